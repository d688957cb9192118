"""Micro-measurement of what telemetry costs: ``python -m tierstate.telemetry.overhead``.

Prints the cost in µs of each recording call (median of ``--repeats`` runs of
``--iters`` calls each, minus an empty loop), then what a step with ``--phases`` phases
and ``--step-ms`` of work would pay, as a fraction of the step.

Why per-call costs and not an on/off A/B of a synthetic step: on the 2-core dev machine
an A/B of identical fixed work swung by 5-8 % in either direction (the order of the
pair, memory-bandwidth flips), hiding a ~1 % effect; per-call costs times call counts
are stable to ~20 %. The end-to-end check belongs to the optimizer benchmark.

Not a test: timings on a shared machine are noisy, so the numbers are medians to read,
not thresholds to assert.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from typing import Callable

from .recorder import Telemetry


def _per_call_us(body: Callable[[int], None], iters: int, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        body(iters)
        samples.append((time.perf_counter() - t0) / iters * 1e6)
    return statistics.median(samples)


def measure(iters: int = 20_000, repeats: int = 7) -> dict[str, float]:
    """Per-call cost in µs of each telemetry operation, empty-loop time subtracted."""
    tel = Telemetry(log_every=0)
    off = Telemetry(enabled=False, log_every=0)
    tel.begin_step(0)

    def empty(n):
        for _ in range(n):
            pass

    def phase(n, t=tel):
        for _ in range(n):
            with t.phase("cpu_update"):
                pass

    def nested(n):
        for _ in range(n):
            with tel.phase("cpu_update"):
                with tel.phase("nvme_wait"):
                    pass

    def add_bytes(n):
        for _ in range(n):
            tel.add_bytes("nvme", "read", 4096)

    def add_phase_time(n):
        for _ in range(n):
            tel.add_phase_time("nvme_read", 1e-4, lane="io0")

    def count(n):
        for _ in range(n):
            tel.count("nonfinite_grads")

    def set_gauge(n):
        for _ in range(n):
            tel.set_gauge("pinned_bytes", 1.0)

    def step(n):
        for i in range(n):
            tel.end_step()
            tel.begin_step(i)

    base = _per_call_us(empty, iters, repeats)
    out = {
        "phase (disabled)": _per_call_us(lambda n: phase(n, off), iters, repeats) - base,
        "phase": _per_call_us(phase, iters, repeats) - base,
        "phase, nested pair": _per_call_us(nested, iters, repeats) - base,
        "add_phase_time": _per_call_us(add_phase_time, iters, repeats) - base,
        "add_bytes": _per_call_us(add_bytes, iters, repeats) - base,
        "count": _per_call_us(count, iters, repeats) - base,
        "set_gauge": _per_call_us(set_gauge, iters, repeats) - base,
        "end_step+begin_step": _per_call_us(step, max(1, iters // 20), repeats) - base,
    }
    with tempfile.TemporaryDirectory() as d:
        tel.start_trace(f"{d}/overhead.json")
        out["phase (tracing)"] = _per_call_us(phase, iters, repeats) - base
        out["set_gauge (tracing)"] = _per_call_us(set_gauge, iters, repeats) - base
        tel.stop_trace()
    import torch.profiler
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        out["phase (torch profiler on)"] = _per_call_us(phase, max(1, iters // 10),
                                                        repeats) - base
    tel.end_step()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tierstate.telemetry.overhead",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--phases", type=int, default=200,
                        help="phases per step for the estimate (default 200: ~4 per "
                        "sub-group x 50 sub-groups)")
    parser.add_argument("--step-ms", type=float, default=100.0,
                        help="step time for the estimate, ms (default 100)")
    args = parser.parse_args(argv)
    if args.iters <= 0 or args.repeats <= 0 or args.phases < 0 or args.step_ms <= 0:
        parser.error("--iters, --repeats and --step-ms must be positive, --phases >= 0")
    costs = measure(args.iters, args.repeats)
    for name, us in costs.items():
        print(f"{name:<28} {us:8.2f} µs")
    per_step_us = (args.phases * (costs["phase"] + costs["add_bytes"])
                   + costs["end_step+begin_step"])
    print(f"estimate: {args.phases} phases (+ one add_bytes each) and one step boundary = "
          f"{per_step_us:.0f} µs, {per_step_us / (args.step_ms * 1e3):.2%} of a "
          f"{args.step_ms:g} ms step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
