"""One rank of tests/dist/test_fsdp_checkpoint.py, started by torchrun (gloo, CPU).

For each optimizer variant (``torch``: torch.optim.AdamW with clip_grad_norm_; ``cpu`` and
``nvme``: tierstate.AdamW on that tier; ``<tier>-zero2``: FSDP2 with
``reshard_after_forward=False``, ZeRO-2; ``cpu-ddp``: DDP, every rank a replica;
``<tier>-zero1``: DDP with ZeroRedundancyOptimizer(optimizer_class=tierstate.AdamW), clipped with
clip_grad_norm_ before the step; ``<tier>-zero1clip``: the same with the inner tierstate.AdamW's own
``max_grad_norm`` instead; ``<variant>-mp``:
FSDP2 with its own mixed precision, ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``:
fp32 shards, bf16 compute, fp32 gradients) it trains a small MLP on a fixed global batch of
GLOBAL_BATCH rows per step, each rank taking its slice of the rows. With more than one rank
the model is wrapped in FSDP2 (``fully_shard`` per Linear and at the root, so every parameter
is a DTensor sharded along dim 0, some unevenly); with one rank it stays a plain model, as a
user resuming on one process would have it.

    torchrun --standalone --nproc-per-node N _fsdp_worker.py OUT [--save] [--resume-from W]

``--save``: train STEPS steps, saving a ``torch.distributed.checkpoint`` (``get_state_dict`` +
``dcp.save``) after step SAVE_AT into OUT/ckpt-<variant>-w<N>; then resume from that
checkpoint in fresh objects (same world) and train to STEPS again.
``--resume-from W``: load OUT/ckpt-<variant>-w<W> and train steps SAVE_AT+1..STEPS.
Rank 0 writes OUT/result-w<N>.pt: per variant, the losses and the full (gathered) parameters
and optimizer state at the end of each run.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import tierstate as ts

STEPS, SAVE_AT, GLOBAL_BATCH = 12, 6, 8
LR, BETAS, WD, CLIP = 1e-2, (0.9, 0.95), 0.1, 0.5
VARIANTS = ("torch", "cpu", "nvme", "cpu-zero2", "nvme-zero2", "cpu-ddp", "cpu-zero1", "nvme-zero1", "torch-mp",
            "cpu-mp", "nvme-mp", "cpu-zero1clip", "nvme-zero1clip")


def build(world: int, wrap: str = "fsdp") -> nn.Module:
    """The MLP, wrapped: ``fsdp`` (FSDP2 defaults), ``zero2`` (FSDP2 keeping the gathered
    parameters from forward to backward: ZeRO-2), ``mp`` (FSDP2 with bf16 compute and fp32
    gradient reduction), ``ddp`` (replicated)."""
    torch.manual_seed(0)
    # 10 output rows: uneven shards on 4 ranks (3, 3, 3, 1), even on 2; 2 rows: ranks 2 and 3 of 4
    # hold an empty shard
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10), nn.Tanh(),
                          nn.Linear(10, 2))
    if world > 1 and wrap in ("ddp", "zero1", "zero1clip"):
        return nn.parallel.DistributedDataParallel(model)
    if world > 1:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        kw = {"reshard_after_forward": wrap != "zero2"}
        if wrap == "mp":
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, **kw)
        fully_shard(model, **kw)
    return model


def optimizer(variant: str, model: nn.Module, out: str, tag: str, wrap: str = ""):
    if variant == "torch":
        return torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WD)
    nvme = {"nvme_dir": os.path.join(out, f"nvme-{tag}-rank{{rank}}")} if variant == "nvme" else {}
    if wrap in ("zero1", "zero1clip"):
        from torch.distributed.optim import ZeroRedundancyOptimizer

        # each rank's tierstate.AdamW holds 1/N of the parameters: "zero1" clips the whole
        # (all-reduced) gradients before the step (see train()), "zero1clip" leaves it to the inner
        # optimizer's max_grad_norm, whose norm is then all-reduced over ZeRO's process group
        clip = {"max_grad_norm": CLIP} if wrap == "zero1clip" else {}
        return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=ts.AdamW, lr=LR, betas=BETAS,
                                       weight_decay=WD, offload=variant, **nvme, **clip)
    return ts.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WD, max_grad_norm=CLIP,
                    offload=variant, **nvme)


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    target = torch.randn(32, 2, generator=torch.Generator().manual_seed(7)) / 4  # a fixed map to learn
    x = torch.randn(GLOBAL_BATCH, 32, generator=torch.Generator().manual_seed(1000 + step))
    y = torch.tanh(x @ target)
    rows = GLOBAL_BATCH // world
    return x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]


def train(variant: str, model: nn.Module, opt, first: int, last: int, on_step=None) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(first, last + 1):
        x, y = batch(step, rank, world)
        loss = nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        clips_itself = isinstance(opt, ts.AdamW) or getattr(getattr(opt, "optim", None), "max_grad_norm", None)
        if not clips_itself:  # torch's AdamW, or tierstate's under ZeroRedundancyOptimizer without max_grad_norm
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        # the global batch's loss: the mean of the ranks' equal slices
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world)
        if on_step is not None:
            on_step(step)
    return losses


def full(t):
    t = t.detach()
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()


def snapshot(model: nn.Module, opt, losses: list[float]) -> dict:
    """Full parameters and optimizer state (gathered from every rank's shards), by parameter name."""
    zero = getattr(opt, "optim", None)  # ZeroRedundancyOptimizer: this rank's tierstate.AdamW
    state = {}
    if zero is None:
        _, osd = get_state_dict(model, opt)
        state = {name: {k: full(v) for k, v in st.items()} for name, st in osd["state"].items()}
    else:
        opt = zero
    usage = None
    if isinstance(opt, ts.AdamW):  # what this rank holds, for the per-rank usage test
        local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())
        files = [f for tier in opt.tiers.values() for f in getattr(tier, "files", ())]
        usage = {"numel": local, "tier_bytes": {str(k): v for k, v in opt.tier_bytes().items()},
                 "file_bytes": sum(os.path.getsize(f) for f in files),
                 "disk_bytes": sum(os.stat(f).st_blocks * 512 for f in files)}
    usages = [None] * dist.get_world_size()
    dist.all_gather_object(usages, usage)
    return {"params": {n.removeprefix("module."): full(p) for n, p in model.named_parameters()}, "state": state,
            "losses": losses,
            "usage": usages}


def full_round_trip(variant: str, model: nn.Module, opt, out: str, name: str) -> dict:
    """The optimizer's full state dict (plain whole tensors, as a single-process run would have)
    loaded into a fresh optimizer over the same sharded model: the state it then presents."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)

    whole = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    fresh = optimizer(variant, model, out, f"{name}-fresh-w{dist.get_world_size()}")
    set_optimizer_state_dict(model, fresh, whole, options=StateDictOptions(full_state_dict=True))
    got = snapshot(model, fresh, [])["state"]
    del fresh
    return got


def save(model, opt, path: str) -> None:
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)


def load(model, opt, path: str) -> None:
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--save", action="store_true")
    p.add_argument("--resume-from", type=int)
    p.add_argument("--variants", default=",".join(VARIANTS))
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    result = {}
    for name in args.variants.split(","):
        variant, _, wrap = name.partition("-")  # e.g. "cpu-zero2": the CPU tier under FSDP2 as ZeRO-2
        if wrap and world == 1:
            continue  # one process: nothing to wrap
        res = result[name] = {}
        model = build(world, wrap or "fsdp")
        opt = optimizer(variant, model, args.out, f"{name}-straight-w{world}", wrap)
        ckpt = os.path.join(args.out, f"ckpt-{variant}-w{world}")

        def maybe_save(step, model=model, opt=opt, ckpt=ckpt, res=res):
            if args.save and step == SAVE_AT:
                save(model, opt, ckpt)
                res["at_save"] = snapshot(model, opt, [])

        losses = train(variant, model, opt, 1, STEPS, None if wrap else maybe_save)
        res["straight"] = snapshot(model, opt, losses)
        if not wrap:
            res["full_round_trip"] = full_round_trip(variant, model, opt, args.out, name)
        del opt
        sources = ([world] if args.save else []) + ([args.resume_from] if args.resume_from else [])
        sources = [] if wrap else sources
        for source in sources:
            model = build(world)
            opt = optimizer(variant, model, args.out, f"{variant}-from{source}-w{world}")
            load(model, opt, os.path.join(args.out, f"ckpt-{variant}-w{source}"))
            res[f"loaded_from_{source}"] = snapshot(model, opt, [])
            losses = train(variant, model, opt, SAVE_AT + 1, STEPS)
            res[f"resumed_from_{source}"] = snapshot(model, opt, losses)
            del opt
    launch = [None] * world  # where each rank ran: torchrun's node (GROUP_RANK) and local rank
    dist.all_gather_object(launch, {k: os.environ.get(k) for k in
                                    ("GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "RANK", "TORCHELASTIC_RUN_ID")})
    result["launch"] = launch
    if rank == 0:
        torch.save(result, os.path.join(args.out, f"result-w{world}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
