"""A disk too small for the NVMe files of generation or of streamed weights: the error names
the shortfall, the path, ENOSPC and the arguments of the call that was made (not the
optimizer's ``Offload(nvme_dir=...)``), and leaves no file behind."""
from __future__ import annotations

import errno
import sys
from pathlib import Path

import pytest
import torch

import tierstate as ts
from tierstate.generate import OffloadedLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "io"))
from io_helpers import mounted  # noqa: E402


def _llama(layers: int = 4):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=1024, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()  # 4.2 MiB of fp32 weights a layer


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    f = tmp_path_factory.mktemp("llama")
    _llama().save_pretrained(f)
    return f


def _no_files_left(mnt: Path) -> None:
    left = [p for p in mnt.rglob("*") if p.is_file()]
    assert left == [], left


def test_weights_of_generation_on_too_small_a_disk(folder, tmp_path):
    with mounted(tmp_path, "tmpfs", 8) as mnt:
        with pytest.raises(ts.DiskFullError) as err:
            OffloadedLM.from_pretrained(folder, weights="nvme", kv="cpu", nvme_dir=mnt / "gen")
        text = str(err.value)
        assert err.value.errno == errno.ENOSPC and str(mnt) in text
        assert "needs 16.0 MiB of disk" in text and "8.0 MiB free" in text
        assert "from_pretrained(nvme_dir=" in text and "weights=" in text
        assert "Offload(nvme_dir" not in text and "state" not in text
        _no_files_left(mnt)


def test_kv_cache_of_generation_on_too_small_a_disk(folder, tmp_path):
    # KV records: 2 x 48 sequences x 96 positions x 256 values x fp32 = 9.0 MiB a layer
    ids = torch.randint(5, 256, (48, 88))
    with mounted(tmp_path, "tmpfs", 8) as mnt:
        with OffloadedLM.from_pretrained(folder, weights="cpu", kv="nvme", nvme_dir=mnt / "gen") as lm:
            with pytest.raises(ts.DiskFullError) as err:
                lm.generate(ids, max_new_tokens=8)
        text = str(err.value)
        assert err.value.errno == errno.ENOSPC and str(mnt) in text
        assert "from_pretrained(nvme_dir=" in text and "kv=" in text
        assert "Offload(nvme_dir" not in text and "state" not in text
        _no_files_left(mnt)


def test_streamed_weights_on_too_small_a_disk(tmp_path):
    model = _llama()
    with mounted(tmp_path, "tmpfs", 8) as mnt:
        with pytest.raises(ts.DiskFullError) as err:
            ts.offload_weights(model, "nvme", nvme_dir=mnt / "w")
        text = str(err.value)
        assert err.value.errno == errno.ENOSPC and str(mnt) in text
        assert "offload_weights(nvme_dir=" in text and "offload=" in text
        assert "Offload(nvme_dir" not in text and "state" not in text
        _no_files_left(mnt)
        assert all(p.device.type != "meta" and p.numel() > 0 for p in model.parameters())  # left usable
