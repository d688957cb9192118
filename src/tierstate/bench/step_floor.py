"""``tierstate bench floor``: ``opt.step()`` as a user calls it, against the memory floor.

    tierstate bench floor [--sizes 50M,100M] [--rounds 9] [--gap-ms 0] [--json [PATH]]

Where ``tierstate bench step`` times the kernels alone, this times the whole
``tierstate.AdamW(offload="cpu").step()`` (norm and non-finite check, bookkeeping, state
publication, the kernels) over the weights of a small MLP (matrices of 2048 x 8192, as in
a d=2048 transformer), each step called right after that model's forward/backward on 8
rows, as in training: torch's OpenMP workers are still spinning when the step starts
(``--gap-ms`` sleeps in between instead, as after a GPU backward). Variants, interleaved
round by round (every other round reversed) in one process:

- ``tierstate``      ``ts.AdamW`` over the bf16 model (fp32 master and moments in host RAM):
                     28 B/param; the gradient norm was taken by the gradients' hooks in
                     backward (:class:`tierstate.pipeline.grads.HookNorms`);
- ``tierstate-norm-in-step`` the same optimizer with the hooks' sums ignored, so the step
                     reads every gradient first (30 B/param), as before the hooks;
- ``tierstate-no-handover`` ``tierstate`` without handing the cores over from torch's
                     spinning OpenMP workers first (:mod:`tierstate.kernels.omp_handover`);
- ``floor``          torch ``AdamW(fused=True)`` over an fp32 copy of the model: the 28 B/param
                     a fused step must move, at the speed torch moves them;
- ``torch+casts``    the same fused step over fp32 masters of the bf16 model, plus the casts
                     a mixed-precision user writes (bf16 gradient -> fp32, fp32 -> bf16 weight):
                     40 B/param.

Reported: the median seconds of each step and of each backward, the medians of the
per-round ratios tierstate/floor and (torch+casts)/tierstate, and (backward + step) of
``tierstate`` over ``tierstate-norm-in-step`` (what the hooks cost inside backward is in it).
After every step the variant's model runs one forward (no grad), timed: what the step
leaves to torch's next forward (the hand-over restarts torch's OpenMP workers there).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from ._timing import JSON_STDOUT, counts_arg, emit_json, load_average

LR, BETAS, EPS, WEIGHT_DECAY = 1e-4, (0.9, 0.95), 1e-8, 0.1
VARIANTS = ("tierstate", "tierstate-norm-in-step", "tierstate-no-handover", "floor", "torch+casts")
_D, _F = 2048, 8192  # model width and MLP width: 2048 x 8192 = 16.8M elements per matrix
_ROWS = 8


def shapes_for(n: int) -> list[tuple[int, int]]:
    """Linear weight shapes adding up to about ``n`` elements: (8192, 2048) and (2048, 8192) in turn."""
    per = _D * _F
    return [(_F, _D) if i % 2 == 0 else (_D, _F) for i in range(max(1, round(n / per)))]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", type=counts_arg, default=[50_000_000, 100_000_000],
                        help="parameter counts, comma separated, suffixes K/M/G (default 50M,100M); rounded to "
                             "whole 2048 x 8192 matrices")
    parser.add_argument("--rounds", type=int, default=9, help="timed rounds (default 9)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first (default 2)")
    parser.add_argument("--gap-ms", type=float, default=0.0,
                        help="sleep between the model's backward and each step (default 0: right after it)")
    parser.add_argument("--json", nargs="?", const=JSON_STDOUT, metavar="PATH",
                        help="write the figures as JSON to PATH (no PATH: to standard output instead of the table)")


def _mlp(shapes: list[tuple[int, int]], dtype: torch.dtype, seed: int = 0) -> torch.nn.Sequential:
    gen = torch.Generator().manual_seed(seed)
    layers = []
    for out_f, in_f in shapes:
        lin = torch.nn.Linear(in_f, out_f, bias=False)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(out_f, in_f, generator=gen) * in_f ** -0.5)
        layers += [lin, torch.nn.GELU()]
    return torch.nn.Sequential(*layers[:-1]).to(dtype)


def _backward(model: torch.nn.Module, x: torch.Tensor) -> None:
    model(x).float().square().mean().backward()


def _build(n: int):
    """{variant: (backward, step)} over models of about ``n`` parameters, and the tierstate optimizer."""
    import tierstate as ts  # noqa: PLC0415 - the command line imports this module lazily
    from tierstate.kernels import omp_handover  # noqa: PLC0415

    shapes = shapes_for(n)
    x = torch.randn(_ROWS, shapes[0][1], generator=torch.Generator().manual_seed(1))
    low = _mlp(shapes, torch.bfloat16)
    opt = ts.AdamW(low.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, offload="cpu")
    norms = opt._engine.parts.grads.norms

    def norm_in_step() -> None:
        saved = norms.sumsq
        norms.sumsq = lambda t, param, scale: None  # as if no hook had taken the sums
        try:
            opt.step()
        finally:
            norms.sumsq = saved

    def no_handover() -> None:
        was = omp_handover.enabled()
        omp_handover.set_enabled(False)
        try:
            opt.step()
        finally:
            omp_handover.set_enabled(was)

    full = _mlp(shapes, torch.float32)
    fused = torch.optim.AdamW(full.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, fused=True)
    low2 = _mlp(shapes, torch.bfloat16)  # its own model: a backward of ``low`` without its step would
    # leave the hooks' sums of ``low`` to a gradient accumulated twice
    masters = [torch.nn.Parameter(p.detach().float()) for p in low2.parameters()]
    for m in masters:
        m.grad = torch.empty_like(m)
    fused_masters = torch.optim.AdamW(masters, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, fused=True)

    def with_casts() -> None:
        for m, p in zip(masters, low2.parameters()):
            m.grad.copy_(p.grad)
        fused_masters.step()
        with torch.no_grad():
            for m, p in zip(masters, low2.parameters()):
                p.copy_(m)

    def zeroed(model, step):
        def run() -> None:
            step()
            model.zero_grad(set_to_none=True)
        return run

    def forward(model, inp):
        def run() -> None:
            with torch.no_grad():
                model(inp)
        return run

    xl = x.bfloat16()
    calls = {  # (backward, step, the next forward)
        "tierstate": (lambda: _backward(low, xl), zeroed(low, opt.step), forward(low, xl)),
        "tierstate-norm-in-step": (lambda: _backward(low, xl), zeroed(low, norm_in_step), forward(low, xl)),
        "tierstate-no-handover": (lambda: _backward(low, xl), zeroed(low, no_handover), forward(low, xl)),
        "floor": (lambda: _backward(full, x), zeroed(full, fused.step), forward(full, x)),
        "torch+casts": (lambda: _backward(low2, xl), zeroed(low2, with_casts), forward(low2, xl)),
    }
    return calls, opt, sum(a * b for a, b in shapes), len(shapes)


def measure(n: int, rounds: int, warmup: int, gap_ms: float) -> dict:
    """Seconds of every variant's backward and step in ``rounds`` interleaved rounds."""
    calls, opt, numel, tensors = _build(n)
    steps = {name: [] for name in VARIANTS}
    backs = {name: [] for name in VARIANTS}
    nexts = {name: [] for name in VARIANTS}
    shares: dict[str, list[float]] = {}
    for rnd in range(warmup + rounds):
        order = VARIANTS if rnd % 2 == 0 else VARIANTS[::-1]
        for name in order:
            backward, step, next_forward = calls[name]
            t0 = time.perf_counter()
            backward()  # torch's OpenMP workers spin after it, as after a training backward
            t1 = time.perf_counter()
            if gap_ms > 0:
                time.sleep(gap_ms / 1e3)
            t2 = time.perf_counter()
            step()
            t3 = time.perf_counter()
            next_forward()
            t4 = time.perf_counter()
            if rnd >= warmup:
                steps[name].append(t3 - t2)
                backs[name].append(t1 - t0)
                nexts[name].append(t4 - t3)
                if name == "tierstate":
                    for phase, seconds in opt.stats().phases.items():
                        shares.setdefault(phase, []).append(seconds / (t3 - t2))
    opt.close()

    def ratio(a: list[float], b: list[float]) -> float:
        return statistics.median(x / y for x, y in zip(a, b))

    whole = {k: [b + s for b, s in zip(backs[k], steps[k])] for k in VARIANTS}
    return {
        "params": numel, "tensors": tensors,
        "median_step_s": {k: statistics.median(v) for k, v in steps.items()},
        "median_backward_s": {k: statistics.median(v) for k, v in backs.items()},
        "median_next_forward_s": {k: statistics.median(v) for k, v in nexts.items()},
        "tierstate_over_floor": ratio(steps["tierstate"], steps["floor"]),
        "casts_over_tierstate": ratio(steps["torch+casts"], steps["tierstate"]),
        "no_handover_over_tierstate": ratio(steps["tierstate-no-handover"], steps["tierstate"]),
        "next_forward_handover_over_none": ratio(nexts["tierstate"], nexts["tierstate-no-handover"]),
        "norm_in_step_over_floor": ratio(steps["tierstate-norm-in-step"], steps["floor"]),
        "bwd_step_hooks_over_norm_in_step": ratio(whole["tierstate"], whole["tierstate-norm-in-step"]),
        "phase_share": {k: statistics.median(v) for k, v in shares.items()},
        "step_s": steps, "backward_s": backs, "next_forward_s": nexts,
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
    for r in results:
        m, b, f = r["median_step_s"], r["median_backward_s"], r["median_next_forward_s"]
        print(f"{r['params']:,} params in {r['tensors']} matrices; median step s (backward s, next forward s):")
        for k in VARIANTS:
            print(f"  {k:<24} {m[k]:.4f} ({b[k]:.4f}, {f[k]:.4f})")
        print(f"  tierstate / floor {r['tierstate_over_floor']:.3f}; norm-in-step / floor "
              f"{r['norm_in_step_over_floor']:.3f}; torch+casts / tierstate {r['casts_over_tierstate']:.3f}; "
              f"(backward + step) hooks / norm-in-step {r['bwd_step_hooks_over_norm_in_step']:.3f}")
        print(f"  OpenMP hand-over: step without / with {r['no_handover_over_tierstate']:.3f}; torch's next "
              f"forward with / without {r['next_forward_handover_over_none']:.3f}")
        top = sorted(r["phase_share"].items(), key=lambda kv: -kv[1])[:4]
        print("  tierstate step phases: " + ", ".join(f"{k} {v:.0%}" for k, v in top))
    return 0
