"""Hugging Face ``transformers.Trainer`` with a tierstate optimizer.

The optimizer itself needs no glue: ``Trainer(..., optimizer_cls_and_kwargs=(tierstate.AdamW,
{"lr": 3e-4, "offload": "cpu"}))`` builds it with Trainer's own parameter groups (the
no-weight-decay group for biases and norms included). Unlike ``optimizers=(opt, sched)``,
this form is also accepted when Trainer wraps the model itself (FSDP).

What the glue adds:

- :class:`TierstateTrainerMixin` (or the ready-made :class:`TierstateTrainer`): checkpoints
  write the offloaded state through tierstate's streaming save into the checkpoint folder
  (``checkpoint-N/tierstate_optimizer/``) instead of Trainer's single pickled
  ``optimizer.pt``, ``resume_from_checkpoint`` reads it back, and every Trainer log line
  carries our metrics (``tierstate/step_ms``, ``tierstate/grad_norm``, ... see
  :class:`~tierstate.integrations.common.OptimizerMetrics`).
- :class:`TierstateCallback`: the metrics alone, for code that cannot change its Trainer class.

Gradient clipping: Trainer clips with ``accelerator.clip_grad_norm_`` over ``param.grad``, which
on an accelerator no longer holds the gradients tierstate has streamed to the host. Set
``TrainingArguments(max_grad_norm=0)`` and pass ``max_grad_norm=`` to the tierstate optimizer,
which clips over every tier (its norm is logged as ``tierstate/grad_norm``). The mixin and the
callback warn at the start when Trainer's ``max_grad_norm`` would clip nothing. On a CPU-only
run both work.

FSDP (``TrainingArguments(fsdp=True, fsdp_config={"version": 2, ...})``, FSDP2 ``fully_shard``):
Trainer builds the optimizer over the full parameters and Accelerate then swaps them for the
sharded DTensors; tierstate re-places its state over this rank's shards at the first step, so each
rank holds the optimizer state of its own shard only. The mixin writes that state per rank
(``checkpoint-N/tierstate_optimizer_rank<r>_of_<world>/``) next to Trainer's own FSDP model
checkpoint, and resumes it with the same world size and wrapping. Trainer's FSDP optimizer
checkpoint (``get_optimizer_state_dict`` over DTensor state) is not used. On a CPU-only machine
use ``fsdp_config={"state_dict_type": "SHARDED_STATE_DICT"}``: the full-state-dict model save
fails there in safetensors ("invalid python storage"), independently of the optimizer. FSDP1
(``version: 1``) is not supported: Accelerate 1.15 cannot build it on CPU and Transformers
deprecates it.

DeepSpeed keeps its own optimizer checkpoint format; under it the mixin leaves Trainer's
checkpointing as it is.
"""
from __future__ import annotations

import os
import warnings
from typing import Any

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer import SCHEDULER_NAME

from .common import (STATE_DIRNAME, OptimizerMetrics, find_offload_optimizer, has_optimizer_dir,
                     load_optimizer_dir, save_optimizer_dir, warn_if_clipping_finds_no_grads)

__all__ = ["TierstateCallback", "TierstateTrainer", "TierstateTrainerMixin"]


class TierstateCallback(TrainerCallback):
    """Adds the tierstate optimizer's metrics to every Trainer log.

    Trainer calls callbacks in order and its reporting integrations (TensorBoard, W&B, ...)
    come first, so register this one with :meth:`install`, which puts it ahead of them::

        trainer = Trainer(..., optimizer_cls_and_kwargs=(tierstate.AdamW, {"lr": 3e-4}))
        TierstateCallback.install(trainer)

    Optimizers that are not tierstate's are ignored.
    """

    def __init__(self) -> None:
        self._metrics: OptimizerMetrics | None = None

    @classmethod
    def install(cls, trainer: Trainer) -> "TierstateCallback":
        """Create the callback and register it ahead of ``trainer``'s other callbacks."""
        callback = cls()
        trainer.callback_handler.callbacks.insert(0, callback)
        return callback

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        warn_if_clipping_finds_no_grads(optimizer, args.max_grad_norm, "TrainingArguments.max_grad_norm")

    def on_log(self, args, state, control, logs=None, optimizer=None, **kwargs):
        if logs is None or optimizer is None:
            return
        if self._metrics is None or self._metrics.optimizer is not find_offload_optimizer(optimizer):
            if find_offload_optimizer(optimizer) is None:
                return
            self._metrics = OptimizerMetrics(optimizer)
        metrics = self._metrics.collect()
        logs.update(metrics)
        # Trainer appended its copy of the logs to the history before calling us.
        if state.log_history:
            state.log_history[-1].update(metrics)


class TierstateTrainerMixin:
    """Mix into a ``transformers.Trainer`` subclass (before it): streaming optimizer checkpoints
    and tierstate metrics in the logs. Has no effect when the optimizer is not tierstate's.

    ::

        class MyTrainer(TierstateTrainerMixin, Trainer): ...
    """

    _tierstate_metrics: OptimizerMetrics | None = None

    def _tierstate_optimizer(self):
        """Our optimizer when this checkpoint path is ours to handle, else None."""
        if getattr(self, "is_deepspeed_enabled", False):
            return None
        return find_offload_optimizer(getattr(self, "optimizer", None))

    def _tierstate_state_name(self) -> str:
        """The optimizer state's folder name in a checkpoint: one per rank under FSDP, where each
        rank's optimizer holds only its shards' state; one for all under DDP (replicas)."""
        if getattr(self, "is_fsdp_enabled", False):
            return f"{STATE_DIRNAME}_rank{self.args.process_index}_of_{self.args.world_size}"
        return STATE_DIRNAME

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        opt = self._tierstate_optimizer()
        if opt is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        if getattr(self, "is_fsdp_enabled", False):
            # The model's shards go through Trainer's FSDP checkpoint (all ranks take part);
            # each rank then streams its own optimizer state.
            from accelerate.utils import save_fsdp_model
            from transformers.distributed.fsdp import get_fsdp_ckpt_kwargs

            save_fsdp_model(self.accelerator.state.fsdp_plugin, self.accelerator, self.model, output_dir,
                            **get_fsdp_ckpt_kwargs())
            save_optimizer_dir(opt, output_dir, name=self._tierstate_state_name())
        elif self.args.should_save:
            # Every rank holds a full replica under DDP; one writer is enough (Trainer's own rule).
            save_optimizer_dir(opt, output_dir)
        if self.args.should_save:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # "please also save the optimizer state"
                torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        opt = self._tierstate_optimizer()
        name = self._tierstate_state_name()
        if checkpoint is None or opt is None or not has_optimizer_dir(checkpoint, name):
            if checkpoint is not None and opt is not None and getattr(self, "is_fsdp_enabled", False):
                _refuse_other_world_size(checkpoint, name)
            # A checkpoint written without the mixin (optimizer.pt) still loads the usual way.
            return super()._load_optimizer_and_scheduler(checkpoint)
        load_optimizer_dir(opt, checkpoint, name=name)
        scheduler_file = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(scheduler_file):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                self.lr_scheduler.load_state_dict(torch.load(scheduler_file, weights_only=True))

    def create_optimizer(self, *args: Any, **kwargs: Any):
        optimizer = super().create_optimizer(*args, **kwargs)
        warn_if_clipping_finds_no_grads(optimizer, self.args.max_grad_norm, "TrainingArguments.max_grad_norm")
        return optimizer

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        opt = find_offload_optimizer(getattr(self, "optimizer", None))
        if opt is not None:
            if self._tierstate_metrics is None or self._tierstate_metrics.optimizer is not opt:
                self._tierstate_metrics = OptimizerMetrics(opt)
            logs.update(self._tierstate_metrics.collect())
        return super().log(logs, *args, **kwargs)


def _refuse_other_world_size(checkpoint: str, name: str) -> None:
    """Raise when ``checkpoint`` holds per-rank FSDP optimizer state of another world size: each
    rank's state covers its own shards, which differ when the number of ranks does."""
    prefix = f"{STATE_DIRNAME}_rank"
    saved = sorted(n for n in os.listdir(checkpoint) if n.startswith(prefix))
    if saved:
        raise ValueError(
            f"resume_from_checkpoint={checkpoint!r} holds tierstate optimizer state of FSDP ranks {saved}, "
            f"not {name!r}: per-rank state resumes only with the world size and FSDP wrapping it was saved with; "
            "resume with that many processes"
        )


class TierstateTrainer(TierstateTrainerMixin, Trainer):
    """``transformers.Trainer`` with :class:`TierstateTrainerMixin` applied."""
