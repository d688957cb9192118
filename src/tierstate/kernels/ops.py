"""The kernel faces: validate tensors, then run the native kernel (or the reference).

Signatures and semantics are those of ``reference.py`` (the kernel contract is in its
docstring). Each face checks its tensors (CPU, contiguous, equal ``numel``, allowed
dtypes) and raises TypeError/ValueError naming the argument, then hands the native
kernel raw data pointers, the element count, dtype codes and the hyper-parameters;
the kernel runs with the GIL released. Without the native module (or with
``set_isa("reference")``) the same call runs the pure-torch reference.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import quant, reference
from .backend import native_kernels

_F32, _BF16, _F16, _NONE = 0, 1, 2, 3
_GRAD_DTYPES = {torch.float32: _F32, torch.bfloat16: _BF16, torch.float16: _F16}
_MOMENT_DTYPES = {torch.float32: _F32, torch.bfloat16: _BF16}
_OUT_DTYPES = {torch.bfloat16: _BF16, torch.float16: _F16}


def _names(codes: dict) -> str:
    return "/".join(str(d).removeprefix("torch.") for d in codes)


def _check(op: str, name: str, t: object, n: int) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{op}: {name} is on {t.device}; the host kernels need CPU tensors (use .cpu())")
    if not t.is_contiguous():
        raise ValueError(f"{op}: {name} must be contiguous (pass {name}.contiguous() or a flat view)")
    if t.numel() != n:
        raise ValueError(f"{op}: {name} has {t.numel()} elements but weight has {n}; all tensors must match")
    return t


def _weight(op: str, weight: object) -> int:
    if not isinstance(weight, Tensor):
        raise TypeError(f"{op}: weight must be a torch.Tensor, got {type(weight).__name__}")
    n = weight.numel()
    _check(op, "weight", weight, n)
    if weight.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"{op}: weight must be float32 (the fp32 master) or float64, got {weight.dtype}")
    return n


def _float64(op: str, n: int, grad: object, weight_out: object, **state: Tensor | None) -> None:
    """Check the tensors of a float64 update: the gradient and the state are float64 too (torch
    keeps a float64 parameter's state in float64), and no rounded copy is asked for (a float64
    parameter is its own master). Such updates run the reference, torch's own float64 ops:
    float64 parameters are rare enough (numerical work, torch's tests) that their speed is
    torch's, while their state still lives in tierstate's tiers."""
    for name, t in (("grad", grad), *state.items()):
        if t is None:
            continue
        _check(op, name, t, n)
        if t.dtype != torch.float64:
            raise TypeError(f"{op}: weight is float64 but {name} is {t.dtype}; a float64 update takes float64 "
                            f"{name} (cast it with .double())")
    if weight_out is not None:
        raise TypeError(f"{op}: weight is float64, which is its own master: pass weight_out=None")


def _faced(op: str, weight: object, grad: object, weight_out: object, **state: Tensor | None) -> tuple:
    """Check the tensors of one update; return ``(native kernels, or None for the reference,
    grad code, moment code, weight_out address, weight_out code)``. A float64 update runs the
    reference (see :func:`_float64`)."""
    n = _weight(op, weight)
    if weight.dtype == torch.float64:
        _float64(op, n, grad, weight_out, **state)
        return None, 0, 0, 0, _NONE
    g = _grad(op, grad, n)
    m = _moments(op, n, **state)
    out_ptr, o = _out(op, weight_out, n)
    return native_kernels(), g, m, out_ptr, o


def _dtype_code(op: str, name: str, t: Tensor, codes: dict) -> int:
    code = codes.get(t.dtype)
    if code is None:
        raise TypeError(f"{op}: {name} has dtype {t.dtype}; allowed: {_names(codes)}")
    return code


def _grad(op: str, grad: object, n: int) -> int:
    return _dtype_code(op, "grad", _check(op, "grad", grad, n), _GRAD_DTYPES)


def _moments(op: str, n: int, **moments: Tensor | None) -> int:
    """Checks the state tensors (None = absent); they must all share one dtype."""
    code = None
    first = ""
    for name, t in moments.items():
        if t is None:
            continue
        c = _dtype_code(op, name, _check(op, name, t, n), _MOMENT_DTYPES)
        if code is None:
            code, first = c, name
        elif c != code:
            raise TypeError(
                f"{op}: {name} is {t.dtype} but {first} is {moments[first].dtype}; "
                "the moments of one tensor must share a dtype"
            )
    return _F32 if code is None else code


def _out(op: str, weight_out: object, n: int) -> tuple[int, int]:
    if weight_out is None:
        return 0, _NONE
    t = _check(op, "weight_out", weight_out, n)
    return t.data_ptr(), _dtype_code(op, "weight_out", t, _OUT_DTYPES)


def _ptr(t: Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def adam_update(
    weight: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    max_exp_avg_sq: Tensor | None = None,
    weight_out: Tensor | None = None,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    bias_correction1: float,
    bias_correction2: float,
    maximize: bool = False,
    grad_scale: float = 1.0,
) -> None:
    """Adam (``decoupled=False``) / AdamW (``decoupled=True``) in place, torch semantics.

    ``weight`` (fp32) and the moments (fp32 or bf16) are updated; ``max_exp_avg_sq``
    enables amsgrad; ``weight_out`` (bf16/fp16) receives the new weight rounded to
    nearest even in the same pass. Bias corrections come from the caller's step count.
    """
    kernels, g, m, out_ptr, o = _faced("adam_update", weight, grad, weight_out, exp_avg=exp_avg,
                                       exp_avg_sq=exp_avg_sq, max_exp_avg_sq=max_exp_avg_sq)
    if kernels is None:
        reference.adam_update(
            weight, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, weight_out, lr=lr, beta1=beta1,
            beta2=beta2, eps=eps, weight_decay=weight_decay, decoupled=decoupled,
            bias_correction1=bias_correction1, bias_correction2=bias_correction2,
            maximize=maximize, grad_scale=grad_scale,
        )
        return
    kernels.adam_update(
        weight.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
        _ptr(max_exp_avg_sq), out_ptr, weight.numel(), g, m, o, float(lr), float(beta1), float(beta2),
        float(eps), float(weight_decay), bool(decoupled), float(bias_correction1),
        float(bias_correction2), bool(maximize), float(grad_scale),
    )


ADAM_JOB_FIELDS = 11    # adam_update_many: ints per job
ADAM_PARAM_FIELDS = 10  # floats per hyper-parameter row


def adam_update_many(jobs: list[int], params: list[float]) -> bool:
    """Many :func:`adam_update` calls in one native call and one pass of the thread pool, or
    nothing (False) where the native kernels do not run (the caller then makes the calls one
    by one, through the reference).

    The step engine's face for models of many tensors, where a call per tensor cost more than
    its update (``benchmarks/many_tensors.py``). It takes raw addresses, so it checks no tensor:
    the caller builds ``jobs`` from tensors it has already checked and holds during the call.
    ``jobs``: per update, ``[weight, grad, exp_avg, exp_avg_sq, max_exp_avg_sq (0: none),
    weight_out (0: none), n, grad dtype code, moment dtype code, out dtype code, row of params]``;
    ``params``: per hyper-parameter set, ``[lr, beta1, beta2, eps, weight_decay, decoupled,
    bias_correction1, bias_correction2, maximize, grad_scale]`` (flags as 0.0 / 1.0). The
    updates are those of :func:`adam_update` bit for bit; they must not overlap.
    """
    if len(jobs) % ADAM_JOB_FIELDS or len(params) % ADAM_PARAM_FIELDS:
        raise ValueError(f"adam_update_many: jobs holds {len(jobs)} ints and params {len(params)} floats; "
                         f"rows are {ADAM_JOB_FIELDS} ints and {ADAM_PARAM_FIELDS} floats")
    kernels = native_kernels()
    if kernels is None:
        return False
    if jobs:
        kernels.adam_update_many(jobs, params)
    return True


# The dtype codes of adam_update_many's jobs: a gradient (fp32/bf16/fp16), the moments
# (fp32/bf16), the rounded weight (bf16/fp16, or NO_OUT).
GRAD_DTYPE_CODES, MOMENT_DTYPE_CODES, OUT_DTYPE_CODES, NO_OUT = _GRAD_DTYPES, _MOMENT_DTYPES, _OUT_DTYPES, _NONE


def lion_update(
    weight: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    weight_out: Tensor | None = None,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    maximize: bool = False,
    grad_scale: float = 1.0,
) -> None:
    """Lion in place (Chen et al. 2023): sign of the interpolated momentum, decoupled decay."""
    kernels, g, m, out_ptr, o = _faced("lion_update", weight, grad, weight_out, exp_avg=exp_avg)
    if kernels is None:
        reference.lion_update(
            weight, grad, exp_avg, weight_out, lr=lr, beta1=beta1, beta2=beta2,
            weight_decay=weight_decay, maximize=maximize, grad_scale=grad_scale,
        )
        return
    kernels.lion_update(
        weight.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(), out_ptr, weight.numel(), g, m, o, float(lr),
        float(beta1), float(beta2), float(weight_decay), bool(maximize), float(grad_scale),
    )


def sgd_update(
    weight: Tensor,
    grad: Tensor,
    momentum_buffer: Tensor | None = None,
    weight_out: Tensor | None = None,
    *,
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    maximize: bool = False,
    first_step: bool = False,
    grad_scale: float = 1.0,
) -> None:
    """SGD in place with optional (Nesterov) momentum, torch semantics.

    ``first_step=True`` starts the momentum buffer at the gradient (torch's clone).
    """
    if momentum != 0 and momentum_buffer is None:
        raise ValueError(f"sgd_update: momentum={momentum} needs a momentum_buffer tensor (or pass momentum=0)")
    kernels, g, m, out_ptr, o = _faced("sgd_update", weight, grad, weight_out, momentum_buffer=momentum_buffer)
    if kernels is None:
        reference.sgd_update(
            weight, grad, momentum_buffer, weight_out, lr=lr, momentum=momentum,
            dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
            maximize=maximize, first_step=first_step, grad_scale=grad_scale,
        )
        return
    kernels.sgd_update(
        weight.data_ptr(), grad.data_ptr(), _ptr(momentum_buffer), out_ptr, weight.numel(), g, m, o, float(lr),
        float(momentum), float(dampening), float(weight_decay), bool(nesterov), bool(maximize),
        bool(first_step), float(grad_scale),
    )


def adagrad_update(
    weight: Tensor,
    grad: Tensor,
    state_sum: Tensor,
    weight_out: Tensor | None = None,
    *,
    clr: float,
    weight_decay: float,
    eps: float,
    maximize: bool = False,
    grad_scale: float = 1.0,
) -> None:
    """Adagrad in place, torch semantics; ``clr = lr / (1 + (step - 1) * lr_decay)``."""
    kernels, g, m, out_ptr, o = _faced("adagrad_update", weight, grad, weight_out, state_sum=state_sum)
    if kernels is None:
        reference.adagrad_update(
            weight, grad, state_sum, weight_out, clr=clr, weight_decay=weight_decay, eps=eps,
            maximize=maximize, grad_scale=grad_scale,
        )
        return
    kernels.adagrad_update(
        weight.data_ptr(), grad.data_ptr(), state_sum.data_ptr(), out_ptr, weight.numel(), g, m, o, float(clr),
        float(weight_decay), float(eps), bool(maximize), float(grad_scale),
    )


def grad_sumsq(grad: Tensor, scale: float = 1.0) -> float:
    """Sum of squares of ``grad * scale`` accumulated in float64; inf/nan propagate.

    For gradient-norm clipping and non-finite detection in one read of the gradient.
    The native result does not depend on the thread count.
    """
    op = "grad_sumsq"
    if not isinstance(grad, Tensor):
        raise TypeError(f"{op}: grad must be a torch.Tensor, got {type(grad).__name__}")
    if grad.dtype == torch.float64:  # summed by torch in float64, as the native kernels sum
        return reference.grad_sumsq(_check(op, "grad", grad, grad.numel()), scale)
    g = _grad(op, grad, grad.numel())
    kernels = native_kernels()
    if kernels is None:
        return reference.grad_sumsq(grad, scale)
    return float(kernels.grad_sumsq(grad.data_ptr(), grad.numel(), g, float(scale)))


# ---- compressed state (tierstate.kernels.quant) ----------------------------------------
_MASTER_CODES = {"fp32": 0, "bf16_kahan": 1, "bf16_sr": 2}


def _map_args(qmap: quant.QuantMap) -> tuple:
    # The tables live as long as the cached map (quant.signed_map / unsigned_map).
    return (qmap.table.data_ptr(), qmap.lut32.data_ptr(), qmap.lut.numel(),
            qmap.lut_shift, qmap.lut_base, qmap.signed, qmap.fp8_mantissa_bits, qmap.top)


def _check_map(op: str, qmap: object) -> quant.QuantMap:
    if not isinstance(qmap, quant.QuantMap):
        raise TypeError(f"{op}: qmap must be a QuantMap (quant.signed_map(), quant.unsigned_map(), "
                        "quant.fp8_signed_map() or quant.fp8_unsigned_map()), "
                        f"got {type(qmap).__name__}")
    return qmap


def _check_typed(op: str, name: str, t: object, n: int, dtype: torch.dtype) -> Tensor:
    _check(op, name, t, n)
    if t.dtype != dtype:
        raise TypeError(f"{op}: {name} has dtype {t.dtype}; it must be {str(dtype).removeprefix('torch.')}")
    return t


def quantize_blockwise(x: Tensor, qmap: quant.QuantMap, block_size: int = quant.DEFAULT_BLOCK_SIZE
                       ) -> tuple[Tensor, Tensor]:
    """Blockwise 8-bit encoding of the fp32 vector ``x``: ``(codes uint8 [n], scale fp32 [blocks])``.

    The encoding is specified in :mod:`tierstate.kernels.quant` and is bit-identical on every
    ISA variant and the reference. An unsigned map encodes ``|x|``.
    """
    op = "quantize_blockwise"
    qmap = _check_map(op, qmap)
    block_size = quant.check_block_size(block_size, f"{op}: block_size")
    if not isinstance(x, Tensor):
        raise TypeError(f"{op}: x must be a torch.Tensor, got {type(x).__name__}")
    n = x.numel()
    _check_typed(op, "x", x, n, torch.float32)
    codes = torch.empty(n, dtype=torch.uint8)
    scale = torch.empty(quant.n_blocks(n, block_size), dtype=torch.float32)
    kernels = native_kernels()
    if kernels is None:
        c, s = quant.quantize_ref(x, qmap, block_size)
        codes.copy_(c)
        scale.copy_(s)
    else:
        kernels.quantize_blockwise(x.data_ptr(), codes.data_ptr(), scale.data_ptr(), n, block_size, _map_args(qmap))
    return codes, scale


def dequantize_blockwise(codes: Tensor, scale: Tensor, qmap: quant.QuantMap,
                         block_size: int = quant.DEFAULT_BLOCK_SIZE) -> Tensor:
    """fp32 values ``table[code] * scale[block]`` of blockwise 8-bit codes."""
    op = "dequantize_blockwise"
    qmap = _check_map(op, qmap)
    block_size = quant.check_block_size(block_size, f"{op}: block_size")
    if not isinstance(codes, Tensor):
        raise TypeError(f"{op}: codes must be a torch.Tensor, got {type(codes).__name__}")
    n = codes.numel()
    _check_typed(op, "codes", codes, n, torch.uint8)
    _check_typed(op, "scale", scale, quant.n_blocks(n, block_size), torch.float32)
    kernels = native_kernels()
    if kernels is None:
        return quant.dequantize_ref(codes, scale, qmap, block_size)
    out = torch.empty(n, dtype=torch.float32)
    kernels.dequantize_blockwise(codes.data_ptr(), scale.data_ptr(), out.data_ptr(), n, block_size,
                                 _map_args(qmap))
    return out


def adam_q8_update(
    state: dict[str, Tensor],
    grad: Tensor,
    weight_out: Tensor | None = None,
    *,
    config: quant.QuantConfig,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    bias_correction1: float,
    bias_correction2: float,
    maximize: bool = False,
    grad_scale: float = 1.0,
    seed: int = 0,
    step: int = 0,
    index_offset: int = 0,
) -> None:
    """Adam / AdamW in place on compressed state (8-bit moments, fp32 or bf16 master).

    ``state`` holds the named flat tensors of ``config.state_spec(n)`` (see
    :mod:`tierstate.kernels.quant`); ``grad`` is fp32/bf16/fp16; ``weight_out`` (bf16/fp16)
    receives the new weight rounded to nearest even. ``seed``, ``step`` and ``index_offset``
    drive the stochastic rounding of ``config.master == "bf16_sr"`` (ignored otherwise).
    """
    op = "adam_q8_update"
    if not isinstance(config, quant.QuantConfig):
        raise TypeError(f"{op}: config must be a tierstate.kernels.quant.QuantConfig, got {type(config).__name__}")
    if not isinstance(state, dict) or "master" not in state:
        raise TypeError(f"{op}: state must be a dict of named tensors (QuantConfig.init_state), got "
                        f"{type(state).__name__}")
    if not isinstance(state["master"], Tensor):
        raise TypeError(f"{op}: state['master'] must be a torch.Tensor, got {type(state['master']).__name__}")
    n = state["master"].numel()
    spec = config.state_spec(n)
    missing = sorted(set(spec) - set(state))
    if missing:
        raise ValueError(f"{op}: state lacks {', '.join(missing)} (config {config}); build it with "
                         "config.init_state(weight)")
    for name, (numel, dtype) in spec.items():
        _check_typed(op, f"state[{name!r}]", state[name], numel, dtype)
    g = _grad(op, grad, n)
    out_ptr, o = _out(op, weight_out, n)
    if isinstance(index_offset, bool) or not isinstance(index_offset, int) or index_offset < 0 \
            or index_offset + n > 2**32:
        raise ValueError(f"{op}: index_offset={index_offset!r} must be an int >= 0 with index_offset + n "
                         f"(n={n}) <= 2**32; give each parameter its own seed instead of a global index")
    key = quant.sr_key(seed, step)
    kernels = native_kernels()
    if kernels is None:
        quant.adam_q8_reference(
            state, grad, weight_out, config=config, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
            weight_decay=weight_decay, decoupled=decoupled, bias_correction1=bias_correction1,
            bias_correction2=bias_correction2, maximize=maximize, grad_scale=grad_scale, seed=seed,
            step=step, index_offset=index_offset,
        )
        return
    comp = state.get("master.comp") if config.master == "bf16_kahan" else None
    kernels.adam_q8_update(
        state["master"].data_ptr(), _ptr(comp), grad.data_ptr(), state[config.codes_key("exp_avg")].data_ptr(),
        state["exp_avg.scale"].data_ptr(), state[config.codes_key("exp_avg_sq")].data_ptr(),
        state["exp_avg_sq.scale"].data_ptr(), out_ptr, n, g, o, _map_args(config.m_map),
        _map_args(config.v_map), float(lr), float(beta1), float(beta2), float(eps),
        float(weight_decay), bool(decoupled), float(bias_correction1), float(bias_correction2),
        bool(maximize), float(grad_scale), config.block_size, _MASTER_CODES[config.master], key,
        index_offset,
    )
