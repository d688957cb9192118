"""Which parameters stream, and where each sits in its block's flat storage.

A *block* is one module of the model (by default each child of the model's largest
``nn.ModuleList``: GPT-2's ``transformer.h``, Llama's ``model.layers``) whose parameters are
fetched and released together. A parameter streams with a block only if nothing outside
that block uses it: a tied embedding (GPT-2's ``wte`` is also its ``lm_head``) or a weight
shared by two blocks stays resident, since no single block's lifetime covers its uses.

[Note: one storage per block, resized in place]
Every streamed parameter of a block is a view into one untyped storage of the block's
bytes. Releasing the block resizes that storage to 0 bytes; materializing it resizes it
back and fills it. The storage object itself never changes, and that is what autograd
needs: forward saves tensors *derived* from the weights for backward (``W.t()`` inside
``F.linear``, views under autocast), and those views hold the storage, not the parameter.
Re-pointing ``param.data`` at a fresh buffer instead would leave such a view reading a
buffer that by backward time holds another block. (FSDP2 frees its unsharded parameters
the same way.) Each parameter starts on a 64-byte boundary, the widest vector the kernels
load, and the block's bytes are one contiguous record: one read, one write per fetch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch
from torch import Tensor, nn

PARAM_ALIGN = 64  # bytes: one AVX-512 vector, so every parameter view is aligned for the kernels


def align_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class Place:
    """One parameter's bytes inside its block's storage."""

    name: str  # as in model.named_parameters()
    param: Tensor
    byte_offset: int
    nbytes: int


@dataclass(eq=False)
class Block:
    """One streamed block: its module, its parameters' places, and its storage on the compute device."""

    index: int
    name: str
    module: nn.Module
    places: tuple[Place, ...]
    nbytes: int  # bytes of the flat storage (every place inside it)
    storage: torch.UntypedStorage | None = None  # sized nbytes while materialized, 0 otherwise
    frozen: bool = field(default=False)  # no parameter requires grad (LoRA base weights)

    @property
    def params(self) -> list[Tensor]:
        return [pl.param for pl in self.places]


def auto_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The children of the ``nn.ModuleList`` holding the most parameters (at least two children).

    This is how transformer stacks are written (GPT-2 ``transformer.h``, Llama ``model.layers``,
    BERT ``encoder.layer``); a model without one must name its blocks."""
    best, best_numel = None, 0
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) >= 2:
            numel = sum(p.numel() for p in mod.parameters())
            if numel > best_numel:
                best, best_numel = (name, mod), numel
    if best is None:
        raise ValueError(
            f"blocks='auto': {type(model).__name__} has no nn.ModuleList of at least two modules with "
            "parameters to stream; pass blocks=[module, ...] naming the modules whose weights stream "
            "(each is fetched before its forward and released after its backward)")
    prefix, mods = best
    return [(f"{prefix}.{i}" if prefix else str(i), m) for i, m in enumerate(mods)]


def resolve_blocks(model: nn.Module, blocks) -> list[tuple[str, nn.Module]]:
    if isinstance(blocks, str):
        if blocks != "auto":
            raise ValueError(f"blocks={blocks!r}: expected 'auto' or a list of the model's modules")
        return auto_blocks(model)
    if isinstance(blocks, nn.Module):
        raise TypeError("blocks=<a module>: pass a list of modules (e.g. list(model.transformer.h)) or 'auto'")
    try:
        mods = list(blocks)
    except TypeError:
        raise TypeError(f"blocks={blocks!r}: expected 'auto' or a list of the model's modules") from None
    names = {m: n for n, m in model.named_modules()}  # modules hash by identity
    out = []
    for i, m in enumerate(mods):
        if not isinstance(m, nn.Module):
            raise TypeError(f"blocks[{i}] is {type(m).__name__}, not an nn.Module of the model")
        if m not in names:
            raise ValueError(f"blocks[{i}] ({type(m).__name__}) is not a submodule of the model")
        out.append((names[m], m))
    if not out:
        raise ValueError("blocks=[]: name at least one module, or pass blocks='auto'")
    for i, (na, _) in enumerate(out):
        for nb, _ in out[i + 1:]:
            if na == nb or na.startswith(nb + ".") or nb.startswith(na + ".") or na == "" or nb == "":
                raise ValueError(f"blocks {na!r} and {nb!r} overlap (one contains the other); name disjoint modules")
    return out


def assign(model: nn.Module, named_blocks: Sequence[tuple[str, nn.Module]],
           keep_resident=None) -> tuple[list[Block], list[tuple[str, Tensor]]]:
    """Blocks with the parameters only they use, and the parameters that stay resident
    (also those for which ``keep_resident(name, param)`` is true, e.g. LoRA adapters)."""
    owners: dict[Tensor, set[int]] = {}  # parameter -> indices of the blocks using it (-1: outside any block)
    first_name: dict[Tensor, str] = {}
    in_block: dict[nn.Module, int] = {}
    for bi, (_, mod) in enumerate(named_blocks):
        for sub in mod.modules():
            in_block[sub] = bi
    for mname, mod in model.named_modules(remove_duplicate=False):
        bi = in_block.get(mod, -1)
        for pname, p in mod.named_parameters(recurse=False):
            if p is None:
                continue
            owners.setdefault(p, set()).add(bi)
            first_name.setdefault(p, f"{mname}.{pname}" if mname else pname)
    blocks: list[Block] = []
    for bi, (bname, mod) in enumerate(named_blocks):
        places, cursor = [], 0
        for p in _unique(mod.parameters()):
            if owners.get(p) != {bi} or p.numel() == 0:
                continue
            if keep_resident is not None and keep_resident(first_name[p], p):
                continue
            cursor = align_up(cursor, PARAM_ALIGN)
            nbytes = p.numel() * p.element_size()
            places.append(Place(first_name[p], p, cursor, nbytes))
            cursor += nbytes
        blocks.append(Block(bi, bname, mod, tuple(places), align_up(cursor, PARAM_ALIGN),
                            frozen=not any(pl.param.requires_grad for pl in places)))
    streamed = {pl.param for b in blocks for pl in b.places}
    resident = [(first_name[p], p) for p in _unique(model.parameters()) if p not in streamed]
    return blocks, resident


def _unique(params: Iterable[Tensor]) -> list[Tensor]:
    seen: set[Tensor] = set()  # tensors hash by identity
    out = []
    for p in params:
        if p not in seen:
            seen.add(p)
            out.append(p)
    return out


def typed_view(storage: torch.UntypedStorage, place: Place) -> Tensor:
    """A tensor of ``place.param``'s dtype and shape over its bytes in ``storage``."""
    p = place.param
    item = p.element_size()
    return torch.empty(0, dtype=p.dtype, device=storage.device).set_(
        storage, place.byte_offset // item, p.shape, _contiguous_strides(p.shape))


def byte_view(storage: torch.UntypedStorage, nbytes: int | None = None) -> Tensor:
    """A uint8 tensor over ``storage`` (its own version counter: writing it does not bump the
    parameters', which autograd checks when it unpacks a saved weight)."""
    n = storage.nbytes() if nbytes is None else nbytes
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (n,), (1,))


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, acc = [], 1
    for d in reversed(tuple(shape)):
        strides.append(acc)
        acc *= max(int(d), 1)
    return tuple(reversed(strides))
