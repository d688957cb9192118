"""The NVMe tier's read-ahead for weights streamed per block, with the update in backward: a
block's gradients complete all its records at once, so the tier reads a whole block's
records ahead (see [Note: a plan in a fixed order]), and the default pool makes room for it."""
from __future__ import annotations

import pytest
import torch

import tierstate as ts
from tierstate.placement import Offload, TierKind, plan_layout
from tierstate.tiers.nvme import NvmeTier
from tierstate.tiers.nvme_pool import BufferState

DTYPES = {"exp_avg": torch.float32, "exp_avg_sq": torch.float32}


def _tier(tmp_path, block_records: int, buffer_count=None, subgroups=120):
    layout = plan_layout([1024 * subgroups], {TierKind.NVME: 1.0}, 1024)
    offload = Offload(cpu=0.0, nvme=1.0, nvme_dir=tmp_path / "nv", subgroup_numel=1024, buffer_count=buffer_count)
    return NvmeTier(layout, DTYPES, {}, offload, block_records=block_records)


def _one_step_in_order(tier, order):
    tier.schedule(order, keep_order=True)
    for sg in order:
        tier.acquire(sg)["exp_avg"].add_(1.0)
        tier.release(sg, dirty=True)


def _loading_or_loaded(tier, order, n):
    """How many of the plan's first ``n`` records are in the pool or being read into it."""
    return sum(sg.index in tier._resident and tier._resident[sg.index].state in
               (BufferState.LOADING, BufferState.CLEAN, BufferState.DIRTY) for sg in order[:n])


@pytest.mark.parametrize("block_records,pool,window", [(0, 16, 4), (12, 16 + 24, 12), (30, 16 + 60, 30)])
def test_the_default_pool_and_window_follow_the_blocks_records(tmp_path, block_records, pool, window):
    tier = _tier(tmp_path, block_records)
    try:
        assert len(tier._pool) == pool and tier._evict_window == window
        order = list(reversed(tier.subgroups))  # the order backward meets them
        _one_step_in_order(tier, order)  # the pool now holds the plan's last records, all dirty
        tier.schedule(order, keep_order=True)  # the next backward: read ahead during forward
        assert _loading_or_loaded(tier, order, window) == window
        assert _loading_or_loaded(tier, order, window + 1) == window  # no further: the rest stay cached
    finally:
        tier.close()


def test_an_explicit_buffer_count_is_kept_and_bounds_the_window(tmp_path):
    tier = _tier(tmp_path, block_records=30, buffer_count=16)
    try:
        assert len(tier._pool) == 16 and tier._evict_window == 8  # half the pool; the rest caches
    finally:
        tier.close()


def test_buffer_count_none_is_the_default_and_bad_values_name_the_fix():
    assert Offload().buffer_count is None and Offload().buffer_count_for() == 16
    assert Offload().buffer_count_for(48) == 112 and Offload(buffer_count=5).buffer_count_for(48) == 5
    for bad in (1, True, 2.0, "16"):
        with pytest.raises(ValueError, match=r"buffer_count=.*must be an int >= 2, or None"):
            Offload(buffer_count=bad)



@pytest.mark.parametrize("in_backward", [True, False])
def test_an_optimizer_over_streamed_blocks_sizes_its_pool_from_the_largest_block(tmp_path, in_backward, tiny_llama):
    model = tiny_llama()
    ws = ts.offload_weights(model, "nvme", nvme_dir=tmp_path / "w")
    sub = 4096
    opt = ts.AdamW(model.parameters(), lr=1e-3, step_in_backward=in_backward,
                   offload=ts.Offload(cpu=0.0, nvme=1.0, nvme_dir=tmp_path / "s", subgroup_numel=sub))
    try:
        tier = opt.tiers[TierKind.NVME]
        layer = sum(p.numel() for p in model.model.layers[0].parameters())
        # a layer's parameters span ceil(layer / sub) sub-groups, +1 where the flat layout's
        # sub-group boundaries do not meet the layer's start
        spans = {len({seg.subgroup for p in blk.parameters() for seg in
                      opt.layout.segments_of(opt.state_store.slot_of(p).trainable)}) for blk in model.model.layers}
        assert max(spans) in (-(-layer // sub), -(-layer // sub) + 1)
        want = min(16 + 2 * max(spans), len(tier.subgroups)) if in_backward else 16
        assert len(tier._pool) == want
        ids = torch.randint(0, 128, (1, 8))
        for _ in range(2):
            model(ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
    finally:
        opt.close()
        ws.close()
