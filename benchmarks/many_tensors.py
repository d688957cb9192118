"""The whole ``opt.step()`` over many parameter tensors: what each tensor costs beyond its bytes.

``tierstate bench step`` and ``tierstate bench floor`` time one large tensor, where the step
is bound by memory bandwidth. A model is many tensors (GPT-2 small: 148; a LoRA adapter set:
hundreds of small ones), and every tensor costs the step some fixed work besides its bytes.
This benchmark times, in interleaved rounds of one process, for each shape ``COUNTxNUMEL``:

- ``tierstate``: ``ts.AdamW(offload="cpu")`` over COUNT fp32 tensors of NUMEL elements;
- ``torch-fused``: ``torch.optim.AdamW(fused=True)`` over the same tensors;
- ``torch-foreach``: ``torch.optim.AdamW(foreach=True)`` over them;
- ``floor``: ``torch.optim.AdamW(fused=True)`` over ONE tensor of COUNT x NUMEL elements:
  the same 28 B per parameter at the memory bandwidth, with no per-tensor cost.

Before each timed step a backward of ``sum((p * w).sum())`` (``w`` fixed per tensor) gives
every tensor its gradient, as training does, so tierstate's backward hooks take the gradient
norm there (untimed). Per-tensor overhead = (median - floor) / COUNT.

    python benchmarks/many_tensors.py --shapes 400x4096,400x65536,148x75000 --rounds 30
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

VARIANTS = ("tierstate", "torch-fused", "torch-foreach", "floor")


def parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for item in text.split(","):
        count, sep, numel = item.strip().lower().partition("x")
        if not sep or not count.isdigit() or not numel.isdigit() or int(count) < 1 or int(numel) < 1:
            raise argparse.ArgumentTypeError(f"--shapes: {item!r} is not COUNTxNUMEL with positive integers, "
                                             "e.g. 400x4096")
        shapes.append((int(count), int(numel)))
    return shapes


def _optimizer(variant: str, params: list):
    import torch

    import tierstate as ts

    if variant == "tierstate":
        return ts.AdamW(params, lr=1e-4, offload="cpu")
    return torch.optim.AdamW(params, lr=1e-4, **({"foreach": True} if variant == "torch-foreach" else {"fused": True}))


def _setup(variant: str, count: int, numel: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    shapes = [count * numel] if variant == "floor" else [numel] * count
    params = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in shapes]
    weights = [torch.randn(n, generator=g) * 1e-3 for n in shapes]
    opt = _optimizer(variant, params)
    for _ in range(3):  # state created, allocator and thread pools warm
        _backward(opt, params, weights)
        opt.step()
    return opt, params, weights


def _backward(opt, params, weights) -> None:
    opt.zero_grad(set_to_none=True)
    sum((p * w).sum() for p, w in zip(params, weights)).backward()


def run(shapes: list[tuple[int, int]], rounds: int, threads: int) -> list[dict]:
    import torch

    import tierstate.kernels as kernels

    torch.set_num_threads(threads)
    kernels.set_num_threads(threads)
    rows = []
    for count, numel in shapes:
        opts = {v: _setup(v, count, numel, seed=i) for i, v in enumerate(VARIANTS)}
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for r in range(rounds):
            order = VARIANTS if r % 2 == 0 else tuple(reversed(VARIANTS))
            for v in order:
                opt, params, weights = opts[v]
                _backward(opt, params, weights)
                t0 = time.perf_counter()
                opt.step()
                times[v].append(time.perf_counter() - t0)
        floor = statistics.median(times["floor"])
        for v in VARIANTS:
            med = statistics.median(times[v])
            rows.append(dict(shape=f"{count}x{numel}", variant=v, median_ms=med * 1e3,
                             min_ms=min(times[v]) * 1e3, max_ms=max(times[v]) * 1e3, x_floor=med / floor,
                             overhead_us_per_tensor=(med - floor) / count * 1e6 if v != "floor" else 0.0,
                             gb_per_s=count * numel * 28 / med / 1e9))
        for opt, _, _ in opts.values():
            if hasattr(opt, "close"):
                opt.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--shapes", type=parse_shapes, default=parse_shapes("400x4096,400x65536,148x75000"),
                        help="comma-separated COUNTxNUMEL (default 400x4096,400x65536,148x75000)")
    parser.add_argument("--rounds", type=int, default=30, help="timed steps per variant, interleaved (default 30)")
    parser.add_argument("--threads", type=int, default=2, help="torch and tierstate threads (default 2)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: must be >= 1")
    if args.threads < 1:
        parser.error(f"--threads {args.threads}: must be >= 1")
    rows = run(args.shapes, args.rounds, args.threads)
    print(f"AdamW over many fp32 tensors, one process, {args.rounds} interleaved steps each, {args.threads} threads; "
          "floor: torch fused AdamW over one tensor of all the elements (28 B/param)")
    print(f"{'shape':>12} {'variant':>14} {'median ms':>10} {'min-max ms':>14} {'x floor':>8} "
          f"{'us/tensor over floor':>21} {'GB/s':>6}")
    for r in rows:
        print(f"{r['shape']:>12} {r['variant']:>14} {r['median_ms']:>10.2f} "
              f"{r['min_ms']:>6.2f}-{r['max_ms']:<7.2f} {r['x_floor']:>8.2f} {r['overhead_us_per_tensor']:>21.1f} "
              f"{r['gb_per_s']:>6.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
