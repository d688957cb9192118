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
                        "--repeats", "1", "--json", str(out),
                        "--modes", "tierstate,accelerate_cold,accelerate_warm,tierstate_int8,tierstate_lossless"],
                       capture_output=True, text=True, timeout=900, env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE"))
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
    # int8 layers: a byte per weight and an fp32 scale per group of 64, against bf16's 2 bytes
    int8_per_step = runs["tierstate_int8"]["stats"]["weight_read_bytes"] / 3
    assert int8_per_step <= 0.6 * per_step
    assert modes["tierstate_int8"]["speedup_over_accelerate_cold"] > 0
    # lossless layers: the same model, so Accelerate's tokens, from ~0.75x of the bytes
    assert modes["tierstate_lossless"]["same_tokens_as_accelerate_cold"]
    lossless_per_step = runs["tierstate_lossless"]["stats"]["weight_read_bytes"] / 3
    assert lossless_per_step <= 0.8 * per_step


def test_an_unknown_mode_is_refused_before_anything_is_written(tmp_path):
    r = subprocess.run([sys.executable, str(SCRIPT), "--modes", "tierstate,acclerate_cold", "--dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--modes" in r.stderr and "acclerate_cold" in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == []
