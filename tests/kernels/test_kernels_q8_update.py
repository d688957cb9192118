"""The fused Adam/AdamW step on compressed state against ``quant.adam_q8_reference``.

Tolerances, and why they are not zero:
- One step from the same state: the fp32 arithmetic is that of the uncompressed kernel
  (test_kernels_parity.py), so the fp32 weight, and the new m and sqrt(v) before encoding,
  may differ from torch's by 16 fp32 ulps of the largest term; the block scales (a max of
  those) by 16 ulps. A code may then differ only where the reference's normalised value lies
  within NEAR_TIE (2**-18 relative, ~32 ulps) of a map threshold. With bf16 gradients such
  ties are common, not rare: |g| / max|g| over bf16 values often lands exactly on a dyadic
  midpoint such as 0.15625 (measured: 47 of 65,573 sqrt(v) codes at step 1, all such ties).
- The bf16 masters: the same fp32 weight, rounded; a bf16 master may differ by one bf16 ulp
  where the two fp32 weights straddle a rounding point (round to nearest even) or, for
  stochastic rounding, where they differ at all in the bits the random number reaches.
- Over 7 independent steps, a tie that went the other way changes that element's moment
  by one code step for the following steps: the weights may then drift apart by a fraction
  of a step. Bound: |w - w_ref| <= STEP_DRIFT * lr * steps, codes differ in < 1% of elements.
  STEP_DRIFT is 0.05 for the dynamic maps (a code step is ~1% of a large moment; measured at
  2**16 + 37 elements, lr 1e-3: 5.4e-5 fp32 master and bf16 + compensation, 1.2e-4 stochastic
  rounding; 0.18% of the sqrt(v) codes) and 0.15 for the fp8 maps, whose steps are 6.25-12.5%
  of the value for exp_avg (measured on a Xeon: 2.4e-7 on AVX2 and AVX-512, where every code
  matched; 2.4e-4 on the scalar build, whose products are not fused). With stochastic rounding
  a weight whose fp32 values differ may round to the other bf16 neighbour: such weights, one
  bf16 ulp apart, are allowed beyond the bound in 0.1% of the elements (measured: 1 of 65,573).
- One bf16 ulp is at most 2**-7 of the value (8 significant bits: 2**-8 at the top of a
  binade, 2**-7 at its bottom).
"""
from __future__ import annotations

import math

import pytest
import torch

import tierstate.kernels as K
from kernel_helpers import GATHER_ISAS, NATIVE_ISAS, needs_native
from tierstate.kernels import quant as Q

pytestmark = needs_native

FP32_ULPS = 16 * 2.0**-23
BF16_ULP = 2.0**-7  # one bf16 ulp relative to the value, at most (see the module docstring)
STEP_DRIFT = {"dynamic": 0.05, "fp8": 0.15}
NEAR_TIE = 2.0**-18

HYPER = {
    "adamw": dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True),
    "adam-l2-max-scaled": dict(lr=1e-3, beta1=0.9, beta2=0.99, eps=1e-6, weight_decay=0.05, decoupled=False,
                               maximize=True, grad_scale=0.5),
    "adamw-lowbeta": dict(lr=1e-2, beta1=0.3, beta2=0.9, eps=1e-8, weight_decay=0.1, decoupled=True),
}


def _hyper(name: str, step: int) -> dict:
    h = dict(HYPER[name])
    h["bias_correction1"] = 1 - h["beta1"] ** step
    h["bias_correction2"] = 1 - h["beta2"] ** step
    return h


def _clone(state: dict) -> dict:
    return {k: v.clone() for k, v in state.items()}


def _warm_state(cfg: Q.QuantConfig, n: int, seed: int, steps: int = 3) -> dict:
    """A state after a few reference steps (so the moments and the comp are not zero)."""
    gen = torch.Generator().manual_seed(seed)
    state = cfg.init_state(torch.randn(n, generator=gen))
    for step in range(1, steps + 1):
        g = torch.randn(n, generator=gen) * torch.pow(10.0, -3 * torch.rand(n, generator=gen))
        Q.adam_q8_reference(state, g, config=cfg, **_hyper("adamw", step), seed=9, step=step)
    return state


def _near_threshold(y: torch.Tensor, qmap: Q.QuantMap) -> torch.Tensor:
    t = qmap.thresholds[:-1].double()
    a = y.abs().double()
    i = torch.searchsorted(t, a).clamp(1, t.numel() - 1)
    d = torch.minimum((a - t[i - 1]).abs(), (a - t[i]).abs())
    d = torch.minimum(d, (a - t[(i + 1).clamp_max(t.numel() - 1)]).abs())
    return d <= NEAR_TIE * a.clamp_min(1e-30)


def _check_codes(mine_codes, mine_scale, ref_codes, ref_scale, values, qmap, block, what):
    assert torch.isfinite(ref_scale).all()
    rel = ((mine_scale.double() - ref_scale.double()).abs() / ref_scale.double().clamp_min(1e-30))
    assert bool((rel <= FP32_ULPS).all()), f"{what}: scales beyond 16 ulps, worst {rel.max().item():.3g}"
    y = values * (torch.full_like(ref_scale, qmap.top) / ref_scale).repeat_interleave(block)[: values.numel()]
    differs = mine_codes != ref_codes
    allowed = _near_threshold(y, qmap)
    assert not bool((differs & ~allowed).any()), (
        f"{what}: {int((differs & ~allowed).sum())} codes differ away from any threshold")


def _one_step(isa, cfg, n, hyper, grad_dtype, out_dtype, seed):
    K.set_isa(isa)
    state = _warm_state(cfg, n, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    grad = (torch.randn(n, generator=gen) * 0.01).to(grad_dtype)
    h = _hyper(hyper, 4)
    mine, ref = _clone(state), _clone(state)
    out = None if out_dtype is None else torch.empty(n, dtype=out_dtype)
    ref_out = None if out_dtype is None else torch.empty(n, dtype=out_dtype)
    K.adam_q8_update(mine, grad, out, config=cfg, **h, seed=11, step=4)
    w_ref, m_ref, s_ref = Q.adam_q8_math(state, grad, config=cfg, **h)
    Q.adam_q8_reference(ref, grad, ref_out, config=cfg, **h, seed=11, step=4)

    w_old = state["master"].float()
    if cfg.master == "bf16_kahan":
        w_old = Q.kahan_value(state["master"], state["master.comp"])
    scale = torch.stack([w_old.abs(), w_ref.abs(), (w_ref - w_old).abs()]).amax(0).double()
    if cfg.master == "fp32":
        err = (mine["master"].double() - w_ref.double()).abs()
        assert bool((err <= FP32_ULPS * scale + 1e-30).all()), f"fp32 master off by {err.max().item():.3g}"
    elif cfg.master == "bf16_kahan":
        # master + comp holds w to 2**-17 of a bf16 ulp (<= 2**-24 |w|)
        full = Q.kahan_value(mine["master"], mine["master.comp"]).double()
        err = (full - w_ref.double()).abs()
        assert bool((err <= FP32_ULPS * scale + 2.0**-23 * w_ref.abs().double() + 1e-30).all())
        assert bool(((mine["master"].double() - ref["master"].double()).abs()
                     <= BF16_ULP * ref["master"].double().abs() + 1e-30).all())
    else:
        diff = mine["master"] != ref["master"]
        assert bool(((mine["master"].double() - ref["master"].double()).abs()
                     <= BF16_ULP * ref["master"].double().abs() + 1e-30).all())
        assert diff.float().mean().item() <= 1e-3, f"{int(diff.sum())} stochastic roundings differ"
    mc, vc = cfg.codes_key("exp_avg"), cfg.codes_key("exp_avg_sq")
    _check_codes(mine[mc], mine["exp_avg.scale"], ref[mc], ref["exp_avg.scale"],
                 m_ref, cfg.m_map, cfg.block_size, "exp_avg")
    _check_codes(mine[vc], mine["exp_avg_sq.scale"], ref[vc], ref["exp_avg_sq.scale"], s_ref, cfg.v_map,
                 cfg.block_size, "exp_avg_sq")
    if out is not None:
        if cfg.master == "bf16_sr":
            expect = mine["master"].float().to(out_dtype)
        elif cfg.master == "bf16_kahan":
            expect = mine["master"].to(out_dtype) if out_dtype == torch.bfloat16 else None
        else:
            expect = mine["master"].to(out_dtype)
        if expect is not None:
            assert torch.equal(out.view(torch.int16), expect.view(torch.int16)), \
                "weight_out must be the step's fp32 weight rounded to nearest even"
        assert bool(((out.double() - ref_out.double()).abs()
                     <= 2.0**-7 * ref_out.double().abs() + 1e-30).all())


@pytest.mark.parametrize("isa", NATIVE_ISAS)
@pytest.mark.parametrize("master", Q.MASTER_MODES)
@pytest.mark.parametrize("maps", Q.MAP_FAMILIES)
def test_one_step_matches_reference(isa, master, maps, isa_and_threads):
    """Every map family, master mode, hyper-parameter set, gradient dtype and weight_out dtype,
    sizes that leave a partial last block and a scalar tail, block sizes 64 and 256."""
    K.set_num_threads(1)
    combos = [("adamw", torch.bfloat16, torch.bfloat16, 257, 64),
              ("adam-l2-max-scaled", torch.float32, torch.float16, 255, 256),
              ("adamw-lowbeta", torch.float16, None, 1, 256),
              ("adamw", torch.float32, torch.bfloat16, 4096 + 17, 256)]
    for k, (hyper, g, o, n, block) in enumerate(combos):
        _one_step(isa, Q.QuantConfig(block, master, maps), n, hyper, g, o, seed=100 + k)


@pytest.mark.parametrize("isa", NATIVE_ISAS)
@pytest.mark.parametrize("threads", [1, 2])
def test_one_step_large(isa, threads, isa_and_threads):
    """2**20 + 3 elements: many tasks, a partial last block."""
    K.set_num_threads(threads)
    master = Q.MASTER_MODES[(threads + NATIVE_ISAS.index(isa)) % 3]  # each mode on some ISA
    maps = Q.MAP_FAMILIES[threads - 1]  # each family on every ISA
    _one_step(isa, Q.QuantConfig(256, master, maps), 2**20 + 3, "adamw", torch.bfloat16, torch.bfloat16, seed=7)


@pytest.mark.parametrize("isa", NATIVE_ISAS)
@pytest.mark.parametrize("master", Q.MASTER_MODES)
@pytest.mark.parametrize("maps", Q.MAP_FAMILIES)
def test_seven_steps_track_reference(isa, master, maps, isa_and_threads):
    """Both sides run 7 steps on their own state; the bounds are in the module docstring."""
    K.set_isa(isa)
    n, lr, steps = 2**16 + 37, 1e-3, 7
    cfg = Q.QuantConfig(256, master, maps)
    w0 = torch.randn(n, generator=torch.Generator().manual_seed(0))
    mine, ref = cfg.init_state(w0), cfg.init_state(w0)
    gen = torch.Generator().manual_seed(1)
    for step in range(1, steps + 1):
        g = (torch.randn(n, generator=gen) * 0.01).bfloat16()
        h = _hyper("adamw", step)
        K.adam_q8_update(mine, g, config=cfg, **h, seed=5, step=step)
        Q.adam_q8_reference(ref, g, config=cfg, **h, seed=5, step=step)
    w, w_ref = cfg.export_full(mine)["param"], cfg.export_full(ref)["param"]
    beyond = (w - w_ref).abs() > STEP_DRIFT[maps] * lr * steps
    if master == "bf16_sr":
        ulp_apart = (w.double() - w_ref.double()).abs() <= BF16_ULP * w_ref.double().abs()
        assert bool(ulp_apart[beyond].all()) and beyond.float().mean().item() <= 1e-3, int(beyond.sum())
    else:
        assert not bool(beyond.any()), (w - w_ref).abs().max().item()
    assert (w - w0).abs().mean().item() > 0.2 * lr * steps  # the weights did move (measured 0.38)
    for part in (cfg.codes_key("exp_avg"), cfg.codes_key("exp_avg_sq")):
        assert (mine[part] != ref[part]).float().mean().item() < 0.01, part


@pytest.mark.parametrize("isa", NATIVE_ISAS)
@pytest.mark.parametrize("maps", Q.MAP_FAMILIES)
def test_threads_and_chunking_do_not_change_bits(isa, maps, isa_and_threads):
    """Stochastic rounding included: the same bits at 1 and 2 threads, and when the parameter
    is updated as two pieces cut at a block boundary with index_offset."""
    K.set_isa(isa)
    n = 2**20 + 3
    cfg = Q.QuantConfig(256, "bf16_sr", maps)
    state = _warm_state(cfg, n, seed=3, steps=1)
    g = torch.randn(n, generator=torch.Generator().manual_seed(4)).bfloat16()
    h = _hyper("adamw", 2)
    results = []
    for threads in (1, 2):
        K.set_num_threads(threads)
        s = _clone(state)
        K.adam_q8_update(s, g, config=cfg, **h, seed=77, step=2)
        results.append(s)
    for name in state:
        assert torch.equal(results[0][name], results[1][name]), name
    cut = 256 * 1000
    pieces = _clone(state)
    for lo, hi in ((0, cut), (cut, n)):
        part = {"master": pieces["master"][lo:hi]}
        for m in ("exp_avg", "exp_avg_sq"):
            part[cfg.codes_key(m)] = pieces[cfg.codes_key(m)][lo:hi]
            part[f"{m}.scale"] = pieces[f"{m}.scale"][lo // 256: (hi + 255) // 256]
        K.adam_q8_update(part, g[lo:hi], config=cfg, **h, seed=77, step=2, index_offset=lo)
    for name in state:
        assert torch.equal(pieces[name], results[0][name]), name


def test_vector_isas_agree_bit_for_bit(isa_and_threads):
    """AVX2 and AVX-512 round every operation alike (FMA in both): identical bits."""
    isas = [i for i in NATIVE_ISAS if i != "scalar"]
    if len(isas) < 2:
        pytest.skip(f"needs two vector ISA variants, this CPU runs {NATIVE_ISAS}")
    for master, maps in ((m, f) for m in Q.MASTER_MODES for f in Q.MAP_FAMILIES):
        cfg = Q.QuantConfig(256, master, maps)
        state = _warm_state(cfg, 10_000 + 5, seed=8)
        g = torch.randn(10_005, generator=torch.Generator().manual_seed(9)).bfloat16()
        outs = []
        for isa in isas:
            K.set_isa(isa)
            s = _clone(state)
            K.adam_q8_update(s, g, config=cfg, **_hyper("adamw", 4), seed=1, step=4)
            outs.append(s)
        for s in outs[1:]:
            for name in state:
                assert torch.equal(s[name], outs[0][name]), (master, maps, name)


@pytest.mark.parametrize("isa", NATIVE_ISAS)
def test_non_finite_gradient_blocks(isa, isa_and_threads):
    """A NaN or inf gradient makes its block's new moments non-finite: that block's scales
    are NaN and its codes 0 (quant.py), wherever in the block it sits (each lane of a
    vector, the scalar tail of a last, partial block of 37), as in the reference; the other
    blocks are updated as usual."""
    K.set_isa(isa)
    block, nblocks = 64, 15
    n = block * (nblocks - 1) + 37
    for master, maps in (("fp32", "fp8"), ("bf16_kahan", "dynamic")):
        cfg = Q.QuantConfig(block, master, maps)
        state = _warm_state(cfg, n, seed=21)
        g = torch.randn(n, generator=torch.Generator().manual_seed(22)) * 0.01
        bad = {0: math.nan, 3: math.inf, 7: -math.inf, 15: math.nan, 16: math.nan, 31: math.nan, 63: math.inf,
               35: math.nan}  # the last in the last block's tail
        for k, (pos, value) in enumerate(bad.items()):
            g[(2 * k) * block + pos] = value  # the even blocks 0, 2, ..., 14
        mine, ref = _clone(state), _clone(state)
        K.adam_q8_update(mine, g, config=cfg, **_hyper("adamw", 4), seed=3, step=4)
        Q.adam_q8_reference(ref, g, config=cfg, **_hyper("adamw", 4), seed=3, step=4)
        for key in ("exp_avg", "exp_avg_sq"):
            codes, scale = mine[cfg.codes_key(key)], mine[f"{key}.scale"]
            hit = torch.zeros(nblocks, dtype=torch.bool)
            hit[0: 2 * len(bad): 2] = True
            assert torch.isnan(scale[hit]).all(), (master, maps, key)
            in_hit = hit.repeat_interleave(block)[:n]
            assert (codes[in_hit] == 0).all() and torch.equal(codes[in_hit], ref[cfg.codes_key(key)][in_hit])
            assert torch.isnan(ref[f"{key}.scale"][hit]).all()
            assert torch.isfinite(scale[~hit]).all(), (master, maps, key)
            rel = (scale[~hit].double() - ref[f"{key}.scale"][~hit].double()).abs() / ref[f"{key}.scale"][~hit].double()
            assert bool((rel <= FP32_ULPS).all()), (master, maps, key)


@pytest.mark.parametrize("isa", GATHER_ISAS)
def test_gather_and_loads_agree_bit_for_bit(isa, isa_and_threads):
    """The table maps' ways of looking codes up (a gather, a load per lane; the decode of a
    block at once by byte permutes where the CPU has AVX512-VBMI, or per vector) give one
    state, every master mode, at both thread counts (the other tests run whichever
    dispatch.cpp's timing chose, with the block decode where it is possible). 2**16 + 5
    values: the last block has 5, decoded past the byte permutes' 64 at a time."""
    K.set_isa(isa)
    for master in Q.MASTER_MODES:
        cfg = Q.QuantConfig(256, master, "dynamic")
        state = _warm_state(cfg, 2**16 + 5, seed=21)
        g = torch.randn(2**16 + 5, generator=torch.Generator().manual_seed(22)).bfloat16()
        outs = []
        for lookup, threads, rows in (("gather", 1, False), ("loads", 2, False), ("gather", 2, True),
                                      ("loads", 1, True)):
            K.set_q8_table_lookup(lookup)
            K.set_q8_row_decode(rows)
            K.set_num_threads(threads)
            s, out = _clone(state), torch.empty(g.numel(), dtype=torch.bfloat16)
            K.adam_q8_update(s, g, out, config=cfg, **_hyper("adamw", 4), seed=1, step=4)
            outs.append((s, out))
        for s, out in outs[1:]:
            assert torch.equal(out.view(torch.int16), outs[0][1].view(torch.int16)), master
            for name in state:
                assert torch.equal(s[name], outs[0][0][name]), (master, name)


def _tiny_update_run(isa: str, master: str, steps: int, reset_comp: bool = False):
    """w in [1, 2) with an Adam step of lr = 1e-4 per step, far below bf16's half ulp there
    (2**-8 = 3.9e-3): constant gradient, no weight decay, so every mode sees the same update."""
    K.set_isa(isa)
    n = 4096
    cfg = Q.QuantConfig(256, master)
    w0 = 1 + torch.rand(n, generator=torch.Generator().manual_seed(2))
    state = cfg.init_state(w0)
    g = torch.full((n,), 0.5)
    h = dict(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True)
    if reset_comp:
        state["master.comp"].zero_()  # a plain bf16 master starts at bf16(w0)
    for step in range(1, steps + 1):
        K.adam_q8_update(state, g, config=cfg, **h, bias_correction1=1 - 0.9**step,
                         bias_correction2=1 - 0.999**step, seed=3, step=step)
        if reset_comp:
            state["master.comp"].zero_()
    return w0, cfg.export_full(state)["param"]


@pytest.mark.parametrize("isa", NATIVE_ISAS)
def test_kahan_tracks_fp32_where_bf16_stalls(isa, isa_and_threads):
    """1000 steps of ~1e-4: fp32 moves every weight by ~0.1; a bf16 master rounded to nearest
    (Kahan's kernel with comp zero before every step) does not move at all; bf16 with
    compensation stays within 2**-16 of fp32 (measured 4.3e-6 on every ISA: 36 fp32 ulps,
about what 1000 roundings of the fp32 run itself leave; a bf16 compensation term drifted
2.6e-3 here), and stochastic
    rounding is unbiased: its mean error over 4096 weights is within 1e-4 (measured 4.2e-6)
    while single weights wander like a random walk of bf16 ulps (measured max 0.11, std 0.027)."""
    steps = 1000
    w0, w32 = _tiny_update_run(isa, "fp32", steps)
    _, plain = _tiny_update_run(isa, "bf16_kahan", steps, reset_comp=True)
    _, kahan = _tiny_update_run(isa, "bf16_kahan", steps)
    _, sr = _tiny_update_run(isa, "bf16_sr", steps)
    moved = (w32 - w0).abs()
    assert moved.min().item() > 0.09
    stall = (plain - w0.bfloat16().float()).abs().max().item()
    assert stall == 0.0, f"plain bf16 moved by {stall}: the test's updates are not below its resolution"
    kahan_err = (kahan - w32).abs().max().item()
    assert kahan_err <= 2.0**-16, f"Kahan master off fp32 by {kahan_err:.3g}"
    sr_bias = (sr - w32).mean().abs().item()
    assert sr_bias <= 1e-4, f"stochastic rounding biased by {sr_bias:.3g}"
    assert (sr - w32).abs().max().item() <= 0.25


def test_stochastic_rounding_reference_properties():
    """SR of a value between two bf16 neighbours picks one of them, with the probability of
    its distance, for a fixed key a fixed choice per index, and changes with seed and step."""
    lo = torch.tensor(1.0).bfloat16().float().item()
    x = torch.full((100_000,), lo + 0.25 * 2.0**-7)
    r = Q.round_bf16_stochastic(x, Q.sr_key(1, 1)).float()
    assert set(r.unique().tolist()) == {lo, lo + 2.0**-7}
    assert abs((r == lo + 2.0**-7).float().mean().item() - 0.25) < 0.01
    assert torch.equal(r, Q.round_bf16_stochastic(x, Q.sr_key(1, 1)).float())
    assert not torch.equal(r, Q.round_bf16_stochastic(x, Q.sr_key(2, 1)).float())
    assert not torch.equal(r, Q.round_bf16_stochastic(x, Q.sr_key(1, 2)).float())
    special = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, -0.0])
    out = Q.round_bf16_stochastic(special, 123)
    assert out.view(torch.int16).tolist()[:2] == [0x7F80, -128] and torch.isnan(out[2])
    assert out.view(torch.int16)[2].item() == 0x7FC0


def test_face_refuses_bad_state():
    cfg = Q.QuantConfig(256, "bf16_kahan")
    state = cfg.init_state(torch.randn(300))
    g = torch.randn(300)
    h = _hyper("adamw", 1)
    bad = dict(state)
    del bad["master.comp"]
    with pytest.raises(ValueError, match="state lacks master.comp"):
        K.adam_q8_update(bad, g, config=cfg, **h)
    bad = dict(state, **{"exp_avg.scale": torch.zeros(1)})
    with pytest.raises(ValueError, match="exp_avg.scale'\\] has 1 elements"):
        K.adam_q8_update(bad, g, config=cfg, **h)
    bad = dict(state, **{"master": state["master"].float()})
    with pytest.raises(TypeError, match="must be bfloat16"):
        K.adam_q8_update(bad, g, config=cfg, **h)
    with pytest.raises(ValueError, match="index_offset"):
        K.adam_q8_update(state, g, config=cfg, **h, index_offset=2**32 - 10)
    with pytest.raises(ValueError, match="block_size=100"):
        Q.QuantConfig(100)
    with pytest.raises(ValueError, match="master='bf16'"):
        Q.QuantConfig(256, "bf16")
    assert Q.QuantConfig(256, "bf16_sr").bytes_per_param() == pytest.approx(4.03125)
    assert Q.QuantConfig(256, "fp32").bytes_per_param() == pytest.approx(6.03125)


@pytest.mark.parametrize("isa", NATIVE_ISAS)
def test_kahan_compensation_at_every_exponent(isa, isa_and_threads):
    """The compensation's unit (2**(max(e, 24) - 150) and its inverse, comp_unit) at every bf16
    exponent field, +-0, subnormals, the largest finite values, inf and NaN: with lr 0 and no
    weight decay the step rewrites master + comp from the same fp32 weight, so every ISA must
    give the reference's bits; and where comp * unit lies within half a bf16 ulp of the master
    (e >= 24, finite, not a power of two, below which the ulp halves) it gives back the same
    master and comp."""
    K.set_isa(isa)
    cfg = Q.QuantConfig(256, "bf16_kahan", "fp8")
    gen = torch.Generator().manual_seed(5)
    fields = torch.arange(256, dtype=torch.int32).repeat_interleave(16)  # 16 masters per exponent field
    mantissa = torch.randint(0, 128, (fields.numel(),), generator=gen, dtype=torch.int32)
    sign = torch.randint(0, 2, (fields.numel(),), generator=gen, dtype=torch.int32) << 15
    bits16 = sign | (fields << 7) | mantissa
    n = bits16.numel()
    state = cfg.init_state(torch.zeros(n))
    state["master"].copy_(bits16.to(torch.int16).view(torch.bfloat16))
    state["master.comp"].copy_(torch.randint(-32767, 32768, (n,), generator=gen, dtype=torch.int16))
    grad = torch.randn(n, generator=gen) * 1e-3
    hyper = dict(_hyper("adamw", 1), lr=0.0, weight_decay=0.0)
    mine, ref = _clone(state), _clone(state)
    K.adam_q8_update(mine, grad, config=cfg, **hyper, seed=3, step=1)
    Q.adam_q8_reference(ref, grad, config=cfg, **hyper, seed=3, step=1)
    same_master = mine["master"].view(torch.int16) == ref["master"].view(torch.int16)
    nan = torch.isnan(ref["master"].float())
    assert bool((same_master | (nan & torch.isnan(mine["master"].float()))).all()), \
        f"{isa}: masters differ at exponent fields {sorted(set(fields[~same_master].tolist()))}"
    same_comp = mine["master.comp"] == ref["master.comp"]
    assert bool(same_comp.all()), f"{isa}: comp differs at exponent fields {sorted(set(fields[~same_comp].tolist()))}"
    kept = (fields >= 24) & (fields < 255) & (mantissa != 0)
    assert torch.equal(mine["master"].view(torch.int16)[kept], state["master"].view(torch.int16)[kept])
    assert torch.equal(mine["master.comp"][kept], state["master.comp"][kept])


@pytest.mark.parametrize("isa", NATIVE_ISAS)
def test_kahan_compensation_saturates_where_the_master_overflows(isa, isa_and_threads):
    """A step that carries w past bf16's largest value (+-3.3895e38, within fp32) rounds the
    master to +-inf, so w - master is -+inf: the compensation saturates to -32768 / 32767 (and
    a NaN one is 0), as comp_to_i16 says, on every ISA."""
    K.set_isa(isa)
    cfg = Q.QuantConfig(64, "bf16_kahan", "fp8")
    n = 256
    top = torch.tensor([0x7F7F], dtype=torch.int16).view(torch.bfloat16).float().item()  # bf16's largest
    sign = torch.tensor([1.0, -1.0]).repeat(n // 2)
    state = cfg.init_state(torch.zeros(n))
    state["master"].copy_((sign * top).bfloat16())
    state["master.comp"].copy_(torch.arange(n, dtype=torch.int16) * 97 - 12000)
    grad = -sign * torch.linspace(0.5, 2.0, n)  # minus the update's direction: pushes |w| up
    hyper = dict(_hyper("adamw", 1), lr=7e35, weight_decay=0.0)  # past the half ulp (6.6e35) at the top
    mine, ref = _clone(state), _clone(state)
    K.adam_q8_update(mine, grad, config=cfg, **hyper, seed=3, step=1)
    Q.adam_q8_reference(ref, grad, config=cfg, **hyper, seed=3, step=1)
    assert torch.equal(mine["master"].view(torch.int16), ref["master"].view(torch.int16))
    assert torch.equal(mine["master.comp"], ref["master.comp"])
    overflowed = torch.isinf(ref["master"].float())
    assert int(overflowed.sum()) > n // 4, "the case must reach the saturation"
    assert set(ref["master.comp"][overflowed].tolist()) <= {-32768, 32767, 0}
