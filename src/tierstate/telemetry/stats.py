"""What one step (or a run of steps) cost: time per phase and lane, bytes, bandwidth, memory."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from .phases import OTHER

_GB = 1e9


@dataclass(frozen=True)
class Bandwidth:
    """Achieved bandwidth of one channel (see :data:`~tierstate.telemetry.phases.CHANNELS`).

    ``busy_s`` is the wall time during which at least one lane was in the channel's
    phase; ``gbps`` is ``nbytes / busy_s / 1e9`` (None when nothing moved or no time was
    recorded); ``peak_gbps`` is the probed peak when one was given.
    """

    nbytes: int
    busy_s: float
    gbps: float | None
    peak_gbps: float | None = None

    @property
    def fraction_of_peak(self) -> float | None:
        """``gbps / peak_gbps``, or None when either is unknown."""
        if self.gbps is None or not self.peak_gbps:
            return None
        return self.gbps / self.peak_gbps

    def as_dict(self) -> dict[str, Any]:
        return {"bytes": self.nbytes, "busy_s": self.busy_s, "gbps": self.gbps,
                "peak_gbps": self.peak_gbps, "fraction_of_peak": self.fraction_of_peak}


@dataclass(frozen=True)
class StepStats:
    """Where one optimizer step's time and bytes went.

    The invariant: ``sum(phases.values()) == wall_s`` up to float rounding, because
    ``phases`` holds the *critical path* only: self time (time minus nested phases) of
    each phase on ``main_lane`` while the step was open, with ``phases["other"]`` the
    remainder. Work on other lanes (I/O threads, CPU workers, streams) overlaps the step
    and is in ``lanes``, which holds every lane's self time per phase, main lane
    included.

    ``bytes`` is keyed ``"tier/direction"`` (``"nvme/read"``, ``"device/d2h"``, ...);
    ``bandwidth`` holds the achieved GB/s per channel next to the probed peak; ``gauges``
    the last value of each gauge (``host_rss``, ``pinned_bytes``, ``device_mem``, ...,
    in bytes); ``counters`` the counts made during the step. ``steps`` is 1 for one
    step and N for :meth:`Telemetry.totals`, where times and bytes are sums.
    """

    step: int
    wall_s: float
    phases: dict[str, float]
    lanes: dict[str, dict[str, float]]
    bytes: dict[str, int]
    bandwidth: dict[str, Bandwidth]
    counters: dict[str, int]
    gauges: dict[str, float]
    skipped: bool
    main_lane: str = "main"
    steps: int = 1
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def nvme_bytes_per_param(self) -> dict[str, float] | None:
        """Bytes the NVMe tier moved per step per parameter it holds: ``{"read": .., "write": ..,
        "record": ..}``, the first two measured (``bytes["nvme/read"]`` / ``nvme/write`` over
        the gauge ``nvme_params``, per step), ``record`` the bytes of the tier's records per
        parameter (what moving every record once costs: 12.0 for fp32 AdamW state with a
        master, ~6.03 with ``moment_dtype="q8"``, ~4.03 with q8 and a ``bf16_kahan`` master of
        bf16 parameters, which are their own master (~2.03 with ``bf16_sr``); the
        pool keeps the last ``buffer_count`` records of a step in RAM, so the measured
        figures are lower by that share). None without an NVMe tier."""
        n = self.gauges.get("nvme_params")
        if not n:
            return None
        steps = max(1, self.steps)
        return {"read": self.bytes.get("nvme/read", 0) / n / steps,
                "write": self.bytes.get("nvme/write", 0) / n / steps,
                "record": float(self.gauges.get("nvme_record_bytes_per_param", 0.0))}

    @property
    def critical_s(self) -> float:
        """Critical-path time covered by named phases (``wall_s - phases["other"]``)."""
        return sum(v for k, v in self.phases.items() if k != OTHER)

    def share(self, phase: str) -> float:
        """Fraction of the wall time ``phase`` took on the critical path (0 if absent)."""
        if self.wall_s <= 0:
            return 0.0
        return self.phases.get(phase, 0.0) / self.wall_s

    @property
    def bottleneck(self) -> tuple[str, float]:
        """``(phase, share)`` of the largest critical-path phase, ``other`` included."""
        if not self.phases:
            return OTHER, 0.0
        name = max(self.phases, key=self.phases.__getitem__)
        return name, self.share(name)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-serialisable copy (plain dicts, floats, ints, bools, strings)."""
        return {
            "step": self.step, "steps": self.steps, "wall_s": self.wall_s,
            "main_lane": self.main_lane, "skipped": self.skipped,
            "phases": dict(self.phases),
            "lanes": {lane: dict(p) for lane, p in self.lanes.items()},
            "bytes": dict(self.bytes),
            "bandwidth": {k: b.as_dict() for k, b in self.bandwidth.items()},
            "counters": dict(self.counters), "gauges": dict(self.gauges),
            **({"extra": dict(self.extra)} if self.extra else {}),
        }

    def __str__(self) -> str:
        head = (f"step {self.step}" if self.steps == 1
                else f"steps ..{self.step} (n={self.steps})")
        parts = [f"{head} {self.wall_s * 1e3:.1f}ms" + (" SKIPPED" if self.skipped else "")]
        ranked = sorted(self.phases.items(), key=lambda kv: -kv[1])
        shown = [f"{k} {self.share(k) * 100:.0f}%" for k, v in ranked if v > 0][:4]
        if shown:
            parts.append(" ".join(shown))
        rates = []
        for name, bw in self.bandwidth.items():
            if bw.gbps is None:
                continue
            peak = f"/{bw.peak_gbps:.1f}" if bw.peak_gbps else ""
            rates.append(f"{name} {bw.gbps:.2f}{peak}GB/s")
        if rates:
            parts.append(" ".join(rates))
        mem = [f"{short} {_gib(self.gauges[k])}" for k, short in _MEMORY_GAUGES
               if k in self.gauges]
        if mem:
            parts.append(" ".join(mem))
        counted = [f"{k}={v}" for k, v in self.counters.items() if v]
        if counted:
            parts.append(" ".join(counted))
        return " | ".join(parts)


_MEMORY_GAUGES = (("host_rss", "rss"), ("pinned_bytes", "pinned"), ("device_mem", "dev"))


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f}G"


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by ``(start, end)`` intervals, overlaps counted once."""
    total = 0.0
    cur_start = cur_end = None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        elif end > cur_end:
            cur_end = end
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def bandwidth_of(nbytes: int, busy_s: float, peak_gbps: float | None) -> Bandwidth:
    gbps = nbytes / busy_s / _GB if nbytes > 0 and busy_s > 0 else None
    return Bandwidth(nbytes=nbytes, busy_s=busy_s, gbps=gbps, peak_gbps=peak_gbps)
