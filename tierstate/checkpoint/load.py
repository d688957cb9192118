"""load_optimizer: check, verify, then stream a checkpoint into an optimizer's tiers.

Nothing is applied until the checkpoint is known to fit and to be intact: (1) the
manifest is compared with the optimizer (same class, parameters of the same shapes and
dtypes, state keys the rule expects) and the first difference is a ``ValueError``;
(2) every shard's size and checksum are verified (one streamed read each); only then
(3) the shards are read again and their tensors written, piece by piece, into whatever
tiers the optimizer has now. The placement of the saving run does not matter: a
checkpoint saved with ``offload="cpu"`` loads into ``offload="nvme"`` and back.
"""
from __future__ import annotations

import json
import os
from typing import Any

import torch

from ..io.errors import from_oserror
from .access import access_for
from .durable import CorruptCheckpointError, aligned_buffer, file_size, read_chunks
from .format import FORMAT_NAME, FORMAT_VERSION, MANIFEST_NAME, Checksum, dtype_from_name
from .save import DEFAULT_BUFFER_BYTES


def read_manifest(path: str | os.PathLike) -> dict:
    """The manifest of the checkpoint in directory ``path`` (a dict), checked for format."""
    directory = os.path.abspath(os.fspath(path))
    file = os.path.join(directory, MANIFEST_NAME)
    try:
        with open(file, "rb") as f:
            raw = f.read()
    except OSError as exc:
        err = from_oserror(exc, file, None, "open")
        if isinstance(err, FileNotFoundError):
            err.strerror = f"no checkpoint here (no {MANIFEST_NAME}; a save that did not finish leaves none)"
        raise err from exc
    try:
        manifest = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptCheckpointError(f"manifest is not valid JSON ({exc})", file) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise CorruptCheckpointError(f"not a tierstate optimizer checkpoint manifest (format {FORMAT_NAME!r} expected)", file)
    if manifest.get("version") != FORMAT_VERSION:
        raise ValueError(f"{file}: checkpoint format version {manifest.get('version')!r}; this tierstate reads "
                         f"version {FORMAT_VERSION} (upgrade tierstate to load it)")
    return manifest


def _from_json(value: Any, like: Any) -> Any:
    if isinstance(value, dict) and "__tensor__" in value:
        return torch.tensor(value["__tensor__"], dtype=dtype_from_name(value["dtype"]))
    if isinstance(value, dict) and "__dtype__" in value:
        return dtype_from_name(value["__dtype__"])
    if isinstance(value, list):
        items = [_from_json(v, None) for v in value]
        return tuple(items) if isinstance(like, tuple) or like is None else items
    return value


def _groups_for(opt, manifest: dict) -> list[dict]:
    groups = []
    for saved, current in zip(manifest["param_groups"], opt.param_groups):
        groups.append({k: (v if k == "params" else _from_json(v, current.get(k))) for k, v in saved.items()})
    return groups


def _check_compatible(opt, access, manifest: dict, file: str) -> list[dict]:
    """Raise ValueError at the first difference between the checkpoint and ``opt``; return its groups."""
    saved_cls, ours = manifest.get("optimizer"), type(opt).__name__
    if saved_cls != ours:
        raise ValueError(f"{file} holds the state of a {saved_cls} optimizer; this one is a {ours}. Load it "
                         f"into a {saved_cls} (tierstate's and torch's classes of one name are interchangeable)")
    saved_groups = manifest["param_groups"]
    if len(saved_groups) != len(opt.param_groups):
        raise ValueError(f"{file} has {len(saved_groups)} param group(s); this optimizer has {len(opt.param_groups)}")
    for gi, (sg, g) in enumerate(zip(saved_groups, opt.param_groups)):
        if len(sg["params"]) != len(g["params"]):
            raise ValueError(f"{file}: param group {gi} has {len(sg['params'])} parameter(s) in the checkpoint, "
                             f"{len(g['params'])} in this optimizer")
    infos = access.describe()
    groups = _groups_for(opt, manifest)
    tensors = manifest["tensors"]
    for rec, info in zip(manifest["params"], infos):
        i = rec["index"]
        shape, dtype = tuple(rec["shape"]), rec["dtype"]
        ours_dtype = str(info.dtype).removeprefix("torch.")
        if shape != info.shape or dtype != ours_dtype:
            raise ValueError(f"{file} does not match this optimizer: parameter {i} (group {rec['group']}) has shape "
                             f"{shape} dtype {dtype} in the checkpoint, shape {info.shape} dtype {ours_dtype} here")
        if not rec["initialized"]:
            continue
        if not access.accepts_state(i):
            raise ValueError(f"{file}: parameter {i} has optimizer state in the checkpoint but is frozen "
                             "(requires_grad=False) in this optimizer")
        required, allowed = access.state_keys_for(i, groups[rec["group"]])
        saved_keys = set(rec["state"])
        for key in sorted(required - saved_keys):
            raise ValueError(f"{file} does not match this optimizer: parameter {i} needs state {key!r}, which the "
                             f"checkpoint lacks (it has {sorted(saved_keys)})")
        for key in sorted(saved_keys - allowed if allowed is not None else ()):
            raise ValueError(f"{file} does not match this optimizer: parameter {i} has state {key!r} in the checkpoint, "
                             f"which {ours} with these hyper-parameters does not keep (it keeps {sorted(required)})")
        for key in saved_keys:
            entry = tensors.get(f"state.{i}.{key}")
            if entry is None or tuple(entry["shape"]) != info.shape:
                found = None if entry is None else tuple(entry["shape"])
                raise ValueError(f"{file} does not match this optimizer: state {key!r} of parameter {i} has shape "
                                 f"{found} in the checkpoint, expected {info.shape}")
    if len(manifest["params"]) != len(infos):
        raise ValueError(f"{file} has {len(manifest['params'])} parameters; this optimizer has {len(infos)}")
    return groups


def _shard_entries(manifest: dict) -> list[list[tuple[int, int, str, torch.dtype]]]:
    """Per shard: (begin, end, tensor name, dtype) sorted by position."""
    per = [[] for _ in manifest["shards"]]
    for name, e in manifest["tensors"].items():
        b, en = e["data_offsets"]
        per[e["shard"]].append((b, en, name, dtype_from_name(e["dtype"])))
    return [sorted(p) for p in per]


def _verify(directory: str, shard: dict, buffers) -> None:
    path = os.path.join(directory, shard["file"])
    algo, want = shard["checksum"]["algorithm"], shard["checksum"]["value"]
    size = file_size(path)
    if size != shard["bytes"]:
        raise CorruptCheckpointError(f"shard is {size} bytes, the manifest records {shard['bytes']} "
                                     f"({algo} {want}): the file is truncated or damaged", path)
    csum = Checksum(algo)
    for _, chunk in read_chunks(path, size, buffers):
        csum.update(memoryview(chunk.numpy()))
    got = csum.hexdigest()
    if got != want:
        raise CorruptCheckpointError(f"{algo} checksum mismatch: the file has {got}, the manifest records {want}: "
                                     "the file is damaged", path)


def _apply_shard(directory: str, shard: dict, entries, access, buffers) -> None:
    path = os.path.join(directory, shard["file"])
    data_offset = shard["data_offset"]
    csum = Checksum(shard["checksum"]["algorithm"])
    cursor = 0
    for file_off, chunk in read_chunks(path, shard["bytes"], buffers):
        csum.update(memoryview(chunk.numpy()))
        d0, d1 = file_off - data_offset, file_off - data_offset + chunk.numel()
        while cursor < len(entries) and entries[cursor][1] <= d0:
            cursor += 1
        j = cursor
        while j < len(entries) and entries[j][0] < d1:
            begin, end, name, dtype = entries[j]
            lo, hi = max(begin, d0), min(end, d1)
            if hi > lo:
                values = chunk[lo - d0: hi - d0].view(dtype)
                offset = (lo - begin) // dtype.itemsize
                kind, index, *key = name.split(".")
                if kind == "param":
                    access.write_param(int(index), offset, values)
                else:
                    access.write_state(int(index), key[0], offset, values)
            j += 1
    if csum.hexdigest() != shard["checksum"]["value"]:
        raise CorruptCheckpointError(
            f"{shard['checksum']['algorithm']} checksum changed while loading (verified before, "
            f"{csum.hexdigest()} now): something rewrote the checkpoint; the optimizer state is partly loaded, "
            "load a checkpoint again before training", path)


def load_optimizer(opt: torch.optim.Optimizer, path: str | os.PathLike, *, params: bool = True,
                   buffer_bytes: int = DEFAULT_BUFFER_BYTES) -> dict:
    """Load the checkpoint in directory ``path`` (written by :func:`save_optimizer`) into ``opt``.

    The optimizer may have any placement (``offload="cpu"``, ``"nvme"``, a mix); the state
    streams into its tiers through two ``buffer_bytes`` buffers. Hyper-parameters
    (``param_groups``) and per-parameter steps are restored as ``load_state_dict`` does.

    Args:
        opt: a tierstate optimizer or a ``torch.optim.Optimizer`` of the same class name
            and parameters as the one saved.
        path: the checkpoint directory.
        params: also restore the parameters' values when the checkpoint holds them.
        buffer_bytes: size of each of the two read buffers (a multiple of 4096).

    Returns:
        The ``extra`` dict given to :func:`save_optimizer` (``{}`` if none).

    Raises:
        FileNotFoundError: ``path`` holds no complete checkpoint.
        ValueError: the checkpoint does not fit ``opt``; the message names the first
            mismatching parameter/state, with the expected and found shape/dtype.
        CorruptCheckpointError: (an ``OSError``) a shard's size or checksum is wrong; the
            message names the file and the checksum. ``opt`` is untouched in both cases.
    """
    if not isinstance(buffer_bytes, int) or buffer_bytes < 4096 or buffer_bytes % 4096:
        raise ValueError(f"buffer_bytes={buffer_bytes!r}: must be a positive multiple of 4096 (e.g. 8 << 20)")
    directory = os.path.abspath(os.fspath(path))
    manifest = read_manifest(directory)
    file = os.path.join(directory, MANIFEST_NAME)
    access = access_for(opt)
    groups = _check_compatible(opt, access, manifest, file)
    buffers = [aligned_buffer(buffer_bytes), aligned_buffer(buffer_bytes)]
    for shard in manifest["shards"]:
        _verify(directory, shard, buffers)

    per_shard = _shard_entries(manifest)
    if not params:
        per_shard = [[e for e in entries if not e[2].startswith("param.")] for entries in per_shard]
    access.begin_load(groups)
    for shard, entries in zip(manifest["shards"], per_shard):
        _apply_shard(directory, shard, entries, access, buffers)
    for rec in manifest["params"]:
        if rec["initialized"]:
            access.commit_param(rec["index"], set(rec["state"]), rec["step"])
    access.finish_load(manifest.get("step_count"), manifest.get("skipped_steps"))
    return manifest.get("extra", {})
