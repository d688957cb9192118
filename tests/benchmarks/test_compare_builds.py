"""benchmarks/compare_builds.py: the before/after harness reads what the package's benchmarks write."""
from __future__ import annotations

import json
import statistics
import sys

import pytest

from benchmark_scripts import load

compare = load("compare_builds")


def test_one_round_of_the_host_kernel_bench_gives_a_ratio(capsys, tmp_path):
    out = tmp_path / "figures.json"
    assert compare.main(["--before", sys.executable, "--after", sys.executable, "--rounds", "1", "--benches", "cpu",
                         "--cpu-size", "1M", "--cpu-reps", "1", "--json", str(out)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:2] == ["figure", "before"]
    key = "bench step cpu 1M native kernel, s"
    row = next(line for line in table if line.startswith(key))
    ratio = float(row.split()[-2])
    figures = json.loads(out.read_text())["figures"]
    before, after = (statistics.median(figures[b][key]) for b in ("before", "after"))
    assert before > 0 and after > 0 and ratio == pytest.approx(after / before, abs=1e-3)


@pytest.mark.parametrize("argv, message", [
    (["--benches", "cpu,gpu"], "unknown ['gpu']"),
    (["--rounds", "0"], "--rounds 0"),
])
def test_bad_arguments_are_refused_by_name(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        compare.main(["--before", sys.executable, "--after", sys.executable, *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
