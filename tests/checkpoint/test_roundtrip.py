"""save_optimizer / load_optimizer round trips: formats, placements, torch interop, sweeping."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open

import tierstate as ts
from tierstate.checkpoint import load_optimizer, read_manifest, save_optimizer
from tierstate.checkpoint.format import DATA_ALIGNMENT

import ckpt_workload as wl

MODES = ["cpu", "nvme"]


def _build(mode, tmp_path, tag, **kw):
    return wl.build(mode, hidden=64, nvme_dir=str(tmp_path / f"nvme-{tag}"), **kw)


def _state(opt) -> dict:
    sd = opt.state_dict()
    return {(i, k): v.clone() for i, st in sd["state"].items() for k, v in st.items()}


def _assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("save_mode", MODES)
@pytest.mark.parametrize("load_mode", MODES)
def test_resume_across_placements_is_bit_identical(tmp_path, save_mode, load_mode):
    model, opt = _build(save_mode, tmp_path, "a")
    for step in range(3):
        wl.train_step(model, opt, step)
    save_optimizer(opt, tmp_path / "ckpt", extra={"step": 3}, shard_bytes=40_000, buffer_bytes=8192)
    for step in range(3, 6):
        wl.train_step(model, opt, step)

    model2, opt2 = _build(load_mode, tmp_path, "b", lr=0.5)  # hyper-parameters come from the checkpoint
    assert load_optimizer(opt2, tmp_path / "ckpt") == {"step": 3}
    assert opt2.param_groups[0]["lr"] == 1e-3 and opt2.param_groups[0]["betas"] == (0.9, 0.95)
    for step in range(3, 6):
        wl.train_step(model2, opt2, step)
    _assert_same_state(_state(opt), _state(opt2))
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
    opt.close()
    opt2.close()


def test_shards_are_aligned_safetensors_with_manifest(tmp_path):
    model, opt = _build("cpu", tmp_path, "a")
    wl.train_step(model, opt, 0)
    man = save_optimizer(opt, tmp_path / "ckpt", shard_bytes=100_000)
    on_disk = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
    assert on_disk["shards"] == man["shards"] and read_manifest(tmp_path / "ckpt")["tensors"] == man["tensors"]
    assert man["optimizer"] == "AdamW" and man["placement"]["cpu"] == 1.0 and man["step_count"] == 1
    assert [p["shape"] for p in man["params"]] == [list(p.shape) for p in model.parameters()]
    assert all(p["step"] == 1.0 for p in man["params"])
    assert len(man["shards"]) > 1
    names = set()
    for shard in man["shards"]:
        path = tmp_path / "ckpt" / shard["file"]
        assert shard["data_offset"] % DATA_ALIGNMENT == 0 and path.stat().st_size == shard["bytes"]
        assert len(shard["checksum"]["value"]) == 8  # crc32
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                assert man["tensors"][name]["shard"] == man["shards"].index(shard)
                names.add(name)
                i = int(name.split(".")[1])
                want = list(model.parameters())[i] if name.startswith("param.") else \
                    opt.state_dict()["state"][i][name.split(".")[2]]
                assert torch.equal(f.get_tensor(name), want.detach())
    assert names == set(man["tensors"]) and len(names) == 3 * len(list(model.parameters()))


def test_sha256_checksums_and_params_false(tmp_path):
    model, opt = _build("cpu", tmp_path, "a")
    wl.train_step(model, opt, 0)
    man = save_optimizer(opt, tmp_path / "ckpt", checksum="sha256", params=False)
    assert all(len(s["checksum"]["value"]) == 64 for s in man["shards"])
    assert not any(n.startswith("param.") for n in man["tensors"])
    model2, opt2 = _build("cpu", tmp_path, "b")
    load_optimizer(opt2, tmp_path / "ckpt")
    _assert_same_state(_state(opt), _state(opt2))
    assert not torch.equal(model[0].weight, model2[0].weight)  # weights not restored: none saved


def test_overwrite_keeps_only_the_new_files_and_sweeps_debris(tmp_path):
    model, opt = _build("cpu", tmp_path, "a")
    ckpt = tmp_path / "ckpt"
    other = tmp_path / "older"
    wl.train_step(model, opt, 0)
    save_optimizer(opt, other)
    before_other = {p.name: p.stat().st_mtime_ns for p in other.iterdir()}
    first = save_optimizer(opt, ckpt)
    (ckpt / "shard-crashed-00000.safetensors.partial").write_bytes(b"x" * 100)  # a killed save's debris
    (ckpt / ".manifest-crashed.tmp").write_bytes(b"{")
    (ckpt / "notes.txt").write_text("the user's own file")
    wl.train_step(model, opt, 1)
    second = save_optimizer(opt, ckpt, extra={"step": 2})
    assert {s["file"] for s in first["shards"]}.isdisjoint(s["file"] for s in second["shards"])
    assert sorted(p.name for p in ckpt.iterdir()) == sorted(["manifest.json", "notes.txt"] +
                                                            [s["file"] for s in second["shards"]])
    assert {p.name: p.stat().st_mtime_ns for p in other.iterdir()} == before_other
    model2, opt2 = _build("cpu", tmp_path, "b")
    assert load_optimizer(opt2, ckpt) == {"step": 2}
    _assert_same_state(_state(opt), _state(opt2))


def test_torch_adamw_checkpoint_loads_into_tierstate_and_back(tmp_path):
    torch.manual_seed(0)
    ref = torch.nn.Linear(40, 30)
    topt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(3):
        x, y = torch.randn(8, 40), torch.randn(8, 30)
        torch.nn.functional.mse_loss(ref(x), y).backward()
        topt.step()
        topt.zero_grad()
    save_optimizer(topt, tmp_path / "from_torch")
    torch.save(topt.state_dict(), tmp_path / "torch.pt")

    for how in ("save_optimizer", "torch.save"):
        model = torch.nn.Linear(40, 30)
        opt = ts.AdamW(model.parameters(), lr=1.0)
        if how == "save_optimizer":
            load_optimizer(opt, tmp_path / "from_torch")
        else:
            model.load_state_dict(ref.state_dict())
            opt.load_state_dict(torch.load(tmp_path / "torch.pt"))
        assert torch.equal(model.weight, ref.weight)
        for i, st in topt.state_dict()["state"].items():
            ours = opt.state_dict()["state"][i]
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(ours[key], st[key]), (how, i, key)
        assert opt.param_groups[0]["lr"] == 1e-2

    # and back: a tierstate checkpoint into torch.optim.AdamW
    save_optimizer(opt, tmp_path / "from_ts")
    back_model = torch.nn.Linear(40, 30)
    back = torch.optim.AdamW(back_model.parameters())
    load_optimizer(back, tmp_path / "from_ts")
    assert torch.equal(back_model.bias, model.bias)
    for i, st in opt.state_dict()["state"].items():
        for key, value in st.items():
            assert torch.equal(back.state_dict()["state"][i][key], value)


def test_low_precision_params_keep_their_masters(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 48).to(torch.bfloat16)
    opt = ts.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    model(x).float().sum().backward()
    opt.step()
    opt.zero_grad()
    man = save_optimizer(opt, tmp_path / "ckpt")
    assert man["params"][0]["state"] == {"exp_avg": "float32", "exp_avg_sq": "float32", "master": "float32"}
    model2 = torch.nn.Linear(64, 48).to(torch.bfloat16)
    opt2 = ts.AdamW(model2.parameters(), offload=ts.Offload(cpu=0.0, nvme=1.0, subgroup_numel=1024,
                                                            nvme_dir=str(tmp_path / "nv")))
    load_optimizer(opt2, tmp_path / "ckpt")
    for m, o in ((model, opt), (model2, opt2)):
        m(x).float().sum().backward()
        o.step()
        o.zero_grad()
    _assert_same_state(_state(opt), _state(opt2))
    assert torch.equal(model.weight, model2.weight)
    opt2.close()


def test_nonfinite_step_is_skipped_and_leaves_the_checkpoint_identical(tmp_path):
    model, opt = _build("cpu", tmp_path, "a")
    wl.train_step(model, opt, 0)
    before = wl.digest(model, opt)
    save_optimizer(opt, tmp_path / "before")
    x, y = wl.batch(1)
    torch.nn.functional.mse_loss(model(x), y).backward()
    model[0].weight.grad[3, 5] = float("nan")
    opt.step()
    opt.zero_grad()
    assert opt.skipped_steps == 1 and wl.digest(model, opt) == before
    man = save_optimizer(opt, tmp_path / "after")
    assert man["skipped_steps"] == 1
    ref = read_manifest(tmp_path / "before")
    assert [s["checksum"] for s in man["shards"]] == [s["checksum"] for s in ref["shards"]]
    model2, opt2 = _build("cpu", tmp_path, "b")
    load_optimizer(opt2, tmp_path / "after")
    assert opt2.skipped_steps == 1 and wl.digest(model2, opt2) == before
    for step in (1, 2):  # training continues as if the bad batch never came
        wl.train_step(model, opt, step)
        wl.train_step(model2, opt2, step)
    assert wl.digest(model, opt) == wl.digest(model2, opt2)


def test_scratch_of_mmap_state_dict_is_empty_and_values_match(tmp_path):
    from tierstate.checkpoint import mmap_state_dict

    model, opt = _build("nvme", tmp_path, "a")
    for step in range(2):
        wl.train_step(model, opt, step)
    scratch = tmp_path / "scratch"
    sd = mmap_state_dict(opt, scratch)
    assert os.listdir(scratch) == []  # mapped files are unlinked at once
    ref = opt.state_dict()
    for i, st in ref["state"].items():
        for key, value in st.items():
            assert torch.equal(sd["state"][i][key], value)
    torch.save(sd, tmp_path / "sd.pt")
    model2, opt2 = _build("cpu", tmp_path, "b")
    opt2.load_state_dict(torch.load(tmp_path / "sd.pt"))
    _assert_same_state(_state(opt), _state(opt2))
    opt.close()
