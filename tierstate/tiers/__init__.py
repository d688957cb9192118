"""Where state lives: each tier owns its storage and hands the step pipeline flat views.

A tier implements: ``schedule(subgroups)`` (the order of upcoming ``acquire`` calls, for
read-ahead), ``acquire(sg) -> {key: 1-D tensor}``, ``release(sg, dirty)`` (write-behind),
``drain()`` (wait for writes in flight), ``read_range(key, sg, offset, numel)`` and
``write_range(key, sg, offset, values)`` for state outside a step (init, state_dict),
``nbytes`` and ``close()``.
"""
from .host import HostTier

__all__ = ["HostTier"]
