"""``python -m tierstate.bench.quant_step``: the 8-bit-state AdamW kernels against the
fp32- and bf16-moment kernels, interleaved in one process.

    python -m tierstate.bench.quant_step [--params 25M] [--threads 2] [--rounds 7] [--blocks 256]
        [--lookups auto|gather,loads]

Every variant takes a bf16 gradient and writes a bf16 weight. Bytes per parameter count
each array read and written once (no write-allocate): fp32 moments 28 (grad 2, master
4 + 4, m 4 + 4, v 4 + 4, weight 2), bf16 moments 20, 8-bit moments with an fp32 master or
a bf16 master + int16 compensation 16 + 8 / block (codes 1 + 1 each, scales 4 + 4 per
block each), with a stochastically rounded bf16 master 12 + 8 / block. Variants run
round-robin with a 20 ms gap before each call (see ``tierstate bench step`` for why), and
the table reports medians: time per step, GB/s of state moved and parameters per second,
and the ratio to the floor of the bytes each layout moves: the host's memory bandwidth of the
moment is the fastest of a 64 MiB copy (read + write, interleaved with the kernels at the same
thread count) and the fp32- and bf16-moment kernels' own rates, and a layout's floor is its
bytes per parameter over that bandwidth. The copy alone understated it: on a 2-vCPU Xeon it
read 12.5 GB/s in one run while the fp32-moment kernel moved 27.7 GB/s (torch's copy after a
20 ms idle gap wakes its thread pool and writes to pages it must first read), which put that
kernel at 0.45x its "floor"; in the next run the bf16-moment kernel moved 33.0 GB/s against
the copy's 26.3.

``--nvme-dir DIR`` adds the optimizer's NVMe step: ``ts.AdamW`` on bf16 parameters with all
state in files under DIR (2 buffers, so each step reads and writes all but 2 records), fp32
state against the compressed layouts, interleaved: step time, the bytes ``stats()`` reports
per parameter per step, and each layout's time and bytes relative to fp32 state.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from .. import kernels as K
from ..kernels import quant as Q
from ..kernels.backend import TABLE_LOOKUPS

HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True,
             bias_correction1=0.5, bias_correction2=0.1)


def _count(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1:], 1)
    return int(float(text[:-1] if scale != 1 else text) * scale)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--params", default="25M", help="parameters per step (e.g. 25M)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--blocks", default="256", help="comma-separated block sizes of the 8-bit variants")
    p.add_argument("--maps", default="dynamic,fp8",
                   help="comma-separated map families of the 8-bit variants (dynamic, fp8)")
    p.add_argument("--lookups", default="auto",
                   help="comma-separated ways the dynamic maps' codes are looked up (auto, gather, loads; "
                        "see tierstate.kernels.set_q8_table_lookup): one variant each, interleaved")
    p.add_argument("--nvme-dir", help="also time ts.AdamW steps with all state on NVMe under this folder")
    p.add_argument("--nvme-params", default="64M", help="parameters of the NVMe comparison (default 64M)")
    args = p.parse_args(argv)
    if args.threads < 1 or args.rounds < 1:
        p.error("--threads and --rounds must be >= 1")
    n = _count(args.params)
    blocks = [int(b) for b in args.blocks.split(",")]
    families = [f.strip() for f in args.maps.split(",")]
    for f in families:
        if f not in Q.MAP_FAMILIES:
            p.error(f"--maps: unknown map family {f!r}; choose from {', '.join(Q.MAP_FAMILIES)}")
    lookups = [x.strip() for x in args.lookups.split(",")]
    for x in lookups:
        if x not in TABLE_LOOKUPS:
            p.error(f"--lookups: unknown lookup {x!r}; choose from {', '.join(TABLE_LOOKUPS)}")
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
    for family in families:
        for block in blocks:
            for mode in Q.MASTER_MODES:
                cfg = Q.QuantConfig(block, mode, family)
                state = cfg.init_state(w)
                nbytes = (12.0 if mode == "bf16_sr" else 16.0) + 8 / block
                prefix = "q8" if family == "dynamic" else family
                for lookup in lookups if family == "dynamic" else ["auto"]:
                    suffix = f"@{lookup}" if family == "dynamic" and len(lookups) > 1 else ""
                    variants[f"{prefix}/{block}+{mode}{suffix}"] = (nbytes, _q8_step(state, g, out, cfg, lookup))
    src, dst = torch.randn(16 << 20), torch.zeros(16 << 20)  # 64 MiB each, every page touched
    torch.set_num_threads(args.threads)
    variants["memory-copy"] = (float("nan"), lambda: dst.copy_(src))
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _, step in variants.values():
        step()
    for _ in range(args.rounds):
        for name, (_, step) in variants.items():
            time.sleep(0.02)
            t = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t)
    K.set_q8_table_lookup("auto")
    print(f"{n / 1e6:g}M params, {args.threads} threads, ISA {K.current_isa()}, medians of {args.rounds} rounds; "
          f"dynamic-map lookups under auto: {K.q8_table_lookup()}, "
          f"block decode by byte permutes: {'on' if K.q8_row_decode() else 'off'}")
    base = statistics.median(times["fp32-moments"])
    copy_bw = 2 * src.numel() * 4 / statistics.median(times.pop("memory-copy"))
    kernel_bw = {k: variants[k][0] * n / statistics.median(times[k]) for k in ("fp32-moments", "bf16-moments")}
    bandwidth = max(copy_bw, *kernel_bw.values())
    print(f"memory bandwidth: {bandwidth / 1e9:.1f} GB/s, the fastest of a 64 MiB copy (read + write, "
          f"{copy_bw / 1e9:.1f} GB/s), the fp32-moment kernel ({kernel_bw['fp32-moments'] / 1e9:.1f} GB/s) and "
          f"the bf16-moment kernel ({kernel_bw['bf16-moments'] / 1e9:.1f} GB/s)")
    for name, (nbytes, _) in variants.items():
        if name == "memory-copy":
            continue
        med = statistics.median(times[name])
        floor = nbytes * n / bandwidth
        print(f"{name:24s} {nbytes:6.2f} B/param {med * 1e3:8.1f} ms {nbytes * n / med / 1e9:6.1f} GB/s "
              f"{n / med / 1e6:6.0f} Mparam/s  time {med / base:5.2f}x fp32-moments  {med / floor:5.2f}x floor")
    if args.nvme_dir:
        nvme_steps(args.nvme_dir, _count(args.nvme_params), args.rounds, args.threads)
    return 0


def _q8_step(state, g, out, cfg, lookup: str):
    def step():
        K.set_q8_table_lookup(lookup)
        K.adam_q8_update(state, g, out, config=cfg, **HYPER, step=1)
    return step


def nvme_steps(folder: str, n: int, rounds: int, threads: int) -> None:
    """ts.AdamW steps with all state on NVMe: fp32 state against the compressed layouts, interleaved."""
    import tierstate as ts

    layouts = {"fp32 state": {}, "q8 + fp32 master": dict(moment_dtype="q8"),
               "q8 + bf16_kahan": dict(moment_dtype="q8", master_dtype="bf16_kahan"),
               "q8 + bf16_sr": dict(moment_dtype="q8", master_dtype="bf16_sr")}
    K.set_num_threads(threads)
    runs = {}
    for i, (name, kw) in enumerate(layouts.items()):
        p = torch.nn.Parameter(torch.randn(n).bfloat16())
        p.grad = torch.randn(n).bfloat16()
        sub = os.path.join(folder, f"layout{i}")  # one folder per optimizer (each locks its own)
        os.makedirs(sub, exist_ok=True)
        opt = ts.AdamW([p], lr=1e-3, offload=ts.Offload(cpu=0.0, nvme=1.0, nvme_dir=sub, buffer_count=2, **kw))
        opt.step()  # the first step fills the records
        runs[name] = (p, opt, [], [])
    for _ in range(rounds):
        for name, (p, opt, times, moved) in runs.items():
            t = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t)
            b = opt.stats().nvme_bytes_per_param
            moved.append(b["read"] + b["write"])
    base_t = statistics.median(runs["fp32 state"][2])
    base_b = statistics.median(runs["fp32 state"][3])
    print(f"\nNVMe step, {n / 1e6:g}M bf16 params, all state in files under {folder}, 2 buffers, medians of {rounds}")
    for name, (p, opt, times, moved) in runs.items():
        t, b = statistics.median(times), statistics.median(moved)
        rec = opt.stats().nvme_bytes_per_param["record"]
        print(f"{name:18s} record {rec:5.2f} B/param  moved {b:5.2f} B/param/step (read + write)  {t * 1e3:8.1f} ms"
              f"  {b * n / t / 1e9:5.2f} GB/s  time {t / base_t:4.2f}x, bytes {b / base_b:4.2f}x fp32 state")
        opt.close()


if __name__ == "__main__":
    raise SystemExit(main())
