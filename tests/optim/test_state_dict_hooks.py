"""The state-dict hooks of ``torch.optim.Optimizer``, as torch's own tests use them
(test_optim.py: test_state_dict_pre_hook, ..._post_hook, ..._pre_post_hook,
test_load_state_dict_pre_hook_and_prepend, ..._post_hook, ..._pre_post_hook): a
``state_dict`` pre-hook sees the optimizer before the dict is made and may add entries to
``optimizer.state``; a post-hook sees (and may replace) the finished dict; a
``load_state_dict`` pre-hook may change or replace the dict before it is read; a post-hook
runs once everything is loaded and may write to ``optimizer.state``."""
from __future__ import annotations

import copy

import pytest
import torch

import tierstate as ts

CLASSES = [ts.AdamW, ts.SGD, ts.Adagrad, ts.Lion]


def _pre(opt):
    opt.state["test"] = 1


def _post(opt, sd):
    if "test" in sd["state"]:
        sd["state"].pop("test")
        sd["ran_state_dict_pre_hook"] = True
    else:
        sd["ran_state_dict_pre_hook"] = False
    return sd


def _load_pre1(opt, sd):
    sd["param_groups"][0]["lr"] = 0.002


def _load_pre2(opt, sd):
    mine = copy.deepcopy(sd)
    mine["param_groups"][0]["lr"] = 0.003
    return mine


def _load_post(opt):
    opt.state["ran_load_state_dict_pre_hook2"] = opt.param_groups[0]["lr"] == 0.003
    opt.state["ran_load_state_dict_post_hook"] = True


@pytest.fixture(params=["cpu", "nvme"])
def make(request, tmp_path):
    made = []

    def build(cls):
        offload = "cpu" if request.param == "cpu" else ts.Offload(nvme=1.0, nvme_dir=tmp_path / str(len(made)))
        p = torch.nn.Parameter(torch.rand(2, 3))
        opt = cls([p], lr=0.01, offload=offload)
        p.grad = torch.rand(2, 3)
        opt.step()
        made.append(opt)
        return opt

    yield build
    for opt in made:
        opt.close()


@pytest.mark.parametrize("cls", CLASSES)
def test_state_dict_pre_hook(make, cls):
    opt = make(cls)
    opt.register_state_dict_pre_hook(_pre)
    sd = opt.state_dict()
    assert sd["state"]["test"] == 1
    if cls in (ts.AdamW, ts.Adagrad):  # the parameters' state is there beside it
        assert torch.is_tensor(sd["state"][0]["step"])


@pytest.mark.parametrize("cls", CLASSES)
def test_state_dict_post_hook(make, cls):
    opt = make(cls)
    opt.register_state_dict_post_hook(_post)
    assert opt.state_dict()["ran_state_dict_pre_hook"] is False


@pytest.mark.parametrize("cls", CLASSES)
def test_state_dict_pre_post_hook(make, cls):
    opt = make(cls)
    opt.register_state_dict_pre_hook(_pre)
    opt.register_state_dict_post_hook(_post)
    sd = opt.state_dict()
    assert "test" not in sd["state"] and sd["ran_state_dict_pre_hook"] is True


def _loaded(make, cls, pre=(), post=()):
    """A second optimizer of ``cls`` with these load hooks, after loading the first's state dict."""
    sd = make(cls).state_dict()
    opt = make(cls)
    for hook in pre:
        opt.register_load_state_dict_pre_hook(hook)
    for hook in post:
        opt.register_load_state_dict_post_hook(hook)
    opt.load_state_dict(sd)
    return opt, sd


@pytest.mark.parametrize("cls", CLASSES)
def test_load_state_dict_pre_hook_and_prepend(make, cls):
    opt, sd = _loaded(make, cls, pre=[_load_pre1])
    assert opt.param_groups[0]["lr"] == 0.002
    opt.register_load_state_dict_pre_hook(_load_pre2, prepend=True)
    opt.load_state_dict(sd)
    # _load_pre2 runs first and returns a new dict with lr 0.003, which _load_pre1 sets to 0.002
    assert opt.param_groups[0]["lr"] == 0.002


@pytest.mark.parametrize("cls", CLASSES)
def test_load_state_dict_post_hook(make, cls):
    opt, _ = _loaded(make, cls, post=[_load_post])
    assert opt.state["ran_load_state_dict_pre_hook2"] is False
    assert opt.state["ran_load_state_dict_post_hook"] is True


@pytest.mark.parametrize("cls", CLASSES)
def test_load_state_dict_pre_post_hook(make, cls):
    opt, _ = _loaded(make, cls, pre=[_load_pre2], post=[_load_post])
    assert opt.state["ran_load_state_dict_pre_hook2"] is True
    assert opt.state["ran_load_state_dict_post_hook"] is True
    assert opt.param_groups[0]["lr"] == 0.003


@pytest.mark.parametrize("cls", CLASSES)
def test_entries_that_are_not_parameters_travel_with_the_state_dict(make, cls):
    """torch keeps a key of ``optimizer.state`` that is not a parameter in the dict, and a
    load puts it back."""
    opt = make(cls)
    opt.state["note"] = {"epoch": 3}
    sd = opt.state_dict()
    assert sd["state"]["note"] == {"epoch": 3}
    opt2 = make(cls)
    opt2.load_state_dict(sd)
    assert opt2.state["note"] == {"epoch": 3}
    p = opt2.param_groups[0]["params"][0]
    p.grad = torch.rand(2, 3)
    opt2.step()  # and the optimizer still steps with it there
