"""Weights and optimizer state planned together within one host RAM and one disk budget."""
import pytest

import tierstate as ts
from tierstate.placement.joint import HOST_SHARES, plan_joint, weight_inputs
from tierstate.placement.model_spec import resolve_model
from tierstate.placement.plan_inputs import GIB, Budgets, Hardware, Placement, PlanError, PlanRequest
from tierstate.placement.weights_plan import CPU, NVME

HW = Hardware(source="test", host_bandwidth=40e9, step_params_per_s=2e9, sumsq_params_per_s=8e9, host_flops=1e12,
              disk_read=2e9, disk_write=4e9, h2d=20e9, d2h=20e9, device_flops=400e12, device_bandwidth=2e12)
ADAMW_KEYS = tuple(spec.name for spec in ts.AdamW.rule.state_specs(ts.AdamW.rule.defaults()))


def request(model="llama-7b", **kw):
    args = dict(device="cpu", param_dtype="fp32", moment_dtype="bf16", micro_batch=1, seq_len=2048,
                activation_checkpointing=True)
    args.update(kw)
    return PlanRequest(resolve_model(model), state_keys=ADAMW_KEYS, **args)


def test_weight_inputs_come_from_the_blocks_in_the_compute_dtype():
    blocks, outside, act, compute_s = weight_inputs(request(param_dtype="bf16", device="cuda"), HW)
    assert blocks == [202_383_360 * 2] * 32 and outside == 262_148_096 * 2
    # forward of one block: 2 FLOPs per parameter per token + attention 4 s h per token, at 400 TFLOP/s
    assert compute_s == pytest.approx((2 * 202_383_360 + 4 * 2048 * 4096) * 2048 / 400e12)
    assert act > 0
    with pytest.raises(ValueError, match="repeated blocks"):
        weight_inputs(PlanRequest(resolve_model("7B"), state_keys=ADAMW_KEYS), HW)


def test_joint_plan_keeps_weights_and_state_within_one_host_and_one_disk_budget():
    budgets = Budgets(host=12 * GIB, disk=200 * GIB)
    joint = plan_joint(request(), HW, budgets)
    usage = joint.usage()
    assert usage["host"]["total"] == usage["host"]["weights"] + usage["host"]["state"] <= 12 * GIB
    assert usage["disk"]["total"] == usage["disk"]["weights"] + usage["disk"]["state"] <= 200 * GIB
    assert usage["host"]["weights"] == joint.weights.compute_peak_bytes  # CPU: weights + activations in RAM
    assert joint.weights_host_budget in [int(12 * GIB * s) for s in HOST_SHARES]
    assert CPU not in joint.weights.tier_of and NVME in joint.weights.tier_of
    assert joint.state.request.weights_offloaded
    # on CPU there is no upload to take off: the state plan's step plus the waits on weights
    assert joint.step_seconds == pytest.approx(joint.state.time.total + joint.weights.stall_seconds)


def test_more_host_ram_never_predicts_a_slower_joint_step():
    steps = [plan_joint(request(), HW, Budgets(host=h * GIB, disk=200 * GIB)).step_seconds for h in (10, 16, 32, 64)]
    assert steps == sorted(steps, reverse=True)


def test_cuda_joint_plan_takes_the_streamed_upload_off_the_state_plan():
    budgets = Budgets(device=8 * GIB, host=128 * GIB, disk=500 * GIB)
    joint = plan_joint(request(device="cuda", param_dtype="bf16", seq_len=1024), HW, budgets)
    w, t = joint.weights, joint.state.time
    streamed = sum(b for b, tier in zip(w.block_bytes, w.tier_of) if tier != "resident")
    upload = t.weight_h2d * streamed / (sum(w.block_bytes) + w.resident_bytes)
    assert joint.step_seconds == pytest.approx(t.total - upload + w.stall_seconds)
    usage = joint.usage()
    assert usage["device"]["total"] <= 8 * GIB and usage["host"]["weights"] == w.host_peak_bytes


def test_a_given_state_placement_is_priced_beside_the_weights():
    joint = plan_joint(request(), HW, Budgets(host=12 * GIB, disk=200 * GIB), placement=Placement(0, 0, 1))
    assert (joint.state.placement.cpu, joint.state.placement.nvme) == (0, 1)


def test_joint_refusals_name_the_missing_budget():
    with pytest.raises(PlanError, match="no weight placement fits"):  # activations alone exceed the RAM
        plan_joint(request(activation_checkpointing=False), HW, Budgets(host=12 * GIB, disk=200 * GIB))
    with pytest.raises(PlanError, match="no split of host RAM and disk.*optimizer state"):
        plan_joint(request(), HW, Budgets(host=12 * GIB, disk=30 * GIB))  # weights 24 GiB + state on disk
    with pytest.raises(ValueError, match="--device-mem"):
        plan_joint(request(device="cuda", param_dtype="bf16"), HW, Budgets(host=64 * GIB))
