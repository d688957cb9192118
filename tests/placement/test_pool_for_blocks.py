"""The planner's NVMe pool is the optimizer's: ``Offload(buffer_count=None)`` sizes the pool
from the records one streamed block spans when the update runs during backward
(``Offload.buffer_count_for``: 112 buffers for a Llama-2-7B layer), and a plan that priced the
old fixed 16 undercounted host RAM by twice a block's records (1.5 GiB at 7B) and, through
``offload="auto"``, handed the optimizer an explicit 16 (a read-ahead of 8 records, not a
block's 48: 1.30x the floor instead of 1.03x in benchmarks/capacity.py --size 7b)."""
from __future__ import annotations

import pytest

import tierstate as ts
from tierstate.placement import TierKind
from tierstate.placement.auto import offload_from_plan
from tierstate.placement.cost_model import Kind, memory_breakdown
from tierstate.placement.model_spec import ModelSpec
from tierstate.placement.plan_inputs import Hardware, Placement, PlanRequest
from tierstate.placement.planner import choose, evaluate

SUB = 4 << 20
LAYER = 202_383_360  # a Llama-2-7B decoder layer's elements


def _req(**kw) -> PlanRequest:
    model = ModelSpec("llama-ish", (LAYER,) * 4, block_numels=(LAYER,) * 4, outside_numel=0, source="builtin formula")
    return PlanRequest(model, device="cpu", param_dtype="bf16", state_keys=("exp_avg", "exp_avg_sq"), **kw)


def test_the_default_pool_follows_the_blocks_only_with_the_update_in_backward():
    records = -(-LAYER // SUB) + 1  # 49 + 1: a block that starts inside a record spans one more
    assert _req(weights_offloaded=True, step_in_backward=True).pool_buffers == 16 + 2 * records
    assert _req(weights_offloaded=True).pool_buffers == 16  # the step after backward: the fixed pool
    assert _req(step_in_backward=True).pool_buffers == 16  # resident weights: no block to read ahead
    assert _req(weights_offloaded=True, step_in_backward=True, buffer_count=24).pool_buffers == 24  # kept
    with pytest.raises(ValueError, match=r"buffer_count=0: must be a positive int or None"):
        _req(buffer_count=0)


def test_the_plan_prices_the_pool_the_optimizer_will_hold():
    req = _req(weights_offloaded=True, step_in_backward=True)
    pool = [m for m in memory_breakdown(req, Placement(0.0, 0.0, 1.0)) if m.kind is Kind.NVME_BUFFER_POOL]
    record = 4 * SUB * 3  # fp32 master + two fp32 moments of bf16 parameters
    assert [m.nbytes for m in pool] == [req.pool_buffers * record]
    assert pool[0].tier is TierKind.HOST
    # what the old fixed pool priced: 2 x 50 records less, 4.7 GiB at these records
    fixed = [m for m in memory_breakdown(_req(weights_offloaded=True), Placement(0.0, 0.0, 1.0))
             if m.kind is Kind.NVME_BUFFER_POOL]
    assert pool[0].nbytes - fixed[0].nbytes == 2 * 50 * record
    # and the policy made from the plan leaves the pool to the optimizer, which sizes it the same way
    plan = evaluate(req, Placement(0.0, 0.0, 1.0), Hardware.conservative())
    offload = offload_from_plan(plan)
    assert offload.buffer_count is None and offload.buffer_count_for(50) == req.pool_buffers


def test_a_smaller_pool_is_chosen_explicitly_when_the_default_does_not_fit():
    from tierstate.placement.plan_inputs import Budgets

    req = _req(weights_offloaded=True, step_in_backward=True)
    record = 4 * SUB * 3
    # room for the parameters' gradients and 32 records, not the default 114
    live_grads = 2 * LAYER * 2
    budgets = Budgets(host=live_grads + 40 * record + (1 << 30), disk=10**13)
    plan = choose(req, Hardware.conservative(), budgets, buffer_options=(64, 32, 16, 8))
    assert plan.request.buffer_count in (32, 16, 8) and plan.placement.nvme > 0
    assert offload_from_plan(plan).buffer_count == plan.request.buffer_count



def test_the_planners_pool_bounds_the_optimizers_for_a_streamed_llama(tmp_path, tiny_llama):
    """The optimizer counts the records each block's parameters really span; the planner takes
    the largest block over the sub-group size plus one: never less, at most two buffers more."""
    model = tiny_llama(layers=3)
    ws = ts.offload_weights(model, "nvme", nvme_dir=tmp_path / "w")
    sub = 4096
    opt = ts.AdamW(model.parameters(), lr=1e-3, step_in_backward=True,
                   offload=ts.Offload(cpu=0.0, nvme=1.0, nvme_dir=tmp_path / "s", subgroup_numel=sub))
    try:
        actual = len(opt.tiers[TierKind.NVME]._pool)
        blocks = tuple(sum(p.numel() for p in layer.parameters()) for layer in model.model.layers)
        total = sum(p.numel() for p in model.parameters())
        spec = ModelSpec("tiny llama", (total,), block_numels=blocks, outside_numel=total - sum(blocks),
                         source="tensors")
        req = PlanRequest(spec, device="cpu", param_dtype="fp32", subgroup_numel=sub, weights_offloaded=True,
                          step_in_backward=True, state_keys=("exp_avg", "exp_avg_sq"))
        # the pool holds at most every record; fp32 parameters are their own master: m and v, 8 B
        count = min(req.pool_buffers, -(-total // sub))
        priced = [m.nbytes for m in memory_breakdown(req, Placement(0.0, 0.0, 1.0)) if m.kind is Kind.NVME_BUFFER_POOL]
        assert priced == [count * sub * 8]
        assert actual <= count <= actual + 2
    finally:
        opt.close()
        ws.close()


def test_auto_prices_the_blocks_of_the_weights_that_stream(tmp_path, tiny_llama):
    """offload="auto" asks the planner with the streamed blocks of the optimizer's parameters
    (tierstate.weights.streamed_blocks): the request's pool is the one the optimizer holds."""
    from tierstate.placement.auto import request_for
    from tierstate.weights import streamed_blocks

    model = tiny_llama(layers=3)
    ws = ts.offload_weights(model, "nvme", nvme_dir=tmp_path / "w")
    try:
        params = list(model.parameters())
        blocks = streamed_blocks([{"params": params}])
        assert [sum(p.numel() for p in b) for b in blocks] == \
            [sum(p.numel() for p in layer.parameters()) for layer in model.model.layers]
        keys = ("exp_avg", "exp_avg_sq")
        req = request_for(params, state_keys=keys, step_in_backward=True, streamed_blocks=blocks)
        assert req.weights_offloaded and req.model.block_numels == tuple(sum(p.numel() for p in b) for b in blocks)
        assert req.model.outside_numel == sum(p.numel() for p in params) - sum(req.model.block_numels)
        assert req.pool_buffers == 16 + 2 * (-(-max(req.model.block_numels) // req.subgroup_numel) + 1)
        plain = request_for(params, state_keys=keys)
        assert not plain.weights_offloaded and plain.pool_buffers == 16
    finally:
        ws.close()


# Compressed state: the default pool holds the RAM 16 fp32 records of the same keys would.
# q8 fp8 moments under a bf16_sr master on bf16 parameters store 2.03 B an element against
# 8 B at fp32, so 16 records were 130 MiB at 4 Mi elements against fp32 state's 512 MiB, and
# the step paid 1.48x the disk floor instead of 1.05x (400M, Zen 1, benchmarks/README.md).
@pytest.mark.parametrize(("layout", "expected"), [
    (dict(), 16),  # fp32 moments and master: unchanged
    (dict(moment_dtype="bf16"), 32),  # fp32 host params are their own master: 2 + 2 B against 8
    # a bf16 master beside fp32 params: 1 + 1 + 2 x 4/256 + 2 = 4.03 B against 12
    (dict(moment_dtype="q8", quant_map="fp8", master_dtype="bf16_sr"), 47),
    # bf16 params their own master: 2.03 B against 8
    (dict(moment_dtype="q8", quant_map="fp8", master_dtype="bf16_sr", param_dtype="bf16"), 63),
])
def test_the_default_pool_holds_sixteen_fp32_records_worth_of_compressed_state(tmp_path, layout, expected):
    import torch

    param_dtype = {"bf16": torch.bfloat16}.get(layout.pop("param_dtype", None), torch.float32)
    device = "cpu"
    model = ModelSpec("flat", (1 << 20,), source="builtin formula")
    dt = {torch.float32: "fp32", torch.bfloat16: "bf16"}[param_dtype]
    req = PlanRequest(model, device=device, param_dtype=dt, state_keys=("exp_avg", "exp_avg_sq"),
                      subgroup_numel=4096, **layout)
    assert req.pool_buffers == expected
    # the optimizer holds the pool the planner priced
    params = [torch.nn.Parameter(torch.zeros(1 << 20, dtype=param_dtype))]
    opt = ts.AdamW(params, lr=1e-3, offload=ts.Offload(cpu=0.0, nvme=1.0, nvme_dir=tmp_path / "s", subgroup_numel=4096,
                                                      **{k: {"bf16": torch.bfloat16}.get(v, v) if k == "moment_dtype" else v
                                                         for k, v in layout.items()}))
    try:
        assert len(opt.tiers[TierKind.NVME]._pool) == expected
    finally:
        opt.close()


def test_a_block_read_ahead_pool_is_not_grown_past_its_records_by_compression():
    from tierstate.placement.defaults import default_buffer_count, state_bytes_per_element

    bf16_moments = state_bytes_per_element("bf16", "fp32", needs_master=False)  # 4 B: fp32 parameters are the master
    assert default_buffer_count(bf16_moments) == 32  # 16 fp32 records of moments = 32 of bf16
    # a 7B layer's 48 records (+1): 16 + 2R already holds 3.5x the RAM of 16 fp32 records
    assert default_buffer_count(bf16_moments, block_records=49) == 16 + 2 * 49
    # few block records: the RAM floor still holds
    assert default_buffer_count(bf16_moments, block_records=4) == 32
    fp32 = state_bytes_per_element("fp32", "fp32", needs_master=True)
    assert default_buffer_count(fp32) == 16 and default_buffer_count(fp32, block_records=3) == 22
