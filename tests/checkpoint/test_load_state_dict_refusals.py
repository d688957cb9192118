"""opt.load_state_dict / DCP's set_optimizer_state_dict with a damaged or mismatched torch-format
dict: a named error, and the live optimizer bit-identical (as load_optimizer guarantees)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

import ckpt_workload as wl


@pytest.fixture(scope="module")
def source():
    model, opt = wl.build("cpu", hidden=64)
    for step in range(2):
        wl.train_step(model, opt, step)
    sd = opt.state_dict()
    sd = {"state": {i: {k: v.clone() for k, v in st.items()} for i, st in sd["state"].items()},
          "param_groups": copy.deepcopy(sd["param_groups"])}
    return sd


def _group(key, value):
    def mutate(sd):
        sd["param_groups"][0][key] = value
    return mutate


def _state(index, key, value):
    def mutate(sd):
        sd["state"][index][key] = value(sd["state"][index][key]) if callable(value) else value
    return mutate


def _drop(index, key):
    def mutate(sd):
        del sd["state"][index][key]
    return mutate


MUTATIONS = [
    ("lr-negative", _group("lr", -1.0), ValueError, r"lr"),
    ("lr-string", _group("lr", "abc"), TypeError, r"lr"),
    ("betas-out-of-range", _group("betas", (1.5, 0.95)), ValueError, r"betas\[0\]"),
    ("eps-missing", lambda sd: sd["param_groups"][0].pop("eps"), ValueError, r"eps"),
    ("state-wrong-shape", _state(0, "exp_avg", lambda t: t.reshape(-1)[:100].clone()), ValueError,
     r"exp_avg.*parameter 0"),
    ("state-wrong-shape-last-param", _state(5, "exp_avg_sq", lambda t: torch.zeros(3)), ValueError,
     r"exp_avg_sq.*parameter 5"),
    ("state-int-dtype", _state(1, "exp_avg", lambda t: t.to(torch.int64)), TypeError, r"exp_avg.*int64"),
    ("state-not-a-tensor", _state(2, "exp_avg", [0.0] * 4096), ValueError, r"exp_avg.*parameter 2"),
    ("state-missing-key", _drop(3, "exp_avg_sq"), ValueError, r"exp_avg_sq.*parameter 3"),
    ("state-missing-step", _drop(4, "step"), ValueError, r"step.*parameter 4"),
    ("step-negative", _state(0, "step", torch.tensor(-1.0)), ValueError, r"step.*parameter 0"),
    ("step-fraction", _state(0, "step", torch.tensor(1.5)), ValueError, r"step.*parameter 0"),
    ("group-count", lambda sd: sd["param_groups"].append(copy.deepcopy(sd["param_groups"][0])), ValueError,
     r"group"),
]


@pytest.mark.parametrize("mode", ["cpu", "nvme"])
@pytest.mark.parametrize("name,mutate,exc,pattern", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_load_state_dict_refusal_changes_nothing(tmp_path, source, mode, name, mutate, exc, pattern):
    model, opt = wl.build(mode, hidden=64, nvme_dir=str(tmp_path / "nv"), lr=5e-4)
    wl.train_step(model, opt, 0)
    before = wl.snapshot(opt)
    sd = {"state": {i: dict(st) for i, st in source["state"].items()},
          "param_groups": copy.deepcopy(source["param_groups"])}
    mutate(sd)
    with pytest.raises(exc, match=pattern):
        opt.load_state_dict(sd)
    wl.assert_same_snapshot(before, wl.snapshot(opt))
    wl.train_step(model, opt, 1)  # and it still steps
    opt.close()


def test_dcp_set_optimizer_state_dict_refusal_changes_nothing(tmp_path):
    """DCP's load path ends in opt.load_state_dict: a bad dict there must not half-apply."""
    src_model, src = wl.build("cpu", hidden=64)
    for step in range(2):
        wl.train_step(src_model, src, step)
    sd = get_optimizer_state_dict(src_model, src)  # keyed by parameter names, as DCP keeps it
    model, opt = wl.build("nvme", hidden=64, nvme_dir=str(tmp_path / "nv"), lr=5e-4)
    wl.train_step(model, opt, 0)
    before = wl.snapshot(opt)
    last = sorted(sd["state"])[-1]
    sd["state"][last]["exp_avg"] = torch.zeros(7)
    with pytest.raises(ValueError, match="exp_avg"):
        set_optimizer_state_dict(model, opt, sd)
    wl.assert_same_snapshot(before, wl.snapshot(opt))
    sd["state"][last]["exp_avg"] = get_optimizer_state_dict(src_model, src)["state"][last]["exp_avg"]
    set_optimizer_state_dict(model, opt, sd)
    assert wl.digest(model, opt) != wl.digest(src_model, src)  # weights were not part of it
    model.load_state_dict(src_model.state_dict())
    assert wl.digest(model, opt) == wl.digest(src_model, src)
    opt.close()


def test_good_state_dict_still_loads(tmp_path, source):
    model, opt = wl.build("nvme", hidden=64, nvme_dir=str(tmp_path / "nv"))
    opt.load_state_dict(source)
    got = opt.state_dict()
    for i, st in source["state"].items():
        for key, value in st.items():
            assert torch.equal(got["state"][i][key], value), (i, key)
    opt.close()


@pytest.mark.parametrize("mode", ["cpu", "nvme"])
def test_state_dict_with_a_state_key_the_tiers_lack_loads(tmp_path, mode):
    """amsgrad=True keeps max_exp_avg_sq, which an optimizer built with amsgrad=False has no
    place for: load_state_dict must place the state anew (as load_optimizer does), not fail
    with a bare KeyError after replacing param_groups and forgetting the state."""
    src_model, src = wl.build("cpu", hidden=64, amsgrad=True)
    for step in range(2):
        wl.train_step(src_model, src, step)
    model, opt = wl.build(mode, hidden=64, nvme_dir=str(tmp_path / "nv"))
    wl.train_step(model, opt, 0)
    opt.load_state_dict(src.state_dict())
    model.load_state_dict(src_model.state_dict())
    assert opt.param_groups[0]["amsgrad"] is True
    assert wl.digest(model, opt) == wl.digest(src_model, src)
    for step in (2, 3):
        wl.train_step(src_model, src, step)
        wl.train_step(model, opt, step)
    assert wl.digest(model, opt) == wl.digest(src_model, src)
    opt.close()
