"""Compressed state (per-block scales) under FSDP2: state_dict() cannot present it as DTensor
state for torch.distributed.checkpoint, and says so naming the key and the fix instead of
failing inside a reshape."""
from __future__ import annotations

import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import os, socket, torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    import tierstate as ts
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    m = torch.nn.Sequential(torch.nn.Linear(512, 512))
    fully_shard(m)
    opt = ts.AdamW(m.parameters(), lr=1e-3, offload=ts.Offload(moment_dtype="q8"))
    m(torch.randn(2, 512)).sum().backward()
    opt.step()
    try:
        opt.state_dict()
        print("no error")
    except ValueError as e:
        print("ValueError:", e)
    dist.destroy_process_group()
""")


def test_q8_state_under_fsdp2_is_refused_by_state_dict_naming_the_key_and_the_fix():
    r = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "ValueError:" in out and "'exp_avg.scale'" in out and "moment_dtype=torch.bfloat16" in out, out
