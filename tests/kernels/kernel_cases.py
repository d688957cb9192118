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


@dataclass(frozen=True)
class Case:
    name: str
    face: Callable
    ref: Callable
    # One entry per state slot between grad and weight_out: an initialiser, or None
    # for an absent optional tensor.
    states: tuple[Callable[[torch.Generator, int], torch.Tensor] | None, ...]
    hyper: dict = field(default_factory=dict)

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
CASES_BY_NAME = {c.name: c for c in CASES}
