"""The optimizer's telemetry: bytes per tier are the analytic count; phases add up to the step."""
from __future__ import annotations

import json

import pytest
import torch

import tierstate as ts
from tierstate.telemetry import validate_trace


def model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 10)).to(dtype)


@pytest.mark.parametrize(
    "dtype, moment_dtype, read_per_param, write_per_param",
    [
        # fp32 params on the CPU are their own master: read grad 4 + param 4 + m 4 + v 4,
        # write param 4 + m 4 + v 4
        (torch.float32, torch.float32, 16, 12),
        # bf16 params: read grad 2 + master 4 + m 4 + v 4; write master 4 + m 4 + v 4 + bf16 weight 2
        (torch.bfloat16, torch.float32, 14, 14),
        # bf16 moments save 4 B each way
        (torch.bfloat16, torch.bfloat16, 10, 10),
    ],
)
def test_host_bytes_are_the_analytic_count(dtype, moment_dtype, read_per_param, write_per_param) -> None:
    net = model(dtype)
    n = sum(p.numel() for p in net.parameters())
    opt = ts.AdamW(net.parameters(), offload=ts.Offload(moment_dtype=moment_dtype))
    for _ in range(2):
        opt.zero_grad()
        net(torch.randn(4, 64, dtype=dtype)).float().sum().backward()
        opt.step()
    stats = opt.stats().as_dict()
    assert stats["bytes"]["host/read"] == read_per_param * n
    assert stats["bytes"]["host/write"] == write_per_param * n
    # state arenas: 2 moments (+ an fp32 master for bf16 params), nothing else
    master = 4 if dtype != torch.float32 else 0
    assert opt.tier_bytes() == {"host": n * (2 * moment_dtype.itemsize + master)}


def test_phases_add_up_to_the_step_and_trace_is_valid(tmp_path) -> None:
    net = model(torch.float32)
    opt = ts.AdamW(net.parameters(), max_grad_norm=1.0)
    trace = tmp_path / "trace.json"
    opt.trace(trace)
    for _ in range(3):
        opt.zero_grad()
        net(torch.randn(4, 64)).sum().backward()
        opt.step()
    stats = opt.stats()
    d = stats.as_dict()
    # the norm for clipping was taken by the gradients' hooks in backward (no read in the step)
    assert d["phases"]["cpu_update"] > 0 and "grad_norm" not in d["phases"]
    # "other" is what no phase covered, so the main lane's phases sum to the wall time
    assert sum(d["phases"].values()) == pytest.approx(d["wall_s"], rel=1e-6, abs=1e-9)
    opt.stop_trace()
    validate_trace(json.loads(trace.read_text()))


def test_probed_peaks_reach_the_stats(tmp_path, monkeypatch) -> None:
    """A saved `tierstate probe` profile puts the peak next to the achieved bandwidth."""
    profile = {"schema_version": 1, "measurements": {"host_memory_bandwidth": {"best": 50e9}, "nvme": [], "cuda": {}}}
    path = tmp_path / "hardware.json"
    path.write_text(json.dumps(profile))
    monkeypatch.setenv("TIERSTATE_PROFILE", str(path))
    net = model(torch.float32)
    opt = ts.AdamW(net.parameters())
    net(torch.randn(4, 64)).sum().backward()
    opt.step()
    host = opt.stats().as_dict()["bandwidth"]["host/rw"]
    assert host["peak_gbps"] == 50.0 and 0 < host["fraction_of_peak"]


def test_broken_profile_is_ignored_with_a_warning(tmp_path, monkeypatch, caplog) -> None:
    path = tmp_path / "hardware.json"
    path.write_text("{not json")
    monkeypatch.setenv("TIERSTATE_PROFILE", str(path))
    with caplog.at_level("WARNING", logger="tierstate"):
        ts.AdamW(model(torch.float32).parameters())
    assert "hardware profile ignored" in caplog.text and str(path) in caplog.text


def test_trace_has_a_lane_per_kernel_thread(tmp_path) -> None:
    from tierstate import kernels

    if not kernels.backend_info()["native"]:
        pytest.skip("worker lanes come from the native thread pool")
    kernels.set_num_threads(2)
    big = torch.nn.Parameter(torch.randn(200_000))  # 13 chunks of 16384: both threads take some
    opt = ts.AdamW([big])
    trace = tmp_path / "workers.json"
    opt.trace(trace)
    for _ in range(2):
        big.grad = torch.randn_like(big)
        opt.step()
    opt.stop_trace()
    events = json.loads(trace.read_text())["traceEvents"]
    validate_trace({"traceEvents": events})
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    worker_tids = {tid for tid, name in names.items() if name.startswith("cpu-worker-")}
    assert {names[t] for t in worker_tids} == {"cpu-worker-0", "cpu-worker-1"}
    slices = [e for e in events if e.get("ph") == "X" and e["tid"] in worker_tids]
    assert len(slices) >= 4 and all(e["name"] == "cpu_update" and e["dur"] > 0 for e in slices)
