"""The Python faces: argument checks, backend selection, thread count, fallback."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import tierstate.kernels as K
from kernel_helpers import NATIVE_ISAS, needs_native

ADAM = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True,
            bias_correction1=0.1, bias_correction2=0.001)


def _adam_args(n=8, **overrides):
    args = dict(weight=torch.zeros(n), grad=torch.zeros(n, dtype=torch.bfloat16),
                exp_avg=torch.zeros(n), exp_avg_sq=torch.zeros(n), max_exp_avg_sq=None,
                weight_out=torch.zeros(n, dtype=torch.bfloat16))
    args.update(overrides)
    return args


@pytest.mark.parametrize(
    "overrides, error, names",
    [
        (dict(weight=torch.zeros(8, dtype=torch.bfloat16)), TypeError, "weight"),
        (dict(grad=torch.zeros(8, dtype=torch.int32)), TypeError, "grad"),
        (dict(grad=torch.zeros(9, dtype=torch.bfloat16)), ValueError, "grad"),
        (dict(grad=torch.zeros(16)[::2]), ValueError, "grad"),
        (dict(exp_avg=torch.zeros(8, device="meta")), ValueError, "exp_avg"),
        (dict(exp_avg=torch.zeros(8, dtype=torch.float16)), TypeError, "exp_avg"),
        (dict(exp_avg_sq=torch.zeros(8, dtype=torch.bfloat16)), TypeError, "exp_avg_sq"),
        (dict(max_exp_avg_sq=torch.zeros(7)), ValueError, "max_exp_avg_sq"),
        (dict(weight_out=torch.zeros(8)), TypeError, "weight_out"),
        (dict(weight_out=[0.0] * 8), TypeError, "weight_out"),
    ],
)
def test_bad_arguments_name_the_argument(overrides, error, names):
    args = _adam_args(**overrides)
    before = args["weight"].clone() if args["weight"].dtype == torch.float32 else None
    with pytest.raises(error, match=names):
        K.adam_update(**args, **ADAM)
    if before is not None:
        assert torch.equal(args["weight"], before), "a rejected call must not touch the state"


def test_sgd_momentum_needs_buffer():
    with pytest.raises(ValueError, match="momentum_buffer"):
        K.sgd_update(torch.zeros(4), torch.zeros(4), None, None, lr=0.1, momentum=0.9,
                     dampening=0.0, weight_decay=0.0, nesterov=False)


def test_backend_info_reports_the_variant_in_use(isa_and_threads):
    info = K.backend_info()
    assert set(info) >= {"native", "isa", "threads", "available_isas"}
    assert info["isa"] in info["available_isas"]
    K.set_num_threads(1)
    assert K.backend_info()["threads"] == 1
    K.set_isa("reference")
    assert K.backend_info()["isa"] == "reference"


@needs_native
def test_set_isa_rejects_unknown_and_unsupported(isa_and_threads):
    with pytest.raises(ValueError, match="available"):
        K.set_isa("sse9")
    if "neon" not in NATIVE_ISAS:
        with pytest.raises(ValueError, match="neon"):
            K.set_isa("neon")
    for isa in NATIVE_ISAS:
        K.set_isa(isa)
        assert K.current_isa() == isa
    K.set_isa("auto")
    assert K.current_isa() == NATIVE_ISAS[0]


def test_set_num_threads_rejects_non_positive():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="positive"):
            K.set_num_threads(bad)


def test_default_threads_divide_affinity_by_local_ranks(monkeypatch):
    cpus = len(os.sched_getaffinity(0))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert K.default_num_threads() == max(1, cpus // 2)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert K.default_num_threads() == cpus


def _run_python(code: str, **env) -> dict:
    full_env = {**os.environ, **env}
    out = subprocess.run([sys.executable, "-c", code], env=full_env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


INFO = "import json, tierstate.kernels as K; print(json.dumps(K.backend_info()))"


@needs_native
def test_environment_forces_isa_and_threads():
    info = _run_python(INFO, TIERSTATE_ISA=NATIVE_ISAS[-1], TIERSTATE_NUM_THREADS="3")
    assert info["isa"] == NATIVE_ISAS[-1] and info["threads"] == 3


@needs_native
def test_environment_rejects_unknown_isa():
    out = subprocess.run([sys.executable, "-c", INFO], env={**os.environ, "TIERSTATE_ISA": "mmx"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "TIERSTATE_ISA" in out.stderr


def test_without_native_module_the_reference_runs():
    code = (
        "import json, torch, tierstate.kernels as K\n"
        "w = torch.ones(5); out = torch.empty(5, dtype=torch.bfloat16)\n"
        "K.sgd_update(w, torch.ones(5), None, out, lr=0.5, momentum=0.0, dampening=0.0,"
        " weight_decay=0.0, nesterov=False)\n"
        "print(json.dumps({**K.backend_info(), 'w': w.tolist(), 'out': out.float().tolist()}))"
    )
    info = _run_python(code, TIERSTATE_NATIVE_PATH="/nonexistent/_native.so")
    assert info["native"] is False and info["isa"] == "reference"
    assert info["w"] == [0.5] * 5 and info["out"] == [0.5] * 5


@needs_native
@pytest.mark.parametrize("isa", NATIVE_ISAS)
def test_seven_steps_match_torch_optimizers(isa, isa_and_threads):
    """fp32 end to end against torch.optim itself (foreach=False) over 7 steps; the
    tolerance is the per-step 16-ulp bound of test_kernels_parity compounded over 7
    steps (rtol 1e-5), with atol for elements that cancel towards zero."""
    K.set_isa(isa)
    K.set_num_threads(2)
    n = 40_003
    gen = torch.Generator().manual_seed(11)
    grads = [torch.randn(n, generator=gen) for _ in range(7)]
    start = torch.randn(n, generator=gen)
    lr, b1, b2, eps, wd = 1e-2, 0.9, 0.99, 1e-8, 0.05

    configs = {
        "adamw": (torch.optim.AdamW, dict(lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)),
        "adam-amsgrad": (torch.optim.Adam, dict(lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd,
                                                amsgrad=True)),
        "sgd-nesterov": (torch.optim.SGD, dict(lr=lr, momentum=0.9, nesterov=True, weight_decay=wd)),
        "adagrad": (torch.optim.Adagrad, dict(lr=lr, lr_decay=0.01, weight_decay=wd, eps=1e-10)),
    }
    for name, (cls, kw) in configs.items():
        p = torch.nn.Parameter(start.clone())
        opt = cls([p], foreach=False, **kw)
        w = start.clone()
        state = [torch.zeros(n), torch.zeros(n), torch.zeros(n)]
        for step, g in enumerate(grads, start=1):
            p.grad = g.clone()
            opt.step()
            if name == "adamw":
                K.adam_update(w, g, state[0], state[1], None, None, lr=lr, beta1=b1, beta2=b2,
                              eps=eps, weight_decay=wd, decoupled=True,
                              bias_correction1=1 - b1**step, bias_correction2=1 - b2**step)
            elif name == "adam-amsgrad":
                K.adam_update(w, g, state[0], state[1], state[2], None, lr=lr, beta1=b1, beta2=b2,
                              eps=eps, weight_decay=wd, decoupled=False,
                              bias_correction1=1 - b1**step, bias_correction2=1 - b2**step)
            elif name == "sgd-nesterov":
                K.sgd_update(w, g, state[0], None, lr=lr, momentum=0.9, dampening=0.0,
                             weight_decay=wd, nesterov=True, first_step=step == 1)
            else:
                K.adagrad_update(w, g, state[0], None, clr=lr / (1 + (step - 1) * 0.01),
                                 weight_decay=wd, eps=1e-10)
        torch.testing.assert_close(w, p.detach(), rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
        torch_state = opt.state[p]
        key = {"adamw": "exp_avg", "adam-amsgrad": "exp_avg", "sgd-nesterov": "momentum_buffer",
               "adagrad": "sum"}[name]
        torch.testing.assert_close(state[0], torch_state[key], rtol=1e-5, atol=1e-6)
