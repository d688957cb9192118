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
        assert store.scratch(0) is None
        keys, values = store.acquire(1, past=0)
        assert keys.shape == values.shape == (MAX_LEN, MB, HEADS, DIM)
        assert keys.stride()[0] == MB * HEADS * DIM  # a token's rows are one run of bytes
        sk, sv = store.scratch(1)
        assert sk.shape == sv.shape == (MB, HEADS, MAX_LEN, DIM) and sk.stride()[2:] == (DIM, 1)
        assert sk.data_ptr() != sv.data_ptr() and store.scratch_nbytes == 2 * store.region[0]
        store.commit(1, 0, 0)
    finally:
        store.close()


def _zeros(*shape):
    return torch.zeros(*shape, dtype=torch.bfloat16)


@pytest.mark.parametrize("steps", [[5, 1, 1, 1], [1] * 6, [MAX_LEN]])
def test_every_layout_gives_attention_the_same_keys_and_values(steps):
    """A prefill then decode steps appended to a head-major cache, a token-major one, and a
    token-major one read through a head-major scratch (an NVMe record's): the [mb, heads,
    tokens, dim] views a layer reads are equal, and so is torch's attention over them, bit
    for bit; the token-major rows (what goes to disk) hold every token appended."""
    gen = torch.Generator().manual_seed(0)
    head = LayerCache(_zeros(MB, HEADS, MAX_LEN, DIM), _zeros(MB, HEADS, MAX_LEN, DIM), 0)
    token = LayerCache(_zeros(MAX_LEN, MB, HEADS, DIM), _zeros(MAX_LEN, MB, HEADS, DIM), 0, token_major=True)
    scratch = (_zeros(MB, HEADS, MAX_LEN, DIM), _zeros(MB, HEADS, MAX_LEN, DIM))
    through = LayerCache(_zeros(MAX_LEN, MB, HEADS, DIM), _zeros(MAX_LEN, MB, HEADS, DIM), 0, token_major=True,
                         scratch=scratch)
    past = 0
    for q in steps:
        key = torch.randn(MB, HEADS, q, DIM, generator=gen).bfloat16()
        value = torch.randn(MB, HEADS, q, DIM, generator=gen).bfloat16()
        query = torch.randn(MB, HEADS, q, DIM, generator=gen).bfloat16()
        scratch[0].normal_()  # another record's rows were there: the scratch is shared
        head.past = token.past = through.past = past
        outs = [cache.update(key, value, 0) for cache in (head, token, through)]
        k1, v1 = outs[0]
        assert outs[2][0].data_ptr() == scratch[0].data_ptr()
        for k, v in outs:
            assert k.shape == v.shape == (MB, HEADS, past + q, DIM)
            assert torch.equal(k, k1) and torch.equal(v, v1)
        a1 = torch.nn.functional.scaled_dot_product_attention(query, k1, v1)
        for k, v in outs[1:]:
            a = torch.nn.functional.scaled_dot_product_attention(query, k, v)
            assert torch.equal(a.view(torch.int16), a1.view(torch.int16))
        past += q
    assert torch.equal(through.keys[:past].permute(1, 2, 0, 3), head.keys[:, :, :past])
    assert torch.equal(through.values[:past].permute(1, 2, 0, 3), head.values[:, :, :past])


def test_appending_past_the_end_is_refused_in_both_layouts():
    for cache in (LayerCache(torch.zeros(1, 1, 4, 2), torch.zeros(1, 1, 4, 2), 3),
                  LayerCache(torch.zeros(4, 1, 1, 2), torch.zeros(4, 1, 1, 2), 3, token_major=True)):
        with pytest.raises(RuntimeError, match="holds 4 tokens, the layer appends up to 5"):
            cache.update(torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2), 0)
