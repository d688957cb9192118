"""A file handle for the engine, shaped like kvikio's ``CuFile``:

    with tierstate.io.File(path, "w") as f:
        fut = f.pwrite(tensor)          # queued; returns at once
        fut.get()                       # bytes written, or raises a FileIOError
        f.write(tensor, offset=4096)    # the blocking form is pwrite(...).get()

Reads return the number of bytes actually read: fewer than asked when the file ends
first (0 past the end). :meth:`File.read_exact` raises :class:`ShortReadError` instead.
"""
from __future__ import annotations

import mmap
import os
import weakref
from typing import Any

from . import faults as _faults
from .buffers import buffer_span
from .engine import Engine, default_engine, say_once
from .errors import ShortReadError, from_oserror, io_error

_MODES = {
    "r": os.O_RDONLY,
    "r+": os.O_RDWR,
    "w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
    "w+": os.O_RDWR | os.O_CREAT | os.O_TRUNC,
    "x": os.O_WRONLY | os.O_CREAT | os.O_EXCL,
    "x+": os.O_RDWR | os.O_CREAT | os.O_EXCL,
}


class IOFuture:
    """A queued read or write. ``get()`` waits and returns the bytes moved or raises.

    The future keeps the buffer alive until the I/O completes; dropping an unfinished
    future waits for it (the kernel may still be writing into the buffer)."""

    __slots__ = ("_request", "_keepalive", "_path", "_offset", "_op", "_result", "__weakref__")

    def __init__(self, request: Any, keepalive: Any, path: str, offset: int, op: str) -> None:
        self._request = request
        self._keepalive = keepalive
        self._path = path
        self._offset = offset
        self._op = op
        self._result: tuple[int, int, int] | None = None

    def done(self) -> bool:
        """Whether the I/O has finished (successfully or not); never blocks."""
        return self._result is not None or self._request.done()

    def _wait(self) -> tuple[int, int, int]:
        if self._result is None:
            self._result = self._request.wait()
            self._keepalive = None
        return self._result

    def get(self) -> int:
        """Waits; returns the bytes moved. Raises a :class:`FileIOError` subclass carrying
        the path, the errno and the file offset of the first failed piece; a failed write
        claims nothing written (its file range holds unknown contents)."""
        nbytes, err, err_offset = self._wait()
        if err:
            raise io_error(err, self._path, err_offset, self._op)
        return nbytes

    def crc(self) -> int:
        """Waits; the CRC-32C (:func:`tierstate.io.crc32c`) of the bytes moved, taken on the
        engine's checksum thread piece by piece: a read's once it landed in the buffer, a
        write's from the buffer once written. Only for a request made with ``checksum=True``; call
        :meth:`get` first, which raises if the request failed (the CRC then covers only
        what moved)."""
        self._wait()
        return self._request.crc()

    def __del__(self) -> None:
        if self._result is None and getattr(self, "_request", None) is not None:
            self._wait()

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"IOFuture({self._op} {self._path!r} @ {self._offset}, {state})"


class _FailedRequest:
    """A request that failed before reaching the disk (see :mod:`tierstate.io.faults`)."""

    def __init__(self, err: int, offset: int) -> None:
        self._result = (0, err, offset)

    def done(self) -> bool:
        return True

    def wait(self) -> tuple[int, int, int]:
        return self._result

    def crc(self) -> int:
        raise ValueError("crc(): the request failed before reaching the disk; get() says why")


class File:
    """An open file whose reads and writes run on an :class:`Engine`.

    Args:
        path: file to open.
        mode: ``"r"``, ``"r+"``, ``"w"``, ``"w+"``, ``"x"`` or ``"x+"`` as in :func:`open`
            (a ``"b"`` is accepted and ignored; append modes are not offered because
            ``pwrite`` on Linux ignores the offset under ``O_APPEND``).
        direct: use ``O_DIRECT`` for the aligned body of each request. When the filesystem
            refuses it, the file silently uses buffered I/O and :attr:`direct_note` says so.
        engine: the engine to run on; default :func:`default_engine`.
        perm: permission bits for a created file.

    Unaligned heads/tails of a request (file offsets not multiple of
    :attr:`split_align`: :attr:`offset_align` rounded up to the page size) go through a
    second, buffered descriptor; a buffer address not aligned to :attr:`mem_align` goes
    through a per-worker aligned bounce buffer. The split is per page because a buffered
    head dirties its whole page, whose writeback would overwrite direct-written bytes that
    shared it.
    """

    def __init__(self, path: str | os.PathLike, mode: str = "r", *, direct: bool = True,
                 engine: Engine | None = None, perm: int = 0o644) -> None:
        clean = mode.replace("b", "")
        if clean not in _MODES:
            raise ValueError(f"mode={mode!r}: expected one of {sorted(_MODES)}")
        self._path = os.fspath(path)
        self._mode = clean
        self._engine = engine if engine is not None else default_engine()
        self._futures: "weakref.WeakSet[IOFuture]" = weakref.WeakSet()
        from .engine import _require_native

        try:
            self._native = _require_native().IOFile(self._path, _MODES[clean], perm, bool(direct))
        except OSError as exc:
            raise from_oserror(exc, self._path, None, "open") from exc
        if direct and not self._native.direct:
            say_once(f"direct:{os.path.dirname(os.path.abspath(self._path))}",
                     "tierstate.io: %s: %s", self._path, self._native.direct_note)

    # ---- properties ----
    @property
    def path(self) -> str:
        return self._path

    @property
    def mode(self) -> str:
        return self._mode

    @property
    def engine(self) -> Engine:
        return self._engine

    @property
    def direct(self) -> bool:
        """Whether O_DIRECT is in use for aligned pieces."""
        return self._native.direct

    @property
    def direct_note(self) -> str:
        """Why O_DIRECT is off ("" when it is on)."""
        return self._native.direct_note

    @property
    def mem_align(self) -> int:
        """Buffer address alignment O_DIRECT needs on this file (statx DIOALIGN, else 4096)."""
        return self._native.mem_align

    @property
    def offset_align(self) -> int:
        """File offset/length alignment O_DIRECT needs on this file (statx DIOALIGN, else 4096)."""
        return self._native.offset_align

    @property
    def split_align(self) -> int:
        """Offsets that are multiples of this go direct: :attr:`offset_align` or the page size,
        whichever is larger."""
        return max(self.offset_align, mmap.PAGESIZE)

    @property
    def alignment_source(self) -> str:
        """``"statx"`` when the kernel reported the alignments, ``"default"`` otherwise."""
        return self._native.alignment_source

    @property
    def closed(self) -> bool:
        return self._native.closed

    def stats(self) -> dict[str, int]:
        """Bytes moved so far by path: ``direct`` (O_DIRECT from the caller's buffer),
        ``bounced`` (O_DIRECT through an aligned bounce buffer), ``buffered``."""
        direct, bounced, buffered = self._native.stats()
        return {"direct": direct, "bounced": bounced, "buffered": buffered}

    # ---- I/O ----
    def _submit(self, write: bool, buf: Any, offset: int, size: int | None, checksum: bool = False) -> IOFuture:
        if self._native.closed:
            raise ValueError(f"I/O on closed file {self._path!r}")
        self._engine.check_owner()
        if not isinstance(offset, int) or offset < 0:
            raise ValueError(f"offset={offset!r}: expected a file offset >= 0")
        address, nbytes, keepalive = buffer_span(buf, writable=not write)
        if size is None:
            size = nbytes
        elif not isinstance(size, int) or not 0 <= size <= nbytes:
            raise ValueError(f"size={size!r}: expected an int in [0, {nbytes}] (the buffer's bytes)")
        op = "write" if write else "read"
        injected = _faults._check(op, self._path)
        if injected:
            return IOFuture(_FailedRequest(injected, offset), keepalive, self._path, offset, op)
        try:
            request = self._engine._native.submit(self._native, write, address, size, offset, bool(checksum))
        except OSError as exc:
            raise from_oserror(exc, self._path, offset, op) from exc
        fut = IOFuture(request, keepalive, self._path, offset, op)
        self._futures.add(fut)
        return fut

    def pread(self, buf: Any, offset: int = 0, size: int | None = None, *, checksum: bool = False) -> IOFuture:
        """Queues a read of ``size`` bytes (default: all of ``buf``) from file ``offset``
        into ``buf``. ``get()`` returns the bytes read: fewer at the end of the file. With
        ``checksum=True`` the engine's checksum thread also takes their CRC-32C (``crc()``),
        off the calling thread."""
        return self._submit(False, buf, offset, size, checksum)

    def pwrite(self, buf: Any, offset: int = 0, size: int | None = None, *, checksum: bool = False) -> IOFuture:
        """Queues a write of ``size`` bytes (default: all of ``buf``) at file ``offset``;
        ``checksum`` as in :meth:`pread` (the buffer must not change until the write is done)."""
        return self._submit(True, buf, offset, size, checksum)

    def read(self, buf: Any, offset: int = 0, size: int | None = None) -> int:
        """Blocking :meth:`pread`: returns the bytes actually read (short at end of file)."""
        return self.pread(buf, offset, size).get()

    def read_exact(self, buf: Any, offset: int = 0, size: int | None = None) -> int:
        """Like :meth:`read`, but raises :class:`ShortReadError` unless ``size`` bytes were read."""
        fut = self.pread(buf, offset, size)
        want = size if size is not None else buffer_span(buf, writable=True)[1]
        got = fut.get()
        if got != want:
            raise ShortReadError(self._path, offset, want, got)
        return got

    def write(self, buf: Any, offset: int = 0, size: int | None = None) -> int:
        """Blocking :meth:`pwrite`: returns the bytes written (always all of them, or raises)."""
        return self.pwrite(buf, offset, size).get()

    def size(self) -> int:
        """The file's current size in bytes."""
        try:
            return self._native.size()
        except OSError as exc:
            raise from_oserror(exc, self._path, None, "fstat") from exc

    def truncate(self, nbytes: int) -> None:
        """Sets the file's size to ``nbytes``."""
        if not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"nbytes={nbytes!r}: expected an int >= 0")
        try:
            self._native.truncate(nbytes)
        except OSError as exc:
            raise from_oserror(exc, self._path, nbytes, "truncate") from exc

    def sync(self) -> None:
        """fsync: data and metadata reach the device."""
        try:
            self._native.sync()
        except OSError as exc:
            raise from_oserror(exc, self._path, None, "fsync") from exc

    def close(self) -> None:
        """Waits for this file's queued I/O, then closes it. Errors of futures nobody
        collected are not raised here; call ``get()`` on them to see them."""
        for fut in list(self._futures):
            fut._wait()
        self._native.close()

    def __enter__(self) -> "File":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        how = "O_DIRECT" if self.direct else f"buffered ({self.direct_note})"
        return f"File({self._path!r}, {self._mode!r}, {how}, backend={self._engine.backend!r})"


__all__ = ["File", "IOFuture"]
