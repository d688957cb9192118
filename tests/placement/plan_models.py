"""Model factories that tests name as "plan_models:..." (this folder is on sys.path under pytest)."""
from tierstate.demo.model import GPT, GPTConfig


def tiny_gpt():
    return GPT(GPTConfig(n_layer=2, n_head=2, d_model=32, max_seq_len=16))
