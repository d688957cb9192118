"""The generation planner: budgets respected, its memory model equal to what OffloadedLM
allocates, and choices that move the way the time model says they should."""
from __future__ import annotations

import pytest
import torch

from tierstate.generate import OffloadedLM
from tierstate.placement.generate_plan import (DEFAULT_PREFETCH, Choice, GenerateBudget, GenerateHardware,
                                               GenerateWorkload, PlanError, memory, plan_generate, shape_from_config)

from _tiny import padded_batch, tiny

HW = GenerateHardware("test rates", flops=100e9, ram_bandwidth=10e9, disk_read=1e9, disk_write=1e9,
                      call_seconds=3e-4, base_rss=500 << 20)


def _llama13b():
    from transformers import LlamaConfig
    return LlamaConfig(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40,
                       num_key_value_heads=40, vocab_size=32000)


def test_shape_counts_match_transformers():
    for family in ("gpt2", "llama"):
        model = tiny(family)
        shape = shape_from_config(model.config, 4)
        layers = model.transformer.h if family == "gpt2" else model.model.layers
        assert shape.layer_params[0] == sum(p.numel() for p in layers[0].parameters())
        outside = sum(p.numel() for n, p in model.named_parameters() if not n.startswith(("transformer.h.",
                                                                                          "model.layers.")))
        assert shape.resident_bytes == 4 * outside


def test_memory_model_equals_what_offloadedlm_allocates(tmp_path):
    model = tiny("llama", layers=4)
    folder = tmp_path / "m"
    model.save_pretrained(folder)
    ids, mask = padded_batch()
    wl = GenerateWorkload(batch=5, prompt_len=ids.shape[1], new_tokens=4)
    choice = Choice(weight_cpu_layers=1, kv_cpu_layers=2, micro_batch=2, num_micro_batches=3)
    with OffloadedLM.from_pretrained(folder, weights=["cpu", "nvme", "nvme", "nvme"],
                                     kv=["cpu", "cpu", "nvme", "nvme"], nvme_dir=tmp_path / "nv", micro_batch=2,
                                     num_micro_batches=3) as lm:
        shape = shape_from_config(model.config, 4, [n for _, n in lm.weights.layouts])
        ram, disk, parts = memory(shape, wl, HW, choice)
        assert parts["resident"] == lm.resident_nbytes
        assert parts["weights_in_ram"] == lm.weights.host_nbytes
        assert parts["weight_pool"] == lm.weights.pool_nbytes
        from tierstate.generate.kv_store import KVStore
        kv = KVStore(4, [2, 2, 1], lm.adapter.kv_heads, lm.adapter.head_dim, wl.prompt_len + wl.new_tokens,
                     lm.dtype, lm.kv, nvme_dir=tmp_path / "nv")
        try:
            assert parts["kv_in_ram"] == kv.host_nbytes
            assert parts["kv_pool"] == kv.pool_nbytes
            assert parts["kv_scratch"] == kv.scratch_nbytes > 0
            assert disk == lm.weights.nvme_nbytes + kv.nvme_nbytes
        finally:
            kv.close()


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_memory_model_of_compressed_layers_equals_what_offloadedlm_allocates(tmp_path, mode):
    """Stored (compressed) layers in RAM and in the NVMe pool, plus the compute buffer the
    layers are dequantized into: what the planner prices is what the store holds."""
    from tierstate.generate.weight_store import layer_sizes
    model = tiny("llama", layers=4)
    folder = tmp_path / "m"
    model.save_pretrained(folder)
    ids, _ = padded_batch()
    wl = GenerateWorkload(batch=5, prompt_len=ids.shape[1], new_tokens=4)
    with OffloadedLM.from_pretrained(folder, weights=["cpu", "cpu", "nvme", "nvme"], kv="cpu",
                                     nvme_dir=tmp_path / "nv", compress=mode, group=16) as lm:
        full, stored = layer_sizes(lm.adapter.layers, lm.dtype, mode, 16)
        assert full == [n for _, n in lm.weights.layouts] and stored == [n for _, n in lm.weights.stored]
        assert all(s < f for s, f in zip(stored, full))
        shape = shape_from_config(model.config, 4, full, stored)
        ram, disk, parts = memory(shape, wl, HW, Choice(2, 4, 5, 1))
        assert parts["weights_in_ram"] == lm.weights.host_nbytes
        assert parts["weight_pool"] + parts["compute_buffer"] == lm.weights.pool_nbytes
        assert disk == lm.weights.nvme_nbytes


def test_memory_model_of_lossless_layers_equals_what_offloadedlm_allocates(tmp_path):
    """Lossless: RAM layers as they are, NVMe records and pool buffers with the room of the
    uncoded layer, one compute buffer; the planner's estimate of the coded bytes is an upper
    bound of what the store's reads move (normally distributed bf16 matrices)."""
    import torch

    from tierstate.generate.weight_store import layer_sizes
    model = tiny("llama", layers=4).to(torch.bfloat16)
    folder = tmp_path / "m"
    model.save_pretrained(folder)
    ids, _ = padded_batch()
    wl = GenerateWorkload(batch=5, prompt_len=ids.shape[1], new_tokens=4)
    with OffloadedLM.from_pretrained(folder, weights=["cpu", "cpu", "nvme", "nvme"], kv="cpu",
                                     nvme_dir=tmp_path / "nv", compress="lossless") as lm:
        full, est = layer_sizes(lm.adapter.layers, lm.dtype, "lossless")
        assert full == [n for _, n in lm.weights.layouts]
        home = lm.weights.nvme
        for i in (2, 3):
            assert home.used_nbytes(i) <= -(-est[i] // 4096) * 4096 and est[i] < 0.8 * full[i]
        shape = shape_from_config(model.config, 2, full, est, lossless=True)
        ram, disk, parts = memory(shape, wl, HW, Choice(2, 4, 5, 1))
        assert parts["weights_in_ram"] == lm.weights.host_nbytes == sum(full[:2])
        assert parts["weight_pool"] + parts["compute_buffer"] == lm.weights.pool_nbytes
        assert disk == lm.weights.nvme_nbytes


def test_compressed_layers_are_priced_by_their_stored_bytes():
    """A RAM budget holds more compressed layers than bf16 ones, and the same placement runs
    faster for the fewer bytes read, but less than in their ratio: the RAM-resident layers are
    dequantized every step too."""
    cfg = _llama13b()
    full = shape_from_config(cfg, 2)
    ratio = {"int8": 1 / 2 + 4 / 64 / 2, "int4": 1 / 4 + 4 / 64 / 2}  # of bf16, at group 64, matrices only
    wl = GenerateWorkload(batch=8, prompt_len=32, new_tokens=8)
    budget = GenerateBudget(ram=12 << 30, disk=64 << 30)
    base = plan_generate(full, wl, HW, budget)
    for mode, r in ratio.items():
        stored = [int(b * r) for b in full.layer_bytes]
        shape = shape_from_config(cfg, 2, list(full.layer_bytes), stored)
        plan = plan_generate(shape, wl, HW, budget)
        assert plan.weight_tiers.count("cpu") > 1.5 * base.weight_tiers.count("cpu"), mode
        assert plan.ram_bytes <= budget.ram
        assert plan.breakdown["ram_parts"]["compute_buffer"] == max(full.layer_bytes)
        # the same placement as the uncompressed plan: faster by the bytes read, not more
        k = base.weight_tiers.count("cpu")
        from tierstate.placement.generate_plan import timing
        c = Choice(k, base.kv_tiers.count("cpu"), base.micro_batch, base.num_micro_batches)
        t_full, _ = timing(full, wl, HW, c)
        t_comp, _ = timing(shape, wl, HW, c)
        assert 1.2 < t_full / t_comp < 1 / r, mode
    with pytest.raises(ValueError, match="stored_layer_bytes: 3 entries for 40 layers"):
        shape_from_config(cfg, 2, None, [1, 2, 3])


def test_budgets_respected_and_tighter_ram_moves_weights_to_nvme():
    shape = shape_from_config(_llama13b(), 2)
    wl = GenerateWorkload(batch=8, prompt_len=32, new_tokens=8)
    roomy = plan_generate(shape, wl, HW, GenerateBudget(ram=64 << 30, disk=64 << 30))
    tight = plan_generate(shape, wl, HW, GenerateBudget(ram=8 << 30, disk=64 << 30))
    assert roomy.weight_tiers.count("nvme") == 0
    assert 0 < tight.weight_tiers.count("cpu") < tight.weight_tiers.count("nvme")
    assert tight.ram_bytes <= 8 << 30 and tight.disk_bytes <= 64 << 30
    assert tight.tokens_per_s < roomy.tokens_per_s
    assert tight.rejected and any("RAM" in why for _, why in tight.rejected)
    text = "\n".join(tight.describe())
    assert "bottleneck" in text and "rejected" in text


def test_disk_bound_decode_prefers_one_big_round():
    """With weights on disk, each read serves a whole round: the planner batches all sequences
    into one round rather than several."""
    shape = shape_from_config(_llama13b(), 2)
    wl = GenerateWorkload(batch=32, prompt_len=8, new_tokens=32)
    plan = plan_generate(shape, wl, HW, GenerateBudget(ram=6 << 30, disk=64 << 30))
    assert plan.micro_batch * plan.num_micro_batches >= 32
    assert plan.bottleneck.startswith("disk")


def test_nothing_fits_names_the_need():
    shape = shape_from_config(_llama13b(), 2)
    with pytest.raises(PlanError, match="RAM"):
        plan_generate(shape, GenerateWorkload(4, 16, 4), HW, GenerateBudget(ram=1 << 30, disk=64 << 30))
    with pytest.raises(ValueError, match="batch=0"):
        plan_generate(shape, GenerateWorkload(0, 16, 4), HW)


def _budget_for_two_layers_in_ram(tmp_path, prefetch=DEFAULT_PREFETCH):
    """An 8-layer GPT-2 saved under tmp_path, a workload, and the RAM of two layers in RAM plus
    the NVMe pool of ``prefetch``: the planner must stream the other six."""
    model = tiny("gpt2", layers=8)
    folder = tmp_path / "m"
    model.save_pretrained(folder)
    shape = shape_from_config(model.config, 4)
    ids, mask = padded_batch()
    wl = GenerateWorkload(5, ids.shape[1], 4)
    budget = GenerateBudget(ram=memory(shape, wl, HW, Choice(2, 8, 5, 1), prefetch)[0], disk=1 << 30)
    return model, folder, ids, mask, wl, budget


def test_auto_follows_the_plan(tmp_path):
    model, folder, ids, mask, wl, budget = _budget_for_two_layers_in_ram(tmp_path)
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=0, eos_token_id=None)
    with OffloadedLM.from_pretrained(folder, weights="auto", kv="auto", nvme_dir=tmp_path / "nv", budget=budget,
                                     hardware=HW, workload=wl) as lm:
        assert lm.plan is not None
        assert lm.weight_tiers == list(lm.plan.weight_tiers)
        assert "nvme" in lm.weight_tiers and lm.plan.ram_bytes <= budget.ram
        out = lm.generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=0, eos_token_id=[])
    assert torch.equal(out, ref)


@pytest.mark.parametrize("prefetch", [1, 3])
def test_auto_prices_the_read_ahead_it_is_given(tmp_path, prefetch):
    # the planner priced the default read-ahead's pool whatever prefetch= said
    _, folder, _, _, wl, budget = _budget_for_two_layers_in_ram(tmp_path, prefetch)
    with OffloadedLM.from_pretrained(folder, weights="auto", kv="cpu", nvme_dir=tmp_path / "nv", budget=budget,
                                     hardware=HW, workload=wl, prefetch=prefetch) as lm:
        assert "nvme" in lm.weight_tiers
        assert lm.plan.breakdown["ram_parts"]["weight_pool"] == lm.weights.pool_nbytes
        assert lm.weights.pool_nbytes == (prefetch + 1) * max(lm.weights.nvme.record_nbytes.values())


def test_rates_are_lowered_to_what_a_real_layer_achieves():
    """measure_hardware's compute rates come down to those of one real layer of the model (a
    prefill and decode steps over copies of it): never above the synthetic probe's, and what the
    real layer's prefill and decode times give back through the planner's own formulas."""
    import math
    import time

    from transformers import LlamaConfig

    from tierstate.generate.policy import _real_layer_rates
    from tierstate.placement.generate_plan import shape_from_config

    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4)
    shape = shape_from_config(cfg, 2)
    huge = 1e18  # synthetic rates no real layer reaches: the real ones must come back
    t0 = time.perf_counter()
    flops, ram_bw = _real_layer_rates(cfg, shape, torch.bfloat16, 0.0, huge, huge)
    assert time.perf_counter() - t0 < 60
    assert 0 < flops < huge and 0 < ram_bw < huge and math.isfinite(flops) and math.isfinite(ram_bw)
    # the prefill of 4 x 32 tokens at that rate takes a positive, plausible time (< 10 s)
    assert 0 < 2 * 4 * 32 * shape.layer_params[0] / flops < 10
    assert 0 < shape.layer_bytes[0] / ram_bw < 10
    low_flops, low_bw = _real_layer_rates(cfg, shape, torch.bfloat16, 0.0, 1.0, 1.0)
    assert (low_flops, low_bw) == (1.0, 1.0)  # a synthetic rate already lower is kept
