"""Sub-group partitioning: which elements of the optimizer state live in which tier.

Pure arithmetic over parameter sizes (no tensors, no I/O), so it is tested alone.

[Note: the flat index space]
The trainable parameters, in ``param_groups`` order, are laid end to end in one flat
index space of ``total`` elements. The space is cut into three contiguous ranges, one
per tier (device, host, nvme, in that order), whose lengths are the policy's fractions
of ``total`` rounded to whole elements; each range is then chopped into sub-groups of at
most ``subgroup_numel`` elements. A parameter may straddle sub-groups (GPT-2's 38.6M
element embedding spans three 16M sub-groups) and even tiers; every piece of it is a
:class:`Segment`. Optimizer kernels are elementwise, so a parameter updated segment by
segment is updated exactly as if it were updated whole.

A sub-group never mixes widths: where float64 parameters lie beside narrower ones (``wide``),
a sub-group also ends where the width changes, and is marked ``wide`` when its state is
float64 (see [Note: float64 parameters] in tierstate.pipeline.assembly).

[Note: block-aligned layouts]
With ``align > 1`` every parameter starts at a multiple of ``align`` in the flat space (the
elements between the end of one and the start of the next are padding that no parameter
owns), the device and NVMe ranges are rounded to multiples of it, and ``subgroup_numel``
must be one, so every sub-group and every piece of a parameter starts on such a multiple
too. Compressed state uses its block size (a block's scale then covers elements of one
parameter only, and a piece is whole blocks); complex parameters use 2, so that the state
of one, stored as its real view, is viewed as complex numbers (``torch.view_as_complex``
needs an even offset) in ``optimizer.state``.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence


class TierKind(enum.Enum):
    """Where a sub-group's optimizer state lives."""

    DEVICE = "device"  # accelerator memory; updated by torch's fused kernels on the device
    HOST = "host"  # host RAM (pinned when a CUDA device is used); native kernels
    NVME = "nvme"  # files under nvme_dir, streamed through a bounded host buffer pool


TIER_ORDER = (TierKind.DEVICE, TierKind.HOST, TierKind.NVME)


@dataclass(frozen=True)
class Segment:
    """The part of one parameter that falls into one sub-group."""

    param_index: int  # index into Layout.param_numels
    param_offset: int  # first element of the piece, in the flattened parameter
    subgroup: int  # index into Layout.subgroups
    subgroup_offset: int  # first element of the piece, inside the sub-group
    numel: int


@dataclass(frozen=True)
class SubGroup:
    """A contiguous run of the flat index space, held by one tier."""

    index: int
    tier: TierKind
    start: int  # first element in the flat index space
    numel: int
    tier_offset: int  # first element inside its tier's own range
    segments: tuple[Segment, ...]
    wide: bool = False  # its parameters are float64 beside narrower ones: float64 state


@dataclass(frozen=True)
class Layout:
    param_numels: tuple[int, ...]
    param_starts: tuple[int, ...]  # flat index of each parameter's first element
    subgroups: tuple[SubGroup, ...]
    tier_numel: dict  # TierKind -> elements held by that tier
    total: int
    align: int = 1  # parameters start, and tiers are cut, at multiples of this (see the note)
    subgroup_numel: int = 0  # the largest sub-group asked for (plan_layout's argument)
    wide: tuple[bool, ...] = ()  # per parameter: float64 beside narrower ones (empty: none is)

    def segments_of(self, param_index: int) -> list[Segment]:
        return self._param_segments[param_index]

    def tier_of_param(self, param_index: int) -> TierKind | None:
        """The tier holding all of a parameter, or None when it straddles tiers (or is empty)."""
        tiers = {self.subgroups[s.subgroup].tier for s in self.segments_of(param_index)}
        return tiers.pop() if len(tiers) == 1 else None

    def __post_init__(self) -> None:
        per_param: list[list[Segment]] = [[] for _ in self.param_numels]
        for sg in self.subgroups:
            for seg in sg.segments:
                per_param[seg.param_index].append(seg)
        object.__setattr__(self, "_param_segments", per_param)


def tier_sizes(total: int, fractions: dict, align: int = 1) -> dict:
    """Elements per tier for fractions summing to 1, rounded so the sizes sum to ``total``.

    Device and NVMe sizes are rounded to the nearest multiple of ``align`` elements; the host
    takes the rest, so an ``Offload(cpu=1.0)`` never loses an element to rounding.
    """
    device = round(total * fractions.get(TierKind.DEVICE, 0.0) / align) * align
    nvme = round(total * fractions.get(TierKind.NVME, 0.0) / align) * align
    nvme = min(nvme, total - device)
    return {TierKind.DEVICE: device, TierKind.HOST: total - device - nvme, TierKind.NVME: nvme}


def plan_layout(param_numels: Sequence[int], fractions: dict, subgroup_numel: int, align: int = 1,
                wide: Sequence[bool] = ()) -> Layout:
    """Cut the flat index space of ``param_numels`` into tiered sub-groups.

    Args:
        param_numels: element count of each trainable parameter, in order (zeros allowed).
        fractions: TierKind -> fraction of the elements to place there (sums to 1).
        subgroup_numel: the largest sub-group, in elements.
        align: the block size of compressed state, or 2 where a parameter is complex (its
            state is viewed as complex numbers, two elements each); 1: none. See the
            note above.
        wide: per parameter, whether its state is float64 beside narrower state (empty: none);
            sub-groups then also end where the width changes.
    """
    if subgroup_numel <= 0:
        raise ValueError(f"subgroup_numel={subgroup_numel}: must be positive")
    if align < 1 or subgroup_numel % align:
        raise ValueError(f"plan_layout(subgroup_numel={subgroup_numel}, align={align}): align must be >= 1 and "
                         "divide subgroup_numel")
    numels = tuple(int(n) for n in param_numels)
    wide = tuple(bool(w) for w in wide) if any(wide) else ()
    if wide and len(wide) != len(numels):
        raise ValueError(f"plan_layout: wide has {len(wide)} flags for {len(numels)} parameters")
    starts, acc = [], 0
    for n in numels:
        starts.append(acc)
        acc += (n + align - 1) // align * align
    total = acc
    sizes = tier_sizes(total, fractions, align)
    # where the width changes (the first element of each parameter of the other width than the
    # one before it), with the width from there on; empty parameters change nothing
    changes: list[tuple[int, bool]] = []
    for p, n in enumerate(numels):
        if wide and n and (not changes or changes[-1][1] != wide[p]):
            changes.append((starts[p], wide[p]))

    subgroups: list[SubGroup] = []
    tier_start = 0
    param_cursor = 0  # first parameter that may overlap the next sub-group
    for tier in TIER_ORDER:
        size = sizes[tier]
        offset = 0
        while offset < size:
            n = min(subgroup_numel, size - offset)
            start = tier_start + offset
            width = False
            for at, w in changes:  # the width at start, and the sub-group's end at the next change
                if at <= start:
                    width = w
                elif at < start + n:
                    n = at - start
                    break
                else:
                    break
            end = start + n
            segs = []
            while param_cursor < len(numels) and starts[param_cursor] + numels[param_cursor] <= start:
                param_cursor += 1
            p = param_cursor
            while p < len(numels) and starts[p] < end:
                lo = max(start, starts[p])
                hi = min(end, starts[p] + numels[p])
                if hi > lo:
                    segs.append(Segment(p, lo - starts[p], len(subgroups), lo - start, hi - lo))
                p += 1
            subgroups.append(SubGroup(len(subgroups), tier, start, n, offset, tuple(segs), width))
            offset += n
        tier_start += size
    return Layout(numels, tuple(starts), tuple(subgroups), sizes, total, align, subgroup_numel, wide)
