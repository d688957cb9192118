"""Bad input raises a ValueError/TypeError that names the argument and what is accepted."""
from __future__ import annotations

import pytest
import torch

import tierstate as ts


def params():
    return [torch.nn.Parameter(torch.randn(3))]


@pytest.mark.parametrize(
    "cls, kwargs, exc, pattern",
    [
        (ts.AdamW, dict(lr=-1.0), ValueError, r"lr: -1.0.*>= 0"),
        (ts.AdamW, dict(betas=(1.0, 0.9)), ValueError, r"betas\[0\].*\[0, 1\)"),
        (ts.AdamW, dict(betas=(0.9, -0.1)), ValueError, r"betas\[1\]"),
        (ts.AdamW, dict(betas=0.9), ValueError, r"betas.*tuple of 2"),
        (ts.Adam, dict(eps=-1e-8), ValueError, r"eps: -1e-08; it must be a finite number >= 0"),
        (ts.AdamW, dict(weight_decay=-0.1), ValueError, r"weight_decay"),
        (ts.AdamW, dict(lr="fast"), TypeError, r"lr must be a real number"),
        (ts.AdamW, dict(offload="disk"), ValueError, r"offload='disk'.*'cpu', 'nvme', 'auto'"),
        (ts.AdamW, dict(offload=3), TypeError, r"offload must be"),
        (ts.AdamW, dict(max_grad_norm=0), ValueError, r"max_grad_norm=0"),
        (ts.AdamW, dict(on_nonfinite="ignore"), ValueError, r"on_nonfinite='ignore'.*skip.*raise"),
        (ts.SGD, dict(nesterov=True), ValueError, r"nesterov=True needs momentum > 0"),
        (ts.SGD, dict(momentum=-0.5), ValueError, r"momentum"),
        (ts.Lion, dict(betas=(0.9, 1.5)), ValueError, r"betas\[1\]"),
        (ts.Adagrad, dict(lr_decay=-1.0), ValueError, r"lr_decay"),
        (ts.Adagrad, dict(initial_accumulator_value=-1.0), ValueError, r"initial_accumulator_value"),
    ],
)
def test_bad_hyper_parameters(cls, kwargs, exc, pattern) -> None:
    with pytest.raises(exc, match=pattern):
        cls(params(), **kwargs)


def test_bad_param_group_added_later_is_refused() -> None:
    opt = ts.AdamW(params())
    with pytest.raises(ValueError, match="Invalid lr"):
        opt.add_param_group({"params": params(), "lr": -3.0})


def test_params_on_two_devices() -> None:
    with pytest.raises(ValueError, match=r"params are on 2 devices \(cpu, meta\).*one optimizer per device"):
        ts.AdamW([torch.nn.Parameter(torch.randn(2)), torch.nn.Parameter(torch.randn(2, device="meta"))])


def test_non_leaf_and_non_tensor_params() -> None:
    leaf = torch.randn(3, requires_grad=True)
    with pytest.raises(ValueError, match=r"params\[0\] is not a leaf tensor"):
        ts.AdamW([leaf * 2])
    with pytest.raises(TypeError, match=r"params\[1\] is a int"):
        ts.AdamW([leaf, 3])
    with pytest.raises(TypeError, match=r"dtype torch.int64.*only floating-point parameters are trained"):
        ts.AdamW([torch.zeros(3, dtype=torch.long)])
    with pytest.raises(TypeError, match=r"dtype torch.float8_e5m2; supported: float32, bfloat16, float16, float64, "
                                        r"complex64, complex128 \(cast the model with model.float\(\)"):
        ts.AdamW([torch.zeros(3, dtype=torch.float8_e5m2, requires_grad=True)])


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(cpu=0.5, nvme=0.2), r"sum to 0.7"),
    (dict(cpu=1.5, nvme=-0.5), r"cpu=1.5"),
    (dict(buffer_count=1), r"buffer_count=1"),
    (dict(subgroup_numel=10), r"subgroup_numel=10"),
    (dict(moment_dtype=torch.float16), r"moment_dtype"),
    (dict(nvme_dir=[]), r"nvme_dir=\[\]"),
])
def test_bad_offload_policy(kwargs, pattern) -> None:
    with pytest.raises(ValueError, match=pattern):
        ts.Offload(**kwargs)


def test_gpu_fraction_without_accelerator() -> None:
    with pytest.raises(ValueError, match=r"Offload\(gpu=0.5\) needs parameters on an accelerator"):
        ts.AdamW(params(), offload=ts.Offload(gpu=0.5, cpu=0.5))
