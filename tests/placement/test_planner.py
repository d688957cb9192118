"""The planner's arithmetic against hand-written accounting, its choices and its errors."""
import re

import pytest

import tierstate as ts
from tierstate.placement import TierKind
from tierstate.placement.cost_model import Kind, memory_breakdown, predict_time
from tierstate.placement.model_spec import ModelSpec, resolve_model
from tierstate.placement.plan_inputs import GIB, Budgets, Hardware, Placement, PlanError, PlanRequest, pow2_ceil
from tierstate.placement.planner import choose, evaluate

HW = Hardware(source="test", host_bandwidth=40e9, step_params_per_s=2e9, sumsq_params_per_s=8e9, host_flops=1e12,
              disk_read=2e9, disk_write=4e9, h2d=20e9, d2h=20e9, device_flops=400e12, device_bandwidth=2e12)
LLAMA7B = resolve_model("llama-7b")
N7 = 6_738_415_616
# The state keys ts.AdamW allocates, from its rule (the planner is told them; it knows no optimizer).
ADAMW_KEYS = tuple(spec.name for spec in ts.AdamW.rule.state_specs(ts.AdamW.rule.defaults()))


def adamw(model, **kwargs) -> PlanRequest:
    """A request for ``model`` trained with ts.AdamW (two moments)."""
    return PlanRequest(model, state_keys=ADAMW_KEYS, **kwargs)


def _bytes(memory, tier, kind):
    return sum(m.nbytes for m in memory if m.tier is tier and m.kind is kind)


def test_pow2_ceil_is_the_pinned_allocator_rounding():
    assert [pow2_ceil(n) for n in (0, 1, 4096, 4097, 5 * GIB)] == [0, 1, 4096, 8192, 8 * GIB]


def test_cuda_bf16_llama7b_all_on_host_matches_hand_accounting():
    req = adamw(LLAMA7B, device="cuda", param_dtype="bf16")
    mem = memory_breakdown(req, Placement(0.0, 1.0, 0.0))
    # FSDP-style analytic accounting, bytes per parameter:
    #   device: 2 (bf16 param) + a 32 MiB gradient bucket in flight (+ the largest param's grad)
    #   host:   4 (fp32 master) + 4 + 4 (fp32 moments), one page-locked arena each, at its own
    #           size (io.page_locked_empty, not torch's power-of-two rounding allocator);
    #           2 (bf16 host gradient arena, 64 B aligned slices, page-locked);
    #           2 (bf16 pinned staging, one arena of 64 B aligned slices).
    assert _bytes(mem, TierKind.DEVICE, Kind.PARAM) == 2 * N7
    assert _bytes(mem, TierKind.HOST, Kind.MASTER) == 4 * N7
    assert _bytes(mem, TierKind.HOST, Kind.MOMENTS) == 8 * N7
    grad_arena = sum((n * 2 + 63) // 64 * 64 for n in LLAMA7B.param_numels)
    assert _bytes(mem, TierKind.HOST, Kind.HOST_GRAD_BUFFER) == grad_arena
    staging = sum((n * 2 + 63) // 64 * 64 for n in LLAMA7B.param_numels)  # same slices as the gradients
    assert _bytes(mem, TierKind.HOST, Kind.WEIGHT_STAGING) == staging
    assert _bytes(mem, TierKind.HOST, Kind.PINNED_ROUNDING) == 0
    pinned = sum(m.nbytes for m in mem if m.pinned)
    assert pinned == 12 * N7 + grad_arena + staging  # 100 GiB, where power-of-two arenas took 128
    assert _bytes(mem, TierKind.DEVICE, Kind.GRAD) == 32 * 2**20 + 2 * LLAMA7B.largest_param
    assert not [m for m in mem if m.tier is TierKind.NVME]


def test_cpu_fp32_has_no_master_and_no_pinned_memory():
    spec = ModelSpec("m", (1000, 3000, 6000), source="tensors")
    mem = memory_breakdown(adamw(spec, device="cpu", param_dtype="fp32"), Placement(0.0, 1.0, 0.0))
    # 1x fp32 param, 1x fp32 grad (param.grad), 2x fp32 moments, one 6000-element fp32 fill temporary
    assert _bytes(mem, TierKind.HOST, Kind.PARAM) == 4 * 10_000
    assert _bytes(mem, TierKind.HOST, Kind.GRAD) == 4 * 10_000
    assert _bytes(mem, TierKind.HOST, Kind.MOMENTS) == 8 * 10_000
    assert _bytes(mem, TierKind.HOST, Kind.MASTER) == 0
    assert _bytes(mem, TierKind.HOST, Kind.FIRST_STEP_TEMPORARY) == 4 * 6000
    assert not any(m.pinned for m in mem)


def test_nvme_split_puts_state_in_files_and_a_bounded_pool_in_ram():
    spec = ModelSpec("m", (50_000_000, 50_000_000), source="tensors")
    req = adamw(spec, device="cpu", param_dtype="bf16", moment_dtype="bf16", subgroup_numel=1 << 22,
                      buffer_count=3)
    mem = memory_breakdown(req, Placement(0.0, 0.25, 0.75))
    # 1x fp32 master + 2x bf16 moments = 8 B/param; 25M on the host, 75M in files
    assert _bytes(mem, TierKind.HOST, Kind.MASTER) == 4 * 25_000_000
    assert _bytes(mem, TierKind.HOST, Kind.MOMENTS) == 4 * 25_000_000
    assert _bytes(mem, TierKind.NVME, Kind.MASTER) + _bytes(mem, TierKind.NVME, Kind.MOMENTS) == 8 * 75_000_000
    # pool: 3 records of one 4 Mi-element sub-group: 16 MiB master + 2 x 8 MiB moments
    assert _bytes(mem, TierKind.HOST, Kind.NVME_BUFFER_POOL) == 3 * (16 + 8 + 8) * 2**20


def test_the_choice_fills_host_ram_then_spills_to_nvme_within_budget():
    spec = ModelSpec("m", (1_000_000_000,), source="tensors")
    req = adamw(spec, device="cpu", param_dtype="fp32")
    fixed = 4e9 + 4e9 + 4e9  # param + grad + first-step temporary: every placement pays them
    pool = 4 * 16 * 2**20 * 8  # 4 records of a 16 Mi-element sub-group x 2 fp32 moments
    budget = Budgets(host=int(fixed + 0.6 * 8e9 + pool), disk=100 * GIB, disk_dir="/x")
    plan = choose(req, HW, budget)
    assert 0.59 < plan.placement.cpu <= 0.6 and plan.placement.nvme == pytest.approx(1 - plan.placement.cpu)
    assert plan.tier_total(TierKind.HOST) <= budget.host
    more = Placement(0.0, plan.placement.cpu + 0.01, plan.placement.nvme - 0.01)
    with pytest.raises(PlanError, match="host memory"):  # the chosen split is tight: 1% more does not fit
        evaluate(req, more, HW, budget)
    assert "NVMe" in plan.reason
    roomy = choose(req, HW, Budgets(host=100 * GIB))  # 20 GB needed
    assert roomy.placement == Placement(0.0, 1.0, 0.0) and "fits in host RAM" in roomy.reason


def test_budgets_that_cannot_be_met_say_what_is_missing():
    req = adamw(LLAMA7B, device="cuda", param_dtype="bf16")
    with pytest.raises(PlanError) as err:
        choose(req, HW, Budgets(host=64 * GIB, disk=12 * GIB, disk_dir="/x"))
    text = str(err.value)
    assert re.search(r"needs \d+\.\d GiB of disk under /x, 12\.0 GiB free", text)
    assert re.search(r"needs \d+\.\d GiB of host memory, 64\.0 GiB available", text)
    assert "75.3 GiB" in text  # 6.74e9 params x 12 B of optimizer state


def test_too_little_device_memory_is_named():
    req = adamw(LLAMA7B, device="cuda", param_dtype="bf16", micro_batch=8, seq_len=4096)
    with pytest.raises(PlanError, match=r"needs \d+\.\d GiB of device memory, 24\.0 GiB available"):
        choose(req, HW, Budgets(device=24 * GIB, host=512 * GIB))


def test_time_model_components_and_bottlenecks():
    spec = ModelSpec("m", (100_000_000,), source="tensors")
    cpu = predict_time(adamw(spec, device="cpu", param_dtype="fp32"), Placement(0, 1, 0), HW)
    # 28 B/param at the kernel's 2e9 params/s x 28 B: 0.05 s. No gradient pass in the step: a CPU
    # gradient's norm is taken by its hook in backward (pipeline/grads.py HookNorms; found
    # 2026-12-07: priced as a pass of 4e8 B at 8e9 x 4 B/s, 12.5 ms, that the step no longer makes)
    assert cpu.cpu_update == pytest.approx(0.05)
    assert cpu.grad_pass == 0.0
    assert cpu.optimizer == pytest.approx(0.05) and cpu.bottleneck == "cpu_step" and cpu.disk == 0
    bf16m = predict_time(adamw(spec, device="cpu", param_dtype="fp32", moment_dtype="bf16"),
                         Placement(0, 1, 0), HW)
    assert bf16m.cpu_update == pytest.approx(0.05 * 20 / 28)  # bf16 moments: 20 B of traffic per param
    nvme = predict_time(adamw(spec, device="cpu", param_dtype="fp32", subgroup_numel=1 << 22,
                                    buffer_count=4), Placement(0, 0, 1), HW)
    # 24 records, 20 move per step (4 stay cached): 20/24 of 8e8 B read at 2e9 and written at 4e9
    moved = 8e8 * 20 / 24
    assert nvme.disk == pytest.approx(moved / 2e9 + moved / 4e9)
    assert nvme.bottleneck == "disk" and nvme.optimizer > nvme.disk
    gpu = predict_time(adamw(spec, device="cuda", param_dtype="bf16", micro_batch=1, seq_len=8),
                       Placement(0, 1, 0), HW)
    assert gpu.weight_h2d == pytest.approx(2e8 / 20e9) and gpu.grad_d2h == pytest.approx(2e8 / 20e9)
    # the host copies of CUDA gradients are read once more for their norm: 2e8 B at 8e9 x 4 B/s
    assert gpu.grad_pass == pytest.approx(2e8 / 32e9)
    assert gpu.total == pytest.approx(gpu.compute + gpu.grad_d2h_exposed + gpu.optimizer + gpu.weight_h2d)


def test_device_tier_is_used_only_when_allowed():
    spec = ModelSpec("m", (1_000_000_000,), source="tensors")
    req = adamw(spec, device="cuda", param_dtype="bf16")
    budgets = Budgets(device=20 * GIB, host=200 * GIB)
    without = choose(req, HW, budgets)
    assert without.placement.gpu == 0
    assert any("--gpu-tier" in note for note in without.notes) and not any("not available" in n for n in without.notes)
    with_gpu = choose(req, HW, budgets, allow_device_tier=True)
    assert with_gpu.placement.gpu > 0 and with_gpu.time.total < without.time.total
    assert with_gpu.tier_total(TierKind.DEVICE) <= budgets.device
    assert not any("--gpu-tier" in note for note in with_gpu.notes)


def test_device_tier_keeps_its_gradients_on_the_device_and_needs_no_staging():
    """What the optimizer does with Offload(gpu=...): parameters touching the device range are
    not streamed (their bf16 param.grad stays on the device), and one wholly inside it has no
    staging tensor; the straddling one keeps both."""
    numels = (600, 300, 100)  # gpu=0.7: parameter 0 inside the device range, parameter 1 straddles
    req = adamw(ModelSpec("m", numels, source="tensors"), device="cuda", param_dtype="bf16")
    mem = memory_breakdown(req, Placement(0.7, 0.3, 0.0))
    assert _bytes(mem, TierKind.HOST, Kind.HOST_GRAD_BUFFER) == (100 * 2 + 63) // 64 * 64
    device_grads = [m for m in mem if m.tier is TierKind.DEVICE and m.kind is Kind.GRAD]
    assert sum(m.nbytes for m in device_grads if "device tier" in m.note) == (600 + 300) * 2
    assert _bytes(mem, TierKind.HOST, Kind.WEIGHT_STAGING) == (300 * 2 + 63) // 64 * 64 + (100 * 2 + 63) // 64 * 64
    assert _bytes(mem, TierKind.DEVICE, Kind.MOMENTS) == 700 * 8 and _bytes(mem, TierKind.HOST, Kind.MOMENTS) == 300 * 8
    all_host = memory_breakdown(req, Placement(0.0, 1.0, 0.0))
    assert _bytes(all_host, TierKind.HOST, Kind.HOST_GRAD_BUFFER) == sum((n * 2 + 63) // 64 * 64 for n in numels)
    assert _bytes(all_host, TierKind.HOST, Kind.WEIGHT_STAGING) == sum((n * 2 + 63) // 64 * 64 for n in numels)


@pytest.mark.parametrize("kwargs, match", [
    (dict(device="tpu"), "device="), (dict(param_dtype="int8"), "param_dtype"), (dict(moment_dtype="fp16"), "moment_dtype"),
    (dict(buffer_count=0), "buffer_count"),
    # the state keys stand where the optimizer's name stood: a name the planner cannot size is refused
    (dict(state_keys="exp_avg"), r"state_keys='exp_avg': .*tuple of key names.*\("),
    (dict(state_keys=("exp_avg", "exp_avg")), r"state_keys=\('exp_avg', 'exp_avg'\): .*'exp_avg' twice"),
    (dict(state_keys=("exp_avg", "")), r"state_keys=.*non-empty str"),
    (dict(state_keys=("master",)), r"state_keys=\('master',\): 'master' is .*needs_master"),
    (dict(state_keys=("sum",), fp32_state_keys=("sum",)), r"fp32_state_keys=\('sum',\): .*'sum' .*also in state_keys"),
])
def test_bad_requests_name_the_argument(kwargs, match):
    kwargs = {"state_keys": ADAMW_KEYS} | kwargs
    with pytest.raises(ValueError, match=match):
        PlanRequest(ModelSpec("m", (10,)), **kwargs)


def test_state_sizes_come_from_the_keys_the_caller_names():
    """Moments in moment_dtype, fp32 keys in 4 bytes, the master when needed: no optimizer table."""
    spec = ModelSpec("m", (1000,), source="tensors")
    one = PlanRequest(spec, device="cpu", param_dtype="fp32", moment_dtype="bf16", state_keys=("exp_avg",))
    assert one.state_bytes() == {"exp_avg": 2} and one.state_bytes_per_param == 2
    mixed = PlanRequest(spec, device="cpu", param_dtype="bf16", moment_dtype="bf16", state_keys=("exp_avg",),
                        fp32_state_keys=("count",))
    assert mixed.state_bytes() == {"exp_avg": 2, "count": 4, "master": 4}
    # traffic of one update: read fp32 master + bf16 grad + each key, write master + keys + the bf16 param
    assert mixed.update_bytes_per_param() == 8 + 2 + 2 * 2 + 2 * 4 + 2
    none = PlanRequest(spec, device="cpu", param_dtype="fp32", state_keys=())  # SGD without momentum
    mem = memory_breakdown(none, Placement(0.0, 1.0, 0.0))
    assert none.state_bytes_per_param == 0
    assert _bytes(mem, TierKind.HOST, Kind.MOMENTS) == 0 and _bytes(mem, TierKind.HOST, Kind.FIRST_STEP_TEMPORARY) == 0
    three = memory_breakdown(PlanRequest(spec, device="cpu", param_dtype="fp32",
                                         state_keys=ADAMW_KEYS + ("max_exp_avg_sq",)), Placement(0.0, 1.0, 0.0))
    assert _bytes(three, TierKind.HOST, Kind.MOMENTS) == 3 * 4 * 1000


def test_memory_is_reported_on_the_layout_tiers_with_the_budget_names():
    """One tier enum: a plan's bytes are keyed by TierKind; the output names the three budgets."""
    spec = ModelSpec("m", (1000,), source="tensors")
    plan = evaluate(adamw(spec, device="cpu", param_dtype="fp32"), Placement(0.0, 0.5, 0.5), HW)
    assert {m.tier for m in plan.memory} <= set(TierKind)
    out = plan.as_dict()
    assert set(out["totals"]) == {"device", "host", "disk", "pinned"}
    assert out["totals"]["disk"] == plan.tier_total(TierKind.NVME) == 500 * 8
    assert {m["tier"] for m in out["memory"]} == {"host", "disk"}


def test_activation_checkpointing_prices_the_recomputed_forward():
    """Checkpointing runs each block's forward again in backward (the embedding and head are not
    recomputed): 2 FLOPs per block parameter per token plus the blocks' attention (4 s h per
    token per layer), on top of the plain step's 6 per parameter + 12 s h L."""
    plain = predict_time(adamw(LLAMA7B, device="cuda", micro_batch=1, seq_len=2048), Placement(0, 1, 0), HW)
    ckpt = predict_time(adamw(LLAMA7B, device="cuda", micro_batch=1, seq_len=2048, activation_checkpointing=True),
                        Placement(0, 1, 0), HW)
    tokens = 2048
    extra = (2 * 202_383_360 * 32 + 4 * 32 * 4096 * 2048) * tokens / HW.device_flops
    assert plain.compute == pytest.approx((6 * N7 + 12 * 32 * 4096 * 2048) * tokens / HW.device_flops)
    assert ckpt.compute == pytest.approx(plain.compute + extra)
    # the gradient copy hides behind backward, which now holds the recompute: 3/4 of the compute
    assert ckpt.grad_d2h_exposed == pytest.approx(max(0.0, ckpt.grad_d2h - 0.75 * ckpt.compute))
    assert ckpt.total == pytest.approx(ckpt.compute + ckpt.grad_d2h_exposed + ckpt.optimizer + ckpt.weight_h2d)
    count_only = ModelSpec("n", (N7,))  # blocks unknown: a third more, as if everything were recomputed
    base = predict_time(adamw(count_only, device="cuda", micro_batch=1, seq_len=2048), Placement(0, 1, 0), HW)
    more = predict_time(adamw(count_only, device="cuda", micro_batch=1, seq_len=2048, activation_checkpointing=True),
                        Placement(0, 1, 0), HW)
    assert more.compute == pytest.approx(base.compute * 4 / 3)


def test_with_weights_offloaded_the_state_plan_leaves_weights_and_activations_to_the_weight_plan():
    """The compute copy and the activations are priced by the weight plan; param.grad (CPU, no
    gradient streaming) lives for the parameters outside the blocks and two blocks, since a
    released block's gradient leaves with it."""
    plain = adamw(LLAMA7B, device="cpu", param_dtype="fp32", micro_batch=1, seq_len=512)
    offloaded = adamw(LLAMA7B, device="cpu", param_dtype="fp32", micro_batch=1, seq_len=512, weights_offloaded=True)
    before = memory_breakdown(plain, Placement(0, 0, 1))
    after = memory_breakdown(offloaded, Placement(0, 0, 1))
    assert _bytes(before, TierKind.HOST, Kind.PARAM) == 4 * N7 and _bytes(after, TierKind.HOST, Kind.PARAM) == 0
    assert _bytes(before, TierKind.HOST, Kind.ACTIVATIONS) > 0 and _bytes(after, TierKind.HOST, Kind.ACTIVATIONS) == 0
    assert _bytes(before, TierKind.HOST, Kind.GRAD) == 4 * N7
    assert _bytes(after, TierKind.HOST, Kind.GRAD) == 4 * (262_148_096 + 2 * 202_383_360)
    for kind in (Kind.MOMENTS, Kind.NVME_BUFFER_POOL, Kind.FIRST_STEP_TEMPORARY):  # the state itself unchanged
        assert _bytes(before, TierKind.HOST, kind) == _bytes(after, TierKind.HOST, kind)
        assert _bytes(before, TierKind.NVME, kind) == _bytes(after, TierKind.NVME, kind)
