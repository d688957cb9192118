"""The NVMe tier's folders on disk: claim, lock, reserve, clean up, and sweep what crashed runs left.

[Note: run folder lifecycle]
Every folder the NVMe tier writes into is a *run folder*. It holds ``tierstate.lock``
(``fcntl.flock``-ed by the owning process for as long as it runs), the state files, and
the *marker* ``tierstate-run.json``: a magic string, the owner's pid and process start
time (``/proc/<pid>/stat``, field 22), its host name, the kernel's boot id
(``/proc/sys/kernel/random/boot_id``), its pid namespace, the creation time, how many
folders of the path the run created, and the name of every file tierstate created there.
The marker is replaced atomically (temporary file, fsync, rename) *before* each new file
is created, so at every instant it lists at least everything of ours on disk. State files
are named ``state-<pid>-<random>-<n>.bin`` and created with ``O_EXCL``: a run never opens,
truncates or deletes a file it did not create, whatever its name.

Who may remove what:

* Only the process that claimed a folder cleans it up (:meth:`RunFolder.close`, the
  ``weakref.finalize`` of the tier at collection and at exit, the SIGTERM handler of
  :mod:`tierstate.tiers.termination`). A forked child inherits the objects and the
  finalizers but not the right: every one of these paths compares ``os.getpid()`` with
  the owner's pid, and the child closes its copies of the lock descriptors at fork, so
  that a parent killed later leaves a lock the next run can take.
* A folder whose lock is held belongs to a live run: claiming it raises
  :class:`NvmeDirInUseError` naming the owner's pid (flock locks belong to an open file
  description, so a second tier of the same process is refused as well).
* The sweep removes what a run that ended without cleaning up (SIGKILL, power loss, an
  ``os._exit``) left, and only what its marker proves tierstate made: it takes the free
  lock, re-reads the marker, and removes the files it lists (regular files only, plain
  names inside the folder; a marker naming anything else proves nothing), then the marker
  and the lock, then the folders the run created if they are empty. It does so only when
  the owner is provably gone: same host and boot id and no process with that pid and
  start time (a reused pid has another start time), or same host and another boot id.
  A marker from another host (shared storage) is never acted on; neither is one from
  another pid namespace of this kernel (another container: its pids are not ours to
  check), one that cannot be read, or a folder without a marker: each is reported with
  ``logging.warning`` naming the path, and left.

When no ``nvme_dir`` is given, each run makes its own folder ``run-<pid>-<hex>`` under
:func:`tierstate.placement.default_nvme_root` and sweeps the ``run-*`` siblings there at
start. A folder the user named is the run folder itself: the claim sweeps it (a stale
marker's files go, and the folders that run created become this run's to remove) and
refuses to start over a marker it cannot judge, since the state files of a live run on
another host may be behind it. A crash in the microseconds between creating a folder
and writing its first marker leaves an empty folder (or a lock file) without proof: it is
reported, not removed.
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import secrets
import stat
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

from ..io import DiskFullError, free_bytes, reserve
from ..io.errors import io_error
from .rundir_marker import (LOCK_NAME, MARKER_NAME, STALE, judge, new_marker, process_start_time,  # noqa: F401
                            read_marker)
from .termination import on_termination


@dataclass(frozen=True)
class Spelling:
    """How the user of one entry point names the NVMe folder and the RAM/NVMe split, so that
    an error says what to change in the call that was made: the optimizer's ``Offload``
    fields, ``offload_weights``' or ``OffloadedLM.from_pretrained``'s own arguments."""

    folder: str = "Offload(nvme_dir=...)"  # "..." is replaced by the folder where one is named
    split: str = "keep part of the state in RAM with Offload(cpu=..., nvme=...)"
    what: str = "the NVMe tier"

    def folder_named(self, path) -> str:
        return self.folder.replace("...", repr(str(path)))


OPTIMIZER = Spelling()

_log = logging.getLogger("tierstate")

STATE_PREFIX = "state-"
RUN_PREFIX = "run-"
# A run-* folder without a marker may be one another process is creating right now
# (mkdir, lock, marker: microseconds apart); only older than this is it reported.
_UNBORN_GRACE_S = 60.0


class NvmeDirInUseError(RuntimeError):
    """The run folder is locked by another run (or another tier of this process), or holds
    the marker of a run tierstate cannot prove is over."""


def _gib(nbytes: int) -> str:
    """Human size: '41.2 GiB', or MiB below 1 GiB so that small figures do not read '0.0 GiB'."""
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:.1f} GiB"
    return f"{nbytes / 2**20:.1f} MiB"


# -- locks and removal ------------------------------------------------------------------------
def _lock(folder: Path, *, create: bool) -> tuple[int | None, bool]:
    """``(fd holding folder's lock, whether we created the lock file)``, ``(None, False)``
    when another holder has it (or, with ``create=False``, there is no lock file).

    The lock file is unlinked by whoever cleans the folder up, while holding it; so after
    taking the lock we check that the path still names the file we locked, and retry if not."""
    path = folder / LOCK_NAME
    for _ in range(100):
        created = False
        try:
            if create:
                try:
                    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
                    created = True
                except FileExistsError:
                    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
            else:
                fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            if create:
                continue  # unlinked between our two opens: try again
            return None, False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return None, False
            raise
        try:
            same = os.path.samestat(os.fstat(fd), os.lstat(path))
        except FileNotFoundError:
            same = False
        if same:
            return fd, created
        os.close(fd)
        if not create:
            return None, False
    raise OSError(errno.EAGAIN, "the lock file kept being replaced while we took it", str(path))


def _listed_bytes(folder: Path, names) -> int:
    total = 0
    for name in names:
        try:
            st = os.lstat(folder / name)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            total += st.st_blocks * 512
    return total


def _unlink_regular(path: Path) -> bool:
    """Unlink ``path`` if it is a regular file (never a link, never a folder). False if it is
    something else; True if it is gone."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    if not stat.S_ISREG(st.st_mode):
        return False
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return True


def _remove_dirs(folder: Path, depth: int) -> None:
    """rmdir ``folder`` and then its parents, ``depth`` folders in all, stopping at the
    first that is not empty (what the user keeps there stays)."""
    for path in [folder, *folder.parents][:depth]:
        try:
            os.rmdir(path)
        except OSError:
            return


def _remove_listed(folder: Path, marker: dict, *, keep_lock: bool) -> list[str]:
    """Remove what ``marker`` lists (the marker and the lock last; see the note). Returns the
    names left because they are not regular files."""
    names = [n for n in marker["files"] if n != LOCK_NAME]
    odd = [n for n in names if not _unlink_regular(folder / n)]
    _unlink_regular(folder / MARKER_NAME)
    if not keep_lock and LOCK_NAME in marker["files"]:
        _unlink_regular(folder / LOCK_NAME)
    return odd


def _sweep_run_folder(folder: Path) -> None:
    """Judge one ``run-*`` folder under the default root; remove it if provably stale."""
    marker, why = read_marker(folder)
    if marker is None:
        try:
            young = time.time() - os.lstat(folder).st_mtime < _UNBORN_GRACE_S
        except OSError:
            return
        if why is not None or not young:
            _log.warning("tierstate: %s looks like an NVMe run folder but %s; left in place (tierstate removes "
                         "only what its marker %s proves it made; remove it by hand if it is debris)",
                         folder, why or "it holds no marker", MARKER_NAME)
        return
    try:
        fd, _ = _lock(folder, create=False)
    except OSError:
        return  # a lock file we cannot open: not ours to judge
    if fd is None:
        return  # a live run holds it (or it is being closed right now)
    try:
        marker, why = read_marker(folder)  # again, under the lock: the one we judge is final
        if marker is None:
            return
        verdict, reason = judge(marker)
        if verdict != STALE:
            _log.warning("tierstate: %s holds %s of NVMe-tier files whose lock is free, but %s; left in place "
                         "(remove it by hand if that run is over)", folder,
                         _gib(_listed_bytes(folder, marker["files"])), reason)
            return
        _log.warning("tierstate: removing %s of NVMe-tier files left in %s by a run that ended without cleaning "
                     "up (%s; its lock was free)", _gib(_listed_bytes(folder, marker["files"])), folder, reason)
        odd = _remove_listed(folder, marker, keep_lock=False)
        if odd:
            _log.warning("tierstate: %s: left %s, listed in its marker but not regular files", folder, odd)
        _remove_dirs(folder, marker["made_depth"])
    finally:
        os.close(fd)


def sweep_default_root(root: Path) -> None:
    """Judge the ``run-*`` folders under the default root; report them, remove the provably stale ones."""
    try:
        entries = sorted(e for e in root.iterdir() if e.name.startswith(RUN_PREFIX))
    except OSError:
        return
    for entry in entries:
        if entry.is_symlink() or not entry.is_dir():
            continue  # tierstate makes run folders, never links or files by that name
        try:
            _sweep_run_folder(entry)
        except OSError as exc:
            _log.warning("tierstate: could not judge %s (%s); left in place", entry, exc)


# -- the run folder ----------------------------------------------------------------------------
def _make_dirs(path: Path) -> int:
    """mkdir ``path`` and its missing parents; how many of them (from ``path`` up) we created."""
    missing = []
    p = path
    while not os.path.lexists(p):
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    made = []
    for d in reversed(missing):
        try:
            os.mkdir(d)
            made.append(d)
        except FileExistsError:
            made = []  # someone else made it meanwhile: it and what is above are theirs
    depth = 0
    for d in [path, *path.parents]:
        if d not in made:
            break
        depth += 1
    return depth


def _kind(path: Path) -> str:
    """What ``path`` is, for an error message ("a file", "a character device", ...)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return "a broken symbolic link" if os.path.islink(path) else "not reachable"
    for test, name in ((stat.S_ISREG, "a file"), (stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a folder"


_live: "weakref.WeakSet[RunFolder]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """A forked child gives up its copies of the lock descriptors (the parent's locks stay held)."""
    for folder in list(_live):
        if folder._lock_fd is not None:
            try:
                os.close(folder._lock_fd)
            except OSError:
                pass
            folder._lock_fd = None


os.register_at_fork(after_in_child=_after_fork_in_child)


class RunFolder:
    """One claimed, locked run folder; see the note at the top of the file.

    Args:
        folder: the folder to claim (created if missing, with its parents), made absolute now.
        owned: the folder was made for this run under the default root; otherwise the user
            named it (``Offload(nvme_dir=...)`` or the ``nvme_dir`` of ``spelling``).
        spelling: how the caller's user names the folder, for the errors (:class:`Spelling`).
    """

    def __init__(self, folder: Path, *, owned: bool, spelling: Spelling = OPTIMIZER) -> None:
        self.path = Path(os.path.abspath(folder))
        self.owned = owned
        self.pid = os.getpid()
        self.run_id = f"{self.pid}-{secrets.token_hex(4)}"
        self.files: list[Path] = []
        self._lock_fd: int | None = None
        self._created_lock = False
        self._closed = False
        self._registration = None
        self._spelling = spelling
        arg = "nvme_dir" if not owned else "the default NVMe root (TIERSTATE_NVME_DIR)"
        if not owned and os.path.lexists(self.path) and not self.path.is_dir():
            raise NotADirectoryError(
                errno.ENOTDIR, f"{spelling.folder_named(self.path)}: {self.path} is {_kind(self.path)}, not a "
                "folder; pass a folder (it is created if missing) or move that away", str(self.path))
        try:
            if owned:
                os.mkdir(self.path)  # a per-run name: never reuse another run's folder
                depth = 1
            else:
                depth = _make_dirs(self.path)
        except FileExistsError:
            raise
        except OSError as exc:
            raise type(exc)(exc.errno, f"cannot create the NVMe-tier folder ({exc.strerror}); pass "
                            f"{spelling.folder} a writable folder or set TIERSTATE_NVME_DIR",
                            str(self.path)) from exc
        try:
            self._claim(depth, arg)
        except BaseException:
            if self._lock_fd is not None:
                if self._created_lock:
                    _unlink_regular(self.path / LOCK_NAME)
                os.close(self._lock_fd)
                self._lock_fd = None
            _remove_dirs(self.path, depth)
            raise
        self._registration = on_termination(self._remove_now)
        _live.add(self)

    def _unusable(self, exc: OSError, arg: str) -> OSError:
        lock = self.path / LOCK_NAME
        err = io_error(exc.errno or errno.EIO, str(lock), None, "open")
        where = "nvme_dir=" + str(self.path) if arg == "nvme_dir" else f"{arg} {self.path}"
        if exc.errno in (errno.EISDIR, errno.ELOOP) and os.path.lexists(lock):
            what = "a symbolic link" if os.path.islink(lock) else _kind(lock)
            err.strerror = (f"{where}: {lock} is {what}, where tierstate keeps its lock file (a plain file it "
                            f"creates); move it away or pass {self._spelling.folder} another folder")
            return err
        err.strerror = (f"{where}: cannot create files in it ({os.strerror(exc.errno or errno.EIO)}); "
                        f"{self._spelling.what} needs a writable folder on a disk: pass {self._spelling.folder} another "
                        "folder or set TIERSTATE_NVME_DIR")
        return err

    def _claim(self, depth: int, arg: str) -> None:
        try:
            fd, created = _lock(self.path, create=True)
        except OSError as exc:
            raise self._unusable(exc, arg) from exc
        if fd is None:
            marker, _ = read_marker(self.path)
            pid = marker["pid"] if marker else None
            who = f"pid {pid}" if pid is not None else "another process"
            if pid == os.getpid():
                who = "another optimizer of this process"
            raise NvmeDirInUseError(
                f"nvme_dir {self.path} is in use by {who} (it holds {self.path / LOCK_NAME}); two runs cannot "
                "share one NVMe folder: give each run its own nvme_dir, or leave nvme_dir unset for a per-run "
                "folder under TIERSTATE_NVME_DIR")
        self._lock_fd, self._created_lock = fd, created
        names = [LOCK_NAME] if created else []
        if not self.owned:
            old, why = read_marker(self.path)
            if why is not None:
                raise NvmeDirInUseError(f"nvme_dir {self.path}: {why}; tierstate will not start over files it "
                                        "cannot judge: remove it by hand if no run uses that folder, or give "
                                        "another nvme_dir")
            if old is not None:
                verdict, reason = judge(old)
                if verdict != STALE:
                    raise NvmeDirInUseError(
                        f"nvme_dir {self.path} holds the NVMe-tier files of another run ({MARKER_NAME} lists "
                        f"{old['files']}), and {reason}; give this run another nvme_dir, or remove those files and "
                        "the marker by hand once that run is over")
                _log.warning("tierstate: removing %s of NVMe-tier files left in %s by a run that ended without "
                             "cleaning up (%s; its lock was free)", _gib(_listed_bytes(self.path, old["files"])),
                             self.path, reason)
                odd = _remove_listed(self.path, old, keep_lock=True)
                if odd:
                    _log.warning("tierstate: %s: left %s, listed in its marker but not regular files", self.path, odd)
                depth = max(depth, old["made_depth"])  # the folders that run made are ours to remove now
                if LOCK_NAME in old["files"]:
                    names = [LOCK_NAME]
            elif os.path.lexists(self.path / "tierstate.pid"):
                _log.warning("tierstate: %s holds files of a run of an earlier tierstate (tierstate.pid, state-*.bin) "
                             "that carry no proof of who made them; left in place (remove them by hand if that run "
                             "is over)", self.path)
        self._tmp_name = f".{MARKER_NAME}.{self.run_id}.tmp"
        self._marker = new_marker(self.path, made_dirs=[str(p) for p in [self.path, *self.path.parents][:depth]],
                                  files=(*names, self._tmp_name))
        try:
            self._write_marker()
        except OSError as exc:
            _unlink_regular(self.path / self._tmp_name)
            raise self._unusable(exc, arg) from exc

    def _write_marker(self) -> None:
        tmp = self.path / self._tmp_name
        body = json.dumps(self._marker, indent=1).encode()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        try:
            os.write(fd, body)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, self.path / MARKER_NAME)

    def state_file(self, index: int) -> Path:
        """Create the run's ``index``-th state file (empty; listed in the marker first) and return its path."""
        name = f"{STATE_PREFIX}{self.run_id}-{index}.bin"
        self._marker["files"].append(name)
        self._write_marker()
        path = self.path / name
        os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644))
        self.files.append(path)
        return path

    def _remove_now(self) -> None:
        """Remove everything the marker lists, the marker, the lock file and the folders we made.
        Only plain unlink/rmdir: it also runs inside the SIGTERM handler."""
        marker = self._marker
        for name in marker["files"]:
            if name != LOCK_NAME:
                _unlink_regular(self.path / name)
        _unlink_regular(self.path / MARKER_NAME)
        if LOCK_NAME in marker["files"]:
            _unlink_regular(self.path / LOCK_NAME)
        _remove_dirs(self.path, marker["made_depth"])

    def close(self) -> None:
        """Remove the run's files (and the folders it made, if left empty) and unlock. Idempotent.

        Does nothing in any process but the one that claimed the folder (a forked child)."""
        if self._closed or os.getpid() != self.pid:
            return
        self._closed = True
        if self._registration is not None:
            self._registration.cancel()
        try:
            self._remove_now()
        finally:
            if self._lock_fd is not None:
                os.close(self._lock_fd)  # unlock last: until here nobody may judge the folder
                self._lock_fd = None
        _live.discard(self)


def claim_folders(dirs: tuple[Path, ...], explicit: bool, spelling: Spelling = OPTIMIZER) -> list[RunFolder]:
    """Claim one run folder per entry of ``dirs`` (see the note); on failure release those taken.
    ``spelling``: how the caller's user names the folder, for the errors."""
    folders: list[RunFolder] = []
    try:
        for d in dirs:
            d = Path(os.path.abspath(d))
            if explicit:
                folders.append(RunFolder(d, owned=False, spelling=spelling))
            else:
                if os.path.lexists(d) and not d.is_dir():
                    raise NotADirectoryError(
                        errno.ENOTDIR, f"the default NVMe root {d} (TIERSTATE_NVME_DIR) is {_kind(d)}, not a "
                        f"folder; set TIERSTATE_NVME_DIR to a folder or pass {spelling.folder}", str(d))
                try:
                    d.mkdir(parents=True, exist_ok=True)
                except OSError as exc:
                    raise type(exc)(exc.errno, f"cannot create the default NVMe root ({exc.strerror}); set "
                                    f"TIERSTATE_NVME_DIR to a writable folder or pass {spelling.folder}",
                                    str(d)) from exc
                sweep_default_root(d)
                folders.append(RunFolder(d / f"{RUN_PREFIX}{os.getpid()}-{secrets.token_hex(4)}", owned=True,
                                         spelling=spelling))
    except BaseException:
        for f in folders:
            f.close()
        raise
    return folders


def reserve_files(requests: list[tuple[Path, int]], spelling: Spelling = OPTIMIZER) -> None:
    """fallocate every ``(path, nbytes)``; raise a :class:`DiskFullError` naming the whole shortfall.

    Requests are grouped by filesystem so that the check names what the run needs on
    each disk in total ("needs 41.2 GiB of disk under /x, 12.0 GiB free") before any
    space is taken, rather than failing on the third of four files. ``spelling``: how the
    caller's user names the folder and the split, for the error.
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
                f"{spelling.what} needs {_gib(need)} of disk under {where}, {_gib(free)} free "
                f"(short by {_gib(need - free)}); free space there, pass {spelling.folder} a folder on a "
                f"bigger disk, or {spelling.split}",
                str(where),
                None,
            )
    for path, nbytes in requests:
        reserve(path, nbytes)
