"""At exit, let torch's gloo worker threads drop their last collective before Python ends.

[Note: a rank aborting at exit after its last gloo collective]
A gloo process group runs each collective on one of its ``pt_gloo_runloop`` threads. The
thread marks the collective complete (the caller's ``wait()`` returns), then drops its own
reference to the work, and with it the work's tensors. Dropping a tensor that Python also
knew needs the GIL (torch decrefs its Python object). If the OS has not run that thread
again by the time the main thread finalizes the interpreter, the thread gets the GIL only
to be ended by ``pthread_exit``, whose unwinding stops in a C++ destructor:
"terminate called without an active exception", SIGABRT, after the script has printed
everything and called ``destroy_process_group()`` (which leaves gloo's threads running).

Seen on a 2-vCPU Zen 4 VM (2026-12-06): 2 of ~170 launches of examples/torchrun_ddp.py,
two launches at a time, and once in CI; the core dump had the thread in ``~AsyncAllgatherWork`` ->
``decref_pyobject`` -> ``take_gil`` -> ``PyThread_exit_thread`` while the main thread ran
the final ``PyGC_Collect`` of ``Py_FinalizeEx``. Upstream torch knows the shape of it
(``destroy_process_group`` at exit was proposed and set aside).

So a process that built a tierstate optimizer as one rank of several registers
:func:`drain` with ``atexit``: before finalization, it sleeps (holding neither the GIL nor
a core) while any of the process's gloo worker threads is running or runnable, until
none has been for QUIET_CHECKS checks in a row, POLL_S apart, or DRAIN_CAP_S has passed.
A thread that was waiting for the GIL gets it during the first sleep and finishes its
work item with Python still alive. Cost at exit: QUIET_CHECKS * POLL_S when the threads
are idle, as they are after any completed collective (measured 3.5-3.7 ms, 9.6 at most, over
124 rank exits of that example, two launches at a time). ``TIERSTATE_EXIT_DRAIN_S``
sets the cap in seconds (0 turns the wait off). Linux only (it reads ``/proc/self/task``);
elsewhere it does nothing.
"""
from __future__ import annotations

import atexit
import os
import threading
import time

from .ranks import group_world_size

#: the names torch gives the gloo threads that run collectives and drop their work
GLOO_WORKER_NAMES = ("pt_gloo_runloop",)
POLL_S = 0.001
QUIET_CHECKS = 3  # a thread woken by the GIL's release runs within microseconds; 3 ms is ample
DRAIN_CAP_S = 1.0  # a collective still in flight at exit (never waited for) is not waited out
CAP_ENV = "TIERSTATE_EXIT_DRAIN_S"

_TASKS = "/proc/self/task"
_registered = False
_lock = threading.Lock()


def _busy_workers(names: tuple[str, ...]) -> list[int]:
    """Thread ids of this process's threads named in ``names`` that are running or runnable."""
    busy = []
    try:
        tids = os.listdir(_TASKS)
    except OSError:
        return busy
    for tid in tids:
        try:
            with open(f"{_TASKS}/{tid}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # the thread ended between the listing and the read
            continue
        # "<tid> (<comm>) <state> ...": comm may itself hold spaces and parentheses
        open_paren, close_paren = stat.find(b"("), stat.rfind(b")")
        comm = stat[open_paren + 1:close_paren].decode(errors="replace")
        state = stat[close_paren + 2:close_paren + 3]
        if comm in names and state == b"R":
            busy.append(int(tid))
    return busy


def cap_from_env() -> float:
    """The cap on the wait at exit: ``TIERSTATE_EXIT_DRAIN_S`` seconds, DRAIN_CAP_S if unset."""
    raw = os.environ.get(CAP_ENV, "").strip()
    if not raw:
        return DRAIN_CAP_S
    try:
        cap = float(raw)
    except ValueError:
        cap = -1.0
    if not cap >= 0.0 or cap == float("inf"):
        raise ValueError(f"{CAP_ENV}={raw!r}: must be a number of seconds >= 0 (0 turns the wait at exit off; "
                         f"default {DRAIN_CAP_S})")
    return cap


def drain(names: tuple[str, ...] = GLOO_WORKER_NAMES, cap_s: float | None = None) -> float:
    """Sleep until no thread named in ``names`` has run for QUIET_CHECKS checks in a row, or
    ``cap_s`` (default: :func:`cap_from_env`) has passed; returns the seconds waited. See
    [Note: a rank aborting at exit after its last gloo collective]."""
    if cap_s is None:
        try:
            cap_s = cap_from_env()
        except ValueError:  # refused when the optimizer was built; changed since
            cap_s = DRAIN_CAP_S
    if cap_s <= 0.0 or not os.path.isdir(_TASKS):
        return 0.0
    start = time.monotonic()
    quiet = 0
    while quiet < QUIET_CHECKS and time.monotonic() - start < cap_s:
        time.sleep(POLL_S)  # releases the GIL: a worker waiting for it takes it now
        quiet = 0 if _busy_workers(names) else quiet + 1
    return time.monotonic() - start


def install() -> bool:
    """Register :func:`drain` to run at exit, once per process, when this process is one rank
    of several; True if registered (now or before)."""
    global _registered
    if group_world_size() < 2:
        return _registered
    cap_from_env()  # a bad value is refused now, not at exit where nobody reads it
    with _lock:
        if not _registered:
            # Registered after init_process_group, so it runs before the handlers torch
            # registered then (atexit runs the last registered first).
            atexit.register(drain)
            _registered = True
    return True


__all__ = ["CAP_ENV", "DRAIN_CAP_S", "GLOO_WORKER_NAMES", "POLL_S", "QUIET_CHECKS", "cap_from_env", "drain", "install"]
