"""The device tier (``Offload(gpu=...)``) on this machine's CPU, with the code a GPU runs.

``TIERSTATE_DEVICE_TIER_ON_CPU=1`` (documented on ``tierstate.Offload``) lets the device
tier take CPU parameters: its "device" arenas are then host tensors and its sub-groups are
updated by exactly the torch kernels used on a GPU (``torch._fused_adamw_`` has a CPU
implementation; the other rules run their pure-torch reference), so everything but the
CUDA streams is exercised here. tests/cuda/test_cuda_offload.py repeats the key checks on
a GPU.

Gradients are synthetic (seeded per step, independent of the weights): with gradients
from backward, the device part's last-bit differences would feed into every later
gradient, and "the host part is bit-identical" could not be checked.

[Note: the tolerance of the device part]
The device part is torch's fused multi-tensor Adam (or, for SGD/Lion/Adagrad, the
reference kernels, which follow torch's single-tensor path op by op); the cpu-only run
uses the native kernels. These compute the same formula with different roundings: the
native kernels fuse multiply-adds and keep each element in registers through the whole
update, torch's kernels round after every op (and the fused Adam computes its bias
corrections and step size in a different order). Each op differs by at most 1 ulp and
Adam's normalisation keeps the differences from growing, so after 8 steps they agree to
rtol 1e-5 / atol 1e-6, the tolerance tests/optim/test_parity.py uses between the native
kernels and torch. The device part is in turn checked bit for bit against torch's own
optimizer (``torch.optim.AdamW(fused=True)``, ``torch.optim.SGD(foreach=False)``).
"""
from __future__ import annotations

import pytest
import torch

import tierstate as ts
from tierstate.placement import TierKind
from tierstate.tiers import DeviceTier

FP32_TOL = dict(rtol=1e-5, atol=1e-6)  # see [Note: the tolerance of the device part]
STEPS = 8
SUBGROUP = 1024  # the smallest sub-group Offload allows: parameters straddle sub-groups and tiers

# sizes chosen so that with a 0.2 device fraction the device/host boundary falls inside a parameter
SHAPES = [(24, 40), (40,), (40, 56), (56,), (0,), (56, 12), (12,)]
FROZEN = 6  # index of a parameter that never gets a gradient (no state, like torch)


@pytest.fixture(autouse=True)
def _device_tier_on_cpu(monkeypatch):
    monkeypatch.setenv("TIERSTATE_DEVICE_TIER_ON_CPU", "1")


CASES = {
    "adamw": (ts.AdamW, dict(lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1), dict(lr=3e-3, weight_decay=0.0)),
    "adam_amsgrad_maximize": (ts.Adam, dict(lr=1e-2, weight_decay=0.1, amsgrad=True), dict(lr=5e-3, maximize=True)),
    "sgd_momentum": (ts.SGD, dict(lr=5e-2, momentum=0.9, dampening=0.1, weight_decay=0.01), dict(lr=1e-2)),
    "lion": (ts.Lion, dict(lr=1e-3, weight_decay=0.1), dict(lr=3e-4)),
    "adagrad": (ts.Adagrad, dict(lr=5e-2, lr_decay=0.01, initial_accumulator_value=0.1), dict(lr=1e-2)),
}
TORCH_TWIN = {  # torch's optimizer running the very kernel the device tier uses
    "adamw": lambda params, kw: torch.optim.AdamW(params, **kw, fused=True),
    "adam_amsgrad_maximize": lambda params, kw: torch.optim.Adam(params, **kw, fused=True),
    "sgd_momentum": lambda params, kw: torch.optim.SGD(params, **kw, foreach=False),
    "adagrad": lambda params, kw: torch.optim.Adagrad(params, **kw, foreach=False),
}


def make_params(dtype: torch.dtype) -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape).to(dtype)) for shape in SHAPES]
    params[FROZEN].requires_grad_(False)
    return params


def param_groups(params: list, second: dict) -> list[dict]:
    return [{"params": params[:3]}, {"params": params[3:], **second}]


def grads_of_step(step: int, params: list) -> list[torch.Tensor | None]:
    """Synthetic gradients: seeded by the step only. At step 2 parameter 1 gets none."""
    gen = torch.Generator().manual_seed(100 + step)
    out = []
    for i, p in enumerate(params):
        g = torch.randn(p.shape, generator=gen).to(p.dtype)
        out.append(None if not p.requires_grad or (step == 2 and i == 1) else g)
    return out


def run(case: str, offload, dtype=torch.float32, steps: int = STEPS, **engine):
    cls, kw, second = CASES[case]
    params = make_params(dtype)
    opt = cls(param_groups(params, second), **kw, offload=offload, **engine)
    for step in range(steps):
        for p, g in zip(params, grads_of_step(step, params)):
            p.grad = g
        opt.step()
    return params, opt


def split(gpu: float, cpu: float, nvme: float, nvme_dir, **kw) -> ts.Offload:
    return ts.Offload(gpu=gpu, cpu=cpu, nvme=nvme, subgroup_numel=SUBGROUP, buffer_count=2, nvme_dir=nvme_dir, **kw)


def device_heads(opt) -> dict[int, int]:
    """{index in state_dict numbering: leading elements held by the device tier}, from the layout."""
    heads = {}
    trainable = 0
    for index, p in enumerate(p for g in opt.param_groups for p in g["params"]):
        if not p.requires_grad and not opt.rule.eager_state:
            continue
        n = sum(seg.numel for seg in opt.layout.segments_of(trainable)
                if opt.layout.subgroups[seg.subgroup].tier is TierKind.DEVICE)
        heads[index] = n
        trainable += 1
    return heads


def assert_split_equals_cpu_only(opt_split, params_split, opt_cpu, params_cpu, host_exact: bool = True) -> None:
    """Host/NVMe elements bit-identical to the cpu-only run, device elements within FP32_TOL."""
    heads = device_heads(opt_split)
    sd_split, sd_cpu = opt_split.state_dict(), opt_cpu.state_dict()
    assert sd_split["state"].keys() == sd_cpu["state"].keys()
    host_check = (lambda a, b, msg: torch.testing.assert_close(a, b, rtol=0, atol=0, msg=msg)) if host_exact else (
        lambda a, b, msg: torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=msg))
    for index, (p_split, p_cpu) in enumerate(zip(params_split, params_cpu)):
        head = heads.get(index, 0)
        pairs = [("param", p_split.detach().reshape(-1), p_cpu.detach().reshape(-1))]
        st_split, st_cpu = sd_split["state"].get(index, {}), sd_cpu["state"].get(index, {})
        assert st_split.keys() == st_cpu.keys(), f"param {index}: keys {sorted(st_split)} vs {sorted(st_cpu)}"
        for key in st_cpu:
            if key == "step":
                assert float(st_split[key]) == float(st_cpu[key]), f"param {index}: step"
            else:
                assert st_split[key].device.type == "cpu" and st_split[key].dtype == st_cpu[key].dtype
                pairs.append((key, st_split[key].reshape(-1), st_cpu[key].reshape(-1)))
        for key, a, b in pairs:
            host_check(a[head:], b[head:], f"param {index} {key}: host part")
            torch.testing.assert_close(a[:head].float(), b[:head].float(), **FP32_TOL,
                                       msg=f"param {index} {key}: device part")


SPLITS = [(0.2, 0.5, 0.3), (1.0, 0.0, 0.0), (0.5, 0.5, 0.0), (0.3, 0.0, 0.7)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", ["adamw", "sgd_momentum"])
@pytest.mark.parametrize("fractions", SPLITS, ids=lambda f: "/".join(f"{x:g}" for x in f))
def test_a_split_trains_as_cpu_only(tmp_path, fractions, case, dtype):
    params_cpu, opt_cpu = run(case, "cpu", dtype)
    params_split, opt_split = run(case, split(*fractions, tmp_path / "nv"), dtype)
    heads = device_heads(opt_split)
    assert sum(heads.values()) == opt_split.layout.tier_numel[TierKind.DEVICE] > 0
    if fractions[0] < 1.0:  # the boundary falls inside a parameter: it straddles the device and host ranges
        assert any(0 < h < params_split[i].numel() for i, h in heads.items())
    assert_split_equals_cpu_only(opt_split, params_split, opt_cpu, params_cpu)
    for index, p in enumerate(params_split):
        if dtype != torch.float32 and p.requires_grad and p.numel():
            master = opt_split.state_dict()["state"][index]["master"]
            assert torch.equal(p.detach(), master.to(dtype)), f"param {index} is not its master rounded"
    assert params_split[FROZEN] not in opt_split.state or case == "adagrad"
    opt_split.close()
    opt_cpu.close()


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_rule_on_a_split(tmp_path, case):
    params_cpu, opt_cpu = run(case, "cpu")
    params_split, opt_split = run(case, split(0.2, 0.5, 0.3, tmp_path / "nv"))
    assert_split_equals_cpu_only(opt_split, params_split, opt_cpu, params_cpu)
    opt_split.close()


@pytest.mark.parametrize("case", sorted(TORCH_TWIN))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_device_part_is_torchs_own_kernel_bit_for_bit(case, dtype):
    """With everything on the device tier, the weights (or masters) and every state key equal
    torch's optimizer fed the same gradients (fp32 copies of them), bit for bit."""
    params, opt = run(case, split(1.0, 0.0, 0.0, None), dtype)
    _, kw, second = CASES[case]
    masters = [p.detach().float().clone().requires_grad_(p.requires_grad)
               for p in make_params(dtype)]
    ref = TORCH_TWIN[case](param_groups(masters, second), kw)
    for step in range(STEPS):
        for m, g in zip(masters, grads_of_step(step, make_params(dtype))):
            m.grad = None if g is None else g.float()
        ref.step()
    sd, sd_ref = opt.state_dict(), ref.state_dict()
    for index, m in enumerate(masters):
        st, st_ref = sd["state"].get(index, {}), sd_ref["state"].get(index, {})
        assert set(st) - {"master"} == set(st_ref), f"param {index}: {sorted(st)} vs torch {sorted(st_ref)}"
        weight = st["master"] if "master" in st else params[index].detach()
        if m.requires_grad and m.numel():
            assert torch.equal(weight, m.detach()), f"param {index}: weight differs from torch's"
        for key in st_ref:
            assert torch.equal(st[key].float().reshape(-1), st_ref[key].float().reshape(-1)), f"param {index} {key}"


def test_bf16_moments_on_the_device_tier(tmp_path):
    """torch's fused Adam takes fp32 moments only: bf16 moments run the reference path, whose
    rounding of the stored moments matches the native kernels (RNE)."""
    params_cpu, opt_cpu = run("adamw", ts.Offload(moment_dtype=torch.bfloat16))
    params_split, opt_split = run("adamw", split(0.2, 0.5, 0.3, tmp_path / "nv", moment_dtype=torch.bfloat16))
    heads = device_heads(opt_split)
    sd_split, sd_cpu = opt_split.state_dict(), opt_cpu.state_dict()
    for index, head in heads.items():
        if index in sd_cpu["state"]:
            for key in ("exp_avg", "exp_avg_sq"):
                a, b = sd_split["state"][index][key].reshape(-1), sd_cpu["state"][index][key].reshape(-1)
                assert a.dtype == torch.bfloat16
                assert torch.equal(a[head:], b[head:])
                # one bf16 ulp (2**-8 relative) of slack: an fp32 difference may round either way
                torch.testing.assert_close(a[:head].float(), b[:head].float(), rtol=2 ** -7, atol=1e-6)
    opt_split.close()


def test_clipping_uses_the_global_norm_over_both_tiers(tmp_path):
    max_norm = 0.5
    params_cpu, opt_cpu = run("adamw", "cpu", max_grad_norm=max_norm)
    params_split, opt_split = run("adamw", split(0.2, 0.5, 0.3, tmp_path / "nv"), max_grad_norm=max_norm)
    params_free, _ = run("adamw", split(0.2, 0.5, 0.3, tmp_path / "nv2"))
    last = [g for g in grads_of_step(STEPS - 1, params_cpu) if g is not None]
    true_norm = torch.cat([g.double().reshape(-1) for g in last]).norm().item()
    assert true_norm > max_norm  # clipping acted
    # the native sum of squares accumulates in fp32 within 16 Ki-element blocks (then float64), the
    # device part's in float64 throughout: the norms agree to ~1e-8 relative, not to the last bit
    assert opt_split.last_grad_norm == pytest.approx(true_norm, rel=1e-7)
    assert opt_cpu.last_grad_norm == pytest.approx(opt_split.last_grad_norm, rel=1e-7)
    # so the clip coefficients may differ in their last bits: the host part is compared at a
    # tight tolerance rather than bitwise
    assert_split_equals_cpu_only(opt_split, params_split, opt_cpu, params_cpu, host_exact=False)
    assert not torch.allclose(params_split[0], params_free[0]), "clipping must change the device part too"
    opt_split.close()


@pytest.mark.parametrize("poisoned", [0, 3], ids=["device_param", "host_param"])
def test_a_non_finite_gradient_skips_the_step_in_every_tier(tmp_path, poisoned):
    params, opt = run("adamw", split(0.2, 0.5, 0.3, tmp_path / "nv"), steps=3)
    # the poisoned element 5 of param 0 lies in the device tier; param 3 lies wholly past it
    assert device_heads(opt)[0] > 5 and device_heads(opt)[3] == 0
    before_sd = {i: {k: v.clone() for k, v in st.items()} for i, st in opt.state_dict()["state"].items()}
    before_params = [p.detach().clone() for p in params]
    grads = grads_of_step(3, params)
    grads[poisoned].view(-1)[5] = float("nan")
    for p, g in zip(params, grads):
        p.grad = g
    opt.step()
    assert opt.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before_params, params))
    after = opt.state_dict()["state"]
    for i, st in before_sd.items():
        for k, v in st.items():
            assert torch.equal(after[i][k], v), f"param {i} state {k} moved on a skipped step"
    opt.on_nonfinite = "raise"
    with pytest.raises(FloatingPointError, match=rf"\[{poisoned}\]"):
        opt.step()
    opt.close()


def _scaler_run(scaler, poison_step: int | None = None, unscale_first: bool = False):
    """A small net on a 0.3/0.7 split; with ``scaler`` the loss is scaled (and poisoned with an
    inf at ``poison_step``); without, ``poison_step`` is simply not stepped."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.Tanh(), torch.nn.Linear(48, 4))
    opt = ts.AdamW(net.parameters(), lr=1e-2, offload=split(0.3, 0.7, 0.0, None))
    assert 0 < device_heads(opt)[0] < net[0].weight.numel()  # the first weight straddles the tiers
    gen = torch.Generator().manual_seed(5)
    for step in range(7):
        x = torch.randn(8, 16, generator=gen)
        opt.zero_grad()
        loss = net(x).pow(2).mean()
        if scaler is None:
            loss.backward()
            if step != poison_step:
                opt.step()
            continue
        scaler.scale(loss * (float("inf") if step == poison_step else 1.0)).backward()
        if unscale_first:
            scaler.unscale_(opt)
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        if step == poison_step:
            assert scaler.get_scale() == scale / 2 and opt.skipped_steps == 1
    return net, opt


@pytest.mark.parametrize("unscale_first", [False, True])
def test_grad_scaler_with_a_device_part(unscale_first):
    """A power-of-two loss scale is undone exactly, so a run under GradScaler equals the run
    without it bit for bit, device part included, whether the gradients were unscaled by
    ``scaler.unscale_(opt)`` (in place, in ``param.grad``) or by the optimizer; an inf skips
    the step everywhere and halves the scale."""
    reference, _ = _scaler_run(None, poison_step=3)
    net, opt = _scaler_run(torch.amp.GradScaler("cpu", init_scale=2.0 ** 10), 3, unscale_first)
    assert opt.skipped_steps == 1
    for a, b in zip(net.parameters(), reference.parameters()):
        assert torch.equal(a, b)


PLACEMENTS = {
    "split": lambda d: split(0.2, 0.5, 0.3, d),
    "other_split": lambda d: split(0.6, 0.1, 0.3, d),
    "device": lambda d: split(1.0, 0.0, 0.0, d),
    "cpu": lambda d: "cpu",
    "nvme": lambda d: ts.Offload(cpu=0.0, nvme=1.0, subgroup_numel=SUBGROUP, buffer_count=2, nvme_dir=d),
}


@pytest.mark.parametrize("src,dst", [("split", "cpu"), ("cpu", "split"), ("split", "nvme"), ("nvme", "device"),
                                     ("device", "other_split")])
def test_state_dict_moves_across_placements(tmp_path, src, dst):
    _, opt_src = run("adamw", PLACEMENTS[src](tmp_path / "a"), torch.bfloat16, steps=4)
    sd = opt_src.state_dict()
    params = make_params(torch.bfloat16)
    opt_dst = ts.AdamW(param_groups(params, CASES["adamw"][2]), offload=PLACEMENTS[dst](tmp_path / "b"))
    opt_dst.load_state_dict(sd)
    back = opt_dst.state_dict()
    assert back["state"].keys() == sd["state"].keys()
    for i, st in sd["state"].items():
        assert back["state"][i].keys() == st.keys()
        for k, v in st.items():
            assert back["state"][i][k].device.type == "cpu"
            assert torch.equal(back["state"][i][k], v), f"param {i} {k} after {src} -> {dst}"
    for st in opt_dst.state.values():  # optimizer.state never holds device-tier memory
        for v in st.values():
            assert not any(v.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
                           for t in opt_dst.tiers.values() if isinstance(t, DeviceTier) for a in t.arenas.values())
    opt_src.close()
    opt_dst.close()


def test_resume_on_the_same_split_is_bit_exact(tmp_path):
    """Load a split's state into a fresh optimizer of the same placement: the next steps match."""
    params_a, opt_a = run("adamw", split(0.2, 0.5, 0.3, tmp_path / "a"), torch.bfloat16, steps=4)
    params_b = make_params(torch.bfloat16)
    with torch.no_grad():
        for a, b in zip(params_a, params_b):
            b.copy_(a)
    opt_b = ts.AdamW(param_groups(params_b, CASES["adamw"][2]), **CASES["adamw"][1],
                     offload=split(0.2, 0.5, 0.3, tmp_path / "b"))
    opt_b.load_state_dict(opt_a.state_dict())
    for step in range(4, 7):
        for params, opt in ((params_a, opt_a), (params_b, opt_b)):
            for p, g in zip(params, grads_of_step(step, params)):
                p.grad = g
            opt.step()
    assert all(torch.equal(a, b) for a, b in zip(params_a, params_b))
    sa, sb = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
    assert all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])
    opt_a.close()
    opt_b.close()


@pytest.mark.parametrize("src,dst", [("split", "nvme"), ("cpu", "split")])
def test_save_and_load_optimizer_across_placements(tmp_path, src, dst):
    from tierstate.checkpoint import load_optimizer, save_optimizer

    params_src, opt_src = run("adamw", PLACEMENTS[src](tmp_path / "a"), torch.bfloat16, steps=4)
    save_optimizer(opt_src, tmp_path / "ckpt", extra={"step": 4})
    params = make_params(torch.bfloat16)
    opt_dst = ts.AdamW(param_groups(params, CASES["adamw"][2]), offload=PLACEMENTS[dst](tmp_path / "b"))
    assert load_optimizer(opt_dst, tmp_path / "ckpt")["step"] == 4
    sd, back = opt_src.state_dict()["state"], opt_dst.state_dict()["state"]
    assert sd.keys() == back.keys()
    for i in sd:
        for k in sd[i]:
            assert torch.equal(back[i][k], sd[i][k]), f"param {i} {k}"
    opt_src.close()
    opt_dst.close()


def test_dcp_round_trip_into_a_split(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Tanh(), torch.nn.Linear(40, 8))
    opt = ts.AdamW(model.parameters(), lr=1e-2, offload="cpu")
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 24, generator=gen)).pow(2).mean().backward()
        opt.step()
    dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=str(tmp_path / "dcp"))
    model2 = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Tanh(), torch.nn.Linear(40, 8))
    model2.load_state_dict(model.state_dict())
    opt2 = ts.AdamW(model2.parameters(), lr=1e-2, offload=split(0.4, 0.6, 0.0, None))
    state = {"optim": get_optimizer_state_dict(model2, opt2)}
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"))
    set_optimizer_state_dict(model2, opt2, state["optim"])
    sd, back = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert device_heads(opt2)[0] > 0
    for i in sd:
        for k in sd[i]:
            assert torch.equal(back[i][k], sd[i][k]), f"param {i} {k}"


def test_the_device_tier_needs_an_accelerator_unless_the_testing_aid_is_on(monkeypatch):
    monkeypatch.delenv("TIERSTATE_DEVICE_TIER_ON_CPU")
    with pytest.raises(ValueError, match=r"Offload\(gpu=0.5\) needs parameters on an accelerator"):
        ts.AdamW([torch.nn.Parameter(torch.randn(8))], offload=ts.Offload(gpu=0.5, cpu=0.5))
    monkeypatch.setenv("TIERSTATE_DEVICE_TIER_ON_CPU", "yes")
    with pytest.raises(ValueError, match="TIERSTATE_DEVICE_TIER_ON_CPU='yes'"):
        ts.AdamW([torch.nn.Parameter(torch.randn(8))], offload=ts.Offload(gpu=0.5, cpu=0.5))


def test_device_tier_state_is_read_on_demand_and_counted(tmp_path):
    params, opt = run("adamw", split(0.2, 0.5, 0.3, tmp_path / "nv"), steps=2)
    heads = device_heads(opt)
    assert set(opt.state[params[0]]) == {"step"}, "wholly device-tier state is not in optimizer.state"
    # indices below FROZEN are also the parameters' places in the layout (the frozen one is last)
    host_only = next(i for i, h in heads.items()
                     if i < FROZEN and params[i].numel() and opt.layout.tier_of_param(i) is TierKind.HOST)
    assert {"step", "exp_avg", "exp_avg_sq"} <= set(opt.state[params[host_only]])
    device_elems = opt.layout.tier_numel[TierKind.DEVICE]
    assert opt.tier_bytes()["device"] == device_elems * 8  # exp_avg + exp_avg_sq, fp32, no master
    assert opt.stats().as_dict()["phases"].get("device_update", 0.0) > 0.0
    opt.close()
