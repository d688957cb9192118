"""``tierstate bench step --offload nvme`` at a tiny size: it times real NVMe steps, moves the
bytes the write-back pool implies, and prices each step against the disk probes on either side."""
from __future__ import annotations

import argparse
import json
import statistics

import pytest

from bench_helpers import parse_with
from tierstate._native_loader import native_status
from tierstate.bench import step, step_nvme

pytestmark = pytest.mark.skipif(not native_status()[0], reason="the NVMe tier needs the native I/O engine")


def _parse(argv: list[str]) -> argparse.Namespace:
    return parse_with(step, ["--offload", "nvme", *argv])


def _run(tmp_path, *extra: str) -> dict:
    # 8 sub-groups of 256 Ki elements (fp32 m and v: 2 MiB records), a pool of 4 buffers
    args = _parse(["--params", "2097152", "--param-numel", "524288", "--subgroup-numel", "262144",
                              "--buffer-count", "4", "--steps", "3", "--warmup", "1", "--probe-bytes", "8M",
                              "--nvme-dir", str(tmp_path), *extra])
    results = step_nvme.run(args)
    assert len(results) == 1
    return results[0]


def test_step_moves_what_the_pool_cannot_hold_and_is_priced_against_its_probes(tmp_path):
    r = _run(tmp_path)
    assert r["grad_norm_s"] == 0.0  # the gradients came through autograd: the hooks took the norm
    record = 2 * (256 << 10) * 4
    assert (r["subgroups"], r["buffer_count"], r["pool_bytes"]) == (8, 4, 4 * record)
    # the last 4 records of a step stay dirty in the pool and serve the next: 8 - 4 move each way
    assert r["read_bytes"] == r["write_bytes"] == 4 * record
    assert r["state_bytes"] == 8 * record and r["direct"]
    for read, write in zip(r["read_bytes_per_step"], r["write_bytes_per_step"]):
        assert read == write == 4 * record
    d = r["disk"]
    assert d["probes"] == 4 and len(d["per_probe"]) == 4  # one before the 3 steps, one after each
    for key in ("write_gbps", "read_gbps", "mixed_gbps"):
        assert d[key] == pytest.approx(statistics.median(p[key] for p in d["per_probe"])) and d[key] > 0
    # each step against the mean of the probes before and after it
    assert len(r["per_step"]) == 3
    for i, timed in enumerate(r["per_step"]):
        around = {k: (d["per_probe"][i][k] + d["per_probe"][i + 1][k]) / 2 for k in d["per_probe"][i]}
        serial = r["read_bytes_per_step"][i] / (around["read_gbps"] * 1e9) \
            + r["write_bytes_per_step"][i] / (around["write_gbps"] * 1e9)
        mixed = (r["read_bytes_per_step"][i] + r["write_bytes_per_step"][i]) / (around["mixed_gbps"] * 1e9)
        assert timed["io_s"] == pytest.approx(min(serial, mixed))
        assert timed["floor_s"] == max(timed["io_s"], r["cpu_steps_s"][i])
        assert timed["nvme_s"] == r["nvme_steps_s"][i]
        assert timed["ratio"] == pytest.approx(timed["nvme_s"] / timed["floor_s"])
    assert r["ratio"] == pytest.approx(statistics.median(timed["ratio"] for timed in r["per_step"]))
    # the same at the medians
    serial = r["read_bytes"] / (d["read_gbps"] * 1e9) + r["write_bytes"] / (d["write_gbps"] * 1e9)
    assert r["io_serial_s"] == pytest.approx(serial)
    assert r["io_floor_s"] == min(r["io_serial_s"], r["io_mixed_s"])
    assert r["floor_s"] == max(r["io_floor_s"], r["cpu_step_s"])
    assert r["ratio_of_medians"] == pytest.approx(r["nvme_step_s"] / r["floor_s"])
    assert len(r["nvme_steps_s"]) == len(r["cpu_steps_s"]) == 3
    assert r["kernels"] not in ("reference", None)
    table = step_nvme.format_table(r)
    assert "8 x 256 Ki elems; pool 4 x 2 MiB" in table and "median of 4 probes" in table
    assert "2.0x the pool" in table and "nothing streams" not in table
    json.dumps(r)  # --json prints it


def test_the_table_says_when_the_pool_holds_every_record(tmp_path):
    # compressed state's default pool holds 31-63 records of 4 Mi elements: at 100M (24
    # sub-groups) that is every record, and a step moves nothing once the first has run
    r = _run(tmp_path, "--buffer-count", "8")
    assert (r["subgroups"], r["buffer_count"]) == (8, 8)
    assert r["read_bytes"] == r["write_bytes"] == 0
    assert "1.0x the pool" in step_nvme.format_table(r)
    assert "the pool holds every record, so nothing streams after the first step" in step_nvme.format_table(r)


def test_sizes_run_one_after_the_other_and_json_lists_them(tmp_path, capsys):
    args = _parse(["--params", "1M,2M", "--param-numel", "524288", "--subgroup-numel", "262144",
                              "--buffer-count", "2", "--steps", "1", "--warmup", "1", "--probe-bytes", "4M",
                              "--nvme-dir", str(tmp_path), "--json"])
    assert args.params == [1_000_000, 2_000_000]
    assert step.main(args) == 0
    results = json.loads(capsys.readouterr().out)
    assert [r["params"] for r in results] == [1_000_000, 2_000_000]
    assert [r["subgroups"] for r in results] == [4, 8]


def test_a_size_beyond_host_ram_is_refused_naming_params(tmp_path):
    args = _parse(["--params", "1000T", "--nvme-dir", str(tmp_path)])
    with pytest.raises(SystemExit, match=r"--params 1000000000M needs about .* GiB of host RAM.*smaller --params"):
        step_nvme.run(args)
    assert list(tmp_path.iterdir()) == []  # refused before anything was made


def test_bf16_parameters_keep_an_fp32_master_in_each_record(tmp_path):
    r = _run(tmp_path, "--dtype", "bf16")
    record = 3 * (256 << 10) * 4  # master, m, v
    assert r["read_bytes"] == r["write_bytes"] == 4 * record


@pytest.mark.parametrize("master, per_element", [("fp32", 4 + 2 * (1 + 4 / 256)), ("bf16_kahan", 2 + 2 * (1 + 4 / 256)),
                                                 ("bf16_sr", 2 * (1 + 4 / 256))])
def test_compressed_records_of_bf16_parameters_hold_no_master_copy(master, per_element, tmp_path):
    """8-bit moments on bf16 parameters: an fp32 master is in each record; a bf16 master is the
    parameter itself, so a record holds its compensation (bf16_kahan) or nothing more (bf16_sr)."""
    r = _run(tmp_path, "--dtype", "bf16", "--moment-dtype", "q8", "--master-dtype", master)
    assert master in r["moment_dtype"]
    # each key's region of a record is aligned to 4 KiB on its own: codes, scales, [master | comp]
    sub = 256 << 10
    parts = [sub, sub * 4 // 256] * 2 + ([sub * 4] if master == "fp32" else [sub * 2] if master == "bf16_kahan" else [])
    record = sum(_align(b) for b in parts)
    assert record == pytest.approx(sub * per_element, rel=0.01)
    assert r["read_bytes"] == r["write_bytes"] == 4 * record


def test_a_16bit_master_without_8bit_moments_is_refused(capsys):
    assert step_nvme.main(_parse(["--master-dtype", "bf16_sr"])) == 2
    assert "needs --moment-dtype q8" in capsys.readouterr().err


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


def test_default_sizes_that_do_not_fit_are_skipped_and_said(tmp_path, monkeypatch, capsys):
    """Without --params both default sizes run; one that the RAM available cannot hold is
    skipped with a line naming it (here: as if 8 GiB were available, which fits 100M, not 400M)."""
    import psutil

    args = _parse(["--nvme-dir", str(tmp_path)])
    assert args.params is None
    real = psutil.virtual_memory()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real._replace(available=8 << 30))
    assert step_nvme._sizes(args) == [100_000_000]
    assert "skipping the default size 400M: --params 400M needs about 12.9 GiB" in capsys.readouterr().err
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real._replace(available=1 << 30))
    assert step.main(args) == 2
    assert "no default size fits" in capsys.readouterr().err


@pytest.mark.parametrize("layout", [
    [],  # fp32 state: 16 records of 4 Mi elements
    ["--moment-dtype", "q8", "--quant-map", "fp8"],  # an fp32 master: 31 records
    ["--moment-dtype", "q8", "--quant-map", "fp8", "--master-dtype", "bf16_kahan"],  # 47
    ["--moment-dtype", "q8", "--quant-map", "fp8", "--master-dtype", "bf16_sr"],  # 63
])
def test_default_sizes_are_the_same_two_regimes_of_every_layouts_pool(tmp_path, monkeypatch, layout):
    """The default sizes put 1.5x and 6x the default pool's records on disk, whatever the
    state's format: with compressed state (whose default pool holds more, smaller records)
    the fp32 sizes 100M and 400M left every record in the pool at 100M, so that step moved
    nothing, and only 1.5-3x the pool at 400M."""
    import psutil

    from tierstate.placement import DEFAULT_SUBGROUP_NUMEL

    args = _parse(["--dtype", "bf16", "--nvme-dir", str(tmp_path), *layout])
    real = psutil.virtual_memory()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real._replace(available=1 << 50))
    pool_elements = step_nvme.default_pool_records(args) * DEFAULT_SUBGROUP_NUMEL
    small, large = step_nvme._sizes(args)
    assert small / pool_elements == pytest.approx(1.5, rel=0.02)
    assert large / pool_elements == pytest.approx(6.0, rel=0.02)
    if not layout:
        assert (small, large) == (100_000_000, 400_000_000)  # fp32 state's, as documented


def test_gradients_are_delivered_as_backward_delivers_them(tmp_path):
    import torch

    import tierstate as ts

    params, grads = step_nvme._params(3_000, 1_000, torch.bfloat16, seed=0)
    opt = ts.AdamW(params, offload=ts.Offload(cpu=0.0, nvme=1.0, nvme_dir=tmp_path, subgroup_numel=1024,
                                              buffer_count=2))
    for _ in range(2):
        step_nvme.deliver_gradients(params, grads)
        for p, g in zip(params, grads):
            assert torch.equal(p.grad, g) and p.grad.data_ptr() != g.data_ptr()  # a copy: g serves every step
        opt.step()
        assert "grad_norm" not in opt.stats().phases  # taken by the hooks, not by a pass of the step
    for p, g in zip(params, grads):  # assigned instead, the step reads every gradient for the norm
        p.grad = g.clone()
    opt.step()
    assert opt.stats().phases["grad_norm"] > 0
    opt.close()
