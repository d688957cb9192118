"""The backward worker threads at interpreter exit (see :mod:`.backward`).

[Note: the worker at interpreter exit]
A script that ends (or raises) right after ``backward()`` leaves the worker inside a
native kernel, which releases the GIL. When the kernel returns into a finalizing
interpreter the thread is ended inside a C++ destructor, and the process aborts
("terminate called without an active exception", exit status 134 instead of 0 or the
traceback's 1): 10 of 10 runs of tests/optim/_backward_exit_script.py. So an ``atexit``
hook, registered when this module is imported, stops every live worker while Python is
whole: the updates still queued are dropped (the state of a process that is ending is
not kept), the one running finishes, the thread is joined (at most EXIT_JOIN_S).
"""
from __future__ import annotations

import atexit
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .backward import BackwardDriver

# How long the exit hook waits for a worker to finish the update it is running (see [Note:
# the worker at interpreter exit]): one sub-group, milliseconds to a second or two.
EXIT_JOIN_S = 30.0
_live_workers: "weakref.WeakSet[BackwardDriver]" = weakref.WeakSet()


@atexit.register  # with no worker started, a loop over nothing
def _stop_workers_at_exit() -> None:
    for driver in list(_live_workers):
        driver.stop_worker(drop_queued=True, timeout=EXIT_JOIN_S)


def watch_at_exit(driver: "BackwardDriver") -> None:
    """Stop ``driver``'s worker at interpreter exit, if it is still alive then."""
    _live_workers.add(driver)


__all__ = ["EXIT_JOIN_S", "watch_at_exit"]
