"""The step: gradients in -> norm and non-finite decision -> executors per sub-group -> weights out.

:class:`StepEngine` (``engine.py``) runs it for ``optimizer.step()``, for the in-backward
driver (``backward.py``) and for the device tier alike; the sub-group loop (``loop.py``)
hands each sub-group to the executor of its tier (``executors.py``) and releases it when
the executor's completion is done.
"""
from .decision import Scaling
from .engine import StepCounters, StepEngine, StepPolicy, StepResult
from .executors import Completion, DeviceExecutor, HostExecutor
from .loop import run_subgroups

__all__ = ["Completion", "DeviceExecutor", "HostExecutor", "Scaling", "StepCounters", "StepEngine", "StepPolicy",
           "StepResult", "run_subgroups"]
