"""The engine that runs reads and writes: worker threads, each either blocking in
pread/pwrite ("threads") or driving its own io_uring ("uring").

A process-wide default engine is created on first use; :func:`set_default_engine`
replaces it (for example with more threads on a machine with several drives).
"""
from __future__ import annotations

import atexit
import logging
import os
import threading
import weakref
from typing import Any

from tierstate._native_loader import native, native_status

from .errors import from_oserror

_log = logging.getLogger("tierstate")
_said: set[str] = set()


def say_once(key: str, message: str, *args: object) -> None:
    """Logs a fallback (no io_uring, no O_DIRECT) once per process at WARNING level."""
    if key not in _said:
        _said.add(key)
        _log.warning(message, *args)


BACKENDS = ("auto", "uring", "threads")

# 4 MiB tasks x 32 in flight. Measured on the reference VM (virtio disk, max_sectors_kb
# 4096), 1 GiB sequential: 4.13 GB/s write / 2.03 read with 4 MiB against 3.82 / 1.91 with
# 1 MiB, and a thread computing beside the I/O lost 35 % less of its speed per GB moved
# (each request costs the guest CPU time). Disks that take smaller requests split them.
DEFAULT_BLOCK_SIZE = 4 << 20
DEFAULT_QUEUE_DEPTH = 32


def engine_available() -> bool:
    """Whether the native module loaded, so tierstate.io can run here (its engine and
    :func:`~tierstate.io.aligned_empty`); callers fall back to buffered I/O and torch's
    allocator when it did not."""
    mod = native()
    return mod is not None and hasattr(mod, "IOEngine")


def _require_native() -> Any:
    mod = native()
    if mod is None:
        _, why = native_status()
        raise ImportError(
            f"tierstate.io needs the native module, which did not load ({why}); rebuild it "
            "with `pip install --no-build-isolation -e .` or scripts/build_native.sh"
        )
    return mod


class Engine:
    """Worker threads that execute file reads and writes.

    Args:
        threads: worker threads. With the ``uring`` backend each owns one ring with
            ``queue_depth`` requests in flight; with ``threads`` each does one blocking
            syscall at a time. ``None``: one ring, or ``min(queue_depth, 8)`` blocking
            workers when the thread pool runs.
        queue_depth: tasks in flight per ring (``uring``); for the thread pool it only
            caps the automatic number of workers.
        block_size: bytes per task; larger requests are split. A multiple of 4096.
        backend: ``"auto"`` (io_uring when the runtime probe allows it, else threads),
            ``"uring"`` (raise if unavailable) or ``"threads"``.

    :attr:`backend` says which backend runs; :attr:`backend_note` says why io_uring was
    not used when ``"auto"`` fell back.
    """

    def __init__(
        self,
        *,
        threads: int | None = None,
        queue_depth: int = DEFAULT_QUEUE_DEPTH,
        block_size: int = DEFAULT_BLOCK_SIZE,
        backend: str = "auto",
    ) -> None:
        if threads is not None and (not isinstance(threads, int) or threads < 1):
            raise ValueError(f"threads={threads!r}: expected an int >= 1, or None for automatic")
        if not isinstance(queue_depth, int) or not 1 <= queue_depth <= 4096:
            raise ValueError(f"queue_depth={queue_depth!r}: expected an int in [1, 4096]")
        if not isinstance(block_size, int) or block_size < 4096 or block_size % 4096:
            raise ValueError(f"block_size={block_size!r}: expected a positive multiple of 4096 bytes")
        if block_size > 256 << 20:
            raise ValueError(f"block_size={block_size!r}: expected at most 256 MiB")
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r}: expected one of {BACKENDS}")
        mod = _require_native()
        self._pid = os.getpid()
        try:
            self._native = mod.IOEngine(threads or 0, queue_depth, block_size, backend)
        except OSError as exc:
            raise from_oserror(exc, None, None, f"starting the {backend} I/O backend") from exc
        if self._native.backend_note:
            say_once("uring", "tierstate.io: %s", self._native.backend_note)
        _live.add(self)

    @property
    def backend(self) -> str:
        """``"uring"`` or ``"threads"``: the backend actually running."""
        return self._native.backend

    @property
    def backend_note(self) -> str:
        """Why io_uring is not in use (empty when it is, or when threads were asked for)."""
        return self._native.backend_note

    @property
    def threads(self) -> int:
        return self._native.threads

    @property
    def queue_depth(self) -> int:
        return self._native.queue_depth

    @property
    def block_size(self) -> int:
        return self._native.block_size

    def check_owner(self) -> None:
        """Raise unless this process created the engine (see [Note: engines and fork])."""
        if os.getpid() != self._pid:
            raise RuntimeError(f"this I/O engine was created by pid {self._pid}, and process {os.getpid()} is a "
                               "fork of it: its worker threads exist only in that process. Open files anew in "
                               "the child (they use the child's own default engine) or create an Engine there")

    def close(self) -> None:
        """Finishes the queued work and stops the workers. Idempotent; does nothing in a
        forked child (the workers are the parent's)."""
        if os.getpid() == self._pid:
            self._native.shutdown()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        note = f", note={self.backend_note!r}" if self.backend_note else ""
        return (f"Engine(backend={self.backend!r}, threads={self.threads}, "
                f"queue_depth={self.queue_depth}, block_size={self.block_size}{note})")


def uring_available(queue_depth: int = DEFAULT_QUEUE_DEPTH) -> tuple[bool, str]:
    """(whether io_uring can be used in this process, why not)."""
    ok, note = _require_native().io_probe_uring(queue_depth)
    return bool(ok), note


_default: Engine | None = None
_default_lock = threading.Lock()

# [Note: engines and fork]
# fork() copies an engine's queue and rings but none of its worker threads. In the child,
# destroying that copy blocks for ever (its queue's condition variable still counts the
# parent's idle workers as waiters) and work queued on it never runs. So a child gives
# every inherited engine's native object one reference that is never dropped (a few KiB
# left to the exit; module teardown would otherwise release a plain list of them),
# refuses I/O on it (Engine.check_owner, called by every submit), and creates its own
# default engine on first use.
_live: "weakref.WeakSet[Engine]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    global _default, _default_lock
    import ctypes

    for engine in list(_live):
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(engine._native))
    _default, _default_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def default_engine() -> Engine:
    """The process-wide engine (created on first use with the defaults, backend "auto")."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Engine()
        return _default


def set_default_engine(engine: Engine | None = None, **config: Any) -> Engine:
    """Replaces the process-wide engine with ``engine`` or with ``Engine(**config)``.

    The previous default is closed after its queued work finishes."""
    global _default
    if engine is not None and config:
        raise ValueError("pass either an Engine or configuration keywords, not both")
    new = engine if engine is not None else Engine(**config)
    with _default_lock:
        old, _default = _default, new
    if old is not None and old is not new:
        old.close()
    return new


@atexit.register
def _close_default() -> None:
    # Join the workers before interpreter teardown rather than during static destruction.
    global _default
    with _default_lock:
        old, _default = _default, None
    if old is not None:
        old.close()
