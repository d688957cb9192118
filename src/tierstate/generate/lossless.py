"""bf16 weights stored with their exponents in 4 bits: 1.5 bytes a value, the same bits back.

A bf16 value is a sign bit, an 8-bit exponent and a 7-bit mantissa. In a weight matrix the
exponents take few values: in a normally distributed matrix (std 0.02, as transformers
initializes Llama) 15 consecutive exponents hold all but 1.5e-4 of the values (entropy 2.55
bits), and trained LLM weights are alike (DFloat11 and ZipNN code them with Huffman at ~11
bits a value). tierstate keeps each matrix as

- one byte per value: the sign in bit 7, the mantissa in bits 0-6;
- one 4-bit code per value, packed in blocks of 64 values: code byte ``j`` of a block holds
  value ``j``'s code in its low nibble and value ``j + 32``'s in its high one (so a vector
  of code bytes gives two runs of consecutive values, with no shuffle across lanes); the
  exponent is ``base + code``, ``base`` chosen per matrix as the start of the 15-exponent
  window that holds the most values;
- the escapes, values whose exponent lies outside the window (code 15): their indices
  (uint32) and exponent bytes.

That is ``n + 32 * ceil(n / 64) + 5 * escapes`` bytes for ``n`` values: 0.75x of bf16 for
a normally distributed matrix. Decoding is byte arithmetic (no lookup), so it runs at memory
speed: the native kernel ``decode_exp4_bf16``, on the kernel thread pool, compiled per ISA.
A matrix whose coded form would not be smaller than its bf16 bytes (many exact zeros, or
exponents spread over more than 15 binades) is stored as it is.

Offloaded generation (``OffloadedLM.from_pretrained(..., compress="lossless")``) codes the
layers it keeps on NVMe: reading 0.75x of the bytes, their disk-bound steps take 0.75x of
the time, and the tokens are the same bits as the uncompressed model's. Layers in RAM stay
as they are (coding them would cost a decode per step and save no disk time).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

BLOCK = 64  # values per block of codes: 64 sign/mantissa bytes, 32 code bytes
WINDOW = 15  # exponents a code names; code 15 is the escape
ESCAPE = 15
_ALIGN = 64  # each part of a coded matrix starts on a 64-byte boundary
_CHUNK = 1 << 22  # values encoded at a time: 16 MiB of int32 temporaries at most


def _up(n: int, a: int = _ALIGN) -> int:
    return (n + a - 1) // a * a


def codes_nbytes(n: int) -> int:
    return 32 * ((n + BLOCK - 1) // BLOCK)


@dataclass(frozen=True)
class Exp4:
    """Where the parts of one coded matrix of ``n`` values sit, in bytes from its start."""

    n: int
    base: int  # the window's first exponent (0-241)
    escapes: int

    @property
    def codes_offset(self) -> int:
        return _up(self.n)

    @property
    def index_offset(self) -> int:
        return _up(self.codes_offset + codes_nbytes(self.n))

    @property
    def exponent_offset(self) -> int:
        return _up(self.index_offset + 4 * self.escapes)

    @property
    def nbytes(self) -> int:
        return self.exponent_offset + self.escapes


def coded_nbytes(n: int, escapes: int) -> int:
    return Exp4(n, 0, escapes).nbytes


def estimated_nbytes(n: int) -> int:
    """The coded size of an ``n``-value matrix before its values are known, for the planner:
    escapes at 2**-12 of the values (1.5e-4 measured on normally distributed matrices)."""
    return coded_nbytes(n, n >> 12)


def codable(shape: tuple[int, ...], dtype: torch.dtype) -> bool:
    """Matrices of bf16 values; vectors (norms, biases) stay as they are."""
    return dtype == torch.bfloat16 and len(shape) == 2 and 0 < shape[0] * shape[1] < (1 << 32)


def _exponents(bits: Tensor) -> Tensor:
    return (bits >> 7) & 0xFF


def _chunks(flat: Tensor):
    for start in range(0, flat.numel(), _CHUNK):
        yield start, flat[start:start + _CHUNK].view(torch.int16).to(torch.int32) & 0xFFFF


def _native():
    from ..kernels.backend import native_kernels  # noqa: PLC0415 - the kernels load lazily

    return native_kernels()


def _histogram(flat: Tensor) -> Tensor:
    """Counts of each exponent byte (256 int64) of the contiguous bf16 values ``flat``."""
    kernels = _native()
    if kernels is not None and flat.device.type == "cpu" and flat.is_contiguous():
        hist = torch.empty(256, dtype=torch.int64)
        kernels.exponent_histogram_bf16(flat.data_ptr(), flat.numel(), hist.data_ptr())
        return hist
    hist = torch.zeros(256, dtype=torch.int64)
    for _, bits in _chunks(flat):
        hist += torch.bincount(_exponents(bits), minlength=256)
    return hist


def choose_base(src: Tensor) -> tuple[int, int]:
    """(base, escapes): the window of 15 consecutive exponents holding the most of ``src``'s
    values (the lowest such base on ties) and how many values fall outside it."""
    flat = src.detach().reshape(-1)
    hist = _histogram(flat)
    held = hist.unfold(0, WINDOW, 1).sum(dim=1)  # held[b]: values with exponent in [b, b + 15)
    base = int(torch.argmax(held))  # the first maximum
    return base, flat.numel() - int(held[base])


def _plan(src: Tensor) -> tuple[Tensor, Exp4] | None:
    """``src``'s values flat and contiguous, and where their coded parts go; None when coding
    would not save bytes."""
    if src.dtype != torch.bfloat16:
        raise ValueError(f"lossless coding takes bfloat16 values; got {src.dtype}")
    flat = src.detach().reshape(-1).contiguous()
    base, escapes = choose_base(flat)
    layout = Exp4(flat.numel(), base, escapes)
    return None if layout.nbytes >= 2 * layout.n else (flat, layout)


def encode_into(src: Tensor, dst: Tensor) -> Exp4 | None:
    """Code the bf16 matrix ``src`` into the uint8 bytes ``dst`` (at least its coded size,
    :func:`coded_nbytes` of its escapes; the uncoded size always suffices); None, writing
    nothing, when coding would not save bytes.

    The native encoder (``encode_exp4_bf16``, on the kernel thread pool) writes the bytes of
    the torch path below, which runs without the native module or under
    ``set_isa("reference")``. A 51.4M-value matrix, 2-vCPU Zen 4: 111-204 ms against 450-658
    with the torch path (3 alternating rounds); the 14 NVMe layers of the 16-layer Llama of
    docs/generate.md (720M values) had added 5.8 s to its load with the torch path."""
    planned = _plan(src)
    if planned is None:
        return None
    flat, layout = planned
    if dst.dtype != torch.uint8 or dst.numel() < layout.nbytes or not dst.is_contiguous():
        raise ValueError(f"dst: {layout.nbytes} contiguous uint8 bytes needed, got {dst.numel()} of {dst.dtype}")
    _write(flat, layout, dst)
    return layout


def encode(src: Tensor) -> tuple[Exp4, Tensor] | None:
    """``src`` coded into a new uint8 tensor of its coded size (None when coding would not save bytes)."""
    planned = _plan(src)
    if planned is None:
        return None
    flat, layout = planned
    dst = torch.zeros(layout.nbytes, dtype=torch.uint8)
    _write(flat, layout, dst)
    return layout, dst


def _write(flat: Tensor, layout: Exp4, dst: Tensor) -> None:
    n, base, escapes = layout.n, layout.base, layout.escapes
    sm = dst[:n]
    codes = dst[layout.codes_offset:layout.codes_offset + codes_nbytes(n)]
    index = dst[layout.index_offset:layout.index_offset + 4 * escapes].view(torch.int32)
    exps = dst[layout.exponent_offset:layout.exponent_offset + escapes]
    kernels = _native()
    if kernels is not None and flat.device.type == "cpu" and dst.device.type == "cpu":
        found = kernels.encode_exp4_bf16(flat.data_ptr(), n, base, sm.data_ptr(), codes.data_ptr(), index.data_ptr(),
                                         exps.data_ptr(), escapes)
    else:
        found = _encode_torch(flat, base, sm, codes, index, exps)
    if found != escapes:  # the histogram and the codes disagree: src changed while it was coded
        raise RuntimeError(f"lossless coding found {found} escapes where its histogram counted {escapes}")


def _encode_torch(flat: Tensor, base: int, sm: Tensor, codes: Tensor, index: Tensor, exps: Tensor) -> int:
    found = 0
    # _CHUNK is a multiple of BLOCK, so a chunk's codes start on a code-byte boundary
    for start, bits in _chunks(flat):
        m = bits.numel()
        sm[start:start + m] = (((bits >> 8) & 0x80) | (bits & 0x7F)).to(torch.uint8)
        e = _exponents(bits)
        code = e - base
        out = (code < 0) | (code >= WINDOW)
        code = torch.where(out, torch.full_like(code, ESCAPE), code)
        where = torch.nonzero(out).reshape(-1)
        k = where.numel()
        if k:
            if found + k > index.numel():
                return found + k  # more than the histogram counted: the caller raises
            index[found:found + k] = (where + start).to(torch.int64).to(torch.int32)  # < 2**32 wraps to uint32 bits
            exps[found:found + k] = e[where].to(torch.uint8)
            found += k
        pad = (-m) % BLOCK
        if pad:
            code = torch.cat([code, torch.zeros(pad, dtype=code.dtype)])
        pairs = code.view(-1, 2, 32).to(torch.uint8)
        codes[start // 2:start // 2 + pairs.shape[0] * 32] = (pairs[:, 0, :] | (pairs[:, 1, :] << 4)).reshape(-1)
    return found


def decode_into(coded: Tensor, layout: Exp4, out: Tensor, *, crc: int | None = None) -> int | None:
    """The bf16 values of ``coded`` (uint8 bytes laid out as ``layout`` says) into ``out`` (a
    contiguous bf16 tensor of ``layout.n`` values), bit for bit what was encoded.

    With ``crc`` (the CRC-32C of whatever precedes the part, 0 for nothing), returns the
    CRC-32C continued over the part's ``layout.nbytes`` bytes, as
    ``tierstate.io.crc32c(coded[:layout.nbytes], crc)`` would; the native kernel takes it chunk
    by chunk as it decodes, while the bytes are in L1, so that a record is read once, not once
    for its check and again for its values. Without ``crc``, returns None.

    The native kernel writes the values in parallel; the torch path below (no native module,
    or ``set_isa("reference")``) gives the same bits. A bad escape index raises ValueError
    before any value is written."""
    n = layout.n
    if out.dtype != torch.bfloat16 or out.numel() != n:
        raise ValueError(f"out: expected {n} bfloat16 values, got {out.numel()} of {out.dtype}")
    if coded.dtype != torch.uint8 or coded.numel() < layout.nbytes:
        raise ValueError(f"coded: expected {layout.nbytes} uint8 bytes, got {coded.numel()} of {coded.dtype}")
    kernels = _native()
    if (kernels is not None and out.device.type == "cpu" and coded.device.type == "cpu" and out.is_contiguous()
            and coded.is_contiguous()):
        base_ptr = coded.data_ptr()
        got = kernels.decode_exp4_bf16(base_ptr, base_ptr + layout.codes_offset, layout.base, out.data_ptr(), n,
                                       base_ptr + layout.index_offset, base_ptr + layout.exponent_offset,
                                       layout.escapes, -1 if crc is None else layout.nbytes, crc or 0)
        return None if crc is None else got
    if crc is not None:
        from .. import io as tio  # noqa: PLC0415

        crc = tio.crc32c(coded[:layout.nbytes], crc)
    _decode_torch(coded, layout, out)
    return crc


def _decode_torch(coded: Tensor, layout: Exp4, out: Tensor) -> None:
    n = layout.n
    flat = out.reshape(-1).view(torch.int16)
    sm = coded[:n].to(torch.int32)
    c = coded[layout.codes_offset:layout.codes_offset + codes_nbytes(n)].view(-1, 1, 32).to(torch.int32)
    code = torch.cat([c & 0x0F, c >> 4], dim=1).reshape(-1)[:n]
    e = (code + layout.base) & 0xFF
    bits = ((sm & 0x80) << 8) | (e << 7) | (sm & 0x7F)
    k = layout.escapes
    if k:
        idx = coded[layout.index_offset:layout.index_offset + 4 * k].view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        if int(idx.max()) >= n:
            raise ValueError("an escape index is >= n")
        ex = coded[layout.exponent_offset:layout.exponent_offset + k].to(torch.int32)
        bits[idx] = (bits[idx] & 0x807F) | (ex << 7)
    flat.copy_(bits.to(torch.int16))  # bits < 2**16: the int16 cast keeps the low 16 bits


def roundtrip(w: Tensor) -> Tensor:
    """``w`` (bf16) as the coded store gives it back: the same bits, or ``w`` itself when not coded."""
    coded = encode(w)
    if coded is None:
        return w.detach().clone()
    layout, data = coded
    out = torch.empty(w.shape, dtype=torch.bfloat16)
    decode_into(data, layout, out)
    return out
