"""benchmarks/generate_vs_accelerate.py end to end at a tiny size: every mode runs in its own
process, Accelerate's disk offload really reads from disk in the cold mode, and both sides
produce the same greedy tokens."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "generate_vs_accelerate.py"


def test_tiny_run_same_tokens_and_floor(tmp_path):
    out = tmp_path / "out.json"
    r = subprocess.run([sys.executable, str(SCRIPT), "--layers", "4", "--hidden", "256", "--intermediate", "512",
                        "--heads", "4", "--batch", "2", "--prompt-len", "4", "--new-tokens", "3", "--ram-layers", "1",
                        "--repeats", "1", "--json", str(out)], capture_output=True, text=True, timeout=900,
                       env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE"))
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    modes = res["modes"]
    assert modes["accelerate_cold"]["same_tokens"] and modes["accelerate_warm"]["same_tokens"]
    runs = {run["mode"]: run for run in res["runs"]}
    assert runs["accelerate_cold"]["disk_layers"] == 3 == runs["accelerate_cold"]["dropped_layers"]
    # tierstate reads its 3 NVMe layers once per token step: the parameters' bytes, plus at most
    # the 64-byte alignment of each parameter and the 4 KiB alignment of each record
    per_step = runs["tierstate"]["stats"]["weight_read_bytes"] / 3
    assert res["weight_bytes_per_step"] <= per_step <= res["weight_bytes_per_step"] + 3 * (4096 + 64 * 16)
    assert res["disk_floor_tokens_per_s"] > 0
