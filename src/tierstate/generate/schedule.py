"""The block schedule: a batch of prompts as micro-batches that share each layer's weights.

For every generated token the loop is layer-major, FlexGen's order:

    for layer in layers:                       # its weights fetched once (NVMe: read ahead
        for micro_batch in micro_batches:      #  during the previous layer)
            keys/values of (layer, micro_batch) from their tier (read ahead during the previous one)
            hidden[micro_batch] = layer(hidden[micro_batch], keys/values)
            append the new keys/values to their tier (a write in flight while the next runs)

so an NVMe layer is read once per token for the whole round (``micro_batch x
num_micro_batches`` sequences), and the bytes read per generated token fall as the round
grows. Hidden states stay in host RAM (``micro_batch x tokens x hidden`` each).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from .adapters import Adapter, LayerCache, MaskSizes
from .kv_store import KVStore
from .sampling import Sampler
from .weight_store import WeightStore


@dataclass
class RoundStats:
    """What one call of :func:`run_round` did."""

    sequences: int = 0
    steps: int = 0  # tokens generated per sequence (the last step included)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    weight_read_bytes: int = 0
    kv_read_bytes: int = 0
    kv_write_bytes: int = 0
    weight_stall_seconds: float = 0.0
    kv_stall_seconds: float = 0.0
    peak: dict = field(default_factory=dict)


def _causal_mask(adapter: Adapter, batch: int, q: int, dtype, attn2d: Tensor, past: int, positions: Tensor,
                 allow_skip: bool):
    from transformers.masking_utils import create_causal_mask  # noqa: PLC0415

    return create_causal_mask(config=adapter.model.config, inputs_embeds=torch.empty((batch, q, 1), dtype=dtype),
                              attention_mask=attn2d, cache=MaskSizes(past), position_ids=positions,
                              allow_is_causal_skip=allow_skip)


def run_round(adapter: Adapter, weights: WeightStore, kv: KVStore, ids: Tensor, attn2d: Tensor, *,
              micro_sizes: list[int], max_new_tokens: int, sampler: Sampler, eos: Tensor | None, pad_token_id: int,
              allow_mask_skip: bool, dtype: torch.dtype,
              progress: Callable[[int, int], None] | None = None) -> tuple[Tensor, RoundStats]:
    """Generate up to ``max_new_tokens`` for the rows of ``ids`` (left-padded, ``attn2d`` their
    mask); returns the prompts with the new tokens appended (``[rows, prompt + steps]``)."""
    stats = RoundStats(sequences=ids.shape[0])
    L, J = len(adapter.layers), len(micro_sizes)
    bounds, start = [], 0
    for n in micro_sizes:
        bounds.append((start, start + n))
        start += n
    positions = attn2d.long().cumsum(-1) - 1
    positions = positions.masked_fill(attn2d == 0, 0)
    unfinished = torch.ones(ids.shape[0], dtype=torch.long)
    out = ids
    order = list(range(L))
    t_start = time.perf_counter()
    with torch.no_grad():
        hidden = [adapter.embed(ids[a:b], positions[a:b]).to(dtype) for a, b in bounds]
        past, q = 0, ids.shape[1]
        for step in range(max_new_tokens):
            mask = _causal_mask(adapter, ids.shape[0], q, dtype, attn2d, past, positions, allow_mask_skip)
            pos = [positions[a:b] for a, b in bounds]
            pe = [adapter.position_embeddings(hidden[j], pos[j]) for j in range(J)]
            masks = [mask[a:b] if isinstance(mask, Tensor) else mask for a, b in bounds]
            for j in range(J):  # read ahead at the last layer of the step before, unless this is the first
                kv.prefetch(j, past)
            for layer in range(L):
                image = weights.acquire(layer)
                # The next layer's KV records go into the disk's queue before the next layers'
                # weights, so they never wait behind them (kv_pool_records says why); after the
                # last layer comes layer 0 of the next step, with this step's rows added.
                if layer + 1 < L:
                    for j in range(J):
                        kv.prefetch((layer + 1) * J + j, past)
                elif step + 1 < max_new_tokens:
                    for j in range(J):
                        kv.prefetch(j, past + q)
                weights.prefetch(order[layer + 1:] + order[:layer])  # the next NVMe layers, this token's then the next's
                weights.bind(layer, image)
                for j in range(J):
                    s = layer * J + j
                    keys, values = kv.acquire(s, past)
                    if s + 1 < L * J:  # a no-op when read ahead above; else the read found no free buffer then
                        kv.prefetch(s + 1, past)
                    cache = LayerCache(keys, values, past, token_major=kv.token_major(s), scratch=kv.scratch(s))
                    hidden[j] = adapter.run_layer(layer, hidden[j], masks[j], pos[j], pe[j], cache)
                    kv.commit(s, past, q)
                weights.release(layer)
            logits = torch.cat([adapter.head(h[:, -1:, :]) for h in hidden])
            nxt = sampler(out, logits)
            if eos is not None:
                nxt = nxt * unfinished + pad_token_id * (1 - unfinished)
            out = torch.cat([out, nxt[:, None]], dim=-1)
            stats.steps = step + 1
            now = time.perf_counter()
            if step == 0:
                stats.prefill_seconds = now - t_start
            if eos is not None:
                unfinished = unfinished & ~torch.isin(nxt, eos)
            if progress is not None:
                progress(step + 1, max_new_tokens)
            if eos is not None and not unfinished.any():
                break
            if step + 1 == max_new_tokens:
                break
            past += q
            q = 1
            attn2d = torch.cat([attn2d, attn2d.new_ones((attn2d.shape[0], 1))], dim=-1)
            positions = positions[:, -1:] + 1
            hidden = [adapter.embed(nxt[a:b, None], positions[a:b]).to(dtype) for a, b in bounds]
    stats.decode_seconds = time.perf_counter() - t_start - stats.prefill_seconds
    stats.weight_read_bytes = weights.read_bytes
    stats.weight_stall_seconds = weights.stall_seconds
    stats.kv_read_bytes, stats.kv_write_bytes, stats.kv_stall_seconds = kv.read_bytes, kv.write_bytes, kv.stall_seconds
    return out, stats
