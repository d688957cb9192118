"""Weights out: the updated weights back into the parameters.

On the CPU the kernels write the rounded low-precision weight straight into the parameter
(or update an fp32 parameter in place): nothing is left to do. A parameter whose weights stream
(:mod:`tierstate.weights`) is updated in its block's host image instead, which the block
copies to the device when it next runs. On CUDA they write it into
pinned staging buffers, and :meth:`WeightsOut.upload` copies every stepped parameter to the
device on a side stream that the compute stream then waits for; a parameter's head held in
the device tier was updated in place there, so only its tail goes up.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Sequence
from weakref import WeakKeyDictionary

import torch
from torch import Tensor

from ..dist import local_tensor
from ..io import first_noting_others
from ..tiers import Slot, StateStore, packed_arena, resident_values
from ..weights import streamed as weights_of


class WeightsOut:
    def __init__(self, store: StateStore, trainable: Sequence[Tensor], device_heads: dict[int, int],
                 device: torch.device) -> None:
        self.store = store
        self.device = device
        self.device_heads = device_heads
        # trainable index -> the handle of a parameter whose weights stream (tierstate.weights):
        # the kernels update its block's host image, and the block refreshes its compute copy
        self.streamed = {i: h for i, p in enumerate(trainable) if (h := weights_of(p)) is not None}
        # their streamers' windows, each once: entered around every sub-group's update
        # (deferring_write_errors), so listed here rather than walked over every handle each time
        self._windows = list({id(h.streamer.window): h.streamer.window for h in self.streamed.values()}.values())
        self._reported: WeakKeyDictionary = WeakKeyDictionary()  # streamer -> its stats() at the last report
        self.staging: dict[int, Tensor] = {}  # CUDA: pinned low-precision weights, written by the kernels
        self.staging_arena: Tensor | None = None
        if device.type == "cuda":
            low = [(i, local_tensor(p)) for i, p in enumerate(trainable) if p.dtype != torch.float32
                   and device_heads.get(i, 0) < local_tensor(p).numel() and i not in self.streamed]
            self.staging_arena, views = packed_arena([p for _, p in low], pin_memory=True, zero=False)
            self.staging = {i: v for (i, _), v in zip(low, views)}
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.upload_done = None  # CUDA: the event after the last upload

    @property
    def pinned_nbytes(self) -> int:
        a = self.staging_arena
        return a.untyped_storage().nbytes() if a is not None and a.is_pinned() else 0

    def values_of(self, s: Slot, write: bool):
        """The flat values of ``s``'s parameter in host-addressable memory (the store's
        ``values_of``): the parameter itself, or, when its weights stream, its block's host
        image, lent for as long as the context lasts."""
        handle = self.streamed.get(s.trainable) if s.trainable is not None else weights_of(s.param)
        if handle is None:
            return resident_values(s, write)
        return handle.for_update() if write else handle.for_reading()

    @contextlib.contextmanager
    def deferring_write_errors(self) -> Iterator[None]:
        """While the optimizer updates streamed weights: a write-back of another block that fails
        does not stop the update half way; it is raised by :meth:`take_write_errors` at the end
        of ``step()`` (see ``Window._take_buffer``)."""
        for w in self._windows:
            w.defer_write_errors += 1
        try:
            yield
        finally:
            for w in self._windows:
                w.defer_write_errors -= 1

    def take_write_errors(self) -> BaseException | None:
        """The first weight write-back failure deferred during the step's updates (the others
        as its notes), or None."""
        return first_noting_others([w.take_write_errors() for w in self._windows])

    def resident(self, s: Slot) -> bool:
        """``values_of(s, ...)`` is the parameter itself (its weights do not stream): nothing to
        lend or write back around an update."""
        return (self.streamed.get(s.trainable) if s.trainable is not None else weights_of(s.param)) is None

    def out_view(self, s: Slot, first: int, end: int, values: Tensor) -> Tensor | None:
        """Where the kernels write the rounded weight of elements ``[first, end)`` of a
        parameter with a master: the parameter's values (``values``: itself on the CPU, its
        block's host image when its weights stream), its staging buffer on CUDA; None for an
        fp32 parameter (uploaded from the master itself)."""
        if s.local.dtype == torch.float32:  # (a complex64 parameter's real view too)
            return None
        if self.device.type == "cpu" or s.trainable in self.streamed:
            return values[first:end]
        return self.staging[s.trainable][first:end]

    def report_streaming(self, telemetry) -> None:
        """Book what weight streaming did since the last step (tierstate.weights): counters
        ``weight_fetch_bytes``, ``weight_writeback_bytes``, ``weight_prefetch_hits`` /
        ``_misses``; gauges ``weight_stall_seconds`` (the compute waiting on weights, since
        the streamer began) and ``weight_window_bytes`` (its peak)."""
        seen = []
        for h in self.streamed.values():
            try:
                streamer = h.streamer
            except RuntimeError:
                continue  # closed
            if any(streamer is x for x in seen):
                continue
            seen.append(streamer)
            st = streamer.stats()
            last = self._reported.get(streamer, {})
            for key in ("fetch_bytes", "writeback_bytes", "prefetch_hits", "prefetch_misses"):
                telemetry.count(f"weight_{key}", int(st[key] - last.get(key, 0)))
            telemetry.set_gauge("weight_stall_seconds", float(st["stall_seconds"]))
            telemetry.set_gauge("weight_window_bytes", float(st["peak_window_bytes"]))
            self._reported[streamer] = st

    def wait_upload(self, telemetry) -> None:
        """Before the kernels rewrite the staging buffers: the previous upload has read them."""
        if self.upload_done is not None:
            with telemetry.phase("device_stall"):
                self.upload_done.synchronize()

    def upload(self, slots: Sequence[Slot], telemetry) -> None:
        """CUDA: copy updated weights to the device on a side stream; the compute stream waits for it."""
        if self.device.type != "cuda":
            return
        with telemetry.phase("weight_upload"), torch.cuda.stream(self._stream):
            for s in slots:
                if s.trainable in self.streamed:
                    continue  # updated in its block's host image, which the block uploads
                head = self.device_heads.get(s.trainable, 0)  # elements updated in place on the device
                if head == s.local.numel():
                    continue
                if s.param.dtype != torch.float32:
                    src = self.staging[s.trainable].view(-1)[head:]
                else:
                    # past the device head (which is the device tier's, updated in place there)
                    src = self.store.read(s, "master").view(-1) if head == 0 else self.store.read_flat(s, "master", head)
                s.local.data.view(-1)[head:].copy_(src, non_blocking=True)
                telemetry.add_bytes("device", "h2d", src.numel() * src.element_size())
            done = torch.cuda.Event()
            done.record(self._stream)
        torch.cuda.current_stream(self.device).wait_event(done)
        self.upload_done = done
