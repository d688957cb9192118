"""Pure-torch reference of every native kernel.

Each function mutates its tensor arguments in place exactly like its native twin in
``csrc/kernels/`` and has the same signature. For fp32 state the arithmetic follows
``torch.optim``'s single-tensor (``foreach=False``) code path operation by operation, so
the reference is bit-identical to torch; the native kernels are then compared against
it (and against torch) at a tolerance whose reason is written in the tests.

Conventions shared with the native kernels (the "kernel contract"):
- all tensors are 1-D, contiguous, on the CPU and of equal ``numel``;
- ``weight`` is the fp32 master (or the fp32 parameter itself); a float64 parameter is its
  own master, with float64 gradient and state, and only the reference runs it;
- ``grad`` is fp32, bf16 or fp16 and is only read; the kernels compute in fp32 on
  ``grad.float() * grad_scale`` (``grad_scale`` folds loss-scale unscaling and gradient
  clipping into the same pass; 1.0 means "as is");
- moments are fp32 or bf16 (computed in fp32, stored rounded to nearest even);
- ``weight_out`` (bf16/fp16 or None) receives the updated weight rounded to its dtype in
  the same pass, so no separate cast pass exists anywhere in the step;
- step counts, bias corrections and every hyper-parameter come from Python: the
  kernels hold no state.
"""
from __future__ import annotations

import torch
from torch import Tensor


_WORKING = (torch.float32, torch.float64)  # computed in their own dtype; bf16/fp16 in fp32


def _effective_grad(grad: Tensor, grad_scale: float, maximize: bool) -> Tensor:
    g = grad if grad.dtype in _WORKING else grad.float()
    if grad_scale != 1.0:
        g = g * grad_scale
    if maximize:
        g = -g
    return g


def _load(state: Tensor) -> Tensor:
    """A moment as working storage: itself in fp32 or fp64, an fp32 copy when stored in bf16."""
    return state if state.dtype in _WORKING else state.float()


def _store(state: Tensor, value: Tensor) -> None:
    if value is not state:
        state.copy_(value)  # rounds to nearest even when state is bf16


def _write_out(weight: Tensor, weight_out: Tensor | None) -> None:
    if weight_out is not None:
        weight_out.copy_(weight)


def adam_update_many(jobs: list[int], params: list[float]) -> bool:
    """The batched face takes raw addresses, which the reference cannot read: it declines
    (False), and the caller makes the same updates one by one through :func:`adam_update`."""
    return False


def adam_update(
    weight: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    max_exp_avg_sq: Tensor | None = None,
    weight_out: Tensor | None = None,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    bias_correction1: float,
    bias_correction2: float,
    maximize: bool = False,
    grad_scale: float = 1.0,
) -> None:
    """Adam (``decoupled=False``) / AdamW (``decoupled=True``), torch semantics."""
    g = _effective_grad(grad, grad_scale, maximize)
    if weight_decay != 0:
        if decoupled:
            weight.mul_(1 - lr * weight_decay)
        else:
            g = g.add(weight, alpha=weight_decay)
    m = _load(exp_avg)
    v = _load(exp_avg_sq)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2**0.5
    if max_exp_avg_sq is not None:
        vmax = _load(max_exp_avg_sq)
        torch.maximum(vmax, v, out=vmax)
        denom = (vmax.sqrt() / bias_correction2_sqrt).add_(eps)
        _store(max_exp_avg_sq, vmax)
    else:
        denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
    weight.addcdiv_(m, denom, value=-step_size)
    _store(exp_avg, m)
    _store(exp_avg_sq, v)
    _write_out(weight, weight_out)


def lion_update(
    weight: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    weight_out: Tensor | None = None,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    maximize: bool = False,
    grad_scale: float = 1.0,
) -> None:
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Alg. 2).

    update = sign(beta1 * m + (1 - beta1) * g); w = w * (1 - lr * wd) - lr * update;
    m = beta2 * m + (1 - beta2) * g.
    """
    g = _effective_grad(grad, grad_scale, maximize)
    m = _load(exp_avg)
    if weight_decay != 0:
        weight.mul_(1 - lr * weight_decay)
    update = m.lerp(g, 1 - beta1).sign_()
    weight.add_(update, alpha=-lr)
    m.lerp_(g, 1 - beta2)
    _store(exp_avg, m)
    _write_out(weight, weight_out)


def sgd_update(
    weight: Tensor,
    grad: Tensor,
    momentum_buffer: Tensor | None = None,
    weight_out: Tensor | None = None,
    *,
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    maximize: bool = False,
    first_step: bool = False,
    grad_scale: float = 1.0,
) -> None:
    """SGD with optional (Nesterov) momentum, torch semantics.

    ``first_step`` marks a momentum buffer that does not exist yet in torch's terms: it is
    set to the gradient (no dampening), as torch's ``torch.clone(grad).detach()`` does.
    """
    g = _effective_grad(grad, grad_scale, maximize)
    if weight_decay != 0:
        g = g.add(weight, alpha=weight_decay)
    if momentum != 0:
        if momentum_buffer is None:
            raise ValueError("sgd_update: momentum != 0 needs a momentum_buffer tensor")
        buf = _load(momentum_buffer)
        if first_step:
            buf.copy_(g)
        else:
            buf.mul_(momentum).add_(g, alpha=1 - dampening)
        _store(momentum_buffer, buf)
        g = g.add(buf, alpha=momentum) if nesterov else buf
    weight.add_(g, alpha=-lr)
    _write_out(weight, weight_out)


def adagrad_update(
    weight: Tensor,
    grad: Tensor,
    state_sum: Tensor,
    weight_out: Tensor | None = None,
    *,
    clr: float,
    weight_decay: float,
    eps: float,
    maximize: bool = False,
    grad_scale: float = 1.0,
) -> None:
    """Adagrad, torch semantics; ``clr = lr / (1 + (step - 1) * lr_decay)`` from Python."""
    g = _effective_grad(grad, grad_scale, maximize)
    if weight_decay != 0:
        g = g.add(weight, alpha=weight_decay)
    s = _load(state_sum)
    s.addcmul_(g, g, value=1)
    std = s.sqrt().add_(eps)
    weight.addcdiv_(g, std, value=-clr)
    _store(state_sum, s)
    _write_out(weight, weight_out)


def grad_sumsq(grad: Tensor, scale: float = 1.0) -> float:
    """Sum of squares of ``grad * scale`` accumulated in float64; inf/nan propagate."""
    g = grad.double()
    if scale != 1.0:
        g = g * scale
    return float(torch.dot(g, g))
