"""Lightning with a tierstate optimizer.

``configure_optimizers`` returns a tierstate optimizer like any other, with or without an
LR scheduler::

    def configure_optimizers(self):
        opt = tierstate.AdamW(self.parameters(), lr=3e-4, offload="cpu", max_grad_norm=1.0)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-4, total_steps=1000)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

Checkpoints (``ModelCheckpoint``, ``trainer.save_checkpoint``, ``fit(ckpt_path=...)``) work
through the optimizer's standard ``state_dict()``; the state is materialised in host memory
while the ``.ckpt`` is written, so for states larger than RAM save with
``tierstate.save_optimizer`` instead.

Gradient clipping: pass ``max_grad_norm=`` to the optimizer, not ``gradient_clip_val=`` to the
Trainer. Lightning clips ``param.grad``, which on an accelerator no longer holds the
gradients tierstate streamed to the host, and under mixed precision (``"16-mixed"`` and
``"bf16-mixed"``) it refuses to clip at all for optimizers that unscale gradients inside
``step()`` (ours do: the host copies are never seen by ``GradScaler.unscale_``), raising "does not allow for gradient
clipping because it performs unscaling of gradients internally". ``max_grad_norm`` clips
the global norm over every tier, after unscaling, as ``clip_grad_norm_`` would.

:class:`TierstateMetrics` logs our metrics through ``LightningModule.log_dict`` after every
optimizer step, so they reach the Trainer's loggers (TensorBoard, CSV, ...) and
``trainer.logged_metrics``.
"""
from __future__ import annotations

from typing import Any

try:
    import lightning.pytorch as pl
except ImportError:  # the standalone "pytorch_lightning" package has the same API
    import pytorch_lightning as pl

from .common import OptimizerMetrics, find_offload_optimizer

__all__ = ["TierstateMetrics"]


class TierstateMetrics(pl.Callback):
    """Logs the tierstate optimizer's metrics (``tierstate/step_ms``, ``tierstate/grad_norm``, ...;
    see :class:`~tierstate.integrations.common.OptimizerMetrics`) at every optimizer step.

    Warns once at the start of fitting when ``gradient_clip_val`` is set together with a
    tierstate optimizer (see the module docstring).
    """

    def __init__(self) -> None:
        self._metrics: dict[int, OptimizerMetrics] = {}

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        ours = [o for o in trainer.optimizers if find_offload_optimizer(o) is not None]
        if ours and trainer.gradient_clip_val:
            pl.utilities.rank_zero_warn(
                "gradient_clip_val is set with a tierstate optimizer: Lightning clips param.grad, which does "
                "not hold gradients already streamed to the host; pass max_grad_norm= to the tierstate "
                "optimizer and leave gradient_clip_val unset"
            )

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        values: dict[str, float] = {}
        for i, optimizer in enumerate(trainer.optimizers):
            opt = find_offload_optimizer(optimizer)
            if opt is None:
                continue
            watch = self._metrics.get(i)
            if watch is None or watch.optimizer is not opt:
                watch = self._metrics[i] = OptimizerMetrics(opt)
            collected = watch.collect()
            if "tierstate/step_ms" not in collected:
                continue  # an accumulation micro-batch: no optimizer step since the last one
            suffix = "" if len(trainer.optimizers) == 1 else f"_{i}"
            values.update({f"{k}{suffix}": v for k, v in collected.items()})
        if values:
            pl_module.log_dict(values, on_step=True, on_epoch=False, batch_size=1)
