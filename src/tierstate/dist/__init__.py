"""torch.distributed glue: the local shard of a DTensor, and how parameters are sharded.

Under FSDP2's ``fully_shard`` parameters and gradients are DTensors; the optimizer's tiers
hold the state of this rank's shard only. This package says which plain tensor that is
and which process groups hold the other shards (for the global gradient norm).
"""
from .failure import PeerFailedError, report_failure
from .ranks import expand_rank_template, rank_fields
from .dtensor import DTensor, is_dtensor, local_state, local_tensor, present_state, shard_groups, shard_key

__all__ = ["DTensor", "PeerFailedError", "report_failure", "expand_rank_template", "rank_fields", "is_dtensor", "local_state", "local_tensor", "present_state", "shard_groups", "shard_key"]
