"""Compressed state through the other ways in and the refusals: the update during backward
equals the step after it, and what the 8-bit kernels do not run is refused with the fix."""
from __future__ import annotations

import pytest
import torch

import tierstate as ts


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(300, 64), torch.nn.GELU(), torch.nn.Linear(64, 5)).bfloat16()


@pytest.mark.parametrize("master", [torch.float32, "bf16_kahan", "bf16_sr"])
def test_step_in_backward_equals_step_after_backward(master, tmp_path):
    runs = []
    for in_backward in (False, True):
        model = _model()
        opt = ts.AdamW(model.parameters(), lr=1e-2, step_in_backward=in_backward, offload=ts.Offload(
            cpu=0.5, nvme=0.5, nvme_dir=str(tmp_path / str(in_backward)), moment_dtype="q8", master_dtype=master,
            subgroup_numel=4096))
        gen = torch.Generator().manual_seed(1)
        for _ in range(4):
            x = torch.randn(8, 300, generator=gen).bfloat16()
            model(x).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        runs.append(([p.detach().clone() for p in model.parameters()], opt.state_dict()))
        opt.close()
    (pa, sa), (pb, sb) = runs
    for a, b in zip(pa, pb):
        assert torch.equal(a, b)
    for i in sa["state"]:
        for k, v in sa["state"][i].items():
            assert torch.equal(v, sb["state"][i][k]), (i, k)


@pytest.mark.parametrize("make, match", [
    (lambda p: ts.Lion(p, lr=1e-3, offload=ts.Offload(moment_dtype="q8")), r"with Lion.*ts.AdamW / ts.Adam"),
    (lambda p: ts.SGD(p, lr=1e-3, momentum=0.9, offload=ts.Offload(moment_dtype="q8")), r"with SGD"),
    (lambda p: ts.AdamW(p, lr=1e-3, amsgrad=True, offload=ts.Offload(moment_dtype="q8")), r"amsgrad=True"),
])
def test_what_the_8bit_kernels_do_not_run_is_refused(make, match):
    with pytest.raises(ValueError, match=match):
        make(_model().parameters())


def test_amsgrad_turned_on_later_is_refused_at_the_step():
    model = _model()
    opt = ts.AdamW(model.parameters(), lr=1e-3, offload=ts.Offload(moment_dtype="q8"))
    opt.param_groups[0]["amsgrad"] = True
    model(torch.randn(2, 300).bfloat16()).float().sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"param_groups\[0\] now asks for state 'max_exp_avg_sq'"):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert opt.state_dict()["state"] == {}
    opt.param_groups[0]["amsgrad"] = False  # set back: the step works
    opt.step()
    assert int(opt.state_dict()["state"][0]["step"]) == 1
    opt.close()
