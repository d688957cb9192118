"""Complex parameters, as torch's optimizers take them (torch's ``test_complex`` and
``test_complex_2d``): a complex64 parameter is stepped as its real view, and its state is
torch's: complex tensors shaped like the parameter.

* against torch's optimizer of the same name on the same complex parameters: every state key
  within the parity tolerance, 8 steps, RAM and NVMe, plain and in backward;
* against tierstate on the real views (``torch.view_as_real``) given as float32 parameters:
  bit for bit, as torch's own test requires of torch;
* state_dict both ways with torch, checkpoints, and the refusal of compressed state
  (complex128 is in test_float64_params.py).
"""
from __future__ import annotations

import pytest
import torch

import tierstate as ts
from tierstate.checkpoint import load_optimizer, save_optimizer

TOL = dict(rtol=1e-5, atol=1e-6)
STEPS = 8

CASES = {
    "adamw": (ts.AdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "adam-amsgrad-max": (ts.Adam, torch.optim.Adam, dict(lr=1e-2, amsgrad=True, maximize=True, weight_decay=0.05)),
    "sgd-nesterov": (ts.SGD, torch.optim.SGD, dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.1)),
    "sgd-damp": (ts.SGD, torch.optim.SGD, dict(lr=1e-2, momentum=0.5, dampening=0.3)),
    "adagrad": (ts.Adagrad, torch.optim.Adagrad, dict(lr=0.1, lr_decay=0.01, weight_decay=0.1,
                                                      initial_accumulator_value=0.1)),
}


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    # a 2-d complex weight, a 1-d complex bias and a real one beside them (torch's test_complex_2d)
    return [torch.nn.Parameter(torch.randn(5, 7, dtype=torch.complex64, generator=g)),
            torch.nn.Parameter(torch.randn(300, dtype=torch.complex64, generator=g)),
            torch.nn.Parameter(torch.randn(11, generator=g))]


def _grads(step, params):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, dtype=p.dtype, generator=g) for p in params]


def _train(params, opt, steps=STEPS, backward=False, first=0, without=None):
    """``steps`` steps on seeded gradients from step ``first``; ``without``: (step, index) of a
    parameter left without a gradient that step (torch skips it)."""
    for step in range(first, first + steps):
        grads = _grads(step, params)
        if without is not None and step == without[0] and len(params) > without[1]:
            grads[without[1]] = None
        if backward:  # through autograd, so the hooks (and step_in_backward) see them
            given = [(p, g) for p, g in zip(params, grads) if g is not None]
            torch.autograd.backward([p for p, _ in given], [g for _, g in given])
        else:
            for p, g in zip(params, grads):
                p.grad = g
        opt.step()
        opt.zero_grad()


def _offload(place, tmp_path):
    return "cpu" if place == "cpu" else ts.Offload(cpu=0.0, nvme=1.0, subgroup_numel=1024, buffer_count=2,
                                                   nvme_dir=tmp_path / "nv")


@pytest.mark.parametrize("place", ["cpu", "split", "device"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_complex_parameter_after_a_real_one_of_odd_size(tmp_path, case, place, monkeypatch):
    """A complex parameter whose real view started at an odd element of its sub-group: its host
    views could not be viewed as complex, so the step (the construction, for Adagrad) raised
    torch's "Tensor must have a storage_offset divisible by 2" publishing optimizer.state. On
    the device tier (``Offload(gpu=...)``, run here on CPU parameters) the gradient norm and the
    update read the complex tensors where their real views were meant: "linalg.vector_norm:
    dtype should be complex for complex inputs"."""
    ts_cls, torch_cls, kw = CASES[case]
    if place == "device":  # the device tier's own code, run on CPU parameters (see tierstate.Offload)
        monkeypatch.setenv("TIERSTATE_DEVICE_TIER_ON_CPU", "1")
    g = torch.Generator().manual_seed(3)
    shapes = [((3,), torch.float32), ((5, 7), torch.complex64), ((1,), torch.float32), ((300,), torch.complex64)]
    make = lambda: [torch.nn.Parameter(torch.randn(s, dtype=d, generator=g)) for s, d in shapes]  # noqa: E731
    ours_p = make()
    ref_p = [torch.nn.Parameter(p.detach().clone()) for p in ours_p]
    offload = {"cpu": "cpu", "split": ts.Offload(cpu=0.5, nvme=0.5, subgroup_numel=1024, nvme_dir=tmp_path / "nv"),
               "device": ts.Offload(gpu=0.5, cpu=0.5, subgroup_numel=1024)}[place]
    ours = ts_cls(ours_p, offload=offload, **kw)
    ref = torch_cls(ref_p, foreach=False, **kw)
    _train(ours_p, ours)
    _train(ref_p, ref)
    sd, ref_sd = ours.state_dict(), ref.state_dict()
    for i, (p, q) in enumerate(zip(ours_p, ref_p)):
        torch.testing.assert_close(p, q, **TOL)
        for key, want in ref.state[q].items():
            torch.testing.assert_close(ours.state[p][key], want, **TOL)  # a view where held in RAM
            torch.testing.assert_close(sd["state"][i][key], ref_sd["state"][i][key], **TOL)
    ours.close()


@pytest.mark.parametrize("mode", ["plain", "in-backward"])
@pytest.mark.parametrize("place", ["cpu", "nvme"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_torch_on_complex_parameters(tmp_path, case, place, mode):
    ts_cls, torch_cls, kw = CASES[case]
    ours_p, ref_p = _params(), _params()
    ours = ts_cls(ours_p, offload=_offload(place, tmp_path), step_in_backward=mode == "in-backward", **kw)
    ref = torch_cls(ref_p, foreach=False, **kw)
    _train(ours_p, ours, backward=True)
    _train(ref_p, ref, backward=True)
    sd, ref_sd = ours.state_dict(), ref.state_dict()
    assert sd["state"].keys() == ref_sd["state"].keys()
    for i, (p, q) in enumerate(zip(ours_p, ref_p)):
        torch.testing.assert_close(p.detach(), q.detach(), **TOL)
        assert set(sd["state"][i]) == set(ref_sd["state"][i])
        for key, theirs in ref_sd["state"][i].items():
            mine = sd["state"][i][key]
            assert mine.dtype == theirs.dtype and mine.shape == theirs.shape, (i, key)
            torch.testing.assert_close(mine, theirs, **TOL)
            if key != "step":
                assert torch.equal(torch.as_tensor(ours.state[p][key]), mine)  # optimizer.state, torch's form
    ours.close()


@pytest.mark.parametrize("case", list(CASES))
def test_bit_identical_to_the_real_views(case):
    """torch's test_complex: the complex parameters end where their real views do."""
    ts_cls, _, kw = CASES[case]
    cplx = _params()
    real = [torch.nn.Parameter(torch.view_as_real(p.detach()).clone() if p.is_complex() else p.detach().clone())
            for p in _params()]
    a, b = ts_cls(cplx, **kw), ts_cls(real, **kw)
    for step in range(STEPS):
        for p, q, g in zip(cplx, real, _grads(step, cplx)):
            p.grad = g
            q.grad = torch.view_as_real(g).clone() if g.is_complex() else g.clone()
        a.step()
        b.step()
    for p, q in zip(cplx, real):
        assert torch.equal(torch.view_as_real(p.detach()) if p.is_complex() else p.detach(), q.detach())
        for key, v in b.state[q].items():
            mine = a.state[p][key]
            assert torch.equal(torch.view_as_real(mine) if mine.is_complex() else mine, v), key
    a.close()
    b.close()


@pytest.mark.parametrize("case", list(CASES))
def test_state_dict_moves_between_torch_and_tierstate(tmp_path, case):
    ts_cls, torch_cls, kw = CASES[case]
    ref_p = _params()
    ref = torch_cls(ref_p, foreach=False, **kw)
    _train(ref_p, ref, steps=3)
    ours_p = [torch.nn.Parameter(p.detach().clone()) for p in ref_p]
    ours = ts_cls(ours_p, offload=_offload("nvme", tmp_path), **kw)
    ours.load_state_dict(ref.state_dict())
    _train(ours_p, ours, steps=4)
    _train(ref_p, ref, steps=4)
    for p, q in zip(ours_p, ref_p):
        torch.testing.assert_close(p.detach(), q.detach(), **TOL)
    back_p = [torch.nn.Parameter(p.detach().clone()) for p in ours_p]
    back = torch_cls(back_p, foreach=False, **kw)
    back.load_state_dict(ours.state_dict())  # tierstate's complex state into torch
    for key, v in ref.state[ref_p[0]].items():
        torch.testing.assert_close(back.state[back_p[0]][key], v, **TOL)
    ours.close()


def test_checkpoint_round_trip_of_complex_state(tmp_path):
    ps = _params()
    opt = ts.AdamW(ps, lr=1e-2)
    _train(ps, opt, steps=3)
    save_optimizer(opt, tmp_path / "ckpt")
    ps2 = [torch.nn.Parameter(torch.zeros_like(p)) for p in ps]
    opt2 = ts.AdamW(ps2, lr=1e-3, offload=_offload("nvme", tmp_path))
    load_optimizer(opt2, tmp_path / "ckpt")
    for p, q in zip(ps, ps2):
        assert torch.equal(p, q)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], opt2.state[q][key])
    _train(ps, opt, steps=2)
    _train(ps2, opt2, steps=2)
    assert all(torch.equal(p, q) for p, q in zip(ps, ps2))
    opt.close()
    opt2.close()


def test_refusals():
    with pytest.raises(ValueError, match="moment_dtype='q8'.*complex"):
        ts.AdamW([torch.nn.Parameter(torch.zeros(300, dtype=torch.complex64))],
                 offload=ts.Offload(cpu=1.0, moment_dtype="q8"))


@pytest.mark.parametrize("options", [dict(offload="auto"), dict(max_grad_norm=0.5),
                                     dict(max_grad_norm=0.5, step_in_backward=True)],
                         ids=["auto", "max-grad-norm", "max-grad-norm-in-backward"])
def test_modes_bit_identical_to_the_real_views(options):
    """A transposed complex parameter (given contiguous memory, with a warning), clipping by the
    global norm (|z|**2 summed as the real view's squares) and updates during backward."""
    def build(real):
        g = torch.Generator().manual_seed(1)
        w = torch.randn(7, 5, dtype=torch.complex64, generator=g).t()  # not contiguous
        b = torch.randn(300, dtype=torch.complex64, generator=g)
        if real:
            return [torch.nn.Parameter(torch.view_as_real(w.contiguous()).clone()),
                    torch.nn.Parameter(torch.view_as_real(b).clone())]
        return [torch.nn.Parameter(w), torch.nn.Parameter(b)]

    cplx, real = build(False), build(True)
    with pytest.warns(UserWarning, match="not contiguous"):
        a = ts.AdamW(cplx, lr=1e-2, **options)
    b = ts.AdamW(real, lr=1e-2, **options)
    for step in range(STEPS):
        grads = _grads(step, cplx)
        torch.autograd.backward(cplx, grads)
        torch.autograd.backward(real, [torch.view_as_real(g).clone() for g in grads])
        a.step()
        b.step()
        a.zero_grad()
        b.zero_grad()
    for p, q in zip(cplx, real):
        assert torch.equal(torch.view_as_real(p.detach()), q.detach())
        assert torch.equal(torch.view_as_real(a.state[p]["exp_avg"]), b.state[q]["exp_avg"])
    assert a.stats().counters.get("skipped_steps", 0) == 0
    # the gradients' norm was taken in their hooks as backward made them, as for the real views:
    # the step read no gradient twice
    assert ("grad_norm" in a.stats().phases) == ("grad_norm" in b.stats().phases), (a.stats().phases, b.stats().phases)
    a.close()
    b.close()


def test_weight_streaming_refuses_complex_parameters():
    model = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(4, 4).to(torch.complex64),
                                                     torch.nn.Linear(4, 4)]))
    with pytest.raises(TypeError, match=r"offload_weights: parameter '0\.0\.weight' is complex"):
        ts.offload_weights(model, "cpu")
