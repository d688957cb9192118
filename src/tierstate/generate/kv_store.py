"""The KV cache of every (layer, micro-batch) on its tier.

[Note: the record of one layer and one micro-batch]
On NVMe, keys and values are kept token-major, ``[max_len, mb, kv_heads, head_dim]``, so
the tokens a step appends are one contiguous run of bytes: a step rewrites only the 4 KiB
pages those new rows touch (the page they share with older rows included, from the buffer
that holds them all), never the whole cache. In host RAM they are kept head-major,
``[mb, kv_heads, max_len, head_dim]``: nothing is written back, and attention reads each
head's tokens as one run (2.2-3.2x faster than over token-major rows: ``LayerCache``). An
NVMe record's rows are copied into one head-major scratch (the size of the largest record,
shared by all: the layers and micro-batches run one at a time) for the layer's attention,
which with the copy is still 2.3-2.7x faster than over the token-major rows. A record is
the keys' region then the values' region, each 4 KiB-aligned, so both O_DIRECT reads (rows
``[0, past)`` of each region) start on a page. A host-RAM record is used in place; an NVMe
record is read into one of a pool of aligned buffers: the layer's records that run, the
next layer's read ahead (asked for before that layer's weights), and one whose write may
still be in flight (:func:`tierstate.placement.generate_plan.kv_pool_records`).

Every NVMe read is checked: a CRC-32C of the valid rows of each region, taken when the rows
were written, is compared after the read (``WeightsLostError`` semantics: the file and the
offset are named).
"""
from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import Tensor

from .. import io as tio
from ..io import StateLostError
from ..io.errors import FileIOError
from ..placement.defaults import default_nvme_root
from ..placement.generate_plan import kv_pool_records
from ..tiers.rundir import Spelling
from ..weights.homes import RECORD_ALIGN, NvmeHome

# what a disk too small for the NVMe KV records tells the caller of OffloadedLM.from_pretrained
KV = Spelling(folder="OffloadedLM.from_pretrained(nvme_dir=...)",
              split='keep the KV cache in RAM with kv="cpu" (or part of it with kv=ts.Offload(cpu=..., nvme=...)), '
                    "or generate fewer sequences at once",
              what="the KV cache kept on NVMe")


class KVLostError(StateLostError):
    """A KV cache record read back from NVMe does not match what was written."""

    def __init__(self, err, reason: str, path: str, offset: int) -> None:
        self.reason = reason
        FileIOError.__init__(self, err, f"the KV cache {reason}: generate again (the cache exists only "
                             "for one generate call)", path, offset)

    def __reduce__(self):
        return (type(self), (self.errno, self.reason, self.filename, self.offset))


def _up(n: int) -> int:
    return (n + RECORD_ALIGN - 1) // RECORD_ALIGN * RECORD_ALIGN


def _down(n: int) -> int:
    return n // RECORD_ALIGN * RECORD_ALIGN


class KVStore:
    """Keys and values of ``n_layers x len(micro_sizes)`` records; record ``s = layer * J + j``."""

    def __init__(self, n_layers: int, micro_sizes: list[int], kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype, tiers: list[str], *, nvme_dir: Path | None) -> None:
        self.J = len(micro_sizes)
        self.micro_sizes = list(micro_sizes)
        self.max_len = max_len
        self.dtype = dtype
        self.tiers = list(tiers)  # per layer
        item = torch.empty(0, dtype=dtype).element_size()
        self.row = [mb * kv_heads * head_dim * item for mb in micro_sizes]  # bytes of one token's keys
        self.shape = [(max_len, mb, kv_heads, head_dim) for mb in micro_sizes]
        self.region = [_up(max_len * r) for r in self.row]
        self.host: dict[int, Tensor] = {}
        nvme_sizes: dict[int, int] = {}
        for layer in range(n_layers):
            for j in range(self.J):
                s = layer * self.J + j
                if self.tiers[layer] == "cpu":
                    self.host[s] = torch.empty(2 * self.region[j], dtype=torch.uint8)
                else:
                    nvme_sizes[s] = 2 * self.region[j]
        self.host_nbytes = sum(t.numel() for t in self.host.values())
        self.nvme: NvmeHome | None = None
        self._free: list[tuple[Tensor, object | None]] = []  # (buffer, write in flight from it)
        self._loaded: dict[int, tuple[Tensor, object | None, object | None, int]] = {}
        self._writing: dict[int, tuple[object, object]] = {}  # record -> its last writes (done or not)
        self.crc: dict[int, tuple[int, int]] = {}
        self.read_bytes = self.write_bytes = 0
        self.stall_seconds = 0.0
        if nvme_sizes:
            explicit = nvme_dir is not None
            folder = Path(nvme_dir) / "kv" if explicit else None
            self.nvme = NvmeHome(nvme_sizes, folder, explicit, default_nvme_root(), KV)
            big = max(nvme_sizes.values())
            for _ in range(kv_pool_records(self.J, len(nvme_sizes))):
                self._free.append((tio.aligned_empty(big, RECORD_ALIGN), None))
        # head-major keys and values for the attention over an NVMe record (see the note)
        self._scratch = torch.empty(max(nvme_sizes.values()), dtype=torch.uint8) if nvme_sizes else None
        self.pool_nbytes = sum(b.numel() for b, _ in self._free)
        self.scratch_nbytes = self._scratch.numel() if self._scratch is not None else 0
        self.nvme_nbytes = self.nvme.nbytes if self.nvme is not None else 0

    def _views(self, s: int, buf: Tensor) -> tuple[Tensor, Tensor]:
        return self._regions(s % self.J, buf, token_major=self.token_major(s))

    def _regions(self, j: int, buf: Tensor, token_major: bool) -> tuple[Tensor, Tensor]:
        """The keys' and the values' regions of ``buf`` as micro-batch ``j``'s tensors, in
        either layout (the note)."""
        reg, shape = self.region[j], self.shape[j]
        n = shape[0] * self.row[j]
        if not token_major:
            max_len, mb, heads, dim = shape
            shape = (mb, heads, max_len, dim)
        return buf[:n].view(self.dtype).view(shape), buf[reg:reg + n].view(self.dtype).view(shape)

    def token_major(self, s: int) -> bool:
        """Whether record ``s``'s views are token-major (on NVMe) or head-major (in RAM); see the note."""
        return self.on_nvme(s)

    def scratch(self, s: int) -> tuple[Tensor, Tensor] | None:
        """Head-major keys and values, ``[mb, kv_heads, max_len, head_dim]``, for the attention
        over NVMe record ``s`` (overwritten by the next record's); None for a record in RAM."""
        if not self.on_nvme(s):
            return None
        return self._regions(s % self.J, self._scratch, token_major=False)

    def on_nvme(self, s: int) -> bool:
        return self.tiers[s // self.J] == "nvme"

    # -- NVMe reads ----------------------------------------------------------------------------
    def prefetch(self, s: int, past: int) -> None:
        """Start reading record ``s``'s first ``past`` rows if it is on NVMe and a buffer is free."""
        if not self.on_nvme(s) or s in self._loaded or not self._free:
            return
        buf, write = self._free.pop()
        if write is not None:
            self._wait(write)
        # Read ahead a layer early, a record can be asked for while its own last write (from
        # another buffer) is still queued: the read must not pass it.
        mine = self._writing.pop(s, None)
        if mine is not None:
            self._wait(mine)
        j = s % self.J
        n = _up(past * self.row[j])
        base = self.nvme.offsets[s]
        kf = self.nvme.file.pread(buf, base, n) if n else None
        vf = self.nvme.file.pread(buf[self.region[j]:], base + self.region[j], n) if n else None
        self._loaded[s] = (buf, kf, vf, past)

    def acquire(self, s: int, past: int) -> tuple[Tensor, Tensor]:
        """Record ``s``'s keys and values, the first ``past`` tokens filled: ``[max_len, mb,
        kv_heads, head_dim]`` on NVMe, ``[mb, kv_heads, max_len, head_dim]`` in RAM (the note)."""
        if not self.on_nvme(s):
            return self._views(s, self.host[s])
        if s not in self._loaded:
            self.prefetch(s, past)
        buf, kf, vf, got = self._loaded[s]
        if got != past:
            raise RuntimeError(f"KV record {s} was read ahead with {got} rows, the step needs {past}")
        t0 = time.perf_counter()
        try:
            for f in (kf, vf):
                if f is not None:
                    f.get()
            self._verify(s, buf, past)
        except BaseException:
            del self._loaded[s]
            self._free.append((buf, None))
            raise
        finally:
            self.stall_seconds += time.perf_counter() - t0
        self.read_bytes += 2 * _up(past * self.row[s % self.J])
        self._loaded[s] = (buf, None, None, past)
        return self._views(s, buf)

    def _verify(self, s: int, buf: Tensor, past: int) -> None:
        if past == 0:
            return
        j = s % self.J
        n = past * self.row[j]
        got = (tio.crc32c(buf[:n]), tio.crc32c(buf[self.region[j]:self.region[j] + n]))
        want = self.crc.get(s)
        if got != want:
            raise KVLostError(None, f"record of layer {s // self.J}, micro-batch {j} ({past} tokens) read back "
                              f"with CRC-32C {got[0]:#010x}/{got[1]:#010x}, expected "
                              f"{'none: never written' if want is None else f'{want[0]:#010x}/{want[1]:#010x}'}",
                              str(self.nvme.path), self.nvme.offsets[s])

    def commit(self, s: int, past: int, new: int) -> None:
        """Rows ``[past, past + new)`` were appended: write the pages they touch (NVMe) and
        let the buffer go to the next read once the write ends."""
        if not self.on_nvme(s):
            return
        buf, _, _, _ = self._loaded.pop(s)
        j = s % self.J
        row, reg, base = self.row[j], self.region[j], self.nvme.offsets[s]
        end = (past + new) * row
        lo, hi = _down(past * row), _up(end)
        self.crc[s] = (tio.crc32c(buf[:end]), tio.crc32c(buf[reg:reg + end]))
        wk = self.nvme.file.pwrite(buf[lo:], base + lo, hi - lo)
        wv = self.nvme.file.pwrite(buf[reg + lo:], base + reg + lo, hi - lo)
        self.write_bytes += 2 * (hi - lo)
        self._free.insert(0, (buf, (wk, wv)))  # reused last: its write gets the most time
        self._writing[s] = (wk, wv)

    def _wait(self, writes) -> None:
        t0 = time.perf_counter()
        try:
            for w in writes:
                w.get()
        finally:
            self.stall_seconds += time.perf_counter() - t0

    def close(self) -> None:
        for s, (buf, kf, vf, _) in list(self._loaded.items()):
            for f in (kf, vf):
                if f is not None:
                    try:
                        f.get()
                    except OSError:
                        pass  # the cache is being dropped
        self._loaded.clear()
        for buf, w in self._free:
            if w is not None:
                try:
                    self._wait(w)
                except OSError:
                    pass
        self._free.clear()
        self._writing.clear()
        self.host.clear()
        if self.nvme is not None:
            self.nvme.close()
            self.nvme = None
