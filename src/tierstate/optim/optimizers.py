"""The public optimizers: torch's names and arguments, one shared offload engine.

Each class only names its rule and its arguments; everything else is
:class:`~tierstate.optim.base.OffloadOptimizer` (the torch face) and :mod:`tierstate.pipeline`
(the step).
"""
from __future__ import annotations

import warnings
from typing import Iterable

from ..placement import Offload
from .base import OffloadOptimizer
from ..rules import AdagradRule, AdamRule, LionRule, SGDRule

_ENGINE_ARGS = """
    Offload arguments (shared by every tierstate optimizer):
        offload: ``"cpu"`` (default: state in host RAM), ``"nvme"`` (state in files), ``"auto"``
            (the planner picks from the measured hardware) or a :class:`tierstate.Offload`.
            With CPU parameters and all state in RAM the optimizer also keeps host memory that
            torch frees for reuse (process-wide; ``Offload(host_allocator=...)`` and
            :mod:`tierstate.host_allocator` say why and how to opt out).
        max_grad_norm: clip the global gradient norm, computed over every tier, to this value
            (as ``torch.nn.utils.clip_grad_norm_``, which cannot see offloaded gradients).
        on_nonfinite: ``"skip"`` (default: a step with an inf/nan gradient is skipped, every state
            untouched, a warning logged and ``skipped_steps`` counted) or ``"raise"``
            (``FloatingPointError``). With a ``torch.amp.GradScaler`` the scaler decides.
        telemetry: record per-step stats (``opt.stats()``); cheap, on by default.
        nvme_dir: shorthand for ``Offload(nvme_dir=...)``: the folder (or list of folders, one per
            drive) of the NVMe tier, with ``offload="nvme"`` or an ``Offload`` that has an NVMe part
            and no ``nvme_dir`` of its own (refused where no state would go there, or with
            ``"auto"``, whose disk budget is measured at :func:`tierstate.placement.default_nvme_root`).
        step_in_backward: update each sub-group during backward as soon as every gradient in
            it is final (on CPU parameters on the backward thread itself, on accelerators on a
            worker thread), so the NVMe I/O overlaps forward and backward (default False). Bit for
            bit the plain step, also with ``max_grad_norm``, a GradScaler and gradient accumulation
            (a constant number of ``backward()`` calls per ``step()``): the updates are then
            speculative and rolled back when clipping, an overflow or a scale change demands it
            (``rollbacks`` counts them), at the cost of a host copy of the state they touch.
            Without those, a non-finite gradient raises instead of skipping the step. See
            docs/step_modes.md and :mod:`tierstate.pipeline.backward`.

    torch's implementation switches (``foreach``, ``fused``, ``capturable``, ``differentiable``,
    where the torch namesake has them) are carried in ``param_groups`` under torch's keys, so
    torch code and ``torch.distributed.checkpoint`` move state between this optimizer and its
    torch namesake. ``foreach`` and ``fused`` may be True (not both, as in torch): they choose
    how torch computes, and tierstate always runs its own fused kernels. ``capturable=True`` and
    ``differentiable=True`` are refused with why.

    Parameters, as torch takes them: float32 (its own master), bfloat16 and float16 (an fp32
    master in the tiers, rounded into the parameter after each update), float64 (float64 state
    and torch's own float64 math; beside narrower parameters the state stays in host RAM),
    complex64 and complex128 (stepped as their real views, torch's complex state shown). A
    tensor is stepped when its ``.grad`` is set, whatever its ``requires_grad``, as in torch.

    What ``optimizer.state[p]`` holds (see [Note: what optimizer.state holds] in
    :mod:`tierstate.optim.state_view`): ``step`` (a CPU float32 tensor, as torch's) and, for a
    parameter whose state lives wholly in host RAM, views of that state under torch's keys:
    writing into them changes the state. State held elsewhere (NVMe, the device tier, or a
    parameter straddling tiers) is not listed when the dict is iterated (frameworks iterate it
    to move tensors, which must not read the NVMe tier; ``in`` answers for the listed keys), but
    ``optimizer.state[p]["exp_avg"]`` and ``.get`` read it on demand into a new CPU tensor: a copy, whose changes do not
    reach the state (use ``load_state_dict`` to change it).
"""


def _engine_kwargs(offload, max_grad_norm, on_nonfinite, telemetry, step_in_backward, nvme_dir) -> dict:
    return dict(offload=offload, max_grad_norm=max_grad_norm, on_nonfinite=on_nonfinite, telemetry=telemetry,
                step_in_backward=step_in_backward, nvme_dir=nvme_dir)


class Adam(OffloadOptimizer):
    __doc__ = """Adam with offloaded state; the math of ``torch.optim.Adam`` (L2 weight decay).

    Args:
        params, lr, betas, eps, weight_decay, amsgrad, maximize, decoupled_weight_decay: as
            ``torch.optim.Adam`` (``decoupled_weight_decay=True`` is AdamW's math).
        foreach, fused, capturable, differentiable: torch's implementation switches (see below).
""" + _ENGINE_ARGS

    rule = AdamRule(decoupled=False)

    def __init__(self, params: Iterable, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False, *, foreach: bool | None = None,
                 maximize: bool = False, capturable: bool = False, differentiable: bool = False,
                 fused: bool | None = None, decoupled_weight_decay: bool = False,
                 offload: "str | Offload" = "cpu", max_grad_norm: float | None = None,
                 on_nonfinite: str = "skip", telemetry: bool = True,
                 step_in_backward: bool = False, nvme_dir=None) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
                        foreach=foreach, capturable=capturable, differentiable=differentiable, fused=fused,
                        decoupled_weight_decay=decoupled_weight_decay)
        super().__init__(params, defaults, **_engine_kwargs(offload, max_grad_norm, on_nonfinite, telemetry,
                                                          step_in_backward, nvme_dir))


class AdamW(OffloadOptimizer):
    __doc__ = """AdamW with offloaded state; the math of ``torch.optim.AdamW`` (decoupled weight decay).

    Example::

        opt = tierstate.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                              offload="cpu")
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)

    Args:
        params, lr, betas, eps, weight_decay, amsgrad, maximize: as ``torch.optim.AdamW``.
        foreach, fused, capturable, differentiable: torch's implementation switches (see below).
""" + _ENGINE_ARGS

    rule = AdamRule(decoupled=True)

    def __init__(self, params: Iterable, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, capturable: bool = False, differentiable: bool = False,
                 fused: bool | None = None,
                 offload: "str | Offload" = "cpu", max_grad_norm: float | None = None,
                 on_nonfinite: str = "skip", telemetry: bool = True,
                 step_in_backward: bool = False, nvme_dir=None) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
                        foreach=foreach, capturable=capturable, differentiable=differentiable, fused=fused,
                        decoupled_weight_decay=True)
        super().__init__(params, defaults, **_engine_kwargs(offload, max_grad_norm, on_nonfinite, telemetry,
                                                          step_in_backward, nvme_dir))


class SGD(OffloadOptimizer):
    __doc__ = """SGD with optional (Nesterov) momentum; the math of ``torch.optim.SGD``.

    Sparse gradients (``nn.Embedding(sparse=True)``) are taken as torch's SGD takes them,
    without weight decay (see ``UpdateRule.sparse_refusal``).

    Args:
        params, lr, momentum, dampening, weight_decay, nesterov, maximize: as ``torch.optim.SGD``.
        foreach, fused, differentiable: torch's implementation switches (see below).
""" + _ENGINE_ARGS

    rule = SGDRule()

    def __init__(self, params: Iterable, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, differentiable: bool = False, fused: bool | None = None,
                 offload: "str | Offload" = "cpu", max_grad_norm: float | None = None,
                 on_nonfinite: str = "skip", telemetry: bool = True,
                 step_in_backward: bool = False, nvme_dir=None) -> None:
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=nesterov, maximize=maximize, foreach=foreach, differentiable=differentiable,
                        fused=fused)
        super().__init__(params, defaults, **_engine_kwargs(offload, max_grad_norm, on_nonfinite, telemetry,
                                                          step_in_backward, nvme_dir))


class Lion(OffloadOptimizer):
    __doc__ = """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms").

    ``update = sign(beta1*m + (1-beta1)*g)``; ``w = w*(1 - lr*wd) - lr*update``;
    ``m = beta2*m + (1-beta2)*g``. State key: ``exp_avg``.

    Args:
        params, lr (default 1e-4), betas (default (0.9, 0.99)), weight_decay, maximize.
""" + _ENGINE_ARGS

    rule = LionRule()

    def __init__(self, params: Iterable, lr: float = 1e-4, betas=(0.9, 0.99), weight_decay: float = 0.0, *,
                 maximize: bool = False, offload: "str | Offload" = "cpu", max_grad_norm: float | None = None,
                 on_nonfinite: str = "skip", telemetry: bool = True,
                 step_in_backward: bool = False, nvme_dir=None) -> None:
        defaults = dict(lr=lr, betas=betas, weight_decay=weight_decay, maximize=maximize)
        super().__init__(params, defaults, **_engine_kwargs(offload, max_grad_norm, on_nonfinite, telemetry,
                                                          step_in_backward, nvme_dir))


class Adagrad(OffloadOptimizer):
    __doc__ = """Adagrad; the math of ``torch.optim.Adagrad`` (state ``step`` and ``sum`` from construction).

    Sparse gradients (``nn.Embedding(sparse=True)``) are taken as torch's Adagrad takes them,
    without weight decay and with ``eps > 0`` (see ``UpdateRule.sparse_refusal``).

    Args:
        params, lr, lr_decay, weight_decay, initial_accumulator_value, eps, maximize: as
        ``torch.optim.Adagrad``. As there, every ``sum`` starts from this
        ``initial_accumulator_value``; a param group's own value is kept in the group and not
        used (tierstate warns about it; torch does not).
        foreach, fused, differentiable: torch's implementation switches (see below).
""" + _ENGINE_ARGS

    rule = AdagradRule()

    def __init__(self, params: Iterable, lr: float = 1e-2, lr_decay: float = 0.0, weight_decay: float = 0.0,
                 initial_accumulator_value: float = 0.0, eps: float = 1e-10, foreach: bool | None = None, *,
                 maximize: bool = False, differentiable: bool = False, fused: bool | None = None,
                 offload: "str | Offload" = "cpu", max_grad_norm: float | None = None,
                 on_nonfinite: str = "skip", telemetry: bool = True,
                 step_in_backward: bool = False, nvme_dir=None) -> None:
        defaults = dict(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
                        initial_accumulator_value=initial_accumulator_value, eps=eps, foreach=foreach,
                        maximize=maximize, differentiable=differentiable, fused=fused)
        self.rule = AdagradRule(defaults)  # torch keeps this dict as self.defaults: the sums start from it
        super().__init__(params, defaults, **_engine_kwargs(offload, max_grad_norm, on_nonfinite, telemetry,
                                                          step_in_backward, nvme_dir))

    def add_param_group(self, param_group: dict) -> None:
        """As torch's; a group whose own ``initial_accumulator_value`` differs from the
        optimizer's is warned about: its sums start from the optimizer's, as in torch's Adagrad
        (which says nothing), and the group keeps its value."""
        own = param_group.get("initial_accumulator_value") if isinstance(param_group, dict) else None
        start = self.defaults["initial_accumulator_value"]
        if own is not None and own != start:
            warnings.warn(f"Adagrad: param group {len(self.param_groups)} sets initial_accumulator_value={own}, but "
                          f"every sum starts at the optimizer's initial_accumulator_value={start}, as in "
                          "torch.optim.Adagrad; pass the value to the constructor (a separate Adagrad per value)",
                          UserWarning, stacklevel=2)
        super().add_param_group(param_group)
