"""The Python faces: argument checks, backend selection, thread count, fallback."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import tierstate.kernels as K
from kernel_helpers import NATIVE_ISAS, REFERENCE_ONLY_ENV, needs_native

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


# Seven steps against torch.optim itself. The gradients span 1e-5 .. 1e2 in magnitude and eps
# is 1e-3, so that eps, weight decay, dampening, Adagrad's lr_decay and initial accumulator all
# move the result: each PERTURBED entry is a torch run with one of them changed, which must
# not match (test_seven_steps_see_every_hyper_parameter).
_N = 40_003
_LR, _B1, _B2, _EPS, _WD = 1e-2, 0.9, 0.99, 1e-3, 0.05
_ADAGRAD = dict(lr=_LR, lr_decay=0.1, weight_decay=_WD, eps=_EPS, initial_accumulator_value=0.05)
TORCH_CONFIGS = {
    "adamw": (torch.optim.AdamW, dict(lr=_LR, betas=(_B1, _B2), eps=_EPS, weight_decay=_WD)),
    "adam-amsgrad": (torch.optim.Adam, dict(lr=_LR, betas=(_B1, _B2), eps=_EPS, weight_decay=_WD, amsgrad=True)),
    "sgd-nesterov": (torch.optim.SGD, dict(lr=_LR, momentum=0.9, nesterov=True, weight_decay=_WD)),
    "sgd-dampened": (torch.optim.SGD, dict(lr=_LR, momentum=0.9, dampening=0.3, weight_decay=_WD)),
    "adagrad": (torch.optim.Adagrad, _ADAGRAD),
}
PERTURBED = [
    ("adamw", dict(eps=4 * _EPS)), ("adamw", dict(weight_decay=0.0)), ("adamw", dict(betas=(_B1, 0.999))),
    ("adam-amsgrad", dict(amsgrad=False)), ("adam-amsgrad", dict(eps=_EPS / 4)),
    ("sgd-nesterov", dict(nesterov=False)), ("sgd-dampened", dict(dampening=0.0)),
    ("adagrad", dict(lr_decay=0.0)), ("adagrad", dict(initial_accumulator_value=0.0)),
    ("adagrad", dict(eps=1e-10)), ("adagrad", dict(weight_decay=0.0)),
]
_STATE_KEY = {"adamw": "exp_avg", "adam-amsgrad": "exp_avg", "sgd-nesterov": "momentum_buffer",
              "sgd-dampened": "momentum_buffer", "adagrad": "sum"}


def _seven_step_inputs():
    gen = torch.Generator().manual_seed(11)

    def wide():
        mag = torch.pow(10.0, -5.0 + 7.0 * torch.rand(_N, generator=gen))
        return torch.where(torch.rand(_N, generator=gen) < 0.5, -mag, mag)
    grads = [wide() for _ in range(7)]
    return grads, torch.randn(_N, generator=gen)


def _torch_run(name, grads, start, **changes):
    cls, kw = TORCH_CONFIGS[name]
    p = torch.nn.Parameter(start.clone())
    opt = cls([p], foreach=False, **{**kw, **changes})
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach(), opt.state[p][_STATE_KEY[name]]


def _kernel_run(name, grads, start):
    w = start.clone()
    init = _ADAGRAD["initial_accumulator_value"] if name == "adagrad" else 0.0
    state = [torch.full((_N,), init), torch.zeros(_N), torch.zeros(_N)]
    adam = dict(lr=_LR, beta1=_B1, beta2=_B2, eps=_EPS, weight_decay=_WD)
    for step, g in enumerate(grads, start=1):
        bc = dict(bias_correction1=1 - _B1**step, bias_correction2=1 - _B2**step)
        if name == "adamw":
            K.adam_update(w, g, state[0], state[1], None, None, decoupled=True, **adam, **bc)
        elif name == "adam-amsgrad":
            K.adam_update(w, g, state[0], state[1], state[2], None, decoupled=False, **adam, **bc)
        elif name.startswith("sgd"):
            kw = TORCH_CONFIGS[name][1]
            K.sgd_update(w, g, state[0], None, lr=_LR, momentum=0.9, dampening=kw.get("dampening", 0.0),
                         weight_decay=_WD, nesterov=kw.get("nesterov", False), first_step=step == 1)
        else:
            K.adagrad_update(w, g, state[0], None, clr=_LR / (1 + (step - 1) * _ADAGRAD["lr_decay"]),
                             weight_decay=_WD, eps=_EPS)
    return w, state[0]


def _assert_seven_steps_match(name, mine, theirs, grads):
    """The per-step 16-ulp bound of test_kernels_parity compounded over 7 steps: 1e-5 relative
    to the element's magnitude or its operands' (the state: the largest gradient that entered
    it, squared for Adagrad's sum, as a sum of +-100 terms may cancel to ~0); the weight gets
    atol 1e-6 (1e-4 of one step's lr) for elements that cancel towards zero."""
    g_max = torch.stack(grads).abs().amax(0)
    operand = g_max * g_max if name == "adagrad" else g_max
    for what, a, b, floor in (("weight", mine[0], theirs[0], torch.full_like(g_max, 1e-6 / 1e-5)),
                              ("state", mine[1], theirs[1], operand)):
        err = (a.double() - b.double()).abs()
        bound = 1e-5 * torch.maximum(b.abs(), floor).double()
        bad = ~(err <= bound)
        worst = int((err / bound).argmax())
        assert not bad.any(), (f"{name} {what}: {int(bad.sum())}/{a.numel()} beyond the bound; worst at {worst}: "
                               f"{a[worst].item()!r} vs torch {b[worst].item()!r}")


@needs_native
@pytest.mark.parametrize("isa", NATIVE_ISAS)
def test_seven_steps_match_torch_optimizers(isa, isa_and_threads):
    """fp32 end to end against torch.optim itself (foreach=False) over 7 steps."""
    K.set_isa(isa)
    K.set_num_threads(2)
    grads, start = _seven_step_inputs()
    for name in TORCH_CONFIGS:
        _assert_seven_steps_match(name, _kernel_run(name, grads, start), _torch_run(name, grads, start), grads)


@needs_native
@pytest.mark.parametrize("name, changes", PERTURBED, ids=lambda x: str(x))
def test_seven_steps_see_every_hyper_parameter(name, changes, isa_and_threads):
    """The comparison above rejects torch run with one hyper-parameter changed: each matters."""
    K.set_num_threads(2)
    grads, start = _seven_step_inputs()
    mine = _kernel_run(name, grads, start)
    with pytest.raises(AssertionError):
        _assert_seven_steps_match(name, mine, _torch_run(name, grads, start, **changes), grads)


def test_native_kernels_are_built():
    """The kernel suite skips its native checks when the module is missing; this test keeps
    that from passing unnoticed (set TIERSTATE_TEST_REFERENCE_ONLY=1 for a reference-only run)."""
    if os.environ.get(REFERENCE_ONLY_ENV) == "1":
        pytest.skip(f"{REFERENCE_ONLY_ENV}=1: checking the pure-torch reference only")
    from tierstate._native_loader import native_status
    loaded, error = native_status()
    assert loaded and NATIVE_ISAS, f"the native kernels did not load ({error}); build them with " \
        "`pip install --no-build-isolation .` and run the tests from tests/"
    assert "scalar" in NATIVE_ISAS   # the baseline variant every build has
