"""The NVMe tier's folders: lock, crashed-run sweep, space reservation, cleanup."""
from __future__ import annotations

import gc
import json
import logging
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

import tierstate as ts
import tierstate.io as tio
from tierstate.placement import TierKind
from tierstate.tiers.rundir import LOCK_NAME, NvmeDirInUseError
import tierstate

# the folder holding the tierstate under test (the checkout, or site-packages when installed):
# children must import that one, whose native module was built
IMPORT_ROOT = Path(tierstate.__file__).resolve().parents[1]


CHILD = Path(__file__).with_name("nvme_child.py")
ROOT = Path(__file__).resolve().parents[2]


def _child(action: str, where: str, env_root: Path | None = None) -> tuple[subprocess.Popen, dict]:
    env = dict(os.environ, PYTHONPATH=str(IMPORT_ROOT))
    if env_root is not None:
        env["TIERSTATE_NVME_DIR"] = str(env_root)
    proc = subprocess.Popen([sys.executable, str(CHILD), action, where], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()
    if not line:
        proc.wait(30)
        pytest.fail(f"child exited with {proc.returncode} before reporting its folders")
    return proc, json.loads(line)


def _optimizer(nvme_dir, numel: int = 5000, subgroup_numel: int = 1024):
    params = [torch.nn.Parameter(torch.randn(numel))]
    return ts.AdamW(params, offload=ts.Offload(cpu=0.0, nvme=1.0, nvme_dir=nvme_dir,
                                               subgroup_numel=subgroup_numel, buffer_count=2))


def test_folder_locked_by_another_process(tmp_path):
    folder = tmp_path / "shared"
    proc, info = _child("hold", str(folder))
    try:
        with pytest.raises(NvmeDirInUseError, match=rf"in use by pid {info['pid']}.*give each run its own nvme_dir"):
            _optimizer(folder)
        assert all(Path(f).exists() for f in info["files"]), "the refused run must not touch the holder's files"
    finally:
        proc.stdin.close()
        proc.wait(30)
    assert proc.returncode == 0
    assert not any(Path(f).exists() for f in info["files"])
    _optimizer(folder).close()  # free again once the holder is gone


def test_second_tier_of_same_process_is_refused(tmp_path):
    opt = _optimizer(tmp_path / "one")
    try:
        with pytest.raises(NvmeDirInUseError, match="another optimizer of this process"):
            _optimizer(tmp_path / "one")
    finally:
        opt.close()


def test_default_folders_are_per_run(nvme_root):
    a, b = _optimizer(None), _optimizer(None)
    fa, fb = a.tiers[TierKind.NVME].folders[0], b.tiers[TierKind.NVME].folders[0]
    assert fa != fb and fa.parent == fb.parent == nvme_root
    a.close()
    b.close()
    assert list(nvme_root.iterdir()) == []


def test_crashed_default_run_is_reported_and_removed(nvme_root, caplog):
    proc, info = _child("crash", "-", env_root=nvme_root)
    proc.wait(30)
    stale = Path(info["folders"][0])
    assert proc.returncode == -9 and stale.exists() and stale.parent == nvme_root
    with caplog.at_level(logging.WARNING, logger="tierstate"):
        opt = _optimizer(None)
    assert not stale.exists()
    msg = [r.getMessage() for r in caplog.records if str(stale) in r.getMessage()]
    assert msg and f"pid {info['pid']}" in msg[0] and "MiB" in msg[0] and "removing" in msg[0]
    opt.close()


def test_crashed_run_in_explicit_folder_is_cleaned(tmp_path, caplog):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "keep.txt").write_text("user data")
    proc, info = _child("crash", str(folder))
    proc.wait(30)
    assert Path(info["files"][0]).exists()
    with caplog.at_level(logging.WARNING, logger="tierstate"):
        opt = _optimizer(folder)
    assert any("ended without cleaning up" in r.getMessage() for r in caplog.records)
    opt.close()
    assert sorted(p.name for p in folder.iterdir()) == ["keep.txt"], "only the run's own files go"


def test_folder_without_marker_is_left_alone(nvme_root, caplog):
    """A run-* folder as an earlier tierstate left it (pid file, lock, state file, no marker)
    proves nothing about who made it: reported, never removed."""
    nvme_root.mkdir(parents=True)
    odd = nvme_root / "run-1-feedbeef"
    odd.mkdir()
    (odd / "tierstate.pid").write_text("999999\n")  # not running
    (odd / LOCK_NAME).touch()
    (odd / "state-0.bin").write_bytes(b"x" * 4096)
    old = time.time() - 3600
    os.utime(odd, (old, old))
    with caplog.at_level(logging.WARNING, logger="tierstate"):
        opt = _optimizer(None)
    opt.close()
    assert sorted(p.name for p in odd.iterdir()) == ["state-0.bin", LOCK_NAME, "tierstate.pid"]
    assert any("left in place" in r.getMessage() and str(odd) in r.getMessage() for r in caplog.records)


def test_files_removed_on_close_and_collection(tmp_path, nvme_root):
    opt = _optimizer(tmp_path / "explicit")
    files = opt.tiers[TierKind.NVME].files
    assert all(f.exists() for f in files)
    opt.close()
    assert not (tmp_path / "explicit").exists(), "a folder the run created is removed when left empty"
    opt = _optimizer(None)
    folder = opt.tiers[TierKind.NVME].folders[0]
    assert folder.exists()
    del opt
    gc.collect()
    assert not folder.exists()


def test_files_removed_at_process_exit(tmp_path, nvme_root):
    """Neither optimizer (explicit folder, default folder) is closed; exit must clean both."""
    proc, info = _child("exit", f"{tmp_path / 'x'},-", env_root=nvme_root)
    proc.wait(30)
    assert proc.returncode == 0
    assert len(info["files"]) == 2 and not any(Path(f).exists() for f in info["files"])
    assert not any(Path(f).exists() for f in info["folders"])


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 16 MiB tmpfs mounted for the test (needs root and mount rights; skipped otherwise)."""
    mnt = tmp_path / f"tmpfs-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip() or res.returncode}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_disk_too_small_names_the_shortfall(small_tmpfs):
    # 8 Mi elements of fp32 AdamW moments: 64 MiB of records on a 16 MiB filesystem.
    with pytest.raises(tio.DiskFullError) as err:
        _optimizer(small_tmpfs / "run", numel=8 << 20, subgroup_numel=1 << 20)
    text = str(err.value)
    assert "needs 64.0 MiB of disk under" in text and str(small_tmpfs) in text and "16.0 MiB free" in text
    assert err.value.errno == 28
    assert not (small_tmpfs / "run").exists() or not any((small_tmpfs / "run").iterdir())
    _optimizer(small_tmpfs / "run2", numel=1 << 20, subgroup_numel=1 << 18).close()  # 8 MiB fits
