"""`tierstate plan` end to end: JSON for machines, a table for people, exit 2 with the shortfall."""
import argparse
import json

import pytest

import torch

import tierstate as ts
from tierstate import plan_cli
from tierstate.plan_cli import parse_compare, parse_price, parse_size


def run(argv, monkeypatch, tmp_path):
    monkeypatch.setenv("TIERSTATE_PROFILE", str(tmp_path / "absent.json"))  # conservative rates, stated
    parser = argparse.ArgumentParser()
    plan_cli.add_arguments(parser)
    return plan_cli.main(parser.parse_args(argv))


def test_json_plan_for_a_builtin_shape(monkeypatch, tmp_path, capsys):
    rc = run(["gpt2", "--device", "cpu", "--host-mem", "16GiB", "--micro-batch", "2", "--seq-len", "256", "--json"],
             monkeypatch, tmp_path)
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"]["params"] == 124_439_808
    assert out["placement"] == {"gpu": 0.0, "cpu": 1.0, "nvme": 0.0}
    kinds = {(m["tier"], m["kind"]) for m in out["memory"]}
    assert {("host", "param"), ("host", "grad"), ("host", "moments"), ("host", "activations")} <= kinds
    assert out["time_s"]["bottleneck"] in ("compute", "cpu_step")
    assert any("conservative defaults" in s for s in out["sources"])


def test_table_for_people(monkeypatch, tmp_path, capsys):
    assert run(["--params", "1.3B", "--device", "cuda", "--host-mem", "64GiB", "--device-mem", "24GiB",
                "--compare", "big,mem=80GiB,price=3.5/h", "--price", "1.2/h"], monkeypatch, tmp_path) == 0
    out = capsys.readouterr().out
    assert "predicted step" in out and "alternatives" in out and "big" in out
    # page-locked at their own size (io.page_locked_empty): no power-of-two rounding to show
    assert "pinned" in out and "pinned_rounding" not in out


def test_unmeetable_budgets_exit_2_naming_the_shortfall(monkeypatch, tmp_path, capsys):
    rc = run(["llama-7b", "--device", "cuda", "--host-mem", "64GiB", "--disk", "12GiB", "--nvme-dir", "/x"],
             monkeypatch, tmp_path)
    assert rc == 2
    err = capsys.readouterr().err
    assert "GiB of disk under /x, 12.0 GiB free" in err and "host memory" in err


def test_given_placement_is_priced_or_refused(monkeypatch, tmp_path, capsys):
    assert run(["--params", "100M", "--device", "cpu", "--placement", "0,0.5,0.5", "--disk", "10GiB", "--json"],
               monkeypatch, tmp_path) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["placement"] == {"gpu": 0.0, "cpu": 0.5, "nvme": 0.5} and out["totals"]["disk"] == 4 * 10**8
    assert run(["--params", "100M", "--placement", "0,0.5,0.6"], monkeypatch, tmp_path) == 2
    assert "sum to 1" in capsys.readouterr().err


def test_model_must_be_given_once(monkeypatch, tmp_path, capsys):
    assert run([], monkeypatch, tmp_path) == 2
    assert "--params" in capsys.readouterr().err


@pytest.mark.parametrize("text, value", [("40GiB", 40 * 2**30), ("500GB", 500 * 10**9), ("1.5TiB", int(1.5 * 2**40)),
                                         ("4096", 4096)])
def test_sizes(text, value):
    assert parse_size(text) == value


def test_prices_and_compare_options():
    assert parse_price("$2.5/h") == (2.5, "hour") and parse_price("25000") == (25000.0, "purchase")
    opt = parse_compare("h100,mem=80GiB,price=3.5/h,speed=2")
    assert opt == {"name": "h100", "mem": 80 * 2**30, "price": (3.5, "hour"), "speed": 2.0}
    with pytest.raises(ValueError, match="mem="):
        parse_compare("h100,price=3/h")
    with pytest.raises(ValueError, match="size"):
        parse_size("lots")


@pytest.mark.parametrize("argv, make", [
    ([], lambda ps: ts.AdamW(ps)),
    (["--optimizer", "adam", "--amsgrad"], lambda ps: ts.Adam(ps, amsgrad=True)),
    (["--optimizer", "sgd"], lambda ps: ts.SGD(ps)),  # torch's default: no momentum buffer
    (["--optimizer", "sgd", "--momentum", "0.9"], lambda ps: ts.SGD(ps, momentum=0.9)),
    (["--optimizer", "lion"], lambda ps: ts.Lion(ps)),
    (["--optimizer", "adagrad"], lambda ps: ts.Adagrad(ps)),
    (["--optimizer", "adamw", "--moment-dtype", "bf16"],
     lambda ps: ts.AdamW(ps, offload=ts.Offload(cpu=1.0, moment_dtype=torch.bfloat16))),
])
def test_state_per_optimizer_is_what_that_optimizer_allocates(argv, make, monkeypatch, tmp_path, capsys):
    """The plan's state bytes come from the optimizer's own rule (its state_specs), so they equal
    what the real optimizer holds after a step, flags (--amsgrad, --momentum) included."""
    n = 1000
    assert run(["--params", str(n), "--device", "cpu", "--param-dtype", "fp32", "--placement", "0,1,0", "--json",
                *argv], monkeypatch, tmp_path) == 0
    out = json.loads(capsys.readouterr().out)
    planned = sum(m["bytes"] for m in out["memory"] if m["kind"] in ("moments", "master"))
    p = torch.nn.Parameter(torch.randn(n))
    p.grad = torch.randn(n)
    opt = make([p])
    opt.step()
    held = sum(v.numel() * v.element_size() for k, v in opt.state[p].items() if k != "step")
    opt.close()
    assert planned == held, (argv, out["config"]["state_keys"], sorted(opt.state[p]))


@pytest.mark.parametrize("argv, match", [
    (["--optimizer", "sgd", "--amsgrad"], "--amsgrad: sgd has no amsgrad"),
    (["--optimizer", "adamw", "--momentum", "0.9"], "--momentum: adamw has no momentum"),
    (["--optimizer", "sgd", "--momentum", "-1"], "momentum"),
])
def test_a_flag_the_optimizer_lacks_exits_2_naming_it(argv, match, monkeypatch, tmp_path, capsys):
    assert run(["--params", "1000", "--device", "cpu", *argv], monkeypatch, tmp_path) == 2
    assert match in capsys.readouterr().err


def test_an_unknown_optimizer_is_refused_with_the_choices(monkeypatch, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        run(["--params", "1000", "--optimizer", "rmsprop"], monkeypatch, tmp_path)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "rmsprop" in err and "adamw" in err and "sgd" in err


# -- weights (parameter offload) ------------------------------------------------------------------
def _plan_subprocess(argv, tmp_path):
    """`tierstate plan ...` as a user runs it: its own process, conservative rates (no profile)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TIERSTATE_PROFILE": str(tmp_path / "absent.json"),
           "TIERSTATE_NVME_DIR": str(tmp_path / "nvme"), "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "tierstate", "plan", *argv], env=env, capture_output=True,
                          text=True, timeout=300)


LLAMA_CPU = ["llama-7b", "--device", "cpu", "--offload-weights", "auto", "--micro-batch", "1", "--seq-len", "2048",
             "--activation-checkpointing", "--moment-dtype", "bf16", "--host-mem", "12GiB", "--disk", "200GiB"]


def test_cli_plans_weights_next_to_the_state_within_one_host_budget(tmp_path):
    r = _plan_subprocess([*LLAMA_CPU, "--json"], tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    w, joint = out["weights"], out["joint"]
    assert len(w["tier_of"]) == 32 and "cpu" not in w["tier_of"] and w["blocks"]["nvme"] > 0
    # 32 blocks of 202,383,360 fp32 elements; outside them the embedding, the head and the final norm
    assert w["block_bytes"] == [202_383_360 * 4] * 32 and w["resident_bytes"] == 262_148_096 * 4
    assert w["window_bytes"] == w["window_blocks"] * 202_383_360 * 4
    assert w["disk_read_bytes"] == 2 * w["bytes"]["nvme"] and w["disk_write_bytes"] == w["bytes"]["nvme"]
    host = joint["usage"]["host"]
    assert host["weights"] == w["compute_peak_bytes"]  # on CPU the activations are in host RAM too
    assert host["total"] == host["weights"] + host["state"] <= host["budget"] == 12 << 30
    disk = joint["usage"]["disk"]
    assert disk["weights"] == w["bytes"]["nvme"] and disk["total"] == disk["weights"] + disk["state"]
    # the optimizer plan leaves the compute copy and the activations to the weight plan
    kinds = {m["kind"] for m in out["memory"]}
    assert "param" not in kinds and "activations" not in kinds
    assert out["config"]["weights_offloaded"] is True
    assert joint["step_s"] >= out["time_s"]["total"] - out["time_s"]["weight_h2d"]


def test_cli_prints_the_weight_plan_and_the_joint_budget(tmp_path):
    r = _plan_subprocess(LLAMA_CPU, tmp_path)
    assert r.returncode == 0, r.stderr
    assert "weights: 32 blocks:" in r.stdout and "NVMe" in r.stdout and "prefetch" in r.stdout
    assert "joint budget: weights and optimizer state" in r.stdout and "joint step:" in r.stdout
    assert "rejected: 'cpu' tier" in r.stdout


def test_cli_weights_on_cuda_use_pinned_host_ram_before_nvme(tmp_path):
    # bf16 llama-7b: 32 blocks of 386 MiB (13 GiB with the rest) on an 8 GiB device; 64 GiB of RAM
    # holds every streamed block's pinned home, so nothing goes to disk
    r = _plan_subprocess(["llama-7b", "--device", "cuda", "--device-mem", "8GiB", "--host-mem", "128GiB",
                          "--disk", "500GiB", "--offload-weights", "auto", "--micro-batch", "1", "--seq-len", "1024",
                          "--activation-checkpointing", "--json"], tmp_path)
    assert r.returncode == 0, r.stderr
    w = json.loads(r.stdout)["weights"]
    assert w["blocks"]["cpu"] > 0 and w["blocks"]["nvme"] == 0 and w["blocks"]["resident"] > 0
    assert w["pcie_bytes"] == 2 * w["bytes"]["cpu"] and w["compute_peak_bytes"] <= 8 << 30


def _plan_in_process(argv, tmp_path, monkeypatch, capsys) -> tuple[int, str]:
    """`tierstate plan ...` through the console script's entry point (tierstate.cli.main) in this
    process, as :func:`_plan_subprocess` sets it up; (exit status, stderr)."""
    from tierstate import cli

    monkeypatch.setenv("TIERSTATE_PROFILE", str(tmp_path / "absent.json"))
    monkeypatch.setenv("TIERSTATE_NVME_DIR", str(tmp_path / "nvme"))
    monkeypatch.setenv("COLUMNS", "200")
    try:
        code = cli.main(["plan", *argv])
    except SystemExit as exc:  # argparse's and the plan's usage errors
        code = exc.code
    return code, capsys.readouterr().err


def test_cli_weight_offload_refusals_exit_2_naming_the_cause(tmp_path, monkeypatch, capsys):
    code, err = _plan_in_process(["7B", "--device", "cpu", "--offload-weights", "auto"], tmp_path, monkeypatch, capsys)
    assert code == 2 and "weight offload needs the model's repeated blocks" in err
    code, err = _plan_in_process(["gpt2", "--device", "cpu", "--offload-weights", "cpu"], tmp_path, monkeypatch, capsys)
    assert code == 2 and "buys nothing" in err
    code, err = _plan_in_process(["gpt2", "--device", "cuda", "--offload-weights", "auto", "--host-mem", "8GiB"],
                                 tmp_path, monkeypatch, capsys)
    assert code == 2 and "--device-mem" in err
    code, err = _plan_in_process(["llama-7b", "--device", "cpu", "--offload-weights", "auto", "--micro-batch", "1",
                                  "--seq-len", "2048", "--host-mem", "12GiB", "--disk", "200GiB"],
                                 tmp_path, monkeypatch, capsys)
    assert code == 2 and "no weight placement fits" in err and "activation" in err
