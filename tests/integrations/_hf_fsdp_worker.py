"""One rank of tests/integrations/test_hf_fsdp.py, started by torchrun (gloo, CPU).

In one process it runs HF Trainer with ``optimizer_cls_and_kwargs=(tierstate.AdamW, ...)`` four
times: under DDP (the reference), then under FSDP2 straight through STEPS steps; again with a
checkpoint at step CHECKPOINT_STEP; and a fresh Trainer resumed from that checkpoint. It writes ``rank<r>.pt`` into the output folder: the
losses and tierstate metrics each run logged, and this rank's local shard of every parameter and
every optimizer state tensor at the end of each run, for the test to compare.

    torchrun --standalone --nproc-per-node 2 _hf_fsdp_worker.py OUT_DIR
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from transformers import TrainingArguments  # noqa: E402

import tierstate as ts  # noqa: E402
from tierstate.integrations import find_offload_optimizer  # noqa: E402
from tierstate.integrations.hf import TierstateTrainer  # noqa: E402
from tiny_lm import TokenStream, tiny_model  # noqa: E402

STEPS = 6
CHECKPOINT_STEP = 3
OPT = (ts.AdamW, {"lr": 1e-2, "offload": "cpu", "max_grad_norm": 1.0, "betas": (0.9, 0.95), "weight_decay": 0.1})


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``t`` (FSDP2 parameters and their state are DTensors)."""
    t = t.detach()
    return (t.to_local() if hasattr(t, "to_local") else t).clone()


def allow_fsdp_on_cpu() -> None:
    """Let Accelerate run FSDP on a CPU-only machine.

    Accelerate 1.15 turns an FSDP plugin into ``DistributedType.FSDP`` only for accelerator
    devices; with ``MULTI_CPU`` it silently keeps DDP and Trainer then trains replicas, not
    shards. torch's FSDP itself runs on CPU over gloo, so this test lifts only that gate (on a GPU
    machine nothing here is needed) and then checks that the parameters really are sharded.
    """
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    original = AcceleratorState.__init__

    def init(self, *args, fsdp_plugin=None, **kwargs):
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin

    AcceleratorState.__init__ = init


# FSDP2, each decoder layer its own unit. SHARDED_STATE_DICT: each rank saves its model shards
# (DCP); with the default FULL_STATE_DICT, Trainer's model save fails on CPU inside safetensors
# ("Attempted to access the data pointer on an invalid python storage"), optimizer or not.
FSDP_CONFIG = {"version": 2, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
               "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"], "state_dict_type": "SHARDED_STATE_DICT"}


def _trainer(out: str, fsdp: bool, **kw) -> TierstateTrainer:
    """A Trainer of the tiny Llama under FSDP2, or under DDP."""
    from accelerate.state import AcceleratorState

    # Each Trainer builds its own Accelerator; the process-wide state of the previous one would
    # otherwise keep its FSDP plugin object.
    AcceleratorState._reset_state(reset_partial_state=False)
    args = TrainingArguments(
        output_dir=out, max_steps=STEPS, per_device_train_batch_size=4, learning_rate=1e-2,
        lr_scheduler_type="linear", logging_steps=1, report_to=[], use_cpu=True, seed=0, data_seed=0,
        dataloader_num_workers=0, disable_tqdm=True, max_grad_norm=0.0, save_only_model=False,
        **({"fsdp": True, "fsdp_config": dict(FSDP_CONFIG)} if fsdp else {}), **kw)
    return TierstateTrainer(model=tiny_model("llama"), args=args, train_dataset=TokenStream(), optimizer_cls_and_kwargs=OPT)


def _snapshot(trainer: TierstateTrainer) -> dict:
    params = {n: _local(p) for n, p in trainer.model.named_parameters()}
    state = trainer.optimizer.state_dict()["state"]
    opt_state = {i: {k: _local(v) for k, v in s.items()} for i, s in state.items()}
    logged = [h for h in trainer.state.log_history if "loss" in h]
    return {"params": params, "opt_state": opt_state, "losses": [h["loss"] for h in logged],
            "metrics": [{k: v for k, v in h.items() if k.startswith("tierstate/")} for h in logged],
            "global_step": trainer.state.global_step, "fsdp_enabled": trainer.is_fsdp_enabled,
            "optimizer_type": type(find_offload_optimizer(trainer.optimizer)).__qualname__}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    args = p.parse_args()
    allow_fsdp_on_cpu()
    result = {}
    # The same training, replicated: FSDP must reach the same losses and gradient norms.
    replicated = _trainer(os.path.join(args.out, "replicated"), fsdp=False, save_strategy="no")
    replicated.train()
    result["replicated"] = _snapshot(replicated)
    straight = _trainer(os.path.join(args.out, "straight"), fsdp=True, save_strategy="no")
    straight.train()
    result["straight"] = _snapshot(straight)

    checkpointed = _trainer(os.path.join(args.out, "resumed"), fsdp=True, save_strategy="steps",
                            save_steps=CHECKPOINT_STEP)
    checkpointed.train()
    result["checkpointed"] = _snapshot(checkpointed)
    ckpt = os.path.join(args.out, "resumed", f"checkpoint-{CHECKPOINT_STEP}")
    result["checkpoint_files"] = sorted(os.listdir(ckpt))

    resumed = _trainer(os.path.join(args.out, "resumed"), fsdp=True, save_strategy="no")
    resumed.train(resume_from_checkpoint=ckpt)
    result["resumed"] = _snapshot(resumed)
    result["world_size"] = dist.get_world_size()
    torch.save(result, os.path.join(args.out, f"rank{dist.get_rank()}.pt"))


if __name__ == "__main__":
    main()
