"""ts.AdamW / ts.Adam on compressed state (``Offload(moment_dtype="q8", master_dtype=...)``)
against the algorithm run by hand on each whole parameter.

Two references:
- the fused kernel face (``tierstate.kernels.adam_q8_update``) on a whole parameter's state:
  the optimizer cuts parameters into sub-groups (and tiers) on block boundaries, and the
  kernel's blocks, stochastic-rounding indices and arithmetic do not depend on the cut, so
  every state part and every weight must be *identical*, on the host tier, the NVMe tier and
  a split of both;
- the pure-torch reference (``quant.adam_q8_reference``), within the tolerance the kernel
  tests document (tests/kernels/test_kernels_q8_update.py): |w - w_ref| <= 0.05 * lr * steps
  (0.15 for the fp8 maps, whose code steps are up to 12.5 % of the value) and codes differing
  in < 1 % of the elements (a value within 2**-18 of a map threshold may take the other code,
  then carry that one-code difference on).
"""
from __future__ import annotations

import pytest
import torch

import tierstate as ts
import tierstate.kernels as K
from tierstate.kernels import quant as Q

STEPS = 8
LR, WD = 1e-2, 0.1
SHAPES = [(37, 300), (1000,), (5,), (64, 64), (3, 7)]  # straddle blocks, sub-groups and tiers


def _native() -> bool:
    return any(isa != "reference" for isa in K.available_isas())


def _params(dtype: torch.dtype) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(5)
    return [torch.nn.Parameter(torch.randn(*shape, generator=gen).to(dtype)) for shape in SHAPES]


def _grads(step: int, params) -> list[torch.Tensor | None]:
    gen = torch.Generator().manual_seed(100 + step)
    out = []
    for i, p in enumerate(params):
        g = (torch.randn(p.shape, generator=gen) * 10.0 ** (-2 * torch.rand(p.shape, generator=gen))).to(p.dtype)
        out.append(None if (i == 2 and step in (2, 5)) else g)  # a parameter without gradient on some steps
    return out


def _own_master(dtype, master: str) -> bool:
    """A host parameter is its own master where its dtype is the master's: fp32 under an fp32
    master, bf16 under a bf16 one (the kernel then updates it in place)."""
    return (dtype == torch.float32 and master == "fp32") or (dtype == torch.bfloat16 and master != "fp32")


def _by_hand(dtype, master: str, steps: int, *, reference_path: bool, decoupled: bool = True, maps="dynamic"):
    """Each whole parameter stepped with the kernel face (or the pure-torch reference)."""
    cfg = Q.QuantConfig(block_size=256, master=master, maps=maps)
    params = _params(dtype)
    states: list[dict | None] = [None] * len(params)
    counts = [0] * len(params)
    for step in range(1, steps + 1):
        for i, (p, g) in enumerate(zip(params, _grads(step, params))):
            if g is None:
                continue
            if states[i] is None:
                states[i] = cfg.init_state(p.detach().float().reshape(-1))
            counts[i] += 1
            st = states[i]
            own_master = _own_master(dtype, master)
            if own_master:
                st["master"] = p.data.view(-1)
            out = p.data.view(-1) if dtype != torch.float32 and not own_master else None
            kwargs = dict(config=cfg, lr=LR, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=WD, decoupled=decoupled,
                          bias_correction1=1 - 0.9 ** counts[i], bias_correction2=1 - 0.999 ** counts[i],
                          seed=Q.param_seed(7, i), step=counts[i], index_offset=0)
            if reference_path:
                Q.adam_q8_reference(st, g.reshape(-1), out, **kwargs)
            else:
                K.adam_q8_update(st, g.reshape(-1).contiguous(), out, **kwargs)
            if dtype == torch.float32 and master != "fp32":
                p.data.view(-1).copy_(Q.master_value(cfg, st))
    return params, states


def _by_optimizer(dtype, master: str, offload_kwargs: dict, steps: int, *, cls=ts.AdamW, maps="dynamic"):
    params = _params(dtype)
    master_dtype = torch.float32 if master == "fp32" else master
    offload = ts.Offload(moment_dtype="q8", master_dtype=master_dtype, quant_block=256, sr_seed=7,
                         subgroup_numel=2048, buffer_count=2, quant_map=maps, **offload_kwargs)
    opt = cls(params, lr=LR, offload=offload, weight_decay=WD)
    for step in range(1, steps + 1):
        for p, g in zip(params, _grads(step, params)):
            p.grad = g
        opt.step()
    sd = opt.state_dict()
    opt.close()
    return params, sd


TIERS = {
    "cpu": dict(cpu=1.0),
    "nvme": dict(cpu=0.0, nvme=1.0),
    "split": dict(cpu=0.45, nvme=0.55),
}


def _offload(tier: str, tmp_path) -> dict:
    kw = dict(TIERS[tier])
    if kw.get("nvme"):
        kw["nvme_dir"] = str(tmp_path / "nvme")
    return kw


def _state_parts(st: dict, dtype, master: str, maps: str = "dynamic") -> dict:
    part = Q.CODES_PART[maps]
    keys = [f"exp_avg.{part}", "exp_avg.scale", f"exp_avg_sq.{part}", "exp_avg_sq.scale"]
    if not _own_master(dtype, master):
        keys.append("master")
    if master == "bf16_kahan":
        keys.append("master.comp")
    return {k: st[k].reshape(-1) for k in keys}


@pytest.mark.skipif(not _native(), reason="the native kernels did not load")
@pytest.mark.parametrize("tier", list(TIERS))
@pytest.mark.parametrize("master", Q.MASTER_MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("maps", Q.MAP_FAMILIES)
def test_q8_optimizer_equals_kernel_on_whole_parameters(tier, master, dtype, maps, tmp_path):
    want_params, want_states = _by_hand(dtype, master, STEPS, reference_path=False, maps=maps)
    got_params, sd = _by_optimizer(dtype, master, _offload(tier, tmp_path), STEPS, maps=maps)
    for i, (w, g) in enumerate(zip(want_params, got_params)):
        assert torch.equal(w.detach(), g.detach()), \
            f"parameter {i} ({tier}, {master}, {dtype}) differs from the kernel on the whole parameter"
        st = sd["state"][i]
        assert int(st["step"]) == (STEPS - 2 if i == 2 else STEPS)
        for key, value in _state_parts(want_states[i], dtype, master, maps).items():
            assert st[key].dtype == value.dtype, key
            assert torch.equal(st[key].reshape(-1), value), f"parameter {i}: state {key!r} differs ({tier}, {master})"
        # exactly these parts: a parameter that is its own master keeps no copy of itself
        assert sorted(k for k in st if k != "step") == sorted(_state_parts(want_states[i], dtype, master, maps))


@pytest.mark.parametrize("tier", ["cpu", "split"])
@pytest.mark.parametrize("master", Q.MASTER_MODES)
@pytest.mark.parametrize("maps", Q.MAP_FAMILIES)
def test_q8_optimizer_within_tolerance_of_pure_torch_reference(tier, master, maps, tmp_path):
    dtype = torch.bfloat16 if master != "fp32" else torch.float32
    want_params, want_states = _by_hand(dtype, master, STEPS, reference_path=True, maps=maps)
    got_params, sd = _by_optimizer(dtype, master, _offload(tier, tmp_path), STEPS, maps=maps)
    bound = {"dynamic": 0.05, "fp8": 0.15}[maps] * LR * STEPS
    cfg = Q.QuantConfig(256, master, maps)
    for i, (w, g) in enumerate(zip(want_params, got_params)):
        st = dict(sd["state"][i])
        st.setdefault("master", g.detach().reshape(-1))  # a parameter that is its own master
        got_w = Q.master_value(cfg, {k: v.reshape(-1) for k, v in st.items() if k.startswith("master")})
        want_w = Q.master_value(cfg, want_states[i])
        # bf16_sr: a weight that moved differently by < 1 fp32 ulp may round to the other bf16
        slack = 2.0**-7 * want_w.abs() if master == "bf16_sr" else 0.0
        assert bool(((got_w - want_w).abs() <= bound + slack).all()), \
            f"parameter {i}: |w - w_ref| up to {(got_w - want_w).abs().max().item():.3g} > {bound}"
        for key in (cfg.codes_key("exp_avg"), cfg.codes_key("exp_avg_sq")):
            differs = (st[key].reshape(-1) != want_states[i][key]).float().mean().item()
            assert differs < 0.01, f"parameter {i}: {differs:.2%} of {key} differ from the pure-torch reference"


def test_q8_optimizer_with_reference_isa_is_the_pure_torch_reference(tmp_path):
    """set_isa('reference') routes the optimizer through quant.adam_q8_reference: identical results."""
    with K.use_isa("reference"):
        got_params, sd = _by_optimizer(torch.bfloat16, "bf16_kahan", _offload("split", tmp_path), STEPS)
    want_params, want_states = _by_hand(torch.bfloat16, "bf16_kahan", STEPS, reference_path=True)
    for i, (w, g) in enumerate(zip(want_params, got_params)):
        assert torch.equal(w.detach(), g.detach())
        for key, value in _state_parts(want_states[i], torch.bfloat16, "bf16_kahan").items():
            assert torch.equal(sd["state"][i][key].reshape(-1), value), key


@pytest.mark.skipif(not _native(), reason="the native kernels did not load")
def test_adam_l2_on_q8_matches_kernel(tmp_path):
    want_params, want_states = _by_hand(torch.bfloat16, "fp32", STEPS, reference_path=False, decoupled=False)
    got_params, sd = _by_optimizer(torch.bfloat16, "fp32", _offload("split", tmp_path), STEPS, cls=ts.Adam)
    for i, (w, g) in enumerate(zip(want_params, got_params)):
        assert torch.equal(w.detach(), g.detach()), f"parameter {i}"
        for key, value in _state_parts(want_states[i], torch.bfloat16, "fp32").items():
            assert torch.equal(sd["state"][i][key].reshape(-1), value), key
