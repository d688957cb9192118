"""stats() reports what the NVMe tier moves per parameter, and compressed state moves less:
records of 6.03 B/param with 8-bit moments and an fp32 master, against 12 B for fp32 state;
a bf16 parameter on the host is its own bf16 master, so a bf16 master adds only its
compensation (4.03 B in all) or nothing (stochastic rounding: 2.03 B); an fp32 parameter
under a bf16 master keeps the master in the records (6.03 / 4.03 B). Real files, real reads
and writes."""
from __future__ import annotations

import pytest
import torch

import tierstate as ts

N = 3 * (1 << 20)  # three sub-groups of 1 Mi elements: 4 KiB alignment is < 0.1 % of a region


@pytest.mark.parametrize("moment, master, record, maps, dtype", [
    (torch.float32, torch.float32, 12.0, "dynamic", torch.bfloat16),
    (torch.bfloat16, torch.float32, 8.0, "dynamic", torch.bfloat16),
    ("q8", torch.float32, 6.03125, "dynamic", torch.bfloat16),
    ("q8", "bf16_kahan", 4.03125, "dynamic", torch.bfloat16),
    ("q8", "bf16_sr", 2.03125, "dynamic", torch.bfloat16),
    ("q8", torch.float32, 6.03125, "fp8", torch.bfloat16),
    ("q8", "bf16_kahan", 4.03125, "fp8", torch.bfloat16),
    ("q8", "bf16_sr", 2.03125, "fp8", torch.bfloat16),
    ("q8", torch.float32, 2.03125, "dynamic", torch.float32),  # an fp32 host parameter: its own fp32 master
    ("q8", "bf16_kahan", 6.03125, "dynamic", torch.float32),
    ("q8", "bf16_sr", 4.03125, "dynamic", torch.float32),
], ids=lambda v: str(v).removeprefix("torch."))
def test_nvme_bytes_per_param_in_stats(moment, master, record, maps, dtype, tmp_path):
    p = torch.nn.Parameter(torch.randn(N).to(dtype))
    opt = ts.AdamW([p], lr=1e-3, offload=ts.Offload(
        cpu=0.0, nvme=1.0, nvme_dir=str(tmp_path), moment_dtype=moment, master_dtype=master,
        subgroup_numel=1 << 20, buffer_count=2, quant_map=maps))
    for _ in range(3):
        p.grad = torch.randn_like(p)
        opt.step()
    moved = opt.stats().nvme_bytes_per_param
    assert moved["record"] == pytest.approx(record, rel=1e-6)
    # the 2-buffer pool keeps the last 2 of 3 records of a step in RAM: one record moves each way
    assert moved["read"] == pytest.approx(record / 3, rel=1e-6)
    assert moved["write"] == pytest.approx(record / 3, rel=1e-6)
    assert opt.stats().as_dict()["gauges"]["nvme_params"] == N
    opt.close()


def test_no_nvme_tier_reports_none():
    p = torch.nn.Parameter(torch.randn(1000))
    opt = ts.AdamW([p], lr=1e-3, offload=ts.Offload(moment_dtype="q8"))
    p.grad = torch.randn_like(p)
    opt.step()
    assert opt.stats().nvme_bytes_per_param is None
    opt.close()
