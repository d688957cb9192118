"""Where a model's tensors come from: safetensors files read a tensor at a time, or the
tensors of a model object already in memory.

A safetensors tensor is read with ``os.preadv`` straight into the destination buffer (the
layer's host image or a resident tensor), not through a memory map: pages touched through a
map count in the process's RSS until unmapped, and for a model larger than RAM that is the
whole model.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Iterator

import torch
from torch import Tensor

from ..io.errors import from_oserror
from ..weights.export import _DTYPES, _read_header

_CODES = {code: dtype for dtype, code in _DTYPES.items()}
_READ_CHUNK = 64 << 20  # one preadv call moves at most this many bytes (Linux caps a call near 2 GiB)


class SafetensorsSource:
    """The tensors of one checkpoint folder (``model.safetensors``, or the shards listed in
    ``model.safetensors.index.json``) or of one ``.safetensors`` file."""

    def __init__(self, path: Path) -> None:
        path = Path(path)
        if path.is_dir():
            index = path / "model.safetensors.index.json"
            single = path / "model.safetensors"
            if single.is_file():
                files = [single]
            elif index.is_file():
                try:
                    weight_map = json.loads(index.read_text())["weight_map"]
                except (ValueError, KeyError) as exc:
                    raise ValueError(f"{index} is not a safetensors index (no readable weight_map: {exc})") from None
                files = [path / f for f in dict.fromkeys(weight_map.values())]
            else:
                raise FileNotFoundError(2, "no model.safetensors or model.safetensors.index.json in the folder: "
                                        "save the model with save_pretrained(..., safe_serialization=True)", str(path))
        elif path.is_file():
            files = [path]
        else:
            raise FileNotFoundError(2, "no such checkpoint folder or safetensors file", str(path))
        self.files = files
        self.entries: dict[str, tuple[Path, torch.dtype, tuple[int, ...], int, int]] = {}
        for f in files:
            header = _read_header(f)
            with open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
            base = 8 + n
            for name, info in header.items():
                dtype = _CODES.get(info.get("dtype"))
                if dtype is None:
                    raise ValueError(f"{f}: tensor {name!r} has dtype {info.get('dtype')!r}, which tierstate "
                                     f"cannot read (it reads {', '.join(sorted(_CODES))})")
                begin, end = info["data_offsets"]
                self.entries[name] = (f, dtype, tuple(info["shape"]), base + begin, end - begin)
        self._fds: dict[Path, int] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def names(self) -> list[str]:
        return list(self.entries)

    def spec(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        _, dtype, shape, _, _ = self.entries[name]
        return dtype, shape

    def read_into(self, name: str, out: Tensor) -> None:
        """Fill ``out`` (contiguous, on CPU) with tensor ``name``, cast to ``out``'s dtype."""
        path, dtype, shape, offset, nbytes = self.entries[name]
        if out.numel() != _numel(shape):
            raise ValueError(f"{path}: tensor {name!r} has shape {list(shape)}, the model expects "
                             f"{list(out.shape)}: the checkpoint is of another configuration")
        target = out if out.dtype == dtype else torch.empty(out.shape, dtype=dtype)
        raw = target.reshape(-1).view(torch.uint8)
        fd = self._fds.get(path)
        if fd is None:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as exc:
                raise from_oserror(exc, str(path), None, "open") from exc
            self._fds[path] = fd
        view = memoryview(raw.numpy())
        done = 0
        while done < nbytes:
            take = min(_READ_CHUNK, nbytes - done)
            try:
                got = os.preadv(fd, [view[done:done + take]], offset + done)
            except OSError as exc:
                raise from_oserror(exc, str(path), offset + done, "read") from exc
            if got == 0:
                raise ValueError(f"{path} ends inside tensor {name!r} (byte {offset + done}): the file is truncated")
            done += got
        if target is not out:
            out.copy_(target)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class ModuleSource:
    """The tensors of a model object in memory (its ``state_dict``, tied names included)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._tensors = dict(model.state_dict())

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def names(self) -> list[str]:
        return list(self._tensors)

    def spec(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        t = self._tensors[name]
        return t.dtype, tuple(t.shape)

    def read_into(self, name: str, out: Tensor) -> None:
        t = self._tensors[name]
        if t.numel() != out.numel():
            raise ValueError(f"tensor {name!r} has shape {list(t.shape)}, the model expects {list(out.shape)}")
        out.copy_(t.detach().reshape(out.shape))

    def close(self) -> None:
        self._tensors.clear()


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def iter_aliases(model: torch.nn.Module) -> Iterator[tuple[str, list[str]]]:
    """(first name, every name) of each parameter and persistent buffer: a tied weight
    (GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``) appears once with both names."""
    groups: dict[int, list[str]] = {}
    order: list[int] = []
    for name, t in model.state_dict(keep_vars=True).items():
        key = id(t)
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append(name)
    for key in order:
        yield groups[key][0], groups[key]
