"""The order in which a generate step asks the disk for things: the next layer's KV records
before the next layers' weights (a disk serves its queue in order, so a record asked for
after a layer's weights waits for all of them), and a pool that holds them."""
from __future__ import annotations

import torch

from tierstate.generate import OffloadedLM
from tierstate.generate.kv_store import KVStore
from tierstate.generate.weight_store import WeightStore
from tierstate.placement.generate_plan import kv_pool_records

from _tiny import padded_batch, tiny


def test_next_layers_kv_records_are_asked_for_before_its_weights(tmp_path, monkeypatch):
    model = tiny("llama")  # 3 layers
    model.save_pretrained(tmp_path / "m")
    calls: list[tuple] = []
    kv_prefetch, w_prefetch, kv_acquire = KVStore.prefetch, WeightStore.prefetch, KVStore.acquire

    def on_kv_prefetch(self, s, past):
        calls.append(("kv", s, past, s in self._loaded))
        return kv_prefetch(self, s, past)

    def on_w_prefetch(self, order):
        calls.append(("weights", tuple(order)))
        return w_prefetch(self, order)

    def on_kv_acquire(self, s, past):
        calls.append(("run", s, past))
        return kv_acquire(self, s, past)

    monkeypatch.setattr(KVStore, "prefetch", on_kv_prefetch)
    monkeypatch.setattr(WeightStore, "prefetch", on_w_prefetch)
    monkeypatch.setattr(KVStore, "acquire", on_kv_acquire)
    ids, mask = padded_batch()
    ref = model.generate(ids[:4], attention_mask=mask[:4], max_new_tokens=3, do_sample=False, pad_token_id=0,
                         eos_token_id=None)
    with OffloadedLM.from_pretrained(tmp_path / "m", weights="nvme", kv="nvme", nvme_dir=tmp_path / "nv",
                                     micro_batch=2, num_micro_batches=2) as lm:
        out = lm.generate(ids[:4], attention_mask=mask[:4], max_new_tokens=3, pad_token_id=0, eos_token_id=[])
    assert torch.equal(out, ref)
    J, L = 2, 3
    runs = [c for c in calls if c[0] == "run"]
    assert [c[1] for c in runs] == list(range(L * J)) * 3  # every record of every layer, each step
    # every record ran from a read asked for earlier, never on demand: the prefetch that read
    # it came before the weights of the layer before it were asked for (or at the step's start)
    for i, c in enumerate(calls):
        if c[0] != "run":
            continue
        s, past = c[1], c[2]
        asked = max(k for k in range(i) if calls[k][:3] == ("kv", s, past) and not calls[k][3])
        layer = s // J
        if layer > 0:
            weights_before = [k for k in range(asked, i) if calls[k][0] == "weights"]
            # between asking for this record and running it, weights were asked for at most
            # twice: at the start of the layer before (after the record) and of its own layer
            assert len(weights_before) <= 2, calls[asked:i + 1]
            start_of_prev = max(k for k in range(i) if calls[k][0] == "weights" and calls[k][1][:1] == (layer,))
            assert asked < start_of_prev, (s, past, calls[asked - 2:i + 1])


def test_the_kv_pool_holds_a_layer_in_use_the_next_and_one_write():
    assert kv_pool_records(micro_batches=2, nvme_records=30) == 5
    assert kv_pool_records(micro_batches=1, nvme_records=30) == 3
    assert kv_pool_records(micro_batches=4, nvme_records=6) == 6  # never more than there are records
    store = KVStore(3, [2, 2], kv_heads=2, head_dim=8, max_len=16, dtype=torch.bfloat16,
                    tiers=["nvme", "cpu", "nvme"], nvme_dir=None)
    try:
        assert len(store._free) == kv_pool_records(2, 4) == 4
    finally:
        store.close()
