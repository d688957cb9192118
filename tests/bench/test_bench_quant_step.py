"""``python -m tierstate.bench.quant_step`` at a tiny size: every layout is timed and set against
a floor that neither uncompressed kernel (both at the memory bandwidth) beats."""
from __future__ import annotations

import re
import subprocess
import sys



def test_every_layout_is_timed_against_a_floor_the_fp32_kernel_does_not_beat():
    r = subprocess.run([sys.executable, "-m", "tierstate.bench.quant_step", "--params", "256K", "--rounds", "2",
                        "--threads", "1"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    bw = re.search(r"memory bandwidth: ([\d.]+) GB/s, the fastest of a 64 MiB copy .*?([\d.]+) GB/s\), the "
                   r"fp32-moment kernel \(([\d.]+) GB/s\) and the bf16-moment kernel \(([\d.]+) GB/s\)", r.stdout)
    assert bw, r.stdout
    assert float(bw.group(1)) == max(float(bw.group(i)) for i in (2, 3, 4))
    rows = dict(re.findall(r"^(\S+)\s+[\d.]+ B/param .*?([\d.]+)x floor$", r.stdout, re.M))
    assert set(rows) == {"fp32-moments", "bf16-moments", "q8/256+fp32", "q8/256+bf16_kahan", "q8/256+bf16_sr",
                         "fp8/256+fp32", "fp8/256+bf16_kahan", "fp8/256+bf16_sr"}, rows
    # the floor's bandwidth is at least each uncompressed kernel's own rate: neither beats it
    # (1 % for the rounding of the printed figures)
    assert float(rows["fp32-moments"]) >= 0.99 and float(rows["bf16-moments"]) >= 0.99


def test_an_unknown_map_family_is_refused_before_anything_runs():
    r = subprocess.run([sys.executable, "-m", "tierstate.bench.quant_step", "--maps", "fp9"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--maps: unknown map family 'fp9'" in r.stderr, r.stderr[-2000:]
