"""Where the NVMe tier's records live: the byte layout of one record and the stripes over files.

[Note: records, files and stripes]
Each NVMe sub-group owns one *record* on disk holding all its state keys back to back,
``[master | exp_avg | exp_avg_sq]`` for AdamW with a master, each region starting on a
4 KiB boundary so that every region is a valid O_DIRECT target and a host view of it is
aligned for any dtype. A record moves in one request (the engine splits it into
block-size tasks), so one 16 Mi-element AdamW record is a 192 MiB sequential read and a
192 MiB sequential write per step. With several ``nvme_dir`` folders the sub-groups are
dealt round-robin, one file per folder: sub-group ``r`` of the tier goes to file
``r % len(dirs)`` at slot ``r // len(dirs)``, so consecutive sub-groups hit different
drives and the reads of k+1 and the writes of k-1 run on different disks.
"""
from __future__ import annotations

from typing import Mapping

import torch
from torch import Tensor

from ..placement import SubGroup

# Every region of a record starts on this boundary: the O_DIRECT offset/length
# alignment of every Linux filesystem (statx DIOALIGN reports 512 or 4096 on NVMe).
ALIGN = 4096


def align_up(n: int, a: int = ALIGN) -> int:
    """``n`` rounded up to a multiple of ``a``."""
    return (n + a - 1) // a * a


def nonzero_start(value: float, dtype: torch.dtype) -> bool:
    """Whether ``value`` stored as ``dtype`` has any non-zero byte (``-0.0`` does): such a
    start value must be written, zeros are what fallocate'd space already reads as."""
    return bool(torch.tensor(value, dtype=dtype).view(-1).view(torch.uint8).any())


class RecordLayout:
    """Byte layout of one sub-group's record: ``{key: (offset, nbytes)}`` and its size.

    Pure arithmetic, shared by the buffers (views) and the files (offsets)."""

    def __init__(self, keys: list[str], dtypes: Mapping[str, torch.dtype], numel: int,
                 units: Mapping[str, int] | None = None) -> None:
        self.numel = numel
        self.regions: dict[str, tuple[int, int]] = {}
        cursor = 0
        units = units or {}
        for key in keys:
            unit = units.get(key, 1)  # elements per item: a block's scale covers `unit` elements
            nbytes = (numel + unit - 1) // unit * torch.empty((), dtype=dtypes[key]).element_size()
            self.regions[key] = (cursor, nbytes)
            cursor = align_up(cursor + nbytes)
        self.nbytes = cursor


class InitialImage:
    """Builds the bytes a fresh record holds (what the tier's initial write leaves in the
    file): zeros, and each key whose start value is not all-zero bytes filled with it over
    its region and the region's padding."""

    def __init__(self, keys: list[str], dtypes: Mapping[str, torch.dtype], inits: Mapping[str, float]) -> None:
        self.fills = [(key, dtypes[key], inits.get(key, 0.0)) for key in keys
                      if nonzero_start(inits.get(key, 0.0), dtypes[key])]

    def __call__(self, rec: RecordLayout, into: Tensor) -> Tensor:
        image = into[: rec.nbytes]
        image.zero_()
        for key, dtype, value in self.fills:
            start, nbytes = rec.regions[key]
            image[start: start + align_up(nbytes)].view(dtype).fill_(value)
        return image


class Stripes:
    """Where each sub-group's record lives: (file index, byte offset, layout); see the note.

    Shared by the tier and its buffer pool (which must not hold the tier itself, or the
    tier's finalizer could never run)."""

    def __init__(self, subgroups: list[SubGroup], keys: list[str], dtypes: Mapping[str, torch.dtype],
                 nfiles: int, units: Mapping[str, int] | None = None) -> None:
        self.keys, self.dtypes, self.nfiles = keys, dtypes, nfiles
        self.units = dict(units or {})
        self._rank = {sg.index: r for r, sg in enumerate(subgroups)}
        self._records: dict[int, RecordLayout] = {}
        self.stride = RecordLayout(keys, dtypes, max(sg.numel for sg in subgroups), self.units).nbytes

    def record(self, sg: SubGroup) -> RecordLayout:
        rec = self._records.get(sg.numel)
        if rec is None:
            rec = self._records[sg.numel] = RecordLayout(self.keys, self.dtypes, sg.numel, self.units)
        return rec

    def __call__(self, sg: SubGroup) -> tuple[int, int, RecordLayout]:
        rank = self._rank[sg.index]
        return rank % self.nfiles, (rank // self.nfiles) * self.stride, self.record(sg)


__all__ = ["ALIGN", "InitialImage", "RecordLayout", "Stripes", "align_up", "nonzero_start"]
