"""A synthetic step for telemetry tests: sleeps and busy loops on the main lane, two I/O
threads reading concurrently, gauges. Durations are lower bounds on a loaded machine;
tests compare against them with stated slack."""
from __future__ import annotations

import threading
import time

from tierstate.telemetry import Telemetry

# Per step, on the main lane: 3 ms grad_norm (busy), then cpu_update with 8 ms of its own
# work (4 ms sleep + 4 ms busy) around a nested nvme_wait that joins the I/O threads,
# then 6 ms of deliberately unrecorded work that must land in "other".
GRAD_NORM_S = 0.003
CPU_SELF_S = 0.008
UNRECORDED_S = 0.006
# Two I/O lanes, each reading READ_BYTES over IO_S, concurrently with the update.
IO_S = 0.008
READ_BYTES = 8 << 20
IO_LANES = ("io0", "io1")


def busy_wait(seconds: float) -> None:
    """Spin (holding the CPU, unlike sleep) for ``seconds``."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _io_worker(tel: Telemetry, lane: str, together: threading.Barrier) -> None:
    together.wait()      # start the reads at once so that they overlap
    with tel.phase("nvme_read", lane=lane):
        time.sleep(IO_S)
    tel.add_bytes("nvme", "read", READ_BYTES)


def run_step(tel: Telemetry, step: int) -> None:
    """One synthetic step, begin_step included; the caller calls ``tel.end_step()``."""
    tel.begin_step(step)
    together = threading.Barrier(len(IO_LANES))
    workers = [threading.Thread(target=_io_worker, args=(tel, lane, together), name=lane)
               for lane in IO_LANES]
    for w in workers:
        w.start()
    with tel.phase("grad_norm"):
        busy_wait(GRAD_NORM_S)
    with tel.phase("cpu_update"):
        time.sleep(CPU_SELF_S / 2)
        with tel.phase("nvme_wait"):
            for w in workers:
                w.join()
        busy_wait(CPU_SELF_S / 2)
    time.sleep(UNRECORDED_S)
    tel.set_gauge("pinned_bytes", float(64 << 20))
    tel.set_gauge("device_mem", float(32 << 20))
    tel.set_gauge("tier_bytes/nvme", float((step + 1) * (16 << 20)))
