"""Offloaded generation: tierstate's OffloadedLM against Hugging Face Accelerate's disk offload
(``device_map``, ``max_memory``, ``offload_folder``), the same model, prompts, batch and RAM
budget for the layers' weights, on the CPU.

    python benchmarks/generate_vs_accelerate.py [--layers 16] [--hidden 2048] [--intermediate 5632]
        [--dtype bf16] [--batch 8] [--prompt-len 32] [--new-tokens 8] [--ram-layers 4] [--repeats 2]
        [--modes tierstate,accelerate_cold,accelerate_warm] [--dir DIR] [--json out.json]

The model is a random-init ``LlamaForCausalLM`` (seed 0, vocabulary 32000, untied head) written
as safetensors a tensor at a time (:func:`tierstate.generate.synthetic.write_random_checkpoint`).
Both sides keep the same ``--ram-layers`` decoder layers in RAM, and the embeddings and head;
the rest are read from disk for every generated token:

=====================  ===================================================================
``tierstate``          ``OffloadedLM.from_pretrained(weights=[cpu x ram-layers, nvme ...],
                       kv="cpu", micro_batch=batch)``: one O_DIRECT record per layer, the
                       next layer read while this one computes
``accelerate_cold``    ``AutoModelForCausalLM.from_pretrained(device_map=..., max_memory=
                       {"cpu": ram-layers' bytes + the resident tensors}, offload_folder=...)``.
                       transformers 5 reads offloaded weights straight from the checkpoint's
                       safetensors file (a memory map). Before each offloaded layer runs, the
                       file's pages are dropped from the page cache (``posix_fadvise(DONTNEED)``):
                       what a machine whose RAM is the budget would do, since the budget leaves
                       no room to cache the file. Without root the page cache cannot be dropped
                       globally; this drops exactly the file's pages
``accelerate_warm``    the same without dropping: the offloaded weights come from the page cache
                       after the first token (RAM the budget does not count; what Accelerate
                       gets on a machine with the whole model's size of free RAM)
``tierstate_int8``     ``tierstate`` with ``compress="int8"``: the offloaded layers' matrices
                       stored group-wise int8 (group 64), about half the bytes read per token.
                       Not the same model: its tokens may differ (``same_tokens`` says), so it
                       is reported beside the comparison, not as it, with the disk floor of
                       its own bytes. Not in the default modes
``tierstate_int4``     the same with ``compress="int4"``: about 0.28x the bytes of bf16
``tierstate_lossless`` ``tierstate`` with ``compress="lossless"``: the offloaded layers'
                       bf16 matrices stored with their exponents in 4 bits, about 0.75x the
                       bytes read per token, decoded to the same bits: the same model, so
                       its tokens must be Accelerate's (``same_tokens``); with the disk floor
                       of its own bytes beside the one of the bf16 bytes
=====================  ===================================================================

Each run is a process of its own (this file with ``--worker``); the modes alternate over
``--repeats`` rounds (A, B, C, A, B, C ...). Per run: tokens/s over the whole ``generate``
(prefill included), the decode steps' tokens/s, bytes read from storage (``/proc/self/io``
``read_bytes``), peak RSS, and a hash of the tokens (both sides must agree: greedy decoding of
the same weights). The disk floor is the weight bytes read per generated token (the offloaded
layers, once per step for the whole batch) over the disk's O_DIRECT read rate, probed on the
same folder before the runs.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tierstate.bench.e2e import modes_option  # the --modes check of bench e2e


MODES = ("tierstate", "accelerate_cold", "accelerate_warm", "tierstate_int8", "tierstate_int4", "tierstate_lossless")
COMPRESSED = {"tierstate_int8": "int8", "tierstate_int4": "int4", "tierstate_lossless": "lossless"}


def _config(args):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=32000, hidden_size=args.hidden, intermediate_size=args.intermediate,
                       num_hidden_layers=args.layers, num_attention_heads=args.heads,
                       num_key_value_heads=args.heads, max_position_embeddings=4096, tie_word_embeddings=False,
                       bos_token_id=1, eos_token_id=2)


def _prompts(args):
    import torch

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 32000, (args.batch, args.prompt_len), generator=g)
    return ids, torch.ones_like(ids)


def _io_read_bytes() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return 0


def worker(args) -> dict:
    import torch

    torch.manual_seed(0)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    folder = Path(args.dir) / "model"
    ids, mask = _prompts(args)
    L = args.layers
    out: dict = {"mode": args.worker}
    read0 = _io_read_bytes()
    t0 = time.perf_counter()
    stamps = []
    if args.worker == "tierstate" or args.worker in COMPRESSED:
        from tierstate.generate import OffloadedLM

        tiers = ["cpu"] * args.ram_layers + ["nvme"] * (L - args.ram_layers)
        lm = OffloadedLM.from_pretrained(folder, weights=tiers, kv="cpu", nvme_dir=Path(args.dir) / "ts-nvme",
                                         micro_batch=args.batch, dtype=dtype,
                                         compress=COMPRESSED.get(args.worker))
        out["load_seconds"] = time.perf_counter() - t0
        read1 = _io_read_bytes()
        t1 = time.perf_counter()
        tokens = lm.generate(ids, attention_mask=mask, max_new_tokens=args.new_tokens, eos_token_id=[],
                             pad_token_id=0, progress=lambda s, n: stamps.append(time.perf_counter()))
        out["stats"] = {k: v for k, v in lm.stats().items()}
        lm.close()
    else:
        from transformers import AutoModelForCausalLM

        shape_bytes = _layer_bytes(args, dtype)
        resident = (2 * 32000 * args.hidden + args.hidden) * (2 if dtype == torch.bfloat16 else 4)
        budget = resident + args.ram_layers * shape_bytes + (1 << 20)  # 1 MiB: the norms' slack
        model = AutoModelForCausalLM.from_pretrained(folder, device_map="auto", max_memory={"cpu": budget},
                                                     offload_folder=str(Path(args.dir) / "acc-offload"), dtype=dtype)
        model.eval()
        dmap = getattr(model, "hf_device_map", {"": "cpu"})
        out["device_map"] = {k: str(v) for k, v in dmap.items()}
        out["disk_layers"] = sum(1 for k, v in dmap.items() if str(v) == "disk" and k.startswith("model.layers."))
        out["load_seconds"] = time.perf_counter() - t0
        ckpt = str(folder / "model.safetensors")
        fd = os.open(ckpt, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # both accelerate modes start cold
        if args.worker == "accelerate_cold":
            disk_layers = [m for i, m in enumerate(model.model.layers)
                           if str(dmap.get(f"model.layers.{i}", "")) == "disk"]

            def drop(module, inputs):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            for m in disk_layers:
                m.register_forward_pre_hook(drop)
            out["dropped_layers"] = len(disk_layers)
        read1 = _io_read_bytes()
        t1 = time.perf_counter()

        from transformers import StoppingCriteria

        class Stamp(StoppingCriteria):
            def __call__(self, input_ids, scores, **kw):
                stamps.append(time.perf_counter())
                return torch.zeros(input_ids.shape[0], dtype=torch.bool)
        with torch.no_grad():
            tokens = model.generate(ids, attention_mask=mask, max_new_tokens=args.new_tokens, do_sample=False,
                                    pad_token_id=0, eos_token_id=None, stopping_criteria=[Stamp()])
        os.close(fd)
    t2 = time.perf_counter()
    new = tokens[:, ids.shape[1]:]
    out.update({
        "seconds": t2 - t1, "tokens": int(new.numel()), "tokens_per_s": new.numel() / (t2 - t1),
        "decode_tokens_per_s": (args.batch * (len(stamps) - 1) / (stamps[-1] - stamps[0])) if len(stamps) > 1 else None,
        "prefill_seconds": stamps[0] - t1 if stamps else None,
        "storage_read_bytes": _io_read_bytes() - read1, "load_read_bytes": read1 - read0,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "tokens_sha1": hashlib.sha1(new.numpy().tobytes()).hexdigest(),
    })
    return out


def _layer_bytes(args, dtype) -> int:
    import torch

    h, i = args.hidden, args.intermediate
    per = 4 * h * h + 3 * h * i + 2 * h
    return per * torch.empty(0, dtype=dtype).element_size()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--ram-layers", type=int, default=4, help="decoder layers both sides keep in RAM")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--modes", type=modes_option(MODES), default=["tierstate", "accelerate_cold", "accelerate_warm"])
    p.add_argument("--dir", help="folder for the checkpoint and the NVMe files (default: a temporary one)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    modes = args.modes
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    import torch

    from tierstate.generate.synthetic import write_random_checkpoint
    from tierstate.placement.probe import measure_disk

    own = args.dir is None
    base = Path(args.dir or tempfile.mkdtemp(prefix="ts-gen-bench-", dir=os.environ.get("TIERSTATE_NVME_DIR")))
    args.dir = str(base)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    t0 = time.perf_counter()
    ckpt = write_random_checkpoint(_config(args), base / "model", dtype=dtype, seed=0)
    print(f"checkpoint: {ckpt.stat().st_size / 2**30:.2f} GiB in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    disk = measure_disk(base / "probe", 512 << 20, reps=2)
    runs = []
    try:
        for r in range(args.repeats):
            for mode in modes:
                cmd = [sys.executable, __file__, "--worker", mode] + [a for a in sys.argv[1:] if a != "--worker"]
                cmd += ["--dir", str(base)]
                res = subprocess.run(cmd, capture_output=True, text=True)
                if res.returncode != 0:
                    print(res.stderr[-3000:], file=sys.stderr)
                    raise SystemExit(f"{mode} failed (exit {res.returncode})")
                run = json.loads(res.stdout.strip().splitlines()[-1])
                run["round"] = r
                runs.append(run)
                print(f"round {r} {mode:16s} {run['tokens_per_s']:7.3f} tokens/s (decode "
                      f"{run['decode_tokens_per_s'] or 0:.3f}), read {run['storage_read_bytes'] / 2**30:.2f} GiB, "
                      f"peak RSS {run['peak_rss_bytes'] / 2**30:.2f} GiB", file=sys.stderr)
    finally:
        if own:
            import shutil
            shutil.rmtree(base, ignore_errors=True)
    layer_b = _layer_bytes(args, dtype)
    per_step = (args.layers - args.ram_layers) * layer_b
    floor_step_s = per_step / disk["read_bytes_per_s"]
    summary = {"config": {k: v for k, v in vars(args).items() if k != "worker"},
               "disk_read_bytes_per_s": disk["read_bytes_per_s"], "weight_bytes_per_step": per_step,
               "disk_floor_tokens_per_s": args.batch / floor_step_s, "modes": {}}
    for mode in modes:
        rs = [r for r in runs if r["mode"] == mode]
        summary["modes"][mode] = {
            "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in rs),
            "decode_tokens_per_s_median": statistics.median(r["decode_tokens_per_s"] for r in rs),
            "storage_read_gib_median": statistics.median(r["storage_read_bytes"] for r in rs) / 2**30,
            "peak_rss_gib_median": statistics.median(r["peak_rss_bytes"] for r in rs) / 2**30,
            "tokens_sha1": sorted({r["tokens_sha1"] for r in rs}),
        }
    m = summary["modes"]
    if "tierstate" in m:
        for other in modes:
            if other != "tierstate" and other != "tierstate_lossless":
                m[other]["tierstate_speedup"] = m["tierstate"]["tokens_per_s_median"] / m[other]["tokens_per_s_median"]
                m[other]["same_tokens"] = m[other]["tokens_sha1"] == m["tierstate"]["tokens_sha1"]
    for mode in COMPRESSED:
        if mode not in m:
            continue
        stored = statistics.median(r["stats"]["weight_read_bytes"] for r in runs if r["mode"] == mode)
        steps = statistics.median(r["stats"]["new_tokens_per_sequence"] for r in runs if r["mode"] == mode)
        m[mode]["disk_floor_tokens_per_s"] = args.batch * steps * disk["read_bytes_per_s"] / stored
        if "accelerate_cold" in m:
            m[mode]["speedup_over_accelerate_cold"] = (m[mode]["tokens_per_s_median"]
                                                       / m["accelerate_cold"]["tokens_per_s_median"])
            m[mode]["same_tokens_as_accelerate_cold"] = m[mode]["tokens_sha1"] == m["accelerate_cold"]["tokens_sha1"]
    summary["runs"] = runs
    text = json.dumps(summary, indent=2)
    if args.json:
        Path(args.json).write_text(text)
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
