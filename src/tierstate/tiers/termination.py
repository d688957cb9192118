"""Cleanup when the process is told to stop: SIGTERM (and SIGHUP) under the default disposition.

[Note: cleanup on SIGTERM]
Slurm, Kubernetes and ``docker stop`` end a job with SIGTERM (then SIGKILL after a grace
period: 30 s in Kubernetes, ``KillWait`` in Slurm); a closed terminal sends SIGHUP. Under
the default disposition the kernel ends the process on the spot, so no ``finally``, no
``atexit`` and no finalizer runs, and the NVMe tier's files (the whole state, 64 MiB
for a 5 M-parameter AdamW, gigabytes for a real model) and a checkpoint's ``.partial``
shard would stay on disk. So while something is registered here (:func:`on_termination`)
this module keeps a handler on both signals, which does what the disposition it replaced
says:

* ``SIG_DFL`` (the usual case): run every registered cleanup of *this* process, put
  ``SIG_DFL`` back and send the signal again, so the process still ends "killed by
  SIGTERM" (exit status -15 / 143) and whoever waits on it sees what it would have seen.
* ``SIG_IGN``: no handler is installed at all; the signal stays ignored.
* A Python handler of the application: it is called, and nothing else is done. Such a
  handler either raises (``sys.exit``: the stack unwinds, a save in progress removes its
  ``.partial``, and the finalizers remove the tier's files at exit) or returns because
  the application means to finish the step, save a checkpoint and exit in its own time,
  which needs the files that a cleanup run before it would have deleted (a save in flight
  would fail to rename its ``.partial``). A handler that ends the process with
  ``os._exit`` skips every cleanup, like SIGKILL; the next run's sweep removes what is left
  (:mod:`tierstate.tiers.rundir`).
* A handler installed by C code (``signal.getsignal`` returns None) cannot be chained from
  Python, so it is left in place.

Python runs signal handlers on the main thread only and only the main thread may install
them: a cleanup registered from another thread is still run by a handler already in
place, and when there is none yet it cannot be installed; a warning says so once, and the
files a SIGTERM then leaves are the next run's sweep's to remove. Cleanups are keyed by
the pid that registered them, so a forked child that inherits the handler never runs its
parent's. The handler takes no lock (the main thread may have been stopped holding any),
only reads the registry, a dict whose single-key operations are atomic under the GIL.
When the last cleanup is cancelled the previous disposition is put back, if ours is still
the one installed and we are on the main thread.
"""
from __future__ import annotations

import itertools
import logging
import os
import signal
import threading
from typing import Callable

_log = logging.getLogger("tierstate")

# The signals whose default action ends the process and that job managers and terminals send.
SIGNALS = (signal.SIGTERM, signal.SIGHUP)

_cleanups: dict[int, tuple[int, Callable[[], None]]] = {}  # token -> (pid that registered, cleanup)
_previous: dict[int, object] = {}  # signal -> the disposition our handler replaced
_tokens = itertools.count(1)
_warned_thread = False


def _handler(signum: int, frame) -> None:
    previous = _previous.get(signum, signal.SIG_DFL)
    if callable(previous):  # the application's handler decides what happens now
        previous(signum, frame)
        return
    pid = os.getpid()
    for owner, cleanup in list(_cleanups.values()):
        if owner != pid:
            continue
        try:
            cleanup()
        except Exception:  # noqa: BLE001 - the process is ending: clean up what the others can
            pass
    signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
    os.kill(pid, signum)
    os._exit(128 + signum)  # not reached: the default action of the signal ends the process


def _install(what: str) -> None:
    """Put our handler on each signal whose disposition allows it (see the note)."""
    global _warned_thread
    if threading.current_thread() is not threading.main_thread():
        missing = [s for s in SIGNALS if signal.getsignal(s) not in (_handler, signal.SIG_IGN)]
        if missing and not _warned_thread:
            _warned_thread = True
            _log.warning("tierstate: %s was made outside the main thread, where Python cannot install a signal "
                         "handler, so a SIGTERM now leaves it on disk until the next run (or save) there sweeps it; "
                         "build the optimizer on the main thread to clean up at once", what)
        return
    for signum in SIGNALS:
        current = signal.getsignal(signum)
        if current is _handler or current is signal.SIG_IGN or current is None:
            continue
        _previous[signum] = current
        signal.signal(signum, _handler)


def _uninstall() -> None:
    if threading.current_thread() is not threading.main_thread():
        return  # our handler stays; with nothing registered it only passes the signal on
    for signum in SIGNALS:
        if signal.getsignal(signum) is _handler:
            signal.signal(signum, _previous.pop(signum, signal.SIG_DFL))


class Registration:
    """A cleanup registered with :func:`on_termination`; :meth:`cancel` takes it back."""

    __slots__ = ("_token",)

    def __init__(self, token: int) -> None:
        self._token = token

    def cancel(self) -> None:
        """Unregister (idempotent); the last one out restores the previous signal dispositions."""
        if _cleanups.pop(self._token, None) is not None and not _cleanups:
            _uninstall()


def on_termination(cleanup: Callable[[], None], what: str = "the NVMe tier's files") -> Registration:
    """Run ``cleanup()`` if this process is ended by SIGTERM or SIGHUP under the default disposition.

    ``cleanup`` runs inside a signal handler on the main thread while the rest of the
    program is stopped at an arbitrary point: it must only remove files (no locks, no
    logging, no I/O that waits on other threads). It never runs in a forked child.
    ``what`` names what it removes, for the one warning given when no handler can be
    installed (registration off the main thread). See [Note: cleanup on SIGTERM].
    """
    token = next(_tokens)
    _cleanups[token] = (os.getpid(), cleanup)
    _install(what)
    return Registration(token)


def remove_on_termination(*paths: str | os.PathLike, what: str = "a checkpoint's .partial shard") -> Registration:
    """:func:`on_termination` for files: unlink each of ``paths`` (missing ones are fine)."""
    names = [os.fspath(p) for p in paths]

    def remove() -> None:
        for name in names:
            try:
                os.unlink(name)
            except OSError:
                pass

    return on_termination(remove, what)


__all__ = ["on_termination", "remove_on_termination", "Registration", "SIGNALS"]
