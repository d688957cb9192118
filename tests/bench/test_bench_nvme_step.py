"""``tierstate bench step --offload nvme`` at a tiny size: it times real NVMe steps, moves the
bytes the write-back pool implies, and prices them against disk probes taken around the steps."""
from __future__ import annotations

import argparse
import json

import pytest

from tierstate._native_loader import native_status
from tierstate.bench import nvme_step

pytestmark = pytest.mark.skipif(not native_status()[0], reason="the NVMe tier needs the native I/O engine")


def _run(tmp_path, *extra: str) -> dict:
    parser = argparse.ArgumentParser()
    nvme_step.add_arguments(parser)
    # 8 sub-groups of 256 Ki elements (fp32 m and v: 2 MiB records), a pool of 4 buffers
    args = parser.parse_args(["--params", "2097152", "--param-numel", "524288", "--subgroup-numel", "262144",
                              "--buffer-count", "4", "--steps", "3", "--warmup", "1", "--probe-bytes", "8M",
                              "--nvme-dir", str(tmp_path), *extra])
    return nvme_step.run(args)


def test_step_moves_what_the_pool_cannot_hold_and_is_priced_against_its_probes(tmp_path):
    r = _run(tmp_path)
    record = 2 * (256 << 10) * 4
    assert (r["subgroups"], r["buffer_count"], r["pool_bytes"]) == (8, 4, 4 * record)
    # the last 4 records of a step stay dirty in the pool and serve the next: 8 - 4 move each way
    assert r["read_bytes"] == r["write_bytes"] == 4 * record
    assert r["state_bytes"] == 8 * record and r["direct"]
    for read, write in zip(r["read_bytes_per_step"], r["write_bytes_per_step"]):
        assert read == write == 4 * record
    d = r["disk"]
    assert d["probes"] == 3 and len(d["per_probe"]) == 3  # before, halfway, after
    for key in ("write_gbps", "read_gbps", "mixed_gbps"):
        assert sorted(p[key] for p in d["per_probe"])[1] == d[key] > 0
    serial = r["read_bytes"] / (d["read_gbps"] * 1e9) + r["write_bytes"] / (d["write_gbps"] * 1e9)
    assert r["io_serial_s"] == pytest.approx(serial)
    assert r["io_floor_s"] == min(r["io_serial_s"], r["io_mixed_s"])
    assert r["floor_s"] == max(r["io_floor_s"], r["cpu_step_s"])
    assert r["ratio"] == pytest.approx(r["nvme_step_s"] / r["floor_s"])
    assert len(r["nvme_steps_s"]) == len(r["cpu_steps_s"]) == 3
    assert r["kernels"] not in ("reference", None)
    table = nvme_step.format_table(r)
    assert "8 x 256 Ki elems; pool 4 x 2 MiB" in table and "median of 3 probes" in table
    json.dumps(r)  # --json prints it


def test_bf16_parameters_keep_an_fp32_master_in_each_record(tmp_path):
    r = _run(tmp_path, "--dtype", "bf16")
    record = 3 * (256 << 10) * 4  # master, m, v
    assert r["read_bytes"] == r["write_bytes"] == 4 * record


def test_a_short_last_record_moves_its_own_size(tmp_path):
    """2M parameters in 256 Ki-element sub-groups: the eighth record is short. A step reads the
    records the pool lacks and writes back the ones it evicts: the two sets are complementary, so
    every step moves the whole state once, each record at its own size."""
    r = _run(tmp_path, "--params", "2M", "--param-numel", "500k")  # later flags win
    full, short = 2 * (256 << 10) * 4, 2 * (2_000_000 - 7 * (256 << 10)) * 4
    assert r["state_bytes"] == 7 * full + _align(short // 2) * 2
    for read, write in zip(r["read_bytes_per_step"], r["write_bytes_per_step"]):
        assert read + write == r["state_bytes"]
        assert {read, write} == {4 * full, 3 * full + _align(short // 2) * 2}


def _align(n: int) -> int:
    return -(-n // 4096) * 4096
