"""``tierstate bench floor``: ``opt.step()`` as a user calls it, against the memory floor.

    tierstate bench floor [--sizes 50M,100M] [--rounds 9] [--gap-ms 0] [--json [PATH]]

Where ``tierstate bench step`` times the kernels alone, this times the whole
``tierstate.AdamW(offload="cpu").step()`` (non-finite check and norm, bookkeeping, state
publication, the kernels) over a few bf16 parameters shaped like a transformer's MLP
matrices, each call made right after a forward/backward of a small torch model, as in
training: torch's OpenMP workers are still spinning when the step starts (``--gap-ms``
sleeps in between instead, as after a GPU backward). Variants, interleaved round by round
(every other round reversed) in one process:

- ``tierstate``   ``ts.AdamW`` over bf16 parameters with bf16 gradients (fp32 master and
                  moments in host RAM): 28 B/param;
- ``floor``       torch ``AdamW(fused=True)`` over fp32 parameters and gradients of the same
                  shapes: the 28 B/param a fused step must move, at the speed torch moves them;
- ``torch+casts`` the same fused step plus the casts a mixed-precision user writes (bf16
                  gradient -> fp32, fp32 weight -> bf16 parameter): 40 B/param.

Reported: the median seconds of each, and the medians of the per-round ratios
tierstate/floor and (torch+casts)/tierstate; plus the median share of each of
``opt.stats()``'s phases in the tierstate step.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from ._timing import JSON_STDOUT, counts_arg, emit_json, load_average

LR, BETAS, EPS, WEIGHT_DECAY = 1e-4, (0.9, 0.95), 1e-8, 0.1
VARIANTS = ("tierstate", "floor", "torch+casts")
# an MLP matrix of a d=2048 transformer (2048 x 8192): 16.8M elements
_MATRIX = (8192, 2048)


def shapes_for(n: int) -> list[tuple[int, ...]]:
    """Model-like shapes adding up to ``n`` elements: 2048 x 8192 matrices, the rest in one 2048-row matrix."""
    per = _MATRIX[0] * _MATRIX[1]
    out = [_MATRIX] * (n // per)
    rest = n - len(out) * per
    if rest >= _MATRIX[1]:
        out.append((rest // _MATRIX[1], _MATRIX[1]))
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", type=counts_arg, default=[50_000_000, 100_000_000],
                        help="parameter counts, comma separated, suffixes K/M/G (default 50M,100M)")
    parser.add_argument("--rounds", type=int, default=9, help="timed rounds (default 9)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first (default 2)")
    parser.add_argument("--gap-ms", type=float, default=0.0,
                        help="sleep between the model's backward and each step (default 0: right after it)")
    parser.add_argument("--json", nargs="?", const=JSON_STDOUT, metavar="PATH",
                        help="write the figures as JSON to PATH (no PATH: to standard output instead of the table)")


class _Model:
    """The small torch model whose forward/backward runs before every timed step (its own
    parameters, not stepped): 2 x Linear(512, 2048) on 64 rows, ~4 ms on 2 cores."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(1)
        self.net = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512))
        self.x = torch.randn(64, 512, generator=gen)

    def run(self) -> None:
        self.net.zero_grad(set_to_none=True)
        self.net(self.x).square().mean().backward()


def _build(n: int):
    """Each variant's step over ``n`` elements, with its parameters and gradients made once."""
    import tierstate as ts  # noqa: PLC0415 - the command line imports this module lazily

    gen = torch.Generator().manual_seed(0)
    shapes = shapes_for(n)
    grads = [(torch.randn(s, generator=gen) * 1e-3).bfloat16() for s in shapes]
    ts_params = [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.02).bfloat16()) for s in shapes]
    for p, g in zip(ts_params, grads):
        p.grad = g
    opt = ts.AdamW(ts_params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, offload="cpu")
    fp32 = [torch.nn.Parameter(p.detach().float()) for p in ts_params]
    for p, g in zip(fp32, grads):
        p.grad = g.float()
    fused = torch.optim.AdamW(fp32, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, fused=True)
    low = [torch.empty(s, dtype=torch.bfloat16) for s in shapes]

    def with_casts() -> None:
        for p, g in zip(fp32, grads):
            p.grad.copy_(g)
        fused.step()
        for out, p in zip(low, fp32):
            out.copy_(p.detach())

    return {"tierstate": opt.step, "floor": fused.step, "torch+casts": with_casts}, opt, sum(g.numel() for g in grads)


def measure(n: int, rounds: int, warmup: int, gap_ms: float) -> dict:
    """Seconds of every variant in ``rounds`` interleaved rounds, with the tierstate step's phase shares."""
    model = _Model()
    steps, opt, numel = _build(n)
    times = {name: [] for name in VARIANTS}
    shares: dict[str, list[float]] = {}
    for rnd in range(warmup + rounds):
        order = VARIANTS if rnd % 2 == 0 else VARIANTS[::-1]
        for name in order:
            model.run()  # torch's OpenMP workers spin after it, as after a training backward
            if gap_ms > 0:
                time.sleep(gap_ms / 1e3)
            t0 = time.perf_counter()
            steps[name]()
            elapsed = time.perf_counter() - t0
            if rnd >= warmup:
                times[name].append(elapsed)
                if name == "tierstate":
                    phases = opt.stats().as_dict().get("phases", {})
                    for phase, seconds in phases.items():
                        shares.setdefault(phase, []).append(seconds / elapsed)
    opt.close()
    ratio_floor = [a / b for a, b in zip(times["tierstate"], times["floor"])]
    ratio_casts = [b / a for a, b in zip(times["tierstate"], times["torch+casts"])]
    return {
        "params": numel, "tensors": len(shapes_for(n)),
        "median_s": {k: statistics.median(v) for k, v in times.items()},
        "tierstate_over_floor": statistics.median(ratio_floor),
        "casts_over_tierstate": statistics.median(ratio_casts),
        "phase_share": {k: statistics.median(v) for k, v in shares.items()},
        "times_s": times,
    }


def main(args: argparse.Namespace) -> int:
    for name, value in (("--rounds", args.rounds), ("--warmup", args.warmup)):
        if value < 1 and name == "--rounds" or value < 0:
            print(f"tierstate bench floor: error: {name}={value}: must be >= 1 (--rounds) or >= 0 (--warmup)",
                  file=sys.stderr)
            return 2
    results = [measure(n, args.rounds, args.warmup, args.gap_ms) for n in args.sizes]
    figures = {"threads": torch.get_num_threads(), "load_average": load_average(), "gap_ms": args.gap_ms,
               "results": results}
    if args.json is not None:
        emit_json(args.json, figures)
        if args.json == JSON_STDOUT:
            return 0
    print(f"opt.step() vs the floor; torch threads {figures['threads']}, load average {figures['load_average']}, "
          f"gap {args.gap_ms} ms after the model's backward")
    print(f"{'params':>12} {'tierstate s':>12} {'floor s':>9} {'casts s':>9} {'ts/floor':>9} {'casts/ts':>9}  phases")
    for r in results:
        m = r["median_s"]
        top = sorted(r["phase_share"].items(), key=lambda kv: -kv[1])[:4]
        print(f"{r['params']:>12,} {m['tierstate']:>12.4f} {m['floor']:>9.4f} {m['torch+casts']:>9.4f} "
              f"{r['tierstate_over_floor']:>9.3f} {r['casts_over_tierstate']:>9.3f}  "
              + ", ".join(f"{k} {v:.0%}" for k, v in top))
    return 0
