"""Models and data shared by the examples: transformers models built from configs (random
init, nothing downloaded) and a synthetic next-token task whose loss visibly falls.

``--tiny`` sizes run in seconds on 2 CPU cores (CI); the full sizes are what you would
fine-tune by hand.
"""
from __future__ import annotations

import argparse
import os
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SIZES = {
    # kind -> (tiny, full) config arguments
    "gpt2": (dict(n_embd=32, n_layer=2, n_head=2, vocab_size=64, n_positions=32),
             dict(n_embd=768, n_layer=12, n_head=12, vocab_size=50257, n_positions=1024)),   # GPT-2 small, 124M
    "llama": (dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=1, vocab_size=64, max_position_embeddings=32),
              dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16,
                   num_key_value_heads=4, vocab_size=32000, max_position_embeddings=1024)),    # ~220M
}


def build_model(kind: str, tiny: bool, **overrides):
    """A causal LM of ``kind`` ("gpt2" or "llama") with random weights."""
    import transformers

    cfg = {**SIZES[kind][0 if tiny else 1], **overrides}
    if kind == "gpt2":
        config = transformers.GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                         eos_token_id=0, **cfg)
        return transformers.GPT2LMHeadModel(config)
    config = transformers.LlamaConfig(bos_token_id=0, eos_token_id=0, **cfg)
    return transformers.LlamaForCausalLM(config)


class CountingTokens(torch.utils.data.Dataset):
    """Sequences counting up from a random start (mod ``vocab``): a learnable next-token task."""

    def __init__(self, n: int, seq: int, vocab: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = (torch.randint(0, vocab, (n, 1), generator=g) + torch.arange(seq)) % vocab

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def dataset_for(model, tiny: bool, n: int | None = None) -> CountingTokens:
    seq = 16 if tiny else 256
    return CountingTokens(n or (64 if tiny else 2048), seq, model.config.vocab_size)


def train_data_parallel(model, opt, data, steps: int, device, first_epoch: int = 0):
    """``steps`` optimizer steps over this rank's slice of ``data`` (a ``DistributedSampler``,
    batches of 4, a new shuffle each epoch); (first loss, last loss, seconds)."""
    sampler = torch.utils.data.distributed.DistributedSampler(data, num_replicas=torch.distributed.get_world_size(),
                                                              rank=torch.distributed.get_rank(), seed=0)
    loader = torch.utils.data.DataLoader(data, batch_size=4, sampler=sampler)
    done, first, loss, epoch = 0, None, None, first_epoch
    start = time.perf_counter()
    while done < steps:
        sampler.set_epoch(epoch)
        for batch in loader:
            loss = model(**{k: v.to(device) for k, v in batch.items()}).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            first = loss.item() if first is None else first
            done += 1
            if done >= steps:
                break
        epoch += 1
    return first, loss.item(), time.perf_counter() - start


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, description=description)
    p.add_argument("--tiny", action="store_true", help="a tiny model and a few steps (CI)")
    p.add_argument("--model", choices=sorted(SIZES), default="gpt2")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: 8 tiny, 200 full)")
    p.add_argument("--out", default=None, help="output directory (default: a temporary one)")
    return p


def steps_of(args) -> int:
    return args.steps or (8 if args.tiny else 200)


def peak_rss_gib() -> float:
    """This process's peak resident memory so far, in GiB (ru_maxrss: KiB on Linux, bytes on macOS)."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (2**30 if sys.platform == "darwin" else 2**20)


def figures(optimizer, steps: int, wall_s: float) -> str:
    """The one line of figures examples/README.md quotes for a run: wall time per training step,
    tierstate's optimizer step time and its largest phase, the state per tier, the bytes each
    tier moved per step and the bandwidth achieved, and the process's peak RSS."""
    from tierstate.integrations.common import find_offload_optimizer

    opt = find_offload_optimizer(optimizer)
    totals = opt.telemetry.totals()
    parts = [f"{wall_s / steps:.2f} s/step over {steps} steps"]
    if totals is not None:
        phase, share = totals.bottleneck
        parts.append(f"optimizer {totals.wall_s / totals.steps * 1e3:.1f} ms/step ({phase} {share:.0%})")
        moved = [f"{k} {v / totals.steps / 2**30:.2f} GiB" for k, v in sorted(totals.bytes.items()) if v]
        if moved:
            parts.append("per step " + ", ".join(moved))
        rates = [f"{k} {bw.gbps:.2f} GB/s" for k, bw in sorted(totals.bandwidth.items()) if bw.gbps]
        if rates:
            parts.append(", ".join(rates))
    parts.append("state " + ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in opt.tier_bytes().items()))
    parts.append(f"peak RSS {peak_rss_gib():.2f} GiB")
    return "figures: " + "; ".join(parts)
