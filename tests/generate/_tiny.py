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


def save_with_tokenizer(model, folder) -> list[str]:
    """Save ``model`` and a word-level tokenizer over its vocabulary ("w0" ... "w499") into
    ``folder``; returns a few prompts in that vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(model.config.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", pad_token="w0")
    model.save_pretrained(folder)
    fast.save_pretrained(folder)
    return ["w10 w20 w30", "w5 w6", "w100 w200 w300 w400 w17"]
