"""GPT-2 124M training steps: tierstate's modes against plain torch and DeepSpeed ZeRO-2/3.

    python benchmarks/e2e.py [--modes torch,cpu,nvme,...,ds_z2_cpu,ds_z3_nvme] [--steps 6]
                             [--warmup 2] [--repeats 2] [--json out.json] [--peers-python PY]

Run from a source checkout with tierstate installed. Everything but DeepSpeed is
``tierstate bench e2e`` (:mod:`tierstate.bench.e2e`: the model, the tierstate and torch
modes, the alternating rounds, the report); this script adds two modes run by
``_e2e_deepspeed_worker.py`` next to it, and the targets against them:

================  ================================================================
``ds_z2_cpu``     DeepSpeed ZeRO-2, optimizer offloaded to the CPU (its bf16 mode)
``ds_z3_nvme``    DeepSpeed ZeRO-3, optimizer offloaded to NVMe (its bf16 mode)
================  ================================================================

DeepSpeed modes run under ``--peers-python`` (default: this interpreter if it imports
deepspeed, else ``TIERSTATE_PEERS_PYTHON``, else ``.peers-venv/bin/python`` in the
checkout); where deepspeed does not import they are reported "not importable" and the rest
still runs. Under ``--precision fp32`` DeepSpeed runs with bf16 off.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from tierstate.bench import e2e

HERE = Path(__file__).resolve().parent
DEEPSPEED_MODES = ("ds_z2_cpu", "ds_z3_nvme")
MODES = (*e2e.MODES, *DEEPSPEED_MODES)
DEEPSPEED_WORKER = HERE / "_e2e_deepspeed_worker.py"

# (name, numerator mode, denominator mode, limit): the step-time ratios set against DeepSpeed,
# for each tierstate variant of the numerator's mode; then tierstate bench e2e's own.
TIME_TARGETS = tuple(
    [(f"{m} vs DeepSpeed ZeRO-3 NVMe", m, "ds_z3_nvme", 0.5) for m in e2e.NVME_VARIANTS]
    + list(e2e.TIME_TARGETS)
    + [(f"{m} vs DeepSpeed ZeRO-2 CPU", m, "ds_z2_cpu", 0.8) for m in e2e.CPU_VARIANTS])

# Step seconds measured on the reference VM (peers/RESULTS.md section 4, bf16, two runs), used
# only to put a number next to a target when DeepSpeed cannot run here: not a verdict.
REFERENCE_STEP_S = {"torch": (1.17, 1.34), "ds_z2_cpu": (1.54, 2.09), "ds_z3_nvme": (3.02, 3.25)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``tierstate bench e2e``'s options, the DeepSpeed modes among ``--modes``, and ``--peers-python``."""
    e2e.add_arguments(parser, MODES, e2e.modes_option(MODES))
    parser.add_argument("--peers-python", default=None,
                        help="interpreter that imports deepspeed, for the ds_* modes (default: this one if it "
                             "can, else TIERSTATE_PEERS_PYTHON, else .peers-venv/bin/python)")


def find_peers_python(explicit: str | None) -> str | None:
    """The interpreter to run DeepSpeed modes with (see ``--peers-python``), or None."""
    if explicit:
        return explicit
    if importlib.util.find_spec("deepspeed") is not None:
        return sys.executable
    env = os.environ.get("TIERSTATE_PEERS_PYTHON")
    if env:
        return env
    venv = HERE.parent / ".peers-venv" / "bin" / "python"
    return str(venv) if venv.exists() else None


def probe_deepspeed(python: str | None, threads: int) -> tuple[bool, str]:
    """(importable, what was found) for ``python``."""
    if python is None:
        return False, "not importable: no interpreter with deepspeed (set --peers-python or make .peers-venv)"
    try:
        done = subprocess.run([python, "-c", "import deepspeed; print(deepspeed.__version__)"],
                              env=e2e.child_env(threads), capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"not importable: {python}: {exc}"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
        return False, f"not importable under {python}: {last}"
    return True, f"deepspeed {done.stdout.strip().splitlines()[-1]} under {python}"


def main(args: argparse.Namespace) -> int:
    """Run the comparison described by ``args``; the exit status of :func:`tierstate.bench.e2e.run_modes`."""
    stop = e2e.prepare(args, MODES)
    if stop is not None:
        return stop
    launch = {m: [sys.executable, *e2e.WORKER] for m in args.modes}
    unavailable = {}
    if any(m in DEEPSPEED_MODES for m in args.modes):
        peers = find_peers_python(args.peers_python)
        ok, what = probe_deepspeed(peers, args.threads)
        print(f"DeepSpeed: {what}", flush=True)
        for m in DEEPSPEED_MODES:
            if m in args.modes:
                if ok:
                    launch[m] = [peers, str(DEEPSPEED_WORKER)]
                else:
                    unavailable[m] = what
    return e2e.run_modes(args, launch, unavailable, TIME_TARGETS, REFERENCE_STEP_S, env={"DS_ACCELERATOR": "cpu"})


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(allow_abbrev=False,
                                      prog="python benchmarks/e2e.py", description=__doc__.split("\n\n")[0])
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
