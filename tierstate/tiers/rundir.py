"""The NVMe tier's folders on disk: claim, lock, reserve, clean up, and find crashed runs.

[Note: run folder lifecycle]
Every folder the NVMe tier writes into is a *run folder* holding ``tierstate.lock``
(``fcntl.flock``-ed by the owning process for as long as it runs), ``tierstate.pid``
(the owner's pid) and the state files. Two rules follow:

* A folder whose lock is held belongs to a live run: claiming it raises
  :class:`NvmeDirInUseError` naming the owner's pid. (flock locks belong to an open file
  description, so a second tier in the same process is refused as well.)
* A folder whose lock can be taken and whose pid is not alive was left by a crashed run:
  it is reported with ``logging.warning`` (with its size) and removed, while we hold its
  lock, so no other process can be claiming it at the same moment. A free lock whose pid
  is alive (pid reuse, or a process that closed the file by hand) is reported and left.

When no ``nvme_dir`` is given, each run makes its own folder ``run-<pid>-<hex>`` under
:func:`tierstate.placement.default_nvme_root`, so concurrent runs never meet; stale
siblings there are swept at start. A folder the user named is used as the run folder
itself. Files are removed by :meth:`RunFolder.close`, which a ``weakref.finalize`` also
calls when the owner is collected and at interpreter exit (finalizers run from
``atexit``); only a crash (SIGKILL, power loss) leaves them, for the next run to sweep.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import secrets
import shutil
import time
from pathlib import Path

from ..io import DiskFullError, free_bytes, reserve

_log = logging.getLogger("tierstate")

LOCK_NAME = "tierstate.lock"
PID_NAME = "tierstate.pid"
STATE_PREFIX = "state-"
RUN_PREFIX = "run-"
# A folder with a free lock but no pid file yet may be one another process is creating
# right now (mkdir, then lock, then pid file: microseconds apart); older than this it is
# debris.
_UNBORN_GRACE_S = 60.0


class NvmeDirInUseError(RuntimeError):
    """The run folder is locked by another run (or another tier of this process)."""


def _gib(nbytes: int) -> str:
    """Human size: '41.2 GiB', or MiB below 1 GiB so that small figures do not read '0.0 GiB'."""
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:.1f} GiB"
    return f"{nbytes / 2**20:.1f} MiB"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _read_pid(folder: Path) -> int | None:
    try:
        return int((folder / PID_NAME).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def folder_bytes(folder: Path) -> int:
    """Disk bytes allocated under ``folder`` (st_blocks, so sparse files count what they use)."""
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total


def _try_lock(folder: Path) -> int | None:
    """An fd holding ``folder``'s lock exclusively, or None when another holder has it."""
    fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return None
        raise
    return fd


def _remove_our_files(folder: Path) -> None:
    """Remove the files a run puts in a folder (and nothing else the user keeps there)."""
    for entry in folder.iterdir() if folder.is_dir() else ():
        if entry.name.startswith(STATE_PREFIX) or entry.name in (PID_NAME, LOCK_NAME):
            try:
                entry.unlink()
            except FileNotFoundError:
                pass


def _sweep_stale(folder: Path, *, whole_folder: bool) -> None:
    """Report and (when safe) remove what a crashed run left in ``folder``; see the note."""
    if not (folder / LOCK_NAME).exists() and not (folder / PID_NAME).exists():
        if not whole_folder or not folder.name.startswith(RUN_PREFIX):
            return
    try:
        fd = _try_lock(folder)
    except OSError:
        return  # unreadable folder of someone else: not ours to judge
    if fd is None:
        return  # a live run holds it
    try:
        pid = _read_pid(folder)
        if pid is None and time.time() - folder.stat().st_mtime < _UNBORN_GRACE_S:
            return
        size = folder_bytes(folder)
        if pid is not None and pid != os.getpid() and _pid_alive(pid):
            _log.warning("tierstate: %s holds %s of NVMe-tier files of pid %d, which is alive but does not hold "
                         "the folder's lock; left in place (remove it by hand if that run is gone)",
                         folder, _gib(size), pid)
            return
        _log.warning("tierstate: removing %s of NVMe-tier files left in %s by a run that ended without "
                     "cleaning up (pid %s, not running; its lock was free)", _gib(size), folder,
                     pid if pid is not None else "unknown")
        if whole_folder:
            shutil.rmtree(folder, ignore_errors=True)
        else:
            _remove_our_files(folder)
    finally:
        os.close(fd)


def sweep_default_root(root: Path) -> None:
    """Find run folders of crashed runs under the default root; report, remove the safe ones."""
    try:
        entries = [e for e in root.iterdir() if e.is_dir() and e.name.startswith(RUN_PREFIX)]
    except OSError:
        return
    for entry in entries:
        _sweep_stale(entry, whole_folder=True)


class RunFolder:
    """One claimed, locked run folder; see the note at the top of the file.

    Args:
        folder: the folder to claim (created if missing).
        owned: the folder was made for this run (it is removed entirely on close);
            otherwise only the files the run put there are.
    """

    def __init__(self, folder: Path, *, owned: bool) -> None:
        self.path = Path(folder)
        self.owned = owned
        self._lock_fd: int | None = None
        self.files: list[Path] = []
        existed = self.path.is_dir()
        try:
            self.path.mkdir(parents=True, exist_ok=not owned)
        except FileExistsError:  # a per-run name taken: never reuse another run's folder
            raise
        except OSError as exc:
            raise type(exc)(exc.errno, f"cannot create the NVMe-tier folder ({exc.strerror}); pass "
                            "Offload(nvme_dir=...) a writable folder or set TIERSTATE_NVME_DIR", str(self.path)) from exc
        self._made = not existed  # an explicit folder we created is removed on close if left empty
        if not owned:
            _sweep_stale(self.path, whole_folder=False)
        fd = _try_lock(self.path)
        if fd is None:
            pid = _read_pid(self.path)
            who = f"pid {pid}" if pid is not None else "another process"
            if pid == os.getpid():
                who = "another optimizer of this process"
            raise NvmeDirInUseError(
                f"nvme_dir {self.path} is in use by {who} (it holds {self.path / LOCK_NAME}); two runs cannot "
                "share one NVMe folder: give each run its own nvme_dir, or leave nvme_dir unset for a per-run "
                "folder under TIERSTATE_NVME_DIR"
            )
        self._lock_fd = fd
        (self.path / PID_NAME).write_text(f"{os.getpid()}\n")

    def state_file(self, index: int) -> Path:
        path = self.path / f"{STATE_PREFIX}{index}.bin"
        self.files.append(path)
        return path

    def close(self) -> None:
        """Remove the run's files (the folder too when it was made for the run) and unlock. Idempotent."""
        if self._lock_fd is None:
            return
        for path in self.files:
            try:
                path.unlink()
            except FileNotFoundError:
                pass
        if self.owned:
            shutil.rmtree(self.path, ignore_errors=True)
        else:
            for name in (PID_NAME, LOCK_NAME):
                try:
                    (self.path / name).unlink()
                except FileNotFoundError:
                    pass
            if self._made:
                try:
                    self.path.rmdir()
                except OSError:  # the user put something there meanwhile: theirs to keep
                    pass
        os.close(self._lock_fd)  # unlock last: until here nobody may judge the folder stale
        self._lock_fd = None


def claim_folders(dirs: tuple[Path, ...], explicit: bool) -> list[RunFolder]:
    """Claim one run folder per entry of ``dirs`` (see the note); on failure release those taken."""
    folders: list[RunFolder] = []
    try:
        for d in dirs:
            if explicit:
                folders.append(RunFolder(d, owned=False))
            else:
                d.mkdir(parents=True, exist_ok=True)
                sweep_default_root(d)
                name = f"{RUN_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
                folders.append(RunFolder(d / name, owned=True))
    except BaseException:
        for f in folders:
            f.close()
        raise
    return folders


def reserve_files(requests: list[tuple[Path, int]]) -> None:
    """fallocate every ``(path, nbytes)``; raise a :class:`DiskFullError` naming the whole shortfall.

    Requests are grouped by filesystem so that the check names what the run needs on
    each disk in total ("needs 41.2 GiB of disk under /x, 12.0 GiB free") before any
    space is taken, rather than failing on the third of four files.
    """
    by_dev: dict[int, list[tuple[Path, int]]] = {}
    for path, nbytes in requests:
        by_dev.setdefault(os.stat(path.parent).st_dev, []).append((path, nbytes))
    for group in by_dev.values():
        need = sum(n for _, n in group)
        where = group[0][0].parent
        free = free_bytes(where)
        if need > free:
            raise DiskFullError(
                errno.ENOSPC,
                f"the NVMe tier needs {_gib(need)} of disk under {where}, {_gib(free)} free "
                f"(short by {_gib(need - free)}); free space there, pass Offload(nvme_dir=...) a bigger "
                "disk, or keep part of the state in RAM with Offload(cpu=..., nvme=...)",
                str(where),
                None,
            )
    for path, nbytes in requests:
        reserve(path, nbytes)
