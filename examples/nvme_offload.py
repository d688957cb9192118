"""Train a Llama-style model whose optimizer state does not fit in this machine's RAM:
bf16 weights and gradients stay in memory, the fp32 master weights and both Adam moments
(12 B/param) live in files on NVMe and stream through a bounded host buffer.

    python examples/nvme_offload.py --tiny --nvme-dir /tmp/ts-nvme          # CI: seconds
    python examples/nvme_offload.py --nvme-dir /mnt/nvme/ts --steps 3       # 2.2B params: by hand

Full size: 2.23B parameters (hidden 2560, 30 layers, vocab 32000). Its optimizer state, fp32
master + two fp32 moments at 12 B/param, is 26.7 GB (24.9 GiB): more than the 24 GiB of RAM
here. In RAM are only the 4.5 GB of bf16 weights, 4.5 GB of bf16 gradients, the activations and
tierstate's bounded staging buffers. Needs ~27 GB free on --nvme-dir.
"""
from __future__ import annotations

import tempfile
import time

import psutil
import torch

import tierstate as ts
from common import build_model, figures, parser

FULL = dict(hidden_size=2560, intermediate_size=6912, num_hidden_layers=30, num_attention_heads=20,
            num_key_value_heads=4, vocab_size=32000, max_position_embeddings=512)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--nvme-dir", default=None, help="directory on the NVMe drive for the optimizer state")
    args = p.parse_args()
    steps = args.steps or (8 if args.tiny else 3)
    nvme_dir = args.nvme_dir or tempfile.mkdtemp(prefix="ts-nvme-")
    torch.manual_seed(0)
    # Built directly in bf16: an fp32 model of this size would need 8.9 GB of RAM before the cast.
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = build_model("llama", args.tiny, **({} if args.tiny else FULL))
    finally:
        torch.set_default_dtype(torch.float32)
    n = sum(p.numel() for p in model.parameters())
    opt = ts.AdamW(model.parameters(), lr=1e-2 if args.tiny else 1e-4, betas=(0.9, 0.95), weight_decay=0.1,
                   max_grad_norm=1.0, offload=ts.Offload(cpu=0.0, nvme=1.0, nvme_dir=nvme_dir))
    print(f"{n / 1e6:.2f}M params; optimizer state in {nvme_dir}: "
          f"{ {k: f'{v / 2**30:.2f} GiB' for k, v in opt.tier_bytes().items()} }; "
          f"RAM {psutil.virtual_memory().total / 2**30:.0f} GiB")
    seq, batch = (16, 8) if args.tiny else (128, 1)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    for step in range(steps):
        ids = (torch.randint(0, vocab, (batch, 1), generator=g) + torch.arange(seq)) % vocab
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        print(f"step {step} loss {loss.item():.3f} fwd+bwd {t1 - t0:.2f}s optimizer {t2 - t1:.2f}s "
              f"rss {psutil.Process().memory_info().rss / 2**30:.2f} GiB | {opt.stats()}")
    print(figures(opt, steps, time.perf_counter() - start))
    opt.close()


if __name__ == "__main__":
    main()
