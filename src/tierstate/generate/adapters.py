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
    """One layer's keys and values for one micro-batch, of which the first ``past`` tokens are
    filled: head-major ``[mb, kv_heads, max_len, head_dim]`` (a cache in RAM), or token-major
    ``[max_len, mb, kv_heads, head_dim]`` (``token_major=True``: a cache on NVMe, whose new
    tokens must be one run of bytes; :mod:`tierstate.generate.kv_store`).

    Either way the layer's attention gets ``[mb, kv_heads, tokens, head_dim]`` views, and the
    same bits out of it. Head-major, each (sequence, head) pair's tokens are contiguous, as in
    transformers' own cache: torch's CPU ``scaled_dot_product_attention`` over a decode step
    (64 sequences, 16 heads of 128, bf16, 2-vCPU Zen 4) took 7.2 ms over 48 cached tokens
    and 18.2 ms over 128 with it, against 15.7 and 57.8 ms over token-major views. So a
    token-major cache given ``scratch`` (head-major keys and values of the same shape,
    shared by every NVMe record of a round) is copied there for its attention: the copy
    and the attention took 23.1 ms over 128 tokens and 87.5 over 512, against 53.8 and
    240.4 ms over the token-major views, the same bits."""

    def __init__(self, keys: Tensor, values: Tensor, past: int, token_major: bool = False,
                 scratch: tuple[Tensor, Tensor] | None = None) -> None:
        super().__init__(past)
        self.keys, self.values = keys, values
        self.token_major = token_major
        self.scratch = scratch
        self.appended = 0

    @property
    def max_len(self) -> int:
        return self.keys.shape[0] if self.token_major else self.keys.shape[2]

    def update(self, key: Tensor, value: Tensor, layer_idx: int, *args, **kwargs) -> tuple[Tensor, Tensor]:
        q = key.shape[2]
        end = self.past + q
        if end > self.max_len:
            raise RuntimeError(f"the KV cache holds {self.max_len} tokens, the layer appends up to {end}")
        self.appended = q
        # returned as [mb, kv_heads, tokens, head_dim], the layout transformers' attention reads
        if self.token_major:
            self.keys[self.past:end].copy_(key.permute(2, 0, 1, 3))
            self.values[self.past:end].copy_(value.permute(2, 0, 1, 3))
            keys, values = self.keys[:end].permute(1, 2, 0, 3), self.values[:end].permute(1, 2, 0, 3)
            if self.scratch is None:
                return keys, values
            sk, sv = self.scratch[0][:, :, :end], self.scratch[1][:, :, :end]
            sk.copy_(keys)
            sv.copy_(values)
            return sk, sv
        self.keys[:, :, self.past:end].copy_(key)
        self.values[:, :, self.past:end].copy_(value)
        return self.keys[:, :, :end], self.values[:, :, :end]


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
