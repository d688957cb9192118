"""``tierstate demo``: train a small GPT with offloaded optimizer state and show what happened."""
from __future__ import annotations

import argparse
import sys

from ..bench._timing import positive_int
from .model import MODEL_PRESETS
from .train import DTYPES, OFFLOAD_CHOICES, RUN_DEFAULTS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the demo's options to ``parser``."""
    parser.description = (
        "Train a GPT of the project's own on a synthetic corpus with tierstate.AdamW, the "
        "optimizer state offloaded; show the loss falling, then where bytes and time went."
    )
    presets = ", ".join(
        f"{name} ({config.num_parameters() / 1e6:.3g}M: batch {RUN_DEFAULTS[name].batch_size}, "
        f"seq {RUN_DEFAULTS[name].seq_len}, lr {RUN_DEFAULTS[name].lr:g})"
        for name, config in MODEL_PRESETS.items()
    )
    parser.add_argument(
        "--model", choices=list(MODEL_PRESETS), default=None,
        help=f"model size; default small on cuda, tiny on cpu. Presets: {presets}",
    )
    parser.add_argument("--steps", type=positive_int, default=100, help="optimizer steps (default 100)")
    parser.add_argument("--batch-size", type=positive_int, default=None, help="sequences per step (default per model)")
    parser.add_argument("--seq-len", type=positive_int, default=None, help="tokens per sequence (default per model)")
    parser.add_argument(
        "--offload", choices=list(OFFLOAD_CHOICES), default="cpu",
        help="where the optimizer state lives: host RAM, NVMe files, or chosen by the planner (default cpu)",
    )
    parser.add_argument("--nvme-dir", default=None, help="folder for the NVMe tier (with --offload nvme)")
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate (default per model)")
    parser.add_argument(
        "--dtype", choices=list(DTYPES), default="fp32",
        help="model parameter dtype; with bf16 the optimizer keeps an fp32 master copy (default fp32)",
    )
    parser.add_argument("--device", default=None, help="torch device for the model (default cuda if available, else cpu)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the corpus, the weights and the batches (default 0)")
    parser.add_argument("--json", dest="json_path", metavar="PATH", default=None, help="also write the summary as JSON")
    parser.add_argument("--trace", dest="trace_path", metavar="PATH", default=None,
                        help="write a Chrome/Perfetto trace of the optimizer steps")


def main(args: argparse.Namespace) -> int:
    """Run the demo with parsed ``args``; print the corpus, a progress bar and the summary."""
    from rich.console import Console

    from .corpus import SyntheticCorpus
    from .summary import print_summary
    from .train import default_model, is_local_rank_zero, resolve_device, run_demo

    console = Console()
    try:
        device = resolve_device(args.device)
        model = args.model or default_model(device)
        show = is_local_rank_zero()
        if show:
            corpus = SyntheticCorpus(args.seed)
            console.print(
                f"[bold]tierstate demo[/]: {model} GPT on {device}, optimizer state offloaded to {args.offload}\n"
                f"corpus (floor {corpus.entropy_per_token:.2f} nats/byte): [dim]{corpus.text(0, 72)}...[/]"
            )
        summary = run_demo(
            model, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
            offload=args.offload, nvme_dir=args.nvme_dir, lr=args.lr, dtype=args.dtype,
            device=device, seed=args.seed, json_path=args.json_path, trace_path=args.trace_path,
            progress=show,
        )
    except (ValueError, FileNotFoundError) as exc:
        # Bad input: one line naming the argument, not a traceback.
        print(f"tierstate demo: error: {exc}", file=sys.stderr)
        return 2
    if show:
        print_summary(summary, console)
    return 0
