"""Where a block's weights live between uses: host RAM or an NVMe file.

Both homes hand out a *host image* of a block: its bytes in host memory, in the layout of
the block's storage (:mod:`.blocks`). A host home's image is the home itself (pinned when
the compute device is CUDA, so the copy up is a DMA). An NVMe home keeps one record per
block in one file, 4 KiB-aligned for O_DIRECT; an image is a buffer the streamer lends
from its pool, filled by a read and written back when the optimizer changed it.

Every record carries a CRC-32C kept in RAM, taken when the record is written and checked
after every read, so a block changed on disk by anyone else is found before it reaches a
parameter (``StateLostError`` names the file and the offset).
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch
from torch import Tensor

from .. import io as tio
from ..io import FileIOError, StateLostError
from ..tiers.rundir import Spelling, claim_folders, reserve_files

RECORD_ALIGN = 4096  # O_DIRECT offset and length alignment on every Linux filesystem


class WeightsLostError(StateLostError):
    """A block's weights cannot be read back from the NVMe home as they were written (a
    checksum mismatch or a failed read). The weights existed only there: reload them."""

    def __init__(self, err: int | None, reason: str, path: str, offset: int, block: int) -> None:
        self.reason, self.record, self.block = reason, block, block
        FileIOError.__init__(self, err, f"the weights of block {block} {reason}: reload the model's weights "
                             "(tierstate.load_weights) into a new streamer, or resume from a checkpoint",
                             path, offset)

    def __reduce__(self):
        return (type(self), (self.errno, self.reason, self.filename, self.offset, self.block))


def _align(n: int) -> int:
    return (n + RECORD_ALIGN - 1) // RECORD_ALIGN * RECORD_ALIGN


class HostHome:
    """Blocks kept in host RAM: the image is the home."""

    kind = "cpu"
    does_io = False

    def __init__(self, sizes: dict[int, int], pin: bool) -> None:
        self.images: dict[int, Tensor] = {}
        for b, n in sizes.items():
            buf = tio.page_locked_empty(n, RECORD_ALIGN) if pin else torch.empty(n, dtype=torch.uint8)
            self.images[b] = buf
        self.nbytes = sum(sizes.values())
        self.pinned_nbytes = self.nbytes if pin else 0

    def image(self, b: int) -> Tensor:
        return self.images[b]

    def close(self) -> None:
        self.images.clear()


# offload_weights' own arguments, named by its errors (the optimizer's are Offload's fields)
STREAMED = Spelling(folder="offload_weights(nvme_dir=...)",
                    split="keep part of the weights in RAM with offload=ts.Offload(cpu=..., nvme=...)",
                    what="the weights' NVMe home")


class NvmeHome:
    """Blocks kept in one file under ``folder`` (claimed and removed as the NVMe tier's are).
    ``spelling``: how the caller's user names the folder and the RAM/NVMe split, for the errors."""

    kind = "nvme"
    does_io = True

    def __init__(self, sizes: dict[int, int], folder: Path | None, explicit: bool, default_root: Path,
                 spelling: Spelling = STREAMED) -> None:
        self._folders = claim_folders((Path(folder) if folder is not None else default_root,), explicit, spelling)
        try:
            self.offsets: dict[int, int] = {}
            cursor = 0
            for b, n in sizes.items():
                self.offsets[b] = cursor
                cursor += _align(n)
            self.sizes = dict(sizes)
            self.record_nbytes = {b: _align(n) for b, n in sizes.items()}
            self.nbytes = cursor
            self.path = self._folders[0].state_file(0)
            reserve_files([(self.path, cursor)], spelling)
            self.file = tio.File(self.path, "r+", direct=True)
        except BaseException:
            for f in self._folders:
                f.close()
            raise
        self.file: "tio.File | None" = self.file
        self.crc: dict[int, int] = {}  # block -> CRC-32C of its record as last written
        self.used: dict[int, int] = {}  # block -> bytes its last write filled (absent: the whole record)

    @property
    def folder(self) -> Path:
        return self._folders[0].path

    def used_nbytes(self, b: int) -> int:
        """Bytes of record ``b`` that reads move: what its last write filled (4 KiB-aligned)."""
        return self.used.get(b, self.record_nbytes[b])

    def read(self, b: int, image: Tensor) -> "tio.IOFuture":
        return self.file.pread(image, self.offsets[b], self.used_nbytes(b))

    def write(self, b: int, image: Tensor, nbytes: int | None = None) -> "tio.IOFuture":
        """Write ``image``'s first ``nbytes`` (default: the whole record, as sized at
        construction) as record ``b``; later reads move just those bytes (a layer stored coded
        fills less than the room its record keeps)."""
        room = self.record_nbytes[b]
        n = room if nbytes is None else _align(int(nbytes))
        if not 0 < n <= room:
            raise ValueError(f"nbytes={nbytes}: record {b} holds 1 to {room} bytes")
        self.used[b] = n
        self.crc[b] = tio.crc32c(image[:n])
        return self.file.pwrite(image, self.offsets[b], n)

    def verify(self, b: int, image: Tensor) -> None:
        """Raise :class:`WeightsLostError` unless ``image`` holds record ``b`` as last written."""
        self.check(b, tio.crc32c(image[:self.used_nbytes(b)]))

    def check(self, b: int, got: int) -> None:
        """Raise :class:`WeightsLostError` unless ``got`` is the CRC-32C record ``b`` was written
        with (taken by the caller over the bytes the read moved, e.g. while decoding them)."""
        n = self.used_nbytes(b)
        want = self.crc.get(b)
        if want is None or got != want:
            expected = "none: never written" if want is None else f"{want:#010x}"
            raise WeightsLostError(None, f"read back ({n} bytes) do not match what was written (CRC-32C "
                                   f"{got:#010x}, expected {expected}): the file was changed or the disk "
                                   "returned other bytes", str(self.path), self.offsets[b], b)

    def close(self) -> None:
        try:
            if self.file is not None and not self.file.closed:
                self.file.close()
        finally:
            self.file = None  # the native handle goes now, not at garbage collection
            for f in self._folders:
                f.close()


def make_home(kind: str, sizes: dict[int, int], *, pin: bool, folder, explicit: bool, default_root: Path):
    if kind == "cpu":
        return HostHome(sizes, pin)
    return NvmeHome(sizes, folder, explicit, default_root)


def split_by_fraction(nbytes: Sequence[int], cpu: float, nvme: float) -> list[str]:
    """Each block's home: the first blocks (in model order) up to ``cpu`` of the bytes in host
    RAM, the rest on NVMe. Whole blocks, since a block is fetched in one piece."""
    total = sum(nbytes)
    if total == 0:
        return ["cpu"] * len(nbytes)
    share = cpu / (cpu + nvme) if cpu + nvme > 0 else 0.0
    out, acc = [], 0
    for n in nbytes:
        # a block goes to RAM if the RAM share is not exceeded by more than half the block
        out.append("cpu" if acc + n / 2 <= share * total else "nvme")
        if out[-1] == "cpu":
            acc += n
    return out
