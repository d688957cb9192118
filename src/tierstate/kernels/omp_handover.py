"""Hand the cores over from torch's idle OpenMP workers before our kernels run.

[Note: torch's spinning OpenMP workers]
torch's CPU wheels run their intra-op parallelism on OpenMP (GNU libgomp on Linux). When
a parallel region ends, libgomp's workers do not sleep at once: they spin on the next
region's barrier (``GOMP_SPINCOUNT``, 300,000 pause iterations unless
``OMP_WAIT_POLICY=PASSIVE``), milliseconds during which each holds a core. An optimizer
step called right after backward starts inside that window, and our pool's threads share
those cores with spinners. Measured on a 2-vCPU Zen 4, 50M bf16 parameters, medians of 30
interleaved calls: ``opt.step()`` took 38.8 ms right after a torch matmul against 35.3 ms
after a 30 ms sleep (+10 %).

The fix asks nothing of the user: OpenMP 5.0's ``omp_pause_resource_all`` (libgomp,
LLVM's libomp and Intel's libiomp5 all export it) releases the *calling thread's* idle
worker team; the spinners exit, and the next torch parallel region starts its workers
again (tens of microseconds, once, against milliseconds of spinning). On the same
machine the step right after torch work then took 35.9 ms (35.3 after a sleep), and
torch's next matmul was unchanged (24.4 ms after it, 23.6-26.5 ms otherwise). A call with
no idle team costs 1.5 us. Inside an OpenMP parallel region the runtime refuses (returns
-1) and nothing changes.

``opt.step()`` hands over once, before its first kernel. Not the updates that
``step_in_backward`` runs between autograd nodes: there each hand-over made torch start its
workers again for the next node, and backward of GPT-2 124M got slower (1.28 s against
1.15 s, medians of 10 steps), more than the spin had cost.

The runtime is the one torch loaded: found by name in ``/proc/self/maps`` and opened with
``RTLD_NOLOAD`` (never a second copy). Elsewhere (no ``/proc``), or with
``TIERSTATE_OMP_HANDOVER=0``, this does nothing.
"""
from __future__ import annotations

import ctypes
import os
import threading
from typing import Callable

_OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: omp_pause_soft = 1, omp_pause_hard = 2
_RUNTIME_NAMES = ("libgomp", "libiomp5", "libomp")

_lock = threading.Lock()
_pause: Callable[[int], int] | None = None
_looked = False
_enabled: bool | None = None  # None: read TIERSTATE_OMP_HANDOVER on first use


def _find_pause() -> Callable[[int], int] | None:
    try:
        with open("/proc/self/maps", encoding="ascii", errors="replace") as f:
            paths = {line.split()[-1] for line in f if "/" in line}
    except OSError:
        return None
    for path in sorted(paths):
        base = os.path.basename(path)
        if not any(base.startswith(name) for name in _RUNTIME_NAMES) or ".so" not in base:
            continue
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            fn = lib.omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
        return fn
    return None


def enabled() -> bool:
    """Whether :func:`hand_over_cores` acts (``TIERSTATE_OMP_HANDOVER=0`` turns it off)."""
    global _enabled
    if _enabled is None:
        raw = os.environ.get("TIERSTATE_OMP_HANDOVER", "1").strip().lower()
        if raw not in ("0", "1", "", "false", "true", "off", "on"):
            raise ValueError(f"TIERSTATE_OMP_HANDOVER={raw!r}: expected 1 (default) or 0")
        _enabled = raw not in ("0", "false", "off")
    return _enabled


def set_enabled(on: bool) -> None:
    """Turn the hand-over on or off for this process (benchmarks compare both)."""
    global _enabled
    if not isinstance(on, bool):
        raise TypeError(f"set_enabled(on={on!r}): expected True or False")
    _enabled = on


def runtime_found() -> bool:
    """Whether an OpenMP runtime with ``omp_pause_resource_all`` is loaded in this process."""
    _lookup()
    return _pause is not None


def _lookup() -> None:
    global _pause, _looked
    if not _looked:
        with _lock:
            if not _looked:
                _pause = _find_pause()
                _looked = True


def hand_over_cores() -> bool:
    """Release the calling thread's idle OpenMP team so its spinning workers give up their
    cores; True if the runtime did. Call right before multi-threaded kernel work."""
    if not enabled():
        return False
    _lookup()
    return _pause is not None and _pause(_OMP_PAUSE_SOFT) == 0
