"""Each decoder layer's weights in one record on its tier, fetched whole before the layer runs.

A layer's parameters are laid out back to back in one flat image (each on a 64-byte boundary,
:data:`tierstate.weights.blocks.PARAM_ALIGN`), and the image lives in the homes of
:mod:`tierstate.weights.homes`: host RAM (the image is the home, used in place) or one
4 KiB-aligned O_DIRECT record per layer in a file, with a CRC-32C checked after every read.

Images of NVMe layers come from a pool of ``prefetch + 1`` aligned buffers: the layer that
runs and the ones read ahead. The block schedule runs every micro-batch through a layer
before it moves on, so each NVMe layer is read once per generated token (per round of
micro-batches), not once per micro-batch.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from torch import Tensor

from .. import io as tio
from ..kernels.omp_handover import hand_over_cores
from ..placement.defaults import default_nvme_root
from ..placement.generate_plan import DEFAULT_PREFETCH
from ..tiers.rundir import Spelling
from ..weights.blocks import PARAM_ALIGN, align_up
from ..weights.homes import RECORD_ALIGN, HostHome, NvmeHome
from . import compress as cq
from . import lossless as ll

# what a disk too small for the NVMe layers tells the caller of OffloadedLM.from_pretrained
LAYERS = Spelling(folder="OffloadedLM.from_pretrained(nvme_dir=...)",
                  split='keep more layers in RAM with weights=ts.Offload(cpu=..., nvme=...), or pass '
                        'weights="auto", which plans within the free disk',
                  what="the layers kept on NVMe")


@dataclass(frozen=True)
class Slot:
    """One parameter inside its layer's image."""

    name: str  # relative to the layer module ("attn.c_attn.weight")
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def layer_layout(layer: torch.nn.Module, dtype: torch.dtype) -> tuple[list[Slot], int]:
    """The slots of ``layer``'s parameters (floating ones cast to ``dtype``) and the image size."""
    slots, cursor = [], 0
    for name, p in layer.named_parameters():
        dt = dtype if p.dtype.is_floating_point else p.dtype
        n = p.numel() * torch.empty(0, dtype=dt).element_size()
        cursor = align_up(cursor, PARAM_ALIGN)
        slots.append(Slot(name, dt, tuple(p.shape), cursor, n))
        cursor += n
    return slots, align_up(max(cursor, 1), PARAM_ALIGN)


def typed(image: Tensor, slot: Slot) -> Tensor:
    return image[slot.offset:slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)


@dataclass(frozen=True)
class Stored:
    """Where one parameter sits in a compressed layer's stored image: quantized values and
    scales, or (``scales_nbytes == 0``) its raw bytes."""

    slot: Slot
    offset: int
    nbytes: int
    scales_offset: int = 0
    scales_nbytes: int = 0


def stored_layout(slots: list[Slot], mode: str, group: int) -> tuple[list[Stored], int]:
    out, cursor = [], 0
    for s in slots:
        numel = s.nbytes // torch.empty(0, dtype=s.dtype).element_size()
        cursor = align_up(cursor, PARAM_ALIGN)
        if cq.quantizable(s.shape, s.dtype, group):
            vn, sn = cq.stored_nbytes(numel, mode, group)
            so = align_up(cursor + vn, PARAM_ALIGN)
            out.append(Stored(s, cursor, vn, so, sn))
            cursor = so + sn
        else:
            out.append(Stored(s, cursor, s.nbytes))
            cursor += s.nbytes
    return out, align_up(max(cursor, 1), PARAM_ALIGN)


def lossless_estimate(slots: list[Slot]) -> int:
    """A layer's bytes as ``compress="lossless"`` stores it, before its values are known:
    :func:`tierstate.generate.lossless.estimated_nbytes` per codable matrix, the rest as it is."""
    cursor = 0
    for s in slots:
        cursor = align_up(cursor, PARAM_ALIGN)
        numel = s.nbytes // torch.empty(0, dtype=s.dtype).element_size()
        cursor += ll.estimated_nbytes(numel) if ll.codable(s.shape, s.dtype) else s.nbytes
    return align_up(max(cursor, 1), PARAM_ALIGN)


def check_options(compress: str | None, group: int, dtype: torch.dtype) -> None:
    """ValueError naming the argument when ``compress`` / ``group`` are not a format, or the
    format cannot store ``dtype`` layers."""
    cq.check_options(compress, group)
    if compress == cq.LOSSLESS and dtype != torch.bfloat16:
        raise ValueError(f"compress='lossless' codes bfloat16 layers; dtype={dtype}: pass dtype=torch.bfloat16 "
                         "or compress=None")


def layer_sizes(layers: Sequence[torch.nn.Module], dtype: torch.dtype, compress: str | None = None,
                group: int = cq.DEFAULT_GROUP) -> tuple[list[int], list[int] | None]:
    """Each layer's image in the compute dtype, and as stored when ``compress`` is given (else
    None): the sizes the planner prices and the store allocates (``"lossless"``: an estimate,
    the bytes an NVMe layer reads; the store sizes its homes by the first list)."""
    check_options(compress, group, dtype)
    layouts = [layer_layout(m, dtype) for m in layers]
    full = [n for _, n in layouts]
    if compress is None:
        return full, None
    if compress == cq.LOSSLESS:
        return full, [lossless_estimate(slots) for slots, _ in layouts]
    return full, [stored_layout(slots, compress, group)[1] for slots, _ in layouts]


@dataclass(frozen=True)
class Coded:
    """Where one parameter sits in an NVMe layer stored ``compress="lossless"``: its coded parts
    (``exp4``) or, when coding would not save bytes or it is not a bf16 matrix, its raw bytes."""

    slot: Slot
    offset: int
    exp4: ll.Exp4 | None


class WeightStore:
    """The layers' weights on their tiers; ``acquire(l)`` gives layer ``l``'s image."""

    def __init__(self, layers: Sequence[torch.nn.Module], tiers: Sequence[str], dtype: torch.dtype, *,
                 nvme_dir: Path | None, prefetch: int = DEFAULT_PREFETCH, compress: str | None = None,
                 group: int = cq.DEFAULT_GROUP) -> None:
        if len(tiers) != len(layers):
            raise ValueError(f"tiers: {len(tiers)} entries for {len(layers)} layers")
        check_options(compress, group, dtype)
        self.layers = list(layers)
        self.tiers = list(tiers)
        self.layouts = [layer_layout(m, dtype) for m in self.layers]
        self.compress, self.group = compress, group
        # lossless: NVMe layers are coded as fill() reads them, each in a record sized for its
        # uncoded image (a coded layer is smaller: reads move what it filled); RAM layers stay
        # as they are. int8/int4: every layer quantized, in a record of its stored size.
        self.lossless = compress == cq.LOSSLESS
        self.coded: dict[int, list[Coded]] = {}
        quantized = compress is not None and not self.lossless
        self.stored = [stored_layout(slots, compress, group) for slots, _ in self.layouts] if quantized else None
        sizes = {i: n for i, (_, n) in enumerate(self.stored or self.layouts)}
        # the layer that runs, decoded: one buffer, layers run one at a time
        decoded = quantized or (self.lossless and "nvme" in self.tiers)
        self._compute = torch.empty(max(n for _, n in self.layouts), dtype=torch.uint8) if decoded else None
        cpu = {i: n for i, n in sizes.items() if self.tiers[i] == "cpu"}
        nvme = {i: n for i, n in sizes.items() if self.tiers[i] == "nvme"}
        self.host = HostHome(cpu, pin=False)
        self.nvme: NvmeHome | None = None
        self._free: list[Tensor] = []
        self._loaded: dict[int, tuple[Tensor, object | None]] = {}  # layer -> (buffer, read in flight)
        self.prefetch_depth = max(int(prefetch), 1)
        self.read_bytes = 0
        self.stall_seconds = 0.0
        if nvme:
            explicit = nvme_dir is not None
            folder = Path(nvme_dir) / "weights" if explicit else None
            self.nvme = NvmeHome(nvme, folder, explicit, default_nvme_root(), LAYERS)
            record = max(self.nvme.record_nbytes.values())
            for _ in range(min(self.prefetch_depth + 1, len(nvme))):
                self._free.append(tio.aligned_empty(record, RECORD_ALIGN))
        self.pool_nbytes = sum(b.numel() for b in self._free) + (self._compute.numel() if decoded else 0)
        self.host_nbytes = self.host.nbytes
        self.nvme_nbytes = self.nvme.nbytes if self.nvme is not None else 0

    # -- filling -------------------------------------------------------------------------------
    def fill(self, source, layer_names: Sequence[str]) -> None:
        """Read every layer's tensors from ``source`` (a tensor at a time, straight into the
        layer's image) and write NVMe layers to their records; one image in memory at a time."""
        scratch = None
        for i, prefix in enumerate(layer_names):
            slots, n = self.layouts[i]
            if self.tiers[i] == "cpu":
                image = self.host.image(i)
            else:
                if scratch is None:
                    scratch = self._free.pop()
                image = scratch
                image.zero_()  # the padding is part of the checksummed record
            if self.lossless and self.tiers[i] == "nvme":
                used = self._fill_coded(i, source, prefix, image)
            elif self.stored is not None:
                for st in self.stored[i][0]:
                    s = st.slot
                    if st.scales_nbytes:
                        full = torch.empty(s.shape, dtype=s.dtype)
                        source.read_into(f"{prefix}.{s.name}", full)
                        cq.quantize_into(full, image[st.offset:st.offset + st.nbytes],
                                         image[st.scales_offset:st.scales_offset + st.scales_nbytes].view(torch.float32),
                                         self.compress, self.group)
                        del full
                    else:
                        source.read_into(f"{prefix}.{s.name}",
                                         image[st.offset:st.offset + st.nbytes].view(s.dtype).view(s.shape))
            else:
                for s in slots:
                    source.read_into(f"{prefix}.{s.name}", typed(image, s))
            if self.tiers[i] == "nvme":
                self.nvme.write(i, image, used if self.lossless else None).get()
        if scratch is not None:
            self._free.append(scratch)

    def _fill_coded(self, i: int, source, prefix: str, image: Tensor) -> int:
        """Layer ``i``'s tensors into ``image``, bf16 matrices coded; the bytes filled."""
        entries, cursor = [], 0
        for s in self.layouts[i][0]:
            cursor = align_up(cursor, PARAM_ALIGN)
            exp4 = None
            if ll.codable(s.shape, s.dtype):
                full = torch.empty(s.shape, dtype=s.dtype)
                source.read_into(f"{prefix}.{s.name}", full)
                exp4 = ll.encode_into(full, image[cursor:])
                if exp4 is None:  # coding would not save bytes: the values as they are
                    image[cursor:cursor + s.nbytes].view(s.dtype).view(s.shape).copy_(full)
                del full
            else:
                source.read_into(f"{prefix}.{s.name}", image[cursor:cursor + s.nbytes].view(s.dtype).view(s.shape))
            entries.append(Coded(s, cursor, exp4))
            cursor += exp4.nbytes if exp4 is not None else s.nbytes
        self.coded[i] = entries
        return max(cursor, 1)

    # -- fetching ------------------------------------------------------------------------------
    def prefetch(self, order: Sequence[int]) -> None:
        """Start reading the NVMe layers of ``order`` (the next layers to run) while buffers last."""
        for i in order:
            if self.tiers[i] != "nvme" or i in self._loaded:
                continue
            if not self._free:
                return
            buf = self._free.pop()
            self._loaded[i] = (buf, self.nvme.read(i, buf))

    def acquire(self, i: int) -> Tensor:
        """Layer ``i``'s image in the compute layout (read now if no read-ahead brought it;
        decoded into the compute buffer when stored quantized, or coded on NVMe)."""
        if self.stored is not None or self.tiers[i] == "nvme":
            # the layer before ran on torch's OpenMP workers, which still spin: give their cores
            # to the native work of this one, the CRC-32C of its record and its dequantization
            # (kernels/omp_handover.py; once per layer)
            hand_over_cores()
        coded = self.lossless and self.tiers[i] == "nvme"
        image = self._stored_image(i, verify=not coded)  # a coded record is checked as it is decoded
        if coded:
            try:
                out = self._decode(i, image)
            except BaseException:
                self.release(i)  # the record is not used: its buffer takes the next read
                raise
        elif self.stored is None:
            return image
        else:
            out = self._dequantize(i, image)
        # decoded into the compute buffer: the record's buffer can take the next read now,
        # while this layer computes, not after it
        self.release(i)
        return out

    def _dequantize(self, i: int, image: Tensor) -> Tensor:
        out = self._compute
        for st in self.stored[i][0]:
            s = st.slot
            dst = typed(out, s)
            if st.scales_nbytes:
                cq.dequantize_into(image[st.offset:st.offset + st.nbytes],
                                   image[st.scales_offset:st.scales_offset + st.scales_nbytes].view(torch.float32),
                                   dst, self.compress, self.group)
            else:
                dst.copy_(image[st.offset:st.offset + st.nbytes].view(s.dtype).view(s.shape))
        return out

    def _decode(self, i: int, image: Tensor) -> Tensor:
        """Layer ``i``'s values from its coded record ``image``, into the compute buffer, with the
        record's CRC-32C taken on the way: each coded matrix's by its decode (while its bytes
        are in L1), the padding's and the uncoded tensors' around them, in record order. A
        record that does not match what was written raises WeightsLostError, and what was
        decoded from it is never used."""
        out, crc, pos = self._compute, 0, 0
        try:
            for c in self.coded[i]:  # in record order, as _fill_coded laid them out
                crc = tio.crc32c(image[pos:c.offset], crc)  # the padding before the part
                dst = typed(out, c.slot)
                if c.exp4 is not None:
                    crc = ll.decode_into(image[c.offset:c.offset + c.exp4.nbytes], c.exp4, dst, crc=crc)
                    pos = c.offset + c.exp4.nbytes
                else:
                    raw = image[c.offset:c.offset + c.slot.nbytes]
                    dst.copy_(raw.view(c.slot.dtype).view(c.slot.shape))
                    crc = tio.crc32c(raw, crc)
                    pos = c.offset + c.slot.nbytes
        except ValueError:  # an escape index past its matrix: bytes changed on disk, or a bug
            self.nvme.verify(i, image)  # raises WeightsLostError when the record changed
            raise
        self.nvme.check(i, tio.crc32c(image[pos:self.nvme.used_nbytes(i)], crc))
        return out

    def _stored_image(self, i: int, verify: bool = True) -> Tensor:
        if self.tiers[i] == "cpu":
            return self.host.image(i)
        if i not in self._loaded:
            self.prefetch([i])
            if i not in self._loaded:
                raise RuntimeError("every weight buffer is held: release a layer before acquiring another")
        buf, fut = self._loaded[i]
        if fut is not None:
            t0 = time.perf_counter()
            try:
                fut.get()
                if verify:
                    self.nvme.verify(i, buf)
            except BaseException:
                del self._loaded[i]
                self._free.append(buf)
                raise
            finally:
                self.stall_seconds += time.perf_counter() - t0
            self.read_bytes += self.nvme.used_nbytes(i)
            self._loaded[i] = (buf, None)
        return buf

    def release(self, i: int) -> None:
        """Layer ``i`` has run: its NVMe buffer may take the next read."""
        if self.tiers[i] == "nvme" and i in self._loaded:
            buf, fut = self._loaded.pop(i)
            if fut is not None:
                try:
                    fut.get()
                except OSError:
                    pass  # a read nobody will use: its error surfaces when the layer is acquired again
            self._free.append(buf)

    def bind(self, i: int, image: Tensor) -> None:
        """Point layer ``i``'s parameters at views of ``image`` (no copy)."""
        layer = self.layers[i]
        for s in self.layouts[i][0]:
            mod_name, _, pname = s.name.rpartition(".")
            mod = layer.get_submodule(mod_name) if mod_name else layer
            mod._parameters[pname] = typed(image, s)

    def release_all(self) -> None:
        """Return every NVMe buffer (after a round, or a round that failed part-way)."""
        for i in list(self._loaded):
            self.release(i)

    def close(self) -> None:
        self.release_all()
        self._free.clear()
        self.host.close()
        if self.nvme is not None:
            self.nvme.close()
            self.nvme = None
