"""A model whose weights exceed RAM generates: a Llama-shaped random-init checkpoint (13B in
bf16 is 24.2 GiB of weights) written to disk a tensor at a time, then ``OffloadedLM`` with
``weights="auto", kv="auto"`` under a RAM budget; the process's peak RSS is compared with the
RAM the planner predicted for its choice (the check: within 10 %).

    python benchmarks/generate_capacity.py --size 13b --dir /mnt/nvme/gen13b --ram-budget 8GiB \\
        [--batch 8] [--prompt-len 32] [--new-tokens 8] [--keep] [--json out.json]
    python benchmarks/generate_capacity.py --size small --dir /tmp/gencap      # the same path, in seconds
    python benchmarks/generate_capacity.py --size small --dir /tmp/gencap --compress int8   # layers stored int8

Disk: the checkpoint (24.2 GiB at 13B bf16) plus the NVMe records of the layers the planner
streams (up to the same again) plus the KV records; the script checks the free space first.
The checkpoint is kept between runs with ``--keep`` (rewriting 13B takes minutes).
The generation runs in a process of its own (this file with ``--worker``), so its peak RSS
(``ru_maxrss``) is its own: the interpreter, torch and transformers, the resident tensors,
the layers in RAM, the NVMe pools, the KV cache and the activations.
"""
from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

SIZES = {  # hidden, intermediate, layers, heads (kv heads = heads), vocab
    "small": (512, 1376, 8, 8, 32000),
    "1b": (2048, 5632, 22, 32, 32000),
    "7b": (4096, 11008, 32, 32, 32000),
    "13b": (5120, 13824, 40, 40, 32000),
}


def _config(size: str):
    from transformers import LlamaConfig

    h, inter, layers, heads, vocab = SIZES[size]
    return LlamaConfig(vocab_size=vocab, hidden_size=h, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=4096,
                       tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def _parse_size(text: str) -> int:
    from tierstate.plan_cli import parse_size

    return parse_size(text, "--ram-budget")


def worker(args) -> dict:
    import torch

    from tierstate.generate import OffloadedLM
    from tierstate.placement.generate_plan import GenerateBudget, GenerateWorkload

    folder = Path(args.dir) / "model"
    wl = GenerateWorkload(args.batch, args.prompt_len, args.new_tokens)
    if args.ram_over_base:
        import transformers.models.llama.modeling_llama  # noqa: F401 - the base includes what generate imports

        from tierstate.generate.policy import rss_bytes
        ram = rss_bytes() + _parse_size(args.ram_over_base)
    else:
        ram = _parse_size(args.ram_budget)
    budget = GenerateBudget(ram=ram, disk=shutil.disk_usage(args.dir).free)
    hardware = None
    if args.measure:
        from tierstate.generate.policy import measure_hardware
        from transformers import AutoConfig
        hardware = measure_hardware(AutoConfig.from_pretrained(folder), torch.bfloat16, Path(args.dir) / "nvme")
    t0 = time.perf_counter()
    lm = OffloadedLM.from_pretrained(folder, weights="auto", kv="auto", nvme_dir=Path(args.dir) / "nvme",
                                     budget=budget, workload=wl, hardware=hardware, compress=args.compress)
    load_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, lm.config.vocab_size, (args.batch, args.prompt_len), generator=g)
    t1 = time.perf_counter()
    out = lm.generate(ids, max_new_tokens=args.new_tokens, eos_token_id=[], pad_token_id=0)
    gen_s = time.perf_counter() - t1
    st = lm.stats()
    plan = lm.plan
    lm.close()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"plan": {"weight_layers_in_ram": plan.weight_tiers.count("cpu"), "weight_layers_on_nvme":
                     plan.weight_tiers.count("nvme"), "kv_layers_in_ram": plan.kv_tiers.count("cpu"),
                     "micro_batch": plan.micro_batch, "num_micro_batches": plan.num_micro_batches,
                     "predicted_ram_bytes": plan.ram_bytes, "predicted_tokens_per_s": plan.tokens_per_s,
                     "bottleneck": plan.bottleneck, "ram_parts": plan.breakdown["ram_parts"]},
            "budget_ram_bytes": budget.ram, "peak_rss_bytes": peak,
            "rss_vs_predicted": peak / plan.ram_bytes, "load_seconds": load_s, "generate_seconds": gen_s,
            "tokens": int(out[:, ids.shape[1]:].numel()), "tokens_per_s": st["tokens_per_s"],
            "weight_read_bytes": st["weight_read_bytes"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="13b")
    p.add_argument("--dir", required=True, help="folder for the checkpoint and the NVMe files")
    p.add_argument("--ram-budget", default="8GiB", help="peak RSS the planner must keep under (default 8GiB)")
    p.add_argument("--ram-over-base", help="instead of --ram-budget: this much over the RSS of the process once "
                   "torch and transformers are imported (a budget that means the same on any machine)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--compress", choices=("int8", "int4"), help="store the layers compressed (group 64)")
    p.add_argument("--measure", action="store_true", help="measure the rates now (else the saved probe profile)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoint for the next run")
    p.add_argument("--json", help="write the result here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    import torch

    from tierstate.generate.synthetic import write_random_checkpoint
    from tierstate.placement.generate_plan import shape_from_config

    base = Path(args.dir)
    base.mkdir(parents=True, exist_ok=True)
    cfg = _config(args.size)
    shape = shape_from_config(cfg, 2)
    weights = sum(shape.layer_bytes) + shape.resident_bytes
    ckpt = base / "model" / "model.safetensors"
    have = ckpt.is_file() and ckpt.stat().st_size >= weights
    need = (0 if have else weights) + sum(shape.layer_bytes)
    free = shutil.disk_usage(base).free
    if need > free:
        print(f"generate_capacity: needs up to {need / 2**30:.1f} GiB under {base} (checkpoint and NVMe records), "
              f"{free / 2**30:.1f} GiB free", file=sys.stderr)
        return 2
    if not have:
        t0 = time.perf_counter()
        write_random_checkpoint(cfg, base / "model", dtype=torch.bfloat16, seed=0)
        print(f"wrote {ckpt} ({ckpt.stat().st_size / 2**30:.1f} GiB) in {time.perf_counter() - t0:.0f} s",
              file=sys.stderr)
    try:
        cmd = [sys.executable, __file__, "--worker", *[a for a in (argv if argv is not None else sys.argv[1:])]]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            print(res.stderr[-4000:], file=sys.stderr)
            return res.returncode
        result = json.loads(res.stdout.strip().splitlines()[-1])
    finally:
        if not args.keep:
            shutil.rmtree(base / "model", ignore_errors=True)
    result["size"] = args.size
    result["weights_bytes"] = weights
    result["within_10_percent"] = abs(result["rss_vs_predicted"] - 1) <= 0.10
    result["under_budget"] = result["peak_rss_bytes"] <= result["budget_ram_bytes"]
    text = json.dumps(result, indent=2)
    if args.json:
        Path(args.json).write_text(text)
    print(text)
    return 0 if result["within_10_percent"] else 1


if __name__ == "__main__":
    sys.exit(main())
