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

from typing import Callable, Sequence

import torch
from torch import Tensor

from .. import kernels
from ..dist import is_dtensor, local_tensor
from ..placement import Offload
from ..tiers import Slot
from ..weights import streamed as weights_of
from . import grad_mark
from .grad_stream import GradStream


def flat_grad(g: Tensor) -> Tensor:
    """``g``'s elements as one contiguous run, as the kernels read them: the gradient itself
    where it is one already (a bias's; making a view costs ~0.7 us), a view of a contiguous
    gradient, a copy of one laid out otherwise (transposed, sliced with gaps, expanded), which
    torch's optimizers take as they are. ``reshape(-1)`` alone keeps a slice's gaps (a 1-d view
    of stride 2)."""
    if g.is_contiguous() and not g.requires_grad:
        return g if g.dim() == 1 else g.view(-1)
    return g.detach().reshape(-1).contiguous()


class HookNorms:
    """Each CPU gradient's sum of squares, taken by its post-accumulate-grad hook in backward.

    [Note: the norm without a pass of its own]
    The global norm (clipping, ``last_grad_norm``) and the non-finite check need every
    gradient before any update, so a step used to start with one read of all of them: on a
    step that moves 28 B/param (bf16 gradient, fp32 master and moments) that read of 2 B/param
    cost 11-16 % of ``opt.step()`` (50M parameters, 2 cores), as it ran from DRAM. The hook
    reads each gradient right after backward wrote it, mostly from cache, and the step reuses
    that sum when ``param.grad`` is still the same tensor at the same version (torch bumps
    ``_version`` on every in-place change: ``clip_grad_norm_``, ``scaler.unscale_``,
    accumulation by a second backward). A gradient set by hand, replaced or changed after its
    hook is read again by the step, as before. An in-place change made through ``.data``
    escapes the version counter, so it is not seen: change gradients in place on
    ``param.grad`` itself.

    The sum is the one the step would take (the same kernel on the same elements, the scale
    applied afterwards as the kernel does), so reusing it is exact. When a parameter's hook
    fires more than once before a step (gradient accumulation) the hooks would read every
    micro-batch's partial sum; they stop taking sums until a step sees one backward again.
    """

    def __init__(self, params: dict[int, Tensor]) -> None:
        self._sums: dict[int, tuple[grad_mark.GradMark, float]] = {}  # trainable -> (the grad's mark, sum)
        self._fired: dict[int, int] = {}
        self.accumulating = False
        # (a frozen parameter cannot be hooked; one unfrozen later is read by the step)
        self._handles = [p.register_post_accumulate_grad_hook(self._hook(t)) for t, p in params.items()
                         if p.requires_grad]

    def _hook(self, t: int):
        def on_grad(param: Tensor) -> None:
            fired = self._fired.get(t, 0) + 1
            self._fired[t] = fired
            grad = param.grad
            if fired > 1 or self.accumulating or grad is None or grad.device.type != "cpu" or grad.is_sparse \
                    or not grad.is_contiguous():
                self._sums.pop(t, None)
                return
            values = local_tensor(grad)  # a complex gradient's real view: the elements the step reads
            if values.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                self._sums.pop(t, None)
                return
            self._sums[t] = (grad_mark.mark(grad), kernels.grad_sumsq(values.reshape(-1)))
        return on_grad

    def sumsq(self, t: int, param: Tensor, scale: float) -> float | None:
        """The sum of squares of ``param.grad * scale`` if the hook's is still valid, else None."""
        entry = self._sums.get(t)
        if entry is None:
            return None
        seen, total = entry
        grad = param.grad
        if grad is None or not grad_mark.unchanged(seen, grad):
            return None
        return total * (scale * scale)  # as the kernel applies its scale (bit for bit)

    def step_taken(self) -> None:
        """A step read this cycle's gradients: start the next one (and learn whether it accumulated)."""
        self.accumulating = any(n > 1 for n in self._fired.values())
        self._sums.clear()
        self._fired.clear()

    def forget(self) -> None:
        """The gradients were dropped or zeroed: no sum of this cycle holds any more."""
        self._sums.clear()
        self._fired.clear()

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._sums.clear()


class Gradients:
    """Where the gradients of one optimizer's trainable parameters come from.

    Args:
        trainable: the trainable parameters, in layout order.
        device_heads: {trainable index: elements at its head held on the compute device}.
        hook_norms: take each CPU gradient's sum of squares in backward (:class:`HookNorms`).
        sparse_refusal: why a parameter's sparse gradient cannot be stepped, or None when it can
            (the rule's ``sparse_refusal`` for the parameter's group).
    """

    def __init__(self, trainable: Sequence[Tensor], device_heads: dict[int, int], offload: Offload,
                 device: torch.device, telemetry, hook_norms: bool = False,
                 sparse_refusal: Callable[[Slot], str | None] = lambda s: "sparse gradients are not supported") -> None:
        self.device_heads = device_heads
        self.sparse_refusal = sparse_refusal
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
        self.norms = None
        if hook_norms and device.type == "cpu" and not any(is_dtensor(p) for p in trainable):
            own = {t: p for t, p in enumerate(trainable)
                   if t not in device_heads and not (self.stream is not None and t in self.stream_index)
                   and weights_of(p) is None}
            self.norms = HookNorms(own) if own else None

    def check_sparse(self, slots: Sequence[Slot]) -> None:
        """Raise, before a step changes anything, for a sparse ``param.grad`` it cannot take."""
        for s in slots:
            g = s.param.grad
            if g is not None and g.is_sparse and (why := self.sparse_refusal(s)) is not None:
                raise self._refusal(s, why)

    def _densified(self, s: Slot, g: Tensor) -> Tensor:
        """``g`` as a dense tensor: a sparse gradient's rows without values are zeros, which leave
        those rows' parameter and state as torch's sparse path does for the rules that accept it."""
        if not g.is_sparse:
            return g
        why = self.sparse_refusal(s)
        if why is not None:
            raise self._refusal(s, why)
        return g.to_dense()

    @staticmethod
    def _refusal(s: Slot, why: str) -> RuntimeError:
        return RuntimeError(f"{why} (parameter {s.index}, shape {tuple(s.param.shape)}, has a sparse gradient, "
                            "e.g. from nn.Embedding(sparse=True))")

    def hook_sumsq(self, s: Slot, scale: float) -> float | None:
        """The sum of squares of ``s``'s host gradient times ``scale`` taken in backward, if still valid."""
        if self.norms is None or self.streamed(s):
            return None
        return self.norms.sumsq(s.trainable, s.param, scale)

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

    def refresh(self) -> bool:
        """Before a step: host copies of gradients changed (or assigned) after backward copied
        them are made again (:meth:`GradStream.changed`); True if any was, so the host copies
        now hold what ``param.grad`` holds, unscaled by ``scaler.unscale_`` if it ran."""
        if self.stream is None:
            return False
        changed = self.stream.changed()
        if not changed:
            return False
        with self.telemetry.phase("grad_transfer"):  # only when there is something to copy
            self.stream.copy_again(changed)
        return True

    def host_grad(self, s: Slot) -> Tensor | None:
        """The flat host gradient of ``s`` (streamed, or copied from ``param.grad``), or None."""
        if self.streamed(s):
            return self.stream.grad(self.stream_index[s.trainable])
        g = s.param.grad
        if g is None:
            return None
        g = self._densified(s, local_tensor(g))
        if not g.is_cpu:
            with self.telemetry.phase("grad_transfer"):
                g = g.detach().to("cpu")
            self.telemetry.add_bytes("device", "d2h", g.numel() * g.element_size())
        return flat_grad(g)

    def grad_of(self, s: Slot) -> Tensor | None:
        """The flat gradient a step reads: ``param.grad`` where it lies for a parameter touching
        the device tier, else the host gradient."""
        if s.trainable not in self.device_heads:
            return self.host_grad(s)
        g = s.param.grad
        # (a complex gradient's real view: the tiers' elements, as host_grad's)
        return None if g is None else flat_grad(self._densified(s, local_tensor(g)))

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

    def step_taken(self) -> None:
        """The step read this cycle's gradients (the hooks' sums are spent)."""
        if self.norms is not None:
            self.norms.step_taken()

    def reset(self, set_to_none: bool) -> None:
        if self.stream is not None:
            self.stream.reset(set_to_none)
        if self.norms is not None:  # zero_grad: the next backward starts a cycle afresh
            self.norms.forget()

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
        if self.norms is not None:
            self.norms.close()
