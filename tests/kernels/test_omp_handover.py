"""Handing the cores over from torch's idle OpenMP workers (tierstate.kernels.omp_handover).

After a torch parallel region, libgomp's workers stay alive and spin; the hand-over makes
them exit (the process's thread count drops), torch's next parallel region starts them
again and computes the same, and ``opt.step()`` does it before its kernels run. Each case
runs in a fresh interpreter: the hand-over acts on the calling thread's OpenMP team, and
the count of threads must not see other tests' pools.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.skipif(
    (os.cpu_count() or 1) < 2 or "OpenMP" not in torch.__config__.parallel_info(),
    reason="needs torch's OpenMP backend and at least 2 CPUs (a team with a worker)")

PRELUDE = """
import os, torch
torch.set_num_threads(2)
def threads():
    return len(os.listdir("/proc/self/task"))
def threads_after_exits(before, seconds=2.0):
    # libgomp's released workers exit on their own after the pause returns (nobody joins them):
    # under load the count can still hold one for a moment, so wait, up to `seconds`, for it to drop
    import time
    end = time.monotonic() + seconds
    while threads() >= before and time.monotonic() < end:
        time.sleep(0.01)
    return threads()
def torch_work():
    a = torch.randn(512, 512, generator=torch.Generator().manual_seed(0))
    return a @ a  # one parallel region: its workers stay, spinning, then asleep
"""


def run(code: str, **env: str) -> str:
    done = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **env})
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


def test_the_idle_team_exits_and_torch_computes_the_same_after():
    out = run("""
        from tierstate.kernels import omp_handover
        ref = torch_work()
        before = threads()
        assert omp_handover.runtime_found()
        assert omp_handover.hand_over_cores() is True
        after = threads_after_exits(before)
        again = torch_work()
        print(before, after, threads(), torch.equal(again, ref))
    """)
    before, after, restarted, same = out.split()
    assert int(after) < int(before), out  # the spinning worker is gone
    assert int(restarted) == int(before), out  # torch's next region started it again
    assert same == "True"


def test_step_hands_the_cores_over_before_its_kernels():
    out = run("""
        import tierstate as ts
        p = torch.nn.Parameter(torch.randn(4096))
        opt = ts.AdamW([p], lr=1e-3, offload="cpu")
        p.grad = torch.randn(4096)
        opt.step()  # the first step makes the state
        torch_work()
        before = threads()
        opt.step()
        print(before, threads_after_exits(before))
    """)
    before, after = map(int, out.split())
    assert after < before, out


def test_switched_off_by_the_environment_and_bad_values_named():
    out = run("""
        from tierstate.kernels import omp_handover
        torch_work()
        before = threads()
        print(omp_handover.enabled(), omp_handover.hand_over_cores(), threads() == before)
    """, TIERSTATE_OMP_HANDOVER="0")
    assert out == "False False True"
    done = subprocess.run([sys.executable, "-c", "from tierstate.kernels import omp_handover as o; o.enabled()"],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "TIERSTATE_OMP_HANDOVER": "sometimes"})
    assert done.returncode != 0 and "TIERSTATE_OMP_HANDOVER='sometimes'" in done.stderr


def test_a_call_from_another_thread_leaves_this_threads_team_alone():
    """The runtime releases the calling thread's team only: a kernel call from a thread that
    ran no torch work changes nothing for the thread that did. Threads are compared by id,
    leaving out the calling thread itself: after ``join()`` its task entry can linger in
    /proc for a moment (seen in 11 of 30 runs on a 2-core VM), which a count would take
    for a new thread."""
    out = run("""
        import threading
        from tierstate.kernels import omp_handover
        def tids():
            return set(map(int, os.listdir("/proc/self/task")))
        torch_work()
        before = tids()
        caller = []
        def call():
            caller.append(threading.get_native_id())
            omp_handover.hand_over_cores()
        t = threading.Thread(target=call)
        t.start(); t.join()
        after = tids() - set(caller)
        print(sorted(before - after), sorted(after - before))
    """)
    assert out == "[] []", out  # none of the main thread's workers left, none started
