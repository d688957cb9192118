"""Executors: what updates a sub-group's state once the loop holds its views.

An executor takes a sub-group, the segments of it to update and the views its tier handed
out, starts the update and returns a :class:`Completion`. The loop releases the sub-group
once its completion is done, so an executor that finishes later than it returns (the
device tier's queued kernels; a GPU updating host-resident state: copy in, update, copy
out) fits the same loop as the host kernels, which are done when they return.

- :class:`HostExecutor`: the native kernels of the rule (:meth:`UpdateRule.update`), one
  fused pass per segment, in the calling thread (the kernels use the tierstate thread pool);
  a sub-group of many Adam segments in one native call (:meth:`HostExecutor.update_many`).
- :class:`DeviceExecutor`: the rule's device path (:meth:`UpdateRule.update_on_device`), one
  batched launch per parameter group of the sub-group, queued on the current stream.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Mapping, Protocol, Sequence

import torch
from torch import Tensor

from .. import kernels
from ..kernels.ops import GRAD_DTYPE_CODES, MOMENT_DTYPE_CODES, NO_OUT, OUT_DTYPE_CODES
from ..kernels.quant import master_value, param_seed
from ..placement import Segment, SubGroup
from ..rules import UpdateTask
from ..tiers import Slot, StateStore


class Completion(Protocol):
    def done(self) -> bool: ...

    def wait(self) -> None: ...


class Done:
    """The completion of work finished when it returned."""

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        pass


DONE = Done()


class EventCompletion:
    """Work queued on a CUDA stream: done when the event recorded after it has passed."""

    def __init__(self, event) -> None:
        self.event = event

    def done(self) -> bool:
        return self.event.query()

    def wait(self) -> None:
        self.event.synchronize()


def own_state(store: StateStore, s: Slot, views: Mapping[str, Tensor], lo: int, hi: int) -> dict[str, Tensor]:
    """``[lo, hi)`` of each view of ``s``'s own state keys (its group's: :meth:`StateStore.keys`).

    A sub-group's views hold every key some group has: with ``amsgrad=True`` in one group only,
    a parameter of another group must not be updated with a ``max_exp_avg_sq`` (until
    2026-12-07 it was, and its moments followed the running maximum, unlike torch's)."""
    own = store.keys(s)
    return {k: v[lo:hi] for k, v in views.items() if k in own and k != "master"}


class Executor(Protocol):
    def submit(self, sg: SubGroup, segments: Sequence[Segment], views: Mapping[str, Tensor]) -> Completion: ...


class HostExecutor:
    """Updates host-resident pieces with the native kernels.

    Args:
        grads: {trainable index: flat host gradient indexed like the parameter}; read when a
            segment is updated, so a caller may keep filling it (the in-backward driver does).
        fresh: trainable indices whose state started existing this step.
        weight_out: (slot, first, end, values) -> where the rounded low-precision weight goes, or None.
        deferring: () -> the context each update runs in, in which a streamed block whose write-back
            fails is kept and its error raised at the end of ``step()`` (WeightsOut.deferring_write_errors).
    """

    def __init__(self, store: StateStore, rule, groups: Callable[[], list], grads: dict[int, Tensor],
                 fresh: set[int], grad_scale: float, weight_out: Callable, telemetry, lane: str | None = None,
                 resident: Callable[[Slot], bool] | None = None, deferring: Callable | None = None) -> None:
        self.store, self.rule, self.groups = store, rule, groups
        self.grads, self.fresh, self.grad_scale = grads, fresh, grad_scale
        self.weight_out, self.telemetry, self.lane = weight_out, telemetry, lane
        self.resident = resident  # Slot -> its values are the parameter itself (None: never assumed)
        # () -> a context in which a streamed block's failed write-back waits for the end of step()
        self.deferring = deferring or contextlib.nullcontext

    def submit(self, sg: SubGroup, segments: Sequence[Segment], views: Mapping[str, Tensor]) -> Completion:
        with self.telemetry.phase("cpu_update", lane=self.lane), self.deferring():
            groups = self.groups()
            rest = self.update_many([(segments, views)], groups)[0] if len(segments) > 1 else segments
            for seg in rest:
                self._update(seg, views, groups)
        return DONE

    def submit_many(self, items: Sequence[tuple[SubGroup, Sequence[Segment], Mapping[str, Tensor]]]) -> Completion:
        """Update several in-memory sub-groups at once: every segment the batched kernel takes in
        one native call, then the others one by one. The loop takes this path where every
        sub-group of the step is in host memory (``Offload("cpu")``): between two native calls
        the Python of the loop and of the next call's arguments ran with the caches emptied by
        the update before it, 0.24 ms at 50M parameters in two sub-groups on the Zen 5 VM
        (2026-12-07), 1 % of that step."""
        with self.telemetry.phase("cpu_update", lane=self.lane), self.deferring():
            groups = self.groups()
            pieces = [(segments, views) for _, segments, views in items]
            for (segments, views), rest in zip(pieces, self.update_many(pieces, groups)):
                for seg in rest:
                    self._update(seg, views, groups)
        return DONE

    def update_many(self, pieces: Sequence[tuple[Sequence[Segment], Mapping[str, Tensor]]],
                    groups: list) -> list[Sequence[Segment]]:
        """Update the segments the batched kernel can take, of every (segments, views of their
        sub-group) piece, in one native call (:func:`tierstate.kernels.adam_update_many`); return
        each piece's others, for ``_update``.

        Per segment, ``_update`` slices every view, checks every tensor and calls the kernel:
        ~40 us a parameter on the Zen 4 VM, against ~2 us of kernel for 4,096 elements
        (``benchmarks/many_tensors.py``). Here a segment costs a few additions on addresses
        taken once per sub-group. Taken: the Adam rule on fp32/bf16 moments whose parameter
        needs no lending (weights not streamed, no master piece pending), with a CPU gradient
        the kernels read; the job is the call ``_update`` would make, bit for bit."""
        jobs: list[int] = []
        params: list[float] = []
        rows: dict[tuple[int, int], int] = {}
        rests = [self._jobs(segments, views, groups, jobs, params, rows) for segments, views in pieces]
        if jobs and not kernels.adam_update_many(jobs, params):
            return [segments for segments, _ in pieces]  # no native kernels: the reference, one segment at a time
        return rests

    def _jobs(self, segments: Sequence[Segment], views: Mapping[str, Tensor], groups: list, jobs: list[int],
              params: list[float], rows: dict) -> Sequence[Segment]:
        """Add to ``jobs`` (and ``params``, rows by (group, step)) the segments of one sub-group the
        batched kernel takes; return the others."""
        batch_params = getattr(self.rule, "batch_params", None)
        exp_avg, exp_avg_sq = views.get("exp_avg"), views.get("exp_avg_sq")
        if (batch_params is None or self.resident is None or self.store.quant is not None or exp_avg is None
                or exp_avg_sq is None or exp_avg.device.type != "cpu"
                or not all(v.dim() == 1 and v.is_contiguous() for v in views.values())):
            return segments
        moment_code = MOMENT_DTYPE_CODES.get(exp_avg.dtype)
        max_sq, master = views.get("max_exp_avg_sq"), views.get("master")
        if (moment_code is None or exp_avg_sq.dtype != exp_avg.dtype
                or (max_sq is not None and max_sq.dtype != exp_avg.dtype)
                or (master is not None and master.dtype != torch.float32)):
            return segments
        size = exp_avg.element_size()
        m0, v0 = exp_avg.data_ptr(), exp_avg_sq.data_ptr()
        x0 = max_sq.data_ptr() if max_sq is not None else 0
        w0 = master.data_ptr() if master is not None else 0
        rest = []
        by_trainable, all_grads, resident = self.store.by_trainable, self.grads, self.resident
        for seg in segments:  # (``is_cpu``: ``device.type`` costs 0.4 us, ~20 % of a segment here)
            s = by_trainable(seg.param_index)
            grad = all_grads[seg.param_index]
            grad_code = GRAD_DTYPE_CODES.get(grad.dtype)
            local = s.local
            if (s.pending_pieces or grad_code is None or not grad.is_cpu or grad.dim() != 1
                    or not grad.is_contiguous() or not resident(s)):
                rest.append(seg)
                continue
            lo, plo, n = seg.subgroup_offset, seg.param_offset, seg.numel
            out_ptr, out_code = 0, NO_OUT
            if s.needs_master:
                if master is None:
                    rest.append(seg)
                    continue
                weight = w0 + lo * 4
                out = self.weight_out(s, plo, plo + n, local.data.view(-1))
                if out is not None:
                    out_code = OUT_DTYPE_CODES.get(out.dtype)
                    if out_code is None or not out.is_cpu or not out.is_contiguous():
                        rest.append(seg)
                        continue
                    out_ptr = out.data_ptr()
            else:  # an fp32 parameter in host memory is its own master
                if local.dtype != torch.float32 or not local.is_cpu or not local.is_contiguous():
                    rest.append(seg)
                    continue
                weight = local.data_ptr() + plo * 4
            x = x0 + lo * size if x0 and "max_exp_avg_sq" in self.store.keys(s) else 0  # (see own_state)
            key = (s.group, s.step)
            row = rows.get(key)
            if row is None:
                row = rows[key] = len(rows)
                params += batch_params(groups[s.group], s.step, self.grad_scale)
            jobs += (weight, grad.data_ptr() + plo * grad.element_size(), m0 + lo * size, v0 + lo * size,
                     x, out_ptr, n, grad_code, moment_code, out_code, row)
        return rest

    def _update(self, seg: Segment, views: Mapping[str, Tensor], groups: list) -> None:
        if self.store.quant is not None:
            return self._update_q8(seg, views, groups)
        s = self.store.by_trainable(seg.param_index)
        lo, hi = seg.subgroup_offset, seg.subgroup_offset + seg.numel
        plo, phi = seg.param_offset, seg.param_offset + seg.numel
        # the parameter's values: its own storage, or its block's host image when its weights stream
        with self.store.values_of(s, True) as values:
            if s.pending_pieces:  # a master piece that waits for this update (see tierstate.tiers.slots)
                self.store.take_pending_master(s, seg, views["master"][lo:hi], values)
            state = own_state(self.store, s, views, lo, hi)
            if s.needs_master:
                weight, out = views["master"][lo:hi], self.weight_out(s, plo, phi, values)
            else:  # an fp32 parameter in host memory is its own master
                weight, out = values[plo:phi], None
            self.rule.update(weight=weight, grad=self.grads[seg.param_index][plo:phi], state=state, weight_out=out,
                             group=groups[s.group], step=s.step, first_step=seg.param_index in self.fresh,
                             grad_scale=self.grad_scale)


    def _update_q8(self, seg: Segment, views: Mapping[str, Tensor], groups: list) -> None:
        """Compressed state (``Offload(moment_dtype="q8")``): the fused 8-bit kernel on the
        segment's parts; a key stored per block (a scale) is sliced in blocks (the layout
        starts every segment on a block boundary)."""
        s = self.store.by_trainable(seg.param_index)
        quant = self.store.quant
        lo, hi = seg.subgroup_offset, seg.subgroup_offset + seg.numel
        plo, phi = seg.param_offset, seg.param_offset + seg.numel
        state = {}
        for k, v in views.items():
            u = self.store.unit(k)
            state[k] = v[lo // u: (hi + u - 1) // u]
        with self.store.values_of(s, True) as values:
            if s.pending_pieces:
                self.store.take_pending_master(s, seg, state["master"], values, state.get("master.comp"))
            if s.needs_master:
                out = self.weight_out(s, plo, phi, values)
            else:  # an fp32 parameter in host memory is its own fp32 master
                state["master"], out = values[plo:phi], None
            self.rule.update_q8(state=state, grad=self.grads[seg.param_index][plo:phi], weight_out=out,
                                group=groups[s.group], step=s.step, grad_scale=self.grad_scale, config=quant,
                                seed=param_seed(self.store.sr_seed, s.index), index_offset=plo)
            if s.needs_master and out is None and s.local.device.type == "cpu":
                # an fp32 host parameter under a 16-bit master takes the master's fp32 value
                values[plo:phi].copy_(master_value(quant, state))


class DeviceExecutor:
    """Updates pieces held on the compute device, in place, with the rule's device kernels.

    On CUDA ``submit`` returns once the kernels are queued on the current stream, so the
    host sub-groups run meanwhile; the next forward is queued behind them on that stream.
    """

    def __init__(self, store: StateStore, rule, groups: Callable[[], list], grads: dict[int, Tensor],
                 fresh: set[int], grad_scale: float, telemetry) -> None:
        self.store, self.rule, self.groups = store, rule, groups
        self.grads, self.fresh, self.grad_scale, self.telemetry = grads, fresh, grad_scale, telemetry

    def submit(self, sg: SubGroup, segments: Sequence[Segment], views: Mapping[str, Tensor]) -> Completion:
        tasks: dict[int, list[UpdateTask]] = {}
        device = None
        for seg in segments:
            s: Slot = self.store.by_trainable(seg.param_index)
            lo, hi = seg.subgroup_offset, seg.subgroup_offset + seg.numel
            plo, phi = seg.param_offset, seg.param_offset + seg.numel
            piece = s.local.data.view(-1)[plo:phi]  # (a complex parameter's real view: the tiers' elements)
            weight, weight_out = (views["master"][lo:hi], piece) if s.needs_master else (piece, None)
            state = own_state(self.store, s, views, lo, hi)
            tasks.setdefault(s.group, []).append(UpdateTask(
                weight, self.grads[seg.param_index][plo:phi], state, weight_out, s.step, seg.param_index in self.fresh))
            device = piece.device
        groups = self.groups()
        with self.telemetry.phase("device_update"):
            for group_index, group_tasks in tasks.items():
                self.rule.update_on_device(group_tasks, group=groups[group_index], grad_scale=self.grad_scale)
        if device is not None and device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            return EventCompletion(event)
        return DONE
