"""NvmeTier on its own: record format, initial values, the write-back cache, flush."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from tierstate.placement import Offload, TierKind, plan_layout
from tierstate.tiers.nvme import ALIGN, NvmeTier


def _tier(tmp_path, numels=(5000, 3000), subgroup=1024, buffers=2, dtypes=None, inits=None, dirs=None):
    layout = plan_layout(list(numels), {TierKind.NVME: 1.0}, subgroup)
    dtypes = dtypes or {"exp_avg": torch.float32, "exp_avg_sq": torch.float32}
    offload = Offload(cpu=0.0, nvme=1.0, nvme_dir=dirs or tmp_path / "nv", subgroup_numel=subgroup,
                      buffer_count=buffers)
    return NvmeTier(layout, dtypes, inits or {}, offload)


def _raw(tier, sg, key):
    """``key`` of ``sg`` read straight from the file, bypassing the tier."""
    index, offset, rec = tier._where(sg)
    start, nbytes = rec.regions[key]
    data = np.fromfile(tier.files[index], dtype=np.uint8, count=nbytes, offset=offset + start)
    return torch.from_numpy(data.copy()).view(tier.dtypes[key])


def test_record_layout_is_aligned(tmp_path):
    tier = _tier(tmp_path, dtypes={"exp_avg": torch.bfloat16, "master": torch.float32, "exp_avg_sq": torch.bfloat16})
    rec = tier.record(tier.subgroups[0])
    assert list(rec.regions) == ["master", "exp_avg", "exp_avg_sq"]
    assert all(start % ALIGN == 0 for start, _ in rec.regions.values())
    assert rec.regions["master"][1] == 1024 * 4 and rec.regions["exp_avg"][1] == 1024 * 2
    assert tier.pool_nbytes == 2 * rec.nbytes
    tier.close()


def test_files_start_with_the_init_values(tmp_path):
    tier = _tier(tmp_path, dtypes={"master": torch.float32, "sum": torch.bfloat16}, inits={"sum": 0.37})
    for sg in tier.subgroups:  # last sub-group is partial: 8000 = 7 x 1024 + 832
        assert torch.equal(_raw(tier, sg, "sum"), torch.full((sg.numel,), 0.37, dtype=torch.bfloat16))
        assert torch.equal(_raw(tier, sg, "master"), torch.zeros(sg.numel))
        assert torch.equal(tier.read_range("sum", sg, 0, sg.numel), torch.full((sg.numel,), 0.37, dtype=torch.bfloat16))
    tier.close()


def test_write_back_reaches_the_files(tmp_path):
    tier = _tier(tmp_path, buffers=2)
    expected = {}
    for sg in tier.subgroups:  # 8 sub-groups through 2 buffers: every load evicts
        values = torch.arange(sg.numel, dtype=torch.float32) + 10_000 * sg.index
        tier.write_range("exp_avg_sq", sg, 0, values)
        tier.write_range("exp_avg", sg, 7, -values[: sg.numel - 7])
        expected[sg.index] = values
    for sg in tier.subgroups:  # read back through the cache (some resident, some evicted)
        assert torch.equal(tier.read_range("exp_avg_sq", sg, 0, sg.numel), expected[sg.index])
    tier.flush()
    for sg in tier.subgroups:
        assert torch.equal(_raw(tier, sg, "exp_avg_sq"), expected[sg.index])
        assert torch.equal(_raw(tier, sg, "exp_avg")[7:], -expected[sg.index][: sg.numel - 7])
        assert torch.equal(_raw(tier, sg, "exp_avg")[:7], torch.zeros(7))
    tier.close()


def test_schedule_meets_resident_subgroups_first(tmp_path):
    tier = _tier(tmp_path, buffers=3)
    sgs = tier.subgroups
    assert tier.schedule(sgs) == sgs  # nothing resident: forward
    for sg in sgs:
        views = tier.acquire(sg)
        views["exp_avg"].add_(1.0)
        tier.release(sg, dirty=True)
    order = tier.schedule(sgs)
    assert order == sgs[::-1]
    assert all(tier.ready(sg) for sg in order[:3]), "the last three of the previous step are still in the pool"
    for sg in order:
        views = tier.acquire(sg)
        views["exp_avg"].add_(1.0)
        tier.release(sg, dirty=True)
    for sg in sgs:
        assert torch.equal(tier.read_range("exp_avg", sg, 0, sg.numel), torch.full((sg.numel,), 2.0))
    tier.close()


def test_release_of_unacquired_subgroup_raises(tmp_path):
    tier = _tier(tmp_path)
    with pytest.raises(RuntimeError, match="not acquired"):
        tier.release(tier.subgroups[0], dirty=True)
    tier.close()


def test_state_larger_than_pool_never_uses_more_buffers(tmp_path):
    tier = _tier(tmp_path, numels=(50_000,), buffers=2)
    tier.schedule(tier.subgroups)
    for sg in tier.subgroups:
        tier.acquire(sg)
        tier.release(sg, dirty=True)
    assert len(tier._pool) == 2 and len(tier._resident) == 2
    tier.close()


def test_pool_without_huge_pages_says_what_it_costs(tmp_path, monkeypatch, caplog):
    """Where the kernel has transparent huge pages off, the tier still works on 4 KiB pages
    and says once, naming the setting that lets it use them."""
    import logging

    import tierstate.io as tio
    from tierstate.io import engine as io_engine

    monkeypatch.setattr(tio, "huge_page_size", lambda: 0)
    monkeypatch.setattr(io_engine, "_said", set())
    with caplog.at_level(logging.WARNING, logger="tierstate"):
        tier = _tier(tmp_path)
    assert "transparent huge pages are off" in caplog.text and "madvise" in caplog.text
    tier.close()


# -- records changed behind the tier's back: every read is checked (size, CRC-32C) --------------------
def _state_lost_error():
    import tierstate.io as tio

    # a class nothing raises where the library has none: the tests then fail on the behaviour
    return getattr(tio, "StateLostError", None) or type("StateLostError", (OSError,), {})


def _filled_tier(tmp_path, buffers=2):
    """8 records through ``buffers`` buffers, each holding known values, flushed to the file."""
    tier = _tier(tmp_path, buffers=buffers)
    for sg in tier.subgroups:
        tier.write_range("exp_avg", sg, 0, torch.full((sg.numel,), 1.0 + sg.index))
        tier.write_range("exp_avg_sq", sg, 0, torch.full((sg.numel,), 2.0 + sg.index))
    tier.flush()
    return tier


def _not_resident(tier):
    return next(sg for sg in tier.subgroups if sg.index not in tier._resident)


def test_truncated_file_is_refused_even_after_write_back_extends_it(tmp_path):
    tier = _filled_tier(tmp_path)
    for sg in list(tier.subgroups)[-2:]:  # both buffers dirty: the next load writes one back first
        tier.write_range("exp_avg", sg, 0, torch.full((sg.numel,), -5.0))
    os.truncate(tier.files[0], 0)
    target = tier.subgroups[0]
    with pytest.raises(_state_lost_error()) as info:
        tier.read_range("exp_avg", target, 0, target.numel)  # write-back re-extends the file first
    err = info.value
    assert isinstance(err, OSError) and err.record == target.index and err.filename == str(tier.files[0])
    assert "load_optimizer" in str(err) and "lost" in str(err)
    with pytest.raises(_state_lost_error()):  # and again: the record stays lost, never zeros
        tier.read_range("exp_avg", target, 0, target.numel)
    tier.close()


def test_truncated_file_is_refused_before_the_read(tmp_path):
    tier = _filled_tier(tmp_path)
    size = os.path.getsize(tier.files[0])
    os.truncate(tier.files[0], size - ALIGN)  # the last record loses its tail only
    target = tier.subgroups[-1] if tier.subgroups[-1].index not in tier._resident else _not_resident(tier)
    with pytest.raises(_state_lost_error(), match="shrank|CRC"):
        tier.read_range("exp_avg", target, 0, target.numel)
    tier.close()


_OVERWRITE = """
import os, sys
path, offset, nbytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
fd = os.open(path, os.O_WRONLY)
# plausible state (small positive floats), not garbage: only the checksum can tell
os.pwrite(fd, bytes([0, 0, 0, 0x3F]) * (nbytes // 4), offset)  # 0.5
os.close(fd)
"""


def test_record_overwritten_by_another_process_is_refused(tmp_path):
    import subprocess
    import sys

    tier = _filled_tier(tmp_path)
    target = _not_resident(tier)
    _, offset, rec = tier._where(target)
    subprocess.run([sys.executable, "-c", _OVERWRITE, str(tier.files[0]), str(offset), str(ALIGN)], check=True)
    with pytest.raises(_state_lost_error(), match="CRC-32C") as info:
        tier.read_range("exp_avg", target, 0, target.numel)
    assert info.value.record == target.index and info.value.offset == offset
    tier.close()


def _flip_bit(tier, target, where, mask=0x10):
    """Flip ``mask`` in one byte of ``target``'s record in its file: the middle of key
    ``where``'s region, or the record's last byte (``where="last byte"``)."""
    _, offset, rec = tier._where(target)
    start, nbytes = rec.regions["exp_avg_sq" if where == "last byte" else where]
    at = offset + rec.nbytes - 1 if where == "last byte" else offset + start + nbytes // 2
    with open(tier.files[0], "r+b") as fh:
        fh.seek(at)
        byte = fh.read(1)[0]
        fh.seek(at)
        fh.write(bytes([byte ^ mask]))


@pytest.mark.parametrize("where", ["exp_avg", "exp_avg_sq", "last byte"])
def test_one_flipped_bit_is_refused(tmp_path, where):
    tier = _filled_tier(tmp_path)
    target = _not_resident(tier)
    _flip_bit(tier, target, where)
    with pytest.raises(_state_lost_error(), match="CRC-32C"):
        tier.read_range("exp_avg", target, 0, target.numel)
    tier.close()


def test_untouched_records_read_back_through_the_checksum(tmp_path):
    """Initial values (fallocate'd zeros and written init values alike) carry a checksum too."""
    tier = _tier(tmp_path, dtypes={"master": torch.float32, "sum": torch.bfloat16}, inits={"sum": -0.0})
    for sg in tier.subgroups:
        assert torch.equal(tier.read_range("sum", sg, 0, sg.numel).view(torch.int16),
                           torch.full((sg.numel,), -0.0, dtype=torch.bfloat16).view(torch.int16))
    tier.close()
