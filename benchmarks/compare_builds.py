"""Two builds of tierstate, the same benchmarks, interleaved: is the change faster or slower?

    python benchmarks/compare_builds.py --before OLD/.venv/bin/python --after .venv/bin/python

Each round runs every benchmark once with each build, the order of the builds alternating
from round to round, so the machine's drift (memory and disk speed move by 1.5x over minutes
on a shared VM) falls on both alike; the table gives the median over rounds of each figure
and the after/before ratio of the medians. Every run starts from a temporary working
directory, so each interpreter imports its own installed package, never a checkout's sources.

The benchmarks are the package's own commands (they exist in both builds):
- ``tierstate bench step --offload cpu --variants native``: the host kernels alone (a sanity
  row: a change to the step engine must not move it);
- ``tierstate bench step --offload nvme``: the optimizer's step with the state in RAM and
  with it on NVMe, against the disk;
- ``tierstate bench e2e --modes ...``: GPT-2 training steps (forward, backward, step).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def _run(python: str, args: list[str], cwd: Path, timeout: float) -> str:
    proc = subprocess.run([python, "-m", "tierstate", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{python} -m tierstate {' '.join(args)} failed ({proc.returncode}):\n"
                           f"{proc.stderr[-3000:]}")
    return proc.stdout


def cpu_step(python: str, work: Path, args: argparse.Namespace) -> dict[str, float]:
    out = work / "cpu.json"
    _run(python, ["bench", "step", "--offload", "cpu", "--sizes", args.cpu_size, "--threads", "2",
                  "--reps", str(args.cpu_reps), "--variants", "native", "--json", str(out)], work, args.timeout)
    rows = json.loads(out.read_text())
    rows = rows["rows"] if isinstance(rows, dict) else rows
    return {f"bench step cpu {r['params'] / 1e6:.0f}M native kernel, s": r["median_ms"] / 1e3 for r in rows
            if r["variant"] == "native" and r["threads"] == 2}


def nvme_step(python: str, work: Path, args: argparse.Namespace) -> dict[str, float]:
    text = _run(python, ["bench", "step", "--offload", "nvme", "--params", args.nvme_params, "--steps",
                         str(args.nvme_steps), "--nvme-dir", str(work), "--json"], work, args.timeout)
    out = {}
    for row in json.loads(text):
        size = f"{row['params'] / 1e6:.0f}M"
        out[f"bench step nvme {size}: RAM-state step, s"] = row["cpu_step_s"]
        out[f"bench step nvme {size}: NVMe-state step, s"] = row["nvme_step_s"]
    return out


def e2e(python: str, work: Path, args: argparse.Namespace) -> dict[str, float]:
    out_json = work / "e2e.json"
    _run(python, ["bench", "e2e", "--modes", args.e2e_modes, "--steps", str(args.e2e_steps), "--warmup", "2", "--precision", "bf16",
                  "--repeats", "1", "--nvme-dir", str(work), "--json", str(out_json)], work, args.timeout)
    summaries = json.loads(out_json.read_text())["summaries"]
    out = {}
    for mode, s in summaries.items():
        if s.get("status") == "ok":
            out[f"bench e2e {mode}: step, s"] = s["total"]["median"]
            out[f"bench e2e {mode}: opt.step(), s"] = s["opt"]["median"]
    return out


BENCHES = {"cpu": cpu_step, "nvme": nvme_step, "e2e": e2e}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="python of the build to compare against")
    parser.add_argument("--after", required=True, help="python of the changed build")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each running both builds (default 3)")
    parser.add_argument("--benches", default="cpu,nvme,e2e", help="comma list of: cpu, nvme, e2e")
    parser.add_argument("--cpu-size", default="100M")
    parser.add_argument("--cpu-reps", type=int, default=7)
    parser.add_argument("--nvme-params", default="100M")
    parser.add_argument("--nvme-steps", type=int, default=5)
    parser.add_argument("--e2e-modes", default="cpu_bf16,nvme_bf16,nvme_bf16_bwd")
    parser.add_argument("--e2e-steps", type=int, default=4)
    parser.add_argument("--nvme-dir", default=None, help="parent of the working folders (default: the temp dir)")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per benchmark run")
    parser.add_argument("--json", metavar="PATH", help="also write every figure of every round to PATH")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: must be at least 1")
    benches = [b.strip() for b in args.benches.split(",") if b.strip()]
    unknown = [b for b in benches if b not in BENCHES]
    if unknown:
        parser.error(f"--benches: unknown {unknown}; choose from {sorted(BENCHES)}")
    builds = {"before": args.before, "after": args.after}
    figures: dict[str, dict[str, list[float]]] = {"before": {}, "after": {}}
    for r in range(args.rounds):
        order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
        for bench in benches:
            for build in order:
                with tempfile.TemporaryDirectory(prefix="compare-builds-", dir=args.nvme_dir) as work:
                    got = BENCHES[bench](builds[build], Path(work), args)
                for key, value in got.items():
                    figures[build].setdefault(key, []).append(value)
                print(f"round {r + 1}/{args.rounds} {bench} {build}: "
                      + ", ".join(f"{k.split(': ')[-1] if ': ' in k else k} {v:.4f}" for k, v in got.items()),
                      file=sys.stderr, flush=True)
    keys = [k for k in figures["before"] if k in figures["after"]]
    width = max(len(k) for k in keys) if keys else 10
    print(f"{'figure':<{width}}  before (median)  after (median)  after/before  rounds")
    for k in keys:
        b, a = statistics.median(figures["before"][k]), statistics.median(figures["after"][k])
        print(f"{k:<{width}}  {b:15.4f}  {a:14.4f}  {a / b:12.3f}  {len(figures['after'][k])}")
    if args.json:
        Path(args.json).write_text(json.dumps({"builds": builds, "rounds": args.rounds, "figures": figures}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
