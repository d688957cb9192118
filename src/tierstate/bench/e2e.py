"""``tierstate bench e2e``: a whole training step of GPT-2 small, tierstate against plain torch.

    tierstate bench e2e [--modes torch,cpu,nvme,...] [--steps 6] [--warmup 2] [--repeats 2]
                        [--json out.json] [--nvme-dir DIR] [--tiny]

GPT-2 124M built from a transformers config (random init, nothing downloaded), batch
2 x 256 random tokens, labels = inputs. Modes:

================  ================================================================
``torch``         ``torch.optim.AdamW(fused=True)``, fp32 parameters, bf16 autocast:
                  the plain-PyTorch baseline
``torch_retain``  ``torch`` with the host-allocator setting tierstate's optimizers apply on
                  CPU parameters (freed memory kept for reuse: no page faults in forward
                  and backward; :mod:`tierstate.host_allocator`), to tell that gain apart
                  from the optimizer's
``cpu``           ``tierstate.AdamW(offload="cpu")``, fp32 parameters, bf16 autocast
``nvme``          ``tierstate.AdamW(offload="nvme")``, the same; state in files
``cpu_bwd``       ``cpu`` with ``step_in_backward=True``
``nvme_bwd``      ``nvme`` with ``step_in_backward=True``
``cpu_bf16``      bf16 parameters, no autocast, fp32 master in the optimizer (how a
                  tierstate user trains in mixed precision)
``nvme_bf16``     the same with the state in files
``cpu_bf16_bwd``  ``cpu_bf16`` with ``step_in_backward=True``: sub-groups updated
                  during backward as their gradients become final
``nvme_bf16_bwd`` ``nvme_bf16`` with ``step_in_backward=True``: the NVMe I/O and the
                  updates overlap forward and backward
``cpu_clip_scaler`` ``cpu`` with ``max_grad_norm=1.0`` and a ``torch.amp.GradScaler``
``cpu_bwd_clip_scaler`` the same with ``step_in_backward=True``: updates made speculatively
                  during backward, rolled back when clipping or the scaler demands it
                  (the rollbacks are counted in the report)
================  ================================================================

``--precision fp32`` (what ``auto`` picks on a CPU without bf16 matrix units, where a
bf16 matmul ran 45-76x slower than an fp32 one on an AVX2 Zen 3) drops autocast, so every
mode trains in fp32; the ``*_bf16*`` modes are then left out.

Each target names "tierstate nvme" or "tierstate cpu"; it is evaluated for every variant of
that mode that ran, so the report shows which configuration meets it.

Each run of a mode is a process of its own (:mod:`tierstate.bench._e2e_worker`), so its
peak RSS is its own. The comparison with DeepSpeed ZeRO-2/3 (modes run under a peers'
interpreter) is ``benchmarks/e2e.py`` in the source tree, which runs these same modes
through this module and adds its own.

[Note: why modes alternate]
Memory bandwidth on the 2-vCPU reference VM switches between two levels ~1.7x apart over
seconds to minutes, and the forward and backward of a CPU model are bandwidth-bound. A
mode run entirely inside a slow phase would look 1.7x worse than its neighbour, so the
modes run round-robin ``--repeats`` times, in reversed order every other round, and the
report gives the median over all timed steps with the min-max, plus each target's ratio
per round (modes of one round ran minutes apart at most).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from ..telemetry.progress import progress
from ._e2e_worker import BF16_PARAM_MODES, MODES, TIERSTATE_MODES, add_model_arguments
from ._timing import non_negative_int, positive_int

_GIB = 2**30
PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the folder holding the tierstate package
# How a worker process of this package's modes is started, after the interpreter.
WORKER = ("-m", "tierstate.bench._e2e_worker")

# (name, numerator mode, denominator mode, limit[, measure]): ratios of the medians of
# ``measure`` ("total": the whole step, the default; "opt": the optimizer phase). The NVMe
# offload's first target, 1.3x plain torch's step, for each tierstate variant of the mode;
# then the offload-at-zero-cost goals: the plain `nvme` step within 1.05x plain torch's, and
# the `cpu` optimizer phase at 0.8x plain torch's fused AdamW phase.
NVME_VARIANTS = ("nvme", "nvme_bwd", "nvme_bf16", "nvme_bf16_bwd")
CPU_VARIANTS = ("cpu", "cpu_bwd", "cpu_bf16", "cpu_bf16_bwd")
TIME_TARGETS = tuple((f"{m} vs plain torch", m, "torch", 1.3) for m in NVME_VARIANTS) + (
    ("nvme step at zero cost (vs plain torch)", "nvme", "torch", 1.05),
    ("cpu optimizer phase vs plain torch's", "cpu", "torch", 0.8, "opt"),
)


def modes_option(modes: tuple[str, ...], elsewhere: dict[str, str] | None = None) -> Callable[[str], list[str]]:
    """The ``--modes`` argument type over ``modes``; ``elsewhere`` maps modes run by another
    command to where, said when one of them is asked for."""
    elsewhere = elsewhere or {}

    def parse(text: str) -> list[str]:
        names = [m.strip() for m in text.split(",") if m.strip()]
        unknown = [m for m in names if m not in modes]
        if unknown or not names:
            where = "".join(dict.fromkeys(f"; {m}: {elsewhere[m]}" for m in unknown if m in elsewhere))
            raise argparse.ArgumentTypeError(
                f"--modes {text!r}: unknown mode(s) {unknown}; choose a comma list of {', '.join(modes)}{where}")
        return list(dict.fromkeys(names))
    return parse


# DeepSpeed's modes: compared by a script of the source tree, which runs these modes too.
_PEER_MODES = {m: "run by benchmarks/e2e.py in the source tree (python benchmarks/e2e.py --modes ...)"
               for m in ("ds_z2_cpu", "ds_z3_nvme")}


def add_arguments(parser: argparse.ArgumentParser, modes: tuple[str, ...] = MODES,
                  modes_type: Callable[[str], list[str]] | None = None) -> None:
    """Options of the end-to-end benchmark, ``--modes`` among ``modes`` (parsed by ``modes_type``)."""
    parser.add_argument("--modes", type=modes_type or modes_option(modes, _PEER_MODES), default=None,
                        help=f"comma list of modes to run (default: all of {','.join(modes)}, less the "
                             "bf16-parameter ones under --precision fp32)")
    parser.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto",
                        help="bf16: autocast and bf16 parameters; fp32: neither; auto "
                             "(default): bf16 unless this CPU's bf16 matmul is much slower than its fp32 one")
    parser.add_argument("--steps", type=positive_int, default=6, help="timed steps per run (default 6)")
    parser.add_argument("--warmup", type=non_negative_int, default=2, help="untimed steps first (default 2)")
    parser.add_argument("--repeats", type=positive_int, default=2,
                        help="runs of every mode, order alternating (default 2)")
    parser.add_argument("--json", metavar="PATH", default=None, help="also write every figure to PATH as JSON")
    parser.add_argument("--nvme-dir", default=None,
                        help="folder for the nvme modes' state files (default: TIERSTATE_NVME_DIR or the "
                             "tierstate cache dir); each run makes and removes its own sub-folder")
    parser.add_argument("--threads", type=positive_int, default=2,
                        help="torch and tierstate threads per run (default 2: this machine's cores)")
    parser.add_argument("--timeout", type=positive_int, default=1800, help="seconds allowed per run (default 1800)")
    parser.add_argument("--tiny", action="store_true",
                        help="a 2-layer, 64-wide GPT-2 on 2 x 32 tokens, with 16 Ki-element sub-groups and a "
                             "2-buffer NVMe pool so the tier still streams: a smoke test of seconds")
    add_model_arguments(parser)


def _apply_tiny(args: argparse.Namespace) -> None:
    args.layers, args.embd, args.heads, args.vocab, args.seq = 2, 64, 2, 1024, 32
    if args.subgroup_numel is None:
        args.subgroup_numel = 1 << 14
    if args.buffer_count is None:
        args.buffer_count = 2


# -- running ----------------------------------------------------------------------------------
def child_env(threads: int | None) -> dict:
    """The environment of a worker process: this tierstate first on its path, nothing fetched
    from the hub, and ``threads`` threads (None: the defaults of the machine's cores)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(PACKAGE_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if threads is not None:
        env.update(OMP_NUM_THREADS=str(threads), TIERSTATE_NUM_THREADS=str(threads))
    return env


def _worker_command(launch: list[str], mode: str, args: argparse.Namespace, out: Path, nvme_dir: Path) -> list[str]:
    cmd = [*launch, "--mode", mode, "--out", str(out),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--threads", str(args.threads),
           "--nvme-dir", str(nvme_dir), "--layers", str(args.layers), "--embd", str(args.embd),
           "--heads", str(args.heads), "--vocab", str(args.vocab), "--batch", str(args.batch),
           "--seq", str(args.seq), "--precision", args.precision]
    if args.subgroup_numel is not None:
        cmd += ["--subgroup-numel", str(args.subgroup_numel)]
    if args.buffer_count is not None:
        cmd += ["--buffer-count", str(args.buffer_count)]
    return cmd


def run_one(mode: str, launch: list[str], args: argparse.Namespace, nvme_dir: Path, workdir: Path, tag: str,
            env: dict | None = None) -> dict:
    """One run of ``mode`` in its own process, started by ``launch`` (an interpreter and what it
    runs) with :func:`child_env` plus ``env``; a failed run is returned with its error, not raised."""
    out = workdir / f"{mode}-{tag}.json"
    cmd = _worker_command(launch, mode, args, out, nvme_dir)
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, env={**child_env(args.threads), **(env or {})}, capture_output=True, text=True,
                              timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"mode": mode, "status": f"failed: no result within --timeout {args.timeout} s"}
    wall = time.perf_counter() - t0
    if done.returncode != 0 or not out.exists():
        lines = [ln for ln in done.stderr.strip().splitlines() if ln.strip()]
        why = lines[-1] if lines else f"exit code {done.returncode}"
        return {"mode": mode, "status": f"failed: {why}", "stderr_tail": "\n".join(lines[-25:])}
    result = json.loads(out.read_text())
    result["process_wall_s"] = wall
    return result


# -- aggregating ------------------------------------------------------------------------------
def _timed(run: dict) -> list[dict]:
    return [s for s in run.get("steps", []) if not s["warmup"]]


def _spread(values: list[float]) -> dict:
    if not values:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def summarize(mode: str, runs: list[dict]) -> dict:
    """Medians and min-max over every timed step of every successful run of ``mode``."""
    ok = [r for r in runs if r.get("status") == "ok"]
    if not ok:
        return {"mode": mode, "status": runs[0]["status"] if runs else "not run"}
    steps = [s for r in ok for s in _timed(r)]
    summary = {
        "mode": mode, "status": "ok", "runs": len(ok), "failed_runs": len(runs) - len(ok),
        "nparams": ok[0]["nparams"],
        **{key: _spread([s[key] for s in steps]) for key in ("total", "fwd", "bwd", "opt")},
        "run_medians_s": [statistics.median(s["total"] for s in _timed(r)) for r in ok],
        "peak_rss_bytes": _spread([r["peak_rss_bytes"] for r in ok]),
        "rss_after_setup_bytes": _spread([r["rss_after_setup_bytes"] for r in ok]),
    }
    with_phases = [s for s in steps if "phases" in s]
    if with_phases:
        names = sorted({k for s in with_phases for k in s["phases"]})
        summary["phases_s"] = {k: statistics.median(s["phases"].get(k, 0.0) for s in with_phases) for k in names}
        moved = sorted({k for s in with_phases for k in s["bytes"]})
        summary["bytes_per_step"] = {k: statistics.median(s["bytes"].get(k, 0) for s in with_phases) for k in moved}
    for key in ok[0].get("info_keys", ()):  # what the worker's harness said about its setup
        summary[key] = ok[0][key]
    return summary


# The model and batch the targets are set for: GPT-2 124M at 2 x 256 (the defaults).
TARGET_SHAPE = {"layers": 12, "embd": 768, "heads": 12, "vocab": 50257, "batch": 2, "seq": 256}


def is_target_shape(args: argparse.Namespace) -> bool:
    """Whether the run is the targets' GPT-2 124M at 2 x 256 (the only shape they are set for)."""
    return all(getattr(args, k) == v for k, v in TARGET_SHAPE.items())


def evaluate_targets(summaries: dict, rounds: list[dict], target_shape: bool, precision: str = "bf16",
                     targets: tuple = TIME_TARGETS, reference: dict | None = None) -> list[dict]:
    """Each of ``targets``: ratio of medians, per-round ratios, and whether it holds.

    ``met`` is None where a side did not run, or where the model is not the targets' shape
    (the ratios are still given, as information). ``reference``: step seconds (low, high)
    measured elsewhere for a denominator mode that cannot run here, quoted next to the
    target (bf16 runs of the targets' shape only), never as a verdict."""
    reference = reference or {}
    out = []
    for name, num, den, limit, *measure in targets:
        key = measure[0] if measure else "total"
        if summaries.get(num, {}).get("status") is None:
            continue  # that variant was not asked for
        entry = {"target": name, "limit": limit, "numerator": num, "denominator": den, "measure": key}
        a, b = summaries.get(num, {}), summaries.get(den, {})
        if a.get("status") == "ok" and b.get("status") == "ok":
            ratio = a[key]["median"] / b[key]["median"]
            per_round = []
            for rnd in rounds:
                ra, rb = rnd.get(num), rnd.get(den)
                if ra and rb and ra.get("status") == "ok" and rb.get("status") == "ok":
                    ma = statistics.median(s[key] for s in _timed(ra))
                    mb = statistics.median(s[key] for s in _timed(rb))
                    per_round.append(ma / mb)
            entry.update(ratio=ratio, per_round=per_round, met=(ratio <= limit) if target_shape else None)
        elif key == "total" and a.get("status") == "ok" and den in reference and target_shape and precision == "bf16":
            lo, hi = reference[den]
            entry.update(ratio=None, met=None, reference_ratio=(a["total"]["median"] / hi, a["total"]["median"] / lo),
                         note=f"{den} {b.get('status', 'not run')}; against RESULTS.md's {lo}-{hi} s (another run)")
        else:
            entry.update(ratio=None, met=None, note="not measured: " + ", ".join(
                f"{m} {summaries.get(m, {}).get('status', 'not run')}" for m in (num, den)
                if summaries.get(m, {}).get("status") != "ok"))
        out.append(entry)
    for m in NVME_VARIANTS:
        if summaries.get(m, {}).get("status") is None:
            continue
        a, b = summaries.get(m, {}), summaries.get("torch", {})
        entry = {"target": f"{m} peak RSS below plain torch's", "numerator": m, "denominator": "torch"}
        if a.get("status") == "ok" and b.get("status") == "ok":
            ra, rb = a["peak_rss_bytes"]["max"], b["peak_rss_bytes"]["min"]
            entry.update(ratio=ra / rb, limit=1.0, met=(ra < rb) if target_shape else None,
                         note=f"max over {m} runs vs min over torch runs")
        else:
            entry.update(ratio=None, met=None, limit=1.0, note="not measured")
        out.append(entry)
    return out


# -- reporting --------------------------------------------------------------------------------
def _fmt_spread(s: dict, digits: int = 2) -> str:
    if s["median"] is None:
        return "-"
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def format_report(summaries: dict, targets: list[dict], meta: dict) -> str:
    """The table, the tierstate phases and the targets, as printed."""
    load = (meta["loadavg_start"][0], meta["loadavg_end"][0])
    lines = [f"GPT-2 {meta['nparams_text']} batch {meta['batch']} x {meta['seq']}, {meta.get('precision', 'bf16')}, "
             f"{meta['steps']} timed steps after "
             f"{meta['warmup']} warm-up, {meta['repeats']} run(s) per mode, threads {meta['threads']}, "
             f"load average {load[0]:.2f} at start, {load[1]:.2f} at end",
             "seconds: median (min-max) over all timed steps; peak RSS: median over runs"]
    cpus = os.cpu_count() or 1
    if max(load) > cpus:
        lines.append(f"WARNING: load average above this machine's {cpus} CPUs: other work shared it, so the "
                     "times are not comparable with quiet-machine figures (peak RSS and bytes are)")
    lines.append("")
    header = ("mode", "step s", "fwd s", "bwd s", "opt s", "peak RSS GiB", "run medians s")
    rows, not_run = [], []
    for mode, s in summaries.items():
        if s["status"] != "ok":
            not_run.append(f"{mode}: {s['status']}")
            continue
        rss = s["peak_rss_bytes"]
        rows.append((mode, _fmt_spread(s["total"]), _fmt_spread(s["fwd"]), _fmt_spread(s["bwd"]),
                     _fmt_spread(s["opt"], 3), f"{rss['median'] / _GIB:.2f} ({rss['min'] / _GIB:.2f}-{rss['max'] / _GIB:.2f})",
                     " ".join(f"{v:.2f}" for v in s["run_medians_s"])))
    widths = [max(len(str(r[i])) for r in (header, *rows)) for i in range(len(header))]
    for r in (header, tuple("-" * w for w in widths), *rows):
        lines.append("  ".join(f"{str(c):<{w}}" for c, w in zip(r, widths)).rstrip())
    lines.extend(not_run)
    retained = [m for m, s in summaries.items() if s.get("host_allocator") == "retain"]
    small = [m for m, s in summaries.items() if s.get("host_allocator") == "retain_small"]
    if retained or small:
        said = [f"all of it in {', '.join(retained)}"] if retained else []
        said += [f"blocks below 32 MiB in {', '.join(small)}"] if small else []
        lines.append("host memory freed by torch kept for reuse (tierstate.host_allocator): " + "; ".join(said)
                     + "; the other modes use the C library's default")
    kernels = sorted({s["kernels"] for s in summaries.values() if s.get("kernels")})
    if kernels:
        lines.append(f"tierstate kernels: {', '.join(kernels)}")
    for mode in TIERSTATE_MODES:
        s = summaries.get(mode, {})
        if s.get("status") == "ok" and s.get("phases_s"):
            ranked = sorted(s["phases_s"].items(), key=lambda kv: -kv[1])
            phases = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in ranked if v > 0)
            moved = ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in s.get("bytes_per_step", {}).items() if v)
            lines.append(f"{mode}: opt.step() phases, ms (median): {phases}" + (f"; per step: {moved}" if moved else ""))
    lines.append("")
    for t in targets:
        if t["ratio"] is not None:
            verdict = {True: "met", False: "MISSED", None: "no verdict (not the targets' model shape)"}[t["met"]]
            rounds = " ".join(f"{r:.2f}" for r in t.get("per_round", []))
            lines.append(f"target {t['target']}: {t['ratio']:.2f} (limit {t['limit']}) {verdict}"
                         + (f"; per round {rounds}" if rounds else "") + (f"; {t['note']}" if t.get("note") else ""))
        elif t.get("reference_ratio"):
            lo, hi = t["reference_ratio"]
            lines.append(f"target {t['target']}: {lo:.2f}-{hi:.2f} (limit {t['limit']}) NOT A VERDICT: {t['note']}")
        else:
            lines.append(f"target {t['target']}: {t['note']}")
    return "\n".join(lines)


def resolve_precision(args: argparse.Namespace) -> str | None:
    """Settle ``args.precision`` ("auto" -> "bf16" or "fp32"); returns what to tell the user, if anything.

    "auto" is bf16 where this CPU runs bf16 matmuls fast, else fp32, except that modes named in
    ``--modes`` which train bf16 parameters settle it to bf16 anyway: the user asked for them by
    name, and fp32 would rule them out (refusing them was the old behaviour)."""
    if args.precision != "auto":
        return None
    from ..placement.probe import SLOW_BF16_FACTOR, bf16_matmul_slowdown

    slowdown = bf16_matmul_slowdown()
    if slowdown <= SLOW_BF16_FACTOR:
        args.precision = "bf16"
        return None
    asked = [m for m in (args.modes or []) if m in BF16_PARAM_MODES]
    if asked:
        args.precision = "bf16"
        return (f"precision: bf16 (auto, for --modes {', '.join(asked)}, which train bf16 parameters): a bf16 "
                f"matmul runs {slowdown:.0f}x slower than an fp32 one on this CPU (no bf16 matrix units), so "
                "forward and backward time oneDNN's fallback; the optimizer step is timed as it runs anywhere")
    args.precision = "fp32"
    return (f"precision: fp32 (auto): a bf16 matmul runs {slowdown:.0f}x slower than an fp32 one on this CPU "
            "(no bf16 matrix units), so bf16 autocast would time oneDNN's fallback, not training; "
            "--precision bf16 forces it")


def prepare(args: argparse.Namespace, modes: tuple[str, ...] = MODES) -> int | None:
    """Settle ``args`` before any run (--tiny, the NVMe folder, the precision, the default modes
    among ``modes``); returns an exit status to stop with, or None to go on."""
    if args.tiny:
        _apply_tiny(args)
    if args.nvme_dir is None:
        from ..placement import default_nvme_root
        args.nvme_dir = str(default_nvme_root())
    precision_note = resolve_precision(args)
    if precision_note:
        print(precision_note, flush=True)
    if args.modes is None:
        args.modes = [m for m in modes if args.precision == "bf16" or m not in BF16_PARAM_MODES]
    elif args.precision == "fp32" and (bad := [m for m in args.modes if m in BF16_PARAM_MODES]):
        print(f"--modes: {', '.join(bad)} train bf16 parameters, which --precision fp32 rules out; leave them out "
              "or pass --precision bf16", file=sys.stderr)
        return 2
    return None


def run_modes(args: argparse.Namespace, launch: dict[str, list[str]], unavailable: dict[str, str] | None = None,
              targets: tuple = TIME_TARGETS, reference: dict | None = None, env: dict | None = None) -> int:
    """Run every mode of ``args.modes`` (settled by :func:`prepare`) ``args.repeats`` times, each
    run started by ``launch[mode]`` (with ``env`` added to its environment), except those in
    ``unavailable`` (mode -> why); :func:`evaluate_targets` gives ``targets`` and ``reference``; print the
    report with ``targets`` and write ``--json``. Returns 0 when every run that could run here
    ran, 1 when one failed."""
    unavailable = unavailable or {}
    nvme_dir = Path(args.nvme_dir)
    runnable = [m for m in args.modes if m not in unavailable]
    meta = {"steps": args.steps, "warmup": args.warmup, "repeats": args.repeats, "threads": args.threads,
            "batch": args.batch, "seq": args.seq, "layers": args.layers, "embd": args.embd, "vocab": args.vocab,
            "precision": args.precision, "nvme_dir": str(nvme_dir), "loadavg_start": os.getloadavg(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
    runs: dict[str, list[dict]] = {m: [] for m in args.modes}
    rounds: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="tierstate-e2e-") as tmp, \
            progress(args.repeats * len(runnable), "end-to-end runs") as advance:
        for r in range(args.repeats):
            order = runnable if r % 2 == 0 else runnable[::-1]
            rnd = {}
            for mode in order:
                print(f"round {r + 1}/{args.repeats}: {mode} (load {os.getloadavg()[0]:.2f})", flush=True)
                result = run_one(mode, launch[mode], args, nvme_dir, Path(tmp), f"r{r}", env)
                if result["status"] != "ok":
                    print(f"  {mode}: {result['status']}", flush=True)
                runs[mode].append(result)
                rnd[mode] = result
                advance()  # each run is its own process: nothing here is being timed
            rounds.append(rnd)
    summaries = {}
    for mode in args.modes:
        summaries[mode] = {"mode": mode, "status": unavailable[mode]} if mode in unavailable else summarize(mode, runs[mode])
    meta["loadavg_end"] = os.getloadavg()
    nparams = next((s["nparams"] for s in summaries.values() if s.get("status") == "ok"), None)
    meta["nparams"] = nparams
    meta["nparams_text"] = f"{nparams / 1e6:.1f}M" if nparams else "(no run)"
    meta["issue_shape"] = is_target_shape(args)  # the JSON key readers of the report look up
    evaluated = evaluate_targets(summaries, rounds, meta["issue_shape"], args.precision, targets, reference)
    print(format_report(summaries, evaluated, meta), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "summaries": summaries, "targets": evaluated,
                                               "runs": runs}, indent=1, default=str))
    failed = [m for m in runnable if any(r.get("status") != "ok" for r in runs[m])]
    for m in failed:
        tail = next(r.get("stderr_tail") for r in runs[m] if r.get("status") != "ok")
        if tail:
            print(f"--- {m} stderr (last lines) ---\n{tail}", file=sys.stderr)
    return 1 if failed else 0


def main(args: argparse.Namespace) -> int:
    """Runs the benchmark described by ``args`` (see :func:`add_arguments`); returns an exit code:
    0 when every requested mode ran, 1 when a run failed, 2 for modes the precision rules out."""
    stop = prepare(args)
    if stop is not None:
        return stop
    return run_modes(args, {m: [sys.executable, *WORKER] for m in args.modes})


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(allow_abbrev=False,
                                      prog="python -m tierstate.bench.e2e", description=__doc__.split("\n\n")[0])
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
