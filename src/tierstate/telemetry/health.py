"""Health rules: a tier far below its probed bandwidth, a nearly full disk, host memory
near its budget. Pure checks over recent :class:`StepStats`; :class:`Telemetry` runs them
at the end of each step and logs what they find, rate-limited per finding."""
from __future__ import annotations

import os
import shutil
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from .phases import CHANNELS, PEAK_KEYS
from .stats import StepStats

# A channel must run under half its probed peak, averaged over the recent window, while
# being the busiest channel for at least a fifth of the wall time: a slow disk that is
# idle most of the step costs nothing and is not worth a warning.
SLOW_FRACTION = 0.5
MIN_BUSY_SHARE = 0.2
BANDWIDTH_WINDOW = 5
MIN_WINDOW = 3
# Disk "nearly full": under 5 % free or under 2 GiB free, whichever triggers first; a
# 2 GiB margin is ~one sub-group write-behind queue (4 x 192 MiB) plus checkpoint slack.
DISK_FREE_FRACTION = 0.05
DISK_FREE_BYTES = 2 * 2**30
# statvfs is a syscall (~2 µs) but a stuck NFS mount can block; 10 s bounds it.
DISK_CHECK_INTERVAL_S = 10.0
HOST_BUDGET_FRACTION = 0.9


@dataclass(frozen=True)
class HealthWarning:
    """One finding: ``kind`` is ``"bandwidth"``, ``"disk"`` or ``"host_memory"``;
    ``key`` identifies its subject (channel, path) for rate limiting."""

    kind: str
    key: str
    message: str

    def __str__(self) -> str:
        return self.message


class HealthMonitor:
    """Holds the probed peaks, watched directories and host budget; evaluates the rules."""

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 disk_usage: Callable[[str], Any] = shutil.disk_usage):
        self._clock = clock
        self._disk_usage = disk_usage
        self.peaks: dict[str, float] = {}
        self.host_budget: int | None = None
        self._dirs: list[str] = []
        self._recent: deque[StepStats] = deque(maxlen=BANDWIDTH_WINDOW)
        self._disk_findings: list[HealthWarning] = []
        self._disk_checked_at: float | None = None

    def set_peaks(self, peaks: dict[str, float]) -> None:
        unknown = set(peaks) - set(PEAK_KEYS)
        if unknown:
            raise ValueError(f"unknown peak keys {sorted(unknown)}; expected a subset of "
                             f"{list(PEAK_KEYS)} (GB/s, from the probe)")
        for key, value in peaks.items():
            if value is not None and (not isinstance(value, (int, float)) or value <= 0):
                raise ValueError(f"peak {key}={value!r} must be a positive number of GB/s "
                                 "or None")
        self.peaks.update({k: float(v) for k, v in peaks.items() if v is not None})

    def set_host_budget(self, nbytes: int | None) -> None:
        if nbytes is not None and (not isinstance(nbytes, int) or nbytes <= 0):
            raise ValueError(f"host budget must be a positive int of bytes or None, got "
                             f"{nbytes!r}")
        self.host_budget = nbytes

    def watch_disk(self, path: str | os.PathLike) -> None:
        path = os.fspath(path)
        if not os.path.isdir(path):
            raise FileNotFoundError(2, "watch_disk needs an existing directory", path)
        if path not in self._dirs:
            self._dirs.append(path)
            self._disk_checked_at = None  # check the new one at the next step

    def observe(self, stats: StepStats) -> None:
        self._recent.append(stats)

    def findings(self) -> list[HealthWarning]:
        """All current findings (the disk part refreshed at most every 10 s)."""
        out = self._bandwidth_findings(self._recent)
        out += self._host_findings()
        out += self._disk()
        return out

    # -- rules ---------------------------------------------------------------------------

    def _bandwidth_findings(self, recent: Iterable[StepStats]) -> list[HealthWarning]:
        window = [s for s in recent if not s.skipped]
        if len(window) < MIN_WINDOW or not self.peaks:
            return []
        wall = sum(s.wall_s for s in window)
        busy = {c.name: sum(s.bandwidth[c.name].busy_s for s in window
                            if c.name in s.bandwidth) for c in CHANNELS}
        busiest = max(busy, key=busy.__getitem__)
        if wall <= 0 or busy[busiest] < MIN_BUSY_SHARE * wall:
            return []
        channel = next(c for c in CHANNELS if c.name == busiest)
        peak = self.peaks.get(channel.peak_key)
        nbytes = sum(s.bandwidth[busiest].nbytes for s in window if busiest in s.bandwidth)
        if not peak or nbytes <= 0:
            return []
        gbps = nbytes / busy[busiest] / 1e9
        if gbps >= SLOW_FRACTION * peak:
            return []
        return [HealthWarning(
            "bandwidth", busiest,
            f"{busiest} runs at {gbps:.2f} GB/s, {gbps / peak:.0%} of its probed peak "
            f"{peak:.2f} GB/s, over the last {len(window)} steps while busy "
            f"{busy[busiest] / wall:.0%} of the step (phase {channel.phase!r}); check for "
            "a competing process, thermal throttling, or a misconfigured path")]

    def _host_findings(self) -> list[HealthWarning]:
        if self.host_budget is None or not self._recent:
            return []
        rss = self._recent[-1].gauges.get("host_rss")
        if rss is None or rss < HOST_BUDGET_FRACTION * self.host_budget:
            return []
        return [HealthWarning(
            "host_memory", "host_rss",
            f"host RSS {rss / 2**30:.2f} GiB is {rss / self.host_budget:.0%} of the "
            f"{self.host_budget / 2**30:.2f} GiB budget; lower the cpu fraction of the "
            "offload policy or the buffer pool size")]

    def _disk(self) -> list[HealthWarning]:
        now = self._clock()
        if (self._disk_checked_at is not None
                and now - self._disk_checked_at < DISK_CHECK_INTERVAL_S):
            return list(self._disk_findings)
        self._disk_checked_at = now
        found = []
        for path in self._dirs:
            try:
                usage = self._disk_usage(path)
            except OSError as e:
                found.append(HealthWarning(
                    "disk", path, f"cannot read free space of {path}: {e.strerror} "
                    f"(errno {e.errno})"))
                continue
            free_fraction = usage.free / usage.total if usage.total else 0.0
            if free_fraction < DISK_FREE_FRACTION:
                found.append(HealthWarning(
                    "disk", path,
                    f"disk under {path} is nearly full: {_size(usage.free)} free "
                    f"({free_fraction:.1%} of {_size(usage.total)}); free space or move "
                    "nvme_dir, or NVMe-tier writes will fail with ENOSPC"))
            elif usage.free < DISK_FREE_BYTES:
                # mostly free but small (a tmpfs, a small partition): say so, not "full"
                found.append(HealthWarning(
                    "disk", path,
                    f"little free space under {path}: {_size(usage.free)} free "
                    f"({free_fraction * 100:.0f} % of a {_size(usage.total)} filesystem), under the "
                    f"{_size(DISK_FREE_BYTES)} that NVMe-tier write-behind and checkpoints can need; "
                    "a state larger than that will fail with ENOSPC there"))
        self._disk_findings = found
        return list(found)


def _size(nbytes: float) -> str:
    """``1.25 GiB`` / ``13.0 MiB`` / ``512 KiB``: a small filesystem must not read as 0.0 GiB."""
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:.2f} GiB"
    if nbytes >= 2**20:
        return f"{nbytes / 2**20:.1f} MiB"
    return f"{nbytes / 2**10:.0f} KiB"
