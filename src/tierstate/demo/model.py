"""A compact GPT: the model ``tierstate demo`` trains.

Token + learned position embeddings, ``n_layer`` pre-LayerNorm blocks (causal self-attention
through :func:`torch.nn.functional.scaled_dot_product_attention`, then a GELU MLP), a final
LayerNorm and an output head tied to the token embedding. Nothing here knows about
optimizers or offloading: the demo's point is that an ordinary model trains unchanged.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# Byte-level tokens: the synthetic corpus (corpus.py) is text over single bytes.
BYTE_VOCAB_SIZE = 256


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a :class:`GPT`.

    Args:
        n_layer: transformer blocks.
        n_head: attention heads per block; must divide ``d_model``.
        d_model: width of the residual stream.
        max_seq_len: longest sequence the position embedding covers.
        vocab_size: tokens the embedding and the tied head cover.
        mlp_ratio: hidden width of the MLP as a multiple of ``d_model``.
    """

    n_layer: int
    n_head: int
    d_model: int
    max_seq_len: int = 512
    vocab_size: int = BYTE_VOCAB_SIZE
    mlp_ratio: int = 4

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "d_model", "max_seq_len", "vocab_size", "mlp_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GPTConfig({name}={value!r}): must be a positive int")
        if self.d_model % self.n_head:
            raise ValueError(
                f"GPTConfig(d_model={self.d_model}, n_head={self.n_head}): n_head must divide "
                f"d_model; pick n_head from the divisors of {self.d_model}"
            )

    @classmethod
    def preset(cls, name: str) -> "GPTConfig":
        """The configuration named ``name`` (one of :data:`MODEL_PRESETS`)."""
        try:
            return MODEL_PRESETS[name]
        except KeyError:
            raise ValueError(
                f"model={name!r} is not a preset; choose one of {sorted(MODEL_PRESETS)}"
            ) from None

    def num_parameters(self) -> int:
        """Parameter count of the model this config builds (the tied head counted once)."""
        d, hidden = self.d_model, self.mlp_ratio * self.d_model
        # per block: 2 LayerNorms (2*2d), qkv (3d*d + 3d), attention out (d*d + d),
        # MLP in (hidden*d + hidden) and out (d*hidden + d)
        per_block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (2 * hidden * d + hidden + d)
        embeddings = self.vocab_size * d + self.max_seq_len * d
        return embeddings + self.n_layer * per_block + 2 * d  # + the final LayerNorm


# 12*d^2 parameters per block dominate; the byte vocabulary keeps the embedding small
# (256*d), so almost all parameters (and optimizer state) sit in the blocks.
MODEL_PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(n_layer=4, n_head=4, d_model=64, max_seq_len=256),  # 0.22M, for tests
    "small": GPTConfig(n_layer=6, n_head=6, d_model=384),  # 10.9M
    "medium": GPTConfig(n_layer=10, n_head=10, d_model=640),  # 49.7M
    "large": GPTConfig(n_layer=16, n_head=12, d_model=768),  # 114M
}


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t sees positions <= t only."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.out = nn.Linear(config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        # (B, T, 3*C) -> 3 x (B, heads, T, C/heads)
        q, k, v = self.qkv(x).view(batch, seq, 3, self.n_head, width // self.n_head).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(batch, seq, width))


class MLP(nn.Module):
    """Position-wise two-layer perceptron with a GELU between the layers."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        hidden = config.mlp_ratio * config.d_model
        self.up = nn.Linear(config.d_model, hidden)
        self.down = nn.Linear(hidden, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    """Pre-LayerNorm residual block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln_mlp = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_attn(x))
        return x + self.mlp(self.ln_mlp(x))


class GPT(nn.Module):
    """A decoder-only transformer language model; ``forward(tokens)`` returns logits.

    Args:
        config: the model's shape (see :class:`GPTConfig` and :data:`MODEL_PRESETS`).
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.d_model)
        self.position_embedding = nn.Embedding(config.max_seq_len, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_final = nn.LayerNorm(config.d_model)
        self._init_weights()

    def _init_weights(self) -> None:
        # GPT-2 style: N(0, 0.02) everywhere, and the two projections that write into the
        # residual stream scaled by 1/sqrt(2*n_layer) so its variance does not grow with depth.
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                std = residual_std if name.endswith(("attn.out", "mlp.down")) else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of shape (batch, seq, vocab) for integer ``tokens`` of shape (batch, seq)."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens: expected shape (batch, seq), got {tuple(tokens.shape)}")
        seq = tokens.shape[1]
        if seq > self.config.max_seq_len:
            raise ValueError(
                f"tokens: sequence length {seq} exceeds max_seq_len={self.config.max_seq_len}; "
                f"shorten the sequence or build the model with a larger max_seq_len"
            )
        positions = torch.arange(seq, device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        # Tied head: the output projection reuses the token embedding matrix.
        return F.linear(self.ln_final(x), self.token_embedding.weight)
