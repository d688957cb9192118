"""Gradient accumulation, streaming, clipping, loss scaling and non-finite gradients."""
from __future__ import annotations

import pytest
import torch

import tierstate as ts
from test_parity import assert_same, make_net


def big_and_micro_batches(seed: int = 5):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(16, 6, generator=gen)
    return x, x.chunk(4)


@pytest.mark.parametrize("streaming", [False, True, "keep"])
def test_accumulating_four_micro_batches_equals_one_big_batch(streaming) -> None:
    """"keep": the stream copies each gradient but keeps param.grad, where torch goes on
    accumulating: each copy must replace the host buffer (adding counted the first
    micro-batches again: 4.6e-2 off torch after 3 steps of 2 micro-batches)."""
    net_ours, net_ref = make_net(), make_net()
    ours = ts.AdamW(net_ours.parameters(), lr=1e-2, offload=ts.Offload(
        grad_streaming=bool(streaming), keep_device_grads=streaming == "keep"))
    ref = torch.optim.AdamW(net_ref.parameters(), lr=1e-2, foreach=False)
    for step in range(7):
        x, micro = big_and_micro_batches(step)
        ours.zero_grad()
        for xm in micro:  # mean over the big batch == sum of micro means / 4
            (net_ours(xm).pow(2).mean() / 4).backward()
        if streaming is True:
            # the device gradient was released after its copy to the host
            assert all(p.grad is None for p in net_ours.parameters())
        if streaming == "keep":
            assert all(p.grad is not None for p in net_ours.parameters() if p.requires_grad)
        ours.step()
        ref.zero_grad()
        net_ref(x).pow(2).mean().backward()
        ref.step()
    assert_same(ours, ref, net_ours, net_ref, exact=False)


def test_streaming_can_keep_device_grads() -> None:
    net = make_net()
    opt = ts.AdamW(net.parameters(), offload=ts.Offload(grad_streaming=True, keep_device_grads=True))
    net(torch.randn(3, 6)).sum().backward()
    assert net.a.weight.grad is not None
    opt.step()
    opt.zero_grad()
    assert net.a.weight.grad is None


@pytest.mark.parametrize("max_norm", [0.05, 1e3])
@pytest.mark.parametrize("streaming", [False, True])
def test_clipping_equals_clip_grad_norm_then_torch_adamw(max_norm: float, streaming: bool) -> None:
    net_ours, net_ref = make_net(), make_net()
    ours = ts.AdamW(net_ours.parameters(), lr=1e-2, max_grad_norm=max_norm,
                    offload=ts.Offload(grad_streaming=streaming))
    ref = torch.optim.AdamW(net_ref.parameters(), lr=1e-2, foreach=False)
    gen = torch.Generator().manual_seed(0)
    for _ in range(7):
        x = torch.randn(8, 6, generator=gen) * 3
        ours.zero_grad()
        net_ours(x).pow(2).mean().backward()
        ours.step()
        ref.zero_grad()
        net_ref(x).pow(2).mean().backward()
        norm = torch.nn.utils.clip_grad_norm_(net_ref.parameters(), max_norm)
        torch.testing.assert_close(torch.tensor(ours.last_grad_norm, dtype=torch.float32), norm, rtol=1e-5, atol=0)
        ref.step()
    assert_same(ours, ref, net_ours, net_ref, exact=False)


@pytest.mark.parametrize("amp", [False, True])
@pytest.mark.parametrize("streaming", [False, True], ids=["grads-in-param", "stream-keeping-param-grad"])
def test_clip_grad_norm_by_hand_then_step(amp: bool, streaming: bool) -> None:
    """The torch recipe (scaler.unscale_, clip_grad_norm_, step), on gradients in param.grad
    and on gradients the stream copied during backward while keeping param.grad
    (keep_device_grads): clip_grad_norm_ and unscale_ change param.grad after the copy, and
    the step must use what param.grad holds, as torch's does. Before, the stream's step used
    the stale copies (8.6e-3 off torch after 3 steps)."""
    net_ours, net_ref = make_net(), make_net()
    ours = ts.AdamW(net_ours.parameters(), lr=1e-2,
                    offload=ts.Offload(grad_streaming=streaming, keep_device_grads=streaming))
    ref = torch.optim.AdamW(net_ref.parameters(), lr=1e-2, foreach=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if amp else None
    gen = torch.Generator().manual_seed(2)
    for _ in range(7):
        x = torch.randn(8, 6, generator=gen) * 3
        ours.zero_grad()
        loss = net_ours(x).pow(2).mean()
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(ours)
        else:
            loss.backward()
        torch.nn.utils.clip_grad_norm_(net_ours.parameters(), 0.05)
        if scaler is not None:
            scaler.step(ours)
            scaler.update()
        else:
            ours.step()
        ref.zero_grad()
        net_ref(x).pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(net_ref.parameters(), 0.05)
        ref.step()
    assert_same(ours, ref, net_ours, net_ref, exact=False)


def test_a_gradient_assigned_after_streamed_backward_is_the_one_stepped() -> None:
    """With the stream releasing param.grad, a gradient the user assigns after backward is
    the gradient, as in torch (the copy made during backward is replaced)."""
    net_ours, net_ref = make_net(), make_net()
    ours = ts.AdamW(net_ours.parameters(), lr=1e-2, offload=ts.Offload(grad_streaming=True))
    ref = torch.optim.AdamW(net_ref.parameters(), lr=1e-2, foreach=False)
    for step in range(3):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
        for net, opt in ((net_ours, ours), (net_ref, ref)):
            opt.zero_grad()
            net(x).pow(2).mean().backward()
            net.a.weight.grad = torch.full_like(net.a.weight, 0.25)
            opt.step()
    assert_same(ours, ref, net_ours, net_ref, exact=False)


def snapshot(opt: torch.optim.Optimizer, net) -> dict:
    sd = opt.state_dict()
    return {
        "params": [p.detach().clone() for p in net.parameters()],
        "state": {i: {k: v.clone() for k, v in st.items()} for i, st in sd["state"].items()},
    }


def assert_snapshots_equal(a: dict, b: dict) -> None:
    for x, y in zip(a["params"], b["params"]):
        assert torch.equal(x, y)
    assert a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        for k in a["state"][i]:
            assert torch.equal(a["state"][i][k], b["state"][i][k]), f"state {i}/{k} changed"


@pytest.mark.parametrize("streaming", [False, True])
def test_grad_scaler_matches_unscaled_training_and_skips_inf_steps(streaming: bool) -> None:
    """Power-of-two loss scales unscale exactly, so scaled training is bit-identical to
    unscaled training; a step with an inf gradient leaves every state bit-identical and
    makes the scaler back off."""
    net_ours, net_plain = make_net(), make_net()
    ours = ts.AdamW(net_ours.parameters(), lr=1e-2, offload=ts.Offload(grad_streaming=streaming))
    plain = ts.AdamW(net_plain.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
    gen = torch.Generator().manual_seed(0)
    for step in range(8):
        x = torch.randn(4, 6, generator=gen)
        poison = torch.tensor(float("inf") if step == 4 else 1.0)
        ours.zero_grad()
        scaler.scale(net_ours(x).pow(2).mean() * poison).backward()
        before = snapshot(ours, net_ours)
        scale_before = scaler.get_scale()
        scaler.step(ours)
        scaler.update()
        if step == 4:
            assert_snapshots_equal(before, snapshot(ours, net_ours))
            assert scaler.get_scale() == scale_before / 2
            assert ours.skipped_steps == 1
            continue
        plain.zero_grad()
        net_plain(x).pow(2).mean().backward()
        plain.step()
        assert_snapshots_equal(snapshot(ours, net_ours), snapshot(plain, net_plain))


@pytest.mark.parametrize("streaming", [False, True])
def test_nonfinite_gradient_skips_and_leaves_state_untouched(streaming: bool, caplog) -> None:
    net = make_net()
    opt = ts.AdamW(net.parameters(), lr=1e-2, offload=ts.Offload(grad_streaming=streaming))
    for _ in range(3):
        opt.zero_grad()
        net(torch.randn(4, 6)).pow(2).mean().backward()
        opt.step()
    before = snapshot(opt, net)
    opt.zero_grad()
    (net(torch.randn(4, 6)).pow(2).mean() * torch.tensor(float("nan"))).backward()
    with caplog.at_level("WARNING", logger="tierstate"):
        opt.step()
    assert_snapshots_equal(before, snapshot(opt, net))
    assert opt.skipped_steps == 1
    assert "step skipped" in caplog.text
    assert opt.stats().as_dict()["counters"].get("skipped_steps") == 1


def test_nonfinite_gradient_raises_when_asked() -> None:
    net = make_net()
    opt = ts.AdamW(net.parameters(), on_nonfinite="raise")
    (net(torch.randn(4, 6)).sum() * torch.tensor(float("inf"))).backward()
    with pytest.raises(FloatingPointError, match="non-finite gradient"):
        opt.step()
    assert not opt.state or all(float(st.get("step", 0)) == 0 for st in opt.state.values())


def test_grad_scaler_attribute_protocol(caplog) -> None:
    """GradScaler's newer contract (grad_scale / found_inf set on the optimizer, as when a
    wrapper such as Accelerate's hides the grad_scaler argument): unscale, or skip silently."""
    net_ours, net_plain = make_net(), make_net()
    ours = ts.AdamW(net_ours.parameters(), lr=1e-2)
    plain = ts.AdamW(net_plain.parameters(), lr=1e-2)
    x = torch.randn(4, 6)
    (net_ours(x).pow(2).mean() * 1024).backward()
    ours.grad_scale, ours.found_inf = torch.tensor(1024.0), torch.tensor(0.0)
    ours.step()
    net_plain(x).pow(2).mean().backward()
    plain.step()
    assert_snapshots_equal(snapshot(ours, net_ours), snapshot(plain, net_plain))
    before = snapshot(ours, net_ours)
    ours.found_inf = torch.tensor(1.0)
    with caplog.at_level("WARNING", logger="tierstate"):
        ours.step()
    assert_snapshots_equal(before, snapshot(ours, net_ours))
    assert ours.skipped_steps == 1 and "step skipped" not in caplog.text


@pytest.mark.parametrize("cls", [ts.AdamW, ts.SGD, ts.Adagrad, ts.Adam])
def test_found_inf_without_grad_scale_skips_the_step(cls) -> None:
    """torch's test_fused_does_not_step_if_foundinf: found_inf set on the optimizer and
    grad_scale None (nothing to unscale) still skips the step, as torch's fused step does
    (found 2026-12-07: the step ran)."""
    for grad_scale in (None, torch.ones(1)):
        params = [torch.nn.Parameter(torch.ones(1)) for _ in range(2)]
        opt = cls(params, lr=0.1, fused=True)
        for p in params:
            p.grad = torch.ones_like(p)
        opt.grad_scale, opt.found_inf = grad_scale, torch.ones(())
        opt.step()
        assert all(torch.equal(p.detach(), torch.ones(1)) for p in params)
        for p in params:
            if "step" in opt.state[p]:
                assert torch.equal(opt.state[p]["step"], torch.zeros(()))
        opt.close()


@pytest.mark.parametrize("ts_cls, torch_cls, kwargs", [
    (ts.AdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    (ts.SGD, torch.optim.SGD, dict(lr=1e-2, momentum=0.9)),
    (ts.Adagrad, torch.optim.Adagrad, dict(lr=0.1)),
])
def test_tensors_without_requires_grad_step_when_given_a_grad(ts_cls, torch_cls, kwargs) -> None:
    """torch steps every parameter whose .grad is set, whatever its requires_grad (its own
    tests build plain tensors and assign .grad by hand); so does tierstate (found
    2026-12-07: such tensors were never stepped), without a warning for plain tensors."""
    import warnings

    gen = torch.Generator().manual_seed(0)
    ours = [torch.randn(10, 5, generator=gen), torch.randn(10, generator=gen)]
    theirs = [t.clone() for t in ours]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = ts_cls(ours, **kwargs)
    ref = torch_cls(theirs, foreach=False, **kwargs)
    for step in range(8):
        grads = [torch.randn(t.shape, generator=torch.Generator().manual_seed(step)) for t in ours]
        for a, b, g in zip(ours, theirs, grads):
            a.grad, b.grad = g.clone(), g.clone()
        if step == 3:  # one without a gradient this step
            ours[1].grad = theirs[1].grad = None
        opt.step()
        ref.step()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(ours, theirs):
        for key, value in ref.state[b].items():
            torch.testing.assert_close(opt.state[a][key], value, rtol=1e-5, atol=1e-6)
    opt.close()
