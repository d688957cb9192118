"""Typed I/O errors: every failure of the engine is an :class:`OSError` subclass that
carries ``errno``, ``filename`` (the path) and ``offset`` (the file offset it concerns).

The class follows the errno, so ordinary ``except`` clauses keep working::

    except FileNotFoundError:      # ENOENT
    except PermissionError:        # EACCES / EPERM
    except DiskFullError:          # ENOSPC / EDQUOT
    except ReadOnlyFilesystemError:  # EROFS
    except FileIOError as e:       # any of them; e.errno, e.filename, e.offset
"""
from __future__ import annotations

import errno as _errno
import os


class FileIOError(OSError):
    """An I/O failure on ``filename`` at file ``offset`` (``None`` when no offset applies)."""

    def __init__(self, err: int | None, message: str, path: str | None, offset: int | None = None):
        super().__init__(err, message, path)
        self.offset = offset

    def __str__(self) -> str:
        where = f" at offset {self.offset}" if self.offset is not None else ""
        code = f"[Errno {self.errno}] " if self.errno is not None else ""
        return f"{code}{self.strerror}: {self.filename!r}{where}"

    def __reduce__(self):
        return (type(self), (self.errno, self.strerror, self.filename, self.offset))


class DiskFullError(FileIOError):
    """No space left on the device (ENOSPC) or over quota (EDQUOT)."""


class ReadOnlyFilesystemError(FileIOError):
    """The file lives on a read-only filesystem (EROFS)."""


class FileIONotFoundError(FileIOError, FileNotFoundError):
    """The path does not exist (ENOENT)."""


class FileIOPermissionError(FileIOError, PermissionError):
    """Permission denied (EACCES, EPERM)."""


class FileIOExistsError(FileIOError, FileExistsError):
    """The file exists and exclusive creation was asked (EEXIST)."""


class ShortReadError(FileIOError, EOFError):
    """``read_exact`` reached the end of the file before filling the buffer.

    ``expected`` and ``got`` give the requested and the actual byte counts."""

    def __init__(self, path: str, offset: int, expected: int, got: int):
        super().__init__(
            None,
            f"read_exact wanted {expected} bytes but the file ends after {got} "
            f"(file offset {offset}); use read() to accept a short count",
            path,
            offset,
        )
        self.expected = expected
        self.got = got

    def __reduce__(self):
        return (type(self), (self.filename, self.offset, self.expected, self.got))


_BY_ERRNO: dict[int, type[FileIOError]] = {
    _errno.ENOSPC: DiskFullError,
    _errno.EDQUOT: DiskFullError,
    _errno.EROFS: ReadOnlyFilesystemError,
    _errno.ENOENT: FileIONotFoundError,
    _errno.EACCES: FileIOPermissionError,
    _errno.EPERM: FileIOPermissionError,
    _errno.EEXIST: FileIOExistsError,
}


def first_noting_others(errors) -> BaseException | None:
    """The first of ``errors`` (``None`` entries skipped; ``None`` if none is left), carrying
    each other one as a note (``add_note``, Python >= 3.11: a traceback prints it), so a
    failure on a second disk is not hidden behind the first. Found 2026-12-07: a step whose
    optimizer-state write and weight write-back both failed named only the state's file."""
    errors = [e for e in errors if e is not None]
    if not errors:
        return None
    first = errors[0]
    if hasattr(first, "add_note"):
        told = {_what(first)}
        for other in errors[1:]:
            if _what(other) not in told:  # one note per file and errno: a full disk fails every record
                told.add(_what(other))
                first.add_note(f"also failed in this step: {type(other).__name__}: {other}")
    return first


def _what(exc: BaseException) -> tuple:
    if isinstance(exc, OSError) and exc.filename is not None:
        return (exc.errno, exc.filename)
    return (type(exc), str(exc))


def io_error(err: int, path: str | None, offset: int | None, operation: str) -> FileIOError:
    """The typed error for ``err`` raised by ``operation`` ("read", "write", "open", ...)."""
    cls = _BY_ERRNO.get(err, FileIOError)
    return cls(err, f"{operation} failed: {os.strerror(err)}", path, offset)


def from_oserror(exc: OSError, path: str | None, offset: int | None, operation: str) -> FileIOError:
    """Re-types an ``OSError`` from the native module (or ``os``) as a :class:`FileIOError`."""
    if isinstance(exc, FileIOError):
        return exc
    err = exc.errno if exc.errno is not None else _errno.EIO
    new = io_error(err, exc.filename or path, offset, operation)
    detail = exc.strerror or str(exc)
    new.strerror = f"{operation} failed: {detail}"
    return new


class StateLostError(FileIOError):
    """A scratch record of the NVMe tier cannot be read back as it was written.

    Raised when a record's file is shorter than the records it holds (truncated), when
    the bytes read back do not match the CRC-32C taken when they were written (changed
    by another process, a bit flip, a torn write), or when the read itself fails (EIO).
    The state that lived in that record exists nowhere else: the run must resume from
    its last checkpoint. ``record`` is the sub-group index, ``filename`` the state
    file, ``offset`` the record's file offset, ``errno`` the read's errno (``None``
    for a checksum mismatch or a shrunken file), ``reason`` the finding in words.
    """

    def __init__(self, err: int | None, reason: str, path: str | None, offset: int | None = None,
                 record: int | None = None):
        self.reason = reason
        self.record = record
        super().__init__(
            err,
            f"NVMe scratch record {record} {reason}: the optimizer state held there is lost (the scratch "
            "files exist only for this run); resume from the last checkpoint with "
            "tierstate.load_optimizer(optimizer, checkpoint_dir)",
            path,
            offset,
        )

    def __reduce__(self):
        return (type(self), (self.errno, self.reason, self.filename, self.offset, self.record))
