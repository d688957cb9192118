"""tierstate optimizers as the local optimizer of torch's ``ZeroRedundancyOptimizer`` (ZeRO-1).

``ZeroRedundancyOptimizer(params, optimizer_class=ts.AdamW, max_grad_norm=...)`` builds one
``ts.AdamW`` per rank over that rank's partition of the parameters (whole parameters, about
1/N of them by size). Clipping by a global norm then needs the squares of every rank's
partition: each rank alone sees 1/N of them, and clipping by that partial norm gives every
rank its own, too large, coefficient (a silent divergence from single-process training).
So when a tierstate optimizer is built by a ``ZeroRedundancyOptimizer`` it takes that
wrapper's process group as its *partition group*: the step all-reduces the sum of squares
and the non-finite flag over it (as under FSDP2 over the shard groups), every rank clips by
the global norm and skips alike. Found by looking up the caller's frames at construction
(the wrapper passes no hint of itself to the class it builds).
"""
from __future__ import annotations

import sys

_FRAMES_LOOKED_AT = 12  # ZeroRedundancyOptimizer.__init__ -> _init_local_optimizer -> the class: 3 deep today


def partition_group_of_caller():
    """The process group of the ``ZeroRedundancyOptimizer`` building the caller, or None."""
    try:
        from torch.distributed.optim import ZeroRedundancyOptimizer
    except ImportError:  # a torch without torch.distributed
        return None
    frame = sys._getframe(1)
    for _ in range(_FRAMES_LOOKED_AT):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        if isinstance(owner, ZeroRedundancyOptimizer):
            return owner.process_group
        frame = frame.f_back
    return None
