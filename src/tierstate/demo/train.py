"""The demo's training loop: a :class:`~tierstate.demo.model.GPT` on the synthetic corpus,
with its optimizer state offloaded by ``tierstate.AdamW``, measured step by step."""
from __future__ import annotations

import errno
import json
import math
import os
import resource
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import tierstate
import tierstate.kernels

from .corpus import SyntheticCorpus, uniform_loss
from .model import GPT, GPTConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
OFFLOAD_CHOICES = ("cpu", "nvme", "auto")
# Losses averaged at each end of the run for "first vs last": one step's loss is noisy
# (a batch of a few thousand bytes), five steps' mean is steady enough to compare.
LOSS_WINDOW = 5


@dataclass(frozen=True)
class RunDefaults:
    """Per-preset defaults chosen so that the loss visibly falls within ~100 steps."""

    batch_size: int
    seq_len: int
    lr: float


RUN_DEFAULTS: dict[str, RunDefaults] = {
    # Small models tolerate (and need, to move within 100 steps) a larger learning rate.
    "tiny": RunDefaults(batch_size=16, seq_len=64, lr=3e-3),
    "small": RunDefaults(batch_size=8, seq_len=128, lr=1e-3),
    "medium": RunDefaults(batch_size=8, seq_len=256, lr=6e-4),
    "large": RunDefaults(batch_size=8, seq_len=256, lr=4e-4),
}


def default_device() -> str:
    """``"cuda"`` when an accelerator is present, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``device`` as a :class:`torch.device` (default :func:`default_device`)."""
    if device is None:
        return torch.device(default_device())
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device={device!r} is not a torch device; use e.g. 'cpu', 'cuda' or 'cuda:1'") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r}: torch sees no CUDA device here; use device='cpu'")
    return resolved


def default_model(device: str | torch.device) -> str:
    """``"small"`` (11M) on an accelerator; ``"tiny"`` (0.23M) on a CPU, where one step of
    the small preset takes seconds (3.7-6 s measured on a busy 2-core host)."""
    return "small" if torch.device(device).type == "cuda" else "tiny"


def is_local_rank_zero() -> bool:
    """True unless ``$LOCAL_RANK`` names another process on this node (only rank 0 draws)."""
    value = os.environ.get("LOCAL_RANK", "0")
    try:
        return int(value) == 0
    except ValueError:
        raise ValueError(f"environment variable LOCAL_RANK={value!r}: must be an integer rank") from None


def run_demo(
    model: str | None = None,
    *,
    steps: int = 100,
    batch_size: int | None = None,
    seq_len: int | None = None,
    offload: str = "cpu",
    nvme_dir: str | os.PathLike | None = None,
    lr: float | None = None,
    dtype: str = "fp32",
    device: str | torch.device | None = None,
    seed: int = 0,
    json_path: str | os.PathLike | None = None,
    trace_path: str | os.PathLike | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Train a GPT preset with ``tierstate.AdamW`` and return a summary of the run.

    Args:
        model: a preset of :data:`~tierstate.demo.model.MODEL_PRESETS`; default
            :func:`default_model` of the device.
        steps: optimizer steps (>= 1).
        batch_size, seq_len, lr: default per preset (:data:`RUN_DEFAULTS`).
        offload: ``"cpu"``, ``"nvme"`` or ``"auto"``: where the optimizer state lives.
        nvme_dir: folder for the NVMe tier (only with ``offload="nvme"``).
        dtype: ``"fp32"`` or ``"bf16"`` model parameters (bf16 keeps an fp32 master copy in
            the optimizer's tiers).
        device: where the model runs; default :func:`default_device`.
        seed: seeds the corpus, the initial weights and the batch order.
        json_path: if given, the summary is also written there as JSON.
        trace_path: if given, the optimizer's timeline is written there as a trace.
        progress: draw a progress bar (on local rank 0 only).

    Returns:
        A JSON-serialisable dict: the arguments, ``parameters``, ``losses`` (per step),
        ``loss_first``/``loss_last`` (means of the first/last 5 steps), ``loss_uniform``
        (ln vocab) and ``loss_floor`` (the corpus's entropy rate), ``step_s`` (per step)
        and ``step_s_median``, ``phases_s`` (seconds per phase, summed over steps),
        ``optimizer_phases_s`` and ``optimizer_bytes`` (the optimizer's own breakdown),
        ``tier_bytes`` (optimizer state per tier), ``kernels`` (native or reference, ISA),
        ``host_rss_bytes`` (the optimizer's gauge) and ``peak_rss_bytes`` (the process's).
    """
    device = resolve_device(device)
    model = default_model(device) if model is None else model
    config = GPTConfig.preset(model)
    defaults = RUN_DEFAULTS[model]
    batch_size = defaults.batch_size if batch_size is None else batch_size
    seq_len = defaults.seq_len if seq_len is None else seq_len
    lr = defaults.lr if lr is None else lr
    _check_arguments(config, steps=steps, batch_size=batch_size, seq_len=seq_len,
                     offload=offload, nvme_dir=nvme_dir, lr=lr, dtype=dtype)
    if json_path is not None:
        _check_folder_exists(json_path)  # fail now, not after the whole run

    corpus = SyntheticCorpus(seed)
    torch.manual_seed(seed)
    net = GPT(config).to(device=device, dtype=DTYPES[dtype])
    opt = tierstate.AdamW(net.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1,
                          offload=_offload_policy(offload, nvme_dir))
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(steps))
    batches = torch.Generator().manual_seed(seed + 1)  # batch order apart from weight init

    log = _RunLog()
    bar = _ProgressBar(steps, enabled=progress and is_local_rank_zero())
    started = time.perf_counter()
    with bar, _tracing(opt, trace_path):
        for _ in range(steps):
            t0 = time.perf_counter()
            inputs, targets = corpus.batch(batch_size, seq_len, batches)
            inputs = inputs.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            t1 = _timestamp(device)
            logits = net(inputs)
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
            t2 = _timestamp(device)
            loss.backward()
            t3 = _timestamp(device)
            opt.step()
            opt.zero_grad(set_to_none=True)
            schedule.step()
            loss_value = loss.item()  # waits for the device, so t4 closes the whole step
            t4 = time.perf_counter()
            # Bookkeeping after the step, outside the timed region.
            log.record(loss_value, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), opt.stats().as_dict())
            bar.advance(loss_value, t4 - t0)
    wall_s = time.perf_counter() - started

    window = min(LOSS_WINDOW, steps)
    median_step_s = statistics.median(log.step_s)
    summary: dict[str, Any] = {
        "model": model,
        "parameters": sum(p.numel() for p in net.parameters()),
        "device": str(device),
        "dtype": dtype,
        "offload": offload,
        "nvme_dir": None if nvme_dir is None else str(nvme_dir),
        "steps": steps,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "lr": lr,
        "seed": seed,
        "tokens_per_step": batch_size * seq_len,
        "losses": log.losses,
        "loss_first": statistics.fmean(log.losses[:window]),
        "loss_last": statistics.fmean(log.losses[-window:]),
        "loss_uniform": uniform_loss(config.vocab_size),
        "loss_floor": corpus.entropy_per_token,
        "step_s": log.step_s,
        "step_s_median": median_step_s,
        "tokens_per_s": batch_size * seq_len / median_step_s,
        "wall_s": wall_s,
        "phases_s": log.phases_s,
        "optimizer_phases_s": log.optimizer_phases_s,
        "optimizer_bytes": log.optimizer_bytes,
        "tier_bytes": {tier: int(n) for tier, n in opt.tier_bytes().items()},
        "kernels": tierstate.kernels.backend_info(),
        "host_rss_bytes": int(log.host_rss),
        # ru_maxrss is KiB on Linux: the high-water mark of the whole process.
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "trace_path": None if trace_path is None else str(trace_path),
    }
    if json_path is not None:
        Path(json_path).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


@dataclass
class _RunLog:
    """Per-step losses and times, and the optimizer's per-step telemetry summed over steps."""

    losses: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    phases_s: dict[str, float] = field(
        default_factory=lambda: {"data": 0.0, "forward": 0.0, "backward": 0.0, "optimizer": 0.0}
    )
    optimizer_phases_s: dict[str, float] = field(default_factory=dict)
    optimizer_bytes: dict[str, int] = field(default_factory=dict)
    host_rss: float = 0.0

    def record(self, loss: float, phase_s: tuple[float, ...], stats: dict[str, Any]) -> None:
        """One step: its loss, the seconds of each of :attr:`phases_s` in order, and
        ``opt.stats().as_dict()`` (the optimizer's account of that step alone)."""
        self.losses.append(loss)
        self.step_s.append(sum(phase_s))
        for name, seconds in zip(self.phases_s, phase_s):
            self.phases_s[name] += seconds
        for name, seconds in stats["phases"].items():
            self.optimizer_phases_s[name] = self.optimizer_phases_s.get(name, 0.0) + seconds
        for key, nbytes in stats["bytes"].items():
            self.optimizer_bytes[key] = self.optimizer_bytes.get(key, 0) + int(nbytes)
        self.host_rss = max(self.host_rss, float(stats["gauges"].get("host_rss", 0.0)))


def _check_arguments(config: GPTConfig, *, steps, batch_size, seq_len, offload, nvme_dir, lr, dtype) -> None:
    for name, value in (("steps", steps), ("batch_size", batch_size), ("seq_len", seq_len)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r}: must be a positive int")
    if seq_len > config.max_seq_len:
        raise ValueError(
            f"seq_len={seq_len}: this model covers at most {config.max_seq_len} positions; "
            f"pass seq_len <= {config.max_seq_len}"
        )
    if offload not in OFFLOAD_CHOICES:
        raise ValueError(f"offload={offload!r}: choose one of {list(OFFLOAD_CHOICES)}")
    if nvme_dir is not None and offload != "nvme":
        raise ValueError(f"nvme_dir={str(nvme_dir)!r} applies only with offload='nvme', not {offload!r}")
    if not isinstance(lr, (int, float)) or isinstance(lr, bool) or not (lr > 0 and math.isfinite(lr)):
        raise ValueError(f"lr={lr!r}: must be a positive finite number")
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: choose one of {list(DTYPES)}")


def _check_folder_exists(path: str | os.PathLike) -> None:
    folder = Path(path).resolve().parent
    if not folder.is_dir():
        raise FileNotFoundError(errno.ENOENT, "the folder for the JSON summary does not exist; create it first",
                                str(folder))


def _offload_policy(offload: str, nvme_dir: str | os.PathLike | None) -> str | tierstate.Offload:
    if offload == "nvme" and nvme_dir is not None:
        return tierstate.Offload(gpu=0.0, cpu=0.0, nvme=1.0, nvme_dir=nvme_dir)
    return offload


@contextmanager
def _tracing(opt: tierstate.OffloadOptimizer, trace_path: str | os.PathLike | None):
    """Record the optimizer's timeline while the loop runs; the file is written on exit."""
    if trace_path is None:
        yield
        return
    opt.trace(trace_path)
    try:
        yield
    finally:
        opt.stop_trace()


def warmup_cosine(steps: int, max_warmup: int = 20):
    """LR multiplier: linear warm-up over 10% of the steps (at most ``max_warmup``), then a
    cosine decay to 10% of the peak, the usual GPT recipe compressed to a short run."""
    warmup = max(1, min(max_warmup, steps // 10))

    def multiplier(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return multiplier


def _timestamp(device: torch.device) -> float:
    # CUDA kernels run asynchronously: without a synchronise the forward would look free
    # and its time would land in whichever phase next waits. One sync per phase boundary
    # costs ~10 us, against steps of milliseconds.
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class _ProgressBar:
    """A rich progress bar with loss and step time, redrawn at most 10 times a second so
    that tiny models' millisecond steps are not slowed by drawing."""

    _REDRAW_S = 0.1

    def __init__(self, total: int, *, enabled: bool) -> None:
        self._enabled = enabled
        self._last_draw = 0.0
        if enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"),
                TextColumn("{task.fields[step_ms]} ms/step"),
                TimeRemainingColumn(),
                console=Console(stderr=True),
                auto_refresh=False,  # no drawing thread competing with the step for cores
            )
            self._task = self._progress.add_task("train", total=total, loss="  -  ", step_ms="  -  ")

    def __enter__(self) -> "_ProgressBar":
        if self._enabled:
            self._progress.start()
        return self

    def __exit__(self, *exc_info) -> None:
        if self._enabled:
            self._progress.refresh()
            self._progress.stop()

    def advance(self, loss: float, step_s: float) -> None:
        if not self._enabled:
            return
        self._progress.update(self._task, advance=1, loss=f"{loss:.3f}", step_ms=f"{step_s * 1e3:.1f}")
        now = time.perf_counter()
        if now - self._last_draw >= self._REDRAW_S:
            self._last_draw = now
            self._progress.refresh()
