"""load_optimizer: check, verify, then stream a checkpoint into an optimizer's tiers.

Nothing is applied until the checkpoint is known to fit and to be intact: (1) the
manifest's own checksum and every field of it are checked (:mod:`.manifest`), then it is
compared with the optimizer (same class, parameters of the same shapes and dtypes, state
keys the rule expects, hyper-parameters the optimizer's constructor would accept), the
first difference a ``ValueError``; (2) every shard's size and checksum are verified and
its safetensors header compared with the manifest (one streamed read each); only then
(3) the shards are read again and their tensors written, piece by piece, into whatever
tiers the optimizer has now. The placement of the saving run does not matter: a
checkpoint saved with ``offload="cpu"`` loads into ``offload="nvme"`` and back.

[Note: verify, then read again]
Step (2) reads every shard once more than a load strictly needs, rather than staging
the state: a staged copy would need the state's size again in RAM or on disk (what the
checkpoint exists to avoid), where two reads need the same 2 x 8 MiB of buffers whatever
the size. The price, measured on a 100 M-parameter AdamW checkpoint (1.2 GB in 4 shards,
O_DIRECT reads, a shared 2-core VM, 4 loads): the verifying read took 2.6-3.4 s of
loads of 8.9-12.2 s, so a load takes 1.3-1.5x as long as one reading each shard once.
The second read is checksummed too; a shard rewritten between the two reads (nothing in
tierstate rewrites a shard: each save writes new files) is reported as such, the only
refusal that comes after something was applied.
"""
from __future__ import annotations

import inspect
import json
import os
from typing import Any

import torch

from ..io.errors import from_oserror
from .access import access_for, store_of
from .durable import CorruptCheckpointError, aligned_buffer, file_size, read_chunks
from .format import (FORMAT_NAME, MANIFEST_NAME, READABLE_VERSIONS, Checksum, dtype_from_name,
                     dtype_to_safetensors, parse_header)
from .manifest import CHECKSUM_FIELD, FIX, check_manifest, corrupt, verify_checksum
from .other_state import FIELD as OTHER_STATE, decode_entries
from .torch_hooks import entries_not_of_parameters
from .save import DEFAULT_BUFFER_BYTES


def read_manifest(path: str | os.PathLike) -> dict:
    """The manifest of the checkpoint in directory ``path`` (a dict), checked.

    Its own checksum and the type, range and consistency of every field are verified
    (:func:`tierstate.checkpoint.manifest.check_manifest`); whether it fits a given
    optimizer is :func:`load_optimizer`'s question.

    Raises:
        FileNotFoundError: no ``manifest.json`` in ``path``.
        CorruptCheckpointError: the manifest is not valid JSON, its checksum does not
            match, or a field is malformed (the message names the field).
        ValueError: a format version this tierstate cannot read.
    """
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
    sealed = CHECKSUM_FIELD in manifest
    if sealed:  # first: an edited version number must not choose which checks run
        verify_checksum(manifest, file)
    version = manifest.get("version")
    if version not in READABLE_VERSIONS:
        raise ValueError(f"{file}: checkpoint format version {version!r}; this tierstate reads "
                         f"versions {list(READABLE_VERSIONS)} (upgrade tierstate to load it)")
    if version >= 2 and not sealed:
        verify_checksum(manifest, file)  # raises: version 2 manifests carry a checksum
    check_manifest(manifest, file, with_checksum=version >= 2)
    return manifest


def _from_json(value: Any, like: Any) -> Any:
    if isinstance(value, dict) and "__tensor__" in value:
        if set(value) != {"__tensor__", "dtype"} or isinstance(value["__tensor__"], (bool, str, list, dict)):
            raise ValueError(f"expected {{'__tensor__': number, 'dtype': name}}, got {value!r}")
        return torch.tensor(value["__tensor__"], dtype=dtype_from_name(value["dtype"]))
    if isinstance(value, dict) and "__dtype__" in value:
        return dtype_from_name(value["__dtype__"])
    if isinstance(value, list):
        items = [_from_json(v, None) for v in value]
        return tuple(items) if isinstance(like, tuple) or like is None else items
    return value


def _validate_group(opt, group: dict) -> None:
    """Raise as the optimizer's constructor would for these hyper-parameters.

    A tierstate optimizer: its rule's ``validate``, the function ``add_param_group`` runs.
    Another ``torch.optim.Optimizer``: its constructor itself, over a one-element tensor,
    with the group's values for the arguments it takes.
    """
    if store_of(opt) is not None:
        opt.rule.validate(group)
        return
    takes = inspect.signature(type(opt).__init__).parameters
    kwargs = {k: v for k, v in group.items() if k in takes and k not in ("self", "params")}
    required = [n for n, a in takes.items() if n not in ("self", "params") and a.default is inspect.Parameter.empty
                and a.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
    if any(n not in kwargs for n in required):
        return  # a constructor that needs more than the group holds (a user's class): nothing to check it with
    type(opt)([torch.zeros(1, requires_grad=True)], **kwargs)


def _checked_groups(opt, manifest: dict, file: str) -> list[dict]:
    """The saved param_groups decoded and validated as ``opt``'s constructor would; nothing applied."""
    groups = []
    for gi, (saved, current) in enumerate(zip(manifest["param_groups"], opt.param_groups)):
        group = {}
        for key, value in saved.items():
            if key == "params":
                continue
            try:
                group[key] = _from_json(value, current.get(key))
            except (TypeError, ValueError, RuntimeError) as exc:
                raise corrupt(file, f"param_groups[{gi}][{key!r}]", value, f"not a hyper-parameter value ({exc})") \
                    from None
        # torch's own optimizers fill keys a group lacks in __setstate__ (a tierstate checkpoint
        # has no 'foreach' or 'capturable'); a tierstate rule reads every key of its defaults
        # (the rule's, not opt.defaults, to which torch's load_state_dict adds 'differentiable')
        needed = opt.rule.required_keys() if store_of(opt) is not None else {}
        missing = sorted(set(needed) - set(group))
        if missing:
            raise ValueError(f"{file}: param_groups[{gi}] lacks {missing[0]!r}, which {type(opt).__name__} needs "
                             f"(its default is {needed[missing[0]]!r}); nothing was loaded. {FIX}")
        if store_of(opt) is not None:
            # as load_state_dict: torch's implementation switches (fused=True of a torch run saved
            # with save_optimizer) say how torch computed, not what; they become this optimizer's
            group = opt.loaded_group(group)
        try:
            _validate_group(opt, {**group, "params": current["params"]})
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{file}: param_groups[{gi}] of the checkpoint is refused, as "
                            f"{type(opt).__name__}(...) would refuse it: {exc}; nothing was loaded. {FIX}") from None
        groups.append({**group, "params": saved["params"]})
    return groups


def _check_compatible(opt, access, manifest: dict, file: str) -> list[dict]:
    """Raise ValueError at the first difference between the checkpoint and ``opt``; return its groups."""
    saved_cls, ours = manifest["optimizer"], type(opt).__name__
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
    if len(manifest["params"]) != len(infos):
        raise ValueError(f"{file} has {len(manifest['params'])} parameters; this optimizer has {len(infos)}")
    groups = _checked_groups(opt, manifest, file)
    needs_step = store_of(opt) is not None and opt.rule.has_step
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
        if needs_step and rec["step"] is None:
            raise corrupt(file, f"params[{i}]['step']", None, f"{ours} keeps a step count for every parameter "
                          "with state, and the record has state")
        access.check_format(i, rec, file)
        required, allowed = access.state_keys_for(i, groups[rec["group"]])
        saved_keys = set(rec["state"])
        for key in sorted(required - saved_keys):
            raise ValueError(f"{file} does not match this optimizer: parameter {i} needs state {key!r}, which the "
                             f"checkpoint lacks (it has {sorted(saved_keys)})")
        for key in sorted(saved_keys - allowed if allowed is not None else ()):
            raise ValueError(f"{file} does not match this optimizer: parameter {i} has state {key!r} in the checkpoint, "
                             f"which {ours} with these hyper-parameters does not keep (it keeps {sorted(required)})")
    return groups


def _shard_entries(manifest: dict) -> list[list[tuple[int, int, str, torch.dtype]]]:
    """Per shard: (begin, end, tensor name, dtype) sorted by position."""
    per = [[] for _ in manifest["shards"]]
    for name, e in manifest["tensors"].items():
        b, en = e["data_offsets"]
        per[e["shard"]].append((b, en, name, dtype_from_name(e["dtype"])))
    return [sorted(p) for p in per]


def _verify(directory: str, si: int, shard: dict, tensors: dict, buffers) -> None:
    """Check shard ``si``'s size and checksum, then its safetensors header against the manifest."""
    path = os.path.join(directory, shard["file"])
    algo, want = shard["checksum"]["algorithm"], shard["checksum"]["value"]
    size = file_size(path)
    if size != shard["bytes"]:
        raise CorruptCheckpointError(f"shard is {size} bytes, the manifest records {shard['bytes']} "
                                     f"({algo} {want}): the file is truncated or damaged", path)
    csum = Checksum(algo)
    head, head_len = [], shard["data_offset"]
    for off, chunk in read_chunks(path, size, buffers):
        csum.update(memoryview(chunk.numpy()))
        if off < head_len:
            head.append(bytes(chunk[: head_len - off].numpy()))
    got = csum.hexdigest()
    if got != want:
        raise CorruptCheckpointError(f"{algo} checksum mismatch: the file has {got}, the manifest records {want}: "
                                     "the file is damaged", path)
    # The header is covered by the checksum just verified: the manifest must agree with it.
    try:
        data_offset, table = parse_header(b"".join(head), path)
    except ValueError as exc:
        raise CorruptCheckpointError(f"the shard's safetensors header ends past data_offset {head_len} ({exc})",
                                     path) from None
    table.pop("__metadata__", None)
    listed = {name: e for name, e in tensors.items() if e["shard"] == si}
    for name in sorted(set(table) ^ set(listed)):
        where = "the shard holds" if name in table else "the manifest places in this shard"
        raise CorruptCheckpointError(f"tensor {name!r}, which {where}, is missing from the "
                                     f"{'manifest' if name in table else 'shard header'}; {FIX}", path)
    for name, e in listed.items():
        h = table[name]
        ours = {"dtype": dtype_to_safetensors(dtype_from_name(e["dtype"])), "shape": e["shape"],
                "data_offsets": e["data_offsets"]}
        for key, value in ours.items():
            if h.get(key) != value:
                raise CorruptCheckpointError(f"tensor {name!r}: the shard header records {key} {h.get(key)!r}, the "
                                             f"manifest {value!r}; {FIX}", path)
    if data_offset != head_len:
        raise CorruptCheckpointError(f"the shard's data starts at byte {data_offset}, the manifest records "
                                     f"data_offset {head_len}; {FIX}", path)


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
                kind, index, *key = name.split(".", 2)  # a part: "state.0.exp_avg.codes"
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
    (``param_groups``) and per-parameter steps are restored as ``load_state_dict`` does, and
    so are the saved entries of ``opt.state`` whose key is not a parameter (those it held
    before the load are dropped, as torch's load drops them; tensors among them come back on
    the CPU).

    Args:
        opt: a tierstate optimizer or a ``torch.optim.Optimizer`` of the same class name
            and parameters as the one saved.
        path: the checkpoint directory.
        params: also restore the parameters' values when the checkpoint holds them.
        buffer_bytes: size of each of the two read buffers (a multiple of 4096).

    Returns:
        The ``extra`` dict given to :func:`save_optimizer` (``{}`` if none).

    Raises:
        FileNotFoundError: ``path`` holds no complete checkpoint, or a shard is missing.
        ValueError: the checkpoint does not fit ``opt``; the message names the first
            mismatching parameter/state, with the expected and found shape/dtype. Also
            (or ``TypeError``) for saved hyper-parameters ``opt``'s constructor would refuse.
        CorruptCheckpointError: (an ``OSError``, errno ``EIO``) the manifest's checksum or
            a field of it is wrong, or a shard's size, checksum or header; the message
            names the file and the field or checksum.

    On every refusal ``opt`` is left exactly as it was: all of the above is checked before
    the first byte is applied. Only a failure while applying (an I/O error of the
    optimizer's own NVMe tier, a shard rewritten since it was verified) leaves it partly
    loaded, and says so.
    """
    if not isinstance(buffer_bytes, int) or buffer_bytes < 4096 or buffer_bytes % 4096:
        raise ValueError(f"buffer_bytes={buffer_bytes!r}: must be a positive multiple of 4096 (e.g. 8 << 20)")
    directory = os.path.abspath(os.fspath(path))
    manifest = read_manifest(directory)
    file = os.path.join(directory, MANIFEST_NAME)
    access = access_for(opt)
    groups = _check_compatible(opt, access, manifest, file)
    other_state = decode_entries(manifest.get(OTHER_STATE, []), file)
    buffers = [aligned_buffer(buffer_bytes), aligned_buffer(buffer_bytes)]
    for si, shard in enumerate(manifest["shards"]):
        _verify(directory, si, shard, manifest["tensors"], buffers)

    per_shard = _shard_entries(manifest)
    if not params:
        per_shard = [[e for e in entries if not e[2].startswith("param.")] for entries in per_shard]
    access.begin_load(groups)
    try:
        for shard, entries in zip(manifest["shards"], per_shard):
            _apply_shard(directory, shard, entries, access, buffers)
    except OSError as exc:  # verified a moment ago: an I/O error now, or a shard removed since
        exc.add_note(f"load_optimizer: the optimizer is partly loaded from {directory}; load a checkpoint "
                     "again before training")
        raise
    for rec in manifest["params"]:
        if rec["initialized"]:
            access.commit_param(rec["index"], set(rec["state"]), rec["step"])
    access.finish_load(manifest.get("step_count"), manifest.get("skipped_steps"))
    # torch's load leaves in optimizer.state what the dict holds, entries not of parameters included
    for key in entries_not_of_parameters(opt):
        del opt.state[key]
    opt.state.update(other_state)
    return manifest.get("extra", {})
