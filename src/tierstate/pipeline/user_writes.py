"""What the user wrote between two steps: parameters, and copies of state read on demand.

[Note: weights changed between steps]
torch's optimizers read each parameter at every step, so whatever the user wrote into it since
the last one (a pruning mask applied in place, weights loaded with ``model.load_state_dict``
or through ``param.data``) is what the next step trains from. A parameter with a master copy
(bf16/fp16 parameters under an fp32 master; fp32 ones under a 16-bit master with 8-bit
state) is updated from the master, which would write the old weights back. So before each
step (and before the first update of a step run in backward) :class:`ParamMarks` compares
every host parameter with what it was after tierstate last wrote it:

- its shape, dtype or device changed (``model.half()``, ``param.data = other``): refused,
  naming the parameter, before anything changes. Its state was laid out for the old one.
- its memory changed (``param.data = new``, same shape and dtype): the master is filled
  again from the parameter, as at the first step, unless the parameter still holds the
  master rounded everywhere (the same weights in other memory: a copy, another memory
  format), which leaves the master's fp32 bits as they were. Memory laid out otherwise (not
  contiguous: ``model.to(memory_format=torch.channels_last)`` after building the optimizer)
  is first made contiguous, with a warning, as at construction (see [Note: parameters are
  updated through a flat view of their memory] in :mod:`tierstate.tiers.param_memory`).
- its version changed (torch bumps ``_version`` at every in-place write; the native kernels
  write through a pointer and bump nothing): the master follows the values. An fp32 master
  takes the parameter's value only where the parameter is no longer the master rounded
  (:func:`follow_values`), so an EMA's evaluation swap, which writes the same values back,
  leaves the master's fp32 bits as they were. A 16-bit master (8-bit state) is filled again
  from the parameter: under an fp32 parameter the kernels wrote the value the master and its
  compensation stand for, so an unchanged parameter gives back the same master (under an
  fp16 one, the master keeps only what the fp16 values hold).

A parameter that is its own master (fp32 state, or a bf16 parameter under ``bf16_kahan``,
whose int16 compensation is then at most half an ulp stale) needs nothing. Parameters on an
accelerator (written by their upload, on a stream) are checked for shape, dtype and device
only. A parameter whose weights stream (:mod:`tierstate.weights`) has no memory of its own
between uses, so only its version is compared: ``ws.write_param`` (and ``model.load_state_dict``,
which goes through it) bumps it, as does an in-place write inside ``ws.gathered()``, while
the block's materializations and the optimizer's updates of its host image do not; its master
then follows the values in the block's host image. (Until 2026-12-07 streamed parameters were
not checked: a bf16 weight set with ``write_param`` was overwritten at the next step from
the master of the old one.)
"""
from __future__ import annotations

import itertools
import threading
import weakref

import torch
from torch import Tensor

from ..tiers import MasterLife, Slot, StateStore
from ..tiers.param_memory import give_contiguous_memory, needs_own_memory
from ..weights import streamed as weights_of

Mark = tuple  # (data_ptr, version, shape, strides, dtype): ~0.5 us a parameter, twice a step


def _mark(t: Tensor) -> Mark:
    # no device: a parameter moved to another device is in other memory (its data_ptr changed),
    # and :meth:`ParamMarks.changed` then compares its device with the optimizer's
    return (t.data_ptr(), t._version, t.shape, t.stride(), t.dtype)


def _streamed_mark(t: Tensor) -> Mark:
    # a streamed parameter's storage comes and goes with its block: its version counts the writes
    return (None, t._version, t.shape, None, t.dtype)


def _values_watched(s: Slot, streamed: bool) -> bool:
    # a streamed parameter's values live in its block's host image, also when it computes on a device
    return s.needs_master and (streamed or s.local.device.type == "cpu")


class ParamMarks:
    """What each trainable parameter was after tierstate last wrote it."""

    def __init__(self) -> None:
        self._marks: dict[int, Mark] = {}
        self._streamed: frozenset[int] = frozenset()

    def record(self, slots, streamed) -> None:
        """After a placement and after each step; ``streamed``: the trainable indices whose
        weights stream (only their versions are compared)."""
        self._streamed = frozenset(s.index for s in slots if s.trainable in streamed)
        self._marks = {s.index: (_streamed_mark if s.index in self._streamed else _mark)(s.local)
                       for s in slots if s.trainable is not None}

    def changed(self, slots, numels, device: torch.device) -> list[tuple[Slot, bool]]:
        """``(slot, replaced)`` for each slot whose values the user wrote since :meth:`record`
        (``replaced``: in other memory, ``param.data = ...``); raises for a parameter whose
        shape, dtype or device changed, or whose new memory cannot be made contiguous, before
        changing anything; then gives the others whose new memory is not contiguous memory of
        their own (:func:`~tierstate.tiers.param_memory.give_contiguous_memory`)."""
        out, moves = [], {}
        for s in slots:
            old = self._marks.get(s.index)
            if s.trainable is None or old is None:
                continue
            local = s.local
            if s.index in self._streamed:
                if _streamed_mark(local) != old and _values_watched(s, True):
                    out.append((s, False))
                continue
            now = _mark(local)
            if now == old:
                continue
            shape, dtype, on = now[2], now[4], local.device
            if (shape, dtype) != (old[2], old[4]) or on != device or local.numel() != numels[s.trainable]:
                what = ("shape" if shape != old[2] else "dtype" if dtype != old[4] else "device")
                was, became = {"shape": (old[2], shape), "dtype": (old[4], dtype), "device": (device, on)}[what]
                raise RuntimeError(
                    f"params[{s.index}] changed {what} from {_show(was)} to {_show(became)} since the optimizer "
                    f"placed its state (model.half(), .to(), or param.data replaced after building the optimizer): "
                    f"its state was laid out for the parameter as it was. build the optimizer after the model is "
                    f"cast, moved or resized (its state_dict() loads into the new one)")
            replaced = now[0] != old[0] or now[3] != old[3]  # other memory, or laid out otherwise
            if replaced and needs_own_memory(s.index, s.param, RuntimeError):
                moves[s.index] = s.param
            if _values_watched(s, False) and weights_of(s.param) is None:  # (one that started
                out.append((s, replaced))  # streaming since: the engine re-assembles over it)
        give_contiguous_memory(moves, since_built=True)
        return out


def _show(v) -> str:
    if not isinstance(v, tuple):
        return str(v)
    return "(" + ", ".join(str(n) for n in v) + ("," if len(v) == 1 else "") + ")"


def follow_values(store: StateStore, changed: list[tuple[Slot, bool]]) -> None:
    """Make the master of each changed slot stand for what its parameter now holds (see the
    note); ``replaced``: the parameter is other memory, whose values all replace the master's."""
    if any(s.master is MasterLife.PENDING for s, _ in changed):
        store.write_pending_masters()  # pieces not filled yet take the parameter's values now
    for s, replaced in changed:
        if not s.master.filled:
            continue  # filled from the parameter at its next update
        if store.dtype(s, "master") != torch.float32:
            _fill_again(store, s)
            continue
        master = store.read(s, "master")
        # compared where the values are (a streamed weight: its block's host image, lent only
        # for the context), so no copy of the parameter is made; the master is written after
        with store.values_of(s, False) as flat:
            param = flat.view(master.shape)
            rounded = master.to(param.dtype)
            kept = (rounded == param) | (rounded.isnan() & param.isnan())
            if bool(kept.all()):
                continue  # the same weights (in other memory: a copy, another memory format)
            followed = None if replaced else torch.where(kept, master, param.to(master.dtype))
        if followed is None:  # new weights: taken whole, as at the first step
            _fill_again(store, s)
        else:
            store.write(s, "master", followed)


def _fill_again(store: StateStore, s: Slot) -> None:
    """Fill ``s``'s master from its parameter, as at the first step."""
    s.master = MasterLife.ABSENT
    s.pending_pieces.clear()
    store.fill_master(s)


class OnDemandCopies:
    """The copies of state read on demand (see [Note: writes into optimizer.state] in
    :mod:`tierstate.optim.state_view`).

    Each copy handed out is watched through a second tensor on its storage, which shares its
    version counter: torch bumps it at every in-place write, through either."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watched: dict[int, list] = {}  # token -> [alias, slot, key, version when last seen]
        self._tokens = itertools.count()

    def hand_out(self, s: Slot, key: str, value: Tensor, out: Tensor) -> Tensor:
        """``out``, the caller's tensor over ``value`` (a fresh CPU copy of state ``key`` of ``s``,
        as the tiers store it), watched."""
        if out is value:
            out = value.view_as(value)  # another tensor object: the caller's may die while ours lives
        token = next(self._tokens)
        with self._lock:
            self._watched[token] = [value, s, key, value._version]
        weakref.finalize(out, OnDemandCopies._dropped, weakref.ref(self), token)
        return out

    @staticmethod
    def _dropped(ref, token: int) -> None:
        self = ref()
        if self is None:
            return
        with self._lock:
            entry = self._watched.get(token)
            if entry is not None and entry[0]._version == entry[3]:
                del self._watched[token]  # gone unwritten: nothing to write back

    def write_back(self, store: StateStore) -> None:
        """Write into the state every watched copy written since it was last seen."""
        with self._lock:
            written = [entry for entry in self._watched.values() if entry[0]._version != entry[3]]
        for entry in written:
            alias, s, key, _ = entry
            store.write(s, key, alias)
            entry[3] = alias._version

    def let_go(self) -> None:
        """After a step: the copies handed out before it no longer show the state."""
        with self._lock:
            self._watched.clear()
