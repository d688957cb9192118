"""Faults and bad inputs around the NVMe run folder: damaged markers, things in the way of
the lock, a full disk at claim time, folders removed under a live run, signals other than
SIGTERM, handlers changed by the application."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

import tierstate as ts
from tierstate.placement import TierKind
from tierstate.tiers import rundir
from tierstate.tiers.rundir import LOCK_NAME, MARKER_NAME, NvmeDirInUseError

IMPORT_ROOT = Path(ts.__file__).resolve().parents[1]
TERM_CHILD = Path(__file__).resolve().parents[1] / "tiers" / "term_child.py"


@pytest.fixture(autouse=True)
def _native_io():
    from tierstate._native_loader import native, native_status

    if native() is None:
        pytest.skip(f"the native module did not load ({native_status()[1]})")


def _optimizer(nvme_dir, numel: int = 5000):
    params = [torch.nn.Parameter(torch.randn(numel))]
    return ts.AdamW(params, offload=ts.Offload(cpu=0.0, nvme=1.0, nvme_dir=nvme_dir, subgroup_numel=1024,
                                               buffer_count=2))


def _snapshot(folder: Path) -> dict:
    return {p.name: (p.is_symlink(), p.read_bytes() if p.is_file() and not p.is_symlink() else None)
            for p in folder.iterdir()}


def test_truncated_marker_in_explicit_folder_refuses_to_start(tmp_path):
    """Power loss while a marker was first written: an empty file proves nothing, and a run
    must not start over it (the files behind it may belong to a live run elsewhere)."""
    folder = tmp_path / "nv"
    folder.mkdir()
    (folder / MARKER_NAME).write_bytes(b"")
    (folder / "state-123-abcd-0.bin").write_bytes(b"\1" * 4096)
    before = _snapshot(folder)
    with pytest.raises(NvmeDirInUseError, match=rf"{MARKER_NAME}.*cannot be read.*remove it by hand.*another nvme_dir"):
        _optimizer(folder)
    assert _snapshot(folder) == before


def test_marker_that_is_a_symlink_or_huge_is_not_proof(tmp_path):
    target = tmp_path / "real.json"
    marker = rundir.new_marker(tmp_path / "nv")
    marker["pid"] = 999999999
    target.write_text(json.dumps(marker))
    folder = tmp_path / "nv"
    folder.mkdir()
    (folder / MARKER_NAME).symlink_to(target)
    with pytest.raises(NvmeDirInUseError, match="not a marker tierstate wrote"):
        _optimizer(folder)
    (folder / MARKER_NAME).unlink()
    (folder / MARKER_NAME).write_text(json.dumps(marker) + " " * (2 << 20))
    with pytest.raises(NvmeDirInUseError, match="not a marker tierstate wrote"):
        _optimizer(folder)
    assert target.exists()


@pytest.mark.parametrize("kind", ["dir", "symlink"])
def test_something_in_the_way_of_the_lock(tmp_path, kind):
    folder = tmp_path / "nv"
    folder.mkdir()
    precious = tmp_path / "precious.txt"
    precious.write_text("keep")
    if kind == "dir":
        (folder / LOCK_NAME).mkdir()
    else:
        (folder / LOCK_NAME).symlink_to(precious)
    with pytest.raises(OSError, match=rf"nvme_dir=.*{LOCK_NAME} is a (folder|symbolic link).*move it away") as err:
        _optimizer(folder)
    assert err.value.errno in (21, 40) and err.value.filename == str(folder / LOCK_NAME)
    assert precious.read_text() == "keep" and sorted(p.name for p in folder.iterdir()) == [LOCK_NAME]


def test_nvme_dir_that_is_a_device_or_default_root_a_file(tmp_path, monkeypatch):
    with pytest.raises(NotADirectoryError, match=r"nvme_dir='/dev/null'.*a character device, not a folder"):
        _optimizer("/dev/null")
    f = tmp_path / "rootfile"
    f.write_text("x")
    monkeypatch.setenv("TIERSTATE_NVME_DIR", str(f))
    with pytest.raises(NotADirectoryError, match=r"default NVMe root .*rootfile \(TIERSTATE_NVME_DIR\) is a file"):
        _optimizer(None)
    assert f.read_text() == "x"


@pytest.fixture
def tiny_tmpfs(tmp_path):
    mnt = tmp_path / f"tmpfs-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip() or res.returncode}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_disk_full_while_writing_the_marker(tiny_tmpfs):
    """The filesystem fills up before the run folder is even claimed: an OSError naming the
    folder and ENOSPC, and nothing of ours left behind (no lock, no temporary marker)."""
    filler = tiny_tmpfs / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as exc:
        assert exc.errno == 28
    finally:
        os.close(fd)
    with pytest.raises(OSError) as err:
        _optimizer(tiny_tmpfs / "nv")
    assert err.value.errno == 28 and str(tiny_tmpfs / "nv") in str(err.value)
    assert sorted(p.name for p in tiny_tmpfs.iterdir()) == ["filler"]


def test_run_folder_removed_under_a_live_run(tmp_path):
    """Someone removes the folder while the run is live: the run keeps stepping on its open
    files, and close() does not fail (nor recreate anything)."""
    import shutil

    folder = tmp_path / "nv"
    params = [torch.nn.Parameter(torch.randn(5000))]
    opt = ts.AdamW(params, offload=ts.Offload(cpu=0.0, nvme=1.0, nvme_dir=folder, subgroup_numel=1024,
                                              buffer_count=2))
    params[0].grad = torch.randn(5000)
    opt.step()
    shutil.rmtree(folder)
    for _ in range(3):
        opt.step()
    assert torch.isfinite(params[0]).all()
    opt.close()
    assert not folder.exists()


def test_signal_handlers_restored_after_close_and_app_handler_left(tmp_path):
    import gc

    from tierstate.tiers import termination

    gc.collect()  # optimizers other tests left unclosed are collected, their cleanups unregistered
    if termination._cleanups:
        pytest.skip("another live run folder of this process keeps the handler armed")
    before = signal.getsignal(signal.SIGTERM)
    opt = _optimizer(tmp_path / "a")
    assert signal.getsignal(signal.SIGTERM) is not before, "armed while a run folder is live"
    opt.close()
    assert signal.getsignal(signal.SIGTERM) is before, "the previous disposition is back once nothing is registered"

    def app(signum, frame):
        pass

    opt = _optimizer(tmp_path / "b")
    signal.signal(signal.SIGTERM, app)  # the application takes SIGTERM over afterwards
    opt.close()
    try:
        assert signal.getsignal(signal.SIGTERM) is app, "a handler installed after ours is left in place"
    finally:
        signal.signal(signal.SIGTERM, before)


def test_sighup_default_disposition_cleans_up_and_dies_by_sighup(tmp_path):
    where = tmp_path / "nv"
    env = dict(os.environ, PYTHONPATH=str(IMPORT_ROOT))
    proc = subprocess.Popen([sys.executable, str(TERM_CHILD), "step", str(where), "default"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    info = json.loads(proc.stdout.readline())
    assert proc.stdout.readline().startswith("loop")
    proc.send_signal(signal.SIGHUP)
    assert proc.wait(60) == -signal.SIGHUP
    assert not any(os.path.exists(f) for f in info["files"]) and not where.exists()


def test_live_marker_of_this_process_with_free_lock_refuses(tmp_path):
    """A marker naming this very process (a copied folder, or a lock file removed by hand):
    the owner is alive, so the claim refuses rather than delete a live run's files."""
    folder = tmp_path / "nv"
    folder.mkdir()
    marker = rundir.new_marker(folder, files=(LOCK_NAME, "state-x-0.bin"))
    (folder / "state-x-0.bin").write_bytes(b"live")
    (folder / MARKER_NAME).write_text(json.dumps(marker))
    with pytest.raises(NvmeDirInUseError, match=rf"pid {os.getpid()} is alive"):
        _optimizer(folder)
    assert (folder / "state-x-0.bin").read_bytes() == b"live"


def test_stale_marker_listing_a_folder_leaves_it(tmp_path, caplog):
    """A name the marker lists that is now a folder (the user reused it): the sweep unlinks
    files only."""
    import logging

    folder = tmp_path / "nv"
    folder.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    marker = rundir.new_marker(folder, files=(LOCK_NAME, "state-x-0.bin", "state-x-1.bin"))
    marker["pid"] = dead.pid
    (folder / "state-x-0.bin").write_bytes(b"old")
    (folder / "state-x-1.bin").mkdir()
    (folder / "state-x-1.bin" / "user.txt").write_text("mine")
    (folder / MARKER_NAME).write_text(json.dumps(marker))
    with caplog.at_level(logging.WARNING, logger="tierstate"):
        opt = _optimizer(folder)
    assert not (folder / "state-x-0.bin").exists()
    assert (folder / "state-x-1.bin" / "user.txt").read_text() == "mine"
    assert any("not regular files" in r.getMessage() for r in caplog.records)
    assert opt.tiers[TierKind.NVME].files[0].exists()
    opt.close()
    assert sorted(p.name for p in folder.iterdir()) == ["state-x-1.bin"]
