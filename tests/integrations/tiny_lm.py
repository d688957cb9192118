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
