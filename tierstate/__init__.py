"""tierstate: train PyTorch models whose optimizer state does not fit in accelerator memory.

fp32 master weights, optimizer moments and gradients live in host RAM and on NVMe and are
streamed with overlap; the model's parameters stay where the user put them.

    import tierstate as ts
    opt = ts.AdamW(model.parameters(), lr=3e-4, offload="cpu")   # or "nvme", or ts.Offload(...)
"""
from . import telemetry  # noqa: F401 - installs the "tierstate" logger's NullHandler
from .checkpoint import load_optimizer, save_optimizer
from .optim import SGD, Adagrad, Adam, AdamW, Lion, OffloadOptimizer
from .placement import Offload

__version__ = "0.1.0"
__all__ = [
    "Adam", "AdamW", "SGD", "Lion", "Adagrad", "Offload", "OffloadOptimizer",
    "save_optimizer", "load_optimizer", "__version__",
]
