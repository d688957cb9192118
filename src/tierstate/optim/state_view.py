"""``optimizer.state``: what torch code sees of the state, without copies and without device memory.

[Note: what optimizer.state holds]
Frameworks (Lightning, Accelerate) move every tensor found in ``optimizer.state`` to the
accelerator, so it must never hold device tensors, and it must not hold copies either (a
copy is memory the user did not ask for). ``optimizer.state[p]`` therefore holds the
``step`` tensor (CPU, float32, as torch) and, for parameters whose state lives wholly in
host memory, views into it under torch's key names (plus ``master`` for low-precision or
accelerator parameters). State held elsewhere (the device tier, NVMe, or a parameter
straddling tiers) is read on demand, as new CPU tensors, by ``state_dict()`` and by a
lookup of its key (``optimizer.state[p]["exp_avg"]``, ``.get``: see :class:`ParamState`),
never by iterating the dict.
"""
from __future__ import annotations

import weakref

import torch
from torch import Tensor

from ..tiers import Slot, StateStore


class ParamState(dict):
    """``optimizer.state[p]`` of a tierstate optimizer (see [Note: what optimizer.state holds]).

    A dict of what is held without a copy: ``step`` and host views of the state. A state key
    held elsewhere (NVMe, the device tier, a parameter straddling tiers) is not an entry, so
    iterating the dict (``items()``, ``values()``: what frameworks do to move tensors) never
    reads it, and ``key in state`` answers for the held entries only, like ``keys()``;
    ``state[key]`` and ``state.get(key)`` read it on demand into a new CPU tensor, a copy whose
    changes do not reach the state. A key the parameter's state does not have raises
    ``KeyError``, as torch's dict does.
    """

    def __init__(self, optimizer, param: Tensor, items=()) -> None:
        super().__init__(items)
        self._optimizer = weakref.ref(optimizer)  # no cycle, and deepcopy shares it (weakrefs are atomic)
        self._param = param

    def __missing__(self, key):
        opt = self._optimizer()
        if opt is None:
            raise KeyError(key)
        return opt._read_on_demand(self._param, key)

    def get(self, key, default=None):
        try:
            return self[key]
        except KeyError:
            return default

    def __reduce__(self):  # pickled and deep-copied as the plain dict it holds
        return dict, (dict(self),)


def publish(opt, store: StateStore, s: Slot, has_step: bool) -> None:
    """Fill ``opt.state[p]`` of a slot whose state starts existing or was loaded.

    The views stay valid as long as the tiers do, so a step only refreshes ``step``
    (:func:`publish_step`)."""
    keys = store.keys(s)
    if not has_step and not keys:
        return  # torch keeps no entry for a parameter without state (SGD without momentum)
    st = opt.state.get(s.param)
    if not isinstance(st, ParamState):
        st = opt.state[s.param] = ParamState(opt, s.param, st or {})
    if has_step:
        st["step"] = torch.tensor(float(s.step), dtype=torch.float32)
    for key in keys:
        if key == "master" and not s.master.filled:
            continue  # filled from the parameter at its first step
        view = store.host_view(s, key)
        if view is not None:
            st[key] = view


def publish_step(opt, s: Slot) -> None:
    opt.state[s.param]["step"].fill_(float(s.step))  # in place, as torch increments it
