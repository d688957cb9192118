"""Parameters, the offload, a training loop and the comparison shared by the compressed-state
checkpoint and state-dict tests: three shapes (a matrix across several 256-value blocks, a
vector, a tail shorter than a block)."""
from __future__ import annotations

import torch

import tierstate as ts

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


def q8_offload(nvme_dir, master: str, nvme: float, block: int = 256, maps: str = "dynamic") -> "ts.Offload":
    """8-bit moments in the ``maps`` family with ``master`` ("fp32", "bf16_kahan", "bf16_sr"),
    ``nvme`` of the state on NVMe under ``nvme_dir`` and the rest in RAM, small sub-groups so
    every tier holds several."""
    return ts.Offload(cpu=1 - nvme, nvme=nvme, nvme_dir=str(nvme_dir), moment_dtype="q8",
                      master_dtype=torch.float32 if master == "fp32" else master, quant_block=block,
                      subgroup_numel=2048, quant_map=maps)


def raw_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def assert_same_state_then_same_steps(opt, params, opt2, params2, seed: int) -> None:
    """``opt2`` holds ``opt``'s state to the byte (every key of every parameter), and from the
    same parameters two more steps on the same gradients give the same parameters."""
    sd, sd2 = opt.state_dict(), opt2.state_dict()
    for i in sd["state"]:
        assert sorted(sd["state"][i]) == sorted(sd2["state"][i])
        for key, value in sd["state"][i].items():
            assert raw_bytes(value) == raw_bytes(sd2["state"][i][key]), (i, key)
    for p, q in zip(params, params2):
        q.data.copy_(p.data)
    train(opt, params, 2, seed=seed)
    train(opt2, params2, 2, seed=seed)
    for p, q in zip(params, params2):
        assert torch.equal(p, q)
