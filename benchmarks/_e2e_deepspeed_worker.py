"""One DeepSpeed configuration of ``benchmarks/e2e.py``, run in a process of its own.

    PEERS_PYTHON benchmarks/_e2e_deepspeed_worker.py --mode ds_z3_nvme --out result.json ...

It runs under the peers' interpreter (the one that imports deepspeed), with the tierstate
package on its path, and trains through :func:`tierstate.bench._e2e_worker.measure`: the
same model, tokens, timing and result as the tierstate modes. DeepSpeed runs its own bf16
mode instead of autocast (bf16 model, fp32 master in its optimizer), as a DeepSpeed user
would; ``opt`` is ``engine.step()``, which zeroes the gradients.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from tierstate.bench._e2e_worker import BETAS, EPS, LR, WEIGHT_DECAY, Harness, measure, worker_parser
from tierstate.bench._gpu_train_worker import deepspeed_world_of_one

MODES = ("ds_z2_cpu", "ds_z3_nvme")


def deepspeed_harness(args: argparse.Namespace, model: torch.nn.Module, tokens: torch.Tensor,
                      swap_dir: Path | None) -> Harness:
    """A single-process DeepSpeed engine (no launcher) in the configuration the peers measured."""
    deepspeed = deepspeed_world_of_one("gloo")
    if args.mode == "ds_z2_cpu":
        zero = {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": False},
                "contiguous_gradients": True, "overlap_comm": False}
        aio = None
    else:
        zero = {"stage": 3, "overlap_comm": False,
                "offload_optimizer": {"device": "nvme", "nvme_path": str(swap_dir), "pin_memory": False,
                                      "buffer_count": 4}}
        aio = {"block_size": 1 << 20, "queue_depth": 32, "intra_op_parallelism": 1,
               "single_submit": False, "overlap_events": True}
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "bf16": {"enabled": args.precision == "bf16"},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS,
                                                  "weight_decay": WEIGHT_DECAY}},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }
    if aio is not None:
        config["aio"] = aio
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    def forward():
        return engine(input_ids=tokens, labels=tokens).loss

    return Harness(forward, engine.backward, engine.step,
                   info={"deepspeed": deepspeed.__version__, "optimizer": type(engine.optimizer).__name__})


def main(argv: list[str] | None = None) -> int:
    args = worker_parser(MODES, __doc__.split("\n\n")[0]).parse_args(argv)
    result = measure(args, deepspeed_harness, uses_disk=args.mode == "ds_z3_nvme")
    Path(args.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
