"""``optimizer.state``: what torch code sees of the state, without copies and without device memory.

[Note: what optimizer.state holds]
Frameworks (Lightning, Accelerate) move every tensor found in ``optimizer.state`` to the
accelerator, so it must never hold device tensors, and it must not hold copies either (a
copy is memory the user did not ask for). ``optimizer.state[p]`` therefore holds the
``step`` tensor (CPU; float32, or float64 under a float64 default dtype, as torch:
:func:`~tierstate.tiers.step_tensor`) and, for parameters whose state lives wholly in host
memory, views into it under torch's key names (plus ``master`` for low-precision or
accelerator parameters). State held elsewhere (the device tier, NVMe, or a parameter
straddling tiers) is read on demand, as new CPU tensors, by ``state_dict()`` and by a
lookup of its key (``optimizer.state[p]["exp_avg"]``, ``.get``: see :class:`ParamState`),
never by iterating the dict.

[Note: writes into optimizer.state]
In torch the entries of ``optimizer.state[p]`` are the state, so code may write them:
``state["exp_avg"].zero_()`` to reset a moment, ``state["exp_avg"] = torch.zeros_like(p)``,
``state["step"] = torch.tensor(0.)``. A host view is the state already. The rest reach the
tiers thus (found 2026-12-07: both were silently dropped):

- an assignment to a state key or ``step`` writes the value into the state
  (:meth:`ParamState.__setitem__`), and the dict keeps its view (or the ``step`` given);
- a copy read on demand is watched (:class:`tierstate.pipeline.user_writes.OnDemandCopies`):
  one written in place is written back before anything next reads or updates that state (the
  next step, the first update of a step run in backward, ``state_dict()``, another read), and
  every copy handed out before a step or a ``load_state_dict`` is let go once it ends, as it
  no longer shows the state. A copy that is never written is freed as soon as the caller drops
  it: only written ones are kept, until written back;
- an entry dropped (``optimizer.state.clear()``, ``optimizer.state = defaultdict(dict)``,
  ``del optimizer.state[p]``: how torch code resets state) starts that state afresh at the
  next step, and a dict assigned as the entry is loaded as its state
  (``OffloadOptimizer._take_dropped_state``; before, the next step raised ``KeyError: 'step'``).

[Note: the state of a complex parameter]
A complex parameter is stepped as its real view (:func:`tierstate.dist.local_tensor`), so
its state is stored as float32 pairs (float64 pairs for complex128). What torch code sees is
torch's: complex tensors shaped like the parameter (``torch.view_as_complex`` of the stored
pairs, a view where the pairs are host memory), in ``optimizer.state``, ``state_dict()`` and
on-demand reads; complex state given to ``load_state_dict`` is stored through its real view.
Checkpoints written by :func:`tierstate.save_optimizer` keep the pairs (safetensors has no
complex dtype): a shape ``(*param.shape, 2)``, float32 (float64 for complex128).
"""
from __future__ import annotations

import weakref

import torch
from torch import Tensor

from ..tiers import Slot, StateStore, step_tensor


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

    def __setitem__(self, key, value) -> None:
        """``state[key] = value``: for a state key or ``step``, the value is written into the
        state (see [Note: writes into optimizer.state]); any other key is kept as given."""
        opt = self._optimizer()
        if opt is None or not opt._assign_state(self._param, key, value):
            super().__setitem__(key, value)

    def keep(self, key, value) -> None:
        """An entry tierstate itself publishes (a view, ``step``): kept as it is."""
        super().__setitem__(key, value)

    def get(self, key, default=None):
        try:
            return self[key]
        except KeyError:
            return default

    def __reduce__(self):  # pickled and deep-copied as the plain dict it holds
        return dict, (dict(self),)


def as_torch_state(param: Tensor, value: Tensor) -> Tensor:
    """A state tensor of ``param`` as torch keeps it: complex for a complex parameter (see
    [Note: the state of a complex parameter]); other tensors as they are."""
    if param.is_complex() and value.dtype in (torch.float32, torch.float64) and value.dim() and value.shape[-1] == 2:
        return torch.view_as_complex(value)
    return value


def as_stored_state(param: Tensor, state):
    """``state`` (a parameter's dict of key -> tensor, as given to a load) with the complex tensors
    of a complex parameter as their real views, as the tiers store them; anything else as is."""
    if not isinstance(state, dict) or not param.is_complex():
        return state
    return {k: torch.view_as_real(v.detach()) if isinstance(v, Tensor) and v.is_complex() else v
            for k, v in state.items()}


def publish(opt, store: StateStore, s: Slot, has_step: bool) -> None:
    """Fill ``opt.state[p]`` of a slot whose state starts existing or was loaded.

    The views stay valid as long as the tiers do, so a step only refreshes ``step``
    (:func:`publish_steps`)."""
    keys = store.keys(s)
    if not has_step and not keys:
        return  # torch keeps no entry for a parameter without state (SGD without momentum)
    st = opt.state.get(s.param)
    if not isinstance(st, ParamState):
        st = opt.state[s.param] = ParamState(opt, s.param, st or {})
    if has_step:
        st.keep("step", step_tensor(s.step, s.step_dtype))
    for key in keys:
        if key == "master" and not s.master.filled:
            continue  # filled from the parameter at its first step
        view = store.host_view(s, key)
        if view is not None:
            st.keep(key, as_torch_state(s.param, view))


def publish_steps(opt, slots: list[Slot]) -> None:
    """Refresh ``step`` of each slot in ``opt.state``, in place, as torch increments it: one
    ``_foreach_copy_`` per step value and dtype (a ``fill_`` per tensor cost ~0.6 us each)."""
    by_value: dict[tuple, list[Tensor]] = {}
    state = opt.state
    for s in slots:
        by_value.setdefault((s.step, s.step_dtype), []).append(state[s.param]["step"])
    for (step, dtype), tensors in by_value.items():
        torch._foreach_copy_(tensors, [step_tensor(step, dtype)] * len(tensors))
