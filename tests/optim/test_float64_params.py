"""float64 parameters, as torch's optimizers take them (torch's ``test_foreach_matches_forloop``
runs in float64 only): their state is float64, and their math is torch's single-tensor math in
float64.

* against torch's optimizer of the same name: params and every state key, 8 steps, RAM and
  NVMe, plain, in backward, with streamed weights, bit for bit (the update is torch's op
  sequence); with clipping within 1e-12;
* torch's foreach and fused implementations agree within torch's own test tolerance;
* state_dict both ways with torch, checkpoints byte for byte, complex128 as its float64 view;
* beside float32, complex128 and bf16 parameters in one optimizer, each in its own width;
* the refusals: such a mix with an NVMe share, compressed or bf16 state.
"""
from __future__ import annotations

import math

import pytest
import torch

import tierstate as ts
from test_complex_params import _grads, _offload
from test_complex_params import _train as _train_complex
from tierstate.checkpoint import load_optimizer, save_optimizer

STEPS = 8

CASES = {
    "adamw": (ts.AdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "adam-amsgrad-max": (ts.Adam, torch.optim.Adam, dict(lr=1e-2, amsgrad=True, maximize=True, weight_decay=0.05)),
    "adam-l2": (ts.Adam, torch.optim.Adam, dict(lr=1e-2, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1)),
    "sgd-nesterov": (ts.SGD, torch.optim.SGD, dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.1)),
    "sgd-damp": (ts.SGD, torch.optim.SGD, dict(lr=1e-2, momentum=0.5, dampening=0.3)),
    "sgd-plain": (ts.SGD, torch.optim.SGD, dict(lr=1e-2)),
    "adagrad": (ts.Adagrad, torch.optim.Adagrad, dict(lr=0.1, lr_decay=0.01, weight_decay=0.1,
                                                      initial_accumulator_value=0.1)),
}


def _params(seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    # a 2-d weight, a 1-d bias, an empty one (torch's tests add one) and a 3-d one
    return [torch.nn.Parameter(torch.randn(5, 7, dtype=dtype, generator=g)),
            torch.nn.Parameter(torch.randn(1500, dtype=dtype, generator=g)),
            torch.nn.Parameter(torch.empty(0, dtype=dtype)),
            torch.nn.Parameter(torch.randn(3, 4, 2, dtype=dtype, generator=g))]


def _train(params, opt, steps=STEPS, backward=False, first=0):
    """As for complex parameters, with params[3] left without a gradient at step 3."""
    _train_complex(params, opt, steps, backward, first, without=(3, 3))


def _assert_state_equal(ours, theirs):
    for p_ours, p_theirs in zip(ours["params"], theirs["params"]):
        torch.testing.assert_close(p_ours, p_theirs, rtol=0, atol=0)
    for i, (s_ours, s_theirs) in enumerate(zip(ours["state"], theirs["state"])):
        assert set(s_theirs) <= set(s_ours), f"params[{i}]: keys {sorted(s_ours)} against torch's {sorted(s_theirs)}"
        for key, value in s_theirs.items():
            mine = s_ours[key]
            assert mine.dtype == value.dtype, f"params[{i}] {key}: {mine.dtype} against torch's {value.dtype}"
            torch.testing.assert_close(mine, value, rtol=0, atol=0, msg=f"params[{i}] {key}")


def _snapshot(params, opt):
    """The parameters and every state key (through state_dict: NVMe-held state is read there)."""
    state = opt.state_dict()["state"]
    return {"params": [p.detach().clone() for p in params],
            "state": [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in state.get(i, {}).items()}
                      for i in range(len(params))]}


@pytest.mark.parametrize("place", ["cpu", "nvme"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_float64_matches_torch_bit_for_bit(case, place, tmp_path):
    ts_cls, torch_cls, kwargs = CASES[case]
    ours, theirs = _params(), _params()
    opt = ts_cls(ours, offload=_offload(place, tmp_path), **kwargs)
    ref = torch_cls(theirs, foreach=False, **kwargs)
    _train(ours, opt)
    _train(theirs, ref)
    mine = _snapshot(ours, opt)
    _assert_state_equal(mine, _snapshot(theirs, ref))
    for state in mine["state"]:  # state keeps the parameter's dtype, as torch's does
        assert all(v.dtype == torch.float64 for k, v in state.items() if k != "step")
    opt.close()


@pytest.mark.parametrize("case", ["adamw", "sgd-nesterov", "adagrad"])
def test_float64_in_backward_and_clipped_match_torch(case, tmp_path):
    ts_cls, torch_cls, kwargs = CASES[case]
    for mode in ("in_backward", "clipped"):
        ours, theirs = _params(1), _params(1)
        if mode == "in_backward":
            opt = ts_cls(ours, step_in_backward=True, **kwargs)
        else:
            opt = ts_cls(ours, max_grad_norm=0.5, **kwargs)
        ref = torch_cls(theirs, foreach=False, **kwargs)
        for step in range(STEPS):
            grads = _grads(step, ours)
            torch.autograd.backward(ours, grads)
            opt.step()
            opt.zero_grad()
            for p, g in zip(theirs, _grads(step, theirs)):
                p.grad = g
            if mode == "clipped":
                torch.nn.utils.clip_grad_norm_(theirs, 0.5, foreach=False)
            ref.step()
            ref.zero_grad()
        if mode == "clipped":  # the norm is summed in another order than torch's: ulps apart
            for a, b in zip(ours, theirs):
                torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-12, atol=1e-14)
        else:
            _assert_state_equal(_snapshot(ours, opt), _snapshot(theirs, ref))
        opt.close()


@pytest.mark.parametrize("impl", ["foreach", "fused"])
@pytest.mark.parametrize("case", ["adamw", "adam-amsgrad-max", "sgd-nesterov", "adagrad"])
def test_float64_matches_torch_implementations(case, impl):
    """torch's own test_foreach_matches_forloop / test_fused_matches_forloop bar: torch's
    faster implementations agree with tierstate as they agree with torch's for-loop."""
    ts_cls, torch_cls, kwargs = CASES[case]
    ours, theirs = _params(2), _params(2)
    opt = ts_cls(ours, **{impl: True}, **kwargs)
    ref = torch_cls(theirs, **{impl: True}, **kwargs)
    _train(ours, opt)
    _train(theirs, ref)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.detach(), b.detach())  # float64's default: rtol 1e-7, atol 1e-7
    for p, q in zip(ours, theirs):
        for key, value in ref.state[q].items():
            torch.testing.assert_close(opt.state[p][key], value)
    opt.close()


def test_float64_lion_is_the_lion_update_in_float64():
    """torch has no Lion: the update written out in float64 (sign of the interpolation,
    decoupled decay, then the moment), against tierstate's."""
    lr, b1, b2, wd = 1e-2, 0.9, 0.99, 0.1
    ours = _params(3)
    expected = [p.detach().clone() for p in ours]
    moments = [torch.zeros_like(p) for p in expected]
    opt = ts.Lion(ours, lr=lr, betas=(b1, b2), weight_decay=wd)
    for step in range(STEPS):
        grads = _grads(step, ours)
        for p, g in zip(ours, grads):
            p.grad = g
        opt.step()
        opt.zero_grad()
        for w, m, g in zip(expected, moments, grads):
            w.mul_(1 - lr * wd)
            w.add_(torch.sign(m * b1 + g * (1 - b1)), alpha=-lr)
            m.lerp_(g, 1 - b2)
    for p, w, m in zip(ours, expected, moments):
        torch.testing.assert_close(p.detach(), w, rtol=0, atol=0)
        torch.testing.assert_close(opt.state[p]["exp_avg"], m, rtol=0, atol=0)
    opt.close()


def test_float64_state_dict_both_ways_with_torch():
    ts_params, torch_params = _params(4), _params(4)
    kwargs = CASES["adam-amsgrad-max"][2]
    ref = torch.optim.Adam(torch_params, foreach=False, **kwargs)
    _train(torch_params, ref, steps=4)
    ours = [torch.nn.Parameter(p.detach().clone()) for p in torch_params]
    opt = ts.Adam(ours, **kwargs)
    opt.load_state_dict(ref.state_dict())  # torch -> tierstate
    _train(ours, opt, steps=4, first=4)
    _train(torch_params, ref, steps=4, first=4)
    _assert_state_equal(_snapshot(ours, opt), _snapshot(torch_params, ref))
    back = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    again = torch.optim.Adam(back, foreach=False, **kwargs)
    again.load_state_dict(opt.state_dict())  # tierstate -> torch
    _train(back, again, steps=2, first=8)
    _train(torch_params, ref, steps=2, first=8)
    _assert_state_equal(_snapshot(back, again), _snapshot(torch_params, ref))
    opt.close()


@pytest.mark.parametrize("place", ["cpu", "nvme"])
def test_float64_checkpoint_round_trip_is_exact(place, tmp_path):
    params = _params(5)
    opt = ts.AdamW(params, offload=_offload(place, tmp_path), lr=1e-2, amsgrad=True)
    _train(params, opt, steps=3)
    save_optimizer(opt, tmp_path / "ckpt")
    saved = _snapshot(params, opt)
    again = [torch.nn.Parameter(p.detach().clone()) for p in params]
    other = ts.AdamW(again, lr=1e-2, amsgrad=True)
    load_optimizer(other, tmp_path / "ckpt")
    loaded = other.state_dict()["state"]
    for i, state in enumerate(saved["state"]):
        assert set(loaded.get(i, {})) == set(state)
        for key, value in state.items():
            assert torch.equal(loaded[i][key], value), key
            assert loaded[i][key].dtype == value.dtype
    _train(params, opt, steps=3, first=3)
    _train(again, other, steps=3, first=3)
    _assert_state_equal(_snapshot(again, other), _snapshot(params, opt))
    assert saved["state"][0]["exp_avg"].dtype == torch.float64
    opt.close()
    other.close()


def test_complex128_matches_torch():
    g = torch.Generator().manual_seed(6)
    ours = [torch.nn.Parameter(torch.randn(5, 3, dtype=torch.complex128, generator=g))]
    theirs = [torch.nn.Parameter(ours[0].detach().clone())]
    opt = ts.AdamW(ours, lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(theirs, foreach=False, lr=1e-2, weight_decay=0.1)
    for step in range(STEPS):
        grad = torch.randn(5, 3, dtype=torch.complex128, generator=torch.Generator().manual_seed(step))
        ours[0].grad, theirs[0].grad = grad.clone(), grad.clone()
        opt.step()
        ref.step()
    torch.testing.assert_close(ours[0].detach(), theirs[0].detach(), rtol=0, atol=0)
    for key in ("exp_avg", "exp_avg_sq"):
        assert opt.state[ours[0]][key].dtype == torch.complex128
        torch.testing.assert_close(opt.state[ours[0]][key], ref.state[theirs[0]][key], rtol=0, atol=0)
    opt.close()


def _mixed(seed=8):
    """float64 parameters between float32 ones and a bf16 one (torch's multi-tensor sparse
    Rosenbrock and mixed-dtype tests put float64 beside float32 in one optimizer)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(5, 7, generator=g)),
            torch.nn.Parameter(torch.randn(1500, dtype=torch.float64, generator=g)),
            torch.nn.Parameter(torch.randn(300, generator=g)),
            torch.nn.Parameter(torch.randn(3, 4, dtype=torch.complex128, generator=g)),
            torch.nn.Parameter(torch.randn(64, generator=g).bfloat16())]


@pytest.mark.parametrize("case", ["adamw", "adam-amsgrad-max", "sgd-nesterov", "adagrad"])
def test_float64_beside_float32_matches_torch(case):
    """Each parameter is stepped in its own width: the float32, float64 and complex128 ones as
    torch steps them (within the parity tolerance for float32, bit for bit for float64), the
    bf16 one exactly as an optimizer of bf16 parameters alone steps it."""
    ts_cls, torch_cls, kwargs = CASES[case]
    ours, theirs = _mixed(), _mixed()
    opt = ts_cls(ours, **kwargs)
    ref = torch_cls(theirs[:4], foreach=False, **kwargs)
    alone = [torch.nn.Parameter(ours[4].detach().clone())]
    bf16_opt = ts_cls(alone, **kwargs)
    for step in range(STEPS):
        grads = _grads(step, ours)
        for p, q, g in zip(ours, theirs, grads):
            p.grad, q.grad = g.clone(), g.clone()
        alone[0].grad = grads[4].clone()
        for o in (opt, ref, bf16_opt):
            o.step()
            o.zero_grad()
    mine, torch_state = _snapshot(ours, opt), _snapshot(theirs[:4], ref)
    for i in range(4):
        # float64: bit for bit; complex128: torch's complex arithmetic (SGD's, or amsgrad's
        # maximum) rounds a few results 1 ulp away from its own real-view path, which tierstate
        # takes; float32: the native kernels' parity tolerance
        tol = {torch.float64: dict(rtol=0, atol=0), torch.complex128: dict(rtol=1e-14, atol=1e-15),
               torch.float32: dict(rtol=1e-5, atol=1e-6)}[ours[i].dtype]
        torch.testing.assert_close(mine["params"][i], torch_state["params"][i], **tol)
        for key, value in torch_state["state"][i].items():
            assert mine["state"][i][key].dtype == value.dtype, (i, key)
            torch.testing.assert_close(mine["state"][i][key], value, **tol)
    assert torch.equal(ours[4].detach(), alone[0].detach())
    alone_state = bf16_opt.state_dict()["state"][0]
    for key, value in alone_state.items():
        assert torch.equal(mine["state"][4][key], value), key
    opt.close()
    bf16_opt.close()


def test_float64_beside_float32_round_trips():
    """state_dict to torch and back, and a checkpoint, keep each parameter's width."""
    params = _mixed(9)[:4]
    opt = ts.AdamW(params, lr=1e-2)
    _train(params, opt, steps=3)
    sd = opt.state_dict()
    assert [sd["state"][i]["exp_avg"].dtype for i in range(4)] == [
        torch.float32, torch.float64, torch.float32, torch.complex128]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ref = torch.optim.AdamW(twins, lr=1e-2, foreach=False)
    ref.load_state_dict(sd)
    back = ts.AdamW([torch.nn.Parameter(p.detach().clone()) for p in params], lr=1e-2)
    back.load_state_dict(ref.state_dict())
    for i, state in sd["state"].items():
        for key, value in state.items():
            assert torch.equal(back.state_dict()["state"][i][key], value), (i, key)
    opt.close()
    back.close()


def test_float64_beside_float32_checkpoint(tmp_path):
    params = _mixed(10)
    opt = ts.AdamW(params, lr=1e-2)
    _train(params, opt, steps=3)
    save_optimizer(opt, tmp_path / "ckpt")
    again = [torch.nn.Parameter(p.detach().clone()) for p in params]
    other = ts.AdamW(again, lr=1e-2)
    load_optimizer(other, tmp_path / "ckpt")
    ours, theirs = opt.state_dict()["state"], other.state_dict()["state"]
    for i, state in ours.items():
        for key, value in state.items():
            assert theirs[i][key].dtype == value.dtype and torch.equal(theirs[i][key], value), (i, key)
    opt.close()
    other.close()


def test_float64_beside_float32_on_nvme_is_refused(tmp_path):
    params = _mixed(11)[:2]
    with pytest.raises(ValueError, match=r"float64 parameters beside.*Offload\(nvme=0.5.*host RAM.*optimizer of their own"):
        ts.AdamW(params, offload=ts.Offload(cpu=0.5, nvme=0.5, nvme_dir=tmp_path / "nv"))


@pytest.mark.parametrize("offload", [ts.Offload(moment_dtype=torch.bfloat16), ts.Offload(moment_dtype="q8")])
def test_float64_with_narrow_state_is_refused(offload):
    w = torch.nn.Parameter(torch.randn(300, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"float64 parameters.*moment_dtype.*float32"):
        ts.AdamW([w], offload=offload)


def test_float64_state_bytes_are_counted():
    """The analytic budget: an Adam optimizer over n float64 elements holds 16 B of moments
    per element and no master (the parameter is its own, as in torch)."""
    n = 4096
    w = torch.nn.Parameter(torch.randn(n, dtype=torch.float64))
    opt = ts.Adam([w])
    w.grad = torch.randn(n, dtype=torch.float64)
    opt.step()
    sd = opt.state_dict()["state"][0]
    assert "master" not in sd
    assert sum(v.numel() * v.element_size() for k, v in sd.items() if k != "step") == 16 * n
    assert math.isfinite(float(w.detach().sum()))
    opt.close()


def test_float64_streamed_weights_match_torch():
    """Weights streamed per block (ts.offload_weights) are updated where they live, in float64."""
    class Blocks(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Linear(16, 16) for _ in range(3)])

        def forward(self, x):
            for layer in self.layers:
                x = torch.tanh(layer(x))
            return x

    torch.manual_seed(7)
    ref_model = Blocks().double()
    model = Blocks().double()
    model.load_state_dict(ref_model.state_dict())
    handle = ts.offload_weights(model)
    opt = ts.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    for _ in range(STEPS):
        x = torch.randn(4, 16, dtype=torch.float64)
        for m, o in ((model, opt), (ref_model, ref)):
            m(x).sum().backward()
            o.step()
            o.zero_grad()
    with handle.gathered():
        for p, q in zip(model.parameters(), ref_model.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0)
    opt.close()


def test_float64_is_priced_as_its_bytes():
    """offload='auto' prices a float64 value's state at twice an fp32 value's."""
    from tierstate.placement.auto import request_for

    w64 = torch.nn.Parameter(torch.zeros(1000, dtype=torch.float64))
    c128 = torch.nn.Parameter(torch.zeros(1000, dtype=torch.complex128))
    w32 = torch.nn.Parameter(torch.zeros(1000))
    keys = ("exp_avg", "exp_avg_sq")
    assert request_for([w64], state_keys=keys).model.numel == 2000
    assert request_for([c128], state_keys=keys).model.numel == 4000
    assert request_for([w32], state_keys=keys).model.numel == 1000


def test_empty_parameters_keep_their_width_beside_others():
    """An empty parameter has no sub-group: its state takes its own dtype, as torch's does,
    wherever it falls beside the other width."""
    params = [torch.nn.Parameter(torch.randn(300)), torch.nn.Parameter(torch.empty(0, dtype=torch.float64)),
              torch.nn.Parameter(torch.randn(1500, dtype=torch.float64)), torch.nn.Parameter(torch.empty(0))]
    opt = ts.AdamW(params, lr=1e-2)
    ref = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone()) for p in params], lr=1e-2, foreach=False)
    for o, ps in ((opt, params), (ref, ref.param_groups[0]["params"])):
        for p in ps:
            p.grad = torch.ones_like(p)
        o.step()
    ours, theirs = opt.state_dict()["state"], ref.state_dict()["state"]
    for i in range(4):
        for key in ("exp_avg", "exp_avg_sq"):
            assert ours[i][key].dtype == theirs[i][key].dtype == params[i].dtype, (i, key)
            assert opt.state[params[i]][key].dtype == params[i].dtype, (i, key)
    opt.close()
