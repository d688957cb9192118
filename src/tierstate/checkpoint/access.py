"""Piecewise access to an optimizer's state, whatever holds it, in bounded pieces.

Two faces, one interface:

* :class:`OffloadAccess` for tierstate optimizers: reads and writes each parameter's
  state through the optimizer's :class:`~tierstate.tiers.StateStore` (a view for host
  memory, a pool-buffer copy for the NVMe tier), never more than ``piece_numel``
  elements at a time.
* :class:`TorchAccess` for any other ``torch.optim.Optimizer`` (e.g. ``torch.optim.AdamW``):
  its state already is in RAM, so it goes through ``state_dict``/``load_state_dict``.

Parameters are numbered as in ``optimizer.state_dict()``: in ``param_groups`` order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
from torch import Tensor

from ..tiers import StateStore, fused_group, step_tensor
from ..kernels import quant as Q
from .compressed import PART_SUFFIXES


@dataclass(frozen=True)
class ParamInfo:
    """What the manifest records of one parameter."""

    index: int
    group: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    initialized: bool  # has optimizer state (torch: an entry in optimizer.state)
    step: float | None  # the per-parameter step (None for rules without one)
    keys: dict  # state key -> dtype stored
    quant_block: int | None = None  # compressed state: elements per scale of the ".scale" keys

    def key_shape(self, key: str) -> tuple[int, ...]:
        """The shape a state key is saved with: the parameter's, or one scale per block."""
        if key.endswith(".scale") and self.quant_block:
            n = 1
            for d in self.shape:
                n *= int(d)
            return (-(-n // self.quant_block),)
        return self.shape


def _pieces(flat: Tensor, piece_numel: int) -> Iterator[Tensor]:
    for lo in range(0, flat.numel(), piece_numel):
        yield flat[lo: lo + piece_numel]


def _cpu_bytes(t: Tensor) -> Tensor:
    """The bytes of a piece as a contiguous uint8 CPU tensor (copies only when it must)."""
    if t.device.type != "cpu":
        t = t.to("cpu")
    return t.contiguous().reshape(-1).view(torch.uint8)


def store_of(opt) -> StateStore | None:
    """The state store of a tierstate optimizer; None for any other optimizer."""
    store = getattr(opt, "state_store", None) if isinstance(opt, torch.optim.Optimizer) else None
    return store if isinstance(store, StateStore) else None


class OffloadAccess:
    """State of a tierstate optimizer, piece by piece through its state store."""

    def __init__(self, opt) -> None:
        self.opt = opt
        opt.sync_state()
        self.params = [p for g in opt.param_groups for p in g["params"]]
        self._attach()

    def _attach(self) -> None:
        self.store: StateStore = self.opt.state_store
        self.slots = [self.store.slot_of(p) for p in self.params]

    def describe(self) -> list[ParamInfo]:
        out = []
        has_step = self.opt.rule.has_step
        for i, s in enumerate(self.slots):
            live = s.has_state and s.trainable is not None
            keys = {key: self.store.dtype(s, key) for key in self.store.held_keys(s)} if live else {}
            initialized = bool(keys) or live
            step = float(s.step) if (has_step and initialized) else None
            quant = self.store.quant
            out.append(ParamInfo(i, s.group, tuple(s.local.shape), s.local.dtype, initialized, step, keys,
                                 quant.block_size if quant is not None and keys else None))
        return out

    def check_format(self, index: int, rec: dict, file: str) -> None:
        """Refuse a record whose state format (full or compressed, block size, master) is not this
        optimizer's: shards keep the compressed form, and a conversion needs whole parameters."""
        quant = self.store.quant
        saved = rec["state"]
        compressed = any(k.endswith(PART_SUFFIXES) for k in saved)
        s = self.slots[index]
        ours = {k: str(self.store.dtype(s, k)).removeprefix("torch.") for k in self.store.keys(s)}
        mismatch = None
        if compressed != (quant is not None):
            mismatch = "compressed" if compressed else "full-precision"
        elif quant is not None and Q.family_of_parts(saved) != quant.maps:
            mismatch = f"compressed with quant_map={Q.family_of_parts(saved)!r}"
        elif quant is not None and rec.get("quant_block") != quant.block_size \
                and -(-s.local.numel() // rec["quant_block"]) != self.store.item_count(s, "exp_avg.scale"):
            mismatch = f"compressed with quant_block={rec.get('quant_block')}"
        elif quant is not None:
            own = str(s.local.dtype).removeprefix("torch.") if not s.needs_master else None
            for key, dt in saved.items():
                if key == "master" and dt == own:
                    continue  # a saved master of a parameter that is its own: loaded into the parameter
                if key.startswith("master") and (key not in ours or ours[key] != dt):
                    mismatch = f"compressed with a {dt} {key!r}"
        if mismatch:
            raise ValueError(f"{file}: parameter {index}'s state is {mismatch}, this optimizer keeps "
                             f"{sorted(ours.items())}; load the checkpoint into an optimizer with its Offload("
                             "moment_dtype=..., master_dtype=..., quant_block=..., quant_map=...) and move the "
                             "state with opt.load_state_dict(other.state_dict()), which converts it (with a warning)")

    def read_state(self, index: int, key: str, piece_numel: int) -> Iterator[Tensor]:
        """The flat state ``key`` of parameter ``index`` as uint8 byte pieces, in order."""
        for piece in self.store.read_pieces(self.slots[index], key, piece_numel):
            yield _cpu_bytes(piece)

    def read_param(self, index: int, piece_numel: int) -> Iterator[Tensor]:
        with self.store.values_of(self.slots[index], False) as flat:
            for piece in _pieces(flat, piece_numel):
                yield _cpu_bytes(piece)

    # -- loading: begin, write pieces, commit ------------------------------------------------
    def begin_load(self, param_groups: list[dict]) -> None:
        """Take the saved hyper-parameters and forget every state (torch's load semantics).

        param_groups were validated with the rule before anything was applied (load.py)."""
        self.opt.take_param_groups(param_groups)
        self._attach()  # the store is new if the saved groups keep other state keys

    def state_keys_for(self, index: int, group: dict) -> tuple[set, set]:
        """(keys a loaded state must have, keys it may have) for parameter ``index`` under ``group``."""
        required = {spec.name for spec in self.opt.rule.state_specs(group)}
        if self.store.quant is not None:
            quant = self.store.quant
            required = {k for name in required for k in (quant.codes_key(name), f"{name}.scale")}
            return required, required | {"master", "master.comp"}
        return required, required | {"master"}

    def accepts_state(self, index: int) -> bool:
        return self.slots[index].trainable is not None

    def write_state(self, index: int, key: str, offset: int, values: Tensor) -> None:
        """Store ``values`` at item ``offset`` of parameter ``index``'s state ``key`` (an element,
        or a block for a scale of compressed state)."""
        s = self.slots[index]
        if key == "master" and not s.needs_master:
            # A host parameter that is its own master (fp32, or bf16 under a bf16 master): the
            # saved master is its value.
            with self.store.values_of(s, True) as flat:
                flat[offset: offset + values.numel()].copy_(values)
            return
        self.store.write_at(s, key, offset, values)

    def write_param(self, index: int, offset: int, values: Tensor) -> None:
        with torch.no_grad(), self.store.values_of(self.slots[index], True) as flat:
            flat[offset: offset + values.numel()].copy_(values)

    def commit_param(self, index: int, keys: set, step: float | None) -> None:
        """Parameter ``index`` has all of ``keys`` written: it now has state, like after a step."""
        s = self.slots[index]
        self.store.commit_loaded(s, keys, step, fused=fused_group(self.opt.param_groups[s.group]))

    def finish_load(self, step_count: int | None, skipped_steps: int | None) -> None:
        self.opt.refresh_state_view()
        if step_count is not None:
            self.opt.steps_taken = int(step_count)
        if skipped_steps is not None:
            self.opt.skipped_steps = int(skipped_steps)

    def counters(self) -> dict:
        return {"step_count": self.opt.steps_taken, "skipped_steps": self.opt.skipped_steps}


class TorchAccess:
    """State of a plain ``torch.optim.Optimizer``, which already lives in RAM."""

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.opt = opt
        self.params = [p for g in opt.param_groups for p in g["params"]]
        self._sd = opt.state_dict()
        self._group_of = [gi for gi, g in enumerate(opt.param_groups) for _ in g["params"]]
        self._pending: dict[int, dict] = {}

    def describe(self) -> list[ParamInfo]:
        out = []
        for i, p in enumerate(self.params):
            st = self._sd["state"].get(i, {})
            keys = {k: v.dtype for k, v in st.items() if isinstance(v, Tensor) and k != "step"}
            for k in keys:
                if st[k].numel() != p.numel() or not st[k].dtype.is_floating_point:  # e.g. ASGD's 0-d 'eta'
                    raise ValueError(
                        f"{type(self.opt).__name__}: state {k!r} of parameter {i} has shape {tuple(st[k].shape)} "
                        f"dtype {st[k].dtype}, the parameter {tuple(p.shape)}; tierstate checkpoints hold "
                        "floating-point state shaped like its parameter: save this optimizer with "
                        "torch.save(opt.state_dict()) instead")
            step = st.get("step")
            step = float(step) if step is not None else None
            out.append(ParamInfo(i, self._group_of[i], tuple(p.shape), p.dtype, bool(st), step, keys))
        return out

    def _state(self, index: int, key: str) -> Tensor:
        return self._sd["state"][index][key]

    def read_state(self, index: int, key: str, piece_numel: int) -> Iterator[Tensor]:
        for piece in _pieces(self._state(index, key).detach().reshape(-1), piece_numel):
            yield _cpu_bytes(piece)

    def read_param(self, index: int, piece_numel: int) -> Iterator[Tensor]:
        for piece in _pieces(self.params[index].detach().reshape(-1), piece_numel):
            yield _cpu_bytes(piece)

    def begin_load(self, param_groups: list[dict]) -> None:
        self._groups = param_groups
        self._pending = {}

    def state_keys_for(self, index: int, group: dict) -> tuple[set, set]:
        return set(), None  # torch optimizers check their own state lazily; accept what was saved

    def check_format(self, index: int, rec: dict, file: str) -> None:
        if any(k.endswith(PART_SUFFIXES) for k in rec["state"]):
            raise ValueError(f"{file}: parameter {index}'s state is compressed (8-bit moments); "
                             f"{type(self.opt).__name__} keeps full-precision state: load the checkpoint into a "
                             "tierstate optimizer with the same Offload(moment_dtype='q8', ...) and give this one "
                             "tierstate.checkpoint.full_state_dict(that_optimizer)")

    def accepts_state(self, index: int) -> bool:
        return True

    def write_state(self, index: int, key: str, offset: int, values: Tensor) -> None:
        if key == "master":
            return  # torch keeps no master copy; the parameter is the weight
        st = self._pending.setdefault(index, {})
        if key not in st:
            st[key] = torch.empty(self.params[index].numel(), dtype=values.dtype)
        st[key][offset: offset + values.numel()].copy_(values)

    def write_param(self, index: int, offset: int, values: Tensor) -> None:
        p = self.params[index]
        with torch.no_grad():
            p.data.view(-1)[offset: offset + values.numel()].copy_(values)

    def commit_param(self, index: int, keys: set, step: float | None) -> None:
        st = self._pending.setdefault(index, {})
        shape = self.params[index].shape
        for key in list(st):
            st[key] = st[key].view(shape)
        if step is not None:
            st["step"] = step_tensor(step)

    def finish_load(self, step_count: int | None, skipped_steps: int | None) -> None:
        self.opt.load_state_dict({"state": self._pending, "param_groups": self._groups})

    def counters(self) -> dict:
        return {}


def access_for(opt) -> "OffloadAccess | TorchAccess":
    if store_of(opt) is not None:
        return OffloadAccess(opt)
    if isinstance(opt, torch.optim.Optimizer):
        return TorchAccess(opt)
    raise TypeError(f"opt is a {type(opt).__name__}; pass a torch.optim.Optimizer (e.g. tierstate.AdamW)")
