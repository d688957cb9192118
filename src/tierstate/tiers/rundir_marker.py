"""Who owns an NVMe run folder: the marker a run writes there and the verdict on a marker
found (see [Note: run folder lifecycle] in :mod:`tierstate.tiers.rundir`)."""
from __future__ import annotations

import json
import os
import socket
import stat
import time
from pathlib import Path

LOCK_NAME = "tierstate.lock"
MARKER_NAME = "tierstate-run.json"
MAGIC = "tierstate NVMe run folder, v1"


def _read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def process_start_time(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks after boot (``/proc/<pid>/stat`` field 22), or None
    when no such process is visible (or there is no /proc)."""
    text = _read_text(f"/proc/{int(pid)}/stat")
    if not text:
        return None
    try:  # the command name (field 2) may hold spaces and parentheses: split after the last ')'
        return int(text[text.rindex(")") + 2:].split()[19])
    except (ValueError, IndexError):
        return None


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _identity() -> dict:
    pid = os.getpid()
    return {"pid": pid, "start_time": process_start_time(pid), "host": socket.gethostname(),
            "boot_id": _read_text("/proc/sys/kernel/random/boot_id"), "pid_ns": _pid_namespace()}


def new_marker(folder: Path, *, made_dirs: list[str] | None = None, files: tuple[str, ...] = (LOCK_NAME,)) -> dict:
    """The marker this process writes into ``folder`` ([Note: run folder lifecycle]): who we are, and the
    files and folders we created (``made_dirs``: the folder and those of its parents that
    the run created, deepest first)."""
    return {"magic": MAGIC, **_identity(), "created": time.time(), "folder": str(folder),
            "made_depth": len(made_dirs or []), "files": list(files)}


def _plain_name(name) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\0" not in name


def read_marker(folder: Path) -> tuple[dict | None, str | None]:
    """``(marker, None)``, ``(None, None)`` when there is none, or ``(None, why)`` when the
    file there proves nothing."""
    path = folder / MARKER_NAME
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        return None, f"its marker {path} cannot be read ({exc.strerror})"
    if not stat.S_ISREG(st.st_mode) or st.st_size > 1 << 20:
        return None, f"{path} is not a marker tierstate wrote (not a small regular file)"
    try:
        marker = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return None, f"its marker {path} cannot be read ({exc})"
    if not isinstance(marker, dict) or marker.get("magic") != MAGIC:
        return None, f"{path} is not a marker tierstate wrote (no magic string)"
    pid, files, depth = marker.get("pid"), marker.get("files"), marker.get("made_depth", 0)
    if not isinstance(pid, int) or pid <= 0 or not isinstance(marker.get("host"), str):
        return None, f"its marker {path} names no owner"
    if not isinstance(files, list) or not all(_plain_name(n) for n in files) or MARKER_NAME in files:
        return None, f"its marker {path} lists files outside its folder"
    if not isinstance(depth, int) or depth < 0:
        return None, f"its marker {path} is damaged (made_depth {depth!r})"
    return marker, None


# Verdicts on a marker whose folder lock is free.
STALE, ALIVE, FOREIGN, UNKNOWN = "stale", "alive", "foreign", "unknown"


def judge(marker: dict) -> tuple[str, str]:
    """Whether the run that wrote ``marker`` is provably over: ``(verdict, why)``."""
    me = _identity()
    pid = marker["pid"]
    if marker["host"] != me["host"]:
        return FOREIGN, (f"it was written by pid {pid} on host {marker['host']!r} (this is {me['host']!r}); tierstate "
                         "never removes another machine's files")
    theirs, ours = marker.get("boot_id"), me["boot_id"]
    if theirs and ours and theirs != ours:
        return STALE, f"pid {pid} ran before this machine last booted"
    if marker.get("pid_ns") and me["pid_ns"] and marker["pid_ns"] != me["pid_ns"]:
        return UNKNOWN, (f"it was written by pid {pid} of another pid namespace ({marker['pid_ns']}: another "
                         "container?), whose processes this one cannot see")
    start = process_start_time(pid)
    if start is None:
        # not in /proc: gone, or hidden from us (no /proc, or /proc mounted hidepid=2 and the
        # process another user's); the signal test tells those apart, a reused pid reading alive
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return STALE, f"pid {pid} is not running"
        except PermissionError:
            pass
        return ALIVE, f"pid {pid} is alive"
    if marker.get("start_time") is not None and start != marker["start_time"]:
        return STALE, f"pid {pid} is not running (a process started later has that pid now)"
    return ALIVE, f"pid {pid} is alive"


__all__ = ["ALIVE", "FOREIGN", "LOCK_NAME", "MAGIC", "MARKER_NAME", "STALE", "UNKNOWN", "judge", "new_marker",
           "process_start_time", "read_marker"]
