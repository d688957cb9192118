"""``tierstate demo`` end to end: the loss falls, the summary is complete, the CLI writes it."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tierstate.kernels import backend_info
from tierstate.demo import run_demo
from tierstate.telemetry import load_trace, validate_trace
import tierstate

# the folder holding the tierstate under test (the checkout, or site-packages when installed):
# children must import that one, whose native module was built
IMPORT_ROOT = Path(tierstate.__file__).resolve().parents[1]


REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("demo") / "summary.json"
    summary = run_demo("tiny", steps=40, device="cpu", json_path=path, progress=False)
    return summary, path


def test_loss_falls_well_below_the_first_steps_and_a_uniform_guess(tiny_run):
    summary, _ = tiny_run
    assert len(summary["losses"]) == 40 and all(math.isfinite(x) for x in summary["losses"])
    assert summary["loss_uniform"] == pytest.approx(math.log(256))
    # Measured: ~5.0 -> ~2.5 over 40 steps; a model stuck at the letter frequencies stays at ~3.0.
    assert summary["loss_last"] < summary["loss_first"] - 1.5
    assert summary["loss_last"] < summary["loss_uniform"] - 2.0
    assert summary["loss_last"] > summary["loss_floor"]  # nothing beats the entropy rate


def test_summary_accounts_for_parameters_state_and_time(tiny_run):
    summary, path = tiny_run
    assert summary["parameters"] == 232_832
    # AdamW keeps 2 fp32 moments per parameter; the host tier holds at least those.
    assert summary["tier_bytes"]["host"] >= 2 * 4 * summary["parameters"]
    assert set(summary["phases_s"]) == {"data", "forward", "backward", "optimizer"}
    assert all(seconds > 0 for seconds in summary["phases_s"].values())
    assert summary["wall_s"] >= sum(summary["step_s"])
    # The optimizer's own account of opt.step() lies inside the demo's timing of it.
    assert 0 < sum(summary["optimizer_phases_s"].values()) <= summary["phases_s"]["optimizer"]
    assert summary["peak_rss_bytes"] >= summary["host_rss_bytes"] > 0
    assert summary["kernels"] == backend_info()
    assert json.loads(path.read_text()) == summary


def test_bf16_parameters_train_too():
    summary = run_demo("tiny", steps=15, dtype="bf16", device="cpu", progress=False)
    assert summary["dtype"] == "bf16"
    assert summary["loss_last"] < summary["loss_first"] - 0.5
    # bf16 params: the optimizer adds a 4-byte fp32 master to the two moments.
    assert summary["tier_bytes"]["host"] >= 3 * 4 * summary["parameters"]


@pytest.mark.skipif(not backend_info()["native"], reason="the NVMe tier needs the native I/O engine")
def test_nvme_offload_keeps_the_state_in_files_and_trains(tmp_path):
    summary = run_demo("tiny", steps=12, offload="nvme", nvme_dir=tmp_path, device="cpu", progress=False)
    assert summary["tier_bytes"].get("nvme", 0) >= 2 * 4 * summary["parameters"]
    assert summary["tier_bytes"].get("host", 0) == 0
    assert summary["optimizer_bytes"].get("nvme/read", 0) > 0
    assert summary["loss_last"] < summary["loss_first"] - 0.5


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        (dict(model="huge"), "model='huge'"),
        (dict(offload="disk"), "offload='disk'"),
        (dict(offload="cpu", nvme_dir="/tmp"), "nvme_dir"),
        (dict(steps=0), "steps=0"),
        (dict(seq_len=1000), "seq_len=1000"),
        (dict(lr=-1.0), "lr=-1.0"),
        (dict(dtype="fp16"), "dtype='fp16'"),
        (dict(device="gpu0"), "device='gpu0'"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, argument):
    with pytest.raises(ValueError, match=argument.replace("(", r"\(")):
        run_demo(**{"model": "tiny", "progress": False, **kwargs})


def test_a_missing_json_folder_fails_before_training(tmp_path):
    missing = tmp_path / "absent" / "summary.json"
    with pytest.raises(FileNotFoundError) as error:
        run_demo("tiny", steps=1, json_path=missing, device="cpu", progress=False)
    assert error.value.filename == str(missing.parent) and error.value.errno == 2


def _cli(*args, env_extra=None, cwd=None):
    env = {**os.environ, "PYTHONPATH": str(IMPORT_ROOT), **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "tierstate", "demo", *args], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=300)


def test_cli_prints_the_summary_and_writes_json_and_a_trace(tmp_path):
    out, trace = tmp_path / "run.json", tmp_path / "run.trace.json"
    result = _cli("--model", "tiny", "--steps", "30", "--device", "cpu", "--json", str(out), "--trace", str(trace))
    assert result.returncode == 0, result.stderr
    assert "state per tier" in result.stdout and "cpu_update" in result.stdout
    summary = json.loads(out.read_text())
    assert summary["steps"] == 30 and summary["loss_last"] < summary["loss_first"] - 1.0
    validate_trace(load_trace(str(trace)))


def test_cli_draws_nothing_on_other_local_ranks(tmp_path):
    out = tmp_path / "rank1.json"
    result = _cli("--model", "tiny", "--steps", "3", "--device", "cpu", "--json", str(out),
                  env_extra={"LOCAL_RANK": "1"})
    assert result.returncode == 0, result.stderr
    assert result.stdout == "" and "train" not in result.stderr
    assert json.loads(out.read_text())["steps"] == 3


def test_cli_reports_a_bad_argument_in_one_line():
    result = _cli("--model", "tiny", "--seq-len", "999", "--device", "cpu")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "seq_len=999" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


@pytest.mark.parametrize("option", ["--steps", "--batch-size", "--seq-len"])
def test_cli_refuses_a_count_below_one_before_printing_anything(option):
    result = _cli("--model", "tiny", option, "0", "--device", "cpu")
    assert result.returncode == 2
    assert result.stdout == "" and f"argument {option}: '0': expected a positive integer" in result.stderr
