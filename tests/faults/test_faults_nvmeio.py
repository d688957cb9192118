"""Faults and bad inputs of the NVMe tier's I/O: what each one raises and what it leaves.

Each test provokes one fault for real where a test can (another process writing the
state file, ``os.truncate``, a bit flipped on disk) and through
:func:`tierstate.io.faults.fail_nth` where it cannot (EIO), then checks the named error
and that no garbage reached a parameter or the state.
"""
from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest
import torch

import tierstate as ts
import tierstate.io as tio
from tierstate.placement import Offload, TierKind, plan_layout

SIZES = (3000, 5000, 700, 7001)


@pytest.fixture(autouse=True)
def _native():
    from tierstate._native_loader import native, native_status

    if native() is None:
        pytest.skip(f"the NVMe tier needs the native module ({native_status()[1]})")


def _make(nvme_dir, step_in_backward=False, **kw):
    gen = torch.Generator().manual_seed(99)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in SIZES]
    opt = ts.AdamW(params, lr=1e-2, step_in_backward=step_in_backward,
                   offload=Offload(cpu=0.0, nvme=1.0, nvme_dir=nvme_dir, subgroup_numel=1024, buffer_count=2, **kw))
    return params, opt


def _step(params, opt, step, backward=False):
    gen = torch.Generator().manual_seed(step)
    grads = [torch.randn(p.shape, generator=gen) for p in params]
    if backward:
        sum((p * g).sum() for p, g in zip(params, grads)).backward()
    else:
        for p, g in zip(params, grads):
            p.grad = g
    try:
        opt.step()
    finally:
        opt.zero_grad()


def _evicted_record(opt):
    """(state file, offset, nbytes) of a record that is not in the pool (the next step reads it)."""
    tier = opt.tiers[TierKind.NVME]
    sg = next(sg for sg in tier.subgroups if sg.index not in tier._resident)
    file_index, offset, rec = tier._where(sg)
    return tier.files[file_index], offset, rec.nbytes


def _assert_refused_and_untouched(params, opt, backward=False):
    """The next step raises StateLostError and changes no parameter."""
    before = [p.detach().clone() for p in params]
    with pytest.raises(tio.StateLostError):
        _step(params, opt, 99, backward)
    assert all(torch.equal(a, p) for a, p in zip(before, params))


def test_bit_flip_between_steps(tmp_path):
    params, opt = _make(tmp_path / "nv")
    _step(params, opt, 1)
    path, offset, nbytes = _evicted_record(opt)
    with open(path, "r+b") as fh:
        fh.seek(offset + nbytes // 3)
        b = fh.read(1)[0]
        fh.seek(offset + nbytes // 3)
        fh.write(bytes([b ^ 0x01]))
    with pytest.raises(tio.StateLostError, match="CRC-32C") as info:
        _step(params, opt, 2)
    assert info.value.filename == str(path) and info.value.offset == offset
    assert all(torch.isfinite(p).all() for p in params)
    _assert_refused_and_untouched(params, opt)
    opt.close()


def test_state_file_truncated_to_zero_between_steps(tmp_path):
    params, opt = _make(tmp_path / "nv")
    _step(params, opt, 1)
    path, _, _ = _evicted_record(opt)
    os.truncate(path, 0)
    with pytest.raises(tio.StateLostError, match="shrank|CRC-32C"):
        _step(params, opt, 2)
    assert all(torch.isfinite(p).all() for p in params)
    _assert_refused_and_untouched(params, opt)
    opt.close()


def test_another_process_writes_plausible_values_into_a_record(tmp_path):
    params, opt = _make(tmp_path / "nv")
    _step(params, opt, 1)
    path, offset, nbytes = _evicted_record(opt)
    code = ("import os, sys, numpy as np; fd = os.open(sys.argv[1], os.O_WRONLY); "
            "os.pwrite(fd, np.full(int(sys.argv[3]) // 4, 1e-3, np.float32).tobytes(), int(sys.argv[2])); os.close(fd)")
    subprocess.run([sys.executable, "-c", code, str(path), str(offset), str(nbytes)], check=True)
    with pytest.raises(tio.StateLostError, match="changed outside"):
        _step(params, opt, 2)
    opt.close()


def test_eio_on_a_flush_write_keeps_the_values_and_the_next_flush_writes_them(tmp_path):
    from tierstate.io.faults import fail_nth
    from tierstate.tiers.nvme import NvmeTier

    layout = plan_layout([8000], {TierKind.NVME: 1.0}, 1024)
    tier = NvmeTier(layout, {"m": torch.float32}, {}, Offload(cpu=0.0, nvme=1.0, nvme_dir=tmp_path / "nv",
                                                             subgroup_numel=1024, buffer_count=2))
    sg = tier.subgroups[0]
    tier.write_range("m", sg, 0, torch.full((sg.numel,), 7.0))
    with fail_nth("write", 1, errno.EIO, path_contains=str(tmp_path), times=2):  # the write and flush's retry
        with pytest.raises(tio.FileIOError, match="kept in RAM") as info:
            tier.flush()
    assert info.value.errno == errno.EIO and info.value.filename == str(tier.files[0])
    for other in tier.subgroups[1:]:  # evict sub-group 0's buffer: the value must come from RAM
        tier.read_range("m", other, 0, 1)
    assert torch.equal(tier.read_range("m", sg, 0, sg.numel), torch.full((sg.numel,), 7.0))
    tier.flush()  # no stale error: the record is written now
    _, offset, _ = tier._where(sg)
    with open(tier.files[0], "rb") as fh:
        fh.seek(offset)
        on_disk = torch.frombuffer(bytearray(fh.read(sg.numel * 4)), dtype=torch.float32)
    assert torch.equal(on_disk, torch.full((sg.numel,), 7.0))
    tier.close()


def test_eio_on_a_read_outside_a_step_loses_only_that_record(tmp_path):
    from tierstate.io.faults import fail_nth
    from tierstate.tiers.nvme import NvmeTier

    layout = plan_layout([8000], {TierKind.NVME: 1.0}, 1024)
    tier = NvmeTier(layout, {"m": torch.float32}, {"m": 0.25},
                    Offload(cpu=0.0, nvme=1.0, nvme_dir=tmp_path / "nv", subgroup_numel=1024, buffer_count=2))
    first, second = tier.subgroups[:2]
    with fail_nth("read", 1, errno.EIO, path_contains=str(tmp_path)):
        with pytest.raises(tio.StateLostError, match="could not be read") as info:
            tier.read_range("m", first, 0, 4)
    assert info.value.errno == errno.EIO and info.value.record == first.index
    with pytest.raises(tio.StateLostError):  # still lost: never a buffer's stale bytes
        tier.read_range("m", first, 0, 4)
    assert torch.equal(tier.read_range("m", second, 0, 4), torch.full((4,), 0.25))
    tier.write_range("m", second, 0, torch.full((4,), 9.0))
    tier.forget_state()  # what loading a checkpoint does first
    assert torch.equal(tier.read_range("m", first, 0, 4), torch.full((4,), 0.25))
    assert torch.equal(tier.read_range("m", second, 0, 4), torch.full((4,), 0.25))
    tier.close()


def test_eio_while_writing_initial_values_fails_construction_and_leaves_no_files(tmp_path):
    from tierstate.io.faults import fail_nth

    root = tmp_path / "nv"
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in SIZES]
    with fail_nth("write", 2, errno.EIO, path_contains=str(root)):
        with pytest.raises(tio.FileIOError) as info:
            ts.Adagrad(params, lr=0.1, initial_accumulator_value=0.5,
                       offload=Offload(cpu=0.0, nvme=1.0, nvme_dir=root, subgroup_numel=1024, buffer_count=2))
    assert info.value.errno == errno.EIO and str(root) in info.value.filename
    leftovers = [p for p in root.rglob("*") if p.is_file() and p.name.startswith("state-")]
    assert leftovers == []


def test_lost_record_in_step_in_backward_mode_stops_every_later_backward(tmp_path):
    params, opt = _make(tmp_path / "nv", step_in_backward=True)
    _step(params, opt, 1, backward=True)
    _step(params, opt, 2, backward=True)
    tier = opt.tiers[TierKind.NVME]
    tier.drain()
    path = tier.files[0]
    with open(path, "r+b") as fh:  # flip a bit in every record: whichever is read first is caught
        for sg in tier.subgroups:
            _, offset, rec = tier._where(sg)
            fh.seek(offset + 5)
            b = fh.read(1)[0]
            fh.seek(offset + 5)
            fh.write(bytes([b ^ 0x80]))
    with pytest.raises(tio.StateLostError):
        _step(params, opt, 3, backward=True)
    assert all(torch.isfinite(p).all() for p in params)
    _assert_refused_and_untouched(params, opt, backward=True)
    opt.close()


def test_bad_arguments_of_the_fault_hook_and_the_checksum():
    from tierstate.io.faults import fail_nth

    with pytest.raises(ValueError, match="op='delete'"):
        with fail_nth("delete", 1):
            pass
    with pytest.raises(ValueError, match="nth=0"):
        with fail_nth("read", 0):
            pass
    with pytest.raises(ValueError, match="times=0"):
        with fail_nth("write", 1, times=0):
            pass
    with pytest.raises(ValueError, match=r"value=4294967296"):
        tio.crc32c(b"abc", 2**32)
    with pytest.raises(ValueError, match="unknown crc32c variant"):
        tio.crc32c(b"abc", isa="sse9")
