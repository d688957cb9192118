"""Entries of ``optimizer.state`` whose key is not a parameter, carried in a checkpoint's manifest.

torch's ``state_dict`` carries an entry of ``optimizer.state`` keyed by something other than a
parameter (a hook's ``optimizer.state["test"] = 1``) as it is, and its ``load_state_dict``
puts it back, dropping the ones the dict does not hold. :func:`tierstate.save_optimizer` and
:func:`tierstate.load_optimizer` do the same through the manifest's optional field
``other_state``: a list of ``[key, value]`` pairs in saved order, each key and value encoded
as JSON by :func:`encode`:

- ``None``, ``bool``, ``int``, ``str`` and finite ``float`` as themselves;
- a non-finite float as ``{"float": "inf" | "-inf" | "nan"}`` (strict JSON has none);
- ``{"list": [...]}``, ``{"tuple": [...]}``, ``{"dict": [[key, value], ...]}`` (any
  hashable keys, in order);
- a tensor as ``{"tensor": {"dtype", "shape", "data"}}``: its values in row-major order,
  little-endian, base64; loaded on the CPU, without ``requires_grad``. The dtypes are a
  checkpoint's (:data:`tierstate.checkpoint.format._DTYPE_TO_ST`).

Anything else (a set, bytes, a complex tensor, an object) is refused by the save before it
writes a byte, naming the entry: silently dropping it is what this module exists to avoid.
These entries are meant to be small (flags, counters, a few numbers): they sit in the JSON
manifest, which is read whole, at 4/3 of their bytes. The field is written only when there
are entries, so other checkpoints stay readable by versions that predate it.
"""
from __future__ import annotations

import base64
import math
import sys

import torch

from .format import _DTYPE_TO_ST, dtype_name
from .manifest import corrupt
from .torch_hooks import entries_not_of_parameters

FIELD = "other_state"

_DTYPES = {dtype_name(d): d for d in _DTYPE_TO_ST}
_NON_FINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}
_TAGS = ("float", "list", "tuple", "dict", "tensor")


def encode_entries(opt: torch.optim.Optimizer) -> list:
    """``opt``'s entries that are not a parameter's state, as the manifest field holds them
    (``[]`` if none). Raises ``TypeError`` naming the first one that cannot be encoded."""
    return [[encode(key, "a key of optimizer.state"), encode(value, f"optimizer.state[{key!r}]")]
            for key, value in entries_not_of_parameters(opt).items()]


def encode(value, where: str):
    """``value`` as JSON (see the module's note); ``where`` names it in the error."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return {"float": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    if isinstance(value, (list, tuple)):
        tag = "list" if isinstance(value, list) else "tuple"
        return {tag: [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, dict):
        return {"dict": [[encode(k, f"a key of {where}"), encode(v, f"{where}[{k!r}]")] for k, v in value.items()]}
    if isinstance(value, torch.Tensor):
        return {"tensor": _encode_tensor(value, where)}
    raise TypeError(f"{where} is a {type(value).__name__}, which a tierstate checkpoint cannot hold (it holds "
                    "None, bool, int, float, str, lists, tuples, dicts and real tensors); store it another way, "
                    "e.g. in save_optimizer(..., extra=...), or remove it from optimizer.state before saving")


def _encode_tensor(t: torch.Tensor, where: str) -> dict:
    if t.dtype not in _DTYPE_TO_ST:
        raise TypeError(f"{where} is a tensor of dtype {t.dtype}, which a tierstate checkpoint cannot hold "
                        f"(supported: {', '.join(_DTYPES)}); convert it (e.g. torch.view_as_real) or remove it "
                        "from optimizer.state before saving")
    if t.layout is not torch.strided:
        raise TypeError(f"{where} is a {t.layout} tensor; a tierstate checkpoint holds dense tensors "
                        "(save t.to_dense())")
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    if sys.byteorder != "little" and flat.element_size() > 1:
        flat = flat.view(torch.uint8).reshape(-1, flat.element_size()).flip(1).reshape(-1)
    raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "data": base64.b64encode(raw).decode("ascii")}


def decode_entries(records, file: str) -> dict:
    """The entries of ``records`` (the manifest field) as a dict, in order. Raises
    :class:`~tierstate.checkpoint.durable.CorruptCheckpointError` naming the first malformed one."""
    if not isinstance(records, list):
        raise corrupt(file, FIELD, records, "expected a list of [key, value] pairs")
    out = {}
    for i, pair in enumerate(records):
        where = f"{FIELD}[{i}]"
        if not isinstance(pair, list) or len(pair) != 2:
            raise corrupt(file, where, pair, "expected a [key, value] pair")
        key = decode(pair[0], f"{where}[0]", file)
        try:
            hash(key)
        except TypeError:
            raise corrupt(file, f"{where}[0]", pair[0], "a key must be hashable") from None
        if isinstance(key, torch.Tensor):
            raise corrupt(file, f"{where}[0]", pair[0], "a tensor key is a parameter, whose state is not here")
        if key in out:
            raise corrupt(file, f"{where}[0]", pair[0], "the key appears twice")
        out[key] = decode(pair[1], f"{where}[1]", file)
    return out


def decode(value, where: str, file: str):
    """The inverse of :func:`encode`."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise corrupt(file, where, value, 'a non-finite float is written as {"float": "inf"}')
        return value
    if not isinstance(value, dict) or len(value) != 1 or next(iter(value)) not in _TAGS:
        raise corrupt(file, where, value, f"expected a JSON scalar or an object with one key among {list(_TAGS)}")
    tag, body = next(iter(value.items()))
    if tag == "float":
        if body not in _NON_FINITE:
            raise corrupt(file, where, value, f"expected one of {sorted(_NON_FINITE)}")
        return _NON_FINITE[body]
    if tag in ("list", "tuple"):
        if not isinstance(body, list):
            raise corrupt(file, where, value, "expected a list of items")
        items = [decode(v, f"{where}[{i}]", file) for i, v in enumerate(body)]
        return items if tag == "list" else tuple(items)
    if tag == "dict":
        if not isinstance(body, list) or any(not isinstance(p, list) or len(p) != 2 for p in body):
            raise corrupt(file, where, value, "expected a list of [key, value] pairs")
        out = {}
        for i, (k, v) in enumerate(body):
            key = decode(k, f"{where}[{i}][0]", file)
            try:
                out[key] = decode(v, f"{where}[{i}][1]", file)
            except TypeError:
                raise corrupt(file, f"{where}[{i}][0]", k, "a key must be hashable") from None
        return out
    return _decode_tensor(body, where, file)


def _decode_tensor(body, where: str, file: str) -> torch.Tensor:
    if not isinstance(body, dict) or set(body) != {"dtype", "shape", "data"}:
        raise corrupt(file, where, body, "expected a tensor's {'dtype', 'shape', 'data'}")
    dtype = _DTYPES.get(body["dtype"])
    if dtype is None:
        raise corrupt(file, f"{where}['dtype']", body["dtype"], f"expected one of {list(_DTYPES)}")
    shape = body["shape"]
    if not isinstance(shape, list) or any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in shape):
        raise corrupt(file, f"{where}['shape']", shape, "expected a list of sizes >= 0")
    try:
        raw = base64.b64decode(body["data"], validate=True) if isinstance(body["data"], str) else None
    except ValueError:
        raw = None
    if raw is None:
        raise corrupt(file, f"{where}['data']", body["data"], "expected base64 text")
    numel = math.prod(shape)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if len(raw) != numel * itemsize:
        raise corrupt(file, where, {"shape": shape, "dtype": body["dtype"]},
                      f"its data holds {len(raw)} bytes, the shape and dtype {numel * itemsize}")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    if sys.byteorder != "little" and itemsize > 1:
        flat = flat.reshape(-1, itemsize).flip(1).reshape(-1).clone()
    return flat.view(dtype).reshape(shape)


__all__ = ["FIELD", "decode_entries", "encode_entries"]
