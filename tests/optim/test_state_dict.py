"""state_dict: torch's schema, exact resume, migration to and from torch.optim."""
from __future__ import annotations

import copy
import io

import pytest
import torch

import tierstate as ts
from test_parity import CASES, assert_same, make_net, torch_kwargs, train


def roundtrip(sd: dict) -> dict:
    """Through torch.save/torch.load, as a user's checkpoint would go."""
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("case", ["adamw", "adamw_amsgrad", "sgd_momentum", "adagrad", "lion"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_save_at_step_k_resume_is_bit_identical(case: str, dtype: torch.dtype) -> None:
    ts_cls, _, kw, _ = CASES[case]
    net = make_net(dtype=dtype)
    opt = ts_cls(net.parameters(), **kw)
    train(net, opt, steps=3, seed=1)
    sd = roundtrip(opt.state_dict())
    net_resumed = copy.deepcopy(net)
    opt_resumed = ts_cls(net_resumed.parameters(), **kw)
    opt_resumed.load_state_dict(sd)
    train(net, opt, steps=4, seed=2)
    train(net_resumed, opt_resumed, steps=4, seed=2)
    assert_same(opt_resumed, opt, net_resumed, net, exact=True)
    if dtype == torch.bfloat16:  # the master travels with the state dict, or resume would not be exact
        trainable = [i for i, p in enumerate(net.parameters()) if p.requires_grad]
        assert all("master" in sd["state"][i] for i in trainable)


def test_state_dict_uses_torch_schema_and_cpu_views() -> None:
    net = make_net()
    opt = ts.AdamW(net.parameters())
    train(net, opt, steps=2)
    sd = opt.state_dict()
    ref = torch.optim.AdamW(make_net().parameters())
    assert sd["param_groups"][0]["params"] == list(range(8))
    # parameters() lists the module's own (frozen, empty) before its children's: 2 is a.weight
    assert 0 not in sd["state"] and set(sd["state"][2]) == {"step", "exp_avg", "exp_avg_sq"}
    assert sd["state"][2]["step"].dtype == torch.float32 and sd["state"][2]["step"].device.type == "cpu"
    assert set(sd["param_groups"][0]) >= set(ref.state_dict()["param_groups"][0]) - {"foreach", "capturable", "differentiable", "fused", "decoupled_weight_decay"}
    # optimizer.state holds views into the host arenas: no device tensors and no copies
    arenas = opt.tiers[ts.placement.TierKind.HOST].arenas
    for st in opt.state.values():
        for key, value in st.items():
            assert value.device.type == "cpu"
            if key != "step":
                assert value.untyped_storage().data_ptr() == arenas[key].untyped_storage().data_ptr()


@pytest.mark.parametrize("case", ["adamw", "adam", "sgd_momentum", "adagrad"])
def test_migration_torch_to_tierstate_to_torch(case: str) -> None:
    ts_cls, torch_cls, kw, second = CASES[case]
    # torch for 3 steps, then tierstate for 3, then torch again for 2 ...
    net_mixed = make_net()
    t1 = torch_cls(net_mixed.parameters(), **torch_kwargs(torch_cls, kw))
    train(net_mixed, t1, steps=3, seed=1)
    mid = ts_cls(net_mixed.parameters(), **kw)
    mid.load_state_dict(roundtrip(t1.state_dict()))
    for st in mid.state.values():  # load never moves state anywhere but the host tier
        assert all(v.device.type == "cpu" for v in st.values())
    train(net_mixed, mid, steps=3, seed=2)
    t2 = torch_cls(net_mixed.parameters(), **torch_kwargs(torch_cls, kw))
    t2.load_state_dict(roundtrip(mid.state_dict()))
    train(net_mixed, t2, steps=2, seed=3)
    # ... equals torch all along
    net_ref = make_net()
    ref = torch_cls(net_ref.parameters(), **torch_kwargs(torch_cls, kw))
    for steps, seed in ((3, 1), (3, 2), (2, 3)):
        train(net_ref, ref, steps=steps, seed=seed)
    assert_same(t2, ref, net_mixed, net_ref, exact=False)


def test_load_rejects_mismatching_state() -> None:
    net = make_net()
    opt = ts.AdamW(net.parameters())
    train(net, opt, steps=1)
    sd = opt.state_dict()
    sd["state"][2]["exp_avg"] = torch.zeros(3)
    with pytest.raises(ValueError, match="exp_avg.*parameter 2"):
        ts.AdamW(make_net().parameters()).load_state_dict(sd)
    with pytest.raises(ValueError, match="param_groups"):
        ts.AdamW(make_net().parameters()).load_state_dict({"state": {}})
