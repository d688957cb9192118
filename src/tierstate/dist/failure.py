"""Fail fast across ranks: one rank's uncaught exception ends every rank, naming it.

[Note: how a rank's failure reaches the others]
When one rank of a job raises and ends, the others are usually inside a collective
(FSDP2's all-gather, tierstate's norm all-reduce) waiting for it. gloo notices the closed
connection and raises a bare "Connection closed by peer"; NCCL waits for its watchdog
(10 minutes by default); a rank whose launcher does not kill the job (``srun`` without
``--kill-on-bad-exit``, ``mp.spawn``) may wait for the process group's timeout (30 minutes
for gloo). None of them says which rank failed or why.

So an optimizer built in a group of more than one rank arms this module once per process:

- the failing rank's ``sys.excepthook`` (chained before the previous one) writes
  ``"<ExceptionType>: <message>"`` under ``tierstate/failed/<rank>`` in the default group's
  store (the rendezvous TCPStore every launcher provides) and bumps ``tierstate/failures``;
  it then waits up to ACK_WAIT_S for the others to acknowledge, so that its process, whose
  exit closes its sockets, does not end before they have read why;
- every rank runs a daemon watchdog thread that reads the counter every POLL_S. When a peer
  failed it logs ``tierstate: rank R failed (ValueError: ...); ending rank r`` at ERROR
  level, acknowledges, and ends this process with exit status EXIT_STATUS: its main thread
  may be blocked in a collective that would never return, and no Python exception can be
  delivered into it there.

The watchdog is stopped and joined at exit (``atexit``). Left running, it would be inside the
store's C++ client when the interpreter finalizes; its return into Python then ends the
thread by forced unwinding through C++ frames that cannot unwind, and the finished process
aborts ("terminate called without an active exception", SIGABRT): 4 of 31 4-rank FSDP2
launches and 1 of 5 2-rank example launches on a 2-core VM before this.

The cost is one small store request per rank every POLL_S (0.5 s): 8 requests a second to
the store of a 4-rank job. ``TIERSTATE_FAIL_FAST=0`` turns it off (then the launcher and
the process group's timeout decide). A rank ended this way leaves its NVMe-tier folder
behind; the next run over that folder removes it (its marker names a dead process).
"""
from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time

from .ranks import group_world_size

POLL_S = 0.5
ACK_WAIT_S = 5.0  # the watchdogs answer within POLL_S; this bounds the wait on a lost store
EXIT_STATUS = 75  # EX_TEMPFAIL: this rank did not fail itself, a peer did
_PREFIX = "tierstate/"
_log = logging.getLogger("tierstate")
_armed_for = None  # the store the hooks of this process report to
_armed_pid = None  # a forked child inherits the hook, not the right to use the parent's store connection
_lock = threading.Lock()
_stop = threading.Event()  # set at exit: the watchdogs return, unless a peer has failed
_ending = threading.Event()  # a watchdog found a failed peer and is ending this process
_watchdogs: list[threading.Thread] = []


class PeerFailedError(RuntimeError):
    """Another rank of the job raised; its rank and error are in the message."""


def _enabled() -> bool:
    raw = os.environ.get("TIERSTATE_FAIL_FAST", "1").strip().lower()
    if raw in ("0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on", ""):
        return True
    raise ValueError(f"TIERSTATE_FAIL_FAST={raw!r}: must be 1 (end every rank when one fails, the default) or 0")


def _default_store():
    if group_world_size() < 2:
        return None
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except (ImportError, RuntimeError, ValueError):  # a group built without a store (init from a file)
        return None


def arm() -> bool:
    """Install the failure hooks once per process when it is one rank of several; True if armed.

    Called by every tierstate optimizer's constructor; calling it yourself early (right after
    ``init_process_group``) also covers failures before the optimizer exists."""
    global _armed_for, _armed_pid
    if not _enabled():
        return False
    import torch.distributed as dist

    store = _default_store()
    if store is None:
        return False
    with _lock:
        if _armed_for is store:
            return True
        first = _armed_for is None
        _armed_for, _armed_pid = store, os.getpid()
        rank, world = dist.get_rank(), dist.get_world_size()
        if first:
            previous = sys.excepthook

            def hook(exc_type, exc, tb):
                try:
                    _write_error_file(exc_type, exc, tb)
                    report_failure(exc if exc is not None else exc_type())
                finally:
                    previous(exc_type, exc, tb)
                    _mark_ending()

            sys.excepthook = hook
            atexit.register(_stop_watchdogs)
        watchdog = threading.Thread(target=_watch, args=(store, rank, world), name="tierstate-fail-fast", daemon=True)
        _watchdogs.append(watchdog)
        watchdog.start()
    return True


def _stop_watchdogs() -> None:
    """At exit, before the interpreter finalizes: the watchdogs leave the store's client and end.

    A process exiting because a peer failed (its collective raised when the peer's sockets
    closed) still ends the way the watchdog ends it, with EXIT_STATUS and the peer named:
    the watchdog checks the store once more when told to stop, and is waited for while it
    ends the process (ACK_WAIT_S for the failing rank's traceback, then a second)."""
    _stop.set()
    for watchdog in _watchdogs:
        if watchdog is not threading.current_thread():
            watchdog.join(timeout=ACK_WAIT_S)  # one store request at most; bounded if the store is lost
            if _ending.is_set():
                watchdog.join(timeout=ACK_WAIT_S + 2.0)
    _watchdogs.clear()


def report_failure(exc: BaseException) -> None:
    """Tell the other ranks that this one failed with ``exc`` (they end, naming it); wait up to
    ACK_WAIT_S for them to have read it. For code that catches an error and cannot go on
    (the uncaught case is reported by the hook :func:`arm` installs)."""
    store = _armed_for
    if store is None or os.getpid() != _armed_pid or isinstance(exc, (PeerFailedError, KeyboardInterrupt)):
        return
    import torch.distributed as dist

    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        text = f"{type(exc).__name__}: {exc}"[:2000]
        store.set(f"{_PREFIX}failed/{rank}", text)
        store.add(f"{_PREFIX}failures", 1)
        deadline = time.monotonic() + ACK_WAIT_S
        while store.add(f"{_PREFIX}acks", 0) < world - 1 and time.monotonic() < deadline:
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - the store went away with the job: the launcher ends the rest
        pass


def _write_error_file(exc_type, exc, tb) -> None:
    """Under torchrun, write this rank's error where ``@record`` would (``TORCHELASTIC_ERROR_FILE``,
    unless the script's own ``@record`` did): torchrun then reports the failing rank, with
    its traceback, as the job's root cause rather than a peer this module ended later."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.getpid() != _armed_pid or os.path.exists(path):
        return
    import json
    import traceback

    data = {"message": {"message": f"{exc_type.__name__}: {exc}", "extraInfo": {
        "py_callstack": "".join(traceback.format_exception(exc_type, exc, tb)), "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:  # torchrun then reports this rank's exit status only
        pass


def _mark_ending() -> None:
    """The failing rank's traceback is out and its process ends now: the peers may end too."""
    store = _armed_for
    if store is None or os.getpid() != _armed_pid:
        return
    import torch.distributed as dist

    try:
        store.set(f"{_PREFIX}ending/{dist.get_rank()}", "1")
    except Exception:  # noqa: BLE001 - the store went away with the job
        pass


def failed_peers(store, world: int) -> list[tuple[int, str]]:
    """(rank, "<ExceptionType>: <message>") of every rank that reported a failure."""
    keys = [f"{_PREFIX}failed/{r}" for r in range(world)]
    return [(r, store.get(k).decode(errors="replace")) for r, k in enumerate(keys) if store.check([k])]


def _watch(store, rank: int, world: int) -> None:
    try:
        while store.add(f"{_PREFIX}failures", 0) == 0:
            if _stop.wait(POLL_S) and store.add(f"{_PREFIX}failures", 0) == 0:
                return  # the process is exiting, and no peer failed
        peers = [(r, why) for r, why in failed_peers(store, world) if r != rank]
    except Exception:  # noqa: BLE001 - the store is gone: the job is ending without us
        return
    if not peers:
        return  # this rank's own failure: its hook is reporting it
    _ending.set()
    store.add(f"{_PREFIX}acks", 1)
    who = "; ".join(f"rank {r} failed ({why})" for r, why in peers)
    _log.error("tierstate: %s; ending rank %d (exit status %d): the other ranks cannot complete their "
               "collectives without it", who, rank, EXIT_STATUS)
    sys.stderr.write(f"{PeerFailedError.__name__}: {who}; ending rank {rank}\n")
    sys.stderr.flush()
    # End after the failing rank, so that a launcher reporting the first failure it observes
    # (torchrun's "Root Cause") names that rank, not this one: its hook marks when it ends,
    # and torchrun notices an exit within its 0.1 s monitor interval.
    deadline = time.monotonic() + ACK_WAIT_S
    try:
        while time.monotonic() < deadline and not all(store.check([f"{_PREFIX}ending/{r}"]) for r, _ in peers):
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - the store went away: the job is ending
        pass
    time.sleep(1.0)  # torchrun orders failures by whole seconds: this one must come a second later
    logging.shutdown()
    os._exit(EXIT_STATUS)


__all__ = ["ACK_WAIT_S", "EXIT_STATUS", "POLL_S", "PeerFailedError", "arm", "failed_peers", "report_failure"]
