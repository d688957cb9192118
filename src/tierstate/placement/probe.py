"""``tierstate probe``: measure this machine and save a hardware profile for the planner.

What it measures (each entry of the profile names its method and units):

- ``host_memory_bandwidth``: a STREAM triad ``a = b + s*c`` over three fp32 arrays with
  torch, at 1 thread and at every CPU of the process (3 arrays moved per triad, GB = 1e9 B);
- ``optimizer_step``: :func:`tierstate.kernels.adam_update` (fp32 weight, grad and moments,
  28 B of traffic per parameter) on one large buffer, per kernel thread count, params/s;
- ``grad_sumsq``: the gradient-norm pass of every step, params/s;
- ``compressed_step``: the fused 8-bit step (:func:`tierstate.kernels.adam_q8_update`, fp32
  master, bf16 gradient and weight out) of each map family at the best thread count,
  params/s: compute-bound where the fp32 step is memory-bound, so the planner prices
  compressed state by it rather than by its bytes;
- ``host_matmul``: fp32 and bf16 matrix multiplication, FLOP/s (the compute estimate);
- ``nvme``: for each ``--nvme-dir``: sequential write then read of one file with O_DIRECT
  (through :mod:`tierstate.io` when the native engine loads, else ``os.pwrite``/``os.preadv``
  on page-aligned memory), 8 MiB requests, all in flight; writes are timed without fsync,
  as the NVMe tier issues them (measured: concurrent reads and writes on one virtio disk
  took the sum of their separate times, so the planner adds them);
- ``cuda``: pinned host-to-device and device-to-host copies, device memory bandwidth, bf16
  matmul FLOP/s and free device memory (skipped with a note when there is no CUDA device).

The profile (JSON, ``schema_version`` 1) goes to :func:`default_profile_path`
(``$TIERSTATE_PROFILE``, else ``~/.cache/tierstate/hardware.json``) or ``--out``. Without
``--nvme-dir`` a default probe took 4.7 s and ``--quick`` (smaller buffers, fewer repetitions)
1.1 s on a 2-vCPU Zen 1 EPYC (2026-12-04); each ``--nvme-dir`` adds its disk's time to write
and read 512 MiB twice (64 MiB once with ``--quick``).

[Note: noisy bandwidth]
Memory bandwidth on shared or virtual machines can change between two levels over seconds
(one VM we develop on flips ~1.7x). Each rate is the median of several repetitions, and
min/max are kept so a reader can see the spread; re-probe when the figures look off.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import logging
import mmap
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Callable

from .machine import (  # noqa: F401 - re-exported: the probe's public face
    _thread_counts, beyond_cache_numel, cache_sizes, cpu_model, getconf_level3_cache_bytes, last_level_cache_bytes,
    machine_facts, sysfs_last_level_cache_bytes)

SCHEMA_VERSION = 1
_log = logging.getLogger("tierstate")


def default_profile_path() -> Path:
    """``$TIERSTATE_PROFILE`` if set, else ``$XDG_CACHE_HOME/tierstate/hardware.json``
    (default ``~/.cache/tierstate/hardware.json``)."""
    env = os.environ.get("TIERSTATE_PROFILE")
    if env:
        return Path(env)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "tierstate" / "hardware.json"


def load_profile(path: str | os.PathLike | None = None) -> dict | None:
    """The saved profile at ``path`` (default :func:`default_profile_path`), or None when absent.

    Raises ValueError when the file exists but is not a profile of a schema this version reads.
    """
    path = Path(path) if path is not None else default_profile_path()
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        profile = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"hardware profile {path} is not valid JSON ({exc}); re-run `tierstate probe`") from exc
    version = profile.get("schema_version") if isinstance(profile, dict) else None
    if version != SCHEMA_VERSION:
        raise ValueError(f"hardware profile {path} has schema_version {version!r}; this tierstate reads "
                         f"{SCHEMA_VERSION}: re-run `tierstate probe`")
    return profile


def peaks_from_profile(profile: dict) -> dict[str, float]:
    """The probed peak bandwidths in GB/s, keyed as :meth:`Telemetry.set_peaks` takes them."""
    m = profile.get("measurements", {})
    peaks: dict[str, float] = {}
    host = m.get("host_memory_bandwidth", {}).get("best")
    if host:
        peaks["host_mem_gbps"] = host / 1e9
    disks = [d for d in m.get("nvme", []) if "read_bytes_per_s" in d]
    if disks:  # several dirs are striped: their rates add up
        peaks["nvme_read_gbps"] = sum(d["read_bytes_per_s"] for d in disks) / 1e9
        peaks["nvme_write_gbps"] = sum(d["write_bytes_per_s"] for d in disks) / 1e9
    cuda = m.get("cuda", {})
    if "h2d_bytes_per_s" in cuda:
        peaks["h2d_gbps"] = cuda["h2d_bytes_per_s"] / 1e9
        peaks["d2h_gbps"] = cuda["d2h_bytes_per_s"] / 1e9
    return peaks


def save_profile(profile: dict, path: str | os.PathLike | None = None) -> Path:
    """Write ``profile`` atomically (temp file + rename) and return where it went."""
    path = Path(path) if path is not None else default_profile_path()
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(profile, indent=2) + "\n")
        os.replace(tmp, path)
    except OSError as exc:
        try:
            tmp.unlink()
        except OSError:
            pass  # never written (the folder is missing or read-only)
        raise type(exc)(exc.errno, f"cannot save the hardware profile ({exc.strerror}); "
                                   "give --out a writable path", str(path)) from exc
    return path


# -- helpers ------------------------------------------------------------------------------------
def _timed(fn: Callable[[], object], reps: int, warmup: int = 1) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _rate(amount: float, seconds: list[float]) -> dict:
    """Median/min/max rate of ``amount`` per run over the measured run times."""
    rates = sorted(amount / s for s in seconds)
    return {"median": statistics.median(rates), "min": rates[0], "max": rates[-1], "samples": len(rates)}


# -- measurements -------------------------------------------------------------------------------
def measure_host_bandwidth(array_bytes: int, reps: int) -> dict:
    import torch

    n = array_bytes // 4
    a, b, c = torch.empty(n), torch.rand(n), torch.rand(n)
    previous = torch.get_num_threads()
    by_threads = {}
    try:
        for t in _thread_counts():
            torch.set_num_threads(t)
            by_threads[str(t)] = _rate(3 * n * 4, _timed(lambda: torch.add(b, c, alpha=3.0, out=a), reps))
    finally:
        torch.set_num_threads(previous)
    best = max(by_threads.values(), key=lambda r: r["median"])["median"]
    return {"method": f"STREAM triad a = b + 3*c with torch.add(out=), 3 fp32 arrays of {array_bytes >> 20} MiB, "
                      "3 arrays counted per triad", "units": "B/s", "by_threads": by_threads, "best": best}


def measure_optimizer_step(numel: int, reps: int) -> dict:
    """The fused AdamW kernel's and the gradient pass's rates (elements/s) over ``numel`` fp32
    elements per array; size it with :func:`beyond_cache_numel` to measure memory, not cache."""
    import torch
    from tierstate import kernels
    from tierstate.kernels import quant

    w, g = torch.randn(numel), torch.randn(numel) * 1e-3
    m, v = torch.zeros(numel), torch.zeros(numel)
    step = lambda: kernels.adam_update(w, g, m, v, lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8,  # noqa: E731
                                       weight_decay=0.01, decoupled=True, bias_correction1=0.1,
                                       bias_correction2=0.001)
    info = kernels.backend_info()
    prev_kernel, prev_torch = kernels.get_num_threads(), torch.get_num_threads()
    by_threads = {}
    try:
        for t in _thread_counts():
            kernels.set_num_threads(t)
            torch.set_num_threads(t)  # the reference kernels run on torch's threads
            by_threads[str(t)] = _rate(numel, _timed(step, reps))
        best_t = max(by_threads, key=lambda k: by_threads[k]["median"])
        kernels.set_num_threads(int(best_t))
        torch.set_num_threads(int(best_t))
        # over all four arrays: the kernel step streams 16 B per element, one array only 4,
        # and a quarter of the working set may fit in cache
        arrays = (w, g, m, v)
        sumsq = _rate(len(arrays) * numel, _timed(lambda: [kernels.grad_sumsq(a) for a in arrays], reps))
        compressed = measure_compressed_step(w, g, reps)
    finally:
        kernels.set_num_threads(prev_kernel)
        torch.set_num_threads(prev_torch)
    impl = f"native {info['isa']}" if info.get("native") else "pure-torch reference (native module not loaded)"
    return {
        "optimizer_step": {"method": f"tierstate.kernels.adam_update (AdamW, fp32 weight/grad/moments) on "
                                     f"{numel:,} elements; {impl}", "units": "params/s", "bytes_per_param": 28,
                           "impl": impl, "by_threads": by_threads, "best_threads": int(best_t),
                           "best": by_threads[best_t]["median"]},
        "grad_sumsq": {"method": f"tierstate.kernels.grad_sumsq on 4 x {numel:,} fp32 elements, {best_t} threads",
                       "units": "params/s", "best": sumsq["median"], "stats": sumsq},
        "compressed_step": {"method": f"tierstate.kernels.adam_q8_update (AdamW, fp32 master, bf16 grad and weight "
                                      f"out, block 256) on {numel:,} elements, {best_t} threads; per map family",
                            "units": "params/s",
                            "bytes_per_param": quant.QuantConfig().step_bytes_per_param(),  # either family
                            "by_maps": {k: r["median"] for k, r in compressed.items()}, "stats": compressed},
    }


def measure_compressed_step(weight, grad, reps: int) -> dict:
    """params/s of the fused 8-bit AdamW step of each map family over ``weight``'s elements
    (fp32 master, ``grad`` as bf16), at the kernels' current thread count."""
    import torch
    from tierstate import kernels
    from tierstate.kernels import quant

    g16 = grad.bfloat16()
    out = torch.empty(weight.numel(), dtype=torch.bfloat16)
    rates = {}
    for maps in quant.MAP_FAMILIES:
        config = quant.QuantConfig(quant.DEFAULT_BLOCK_SIZE, "fp32", maps)
        rates[maps] = _rate(weight.numel(), _timed(partial(
            kernels.adam_q8_update, config.init_state(weight), g16, out, config=config, lr=1e-4, beta1=0.9,
            beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True, bias_correction1=0.1,
            bias_correction2=0.001), reps))
    return rates


# Longest a probe's timed matrix product may take: without bf16 matrix units a bf16 torch.mm
# runs at ~1 GFLOP/s (a 2-vCPU Zen 1 EPYC, 2026-12-04), where a 1024 x 1024 product is 2.1 s
# and the quick probe's four of them were 8.6 s of its 12.
MATMUL_PRODUCT_BUDGET_S = 0.1


def measure_host_matmul(size: int, reps: int, product_budget_s: float = MATMUL_PRODUCT_BUDGET_S) -> dict:
    """FLOP/s of fp32 and bf16 ``torch.mm`` of two square matrices, ``size`` x ``size``, or
    smaller for a dtype whose product would take longer than ``product_budget_s``: then the
    largest multiple of 64 (at least 64) that a 256 x 256 trial product says fits. Each
    dtype's ``size`` is in its result."""
    import torch

    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        n = _matmul_size(torch, dtype, size, product_budget_s)
        x, y = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        out[str(dtype).replace("torch.", "")] = {**_rate(2.0 * n ** 3, _timed(lambda: torch.mm(x, y), reps)),
                                                 "size": n}
    return {"method": f"torch.mm of two n x n matrices, 2*n^3 FLOPs; n = {size}, or less where one product "
                      f"would take over {product_budget_s:g} s (by_dtype[...]['size'])",
            "units": "FLOP/s", "by_dtype": out, "best": out["float32"]["median"]}


def _matmul_size(torch, dtype, size: int, budget_s: float) -> int:
    trial = min(size, 256)
    x, y = torch.randn(trial, trial, dtype=dtype), torch.randn(trial, trial, dtype=dtype)
    torch.mm(x, y)  # first call: kernel selection, page faults
    t0 = time.perf_counter()
    torch.mm(x, y)
    rate = 2.0 * trial ** 3 / max(time.perf_counter() - t0, 1e-9)
    if 2.0 * size ** 3 / rate <= budget_s:
        return size
    return min(size, max(64, int((budget_s * rate / 2.0) ** (1 / 3)) // 64 * 64))


def bf16_slowdown(host_matmul: dict) -> float:
    """fp32 / bf16 rate of a :func:`measure_host_matmul` result: how many times slower bf16 runs."""
    rates = host_matmul["by_dtype"]
    return rates["float32"]["median"] / rates["bfloat16"]["median"]


def bf16_matmul_slowdown(size: int = 256, reps: int = 3) -> float:
    """How many times slower a bf16 ``torch.mm`` runs than an fp32 one on this CPU (median rates).

    ~0.5-1 on CPUs with bf16 matrix units (AVX-512 BF16, AMX, SVE BF16); 45-130 without them
    (an AVX2-only Zen 3: 45-76x at 256 x 256, 116 vs 0.9 GFLOP/s at 512 x 768 x 3072, where
    oneDNN has no fast bf16 path). 256 x 256 keeps it under 0.1 s even there."""
    return bf16_slowdown(measure_host_matmul(size, reps))


# A bf16 matmul this many times slower than fp32 means the CPU has no bf16 matrix units:
# bf16 training (autocast or bf16 parameters) is then the wrong choice on the CPU.
SLOW_BF16_FACTOR = 4.0


def _disk_with_tierstate_io(path: Path, nbytes: int, chunk: int, reps: int) -> dict:
    from tierstate import io as tio

    buf = tio.aligned_empty(chunk)
    buf.fill_(7)
    offsets = range(0, nbytes, chunk)
    with tio.File(path, "w+", direct=True) as f:
        def write():  # no fsync: the NVMe tier writes with O_DIRECT and never fsyncs inside a step
            for fut in [f.pwrite(buf, off) for off in offsets]:
                fut.get()

        def read():
            bufs = [tio.aligned_empty(chunk) for _ in range(4)]
            futs = [f.pread(bufs[i % 4], off) for i, off in enumerate(offsets)]
            for fut in futs:
                fut.get()

        w = _timed(write, reps)  # the warm-up write allocates the file; timed writes overwrite it
        r = _timed(read, reps)
        direct, note = f.direct, f.direct_note
    return {"write": _rate(nbytes, w), "read": _rate(nbytes, r), "direct": direct, "direct_note": note,
            "engine": f"tierstate.io ({tio.default_engine().backend})"}


def _disk_with_os(path: Path, nbytes: int, chunk: int, reps: int) -> dict:
    flags = os.O_RDWR | os.O_CREAT
    direct = hasattr(os, "O_DIRECT")
    try:
        fd = os.open(path, flags | (os.O_DIRECT if direct else 0), 0o644)
    except OSError:  # tmpfs and a few others refuse O_DIRECT
        direct = False
        fd = os.open(path, flags, 0o644)
    bufs = [mmap.mmap(-1, chunk) for _ in range(4)]  # page-aligned, as O_DIRECT needs
    offsets = list(range(0, nbytes, chunk))
    try:
        with ThreadPoolExecutor(4) as pool:
            def write():
                list(pool.map(lambda io: os.pwrite(fd, bufs[io[0] % 4], io[1]), enumerate(offsets)))

            def read():
                list(pool.map(lambda io: os.preadv(fd, [bufs[io[0] % 4]], io[1]), enumerate(offsets)))

            w = _timed(write, reps)
            r = _timed(read, reps)
    finally:
        os.close(fd)
    return {"write": _rate(nbytes, w), "read": _rate(nbytes, r), "direct": direct,
            "direct_note": "" if direct else "O_DIRECT refused; buffered I/O (reads may come from the page cache)",
            "engine": "os.pwrite/os.preadv, 4 threads"}


def measure_disk(directory: str | os.PathLike, nbytes: int, reps: int, chunk: int = 8 << 20) -> dict:
    """Sequential O_DIRECT write (incl. fsync) then read of one ``nbytes`` file under ``directory``."""
    from tierstate.io import free_bytes

    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        free = free_bytes(directory)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot use --nvme-dir {directory}: {exc.strerror}", str(directory)) from exc
    if free < 2 * nbytes:
        raise OSError(28, f"--nvme-dir {directory} has {free / 2**30:.2f} GiB free; the probe writes "
                          f"{nbytes / 2**30:.2f} GiB: free space or use --quick", str(directory))
    path = directory / f".tierstate-probe-{os.getpid()}.bin"
    try:
        try:
            result = _disk_with_tierstate_io(path, nbytes, chunk, reps)
        except ImportError as exc:
            result = _disk_with_os(path, nbytes, chunk, reps)
            result["fallback_reason"] = str(exc)
    finally:
        path.unlink(missing_ok=True)
    result.update({
        "dir": str(directory), "bytes": nbytes, "request_bytes": chunk, "units": "B/s",
        "method": f"sequential O_DIRECT write (no fsync, as the NVMe tier writes) then read of a {nbytes >> 20} MiB file in {chunk >> 20} MiB requests, "
                  "all queued at once; the warm-up write allocates, timed writes overwrite",
        "write_bytes_per_s": result["write"]["median"], "read_bytes_per_s": result["read"]["median"],
        "free_bytes": free,
    })
    return result


def measure_cuda(nbytes: int, reps: int) -> dict:
    import torch

    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device (torch.cuda.is_available() is False); H2D/D2H and device memory "
                           "not measured"}
    dev = torch.device("cuda")
    free, total = torch.cuda.mem_get_info(dev)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    other = torch.empty_like(device)

    def synced(fn):
        def run():
            fn()
            torch.cuda.synchronize(dev)
        return run

    h2d = _rate(nbytes, _timed(synced(lambda: device.copy_(host, non_blocking=True)), reps))
    d2h = _rate(nbytes, _timed(synced(lambda: host.copy_(device, non_blocking=True)), reps))
    dbw = _rate(2 * nbytes, _timed(synced(lambda: other.copy_(device)), reps))
    size = 8192
    x = torch.randn(size, size, device=dev, dtype=torch.bfloat16)
    mm = _rate(2.0 * size ** 3, _timed(synced(lambda: torch.mm(x, x)), reps))
    del host, device, other, x
    return {
        "method": f"pinned {nbytes >> 20} MiB copies, device copy (2 bytes moved per byte), bf16 {size}^3 matmul",
        "units": "B/s, FLOP/s, bytes", "name": torch.cuda.get_device_name(dev),
        "h2d_bytes_per_s": h2d["median"], "d2h_bytes_per_s": d2h["median"], "h2d": h2d, "d2h": d2h,
        "device_bandwidth_bytes_per_s": dbw["median"], "matmul_flops": mm["median"],
        "free_bytes": free, "total_bytes": total,
    }


def run_probe(nvme_dirs: list[str] | None = None, quick: bool = False) -> dict:
    """Measure this machine; returns the profile (not saved). ``quick``: small buffers, fewer
    repetitions (~1 s without ``nvme_dirs`` on a 2-vCPU VM)."""
    import torch
    from tierstate import __version__

    t0 = time.perf_counter()
    size = dict(array=32 << 20, adam=4 << 20, mm=1024, disk=64 << 20, cuda=64 << 20, reps=3) if quick else \
        dict(array=256 << 20, adam=16 << 20, mm=1024, disk=512 << 20, cuda=512 << 20, reps=7)
    notes = []
    m: dict = {}
    m["host_memory_bandwidth"] = measure_host_bandwidth(size["array"], size["reps"])
    # the full probe streams beyond the last-level cache (300 MiB L3 seen on a 2-vCPU VM)
    adam = size["adam"] if quick else beyond_cache_numel(size["adam"], 16)
    m.update(measure_optimizer_step(adam, size["reps"]))
    m["host_matmul"] = measure_host_matmul(size["mm"], size["reps"])
    m["nvme"] = [measure_disk(d, size["disk"], 1 if quick else 2) for d in (nvme_dirs or [])]
    if not nvme_dirs:
        notes.append("no --nvme-dir given: disk not measured (the planner then uses conservative disk rates)")
    m["cuda"] = measure_cuda(size["cuda"], size["reps"])
    if "skipped" in m["cuda"]:
        notes.append(m["cuda"]["skipped"])
    slowdown = bf16_slowdown(m["host_matmul"])
    if slowdown > SLOW_BF16_FACTOR:
        notes.append(f"bf16 matmul runs {slowdown:.0f}x slower than fp32 on this CPU (no bf16 matrix units): "
                     "train CPU models in fp32, not under bf16 autocast or with bf16 parameters "
                     "(tierstate's optimizer kernels are fast in either precision)")
    if m["optimizer_step"]["impl"].startswith("pure-torch"):
        notes.append("the native kernels did not load: optimizer_step measures the slower reference kernels")
    return {
        "schema_version": SCHEMA_VERSION,
        "tierstate_version": __version__,
        "created_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "mode": "quick" if quick else "default",
        "duration_s": round(time.perf_counter() - t0, 2),
        "machine": machine_facts(),
        "measurements": m,
        "notes": notes,
        "torch_threads": torch.get_num_threads(),
    }


# -- command line -------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``tierstate probe``."""
    parser.add_argument("--nvme-dir", action="append", default=[], metavar="DIR",
                        help="measure read/write bandwidth of this folder (repeatable; writes a temporary file)")
    parser.add_argument("--out", metavar="PATH", help=f"where to save the profile (default {default_profile_path()}, "
                                                      "or $TIERSTATE_PROFILE)")
    parser.add_argument("--quick", action="store_true", help="~1 s with small buffers (less accurate)")
    parser.add_argument("--json", action="store_true", help="print the profile as JSON")
    parser.add_argument("--no-save", action="store_true", help="measure and print only")


def _summary_rows(profile: dict) -> list[tuple[str, str]]:
    m = profile["measurements"]
    rows = []
    for t, r in m["host_memory_bandwidth"]["by_threads"].items():
        rows.append((f"host memory triad, {t} thread(s)", f"{r['median'] / 1e9:.1f} GB/s ({r['min'] / 1e9:.1f}-{r['max'] / 1e9:.1f})"))
    step = m["optimizer_step"]
    for t, r in step["by_threads"].items():
        rows.append((f"AdamW step, {t} thread(s)", f"{r['median'] / 1e9:.2f} Gparam/s ({step['impl']})"))
    rows.append(("gradient norm pass", f"{m['grad_sumsq']['best'] / 1e9:.2f} Gparam/s"))
    for maps, rate in (m.get("compressed_step") or {}).get("by_maps", {}).items():
        rows.append((f"AdamW step, 8-bit moments ({maps} maps)", f"{rate / 1e9:.2f} Gparam/s"))
    for dtype, r in m["host_matmul"]["by_dtype"].items():
        rows.append((f"CPU matmul {dtype}", f"{r['median'] / 1e9:.0f} GFLOP/s"))
    for d in m["nvme"]:
        rows.append((f"disk {d['dir']}", f"write {d['write_bytes_per_s'] / 1e9:.2f} GB/s, read "
                                         f"{d['read_bytes_per_s'] / 1e9:.2f} GB/s ({'O_DIRECT' if d['direct'] else 'buffered'})"))
    cuda = m["cuda"]
    if "skipped" in cuda:
        rows.append(("CUDA", "skipped: no CUDA device"))
    else:
        rows.append((f"CUDA {cuda['name']}", f"H2D {cuda['h2d_bytes_per_s'] / 1e9:.1f} GB/s, D2H "
                                             f"{cuda['d2h_bytes_per_s'] / 1e9:.1f} GB/s, free {cuda['free_bytes'] / 2**30:.1f} GiB"))
    return rows


def main(args: argparse.Namespace) -> int:
    """Run ``tierstate probe``; returns the exit status."""
    try:
        profile = run_probe(args.nvme_dir, quick=args.quick)
    except OSError as exc:
        print(f"tierstate probe: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(profile, indent=2))
    else:
        try:
            from rich.console import Console
            from rich.table import Table

            table = Table(title=f"tierstate probe ({profile['mode']}, {profile['duration_s']} s)")
            table.add_column("measurement")
            table.add_column("result")
            for row in _summary_rows(profile):
                table.add_row(*row)
            Console().print(table)
        except ImportError:
            for name, value in _summary_rows(profile):
                print(f"{name:40s} {value}")
        for note in profile["notes"]:
            print(f"note: {note}")
    if not args.no_save:
        try:
            path = save_profile(profile, args.out)
        except OSError as exc:
            print(f"tierstate probe: {exc}", file=sys.stderr)
            return 1
        print(f"profile saved to {path}", file=sys.stderr if args.json else sys.stdout)
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(allow_abbrev=False, prog="tierstate probe", description=__doc__.split("\n")[0])
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
