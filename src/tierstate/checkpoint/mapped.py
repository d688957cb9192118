"""``mmap_state_dict``: torch's optimizer state_dict with file-backed tensors.

``optimizer.state_dict()`` reads NVMe-tier state into new RAM tensors, which cannot work
when the state is larger than RAM. :func:`mmap_state_dict` returns the same schema, but
each tensor not already in host RAM is written, piece by piece, into a file under
``scratch_dir`` and handed out as a ``MAP_SHARED`` mapping of it (``torch.from_file``).
The file is unlinked as soon as it is mapped: its blocks live exactly as long as the
tensor, and a crashed run leaves nothing behind in ``scratch_dir``. Pages come from the
page cache on access and can be evicted again, so ``torch.save(sd)`` or ``dcp.save(sd)``
streams through it without holding the state in RAM.
"""
from __future__ import annotations

import os
import tempfile

import torch
from torch import Tensor

from ..io.errors import from_oserror
from ..tiers import step_tensor
from .access import OffloadAccess, store_of
from .torch_hooks import entries_not_of_parameters, packed

# Pieces of 4 MiB: each a single buffered pwrite into the scratch file.
_PIECE_BYTES = 4 << 20


def _file_backed(scratch_dir: str, numel: int, dtype: torch.dtype, pieces) -> Tensor:
    if numel == 0:
        return torch.empty(0, dtype=dtype)
    fd, path = tempfile.mkstemp(prefix="tierstate-state-", suffix=".bin", dir=scratch_dir)
    try:
        try:
            os.ftruncate(fd, numel * dtype.itemsize)
            offset = 0
            for piece in pieces:
                view = memoryview(piece.contiguous().view(torch.uint8).numpy())  # bytes: bf16 has no numpy dtype
                done = 0
                while done < len(view):
                    done += os.pwrite(fd, view[done:], offset + done)
                offset += len(view)
        except OSError as exc:
            raise from_oserror(exc, path, None, "write") from exc
        finally:
            os.close(fd)
        return torch.from_file(path, shared=True, size=numel, dtype=dtype)
    finally:
        os.unlink(path)  # the mapping keeps the blocks; nothing is left on disk after it


def mmap_state_dict(opt, scratch_dir: str | os.PathLike, *, host_views: bool = True) -> dict:
    """``opt.state_dict()`` whose off-host tensors are file mappings under ``scratch_dir``.

    Host-tier state is returned as views, as ``state_dict()`` does; state in other tiers
    (NVMe) is streamed into unlinked files of ``scratch_dir`` and mapped, so building the
    dict needs ``4 MiB`` of RAM beyond the page cache, whatever the state's size. Choose a
    ``scratch_dir`` on a filesystem with room for the off-host state (not a tmpfs).
    The result is an ordinary state dict: ``torch.save`` it, hand it to
    ``torch.distributed.checkpoint``, or ``load_state_dict`` it into another optimizer.

    ``host_views=False`` copies host-tier state into mapped files too, so that the dict
    shares no memory with ``opt``: the target to give ``dcp.load``, which writes into the
    tensors it is given, one after the other. With views a ``dcp.load`` that fails half way
    (a damaged file) leaves the live state half overwritten; with copies it stays as it
    was, and ``opt.load_state_dict(sd)`` applies a completed load, checking all of it first.
    """
    if not isinstance(host_views, bool):
        raise TypeError(f"host_views must be True or False, got {host_views!r}")
    if store_of(opt) is None:
        raise TypeError(f"opt is a {type(opt).__name__}; mmap_state_dict takes a tierstate optimizer "
                        "(other optimizers hold their state in RAM already: use opt.state_dict())")
    scratch = os.fspath(scratch_dir)
    os.makedirs(scratch, exist_ok=True)
    access = OffloadAccess(opt)
    sd = packed(opt)  # param_groups packed by torch; opt.state_dict() runs the hooks around this
    state = {}
    for info in access.describe():
        if not info.initialized:
            continue
        s = access.slots[info.index]
        entry = {}
        for key, dtype in info.keys.items():
            view = access.store.host_view(s, key) if host_views else None
            if view is not None:
                entry[key] = view
            else:
                numel = access.store.item_count(s, key)  # a block scale: one item per block
                pieces = access.read_state(info.index, key, max(1, _PIECE_BYTES // dtype.itemsize))
                mapped = _file_backed(scratch, numel, dtype, pieces)
                entry[key] = mapped.view(s.local.shape) if access.store.unit(key) == 1 else mapped
        if info.step is not None:
            entry["step"] = step_tensor(info.step, s.step_dtype)
        state[info.index] = entry
    state.update(entries_not_of_parameters(opt))
    sd["state"] = state
    return sd
