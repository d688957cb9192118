"""DTensor helpers: this rank's shard, and the process groups sharding a parameter."""
from __future__ import annotations

from torch import Tensor

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch build without torch.distributed: no parameter can be a DTensor
    DTensor = ()


def is_dtensor(t) -> bool:
    return isinstance(t, DTensor)


def local_tensor(t: Tensor) -> Tensor:
    """The plain tensor the engine reads and writes for ``t``: ``t`` itself, or this rank's shard
    when ``t`` is a DTensor (parameters and gradients under FSDP2's ``fully_shard``). The shard is
    the DTensor's own storage, so writing into it updates the parameter."""
    return t._local_tensor if isinstance(t, DTensor) else t


def shard_key(p: Tensor) -> tuple:
    """(mesh, mesh dims that shard ``p``): ranks along those dims hold the other parts of ``p``;
    ``()`` for a parameter every rank holds whole."""
    if not isinstance(p, DTensor):
        return ()
    dims = tuple(d for d, placement in enumerate(p.placements) if placement.is_shard())
    return (p.device_mesh, dims) if dims else ()


def shard_groups(params: list[Tensor]) -> list[tuple[tuple, list]]:
    """One ``(shard key, process groups)`` per way the trainable parameters are sharded, in
    parameter order (the same on every rank, so the collectives match); empty when none is."""
    out: dict[tuple, list] = {}
    for p in params:
        key = shard_key(p)
        if key and key not in out:
            mesh, dims = key
            out[key] = [mesh.get_group(d) for d in dims]
    if out and any(not shard_key(p) for p in params):
        out.setdefault((), [])  # parameters replicated on every rank: their squares count once
    return list(out.items())
