"""Tiny random-init GPT-2 and Llama models (no downloads) saved as safetensors folders."""
from __future__ import annotations

import torch


def tiny(family: str, seed: int = 0, layers: int = 3):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    if family == "gpt2":
        cfg = GPT2Config(vocab_size=500, n_positions=128, n_embd=64, n_layer=layers, n_head=4,
                         bos_token_id=1, eos_token_id=2)
        model = GPT2LMHeadModel(cfg)
    else:
        cfg = LlamaConfig(vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                          bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
        model = LlamaForCausalLM(cfg)
    return model.eval()


def padded_batch(seed: int = 1, rows: int = 5, width: int = 9, pads=(0, 3, 1, 5, 0)):
    """Prompts of different lengths, left-padded with token 0."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 500, (rows, width), generator=g)
    mask = torch.ones_like(ids)
    for i, n in enumerate(pads[:rows]):
        mask[i, :n] = 0
        ids[i, :n] = 0
    return ids, mask
