"""Asynchronous direct file I/O for host buffers (tensors, numpy arrays, bytearrays).

    import tierstate.io as tio
    buf = tio.aligned_empty(64 << 20)
    with tio.File("/nvme/state.bin", "w+") as f:
        f.pwrite(buf).get()                 # bytes written
        n = f.read(buf, offset=0)           # bytes read (short at end of file)

Backends: io_uring when the kernel and container allow it, else a thread pool doing
pread/pwrite; :func:`default_engine` ``.backend`` says which one runs.

:func:`crc32c` checksums host buffers without the GIL (the NVMe tier verifies every record
it reads with it); :mod:`tierstate.io.faults` injects I/O failures for tests.
"""
from .buffers import (DEFAULT_ALIGNMENT, aligned_empty, huge_page_eligible, huge_page_size, mapping_fields,
                      page_locked_empty)
from .checksum import checksums_beside_kernels, crc32c, crc32c_isas
from .engine import Engine, default_engine, engine_available, set_default_engine, uring_available
from .errors import (
    DiskFullError,
    FileIOError,
    FileIOExistsError,
    FileIONotFoundError,
    FileIOPermissionError,
    ReadOnlyFilesystemError,
    ShortReadError,
    StateLostError,
    first_noting_others,
)
from .file import File, IOFuture
from .space import free_bytes, reserve

__all__ = [
    "DEFAULT_ALIGNMENT",
    "DiskFullError",
    "Engine",
    "File",
    "FileIOError",
    "first_noting_others",
    "FileIOExistsError",
    "FileIONotFoundError",
    "FileIOPermissionError",
    "IOFuture",
    "ReadOnlyFilesystemError",
    "ShortReadError",
    "StateLostError",
    "checksums_beside_kernels",
    "crc32c",
    "crc32c_isas",
    "aligned_empty",
    "page_locked_empty",
    "huge_page_eligible",
    "mapping_fields",
    "huge_page_size",
    "default_engine",
    "engine_available",
    "free_bytes",
    "reserve",
    "set_default_engine",
    "uring_available",
]
