"""Parameters and a training loop shared by the compressed-state checkpoint and state-dict tests:
three shapes (a matrix across several 256-value blocks, a vector, a tail shorter than a block)."""
from __future__ import annotations

import torch

SHAPES = [(37, 300), (1000,), (5,)]


def make_params(dtype=torch.bfloat16, seed: int = 11) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=gen).to(dtype)) for s in SHAPES]


def train(opt, params, steps: int, seed: int = 0) -> None:
    """``steps`` optimizer steps on seeded random gradients."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        opt.step()
