"""Random-init checkpoints of any size, written a tensor at a time: a 13B-parameter model's
safetensors file without 26 GB of RAM (for capacity runs and benchmarks; nothing downloaded).

Weights are ``normal(0, 0.02)`` (transformers' ``initializer_range``), norms' weights 1 and
biases 0, drawn from a generator seeded with ``seed`` so a folder can be rewritten identically.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from ..weights.export import _Sink, header_bytes
from .source import iter_aliases


def write_random_checkpoint(config, folder, *, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> Path:
    """Write ``config.json`` and ``model.safetensors`` for ``config`` into ``folder``; returns
    the safetensors path. Peak RAM: the largest tensor (in float32, then cast) and two 8 MiB
    write buffers."""
    from .adapters import build_meta  # noqa: PLC0415

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model = build_meta(config, None).model
    names = [first for first, _ in iter_aliases(model)]
    metas = dict(model.state_dict(keep_vars=True))
    specs = [(n, dtype if metas[n].dtype.is_floating_point else metas[n].dtype, tuple(metas[n].shape)) for n in names]
    head, _ = header_bytes(specs, {"format": "pt"})
    path = folder / "model.safetensors"
    if path.exists():
        path.unlink()
    sink = _Sink(str(path))
    gen = torch.Generator().manual_seed(seed)
    try:
        sink.put(torch.frombuffer(bytearray(head), dtype=torch.uint8))
        for name, dt, shape in specs:
            if name.endswith("norm.weight") or ".ln_" in name or name.endswith("ln_f.weight") \
                    or "layernorm" in name:
                t = torch.ones(shape, dtype=dt) if name.endswith("weight") else torch.zeros(shape, dtype=dt)
            elif name.endswith(".bias") or len(shape) == 1:
                t = torch.zeros(shape, dtype=dt)
            else:
                t = torch.empty(shape, dtype=torch.float32).normal_(0.0, 0.02, generator=gen).to(dt)
            sink.put(t.reshape(-1).view(torch.uint8))
            del t
        sink.finish()
    except BaseException:
        sink.abort()
        raise
    config.save_pretrained(folder)
    os.sync()
    return path
