"""examples/fsdp2_torchrun.py under torchrun, as a user runs it (examples/torchrun_ddp.py runs in
tests/integrations/test_examples.py; the per-rank state of its ZeRO-1 mode is measured in
tests/dist/test_fsdp_checkpoint.py).

The FSDP2 example trains 8 steps on 2 ranks, each streaming its shards of the blocks' weights
from NVMe (``--stream-weights nvme``), and saves a DCP checkpoint; resumed on 1 process with the
NVMe tier (weights resident) it continues from step 8 and the loss keeps falling. About a minute
(transformers import per rank).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tierstate

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
IMPORT_ROOT = Path(tierstate.__file__).resolve().parents[1]

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                 reason="this torch build has no torch.distributed with gloo")]
pytest.importorskip("transformers", reason="transformers is not installed (pip install tierstate[hf])")


def torchrun(world: int, script: str, *args: str) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(IMPORT_ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
                           str(EXAMPLES / script), "--tiny", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def losses(out: str) -> tuple[float, float]:
    m = re.search(r"loss (\d+\.\d+) -> (\d+\.\d+)", out)
    assert m, out
    return float(m.group(1)), float(m.group(2))


def test_fsdp2_example_saves_on_two_ranks_and_resumes_on_one(tmp_path):
    out = torchrun(2, "fsdp2_torchrun.py", "--out", str(tmp_path), "--stream-weights", "nvme")
    first, last = losses(out)
    assert last < first - 0.5, out
    assert "checkpoint of step 8" in out and len(re.findall(r"rank \d figures:", out)) == 2, out
    # (not anchored at line starts: torchrun can pass the ranks' lines on run together)
    streamed = re.findall(r"weights streamed: (\d+) blocks' shards \(([\d.]+) MiB\) on nvme, ([\d.]+) MiB read back",
                          out)
    assert len(streamed) == 2, out  # each rank: its shards, read back from disk as the steps went
    assert all(int(n) > 1 and float(read) > float(size) for n, size, read in streamed), streamed
    resumed = torchrun(1, "fsdp2_torchrun.py", "--out", str(tmp_path), "--resume", "--offload", "nvme")
    assert "1 rank(s) resumed at step 8" in resumed and "checkpoint of step 16" in resumed, resumed
    r_first, r_last = losses(resumed)
    assert r_first < first - 0.5 and r_last < r_first, (out, resumed)  # it continued, not restarted
    assert "state nvme" in resumed
