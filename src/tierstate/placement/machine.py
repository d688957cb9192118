"""What this machine is, as the probe and the benchmarks report it: the CPU's model, the
machine facts a hardware profile records, and the last-level cache the rate probes size
their arrays to stream past. :mod:`tierstate.placement.probe` re-exports every name."""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path
from typing import Iterable


def _thread_counts() -> list[int]:
    """The thread counts a rate probe tries: powers of two below this process's CPUs, then all of them."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    counts, t = [], 1
    while t < cpus:
        counts.append(t)
        t *= 2
    return counts + [cpus]


def cpu_model() -> str:
    """The CPU's model name as ``lscpu`` shows it (``/proc/cpuinfo``), else ``platform.processor()``
    (may be empty)."""
    fallback = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), fallback)
    except OSError:
        return fallback


def machine_facts() -> dict:
    import psutil
    import torch

    vm = psutil.virtual_memory()
    facts = {
        "hostname": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
        "torch": torch.__version__, "cpu_model": cpu_model(),
        "logical_cpus": psutil.cpu_count(logical=True), "physical_cpus": psutil.cpu_count(logical=False),
        "process_cpus": _thread_counts()[-1], "memory_total_bytes": vm.total,
        "memory_available_bytes": vm.available, "load_average_1m": os.getloadavg()[0],
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "last_level_cache_bytes": cache_sizes(),
    }
    try:
        from tierstate.kernels import backend_info
        facts["kernels"] = backend_info()
    except ImportError as exc:
        facts["kernels"] = {"native": False, "native_error": str(exc)}
    return facts


def _cache_size_bytes(text: str) -> int:
    """sysfs's ``"307200K"``, ``"2048K"``, ``"32M"`` in bytes; 0 when unreadable."""
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
    digits = text[:-1] if scale > 1 else text
    return int(digits) * scale if digits.isdigit() else 0


def sysfs_last_level_cache_bytes(root: str | os.PathLike = "/sys/devices/system/cpu",
                                 cpus: Iterable[int] | None = None) -> int:
    """The last-level cache the CPUs ``cpus`` (default: this process's affinity) reach, from
    sysfs: the largest cache level listed, summed over its distinct instances (an AMD core
    complex has its own L3 slice, 32 MiB on Zen 3/4, and threads on two complexes use two).
    0 when sysfs lists no cache."""
    root = Path(root)
    if cpus is None:
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    instances: dict[tuple[int, str], int] = {}  # (level, shared_cpu_list) -> size
    for cpu in cpus:
        for index in (root / f"cpu{cpu}" / "cache").glob("index*"):
            try:
                size = _cache_size_bytes((index / "size").read_text().strip())
                level_text = (index / "level").read_text().strip() if (index / "level").exists() else "0"
                shared = (index / "shared_cpu_list").read_text().strip() \
                    if (index / "shared_cpu_list").exists() else f"cpu{cpu}"
            except OSError:
                continue
            if size:
                level = int(level_text) if level_text.isdigit() else 0
                instances[(level, shared)] = size
    if not instances:
        return 0
    top = max(level for level, _ in instances)
    return sum(size for (level, _), size in instances.items() if level == top)


def getconf_level3_cache_bytes() -> int:
    """glibc's ``LEVEL3_CACHE_SIZE`` (``getconf``; CPUID-based), 0 when unknown."""
    getconf = shutil.which("getconf")
    if getconf is None:
        return 0
    try:
        out = subprocess.run([getconf, "LEVEL3_CACHE_SIZE"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    out = out.strip()
    return int(out) if out.isdigit() else 0


def cache_sizes() -> dict[str, int]:
    """The last-level cache size by source: ``sysfs`` and ``getconf`` (glibc), bytes, 0 when unknown."""
    return {"sysfs": sysfs_last_level_cache_bytes(), "getconf": getconf_level3_cache_bytes()}


def last_level_cache_bytes() -> int:
    """The larger of the sources in :func:`cache_sizes` (0 when none reports one).

    They disagree on some VMs: a 2-vCPU Zen 4 EPYC VM lists a 32 MiB L3 in sysfs (one core
    complex's slice) while glibc reports 320 MiB (the socket's). Taking the larger is the
    safe side: a probe sized from a too-small cache fits in the real one and measures the
    cache (step-time predictions 25-35 % low on a 300 MiB-L3 VM), while one sized from a
    too-large figure only streams more bytes (2 x 320 MiB: ~0.1 s per pass at 10 GB/s)."""
    return max(cache_sizes().values(), default=0)


# Rate probes never allocate more than this share of the available RAM, whatever a cache
# report says (a foreign figure must not make the probe swap).
BEYOND_CACHE_RAM_SHARE = 0.25


def beyond_cache_numel(numel: int, bytes_per_element: int) -> int:
    """``numel``, raised until the arrays it sizes (``bytes_per_element`` in all) stream over twice
    the last-level cache (:func:`last_level_cache_bytes`), but to at most a quarter of the
    available RAM. A rate probe that fits in cache measures the cache: on a 2-vCPU VM
    reporting a 300 MiB L3, ``grad_sumsq`` ran at 11.6-13.0 G elements/s over 8-16 Mi elements
    and 7.2-7.9 over 64-95 Mi, and the planner under-predicted the step by 25-35 %."""
    import psutil

    wanted = -(-2 * last_level_cache_bytes() // bytes_per_element)
    ceiling = int(psutil.virtual_memory().available * BEYOND_CACHE_RAM_SHARE) // bytes_per_element
    return max(numel, min(wanted, ceiling))
