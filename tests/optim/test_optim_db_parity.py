"""torch's own optimizer test inputs, run against tierstate.

``torch.testing._internal.common_optimizers.optim_db`` lists, per torch optimizer, the
keyword arguments torch's test suite exercises it with (``optim_inputs_func``) and the
inputs it must refuse (``optim_error_inputs_func``). For Adam, AdamW, SGD and Adagrad:

- every input tierstate supports trains 8 steps on the two-group model of
  ``test_parity.py`` (a frozen parameter, a zero-size one, a step where half the
  parameters get no gradient, a second group with its own lr) and must match
  ``torch.optim`` (single-tensor path) in every parameter and every state key, at that
  file's tolerance, with the state in RAM and on NVMe, and end with the same param groups;
- every input it does not support (torch's implementation switches such as
  ``capturable=True``, listed for CUDA) is refused with a ValueError naming the argument;
- every input torch refuses (or warns about) is refused (or warned about) by tierstate
  with the same exception (or warning) type and a message torch's own regex matches.
"""
from __future__ import annotations

import copy

import pytest
import torch

import tierstate as ts
from test_parity import assert_same, groups, make_net, train
from test_torch_compat import same_groups

pytest.importorskip("expecttest", reason="torch's optim_db imports it: pip install 'tierstate[test]'")
from torch.testing._internal.common_optimizers import OptimizerErrorEnum, optim_db  # noqa: E402

PAIRS = {"Adam": ts.Adam, "AdamW": ts.AdamW, "SGD": ts.SGD, "Adagrad": ts.Adagrad}
UNSUPPORTED = {"capturable": True, "differentiable": True}  # (foreach/fused=True are taken: they pick torch's path)


def _infos():
    return [info for info in optim_db if info.optim_cls.__name__ in PAIRS]


def _inputs():
    out = []
    for info in _infos():
        name = info.optim_cls.__name__
        seen = set()
        # the CUDA list is the CPU one plus the inputs of torch's CUDA-only switches (capturable)
        for device in ("cpu", "cuda"):
            for oi in info.optim_inputs_func(device=device, dtype=torch.float32):
                key = (oi.desc, repr(sorted(oi.kwargs.items())))
                if key in seen:
                    continue
                seen.add(key)
                out.append(pytest.param(info.optim_cls, oi.kwargs, id=f"{name}-{oi.desc.replace(' ', '_')}"))
    return out


def _unsupported(kwargs: dict) -> list[str]:
    return [k for k, v in kwargs.items() if k in UNSUPPORTED and v is UNSUPPORTED[k]]


def test_optim_db_lists_the_inputs_this_file_expects() -> None:
    """The comparison below must not pass by running nothing."""
    assert {info.optim_cls.__name__ for info in _infos()} == set(PAIRS)
    assert len(_inputs()) >= 30


@pytest.mark.parametrize("placement", ["cpu", "nvme"])
@pytest.mark.parametrize("torch_cls, kwargs", _inputs())
def test_torch_optim_input_matches_torch(tmp_path, torch_cls, kwargs, placement) -> None:
    ts_cls = PAIRS[torch_cls.__name__]
    offload = "cpu" if placement == "cpu" else ts.Offload(nvme=1.0, nvme_dir=tmp_path, subgroup_numel=1024,
                                                           buffer_count=2)
    bad = _unsupported(kwargs)
    if bad:
        with pytest.raises(ValueError, match=rf"{ts_cls.__name__}\({bad[0]}=True\): "):
            ts_cls(groups(make_net()), offload=offload, **kwargs)
        return
    second = dict(lr=2e-2)
    net_ours, net_ref = make_net(), make_net()
    ours = ts_cls(groups(net_ours, **second), offload=offload, **kwargs)
    ref = torch_cls(groups(net_ref, **second), **{**kwargs, "foreach": False})
    train(net_ours, ours, steps=8)
    train(net_ref, ref, steps=8)
    assert_same(ours, ref, net_ours, net_ref, exact=False)
    assert same_groups(ours.state_dict()["param_groups"], ref.state_dict()["param_groups"])
    ours.close()


def _error_inputs():
    out = []
    for info in _infos():
        for i, e in enumerate(info.optim_error_inputs_func(device="cpu", dtype=torch.float32)):
            out.append(pytest.param(info.optim_cls, e, id=f"{info.optim_cls.__name__}-{i}"))
    return out


def test_optim_db_lists_the_error_inputs_this_file_expects() -> None:
    """The refusals below must not pass by running nothing."""
    assert len(_error_inputs()) >= 38


@pytest.mark.parametrize("torch_cls, error_input", _error_inputs())
def test_torch_refused_input_is_refused_in_torchs_words(torch_cls, error_input) -> None:
    """torch's own ``test_errors``, run on tierstate's optimizer of the same name as torch runs it
    on its own: the input's ``params`` as given (None where the hyper-parameters alone must be
    refused, before any parameter is read), its exception or warning type and torch's regex.
    A duplicate tensor in one group is only warned about, by torch and by tierstate
    (``test_param_groups.py`` has what tierstate then does with it)."""
    inp = error_input.optimizer_error_input
    expect = pytest.warns if issubclass(error_input.error_type, Warning) else pytest.raises
    for cls in (torch_cls, PAIRS[torch_cls.__name__]):
        if error_input.error_on is OptimizerErrorEnum.CONSTRUCTION_ERROR:
            with expect(error_input.error_type, match=error_input.error_regex):
                cls(inp.params, **inp.kwargs)
        else:
            opt = cls(inp.params, **inp.kwargs)
            with expect(error_input.error_type, match=error_input.error_regex):
                opt.step()


# the keys torch's own test_can_load_older_state_dict deletes from a saved state dict's groups:
# older releases did not save them, and torch's optimizers give such a group its defaults
NEW_FLAGS = ("maximize", "foreach", "fused", "differentiable", "capturable")


@pytest.mark.parametrize("placement", ["cpu", "nvme"])
@pytest.mark.parametrize("torch_cls, kwargs", _inputs())
def test_older_state_dict_without_the_newer_flags_loads_as_in_torch(tmp_path, torch_cls, kwargs, placement) -> None:
    """A state dict saved without ``maximize`` and torch's implementation switches loads, and
    the group gets what torch's ``__setstate__`` gives it (``maximize=False`` whatever the
    optimizer was built with); training then goes on as torch's does."""
    if _unsupported(kwargs):
        return  # refused at construction (test_torch_optim_input_matches_torch)
    ts_cls = PAIRS[torch_cls.__name__]
    offload = "cpu" if placement == "cpu" else ts.Offload(nvme=1.0, nvme_dir=tmp_path, subgroup_numel=1024,
                                                           buffer_count=2)
    net_ours, net_ref = make_net(), make_net()
    ours = ts_cls(groups(net_ours), offload=offload, **kwargs)
    ref = torch_cls(groups(net_ref), **{**kwargs, "foreach": False})
    train(net_ours, ours, steps=3)
    train(net_ref, ref, steps=3)
    for opt in (ours, ref):
        old = copy.deepcopy(opt.state_dict())
        for group in old["param_groups"]:
            for flag in NEW_FLAGS:
                group.pop(flag, None)
        opt.load_state_dict(old)
    assert [g.get("maximize") for g in ours.param_groups] == [g.get("maximize") for g in ref.param_groups]
    train(net_ours, ours, steps=5, seed=2)
    train(net_ref, ref, steps=5, seed=2)
    assert_same(ours, ref, net_ours, net_ref, exact=False)
    ours.close()


@pytest.mark.parametrize("torch_cls, kwargs", _inputs())
def test_deepcopy_copies_all_public_attrs(torch_cls, kwargs) -> None:
    """torch's test of the same name, on every supported optim_db input."""
    if _unsupported(kwargs):
        return
    params = [torch.nn.Parameter(torch.randn(2, 3)) for _ in range(2)]
    for p in params:
        p.grad = torch.rand_like(p)
    opt = PAIRS[torch_cls.__name__](params, offload="cpu", **kwargs)
    for _ in range(3):
        opt.step()

    def public(obj):
        return {k for k in obj.__dict__ if not k.startswith("_")}

    twin = copy.deepcopy(opt)
    assert public(twin) == public(opt)
    opt.close()
    twin.close()
