"""One rank of tests/dist/test_exit_drain.py: build a tierstate optimizer in a 2-rank gloo
group, start a thread named as gloo's collective workers that is busy without the GIL and
then needs it, and exit while it is still busy. Writes OUT/finished-<rank> from the thread
once it has the GIL back (which a finalizing interpreter never gives it). Usage:
_exit_drain_worker.py OUT MIB (the thread hashes MIB MiB of zeros)."""
import ctypes
import hashlib
import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist

import tierstate as ts

out = Path(sys.argv[1])
dist.init_process_group("gloo")
rank = dist.get_rank()
opt = ts.AdamW([torch.nn.Parameter(torch.zeros(8))], offload="cpu")
busy = threading.Event()
# sha256 of 256 MiB: 0.2 s on a Zen 4 core, the GIL released throughout; the zeros are
# never written, so even 2 GiB maps only the kernel's zero page
data = bytes(int(sys.argv[2]) << 20)


def worker() -> None:
    ctypes.CDLL(None).prctl(15, b"pt_gloo_runloop", 0, 0, 0)  # PR_SET_NAME, as torch names its gloo threads
    busy.set()
    digest = hashlib.sha256(data).hexdigest()
    (out / f"finished-{rank}").write_text(digest)


threading.Thread(target=worker, daemon=True).start()
busy.wait()
dist.barrier()
dist.destroy_process_group()
