"""Parameters and parameter groups in: what torch accepts trains the same, the rest is refused
by name, and a refused call leaves the optimizer as it was."""
from __future__ import annotations

import copy
import math

import pytest
import torch

import tierstate as ts

INF, NAN = math.inf, math.nan


def mlp(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def run(model, opt, steps: int = 3) -> None:
    gen = torch.Generator().manual_seed(7)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(6, 4, generator=gen)).pow(2).mean().backward()
        opt.step()


@pytest.mark.parametrize("ts_cls, torch_cls", [(ts.AdamW, torch.optim.AdamW), (ts.SGD, torch.optim.SGD),
                                               (ts.Adam, torch.optim.Adam), (ts.Adagrad, torch.optim.Adagrad)])
def test_param_groups_given_as_generators_train_like_torch(ts_cls, torch_cls) -> None:
    m_ours, m_ref = mlp(), mlp()
    ours = ts_cls([{"params": m_ours[0].parameters(), "weight_decay": 0.0}, {"params": m_ours[2].parameters()}],
                  lr=1e-2)
    ref = torch_cls([{"params": m_ref[0].parameters(), "weight_decay": 0.0}, {"params": m_ref[2].parameters()}],
                    lr=1e-2, foreach=False)
    assert [len(g["params"]) for g in ours.param_groups] == [2, 2]
    assert all(isinstance(g["params"], list) for g in ours.param_groups)
    run(m_ours, ours)
    run(m_ref, ref)
    for a, b in zip(m_ours.parameters(), m_ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert not torch.equal(m_ours[0].weight, mlp()[0].weight)  # it did train


def test_params_as_generator_and_tuple_and_named() -> None:
    m = mlp()
    assert len(ts.AdamW(p for p in m.parameters()).param_groups[0]["params"]) == 4
    assert len(ts.AdamW(tuple(m.parameters())).param_groups[0]["params"]) == 4
    opt = ts.AdamW(m.named_parameters())  # torch 2.6+: (name, tensor) pairs; names kept in the group
    assert opt.param_groups[0]["param_names"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    run(m, opt, 1)


def test_a_set_of_params_is_refused() -> None:
    m = mlp()
    with pytest.raises(TypeError, match=r"params is a set.*ordering.*list"):
        ts.AdamW(set(m.parameters()))
    with pytest.raises(TypeError, match=r"param_groups\[0\]\['params'\] is a set.*list"):
        ts.AdamW([{"params": set(m.parameters())}])


@pytest.mark.parametrize("params", [
    pytest.param(lambda m: [], id="empty-list"),
    pytest.param(lambda m: iter([]), id="empty-generator"),
    pytest.param(lambda m: [{"params": []}], id="one-empty-group"),
    pytest.param(lambda m: [{"params": iter(())}, {"params": []}], id="two-empty-groups"),
])
def test_no_parameter_is_refused(params) -> None:
    with pytest.raises(ValueError, match=r"got no (trainable )?parameter"):
        ts.AdamW(params(mlp()))


def test_frozen_parameters_are_taken() -> None:
    m = mlp()
    m[0].weight.requires_grad_(False)
    ts.AdamW(m.parameters())  # some trainable: fine (the frozen one may be unfrozen later)
    m.requires_grad_(False)
    with pytest.warns(UserWarning, match=r"step\(\) updates only those given a \.grad.*until some are unfrozen"):
        ts.AdamW(m.parameters())  # all frozen: taken, as torch takes them


def test_same_tensor_twice_in_a_group_is_warned_about_in_torchs_words_and_kept_once() -> None:
    """torch warns about a tensor given twice in one group ("in future, this will cause an
    error") and then updates it once per occurrence with one state; tierstate warns in torch's
    words, names both places, keeps the tensor once and updates it once per step: bit-identical
    to an optimizer given it once."""
    m, twin = mlp(), mlp()
    w, b = m[0].weight, m[0].bias
    with pytest.warns(UserWarning, match=r"a parameter group with duplicate parameters.*"
                                         r"param_groups\[0\]\['params'\]\[2\] is the same tensor as "
                                         r"param_groups\[0\]\['params'\]\[0\].*once per step"):
        ours = ts.AdamW([w, b, w, *m[2].parameters()], lr=1e-2)
    ref = ts.AdamW([twin[0].weight, twin[0].bias, *twin[2].parameters()], lr=1e-2)
    assert [id(p) for p in ours.param_groups[0]["params"]] == [id(w), id(b), *map(id, m[2].parameters())]
    run(m, ours)
    run(twin, ref)
    for p, q in zip(m.parameters(), twin.parameters()):
        assert torch.equal(p, q)
        assert ours.state[p]["step"] == ref.state[q]["step"] == 3
        assert all(torch.equal(ours.state[p][k], ref.state[q][k]) for k in ("exp_avg", "exp_avg_sq"))
    assert len(ours.state_dict()["param_groups"][0]["params"]) == 4
    # named parameters: the later (name, tensor) pair goes too
    with pytest.warns(UserWarning, match="a parameter group with duplicate parameters"):
        named = ts.AdamW([("w", w), ("b", b), ("w_again", w)], lr=1e-2)
    assert named.param_groups[0]["param_names"] == ["w", "b"]


def test_same_tensor_in_two_groups_is_refused_in_torchs_words_by_index() -> None:
    m = mlp()
    w = m[0].weight
    with pytest.raises(ValueError, match=r"some parameters appear in more than one parameter group: "
                                         r"param_groups\[1\]\['params'\]\[0\] is the same tensor as "
                                         r"param_groups\[0\]\['params'\]\[0\]"):
        ts.AdamW([{"params": [w]}, {"params": [w]}])
    opt = ts.AdamW([w])
    with pytest.raises(ValueError, match=r"some parameters appear in more than one parameter group: "
                                         r"param_groups\[1\]\['params'\]\[1\] is the same tensor as "
                                         r"param_groups\[0\]\['params'\]\[0\]"):
        opt.add_param_group({"params": [m[0].bias, w]})
    assert len(opt.param_groups) == 1
    with pytest.warns(UserWarning, match="a parameter group with duplicate parameters"):
        opt.add_param_group({"params": [m[0].bias, m[0].bias]})
    assert [len(g["params"]) for g in opt.param_groups] == [1, 1]
    run(m, opt, 1)


BAD_HYPER = [
    (ts.AdamW, "lr", INF), (ts.AdamW, "lr", NAN), (ts.AdamW, "lr", -1e-3), (ts.AdamW, "lr", "1e-3"),
    (ts.AdamW, "lr", torch.tensor([1e-3, 1e-3])), (ts.AdamW, "lr", True),
    (ts.AdamW, "weight_decay", INF), (ts.AdamW, "weight_decay", NAN), (ts.AdamW, "weight_decay", -0.1),
    (ts.AdamW, "eps", INF), (ts.AdamW, "eps", NAN), (ts.AdamW, "eps", -1e-8), (ts.AdamW, "eps", None),
    (ts.AdamW, "betas", (INF, 0.9)), (ts.AdamW, "betas", (0.9, NAN)), (ts.AdamW, "betas", (0.9,)),
    (ts.AdamW, "betas", (0.9, torch.tensor(0.99))), (ts.AdamW, "amsgrad", "yes"), (ts.AdamW, "maximize", 1),
    (ts.Adam, "lr", INF), (ts.Adam, "weight_decay", INF), (ts.Adam, "eps", -1.0),
    (ts.SGD, "lr", INF), (ts.SGD, "lr", NAN), (ts.SGD, "momentum", INF), (ts.SGD, "momentum", NAN),
    (ts.SGD, "momentum", -0.1), (ts.SGD, "dampening", INF),
    (ts.SGD, "dampening", NAN), (ts.SGD, "weight_decay", INF), (ts.SGD, "nesterov", "no"),
    (ts.Adagrad, "lr", INF), (ts.Adagrad, "lr_decay", INF), (ts.Adagrad, "lr_decay", NAN),
    (ts.Adagrad, "weight_decay", INF), (ts.Adagrad, "initial_accumulator_value", INF),
    (ts.Adagrad, "initial_accumulator_value", NAN), (ts.Adagrad, "eps", INF), (ts.Adagrad, "eps", -1.0),
    (ts.Lion, "lr", INF), (ts.Lion, "weight_decay", INF), (ts.Lion, "betas", (0.9, INF)),
]


@pytest.mark.parametrize("cls, name, value", BAD_HYPER, ids=[f"{c.__name__}-{n}-{v!r}" for c, n, v in BAD_HYPER])
def test_bad_hyper_parameter_is_refused_everywhere(cls, name, value) -> None:
    """At construction, in add_param_group and in load_state_dict, naming the argument; a
    refused add_param_group or load_state_dict leaves the optimizer bit-identical."""
    with pytest.raises((ValueError, TypeError), match=rf"{name.split('_')[0]}"):
        cls(mlp().parameters(), **{name: value})
    m = mlp()
    opt = cls([{"params": [m[0].weight, m[0].bias]}], lr=1e-2)
    run_first = [p for p in m.parameters() if p.requires_grad]
    m[2].requires_grad_(False)
    run(m, opt, 2)
    before_sd = copy.deepcopy(opt.state_dict())
    before_params = [p.detach().clone() for p in run_first]
    with pytest.raises((ValueError, TypeError), match=rf"{name.split('_')[0]}"):
        opt.add_param_group({"params": list(m[2].parameters()), name: value})
    assert len(opt.param_groups) == 1
    bad = copy.deepcopy(before_sd)
    bad["param_groups"][0][name] = value
    with pytest.raises((ValueError, TypeError), match=rf"{name.split('_')[0]}"):
        opt.load_state_dict(bad)
    after = opt.state_dict()
    assert after["param_groups"] == before_sd["param_groups"]
    assert after["state"].keys() == before_sd["state"].keys()
    for i, st in before_sd["state"].items():
        assert after["state"][i].keys() == st.keys()
        for k, v in st.items():
            assert torch.equal(after["state"][i][k], v), (i, k)
    assert all(torch.equal(a, b) for a, b in zip(run_first, before_params))


def test_refused_load_state_dict_with_a_bad_state_tensor_applies_nothing() -> None:
    m = mlp()
    opt = ts.AdamW(m.parameters(), lr=1e-2)
    run(m, opt, 2)
    before = copy.deepcopy(opt.state_dict())
    bad = copy.deepcopy(before)
    bad["param_groups"][0]["lr"] = 0.5  # valid, but must not be applied: the state below is refused
    bad["state"][0]["exp_avg"] = bad["state"][0]["exp_avg"] * 3  # valid, must not be applied either
    bad["state"][3]["exp_avg_sq"] = torch.zeros(7)
    with pytest.raises(ValueError, match=r"exp_avg_sq.*parameter 3"):
        opt.load_state_dict(bad)
    after = opt.state_dict()
    assert after["param_groups"][0]["lr"] == 1e-2
    for i, st in before["state"].items():
        for k, v in st.items():
            assert torch.equal(after["state"][i][k], v), (i, k)


def test_meta_device_parameters_are_refused_at_construction(tmp_path) -> None:
    p = torch.nn.Parameter(torch.empty(3, 3, device="meta"))
    with pytest.raises(ValueError, match=r"params\[0\] \(shape \(3, 3\)\) is on the meta device.*to_empty"):
        ts.AdamW([p])
    nv = tmp_path / "nv"
    with pytest.raises(ValueError, match=r"meta device"):
        ts.AdamW([torch.nn.Parameter(torch.empty(4, device="meta"))],
                 offload=ts.Offload(cpu=0.0, nvme=1.0, nvme_dir=nv))
    assert not nv.exists() or not any(nv.rglob("*.bin"))  # no file was allocated for it


FLAGS = [("capturable", True, r"capturable=True.*CUDA graph"), ("differentiable", True, r"differentiable=True.*no_grad")]
# torch's SGD and Adagrad have no capturable argument
FLAG_CASES = [(cls, *flag) for cls in (ts.AdamW, ts.Adam, ts.SGD, ts.Adagrad) for flag in FLAGS
              if not (flag[0] == "capturable" and cls in (ts.SGD, ts.Adagrad))]


@pytest.mark.parametrize("cls, kwarg, value, pattern", FLAG_CASES,
                         ids=[f"{c.__name__}-{k}" for c, k, _, _ in FLAG_CASES])
def test_torch_only_implementation_flags_are_refused_with_what_tierstate_does(cls, kwarg, value, pattern) -> None:
    with pytest.raises(ValueError, match=rf"{cls.__name__}\({pattern}"):
        cls(mlp().parameters(), **{kwarg: value})
    opt = cls(mlp().parameters())
    with pytest.raises(ValueError, match=pattern):
        opt.add_param_group({"params": list(mlp(1).parameters()), kwarg: value})


@pytest.mark.parametrize("cls", [ts.AdamW, ts.Adam, ts.SGD, ts.Adagrad])
@pytest.mark.parametrize("hint", ["foreach", "fused"])
def test_foreach_and_fused_are_taken_as_torch_takes_them(cls, hint) -> None:
    """Code written for torch passes foreach=True or fused=True (torch's CPU fused AdamW, HF's
    adamw_torch_fused): they choose how torch computes, not what, and tierstate always runs its
    own fused kernels, so either is taken, kept in param_groups, and trains as the default does."""
    m_hint, m_plain = mlp(), mlp()
    with_hint = cls(m_hint.parameters(), lr=1e-2, **{hint: True})
    plain = cls(m_plain.parameters(), lr=1e-2)
    assert with_hint.param_groups[0][hint] is True
    run(m_hint, with_hint, 3)
    run(m_plain, plain, 3)
    for a, b in zip(m_hint.parameters(), m_plain.parameters()):
        assert torch.equal(a, b)
    with_hint.add_param_group({"params": list(mlp(1).parameters()), hint: True})
    with pytest.raises(RuntimeError, match="`fused` and `foreach` cannot be `True` together"):
        cls(mlp().parameters(), foreach=True, fused=True)  # torch's refusal, in torch's words
    with pytest.raises(TypeError, match=rf"{hint}='yes'"):
        cls(mlp().parameters(), **{hint: "yes"})


@pytest.mark.parametrize("cls", [ts.AdamW, ts.Adam, ts.SGD, ts.Adagrad])
def test_torch_default_implementation_flags_are_accepted(cls) -> None:
    kw = dict(foreach=None, fused=None, differentiable=False)
    if cls in (ts.Adam, ts.AdamW):
        kw["capturable"] = False
    cls(mlp().parameters(), **kw)
    cls(mlp().parameters(), foreach=False, fused=False)


def test_adam_decoupled_weight_decay_is_adamw() -> None:
    """torch.optim.Adam(decoupled_weight_decay=True) is AdamW's math; so is tierstate's."""
    m_ours, m_ref = mlp(), mlp()
    ours = ts.Adam(m_ours.parameters(), lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True)
    ref = torch.optim.AdamW(m_ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    run(m_ours, ours, 4)
    run(m_ref, ref, 4)
    for a, b in zip(m_ours.parameters(), m_ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert ours.param_groups[0]["decoupled_weight_decay"] is True


@pytest.mark.parametrize("place", ["cpu", "nvme"])
@pytest.mark.parametrize("cls", [ts.AdamW, ts.SGD, ts.Adagrad])
def test_all_parameters_frozen_at_construction_then_unfrozen(tmp_path, cls, place) -> None:
    """torch takes an optimizer over frozen parameters only (progressive unfreezing builds it
    before the first unfreeze); tierstate did not (found 2026-12-07: "got no trainable
    parameter"). It now warns once, steps nothing, and once they are unfrozen trains as torch."""
    m_ours, m_ref = mlp(), mlp()
    for m in (m_ours, m_ref):
        m.requires_grad_(False)
    offload = "cpu" if place == "cpu" else ts.Offload(cpu=0.0, nvme=1.0, subgroup_numel=1024, buffer_count=2,
                                                      nvme_dir=tmp_path / "nv")
    kw = dict(lr=1e-2, momentum=0.9) if cls is ts.SGD else dict(lr=1e-2)
    with pytest.warns(UserWarning, match="all 4 parameters have requires_grad=False"):
        ours = cls(m_ours.parameters(), offload=offload, **kw)
    ref = getattr(torch.optim, cls.__name__)(m_ref.parameters(), foreach=False, **kw)
    ours.step()
    ref.step()
    for m in (m_ours, m_ref):
        m.requires_grad_(True)
    run(m_ours, ours, 4)
    run(m_ref, ref, 4)
    for a, b in zip(m_ours.parameters(), m_ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    ours.close()


ASSEMBLY_REFUSALS = {
    # groups whose refusal comes from placing the state (assembly), after the group's own checks
    "complex-into-q8": (lambda: ts.Offload(cpu=1.0, moment_dtype="q8"),
                        lambda: torch.nn.Parameter(torch.randn(300, dtype=torch.complex64)), r"complex"),
    "float64-into-nvme": (lambda tmp: ts.Offload(cpu=0.5, nvme=0.5, subgroup_numel=1024, nvme_dir=tmp / "nv"),
                          lambda: torch.nn.Parameter(torch.randn(300, dtype=torch.float64)), r"float64.*host RAM"),
}


@pytest.mark.parametrize("case", sorted(ASSEMBLY_REFUSALS))
def test_group_refused_by_the_placement_leaves_the_optimizer_as_it_was(case, tmp_path) -> None:
    """A group refused while the state is placed anew (found 2026-12-07: the group stayed in
    ``param_groups``, the state was dropped and the next step raised a KeyError)."""
    make_offload, make_param, pattern = ASSEMBLY_REFUSALS[case]
    offloads = [make_offload(tmp_path / d) if "nvme" in case else make_offload() for d in ("a", "b")]
    w = torch.nn.Parameter(torch.randn(3000))
    opt = ts.AdamW([w], lr=1e-2, offload=offloads[0])
    twin = torch.nn.Parameter(w.detach().clone())
    ref = ts.AdamW([twin], lr=1e-2, offload=offloads[1])
    for p, o in ((w, opt), (twin, ref)):
        for step in range(2):
            p.grad = torch.randn(3000, generator=torch.Generator().manual_seed(step))
            o.step()
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises((ValueError, TypeError), match=pattern):
        opt.add_param_group({"params": [make_param()]})
    assert len(opt.param_groups) == 1
    after = opt.state_dict()
    assert after["param_groups"] == before["param_groups"]
    for k, v in before["state"][0].items():
        assert torch.equal(after["state"][0][k], v), k
    for p, o in ((w, opt), (twin, ref)):  # and it trains on as the untouched twin does
        p.grad = torch.randn(3000, generator=torch.Generator().manual_seed(2))
        o.step()
    assert torch.equal(w, twin)
    opt.close()
    ref.close()


def test_unfrozen_parameter_refused_by_the_placement_leaves_the_optimizer_as_it_was() -> None:
    """A frozen parameter the state cannot hold, unfrozen later (a complex one under 8-bit
    state): each step refuses it before anything changes (found 2026-12-07: the state was
    dropped and every later step raised a KeyError), and frozen again it trains on."""
    offload = ts.Offload(cpu=1.0, moment_dtype="q8")
    w = torch.nn.Parameter(torch.randn(3000))
    c = torch.nn.Parameter(torch.randn(300, dtype=torch.complex64), requires_grad=False)
    opt = ts.AdamW([w, c], lr=1e-2, offload=offload)
    twin = torch.nn.Parameter(w.detach().clone())
    ref = ts.AdamW([twin], lr=1e-2, offload=offload)
    grads = [torch.randn(3000, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    for p, o in ((w, opt), (twin, ref)):
        p.grad = grads[0].clone()
        o.step()
    before = copy.deepcopy(opt.state_dict())
    c.requires_grad_(True)
    c.grad = torch.randn(300, dtype=torch.complex64)
    w.grad = grads[1].clone()
    for _ in range(2):
        with pytest.raises(ValueError, match=r"moment_dtype='q8'.*complex"):
            opt.step()
    after = opt.state_dict()
    assert torch.equal(w, twin) and set(after["state"]) == set(before["state"])
    for k, v in before["state"][0].items():
        assert torch.equal(after["state"][0][k], v), k
    c.requires_grad_(False)
    c.grad = None
    for p, o, g in ((w, opt, grads[1]), (twin, ref, grads[1])):
        p.grad = g.clone()
        o.step()
    assert torch.equal(w, twin)
    opt.close()
    ref.close()


def test_replaced_parameters_refused_by_the_placement_are_placed_again_once_put_back() -> None:
    """Parameters replaced in ``param_groups`` before the first step (as a wrapper does) by
    ones the tiers refuse: each step and state access raises the refusal, and once parameters
    that fit are back the optimizer trains as an untouched twin (found 2026-12-07: after the
    refusal the optimizer raised KeyError: TierKind.HOST forever)."""
    offload = ts.Offload(cpu=1.0, moment_dtype="q8")
    w = torch.nn.Parameter(torch.randn(3000))
    opt = ts.AdamW([w], lr=1e-2, offload=offload)
    twin = torch.nn.Parameter(w.detach().clone())
    ref = ts.AdamW([twin], lr=1e-2, offload=offload)
    c = torch.nn.Parameter(torch.randn(300, dtype=torch.complex64))
    opt.param_groups[0]["params"] = [c]
    c.grad = torch.randn(300, dtype=torch.complex64)
    for _ in range(2):
        with pytest.raises(ValueError, match=r"moment_dtype='q8'.*complex"):
            opt.step()
    with pytest.raises(ValueError, match=r"moment_dtype='q8'.*complex"):
        opt.state_dict()
    opt.zero_grad()
    opt.param_groups[0]["params"] = [w]
    for step in range(3):
        for p, o in ((w, opt), (twin, ref)):
            p.grad = torch.randn(3000, generator=torch.Generator().manual_seed(step))
            o.step()
    assert torch.equal(w, twin)
    for k, v in ref.state_dict()["state"][0].items():
        assert torch.equal(opt.state_dict()["state"][0][k], v), k
    opt.close()
    ref.close()
