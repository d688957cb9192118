"""One optimizer's telemetry: phase timing, bytes, counters, gauges, traces, health.

Cost model (measured by ``tierstate bench overhead --per-call``): a phase is a small
object, two ``perf_counter`` calls and one tuple appended to a per-thread buffer, no
lock; buffers are folded into the step's totals (and the trace, while tracing) at
``end_step``, or by a thread itself every 4096 records. That is 3-4 µs per phase all
included on the 2-core dev machine at load 4-11; ``record_function`` is entered only
while the torch profiler runs (torch's own module flag, a global read). A step with 200
phases pays ~1 ms, about 1 % of a 100 ms step, which is why telemetry stays on by
default.

[Note: critical path vs lanes]
The thread that calls :meth:`Telemetry.begin_step` owns the *main lane*. A phase on the
main lane that starts inside the step is on the critical path and is booked as its *self
time* (its duration minus the phases nested in it on that lane), so the critical-path
phases tile the step without double counting and ``other`` is the rest of the wall
time. Phases on every other lane (I/O threads, CPU workers, CUDA streams, whose names
are free strings) overlap the step; they are booked per lane. Background work is
attributed to the step that ends next, so read-ahead done during forward/backward
counts toward the step that consumes it, and bytes per step add up over a run.
"""
from __future__ import annotations

import atexit
import errno
import logging
import math
import os
import tempfile
import threading
import time
from collections import defaultdict
from typing import Any

import torch.autograd.profiler as _torch_profiler

from .health import HealthMonitor, HealthWarning
from .phases import (_PHASES as _phase_table, CHANNEL_PHASES, CHANNELS, DIRECTIONS, OTHER,
                     PCIE_DIRECTIONS, PHASES, RENAMED_PHASES, TIERS)
from .stats import Bandwidth, StepStats, bandwidth_of, union_length
from .trace import TraceRecorder

_log = logging.getLogger("tierstate")
_perf_counter = time.perf_counter

TRACE_ENV = "TIERSTATE_TRACE"
# Health warnings repeat at most this often per subject (channel, directory, budget).
WARN_INTERVAL_S = 300.0

_MAIN_LANE = "main"
# Telemetry objects with a trace to write at exit. Strong references on purpose: an
# optimizer dropped before exit still leaves its trace file.
_live: set = set()
_env_trace_uses = 0                 # how many Telemetry objects took TIERSTATE_TRACE
_env_lock = threading.Lock()


def _bytes_key(tier: str, direction: str) -> str:
    if tier not in TIERS:
        raise ValueError(f"tier must be one of {TIERS}, got {tier!r}")
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    if direction in PCIE_DIRECTIONS and tier != "device":
        raise ValueError(f"direction {direction!r} is a PCIe transfer; record it under "
                         f"tier='device' (got tier={tier!r}) so it is counted once")
    return f"{tier}/{direction}"


_BYTES_KEYS = {(t, d): f"{t}/{d}" for t in TIERS for d in DIRECTIONS
               if d not in PCIE_DIRECTIONS or t == "device"}


# A thread drains its own record buffer into the step's accumulators once it holds this
# many records (~4096 x 100 B), so a thread that records outside of steps (a checkpoint
# writer) cannot grow memory without bound.
_DRAIN_AT = 4096


class _ThreadState:
    """Per-thread recording state: the lane name, the open-phase stack (a linked list of
    spans through ``up``) and the buffer of finished records, appended without a lock
    and drained by :meth:`Telemetry._drain`."""

    __slots__ = ("lane", "top", "buf", "thread")

    def __init__(self) -> None:
        self.thread = threading.current_thread()
        self.lane = _MAIN_LANE if self.thread is threading.main_thread() else self.thread.name
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
        if len(buf) >= _DRAIN_AT:
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


class _Accumulators:
    """Everything booked between two ``end_step`` calls (guarded by Telemetry._lock)."""

    __slots__ = ("critical", "lanes", "bytes", "counters", "intervals")

    def __init__(self) -> None:
        self.critical: dict[str, float] = defaultdict(float)
        self.lanes: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.bytes: dict[str, int] = defaultdict(int)
        self.counters: dict[str, int] = defaultdict(int)
        self.intervals: dict[str, list[tuple[float, float]]] = defaultdict(list)


class Telemetry:
    """Per-optimizer telemetry: where every millisecond and byte of a step went.

    Typical use by the optimizer core::

        tel = Telemetry(enabled=True, log_every=50)
        tel.begin_step(step)
        with tel.phase("cpu_update"):              # on the main lane: critical path
            ...
        tel.add_bytes("nvme", "read", nbytes)      # from any thread
        stats = tel.end_step()                     # StepStats; logged every log_every

    Args:
        enabled: when False every call is a no-op except step wall time, and
            ``end_step`` returns stats with all time in ``other``.
        log_every: log ``str(stats)`` at INFO on ``logging.getLogger("tierstate")``
            every this many steps (0 disables).
        sample_host_rss: read the process RSS at each ``end_step`` (~2 µs from
            ``/proc/self/statm``) unless the caller set the ``host_rss`` gauge during
            the step.
        max_trace_events: bound on events kept in memory while tracing.

    Tracing: ``start_trace(path)`` (or the ``TIERSTATE_TRACE`` environment variable,
    read when the object is created) records Chrome/Perfetto trace events until
    ``stop_trace()``, or until interpreter exit, which writes the file too.
    ``TIERSTATE_TRACE`` may contain ``{pid}`` and ``{rank}`` (from ``$RANK``, else 0);
    when several Telemetry objects (optimizers) in one process take it, the second
    writes ``name.1.json``, the third ``name.2.json``, and so on.

    Thread safety: phases, bytes, counters and gauges may be recorded from any thread.
    ``begin_step``/``end_step`` are called from the thread that runs the step.
    """

    def __init__(self, enabled: bool = True, log_every: int = 50, *,
                 sample_host_rss: bool = True, max_trace_events: int = 1_000_000):
        if not isinstance(log_every, int) or log_every < 0:
            raise ValueError(f"log_every must be an int >= 0 (0 disables), got {log_every!r}")
        self.enabled = bool(enabled)
        self.log_every = log_every
        self.sample_host_rss = sample_host_rss
        self.max_trace_events = max_trace_events
        self.last: StepStats | None = None
        self._lock = threading.Lock()
        self._local = threading.local()
        self._threads: list[_ThreadState] = []
        self._acc = _Accumulators()
        self._gauges: dict[str, float] = {}
        self._rss_set = False
        self._main_lane = _MAIN_LANE
        self._step: int | None = None
        self._step_start = math.inf          # no step open: nothing is critical path
        self._steps_ended = 0
        self._aborted = 0
        self._totals: dict[str, Any] = _empty_totals()
        self._health = HealthMonitor()
        self._warned_at: dict[tuple[str, str], float] = {}
        self._trace: TraceRecorder | None = None
        self._process = None   # psutil, only where /proc/self/statm is unavailable
        env_path = os.environ.get(TRACE_ENV)
        if env_path and self.enabled:
            self.start_trace(_expand_env_trace_path(env_path))

    # -- phases ----------------------------------------------------------------------

    def phase(self, name: str, lane: str | None = None) -> Any:
        """Context manager timing phase ``name`` (a key of :data:`PHASES`) on ``lane``.

        ``lane`` defaults to the current thread's name (``"main"`` on the main thread).
        Inside, ``torch.profiler.record_function(f"tierstate::{name}")`` is open while
        the torch profiler runs, so profiler traces show the phase too.
        """
        if not self.enabled:
            return _NULL_SPAN
        return _Span(self, name, lane)

    def add_phase_time(self, name: str, seconds: float, lane: str | None = None,
                       start: float | None = None) -> None:
        """Book ``seconds`` of phase ``name`` measured elsewhere (an I/O thread, a CUDA
        event pair). ``start`` is a ``time.perf_counter()`` value; without it the
        interval is taken to end now. When the calling thread has a phase open on the
        same lane, the time nests in it (is subtracted from its self time)."""
        if not self.enabled:
            return
        if name not in _phase_table or name == OTHER:
            _raise_unknown_phase(name)
        if (not isinstance(seconds, (int, float)) or isinstance(seconds, bool)
                or not 0 <= seconds < math.inf):
            raise ValueError(f"seconds must be a finite number >= 0, got {seconds!r}")
        try:
            state = self._local.state
        except AttributeError:
            state = self._thread_state()
        if lane is None:
            lane = state.lane
        if start is None:
            end = _perf_counter()
            start = end - seconds
        else:
            end = start + seconds
        top = state.top
        if top is not None and top.lane == lane:
            top.child_s += seconds
        state.buf.append((name, lane, start, end, float(seconds)))
        if len(state.buf) >= _DRAIN_AT:
            self._drain()

    def _thread_state(self) -> _ThreadState:
        state = _ThreadState()
        self._local.state = state
        with self._lock:
            self._threads.append(state)
        return state

    def _drain(self) -> None:
        """Move every thread's finished records into the accumulators (and the trace).

        Appends race only with this slice-then-delete of the records counted first,
        and both are single list operations under the GIL, so no record is lost.
        """
        with self._lock:
            acc = self._acc
            main_lane, step_start = self._main_lane, self._step_start
            trace = self._trace
            alive = []
            for state in self._threads:
                buf = state.buf
                n = len(buf)
                records = buf[:n]
                del buf[:n]
                if state.thread.is_alive() or buf:
                    alive.append(state)
                for name, lane, start, end, self_s in records:
                    acc.lanes[lane][name] += self_s
                    if lane == main_lane and end > step_start:
                        # only the part inside the step is critical path (an interval
                        # booked with add_phase_time may begin before begin_step)
                        acc.critical[name] += min(self_s, end - step_start)
                    if name in CHANNEL_PHASES:
                        acc.intervals[name].append((start, end))
                    if trace is not None:
                        trace.add_slice(lane, name, start, end)
            self._threads = alive

    # -- bytes, counters, gauges -----------------------------------------------------

    def add_bytes(self, tier: str, direction: str, nbytes: int) -> None:
        """Count ``nbytes`` moved on ``tier`` (device/host/nvme) in ``direction``
        (h2d/d2h for PCIe, under tier ``device``; read/write otherwise)."""
        if not self.enabled:
            return
        key = _BYTES_KEYS.get((tier, direction)) or _bytes_key(tier, direction)
        if not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"nbytes must be an int >= 0, got {nbytes!r}")
        with self._lock:
            self._acc.bytes[key] += nbytes

    def count(self, name: str, n: int = 1) -> None:
        """Add ``n`` to counter ``name`` for this step (``"skipped_steps"`` marks the
        step skipped)."""
        if not self.enabled:
            return
        if not isinstance(n, int):
            raise TypeError(f"count({name!r}, n=...) needs an int, got {type(n).__name__}")
        with self._lock:
            self._acc.counters[name] += n

    def set_gauge(self, name: str, value: float) -> None:
        """Set gauge ``name`` (bytes for memory gauges: ``host_rss``, ``pinned_bytes``,
        ``device_mem``, ``tier_bytes/nvme``, ...). Gauges keep their last value across
        steps; while tracing each set is a counter sample."""
        if not self.enabled:
            return
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"gauge {name!r} needs a finite number, got {value!r}")
        self._gauges[name] = value
        if name == "host_rss":
            self._rss_set = True
        trace = self._trace
        if trace is not None:
            trace.add_counter(name, _perf_counter(), value)

    # -- steps -----------------------------------------------------------------------

    def begin_step(self, step_index: int) -> None:
        """Open step ``step_index`` on the calling thread's lane and start its clock.

        Beginning a step while another is open discards the open one (an exception
        escaped it) and counts it under ``aborted_steps`` in the next stats.
        """
        if self._step is not None:
            self._aborted += 1
        try:
            state = self._local.state
        except AttributeError:
            state = self._thread_state()
        with self._lock:
            self._main_lane = state.lane
            self._step = int(step_index)
            self._acc.critical.clear()
            self._step_start = _perf_counter()

    def end_step(self, skipped: bool | None = None) -> StepStats:
        """Close the open step and return its :class:`StepStats`.

        ``skipped`` defaults to whether ``count("skipped_steps")`` was called during
        the step. Logs the one-line summary every ``log_every`` steps and health
        warnings (rate-limited) when a rule fires.
        """
        end = _perf_counter()
        if self._step is None:
            raise RuntimeError("end_step() called with no open step; call "
                               "begin_step(step_index) at the start of the step")
        start = self._step_start
        self._drain()
        with self._lock:
            acc, self._acc = self._acc, _Accumulators()
            step = self._step
            self._step = None
            self._step_start = math.inf
        wall = end - start
        if not self.enabled:
            stats = StepStats(step=step, wall_s=wall, phases={OTHER: wall}, lanes={},
                              bytes={}, bandwidth={}, counters={}, gauges={},
                              skipped=bool(skipped), main_lane=self._main_lane)
            self.last = stats
            return stats
        if self.sample_host_rss and not self._rss_set:
            self.set_gauge("host_rss", self._host_rss())
        self._rss_set = False
        counters = dict(acc.counters)
        if self._aborted:
            counters["aborted_steps"] = counters.get("aborted_steps", 0) + self._aborted
            self._aborted = 0
        phases = dict(acc.critical)
        phases[OTHER] = max(0.0, wall - sum(phases.values()))
        bandwidth = {}
        for ch in CHANNELS:
            nbytes = sum(acc.bytes.get(k, 0) for k in ch.bytes_keys)
            busy = union_length(acc.intervals.get(ch.phase, ()))
            if nbytes or busy:
                bandwidth[ch.name] = bandwidth_of(nbytes, busy,
                                                  self._health.peaks.get(ch.peak_key))
        if skipped is None:
            skipped = counters.get("skipped_steps", 0) > 0
        stats = StepStats(
            step=step, wall_s=wall, phases=phases,
            lanes={lane: dict(p) for lane, p in acc.lanes.items()},
            bytes=dict(acc.bytes), bandwidth=bandwidth, counters=counters,
            gauges=dict(self._gauges), skipped=bool(skipped), main_lane=self._main_lane)
        self.last = stats
        self._steps_ended += 1
        _accumulate(self._totals, stats)
        trace = self._trace
        if trace is not None:
            trace.add_slice(self._main_lane, "step", start, end, cat="step",
                            args=_trace_step_args(stats))
        self._health.observe(stats)
        self._log_health()
        if self.log_every and self._steps_ended % self.log_every == 0:
            _log.info("%s", stats)
        return stats

    def totals(self) -> StepStats | None:
        """Cumulative stats over every ended step (None before the first): times, bytes
        and counters summed, bandwidth over the summed busy time, gauges the last
        values (their maxima in ``extra["gauge_max"]``), ``steps`` the count."""
        t = self._totals
        if not t["steps"]:
            return None
        bandwidth = {name: bandwidth_of(nb, busy, self._health.peaks.get(peak_key))
                     for name, (nb, busy, peak_key) in t["bandwidth"].items()}
        return StepStats(
            step=t["step"], wall_s=t["wall_s"], phases=dict(t["phases"]),
            lanes={lane: dict(p) for lane, p in t["lanes"].items()},
            bytes=dict(t["bytes"]), bandwidth=bandwidth, counters=dict(t["counters"]),
            gauges=dict(t["gauges"]), skipped=False, main_lane=self._main_lane,
            steps=t["steps"], extra={"gauge_max": dict(t["gauge_max"])})

    # -- health ----------------------------------------------------------------------

    def set_peaks(self, peaks: dict[str, float]) -> None:
        """Probed peak bandwidths in GB/s: any of ``host_mem_gbps``, ``nvme_read_gbps``,
        ``nvme_write_gbps``, ``h2d_gbps``, ``d2h_gbps``. Shown next to achieved GB/s and
        used by the bandwidth health rule."""
        self._health.set_peaks(peaks)

    def set_host_budget(self, nbytes: int | None) -> None:
        """Warn when the ``host_rss`` gauge exceeds 90 % of ``nbytes`` (None: no rule)."""
        self._health.set_host_budget(nbytes)

    def watch_disk(self, path: str | os.PathLike) -> None:
        """Warn when the file system holding ``path`` has < 5 % or < 2 GiB free."""
        self._health.watch_disk(path)

    def health_warnings(self) -> list[HealthWarning]:
        """The health rules' current findings (not rate-limited)."""
        return self._health.findings()

    def _log_health(self) -> None:
        findings = self._health.findings()
        if not findings:
            return
        now = time.monotonic()
        for w in findings:
            key = (w.kind, w.key)
            last = self._warned_at.get(key)
            if last is None or now - last >= WARN_INTERVAL_S:
                self._warned_at[key] = now
                _log.warning("tierstate health: %s", w.message)

    # -- tracing ---------------------------------------------------------------------

    @property
    def tracing(self) -> bool:
        """Whether a trace is being recorded."""
        return self._trace is not None

    @property
    def trace_path(self) -> str | None:
        """Where the current trace will be written (None when not tracing)."""
        return None if self._trace is None else self._trace.path

    def start_trace(self, path: str | os.PathLike) -> None:
        """Start recording a Chrome/Perfetto trace to ``path`` (callable mid-run).

        The file is written by :meth:`stop_trace`, or at interpreter exit if the run
        ends first (the trace keeps this object alive until then). Raises
        ``FileNotFoundError`` when the folder of ``path`` does not exist,
        ``IsADirectoryError`` when ``path`` is a folder, another ``OSError`` (with the errno
        and the path) when no file can be created in the folder, and ``RuntimeError`` when
        already tracing or telemetry is disabled.
        """
        if not self.enabled:
            raise RuntimeError("telemetry is disabled; create Telemetry(enabled=True) "
                               "to trace")
        if self._trace is not None:
            raise RuntimeError(f"already tracing to {self._trace.path}; call stop_trace() "
                               "first")
        path = os.fspath(path)
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise FileNotFoundError(errno.ENOENT, "trace folder does not exist; create it first",
                                    folder)
        if os.path.isdir(path):
            raise IsADirectoryError(errno.EISDIR, "trace path is a folder; give a file in it, "
                                    f"such as {os.path.join(path, 'trace.json')}", path)
        # The file is written only at stop_trace, possibly hours later: find out now whether
        # the folder takes a file (os.access says yes to root on a read-only mount).
        fd, probe = tempfile.mkstemp(prefix=".trace-", suffix=".probe", dir=folder)
        os.close(fd)
        os.unlink(probe)
        trace = TraceRecorder(path, origin=_perf_counter(),
                              max_events=self.max_trace_events)
        trace.lane_tid(self._main_lane)  # the main lane is always the top lane
        for name, value in self._gauges.items():
            trace.add_counter(name, trace.origin, value)
        self._trace = trace
        _live.add(self)

    def stop_trace(self) -> str:
        """Stop recording, write the trace file and return its path."""
        trace = self._trace
        if trace is None:
            raise RuntimeError("stop_trace() called while not tracing; call "
                               "start_trace(path) first")
        self._drain()
        self._trace = None
        _live.discard(self)
        if trace.dropped:
            _log.warning("trace %s dropped %d events past max_trace_events=%d",
                         trace.path, trace.dropped, trace.max_events)
        return trace.write(self._trace_metadata())

    def _trace_metadata(self) -> dict[str, Any]:
        return {"tierstate": {"format": 1, "main_lane": self._main_lane,
                              "peaks_gbps": dict(self._health.peaks),
                              "phases": dict(PHASES),
                              "channels": {c.name: {"phase": c.phase,
                                                    "bytes": list(c.bytes_keys),
                                                    "peak": c.peak_key}
                                           for c in CHANNELS}}}

    def _host_rss(self) -> int:
        rss = _proc_statm_rss()
        if rss is not None:
            return rss
        if self._process is None:
            self._process = _psutil_process()
        return self._process.memory_info().rss


def _psutil_process():
    import psutil
    return psutil.Process()


_statm: tuple[int, int] | None = None   # (pid, fd) of an open /proc/self/statm
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _proc_statm_rss() -> int | None:
    """Resident set size from ``/proc/self/statm`` via a kept-open fd (~2 µs; psutil's
    memory_info() opens the file each time, ~15 µs). None where /proc is missing.
    The fd is reopened after a fork, since /proc/self was resolved at open time."""
    global _statm
    pid = os.getpid()
    if _statm is None or _statm[0] != pid:
        try:
            _statm = (pid, os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC))
        except OSError:
            return None
    try:
        return int(os.pread(_statm[1], 128, 0).split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


def _trace_step_args(stats: StepStats) -> dict[str, Any]:
    return {"step": stats.step, "wall_s": stats.wall_s, "skipped": stats.skipped,
            "phases": stats.phases, "bytes": stats.bytes,
            "bandwidth": {k: b.as_dict() for k, b in stats.bandwidth.items()}}


def _empty_totals() -> dict[str, Any]:
    return {"steps": 0, "step": 0, "wall_s": 0.0, "phases": defaultdict(float),
            "lanes": defaultdict(lambda: defaultdict(float)), "bytes": defaultdict(int),
            "counters": defaultdict(int), "gauges": {}, "gauge_max": {},
            "bandwidth": {}}


def _accumulate(t: dict[str, Any], s: StepStats) -> None:
    t["steps"] += 1
    t["step"] = s.step
    t["wall_s"] += s.wall_s
    for k, v in s.phases.items():
        t["phases"][k] += v
    for lane, p in s.lanes.items():
        for k, v in p.items():
            t["lanes"][lane][k] += v
    for k, v in s.bytes.items():
        t["bytes"][k] += v
    for k, v in s.counters.items():
        t["counters"][k] += v
    if s.skipped and not s.counters.get("skipped_steps"):
        t["counters"]["skipped_steps"] += 1
    t["gauges"] = dict(s.gauges)
    for k, v in s.gauges.items():
        t["gauge_max"][k] = max(v, t["gauge_max"].get(k, v))
    for ch in CHANNELS:
        b: Bandwidth | None = s.bandwidth.get(ch.name)
        if b is None:
            continue
        nb, busy, _ = t["bandwidth"].get(ch.name, (0, 0.0, ch.peak_key))
        t["bandwidth"][ch.name] = (nb + b.nbytes, busy + b.busy_s, ch.peak_key)


def _expand_env_trace_path(template: str) -> str:
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
    for tel in list(_live):
        try:
            path = tel.stop_trace()
            _log.info("tierstate trace written to %s at exit", path)
        except Exception as e:  # exit must not fail because one trace could not be saved
            _log.error("could not write the tierstate trace at exit: %s", e)
