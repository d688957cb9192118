"""The tierstate logger (NullHandler, a summary every N steps) and the health rules."""
from __future__ import annotations

import logging
import shutil
from collections import namedtuple

import pytest

from tierstate.telemetry import Telemetry
from tierstate.telemetry.health import DISK_FREE_BYTES, HealthMonitor
from telemetry_workload import busy_wait

DiskUsage = namedtuple("DiskUsage", "total used free")


def test_package_logger_has_a_null_handler():
    handlers = logging.getLogger("tierstate").handlers
    assert any(isinstance(h, logging.NullHandler) for h in handlers)


def _steps(tel, n, body=None):
    for i in range(n):
        tel.begin_step(i)
        if body:
            body(tel)
        tel.end_step()


def test_summary_logged_every_n_steps(caplog):
    caplog.set_level(logging.INFO, logger="tierstate")
    tel = Telemetry(log_every=3)

    def body(t):
        with t.phase("cpu_update"):
            busy_wait(0.0005)

    _steps(tel, 10, body)
    lines = [r for r in caplog.records if r.name == "tierstate" and r.levelno == logging.INFO]
    assert [r.getMessage().split()[1] for r in lines] == ["2", "5", "8"]
    assert all("cpu_update" in r.getMessage() and "\n" not in r.getMessage() for r in lines)


def test_log_every_zero_is_silent(caplog):
    caplog.set_level(logging.INFO, logger="tierstate")
    _steps(Telemetry(log_every=0), 5)
    assert not [r for r in caplog.records if r.levelno == logging.INFO]


def _slow_nvme_step(t):
    # 4 MiB in >= 10 ms is <= 0.42 GB/s, under half of the 50 GB/s "probed" peak
    t.add_phase_time("nvme_read", 0.010, lane="nvme0")
    t.add_bytes("nvme", "read", 4 << 20)
    busy_wait(0.012)


def test_slow_tier_warns_once_while_it_is_the_busiest(caplog):
    caplog.set_level(logging.WARNING, logger="tierstate")
    tel = Telemetry(log_every=0)
    tel.set_peaks({"nvme_read_gbps": 50.0})
    _steps(tel, 2, _slow_nvme_step)
    assert tel.health_warnings() == []             # fewer than 3 steps: no verdict yet
    _steps(tel, 6, _slow_nvme_step)
    found = tel.health_warnings()
    assert [(w.kind, w.key) for w in found] == [("bandwidth", "nvme/read")]
    assert "of its probed peak 50.00 GB/s" in str(found[0])
    warned = [r for r in caplog.records if "nvme/read runs at" in r.getMessage()]
    assert len(warned) == 1                        # rate-limited: once per 5 minutes


def test_fast_or_idle_tier_does_not_warn():
    tel = Telemetry(log_every=0)
    tel.set_peaks({"nvme_read_gbps": 0.5})         # 4 MiB / 10 ms = 0.42 GB/s: 84 %
    _steps(tel, 5, _slow_nvme_step)
    assert tel.health_warnings() == []

    def idle_disk(t):                              # slow, but busy 1 % of the step
        t.add_phase_time("nvme_read", 0.0002, lane="nvme0")
        t.add_bytes("nvme", "read", 4096)
        busy_wait(0.02)

    tel = Telemetry(log_every=0)
    tel.set_peaks({"nvme_read_gbps": 50.0})
    _steps(tel, 5, idle_disk)
    assert tel.health_warnings() == []


def test_host_memory_near_budget_warns(caplog):
    caplog.set_level(logging.WARNING, logger="tierstate")
    tel = Telemetry(log_every=0)
    tel.set_host_budget(100 << 30)
    _steps(tel, 1, lambda t: t.set_gauge("host_rss", float(80 << 30)))
    assert tel.health_warnings() == []
    _steps(tel, 1, lambda t: t.set_gauge("host_rss", float(95 << 30)))
    (w,) = tel.health_warnings()
    assert w.kind == "host_memory" and "95%" in w.message
    assert any("95.00 GiB" in r.getMessage() for r in caplog.records)


def test_sampled_rss_feeds_the_budget_rule():
    tel = Telemetry(log_every=0)
    tel.set_host_budget(1 << 20)           # 1 MiB: any Python process is above 90 %
    _steps(tel, 1)
    assert [w.kind for w in tel.health_warnings()] == ["host_memory"]


def test_nearly_full_disk_warns(tmp_path):
    usage = {"free": 100 << 30}         # 100 GiB of 1 TiB: 9.8 % free, fine
    monitor = HealthMonitor(disk_usage=lambda p: DiskUsage(1 << 40, 0, usage["free"]))
    monitor.watch_disk(tmp_path)
    assert monitor.findings() == []
    usage["free"] = 1 << 30                # 1 GiB free: under the 2 GiB floor
    monitor._disk_checked_at = None        # skip the 10 s re-check interval
    (w,) = monitor.findings()
    assert w.kind == "disk" and w.key == str(tmp_path) and "nearly full" in w.message
    usage["free"] = 40 << 30               # 40 GiB of 1 TiB = 3.9 %: under 5 %
    monitor._disk_checked_at = None
    assert [f.kind for f in monitor.findings()] == ["disk"]


def test_real_disk_is_checked(tmp_path):
    tel = Telemetry(log_every=0)
    tel.watch_disk(tmp_path)
    _steps(tel, 1)
    usage = shutil.disk_usage(tmp_path)
    full = usage.free < DISK_FREE_BYTES or usage.free < 0.05 * usage.total
    assert [w.kind for w in tel.health_warnings()] == (["disk"] if full else [])


def test_watch_disk_needs_a_directory(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        Telemetry(log_every=0).watch_disk(tmp_path / "nope")
    assert info.value.filename == str(tmp_path / "nope")
