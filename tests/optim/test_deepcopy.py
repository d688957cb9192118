"""``copy.deepcopy`` of an optimizer, as torch gives it: a new optimizer over copies of the
parameters (the same copies a deepcopy of the model in the same call makes), with the same
hyper-parameters, state and step counts, independent of the original from then on."""
from __future__ import annotations

import copy
import pickle

import pytest
import torch

import tierstate as ts
from test_parity import make_net, train


def _nvme(tmp_path, monkeypatch):
    monkeypatch.setenv("TIERSTATE_NVME_DIR", str(tmp_path))  # per-run folders under it
    return ts.Offload(nvme=1.0, subgroup_numel=1024, buffer_count=2)


@pytest.mark.parametrize("placement", ["cpu", "nvme", "nvme_bwd"])
def test_deepcopy_trains_as_the_original_and_apart_from_it(tmp_path, monkeypatch, placement) -> None:
    net = make_net()
    offload = "cpu" if placement == "cpu" else _nvme(tmp_path, monkeypatch)
    opt = ts.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1, amsgrad=True, offload=offload,
                   step_in_backward=placement.endswith("bwd"), max_grad_norm=1.0)
    train(net, opt, steps=3)
    net2, opt2 = copy.deepcopy((net, opt))
    assert type(opt2) is ts.AdamW and opt2.max_grad_norm == 1.0 and opt2.step_in_backward == opt.step_in_backward
    copied = list(net2.parameters())
    assert len(opt2.param_groups[0]["params"]) == len(copied)
    assert all(p is q for p, q in zip(opt2.param_groups[0]["params"], copied))
    assert not any(p is q for p, q in zip(net.parameters(), net2.parameters()))
    before = [p.detach().clone() for p in net.parameters()]
    sd = copy.deepcopy(opt.state_dict())
    train(net2, opt2, steps=4, seed=5)  # the copy trains; the original must not move
    assert all(torch.equal(p.detach(), b) for p, b in zip(net.parameters(), before))
    now = opt.state_dict()
    assert now["param_groups"] == sd["param_groups"] and now["state"].keys() == sd["state"].keys()
    for i, st in sd["state"].items():
        assert all(torch.equal(torch.as_tensor(v), torch.as_tensor(now["state"][i][k])) for k, v in st.items())
    train(net, opt, steps=4, seed=5)  # and the original, given the same batches, ends where the copy did
    for p, q in zip(net.parameters(), net2.parameters()):
        assert torch.equal(p.detach(), q.detach())
    for p, q in zip(net.parameters(), net2.parameters()):
        for key, value in opt.state.get(p, {}).items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(opt2.state[q][key])), key
    opt.close()
    opt2.close()


def test_deepcopy_with_a_named_nvme_dir_is_refused(tmp_path) -> None:
    net = make_net()
    opt = ts.AdamW(net.parameters(), offload=ts.Offload(nvme=1.0, nvme_dir=tmp_path / "run"))
    with pytest.raises(TypeError, match=r"nvme_dir.*its own folder.*load_state_dict"):
        copy.deepcopy(opt)
    opt.close()


def test_pickling_is_refused_with_the_fix() -> None:
    opt = ts.SGD(make_net().parameters(), lr=0.1, offload="cpu")
    with pytest.raises(TypeError, match=r"state_dict\(\)"):
        pickle.dumps(opt)
    opt.close()


def test_deepcopy_runs_no_state_dict_hook() -> None:
    """torch's deepcopy of an optimizer calls none of its hooks; nor does tierstate's."""
    opt = ts.SGD(make_net().parameters(), lr=0.1, momentum=0.9, offload="cpu")
    calls = []
    opt.register_state_dict_pre_hook(lambda o: calls.append("pre"))
    opt.register_state_dict_post_hook(lambda o, sd: calls.append("post"))
    twin = copy.deepcopy(opt)
    assert calls == []
    opt.close()
    twin.close()
