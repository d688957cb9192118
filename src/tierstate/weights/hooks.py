"""The module and autograd hooks that fetch a block before it runs and release it after.

    forward pre-hook   hold the block (materialize it, read the next ones ahead); when
                       autograd records, route the block's tensor inputs through
                       :class:`_AfterBackward`, whose backward runs once the gradients of
                       those inputs exist, i.e. when the block's backward is complete
    forward post-hook  drop the forward hold (the block is released unless backward holds
                       it; also when the forward raised); when autograd records, hook the
                       outputs: the first gradient to
                       reach any of them takes a backward hold (materialize again)
    _AfterBackward     drop the backward hold: release
    end of backward    drop every backward hold left (a block whose inputs need no
                       gradient, e.g. the first block under a frozen embedding), learn the order

Under activation checkpointing the block's forward runs again inside its backward, after
the backward hold was taken: the recomputation's post-hook then releases nothing. With
``use_reentrant=True`` the first forward records no graph, so the recomputation's own
hooks do the holding. A module called twice gets a hold per call.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_unflatten

if TYPE_CHECKING:
    from .streamer import WeightStreamer


class _AfterBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, callback, *tensors):
        ctx.callback = callback
        return tensors

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None, *grads)


def _route_inputs(args: tuple, kwargs: dict, callback) -> tuple[tuple, dict]:
    leaves, spec = tree_flatten((args, kwargs))
    where = [i for i, x in enumerate(leaves) if isinstance(x, Tensor) and x.requires_grad]
    if not where:
        return args, kwargs
    routed = _AfterBackward.apply(callback, *(leaves[i] for i in where))
    for i, t in zip(where, routed):
        leaves[i] = t
    return tree_unflatten(leaves, spec)


class BlockHooks:
    """Installs the hooks on every block of a streamer; :meth:`remove` takes them off."""

    def __init__(self, streamer: "WeightStreamer") -> None:
        self.streamer = streamer
        self._handles = []
        self._callback_queued = False
        for block in streamer.blocks:
            b = block.index
            self._handles.append(block.module.register_forward_pre_hook(self._pre(b), with_kwargs=True))
            # always_call: a forward that raises still drops its hold (else the block, and on the
            # CPU its image, stayed pinned for the rest of the run)
            self._handles.append(block.module.register_forward_hook(self._post(b), with_kwargs=True,
                                                                    always_call=True))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _pre(self, b: int):
        def hook(module, args, kwargs):
            self.streamer._enter_forward(b)
            if torch.is_grad_enabled():
                return _route_inputs(args, kwargs, lambda: self.streamer._leave_backward(b))
            return None
        return hook

    def _post(self, b: int):
        def hook(module, args, kwargs, output: Any):
            if torch.is_grad_enabled():
                tensors = [t for t in tree_flatten(output)[0] if isinstance(t, Tensor) and t.requires_grad]
                if tensors:
                    torch.autograd.graph.register_multi_grad_hook(tensors, lambda grads: self._before_backward(b),
                                                                  mode="any")
            self.streamer._leave_forward(b)
            return None
        return hook

    def _before_backward(self, b: int) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        self.streamer._enter_backward(b)

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        self.streamer._end_backward()
