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
        (ts.AdamW, dict(lr=-1.0), ValueError, r"Invalid learning rate: -1.0 \(lr must be a finite number >= 0"),
        (ts.AdamW, dict(betas=(1.0, 0.9)), ValueError, r"betas\[0\].*\[0, 1\)"),
        (ts.AdamW, dict(betas=(0.9, -0.1)), ValueError, r"betas\[1\]"),
        (ts.AdamW, dict(betas=0.9), ValueError, r"betas.*tuple of 2"),
        (ts.Adam, dict(eps=-1e-8), ValueError, r"Invalid epsilon value: -1e-08 \(eps must be a finite number >= 0"),
        (ts.AdamW, dict(weight_decay=-0.1), ValueError, r"weight_decay"),
        (ts.AdamW, dict(lr="fast"), TypeError, r"lr must be a real number"),
        (ts.AdamW, dict(offload="disk"), ValueError, r"offload='disk'.*'cpu', 'nvme', 'auto'"),
        (ts.AdamW, dict(offload=3), TypeError, r"offload must be"),
        (ts.AdamW, dict(max_grad_norm=0), ValueError, r"max_grad_norm=0"),
        (ts.AdamW, dict(on_nonfinite="ignore"), ValueError, r"on_nonfinite='ignore'.*skip.*raise"),
        (ts.SGD, dict(nesterov=True), ValueError,
         r"Nesterov momentum requires a momentum.*nesterov=True needs momentum > 0"),
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
    with pytest.raises(ValueError, match="Invalid learning rate"):
        opt.add_param_group({"params": params(), "lr": -3.0})


def test_params_on_two_devices() -> None:
    with pytest.raises(ValueError, match=r"params are on 2 devices \(cpu, meta\).*one optimizer per device"):
        ts.AdamW([torch.nn.Parameter(torch.randn(2)), torch.nn.Parameter(torch.randn(2, device="meta"))])


def test_non_leaf_and_non_tensor_params() -> None:
    leaf = torch.randn(3, requires_grad=True)
    with pytest.raises(ValueError, match=r"can't optimize a non-leaf Tensor: params\[0\] was computed"):
        ts.AdamW([leaf * 2])
    with pytest.raises(TypeError, match=r"optimizer can only optimize Tensors, but one of the params is int: "
                                        r"params\[1\]"):
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



def _load(cls, saved_groups: list[str], loading_groups: list[str]) -> None:
    """Load a state dict of an optimizer over ``saved_groups`` into one over ``loading_groups``
    (each group a string of parameter names)."""
    named = {n: torch.nn.Parameter(torch.randn(2)) for n in "abc"}
    saved = cls([{"params": [named[n] for n in g]} for g in saved_groups]).state_dict()
    cls([{"params": [named[n] for n in g]} for g in loading_groups]).load_state_dict(saved)


def _one() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.randn(2))]


# Refusals torch's optimizers make, with the words they raise them in: code and tests that match
# torch's message must match tierstate's, which goes on to name the place and the fix.
TORCH_REFUSALS = {
    "a non-tensor": (lambda cls: cls([*_one(), 3]), TypeError,
                     r"^optimizer can only optimize Tensors, but one of the params is int"),
    "a non-leaf tensor": (lambda cls: cls([torch.randn(3, requires_grad=True) * 2]), ValueError,
                          r"^can't optimize a non-leaf Tensor"),
    "a group that is not a dict": (lambda cls: cls(_one()).add_param_group([1]), TypeError,
                                   r"^param_group must be a dict"),
    "one tensor in two groups": (lambda cls: cls([{"params": p} for p in _one() * 2]), ValueError,
                                 r"^some parameters appear in more than one parameter group"),
    "a state dict of another group count": (lambda cls: _load(cls, ["ab"], ["a", "b"]), ValueError,
                                            r"^loaded state dict has a different number of parameter groups"),
    "a state dict of another group size": (lambda cls: _load(cls, ["ab"], ["abc"]), ValueError,
                                           r"^loaded state dict contains a parameter group that doesn't match the "
                                           r"size of optimizer's group"),
}


@pytest.mark.parametrize("ts_cls, torch_cls", [(ts.AdamW, torch.optim.AdamW), (ts.SGD, torch.optim.SGD)])
@pytest.mark.parametrize("case", TORCH_REFUSALS)
def test_refusals_start_with_torchs_words(case, ts_cls, torch_cls) -> None:
    build, exc, words = TORCH_REFUSALS[case]
    for cls in (torch_cls, ts_cls):  # the words are torch's own: checked on torch first
        with pytest.raises(exc, match=words):
            build(cls)


def test_nesterov_without_momentum_is_refused_in_torchs_words() -> None:
    for cls in (torch.optim.SGD, ts.SGD):
        with pytest.raises(ValueError, match=r"^Nesterov momentum requires a momentum and zero dampening"):
            cls(_one(), lr=0.1, nesterov=True)
