"""Host memory of NVMe mode is bounded by the buffer pool, whatever the state's size.

[Note: the constant]
Peak RSS growth is allowed the pool plus ``CONSTANT`` = 32 MiB, which covers what the
optimizer front allocates per parameter outside the tier (the fill tensors of a
parameter's first step, ``torch.full(numel)``: 2 x 4 MB live at once for these
1M-element parameters), the step bookkeeping, the I/O threads' stacks and torch's
allocator slack. Measured: pool + 0.5 MiB. It does not grow with the number of
parameters or sub-groups: the test's state is 12x the pool, and CPU mode, run as the
control, grows by the whole state.

The child runs with ``MALLOC_MMAP_THRESHOLD_`` fixed at 1 MiB. Without it glibc raises its
mmap threshold after the first large free, so the front's 4 MB fill temporaries (one per
parameter and key, freed at once) come from the brk heap, where small live objects
allocated between them keep the freed space from being returned: +120 MB of RSS for
these 25 parameters, none of it the tier's. Filling with a stride-0 tensor instead
(``torch.full((1,), init).expand(numel)``, which the tiers' ``write_range`` accepts)
removes those temporaries; with that change the variable is unneeded.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
import tierstate

# the folder holding the tierstate under test (the checkout, or site-packages when installed):
# children must import that one, whose native module was built
IMPORT_ROOT = Path(tierstate.__file__).resolve().parents[1]


CHILD = Path(__file__).with_name("nvme_rss_child.py")
ROOT = Path(__file__).resolve().parents[2]
CONSTANT = 32 << 20


def _growth(mode: str, folder: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(IMPORT_ROOT), MALLOC_MMAP_THRESHOLD_=str(1 << 20))
    out = subprocess.run([sys.executable, str(CHILD), mode, str(folder)], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_peak_rss_bounded_by_pool(tmp_path):
    nvme = _growth("nvme", tmp_path)
    assert nvme["state"] >= 8 * nvme["pool"]
    assert nvme["read"] > 0, "the state must actually stream from the files"
    assert nvme["growth"] <= nvme["pool"] + CONSTANT, (
        f"peak RSS grew {nvme['growth'] / 2**20:.0f} MiB; pool {nvme['pool'] / 2**20:.0f} MiB + "
        f"{CONSTANT >> 20} MiB allowed")
    cpu = _growth("cpu", tmp_path)  # control: the same measure sees the whole state in RAM
    assert cpu["growth"] >= 0.9 * cpu["state"]
