"""StateStore: every parameter's optimizer state, read and written by parameter and key.

The store is the one place that maps a parameter to the pieces of its state in the tiers
(through the layout's segments) and keeps each parameter's lifecycle (:mod:`.slots`).
The step pipeline asks it for sub-groups' views through the tiers; ``state_dict``,
``load_state_dict`` and the checkpoint streamer read and write through it, piece by piece,
so none of them needs to know which tier holds what.
"""
from __future__ import annotations

import contextlib

from typing import Callable, Iterator, Mapping, Sequence

import torch
from torch import Tensor

from ..io import first_noting_others
from ..placement import Layout, Segment, SubGroup
from .protocol import Tier
from .slots import MasterLife, Slot, StateLife


def fused_group(group: Mapping) -> bool:
    """Whether a parameter group asks for torch's fused or capturable implementation (which
    keep ``step`` in float32): tierstate runs its own kernels either way, only ``step``'s dtype follows."""
    return bool(group.get("fused") or group.get("capturable"))


def scalar_dtype(fused: bool = False) -> torch.dtype:
    """The dtype torch gives a new ``step`` (``torch.optim.optimizer._get_scalar_dtype``):
    float32 for a ``fused`` or ``capturable`` group, else float64 while the default dtype is
    float64 and float32 otherwise. Fixed when the state starts: a later change of the default
    dtype leaves it as it was."""
    if not fused and torch.get_default_dtype() == torch.float64:
        return torch.float64
    return torch.float32


def step_tensor(step: float, dtype: torch.dtype | None = None) -> Tensor:
    """``step`` as torch's optimizers keep it: a CPU scalar tensor of ``dtype`` (the slot's
    ``step_dtype``; None: :func:`scalar_dtype` of the moment)."""
    return torch.tensor(float(step), dtype=dtype or scalar_dtype())


def loaded_step_dtype(value, saved_fused: bool) -> torch.dtype:
    """The dtype of a ``step`` loaded from a state dict, as torch's ``load_state_dict`` leaves it:
    float32 where the saved group was fused or capturable, else a tensor keeps its own and a
    number (an old state dict) takes :func:`scalar_dtype` of the moment."""
    if saved_fused:
        return torch.float32
    return value.dtype if isinstance(value, Tensor) else scalar_dtype()


@contextlib.contextmanager
def resident_values(s: Slot, write: bool) -> Iterator[Tensor]:
    """The flat values of a parameter that is where it always is (its own storage)."""
    yield s.local.data.view(-1) if write else s.local.detach().reshape(-1)


class StateStore:
    """The state of one optimizer's parameters over its tiers.

    Args:
        slots: every parameter of the optimizer, in ``param_groups`` order.
        layout: the flat index space of the trainable ones, cut into sub-groups per tier.
        tiers: the tier holding each sub-group, by ``SubGroup.tier``.
        dtypes: the stored dtype of each state key (``master`` included where one exists).
        specs_of: a parameter group's index -> the rule's state specs for that group.
        values_of: ``(slot, write) ->`` a context manager yielding the flat values of the slot's
            parameter in host-addressable memory: the parameter itself by default; for a
            parameter whose weights stream (:mod:`tierstate.weights`), its block's host image.
        quant: the :class:`tierstate.kernels.quant.QuantConfig` of compressed state, or None.
            Each moment ``k`` of the rule is then stored as ``k.codes`` (uint8, one per
            element) and ``k.scale`` (fp32, one per block of ``quant.block_size`` elements of
            the parameter), and a master as ``master`` (fp32 or bf16) plus ``master.comp``
            (int16) for ``bf16_kahan``; a bf16 parameter that is its own bf16 master keeps
            only ``master.comp`` (:meth:`keeps_own_comp`); see :mod:`tierstate.kernels.quant`.
            Keys stored per block are counted in blocks ("items") by every method taking
            offsets or sizes.
        wide_dtypes: the stored dtype of each state key of the float64 parameters that lie
            beside narrower ones (the layout's ``wide`` ones; empty when none do).
    """

    def __init__(self, slots: Sequence[Slot], layout: Layout, tiers: Mapping, dtypes: Mapping[str, torch.dtype],
                 specs_of: Callable[[int], Sequence], values_of: Callable | None = None, quant=None,
                 sr_seed: int = 0, wide_dtypes: Mapping[str, torch.dtype] | None = None) -> None:
        self.values_of = values_of if values_of is not None else resident_values
        self.quant = quant
        self.sr_seed = sr_seed  # Offload.sr_seed: the stochastic rounding of a bf16_sr master
        # elements per stored item of each key stored per block (the moments' scales)
        self.units: dict[str, int] = {k: quant.block_size for k in dtypes if k.endswith(".scale")} if quant else {}
        self.slots = list(slots)
        self.layout = layout
        self.tiers: dict = dict(tiers)
        self.dtypes = dict(dtypes)
        self.wide_dtypes = dict(wide_dtypes or {})
        self._specs_of = specs_of
        self._slot_of = {s.param: s for s in self.slots}  # tensors hash by identity, as in torch.optim
        self._by_trainable = {s.trainable: s for s in self.slots if s.trainable is not None}
        self.params = [s.param for s in self.slots]  # in param_groups order (slots never change)

    # -- lookup ------------------------------------------------------------------------------
    def slot_of(self, param: Tensor) -> Slot | None:
        """The slot of ``param`` (this very tensor), or None."""
        s = self._slot_of.get(param)
        return s if s is not None and s.param is param else None

    def by_trainable(self, t: int) -> Slot:
        return self._by_trainable[t]

    def tier_of(self, sg: SubGroup) -> Tier:
        return self.tiers[sg.tier]

    def segments(self, s: Slot) -> tuple[Segment, ...]:
        return self.layout.segments_of(s.trainable) if s.trainable is not None else ()

    def is_wide(self, s: Slot) -> bool:
        """``s`` is a float64 parameter beside narrower ones: its state has dtypes of its own."""
        return bool(self.layout.wide) and s.trainable is not None and self.layout.wide[s.trainable]

    def dtypes_of(self, s: Slot) -> Mapping[str, torch.dtype]:
        """The stored dtype of each key of ``s``'s state."""
        return self.wide_dtypes if self.is_wide(s) else self.dtypes

    def dtype(self, s: Slot, key: str) -> torch.dtype:
        return self.dtypes_of(s)[key]

    def keys(self, s: Slot) -> list[str]:
        """The state keys of ``s`` (torch's names), plus ``master`` where it has one; with
        compressed state, the stored parts (``exp_avg.codes``, ``exp_avg.scale``, ...)."""
        names = [spec.name for spec in self._specs_of(s.group)]
        if self.quant is None:
            return names + (["master"] if s.needs_master else [])
        keys = [k for name in names for k in (self.quant.codes_key(name), f"{name}.scale")]
        if s.needs_master:
            keys.append("master")
        if self.quant.master == "bf16_kahan" and (s.needs_master or self.keeps_own_comp(s)):
            keys.append("master.comp")
        return keys

    def keeps_own_comp(self, s: Slot) -> bool:
        """``s`` is a bf16 parameter that is its own ``bf16_kahan`` master: its compensation
        (``master.comp``) is state like a moment, kept beside the parameter's own values."""
        return (self.quant is not None and self.quant.master == "bf16_kahan" and not s.needs_master
                and s.trainable is not None and "master.comp" in self.dtypes)

    def check_specs(self, groups: Sequence[Mapping]) -> None:
        """Refuse hyper-parameters changed since construction so that the rule now keeps a
        state that compressed storage has no place for (amsgrad=True adds max_exp_avg_sq)."""
        if self.quant is None:
            return
        for gi in range(len(groups)):
            for spec in self._specs_of(gi):
                if self.quant.codes_key(spec.name) not in self.dtypes:
                    raise ValueError(f"param_groups[{gi}] now asks for state {spec.name!r} (amsgrad=True with "
                                     "Offload(moment_dtype='q8')?): the 8-bit kernels keep exp_avg and exp_avg_sq "
                                     "only; set it back (amsgrad=False) or use moment_dtype=torch.float32")

    def held_keys(self, s: Slot) -> list[str]:
        """The keys whose values exist now: a master (and its compensation) only once it was
        filled; the compensation of a parameter that is its own master with the state."""
        return [k for k in self.keys(s) if not (s.needs_master and k.startswith("master")) or s.master.filled]

    def unit(self, key: str) -> int:
        """Elements per stored item of ``key``: the block size for a block's scale, else 1."""
        return self.units.get(key, 1)

    def item_count(self, s: Slot, key: str) -> int:
        """Stored items of ``key`` for ``s``: its element count, or its block count."""
        u = self.unit(key)
        return (s.local.numel() + u - 1) // u

    def bytes_per_element(self, s: Slot) -> tuple[float, float]:
        """(moments, master) bytes stored per element of ``s`` (a block's scale counts 4 / block)."""
        moments = master = 0.0
        for k in self.keys(s):
            b = self.dtype(s, k).itemsize / self.unit(k)
            if k.startswith("master"):
                master += b
            else:
                moments += b
        return moments, master

    def _pieces(self, s: Slot, key: str) -> Iterator[tuple[int, SubGroup, int, int]]:
        """(first item in the parameter, sub-group, first item in it, items) of each segment of ``s``."""
        u = self.unit(key)
        for seg in self.segments(s):
            sg = self.layout.subgroups[seg.subgroup]
            yield seg.param_offset // u, sg, seg.subgroup_offset // u, (seg.numel + u - 1) // u

    # -- reading and writing by parameter and key ---------------------------------------------
    def host_view(self, s: Slot, key: str) -> Tensor | None:
        """A view of ``s``'s state ``key`` in host memory, shaped like it, where one exists: the
        parameter lies wholly in a tier whose state is host memory."""
        if s.trainable is None or key not in self.dtypes_of(s):
            return None
        if not s.local.numel() and self.layout.wide:  # no segment, so no sub-group of its width to view
            return torch.empty(s.local.shape, dtype=self.dtype(s, key))
        if s.local.numel():
            kind = self.layout.tier_of_param(s.trainable)  # None: it straddles tiers
            tier = self.tiers.get(kind) if kind is not None else None
        else:  # no segment: any tier keeping host views gives its empty view
            tier = self._empty_param_tier()
        start = self.layout.param_starts[s.trainable]
        if tier is None or not tier.host_views or not tier.holds(key, start):
            return None
        view = tier.flat_range(key, start, s.local.numel())
        return view if self.unit(key) != 1 else view.view(s.local.shape)

    def _empty_param_tier(self):
        """The tier of a zero-size parameter (it has no segment): the first that keeps host views."""
        return next((t for t in self.tiers.values() if t.host_views), None)

    def read(self, s: Slot, key: str) -> Tensor:
        """State ``key`` of ``s`` as a CPU tensor shaped like the parameter (a view where one
        exists); a key stored per block (a scale) is flat, one item per block."""
        view = self.host_view(s, key)
        if view is not None:
            return view
        flat = self.read_flat(s, key)
        return flat if self.unit(key) != 1 else flat.view(s.local.shape)

    def read_flat(self, s: Slot, key: str, first: int = 0) -> Tensor:
        """A flat CPU copy of state ``key`` of ``s`` from item ``first`` on, read segment by
        segment from whichever tiers hold them."""
        out = torch.empty(self.item_count(s, key) - first, dtype=self.dtype(s, key))
        for p0, sg, offset, count in self._pieces(s, key):
            if p0 < first:
                continue
            out[p0 - first: p0 - first + count] = self.tiers[sg.tier].read_range(key, sg, offset, count)
        return out

    def read_pieces(self, s: Slot, key: str, piece_numel: int) -> Iterator[Tensor]:
        """State ``key`` of ``s`` in order, in pieces of at most ``piece_numel`` items (tier copies)."""
        for _, sg, offset, count in self._pieces(s, key):
            tier = self.tiers[sg.tier]
            for lo in range(0, count, piece_numel):
                yield tier.read_range(key, sg, offset + lo, min(piece_numel, count - lo))

    def write(self, s: Slot, key: str, value: Tensor) -> None:
        """Store the whole state ``key`` of ``s`` (any shape with its item count; converted to the key's dtype)."""
        self.write_at(s, key, 0, value.detach().reshape(-1).to("cpu"))

    def write_at(self, s: Slot, key: str, offset: int, values: Tensor) -> None:
        """Store flat ``values`` at item ``offset`` of state ``key`` of ``s``."""
        end = offset + values.numel()
        for p0, sg, sg_offset, count in self._pieces(s, key):
            lo, hi = max(offset, p0), min(end, p0 + count)
            if hi <= lo:
                continue
            self.tiers[sg.tier].write_range(key, sg, sg_offset + (lo - p0), values[lo - offset: hi - offset])

    # -- lifecycle (see [Note: the lifecycle of a parameter's state]) ---------------------------
    def reset_to_init(self, s: Slot, skip: Mapping | None = None) -> None:
        """Write the init value of each state key (except those given in ``skip``) where the
        regions may hold other values; the tiers start at the init values otherwise."""
        if not s.life.regions_dirty:
            return
        for spec in self._specs_of(s.group):
            stored = [spec.name] if self.quant is None else [self.quant.codes_key(spec.name), f"{spec.name}.scale"]
            for key in stored:
                if skip is not None and skip.get(key) is not None:
                    continue
                # compressed moments start at 0: codes 0 and scale 0 (Adam's only init value)
                init = spec.init if self.quant is None else 0.0
                # stride 0: no parameter-sized temporary (glibc would keep the freed heap as RSS)
                fill = torch.full((1,), init, dtype=self.dtype(s, key)).expand(self.item_count(s, key))
                self.write(s, key, fill)
        if self.keeps_own_comp(s) and (skip is None or skip.get("master.comp") is None):
            # the parameter holds its bf16 master exactly: nothing is left to compensate
            self.write(s, "master.comp", torch.zeros((1,), dtype=self.dtypes["master.comp"]).expand(s.local.numel()))

    def start_state(self, s: Slot, fused: bool = False) -> None:
        """First step of a parameter with a gradient: its state starts existing (torch semantics).
        ``fused``: its group asks for torch's fused or capturable implementation, whose ``step``
        is float32 whatever the default dtype."""
        self.reset_to_init(s)
        s.life = StateLife.AT_INIT
        s.step = 0
        s.step_dtype = scalar_dtype(fused)

    def forget(self, s: Slot) -> None:
        """``s``'s state stops existing (a load replaces it, or torch code dropped its
        ``optimizer.state`` entry): its next step starts it afresh from the init values, its
        master from the parameter."""
        s.life = s.life.forgotten()
        s.master, s.step, s.step_dtype = MasterLife.ABSENT, 0, None
        s.pending_pieces.clear()

    def forget_all(self) -> None:
        """Every state stops existing (a load replaces them all); no record need be read back."""
        for tier in self.tiers.values():
            tier.forget_state()
        for s in self.slots:
            self.forget(s)

    def fill_master(self, s: Slot) -> None:
        """Fill ``s``'s master from its parameter before its first update; pieces in I/O tiers
        stay pending (see [Note: the master copy's lifecycle])."""
        if not s.needs_master or s.master.filled:
            return
        segs = self.segments(s)
        io = [self.tiers[self.layout.subgroups[seg.subgroup].tier].does_io for seg in segs]
        for seg, does_io in zip(segs, io):
            if does_io:
                s.pending_pieces.add((seg.subgroup, seg.param_offset))
        if not all(io):
            with self.values_of(s, False) as flat:
                for seg, does_io in zip(segs, io):  # segment by segment: temporaries stay sub-group sized
                    if not does_io:
                        self._write_master_piece(flat, seg)
        s.master = MasterLife.PENDING if s.pending_pieces else MasterLife.READY

    def take_pending_master(self, s: Slot, seg: Segment, master_view: Tensor, values: Tensor,
                            comp_view: Tensor | None = None) -> None:
        """Copy a pending master piece into the sub-group views an update holds (then it is
        written); ``values``: the parameter's flat values (see ``values_of``); ``comp_view``:
        the piece's ``master.comp`` of a ``bf16_kahan`` master."""
        key = (seg.subgroup, seg.param_offset)
        if key in s.pending_pieces:
            piece = values[seg.param_offset: seg.param_offset + seg.numel]
            master_view.copy_(piece)
            if comp_view is not None:
                comp_view.copy_(self._comp_of(piece, master_view))
            s.pending_pieces.discard(key)
            if not s.pending_pieces:
                s.master = MasterLife.READY

    def _write_master_piece(self, flat: Tensor, seg: Segment) -> None:
        sg = self.layout.subgroups[seg.subgroup]
        tier = self.tiers[sg.tier]
        piece = flat[seg.param_offset: seg.param_offset + seg.numel]
        if not tier.on_device:  # a device tier copies straight from the parameter
            piece = piece.to("cpu", torch.float32)
        tier.write_range("master", sg, seg.subgroup_offset, piece)
        if self.quant is not None and self.quant.master == "bf16_kahan":
            master = tier.read_range("master", sg, seg.subgroup_offset, seg.numel)
            tier.write_range("master.comp", sg, seg.subgroup_offset, self._comp_of(piece, master))

    @staticmethod
    def _comp_of(values: Tensor, master: Tensor) -> Tensor:
        """int16 compensation of a bf16 master filled from ``values`` (0 for bf16 parameters)."""
        from ..kernels.quant import kahan_comp  # noqa: PLC0415 - tiers load kernels only for compressed state

        return kahan_comp(values.to("cpu", torch.float32), master)

    def write_pending_masters(self) -> None:
        """Write every pending master piece, so the tiers hold all the state (before any read)."""
        for s in self.slots:
            if not s.pending_pieces:
                continue
            with self.values_of(s, False) as flat:
                for seg in self.segments(s):
                    if (seg.subgroup, seg.param_offset) in s.pending_pieces:
                        self._write_master_piece(flat, seg)
            s.pending_pieces.clear()
            s.master = MasterLife.READY

    # -- whole states --------------------------------------------------------------------------
    def export(self, s: Slot, has_step: bool) -> dict:
        """``s``'s state as torch's dict of key -> tensor (host views where they exist)."""
        out = {key: self.read(s, key) for key in self.held_keys(s)}
        if has_step:
            out["step"] = step_tensor(s.step, s.step_dtype)
        return out

    def import_(self, s: Slot, state: Mapping, master_filled: bool | None = None, saved_fused: bool = False) -> None:
        """Make ``state`` (torch's dict of key -> tensor) ``s``'s state; keys it lacks start at init.
        ``saved_fused``: the group it was saved from was fused or capturable (:func:`loaded_step_dtype`)."""
        if not s.has_state:
            # Only keys the state dict lacks start from their init value: the given ones may be
            # this optimizer's own views (DCP loads in place), which a reset would wipe first.
            self.reset_to_init(s, skip=state)
            s.step, s.step_dtype = 0, scalar_dtype(saved_fused)
        s.life = StateLife.LIVE
        for key in self.keys(s):
            value = state.get(key)
            if value is None:
                continue
            if not isinstance(value, Tensor) or value.numel() != self.item_count(s, key):
                got = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
                want = (f"the parameter has shape {tuple(s.local.shape)}" if self.unit(key) == 1 else
                        f"it holds one item per block of {self.unit(key)}: {self.item_count(s, key)}")
                raise ValueError(f"load_state_dict: state {key!r} of parameter {s.index} has shape {got}, {want}")
            self.write(s, key, value)
        if "step" in state:
            s.step = int(float(state["step"]))
            s.step_dtype = loaded_step_dtype(state["step"], saved_fused)
        filled = ("master" in state) if master_filled is None else master_filled
        s.master = MasterLife.READY if filled else MasterLife.ABSENT
        s.pending_pieces.clear()

    def commit_loaded(self, s: Slot, keys: set, step: float | None, fused: bool = False) -> None:
        """``s`` has all of ``keys`` written by a streaming load: it has state, as after a step.
        The checkpoint keeps ``step`` as a number: its dtype is :func:`scalar_dtype` of the moment."""
        s.life = StateLife.LIVE
        s.step = int(step) if step is not None else 0
        s.step_dtype = scalar_dtype(fused)
        s.master = MasterLife.READY if ("master" in keys and s.needs_master) else MasterLife.ABSENT
        s.pending_pieces.clear()
        if "master.comp" in self.keys(s) and "master.comp" not in keys and (not s.needs_master or "master" in keys):
            # a bf16 master saved without compensation (bf16_sr) is exact as it is: nothing to
            # compensate (a master not saved at all is filled from the parameter, with its own)
            self.write(s, "master.comp", torch.zeros((1,), dtype=self.dtypes["master.comp"]).expand(s.local.numel()))

    # -- the tiers as a whole ------------------------------------------------------------------
    def settle(self) -> None:
        for tier in self.tiers.values():
            tier.settle()

    def take_write_errors(self) -> BaseException | None:
        return first_noting_others([t.take_write_errors() for t in self.tiers.values()])

    def lost_error(self) -> BaseException | None:
        return next((e for t in self.tiers.values() if (e := t.lost_error()) is not None), None)

    def nbytes_by_tier(self) -> dict[str, int]:
        return {kind.value: tier.nbytes for kind, tier in self.tiers.items()}

    def nvme_gauges(self) -> dict[str, float]:
        """``nvme_params``: parameters (elements) whose state lives in the NVMe tier;
        ``nvme_record_bytes_per_param``: bytes of their records (all keys, region alignment
        included) per parameter: what one read or one write of the tier moves per parameter.
        Empty without an NVMe tier."""
        from ..placement import TierKind  # noqa: PLC0415

        tier = self.tiers.get(TierKind.NVME)
        if tier is None:
            return {}
        n = sum(seg.numel for sg in self.layout.subgroups if sg.tier is TierKind.NVME for seg in sg.segments)
        return {"nvme_params": float(n), "nvme_record_bytes_per_param": tier.nbytes / n if n else 0.0}

    @property
    def pinned_nbytes(self) -> int:
        return sum(t.pinned_nbytes for t in self.tiers.values())

    @property
    def spill_folder(self):
        """Where a state dict too large for RAM is mapped from (the first I/O tier's), or None."""
        return next((t.spill_folder for t in self.tiers.values() if t.spill_folder is not None), None)

    @property
    def spilled_nbytes(self) -> int:
        """Bytes of state held outside memory (what a state dict must read from storage)."""
        return sum(t.nbytes for t in self.tiers.values() if t.does_io)

    def close(self) -> None:
        for tier in self.tiers.values():
            tier.close()
        self.tiers = {}
