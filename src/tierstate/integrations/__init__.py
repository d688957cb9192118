"""Glue between tierstate optimizers and the training frameworks people already use.

- :mod:`tierstate.integrations.hf` — Hugging Face ``Trainer``: a mixin that checkpoints
  offloaded state through tierstate's streaming save and puts our metrics in the logs, and a
  callback for the metrics alone.
- :mod:`tierstate.integrations.accelerate` — ``Accelerator``: fp16 ``GradScaler`` steps with a
  truthful ``step_was_skipped``, and ``save_state``/``load_state`` through the streaming save.
- :mod:`tierstate.integrations.lightning` — Lightning: a callback that logs our metrics.

Each module imports its framework on import; this package itself imports none, so
``import tierstate`` never needs the optional extras (``pip install tierstate[hf]`` or
``tierstate[lightning]``). The framework-independent pieces (finding our optimizer inside a
wrapper, flattening stats into scalars, saving a checkpoint directory) are in
:mod:`tierstate.integrations.common`.
"""
from .common import OptimizerMetrics, find_offload_optimizer, load_optimizer_dir, save_optimizer_dir

__all__ = ["OptimizerMetrics", "find_offload_optimizer", "load_optimizer_dir", "save_optimizer_dir"]
