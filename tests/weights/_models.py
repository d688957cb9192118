"""Tiny transformers models (random init, no download) for the parameter-offload tests."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

VOCAB = 96


def gpt2(n_layer: int = 3, n_embd: int = 32, tied: bool = True, seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=4, vocab_size=VOCAB, n_positions=32,
                                  bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, attn_pdrop=0.0,
                                  embd_pdrop=0.0, tie_word_embeddings=tied)
    return transformers.GPT2LMHeadModel(cfg)


def llama(n_layer: int = 3, hidden: int = 32, tied: bool = False, seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(num_hidden_layers=n_layer, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                   max_position_embeddings=32, bos_token_id=0, eos_token_id=0,
                                   pad_token_id=0, tie_word_embeddings=tied)
    return transformers.LlamaForCausalLM(cfg)


BUILDERS = {"gpt2": gpt2, "llama": llama}


def twin(kind: str, dtype=torch.float32, **kw):
    """Two identical models: the reference and the one whose weights will stream."""
    a = BUILDERS[kind](**kw).to(dtype)
    b = BUILDERS[kind](**kw).to(dtype)
    b.load_state_dict(a.state_dict())
    return a, b


def batches(n: int, seed: int = 1, bs: int = 2, seq: int = 12):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (bs, seq), generator=g) for _ in range(n)]


def offload(model, *args, **kw):
    """ts.offload_weights onto the CPU: these tests compare against CPU references, also on a
    machine with a GPU (where the default compute device would be CUDA)."""
    import tierstate as ts

    kw.setdefault("device", "cpu")
    return ts.offload_weights(model, *args, **kw)
