"""benchmarks/quality_curves.py's --resume: a stopped sweep goes on where it stopped."""
from __future__ import annotations

import json
import subprocess
import sys

from benchmark_scripts import BENCHMARKS

TINY = ["--steps", "3", "--models", "demo", "--formats", "fp32 state", "--batch-size", "2", "--seq-len", "8",
        "--eval-batches", "1", "--workers", "1"]


def _sweep(out, *extra):
    return subprocess.run([sys.executable, str(BENCHMARKS / "quality_curves.py"), *TINY, "--out", str(out), *extra],
                          capture_output=True, text=True, timeout=300)


def test_resume_keeps_the_saved_runs_and_runs_only_the_rest(tmp_path) -> None:
    first = _sweep(tmp_path, "--seeds", "1")
    assert first.returncode == 0, first.stderr
    kept = json.loads((tmp_path / "quality_curves.json").read_text())["runs"]
    assert [(r["seed"], r["format"]) for r in kept] == [(0, "fp32 state")]

    more = _sweep(tmp_path, "--seeds", "2", "--resume")
    assert more.returncode == 0, more.stderr
    assert "--resume: 1 runs kept" in more.stdout
    assert "[2/2] demo fp32 state seed 1" in more.stdout  # seed 0 was not run again
    saved = json.loads((tmp_path / "quality_curves.json").read_text())
    assert sorted(r["seed"] for r in saved["runs"]) == [0, 1]
    assert saved["runs"][0] == kept[0], "the kept run is the one saved, as it was"
    table = json.loads((tmp_path / "quality_table.json").read_text())["table"]
    assert table[0]["seeds"] == 2

    refused = _sweep(tmp_path, "--seeds", "3", "--resume", "--lr", "1e-3")
    assert refused.returncode != 0
    assert "other settings (lr)" in refused.stderr and "--out" in refused.stderr
