"""Weight streaming under FSDP2: FSDP shards each block across the ranks, tierstate keeps this
rank's shard on a tier and brings it into memory only while FSDP gathers the block.

[Note: streaming FSDP2's shards]
``fully_shard(block)`` leaves every rank a padded 1-D shard of each parameter
(``FSDPParam._sharded_param_data``; the DTensor parameter's local tensor is its first rows).
FSDP2 reads those shards at exactly one point: its all-gather's copy-in, inside
``FSDPParamGroup.unshard()`` (pre-forward, pre-backward, its backward prefetch of the next
block, a recomputation under activation checkpointing, ``FSDPModule.unshard()``). Between
``reshard()`` and the next ``unshard()`` only the optimizer touches them, and tierstate's
optimizer updates a streamed parameter in its block's host image, never through the
parameter.

So a streamed block here is the set of one FSDP unit's shards, laid out in one storage as
any streamed block (:mod:`.blocks`): every ``_sharded_param_data`` and local tensor is
re-pointed at a view into it (FSDP2 does the same re-pointing itself in
``reset_sharded_param``). The hooks are the unit's own ``unshard`` and ``reshard``: the block
is held from the unshard that gathers it to the reshard that frees the gathered parameters.
Holding only around the copy-in would also do on the CPU, but on CUDA the copy-in runs on
FSDP's copy-in stream, and with ``world_size == 1`` the gathered parameter may alias the
shard; holding until the reshard costs 1/N of the gathered block, and is safe in all three.
The use order (for prefetch) is the order of those unshards, learned as for plain streaming.

FSDP2's lazy initialization re-pads the shards once (``reset_sharded_param``) and must see
their bytes, so :func:`prepare` runs it while the shards are still whole in memory.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch
from torch import Tensor, nn

from .blocks import PARAM_ALIGN, Block, Place, align_up

if TYPE_CHECKING:
    from .streamer import WeightStreamer

try:
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # a torch build without torch.distributed
    FSDPModule = ()

__all__ = ["ShardHooks", "ShardPlace", "is_sharded", "prepare", "shard_blocks"]


@dataclass(frozen=True)
class ShardPlace(Place):
    """A parameter's FSDP2 shard inside its block's storage: ``nbytes`` are the shard's own
    elements (what the optimizer updates), ``padded_nbytes`` the padded extent FSDP gathers."""

    fsdp_param: Any = None
    padded_nbytes: int = 0


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` was wrapped by FSDP2's ``fully_shard`` (its root)."""
    return bool(FSDPModule) and isinstance(model, FSDPModule)


def _groups(module: nn.Module) -> list:
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch < 2.6 kept one group
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return list(groups)


def prepare(model: nn.Module) -> None:
    """Run FSDP2's lazy initialization now, while every shard is in memory (see the Note)."""
    state = model._get_fsdp_state()
    if getattr(state, "_is_root", None) is False:
        raise ValueError("offload_weights(model) under FSDP2: pass the root module (the one fully_shard was "
                         "applied to last), not a sharded block")
    state._lazy_init()


def shard_blocks(model: nn.Module, named_blocks: Sequence[tuple[str, nn.Module]],
                 keep_resident=None) -> tuple[list[Block], list[tuple[str, Tensor]]]:
    """The streamed blocks of an FSDP2 model: one per block module, each fully_shard-ed on its
    own, holding this rank's shards of its parameters; and the parameters that stay (the root
    unit's: embeddings, final norm, head; and ``keep_resident`` picks)."""
    names = {p: n for n, p in model.named_parameters(remove_duplicate=False)}
    blocks: list[Block] = []
    for bi, (bname, mod) in enumerate(named_blocks):
        if mod is model or not isinstance(mod, FSDPModule):
            raise ValueError(f"offload_weights under FSDP2: block {bname!r} ({type(mod).__name__}) is not sharded "
                             "on its own; apply fully_shard(block) to each block, then fully_shard(model), then "
                             "offload_weights(model, ...)")
        places, cursor = [], 0
        for group in _groups(mod):
            if getattr(group, "_use_post_forward_mesh", False):
                raise ValueError(f"offload_weights under FSDP2: block {bname!r} was sharded with an int "
                                 "reshard_after_forward (resharded to a smaller mesh after forward); use True or "
                                 "False")
            for fp in group.fsdp_params:
                p = fp.sharded_param
                if p._local_tensor.is_meta:
                    raise ValueError(f"offload_weights under FSDP2: parameter {names.get(p, '?')!r} is on the meta "
                                     "device; materialize the sharded model first (model.to_empty(device=...) "
                                     "and initialize it), then offload its weights")
                name = names.get(p, getattr(fp, "_param_fqn", "?"))
                if keep_resident is not None and keep_resident(name, p):
                    continue
                item = p.element_size()
                padded = fp._sharded_param_data.numel() * item
                if padded == 0:
                    continue
                cursor = align_up(cursor, PARAM_ALIGN)
                places.append(ShardPlace(name, p, cursor, p._local_tensor.numel() * item, fp, padded))
                cursor += padded
        blocks.append(Block(bi, bname, mod, tuple(places), align_up(cursor, PARAM_ALIGN),
                            frozen=not any(pl.param.requires_grad for pl in places)))
    streamed = {pl.param for b in blocks for pl in b.places}
    resident, seen = [], set()
    for n, p in model.named_parameters():
        if p not in streamed and p not in seen:
            seen.add(p)
            resident.append((n, p))
    return blocks, resident


def shard_device(model: nn.Module) -> torch.device:
    """Where the shards live (FSDP2's device, or the CPU under its ``CPUOffloadPolicy``)."""
    for p in model.parameters():
        local = getattr(p, "_local_tensor", None)
        if local is not None:
            return local.device
    return torch.device("cpu")


def repoint(place: ShardPlace, flat: Tensor) -> None:
    """Make FSDP2's shard of ``place`` the view ``flat`` (its padded extent, 1-D) into the
    block's storage, copying the shard's values there first when ``flat`` has memory."""
    fp = place.fsdp_param
    old = fp._sharded_param_data
    if flat.untyped_storage().nbytes() and old.numel():
        flat.copy_(old)
    fp._sharded_param_data = flat
    local = fp.sharded_param._local_tensor
    dim = fp.fsdp_placement.dim
    rows = local.size(dim) if local.numel() > 0 else 0
    fp.sharded_param._local_tensor = flat.view(fp.padded_sharded_param_size).narrow(dim, 0, rows)


def empty_shard(place: ShardPlace) -> None:
    """At close: the shard has no values any more (the streamer's homes are gone)."""
    fp = place.fsdp_param
    empty = torch.empty(0, dtype=place.param.dtype, device=fp._sharded_param_data.device)
    fp._sharded_param_data = empty
    fp.sharded_param._local_tensor = empty


class ShardHooks:
    """Holds a block from the ``unshard`` of its FSDP unit that gathers it to the ``reshard``
    that frees the gathered parameters (see [Note: streaming FSDP2's shards]); :meth:`remove`
    restores FSDP2's methods."""

    def __init__(self, streamer: "WeightStreamer") -> None:
        self.streamer = streamer
        self._patched: list = []
        self._held: dict[int, int] = {}  # id(group) -> block it holds
        self._commit_queued = False
        for block in streamer.blocks:
            for group in _groups(block.module):
                self._patch(group, block.index)

    def _patch(self, group, b: int) -> None:
        unshard, reshard = group.unshard, group.reshard  # bound methods of FSDP2's class

        def held_unshard(*args, **kwargs):
            if group._all_gather_result is not None or group.is_unsharded or id(group) in self._held:
                return unshard(*args, **kwargs)  # nothing to gather: FSDP2 returns at once
            self._hold(group, b)
            try:
                out = unshard(*args, **kwargs)
            except BaseException:
                self._drop(group)
                raise
            if group._all_gather_result is None and not group.is_unsharded:
                self._drop(group)  # FSDP2 chose not to gather (e.g. no unshard in backward)
            return out

        def held_reshard(*args, **kwargs):
            out = reshard(*args, **kwargs)
            if id(group) in self._held and not group.is_unsharded and group._all_gather_result is None:
                self._drop(group)
            return out

        group.unshard, group.reshard = held_unshard, held_reshard
        self._patched.append(group)

    def _hold(self, group, b: int) -> None:
        self._held[id(group)] = b
        self.streamer._enter_forward(b)  # materialize, note the order, read the next ones ahead
        if torch._C._current_graph_task_id() != -1 and not self._commit_queued:
            self._commit_queued = True  # inside backward: learn the order once it ends
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _drop(self, group) -> None:
        b = self._held.pop(id(group), None)
        if b is not None:
            self.streamer._leave_forward(b)

    def _end_of_backward(self) -> None:
        self._commit_queued = False
        with self.streamer._lock:
            self.streamer.order.commit()

    def remove(self) -> None:
        for group in self._patched:
            for name in ("unshard", "reshard"):
                group.__dict__.pop(name, None)  # FSDP2's own methods again
        self._patched.clear()
        for gid in list(self._held):
            b = self._held.pop(gid)
            self.streamer._leave_forward(b)
