"""One rank of tests/dist/test_ranks.py, started by torchrun (gloo, CPU).

    torchrun --standalone --nproc-per-node N _ranks_worker.py OUT MODE

MODE ``setup``: write OUT/setup-<rank>.json with the kernel threads tierstate chose, this
process's CPUs and the state files of two NVMe-tier optimizers, one over
``nvme_dir=OUT/ts/rank{rank}`` and one over the default root (``TIERSTATE_NVME_DIR``).

MODE ``fail``: FSDP2 training with tierstate.AdamW; rank FAIL_RANK raises at step FAIL_STEP
(a ValueError from the user's code, after its backward) and writes it to OUT/fail-<rank>.json.
MODE ``fail-caught``: the same, but that rank catches the error, reports it
(``tierstate.dist.report_failure``) and hangs. MODE ``lost``/``restart``: see their functions.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
from torch import nn

import tierstate as ts

FAIL_RANK, FAIL_STEP = 1, 3


def setup(out: str) -> None:
    rank = dist.get_rank()
    model = nn.Linear(16, 16)
    files = {}
    for name, kw in (("template", {"nvme_dir": os.path.join(out, "ts", "rank{rank}")}), ("default", {})):
        opt = ts.AdamW(model.parameters(), lr=1e-2, offload="nvme", **kw)
        model(torch.randn(4, 16)).sum().backward()
        opt.step()
        files[name] = [str(p) for tier in opt.tiers.values() for p in tier.files]
        dist.barrier()  # both ranks hold their files at once
        opt.close()
        del opt
    record = {"rank": rank, "threads": ts.kernels.get_num_threads(), "cpus": len(os.sched_getaffinity(0)),
              "omp": os.environ.get("OMP_NUM_THREADS"), "local_world": os.environ.get("LOCAL_WORLD_SIZE"),
              "files": files}
    with open(os.path.join(out, f"setup-{rank}.json"), "w") as f:
        json.dump(record, f)


def fail(out: str) -> None:
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    opt = ts.AdamW(model.parameters(), lr=1e-2, max_grad_norm=1.0)
    start = time.monotonic()
    try:
        for step in range(1, 50):
            loss = model(torch.randn(4, 16)).square().mean()
            loss.backward()
            if rank == FAIL_RANK and step == FAIL_STEP:
                raise ValueError(f"bad batch on rank {rank} at step {step}")
            opt.step()
            opt.zero_grad()
    except BaseException as exc:  # noqa: BLE001 - recorded for the test, then raised again
        with open(os.path.join(out, f"fail-{rank}.json"), "w") as f:
            json.dump({"rank": rank, "type": type(exc).__name__, "message": str(exc), "at": time.time(),
                       "seconds": time.monotonic() - start, "traceback": traceback.format_exc()}, f)
        raise


def fail_caught(out: str) -> None:
    """Rank FAIL_RANK catches its error, reports it, and stays alive (hung): the others must not
    wait for it."""
    try:
        fail(out)
    except ValueError as exc:
        ts.dist.report_failure(exc)
        time.sleep(600)


def _step_on_nvme(out: str):
    """One step of a small model with its state under OUT/ts/rank{rank}: (the optimizer, its files)."""
    model = nn.Linear(16, 16)
    opt = ts.AdamW(model.parameters(), lr=1e-2, offload="nvme", nvme_dir=os.path.join(out, "ts", "rank{rank}"))
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    return opt, [str(p) for tier in opt.tiers.values() for p in tier.files]


def lost(out: str) -> None:
    """Every rank steps on its NVMe folder (OUT/ts/rank{rank}); rank FAIL_RANK then dies by
    SIGKILL, leaving its state files and marker behind."""
    import signal

    rank = dist.get_rank()
    opt, files = _step_on_nvme(out)  # held to the end: a collected optimizer would remove its files
    with open(os.path.join(out, f"lost-{rank}.json"), "w") as f:
        json.dump({"rank": rank, "pid": os.getpid(), "files": files}, f)
    dist.barrier()
    if rank == FAIL_RANK:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()  # the lost rank never arrives


def restart(out: str) -> None:
    """The job restarted over the same folders: each rank's optimizer claims its folder again."""
    rank = dist.get_rank()
    opt, files = _step_on_nvme(out)
    with open(os.path.join(out, f"restart-{rank}.json"), "w") as f:
        json.dump({"rank": rank, "pid": os.getpid(), "files": files,
                   "listing": sorted(os.listdir(os.path.join(out, "ts", f"rank{rank}")))}, f)
    dist.barrier()
    opt.close()


def main() -> None:
    out, mode = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    {"setup": setup, "fail": fail, "fail-caught": fail_caught, "lost": lost, "restart": restart}[mode](out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
