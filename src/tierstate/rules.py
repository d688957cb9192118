"""The math of each optimizer as an update rule, apart from where its state lives.

A rule names its state (torch's key names), checks its hyper-parameters, and updates one
contiguous piece of one parameter through a kernel of :mod:`tierstate.kernels`. It never
sees a tier, a file or a sub-group: the step pipeline hands it flat views.

Two ways in, one piece of math each:

- :meth:`UpdateRule.update`: host pieces, through the native kernels (``ops=kernels``);
  the same call with ``ops=kernels.reference`` runs the pure-torch twin on any device.
- :meth:`UpdateRule.update_on_device`: all pieces of one parameter group that live on an
  accelerator (the device tier), in one batch: Adam/AdamW through torch's fused
  multi-tensor kernel (``torch._fused_adam_`` / ``torch._fused_adamw_``), the others
  through the pure-torch reference of their kernel (elementwise torch ops, so they run
  wherever the tensors are).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor

from . import kernels
from .kernels import reference


@dataclass(frozen=True)
class StateSpec:
    """One per-element state tensor of a rule."""

    name: str  # torch's key in optimizer.state[p]
    init: float = 0.0  # value it starts from (Adagrad's initial_accumulator_value)
    moment: bool = True  # stored in Offload.moment_dtype (else always fp32)


@dataclass(frozen=True)
class UpdateTask:
    """One contiguous piece of one parameter, all its tensors on one device (device tier)."""

    weight: Tensor  # fp32: the master, or the fp32 parameter itself
    grad: Tensor  # same numel; any supported dtype; only read
    state: Mapping[str, Tensor]  # the rule's state keys -> same-numel views
    weight_out: Tensor | None  # the parameter's own piece when ``weight`` is a master (written rounded)
    step: int  # the parameter's step count, this step included
    first_step: bool  # its state was created for this step (SGD's momentum starts from the gradient)


def _as_float(value: Any) -> float:
    return float(value.item()) if isinstance(value, Tensor) else float(value)


# torch.optim's own words for a hyper-parameter out of range ("Invalid learning rate: -1"), which
# tierstate's messages start with, so that code and tests matching torch's errors match these
TORCH_WORDS = {
    "lr": "Invalid learning rate",
    "eps": "Invalid epsilon value",
    "betas[0]": "Invalid beta parameter at index 0",
    "betas[1]": "Invalid beta parameter at index 1",
    "weight_decay": "Invalid weight_decay value",
    "momentum": "Invalid momentum value",
    "lr_decay": "Invalid lr_decay value",
    "initial_accumulator_value": "Invalid initial_accumulator_value value",
}


def _check_number(name: str, value: Any, *, low: float | None = None, low_open: bool = False,
                  high: float | None = None, high_open: bool = False, hint: str = "") -> None:
    """A finite real number (or one-element tensor) in the given range; inf and nan never are."""
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"Tensor {name} must be 1-element, got a tensor of shape {tuple(value.shape)}: give "
                             f"{name} as a number or a one-element tensor")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    v = float(value)
    bad = not math.isfinite(v)
    if low is not None:
        bad |= v <= low if low_open else v < low
    if high is not None:
        bad |= v >= high if high_open else v > high
    if bad:
        lo = "" if low is None else ("(" if low_open else "[") + f"{low:g}"
        hi = "" if high is None else f"{high:g}" + (")" if high_open else "]")
        if lo and hi:
            rng = f" in {lo}, {hi}"
        elif lo:
            rng = f" >{'' if low_open else '='} {low:g}"
        elif hi:
            rng = f" <{'' if high_open else '='} {high:g}"
        else:
            rng = ""
        words = TORCH_WORDS.get(name, f"Invalid {name}")
        raise ValueError(f"{words}: {value} ({name} must be a finite number{rng}{hint})")


def _check_flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")


# torch's implementation switches, carried in param_groups as given (torch code and
# torch.distributed.checkpoint expect the keys). ``foreach`` and ``fused`` choose how torch
# computes, not what: tierstate always runs its own fused kernel (one pass over each element of
# the state: native on the host tiers, torch's fused/elementwise kernels on the device tier), so
# either may be True, as code written for torch passes them (torch refuses both True at once,
# and so does tierstate). ``capturable`` and ``differentiable`` ask for what tierstate cannot
# do: True is refused with why.
SPEED_HINTS = ("foreach", "fused")
# the switches refused when True, with why
REFUSED_FLAGS = {
    "capturable": "the step count lives on the host, as with capturable=False, and the state streams through host "
                  "memory, so step() cannot be captured in a CUDA graph: leave capturable False",
    "differentiable": "tierstate updates the parameters in place under torch.no_grad() from offloaded state, so "
                      "autograd cannot differentiate through step(): leave differentiable False",
}


def check_implementation_flags(owner: str, group: Mapping[str, Any], keys: Sequence[str]) -> None:
    """Refuse a torch implementation switch that asks for what tierstate does not do."""
    for key in keys:
        if key not in group:
            continue
        value = group[key]
        if value is None or value is False or (value is True and key in SPEED_HINTS):
            continue
        if value is True:
            raise ValueError(f"{owner}({key}=True): {REFUSED_FLAGS[key]}")
        taken = "None, False or True" if key in SPEED_HINTS else "None or False"
        raise TypeError(f"{owner}({key}={value!r}): must be None, False or True (and tierstate takes {taken})")
    if all(group.get(k) is True for k in SPEED_HINTS) and all(k in keys for k in SPEED_HINTS):
        raise RuntimeError("`fused` and `foreach` cannot be `True` together.")  # torch's words


def _scaled_fp32(grad: Tensor, grad_scale: float) -> Tensor:
    """``fp32(grad) * grad_scale`` as the kernels compute it; the gradient itself when that is it."""
    g = grad if grad.dtype == torch.float32 else grad.float()
    if grad_scale != 1.0:
        g = g * grad_scale if g is grad else g.mul_(grad_scale)
    return g


def _check_betas(betas: Any, n: int = 2) -> None:
    if not isinstance(betas, (tuple, list)) or len(betas) != n:
        raise ValueError(f"Invalid betas: {betas!r}; give a tuple of {n} numbers in [0, 1), e.g. (0.9, 0.999)")
    if len({isinstance(b, Tensor) for b in betas}) > 1:
        raise ValueError(f"betas must be either both floats or both Tensors, got {betas!r}: give numbers, or "
                         "one-element tensors")
    for i, b in enumerate(betas):
        _check_number(f"betas[{i}]", b, low=0.0, high=1.0, high_open=True)


class UpdateRule:
    """Base of the rules; a rule is stateless and shared by all parameters."""

    name = "rule"
    torch_name = "Optimizer"  # the torch.optim class whose param-group keys the groups carry
    flags: tuple[str, ...] = ()  # its implementation switches (see SPEED_HINTS, REFUSED_FLAGS)
    # hyper-parameters older torch releases did not save, with the value torch's optimizer
    # (its __setstate__) gives a loaded group that lacks them, whatever it was built with
    added_later: dict[str, Any] = {}
    has_step = True  # keeps a per-parameter 'step' in optimizer.state (torch does, except SGD/Lion)
    eager_state = False  # torch creates the state at construction (Adagrad), not at the first step

    def defaults(self) -> dict:
        raise NotImplementedError

    def required_keys(self) -> dict:
        """The hyper-parameters (with their defaults) a saved param group must carry to be loaded.

        torch's implementation switches, ``decoupled_weight_decay`` and :attr:`added_later` are not
        among them: older torch releases did not save them, and a group that lacks them takes
        torch's values for :attr:`added_later`, this optimizer's for the rest.
        """
        return {k: v for k, v in self.defaults().items()
                if k not in self.flags and k != "decoupled_weight_decay" and k not in self.added_later}

    def validate(self, group: Mapping[str, Any]) -> None:
        """Raise ValueError/TypeError naming the first bad hyper-parameter of ``group``."""
        _check_number("lr", group["lr"], low=0.0, hint=" (a learning rate is a step size)")
        _check_flag("maximize", group["maximize"])
        check_implementation_flags(self.torch_name, group, self.flags)

    def state_specs(self, group: Mapping[str, Any]) -> tuple[StateSpec, ...]:
        raise NotImplementedError

    def update(self, *, weight: Tensor, grad: Tensor, state: Mapping[str, Tensor], weight_out: Tensor | None,
               group: Mapping[str, Any], step: int, first_step: bool, grad_scale: float, ops=kernels) -> None:
        """Update one piece in place. ``ops`` is the kernel namespace: :mod:`tierstate.kernels`
        (native, CPU tensors) or :mod:`tierstate.kernels.reference` (pure torch, any device)."""
        raise NotImplementedError

    def update_on_device(self, tasks: Sequence[UpdateTask], *, group: Mapping[str, Any], grad_scale: float) -> None:
        """Update the device-tier pieces of one parameter group (every tensor on one device).

        The default runs the pure-torch reference of the rule's kernel piece by piece: the
        same formulas as the native kernel, in torch ops, so on CUDA they are queued on the
        current stream and return before they ran.
        """
        for t in tasks:
            self.update(weight=t.weight, grad=t.grad, state=t.state, weight_out=t.weight_out, group=group,
                        step=t.step, first_step=t.first_step, grad_scale=grad_scale, ops=reference)

    def sparse_refusal(self, group: Mapping[str, Any]) -> str | None:
        """Why a sparse gradient (``nn.Embedding(sparse=True)``) cannot be stepped under ``group``,
        or None when it can. The engine reads it densified: its rows without a gradient are zeros,
        which leave those rows as they were only for the rules that say so (SGD, Adagrad, as
        torch's sparse paths do); the others refuse it as their torch namesakes do."""
        return f"{self.torch_name} does not support sparse gradients"

    def zero_step_is_noop(self, group: Mapping[str, Any]) -> bool:
        """True when a first step with all-zero gradients and lr 0 leaves the state at its init.

        L2 weight decay turns a zero gradient into ``wd * w``, which moves the moments.
        """
        return float(group.get("weight_decay", 0.0)) == 0.0

class AdamRule(UpdateRule):
    """Adam and AdamW (torch.optim.Adam / AdamW), incl. amsgrad and maximize."""

    flags = ("foreach", "fused", "capturable", "differentiable")
    added_later = {"amsgrad": False, "maximize": False}

    def __init__(self, decoupled: bool) -> None:
        self.decoupled = decoupled  # the default; a group's ``decoupled_weight_decay`` decides (as torch's Adam)
        self.name = "adamw" if decoupled else "adam"
        self.torch_name = "AdamW" if decoupled else "Adam"

    def defaults(self) -> dict:
        return dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2 if self.decoupled else 0.0,
                    amsgrad=False, maximize=False, foreach=None, capturable=False, differentiable=False,
                    fused=None, decoupled_weight_decay=self.decoupled)

    def sparse_refusal(self, group):
        return f"{self.torch_name} does not support sparse gradients, please consider SparseAdam instead"

    def is_decoupled(self, group: Mapping[str, Any]) -> bool:
        return bool(group.get("decoupled_weight_decay", self.decoupled))

    def validate(self, group):
        super().validate(group)
        _check_betas(group["betas"])
        _check_number("eps", group["eps"], low=0.0, hint=" (e.g. 1e-8)")
        _check_number("weight_decay", group["weight_decay"], low=0.0)
        _check_flag("amsgrad", group["amsgrad"])
        if "decoupled_weight_decay" in group:
            _check_flag("decoupled_weight_decay", group["decoupled_weight_decay"])
        if group.get("foreach") is True and not group.get("capturable"):
            # torch's foreach path cannot take them, and its Adam refuses the pair: so does this one,
            # so that code moves between the two with the same errors
            for name, value in (("lr", group["lr"]), ("betas[0]", group["betas"][0]), ("betas[1]", group["betas"][1])):
                if isinstance(value, Tensor):
                    raise ValueError(f"{name} as a Tensor is not supported for capturable=False and foreach=True")

    def zero_step_is_noop(self, group):
        return self.is_decoupled(group) or super().zero_step_is_noop(group)

    def state_specs(self, group):
        specs = (StateSpec("exp_avg"), StateSpec("exp_avg_sq"))
        return specs + ((StateSpec("max_exp_avg_sq"),) if group["amsgrad"] else ())

    def _hyper(self, group, step, grad_scale) -> dict:
        beta1, beta2 = (_as_float(b) for b in group["betas"])
        return dict(lr=_as_float(group["lr"]), beta1=beta1, beta2=beta2, eps=_as_float(group["eps"]),
                    weight_decay=_as_float(group["weight_decay"]), decoupled=self.is_decoupled(group),
                    # float64 bias corrections, as torch's single-tensor and fused paths compute them
                    bias_correction1=1 - beta1**step, bias_correction2=1 - beta2**step,
                    maximize=bool(group["maximize"]), grad_scale=grad_scale)

    def update(self, *, weight, grad, state, weight_out, group, step, first_step, grad_scale, ops=kernels):
        ops.adam_update(weight, grad, state["exp_avg"], state["exp_avg_sq"], state.get("max_exp_avg_sq"), weight_out,
                        **self._hyper(group, step, grad_scale))

    def batch_params(self, group, step, grad_scale) -> list[float]:
        """The hyper-parameter row of :func:`tierstate.kernels.adam_update_many` for a piece
        ``update`` would update with these arguments (the same floats)."""
        h = self._hyper(group, step, grad_scale)
        return [float(h["lr"]), float(h["beta1"]), float(h["beta2"]), float(h["eps"]), float(h["weight_decay"]),
                float(bool(h["decoupled"])), float(h["bias_correction1"]), float(h["bias_correction2"]),
                float(h["maximize"]), float(h["grad_scale"])]

    def update_q8(self, *, state, grad, weight_out, group, step, grad_scale, config, seed, index_offset,
                  reference_path: bool = False):
        """Update one piece of compressed state in place (``Offload(moment_dtype="q8")``): the
        fused 8-bit kernel (:func:`tierstate.kernels.adam_q8_update`), or with
        ``reference_path`` its pure-torch twin. ``state`` holds the named parts of
        :meth:`tierstate.kernels.quant.QuantConfig.state_spec`, ``master`` included."""
        if group["amsgrad"]:
            raise ValueError("amsgrad=True with Offload(moment_dtype='q8'): the 8-bit kernels keep no "
                             "max_exp_avg_sq; set amsgrad=False or use moment_dtype=torch.float32")
        beta1, beta2 = (_as_float(b) for b in group["betas"])
        kwargs = dict(config=config, lr=_as_float(group["lr"]), beta1=beta1, beta2=beta2, eps=_as_float(group["eps"]),
                      weight_decay=_as_float(group["weight_decay"]), decoupled=self.is_decoupled(group),
                      bias_correction1=1 - beta1**step, bias_correction2=1 - beta2**step,
                      maximize=bool(group["maximize"]), grad_scale=grad_scale, seed=seed, step=step,
                      index_offset=index_offset)
        if reference_path:
            from .kernels.quant import adam_q8_reference  # noqa: PLC0415

            adam_q8_reference(state, grad, weight_out, **kwargs)
        else:
            kernels.adam_q8_update(state, grad, weight_out, **kwargs)

    def update_on_device(self, tasks, *, group, grad_scale):
        """torch's fused Adam/AdamW kernel over every piece at once (one multi-tensor launch).

        The fused kernel wants every tensor in fp32 (it rejects bf16 moments), so with
        ``Offload(moment_dtype=torch.bfloat16)`` the reference path runs instead. The
        gradient is handed over as ``fp32(grad) * grad_scale``, the very value the native
        kernels compute with, rather than through the kernel's own ``grad_scale`` argument,
        which divides by the scale (a different rounding) and writes the unscaled gradient
        back into ``param.grad``.
        """
        if not tasks:
            return
        if any(v.dtype != torch.float32 for v in tasks[0].state.values()):
            return super().update_on_device(tasks, group=group, grad_scale=grad_scale)
        beta1, beta2 = (_as_float(b) for b in group["betas"])
        device = tasks[0].weight.device
        # torch keeps each step in a float32 tensor on the parameter's device for its fused path;
        # the kernel computes the bias corrections from it (one copy for all pieces).
        steps = torch.tensor([float(t.step) for t in tasks], dtype=torch.float32).to(device).unbind(0)
        fused = torch._fused_adamw_ if self.is_decoupled(group) else torch._fused_adam_
        amsgrad = bool(group["amsgrad"])
        fused([t.weight for t in tasks], [_scaled_fp32(t.grad, grad_scale) for t in tasks],
              [t.state["exp_avg"] for t in tasks], [t.state["exp_avg_sq"] for t in tasks],
              [t.state["max_exp_avg_sq"] for t in tasks] if amsgrad else [], list(steps),
              lr=_as_float(group["lr"]), beta1=beta1, beta2=beta2, weight_decay=_as_float(group["weight_decay"]),
              eps=_as_float(group["eps"]), amsgrad=amsgrad, maximize=bool(group["maximize"]))
        for t in tasks:
            if t.weight_out is not None:
                t.weight_out.copy_(t.weight)  # rounds to nearest even, as the native kernels' weight_out

class LionRule(UpdateRule):
    """Lion (Chen et al. 2023); no torch namesake, parity is against the published algorithm."""

    name = "lion"
    torch_name = "Lion"
    has_step = False

    def defaults(self):
        return dict(lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, maximize=False)

    def validate(self, group):
        super().validate(group)
        _check_betas(group["betas"])
        _check_number("weight_decay", group["weight_decay"], low=0.0)

    def zero_step_is_noop(self, group):
        return True  # decoupled weight decay times lr 0

    def state_specs(self, group):
        return (StateSpec("exp_avg"),)

    def update(self, *, weight, grad, state, weight_out, group, step, first_step, grad_scale, ops=kernels):
        beta1, beta2 = (_as_float(b) for b in group["betas"])
        ops.lion_update(weight, grad, state["exp_avg"], weight_out, lr=_as_float(group["lr"]),
                            beta1=beta1, beta2=beta2, weight_decay=_as_float(group["weight_decay"]),
                            maximize=bool(group["maximize"]), grad_scale=grad_scale)

class SGDRule(UpdateRule):
    """SGD with momentum, dampening and Nesterov (torch.optim.SGD)."""

    name = "sgd"
    torch_name = "SGD"
    flags = ("foreach", "fused", "differentiable")
    added_later = {"nesterov": False, "maximize": False}
    has_step = False

    def defaults(self):
        return dict(lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False,
                    foreach=None, differentiable=False, fused=None)

    def validate(self, group):
        super().validate(group)
        _check_number("momentum", group["momentum"], low=0.0)
        _check_number("dampening", group["dampening"])  # any finite value, as torch (which checks none)
        _check_number("weight_decay", group["weight_decay"], low=0.0)
        _check_flag("nesterov", group["nesterov"])
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError(
                "Nesterov momentum requires a momentum and zero dampening (torch's words): nesterov=True needs "
                f"momentum > 0 and dampening == 0 (got momentum={group['momentum']}, dampening={group['dampening']})"
            )

    def state_specs(self, group):
        return (StateSpec("momentum_buffer"),) if group["momentum"] != 0 else ()

    def sparse_refusal(self, group):
        # A zero row leaves its parameter and momentum as torch's sparse path does (the buffer's
        # rows outside every gradient so far are zero). Weight decay would add wd * w to every
        # row, which torch's sparse path cannot do (add(sparse, dense) raises there).
        if float(group["weight_decay"]) != 0.0:
            return ("SGD with weight_decay and sparse gradients: torch's SGD cannot add the decay to a sparse "
                    "gradient; set weight_decay=0 for the parameters with sparse gradients (a param group of their own)")
        return None

    def update(self, *, weight, grad, state, weight_out, group, step, first_step, grad_scale, ops=kernels):
        ops.sgd_update(weight, grad, state.get("momentum_buffer"), weight_out, lr=_as_float(group["lr"]),
                           momentum=float(group["momentum"]), dampening=float(group["dampening"]),
                           weight_decay=float(group["weight_decay"]), nesterov=bool(group["nesterov"]),
                           maximize=bool(group["maximize"]), first_step=first_step, grad_scale=grad_scale)

class AdagradRule(UpdateRule):
    """Adagrad (torch.optim.Adagrad), incl. lr_decay and initial_accumulator_value.

    ``defaults``: the optimizer's defaults (the dict torch keeps as ``optimizer.defaults``),
    whose ``initial_accumulator_value`` every ``sum`` starts from, as in torch: its
    ``__init__`` fills the sums from its own argument and ``_init_group`` from
    ``self.defaults``, never from a param group's value (which the group keeps). Without it
    (a rule not bound to an optimizer: ``tierstate plan``), the group's value."""

    name = "adagrad"
    torch_name = "Adagrad"
    flags = ("foreach", "fused", "differentiable")
    added_later = {"maximize": False}
    eager_state = True

    def __init__(self, defaults: Mapping[str, Any] | None = None) -> None:
        self.bound_defaults = defaults

    def defaults(self):
        return dict(lr=1e-2, lr_decay=0.0, weight_decay=0.0, initial_accumulator_value=0.0, eps=1e-10,
                    foreach=None, maximize=False, differentiable=False, fused=None)

    def validate(self, group):
        super().validate(group)
        _check_number("lr_decay", group["lr_decay"], low=0.0)
        _check_number("weight_decay", group["weight_decay"], low=0.0)
        _check_number("initial_accumulator_value", group["initial_accumulator_value"], low=0.0)
        _check_number("eps", group["eps"], low=0.0, hint=" (e.g. 1e-10)")

    def state_specs(self, group):
        return (StateSpec("sum", init=float(self.initial_accumulator_value(group))),)

    def initial_accumulator_value(self, group: Mapping[str, Any]) -> float:
        """What the sums of ``group``'s parameters start from (see the class docstring)."""
        source = self.bound_defaults if self.bound_defaults is not None else group
        return source["initial_accumulator_value"]

    def sparse_refusal(self, group):
        # A zero row adds 0 to its sum and 0 / (sqrt(sum) + eps) to its parameter: unchanged, as
        # torch's sparse path leaves it, as long as eps > 0 (with eps 0 and a sum of 0, 0 / 0).
        if float(group["weight_decay"]) != 0.0:
            return ("weight_decay option is not compatible with sparse gradients (as in torch's Adagrad); set "
                    "weight_decay=0 for the parameters with sparse gradients (a param group of their own)")
        if float(group["eps"]) == 0.0:
            return ("Adagrad with eps=0 and sparse gradients: the rows without a gradient would divide 0 by 0 in "
                    "the dense update tierstate runs; use eps > 0 (torch's default is 1e-10)")
        return None

    def update(self, *, weight, grad, state, weight_out, group, step, first_step, grad_scale, ops=kernels):
        lr = _as_float(group["lr"])
        clr = lr / (1 + (step - 1) * float(group["lr_decay"]))
        ops.adagrad_update(weight, grad, state["sum"], weight_out, clr=clr,
                               weight_decay=float(group["weight_decay"]), eps=float(group["eps"]),
                               maximize=bool(group["maximize"]), grad_scale=grad_scale)
