"""Peak RSS of one training step with streamed weights (run as a subprocess by test_memory.py).

Prints JSON: the step's peak RSS (VmHWM after a reset at the step's start) and the budget's
terms, measured from the objects (window, pools) rather than assumed.
"""
from __future__ import annotations

import json
import sys

import torch
import transformers

import tierstate as ts

transformers.logging.set_verbosity_error()


def rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def main(n_layer: int, folder: str) -> None:
    torch.set_num_threads(1)
    cfg = transformers.GPT2Config(n_layer=n_layer, n_embd=384, n_head=6, vocab_size=256, n_positions=64,
                                  bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, attn_pdrop=0.0, embd_pdrop=0.0)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(cfg)
    before_model = rss("VmRSS")
    ws = ts.offload_weights(model, "nvme", device="cpu", nvme_dir=f"{folder}/w", prefetch=1, init=model._init_weights)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    opt = ts.AdamW(model.parameters(), lr=1e-3, step_in_backward=True,
                   offload=ts.Offload(nvme=1.0, nvme_dir=f"{folder}/s", subgroup_numel=1 << 20, buffer_count=4))
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    for _ in range(2):  # warm: pools touched, allocator caches filled
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    start = rss("VmRSS")
    model(ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    peak = rss("VmHWM")
    st = ws.stats()
    print(json.dumps({
        "n_layer": n_layer, "before_model": before_model, "start": start, "peak": peak,
        "streamed_bytes": sum(ws.block_bytes()), "max_block": max(ws.block_bytes()),
        "peak_window": st["peak_window_bytes"], "weight_pool": st["pool_bytes"],
        "state_pool": opt.state_store.tiers[next(iter(opt.state_store.tiers))].pool_nbytes
        if hasattr(opt.state_store.tiers[next(iter(opt.state_store.tiers))], "pool_nbytes") else 0,
        "resident_bytes": ws.resident_bytes(),
    }))
    ws.close()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
