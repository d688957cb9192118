"""adam_update_many: many Adam updates in one native call, bit for bit the adam_update calls.

Each job is built from tensors that also get the one-by-one ``adam_update`` (copies of the
same data), over every ISA and both thread counts: mixed gradient, moment and output dtypes,
amsgrad on some jobs, several hyper-parameter rows, sizes around the task boundaries, empty
jobs and unaligned views (whose neighbours, NaN-filled, must stay untouched).
"""
from __future__ import annotations

import pytest
import torch

import tierstate.kernels as K
from kernel_helpers import NATIVE_ISAS, needs_native, unaligned_view
from tierstate.kernels import ops

SIZES = (0, 1, 17, 4095, 4096, 4097, 70_001)
GRADS = (torch.float32, torch.bfloat16, torch.float16)
MOMENTS = (torch.float32, torch.bfloat16)
OUTS = (None, torch.bfloat16, torch.float16)
HYPER = [
    dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True, maximize=False, grad_scale=1.0),
    dict(lr=3e-2, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.1, decoupled=False, maximize=True, grad_scale=0.5),
    dict(lr=1e-4, beta1=0.0, beta2=0.5, eps=0.0, weight_decay=0.0, decoupled=True, maximize=False, grad_scale=2.0),
]


def _job_tensors(i: int, n: int) -> dict:
    g = torch.Generator().manual_seed(i)
    grad_dtype, moment_dtype, out_dtype = GRADS[i % 3], MOMENTS[i % 2], OUTS[(i // 2) % 3]
    t = dict(weight=unaligned_view(torch.randn(n, generator=g), i % 5, torch.float32),
             grad=unaligned_view(torch.randn(n, generator=g), i % 3, grad_dtype),
             exp_avg=unaligned_view(torch.randn(n, generator=g) * 1e-2, i % 7, moment_dtype),
             exp_avg_sq=unaligned_view(torch.rand(n, generator=g) * 1e-4, i % 4, moment_dtype),
             max_exp_avg_sq=unaligned_view(torch.rand(n, generator=g) * 1e-4, 1, moment_dtype) if i % 4 == 1 else None,
             weight_out=unaligned_view(torch.zeros(n), i % 2, out_dtype) if out_dtype is not None else None)
    return t


def _copies(t: dict) -> dict:
    return {k: None if v is None else unaligned_view(v.clone(), 3, v.dtype) for k, v in t.items()}


def _row(h: dict, step: int) -> list[float]:
    return [h["lr"], h["beta1"], h["beta2"], h["eps"], h["weight_decay"], float(h["decoupled"]),
            1 - h["beta1"] ** step, 1 - h["beta2"] ** step, float(h["maximize"]), h["grad_scale"]]


def _ptr(t) -> int:
    return 0 if t is None else t.data_ptr()


@needs_native
@pytest.mark.parametrize("isa", NATIVE_ISAS)
@pytest.mark.parametrize("threads", [1, 2])
def test_many_is_the_calls_one_by_one(isa, threads, isa_and_threads):
    K.set_isa(isa)
    K.set_num_threads(threads)
    jobs_t = [_job_tensors(i, n) for i, n in enumerate(SIZES * 3)]
    singles = [_copies(t) for t in jobs_t]
    steps = [1, 7, 1000]
    params = sum((_row(h, s) for h, s in zip(HYPER, steps)), [])
    jobs = []
    for i, t in enumerate(jobs_t):
        out = t["weight_out"]
        jobs += [_ptr(t["weight"]), _ptr(t["grad"]), _ptr(t["exp_avg"]), _ptr(t["exp_avg_sq"]),
                 _ptr(t["max_exp_avg_sq"]), _ptr(out), t["weight"].numel(), ops.GRAD_DTYPE_CODES[t["grad"].dtype],
                 ops.MOMENT_DTYPE_CODES[t["exp_avg"].dtype],
                 ops.OUT_DTYPE_CODES[out.dtype] if out is not None else ops.NO_OUT, i % 3]
    assert K.adam_update_many(jobs, params) is True
    for i, (t, s) in enumerate(zip(jobs_t, singles)):
        h, step = HYPER[i % 3], steps[i % 3]
        K.adam_update(s["weight"], s["grad"], s["exp_avg"], s["exp_avg_sq"], s["max_exp_avg_sq"], s["weight_out"],
                      lr=h["lr"], beta1=h["beta1"], beta2=h["beta2"], eps=h["eps"], weight_decay=h["weight_decay"],
                      decoupled=h["decoupled"], bias_correction1=1 - h["beta1"] ** step,
                      bias_correction2=1 - h["beta2"] ** step, maximize=h["maximize"], grad_scale=h["grad_scale"])
        for key, v in t.items():
            if v is None:
                continue
            bits = {2: torch.int16, 4: torch.int32}[v.element_size()]
            assert torch.equal(v.view(bits), s[key].view(bits)), (i, key)
            # nothing written outside the view: its buffer's NaN margins are untouched
            base, first = v._base, v.storage_offset()
            margin = torch.cat([base[:first], base[first + v.numel():]])
            assert bool(margin.float().isnan().all()), (i, key, "written outside its view")


@needs_native
def test_no_jobs_is_a_no_op_and_malformed_rows_are_refused(isa_and_threads):
    assert K.adam_update_many([], []) is True
    with pytest.raises(ValueError, match=r"rows are 11 ints and 10 floats"):
        K.adam_update_many([0] * 10, [0.0] * 10)
    with pytest.raises(ValueError, match=r"rows are 11 ints and 10 floats"):
        K.adam_update_many([0] * 11, [0.0] * 9)
    w = torch.zeros(4)
    row = [w.data_ptr(), w.data_ptr(), w.data_ptr(), w.data_ptr(), 0, 0, 4, 0, 0, ops.NO_OUT]
    with pytest.raises(ValueError, match=r"params row that does not exist"):
        K.adam_update_many(row + [1], _row(HYPER[0], 1))
    with pytest.raises(ValueError, match=r"exp_avg and exp_avg_sq must be non-null"):
        K.adam_update_many([w.data_ptr(), w.data_ptr(), 0, 0, 0, 0, 4, 0, 0, ops.NO_OUT, 0], _row(HYPER[0], 1))
    with pytest.raises(ValueError, match=r"grad dtype"):
        K.adam_update_many([w.data_ptr()] * 4 + [0, 0, 4, 7, 0, ops.NO_OUT, 0], _row(HYPER[0], 1))


def test_the_reference_declines_so_the_caller_goes_one_by_one(isa_and_threads):
    K.set_isa("reference")
    w = torch.zeros(4)
    assert K.adam_update_many([w.data_ptr()] * 4 + [0, 0, 4, 0, 0, ops.NO_OUT, 0], _row(HYPER[0], 1)) is False
    assert torch.equal(w, torch.zeros(4))
