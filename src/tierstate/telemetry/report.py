"""``tierstate report TRACE``: plots and a bottleneck summary from a tierstate trace.

Writes into ``--out`` (default: ``<trace>_report/`` beside the trace):

- ``timeline.png`` — the last ``--steps`` steps as a Gantt chart: one row per lane, one
  colour per phase, nested phases drawn inside their parents, waits hatched; overlap
  between lanes and stalls on the main lane are visible at a glance;
- ``memory.png`` — every memory counter (host RSS, pinned, device, NVMe bytes, ...) over
  the whole trace, in GiB;
- ``summary.txt`` — critical-path share per phase, busy time per background lane,
  achieved vs probed bandwidth, and the bottleneck named; also printed.

Run as ``python -m tierstate.telemetry.report TRACE [--out DIR] [--steps N]``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from .phases import CHANNELS, OTHER, PHASES, RENAMED_PHASES
from .trace import TraceFormatError, load_trace, validate_trace

# Which channel's bandwidth explains a phase when it is the bottleneck: a wait is
# explained by the link it waits on.
_PHASE_CHANNELS = {
    "cpu_update": ("host/rw",),
    "grad_transfer": ("device/d2h",), "grad_wait": ("device/d2h",),
    "weight_upload": ("device/h2d",),
    "nvme_read": ("nvme/read",), "nvme_write": ("nvme/write",),
    "nvme_wait": ("nvme/read", "nvme/write"),
}
_WAITS = ("grad_wait", "nvme_wait", "device_stall")
_MEMORY_WORDS = ("rss", "pinned", "mem", "bytes")


@dataclass
class _Lane:
    name: str
    tid: int
    sort_index: int
    # (start_us, end_us, phase, depth)
    slices: list[tuple[float, float, str, int]] = field(default_factory=list)
    self_us: dict[str, float] = field(default_factory=lambda: defaultdict(float))


@dataclass
class TraceData:
    """A tierstate trace parsed for plotting."""

    lanes: list[_Lane]
    steps: list[dict[str, Any]]           # step-slice args + "ts"/"dur" in µs
    counters: dict[str, list[tuple[float, float]]]
    main_lane: str
    peaks: dict[str, float]
    span_us: tuple[float, float]


def parse_trace(obj: dict[str, Any]) -> TraceData:
    """Group a trace object's events by lane, with depth and self time per slice."""
    events = obj.get("traceEvents", [])
    meta = (obj.get("otherData") or {}).get("tierstate") or {}
    names: dict[tuple[int, int], str] = {}
    order: dict[tuple[int, int], int] = {}
    raw: dict[tuple[int, int], list[tuple[float, float, str, str, dict]]] = defaultdict(list)
    counters: dict[str, list[tuple[float, float]]] = defaultdict(list)
    lo, hi = float("inf"), float("-inf")
    for ev in events:
        ph = ev.get("ph")
        key = (ev.get("pid"), ev.get("tid"))
        if ph == "M" and ev.get("name") == "thread_name":
            names[key] = ev["args"]["name"]
        elif ph == "M" and ev.get("name") == "thread_sort_index":
            order[key] = ev["args"]["sort_index"]
        elif ph == "X":
            start, end = ev["ts"], ev["ts"] + ev["dur"]
            args = ev.get("args") or {}
            if ev.get("cat") == "step" and isinstance(args.get("phases"), dict):
                args = {**args, "phases": _current_names(args["phases"])}
            name = RENAMED_PHASES.get(ev["name"], ev["name"])
            raw[key].append((start, end, name, ev.get("cat", ""), args))
            lo, hi = min(lo, start), max(hi, end)
        elif ph == "C":
            for series, value in ev["args"].items():
                label = ev["name"] if series == "value" else f"{ev['name']}/{series}"
                counters[label].append((ev["ts"], value))
                lo, hi = min(lo, ev["ts"]), max(hi, ev["ts"])
    lanes: list[_Lane] = []
    steps: list[dict[str, Any]] = []
    for key, slices in raw.items():
        lane = _Lane(names.get(key, f"tid {key[1]}"), key[1], order.get(key, key[1]))
        slices.sort(key=lambda s: (s[0], -s[1]))
        stack: list[list] = []   # [end, phase, child_us, dur]
        for start, end, name, cat, args in slices:
            while stack and stack[-1][0] <= start:
                _close(lane, stack.pop())
            if cat == "step":
                steps.append({**args, "ts": start, "dur": end - start})
                stack.append([end, None, 0.0, end - start])
                continue
            depth = sum(1 for s in stack if s[1] is not None)
            if stack:
                stack[-1][2] += end - start
            lane.slices.append((start, end, name, depth))
            stack.append([end, name, 0.0, end - start])
        while stack:
            _close(lane, stack.pop())
        lanes.append(lane)
    lanes.sort(key=lambda ln: (ln.sort_index, ln.name))
    steps.sort(key=lambda s: s["ts"])
    for series in counters.values():
        series.sort()
    if lo > hi:
        lo = hi = 0.0
    return TraceData(lanes, steps, dict(counters), meta.get("main_lane", "main"),
                     dict(meta.get("peaks_gbps") or {}), (lo, hi))


def _current_names(phases: dict[str, float]) -> dict[str, float]:
    """A step's phase totals with old phase names (see RENAMED_PHASES) under the current ones."""
    out: dict[str, float] = defaultdict(float)
    for name, secs in phases.items():
        out[RENAMED_PHASES.get(name, name)] += secs
    return dict(out)


def _close(lane: _Lane, frame: list) -> None:
    end, name, child_us, dur = frame
    if name is not None:
        lane.self_us[name] += dur - child_us


# ---------------------------------------------------------------------------------------
# Summary
# ---------------------------------------------------------------------------------------

def summarize(data: TraceData, trace_path: str = "") -> str:
    """The text summary: critical path, lanes, bandwidth, and the bottleneck named."""
    lines = [f"tierstate trace report: {trace_path}".rstrip(": ")]
    steps = data.steps
    if not steps:
        lines.append("no tierstate step slices in this trace (was a step ended while "
                     "tracing?); lane busy times only:")
        lines += _lane_lines(data, wall_us=data.span_us[1] - data.span_us[0])
        return "\n".join(lines) + "\n"
    walls = [s["wall_s"] for s in steps]
    wall = sum(walls)
    skipped = sum(1 for s in steps if s.get("skipped"))
    lines.append(f"steps: {len(steps)} (skipped {skipped}); step time median "
                 f"{statistics.median(walls) * 1e3:.2f} ms, mean "
                 f"{wall / len(steps) * 1e3:.2f} ms, total {wall:.3f} s")
    phases: dict[str, float] = defaultdict(float)
    for s in steps:
        for k, v in (s.get("phases") or {}).items():
            phases[k] += v
    lines.append(f"critical path on lane '{data.main_lane}' (share of step time; phases "
                 "plus 'other' sum to 100%):")
    for name, secs in sorted(phases.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {name:<14} {secs / wall:7.1%}  {secs * 1e3:10.2f} ms")
    lines.append("lanes (self time per phase, share of total step time):")
    lines += _lane_lines(data, wall_us=wall * 1e6)
    bandwidth = _bandwidth(steps, data.peaks)
    if bandwidth:
        lines.append("bandwidth (bytes / time the channel's phase was running on any lane):")
        for name, (nbytes, busy, gbps, peak) in bandwidth.items():
            lines.append(f"  {name:<11} {nbytes / 2**30:9.3f} GiB  " + _rate(gbps, peak))
    name, secs = max(phases.items(), key=lambda kv: kv[1])
    lines.append(_bottleneck_line(name, secs / wall, data.main_lane, bandwidth))
    return "\n".join(lines) + "\n"


def _lane_lines(data: TraceData, wall_us: float) -> list[str]:
    out = []
    for lane in data.lanes:
        busy = sorted(lane.self_us.items(), key=lambda kv: -kv[1])
        if not busy:
            continue
        parts = [f"{k} {v / wall_us:.0%}" if wall_us > 0 else f"{k} {v / 1e3:.1f}ms"
                 for k, v in busy]
        out.append(f"  {lane.name:<14} " + ", ".join(parts))
    return out


def _bandwidth(steps: list[dict], peaks: dict[str, float]) -> dict[str, tuple]:
    totals: dict[str, list[float]] = {}
    for s in steps:
        for name, b in (s.get("bandwidth") or {}).items():
            t = totals.setdefault(name, [0, 0.0])
            t[0] += b.get("bytes", 0)
            t[1] += b.get("busy_s", 0.0)
    out = {}
    for ch in CHANNELS:
        if ch.name not in totals:
            continue
        nbytes, busy = totals[ch.name]
        if not nbytes:
            continue
        gbps = nbytes / busy / 1e9 if nbytes and busy else None
        out[ch.name] = (nbytes, busy, gbps, peaks.get(ch.peak_key))
    return out


def _rate(gbps: float | None, peak: float | None) -> str:
    if gbps is None:
        return "n/a GB/s"
    if not peak:
        return f"{gbps:.2f} GB/s (no probed peak)"
    return f"{gbps:.2f} GB/s of {peak:.2f} GB/s peak ({gbps / peak:.0%})"


def _bottleneck_line(phase: str, share: float, main_lane: str,
                     bandwidth: dict[str, tuple]) -> str:
    head = f"bottleneck: {phase} on lane '{main_lane}', {share:.0%} of the critical path"
    if phase == OTHER:
        return head + " (time in no phase: Python bookkeeping, hooks, scheduling)"
    rates = [f"{ch} {_rate(bandwidth[ch][2], bandwidth[ch][3])}"
             for ch in _PHASE_CHANNELS.get(phase, ()) if ch in bandwidth]
    what = PHASES.get(phase, "")
    tail = f"; {'; '.join(rates)}" if rates else ""
    wait = " (a wait: the link it waits on is the bottleneck)" if phase in _WAITS else ""
    return f"{head}{wait}{tail}\n  {phase}: {what}"


# ---------------------------------------------------------------------------------------
# Plots
# ---------------------------------------------------------------------------------------

# One distinct colour per phase, so nested phases stand apart from their parents; the
# waits are the warm reds and are hatched too.
_COLOURS = {
    "grad_transfer": "tab:blue", "grad_wait": "tab:pink", "grad_norm": "tab:olive",
    "cpu_update": "tab:orange", "nvme_read": "tab:green", "nvme_write": "tab:cyan",
    "nvme_wait": "tab:red", "weight_upload": "tab:purple", "device_update": "gold",
    "device_stall": "tab:brown",
}


def _phase_colours() -> dict[str, Any]:
    from matplotlib import colormaps
    extra = colormaps["tab20"]
    registered = [p for p in PHASES if p != OTHER and p not in _COLOURS]
    return {**_COLOURS, **{name: extra(2 * i % 20 + 1) for i, name in enumerate(registered)}}


def plot_timeline(data: TraceData, path: str, last_steps: int = 6) -> str:
    """Gantt chart of the last ``last_steps`` steps (0: the whole trace) into ``path``."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    lo, hi = data.span_us
    shown = data.steps[-last_steps:] if last_steps and data.steps else data.steps
    if shown:
        lo, hi = shown[0]["ts"], shown[-1]["ts"] + shown[-1]["dur"]
        pad = 0.02 * (hi - lo)
        lo, hi = lo - pad, hi + pad
    colours = _phase_colours()
    lanes = data.lanes
    fig = Figure(figsize=(12, 1.6 + 0.55 * max(1, len(lanes))), dpi=100)
    ax = fig.add_subplot()
    used: dict[str, Any] = {}
    for row, lane in enumerate(lanes):
        y = len(lanes) - 1 - row
        if lane.name == data.main_lane:
            for s in data.steps:
                if s["ts"] + s["dur"] >= lo and s["ts"] <= hi:
                    ax.broken_barh([((s["ts"] - lo) / 1e3, s["dur"] / 1e3)], (y - 0.45, 0.9),
                                   facecolors="none", edgecolors="0.35", linewidth=0.8)
        for start, end, name, depth in sorted(lane.slices, key=lambda s: s[3]):
            if end < lo or start > hi:
                continue
            height = max(0.2, 0.8 - 0.18 * depth)
            colour = colours.get(name, "0.6")
            used[name] = colour
            ax.broken_barh([((start - lo) / 1e3, max((end - start) / 1e3, 1e-6))],
                           (y - height / 2, height), facecolors=colour,
                           edgecolors="black", linewidth=0.3,
                           hatch="///" if name in _WAITS else None)
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels([ln.name for ln in reversed(lanes)])
    ax.set_xlim(0, max((hi - lo) / 1e3, 1e-3))
    ax.set_ylim(-0.7, len(lanes) - 0.3)
    ax.set_xlabel("time (ms)")
    title = "tierstate step timeline"
    if shown:
        title += f": steps {shown[0].get('step')}..{shown[-1].get('step')} (outlined)"
    ax.set_title(title)
    ax.grid(axis="x", alpha=0.3)
    if used:
        ax.legend(handles=[Patch(facecolor=c, edgecolor="black",
                                 hatch="///" if n in _WAITS else None, label=n)
                           for n, c in used.items()],
                  loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    return path


def plot_memory(data: TraceData, path: str) -> str:
    """Memory counters (GiB) over the trace's time into ``path``."""
    from matplotlib.figure import Figure

    series = {k: v for k, v in data.counters.items()
              if any(w in k.lower() for w in _MEMORY_WORDS)}
    fig = Figure(figsize=(12, 4), dpi=100)
    ax = fig.add_subplot()
    lo = data.span_us[0]
    for name, points in sorted(series.items()):
        xs = [(t - lo) / 1e6 for t, _ in points]
        ys = [v / 2**30 for _, v in points]
        ax.step(xs, ys, where="post", label=name, linewidth=1.5, marker="." if
                len(points) < 50 else None)
    if not series:
        ax.text(0.5, 0.5, "no memory counters in this trace", ha="center", va="center",
                transform=ax.transAxes)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("GiB")
    ax.set_ylim(bottom=0)
    ax.set_title("memory per tier")
    ax.grid(alpha=0.3)
    if series:
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    return path


# ---------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``report`` options to ``parser``."""
    parser.add_argument("trace", help="a trace JSON written by tierstate "
                        "(Telemetry.start_trace or TIERSTATE_TRACE)")
    parser.add_argument("--out", default=None,
                        help="folder for timeline.png, memory.png, summary.txt "
                        "(default: <trace>_report beside the trace)")
    parser.add_argument("--steps", type=int, default=6,
                        help="how many of the last steps the timeline shows (0: all; "
                        "default 6)")


def main(args: argparse.Namespace) -> int:
    """Run the report; returns the process exit code (0 ok, 1 unreadable trace)."""
    if args.steps < 0:
        print(f"tierstate report: --steps must be >= 0, got {args.steps}", file=sys.stderr)
        return 1
    try:
        obj = load_trace(args.trace)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        print(f"tierstate report: cannot read trace {args.trace}: {e}", file=sys.stderr)
        return 1
    try:
        validate_trace(obj)
    except TraceFormatError as e:
        if not isinstance(obj.get("traceEvents"), list):
            print(f"tierstate report: {args.trace}: {e}", file=sys.stderr)
            return 1
        print(f"tierstate report: warning: {args.trace}: {e}", file=sys.stderr)
    out = args.out or os.path.splitext(args.trace)[0] + "_report"
    os.makedirs(out, exist_ok=True)
    data = parse_trace(obj)
    summary = summarize(data, args.trace)
    paths = [plot_timeline(data, os.path.join(out, "timeline.png"), args.steps),
             plot_memory(data, os.path.join(out, "memory.png"))]
    summary_path = os.path.join(out, "summary.txt")
    with open(summary_path, "w") as f:
        f.write(summary)
    print(summary, end="")
    print("wrote " + ", ".join(paths + [summary_path]))
    return 0


def _cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="python -m tierstate.telemetry.report",
                                     description=__doc__.split("\n")[0])
    add_arguments(parser)
    return main(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(_cli())
