"""torch's own optimizer tests that take the "global cliquey kwargs" (every input of
``optim_db`` also with ``foreach`` / ``fused`` / ``differentiable`` switched), restated for
tierstate's optimizers: ``test_complex``, ``test_complex_2d``, ``test_tensor_lr`` and
``test_rosenbrock_sparse`` of torch's test/test_optim.py, with the same assertions. Inputs torch
skips there are skipped here (``differentiable`` everywhere, ``fused`` for complex and sparse
gradients); torch's multi-tensor variant of the sparse test (its ``foreach=True`` inputs) puts
a float64 parameter beside the float32 one, as here.
"""
from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch

import tierstate as ts

pytest.importorskip("expecttest", reason="torch's optim_db imports it: pip install 'tierstate[test]'")
from torch.optim.lr_scheduler import ReduceLROnPlateau  # noqa: E402
from torch.testing._internal.common_optimizers import (  # noqa: E402
    _get_optim_inputs_including_global_cliquey_kwargs as cliquey_inputs, optim_db)

PAIRS = {"Adam": ts.Adam, "AdamW": ts.AdamW, "SGD": ts.SGD, "Adagrad": ts.Adagrad}
SPARSE = ("SGD", "Adagrad")  # torch's optimizers with supports_sparse, of those tierstate has


def _infos(names=PAIRS):
    return [pytest.param(info, id=info.optim_cls.__name__) for info in optim_db if info.optim_cls.__name__ in names]


def rosenbrock(t):
    x, y = t
    return (1 - x) ** 2 + 100 * (y - x**2) ** 2


def drosenbrock(t):
    x, y = t
    return torch.stack((-400 * x * (y - x**2) - 2 * (1 - x), 200 * (y - x**2)))


@pytest.mark.parametrize("info", _infos())
def test_complex(info) -> None:
    cls = PAIRS[info.optim_cls.__name__]
    for inp in cliquey_inputs("cpu", torch.complex64, info, skip=("differentiable", "fused")):
        torch.manual_seed(0)
        cplx = [torch.randn(10, 5, dtype=torch.complex64, requires_grad=True),
                torch.randn(10, dtype=torch.complex64, requires_grad=True),
                torch.randn(10, 5, requires_grad=True)]  # the last one real: the two mixed
        real = [(torch.view_as_real(p) if p.is_complex() else p).detach().clone().requires_grad_() for p in cplx]
        c_opt, r_opt = cls(cplx, **inp.kwargs), cls(real, **inp.kwargs)
        for _ in range(3):
            for p, q in zip(cplx, real):
                q.grad = torch.randn_like(q)
                p.grad = torch.view_as_complex(q.grad.clone()) if p.is_complex() else q.grad.clone()
            r_opt.step()
            c_opt.step()
            for p, q in zip(cplx, real):  # bit for bit, as torch's test asserts of torch
                assert torch.equal(torch.view_as_real(p) if p.is_complex() else p, q), inp.desc


@pytest.mark.parametrize("info", _infos())
def test_complex_2d(info) -> None:
    cls = PAIRS[info.optim_cls.__name__]
    for inp in cliquey_inputs("cpu", torch.complex64, info, skip=("differentiable", "fused")):
        torch.manual_seed(1)
        a1 = torch.randn(2, dtype=torch.complex64, requires_grad=True)
        re, im = a1.real.detach().clone().requires_grad_(), a1.imag.detach().clone().requires_grad_()
        opt1, opt2 = cls([a1], **inp.kwargs), cls([re, im], **inp.kwargs)
        for _ in range(3):
            opt1.zero_grad()
            rosenbrock(a1).abs().backward()
            opt2.zero_grad()
            rosenbrock(torch.complex(re, im)).abs().backward()
            torch.testing.assert_close(a1.grad.real, re.grad)
            opt1.step()
            opt2.step()
            torch.testing.assert_close(a1.real, re, msg=inp.desc)
            torch.testing.assert_close(a1.imag, im, msg=inp.desc)


@pytest.mark.parametrize("info", _infos())
def test_tensor_lr(info) -> None:
    cls = PAIRS[info.optim_cls.__name__]
    inputs = cliquey_inputs("cpu", torch.float32, info, skip=("differentiable",))
    assert any(i.kwargs.get("fused") for i in inputs)  # the switched inputs are there (on the CPU: fused)
    for inp in inputs:
        torch.manual_seed(2)
        w, b = torch.nn.Parameter(torch.randn(10, 5)), torch.nn.Parameter(torch.randn(10))
        wc, bc = w.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
        x = torch.randn(5)
        kwargs = {k: v for k, v in inp.kwargs.items() if k != "lr"}
        plain = cls([w, b], lr=1e-3, **kwargs)
        try:
            tensor_lr = cls([wc, bc], lr=torch.tensor(1e-3), **kwargs)
        except ValueError as e:  # torch's foreach path takes no tensor lr; neither input is run then
            assert "lr as a Tensor is not supported" in str(e)
            with pytest.raises(ValueError, match="lr as a Tensor is not supported"):
                info.optim_cls([torch.nn.Parameter(torch.randn(2))], lr=torch.tensor(1e-3), **kwargs)
            continue
        for _ in range(5):
            for opt, ww, bb in ((plain, w, b), (tensor_lr, wc, bc)):
                opt.zero_grad()
                (ww.mv(x) + bb).pow(2).sum().backward()
                opt.step()
            torch.testing.assert_close(w, wc, msg=inp.desc)
            torch.testing.assert_close(b, bc, msg=inp.desc)


@pytest.mark.parametrize("with_lrsched", [False, True])
@pytest.mark.parametrize("info", _infos(SPARSE))
def test_rosenbrock_sparse(info, with_lrsched) -> None:
    """Cyclic coordinate descent on Rosenbrock's function, the gradient given as an uncoalesced
    sparse tensor (duplicate indices), against the same optimizer on the dense gradient at
    torch's tolerance (5e-6), every step, for torch's 1,800 steps."""
    cls = PAIRS[info.optim_cls.__name__]
    inputs = cliquey_inputs("cpu", torch.float64, info, skip=("differentiable", "fused"))
    kwarg_updates, schedulers = info.metadata_for_sparse
    if with_lrsched and not schedulers:
        pytest.skip(f"torch gives {info.optim_cls.__name__} no scheduler for this test")
    supported, seen = [], set()
    for i in inputs:  # torch's selection of inputs
        if kwarg_updates:
            for k in kwarg_updates:
                i.kwargs.pop(k, None)
            key = tuple(sorted(i.kwargs.items()))
            if not i.kwargs or key in seen:
                continue
            seen.add(key)
            if "lr" in kwarg_updates:
                i.kwargs["lr"] = kwarg_updates["lr"]
        supported.append(i)
    assert supported

    def grad_of(param, sparse, w):
        grad = drosenbrock(param)
        if not sparse:
            return torch.tensor([grad[0], 0], dtype=param.dtype) if w else torch.tensor([0, grad[1]], dtype=param.dtype)
        if w:
            x = grad[0]
            values, rows = torch.tensor([x / 4.0, x - x / 4.0]), [[0, 0]]
        else:
            y = grad[1]
            values, rows = torch.tensor([y - y / 4.0, y / 4.0]), [[1, 1]]
        return torch.sparse_coo_tensor(torch.tensor(rows), values, (2,), dtype=values.dtype).to(dtype=param.dtype)

    def closure(opt, params, sparse, w):
        opt.zero_grad()
        loss = sum(rosenbrock(p) for p in params)
        loss.backward()
        with torch.no_grad():
            for p in params:
                p.grad = grad_of(p, sparse, w)
        return loss

    # torch runs its multi-tensor variant (a float64 parameter beside the float32 one) for the
    # foreach=True inputs, which its input list holds where the device has a foreach path; here
    # every input runs both ways
    variants = [(inp, multi) for inp in supported for multi in (False, True)]
    for inp, multi in variants:
        widths = (torch.float32, torch.float64) if multi or inp.kwargs.get("foreach", False) else (torch.float32,)
        runs = []
        for sparse in (True, False):
            params = [torch.nn.Parameter(torch.tensor([1.5, 1.5], dtype=d)) for d in widths]
            opt = cls(params, **inp.kwargs)
            runs.append((params, opt, [s(opt) for s in (schedulers if with_lrsched else [])], sparse))
        start = sum(float(torch.dist(p.detach(), torch.tensor([1.0, 1.0], dtype=p.dtype))) for p in runs[0][0])
        for step in range(1800):
            for params, opt, scheds, sparse in runs:
                opt.step(functools.partial(closure, opt, params, sparse, step % 2))
                for s in scheds:
                    s.step(rosenbrock(params[0])) if isinstance(s, ReduceLROnPlateau) else s.step()
            torch.testing.assert_close(runs[0][0], runs[1][0], atol=5e-6, rtol=5e-6, msg=inp.desc)
        params = [p.detach() for p in runs[0][0]]
        if not inp.kwargs.get("maximize", False):
            assert sum(float(torch.dist(p, torch.tensor([1.0, 1.0], dtype=p.dtype))) for p in params) <= start, inp.desc
        else:
            assert sum(float(rosenbrock(p)) for p in params) >= len(params) * float(
                rosenbrock(torch.tensor([1.5, 1.5]))), inp.desc


@pytest.mark.parametrize("info", _infos())
def test_param_groups_weight_decay_and_lr(info) -> None:
    """torch's test_param_groups_weight_decay and test_param_groups_lr: a group without weight
    decay beside one with it, and a group left at an outer lr of 1e-28 that must not move."""
    cls = PAIRS[info.optim_cls.__name__]
    for inp in cliquey_inputs("cpu", torch.float32, info, skip=("differentiable",)):
        torch.manual_seed(3)
        w, b, x = torch.nn.Parameter(torch.randn(10, 5)), torch.nn.Parameter(torch.randn(10)), torch.randn(5)
        opt = cls([dict(params=[w], **inp.kwargs), dict(params=[b], **{**inp.kwargs, "weight_decay": 0.0})])
        first = (w.mv(x) + b).pow(2).sum().item()
        for _ in range(20):
            opt.zero_grad()
            loss = (w.mv(x) + b).pow(2).sum()
            loss.backward()
            opt.step()
        assert (loss.item() > first) if inp.kwargs.get("maximize") else (loss.item() < first), inp.desc

        kwargs = dict(inp.kwargs)
        if not kwargs.get("lr"):
            kwargs["lr"] = 1e-3
        w, b, other = (torch.nn.Parameter(torch.randn(*s)) for s in ((10, 5), (10,), (2,)))
        before = other.detach().clone()
        opt = cls([dict(params=[w, b], **kwargs), dict(params=[other])], lr=1e-28)
        first = (w.mv(x) + b).pow(2).sum().item()
        for _ in range(20):
            opt.zero_grad()
            loss = (w.mv(x) + b).pow(2).sum()
            loss.backward()
            other.grad = torch.rand_like(other)
            opt.step()
        assert (loss.item() > first) if inp.kwargs.get("maximize") else (loss.item() < first), inp.desc
        torch.testing.assert_close(other.detach(), before)


@pytest.mark.parametrize("info", _infos())
def test_step_is_noop_without_grads_and_for_zero_grads(info) -> None:
    """torch's test_step_is_noop_when_params_have_no_grad (an optimizer over frozen tensors only:
    taken, and its step does nothing) and test_step_is_noop_for_zero_grads; and the optimizer
    prints (test_optimizer_can_be_printed). The differentiable=True inputs are refused by
    tierstate at construction (it updates in place under no_grad), so they are skipped here."""
    cls = PAIRS[info.optim_cls.__name__]
    for inp in cliquey_inputs("cpu", torch.float32, info, skip=("differentiable",)):
        frozen = [torch.randn(2, 3) for _ in range(2)]
        old = [p.clone() for p in frozen]
        with warnings.catch_warnings():  # plain tensors are torch's way of giving .grad by hand: no warning
            warnings.simplefilter("error", UserWarning)
            opt = cls(frozen, **inp.kwargs)
        opt.step(lambda: torch.tensor([1.0]))
        assert all(torch.equal(p, q) for p, q in zip(frozen, old))
        repr(opt)
        kwargs = dict(inp.kwargs)
        if kwargs.get("weight_decay", 0) != 0:
            continue  # the parameter decays without a gradient
        if info.optim_cls.__name__ == "AdamW":
            kwargs["lr"] = torch.tensor(1e-5) if isinstance(kwargs.get("lr", 1e-5), torch.Tensor) else 1e-5
        param = torch.randn((5, 1), requires_grad=True)
        before = param.detach().clone()
        opt = cls([param], **kwargs)
        param.grad = torch.zeros_like(param)
        opt.step(lambda: torch.tensor([1.0]))
        torch.testing.assert_close(param.detach(), before)


@pytest.mark.parametrize("impl", ["foreach", "fused"])
@pytest.mark.parametrize("info", _infos())
def test_derived_implementations_match_forloop_in_float64(info, impl) -> None:
    """torch's test_foreach_matches_forloop (float64 only) and test_fused_matches_forloop, as
    its _test_derived_optimizers runs them: a float64 MLP and an empty parameter, 7 steps, the
    third without a backward, the last layer frozen for the fourth and fifth; every parameter and
    state key of tierstate with the switch on, against tierstate with it off (torch's bar) and
    against torch's for-loop optimizer, bit for bit."""
    cls = PAIRS[info.optim_cls.__name__]
    for inp in cliquey_inputs("cpu", torch.float64, info, skip=("differentiable", "foreach", "fused")):
        models, optimizers = [], []
        for make, switch in ((cls, False), (cls, True), (info.optim_cls, False)):
            torch.manual_seed(1)
            model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Sigmoid(), torch.nn.Linear(3, 1),
                                        torch.nn.Sigmoid()).to(torch.float64)
            empty = torch.nn.Parameter(torch.empty(0, dtype=torch.float64))
            kwargs = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in inp.kwargs.items()}
            models.append(model)
            optimizers.append(make(list(model.parameters()) + [empty], **kwargs, **{impl: switch}))
        x = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], dtype=torch.float64).reshape(3, 2)
        for i in range(7):
            for model, opt in zip(models, optimizers):
                opt.zero_grad()
                if i == 3:
                    model[2].requires_grad_(False)
                if i == 5:
                    model[2].requires_grad_(True)
                if i != 2:
                    model(x).sum().backward()
                opt.step()
            theirs = optimizers[2]
            for ours in optimizers[:2]:
                for p, q in zip(ours.param_groups[0]["params"], theirs.param_groups[0]["params"]):
                    torch.testing.assert_close(p, q, rtol=0, atol=0, msg=f"{inp.desc}, step {i}")
                    for key, value in theirs.state[q].items():
                        torch.testing.assert_close(ours.state[p][key], value, rtol=0, atol=0,
                                                   msg=f"{inp.desc}, step {i}, {key}")
        for opt in optimizers[:2]:
            opt.close()


@pytest.mark.parametrize("default_dtype", [torch.float64, torch.float16])
@pytest.mark.parametrize("info", _infos())
def test_set_default_dtype_works_with_foreach(info, default_dtype) -> None:
    """torch's test_set_default_dtype_works_with_foreach: with the default dtype float64 (or
    float16), a float32 model trained 7 steps as _test_derived_optimizers trains it, with the
    foreach switch on, against torch's for-loop optimizer; ``step`` is a float64 tensor under a
    float64 default and float32 otherwise, as torch makes it (found 2026-12-07: always float32)."""
    cls = PAIRS[info.optim_cls.__name__]
    step_dtype = torch.float64 if default_dtype == torch.float64 else torch.float32
    old = torch.get_default_dtype()
    try:
        torch.set_default_dtype(default_dtype)
        for inp in cliquey_inputs("cpu", torch.float32, info, skip=("differentiable", "foreach", "fused")):
            models, optimizers = [], []
            for make, switch in ((cls, True), (info.optim_cls, False)):
                torch.manual_seed(1)
                model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Sigmoid(), torch.nn.Linear(3, 1),
                                            torch.nn.Sigmoid()).to(torch.float32)
                kwargs = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in inp.kwargs.items()}
                models.append(model)
                optimizers.append(make(model.parameters(), **kwargs, foreach=switch))
            x = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], dtype=torch.float32).reshape(3, 2)
            for i in range(7):
                for model, opt in zip(models, optimizers):
                    opt.zero_grad()
                    if i != 2:
                        model(x).sum().backward()
                    opt.step()
            ours, theirs = optimizers
            for p, q in zip(ours.param_groups[0]["params"], theirs.param_groups[0]["params"]):
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=inp.desc)
                for key, value in theirs.state[q].items():
                    torch.testing.assert_close(ours.state[p][key], value, rtol=1e-5, atol=1e-6, msg=f"{inp.desc} {key}")
                if "step" in theirs.state[q]:
                    assert theirs.state[q]["step"].dtype == step_dtype, "torch's own rule"
                    assert ours.state[p]["step"].dtype == step_dtype, inp.desc
                    assert ours.state_dict()["state"][0]["step"].dtype == step_dtype, inp.desc
            ours.close()
    finally:
        torch.set_default_dtype(old)


def _step_dtypes_through_a_life(make) -> list:
    """What ``state[p]["step"]`` is at each point of a life that changes the default dtype, uses
    ``fused``, and loads state dicts saved under another default (torch's rules: the dtype is
    fixed when the state starts, float32 under ``fused``; a loaded tensor keeps its dtype unless
    its saved group was fused; a loaded number becomes a tensor of the rule of the moment)."""
    seen = []

    def look(what, opt, p):
        step = opt.state[p]["step"]
        seen.append((what, type(step).__name__, getattr(step, "dtype", None), float(step),
                     opt.state_dict()["state"][0]["step"].dtype))

    p = torch.nn.Parameter(torch.randn(4, dtype=torch.float32))
    p.grad = torch.ones_like(p)
    torch.set_default_dtype(torch.float64)
    opt = make([p], fused=True)
    opt.step()
    look("fused, float64 default", opt, p)
    opt = make([p])
    opt.step()
    look("float64 default", opt, p)
    saved64 = copy.deepcopy(opt.state_dict())
    torch.set_default_dtype(torch.float32)
    look("the default back to float32", opt, p)
    opt.step()
    look("a step after that", opt, p)
    for fused in (False, True):
        other = make([p], fused=fused)
        other.load_state_dict(copy.deepcopy(saved64))
        look(f"float64 step loaded under float32, fused={fused}", other, p)
        other.step()
        look(f"... and a step, fused={fused}", other, p)
    fused_saved = make([p], fused=True)
    fused_saved.step()
    sd = copy.deepcopy(fused_saved.state_dict())
    sd["state"][0]["step"] = sd["state"][0]["step"].double()
    other = make([p])
    other.load_state_dict(sd)
    look("a float64 step saved by a fused optimizer", other, p)
    sd = copy.deepcopy(saved64)
    sd["state"][0]["step"] = 3
    torch.set_default_dtype(torch.float64)
    other = make([p])
    other.load_state_dict(sd)
    look("a number loaded under float64", other, p)
    return seen


@pytest.mark.parametrize("name", ["Adam", "AdamW", "Adagrad"])
def test_step_dtype_is_fixed_when_the_state_starts_and_kept_by_a_load_as_in_torch(name) -> None:
    """found 2026-12-07: tierstate made ``step`` anew by the default dtype of the moment it was
    looked at, and ignored ``fused`` (float32 in torch whatever the default)."""
    old = torch.get_default_dtype()
    try:
        theirs = _step_dtypes_through_a_life(getattr(torch.optim, name))
        ours = _step_dtypes_through_a_life(PAIRS[name])
    finally:
        torch.set_default_dtype(old)
    for a, b in zip(ours, theirs):
        assert a == b, f"{name}: {a[0]}: tierstate {a[1:]}, torch {b[1:]}"
    assert len(ours) == len(theirs) == 10
