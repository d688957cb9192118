"""``tierstate bench step --offload nvme``: the NVMe-tier optimizer step against its floor.

    python -m tierstate.bench.nvme_step --params 100M [--dtype bf16] [--json]

One run measures, on the same folder and the same I/O engine (same block size):

- the disk's sequential write and read bandwidth (records-sized requests, O_DIRECT,
  overwriting a file first written once, as the tier's files are after the first step),
  probed before, halfway through and after the timed steps (medians: the disk drifts);
- the CPU step time: ``ts.AdamW(offload="cpu")`` on a copy of the same parameters and
  gradients, interleaved with the NVMe steps so both see the same memory-bandwidth
  phase of the machine;
- the NVMe step time, and the bytes it moved (from its telemetry).

floor = max(disk time of the step's bytes, CPU step time), the disk time being the
smaller of (read bytes / read GB/s + write bytes / write GB/s) and (all bytes / GB/s of
reads and writes at once); the target
is NVMe step <= 1.15 x floor. Times are medians over the timed steps.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from ..placement.model_spec import parse_count
from ..telemetry.progress import progress

TARGET_RATIO = 1.15
# measure_disk's rates, in GB/s: one direction at a time, and reads and writes at once
_DISK_RATES = ("write_gbps", "read_gbps", "mixed_gbps")


def _count(text: str) -> int:
    """'100M' -> 100_000_000; '1.5G', '250k' and plain integers too."""
    try:
        return parse_count(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of the NVMe step benchmark."""
    from ..placement import DEFAULT_BUFFER_COUNT, DEFAULT_SUBGROUP_NUMEL

    parser.add_argument("--params", type=_count, default=100_000_000, help="parameters (default 100M)")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                        help="parameter dtype; bf16 keeps an fp32 master in the tier (default fp32)")
    parser.add_argument("--moment-dtype", choices=("fp32", "bf16"), default="fp32", help="optimizer moments' dtype")
    parser.add_argument("--param-numel", type=_count, default=4_000_000,
                        help="elements per parameter tensor (the last one takes the rest; default 4M)")
    parser.add_argument("--subgroup-numel", type=_count, default=DEFAULT_SUBGROUP_NUMEL,
                        help=f"Offload.subgroup_numel (default {DEFAULT_SUBGROUP_NUMEL})")
    parser.add_argument("--buffer-count", type=int, default=DEFAULT_BUFFER_COUNT,
                        help=f"Offload.buffer_count (default {DEFAULT_BUFFER_COUNT}, the library's)")
    parser.add_argument("--nvme-dir", default=None,
                        help="folder for the state files and the disk probe (default: a temporary folder under "
                             "TIERSTATE_NVME_DIR or the tierstate cache dir)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant (default 5)")
    parser.add_argument("--probe-bytes", type=_count, default=256 << 20,
                        help="bytes each way per disk probe, at least the step's (default 256 MiB); the disk "
                             "is probed before, halfway through and after the timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def _gbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def measure_disk(folder: Path, nbytes: int, request_bytes: int, in_flight: int = 2, reps: int = 3) -> dict:
    """Sequential O_DIRECT write and read GB/s of the I/O engine on ``folder`` (medians of ``reps``).

    ``nbytes`` is rounded up to whole requests; the file is written once untimed (the
    tier's files are allocated the same way: first write, then overwrites)."""
    from .. import io as tio

    count = max(1, -(-nbytes // request_bytes))
    path = folder / f"disk-probe-{os.getpid()}.bin"
    buffers = [tio.aligned_empty(request_bytes) for _ in range(in_flight)]
    for b in buffers:
        b.fill_(0x5A)

    def sweep(f, write: bool) -> float:
        t0 = time.perf_counter()
        futures = []
        for i in range(count):
            if len(futures) == in_flight:
                futures.pop(0).get()
            buf = buffers[i % in_flight]
            op = f.pwrite if write else f.pread
            futures.append(op(buf, i * request_bytes))
        for fut in futures:
            fut.get()
        return time.perf_counter() - t0

    def mixed(f) -> float:
        """Read the first half while writing the second, as the tier's step does."""
        half = count // 2 or 1
        t0 = time.perf_counter()
        futures = []
        for i in range(half):
            if len(futures) >= 2 * in_flight:
                futures.pop(0).get()
                futures.pop(0).get()
            futures.append(f.pread(read_bufs[i % in_flight], i * request_bytes))
            futures.append(f.pwrite(buffers[i % in_flight], (half + i) * request_bytes))
        for fut in futures:
            fut.get()
        return time.perf_counter() - t0

    read_bufs = [tio.aligned_empty(request_bytes) for _ in range(in_flight)]
    try:
        tio.reserve(path, count * request_bytes)
        with tio.File(path, "r+", direct=True) as f:
            sweep(f, True)
            writes, reads, mixes = [], [], []
            for _ in range(reps):
                writes.append(sweep(f, True))
                reads.append(sweep(f, False))
                mixes.append(mixed(f))
            direct = f.direct
        engine = tio.default_engine()
        total = count * request_bytes
        return {
            "bytes": total,
            "write_gbps": _gbps(total, statistics.median(writes)),
            "read_gbps": _gbps(total, statistics.median(reads)),
            # reads and writes at once (equal bytes each), counting both directions
            "mixed_gbps": _gbps(2 * (count // 2 or 1) * request_bytes, statistics.median(mixes)),
            "direct": direct,
            "backend": engine.backend,
            "block_size": engine.block_size,
            "queue_depth": engine.queue_depth,
        }
    finally:
        path.unlink(missing_ok=True)


def _params(n: int, per: int, dtype: torch.dtype, seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    sizes = [per] * (n // per) + ([n % per] if n % per else [])
    out = []
    for size in sizes:
        p = torch.nn.Parameter(torch.randn(size, generator=gen).to(dtype))
        p.grad = (torch.randn(size, generator=gen) * 1e-2).to(dtype)
        out.append(p)
    return out


def _timed_step(opt) -> tuple[float, dict]:
    t0 = time.perf_counter()
    opt.step()
    wall = time.perf_counter() - t0
    stats = opt.stats()
    return wall, {"bytes": dict(stats.bytes), "nvme_wait": stats.phases.get("nvme_wait", 0.0)}


def run(args: argparse.Namespace) -> dict:
    """Run the benchmark; returns the figures ``main`` prints."""
    import tierstate as ts
    from ..kernels import backend_info
    from ..placement import default_nvme_root

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    moment = torch.bfloat16 if args.moment_dtype == "bf16" else torch.float32
    root = Path(args.nvme_dir) if args.nvme_dir else default_nvme_root()
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-step-", dir=root))
    try:
        offload = ts.Offload(cpu=0.0, nvme=1.0, nvme_dir=work / "state", subgroup_numel=args.subgroup_numel,
                             buffer_count=args.buffer_count, moment_dtype=moment)
        nvme_params = _params(args.params, args.param_numel, dtype, seed=0)
        cpu_params = _params(args.params, args.param_numel, dtype, seed=0)
        nvme_opt = ts.AdamW(nvme_params, lr=1e-3, offload=offload)
        cpu_opt = ts.AdamW(cpu_params, lr=1e-3, offload=ts.Offload(cpu=1.0, moment_dtype=moment))
        tier = nvme_opt.tiers[ts.placement.TierKind.NVME]
        for _ in range(args.warmup):
            cpu_opt.step()
            nvme_opt.step()
        # The disk's speed drifts over minutes here (reads 1.7-3.2 GB/s across runs), so it is
        # probed before, halfway through and after the timed steps; the floor takes the medians.
        pool = tier.pool_nbytes // tier.record_nbytes
        probe_bytes = max(tier.record_nbytes * max(1, len(tier.subgroups) - pool), args.probe_bytes)
        disks = []

        def probe_disk() -> None:
            disks.append(measure_disk(work, probe_bytes, tier.record_nbytes, reps=1))

        probe_disk()
        cpu_times, nvme_times, reads, writes, waits = [], [], [], [], []
        with progress(args.steps, "cpu and nvme steps") as advance:
            for i in range(args.steps):
                if i == args.steps // 2 and i > 0:
                    probe_disk()
                pair = [(cpu_opt, cpu_times), (nvme_opt, nvme_times)]
                for opt, times in (pair if i % 2 == 0 else pair[::-1]):
                    wall, info = _timed_step(opt)
                    times.append(wall)
                    if opt is nvme_opt:
                        reads.append(info["bytes"].get("nvme/read", 0))
                        writes.append(info["bytes"].get("nvme/write", 0))
                        waits.append(info["nvme_wait"])
                advance()  # between pairs of timed steps
        read_bytes, write_bytes = statistics.median(reads), statistics.median(writes)
        probe_disk()
        disk = dict(disks[-1], **{k: statistics.median(d[k] for d in disks) for k in _DISK_RATES},
                    probes=len(disks), per_probe=[{k: d[k] for k in _DISK_RATES} for d in disks])
        result = {
            "params": args.params,
            "dtype": args.dtype,
            "moment_dtype": args.moment_dtype,
            "subgroups": len(tier.subgroups),
            "subgroup_numel": args.subgroup_numel,
            "buffer_count": args.buffer_count,
            "pool_bytes": tier.pool_nbytes,
            "state_bytes": tier.nbytes,
            "direct": tier.direct,
            "kernels": backend_info()["isa"],
            "disk": disk,
            "cpu_step_s": statistics.median(cpu_times),
            "nvme_step_s": statistics.median(nvme_times),
            "nvme_steps_s": nvme_times,
            "cpu_steps_s": cpu_times,
            "nvme_wait_s": statistics.median(waits),
            "read_bytes": read_bytes,
            "write_bytes": write_bytes,
            "read_bytes_per_step": reads,
            "write_bytes_per_step": writes,
        }
        nvme_opt.close()
        cpu_opt.close()
    finally:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    # The disk's time for the step's bytes: one direction after the other, or both at once
    # (the tier overlaps reads and writes); the faster of the two is the floor.
    serial_s = read_bytes / (disk["read_gbps"] * 1e9) + write_bytes / (disk["write_gbps"] * 1e9)
    mixed_s = (read_bytes + write_bytes) / (disk["mixed_gbps"] * 1e9)
    io_s = min(serial_s, mixed_s)
    result["io_serial_s"], result["io_mixed_s"] = serial_s, mixed_s
    result["io_floor_s"] = io_s
    result["floor_s"] = max(io_s, result["cpu_step_s"])
    result["bound"] = "disk" if io_s >= result["cpu_step_s"] else "cpu"
    result["ratio"] = result["nvme_step_s"] / result["floor_s"]
    result["achieved_gbps"] = _gbps(read_bytes + write_bytes, result["nvme_step_s"])
    result["target_ratio"] = TARGET_RATIO
    result["uptime"] = _load_average()
    return result


def _load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def _binary(n: int) -> str:
    """4194304 -> '4 Mi', 262144 -> '256 Ki' (whole units where they divide)."""
    for unit, size in (("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)):
        if n >= size:
            return f"{n / size:.0f} {unit}" if n % size == 0 else f"{n / size:.1f} {unit}"
    return str(n)


def format_table(r: dict) -> str:
    d = r["disk"]
    gib = 2**30
    rows = [
        ("parameters", f"{r['params'] / 1e6:.0f}M {r['dtype']} (moments {r['moment_dtype']})"),
        ("sub-groups x pool", f"{r['subgroups']} x {_binary(r['subgroup_numel'])} elems; pool "
                              f"{r['buffer_count']} x {_binary(r['pool_bytes'] // r['buffer_count'])}B"),
        ("state on disk", f"{r['state_bytes'] / gib:.2f} GiB ({'O_DIRECT' if r['direct'] else 'buffered'}, "
                          f"{d['backend']}, block {d['block_size'] >> 10} KiB, qd {d['queue_depth']})"),
        ("disk write / read / both", f"{d['write_gbps']:.2f} / {d['read_gbps']:.2f} / {d['mixed_gbps']:.2f} GB/s "
                                     f"(engine, sequential, median of {d['probes']} probes around the steps: "
                                     + ", ".join("/".join(f"{p[k]:.2f}" for k in _DISK_RATES) for p in d["per_probe"])
                                     + "; 'both' = reads and writes at once)"),
        ("bytes moved / step", f"read {r['read_bytes'] / gib:.2f} GiB, write {r['write_bytes'] / gib:.2f} GiB"),
        ("I/O time at disk speed", f"{r['io_floor_s'] * 1e3:.0f} ms (serial {r['io_serial_s'] * 1e3:.0f}, "
                                   f"both at once {r['io_mixed_s'] * 1e3:.0f})"),
        ("CPU step (offload cpu)", f"{r['cpu_step_s'] * 1e3:.0f} ms ({r['kernels']} kernels)"),
        ("floor", f"{r['floor_s'] * 1e3:.0f} ms ({r['bound']}-bound)"),
        ("NVMe step", f"{r['nvme_step_s'] * 1e3:.0f} ms (of it blocked on I/O: {r['nvme_wait_s'] * 1e3:.0f} ms); "
                      f"achieved {r['achieved_gbps']:.2f} GB/s"),
        ("NVMe step / floor", f"{r['ratio']:.2f}x (target <= {r['target_ratio']:.2f}x)"),
        ("load average", r["uptime"]),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def main(args: argparse.Namespace) -> int:
    """Run and print (table or ``--json``); returns the exit status."""
    for name in ("steps", "buffer_count"):
        if getattr(args, name) < (1 if name == "steps" else 2):
            print(f"--{name.replace('_', '-')} must be at least {1 if name == 'steps' else 2}", file=sys.stderr)
            return 2
    result = run(args)
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="python -m tierstate.bench.nvme_step", description=__doc__.split("\n")[0])
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
