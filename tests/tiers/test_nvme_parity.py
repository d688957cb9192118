"""NVMe mode trains bit for bit like CPU mode: same kernels, the state just lives in files.

Small sub-groups (1024-4096 elements) over parameters of awkward sizes make many
sub-groups, parameters straddling them, evictions with 2 buffers, and reversed
schedules; one parameter gets a gradient only every other step (partial schedules)."""
from __future__ import annotations

import pytest
import torch

import tierstate as ts
from tierstate.placement import TierKind

SIZES = (3000, 5000, 1, 700, 7001, 2500)  # 18202 elements
STEPS = 20


def _train(make_opt, dtype: torch.dtype, steps: int = STEPS):
    gen = torch.Generator().manual_seed(1234)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen).to(dtype)) for n in SIZES]
    opt = make_opt(params)
    for step in range(steps):
        for i, p in enumerate(params):
            g = torch.randn(p.shape, generator=gen).to(dtype)
            p.grad = None if (i == 3 and step % 2) else g
        opt.step()
    return params, opt


def _assert_same(cpu, nvme):
    (cpu_params, cpu_opt), (nvme_params, nvme_opt) = cpu, nvme
    for i, (a, b) in enumerate(zip(cpu_params, nvme_params)):
        assert torch.equal(a, b), f"parameter {i} differs"
    sa, sb = cpu_opt.state_dict()["state"], nvme_opt.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for idx in sa:
        assert sa[idx].keys() == sb[idx].keys()
        for key in sa[idx]:
            assert sa[idx][key].dtype == sb[idx][key].dtype
            assert torch.equal(sa[idx][key].reshape(-1), sb[idx][key].reshape(-1)), f"state {idx}/{key} differs"


CASES = {
    "adamw-fp32-b2": (lambda p, o: ts.AdamW(p, lr=1e-2, weight_decay=0.1, offload=o), torch.float32,
                      dict(subgroup_numel=1024, buffer_count=2)),
    "adamw-bf16-master-b4": (lambda p, o: ts.AdamW(p, lr=1e-2, weight_decay=0.1, offload=o), torch.bfloat16,
                             dict(subgroup_numel=4096, buffer_count=4)),
    "adamw-bf16-moments": (lambda p, o: ts.AdamW(p, lr=1e-2, offload=o), torch.float32,
                           dict(subgroup_numel=2048, buffer_count=3, moment_dtype=torch.bfloat16)),
    "adagrad-init": (lambda p, o: ts.Adagrad(p, lr=0.1, initial_accumulator_value=0.37, offload=o),
                     torch.float32, dict(subgroup_numel=1024, buffer_count=2)),
    "sgd-momentum": (lambda p, o: ts.SGD(p, lr=0.05, momentum=0.9, nesterov=True, offload=o), torch.float32,
                     dict(subgroup_numel=4096, buffer_count=4)),
    "sgd-momentum-bf16": (lambda p, o: ts.SGD(p, lr=0.05, momentum=0.9, offload=o), torch.bfloat16,
                          dict(subgroup_numel=1024, buffer_count=2)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_nvme_equals_cpu(case, tmp_path):
    build, dtype, policy = CASES[case]
    moment = policy.get("moment_dtype", torch.float32)
    cpu = _train(lambda p: build(p, ts.Offload(cpu=1.0, moment_dtype=moment, subgroup_numel=policy["subgroup_numel"])),
                 dtype)
    offload = ts.Offload(cpu=0.0, nvme=1.0, nvme_dir=tmp_path / "nv", **policy)
    nvme = _train(lambda p: build(p, offload), dtype)
    tier = nvme[1].tiers[TierKind.NVME]
    assert len(tier.subgroups) >= 5 and tier.direct
    _assert_same(cpu, nvme)
    stats = nvme[1].stats()
    assert stats.bytes.get("nvme/read", 0) > 0 and stats.bytes.get("nvme/write", 0) > 0
    nvme[1].close()


def test_striped_over_two_dirs(tmp_path):
    dirs = [tmp_path / "d0", tmp_path / "d1"]
    build = lambda p, o: ts.AdamW(p, lr=1e-2, offload=o)  # noqa: E731
    cpu = _train(lambda p: build(p, "cpu"), torch.bfloat16)
    nvme = _train(lambda p: build(p, ts.Offload(cpu=0.0, nvme=1.0, nvme_dir=dirs, subgroup_numel=1024,
                                                buffer_count=2)), torch.bfloat16)
    tier = nvme[1].tiers[TierKind.NVME]
    files = tier.files
    assert [f.parent for f in files] == dirs
    # Round-robin: 18 sub-groups -> 9 records per file, each record [master | exp_avg | exp_avg_sq].
    assert all(f.stat().st_size == 9 * tier.record_nbytes for f in files)
    _assert_same(cpu, nvme)
    nvme[1].close()


def test_split_cpu_and_nvme(tmp_path):
    build = lambda p, o: ts.AdamW(p, lr=1e-2, weight_decay=0.05, offload=o)  # noqa: E731
    cpu = _train(lambda p: build(p, "cpu"), torch.float32)
    nvme = _train(lambda p: build(p, ts.Offload(cpu=0.5, nvme=0.5, nvme_dir=tmp_path / "nv", subgroup_numel=1024,
                                                buffer_count=2)), torch.float32)
    opt = nvme[1]
    assert opt.layout.tier_numel[TierKind.HOST] > 0 and opt.layout.tier_numel[TierKind.NVME] > 0
    assert opt.layout.tier_of_param(2) is None or any(opt.layout.tier_of_param(i) is None for i in range(len(SIZES)))
    _assert_same(cpu, nvme)
    opt.close()


def test_state_dict_round_trip_continues_exactly(tmp_path):
    """A CPU-mode state dict loaded into an NVMe-mode optimizer continues bit for bit."""
    build = lambda p, o: ts.AdamW(p, lr=1e-2, offload=o)  # noqa: E731
    ref_params, ref_opt = _train(lambda p: build(p, "cpu"), torch.bfloat16, steps=6)
    sd = ref_opt.state_dict()
    nvme_params = [torch.nn.Parameter(p.detach().clone()) for p in ref_params]
    nvme_opt = build(nvme_params, ts.Offload(cpu=0.0, nvme=1.0, nvme_dir=tmp_path / "nv", subgroup_numel=1024,
                                             buffer_count=2))
    nvme_opt.load_state_dict(sd)
    gen = torch.Generator().manual_seed(99)
    for _ in range(4):
        for a, b in zip(ref_params, nvme_params):
            g = torch.randn(a.shape, generator=gen).to(a.dtype)
            a.grad, b.grad = g, g.clone()
        ref_opt.step()
        nvme_opt.step()
    _assert_same((ref_params, ref_opt), (nvme_params, nvme_opt))
    nvme_opt.close()


def test_first_step_streams_each_record_once(tmp_path):
    """A fresh bf16 parameter's fp32 master is copied in by its first update, inside the record
    the step streams anyway: step 0 reads no record twice (writing the masters through the
    pool beforehand read 21 records and wrote 17 of a 13-record state with 4 buffers)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(12)]).bfloat16()
    opt = ts.AdamW(net.parameters(), lr=1e-3, offload=ts.Offload(cpu=0.0, nvme=1.0, nvme_dir=tmp_path / "s",
                                                                 subgroup_numel=4096, buffer_count=4))
    nvme = opt.tiers[TierKind.NVME]
    records = len(nvme.subgroups)
    assert records >= 3 * 4  # the state is well beyond the pool
    x = torch.randn(8, 64).bfloat16()
    moved = []
    for _ in range(3):
        net(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        moved.append(opt.stats().bytes)
    assert moved[0]["nvme/read"] <= nvme.nbytes  # every record at most once in step 0
    assert moved[0]["nvme/write"] <= (records - 4) * nvme.record_nbytes  # evictions only
    state = opt.state_dict()["state"]
    for index, p in enumerate(net.parameters()):  # and the masters are right: weight == master rounded
        assert torch.equal(state[index]["master"].bfloat16().reshape(p.shape), p.detach())
    opt.close()
