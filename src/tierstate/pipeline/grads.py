"""Gradients in: where each parameter's gradient is read from for a step.

Three sources, one question (``grad_of``):

- the gradient stream (:mod:`.grad_stream`, CUDA by default): host buffers filled during
  backward;
- ``param.grad`` where backward left it, copied to the host when it is on an accelerator;
- for a parameter touching a tier on the compute device, ``param.grad`` in place: its head
  is updated there, and only its tail (the part in host tiers) is copied down
  (:meth:`Gradients.split`).
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from ..dist import is_dtensor, local_tensor
from ..placement import Offload
from ..tiers import Slot
from ..weights import streamed as weights_of
from .grad_stream import GradStream, dense


class Gradients:
    """Where the gradients of one optimizer's trainable parameters come from.

    Args:
        trainable: the trainable parameters, in layout order.
        device_heads: {trainable index: elements at its head held on the compute device}.
    """

    def __init__(self, trainable: Sequence[Tensor], device_heads: dict[int, int], offload: Offload,
                 device: torch.device, telemetry) -> None:
        self.device_heads = device_heads
        self.telemetry = telemetry
        self.keep_device_grads = offload.keep_device_grads
        streaming = offload.grad_streaming
        if streaming is None:
            streaming = device.type == "cuda"
        if any(is_dtensor(p) for p in trainable):
            # FSDP2 assigns each sharded gradient after its reduce-scatter instead of accumulating
            # it, so the post-accumulate-grad hooks the stream relies on never fire: read .grad.
            streaming = False
        # parameters touching the device tier keep their gradients on the device (not streamed);
        # so do parameters whose weights stream (tierstate.weights): a pinned arena for their
        # gradients would be as large as the weights that did not fit (140 GB for 70B in bf16),
        # so each is copied down when its update reads it and dropped once applied
        streamed = [t for t in range(len(trainable)) if t not in device_heads and weights_of(trainable[t]) is None]
        self.stream_index = {t: k for k, t in enumerate(streamed)}
        pin = offload.pin_memory and device.type == "cuda"
        self.stream = GradStream([trainable[t] for t in streamed], keep_device_grads=offload.keep_device_grads,
                                 pin_memory=pin, telemetry=telemetry) if streaming and streamed else None

    @property
    def nbytes(self) -> int:
        return self.stream.nbytes if self.stream is not None else 0

    @property
    def pinned_nbytes(self) -> int:
        arena = self.stream.arena if self.stream is not None else None
        return arena.untyped_storage().nbytes() if arena is not None and arena.is_pinned() else 0

    def streamed(self, s: Slot) -> bool:
        return self.stream is not None and s.trainable in self.stream_index

    def wait(self) -> None:
        """Every streamed copy has landed (the step reads final sums)."""
        if self.stream is not None:
            with self.telemetry.phase("grad_wait"):
                self.stream.wait()

    def host_grad(self, s: Slot) -> Tensor | None:
        """The flat host gradient of ``s`` (streamed, or copied from ``param.grad``), or None."""
        if self.streamed(s):
            return self.stream.grad(self.stream_index[s.trainable])
        g = s.param.grad
        if g is None:
            return None
        g = dense(local_tensor(g))
        if g.device.type != "cpu":
            with self.telemetry.phase("grad_transfer"):
                g = g.detach().to("cpu")
            self.telemetry.add_bytes("device", "d2h", g.numel() * g.element_size())
        return g.detach().reshape(-1)

    def grad_of(self, s: Slot) -> Tensor | None:
        """The flat gradient a step reads: ``param.grad`` where it lies for a parameter touching
        the device tier, else the host gradient."""
        if s.trainable not in self.device_heads:
            return self.host_grad(s)
        g = s.param.grad
        return None if g is None else dense(g).detach().reshape(-1)

    def split(self, active: list) -> tuple[dict[int, tuple[Tensor, int]], dict[int, Tensor]]:
        """Split a step's ``(slot, gradient)`` pairs between the host tiers and the device tier.

        Returns ``{trainable: (host gradient indexed like the parameter, first element the
        host part reads)}`` and ``{trainable: device gradient}``. The one parameter straddling
        the device range gets a host buffer of its full size of which only the tail is copied
        (and read); the head is never touched.
        """
        host: dict[int, tuple[Tensor, int]] = {}
        device: dict[int, Tensor] = {}
        for s, g in active:
            head = self.device_heads.get(s.trainable, 0)
            if head == 0:
                host[s.trainable] = (g, 0)
                continue
            device[s.trainable] = g
            if head == g.numel():
                continue
            if g.device.type != "cpu":
                tail = g[head:]
                with self.telemetry.phase("grad_transfer"):
                    buffer = torch.empty(g.numel(), dtype=g.dtype)
                    buffer[head:].copy_(tail)
                self.telemetry.add_bytes("device", "d2h", tail.numel() * tail.element_size())
                g = buffer
            host[s.trainable] = (g, head)
        return host, device

    def carry_over(self) -> dict:
        """{parameter: a copy of its streamed host gradient}, for an engine rebuilt mid-accumulation."""
        if self.stream is None:
            return {}
        out = {}
        for t, k in self.stream_index.items():
            g = self.stream.grad(k)
            if g is not None:
                out[self.stream.params[k]] = g.clone()
        return out

    def take_over(self, slots: Sequence[Slot], pending: dict) -> None:
        """After a rebuild: put each parameter's carried gradient (:meth:`carry_over`) where this
        engine reads it (its stream buffer, or ``param.grad`` when it now touches the device)."""
        if self.stream is None and not pending:
            return
        for s in slots:
            g = pending.get(s.param)
            if not self.streamed(s):
                if s.trainable is not None and g is not None and s.param.grad is None:
                    s.param.grad = g.view(s.param.shape).to(s.param.device, s.param.dtype)
                continue
            if g is None and s.param.grad is not None:
                g = local_tensor(s.param.grad).detach().reshape(-1).to("cpu")
                if not self.keep_device_grads:
                    s.param.grad = None
            if g is not None:
                k = self.stream_index[s.trainable]
                self.stream.host[k].copy_(g)
                self.stream.valid[k] = True

    def reset(self, set_to_none: bool) -> None:
        if self.stream is not None:
            self.stream.reset(set_to_none)

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
