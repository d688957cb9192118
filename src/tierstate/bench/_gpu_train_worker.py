"""One run of ``tierstate bench gpu``: one mode, one model size, one device-memory cap.

    python -m tierstate.bench._gpu_train_worker --mode cpu --size 1b --out result.json [--cap-gib 24] ...

A process per run gives each run its own peak host RSS and its own device memory (a run
that runs out of device memory cannot leave fragments for the next), and lets the
orchestrator (:mod:`tierstate.bench.gpu_train`) stop a run that hangs. The result is one
JSON object whose ``status`` says how the run ended:

- ``ok``: trained ``warmup + steps`` steps; the figures follow;
- ``oom``: the device (under the cap) or the host ran out of memory: the model does not
  train this way there; ``error`` holds torch's first line;
- ``no_fit``: tierstate's planner found no placement (``offload="auto"``), with its reason;
- ``unavailable``: the mode's package is not installed (DeepSpeed, torchao);
- ``error``: anything else, with the exception.

The training step: a Llama-shaped ``LlamaForCausalLM`` from a transformers config (random
init, nothing downloaded), ``batch x seq`` random tokens, labels = inputs, SDPA attention,
activation checkpointing unless ``--no-checkpointing``. Each mode trains as its users do:

================  ==================================================================
``torch``         fp32 parameters on the device, bf16 autocast, ``torch.optim.AdamW
                  (fused=True)`` on the device: no offload (16 B/param of device memory)
``cpu``           bf16 parameters on the device, ``tierstate.AdamW(offload="cpu")``:
                  fp32 master and moments in host RAM, gradients streamed to the host
``cpu_bwd``       ``cpu`` with ``step_in_backward=True``: the host updates each sub-group
                  while the GPU still runs backward (what docs/step_modes.md advises on
                  GPUs, where the host cores are otherwise idle during backward)
``nvme``          the same with ``Offload(nvme=1.0)``: state in files under ``--nvme-dir``
``auto``          ``offload="auto"``: the planner places the state from probed hardware
``deepspeed``     DeepSpeed ZeRO-Offload (stage 2, optimizer on the CPU, bf16), one
                  process without a launcher, when ``deepspeed`` imports
``torchao``       bf16 parameters, ``torchao.optim.CPUOffloadOptimizer`` around
                  ``torch.optim.AdamW(fused=True)``, when ``torchao`` imports
================  ==================================================================

Every phase is timed with ``perf_counter`` after ``torch.cuda.synchronize()``: ``fwd`` =
model call with loss, ``bwd`` = backward, ``opt`` = optimizer step and gradients set to
None; ``total`` is their sum. FLOPs per step: 6 per parameter per token plus attention's
12 x layers x hidden x seq per token (the recomputation under checkpointing is not
counted, as MFU conventionally does not).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from ._e2e_worker import peak_rss_bytes

MODES = ("torch", "cpu", "cpu_bwd", "nvme", "auto", "deepspeed", "torchao")
TIERSTATE_MODES = ("cpu", "cpu_bwd", "nvme", "auto")
# The optimizer every mode runs.
LR, BETAS, EPS, WEIGHT_DECAY = 1e-4, (0.9, 0.95), 1e-8, 0.1


@dataclass(frozen=True)
class Shape:
    """A Llama-shaped decoder: the published shapes of models of each size (vocabulary 32,000)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int = 32000

    def config(self, seq: int):
        from transformers import LlamaConfig

        return LlamaConfig(hidden_size=self.hidden, intermediate_size=self.intermediate,
                           num_hidden_layers=self.layers, num_attention_heads=self.heads,
                           num_key_value_heads=self.kv_heads, vocab_size=self.vocab,
                           max_position_embeddings=max(seq, 128), tie_word_embeddings=False,
                           use_cache=False, attn_implementation="sdpa")

    def numel(self) -> int:
        """Parameters of ``LlamaForCausalLM`` of this shape (untied embeddings, RMSNorm weights)."""
        head = self.hidden // self.heads
        attn = self.hidden * self.hidden * 2 + self.hidden * self.kv_heads * head * 2
        mlp = 3 * self.hidden * self.intermediate
        return self.layers * (attn + mlp + 2 * self.hidden) + 2 * self.vocab * self.hidden + self.hidden


# TinyLlama 1.1B, OpenLLaMA 3B, Llama 2 7B and 13B, and two shapes for runs of seconds.
SIZES = {
    "tiny": Shape(hidden=64, intermediate=172, layers=2, heads=4, kv_heads=2, vocab=256),
    "small": Shape(hidden=512, intermediate=1376, layers=4, heads=8, kv_heads=8, vocab=8192),
    "1b": Shape(hidden=2048, intermediate=5632, layers=22, heads=32, kv_heads=4),
    "3b": Shape(hidden=3200, intermediate=8640, layers=26, heads=32, kv_heads=32),
    "7b": Shape(hidden=4096, intermediate=11008, layers=32, heads=32, kv_heads=32),
    "13b": Shape(hidden=5120, intermediate=13824, layers=40, heads=40, kv_heads=40),
}


def flops_per_step(shape: Shape, batch: int, seq: int) -> float:
    """Model FLOPs of one training step (forward + backward), recomputation not counted."""
    tokens = batch * seq
    return 6.0 * shape.numel() * tokens + 12.0 * shape.layers * shape.hidden * seq * tokens


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_model(shape: Shape, seq: int, device: torch.device, dtype: torch.dtype, checkpointing: bool):
    """``LlamaForCausalLM`` of ``shape``, made directly on ``device`` in ``dtype`` (no full-size
    copy in another dtype or place: under a device-memory cap the model must fit as it is made)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(shape.config(seq))
    finally:
        torch.set_default_dtype(previous)
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


class Unavailable(Exception):
    """The mode's package is not installed here."""


def make_optimizer(mode: str, model: torch.nn.Module, args: argparse.Namespace, scratch: Path | None):
    """``(step, zero_grad, info, optimizer)`` of ``mode``: how its users step and what to report."""
    if mode == "torch":
        opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                                fused=True)
        return opt.step, lambda: opt.zero_grad(set_to_none=True), {}, opt
    if mode in TIERSTATE_MODES:
        import tierstate as ts
        from ..kernels import backend_info

        if mode in ("cpu", "cpu_bwd"):
            offload = ts.Offload(cpu=1.0)
        elif mode == "nvme":
            offload = ts.Offload(nvme=1.0, nvme_dir=scratch)
        else:  # the planner measures its disk budget at the default NVMe root: point that at the scratch folder
            if scratch is not None:
                os.environ["TIERSTATE_NVME_DIR"] = str(scratch)
            offload = "auto"
        opt = ts.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, offload=offload,
                       step_in_backward=mode == "cpu_bwd")
        info = {"kernels": backend_info()["isa"], "tier_bytes": opt.tier_bytes()}
        return opt.step, lambda: opt.zero_grad(set_to_none=True), info, opt
    if mode == "torchao":
        try:
            from torchao.optim import CPUOffloadOptimizer
        except ImportError:
            try:
                from torchao.prototype.low_bit_optim import CPUOffloadOptimizer
            except ImportError as exc:
                raise Unavailable(f"torchao's CPUOffloadOptimizer does not import here ({exc})") from None
        import torchao

        opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=LR, betas=BETAS, eps=EPS,
                                  weight_decay=WEIGHT_DECAY, fused=True)
        return opt.step, lambda: opt.zero_grad(set_to_none=True), {"torchao": torchao.__version__}, opt
    raise ValueError(f"--mode {mode}: not an optimizer of this worker")


def deepspeed_world_of_one(backend: str):
    """``deepspeed``, imported, with torch.distributed started as a world of one process (no
    launcher): the rendezvous variables a launcher would set, where the environment has none.
    Raises ImportError where DeepSpeed is not installed."""
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port)), ("RANK", "0"),
                       ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    import deepspeed

    deepspeed.init_distributed(dist_backend=backend)
    return deepspeed


def _deepspeed_engine(model: torch.nn.Module, args: argparse.Namespace):
    """A single-process DeepSpeed ZeRO-Offload engine (stage 2, optimizer state on the CPU, bf16)."""
    try:
        deepspeed = deepspeed_world_of_one("nccl" if torch.cuda.is_available() else "gloo")
    except ImportError as exc:
        raise Unavailable(f"deepspeed does not import here ({exc})") from None
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS,
                                                  "weight_decay": WEIGHT_DECAY}},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                              "contiguous_gradients": True, "overlap_comm": True},
        "steps_per_print": 10**9,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine, {"deepspeed": deepspeed.__version__, "optimizer": type(engine.optimizer).__name__}


def _is_oom(exc: BaseException) -> bool:
    # torch.OutOfMemoryError since torch 2.5; torch.cuda.OutOfMemoryError before (the GPU
    # machine's torch is whatever it has)
    oom = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
    if isinstance(exc, (oom, MemoryError)):
        return True
    text = str(exc)
    return "out of memory" in text.lower() or "CUDA error: out of memory" in text


def train(args: argparse.Namespace) -> dict:
    """Build, set up and time one run; the figures of an ``ok`` result."""
    device = torch.device(args.device)
    shape = SIZES[args.size]
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        if args.cap_gib is not None:
            cap = int(args.cap_gib * 2**30)
            if cap > total:
                raise ValueError(f"--cap-gib {args.cap_gib:g} is above this device's {total / 2**30:.1f} GiB")
            torch.cuda.set_per_process_memory_fraction(cap / total, device)
        torch.cuda.reset_peak_memory_stats(device)
    scratch = None
    if args.mode in ("nvme", "auto"):
        root = Path(args.nvme_dir)
        root.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f"gpu-{args.mode}-{args.size}-", dir=root))
    try:
        return _train(args, device, shape, scratch)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def _train(args: argparse.Namespace, device: torch.device, shape: Shape, scratch: Path | None) -> dict:
    t_setup = time.perf_counter()
    fp32_model = args.mode == "torch"
    model = build_model(shape, args.seq, device, torch.float32 if fp32_model else torch.bfloat16,
                        checkpointing=not args.no_checkpointing)
    tokens = torch.randint(0, shape.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    tokens = tokens.to(device)
    optimizer = None
    if args.mode == "deepspeed":
        engine, info = _deepspeed_engine(model, args)

        def forward():
            return engine(input_ids=tokens, labels=tokens).loss

        backward, step, zero = engine.backward, engine.step, (lambda: None)
    else:
        step, zero, info, optimizer = make_optimizer(args.mode, model, args, scratch)
        autocast = fp32_model and device.type == "cuda"

        def forward():
            if autocast:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    return model(input_ids=tokens, labels=tokens).loss
            return model(input_ids=tokens, labels=tokens).loss

        def backward(loss):
            loss.backward()

    trace_path = None
    if args.trace_dir and optimizer is not None and hasattr(optimizer, "trace"):
        trace_path = str(Path(args.trace_dir) / f"trace-{args.mode}-{args.size}-{args.tag}.json")
        optimizer.trace(trace_path)
    _sync(device)
    setup_s = time.perf_counter() - t_setup
    steps = []
    for i in range(args.warmup + args.steps):
        _sync(device)
        t0 = time.perf_counter()
        loss = forward()
        _sync(device)
        t1 = time.perf_counter()
        backward(loss)
        _sync(device)
        t2 = time.perf_counter()
        step()
        zero()
        _sync(device)
        t3 = time.perf_counter()
        record = {"fwd": t1 - t0, "bwd": t2 - t1, "opt": t3 - t2, "total": t3 - t0,
                  "loss": float(loss.detach().float()), "warmup": i < args.warmup}
        if optimizer is not None and args.mode in TIERSTATE_MODES:
            record["phases"] = optimizer.stats().as_dict()["phases"]
        steps.append(record)
        print(f"[{args.mode} {args.size}] step {i} fwd {record['fwd']:.3f}s bwd {record['bwd']:.3f}s "
              f"opt {record['opt']:.3f}s loss {record['loss']:.3f}", file=sys.stderr, flush=True)
    if trace_path is not None:
        trace_path = str(optimizer.stop_trace())
    if optimizer is not None and hasattr(optimizer, "close") and args.mode in TIERSTATE_MODES:
        optimizer.close()
    out = {
        "status": "ok", "steps": steps, "setup_s": setup_s, "trace": trace_path, **info,
        "nparams": sum(p.numel() for p in model.parameters()),
        "peak_rss_bytes": peak_rss_bytes(),
    }
    if device.type == "cuda":
        out["peak_device_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        out["peak_device_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
        out["device_name"] = torch.cuda.get_device_name(device)
        out["device_total_bytes"] = torch.cuda.get_device_properties(device).total_memory
    return out


def run(args: argparse.Namespace) -> dict:
    """:func:`train`, with how the run ended in ``status`` instead of an exception."""
    shape = SIZES[args.size]
    head = {"mode": args.mode, "size": args.size, "cap_gib": args.cap_gib, "device": args.device,
            "batch": args.batch, "seq": args.seq, "checkpointing": not args.no_checkpointing,
            "model_numel": shape.numel(), "flops_per_step": flops_per_step(shape, args.batch, args.seq),
            "torch": torch.__version__}
    try:
        return {**head, **train(args)}
    except Unavailable as exc:
        return {**head, "status": "unavailable", "error": str(exc)}
    except BaseException as exc:  # every ending is a result: the orchestrator goes on with the next run
        if isinstance(exc, KeyboardInterrupt):
            raise
        from ..placement.plan_inputs import PlanError

        if _is_oom(exc):
            status = "oom"
        elif isinstance(exc, PlanError):
            status = "no_fit"
        else:
            status = "error"
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return {**head, "status": status, "error": f"{type(exc).__name__}: {first}",
                "traceback": traceback.format_exc(limit=8), "peak_rss_bytes": peak_rss_bytes()}


def worker_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--size", choices=tuple(SIZES), required=True)
    parser.add_argument("--out", required=True, help="where to write the result as JSON")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--cap-gib", type=float, default=None, help="device memory this process may use")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--no-checkpointing", action="store_true")
    parser.add_argument("--nvme-dir", default=tempfile.gettempdir())
    parser.add_argument("--trace-dir", default=None, help="write the tierstate modes' step traces here")
    parser.add_argument("--tag", default="0", help="names this run's trace file")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = worker_parser().parse_args(argv)
    result = run(args)
    Path(args.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
