"""``benchmarks/weights_vs_zero3.py``: tierstate's weight streaming against DeepSpeed ZeRO-3 on a
tiny Llama, for real (worker processes, files on disk, /proc/<pid>/io); DeepSpeed, a peer that
is not in the test venv, must say why it did not run, and a run that fails must report its error."""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from benchmark_scripts import BENCHMARKS, load

from tierstate._native_loader import native_status

bench = load("weights_vs_zero3")
worker = load("_zero3_worker")


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize("size", sorted(bench.SIZES))
def test_parameter_count_is_the_model_s(size):
    hidden, layers, heads, kv_heads, intermediate, vocab = bench.SIZES[size]
    args = argparse.Namespace(hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
                              intermediate=intermediate, vocab=vocab, seq=256)
    with torch.device("meta"):  # the real module tree, no memory: 7b is 6.7e9 parameters
        model = worker.build_model(args)
    assert bench.llama_params(hidden, layers, heads, kv_heads, intermediate, vocab) == \
        sum(p.numel() for p in model.parameters())


def test_both_modes_train_the_same_model_and_deepspeed_says_whether_it_ran(tmp_path):
    ok, why = native_status()
    if not ok:
        pytest.skip(f"tierstate._native did not load: {why}")
    out = tmp_path / "report.json"
    args = _parse(["--size", "tiny", "--modes", "tierstate,tierstate_after,ds_z3_nvme", "--steps", "2",
                   "--warmup", "1", "--repeats", "1", "--threads", "1",
                   "--nvme-dir", str(tmp_path / "nvme"), "--probe-bytes", "32M", "--json", str(out),
                   "--peers-python", sys.executable, "--timeout", "300"])
    assert bench.main(args) == 0
    report = json.loads(out.read_text())
    ts_summary = report["summaries"]["tierstate"]
    assert ts_summary["status"] == "ok" and ts_summary["total"]["n"] == 2
    (run,) = report["runs"]["tierstate"]
    assert run["files_bytes"] > 0  # the weights and the optimizer state were files under --nvme-dir
    assert run["steps"][0]["weights"]["fetch_bytes"] >= run["block_bytes"]  # and were read back from them
    assert run["peak_rss_steps_bytes"] > 0 and run["disk"]["mean"]["read_gbps"] > 0
    assert not (tmp_path / "nvme" / "tierstate").exists()  # each run's files are removed after it
    (after,) = report["runs"]["tierstate_after"]  # the updates after backward: the same training
    assert after["status"] == "ok"
    assert [s["loss"] for s in after["steps"]] == pytest.approx([s["loss"] for s in run["steps"]], abs=1e-3)
    ds = report["summaries"]["ds_z3_nvme"]
    if importlib.util.find_spec("deepspeed") is None:
        assert ds["status"] == "failed" and ds["error"].startswith("not importable")
        assert report["verdict"] is None
    else:  # same seed, same tokens: the first losses agree to bf16 rounding
        assert ds["status"] == "ok"
        assert abs(ds["first_loss"] - ts_summary["first_loss"]) < 1e-2


def test_a_failed_run_reports_its_error_instead_of_figures(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    out = tmp_path / "result.json"
    argv = [sys.executable, str(BENCHMARKS / "_zero3_worker.py"), "--mode", "tierstate", "--out", str(out),
            "--nvme-dir", str(blocker / "run"), "--hidden", "64", "--layers", "2", "--heads", "2", "--kv-heads", "2",
            "--intermediate", "172", "--vocab", "1024", "--batch", "1", "--seq", "8", "--dtype", "fp32",
            "--steps", "1", "--warmup", "0", "--threads", "1"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    result = json.loads(out.read_text())
    assert result["status"] == "failed" and result["steps"] == []
    assert result["error"].startswith(("NotADirectoryError", "FileExistsError")), result["error"]
    assert str(blocker) in result["error"] and "\n" not in result["error"]
    summary = bench.summarize("tierstate", [result])
    assert summary == {"mode": "tierstate", "status": "failed", "error": result["error"]}
    meta = {"size": "tiny", "nparams": 1, "batch": 1, "seq": 8, "dtype": "fp32", "steps": 1, "warmup": 0,
            "repeats": 1, "threads": 1, "loadavg_start": (0.0,), "loadavg_end": (0.0,)}
    assert f"tierstate: FAILED: {result['error']}" in bench.format_report({"tierstate": summary}, None, meta)


def test_a_size_the_disk_cannot_hold_is_refused_naming_the_size(tmp_path):
    args = _parse(["--size", "7b", "--nvme-dir", str(tmp_path)])
    need = 16 * bench.llama_params(*bench.SIZES["7b"]) + bench.DISK_MARGIN
    if shutil.disk_usage(tmp_path).free >= need:
        pytest.skip("this disk holds a 7B model's DeepSpeed swap files")
    with pytest.raises(ValueError, match=r"--size 7b: .* GB free; pick a smaller --size"):
        bench.main(args)


def test_modes_are_checked_by_name(capsys):
    assert _parse(["--modes", "ds_z3_nvme,tierstate"]).modes == ["ds_z3_nvme", "tierstate"]
    with pytest.raises(SystemExit):
        _parse(["--modes", "tierstate,zero9"])
    err = capsys.readouterr().err
    assert "--modes" in err and "zero9" in err and "ds_z3_nvme" in err


def test_a_run_past_its_timeout_is_killed_and_says_so(tmp_path):
    args = _parse(["--size", "tiny", "--steps", "1", "--warmup", "0", "--threads", "1", "--timeout", "1",
                   "--probe-bytes", "16M"])
    started = time.perf_counter()
    result = bench.run_one(sys.executable, "tierstate", args, tmp_path, tmp_path, "r0")
    assert result["status"] == "failed" and result["error"] == "no result within --timeout 1 s"
    assert time.perf_counter() - started < 60  # killed, not waited for
    assert not (tmp_path / "tierstate").exists()


def test_a_mode_folder_that_exists_already_is_left_alone_and_refused(tmp_path):
    # each run makes <nvme-dir>/<mode> and removes it after: a folder of that name that was
    # there before belongs to someone else, so the benchmark refuses rather than delete it
    theirs = tmp_path / "tierstate"
    theirs.mkdir()
    (theirs / "keep.txt").write_text("someone's data")
    args = _parse(["--size", "tiny", "--modes", "tierstate", "--steps", "1", "--warmup", "0", "--repeats", "1",
                   "--probe-bytes", "16M", "--nvme-dir", str(tmp_path)])
    with pytest.raises(ValueError, match=r"--nvme-dir .*tierstate exists already"):
        bench.main(args)
    assert (theirs / "keep.txt").read_text() == "someone's data"


def test_a_run_the_kernel_kills_says_so_with_the_rss_it_reached(tmp_path):
    # what an out-of-memory kill looks like from outside: SIGKILL, no result file
    args = _parse(["--size", "tiny", "--steps", "1000", "--warmup", "0", "--threads", "1", "--probe-bytes", "16M"])
    out = {}
    runner = threading.Thread(target=lambda: out.update(bench.run_one(sys.executable, "tierstate", args, tmp_path,
                                                                      tmp_path, "r0")))
    runner.start()
    deadline = time.monotonic() + 120
    pid = None
    while pid is None and time.monotonic() < deadline:
        for proc in Path("/proc").iterdir():
            try:
                cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if str(tmp_path / "tierstate-r0.json").encode() in cmdline:
                pid = int(proc.name)
        time.sleep(0.5)
    assert pid is not None, "the worker did not start"
    time.sleep(8)  # let it import torch and build the model
    os.kill(pid, signal.SIGKILL)
    runner.join(timeout=120)
    assert out["status"] == "failed"
    assert re.fullmatch(r"killed by signal 9 \(SIGKILL: the out-of-memory killer\?\) at RSS \d+\.\d GiB, "
                        r"(after: \[tierstate\] .*|before setup ended)", out["error"]), out["error"]
    assert not (tmp_path / "tierstate").exists()
