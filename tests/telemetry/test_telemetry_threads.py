"""Thread safety: many threads recording phases, bytes and counters while the main
thread ends steps; nothing lost, nothing double counted, the trace stays valid."""
from __future__ import annotations

import threading
import time

from tierstate.telemetry import Telemetry, load_trace, validate_trace

WORKERS = 6
PHASES_PER_WORKER = 6000       # > the 4096-record buffer drain threshold
BYTES_PER_PHASE = 4096


def test_concurrent_recording_loses_nothing(tmp_path):
    tel = Telemetry(log_every=0)
    tel.start_trace(tmp_path / "threads.json")
    start = threading.Barrier(WORKERS + 1)

    def worker(i: int):
        start.wait()
        for _ in range(PHASES_PER_WORKER):
            with tel.phase("nvme_read"):
                with tel.phase("nvme_wait"):
                    pass
            tel.add_bytes("nvme", "read", BYTES_PER_PHASE)
            tel.count("reads")

    threads = [threading.Thread(target=worker, args=(i,), name=f"io{i}")
               for i in range(WORKERS)]
    for t in threads:
        t.start()
    start.wait()
    stats = []
    step = 0
    while any(t.is_alive() for t in threads):
        tel.begin_step(step)
        with tel.phase("cpu_update"):
            pass
        stats.append(tel.end_step())
        step += 1
    for t in threads:
        t.join()
    tel.begin_step(step)           # whatever the workers booked after the last step
    stats.append(tel.end_step())

    total_bytes = sum(s.bytes.get("nvme/read", 0) for s in stats)
    assert total_bytes == WORKERS * PHASES_PER_WORKER * BYTES_PER_PHASE
    assert sum(s.counters.get("reads", 0) for s in stats) == WORKERS * PHASES_PER_WORKER
    assert tel.totals().bytes["nvme/read"] == total_bytes
    for s in stats:
        assert "nvme_read" not in s.phases        # worker lanes are never critical path
        assert abs(sum(s.phases.values()) - s.wall_s) < 1e-9

    obj = load_trace(tel.stop_trace())
    validate_trace(obj)
    lanes = {e["tid"]: e["args"]["name"] for e in obj["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name"}
    per_lane = {}
    for e in obj["traceEvents"]:
        if e["ph"] == "X" and e["cat"] == "phase":
            key = (lanes[e["tid"]], e["name"])
            per_lane[key] = per_lane.get(key, 0) + 1
    for i in range(WORKERS):
        assert per_lane[(f"io{i}", "nvme_read")] == PHASES_PER_WORKER
        assert per_lane[(f"io{i}", "nvme_wait")] == PHASES_PER_WORKER
    assert per_lane[("main", "cpu_update")] == len(stats) - 1


def test_each_thread_gets_its_own_lane_and_stack():
    tel = Telemetry(log_every=0)
    tel.begin_step(0)
    ready = threading.Barrier(2)

    def worker():
        # opened while the main thread also has a phase open: the stacks must not mix
        with tel.phase("nvme_write"):
            ready.wait()
            ready.wait()

    t = threading.Thread(target=worker, name="writer")
    t.start()
    with tel.phase("cpu_update"):
        ready.wait()
        time.sleep(0.005)            # both phases are open across this sleep
        ready.wait()
    t.join()
    s = tel.end_step()
    assert set(s.lanes) == {"main", "writer"}
    assert set(s.lanes["writer"]) == {"nvme_write"}
    # the worker's phase did not nest into (and subtract from) the main lane's phase
    assert s.lanes["writer"]["nvme_write"] >= 0.005 * 0.95
    assert s.phases["cpu_update"] >= 0.005 * 0.95
