"""HostTier: optimizer state resident in host RAM (pinned when a CUDA device is used)."""
from __future__ import annotations

import bisect
from typing import Mapping

import torch
from torch import Tensor

from .. import io as tio
from ..placement import Layout, SubGroup, TierKind


_SLICE_ALIGN = 64  # bytes; one cache line, and the AVX-512 vector width, per slice


def item_range(unit: int, lo: int, numel: int) -> tuple[int, int]:
    """Items ``[first, end)`` of a key stored one item per ``unit`` elements (the scale of a
    block of compressed state: unit = the block size) that cover elements ``[lo, lo + numel)``;
    ``lo`` is a multiple of ``unit`` (see [Note: block-aligned layouts] in tierstate.placement.layout)."""
    return lo // unit, (lo + numel + unit - 1) // unit


def host_buffer(nbytes: int, *, pin_memory: bool, zero: bool = True) -> Tensor:
    """``nbytes`` of host memory (uint8), zeroed unless ``zero=False``: page-locked when a
    CUDA device copies from it, else on transparent huge pages (see the note).

    [Note: huge pages for host state]
    The host step streams every byte of the state once (28 B/param for bf16 AdamW). Over
    4 KiB pages that is a page walk every 4 KiB (344 K walks for 50M parameters, far beyond
    the second-level TLB's reach of ~12 MB); over 2 MiB pages, 700. Measured on a 2-vCPU
    Zen 4 (AMD EPYC), the fused AdamW kernel over 50M fp32 params in 4 Mi sub-groups,
    22 interleaved rounds, medians: 32.1 ms on torch's allocations against 25.7 ms on huge
    pages in one run, 29.8 against 27.7 ms in the next (the machine is shared; the order
    held in both). Memory a CUDA device copies from is page-locked as well
    (:func:`tierstate.io.page_locked_empty`: the same huge-page mapping, registered with
    CUDA, with no power-of-two rounding), and without the native module torch's allocator
    is used.
    """
    if pin_memory and nbytes:
        buf = tio.page_locked_empty(nbytes, _SLICE_ALIGN)
        return buf.zero_() if zero else buf
    if nbytes == 0 or not tio.engine_available():
        make = torch.zeros if zero else torch.empty
        return make(nbytes, dtype=torch.uint8)
    buf = tio.aligned_empty(nbytes, _SLICE_ALIGN)  # huge pages from one huge page on (aligned_empty's default)
    if zero:
        buf.zero_()
    return buf


def sole_owner(param: Tensor, nbytes: int) -> bool:
    """Whether ``param`` is the only tensor on its storage and spans all of it. Any other
    tensor on it (a view a user keeps, a tensor saved by an autograd graph, a base tensor the
    parameter views) holds a reference to the storage: 2 references are the parameter's and
    the storage object asked here. Without torch's use count, the answer is no."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    storage = param.untyped_storage()
    return use_count is not None and storage.nbytes() == nbytes and use_count(storage._cdata) == 2


def move_to_huge_pages(param: Tensor) -> bool:
    """Give a CPU parameter fresh storage on transparent huge pages, its values copied (True), or
    leave it as it is (False): where huge pages would not cover it (smaller than one huge page,
    no THP, no native module), where it already starts a huge page of memory the kernel may back
    with them (moved before, or THP "always"), or where its storage is not its own (a view, or a
    storage it shares), since other tensors would keep the old values. Alignment alone is not
    enough: torch's allocator placed a 4 MiB embedding on a 2 MiB boundary of the plain heap,
    which under THP "madvise" stays on 4 KiB pages (see :func:`tierstate.io.huge_page_eligible`).

    [Note: an fp32 host parameter is its own master, so it moves]
    An fp32 parameter on the CPU is updated in place by the host step: 8 of the 28 B/param the
    AdamW step moves are its read and write, the moments' 16 are on huge pages already (see
    [Note: huge pages for host state]). Its storage is torch's, on 4 KiB pages. The optimizer
    therefore moves such a parameter once, at construction, as FSDP and ZeRO move parameters
    into their flat buffers: ``param.data`` is replaced, the Parameter object, its name,
    hooks and ``requires_grad`` stay, and ``data_ptr()`` changes once. A parameter that any
    other tensor shares storage with (a view kept by the user, a tied copy that is not the same
    Parameter) stays where it is, so that tensor keeps seeing the updates. The gradients stay
    where autograd puts them (4 of the 28 B). Measured on a 2-vCPU Zen 4 (AMD EPYC), GPT-2
    124M in fp32, batch 2 x 256, three interleaved runs, median of 6 steps each: ``opt.step()``
    42.7 / 43.4 / 44.2 ms with the parameters moved, 44.8 / 46.0 / 47.0 ms without, torch's
    fused AdamW 47.8 / 48.0 / 49.0 ms.
    """
    page = tio.huge_page_size() if tio.engine_available() else 0
    nbytes = param.numel() * param.element_size()
    if (page <= 0 or nbytes < page or param.device.type != "cpu"
            or not param.is_contiguous() or param.storage_offset() != 0 or not sole_owner(param, nbytes)):
        return False
    if param.data_ptr() % page == 0 and tio.huge_page_eligible(param.data_ptr()):
        return False  # the aligned case is rare (a moved parameter): only it pays for reading smaps
    home = tio.aligned_empty(nbytes, page).view(param.dtype).view(param.shape)
    home.copy_(param.detach())
    param.data = home
    return True


def packed_arena(tensors: list[Tensor], *, pin_memory: bool, zero: bool) -> tuple[Tensor, list[Tensor]]:
    """One host buffer holding a flat slice per tensor (its dtype and numel), each slice
    64-byte aligned. One allocation instead of one per tensor: one mapping, and on CUDA one
    registration (torch's pinned allocator, the fallback there, rounds every allocation up
    to a power of two, which per tensor would waste up to half)."""
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += (t.numel() * t.element_size() + _SLICE_ALIGN - 1) // _SLICE_ALIGN * _SLICE_ALIGN
    arena = host_buffer(total, pin_memory=pin_memory, zero=zero)
    views = [arena[o: o + t.numel() * t.element_size()].view(t.dtype) for o, t in zip(offsets, tensors)]
    return arena, views


class ArenaTier:
    """State in memory, one flat tensor ("arena") per state key over the tier's range.

    Sub-group ``sg`` owns ``arena[key][sg.tier_offset : sg.tier_offset + sg.numel]``; a key
    stored one item per ``units[key]`` elements (a block's scale) owns the items covering
    that range (:func:`item_range`). ``acquire``/``release`` cost nothing here; they exist so
    the step pipeline treats every tier alike. Subclasses fill ``self.arenas``.
    """

    arenas: dict[str, Tensor]
    units: dict[str, int] = {}
    does_io = False  # acquire never waits
    wait_phase = None
    spill_folder = None  # state dicts of memory tiers are views or plain tensors, never files

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() for a in self.arenas.values())

    @property
    def pinned_nbytes(self) -> int:
        return sum(a.untyped_storage().nbytes() for a in self.arenas.values() if a.is_pinned())

    def schedule(self, subgroups: list[SubGroup], keep_order: bool = False) -> list[SubGroup]:
        """In-memory state needs no read-ahead; any order is as good: the given one."""
        return list(subgroups)

    def ready(self, sg: SubGroup) -> bool:
        """Always: the state is in memory."""
        return True

    def arenas_of(self, sg: SubGroup) -> dict[str, Tensor]:
        """The arenas holding ``sg``'s state: one per key (a wide tier: those of its width)."""
        return self.arenas

    def offset_of(self, sg: SubGroup) -> int:
        """``sg``'s first element in its arenas."""
        return sg.tier_offset

    def holds(self, key: str, flat_start: int) -> bool:
        """Whether the arenas holding flat index ``flat_start`` hold ``key`` (host views only)."""
        return key in self.arenas

    def acquire(self, sg: SubGroup) -> dict[str, Tensor]:
        """Views of the sub-group's state (no copy)."""
        out = {}
        first = self.offset_of(sg)
        for k, a in self.arenas_of(sg).items():
            lo, hi = item_range(self.units.get(k, 1), first, sg.numel)
            out[k] = a[lo:hi]
        return out

    def _items(self, key: str, sg: SubGroup, offset: int) -> int:
        """The arena index of item ``offset`` of ``key`` inside ``sg``."""
        return self.offset_of(sg) // self.units.get(key, 1) + offset

    def release(self, sg: SubGroup, dirty: bool) -> None:
        """Nothing to write back: the views are the storage."""

    # memory cannot fail as a disk does: nothing to settle, report or forget
    def settle(self) -> None:
        """No write can have failed."""

    def take_write_errors(self) -> None:
        return None

    def lost_error(self) -> None:
        return None

    def forget_state(self) -> None:
        """Nothing to drop: a load overwrites the arenas in place."""


class HostTier(ArenaTier):
    """One flat host buffer ("arena") per state key over the host range of the layout.

    Sub-group ``sg`` owns ``arena[key][sg.tier_offset : sg.tier_offset + sg.numel]``; a
    parameter that lies wholly in the host range has a contiguous view in every arena,
    which is what ``optimizer.state[p]`` exposes. ``acquire``/``release`` cost nothing here;
    they exist so the step pipeline treats every tier alike.
    """

    kind = TierKind.HOST
    on_device = False
    host_views = True

    def __init__(self, layout: Layout, dtypes: Mapping[str, torch.dtype], inits: Mapping[str, float],
                 pin_memory: bool = False, units: Mapping[str, int] | None = None,
                 wide_dtypes: Mapping[str, torch.dtype] | None = None) -> None:
        self.layout = layout
        self.numel = layout.tier_numel[TierKind.HOST]
        self.units = dict(units or {})
        own = [sg for sg in layout.subgroups if sg.tier is TierKind.HOST]
        # With float64 parameters beside narrower ones (``wide_dtypes``: their keys' dtypes),
        # each width has its own arenas, over its own sub-groups laid end to end: sub-group
        # ``sg`` starts at ``self._offsets[sg.index]`` in the arenas of its width.
        self._offsets: dict[int, int] = {}
        counts = {False: 0, True: 0}
        for sg in own:
            self._offsets[sg.index] = counts[sg.wide]
            counts[sg.wide] += sg.numel
        self.arenas = self._make_arenas(dtypes, inits, counts[False], pin_memory)
        self.wide_arenas = self._make_arenas(wide_dtypes or {}, inits, counts[True], pin_memory)
        self._starts = [sg.start for sg in own]  # sorted: the flat index of each sub-group's first element
        self._own = own

    def _make_arenas(self, dtypes: Mapping[str, torch.dtype], inits: Mapping[str, float], numel: int,
                     pin_memory: bool) -> dict[str, Tensor]:
        arenas = {}
        for key, dtype in dtypes.items():
            # host_buffer zeroes every page, so the arenas count in RSS from construction on (as
            # they would after the first step anyway): memory trouble shows at once, not mid-run.
            items = item_range(self.units.get(key, 1), 0, numel)[1]
            arena = host_buffer(items * dtype.itemsize, pin_memory=pin_memory).view(dtype)
            if inits.get(key, 0.0) != 0.0:
                arena.fill_(inits[key])
            arenas[key] = arena
        return arenas

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() for a in (*self.arenas.values(), *self.wide_arenas.values()))

    @property
    def pinned_nbytes(self) -> int:
        return sum(a.untyped_storage().nbytes() for a in (*self.arenas.values(), *self.wide_arenas.values())
                   if a.is_pinned())

    def arenas_of(self, sg: SubGroup) -> dict[str, Tensor]:
        return self.wide_arenas if sg.wide else self.arenas

    def offset_of(self, sg: SubGroup) -> int:
        return self._offsets[sg.index]

    def _subgroup_at(self, flat: int) -> SubGroup:
        """The host sub-group holding flat index ``flat`` (the last one for its end)."""
        return self._own[max(bisect.bisect_right(self._starts, flat) - 1, 0)]

    def holds(self, key: str, flat_start: int) -> bool:
        """Whether the arenas of the width at flat index ``flat_start`` hold ``key``."""
        return bool(self._own) and key in self.arenas_of(self._subgroup_at(flat_start))

    def drain(self) -> None:
        """No writes in flight."""

    def flush(self) -> None:
        """Nothing to write back."""

    def read_range(self, key: str, sg: SubGroup, offset: int, numel: int) -> Tensor:
        """``numel`` items of ``key`` from item ``offset`` inside sub-group ``sg`` (a view)."""
        lo = self._items(key, sg, offset)
        return self.arenas_of(sg)[key][lo: lo + numel]

    def write_range(self, key: str, sg: SubGroup, offset: int, values: Tensor) -> None:
        """Store ``values`` (converted to the key's dtype) at item ``offset`` inside sub-group ``sg``."""
        lo = self._items(key, sg, offset)
        self.arenas_of(sg)[key][lo: lo + values.numel()].copy_(values)

    def flat_range(self, key: str, flat_start: int, numel: int) -> Tensor:
        """A view of the items of ``key`` that cover ``numel`` elements from flat index
        ``flat_start`` (elements of one width: one parameter's, whose sub-groups follow each
        other in the arenas of its width)."""
        sg = self._subgroup_at(flat_start)
        lo, hi = item_range(self.units.get(key, 1), self.offset_of(sg) + flat_start - sg.start, numel)
        return self.arenas_of(sg)[key][lo:hi]

    def close(self) -> None:
        self.arenas.clear()
        self.wide_arenas.clear()
