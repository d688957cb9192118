"""Group-wise int8 / int4 storage of a layer's matrices, dequantized when the layer is fetched.

Each row of a weight matrix is cut into groups of ``group`` consecutive values; a group keeps
one float32 scale, ``max|x| / 127`` (int8) or ``max|x| / 7`` (int4), and its values rounded
to ``x / scale``, symmetric around 0 (int4: two per byte, the even index in the low nibble,
stored as ``q + 8``). Stored bytes per value: 1 + 4/group (int8), 0.5 + 4/group (int4): at
group 64, 0.27x / 0.14x of float32, 0.53x / 0.28x of bf16. Vectors (norms, biases) and
matrices whose rows are not a whole number of groups stay as they are.
"""
from __future__ import annotations

import torch
from torch import Tensor

MODES = ("int8", "int4")
DEFAULT_GROUP = 64  # values per scale: 1 + 4/64 B per int8 value, 0.5 + 4/64 per int4 one
_CHUNK = 1 << 22  # values dequantized at a time: 16 MiB of float32 temporaries at most
_QMAX = {"int8": 127, "int4": 7}


LOSSLESS = "lossless"  # bf16 exponents in 4 bits (tierstate.generate.lossless): the same bits back
ALL_MODES = MODES + (LOSSLESS,)


def check_options(compress: str | None, group: int) -> None:
    """ValueError naming the argument when ``compress`` / ``group`` are not a format."""
    if compress is not None and compress not in ALL_MODES:
        raise ValueError(f"compress={compress!r}: expected None, 'int8', 'int4' (quantized: other tokens) or "
                         "'lossless' (bf16 layers on NVMe at 0.75x their bytes, the same tokens)")
    if not isinstance(group, int) or isinstance(group, bool) or group < 2 or group % 2:
        raise ValueError(f"group={group!r}: expected an even int >= 2 (values per quantization scale, e.g. 64)")


def quantizable(shape: tuple[int, ...], dtype: torch.dtype, group: int) -> bool:
    return dtype.is_floating_point and len(shape) == 2 and shape[-1] % group == 0


def _chunk(group: int) -> int:
    """Values per chunk: whole groups (a group of 6 or 100 must not straddle two chunks)."""
    return max(_CHUNK // group, 1) * group


def stored_nbytes(numel: int, mode: str, group: int) -> tuple[int, int]:
    """(bytes of the values, bytes of the scales)."""
    values = numel if mode == "int8" else (numel + 1) // 2
    return values, (numel // group) * 4


def quantize_into(src: Tensor, values: Tensor, scales: Tensor, mode: str, group: int) -> None:
    """``src`` (any float dtype) -> ``values`` (uint8 bytes) and ``scales`` (float32), chunk by chunk."""
    flat = src.reshape(-1)
    qmax = _QMAX[mode]
    chunk = _chunk(group)
    for start in range(0, flat.numel(), chunk):
        x = flat[start:start + chunk].float().view(-1, group)
        s = x.abs().amax(dim=1) / qmax
        s = torch.where(s > 0, s, torch.ones_like(s))
        q = torch.round(x / s[:, None]).clamp_(-qmax - (mode == "int4"), qmax).to(torch.int8).view(-1)
        g0 = start // group
        scales[g0:g0 + s.numel()] = s
        if mode == "int8":
            values[start:start + q.numel()] = q.view(torch.uint8)
        else:
            u = (q + 8).to(torch.uint8)
            values[start // 2:(start + q.numel()) // 2] = u[0::2] | (u[1::2] << 4)


_OUT_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # the native kernels' dtype codes


def dequantize_into(values: Tensor, scales: Tensor, out: Tensor, mode: str, group: int) -> None:
    """The inverse of :func:`quantize_into` into ``out`` (the compute dtype): ``float(code) *
    scale`` in float32, rounded once into ``out``.

    The native kernel (``tierstate._native.kernels.dequantize_groups``, per ISA, on the
    kernel thread pool) writes the same bits as the torch path below, which runs without the
    native module or under ``set_isa("reference")``. A 51.4M-value layer into bf16, 2 threads,
    Xeon, medians of 7 interleaved rounds: int8 9.1 ms (torch path 44.5 ms), int4 8.7 ms (30.3)."""
    from ..kernels.backend import native_kernels  # noqa: PLC0415 - the kernels load lazily

    n = out.numel()
    vn, sn = stored_nbytes(n, mode, group)
    if n % group or values.numel() < vn or scales.numel() < sn // 4:
        raise ValueError(f"dequantize_into: {n} values in groups of {group} need {vn} code bytes and {sn // 4} "
                         f"scales; got {values.numel()} and {scales.numel()}")
    kernels = native_kernels()
    code = _OUT_CODES.get(out.dtype)
    if (kernels is not None and code is not None and out.device.type == "cpu" and out.is_contiguous()
            and values.is_contiguous() and scales.is_contiguous() and values.device.type == "cpu"
            and scales.device.type == "cpu" and scales.dtype == torch.float32 and values.dtype == torch.uint8):
        kernels.dequantize_groups(values.data_ptr(), scales.data_ptr(), out.data_ptr(), n, group,
                                  8 if mode == "int8" else 4, code)
        return
    _dequantize_torch(values, scales, out, mode, group)


def _dequantize_torch(values: Tensor, scales: Tensor, out: Tensor, mode: str, group: int) -> None:
    """:func:`dequantize_into` in torch, chunk by chunk: each chunk is widened into one float32
    buffer, scaled in place and rounded into ``out`` (no temporary per step of the arithmetic:
    a 37.7M-value layer took 11.3-12.2 ms against 19.4-55.4 ms with one, int8, Xeon)."""
    flat = out.reshape(-1)
    chunk = _chunk(group)
    scratch = torch.empty(min(chunk, flat.numel()), dtype=torch.float32)
    for start in range(0, flat.numel(), chunk):
        n = min(chunk, flat.numel() - start)
        q = scratch[:n]
        if mode == "int8":
            q.copy_(values[start:start + n].view(torch.int8))
        else:
            b = values[start // 2:(start + n) // 2]
            q[0::2] = b & 0x0F
            q[1::2] = b >> 4
            q.sub_(8)
        g0 = start // group
        q.view(-1, group).mul_(scales[g0:g0 + n // group, None])
        flat[start:start + n].copy_(q)


def roundtrip(w: Tensor, mode: str, group: int) -> Tensor:
    """``w`` as a compressed store gives it back (quantized, then dequantized to ``w``'s dtype)."""
    numel = w.numel()
    vn, sn = stored_nbytes(numel, mode, group)
    values, scales = torch.empty(vn, dtype=torch.uint8), torch.empty(sn // 4, dtype=torch.float32)
    quantize_into(w.detach(), values, scales, mode, group)
    out = torch.empty_like(w.detach())
    dequantize_into(values, scales, out, mode, group)
    return out


def quantized_copy(model: torch.nn.Module, layers: torch.nn.ModuleList, mode: str, group: int = DEFAULT_GROUP):
    """A deep copy of ``model`` whose layers' matrices are what a ``compress=mode`` store gives back."""
    import copy  # noqa: PLC0415

    out = copy.deepcopy(model)
    names = {id(m): n for n, m in model.named_modules()}
    target = out.get_submodule(names[id(layers)])
    with torch.no_grad():
        for p in target.parameters():
            if quantizable(tuple(p.shape), p.dtype, group):
                p.copy_(roundtrip(p, mode, group))
    return out


def quality(model: torch.nn.Module, layers: torch.nn.ModuleList, input_ids: Tensor, mode: str,
            group: int = DEFAULT_GROUP) -> dict:
    """How far the compressed layers move the model, teacher-forced on ``input_ids``: the largest
    logit error relative to the logits' standard deviation, its mean, and the share of positions
    whose top-1 token is unchanged."""
    q = quantized_copy(model, layers, mode, group)
    with torch.no_grad():
        a = model(input_ids).logits.float()
        b = q(input_ids).logits.float()
    err = (a - b).abs()
    std = a.std().item()
    return {"mode": mode, "group": group, "max_logit_error_rel": err.max().item() / std,
            "mean_logit_error_rel": err.mean().item() / std,
            "top1_agreement": (a.argmax(-1) == b.argmax(-1)).float().mean().item()}
