"""``tierstate generate`` and ``tierstate plan MODEL --generate``.

    tierstate generate ./my-llama --prompt "Once upon a time" --max-new-tokens 32 --weights nvme
    tierstate generate ./my-llama --prompts-file prompts.txt --weights auto --micro-batch 8 --num-micro-batches 4
    tierstate plan llama-13b --generate --batch 32 --prompt-len 64 --new-tokens 32 --host-mem 16GiB
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .compress import ALL_MODES, DEFAULT_GROUP, LOSSLESS

# built-in shapes for `tierstate plan NAME --generate` (transformers config fields)
BUILTIN = {
    "gpt2": ("gpt2", {}),
    "gpt2-xl": ("gpt2", {"n_embd": 1600, "n_layer": 48, "n_head": 25}),
    "tinyllama-1.1b": ("llama", {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
                                 "num_attention_heads": 32, "num_key_value_heads": 4}),
    "llama-7b": ("llama", {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                           "num_attention_heads": 32, "num_key_value_heads": 32}),
    "llama-13b": ("llama", {"hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 40,
                            "num_attention_heads": 40, "num_key_value_heads": 40}),
}
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def model_config(name: str):
    """A transformers config: a folder's ``config.json`` or a built-in shape."""
    from transformers import AutoConfig, GPT2Config, LlamaConfig  # noqa: PLC0415

    path = Path(name)
    if path.is_dir() or path.name == "config.json" or path.suffix == ".safetensors":
        folder = path if path.is_dir() else path.parent
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(2, "no config.json in the model folder", str(folder))
        return AutoConfig.from_pretrained(folder)
    if name in BUILTIN:
        family, fields = BUILTIN[name]
        return (GPT2Config if family == "gpt2" else LlamaConfig)(**fields)
    raise ValueError(f"MODEL {name!r}: give a folder saved by save_pretrained (config.json + safetensors) or one of "
                     f"{', '.join(BUILTIN)}")


def _placement(text: str, what: str):
    """``cpu``, ``nvme``, ``auto`` or ``cpu=0.3`` (that fraction of the layers' bytes in RAM, the rest on NVMe)."""
    if text in ("cpu", "nvme", "auto"):
        return text
    if text.startswith("cpu="):
        from ..placement.offload import Offload  # noqa: PLC0415

        try:
            frac = float(text[4:])
        except ValueError:
            frac = -1.0
        if not 0 <= frac <= 1:
            raise ValueError(f"--{what} {text!r}: the RAM fraction must be a number in [0, 1], e.g. cpu=0.25")
        return Offload(cpu=frac, nvme=1 - frac)
    raise ValueError(f"--{what} {text!r}: expected cpu, nvme, auto or cpu=FRACTION (e.g. cpu=0.25)")


def add_compress_arguments(parser) -> None:
    """``--compress`` / ``--group``, shared by ``tierstate generate`` and ``tierstate plan --generate``."""
    parser.add_argument("--compress", choices=list(ALL_MODES),
                        help="store the layers' matrices group-wise int8 or int4 (about 0.53x / 0.28x of bf16; "
                             "the tokens may differ from the uncompressed model's), or, for bf16 layers on NVMe, "
                             "lossless (exponents in 4 bits: about 0.75x of the bytes read, the same tokens)")
    parser.add_argument("--group", type=int,
                        help=f"values per quantization scale (default {DEFAULT_GROUP}; with --compress int8 or int4)")


def compress_options(args) -> tuple[str | None, int | None]:
    """(compress, group) from ``--compress`` / ``--group`` (None: ``DEFAULT_GROUP``); ValueError
    for a --group without --compress."""
    if args.group is not None and args.compress in (None, LOSSLESS):
        raise ValueError(f"--group {args.group}: give --compress int8 or int4 with it (lossless has no groups)")
    return args.compress, args.group


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="a folder saved by save_pretrained (config.json + model.safetensors)")
    parser.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for a batch)")
    parser.add_argument("--prompts-file", help="a text file, one prompt per line (blank lines skipped)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--weights", default="auto", help="cpu, nvme, auto or cpu=FRACTION (default auto)")
    parser.add_argument("--kv", default="cpu", help="where the KV cache lives: cpu, nvme, auto or cpu=FRACTION")
    parser.add_argument("--nvme-dir", help="folder for the NVMe files (removed at the end)")
    parser.add_argument("--micro-batch", type=int)
    parser.add_argument("--num-micro-batches", type=int, default=1)
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="default: the checkpoint's")
    parser.add_argument("--do-sample", action="store_true")
    parser.add_argument("--temperature", type=float)
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--stop", action="append", type=int, default=[], metavar="TOKEN_ID",
                        help="a token id that ends a sequence (repeat; default: the config's eos)")
    add_compress_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the texts and figures as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress line")


def _prompts(args) -> list[str]:
    prompts = list(args.prompt)
    if args.prompts_file:
        try:
            text = Path(args.prompts_file).read_text()
        except OSError as exc:
            raise type(exc)(exc.errno, f"--prompts-file: cannot read it ({exc.strerror})", args.prompts_file) from exc
        prompts += [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ValueError("give at least one --prompt or a --prompts-file")
    return prompts


def main(args: argparse.Namespace) -> int:
    import torch  # noqa: PLC0415

    from .model import OffloadedLM  # noqa: PLC0415

    try:
        prompts = _prompts(args)
        weights, kv = _placement(args.weights, "weights"), _placement(args.kv, "kv")
        dtype = getattr(torch, DTYPES[args.dtype]) if args.dtype else None
        compress, group = compress_options(args)
        t0 = time.perf_counter()
        lm = OffloadedLM.from_pretrained(args.model, weights=weights, kv=kv, nvme_dir=args.nvme_dir,
                                         micro_batch=args.micro_batch, num_micro_batches=args.num_micro_batches,
                                         dtype=dtype, compress=compress, group=group)
    except (ValueError, TypeError) as exc:
        print(f"tierstate generate: {exc}", file=sys.stderr)
        return 2
    load_s = time.perf_counter() - t0
    with lm:
        if lm.tokenizer is None:
            print(f"tierstate generate: {args.model} has no tokenizer files (tokenizer.json / vocab.json): save the "
                  "tokenizer next to the model", file=sys.stderr)
            return 2
        if not args.quiet:
            print(f"loaded in {load_s:.1f} s: {lm!r}", file=sys.stderr)
        started = time.perf_counter()

        def progress(step: int, total: int) -> None:
            if args.quiet:
                return
            rate = step * len(prompts) / (time.perf_counter() - started)
            end = "\n" if step == total else "\r"
            print(f"  token {step}/{total}  {rate:.2f} tokens/s", end=end, file=sys.stderr, flush=True)

        try:
            out = lm.generate(prompts, max_new_tokens=args.max_new_tokens, do_sample=args.do_sample,
                              temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                              eos_token_id=args.stop or None, progress=progress)
        except (ValueError, TypeError) as exc:
            print(f"tierstate generate: {exc}", file=sys.stderr)
            return 2
        st = lm.stats()
        width = out.shape[1] - st["new_tokens_per_sequence"]
        texts = [lm.tokenizer.decode(row[width:], skip_special_tokens=True) for row in out]
    summary = (f"{st['tokens']} tokens for {st['sequences']} prompts in {st['seconds']:.2f} s: "
               f"{st['tokens_per_s']:.2f} tokens/s (prefill {st['prefill_seconds']:.2f} s); weights read "
               f"{st['weight_read_bytes'] / 2**30:.2f} GiB from NVMe, waited {st['weight_stall_seconds']:.2f} s")
    if args.json:
        print(json.dumps({"prompts": prompts, "completions": texts, "stats": st}, indent=2))
    else:
        for p, t in zip(prompts, texts):
            print(f"{p}{t}")
            print("---")
        print(summary, file=sys.stderr)
    return 0


def plan_main(args: argparse.Namespace, load_hardware, parse_size) -> int:
    """``tierstate plan MODEL --generate``: print the chosen placement, its predicted tokens/s,
    the bottleneck and the rejected alternatives. ``load_hardware(path)`` and
    ``parse_size(text, name)`` are ``tierstate plan``'s own (passed in: plan_cli imports this
    module, not the other way round)."""
    from ..placement.generate_plan import (GenerateBudget, GenerateHardware, GenerateWorkload,  # noqa: PLC0415
                                           PlanError, plan_generate, shape_from_config)
    from .policy import available_ram, default_budget, rss_bytes  # noqa: PLC0415

    try:
        if not args.model:
            raise ValueError("--generate needs MODEL: a folder with config.json or one of " + ", ".join(BUILTIN))
        config = model_config(args.model)
        dtype_bytes = {"fp32": 4, "bf16": 2, "fp16": 2}[args.param_dtype or "bf16"]
        compress, group = compress_options(args)
        if compress:
            import torch  # noqa: PLC0415

            from .adapters import build_meta  # noqa: PLC0415
            from .weight_store import layer_sizes  # noqa: PLC0415

            dtype = getattr(torch, DTYPES[args.param_dtype or "bf16"])
            full, stored = layer_sizes(build_meta(config, None).layers, dtype, compress,
                                       DEFAULT_GROUP if group is None else group)
            shape = shape_from_config(config, dtype_bytes, full, stored, lossless=compress == LOSSLESS)
        else:
            shape = shape_from_config(config, dtype_bytes)
        hw_rates, _ = load_hardware(args.profile)
        hw = GenerateHardware.from_rates(hw_rates, base_rss=rss_bytes())
        budget = default_budget(args.nvme_dir)
        budget = GenerateBudget(ram=parse_size(args.host_mem, "--host-mem") if args.host_mem else budget.ram,
                                disk=parse_size(args.disk, "--disk") if args.disk else budget.disk)
        wl = GenerateWorkload(args.batch, args.prompt_len, args.new_tokens)
        plan = plan_generate(shape, wl, hw, budget, micro_batch=args.micro_batch,
                             num_micro_batches=args.num_micro_batches)
    except (PlanError, ValueError, TypeError) as exc:
        print(f"tierstate plan: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plan.as_dict(), indent=2, default=str))
        return 0
    print(f"tierstate plan {args.model} --generate: {wl.batch} prompts x {wl.prompt_len} tokens, "
          f"{wl.new_tokens} new tokens each, {args.param_dtype or 'bf16'}")
    stored = (f" (~{sum(shape.stored_bytes) / 2**30:.2f} GiB as the lossless code reads them from NVMe)"
              if args.compress == LOSSLESS else
              f" ({sum(shape.stored_bytes) / 2**30:.2f} GiB stored as {args.compress})" if args.compress else "")
    print(f"  model: {shape.n_layers} layers, {sum(shape.layer_bytes) / 2**30:.2f} GiB of layer weights{stored}, "
          f"{shape.resident_bytes / 2**30:.2f} GiB resident")
    print(f"  budget: RAM {budget.ram / 2**30:.1f} GiB, disk {budget.disk / 2**30:.1f} GiB "
          f"(available RAM now {available_ram() / 2**30:.1f} GiB)")
    for line in plan.describe():
        print("  " + line)
    return 0
