"""Blockwise 8-bit quantization: the native encoder/decoder against the pure-torch reference.

The encoding is integer/compare arithmetic on the same fp32 products in every variant, so
codes and scales must be bit-identical to ``quant.quantize_ref`` on every ISA (the scalar
build included), at every size and block size, with no tolerance.
"""
from __future__ import annotations

import math

import pytest
import torch

import tierstate.kernels as K
from kernel_helpers import ISA_LOOKUPS, NATIVE_ISAS, needs_native, unaligned_view
from tierstate.kernels import quant as Q

SIZES = (1, 255, 257, 2**20 + 3)
MAPS = {"signed": Q.signed_map, "unsigned": Q.unsigned_map, "fp8-signed": Q.fp8_signed_map,
        "fp8-unsigned": Q.fp8_unsigned_map}
# Each ISA with each way of looking up a table map's codes; the fp8 maps have no table.
ISA_LOOKUP_MAPS = [pytest.param(isa, lookup, name, id=f"{isa}-{lookup}-{name}")
                   for isa, lookup in ISA_LOOKUPS for name in MAPS
                   if lookup == "loads" or not name.startswith("fp8")]


def _moment_like(n: int, seed: int) -> torch.Tensor:
    """Signed values with magnitudes 10**U(-9, 1), exact zeros, and all-zero blocks."""
    g = torch.Generator().manual_seed(seed)
    x = torch.pow(10.0, -9 + 10 * torch.rand(n, generator=g)) * torch.randn(n, generator=g).sign()
    x[torch.rand(n, generator=g) < 0.05] = 0.0
    if n > 700:
        x[256:512] = 0.0  # one whole block of 256 is zero
    return x


def _assert_same(x: torch.Tensor, qmap: Q.QuantMap, block: int) -> None:
    codes, scale = K.quantize_blockwise(x, qmap, block)
    ref_codes, ref_scale = Q.quantize_ref(x, qmap, block)
    bad = (codes != ref_codes).nonzero().flatten()
    assert bad.numel() == 0, (f"{bad.numel()} codes differ, first at {int(bad[0])}: x={x[bad[0]].item()!r} "
                              f"native {int(codes[bad[0]])} reference {int(ref_codes[bad[0]])}")
    assert torch.equal(scale.view(torch.int32), ref_scale.view(torch.int32)), "scales differ"
    values = K.dequantize_blockwise(codes, scale, qmap, block)
    ref_values = Q.dequantize_ref(ref_codes, ref_scale, qmap, block)
    assert torch.equal(values.view(torch.int32), ref_values.view(torch.int32)), "dequantized values differ"


@needs_native
@pytest.mark.parametrize("isa,lookup,map_name", ISA_LOOKUP_MAPS)
def test_codes_and_scales_bit_identical(isa, lookup, map_name, isa_and_threads):
    """Against the reference, at both thread counts; the table maps also with the decode of
    a block at once turned off (it is on where the CPU has AVX512-VBMI: q8_row_decode)."""
    K.set_isa(isa)
    K.set_q8_table_lookup(lookup)
    qmap = MAPS[map_name]()
    for threads, rows in ((1, True), (2, True), (2, False)):
        if not rows and (qmap.fp8_mantissa_bits or not K.q8_row_decode()):
            continue
        K.set_num_threads(threads)
        K.set_q8_row_decode(rows)
        for n in SIZES:
            for block in (64, 256, 4096) if n < 2**20 else (256,):
                x = _moment_like(n, seed=n + block)
                _assert_same(x.abs() if not qmap.signed else x, qmap, block)


@needs_native
@pytest.mark.parametrize("isa,lookup,map_name", ISA_LOOKUP_MAPS)
def test_every_threshold_and_its_neighbours(isa, lookup, map_name, isa_and_threads):
    """Blocks whose absmax is exactly the map's top (so y = x): every threshold, 1-3 fp32 ulps
    either side, and a stride over all fp32 values in [0, top]. Ties go to the upper code in
    the dynamic maps and to the even code in the fp8 maps."""
    K.set_isa(isa)
    K.set_q8_table_lookup(lookup)
    qmap = MAPS[map_name]()
    top = qmap.top
    t = qmap.thresholds[:-1].view(torch.int32)
    near = torch.cat([t + d for d in (-3, -2, -1, 0, 1, 2, 3)]).view(torch.float32)
    sweep = torch.arange(0, int(torch.tensor(top).view(torch.int32)), 997, dtype=torch.int32).view(torch.float32)
    x = torch.cat([near, sweep])
    if qmap.signed:
        x = torch.cat([x, -x])
    x[::64] = top
    _assert_same(x, qmap, 64)
    codes, _ = K.quantize_blockwise(x, qmap, 64)
    m = t.numel()
    position = torch.arange(3 * m, 4 * m)  # the "+0 ulp" copy: exactly the thresholds
    kept = position % 64 != 0               # not overwritten by a block's top value
    at_threshold = codes[position[kept]].long() & (0x7F if qmap.signed else 0xFF)
    upper = torch.arange(m) + 1
    expect = upper if not qmap.fp8_mantissa_bits else upper - (upper & 1)  # the even one of (c - 1, c)
    assert torch.equal(at_threshold, expect[kept]), "a value at a threshold takes the upper (dynamic) or even code"


@pytest.mark.parametrize("map_name", ["signed", "unsigned"])
def test_one_lookup_table_encodes_as_the_thresholds(map_name):
    """QuantMap.lut32, the native encoders' table: (w & 0xFF) + (low bits >= w >> 8) is the
    count of thresholds <= |y| at both ends of every bucket, one ulp outside them, at every
    threshold and its neighbours, and for magnitudes clamped into the first or last bucket."""
    qmap = MAPS[map_name]()
    size, shift, base = qmap.lut32.numel(), qmap.lut_shift, qmap.lut_base
    lows = (torch.arange(size, dtype=torch.int64) + base) << shift
    t = qmap.thresholds[:-1].view(torch.int32).long()
    bits = torch.cat([lows, lows - 1, lows + (1 << shift) - 1, lows + (1 << shift),
                      *(t + d for d in (-2, -1, 0, 1, 2)),
                      torch.tensor([0, 1, 0x3F800000, 0x40000000, 0x7F000000, 0x7F800000])])
    bits = bits[(bits >= 0) & (bits <= 0x7F800000)]
    x = bits.to(torch.int32).view(torch.float32)
    bucket = ((bits >> shift) - base).clamp(0, size - 1)
    w = qmap.lut32.long()[bucket]
    code = (w & 0xFF) + ((bits & ((1 << shift) - 1)) >= (w >> 8)).long()
    assert torch.equal(code, torch.searchsorted(qmap.thresholds[:-1], x, right=True))


def test_encoding_is_nearest_code():
    """The reference picks the nearest magnitude (checked in float64), except exactly at a
    midpoint, where it takes the upper one (the midpoint is itself rounded to fp32) or, in the
    fp8 maps, the even one."""
    for make in MAPS.values():
        qmap = make()
        y = qmap.top * torch.rand(200_000, generator=torch.Generator().manual_seed(3)) ** 3
        y[::4096] = qmap.top  # every block's absmax is the top, so the normalised value is y itself
        codes, scale = Q.quantize_ref(y, qmap, 4096)
        assert bool((scale == qmap.top).all())
        mags = qmap.magnitudes.double()
        dist = (y.double()[:, None] - mags[None, :]).abs()
        nearest = dist.argmin(dim=1)
        got = codes.long() & 0x7F if qmap.signed else codes.long()
        differs = got != nearest
        d_got = dist.gather(1, got[:, None]).squeeze(1)
        d_best = dist.gather(1, nearest[:, None]).squeeze(1)
        # a different pick is only allowed where the two are equally near to within an fp32 ulp
        assert bool(((d_got - d_best)[differs] <= 2.0**-24).all())
        assert int(differs.sum()) <= 2


@needs_native
@pytest.mark.parametrize("isa", NATIVE_ISAS)
def test_non_finite_and_tiny_blocks(isa, isa_and_threads):
    """NaN or inf in a block: scale NaN, all codes 0, the block dequantizes to NaN. A block
    whose absmax is below FLT_MIN keeps its scale and encodes as zeros. Other blocks intact."""
    K.set_isa(isa)
    block = 64
    x = torch.randn(6 * block, generator=torch.Generator().manual_seed(4))
    x[3] = math.nan
    x[block + 5] = math.inf
    x[2 * block + 7] = -math.inf
    x[3 * block: 4 * block] = 1e-39 * torch.randn(block).sign()  # subnormal absmax
    x[4 * block: 5 * block] = 0.0
    for qmap in (m() for m in MAPS.values()):
        _assert_same(x, qmap, block)
        codes, scale = K.quantize_blockwise(x, qmap, block)
        assert torch.isnan(scale[:3]).all() and (codes[: 3 * block] == 0).all()
        values = K.dequantize_blockwise(codes, scale, qmap, block)
        assert torch.isnan(values[: 3 * block]).all()
        assert scale[3].item() == pytest.approx(1e-39, rel=1e-2) and (values[3 * block: 5 * block] == 0).all()
        assert scale[4].item() == 0.0
        assert torch.isfinite(values[5 * block:]).all()


@needs_native
@pytest.mark.parametrize("isa", NATIVE_ISAS)
def test_absmax_found_at_every_lane(isa, isa_and_threads):
    """A block's absmax is a horizontal maximum over the vector lanes: put the largest
    magnitude (or a NaN) at each position of a 64-element block in turn (every lane of a
    16-, 8- and 4-wide vector), and in the scalar tail of a last, partial block of 37; the
    scale must be exactly that value (NaN: scale NaN, codes 0) and the other blocks intact."""
    K.set_isa(isa)
    block, tail = 64, 37
    x = 0.5 * torch.rand(block * block + tail, generator=torch.Generator().manual_seed(5)) + 0.25
    x[::3] = -x[::3]
    peaks = [2.0 + j / 128 for j in range(block + 1)]
    where = [j * block + j for j in range(block)] + [block * block + tail - 2]
    for j, at in enumerate(where):
        x[at] = -peaks[j] if j % 2 else peaks[j]
    for qmap in (Q.signed_map(), Q.fp8_signed_map()):
        _assert_same(x, qmap, block)
        _, scale = K.quantize_blockwise(x, qmap, block)
        assert scale.tolist() == peaks
    nan = x.clone()
    nan[where[0::2]] = math.nan
    for qmap in (Q.signed_map(), Q.fp8_signed_map()):
        _assert_same(nan, qmap, block)
        codes, scale = K.quantize_blockwise(nan, qmap, block)
        assert torch.isnan(scale[0::2]).all() and torch.isfinite(scale[1::2]).all()
        assert (codes[: block * block].view(block, block)[0::2] == 0).all() and (codes[block * block:] == 0).all()


@needs_native
def test_unaligned_views(isa_and_threads):
    """Inputs that start 1-3 elements into a buffer; outputs into fresh tensors."""
    for qmap in (Q.signed_map(), Q.fp8_signed_map()):
        for offset in (1, 2, 3):
            x = unaligned_view(_moment_like(1000, offset), offset, torch.float32)
            _assert_same(x, qmap, 64)


@pytest.mark.parametrize("make", [Q.signed_map, Q.fp8_signed_map])
def test_quantization_error_is_bounded(make):
    """A value's error is at most half its step between neighbouring codes, times the block's
    scale over the map's top."""
    qmap = make()
    x = torch.randn(256 * 64, generator=torch.Generator().manual_seed(5))
    codes, scale = Q.quantize_ref(x, qmap, 256)
    y = Q.dequantize_ref(codes, scale, qmap, 256)
    mags = qmap.magnitudes
    steps = torch.cat([mags[1:] - mags[:-1], mags[-1:] - mags[-2:-1]])
    bound = steps[(codes.long() & 0x7F)].maximum(steps[((codes.long() & 0x7F) - 1).clamp_min(0)])
    per_block = (scale / qmap.top).repeat_interleave(256)
    assert bool(((x - y).abs() <= bound * per_block * 0.5 + 1e-7).all())


def test_face_errors():
    x = torch.randn(300)
    with pytest.raises(ValueError, match="block_size=100"):
        K.quantize_blockwise(x, Q.signed_map(), 100)
    with pytest.raises(TypeError, match="x has dtype torch.float64"):
        K.quantize_blockwise(x.double(), Q.signed_map(), 256)
    with pytest.raises(TypeError, match="qmap must be a QuantMap"):
        K.quantize_blockwise(x, "signed", 256)
    codes, scale = K.quantize_blockwise(x, Q.signed_map(), 256)
    with pytest.raises(ValueError, match="scale has 1 elements"):
        K.dequantize_blockwise(codes, scale[:1], Q.signed_map(), 256)
    with pytest.raises(TypeError, match="codes has dtype torch.int8"):
        K.dequantize_blockwise(codes.to(torch.int8), scale, Q.signed_map(), 256)


@needs_native
def test_table_lookup_is_chosen_at_first_use_and_can_be_fixed(isa_and_threads):
    """"auto" times gather against loads at a variant's first table-map call and keeps the
    answer; "gather" / "loads" fix it; anything else is refused, naming the argument."""
    x = _moment_like(4096, seed=3)
    for isa in NATIVE_ISAS:
        K.set_isa(isa)
        K.set_q8_table_lookup("auto")
        K.quantize_blockwise(x, Q.signed_map(), 256)
        chosen = K.q8_table_lookup()
        assert chosen in (("gather", "loads") if isa.startswith("avx") else ("loads",)), (isa, chosen)
        K.quantize_blockwise(x, Q.signed_map(), 256)
        assert K.q8_table_lookup() == chosen, "the timed choice is kept"
        assert K.backend_info()["q8_table_lookup"] == chosen
        for fixed in ("gather", "loads"):
            K.set_q8_table_lookup(fixed)
            assert K.q8_table_lookup() == (fixed if isa.startswith("avx") else "loads")
    for bad in ("gathers", "", None, 1):
        with pytest.raises(ValueError, match="set_q8_table_lookup.*mode.*auto, gather, loads"):
            K.set_q8_table_lookup(bad)


def _cpu_has_avx512_vbmi() -> bool:
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return False
    return "avx512vbmi" in flags


@needs_native
def test_row_decode_where_the_cpu_has_vbmi(isa_and_threads):
    """The block-at-a-time decode is on for the AVX-512 variants exactly where /proc/cpuinfo
    lists avx512vbmi, off for the others, can be turned off, and refuses a non-bool."""
    for isa in NATIVE_ISAS:
        K.set_isa(isa)
        K.set_q8_row_decode(True)
        expected = isa.startswith("avx512") and _cpu_has_avx512_vbmi()
        assert K.q8_row_decode() is expected, isa
        assert K.backend_info()["q8_row_decode"] is expected
        K.set_q8_row_decode(False)
        assert K.q8_row_decode() is False
    for bad in (1, "yes", None):
        with pytest.raises(TypeError, match="set_q8_row_decode.*True or False"):
            K.set_q8_row_decode(bad)
