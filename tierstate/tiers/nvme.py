"""NvmeTier: optimizer state in files, streamed through a fixed pool of aligned host buffers.

[Note: records, files and stripes]
Each NVMe sub-group owns one *record* on disk holding all its state keys back to back,
``[master | exp_avg | exp_avg_sq]`` for AdamW with a master, each region starting on a
4 KiB boundary so that every region is a valid O_DIRECT target and a host view of it is
aligned for any dtype. A record moves in one request (the engine splits it into
block-size tasks), so one 16 Mi-element AdamW record is a 192 MiB sequential read and a
192 MiB sequential write per step. With several ``nvme_dir`` folders the sub-groups are
dealt round-robin, one file per folder: sub-group ``r`` of the tier goes to file
``r % len(dirs)`` at slot ``r // len(dirs)``, so consecutive sub-groups hit different
drives and the reads of k+1 and the writes of k-1 run on different disks.

[Note: the buffer pool is a write-back cache]
``Offload.buffer_count`` buffers, each the size of the largest record, are the tier's
whole host memory. They sit on transparent huge pages (:func:`tierstate.io.aligned_empty`):
over 4 KiB pages the block layer splits every direct request at the device's segment limit,
and this tier's reads ran 2.2x slower that way on the reference VM. A buffer holds one
sub-group's record; it is *pinned* while the step updates it and *dirty* once updated. A
dirty buffer is written back only when it is evicted to make room for a sub-group the
schedule needs (or on :meth:`NvmeTier.flush`):
its write and the read of the newcomer are queued on the buffer's own I/O thread, write
first, so they overlap the update of the sub-group pinned at that moment. Victims are
buffers holding nothing the rest of the schedule needs, clean before dirty, least
recently used first, so a sub-group is never evicted just before it is used.

At the end of a step the last ``buffer_count`` sub-groups stay dirty in the pool, and
:meth:`NvmeTier.schedule` walks the next step in whichever direction (forward or
reversed) meets them first. Those sub-groups then cost no I/O at all in that step: per
step the tier moves ``S - buffer_count`` records each way instead of ``S``, and the pipeline
has no fill bubble (the step starts on data already in RAM). Because the files are
private to the run and removed at exit, a dirty buffer is as good as the file; every
read or write of state outside a step (:meth:`read_range`, :meth:`write_range`) goes
through the same pool, so it always sees the newest values.

[Note: a plan in a fixed order]
With ``step_in_backward=True`` (:mod:`tierstate.optim.backward_update`) the order of a
step is not ours to choose: sub-groups come as backward finishes their gradients, and
the optimizer hands the tier that order (the previous step's) right after a step ends.
The pool then holds the previous step's last records, which this order needs last. To
start the next backward with its first records in RAM, read-ahead may evict by Belady's
rule (a record the plan needs later makes room for one it needs sooner), but only for
the next ``W = min(4, B // 4)`` positions of the plan: those writes run during forward,
and then the records updated during backward free their buffers for the rest. Evicting
for the whole plan would cycle every record through the disk each step (GPT-2 124M, 30
records, B = 16: 28 each way per step, against 14 for the plain step); with the window,
the middle of the plan stays cached and a step moves ``S - B + W`` records each way (18),
all of it during forward and backward.

[Note: ordering between I/O threads]
Every buffer has one I/O thread that runs its operations in order, so "write the old
record, then read the new one into the same memory" needs no further locking. Across
buffers one dependency remains: a sub-group evicted from buffer A (write queued on A)
and needed again soon in buffer B must not be read before A's write lands; the read
carries that write as a prerequisite. Writes never wait on anything, so the threads
cannot deadlock.

[Note: checksums]
The tier keeps, in RAM, the CRC-32C of every record as it was last written (4 bytes per
record; the initial values included) and checks every read against it, after checking
that the file is still as long as the records it holds (``fstat``): a record truncated
away, overwritten by another process (even with bytes that look valid), torn, or hit by
a bit flip raises :class:`~tierstate.io.StateLostError` at the read, and never reaches
an update. The CRC runs on the buffer's I/O thread without the GIL, in the variant chosen
at run time (:func:`tierstate.io.crc32c_isas`): on the reference VM (2 Zen 4 cores)
AVX-512 VPCLMULQDQ folding does 16-18 GB/s per core, the ``crc32`` instruction 11.
It reads every record moved once more from memory, which competes with the update
kernels: on the reference VM, ``tierstate bench step --offload nvme`` alternating with a
build without it, the step took +2 % at 400M parameters (1.03-1.12x the disk floor) and
+5 % at 100M (benchmarks/README.md has the runs).

[Note: what a failed I/O leaves]
A failed *write* loses nothing: the I/O thread copies the record's bytes out of the
buffer (which the read queued behind it may then reuse) into the ledger's ``stranded``
records, and every later read of that record takes them instead of the file, until a
write of it lands. The step therefore completes in memory; the optimizer raises the
write's error (path, errno) at the end of ``step()``. :meth:`NvmeTier.settle` writes the
stranded records again; the optimizer calls it before a step modifies anything, so
while they still cannot be written the step raises at once, leaving parameters and state
exactly as before it. ``state_dict()`` and ``save_optimizer`` read them from RAM. Each
stranded record costs one record of RAM beyond the pool.

A failed *read* (EIO, a short read, a shrunken file, a CRC mismatch) cannot be made
harmless: the bytes on disk were the only copy of that record, and the step may already
have updated other sub-groups when the read-ahead's failure surfaces (a step streams
state larger than RAM, so it cannot verify every record first). The record is marked
lost; its acquire, every later step (at :meth:`NvmeTier.settle`) and every read of it
raise :class:`~tierstate.io.StateLostError` until a checkpoint is loaded
(:meth:`NvmeTier.forget_state`: a load replaces every state, so every record then
starts from its initial values, built in RAM without reading the files). No error is
sticky beyond its cause: an I/O thread keeps no failure state.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import torch
from torch import Tensor

from .. import io as tio
from ..io.engine import say_once
from ..placement import Layout, Offload, SubGroup, TierKind
from .rundir import RunFolder, claim_folders, reserve_files


_log = logging.getLogger("tierstate")

# Every region of a record starts on this boundary: the O_DIRECT offset/length
# alignment of every Linux filesystem (statx DIOALIGN reports 512 or 4096 on NVMe).
ALIGN = 4096


def _align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


class RecordLayout:
    """Byte layout of one sub-group's record: ``{key: (offset, nbytes)}`` and its size.

    Pure arithmetic, shared by the buffers (views) and the files (offsets)."""

    def __init__(self, keys: list[str], dtypes: Mapping[str, torch.dtype], numel: int) -> None:
        self.numel = numel
        self.regions: dict[str, tuple[int, int]] = {}
        cursor = 0
        for key in keys:
            nbytes = numel * torch.empty((), dtype=dtypes[key]).element_size()
            self.regions[key] = (cursor, nbytes)
            cursor = _align_up(cursor + nbytes)
        self.nbytes = cursor


class _InitialImage:
    """Builds the bytes a fresh record holds (what :meth:`NvmeTier._write_initial_values` leaves
    in the file): zeros, and each key whose start value is not all-zero bytes filled with it
    over its region and the region's padding. Shared with the I/O threads."""

    def __init__(self, keys: list[str], dtypes: Mapping[str, torch.dtype], inits: Mapping[str, float]) -> None:
        self.fills = [(key, dtypes[key], inits.get(key, 0.0)) for key in keys
                      if torch.tensor(inits.get(key, 0.0), dtype=dtypes[key]).view(-1).view(torch.uint8).any()]

    def __call__(self, rec: RecordLayout, into: Tensor) -> Tensor:
        image = into[: rec.nbytes]
        image.zero_()
        for key, dtype, value in self.fills:
            start, nbytes = rec.regions[key]
            image[start: start + _align_up(nbytes)].view(dtype).fill_(value)
        return image


class _Stripes:
    """Where each sub-group's record lives: (file index, byte offset, layout); see the note on stripes.

    Shared by the tier and its I/O threads (which must not hold the tier itself, or the
    tier's finalizer could never run)."""

    def __init__(self, subgroups: list[SubGroup], keys: list[str], dtypes: Mapping[str, torch.dtype],
                 nfiles: int) -> None:
        self.keys, self.dtypes, self.nfiles = keys, dtypes, nfiles
        self._rank = {sg.index: r for r, sg in enumerate(subgroups)}
        self._records: dict[int, RecordLayout] = {}
        self.stride = RecordLayout(keys, dtypes, max(sg.numel for sg in subgroups)).nbytes

    def record(self, sg: SubGroup) -> RecordLayout:
        rec = self._records.get(sg.numel)
        if rec is None:
            rec = self._records[sg.numel] = RecordLayout(self.keys, self.dtypes, sg.numel)
        return rec

    def __call__(self, sg: SubGroup) -> tuple[int, int, RecordLayout]:
        rank = self._rank[sg.index]
        return rank % self.nfiles, (rank // self.nfiles) * self.stride, self.record(sg)


@dataclass
class _Op:
    """One read or write of a record, run by a buffer's I/O thread.

    ``error`` is set by a failed read only (a :class:`~tierstate.io.StateLostError`): a
    failed write keeps the record in RAM instead (see [Note: what a failed I/O leaves])."""

    write: bool
    sg: SubGroup
    buffer: Tensor
    after: "_Op | None" = None  # a write of the same record on another buffer, to land first
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None

    def wait(self) -> None:
        self.done.wait()
        if self.error is not None:
            raise self.error


@dataclass
class _Buffer:
    index: int
    memory: Tensor  # uint8, ALIGN-aligned, one record of the largest sub-group
    sg: SubGroup | None = None
    dirty: bool = False
    pinned: bool = False  # acquired: the step is updating it
    last_use: int = 0
    last_op: _Op | None = None


class _Ledger:
    """What the tier knows about its records beyond the files, shared with the I/O threads.

    ``crc``: sub-group index -> CRC-32C of the record as last written (initial values
    included); every read is checked against it. ``stranded``: records whose write-back
    failed, as a private copy of the newest bytes, which every read of that record takes
    instead of the file until a write of it lands. ``write_errors``: failed writes not
    yet reported to the caller. ``lost``: records that could not be read back as written.
    ``sizes``: the size each state file must have. ``fresh``, ``image``: see :meth:`NvmeTier.forget_state`."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.crc: dict[int, int] = {}
        self.stranded: dict[int, Tensor] = {}
        self.write_errors: list[tuple[int, BaseException]] = []  # (sub-group index, error)
        self.lost: dict[int, BaseException] = {}
        self.sizes: list[int] = []
        # records whose state was forgotten (a load follows): read as their initial values,
        # not from the file, until written
        self.fresh: set[int] = set()
        self.image: _InitialImage | None = None


class _IOThread:
    """Runs one buffer's reads and writes in order (see [Note: ordering between I/O threads])."""

    def __init__(self, index: int, files: list, where, ledger: _Ledger, telemetry) -> None:
        self.lane = f"nvme-io-{index}"
        self._files = files
        self._where = where  # SubGroup -> (file index, file offset, RecordLayout)
        self._ledger = ledger
        self._telemetry = telemetry
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=self.lane, daemon=True)
        self.thread.start()

    def submit(self, op: _Op) -> None:
        self._queue.put(op)

    def stop(self) -> None:
        self._queue.put(None)
        self.thread.join()

    def _run(self) -> None:
        while True:
            op = self._queue.get()
            if op is None:
                return
            try:
                if op.after is not None:
                    op.after.done.wait()  # a failed write left its bytes in the ledger: no error here
                if op.write:
                    self._write(op)
                else:
                    self._read(op)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                op.error = exc
            finally:
                op.done.set()

    def _write(self, op: _Op) -> None:
        file_index, offset, record = self._where(op.sg)
        f, ledger, key = self._files[file_index], self._ledger, op.sg.index
        data = op.buffer[: record.nbytes]
        crc = tio.crc32c(data)  # before the write: the bytes this record must read back as
        t0 = time.perf_counter()
        try:
            f.write(op.buffer, offset, record.nbytes)
        except OSError as exc:
            # The file's range now holds unknown bytes; the record's truth stays in RAM.
            # A copy frees the buffer for the read queued behind this write.
            try:
                copy = data.clone()
            except RuntimeError as mem:  # out of memory: the newest bytes have nowhere to go
                lost = tio.StateLostError(exc.errno, f"could not be written ({exc}) nor kept in RAM ({mem})",
                                          f.path, offset, key)
                with ledger.lock:
                    ledger.lost[key] = lost
                    ledger.write_errors.append((key, lost))
                return
            with ledger.lock:
                ledger.stranded[key] = copy
                ledger.write_errors.append((key, exc))
            return
        with ledger.lock:
            ledger.crc[key] = crc
            ledger.stranded.pop(key, None)
            ledger.lost.pop(key, None)
            ledger.fresh.discard(key)
        self._book(True, t0, record.nbytes)

    def _read(self, op: _Op) -> None:
        file_index, offset, record = self._where(op.sg)
        f, ledger, key = self._files[file_index], self._ledger, op.sg.index
        with ledger.lock:
            kept, lost, crc = ledger.stranded.get(key), ledger.lost.get(key), ledger.crc.get(key)
            fresh = key in ledger.fresh
        if fresh:
            ledger.image(record, op.buffer)
            return
        if kept is not None:
            op.buffer[: record.nbytes].copy_(kept)
            return
        if lost is not None:
            raise lost
        t0 = time.perf_counter()
        try:
            size = f.size()
            if size < ledger.sizes[file_index]:
                raise tio.StateLostError(None, f"lies in {f.path!r}, which shrank to {size} bytes (it must hold "
                                         f"{ledger.sizes[file_index]}): another process truncated it",
                                         f.path, offset, key)
            f.read_exact(op.buffer, offset, record.nbytes)
            got = tio.crc32c(op.buffer[: record.nbytes])
            if got != crc:
                raise tio.StateLostError(None, f"read back from {f.path!r} at offset {offset} does not match the "
                                         f"CRC-32C taken when it was written (0x{got:08x}, expected 0x{crc:08x}): "
                                         "the file was changed outside this optimizer", f.path, offset, key)
        except tio.StateLostError as exc:
            with ledger.lock:
                ledger.lost[key] = exc
            raise
        except OSError as exc:  # EIO, a short read
            lost = tio.StateLostError(exc.errno, f"could not be read from {f.path!r} at offset {offset} ({exc})",
                                      f.path, offset, key)
            with ledger.lock:
                ledger.lost[key] = lost
            raise lost from exc
        self._book(False, t0, record.nbytes)

    def _book(self, write: bool, t0: float, nbytes: int) -> None:
        tel = self._telemetry
        if tel is not None:
            tel.add_phase_time("nvme_write" if write else "nvme_read", time.perf_counter() - t0,
                               lane=self.lane, start=t0)
            tel.add_bytes("nvme", "write" if write else "read", nbytes)


class _Resources:
    """What must be released even if the tier is never closed (held by the finalizer)."""

    def __init__(self) -> None:
        self.threads: list[_IOThread] = []
        self.files: list = []
        self.folders: list[RunFolder] = []

    def release(self) -> None:
        for t in self.threads:
            t.stop()
        for f in self.files:
            f.close()
        for folder in self.folders:
            folder.close()
        self.threads, self.files, self.folders = [], [], []


class NvmeTier:
    """Optimizer state in files under ``offload.nvme_dirs``; host RAM bounded by the buffer pool.

    See the notes at the top of the file for the record format, the cache policy and the
    I/O threads, and :mod:`tierstate.tiers.rundir` for folders, locks and cleanup.

    Args:
        layout: the optimizer's layout; this tier holds its NVMe sub-groups.
        dtypes: state key -> dtype stored (``master`` is fp32; moments per ``moment_dtype``).
        inits: state key -> the value a fresh state starts from.
        offload: the policy (``nvme_dirs``, ``nvme_dir``, ``buffer_count``, ``pin_memory``).
        telemetry: where I/O time and bytes are booked (optional).
        pin_memory: page-lock the pool (CUDA runs); default ``offload.pin_memory`` when
            CUDA is available.
    """

    kind = TierKind.NVME
    does_io = True  # acquire may wait on the disk
    wait_phase = "nvme_wait"
    on_device = False
    host_views = False  # records move through the pool: no stable view to hand out

    @property
    def spill_folder(self):
        """Where a state dict too large for RAM is mapped from (unlinked files)."""
        return self.folders[0] / "state-dict"

    @property
    def pinned_nbytes(self) -> int:
        return self.pool_nbytes if self.pin_memory else 0

    def __init__(self, layout: Layout, dtypes: Mapping[str, torch.dtype], inits: Mapping[str, float],
                 offload: Offload, telemetry=None, pin_memory: bool | None = None) -> None:
        self.layout = layout
        self.subgroups = [sg for sg in layout.subgroups if sg.tier is TierKind.NVME]
        if not self.subgroups:
            raise ValueError("NvmeTier needs a layout with NVMe sub-groups (Offload(nvme=...) > 0)")
        self.dtypes = dict(dtypes)
        # master first: the record reads [master | moments...] as in the docs.
        order = list(self.dtypes)
        self.keys = sorted(order, key=lambda k: (k != "master", order.index(k)))
        self._telemetry = telemetry
        self._res = _Resources()
        self._finalizer = weakref.finalize(self, _Resources.release, self._res)
        self._pool: list[_Buffer] = []
        self._ledger = _Ledger()
        try:
            self._res.folders = claim_folders(tuple(Path(d) for d in offload.nvme_dirs), offload.nvme_dir is not None)
            self.folders = [f.path for f in self._res.folders]
            self._where = _Stripes(self.subgroups, self.keys, self.dtypes, len(self.folders))
            self.record_nbytes = self._where.stride
            self._open_files()
            if pin_memory is None:
                pin_memory = offload.pin_memory and torch.cuda.is_available()
            self.pin_memory = bool(pin_memory)
            # more buffers than records would hold nothing; two keep one updating while one moves
            pool_size = min(offload.buffer_count, max(2, len(self.subgroups)))
            self._pool = [_Buffer(i, self._allocate(self.record_nbytes)) for i in range(pool_size)]
            self._write_initial_values(inits)
            self._res.threads = [_IOThread(b.index, self._res.files, self._where, self._ledger, telemetry)
                                 for b in self._pool]
        except BaseException:
            self._finalizer()
            raise
        self._resident: dict[int, _Buffer] = {}  # sub-group index -> the buffer holding it
        self._writes: dict[int, _Op] = {}  # sub-group index -> its latest write-back in flight
        self._plan: list[SubGroup] = []
        self._plan_pos = 0
        self._evict_needed = False  # the plan lets read-ahead evict records it needs later
        # ... but only to fill this many plan positions ahead (see [Note: a plan in a fixed order])
        self._evict_window = max(1, min(4, len(self._pool) // 4))
        self._tick = 0

    # -- construction ------------------------------------------------------------------------
    def record(self, sg: SubGroup) -> RecordLayout:
        """The byte layout of ``sg``'s record."""
        return self._where.record(sg)

    def _open_files(self) -> None:
        nfiles = len(self._res.folders)
        sizes = [0] * nfiles
        for sg in self.subgroups:
            index, offset, rec = self._where(sg)
            sizes[index] = max(sizes[index], offset + rec.nbytes)
        # each created empty under a name of this run only: nothing on disk can lend us its contents
        paths = [folder.state_file(i) for i, folder in enumerate(self._res.folders)]
        # fallocate'd extents read back as zeros, which is every zero-init key's start value.
        reserve_files([(p, n) for p, n in zip(paths, sizes) if n > 0])
        self._ledger.sizes = sizes
        self._res.files = [tio.File(p, "r+", direct=True) for p in paths]

    def _allocate(self, nbytes: int) -> Tensor:
        if self.pin_memory:
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            if buf.data_ptr() % ALIGN == 0:
                return buf
        if tio.huge_page_size() == 0:
            say_once("thp", "tierstate: transparent huge pages are off (/sys/kernel/mm/transparent_hugepage/"
                     "enabled is 'never' or absent), so the NVMe buffer pool uses 4 KiB pages and every "
                     "direct request is split at the device's segment limit (~1 MiB on virtio-blk: reads "
                     "2.2x slower on the reference VM); 'madvise' is enough to let tierstate use them")
        return tio.aligned_empty(nbytes, ALIGN)

    def _write_initial_values(self, inits: Mapping[str, float]) -> None:
        """Write the start value of every key whose start is not 0 into each record (only those regions)."""
        scratch = self._pool[0].memory
        for key in self.keys:
            value = inits.get(key, 0.0)
            if not torch.tensor(value, dtype=self.dtypes[key]).view(-1).view(torch.uint8).any():
                continue  # all-zero bytes (not -0.0): fallocate'd space already reads so
            itemsize = torch.empty((), dtype=self.dtypes[key]).element_size()
            largest = self.record_nbytes // itemsize
            scratch[: largest * itemsize].view(self.dtypes[key]).fill_(value)
            futures = []
            for sg in self.subgroups:
                index, offset, rec = self._where(sg)
                start, nbytes = rec.regions[key]
                futures.append(self._res.files[index].pwrite(scratch, offset + start, _align_up(nbytes)))
            for fut in futures:
                fut.get()
        self._ledger.image = _InitialImage(self.keys, self.dtypes, inits)
        crcs = {}
        for sg in self.subgroups:
            rec = self.record(sg)
            if rec.numel not in crcs:
                crcs[rec.numel] = tio.crc32c(self._ledger.image(rec, scratch))
            self._ledger.crc[sg.index] = crcs[rec.numel]

    # -- properties ----------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes of state on disk (records incl. alignment padding)."""
        return sum(self.record(sg).nbytes for sg in self.subgroups)

    @property
    def pool_nbytes(self) -> int:
        """Host RAM held by the tier: the buffer pool."""
        return len(self._pool) * self.record_nbytes

    @property
    def direct(self) -> bool:
        """Whether every state file uses O_DIRECT (False on filesystems that refuse it, e.g. tmpfs)."""
        return all(f.direct for f in self._res.files)

    @property
    def files(self) -> list[Path]:
        return [Path(f.path) for f in self._res.files]

    # -- the pool ------------------------------------------------------------------------------
    def _views(self, buf: _Buffer) -> dict[str, Tensor]:
        rec = self.record(buf.sg)
        out = {}
        for key in self.keys:
            start, nbytes = rec.regions[key]
            out[key] = buf.memory[start: start + nbytes].view(self.dtypes[key])
        return out

    def _victim(self, needed: set[int]) -> _Buffer | None:
        """A buffer to reuse: not pinned, holding nothing in ``needed``; empty, then clean, then LRU."""
        best = None
        for buf in self._pool:
            if buf.pinned or (buf.sg is not None and buf.sg.index in needed):
                continue
            rank = (buf.sg is not None, buf.dirty, buf.last_use)
            if best is None or rank < best[0]:
                best = (rank, buf)
        return None if best is None else best[1]

    def _farthest(self, before: int) -> _Buffer | None:
        """The unpinned buffer whose sub-group the plan needs last, if that is after plan position
        ``before`` (Belady's choice: see [Note: a plan in a fixed order])."""
        pos = {sg.index: i for i, sg in enumerate(self._plan) if i >= self._plan_pos}
        best = None
        for buf in self._pool:
            if buf.pinned or buf.sg is None:
                continue
            at = pos.get(buf.sg.index)
            if at is not None and at > before and (best is None or at > best[0]):
                best = (at, buf)
        return None if best is None else best[1]

    def _submit(self, buf: _Buffer, op: _Op) -> None:
        buf.last_op = op
        self._res.threads[buf.index].submit(op)

    def _load(self, buf: _Buffer, sg: SubGroup) -> None:
        """Queue on ``buf``: write back what it holds (if dirty), then read ``sg``."""
        if buf.sg is not None:
            del self._resident[buf.sg.index]
            if buf.dirty:
                write = _Op(True, buf.sg, buf.memory)
                self._writes[buf.sg.index] = write
                self._submit(buf, write)
        self._submit(buf, _Op(False, sg, buf.memory, after=self._writes.pop(sg.index, None)))
        buf.sg, buf.dirty = sg, False
        self._resident[sg.index] = buf

    def _needed(self) -> set[int]:
        return {sg.index for sg in self._plan[self._plan_pos:]}

    def _read_ahead(self) -> None:
        needed = self._needed()
        for at in range(self._plan_pos, len(self._plan)):
            sg = self._plan[at]
            if sg.index in self._resident:
                continue
            buf = self._victim(needed)
            if buf is None and self._evict_needed and at - self._plan_pos < self._evict_window:
                buf = self._farthest(at)
            if buf is None:
                return
            self._load(buf, sg)

    def _hold(self, sg: SubGroup) -> _Buffer:
        """The buffer holding ``sg``, loading it if needed, with its I/O finished."""
        buf = self._resident.get(sg.index)
        if buf is None:
            buf = self._victim(self._needed() - {sg.index}) or self._victim({sg.index})
            if buf is None:
                raise RuntimeError(f"no NVMe buffer free for sub-group {sg.index}: all "
                                   f"{len(self._pool)} are acquired (release one first)")
            self._load(buf, sg)
        op = buf.last_op
        if op is not None:
            op.done.wait()
            if op.error is not None:  # the read left nothing usable in the buffer
                del self._resident[sg.index]
                buf.sg, buf.dirty, buf.last_op = None, False, None
                raise op.error
        self._tick += 1
        buf.last_use = self._tick
        return buf

    # -- the tier interface --------------------------------------------------------------------
    def schedule(self, subgroups: list[SubGroup], keep_order: bool = False) -> list[SubGroup]:
        """Plan the step: forward or reversed, whichever meets the resident sub-groups first.

        With ``keep_order`` the order is the caller's (the order gradients become final
        in during backward) and read-ahead may evict records the plan needs later for ones
        it needs sooner (see [Note: a plan in a fixed order]).

        Returns the order in which the sub-groups will be acquired and starts reading
        ahead into the buffers the plan lets it reuse."""
        order = list(subgroups)
        if not keep_order:
            window = len(self._pool)
            ahead = sum(sg.index in self._resident for sg in order[:window])
            behind = sum(sg.index in self._resident for sg in order[-window:])
            if behind > ahead:
                order.reverse()
        self._plan, self._plan_pos, self._evict_needed = order, 0, keep_order
        self._read_ahead()
        return order

    def ready(self, sg: SubGroup) -> bool:
        """Whether :meth:`acquire` of ``sg`` would return without waiting for I/O."""
        buf = self._resident.get(sg.index)
        return buf is not None and (buf.last_op is None or buf.last_op.done.is_set())

    def acquire(self, sg: SubGroup) -> dict[str, Tensor]:
        """Flat views of every state key of ``sg`` in its buffer (waits for its read)."""
        plan = self._plan
        if self._plan_pos < len(plan) and plan[self._plan_pos].index == sg.index:
            self._plan_pos += 1
        else:  # off the plan: take it out so it is not read twice
            self._plan = plan[: self._plan_pos] + [s for s in plan[self._plan_pos:] if s.index != sg.index]
        buf = self._hold(sg)
        buf.pinned = True
        self._read_ahead()
        return self._views(buf)

    def release(self, sg: SubGroup, dirty: bool) -> None:
        """Done with ``sg``: its buffer becomes evictable (written back when evicted)."""
        buf = self._resident.get(sg.index)
        if buf is None or not buf.pinned:
            raise RuntimeError(f"release of sub-group {sg.index}, which is not acquired")
        buf.pinned = False
        buf.dirty = buf.dirty or dirty
        self._read_ahead()

    def drain(self) -> None:
        """Wait for every read and write in flight. Their failures stay where the next user
        of the record meets them (see [Note: what a failed I/O leaves]): a failed read is
        raised by whoever acquires that record, a failed write by :meth:`settle` and
        :meth:`take_write_errors`."""
        for buf in self._pool:
            if buf.last_op is not None:
                buf.last_op.done.wait()
        for op in list(self._writes.values()):
            op.done.wait()
        self._writes.clear()

    def flush(self) -> None:
        """Write every dirty buffer and every record kept in RAM to its file, and wait.

        Raises the first write error (a :class:`~tierstate.io.FileIOError` naming the path
        and errno) when a record still cannot be written; it then stays in RAM, readable
        through the tier, and is tried again by the next :meth:`flush` or :meth:`settle`."""
        for buf in self._pool:
            if buf.sg is not None and buf.dirty and not buf.pinned:
                op = _Op(True, buf.sg, buf.memory)
                self._writes[buf.sg.index] = op
                self._submit(buf, op)
                buf.dirty = False
        self.drain()
        self.settle()

    def settle(self) -> None:
        """Make the files hold every record the tier does not keep in its pool, or raise.

        Waits for the I/O in flight, then writes again each record whose write-back failed
        (kept in RAM since). Raises, without changing any state: :class:`~tierstate.io.StateLostError`
        if a record could not be read back as written (load the last checkpoint), or the
        write's own error (e.g. :class:`~tierstate.io.DiskFullError`) if a kept record
        still cannot be written. The optimizer calls this before a step modifies anything."""
        ledger = self._ledger
        with ledger.lock:
            busy = bool(ledger.stranded or ledger.lost)
        if busy:  # no waiting otherwise: the step starts on the read-ahead in flight
            self.drain()
        lost = self.lost_error()
        with ledger.lock:
            stranded = list(ledger.stranded.items())
        if lost is not None:
            raise lost
        first = None
        by_index = {sg.index: sg for sg in self.subgroups}
        for index, data in stranded:
            file_index, offset, rec = self._where(by_index[index])
            f = self._res.files[file_index]
            crc = tio.crc32c(data)
            try:
                f.write(data, offset, rec.nbytes)
            except OSError as exc:
                first = first or exc
                continue
            with ledger.lock:
                if ledger.stranded.get(index) is data:
                    del ledger.stranded[index]
                    ledger.crc[index] = crc
        with ledger.lock:
            reported, ledger.write_errors = ledger.write_errors, []
            left = len(ledger.stranded)
        if first is not None:
            raise _kept_in_ram(first, left)
        if reported:
            _log.warning("tierstate: %d NVMe write-back(s) failed (first: %s) and succeeded when retried",
                         len(reported), reported[0][1])

    def lost_error(self) -> BaseException | None:
        """The :class:`~tierstate.io.StateLostError` of a record found lost, or ``None``."""
        with self._ledger.lock:
            return next(iter(self._ledger.lost.values()), None)

    def take_write_errors(self) -> BaseException | None:
        """The first write-back failure since the last call (``None`` if none), ready to raise.

        Its record is kept in RAM; the error's message says how many are and that the next
        ``step()``, flush or save writes them again."""
        ledger = self._ledger
        with ledger.lock:
            errors, ledger.write_errors = ledger.write_errors, []
            # a later write of the same record may have landed since: nothing to report then
            errors = [exc for index, exc in errors if index in ledger.stranded or index in ledger.lost]
            left = len(ledger.stranded)
        if not errors:
            return None
        first = errors[0]
        return first if isinstance(first, tio.StateLostError) else _kept_in_ram(first, left)

    def forget_state(self) -> None:
        """Forget every record's contents: each reads as its initial values from now on, built
        in RAM (no file is read or written) until it is written back.

        For a load that replaces every state (``load_state_dict``, ``load_optimizer``): the
        records it writes need not be read first, and a record found lost, changed on disk,
        or kept in RAM after a failed write stops mattering, so loading a checkpoint recovers
        from a :class:`~tierstate.io.StateLostError`."""
        self.drain()
        for buf in self._pool:
            if buf.sg is not None and not buf.pinned:
                del self._resident[buf.sg.index]
                buf.sg, buf.dirty, buf.last_op = None, False, None
        with self._ledger.lock:
            self._ledger.lost.clear()
            self._ledger.stranded.clear()
            self._ledger.write_errors.clear()
            self._ledger.fresh = {sg.index for sg in self.subgroups}

    def read_range(self, key: str, sg: SubGroup, offset: int, numel: int) -> Tensor:
        """A copy of ``numel`` elements of ``key`` from ``offset`` inside ``sg``."""
        buf = self._hold(sg)
        return self._views(buf)[key][offset: offset + numel].clone()

    def write_range(self, key: str, sg: SubGroup, offset: int, values: Tensor) -> None:
        """Store ``values`` (converted to the key's dtype) at ``offset`` inside ``sg``."""
        buf = self._hold(sg)
        self._views(buf)[key][offset: offset + values.numel()].copy_(values)
        buf.dirty = True

    def close(self) -> None:
        """Stop the I/O threads, remove the files and unlock the folders. Idempotent."""
        self._pool = []
        self._resident.clear()
        self._finalizer()

    def __repr__(self) -> str:
        return (f"NvmeTier({len(self.subgroups)} sub-groups, {self.nbytes / 2**30:.2f} GiB on disk in "
                f"{[str(f) for f in getattr(self, 'folders', [])]}, pool {len(self._pool)} x "
                f"{self.record_nbytes / 2**20:.1f} MiB)")


def _kept_in_ram(exc: OSError, kept: int) -> OSError:
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


__all__ = ["NvmeTier", "RecordLayout"]
