"""Reserving disk space up front, so that a run fails at start with a clear message
rather than hours later with ENOSPC in the middle of a step."""
from __future__ import annotations

import errno
import os

from .errors import DiskFullError, from_oserror


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.3g} GiB"


def free_bytes(directory: str | os.PathLike) -> int:
    """Bytes an unprivileged writer may still allocate under ``directory``."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def reserve(path: str | os.PathLike, nbytes: int) -> None:
    """Allocates ``nbytes`` of disk for the file ``path`` (created if missing) with
    ``posix_fallocate``, so later writes inside that range cannot fail with ENOSPC.

    Raises :class:`DiskFullError` naming the shortfall ("needs X GiB under DIR, Y GiB
    free") when the filesystem has less free space than the part not yet allocated.
    """
    if not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"nbytes={nbytes!r}: expected an int >= 0")
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    try:
        already = os.stat(path).st_blocks * 512
    except FileNotFoundError:
        already = 0
    try:
        free = free_bytes(directory)
    except OSError as exc:
        raise from_oserror(exc, directory, None, "statvfs") from exc
    missing = max(nbytes - already, 0)
    if missing > free:
        raise DiskFullError(
            errno.ENOSPC,
            f"needs {_gib(missing)} ({missing} B) under {directory}, {_gib(free)} ({free} B) free; "
            "free space there or choose another directory",
            path,
            None,
        )
    if nbytes == 0:
        open(path, "ab").close()
        return
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise from_oserror(exc, path, None, "open") from exc
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        err = from_oserror(exc, path, 0, "posix_fallocate")
        if isinstance(err, DiskFullError):
            err.strerror = (f"posix_fallocate failed: needs {_gib(missing)} under {directory}, "
                            f"{_gib(free_bytes(directory))} free")
        raise err from exc
    finally:
        os.close(fd)
