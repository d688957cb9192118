"""``tierstate bench overhead``: the step A/B at one block's size, and ``--per-call``."""
from __future__ import annotations

import argparse
import json
import math

from tierstate.bench import overhead


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    overhead.add_arguments(parser)
    return parser.parse_args(argv)


def test_per_call_prices_every_telemetry_call_and_a_step(tmp_path, capsys):
    path = tmp_path / "calls.json"
    assert overhead.main(_parse(["--per-call", "--iters", "200", "--repeats", "3", "--json", str(path)])) == 0
    out = capsys.readouterr().out
    figures = json.loads(path.read_text())
    names = ("phase (disabled)", "phase", "phase, nested pair", "add_phase_time", "add_bytes", "count", "set_gauge",
             "end_step+begin_step", "phase (tracing)", "set_gauge (tracing)", "phase (torch profiler on)")
    assert sorted(figures["per_call_us"]) == sorted(names)
    assert all(math.isfinite(v) for v in figures["per_call_us"].values())
    calls = figures["per_call_us"]
    assert figures["per_step_us"] == 200 * (calls["phase"] + calls["add_bytes"]) + calls["end_step+begin_step"]
    for name in names:
        assert f"{name:<28}" in out
    assert "estimate: 200 phases" in out


def test_per_call_refuses_bad_counts(capsys):
    assert overhead.main(_parse(["--per-call", "--iters", "0"])) == 2
    assert "--iters" in capsys.readouterr().out


def test_step_ab_times_kernel_and_optimizer_with_and_without_telemetry(tmp_path, capsys):
    path = tmp_path / "ab.json"
    assert overhead.main(_parse(["--layers", "1", "--reps", "2", "--warmup", "1", "--json", str(path)])) == 0
    figures = json.loads(path.read_text())
    assert sorted(figures["times_s"]) == ["kernel", "opt", "opt-no-telemetry"]
    assert all(len(v) == 2 for v in figures["times_s"].values())
    assert figures["params"] == sum(overhead.gpt2_shapes(1))
    assert "telemetry overhead:" in capsys.readouterr().out
