"""Parameters the user changes between steps: their values (written in place or through
``param.data``), their shape or dtype, and an optimizer used after ``close()``.

torch's optimizers read the parameter at every step, so a value written into it between steps
is what the next step trains from. tierstate keeps a master copy for low-precision parameters
(and a 16-bit master with compensation for fp32 ones under 8-bit state): the master must
follow what the user wrote, or the next step writes the old weights back (found 2026-12-07:
a pruning mask applied in place to bf16 weights was undone by the next step). A parameter
whose shape or dtype changed under the optimizer was stepped over the old layout without a
word, or failed in a kernel's words.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

import tierstate as ts

FP32_TOL = dict(rtol=1e-5, atol=1e-6)
HYPER = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)


def _offload(kind: str, tmp_path, **compression) -> ts.Offload:
    if kind == "cpu":
        return ts.Offload(cpu=1.0, **compression)
    if kind == "nvme":
        return ts.Offload(nvme=1.0, nvme_dir=str(tmp_path / "nv"), subgroup_numel=1024, buffer_count=2, **compression)
    return ts.Offload(cpu=0.5, nvme=0.5, nvme_dir=str(tmp_path / "nv"), subgroup_numel=1024, buffer_count=2,
                      **compression)


def _grads(gen, params, dtype):
    return [torch.randn(p.shape, generator=gen).to(dtype) for p in params]


@pytest.mark.parametrize("kind", ["cpu", "nvme", "split"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_mask_applied_in_place_to_low_precision_weights_is_kept_by_their_master(tmp_path, kind, dtype) -> None:
    """The reference is torch's AdamW over fp32 copies (what tierstate's master stands for) fed
    the same gradients, the mask applied to it too: every step after the mask matches it."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(48, 40, generator=gen).to(dtype)),
              torch.nn.Parameter(torch.randn(40, generator=gen).to(dtype))]
    ref = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
    opt = ts.AdamW(params, offload=_offload(kind, tmp_path), **HYPER)
    theirs = torch.optim.AdamW(ref, **HYPER, foreach=False)
    masks = [torch.rand(p.shape, generator=gen) > 0.5 for p in params]
    for step in range(8):
        if step == 3:
            with torch.no_grad():
                for p, q, m in zip(params, ref, masks):
                    p.mul_(m)
                    q.mul_(m)
        for p, q, g in zip(params, ref, _grads(gen, params, dtype)):
            p.grad, q.grad = g, g.float()
        opt.step()
        theirs.step()
    for p, q in zip(params, ref):
        master = opt.state[p]["master"]
        torch.testing.assert_close(master, q.detach(), **FP32_TOL)
        assert torch.equal(p.detach(), master.to(dtype)), "the parameter is not its master rounded"
    opt.close()


@pytest.mark.parametrize("kind", ["cpu", "nvme"])
def test_new_weights_given_through_data_are_trained_from(tmp_path, kind) -> None:
    gen = torch.Generator().manual_seed(1)
    p = torch.nn.Parameter(torch.randn(64, 33, generator=gen).to(torch.bfloat16))
    opt = ts.AdamW([p], offload=_offload(kind, tmp_path), **HYPER)
    p.grad = torch.randn(p.shape, generator=gen).to(torch.bfloat16)
    opt.step()
    new = torch.randn(p.shape, generator=gen).to(torch.bfloat16)
    p.data = new.clone()  # e.g. weights loaded into the model after the optimizer was built and stepped
    ref = torch.nn.Parameter(new.float())
    theirs = torch.optim.AdamW([ref], **HYPER, foreach=False)
    theirs.load_state_dict({"state": {0: {k: v.clone() for k, v in opt.state_dict()["state"][0].items()
                                          if k != "master"}}, "param_groups": theirs.state_dict()["param_groups"]})
    for _ in range(4):
        g = torch.randn(p.shape, generator=gen).to(torch.bfloat16)
        p.grad, ref.grad = g, g.float()
        opt.step()
        theirs.step()
    torch.testing.assert_close(opt.state[p]["master"], ref.detach(), **FP32_TOL)
    assert torch.equal(p.detach(), opt.state[p]["master"].to(torch.bfloat16))
    opt.close()


@pytest.mark.parametrize("kind", ["cpu", "nvme"])
def test_weights_swapped_out_and_back_leave_the_master_exact(tmp_path, kind) -> None:
    """An EMA's evaluation swap (other weights copied in, the trained ones copied back) writes
    the parameter twice but leaves it as it was: the master keeps its fp32 bits, bit for bit
    as an optimizer whose parameter nobody touched."""
    gen = torch.Generator().manual_seed(2)
    init = torch.randn(300, generator=gen).to(torch.bfloat16)
    grads = [torch.randn(300, generator=gen).to(torch.bfloat16) for _ in range(6)]
    finals = []
    for swap in (False, True):
        p = torch.nn.Parameter(init.clone())
        opt = ts.AdamW([p], offload=_offload(kind, tmp_path / str(swap)), **HYPER)
        for i, g in enumerate(grads):
            if swap and i == 3:
                kept = p.detach().clone()
                with torch.no_grad():
                    p.copy_(torch.zeros_like(p))
                    p.copy_(kept)
            p.grad = g
            opt.step()
        finals.append((p.detach().clone(), opt.state[p]["master"].clone()))
        opt.close()
    assert torch.equal(finals[0][0], finals[1][0]) and torch.equal(finals[0][1], finals[1][1])


@pytest.mark.parametrize("master_dtype", ["bf16_kahan", "bf16_sr"])
@pytest.mark.parametrize("kind", ["cpu", "nvme"])
def test_fp32_weights_written_in_place_are_followed_by_a_16_bit_master(tmp_path, kind, master_dtype) -> None:
    """fp32 parameters under 8-bit state with a bf16 master: after a mask applied in place, a
    step at lr 0 leaves the parameter as masked (it wrote the old weights back before)."""
    gen = torch.Generator().manual_seed(3)
    p = torch.nn.Parameter(torch.randn(2048, generator=gen))
    opt = ts.AdamW([p], offload=_offload(kind, tmp_path, moment_dtype="q8", master_dtype=master_dtype), **HYPER)
    for _ in range(3):
        p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    mask = torch.rand(p.shape, generator=gen) > 0.5
    with torch.no_grad():
        p.mul_(mask)
    masked = p.detach().clone()
    opt.param_groups[0]["lr"] = 0.0
    p.grad = torch.randn(p.shape, generator=gen)
    opt.step()
    assert torch.equal(p.detach()[~mask], torch.zeros_like(masked[~mask])), "the masked weights came back"
    torch.testing.assert_close(p.detach(), masked, rtol=2.0**-23, atol=0)
    opt.close()


def _stepped_once():
    m = torch.nn.Linear(8, 4)
    opt = ts.AdamW(m.parameters(), lr=1e-2)
    m(torch.randn(2, 8)).sum().backward()
    opt.step()
    return m, opt


def test_a_parameter_of_another_shape_is_refused_by_name() -> None:
    m, opt = _stepped_once()
    m.weight.data = torch.randn(5, 8)
    m.weight.grad = torch.randn(5, 8)
    before = m.weight.detach().clone()
    with pytest.raises(RuntimeError, match=r"params\[0\] changed shape from \(4, 8\) to \(5, 8\)"):
        opt.step()
    assert torch.equal(m.weight.detach(), before), "a refused step changed the parameter"


def test_a_parameter_cast_after_the_optimizer_was_built_is_refused_by_name() -> None:
    m, opt = _stepped_once()
    m.half()
    m(torch.randn(2, 8).half()).sum().backward()
    with pytest.raises(RuntimeError, match=r"params\[0\] changed dtype from torch.float32 to torch.float16.*"
                                           r"build the optimizer after"):
        opt.step()


def test_an_optimizer_used_after_close_says_so() -> None:
    m, opt = _stepped_once()
    opt.close()
    opt.close()  # twice is harmless
    for use in (opt.step, opt.state_dict, lambda: opt.load_state_dict({})):
        with pytest.raises(RuntimeError, match=r"closed: close\(\) released"):
            use()
    opt.zero_grad()  # touches only the parameters' gradients
    assert m.weight.grad is None


@pytest.mark.parametrize("master_dtype", ["bf16_kahan", "bf16_sr"])
def test_an_fp32_weight_written_unchanged_gives_back_the_same_16_bit_master(master_dtype) -> None:
    """The refill from the parameter computes the master and its compensation as the kernels
    did: a write that changes no value (``p.add_(0)``) leaves them bit for bit."""
    gen = torch.Generator().manual_seed(4)
    p = torch.nn.Parameter(torch.randn(5000, generator=gen))
    opt = ts.AdamW([p], offload=ts.Offload(cpu=1.0, moment_dtype="q8", master_dtype=master_dtype), **HYPER)
    for _ in range(4):
        p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    keys = [k for k in ("master", "master.comp") if k in opt.state[p]]
    before = {k: opt.state[p][k].clone() for k in keys}
    with torch.no_grad():
        p.add_(0.0)
    opt.param_groups[0]["lr"] = 0.0
    opt.param_groups[0]["weight_decay"] = 0.0
    p.grad = torch.zeros_like(p)
    opt.step()
    for k in keys:
        assert torch.equal(opt.state[p][k], before[k]), k
    opt.close()


@pytest.mark.parametrize("kind", ["cpu", "nvme"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_step_between_forward_and_backward_is_caught_by_autograd_as_in_torch(tmp_path, kind, dtype) -> None:
    """torch's in-place update bumps the parameters' version counters, so a backward through a
    graph that saved the old weights raises. tierstate's kernels write through a pointer and
    bumped nothing (found 2026-12-07): the backward ran and its gradients used the new weights."""
    lin = torch.nn.Linear(8, 8).to(dtype)
    opt = ts.AdamW(lin.parameters(), lr=1e-2, offload=_offload(kind, tmp_path))
    x = torch.randn(4, 8, dtype=dtype, requires_grad=True)
    lin(x).float().square().sum().backward()
    opt.step()
    loss = lin(x).float().square().sum()  # the graph saves the weight
    opt.step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    opt.close()


def _conv_net(dtype) -> torch.nn.Sequential:
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3)).to(dtype)


@pytest.mark.parametrize("kind", ["cpu", "nvme"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("change", ["channels_last", "transposed_in_place"])
def test_memory_laid_out_otherwise_after_the_optimizer_was_built_trains_as_in_torch(tmp_path, kind, dtype,
                                                                                     change) -> None:
    """``model.to(memory_format=torch.channels_last)`` after building the optimizer (torch code
    does it), or a square weight transposed in place: found 2026-12-07, the next step failed inside
    torch ("view size is not compatible with input tensor's size and stride"). Now the parameter
    is given contiguous memory, with a warning, as at construction, and training goes on as
    torch's does over fp32 copies changed the same way."""
    net = _conv_net(dtype)
    square = torch.nn.Parameter(torch.randn(24, 24).to(dtype))
    params = [*net.parameters(), square]
    ref = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
    opt = ts.AdamW(params, offload=_offload(kind, tmp_path), **HYPER)
    theirs = torch.optim.AdamW(ref, **HYPER, foreach=False)
    gen = torch.Generator().manual_seed(4)
    for step in range(8):
        if step == 3:
            if change == "channels_last":
                net.to(memory_format=torch.channels_last)
                with torch.no_grad():
                    for q in ref:
                        if q.dim() == 4:
                            q.data = q.data.contiguous(memory_format=torch.channels_last)
            else:
                with torch.no_grad():
                    square.t_()
                    ref[-1].t_()
                    if dtype != torch.float32:  # new values at each place: the master is filled from them
                        ref[-1].copy_(square.float())
        for p, q, g in zip(params, ref, _grads(gen, params, dtype)):
            p.grad, q.grad = g, g.float()
        if step == 3:
            with pytest.warns(UserWarning, match="not contiguous since the optimizer was built") as caught:
                opt.step()
            named = [0, 2] if change == "channels_last" else [4]  # the two convolutions' weights, or the square
            message = str(caught[0].message)
            assert all(f"params[{i}]" in message for i in named) and message.count("params[") == len(named), message
        else:
            opt.step()
        theirs.step()
    for i, (p, q) in enumerate(zip(params, ref)):
        assert p.is_contiguous()
        if dtype == torch.float32:
            torch.testing.assert_close(p.detach(), q.detach(), **FP32_TOL, msg=f"params[{i}]")
        else:
            torch.testing.assert_close(opt.state[p]["master"], q.detach(), **FP32_TOL, msg=f"params[{i}]")
            assert torch.equal(p.detach(), opt.state[p]["master"].to(dtype))
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt.state[p][key], theirs.state[q][key], **FP32_TOL, msg=f"params[{i}] {key}")
    opt.close()


def test_memory_replaced_by_an_expanded_tensor_between_steps_is_refused_by_name() -> None:
    p = torch.nn.Parameter(torch.randn(4, 5))
    opt = ts.AdamW([p, torch.nn.Parameter(torch.randn(3))], **HYPER)
    p.grad = torch.randn(4, 5)
    opt.step()
    before = opt.state_dict()["state"][0]["exp_avg"].clone()
    p.data = torch.randn(1, 5).expand(4, 5)
    p.grad = torch.randn(4, 5)
    with pytest.raises(RuntimeError, match=r"params\[0\] .*overlap in memory"):
        opt.step()
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], before)
    opt.close()


@pytest.mark.parametrize("kind", ["cpu", "nvme"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_memory_format_changed_mid_training_in_backward_equals_the_plain_step(tmp_path, kind, dtype) -> None:
    """In backward the new memory is given before the first update, inside the backward that saved
    the channels_last weights: the gradients and the steps are those of the plain step, bit for bit."""
    def train(step_in_backward: bool) -> list[torch.Tensor]:
        net = _conv_net(dtype)
        opt = ts.AdamW(net.parameters(), step_in_backward=step_in_backward, max_grad_norm=1.0,
                       offload=_offload(kind, tmp_path / str(step_in_backward)), **HYPER)
        gen = torch.Generator().manual_seed(5)
        for step in range(6):
            if step == 3:
                net.to(memory_format=torch.channels_last)
            # in backward, the warning comes from the first update, during backward
            with pytest.warns(UserWarning, match="since the optimizer was built") if step == 3 else \
                    contextlib.nullcontext():
                net(torch.randn(2, 3, 9, 9, generator=gen).to(dtype)).float().pow(2).mean().backward()
                opt.step()
            opt.zero_grad()
        out = [p.detach().clone() for p in net.parameters()]
        opt.close()
        return out

    for a, b in zip(train(True), train(False)):
        assert torch.equal(a, b)
