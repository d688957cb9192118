"""CRC-32C of host buffers, computed in the native module without the GIL.

    from tierstate.io import crc32c
    crc32c(b"123456789")            # 0xE3069283
    crc32c(tail, crc32c(head))      # the CRC of head + tail

The variant (carry-less-multiplication folding, 512 or 128 bits wide, or the x86 ``crc32``
instruction; the AArch64 CRC32C instructions; or slicing-by-8 tables) is chosen at run
time; :func:`crc32c_isas` lists those this CPU can run, and ``isa=`` forces one (tests
compare them).
"""
from __future__ import annotations

from typing import Any

from .buffers import buffer_span
from .engine import _require_native

# From this size the native CRC splits a buffer over the kernels' thread pool (csrc/io/crc32c.cpp).
_SPLIT_FROM = 2 << 20
_pool_configured = False


def _configure_pool() -> None:
    """Give the kernels' thread pool its default size (TIERSTATE_NUM_THREADS or the
    cores torch uses) before the first large CRC, which may come before any kernel call."""
    global _pool_configured
    from ..kernels import backend  # noqa: PLC0415 - the kernels load only when a CRC is split

    backend.get_num_threads()
    _pool_configured = True


def crc32c(buf: Any, value: int = 0, *, isa: str | None = None) -> int:
    """The CRC-32C of ``buf`` (a CPU tensor, numpy array or buffer-protocol object),
    continuing from ``value`` (the CRC of the bytes before it; 0 to start). A buffer of
    2 MiB or more is split over the kernels' threads (:func:`tierstate.kernels.set_num_threads`)
    unless ``isa`` names a variant."""
    if not isinstance(value, int) or not 0 <= value < 2**32:
        raise ValueError(f"value={value!r}: expected the CRC-32C of the preceding bytes, an int in [0, 2**32)")
    address, nbytes, keepalive = buffer_span(buf, writable=False)
    if not isa and nbytes >= _SPLIT_FROM and not _pool_configured:
        _configure_pool()
    try:
        return _require_native().io_crc32c(address, nbytes, value, isa or "")
    finally:
        del keepalive


def checksums_beside_kernels() -> bool:
    """Whether a CRC taken by the I/O engine (``File.pread/pwrite(..., checksum=True)``) runs
    beside the kernels rather than in their place: the kernels' pool leaves a core of this
    process's share free (:func:`tierstate.kernels.set_num_threads` below it). The engine's
    checksum thread then takes a record's CRC while the caller goes on; without a free core
    it only takes one from the kernels (see [Note: checksums taken by the engine] in
    csrc/io/engine.h for the figures either way)."""
    from ..kernels import backend  # noqa: PLC0415 - the kernels load only when asked

    return backend.get_num_threads() < backend.default_num_threads()


def crc32c_isas() -> list[str]:
    """The CRC-32C variants this CPU and build can run, fastest first (``"table"`` last, always)."""
    return list(_require_native().io_crc32c_isas())


__all__ = ["checksums_beside_kernels", "crc32c", "crc32c_isas"]
