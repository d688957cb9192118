"""Tiny transformers models and a learnable token stream shared by the integration tests.

Models are real transformers architectures built from configs with random weights (no
download): a GPT-2 and a Llama-style model of ~30k parameters each, small enough that a
few Trainer/Accelerate/Lightning steps take well under a second on 2 cores.
"""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

VOCAB = 64
SEQ = 16


def tiny_model(kind: str = "gpt2", seed: int = 0):
    """A tiny causal LM of ``kind`` ("gpt2" or "llama"), initialised from ``seed``."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install tierstate[hf])")
    torch.manual_seed(seed)
    if kind == "gpt2":
        config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                         bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(config)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=SEQ,
                                      bos_token_id=0, eos_token_id=0)
    return transformers.LlamaForCausalLM(config)


class TokenStream(torch.utils.data.Dataset):
    """Sequences that count up from a random start modulo VOCAB: the next token is learnable,
    so the loss falls within a few steps from ln(VOCAB) ~ 4.2."""

    def __init__(self, n: int = 64, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, VOCAB, (n, 1), generator=g)
        self.ids = (starts + torch.arange(SEQ)) % VOCAB

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def params_of(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_bit_identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs: max |diff| {(a[k].float() - b[k].float()).abs().max()}"


# Tolerance of a tierstate run against the same framework run with torch.optim.AdamW, both in
# fp32. With the pure-torch reference kernels (TIERSTATE_ISA=reference) the update is torch's
# own single-tensor code, so the runs must agree bit for bit. The native kernels fuse
# multiply-adds (``v * beta2 + (1 - beta2) * g * g``, ``w - lr * m / denom``) where torch rounds
# twice: each step differs from torch by a few fp32 ulps (2**-23 = 1.2e-7 relative) per element,
# and the next forward/backward carries that into the gradients. Adam divides each gradient by
# its own running RMS, so an element whose gradient nearly cancels (a small sum of large terms)
# turns a tiny absolute difference into an update difference of up to lr times its relative
# error: the parameters differ by an absolute amount, not one relative to their size. Measured
# over these 6-8 step runs with lr = 1e-2: <= 5e-7 absolute on parameters, <= 3e-7 relative on
# the losses. We allow RUN_RTOL = 1e-5 relative (about 80 ulps) plus RUN_ATOL = 1e-6 absolute
# (1e-4 of one step's update). A real defect (lr, betas, eps, weight decay, bias correction or
# the step count off) moves parameters by a sizeable fraction of lr = 1e-2 per step, 10^4x more.
RUN_RTOL = 1e-5
RUN_ATOL = 1e-6


def assert_runs_match(losses: list[float], torch_losses: list[float], params: dict, torch_params: dict,
                      exact: bool) -> None:
    """A tierstate run's losses and final parameters against the torch.optim.AdamW run's:
    bit-identical when ``exact``, else within RUN_RTOL / RUN_ATOL."""
    assert len(losses) == len(torch_losses) > 0
    assert params.keys() == torch_params.keys()
    if exact:
        assert losses == torch_losses
        assert_bit_identical(params, torch_params)
        return
    for k, (a, b) in enumerate(zip(losses, torch_losses)):
        assert abs(a - b) <= RUN_RTOL * abs(b), f"loss {k}: {a} vs torch {b}"
    for name in params:
        a, b = params[name].double(), torch_params[name].double()
        err = (a - b).abs()
        bound = RUN_RTOL * b.abs() + RUN_ATOL
        assert bool((err <= bound).all()), (
            f"{name}: max |diff| {err.max().item():.3g}, worst relative {(err / bound).max().item():.3g}x the bound")
