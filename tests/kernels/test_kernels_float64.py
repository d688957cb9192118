"""The kernel faces on float64 tensors: torch's single-tensor ops in float64 (the reference),
bit for bit against torch's own optimizers, and the errors for tensors of mixed widths."""
from __future__ import annotations

import pytest
import torch

from tierstate import kernels

N = 1000


def _tensors(seed, *names):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(N, dtype=torch.float64, generator=g) for n in names}


def test_adam_face_is_torch_adam_in_float64():
    t = _tensors(0, "weight", "grad", "exp_avg")
    t["exp_avg_sq"] = t["exp_avg"].square()
    p = torch.nn.Parameter(t["weight"].clone())
    ref = torch.optim.AdamW([p], lr=1e-2, weight_decay=0.1, foreach=False)
    ref.state[p] = {"step": torch.tensor(4.0), "exp_avg": t["exp_avg"].clone(), "exp_avg_sq": t["exp_avg_sq"].clone()}
    p.grad = t["grad"].clone()
    ref.step()
    kernels.adam_update(t["weight"], t["grad"], t["exp_avg"], t["exp_avg_sq"], lr=1e-2, beta1=0.9, beta2=0.999,
                        eps=1e-8, weight_decay=0.1, decoupled=True, bias_correction1=1 - 0.9 ** 5,
                        bias_correction2=1 - 0.999 ** 5)
    assert torch.equal(t["weight"], p.detach())
    assert torch.equal(t["exp_avg"], ref.state[p]["exp_avg"])
    assert torch.equal(t["exp_avg_sq"], ref.state[p]["exp_avg_sq"])


def test_sgd_lion_adagrad_faces_take_float64():
    t = _tensors(1, "weight", "grad", "buf")
    w, buf = t["weight"].clone(), t["buf"].clone()
    kernels.sgd_update(w, t["grad"], buf, lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False)
    p = torch.nn.Parameter(t["weight"].clone())
    ref = torch.optim.SGD([p], lr=0.1, momentum=0.9, foreach=False)
    ref.state[p] = {"momentum_buffer": t["buf"].clone()}
    p.grad = t["grad"].clone()
    ref.step()
    assert torch.equal(w, p.detach()) and torch.equal(buf, ref.state[p]["momentum_buffer"])
    state_sum = t["buf"].abs()
    before = t["weight"].clone()
    kernels.adagrad_update(t["weight"], t["grad"], state_sum, clr=0.1, weight_decay=0.0, eps=1e-10)
    assert t["weight"].dtype == torch.float64 and not torch.equal(t["weight"], before)
    m = torch.zeros(N, dtype=torch.float64)
    kernels.lion_update(t["weight"], t["grad"], m, lr=0.1, beta1=0.9, beta2=0.99, weight_decay=0.0)
    assert torch.equal(m, torch.zeros(N, dtype=torch.float64).lerp_(t["grad"], 1 - 0.99))
    assert kernels.grad_sumsq(t["grad"], 0.5) == pytest.approx(float((t["grad"] * 0.5).square().sum()), rel=1e-15)


def test_mixed_widths_are_refused_naming_the_tensor():
    t = _tensors(2, "weight", "grad", "exp_avg", "exp_avg_sq")
    args = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True,
                bias_correction1=0.1, bias_correction2=0.001)
    with pytest.raises(TypeError, match=r"weight is float64 but grad is torch.float32.*\.double\(\)"):
        kernels.adam_update(t["weight"], t["grad"].float(), t["exp_avg"], t["exp_avg_sq"], **args)
    with pytest.raises(TypeError, match=r"weight is float64 but exp_avg_sq is torch.bfloat16"):
        kernels.adam_update(t["weight"], t["grad"], t["exp_avg"], t["exp_avg_sq"].bfloat16(), **args)
    with pytest.raises(TypeError, match=r"float64, which is its own master: pass weight_out=None"):
        kernels.adam_update(t["weight"], t["grad"], t["exp_avg"], t["exp_avg_sq"],
                            weight_out=torch.empty(N, dtype=torch.bfloat16), **args)
    with pytest.raises(TypeError, match=r"weight must be float32 \(the fp32 master\) or float64, got torch.float16"):
        kernels.adam_update(t["weight"].half(), t["grad"], t["exp_avg"], t["exp_avg_sq"], **args)
