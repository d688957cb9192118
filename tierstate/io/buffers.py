"""Host buffers for the engine: aligned allocation and turning a user buffer into an
address the engine can use.

Accepted buffers: CPU contiguous ``torch.Tensor`` of any dtype, C-contiguous numpy
arrays, and objects with the buffer protocol (``bytearray``, ``memoryview``,
``bytes`` for writes only). The caller's object is kept referenced by the returned
future until the I/O completes.
"""
from __future__ import annotations

import sys
from typing import Any

import numpy as np

from .engine import _require_native

# Page size: valid O_DIRECT buffer alignment on every Linux filesystem; statx's
# STATX_DIOALIGN often allows less (512 B or 4 B), never more.
DEFAULT_ALIGNMENT = 4096


def aligned_empty(nbytes: int, alignment: int | None = None):
    """An uninitialised ``torch.uint8`` tensor of ``nbytes`` whose first byte is aligned.

    Memory comes from ``posix_memalign`` in the native module (not from over-allocating
    and slicing), so the tensor owns exactly ``nbytes`` (rounded up by the allocator) and
    frees it with ``free`` when the last view dies. ``alignment`` defaults to 4096, a
    power of two >= 8.
    """
    import torch

    if not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"nbytes={nbytes!r}: expected an int >= 0")
    alignment = DEFAULT_ALIGNMENT if alignment is None else alignment
    if not isinstance(alignment, int) or alignment < 8 or alignment & (alignment - 1):
        raise ValueError(f"alignment={alignment!r}: expected a power of two >= 8 (e.g. 4096)")
    array = _require_native().io_aligned_empty(nbytes, alignment)
    return torch.from_numpy(array)


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
