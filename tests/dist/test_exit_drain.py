"""A rank's gloo worker threads get to finish with Python before the interpreter ends.

See [Note: a rank aborting at exit after its last gloo collective] in
tierstate/dist/exit_drain.py. The launch runs ``_exit_drain_worker.py`` on two gloo ranks
under torchrun: a thread named as torch's gloo workers is busy without the GIL when the
rank's script ends, and must still get the GIL back (and write its file) before Python
finalizes. Without the wait at exit it never does: the interpreter ends it silently, or, for
torch's own thread inside a C++ destructor, with SIGABRT. About 15 s.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import tierstate
from tierstate.dist import exit_drain

WORKER = Path(__file__).with_name("_exit_drain_worker.py")
IMPORT_ROOT = Path(tierstate.__file__).resolve().parents[1]
needs_gloo = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="this torch build has no torch.distributed with gloo")
linux_only = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads /proc/self/task")


def _launch(out: Path, mib: int, **env_extra) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env_extra,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(IMPORT_ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(WORKER), str(out), str(mib)], env=env, capture_output=True, text=True, timeout=180)


# (hashed MiB, TIERSTATE_EXIT_DRAIN_S, whether the thread finishes). With the wait, a cap well
# above the thread's 0.2 s of hashing, so that a loaded machine does not fail it. The control,
# the wait off: a hash long enough (2 GiB, 1.6 s) that the rank's exit surely comes first on
# a loaded machine ends the thread before it writes.
LAUNCHES = [(256, "20", True), (2048, "0", False)]


@needs_gloo
@linux_only
@pytest.mark.timeout(400)
@pytest.mark.parametrize("mib, cap, finishes", LAUNCHES, ids=["wait", "wait-off"])
def test_a_busy_gloo_worker_finishes_before_the_rank_exits(tmp_path, mib, cap, finishes):
    done = _launch(tmp_path, mib, TIERSTATE_EXIT_DRAIN_S=cap)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    written = [tmp_path / f"finished-{rank}" for rank in (0, 1)]
    if not finishes:
        assert not any(f.exists() for f in written)
        return
    expected = hashlib.sha256(bytes(mib << 20)).hexdigest()  # the worker's whole hash, not a part
    for rank, finished in enumerate(written):
        assert finished.exists(), f"rank {rank}'s gloo-named thread was ended by the exit\n" + done.stderr[-3000:]
        assert finished.read_text() == expected


def _named_thread(name: bytes, work, started: threading.Event) -> threading.Thread:
    def run():
        ctypes.CDLL(None).prctl(15, name, 0, 0, 0)  # PR_SET_NAME
        started.set()
        work()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    started.wait()
    return t


@linux_only
def test_drain_waits_for_a_running_worker_and_returns_when_it_is_done():
    started, hashed = threading.Event(), threading.Event()
    data = bytes(128 << 20)  # sha256: ~0.1 s without the GIL

    def work():
        hashlib.sha256(data).digest()
        hashed.set()  # needs the GIL back, which the drain's sleeps give it

    _named_thread(b"pt_gloo_runloop", work, started)
    assert not hashed.is_set()
    waited = exit_drain.drain(cap_s=30.0)
    assert hashed.is_set(), f"drain returned after {waited:.3f} s with the worker still hashing"
    # idle now: back after QUIET_CHECKS polls
    assert exit_drain.drain(cap_s=30.0) < 0.5


@linux_only
def test_drain_ignores_threads_of_other_names_and_stops_at_its_cap():
    stop = threading.Event()

    def spin():  # a GIL-free busy loop until told to stop: sha256 of 16 MiB at a time
        data = bytes(16 << 20)
        while not stop.is_set():
            hashlib.sha256(data).digest()

    started = threading.Event()
    _named_thread(b"someone-else", spin, started)
    try:
        assert exit_drain.drain(cap_s=30.0) < 0.5  # not a gloo worker: not waited for
        started2 = threading.Event()
        _named_thread(b"pt_gloo_runloop", spin, started2)
        start = time.monotonic()
        waited = exit_drain.drain(cap_s=0.3)
        assert 0.3 <= waited < 0.3 + 0.5 and time.monotonic() - start < 1.0
    finally:
        stop.set()


def test_busy_workers_reads_names_with_spaces_and_parentheses(tmp_path, monkeypatch):
    task = tmp_path / "4242"
    task.mkdir()
    (task / "stat").write_bytes(b"4242 (pt_gloo_runloop) R 1 2 3\n")
    other = tmp_path / "4243"
    other.mkdir()
    (other / "stat").write_bytes(b"4243 (a (tricky) name) R 1 2 3\n")
    idle = tmp_path / "4244"
    idle.mkdir()
    (idle / "stat").write_bytes(b"4244 (pt_gloo_runloop) S 1 2 3\n")
    monkeypatch.setattr(exit_drain, "_TASKS", str(tmp_path))
    assert exit_drain._busy_workers(("pt_gloo_runloop",)) == [4242]
    assert exit_drain._busy_workers(("a (tricky) name",)) == [4243]


@pytest.mark.parametrize("raw, expected", [("", exit_drain.DRAIN_CAP_S), ("2.5", 2.5), ("0", 0.0)])
def test_cap_from_env(monkeypatch, raw, expected):
    monkeypatch.setenv(exit_drain.CAP_ENV, raw)
    assert exit_drain.cap_from_env() == expected


@pytest.mark.parametrize("raw", ["-1", "soon", "nan", "inf"])
def test_a_bad_cap_is_refused_naming_the_variable(monkeypatch, raw):
    monkeypatch.setenv(exit_drain.CAP_ENV, raw)
    with pytest.raises(ValueError, match="TIERSTATE_EXIT_DRAIN_S.*seconds >= 0"):
        exit_drain.cap_from_env()
