"""``tierstate report``: PNGs that open, have size and content; a summary that adds up
and names the bottleneck."""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread

from tierstate.telemetry import Telemetry
from tierstate.telemetry.report import add_arguments, main
from telemetry_workload import busy_wait, run_step
import tierstate

# the folder holding the tierstate under test (the checkout, or site-packages when installed):
# children must import that one, whose native module was built
IMPORT_ROOT = Path(tierstate.__file__).resolve().parents[1]


REPO = Path(__file__).resolve().parents[2]


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def _check_png(path: Path, min_w: int, min_h: int, min_coloured: float) -> np.ndarray:
    """Open a PNG and check its size and that it shows data, not just empty axes.

    Axes, ticks and text are grey; bars and lines are coloured. An empty set of axes
    has pixel std ~0.08 and 0 % coloured pixels; the timeline is ~30 % coloured and
    the memory plot (thin lines) ~0.8 %.
    """
    img = imread(path)                               # H x W x 4 floats in [0, 1]
    h, w = img.shape[:2]
    assert w >= min_w and h >= min_h, f"{path.name} is only {w}x{h}"
    rgb = img[..., :3]
    assert rgb.std() > 0.05, f"{path.name} is (nearly) blank"
    coloured = ((rgb.max(axis=-1) - rgb.min(axis=-1)) > 0.2).mean()
    assert coloured >= min_coloured, f"{path.name}: only {coloured:.2%} coloured pixels"
    return img


@pytest.fixture(scope="module")
def workload_trace(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("report") / "workload.json"
    tel = Telemetry(log_every=0)
    tel.set_peaks({"nvme_read_gbps": 3.0})
    tel.start_trace(path)
    for step in range(4):
        run_step(tel, step)
        tel.end_step()
    tel.stop_trace()
    return path


def test_report_writes_pngs_with_content(workload_trace, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(_args(str(workload_trace), "--out", str(out))) == 0
    timeline = _check_png(out / "timeline.png", 800, 200, min_coloured=0.05)
    memory = _check_png(out / "memory.png", 800, 300, min_coloured=0.002)
    assert timeline.shape != memory.shape or not np.array_equal(timeline, memory)
    summary = (out / "summary.txt").read_text()
    assert summary == capsys.readouterr().out.split("wrote ")[0]
    assert "steps: 4 (skipped 0)" in summary
    assert re.search(r"^  io0 +nvme_read \d+%", summary, re.M)


def test_critical_path_shares_add_to_100(workload_trace, tmp_path):
    assert main(_args(str(workload_trace), "--out", str(tmp_path))) == 0
    summary = (tmp_path / "summary.txt").read_text()
    block = summary.split("sum to 100%):\n")[1].split("lanes")[0]
    shares = [float(m) for m in re.findall(r"^  \w+ +([\d.]+)%", block, re.M)]
    assert {"grad_norm", "cpu_update", "nvme_wait", "other"} <= set(re.findall(r"^  (\w+)", block,
                                                                           re.M))
    assert sum(shares) == pytest.approx(100.0, abs=0.5)


def test_default_out_dir_is_beside_the_trace(workload_trace, capsys):
    assert main(_args(str(workload_trace), "--steps", "0")) == 0
    folder = workload_trace.with_name("workload_report")
    assert {p.name for p in folder.iterdir()} == {"timeline.png", "memory.png", "summary.txt"}


def _nvme_bound_trace(path: Path) -> None:
    """Steps that wait on a disk reading 64 MiB in 30 ms (2.24 GB/s) of a 6 GB/s peak."""
    tel = Telemetry(log_every=0, sample_host_rss=False)
    tel.set_peaks({"nvme_read_gbps": 6.0, "host_mem_gbps": 20.0})
    tel.start_trace(path)
    for step in range(3):
        tel.begin_step(step)
        with tel.phase("cpu_update"):
            busy_wait(0.003)
        read_start = time.perf_counter()
        with tel.phase("nvme_wait"):
            time.sleep(0.030)
        # the read's duration as an I/O engine would report it on completion
        tel.add_phase_time("nvme_read", 0.030, lane="nvme0", start=read_start)
        tel.add_bytes("nvme", "read", 64 << 20)
        tel.end_step()
    tel.stop_trace()


def test_summary_names_the_bottleneck_with_its_bandwidth(tmp_path, capsys):
    trace = tmp_path / "nvme.json"
    _nvme_bound_trace(trace)
    assert main(_args(str(trace), "--out", str(tmp_path / "r"))) == 0
    summary = (tmp_path / "r" / "summary.txt").read_text()
    line = next(ln for ln in summary.splitlines() if ln.startswith("bottleneck:"))
    assert line.startswith("bottleneck: nvme_wait on lane 'main',")
    share = int(re.search(r"(\d+)% of the critical path", line).group(1))
    assert share >= 50
    assert "nvme/read 2.24 GB/s of 6.00 GB/s peak (37%)" in line
    assert "nvme/read       0.188 GiB  2.24 GB/s of 6.00 GB/s peak (37%)" in summary
    # no memory counters (rss sampling off, no gauges): the plot says so and is empty
    img = imread(tmp_path / "r" / "memory.png")[..., :3]
    assert img.shape[1] >= 800
    assert ((img.max(axis=-1) - img.min(axis=-1)) > 0.2).mean() == 0


def test_unreadable_traces_fail_cleanly(tmp_path, capsys):
    assert main(_args(str(tmp_path / "absent.json"))) == 1
    assert "cannot read trace" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(_args(str(bad))) == 1
    bad.write_text(json.dumps({"events": []}))
    assert main(_args(str(bad))) == 1
    assert main(_args(str(bad), "--steps", "-1")) == 1


def test_invalid_but_readable_trace_is_reported_with_a_warning(tmp_path, capsys):
    trace = tmp_path / "foreign.json"
    trace.write_text(json.dumps({"traceEvents": [
        {"ph": "X", "name": "cpu_update", "ts": 0, "dur": 10, "pid": 1, "tid": 1},
        {"ph": "X", "name": "nvme_read", "ts": 5, "dur": 10, "pid": 1, "tid": 1},
    ]}))
    assert main(_args(str(trace), "--out", str(tmp_path / "r"))) == 0
    captured = capsys.readouterr()
    assert "warning" in captured.err and "partially overlaps" in captured.err
    assert "no tierstate step slices" in captured.out
    _check_png(tmp_path / "r" / "timeline.png", 800, 100, min_coloured=0.02)


def test_module_entry_point(workload_trace, tmp_path):
    env = dict(os.environ,
               PYTHONPATH=os.pathsep.join([str(IMPORT_ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "tierstate.telemetry.report",
                           str(workload_trace), "--out", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert "bottleneck:" in proc.stdout
    assert (tmp_path / "timeline.png").stat().st_size > 10_000


def test_old_trace_with_the_clip_phase_reads_as_grad_norm(tmp_path, capsys):
    """Traces written before the gradient-norm pass was renamed call it "clip", in the slices
    and in each step's phase totals: the report books it as grad_norm."""
    pid = 7
    events = [
        {"ph": "M", "name": "thread_name", "pid": pid, "tid": 1, "args": {"name": "main"}},
        {"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": 1, "args": {"sort_index": 0}},
    ]
    for k in range(2):
        t0 = k * 10_000.0
        events += [
            {"ph": "X", "cat": "step", "name": f"step {k}", "pid": pid, "tid": 1, "ts": t0, "dur": 9_000.0,
             "args": {"step": k, "wall_s": 0.009, "skipped": False,
                      "phases": {"clip": 0.006, "cpu_update": 0.002, "other": 0.001}}},
            {"ph": "X", "cat": "phase", "name": "clip", "pid": pid, "tid": 1, "ts": t0, "dur": 6_000.0},
            {"ph": "X", "cat": "phase", "name": "cpu_update", "pid": pid, "tid": 1, "ts": t0 + 6_000.0,
             "dur": 2_000.0},
        ]
    trace = tmp_path / "old.json"
    trace.write_text(json.dumps({"traceEvents": events, "otherData": {"tierstate": {"main_lane": "main"}}}))
    assert main(_args(str(trace), "--out", str(tmp_path / "r"))) == 0
    summary = (tmp_path / "r" / "summary.txt").read_text()
    assert not re.search(r"\bclip\b", summary), summary
    assert re.search(r"^  grad_norm\s+66\.7%", summary, flags=re.M), summary
    assert re.search(r"^  main\s+grad_norm 67%", summary, flags=re.M), summary
    assert summary.splitlines()[-2].startswith("bottleneck: grad_norm on lane 'main', 67%")
