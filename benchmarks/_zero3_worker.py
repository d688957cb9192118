"""One run of ``benchmarks/weights_vs_zero3.py``, in a process of its own.

    PYTHON benchmarks/_zero3_worker.py --mode tierstate|ds_z3_nvme --out result.json --nvme-dir DIR ...

A process per run makes its peak RSS its own. The ``ds_z3_nvme`` mode runs under the peers'
interpreter (the one that imports deepspeed), so this file imports neither tierstate nor
deepspeed at the top: each mode imports its own library, and only the standard library,
torch and transformers are shared. Both modes train the same Llama (same config, same seed,
same tokens), so their first losses agree to bf16 rounding: a check that the two ran the
same model.

What a step is, per mode (timed with ``perf_counter`` around each call):

* ``tierstate``: ``loss = model(ids, labels=ids).loss``; ``loss.backward()``; ``opt.step()``;
  ``opt.zero_grad(set_to_none=True)``, with the weights streamed from NVMe by
  ``ts.offload_weights`` and ``ts.AdamW(offload="nvme", step_in_backward=True)``.
* ``tierstate_after``: the same with ``step_in_backward=False``: every update in ``opt.step()``,
  after backward, as DeepSpeed does it.
* ``ds_z3_nvme``: ``loss = engine(ids, labels=ids).loss``; ``engine.backward(loss)``;
  ``engine.step()`` (which zeroes the gradients), ZeRO-3 with ``offload_param`` and
  ``offload_optimizer`` on NVMe.

Under ``--dtype bf16`` both hold bf16 weights and an fp32 master in the optimizer (DeepSpeed's
``bf16.enabled``); under ``fp32`` both train fp32 weights.

Per step it records the phase times, the loss and the bytes this process read from and wrote
to storage (``/proc/self/io`` ``read_bytes``/``write_bytes``: O_DIRECT, io_uring and libaio
I/O all count there, page-cache hits do not). Peak RSS is given twice: over the whole process
(``ru_maxrss``, model construction included) and over the steps alone (``VmHWM`` after
resetting it through ``/proc/self/clear_refs`` once setup is done).

When the run fails, the result file still says so: ``status`` is ``failed`` and ``error`` is
the exception's type and the first line of its message (the traceback goes to stderr).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import sys
import time
import traceback
from pathlib import Path

import torch

MODES = ("tierstate", "tierstate_after", "ds_z3_nvme")
LR, BETAS, EPS, WEIGHT_DECAY = 1e-4, (0.9, 0.999), 1e-8, 0.01


def parser() -> argparse.ArgumentParser:
    """The options the orchestrator passes through (the model shape already resolved from ``--size``)."""
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=MODES, required=True)
    p.add_argument("--out", required=True, help="where to write the result as JSON")
    p.add_argument("--nvme-dir", required=True,
                   help="folder for this run's files (weights, optimizer state, swap); made here, removed after")
    p.add_argument("--hidden", type=int, required=True)
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--heads", type=int, required=True)
    p.add_argument("--kv-heads", type=int, required=True)
    p.add_argument("--intermediate", type=int, required=True)
    p.add_argument("--vocab", type=int, required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--seq", type=int, required=True)
    p.add_argument("--dtype", choices=("bf16", "fp32"), required=True)
    p.add_argument("--steps", type=int, required=True, help="timed steps")
    p.add_argument("--warmup", type=int, required=True, help="untimed steps first")
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--prefetch", type=int, default=2, help="tierstate: blocks fetched ahead")
    return p


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    """A Llama from a transformers config: random init (seed 0), nothing downloaded, fp32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
                         max_position_embeddings=max(2048, args.seq), tie_word_embeddings=False,
                         use_cache=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.train()
    return model


def tokens_for(args: argparse.Namespace) -> torch.Tensor:
    return torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))


def disk_io() -> tuple[int, int]:
    """(read_bytes, write_bytes) this process has moved to or from storage so far."""
    values = {}
    with open("/proc/self/io") as f:
        for line in f:
            key, _, value = line.partition(":")
            values[key] = int(value)
    return values["read_bytes"], values["write_bytes"]


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_since_reset() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise OSError("/proc/self/status has no VmHWM line")


def current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def lifetime_peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


# -- the two modes: each returns (forward, backward, step, stats, close, info) ------------------------
def tierstate_mode(args, model, tokens, folder: Path):
    import tierstate as ts

    if args.dtype == "bf16":
        model.to(torch.bfloat16)  # bf16 weights; the optimizer keeps the fp32 master in its tier
    ws = ts.offload_weights(model, offload="nvme", nvme_dir=str(folder / "weights"), blocks="auto",
                            prefetch=args.prefetch)
    opt = ts.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                   offload="nvme", nvme_dir=str(folder / "state"), step_in_backward=args.mode == "tierstate")
    info = {"tierstate": ts.__version__, "block_bytes": sum(ws.block_bytes()),
            "blocks": len(ws.block_bytes()), "resident_bytes": ws.resident_bytes()}

    def forward():
        return model(input_ids=tokens, labels=tokens).loss

    def backward(loss):
        loss.backward()

    def step():
        opt.step()
        opt.zero_grad(set_to_none=True)

    last: dict = {}

    def stats():
        """The streamer's counters over this step (they count from the start)."""
        now = _plain(ws.stats())
        step = {k: (v - last.get(k, 0) if k in _COUNTERS and isinstance(v, (int, float)) else v)
                for k, v in now.items()}
        last.update(now)
        return {"weights": step}

    def close():
        opt.close()
        ws.close()

    return forward, backward, step, stats, close, info


# WeightStreamer.stats() keys that count from the start (the rest are levels or settings).
_COUNTERS = ("fetch_bytes", "writeback_bytes", "copy_bytes", "prefetch_hits", "prefetch_misses", "stall_seconds",
             "materializations", "order_changes")


def _plain(value):
    """A JSON-able copy of a stats value (numbers, strings, nested dicts and lists)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    return str(value)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deepspeed_config(args, folder: Path, largest_numel: int) -> dict:
    """ZeRO-3 with the parameters and the optimizer state on NVMe, as DeepSpeed's docs set it up.

    ``offload_param.buffer_size`` must hold the largest parameter (the embedding: 32000 x hidden,
    above the 1e8-element default from hidden 3200 up); ``pin_memory`` is off because the CPU
    accelerator has no page-locked memory to give; the aio settings are the ones measured as
    DeepSpeed's fastest on this VM (../shared/peers/RESULTS.md section 3b: one thread, queue 32)."""
    swap = str(folder)
    return {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "bf16": {"enabled": args.dtype == "bf16"},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS,
                                                  "weight_decay": WEIGHT_DECAY}},
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": False,
            "contiguous_gradients": True,
            "offload_param": {"device": "nvme", "nvme_path": swap, "pin_memory": False, "buffer_count": 5,
                              "buffer_size": max(100_000_000, largest_numel)},
            "offload_optimizer": {"device": "nvme", "nvme_path": swap, "pin_memory": False, "buffer_count": 4},
        },
        "aio": {"block_size": 1 << 20, "queue_depth": 32, "intra_op_parallelism": 1,
                "single_submit": False, "overlap_events": True},
        "steps_per_print": 10**9,
    }


def deepspeed_mode(args, model, tokens, folder: Path):
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(_free_port())), ("RANK", "0"),
                       ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    largest = max(p.numel() for p in model.parameters())
    config = deepspeed_config(args, folder, largest)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    info = {"deepspeed": deepspeed.__version__, "optimizer": type(engine.optimizer).__name__,
            "zero_optimization": config["zero_optimization"]}

    def forward():
        return engine(input_ids=tokens, labels=tokens).loss

    return forward, engine.backward, engine.step, None, None, info


# -- the run ------------------------------------------------------------------------------------------
def run(args: argparse.Namespace, result: dict) -> None:
    """Train ``warmup + steps`` steps of ``args.mode``, filling ``result`` as it goes (so a failure
    leaves what was measured up to it)."""
    torch.set_num_threads(args.threads)
    folder = Path(args.nvme_dir)
    folder.mkdir(parents=True, exist_ok=True)
    t_setup = time.perf_counter()
    model = build_model(args)
    result["nparams"] = sum(p.numel() for p in model.parameters())
    # phase lines: where a run the kernel kills (out of memory) got to
    print(f"[{args.mode}] model built: {result['nparams'] / 1e6:.1f}M parameters in fp32, RSS "
          f"{current_rss() / 2**30:.2f} GiB", file=sys.stderr, flush=True)
    tokens = tokens_for(args)
    setup = deepspeed_mode if args.mode == "ds_z3_nvme" else tierstate_mode
    forward, backward, step, stats, close, info = setup(args, model, tokens, folder)
    result.update(info)
    result["setup_s"] = time.perf_counter() - t_setup
    print(f"[{args.mode}] offload set up in {result['setup_s']:.1f} s, RSS {current_rss() / 2**30:.2f} GiB",
          file=sys.stderr, flush=True)
    result["peak_rss_setup_bytes"] = lifetime_peak_rss()
    result["peak_rss_reset"] = reset_peak_rss()
    steps = result["steps"]
    for i in range(args.warmup + args.steps):
        r0, w0 = disk_io()
        t0 = time.perf_counter()
        loss = forward()
        t1 = time.perf_counter()
        backward(loss)
        t2 = time.perf_counter()
        step()
        t3 = time.perf_counter()
        r1, w1 = disk_io()
        record = {"fwd": t1 - t0, "bwd": t2 - t1, "opt": t3 - t2, "total": t3 - t0,
                  "loss": float(loss.detach().float()), "warmup": i < args.warmup,
                  "read_bytes": r1 - r0, "write_bytes": w1 - w0}
        if stats is not None:
            record.update(stats())
        steps.append(record)
        print(f"[{args.mode}] step {i} fwd {record['fwd']:.2f}s bwd {record['bwd']:.2f}s opt {record['opt']:.2f}s "
              f"read {record['read_bytes'] / 1e9:.2f} GB write {record['write_bytes'] / 1e9:.2f} GB "
              f"loss {record['loss']:.4f}", file=sys.stderr, flush=True)
    result["peak_rss_steps_bytes"] = peak_rss_since_reset() if result["peak_rss_reset"] else None
    result["files_bytes"] = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    if close is not None:
        close()
    result["status"] = "ok"


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    result = {"mode": args.mode, "status": "failed", "steps": [], "threads": args.threads,
              "torch": torch.__version__, "python": sys.executable, "loadavg_start": os.getloadavg()}
    code = 0
    try:
        run(args, result)
    except Exception as exc:  # the failure is the result: report it, with what was measured before it
        lines = str(exc).strip().splitlines()
        result["error"] = f"{type(exc).__name__}: {lines[0] if lines else '(no message)'}"
        traceback.print_exc()
        code = 1
    finally:
        result["peak_rss_bytes"] = lifetime_peak_rss()
        result["loadavg_end"] = os.getloadavg()
        shutil.rmtree(args.nvme_dir, ignore_errors=True)
        Path(args.out).write_text(json.dumps(result))
    return code


if __name__ == "__main__":
    sys.exit(main())
