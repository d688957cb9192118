"""run_subgroups over real tiers: every segment updated once, in any order, errors released,
a sub-group released only once its executor's completion is done."""
from __future__ import annotations

import pytest
import torch

from tierstate.pipeline import run_subgroups
from tierstate.pipeline.executors import DONE
from tierstate.placement import Offload, TierKind, plan_layout
from tierstate.telemetry import Telemetry
from tierstate.tiers import HostTier


def _tiers(tmp_path, layout, dtypes):
    tiers = {}
    if layout.tier_numel[TierKind.HOST]:
        tiers[TierKind.HOST] = HostTier(layout, dtypes, {})
    if layout.tier_numel[TierKind.NVME]:
        from tierstate._native_loader import native

        if native() is None:
            pytest.skip("the NVMe tier needs the native module")
        from tierstate.tiers.nvme import NvmeTier

        tiers[TierKind.NVME] = NvmeTier(layout, dtypes, {}, Offload(cpu=0.5, nvme=0.5, nvme_dir=tmp_path / "nv",
                                                                      subgroup_numel=1024, buffer_count=2))
    return tiers


class _Each:
    """An executor that calls ``fn(seg, views)`` for each segment and is done when it returns."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def submit(self, sg, segments, views):
        for seg in segments:
            self.fn(seg, views)
        return DONE


def _run(work, tiers, fn, tel):
    executor = _Each(fn)
    run_subgroups(work, tiers, lambda tier: executor, tel)


def _state(tiers, layout, key):
    out = torch.empty(layout.total)
    for sg in layout.subgroups:
        out[sg.start: sg.start + sg.numel] = tiers[sg.tier].read_range(key, sg, 0, sg.numel)
    return out


@pytest.mark.parametrize("fractions", [{TierKind.HOST: 1.0}, {TierKind.HOST: 0.5, TierKind.NVME: 0.5}])
def test_every_segment_updated_once_per_step(tmp_path, fractions):
    numels = [3000, 1, 2047, 4500]
    layout = plan_layout(numels, fractions, 1024)
    tiers = _tiers(tmp_path, layout, {"m": torch.float32})
    tel = Telemetry(enabled=True, log_every=0)
    seen = []

    def update(seg, views):
        seen.append(seg)
        start = layout.param_starts[seg.param_index] + seg.param_offset  # flat index of the piece
        views["m"][seg.subgroup_offset: seg.subgroup_offset + seg.numel] += torch.arange(start, start + seg.numel)

    work = [(sg, list(sg.segments)) for sg in layout.subgroups]
    for step in range(3):
        tel.begin_step(step)
        _run(work, tiers, update, tel)
        tel.end_step()
    assert sorted(seen, key=lambda s: (s.subgroup, s.subgroup_offset)) == sorted(
        [s for sg in layout.subgroups for s in sg.segments] * 3, key=lambda s: (s.subgroup, s.subgroup_offset))
    assert torch.equal(_state(tiers, layout, "m"), 3 * torch.arange(layout.total, dtype=torch.float32))
    for t in tiers.values():
        t.close()


def test_failed_update_releases_the_subgroup(tmp_path):
    layout = plan_layout([6000], {TierKind.HOST: 0.5, TierKind.NVME: 0.5}, 1024)
    tiers = _tiers(tmp_path, layout, {"m": torch.float32})
    tel = Telemetry(enabled=False)
    work = [(sg, list(sg.segments)) for sg in layout.subgroups]

    def broken(seg, views):
        raise FloatingPointError("boom")

    with pytest.raises(FloatingPointError):
        _run(work, tiers, broken, tel)
    _run(work, tiers, lambda seg, v: v["m"][seg.subgroup_offset: seg.subgroup_offset + seg.numel].add_(1), tel)
    assert torch.equal(_state(tiers, layout, "m"), torch.ones(6000))
    for t in tiers.values():
        t.close()


class _Later:
    """The completion of work that finishes after submit returned (as a GPU's would): done once
    ``finish`` ran; ``wait`` finishes it."""

    def __init__(self, log, sg) -> None:
        self.log, self.sg, self.finished = log, sg, False

    def done(self) -> bool:
        return self.finished

    def wait(self) -> None:
        self.finished = True
        self.log.append(("finished", self.sg.index))


class _ReleaseLog(HostTier):
    def __init__(self, *args, log, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.log = log

    def release(self, sg, dirty):
        self.log.append(("released", sg.index))


def test_subgroup_released_only_after_its_completion():
    """An executor whose work outlives submit (a GPU updating host state: H2D, update, D2H) keeps
    its sub-group held until the completion is done; the loop waits for every one before it ends."""
    layout = plan_layout([3000], {TierKind.HOST: 1.0}, 1024)
    log = []
    tiers = {TierKind.HOST: _ReleaseLog(layout, {"m": torch.float32}, {}, log=log)}
    pending = []

    class Async:
        def submit(self, sg, segments, views):
            done = [c for c in pending if not c.finished]
            if done:
                done[0].wait()  # the previous sub-group's work finishes while the next is submitted
            c = _Later(log, sg)
            pending.append(c)
            return c

    executor = Async()
    run_subgroups([(sg, list(sg.segments)) for sg in layout.subgroups], tiers, lambda tier: executor,
                  Telemetry(enabled=False))
    for sg in layout.subgroups:
        assert log.index(("finished", sg.index)) < log.index(("released", sg.index)), log
    assert sorted(e for e in log if e[0] == "released") == [("released", sg.index) for sg in layout.subgroups]
