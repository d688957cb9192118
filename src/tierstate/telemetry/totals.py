"""Cumulative stats over the steps of a run: what :meth:`Telemetry.totals
<tierstate.telemetry.recorder.Telemetry.totals>` sums."""
from __future__ import annotations

from collections import defaultdict
from typing import Any

from .phases import CHANNELS
from .stats import Bandwidth, StepStats


def empty_totals() -> dict[str, Any]:
    return {"steps": 0, "step": 0, "wall_s": 0.0, "phases": defaultdict(float),
            "lanes": defaultdict(lambda: defaultdict(float)), "bytes": defaultdict(int),
            "counters": defaultdict(int), "gauges": {}, "gauge_max": {},
            "bandwidth": {}}


def accumulate(t: dict[str, Any], s: StepStats) -> None:
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
