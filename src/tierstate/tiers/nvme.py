"""NvmeTier: optimizer state in files, streamed through a fixed pool of aligned host buffers.

This module holds the cache policy. The record format and the stripes over files are in
:mod:`tierstate.tiers.nvme_records`; each buffer's lifecycle, its I/O on the engine's
futures and the checksums in :mod:`tierstate.tiers.nvme_pool`; [Note: what a failed I/O
leaves] in :mod:`tierstate.tiers.nvme_ledger`; the folders in :mod:`tierstate.tiers.rundir`.

[Note: the buffer pool is a write-back cache]
``Offload.buffer_count`` buffers, each the size of the largest record, are the tier's
whole host memory. They sit on transparent huge pages (:func:`tierstate.io.aligned_empty`):
over 4 KiB pages the block layer splits every direct request at the device's segment limit,
and this tier's reads ran 2.2x slower that way on the reference VM. A buffer holds one
sub-group's record; it is *acquired* while the step updates it and *dirty* once updated. A
dirty buffer is written back only when it is evicted to make room for a sub-group the
schedule needs (or on :meth:`NvmeTier.flush`): its write and the read of the newcomer are
queued on the buffer, write first, so they overlap the update of the sub-group acquired at
that moment. Victims are buffers holding nothing the rest of the schedule needs, clean
before dirty, least recently used first, so a sub-group is never evicted just before it
is used.

At the end of a step the last ``buffer_count`` sub-groups stay dirty in the pool, and
:meth:`NvmeTier.schedule` walks the next step in whichever direction (forward or
reversed) meets them first. Those sub-groups then cost no I/O at all in that step: per
step the tier moves ``S - buffer_count`` records each way instead of ``S``, and the pipeline
has no fill bubble (the step starts on data already in RAM). Because the files are
private to the run and removed at exit, a dirty buffer is as good as the file; every
read or write of state outside a step (:meth:`read_range`, :meth:`write_range`) goes
through the same pool, so it always sees the newest values.

[Note: a plan in a fixed order]
With ``step_in_backward=True`` (:mod:`tierstate.pipeline.backward`) the order of a
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

Weights streamed per block (:func:`tierstate.offload_weights`) change the shape of the
plan: a block's gradients complete all its records within that block's backward, a burst
of ``R`` records (48 for a Llama-2-7B layer at 4 Mi elements) that a 4-record window cannot
stay ahead of. With ``R`` given (``block_records``) the window is ``min(B // 2, R)`` and the
default pool ``16 + 2R`` (:meth:`tierstate.Offload.buffer_count_for`; without ``R`` it is
16 for fp32 state and more for compressed records, as many as fit in the RAM of 16 fp32
ones): one block's records are read while the previous block's are updated, and the rest
of the pool still caches the end of the plan. On the 7B capacity case (2-vCPU Xeon VM, one
virtio disk) the optimizer's waits for its records fell from 17-23 s a step to 9.5-11 s and the step from 62-65 s to 47-49 s.
"""
from __future__ import annotations

import logging
import weakref
from pathlib import Path
from typing import Mapping

import torch
from torch import Tensor

from .. import io as tio
from ..io.engine import say_once
from ..placement import Layout, Offload, SubGroup, TierKind
from .nvme_ledger import Ledger, kept_in_ram
from .nvme_pool import PINNED, Buffer, BufferState, Pool
from .nvme_records import ALIGN, InitialImage, RecordLayout, Stripes, align_up, nonzero_start
from .rundir import RunFolder, claim_folders, reserve_files


_log = logging.getLogger("tierstate")


def _warn_retried(errors: list[BaseException]) -> None:
    """Say that the disk failed writes whose records a later write then put on it: nothing is
    lost, but a failing disk must not go unnoticed (the first error names the path and errno)."""
    if errors:
        _log.warning("tierstate: %d NVMe write-back(s) failed (first: %s) and succeeded when retried",
                     len(errors), errors[0])


class _Resources:
    """What must be released even if the tier is never closed (held by the finalizer)."""

    def __init__(self) -> None:
        self.files: list = []
        self.folders: list[RunFolder] = []

    def release(self) -> None:
        for f in self.files:
            f.close()  # waits for its reads and writes in flight
        for folder in self.folders:
            folder.close()
        self.files, self.folders = [], []


class NvmeTier:
    """Optimizer state in files under ``offload.nvme_dirs``; host RAM bounded by the buffer pool.

    See the notes at the top of the file for the cache policy, :mod:`tierstate.tiers.nvme_pool`
    for the buffers' I/O, and :mod:`tierstate.tiers.rundir` for folders, locks and cleanup.

    Args:
        layout: the optimizer's layout; this tier holds its NVMe sub-groups.
        dtypes: state key -> dtype stored (``master`` is fp32; moments per ``moment_dtype``).
        inits: state key -> the value a fresh state starts from.
        offload: the policy (``nvme_dirs``, ``nvme_dir``, ``buffer_count``, ``pin_memory``).
        telemetry: where I/O time and bytes are booked (optional).
        units: state key -> elements per stored item, for keys stored per block (the scales
            of compressed state); ``read_range``/``write_range`` count those keys in items.
        block_records: the most records one block of streamed weights completes at once when
            the update runs during backward (0: none), which sizes the read-ahead window and
            the default pool (see [Note: a plan in a fixed order]).
        pin_memory: page-lock the pool (CUDA runs); default ``offload.pin_memory`` when
            CUDA is available.
    """

    kind = TierKind.NVME
    does_io = True  # acquire may wait on storage
    wait_phase = "nvme_wait"  # the telemetry phase those waits are booked under
    on_device = False  # the state lives in host RAM and files, not on the compute device
    host_views = False  # records move through the pool: no stable view to hand out

    def __init__(self, layout: Layout, dtypes: Mapping[str, torch.dtype], inits: Mapping[str, float],
                 offload: Offload, telemetry=None, pin_memory: bool | None = None,
                 units: Mapping[str, int] | None = None, block_records: int = 0) -> None:
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
        self._pool: list[Buffer] = []
        self._pinned_nbytes = 0
        self._ledger = Ledger()
        try:
            self._res.folders = claim_folders(tuple(Path(d) for d in offload.nvme_dirs), offload.nvme_dir is not None)
            self.folders = [f.path for f in self._res.folders]
            self._where = Stripes(self.subgroups, self.keys, self.dtypes, len(self.folders), units)
            self.record_nbytes = self._where.stride
            self._open_files()
            if pin_memory is None:
                pin_memory = offload.pin_memory and torch.cuda.is_available()
            self.pin_memory = bool(pin_memory)
            # more buffers than records would hold nothing; two keep one updating while one moves
            # the default pool holds 16 fp32 records' worth of RAM: more buffers of compressed records
            stored = {k: self.dtypes[k].itemsize / (units or {}).get(k, 1) for k in self.keys}
            pool_size = min(offload.buffer_count_for(block_records, stored), max(2, len(self.subgroups)))
            memories = [self._allocate(self.record_nbytes) for _ in range(pool_size)]
            self._io = Pool(memories, self._res.files, self._where, self._ledger, telemetry)
            self._pool = self._io.buffers
            self._write_initial_values(inits)
        except BaseException:
            self._finalizer()
            raise
        self._resident: dict[int, Buffer] = {}  # sub-group index -> the buffer holding it
        self._writes: dict[int, object] = {}  # sub-group index -> its latest write-back (nvme_pool's op)
        self._plan: list[SubGroup] = []
        self._plan_pos = 0
        self._evict_needed = False  # the plan lets read-ahead evict records it needs later
        # ... but only to fill this many plan positions ahead (see [Note: a plan in a fixed order])
        self._evict_window = max(1, min(len(self._pool) // 2, block_records) if block_records
                                 else min(4, len(self._pool) // 4))
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
            buf = tio.page_locked_empty(nbytes, ALIGN)
            if buf.data_ptr() % ALIGN == 0:
                self._pinned_nbytes += nbytes
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
            if not nonzero_start(value, self.dtypes[key]):
                continue  # all-zero bytes (not -0.0): fallocate'd space already reads so
            itemsize = torch.empty((), dtype=self.dtypes[key]).element_size()
            largest = self.record_nbytes // itemsize
            scratch[: largest * itemsize].view(self.dtypes[key]).fill_(value)
            futures = []
            for sg in self.subgroups:
                index, offset, rec = self._where(sg)
                start, nbytes = rec.regions[key]
                futures.append(self._res.files[index].pwrite(scratch, offset + start, align_up(nbytes)))
            for fut in futures:
                fut.get()
        self._ledger.image = InitialImage(self.keys, self.dtypes, inits)
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
    def pinned_nbytes(self) -> int:
        """Bytes of the pool that are page-locked (all of it with ``pin_memory``, else 0)."""
        return self._pinned_nbytes

    @property
    def spill_folder(self) -> Path:
        """Where state dicts backed by files go: ``state-dict`` in the first run folder."""
        return self.folders[0] / "state-dict"

    @property
    def direct(self) -> bool:
        """Whether every state file uses O_DIRECT (False on filesystems that refuse it, e.g. tmpfs)."""
        return all(f.direct for f in self._res.files)

    @property
    def files(self) -> list[Path]:
        return [Path(f.path) for f in self._res.files]

    # -- the pool ------------------------------------------------------------------------------
    def _views(self, buf: Buffer) -> dict[str, Tensor]:
        rec = self.record(buf.sg)
        out = {}
        for key in self.keys:
            start, nbytes = rec.regions[key]
            out[key] = buf.memory[start: start + nbytes].view(self.dtypes[key])
        return out

    def _victim(self, needed: set[int]) -> Buffer | None:
        """A buffer to reuse: not acquired, holding nothing in ``needed``; empty, then clean, then LRU."""
        best = None
        for buf in self._pool:
            if buf.state in PINNED or (buf.sg is not None and buf.sg.index in needed):
                continue
            rank = (buf.sg is not None, buf.state is BufferState.DIRTY, buf.last_use)
            if best is None or rank < best[0]:
                best = (rank, buf)
        return None if best is None else best[1]

    def _farthest(self, before: int) -> Buffer | None:
        """The unacquired buffer whose sub-group the plan needs last, if that is after plan position
        ``before`` (Belady's choice: see [Note: a plan in a fixed order])."""
        pos = {sg.index: i for i, sg in enumerate(self._plan) if i >= self._plan_pos}
        best = None
        for buf in self._pool:
            if buf.state in PINNED or buf.sg is None:
                continue
            at = pos.get(buf.sg.index)
            if at is not None and at > before and (best is None or at > best[0]):
                best = (at, buf)
        return None if best is None else best[1]

    def _load(self, buf: Buffer, sg: SubGroup) -> None:
        """Queue on ``buf``: write back what it holds (if dirty), then read ``sg``."""
        if buf.sg is not None:
            del self._resident[buf.sg.index]
        old = buf.sg
        write = self._io.load(buf, sg, after=self._writes.pop(sg.index, None))
        if write is not None:
            self._writes[old.index] = write
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

    def _hold(self, sg: SubGroup) -> Buffer:
        """The buffer holding ``sg``, loading it if needed, with its I/O finished."""
        buf = self._resident.get(sg.index)
        if buf is None:
            buf = self._victim(self._needed() - {sg.index}) or self._victim({sg.index})
            if buf is None:
                raise RuntimeError(f"no NVMe buffer free for sub-group {sg.index}: all "
                                   f"{len(self._pool)} are acquired (release one first)")
            self._load(buf, sg)
        self._io.wait(buf)
        if buf.state is BufferState.FAILED:  # the read left nothing usable in the buffer
            error = buf.error
            del self._resident[sg.index]
            self._io.empty(buf)
            raise error
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
        self._io.progress()
        self._read_ahead()
        return order

    def ready(self, sg: SubGroup) -> bool:
        """Whether :meth:`acquire` of ``sg`` would return without waiting for I/O."""
        self._io.progress()
        buf = self._resident.get(sg.index)
        return buf is not None and not buf.busy

    def acquire(self, sg: SubGroup) -> dict[str, Tensor]:
        """Flat views of every state key of ``sg`` in its buffer (waits for its read)."""
        plan = self._plan
        if self._plan_pos < len(plan) and plan[self._plan_pos].index == sg.index:
            self._plan_pos += 1
        else:  # off the plan: take it out so it is not read twice
            self._plan = plan[: self._plan_pos] + [s for s in plan[self._plan_pos:] if s.index != sg.index]
        buf = self._hold(sg)
        if buf.state is BufferState.CLEAN:
            buf.move(BufferState.ACQUIRED)
        elif buf.state is BufferState.DIRTY:
            buf.move(BufferState.ACQUIRED_DIRTY)
        self._read_ahead()
        return self._views(buf)

    def release(self, sg: SubGroup, dirty: bool) -> None:
        """Done with ``sg``: its buffer becomes evictable (written back when evicted)."""
        self._io.progress()
        buf = self._resident.get(sg.index)
        if buf is None or buf.state not in PINNED:
            raise RuntimeError(f"release of sub-group {sg.index}, which is not acquired")
        dirty = dirty or buf.state is BufferState.ACQUIRED_DIRTY
        buf.move(BufferState.DIRTY if dirty else BufferState.CLEAN)
        self._read_ahead()

    def drain(self) -> None:
        """Wait for every read and write in flight. Their failures stay where the next user
        of the record meets them (see [Note: what a failed I/O leaves]): a failed read is
        raised by whoever acquires that record, a failed write by :meth:`settle` and
        :meth:`take_write_errors`."""
        for buf in self._pool:
            self._io.wait(buf)
        for op in list(self._writes.values()):
            self._io.wait_op(op)
        self._writes.clear()

    def flush(self) -> None:
        """Write every dirty buffer and every record kept in RAM to its file, and wait.

        Raises the first write error (a :class:`~tierstate.io.FileIOError` naming the path
        and errno) when a record still cannot be written; it then stays in RAM, readable
        through the tier, and is tried again by the next :meth:`flush` or :meth:`settle`."""
        self._io.progress()
        for buf in self._pool:
            if buf.state is BufferState.DIRTY:
                self._writes[buf.sg.index] = self._io.flush(buf)
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
        self._io.progress()
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
            ledger.rewrote(index, data, crc)
        with ledger.lock:
            reported, ledger.write_errors = ledger.write_errors, []
            left = len(ledger.stranded)
        if first is not None:
            raise kept_in_ram(first, left)
        _warn_retried([exc for _, exc in reported])

    def lost_error(self) -> BaseException | None:
        """The :class:`~tierstate.io.StateLostError` of a record found lost, or ``None``."""
        self._io.progress()
        return self._ledger.lost_error()

    def take_write_errors(self) -> BaseException | None:
        """The first write-back failure since the last call (``None`` if none), ready to raise.

        Its record is kept in RAM; the error's message says how many are and that the next
        ``step()``, flush or save writes them again."""
        self._io.progress()
        errors, superseded, left = self._ledger.take_write_errors()
        _warn_retried(superseded)
        if not errors:
            return None
        first = errors[0] if isinstance(errors[0], tio.StateLostError) else kept_in_ram(errors[0], left)
        return tio.first_noting_others([first, *errors[1:]])

    def forget_state(self) -> None:
        """Forget every record's contents: each reads as its initial values from now on, built
        in RAM (no file is read or written) until it is written back.

        For a load that replaces every state (``load_state_dict``, ``load_optimizer``): the
        records it writes need not be read first, and a record found lost, changed on disk,
        or kept in RAM after a failed write stops mattering, so loading a checkpoint recovers
        from a :class:`~tierstate.io.StateLostError`."""
        self.drain()
        for buf in self._pool:
            if buf.sg is not None and buf.state not in PINNED:
                del self._resident[buf.sg.index]
                self._io.empty(buf)
        self._ledger.forget({sg.index for sg in self.subgroups})

    def read_range(self, key: str, sg: SubGroup, offset: int, numel: int) -> Tensor:
        """A copy of ``numel`` elements of ``key`` from ``offset`` inside ``sg``."""
        buf = self._hold(sg)
        return self._views(buf)[key][offset: offset + numel].clone()

    def write_range(self, key: str, sg: SubGroup, offset: int, values: Tensor) -> None:
        """Store ``values`` (converted to the key's dtype) at ``offset`` inside ``sg``."""
        buf = self._hold(sg)
        self._views(buf)[key][offset: offset + values.numel()].copy_(values)
        if buf.state is BufferState.CLEAN:
            buf.move(BufferState.DIRTY)
        elif buf.state is BufferState.ACQUIRED:
            buf.move(BufferState.ACQUIRED_DIRTY)

    def close(self) -> None:
        """Wait for the I/O in flight, remove the files and unlock the folders. Idempotent."""
        self._pool = self._io.buffers = []
        self._resident.clear()
        self._writes.clear()
        self._finalizer()

    def __repr__(self) -> str:
        return (f"NvmeTier({len(self.subgroups)} sub-groups, {self.nbytes / 2**30:.2f} GiB on disk in "
                f"{[str(f) for f in getattr(self, 'folders', [])]}, pool {len(self._pool)} x "
                f"{self.record_nbytes / 2**20:.1f} MiB)")



__all__ = ["ALIGN", "NvmeTier", "RecordLayout"]
