"""The undo side of speculative updates during backward: copies taken before each update,
the rollback, and the test of whether the updates stand as the plain step would have made
them. Why and when: [Note: speculative updates and rollback] in :mod:`.backward`.

:class:`Speculation` is a mixin of :class:`.backward.BackwardDriver`; it uses the driver's
``engine``, ``undo``, ``saved``, ``grads``, ``lives``, ``sums``, ``versions`` and
``spec_scale``; it also holds the refusal of a sparse gradient met during backward, which
undoes what it can as a rollback does.
"""
from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

import torch

from ..placement import SubGroup
from . import grad_mark
from .decision import Scaling

_log = logging.getLogger("tierstate")

if TYPE_CHECKING:
    from .engine import StepEngine


class Speculation:
    engine: "StepEngine"

    def refuse_sparse(self) -> bool:
        """After :meth:`finish`: for a sparse gradient the rule refuses, either raise with the state
        as before this backward (its updates rolled back where they are speculative, or none made),
        or return True: updates made during backward cannot be undone, so :meth:`finish_step`
        completes the parameters whose gradients were handed over before it and leaves the others
        untouched (as after a non-finite gradient), and the step raises the refusal then."""
        try:
            self.engine.parts.grads.check_sparse(self.engine.store.slots)
        except RuntimeError:
            if self.speculative or not self.prepared:
                if self.speculative and (self.saved or self.prepared):
                    self.rollback()
                self.close_cycle()
                raise
            return True
        return False

    def save(self, sg: SubGroup, segments, views) -> None:
        """Copy ``sg``'s state and its parameters' values aside before its speculative update."""
        store = self.engine.store
        keep = self.undo.get(sg.index)
        if keep is None:
            keep = self.undo[sg.index] = {"views": {}, "values": {}}
        for key, view in views.items():
            buf = keep["views"].get(key)
            if buf is None or buf.shape != view.shape or buf.dtype != view.dtype:
                buf = keep["views"][key] = torch.empty_like(view, device="cpu")
            buf.copy_(view)
        for seg in segments:
            s = store.by_trainable(seg.param_index)
            with store.values_of(s, False) as values:
                piece = values[seg.param_offset: seg.param_offset + seg.numel]
                buf = keep["values"].get(seg.param_index)
                if buf is None or buf.shape != piece.shape or buf.dtype != piece.dtype:
                    buf = keep["values"][seg.param_index] = torch.empty_like(piece, device="cpu")
                buf.copy_(piece)
        self.saved.append(sg.index)

    def second_pass_refusal(self, index: int) -> str:
        """Why parameter ``index``'s gradient of a backward pass past the one this step's updates
        ran in is refused (after :meth:`rollback` where those could be undone)."""
        head = (f"step_in_backward=True: parameter {index} received a gradient in backward pass {self.passes + 1} "
                "before step()")
        if not self.can_undo:  # found 2026-12-07: this said to keep the count constant, as the user had
            return (f"{head}: with weights streamed per block (ts.offload_weights) each gradient is applied during "
                    "the backward that produces it and then released, so gradients cannot accumulate over several "
                    "backward() calls, and the updates of the first pass stand (they cannot be rolled back). Call "
                    "backward() once per step(), or construct the optimizer with step_in_backward=False to accumulate")
        return (f"{head}, while the last step took {self.expected_passes}; this mode updates the state during the "
                "last pass, and the forward just run already used those weights"
                + (" (the updates were rolled back)" if self.speculative else "")
                + ". Keep the number of backward() calls per step() constant (the first step learns it), "
                "or construct the optimizer with step_in_backward=False")

    def abandon(self) -> None:
        """The cycle ends on an error raised by ``step()`` (a record found lost, a refusal):
        its speculative updates are rolled back, so the step leaves every parameter and state as
        before it (found 2026-12-07: after a failed read the sub-groups updated before it kept
        their unclipped speculative updates). A rollback that fails too is logged; the error the
        step raises is the first one."""
        try:
            if self.speculative and (self.saved or self.prepared):
                self.rollback()
        except Exception as undo_failed:  # noqa: BLE001 - the caller raises the first error
            _log.warning("tierstate: rolling back the updates made during backward failed too (%s): load the "
                         "last checkpoint (tierstate.load_optimizer) before training on", undo_failed)
        finally:
            self.close_cycle()

    def rollback(self) -> None:
        """Put back every speculative update of this cycle: the sub-groups' state and parameter
        values from their copies, each prepared parameter's step count and state life."""
        engine = self.engine
        store, layout = engine.store, engine.store.layout
        self._update_waiting_drop()
        failed = None  # the first sub-group whose state could not be put back (its record unreadable)
        with engine.telemetry.phase("backward_rollback"):
            for index in self.saved:
                sg = layout.subgroups[index]
                keep = self.undo[index]
                # the parameters first: their copies are in RAM, so they come back even where the
                # tier cannot give the state back (found 2026-12-07: a second failed read left them
                # holding speculative values)
                for seg in sg.segments:
                    buf = keep["values"].get(seg.param_index)
                    if buf is None or seg.param_index not in self.grads:
                        continue
                    s = store.by_trainable(seg.param_index)
                    with store.values_of(s, True) as values:
                        values[seg.param_offset: seg.param_offset + seg.numel].copy_(buf)
                tier = store.tier_of(sg)
                try:
                    views = tier.acquire(sg)
                except Exception as exc:  # noqa: BLE001 - raised once every other sub-group is back
                    failed = failed or exc
                    continue
                try:
                    for key, view in views.items():
                        view.copy_(keep["views"][key])
                finally:
                    tier.release(sg, dirty=True)
        for t, (life, step, master, pending) in self.lives.items():
            s = store.by_trainable(t)
            s.life, s.step, s.master = life, step, master
            s.pending_pieces.clear()
            s.pending_pieces.update(pending)
        engine.counters.rollbacks += 1
        engine.telemetry.count("backward_rollbacks")
        self.grads.clear()
        self.prepared.clear()
        self.fresh.clear()
        self.done = []
        self.saved = []
        self.sums.clear()
        self.versions.clear()
        self.lives.clear()
        self.nonfinite = []
        self.sumsq = 0.0
        self.stopped = False
        if failed is not None:
            raise failed

    def _update_waiting_drop(self) -> None:
        self.waiting.clear()

    def _commits(self, active: list, scaling: Scaling) -> "float | None":
        """The squared norm (scaled as the plain step takes it) when the speculative updates stand
        as the plain step would have made them; None when they must be rolled back."""
        if self.nonfinite or scaling.prior_inf or scaling.inv_scale != self.spec_scale:
            return None
        sums = []
        for s, g in active:
            t = s.trainable
            if t not in self.sums:
                return None  # a gradient no hook took (set by hand, or a pass not taken)
            if not grad_mark.unchanged(self.versions[t], s.param.grad):
                return None  # changed after its hook (scaler.unscale_, clip_grad_norm_, ...)
            sums.append(self.sums[t] * (scaling.inv_scale * scaling.inv_scale))
        if len(sums) != len(self.grads):
            return None
        sumsq = sum(sums)
        if not math.isfinite(sumsq):
            return None
        limit = self.engine.policy.max_grad_norm
        if limit is not None and min(1.0, limit / (math.sqrt(sumsq) + 1e-6)) != 1.0:
            return None
        return sumsq


class Saving:
    """An executor that copies each sub-group's state aside before the wrapped one updates it."""

    def __init__(self, driver: "Speculation", inner) -> None:
        self.driver, self.inner = driver, inner

    def submit(self, sg: SubGroup, segments, views):
        self.driver.save(sg, segments, views)
        return self.inner.submit(sg, segments, views)
