"""The KV cache's layouts: head-major in RAM (each head's tokens one run, as attention reads
them), token-major on NVMe (a step's new tokens one run of bytes), and the same attention
inputs from both."""
from __future__ import annotations

import pytest
import torch

from tierstate.generate.adapters import LayerCache
from tierstate.generate.kv_store import KVStore

MB, HEADS, DIM, MAX_LEN = 3, 2, 8, 16


def _store(tmp_path, tiers):
    return KVStore(len(tiers), [MB], kv_heads=HEADS, head_dim=DIM, max_len=MAX_LEN, dtype=torch.bfloat16,
                   tiers=tiers, nvme_dir=tmp_path)


def test_ram_records_are_head_major_and_nvme_records_token_major(tmp_path):
    store = _store(tmp_path, ["cpu", "nvme"])
    try:
        assert not store.token_major(0) and store.token_major(1)
        keys, values = store.acquire(0, past=0)
        assert keys.shape == values.shape == (MB, HEADS, MAX_LEN, DIM)
        # a (sequence, head) pair's tokens are contiguous: what attention reads as one run
        assert keys.stride()[2:] == values.stride()[2:] == (DIM, 1)
        keys, values = store.acquire(1, past=0)
        assert keys.shape == values.shape == (MAX_LEN, MB, HEADS, DIM)
        assert keys.stride()[0] == MB * HEADS * DIM  # a token's rows are one run of bytes
        store.commit(1, 0, 0)
    finally:
        store.close()


@pytest.mark.parametrize("steps", [[5, 1, 1, 1], [1] * 6, [MAX_LEN]])
def test_both_layouts_give_attention_the_same_keys_and_values(steps):
    """A prefill then decode steps appended to a head-major and a token-major cache: the
    [mb, heads, tokens, dim] views a layer reads are equal, and so is torch's attention over
    them, bit for bit."""
    gen = torch.Generator().manual_seed(0)
    head = LayerCache(torch.zeros(MB, HEADS, MAX_LEN, DIM, dtype=torch.bfloat16),
                      torch.zeros(MB, HEADS, MAX_LEN, DIM, dtype=torch.bfloat16), 0)
    token = LayerCache(torch.zeros(MAX_LEN, MB, HEADS, DIM, dtype=torch.bfloat16),
                       torch.zeros(MAX_LEN, MB, HEADS, DIM, dtype=torch.bfloat16), 0, token_major=True)
    past = 0
    for q in steps:
        key = torch.randn(MB, HEADS, q, DIM, generator=gen).bfloat16()
        value = torch.randn(MB, HEADS, q, DIM, generator=gen).bfloat16()
        query = torch.randn(MB, HEADS, q, DIM, generator=gen).bfloat16()
        head.past = token.past = past
        k1, v1 = head.update(key, value, 0)
        k2, v2 = token.update(key, value, 0)
        assert k1.shape == k2.shape == (MB, HEADS, past + q, DIM)
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
        a1 = torch.nn.functional.scaled_dot_product_attention(query, k1, v1)
        a2 = torch.nn.functional.scaled_dot_product_attention(query, k2, v2)
        assert torch.equal(a1.view(torch.int16), a2.view(torch.int16))
        past += q


def test_appending_past_the_end_is_refused_in_both_layouts():
    for cache in (LayerCache(torch.zeros(1, 1, 4, 2), torch.zeros(1, 1, 4, 2), 3),
                  LayerCache(torch.zeros(4, 1, 1, 2), torch.zeros(4, 1, 1, 2), 3, token_major=True)):
        with pytest.raises(RuntimeError, match="holds 4 tokens, the layer appends up to 5"):
            cache.update(torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2), 0)
