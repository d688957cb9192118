"""Injected faults around checkpoints: each refused by name, the live optimizer bit-identical."""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "checkpoint"))

import ckpt_workload as wl  # noqa: E402
from tierstate.checkpoint import CorruptCheckpointError, load_optimizer, read_manifest, save_optimizer  # noqa: E402
from tierstate.checkpoint.durable import aligned_buffer, read_chunks  # noqa: E402


@pytest.fixture
def saved(tmp_path):
    model, opt = wl.build("cpu", hidden=64)
    for step in range(2):
        wl.train_step(model, opt, step)
    man = save_optimizer(opt, tmp_path / "ckpt", shard_bytes=30_000)
    return tmp_path / "ckpt", man, wl.digest(model, opt)


@pytest.fixture
def live(tmp_path):
    model, opt = wl.build("nvme", hidden=64, nvme_dir=str(tmp_path / "nv"))
    wl.train_step(model, opt, 0)
    yield model, opt
    opt.close()


def _refused(opt, ckpt, exc, pattern):
    before = wl.snapshot(opt)
    with pytest.raises(exc, match=pattern) as info:
        load_optimizer(opt, ckpt)
    wl.assert_same_snapshot(before, wl.snapshot(opt))
    return info.value


def test_one_bit_flipped_in_the_manifest_file(saved, live):
    """A single bit of manifest.json flipped on disk (inside an offset's digits)."""
    ckpt, man, _ = saved
    raw = (ckpt / "manifest.json").read_bytes()
    text = raw.decode()
    at = text.index('"data_offsets"') + len('"data_offsets": [\n  ') + 1
    while not text[at].isdigit():
        at += 1
    flipped = bytearray(raw)
    flipped[at] ^= 0x01  # '0' <-> '1', '2' <-> '3', ...: still valid JSON, another number
    (ckpt / "manifest.json").write_bytes(bytes(flipped))
    err = _refused(live[1], ckpt, CorruptCheckpointError, "manifest checksum mismatch")
    assert err.errno == errno.EIO and err.filename == str(ckpt / "manifest.json")


def test_two_shard_files_swapped(saved, live):
    """Two shards' contents exchanged (e.g. a copy tool that mixed up names)."""
    ckpt, man, _ = saved
    a, b = (ckpt / man["shards"][0]["file"]), (ckpt / man["shards"][1]["file"])
    da, db = a.read_bytes(), b.read_bytes()
    a.write_bytes(db)
    b.write_bytes(da)
    err = _refused(live[1], ckpt, CorruptCheckpointError, r"truncated or damaged|checksum mismatch")
    assert err.filename in (str(a), str(b)) and err.errno == errno.EIO


def test_shard_replaced_by_a_directory(saved, live):
    ckpt, man, _ = saved
    path = ckpt / man["shards"][-1]["file"]
    path.unlink()
    path.mkdir()
    err = _refused(live[1], ckpt, CorruptCheckpointError, "truncated or damaged")
    assert err.filename == str(path)


def test_shard_truncated_to_zero_and_missing(saved, live):
    ckpt, man, _ = saved
    path = ckpt / man["shards"][1]["file"]
    path.write_bytes(b"")
    err = _refused(live[1], ckpt, CorruptCheckpointError, r"shard is 0 bytes")
    assert err.filename == str(path)
    path.unlink()
    err = _refused(live[1], ckpt, FileNotFoundError, "No such file")
    assert err.filename == str(path) and err.errno == errno.ENOENT


def test_manifest_empty_or_a_directory(saved, live):
    ckpt, _, _ = saved
    manifest = ckpt / "manifest.json"
    manifest.write_bytes(b"")
    err = _refused(live[1], ckpt, CorruptCheckpointError, "not valid JSON")
    assert err.filename == str(manifest)
    manifest.unlink()
    manifest.mkdir()
    err = _refused(live[1], ckpt, OSError, "Is a directory")
    assert err.filename == str(manifest) and err.errno == errno.EISDIR


def test_manifest_of_another_checkpoint_with_its_checksum(saved, live, tmp_path):
    """manifest.json copied from another save of the same model: intact and sealed, but its
    shards are not these files."""
    ckpt, _, _ = saved
    model, opt = wl.build("cpu", hidden=64)
    wl.train_step(model, opt, 0)
    save_optimizer(opt, tmp_path / "other", shard_bytes=30_000)
    (ckpt / "manifest.json").write_bytes((tmp_path / "other" / "manifest.json").read_bytes())
    err = _refused(live[1], ckpt, FileNotFoundError, "No such file")
    assert err.filename.startswith(str(ckpt) + os.sep) and err.errno == errno.ENOENT


def test_shard_shrinks_while_being_read(tmp_path):
    """A read that ends early (the file was truncated after its size was checked): EIO, path."""
    path = tmp_path / "short.bin"
    path.write_bytes(b"x" * 10_000)
    buffers = [aligned_buffer(4096), aligned_buffer(4096)]
    with pytest.raises(CorruptCheckpointError, match="truncated while being read") as info:
        for _ in read_chunks(str(path), 16_384, buffers):
            pass
    assert info.value.errno == errno.EIO and info.value.filename == str(path)


def test_nan_hyper_parameter_and_step_in_a_state_dict(live):
    """opt.load_state_dict with lr=nan, then with a NaN step: refused, nothing replaced."""
    model, opt = live
    sd = opt.state_dict()
    sd = {"state": {i: {k: v.clone() for k, v in st.items()} for i, st in sd["state"].items()},
          "param_groups": [dict(g) for g in sd["param_groups"]]}
    before = wl.snapshot(opt)
    sd["param_groups"][0]["lr"] = float("nan")
    with pytest.raises(ValueError, match=r"param_groups\[0\].*lr"):
        opt.load_state_dict(sd)
    wl.assert_same_snapshot(before, wl.snapshot(opt))
    sd["param_groups"][0]["lr"] = 1e-3
    sd["state"][3]["step"] = torch.tensor(float("nan"))
    with pytest.raises(ValueError, match=r"'step' of parameter 3"):
        opt.load_state_dict(sd)
    wl.assert_same_snapshot(before, wl.snapshot(opt))


def test_malformed_pause_variable_is_named(tmp_path, monkeypatch):
    model, opt = wl.build("cpu", hidden=16)
    wl.train_step(model, opt, 0)
    monkeypatch.setenv("TIERSTATE_TEST_PAUSE_AT", "shards-renamed")  # no marker file
    with pytest.raises(ValueError, match=r"TIERSTATE_TEST_PAUSE_AT='shards-renamed'.*<marker file>"):
        save_optimizer(opt, tmp_path / "ckpt")
    assert sorted(os.listdir(tmp_path / "ckpt")) == []  # the failed save left nothing


def test_two_crashed_saves_then_a_load_and_a_save(tmp_path):
    """Two writers killed in turn after renaming their shards: the first checkpoint still
    loads; the next save sweeps both crashed saves' shards."""
    ckpt = tmp_path / "ckpt"
    model, opt = wl.build("cpu", hidden=wl.HIDDEN)
    wl.train_step(model, opt, 0)
    save_optimizer(opt, ckpt, extra={"step": 1}, **wl.SAVE_KW)
    first = wl.digest(model, opt)
    import tierstate

    env = dict(os.environ)
    env["PYTHONPATH"] = str(Path(tierstate.__file__).resolve().parents[1]) + os.pathsep + env.get("PYTHONPATH", "")
    for n in range(2):
        marker = tmp_path / f"paused{n}"
        env["CKPT_TEST_PAUSE"] = f"shards-renamed:1:{marker}"
        proc = subprocess.Popen([sys.executable, wl.__file__, "train", "cpu", str(ckpt), "1"], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 300
        while not marker.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-2000:]
            time.sleep(0.02)
        proc.kill()
        proc.wait(timeout=60)
        proc.stderr.close()
    names = os.listdir(ckpt)
    live_shards = {s["file"] for s in read_manifest(ckpt)["shards"]}
    assert len([n for n in names if n.endswith(".safetensors")]) == 3 * len(live_shards)
    model2, opt2 = wl.build("cpu", hidden=wl.HIDDEN)
    assert load_optimizer(opt2, ckpt) == {"step": 1}
    assert wl.digest(model2, opt2) == first
    save_optimizer(opt2, ckpt, extra={"step": 1}, **wl.SAVE_KW)
    assert sorted(os.listdir(ckpt)) == sorted(["manifest.json"] + [s["file"] for s in read_manifest(ckpt)["shards"]])
    assert json.loads((ckpt / "manifest.json").read_text())["extra"] == {"step": 1}
