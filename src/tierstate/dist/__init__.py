"""torch.distributed glue (see docs/distributed.md).

Under FSDP2's ``fully_shard`` parameters and gradients are DTensors; the optimizer's tiers
hold the state of this rank's shard only. This package says which plain tensor that is and
which process groups hold the other shards (for the global gradient norm), presents that
state as DTensors in ``state_dict()`` and takes it back in ``load_state_dict()`` (so
``torch.distributed.checkpoint`` reshards it), names per-rank folders (``{rank}``), and ends
every rank when one fails (:mod:`.failure`).
"""
from .failure import PeerFailedError, report_failure
from .ranks import expand_rank_template, rank_fields
from .dtensor import (DTensor, is_dtensor, is_own_local, local_state, local_tensor, present_state, shard_groups,
                      shard_key)

__all__ = ["DTensor", "PeerFailedError", "expand_rank_template", "is_dtensor", "is_own_local", "local_state",
           "local_tensor", "present_state", "rank_fields", "report_failure", "shard_groups", "shard_key"]
