"""``python -m tierstate.bench.quant_step``: the 8-bit-state AdamW kernels against the
fp32- and bf16-moment kernels, interleaved in one process.

    python -m tierstate.bench.quant_step [--params 25M] [--threads 2] [--rounds 7] [--blocks 256]

Every variant takes a bf16 gradient and writes a bf16 weight. Bytes per parameter count
each array read and written once (no write-allocate): fp32 moments 28 (grad 2, master
4 + 4, m 4 + 4, v 4 + 4, weight 2), bf16 moments 20, 8-bit moments with an fp32 master or
a bf16 master + int16 compensation 16 + 8 / block (codes 1 + 1 each, scales 4 + 4 per
block each), with a stochastically rounded bf16 master 12 + 8 / block. Variants run
round-robin with a 20 ms gap before each call (see ``tierstate bench step`` for why), and
the table reports medians: time per step, GB/s of state moved and parameters per second.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from .. import kernels as K
from ..kernels import quant as Q

HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True,
             bias_correction1=0.5, bias_correction2=0.1)


def _count(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1:], 1)
    return int(float(text[:-1] if scale != 1 else text) * scale)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", default="25M", help="parameters per step (e.g. 25M)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--blocks", default="256", help="comma-separated block sizes of the 8-bit variants")
    args = p.parse_args(argv)
    n = _count(args.params)
    blocks = [int(b) for b in args.blocks.split(",")]
    K.set_num_threads(args.threads)
    g = torch.randn(n).bfloat16()
    out = torch.empty(n, dtype=torch.bfloat16)
    w = torch.randn(n)
    m32, v32 = torch.zeros(n), torch.zeros(n)
    m16, v16 = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    variants = {
        "fp32-moments": (28.0, lambda: K.adam_update(w, g, m32, v32, None, out, **HYPER)),
        "bf16-moments": (20.0, lambda: K.adam_update(w, g, m16, v16, None, out, **HYPER)),
    }
    for block in blocks:
        for mode in Q.MASTER_MODES:
            cfg = Q.QuantConfig(block, mode)
            state = cfg.init_state(w)
            nbytes = (12.0 if mode == "bf16_sr" else 16.0) + 8 / block
            variants[f"q8/{block}+{mode}"] = (
                nbytes, lambda s=state, c=cfg: K.adam_q8_update(s, g, out, config=c, **HYPER, step=1))
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _, step in variants.values():
        step()
    for _ in range(args.rounds):
        for name, (_, step) in variants.items():
            time.sleep(0.02)
            t = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t)
    print(f"{n / 1e6:g}M params, {args.threads} threads, ISA {K.current_isa()}, medians of {args.rounds} rounds")
    base = statistics.median(times["fp32-moments"])
    for name, (nbytes, _) in variants.items():
        med = statistics.median(times[name])
        print(f"{name:24s} {nbytes:6.2f} B/param {med * 1e3:8.1f} ms {nbytes * n / med / 1e9:6.1f} GB/s "
              f"{n / med / 1e6:6.0f} Mparam/s  time {med / base:5.2f}x fp32-moments")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
