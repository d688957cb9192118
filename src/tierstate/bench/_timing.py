"""The timing and reporting both halves of ``tierstate bench step`` share."""
from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable

from ..placement.model_spec import parse_count
from ..telemetry.progress import progress

# ``--json`` given without a path: the figures go to standard output instead of the tables.
JSON_STDOUT = "-"


def interleave(calls: dict[str, Callable[[], object]], rounds: int, warmup: int, label: str, *,
               gap_ms: float = 0.0, alternate: bool = False, before_timed: Callable[[], None] | None = None,
               after_round: Callable[[], None] | None = None,
               before_call: dict[str, Callable[[], None]] | None = None) -> dict[str, list[float]]:
    """Seconds of each call of ``calls``, round-robin: ``warmup`` untimed rounds, then ``rounds``
    timed ones, every variant once per round, so that all of them see the same phase of the
    machine (memory bandwidth on the reference VM moves by ~1.7x within seconds).

    ``gap_ms``: sleep before every call (see ``tierstate bench step``'s note on OpenMP's
    spin-wait). ``alternate``: every other timed round runs in reversed order, so that no
    variant always follows the same one. ``before_timed`` runs once before the first timed
    round and ``after_round`` after each timed round, and ``before_call[name]`` before every
    call of ``name``, all outside the timed calls."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    with progress(warmup + rounds, label) as advance:
        for rnd in range(warmup + rounds):
            timed = rnd >= warmup
            if rnd == warmup and before_timed is not None:
                before_timed()
            flip = alternate and timed and (rnd - warmup) % 2 == 1
            for name in (names[::-1] if flip else names):
                call = calls[name]
                if before_call and name in before_call:
                    before_call[name]()
                if gap_ms > 0:
                    time.sleep(gap_ms / 1e3)  # let the previous variant's spinning threads sleep
                t0 = time.perf_counter()
                call()
                elapsed = time.perf_counter() - t0
                if timed:
                    times[name].append(elapsed)
            if timed and after_round is not None:
                after_round()
            advance()  # between rounds, outside every timed region
    return times


def load_average() -> str:
    """The 1, 5 and 15-minute load averages, as ``uptime`` prints them ("n/a" where unknown)."""
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def emit_json(destination: str | None, figures: object) -> None:
    """Write ``figures`` where ``--json`` asked: a path, or :data:`JSON_STDOUT` (which then
    replaces the tables); nothing without ``--json``."""
    if destination == JSON_STDOUT:
        print(json.dumps(figures, indent=2))
    elif destination is not None:
        with open(destination, "w") as f:
            json.dump(figures, f, indent=2)


def positive_int(text: str) -> int:
    """An integer >= 1 (an argparse type)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive integer")
    return value


def non_negative_int(text: str) -> int:
    """An integer >= 0 (an argparse type)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected an integer >= 0")
    return value


def count_arg(text: str) -> int:
    """'100M' -> 100_000_000; '1.5G', '250k' and plain integers too (an argparse type)."""
    try:
        return parse_count(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def counts_arg(text: str) -> list[int]:
    """'100M,400M' -> [100_000_000, 400_000_000]: one run per size (an argparse type)."""
    return [count_arg(part) for part in text.split(",") if part.strip()] or [count_arg(text)]
