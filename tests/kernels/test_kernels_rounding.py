"""Rounding of the low-precision outputs, and the gradient sum of squares."""
from __future__ import annotations

import math

import pytest
import torch

import tierstate.kernels as K
from kernel_helpers import NATIVE_ISAS, needs_native
from tierstate.kernels import reference as R

pytestmark = needs_native


def _special_fp32() -> torch.Tensor:
    """Values where rounding goes wrong first: exact bf16/fp16 ties (even and odd),
    fp32 subnormals, the largest finite values, infinities and NaNs."""
    bits = [
        0x3F808000, 0x3F818000, 0xBF808000, 0xBF818000,  # bf16 ties around +-1.0
        0x3F80FFFF, 0x3F807FFF, 0x7F7FFFFF, 0xFF7FFFFF,  # just off a tie; fp32 max
        0x7F7F8000, 0x00000001, 0x80000001, 0x007FFFFF,  # ties to inf; fp32 subnormals
        0x00400000, 0x00008000, 0x00018000, 0x7F800000,  # subnormal bf16 ties; +inf
        0xFF800000, 0x7FC00000, 0xFFC00001, 0x7F800001,  # -inf; NaNs (incl. signalling)
        0x00000000, 0x80000000, 0x3F801000, 0x3F803000,  # +-0; fp16 ties near 1.0
        0x477FEFFF, 0x477FF000, 0x33000000, 0x33000001,  # fp16 max/overflow; fp16 subnormal tie
        0x38800000, 0x387FE000, 0x387FF000, 0x337FFFFF,  # fp16 min normal and around it
    ]
    values = torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)
    # Repeat at every vector phase so each value meets the vector body and the tail.
    return torch.cat([values.roll(k) for k in range(17)])


@pytest.mark.parametrize("isa", NATIVE_ISAS)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_weight_out_rounds_to_nearest_even(isa, out_dtype, isa_and_threads):
    """SGD with lr=0 passes the master through unchanged, so weight_out must hold
    exactly torch's round-to-nearest-even of every special value (NaN stays NaN)."""
    K.set_isa(isa)
    master = _special_fp32()
    weight = master.clone()
    out = torch.zeros(master.numel(), dtype=out_dtype)
    K.sgd_update(weight, torch.zeros_like(master), None, out, lr=0.0, momentum=0.0, dampening=0.0,
                 weight_decay=0.0, nesterov=False)
    expected = master.to(out_dtype)
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(out), nan)
    assert torch.equal(out[~nan].view(torch.int16), expected[~nan].view(torch.int16))


@pytest.mark.parametrize("isa", NATIVE_ISAS)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_grad_sumsq_matches_reference(isa, grad_dtype, isa_and_threads):
    """fp32 accumulation within 16 Ki-element blocks (each lane sums <= 4096 squares), double
    across blocks: within 1e-5 relative of the double reference, the bound of 4096 fp32
    additions (4096 * 2**-24 = 2.4e-4 worst case; squares are all positive, so the error stays
    near its average: ~3e-7 measured). torch's own fp32 vector_norm is no tighter."""
    K.set_isa(isa)
    gen = torch.Generator().manual_seed(3)
    grad = torch.randn(2**20 + 3 + 2, generator=gen).to(grad_dtype)[2:]  # unaligned view
    for threads in (1, 2):
        K.set_num_threads(threads)
        for scale in (1.0, 0.125):
            assert math.isclose(K.grad_sumsq(grad, scale), R.grad_sumsq(grad, scale), rel_tol=1e-5)
    for n in (1, 7, 15, 16, 17, 255, 1023):
        small = grad[:n]
        assert math.isclose(K.grad_sumsq(small), R.grad_sumsq(small), rel_tol=1e-5)


@pytest.mark.parametrize("isa", NATIVE_ISAS)
def test_grad_sumsq_same_for_every_thread_count(isa, isa_and_threads):
    K.set_isa(isa)
    grad = torch.randn(3 * 2**20 + 5)
    sums = []
    for threads in (1, 2):
        K.set_num_threads(threads)
        sums.append(K.grad_sumsq(grad))
    assert sums[0] == sums[1]


@pytest.mark.parametrize("isa", NATIVE_ISAS)
@pytest.mark.parametrize("bad, expected", [(float("inf"), math.inf), (float("nan"), None)])
def test_grad_sumsq_propagates_non_finite(isa, bad, expected, isa_and_threads):
    K.set_isa(isa)
    for position in (0, 16, 1000, 2**17 + 1):  # vector body, tail, later chunks
        grad = torch.ones(2**17 + 2, dtype=torch.bfloat16)
        grad[position] = bad
        total = K.grad_sumsq(grad)
        assert math.isnan(total) if expected is None else total == expected
