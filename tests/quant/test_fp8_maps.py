"""The fp8 map family (``Offload(moment_dtype="q8", quant_map="fp8")``): its definition, the
option's refusals, and a state that names its maps wherever it goes (state dict, conversion,
checkpoint). The kernels' bits against the reference are in tests/kernels/test_kernels_quant.py
and test_kernels_q8_update.py, the optimizer's in test_q8_optimizer_parity.py."""
from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys

import pytest
import torch

import tierstate as ts
from _q8_common import assert_same_state_then_same_steps, make_params, q8_offload, raw_bytes
from _q8_common import train as _train
from tierstate.checkpoint.compressed import StateFormatWarning
from tierstate.kernels import quant as Q
from tierstate.placement import defaults
from tierstate.placement.auto import offload_from_plan
from tierstate.placement.model_spec import from_param_numels
from tierstate.placement.plan_inputs import Budgets, Hardware, PlanRequest
from tierstate.placement.planner import choose


def test_fp8_magnitudes_are_the_documented_floats():
    """4 exponent bits, bias 15, subnormals below 2**-14, no inf or NaN: every code by hand."""
    for m, make in ((3, Q.fp8_signed_map), (4, Q.fp8_unsigned_map)):
        qmap = make()
        mags = qmap.magnitudes.double()
        assert mags.numel() == 2 ** (4 + m) and qmap.fp8_mantissa_bits == m
        for c in range(mags.numel()):
            e, f = c >> m, c % 2**m
            want = c * 2.0 ** -(14 + m) if e == 0 else (1 + f / 2**m) * 2.0 ** (e - 15)
            assert mags[c].item() == want, c
        assert bool((mags[1:] > mags[:-1]).all())
        assert qmap.top == mags[-1].item() == 2 - 2.0**-m  # 1.875 and 1.9375
    signed = Q.fp8_signed_map()
    assert torch.equal(signed.table[128:], -signed.table[:128])  # bit 7 is the sign, 128 is -0.0
    assert math.copysign(1.0, signed.table[128].item()) == -1.0


def test_placement_knows_the_families_and_their_part_names():
    """placement/defaults.py keeps its own copy (it must not import the kernels)."""
    assert defaults.QUANT_MAPS == Q.MAP_FAMILIES and defaults.QUANT_CODES_PART == Q.CODES_PART
    for maps in Q.MAP_FAMILIES:
        b = defaults.state_bytes_per_element("q8", "fp32", 256, quant_map=maps)
        assert set(b) == {f"exp_avg.{Q.CODES_PART[maps]}", "exp_avg.scale", f"exp_avg_sq.{Q.CODES_PART[maps]}",
                          "exp_avg_sq.scale", "master"}
        assert sum(b.values()) == pytest.approx(6.03125)  # the same bytes in both families
    assert set(Q.QuantConfig(256, "bf16_sr", "fp8").state_spec(10)) == {
        "exp_avg.fp8", "exp_avg.scale", "exp_avg_sq.fp8", "exp_avg_sq.scale", "master"}


def test_the_option_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match=r"Offload\(quant_map='fp4'\): must be one of 'dynamic', 'fp8'"):
        ts.Offload(moment_dtype="q8", quant_map="fp4")
    with pytest.raises(ValueError, match=r"quant_map='fp8', moment_dtype=torch.bfloat16\).*add moment_dtype='q8'"):
        ts.Offload(moment_dtype=torch.bfloat16, quant_map="fp8")
    with pytest.raises(ValueError, match=r"QuantConfig.maps='fp4'"):
        Q.QuantConfig(256, "fp32", "fp4")
    assert ts.Offload(moment_dtype="q8", quant_map="fp8").quant_config() == Q.QuantConfig(256, "fp32", "fp8")


def _fp8_offload(folder, master="fp32", nvme=0.5, maps="fp8"):
    return q8_offload(folder, master, nvme, maps=maps)


@pytest.mark.parametrize("master", Q.MASTER_MODES)
def test_state_dict_names_the_maps_and_round_trips_to_the_byte(master, tmp_path):
    params = make_params()
    opt = ts.AdamW(params, lr=1e-2, offload=_fp8_offload(tmp_path / "a", master))
    _train(opt, params, 3)
    sd = opt.state_dict()
    st = sd["state"][0]
    assert {"exp_avg.fp8", "exp_avg_sq.fp8"} <= set(st) and not any(k.endswith(".codes") for k in st)
    cfg = Q.QuantConfig(256, master, "fp8")
    parts = {k: v.reshape(-1) for k, v in st.items() if k != "step"}
    parts.setdefault("master", params[0].detach().reshape(-1))  # a bf16 parameter is its own bf16 master
    full = cfg.export_full(parts)
    assert torch.isfinite(full["exp_avg"]).all() and (full["exp_avg"] != 0).any()
    params2 = make_params()
    opt2 = ts.AdamW(params2, lr=1e-2, offload=_fp8_offload(tmp_path / "b", master, nvme=0.0))
    opt2.load_state_dict(copy.deepcopy(sd))  # the same format: no conversion, no warning
    assert_same_state_then_same_steps(opt, params, opt2, params2, seed=5)
    opt.close(), opt2.close()


def test_loading_the_other_family_converts_with_a_warning(tmp_path):
    """dynamic -> fp8 and back: the moments are decoded with the maps their part names say and
    encoded with the target's; the compensation of the bf16 parameters (their own masters)
    moves unchanged."""
    params = make_params()
    dyn = ts.AdamW(params, lr=1e-2, offload=_fp8_offload(tmp_path / "d", "bf16_kahan", maps="dynamic"))
    _train(dyn, params, 3)
    dsd = dyn.state_dict()
    fp8_params = make_params()
    for q, p in zip(fp8_params, params):  # the model's weights, loaded beside the optimizer's state
        q.data.copy_(p.data)
    fp8 = ts.AdamW(fp8_params, lr=1e-2, offload=_fp8_offload(tmp_path / "f", "bf16_kahan"))
    with pytest.warns(StateFormatWarning, match=r"converted the state of 3 parameter.*quant_map='fp8'"):
        fp8.load_state_dict(dsd)
    fsd = fp8.state_dict()
    dcfg, fcfg = Q.QuantConfig(256, "bf16_kahan", "dynamic"), Q.QuantConfig(256, "bf16_kahan", "fp8")
    for i in dsd["state"]:
        d, f = dsd["state"][i], fsd["state"][i]
        full = dcfg.export_full({"master": params[i].detach().reshape(-1),
                                 **{k: v.reshape(-1) for k, v in d.items() if k != "step"}})
        codes, scale = Q.quantize_ref(full["exp_avg"], fcfg.m_map, 256)
        assert torch.equal(f["exp_avg.fp8"].reshape(-1), codes) and torch.equal(f["exp_avg.scale"], scale)
        codes, scale = Q.quantize_ref(Q.sqrt_exact(full["exp_avg_sq"]), fcfg.v_map, 256)
        assert torch.equal(f["exp_avg_sq.fp8"].reshape(-1), codes) and torch.equal(f["exp_avg_sq.scale"], scale)
        assert "master" not in f and raw_bytes(f["master.comp"]) == raw_bytes(d["master.comp"])
        assert int(f["step"]) == 3
    back = ts.AdamW(make_params(), lr=1e-2, offload=_fp8_offload(tmp_path / "b", "bf16_kahan", maps="dynamic"))
    with pytest.warns(StateFormatWarning, match="quant_map='dynamic'"):
        back.load_state_dict(fsd)
    assert "exp_avg.codes" in back.state_dict()["state"][0]
    for o in (dyn, fp8, back):
        o.close()


def test_checkpoint_keeps_the_fp8_parts_and_refuses_the_other_family(tmp_path):
    params = make_params()
    opt = ts.AdamW(params, lr=1e-2, offload=_fp8_offload(tmp_path / "a", "bf16_sr", nvme=1.0))
    _train(opt, params, 3)
    ts.save_optimizer(opt, tmp_path / "ckpt")
    manifest = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
    assert manifest["params"][0]["state"]["exp_avg.fp8"] == "uint8"
    assert "state.0.exp_avg_sq.fp8" in manifest["tensors"]
    params2 = make_params()
    opt2 = ts.AdamW(params2, lr=1e-2, offload=_fp8_offload(tmp_path / "b", "bf16_sr", nvme=0.0))
    ts.load_optimizer(opt2, tmp_path / "ckpt")
    assert_same_state_then_same_steps(opt, params, opt2, params2, seed=6)
    dyn = ts.AdamW(make_params(), lr=1e-2, offload=_fp8_offload(tmp_path / "c", "bf16_sr", maps="dynamic"))
    with pytest.raises(ValueError, match=r"compressed with quant_map='fp8'.*quant_map=\.\.\.\).*load_state_dict"):
        ts.load_optimizer(dyn, tmp_path / "ckpt")
    assert dyn.state_dict()["state"] == {}
    for o in (opt, opt2, dyn):
        o.close()


def test_fp8_state_trains_like_the_dynamic_state():
    """The two families reach nearly the same weights on a small regression (AdamW, 200 steps):
    a check that the fp8 moments drive Adam as moments, not a quality figure (those are in
    docs/compressed_state.md)."""
    torch.manual_seed(0)
    x = torch.randn(256, 32)
    y = x @ torch.randn(32, 1)
    losses = {}
    for maps in Q.MAP_FAMILIES:
        model = torch.nn.Linear(32, 1)
        torch.nn.init.zeros_(model.weight), torch.nn.init.zeros_(model.bias)
        opt = ts.AdamW(model.parameters(), lr=3e-2, weight_decay=0.0,
                       offload=ts.Offload(moment_dtype="q8", quant_map=maps, master_dtype="bf16_kahan"))
        for _ in range(200):
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        losses[maps] = torch.nn.functional.mse_loss(model(x), y).item()
        opt.close()
    start = y.pow(2).mean().item()
    assert losses["fp8"] < 0.01 * start and losses["dynamic"] < 0.01 * start, (losses, start)


def test_the_planner_prices_and_carries_the_maps(tmp_path):
    """The same bytes in both families; the planned Offload, `tierstate plan` and its JSON keep
    the maps (state keys named by the family's part)."""

    model = from_param_numels([10_000_000] * 4)
    kw = dict(device="cpu", param_dtype="bf16", state_keys=("exp_avg", "exp_avg_sq"), moment_dtype="q8")
    dyn, fp8 = PlanRequest(model, **kw), PlanRequest(model, quant_map="fp8", **kw)
    assert dyn.state_bytes_per_param == fp8.state_bytes_per_param == 6.03125
    assert "exp_avg.fp8" in fp8.state_bytes() and "exp_avg.codes" in dyn.state_bytes()
    with pytest.raises(ValueError, match="quant_map='fp8' needs moment_dtype='q8'"):
        PlanRequest(model, **{**kw, "moment_dtype": "bf16"}, quant_map="fp8")
    with pytest.raises(ValueError, match="quant_map='fp4'"):
        PlanRequest(model, quant_map="fp4", **kw)
    plan = choose(fp8, Hardware.conservative(), Budgets(host=8 * 2**30, disk=10**13))
    assert offload_from_plan(plan).quant_map == "fp8"
    r = subprocess.run([sys.executable, "-m", "tierstate", "plan", "124M", "--device", "cpu", "--moment-dtype", "q8",
                        "--quant-map", "fp8", "--json"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "TIERSTATE_PROFILE": str(tmp_path / "none.json")})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "exp_avg.fp8" in json.loads(r.stdout)["state_bytes_per_param"], r.stdout[:2000]


def test_the_cost_model_prices_8bit_updates_by_their_probed_rate():
    """The 8-bit kernels are compute-bound: the CPU update of compressed state takes the
    longer of its bytes at the fp32 kernel's rate and the probed rate of its own fused step."""
    from dataclasses import replace

    from tierstate.placement.cost_model import predict_time
    from tierstate.placement.plan_inputs import Placement

    model = from_param_numels([10_000_000] * 10)
    kw = dict(device="cpu", param_dtype="bf16", state_keys=("exp_avg", "exp_avg_sq"), moment_dtype="q8")
    hw = replace(Hardware.conservative(), step_params_per_s=1.7e9,
                 compressed_params_per_s=(("dynamic", 0.78e9), ("fp8", 1.55e9)))
    all_cpu = Placement(gpu=0.0, cpu=1.0, nvme=0.0)
    dyn = predict_time(PlanRequest(model, **kw), all_cpu, hw).cpu_update
    fp8 = predict_time(PlanRequest(model, quant_map="fp8", **kw), all_cpu, hw).cpu_update
    assert dyn == pytest.approx(100e6 / 0.78e9) and fp8 == pytest.approx(100e6 / 1.55e9)
    # a rate faster than the bytes allow does not make the update faster than its traffic
    fast = replace(hw, compressed_params_per_s=(("dynamic", 100e9), ("fp8", 100e9)))
    by_bytes = PlanRequest(model, **kw).update_bytes_per_param() * 100e6 / (1.7e9 * 28)
    assert predict_time(PlanRequest(model, **kw), all_cpu, fast).cpu_update == pytest.approx(by_bytes)
    full = predict_time(PlanRequest(model, **{**kw, "moment_dtype": "fp32"}), all_cpu, hw).cpu_update
    assert full == pytest.approx(28 * 100e6 / (1.7e9 * 28))  # fp32 state: its bytes, unchanged
