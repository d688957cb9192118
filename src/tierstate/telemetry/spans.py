"""The recording hot path: per-thread state and the phase spans of :class:`~.recorder.Telemetry`.

A phase is a :class:`_Span`: two ``perf_counter`` calls and one tuple appended to its
thread's buffer, no lock. :meth:`Telemetry._drain <tierstate.telemetry.recorder.Telemetry._drain>`
folds the buffers into the step's totals. What a step books is :class:`Accumulators`.
"""
from __future__ import annotations

import threading
import time
from collections import defaultdict
from typing import TYPE_CHECKING

import torch.autograd.profiler as _torch_profiler

from .phases import _PHASES as _phase_table, OTHER, PHASES, RENAMED_PHASES

if TYPE_CHECKING:
    from .recorder import Telemetry

_perf_counter = time.perf_counter
MAIN_LANE = "main"  # the main thread's lane, and the main lane until a step begins on another thread


# A thread drains its own record buffer into the step's accumulators once it holds this
# many records (~4096 x 100 B), so a thread that records outside of steps (a checkpoint
# writer) cannot grow memory without bound.
DRAIN_AT = 4096


class _ThreadState:
    """Per-thread recording state: the lane name, the open-phase stack (a linked list of
    spans through ``up``) and the buffer of finished records, appended without a lock
    and drained by :meth:`Telemetry._drain`."""

    __slots__ = ("lane", "top", "buf", "thread")

    def __init__(self) -> None:
        self.thread = threading.current_thread()
        self.lane = MAIN_LANE if self.thread is threading.main_thread() else self.thread.name
        self.top: _Span | None = None
        # (phase, lane, start, end, self_s)
        self.buf: list[tuple[str, str, float, float, float]] = []


class _Span:
    """One open phase on one thread (``with tel.phase(...)``); ``child_s`` collects the
    time of phases nested in it on the same lane."""

    __slots__ = ("tel", "name", "lane", "start", "child_s", "up", "rf", "state")

    def __init__(self, tel: "Telemetry", name: str, lane: str | None):
        # a plain dict lookup: the MappingProxy's ``in`` costs ~3x more on the hot path
        if name not in _phase_table or name == OTHER:
            _raise_unknown_phase(name)
        self.tel = tel
        self.name = name
        self.lane = lane

    def __enter__(self) -> "_Span":
        try:
            state = self.tel._local.state
        except AttributeError:
            state = self.tel._thread_state()
        self.state = state
        if self.lane is None:
            self.lane = state.lane
        self.up = state.top
        state.top = self
        self.child_s = 0.0
        if _torch_profiler._is_profiler_enabled:
            self.rf = _torch_profiler.record_function(f"tierstate::{self.name}")
            self.rf.__enter__()
        else:
            self.rf = None
        self.start = _perf_counter()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        end = _perf_counter()
        if self.rf is not None:
            self.rf.__exit__(exc_type, exc, tb)
        state, up, lane = self.state, self.up, self.lane
        state.top = up
        elapsed = end - self.start
        if up is not None and up.lane == lane:
            up.child_s += elapsed
        buf = state.buf
        buf.append((self.name, lane, self.start, end, elapsed - self.child_s))
        if len(buf) >= DRAIN_AT:
            self.tel._drain()


def _raise_unknown_phase(name: str) -> None:
    if name == OTHER:
        raise ValueError("phase 'other' is computed (step time in no phase) and cannot be "
                         "recorded; pick the phase that covers the work")
    if name in RENAMED_PHASES:
        raise ValueError(f"phase {name!r} is now called {RENAMED_PHASES[name]!r}; record that name")
    raise ValueError(f"unknown phase {name!r}; use one of "
                     f"{[p for p in PHASES if p != OTHER]} or register it with "
                     "tierstate.telemetry.register_phase(name, description)")


class _NullSpan:
    __slots__ = ()

    def __enter__(self) -> "_NullSpan":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        return None


_NULL_SPAN = _NullSpan()


class Accumulators:
    """Everything booked between two ``end_step`` calls (guarded by Telemetry._lock)."""

    __slots__ = ("critical", "lanes", "bytes", "counters", "intervals")

    def __init__(self) -> None:
        self.critical: dict[str, float] = defaultdict(float)
        self.lanes: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.bytes: dict[str, int] = defaultdict(int)
        self.counters: dict[str, int] = defaultdict(int)
        self.intervals: dict[str, list[tuple[float, float]]] = defaultdict(list)
