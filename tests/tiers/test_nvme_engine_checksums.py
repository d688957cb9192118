"""Where the NVMe tier's record checksums are taken: on the caller, or on the I/O engine's
checksum thread when the kernels leave a core free (``tierstate.io.checksums_beside_kernels``).

Either way every record read must be checked against the CRC-32C of what was written, and
the state must train bit for bit as in RAM; the spy below also proves which path ran (the
caller takes no record CRC at all when the engine does).
"""
from __future__ import annotations

import pytest
import torch

import tierstate as ts
import tierstate.io as tio
import tierstate.tiers.nvme_pool as nvme_pool
from tierstate.kernels import backend
from test_nvme_tier import _filled_tier, _flip_bit, _not_resident, _state_lost_error

pytestmark = pytest.mark.skipif(backend.default_num_threads() < 2,
                                reason="the engine's checksum thread is used only beside a free core")


@pytest.fixture(params=["caller", "engine"])
def where(request, monkeypatch):
    """Kernel threads set so that the tier takes its checksums ``where`` the parameter says;
    yields the list of record sizes the caller checksummed (empty on the engine's path)."""
    before = backend.get_num_threads()
    backend.set_num_threads(1 if request.param == "engine" else backend.default_num_threads())
    assert tio.checksums_beside_kernels() is (request.param == "engine")
    calls = []
    real = tio.crc32c

    class SpyIO:  # the tier's view of tierstate.io, counting the CRCs it takes itself
        def __getattr__(self, name):
            return getattr(tio, name)

        @staticmethod
        def crc32c(buf, *args, **kwargs):
            calls.append(len(buf))
            return real(buf, *args, **kwargs)

    monkeypatch.setattr(nvme_pool, "tio", SpyIO())
    yield request.param, calls
    backend.set_num_threads(before)


def test_records_round_trip_through_evictions(tmp_path, where):
    mode, calls = where
    tier = _filled_tier(tmp_path)  # 8 records through 2 buffers, flushed
    for sg in tier.subgroups:
        assert torch.equal(tier.read_range("exp_avg", sg, 0, sg.numel), torch.full((sg.numel,), 1.0 + sg.index))
        assert torch.equal(tier.read_range("exp_avg_sq", sg, 0, sg.numel), torch.full((sg.numel,), 2.0 + sg.index))
    assert (len(calls) == 0) is (mode == "engine")
    tier.close()


@pytest.mark.parametrize("flip", ["exp_avg", "last byte"])
def test_a_flipped_bit_is_refused_on_either_path(tmp_path, where, flip):
    mode, calls = where
    tier = _filled_tier(tmp_path)
    target = _not_resident(tier)
    _flip_bit(tier, target, flip, mask=0x01)
    with pytest.raises(_state_lost_error(), match="CRC-32C"):
        tier.read_range("exp_avg", target, 0, target.numel)
    assert (len(calls) == 0) is (mode == "engine")
    tier.close()


def test_nvme_state_trains_bit_for_bit_as_in_ram(tmp_path, where):
    mode, calls = where
    sizes = (3000, 5000, 1, 7001)

    def run(offload):
        gen = torch.Generator().manual_seed(7)
        params = [torch.nn.Parameter(torch.randn(n, generator=gen).to(torch.bfloat16)) for n in sizes]
        opt = ts.AdamW(params, lr=1e-2, weight_decay=0.1, offload=offload)
        for _ in range(8):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen).to(torch.bfloat16)
            opt.step()
        state = opt.state_dict()["state"]
        opt.close()
        return params, state

    ram_params, ram_state = run("cpu")
    nvme_params, nvme_state = run(ts.Offload(nvme=1.0, nvme_dir=tmp_path / "nv", subgroup_numel=1024,
                                             buffer_count=2))
    for a, b in zip(ram_params, nvme_params):
        assert torch.equal(a, b)
    for idx in ram_state:
        for key in ram_state[idx]:
            assert torch.equal(ram_state[idx][key], nvme_state[idx][key]), f"{idx}/{key}"
    record_crcs = [n for n in calls if n >= 1024]  # the caller's CRCs of whole records
    assert (len(record_crcs) == 0) is (mode == "engine")
