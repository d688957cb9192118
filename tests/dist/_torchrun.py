"""Launching a tests/dist worker under torchrun (gloo, CPU), as a user's job is launched."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

import tierstate

IMPORT_ROOT = Path(tierstate.__file__).resolve().parents[1]


def launch_worker(worker: Path, world: int, out: Path, *args: str, timeout: float) -> dict | str:
    """Run ``worker OUT *args`` on ``world`` ranks; the result its rank 0 saved in
    OUT/result-w<world>.pt, or the output of a failed launch (for the test to show)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(IMPORT_ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(world), str(worker), str(out), *args],
                          env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        return f"{world}-rank launch failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return torch.load(out / f"result-w{world}.pt", weights_only=False)
