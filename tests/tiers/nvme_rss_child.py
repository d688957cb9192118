"""Child process of the bounded-memory test: prints the peak RSS growth of an optimizer.

argv: mode ("nvme" or "cpu"), folder. Parameters and gradients are made first and a tiny
optimizer of the same mode runs once (loading the I/O engine, its threads and the
kernels), so that what grows afterwards is the optimizer's own memory."""
import json
import resource
import sys

import psutil
import torch

import tierstate as ts
from tierstate.placement import TierKind

NUMEL = 25_000_000  # AdamW fp32: 8 B/param of state = 200 MB
PER_PARAM = 1_000_000
SUBGROUP = 1 << 20  # records of 8 MiB; pool of 2 = 16 MiB, 1/12 of the state


def offload(mode: str, folder: str, tag: str):
    if mode == "cpu":
        return ts.Offload(cpu=1.0, subgroup_numel=SUBGROUP)
    return ts.Offload(cpu=0.0, nvme=1.0, nvme_dir=f"{folder}/{tag}", subgroup_numel=SUBGROUP, buffer_count=2)


def _high_water_mark() -> int:
    """Peak RSS since the last reset of /proc/self/clear_refs, in bytes (Linux VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # no VmHWM: lifetime peak


def main() -> None:
    mode, folder = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(PER_PARAM)) for _ in range(NUMEL // PER_PARAM)]
    for p in params:
        p.grad = torch.randn(PER_PARAM)
    tiny = [torch.nn.Parameter(torch.randn(4096))]
    tiny[0].grad = torch.randn(4096)
    warm = ts.AdamW(tiny, offload=ts.Offload(cpu=0.0, nvme=1.0, nvme_dir=f"{folder}/warm", subgroup_numel=1024,
                                            buffer_count=2) if mode == "nvme" else "cpu")
    warm.step()
    warm.close()
    # Reset the high-water mark first: ru_maxrss counts the whole life of the process, so a
    # transient peak before this point (imports, the warm-up) would be read as growth.
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = psutil.Process().memory_info().rss
    opt = ts.AdamW(params, lr=1e-3, offload=offload(mode, folder, "run"))
    for _ in range(3):
        opt.step()
    peak = _high_water_mark()
    tier = opt.tiers.get(TierKind.NVME)
    print(json.dumps({"growth": peak - before, "state": NUMEL * 8,
                      "pool": tier.pool_nbytes if tier else 0,
                      "read": opt.stats().bytes.get("nvme/read", 0)}))
    opt.close()


if __name__ == "__main__":
    main()
