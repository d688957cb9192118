"""The parity cases can see every term of every rule.

A parity test passes when the native kernel agrees with the reference; that proves
something only if a kernel with one term wrong would disagree. Here each rule is
re-implemented (fp32 torch, the reference's operations) with a ``mutation`` switch that
perturbs exactly one term: eps moved inside the square root, a bias correction dropped,
decoupled weight decay applied as L2 (and back), dampening ignored, and so on. For every
native ISA variant, every case of ``kernel_cases.CASES`` in which the term is active and
every mutation, :func:`test_parity.run_and_compare` (the very comparison the parity tests
make, at their tolerances) must FAIL against the mutated reference; the unmutated
re-implementation must pass it, so a failure is the mutation's doing.

Each mutation must be active in at least one case (``test_every_mutation_is_exercised``),
so a new term cannot be added here without a case that sees it.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

import tierstate.kernels as K
from kernel_cases import CASES, Case
from kernel_helpers import NATIVE_ISAS, needs_native
from test_kernels_parity import run_and_compare

pytestmark = needs_native

# The comparisons run for the dtype combinations whose tolerance is loosest (bf16 moments:
# one bf16 ulp more on the states) and tightest (fp32 everywhere), with weight_out on, at a
# size with a vector body and a scalar tail.
COMBOS = (
    (torch.float32, torch.float32, None),
    (torch.bfloat16, torch.bfloat16, torch.bfloat16),
)
SIZE = 1023


def _g(grad, grad_scale, maximize, mutation):
    g = grad.float()
    if mutation != "grad_scale_ignored":
        g = g * grad_scale
    if maximize and mutation != "maximize_ignored":
        g = -g
    return g


def _finish(weight, weight_out, pairs):
    for state, value in pairs:
        if state is not None:
            state.copy_(value)
    if weight_out is not None:
        weight_out.copy_(weight)


def adam(mutation, weight, grad, exp_avg, exp_avg_sq, max_exp_avg_sq=None, weight_out=None, *, lr, beta1,
         beta2, eps, weight_decay, decoupled, bias_correction1, bias_correction2, maximize=False,
         grad_scale=1.0):
    g = _g(grad, grad_scale, maximize, mutation)
    if weight_decay != 0 and mutation != "weight_decay_ignored":
        if decoupled != (mutation == "decay_coupling_swapped"):
            weight.mul_(1 - (1.0 if mutation == "decay_without_lr" else lr) * weight_decay)
        else:
            g = g + weight_decay * weight
    m = exp_avg.float().lerp(g, beta1 if mutation == "beta1_weights_swapped" else 1 - beta1)
    v = exp_avg_sq.float() * beta2 + (1.0 if mutation == "beta2_weight_missing" else 1 - beta2) * g * g
    vmax = None
    used = v
    if max_exp_avg_sq is not None:
        vmax = torch.maximum(max_exp_avg_sq.float(), v)
        if mutation != "amsgrad_max_ignored":
            used = vmax
    bc1 = 1.0 if mutation == "bias_correction1_off" else bias_correction1
    bc2 = 1.0 if mutation == "bias_correction2_off" else bias_correction2
    if mutation == "eps_inside_sqrt":
        denom = (used / bc2 + eps).sqrt()
    elif mutation == "eps_squared_inside_sqrt":
        denom = (used / bc2 + eps * eps).sqrt()
    elif mutation == "eps_before_bias_correction":
        denom = (used.sqrt() + eps) / math.sqrt(bc2)
    else:
        denom = used.sqrt() / math.sqrt(bc2) + eps
    weight.addcdiv_(m, denom, value=-lr / bc1)
    _finish(weight, weight_out, [(exp_avg, m), (exp_avg_sq, v), (max_exp_avg_sq, vmax)])


def lion(mutation, weight, grad, exp_avg, weight_out=None, *, lr, beta1, beta2, weight_decay, maximize=False,
         grad_scale=1.0):
    g = _g(grad, grad_scale, maximize, mutation)
    m = exp_avg.float()
    if weight_decay != 0 and mutation != "weight_decay_ignored":
        weight.mul_(1 - (1.0 if mutation == "decay_without_lr" else lr) * weight_decay)
    b_update, b_moment = (beta2, beta1) if mutation == "betas_swapped" else (beta1, beta2)
    update = m.lerp(g, 1 - b_update)
    if mutation != "sign_missing":
        update = update.sign()
    weight.add_(update, alpha=-lr)
    _finish(weight, weight_out, [(exp_avg, m.lerp(g, 1 - b_moment))])


def sgd(mutation, weight, grad, momentum_buffer=None, weight_out=None, *, lr, momentum, dampening, weight_decay,
        nesterov, maximize=False, first_step=False, grad_scale=1.0):
    g = _g(grad, grad_scale, maximize, mutation)
    if weight_decay != 0 and mutation != "weight_decay_ignored":
        if mutation == "decay_decoupled":
            weight.mul_(1 - lr * weight_decay)
        else:
            g = g + weight_decay * weight
    buf = None
    if momentum != 0:
        damp = 0.0 if mutation == "dampening_ignored" else dampening
        if first_step and mutation != "first_step_dampened":
            buf = g.clone()
        elif first_step:
            buf = (1 - dampening) * g
        else:
            mom = 1.0 if mutation == "momentum_coefficient_ignored" else momentum
            buf = momentum_buffer.float() * mom + (1 - damp) * g
        g = g + momentum * buf if nesterov and mutation != "nesterov_ignored" else buf
    weight.add_(g, alpha=-lr)
    _finish(weight, weight_out, [(momentum_buffer, buf)])


def adagrad(mutation, weight, grad, state_sum, weight_out=None, *, clr, weight_decay, eps, maximize=False,
            grad_scale=1.0):
    g = _g(grad, grad_scale, maximize, mutation)
    if weight_decay != 0 and mutation != "weight_decay_ignored":
        if mutation == "decay_decoupled":
            weight.mul_(1 - clr * weight_decay)
        else:
            g = g + weight_decay * weight
    s = state_sum.float() + (g.abs() if mutation == "sum_not_squared" else g * g)
    if mutation == "eps_inside_sqrt":
        std = (s + eps).sqrt()
    elif mutation == "eps_squared_inside_sqrt":
        std = (s + eps * eps).sqrt()
    elif mutation == "eps_ignored":
        std = s.sqrt()
    else:
        std = s.sqrt() + eps
    weight.addcdiv_(g, std, value=-clr)
    _finish(weight, weight_out, [(state_sum, s)])


IMPLEMENTATIONS: dict[str, Callable] = {"adam": adam, "lion": lion, "sgd": sgd, "adagrad": adagrad}


@dataclass(frozen=True)
class Mutation:
    op: str
    name: str
    active: Callable[[Case], bool]   # whether the perturbed term takes part in the case

    def __str__(self) -> str:
        return f"{self.op}:{self.name}"


def _h(case: Case, key: str, default=None):
    return case.hyper.get(key, default)


def _states(case: Case) -> int:
    return sum(init is not None for init in case.states)


_always = lambda c: True  # noqa: E731
_wd = lambda c: _h(c, "weight_decay", 0.0) != 0  # noqa: E731
_maximize = lambda c: bool(_h(c, "maximize", False))  # noqa: E731
_scaled = lambda c: _h(c, "grad_scale", 1.0) != 1.0  # noqa: E731
_momentum = lambda c: _h(c, "momentum", 0.0) != 0  # noqa: E731
# eps takes part only where the denominator's other term comes near it: the "wide" cases
# (see kernel_cases). The others draw sqrt(v / bc2) ~ 0.1 .. 2 against eps = 1e-8 (Adagrad:
# sqrt(sum) ~ 1 against 1e-10) and check the dtype/size matrix, not eps.
_eps = lambda c: "-wide" in c.name  # noqa: E731

MUTATIONS = [
    *(Mutation("adam", n, a) for n, a in [
        ("eps_inside_sqrt", _eps),
        ("eps_squared_inside_sqrt", _eps),
        ("eps_before_bias_correction", _eps),
        ("bias_correction1_off", _always),
        ("bias_correction2_off", _always),
        ("beta1_weights_swapped", _always),
        ("beta2_weight_missing", _always),
        ("weight_decay_ignored", _wd),
        ("decay_coupling_swapped", _wd),
        ("decay_without_lr", lambda c: _wd(c) and _h(c, "decoupled")),
        ("amsgrad_max_ignored", lambda c: _states(c) == 3),
        ("maximize_ignored", _maximize),
        ("grad_scale_ignored", _scaled),
    ]),
    *(Mutation("lion", n, a) for n, a in [
        ("betas_swapped", lambda c: _h(c, "beta1") != _h(c, "beta2")),
        ("sign_missing", _always),
        ("weight_decay_ignored", _wd),
        ("decay_without_lr", _wd),
        ("maximize_ignored", _maximize),
        ("grad_scale_ignored", _scaled),
    ]),
    *(Mutation("sgd", n, a) for n, a in [
        ("weight_decay_ignored", _wd),
        # Without momentum, w - lr * (g + wd * w) == w * (1 - lr * wd) - lr * g: the same rule.
        ("decay_decoupled", lambda c: _wd(c) and _momentum(c)),
        ("dampening_ignored", lambda c: _momentum(c) and _h(c, "dampening") != 0 and not _h(c, "first_step")),
        ("first_step_dampened", lambda c: _momentum(c) and _h(c, "dampening") != 0 and _h(c, "first_step")),
        ("momentum_coefficient_ignored", lambda c: _momentum(c) and not _h(c, "first_step")),
        ("nesterov_ignored", lambda c: _momentum(c) and _h(c, "nesterov")),
        ("maximize_ignored", _maximize),
        ("grad_scale_ignored", _scaled),
    ]),
    *(Mutation("adagrad", n, a) for n, a in [
        ("eps_inside_sqrt", _eps),
        ("eps_squared_inside_sqrt", _eps),
        ("eps_ignored", _eps),
        ("sum_not_squared", _always),
        ("weight_decay_ignored", _wd),
        ("decay_decoupled", _wd),
        ("maximize_ignored", _maximize),
        ("grad_scale_ignored", _scaled),
    ]),
]


def _pairs():
    for case in CASES:
        for mutation in MUTATIONS:
            if mutation.op == case.op and mutation.active(case):
                yield case, mutation


def _with(mutation: str | None, op: str) -> Callable:
    impl = IMPLEMENTATIONS[op]
    return lambda *args, **kw: impl(mutation, *args, **kw)


def test_every_mutation_is_exercised():
    """Each perturbed term is active in at least one case, so each is checked below."""
    exercised = {str(m) for _, m in _pairs()}
    assert exercised == {str(m) for m in MUTATIONS}, {str(m) for m in MUTATIONS} - exercised


@pytest.mark.parametrize("isa", NATIVE_ISAS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_unmutated_rewrite_passes_parity(isa, case, isa_and_threads):
    """The switchable re-implementation, unswitched, agrees with the kernel: so a failure
    under a mutation below comes from the mutation, not from the re-implementation."""
    K.set_isa(isa)
    K.set_num_threads(1)
    for g, m, o in COMBOS:
        run_and_compare(case, SIZE, g, m, o, offset=1, ref=_with(None, case.op))


@pytest.mark.parametrize("isa", NATIVE_ISAS)
@pytest.mark.parametrize("case, mutation", list(_pairs()), ids=lambda x: x.name)
def test_parity_sees_the_mutation(isa, case, mutation, isa_and_threads):
    """The parity comparison must reject the reference with ``mutation`` applied."""
    K.set_isa(isa)
    K.set_num_threads(1)
    for g, m, o in COMBOS:
        with pytest.raises(AssertionError):
            run_and_compare(case, SIZE, g, m, o, offset=1, ref=_with(mutation.name, case.op))
