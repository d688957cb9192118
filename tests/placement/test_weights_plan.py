"""The weight planner: hand-computed cases on round rates, and its refusals.

Rates are chosen so one block of ``B`` bytes takes 0.1 s over PCIe, 0.2 s to read from disk and
0.4 s to write, and every block is a power of two (pinned allocations round to one), so each
figure below is worked out by hand in its comment.
"""
import math

import pytest

from tierstate.placement.model_spec import BUILTIN_SHAPES, resolve_model
from tierstate.placement.plan_inputs import Hardware, PlanError
from tierstate.placement.weights_plan import CPU, NVME, RESIDENT, WeightPlan, plan_weights

B = 1 << 27  # 128 MiB
HW = Hardware(source="round test rates", host_bandwidth=1e10, step_params_per_s=1e8, sumsq_params_per_s=1e9,
              host_flops=1e11, disk_read=B / 0.2, disk_write=B / 0.4, h2d=B / 0.1, d2h=B / 0.1)


def plan(blocks, **kw):
    args = dict(resident_bytes=0, compute="cuda", compute_memory_budget=100 * B, host_memory_budget=100 * B,
                profile=HW, activation_bytes=0, compute_seconds_per_block=None)
    args.update(kw)
    return plan_weights(blocks, **args)


def test_everything_fits_stays_resident():
    # outside the blocks B + 4 blocks 4B + activations B = 6B = the device budget exactly
    p = plan([B] * 4, resident_bytes=B, activation_bytes=B, compute_memory_budget=6 * B, host_memory_budget=0,
             compute_seconds_per_block=0.1)
    assert isinstance(p, WeightPlan)
    assert p.tier_of == (RESIDENT,) * 4
    assert (p.prefetch, p.window_blocks, p.window_bytes) == (0, 0, 0)
    assert (p.host_peak_bytes, p.pinned_bytes, p.disk_bytes) == (0, 0, 0)
    assert p.compute_peak_bytes == 6 * B
    assert (p.disk_read_bytes, p.disk_write_bytes, p.pcie_bytes) == (0, 0, 0)
    # 4 blocks x (forward 0.1 + backward 0.2): nothing to wait for
    assert p.compute_seconds == pytest.approx(1.2) and p.step_seconds == pytest.approx(1.2)
    assert p.stall_seconds == pytest.approx(0.0) and p.bottleneck == "compute"
    assert p.rejected == ()


def test_host_ram_too_small_on_cpu_streams_from_nvme_with_a_window_of_the_largest_block():
    # CPU, 5 blocks of B, RAM for 4B. A streamed block takes RAM twice: a host image (one of the
    # prefetch + 2 in the pool) and the copy it runs from (1 block). So: all resident 5B;
    # 4 resident + 1 + 1 image 6B; 3 resident + 1 + 2 images 6B; 2 resident + 1 + 2 images 5B;
    # 1 resident + 1 + 2 images (on demand) 4B fits; 0 resident + 1 + 3 images (prefetch 1) 4B
    # fits, prefetch 2 would need 5B. A fetch (disk, 0.2 s) is shorter than a forward (1 s), so
    # depth 1 hides it. Predicted, per step:
    #   1 resident, on demand: 3.0 + 4 x (1.2 + 2.2) + write-back 4 x 0.4 = 18.2 s
    #   0 resident, prefetch 1: 5 x 3.0 + fill 0.2 (forward) + 0.2 (backward) + 5 x 0.4 = 17.4 s: wins
    p = plan([B] * 5, compute="cpu", compute_memory_budget=4 * B, host_memory_budget=4 * B,
             compute_seconds_per_block=1.0)
    assert p.tier_of == (NVME,) * 5
    assert (p.prefetch, p.window_blocks, p.window_bytes) == (1, 3, 3 * B)
    assert (p.materialized_blocks, p.materialized_bytes) == (1, B)
    assert p.host_peak_bytes == p.compute_peak_bytes == 4 * B and p.pinned_bytes == 0 and p.disk_bytes == 5 * B
    assert (p.disk_read_bytes, p.disk_write_bytes, p.pcie_bytes) == (10 * B, 5 * B, 0)
    assert p.step_seconds == pytest.approx(17.4)
    assert p.compute_seconds == pytest.approx(15.0)
    assert p.disk_seconds == pytest.approx(10 * 0.2 + 5 * 0.4)
    assert p.bottleneck == "compute"
    assert "1 block resident: leaves room for prefetch 0 only, 18200.0 ms predicted against 17400.0 ms" in p.rejected
    assert any(r.startswith("prefetch 2: needs 640 MiB of host RAM") for r in p.rejected)


@pytest.mark.parametrize("host", [6 * B + B // 2, 7 * B, 8 * B, 9 * B])
def test_window_bytes_are_window_blocks_times_the_largest_streamed_block(host):
    blocks = [B] * 7 + [2 * B]  # the largest last: every streamed set holds it
    p = plan(blocks, compute="cpu", compute_memory_budget=host, host_memory_budget=host,
             compute_seconds_per_block=0.5, resident_bytes=B // 4, activation_bytes=B // 4)
    streamed = [b for b, t in zip(blocks, p.tier_of) if t != RESIDENT]
    assert streamed and p.window_bytes == p.window_blocks * max(streamed) == p.window_blocks * 2 * B
    assert p.materialized_bytes == 2 * B
    resident = sum(b for b, t in zip(blocks, p.tier_of) if t == RESIDENT)
    assert p.host_peak_bytes == B // 4 + resident + 2 * B + p.window_bytes
    assert p.compute_peak_bytes == p.host_peak_bytes + B // 4 <= host


def test_an_unaligned_block_takes_a_4_kib_aligned_image():
    p = plan([B + 1] * 4, tier="nvme", compute_seconds_per_block=1.0, max_prefetch=0)
    assert p.window_blocks == 2 and p.window_bytes == 2 * (B + 4096)
    # each pinned buffer takes its record (whole pages), not a power of two (io.page_locked_empty)
    assert p.pinned_bytes == 2 * (B + 4096)


@pytest.mark.parametrize("compute_s, max_prefetch, depth", [
    (0.3, 4, 1),  # one fetch: disk 0.2 + PCIe 0.1 = 0.3 s; ceil(0.3 / 0.3) = 1
    (0.15, 4, 2),  # ceil(0.3 / 0.15) = 2
    (0.1, 4, 3),  # ceil(3.0) = 3
    (0.07, 4, 4),  # ceil(4.29) = 5, capped at max_prefetch 4
    (0.07, 2, 2),  # capped at 2
    (None, 4, 2),  # unknown compute: the streamer's default depth
])
def test_prefetch_depth_is_the_fetch_to_compute_ratio(compute_s, max_prefetch, depth):
    p = plan([B] * 8, tier="nvme", compute_seconds_per_block=compute_s, max_prefetch=max_prefetch)
    assert p.tier_of == (NVME,) * 8
    assert p.fetch_seconds == pytest.approx(0.3)
    assert p.prefetch == depth and p.window_blocks == depth + 2 and p.window_bytes == (depth + 2) * B
    # pinned staging: one buffer per window slot
    assert p.pinned_bytes == p.host_peak_bytes == (depth + 2) * B


def test_predicted_time_of_a_two_stage_fetch():
    # 8 blocks from NVMe on CUDA, forward 0.15 s, prefetch 2: a streamed block takes
    # max(c, slowest stage 0.2, 0.3 / 2) per pass -> forward 8 x 0.2, backward 8 x 0.3; plus the
    # first fetch of each pass (0.3 + 0.3) and the write-back 8 x 0.4 = 3.2: 1.6 + 2.4 + 0.6 + 3.2 = 7.8 s.
    p = plan([B] * 8, tier="nvme", compute_seconds_per_block=0.15)
    assert p.prefetch == 2
    assert p.compute_seconds == pytest.approx(8 * 0.45)
    assert p.step_seconds == pytest.approx(7.8)
    assert p.stall_seconds == pytest.approx(7.8 - 3.6)
    # disk: 16 reads x 0.2 + 8 writes x 0.4 = 6.4 s; PCIe 16 x 0.1 = 1.6 s; compute 3.6 s
    assert p.disk_seconds == pytest.approx(6.4) and p.pcie_seconds == pytest.approx(1.6)
    assert p.bottleneck == "disk"


def test_memory_too_small_for_the_wanted_depth_takes_less_and_says_why():
    # wants depth 3 (fetch 0.3 / forward 0.1): 5 pinned images; host RAM holds 4 -> prefetch 2
    p = plan([B] * 8, tier="nvme", compute_seconds_per_block=0.1, host_memory_budget=4 * B)
    assert (p.prefetch, p.window_blocks) == (2, 4)
    assert "prefetch 3 (what hides a fetch): needs 640 MiB of pinned host RAM (homes 0 MiB + 5 NVMe images " \
           "640 MiB), host_memory_budget 512 MiB" in p.rejected


@pytest.mark.parametrize("host", [0, B, 3 * B, 8 * B, 100 * B])
@pytest.mark.parametrize("ram", [2 * B, 3 * B, 5 * B, 7 * B, 9 * B])
def test_cpu_compute_never_picks_the_cpu_tier(host, ram):
    try:
        p = plan([B] * 8, compute="cpu", compute_memory_budget=ram, host_memory_budget=max(host, ram),
                 compute_seconds_per_block=0.05)
    except PlanError:
        return
    assert CPU not in p.tier_of
    if p.streamed:
        assert any("'cpu' tier" in r and "buys nothing" in r for r in p.rejected)


def test_cpu_tier_on_a_cpu_compute_device_is_refused_naming_the_argument():
    with pytest.raises(ValueError, match=r"tier='cpu' with compute='cpu'.*buys nothing"):
        plan([B] * 2, compute="cpu", tier="cpu")


def test_cuda_splits_streamed_blocks_between_pinned_host_ram_and_nvme():
    # Device: outside B + activations B + room for 2.5B: the running block and the next one's
    # copy up (2B) leave no room for a resident block, so all 8 stream. max_prefetch 0: NVMe
    # blocks are read on demand into a pool of 2 pinned images (2B); of the 5.5B of host RAM
    # the other 3.5B hold 3 pinned homes, the first 3 blocks.
    p = plan([B] * 8, resident_bytes=B, activation_bytes=B, compute_memory_budget=4 * B + B // 2,
             host_memory_budget=5 * B + B // 2, compute_seconds_per_block=0.1, max_prefetch=0)
    assert p.tier_of == (CPU,) * 3 + (NVME,) * 5
    assert (p.prefetch, p.window_blocks, p.window_bytes) == (0, 2, 2 * B)
    assert (p.materialized_blocks, p.materialized_bytes) == (2, 2 * B)
    assert p.pinned_bytes == p.host_peak_bytes == 5 * B
    assert p.disk_bytes == 5 * B and p.compute_peak_bytes == 4 * B
    assert (p.disk_read_bytes, p.disk_write_bytes, p.pcie_bytes) == (10 * B, 5 * B, 16 * B)
    # on demand: forward 3 x (0.1 + 0.1) + 5 x (0.1 + 0.3); backward 3 x (0.2 + 0.1) + 5 x (0.2 + 0.3);
    # write-back 5 x 0.4: 2.6 + 3.4 + 2.0 = 8.0 s
    assert p.step_seconds == pytest.approx(8.0)
    assert p.bottleneck == "disk"  # 10 x 0.2 + 5 x 0.4 = 4.0 s, PCIe 1.6, compute 2.4
    assert "all 8 streamed blocks in pinned host RAM: needs 1.00 GiB, host_memory_budget 704 MiB" in p.rejected


def test_cuda_trades_pinned_homes_for_a_deeper_pool_when_that_is_faster():
    # As above with prefetch allowed (a fetch from NVMe: 0.2 + 0.1 = 0.3 s, forward 0.1 s: wants 3).
    # Host RAM 5.5B: prefetch 3 -> 5 images, no home (7.0 s); prefetch 2 -> 4 images + 1 home;
    # prefetch 1 -> 3 images + 2 homes (7.0 s); prefetch 0 -> 2 images + 3 homes (8.0 s).
    # Prefetch 2: the pinned block takes max(c, 0.1, 0.05) per pass, an NVMe one max(c, 0.2, 0.15):
    # forward 0.1 + 7 x 0.2, backward 0.2 + 7 x 0.2, first fetches 0.1 + 0.3, write-back 7 x 0.4:
    # 1.5 + 1.6 + 0.4 + 2.8 = 6.3 s: the fastest.
    p = plan([B] * 8, resident_bytes=B, activation_bytes=B, compute_memory_budget=4 * B + B // 2,
             host_memory_budget=5 * B + B // 2, compute_seconds_per_block=0.1)
    assert p.tier_of == (CPU,) + (NVME,) * 7
    assert (p.prefetch, p.window_blocks, p.pinned_bytes) == (2, 4, 5 * B)
    assert p.step_seconds == pytest.approx(6.3)
    assert "prefetch 3 (what hides a fetch): 7000.0 ms predicted against 6300.0 ms (8 on NVMe)" in p.rejected


def test_cuda_prefers_pinned_homes_when_host_ram_holds_them_all():
    p = plan([B] * 8, compute_memory_budget=5 * B, host_memory_budget=8 * B, compute_seconds_per_block=0.1)
    assert NVME not in p.tier_of and p.tier_of.count(RESIDENT) >= 1
    assert p.disk_read_bytes == p.disk_write_bytes == p.disk_bytes == 0
    assert p.pinned_bytes == B * p.tier_of.count(CPU)


def test_gradient_accumulation_multiplies_fetches_not_the_write_back():
    one = plan([B] * 4, tier="nvme", compute_seconds_per_block=0.1)
    four = plan([B] * 4, tier="nvme", compute_seconds_per_block=0.1, micro_batches=4)
    assert four.disk_read_bytes == 4 * one.disk_read_bytes and four.pcie_bytes == 4 * one.pcie_bytes
    assert four.disk_write_bytes == one.disk_write_bytes == 4 * B
    ckpt = plan([B] * 4, tier="nvme", compute_seconds_per_block=0.1, activation_checkpointing=True)
    assert ckpt.compute_seconds == pytest.approx(one.compute_seconds * 4 / 3)  # the forward again in backward
    assert ckpt.disk_read_bytes == one.disk_read_bytes


def test_no_placement_names_the_budget_and_the_need():
    # a window of 2 blocks (2B) + outside B + activations B = 4B > 3B
    with pytest.raises(PlanError, match=r"no weight placement fits.*needs 512 MiB of device memory.*budget 384 MiB"):
        plan([B] * 4, resident_bytes=B, activation_bytes=B, compute_memory_budget=3 * B)
    with pytest.raises(PlanError, match="host_memory_budget"):
        plan([B] * 4, tier="cpu", host_memory_budget=B)
    with pytest.raises(PlanError, match="disk_budget"):
        plan([B] * 4, tier="nvme", disk_budget=B)


@pytest.mark.parametrize("blocks, kw, exc, match", [
    ([], {}, ValueError, "block_bytes=\\[\\]"),
    ("1234", {}, TypeError, "block_bytes='1234'"),
    ([B, 0], {}, ValueError, r"block_bytes\[1\]=0: must be >= 1"),
    ([B, 1.5], {}, TypeError, r"block_bytes\[1\]=1.5"),
    ([B, True], {}, TypeError, r"block_bytes\[1\]=True"),
    ([B], {"resident_bytes": -1}, ValueError, "resident_bytes=-1"),
    ([B], {"compute": "gpu"}, ValueError, "compute='gpu'"),
    ([B], {"compute_memory_budget": None}, TypeError, "compute_memory_budget=None"),
    ([B], {"host_memory_budget": -5}, ValueError, "host_memory_budget=-5"),
    ([B], {"activation_bytes": 2.0}, TypeError, "activation_bytes=2.0"),
    ([B], {"compute_seconds_per_block": 0}, ValueError, "compute_seconds_per_block=0"),
    ([B], {"compute_seconds_per_block": math.nan}, ValueError, "compute_seconds_per_block=nan"),
    ([B], {"compute_seconds_per_block": "fast"}, ValueError, "compute_seconds_per_block='fast'"),
    ([B], {"max_prefetch": -1}, ValueError, "max_prefetch=-1"),
    ([B], {"micro_batches": 0}, ValueError, "micro_batches=0"),
    ([B], {"tier": "disk"}, ValueError, "tier='disk'"),
    ([B], {"disk_budget": -1}, ValueError, "disk_budget=-1"),
    ([B], {"profile": "fast"}, TypeError, "profile=str"),
    ([B], {"profile": {"x": 1}}, ValueError, "not a `tierstate probe` profile"),
])
def test_bad_input_names_the_argument(blocks, kw, exc, match):
    with pytest.raises(exc, match=match):
        plan(blocks, **kw)


def test_a_probe_profile_dict_and_none_are_accepted():
    profile = {"measurements": {"nvme": [{"read_bytes_per_s": B / 0.2, "write_bytes_per_s": B / 0.4}],
                                "cuda": {"h2d_bytes_per_s": B / 0.1}}}
    p = plan([B] * 4, tier="nvme", profile=profile)
    assert p.fetch_seconds == pytest.approx(0.3)
    conservative = plan([B] * 4, tier="nvme", profile=None)
    c = Hardware.conservative()
    assert conservative.fetch_seconds == pytest.approx(B / c.disk_read + B / c.h2d)


def test_describe_and_as_dict_carry_the_decision():
    p = plan([B] * 8, resident_bytes=B, activation_bytes=B, compute_memory_budget=4 * B + B // 2,
             host_memory_budget=5 * B + B // 2, compute_seconds_per_block=0.1, max_prefetch=0)
    text = "\n".join(p.describe())
    assert "3 pinned host RAM [0-2]" in text and "5 NVMe [3-7]" in text and "window 2 NVMe images" in text
    assert "bottleneck: disk" in text and "rejected: all 8 blocks resident" in text
    d = p.as_dict()
    assert d["blocks"] == {"resident": 0, "cpu": 3, "nvme": 5} and d["tier_of"][0] == "cpu"
    assert d["stall_seconds"] == pytest.approx(8.0 - 2.4)


def test_builtin_llama_7b_on_a_24_gib_cpu_box_streams_from_nvme():
    """The issue's capacity case as the planner sees it: 32 blocks of 202,383,360 fp32 elements
    (810 MB each) do not fit a 12 GiB weight budget beside the activations."""
    spec = resolve_model("llama-7b")
    blocks = [n * 4 for n in spec.block_numels]
    p = plan_weights(blocks, resident_bytes=spec.outside_numel * 4, compute="cpu",
                     compute_memory_budget=12 << 30, host_memory_budget=12 << 30, profile=None,
                     activation_bytes=1 << 30, compute_seconds_per_block=2.0)
    assert p.streamed and CPU not in p.tier_of
    assert p.compute_peak_bytes <= 12 << 30
    assert p.host_peak_bytes == (spec.outside_numel * 4 + sum(blocks[:p.tier_of.count(RESIDENT)]) + blocks[0]
                                 + p.window_bytes)


def test_builtin_block_counts_add_up():
    for name, make in BUILTIN_SHAPES.items():
        spec = make()
        assert spec.blocks_known and len(spec.block_numels) == spec.shape.n_layer, name
        assert sum(spec.block_numels) + spec.outside_numel == spec.numel, name
