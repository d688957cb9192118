"""The gradient norm and non-finite check taken in backward, while each gradient is hot in cache.

A plain step on CPU parameters reuses the sum of squares the post-accumulate-grad hook took
of each gradient, as long as ``param.grad`` is still that tensor at that version; anything
that changed a gradient after its hook (an in-place edit, a replacement, a second backward)
makes the step read it again. These tests compare against an optimizer whose gradients were
set by hand (no hook fired, so its step reads every gradient), bit for bit.
"""
from __future__ import annotations

import math

import pytest
import torch

import tierstate as ts


def _net(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).to(dtype)


def _loss(net: torch.nn.Module, i: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + i)
    x = torch.randn(32, 16, generator=gen).to(dtype)
    return net(x).float().square().mean() * 50.0


def _pair(dtype, **kw):
    """(net whose gradients come from backward, its optimizer, twin net, twin optimizer)."""
    net, twin = _net(dtype), _net(dtype)
    opt = ts.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1, offload="cpu", **kw)
    opt_twin = ts.AdamW(twin.parameters(), lr=1e-2, weight_decay=0.1, offload="cpu", **kw)
    return net, opt, twin, opt_twin


def _copy_grads(src: torch.nn.Module, dst: torch.nn.Module) -> None:
    for p, q in zip(src.parameters(), dst.parameters()):
        q.grad = None if p.grad is None else p.grad.detach().clone()


def _same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("max_grad_norm", [None, 0.05])
def test_step_after_backward_reads_no_gradient_twice(dtype, max_grad_norm):
    net, opt, twin, opt_twin = _pair(dtype, max_grad_norm=max_grad_norm)
    for i in range(4):
        _loss(net, i, dtype).backward()
        _copy_grads(net, twin)
        opt.step()
        opt_twin.step()
        phases = opt.stats().phases
        assert "grad_norm" not in phases, phases  # the norm came from the hooks
        assert "grad_norm" in opt_twin.stats().phases  # set by hand: the step reads them
        assert opt.last_grad_norm == opt_twin.last_grad_norm
        if max_grad_norm is not None:
            assert opt.last_grad_norm > max_grad_norm  # clipping was active
        _same(net, twin)
        opt.zero_grad()
        opt_twin.zero_grad()


@pytest.mark.parametrize("edit", ["in_place", "replaced", "inf"])
def test_a_gradient_changed_after_its_hook_is_read_again(edit):
    net, opt, twin, opt_twin = _pair(torch.float32, max_grad_norm=0.05)
    _loss(net, 0, torch.float32).backward()
    w = net[0].weight
    if edit == "in_place":
        w.grad.mul_(3.0)
    elif edit == "replaced":
        w.grad = w.grad * 3.0
    else:
        w.grad[3, 5] = math.inf
    _copy_grads(net, twin)
    before = [p.detach().clone() for p in net.parameters()]
    opt.step()
    opt_twin.step()
    assert opt.skipped_steps == opt_twin.skipped_steps == (1 if edit == "inf" else 0)
    if edit == "inf":
        for p, b in zip(net.parameters(), before):
            assert torch.equal(p, b)
    else:
        assert opt.last_grad_norm == opt_twin.last_grad_norm
    _same(net, twin)


def test_accumulated_gradients_give_the_norm_of_their_sum():
    net, opt, twin, opt_twin = _pair(torch.float32, max_grad_norm=0.05)
    for step in range(3):
        for k in range(3):
            _loss(net, 10 * step + k, torch.float32).backward()
        _copy_grads(net, twin)
        opt.step()
        opt_twin.step()
        assert opt.last_grad_norm == opt_twin.last_grad_norm
        _same(net, twin)
        opt.zero_grad()
        opt_twin.zero_grad()


def test_nonfinite_raise_still_names_the_parameter():
    net, opt, _, _ = _pair(torch.float32, on_nonfinite="raise")
    _loss(net, 0, torch.float32).backward()
    with torch.no_grad():
        net[2].bias.grad[0] = math.nan
    before = [p.detach().clone() for p in net.parameters()]
    with pytest.raises(FloatingPointError, match=r"parameter\(s\) \[3\]"):
        opt.step()
    for p, b in zip(net.parameters(), before):
        assert torch.equal(p, b)


def test_frozen_parameters_of_an_eager_rule_are_not_hooked():
    """Adagrad places state for frozen parameters too; a tensor without requires_grad cannot be
    hooked, and its gradient, if it gets one later, is read by the step."""
    net = _net(torch.float32)
    net[0].bias.requires_grad_(False)
    opt = ts.Adagrad(net.parameters(), lr=1e-2, offload="cpu")
    _loss(net, 0, torch.float32).backward()
    opt.step()
    assert "grad_norm" not in opt.stats().phases
    assert opt.last_grad_norm > 0
