"""compress="lossless": bf16 matrices stored with 4-bit exponent codes give back the same bits
(torch path and every native ISA), NVMe layers read ~0.75x of their bytes, and the tokens are
transformers' own for the resident bf16 model."""
from __future__ import annotations

import pytest
import torch

from tierstate.generate import OffloadedLM
from tierstate.generate import lossless as ll

from _tiny import padded_batch, tiny


def _bits(t):
    return t.reshape(-1).view(torch.int16)


def _normal(n, seed=0, std=0.02):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * std).to(torch.bfloat16)


def _specials(n, seed=0):
    """A normal matrix salted with what a window of 15 exponents cannot hold: zeros, signed
    zeros, subnormals, infinities, NaNs (two payloads), the largest finite values."""
    w = _normal(n, seed)
    b = _bits(w)
    g = torch.Generator().manual_seed(seed + 1)
    salt = torch.tensor([0x0000, 0x8000, 0x0001, 0x807F, 0x7F80, 0xFF80, 0x7FC0, 0x7FC1, 0x7F7F, 0xFF7F, 0x3F80],
                        dtype=torch.int32)
    where = torch.randperm(n, generator=g)[:min(n, 4 * salt.numel())]
    b[where] = salt.repeat(4)[:where.numel()].to(torch.int16)
    return w


@pytest.mark.parametrize("n", [1, 31, 33, 64, 65, 1000, 4096 + 17])
def test_roundtrip_is_bit_exact_with_escapes_and_partial_blocks(n):
    w = _specials(n, seed=n)
    coded = ll.encode(w)
    if coded is None:  # a handful of values: the escapes make coding larger than bf16
        assert ll.coded_nbytes(n, ll.choose_base(w)[1]) >= 2 * n
        return
    layout, data = coded
    assert layout.nbytes == data.numel() < 2 * n
    out = torch.empty(n, dtype=torch.bfloat16)
    ll.decode_into(data, layout, out)
    assert torch.equal(_bits(out), _bits(w))


def test_roundtrip_across_encoder_chunks():
    # more values than one 4 Mi-value encoder chunk, escapes in each chunk, a partial last block
    n = ll._CHUNK + 3 * 64 + 5
    w = _specials(n, seed=3)
    b = _bits(w)
    b[ll._CHUNK - 1] = 0x7F80
    b[ll._CHUNK] = 0x0000
    b[n - 1] = 0x0001
    layout, data = ll.encode(w)
    assert layout.escapes >= 3
    out = torch.empty(n, dtype=torch.bfloat16)
    ll.decode_into(data, layout, out)
    assert torch.equal(_bits(out), _bits(w))


def test_layout_parts_and_size():
    """Sign and mantissa bytes first, then the code bytes (value j low nibble, j + 32 high), then
    the escapes' uint32 indices and exponent bytes, each part on a 64-byte boundary."""
    n = 65 * 64 + 1  # 65 whole blocks and one value
    w = torch.full((n,), 0.25, dtype=torch.bfloat16)
    w[:4] = torch.tensor([1.0, -2.0, 0.5, 0.0])
    w[n - 1] = 3.0
    layout, data = ll.encode(w)
    # exponents: 1.0 -> 127, 2.0 -> 128, 0.5 -> 126, 0.25 -> 125, 3.0 -> 128; 0.0 -> 0 escapes
    assert layout.base == 114  # the lowest of the windows [114, 128] ... [125, 139] that hold all but the zero
    assert layout.escapes == 1
    assert (layout.codes_offset, layout.index_offset, layout.exponent_offset) == (4224, 6336, 6400)
    assert layout.nbytes == 6401 == data.numel()
    assert data[0] == 0x00 and data[1] == 0x80 and data[n - 1] == 0x40  # 3.0: mantissa 0b1000000
    codes = data[4224:6336]
    assert codes[0] & 0x0F == 127 - 114 and codes[0] >> 4 == 125 - 114  # values 0 and 32
    assert codes[1] & 0x0F == 128 - 114
    assert codes[3] & 0x0F == ll.ESCAPE
    assert codes[65 * 32] & 0x0F == 128 - 114 and codes[65 * 32] >> 4 == 0  # the last value, padding
    assert data[6336:6340].view(torch.int32).item() == 3 and data[6400] == 0


def test_a_normal_matrix_codes_to_three_quarters_of_bf16():
    w = _normal(2048 * 5632).view(2048, 5632)
    layout, data = ll.encode(w)
    assert layout.escapes / w.numel() < 4e-4  # 1.5e-4 measured: values below 2**-13 x std
    assert 0.75 <= layout.nbytes / (2 * w.numel()) < 0.7505
    assert layout.nbytes <= ll.estimated_nbytes(w.numel())


def test_exponents_spread_wider_than_the_window_stay_uncoded():
    g = torch.Generator().manual_seed(0)
    e = torch.randint(1, 255, (4096,), generator=g, dtype=torch.int32)
    bits = (e << 7) | torch.randint(0, 128, (4096,), generator=g, dtype=torch.int32)
    w = bits.to(torch.int16).view(torch.bfloat16)
    assert ll.encode(w) is None
    assert ll.encode_into(w, torch.zeros(2 * 4096, dtype=torch.uint8)) is None
    assert torch.equal(_bits(ll.roundtrip(w)), _bits(w))


def test_native_decoder_is_the_torch_path_bit_for_bit_on_every_isa():
    from tierstate.kernels import available_isas, use_isa
    isas = [i for i in available_isas() if i != "reference"]
    assert isas, "no native kernel to compare"
    for n in (64 * 1024 * 3 + 100, 40 * 64 + 7):  # several thread-pool tasks and a tail; 40 blocks and a partial one
        w = _specials(n, seed=n)
        layout, data = ll.encode(w)
        want = torch.empty(n, dtype=torch.bfloat16)
        ll._decode_torch(data, layout, want)
        assert torch.equal(_bits(want), _bits(w))
        for isa in isas:
            got = torch.full((n,), float("nan"), dtype=torch.bfloat16)
            with use_isa(isa):
                ll.decode_into(data, layout, got)
            assert torch.equal(_bits(got), _bits(w)), isa


@pytest.mark.parametrize("n", [1000, 40 * 64 + 7, 64 * 1024 * 3 + 100])
def test_decode_takes_the_crc_of_the_bytes_it_reads(n):
    """With ``crc=``, the decode returns the CRC-32C of the coded part continued from it, taken as
    the values are decoded (the generation store checks its records that way): the same value
    as tierstate.io.crc32c over the part's bytes, on the torch path and every native ISA."""
    from tierstate import io as tio
    from tierstate.kernels import available_isas, use_isa
    w = _specials(n, seed=n)
    layout, data = ll.encode(w)
    assert layout.escapes > 0 and data.numel() >= layout.nbytes
    for isa in ["reference", *[i for i in available_isas() if i != "reference"]]:
        for start in (0, 0x1234ABCD):
            out = torch.full((n,), float("nan"), dtype=torch.bfloat16)
            with use_isa(isa):
                got = ll.decode_into(data, layout, out, crc=start)
            assert got == tio.crc32c(data[:layout.nbytes], start), (isa, start)
            assert torch.equal(_bits(out), _bits(w)), isa
        with use_isa(isa):
            assert ll.decode_into(data, layout, out) is None


@pytest.mark.parametrize("n", [1000, 40 * 64 + 7, 64 * 1024 * 3 + 100])
def test_native_encoder_writes_the_torch_paths_bytes(n):
    from tierstate.kernels import use_isa
    w = _specials(n, seed=n + 1)
    native = ll.encode(w)
    with use_isa("reference"):
        reference = ll.encode(w)
    assert native[0] == reference[0] and native[0].escapes > 0
    assert torch.equal(native[1], reference[1])


def test_native_encoder_refuses_more_escapes_than_room():
    from tierstate.kernels.backend import native_kernels
    k = native_kernels()
    w = _specials(1000)
    base, escapes = ll.choose_base(w)
    parts = [torch.zeros(1000, dtype=torch.uint8), torch.zeros(512, dtype=torch.uint8),
             torch.zeros(escapes, dtype=torch.int32), torch.zeros(escapes, dtype=torch.uint8)]
    with pytest.raises(Exception, match="escape_room"):
        k.encode_exp4_bf16(w.data_ptr(), 1000, base, *(p.data_ptr() for p in parts), escapes - 1)
    assert not parts[2].any() and not parts[3].any()  # no escape written
    assert k.encode_exp4_bf16(w.data_ptr(), 1000, base, *(p.data_ptr() for p in parts), escapes) == escapes
    with pytest.raises(ValueError, match="base must be 0-241"):
        k.encode_exp4_bf16(w.data_ptr(), 1000, 242, *(p.data_ptr() for p in parts), escapes)


def test_decoder_refuses_bad_input_and_leaves_out_untouched():
    w = _specials(1000)
    layout, data = ll.encode(w)
    bad = data.clone()
    bad[layout.index_offset:layout.index_offset + 4].view(torch.int32)[0] = 1000  # past the end
    from tierstate.kernels import use_isa
    for isa in ("reference", "auto"):
        out = torch.zeros(1000, dtype=torch.bfloat16)
        with use_isa(isa), pytest.raises(ValueError, match="escape index"):
            ll.decode_into(bad, layout, out)
        if isa == "auto":
            assert not out.any()  # checked before any write
    with pytest.raises(ValueError, match="out: expected 1000 bfloat16"):
        ll.decode_into(data, layout, torch.empty(1000, dtype=torch.float32))
    with pytest.raises(ValueError, match="coded: expected"):
        ll.decode_into(data[:-1], layout, torch.empty(1000, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bfloat16"):
        ll.encode_into(w.float(), torch.zeros(4000, dtype=torch.uint8))


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def saved(request, tmp_path_factory):
    model = tiny(request.param).to(torch.bfloat16)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    return model, folder


@pytest.mark.parametrize("weights,kv,mb,nmb", [("nvme", "cpu", 2, 3), (["cpu", "nvme", "nvme"], "nvme", None, 1),
                                               ("cpu", "cpu", None, 1)], ids=str)
def test_tokens_identical_to_transformers_and_fewer_bytes_read(saved, weights, kv, mb, nmb, tmp_path):
    model, folder = saved
    ids, mask = padded_batch()
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
                         eos_token_id=None)
    with OffloadedLM.from_pretrained(folder, weights=weights, kv=kv, nvme_dir=tmp_path / "a", micro_batch=mb,
                                     num_micro_batches=nmb, compress="lossless") as lm:
        out = lm.generate(ids, attention_mask=mask, max_new_tokens=8, pad_token_id=0, eos_token_id=[])
        coded = lm.stats()["weight_read_bytes"]
        coded_layers = len(lm.weights.coded)
        assert coded_layers == lm.weight_tiers.count("nvme")  # RAM layers stay as they are
    assert torch.equal(out, ref)
    with OffloadedLM.from_pretrained(folder, weights=weights, kv=kv, nvme_dir=tmp_path / "b", micro_batch=mb,
                                     num_micro_batches=nmb) as plain:
        plain.generate(ids, attention_mask=mask, max_new_tokens=8, pad_token_id=0, eos_token_id=[])
        full = plain.stats()["weight_read_bytes"]
    if coded_layers:
        # tiny layers: 4 KiB records round the coded 0.75x up a little
        assert coded / full < (0.80 if saved[0].config.model_type == "llama" else 0.82)
    else:
        assert coded == full == 0


def test_sampling_with_a_seed_identical(saved, tmp_path):
    model, folder = saved
    ids, mask = padded_batch()
    torch.manual_seed(7)
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=True, top_k=20, pad_token_id=0,
                         eos_token_id=None)
    with OffloadedLM.from_pretrained(folder, weights="nvme", kv="cpu", nvme_dir=tmp_path,
                                     compress="lossless") as lm:
        torch.manual_seed(7)
        out = lm.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=True, top_k=20, pad_token_id=0,
                          eos_token_id=[])
    assert torch.equal(out, ref)


def test_a_changed_byte_of_a_coded_record_is_caught(saved, tmp_path):
    from tierstate.weights.homes import WeightsLostError
    _, folder = saved
    ids, mask = padded_batch()
    with OffloadedLM.from_pretrained(folder, weights="nvme", kv="cpu", nvme_dir=tmp_path,
                                     compress="lossless") as lm:
        home = lm.weights.nvme
        used = home.used_nbytes(1)
        assert used < home.record_nbytes[1]  # the read moves what the coded layer filled
        with open(home.path, "r+b") as f:  # a byte inside the coded part of layer 1
            f.seek(home.offsets[1] + used // 2)
            byte = f.read(1)
            f.seek(home.offsets[1] + used // 2)
            f.write(bytes([byte[0] ^ 0x10]))
        with pytest.raises(WeightsLostError, match="CRC-32C"):
            lm.generate(ids, attention_mask=mask, max_new_tokens=2, pad_token_id=0, eos_token_id=[])


def _record_spots(lm, i):
    """Byte offsets inside layer ``i``'s record, one per kind of region the decode's CRC covers."""
    parts = sorted(lm.weights.coded[i], key=lambda c: c.offset)
    coded = [c for c in parts if c.exp4 is not None]
    end = lambda c: c.offset + (c.exp4.nbytes if c.exp4 is not None else c.slot.nbytes)  # noqa: E731
    spots = {"sign/mantissa byte": coded[0].offset + 5,
             "exponent code byte": coded[0].offset + coded[0].exp4.codes_offset + 3,
             # the first escape's index, high byte: far past the matrix's end
             "escape index": next(c.offset + c.exp4.index_offset + 3 for c in coded if c.exp4.escapes),
             "padding between parts": next(end(a) for a, b in zip(parts, parts[1:]) if end(a) < b.offset)}
    raw = [c for c in parts if c.exp4 is None]
    if raw:
        spots["uncoded tensor"] = raw[0].offset + 1
    if end(parts[-1]) < lm.weights.nvme.used_nbytes(i):
        spots["padding after the last part"] = lm.weights.nvme.used_nbytes(i) - 1
    return spots


def test_a_changed_byte_anywhere_in_a_coded_record_is_caught(saved, tmp_path):
    """The record's CRC-32C, taken while the decode reads it, covers every byte the read moved:
    a byte flipped on disk in any part fails the next step with WeightsLostError, never with
    other tokens (or, for an escape index sent past the matrix, an IndexError)."""
    from tierstate.weights.homes import WeightsLostError
    _, folder = saved
    ids, mask = padded_batch()
    with OffloadedLM.from_pretrained(folder, weights="nvme", kv="cpu", nvme_dir=tmp_path,
                                     compress="lossless") as lm:
        ref = lm.generate(ids, attention_mask=mask, max_new_tokens=2, pad_token_id=0, eos_token_id=[])
        home = lm.weights.nvme
        spots = _record_spots(lm, 1)
        assert len(spots) >= 5
        for where, at in spots.items():
            with open(home.path, "r+b") as f:
                f.seek(home.offsets[1] + at)
                byte = f.read(1)
                f.seek(home.offsets[1] + at)
                f.write(bytes([byte[0] ^ 0x10]))
            with pytest.raises(WeightsLostError, match="CRC-32C"):
                lm.generate(ids, attention_mask=mask, max_new_tokens=2, pad_token_id=0, eos_token_id=[])
            with open(home.path, "r+b") as f:  # put it back: the next spot is tested alone
                f.seek(home.offsets[1] + at)
                f.write(byte)
            again = lm.generate(ids, attention_mask=mask, max_new_tokens=2, pad_token_id=0, eos_token_id=[])
            assert torch.equal(again, ref), where


def test_bad_lossless_arguments(tmp_path):
    model = tiny("llama")
    model.save_pretrained(tmp_path)  # float32 weights
    with pytest.raises(ValueError, match="compress='lossless' codes bfloat16 layers; dtype=torch.float32"):
        OffloadedLM.from_pretrained(tmp_path, weights="nvme", kv="cpu", compress="lossless", nvme_dir=tmp_path / "n")
    with pytest.raises(ValueError, match="group=32 applies to quantized layers"):
        OffloadedLM.from_pretrained(tmp_path, weights="nvme", kv="cpu", compress="lossless", group=32,
                                    dtype=torch.bfloat16)


def test_planner_reads_coded_bytes_from_nvme_only():
    """Lossless: NVMe layers read their coded bytes and are decoded; RAM layers cost their bf16
    bytes and no decode; the compute buffer exists only with a layer on NVMe."""
    from transformers import LlamaConfig

    from tierstate.placement.generate_plan import (Choice, GenerateHardware, GenerateWorkload, memory,
                                                   shape_from_config, timing)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                      num_attention_heads=16, num_key_value_heads=16, tie_word_embeddings=False)
    plain = shape_from_config(cfg, 2)
    est = [ll.estimated_nbytes(b // 2) for b in plain.layer_bytes]  # about 0.75x
    coded = shape_from_config(cfg, 2, plain.layer_bytes, est, lossless=True)
    hw = GenerateHardware("test", flops=300e9, ram_bandwidth=40e9, disk_read=2e9, disk_write=1e9,
                          call_seconds=3e-4, base_rss=700 << 20, dequant_bandwidth=30e9)
    wl = GenerateWorkload(32, 8, 24)
    for k in (2, 16):
        c = Choice(weight_cpu_layers=k, kv_cpu_layers=16, micro_batch=32, num_micro_batches=1)
        (ram_a, disk_a, a), (ram_b, disk_b, b) = memory(plain, wl, hw, c), memory(coded, wl, hw, c)
        assert b["weights_in_ram"] == a["weights_in_ram"] == sum(plain.layer_bytes[:k])
        assert b["weight_pool"] == a["weight_pool"] and disk_b == disk_a  # records keep their room
        ta, tb = timing(plain, wl, hw, c)[0], timing(coded, wl, hw, c)[0]
        if k == 16:  # nothing on NVMe: nothing coded, nothing decoded
            assert b["compute_buffer"] == 0 and ram_b == ram_a
            assert tb == pytest.approx(ta)
        else:
            assert b["compute_buffer"] == max(plain.layer_bytes) and ram_b == ram_a + b["compute_buffer"]
            # disk-bound at 2 GB/s: the coded layers' step is ~0.75x as long
            assert 1.25 < ta / tb < 1.34
