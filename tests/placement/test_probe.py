"""`tierstate probe`: a real (quick) measurement, the saved profile, and the planner reading it."""
import argparse
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tierstate.placement import probe
from tierstate.placement.plan_inputs import Hardware


@pytest.fixture(scope="module")
def quick_profile(tmp_path_factory):
    return probe.run_probe([str(tmp_path_factory.mktemp("nvme"))], quick=True)


def test_quick_profile_has_every_measurement_with_method_and_units(quick_profile):
    p = quick_profile
    assert p["schema_version"] == probe.SCHEMA_VERSION and p["mode"] == "quick"
    assert p["machine"]["logical_cpus"] >= 1 and p["machine"]["memory_total_bytes"] > 2**30
    m = p["measurements"]
    for key in ("host_memory_bandwidth", "optimizer_step", "grad_sumsq", "host_matmul"):
        assert m[key]["method"] and m[key]["units"] and m[key]["best"] > 0, key
    assert "1" in m["host_memory_bandwidth"]["by_threads"]
    # a triad moves >= 0.5 GB/s and < 10 TB/s on any machine this runs on
    assert 5e8 < m["host_memory_bandwidth"]["best"] < 1e13
    assert m["optimizer_step"]["best_threads"] in {int(t) for t in m["optimizer_step"]["by_threads"]}
    (disk,) = m["nvme"]
    assert disk["read_bytes_per_s"] > 1e6 and disk["write_bytes_per_s"] > 1e6 and disk["bytes"] == 64 << 20
    assert "cuda" in m and ("skipped" in m["cuda"] or m["cuda"]["h2d_bytes_per_s"] > 0)
    assert p["duration_s"] < 60


def test_probe_leaves_no_file_behind(tmp_path):
    probe.measure_disk(tmp_path, 8 << 20, 1)
    assert list(tmp_path.iterdir()) == []


def test_profile_roundtrip_and_the_planner_reads_it(quick_profile, tmp_path):
    path = probe.save_profile(quick_profile, tmp_path / "hw.json")
    loaded = probe.load_profile(path)
    assert loaded == json.loads(json.dumps(quick_profile))
    hw = Hardware.from_profile(loaded, source="test")
    m = quick_profile["measurements"]
    assert hw.step_params_per_s == m["optimizer_step"]["best"]
    assert hw.disk_read == m["nvme"][0]["read_bytes_per_s"]
    by_maps = m["compressed_step"]["by_maps"]
    assert set(by_maps) == {"dynamic", "fp8"} and all(r > 0 for r in by_maps.values())
    assert hw.compressed_rate("fp8") == by_maps["fp8"] and hw.compressed_rate("dynamic") == by_maps["dynamic"]
    # a profile saved before the 8-bit rates were probed: the conservative rates, scaled by how
    # much faster this machine's fp32 step is than the conservative one
    del loaded["measurements"]["compressed_step"]
    old = Hardware.from_profile(loaded, source="test")
    scale = hw.step_params_per_s / Hardware.conservative().step_params_per_s
    assert old.compressed_rate("fp8") == pytest.approx(Hardware.conservative().compressed_rate("fp8") * scale)


def test_default_path_honours_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("TIERSTATE_PROFILE", str(tmp_path / "p.json"))
    assert probe.default_profile_path() == tmp_path / "p.json"
    monkeypatch.delenv("TIERSTATE_PROFILE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert probe.default_profile_path() == tmp_path / "tierstate" / "hardware.json"
    assert probe.load_profile() is None  # absent: None, not an error


def test_a_foreign_or_old_profile_is_refused_with_the_fix(tmp_path):
    bad = tmp_path / "hw.json"
    bad.write_text(json.dumps({"schema_version": 0}))
    with pytest.raises(ValueError, match="re-run `tierstate probe`"):
        probe.load_profile(bad)
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        probe.load_profile(bad)


def test_unusable_nvme_dir_is_an_oserror_naming_it(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OSError, match="--nvme-dir"):
        probe.measure_disk(blocker / "sub", 8 << 20, 1)


def test_cli_main_saves_where_asked(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(probe, "run_probe", lambda dirs, quick: {**_FAKE_RESULT, "mode": "quick" if quick else "x"})
    parser = argparse.ArgumentParser()
    probe.add_arguments(parser)
    out = tmp_path / "saved.json"
    assert probe.main(parser.parse_args(["--quick", "--out", str(out), "--json"])) == 0
    assert json.loads(out.read_text())["mode"] == "quick"
    assert json.loads(capsys.readouterr().out)["schema_version"] == probe.SCHEMA_VERSION


_FAKE_RESULT = {"schema_version": probe.SCHEMA_VERSION, "measurements": {}, "notes": []}


def _sysfs_cache_sizes() -> list[int]:
    """Every cache size Linux lists for CPU 0, read here independently of the probe."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
        digits = text[:-1] if scale > 1 else text
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return sizes


def _getconf_l3() -> int:
    getconf = shutil.which("getconf")
    out = subprocess.run([getconf, "LEVEL3_CACHE_SIZE"], capture_output=True, text=True).stdout.strip() \
        if getconf else ""
    return int(out) if out.isdigit() else 0


def test_rate_probes_are_sized_to_stream_beyond_the_last_level_cache():
    """A kernel probe whose arrays fit in cache measures the cache (1.6x too fast on a 300 MiB-L3
    VM). sysfs and glibc disagree on some VMs (a Zen 4 EPYC VM: sysfs 32 MiB, the L3 slice of one
    core complex; glibc 320 MiB), and the probe takes the larger, so its arrays stream past twice
    whichever cache is real."""
    sysfs, glibc = max(_sysfs_cache_sizes(), default=0), _getconf_l3()
    sources = probe.cache_sizes()
    assert sources["sysfs"] >= sysfs          # >=: caches of further core complexes add up
    assert sources["getconf"] == glibc
    llc = probe.last_level_cache_bytes()
    assert llc == max(sources.values()) >= max(sysfs, glibc)
    n = probe.beyond_cache_numel(1024, 16)
    assert n >= 1024 and n * 16 >= 2 * max(sysfs, glibc)
    assert probe.beyond_cache_numel(10**12, 16) == 10**12  # already beyond: unchanged


def test_sysfs_cache_sizes_add_up_over_core_complexes(tmp_path):
    """Two CPUs on two L3 slices (an AMD VM whose vCPUs span two core complexes) reach both."""
    for cpu, shared in ((0, "0"), (1, "1")):
        for idx, (level, size, kind) in enumerate(((1, "32K", "Data"), (2, "1024K", "Unified"),
                                                    (3, "32768K", "Unified"))):
            d = tmp_path / f"cpu{cpu}" / "cache" / f"index{idx}"
            d.mkdir(parents=True)
            (d / "level").write_text(f"{level}\n")
            (d / "size").write_text(f"{size}\n")
            (d / "type").write_text(f"{kind}\n")
            (d / "shared_cpu_list").write_text(f"{shared if level == 3 else cpu}\n")
    assert probe.sysfs_last_level_cache_bytes(tmp_path, cpus=[0, 1]) == 64 << 20
    assert probe.sysfs_last_level_cache_bytes(tmp_path, cpus=[1]) == 32 << 20
    assert probe.sysfs_last_level_cache_bytes(tmp_path / "absent", cpus=[0]) == 0


def test_matmul_products_are_sized_to_the_time_budget():
    """Without bf16 matrix units a bf16 torch.mm runs at ~1 GFLOP/s (a Zen 1 EPYC), where the
    1024 x 1024 products the probe asks for take 2.1 s each: the quick probe, meant to take
    ~5 s, took 12 s. Each dtype's products are cut to the largest multiple of 64 that a
    trial product says fits the per-product budget, and the size is recorded."""
    fast = probe.measure_host_matmul(192, 1, product_budget_s=60.0)
    assert {r["size"] for r in fast["by_dtype"].values()} == {192}, "within the budget: the size asked for"
    tight = probe.measure_host_matmul(1024, 1, product_budget_s=1e-9)
    assert {r["size"] for r in tight["by_dtype"].values()} == {64}, "no budget: the smallest size"
    for r in (*fast["by_dtype"].values(), *tight["by_dtype"].values()):
        assert r["median"] > 0 and r["samples"] == 1
    assert "size" in tight["method"]
    assert tight["best"] == tight["by_dtype"]["float32"]["median"]
