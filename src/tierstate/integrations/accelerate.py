"""Hugging Face Accelerate with a tierstate optimizer.

``accelerator.prepare(model, opt, loader, scheduler)`` works as with any optimizer:
gradient accumulation (``accelerator.accumulate``), bf16 autocast, DDP. Call
:func:`attach` once afterwards for the two things Accelerate cannot know about us::

    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    tierstate.integrations.accelerate.attach(accelerator, opt)

1. **fp16 loss scaling.** Accelerate runs ``scaler.step(opt)`` through a wrapper of
   ``opt.step`` whose signature hides the ``grad_scaler`` argument our step takes, so
   ``GradScaler`` falls back to a protocol our step ignores (it sets ``opt.grad_scale`` and
   ``opt.found_inf``) and the gradients would reach the update still scaled. And
   ``step_was_skipped`` is derived from whether ``opt.step`` was *called*, which is always
   the case for an optimizer that does its own unscaling, so an overflow step would be
   reported as taken. :func:`attach` passes the scaler through and reports the skip from
   the optimizer itself. (Without a scaler, i.e. fp32/bf16, nothing changes.)
2. **Checkpoints.** ``accelerator.save_state(dir)`` would pickle the whole optimizer state
   into ``dir/optimizer.bin``; after :func:`attach` that file only names the streaming
   checkpoint written beside it (``dir/tierstate_optimizer_<i>/``), and
   ``accelerator.load_state(dir)`` streams it back. A full state dict (from a run without
   :func:`attach`, or from ``torch.optim.AdamW``) still loads.
"""
from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer

from .common import OptimizerMetrics, find_offload_optimizer, load_optimizer_dir, save_optimizer_dir

__all__ = ["attach", "metrics"]

# Key of the small dict that stands in optimizer.bin for a streaming checkpoint.
_REFERENCE_KEY = "tierstate_checkpoint"


def attach(accelerator: Accelerator, *optimizers: AcceleratedOptimizer) -> None:
    """Fix fp16 scaling / ``step_was_skipped`` and stream checkpoints for prepared ``optimizers``.

    Args:
        accelerator: the ``Accelerator`` that prepared them.
        optimizers: the optimizers ``accelerator.prepare`` returned (wrapping tierstate's).
    """
    if not optimizers:
        raise ValueError("attach(accelerator, *optimizers): pass the optimizer(s) returned by accelerator.prepare")
    prepared = list(getattr(accelerator, "_optimizers", []))
    for opt in optimizers:
        if not isinstance(opt, AcceleratedOptimizer):
            raise TypeError(f"attach() takes the optimizer returned by accelerator.prepare(...), got "
                            f"{type(opt).__name__}; call attach after prepare")
        inner = find_offload_optimizer(opt)
        if inner is None:
            raise TypeError(f"the prepared optimizer wraps a {type(opt.optimizer).__name__}, not a tierstate optimizer")
        if getattr(opt, "_tierstate_attached", False):
            continue
        index = next((i for i, p in enumerate(prepared) if p is opt), None)
        if index is None:
            raise ValueError("this optimizer was prepared by another Accelerator; attach it to that one")
        if opt.scaler is not None:
            _pass_scaler_through(opt, inner)
        _StreamingCheckpoint(accelerator, opt, inner, index).install()
        opt._tierstate_attached = True


def _pass_scaler_through(opt: AcceleratedOptimizer, inner) -> None:
    """Replace Accelerate's step wrapper (used only while ``scaler.step`` runs) by one that
    declares ``grad_scaler`` and records whether the update really happened."""
    original = opt._optimizer_original_step_method
    if "grad_scaler" not in inspect.signature(original).parameters:
        raise TypeError(f"{type(inner).__name__}.step takes no grad_scaler argument; cannot pass the scaler through")

    def step(closure=None, grad_scaler=None):
        skipped_before = inner.skipped_steps
        result = original(closure, grad_scaler=grad_scaler)
        # AcceleratedOptimizer.step reads this flag to set step_was_skipped.
        opt._accelerate_step_called = inner.skipped_steps == skipped_before
        return result

    opt._optimizer_patched_step_method = step


class _StreamingCheckpoint:
    """Routes one prepared optimizer's ``state_dict``/``load_state_dict`` through the streaming
    checkpoint while ``save_state``/``load_state`` run (their pre-hooks say where), and leaves
    them standard at every other time."""

    def __init__(self, accelerator: Accelerator, opt: AcceleratedOptimizer, inner, index: int) -> None:
        self.accelerator = accelerator
        self.opt = opt
        self.inner = inner
        self.name = f"tierstate_optimizer_{index}"
        self.save_dir: str | None = None
        self.load_dir: str | None = None

    def install(self) -> None:
        self.accelerator.register_save_state_pre_hook(self._before_save)
        self.accelerator.register_load_state_pre_hook(self._before_load)
        # Instance attributes shadow AcceleratedOptimizer's methods for this object only.
        self.opt.state_dict = self.state_dict
        self.opt.load_state_dict = self.load_state_dict

    def _before_save(self, models, weights, output_dir) -> None:
        self.save_dir = os.fspath(output_dir)

    def _before_load(self, models, input_dir) -> None:
        self.load_dir = os.fspath(input_dir)

    def state_dict(self) -> dict:
        if self.save_dir is None:  # not inside save_state: the standard state dict
            return self.inner.state_dict()
        directory, self.save_dir = self.save_dir, None
        # Every rank of a DDP run holds the same replica; one writer (optimizer.bin's rule).
        if self.accelerator.is_main_process:
            save_optimizer_dir(self.inner, directory, name=self.name)
        return {_REFERENCE_KEY: self.name, "state": {}, "param_groups": []}

    def load_state_dict(self, state_dict: dict) -> None:
        if _REFERENCE_KEY not in state_dict:
            return self.inner.load_state_dict(state_dict)
        if self.load_dir is None:
            raise ValueError(
                f"this optimizer state dict names a streaming checkpoint ({state_dict[_REFERENCE_KEY]!r}) and must "
                "be loaded through accelerator.load_state(dir), or with "
                "tierstate.integrations.load_optimizer_dir(opt, dir, name=...)"
            )
        directory, self.load_dir = self.load_dir, None
        load_optimizer_dir(self.inner, Path(directory), name=state_dict[_REFERENCE_KEY])


def metrics(optimizer: Any) -> OptimizerMetrics:
    """An :class:`~tierstate.integrations.common.OptimizerMetrics` for ``optimizer`` (prepared
    or not); pass ``.collect()`` to ``accelerator.log(...)`` at your logging interval."""
    return OptimizerMetrics(optimizer)
