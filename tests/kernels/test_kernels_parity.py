"""Parity of every native ISA variant with the pure-torch reference.

Every op case x grad dtype x moment dtype x weight_out dtype runs on every variant this
CPU can execute, over sizes that cover empty vector bodies, exact multiples of the
AVX2/AVX-512 widths (8, 16) and scalar tails (1, 7, 15, 17, 255, 1023), on views that
start 1..3 elements into a larger buffer. The large size 2**20 + 3 (many chunks, an
unaligned head chunk, threads 1 and 2) runs for every op and variant.

Tolerances, and why they are not zero:
- fp32 results (weight, fp32 moments) may differ from the reference by 16 fp32 ulps
  (16 * 2**-23 relative) of the largest term that enters the element: its old value,
  its new value, the update (new - old), the effective gradient g and g*g. The reference follows torch's
  single-tensor code, which rounds a product and a sum separately in places
  (``v * beta2 + (1 - beta2) * g * g``, ``grad + wd * w``, ``w - lr * buf``) where the
  kernels use one FMA (and the baseline "scalar" build, without FMA, does the reverse
  for torch's FMA-based lerp). sqrt and division are correctly rounded in both, so each
  of the ~5 roundings of a step can differ by an ulp of its operands; when the result
  cancels to near zero (w ~ lr * update) that is an ulp of the operands, not of the result,
  and a moment's few-ulp difference reaches the weight scaled by lr (hence 16, not 8).
- bf16 moments: one bf16 ulp (2**-7 relative) more: both sides round to nearest even,
  but from fp32 values that may differ by an ulp and straddle a rounding boundary.
- weight_out is compared EXACTLY against the kernel's own fp32 master rounded by torch
  (``weight.to(torch.bfloat16)``): rounding must be round-to-nearest-even, bit for bit.
- Lion applies sign(); elements whose interpolated momentum is within 1e-6 of zero may
  take either sign under an ulp of difference, so they are excluded (there are ~none).
"""
from __future__ import annotations

import itertools

import pytest
import torch

import tierstate.kernels as K
from kernel_helpers import NATIVE_ISAS, needs_native, unaligned_view
from kernel_cases import CASES, CASES_BY_NAME, Case

pytestmark = needs_native

SMALL_SIZES = (1, 7, 15, 16, 17, 255, 1023)
LARGE_SIZE = 2**20 + 3
GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MOMENT_DTYPES = (torch.float32, torch.bfloat16)
OUT_DTYPES = (None, torch.bfloat16, torch.float16)
FP32_ULPS = 16 * 2.0**-23
BF16_ULP = 2.0**-7


def assert_within(actual, expected, scale, rel, what):
    """|actual - expected| <= rel * scale elementwise (scale: the operands' magnitude)."""
    err = (actual.double() - expected.double()).abs()
    bound = rel * scale.double() + 1e-30
    bad = ~(err <= bound)
    assert not bad.any(), (
        f"{what}: {int(bad.sum())}/{actual.numel()} elements beyond tolerance; worst at "
        f"{int((err / bound).argmax())}: actual {actual[(err / bound).argmax()].item()!r}, "
        f"expected {expected[(err / bound).argmax()].item()!r}"
    )


def _adam_exact(h: dict, weight, grad, states) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight after one Adam/AdamW step of the reference's formula, in float64 from the
    same inputs, and how far two fp32 roundings of the effective gradient move it.

    Why: where the L2 term cancels a scaled, maximized gradient (``-0.5 g + 0.1 w`` near 4e-4
    from operands near 0.2, in ``adam-wide-l2-maximize-scaled``), the second moment is tiny and
    eps-dominated, and a rounding of that sum reaches the weight amplified. The baseline scalar
    build, without FMA, rounds ``g * scale`` and ``+ wd * w`` apart; on a Xeon it gave
    -0.6080495 where torch's fp32 step gave -0.6080545 and this formula -0.6080521, beyond 16
    ulps of either fp32 result but well within what those roundings explain."""
    def step(g):
        w = weight.double()
        if h["weight_decay"]:
            if h["decoupled"]:
                w = w * (1 - h["lr"] * h["weight_decay"])
            else:
                g = g + h["weight_decay"] * weight.double()
        m = states[0].double() + (1 - h["beta1"]) * (g - states[0].double())
        v = states[1].double() * h["beta2"] + (1 - h["beta2"]) * g * g
        if len(states) > 2 and states[2] is not None:
            v = torch.maximum(states[2].double(), v)
        return w - h["lr"] / h["bias_correction1"] * m / (v.sqrt() / h["bias_correction2"] ** 0.5 + h["eps"])

    g = grad.double() * h.get("grad_scale", 1.0) * (-1.0 if h.get("maximize", False) else 1.0)
    operands = g.abs() + (h["weight_decay"] * weight.double().abs() if not h["decoupled"] else 0.0)
    delta = 2 * 2.0**-23 * operands  # two roundings of the effective gradient's operands
    exact = step(g)
    moved = torch.maximum((step(g + delta) - exact).abs(), (step(g - delta) - exact).abs())
    return exact, moved


def _check_guards(buffer: torch.Tensor, offset: int, n: int, name: str) -> None:
    """The NaN sentinels around a view must survive: no write outside the view."""
    outside = torch.cat([buffer[:offset], buffer[offset + n :]]).float()
    assert torch.isnan(outside).all(), f"{name}: a kernel wrote outside the tensor"


def run_and_compare(case: Case, n: int, grad_dtype, moment_dtype, out_dtype, offset: int,
                    ref=None) -> None:
    """Runs ``case`` through the native face and through ``ref`` (default: the case's
    reference) on the same inputs and asserts they agree within the tolerances above."""
    gen = torch.Generator().manual_seed(1000 * n + offset)
    weight = case.weight(gen, n)
    grad = case.grad(gen, n).to(grad_dtype)
    states = [None if init is None else init(gen, n).to(moment_dtype) for init in case.states]

    ref_weight = weight.clone()
    ref_states = [None if s is None else s.clone() for s in states]
    ref_out = None if out_dtype is None else torch.empty(n, dtype=out_dtype)
    (case.ref if ref is None else ref)(ref_weight, grad.clone(), *ref_states, ref_out, **case.hyper)

    # Each tensor at its own misalignment, so no two share a vector phase.
    views = {}
    views["weight"] = unaligned_view(weight, offset, torch.float32)
    views["grad"] = unaligned_view(grad, offset % 3 + 1, grad_dtype)
    for i, s in enumerate(states):
        if s is not None:
            views[f"state{i}"] = unaligned_view(s, (offset + i + 1) % 3 + 1, moment_dtype)
    if out_dtype is not None:
        views["out"] = unaligned_view(torch.zeros(n), (offset + 1) % 3 + 1, out_dtype)
    native_states = [views.get(f"state{i}") for i in range(len(states))]
    case.face(views["weight"], views["grad"], *native_states, views.get("out"), **case.hyper)

    for name, view in views.items():
        _check_guards(view._base, view.storage_offset(), n, name)
    assert torch.equal(views["grad"], grad), "the gradient must only be read"

    keep = torch.ones(n, dtype=torch.bool)
    if case.op == "lion":
        h = case.hyper
        sign = -1.0 if h.get("maximize", False) else 1.0
        g64 = grad.double() * h.get("grad_scale", 1.0) * sign
        m64 = states[0].double()
        keep = (m64 + (1 - h["beta1"]) * (g64 - m64)).abs() > 1e-6

    g_abs = grad.float().abs() * case.hyper.get("grad_scale", 1.0) + weight.abs()
    w_scale = torch.stack([weight.abs(), ref_weight.abs(), (ref_weight - weight).abs()]).amax(0)
    w_keep = keep
    if case.op == "adam":
        # Elements where one rounding of the effective gradient moves the weight by more than
        # the tolerance are held to that conditioning, against the exact result, not to torch's
        # own fp32 rounding: see _adam_exact.
        exact, moved = _adam_exact(case.hyper, weight, grad, states)
        tol = FP32_ULPS * w_scale.double()
        ill = keep & (moved > tol)
        err = (views["weight"].double() - exact).abs()
        assert (err[ill] <= moved[ill] + tol[ill]).all(), (
            f"weight: {int((err[ill] > moved[ill] + tol[ill]).sum())} ill-conditioned elements farther from "
            "the exact result than one rounding of their effective gradient explains")
        w_keep = keep & ~ill
    assert_within(views["weight"][w_keep], ref_weight[w_keep], w_scale[w_keep], FP32_ULPS, "weight")
    for i, (mine, ref, before) in enumerate(zip(native_states, ref_states, states)):
        if mine is None:
            continue
        scale = torch.stack([before.float().abs(), ref.float().abs(), g_abs, g_abs * g_abs]).amax(0)
        rel = FP32_ULPS if moment_dtype == torch.float32 else FP32_ULPS + BF16_ULP
        assert_within(mine.float()[keep], ref.float()[keep], scale[keep], rel, f"state {i}")
    if out_dtype is not None:
        rounded = views["weight"].to(out_dtype)
        assert torch.equal(views["out"].view(torch.int16), rounded.view(torch.int16)), (
            "weight_out must be the fp32 master rounded to nearest even"
        )


@pytest.mark.parametrize("isa", NATIVE_ISAS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_dtype_matrix_small_sizes(isa, case, isa_and_threads):
    """Every dtype combination at every small size, one thread."""
    K.set_isa(isa)
    K.set_num_threads(1)
    combos = itertools.product(GRAD_DTYPES, MOMENT_DTYPES, OUT_DTYPES)
    for k, (g, m, o) in enumerate(combos):
        for j, n in enumerate(SMALL_SIZES):
            run_and_compare(case, n, g, m, o, offset=(k + j) % 3 + 1)


# One case per op for the default tier; the slow tier runs all of them.
LARGE_CASES = [CASES_BY_NAME[n] for n in ("adam-amsgrad", "lion-default", "sgd-nesterov-first",
                                          "adagrad-wd-maximize")]
# threads -> (grad, moments, weight_out, offset): the mixed-precision combination the
# optimizer uses on one thread count, the other half-precision paths on the other.
LARGE_DTYPES = {
    1: (torch.bfloat16, torch.float32, torch.bfloat16, 1),
    2: (torch.float16, torch.bfloat16, torch.float16, 3),
}


def _large(case, isa, threads):
    K.set_isa(isa)
    K.set_num_threads(threads)
    g, m, o, offset = LARGE_DTYPES[threads]
    run_and_compare(case, LARGE_SIZE, g, m, o, offset=offset)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("isa", NATIVE_ISAS)
@pytest.mark.parametrize("case", LARGE_CASES, ids=lambda c: c.name)
def test_large_unaligned(isa, case, threads, isa_and_threads):
    """2**20 + 3 elements: 64 chunks, an unaligned head chunk and a scalar tail."""
    _large(case, isa, threads)


@pytest.mark.slow
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("isa", NATIVE_ISAS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_large_unaligned_all_cases(isa, case, threads, isa_and_threads):
    _large(case, isa, threads)


@pytest.mark.parametrize("isa", NATIVE_ISAS)
def test_threads_do_not_change_results(isa, isa_and_threads):
    """Elementwise kernels: the split over threads must not change a single bit."""
    K.set_isa(isa)
    case = CASES_BY_NAME["adam-amsgrad"]
    results = []
    for threads in (1, 2):
        K.set_num_threads(threads)
        gen = torch.Generator().manual_seed(7)
        n = LARGE_SIZE
        w, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen).bfloat16()
        states = [init(gen, n) for init in case.states]
        out = torch.empty(n, dtype=torch.bfloat16)
        case.face(w, g, *states, out, **case.hyper)
        results.append([w, *states, out])
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("isa", NATIVE_ISAS)
def test_zero_elements(isa, isa_and_threads):
    K.set_isa(isa)
    empty = torch.empty(0)
    K.adam_update(empty, empty, empty.clone(), empty.clone(), None, None, lr=1e-3, beta1=0.9,
                  beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True, bias_correction1=0.1,
                  bias_correction2=0.001)
    assert K.grad_sumsq(empty) == 0.0
