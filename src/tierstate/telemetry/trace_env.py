"""Traces a run leaves without asking: ``TIERSTATE_TRACE``, and the traces written at exit.

``TIERSTATE_TRACE=path`` makes every :class:`~tierstate.telemetry.recorder.Telemetry` trace
from its creation; a trace still open when the interpreter exits is written then.
"""
from __future__ import annotations

import atexit
import logging
import os
import threading

_log = logging.getLogger("tierstate")

TRACE_ENV = "TIERSTATE_TRACE"
# Telemetry objects with a trace to write at exit. Strong references on purpose: an
# optimizer dropped before exit still leaves its trace file.
live: set = set()
_env_trace_uses = 0                 # how many Telemetry objects took TIERSTATE_TRACE
_env_lock = threading.Lock()


def expand_env_trace_path(template: str) -> str:
    """``TIERSTATE_TRACE`` with ``{pid}``/``{rank}`` filled in and, for the n-th
    Telemetry in this process (n >= 1), ``.n`` inserted before the extension."""
    global _env_trace_uses
    rank = os.environ.get("RANK", "0")
    try:
        path = template.format(pid=os.getpid(), rank=rank)
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(f"{TRACE_ENV}={template!r}: only {{pid}} and {{rank}} may appear "
                         f"in braces ({e})") from None
    with _env_lock:
        n = _env_trace_uses
        _env_trace_uses += 1
    if n:
        stem, ext = os.path.splitext(path)
        path = f"{stem}.{n}{ext or '.json'}"
    return path


@atexit.register
def _write_open_traces() -> None:
    for tel in list(live):
        try:
            path = tel.stop_trace()
            _log.info("tierstate trace written to %s at exit", path)
        except Exception as e:  # exit must not fail because one trace could not be saved
            _log.error("could not write the tierstate trace at exit: %s", e)
