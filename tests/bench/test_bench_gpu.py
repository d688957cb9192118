"""``tierstate bench gpu`` on the CPU (``--device cpu --sizes tiny``): the code a GPU machine
runs (scripts/gpu_check.sh), exercised where there is none: one process per run, every
ending a result, the figures and the comparisons the targets are read from."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from bench_helpers import parse_with, require_native
from tierstate.bench import _gpu_train_worker as worker
from tierstate.bench import gpu_train


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    require_native()
    tmp = tmp_path_factory.mktemp("gpu")
    out = tmp / "bench.json"
    args = parse_with(gpu_train, ["--device", "cpu", "--sizes", "tiny", "--modes", "torch,cpu,cpu_bwd,nvme,deepspeed",
                                  "--batch", "2", "--seq", "16", "--steps", "2", "--warmup", "1", "--json", str(out),
                                  "--out-dir", str(tmp / "runs"), "--nvme-dir", str(tmp / "nvme"), "--timeout", "300"])
    rc = gpu_train.main(args)
    return rc, json.loads(out.read_text()), tmp


def test_every_mode_trains_or_says_why_not(tiny_run):
    rc, report, tmp = tiny_run
    assert rc == 0
    by_mode = {r["mode"]: r for r in report["results"]}
    assert set(by_mode) == {"torch", "cpu", "cpu_bwd", "nvme", "deepspeed"}
    for mode in ("torch", "cpu", "cpu_bwd", "nvme"):
        r = by_mode[mode]
        assert r["status"] == "ok", r.get("error")
        assert len(r["steps"]) == 3 and sum(not s["warmup"] for s in r["steps"]) == 2
        assert all(s["total"] == pytest.approx(s["fwd"] + s["bwd"] + s["opt"]) for s in r["steps"])
        assert all(torch.isfinite(torch.tensor(s["loss"])) for s in r["steps"])
        assert r["nparams"] == r["model_numel"] == worker.SIZES["tiny"].numel()
        f = r["figures"]
        assert f["tokens_per_s"] == pytest.approx(2 * 16 / f["step_s"])
        assert f["tflops"] == pytest.approx(r["flops_per_step"] / f["step_s"] / 1e12)
        assert f["mfu"] is None  # no peak known for a CPU
    # the offload modes trace their steps, drawn as PNG timelines; their phases are in the figures
    for mode in ("cpu", "nvme"):
        assert by_mode[mode]["timeline_png"].endswith(".png")
        assert (tmp / "runs" / by_mode[mode]["timeline_png"].rsplit("/", 1)[-1]).stat().st_size > 0
        assert "cpu_update" in by_mode[mode]["figures"]["phases_s"]
    assert "nvme_wait" in by_mode["nvme"]["figures"]["phases_s"]
    # the update inside backward is the plain step's, bit for bit: the same losses step by step
    assert [s["loss"] for s in by_mode["cpu_bwd"]["steps"]] == [s["loss"] for s in by_mode["cpu"]["steps"]]
    ds = by_mode["deepspeed"]
    assert ds["status"] in ("ok", "unavailable")
    if ds["status"] == "unavailable":
        assert "deepspeed" in ds["error"]
    # the NVMe run's scratch folder is gone
    assert not any((tmp / "nvme").glob("gpu-nvme-*"))


def test_the_comparisons_pair_runs_of_the_same_size_and_cap(tiny_run):
    _, report, _ = tiny_run
    speed = {(row["mode"], row["against"]): row for row in report["comparison"]["speed"]}
    assert set(speed) >= {("cpu", "torch"), ("nvme", "torch")}
    by_mode = {r["mode"]: r for r in report["results"]}
    ratio = by_mode["cpu"]["figures"]["tokens_per_s"] / by_mode["torch"]["figures"]["tokens_per_s"]
    assert speed[("cpu", "torch")]["ratio"] == pytest.approx(ratio)
    assert speed[("cpu", "torch")]["target"] == gpu_train.TARGET_VS_TORCH


def test_numel_of_every_preset_is_the_models():
    from transformers import LlamaForCausalLM

    for name, shape in worker.SIZES.items():
        with torch.device("meta"):
            model = LlamaForCausalLM(shape.config(128))
        assert sum(p.numel() for p in model.parameters()) == shape.numel(), name
    assert 1.0e9 < worker.SIZES["1b"].numel() < 1.2e9 and 6.6e9 < worker.SIZES["7b"].numel() < 6.8e9
    assert 12.9e9 < worker.SIZES["13b"].numel() < 13.1e9


def test_largest_and_capacity_ratio_under_a_cap():
    def ok(mode, size, cap):
        return {"mode": mode, "size": size, "cap_gib": cap, "status": "ok",
                "model_numel": worker.SIZES[size].numel(), "figures": {"tokens_per_s": 1000.0}}

    results = [ok("torch", "1b", 24.0), {"mode": "torch", "size": "3b", "cap_gib": 24.0, "status": "oom"},
               ok("cpu", "1b", 24.0), ok("cpu", "3b", 24.0), ok("cpu", "7b", 24.0)]
    cmp = gpu_train.compare(results)
    (cap,) = cmp["capacity"]
    assert cap["largest_torch_numel"] == worker.SIZES["1b"].numel()
    assert cap["largest_tierstate_numel"] == worker.SIZES["7b"].numel()
    assert cap["ratio"] == pytest.approx(worker.SIZES["7b"].numel() / worker.SIZES["1b"].numel())
    assert cap["target"] == gpu_train.TARGET_LARGEST
    text = gpu_train.summary(cmp)
    assert "24 GiB cap" in text and "target >= 3: met" in text


def test_a_run_that_runs_out_of_memory_is_a_result(monkeypatch, tmp_path):
    def train(args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(worker, "train", train)
    args = worker.worker_parser().parse_args(["--mode", "cpu", "--size", "tiny", "--out", str(tmp_path / "r.json"),
                                              "--device", "cpu"])
    r = worker.run(args)
    assert r["status"] == "oom" and "Tried to allocate" in r["error"]


def test_a_mode_without_its_package_is_asked_once(tmp_path, monkeypatch):
    require_native()
    launched = []
    real = gpu_train.run_one

    def run_one(args, mode, size, *rest):
        launched.append((mode, size))
        return real(args, mode, size, *rest)

    monkeypatch.setattr(gpu_train, "run_one", run_one)
    modes = "torchao,deepspeed"
    args = parse_with(gpu_train, ["--device", "cpu", "--sizes", "tiny,small", "--modes", modes, "--steps", "1",
                                  "--warmup", "0", "--out-dir", str(tmp_path / "runs"),
                                  "--json", str(tmp_path / "r.json")])
    assert gpu_train.main(args) == 0
    results = json.loads((tmp_path / "r.json").read_text())["results"]
    for mode in modes.split(","):
        mine = [r for r in results if r["mode"] == mode]
        assert [r["size"] for r in mine] == ["tiny", "small"]
        if mine[0]["status"] == "unavailable":  # not installed here: one process asked, the answer kept
            assert mine[1]["status"] == "unavailable" and (mode, "small") not in launched


def test_caps_need_a_cuda_device(capsys):
    assert gpu_train.main(parse_with(gpu_train, ["--device", "cpu", "--caps", "24", "--sizes", "tiny"])) == 2
    assert "--caps" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [(["--sizes", "2b"], "--sizes: 2b"), (["--modes", "fsdp"], "--modes: fsdp"),
                                           (["--caps", "lots"], "--caps: 'lots'"), (["--caps", "-1"], "above 0")])
def test_bad_options_name_themselves(argv, message):
    proc = subprocess.run([sys.executable, "-m", "tierstate", "bench", "gpu", *argv], capture_output=True, text=True)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
