"""Host buffers for the engine: aligned allocation and turning a user buffer into an
address the engine can use.

Accepted buffers: CPU contiguous ``torch.Tensor`` of any dtype, C-contiguous numpy
arrays, and objects with the buffer protocol (``bytearray``, ``memoryview``,
``bytes`` for writes only). The caller's object is kept referenced by the returned
future until the I/O completes.
"""
from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import numpy as np

from .engine import _require_native

# Page size: valid O_DIRECT buffer alignment on every Linux filesystem; statx's
# STATX_DIOALIGN often allows less (512 B or 4 B), never more.
DEFAULT_ALIGNMENT = 4096


@functools.cache
def huge_page_size() -> int:
    """Bytes of a transparent huge page, or 0 when the kernel will not give them.

    0 when THP is ``never`` (``/sys/kernel/mm/transparent_hugepage/enabled``) or absent
    (not Linux, no THP in the kernel). ``always`` and ``madvise`` both honour the advice
    :func:`aligned_empty` gives."""
    root = Path("/sys/kernel/mm/transparent_hugepage")
    try:
        enabled = (root / "enabled").read_text()
    except OSError:
        return 0
    if "[never]" in enabled:
        return 0
    try:
        return int((root / "hpage_pmd_size").read_text())
    except (OSError, ValueError):
        return 2 << 20  # x86-64 and 4 KiB-page arm64


def mapping_fields(address: int) -> dict | None:
    """The ``/proc/self/smaps`` fields of the mapping that holds ``address`` (values as text,
    e.g. ``"Rss": "0 kB"``, ``"VmFlags": "rd wr mr mw me ac hg"``), with its bounds as ints under
    ``"start"`` and ``"end"``; None where no mapping holds it or smaps cannot be read (not
    Linux). Reads the mappings up to the one found."""
    fields, inside = {}, False
    try:
        with open("/proc/self/smaps") as smaps:
            for line in smaps:
                head = line.split(maxsplit=1)[0] if line.strip() else ""
                if "-" in head and not head.endswith(":"):  # a mapping's first line: "start-end perms ..."
                    if inside:
                        return fields
                    lo, _, hi = head.partition("-")
                    start, end = int(lo, 16), int(hi, 16)
                    inside, fields = start <= address < end, {"start": start, "end": end}
                elif inside:
                    key, _, value = line.partition(":")
                    fields[key] = value.strip()
    except (OSError, ValueError):
        return None
    return fields if inside else None


def huge_page_eligible(address: int) -> bool:
    """Whether the kernel may back the memory at ``address`` with transparent huge pages: the
    ``THPeligible`` field of the mapping holding it in ``/proc/self/smaps``. Alignment alone does
    not say so: under THP ``madvise`` (the common default) only advised mappings are eligible, and
    torch's allocator can return a 2 MiB-aligned address on the plain heap. False where the
    kernel reports no such field (no THP, not Linux) or no mapping holds ``address``.

    Reads the mappings up to the one found: 1.1-3.5 ms in a process with torch and transformers
    imported (521 mappings; 2-vCPU AMD EPYC, 2026-12-03). Call it for the rare case (an aligned
    parameter), not for every tensor."""
    fields = mapping_fields(address)
    return fields is not None and fields.get("THPeligible") == "1"


def aligned_empty(nbytes: int, alignment: int | None = None, *, huge_pages: bool | None = None):
    """An uninitialised ``torch.uint8`` tensor of ``nbytes`` whose first byte is aligned.

    Memory comes from the native module (not from over-allocating and slicing), so the
    tensor owns exactly ``nbytes`` (rounded up to the page) and gives it back when the last
    view dies. ``alignment`` defaults to 4096, a power of two >= 8.

    ``huge_pages`` (default: when ``nbytes`` is at least one huge page and the kernel has
    THP) aligns the memory to a huge page and advises the kernel to back it with them. Such
    a buffer is an anonymous mapping of its own, advised before any of its pages exists:
    ``posix_memalign`` may return heap memory an earlier block already touched, whose 4 KiB
    pages the advice does not change (direct reads into 8 MiB of it ran at 1.3-1.7 GB/s
    against 2.8-3.0, Zen 4 VM, 2026-12-06). Without it, ``posix_memalign``.
    For direct I/O this matters more than it seems: the block layer splits a request at
    the device's segment limit (virtio-blk: 254 segments), which over 4 KiB pages is
    ~1 MiB, while a 2 MiB page is one segment. On the reference VM a 256 MiB buffer moved
    6.1 GB/s written / 2.8 GB/s read with huge pages against 2.7 / 1.1 without, and a
    thread computing beside it lost less time per GB (benchmarks/README.md).
    """
    import torch

    if not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"nbytes={nbytes!r}: expected an int >= 0")
    alignment = DEFAULT_ALIGNMENT if alignment is None else alignment
    if not isinstance(alignment, int) or alignment < 8 or alignment & (alignment - 1):
        raise ValueError(f"alignment={alignment!r}: expected a power of two >= 8 (e.g. 4096)")
    page = huge_page_size()
    if huge_pages is None:
        huge_pages = page > 0 and nbytes >= page
    huge_pages = bool(huge_pages) and page > 0
    if huge_pages:
        alignment = max(alignment, page)
    array = _require_native().io_aligned_empty(nbytes, alignment, huge_pages)
    return torch.from_numpy(array)


class _PageLocked:
    """Owner of an :func:`aligned_empty` array registered with CUDA (``cudaHostRegister``).

    numpy views it through ``__array_interface__`` and keeps it as the array's base, so it
    lives exactly as long as the last tensor on the memory. Its finalizer waits for the
    device (a copy may still be reading the memory), unregisters the range, and only then
    lets the array go, which unmaps it."""

    def __init__(self, array: np.ndarray, unregister) -> None:
        self._array = array
        self._unregister = unregister
        self.__array_interface__ = array.__array_interface__

    def __del__(self) -> None:
        try:
            self._unregister(self._array.ctypes.data)
        finally:
            self._array = None


def _cuda_host_register(address: int, nbytes: int) -> str | None:
    """Page-lock ``[address, address + nbytes)`` for CUDA copies; None on success, else why not."""
    import torch

    try:
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(address, nbytes, 0)  # cudaHostRegisterDefault
    except Exception as exc:  # no CUDA runtime, or a torch without the binding
        return f"{type(exc).__name__}: {exc}"
    code = int(getattr(err, "value", err))
    return None if code == 0 else f"cudaHostRegister returned {err}"


def _cuda_host_unregister(address: int) -> None:
    import torch

    try:
        torch.cuda.synchronize()  # no copy may still be reading the range once it is unpinned and unmapped
        torch.cuda.cudart().cudaHostUnregister(address)
    except Exception:  # interpreter shutdown or a lost device: the unmap goes ahead; the process is ending
        pass


def page_locked_empty(nbytes: int, alignment: int | None = None, *, register=_cuda_host_register,
                      unregister=_cuda_host_unregister):
    """An uninitialised ``torch.uint8`` tensor of ``nbytes`` in page-locked host memory, for
    asynchronous copies to and from a CUDA device, taking ``nbytes`` (rounded up to a page).

    torch's pinned allocator (``pin_memory=True``) rounds every request up to a power of two
    (``CachingHostAllocator``; through torch 2.13 unless ``pinned_max_round_threshold_mb`` is
    set): the 27 GB fp32 master of a 7B model would lock 32 GiB, and the master, the two
    moments, the gradient arena and the weight staging of a 7B model 128 GiB instead of
    100. Here the memory is :func:`aligned_empty`'s (its own mapping, on huge pages from
    one huge page on) registered with ``cudaHostRegister``, and unregistered when the last
    tensor on it dies. Where registration fails (no CUDA runtime), torch's pinned
    allocator is used after all (also without the native module), and the first such
    fallback is logged, with the reason.
    ``register`` / ``unregister`` are the CUDA calls (replaceable to test the lifetime
    without a GPU).
    """
    import torch

    if not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"nbytes={nbytes!r}: expected an int >= 0")
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    try:
        tensor = aligned_empty(nbytes, alignment)
    except ImportError as exc:  # no native module: torch's allocator, as everywhere then
        tensor, why = None, str(exc)
    else:
        array = tensor.numpy()
        why = register(array.ctypes.data, nbytes)
    if why is not None:
        from .engine import say_once

        say_once("page-lock", f"tierstate: could not page-lock host memory with cudaHostRegister ({why}); "
                              "using torch's pinned allocator, which rounds each buffer up to a power of two")
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    del tensor
    return torch.from_numpy(np.asarray(_PageLocked(array, unregister)))


def buffer_span(buf: Any, *, writable: bool, argname: str = "buf") -> tuple[int, int, Any]:
    """(address, nbytes, keepalive) of ``buf``; ``writable`` when the engine will write into it."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(buf, torch.Tensor):
        if buf.device.type != "cpu":
            raise TypeError(f"{argname} is a tensor on {buf.device}; the engine reads/writes host "
                            "memory: pass a CPU tensor (e.g. from tierstate.io.aligned_empty)")
        if not buf.is_contiguous():
            raise ValueError(f"{argname} is a non-contiguous tensor; pass tensor.contiguous()")
        return buf.data_ptr(), buf.numel() * buf.element_size(), buf
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise ValueError(f"{argname} is a non-contiguous numpy array; pass np.ascontiguousarray(...)")
        if writable and not buf.flags.writeable:
            raise ValueError(f"{argname} is a read-only numpy array; reads need a writable buffer")
        return buf.ctypes.data, buf.nbytes, buf
    try:
        view = memoryview(buf)
    except TypeError:
        raise TypeError(
            f"{argname} of type {type(buf).__name__} is not a buffer: pass a CPU torch.Tensor, "
            "a numpy array, a bytearray or a memoryview") from None
    if not view.c_contiguous:
        raise ValueError(f"{argname} is a non-contiguous memoryview; copy it into a bytearray")
    if writable and view.readonly:
        raise ValueError(f"{argname} is read-only ({type(buf).__name__}); reads need a writable "
                         "buffer such as a bytearray")
    flat = np.frombuffer(view.cast("B"), dtype=np.uint8) if view.nbytes else np.empty(0, np.uint8)
    return flat.ctypes.data, view.nbytes, (buf, view, flat)
