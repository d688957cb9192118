"""DDP or FSDP2 under tierstate: per-rank state and step time, interleaved, on N ranks.

    torchrun --standalone --nproc-per-node 2 benchmarks/ddp_vs_fsdp2.py [--width 1024 --layers 16]

Four wrappings of the same MLP (``--layers`` Linear(width, width) + tanh), each with its own
``tierstate.AdamW(offload=...)``, trained in turns within one run (A, B, C, D, A, ...) so
the load of a shared machine falls on all three alike:

- ``ddp``: DistributedDataParallel; every rank holds the whole optimizer state;
- ``zero1``: DDP with ``torch.distributed.optim.ZeroRedundancyOptimizer(optimizer_class=
  tierstate.AdamW)``: gradients all-reduced by DDP, each rank steps the state of its 1/N of
  the parameters (whole tensors), then broadcasts them (ZeRO-1);
- ``zero2``: FSDP2 ``fully_shard(..., reshard_after_forward=False)``: parameters gathered once
  per step and kept through backward, gradients reduce-scattered per layer during backward,
  each rank steps (and holds the state of) its 1/N shard (ZeRO-2);
- ``fsdp``: FSDP2's defaults (parameters gathered again for backward: ZeRO-3).

Rank 0 prints, per wrapping, the median training step (forward, backward, optimizer step;
ranks synchronised before and after), tierstate's median optimizer step, and the optimizer
state one rank holds; then the ratios to ``ddp``. ``--json PATH`` writes them too.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

import tierstate as ts
from tierstate.placement.probe import cpu_model

WRAPS = ("ddp", "zero1", "zero2", "fsdp")


def build(wrap: str, width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.Tanh())])
    if wrap in ("ddp", "zero1"):
        return nn.parallel.DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    keep = wrap == "zero2"
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m, reshard_after_forward=not keep)
    return fully_shard(model, reshard_after_forward=not keep)


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False,
                                description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--batch", type=int, default=32, help="rows per rank per step")
    p.add_argument("--rounds", type=int, default=6, help="turns per wrapping (the first is warm-up)")
    p.add_argument("--steps", type=int, default=3, help="steps per turn")
    p.add_argument("--offload", default="cpu", choices=("cpu", "nvme"))
    p.add_argument("--nvme-dir", default=None, help="with --offload nvme; '{rank}' names a folder per rank")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    setups = {}
    for wrap in WRAPS:
        model = build(wrap, args.width, args.layers)
        # one folder per wrapping (four optimizers in this process) and per rank
        kw = {"nvme_dir": os.path.join(args.nvme_dir, wrap)} if args.offload == "nvme" and args.nvme_dir else {}
        if wrap == "zero1":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            # each rank builds a tierstate.AdamW over its 1/N of the parameters and broadcasts
            # them after its step; the clipping norm comes from the whole (all-reduced) gradients
            zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=ts.AdamW, lr=1e-3,
                                           offload=args.offload, **kw)
            setups[wrap] = (model, zero)
        else:
            setups[wrap] = (model, ts.AdamW(model.parameters(), lr=1e-3, offload=args.offload, max_grad_norm=1.0,
                                            **kw))
    g = torch.Generator().manual_seed(rank)
    step_s = {w: [] for w in WRAPS}
    opt_s = {w: [] for w in WRAPS}
    for r in range(args.rounds):
        for wrap, (model, opt) in setups.items():
            for _ in range(args.steps):
                x = torch.randn(args.batch, args.width, generator=g)
                dist.barrier()
                start = time.perf_counter()
                model(x).square().mean().backward()
                if wrap == "zero1":
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
                dist.barrier()
                if r > 0:
                    step_s[wrap].append(time.perf_counter() - start)
                    opt_s[wrap].append(_local(opt).stats().wall_s)
    state = {w: sum(_local(opt).tier_bytes().values()) for w, (_, opt) in setups.items()}
    states = [None] * world
    dist.all_gather_object(states, state)
    if rank == 0:
        params = args.layers * (args.width * args.width + args.width)
        out = {"world": world, "params": params, "offload": args.offload, "batch_per_rank": args.batch,
               "samples": len(step_s["ddp"]), "cpu": cpu_model() or "unknown CPU", "date": time.strftime("%Y-%m-%d"),
               "threads_per_rank": ts.kernels.get_num_threads(), "wraps": {}}
        for w in WRAPS:
            out["wraps"][w] = {"step_s": statistics.median(step_s[w]), "opt_step_s": statistics.median(opt_s[w]),
                               "state_bytes_per_rank": max(s[w] for s in states)}
        base = out["wraps"]["ddp"]
        print(f"{world} ranks, {params / 1e6:.1f}M parameters, offload={args.offload}, {out['samples']} steps each "
              f"(interleaved), {out['cpu']}")
        print(f"{'wrap':6} {'step ms':>8} {'opt ms':>8} {'state/rank MiB':>15} {'step vs ddp':>12} {'state vs ddp':>13}")
        for w, f in out["wraps"].items():
            print(f"{w:6} {f['step_s'] * 1e3:8.1f} {f['opt_step_s'] * 1e3:8.1f} {f['state_bytes_per_rank'] / 2**20:15.1f} "
                  f"{f['step_s'] / base['step_s']:12.2f} {f['state_bytes_per_rank'] / base['state_bytes_per_rank']:13.2f}")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(out, fh, indent=1)
    for _, opt in setups.values():
        _local(opt).close()
    dist.barrier()
    dist.destroy_process_group()


def _local(opt) -> ts.AdamW:
    """The tierstate optimizer of this rank (ZeroRedundancyOptimizer holds it as ``optim``)."""
    return getattr(opt, "optim", opt)




if __name__ == "__main__":
    main()
