"""``tierstate bench step`` (``--offload cpu``) at a tiny size, and the timing loop both tiers share."""
from __future__ import annotations

import argparse
import json

from bench_helpers import parse_with
from tierstate.bench import step
from tierstate.bench._timing import interleave


def _parse(argv: list[str]) -> argparse.Namespace:
    return parse_with(step, argv)


_TINY = ["--sizes", "64k", "--threads", "1", "--reps", "2", "--warmup", "1", "--gap-ms", "0",
         "--variants", "native,torch-fused+casts,floor"]


def test_json_without_a_path_replaces_the_table(capsys):
    assert step.main(_parse([*_TINY, "--json"])) == 0
    out = capsys.readouterr().out
    figures = json.loads(out)  # the whole of standard output is the JSON
    assert [r["variant"] for r in figures["rows"]] == ["native", "torch-fused+casts", "floor"]
    assert all(r["params"] == 64_000 and r["median_ms"] > 0 for r in figures["rows"])
    floor = next(r for r in figures["rows"] if r["variant"] == "floor")
    assert floor["vs_floor"] == 1.0


def test_json_to_a_path_comes_with_the_table(tmp_path, capsys):
    path = tmp_path / "step.json"
    assert step.main(_parse([*_TINY, "--json", str(path)])) == 0
    out = capsys.readouterr().out
    assert "native = " in out and "x floor" in out
    assert len(json.loads(path.read_text())["rows"]) == 3


def test_compressed_variants_are_held_to_the_floor_of_their_own_bytes(capsys):
    argv = ["--sizes", "64k", "--threads", "1", "--reps", "2", "--warmup", "1", "--gap-ms", "0",
            "--variants", "native,native-q8,native-fp8,native-fp8-sr,native-fp8-kahan,floor", "--json"]
    assert step.main(_parse(argv)) == 0
    rows = {r["variant"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    # grad 2 + (codes 2 + scales 8/256 + master 4, or 2 for bf16_sr) read and written + weight out 2
    assert rows["native-fp8"]["bytes_per_param"] == rows["native-q8"]["bytes_per_param"] == 16.0625
    # a bf16 master is the bf16 weight, in place: grad 2 + (codes, scales, weight [, comp]) x 2
    assert rows["native-fp8-sr"]["bytes_per_param"] == 10.0625
    assert rows["native-fp8-kahan"]["bytes_per_param"] == 14.0625
    for name, r in rows.items():
        # the floor of its own bytes is the floor row's time scaled by B/param / 28
        assert abs(r["vs_own_floor"] - r["vs_floor"] * 28 / r["bytes_per_param"]) < 1e-9, name
    assert rows["floor"]["vs_own_floor"] == 1.0
    assert step.main(_parse(["--sizes", "64k", "--variants", "native-fp8"])) == 2
    assert "add floor" in capsys.readouterr().err


def test_interleave_times_each_call_once_per_round_and_runs_the_hooks_outside():
    log = []
    calls = {name: (lambda name=name: log.append(name)) for name in ("a", "b", "c")}
    times = interleave(calls, rounds=3, warmup=2, label="test", alternate=True,
                       before_timed=lambda: log.append("before"), after_round=lambda: log.append("after"))
    assert {name: len(t) for name, t in times.items()} == {"a": 3, "b": 3, "c": 3}
    assert all(t >= 0 for ts in times.values() for t in ts)
    # warm-up rounds in order; timed rounds alternate, starting in order
    assert log == ["a", "b", "c"] * 2 + ["before"] + ["a", "b", "c", "after", "c", "b", "a", "after",
                                                      "a", "b", "c", "after"]
