"""DeepSpeed's CPU-Adam and CPU-Adagrad test matrices, run against tierstate and torch.

DeepSpeed tests its CPU Adam over parameter sizes chosen to hit every vector tail (22, 55,
64, 128, 1024, 2**20 and 2**20 + 1 elements), in fp32 and half precision, Adam and AdamW
modes, for 10 steps, against ``torch.optim.AdamW``/``Adam`` at atol 1e-2. We run the same
matrix against tighter bounds:

* fp32 parameters: every parameter and both moments within the parity tolerance of
  tests/optim/test_parity.py (rtol 1e-5, atol 1e-6) after 10 steps;
* bf16/fp16 parameters: tierstate keeps an fp32 master, so the reference is torch's
  optimizer on fp32 copies fed the same (low-precision) gradients; the master must match
  it within the same tolerance and the parameter must be exactly the master rounded to
  the parameter's dtype.

DeepSpeed's CPU Adagrad is tested the same way over sizes 22 to 2**20 in fp32, and on an
embedding trained with sparse gradients; here against ``torch.optim.Adagrad`` within the same
tolerance (tests/optim/test_sparse_grads.py has the modes and refusals of sparse gradients).
"""
from __future__ import annotations

import pytest
import torch

import tierstate as ts

FP32_TOL = dict(rtol=1e-5, atol=1e-6)
SIZES = [22, 55, 64, 128, 1024, 2**20, 2**20 + 1]
STEPS = 10


def _cases():
    for size in SIZES:
        big = size >= 2**20
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for decoupled in (True, False):
                if big and (dtype is torch.float16 or not decoupled):
                    continue  # the tails are what a large size adds; keep the matrix's run time down
                yield pytest.param(size, dtype, decoupled, id=f"{size}-{str(dtype)[6:]}-{'adamw' if decoupled else 'adam'}")


@pytest.mark.parametrize("size,dtype,decoupled", list(_cases()))
def test_deepspeed_cpu_adam_matrix(size: int, dtype: torch.dtype, decoupled: bool) -> None:
    gen = torch.Generator().manual_seed(size)
    init = torch.randn(size, generator=gen)
    param = torch.nn.Parameter(init.to(dtype))
    ref = torch.nn.Parameter(param.detach().float().clone())  # what tierstate's master starts from
    kwargs = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    ours = (ts.AdamW if decoupled else ts.Adam)([param], **kwargs)
    theirs = (torch.optim.AdamW if decoupled else torch.optim.Adam)([ref], **kwargs, foreach=False)
    for _ in range(STEPS):
        grad = torch.randn(size, generator=gen).to(dtype)
        param.grad = grad
        ref.grad = grad.float()
        ours.step()
        theirs.step()
    state, ref_state = ours.state[param], theirs.state[ref]
    master = state["master"] if dtype is not torch.float32 else param.detach()
    torch.testing.assert_close(master, ref.detach(), **FP32_TOL)
    if dtype is not torch.float32:
        assert torch.equal(param.detach(), master.to(dtype)), "the parameter is not its master rounded"
    for key in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(state[key], ref_state[key], **FP32_TOL, msg=lambda m: f"{key}: {m}")
    assert float(state["step"]) == float(ref_state["step"]) == STEPS
    ours.close()


ADAGRAD_SIZES = [22, 55, 64, 128, 1024, 2**20]


@pytest.mark.parametrize("size", ADAGRAD_SIZES)
def test_deepspeed_cpu_adagrad_matrix(size: int) -> None:
    gen = torch.Generator().manual_seed(size)
    param = torch.nn.Parameter(torch.randn(size, generator=gen))
    ref = torch.nn.Parameter(param.detach().clone())
    kwargs = dict(lr=1e-2, eps=1e-10, weight_decay=0.01)
    ours, theirs = ts.Adagrad([param], **kwargs), torch.optim.Adagrad([ref], **kwargs, foreach=False)
    for _ in range(STEPS):
        grad = torch.randn(size, generator=gen)
        param.grad, ref.grad = grad, grad.clone()
        ours.step()
        theirs.step()
    torch.testing.assert_close(param.detach(), ref.detach(), **FP32_TOL)
    torch.testing.assert_close(ours.state[param]["sum"], theirs.state[ref]["sum"], **FP32_TOL)
    assert float(ours.state[param]["step"]) == float(theirs.state[ref]["step"]) == STEPS
    ours.close()


def test_deepspeed_cpu_adagrad_sparse_embedding() -> None:
    """An embedding and a linear layer trained from sparse embedding gradients (repeated rows)."""

    def build():
        torch.manual_seed(7)
        return torch.nn.ModuleDict({"emb": torch.nn.Embedding(1000, 32, sparse=True), "out": torch.nn.Linear(32, 8)})

    ours_model, ref_model = build(), build()
    ours = ts.Adagrad(ours_model.parameters(), lr=1e-2)
    theirs = torch.optim.Adagrad(ref_model.parameters(), lr=1e-2, foreach=False)
    gen = torch.Generator().manual_seed(3)
    for _ in range(STEPS):
        idx = torch.randint(0, 200, (16, 12), generator=gen)
        target = torch.randn(16, 12, 8, generator=gen)
        for model, opt in ((ours_model, ours), (ref_model, theirs)):
            loss = torch.nn.functional.mse_loss(model["out"](model["emb"](idx)), target)
            loss.backward()
            assert model["emb"].weight.grad.is_sparse
            opt.step()
            opt.zero_grad()
    for (name, p), q in zip(ref_model.named_parameters(), ours_model.parameters()):
        torch.testing.assert_close(q.detach(), p.detach(), **FP32_TOL, msg=name)
        torch.testing.assert_close(ours.state[q]["sum"], theirs.state[p]["sum"], **FP32_TOL, msg=name)
    ours.close()
