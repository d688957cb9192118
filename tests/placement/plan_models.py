"""Model factories that tests name as "plan_models:..." (this folder is on sys.path under pytest)."""
from tierstate.demo.model import GPT, GPTConfig


def tiny_gpt():
    return GPT(GPTConfig(n_layer=2, n_head=2, d_model=32, max_seq_len=16))


def fresh_tensors():
    """Parameters made one at a time and dropped once counted (a generator): every one is its own."""
    import torch

    return (torch.nn.Parameter(torch.empty(n)) for n in (100, 100, 100, 300))


def tied_list():
    """One tensor listed twice (tied weights), as model.parameters() never does but a list may."""
    import torch

    w = torch.nn.Parameter(torch.empty(64))
    return [w, torch.nn.Parameter(torch.empty(8)), w]
