"""Gradients to host memory as backward produces them.

A ``register_post_accumulate_grad_hook`` on every trainable parameter hands its finished
gradient to :class:`GradStream`, which copies it into a host buffer and (by default) drops
``param.grad`` so the device memory is released during backward, not after it.

On CUDA the copies are batched into buckets of ``bucket_bytes`` and issued on a side
stream after an event recorded on the compute stream, so they overlap the rest of
backward; ``record_stream`` keeps each gradient's memory alive until its copy has run.
On the CPU (no accelerator) the copy is a plain host copy; the mode exists so that the
streaming logic (accumulation, release, waiting) is exercised on any machine.

Accumulation over micro-batches: the first gradient of a parameter after ``reset`` is
copied into its host buffer; later ones are added to it (on CUDA through a pinned scratch
buffer, added on the host once its copy is done). With ``keep_device_grads`` torch keeps
accumulating into ``param.grad`` itself, so each copy replaces the host buffer instead
(adding would count the first micro-batch twice). :meth:`wait` settles everything in
flight, so the step never reads a partial sum.

[Note: gradients changed after their copy]
Code between backward and ``step()`` may change ``param.grad`` (``clip_grad_norm_``,
``scaler.unscale_``, an assignment): where the device gradient is kept, the host copy made
during backward is then stale. Each copy records the gradient's mark (:mod:`.grad_mark`:
the tensor and torch's in-place counter); before the step reads them, :meth:`changed` names
every gradient that is not the one copied or was changed since and :meth:`copy_again` copies
it again. Released gradients (the default) leave nothing to change: ``param.grad`` is None
until the user assigns one, which is then taken.
"""
from __future__ import annotations

import time
from typing import Sequence

import torch
from torch import Tensor

from ..tiers import packed_arena
from . import grad_mark


def dense(grad: Tensor) -> Tensor:
    """``grad``, refused when sparse: the stream copies flat dense gradients into its arena (the
    host path densifies the sparse gradients SGD and Adagrad take: Gradients.host_grad)."""
    if grad.is_sparse:
        raise RuntimeError("a sparse gradient of a parameter whose gradients stream to the host (CUDA "
                           "parameters): tierstate takes sparse gradients of CPU parameters only; use a dense "
                           "embedding, or Offload(grad_streaming=False)")
    return grad


class GradStream:
    def __init__(self, params: Sequence[Tensor], *, keep_device_grads: bool, pin_memory: bool,
                 bucket_bytes: int = 32 << 20, telemetry=None) -> None:
        self.params = list(params)
        self.keep_device_grads = keep_device_grads
        self.bucket_bytes = bucket_bytes
        self.telemetry = telemetry
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self.is_cuda = self.device.type == "cuda"
        # One host arena for all gradients, pinned once (not per parameter) on CUDA.
        self.arena, self.host = packed_arena(self.params, pin_memory=pin_memory and self.is_cuda, zero=True)
        self.valid = [False] * len(self.params)
        self._index = {p: i for i, p in enumerate(self.params)}
        self._open: dict[int, Tensor] = {}  # CUDA: gradients waiting for the bucket to fill
        self._open_bytes = 0
        self._inflight: list[tuple[object, list[tuple[int, Tensor | None]]]] = []
        # CUDA: (start, done) timing events of each bucket's copies, booked in the telemetry
        # once they have landed (see _book_copies)
        self._timed: list[tuple[object, object]] = []
        self._stream = torch.cuda.Stream(self.device) if self.is_cuda else None
        self.bytes_moved = 0
        self._copied: dict[int, grad_mark.GradMark] = {}  # i -> the mark of the param.grad copied
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]

    @property
    def nbytes(self) -> int:
        return self.arena.numel()

    def grad(self, i: int) -> Tensor | None:
        """The host gradient of parameter ``i`` (flat), or None when backward produced none."""
        return self.host[i] if self.valid[i] else None

    # -- hooks ---------------------------------------------------------------------------------
    def _on_grad(self, param: Tensor) -> None:
        i = self._index[param]
        grad = param.grad
        if grad is None:
            return
        dense(grad)
        if self.is_cuda:
            # The same tensor may come back (two backward passes without a flush): it already
            # holds the sum, so it is queued once.
            if i not in self._open:
                self._open[i] = grad
                self._open_bytes += grad.numel() * grad.element_size()
            if self._open_bytes >= self.bucket_bytes:
                self._flush()
            self._settle(block=False)
            return
        t0 = time.perf_counter()
        flat = grad.detach().reshape(-1)
        if self.valid[i] and not self.keep_device_grads:
            self.host[i].add_(flat)
        else:  # the first gradient, or a kept param.grad that already holds the sum
            self.host[i].copy_(flat)
            self.valid[i] = True
        self._copied[i] = grad_mark.mark(grad)
        self.bytes_moved += flat.numel() * flat.element_size()
        if not self.keep_device_grads:
            param.grad = None
        if self.telemetry is not None:
            self.telemetry.add_phase_time("grad_transfer", time.perf_counter() - t0, lane="grad-stream", start=t0)

    def _flush(self) -> None:
        """CUDA: copy the open bucket to the host on the side stream."""
        if not self._open:
            return
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        copies: list[tuple[int, Tensor | None]] = []
        timed = self.telemetry is not None and self.telemetry.enabled
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(ready)
            if timed:
                start = torch.cuda.Event(enable_timing=True)
                start.record(self._stream)
            for i, grad in self._open.items():
                flat = grad.detach().reshape(-1)
                self._copied[i] = grad_mark.mark(grad)
                if self.valid[i] and not self.keep_device_grads:
                    scratch = torch.empty(flat.numel(), dtype=flat.dtype, pin_memory=True)
                    scratch.copy_(flat, non_blocking=True)
                    copies.append((i, scratch))
                else:
                    self.host[i].copy_(flat, non_blocking=True)
                    self.valid[i] = True
                    copies.append((i, None))
                flat.record_stream(self._stream)  # its memory is not reused before the copy ran
                self.bytes_moved += flat.numel() * flat.element_size()
            done = torch.cuda.Event(enable_timing=timed)
            done.record(self._stream)
        self._inflight.append((done, copies))
        if timed:
            self._timed.append((start, done))
        if not self.keep_device_grads:
            for i in self._open:
                self.params[i].grad = None
        self._open.clear()
        self._open_bytes = 0

    def _settle(self, block: bool) -> None:
        """Add finished scratch copies into their host buffers (all of them when ``block``)."""
        remaining = []
        for event, copies in self._inflight:
            if block:
                event.synchronize()
            elif not event.query():
                remaining.append((event, copies))
                continue
            for i, scratch in copies:
                if scratch is not None:
                    self.host[i].add_(scratch)
        self._inflight = remaining

    def flush_now(self):
        """CUDA: issue the copies of every gradient queued so far; return an event that is done
        when they have landed (None on the CPU, where copies are synchronous). Used by
        ``step_in_backward``, which cannot wait for a bucket to fill."""
        if not self.is_cuda:
            return None
        self._flush()
        return self._inflight[-1][0] if self._inflight else None

    # -- step side -----------------------------------------------------------------------------
    def changed(self) -> list[int]:
        """The parameters whose ``param.grad`` changed since its copy, or was assigned without
        one (see [Note: gradients changed after their copy])."""
        out = []
        for i, p in enumerate(self.params):
            g = p.grad
            if g is None:
                continue
            seen = self._copied.get(i)
            if not (self.valid[i] and seen is not None and grad_mark.unchanged(seen, g)):
                out.append(i)
        return out

    def copy_again(self, indices: list[int]) -> None:
        """Replace the host copies of ``indices`` (:meth:`changed`) by their ``param.grad``."""
        self.wait()  # the copies in flight land first: these replace them
        for i in indices:
            g = dense(self.params[i].grad)
            flat = g.detach().reshape(-1)
            self.host[i].copy_(flat)
            self.valid[i] = True
            self._copied[i] = grad_mark.mark(g)
            self.bytes_moved += flat.numel() * flat.element_size()

    def wait(self) -> None:
        """Settle every copy in flight: afterwards the host buffers hold the final sums."""
        if self.is_cuda:
            self._flush()
            self._settle(block=True)
            self._book_copies()

    def _book_copies(self) -> None:
        """Book each landed bucket's copy as a ``grad_transfer`` span on lane ``grad-stream``,
        where it ran on the device's clock: an event recorded now on the idle side stream and
        waited for marks the device's present at ``perf_counter()`` (to the wait's latency, tens
        of microseconds), and each copy's start and end are placed before it by their elapsed
        times. The trace then shows the device-to-host copies beside backward."""
        if not self._timed:
            return
        now = torch.cuda.Event(enable_timing=True)
        now.record(self._stream)
        now.synchronize()
        t_now = time.perf_counter()
        for start, done in self._timed:
            begin = t_now - start.elapsed_time(now) / 1e3
            self.telemetry.add_phase_time("grad_transfer", start.elapsed_time(done) / 1e3, lane="grad-stream",
                                          start=begin)
        self._timed.clear()

    def reset(self, set_to_none: bool) -> None:
        """zero_grad: forget the host gradients (or zero them, like ``set_to_none=False``)."""
        self.wait()
        self._copied.clear()
        if set_to_none:
            self.valid = [False] * len(self.params)
        else:
            for i, ok in enumerate(self.valid):
                if ok:
                    self.host[i].zero_()

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
