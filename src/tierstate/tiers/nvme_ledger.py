"""What the NVMe tier knows about its records beyond the files: checksums, failed I/O.

[Note: what a failed I/O leaves]
A failed *write* loses nothing: the pool copies the record's bytes out of the buffer
before the buffer is reused (the read queued behind the write starts only once the
write's outcome is known) into the ledger's ``stranded`` records, and every later read of
that record takes them instead of the file, until a write of it lands. The step
therefore completes in memory; the optimizer raises the write's error (path, errno) at
the end of ``step()``. :meth:`NvmeTier.settle` writes the stranded records again; the
optimizer calls it before a step modifies anything, so while they still cannot be
written the step raises at once, leaving parameters and state exactly as before it.
``state_dict()`` and ``save_optimizer`` read them from RAM. Each stranded record costs
one record of RAM beyond the pool.

A failed *read* (EIO, a short read, a shrunken file, a CRC mismatch) cannot be made
harmless: the bytes on disk were the only copy of that record, and the step may already
have updated other sub-groups when the read-ahead's failure surfaces (a step streams
state larger than RAM, so it cannot verify every record first). The record is marked
lost; its acquire, every later step (at :meth:`NvmeTier.settle`) and every read of it
raise :class:`~tierstate.io.StateLostError` until a checkpoint is loaded
(:meth:`NvmeTier.forget_state`: a load replaces every state, so every record then
starts from its initial values, built in RAM without reading the files). No error is
sticky beyond its cause: a buffer keeps a failed read's error only until its acquire
raises it.
"""
from __future__ import annotations

import threading

from torch import Tensor

from .. import io as tio
from .nvme_records import InitialImage


class Ledger:
    """The records' checksums and failures, shared by the tier and its buffer pool.

    ``crc``: sub-group index -> CRC-32C of the record as last written (initial values
    included); every read is checked against it. ``stranded``: records whose write-back
    failed, as a private copy of the newest bytes, which every read of that record takes
    instead of the file until a write of it lands. ``write_errors``: failed writes not
    yet reported to the caller. ``lost``: records that could not be read back as written.
    ``sizes``: the size each state file must have. ``fresh``: records whose state was
    forgotten (a load follows), read as ``image`` builds them, not from the file, until
    written. The lock guards every field: the optimizer may reach the tier from the
    autograd engine's threads (``step_in_backward``) as well as the main thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.crc: dict[int, int] = {}
        self.stranded: dict[int, Tensor] = {}
        self.write_errors: list[tuple[int, BaseException]] = []  # (sub-group index, error)
        self.lost: dict[int, BaseException] = {}
        self.sizes: list[int] = []
        self.fresh: set[int] = set()
        self.image: InitialImage | None = None

    def for_read(self, key: int) -> tuple[bool, Tensor | None, BaseException | None, int | None]:
        """``(fresh, stranded bytes, lost error, crc)`` of record ``key``: where its read comes from."""
        with self.lock:
            return key in self.fresh, self.stranded.get(key), self.lost.get(key), self.crc.get(key)

    def wrote(self, key: int, crc: int) -> None:
        """A write of record ``key`` landed: the file holds it, with this CRC-32C."""
        with self.lock:
            self.crc[key] = crc
            self.stranded.pop(key, None)
            self.lost.pop(key, None)
            self.fresh.discard(key)

    def write_failed(self, key: int, exc: OSError, data: Tensor, path: str, offset: int) -> None:
        """A write of record ``key`` failed: keep a copy of ``data`` (the buffer is about to be
        reused) and the error, or mark the record lost if RAM cannot hold the copy."""
        try:
            copy = data.clone()
        except RuntimeError as mem:  # out of memory: the newest bytes have nowhere to go
            lost = tio.StateLostError(exc.errno, f"could not be written ({exc}) nor kept in RAM ({mem})",
                                      path, offset, key)
            with self.lock:
                self.lost[key] = lost
                self.write_errors.append((key, lost))
            return
        with self.lock:
            self.stranded[key] = copy
            self.write_errors.append((key, exc))

    def mark_lost(self, key: int, exc: BaseException) -> None:
        """Record ``key`` could not be read back as written."""
        with self.lock:
            self.lost[key] = exc

    def rewrote(self, key: int, data: Tensor, crc: int) -> None:
        """A stranded record was written again: drop the copy, unless a newer one replaced it."""
        with self.lock:
            if self.stranded.get(key) is data:
                del self.stranded[key]
                self.crc[key] = crc

    def lost_error(self) -> BaseException | None:
        """The :class:`~tierstate.io.StateLostError` of a record found lost, or ``None``."""
        with self.lock:
            return next(iter(self.lost.values()), None)

    def take_write_errors(self) -> tuple[list[BaseException], list[BaseException], int]:
        """The write failures not reported yet: those whose record is still kept in RAM or
        lost, those a later write of the same record has superseded since (nothing is lost, but
        the disk failed a write: a step in backward writes a record, rolls it back and writes it
        again), and how many records are kept in RAM. Forgets them (each is reported once)."""
        with self.lock:
            errors, self.write_errors = self.write_errors, []
            pending = [exc for key, exc in errors if key in self.stranded or key in self.lost]
            superseded = [exc for key, exc in errors if not (key in self.stranded or key in self.lost)]
            return pending, superseded, len(self.stranded)

    def forget(self, keys: set[int]) -> None:
        """Every record reads as its initial values until written; no failure matters any more."""
        with self.lock:
            self.lost.clear()
            self.stranded.clear()
            self.write_errors.clear()
            self.fresh = set(keys)


def kept_in_ram(exc: OSError, kept: int) -> OSError:
    """``exc`` (a write's error, path and errno kept) with what the tier did about it."""
    note = (f"; {kept} NVMe record(s) that could not be written are kept in RAM (state intact): the next "
            "step(), flush or save_optimizer writes them again, and step() refuses to start while they "
            "still cannot be written")
    if isinstance(exc, tio.FileIOError):
        out = type(exc)(exc.errno, (exc.strerror or "") + note, exc.filename, exc.offset)
    else:
        out = tio.FileIOError(exc.errno, f"{exc.strerror or exc}{note}", exc.filename)
    out.__cause__ = exc
    return out


__all__ = ["Ledger", "kept_in_ram"]
