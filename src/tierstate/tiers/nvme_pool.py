"""The NVMe tier's buffer pool: each buffer's lifecycle and the reads and writes that move it.

[Note: a buffer's lifecycle]
A buffer is in one :class:`BufferState`; :data:`TRANSITIONS` lists every move and
:meth:`Buffer.move` is the only place that changes the state:

- ``load``: EMPTY, CLEAN, FAILED, FLUSHING, LOADING or DIRTY -> LOADING (from DIRTY the
  record it held is written back first, into the file, before the read reuses the memory);
- the read lands -> CLEAN; it fails -> FAILED, and the acquire that meets it raises its
  error and leaves the buffer EMPTY;
- ``acquire``: CLEAN -> ACQUIRED, DIRTY -> ACQUIRED_DIRTY (the step updates it);
- ``release``: ACQUIRED -> CLEAN or DIRTY (as the step says), ACQUIRED_DIRTY -> DIRTY;
- ``write_range``: CLEAN -> DIRTY, ACQUIRED -> ACQUIRED_DIRTY;
- ``flush``: DIRTY -> FLUSHING -> CLEAN when the write lands (its record stays resident);
- :meth:`NvmeTier.forget_state`: every unacquired state -> EMPTY.

[Note: I/O on the engine's futures]
Reads and writes are :class:`tierstate.io.IOFuture` requests on the process's I/O
engine; the pool has no threads of its own. A buffer runs its operations in order, so
"write the old record, then read the new one into the same memory" holds the read back
until the write's outcome is known (a failed write's bytes are copied to the ledger
first). Across buffers one dependency remains: a record evicted from buffer A (write in
flight) and needed again soon in buffer B is not read before A's write lands. Writes
never wait on anything, so nothing can deadlock. Completed requests are collected by
:meth:`Pool.progress`, which every call into the tier runs first and which then starts
the reads they held back; :meth:`Pool.wait` blocks on the request a buffer waits for.
A read held back behind a write thus starts at the next call into the tier rather than
the instant the write lands; the disk stays busy meanwhile with the other buffers'
requests. Against one Python thread per buffer running the same operations, the step
(``tierstate bench step --offload nvme``, reference VM, interleaved runs) took 195 ms
against 199 at 100M parameters (medians of 8) and 1655 ms against 1718 at 400M (of 3).

[Note: checksums]
The tier keeps, in RAM, the CRC-32C of every record as it was last written (4 bytes per
record; the initial values included) and checks every read against it, after checking
that the file is still as long as the records it holds (``fstat``): a record truncated
away, overwritten by another process (even with bytes that look valid), torn, or hit by
a bit flip raises :class:`~tierstate.io.StateLostError` at the read, and never reaches
an update. The CRC runs without the GIL, in the variant chosen at run time
(:func:`tierstate.io.crc32c_isas`; AVX-512 VPCLMULQDQ folding does 16-18 GB/s per Zen 4
core, the ``crc32`` instruction 11; on a Zen 1 EPYC 128-bit PCLMULQDQ folding 6.7-6.9 GB/s
per core from DRAM against the instruction's 5.3-5.4). Where it runs depends on the cores:

- when the kernels' pool leaves a core free (:func:`tierstate.io.checksums_beside_kernels`),
  on the I/O engine's checksum thread, as each piece of a record moves (``checksum=True``),
  while the step goes on. ``TIERSTATE_NUM_THREADS=1 tierstate bench step --offload nvme
  --params 400M --dtype bf16`` on the 2-vCPU Zen 4 VM, two rounds alternating with the
  CRCs on the caller: 1.07-1.08x the step's floor against 1.13-1.29x; with ``--moment-dtype
  q8 --quant-map fp8 --master-dtype bf16_kahan``, 562-569 ms (1.06-1.07x) against 611-656
  ms (1.17-1.21x);
- otherwise from the thread that calls into the tier: a write's when it is queued (the
  bytes the record must read back as), a read's when its completion is collected, a record
  of 2 MiB or more split over the kernels' threads, which are idle then (one core reads
  DRAM at ~15 GB/s; two did 28-33 GB/s on the Xeon VM). A checksum thread there takes its
  core from the kernels and the I/O worker: the fp32-state step at 400M took 1.07-1.13 s
  against 1.05-1.08 s on the caller (two rounds alternating).

It costs one more pass over every record moved, which competes with the update kernels
for memory bandwidth: +2 % step time at 400M parameters and +5 % at 100M (``tierstate
bench step --offload nvme``, benchmarks/README.md).
"""
from __future__ import annotations

import enum
import time
from collections import deque

from torch import Tensor

from .. import io as tio
from ..placement import SubGroup
from .nvme_ledger import Ledger
from .nvme_records import Stripes


class BufferState(enum.Enum):
    """Where a pool buffer is in its lifecycle (see [Note: a buffer's lifecycle])."""

    EMPTY = "empty"                    # holds no record
    LOADING = "loading"                # its record's read is queued or in flight
    FAILED = "failed"                  # the read failed; acquire raises its error
    CLEAN = "clean"                    # holds its record as the file (or the ledger) has it
    DIRTY = "dirty"                    # holds newer values than the file
    FLUSHING = "flushing"              # its record is being written back; clean once it lands
    ACQUIRED = "acquired"              # the step is updating it; was clean
    ACQUIRED_DIRTY = "acquired_dirty"  # the step is updating it; was dirty already


S = BufferState
TRANSITIONS: dict[BufferState, frozenset[BufferState]] = {
    S.EMPTY: frozenset({S.LOADING}),
    S.LOADING: frozenset({S.LOADING, S.CLEAN, S.FAILED, S.EMPTY}),
    S.FAILED: frozenset({S.LOADING, S.EMPTY}),
    S.CLEAN: frozenset({S.LOADING, S.ACQUIRED, S.DIRTY, S.EMPTY}),
    S.DIRTY: frozenset({S.LOADING, S.ACQUIRED_DIRTY, S.FLUSHING, S.EMPTY}),
    S.FLUSHING: frozenset({S.CLEAN, S.LOADING, S.EMPTY}),
    S.ACQUIRED: frozenset({S.CLEAN, S.DIRTY, S.ACQUIRED_DIRTY}),
    S.ACQUIRED_DIRTY: frozenset({S.DIRTY}),
}
# states in which the step holds the buffer: never evicted, never emptied
PINNED = frozenset({S.ACQUIRED, S.ACQUIRED_DIRTY})


class _Op:
    """One read or write of a record from or into a buffer's memory."""

    __slots__ = ("write", "sg", "after", "memory", "lane", "future", "crc", "engine_crc", "t0", "finished", "error")

    def __init__(self, write: bool, sg: SubGroup, after: "_Op | None" = None) -> None:
        self.write = write
        self.sg = sg
        self.after = after  # a write of the same record from another buffer, to land first
        self.memory: Tensor | None = None  # the buffer's, once started
        self.lane = ""
        self.future: tio.IOFuture | None = None
        self.crc: int | None = None  # the CRC-32C written (writes) or expected (reads)
        self.engine_crc = False  # taken by the engine's checksum thread, not by the caller
        self.t0 = 0.0
        self.finished = False  # its outcome is collected: in the ledger, and in ``error`` for a read
        self.error: BaseException | None = None  # a read's StateLostError

    def wait(self) -> None:
        """Block until the engine completes the request (its outcome is collected later)."""
        if self.future is not None and not self.finished:
            try:
                self.future.get()
            except OSError:
                pass  # collected, with the path and errno, by Pool.progress


class Buffer:
    """One pool buffer: ``memory`` (uint8, one record of the largest sub-group), the record
    ``sg`` it holds or is loading (``None`` when EMPTY), its :class:`BufferState`, and its
    operations: ``inflight`` on the engine, ``queued`` behind it."""

    def __init__(self, index: int, memory: Tensor) -> None:
        self.index = index
        self.lane = f"nvme-io-{index}"
        self.memory = memory
        self.state = BufferState.EMPTY
        self.sg: SubGroup | None = None
        self.last_use = 0
        self.error: BaseException | None = None  # FAILED: the read's error
        self.inflight: _Op | None = None
        self.queued: deque[_Op] = deque()

    def move(self, state: BufferState) -> None:
        """Change state; any move not in :data:`TRANSITIONS` is a bug in the tier."""
        if state not in TRANSITIONS[self.state]:
            raise AssertionError(f"NVMe buffer {self.index}: {self.state.name} -> {state.name} is not a "
                                 "transition of its lifecycle")
        self.state = state

    @property
    def busy(self) -> bool:
        """Whether an operation is queued or in flight."""
        return self.inflight is not None or bool(self.queued)

    @property
    def pinned(self) -> bool:
        return self.state in PINNED

    @property
    def dirty(self) -> bool:
        return self.state in (S.DIRTY, S.ACQUIRED_DIRTY)


class Pool:
    """The buffers, and the reads and writes between them and the files.

    Holds no reference to the tier (see :class:`~tierstate.tiers.nvme_records.Stripes`)."""

    def __init__(self, memories: list[Tensor], files: list, where: Stripes, ledger: Ledger, telemetry) -> None:
        self.buffers = [Buffer(i, m) for i, m in enumerate(memories)]
        self._files = files
        self._where = where
        self._ledger = ledger
        self._telemetry = telemetry

    # -- queueing --------------------------------------------------------------------------
    def load(self, buf: Buffer, sg: SubGroup, after: _Op | None) -> _Op | None:
        """Queue on ``buf``: write back what it holds if dirty, then read ``sg`` (once ``after``,
        a write of ``sg`` from another buffer, has landed). Returns the write queued, if any."""
        write = None
        if buf.state is S.DIRTY:
            write = _Op(True, buf.sg)
            buf.queued.append(write)
        buf.queued.append(_Op(False, sg, after))
        buf.sg, buf.error = sg, None
        buf.move(S.LOADING)
        self._advance(buf)
        return write

    def flush(self, buf: Buffer) -> _Op:
        """Queue the write-back of the DIRTY ``buf``'s record; it stays resident."""
        write = _Op(True, buf.sg)
        buf.queued.append(write)
        buf.move(S.FLUSHING)
        self._advance(buf)
        return write

    def empty(self, buf: Buffer) -> None:
        """Drop what an idle, unacquired ``buf`` holds (nothing is written)."""
        buf.sg, buf.error = None, None
        if buf.state is not S.EMPTY:
            buf.move(S.EMPTY)

    # -- progress ----------------------------------------------------------------------------
    def progress(self) -> None:
        """Collect every completed request and start the operations it held back. Never blocks."""
        changed = True
        while changed:
            changed = False
            for buf in self.buffers:
                changed |= self._advance(buf)

    def _advance(self, buf: Buffer) -> bool:
        """Collect ``buf``'s finished request and start what is queued behind it, as far as
        nothing in flight holds it back. Whether anything changed."""
        moved = False
        while True:
            op = buf.inflight
            if op is not None:
                if not op.finished:
                    if not op.future.done():
                        return moved
                    self._collect(op)
                buf.inflight = None
                moved = True
                self._after_op(buf, op)
                continue
            if not buf.queued:
                return moved
            op = buf.queued[0]
            if op.after is not None and not op.after.finished:
                if not op.after.future.done():
                    return moved
                self._collect(op.after)
            buf.queued.popleft()
            buf.inflight = op
            moved = True
            self._start(buf, op)

    def _after_op(self, buf: Buffer, op: _Op) -> None:
        """``buf``'s operation ``op`` finished: if it was the last, the buffer holds its record."""
        if buf.queued:
            return
        if buf.state is S.FLUSHING and op.write:
            buf.move(S.CLEAN)
        elif buf.state is S.LOADING and not op.write and op.sg is buf.sg:
            buf.error = op.error
            buf.move(S.CLEAN if op.error is None else S.FAILED)

    def wait(self, buf: Buffer) -> None:
        """Block until ``buf`` has no operation queued or in flight."""
        while True:
            self.progress()
            if not buf.busy:
                return
            if buf.inflight is not None:
                buf.inflight.wait()
            else:  # its read waits for a write from another buffer (started when queued: a
                buf.queued[0].after.wait()  # buffer is DIRTY only when idle, so a write never queues)

    def wait_op(self, op: _Op) -> None:
        """Block until ``op`` is finished and collected."""
        while not op.finished:
            op.wait()
            self.progress()

    # -- one operation -------------------------------------------------------------------------
    def _start(self, buf: Buffer, op: _Op) -> None:
        """Submit ``op`` to the engine, or finish it at once when its record's truth is in RAM."""
        file_index, offset, record = self._where(op.sg)
        f = self._files[file_index]
        op.memory, op.lane = buf.memory, buf.lane
        op.engine_crc = tio.checksums_beside_kernels()  # see [Note: checksums]
        if op.write:
            if not op.engine_crc:
                op.crc = tio.crc32c(buf.memory[: record.nbytes])  # before the write: what must read back
        else:
            fresh, kept, lost, op.crc = self._ledger.for_read(op.sg.index)
            if fresh or kept is not None or lost is not None:
                if fresh:
                    self._ledger.image(record, buf.memory)
                elif kept is not None:
                    buf.memory[: record.nbytes].copy_(kept)
                else:
                    op.error = lost
                op.finished = True
                return
        op.t0 = time.perf_counter()
        try:
            op.future = (f.pwrite if op.write else f.pread)(buf.memory, offset, record.nbytes,
                                                            checksum=op.engine_crc)
        except OSError as exc:  # refused before reaching the disk: as if it failed there
            self._collect(op, exc)

    def _collect(self, op: _Op, refused: OSError | None = None) -> None:
        """Book the outcome of ``op``'s completed request (see [Note: what a failed I/O leaves])."""
        op.finished = True
        file_index, offset, record = self._where(op.sg)
        f, ledger, key = self._files[file_index], self._ledger, op.sg.index
        if op.write:
            try:
                if refused is not None:
                    raise refused
                op.future.get()
            except OSError as exc:
                # The file's range now holds unknown bytes; the record's truth stays in RAM.
                ledger.write_failed(key, exc, op.memory[: record.nbytes], f.path, offset)
                return
            if op.engine_crc:
                op.crc = op.future.crc()  # of the bytes written: what the record must read back as
            ledger.wrote(key, op.crc)
            self._book(op, record.nbytes)
            return
        try:
            if refused is not None:
                raise refused
            size = f.size()
            if size < ledger.sizes[file_index]:
                raise tio.StateLostError(None, f"lies in {f.path!r}, which shrank to {size} bytes (it must hold "
                                         f"{ledger.sizes[file_index]}): another process truncated it",
                                         f.path, offset, key)
            got = op.future.get()
            if got != record.nbytes:
                raise tio.ShortReadError(f.path, offset, record.nbytes, got)
            crc = op.future.crc() if op.engine_crc else tio.crc32c(op.memory[: record.nbytes])
            if crc != op.crc:
                raise tio.StateLostError(None, f"read back from {f.path!r} at offset {offset} does not match the "
                                         f"CRC-32C taken when it was written (0x{crc:08x}, expected "
                                         f"0x{op.crc:08x}): the file was changed outside this optimizer",
                                         f.path, offset, key)
        except tio.StateLostError as exc:
            op.error = exc
        except OSError as exc:  # EIO, a short read
            op.error = tio.StateLostError(exc.errno, f"could not be read from {f.path!r} at offset {offset} "
                                          f"({exc})", f.path, offset, key)
            op.error.__cause__ = exc
        if op.error is not None:
            ledger.mark_lost(key, op.error)
            return
        self._book(op, record.nbytes)

    def _book(self, op: _Op, nbytes: int) -> None:
        tel = self._telemetry
        if tel is not None:
            tel.add_phase_time("nvme_write" if op.write else "nvme_read", time.perf_counter() - op.t0,
                               lane=op.lane, start=op.t0)
            tel.add_bytes("nvme", "write" if op.write else "read", nbytes)


__all__ = ["BufferState", "Buffer", "PINNED", "Pool", "TRANSITIONS"]
