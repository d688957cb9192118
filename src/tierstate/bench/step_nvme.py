"""The NVMe tier's half of ``tierstate bench step`` (``--offload nvme``): the step against its floor.

    tierstate bench step --offload nvme [--params 100M,400M] [--dtype bf16] [--json [PATH]]

For each size in ``--params``, one run measures, on the same folder and the same I/O
engine (same block size):

- the disk's sequential write and read bandwidth (records-sized requests, O_DIRECT,
  overwriting a file first written once, as the tier's files are after the first step),
  probed before the first timed step and after each one: the disk drifts by 10-20 %
  within seconds on the reference VM, so each step is priced against the two probes
  around it;
- the CPU step time: ``ts.AdamW(offload="cpu")`` on a copy of the same parameters and
  gradients, interleaved with the NVMe steps so both see the same memory-bandwidth
  phase of the machine;
- the NVMe step time, and the bytes it moved (from its telemetry).

Before each step the gradients reach ``.grad`` through autograd (:func:`deliver_gradients`),
so the optimizer's gradient hooks take their norm as in training and the step does not read
them again (until 2026-12-06 they were assigned, and each step began with that extra pass).

floor = max(disk time of the step's bytes, CPU step time), the disk time being the
smaller of (read bytes / read GB/s + write bytes / write GB/s) and (all bytes / GB/s of
reads and writes at once), at the mean rates of the probes just before and just after
the step. The ratio is the median over the timed steps of step time / its floor; the
target is <= 1.15.

The two default sizes are two regimes of the default pool: the state 1.5x and 6x what the
pool holds. For fp32 state (16 records of 4 Mi elements) they are 100M and 400M parameters:
at 100M two thirds of the state stays in the pool and each step streams 8 of its 24 records
each way, so the step's fixed costs before its first write (the first update; with
gradients assigned to ``.grad``, also a gradient-norm pass over all of them, ~20 ms on the
reference VM, ~9 % of the floor) weigh most there; at 400M 80 of 96 records
stream, as they do for the models NVMe offload is for. Compressed state's default pool holds
more records (31 to 63 of 4 Mi elements, the RAM of 16 fp32-state ones:
:func:`tierstate.placement.defaults.default_buffer_count`), so its default sizes grow with
it (294M and 1,175M parameters with a ``bf16_kahan`` master). Until 2026-12-06 they were
fp32 state's: at 100M such a pool held every record and the step moved nothing. A
``--buffer-count`` or ``--subgroup-numel`` scales them the same way; a size given with
``--params`` whose pool holds every record is run, and the table says nothing streamed.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from ._timing import JSON_STDOUT, count_arg, counts_arg, emit_json, interleave, load_average

TARGET_RATIO = 1.15
# fp32 state's default sizes: its state 1.5x and 6x the default pool of 16 x 4 Mi elements
DEFAULT_SIZES = (100_000_000, 400_000_000)
# measure_disk's rates, in GB/s: one direction at a time, and reads and writes at once
_DISK_RATES = ("write_gbps", "read_gbps", "mixed_gbps")


def add_arguments(group, option) -> None:
    """The options of the NVMe step, added to ``group`` with ``option`` (the command's
    ``add_argument`` that notes which options were given: see :mod:`tierstate.bench.step`)."""
    from ..placement import DEFAULT_BUFFER_COUNT, DEFAULT_SUBGROUP_NUMEL

    option(group, "--params", type=counts_arg, default=None,
           help="parameters, or a comma-separated list of sizes run one after the other "
                "(default: the state 1.5x and 6x the pool, 100M,400M for fp32 state; a default size that "
                "does not fit in the host RAM available is skipped, and says so)")
    option(group, "--dtype", choices=("fp32", "bf16"), default="fp32",
           help="parameter dtype; bf16 keeps an fp32 master in the tier (default fp32)")
    option(group, "--moment-dtype", choices=("fp32", "bf16", "q8"), default="fp32",
           help="optimizer moments' dtype; q8: blockwise 8-bit moments (docs/compressed_state.md)")
    option(group, "--quant-map", choices=("dynamic", "fp8"), default="dynamic",
           help="the 8-bit maps of --moment-dtype q8 (Offload.quant_map; default dynamic)")
    option(group, "--master-dtype", choices=("fp32", "bf16_kahan", "bf16_sr"), default="fp32",
           help="the master of --moment-dtype q8 (Offload.master_dtype; default fp32); a bf16 "
                "master of --dtype bf16 parameters is the parameter itself")
    option(group, "--param-numel", type=count_arg, default=4_000_000,
           help="elements per parameter tensor (the last one takes the rest; default 4M)")
    option(group, "--subgroup-numel", type=count_arg, default=DEFAULT_SUBGROUP_NUMEL,
           help=f"Offload.subgroup_numel (default {DEFAULT_SUBGROUP_NUMEL})")
    option(group, "--buffer-count", type=int, default=None,
           help=f"Offload.buffer_count (default: the library's, {DEFAULT_BUFFER_COUNT} records of fp32 state "
                "or their RAM in compressed records)")
    option(group, "--nvme-dir", default=None,
           help="folder for the state files and the disk probe (default: a temporary folder under "
                "TIERSTATE_NVME_DIR or the tierstate cache dir)")
    option(group, "--steps", type=int, default=5, help="timed steps per variant and size (default 5)")
    option(group, "--probe-bytes", type=count_arg, default=256 << 20,
           help="bytes each way per disk probe, at least the step's (default 256 MiB); the disk "
                "is probed before the first timed step and after each one")


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


def _params(n: int, per: int, dtype: torch.dtype, seed: int) -> tuple[list[torch.nn.Parameter], list[torch.Tensor]]:
    """Parameters of ``n`` elements in tensors of ``per``, and a gradient for each (not yet
    delivered: see :func:`deliver_gradients`)."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [per] * (n // per) + ([n % per] if n % per else [])
    params, grads = [], []
    for size in sizes:
        # drawn in place: a freed temporary of the same size would stay as a hole in glibc's
        # heap (see tierstate.host_allocator), 4 B/param more RSS at 400M (12.8 GiB, not 9.4)
        params.append(torch.nn.Parameter(torch.empty(size).normal_(generator=gen).to(dtype)))
        grads.append(torch.empty(size).normal_(std=1e-2, generator=gen).to(dtype))
    return params, grads


def deliver_gradients(params: list[torch.nn.Parameter], grads: list[torch.Tensor]) -> None:
    """Hand each parameter its gradient as backward does: autograd accumulates it into
    ``param.grad`` (a fresh copy) and runs the parameter's post-accumulate hooks, where the
    optimizer takes the gradient's sum of squares (``docs/step_modes.md``), so the step reads
    no gradient twice, as in training. Gradients assigned to ``.grad`` instead made every
    step read all of them once more for the norm first: 24-26 ms at 400M bf16 parameters
    before any I/O (2-vCPU Zen 4 VM, 2026-12-06), which training does not pay."""
    for p in params:
        p.grad = None
    torch.autograd.backward(params, grads)


# torch, Python, the disk probe's buffers: peak RSS less the estimate below was 0.40-0.42 GiB
# at 100M and 400M fp32 parameters (3.15 and 9.86 GiB measured with /usr/bin/time)
_BASE_BYTES = 512 << 20


def _param_dtype(args: argparse.Namespace) -> torch.dtype:
    """The parameters' dtype from ``--dtype``."""
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]


def _moment_offload(args: argparse.Namespace) -> dict:
    """The Offload keyword arguments of the moments' format (the options' names are Offload's spellings)."""
    if args.moment_dtype != "q8":
        return dict(moment_dtype=args.moment_dtype)
    return dict(moment_dtype="q8", quant_map=args.quant_map, master_dtype=args.master_dtype)


def _state_table(args: argparse.Namespace) -> dict[str, float]:
    """Stored bytes per element of each state key the tier keeps for these options."""
    from ..placement.defaults import is_own_master, state_bytes_per_element
    from ..placement.offload import dtype_name

    dtype = _param_dtype(args)
    master = args.master_dtype if args.moment_dtype == "q8" else "fp32"
    return state_bytes_per_element(args.moment_dtype, master, needs_master=not is_own_master(dtype_name(dtype), master))


def default_pool_records(args: argparse.Namespace) -> int:
    """Records the NVMe pool holds: ``--buffer-count``, or the library's default for this state."""
    from ..placement.defaults import default_buffer_count

    return args.buffer_count if args.buffer_count is not None else default_buffer_count(_state_table(args))


def default_sizes(args: argparse.Namespace) -> list[int]:
    """The sizes run without ``--params``: :data:`DEFAULT_SIZES` scaled by the pool's elements
    against fp32 state's default pool, so that the state is 1.5x and 6x the pool whatever its
    format (whole millions of parameters)."""
    from ..placement import DEFAULT_BUFFER_COUNT, DEFAULT_SUBGROUP_NUMEL

    scale = default_pool_records(args) * args.subgroup_numel / (DEFAULT_BUFFER_COUNT * DEFAULT_SUBGROUP_NUMEL)
    return [max(1, round(n * scale / 1e6)) * 1_000_000 for n in DEFAULT_SIZES]


def _host_bytes_needed(args: argparse.Namespace, params: int) -> int:
    """Host RAM the run holds at once: both copies of the parameters, their gradients and the
    gradients delivered to ``.grad`` (:func:`deliver_gradients`), the CPU optimizer's state
    (moments, and a master where the parameters are not their own), the NVMe tier's pool
    (records of the same state), and the interpreter's own."""
    dtype = _param_dtype(args)
    state = sum(_state_table(args).values())
    record = args.subgroup_numel * state
    return int(params * (6 * dtype.itemsize + state) + default_pool_records(args) * record + _BASE_BYTES)


def _disk_time(read_bytes: float, write_bytes: float, rates: dict) -> tuple[float, float]:
    """(serial, at once) seconds for the step's bytes at ``rates`` (GB/s, as measure_disk gives)."""
    serial = read_bytes / (rates["read_gbps"] * 1e9) + write_bytes / (rates["write_gbps"] * 1e9)
    mixed = (read_bytes + write_bytes) / (rates["mixed_gbps"] * 1e9)
    return serial, mixed


def _ram_shortfall(args: argparse.Namespace, params: int) -> str | None:
    """Why ``params`` parameters do not fit in the host RAM available now, or None if they do."""
    import psutil

    needed = _host_bytes_needed(args, params)
    available = psutil.virtual_memory().available
    if needed <= 0.9 * available:
        return None
    return (f"--params {params / 1e6:.0f}M needs about {needed / 2**30:.1f} GiB of host RAM (parameters and "
            f"gradients three times, the CPU optimizer's moments, the pool) and {available / 2**30:.1f} GiB is available")


def _sizes(args: argparse.Namespace) -> list[int]:
    """The sizes to run: those asked for (refused, before any runs, if one does not fit in RAM),
    or the default ones that fit (saying which do not)."""
    sizes = []
    for params in args.params if args.params is not None else default_sizes(args):
        shortfall = _ram_shortfall(args, params)
        if shortfall and args.params is not None:
            raise SystemExit(f"tierstate bench step --offload nvme: {shortfall}: pass a smaller --params")
        if shortfall:
            print(f"tierstate bench step --offload nvme: skipping the default size {params / 1e6:.0f}M: {shortfall}",
                  file=sys.stderr)
        else:
            sizes.append(params)
    return sizes


def run_size(args: argparse.Namespace, params: int) -> dict:
    """Benchmark one size (``params`` parameters, checked against the RAM by :func:`_sizes`);
    returns the figures ``format_table`` prints."""
    import tierstate as ts
    from ..kernels import backend_info
    from ..placement import default_nvme_root

    dtype = _param_dtype(args)
    root = Path(args.nvme_dir) if args.nvme_dir else default_nvme_root()
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-step-", dir=root))
    try:
        offload = ts.Offload(cpu=0.0, nvme=1.0, nvme_dir=work / "state", subgroup_numel=args.subgroup_numel,
                             buffer_count=args.buffer_count, **_moment_offload(args))
        nvme_params, nvme_grads = _params(params, args.param_numel, dtype, seed=0)
        cpu_params, cpu_grads = _params(params, args.param_numel, dtype, seed=0)
        nvme_opt = ts.AdamW(nvme_params, lr=1e-3, offload=offload)
        cpu_opt = ts.AdamW(cpu_params, lr=1e-3, offload=ts.Offload(cpu=1.0, **_moment_offload(args)))
        tier = next(t for t in nvme_opt.tiers.values() if t.does_io)  # all state is in the one I/O tier
        # The disk's speed drifts by 10-20 % within seconds on the reference VM (reads 1.7-3.2
        # GB/s across runs), so it is probed before the first timed step and after each one, and
        # each step is priced at the mean of the probes on either side of it.
        pool = tier.pool_nbytes // tier.record_nbytes
        probe_bytes = max(tier.record_nbytes * max(1, len(tier.subgroups) - pool), args.probe_bytes)
        disks, reads, writes, waits, norms = [], [], [], [], []

        def probe_disk() -> None:
            disks.append(measure_disk(work, probe_bytes, tier.record_nbytes, reps=1))

        def after_round() -> None:
            stats = nvme_opt.stats()  # the NVMe optimizer's last step, whichever ran second
            reads.append(dict(stats.bytes).get("nvme/read", 0))
            writes.append(dict(stats.bytes).get("nvme/write", 0))
            waits.append(stats.phases.get("nvme_wait", 0.0))
            norms.append(stats.phases.get("grad_norm", 0.0))  # none: the hooks took it (deliver_gradients)
            probe_disk()

        times = interleave({"cpu": cpu_opt.step, "nvme": nvme_opt.step}, args.steps, args.warmup,
                           f"cpu and nvme steps, {params / 1e6:.0f}M", alternate=True,
                           before_timed=probe_disk, after_round=after_round,
                           before_call={"cpu": lambda: deliver_gradients(cpu_params, cpu_grads),
                                        "nvme": lambda: deliver_gradients(nvme_params, nvme_grads)})
        cpu_times, nvme_times = times["cpu"], times["nvme"]
        read_bytes, write_bytes = statistics.median(reads), statistics.median(writes)
        disk = dict(disks[-1], **{k: statistics.median(d[k] for d in disks) for k in _DISK_RATES},
                    probes=len(disks), per_probe=[{k: d[k] for k in _DISK_RATES} for d in disks])
        result = {
            "params": params,
            "dtype": args.dtype,
            "moment_dtype": args.moment_dtype + (f" ({args.quant_map} maps, {args.master_dtype} master)"
                                                 if args.moment_dtype == "q8" else ""),
            "subgroups": len(tier.subgroups),
            "subgroup_numel": args.subgroup_numel,
            "buffer_count": pool,
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
            "grad_norm_s": statistics.median(norms),
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
    # Each step against the disk as the probes on either side of it found it: one direction
    # after the other, or both at once (the tier overlaps reads and writes), whichever is
    # faster, or the CPU step timed next to it if that is longer.
    per_step = []
    for i, (nvme_s, cpu_s) in enumerate(zip(nvme_times, cpu_times)):
        around = {k: (disk["per_probe"][i][k] + disk["per_probe"][i + 1][k]) / 2 for k in _DISK_RATES}
        io_s = min(_disk_time(reads[i], writes[i], around))
        floor = max(io_s, cpu_s)
        per_step.append({"nvme_s": nvme_s, "cpu_s": cpu_s, "io_s": io_s, "floor_s": floor, "ratio": nvme_s / floor})
    result["per_step"] = per_step
    result["ratio"] = statistics.median(p["ratio"] for p in per_step)
    # The same at the medians (of the steps, and of all the probes): what one probe per run gives
    serial_s, mixed_s = _disk_time(read_bytes, write_bytes, disk)
    io_s = min(serial_s, mixed_s)
    result["io_serial_s"], result["io_mixed_s"] = serial_s, mixed_s
    result["io_floor_s"] = io_s
    result["floor_s"] = max(io_s, result["cpu_step_s"])
    result["bound"] = "disk" if io_s >= result["cpu_step_s"] else "cpu"
    result["ratio_of_medians"] = result["nvme_step_s"] / result["floor_s"]
    result["achieved_gbps"] = _gbps(read_bytes + write_bytes, result["nvme_step_s"])
    result["target_ratio"] = TARGET_RATIO
    result["uptime"] = load_average()
    return result


def run(args: argparse.Namespace) -> list[dict]:
    """Benchmark each size of ``args.params`` (default: :func:`default_sizes`) in turn; one result per size."""
    return [run_size(args, params) for params in _sizes(args)]


def _binary(n: int) -> str:
    """4194304 -> '4 Mi', 262144 -> '256 Ki' (whole units where they divide)."""
    for unit, size in (("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)):
        if n >= size:
            return f"{n / size:.0f} {unit}" if n % size == 0 else f"{n / size:.1f} {unit}"
    return str(n)


def format_table(r: dict) -> str:
    """One size's figures as a two-column table."""
    d = r["disk"]
    gib = 2**30
    rows = [
        ("parameters", f"{r['params'] / 1e6:.0f}M {r['dtype']} (moments {r['moment_dtype']})"),
        ("sub-groups x pool", f"{r['subgroups']} x {_binary(r['subgroup_numel'])} elems; pool "
                              f"{r['buffer_count']} x {_binary(r['pool_bytes'] // r['buffer_count'])}B"),
        ("state on disk", f"{r['state_bytes'] / gib:.2f} GiB = {r['state_bytes'] / r['pool_bytes']:.1f}x the pool "
                          f"({'O_DIRECT' if r['direct'] else 'buffered'}, "
                          f"{d['backend']}, block {d['block_size'] >> 10} KiB, qd {d['queue_depth']})"
                          + ("; the pool holds every record, so nothing streams after the first step: pass a "
                             "larger --params or a smaller --buffer-count" if r["buffer_count"] >= r["subgroups"] else "")),
        ("disk write / read / both", f"{d['write_gbps']:.2f} / {d['read_gbps']:.2f} / {d['mixed_gbps']:.2f} GB/s "
                                     f"(engine, sequential, median of {d['probes']} probes, one before the steps "
                                     "and one after each: "
                                     + ", ".join("/".join(f"{p[k]:.2f}" for k in _DISK_RATES) for p in d["per_probe"])
                                     + "; 'both' = reads and writes at once)"),
        ("bytes moved / step", f"read {r['read_bytes'] / gib:.2f} GiB, write {r['write_bytes'] / gib:.2f} GiB"),
        ("I/O time at disk speed", f"{r['io_floor_s'] * 1e3:.0f} ms (serial {r['io_serial_s'] * 1e3:.0f}, "
                                   f"both at once {r['io_mixed_s'] * 1e3:.0f}; at the probes' medians)"),
        ("CPU step (offload cpu)", f"{r['cpu_step_s'] * 1e3:.0f} ms ({r['kernels']} kernels)"),
        ("floor", f"{r['floor_s'] * 1e3:.0f} ms ({r['bound']}-bound)"),
        ("NVMe step", f"{r['nvme_step_s'] * 1e3:.0f} ms (of it blocked on I/O: {r['nvme_wait_s'] * 1e3:.0f} ms); "
                      f"achieved {r['achieved_gbps']:.2f} GB/s"),
        ("each step / its floor", ", ".join(f"{p['nvme_s'] * 1e3:.0f}/{p['floor_s'] * 1e3:.0f} ms = {p['ratio']:.2f}"
                                           for p in r["per_step"])),
        ("NVMe step / floor", f"{r['ratio']:.2f}x, median of the steps (target <= {r['target_ratio']:.2f}x); "
                              f"{r['ratio_of_medians']:.2f}x at the medians"),
        ("load average", r["uptime"]),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def main(args: argparse.Namespace) -> int:
    """Run and print (a table per size; ``--json``: a list with one object per size, to a
    path or instead of the tables); returns the exit status."""
    for name in ("steps", "buffer_count"):
        if getattr(args, name) is not None and getattr(args, name) < (1 if name == "steps" else 2):
            print(f"--{name.replace('_', '-')} must be at least {1 if name == 'steps' else 2}", file=sys.stderr)
            return 2
    if args.master_dtype != "fp32" and args.moment_dtype != "q8":
        print(f"--master-dtype {args.master_dtype} needs --moment-dtype q8 (a 16-bit master is part of the "
              "compressed state)", file=sys.stderr)
        return 2
    sizes = _sizes(args)
    if not sizes:
        print("tierstate bench step --offload nvme: no default size fits in the host RAM available; "
              "pass a smaller --params", file=sys.stderr)
        return 2
    results = []
    for params in sizes:
        results.append(run_size(args, params))
        if args.json != JSON_STDOUT:
            print(("\n" if len(results) > 1 else "") + format_table(results[-1]), flush=True)
    emit_json(args.json, results)
    return 0
