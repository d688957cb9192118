"""Piecewise access to an optimizer's state, whatever holds it, in bounded pieces.

Two faces, one interface:

* :class:`OffloadAccess` for tierstate optimizers: reads and writes each parameter's
  state through its layout segments and the owning tier's ``read_range``/``write_range``
  (a view for the host tier, a pool-buffer copy for the NVMe tier), never more than
  ``piece_numel`` elements at a time.
* :class:`TorchAccess` for any other ``torch.optim.Optimizer`` (e.g. ``torch.optim.AdamW``):
  its state already is in RAM, so it goes through ``state_dict``/``load_state_dict``.

Parameters are numbered as in ``optimizer.state_dict()``: in ``param_groups`` order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
from torch import Tensor

from ..optim.base import OffloadOptimizer
from ..placement import TierKind


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


def _pieces(flat: Tensor, piece_numel: int) -> Iterator[Tensor]:
    for lo in range(0, flat.numel(), piece_numel):
        yield flat[lo: lo + piece_numel]


def _cpu_bytes(t: Tensor) -> Tensor:
    """The bytes of a piece as a contiguous uint8 CPU tensor (copies only when it must)."""
    if t.device.type != "cpu":
        t = t.to("cpu")
    return t.contiguous().reshape(-1).view(torch.uint8)


class OffloadAccess:
    """State of a tierstate optimizer, segment by segment through its tiers."""

    def __init__(self, opt: OffloadOptimizer) -> None:
        self.opt = opt
        opt._before_state_access()
        self.params = opt._all_params()
        self._slots = [opt._slot_of[id(p)] for p in self.params]

    def describe(self) -> list[ParamInfo]:
        out = []
        for i, s in enumerate(self._slots):
            keys = {}
            if s.initialized and s.trainable is not None:
                for key in self.opt._state_keys(s):
                    if key != "master" or s.master_ready:
                        keys[key] = self.opt._state_dtypes[key]
            initialized = bool(keys) or (s.initialized and s.trainable is not None)
            step = float(s.step) if (self.opt.rule.has_step and initialized) else None
            out.append(ParamInfo(i, s.group, tuple(s.local.shape), s.param.dtype, initialized, step, keys))
        return out

    def read_state(self, index: int, key: str, piece_numel: int) -> Iterator[Tensor]:
        """The flat state ``key`` of parameter ``index`` as uint8 byte pieces, in order."""
        s = self._slots[index]
        opt = self.opt
        for seg in opt._segments(s):
            sg = opt.layout.subgroups[seg.subgroup]
            tier = opt.tiers[sg.tier]
            for lo in range(0, seg.numel, piece_numel):
                n = min(piece_numel, seg.numel - lo)
                yield _cpu_bytes(tier.read_range(key, sg, seg.subgroup_offset + lo, n))

    def read_param(self, index: int, piece_numel: int) -> Iterator[Tensor]:
        flat = self._slots[index].local.detach().reshape(-1)
        for piece in _pieces(flat, piece_numel):
            yield _cpu_bytes(piece)

    # -- loading: begin, write pieces, commit ------------------------------------------------
    def begin_load(self, param_groups: list[dict]) -> None:
        """Take the saved hyper-parameters and forget every state (torch's load semantics)."""
        opt = self.opt
        # param_groups were validated with opt.rule.validate before anything was applied (load.py);
        # torch's implementation switches in them become this optimizer's, missing keys its defaults
        merged = [opt._loaded_group(g) for g in param_groups]
        torch.optim.Optimizer.load_state_dict(opt, {"state": {}, "param_groups": param_groups})
        for g, m in zip(opt.param_groups, merged):
            g.update({k: v for k, v in m.items() if k not in ("params", "param_names")})
        forget_state = getattr(opt.tiers.get(TierKind.NVME), "forget_state", None)
        if forget_state is not None:  # every state is replaced: no record need be read back
            forget_state()
        for s in self._slots:
            s.initialized, s.master_ready, s.step = False, False, 0
        opt.state.clear()
        keys = {spec.name for g in opt.param_groups for spec in opt.rule.state_specs(g)}
        if not keys <= set(opt._state_dtypes):
            # The saved hyper-parameters keep a state key the tiers were not built for
            # (e.g. amsgrad=True adds max_exp_avg_sq): place the state anew. Nothing is
            # lost: every state was just forgotten.
            opt._rebuild_engine()
            self._slots = [opt._slot_of[id(p)] for p in self.params]

    def state_keys_for(self, index: int, group: dict) -> tuple[set, set]:
        """(keys a loaded state must have, keys it may have) for parameter ``index`` under ``group``."""
        required = {spec.name for spec in self.opt.rule.state_specs(group)}
        return required, required | {"master"}

    def accepts_state(self, index: int) -> bool:
        return self._slots[index].trainable is not None

    def write_state(self, index: int, key: str, offset: int, values: Tensor) -> None:
        """Store ``values`` at element ``offset`` of parameter ``index``'s state ``key``."""
        opt, s = self.opt, self._slots[index]
        if key == "master" and not s.needs_master:
            # An fp32 host parameter is its own master: the saved master is its value.
            s.local.data.view(-1)[offset: offset + values.numel()].copy_(values)
            return
        end = offset + values.numel()
        for seg in opt._segments(s):
            lo, hi = max(offset, seg.param_offset), min(end, seg.param_offset + seg.numel)
            if hi <= lo:
                continue
            sg = opt.layout.subgroups[seg.subgroup]
            opt.tiers[sg.tier].write_range(key, sg, seg.subgroup_offset + (lo - seg.param_offset),
                                           values[lo - offset: hi - offset])

    def write_param(self, index: int, offset: int, values: Tensor) -> None:
        p = self._slots[index].local
        with torch.no_grad():
            p.data.view(-1)[offset: offset + values.numel()].copy_(values)

    def commit_param(self, index: int, keys: set, step: float | None) -> None:
        """Parameter ``index`` has all of ``keys`` written: it now has state, like after a step."""
        s = self._slots[index]
        s.initialized = True
        s.step = int(step) if step is not None else 0
        s.master_ready = "master" in keys and s.needs_master
        self.opt._publish(s)

    def finish_load(self, step_count: int | None, skipped_steps: int | None) -> None:
        if step_count is not None:
            self.opt._steps_taken = int(step_count)
        if skipped_steps is not None:
            self.opt.skipped_steps = int(skipped_steps)

    def counters(self) -> dict:
        return {"step_count": getattr(self.opt, "_steps_taken", 0), "skipped_steps": self.opt.skipped_steps}


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
            st["step"] = torch.tensor(step, dtype=torch.float32)

    def finish_load(self, step_count: int | None, skipped_steps: int | None) -> None:
        self.opt.load_state_dict({"state": self._pending, "param_groups": self._groups})

    def counters(self) -> dict:
        return {}


def access_for(opt) -> "OffloadAccess | TorchAccess":
    if isinstance(opt, OffloadOptimizer):
        return OffloadAccess(opt)
    if isinstance(opt, torch.optim.Optimizer):
        return TorchAccess(opt)
    raise TypeError(f"opt is a {type(opt).__name__}; pass a torch.optim.Optimizer (e.g. tierstate.AdamW)")
