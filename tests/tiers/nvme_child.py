"""A child process for the lifecycle tests: opens an NVMe-mode optimizer, reports its
folders on stdout as JSON, then does what argv[1] says:

- ``hold``: waits until stdin closes (keeps the folder locked meanwhile);
- ``crash``: dies by SIGKILL (no cleanup runs, as in a crash);
- ``exit``: returns normally without calling close() (cleanup must run at exit).

argv[2] is a comma-separated list of nvme_dirs, one optimizer each (``-``: the default,
under TIERSTATE_NVME_DIR)."""
import json
import os
import signal
import sys

import torch

import tierstate as ts
from tierstate.placement import TierKind


def main() -> None:
    action, wheres = sys.argv[1], sys.argv[2].split(",")
    folders, files, keep = [], [], []
    for where in wheres:
        params = [torch.nn.Parameter(torch.randn(5000))]
        opt = ts.AdamW(params, offload=ts.Offload(cpu=0.0, nvme=1.0, nvme_dir=None if where == "-" else where,
                                                  subgroup_numel=1024, buffer_count=2))
        params[0].grad = torch.randn(5000)
        opt.step()
        tier = opt.tiers[TierKind.NVME]
        folders += [str(f) for f in tier.folders]
        files += [str(f) for f in tier.files]
        keep.append(opt)
    print(json.dumps({"folders": folders, "files": files, "pid": os.getpid()}), flush=True)
    if action == "hold":
        sys.stdin.read()
    elif action == "crash":
        os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
