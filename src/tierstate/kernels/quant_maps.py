"""The 8-bit maps of compressed optimizer state: the dynamic-tree maps (tables) and the fp8
maps (arithmetic), their families, and the reference fp8 encoder.

The encoding each map stands for is specified in :mod:`tierstate.kernels.quant` (module
doc), which re-exports every public name here; the native kernels read these tables
(``csrc/kernels/kernels.h``: ``QuantMapRef``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import Tensor


# ---- maps ------------------------------------------------------------------------------
def _decade_means(fraction_items: int) -> list[float]:
    """Midpoints of ``fraction_items - 1`` equal steps over [0.1, 1] (bitsandbytes' dynamic map)."""
    edges = [0.1 + 0.9 * j / (fraction_items - 1) for j in range(fraction_items)]
    return [(a + b) / 2 for a, b in zip(edges[:-1], edges[1:])]


def dynamic_magnitudes(bits: int) -> list[float]:
    """2**bits magnitudes of a dynamic-tree map (Dettmers et al. 2022, "8-bit Optimizers via
    Block-wise Quantization"): 0, 1.0 and decades 1e-6 .. 1 where the decade 10**(i - 6)
    holds 2**(i + extra) linearly spaced values, so large values get more fraction bits.

    ``bits=8`` is bitsandbytes' unsigned map exactly (decades 0..6: 2, 4, .., 128 values).
    ``bits=7`` (the signed map's magnitudes) takes bitsandbytes' signed map's positive side
    (decades of 1, 2, .., 64 values) and drops its one value in the 1e-6 decade so that
    +-1.0 fit: 0, 126 values from 3.25e-6 up, and 1.0.
    """
    values: list[float] = []
    if bits == 8:
        for i in range(7):
            values += [10.0 ** (i - 6) * m for m in _decade_means(2 ** (i + 1) + 1)]
    elif bits == 7:
        for i in range(1, 7):
            values += [10.0 ** (i - 6) * m for m in _decade_means(2**i + 1)]
    else:
        raise ValueError(f"dynamic_magnitudes: bits must be 7 or 8, got {bits!r}")
    values = sorted([0.0, *values, 1.0])
    assert len(values) == 2**bits
    return values


@dataclass(frozen=True)
class QuantMap:
    """One 8-bit map and its encoder tables (the same arrays the native kernels read).

    ``table``: fp32 [256], the dequantized value of each code (before the block scale).
    ``thresholds``: fp32 [M], the midpoints between the M + 1 magnitudes, then +inf.
    ``lut``/``lut_shift``/``lut_base``/``lut_threshold``: the fast encoder: the bucket of |y|
    is ``clamp((bits(|y|) >> lut_shift) - lut_base, 0, len(lut) - 1)``, ``lut[bucket]`` the
    count of thresholds at or below the bucket's low end, ``lut_threshold[bucket] =
    thresholds[lut[bucket]]``, and no bucket holds more than one threshold strictly inside,
    so ``code = lut[b] + (|y| >= lut_threshold[b])``.

    ``lut32``: what the native kernels read, the same encoder in one lookup: int32 per
    bucket, ``lut[b] | low << 8``, where ``low`` is the low ``lut_shift`` bits of
    ``lut_threshold[b]`` when that threshold lies inside bucket ``b`` (its bits above
    ``lut_shift`` are the bucket's own) and ``1 << lut_shift`` (above every remainder)
    when it does not. Then ``code = (w & 0xFF) + ((bits(|y|) & (2**lut_shift - 1)) >= w >> 8)``:
    inside a bucket every magnitude shares the threshold's high bits, and positive floats
    order as their bits. A clamped magnitude (below the first bucket, above the last, NaN)
    meets no threshold inside, as before. 5.6 and 12.8 KB for the two maps
    (csrc/kernels/kernels.h).
    """

    name: str
    signed: bool
    magnitudes: Tensor
    table: Tensor
    thresholds: Tensor
    lut: Tensor
    lut_shift: int
    lut_base: int
    lut_threshold: Tensor
    lut32: Tensor
    fp8_mantissa_bits: int = 0
    top: float = 1.0


def _build_map(name: str, magnitudes: list[float], signed: bool) -> QuantMap:
    mags64 = torch.tensor(magnitudes, dtype=torch.float64)
    mags = mags64.float()
    assert bool((mags[1:] > mags[:-1]).all()), "magnitudes must increase strictly in fp32"
    mids = ((mags64[:-1] + mags64[1:]) / 2).float()
    thresholds = torch.cat([mids, torch.tensor([math.inf])])
    if signed:
        assert mags.numel() == 128
        table = torch.cat([mags, -mags])
    else:
        assert mags.numel() == 256
        table = mags.clone()
    # Smallest mantissa-bit count k whose buckets each hold at most one threshold; buckets
    # start one binade below the smallest threshold and end with the binade of 1.0.
    tmin = float(mids[0])
    e0 = math.floor(math.log2(tmin)) - 1
    bits = mids.view(torch.int32).long()
    for k in range(3, 12):
        shift = 23 - k
        base = (e0 + 127) << k
        size = (127 - (e0 + 127) + 1) << k
        bucket = ((bits >> shift) - base).clamp(0, size - 1)
        # a threshold exactly at its bucket's low end is counted by lut, not "inside"
        low = ((bucket + base) << shift).to(torch.int32).view(torch.float32)
        low = torch.where(bucket == 0, torch.zeros_like(low), low)
        inside = bucket[mids > low]
        if inside.numel() == 0 or int(torch.bincount(inside).max()) <= 1:
            break
    else:
        raise AssertionError(f"{name}: no LUT resolution separates the thresholds")
    lows = ((torch.arange(size, dtype=torch.int64) + base) << shift).to(torch.int32).view(torch.float32)
    lows[0] = 0.0
    lut = torch.searchsorted(mids, lows, right=True).to(torch.int32)
    assert int(lut.max()) < 256 and thresholds.numel() <= 256
    lut_threshold = thresholds[lut.long()].contiguous()
    lut32 = _pack_lut(lut, lut_threshold, shift, base)
    return QuantMap(name, signed, mags, table, thresholds.contiguous(), lut, shift, base, lut_threshold, lut32)


def _pack_lut(lut: Tensor, lut_threshold: Tensor, shift: int, base: int) -> Tensor:
    """The one-lookup encoder table of the native kernels (QuantMap.lut32)."""
    bits = lut_threshold.view(torch.int32).long()  # +inf: 0x7F800000, never a bucket's own
    bucket = torch.arange(lut.numel(), dtype=torch.int64)
    inside = (bits >> shift) - base == bucket
    # The first bucket also holds every magnitude below it, the last every one above: a
    # threshold inside them would be compared with a remainder of other high bits.
    assert not bool(inside[0]) and not bool(inside[-1])
    low = torch.where(inside, bits & ((1 << shift) - 1), torch.full_like(bits, 1 << shift))
    assert int(low.max()) < 1 << 24
    return (lut.long() | (low << 8)).to(torch.int32).contiguous()


@lru_cache(maxsize=None)
def signed_map() -> QuantMap:
    """Map of the first moment: sign bit + 7-bit dynamic magnitude."""
    return _build_map("signed-dynamic", dynamic_magnitudes(7), signed=True)


@lru_cache(maxsize=None)
def unsigned_map() -> QuantMap:
    """Map of the second moment's square root: 8-bit dynamic magnitude."""
    return _build_map("unsigned-dynamic", dynamic_magnitudes(8), signed=False)


# ---- fp8 maps ---------------------------------------------------------------------------
FP8_EXPONENT_BITS = 4
FP8_BIAS = 15


def fp8_magnitudes(mantissa_bits: int) -> list[float]:
    """The 2**(4 + mantissa_bits) magnitudes of an fp8 map, in code order: code ``c < 2**M``
    is ``c * 2**-(14 + M)`` (subnormal), above it ``(1 + f / 2**M) * 2**(e - 15)`` with
    ``e = c >> M``, ``f = c & (2**M - 1)``: 4 exponent bits, bias 15, no inf or NaN."""
    m = mantissa_bits
    values = []
    for c in range(2 ** (FP8_EXPONENT_BITS + m)):
        e, f = c >> m, c & ((1 << m) - 1)
        values.append(math.ldexp(c, -(FP8_BIAS - 1 + m)) if e == 0 else math.ldexp(1 + f / 2**m, e - FP8_BIAS))
    return values


def _build_fp8_map(name: str, mantissa_bits: int, signed: bool) -> QuantMap:
    mags = torch.tensor(fp8_magnitudes(mantissa_bits), dtype=torch.float32)
    assert mags.numel() == (128 if signed else 256)
    table = torch.cat([mags, -mags]) if signed else mags.clone()
    thresholds = torch.cat([(mags[:-1] + mags[1:]) / 2, torch.tensor([math.inf])])  # exact in fp32
    empty_i32 = torch.zeros(0, dtype=torch.int32)
    return QuantMap(name, signed, mags, table, thresholds, empty_i32, 0, 0, torch.zeros(0), empty_i32,
                    fp8_mantissa_bits=mantissa_bits, top=float(mags[-1]))


@lru_cache(maxsize=None)
def fp8_signed_map() -> QuantMap:
    """Map of the first moment in the ``"fp8"`` family: sign bit + E4M3 (top 1.875)."""
    return _build_fp8_map("signed-fp8-e4m3", 3, signed=True)


@lru_cache(maxsize=None)
def fp8_unsigned_map() -> QuantMap:
    """Map of the second moment's square root in the ``"fp8"`` family: E4M4 (top 1.9375)."""
    return _build_fp8_map("unsigned-fp8-e4m4", 4, signed=False)


# The map families of QuantConfig.maps: (first moment's map, sqrt(v)'s map).
MAP_FAMILIES = ("dynamic", "fp8")
# The codes of each family are stored under their own part name ("exp_avg.codes" against
# "exp_avg.fp8"), so a state dict, a checkpoint shard or a DCP entry says which maps it
# was written with and is never decoded with the other family's.
CODES_PART = {"dynamic": "codes", "fp8": "fp8"}


def family_of_parts(keys) -> str:
    """The map family of a compressed state from its part names ("dynamic" for ``.codes``)."""
    return "fp8" if any(str(k).endswith(".fp8") for k in keys) else "dynamic"


def map_family(name: str) -> tuple[QuantMap, QuantMap]:
    """(signed map of exp_avg, unsigned map of sqrt(exp_avg_sq)) of the family ``name``."""
    if name == "dynamic":
        return signed_map(), unsigned_map()
    if name == "fp8":
        return fp8_signed_map(), fp8_unsigned_map()
    raise ValueError(f"quant maps {name!r}: choose one of {', '.join(MAP_FAMILIES)}")


def _encode_fp8(y: Tensor, qmap: QuantMap) -> Tensor:
    """int64 codes of the fp32 ``y`` (already scaled to the map's range): round to nearest,
    ties to even, by the native kernels' integer steps (see the module doc)."""
    m = qmap.fp8_mantissa_bits
    a = y.abs()
    bits = a.view(torch.int32).long()
    lsb = (bits >> (23 - m)) & 1
    normal = ((bits + ((1 << (22 - m)) - 1) + lsb) >> (23 - m)) - (112 << m)
    sub = torch.round(a * float(2 ** (14 + m))).long()  # exact product; round half to even
    codes = torch.where(bits >= (113 << 23), normal, sub).clamp_max(127 if qmap.signed else 255)
    if qmap.signed:
        codes = codes | ((y < 0).long() << 7)
    return codes
