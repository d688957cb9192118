"""Host memory that torch frees, kept for its next allocation, so CPU training stops page-faulting.

    import tierstate as ts
    ts.host_allocator.retain_freed_memory()   # what an optimizer on CPU parameters does by default
    ts.host_allocator.retain_small_blocks()   # the same for blocks below 32 MiB (with an NVMe tier)
    ts.host_allocator.policy()                # "retain", "retain_small" or "system"

[Note: why tierstate touches the C allocator]
On CPU parameters, forward and backward allocate their activations and gradients afresh every
step. glibc's malloc serves each block above its mmap threshold (128 KiB at start, raised
towards 32 MiB as blocks are freed) with a fresh ``mmap`` and gives it back with ``munmap``
when torch frees it, so the next step touches new pages again: every 4 KiB page costs a page
fault, and the kernel zeroes it. GPT-2 124M in fp32 at 2 x 256 tokens (2-vCPU AVX2 VM, plain
torch loop): 140-210 K minor faults and 0.45-0.70 CPU-seconds of kernel time per step (of ~8
CPU-seconds). With the setting below: no fault from the third step on. Most of that memory
comes in blocks above 32 MiB (logits, the embedding's gradient), so raising the mmap threshold
to its 32 MiB maximum alone left 150-160 K faults per step.

PyTorch's CUDA caching allocator keeps freed device blocks for the same reason; torch has no
such cache for host memory, so tierstate asks glibc for the equivalent: ``M_MMAP_MAX = 0``
(every block comes from the heap, whose freed blocks are reused) and ``M_TRIM_THRESHOLD =
2 GiB`` (the heap's free top is returned to the system only beyond 2 GiB, not 128 KiB).
The price is the caching allocator's: the process's RSS stays near its high-water mark
instead of shrinking between steps, and a large block freed in the middle of the heap waits
for reuse instead of going back to the system. glibc 2.36 also cannot reuse a freed block
for a ``posix_memalign`` of the same size (it asks for the alignment's slack on top), so the
heap grows until freed neighbours coalesce: a 64 MiB tensor made and freed in a loop grew
the RSS by 320 MiB over the first 5 rounds and not at all over the next 55; the GPT-2 loop
above peaked at 4.08 GiB instead of 3.74 (medians 3.83 s against 4.30 s per step, four
interleaved pairs of 7-step runs). Hence the optimizers' default: on for CPU parameters
whose state is all in RAM.

With an NVMe tier (chosen to bound host memory) the default is the middle way,
:func:`retain_small_blocks`: ``M_MMAP_THRESHOLD = 32 MiB`` (what glibc's own dynamic threshold
climbs to) and ``M_TRIM_THRESHOLD = 2 GiB``. A block of 32 MiB or more that the heap has no
free room for is still mapped, and unmapped when freed, so such blocks do not hold the RSS at
its high-water mark; the heap itself is no longer cut back whenever its free top passes twice
the dynamic threshold (64 MiB), which glibc's default did after an NVMe step (``brk`` shrank
the heap; the next forward grew it again in 14 ``brk`` calls, faulting every page in).
GPT-2 124M fp32 with all state on NVMe (2-vCPU Zen 4 VM, 2026-12-06, one process per policy,
steps 4-5): 50 K minor faults in forward and 163 K in backward under glibc's default, 0-25 K
and 100-138 K with this policy (plain torch: 0-50 K and 100-163 K); forward 1.37-1.41 s
against 1.54-1.59 s. In ``tierstate bench e2e --modes torch,nvme --precision fp32 --repeats
2``, two runs per policy alternating: peak RSS 3.08-3.10 GiB against 3.08-3.11 (plain torch
3.72-3.77), the NVMe step 1.12x and 1.08x plain torch's against 1.18x and 1.22x.
:func:`release_to_system` undoes either.

Only glibc has these knobs; elsewhere (musl, macOS) the calls report that nothing changed.
"""
from __future__ import annotations

import ctypes
import logging
import threading

_log = logging.getLogger(__name__)

# mallopt parameter numbers, from glibc's <malloc.h>
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_MMAP_MAX = -4

# The heap's free top is kept up to this size (mallopt takes an int: 2 GiB - 1 is its maximum).
RETAINED_TOP_BYTES = 2**31 - 1
# glibc's defaults, restored by release_to_system(): 64 Ki mmaps, trim and mmap thresholds of 128 KiB.
_GLIBC_MMAP_MAX = 65536
_GLIBC_THRESHOLD = 128 * 1024

_lock = threading.Lock()
_policy = "system"


def _glibc():
    """The process's C library if it is glibc (has ``mallopt`` and ``gnu_get_libc_version``), else None."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - only glibc exports it
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return libc


def _mallopt(libc, settings: tuple[tuple[int, int], ...]) -> bool:
    return all(libc.mallopt(param, value) == 1 for param, value in settings)


# blocks from this size up are mapped and unmapped under "retain_small": glibc's largest
# dynamic mmap threshold (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit), which it would climb to anyway
SMALL_BLOCK_LIMIT = 32 << 20


def policy() -> str:
    """The setting in effect in this process: ``"retain"`` (:func:`retain_freed_memory`),
    ``"retain_small"`` (:func:`retain_small_blocks`) or ``"system"`` (glibc's defaults, or
    not glibc)."""
    return _policy


# What each policy asks of glibc, what its log line says, and the policies under which it is
# already in effect ("retain" holds everything "retain_small" asks, and more).
_SETTINGS = {
    "retain": (((_M_MMAP_MAX, "M_MMAP_MAX", 0), (_M_TRIM_THRESHOLD, "M_TRIM_THRESHOLD", RETAINED_TOP_BYTES)),
               "freed host memory is kept in the heap for reuse (mallopt M_MMAP_MAX=0, M_TRIM_THRESHOLD=2 GiB), "
               "so CPU forward/backward stop page-faulting",
               ("retain",)),
    "retain_small": (((_M_MMAP_THRESHOLD, "M_MMAP_THRESHOLD", SMALL_BLOCK_LIMIT),
                      (_M_TRIM_THRESHOLD, "M_TRIM_THRESHOLD", RETAINED_TOP_BYTES)),
                     "blocks below 32 MiB come from the heap, whose freed memory is kept for reuse "
                     "(mallopt M_MMAP_THRESHOLD=32 MiB, M_TRIM_THRESHOLD=2 GiB)",
                     ("retain", "retain_small")),
}


def adopt(name: str) -> bool:
    """Put the policy ``name`` in effect: ``"retain"`` (:func:`retain_freed_memory`),
    ``"retain_small"`` (:func:`retain_small_blocks`), or ``"system"``, which leaves the
    allocator as it is. Returns whether ``name``'s setting (or a stronger one) is in effect."""
    global _policy
    if name == "system":
        return False
    settings, said, in_effect = _SETTINGS[name]
    with _lock:
        if _policy in in_effect:
            return True
        libc = _glibc()
        if libc is None:
            _log.info("tierstate: host allocator left as it is: the C library is not glibc (no mallopt)")
            return False
        if not _mallopt(libc, tuple((param, value) for param, _, value in settings)):
            _log.warning("tierstate: glibc refused mallopt(%s); host allocator unchanged",
                         "/".join(label for _, label, _ in settings))
            return False
        _policy = name
        _log.info("tierstate: %s; tierstate.host_allocator.release_to_system() undoes it", said)
        return True


def retain_small_blocks() -> bool:
    """Keep the heap's freed memory for later allocations, and serve blocks below 32 MiB from
    it; a larger block the heap has no free room for is mapped, and returned to the system
    when freed (idempotent; a process already under ``"retain"`` stays there, the stronger
    setting).

    Returns True when this or the stronger setting is in effect (glibc), False where this C
    library has no such knob. See [Note: why tierstate touches the C allocator]."""
    return adopt("retain_small")


def retain_freed_memory() -> bool:
    """Keep host memory that is freed in the process heap for later allocations (idempotent).

    Returns True when the setting is in effect (glibc), False where this C library has no
    such knob (then nothing changed). See [Note: why tierstate touches the C allocator].
    """
    return adopt("retain")


def release_to_system() -> bool:
    """Back to glibc's defaults (fixed 128 KiB thresholds: its dynamic threshold stays off once
    set) and return the heap's free memory to the system now (``malloc_trim``). Blocks still
    free in the heap serve later allocations before any new ``mmap``. Returns True if the
    policy was "retain" or "retain_small" and is now "system"."""
    global _policy
    with _lock:
        if _policy == "system":
            return False
        libc = _glibc()
        _mallopt(libc, ((_M_MMAP_MAX, _GLIBC_MMAP_MAX), (_M_TRIM_THRESHOLD, _GLIBC_THRESHOLD),
                        (_M_MMAP_THRESHOLD, _GLIBC_THRESHOLD)))
        libc.malloc_trim(ctypes.c_size_t(0))
        _policy = "system"
        return True


__all__ = ["adopt", "policy", "retain_freed_memory", "retain_small_blocks", "release_to_system",
           "RETAINED_TOP_BYTES", "SMALL_BLOCK_LIMIT"]
