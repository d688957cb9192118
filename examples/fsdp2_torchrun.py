"""FSDP2 (``fully_shard``) + tierstate with plain torchrun: each rank keeps the optimizer state of
its shards in its tiers, and a ``torch.distributed.checkpoint`` saved on N ranks resumes on M.

    torchrun --standalone --nproc-per-node 2 examples/fsdp2_torchrun.py --tiny --out /tmp/run
    torchrun --standalone --nproc-per-node 1 examples/fsdp2_torchrun.py --tiny --out /tmp/run --resume

Two "nodes" on one machine (the multi-node launch path; run each line in its own shell):

    torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint localhost:29400 \\
        --rdzv-id demo examples/fsdp2_torchrun.py --tiny --out /tmp/run2

The first run trains ``--steps`` steps, saving a checkpoint (model and optimizer, through
``get_state_dict`` + ``dcp.save``) at the last step into ``--out/checkpoint``; ``--resume``
loads it (any number of ranks: DCP reshards) and trains ``--steps`` more. ``--offload nvme``
puts each rank's state in ``--nvme-dir`` (default ``--out/nvme/rank{rank}``: a folder per rank).
``--stream-weights cpu|nvme`` also keeps each rank's shards of the blocks' weights on that tier
(``tierstate.offload_weights``: FSDP2 shards each block, tierstate streams the shard, bringing
it in only while FSDP2 gathers the block; NVMe folder ``--out/weights/rank{rank}``); the
checkpoint is then saved and loaded inside ``ws.gathered()``. gloo on CPU, nccl on GPUs.
"""
from __future__ import annotations

import contextlib
import os
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

import tierstate as ts
from common import build_model, dataset_for, figures, parser, steps_of, train_data_parallel


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--resume", action="store_true", help="load --out/checkpoint first")
    p.add_argument("--offload", choices=("cpu", "nvme"), default="cpu")
    p.add_argument("--nvme-dir", default=None, help="with --offload nvme; '{rank}' is replaced by the rank")
    p.add_argument("--stream-weights", choices=("cpu", "nvme"), default=None,
                   help="keep each rank's shards of the blocks' weights on this tier (tierstate.offload_weights)")
    args = p.parse_args()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    out = args.out or tempfile.mkdtemp(prefix="ts-fsdp2-")
    torch.manual_seed(0)
    model = build_model(args.model, args.tiny).to(device)
    blocks = model.transformer.h if args.model == "gpt2" else model.model.layers
    for block in blocks:  # one FSDP unit per transformer block, then the rest at the root
        fully_shard(block)
    fully_shard(model)
    ws = None
    if args.stream_weights:  # after fully_shard: each rank streams its own shards of every block
        folder = os.path.join(out, "weights", "rank{rank}") if args.stream_weights == "nvme" else None
        ws = ts.offload_weights(model, args.stream_weights, nvme_dir=folder)
    # the model's state dict reads the shards: with streamed weights, inside ws.gathered()
    shards_in_memory = ws.gathered if ws is not None else contextlib.nullcontext
    nvme = {}
    if args.offload == "nvme":
        nvme["nvme_dir"] = args.nvme_dir or os.path.join(out, "nvme", "rank{rank}")
    opt = ts.AdamW(model.parameters(), lr=1e-2 if args.tiny else 3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                   max_grad_norm=1.0, offload=args.offload, **nvme)
    ckpt = os.path.join(out, "checkpoint")
    first_step = 0
    if args.resume:
        with shards_in_memory():
            msd, osd = get_state_dict(model, opt)  # DTensor state: this rank's shards of the saved tensors
            sd = {"model": msd, "optim": osd, "meta": {"step": torch.tensor(0)}}
            dcp.load(sd, checkpoint_id=ckpt)
            set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        first_step = int(sd["meta"]["step"])
    steps = steps_of(args)
    first, last, runtime = train_data_parallel(model, opt, dataset_for(model, args.tiny), steps, device,
                                               first_epoch=first_step)
    with shards_in_memory():
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd, "meta": {"step": torch.tensor(first_step + steps)}},
                 storage_writer=dcp.FileSystemWriter(ckpt, overwrite=True))  # the newest replaces the last
    if rank == 0:
        print(f"{world} rank(s){' resumed at step ' + str(first_step) if args.resume else ''}: loss {first:.3f} -> "
              f"{last:.3f} over {steps} steps; checkpoint of step {first_step + steps} in {ckpt}")
    # every rank's own line: its state is its shards' only
    streamed = ""
    if ws is not None:
        st = ws.stats()
        streamed = (f"; weights streamed: {st['blocks']} blocks' shards ({sum(ws.block_bytes()) / 2**20:.1f} MiB) on "
                    f"{args.stream_weights}, {st['fetch_bytes'] / 2**20:.1f} MiB read back, at most "
                    f"{st['peak_window_bytes'] / 2**20:.2f} MiB in memory at once")
    print(f"rank {rank} {figures(opt, steps, runtime)}{streamed}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
