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
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tierstate
from tierstate.checkpoint.durable import PAUSE_PHASES

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


def _paused_writers(tmp_path: Path, phases: dict[str, dict]) -> dict[str, tuple[str, subprocess.Popen]]:
    """Start one training writer per phase, side by side (each saves after every step; the save
    of step TARGET stops at its phase); return once every one has stopped there.
    ``phases``: phase -> extra environment. Returns checkpoint path -> (phase, process)."""
    runs = {}
    for i, (phase, more) in enumerate(phases.items()):
        ckpt = tmp_path / phase
        marker = tmp_path / f"{phase}.paused"
        env = {**_env(tmp_path / f"nvme-{phase}"), "CKPT_TEST_PAUSE": f"{phase}:{TARGET}:{marker}", **more}
        proc = subprocess.Popen([sys.executable, WORKLOAD, "train", "nvme" if i % 2 else "cpu", str(ckpt),
                                 str(STEPS)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        runs[str(ckpt)] = (phase, proc, marker)
    try:
        deadline = time.monotonic() + 300
        for phase, proc, marker in runs.values():
            while not marker.exists():
                assert proc.poll() is None, f"the writer ended before pausing at {phase}: {proc.stderr.read()[-3000:]}"
                assert time.monotonic() < deadline, f"the writer never paused at {phase}"
                time.sleep(0.02)
    except BaseException:
        for _, proc, _ in runs.values():
            proc.kill()
            proc.communicate(timeout=60)
        raise
    return {ckpt: (phase, proc) for ckpt, (phase, proc, _) in runs.items()}


def test_kill_at_each_phase_of_a_save_leaves_one_whole_checkpoint(tmp_path):
    """kill -9 exactly at each phase of a save (the writer stops there, see save.py's
    TIERSTATE_TEST_PAUSE_AT): the previous checkpoint, or the new one once committed, loads
    bit-identical to what was saved, and resuming from it ends as the uninterrupted run."""
    reference = _json_from(["digests", "cpu", str(STEPS)], _env())
    seen = {}
    for ckpt, (phase, proc) in _paused_writers(tmp_path, {phase: {} for phase in PHASES}).items():
        before = json.loads((Path(ckpt) / "manifest.json").read_text())
        names = set(os.listdir(ckpt))
        proc.kill()  # SIGKILL, while the writer sleeps at the phase
        proc.communicate(timeout=60)
        assert proc.returncode == -9
        assert set(os.listdir(ckpt)) == names, "the directory changed after the writer stopped"
        seen[ckpt] = (phase, {"manifest": before, "names": names})
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


# Interruptions the process survives long enough to clean up: Ctrl-C (KeyboardInterrupt, the
# process then ends by SIGINT) and a launcher's SIGTERM caught by an application handler that
# calls sys.exit(3) both raise inside the save wherever it happens to be; a SIGTERM under the
# default disposition runs tierstate's handler (tiers/termination.py), which removes what did
# not commit and ends the process by SIGTERM, with no unwinding.
INTERRUPTS = {"sigint": (signal.SIGINT, -signal.SIGINT, {}),
              "sigterm-exit": (signal.SIGTERM, 3, {"CKPT_TEST_SIGTERM_EXIT": "1"}),
              "sigterm-default": (signal.SIGTERM, -signal.SIGTERM, {})}
# Which interrupt lands at which phase: each kind before and after the commit, and the default
# SIGTERM where the manifest is written but not yet renamed (it once left the save's files there).
KINDS = {"shard-written": "sigint", "shard-closed": "sigterm-default", "shards-renamed": "sigterm-exit",
         "manifest-written": "sigterm-default", "manifest-renamed": "sigint", "manifest-committed": "sigterm-exit",
         "cleanup": "sigterm-default"}
# phases before the manifest's rename: the previous checkpoint stays, and nothing of the new save
COMMITTED_FROM = PAUSE_PHASES.index("manifest-renamed")


def test_an_interrupt_at_each_phase_of_a_save_unwinds_to_one_whole_checkpoint(tmp_path):
    """Ctrl-C, a SIGTERM handler that exits, or a SIGTERM under the default disposition, at each
    phase of a save: save_optimizer (or the SIGTERM cleanup) must leave no .partial or .tmp file, remove the shards of a
    save that did not commit, and never remove the shards of a manifest already renamed into
    place (the newest checkpoint). The writers run side by side to keep the test short."""
    reference = _json_from(["digests", "cpu", str(STEPS)], _env())
    assert set(KINDS) == set(PAUSE_PHASES)
    kinds = KINDS
    writers = _paused_writers(tmp_path, {phase: INTERRUPTS[kind][2] for phase, kind in kinds.items()})
    runs = {}
    try:
        for ckpt, (phase, proc) in writers.items():
            proc.send_signal(INTERRUPTS[kinds[phase]][0])
        for ckpt, (phase, proc) in writers.items():
            err = proc.communicate(timeout=60)[1]
            kind = kinds[phase]
            assert proc.returncode == INTERRUPTS[kind][1], (phase, kind, proc.returncode, err[-3000:])
            if kind == "sigint":
                assert "KeyboardInterrupt" in err, err[-3000:]
            runs[ckpt] = (phase, kind)
    finally:
        for _, proc in writers.values():
            if proc.poll() is None:  # an interrupt that did not end it: it would sleep at its phase for ever
                proc.kill()
                proc.communicate(timeout=60)
    for ckpt, (phase, kind, *_) in runs.items():
        names = sorted(os.listdir(ckpt))
        assert not [n for n in names if n.endswith((".partial", ".tmp"))], (phase, kind, names)
        manifest = json.loads((Path(ckpt) / "manifest.json").read_text())
        referenced = {s["file"] for s in manifest["shards"]}
        shards = {n for n in names if n.endswith(".safetensors")}
        assert referenced <= shards, f"{phase} ({kind}): the manifest names shards that were removed: {names}"
        want = TARGET if PAUSE_PHASES.index(phase) >= COMMITTED_FROM else TARGET - 1
        assert manifest["extra"] == {"step": want}, (phase, kind, manifest["extra"])
        if want == TARGET - 1:
            assert shards == referenced, f"{phase} ({kind}): the interrupted save left its shards: {names}"
    resumed = _json_from(["resume", "cpu", str(STEPS), *runs], _env())
    for ckpt, (phase, kind, *_) in runs.items():
        got = resumed[ckpt]
        want = TARGET if PAUSE_PHASES.index(phase) >= COMMITTED_FROM else TARGET - 1
        assert got["step"] == want and got["loaded"] == reference[str(want)], (phase, kind, got["step"])
        assert got["final"] == reference[str(STEPS)], f"{phase} ({kind}): resuming did not end bit-identical"


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
