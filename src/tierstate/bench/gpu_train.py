"""``tierstate bench gpu``: training a Llama-shaped model on one GPU, with and without offload.

    tierstate bench gpu [--sizes 1b,3b] [--modes torch,cpu,nvme,auto,deepspeed,torchao]
                        [--caps none,24,80] [--largest] [--batch 4] [--seq 1024]
                        [--out-dir DIR] [--json PATH] [--budget SECONDS]

One process per run (mode x size x device-memory cap: :mod:`tierstate.bench._gpu_train_worker`,
whose docstring says what each mode runs). A cap emulates a smaller card on a large one
(``torch.cuda.set_per_process_memory_fraction``): ``--caps 24,80`` runs everything as on a
24 GB and an 80 GB card. For each ``ok`` run the table gives tokens/s, model TFLOP/s and
MFU (against the card's dense bf16 peak: :data:`PEAK_BF16_TFLOPS`, or ``--peak-tflops``),
the median step and its phases, and the peak device and host memory.

Then the comparisons the targets are about, each from runs of this invocation:

- tierstate ``cpu`` (and ``auto``) tokens/s against ``torch`` (no offload) at the same size
  and cap, where both trained (target >= 0.70);
- tierstate against DeepSpeed ZeRO-Offload at the same size and cap (target >= 1.5);
- under each cap, the largest size each mode trained (``--largest`` walks the sizes upward
  per mode and stops that mode at its first size that does not fit), and the ratio of the
  largest tierstate model to the largest plain-torch one (target >= 3 under a 24 GB cap).

A run that fails does not stop the others: its status (``oom``, ``no_fit``, ``unavailable``,
``timeout``, ``error``) is in the table and the JSON, and ``results.json`` in ``--out-dir``
holds every result so far after each run. ``--budget`` bounds the whole invocation (each
run's limit is cut to what is left), so a device lent for minutes returns what finished.
The tierstate modes' step traces are written under ``--out-dir`` with a PNG timeline each
(``tierstate report`` draws them).

On a machine without a GPU, ``--device cpu --sizes tiny`` runs the same code in seconds
(the tests do); caps need a CUDA device.
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
from pathlib import Path

from ._gpu_train_worker import MODES, SIZES, TIERSTATE_MODES
from ._timing import emit_json, load_average, non_negative_int, positive_int
from .e2e import child_env  # the same worker environment as bench e2e

# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity) from the vendors' data sheets, matched
# as substrings of torch.cuda.get_device_name(), most specific first.
PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H200", 989.4), ("H100", 989.4), ("GH200", 989.4),
    ("A100", 312.0), ("L40S", 362.0), ("L4", 121.0), ("A10G", 70.0), ("RTX 4090", 165.2),
)
TARGET_VS_TORCH = 0.70
TARGET_VS_DEEPSPEED = 1.5
TARGET_LARGEST = 3.0
TARGET_CAP_GIB = 24.0
MIN_RUN_S = 20  # under --budget, no run starts with less time left than this
DEFAULT_MODES = MODES


def _list(choices: tuple[str, ...], what: str):
    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"{what}: {', '.join(bad) or 'nothing given'} not among "
                                             f"{', '.join(choices)}")
        return items
    return parse


def _caps(text: str) -> list[float | None]:
    out: list[float | None] = []
    for t in (t.strip() for t in text.split(",")):
        if t in ("none", ""):
            out.append(None)
            continue
        try:
            value = float(t)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--caps: {t!r} is neither 'none' nor GiB (e.g. 24)") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"--caps: {t} GiB must be above 0")
        out.append(value)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", type=_list(tuple(SIZES), "--sizes"), default=["1b", "3b"],
                        help=f"comma list of model sizes, ascending (of {', '.join(SIZES)}; default 1b,3b)")
    parser.add_argument("--modes", type=_list(MODES, "--modes"), default=list(DEFAULT_MODES),
                        help=f"comma list of modes (default all: {','.join(MODES)}); one without its "
                             "package installed reports 'unavailable'")
    parser.add_argument("--caps", type=_caps, default=[None],
                        help="comma list of device-memory caps in GiB, 'none' for the whole card (default none)")
    parser.add_argument("--largest", action="store_true",
                        help="per cap and mode, stop at the first size that does not fit (sizes ascending)")
    parser.add_argument("--batch", type=positive_int, default=4, help="sequences per step (default 4)")
    parser.add_argument("--seq", type=positive_int, default=1024, help="tokens per sequence (default 1024)")
    parser.add_argument("--steps", type=positive_int, default=4, help="timed steps per run (default 4)")
    parser.add_argument("--warmup", type=non_negative_int, default=2, help="untimed steps first (default 2)")
    parser.add_argument("--no-checkpointing", action="store_true", help="keep every activation (default: "
                        "activation checkpointing per decoder layer)")
    parser.add_argument("--device", default=None, help="cuda (default where available) or cpu")
    parser.add_argument("--nvme-dir", default=None, help="folder for the nvme and auto modes' state "
                        "(default: a temporary folder)")
    parser.add_argument("--out-dir", default=None, help="folder for each run's JSON, traces and PNG timelines")
    parser.add_argument("--json", metavar="PATH", default=None, help="also write every figure to PATH as JSON")
    parser.add_argument("--timeout", type=positive_int, default=900, help="seconds allowed per run (default 900)")
    parser.add_argument("--budget", type=positive_int, default=None,
                        help="seconds for the whole invocation: each run's limit is cut to what is left, and "
                             f"none starts with less than {MIN_RUN_S} s left (default: no limit)")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the device's dense bf16 peak for MFU (default: looked up by device name)")


def peak_tflops(device_name: str | None) -> float | None:
    """The dense bf16 peak of ``device_name`` from :data:`PEAK_BF16_TFLOPS`, or None."""
    if not device_name:
        return None
    for key, value in PEAK_BF16_TFLOPS:
        if key in device_name:
            return value
    return None


def run_one(args: argparse.Namespace, mode: str, size: str, cap: float | None, out_dir: Path, nvme_dir: Path,
            tag: str, timeout: float) -> dict:
    """One worker process; its result, or a ``timeout`` / ``error`` result when it wrote none."""
    out = out_dir / f"run-{tag}-{mode}-{size}-cap{'none' if cap is None else f'{cap:g}'}.json"
    cmd = [sys.executable, "-m", "tierstate.bench._gpu_train_worker", "--mode", mode, "--size", size,
           "--out", str(out), "--device", args.device, "--batch", str(args.batch), "--seq", str(args.seq),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--nvme-dir", str(nvme_dir),
           "--trace-dir", str(out_dir), "--tag", tag]
    if cap is not None:
        cmd += ["--cap-gib", f"{cap:g}"]
    if args.no_checkpointing:
        cmd.append("--no-checkpointing")
    head = {"mode": mode, "size": size, "cap_gib": cap, "device": args.device}
    log = out_dir / (out.stem + ".log")
    t0 = time.perf_counter()
    with open(log, "w") as f:
        try:
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=child_env(None), timeout=timeout)
        except subprocess.TimeoutExpired:
            return {**head, "status": "timeout", "error": f"no result within {timeout:.0f} s (log: {log})",
                    "wall_s": time.perf_counter() - t0}
    wall = time.perf_counter() - t0
    if out.exists():
        result = json.loads(out.read_text())
    else:  # killed (the host's OOM killer) or crashed before writing
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        status = "oom" if proc.returncode in (-9, 137) else "error"
        result = {**head, "status": status, "error": f"exit status {proc.returncode}: {' | '.join(tail)}"}
    result["wall_s"] = wall
    result["log"] = str(log)
    return result


def figures(result: dict, peak: float | None) -> dict:
    """Median step figures of an ``ok`` result: tokens/s, TFLOP/s, MFU, phases, memory."""
    timed = [s for s in result["steps"] if not s["warmup"]] or result["steps"]
    step = statistics.median(s["total"] for s in timed)
    tokens = result["batch"] * result["seq"]
    tflops = result["flops_per_step"] / step / 1e12
    out = {"step_s": step, "tokens_per_s": tokens / step, "tflops": tflops,
           "mfu": tflops / peak if peak else None,
           "fwd_s": statistics.median(s["fwd"] for s in timed), "bwd_s": statistics.median(s["bwd"] for s in timed),
           "opt_s": statistics.median(s["opt"] for s in timed),
           "peak_device_gib": result.get("peak_device_reserved_bytes", 0) / 2**30 or None,
           "peak_host_gib": result.get("peak_rss_bytes", 0) / 2**30}
    phases = [s["phases"] for s in timed if s.get("phases")]
    if phases:
        names = sorted({k for p in phases for k in p})
        out["phases_s"] = {k: statistics.median(p.get(k, 0.0) for p in phases) for k in names}
    return out


def compare(results: list[dict]) -> dict:
    """The target comparisons among ``ok`` results (see the module docstring)."""
    ok = {(r["mode"], r["size"], r["cap_gib"]): r for r in results if r["status"] == "ok"}
    rows = []
    for (mode, size, cap), r in ok.items():
        if mode not in TIERSTATE_MODES:
            continue
        for peer, target in (("torch", TARGET_VS_TORCH), ("deepspeed", TARGET_VS_DEEPSPEED)):
            other = ok.get((peer, size, cap))
            if other is not None:
                ratio = r["figures"]["tokens_per_s"] / other["figures"]["tokens_per_s"]
                rows.append({"mode": mode, "against": peer, "size": size, "cap_gib": cap, "ratio": ratio,
                             "target": target, "met": ratio >= target})
    largest: dict = {}
    for r in results:
        if r["status"] == "ok":
            key = (r["cap_gib"], r["mode"])
            if key not in largest or r["model_numel"] > largest[key]["numel"]:
                largest[key] = {"size": r["size"], "numel": r["model_numel"]}
    capacity = []
    for cap in sorted({c for c, _ in largest} | {r["cap_gib"] for r in results}, key=lambda c: (c is None, c or 0)):
        best_ts = max((v["numel"] for (c, m), v in largest.items() if c == cap and m in TIERSTATE_MODES), default=0)
        best_torch = largest.get((cap, "torch"), {}).get("numel", 0)
        tried_torch = any(r["mode"] == "torch" and r["cap_gib"] == cap for r in results)
        capacity.append({"cap_gib": cap, "largest_tierstate_numel": best_ts, "largest_torch_numel": best_torch,
                         "ratio": best_ts / best_torch if best_torch else None, "torch_tried": tried_torch,
                         "target": TARGET_LARGEST if cap == TARGET_CAP_GIB else None})
    return {"speed": rows, "largest": [{"cap_gib": c, "mode": m, **v} for (c, m), v in sorted(
        largest.items(), key=lambda kv: ((kv[0][0] is None, kv[0][0] or 0), kv[0][1]))], "capacity": capacity}


def _plot_traces(results: list[dict]) -> None:
    """A PNG timeline beside each trace (matplotlib missing or a bad trace: noted, not fatal)."""
    for r in results:
        trace = r.get("trace")
        if not trace or not os.path.exists(trace):
            continue
        try:
            from ..telemetry.report import load_trace, parse_trace, plot_timeline

            r["timeline_png"] = plot_timeline(parse_trace(load_trace(trace)), os.path.splitext(trace)[0] + ".png")
        except Exception as exc:  # the figures stand without the picture
            r["timeline_error"] = f"{type(exc).__name__}: {exc}"


def _fmt(x, spec: str, none: str = "-") -> str:
    return none if x is None else format(x, spec)


def table(results: list[dict]) -> str:
    lines = ["| cap GiB | size | mode | status | tokens/s | TFLOP/s | MFU | step s (fwd/bwd/opt) | device GiB "
             "| host GiB |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        cap = "none" if r["cap_gib"] is None else f"{r['cap_gib']:g}"
        f = r.get("figures")
        if f is None:
            lines.append(f"| {cap} | {r['size']} | {r['mode']} | {r['status']}: {r.get('error', '')[:90]} "
                         "| | | | | | |")
            continue
        lines.append(f"| {cap} | {r['size']} | {r['mode']} | ok | {f['tokens_per_s']:.0f} | {f['tflops']:.1f} | "
                     f"{_fmt(f['mfu'], '.1%')} | {f['step_s']:.3f} ({f['fwd_s']:.3f}/{f['bwd_s']:.3f}/"
                     f"{f['opt_s']:.3f}) | {_fmt(f['peak_device_gib'], '.1f')} | {f['peak_host_gib']:.1f} |")
    return "\n".join(lines)


def summary(comparison: dict, on_gpu: bool = True) -> str:
    """The comparisons in words; without a GPU the verdicts are left out (on the CPU, ``torch``
    trains fp32 parameters and the offload modes bf16 ones: a run of the code, not of the targets)."""
    lines = [] if on_gpu else ["(CPU run: the ratios below exercise the code; the targets are for CUDA runs)"]

    def verdict(met: bool, target: float) -> str:
        return f"; target >= {target:g}: {'met' if met else 'NOT met'}" if on_gpu else ""

    for row in comparison["speed"]:
        cap = "whole card" if row["cap_gib"] is None else f"{row['cap_gib']:g} GiB cap"
        lines.append(f"{row['mode']} / {row['against']} tokens/s, {row['size']}, {cap}: {row['ratio']:.2f}x"
                     f"{verdict(row['met'], row['target'])}")
    for row in comparison["capacity"]:
        cap = "whole card" if row["cap_gib"] is None else f"{row['cap_gib']:g} GiB cap"
        ts_n, torch_n = row["largest_tierstate_numel"], row["largest_torch_numel"]
        text = f"largest trained, {cap}: tierstate {ts_n / 1e9:.2f}B parameters, torch {torch_n / 1e9:.2f}B"
        if row["ratio"] is not None:
            met = row["ratio"] >= (row["target"] or 0)
            text += f" ({row['ratio']:.1f}x{verdict(met, row['target']) if row['target'] else ''})"
        elif row["torch_tried"]:
            text += " (torch trained none of the sizes tried)"
        lines.append(text)
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    import torch

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("tierstate bench gpu: --device cuda, but torch sees no CUDA device here; "
              "use --device cpu --sizes tiny for a run of the same code on the CPU", file=sys.stderr)
        return 2
    if not args.device.startswith("cuda") and any(c is not None for c in args.caps):
        print("tierstate bench gpu: --caps limit device memory and need --device cuda", file=sys.stderr)
        return 2
    out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="tierstate-bench-gpu-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    nvme_dir = Path(args.nvme_dir or tempfile.mkdtemp(prefix="tierstate-bench-gpu-nvme-"))
    device_name = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else None
    peak = args.peak_tflops or peak_tflops(device_name)
    print(f"device: {device_name or args.device}; dense bf16 peak for MFU: {_fmt(peak, 'g', 'unknown')} TFLOP/s; "
          f"batch {args.batch} x {args.seq} tokens; load average {load_average()}", flush=True)
    start = time.perf_counter()
    results: list[dict] = []
    stopped: set = set()  # (cap, mode) that did not fit a smaller size under --largest
    unavailable: dict = {}  # mode -> why its package does not import: not asked again
    for cap in args.caps:
        for size in args.sizes:
            for mode in args.modes:
                tag = f"{len(results):02d}"
                if mode in unavailable:
                    results.append({"mode": mode, "size": size, "cap_gib": cap, "status": "unavailable",
                                    "error": unavailable[mode]})
                    continue
                if args.largest and (cap, mode) in stopped:
                    results.append({"mode": mode, "size": size, "cap_gib": cap, "status": "skipped",
                                    "error": "a smaller size did not fit"})
                    continue
                timeout = float(args.timeout)
                if args.budget is not None:
                    left = args.budget - (time.perf_counter() - start)
                    if left < MIN_RUN_S:
                        results.append({"mode": mode, "size": size, "cap_gib": cap, "status": "skipped",
                                        "error": f"--budget {args.budget} s spent"})
                        continue
                    timeout = min(timeout, left)
                r = run_one(args, mode, size, cap, out_dir, nvme_dir, tag, timeout)
                if r["status"] == "ok":
                    r["figures"] = figures(r, peak)
                elif r["status"] in ("oom", "no_fit"):
                    stopped.add((cap, mode))
                elif r["status"] == "unavailable":
                    unavailable[mode] = r.get("error", "")
                results.append(r)
                # so far, in case this process is stopped before the end
                (out_dir / "results.json").write_text(json.dumps({"results": results}, indent=1))
                f = r.get("figures")
                print(f"  {mode:9s} {size:5s} cap {_fmt(cap, 'g', 'none'):>4s}: {r['status']}"
                      + (f", {f['tokens_per_s']:.0f} tokens/s, step {f['step_s']:.3f} s" if f else
                         f" ({r.get('error', '')[:120]})"), flush=True)
    _plot_traces(results)
    comparison = compare(results)
    print()
    print(table(results))
    print()
    print(summary(comparison, on_gpu=device_name is not None))
    emit_json(args.json, {"device": device_name or args.device, "peak_tflops": peak, "batch": args.batch,
                          "seq": args.seq, "results": results, "comparison": comparison,
                          "wall_s": time.perf_counter() - start})
    (out_dir / "results.json").write_text(json.dumps({"results": results, "comparison": comparison}, indent=1))
    return 0
