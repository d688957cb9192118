"""Injected I/O failures, for testing what callers do when a read or write fails.

    from tierstate.io.faults import fail_nth
    with fail_nth("write", 3, errno.EIO, path_contains="state-"):
        ...   # the 3rd write submitted to a matching file completes with EIO, nothing written

The failure is injected where a request is submitted (:meth:`tierstate.io.File.pread` /
``pwrite``): the request does not reach the disk and its future reports the errno, as a
request the kernel failed would. Disk-full and truncation are tested for real (a small
mounted filesystem, ``os.truncate``); errors a test cannot provoke on demand (EIO) come
from here.
"""
from __future__ import annotations

import contextlib
import errno as _errno
import threading
from typing import Iterator

_lock = threading.Lock()
_plans: list["_Plan"] = []


class _Plan:
    def __init__(self, op: str, nth: int, err: int, path_contains: str | None, times: int) -> None:
        self.op, self.nth, self.err, self.path_contains, self.times = op, nth, err, path_contains, times
        self.seen = 0
        self.fired = 0


def _check(op: str, path: str) -> int:
    """The errno to fail this submission with, or 0 (called by File for every request)."""
    if not _plans:
        return 0
    with _lock:
        for plan in _plans:
            if plan.op != op or (plan.path_contains is not None and plan.path_contains not in path):
                continue
            plan.seen += 1
            if plan.seen >= plan.nth and plan.fired < plan.times:
                plan.fired += 1
                return plan.err
    return 0


@contextlib.contextmanager
def fail_nth(op: str, nth: int, err: int = _errno.EIO, *, path_contains: str | None = None,
             times: int = 1) -> Iterator[_Plan]:
    """Within the block, fail the ``nth`` (1-based) ``op`` ("read" or "write") submitted to a
    file whose path contains ``path_contains`` (any file when None), and the ``times - 1``
    matching ones after it, with ``err``. Yields the plan: ``.seen`` and ``.fired`` count
    the matching requests and the failures injected."""
    if op not in ("read", "write"):
        raise ValueError(f"op={op!r}: expected 'read' or 'write'")
    if not isinstance(nth, int) or nth < 1:
        raise ValueError(f"nth={nth!r}: expected an int >= 1 (1 = the first matching request)")
    if not isinstance(times, int) or times < 1:
        raise ValueError(f"times={times!r}: expected an int >= 1")
    plan = _Plan(op, nth, int(err), path_contains, times)
    with _lock:
        _plans.append(plan)
    try:
        yield plan
    finally:
        with _lock:
            _plans.remove(plan)


__all__ = ["fail_nth"]
