"""A model's weights to and from one safetensors file, streamed: :func:`save_weights`,
:func:`load_weights`.

[Note: writing safetensors in a stream]
The safetensors library builds a whole file in memory (``save_file`` serializes every tensor
first), which for a 7B fp32 model is 27 GB of RAM that a streamed model never had. The
format is simple enough to write directly:

    8 bytes      N, the header's length, unsigned little-endian
    N bytes      a JSON object: for each tensor {"dtype": "F32", "shape": [...],
                 "data_offsets": [begin, end]} (byte offsets into the data, end exclusive),
                 and "__metadata__": {"format": "pt"} (str -> str; transformers checks "format")
    data         every tensor's bytes, row-major, little-endian, back to back

The reader accepts trailing spaces in the header and requires the data to be covered exactly,
without holes or overlaps. Everything in the header comes from shapes and dtypes, so it is
written first; the data follows tensor by tensor, a streamed parameter read from its block's
host image (one block image in memory at a time, the streamer's pool buffer) and copied
into the writer's two aligned buffers. The header is padded with spaces to end on a 4 KiB
boundary so that the data's file offsets stay aligned for O_DIRECT.
"""
from __future__ import annotations

import errno
import json
import os
import struct
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor, nn

from ..checkpoint.durable import aligned_buffer, fsync_dir, open_file, remove_quietly
from ..dist import is_dtensor
from ..io.errors import FileIOError, from_oserror, io_error
from ..tiers.termination import remove_on_termination
from .streamer import WeightStreamer, closed_name, streamed

# torch dtype -> safetensors dtype name (the library's spelling).
_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
for _name, _code in (("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64")):
    if hasattr(torch, _name):
        _DTYPES[getattr(torch, _name)] = _code

DATA_ALIGN = 4096  # the data starts on an O_DIRECT boundary (the header is padded with spaces)
# Two 8 MiB buffers: one fills while the other is written. 8 MiB keeps a write at the
# device's full rate (the I/O benchmark's plateau starts near 1 MiB) and adds 16 MiB of RAM.
CHUNK = 8 << 20


class LoadResult(NamedTuple):
    """What :func:`load_weights` did not match (empty lists under ``strict=True``)."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def _entries(model: nn.Module) -> tuple[list[tuple[str, Tensor]], dict[str, str]]:
    """(name, tensor) of every parameter and persistent buffer once, in ``state_dict`` order,
    and the aliases: a name whose tensor is saved under an earlier name (tied weights, as
    transformers saves them: ``lm_head.weight`` tied to ``transformer.wte.weight`` is saved once,
    under the first name)."""
    saved: dict[int, str] = {}
    entries, aliases = [], {}
    for name, t in model.state_dict(keep_vars=True).items():
        first = saved.get(id(t))
        if first is not None:
            aliases[name] = first
            continue
        saved[id(t)] = name
        entries.append((name, t))
    return entries, aliases


def _streamer_of(t: Tensor, streamer: WeightStreamer | None, name: str):
    h = streamed(t)
    if h is None:
        return None
    if streamer is not None and h.streamer is not streamer:
        raise ValueError(f"streamer={streamer!r}: parameter {name!r} is streamed by another WeightStreamer "
                         f"({h.streamer!r}); pass that one, or streamer=None to use whichever streams each")
    return h


def _check_model(model, streamer) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if any(is_dtensor(p) for p in model.parameters()):
        # each rank holds shards: a file of one rank's shards under the global names and shapes
        # would be corrupt, and gathering whole tensors is what DCP is for
        raise ValueError("save_weights/load_weights: the model's parameters are sharded (DTensor, FSDP2); save and "
                         "load them with torch.distributed.checkpoint (get_state_dict + dcp.save / dcp.load + "
                         "set_state_dict); streamed shards are read from and written to their homes")
    if streamer is not None:
        if not isinstance(streamer, WeightStreamer):
            raise TypeError(f"streamer={streamer!r}: expected a tierstate.WeightStreamer or None")
        if streamer.closed:
            raise ValueError(f"streamer={streamer!r} is closed: its weights are gone; save before close()")
        if streamer.model_ref() is not model:
            raise ValueError("streamer= streams another model: pass the WeightStreamer that "
                             "offload_weights returned for this model, or streamer=None")


def _path_arg(path, what: str) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path={path!r}: expected a str or os.PathLike naming the {what}")
    return Path(path)


def header_bytes(specs: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str]) -> tuple[bytes, int]:
    """The file's first bytes (length + JSON header, padded so the data starts at a 4 KiB
    boundary) and the data's length, for tensors given as (name, dtype, shape) in file order."""
    header: dict = {"__metadata__": dict(metadata)}
    cursor = 0
    for name, dtype, shape in specs:
        code = _DTYPES.get(dtype)
        if code is None:
            raise TypeError(f"tensor {name!r} has dtype {dtype}, which safetensors cannot store "
                            f"(it stores {', '.join(sorted(_DTYPES.values()))}): cast it before saving")
        n = _numel(shape) * torch.empty(0, dtype=dtype).element_size()
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [cursor, cursor + n]}
        cursor += n
    text = json.dumps(header, separators=(",", ":")).encode()
    total = 8 + len(text)
    pad = (-total) % DATA_ALIGN
    text += b" " * pad
    return struct.pack("<Q", len(text)) + text, cursor


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


class _Sink:
    """Bytes appended to a new file through two aligned buffers: one fills while the other
    is being written. ``finish`` waits, fsyncs and closes; ``abort`` closes and removes."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._file = open_file(path, "x")
        self._buffers = [aligned_buffer(CHUNK) for _ in range(2)]
        self._pending: list = [None, None]
        self._current = self._fill = self._offset = 0

    def put(self, data: Tensor) -> None:
        pos, n = 0, data.numel()
        while pos < n:
            buf = self._buffers[self._current]
            if self._fill == 0 and self._pending[self._current] is not None:
                fut, self._pending[self._current] = self._pending[self._current], None
                fut.get()  # this buffer's previous write must be done before it is refilled
            take = min(n - pos, CHUNK - self._fill)
            buf[self._fill: self._fill + take].copy_(data[pos: pos + take])
            self._fill += take
            pos += take
            if self._fill == CHUNK:
                self._flush()

    def _flush(self) -> None:
        self._pending[self._current] = self._file.pwrite(self._buffers[self._current], self._offset, self._fill)
        self._offset += self._fill
        self._fill = 0
        self._current ^= 1

    def finish(self) -> int:
        if self._fill:
            self._flush()
        for i, fut in enumerate(self._pending):
            if fut is not None:
                self._pending[i] = None
                fut.get()
        self._file.sync()
        self._file.close()
        return self._offset

    def abort(self) -> None:
        for fut in self._pending:
            if fut is not None:
                try:
                    fut.get()  # the buffers are ours again only once their writes ended
                except OSError:
                    pass  # the error being raised is the first one
        self._pending = [None, None]
        try:
            self._file.close()
        except OSError:
            pass
        remove_quietly(self.path)


def _as_bytes(t: Tensor) -> Tensor:
    """A contiguous uint8 CPU view (or copy, for a tensor on another device) of ``t``'s values."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    return t.contiguous().reshape(-1).view(torch.uint8)


def _named(exc: OSError, final: Path, tmp: str) -> FileIOError:
    """The error of a failed save, naming the file asked for (and the temporary one it concerns)."""
    err = exc.errno if exc.errno is not None else errno.EIO
    new = io_error(err, str(final), getattr(exc, "offset", None), "save_weights")
    new.strerror = f"save_weights failed writing {tmp} (removed; {final} is unchanged): {exc.strerror or exc}"
    return new


def save_weights(model: nn.Module, path, *, streamer: WeightStreamer | None = None) -> Path:
    """Write the model's weights to one safetensors file, a tensor at a time.

    Every entry of ``model.state_dict()`` (parameters and persistent buffers) is saved once;
    a tied weight is saved under its first name (``lm_head.weight`` tied to
    ``transformer.wte.weight`` is stored as the latter, as transformers' ``save_pretrained``
    does). Streamed parameters are read block by block from where they live (host RAM or the
    NVMe home, including updates not yet written back), so the memory used is one block
    image plus two 8 MiB write buffers, whatever the model's size. The file is what
    ``safetensors.torch.load_file`` and transformers' ``from_pretrained`` read.

    The write is atomic: a temporary file in the same folder, fsynced, renamed over ``path``,
    and the folder fsynced. On failure the temporary file is removed, ``path`` is left as it
    was, and the :class:`OSError` (a :class:`tierstate.FileIOError` subclass by errno, e.g.
    :class:`tierstate.DiskFullError`) names ``path``.

    Args:
        model: the model, streamed by :func:`tierstate.offload_weights` or not.
        path: the file to write (e.g. ``out/model.safetensors``); its folder must exist.
        streamer: the :class:`tierstate.WeightStreamer` of the model; by default the one
            streaming each parameter is found from the parameter.

    Returns:
        ``path`` as a :class:`pathlib.Path`.
    """
    _check_model(model, streamer)
    final = _path_arg(path, "safetensors file to write")
    if final.is_dir():
        raise ValueError(f"path={str(final)!r} is a folder: give a file path such as "
                         f"{str(final / 'model.safetensors')!r}")
    entries, _aliases = _entries(model)
    sources = []
    for name, t in entries:
        h = _streamer_of(t, streamer, name)
        if h is None and closed_name(t) is not None:
            raise ValueError(f"{name!r} was streamed by a WeightStreamer that is closed: close() drops the "
                             "streamed weights; call tierstate.save_weights before WeightStreamer.close()")
        if h is None and t.is_meta:
            raise ValueError(f"{name!r} is on the meta device (it has no values): materialize the model, "
                             "or stream it with tierstate.offload_weights(..., init=...), before saving")
        sources.append(h)
    head, _ = header_bytes([(n, t.dtype, tuple(t.shape)) for n, t in entries], {"format": "pt"})
    tmp = str(final.parent / f".{final.name}.{os.getpid()}.tmp")
    # A SIGTERM under the default disposition takes the temporary file (gigabytes for a 7B
    # model) with it; an interrupt that unwinds (Ctrl-C, a handler's sys.exit) removes it
    # below, wherever between two bytecodes it lands.
    on_sigterm = remove_on_termination(tmp, what="a save_weights temporary file")
    sink = None
    try:
        sink = _Sink(tmp)
        sink.put(torch.frombuffer(bytearray(head), dtype=torch.uint8))
        for (name, t), h in zip(entries, sources):
            if t.numel() == 0:
                continue
            if h is None:
                sink.put(_as_bytes(t))
                continue
            with h.for_reading() as flat:  # the block's host image: no copy of the tensor
                sink.put(flat.view(torch.uint8))
        sink.finish()
        os.replace(tmp, final)
    except BaseException as exc:
        if sink is not None:
            sink.abort()  # removes tmp
        else:  # the interrupt came inside _Sink(), perhaps after it made the file
            remove_quietly(tmp)
        if isinstance(exc, OSError):
            raise _named(exc, final, tmp) from exc
        raise
    finally:
        on_sigterm.cancel()
    fsync_dir(str(final.parent))
    return final


def _read_header(path: Path) -> dict:
    """The header of a safetensors file, read with plain file reads (its shapes and dtypes
    decide whether loading can start before any tensor is read)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            size = os.fstat(f.fileno()).st_size
            if len(raw) < 8:
                raise ValueError(f"path={str(path)!r} is not a safetensors file: {size} bytes, shorter than the "
                                 "8-byte header length")
            (n,) = struct.unpack("<Q", raw)
            if n > size - 8:
                raise ValueError(f"path={str(path)!r} is not a safetensors file: its header length {n} is past "
                                 f"the end of the file ({size} bytes)")
            text = f.read(n)
    except OSError as exc:
        raise from_oserror(exc, str(path), None, "load_weights: read") from exc
    try:
        header = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"path={str(path)!r} is not a safetensors file: its header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError(f"path={str(path)!r} is not a safetensors file: its header is not a JSON object")
    header.pop("__metadata__", None)
    return header


def _listing(names: list[str], limit: int = 12) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def load_weights(model: nn.Module, path, *, strict: bool = True) -> LoadResult:
    """Load a safetensors file into the model, a tensor at a time.

    Each tensor is read from the file's memory map and copied into its parameter or buffer:
    a resident one in place, a streamed one through
    :meth:`tierstate.WeightStreamer.write_param` into its block's home (the streamer's
    images are written back at the end). Values are cast to the parameter's dtype, as
    ``load_state_dict`` does. Reads files written by :func:`save_weights` and by
    transformers' ``save_pretrained`` (``model.safetensors``); a tied weight present under
    any of its names counts as present.

    Nothing is copied until the whole file has been checked against the model: a shape
    mismatch raises ``ValueError`` naming every mismatched key with both shapes, and under
    ``strict=True`` so do missing keys (in the model, not in the file) and unexpected keys
    (in the file, not in the model).

    Args:
        model: the model, streamed by :func:`tierstate.offload_weights` or not.
        path: the safetensors file.
        strict: refuse missing and unexpected keys (else skip them and report them).

    Returns:
        ``LoadResult(missing_keys, unexpected_keys)``.
    """
    _check_model(model, None)
    if not isinstance(strict, bool):
        raise TypeError(f"strict={strict!r}: expected True or False")
    src = _path_arg(path, "safetensors file to read")
    header = _read_header(src)
    entries, aliases = _entries(model)
    names_of: dict[str, list[str]] = {n: [n] for n, _ in entries}
    for alias, first in aliases.items():
        names_of[first].append(alias)
    known = set(names_of) | set(aliases)
    unexpected = [k for k in header if k not in known]
    plan, missing, mismatched = [], [], []
    for name, t in entries:
        key = next((k for k in names_of[name] if k in header), None)
        if key is None:
            missing.append(name)
            continue
        shape = tuple(header[key].get("shape", ()))
        if shape != tuple(t.shape):
            mismatched.append(f"{key!r}: {list(shape)} in the file, {list(t.shape)} in the model")
            continue
        h = streamed(t)
        if h is None and t.is_meta:
            raise ValueError(f"{name!r} is on the meta device: stream the model with tierstate.offload_weights"
                             "(..., init=...) or materialize it (model.to_empty(device=...)) before loading")
        plan.append((key, t, h))
    if mismatched:
        raise ValueError(f"load_weights({str(src)!r}): shapes differ for {len(mismatched)} tensor(s): "
                         + "; ".join(mismatched[:12]) + (" ..." if len(mismatched) > 12 else "")
                         + ". The file was saved from another architecture or configuration")
    if strict and (missing or unexpected):
        parts = []
        if missing:
            parts.append(f"missing (in the model, not in the file): {_listing(missing)}")
        if unexpected:
            parts.append(f"unexpected (in the file, not in the model): {_listing(unexpected)}")
        raise ValueError(f"load_weights({str(src)!r}): " + "; ".join(parts)
                         + ". Pass strict=False to load the keys both have")
    from safetensors import safe_open  # noqa: PLC0415 - a dependency of transformers, needed only here

    streamers = []
    try:
        f_ctx = safe_open(str(src), framework="pt", device="cpu")
    except OSError as exc:
        raise from_oserror(exc, str(src), None, "load_weights: open") from exc
    except Exception as exc:  # safetensors' own error for a malformed file
        raise ValueError(f"path={str(src)!r} is not a readable safetensors file: {exc}") from None
    with f_ctx as f, torch.no_grad():
        for key, t, h in plan:
            value = f.get_tensor(key)
            if h is None:
                t.copy_(value)
                continue
            s = h.streamer
            s.write_param(t, value)
            if s not in streamers:
                streamers.append(s)
            del value
    for s in streamers:
        s.flush()
    return LoadResult(missing, unexpected)


__all__ = ["LoadResult", "load_weights", "save_weights"]
