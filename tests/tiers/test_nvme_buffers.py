"""The NVMe pool buffers' lifecycle, walked with real files, and the tier's protocol properties."""
from __future__ import annotations

import os

import pytest
import torch

from tierstate.placement import Offload, TierKind, plan_layout
from tierstate.tiers.nvme import NvmeTier
from tierstate.tiers.nvme_pool import TRANSITIONS, BufferState

S = BufferState


def _tier(tmp_path, buffers=2):
    layout = plan_layout([5000, 3000], {TierKind.NVME: 1.0}, 1024)  # 8 sub-groups
    offload = Offload(cpu=0.0, nvme=1.0, nvme_dir=tmp_path / "nv", subgroup_numel=1024, buffer_count=buffers)
    return NvmeTier(layout, {"exp_avg": torch.float32, "exp_avg_sq": torch.float32}, {}, offload)


def _state(tier, sg):
    return tier._resident[sg.index].state


def test_a_step_walks_each_buffer_through_its_lifecycle(tmp_path):
    tier = _tier(tmp_path)
    assert all(b.state is S.EMPTY for b in tier._pool)
    order = tier.schedule(tier.subgroups)
    first, second = order[0], order[1]
    assert _state(tier, first) in (S.LOADING, S.CLEAN) and _state(tier, second) in (S.LOADING, S.CLEAN)
    views = tier.acquire(first)
    assert _state(tier, first) is S.ACQUIRED
    views["exp_avg"].fill_(3.0)
    tier.release(first, dirty=True)
    assert first.index not in tier._resident or _state(tier, first) is S.DIRTY
    for sg in order[1:]:  # every later load evicts a dirty buffer: write first, then the read
        tier.acquire(sg)["exp_avg"].fill_(1.0 + sg.index)
        tier.release(sg, dirty=True)
    held = [b for b in tier._pool if b.sg is not None]
    assert held and all(b.state is S.DIRTY for b in held)
    tier.flush()
    assert all(b.state is S.CLEAN and not b.busy for b in held)
    again = tier.acquire(held[0].sg)  # a dirty buffer acquired again stays dirty at release(dirty=False)
    assert held[0].state is S.ACQUIRED
    tier.write_range("exp_avg", held[0].sg, 0, torch.ones(4))
    assert held[0].state is S.ACQUIRED_DIRTY
    del again
    tier.release(held[0].sg, dirty=False)
    assert held[0].state is S.DIRTY
    assert torch.equal(tier.read_range("exp_avg", first, 0, first.numel), torch.full((first.numel,), 3.0))
    tier.forget_state()
    assert all(b.state is S.EMPTY for b in tier._pool)
    tier.close()


def test_a_failed_read_leaves_the_buffer_failed_until_its_acquire_raises(tmp_path):
    tier = _tier(tmp_path)
    for sg in tier.subgroups:
        tier.write_range("exp_avg", sg, 0, torch.full((sg.numel,), float(sg.index)))
    tier.flush()
    target = next(sg for sg in tier.subgroups if sg.index not in tier._resident)
    os.truncate(tier.files[0], 0)
    tier.schedule([target])
    tier.drain()
    buf = tier._resident[target.index]
    assert buf.state is S.FAILED and tier.ready(target)  # acquire would not wait: it raises
    with pytest.raises(OSError, match="shrank|CRC-32C"):
        tier.acquire(target)
    assert buf.state is S.EMPTY and target.index not in tier._resident
    tier.close()


def test_a_move_outside_the_lifecycle_is_refused(tmp_path):
    tier = _tier(tmp_path)
    buf = tier._pool[0]
    assert S.ACQUIRED not in TRANSITIONS[S.EMPTY]
    with pytest.raises(AssertionError, match="EMPTY -> ACQUIRED"):
        buf.move(S.ACQUIRED)
    assert buf.state is S.EMPTY
    tier.close()


def test_protocol_properties(tmp_path):
    tier = _tier(tmp_path)
    assert NvmeTier.does_io is True and NvmeTier.on_device is False and NvmeTier.wait_phase == "nvme_wait"
    assert tier.spill_folder == tier.folders[0] / "state-dict"
    assert tier.pinned_nbytes == 0  # no CUDA here: the pool is not page-locked
    assert tier.pool_nbytes == 2 * tier.record_nbytes
    tier.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locked memory needs CUDA")
def test_pinned_pool_is_counted(tmp_path):
    layout = plan_layout([5000], {TierKind.NVME: 1.0}, 1024)
    offload = Offload(cpu=0.0, nvme=1.0, nvme_dir=tmp_path / "nv", subgroup_numel=1024, buffer_count=2)
    tier = NvmeTier(layout, {"exp_avg": torch.float32}, {}, offload, pin_memory=True)
    assert tier.pinned_nbytes == tier.pool_nbytes and all(b.memory.is_pinned() for b in tier._pool)
    tier.close()
