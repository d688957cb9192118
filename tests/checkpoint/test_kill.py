"""kill -9 of a training process during save_optimizer: at each named phase, and at random.

The default test stops the writer at each phase of a save (save.py's testing aid
TIERSTATE_TEST_PAUSE_AT) and kills it there, so every phase is hit on every run. The slow
test adds random moments: each trial trains in a child process that saves into one
directory after every step and is SIGKILLed a random time after a save begins (0 to 1.1x
the previous save's length; the child waits for a "go" at the start of each save, so the
clock and the save start together). Afterwards the directory must hold one complete
checkpoint, of the step before or of the step being saved, whose state equals the
uninterrupted run's at that step, and training resumed from it must end bit-identical to
the uninterrupted run.
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


# phase -> (the checkpoint that must load: the target save's step or the one before, what the
# directory must show at the kill, so that the kill provably landed inside that phase)
PHASES = {
    "shard-written": ("previous", "a .partial shard"),
    "shards-renamed": ("previous", "new shards no manifest names"),
    "manifest-committed": ("new", "every old shard still there"),
    "cleanup": ("new", "some old shards deleted, some left"),
}
TARGET = 3


def _kill_at(ckpt: Path, mode: str, phase: str, nvme_dir: Path) -> dict:
    """Train, saving after every step; the save of step TARGET stops at ``phase``; kill -9 it there."""
    marker = ckpt.parent / f"{ckpt.name}.paused"
    env = {**_env(nvme_dir), "CKPT_TEST_PAUSE": f"{phase}:{TARGET}:{marker}"}
    proc = subprocess.Popen([sys.executable, WORKLOAD, "train", mode, str(ckpt), str(STEPS)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not marker.exists():
            assert proc.poll() is None, f"the writer ended before pausing at {phase}: {proc.stderr.read()[-3000:]}"
            assert time.monotonic() < deadline, f"the writer never paused at {phase}"
            time.sleep(0.02)
        before = json.loads((ckpt / "manifest.json").read_text()) if (ckpt / "manifest.json").exists() else None
        names = {p.name for p in ckpt.iterdir()}
        proc.kill()  # SIGKILL, while the writer sleeps at the phase
        proc.wait(timeout=60)
        assert proc.returncode == -9
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)
        proc.stdout.close()
        proc.stderr.close()
    assert {p.name for p in ckpt.iterdir()} == names, "the directory changed after the writer stopped"
    return {"manifest": before, "names": names}


def test_kill_at_each_phase_of_a_save_leaves_one_whole_checkpoint(tmp_path):
    """kill -9 exactly at each phase of a save (the writer stops there, see save.py's
    TIERSTATE_TEST_PAUSE_AT): the previous checkpoint, or the new one once committed, loads
    bit-identical to what was saved, and resuming from it ends as the uninterrupted run."""
    reference = _json_from(["digests", "cpu", str(STEPS)], _env())
    seen = {}
    for i, phase in enumerate(PHASES):
        ckpt = tmp_path / f"{phase}"
        seen[str(ckpt)] = (phase, _kill_at(ckpt, "nvme" if i % 2 else "cpu", phase, tmp_path / f"nvme-{phase}"))
    resumed = _json_from(["resume", "cpu", str(STEPS), *seen], _env())
    for ckpt, (phase, at_kill) in seen.items():
        which, shows = PHASES[phase]
        manifest, names = at_kill["manifest"], at_kill["names"]
        referenced = {s["file"] for s in manifest["shards"]}
        shards = {n for n in names if n.endswith(".safetensors")}
        partial = {n for n in names if n.endswith(".partial")}
        save_ids = {n.split("-")[1] + "-" + n.split("-")[2] for n in shards | partial}
        # what the directory shows proves where the kill landed
        if phase == "shard-written":
            assert len(partial) == 1 and shards == referenced, (phase, names)
        elif phase == "shards-renamed":
            assert not partial and referenced < shards, (phase, names)
        elif phase == "manifest-committed":  # both saves have as many shards: the state's size did not change
            assert not partial and len(shards - referenced) == len(referenced) >= 2 and len(save_ids) == 2, names
        else:  # the sweep deleted one old shard and stopped before the next
            assert not partial and len(shards - referenced) == len(referenced) - 1 >= 1, (phase, names)
        want = TARGET if which == "new" else TARGET - 1
        assert manifest["extra"] == {"step": want}, (phase, manifest["extra"])
        got = resumed[ckpt]
        assert got["step"] == want, (phase, got["step"])
        assert got["loaded"] == reference[str(want)], f"{phase}: loaded state differs from what was saved"
        assert got["final"] == reference[str(STEPS)], f"{phase}: resuming did not end bit-identical"
        # the resumed run's save swept everything else: one manifest and its shards remain
        assert not any(n.endswith((".partial", ".tmp")) for n in got["files"]), got["files"]
        assert "manifest.json" in got["files"] and all(n.endswith(".safetensors") or n == "manifest.json"
                                                       for n in got["files"])


def test_pause_at_rejects_an_unknown_phase(tmp_path, monkeypatch):
    from tierstate.checkpoint import save_optimizer

    import ckpt_workload as wl

    model, opt = wl.build("cpu", hidden=16)
    wl.train_step(model, opt, 0)
    monkeypatch.setenv("TIERSTATE_TEST_PAUSE_AT", "before-everything:/nonexistent/marker")
    with pytest.raises(ValueError, match="TIERSTATE_TEST_PAUSE_AT.*shard-written"):
        save_optimizer(opt, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt" / "manifest.json").exists()


@pytest.mark.slow
def test_kill_during_save_thirty_trials(tmp_path):
    _trials(tmp_path, 30, seed=1234)
