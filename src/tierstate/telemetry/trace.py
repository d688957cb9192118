"""Chrome / Perfetto trace-event JSON: recording, export with per-lane nesting, validation.

The file is the JSON Object Format of the Trace Event Format: ``{"traceEvents": [...],
"displayTimeUnit": "ms", "otherData": {...}}``. It holds three kinds of event:

- ``"X"`` complete events (``name, cat, ts, dur, pid, tid``; ``ts``/``dur`` in µs),
  one per phase slice and one ``"step"`` slice per step on the main lane;
- ``"M"`` metadata events naming the process and each lane (``thread_name``) and fixing
  the lanes' order (``thread_sort_index``);
- ``"C"`` counter events, one track per gauge (memory per tier, bytes in flight).

[Note: nesting per lane]
Perfetto draws the slices of one ``tid`` as a stack and rejects (or mis-draws) a slice
that starts inside another and ends after it. Slices recorded by ``with tel.phase(...)``
on one thread nest by construction; slices added with an explicit start, or from two
threads that share a lane name, may not. :func:`nest_lane` repairs a lane on export by
splitting a slice where it crosses the end of its enclosing one (the tail becomes a
sibling slice with ``args.split = true``), so no time is lost or invented, and
:func:`validate_trace` checks the result.
"""
from __future__ import annotations

import heapq
import json
import math
import os
import tempfile
import threading
from dataclasses import dataclass
from typing import Any, Iterable

_NS_PER_S = 1_000_000_000


class TraceFormatError(ValueError):
    """A trace object breaks the trace-event format; ``problems`` lists every finding."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        super().__init__(f"invalid trace ({len(problems)} problems):\n  {shown}{more}")


@dataclass(frozen=True)
class Slice:
    """One complete event in integer nanoseconds since the trace origin."""

    start_ns: int
    end_ns: int
    name: str
    cat: str
    args: dict[str, Any] | None = None


def nest_lane(slices: Iterable[Slice]) -> list[Slice]:
    """Return ``slices`` reordered and split so that any two either nest or are disjoint.

    A slice that crosses the end of the slice enclosing its start is cut there; its
    tail is pushed back into the queue and placed like any other slice (it may be cut
    again). Total duration is preserved; zero-length tails are dropped.
    """
    # Heap order: earlier start first; for equal starts the longer slice first, so it
    # becomes the parent. The sequence number keeps the order total and stable.
    heap = [(s.start_ns, -s.end_ns, i, s) for i, s in enumerate(slices)]
    heapq.heapify(heap)
    seq = len(heap)
    out: list[Slice] = []
    open_ends: list[int] = []
    while heap:
        _, _, _, s = heapq.heappop(heap)
        while open_ends and open_ends[-1] <= s.start_ns:
            open_ends.pop()
        if open_ends and s.end_ns > open_ends[-1]:
            cut = open_ends[-1]
            args = dict(s.args or {})
            args["split"] = True
            head = Slice(s.start_ns, cut, s.name, s.cat, args)
            tail = Slice(cut, s.end_ns, s.name, s.cat, args)
            out.append(head)
            open_ends.append(cut)
            heapq.heappush(heap, (tail.start_ns, -tail.end_ns, seq, tail))
            seq += 1
            continue
        out.append(s)
        open_ends.append(s.end_ns)
    return out


class TraceRecorder:
    """Collects slices and counter samples while tracing; writes the trace JSON.

    Appends are list appends (atomic under the GIL), so worker threads record without
    a lock; only the first sighting of a lane takes one. ``max_events`` bounds memory
    for a trace left on for a long run (1e6 events is ~150 MB of tuples); past it,
    events are counted in ``dropped`` and the file says so in ``otherData``.
    """

    def __init__(self, path: str, origin: float, pid: int | None = None,
                 max_events: int = 1_000_000):
        if max_events <= 0:
            raise ValueError(f"max_events must be positive, got {max_events}")
        self.path = os.fspath(path)
        self.origin = origin
        self.pid = os.getpid() if pid is None else pid
        self.max_events = max_events
        self.dropped = 0
        self._slices: list[tuple[str, str, str, float, float, dict | None]] = []
        self._counters: list[tuple[str, float, float]] = []
        self._lanes: dict[str, int] = {}
        self._lane_lock = threading.Lock()

    def lane_tid(self, lane: str) -> int:
        """The stable thread id of ``lane``: 1, 2, ... in order of first use."""
        tid = self._lanes.get(lane)
        if tid is None:
            with self._lane_lock:
                tid = self._lanes.setdefault(lane, len(self._lanes) + 1)
        return tid

    def add_slice(self, lane: str, name: str, start: float, end: float,
                  cat: str = "phase", args: dict | None = None) -> None:
        """Record ``[start, end]`` (perf_counter seconds) on ``lane``."""
        if len(self._slices) + len(self._counters) >= self.max_events:
            self.dropped += 1
            return
        if lane not in self._lanes:
            self.lane_tid(lane)
        self._slices.append((lane, name, cat, start, end, args))

    def add_counter(self, name: str, when: float, value: float) -> None:
        """Record one sample of the counter track ``name`` at perf_counter time ``when``."""
        if len(self._slices) + len(self._counters) >= self.max_events:
            self.dropped += 1
            return
        self._counters.append((name, when, value))

    def _ns(self, t: float) -> int:
        return max(0, round((t - self.origin) * _NS_PER_S))

    def to_object(self, other_data: dict[str, Any] | None = None) -> dict[str, Any]:
        """The trace as a JSON-ready dict, every lane nested (see [Note: nesting per lane])."""
        pid = self.pid
        events: list[dict[str, Any]] = [
            {"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
             "args": {"name": "tierstate"}},
        ]
        lanes = dict(self._lanes)
        for lane, tid in lanes.items():
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                           "args": {"name": lane}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                           "args": {"sort_index": tid}})
        per_lane: dict[str, list[Slice]] = {lane: [] for lane in lanes}
        for lane, name, cat, start, end, args in list(self._slices):
            start_ns, end_ns = self._ns(start), self._ns(end)
            if end_ns < start_ns or (end_ns == start_ns and end > start):
                continue  # began and ended before the trace started
            per_lane[lane].append(Slice(start_ns, end_ns, name, cat, args))
        for lane, slices in per_lane.items():
            tid = lanes[lane]
            for s in nest_lane(slices):
                ev = {"ph": "X", "name": s.name, "cat": s.cat, "pid": pid, "tid": tid,
                      "ts": s.start_ns / 1000, "dur": (s.end_ns - s.start_ns) / 1000}
                if s.args:
                    ev["args"] = s.args
                events.append(ev)
        for name, when, value in list(self._counters):
            if when < self.origin:
                continue
            events.append({"ph": "C", "name": name, "pid": pid, "tid": 0,
                           "ts": self._ns(when) / 1000, "args": {"value": value}})
        other = {"dropped_events": self.dropped, **(other_data or {})}
        return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}

    def write(self, other_data: dict[str, Any] | None = None) -> str:
        """Write the trace atomically (temp file + rename) and return its path.

        Raises ``OSError`` (carrying the path and errno) when the folder is missing or
        not writable.
        """
        obj = self.to_object(other_data)
        folder = os.path.dirname(os.path.abspath(self.path))
        fd, tmp = tempfile.mkstemp(prefix=".trace-", suffix=".json.tmp", dir=folder)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(obj, f, separators=(",", ":"), allow_nan=False)
            os.replace(tmp, self.path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        return self.path


# ---------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------

_METADATA_NAMES = {"process_name": "name", "thread_name": "name", "process_labels": "labels",
                   "process_sort_index": "sort_index", "thread_sort_index": "sort_index"}
_SUPPORTED = {"X", "B", "E", "M", "C", "i", "I"}


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def validate_trace(obj: Any, *, require_lane_names: bool = True) -> None:
    """Check ``obj`` (a parsed trace JSON) against the trace-event format.

    Checks the container (an object with a ``traceEvents`` list, or a bare list), the
    fields each event type requires (``X``: name, ts, dur >= 0, pid, tid; ``B``/``E``:
    ts, pid, tid, matched per lane; ``M``: a known metadata name and its arg; ``C``:
    name, ts, pid, numeric args; ``i``: name, ts, pid), that slices on one
    ``(pid, tid)`` nest (no partial overlap), and, with ``require_lane_names``, that
    every lane carrying slices is named by a ``thread_name`` event.

    Raises :class:`TraceFormatError` listing every problem; returns None when valid.
    """
    problems: list[str] = []
    if isinstance(obj, dict):
        events = obj.get("traceEvents")
        if not isinstance(events, list):
            raise TraceFormatError(["top-level object has no 'traceEvents' list"])
    elif isinstance(obj, list):
        events = obj
    else:
        raise TraceFormatError([f"trace must be an object or a list, got {type(obj).__name__}"])

    # per lane: intervals in integer ns (µs * 1000 rounded) so nesting is checked exactly
    spans: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    open_b: dict[tuple[int, int], list[tuple[int, int]]] = {}
    named_lanes: set[tuple[int, int]] = set()
    for i, ev in enumerate(events):
        where = f"event {i}"
        if not isinstance(ev, dict):
            problems.append(f"{where}: not an object")
            continue
        ph = ev.get("ph")
        if not isinstance(ph, str) or ph not in _SUPPORTED:
            problems.append(f"{where}: unsupported or missing 'ph' {ph!r}")
            continue
        where = f"event {i} (ph={ph}, name={ev.get('name')!r})"
        if not _is_int(ev.get("pid")):
            problems.append(f"{where}: 'pid' must be an integer")
        if ph in ("X", "B", "E") and not _is_int(ev.get("tid")):
            problems.append(f"{where}: 'tid' must be an integer")
        if ph in ("X", "B", "C", "i", "I", "M") and not isinstance(ev.get("name"), str):
            problems.append(f"{where}: 'name' must be a string")
        if ph != "M" and not _is_num(ev.get("ts")):
            problems.append(f"{where}: 'ts' must be a finite number (µs)")
            continue
        if "args" in ev and not isinstance(ev["args"], dict):
            problems.append(f"{where}: 'args' must be an object")
            continue
        lane = (ev.get("pid"), ev.get("tid"))
        if ph == "X":
            dur = ev.get("dur")
            if not _is_num(dur) or dur < 0:
                problems.append(f"{where}: 'dur' must be a finite number >= 0 (µs)")
                continue
            start = round(ev["ts"] * 1000)
            spans.setdefault(lane, []).append((start, start + round(dur * 1000), i))
        elif ph == "B":
            open_b.setdefault(lane, []).append((round(ev["ts"] * 1000), i))
        elif ph == "E":
            stack = open_b.get(lane)
            if not stack:
                problems.append(f"{where}: 'E' without a matching 'B' on lane {lane}")
                continue
            start, j = stack.pop()
            end = round(ev["ts"] * 1000)
            if end < start:
                problems.append(f"{where}: ends before its 'B' (event {j}) begins")
                continue
            spans.setdefault(lane, []).append((start, end, j))
        elif ph == "M":
            key = _METADATA_NAMES.get(ev.get("name"))
            args = ev.get("args")
            if key is None:
                problems.append(f"{where}: unknown metadata name; expected one of "
                                f"{sorted(_METADATA_NAMES)}")
            elif not isinstance(args, dict) or key not in args:
                problems.append(f"{where}: metadata needs args.{key}")
            elif key == "name" and not isinstance(args[key], str):
                problems.append(f"{where}: args.name must be a string")
            elif key == "sort_index" and not _is_int(args[key]):
                problems.append(f"{where}: args.sort_index must be an integer")
            elif ev["name"] == "thread_name":
                if not _is_int(ev.get("tid")):
                    problems.append(f"{where}: 'tid' must be an integer")
                named_lanes.add(lane)
        elif ph == "C":
            args = ev.get("args")
            if not isinstance(args, dict) or not args:
                problems.append(f"{where}: counter needs a non-empty 'args' object")
            elif not all(_is_num(v) for v in args.values()):
                problems.append(f"{where}: counter args must all be finite numbers")
        elif ph in ("i", "I"):
            if ev.get("s", "t") not in ("g", "p", "t"):
                problems.append(f"{where}: instant scope 's' must be 'g', 'p' or 't'")
    for lane, stack in open_b.items():
        for _, j in stack:
            problems.append(f"event {j}: 'B' on lane {lane} never ended")

    for lane, intervals in spans.items():
        if require_lane_names and lane not in named_lanes:
            problems.append(f"lane pid={lane[0]} tid={lane[1]} has slices but no "
                            "'thread_name' metadata event")
        intervals.sort(key=lambda s: (s[0], -s[1]))
        stack: list[tuple[int, int, int]] = []
        for start, end, i in intervals:
            while stack and stack[-1][1] <= start:
                stack.pop()
            if stack and end > stack[-1][1]:
                p = stack[-1]
                problems.append(
                    f"event {i} [{start / 1000}, {end / 1000}] µs on lane pid={lane[0]} "
                    f"tid={lane[1]} partially overlaps event {p[2]} "
                    f"[{p[0] / 1000}, {p[1] / 1000}] µs: slices on one lane must nest")
            stack.append((start, end, i))
    if problems:
        raise TraceFormatError(problems)


def load_trace(path: str) -> dict[str, Any]:
    """Read a trace JSON file (object or bare-list form) into the object form."""
    with open(path) as f:
        obj = json.load(f)
    if isinstance(obj, list):
        obj = {"traceEvents": obj}
    return obj
