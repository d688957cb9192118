"""scripts/gpu_check.sh, the one prepared run for a machine with a GPU, run here on the CPU
(``DEVICE=cpu``: the same parts, tiny sizes): every part runs under its own limit, a part
that fails or runs out of time does not stop the others, and the summary comes last."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench_helpers import require_native

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.sh"


def _run(tmp_path: Path, **env) -> tuple[subprocess.CompletedProcess, Path]:
    require_native()
    out = tmp_path / "out"
    full = {**os.environ, "DEVICE": "cpu", "SKIP_BUILD": "1", "OUT": str(out), "PYTHON": sys.executable, **env}
    proc = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=full, timeout=600)
    return proc, out


def test_every_part_runs_and_the_summary_comes_last(tmp_path):
    proc, out = _run(tmp_path, TESTS_S="1")  # too short for pytest to start: that part times out
    assert proc.returncode == 0, proc.stderr
    summary = (out / "summary.txt").read_text()
    assert "cuda_tests: TIMED OUT" in summary
    assert "bench: ok" in summary and "probe: ok" in summary, summary  # the parts after it still ran
    assert json.loads((out / "hardware.json").read_text())
    tail = proc.stdout[proc.stdout.rindex("== summary"):]
    assert "bench: ok" in tail and "| tiny | cpu | ok |" in tail
    report = json.loads((out / "bench.json").read_text())
    assert {r["mode"]: r["status"] for r in report["results"]}["cpu"] == "ok"
    assert (out / "versions.txt").read_text().startswith("python ")
    assert not (out / "nvme").exists()
