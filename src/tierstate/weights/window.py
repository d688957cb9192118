"""The window: which blocks are materialized on the compute device, which have a host image,
and the reads and write-backs between the homes and the images.

A block moves through three places:

    home (host RAM or an NVMe record)  ->  host image  ->  its storage on the compute device
                                           (the home itself for a host home; a pool
                                            buffer for an NVMe home)

``materialize`` gives the block's storage its bytes: on CUDA it allocates them and copies the
image up on a side stream; on the CPU the storage *is* the image (see [Note: the image as the
CPU storage]). ``release`` takes them away again. The optimizer updates a block's *image*
(:meth:`Window.image_for_update`), never a device copy: the image is where the host kernels
run, and a materialized CUDA block is refreshed from it. An NVMe image the optimizer changed
is *dirty* and is written back before its buffer serves another block.

[Note: the image as the CPU storage]
On the CPU, materializing a block points its storage at the image's bytes (the storage
swaps its data pointer with a non-owning one, ``UntypedStorage._swap_data_ptr_``) and
releasing swaps it back. Allocating and copying instead cost far more than the copy: a
fresh 808 MiB allocation (one Llama-7B layer in fp32) is mapped by the kernel and faulted in
page by page as the copy first touches it, 0.6-1.1 s against 0.2 s for the same copy into
touched memory, plus 0.12-0.17 s to unmap it at release, twice per layer and step (2-core
Zen 4 VM). Huge pages (``MADV_HUGEPAGE``) cut the faults but stalled 5-10 s in compaction
on some allocations. So a materialized image is never a victim, the NVMe pool has one buffer
more on the CPU (the block in use is now one of them), and a parameter changed in place
while materialized marks its image dirty (its version counter moved), so nothing written
there is lost.

[Note: the pool of images]
An NVMe home lends images from a pool of ``prefetch + 2`` buffers of the largest record:
the block in use, the one whose write-back may still be in flight, and ``prefetch`` read
ahead. The buffer to reuse is the least recently used image that nothing holds and that is
not among the blocks expected next; a dirty one is written first. When every buffer is
held (the optimizer may hold the images of all blocks one of its sub-groups spans) the pool
grows by one buffer and says so once: a stall is better than a deadlock, and
``stats()["pool_grown"]`` shows it.
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch
from torch import Tensor

from .. import io as tio
from .blocks import Block, byte_view
from .homes import RECORD_ALIGN

_log = logging.getLogger("tierstate")
# the two private storage calls the CPU aliasing needs (present in torch 2.13); without them
# the CPU path allocates and copies as CUDA does
_CAN_ALIAS = hasattr(torch.UntypedStorage, "_swap_data_ptr_") and hasattr(torch._C, "_construct_storage_from_data_pointer")


@dataclass
class Counters:
    """What the window did, for ``WeightStreamer.stats()``."""

    fetch_bytes: int = 0  # read from NVMe homes
    fetch_seconds: float = 0.0  # from each read's submission to its completion being seen
    writeback_bytes: int = 0  # written to NVMe homes (changed images, and the initial fill)
    copy_bytes: int = 0  # image -> compute storage
    prefetch_hits: int = 0  # a needed NVMe block had been read (or was being read) ahead
    prefetch_misses: int = 0  # ... had to be read when needed
    stall_seconds: float = 0.0  # compute waiting on a read, a write-back or an upload
    materializations: int = 0
    peak_materialized_bytes: int = 0
    pool_grown: int = 0


@dataclass(eq=False)
class _State:
    image: Tensor | None = None
    fetch: object | None = None  # the read in flight into image
    fetch_started: float = 0.0
    write: object | None = None  # the write-back in flight from image
    dirty: bool = False  # the image holds bytes its NVMe home does not
    image_holds: int = 0  # optimizer updates using the image
    holds: int = 0  # forward passes running the block
    backward_holds: int = 0  # backward passes that may still need the block
    materialized: bool = False
    stale: bool = False  # materialized, and the image changed since the copy up
    upload: object | None = None  # CUDA: the event after the image -> device copy
    lent: object | None = None  # CPU: the storage holding the block's empty pointer while it aliases the image
    versions: list = field(default_factory=list)  # CPU: the parameters' version counters at materialize
    last_use: int = 0
    extra: list = field(default_factory=list)


class Window:
    """Materialize and release blocks; lend images to the optimizer. Not thread-safe: the
    streamer calls it from the thread that runs forward, backward and the optimizer step."""

    def __init__(self, blocks: Sequence[Block], homes: Sequence, device: torch.device, prefetch: int) -> None:
        self.blocks = list(blocks)
        self.homes = list(homes)  # per block
        self.device = device
        self.cuda = device.type == "cuda"
        # [Note: the image as the CPU storage]
        self.alias = not self.cuda and _CAN_ALIAS
        self.state = [_State() for _ in self.blocks]
        self.counters = Counters()
        self._tick = 0
        self._materialized_bytes = 0
        nvme = [b.index for b in self.blocks if self.homes[b.index].does_io]
        self._image_nbytes = max((self.homes[b].record_nbytes[b] for b in nvme), default=0)
        self._free: list[Tensor] = []
        self.pool_nbytes = 0
        self._buffers = 0
        if nvme:
            for _ in range(min(prefetch + 2 + self.alias, len(nvme))):
                self._free.append(self._new_buffer())
        self._base_buffers = self._buffers  # beyond these, a released clean image is freed
        # > 0 while the optimizer updates images (tierstate.pipeline.weights): a write-back that
        # fails then leaves its image kept, dirty, and the update goes on (see _take_buffer)
        self.defer_write_errors = 0
        self._deferred: list[BaseException] = []
        self.quiet_growth = 0  # > 0 while the user asked for many blocks at once (gathered())
        self._stream = torch.cuda.Stream(device) if self.cuda else None
        # (phase, seconds, start) -> None: the streamer books waits and reads in the telemetry of
        # the optimizers that update these weights (see WeightStreamer.attach_telemetry)
        self.report = lambda phase, seconds, start: None
        # block -> whether the optimizer has an update still to apply to it (a parameter holds a
        # gradient): set by the streamer, which knows the parameters
        self.pending = lambda b: False

    # -- buffers -------------------------------------------------------------------------------
    def _new_buffer(self) -> Tensor:
        self._buffers += 1
        if self.cuda:
            buf = tio.page_locked_empty(self._image_nbytes, RECORD_ALIGN)
            if buf.data_ptr() % RECORD_ALIGN == 0:
                self.pool_nbytes += self._image_nbytes
                return buf
        self.pool_nbytes += self._image_nbytes
        return tio.aligned_empty(self._image_nbytes, RECORD_ALIGN)

    def _take_buffer(self, avoid: set[int]) -> Tensor:
        if self._free:
            return self._free.pop()
        victim = self._victim(avoid) or self._victim(set())
        if victim is None:
            if not self.counters.pool_grown and not self.quiet_growth:
                _log.warning("tierstate: every weight image is in use; the pool of %d buffers grows by one "
                             "(%.1f MiB): raise prefetch or make sub-groups smaller to avoid it",
                             self.pool_nbytes // max(self._image_nbytes, 1), self._image_nbytes / 2**20)
            self.counters.pool_grown += 1
            return self._new_buffer()
        try:
            return self._evict(victim)
        except OSError as exc:
            # While the optimizer updates, stopping here would leave a step half applied (found
            # 2026-12-07). The victim keeps its image, dirty (nothing is lost; its write is
            # tried again when it is next evicted), the update goes on in a new buffer, and the
            # error is raised at the end of step(), as the NVMe state tier does. At most the
            # pool's own size is kept so: beyond it, the error is raised at once.
            if not self.defer_write_errors or len(self._deferred) >= self._base_buffers:
                raise
            self._deferred.append(exc)
            return self._new_buffer()

    def _victim(self, avoid: set[int], clean_only: bool = False) -> int | None:
        """The image to reuse: one nothing holds or reads into, outside ``avoid``; a clean one
        (its bytes on disk, no write in flight) before a changed one, one no update is pending
        for before one the optimizer has still to change (else it is read again for that
        update, and written twice), then the least recently used."""
        best, best_key = None, None
        for b, st in enumerate(self.state):
            if st.image is None or st.fetch is not None or st.image_holds or b in avoid:
                continue
            if st.materialized and self.alias:
                continue  # it is the block's storage
            if not self.homes[b].does_io:
                continue
            if st.materialized and self.cuda and st.upload is not None and not st.upload.query():
                continue
            busy = st.dirty or (st.write is not None and not st.write.done())
            if clean_only and busy:
                continue
            key = (busy, self.pending(b), st.last_use)
            if best_key is None or key < best_key:
                best, best_key = b, key
        return best

    def _evict(self, b: int) -> Tensor:
        st = self.state[b]
        if st.dirty:
            self._write_back(b)
        self._finish_write(b)
        buf, st.image = st.image, None
        return buf

    def _write_back(self, b: int) -> None:
        st = self.state[b]
        self._finish_write(b)
        home = self.homes[b]
        st.write = home.write(b, st.image)
        st.dirty = False
        self.counters.writeback_bytes += home.record_nbytes[b]

    def _finish_write(self, b: int) -> None:
        st = self.state[b]
        if st.write is not None:
            write, st.write = st.write, None
            t0 = time.perf_counter()
            try:
                write.get()
            except BaseException:
                st.dirty = True  # the bytes are still in the image: nothing is lost, the next eviction retries
                raise
            finally:
                waited = time.perf_counter() - t0
                self.counters.stall_seconds += waited
                self.report("weight_wait", waited, t0)

    # -- images --------------------------------------------------------------------------------
    def prefetch(self, b: int, upcoming: set[int]) -> None:
        """Start reading block ``b``'s image if it has none (NVMe homes only); never evicts a
        block in ``upcoming`` or a held one, and never waits."""
        st, home = self.state[b], self.homes[b]
        if not home.does_io or st.image is not None:
            return
        if self._free:
            buf = self._free.pop()
        else:
            victim = self._victim(upcoming | {b}, clean_only=True)
            if victim is None:  # a read ahead never waits on a write-back: start one for later
                changed = self._victim(upcoming | {b})
                if changed is not None and self.state[changed].dirty:
                    self._write_back(changed)
                return
            buf = self._evict(victim)
        st.image = buf
        st.fetch = home.read(b, buf)
        st.fetch_started = time.perf_counter()

    def stage(self, b: int, upcoming: set[int] = frozenset(), count: bool = False) -> Tensor:
        """Block ``b``'s image, read now if no read ahead brought it; ``count``: a use by the
        compute (counted as a prefetch hit or miss), not the optimizer's."""
        st, home = self.state[b], self.homes[b]
        self._tick += 1
        st.last_use = self._tick
        if not home.does_io:
            if st.image is None:
                st.image = home.image(b)
            return st.image
        if st.image is not None and st.fetch is None:
            self.counters.prefetch_hits += count
            return st.image
        if st.fetch is None:
            self.counters.prefetch_misses += count
            st.image = self._take_buffer(upcoming | {b})
            st.fetch = home.read(b, st.image)
            st.fetch_started = time.perf_counter()
        else:
            self.counters.prefetch_hits += count
        t0 = time.perf_counter()
        fetch, st.fetch = st.fetch, None
        try:
            fetch.get()
            home.verify(b, st.image)
        except BaseException:
            self._free.append(st.image)
            st.image = None
            raise
        finally:
            now = time.perf_counter()
            self.counters.stall_seconds += now - t0
            self.counters.fetch_seconds += now - st.fetch_started
            self.report("weight_wait", now - t0, t0)
            self.report("weight_fetch", now - st.fetch_started, st.fetch_started)
        self.counters.fetch_bytes += home.record_nbytes[b]
        return st.image

    @contextlib.contextmanager
    def image_for_update(self, b: int, refresh: bool = False) -> Iterator[Tensor]:
        """Lend block ``b``'s image to the optimizer, which may change it: afterwards it is
        dirty (NVMe), and a materialized block is *stale*: its next use copies it up again
        (``refresh``: now). Not at once, because the optimizer updates a block piece by piece
        while backward still holds it (its gradients are final, so autograd no longer reads
        the updated parameters): copying the whole block after every piece moved 60 GB a step
        for a 1B model whose layers span 13-17 sub-groups each."""
        st = self.state[b]
        image = self.stage(b)
        if st.upload is not None:  # CUDA: the copy up still reads the image
            st.upload.synchronize()
            st.upload = None
        try:
            self._finish_write(b)  # a write-back in flight still reads it too
        except OSError as exc:  # the image is still dirty: written again later (see _take_buffer)
            if not self.defer_write_errors:
                raise
            self._deferred.append(exc)
        st.image_holds += 1
        try:
            yield image
        finally:
            st.image_holds -= 1
            st.dirty = st.dirty or self.homes[b].does_io
            if st.materialized and not self.alias:
                st.stale = True
                if refresh:
                    self._refresh(b)

    def take_write_errors(self) -> BaseException | None:
        """The first write-back failure deferred while the optimizer updated, the others as its
        notes (None if none); forgets them."""
        errors, self._deferred = self._deferred, []
        return tio.first_noting_others(errors)

    @contextlib.contextmanager
    def image_for_reading(self, b: int) -> Iterator[Tensor]:
        st = self.state[b]
        image = self.stage(b)
        st.image_holds += 1
        try:
            yield image
        finally:
            st.image_holds -= 1

    def fill_home(self, b: int, src: Tensor) -> None:
        """Write a block's first bytes (``src``, uint8) to its home, before any use."""
        home = self.homes[b]
        n = src.numel()
        if not home.does_io:
            home.image(b)[:n].copy_(src)
            return
        buf = self._take_buffer({b})
        try:
            buf[:n].copy_(src)
            buf[n:home.record_nbytes[b]].zero_()  # the padding is part of the checksummed record
            home.write(b, buf).get()
            self.counters.writeback_bytes += home.record_nbytes[b]
        finally:
            self._free.append(buf)

    # -- compute storage -----------------------------------------------------------------------
    def materialize(self, b: int, upcoming: set[int] = frozenset()) -> None:
        st = self.state[b]
        self._tick += 1
        st.last_use = self._tick
        if st.materialized:
            if st.stale:
                self._refresh(b)
            return
        image = self.stage(b, upcoming, count=True)
        block = self.blocks[b]
        st.materialized = True
        self._materialized_bytes += block.nbytes
        self.counters.materializations += 1
        self.counters.peak_materialized_bytes = max(self.counters.peak_materialized_bytes, self._materialized_bytes)
        if self.alias:
            lent = torch._C._construct_storage_from_data_pointer(image.data_ptr(), self.device, block.nbytes)
            block.storage._swap_data_ptr_(lent)  # lent now holds the empty pointer, until release
            st.lent = lent
            st.versions = [p._version for p in block.params]
            return
        block.storage.resize_(block.nbytes)
        self._copy_up(b, image)

    def _unalias(self, b: int) -> None:
        st, block = self.state[b], self.blocks[b]
        block.storage._swap_data_ptr_(st.lent)
        st.lent = None
        if any(p._version != v for p, v in zip(block.params, st.versions)) and self.homes[b].does_io:
            st.dirty = True  # written in place while it was the parameters' storage
        st.versions = []

    def _refresh(self, b: int) -> None:
        """Copy a materialized block's changed image up again."""
        self._copy_up(b, self.stage(b))

    def _copy_up(self, b: int, image: Tensor) -> None:
        self.state[b].stale = False
        block = self.blocks[b]
        dst = byte_view(block.storage, block.nbytes)
        self.counters.copy_bytes += block.nbytes
        if not self.cuda:
            dst.copy_(image[:block.nbytes])
            return
        compute = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(compute)  # the storage was just allocated on the compute stream
        with torch.cuda.stream(self._stream):
            dst.copy_(image[:block.nbytes], non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        compute.wait_event(event)
        self.state[b].upload = event

    def release(self, b: int) -> None:
        """Free block ``b``'s compute storage if no forward or backward holds it."""
        st = self.state[b]
        if not st.materialized or st.holds or st.backward_holds:
            return
        block = self.blocks[b]
        if st.lent is not None:
            self._unalias(b)
        else:
            block.storage.resize_(0)
        st.materialized = False
        self._materialized_bytes -= block.nbytes
        if st.dirty and not st.image_holds and st.write is None and not self.pending(b):
            # write-behind: the block's updates are in (none pending), so its buffer can be
            # clean by the time a read-ahead wants it; with updates still to come it would be
            # written twice (a 1B Llama wrote 1.7x its weights a step that way)
            self._write_back(b)
        if self._buffers > self._base_buffers and self.homes[b].does_io and st.image is not None \
                and not st.image_holds and st.fetch is None:
            self._shrink(b)

    def write_behind(self) -> None:
        """Start writing back every changed image that nothing uses and no update is pending
        for (the optimizer applied its gradients after the block was released), so its buffer
        is clean when a read-ahead needs one; never waits."""
        for b, st in enumerate(self.state):
            if st.dirty and st.image is not None and st.write is None and not st.materialized \
                    and not st.image_holds and st.fetch is None and not self.pending(b):
                self._write_back(b)

    def _shrink(self, b: int) -> None:
        """Give a grown pool's buffer back to the allocator (after gathered() of many blocks,
        or a burst the pool could not hold): written first if it changed."""
        st = self.state[b]
        if st.dirty:
            self._write_back(b)
        self._finish_write(b)
        st.image = None
        self._buffers -= 1
        self.pool_nbytes -= self._image_nbytes

    @property
    def materialized_bytes(self) -> int:
        return self._materialized_bytes

    # -- whole window --------------------------------------------------------------------------
    def flush(self) -> None:
        """Write every dirty image to its home and wait (before a checkpoint or close)."""
        for b, st in enumerate(self.state):
            if st.dirty and st.image is not None:
                self._write_back(b)
        for b in range(len(self.state)):
            self._finish_write(b)

    def drop_images(self) -> None:
        """Return clean NVMe images to the pool (after a flush)."""
        for b, st in enumerate(self.state):
            if self.homes[b].does_io and st.image is not None and not st.dirty and st.fetch is None \
                    and not st.image_holds and st.write is None and st.lent is None:
                self._free.append(st.image)
                st.image = None

    def close(self) -> None:
        for b, st in enumerate(self.state):
            if st.lent is not None:  # the image is about to go: the storage must not point at it
                self._unalias(b)
                st.materialized = False
            if st.fetch is not None:
                with contextlib.suppress(Exception):
                    st.fetch.get()
                st.fetch = None
            if st.write is not None:
                with contextlib.suppress(Exception):
                    st.write.get()
                st.write = None
        self._free.clear()
        for st in self.state:
            st.image = None
