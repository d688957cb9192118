"""Durable file writing and reading for checkpoints: streamed shards, fsync, atomic rename.

Shards go through :mod:`tierstate.io` (O_DIRECT where the filesystem allows it, requests
queued on the engine's threads) when the native module is available, and through plain
buffered ``os.pwrite``/``os.pread`` + ``fsync`` otherwise. Either way the caller fills one
aligned buffer while the other is being written (two buffers: the RAM a save or load
holds, whatever the size of the state).
"""
from __future__ import annotations

import errno
import os
import time
from typing import Iterator

import torch

from ..io import engine_available
from ..io.errors import FileIOError, from_oserror
from .format import Checksum


# Testing aid: TIERSTATE_TEST_PAUSE_AT=<phase>:<marker file> makes a save stop at <phase>:
# it writes its pid into <marker file> and sleeps until killed, so that a test can kill -9
# the writer at exactly that point (tests/checkpoint/test_kill.py). Unset, it costs one
# environment lookup per phase.
PAUSE_ENV = "TIERSTATE_TEST_PAUSE_AT"
PAUSE_PHASES = (
    "shard-written",       # the first shard's data written, before its fsync and rename
    "shard-closed",        # the first shard fsynced and closed, before its rename
    "shards-renamed",      # every shard fsynced and renamed, before the manifest is written
    "manifest-written",    # the new manifest written and fsynced under its temporary name, before its rename
    "manifest-renamed",    # the new manifest renamed into place, before the directory's fsync
    "manifest-committed",  # the new manifest renamed into place, before any old shard is deleted
    "cleanup",             # one old file deleted, others still there
)


def pause_point(phase: str) -> None:
    """Stop here, forever, if ``TIERSTATE_TEST_PAUSE_AT`` names ``phase`` (a testing aid)."""
    wanted = os.environ.get(PAUSE_ENV)
    if not wanted:
        return
    name, _, marker = wanted.partition(":")
    if name not in PAUSE_PHASES or not marker:
        raise ValueError(f"{PAUSE_ENV}={wanted!r}: expected '<phase>:<marker file>' with a phase among {PAUSE_PHASES}")
    if name != phase:
        return
    with open(marker, "w") as f:
        f.write(str(os.getpid()))
    while True:
        time.sleep(3600)


def aligned_buffer(nbytes: int) -> torch.Tensor:
    """A 4 KiB-aligned uint8 host buffer (aligned_empty when the engine exists)."""
    if engine_available():
        from ..io import aligned_empty  # noqa: PLC0415

        return aligned_empty(nbytes)
    return torch.empty(nbytes, dtype=torch.uint8)


class _Done:
    """The already-finished result of a synchronous write/read (same face as IOFuture)."""

    __slots__ = ("_n",)

    def __init__(self, n: int) -> None:
        self._n = n

    def get(self) -> int:
        return self._n


class _BufferedFile:
    """The fallback when tierstate.io is unavailable: os.pwrite/os.pread, same interface."""

    direct = False

    def __init__(self, path: str, mode: str) -> None:
        self.path = path
        flags = os.O_RDONLY if mode == "r" else os.O_WRONLY | os.O_CREAT | os.O_EXCL
        try:
            self._fd = os.open(path, flags | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise from_oserror(exc, path, None, "open") from exc

    def pwrite(self, buf: torch.Tensor, offset: int, size: int) -> _Done:
        view = memoryview(buf.numpy())[:size]
        done = 0
        while done < size:
            try:
                done += os.pwrite(self._fd, view[done:], offset + done)
            except OSError as exc:
                raise from_oserror(exc, self.path, offset + done, "write") from exc
        return _Done(size)

    def pread(self, buf: torch.Tensor, offset: int, size: int) -> _Done:
        view = memoryview(buf.numpy())
        done = 0
        while done < size:
            try:
                n = os.preadv(self._fd, [view[done:size]], offset + done)
            except OSError as exc:
                raise from_oserror(exc, self.path, offset + done, "read") from exc
            if n == 0:
                break
            done += n
        return _Done(done)

    def sync(self) -> None:
        try:
            os.fsync(self._fd)
        except OSError as exc:
            raise from_oserror(exc, self.path, None, "fsync") from exc

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def open_file(path: str, mode: str):
    """``mode`` "r" (read) or "x" (create, must not exist, write) through the best path here."""
    if engine_available():
        from ..io import File  # noqa: PLC0415

        return File(path, mode, direct=True)
    return _BufferedFile(path, mode)


def describe_writer() -> str:
    """Which path writes shards here, for the manifest (and for people reading it)."""
    if not engine_available():
        return "buffered os.pwrite + fsync (tierstate.io native engine unavailable)"
    from ..io import default_engine  # noqa: PLC0415

    return f"tierstate.io O_DIRECT where the filesystem allows it, {default_engine().backend} backend, + fsync"


class ShardSink:
    """Streams bytes into a new file through two aligned buffers, checksumming as it goes.

    ``put`` copies into the current buffer; a full buffer is checksummed and queued for
    writing at its (aligned) file offset while the next one fills. ``finish`` writes the
    tail, waits for every write, fsyncs and closes, returning (bytes, checksum hex).
    """

    def __init__(self, path: str, buffers: list[torch.Tensor], checksum: str) -> None:
        self.path = path
        self._file = open_file(path, "x")
        self._buffers = buffers
        self._pending: list = [None] * len(buffers)
        self._current = 0
        self._fill = 0
        self._offset = 0
        self._sum = Checksum(checksum)

    def put(self, data: torch.Tensor) -> None:
        """Append the bytes of ``data`` (a contiguous uint8 CPU tensor)."""
        pos, n = 0, data.numel()
        while pos < n:
            buf = self._buffers[self._current]
            if self._fill == 0 and self._pending[self._current] is not None:
                self._pending[self._current].get()  # this buffer's previous write must be done
                self._pending[self._current] = None
            take = min(n - pos, buf.numel() - self._fill)
            buf[self._fill: self._fill + take].copy_(data[pos: pos + take])
            self._fill += take
            pos += take
            if self._fill == buf.numel():
                self._flush()

    def _flush(self) -> None:
        buf = self._buffers[self._current]
        self._sum.update(memoryview(buf.numpy())[: self._fill])
        self._pending[self._current] = self._file.pwrite(buf, self._offset, self._fill)
        self._offset += self._fill
        self._fill = 0
        self._current = (self._current + 1) % len(self._buffers)

    def finish(self) -> tuple[int, str]:
        if self._fill:
            self._flush()
        for i, fut in enumerate(self._pending):
            if fut is not None:
                fut.get()
                self._pending[i] = None
        pause_point("shard-written")
        self._file.sync()
        self._file.close()
        return self._offset, self._sum.hexdigest()

    def abort(self) -> None:
        """Wait for queued writes (their buffers are ours), close, and remove the file."""
        for fut in self._pending:
            if fut is not None:
                try:
                    fut.get()
                except OSError:
                    pass  # the first error is the one being reported
        self._file.close()
        remove_quietly(self.path)


def read_chunks(path: str, size: int, buffers: list[torch.Tensor]) -> Iterator[tuple[int, torch.Tensor]]:
    """Yields (file offset, bytes) over ``size`` bytes of ``path``, one buffer at a time.

    The read of the next chunk is in flight while the caller uses the current one; a
    yielded chunk is valid until the generator is resumed.
    """
    chunk = buffers[0].numel()
    offsets = list(range(0, size, chunk))
    f = open_file(path, "r")
    futures: dict[int, object] = {}
    try:
        def submit(i: int) -> None:
            if i < len(offsets):
                n = min(chunk, size - offsets[i])
                futures[i] = f.pread(buffers[i % len(buffers)], offsets[i], n)

        for i in range(min(len(buffers), len(offsets))):
            submit(i)
        for i, off in enumerate(offsets):
            want = min(chunk, size - off)
            got = futures.pop(i).get()
            if got != want:  # the file shrank since its size was checked: errno EIO, with the path
                raise CorruptCheckpointError(f"the file ends {got} bytes into the {want}-byte read at offset {off} "
                                             f"({size} bytes expected): it was truncated while being read", path)
            yield off, buffers[i % len(buffers)][:want]
            submit(i + len(buffers))
    finally:
        for fut in futures.values():
            try:
                fut.get()
            except OSError:
                pass  # already failing; the buffers just must not be written after we return
        f.close()


def fsync_dir(path: str) -> None:
    """Make a directory's entries (creations, renames, unlinks) durable."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise from_oserror(exc, path, None, "open directory") from exc
    try:
        os.fsync(fd)
    except OSError as exc:
        raise from_oserror(exc, path, None, "fsync directory") from exc
    finally:
        os.close(fd)


def write_file_atomic(directory: str, name: str, data: bytes, tmp_name: str) -> None:
    """Write ``data`` to ``directory/tmp_name``, fsync it, rename it to ``name``, fsync the dir.

    A failure before the rename, an interrupt included (KeyboardInterrupt, a signal
    handler's ``sys.exit``), removes the temporary file and leaves ``name`` as it was.
    """
    tmp = os.path.join(directory, tmp_name)
    final = os.path.join(directory, name)
    fd, op = -1, "open"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        op = "write"
        view, done = memoryview(data), 0
        while done < len(data):
            done += os.write(fd, view[done:])
        os.fsync(fd)
        os.close(fd)
        fd, op = -1, "rename"
        pause_point("manifest-written")
        os.replace(tmp, final)
    except BaseException as exc:
        if fd >= 0:
            os.close(fd)
        if op != "open":  # an O_EXCL open that failed made nothing, and the file may be another's
            remove_quietly(tmp)
        if isinstance(exc, OSError):
            raise from_oserror(exc, final if op == "rename" else tmp, None, op) from exc
        raise
    pause_point("manifest-renamed")
    fsync_dir(directory)


def rename(src: str, dst: str) -> None:
    try:
        os.replace(src, dst)
    except OSError as exc:
        raise from_oserror(exc, dst, None, "rename") from exc


def remove_quietly(path: str) -> None:
    """Unlink ``path`` if it exists (cleanup after a failure must not mask the failure)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError:
        pass  # e.g. EROFS: leaving a stray temp file is better than hiding the real error


def file_size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError as exc:
        raise from_oserror(exc, path, None, "stat") from exc


class CorruptCheckpointError(FileIOError):
    """A checkpoint file whose size or checksum differs from what its manifest records."""

    def __init__(self, message: str, path: str) -> None:
        super().__init__(errno.EIO, message, path, None)


__all__ = ["CorruptCheckpointError", "ShardSink", "read_chunks", "fsync_dir", "write_file_atomic"]
