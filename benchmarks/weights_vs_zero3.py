"""Weights on NVMe: tierstate's parameter offload against DeepSpeed ZeRO-3 (offload_param and
offload_optimizer on NVMe), the same Llama and batch, on the CPU.

    python benchmarks/weights_vs_zero3.py --size 350m [--batch 2] [--seq 256] [--dtype bf16]
        [--modes tierstate,tierstate_after,ds_z3_nvme] [--steps 3] [--warmup 1] [--repeats 2]
        [--nvme-dir DIR] [--peers-python PY] [--json out.json]

Run from a source checkout with tierstate installed. The model is ``LlamaForCausalLM`` from a
transformers ``LlamaConfig`` (random init, seed 0, nothing downloaded; untied embeddings,
vocabulary 32000) at ``--size``:

=======  ======  ======  =====  ========  ============  =====================
size     hidden  layers  heads  kv heads  intermediate  shape of
=======  ======  ======  =====  ========  ============  =====================
tiny     64      2       2      2         172           a smoke test (vocab 1024)
125m     768     12      12     12        2048          GPT-2 small's width
350m     1024    24      16     16        2816          GPT-2 medium's width
1b       2048    22      32     4         5632          TinyLlama 1.1B
3b       3200    26      32     32        8640          OpenLLaMA 3B
7b       4096    32      32     32        11008         Llama 2 7B
=======  ======  ======  =====  ========  ============  =====================

Modes, each run in a process of its own (``_zero3_worker.py``) so its peak RSS is its own:

===================  ==============================================================
``tierstate``        ``ts.offload_weights(model, offload="nvme")`` and
                     ``ts.AdamW(offload="nvme", step_in_backward=True)``
``tierstate_after``  the same with ``step_in_backward=False`` (not run by default):
                     every update after backward, as DeepSpeed does it
``ds_z3_nvme``       DeepSpeed ZeRO-3, ``offload_param`` and ``offload_optimizer`` both
                     ``{device: nvme}``, ``DS_ACCELERATOR=cpu``, under ``--peers-python``
===================  ==============================================================

The modes alternate over ``--repeats`` rounds (reversed every other round: this VM's memory
bandwidth switches between two levels ~1.7x apart, so a mode run wholly in a slow phase would
look 1.7x worse). Each run's files live in ``<nvme-dir>/<mode>``, removed when it ends. Per
run: seconds per step (median of the timed steps), peak RSS of the process and of its steps,
bytes read from and written to storage per step (``/proc/<pid>/io``), and the disk floor:
those bytes at the disk's sequential O_DIRECT speed, probed on the same folder just before and
just after the run (the smaller of one direction after the other and both at once, as
``tierstate bench step --offload nvme`` prices its steps). A mode that fails prints its error
(the exception's first line) where its figures would be: that is a result too.

Before anything runs, the size is checked against the free disk under ``--nvme-dir`` and the
available RAM (both modes build the model in fp32 first), and refused naming ``--size`` when
it cannot fit; a ``<nvme-dir>/<mode>`` folder that exists already is refused too, never removed.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from tierstate.bench._timing import non_negative_int, positive_int  # the same argument checks as bench e2e
from tierstate.bench.e2e import modes_option
from tierstate.bench.io import parse_bytes

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_zero3_worker.py"
MODES = ("tierstate", "tierstate_after", "ds_z3_nvme")
DEFAULT_MODES = ("tierstate", "ds_z3_nvme")
DEEPSPEED_MODE = "ds_z3_nvme"
_GIB = 2**30

# size -> (hidden, layers, heads, kv heads, intermediate, vocab)
SIZES = {
    "tiny": (64, 2, 2, 2, 172, 1024),
    "125m": (768, 12, 12, 12, 2048, 32000),
    "350m": (1024, 24, 16, 16, 2816, 32000),
    "1b": (2048, 22, 32, 4, 5632, 32000),
    "3b": (3200, 26, 32, 32, 8640, 32000),
    "7b": (4096, 32, 32, 32, 11008, 32000),
}

# Disk each mode's files take, bytes per parameter. DeepSpeed: the weights in their dtype, and
# its optimizer swap files (fp32 master, two fp32 moments, fp32 gradient: 16 B; RESULTS.md of the
# peers measured 1.9 GB of swap for GPT-2's 124M parameters). tierstate: the weights in their
# dtype plus fp32 master and moments (12 B). Runs are sequential and each removes its files, so
# the larger of the two must fit.
DISK_BYTES_PER_PARAM = {"tierstate": 12, "tierstate_after": 12, DEEPSPEED_MODE: 16}
# Both modes build the whole model in fp32 before offloading it (4 B/param), and a forward's
# activations and the interpreter need room beside it.
RAM_BYTES_PER_PARAM = 4
RAM_MARGIN = 3 * _GIB
DISK_MARGIN = 4 * _GIB  # other users of a shared disk, and the disk probe's file

# DeepSpeed ZeRO-3's peak RSS with both offloads on NVMe on the CPU accelerator, measured on the
# 2-vCPU Zen 4 VM (benchmarks/README.md): 5.5-5.9 GiB at 134M parameters, 12.8-14.0 GiB at 374M,
# about 2 GiB + 30 B/param; at 1.1B the kernel killed it at 22 GiB. Used only to warn before a run.
DS_RSS_BASE, DS_RSS_BYTES_PER_PARAM = 2 * _GIB, 30

# What the issue sets against DeepSpeed: tierstate's step at most half of ZeRO-3's, and a lower peak RSS.
TIME_LIMIT = 0.5


def llama_params(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, vocab: int) -> int:
    """Parameters of an untied ``LlamaForCausalLM`` of that shape (no biases), counted from its matrices."""
    head_dim = hidden // heads
    attention = 2 * hidden * hidden + 2 * hidden * kv_heads * head_dim  # q, o; k, v
    mlp = 3 * hidden * intermediate  # gate, up, down
    return 2 * vocab * hidden + layers * (attention + mlp + 2 * hidden) + hidden


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's options."""
    parser.add_argument("--size", choices=tuple(SIZES), default="350m", help="model size (default 350m)")
    parser.add_argument("--batch", type=positive_int, default=2, help="sequences per step (default 2)")
    parser.add_argument("--seq", type=positive_int, default=256, help="tokens per sequence (default 256)")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                        help="weights' dtype in both modes; bf16 keeps an fp32 master in the optimizer (default)")
    parser.add_argument("--modes", type=modes_option(MODES), default=list(DEFAULT_MODES),
                        help=f"comma list of {', '.join(MODES)} (default {','.join(DEFAULT_MODES)})")
    parser.add_argument("--steps", type=positive_int, default=3, help="timed steps per run (default 3)")
    parser.add_argument("--warmup", type=non_negative_int, default=1, help="untimed steps first (default 1)")
    parser.add_argument("--repeats", type=positive_int, default=2, help="runs of every mode, order alternating (default 2)")
    parser.add_argument("--prefetch", type=non_negative_int, default=2, help="tierstate: blocks fetched ahead (default 2)")
    parser.add_argument("--threads", type=positive_int, default=2, help="torch threads per run (default 2)")
    parser.add_argument("--nvme-dir", default=None,
                        help="folder for the runs' files, one sub-folder per mode, removed after each run "
                             "(default: TIERSTATE_NVME_DIR or the tierstate cache dir)")
    parser.add_argument("--probe-bytes", type=parse_bytes, default=512 << 20,
                        help="bytes each way of the disk probe before and after every run (default 512 MiB)")
    parser.add_argument("--peers-python", default=None,
                        help="interpreter that imports deepspeed (default: this one if it can, else "
                             "TIERSTATE_PEERS_PYTHON, else .peers-venv/bin/python in the checkout)")
    parser.add_argument("--timeout", type=positive_int, default=3600, help="seconds allowed per run (default 3600)")
    parser.add_argument("--json", metavar="PATH", default=None, help="also write every figure to PATH as JSON")


def _sibling(name: str):
    """``benchmarks/<name>.py`` as a module (this folder is not a package)."""
    module_name = f"benchmarks_{name}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, HERE / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    return sys.modules[module_name]


def shape(args: argparse.Namespace) -> dict:
    hidden, layers, heads, kv_heads, intermediate, vocab = SIZES[args.size]
    return {"hidden": hidden, "layers": layers, "heads": heads, "kv_heads": kv_heads,
            "intermediate": intermediate, "vocab": vocab}


def check_fits(args: argparse.Namespace, nparams: int, root: Path) -> None:
    """Refuse (ValueError naming --size) a model whose files or fp32 build would not fit here."""
    disk_need = max(DISK_BYTES_PER_PARAM[m] for m in args.modes) * nparams + DISK_MARGIN
    free = shutil.disk_usage(root).free
    if disk_need > free:
        raise ValueError(
            f"--size {args.size}: {nparams / 1e9:.2f}B parameters need ~{disk_need / 1e9:.0f} GB of files under "
            f"--nvme-dir {root} ({max(DISK_BYTES_PER_PARAM[m] for m in args.modes)} B/param for "
            f"{'/'.join(args.modes)} plus {DISK_MARGIN // _GIB} GiB), which has {free / 1e9:.0f} GB free; "
            "pick a smaller --size or an --nvme-dir on a larger disk")
    with open("/proc/meminfo") as f:
        available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    ram_need = RAM_BYTES_PER_PARAM * nparams + RAM_MARGIN
    if ram_need > available:
        raise ValueError(
            f"--size {args.size}: building the {nparams / 1e9:.2f}B-parameter model in fp32 needs "
            f"~{ram_need / _GIB:.1f} GiB of RAM, {available / _GIB:.1f} GiB is available; pick a smaller --size")
    ds_need = DS_RSS_BASE + DS_RSS_BYTES_PER_PARAM * nparams
    if DEEPSPEED_MODE in args.modes and ds_need > available:
        print(f"note: DeepSpeed ZeRO-3 took ~{DS_RSS_BYTES_PER_PARAM} B/param of RSS on the reference VM, "
              f"~{ds_need / _GIB:.0f} GiB at --size {args.size} against {available / _GIB:.1f} GiB available: "
              "expect the out-of-memory killer to end its run (reported as its result)", flush=True)


def worker_command(python: str, mode: str, args: argparse.Namespace, out: Path, folder: Path) -> list[str]:
    s = shape(args)
    return [python, str(WORKER), "--mode", mode, "--out", str(out), "--nvme-dir", str(folder),
            "--hidden", str(s["hidden"]), "--layers", str(s["layers"]), "--heads", str(s["heads"]),
            "--kv-heads", str(s["kv_heads"]), "--intermediate", str(s["intermediate"]), "--vocab", str(s["vocab"]),
            "--batch", str(args.batch), "--seq", str(args.seq), "--dtype", args.dtype, "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--threads", str(args.threads), "--prefetch", str(args.prefetch)]


def child_env(threads: int) -> dict:
    """The worker's environment: ``threads`` threads, the CPU accelerator for DeepSpeed, nothing downloaded.
    Nothing is put on PYTHONPATH: each interpreter imports its own torch (and tierstate or deepspeed)."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads), TIERSTATE_NUM_THREADS=str(threads), DS_ACCELERATOR="cpu",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


def probe_disk(folder: Path, nbytes: int) -> dict:
    """Sequential O_DIRECT rates of ``folder`` (tierstate bench step --offload nvme's probe)."""
    from tierstate.bench.step_nvme import measure_disk

    folder.mkdir(parents=True, exist_ok=True)
    return measure_disk(folder, nbytes, request_bytes=16 << 20, reps=1)


def disk_floor_s(read_bytes: float, write_bytes: float, rates: dict) -> float:
    """Seconds the disk needs for the bytes at ``rates``: one direction after the other or both at
    once, whichever is faster."""
    from tierstate.bench.step_nvme import _disk_time

    return min(_disk_time(read_bytes, write_bytes, rates))


def _watch_rss(proc: subprocess.Popen, seen: list[int]) -> None:
    """The largest RSS of ``proc`` seen while it runs (every 0.2 s), kept in ``seen[0]``: the only
    memory figure of a run the kernel kills, which writes no result."""
    status = Path(f"/proc/{proc.pid}/status")
    while proc.poll() is None:
        try:
            for line in status.read_text().splitlines():
                if line.startswith("VmRSS:"):
                    seen[0] = max(seen[0], int(line.split()[1]) * 1024)
        except (OSError, ValueError):  # the process ended between poll() and the read
            return
        time.sleep(0.2)


def run_one(python: str, mode: str, args: argparse.Namespace, root: Path, workdir: Path, tag: str) -> dict:
    """One run of ``mode`` in its own process; a failure comes back as the result's ``status`` and ``error``."""
    folder = root / mode
    out = workdir / f"{mode}-{tag}.json"
    before = probe_disk(root, args.probe_bytes)
    t0 = time.perf_counter()
    lines: list[str] = []
    progress: list[str] = []
    rss_seen = [0]
    timed_out = threading.Event()
    try:
        with subprocess.Popen(worker_command(python, mode, args, out, folder), env=child_env(args.threads),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) as proc:
            def stop() -> None:
                timed_out.set()
                proc.kill()
            timer = threading.Timer(args.timeout, stop)
            timer.start()
            watcher = threading.Thread(target=_watch_rss, args=(proc, rss_seen), daemon=True)
            watcher.start()
            try:
                for line in proc.stderr:  # the worker's phase and step lines, shown as they come
                    lines.append(line.rstrip())
                    if line.startswith(f"[{mode}] "):
                        print("    " + line.rstrip(), flush=True)
                        progress.append(line.rstrip())
                returncode = proc.wait()
            finally:
                timer.cancel()
                watcher.join()
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # the worker removes it too, unless it was killed
    wall = time.perf_counter() - t0
    if timed_out.is_set():
        returncode = None
    tail = "\n".join([ln for ln in lines if ln.strip()][-30:])
    if out.exists():
        result = json.loads(out.read_text())
    else:
        result = {"mode": mode, "status": "failed", "steps": []}
    if returncode is None:
        result["error"] = f"no result within --timeout {args.timeout} s"
    elif returncode < 0:
        result["error"] = (f"killed by signal {-returncode}"
                           + (" (SIGKILL: the out-of-memory killer?)" if returncode == -9 else "")
                           + f" at RSS {rss_seen[0] / _GIB:.1f} GiB"
                           + (f", after: {progress[-1]}" if progress else ", before setup ended"))
    elif result["status"] != "ok" and "error" not in result:
        result["error"] = (tail.splitlines() or [f"exit code {returncode}"])[-1]
    if result["status"] != "ok":
        result["stderr_tail"] = tail
    result["process_wall_s"] = wall
    after = probe_disk(root, args.probe_bytes)
    rates = {k: (before[k] + after[k]) / 2 for k in ("write_gbps", "read_gbps", "mixed_gbps")}
    result["disk"] = {"before": before, "after": after, "mean": rates}
    timed = [s for s in result.get("steps", []) if not s["warmup"]]
    if result["status"] == "ok" and timed:
        result["step_s"] = statistics.median(s["total"] for s in timed)
        result["read_bytes_per_step"] = statistics.median(s["read_bytes"] for s in timed)
        result["write_bytes_per_step"] = statistics.median(s["write_bytes"] for s in timed)
        result["disk_floor_s"] = disk_floor_s(result["read_bytes_per_step"], result["write_bytes_per_step"], rates)
    return result


def _spread(values: list[float]) -> dict | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def summarize(mode: str, runs: list[dict]) -> dict:
    ok = [r for r in runs if r.get("status") == "ok"]
    if not ok:
        errors = list(dict.fromkeys(r.get("error", "failed") for r in runs))
        return {"mode": mode, "status": "failed", "error": "; ".join(errors) if errors else "not run"}
    timed = [s for r in ok for s in r["steps"] if not s["warmup"]]
    summary = {"mode": mode, "status": "ok", "runs": len(ok), "failed_runs": len(runs) - len(ok),
               "nparams": ok[0]["nparams"],
               **{k: _spread([s[k] for s in timed]) for k in ("total", "fwd", "bwd", "opt")},
               "run_step_s": [r["step_s"] for r in ok],
               "peak_rss_bytes": _spread([r["peak_rss_bytes"] for r in ok]),
               "peak_rss_steps_bytes": _spread([r["peak_rss_steps_bytes"] for r in ok
                                                if r.get("peak_rss_steps_bytes") is not None]),
               "read_bytes_per_step": _spread([r["read_bytes_per_step"] for r in ok]),
               "write_bytes_per_step": _spread([r["write_bytes_per_step"] for r in ok]),
               "disk_floor_s": _spread([r["disk_floor_s"] for r in ok]),
               "files_bytes": max(r.get("files_bytes", 0) for r in ok),
               "setup_s": _spread([r["setup_s"] for r in ok]),
               "first_loss": ok[0]["steps"][0]["loss"]}
    floor = summary["disk_floor_s"]["median"]
    summary["x_floor"] = summary["total"]["median"] / floor if floor > 0 else None  # no disk I/O: no floor
    return summary


def compare(summaries: dict, rounds: list[dict]) -> dict | None:
    """tierstate against ZeRO-3: step-time ratio (of the medians, and per round) and peak RSS."""
    a, b = summaries.get("tierstate", {}), summaries.get(DEEPSPEED_MODE, {})
    if a.get("status") != "ok" or b.get("status") != "ok":
        return None
    per_round = [rnd["tierstate"]["step_s"] / rnd[DEEPSPEED_MODE]["step_s"] for rnd in rounds
                 if rnd.get("tierstate", {}).get("status") == "ok" and rnd.get(DEEPSPEED_MODE, {}).get("status") == "ok"]
    time_ratio = a["total"]["median"] / b["total"]["median"]
    rss_ratio = a["peak_rss_bytes"]["max"] / b["peak_rss_bytes"]["min"]
    return {"time_ratio": time_ratio, "time_per_round": per_round, "time_limit": TIME_LIMIT,
            "time_met": time_ratio <= TIME_LIMIT, "rss_ratio": rss_ratio, "rss_met": rss_ratio < 1.0}


def _fmt(s: dict | None, scale: float = 1.0, digits: int = 2) -> str:
    if not s:
        return "-"
    if s["n"] == 1:
        return f"{s['median'] / scale:.{digits}f}"
    return f"{s['median'] / scale:.{digits}f} ({s['min'] / scale:.{digits}f}-{s['max'] / scale:.{digits}f})"


def format_report(summaries: dict, verdict: dict | None, meta: dict) -> str:
    lines = [f"Llama {meta['size']} ({meta['nparams'] / 1e6:.1f}M parameters), batch {meta['batch']} x {meta['seq']}, "
             f"{meta['dtype']}, {meta['steps']} timed steps after {meta['warmup']} warm-up, {meta['repeats']} "
             f"run(s) per mode interleaved, {meta['threads']} threads, load average {meta['loadavg_start'][0]:.2f} "
             f"at start, {meta['loadavg_end'][0]:.2f} at end",
             "step/fwd/bwd/opt s: median (min-max) over all timed steps; bytes and floor: median (min-max) over runs",
             ""]
    header = ("mode", "step s", "fwd s", "bwd s", "opt s", "peak RSS GiB", "in steps GiB", "read GB/step",
              "write GB/step", "disk floor s", "x floor", "files GB", "loss 0")
    rows, failed = [], []
    for mode, s in summaries.items():
        if s["status"] != "ok":
            failed.append(f"{mode}: FAILED: {s['error']}")
            continue
        rows.append((mode, _fmt(s["total"]), _fmt(s["fwd"]), _fmt(s["bwd"]), _fmt(s["opt"]),
                     _fmt(s["peak_rss_bytes"], _GIB), _fmt(s["peak_rss_steps_bytes"], _GIB),
                     _fmt(s["read_bytes_per_step"], 1e9), _fmt(s["write_bytes_per_step"], 1e9),
                     _fmt(s["disk_floor_s"]), "-" if s["x_floor"] is None else f"{s['x_floor']:.2f}", f"{s['files_bytes'] / 1e9:.1f}",
                     f"{s['first_loss']:.4f}"))
    widths = [max(len(str(r[i])) for r in (header, *rows)) for i in range(len(header))]
    for r in (header, tuple("-" * w for w in widths), *rows):
        lines.append("  ".join(f"{str(c):<{w}}" for c, w in zip(r, widths)).rstrip())
    lines.extend(failed)
    disk = meta.get("disk_gbps")
    if disk:
        lines.append(f"disk probes (GB/s, median over the runs' probes): write {disk['write_gbps']:.2f}, "
                     f"read {disk['read_gbps']:.2f}, both at once {disk['mixed_gbps']:.2f}")
    if verdict:
        rounds = " ".join(f"{r:.2f}" for r in verdict["time_per_round"])
        lines.append(f"tierstate / ZeRO-3 step time: {verdict['time_ratio']:.2f} (limit {verdict['time_limit']}) "
                     f"{'met' if verdict['time_met'] else 'MISSED'}; per round {rounds}")
        lines.append(f"tierstate / ZeRO-3 peak RSS (max over tierstate runs / min over ZeRO-3 runs): "
                     f"{verdict['rss_ratio']:.2f} {'lower: met' if verdict['rss_met'] else 'NOT lower: MISSED'}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """Run the comparison; 0 when every run ran, 1 when one failed (its error is in the report)."""
    s = shape(args)
    nparams = llama_params(**{k: s[k] for k in ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab")})
    if args.nvme_dir is None:
        from tierstate.placement import default_nvme_root
        args.nvme_dir = str(default_nvme_root())
    root = Path(args.nvme_dir)
    root.mkdir(parents=True, exist_ok=True)
    check_fits(args, nparams, root)
    taken = [str(root / m) for m in args.modes if (root / m).exists()]
    if taken:
        raise ValueError(f"--nvme-dir {root}: {', '.join(taken)} exists already; every run makes and removes "
                         "<nvme-dir>/<mode>, so move that folder away or pick another --nvme-dir")
    pythons = {m: sys.executable for m in args.modes if m != DEEPSPEED_MODE}
    unavailable = {}
    if DEEPSPEED_MODE in args.modes:
        e2e = _sibling("e2e")
        peers = e2e.find_peers_python(args.peers_python)
        ok, what = e2e.probe_deepspeed(peers, args.threads)
        print(f"DeepSpeed: {what}", flush=True)
        if ok:
            pythons[DEEPSPEED_MODE] = peers
        else:
            unavailable[DEEPSPEED_MODE] = what
    runnable = [m for m in args.modes if m not in unavailable]
    meta = {"size": args.size, "nparams": nparams, **s, "batch": args.batch, "seq": args.seq, "dtype": args.dtype,
            "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats, "threads": args.threads,
            "prefetch": args.prefetch, "nvme_dir": str(root), "loadavg_start": os.getloadavg(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    print(f"Llama {args.size}: {nparams / 1e6:.0f}M parameters, {s}", flush=True)
    runs: dict[str, list[dict]] = {m: [] for m in args.modes}
    rounds: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="weights-vs-zero3-") as tmp:
        for r in range(args.repeats):
            rnd = {}
            for mode in (runnable if r % 2 == 0 else runnable[::-1]):
                print(f"round {r + 1}/{args.repeats}: {mode} (load {os.getloadavg()[0]:.2f})", flush=True)
                result = run_one(pythons[mode], mode, args, root, Path(tmp), f"r{r}")
                if result["status"] == "ok":
                    print(f"  {mode}: {result['step_s']:.2f} s/step, peak RSS {result['peak_rss_bytes'] / _GIB:.2f} GiB",
                          flush=True)
                else:
                    print(f"  {mode}: FAILED: {result['error']}", flush=True)
                runs[mode].append(result)
                rnd[mode] = result
            rounds.append(rnd)
    summaries = {m: {"mode": m, "status": "failed", "error": unavailable[m]} if m in unavailable
                 else summarize(m, runs[m]) for m in args.modes}
    meta["loadavg_end"] = os.getloadavg()
    probes = [p for rs in runs.values() for r in rs if "disk" in r for p in (r["disk"]["before"], r["disk"]["after"])]
    if probes:
        meta["disk_gbps"] = {k: statistics.median(p[k] for p in probes) for k in ("write_gbps", "read_gbps", "mixed_gbps")}
    verdict = compare(summaries, rounds)
    print(format_report(summaries, verdict, meta), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "summaries": summaries, "verdict": verdict, "runs": runs},
                                              indent=1, default=str))
    failed = [m for m in runnable if any(r["status"] != "ok" for r in runs[m])]
    for m in failed:
        tail = next((r.get("stderr_tail") for r in runs[m] if r["status"] != "ok"), "")
        if tail:
            print(f"--- {m} stderr (last lines) ---\n{tail}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(allow_abbrev=False, prog="python benchmarks/weights_vs_zero3.py",
                                      description=__doc__.split("\n\n")[0])
    add_arguments(_parser)
    _args = _parser.parse_args()
    try:
        sys.exit(main(_args))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
