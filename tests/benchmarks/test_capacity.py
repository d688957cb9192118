"""benchmarks/capacity.py: its parameter arithmetic against transformers' models, and a run at the
tiny size end to end (figures written, both NVMe folders removed)."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from benchmark_scripts import BENCHMARKS, load

transformers = pytest.importorskip("transformers")
pytest.importorskip("psutil")
capacity = load("capacity")


@pytest.mark.parametrize("size", sorted(capacity.SIZES))
def test_parameter_count_is_the_models(size):
    cfg = capacity.llama_config(size)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    assert capacity.param_count(cfg) == sum(p.numel() for p in model.parameters())
    if size == "7b":
        assert capacity.param_count(cfg) >= 6.7e9  # Llama-2-7B's 6.74e9


@pytest.mark.parametrize("moments,record_bytes", [("bf16", 4.0), ("q8", 2 * (1 + 4 / 256))])
def test_a_tiny_run_reports_its_figures_and_removes_its_folders(tmp_path, moments, record_bytes):
    out = tmp_path / "r.json"
    work = tmp_path / "cap"
    r = subprocess.run([sys.executable, str(BENCHMARKS / "capacity.py"), "--size", "tiny", "--dir", str(work),
                        "--steps", "2", "--seq", "16", "--no-bench-io", "--moment-dtype", moments, "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads(out.read_text())
    assert [s["step"] for s in rep["steps"]] == [1, 2]
    # the moments are stored as asked (the weights are their own fp32 master: no master bytes)
    assert rep["moment_dtype"] == moments
    gauges = rep["steps"][-1]["optimizer"]["gauges"]
    assert gauges["nvme_record_bytes_per_param"] == pytest.approx(record_bytes, rel=5e-3)  # + records' alignment
    assert all(math.isfinite(s["loss"]) for s in rep["steps"])
    # the weights really streamed from the NVMe home: every layer fetched forward and backward
    assert rep["streamer"]["blocks"] == 4 and rep["streamer"]["materializations"] == 2 * 2 * 4
    assert rep["init"]["write_bytes"] >= rep["streamer"]["home_bytes"]["nvme"]
    assert rep["peak_rss_sampled"] > 0 and rep["floor_compute"]["compute_s"] > 0
    assert "summary" in r.stdout and "step / floor" not in r.stdout  # no disk figure: no ratio claimed
    assert sorted(p.name for p in work.iterdir()) == []


def test_refuses_a_folder_without_the_space(tmp_path, capsys):
    # 7b needs 53.9 GB: a 1 MiB tmpfs has far less; refuse before writing anything
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {r.stderr.strip()}")
    try:
        assert capacity.main(["--size", "7b", "--dir", str(mnt)]) == 2
        err = capsys.readouterr().err
        assert "needs 53.9 GB" in err and "6.74 B parameters" in err
        assert list(mnt.iterdir()) == []
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
