"""``tierstate bench e2e`` at a tiny model size: every mode runs in its own process, times its
phases, trains the same model as plain torch, and the NVMe mode really streams through its files."""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys

import pytest

from bench_helpers import parse_with, require_native
from tierstate.bench import e2e
from tierstate.kernels import backend_info


def _parse(argv: list[str]) -> argparse.Namespace:
    return parse_with(e2e, argv)


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory):
    require_native()
    tmp = tmp_path_factory.mktemp("e2e")
    out = tmp / "e2e.json"
    args = _parse(["--tiny", "--modes", "torch,cpu,nvme,cpu_bf16,nvme_bf16_bwd", "--precision", "bf16",
                   "--steps", "2", "--warmup", "1",
                   "--repeats", "1", "--threads", "1", "--json", str(out), "--nvme-dir", str(tmp / "nvme"),
                   "--timeout", "300"])
    rc = e2e.main(args)
    return rc, json.loads(out.read_text()), tmp / "nvme"


def test_tiny_run_times_every_phase_of_every_mode(tiny_report):
    rc, report, _ = tiny_report
    assert rc == 0
    for mode in ("torch", "cpu", "nvme"):
        s = report["summaries"][mode]
        assert s["status"] == "ok", s["status"]
        assert s["total"]["n"] == 2  # the warm-up step is not counted
        run = report["runs"][mode][0]
        timed = [step for step in run["steps"] if not step["warmup"]]
        assert len(run["steps"]) == 3 and len(timed) == 2
        for step in timed:
            assert min(step["fwd"], step["bwd"], step["opt"]) > 0
            assert step["fwd"] + step["bwd"] + step["opt"] == pytest.approx(step["total"], rel=1e-6)
        assert run["peak_rss_bytes"] >= run["rss_after_setup_bytes"] > 0
    for mode in ("cpu", "nvme"):
        assert report["summaries"][mode]["phases_s"]["cpu_update"] > 0
        assert report["summaries"][mode]["kernels"] == backend_info()["isa"]  # the native ISA, named
    assert "phases_s" not in report["summaries"]["torch"]


def test_tierstate_mode_refuses_to_time_the_reference_kernels(tmp_path):
    """An interpreter without the compiled module would time the pure-torch fallback: the
    worker stops instead, and says which interpreter and what to do."""
    out = tmp_path / "cpu.json"
    env = {**os.environ, "TIERSTATE_NATIVE_PATH": str(tmp_path / "missing_native.so")}
    done = subprocess.run([sys.executable, "-m", "tierstate.bench._e2e_worker", "--mode", "cpu", "--out", str(out),
                           "--steps", "1", "--warmup", "0", "--threads", "1", "--layers", "1", "--embd", "32",
                           "--heads", "2", "--vocab", "64", "--batch", "1", "--seq", "8", "--precision", "fp32"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and not out.exists()
    assert "--mode cpu: tierstate's native module did not load" in done.stderr
    assert "pip install ." in done.stderr


def test_tiny_run_trains_the_same_model_in_every_mode(tiny_report):
    """Same seed, tokens and AdamW arguments: the tierstate modes follow plain torch's losses."""
    _, report, _ = tiny_report
    losses = {m: [s["loss"] for s in report["runs"][m][0]["steps"]] for m in ("torch", "cpu", "nvme")}
    assert all(math.isfinite(v) for v in losses["torch"])
    assert losses["cpu"][0] == losses["torch"][0] == losses["nvme"][0]  # before any update: same forward
    for mode in ("cpu", "nvme"):
        assert losses[mode] == pytest.approx(losses["torch"], rel=1e-3)
    assert losses["cpu"] == losses["nvme"]  # same kernels, different tier


def test_tiny_bf16_modes_update_in_backward_to_the_same_bits(tiny_report):
    """bf16 parameters with an fp32 master: the NVMe run that updates during backward trains
    exactly like the host-RAM run with a plain step, and its step() only finishes the rest."""
    _, report, _ = tiny_report
    losses = {m: [s["loss"] for s in report["runs"][m][0]["steps"]] for m in ("cpu_bf16", "nvme_bf16_bwd")}
    assert losses["cpu_bf16"] == losses["nvme_bf16_bwd"]
    assert losses["cpu_bf16"][-1] < losses["cpu_bf16"][0]
    for mode, in_backward in (("cpu_bf16", False), ("nvme_bf16_bwd", True)):
        last = report["runs"][mode][0]["steps"][-1]
        phases, lanes = last["phases"], last["lanes"]  # phases: the critical path inside step()
        # Neither step reads the gradients for their norm ("grad_norm"): the plain step reuses the
        # sums its gradients' hooks took in backward (tierstate.pipeline.grads.HookNorms); in backward
        # mode the hooks check each gradient as it lands, and on CPU parameters every update
        # runs on the thread that ran backward (no worker lane). How many of them wait for
        # step() depends on the disk, so only the split of the plain step is exact.
        assert "grad_norm" not in phases, mode
        assert "backward-update" not in lanes, mode
        if in_backward:
            assert lanes["main"]["cpu_update"] >= phases.get("cpu_update", 0.0)
        else:
            assert lanes["main"]["cpu_update"] == pytest.approx(phases["cpu_update"], rel=1e-6)


def test_tiny_nvme_mode_streams_state_through_its_files_and_removes_them(tiny_report):
    _, report, nvme_dir = tiny_report
    moved = report["summaries"]["nvme"]["bytes_per_step"]
    # 16 Ki-element sub-groups and a 2-buffer pool: most sub-groups are read and written every step
    assert moved["nvme/read"] > 0 and moved["nvme/write"] > 0
    assert "nvme/read" not in report["summaries"]["cpu"]["bytes_per_step"]
    assert list(nvme_dir.iterdir()) == []


def test_targets_give_ratios_but_no_verdict_off_the_issue_shape(tiny_report):
    _, report, _ = tiny_report
    assert report["meta"]["issue_shape"] is False
    by_name = {t["target"]: t for t in report["targets"]}
    nvme_vs_torch = by_name["nvme vs plain torch"]
    expected = report["summaries"]["nvme"]["total"]["median"] / report["summaries"]["torch"]["total"]["median"]
    assert nvme_vs_torch["ratio"] == pytest.approx(expected)
    # the zero-cost goals: the same step ratio against 1.05, and the optimizer phases against 0.8
    tight = by_name["nvme step at zero cost (vs plain torch)"]
    assert (tight["ratio"], tight["limit"]) == (pytest.approx(expected), 1.05)
    phase = by_name["cpu optimizer phase vs plain torch's"]
    assert phase["measure"] == "opt" and phase["limit"] == 0.8
    summaries = report["summaries"]
    assert phase["ratio"] == pytest.approx(summaries["cpu"]["opt"]["median"] / summaries["torch"]["opt"]["median"])
    assert len(phase["per_round"]) == len(nvme_vs_torch["per_round"]) > 0
    assert all(t["met"] is None for t in report["targets"])


def test_unknown_mode_is_rejected_naming_the_option(capsys):
    with pytest.raises(SystemExit):
        _parse(["--modes", "torch,zero9"])
    err = capsys.readouterr().err
    assert "--modes" in err and "zero9" in err and "nvme_bf16_bwd" in err


def test_deepspeed_modes_are_refused_pointing_at_the_peer_comparison(capsys):
    """The installed command has no DeepSpeed code: its modes are named with where they run."""
    with pytest.raises(SystemExit):
        _parse(["--modes", "torch,ds_z2_cpu"])
    err = capsys.readouterr().err
    assert "ds_z2_cpu" in err and "python benchmarks/e2e.py" in err


def test_the_installed_e2e_modules_hold_no_deepspeed_code():
    import inspect

    from tierstate.bench import _e2e_worker

    for module in (e2e, _e2e_worker):
        source = inspect.getsource(module)
        assert "import deepspeed" not in source and "deepspeed.initialize" not in source, module.__name__


def test_fp32_precision_trains_without_bf16_anywhere(tmp_path):
    """--precision fp32 (auto's pick on CPUs without bf16 matrix units): no autocast, and the
    in-backward NVMe mode on fp32 parameters trains bit for bit like the plain CPU mode."""
    require_native()
    out = tmp_path / "e2e.json"
    args = _parse(["--tiny", "--modes", "torch,cpu,nvme_bwd", "--precision", "fp32", "--steps", "2", "--warmup", "1",
                   "--repeats", "1", "--threads", "1", "--json", str(out), "--nvme-dir", str(tmp_path / "nvme"),
                   "--timeout", "300"])
    assert e2e.main(args) == 0
    report = json.loads(out.read_text())
    assert report["meta"]["precision"] == "fp32"
    runs = {m: report["runs"][m][0] for m in ("torch", "cpu", "nvme_bwd")}
    assert {r["precision"] for r in runs.values()} == {"fp32"}
    losses = {m: [s["loss"] for s in r["steps"]] for m, r in runs.items()}
    assert losses["cpu"] == losses["nvme_bwd"]  # same kernels, other tier, updated during backward
    assert losses["cpu"] == pytest.approx(losses["torch"], rel=1e-4)  # fp32 throughout: close to torch
    assert "grad_norm" not in runs["nvme_bwd"]["steps"][-1]["phases"]  # its updates ran in backward's hooks


def test_fp32_precision_refuses_bf16_parameter_modes(capsys, tmp_path):
    args = _parse(["--tiny", "--modes", "torch,cpu_bf16", "--precision", "fp32", "--nvme-dir", str(tmp_path)])
    assert e2e.main(args) == 2
    err = capsys.readouterr().err
    assert "cpu_bf16" in err and "--precision bf16" in err


@pytest.mark.parametrize("slowdown", [1.0, 56.0])  # a CPU with bf16 matrix units, and one without (AVX2 only)
@pytest.mark.parametrize("modes, want", [
    ("torch,cpu", {1.0: "bf16", 56.0: "fp32"}),
    ("cpu_bf16_bwd,nvme_bf16_bwd", {1.0: "bf16", 56.0: "bf16"}),  # named bf16-parameter modes settle auto to bf16
    (None, {1.0: "bf16", 56.0: "fp32"}),
])
def test_auto_precision_runs_the_modes_asked_for(monkeypatch, tmp_path, capsys, slowdown, modes, want):
    # Regression: on a CPU without bf16 matrix units, `--modes cpu_bf16_bwd` (the README's command)
    # with the default --precision auto exited 2, auto having settled on fp32, which rules them out.
    from tierstate.placement import probe

    monkeypatch.setattr(probe, "bf16_matmul_slowdown", lambda *a, **k: slowdown)
    args = _parse(["--tiny", "--nvme-dir", str(tmp_path)] + (["--modes", modes] if modes else []))
    assert e2e.prepare(args) is None
    assert args.precision == want[slowdown]
    if modes:
        assert args.modes == modes.split(",")
    else:
        assert bool(set(args.modes) & set(e2e.BF16_PARAM_MODES)) == (want[slowdown] == "bf16")
    out = capsys.readouterr().out
    assert ("precision:" in out) == (slowdown > 4)  # the pick is explained where the CPU is slow at bf16


def test_bf16_slowdown_probe_is_a_positive_ratio():
    from tierstate.placement.probe import bf16_matmul_slowdown

    slowdown = bf16_matmul_slowdown(size=64, reps=1)
    assert math.isfinite(slowdown) and slowdown > 0
