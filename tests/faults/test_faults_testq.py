"""Faults and bad inputs for the kernels and the telemetry: each must end in an error that
names the thing at fault (path, argument, variable), or in a result that is still correct,
never in a silent loss found only at the end of a run."""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tierstate
import tierstate.kernels as K
from tierstate.kernels import reference as R
from tierstate.telemetry import Telemetry
from tierstate.telemetry.report import add_arguments, main as report_main

IMPORT_ROOT = Path(tierstate.__file__).resolve().parents[1]
NATIVE_ISAS = [isa for isa in K.available_isas() if isa != "reference"]


@pytest.fixture(autouse=True)
def _no_env_trace(monkeypatch):
    monkeypatch.delenv("TIERSTATE_TRACE", raising=False)


@pytest.fixture
def restore_isa():
    isa, threads = K.current_isa(), K.get_num_threads()
    yield
    K.set_isa(isa)
    K.set_num_threads(threads)


def _report(*argv: str) -> int:
    import argparse
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return report_main(parser.parse_args(list(argv)))


def _one_step(tel: Telemetry) -> None:
    tel.begin_step(0)
    with tel.phase("cpu_update"):
        pass
    tel.end_step()


def test_trace_path_that_is_a_folder_is_refused_at_start(tmp_path):
    """A folder given as the trace path used to be accepted and fail only when the trace was
    written, after the whole run: refused up front, naming the path."""
    tel = Telemetry(log_every=0)
    with pytest.raises(IsADirectoryError) as info:
        tel.start_trace(tmp_path)
    assert info.value.filename == str(tmp_path) and "trace.json" in str(info.value)


def test_trace_in_an_unwritable_folder_is_refused_at_start():
    """A folder where no file can be created (sysfs: EACCES even for root) fails at start_trace
    with the errno and the folder, not at stop_trace after the run."""
    if os.access("/sys", os.W_OK) and not os.path.ismount("/sys"):
        pytest.skip("/sys is writable here")
    tel = Telemetry(log_every=0)
    with pytest.raises(OSError) as info:
        tel.start_trace("/sys/tierstate-trace.json")
    assert info.value.errno is not None and "/sys" in str(info.value)
    _one_step(tel)   # telemetry keeps working without a trace


def test_trace_folder_removed_mid_run_names_the_folder(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    tel = Telemetry(log_every=0)
    tel.start_trace(folder / "t.json")
    _one_step(tel)
    shutil.rmtree(folder)
    with pytest.raises(FileNotFoundError) as info:
        tel.stop_trace()
    assert str(folder) in str(info.value.filename)
    assert not list(tmp_path.rglob(".trace-*"))   # no temp file left anywhere


def test_truncated_trace_fails_the_report_with_its_path(tmp_path, capsys):
    """A trace cut off mid-write (a killed run) is a clean error naming the file, not a traceback."""
    whole = tmp_path / "whole.json"
    tel = Telemetry(log_every=0)
    tel.start_trace(whole)
    _one_step(tel)
    tel.stop_trace()
    cut = tmp_path / "cut.json"
    text = whole.read_text()
    cut.write_text(text[: len(text) // 2])
    assert _report(str(cut), "--out", str(tmp_path / "r")) == 1
    err = capsys.readouterr().err
    assert "cannot read trace" in err and str(cut) in err


def test_trace_with_a_negative_duration_is_reported_not_plotted_silently(tmp_path, capsys):
    trace = tmp_path / "neg.json"
    trace.write_text(json.dumps({"traceEvents": [
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": {"name": "main"}},
        {"ph": "X", "name": "cpu_update", "ts": 10, "dur": -5, "pid": 1, "tid": 1},
    ]}))
    _report(str(trace), "--out", str(tmp_path / "r"))
    err = capsys.readouterr().err
    assert "'dur' must be a finite number >= 0" in err


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_non_finite_gradient_element_stays_in_its_element(bad, restore_isa):
    """One inf/nan gradient element poisons its own weight and moments only, on every ISA and
    at every vector lane: its neighbours match the reference exactly as if it were absent."""
    for isa in NATIVE_ISAS:
        K.set_isa(isa)
        for position in (0, 7, 15, 16, 1022):
            gen = torch.Generator().manual_seed(position)
            n = 1023
            w, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
            g[position] = bad
            m, v = torch.zeros(n), torch.zeros(n)
            hyper = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=True,
                         bias_correction1=0.1, bias_correction2=0.001)
            before, rw, rm, rv = w.clone(), w.clone(), m.clone(), v.clone()
            R.adam_update(rw, g, rm, rv, **hyper)
            K.adam_update(w, g, m, v, **hyper)
            others = torch.arange(n) != position
            assert not torch.isfinite(w[position]), (isa, position)
            assert torch.isfinite(w[others]).all() and torch.isfinite(m[others]).all(), (isa, position)
            # the parity tests' bound: 16 fp32 ulps of the larger of the old and new weight
            scale = torch.maximum(before[others].abs(), rw[others].abs())
            assert bool(((w[others] - rw[others]).abs() <= 16 * 2**-23 * scale).all()), (isa, position)


def test_bad_thread_count_in_the_environment_names_the_variable():
    env = dict(os.environ, TIERSTATE_NUM_THREADS="0",
               PYTHONPATH=os.pathsep.join([str(IMPORT_ROOT), os.environ.get("PYTHONPATH", "")]))
    code = "import torch, tierstate.kernels as K; K.adam_update(torch.zeros(4), torch.zeros(4), torch.zeros(4), " \
           "torch.zeros(4), lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True, " \
           "bias_correction1=0.1, bias_correction2=0.001)"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "TIERSTATE_NUM_THREADS='0' must be a positive integer" in proc.stderr


def test_gradient_on_another_device_is_refused_naming_it():
    w = torch.zeros(8)
    with pytest.raises(ValueError, match=r"adagrad_update: grad is on meta"):
        K.adagrad_update(w, torch.zeros(8, device="meta"), torch.zeros(8), clr=0.1, weight_decay=0.0, eps=1e-10)
    assert torch.equal(w, torch.zeros(8))   # nothing written before the refusal


def test_old_phase_name_is_refused_with_the_new_one():
    tel = Telemetry(log_every=0)
    tel.begin_step(0)
    with pytest.raises(ValueError, match="'clip' is now called 'grad_norm'"):
        with tel.phase("clip"):
            pass
    assert "grad_norm" not in tel.end_step().phases
