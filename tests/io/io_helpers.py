"""Helpers of the I/O engine tests (a uniquely named module: every test area has a conftest):
which backends run here, and filesystems mounted by the test itself (root only)."""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import uuid

import pytest

from tierstate._native_loader import native_status


def native_or_skip() -> None:
    ok, why = native_status()
    if not ok:
        pytest.skip(f"tierstate._native did not load: {why}")


def available_backends() -> list[str]:
    ok, _ = native_status()
    if not ok:
        return ["threads"]
    import tierstate.io as tio

    return ["threads", "uring"] if tio.uring_available()[0] else ["threads"]


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True)


@contextlib.contextmanager
def mounted(tmp_path, fs: str, size_mib: int):
    """Mounts a fresh ``fs`` ("tmpfs", "ramfs" or "ext4", the latter on a loop file) of ``size_mib``
    under ``tmp_path``; skips when not root or when the mount is refused. Unmounts in a finally."""
    if os.geteuid() != 0:
        pytest.skip("mounting a test filesystem needs root")
    if not shutil.which("mount") or not shutil.which("umount"):
        pytest.skip("mount/umount not found on PATH")
    mnt = tmp_path / f"mnt-{fs}-{uuid.uuid4().hex[:8]}"
    mnt.mkdir()
    if fs == "tmpfs":
        r = _run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(mnt)])
    elif fs == "ramfs":  # no size limit and, unlike tmpfs, no O_DIRECT at all
        r = _run(["mount", "-t", "ramfs", "ramfs", str(mnt)])
    elif fs == "ext4":
        if not shutil.which("mkfs.ext4"):
            pytest.skip("mkfs.ext4 not found on PATH")
        image = tmp_path / f"{mnt.name}.img"
        with open(image, "wb") as fh:
            fh.truncate(size_mib << 20)
        mk = _run(["mkfs.ext4", "-q", "-F", "-m", "0", str(image)])
        if mk.returncode != 0:
            pytest.skip(f"mkfs.ext4 failed: {mk.stderr.strip()}")
        r = _run(["mount", "-o", "loop", str(image), str(mnt)])
    else:
        raise ValueError(f"fs={fs!r}: expected 'tmpfs', 'ramfs' or 'ext4'")
    if r.returncode != 0:
        pytest.skip(f"mounting {fs} refused here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        u = _run(["umount", str(mnt)])
        if u.returncode != 0:  # something still open: lazy unmount so the test run leaves nothing behind
            _run(["umount", "-l", str(mnt)])


def remount_read_only(mnt) -> None:
    r = _run(["mount", "-o", "remount,ro", str(mnt)])
    if r.returncode != 0:
        pytest.skip(f"remount read-only refused: {r.stderr.strip()}")

