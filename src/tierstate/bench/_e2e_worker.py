"""One configuration of ``tierstate bench e2e``, run in a process of its own.

    python -m tierstate.bench._e2e_worker --mode nvme --out result.json [--layers 12] ...

A process per configuration makes ``ru_maxrss`` that configuration's own peak RSS. The
orchestrator, :mod:`tierstate.bench.e2e`, starts these processes, alternates their order
and aggregates what they write. :func:`measure` is the timed training loop for any
optimizer: ``benchmarks/_e2e_deepspeed_worker.py`` (in the source tree) runs DeepSpeed's
engine through it for the peer comparison.

The training step is the same for every mode: fp32 parameters, forward and loss under
``torch.autocast("cpu", bfloat16)``, ``loss.backward()``, optimizer step, gradients set
to None. With ``--precision fp32`` (for CPUs without bf16 matrix units, where a bf16
matmul ran 45-76x slower than an fp32 one on an AVX2 Zen 3) every mode runs in fp32: no
autocast, and the ``*_bf16*`` modes refuse. Each phase is timed with ``perf_counter``
around the call that does it: ``fwd`` = model call with loss, ``bwd`` = backward, ``opt``
= optimizer step plus ``zero_grad``.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..placement.defaults import DEFAULT_BUFFER_COUNT, DEFAULT_SUBGROUP_NUMEL

TORCH_MODE = "torch"
# Plain torch with the host-allocator setting tierstate's optimizers apply on CPU parameters
# (tierstate.host_allocator): shows how much of a tierstate mode's gain over "torch" is that
# setting rather than the optimizer.
TORCH_RETAIN_MODE = "torch_retain"
TORCH_MODES = (TORCH_MODE, TORCH_RETAIN_MODE)
TIERSTATE_MODES = ("cpu", "nvme", "cpu_bwd", "nvme_bwd", "cpu_bf16", "nvme_bf16", "cpu_bf16_bwd", "nvme_bf16_bwd",
                   "cpu_clip_scaler", "cpu_bwd_clip_scaler")
# Modes with clipping (max_grad_norm=1.0) and a torch.amp.GradScaler: the step in-backward
# mode makes speculatively and rolls back when either demands it (opt.rollbacks is reported).
CLIP_SCALER_MODES = ("cpu_clip_scaler", "cpu_bwd_clip_scaler")
# Modes whose model holds bf16 parameters and runs without autocast: the fp32 master lives in
# the optimizer, which writes the rounded weight back in its fused pass (DeepSpeed's bf16 mode
# is the same arrangement: bf16 model, fp32 master in the optimizer).
BF16_PARAM_MODES = ("cpu_bf16", "nvme_bf16", "cpu_bf16_bwd", "nvme_bf16_bwd")
# Modes that update the state during backward (step_in_backward=True).
IN_BACKWARD_MODES = ("cpu_bwd", "nvme_bwd", "cpu_bf16_bwd", "nvme_bf16_bwd", "cpu_bwd_clip_scaler")
NVME_MODES = ("nvme", "nvme_bwd", "nvme_bf16", "nvme_bf16_bwd")
MODES = (*TORCH_MODES, *TIERSTATE_MODES)
# The training precision of a run: "bf16" (autocast, or bf16 parameters) or "fp32" (no bf16 anywhere).
PRECISIONS = ("bf16", "fp32")

# The optimizer every mode runs (benchmarks/e2e.py's DeepSpeed modes use the same).
LR, BETAS, EPS, WEIGHT_DECAY = 1e-4, (0.9, 0.999), 1e-8, 0.01


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model and batch shape; shared with the orchestrator, which passes them through."""
    parser.add_argument("--layers", type=int, default=12, help="transformer blocks (GPT-2 small: 12)")
    parser.add_argument("--embd", type=int, default=768, help="hidden size (GPT-2 small: 768)")
    parser.add_argument("--heads", type=int, default=12, help="attention heads (GPT-2 small: 12)")
    parser.add_argument("--vocab", type=int, default=50257, help="vocabulary size (GPT-2: 50257)")
    parser.add_argument("--batch", type=int, default=2, help="sequences per step (default 2)")
    parser.add_argument("--seq", type=int, default=256, help="tokens per sequence (default 256)")
    parser.add_argument("--subgroup-numel", type=int, default=None,
                        help="tierstate Offload.subgroup_numel (default: the library's, "
                             f"{DEFAULT_SUBGROUP_NUMEL >> 20} Mi elements)")
    parser.add_argument("--buffer-count", type=int, default=None,
                        help=f"tierstate Offload.buffer_count for nvme (default: the library's, {DEFAULT_BUFFER_COUNT})")


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    """GPT-2 from a transformers config: random init, nothing downloaded."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=args.layers, n_embd=args.embd, n_head=args.heads,
                        n_positions=max(1024, args.seq), vocab_size=args.vocab)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    model.config.use_cache = False  # training: no key/value cache to build
    model.train()
    return model


def _tierstate_optimizer(model: torch.nn.Module, args: argparse.Namespace, state_dir: Path | None):
    import tierstate as ts

    overrides = {}
    if args.subgroup_numel is not None:
        overrides["subgroup_numel"] = args.subgroup_numel
    if args.mode in NVME_MODES:
        if args.buffer_count is not None:
            overrides["buffer_count"] = args.buffer_count
        offload = ts.Offload(cpu=0.0, nvme=1.0, nvme_dir=state_dir, **overrides)
    else:
        offload = ts.Offload(cpu=1.0, **overrides)
    return ts.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, offload=offload,
                    step_in_backward=args.mode in IN_BACKWARD_MODES,
                    max_grad_norm=1.0 if args.mode in CLIP_SCALER_MODES else None)


def _native_kernels(mode: str) -> str:
    """The ISA of the kernels a tierstate mode will time; refuses the pure-torch reference.

    Without the compiled module (an interpreter tierstate was not installed into, reached
    through PYTHONPATH) the optimizers fall back to the reference kernels, 12x slower on the
    2-vCPU AVX2 VM (741 against 62 ms for a 100M-parameter AdamW step): a figure from them
    would be wrong, not slow."""
    from ..kernels import backend_info

    info = backend_info()
    if not info["native"]:
        raise RuntimeError(
            f"--mode {mode}: tierstate's native module did not load under {sys.executable} "
            f"({info['native_error']}), so this run would time the pure-torch reference kernels; "
            "install tierstate into that interpreter (pip install . from the checkout) or run the "
            "benchmark with the one it is installed in")
    return info["isa"]


def peak_rss_bytes() -> int:
    """This process's peak resident set, in bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _current_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@dataclass
class Harness:
    """How one mode trains: the three timed calls, and what it reports besides the times."""

    forward: Callable[[], torch.Tensor]  # the model call with its loss
    backward: Callable[[torch.Tensor], None]
    optimizer_step: Callable[[], None]  # the step and zeroing the gradients
    stats: Callable[[], dict] | None = None  # per-step telemetry (phases, lanes, bytes), if any
    close: Callable[[], None] | None = None
    info: dict = field(default_factory=dict)  # figures about the setup, merged into the result


def _tierstate_harness(args: argparse.Namespace, model: torch.nn.Module, tokens: torch.Tensor,
                       scratch: Path | None) -> Harness:
    """The plain-torch and tierstate modes: fp32 parameters under bf16 autocast, or bf16 parameters."""
    info: dict = {}
    stats = close = None
    if args.mode in TORCH_MODES:
        if args.mode == TORCH_RETAIN_MODE:
            from .. import host_allocator
            host_allocator.retain_freed_memory()
            info["host_allocator"] = host_allocator.policy()
        opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                                fused=True)
    else:
        info["kernels"] = _native_kernels(args.mode)
        opt = _tierstate_optimizer(model, args, scratch)
        info["tier_bytes"] = opt.tier_bytes()
        info["host_allocator"] = opt.host_allocator
        if args.mode in NVME_MODES:
            from .. import io as tio
            info["io_backend"] = tio.default_engine().backend

        def stats() -> dict:
            d = opt.stats().as_dict()
            return {"phases": d["phases"], "lanes": d["lanes"], "bytes": d["bytes"], "rollbacks": opt.rollbacks}

        close = opt.close

    if args.mode in BF16_PARAM_MODES or args.precision == "fp32":
        def forward():
            return model(input_ids=tokens, labels=tokens).loss
    else:
        def forward():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return model(input_ids=tokens, labels=tokens).loss

    scaler = torch.amp.GradScaler("cpu") if args.mode in CLIP_SCALER_MODES else None

    def backward(loss):
        (loss if scaler is None else scaler.scale(loss)).backward()

    def optimizer_step():
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        opt.zero_grad(set_to_none=True)

    return Harness(forward, backward, optimizer_step, stats=stats, close=close, info=info)


def measure(args: argparse.Namespace, harness: Callable[..., Harness], uses_disk: bool,
            bf16_params: bool = False) -> dict:
    """Build the model, set up ``harness(args, model, tokens, scratch)``, train ``warmup + steps``
    steps and return the figures. ``uses_disk``: the mode gets a scratch folder of its own under
    ``args.nvme_dir``, removed afterwards; ``bf16_params``: the model is cast to bf16 first."""
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    t_setup = time.perf_counter()
    model = build_model(args)
    if bf16_params:
        model.to(torch.bfloat16)
    nparams = sum(p.numel() for p in model.parameters())
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    scratch = None
    if uses_disk:
        root = Path(args.nvme_dir)
        root.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f"e2e-{args.mode}-", dir=root))
    try:
        h = harness(args, model, tokens, scratch)
        setup_s = time.perf_counter() - t_setup
        rss_after_setup = _current_rss_bytes()
        steps = []
        for i in range(args.warmup + args.steps):
            t0 = time.perf_counter()
            loss = h.forward()
            t1 = time.perf_counter()
            h.backward(loss)
            t2 = time.perf_counter()
            h.optimizer_step()
            t3 = time.perf_counter()
            record = {"fwd": t1 - t0, "bwd": t2 - t1, "opt": t3 - t2, "total": t3 - t0,
                      "loss": float(loss.detach().float()), "warmup": i < args.warmup}
            if h.stats is not None:
                record.update(h.stats())
            steps.append(record)
            print(f"[{args.mode}] step {i} fwd {record['fwd']:.3f}s bwd {record['bwd']:.3f}s "
                  f"opt {record['opt']:.3f}s loss {record['loss']:.3f}", file=sys.stderr, flush=True)
        if h.close is not None:
            h.close()
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    return {
        "mode": args.mode, "status": "ok", "nparams": nparams, "steps": steps,
        "peak_rss_bytes": peak_rss_bytes(), "rss_after_setup_bytes": rss_after_setup, "setup_s": setup_s,
        "threads": args.threads, "precision": args.precision, "torch": torch.__version__, "python": sys.executable,
        "loadavg_start": load_start, "loadavg_end": os.getloadavg(), **h.info, "info_keys": sorted(h.info),
    }


def run(args: argparse.Namespace) -> dict:
    """Train ``args.mode`` (one of :data:`MODES`) for ``warmup + steps`` steps; return its figures."""
    if args.precision == "fp32" and args.mode in BF16_PARAM_MODES:
        raise ValueError(f"--mode {args.mode} trains bf16 parameters; with --precision fp32 use one of "
                         f"{', '.join(m for m in MODES if m not in BF16_PARAM_MODES)}")
    return measure(args, _tierstate_harness, uses_disk=args.mode in NVME_MODES,
                   bf16_params=args.mode in BF16_PARAM_MODES)


def worker_parser(modes: tuple[str, ...], description: str) -> argparse.ArgumentParser:
    """The options a worker process takes (the orchestrator passes them through), ``--mode`` among ``modes``."""
    parser = argparse.ArgumentParser(allow_abbrev=False, description=description)
    parser.add_argument("--mode", choices=modes, required=True)
    parser.add_argument("--out", required=True, help="where to write the result as JSON")
    parser.add_argument("--steps", type=int, default=6, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--precision", choices=PRECISIONS, default="bf16",
                        help="bf16: autocast / bf16 parameters (default); fp32: none of them")
    parser.add_argument("--nvme-dir", default=tempfile.gettempdir(), help="folder for nvme-mode state files")
    add_model_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = worker_parser(MODES, __doc__.split("\n\n")[0]).parse_args(argv)
    result = run(args)
    Path(args.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
