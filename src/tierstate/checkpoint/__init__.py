"""Checkpoints of optimizer state: streamed, atomic, checksummed, placement-independent.

    import tierstate as ts
    ts.save_optimizer(opt, "ckpt/")        # aligned safetensors shards + manifest.json
    extra = ts.load_optimizer(opt, "ckpt/")

``mmap_state_dict`` gives torch's ``state_dict`` schema with file-backed tensors, for
``torch.save`` / ``torch.distributed.checkpoint`` of states larger than RAM.
"""
from .durable import CorruptCheckpointError
from .load import load_optimizer, read_manifest
from .mapped import mmap_state_dict
from .save import save_optimizer

__all__ = ["CorruptCheckpointError", "load_optimizer", "mmap_state_dict", "read_manifest", "save_optimizer"]
