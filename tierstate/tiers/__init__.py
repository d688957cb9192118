"""Where state lives: each tier owns its storage and hands the step pipeline flat views.

A tier implements:

- ``schedule(subgroups) -> list[SubGroup]``: the step will acquire these sub-groups;
  the tier answers the order it wants them in (a permutation; the NVMe tier picks the
  direction that meets the sub-groups already in its pool first) and may start reading
  ahead along it.
- ``ready(sg) -> bool``: whether ``acquire(sg)`` would return without waiting for I/O.
- ``acquire(sg) -> {key: 1-D tensor}``: flat views of every state key of ``sg``, valid
  until ``release``.
- ``release(sg, dirty)``: done with ``sg``; dirty state is written back by the tier
  (the NVMe tier lazily, when it reuses the buffer: write-behind).
- ``drain()``: wait for I/O in flight; ``flush()``: also write back every dirty buffer,
  so the tier's files hold all the state, raising a write that still fails. The NVMe
  tier reports I/O failures where they matter (a failed read to whoever acquires that
  record, failed writes through ``settle()`` / ``take_write_errors()``): see its
  [Note: what a failed I/O leaves].
- ``read_range(key, sg, offset, numel)`` / ``write_range(key, sg, offset, values)``: state
  outside a step (init, state_dict, load_state_dict); always the newest values.
- ``nbytes`` (bytes of state the tier holds) and ``close()``.

:class:`DeviceTier` keeps its state on the parameters' device (``Offload(gpu=...)``),
:class:`HostTier` in host RAM, :class:`NvmeTier` in files.
"""
from .device import DeviceTier
from .host import HostTier, packed_arena

__all__ = ["DeviceTier", "HostTier", "NvmeTier", "packed_arena"]


def __getattr__(name: str):
    if name == "NvmeTier":  # imported on use: it loads the native I/O engine
        from .nvme import NvmeTier

        return NvmeTier
    raise AttributeError(f"module 'tierstate.tiers' has no attribute {name!r}")
