"""Faults and bad input at the optimizer's front door: constructor, param groups,
load_state_dict, optimizer.state, the Offload policy. Each is refused with an error naming
what is wrong, or handled as torch does; nothing is half applied."""
from __future__ import annotations

import copy
import gc
import math
import os
import pickle

import pytest
import torch

import tierstate as ts


def mlp(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 3))


def step(model, opt, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    opt.zero_grad()
    model(torch.randn(4, 64, generator=gen)).pow(2).mean().backward()
    opt.step()


def snapshot(opt) -> dict:
    sd = opt.state_dict()
    return {"groups": copy.deepcopy(sd["param_groups"]),
            "state": {i: {k: v.clone() for k, v in st.items()} for i, st in sd["state"].items()}}


def assert_unchanged(opt, before: dict) -> None:
    after = snapshot(opt)
    assert after["groups"] == before["groups"]
    assert after["state"].keys() == before["state"].keys()
    for i, st in before["state"].items():
        assert after["state"][i].keys() == st.keys()
        for k, v in st.items():
            assert torch.equal(after["state"][i][k], v), (i, k)


def test_used_up_generator_is_refused_not_trained_on() -> None:
    m = mlp()
    params = m.parameters()
    list(params)  # e.g. counted by a logging line first
    with pytest.raises(ValueError, match=r"AdamW got no trainable parameter.*used up"):
        ts.AdamW(params)


def test_load_state_dict_with_a_nan_step_applies_nothing(tmp_path) -> None:
    m = mlp()
    opt = ts.AdamW(m.parameters(), lr=1e-2, offload=ts.Offload(nvme=1.0, nvme_dir=tmp_path, subgroup_numel=1024))
    step(m, opt)
    before = snapshot(opt)
    bad = opt.state_dict()
    bad = {"param_groups": copy.deepcopy(bad["param_groups"]),
           "state": {i: {k: v.clone() for k, v in st.items()} for i, st in bad["state"].items()}}
    bad["param_groups"][0]["lr"] = 0.5
    bad["state"][0]["exp_avg"].fill_(7.0)
    bad["state"][2]["step"] = torch.tensor(math.nan)
    with pytest.raises(ValueError, match=r"'step' of parameter 2 is (tensor\()?nan"):
        opt.load_state_dict(bad)
    assert_unchanged(opt, before)
    opt.close()


def test_load_state_dict_with_integer_state_applies_nothing() -> None:
    m = mlp()
    opt = ts.SGD(m.parameters(), lr=1e-2, momentum=0.9)
    step(m, opt)
    before = snapshot(opt)
    bad = copy.deepcopy(opt.state_dict())
    bad["state"][1]["momentum_buffer"] = torch.ones(64, dtype=torch.int64)
    with pytest.raises(TypeError, match=r"momentum_buffer.*parameter 1.*torch.int64"):
        opt.load_state_dict(bad)
    assert_unchanged(opt, before)


def test_load_state_dict_with_other_group_count_applies_nothing() -> None:
    m = mlp()
    opt = ts.AdamW(m.parameters(), lr=1e-2)
    step(m, opt)
    before = snapshot(opt)
    other = ts.AdamW([{"params": [m[0].weight]}, {"params": [m[0].bias, m[2].weight, m[2].bias]}])
    with pytest.raises(ValueError, match=r"has 2 param group\(s\), this AdamW has 1"):
        opt.load_state_dict(other.state_dict())
    assert_unchanged(opt, before)


def test_torch_fused_checkpoint_loads_and_continues_like_torch() -> None:
    """A torch run with fused=True (its CPU fused kernel) migrates: the switch says how torch
    computed, so tierstate takes the state and runs its own kernels."""
    m_ref, m_ours = mlp(), mlp()
    ref = torch.optim.AdamW(m_ref.parameters(), lr=1e-2, fused=True)
    step(m_ref, ref, 0)
    m_ours.load_state_dict(m_ref.state_dict())
    ours = ts.AdamW(m_ours.parameters(), lr=1e-2)
    ours.load_state_dict(ref.state_dict())
    assert ours.param_groups[0]["fused"] is None and ours.param_groups[0]["foreach"] is None
    for s in (1, 2, 3):
        step(m_ref, ref, s)
        step(m_ours, ours, s)
    for a, b in zip(m_ours.parameters(), m_ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_load_state_dict_that_turns_on_amsgrad_places_the_new_key(tmp_path) -> None:
    """Saved hyper-parameters with another state key than the optimizer was built for."""
    m_ref, m_ours = mlp(), mlp()
    ref = torch.optim.Adam(m_ref.parameters(), lr=1e-2, amsgrad=True, foreach=False)
    step(m_ref, ref, 0)
    ours = ts.Adam(m_ours.parameters(), lr=1e-2, offload=ts.Offload(nvme=0.5, nvme_dir=tmp_path,
                                                                   subgroup_numel=1024))
    m_ours.load_state_dict(m_ref.state_dict())
    ours.load_state_dict(ref.state_dict())
    for s in (1, 2):
        step(m_ref, ref, s)
        step(m_ours, ours, s)
    for i, p in enumerate(m_ref.parameters()):
        q = list(m_ours.parameters())[i]
        torch.testing.assert_close(ours.state[q]["max_exp_avg_sq"], ref.state[p]["max_exp_avg_sq"],
                                   rtol=1e-5, atol=1e-6)
    ours.close()


def test_parameter_in_two_groups_via_add_param_group_changes_nothing() -> None:
    m = mlp()
    opt = ts.AdamW([m[0].weight, m[0].bias], lr=1e-2)
    step(m, opt)
    before = snapshot(opt)
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['params'\]\[1\] is the same tensor as "
                                         r"param_groups\[0\]\['params'\]\[1\]"):
        opt.add_param_group({"params": [m[2].weight, m[0].bias]})
    assert len(opt.param_groups) == 1
    assert_unchanged(opt, before)
    step(m, opt, 1)  # still trains


def test_lazy_state_read_of_a_truncated_nvme_file_names_the_file(tmp_path) -> None:
    m = mlp()
    opt = ts.AdamW(m.parameters(), lr=1e-2, offload=ts.Offload(nvme=1.0, nvme_dir=tmp_path, subgroup_numel=1024,
                                                               buffer_count=2))
    step(m, opt)
    opt.state_dict()  # every record through the pool once: none is waiting to be written back
    files = list(tmp_path.rglob("*.bin"))
    assert files
    for f in files:
        os.truncate(f, 0)
    with pytest.raises(ts.StateLostError, match=r"state-[^ ]*0\.bin.*shrank") as info:
        opt.state[m[0].weight]["exp_avg"]
    assert info.value.filename == str(files[0]) or info.value.filename in {str(f) for f in files}
    opt.close()


def test_optimizer_state_outlives_nothing_and_pickles_as_a_dict(tmp_path) -> None:
    m = mlp()
    opt = ts.AdamW(m.parameters(), offload=ts.Offload(nvme=1.0, nvme_dir=tmp_path, subgroup_numel=1024))
    step(m, opt)
    st = opt.state[m[0].weight]
    assert type(pickle.loads(pickle.dumps(st))) is dict
    assert type(copy.deepcopy(st)) is dict and set(copy.deepcopy(st)) == {"step"}
    opt.close()
    del opt
    gc.collect()
    with pytest.raises(KeyError):  # the optimizer is gone: nothing to read, no crash
        st["exp_avg"]
    assert st.get("exp_avg") is None


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, torch.tensor(math.inf), torch.tensor([1e-3, 1e-3])])
def test_non_finite_or_non_scalar_tensor_lr_in_a_group(value) -> None:
    m = mlp()
    with pytest.raises(ValueError, match=r"lr"):
        ts.SGD([{"params": m[0].parameters()}, {"params": m[2].parameters(), "lr": value}], lr=0.1)


def test_nvme_dir_that_is_a_file(tmp_path) -> None:
    f = tmp_path / "not-a-folder"
    f.write_text("x")
    with pytest.raises(OSError, match=r"not-a-folder"):
        ts.AdamW(mlp().parameters(), offload="nvme", nvme_dir=f)


def test_offload_fraction_of_wrong_type() -> None:
    with pytest.raises(ValueError, match=r"Offload\(nvme='0.5'\)"):
        ts.Offload(nvme="0.5")
    with pytest.raises(ValueError, match=r"Offload\(gpu=True\)"):
        ts.Offload(gpu=True)
    with pytest.raises(ValueError, match=r"Offload\(nvme=nan\)"):
        ts.Offload(nvme=math.nan)


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(pin_memory="no"), r"Offload\(pin_memory='no'\): must be True or False"),
    (dict(keep_device_grads=1), r"Offload\(keep_device_grads=1\)"),
    (dict(grad_streaming="auto"), r"Offload\(grad_streaming='auto'\).*or None"),
    (dict(nvme_dir=5), r"Offload\(nvme_dir=5\): expected a folder"),
    (dict(nvme_dir=["/tmp/a", None]), r"entry 1 is None.*must be a folder path"),
])
def test_offload_switch_of_wrong_type(kwargs, pattern) -> None:
    """A truthy string would have switched pinning on, an int folder failed deep in the I/O layer."""
    with pytest.raises(TypeError, match=pattern):
        ts.Offload(**kwargs)
