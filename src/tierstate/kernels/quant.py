"""Compressed optimizer state: blockwise 8-bit moments and a 16-bit master.

State layout. A parameter of ``n`` elements under a :class:`QuantConfig` is held as a set
of named flat tensors (the state store keeps exactly these; :meth:`QuantConfig.state_spec`
lists them with their sizes and dtypes):

- ``exp_avg.codes``      uint8 [n]        first moment, signed map (``SIGNED_MAP``)
- ``exp_avg.scale``      fp32  [blocks]   its per-block absmax
- ``exp_avg_sq.codes``   uint8 [n]        second moment, stored as sqrt(v) in the
                                           unsigned map (``UNSIGNED_MAP``)
- ``exp_avg_sq.scale``   fp32  [blocks]   per-block max of sqrt(v)
- ``master``             fp32 [n] (``master="fp32"``) or bf16 [n] (``"bf16_kahan"``,
                          ``"bf16_sr"``)
- ``master.comp``        int16 [n]        only for ``"bf16_kahan"``: the part of the fp32
                                           weight that the bf16 master does not hold, in
                                           units of 2**-16 of the master's bf16 ulp

``blocks = ceil(n / block_size)``; block ``b`` covers elements ``[b * B, (b + 1) * B)`` of the
parameter (the last one may be shorter), so a caller that splits a parameter into pieces
must cut at multiples of ``block_size``. Bytes per parameter: 2 (codes) + 8 / B (scales)
plus 4 (fp32 master) or 2 (bf16 + stochastic rounding) or 4 (bf16 + compensation: the
same bytes as fp32, but the master is a ready bf16 weight). ``master`` may be the bf16
weight itself, updated in place with ``weight_out=None``: the optimizer does so for bf16
parameters in host memory (then 2 B of a bf16 master are the parameter's own, and only
the compensation is state: 4 + 8 / B B with ``bf16_kahan``, 2 + 8 / B with ``bf16_sr``).

Quantization of a block x[0..B) (the encoding is exact and deterministic; the native
kernels and :func:`quantize_ref` here produce the same bits):

- ``scale = max |x|`` (for the second moment, ``max sqrt(v)``); a block that holds a NaN
  or an infinity gets ``scale = NaN`` and every code 0, so it dequantizes to NaN (the
  failure stays visible; nothing is silently clamped); an all-zero block gets scale 0 and
  code 0 (exactly 0.0) everywhere, and so does a block whose absmax is below FLT_MIN
  (1.2e-38, where 1 / scale could overflow): it keeps its scale and dequantizes to zero.
- ``y = x * inv`` with ``inv = 1 / scale`` (fp32 reciprocal, then an fp32 product).
- A map is 2**k magnitudes ``P[0] = 0 < P[1] < ... <= 1`` and the fp32 midpoints between
  neighbours, ``T[j] = fp32((P[j] + P[j + 1]) / 2)``. The code of |y| is the number of
  midpoints ``<= |y|``: the nearest magnitude, a value exactly at a (fp32-rounded) midpoint
  taking the upper one. The signed map has 128 magnitudes and puts the sign in bit 7
  (set when ``y < 0``); the unsigned map has 256.
- Dequantization: ``value = table[code] * scale``.

fp8 maps (``QuantConfig.maps == "fp8"``; the codes are then stored as ``exp_avg.fp8`` and
``exp_avg_sq.fp8``, so a state names its maps): the same blocks and scale (absmax), but
the codes are 8-bit floats, 4 exponent bits with bias 15 and subnormals, no inf or NaN:
sign + E4M3 for the first moment (magnitudes 0, 2**-17, ..., top 1.875) and E4M4 for
sqrt(v) (0, 2**-18, ..., top 1.9375). A block is scaled to the map's top instead of 1:

- ``y = x * inv`` with ``inv = fp32(top / scale)`` (0 where the dynamic maps take 0).
- The code of |y| is |y| rounded to nearest, ties to even: at or above 2**-14, the fp32
  bits rounded to M mantissa bits, ``((bits + 2**(22 - M) - 1 + lsb) >> (23 - M)) - (112 << M)``
  with ``lsb`` the lowest kept bit (the carry moves into the exponent); below 2**-14,
  ``rint(|y| * 2**(14 + M))`` (an exact product, rounded half to even). Clamped to the
  largest code; the sign in bit 7 when ``y < 0`` (signed map).
- Dequantization: ``value = table[code] * fp32(scale / top)``.

Encoding is integer arithmetic and decoding the exact widening of the fp16 that holds the
code (4 exponent bits and bias 15 are fp16's layout with the top exponent bit 0), no table:
the fused step takes 0.4-0.8x the dynamic maps' time (Xeon, 2 threads: ``tierstate bench
step --variants ...`` and ``python -m tierstate.bench.quant_step``, docs/compressed_state.md).
The steps between neighbouring codes are 6.25-12.5 % of the value for exp_avg (3.1-6.25 % for
sqrt(v)) across 15 binades below the top, where the dynamic maps give 0.7-14 % in their top
decade and coarser below. On the moments of the demo GPT after 300 AdamW steps (the table
below, here with eps = 1e-8 and no bias correction) the Adam update m / (sqrt(v) + eps) is
off by 3.00 % (relative L2) with the fp8 maps against 2.13 % with the dynamic maps at block
256 (2.93 % and 1.53 % at 128); m alone 2.58 % against 1.18 %.

The update (:func:`adam_q8_reference`) dequantizes m and v, runs the AdamW/Adam arithmetic
of :func:`tierstate.kernels.reference.adam_update` in fp32, writes the weight per master
mode, and requantizes m and v with the block's new scale, all in one pass per block.
Master modes:

- ``fp32``: as the uncompressed kernels.
- ``bf16_kahan``: compensated summation. The fp32 working weight is
  ``w = master + comp * unit(master)`` with ``unit(m) = 2**(max(e, 24) - 150)`` for m's
  biased fp32 exponent e: 2**-16 of m's bf16 ulp (e >= 24, |m| >= 2**-103). After the
  update ``master = bf16(w_new)`` (nearest even) and ``comp = rint((w_new - master) /
  unit(master))`` (nearest even, clamped to int16, 0 for NaN). ``w_new - master`` is exact
  and at most half an ulp, so master + comp holds w_new to 2**-17 of a bf16 ulp: 24
  significant bits, fp32's own precision, and updates far below bf16's resolution
  accumulate in comp until they move the master. A bf16 compensation term (8 significant
  bits) was measured first and rejected: 1,000 steps of a constant 1e-4 on weights in
  [1, 2) drifted 2.6e-3 from fp32 (its rounding errors add up with one sign), this term
  drifts < 1e-6.
- ``bf16_sr``: ``master = SR(w_new)``, stochastic rounding: the fp32 bits plus a 16-bit
  random number, truncated. The random number is ``lowbias32(index ^ key) >> 16`` with
  ``key = sr_key(seed, step)`` and ``index`` the element's index in the parameter
  (``index_offset + i``), so it depends on neither the thread count, the ISA nor how a
  caller chunks the parameter. Indices must stay below 2**32 per parameter; mix the
  parameter's identity into ``seed``.

``weight_out`` (bf16/fp16) receives the fp32 weight of the step rounded to nearest even
(for ``bf16_sr``: the new bf16 master's value).

Why these maps and the default block of 256 (measured on the moments of the demo GPT,
2 layers, d_model 128, 446k parameters, after 300 torch AdamW steps; relative L2 error):

=====  ==========  =================================  ===============================
block  m (signed)  Adam update m / (sqrt(v) + eps),    same, v itself in the unsigned
                   sqrt(v) in the unsigned map         map
=====  ==========  =================================  ===============================
128    1.09 %      1.32 %                              1.30 %
256    1.20 %      1.58 %                              685 %
512    1.34 %      1.77 %                              867 %
=====  ==========  =================================  ===============================

Encoding v directly rounds the smallest v of a block to code 0 (0.058 % of the elements
at 256) while their m is not zero, and m / eps explodes; sqrt(v) halves the dynamic range
that the map must span (0.031 % zeroed, harmless at 1.58 %). 256 costs 0.03 B/param of
scales; 128 lowers the update error from 1.58 % to 1.32 % for 0.03 B more. Speed did not separate them
(``python -m tierstate.bench.quant_step --blocks 128,256,512``: 3.67x, 3.69x, 3.49x the
fp32-moment kernel's time, 10M params, 2 threads, one interleaved run).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from .quant_maps import (  # noqa: F401 - the maps are part of this module's public face
    CODES_PART, FP8_BIAS, FP8_EXPONENT_BITS, MAP_FAMILIES, QuantMap, _encode_fp8, dynamic_magnitudes,
    family_of_parts, fp8_magnitudes, fp8_signed_map, fp8_unsigned_map, map_family, signed_map, unsigned_map)

MASTER_MODES = ("fp32", "bf16_kahan", "bf16_sr")
DEFAULT_BLOCK_SIZE = 256
_MIN_BLOCK, _MAX_BLOCK = 64, 4096
_FLT_MIN = torch.finfo(torch.float32).tiny


# ---- configuration ----------------------------------------------------------------------
def check_block_size(block_size: object, where: str = "block_size") -> int:
    """A power of two in [64, 4096] (chunks of the native kernels are multiples of 4096)."""
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise TypeError(f"{where} must be an int such as 256, got {type(block_size).__name__}")
    if block_size < _MIN_BLOCK or block_size > _MAX_BLOCK or block_size & (block_size - 1):
        raise ValueError(f"{where}={block_size} must be a power of two in [{_MIN_BLOCK}, {_MAX_BLOCK}], e.g. 256")
    return block_size


def n_blocks(n: int, block_size: int) -> int:
    return (n + block_size - 1) // block_size


@dataclass(frozen=True)
class QuantConfig:
    """How one parameter's Adam state is compressed: 8-bit moments in blocks of
    ``block_size`` and a master of ``master`` mode (``fp32``, ``bf16_kahan``, ``bf16_sr``)."""

    block_size: int = DEFAULT_BLOCK_SIZE
    master: str = "fp32"
    maps: str = "dynamic"

    def __post_init__(self) -> None:
        check_block_size(self.block_size, "QuantConfig.block_size")
        if self.master not in MASTER_MODES:
            raise ValueError(f"QuantConfig.master={self.master!r}; choose one of {', '.join(MASTER_MODES)}")
        if self.maps not in MAP_FAMILIES:
            raise ValueError(f"QuantConfig.maps={self.maps!r}; choose one of {', '.join(MAP_FAMILIES)}")

    @property
    def m_map(self) -> QuantMap:
        """The signed map of ``exp_avg``."""
        return map_family(self.maps)[0]

    @property
    def v_map(self) -> QuantMap:
        """The unsigned map of ``sqrt(exp_avg_sq)``."""
        return map_family(self.maps)[1]

    def codes_key(self, moment: str) -> str:
        """The part name of a moment's codes: ``"exp_avg.codes"`` (dynamic) or ``"exp_avg.fp8"``."""
        return f"{moment}.{CODES_PART[self.maps]}"

    def state_spec(self, n: int) -> dict[str, tuple[int, torch.dtype]]:
        """Name -> (numel, dtype) of every flat tensor of a parameter of n elements."""
        blocks = n_blocks(n, self.block_size)
        spec = {
            self.codes_key("exp_avg"): (n, torch.uint8),
            "exp_avg.scale": (blocks, torch.float32),
            self.codes_key("exp_avg_sq"): (n, torch.uint8),
            "exp_avg_sq.scale": (blocks, torch.float32),
            "master": (n, torch.float32 if self.master == "fp32" else torch.bfloat16),
        }
        if self.master == "bf16_kahan":
            spec["master.comp"] = (n, torch.int16)
        return spec

    def bytes_per_param(self) -> float:
        """State bytes per parameter (codes, scales and master), e.g. 6.03 for fp32/256."""
        master = {"fp32": 4, "bf16_kahan": 4, "bf16_sr": 2}[self.master]
        return 2 + 8 / self.block_size + master

    def step_bytes_per_param(self, grad_bytes: int = 2, out_bytes: int = 2) -> float:
        """Memory traffic of one fused update of one element: the gradient read, the state
        (codes, scales, master) read and written, the rounded weight written; 16.0625 for an
        fp32 master, a bf16 gradient and a bf16 weight out."""
        return grad_bytes + 2 * self.bytes_per_param() + out_bytes

    def init_state(self, weight: Tensor) -> dict[str, Tensor]:
        """Fresh state for the fp32 ``weight``: zero moments, the master from the weight."""
        if not isinstance(weight, Tensor) or weight.dtype != torch.float32:
            raise TypeError(f"init_state: weight must be a float32 tensor, got {getattr(weight, 'dtype', type(weight))}")
        w = weight.detach().reshape(-1)
        state = {name: torch.zeros(numel, dtype=dtype) for name, (numel, dtype) in self.state_spec(w.numel()).items()}
        if self.master == "fp32":
            state["master"].copy_(w)
        else:
            state["master"].copy_(w)  # round to nearest even
            if self.master == "bf16_kahan":
                state["master.comp"].copy_(kahan_comp(w, state["master"]))
        return state

    def export_full(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """The state in full precision: ``param`` (fp32 weight), ``exp_avg``, ``exp_avg_sq``."""
        m_codes, v_codes = state[self.codes_key("exp_avg")], state[self.codes_key("exp_avg_sq")]
        n = m_codes.numel()
        master = state["master"].float()
        if self.master == "bf16_kahan":
            master = kahan_value(state["master"], state["master.comp"])
        m = dequantize_ref(m_codes, state["exp_avg.scale"], self.m_map, self.block_size)
        s = dequantize_ref(v_codes, state["exp_avg_sq.scale"], self.v_map, self.block_size)
        return {"param": master, "exp_avg": m[:n], "exp_avg_sq": s * s}


# ---- the reference -------------------------------------------------------------------
def sqrt_exact(x: Tensor) -> Tensor:
    """The fp32 square root of ``x`` rounded correctly, as the native kernels' VSQRTPS gives it,
    whatever state the calling threads' math library is in (a CPU fp32 tensor).

    torch's CPU sqrt is not that: on a 2-vCPU Xeon (torch 2.13) it was one ulp off in 72 of
    11,100 values, and in some processes one of its two threads returned roots up to 3.1e-4
    (relative) off for its half of the tensor: a per-thread accuracy mode of its math library
    that other code in the process had left behind. Converted 8-bit state then changed from
    run to run. numpy's float32 sqrt is the hardware instruction."""
    return torch.from_numpy(np.sqrt(x.detach().to("cpu", torch.float32).contiguous().numpy()))


def quantize_ref(x: Tensor, qmap: QuantMap, block_size: int) -> tuple[Tensor, Tensor]:
    """(codes uint8 [n], scale fp32 [blocks]) of the fp32 vector ``x``; see the module doc."""
    x = x.reshape(-1)
    n = x.numel()
    blocks = n_blocks(n, block_size)
    padded = torch.zeros(blocks * block_size, dtype=torch.float32)
    padded[:n] = x
    padded = padded.view(blocks, block_size)
    absmax = padded.abs().amax(dim=1) if blocks else torch.zeros(0)
    finite = torch.isfinite(absmax)
    # Below FLT_MIN the reciprocal could overflow: such a block encodes as zeros.
    ok = finite & (absmax >= _FLT_MIN)
    if qmap.fp8_mantissa_bits:
        inv = torch.where(ok, torch.full_like(absmax, qmap.top) / absmax, torch.zeros_like(absmax))
        codes = _encode_fp8(padded * inv[:, None], qmap)
    else:
        inv = torch.where(ok, torch.reciprocal(absmax), torch.zeros_like(absmax))
        y = padded * inv[:, None]
        codes = torch.searchsorted(qmap.thresholds[:-1], y.abs().contiguous(), right=True)
        if qmap.signed:
            codes = codes | ((y < 0).long() << 7)
    codes = torch.where(finite[:, None], codes, torch.zeros_like(codes))
    scale = torch.where(finite, absmax, torch.full_like(absmax, math.nan))
    return codes.reshape(-1)[:n].to(torch.uint8), scale


def dequantize_ref(codes: Tensor, scale: Tensor, qmap: QuantMap, block_size: int) -> Tensor:
    """fp32 [n]: ``table[code] * (scale[block] / top)`` (``top`` is 1 for the dynamic maps)."""
    n = codes.numel()
    values = qmap.table[codes.reshape(-1).long()]
    mul = scale if qmap.top == 1.0 else scale / qmap.top
    per_element = mul.repeat_interleave(block_size)[:n]
    return values * per_element


def comp_unit(master: Tensor, inverse: bool = False) -> Tensor:
    """fp32 unit of the compensation term per element (or its inverse): 2**(max(e, 24) - 150)."""
    e = (master.float().view(torch.int32) >> 23) & 0xFF
    e = e.clamp_min(24)
    bits = (277 - e) if inverse else (e - 23)
    return (bits << 23).to(torch.int32).view(torch.float32)


def kahan_value(master: Tensor, comp: Tensor) -> Tensor:
    """The fp32 weight that a bf16 master and its int16 compensation term hold."""
    m = master.float()
    return m + comp.float() * comp_unit(m)  # the product is exact (a power of two times an int16)


def kahan_comp(w: Tensor, master: Tensor) -> Tensor:
    """int16 compensation of the fp32 ``w`` whose bf16 master is ``master`` (= bf16(w))."""
    m = master.float()
    r = (w - m) * comp_unit(m, inverse=True)
    r = torch.where(torch.isnan(r), torch.zeros_like(r), r).clamp(-32768.0, 32767.0)
    return torch.round(r).to(torch.int16)  # round half to even


def lowbias32(x: Tensor) -> Tensor:
    """Chris Wellons' lowbias32 integer hash on int64 tensors holding uint32 values."""
    m = 0xFFFFFFFF
    x = x & m
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & m
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & m
    return x ^ (x >> 16)


def _lowbias32_int(x: int) -> int:
    """:func:`lowbias32` of one uint32 in Python integers (no tensor: it runs once per
    parameter and step, where four tiny torch ops cost 0.5 ms)."""
    m = 0xFFFFFFFF
    x &= m
    x ^= x >> 16
    x = (x * 0x7FEB352D) & m
    x ^= x >> 15
    x = (x * 0x846CA68B) & m
    return x ^ (x >> 16)


def sr_key(seed: int, step: int) -> int:
    """The 32-bit key of one step's stochastic rounding: hashes of seed and step (64 bits each)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise ValueError(f"seed={seed!r} must be an int in [0, 2**64)")
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 2**64:
        raise ValueError(f"step={step!r} must be an int in [0, 2**64)")
    k = _lowbias32_int(seed & 0xFFFFFFFF)
    k = _lowbias32_int(k ^ (seed >> 32))
    k = _lowbias32_int(k ^ (step & 0xFFFFFFFF))
    return _lowbias32_int(k ^ (step >> 32))


def master_value(config: "QuantConfig", state: dict[str, Tensor]) -> Tensor:
    """The fp32 weight a master of ``config.master`` mode holds (``state``: its named parts)."""
    if config.master == "bf16_kahan":
        return kahan_value(state["master"], state["master.comp"])
    return state["master"].float()


def param_seed(seed: int, param_index: int) -> int:
    """The stochastic-rounding seed of one parameter: the run's ``seed`` with the parameter's
    index (its position in ``param_groups``) mixed in by a 64-bit odd multiplier, so that no two
    parameters share their random numbers."""
    return (seed ^ ((param_index + 1) * 0x9E3779B97F4A7C15)) & 0xFFFFFFFFFFFFFFFF


def round_bf16_stochastic(x: Tensor, key: int, index_offset: int = 0) -> Tensor:
    """bf16 of the fp32 ``x`` by stochastic rounding, element i using index ``index_offset + i``."""
    bits = x.contiguous().view(torch.int32).long() & 0xFFFFFFFF
    index = torch.arange(x.numel(), dtype=torch.int64) + index_offset
    rand = lowbias32(index ^ key) >> 16
    rounded = ((bits + rand) >> 16) & 0xFFFF
    rounded = torch.where(torch.isnan(x), torch.full_like(rounded, 0x7FC0), rounded)
    return rounded.to(torch.int32).to(torch.int16).view(torch.bfloat16)


def adam_q8_math(
    state: dict[str, Tensor],
    grad: Tensor,
    *,
    config: QuantConfig,
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
) -> tuple[Tensor, Tensor, Tensor]:
    """The fp32 part of one step, without writing: ``(w_new, m_new, sqrt(v_new))``."""
    from .reference import _effective_grad

    block = config.block_size
    g = _effective_grad(grad, grad_scale, maximize)
    if config.master == "fp32":
        w = state["master"].clone()
    elif config.master == "bf16_kahan":
        w = kahan_value(state["master"], state["master.comp"])
    else:
        w = state["master"].float()
    if weight_decay != 0:
        if decoupled:
            w.mul_(1 - lr * weight_decay)
        else:
            g = g.add(w, alpha=weight_decay)
    m = dequantize_ref(state[config.codes_key("exp_avg")], state["exp_avg.scale"], config.m_map, block)
    s = dequantize_ref(state[config.codes_key("exp_avg_sq")], state["exp_avg_sq.scale"], config.v_map, block)
    v = s * s
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    s_new = sqrt_exact(v)
    denom = (s_new / bias_correction2**0.5).add_(eps)
    w.addcdiv_(m, denom, value=-(lr / bias_correction1))
    return w, m, s_new


def adam_q8_reference(
    state: dict[str, Tensor],
    grad: Tensor,
    weight_out: Tensor | None = None,
    *,
    config: QuantConfig,
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
    """One Adam/AdamW step on compressed state, in place (pure torch, the native kernel's twin)."""
    w, m, s_new = adam_q8_math(
        state, grad, config=config, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
        decoupled=decoupled, bias_correction1=bias_correction1, bias_correction2=bias_correction2,
        maximize=maximize, grad_scale=grad_scale)
    block = config.block_size
    codes, scale = quantize_ref(m, config.m_map, block)
    state[config.codes_key("exp_avg")].copy_(codes)
    state["exp_avg.scale"].copy_(scale)
    codes, scale = quantize_ref(s_new, config.v_map, block)
    state[config.codes_key("exp_avg_sq")].copy_(codes)
    state["exp_avg_sq.scale"].copy_(scale)
    if config.master == "fp32":
        state["master"].copy_(w)
        value = w
    elif config.master == "bf16_kahan":
        state["master"].copy_(w)
        state["master.comp"].copy_(kahan_comp(w, state["master"]))
        value = w
    else:
        state["master"].copy_(round_bf16_stochastic(w, sr_key(seed, step), index_offset))
        value = state["master"].float()
    if weight_out is not None:
        weight_out.copy_(value)
