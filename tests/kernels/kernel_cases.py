"""Operation cases for the parity tests: each runs one op through the face and through
the reference with the same inputs."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import tierstate.kernels as K
from tierstate.kernels import reference as R


def _pos(g: torch.Generator, n: int, scale: float) -> torch.Tensor:
    return torch.rand(n, generator=g) * scale


def _signed(g: torch.Generator, n: int, scale: float) -> torch.Tensor:
    return torch.randn(n, generator=g) * scale


def _log_uniform(g: torch.Generator, n: int, low: float, high: float, signed: bool) -> torch.Tensor:
    """Magnitudes 10**U(low, high), so one tensor holds tiny, ordinary and huge values;
    random signs when ``signed``."""
    mag = torch.pow(10.0, low + (high - low) * torch.rand(n, generator=g))
    if signed:
        mag = torch.where(torch.rand(n, generator=g) < 0.5, -mag, mag)
    return mag


def _default_weight(g: torch.Generator, n: int) -> torch.Tensor:
    return torch.randn(n, generator=g)


def _default_grad(g: torch.Generator, n: int) -> torch.Tensor:
    return torch.randn(n, generator=g) * 2


def _wide_grad(g: torch.Generator, n: int) -> torch.Tensor:
    # 1e-5 .. 1e2: g*g spans 1e-10 .. 1e4 (fp16 holds both ends: 1e-5 as a subnormal)
    return _log_uniform(g, n, -5.0, 2.0, signed=True)


@dataclass(frozen=True)
class Case:
    name: str
    face: Callable
    ref: Callable
    # One entry per state slot between grad and weight_out: an initialiser, or None
    # for an absent optional tensor.
    states: tuple[Callable[[torch.Generator, int], torch.Tensor] | None, ...]
    hyper: dict = field(default_factory=dict)
    weight: Callable[[torch.Generator, int], torch.Tensor] = _default_weight
    grad: Callable[[torch.Generator, int], torch.Tensor] = _default_grad

    @property
    def op(self) -> str:
        return self.name.split("-")[0]


_adam = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, bias_correction1=1 - 0.9**3,
             bias_correction2=1 - 0.999**3)
_m = lambda g, n: _signed(g, n, 0.1)  # noqa: E731
_v = lambda g, n: _pos(g, n, 0.01)  # noqa: E731

CASES = [
    Case("adam-adamw", K.adam_update, R.adam_update, (_m, _v, None),
         dict(_adam, weight_decay=0.01, decoupled=True)),
    Case("adam-l2", K.adam_update, R.adam_update, (_m, _v, None),
         dict(_adam, weight_decay=0.05, decoupled=False)),
    Case("adam-amsgrad", K.adam_update, R.adam_update, (_m, _v, _v),
         dict(_adam, weight_decay=0.01, decoupled=True)),
    # beta1 = 0.3 makes the lerp weight 0.7 >= 0.5: torch's other lerp formula.
    Case("adam-maximize-scaled-lowbeta", K.adam_update, R.adam_update, (_m, _v, None),
         dict(_adam, beta1=0.3, weight_decay=0.0, decoupled=True, maximize=True, grad_scale=0.25)),
    Case("lion-default", K.lion_update, R.lion_update, (_m,),
         dict(lr=1e-4, beta1=0.9, beta2=0.99, weight_decay=0.1)),
    Case("lion-maximize-lowbeta", K.lion_update, R.lion_update, (_m,),
         dict(lr=1e-4, beta1=0.2, beta2=0.4, weight_decay=0.0, maximize=True, grad_scale=3.0)),
    Case("sgd-plain", K.sgd_update, R.sgd_update, (None,),
         dict(lr=0.1, momentum=0.0, dampening=0.0, weight_decay=0.01, nesterov=False)),
    Case("sgd-momentum", K.sgd_update, R.sgd_update, (_m,),
         dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.0, nesterov=False)),
    Case("sgd-nesterov-first", K.sgd_update, R.sgd_update, (_m,),
         dict(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.01, nesterov=True, first_step=True)),
    Case("sgd-nesterov-maximize", K.sgd_update, R.sgd_update, (_m,),
         dict(lr=0.1, momentum=0.8, dampening=0.0, weight_decay=0.0, nesterov=True, maximize=True,
              grad_scale=0.5)),
    Case("adagrad-plain", K.adagrad_update, R.adagrad_update, (lambda g, n: _pos(g, n, 1.0),),
         dict(clr=0.01, weight_decay=0.0, eps=1e-10)),
    Case("adagrad-wd-maximize", K.adagrad_update, R.adagrad_update, (lambda g, n: _pos(g, n, 1.0),),
         dict(clr=0.01 / 1.5, weight_decay=0.1, eps=1e-10, maximize=True, grad_scale=2.0)),
]

# Cases in which every term of the rule moves the result by far more than the tolerance
# (checked term by term in test_kernels_mutations.py). eps = 1e-3 sits inside the range of
# the denominator's other term: sqrt(v / bc2) spans ~1e-5 .. 1e2 here (v drawn over 1e-12 ..
# 1e2 with bc2 = 1 - 0.999**3 ~ 0.003, plus (1 - beta2) g*g with g over 1e-5 .. 1e2), so
# for some elements eps dominates, for some it is negligible and for some the two are
# comparable, where moving eps (inside the sqrt, before the bias correction) shows.
_v_wide = lambda g, n: _log_uniform(g, n, -12.0, 2.0, signed=False)  # noqa: E731
_m_wide = lambda g, n: _log_uniform(g, n, -6.0, 1.0, signed=True)  # noqa: E731
_sum_wide = lambda g, n: _log_uniform(g, n, -10.0, 2.0, signed=False)  # noqa: E731
_adam_wide = dict(_adam, lr=1e-2, eps=1e-3)

CASES += [
    Case("adam-wide-adamw-amsgrad", K.adam_update, R.adam_update, (_m_wide, _v_wide, _v_wide),
         dict(_adam_wide, weight_decay=0.1, decoupled=True), grad=_wide_grad),
    Case("adam-wide-l2-maximize-scaled", K.adam_update, R.adam_update, (_m_wide, _v_wide, None),
         dict(_adam_wide, beta2=0.99, weight_decay=0.1, decoupled=False, maximize=True, grad_scale=0.5,
              bias_correction2=1 - 0.99**3), grad=_wide_grad),
    Case("adam-wide-no-decay", K.adam_update, R.adam_update, (_m_wide, _v_wide, None),
         dict(_adam_wide, weight_decay=0.0, decoupled=True), grad=_wide_grad),
    Case("adagrad-wide-wd-scaled", K.adagrad_update, R.adagrad_update, (_sum_wide,),
         dict(clr=0.05, weight_decay=0.1, eps=1e-3, grad_scale=0.5), grad=_wide_grad),
    Case("adagrad-wide-maximize", K.adagrad_update, R.adagrad_update, (_sum_wide,),
         dict(clr=0.05, weight_decay=0.0, eps=1e-3, maximize=True), grad=_wide_grad),
    # torch sets a new buffer to the gradient itself: dampening must not touch the first step.
    Case("sgd-momentum-first-dampened", K.sgd_update, R.sgd_update, (_m,),
         dict(lr=0.1, momentum=0.9, dampening=0.3, weight_decay=0.01, nesterov=False, first_step=True)),
    Case("sgd-nesterov-wd-scaled", K.sgd_update, R.sgd_update, (_m,),
         dict(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.05, nesterov=True, grad_scale=0.5)),
    Case("lion-wd-scaled-maximize", K.lion_update, R.lion_update, (_m,),
         dict(lr=1e-2, beta1=0.9, beta2=0.99, weight_decay=0.5, maximize=True, grad_scale=0.5)),
]
CASES_BY_NAME = {c.name: c for c in CASES}
