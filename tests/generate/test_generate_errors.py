"""Bad arguments name themselves; bytes changed on disk are found, not generated from."""
from __future__ import annotations

import os

import pytest
import torch

import tierstate as ts
from tierstate.generate import KVLostError, OffloadedLM

from _tiny import padded_batch, tiny


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    f = tmp_path_factory.mktemp("gpt2")
    tiny("gpt2").save_pretrained(f)
    return f


def test_public_names():
    assert ts.OffloadedLM is OffloadedLM and ts.KVLostError is KVLostError
    assert issubclass(KVLostError, ts.StateLostError)


@pytest.mark.parametrize("kwargs,match", [
    (dict(weights="disk"), "weights='disk'"),
    (dict(kv=["cpu"]), "one of 'cpu'/'nvme' per layer"),
    (dict(weights=ts.Offload(gpu=0.5, cpu=0.5)), "gpu"),
    (dict(micro_batch=0), "micro_batch=0"),
    (dict(num_micro_batches=-1), "num_micro_batches=-1"),
    (dict(dtype=torch.int8), "dtype"),
])
def test_bad_from_pretrained_arguments(folder, kwargs, match):
    kw = dict(weights="cpu", kv="cpu") | kwargs
    with pytest.raises((ValueError, TypeError), match=match):
        OffloadedLM.from_pretrained(folder, **kw)


def test_bad_generate_arguments(folder):
    ids, mask = padded_batch()
    with OffloadedLM.from_pretrained(folder, weights="cpu", kv="cpu") as lm:
        with pytest.raises(ValueError, match="max_new_tokens=0"):
            lm.generate(ids, max_new_tokens=0)
        with pytest.raises(ValueError, match="top_p=1.5"):
            lm.generate(ids, max_new_tokens=2, do_sample=True, top_p=1.5)
        with pytest.raises(ValueError, match="attention_mask"):
            lm.generate(ids, attention_mask=mask[:, :3], max_new_tokens=2)
        with pytest.raises(ValueError, match="tokenizer"):
            lm.generate(["hello"], max_new_tokens=2)
        with pytest.raises(TypeError, match="eos_token_id"):
            lm.generate(ids, max_new_tokens=2, eos_token_id="x")
    with pytest.raises(ValueError, match="closed"):
        lm.generate(ids, max_new_tokens=2)


def test_missing_tensor_named(tmp_path):
    from safetensors.torch import load_file, save_file
    model = tiny("llama")
    model.save_pretrained(tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        OffloadedLM.from_pretrained(tmp_path, weights="nvme", kv="cpu", nvme_dir=tmp_path / "nv")
    assert not (tmp_path / "nv" / "weights").exists()  # the half-built NVMe home was removed


def _flip_byte(path, offset):
    fd = os.open(path, os.O_RDWR)
    try:
        b = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([b[0] ^ 0xFF]), offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def test_weight_record_changed_on_disk_is_found(folder, tmp_path):
    ids, mask = padded_batch()
    with OffloadedLM.from_pretrained(folder, weights="nvme", kv="cpu", nvme_dir=tmp_path) as lm:
        lm.generate(ids, attention_mask=mask, max_new_tokens=2)
        _flip_byte(lm.weights.nvme.path, lm.weights.nvme.offsets[1] + 100)
        with pytest.raises(ts.WeightsLostError) as info:
            lm.generate(ids, attention_mask=mask, max_new_tokens=2)
        assert str(lm.weights.nvme.path) in str(info.value) and "block 1" in str(info.value)


def test_kv_record_changed_on_disk_is_found(folder, tmp_path):
    """A byte of layer 1's keys flipped on disk between two steps: the next read of that record
    fails with KVLostError naming the file, instead of attending over wrong keys."""
    ids, mask = padded_batch()
    with OffloadedLM.from_pretrained(folder, weights="nvme", kv="nvme", nvme_dir=tmp_path, micro_batch=5) as lm:
        def corrupt(step, total):
            if step == 2:
                kv = corrupt.kv
                _flip_byte(kv.nvme.path, kv.nvme.offsets[1] + 10)

        import tierstate.generate.model as gm
        real = gm.KVStore

        class Spy(real):
            def __init__(self, *a, **k):
                super().__init__(*a, **k)
                corrupt.kv = self
        gm.KVStore = Spy
        try:
            with pytest.raises(KVLostError) as info:
                lm.generate(ids, attention_mask=mask, max_new_tokens=4, progress=corrupt)
        finally:
            gm.KVStore = real
        assert "layer 1, micro-batch 0" in str(info.value) and str(tmp_path) in str(info.value)
        assert info.value.errno is None or isinstance(info.value.errno, int)
        # the next call builds a new cache and works
        out = lm.generate(ids, attention_mask=mask, max_new_tokens=4)
        assert out.shape == (5, ids.shape[1] + 4)
