"""StepEngine: one optimizer step, from gradients in to weights out.

    gradients in (grads.py) -> norm and non-finite decision (decision.py) -> state made ready
    (the store) -> the sub-group loop (loop.py), each sub-group updated by the executor of its
    tier (executors.py) -> weights out (weights.py)

``OffloadOptimizer.step()`` runs :meth:`StepEngine.step`; with ``step_in_backward`` the
driver in :mod:`.backward` runs the same loop and executors during backward and
:meth:`StepEngine.step` finishes what is left. The engine is built from the optimizer's
parameter groups, its rule and its policy (:mod:`.assembly`), and rebuilt when those
change (a group added, parameters replaced, a load needing other state keys).
"""
from __future__ import annotations

import logging
import operator
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from ..placement import Offload
from ..tiers import Slot, StateLife, fused_group
from ..weights import generation as weights_generation
from ..weights import streamed as weights_of
from .assembly import Parts, assemble
from .decision import Decision, Scaling, Verdict, decide
from .executors import DeviceExecutor, HostExecutor
from .loop import run_subgroups
from .user_writes import OnDemandCopies, ParamMarks, follow_values

_log = logging.getLogger("tierstate")


@dataclass(frozen=True)
class StepPolicy:
    """How a step treats its gradients (validated by the optimizer's constructor)."""

    max_grad_norm: float | None = None
    on_nonfinite: str = "skip"  # or "raise"
    step_in_backward: bool = False
    # the process group over which the optimizer's (whole) parameters are partitioned, one part
    # per rank (ZeroRedundancyOptimizer): the norm and the non-finite decision sum over it
    partition_group: object = None


@dataclass
class StepCounters:
    """What the optimizer reports across steps (and a checkpoint keeps)."""

    steps_taken: int = 0  # step() calls, for telemetry's step index
    skipped_steps: int = 0
    last_grad_norm: float | None = None
    rollbacks: int = 0  # step_in_backward: speculative updates rolled back (pipeline.backward)


@dataclass
class StepResult:
    """The slots a step updated (their state and step count changed) and which of them got state."""

    stepped: list[Slot] = field(default_factory=list)
    fresh: set[int] = field(default_factory=set)  # trainable indices whose state started existing
    rebuilt: bool = False  # the engine was rebuilt first: every slot's host views changed
    error: BaseException | None = None  # to raise once the stepped state is published


class StepEngine:
    """The step of one optimizer over its tiers.

    Args:
        owner: the object whose ``param_groups`` the engine steps (held weakly: hooks on the
            parameters keep the engine alive, and must not keep the optimizer alive).
        rule: the update rule (:mod:`tierstate.rules`).
    """

    def __init__(self, owner, rule, offload: Offload, policy: StepPolicy, telemetry,
                 counters: StepCounters | None = None) -> None:
        self._owner = weakref.ref(owner)
        self.rule, self.offload, self.policy, self.telemetry = rule, offload, policy, telemetry
        self.counters = counters if counters is not None else StepCounters()
        self.backward = None
        self.parts: Parts | None = None
        self._held_back: set[Tensor] = set()  # placed as frozen for one re-placement (adopt_new_trainables)
        self._unplaced: dict | None = None  # the state of a refused placement (place_again)
        self.closed = False
        self.marks = ParamMarks()  # what the parameters were after we last wrote them (user_writes.py)
        self.copies = OnDemandCopies()  # state read on demand, written back if the user writes it
        # the owner's own check before a step updates anything (optim/base.py: state entries dropped)
        self.before_update: Callable[[], None] = lambda: None
        self._assemble()

    def groups(self) -> list[dict]:
        owner = self._owner()
        return owner.param_groups if owner is not None else []

    def _start_state(self, s: Slot) -> None:
        groups = self.groups()
        self.store.start_state(s, fused=s.group < len(groups) and fused_group(groups[s.group]))

    # -- assembly ----------------------------------------------------------------------------
    def _assemble(self) -> None:
        self.parts = assemble(self.groups, self.rule, self.offload, self.policy.step_in_backward, self.telemetry,
                              held_back=frozenset(self._held_back))
        if self.rule.eager_state:
            for s in self.store.slots:
                if s.trainable is not None:
                    self._start_state(s)
        if self.policy.step_in_backward and self.parts.trainable:
            from .backward import BackwardDriver  # noqa: PLC0415 - only this mode needs it

            self.backward = BackwardDriver(self)
            self.backward.plan_next()
        self.mark_params()

    @property
    def store(self):
        return self.parts.store

    @property
    def device(self) -> torch.device:
        return self.parts.device

    def rebuild(self, undo: Callable[[], None] | None = None) -> None:
        """Assemble anew over the current parameter groups, carrying every existing state.

        ``undo``: reverts the caller's change to the groups (a group just added). When the new
        placement is refused (a group the tiers cannot hold: a complex parameter beside 8-bit
        state), it runs, the state is placed again over the groups as they were and the
        refusal is raised: the optimizer is left as it was. Without one, the state waits to be
        placed over the groups as the next step or state access finds them."""
        if self._unplaced is not None:  # a refused placement's state, not placed since
            saved = self._unplaced
        else:
            store = self.store
            # host views of the old arenas where they exist: they keep those arenas alive until placed
            saved = {s.param: (store.export(s, self.rule.has_step), s.master.filled)
                     for s in store.slots if s.has_state}
        self._close_parts()
        self._place(saved, undo)

    def _place(self, saved: dict, undo: Callable[[], None] | None = None) -> None:
        """Assemble and put ``saved`` back; on a refusal, ``undo`` and place again, or (no undo:
        parameters replaced by hand, weights that started streaming) keep ``saved`` for
        :meth:`place_again`, which the next step or state access runs."""
        try:
            self._assemble()
        except BaseException:
            if undo is None:
                self._unplaced = saved
                raise
            undo()
            self._assemble()
            self._unplaced = None
            self._import(saved)
            raise
        self._unplaced = None
        self._import(saved)

    def place_again(self) -> None:
        """After a refused placement without an undo: place the state over the groups as they
        are now (the refusal again while they still cannot be placed)."""
        if self._unplaced is not None:
            self._place(self._unplaced)

    def _import(self, saved: dict) -> None:
        for s in self.store.slots:
            if s.param in saved:
                state, master_filled = saved[s.param]
                self.store.import_(s, state, master_filled=master_filled)

    def _close_parts(self) -> None:
        if self.backward is not None:
            self.backward.close()
            self.backward = None
        if self.parts is not None and self._unplaced is None:  # (closed already while unplaced)
            self.parts.close()

    def close(self) -> None:
        """Release host buffers, files and hooks; any later use of the state is refused."""
        self._close_parts()
        self.closed = True

    def check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this optimizer was closed: close() released its buffers, files and hooks, and "
                               "its state with them. build a new optimizer (a state_dict() or checkpoint taken "
                               "before close() loads into it)")

    def follow_user_writes(self) -> None:
        """Before a step updates anything: refuse parameters whose shape or dtype changed, make
        masters follow the values written into their parameters (see [Note: weights changed
        between steps]), write back the state copies written since they were read, and let the
        owner take the state entries torch code dropped or replaced."""
        changed = self.marks.changed(self.store.slots, self.store.layout.param_numels, self.device)
        if changed:
            follow_values(self.store, changed)
        self.copies.write_back(self.store)
        self.before_update()

    def user_writes_refused(self) -> RuntimeError | None:
        """:meth:`follow_user_writes` where it cannot raise (in a backward hook): its refusal."""
        try:
            self.follow_user_writes()
        except RuntimeError as refused:
            return refused
        return None

    def mark_params(self) -> None:
        """The parameters as tierstate last wrote them (after a placement and after each step)."""
        self.marks.record(self.store.slots, self.parts.weights.streamed)

    # -- outside a step ------------------------------------------------------------------------
    @property
    def backward_open(self) -> bool:
        return self.backward is not None and self.backward.open

    def before_state_access(self) -> bool:
        """Before reading or writing state outside ``step()``: let the updates ``step_in_backward``
        runs during backward land first (its driver owns the tiers until then; the step stays
        open for ``step()`` to finish), write the master pieces still pending, and follow
        parameters that FSDP2 replaced. True if the engine was rebuilt."""
        self.check_open()
        self.place_again()
        if self.backward_open:
            self.backward.finish()
        self.store.write_pending_masters()
        self.copies.write_back(self.store)
        return self.follow_replaced_params()

    def follow_replaced_params(self) -> bool:
        """Re-place the state when ``param_groups`` now holds other parameter objects.

        Accelerate's FSDP2 preparation builds the optimizer over the full parameters and then
        swaps them in ``param_groups`` for the sharded DTensors ``fully_shard`` made (HF Trainer
        does this for ``optimizer_cls_and_kwargs``). Before the first step there is no state to
        carry, so the engine is simply built again over the new parameters; after it, the state
        of a replaced parameter would have no owner, so that is refused.
        """
        params = [p for g in self.groups() for p in g["params"]]
        slots = self.store.slots
        if self.parts.weights_generation != weights_generation():
            # some weights started or stopped streaming; if ours did (ts.offload_weights after the
            # optimizer was built), the same parameters' values now live elsewhere: re-assemble
            streamed = self.parts.weights.streamed
            if any((weights_of(p) is not None) != (t in streamed) for t, p in enumerate(self.parts.trainable)):
                self.rebuild()
                return True
            self.parts.weights_generation = weights_generation()
        if len(params) == len(slots) and all(map(operator.is_, params, self.store.params)):
            return False
        current = set(params)  # tensors hash by identity
        lost = [s.index for s in slots if s.has_state and s.param not in current]
        if lost:
            raise RuntimeError(
                f"param_groups no longer hold parameter(s) {lost[:8]} of this optimizer, which have state; "
                "parameters may be replaced (e.g. by FSDP2 wrapping) only before the first step. Wrap the "
                "model first, or save the optimizer state and load it into one built over the new parameters")
        self.rebuild()
        return True

    def adopt_new_trainables(self) -> bool:
        """A parameter frozen at construction that now has a gradient gets a place in the tiers
        (whatever its ``requires_grad``: torch steps any tensor whose ``.grad`` is set)."""
        new = [s.param for s in self.store.slots if s.trainable is None and s.param.grad is not None]
        if not new:
            return False
        pending = self.parts.grads.carry_over()  # gradients already streamed survive the re-placement
        try:  # refused (a complex parameter under 8-bit state): placed as before, still frozen
            self.rebuild(undo=lambda: self._held_back.update(new))
        finally:
            self._held_back.clear()
            self.parts.grads.take_over(self.store.slots, pending)
        return True

    def reset_grads(self, set_to_none: bool) -> None:
        if self._unplaced is None:  # (unplaced: no gradient stream to reset; the groups' grads are torch's)
            self.parts.grads.reset(set_to_none)

    # -- the step ------------------------------------------------------------------------------
    def prepare(self, s: Slot, grad: Tensor | None, traffic: HostTraffic | None = None) -> bool:
        """Make a parameter ready for its update (state, master, step count); True if its state is new.

        ``grad``: the part of its gradient the host kernels read (None: it is wholly on the device).
        ``traffic``: where to add the bytes the update will move (booked by the caller once for
        many parameters); without it they go to the telemetry at once.
        """
        fresh = not s.has_state
        if fresh:
            self._start_state(s)
        self.store.fill_master(s)
        s.life = StateLife.LIVE
        s.step += 1
        if grad is not None:
            book = traffic if traffic is not None else HostTraffic()
            book.add(self._kernel_traffic(s, grad, book.per_element))
            if traffic is None:
                book.report(self.telemetry)
        return fresh

    def host_executor(self, grads: dict, fresh: set, grad_scale: float, lane: str | None = None) -> HostExecutor:
        weights = self.parts.weights
        return HostExecutor(self.store, self.rule, self.groups, grads, fresh, grad_scale, weights.out_view,
                            self.telemetry, lane=lane, resident=weights.resident,
                            deferring=weights.deferring_write_errors if weights.streamed else None)

    def work(self, grads_by_place, skip: set[int] = frozenset()) -> list[tuple]:
        """(sub-group, its segments with a gradient) for every sub-group not in ``skip``, in layout
        order. ``grads_by_place(tier)``: the gradients that tier's executor reads."""
        out = []
        for sg in self.store.layout.subgroups:
            if sg.index in skip:
                continue
            have = grads_by_place(self.store.tier_of(sg))
            segs = [seg for seg in sg.segments if seg.param_index in have]
            if segs:
                out.append((sg, segs))
        return out

    def step(self, scaling: Scaling) -> StepResult:
        """One step over every parameter with a gradient (see ``OffloadOptimizer.step`` for what a
        failure leaves). Raises the I/O errors of the tiers; a write that failed during the step
        is left for the caller to collect (``store.take_write_errors()``)."""
        result = self._step(scaling)
        # The kernels write the parameters through a pointer: bump their version counters as
        # torch's in-place update would, so autograd refuses a graph that saved the old weights
        # (a step between forward and backward) instead of computing wrong gradients from the new.
        streamed = self.parts.weights.streamed
        written = [s.local for s in result.stepped if s.trainable not in streamed]
        if written:
            torch.autograd.graph.increment_version(written)
        # the parameters as this step left them (a failed step keeps the earlier marks: the next
        # one then compares values it wrote itself, which changes nothing)
        self.mark_params()
        self.copies.let_go()  # copies read before this step no longer show the state
        return result

    def _step(self, scaling: Scaling) -> StepResult:
        self.place_again()  # (a closed engine was refused by OffloadOptimizer.step, before the closure)
        tel, store = self.telemetry, self.store
        backward_open = self.backward_open
        if not backward_open:
            self.parts.grads.check_sparse(store.slots)  # a sparse gradient refused: nothing changed yet
            store.settle()  # earlier failed writes retried, or raise with nothing changed yet
            self.follow_user_writes()  # a changed shape refused: nothing changed yet
        self.counters.steps_taken += 1
        self.parts.weights.wait_upload(tel)  # the staging buffers are about to be rewritten
        self.parts.grads.wait()
        rebuilt = refused = False
        if backward_open:
            self.backward.finish()
            self.copies.write_back(store)  # state read and written after the backward updates
            try:
                refused = self.backward.refuse_sparse()
            except RuntimeError:
                self.counters.steps_taken -= 1  # no step was taken
                raise
        else:
            rebuilt = self.follow_replaced_params()
            rebuilt = self.adopt_new_trainables() or rebuilt
            store = self.store
        grads = self.parts.grads
        # with a refused sparse gradient, finish_step completes what backward took and raises the refusal
        skip = set(self.backward.refused) if refused else set()
        active = [(s, g) for s in store.slots if s.trainable is not None and s.index not in skip
                  and (g := grads.grad_of(s)) is not None]
        if backward_open:
            result = self.backward.finish_step(active, scaling)
            if result is not None:
                result.rebuilt = rebuilt
                return result
            # the speculative updates were rolled back: the plain step, then the next backward's plan
            try:
                return self._plain(active, scaling, rebuilt)
            finally:
                self.backward.plan_next()
        return self._plain(active, scaling, rebuilt)

    def _plain(self, active: list, scaling: Scaling, rebuilt: bool) -> StepResult:
        tel, store, grads = self.telemetry, self.store, self.parts.grads
        host_grads, device_grads = grads.split(active)
        shard_groups = self.parts.shard_groups
        if self.policy.partition_group is not None:  # every parameter here is this rank's part of the whole
            shard_groups = [((), [self.policy.partition_group])]
        decision = decide(active, host_grads, device_grads, self.parts.heads, scaling, shard_groups,
                          self.policy.max_grad_norm, self.device, tel, hook_sumsq=grads.hook_sumsq)
        grads.step_taken()
        if decision.verdict is Verdict.SKIP:
            self._skip(decision, active, scaling)
            return StepResult(rebuilt=rebuilt)
        if decision.verdict is Verdict.RUN:
            self.counters.last_grad_norm = decision.norm
            if decision.sumsq == 0.0 and not any(s.has_state for s in store.slots) and all(
                    float(g["lr"]) == 0.0 and self.rule.zero_step_is_noop(g) for g in self.groups()):
                # torch.distributed.checkpoint's _init_optim_state: a step with zero gradients and
                # lr 0 only to make state exist. Its outcome is known (state at init, step 1), so
                # no sub-group is streamed through the tiers for it.
                for s, _ in active:
                    self._start_state(s)
                    s.step = 1
                return StepResult([s for s, _ in active], {s.trainable for s, _ in active}, rebuilt)
        result = self._run(active, host_grads, device_grads, decision)
        result.rebuilt = rebuilt
        return result

    def _skip(self, decision: Decision, active: list, scaling: Scaling) -> None:
        if self.policy.on_nonfinite == "raise" and not scaling.scaled:  # a scaler decides when there is one
            bad = [s.index for s, g in active if not bool(torch.isfinite(g).all())]
            raise FloatingPointError(f"non-finite gradient in parameter(s) {bad[:8]} (inf or nan); pass "
                                     "on_nonfinite='skip' to skip such steps, or use torch.amp.GradScaler")
        self.counters.skipped_steps += 1
        self.telemetry.count("skipped_steps")
        if scaling.scaled:
            return  # GradScaler lowers its scale in update(); nothing to say
        _log.warning("tierstate: step skipped (%s); all optimizer state left untouched (%d skipped so far)",
                     f"non-finite gradient, total squared norm {decision.sumsq}", self.counters.skipped_steps)

    def _run(self, active: list, host_grads: dict, device_grads: dict, decision: Decision) -> StepResult:
        grads: dict[int, Tensor] = {}
        fresh: set[int] = set()
        traffic = HostTraffic()
        for s, g in active:
            host = host_grads.get(s.trainable)
            # the part the host kernels read (a slice only where the device tier holds the head:
            # a view costs ~0.7 us a parameter)
            part = None if host is None else host[0] if host[1] == 0 else host[0][host[1]:]
            if self.prepare(s, part, traffic):
                fresh.add(s.trainable)
            if host is not None:
                grads[s.trainable] = host[0]
        traffic.report(self.telemetry)
        host_exec = self.host_executor(grads, fresh, decision.grad_scale)
        device_exec = DeviceExecutor(self.store, self.rule, self.groups, device_grads, fresh,
                                     decision.device_grad_scale, self.telemetry) if device_grads else None
        work = self.work(lambda tier: device_grads if tier.on_device else grads)
        run_subgroups(work, self.store.tiers, lambda tier: device_exec if tier.on_device else host_exec,
                      self.telemetry)
        stepped = [s for s, _ in active]
        self.after_update(stepped)
        return StepResult(stepped, fresh)

    def after_update(self, stepped: list[Slot]) -> None:
        """Upload the stepped parameters' weights (CUDA) and set the gauges."""
        tel = self.telemetry
        self.parts.weights.upload(stepped, tel)
        if self.parts.weights.streamed:
            self.parts.weights.report_streaming(tel)
        for tier_name, nbytes in self.tier_bytes().items():
            tel.set_gauge(f"tier_bytes/{tier_name}", nbytes)
        for name, value in self.store.nvme_gauges().items():  # StepStats.nvme_bytes_per_param
            tel.set_gauge(name, value)
        if self.device.type == "cuda":
            tel.set_gauge("pinned_bytes", self.pinned_bytes())
            tel.set_gauge("device_mem", torch.cuda.memory_allocated(self.device))

    # -- accounting ----------------------------------------------------------------------------
    def tier_bytes(self) -> dict:
        out = self.store.nbytes_by_tier()
        if self.parts.grads.stream is not None:
            out["host_grads"] = self.parts.grads.nbytes
        return out

    def pinned_bytes(self) -> int:
        """Page-locked host memory held (arenas, gradient arena, staging, I/O pools)."""
        return self.store.pinned_nbytes + self.parts.grads.pinned_nbytes + self.parts.weights.pinned_nbytes

    def _kernel_traffic(self, s: Slot, grad: Tensor, per_element: dict | None = None) -> tuple[int, int]:
        """Host-memory bytes the update of (the host part of) one parameter reads and writes (one
        fused pass). ``per_element``: the bytes per element already worked out in this step, by
        (group, needs_master, gradient dtype, parameter dtype), which is all they depend on while
        a step runs (looked up once: ~2 us a parameter otherwise)."""
        key = (s.group, s.needs_master, grad.dtype, s.param.dtype)
        rates = per_element.get(key) if per_element is not None else None
        if rates is None:
            state, master = self.store.bytes_per_element(s)  # a block's scale counts 4 / block
            # the stored master, or the parameter itself (its own master; a bf16 one keeps its compensation)
            weight = master if s.needs_master else s.local.element_size() + master
            out = s.local.element_size() if s.needs_master and s.param.dtype != torch.float32 else 0
            rates = (grad.element_size() + state + weight, state + weight + out)
            if per_element is not None:
                per_element[key] = rates
        n = grad.numel()
        return round(n * rates[0]), round(n * rates[1])


class HostTraffic:
    """The host-memory bytes of a step's updates, added up and booked once (``prepare``)."""

    def __init__(self) -> None:
        self.read = self.written = 0
        self.updates = 0
        self.per_element: dict = {}  # see StepEngine._kernel_traffic

    def add(self, read_written: tuple[int, int]) -> None:
        self.read += read_written[0]
        self.written += read_written[1]
        self.updates += 1

    def report(self, telemetry) -> None:
        if self.updates:  # no host update: nothing booked, as before there were any
            telemetry.add_bytes("host", "read", self.read)
            telemetry.add_bytes("host", "write", self.written)


__all__ = ["HostTraffic", "StepCounters", "StepEngine", "StepPolicy", "StepResult"]
