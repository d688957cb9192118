"""Data-parallel training with torchrun: DDP over gloo (CPU) or nccl (GPU) with tierstate.

DDP all-reduces the gradients, so every rank could take the same step over a whole copy of the
optimizer state (``--state replicate``: N copies of the state on a node). By default the state
is sharded instead (``--state zero1``): torch's ``ZeroRedundancyOptimizer`` gives each rank's
``tierstate.AdamW`` 1/N of the parameters (whole tensors), each rank steps those and broadcasts
them, so each rank holds 1/N of the state. The replicas stay identical (checked at the end).

    torchrun --nproc-per-node 2 examples/torchrun_ddp.py --tiny
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import tierstate as ts
from common import build_model, dataset_for, figures, parser, steps_of, train_data_parallel


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--state", choices=("zero1", "replicate"), default="zero1",
                   help="zero1: each rank holds 1/N of the optimizer state (default); replicate: a whole copy each")
    args = p.parse_args()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if backend == "nccl" else torch.device("cpu")
    torch.manual_seed(0)  # same initial weights on every rank (DDP also broadcasts rank 0's)
    model = build_model(args.model, args.tiny).to(device)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    hyper = dict(lr=1e-2 if args.tiny else 3e-4, betas=(0.9, 0.95), offload="cpu")
    if args.state == "zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        # Each rank's tierstate.AdamW holds 1/N of the parameters; built by ZeroRedundancyOptimizer
        # it all-reduces its gradients' squares over ZeRO's process group, so max_grad_norm clips
        # by the global norm (tierstate.dist.zero).
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=ts.AdamW, max_grad_norm=1.0, **hyper)
        local = opt.optim  # this rank's tierstate.AdamW
    else:
        opt = local = ts.AdamW(ddp.parameters(), max_grad_norm=1.0, **hyper)
    steps = steps_of(args)
    first, last, runtime = train_data_parallel(ddp, opt, dataset_for(model, args.tiny), steps, device)
    # Replicas must agree: compare a checksum of the weights across ranks.
    checksum = torch.stack([p.detach().double().sum() for p in model.parameters()]).sum().reshape(1).cpu()
    sums = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(sums, checksum)
    held = [0] * world  # optimizer state bytes each rank holds
    dist.all_gather_object(held, sum(local.tier_bytes().values()))
    if rank == 0:
        agree = all(torch.equal(s, sums[0]) for s in sums)
        print(f"{world} ranks: loss {first:.3f} -> {last:.3f} over {steps} steps; "
              f"optimizer step {local.stats().wall_s * 1e3:.1f} ms; replicas identical: {agree}")
        print(f"state per rank ({args.state}): " + ", ".join(f"{b / 2**20:.2f} MiB" for b in held))
        print(f"rank 0 {figures(local, steps, runtime)}")
        if not agree:
            raise SystemExit("replicas diverged")
    # Leave the group together. (Two aborts at exit were seen here, SIGABRT with "terminate
    # called without an active exception": tierstate's fail-fast watchdog still inside the
    # store's client, and a gloo thread still dropping the last all_gather's tensors, while
    # the interpreter finalized. tierstate now stops the one and waits for the other at exit:
    # docs/distributed.md, "At exit".)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
