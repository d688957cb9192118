"""Parity of every tierstate optimizer with its torch namesake (torch test_optim style).

Eight steps (torch's own parity tests use 7, "where we start to see differences for
RAdam"), with: two parameter groups with different hyper-parameters, weight decay != 0,
an LR scheduler, a frozen parameter, a zero-size parameter, and steps where some
parameters get no gradient (their state must not move). Every state key is compared.

Tolerance: the native kernels compute each element in fp32 with fused multiply-adds in
one pass, while torch's single-tensor path rounds after every op; each op differs by at
most 1 ulp and Adam's normalisation keeps errors from growing, so after 8 steps the
parameters and moments agree to rtol 1e-5 / atol 1e-6 (measured worst case ~1e-7). With
the pure-torch reference kernels the results are bit-identical (asserted separately).
"""
from __future__ import annotations

import warnings

import pytest
import torch

import tierstate as ts
from tierstate import kernels

FP32_TOL = dict(rtol=1e-5, atol=1e-6)
STATE_KEYS = {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "sum"}


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(6, 12)
        self.b = torch.nn.Linear(12, 12)
        self.head = torch.nn.Linear(12, 3)
        self.frozen = torch.nn.Parameter(torch.randn(4), requires_grad=False)
        self.empty = torch.nn.Parameter(torch.zeros(0))

    def forward(self, x: torch.Tensor, use_b: bool = True) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if use_b:
            h = torch.tanh(self.b(h))
        return self.head(h) + self.empty.sum()


def make_net(seed: int = 0, dtype=torch.float32) -> Net:
    torch.manual_seed(seed)
    return Net().to(dtype)


def groups(net: Net, **second) -> list[dict]:
    return [
        {"params": [net.a.weight, net.a.bias, net.frozen, net.empty]},
        {"params": [net.b.weight, net.b.bias, net.head.weight, net.head.bias], **second},
    ]


def train(net: Net, opt, steps: int = 8, sched=None, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    for i in range(steps):
        x = torch.randn(5, 6, generator=gen, dtype=next(net.parameters()).dtype)
        opt.zero_grad(set_to_none=True)
        # step 2: net.b gets no gradient, so its state must be left alone
        loss = net(x, use_b=i != 2).float().pow(2).mean()
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()


class LionReference(torch.optim.Optimizer):
    """Lion as published (Chen et al. 2023, Alg. 2), written independently of tierstate."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                m = state["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                update = (m * beta1 + p.grad * (1 - beta1)).sign()
                p.add_(update, alpha=-group["lr"])
                m.mul_(beta2).add_(p.grad, alpha=1 - beta2)


CASES = {
    "adamw": (ts.AdamW, torch.optim.AdamW, dict(lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1), dict(lr=3e-3, weight_decay=0.0)),
    "adamw_amsgrad": (ts.AdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.05, amsgrad=True), dict(lr=2e-2)),
    "adam": (ts.Adam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1, eps=1e-6), dict(lr=5e-3, maximize=True)),
    # the edges torch accepts: eps=0 (torch checks eps >= 0) and any dampening (torch checks none)
    "adamw_eps_zero": (ts.AdamW, torch.optim.AdamW, dict(lr=1e-2, eps=0.0), dict(lr=3e-3, eps=1e-8)),
    "adam_eps_zero": (ts.Adam, torch.optim.Adam, dict(lr=1e-2, eps=0.0, amsgrad=True), dict(lr=5e-3)),
    "sgd_dampening_outside_0_1": (ts.SGD, torch.optim.SGD, dict(lr=5e-2, momentum=0.9, dampening=1.5), dict(lr=1e-2, dampening=-0.5)),
    "sgd_momentum": (ts.SGD, torch.optim.SGD, dict(lr=5e-2, momentum=0.9, dampening=0.1, weight_decay=0.01), dict(lr=1e-2)),
    "sgd_nesterov": (ts.SGD, torch.optim.SGD, dict(lr=5e-2, momentum=0.9, nesterov=True, weight_decay=0.01), dict(lr=1e-2)),
    "sgd_plain": (ts.SGD, torch.optim.SGD, dict(lr=5e-2, weight_decay=0.01), dict(lr=1e-1)),
    "adagrad": (ts.Adagrad, torch.optim.Adagrad, dict(lr=5e-2, lr_decay=0.01, weight_decay=0.01, initial_accumulator_value=0.1), dict(lr=1e-2)),
    # torch fills every `sum` from the optimizer's initial_accumulator_value, whatever a group says
    # (tierstate filled them from the first group's: see test_adagrad_sums_start_at_the_optimizers_value)
    "adagrad_group_init": (ts.Adagrad, torch.optim.Adagrad, dict(lr=5e-2, initial_accumulator_value=0.1),
                           dict(lr=1e-2, initial_accumulator_value=0.7)),
    "lion": (ts.Lion, LionReference, dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1), dict(lr=3e-4)),
}


def torch_kwargs(torch_cls, kw: dict) -> dict:
    return kw if torch_cls is LionReference else {**kw, "foreach": False}


def assert_same(ours: torch.optim.Optimizer, ref: torch.optim.Optimizer, net_ours: Net, net_ref: Net, exact: bool) -> None:
    check = (lambda a, b, msg: torch.testing.assert_close(a, b, rtol=0, atol=0, msg=msg)) if exact else (
        lambda a, b, msg: torch.testing.assert_close(a, b, **FP32_TOL, msg=msg))
    for (name, p_ours), p_ref in zip(net_ours.named_parameters(), net_ref.parameters()):
        check(p_ours.detach(), p_ref.detach(), f"param {name}")
        s_ours, s_ref = ours.state.get(p_ours, {}), ref.state.get(p_ref, {})
        ref_keys = {k for k, v in s_ref.items() if v is not None} - {"master"}
        # state held outside the host tier is not listed in optimizer.state but read on demand
        ours_keys = {k for k in set(s_ours) | set(s_ref) | STATE_KEYS if s_ours.get(k) is not None} - {"master"}
        assert ours_keys == ref_keys, f"{name}: state keys {sorted(ours_keys)} vs torch {sorted(ref_keys)}"
        for key in ref_keys:
            a, b = s_ours[key], s_ref[key]
            if key == "step":
                assert float(a) == float(b), f"{name}: step {float(a)} vs {float(b)}"
            else:
                check(a, b, f"{name}: state {key}")


@pytest.mark.parametrize("placement", ["cpu", "nvme"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_parity_with_torch(case: str, placement: str, tmp_path) -> None:
    ts_cls, torch_cls, kw, second = CASES[case]
    net_ours, net_ref = make_net(), make_net()
    offload = "cpu" if placement == "cpu" else ts.Offload(nvme=1.0, nvme_dir=tmp_path, subgroup_numel=1024)
    ours = ts_cls(groups(net_ours, **second), offload=offload, **kw)
    ref = torch_cls(groups(net_ref, **second), **torch_kwargs(torch_cls, kw))
    sched_ours = torch.optim.lr_scheduler.StepLR(ours, step_size=3, gamma=0.5)
    sched_ref = torch.optim.lr_scheduler.StepLR(ref, step_size=3, gamma=0.5)
    train(net_ours, ours, sched=sched_ours)
    train(net_ref, ref, sched=sched_ref)
    assert_same(ours, ref, net_ours, net_ref, exact=False)
    # a frozen parameter never gets state (torch creates none either, except Adagrad, which
    # creates its state for every parameter at construction); the zero-size one gets empty state
    # like torch's (compared above)
    if not case.startswith("adagrad"):
        assert net_ours.frozen not in ours.state
    assert ours.param_groups[0]["lr"] == ref.param_groups[0]["lr"]


@pytest.mark.parametrize("case", ["adamw", "adamw_amsgrad", "adam", "sgd_nesterov", "sgd_momentum", "adagrad"])
def test_reference_kernels_are_bit_identical_to_torch(case: str, monkeypatch) -> None:
    """The pure-torch reference replays torch's single-tensor arithmetic op by op."""
    from tierstate.kernels import reference
    for name in ("adam_update", "adam_update_many", "lion_update", "sgd_update", "adagrad_update", "grad_sumsq"):
        monkeypatch.setattr(kernels, name, getattr(reference, name))
    ts_cls, torch_cls, kw, second = CASES[case]
    net_ours, net_ref = make_net(), make_net()
    ours = ts_cls(groups(net_ours, **second), **kw)
    ref = torch_cls(groups(net_ref, **second), **torch_kwargs(torch_cls, kw))
    train(net_ours, ours)
    train(net_ref, ref)
    assert_same(ours, ref, net_ours, net_ref, exact=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ["adamw", "sgd_momentum", "adagrad", "lion"])
def test_low_precision_params_keep_an_fp32_master(case: str, dtype: torch.dtype) -> None:
    """bf16/fp16 params: the master follows the fp32 reference fed the same gradients, and the
    param is exactly the master rounded to its dtype."""
    ts_cls, torch_cls, kw, second = CASES[case]
    net = make_net(dtype=dtype)
    ours = ts_cls(groups(net, **second), **kw)
    masters = [p.detach().float().clone().requires_grad_(p.requires_grad) for p in net.parameters()]
    ref_groups = [{"params": masters[:4]}, {"params": masters[4:], **second}]
    ref = torch_cls(ref_groups, **torch_kwargs(torch_cls, kw))
    gen = torch.Generator().manual_seed(3)
    for i in range(8):
        x = torch.randn(5, 6, generator=gen).to(dtype)
        ours.zero_grad()
        ref.zero_grad()
        net(x, use_b=i != 2).float().pow(2).mean().backward()
        for p, m in zip(net.parameters(), masters):
            m.grad = None if p.grad is None else p.grad.float()
        ours.step()
        ref.step()
    for (name, p), m in zip(net.named_parameters(), masters):
        if not p.requires_grad or p.numel() == 0:
            continue  # never had a gradient, so no master
        master = ours.state[p]["master"]
        assert master.dtype == torch.float32
        torch.testing.assert_close(master, m.detach(), **FP32_TOL, msg=f"master of {name}")
        assert torch.equal(p.detach(), master.to(dtype)), f"{name} is not its master rounded to {dtype}"


@pytest.mark.parametrize("placement", ["cpu", "nvme"])
def test_adagrad_sums_start_at_the_optimizers_value_whatever_the_groups_say(placement: str, tmp_path) -> None:
    """Every group with a value of its own, the first one too: before, every sum started from
    the first group's value (0.7 here) instead of the optimizer's (0.1), as torch does."""
    net_ours, net_ref = make_net(), make_net()
    offload = "cpu" if placement == "cpu" else ts.Offload(nvme=1.0, nvme_dir=tmp_path, subgroup_numel=1024)
    own = [dict(initial_accumulator_value=0.7), dict(initial_accumulator_value=0.3, lr=1e-2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (test_adagrad_warns_... checks the warning)
        ours = ts.Adagrad([{**g, **o} for g, o in zip(groups(net_ours), own)], lr=5e-2, initial_accumulator_value=0.1,
                          offload=offload)
    ref = torch.optim.Adagrad([{**g, **o} for g, o in zip(groups(net_ref), own)], lr=5e-2,
                              initial_accumulator_value=0.1, foreach=False)
    train(net_ours, ours)
    train(net_ref, ref)
    assert_same(ours, ref, net_ours, net_ref, exact=False)
    ours.close()


MIXED_STATE = {  # one group keeps a state key the other has not: the other's updates must not use it
    "adam_amsgrad_first": (ts.Adam, torch.optim.Adam, dict(amsgrad=True), dict(amsgrad=False, weight_decay=0.1)),
    "adamw_amsgrad_second": (ts.AdamW, torch.optim.AdamW, dict(amsgrad=False), dict(amsgrad=True)),
    # torch ignores dampening without momentum; a momentum buffer of the other group's kind used it
    "sgd_momentum_first": (ts.SGD, torch.optim.SGD, dict(momentum=0.9), dict(momentum=0.0, dampening=0.5)),
}


@pytest.mark.parametrize("placement", ["cpu", "nvme", "device"])
@pytest.mark.parametrize("case", sorted(MIXED_STATE))
def test_a_groups_update_uses_only_its_own_state_keys(case: str, placement: str, tmp_path, monkeypatch) -> None:
    """Before, the sub-group views held every group's keys, and a parameter of a group without
    amsgrad was updated with amsgrad (the max_exp_avg_sq of the layout), one of an SGD group
    without momentum with a momentum buffer (dampening applied): 1e-5 off torch after 3 steps."""
    ts_cls, torch_cls, first, second = MIXED_STATE[case]
    if placement == "device":  # the device tier's own code, run on CPU parameters (see tierstate.Offload)
        monkeypatch.setenv("TIERSTATE_DEVICE_TIER_ON_CPU", "1")
    offload = {"cpu": "cpu", "nvme": ts.Offload(nvme=1.0, nvme_dir=tmp_path, subgroup_numel=1024),
               "device": ts.Offload(gpu=0.5, cpu=0.5, subgroup_numel=1024)}[placement]
    net_ours, net_ref = make_net(), make_net()
    mine = lambda net: [{**g, **o} for g, o in zip(groups(net), (first, second))]  # noqa: E731
    ours = ts_cls(mine(net_ours), lr=5e-2, offload=offload)
    ref = torch_cls(mine(net_ref), lr=5e-2, foreach=False)
    train(net_ours, ours)
    train(net_ref, ref)
    assert_same(ours, ref, net_ours, net_ref, exact=False)
    ours.close()


def test_adagrad_warns_that_a_groups_initial_accumulator_value_is_not_used() -> None:
    """As in torch, a param group's own initial_accumulator_value is kept in the group but every
    sum starts at the optimizer's; tierstate says so (torch is silent), once per group, and not
    for a group that repeats the optimizer's value."""
    net = make_net()
    said = r"param group 1 .*initial_accumulator_value=0\.7.*initial_accumulator_value=0\.1"
    with pytest.warns(UserWarning, match=said) as seen:
        opt = ts.Adagrad(groups(net, initial_accumulator_value=0.7), lr=5e-2, initial_accumulator_value=0.1)
    assert len([w for w in seen if "initial_accumulator_value" in str(w.message)]) == 1
    assert opt.param_groups[1]["initial_accumulator_value"] == 0.7  # kept, as torch keeps it
    assert torch.equal(opt.state[net.b.weight]["sum"], torch.full_like(net.b.weight, 0.1))
    opt.close()


def test_tensor_lr_and_closure() -> None:
    net_ours, net_ref = make_net(), make_net()
    ours = ts.AdamW(net_ours.parameters(), lr=torch.tensor(0.01))
    ref = torch.optim.AdamW(net_ref.parameters(), lr=0.01, foreach=False)
    x = torch.randn(4, 6)
    for net, opt in ((net_ours, ours), (net_ref, ref)):
        for _ in range(7):
            def closure(net=net, opt=opt):
                opt.zero_grad()
                loss = net(x).pow(2).mean()
                loss.backward()
                return loss
            loss = opt.step(closure)
            assert isinstance(loss, torch.Tensor)
    assert_same(ours, ref, net_ours, net_ref, exact=False)


def test_is_a_torch_optimizer_and_hooks_fire() -> None:
    net = make_net()
    opt = ts.AdamW(net.parameters())
    assert isinstance(opt, torch.optim.Optimizer)
    calls = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: calls.append("post"))
    net(torch.randn(2, 6)).sum().backward()
    opt.step()
    assert calls == ["pre", "post"]


def test_zero_grad_keep_zeros_still_steps_like_torch() -> None:
    """zero_grad(set_to_none=False) leaves zero gradients: torch still applies a step (Adam's
    moments decay and weight decay acts), and so must we, with and without streaming."""
    for streaming in (False, True):
        net_ours, net_ref = make_net(), make_net()
        ours = ts.AdamW(net_ours.parameters(), lr=1e-2, offload=ts.Offload(grad_streaming=streaming))
        ref = torch.optim.AdamW(net_ref.parameters(), lr=1e-2, foreach=False)
        for net, opt in ((net_ours, ours), (net_ref, ref)):
            net(torch.ones(3, 6)).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            opt.step()
        assert_same(ours, ref, net_ours, net_ref, exact=False)


def test_parameter_unfrozen_later_gets_state() -> None:
    net_ours, net_ref = make_net(), make_net()
    ours = ts.AdamW(net_ours.parameters(), lr=1e-2)
    ref = torch.optim.AdamW(net_ref.parameters(), lr=1e-2, foreach=False)
    for net, opt in ((net_ours, ours), (net_ref, ref)):
        for i in range(8):
            if i == 3:
                net.frozen.requires_grad_(True)
            opt.zero_grad()
            (net(torch.ones(2, 6)).sum() + (net.frozen.pow(2).sum() if i >= 3 else 0)).backward()
            opt.step()
    assert_same(ours, ref, net_ours, net_ref, exact=False)
