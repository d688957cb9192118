"""Model adapters: how the block schedule drives a transformers causal LM one decoder layer
at a time.

The layers themselves are transformers' own modules (``GPT2Block``, ``LlamaDecoderLayer``),
built on the meta device and given their weights only while they run (views into the layer's
host image). Attention, masks and rotary embeddings are therefore transformers' code, which
is what makes the tokens identical to ``model.generate`` of the resident model: only the
embedding, the layer loop and the head are re-driven here.

A layer gets a :class:`LayerCache` instead of a ``transformers.Cache``: the one method a
layer calls, ``update(key, value, layer_idx)``, appends the new keys and values to the
micro-batch's cache rows (host RAM or a buffer read from NVMe) and returns all of them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

SUPPORTED = ("gpt2", "llama")


class MaskSizes:
    """What ``transformers.masking_utils.create_causal_mask`` asks of a cache: the tokens it
    has seen (``past``), so the mask spans ``past + query`` keys."""

    is_compileable = False

    def __init__(self, past: int) -> None:
        self.past = past

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.past

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.past + query_length, 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.past


class LayerCache(MaskSizes):
    """One layer's keys and values for one micro-batch, token-major rows ``[max_len, mb,
    kv_heads, head_dim]`` of which the first ``past`` are filled."""

    def __init__(self, keys: Tensor, values: Tensor, past: int) -> None:
        super().__init__(past)
        self.keys, self.values = keys, values
        self.appended = 0

    def update(self, key: Tensor, value: Tensor, layer_idx: int, *args, **kwargs) -> tuple[Tensor, Tensor]:
        q = key.shape[2]
        end = self.past + q
        if end > self.keys.shape[0]:
            raise RuntimeError(f"the KV cache holds {self.keys.shape[0]} tokens, the layer appends up to {end}")
        self.keys[self.past:end].copy_(key.permute(2, 0, 1, 3))
        self.values[self.past:end].copy_(value.permute(2, 0, 1, 3))
        self.appended = q
        # [mb, kv_heads, tokens, head_dim], the layout transformers' attention reads
        return self.keys[:end].permute(1, 2, 0, 3), self.values[:end].permute(1, 2, 0, 3)


@dataclass
class Adapter:
    """The pieces of one architecture: its layers, the names of its resident tensors, the
    KV shape, and the embedding / layer / head calls."""

    model: nn.Module
    family: str
    layers: nn.ModuleList
    layer_prefix: str  # "transformer.h" or "model.layers"
    kv_heads: int
    head_dim: int

    def embed(self, ids: Tensor, positions: Tensor) -> Tensor:
        if self.family == "gpt2":
            tr = self.model.transformer
            return tr.wte(ids) + tr.wpe(positions)
        return self.model.model.embed_tokens(ids)

    def position_embeddings(self, hidden: Tensor, positions: Tensor):
        if self.family == "llama":
            return self.model.model.rotary_emb(hidden, position_ids=positions)
        return None

    def run_layer(self, index: int, hidden: Tensor, mask, positions: Tensor, pos_emb, cache: LayerCache) -> Tensor:
        layer = self.layers[index]
        if self.family == "gpt2":
            out = layer(hidden, cache, mask, None, use_cache=True, position_ids=positions)
        else:
            out = layer(hidden, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True,
                        position_embeddings=pos_emb)
        return out[0] if isinstance(out, tuple) else out

    def head(self, hidden_last: Tensor) -> Tensor:
        """float32 logits of the last position, ``[batch, vocab]`` (as generate computes them)."""
        if self.family == "gpt2":
            h = self.model.transformer.ln_f(hidden_last)
        else:
            h = self.model.model.norm(hidden_last)
        return self.model.lm_head(h)[:, -1, :].to(copy=True, dtype=torch.float32)


def family_of(config) -> str:
    mt = getattr(config, "model_type", None)
    if mt == "gpt2":
        return "gpt2"
    if mt == "llama":
        return "llama"
    raise ValueError(f"model_type={mt!r}: tierstate.OffloadedLM drives {', '.join(SUPPORTED)} models "
                     "(transformers' GPT2LMHeadModel and LlamaForCausalLM); load another architecture with "
                     "transformers and accelerate's device_map instead")


def build_meta(config, attn_implementation: str | None) -> Adapter:
    """The architecture on the meta device (no weight memory), with its non-persistent buffers
    (Llama's rotary ``inv_freq``) rebuilt on CPU."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415 - only generation needs transformers

    family = family_of(config)
    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, **kwargs)
    model.eval()
    if family == "gpt2":
        layers, prefix = model.transformer.h, "transformer.h"
        kv_heads = config.n_head
        head_dim = config.n_embd // config.n_head
    else:
        layers, prefix = model.model.layers, "model.layers"
        rot = model.model.rotary_emb
        model.model.rotary_emb = type(rot)(config=model.config)  # on CPU: inv_freq is computed, not loaded
        kv_heads = config.num_key_value_heads or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    for name, buf in model.named_buffers():
        if buf.is_meta and not name.startswith(prefix + "."):
            raise ValueError(f"{type(model).__name__} has a buffer {name!r} that is not in the checkpoint; "
                             "tierstate cannot rebuild it")
    for name, buf in layers.named_buffers():
        raise ValueError(f"{type(model).__name__}'s layers hold a buffer ({name!r}); tierstate streams "
                         "parameters only")
    return Adapter(model, family, layers, prefix, int(kv_heads), int(head_dim))
