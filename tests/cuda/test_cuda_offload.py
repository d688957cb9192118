"""The CUDA paths: gradient streaming on a side stream, pinned staging, weight upload.

Skipped without a GPU (this project's CI has none); `scripts/gpu_check.sh` runs them on a
machine with one. Parity is against torch.optim on an fp32 host copy fed the same
gradients, as in tests/optim/test_parity.py.
"""
from __future__ import annotations

import pytest
import torch

import tierstate as ts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

FP32_TOL = dict(rtol=1e-5, atol=1e-6)  # same reason as tests/optim/test_parity.py


def net(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    # a 4M-element first layer: its gradient spans several 32 MiB-bucket flushes of the stream
    return torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 16)).to(
        "cuda", dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("micro_batches", [1, 4])
def test_cuda_adamw_matches_fp32_reference(dtype: torch.dtype, micro_batches: int) -> None:
    model = net(dtype)
    opt = ts.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    assert opt._engine.parts.grads.stream is not None, "CUDA parameters stream their gradients by default"
    masters = [p.detach().float().cpu().clone().requires_grad_(True) for p in model.parameters()]
    ref = torch.optim.AdamW(masters, lr=1e-3, weight_decay=0.1, foreach=False)
    gen = torch.Generator().manual_seed(1)
    for _ in range(7):
        x = torch.randn(8 * micro_batches, 2048, generator=gen)
        opt.zero_grad()
        for xm in x.chunk(micro_batches):
            model(xm.to("cuda", dtype)).float().pow(2).mean().div(micro_batches).backward()
            assert all(p.grad is None for p in model.parameters()), "device grads are released once copied"
        opt.step()
        # the reference sees what the host received: the streamed (accumulated) gradients
        for i, m in enumerate(masters):
            m.grad = opt._engine.parts.grads.stream.grad(i).view(m.shape).float().clone()
        ref.step()
    torch.cuda.synchronize()
    for p, m in zip(model.parameters(), masters):
        st = opt.state[p]
        assert all(v.device.type == "cpu" for v in st.values()), "optimizer.state holds no device tensors"
        master = st["master"]
        torch.testing.assert_close(master, m.detach(), **FP32_TOL)
        assert torch.equal(p.detach().cpu(), master.to(dtype)), "the device weight is the rounded master"


@pytest.mark.parametrize("micro_batches", [1, 4])
def test_cuda_kept_streamed_gradients_accumulate_once_and_honour_clip_grad_norm(micro_batches: int) -> None:
    """keep_device_grads=True: torch accumulates into param.grad across micro-batches, and the
    side stream's copies must replace the host buffer, not add to it; clip_grad_norm_ by hand
    after backward changes param.grad after its copy, and the step must take the clipped
    values (Gradients.refresh). Before both fixes the CPU twin of this test was 4.6e-2 and
    8.6e-3 off torch (tests/optim/test_step_semantics.py)."""
    model = net(torch.float32)
    opt = ts.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, offload=ts.Offload(keep_device_grads=True))
    assert opt._engine.parts.grads.stream is not None and not opt.releases_param_grads
    masters = [p.detach().cpu().clone().requires_grad_(True) for p in model.parameters()]
    ref = torch.optim.AdamW(masters, lr=1e-3, weight_decay=0.1, foreach=False)
    gen = torch.Generator().manual_seed(3)
    for _ in range(7):
        x = torch.randn(8 * micro_batches, 2048, generator=gen)
        opt.zero_grad()
        for xm in x.chunk(micro_batches):
            model(xm.to("cuda")).pow(2).mean().div(micro_batches).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        for p, m in zip(model.parameters(), masters):
            m.grad = p.grad.detach().cpu().clone()  # what torch's optimizer would step on
        opt.step()
        ref.step()
    torch.cuda.synchronize()
    for p, m in zip(model.parameters(), masters):
        torch.testing.assert_close(p.detach().cpu(), m.detach(), **FP32_TOL)


@pytest.mark.parametrize("offload", [ts.Offload(), ts.Offload(gpu=0.4, cpu=0.6, subgroup_numel=1 << 20)],
                         ids=["host", "device-split"])
def test_cuda_grad_scaler_skips_everywhere_and_backs_off(offload) -> None:
    model = net(torch.float16)
    opt = ts.AdamW(model.parameters(), lr=1e-3, offload=offload)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**16)
    for step in range(4):
        x = torch.randn(8, 2048, device="cuda", dtype=torch.float16)
        opt.zero_grad()
        poison = float("inf") if step == 2 else 1.0
        scaler.scale(model(x).float().pow(2).mean() * poison).backward()
        before = [p.detach().clone() for p in model.parameters()]
        state_before = {i: {k: v.clone() for k, v in st.items()} for i, st in opt.state_dict()["state"].items()}
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        if step == 2:
            torch.cuda.synchronize()
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
            after = opt.state_dict()["state"]
            assert all(torch.equal(after[i][k], v) for i, st in state_before.items() for k, v in st.items())
            assert scaler.get_scale() == scale / 2
    assert opt.skipped_steps == 1


def test_cuda_nvme_equals_cpu_tier(tmp_path) -> None:
    a, b = net(torch.bfloat16), net(torch.bfloat16)
    cpu = ts.AdamW(a.parameters(), lr=1e-3)
    nvme = ts.AdamW(b.parameters(), lr=1e-3, offload=ts.Offload(cpu=0.0, nvme=1.0, nvme_dir=tmp_path / "nv"))
    for _ in range(5):
        x = torch.randn(8, 2048, device="cuda", dtype=torch.bfloat16)
        for model, opt in ((a, cpu), (b, nvme)):
            opt.zero_grad()
            model(x).float().pow(2).mean().backward()
            opt.step()
    torch.cuda.synchronize()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    nvme.close()


# -- the device tier: Offload(gpu=...) -------------------------------------------------------------
# The same checks as tests/tiers/test_device_tier.py (which runs the tier on CPU parameters),
# here with CUDA's fused Adam and streams. The device part is torch's fused kernel, the host
# part the native one: the device part agrees with the cpu-only run at FP32_TOL (the reason is
# in tests/tiers/test_device_tier.py, [Note: the tolerance of the device part]); the host part
# is bit-identical, since its kernels get the same inputs.

def _device_heads(opt) -> list[int]:
    """Leading elements of each trainable parameter held by the device tier."""
    from tierstate.placement import TierKind

    return [sum(seg.numel for seg in opt.layout.segments_of(t) if opt.layout.subgroups[seg.subgroup].tier
                is TierKind.DEVICE) for t in range(len(opt.layout.param_numels))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_device_split_matches_the_cpu_tier(tmp_path, dtype: torch.dtype) -> None:
    a, b = net(dtype), net(dtype)
    # no streaming: the gradients below are set by hand (identical for both), not made by backward
    cpu = ts.AdamW(a.parameters(), lr=1e-3, weight_decay=0.1, offload=ts.Offload(grad_streaming=False))
    split = ts.AdamW(b.parameters(), lr=1e-3, weight_decay=0.1, offload=ts.Offload(
        gpu=0.3, cpu=0.4, nvme=0.3, subgroup_numel=1 << 20, nvme_dir=tmp_path / "nv", grad_streaming=False))
    heads = _device_heads(split)
    assert 0 < heads[0] < a[0].weight.numel(), "the first weight straddles the device and host ranges"
    gen = torch.Generator().manual_seed(2)
    for _ in range(7):
        for p, q in zip(a.parameters(), b.parameters()):
            g = torch.randn(p.shape, generator=gen).to("cuda", dtype)
            p.grad, q.grad = g, g.clone()
        cpu.step()
        split.step()
    torch.cuda.synchronize()
    sd_cpu, sd_split = cpu.state_dict()["state"], split.state_dict()["state"]
    for i, (p, q) in enumerate(zip(a.parameters(), b.parameters())):
        head = heads[i]
        pairs = [("param", p.detach().cpu().reshape(-1), q.detach().cpu().reshape(-1))]
        pairs += [(k, sd_cpu[i][k].reshape(-1), sd_split[i][k].reshape(-1)) for k in sd_cpu[i] if k != "step"]
        for key, x, y in pairs:
            assert y.device.type == "cpu"
            assert torch.equal(x[head:], y[head:]), f"param {i} {key}: host part"
            torch.testing.assert_close(y[:head].float(), x[:head].float(), **FP32_TOL, msg=f"param {i} {key}")
        assert all(v.device.type == "cpu" for v in split.state[q].values()), "optimizer.state holds no device tensors"
        if dtype != torch.float32:
            assert torch.equal(q.detach().cpu(), sd_split[i]["master"].to(dtype)), "the weight is the rounded master"
    split.close()


def test_cuda_device_tier_gradients_stay_on_the_device() -> None:
    model = net(torch.bfloat16)
    opt = ts.AdamW(model.parameters(), lr=1e-3, offload=ts.Offload(gpu=0.5, cpu=0.5, subgroup_numel=1 << 20))
    heads = _device_heads(opt)
    params = list(model.parameters())
    x = torch.randn(8, 2048, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        opt.zero_grad()
        model(x).float().pow(2).mean().backward()
        for p, head in zip(params, heads):
            if head:
                assert p.grad is not None and p.grad.is_cuda, "a device-tier gradient is read where backward left it"
            else:
                assert p.grad is None, "host-tier gradients are streamed and released"
        before = params[0].detach().clone()
        opt.step()
        torch.cuda.synchronize()
        assert not torch.equal(before, params[0])
    assert opt.tier_bytes()["device"] > 0
    assert opt.stats().as_dict()["bytes"].get("device/d2h", 0) > 0  # the host part's gradients crossed


def _train_step(model, opt, x) -> None:
    opt.zero_grad()
    model(x).float().pow(2).mean().backward()
    opt.step()


def test_cuda_device_and_pinned_memory_do_not_grow_over_200_steps() -> None:
    model = net(torch.bfloat16)
    opt = ts.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(8, 2048, device="cuda", dtype=torch.bfloat16)
    for _ in range(10):
        _train_step(model, opt, x)
    torch.cuda.synchronize()
    device_before, pinned_before = torch.cuda.memory_allocated(), opt._engine.pinned_bytes()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(190):
        _train_step(model, opt, x)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == device_before
    assert opt._engine.pinned_bytes() == pinned_before
    # the peak: the steady state plus one gradient bucket in flight at most
    assert torch.cuda.max_memory_allocated() <= device_before + 32 * 2**20 + 2048 * 2048 * 2 + (1 << 20)


def test_cuda_pinned_memory_is_what_the_plan_prices_and_not_rounded(torch_pinned_bytes) -> None:
    """The planner's pinned lines (gradient arena, master and moment arenas, weight staging)
    against what the optimizer page-locked: equal, and none of it from torch's
    power-of-two CachingHostAllocator (io.page_locked_empty)."""
    from tierstate.placement.auto import request_for
    from tierstate.placement.plan_inputs import Placement
    from tierstate.placement.cost_model import memory_breakdown

    torch_pinned_before = torch_pinned_bytes()
    model = net(torch.bfloat16)
    params = list(model.parameters())
    opt = ts.AdamW(params, lr=1e-4)
    _train_step(model, opt, torch.randn(8, 2048, device="cuda", dtype=torch.bfloat16))
    torch.cuda.synchronize()
    req = request_for(params, state_keys=("exp_avg", "exp_avg_sq"))
    planned = sum(m.nbytes for m in memory_breakdown(req, Placement(0.0, 1.0, 0.0)) if m.pinned)
    # within 1 % (slices' alignment); torch's power-of-two rounding would add 20-100 %
    assert abs(opt._engine.pinned_bytes() - planned) <= 0.01 * planned, (opt._engine.pinned_bytes(), planned)
    assert torch_pinned_bytes() == torch_pinned_before


def test_cuda_gradient_copies_overlap_backward_in_the_trace(tmp_path) -> None:
    """The side stream's device-to-host copies, as the trace books them (grad_transfer on lane
    grad-stream, placed on the device's clock), run while backward still computes: with eight
    32 MiB weight gradients, one bucket each, most copies end before backward's last kernel."""
    import time

    from tierstate.telemetry.report import load_trace, parse_trace

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(8)]).to("cuda", torch.bfloat16)
    opt = ts.AdamW(model.parameters(), lr=1e-4)
    path = tmp_path / "trace.json"
    opt.trace(str(path))
    x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)  # ~0.5 ms of backward per layer on an H100
    windows = []
    for _ in range(3):
        opt.zero_grad()
        loss = model(x).float().pow(2).mean()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss.backward()
        torch.cuda.synchronize()  # backward's kernels are done: its end on the host's clock
        t1 = time.perf_counter()
        t_step = time.perf_counter()
        opt.step()
        windows.append((t0, t1, t_step))
    data = parse_trace(load_trace(opt.stop_trace()))
    copies = [(s, e) for lane in data.lanes if lane.name == "grad-stream" for s, e, name, _ in lane.slices
              if name == "grad_transfer"]
    assert copies, [lane.name for lane in data.lanes]
    t0, t1, t_step = windows[-1]
    origin = t_step - data.steps[-1]["ts"] / 1e6  # the trace's zero on perf_counter's clock (to ~0.1 ms)
    bwd_start, bwd_end = (t0 - origin) * 1e6, (t1 - origin) * 1e6
    last = [(s, e) for s, e in copies if s >= bwd_start - 200]
    assert len(last) >= 6, (len(last), copies[-10:], bwd_start, bwd_end)
    during = [e for s, e in last if e < bwd_end - 200]
    assert len(during) >= len(last) // 2, (last, bwd_start, bwd_end)
