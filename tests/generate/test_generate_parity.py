"""OffloadedLM's tokens equal transformers' own generate of the resident model, for every
placement of weights and KV cache, batches of prompts of different lengths, stop tokens and
seeded sampling."""
from __future__ import annotations

import pytest
import torch

from tierstate.generate import OffloadedLM

from _tiny import padded_batch, tiny

FAMILIES = ("gpt2", "llama")
# (weights, kv, micro_batch, num_micro_batches): every tier of each, split, and micro-batching
PLACEMENTS = [
    ("cpu", "cpu", None, 1),
    ("nvme", "cpu", 2, 3),
    ("cpu", "nvme", 2, 3),
    ("nvme", "nvme", 1, 5),
    (["cpu", "nvme", "cpu"], ["nvme", "cpu", "nvme"], 3, 2),
    ("split", "split", 2, 2),  # ts.Offload fractions: rounds of 4 rows, then 1
    # one NVMe KV record and a pool of one buffer: each step's first read of it comes while
    # the last layer runs, after that record's write was queued
    ("nvme", ["nvme", "cpu", "cpu"], None, 1),
]


@pytest.fixture(scope="module", params=FAMILIES)
def saved(request, tmp_path_factory):
    model = tiny(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    return model, folder


def _place(arg):
    import tierstate as ts
    return ts.Offload(cpu=0.4, nvme=0.6) if arg == "split" else arg


@pytest.mark.parametrize("weights,kv,mb,nmb", PLACEMENTS, ids=lambda v: str(v))
def test_greedy_identical_to_transformers(saved, weights, kv, mb, nmb, tmp_path):
    model, folder = saved
    ids, mask = padded_batch()
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0,
                         eos_token_id=None)
    with OffloadedLM.from_pretrained(folder, weights=_place(weights), kv=_place(kv), nvme_dir=tmp_path,
                                     micro_batch=mb, num_micro_batches=nmb) as lm:
        out = lm.generate(ids, attention_mask=mask, max_new_tokens=10, pad_token_id=0, eos_token_id=[])
        assert torch.equal(out, ref), (out, ref)
        st = lm.stats()
        n_nvme = lm.weight_tiers.count("nvme")
        if n_nvme:  # each NVMe layer is read once per token per round, not once per micro-batch
            rounds = -(-ids.shape[0] // (lm.micro_batch * nmb)) if lm.micro_batch else 1
            per_layer = lm.weights.nvme.record_nbytes
            want = rounds * 10 * sum(per_layer.values())
            assert st["weight_read_bytes"] == want
        else:
            assert st["weight_read_bytes"] == 0
    assert list(tmp_path.iterdir()) == []  # closing removed the NVMe files and the folders made


def test_stop_tokens_and_padding(saved, tmp_path):
    model, folder = saved
    ids, mask = padded_batch(seed=3)
    free = model.generate(ids, attention_mask=mask, max_new_tokens=12, pad_token_id=0, eos_token_id=None)
    # stop tokens that the free run produces mid-way in two different rows
    stops = [int(free[0, ids.shape[1] + 3]), int(free[2, ids.shape[1] + 6])]
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=12, pad_token_id=7, eos_token_id=stops)
    with OffloadedLM.from_pretrained(folder, weights="nvme", kv="nvme", nvme_dir=tmp_path, micro_batch=2,
                                     num_micro_batches=3) as lm:
        out = lm.generate(ids, attention_mask=mask, max_new_tokens=12, pad_token_id=7, eos_token_id=stops)
    assert torch.equal(out, ref)
    assert (out[0, ids.shape[1] + 4:] == 7).all()  # the stopped row is padded


def test_list_of_prompts_left_padded_like_a_tensor(saved):
    model, folder = saved
    ids, mask = padded_batch()
    prompts = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0, eos_token_id=None)
    with OffloadedLM.from_pretrained(folder, weights="cpu", kv="cpu") as lm:
        out = lm.generate(prompts, max_new_tokens=6, pad_token_id=0, eos_token_id=[])
    assert torch.equal(out, ref)


@pytest.mark.parametrize("seed", [0, 7])
def test_sampling_with_seed_identical_to_transformers(saved, seed, tmp_path):
    """seed=s is transformers' generate after torch.manual_seed(s), same warpers."""
    model, folder = saved
    ids, mask = padded_batch()
    kw = dict(max_new_tokens=10, do_sample=True, temperature=0.8, top_k=40, top_p=0.9, pad_token_id=0)
    torch.manual_seed(seed)
    ref = model.generate(ids, attention_mask=mask, eos_token_id=None, **kw)
    with OffloadedLM.from_pretrained(folder, weights="nvme", kv="nvme", nvme_dir=tmp_path, micro_batch=2,
                                     num_micro_batches=3) as lm:
        state = torch.get_rng_state()
        out = lm.generate(ids, attention_mask=mask, seed=seed, eos_token_id=[], **kw)
        assert torch.equal(torch.get_rng_state(), state)  # the global generator is left alone
        again = lm.generate(ids, attention_mask=mask, seed=seed, eos_token_id=[], **kw)
        other = lm.generate(ids, attention_mask=mask, seed=seed + 1, eos_token_id=[], **kw)
    assert torch.equal(out, ref)
    assert torch.equal(again, ref)
    assert not torch.equal(other, ref)


def test_model_object_source_matches_folder(saved, tmp_path):
    model, folder = saved
    ids, mask = padded_batch()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=5, pad_token_id=0, eos_token_id=None)
    with OffloadedLM.from_pretrained(model, weights="nvme", kv="cpu", nvme_dir=tmp_path) as lm:
        out = lm.generate(ids, attention_mask=mask, max_new_tokens=5, pad_token_id=0, eos_token_id=[])
    assert torch.equal(out, ref)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
