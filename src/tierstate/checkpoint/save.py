"""save_optimizer: stream an optimizer's state into an atomic, checksummed checkpoint.

[Note: atomicity]
The manifest is the commit point. A save (1) writes each shard under a name no earlier
save used (``shard-<save id>-NNNNN.safetensors``), first as ``<name>.partial``, then fsyncs
and renames it; (2) fsyncs the directory; (3) writes ``.manifest-<save id>.tmp``, fsyncs,
renames it over ``manifest.json`` and fsyncs the directory; (4) only then deletes the
previous save's shards and any debris of crashed saves. A crash before (3) leaves the
old manifest naming the old shards, untouched; after (3) the new one naming new shards,
all durable. So ``path`` holds either the previous checkpoint or the new one, whole, at
every instant; nothing outside ``path`` is touched. One writer per ``path`` at a time.

An interrupt that unwinds (Ctrl-C's KeyboardInterrupt, a SIGTERM handler's ``sys.exit``)
can land between any two bytecodes of a save. Every file the save may create is recorded
before it exists, and is removed on the way out unless ``manifest.json`` already names
this save's shards: an interrupt after the manifest's rename (during the directory's
fsync, or the sweep) leaves the new checkpoint whole, never a manifest naming deleted
shards.

Testing aid: ``TIERSTATE_TEST_PAUSE_AT=<phase>:<marker file>`` stops a save at one of
these points (``shard-written``, ``shard-closed``, ``shards-renamed``, ``manifest-written``,
``manifest-renamed``, ``manifest-committed``, ``cleanup``; see
:data:`tierstate.checkpoint.durable.PAUSE_PHASES`): the writer records its pid in the
marker file and sleeps until killed or interrupted, so a test stops it at exactly that point.
"""
from __future__ import annotations

import json
import os
import secrets
import threading
import time
from typing import Any

import torch

from ..tiers.termination import on_termination
from .access import ParamInfo, access_for
from .durable import (ShardSink, aligned_buffer, describe_writer, fsync_dir, pause_point, remove_quietly, rename,
                      write_file_atomic)
from .format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_NAME,
    MANIFEST_TMP_PREFIX,
    PARTIAL_SUFFIX,
    SHARD_PREFIX,
    SHARD_SUFFIX,
    Checksum,
    dtype_name,
    shard_header,
)
from .manifest import seal
from .other_state import FIELD as OTHER_STATE, encode_entries

# Two 8 MiB buffers: 16 MiB of RAM per save/load whatever the state's size; 8 MiB
# requests already run sequential NVMe near full speed (peers/RESULTS.md, fio).
DEFAULT_BUFFER_BYTES = 8 << 20
# Shards of 256 MiB: few files for a 100 GB state (~400), small enough that a failed
# shard costs little to rewrite and a reader can fetch them in parallel.
DEFAULT_SHARD_BYTES = 256 << 20


def _json_value(value: Any) -> Any:
    """A hyper-parameter as JSON (tuples become lists; one-element tensors become numbers)."""
    if isinstance(value, torch.Tensor):
        return {"__tensor__": value.item(), "dtype": dtype_name(value.dtype)}
    if isinstance(value, (tuple, list)):
        return [_json_value(v) for v in value]
    if isinstance(value, torch.dtype):
        return {"__dtype__": dtype_name(value)}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"hyper-parameter value {value!r} of type {type(value).__name__} cannot be stored in "
                    "a checkpoint manifest (numbers, strings, tuples and one-element tensors can)")


def _placement(opt) -> dict | None:
    offload = getattr(opt, "offload", None)
    if offload is None:
        return None
    return {
        "gpu": offload.gpu, "cpu": offload.cpu, "nvme": offload.nvme,
        "nvme_dir": [str(d) for d in offload.nvme_dirs],
        "subgroup_numel": opt.layout.subgroup_numel,  # the size used (the offload's may be None: per placement)
        "buffer_count": offload.buffer_count, "moment_dtype": dtype_name(offload.moment_dtype),
        **({"master_dtype": dtype_name(offload.master_dtype), "quant_block": offload.quant_block}
           if offload.compressed else {}),
    }


def _plan_shards(tensors: list[tuple[str, torch.dtype, tuple, int]], shard_bytes: int) -> list[list]:
    """Group whole tensors into shards of at most ``shard_bytes`` (a larger tensor alone)."""
    shards, current, size = [], [], 0
    for entry in tensors:
        nbytes = entry[3]
        if current and size + nbytes > shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(entry)
        size += nbytes
    if current:
        shards.append(current)
    # Largest element size first inside a shard: every tensor then starts at a multiple
    # of its element size (see format.py); sorted() is stable, so order is kept otherwise.
    return [sorted(s, key=lambda e: -e[1].itemsize) for s in shards]


def _ours(name: str) -> bool:
    return (name.startswith(SHARD_PREFIX) and (name.endswith(SHARD_SUFFIX) or name.endswith(SHARD_SUFFIX + PARTIAL_SUFFIX))) \
        or name.startswith(MANIFEST_TMP_PREFIX)


def save_optimizer(opt: torch.optim.Optimizer, path: str | os.PathLike, *, params: bool = True,
                   extra: dict | None = None, shard_bytes: int = DEFAULT_SHARD_BYTES,
                   buffer_bytes: int = DEFAULT_BUFFER_BYTES, checksum: str = "crc32") -> dict:
    """Write ``opt``'s state to the checkpoint directory ``path``, atomically.

    The state is streamed shard by shard through two ``buffer_bytes`` buffers, whatever
    tier holds it (host RAM or NVMe), so a save needs ``2 * buffer_bytes`` of RAM. The
    directory then holds aligned safetensors shards and ``manifest.json`` (see
    :mod:`tierstate.checkpoint.format`). If ``path`` already holds a checkpoint it stays
    valid until the new one is complete, and is then replaced; if the save fails (disk
    full, I/O error, the process killed) the previous checkpoint is left as it was.

    Args:
        opt: a tierstate optimizer or any ``torch.optim.Optimizer``.
        path: the checkpoint directory (created if missing).
        params: also store each parameter's value, so that loading restores the model's
            weights together with the optimizer state (one atomic unit to resume from).
        extra: JSON-serialisable data of the caller (e.g. data loader position), returned
            by :func:`load_optimizer`.
        shard_bytes: the largest shard file (a tensor larger than this gets its own).
        buffer_bytes: size of each of the two I/O buffers (a multiple of 4096).
        checksum: ``"crc32"`` (default) or ``"sha256"``, one per shard.

    Returns:
        The manifest written (a dict).

    Entries of ``opt.state`` whose key is not a parameter (a hook's ``state["test"]``) are
    saved with it, as torch's ``state_dict`` carries them (:mod:`tierstate.checkpoint.other_state`).

    Raises:
        OSError: an I/O failure (e.g. :class:`tierstate.io.DiskFullError`), naming the
            file and errno; the previous checkpoint in ``path`` is intact.
        TypeError: ``extra``, or an entry of ``opt.state`` that is not a parameter's, holds
            something a checkpoint cannot (named); nothing is written.
    """
    Checksum(checksum)  # validates the name
    if not isinstance(buffer_bytes, int) or buffer_bytes < 4096 or buffer_bytes % 4096:
        raise ValueError(f"buffer_bytes={buffer_bytes!r}: must be a positive multiple of 4096 (e.g. 8 << 20)")
    if not isinstance(shard_bytes, int) or shard_bytes <= 0:
        raise ValueError(f"shard_bytes={shard_bytes!r}: must be a positive int (e.g. 256 << 20)")
    if extra is not None:
        try:
            json.dumps(extra)
        except TypeError as exc:
            raise TypeError(f"extra must be JSON-serialisable ({exc})") from None
    other_state = encode_entries(opt)  # refused here, before any file, if one cannot be held
    directory = os.path.abspath(os.fspath(path))
    access = access_for(opt)
    infos = access.describe()

    tensors = []  # (name, dtype, shape, nbytes)
    for info in infos:
        numel = _numel(info.shape)
        for key, dtype in info.keys.items():
            shape = info.key_shape(key)  # a block scale: one item per block
            tensors.append((f"state.{info.index}.{key}", dtype, shape, _numel(shape) * dtype.itemsize))
        if params:
            tensors.append((f"param.{info.index}", info.dtype, info.shape, numel * info.dtype.itemsize))
    plan = _plan_shards(tensors, shard_bytes)

    made_dir = not os.path.isdir(directory)
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        from ..io.errors import from_oserror  # noqa: PLC0415

        raise from_oserror(exc, directory, None, "mkdir") from exc
    if made_dir:
        fsync_dir(os.path.dirname(directory))

    save_id = f"{time.strftime('%Y%m%d%H%M%S')}-{secrets.token_hex(4)}"
    piece_numel = buffer_bytes // 8  # elements per read from a tier: at most one buffer of fp64
    buffers = [aligned_buffer(buffer_bytes), aligned_buffer(buffer_bytes)]
    shards, tensor_map = [], {}
    made = []  # every file this save may have created: removed unless its manifest commits
    committing = False  # True from the moment the manifest may be renamed into place

    # Signal handlers run on the main thread, between two of its bytecodes. A save on the main
    # thread is then stopped either before the manifest's rename or after it, and the manifest
    # on disk says which; a save on another thread may rename while the handler runs, so from
    # the moment it may, its files stay for the next save's sweep.
    on_main_thread = threading.current_thread() is threading.main_thread()

    def remove_uncommitted() -> None:  # a SIGTERM under the default disposition (signal handler: unlinks only)
        if committing and (not on_main_thread or _committed(directory, save_id)):
            return
        for f in list(made):
            try:
                os.unlink(f)
            except OSError:
                pass

    on_sigterm = on_termination(remove_uncommitted, "a checkpoint's uncommitted shards")
    try:
        for si, entries in enumerate(plan):
            name = f"{SHARD_PREFIX}{save_id}-{si:05d}{SHARD_SUFFIX}"
            final = os.path.join(directory, name)
            partial = final + PARTIAL_SUFFIX
            header, placed = shard_header([(n, d, s) for n, d, s, _ in entries])
            # Both names are recorded before the file exists: an exception raised by a signal
            # handler (Ctrl-C, a SIGTERM handler calling sys.exit) can land between any two
            # bytecodes, and each of these steps must be undone whichever it lands after.
            made += [partial, final]
            sink = None
            try:
                sink = ShardSink(partial, buffers, checksum)
                sink.put(torch.frombuffer(bytearray(header), dtype=torch.uint8))
                for entry in placed:
                    kind, index, *key = entry.name.split(".", 2)  # a part: "state.0.exp_avg.codes"
                    pieces = (access.read_param(int(index), piece_numel) if kind == "param"
                              else access.read_state(int(index), key[0], piece_numel))
                    for piece in pieces:
                        sink.put(piece)
                    tensor_map[entry.name] = {"shard": si, "dtype": dtype_name(entry.dtype), "shape": list(entry.shape),
                                              "data_offsets": [entry.begin, entry.end]}
                nbytes, digest = sink.finish()
                sink = None  # closed: nothing left to abort
            except BaseException:
                if sink is not None:
                    sink.abort()
                raise
            pause_point("shard-closed")
            rename(partial, final)
            shards.append({"file": name, "bytes": nbytes, "data_offset": len(header),
                           "checksum": {"algorithm": checksum, "value": digest}})
        fsync_dir(directory)
        pause_point("shards-renamed")

        manifest = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "optimizer": type(opt).__name__,
            "optimizer_module": type(opt).__module__,
            "param_groups": [{k: (v if k == "params" else _json_value(v)) for k, v in g.items()}
                             for g in _saved_groups(opt)],
            "params": [_param_record(info) for info in infos],
            **access.counters(),
            "placement": _placement(opt),
            "has_params": bool(params),
            "shards": shards,
            "tensors": tensor_map,
            "extra": extra if extra is not None else {},
            **({OTHER_STATE: other_state} if other_state else {}),
            "writer": describe_writer(),
            "torch_version": torch.__version__,
            "created": time.time(),
        }
        manifest = seal(manifest, checksum)
        body = json.dumps(manifest, indent=1).encode()
        tmp_name = f"{MANIFEST_TMP_PREFIX}{save_id}.tmp"
        made.append(os.path.join(directory, tmp_name))
        # From here on the manifest may be renamed at any instant, and its shards are then the
        # checkpoint: a SIGTERM asks the manifest on disk first (see remove_uncommitted).
        committing = True
        write_file_atomic(directory, MANIFEST_NAME, body, tmp_name)
    except BaseException as exc:
        # An interrupt can land after the manifest's rename, while the directory is being
        # fsynced: the save is committed then, and its shards are the checkpoint.
        if not _committed(directory, save_id):
            for f in made:  # shards no manifest names: give their space back now
                remove_quietly(f)
        if isinstance(exc, OSError):
            exc.add_note(f"save_optimizer: the checkpoint in {directory} was left as it was before this save")
        raise
    finally:
        on_sigterm.cancel()
    pause_point("manifest-committed")
    _sweep(directory, {s["file"] for s in shards})
    return manifest


def _committed(directory: str, save_id: str) -> bool:
    """Whether the manifest in ``directory`` is the one of save ``save_id`` (names its shards)."""
    try:
        with open(os.path.join(directory, MANIFEST_NAME), "rb") as f:
            shards = json.loads(f.read())["shards"]
        return any(s["file"].startswith(f"{SHARD_PREFIX}{save_id}-") for s in shards)
    except (OSError, ValueError, KeyError, TypeError):
        return False  # no readable manifest of ours: this save did not commit


def _sweep(directory: str, keep: set) -> None:
    """Delete the previous save's shards and debris of crashed saves (ours only)."""
    removed = False
    for name in os.listdir(directory):
        if _ours(name) and name not in keep:
            if removed:
                pause_point("cleanup")
            remove_quietly(os.path.join(directory, name))
            removed = True
    if removed:
        fsync_dir(directory)


def _saved_groups(opt) -> list[dict]:
    """param_groups with ``params`` as indices, as in ``optimizer.state_dict()``."""
    out, start = [], 0
    for g in opt.param_groups:
        saved = {k: v for k, v in g.items() if k != "params"}
        saved["params"] = list(range(start, start + len(g["params"])))
        start += len(g["params"])
        out.append(saved)
    return out


def _param_record(info: ParamInfo) -> dict:
    return {"index": info.index, "group": info.group, "shape": list(info.shape), "dtype": dtype_name(info.dtype),
            "initialized": info.initialized, "step": info.step,
            "state": {k: dtype_name(d) for k, d in info.keys.items()},
            **({"quant_block": info.quant_block} if info.quant_block else {})}


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
