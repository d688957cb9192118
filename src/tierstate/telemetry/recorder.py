"""One optimizer's telemetry: phase timing, bytes, counters, gauges, traces, health.

Cost model (measured by ``tierstate bench overhead --per-call``): a phase is a small
object, two ``perf_counter`` calls and one tuple appended to a per-thread buffer, no
lock (:mod:`.spans`); buffers are folded into the step's totals (and the trace, while
tracing) at ``end_step``, or by a thread itself every 4096 records. That is 3-4 µs per
phase, the fold included, on a 2-core VM with other work running; ``record_function`` is
entered only while the torch profiler runs (torch's own module flag, a global read). A
step with 200 phases pays ~1 ms, about 1 % of a 100 ms step, which is why telemetry stays
on by default (``tierstate bench overhead`` times the optimizer with telemetry on against off).

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

import errno
import logging
import math
import os
import tempfile
import threading
import time
from typing import Any

from .health import HealthMonitor, HealthWarning
from .phases import _PHASES as _phase_table, CHANNEL_PHASES, CHANNELS, DIRECTIONS, OTHER, PCIE_DIRECTIONS, PHASES, TIERS
from .rss import proc_statm_rss, psutil_process
from .spans import _NULL_SPAN, DRAIN_AT, MAIN_LANE, Accumulators, _raise_unknown_phase, _Span, _ThreadState
from .stats import StepStats, bandwidth_of, union_length
from .totals import accumulate, empty_totals
from .trace import TraceRecorder
from .trace_env import TRACE_ENV, expand_env_trace_path, live

_log = logging.getLogger("tierstate")
_perf_counter = time.perf_counter

# Health warnings repeat at most this often per subject (channel, directory, budget).
WARN_INTERVAL_S = 300.0



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
        self._acc = Accumulators()
        self._gauges: dict[str, float] = {}
        self._rss_set = False
        self._main_lane = MAIN_LANE
        self._step: int | None = None
        self._step_start = math.inf          # no step open: nothing is critical path
        self._steps_ended = 0
        self._aborted = 0
        self._totals: dict[str, Any] = empty_totals()
        self._health = HealthMonitor()
        self._warned_at: dict[tuple[str, str], float] = {}
        self._trace: TraceRecorder | None = None
        self._process = None   # psutil, only where /proc/self/statm is unavailable
        env_path = os.environ.get(TRACE_ENV)
        if env_path and self.enabled:
            self.start_trace(expand_env_trace_path(env_path))

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
        if len(state.buf) >= DRAIN_AT:
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
            acc, self._acc = self._acc, Accumulators()
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
        accumulate(self._totals, stats)
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
        live.add(self)

    def stop_trace(self) -> str:
        """Stop recording, write the trace file and return its path."""
        trace = self._trace
        if trace is None:
            raise RuntimeError("stop_trace() called while not tracing; call "
                               "start_trace(path) first")
        self._drain()
        self._trace = None
        live.discard(self)
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
        rss = proc_statm_rss()
        if rss is not None:
            return rss
        if self._process is None:
            self._process = psutil_process()
        return self._process.memory_info().rss


def _trace_step_args(stats: StepStats) -> dict[str, Any]:
    return {"step": stats.step, "wall_s": stats.wall_s, "skipped": stats.skipped,
            "phases": stats.phases, "bytes": stats.bytes,
            "bandwidth": {k: b.as_dict() for k, b in stats.bandwidth.items()}}


