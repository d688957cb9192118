"""Updating optimizer state during backward: each sub-group as soon as its gradients are final.

Opt-in with ``step_in_backward=True`` on any tierstate optimizer. The driver runs the
engine's own loop and host executor (:mod:`.loop`, :mod:`.executors`) on each ready sub-group.

[Note: why update during backward]
A plain step starts when backward ends, so everything the step does is added to the
training step: the host kernels' pass over the state and, in NVMe mode, the disk time of
every record that is not cached in the buffer pool. With a pool of ``B`` buffers and ``S``
records, a step must read ``S - B`` records and write ``S - B`` whatever the pool policy,
since at most ``B`` records can be in RAM when it starts (GPT-2 124M, the default pool:
14 of 30 records each way, ~0.5 s of disk time on a 1.9 GB/s read / 4 GB/s write disk).

Backward, though, finishes the gradients layer by layer, last layer first. Once every
parameter with a piece in a sub-group has its final gradient (its
``register_post_accumulate_grad_hook`` has fired), nothing later in the backward pass
changes that sub-group's inputs, so it can be updated right then, while autograd has
the earlier layers still to compute. The NVMe tier is told the order the
sub-groups become ready in (the order of the previous step), and with that plan it
writes the previous step's last records back during forward and reads the next records
ahead during backward. What is left for ``step()`` is the sub-groups whose gradients are
final only when backward ends (a tied input embedding is the usual one) and the
bookkeeping.

Touching a parameter's value after its hook fired is safe: autograd needs a leaf's value
only inside the nodes that consumed it, and its gradient is complete (the hook fires)
only after all of them ran. On an accelerator the device copy of the weight is uploaded
in ``step()``, as without this mode.

[Note: updates on the backward thread]
Where an update runs depends on where backward runs. On an accelerator the host cores are
idle during backward, so a worker thread takes each ready sub-group (and the CUDA stream
keeps the device busy meanwhile). On CPU parameters backward itself keeps every core busy,
and a worker beside it only oversubscribes them: torch's parallel regions wait for their
slowest thread, and a thread preempted by the worker stalls the whole region. So on CPU
the hook updates a ready sub-group itself, on the backward thread with all kernel
threads, between two autograd nodes; an NVMe sub-group whose record has not landed yet is
left for a later hook (or ``step()``) instead of being waited for, so backward never waits
on the disk. What overlaps backward is then the I/O alone, which is the point on CPU.
On a 2-core machine (GPT-2 124M, bf16 parameters, NVMe) a step takes ~1.8 s on the
backward thread against ~1.9-2.0 s with a worker thread, and peaks ~0.2 GiB lower.

[Note: speculative updates and rollback]
Clipping needs the global norm, a GradScaler's overflow check every gradient, and with
gradient accumulation only the last backward's gradients are final: none of that is known
when a sub-group becomes ready. So when any of them may apply (``max_grad_norm`` is set, a
loss scaler or accumulation was seen, a step found a gradient changed after its hook, as
``clip_grad_norm_`` by hand does, or it is the first step and nothing is known yet),
the updates during backward are speculative: each sub-group's state (and its parameter's
values) is copied aside just before its update, with the unclipped gradient times the loss
scale of the previous step. ``step()`` then decides as the plain step would, from the sums
of squares the hooks took: if every gradient is finite and unchanged since its hook, the
scale is the one used and the clip coefficient is exactly 1, the updates stand; otherwise
every speculative update is rolled back from its copy, the step counts and state lives are
put back, and the plain step runs (or skips), so the result is the plain step's bit for
bit in every case. A second gradient for a parameter before ``step()`` (accumulation)
rolls back what this backward updated and ends speculation for the step; the next steps
speculate only during the backward that, by the last step's count, is the final one.
``stats().counts["backward_rollbacks"]`` counts rollbacks.

The copies cost host memory and bandwidth: the state of every sub-group updated during
backward (master and moments: 12 B/param for AdamW), kept across steps for reuse, plus
one extra write of those bytes per step; a rollback adds a copy back and the plain step.
Without clipping, scaler or accumulation no copy is kept after the first step. Since a
rollback costs more than the update it undoes, the steps after one take nothing during
backward (1, then 2, 4, ... up to 16 steps while rollbacks repeat), so a run where clipping
is active on most steps pays about the plain step, not twice it.

[Note: what this mode cannot do]
- with parameters whose weights stream (``ts.offload_weights``) updates cannot be
  rolled back (their gradients are released once applied): no clipping, no GradScaler, no
  accumulation there (refused);
- without speculation, a gradient changed after its hook (a change first made after the
  steps that learned there was none) finds its update made with the value backward left:
  ``step()`` raises ``RuntimeError`` saying so, and every later step speculates;
- without speculation, a non-finite gradient cannot skip the whole step: each gradient is
  checked when it is handed over and the updates stop at the first non-finite one;
  sub-groups updated before stay updated, the rest stay untouched, and ``step()`` raises
  ``FloatingPointError`` naming the parameters (with speculation it is skipped, as the
  plain step does).
- an NVMe write that fails is raised at the end of ``step()``, the record kept in RAM
  and written when next evicted (a step cannot refuse to start: its updates ran during
  backward); once a record is found lost (``StateLostError``) every later backward
  updates nothing and ``step()`` raises it, until a checkpoint is loaded. Speculative
  updates made before it in that backward are rolled back (the parameters first).
"""
from __future__ import annotations

import math
import queue
import threading
from collections import deque
from typing import TYPE_CHECKING

from torch import Tensor

from .. import kernels
from ..placement import SubGroup
from ..tiers import Slot
from . import grad_mark
from .decision import Scaling
from .loop import run_subgroups, update_planned
from .speculation import Saving, Speculation
from .worker_exit import watch_at_exit

if TYPE_CHECKING:
    from .engine import StepEngine, StepResult

_LANE = "backward-update"
# sub-groups whose gradients may wait for their NVMe record when weights stream (see _update_waiting)
STREAMED_WAITING = 4
# After a rollback the next 1, 2, 4, ... (at most this many) steps update nothing during backward
# (see [Note: speculative updates and rollback]): with clipping active on every step (GPT-2 124M
# early in training, max_grad_norm=1.0) each rollback cost more than the update it undid.
_MAX_HOLD = 16


class BackwardDriver(Speculation):
    """Hooks every trainable parameter and updates sub-groups as they become ready.

    Where the updates run is said in [Note: updates on the backward thread]. Either way the
    tiers never see two threads at once: with the worker, all tier access while a backward
    pass is open happens on it, and ``step()`` calls :meth:`finish` (which waits for the
    worker) before it touches the tiers itself.
    """

    def __init__(self, engine: "StepEngine") -> None:
        self.engine = engine
        # see [Note: speculative updates and rollback]
        self.can_undo = not engine.parts.weights.streamed
        if engine.policy.max_grad_norm is not None and not self.can_undo:
            raise ValueError(
                f"step_in_backward=True with max_grad_norm={engine.policy.max_grad_norm!r} and parameters whose "
                "weights stream: their gradients are released once applied, so an update made during backward "
                "cannot be rolled back when clipping turns out active; pass max_grad_norm=None or "
                "step_in_backward=False")
        self.known = False  # a step has been taken: what follows is learned from it
        self.saw_scaler = False
        # a step found a gradient changed after its hook (clip_grad_norm_, scaler.unscale_, ...):
        # from then on every update during backward keeps what is needed to undo it
        self.saw_change = False
        self.expected_passes = 1  # backward passes per step, as the last step counted them
        self.spec_scale = 1.0  # the loss scale's inverse the last step used
        self.undo: dict[int, dict] = {}  # sub-group -> its copies, reused across steps
        self.hold_for = 0  # steps left that take nothing during backward (after a rollback)
        self.hold_next = 1  # how many the next rollback holds for (doubles up to _MAX_HOLD)
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None  # the worker, started at its first use
        # a frozen parameter cannot be hooked (Adagrad's, which keep state, reach step() as set by hand)
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in engine.parts.trainable
                         if p.requires_grad]
        # The order sub-groups became ready in during the last backward (then the leftovers
        # step() updated): the I/O tiers' plan for the next one. Before the first backward,
        # the reverse of the parameters' order, which is how backward usually meets them.
        self.expected_order: list[SubGroup] = list(reversed(engine.store.layout.subgroups))
        # See [Note: updates on the backward thread]; tests set it to run the worker on CPU.
        self.inline = engine.device.type == "cpu"
        self._reset()

    # -- one backward pass ---------------------------------------------------------------------
    def _reset(self) -> None:
        self.open = False
        self.pending: dict[int, int] = {}  # sub-group -> hooked parameters still to deliver
        self.seen: set[int] = set()  # trainable indices whose gradient arrived
        self.grads: dict[int, Tensor] = {}  # trainable index -> flat host gradient
        self.prepared: set[int] = set()  # slots whose step count and state were set up
        self.fresh: set[int] = set()  # slots whose state started existing this step
        self.done: list[SubGroup] = []  # sub-groups updated during backward, in order
        self.nonfinite: list[int] = []  # param indices (torch numbering) with inf/nan
        self.refused: list[int] = []  # param indices with a sparse gradient the rule refuses
        self.error: BaseException | None = None
        self.stopped = False  # set at the first non-finite gradient or error
        self.sumsq = 0.0  # squared norm of the gradients taken (for last_grad_norm)
        self.waiting: deque[SubGroup] = deque()  # inline: ready sub-groups whose record is still on its way
        # streamed parameters (tierstate.weights) -> their sub-groups not yet updated; at 0 the
        # gradient has been applied and is released (see [Note: gradients of streamed weights])
        self.segments_left: dict[int, int] = {}
        self.passes = 0  # backward passes seen this cycle
        self.sums: dict[int, float] = {}  # trainable index -> its gradient's sum of squares (unscaled)
        self.versions: dict[int, tuple] = {}  # trainable index -> its param.grad's mark at its hook (grad_mark)
        self.lives: dict[int, tuple] = {}  # trainable index -> (life, step, master, pending) before prepare
        self.saved: list[int] = []  # sub-groups whose copies hold their state from before this cycle
        self.speculative = self._speculates()
        self.holding = self.speculative and self.hold_for > 0
        self.executor = self.engine.host_executor(self.grads, self.fresh, self.spec_scale if self.speculative else 1.0)

    def _speculates(self) -> bool:
        """Whether this cycle's updates keep what is needed to roll them back."""
        if not self.can_undo:
            return False
        policy = self.engine.policy
        return (policy.max_grad_norm is not None or self.saw_scaler or self.saw_change or self.expected_passes > 1
                or not self.known)

    def _taking(self) -> bool:
        """Whether gradients of this backward pass are taken (and sub-groups updated) now: not
        before a first step said how many backward passes make one (the forward of a next
        micro-batch would see the updated weights), and only in the last of them."""
        if not self.speculative:
            return True
        return self.known and not self.holding and self.passes >= self.expected_passes

    def _begin(self) -> None:
        """First gradient of a backward pass: count, per sub-group, the parameters to wait for."""
        engine = self.engine
        self.open = True
        self.passes += 1
        self.pending = {}
        self.seen = set()
        self.waiting.clear()
        lost = engine.store.lost_error() or engine.user_writes_refused()  # masters follow the user's writes
        if lost is not None:  # update nothing: step() raises it with the state as before this backward
            self.error, self.stopped = lost, True
        streamed = engine.parts.weights.streamed
        for t, p in enumerate(engine.parts.trainable):
            if not p.requires_grad:
                continue
            segs = engine.store.layout.segments_of(t)
            for seg in segs:
                self.pending[seg.subgroup] = self.pending.get(seg.subgroup, 0) + 1
            if t in streamed:
                self.segments_left[t] = len(segs)

    def _on_grad(self, param: Tensor) -> None:
        engine = self.engine
        if engine.parts is None:
            return
        s = engine.store.slot_of(param)
        if s is None or s.trainable is None:
            return
        if not self.open:
            self._begin()
        if s.trainable in self.seen:
            self._next_pass(s)
        self.seen.add(s.trainable)
        # what step() compares to learn whether gradients change after their hooks, taken or not
        self.versions[s.trainable] = grad_mark.mark(s.param.grad)
        if not self._taking():
            return
        landed = None
        grads = engine.parts.grads
        if s.param.grad is not None and s.param.grad.is_sparse and grads.sparse_refusal(s) is not None:
            self.refused.append(s.index)  # and take nothing more: see refuse_sparse
            self.stopped = True
            return
        if grads.streamed(s):
            # CUDA gradient stream: send this gradient now instead of when its bucket fills;
            # the worker waits for the copy before it reads the host buffer.
            landed = grads.stream.flush_now()
            grad = grads.stream.host[grads.stream_index[s.trainable]]
        else:
            grad = grads.host_grad(s)
            if grad is None:
                return
        ready = []
        layout = engine.store.layout
        for seg in layout.segments_of(s.trainable):
            left = self.pending.get(seg.subgroup, 0) - 1
            self.pending[seg.subgroup] = left
            if left == 0:
                ready.append(layout.subgroups[seg.subgroup])
        if not self.inline:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tierstate-backward-update", daemon=True)
                watch_at_exit(self)
                self._thread.start()
            self._queue.put((s, grad, ready, landed))
            return
        if self.stopped:
            return
        try:
            if self._take(s, grad, landed):
                self.waiting.extend(ready)
            self._update_waiting(block=False)
        except BaseException as exc:  # noqa: BLE001 - raised by finish(), as the worker's are
            self.error = exc
            self.stopped = True

    def _next_pass(self, s: Slot) -> None:
        """A second gradient for a parameter before step(): another backward pass (accumulation).

        Passes before the one the last step counted as final took nothing. A pass beyond it
        finds this step's updates made, and the forward just run used their weights: they are
        rolled back (the state is as before the step) and this is refused, as the gradients of
        this micro-batch are not the plain step's."""
        if not self.inline:
            self._queue.join()  # the worker is idle from here: the tiers are this thread's
        if self.prepared or self.done or self.nonfinite:
            if self.speculative:
                self.rollback()
            raise RuntimeError(self.second_pass_refusal(s.index))
        self._begin()

    # -- the worker ----------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if not self.stopped:
                    self._handle(*item)
            except BaseException as exc:  # noqa: BLE001 - re-raised by finish() on the step's thread
                self.error = exc
                self.stopped = True
            finally:
                self._queue.task_done()

    def _handle(self, s: Slot, grad: Tensor, ready: list[SubGroup], landed) -> None:
        if self._take(s, grad, landed):
            for sg in ready:
                self._update(sg)

    def _take(self, s: Slot, grad: Tensor, landed) -> bool:
        """Check one parameter's gradient and set up its state; False (and stop) if it is not finite."""
        if landed is not None:
            landed.synchronize()
        upload = self.engine.parts.weights.upload_done
        if upload is not None:
            # CUDA: the previous step's weight upload reads the staging buffers the kernels
            # are about to overwrite (forward on the device may not even have started yet)
            upload.synchronize()
        sumsq = kernels.grad_sumsq(grad)
        if not math.isfinite(sumsq):
            self.nonfinite.append(s.index)
            self.stopped = True
            return False
        self.sumsq += sumsq
        if self.speculative:  # what a rollback and the commit check need (with the hook's versions)
            self.sums[s.trainable] = sumsq
            self.lives[s.trainable] = (s.life, s.step, s.master, set(s.pending_pieces))
        self.grads[s.trainable] = grad
        if self.engine.prepare(s, grad):
            self.fresh.add(s.trainable)
        self.prepared.add(s.trainable)
        return True

    def _update(self, sg: SubGroup) -> None:
        """Update one sub-group whose gradients are all final, through the engine's loop."""
        segs = [seg for seg in sg.segments if seg.param_index in self.grads]
        store = self.engine.store
        telemetry = self.engine.telemetry
        self.executor.lane = None if self.inline else _LANE  # the worker's phases go to its own trace lane
        if not self.inline:
            telemetry = _Lane(telemetry, _LANE)
        executor = Saving(self, self.executor) if self.speculative else self.executor
        # the I/O tiers read ahead along plan_next()'s order: this sub-group is part of that plan
        update_planned(store.tier_of(sg), sg, segs, executor, telemetry)
        self.done.append(sg)
        self._release_applied(segs)

    def _release_applied(self, segs) -> None:
        """Drop the gradients of streamed parameters that are wholly applied.

        [Note: gradients of streamed weights]
        A model whose weights stream is one whose gradients would not fit either (they are as
        large as the weights: 27 GB in fp32 for a 7B model), so a streamed parameter's gradient
        is dropped (``param.grad = None``) as soon as every piece of it has been applied, during
        backward, and its memory goes back before the next block's gradients are made. The
        step's bookkeeping keeps the parameter as stepped."""
        trainable = self.engine.parts.trainable
        for seg in segs:
            t = seg.param_index
            left = self.segments_left.get(t)
            if left is None:
                continue
            if left == 1:
                del self.segments_left[t]
                self.grads[t] = None
                trainable[t].grad = None
            else:
                self.segments_left[t] = left - 1

    def _update_waiting(self, block: bool) -> None:
        """Inline mode: update the ready sub-groups in order, up to the first whose record has
        not landed yet (all of them with ``block``). With streamed weights at most
        ``STREAMED_WAITING`` sub-groups wait: beyond that the oldest one's record is waited for,
        or their gradients would pile up to the model's size (a step of an 8-layer GPT-2 with
        50 MB blocks peaked 215 MB above its start with every update left to step())."""
        store = self.engine.store
        limit = STREAMED_WAITING if self.segments_left else None
        while self.waiting and not self.stopped:
            sg = self.waiting[0]
            tier = store.tier_of(sg)
            if not block and tier.does_io and not tier.ready(sg) and (limit is None or len(self.waiting) <= limit):
                return
            self.waiting.popleft()
            self._update(sg)

    # -- the step's side -----------------------------------------------------------------------
    def finish(self) -> None:
        """Wait until every gradient delivered so far is handled (by the worker, or here for the
        sub-groups left waiting for their records); raise the first error."""
        if not self.open:
            return
        if self.inline:
            try:
                self._update_waiting(block=True)
            except BaseException as exc:  # noqa: BLE001 - raised below, as the worker's are
                self.error = exc
                self.stopped = True
        else:
            with self.engine.telemetry.phase("backward_wait"):
                self._queue.join()
        if self.error is not None:
            error, self.error = self.error, None
            self.abandon()  # speculative updates rolled back: the failed step changed nothing
            raise error

    def finish_step(self, active: list, scaling: Scaling) -> "StepResult":
        """step() after a backward whose sub-groups were (partly) updated during it: update what is
        left (sub-groups with a parameter that got no gradient during backward, or whose gradient
        is final only at its end), and plan the next backward's I/O.

        Every parameter ends either wholly updated or untouched: one whose gradient was taken
        (and found finite) gets its remaining pieces here even when a later gradient was
        non-finite; then the result carries a ``FloatingPointError`` naming the non-finite ones,
        to raise once the updated state is published.
        """
        from .engine import StepResult  # noqa: PLC0415 - engine imports this module

        engine = self.engine
        store = engine.store
        if scaling.scaled:
            self.saw_scaler = True
        changed = self._changed_after_hooks(active)
        if changed:
            self.saw_change = True
        if self.speculative:
            late = [s.index for s in store.slots if s.trainable is None and s.param.requires_grad
                    and s.param.grad is not None]
            if late:
                if self.saved or self.prepared:
                    self.rollback()
                self.close_cycle()
                raise RuntimeError(
                    f"step_in_backward=True: parameter(s) {late[:8]} were frozen when the optimizer was built and "
                    "now have gradients; their state cannot be placed while backward updates run. Build the "
                    "optimizer after unfreezing them, or use step_in_backward=False")
            return self._finish_speculative(active, scaling)
        bad, refused = list(self.nonfinite), list(self.refused)  # refused: see refuse_sparse
        applied = [t for t in changed if t in self.prepared]  # used during backward, as it was then
        try:
            if scaling.scaled:
                raise ValueError("step_in_backward=True does not work with a GradScaler when updates cannot be "
                                 "rolled back (parameters whose weights stream): the updates made during this "
                                 "backward used the scaled gradients and stand; load the last checkpoint into an "
                                 "optimizer with step_in_backward=False, or train in bf16 (no scaler)")
            late = [s.index for s in store.slots if s.trainable is None and s.param.requires_grad
                    and s.param.grad is not None]
            if late:
                raise RuntimeError(
                    f"step_in_backward=True: parameter(s) {late[:8]} were frozen when the optimizer was built and "
                    "now have gradients; their state cannot be placed while backward updates run. Build the "
                    "optimizer after unfreezing them, or use step_in_backward=False")
            grads = dict(self.grads)
            fresh = set(self.fresh)
            extra = [(s, g) for s, g in active if s.trainable not in self.prepared]
            sumsq = self.sumsq
            if not (bad or refused) and extra:  # gradients that reached step() without passing a hook (set by hand)
                with engine.telemetry.phase("grad_norm"):
                    for s, g in extra:
                        value = kernels.grad_sumsq(g)
                        if math.isfinite(value):
                            sumsq += value
                        else:
                            bad.append(s.index)
            if not (bad or refused):
                engine.counters.last_grad_norm = math.sqrt(sumsq)
                for s, g in extra:
                    if engine.prepare(s, g):
                        fresh.add(s.trainable)
                    grads[s.trainable] = g
            work = engine.work(lambda tier: grads, skip={sg.index for sg in self.done})
            executor = engine.host_executor(grads, fresh, 1.0)
            run_subgroups(work, store.tiers, lambda tier: executor, engine.telemetry)
            stepped = [store.by_trainable(t) for t in grads]
            engine.after_update(stepped)
        finally:
            self.close_cycle()
        self.plan_next()
        result = StepResult(stepped, fresh)
        if applied:
            result.error = RuntimeError(
                f"step_in_backward=True: the gradients of parameter(s) "
                f"{[store.by_trainable(t).index for t in applied][:8]} changed after backward handed them over "
                "(torch.nn.utils.clip_grad_norm_, scaler.unscale_, an in-place edit of param.grad) while their "
                "updates ran during backward with no copy to undo them: this step used the gradients as backward "
                "left them for the sub-groups updated then. From the next step on the updates during backward keep "
                "copies and roll back when the gradients change (exact, at the cost of a second update). To clip, "
                "pass max_grad_norm= to the optimizer (it clips inside the update), or use step_in_backward=False")
        if bad:
            engine.counters.skipped_steps += 1
            engine.telemetry.count("skipped_steps")
            result.error = FloatingPointError(
                f"non-finite gradient in parameter(s) {bad[:8]} (inf or nan) with step_in_backward=True: parameters "
                "whose gradients were handed over before it are updated, the others are untouched (this mode "
                "cannot skip a whole step; use step_in_backward=False for on_nonfinite='skip')")
        if refused:  # (refuse_sparse) worded as the non-finite case
            why = engine.parts.grads.sparse_refusal(next(s for s in store.slots if s.index == refused[0]))
            result.error = RuntimeError(f"{why} (parameter(s) {refused[:8]} have sparse gradients); with step_in_backward"
                                        "=True parameters handed over before it are updated, the others are untouched")
        return result

    def _changed_after_hooks(self, active: list) -> list[int]:
        """Trainable indices whose ``param.grad`` is not the tensor its hook saw, or was changed
        in place since (torch's version counter): what step() would read is not what backward
        handed over."""
        changed = []
        for s, _ in active:
            entry = self.versions.get(s.trainable)
            if entry is None:
                continue  # no hook took it (set by hand): step() reads it as it is
            if s.param.grad is None:
                continue  # released once applied (streamed weights), or dropped: nothing step() reads
            if not grad_mark.unchanged(entry, s.param.grad):
                changed.append(s.trainable)
        return changed

    def _finish_speculative(self, active: list, scaling: Scaling) -> "StepResult | None":
        """step() after speculative updates: they stand (the rest is updated here) or are rolled
        back, and then None tells the engine to run the plain step."""
        from .engine import StepResult  # noqa: PLC0415 - engine imports this module

        engine = self.engine
        store = engine.store
        self.known = True
        self.expected_passes = max(1, self.passes)
        sumsq = self._commits(active, scaling)
        if self.holding:
            self.hold_for -= 1
        if sumsq is None:
            if self.saved or self.prepared:
                self.rollback()
                # clipping active or the scale moving tends to last: the next steps take nothing
                # during backward (no copies, no rollback, the plain step's cost), then try again
                self.hold_for, self.hold_next = self.hold_next, min(_MAX_HOLD, 2 * self.hold_next)
            self.spec_scale = scaling.inv_scale if math.isfinite(scaling.inv_scale) else 1.0
            self.close_cycle()
            return None
        self.hold_next = 1
        try:
            scaling.report(True)
            engine.counters.last_grad_norm = math.sqrt(sumsq)
            grads = dict(self.grads)
            work = engine.work(lambda tier: grads, skip={sg.index for sg in self.done})
            executor = engine.host_executor(grads, set(self.fresh), self.spec_scale)
            run_subgroups(work, store.tiers, lambda tier: executor, engine.telemetry)
            stepped = [store.by_trainable(t) for t in grads]
            fresh = set(self.fresh)
            engine.after_update(stepped)
        finally:
            self.close_cycle()
        self.plan_next()
        return StepResult(stepped, fresh)

    def close_cycle(self) -> None:
        """The step consumed this backward's updates: remember their order, forget the rest."""
        if self.open:
            done = {sg.index for sg in self.done}
            self.expected_order = self.done + [sg for sg in self.expected_order if sg.index not in done]
        self.known = True
        self._reset()
        if not self.speculative:
            self.undo.clear()  # nothing of the next cycle will be rolled back

    def plan_next(self) -> None:
        """Tell the I/O tiers the order of the next backward, so their reads start now (during forward)."""
        store = self.engine.store
        for kind, tier in store.tiers.items():
            if tier.does_io:
                tier.schedule([sg for sg in self.expected_order if sg.tier is kind], keep_order=True)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self.stop_worker()

    def stop_worker(self, drop_queued: bool = False, timeout: float | None = None) -> None:
        """End the worker once it took what is queued (``drop_queued``: its running update only;
        see :mod:`.worker_exit`)."""
        if self._thread is not None and self._thread.is_alive():
            self.stopped = self.stopped or drop_queued  # _run skips every item it takes from then on
            self._queue.put(None)
            self._thread.join(timeout)


class _Lane:
    """Telemetry whose phases go to one trace lane (the worker thread's), as the loop books them."""

    def __init__(self, telemetry, lane: str) -> None:
        self._telemetry, self._lane = telemetry, lane

    def phase(self, name: str, lane: str | None = None):
        return self._telemetry.phase(name, lane=lane or self._lane)
