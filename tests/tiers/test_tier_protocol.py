"""Every tier is a tiers.Tier, and says what the pipeline asks of it: the step loop, the store and
the checkpoint streamer decide by these answers, never by a tier's kind."""
from __future__ import annotations

import pytest
import torch

from tierstate.placement import Offload, TierKind, plan_layout
from tierstate.tiers import DeviceTier, HostTier, Tier

DTYPES = {"exp_avg": torch.float32, "master": torch.float32}


def _nvme(tmp_path, layout):
    from tierstate._native_loader import native

    if native() is None:
        pytest.skip("the NVMe tier needs the native module")
    from tierstate.tiers.nvme import NvmeTier

    return NvmeTier(layout, DTYPES, {}, Offload(cpu=0.0, nvme=1.0, nvme_dir=tmp_path / "nv", subgroup_numel=1024,
                                                buffer_count=2))


# (tier, does_io, wait_phase, on_device, host_views)
EXPECTED = {
    TierKind.HOST: (False, None, False, True),
    TierKind.DEVICE: (False, None, True, False),
    TierKind.NVME: (True, "nvme_wait", False, False),
}


@pytest.mark.parametrize("kind", list(EXPECTED), ids=lambda k: k.value)
def test_each_tier_answers_the_protocol(tmp_path, kind):
    layout = plan_layout([3000], {kind: 1.0}, 1024)
    tier = {TierKind.HOST: lambda: HostTier(layout, DTYPES, {}),
            TierKind.DEVICE: lambda: DeviceTier(layout, DTYPES, {}, torch.device("cpu")),
            TierKind.NVME: lambda: _nvme(tmp_path, layout)}[kind]()
    try:
        assert isinstance(tier, Tier)
        assert (tier.does_io, tier.wait_phase, tier.on_device, tier.host_views) == EXPECTED[kind]
        # each key of an NVMe record starts on a 4 KiB page (O_DIRECT): 3 records x 2 keys x 4096
        assert tier.nbytes == (3 * 2 * 4096 if tier.does_io else 2 * 3000 * 4)
        assert tier.pinned_nbytes == 0  # nothing pinned without CUDA
        assert (tier.spill_folder is not None) == tier.does_io  # only state in files is mapped from files
        sg = layout.subgroups[1]
        assert tier.schedule([sg], keep_order=True) == [sg]
        tier.write_range("exp_avg", sg, 5, torch.arange(10, dtype=torch.float32))
        views = tier.acquire(sg)
        assert torch.equal(views["exp_avg"][5:15], torch.arange(10, dtype=torch.float32))
        tier.release(sg, dirty=False)
        got = tier.read_range("exp_avg", sg, 5, 10)
        assert got.device.type == "cpu" and torch.equal(got, torch.arange(10, dtype=torch.float32))
        tier.settle()
        assert tier.take_write_errors() is None and tier.lost_error() is None
    finally:
        tier.close()
