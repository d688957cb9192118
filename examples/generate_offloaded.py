"""Generate with a Llama-style model whose layer weights live on NVMe and whose KV cache
lives on NVMe too, FlexGen-style: the batch is cut into micro-batches that share every read
of a layer's weights; the next layer is read while this one computes.

    python examples/generate_offloaded.py --tiny --nvme-dir /tmp/ts-gen          # CI: seconds
    python examples/generate_offloaded.py --nvme-dir /mnt/nvme/ts-gen             # 1.1B params: by hand

The model is random-init (nothing downloaded), written as safetensors a tensor at a time
(``tierstate.generate.synthetic``), then loaded straight into its tiers: the first quarter of
the layers' bytes in RAM, the rest as O_DIRECT records on NVMe. The same greedy tokens come out
of transformers' own ``generate`` (checked with ``--tiny``, where the resident model fits).
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import tierstate as ts
from tierstate.generate.synthetic import write_random_checkpoint

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512)
FULL = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
            num_key_value_heads=4, vocab_size=32000)  # TinyLlama 1.1B's shape


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="a 0.3M-parameter model, checked against transformers")
    p.add_argument("--nvme-dir", default=None, help="folder for the checkpoint and the NVMe records")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=16)
    args = p.parse_args()
    root = Path(args.nvme_dir or tempfile.mkdtemp(prefix="ts-gen-"))
    config = LlamaConfig(max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                         **(TINY if args.tiny else FULL))
    dtype = torch.float32 if args.tiny else torch.bfloat16
    write_random_checkpoint(config, root / "model", dtype=dtype, seed=0)

    # prompts of different lengths: a list of token-id lists, padded on the left
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, config.vocab_size, (n,), generator=g).tolist()
               for n in (5, 9, 3, 12, 7, 9, 4, 11)[: args.batch]]

    with ts.OffloadedLM.from_pretrained(root / "model", weights=ts.Offload(cpu=0.25, nvme=0.75), kv="nvme",
                                        nvme_dir=root / "run", micro_batch=max(1, args.batch // 2),
                                        num_micro_batches=2) as lm:
        print(lm)
        t0 = time.perf_counter()
        out = lm.generate(prompts, max_new_tokens=args.new_tokens, eos_token_id=[], pad_token_id=0)
        st = lm.stats()
        print(f"{st['tokens']} tokens in {time.perf_counter() - t0:.2f} s: {st['tokens_per_s']:.1f} tokens/s; "
              f"{st['weight_read_bytes'] / 2**20:.1f} MiB of weights read from NVMe "
              f"({st['weight_read_bytes'] / max(st['new_tokens_per_sequence'], 1) / 2**20:.1f} MiB per token step "
              f"for all {st['sequences']} sequences)")
    if args.tiny:  # the resident model, transformers' generate: the same tokens
        ref_model = AutoModelForCausalLM.from_pretrained(root / "model", dtype=dtype).eval()
        width = max(len(pr) for pr in prompts)
        ids = torch.zeros((len(prompts), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, pr in enumerate(prompts):
            ids[i, width - len(pr):] = torch.tensor(pr)
            mask[i, width - len(pr):] = 1
        ref = ref_model.generate(ids, attention_mask=mask, max_new_tokens=args.new_tokens, pad_token_id=0,
                                 eos_token_id=None)
        assert torch.equal(out, ref), "tokens differ from transformers' generate"
        print("identical to transformers' generate of the resident model")


if __name__ == "__main__":
    main()
