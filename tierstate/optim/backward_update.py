"""Updating optimizer state during backward: each sub-group as soon as its gradients are final.

Opt-in with ``step_in_backward=True`` on any tierstate optimizer.

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
Measured on the 2-core reference VM (GPT-2 124M, bf16 parameters, NVMe, two interleaved
runs of ``tierstate bench e2e``): 1.77 / 1.80 s per step on the backward thread against
1.89 / 1.97 s with a worker thread (which already ran its kernels on one thread of two),
peak RSS 2.56 against 2.76-2.82 GiB.

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
import weakref
from collections import deque
from typing import TYPE_CHECKING

from torch import Tensor

from .. import kernels
from ..placement import SubGroup, TierKind

if TYPE_CHECKING:
    from .base import OffloadOptimizer, _Slot

_LANE = "backward-update"


class BackwardUpdater:
    """Hooks every trainable parameter and updates sub-groups as they become ready.

    Where the updates run is said in [Note: updates on the backward thread]. Either way the
    tiers never see two threads at once: with the worker, all tier access while a backward
    pass is open happens on it, and ``step()`` calls :meth:`finish` (which waits for the
    worker) before it touches the tiers itself.
    """

    def __init__(self, opt: "OffloadOptimizer") -> None:
        # A weak reference: the hooks on the parameters keep this object alive, and must not
        # keep the optimizer (its host arenas, its NVMe files) alive past the user's last use.
        self._opt = weakref.ref(opt)
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None  # the worker, started at its first use
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in opt._trainable]
        # The order sub-groups became ready in during the last backward (then the leftovers
        # step() updated): the NVMe tier's plan for the next one. Before the first backward,
        # the reverse of the parameters' order, which is how backward usually meets them.
        self.expected_order: list[SubGroup] = list(reversed(opt.layout.subgroups))
        # See [Note: updates on the backward thread]; tests set it to run the worker on CPU.
        self.inline = opt.device.type == "cpu"
        self._reset()

    @property
    def opt(self) -> "OffloadOptimizer":
        opt = self._opt()
        if opt is None:
            raise RuntimeError("the optimizer of this step_in_backward hook was garbage-collected")
        return opt

    # -- one backward pass ---------------------------------------------------------------------
    def _reset(self) -> None:
        self.open = False
        self.pending: dict[int, int] = {}  # sub-group -> hooked parameters still to deliver
        self.seen: set[int] = set()  # trainable indices whose gradient arrived
        self.grads: dict[int, Tensor] = {}  # trainable index -> flat host gradient
        self.prepared: set[int] = set()  # slots whose step count and state were set up
        self.fresh: set[int] = set()  # slots whose state started existing this step
        self.done: list[SubGroup] = []  # sub-groups updated by the worker, in order
        self.nonfinite: list[int] = []  # param indices (torch numbering) with inf/nan
        self.error: BaseException | None = None
        self.stopped = False  # set by the worker at the first non-finite gradient or error
        self.sumsq = 0.0  # squared norm of the gradients the worker took (for last_grad_norm)
        self.waiting: deque[SubGroup] = deque()  # inline: ready sub-groups whose record is still on its way

    def _begin(self) -> None:
        """First gradient of a backward pass: count, per sub-group, the parameters to wait for."""
        opt = self.opt
        self.open = True
        self.pending = {}
        nvme = opt.tiers.get(TierKind.NVME)
        lost = nvme.lost_error() if nvme is not None else None
        if lost is not None:  # update nothing: step() raises it with the state as before this backward
            self.error, self.stopped = lost, True
        for t, p in enumerate(opt._trainable):
            if not p.requires_grad:
                continue
            for seg in opt.layout.segments_of(t):
                self.pending[seg.subgroup] = self.pending.get(seg.subgroup, 0) + 1

    def _on_grad(self, param: Tensor) -> None:
        opt = self._opt()
        if opt is None:  # collected without close(); its finalizer removes these hooks
            return
        s = opt._slot_of.get(id(param))
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
        if opt._grads is not None and s.trainable in opt._stream_index:
            # CUDA gradient stream: send this gradient now instead of when its bucket fills;
            # the worker waits for the copy before it reads the host buffer.
            landed = opt._grads.flush_now()
            grad = opt._grads.host[opt._stream_index[s.trainable]]
        else:
            grad = opt._host_grad(s)
            if grad is None:
                return
        ready = []
        for seg in opt.layout.segments_of(s.trainable):
            left = self.pending.get(seg.subgroup, 0) - 1
            self.pending[seg.subgroup] = left
            if left == 0:
                ready.append(opt.layout.subgroups[seg.subgroup])
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

    def _handle(self, s: "_Slot", grad: Tensor, ready: list[SubGroup], landed) -> None:
        if self._take(s, grad, landed):
            for sg in ready:
                self._update(sg)

    def _take(self, s: "_Slot", grad: Tensor, landed) -> bool:
        """Check one parameter's gradient and set up its state; False (and stop) if it is not finite."""
        opt = self.opt
        if landed is not None:
            landed.synchronize()
        if opt._upload_done is not None:
            # CUDA: the previous step's weight upload reads the staging buffers the kernels
            # are about to overwrite (forward on the device may not even have started yet)
            opt._upload_done.synchronize()
        sumsq = kernels.grad_sumsq(grad)
        if not math.isfinite(sumsq):
            self.nonfinite.append(s.index)
            self.stopped = True
            return False
        self.sumsq += sumsq
        self.grads[s.trainable] = grad
        if opt._prepare_slot(s, grad):
            self.fresh.add(s.trainable)
        self.prepared.add(s.trainable)
        return True

    def _update(self, sg: SubGroup) -> None:
        """Update one sub-group whose gradients are all final."""
        opt = self.opt
        tel = opt.telemetry
        lane = None if self.inline else _LANE
        tier = opt.tiers[sg.tier]
        segs = [seg for seg in sg.segments if seg.param_index in self.grads]
        if sg.tier is TierKind.NVME:
            with tel.phase("nvme_wait", lane=lane):
                views = tier.acquire(sg)
        else:
            views = tier.acquire(sg)
        try:
            with tel.phase("cpu_update", lane=lane):
                for seg in segs:
                    opt._update_segment(seg, views, self.grads[seg.param_index],
                                        first_step=seg.param_index in self.fresh, grad_scale=1.0)
        finally:
            tier.release(sg, dirty=True)
        self.done.append(sg)

    def _update_waiting(self, block: bool) -> None:
        """Inline mode: update the ready sub-groups in order, up to the first whose NVMe record
        has not landed yet (all of them with ``block``)."""
        opt = self.opt
        while self.waiting and not self.stopped:
            sg = self.waiting[0]
            if not block and sg.tier is TierKind.NVME and not opt.tiers[sg.tier].ready(sg):
                return
            self.waiting.popleft()
            self._update(sg)

    # -- the step's side -----------------------------------------------------------------------
    def finish(self) -> None:
        """Wait until every gradient delivered so far is handled (by the worker, or here for the
        sub-groups left waiting for their NVMe records); raise the first error."""
        if not self.open:
            return
        if self.inline:
            try:
                self._update_waiting(block=True)
            except BaseException as exc:  # noqa: BLE001 - raised below, as the worker's are
                self.error = exc
                self.stopped = True
        else:
            with self.opt.telemetry.phase("backward_wait"):
                self._queue.join()
        if self.error is not None:
            error, self.error = self.error, None
            self.close_cycle()
            raise error

    def close_cycle(self) -> None:
        """The step consumed this backward's updates: remember their order, forget the rest."""
        if self.open:
            done = {sg.index for sg in self.done}
            self.expected_order = self.done + [sg for sg in self.expected_order if sg.index not in done]
        self._reset()

    def plan_next(self) -> None:
        """Tell the NVMe tier the order of the next backward, so its I/O starts now (during forward)."""
        nvme = self.opt.tiers.get(TierKind.NVME)
        if nvme is not None:
            mine = [sg for sg in self.expected_order if sg.tier is TierKind.NVME]
            nvme.schedule(mine, keep_order=True)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
