"""``benchmarks/e2e.py``: the DeepSpeed modes run through tierstate bench e2e's orchestrator, and
where DeepSpeed does not import they say so while the other modes still run."""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys

import pytest
from benchmark_scripts import load

from tierstate._native_loader import native_status

peers_e2e = load("e2e")


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    peers_e2e.add_arguments(parser)
    return parser.parse_args(argv)


def test_deepspeed_modes_report_whether_they_could_run(tmp_path):
    ok, why = native_status()
    if not ok:
        pytest.skip(f"tierstate._native did not load: {why}")
    out = tmp_path / "e2e.json"
    args = _parse(["--tiny", "--modes", "torch,cpu,ds_z2_cpu", "--precision", "bf16", "--steps", "2", "--warmup", "1",
                   "--repeats", "1", "--threads", "1", "--json", str(out), "--nvme-dir", str(tmp_path / "nvme"),
                   "--peers-python", sys.executable, "--timeout", "300"])
    assert peers_e2e.main(args) == 0
    report = json.loads(out.read_text())
    status = report["summaries"]["ds_z2_cpu"]["status"]
    if importlib.util.find_spec("deepspeed") is None:
        assert status.startswith("not importable")
    else:
        assert status == "ok"
    for mode in ("torch", "cpu"):
        assert report["summaries"][mode]["status"] == "ok" and report["summaries"][mode]["total"]["n"] == 2
    by_name = {t["target"]: t for t in report["targets"]}
    # the targets against DeepSpeed are there, with no verdict off the targets' model shape
    assert "cpu vs DeepSpeed ZeRO-2 CPU" in by_name and by_name["cpu vs DeepSpeed ZeRO-2 CPU"]["met"] is None


def test_modes_are_tierstate_bench_e2e_s_and_deepspeed_s(capsys):
    assert _parse(["--modes", "nvme_bf16_bwd,ds_z3_nvme"]).modes == ["nvme_bf16_bwd", "ds_z3_nvme"]
    with pytest.raises(SystemExit):
        _parse(["--modes", "torch,zero9"])
    err = capsys.readouterr().err
    assert "--modes" in err and "zero9" in err and "ds_z3_nvme" in err
