"""SIGTERM mid-step and mid-save, for each disposition the application may have set, and
forked children that exit: real processes, real signals, real files."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import tierstate

IMPORT_ROOT = Path(tierstate.__file__).resolve().parents[1]
CHILD = Path(__file__).with_name("term_child.py")


def _start(what: str, where: str, disposition: str, **env) -> tuple[subprocess.Popen, dict]:
    full = dict(os.environ, PYTHONPATH=str(IMPORT_ROOT), **env)
    proc = subprocess.Popen([sys.executable, str(CHILD), what, where, disposition], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=full)
    line = proc.stdout.readline()
    if not line:
        proc.wait(60)
        pytest.fail(f"child exited with {proc.returncode} before reporting its folders")
    return proc, json.loads(line)


def _wait_loops(proc: subprocess.Popen, n: int) -> None:
    """Read ``loop`` lines until the child has run ``n`` iterations (so it is in the middle of one)."""
    for _ in range(n):
        line = proc.stdout.readline()
        assert line.startswith("loop"), line
    time.sleep(0.03)  # the next step or save has begun: the signal lands inside it, not on the print


def _leftovers(info: dict) -> list[str]:
    out = [f for f in info["files"] if os.path.exists(f)]
    for folder in info["folders"]:
        if os.path.isdir(folder):
            out += [os.path.join(folder, n) for n in os.listdir(folder)]
    return out


def _unnamed_shards(ckpt: Path) -> list[str]:
    """Shards the checkpoint's manifest does not name (a save's that did not commit)."""
    if not (ckpt / "manifest.json").exists():
        return []
    named = {s["file"] for s in json.loads((ckpt / "manifest.json").read_text())["shards"]}
    return sorted(n for n in os.listdir(ckpt) if n.endswith(".safetensors") and n not in named)


def _partials(ckpt: Path) -> list[str]:
    """A checkpoint's shard being written, or save_weights' temporary file."""
    return sorted(n for n in os.listdir(ckpt) if n.endswith((".partial", ".tmp"))) if ckpt.is_dir() else []


@pytest.mark.parametrize("what", ["step", "save", "export"])
def test_sigterm_default_disposition_cleans_up_and_dies_by_sigterm(tmp_path, what):
    where = tmp_path / "nv"
    proc, info = _start(what, str(where), "default")
    _wait_loops(proc, 3)
    if what != "step":  # wait until a shard (or the export's temporary file) is being written
        deadline = time.monotonic() + 30
        while not _partials(Path(f"{where}.ckpt")) and time.monotonic() < deadline:
            pass
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == -signal.SIGTERM, "the exit status must still say 'killed by SIGTERM'"
    assert _leftovers(info) == []
    assert not where.exists(), "the folder the run created is removed"
    assert _partials(Path(f"{where}.ckpt")) == []
    assert _unnamed_shards(Path(f"{where}.ckpt")) == [], "the shards the interrupted save had finished are removed"


def test_sigterm_default_disposition_default_root(tmp_path, monkeypatch):
    root = tmp_path / "root"
    monkeypatch.setenv("TIERSTATE_NVME_DIR", str(root))
    proc, info = _start("step", "-", "default", CKPT_DIR=str(tmp_path / "ck"))
    _wait_loops(proc, 2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == -signal.SIGTERM
    assert _leftovers(info) == [] and list(root.iterdir()) == []


@pytest.mark.parametrize("what", ["step", "save"])
def test_sigterm_ignored_changes_nothing(tmp_path, what):
    where = tmp_path / "nv"
    proc, info = _start(what, str(where), "ignore")
    _wait_loops(proc, 2)
    proc.send_signal(signal.SIGTERM)
    _wait_loops(proc, 2)  # still running, still stepping or saving
    assert all(os.path.exists(f) for f in info["files"])
    proc.stdin.close()
    assert proc.wait(60) == 0
    assert _leftovers(info) == [] and _partials(Path(f"{where}.ckpt")) == []


@pytest.mark.parametrize("what", ["step", "save", "export"])
def test_sigterm_app_handler_that_exits_is_called(tmp_path, what):
    where = tmp_path / "nv"
    proc, info = _start(what, str(where), "exit")
    _wait_loops(proc, 3)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 3, "the application's handler ran (sys.exit(3))"
    assert _leftovers(info) == [] and _partials(Path(f"{where}.ckpt")) == []


@pytest.mark.parametrize("what", ["step", "save"])
def test_sigterm_app_handler_that_returns_lets_the_run_finish(tmp_path, what):
    """A graceful-shutdown handler (set a flag, finish the step, save, exit): the files it
    still needs must be there, the save in flight must complete. The signal must land inside
    the step or the save; when it lands between two (the loop's print), the run is made again,
    up to three times."""
    for attempt in range(3):
        where = tmp_path / f"nv{attempt}"
        proc, info = _start(what, str(where), "flag")
        _wait_loops(proc, 3)
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=120)[0]
        assert proc.returncode == 0, out
        lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
        assert {"after": "ok"} in lines, out
        assert _leftovers(info) == [] and _partials(Path(f"{where}.ckpt")) == []
        manifest = json.loads((Path(f"{where}.ckpt") / "manifest.json").read_text())
        assert all((Path(f"{where}.ckpt") / s["file"]).exists() for s in manifest["shards"])
        seen = [x["seen"] for x in lines if "seen" in x]
        if seen and ("save_optimizer" if what == "save" else "step") in seen[0][0]:
            return
    pytest.fail(f"in 3 runs the signal never came mid-{what}: {seen}")


def test_sigterm_after_construction_off_the_main_thread_is_swept_next_start(tmp_path, caplog):
    import logging

    import torch

    import tierstate as ts

    where = tmp_path / "nv"
    proc, info = _start("step", str(where), "thread")
    _wait_loops(proc, 2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == -signal.SIGTERM
    left = _leftovers(info)
    assert left, "no handler could be installed from that thread: the files stay for the sweep"
    with caplog.at_level(logging.WARNING, logger="tierstate"):
        p = [torch.nn.Parameter(torch.randn(4096))]
        opt = ts.AdamW(p, offload=ts.Offload(cpu=0.0, nvme=1.0, nvme_dir=where, subgroup_numel=1024, buffer_count=2))
    assert not any(os.path.exists(f) for f in info["files"])
    assert any("removing" in r.getMessage() and str(where) in r.getMessage() for r in caplog.records)
    opt.close()
    assert not where.exists()


def test_forked_child_exiting_normally_leaves_the_parent_alone(tmp_path):
    where = tmp_path / "nv"
    proc, info = _start("fork", str(where), "default")
    after = json.loads(proc.stdout.readline())
    assert after["child"] == 0
    assert all(after["files_exist"]), "the child removed the parent's state files"
    listing = after["folders"][str(where)] or []
    assert "tierstate.lock" in listing and "tierstate-run.json" in listing, listing
    assert after["stepped"]
    import torch

    import tierstate as ts
    from tierstate.tiers.rundir import NvmeDirInUseError

    with pytest.raises(NvmeDirInUseError, match=f"in use by pid {info['pid']}"):  # a third process is refused
        ts.AdamW([torch.nn.Parameter(torch.randn(4096))],
                 offload=ts.Offload(cpu=0.0, nvme=1.0, nvme_dir=where, subgroup_numel=1024, buffer_count=2))
    proc.stdin.close()
    assert proc.wait(60) == 0
    assert _leftovers(info) == [] and not where.exists()


def test_multiprocessing_fork_child_leaves_the_parent_alone(tmp_path):
    where = tmp_path / "nv"
    mark = tmp_path / "mark"
    proc, info = _start("mpfork", str(where), "default", MARK_FILE=str(mark))
    after = json.loads(proc.stdout.readline())
    assert after["child"] == 0 and mark.read_text() == "done"
    assert all(after["files_exist"]) and "tierstate.lock" in (after["folders"][str(where)] or [])
    assert after["stepped"]
    proc.stdin.close()
    assert proc.wait(60) == 0
    assert _leftovers(info) == []


def test_forked_child_killed_by_sigterm_leaves_the_parent_alone(tmp_path):
    where = tmp_path / "nv"
    proc, info = _start("forkterm", str(where), "default")
    after = json.loads(proc.stdout.readline())
    assert after["child"] == -signal.SIGTERM
    assert all(after["files_exist"]) and "tierstate.lock" in (after["folders"][str(where)] or [])
    assert after["stepped"]
    proc.stdin.close()
    assert proc.wait(60) == 0
    assert _leftovers(info) == []
