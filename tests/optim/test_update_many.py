"""A sub-group of many parameters is updated in one native call (HostExecutor.update_many),
bit for bit as one ``adam_update`` per parameter.

The reference run forces the one-by-one path (``kernels.adam_update_many`` declines, as the
pure-torch reference does); the batched run must be taken (a spy counts the calls) and end
with the same parameters and the same state, every key, after 8 steps: two groups (amsgrad
in one, Adam's L2 decay in the other), a parameter that gets no gradient every other step
(so steps differ within a sub-group), fp32 and bf16 parameters (a master and the rounded
weight), state in RAM and on NVMe.
"""
from __future__ import annotations

import pytest
import torch

import tierstate as ts
import tierstate.kernels as K
from test_step_in_backward import assert_same_state
from tierstate.kernels import reference

pytestmark = pytest.mark.skipif(K.current_isa() == "reference", reason="needs the native kernels")


def _model(dtype: torch.dtype) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    sizes = [3, 64, 4095, 4096, 4097, 1, 300, 8192, 77, 5000] * 3
    return [torch.nn.Parameter(torch.randn(n, generator=g).to(dtype)) for n in sizes]


def _train(params, offload, steps: int = 8) -> ts.AdamW:
    groups = [{"params": params[:15], "amsgrad": True},
              {"params": params[15:], "lr": 3e-2, "weight_decay": 0.0, "betas": (0.8, 0.95)}]
    opt = ts.AdamW(groups, lr=1e-2, weight_decay=0.1, offload=offload)
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        for i, p in enumerate(params):
            grad = torch.randn(p.shape, generator=g).to(p.dtype)
            p.grad = None if (i == 7 and step % 2) else grad  # parameter 7 lags a step behind
        opt.step()
    return opt


def _count_native_calls(monkeypatch) -> dict:
    """{"many": calls of kernels.adam_update_many, "one": of kernels.adam_update}, counted from now."""
    calls = {"many": 0, "one": 0}
    many, one = K.adam_update_many, K.adam_update

    def count_many(jobs, params):
        calls["many"] += 1
        return many(jobs, params)

    def count_one(*a, **k):
        calls["one"] += 1
        return one(*a, **k)

    monkeypatch.setattr(K, "adam_update_many", count_many)
    monkeypatch.setattr(K, "adam_update", count_one)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("place", ["cpu", "nvme"])
def test_batched_updates_are_the_one_by_one_updates(dtype, place, tmp_path, monkeypatch):
    def offload(sub):
        if place == "cpu":
            return ts.Offload(cpu=1.0)
        return ts.Offload(nvme=1.0, nvme_dir=tmp_path / sub, subgroup_numel=16384, buffer_count=2)

    calls = _count_native_calls(monkeypatch)
    batched_params = _model(dtype)
    batched = _train(batched_params, offload("a"))
    batched_one = calls["one"]  # a sub-group of one segment goes alone
    assert calls["many"] >= 8, calls

    monkeypatch.setattr(K, "adam_update_many", reference.adam_update_many)  # declines: one by one
    calls["one"] = 0
    single_params = _model(dtype)
    single = _train(single_params, offload("b"))
    assert calls["one"] >= 8 * 29 and batched_one * 3 < calls["one"], (batched_one, calls)

    for i, (a, b) in enumerate(zip(batched_params, single_params)):
        assert torch.equal(a, b), f"parameter {i}"
    assert_same_state(batched, single)
    state = batched.state_dict()["state"]
    assert state[7]["step"] == 4 and state[0]["step"] == 8
    batched.close()
    single.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_host_step_over_many_subgroups_is_one_native_call(dtype, monkeypatch):
    """With every sub-group in host memory the step hands them all to one native call (between
    two calls the loop's Python ran with the caches the update had emptied): 8 steps, 8 calls,
    no parameter left to ``adam_update``, and the one-by-one result bit for bit."""
    layout = ts.Offload(cpu=1.0, subgroup_numel=16384)  # the 30 parameters (64 K elements) in 5+ sub-groups
    calls = _count_native_calls(monkeypatch)
    batched_params = _model(dtype)
    batched = _train(batched_params, layout)
    assert len(batched.layout.subgroups) >= 5
    assert calls == {"many": 8, "one": 0}, calls

    monkeypatch.setattr(K, "adam_update_many", reference.adam_update_many)  # declines: one by one
    single_params = _model(dtype)
    single = _train(single_params, layout)
    for i, (a, b) in enumerate(zip(batched_params, single_params)):
        assert torch.equal(a, b), f"parameter {i}"
    assert_same_state(batched, single)
    batched.close()
    single.close()
