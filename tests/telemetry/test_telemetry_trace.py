"""Trace files: valid trace-event JSON (fields per event type, lanes named, slices nest
per lane), repaired when recorded slices cross, written at stop, at exit, from the env."""
from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tierstate.telemetry import (Telemetry, TraceFormatError, load_trace, validate_trace)
from tierstate.telemetry.trace import Slice, nest_lane
from telemetry_workload import IO_LANES, run_step
import tierstate

# the folder holding the tierstate under test (the checkout, or site-packages when installed):
# children must import that one, whose native module was built
IMPORT_ROOT = Path(tierstate.__file__).resolve().parents[1]


REPO = Path(__file__).resolve().parents[2]


def _events(obj, ph):
    return [e for e in obj["traceEvents"] if e["ph"] == ph]


def _lane_names(obj):
    return {e["tid"]: e["args"]["name"] for e in _events(obj, "M")
            if e["name"] == "thread_name"}


@pytest.fixture
def traced(tmp_path):
    tel = Telemetry(log_every=0)
    path = tmp_path / "run.json"
    tel.start_trace(path)
    for step in range(3):
        run_step(tel, step)
        tel.end_step()
    assert tel.tracing and tel.trace_path == str(path)
    assert tel.stop_trace() == str(path)
    assert not tel.tracing
    return load_trace(str(path))


def test_workload_trace_is_valid(traced):
    validate_trace(traced)
    names = _lane_names(traced)
    assert names[1] == "main"                      # the main lane is the top lane
    assert set(names.values()) == {"main", *IO_LANES}
    xs = _events(traced, "X")
    steps = [e for e in xs if e["cat"] == "step"]
    assert [e["args"]["step"] for e in steps] == [0, 1, 2]
    assert all(e["tid"] == 1 for e in steps)
    by_lane = {}
    for e in xs:
        by_lane.setdefault(names[e["tid"]], set()).add(e["name"])
    assert by_lane["main"] == {"step", "grad_norm", "cpu_update", "nvme_wait"}
    assert by_lane["io0"] == by_lane["io1"] == {"nvme_read"}
    # one slice per recorded phase: 3 steps x (grad_norm, cpu_update, nvme_wait) on main
    assert sum(1 for e in xs if names[e["tid"]] == "main" and e["cat"] == "phase") == 9
    # step args carry the stats the report needs
    assert steps[0]["args"]["bytes"] == {"nvme/read": 2 * (8 << 20)}
    assert set(steps[0]["args"]["phases"]) >= {"grad_norm", "cpu_update", "nvme_wait", "other"}


def test_counters_are_memory_tracks(traced):
    counters = _events(traced, "C")
    names = {e["name"] for e in counters}
    assert {"pinned_bytes", "device_mem", "tier_bytes/nvme", "host_rss"} <= names
    nvme = [e["args"]["value"] for e in counters if e["name"] == "tier_bytes/nvme"]
    assert nvme == [16 << 20, 32 << 20, 48 << 20]
    ts = [e["ts"] for e in counters]
    assert min(ts) >= 0


def test_slices_within_a_step_lie_inside_it(traced):
    names = _lane_names(traced)
    xs = _events(traced, "X")
    steps = [e for e in xs if e["cat"] == "step"]
    for e in xs:
        if names[e["tid"]] == "main" and e["cat"] == "phase":
            assert any(s["ts"] <= e["ts"] and e["ts"] + e["dur"] <= s["ts"] + s["dur"]
                       for s in steps)


# -- validator on bad input -------------------------------------------------------------

def _good():
    return {"traceEvents": [
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": {"name": "main"}},
        {"ph": "X", "name": "a", "ts": 0.0, "dur": 10.0, "pid": 1, "tid": 1},
        {"ph": "X", "name": "b", "ts": 2.0, "dur": 3.0, "pid": 1, "tid": 1},
        {"ph": "X", "name": "c", "ts": 10.0, "dur": 1.0, "pid": 1, "tid": 1},
        {"ph": "C", "name": "host_rss", "ts": 1.0, "pid": 1, "args": {"value": 5}},
    ]}


def test_validator_accepts_the_reference_and_the_list_form():
    validate_trace(_good())
    validate_trace(_good()["traceEvents"])


@pytest.mark.parametrize("mutate, match", [
    (lambda o: o.pop("traceEvents"), "no 'traceEvents'"),
    (lambda o: o["traceEvents"].append("x"), "not an object"),
    (lambda o: o["traceEvents"][1].pop("ph"), "'ph'"),
    (lambda o: o["traceEvents"][1].update(ph="Q"), "unsupported"),
    (lambda o: o["traceEvents"][1].pop("ts"), "'ts' must be"),
    (lambda o: o["traceEvents"][1].update(ts="3"), "'ts' must be"),
    (lambda o: o["traceEvents"][1].pop("dur"), "'dur' must be"),
    (lambda o: o["traceEvents"][1].update(dur=-1.0), "'dur' must be"),
    (lambda o: o["traceEvents"][1].pop("pid"), "'pid' must be"),
    (lambda o: o["traceEvents"][1].update(tid="main"), "'tid' must be"),
    (lambda o: o["traceEvents"][1].update(name=None), "'name' must be"),
    (lambda o: o["traceEvents"][2].update(ts=8.0), "partially overlaps"),
    (lambda o: o["traceEvents"][0].update(tid=2), "no 'thread_name'"),
    (lambda o: o["traceEvents"][0].update(name="thread_nom"), "unknown metadata"),
    (lambda o: o["traceEvents"][0].update(args={}), "args.name"),
    (lambda o: o["traceEvents"][4].update(args={}), "non-empty 'args'"),
    (lambda o: o["traceEvents"][4].update(args={"value": "big"}), "finite numbers"),
    (lambda o: o["traceEvents"].append({"ph": "E", "ts": 1.0, "pid": 1, "tid": 1}),
     "without a matching 'B'"),
    (lambda o: o["traceEvents"].append({"ph": "B", "name": "z", "ts": 1.0, "pid": 1,
                                        "tid": 1}), "never ended"),
    (lambda o: o["traceEvents"].append({"ph": "i", "name": "z", "ts": 1.0, "pid": 1,
                                        "s": "x"}), "scope"),
])
def test_validator_rejects(mutate, match):
    obj = _good()
    mutate(obj)
    with pytest.raises(TraceFormatError, match=match):
        validate_trace(obj)


def test_validator_checks_begin_end_nesting():
    obj = _good()
    obj["traceEvents"] += [
        {"ph": "B", "name": "p", "ts": 20.0, "pid": 1, "tid": 1},
        {"ph": "X", "name": "q", "ts": 25.0, "dur": 10.0, "pid": 1, "tid": 1},
        {"ph": "E", "ts": 30.0, "pid": 1, "tid": 1},
    ]
    with pytest.raises(TraceFormatError, match="partially overlaps"):
        validate_trace(obj)


def test_validator_reports_every_problem():
    obj = _good()
    obj["traceEvents"][1]["dur"] = -1
    obj["traceEvents"][4]["args"] = {}
    with pytest.raises(TraceFormatError) as info:
        validate_trace(obj)
    assert len(info.value.problems) == 2


# -- nesting repair -----------------------------------------------------------------------

def test_nest_lane_splits_a_crossing_slice():
    out = nest_lane([Slice(0, 100, "a", "phase"), Slice(50, 150, "b", "phase")])
    assert [(s.start_ns, s.end_ns, s.name) for s in out] == [
        (0, 100, "a"), (50, 100, "b"), (100, 150, "b")]
    assert out[1].args == {"split": True}


def test_nest_lane_random_slices_become_valid_and_keep_their_time():
    rng = random.Random(7)
    for _ in range(200):
        slices = []
        for i in range(rng.randint(1, 12)):
            start = rng.randint(0, 100)
            slices.append(Slice(start, start + rng.randint(0, 60), f"s{i}", "phase"))
        out = nest_lane(slices)
        per_name = {}
        for s in out:
            per_name[s.name] = per_name.get(s.name, 0) + s.end_ns - s.start_ns
        assert per_name == {s.name: s.end_ns - s.start_ns for s in slices}
        events = [{"ph": "M", "name": "thread_name", "pid": 1, "tid": 1,
                   "args": {"name": "l"}}]
        events += [{"ph": "X", "name": s.name, "ts": s.start_ns / 1000,
                    "dur": (s.end_ns - s.start_ns) / 1000, "pid": 1, "tid": 1}
                   for s in out]
        validate_trace(events)


def test_crossing_slices_recorded_on_one_lane_are_repaired(tmp_path):
    tel = Telemetry(log_every=0)
    tel.start_trace(tmp_path / "cross.json")
    tel.begin_step(0)
    t0 = time.perf_counter()
    # two I/O completions booked on one stream lane with overlapping intervals
    tel.add_phase_time("nvme_read", 0.004, lane="nvme0", start=t0)
    tel.add_phase_time("nvme_write", 0.004, lane="nvme0", start=t0 + 0.002)
    tel.end_step()
    obj = load_trace(tel.stop_trace())
    validate_trace(obj)
    tid = next(t for t, n in _lane_names(obj).items() if n == "nvme0")
    lane = [e for e in _events(obj, "X") if e["tid"] == tid]
    assert sum(e["dur"] for e in lane if e["name"] == "nvme_write") == pytest.approx(4000)
    assert any(e.get("args", {}).get("split") for e in lane)


def test_two_threads_sharing_a_lane_name_still_nest(tmp_path):
    import threading
    tel = Telemetry(log_every=0)
    tel.start_trace(tmp_path / "shared.json")
    barrier = threading.Barrier(2)

    def worker(delay):
        barrier.wait()
        time.sleep(delay)
        with tel.phase("nvme_read", lane="pool"):
            time.sleep(0.005)

    threads = [threading.Thread(target=worker, args=(d,)) for d in (0.0, 0.002)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    validate_trace(load_trace(tel.stop_trace()))


# -- writing ------------------------------------------------------------------------------

def test_start_trace_mid_run_keeps_only_what_follows(tmp_path):
    tel = Telemetry(log_every=0)
    for step in range(2):
        run_step(tel, step)
        tel.end_step()
    tel.start_trace(tmp_path / "late.json")
    run_step(tel, 2)
    tel.end_step()
    obj = load_trace(tel.stop_trace())
    validate_trace(obj)
    steps = [e["args"]["step"] for e in _events(obj, "X") if e["cat"] == "step"]
    assert steps == [2]
    assert all(e["ts"] >= 0 for e in _events(obj, "X"))


def test_trace_errors(tmp_path):
    tel = Telemetry(log_every=0)
    with pytest.raises(FileNotFoundError) as info:
        tel.start_trace(tmp_path / "missing" / "t.json")
    assert str(tmp_path / "missing") in str(info.value)
    with pytest.raises(RuntimeError, match="start_trace"):
        tel.stop_trace()
    tel.start_trace(tmp_path / "t.json")
    with pytest.raises(RuntimeError, match="already tracing"):
        tel.start_trace(tmp_path / "u.json")
    tel.stop_trace()


def test_max_events_bounds_memory_and_is_reported(tmp_path):
    tel = Telemetry(log_every=0, max_trace_events=10)
    tel.start_trace(tmp_path / "cap.json")
    tel.begin_step(0)
    for _ in range(50):
        with tel.phase("cpu_update"):
            pass
    tel.end_step()
    obj = load_trace(tel.stop_trace())
    validate_trace(obj)
    assert len(_events(obj, "X")) + len(_events(obj, "C")) == 10
    assert obj["otherData"]["dropped_events"] > 0


_ENV_SCRIPT = textwrap.dedent("""
    import time
    from tierstate.telemetry import Telemetry
    first, second = Telemetry(log_every=0), Telemetry(log_every=0)
    for tel in (first, second):
        for step in range(3):
            tel.begin_step(step)
            with tel.phase("cpu_update"):
                time.sleep(0.001)
            tel.set_gauge("pinned_bytes", 1024.0)
            tel.end_step()
    print(first.trace_path)
    print(second.trace_path)
    # no stop_trace: the atexit hook must write both files
""")


def test_env_var_traces_every_optimizer_and_writes_at_exit(tmp_path):
    env = dict(os.environ, TIERSTATE_TRACE=str(tmp_path / "run-{pid}.json"),
               PYTHONPATH=os.pathsep.join([str(IMPORT_ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", _ENV_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    first, second = proc.stdout.split()
    assert Path(first).name.startswith("run-") and Path(first).suffix == ".json"
    assert second == first[:-len(".json")] + ".1.json"
    for path in (first, second):
        obj = load_trace(path)
        validate_trace(obj)
        assert [e["args"]["step"] for e in _events(obj, "X") if e["cat"] == "step"] == [0, 1, 2]
    assert not list(tmp_path.glob(".trace-*"))     # no temp files left behind


def test_bad_env_template_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("TIERSTATE_TRACE", str(tmp_path / "{host}.json"))
    with pytest.raises(ValueError, match="TIERSTATE_TRACE"):
        Telemetry(log_every=0)
