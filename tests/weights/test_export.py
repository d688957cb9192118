"""save_weights / load_weights: one safetensors file, written a tensor at a time, read by the
safetensors library and by transformers; streamed weights never gathered in RAM at once."""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import tierstate as ts
from tierstate.io import DiskFullError, FileIOError
from tierstate.io.errors import ReadOnlyFilesystemError

safetensors_torch = pytest.importorskip("safetensors.torch")
from safetensors import safe_open  # noqa: E402

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


def gpt2(dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=128, n_positions=32,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg).to(dtype).eval()  # eval: no dropout in the forward compared


def llama(dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                   max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg).to(dtype).eval()


BUILD = {"gpt2": gpt2, "llama": llama}


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def streamed_values(model: nn.Module, ws) -> dict[str, torch.Tensor]:
    """Every state_dict entry's current values, streamed ones read through the streamer."""
    out = {}
    for k, v in model.state_dict(keep_vars=True).items():
        out[k] = ws.read_param(v) if ts.weights.streamed(v) is not None else v.detach().clone()
    return out


def offload(model: nn.Module, home: str, tmp_path: Path, name: str = "w"):
    return ts.offload_weights(model, home, nvme_dir=tmp_path / name if home == "nvme" else None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("home", ["nvme", "cpu"])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_round_trip_is_bit_identical_and_the_library_reads_the_file(arch, home, dtype, tmp_path):
    ref = BUILD[arch](dtype, seed=1)
    want = snapshot(ref)
    model = BUILD[arch](dtype, seed=2)
    model.load_state_dict(ref.state_dict())
    ws = offload(model, home, tmp_path)
    assert ws.stats()["blocks"] == 4
    path = ts.save_weights(model, tmp_path / "model.safetensors")
    assert path == tmp_path / "model.safetensors"

    # the safetensors library reads it: every tensor, bit for bit, tied weights once
    got = safetensors_torch.load_file(str(path))
    expected_keys = set(want) - ({"lm_head.weight"} if arch == "gpt2" else set())
    assert set(got) == expected_keys
    for k in expected_keys:
        assert same_bits(got[k], want[k]), k
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    assert sorted(os.listdir(tmp_path)) == sorted(["model.safetensors"] + (["w"] if home == "nvme" else []))

    # into another streamed model of the same architecture: the same bits come back
    other = BUILD[arch](dtype, seed=3)
    ws2 = offload(other, home, tmp_path, "w2")
    assert not same_bits(streamed_values(other, ws2)["model.layers.0.mlp.up_proj.weight" if arch == "llama"
                                                     else "transformer.h.0.mlp.c_fc.weight"],
                         want["model.layers.0.mlp.up_proj.weight" if arch == "llama" else "transformer.h.0.mlp.c_fc.weight"])
    result = ts.load_weights(other, path)
    assert result == ([], [])
    back = streamed_values(other, ws2)
    for k in want:
        assert same_bits(back[k], want[k]), k
    if arch == "gpt2":
        assert other.lm_head.weight is other.transformer.wte.weight
    # and a forward pass of the loaded model is the reference's
    ids = torch.arange(16).reshape(1, 16) % 128
    with torch.no_grad():
        assert torch.equal(other(ids).logits, ref(ids).logits)
    ws.close()
    ws2.close()


def test_save_reads_updates_not_yet_written_back(tmp_path):
    """A value set in a block's image (as the optimizer does) is saved before any write-back."""
    model = llama()
    ws = offload(model, "nvme", tmp_path)
    p = model.model.layers[2].mlp.down_proj.weight
    new = torch.full(p.shape, 0.125)
    writes = ws.stats()["writeback_bytes"]
    ws.write_param(p, new)
    assert ws.stats()["writeback_bytes"] == writes  # still only in the image
    path = ts.save_weights(model, tmp_path / "m.safetensors", streamer=ws)
    assert torch.equal(safetensors_torch.load_file(str(path))["model.layers.2.mlp.down_proj.weight"], new)
    ws.close()


def test_save_after_close_names_the_cause_and_writes_nothing(tmp_path):
    model = llama()
    ws = offload(model, "nvme", tmp_path)
    ws.close()
    out = tmp_path / "m.safetensors"
    with pytest.raises(ValueError, match=r"model\.layers\.0\..*closed.*before WeightStreamer.close"):
        ts.save_weights(model, out)
    assert not out.exists()


def test_a_save_pretrained_file_loads_into_a_streamed_model(tmp_path):
    ref = gpt2(seed=4)
    ref.save_pretrained(tmp_path / "hf")
    want = snapshot(ref)
    model = gpt2(seed=5)
    ws = offload(model, "nvme", tmp_path)
    assert ts.load_weights(model, tmp_path / "hf" / "model.safetensors") == ([], [])
    back = streamed_values(model, ws)
    for k in want:
        assert same_bits(back[k], want[k]), k
    ws.close()


def test_transformers_from_pretrained_reads_the_saved_file(tmp_path):
    model = llama(torch.bfloat16, seed=6)
    want = snapshot(model)
    model.config.save_pretrained(tmp_path / "out")
    ws = offload(model, "nvme", tmp_path)
    ts.save_weights(model, tmp_path / "out" / "model.safetensors")
    ws.close()
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.bfloat16)
    got = loaded.state_dict()
    for k in want:
        assert same_bits(got[k], want[k]), k


def test_load_names_missing_unexpected_and_mismatched_keys_and_changes_nothing(tmp_path):
    small = gpt2(seed=7)
    path = ts.save_weights(small, tmp_path / "g.safetensors")
    target = llama(seed=8)
    ws = offload(target, "cpu", tmp_path)
    before = streamed_values(target, ws)
    with pytest.raises(ValueError) as e:
        ts.load_weights(target, path)
    msg = str(e.value)
    assert "missing (in the model, not in the file): 'model.embed_tokens.weight'" in msg
    assert "unexpected (in the file, not in the model): 'transformer.wte.weight'" in msg
    assert "strict=False" in msg

    # same names, other shapes: always refused, every mismatch named with both shapes
    wide = llama(seed=9)
    cfg = wide.config
    cfg.intermediate_size = 96
    narrow = transformers.LlamaForCausalLM(cfg)
    bad = ts.save_weights(narrow, tmp_path / "narrow.safetensors")
    with pytest.raises(ValueError) as e:
        ts.load_weights(target, bad, strict=False)
    assert "'model.layers.0.mlp.up_proj.weight': [96, 64] in the file, [128, 64] in the model" in str(e.value)
    assert "12 tensor(s)" in str(e.value)  # gate, up, down in each of the 4 layers
    after = streamed_values(target, ws)
    assert all(same_bits(after[k], before[k]) for k in before)

    # strict=False loads what both have and reports the rest
    partial = {k: v for k, v in snapshot(llama(seed=10)).items() if "layers.3" not in k}
    partial["extra.weight"] = torch.zeros(3)
    safetensors_torch.save_file(partial, str(tmp_path / "partial.safetensors"))
    result = ts.load_weights(target, tmp_path / "partial.safetensors", strict=False)
    assert result.unexpected_keys == ["extra.weight"]
    assert sorted(result.missing_keys) == sorted(k for k in before if "layers.3" in k)
    after = streamed_values(target, ws)
    assert all(same_bits(after[k], partial[k]) for k in partial if k != "extra.weight")
    assert all(same_bits(after[k], before[k]) for k in result.missing_keys)
    ws.close()


def test_bad_arguments_name_the_argument(tmp_path):
    model = gpt2()
    with pytest.raises(TypeError, match="path=3"):
        ts.save_weights(model, 3)
    with pytest.raises(ValueError, match="is a folder"):
        ts.save_weights(model, tmp_path)
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        ts.save_weights("model", tmp_path / "x.safetensors")
    with pytest.raises(TypeError, match="strict="):
        ts.load_weights(model, tmp_path / "x.safetensors", strict="yes")
    ws = offload(gpt2(), "cpu", tmp_path)
    with pytest.raises(ValueError, match="streams another model"):
        ts.save_weights(model, tmp_path / "x.safetensors", streamer=ws)
    with pytest.raises(FileNotFoundError) as e:
        ts.load_weights(model, tmp_path / "absent.safetensors")
    assert "absent.safetensors" in str(e.value)
    (tmp_path / "junk.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(ValueError, match="not a safetensors file"):
        ts.load_weights(model, tmp_path / "junk.safetensors")
    with torch.device("meta"):
        meta = transformers.GPT2LMHeadModel(model.config)
    with pytest.raises(ValueError, match="meta device"):
        ts.save_weights(meta, tmp_path / "x.safetensors")
    ws.close()
    assert sorted(os.listdir(tmp_path)) == ["junk.safetensors"]


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 1 MiB tmpfs, or skip where this process may not mount one (not root)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_full_disk_leaves_no_partial_file_and_names_the_path(small_tmpfs, tmp_path):
    model = llama()  # 4 layers x 24 K params x 4 B + 2 x 8 K x 4 B: 0.46 MiB of weights
    model.model.layers.append(llama(seed=11).model.layers[0])
    for _ in range(4):
        model.model.layers.extend(llama(seed=12).model.layers)  # 2.3 MiB: past the 1 MiB tmpfs
    ws = offload(model, "nvme", tmp_path)
    target = small_tmpfs / "model.safetensors"
    target.write_bytes(b"the previous file")
    with pytest.raises(DiskFullError) as e:
        ts.save_weights(model, target)
    assert e.value.errno == errno.ENOSPC
    assert e.value.filename == str(target) and str(target) in str(e.value)
    assert os.listdir(small_tmpfs) == ["model.safetensors"]  # the temporary file is gone
    assert target.read_bytes() == b"the previous file"
    ws.close()


def test_a_read_only_folder_raises_naming_the_path(small_tmpfs, tmp_path):
    subprocess.run(["mount", "-o", "remount,ro", str(small_tmpfs)], check=True)
    model = gpt2()
    with pytest.raises(ReadOnlyFilesystemError) as e:
        ts.save_weights(model, small_tmpfs / "model.safetensors")
    assert isinstance(e.value, FileIOError) and e.value.errno == errno.EROFS
    assert str(small_tmpfs / "model.safetensors") in str(e.value)
    assert os.listdir(small_tmpfs) == []


RSS_CHILD = textwrap.dedent("""
    import json, sys, threading, time
    import psutil, torch
    from torch import nn
    import tierstate as ts

    out, home_dir = sys.argv[1], sys.argv[2]
    BLOCKS, WIDTH = 32, 1024  # 32 blocks of one 1024x1024 fp32 weight: 4 MiB each, 128 MiB streamed

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(64, WIDTH)
            self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(BLOCKS))

    def init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    with torch.device("meta"):
        model = Net()
    ws = ts.offload_weights(model, "nvme", nvme_dir=home_dir, init=init, prefetch=2)
    proc = psutil.Process()
    peak = [0]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.0005)

    def measure(fn):
        base = proc.memory_info().rss
        peak[0] = base
        stop.clear()
        t = threading.Thread(target=sample)
        t.start()
        fn()
        stop.set()
        t.join()
        return peak[0] - base

    def gather_all():  # the control: every block in memory at once, as a naive export would hold them
        with ws.gathered():
            time.sleep(0.05)

    growth = measure(lambda: ts.save_weights(model, out))
    control = measure(gather_all)
    st = ws.stats()
    json.dump({"growth": growth, "control": control, "streamed": sum(ws.block_bytes()),
               "block": max(ws.block_bytes()), "pool": st["pool_bytes"]}, sys.stdout)
""")


def test_save_memory_stays_near_one_block_while_streaming(tmp_path):
    """RSS growth during save: one block image + one tensor + the 16 MiB of write buffers + slack,
    for streamed weights 32x one block; a control (all blocks gathered) shows the meter sees it."""
    pytest.importorskip("psutil")
    out = tmp_path / "big.safetensors"
    r = subprocess.run([sys.executable, "-c", RSS_CHILD, str(out), str(tmp_path / "home")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    m = json.loads(r.stdout.strip().splitlines()[-1])
    mib = 2**20
    assert m["streamed"] >= 4 * (m["pool"] + m["block"])  # the model is well past the window
    bound = m["block"] + m["block"] + 16 * mib + 24 * mib  # an image, one tensor, write buffers, slack
    assert m["growth"] < bound, f"save grew RSS by {m['growth'] / mib:.1f} MiB (bound {bound / mib:.1f}): {m}"
    # gathered blocks take the pool's images first (on the CPU an image is the block's storage)
    assert m["control"] > 0.9 * (m["streamed"] - m["pool"]), f"the meter missed the gathered weights: {m}"
    with safe_open(str(out), framework="pt") as f:
        assert len(list(f.keys())) == 33
        assert f.get_tensor("blocks.31.weight").shape == (1024, 1024)


def test_persistent_buffers_are_saved_and_loaded_non_persistent_ones_are_not(tmp_path):
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.norm = nn.BatchNorm1d(8)  # running_mean/var, num_batches_tracked (int64): persistent
            self.register_buffer("scratch", torch.ones(3), persistent=False)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(3))

    torch.manual_seed(13)
    net = Net()
    for b in net.blocks:
        b.norm.running_mean.normal_()
        b.norm.num_batches_tracked.fill_(7)
    want = snapshot(net)
    ws = offload(net, "nvme", tmp_path)
    path = ts.save_weights(net, tmp_path / "n.safetensors")
    got = safetensors_torch.load_file(str(path))
    assert set(got) == set(want) and "blocks.0.scratch" not in got
    assert got["blocks.1.norm.num_batches_tracked"].dtype == torch.int64
    assert all(same_bits(got[k], want[k]) for k in want)
    torch.manual_seed(14)
    other = Net()
    ws2 = offload(other, "cpu", tmp_path)
    ts.load_weights(other, path)
    back = streamed_values(other, ws2)
    assert all(same_bits(back[k], want[k]) for k in want)
    ws.close()
    ws2.close()
