"""kill -9 of a training process at random moments of save_optimizer.

Each trial trains in a child process that saves into one directory after every step and
is SIGKILLed a random time after a save begins (0 to 1.1x the previous save's length; the
child waits for a "go" at the start of each save, so the clock and the save start together).
Afterwards the directory must hold one complete checkpoint, of the step before or of the
step being saved, whose state equals the uninterrupted run's at that step, and training
resumed from it must end bit-identical to the uninterrupted run.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tierstate

# the folder holding the tierstate under test (the checkout, or site-packages when installed):
# children must import that one, whose native module was built
IMPORT_ROOT = Path(tierstate.__file__).resolve().parents[1]


WORKLOAD = str(Path(__file__).with_name("ckpt_workload.py"))
STEPS = 6


def _env(nvme_dir: Path | None = None) -> dict:
    env = dict(os.environ)
    root = str(IMPORT_ROOT)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    if nvme_dir is not None:
        env["CKPT_TEST_NVME_DIR"] = str(nvme_dir)
    return env


def _json_from(cmd: list[str], env: dict) -> dict:
    done = subprocess.run([sys.executable, WORKLOAD, *cmd], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _kill_during_save(ckpt: Path, mode: str, rng: random.Random, nvme_dir: Path) -> dict:
    target = rng.randint(2, STEPS - 1)
    env = {**_env(nvme_dir), "CKPT_TEST_HANDSHAKE": "1"}
    proc = subprocess.Popen([sys.executable, WORKLOAD, "train", mode, str(ckpt), str(STEPS)], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    last, delay = 0.0, None
    try:
        for line in proc.stdout:
            word, step, *rest = line.split()
            if word == "end":
                last = float(rest[0])
            elif word == "begin":
                proc.stdin.write("go\n")
                proc.stdin.flush()
                if int(step) != target:
                    continue
                delay = rng.uniform(0.0, 1.1 * last)
                time.sleep(delay)
                proc.kill()  # SIGKILL
                break
    finally:
        proc.kill()
        proc.wait(timeout=60)
        proc.stdout.close()
        proc.stdin.close()
        err = proc.stderr.read()
        proc.stderr.close()
    assert delay is not None, f"the child ended before save {target}: {err[-3000:]}"
    names = {p.name for p in ckpt.iterdir()}
    debris = sorted(n for n in names if n.endswith((".partial", ".tmp")))
    referenced = set()
    if "manifest.json" in names:
        referenced = {s["file"] for s in json.loads((ckpt / "manifest.json").read_text())["shards"]}
    stale = sorted(n for n in names if n.endswith(".safetensors") and n not in referenced)
    return {"target": target, "delay": delay, "save_s": last, "debris": debris, "stale_shards": stale}


def _trials(tmp_path: Path, count: int, seed: int) -> None:
    rng = random.Random(seed)
    reference = _json_from(["digests", "cpu", str(STEPS)], _env())
    trials = {}
    for i in range(count):
        ckpt = tmp_path / f"trial{i:02d}"
        mode = "nvme" if i % 2 else "cpu"  # the NVMe runs also leave a crashed run folder behind
        trials[str(ckpt)] = _kill_during_save(ckpt, mode, rng, tmp_path / f"nvme{i:02d}")
    resumed = _json_from(["resume", "cpu", str(STEPS), *trials], _env())
    phases = {"before commit": 0, "after commit, before cleanup": 0, "after the save": 0}
    for ckpt, trial in trials.items():
        got = resumed[ckpt]
        # the newest complete checkpoint: the one before the interrupted save, or that one
        assert got["step"] in (trial["target"] - 1, trial["target"]), (trial, got["step"])
        assert got["loaded"] == reference[str(got["step"])], f"{ckpt} loaded a wrong state: {trial}"
        assert got["final"] == reference[str(STEPS)], f"{ckpt} did not resume bit-identically: {trial}"
        # the resumed run's save swept the crashed save's files
        assert not any(name.endswith((".partial", ".tmp")) for name in got["files"]), got["files"]
        assert len(got["files"]) == len(set(got["files"]) - set(trial["stale_shards"]))
        if got["step"] == trial["target"] - 1:
            phases["before commit"] += 1
        elif trial["stale_shards"]:
            phases["after commit, before cleanup"] += 1
        else:
            phases["after the save"] += 1
    print(f"{count} trials, killed: {phases}")
    if count >= 30:
        assert phases["before commit"] > 0 and phases["before commit"] + phases["after commit, before cleanup"] >= count // 2


def test_kill_during_save_three_trials(tmp_path):
    _trials(tmp_path, 3, seed=5)


@pytest.mark.slow
def test_kill_during_save_thirty_trials(tmp_path):
    _trials(tmp_path, 30, seed=1234)
