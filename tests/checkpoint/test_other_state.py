"""Entries of ``optimizer.state`` whose key is not a parameter (a hook's ``state["test"]``)
through save_optimizer / load_optimizer: torch's state dict carries them and its load puts
them back, so tierstate's checkpoint does too, or refuses to save one it cannot hold."""
from __future__ import annotations

import json
import math

import pytest
import torch

import tierstate as ts
from tierstate.checkpoint import load_optimizer, read_manifest, save_optimizer
from tierstate.checkpoint.compressed import StateFormatWarning, full_state_dict
from tierstate.checkpoint.manifest import CHECKSUM_FIELD, CorruptCheckpointError, seal

import ckpt_workload as wl

ENTRIES = {
    "test": 1,
    "flag": True,
    "nothing": None,
    "ratio": 0.1,
    "not a number": math.inf,
    "text": "abc",
    7: [1, 2.5, "x"],  # an int key stays an int
    (1, "a"): "tuple key",
    "nested": {"a": (1, 2), 3: [torch.tensor([1.5, -2.0])]},
    "fp32": torch.arange(6, dtype=torch.float32).reshape(2, 3),
    "bf16": torch.tensor([1.0, -3.5, 1e-3], dtype=torch.bfloat16),
    "i64 scalar": torch.tensor(12345678901, dtype=torch.int64),
    "bool": torch.tensor([True, False]),
    "empty": torch.empty(0, 4),
    "strided": torch.arange(12.0).reshape(3, 4).t(),  # not contiguous: saved by value
}


def _same(a, b) -> None:
    assert type(a) is type(b), (a, b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert a == b


def _build(mode: str, tmp_path, tag: str):
    if mode != "torch":
        return wl.build(mode, hidden=32, nvme_dir=str(tmp_path / f"nv-{tag}"))
    model, _ = wl.build("cpu", hidden=32)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


@pytest.mark.parametrize("save_mode,load_mode", [("cpu", "cpu"), ("cpu", "nvme"), ("nvme", "cpu"), ("torch", "cpu")])
def test_entries_not_of_parameters_round_trip(tmp_path, save_mode, load_mode):
    model, opt = _build(save_mode, tmp_path, "a")
    wl.train_step(model, opt, 0)
    for key, value in ENTRIES.items():
        opt.state[key] = value
    save_optimizer(opt, tmp_path / "ckpt")
    model2, opt2 = _build(load_mode, tmp_path, "b")
    opt2.state["stale"] = 5  # torch's load replaces the whole state: an entry not saved is gone
    load_optimizer(opt2, tmp_path / "ckpt")
    others = {k: v for k, v in opt2.state.items() if not isinstance(k, torch.Tensor)}
    assert list(others) == list(ENTRIES)
    for key, value in ENTRIES.items():
        _same(value if not isinstance(value, torch.Tensor) else value.contiguous(), others[key])
    # the parameters' state is what it was
    for p, q in zip(model.parameters(), model2.parameters()):
        for k, v in opt.state[p].items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(opt2.state[q][k])), k
    for o in (opt, opt2):
        getattr(o, "close", lambda: None)()


def test_checkpoint_without_such_entries_keeps_its_manifest(tmp_path):
    model, opt = wl.build("cpu", hidden=32)
    wl.train_step(model, opt, 0)
    man = save_optimizer(opt, tmp_path / "ckpt")
    assert "other_state" not in man  # readable by the versions that predate the field
    opt.close()


class _Opaque:
    pass


@pytest.mark.parametrize("value", [_Opaque(), {1, 2}, torch.tensor([1 + 2j]), {"k": {"inner": b"bytes"}}])
def test_an_entry_the_checkpoint_cannot_hold_is_refused_before_writing(tmp_path, value):
    model, opt = wl.build("cpu", hidden=32)
    wl.train_step(model, opt, 0)
    opt.state["mine"] = value
    with pytest.raises(TypeError, match=r"optimizer\.state\['mine'\]"):
        save_optimizer(opt, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())
    opt.close()


def test_a_damaged_entry_is_named_at_load(tmp_path):
    model, opt = wl.build("cpu", hidden=32)
    wl.train_step(model, opt, 0)
    opt.state["t"] = torch.ones(3)
    save_optimizer(opt, tmp_path / "ckpt", checksum="crc32")
    man = read_manifest(tmp_path / "ckpt")
    assert man["other_state"][0][1]["tensor"]["dtype"] == "float32"
    model2, opt2 = wl.build("cpu", hidden=32)
    path = tmp_path / "ckpt" / "manifest.json"
    body = json.loads(path.read_text())
    body["other_state"][0][1]["tensor"]["shape"] = [4]  # 3 values' bytes under a shape of 4
    path.write_text(json.dumps(body))
    with pytest.raises(CorruptCheckpointError, match="manifest_checksum"):  # any edit
        load_optimizer(opt2, tmp_path / "ckpt")
    body.pop(CHECKSUM_FIELD)
    path.write_text(json.dumps(seal(body, "crc32")))  # resealed: the entry's own check names it
    with pytest.raises(CorruptCheckpointError, match=r"other_state\[0\]"):
        load_optimizer(opt2, tmp_path / "ckpt")
    assert "t" not in opt2.state
    opt.close()
    opt2.close()


def _q8(model):
    return ts.AdamW(model.parameters(), lr=1e-2, offload=ts.Offload(cpu=1.0, moment_dtype="q8"))


def test_compressed_state_conversions_pass_other_entries_through():
    """full_state_dict and the full <-> compressed cross-loads convert the parameters' state
    and leave every other entry as it is, even one that looks like a parameter's state."""
    model, _ = wl.build("cpu", hidden=32)
    q8 = _q8(model)
    wl.train_step(model, q8, 0)
    others = {"test": 1, "looks like state": {"exp_avg": torch.ones(3), "step": 2.0}}
    q8.state.update(others)
    full = full_state_dict(q8)
    for key, value in others.items():
        _same(value, full["state"][key])
    ids = [i for g in full["param_groups"] for i in g["params"]]
    assert all(full["state"][i]["exp_avg"].dtype == torch.float32 for i in ids)
    plain = ts.AdamW(model.parameters(), lr=1e-2)  # compressed -> full, with a warning
    with pytest.warns(StateFormatWarning):
        plain.load_state_dict(q8.state_dict())
    back = _q8(model)  # full -> compressed
    with pytest.warns(StateFormatWarning):
        back.load_state_dict(full)
    for opt in (plain, back):
        for key, value in others.items():
            _same(value, opt.state[key])
    t = torch.optim.AdamW(model.parameters())
    t.load_state_dict(full)
    assert t.state["test"] == 1
    for opt in (q8, plain, back):
        opt.close()
