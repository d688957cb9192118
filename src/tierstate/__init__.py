"""tierstate: train PyTorch models whose optimizer state does not fit in accelerator memory.

fp32 master weights, optimizer moments and gradients live in host RAM and on NVMe and are
streamed with overlap; the model's parameters stay where the user put them.

    import tierstate as ts
    opt = ts.AdamW(model.parameters(), lr=3e-4, offload="cpu")   # or "nvme", or ts.Offload(...)

The public names are imported on first use (PEP 562), so ``tierstate --help`` and other
commands that do not train start without importing torch (~1.5 s of CPU).
"""
from __future__ import annotations

import importlib
import logging

# A library logs to "tierstate" and lets the application decide where it goes.
logging.getLogger("tierstate").addHandler(logging.NullHandler())

__version__ = "0.1.0"

_EXPORTS = {
    "Adam": ".optim", "AdamW": ".optim", "SGD": ".optim", "Lion": ".optim", "Adagrad": ".optim",
    "OffloadOptimizer": ".optim",
    "Offload": ".placement",
    "offload_weights": ".weights", "WeightStreamer": ".weights", "WeightsLostError": ".weights",
    "save_weights": ".weights", "load_weights": ".weights", "StreamedParameter": ".weights",
    "OffloadedLM": ".generate", "KVLostError": ".generate",
    "save_optimizer": ".checkpoint", "load_optimizer": ".checkpoint",
    # the errors a training loop may want to catch by name
    "StateLostError": ".io", "DiskFullError": ".io", "FileIOError": ".io",
    "CorruptCheckpointError": ".checkpoint", "NvmeDirInUseError": ".tiers.rundir",
}
# Modules reachable as attributes (``ts.host_allocator.policy()``), imported on first use too.
_SUBMODULES = ("host_allocator",)
__all__ = [*_EXPORTS, *_SUBMODULES, "__version__"]


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tierstate' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS) | set(_SUBMODULES))
