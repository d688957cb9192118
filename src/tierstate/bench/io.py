"""``tierstate bench io``: sequential write and read bandwidth of the I/O engine (each
backend) against fio (io_uring and libaio, when ``fio`` is on PATH) and DeepSpeed's aio
handle (when importable), on the same file, size, block size and queue depth.

Methods run interleaved within each repetition (write, then drop the page cache when
root, then read), so that drifts of the machine hit all of them alike; cells are the
median over repetitions with the min-max range. GB/s = 1e9 bytes/s. Writes overwrite
one preallocated file in place, and include an fsync at the end (fio: ``end_fsync=1``).

    python -m tierstate.bench.io --size 1G --reps 5 [--dir /nvme/tmp] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable

from ..io.engine import DEFAULT_BLOCK_SIZE
from ..telemetry.progress import progress

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_bytes(text: str) -> int:
    """'1G' -> 1073741824; accepts K/M/G/T with an optional 'iB'/'B' suffix, or a plain integer."""
    s = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = s[-1] if s and s[-1] in _UNITS else ""
    number = s[: len(s) - len(unit)]
    try:
        value = float(number) * _UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; use e.g. 1G, 512M, 4096") from None
    if value <= 0 or value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive whole number of bytes")
    return int(value)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the options of ``tierstate bench io`` to ``parser``."""
    parser.add_argument("--dir", default=None,
                        help="directory for the test file (default: a temporary folder under the "
                             "current directory, removed afterwards)")
    parser.add_argument("--size", type=parse_bytes, default=1 << 30, help="file size (default 1G)")
    parser.add_argument("--block-size", type=parse_bytes, default=DEFAULT_BLOCK_SIZE,
                        help=f"bytes per I/O (default {DEFAULT_BLOCK_SIZE >> 20}M, the engine's)")
    parser.add_argument("--queue-depth", type=int, default=32, help="I/Os in flight (default 32)")
    parser.add_argument("--threads", type=int, default=None,
                        help="engine workers: default 1 for io_uring (one ring, like one fio job) "
                             "and min(queue depth, 8) for the thread pool")
    parser.add_argument("--reps", type=int, default=5, help="repetitions; cells are medians (default 5)")
    parser.add_argument("--backends", default="all",
                        help="engine backends to measure: all (those available), uring, threads, "
                             "or a comma list")
    parser.add_argument("--small-pages", action="store_true",
                        help="also time the first backend over a buffer of 4 KiB pages (the default "
                             "buffer uses transparent huge pages where the kernel has them)")
    parser.add_argument("--no-fio", action="store_true", help="skip fio even when installed")
    parser.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeed's aio handle")
    parser.add_argument("--json", default=None, metavar="PATH",
                        help="also write the results as JSON to PATH ('-' for stdout)")


@dataclass
class Method:
    name: str
    write: Callable[[], float]   # returns seconds
    read: Callable[[], float]
    note: str = ""
    write_gbps: list[float] = field(default_factory=list)
    read_gbps: list[float] = field(default_factory=list)
    error: str = ""


def drop_page_cache() -> bool:
    """sync + drop the page cache (root only). Returns whether it was dropped."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
        return True
    except OSError:
        return False


# ---- methods -------------------------------------------------------------------------

def _engine_method(backend: str, path: str, size: int, args, buf, label: str = "",
                   huge_pages: bool = True) -> Method:
    import tierstate.io as tio

    engine = tio.Engine(backend=backend, threads=args.threads, queue_depth=args.queue_depth,
                        block_size=args.block_size)
    threads = engine.threads
    handle = tio.File(path, "r+", engine=engine)
    if not handle.direct:
        note = f"buffered: {handle.direct_note}"
    else:
        note = f"O_DIRECT, threads={threads}" + (f", qd={args.queue_depth}/ring" if backend == "uring" else "")
        note += ", " + _page_note(buf, huge_pages)

    def write() -> float:
        t0 = time.perf_counter()
        n = handle.pwrite(buf, 0, size).get()
        handle.sync()
        dt = time.perf_counter() - t0
        if n != size:
            raise RuntimeError(f"engine wrote {n} of {size} bytes")
        return dt

    def read() -> float:
        t0 = time.perf_counter()
        n = handle.pread(buf, 0, size).get()
        dt = time.perf_counter() - t0
        if n != size:
            raise RuntimeError(f"engine read {n} of {size} bytes")
        return dt

    m = Method(f"tierstate {backend}{label}", write, read, note)
    m.close = lambda: (handle.close(), engine.close())  # type: ignore[attr-defined]
    return m


def _page_note(buf, huge_pages: bool) -> str:
    """Which pages back ``buf`` (from tierstate.io.aligned_empty, asked for huge pages or not):
    a direct request over 4 KiB pages is split at the device's segment limit, so this moves
    the figures a lot. Asks the kernel (smaps' THPeligible) rather than trusting the request."""
    import tierstate.io as tio

    page = tio.huge_page_size()
    huge = huge_pages and page > 0 and buf.numel() >= page and tio.huge_page_eligible(buf.data_ptr())
    return "huge-page buffer" if huge else "4 KiB-page buffer"


def _fio_method(ioengine: str, path: str, size: int, args) -> Method:
    def run(rw: str) -> float:
        cmd = ["fio", "--name=tierstate-bench", f"--filename={path}", f"--rw={rw}",
               f"--bs={args.block_size}", f"--size={size}", "--direct=1", f"--iodepth={args.queue_depth}",
               f"--ioengine={ioengine}", "--numjobs=1", "--output-format=json"]
        if rw == "write":
            cmd.append("--end_fsync=1")
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"fio failed: {r.stderr.strip()[-300:]}")
        job = json.loads(r.stdout[r.stdout.index("{"):])["jobs"][0][rw]
        if job["io_bytes"] != size:
            raise RuntimeError(f"fio moved {job['io_bytes']} of {size} bytes")
        return size / job["bw_bytes"]

    return Method(f"fio {ioengine}", lambda: run("write"), lambda: run("read"),
                  f"direct=1, iodepth={args.queue_depth}, numjobs=1")


def _deepspeed_method(path: str, size: int, args) -> Method | str:
    try:
        import torch
        from deepspeed.ops.op_builder import AsyncIOBuilder

        h = AsyncIOBuilder().load().aio_handle(args.block_size, args.queue_depth, False, True, 1)
        buf = h.new_cpu_locked_tensor(size, torch.empty(0, dtype=torch.uint8))
    except Exception as exc:  # not installed, or its op fails to build: reported, not fatal
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"

    def write() -> float:
        t0 = time.perf_counter()
        h.sync_pwrite(buf, path)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return time.perf_counter() - t0

    def read() -> float:
        t0 = time.perf_counter()
        h.sync_pread(buf, path)
        return time.perf_counter() - t0

    return Method("deepspeed aio", write, read, "locked buffer, intra_op_parallelism=1")


# ---- run -------------------------------------------------------------------------------

def _median_range(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def _selected_backends(spec: str) -> list[str]:
    import tierstate.io as tio

    have_uring, _ = tio.uring_available()
    available = ["uring", "threads"] if have_uring else ["threads"]
    if spec == "all":
        return available
    wanted = [b.strip() for b in spec.split(",") if b.strip()]
    for b in wanted:
        if b not in ("uring", "threads"):
            raise ValueError(f"--backends: {b!r} is not a backend; use uring, threads or all")
    return wanted


def main(args: argparse.Namespace) -> int:
    """Runs the benchmark described by ``args`` (see :func:`add_arguments`); returns an exit code."""
    import tierstate.io as tio

    if args.size % args.block_size:
        print(f"--size {args.size} must be a multiple of --block-size {args.block_size}", file=sys.stderr)
        return 2
    if args.reps < 1 or args.queue_depth < 1:
        print("--reps and --queue-depth must be >= 1", file=sys.stderr)
        return 2
    own_dir = args.dir is None
    directory = tempfile.mkdtemp(prefix="tierstate-bench-io-", dir=os.getcwd()) if own_dir else args.dir
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "tierstate-bench-io.dat")
    size = args.size
    methods: list[Method] = []
    skipped: dict[str, str] = {}
    try:
        tio.reserve(path, size)
        buf = tio.aligned_empty(size)
        buf.random_(0, 256)
        with tio.File(path, "r+") as f:   # lay the file out once: every timed write overwrites
            f.write(buf)
            f.sync()

        backends = _selected_backends(args.backends)
        for backend in backends:
            methods.append(_engine_method(backend, path, size, args, buf))
        if args.small_pages and backends and tio.huge_page_size():
            # the same engine over an ordinary buffer: what the huge pages are worth here
            small = tio.aligned_empty(size, huge_pages=False)
            small.copy_(buf)
            methods.append(_engine_method(backends[0], path, size, args, small, label=", 4K pages",
                                          huge_pages=False))
        if args.no_fio:
            skipped["fio"] = "--no-fio"
        elif shutil.which("fio") is None:
            skipped["fio"] = "fio not on PATH (apt-get install fio)"
        else:
            methods += [_fio_method("io_uring", path, size, args), _fio_method("libaio", path, size, args)]
        if args.no_deepspeed:
            skipped["deepspeed aio"] = "--no-deepspeed"
        else:
            ds = _deepspeed_method(path, size, args)
            if isinstance(ds, str):
                skipped["deepspeed aio"] = ds
            else:
                methods.append(ds)

        dropped_all = True
        load_before = os.getloadavg()
        with progress(args.reps, "sequential write + read") as advance:
            for _ in range(args.reps):
                for m in methods:
                    if m.error:
                        continue
                    try:
                        m.write_gbps.append(size / m.write() / 1e9)
                        dropped_all &= drop_page_cache()
                        m.read_gbps.append(size / m.read() / 1e9)
                    except Exception as exc:  # one failing method must not hide the others' figures
                        m.error = f"{type(exc).__name__}: {exc}"
                advance()  # between repetitions, outside the timed calls
        load_after = os.getloadavg()
    finally:
        for m in methods:
            close = getattr(m, "close", None)
            if close:
                close()
        if own_dir:
            shutil.rmtree(directory, ignore_errors=True)
        elif os.path.exists(path):
            os.remove(path)

    fio_ref = {d: max((statistics.median(getattr(m, f"{d}_gbps")) for m in methods
                       if m.name.startswith("fio") and getattr(m, f"{d}_gbps")), default=None)
               for d in ("write", "read")}
    result = {
        "config": {"dir": directory, "size": size, "block_size": args.block_size,
                   "queue_depth": args.queue_depth, "reps": args.reps,
                   "page_cache_dropped_before_reads": dropped_all,
                   "loadavg_before_after": [load_before[0], load_after[0]]},
        "methods": {m.name: {"note": m.note, "error": m.error, "write_gbps": m.write_gbps,
                             "read_gbps": m.read_gbps,
                             "write_median": statistics.median(m.write_gbps) if m.write_gbps else None,
                             "read_median": statistics.median(m.read_gbps) if m.read_gbps else None}
                    for m in methods},
        "skipped": skipped,
        "best_fio_median": fio_ref,
    }
    _print_table(result)
    if args.json == "-":
        print(json.dumps(result, indent=2))
    elif args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    return 1 if any(m.error for m in methods) else 0


def _print_table(result: dict) -> None:
    c = result["config"]
    print(f"sequential I/O, {c['size'] / 2**30:.3g} GiB file, block {c['block_size'] >> 10} KiB, "
          f"queue depth {c['queue_depth']}, median (min-max) of {c['reps']} reps, GB/s = 1e9 B/s; "
          f"page cache dropped before reads: {'yes' if c['page_cache_dropped_before_reads'] else 'NO (not root)'}; "
          f"load {c['loadavg_before_after'][0]:.2f} -> {c['loadavg_before_after'][1]:.2f}")
    ref = result["best_fio_median"]
    w = max([18] + [len(name) for name in result["methods"]])
    header = f"| {'method':<{w}} | {'write GB/s':<20} | {'read GB/s':<20} | vs best fio (w / r) | notes"
    print(header)
    print("|" + "-" * (w + 2) + "|" + "-" * 22 + "|" + "-" * 22 + "|" + "-" * 21 + "|------")
    for name, m in result["methods"].items():
        ratio = "-"
        if ref["write"] and ref["read"] and m["write_median"] and m["read_median"]:
            ratio = f"{m['write_median'] / ref['write']:.0%} / {m['read_median'] / ref['read']:.0%}"
        note = m["note"] + (f"; ERROR {m['error']}" if m["error"] else "")
        print(f"| {name:<{w}} | {_median_range(m['write_gbps']):<20} | {_median_range(m['read_gbps']):<20} "
              f"| {ratio:<19} | {note}")
    for name, why in result["skipped"].items():
        print(f"skipped {name}: {why}")


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(allow_abbrev=False, prog="python -m tierstate.bench.io", description=__doc__,
                                      formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
