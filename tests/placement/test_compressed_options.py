"""The options of compressed state (Offload(moment_dtype="q8", master_dtype=..., quant_block=...)):
validation, the block-aligned layout, and the one bytes-per-parameter table the planner and the
optimizer share."""
from __future__ import annotations

import pytest
import torch

import tierstate as ts
from tierstate.placement import TierKind, plan_layout
from tierstate.placement.auto import offload_from_plan
from tierstate.placement.defaults import state_bytes_per_element
from tierstate.placement.model_spec import from_param_numels
from tierstate.placement.plan_inputs import Hardware, PlanRequest
from tierstate.placement.planner import choose


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(moment_dtype="int8"), ValueError, r"moment_dtype='int8'.*'q8'"),
    (dict(moment_dtype=torch.float16), ValueError, r"moment_dtype=torch.float16"),
    (dict(master_dtype=torch.bfloat16, moment_dtype="q8"), ValueError, r"choose 'bf16_kahan'.*'bf16_sr'"),
    (dict(master_dtype="bf8"), ValueError, r"master_dtype='bf8'.*'bf16_kahan' or 'bf16_sr'"),
    (dict(master_dtype="bf16_sr"), ValueError, r"add moment_dtype='q8'"),
    (dict(moment_dtype="q8", quant_block=100), ValueError, r"quant_block=100.*power of two in \[64, 4096\]"),
    (dict(moment_dtype="q8", quant_block=8192), ValueError, r"quant_block=8192"),
    (dict(moment_dtype="q8", quant_block=True), ValueError, r"quant_block=True"),
    (dict(moment_dtype="q8", sr_seed=-1), ValueError, r"sr_seed=-1"),
    (dict(moment_dtype="q8", subgroup_numel=1000 * 1024 + 100), ValueError, r"multiple of 256"),
    (dict(moment_dtype="q8", gpu=0.5), ValueError, r"gpu=0.5.*no compressed state.*Offload\(gpu=0"),
])
def test_offload_refuses_bad_compression_options(kwargs, error, match):
    with pytest.raises(error, match=match):
        ts.Offload(**kwargs)


@pytest.mark.parametrize("spelling, dtype", [("fp32", torch.float32), ("float32", torch.float32),
                                             ("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16)])
def test_dtype_names_as_the_cli_spells_them(spelling, dtype):
    """``tierstate bench step --moment-dtype bf16 --master-dtype fp32`` spells dtypes as strings:
    the same strings work in ``Offload``, stored as the torch dtype (so equal options compare
    equal and the planner, the state dict and the checkpoints see one value)."""
    o = ts.Offload(moment_dtype=spelling)
    assert o.moment_dtype is dtype and o == ts.Offload(moment_dtype=dtype)
    if dtype is torch.float32:
        m = ts.Offload(moment_dtype="q8", master_dtype=spelling)
        assert m.master_dtype is torch.float32 and m.master_mode == "fp32"
    else:  # a plain bf16 master is refused with its reason, whichever way it is spelled
        with pytest.raises(ValueError, match=rf"master_dtype='{spelling}'.*loses updates.*'bf16_kahan'"):
            ts.Offload(moment_dtype="q8", master_dtype=spelling)


def test_offload_compression_properties():
    o = ts.Offload(moment_dtype="q8", master_dtype="bf16_kahan", quant_block=128)
    assert o.compressed and o.master_mode == "bf16_kahan"
    assert o.quant_config().block_size == 128 and o.quant_config().master == "bf16_kahan"
    assert not ts.Offload().compressed and ts.Offload().quant_config() is None
    assert ts.Offload(moment_dtype=torch.bfloat16).master_mode == "fp32"


def test_bytes_per_element_table():
    full = state_bytes_per_element("fp32")
    assert full == {"exp_avg": 4.0, "exp_avg_sq": 4.0, "master": 4.0}
    assert sum(state_bytes_per_element("bf16").values()) == 8.0
    q8 = state_bytes_per_element("q8", "fp32", 256)
    assert q8 == {"exp_avg.codes": 1.0, "exp_avg.scale": 4 / 256, "exp_avg_sq.codes": 1.0,
                  "exp_avg_sq.scale": 4 / 256, "master": 4.0}
    assert sum(state_bytes_per_element("q8", "bf16_kahan", 256).values()) == 6.03125
    assert sum(state_bytes_per_element("q8", "bf16_sr", 256).values()) == 4.03125
    assert sum(state_bytes_per_element("q8", "fp32", 256, needs_master=False).values()) == 2.03125
    # a bf16 host parameter is its own bf16 master: the compensation is all a master adds
    assert sum(state_bytes_per_element("q8", "bf16_kahan", 256, needs_master=False).values()) == 4.03125
    assert state_bytes_per_element("q8", "bf16_kahan", 256, needs_master=False)["master.comp"] == 2.0
    assert "master" not in state_bytes_per_element("q8", "bf16_sr", 256, needs_master=False)
    assert sum(state_bytes_per_element("q8", "bf16_sr", 256, needs_master=False).values()) == 2.03125
    # which parameters are their own master
    from tierstate.placement.defaults import is_own_master
    assert is_own_master("fp32", "fp32") and is_own_master("bf16", "bf16_kahan") and is_own_master("bf16", "bf16_sr")
    assert not any(is_own_master(p, m) for p, m in [("fp32", "bf16_kahan"), ("fp32", "bf16_sr"), ("bf16", "fp32"),
                                                     ("fp16", "fp32"), ("fp16", "bf16_kahan"), ("fp16", "bf16_sr")])
    # the optimizer's policy reads the same table
    assert ts.Offload(moment_dtype="q8", master_dtype="bf16_sr").bytes_per_element() == \
        state_bytes_per_element("q8", "bf16_sr", 256)


def test_block_aligned_layout_never_splits_a_block():
    numels = [300, 5, 4096, 1000, 0, 257]
    layout = plan_layout(numels, {TierKind.HOST: 0.5, TierKind.NVME: 0.5}, 1024, align=256)
    assert all(s % 256 == 0 for s in layout.param_starts)
    assert layout.total == sum(-(-n // 256) * 256 for n in numels)
    assert all(v % 256 == 0 for v in layout.tier_numel.values())
    covered = [0] * len(numels)
    for sg in layout.subgroups:
        assert sg.start % 256 == 0 and sg.tier_offset % 256 == 0
        for seg in sg.segments:
            assert seg.param_offset % 256 == 0 and seg.subgroup_offset % 256 == 0
            assert seg.param_offset + seg.numel <= numels[seg.param_index]  # real elements only
            covered[seg.param_index] += seg.numel
    assert covered == numels
    with pytest.raises(ValueError, match="divide subgroup_numel"):
        plan_layout(numels, {TierKind.HOST: 1.0}, 1000, align=256)
    # align=1 is the plain layout
    plain = plan_layout(numels, {TierKind.HOST: 1.0}, 1024)
    assert plain.total == sum(numels) and plain.align == 1


def test_plan_request_prices_compressed_state():
    model = from_param_numels([10_000_000] * 10)
    kw = dict(device="cpu", param_dtype="bf16", state_keys=("exp_avg", "exp_avg_sq"))
    full = PlanRequest(model, **kw)
    q8 = PlanRequest(model, moment_dtype="q8", **kw)
    sr = PlanRequest(model, moment_dtype="q8", master_dtype="bf16_sr", **kw)
    kahan = PlanRequest(model, moment_dtype="q8", master_dtype="bf16_kahan", **kw)
    on_gpu = PlanRequest(model, moment_dtype="q8", master_dtype="bf16_sr", **(kw | {"device": "cuda"}))
    assert full.state_bytes_per_param == 12 and q8.state_bytes_per_param == 6.03125
    # bf16 host parameters are their own bf16 master; on an accelerator the host keeps a copy
    assert sr.state_bytes_per_param == 2.03125 and kahan.state_bytes_per_param == 4.03125
    assert on_gpu.state_bytes_per_param == 4.03125
    # kernel traffic: grad 2 + master 2x4 + moments 2x8 + bf16 out 2 = 28 B; q8: 2 + 8 + 2x2.03 + 2;
    # the parameter as its own master is read and written in place (2x2), with no extra weight out
    assert full.update_bytes_per_param() == 28
    assert q8.update_bytes_per_param() == pytest.approx(16.0625)
    assert sr.update_bytes_per_param() == pytest.approx(2 + 4 + 2 * 2.03125)
    assert kahan.update_bytes_per_param() == pytest.approx(2 + 4 + 4 + 2 * 2.03125)
    assert on_gpu.update_bytes_per_param() == pytest.approx(12.0625)
    with pytest.raises(ValueError, match="needs moment_dtype='q8'"):
        PlanRequest(model, master_dtype="bf16_sr", **kw)
    with pytest.raises(ValueError, match="quant_block=3"):
        PlanRequest(model, moment_dtype="q8", quant_block=3, **kw)
    # a host budget that holds the 8-bit state but not the fp32 state: all in RAM only when compressed
    from tierstate.placement.plan_inputs import Budgets
    hw = Hardware.conservative()
    budgets = Budgets(host=int(1.3 * 2**30), disk=10**13)  # fp32 state all in RAM needs 1.53 GiB here
    assert choose(full, hw, budgets).placement.nvme > 0
    plan = choose(sr, hw, budgets)
    assert plan.placement.nvme == 0
    offload = offload_from_plan(plan)
    assert offload.moment_dtype == "q8" and offload.master_dtype == "bf16_sr" and offload.quant_block == 256
    assert plan.as_dict()["state_bytes_per_param"]["total"] == 2.03125
