"""The manifest's own checksum and its structural check, both run before anything is loaded.

[Note: manifest checksum]
Shards carry checksums, but the manifest says where each tensor lies in them; an edit or
a damaged byte there (an offset, a dtype, a flag) would load wrong state without a shard
checksum noticing. So the manifest is checksummed too: ``manifest_checksum`` holds the
digest (the save's algorithm, crc32 by default) of the manifest's *canonical* JSON, i.e.
``json.dumps(manifest_without_that_field, sort_keys=True, separators=(",", ":"))``. The
canonical form, rather than the file's bytes, lets the file stay readable JSON that
records its own checksum; re-indenting it changes nothing, changing any value does.

The checksum is not a signature: a writer with a bug, or a person who recomputes it after
an edit, gets past it. :func:`check_manifest` therefore also checks every field's type
and range, that tensor entries agree with the per-parameter records and lie inside their
shards without overlapping; the loader then compares each entry with the shard's own
safetensors header, which the shard's checksum covers.
"""
from __future__ import annotations

import json
import math
import re

from .compressed import CODES_SUFFIXES, PART_SUFFIXES
from .durable import CorruptCheckpointError
from .format import DATA_ALIGNMENT, SHARD_PREFIX, SHARD_SUFFIX, Checksum, _DTYPE_TO_ST, dtype_name

CHECKSUM_FIELD = "manifest_checksum"

# One line of advice for every refusal of a damaged manifest.
FIX = ("the manifest is damaged or was edited; load another checkpoint, or save again from the run "
       "that wrote this one")

_DTYPES = {dtype_name(d): d for d in _DTYPE_TO_ST}
_HEX_LENGTH = {"crc32": 8, "sha256": 64}
# a state key is torch's name, or a part of compressed state ("exp_avg.codes", "exp_avg.fp8",
# "master.comp")
_STATE_KEY = rf"[A-Za-z_][A-Za-z0-9_]*(?:\.(?:{'|'.join(sfx[1:] for sfx in PART_SUFFIXES)}))?"
_TENSOR_NAME = re.compile(rf"^(?:state\.(0|[1-9][0-9]*)\.({_STATE_KEY})|param\.(0|[1-9][0-9]*))$")
# the integer parts of compressed state (tierstate.checkpoint.compressed); other state is floating point
_PART_DTYPES = {**{sfx: "uint8" for sfx in CODES_SUFFIXES}, ".comp": "int16"}


def canonical_bytes(manifest: dict) -> bytes:
    """The bytes ``manifest_checksum`` is computed over (see the note at the top)."""
    body = {k: v for k, v in manifest.items() if k != CHECKSUM_FIELD}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def seal(manifest: dict, algorithm: str) -> dict:
    """``manifest`` as it reads back from JSON, with its ``manifest_checksum`` added.

    The round trip makes what is checksummed equal to what a reader will parse (tuples
    become lists, integer keys of ``extra`` become strings).
    """
    body = json.loads(json.dumps({k: v for k, v in manifest.items() if k != CHECKSUM_FIELD}))
    csum = Checksum(algorithm)
    csum.update(canonical_bytes(body))
    return {**body, CHECKSUM_FIELD: {"algorithm": algorithm, "value": csum.hexdigest()}}


def verify_checksum(manifest: dict, file: str) -> None:
    """Raise CorruptCheckpointError unless ``manifest_checksum`` matches the manifest's content."""
    record = manifest.get(CHECKSUM_FIELD)
    if record is None:
        raise CorruptCheckpointError(f"the manifest has no {CHECKSUM_FIELD} (format version "
                                     f"{manifest.get('version')} records one); {FIX}", file)
    if not isinstance(record, dict) or set(record) != {"algorithm", "value"} \
            or record["algorithm"] not in Checksum.ALGORITHMS or not isinstance(record["value"], str):
        raise CorruptCheckpointError(f"manifest field {CHECKSUM_FIELD} = {_short(record)}: expected "
                                     f"{{'algorithm': one of {Checksum.ALGORITHMS}, 'value': hex string}}; {FIX}", file)
    csum = Checksum(record["algorithm"])
    csum.update(canonical_bytes(manifest))
    if csum.hexdigest() != record["value"]:
        raise CorruptCheckpointError(f"manifest checksum mismatch: the content has {record['algorithm']} "
                                     f"{csum.hexdigest()}, {CHECKSUM_FIELD} records {record['value']}; {FIX}", file)


def corrupt(file: str, where: str, value, why: str) -> CorruptCheckpointError:
    """The error for manifest field ``where`` holding ``value``, which is wrong because ``why``."""
    return _Checker(file).fail(where, value, why)


def _short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Checker:
    def __init__(self, file: str) -> None:
        self.file = file

    def fail(self, where: str, value, why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"manifest field {where} = {_short(value)}: {why}; {FIX}", self.file)

    def typed(self, where: str, value, kind, what: str):
        kinds = kind if isinstance(kind, tuple) else (kind,)
        # bool is an int to isinstance; a flag where a count belongs is an error all the same
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            raise self.fail(where, value, f"expected {what}")
        return value

    def count(self, where: str, value, low: int = 0) -> int:
        self.typed(where, value, int, f"an integer >= {low}")
        if value < low:
            raise self.fail(where, value, f"expected an integer >= {low}")
        return value

    def keys(self, where: str, record: dict, required: set, optional: frozenset = frozenset()) -> None:
        missing = sorted(required - set(record))
        if missing:
            raise self.fail(where, sorted(record), f"lacks {missing[0]!r}")
        unknown = sorted(set(record) - required - optional)
        if unknown:
            raise self.fail(f"{where}[{unknown[0]!r}]", record[unknown[0]], "unknown field (not written by "
                            "this format version)")

    def dtype(self, where: str, value) -> str:
        if value not in _DTYPES:
            raise self.fail(where, value, f"expected a dtype name among {sorted(_DTYPES)}")
        return value

    def shape(self, where: str, value) -> tuple:
        self.typed(where, value, list, "a list of dimension sizes")
        for i, d in enumerate(value):
            self.count(f"{where}[{i}]", d)
        return tuple(value)


_TOP = {"format", "version", "optimizer", "optimizer_module", "param_groups", "params", "placement", "has_params",
        "shards", "tensors", "extra", "writer", "torch_version", "created"}
_COUNTERS = frozenset({"step_count", "skipped_steps"})  # written for tierstate optimizers
# other_state: entries of optimizer.state that are not a parameter's, written when there are any
_TOP_OPTIONAL = _COUNTERS | {"other_state"}
_PARAM = {"index", "group", "shape", "dtype", "initialized", "step", "state"}
_PARAM_OPTIONAL = frozenset({"quant_block"})  # compressed state: elements per scale of a ".scale" key
_SHARD = {"file", "bytes", "data_offset", "checksum"}
_ENTRY = {"shard", "dtype", "shape", "data_offsets"}


def check_manifest(m: dict, file: str, *, with_checksum: bool = True) -> None:
    """Check every field of a parsed manifest for type, range and internal consistency.

    Raises :class:`CorruptCheckpointError` (naming ``file`` and the first bad field) on
    anything :func:`tierstate.checkpoint.save_optimizer` cannot have written. Whether the
    checkpoint fits a given optimizer is the loader's separate question.
    """
    c = _Checker(file)
    c.keys("manifest", m, _TOP | ({CHECKSUM_FIELD} if with_checksum else set()), _TOP_OPTIONAL)
    for key in ("optimizer", "optimizer_module", "writer", "torch_version"):
        c.typed(key, m[key], str, "a string")
    c.typed("created", m["created"], (int, float), "a number")
    c.typed("has_params", m["has_params"], bool, "true or false")
    c.typed("placement", m["placement"], (dict, type(None)), "an object or null")
    for key in _COUNTERS & set(m):
        c.count(key, m[key])
    if "other_state" in m:
        from .other_state import decode_entries  # noqa: PLC0415 - it builds on this module

        decode_entries(m["other_state"], file)

    # param_groups: each holds the next parameters, in order, as optimizer.state_dict() numbers them
    groups = c.typed("param_groups", m["param_groups"], list, "a list of parameter groups")
    params = c.typed("params", m["params"], list, "a list of per-parameter records")
    member = []
    for gi, g in enumerate(groups):
        c.typed(f"param_groups[{gi}]", g, dict, "an object")
        if "params" not in g:
            raise c.fail(f"param_groups[{gi}]", sorted(g), "lacks 'params'")
        ids = c.typed(f"param_groups[{gi}]['params']", g["params"], list, "a list of parameter indices")
        for j, idx in enumerate(ids):
            if not isinstance(idx, int) or isinstance(idx, bool) or idx != len(member):
                raise c.fail(f"param_groups[{gi}]['params'][{j}]", idx,
                             f"expected {len(member)} (parameters are numbered in group order)")
            member.append(gi)
    if len(member) != len(params):
        raise c.fail("params", f"<{len(params)} records>", f"param_groups hold {len(member)} parameters")

    for i, rec in enumerate(params):
        where = f"params[{i}]"
        c.typed(where, rec, dict, "an object")
        c.keys(where, rec, _PARAM, _PARAM_OPTIONAL)
        if "quant_block" in rec:
            qb = c.count(f"{where}['quant_block']", rec["quant_block"], low=1)
            if qb & (qb - 1):
                raise c.fail(f"{where}['quant_block']", qb, "expected a power of two")
        if c.count(f"{where}['index']", rec["index"]) != i:
            raise c.fail(f"{where}['index']", rec["index"], f"expected {i} (records are in parameter order)")
        if c.count(f"{where}['group']", rec["group"]) != member[i]:
            raise c.fail(f"{where}['group']", rec["group"], f"param_groups put parameter {i} in group {member[i]}")
        c.shape(f"{where}['shape']", rec["shape"])
        c.dtype(f"{where}['dtype']", rec["dtype"])
        init = c.typed(f"{where}['initialized']", rec["initialized"], bool, "true or false")
        state = c.typed(f"{where}['state']", rec["state"], dict, "an object of state key -> dtype name")
        for key, dt in state.items():
            if not re.fullmatch(_STATE_KEY, key):
                raise c.fail(f"{where}['state']", key, "expected state keys that are identifiers (or parts of "
                             "compressed state: '<key>.codes', '<key>.fp8', '<key>.scale', 'master.comp')")
            c.dtype(f"{where}['state'][{key!r}]", dt)
            part = next((sfx for sfx in _PART_DTYPES if key.endswith(sfx)), None)
            if part is not None and dt != _PART_DTYPES[part]:
                raise c.fail(f"{where}['state'][{key!r}]", dt, f"a '{part}' part is {_PART_DTYPES[part]}")
            if part is None and not _DTYPES[dt].is_floating_point:
                raise c.fail(f"{where}['state'][{key!r}]", dt, "optimizer state is floating point")
            if key.endswith(".scale") and "quant_block" not in rec:
                raise c.fail(where, sorted(rec), f"state {key!r} is per block, and the record has no 'quant_block'")
        step = rec["step"]
        if step is not None:
            c.typed(f"{where}['step']", step, (int, float), "a number or null")
            if not math.isfinite(step) or step < 0 or step != int(step):
                raise c.fail(f"{where}['step']", step, "expected a whole number >= 0 (a step count)")
        if not init and (state or step is not None):
            raise c.fail(f"{where}['initialized']", init, f"but the record has state {sorted(state)} and step {step}")

    shards = c.typed("shards", m["shards"], list, "a list of shard records")
    files = set()
    for si, sh in enumerate(shards):
        where = f"shards[{si}]"
        c.typed(where, sh, dict, "an object")
        c.keys(where, sh, _SHARD)
        name = c.typed(f"{where}['file']", sh["file"], str, "a file name")
        if "/" in name or "\\" in name or not (name.startswith(SHARD_PREFIX) and name.endswith(SHARD_SUFFIX)) \
                or name in files:
            raise c.fail(f"{where}['file']", name, f"expected a distinct '{SHARD_PREFIX}*{SHARD_SUFFIX}' name in "
                         "the checkpoint's directory")
        files.add(name)
        size = c.count(f"{where}['bytes']", sh["bytes"])
        off = c.count(f"{where}['data_offset']", sh["data_offset"], low=8)
        if off % DATA_ALIGNMENT or off > size:
            raise c.fail(f"{where}['data_offset']", off, f"expected a multiple of {DATA_ALIGNMENT} within the "
                         f"shard's {size} bytes")
        ck = c.typed(f"{where}['checksum']", sh["checksum"], dict, "an object")
        c.keys(f"{where}['checksum']", ck, {"algorithm", "value"})
        if ck["algorithm"] not in _HEX_LENGTH:
            raise c.fail(f"{where}['checksum']['algorithm']", ck["algorithm"], f"expected one of {sorted(_HEX_LENGTH)}")
        v = ck["value"]
        if not isinstance(v, str) or len(v) != _HEX_LENGTH[ck["algorithm"]] or not re.fullmatch(r"[0-9a-f]+", v):
            raise c.fail(f"{where}['checksum']['value']", v, f"expected {_HEX_LENGTH[ck['algorithm']]} hex digits")

    tensors = c.typed("tensors", m["tensors"], dict, "an object of tensor name -> entry")
    placed = [[] for _ in shards]
    for name, e in tensors.items():
        where = f"tensors[{name!r}]"
        match = _TENSOR_NAME.match(name)
        if not match:
            raise c.fail("tensors", name, "expected tensor names 'state.<index>.<key>' or 'param.<index>'")
        index = int(match.group(1) or match.group(3))
        if index >= len(params):
            raise c.fail("tensors", name, f"names parameter {index}; the checkpoint has {len(params)}")
        rec, key = params[index], match.group(2)
        if key is not None:
            if not rec["initialized"] or key not in rec["state"]:
                raise c.fail("tensors", name, f"params[{index}] (initialized={rec['initialized']}) records state "
                             f"{sorted(rec['state'])}, not {key!r}")
            want_dtype = rec["state"][key]
        else:
            if not m["has_params"]:
                raise c.fail("tensors", name, "the manifest says has_params=false")
            want_dtype = rec["dtype"]
        c.typed(where, e, dict, "an object")
        c.keys(where, e, _ENTRY)
        si = c.count(f"{where}['shard']", e["shard"])
        if si >= len(shards):
            raise c.fail(f"{where}['shard']", si, f"the manifest lists {len(shards)} shards")
        dt = _DTYPES[c.dtype(f"{where}['dtype']", e["dtype"])]
        if e["dtype"] != want_dtype:
            raise c.fail(f"{where}['dtype']", e["dtype"], f"params[{index}] records {want_dtype}")
        want_shape = tuple(rec["shape"])
        if key is not None and key.endswith(".scale"):  # one scale per block of quant_block elements
            want_shape = (-(-math.prod(want_shape) // rec["quant_block"]),)
        if c.shape(f"{where}['shape']", e["shape"]) != want_shape:
            raise c.fail(f"{where}['shape']", e["shape"], f"params[{index}] records shape {rec['shape']}"
                         + (f" and quant_block {rec['quant_block']}: {list(want_shape)} expected" if key and
                            key.endswith(".scale") else ""))
        offs = c.typed(f"{where}['data_offsets']", e["data_offsets"], list, "[begin, end]")
        if len(offs) != 2:
            raise c.fail(f"{where}['data_offsets']", offs, "expected [begin, end]")
        begin = c.count(f"{where}['data_offsets'][0]", offs[0])
        end = c.count(f"{where}['data_offsets'][1]", offs[1])
        numel = math.prod(e["shape"])
        region = shards[si]["bytes"] - shards[si]["data_offset"]
        if end - begin != numel * dt.itemsize or begin % dt.itemsize or end > region:
            raise c.fail(f"{where}['data_offsets']", offs, f"expected {numel} x {dt.itemsize} bytes at a multiple of "
                         f"{dt.itemsize} within the {region}-byte data region of shard {si}")
        placed[si].append((begin, end, name))
    for si, entries in enumerate(placed):
        entries.sort()
        for (_, end_a, a), (begin_b, _, b) in zip(entries, entries[1:]):
            if begin_b < end_a:
                raise c.fail(f"tensors[{b!r}]['data_offsets']", tensors[b]["data_offsets"],
                             f"overlaps {a!r} in shard {si}")

    for i, rec in enumerate(params):
        for key in sorted(rec["state"]) if rec["initialized"] else ():
            if f"state.{i}.{key}" not in tensors:
                raise c.fail("tensors", f"<no 'state.{i}.{key}'>", f"params[{i}] records state {key!r}")
        if m["has_params"] and f"param.{i}" not in tensors:
            raise c.fail("tensors", f"<no 'param.{i}'>", "the manifest says has_params=true")
