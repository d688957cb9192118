"""``tierstate bench overhead``: what the optimizer adds on top of its kernels.

Three variants over the same parameter shapes, interleaved round-robin (the VM's memory
bandwidth moves by ~1.7x between phases, so only interleaved medians compare):

- ``kernel``        one native AdamW kernel call over one flat buffer of all elements: the
                    work itself, with no per-parameter bookkeeping;
- ``opt``           ``tierstate.AdamW(offload="cpu")`` with telemetry on (the default);
- ``opt-no-telemetry`` the same optimizer with ``opt.telemetry.enabled`` switched off for
                    the call. One optimizer serves both: two optimizers' arenas land in
                    different memory, which alone moved the step by ~5 % either way.

``opt`` vs ``opt-no-telemetry`` is the cost of telemetry (target < 2 %); ``opt`` vs
``kernel`` is the whole per-step cost of the optimizer front (non-finite check, per-tensor
calls, state publication). Parameters are bf16 with bf16 gradients (fp32 masters and
moments), shaped like GPT-2 small by default (148 tensors, 124M elements).

``--per-call`` measures the telemetry calls one by one instead: the cost in µs of each
recording call (median of ``--repeats`` runs of ``--iters`` calls each, minus an empty
loop), then what a step with ``--phases`` phases and ``--step-ms`` of work would pay. The
two views answer different questions: an on/off A/B of identical fixed work on the 2-core
reference VM swung by 5-8 % either way (the order of the pair, memory-bandwidth flips),
enough to hide a ~1 % effect in a single pair, which is why the step A/B above takes the
median of per-round ratios over many rounds; per-call costs times call counts are stable
to ~20 % and show which call to make cheaper.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable

import torch

from ._timing import interleave

# GPT-2 small (n_layer=12, n_embd=768, vocab 50257, 1024 positions): the tensors of one block
# and the embeddings, element counts only.
_BLOCK = [768, 768, 768 * 2304, 2304, 768 * 768, 768, 768, 768, 768 * 3072, 3072, 3072 * 768, 768]


def gpt2_shapes(layers: int = 12) -> list[int]:
    return [50257 * 768, 1024 * 768] + _BLOCK * layers + [768, 768]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``tierstate bench overhead``: the step A/B's, then ``--per-call``'s."""
    parser.add_argument("--layers", type=int, default=12, help="GPT-2 blocks to shape the parameters after (default 12)")
    parser.add_argument("--reps", type=int, default=15, help="timed rounds (default 15)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first (default 2)")
    parser.add_argument("--json", metavar="PATH", help="also write the result as JSON to PATH")
    calls = parser.add_argument_group("--per-call", "the cost of each telemetry call, instead of the step A/B")
    calls.add_argument("--per-call", action="store_true", help="measure the telemetry calls one by one")
    calls.add_argument("--iters", type=int, default=20_000, help="calls per timed run (default 20000)")
    calls.add_argument("--repeats", type=int, default=7, help="timed runs per call; the median is shown (default 7)")
    calls.add_argument("--phases", type=int, default=200,
                       help="phases per step for the estimate (default 200: ~4 per sub-group x 50 sub-groups)")
    calls.add_argument("--step-ms", type=float, default=100.0, help="step time for the estimate, ms (default 100)")


def _params(shapes: list[int], seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    params = []
    for n in shapes:
        p = torch.nn.Parameter((torch.randn(n, generator=gen) * 0.02).bfloat16())
        p.grad = (torch.randn(n, generator=gen) * 1e-3).bfloat16()
        params.append(p)
    return params


def _per_call_us(body: Callable[[int], None], iters: int, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        body(iters)
        samples.append((time.perf_counter() - t0) / iters * 1e6)
    return statistics.median(samples)


def measure_calls(iters: int = 20_000, repeats: int = 7) -> dict[str, float]:
    """Per-call cost in µs of each telemetry operation, empty-loop time subtracted."""
    from ..telemetry import Telemetry

    tel = Telemetry(log_every=0)
    off = Telemetry(enabled=False, log_every=0)
    tel.begin_step(0)

    def empty(n):
        for _ in range(n):
            pass

    def phase(n, t=tel):
        for _ in range(n):
            with t.phase("cpu_update"):
                pass

    def nested(n):
        for _ in range(n):
            with tel.phase("cpu_update"):
                with tel.phase("nvme_wait"):
                    pass

    def add_bytes(n):
        for _ in range(n):
            tel.add_bytes("nvme", "read", 4096)

    def add_phase_time(n):
        for _ in range(n):
            tel.add_phase_time("nvme_read", 1e-4, lane="io0")

    def count(n):
        for _ in range(n):
            tel.count("nonfinite_grads")

    def set_gauge(n):
        for _ in range(n):
            tel.set_gauge("pinned_bytes", 1.0)

    def step(n):
        for i in range(n):
            tel.end_step()
            tel.begin_step(i)

    base = _per_call_us(empty, iters, repeats)
    out = {
        "phase (disabled)": _per_call_us(lambda n: phase(n, off), iters, repeats) - base,
        "phase": _per_call_us(phase, iters, repeats) - base,
        "phase, nested pair": _per_call_us(nested, iters, repeats) - base,
        "add_phase_time": _per_call_us(add_phase_time, iters, repeats) - base,
        "add_bytes": _per_call_us(add_bytes, iters, repeats) - base,
        "count": _per_call_us(count, iters, repeats) - base,
        "set_gauge": _per_call_us(set_gauge, iters, repeats) - base,
        "end_step+begin_step": _per_call_us(step, max(1, iters // 20), repeats) - base,
    }
    with tempfile.TemporaryDirectory() as d:
        tel.start_trace(f"{d}/overhead.json")
        out["phase (tracing)"] = _per_call_us(phase, iters, repeats) - base
        out["set_gauge (tracing)"] = _per_call_us(set_gauge, iters, repeats) - base
        tel.stop_trace()
    import torch.profiler
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        out["phase (torch profiler on)"] = _per_call_us(phase, max(1, iters // 10),
                                                        repeats) - base
    tel.end_step()
    return out


def _main_per_call(args: argparse.Namespace) -> int:
    if args.iters <= 0 or args.repeats <= 0 or args.phases < 0 or args.step_ms <= 0:
        print("--iters, --repeats and --step-ms must be positive, --phases >= 0")
        return 2
    costs = measure_calls(args.iters, args.repeats)
    for name, us in costs.items():
        print(f"{name:<28} {us:8.2f} µs")
    per_step_us = args.phases * (costs["phase"] + costs["add_bytes"]) + costs["end_step+begin_step"]
    print(f"estimate: {args.phases} phases (+ one add_bytes each) and one step boundary = "
          f"{per_step_us:.0f} µs, {per_step_us / (args.step_ms * 1e3):.2%} of a {args.step_ms:g} ms step")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"per_call_us": costs, "per_step_us": per_step_us}, f, indent=2)
    return 0


def main(args: argparse.Namespace) -> int:
    """Run the step A/B (or ``--per-call``: the telemetry calls one by one); returns the exit status."""
    if args.per_call:
        return _main_per_call(args)
    import tierstate as ts
    from tierstate import kernels

    if args.reps < 1 or args.warmup < 0 or args.layers < 1:
        print("--reps and --layers must be >= 1, --warmup >= 0")
        return 2
    shapes = gpt2_shapes(args.layers)
    total = sum(shapes)
    opt = ts.AdamW(_params(shapes, 0), lr=1e-4, weight_decay=0.1)
    flat = {k: torch.zeros(total) for k in ("w", "m", "v")}
    flat_grad = torch.randn(total).bfloat16()
    flat_out = torch.empty(total, dtype=torch.bfloat16)
    counter = [0]

    def kernel() -> None:
        counter[0] += 1
        t = counter[0]
        kernels.adam_update(flat["w"], flat_grad, flat["m"], flat["v"], None, flat_out, lr=1e-4, beta1=0.9,
                            beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=True,
                            bias_correction1=1 - 0.9**t, bias_correction2=1 - 0.999**t)

    def without_telemetry() -> None:
        opt.telemetry.enabled = False
        try:
            opt.step()
        finally:
            opt.telemetry.enabled = True

    variants = {"kernel": kernel, "opt": opt.step, "opt-no-telemetry": without_telemetry}
    # reversed every other round: what ran just before a variant (caches, the memory bandwidth
    # phase) must not favour one variant
    times = interleave(variants, args.reps, args.warmup, f"{total / 1e6:.0f}M params", alternate=True)
    med = {name: statistics.median(v) for name, v in times.items()}
    print(f"{len(shapes)} tensors, {total / 1e6:.1f}M bf16 params, {kernels.backend_info()['threads']} threads, "
          f"{args.reps} interleaved rounds")
    print(f"{'variant':<18}{'median ms':>10}{'min ms':>9}{'max ms':>9}{'vs kernel':>11}")
    for name, v in times.items():
        print(f"{name:<18}{med[name] * 1e3:>10.2f}{min(v) * 1e3:>9.2f}{max(v) * 1e3:>9.2f}{med[name] / med['kernel']:>10.3f}x")
    # per-round ratio, then its median: both variants of one round share a bandwidth phase
    ratios = [a / b for a, b in zip(times["opt"], times["opt-no-telemetry"])]
    overhead = statistics.median(ratios) - 1
    print(f"telemetry overhead: {overhead * 100:+.2f}% (median of per-round ratios; "
          f"range {min(ratios) * 100 - 100:+.1f}% .. {max(ratios) * 100 - 100:+.1f}%)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tensors": len(shapes), "params": total, "median_s": med, "times_s": times,
                       "telemetry_overhead": overhead}, f, indent=2)
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(allow_abbrev=False,
                                prog="python -m tierstate.bench.overhead", description=__doc__.split("\n")[0])
    add_arguments(p)
    raise SystemExit(main(p.parse_args()))
