"""Framework-independent pieces of the integrations.

- :func:`find_offload_optimizer` finds the tierstate optimizer inside a framework's wrapper
  (Accelerate's ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``, ...).
- :class:`OptimizerMetrics` turns the optimizer's telemetry into flat ``{name: float}``
  scalars, the shape every framework logger accepts.
- :func:`save_optimizer_dir` / :func:`load_optimizer_dir` put the optimizer's state into a
  framework's checkpoint directory through the streaming checkpoint
  (:mod:`tierstate.checkpoint`), so no framework ever pickles the whole state in one file.
"""
from __future__ import annotations

import errno
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from ..optim import OffloadOptimizer

# Name of the streaming checkpoint inside a framework's checkpoint directory (with ".pt":
# the single-file form used when the streaming checkpoint module is not available).
STATE_DIRNAME = "tierstate_optimizer"
METRIC_PREFIX = "tierstate/"

# Wrappers name the optimizer they hold differently: Accelerate and HF use ``optimizer``,
# Lightning's LightningOptimizer ``_optimizer``. Nesting is at most a few levels deep (HF
# Trainer -> AcceleratedOptimizer -> ours); the bound stops a wrapper that refers to itself.
_WRAPPED_ATTRS = ("optimizer", "_optimizer")
_MAX_WRAPPING = 8


def warn_if_clipping_finds_no_grads(optimizer: Any, clip_value: float | None, setting: str) -> bool:
    """Warn (and return True) when a framework is set to clip ``param.grad`` (``setting`` =
    ``clip_value``) but ``optimizer`` is a tierstate optimizer that releases ``param.grad`` after
    streaming it to the host (:attr:`OffloadOptimizer.releases_param_grads`): the framework's
    clipping would silently clip nothing."""
    opt = find_offload_optimizer(optimizer)
    if opt is None or not clip_value or not opt.releases_param_grads:
        return False
    warnings.warn(
        f"{setting}={clip_value} with a tierstate optimizer that streams gradients to the host during backward "
        "and releases param.grad: the framework's clip_grad_norm_ finds no gradient and clips nothing. Pass "
        f"max_grad_norm={clip_value} to the tierstate optimizer (it clips over every tier) and set {setting}=0, "
        "or keep param.grad with Offload(keep_device_grads=True)", UserWarning, stacklevel=3)
    return True


def find_offload_optimizer(optimizer: Any) -> OffloadOptimizer | None:
    """The tierstate optimizer ``optimizer`` is or wraps, or None when it is not one of ours."""
    current = optimizer
    for _ in range(_MAX_WRAPPING):
        if isinstance(current, OffloadOptimizer):
            return current
        inner = next((getattr(current, a) for a in _WRAPPED_ATTRS if getattr(current, a, None) is not None), None)
        if inner is None or inner is current:
            return None
        current = inner
    return None


class OptimizerMetrics:
    """Scalars describing the optimizer steps since the previous :meth:`collect`.

    ``collect()`` returns (all keys prefixed ``tierstate/``):

    - ``step_ms``: mean wall time of one optimizer step over the interval;
    - ``bottleneck_share``: share of that time in the largest phase, named by
      ``bottleneck_<phase>`` = 1.0 (loggers want numbers, so the name is in the key);
    - ``grad_norm``: the global gradient norm of the last step (before clipping), over every tier;
    - ``skipped_steps``: steps skipped so far for non-finite gradients;
    - ``state_gib``: optimizer state held per tier (``state_gib_host``, ``state_gib_nvme``, ...);
    - ``<channel>_gbps``: achieved bandwidth per channel (host memory, NVMe, PCIe) over the interval;
    - ``host_rss_gib``: the process's resident memory at the last step.

    An interval with no step returns only the cumulative keys (``skipped_steps``, ``state_gib_*``).
    """

    def __init__(self, optimizer: Any) -> None:
        opt = find_offload_optimizer(optimizer)
        if opt is None:
            raise TypeError(f"optimizer is a {type(optimizer).__name__}, not a tierstate optimizer (or a wrapper of one)")
        self.optimizer = opt
        self._previous = None  # telemetry totals at the previous collect()

    def collect(self) -> dict[str, float]:
        opt = self.optimizer
        out: dict[str, float] = {f"{METRIC_PREFIX}skipped_steps": float(opt.skipped_steps)}
        for tier, nbytes in opt.tier_bytes().items():
            out[f"{METRIC_PREFIX}state_gib_{tier}"] = nbytes / 2**30
        totals = opt.telemetry.totals()
        if totals is None:
            return out
        prev = self._previous
        self._previous = totals
        steps = totals.steps - (prev.steps if prev else 0)
        if steps <= 0:
            return out
        wall = totals.wall_s - (prev.wall_s if prev else 0.0)
        out[f"{METRIC_PREFIX}step_ms"] = wall / steps * 1e3
        phases = {k: v - (prev.phases.get(k, 0.0) if prev else 0.0) for k, v in totals.phases.items()}
        if phases and wall > 0:
            name = max(phases, key=phases.__getitem__)
            out[f"{METRIC_PREFIX}bottleneck_share"] = phases[name] / wall
            out[f"{METRIC_PREFIX}bottleneck_{name}"] = 1.0
        for channel, bw in totals.bandwidth.items():
            before = prev.bandwidth.get(channel) if prev else None
            nbytes = bw.nbytes - (before.nbytes if before else 0)
            busy = bw.busy_s - (before.busy_s if before else 0.0)
            if nbytes > 0 and busy > 0:
                out[f"{METRIC_PREFIX}{channel.replace('/', '_')}_gbps"] = nbytes / busy / 1e9
        if opt.last_grad_norm is not None:
            out[f"{METRIC_PREFIX}grad_norm"] = float(opt.last_grad_norm)
        rss = totals.gauges.get("host_rss")
        if rss is not None:
            out[f"{METRIC_PREFIX}host_rss_gib"] = rss / 2**30
        return out


def _streaming_checkpoint():
    """``(save_optimizer, load_optimizer)`` of :mod:`tierstate.checkpoint`, or None if absent."""
    try:
        from ..checkpoint import load_optimizer, save_optimizer
    except ImportError:
        return None
    return save_optimizer, load_optimizer


def save_optimizer_dir(optimizer: Any, directory: str | os.PathLike, name: str = STATE_DIRNAME) -> Path:
    """Save a tierstate optimizer's state into ``directory`` (a framework's checkpoint folder).

    Uses the streaming checkpoint (``directory/<name>/``: shards written through a bounded
    buffer, atomically) when :mod:`tierstate.checkpoint` is available, else one
    ``directory/<name>.pt`` of ``optimizer.state_dict()`` (written to a temporary name, then
    renamed). Returns the path written.
    """
    opt = find_offload_optimizer(optimizer)
    if opt is None:
        raise TypeError(f"optimizer is a {type(optimizer).__name__}, not a tierstate optimizer (or a wrapper of one)")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    streaming = _streaming_checkpoint()
    if streaming is not None:
        target = directory / name
        # The framework saves the model's weights itself; the optimizer checkpoint holds only
        # optimizer state (params=False), so weights are not written twice.
        streaming[0](opt, target, params=False)
        return target
    target = directory / f"{name}.pt"
    tmp = target.with_name(target.name + ".tmp")
    try:
        torch.save(opt.state_dict(), tmp)
        os.replace(tmp, target)
    except BaseException:  # a failed or interrupted write (Ctrl-C) leaves the previous file, and no .tmp
        tmp.unlink(missing_ok=True)
        raise
    return target


def has_optimizer_dir(directory: str | os.PathLike, name: str = STATE_DIRNAME) -> bool:
    """Whether ``directory`` holds a state written by :func:`save_optimizer_dir`."""
    directory = Path(directory)
    return (directory / name).exists() or (directory / f"{name}.pt").is_file()


def load_optimizer_dir(optimizer: Any, directory: str | os.PathLike, name: str = STATE_DIRNAME) -> Path:
    """Load the state :func:`save_optimizer_dir` wrote into ``directory``; returns its path.

    Raises ``FileNotFoundError`` (an ``OSError`` carrying the path) when there is none.
    """
    opt = find_offload_optimizer(optimizer)
    if opt is None:
        raise TypeError(f"optimizer is a {type(optimizer).__name__}, not a tierstate optimizer (or a wrapper of one)")
    directory = Path(directory)
    target = directory / name
    if target.exists():
        streaming = _streaming_checkpoint()
        if streaming is None:
            raise ValueError(
                f"{target} is a streaming tierstate checkpoint but tierstate.checkpoint is not available in "
                "this installation; load it with a tierstate version that has it"
            )
        streaming[1](opt, target, params=False)
        return target
    target = directory / f"{name}.pt"
    if target.is_file():
        opt.load_state_dict(torch.load(target, map_location="cpu", weights_only=True))
        return target
    raise FileNotFoundError(errno.ENOENT, f"no tierstate optimizer state ({name}/ or {name}.pt) in "
                            "this checkpoint directory", str(directory))
