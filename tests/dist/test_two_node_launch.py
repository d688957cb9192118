"""The multi-node launch path: ``torchrun --nnodes 2 --rdzv-backend c10d`` with two agents on one machine.

Two torchrun agents (two "nodes", one rank each) meet at a c10d rendezvous on a local port
and run ``_fsdp_worker.py``: FSDP2 over both nodes with tierstate.AdamW on the CPU and the
NVMe tier, a ``torch.distributed.checkpoint`` at step 6 and a resume from it. Checked: both
agents succeed, the ranks ran on different nodes, training progresses and the resume
continues bit for bit. About 30 s.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tierstate

WORKER = Path(__file__).with_name("_fsdp_worker.py")
IMPORT_ROOT = Path(tierstate.__file__).resolve().parents[1]
LAUNCH_TIMEOUT_S = 240

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="this torch build has no torch.distributed with gloo")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
def test_two_rendezvous_agents(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(IMPORT_ROOT), os.environ.get("PYTHONPATH")]))}
    endpoint = f"127.0.0.1:{free_port()}"
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                                "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", f"ts-{os.getpid()}",
                                str(WORKER), str(tmp_path), "--save", "--variants", "cpu,nvme"],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for _ in range(2)]
    try:
        outs = [a.communicate(timeout=LAUNCH_TIMEOUT_S)[0] for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
                a.wait()
    for a, out in zip(agents, outs):
        assert a.returncode == 0, out[-6000:]
    result = torch.load(tmp_path / "result-w2.pt", weights_only=False)
    launch = result["launch"]
    assert sorted(int(r["GROUP_RANK"]) for r in launch) == [0, 1]  # one rank on each node
    assert all(r["LOCAL_RANK"] == "0" and r["LOCAL_WORLD_SIZE"] == "1" for r in launch)
    for tier in ("cpu", "nvme"):
        r = result[tier]
        assert r["straight"]["losses"][-1] < 0.7 * r["straight"]["losses"][0], r["straight"]["losses"]
        for name, p in r["straight"]["params"].items():
            assert torch.equal(r["resumed_from_2"]["params"][name], p), (tier, name)
