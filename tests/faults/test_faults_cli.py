"""Faults and bad inputs at the command line, the planner's messages and the disk health rule:
each gives a named error or an accurate message, never a traceback or a false statement."""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import tierstate
from tierstate import plan_cli
from tierstate.telemetry.health import HealthMonitor

IMPORT_ROOT = Path(tierstate.__file__).resolve().parents[1]


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 16 MiB filesystem (tmpfs), mounted for the test and unmounted after it."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root and mount(8)")
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"tmpfs mount refused here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_a_small_disk_with_most_of_it_free_is_not_called_nearly_full(small_tmpfs):
    (small_tmpfs / "used").write_bytes(b"x" * (3 << 20))  # 3 of 16 MiB used: 81 % free
    monitor = HealthMonitor()
    monitor.watch_disk(small_tmpfs)
    (finding,) = monitor.findings()      # under the 2 GiB margin: still worth a line, but a true one
    assert "nearly full" not in finding.message
    assert re.search(r"\b81 % of a 16(\.0)? MiB filesystem", finding.message), finding.message
    assert "0.0 GiB" not in finding.message and "13" in finding.message and "MiB free" in finding.message


def test_a_nearly_full_small_disk_is_called_nearly_full(small_tmpfs):
    (small_tmpfs / "used").write_bytes(b"x" * (int(15.6 * 2**20)))  # ~2 % free
    monitor = HealthMonitor()
    monitor.watch_disk(small_tmpfs)
    (finding,) = monitor.findings()
    assert "nearly full" in finding.message and "KiB free" in finding.message, finding.message
    assert "of 16.0 MiB" in finding.message and "0.0 GiB" not in finding.message


def _plan(argv, monkeypatch, tmp_path):
    monkeypatch.setenv("TIERSTATE_PROFILE", str(tmp_path / "absent.json"))
    parser = argparse.ArgumentParser()
    plan_cli.add_arguments(parser)
    return plan_cli.main(parser.parse_args(argv))


def test_plan_prices_the_default_nvme_folder_by_the_disk_it_would_land_on(monkeypatch, tmp_path, capsys):
    # the default NVMe folder does not exist yet; its disk is the one its nearest existing parent is on
    folder = tmp_path / "not" / "yet"
    monkeypatch.setenv("TIERSTATE_NVME_DIR", str(folder))
    free = shutil.disk_usage(tmp_path).free
    assert _plan(["--params", "10M", "--device", "cpu", "--host-mem", "1GiB", "--json"], monkeypatch, tmp_path) == 0
    out = json.loads(capsys.readouterr().out)
    assert abs(out["budgets"]["disk"] - free) < (256 << 20), (out["budgets"], free)
    assert out["budgets"]["disk_dir"] == str(folder)
    assert any(str(folder) in s for s in out["sources"]), out["sources"]
    # and a model that does not fit names that folder and its real free space
    assert _plan(["70B", "--device", "cpu", "--host-mem", "4GiB"], monkeypatch, tmp_path) == 2
    err = capsys.readouterr().err
    assert "0 MiB free" not in err and f"under {folder}" in err, err


def test_plan_does_not_suggest_the_moment_dtype_already_given(monkeypatch, tmp_path, capsys):
    rc = _plan(["70B", "--device", "cpu", "--host-mem", "4GiB", "--disk", "10GiB", "--moment-dtype", "bf16"],
               monkeypatch, tmp_path)
    err = capsys.readouterr().err
    assert rc == 2 and "no placement" in err
    assert "--moment-dtype bf16" not in err, err
    rc = _plan(["70B", "--device", "cpu", "--host-mem", "4GiB", "--disk", "10GiB"], monkeypatch, tmp_path)
    assert rc == 2 and "--moment-dtype bf16" in capsys.readouterr().err


# -- the native module: where the install built it, the suite must fail without it ----------------
TESTS = Path(__file__).resolve().parents[1]


def _suite_with(tmp_path, damage):
    """Copy the installed package (and its dist-info) to ``tmp_path/site``, apply ``damage`` to the
    copy's native module, and run a one-test suite under the project's tests/conftest.py there."""
    import importlib.metadata as md

    site = tmp_path / "site"
    pkg = Path(tierstate.__file__).resolve().parent
    shutil.copytree(pkg, site / "tierstate", ignore=shutil.ignore_patterns("__pycache__"))
    dist = md.distribution("tierstate")
    if Path(dist.locate_file("tierstate/__init__.py")).resolve().parent == pkg:
        info = Path(dist._path)  # the dist-info folder of exactly this install
        shutil.copytree(info, site / info.name)
    suite = tmp_path / "tests"
    suite.mkdir()
    shutil.copy(TESTS / "conftest.py", suite / "conftest.py")
    (suite / "test_one.py").write_text("def test_one():\n    assert True\n")
    natives = sorted((site / "tierstate").glob("_native*"))
    assert natives, "the installed tierstate has no native module to damage"
    damage(natives[0])
    env = {k: v for k, v in os.environ.items() if k != "TIERSTATE_NATIVE_PATH"} | {"PYTHONPATH": str(site)}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(suite)],
                          cwd=suite, env=env, capture_output=True, text=True, timeout=300)


def test_the_suite_passes_with_the_native_module_intact(tmp_path):
    r = _suite_with(tmp_path, lambda so: None)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("damage", [
    pytest.param(lambda so: so.write_bytes(b"\x7fELF not really"), id="corrupt"),
    pytest.param(lambda so: so.unlink(), id="deleted"),
])
def test_a_broken_native_module_fails_the_suite_instead_of_skipping(tmp_path, damage):
    r = _suite_with(tmp_path, damage)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert "native module" in out and "tierstate._native" in out, out


# -- two builds of one checkout at once ----------------------------------------------------------
REPO = TESTS.parent


@pytest.mark.slow
def test_two_installs_from_one_checkout_at_once_both_build(tmp_path):
    """``pip install .`` twice at once from one source tree (two CI jobs, two venvs): each build
    must have its own build folder, or one deletes or rewrites the other's objects mid-compile
    ("opening dependency file ... No such file or directory"). Takes 1-4 minutes on 2 cores."""
    if not (REPO / "pyproject.toml").is_file() or not (REPO / "csrc").is_dir():
        pytest.skip("needs the source checkout next to tests/")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SKBUILD_")}
    procs = [subprocess.Popen([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
                               "--no-cache-dir", "-q", "--target", str(tmp_path / f"target{i}"), str(REPO)],
                              cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    outs = [p.communicate(timeout=1500)[0] for p in procs]
    for i, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"install {i} failed:\n{out[-4000:]}"
        assert list((tmp_path / f"target{i}" / "tierstate").glob("_native*.so")), out[-2000:]
    # each built module loads and runs its kernels
    for i in range(2):
        code = ("import tierstate._native_loader as L; ok, err = L.native_status(); assert ok, err; "
                "print(L.native().__file__)")
        r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                           env={**env, "PYTHONPATH": str(tmp_path / f"target{i}")}, timeout=120)
        assert r.returncode == 0 and f"target{i}" in r.stdout, r.stdout + r.stderr


# -- nonsense arguments at the command line: a one-line named error, never a traceback ------------
def _tierstate(*args, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(IMPORT_ROOT), "TIERSTATE_PROFILE": str(tmp_path / "profile.json"),
           "TIERSTATE_NVME_DIR": str(tmp_path / "nvme")}
    return subprocess.run([sys.executable, "-m", "tierstate", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("args, names", [
    (["probe", "--quick", "--out", "/proc/no/such/profile.json"], ["/proc/no/such/profile.json", "--out"]),
    (["bench", "step", "--sizes", "1M", "--reps", "1", "--warmup", "0", "--variants", "native",
      "--json", "/nonexistent-dir/step.json"], ["/nonexistent-dir/step.json", "Errno"]),
    (["bench", "step", "--offload", "nvme", "--params", "1M", "--steps", "1", "--nvme-dir", "/proc/no/such"],
     ["/proc/no", "Errno"]),
    (["plan", "gpt2", "--compare", "x,mem=80GiB,speed=fast"], ["--compare", "speed='fast'"]),
    (["plan", "gpt2", "--compare", "x,mem=80GiB,speed=0"], ["--compare", "speed='0'"]),
    (["plan", "gpt2", "--profile", "/"], ["--profile", "Is a directory", "'/'"]),
    (["plan", "gpt2", "--nvme-dir", "/etc/hostname"], ["--nvme-dir", "/etc/hostname", "is a file"]),
])
def test_bad_paths_and_values_are_named_errors_not_tracebacks(args, names, tmp_path):
    r = _tierstate(*args, tmp_path=tmp_path)
    assert r.returncode in (1, 2), r.stdout[-2000:] + r.stderr[-2000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("tierstate"), r.stderr[-2000:]
    for name in names:
        assert name in r.stderr, (name, r.stderr[-2000:])
