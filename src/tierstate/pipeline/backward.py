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

[Note: what this mode cannot do]
An update made during backward cannot wait for the whole gradient, so:
- no gradient clipping (``max_grad_norm``) and no ``GradScaler``: both need every
  gradient before the first update (refused at construction / at ``step()``);
- no gradient accumulation: every ``backward()`` must be followed by ``step()``; a second
  gradient for a parameter already handed over raises ``RuntimeError`` from backward;
- a non-finite gradient cannot skip the whole step: each gradient is checked when it is
  handed over and the updates stop at the first non-finite one; sub-groups updated
  before stay updated, the rest stay untouched, and ``step()`` raises
  ``FloatingPointError`` naming the parameters.
- an NVMe write that fails is raised at the end of ``step()``, the record kept in RAM
  and written when next evicted (a step cannot refuse to start: its updates ran during
  backward); once a record is found lost (``StateLostError``) every later backward
  updates nothing and ``step()`` raises it, until a checkpoint is loaded.
The mode is off by default for these reasons; it is exact (bit for bit the same state as
the plain step) whenever its conditions hold.
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
from .decision import Scaling
from .loop import run_subgroups, update_planned

if TYPE_CHECKING:
    from .engine import StepEngine, StepResult

_LANE = "backward-update"


class BackwardDriver:
    """Hooks every trainable parameter and updates sub-groups as they become ready.

    Where the updates run is said in [Note: updates on the backward thread]. Either way the
    tiers never see two threads at once: with the worker, all tier access while a backward
    pass is open happens on it, and ``step()`` calls :meth:`finish` (which waits for the
    worker) before it touches the tiers itself.
    """

    def __init__(self, engine: "StepEngine") -> None:
        self.engine = engine
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None  # the worker, started at its first use
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in engine.parts.trainable]
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
        self.error: BaseException | None = None
        self.stopped = False  # set at the first non-finite gradient or error
        self.sumsq = 0.0  # squared norm of the gradients taken (for last_grad_norm)
        self.waiting: deque[SubGroup] = deque()  # inline: ready sub-groups whose record is still on its way
        # streamed parameters (tierstate.weights) -> their sub-groups not yet updated; at 0 the
        # gradient has been applied and is released (see [Note: gradients of streamed weights])
        self.segments_left: dict[int, int] = {}
        self.executor = self.engine.host_executor(self.grads, self.fresh, 1.0)

    def _begin(self) -> None:
        """First gradient of a backward pass: count, per sub-group, the parameters to wait for."""
        engine = self.engine
        self.open = True
        self.pending = {}
        lost = engine.store.lost_error()
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
            raise RuntimeError(
                f"step_in_backward=True: parameter {s.index} received a second gradient before step(); "
                "this mode updates the state during backward, so every backward() must be followed by "
                "step() (no gradient accumulation, no double backward). Construct the optimizer with "
                "step_in_backward=False to accumulate gradients")
        self.seen.add(s.trainable)
        landed = None
        grads = engine.parts.grads
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
        # the I/O tiers read ahead along plan_next()'s order: this sub-group is part of that plan
        update_planned(store.tier_of(sg), sg, segs, self.executor, telemetry)
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
        not landed yet (all of them with ``block``)."""
        store = self.engine.store
        while self.waiting and not self.stopped:
            sg = self.waiting[0]
            tier = store.tier_of(sg)
            if not block and tier.does_io and not tier.ready(sg):
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
            self.close_cycle()
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
        bad = list(self.nonfinite)
        try:
            if scaling.scaled:
                raise ValueError("step_in_backward=True does not work with a GradScaler: unscaling and the inf "
                                 "check need every gradient before the first update; use bf16 (no scaler) or "
                                 "step_in_backward=False")
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
            if not bad and extra:  # gradients that reached step() without passing a hook (set by hand)
                with engine.telemetry.phase("grad_norm"):
                    for s, g in extra:
                        value = kernels.grad_sumsq(g)
                        if math.isfinite(value):
                            sumsq += value
                        else:
                            bad.append(s.index)
            if not bad:
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
        if bad:
            engine.counters.skipped_steps += 1
            engine.telemetry.count("skipped_steps")
            result.error = FloatingPointError(
                f"non-finite gradient in parameter(s) {bad[:8]} (inf or nan) with step_in_backward=True: parameters "
                "whose gradients were handed over before it are updated, the others are untouched (this mode "
                "cannot skip a whole step; use step_in_backward=False for on_nonfinite='skip')")
        return result

    def close_cycle(self) -> None:
        """The step consumed this backward's updates: remember their order, forget the rest."""
        if self.open:
            done = {sg.index for sg in self.done}
            self.expected_order = self.done + [sg for sg in self.expected_order if sg.index not in done]
        self._reset()

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
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()


class _Lane:
    """Telemetry whose phases go to one trace lane (the worker thread's), as the loop books them."""

    def __init__(self, telemetry, lane: str) -> None:
        self._telemetry, self._lane = telemetry, lane

    def phase(self, name: str, lane: str | None = None):
        return self._telemetry.phase(name, lane=lane or self._lane)
