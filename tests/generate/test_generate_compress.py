"""Compressed weight stores (group-wise int8 / int4): the tokens are exactly those of the model
whose matrices were quantized and dequantized the same way, the stored and read bytes shrink by
the format's ratio, and the quality loss is measured."""
from __future__ import annotations

import pytest
import torch

from tierstate.generate import OffloadedLM
from tierstate.generate.compress import quality, quantized_copy, roundtrip

from _tiny import padded_batch


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=500, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, eos_token_id=2)
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("mode,qmax", [("int8", 127), ("int4", 7)])
def test_roundtrip_error_is_half_a_step(mode, qmax):
    w = torch.randn(64, 256) * torch.linspace(0.01, 3, 256)
    back = roundtrip(w, mode, 64)
    step = w.view(64, 4, 64).abs().amax(-1, keepdim=True) / qmax
    assert ((w.view(64, 4, 64) - back.view(64, 4, 64)).abs() <= step / 2 + 1e-6).all()
    assert not torch.equal(back, w)


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequantize_across_chunks_is_codes_times_scales_rounded_once(mode, dtype):
    from tierstate.generate import compress as C
    n = C._CHUNK + 3 * 64  # a whole chunk and a tail: the chunk loop's both paths
    w = (torch.randn(n) * torch.rand(n)).to(dtype).view(-1, 64)
    vn, sn = C.stored_nbytes(n, mode, 64)
    values, scales = torch.empty(vn, dtype=torch.uint8), torch.empty(sn // 4, dtype=torch.float32)
    C.quantize_into(w, values, scales, mode, 64)
    out = torch.empty_like(w)
    C.dequantize_into(values, scales, out, mode, 64)
    if mode == "int8":
        codes = values.view(torch.int8).float()
    else:  # two per byte, the even index in the low nibble, stored as q + 8
        codes = torch.stack([(values & 0x0F).float(), (values >> 4).float()], dim=1).view(-1) - 8
    want = (codes.view(-1, 64) * scales[:, None]).to(dtype)  # in float32, rounded once
    assert torch.equal(out, want)


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("weights,kv", [("nvme", "cpu"), ("cpu", "nvme")])
def test_tokens_equal_the_quantized_model(tmp_path, mode, weights, kv):
    model = _model()
    model.save_pretrained(tmp_path / "m")
    ids, mask = padded_batch()
    ref_model = quantized_copy(model, model.model.layers, mode)
    ref = ref_model.generate(ids, attention_mask=mask, max_new_tokens=8, pad_token_id=0, eos_token_id=None)
    with OffloadedLM.from_pretrained(tmp_path / "m", weights=weights, kv=kv, compress=mode,
                                     nvme_dir=tmp_path / "nv", micro_batch=2, num_micro_batches=3) as lm:
        out = lm.generate(ids, attention_mask=mask, max_new_tokens=8, pad_token_id=0, eos_token_id=[])
        st = lm.stats()
    assert torch.equal(out, ref)
    if weights == "nvme":
        with OffloadedLM.from_pretrained(tmp_path / "m", weights="nvme", kv="cpu", nvme_dir=tmp_path / "nv2") as full:
            full.generate(ids, attention_mask=mask, max_new_tokens=8, pad_token_id=0, eos_token_id=[])
            ratio = st["weight_read_bytes"] / full.stats()["weight_read_bytes"]
        # fp32 matrices: int8 stores 1 + 4/64 bytes per 4, int4 0.5 + 4/64 (norms stay fp32)
        assert ratio < (0.28 if mode == "int8" else 0.15)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_groups_that_do_not_divide_the_chunk_quantize_and_dequantize(mode):
    # group 96 (768 = 8 x 96) does not divide the 4 Mi-value chunk: a chunk used to end inside
    # a group, and quantize_into / dequantize_into raised on the view (any matrix > 4 Mi values)
    from tierstate.generate import compress as C
    from tierstate.kernels import use_isa
    n = 96 * (C._CHUNK // 96 + 5)
    w = torch.randn(n).view(-1, 96)
    vn, sn = C.stored_nbytes(n, mode, 96)
    values, scales = torch.empty(vn, dtype=torch.uint8), torch.empty(sn // 4, dtype=torch.float32)
    C.quantize_into(w, values, scales, mode, 96)
    step = w.abs().amax(-1, keepdim=True) / C._QMAX[mode]
    for isa in ("reference", "auto"):  # the torch path and the native kernel
        out = torch.empty_like(w)
        with use_isa(isa):
            C.dequantize_into(values, scales, out, mode, 96)
        assert ((w - out).abs() <= step / 2 + 1e-6).all(), isa


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("group", [64, 66, 6])
def test_native_dequantization_is_the_torch_path_bit_for_bit_on_every_isa(mode, group):
    """Every ISA variant of the native kernel writes what the torch path writes, for each
    output dtype; group 66 has a scalar tail after its vectors (and int4's at an odd byte
    offset), group 6 is all tail; scales span subnormal to overflowing products."""
    from tierstate.generate import compress as C
    from tierstate.kernels import available_isas, use_isa
    g = torch.Generator().manual_seed(group)
    n_groups = 1000 + 7
    n = n_groups * group
    values = torch.randint(0, 256, (C.stored_nbytes(n, mode, group)[0],), dtype=torch.uint8, generator=g)
    # finite products (a NaN from 0 x inf may differ in its payload bits); fp16 overflows to inf
    scales = torch.exp2(torch.randint(-140, 120, (n_groups,), generator=g).float()) * torch.rand(n_groups, generator=g)
    isas = [i for i in available_isas() if i != "reference"]
    assert isas, "no native kernel to compare"
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        want = torch.empty(n, dtype=dtype)
        C._dequantize_torch(values, scales, want, mode, group)
        for isa in isas:
            got = torch.full((n,), float("nan"), dtype=dtype)
            with use_isa(isa):
                C.dequantize_into(values, scales, got, mode, group)
            assert torch.equal(got.view(torch.int16 if dtype != torch.float32 else torch.int32),
                               want.view(torch.int16 if dtype != torch.float32 else torch.int32)), (isa, dtype)


def test_dequantize_refuses_short_codes_or_scales():
    from tierstate.generate import compress as C
    out = torch.empty(128)
    for values, scales in ((torch.zeros(127, dtype=torch.uint8), torch.ones(2)),
                           (torch.zeros(128, dtype=torch.uint8), torch.ones(1))):
        with pytest.raises(ValueError, match="need 128 code bytes and 2 scales"):
            C.dequantize_into(values, scales, out, "int8", 64)
    with pytest.raises(ValueError, match="in groups of 48"):
        C.dequantize_into(torch.zeros(128, dtype=torch.uint8), torch.ones(3), out, "int8", 48)


@pytest.mark.parametrize("weights,mode,calls", [("cpu", None, 0), ("cpu", "int8", 9), ("nvme", None, 9),
                                                ("nvme", "int4", 9)])
def test_native_work_of_a_layer_takes_the_cores_from_torchs_spinning_workers(tmp_path, monkeypatch, weights, mode,
                                                                             calls):
    """Once per layer fetched with native work to do (the CRC-32C of an NVMe record, a
    dequantization), right after the previous layer's torch work; never for uncompressed
    layers in RAM, which torch alone computes. 3 layers x 3 steps."""
    from tierstate.generate import weight_store
    seen = []
    real = weight_store.hand_over_cores
    monkeypatch.setattr(weight_store, "hand_over_cores", lambda: seen.append(1) or real())
    model = _model()
    model.save_pretrained(tmp_path / "m")
    ids, mask = padded_batch()
    with OffloadedLM.from_pretrained(tmp_path / "m", weights=weights, kv="cpu", compress=mode,
                                     nvme_dir=tmp_path / "nv") as lm:
        lm.generate(ids, attention_mask=mask, max_new_tokens=3, pad_token_id=0, eos_token_id=[])
    assert len(seen) == calls


def test_bad_compress_arguments(tmp_path):
    model = _model()
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="compress='int2'"):
        OffloadedLM.from_pretrained(tmp_path, weights="cpu", kv="cpu", compress="int2")
    with pytest.raises(ValueError, match="group=3"):
        OffloadedLM.from_pretrained(tmp_path, weights="cpu", kv="cpu", compress="int8", group=3)
    # options that would do nothing are refused, not ignored
    with pytest.raises(ValueError, match="group=32 applies to quantized layers"):
        OffloadedLM.from_pretrained(tmp_path, weights="cpu", kv="cpu", group=32)
    from tierstate.placement.generate_plan import GenerateBudget, GenerateWorkload
    with pytest.raises(ValueError, match="budget, workload: the planner's inputs"):
        OffloadedLM.from_pretrained(tmp_path, weights="cpu", kv="nvme", budget=GenerateBudget(ram=1 << 30),
                                    workload=GenerateWorkload(1, 4, 4))


def test_quality_measured():
    model = _model()
    ids = torch.randint(3, 500, (4, 32), generator=torch.Generator().manual_seed(5))
    q8 = quality(model, model.model.layers, ids, "int8")
    q4 = quality(model, model.model.layers, ids, "int4")
    # int8 moves the logits far less than int4, and keeps nearly every top-1 token
    assert q8["mean_logit_error_rel"] < q4["mean_logit_error_rel"] / 4
    assert q8["top1_agreement"] >= 0.95 and q8["top1_agreement"] >= q4["top1_agreement"]
    assert 0 < q8["max_logit_error_rel"] < 0.1
