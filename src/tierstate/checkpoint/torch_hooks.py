"""torch's state-dict hooks around a tierstate optimizer's own ``state_dict``/``load_state_dict``.

``torch.optim.Optimizer`` runs its ``state_dict`` pre-hooks before it packs the dict and its
post-hooks on the finished dict (which they may replace); ``load_state_dict`` pre-hooks may
change or replace the dict before it is read, and post-hooks run once it is loaded. A
tierstate optimizer builds its dict from its tiers and loads through them, using torch's
methods only for the param groups; those calls run with the hooks set aside
(:func:`without_state_dict_hooks`), and the optimizer runs each hook once, where torch
does, around the whole of its own work (``OffloadOptimizer.state_dict``).
"""
from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Iterator

import torch

_HOOKS = ("_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
          "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks")


@contextlib.contextmanager
def without_state_dict_hooks(opt: torch.optim.Optimizer) -> Iterator[None]:
    """Inside, torch's ``state_dict``/``load_state_dict`` of ``opt`` run none of its hooks."""
    saved = [(name, opt.__dict__[name]) for name in _HOOKS if name in opt.__dict__]
    for name, _ in saved:
        setattr(opt, name, OrderedDict())
    try:
        yield
    finally:
        for name, hooks in saved:
            setattr(opt, name, hooks)


def packed(opt: torch.optim.Optimizer) -> dict:
    """torch's ``state_dict`` of ``opt`` without its hooks: the param groups packed by index
    (``params``, ``param_names``), and ``state`` as torch packs ``opt.state``."""
    with without_state_dict_hooks(opt):
        return torch.optim.Optimizer.state_dict(opt)


def entries_not_of_parameters(opt: torch.optim.Optimizer) -> dict:
    """The entries of ``opt.state`` whose key is not a parameter (a hook's ``state["test"]``):
    torch's state dict carries them as they are, and its load puts them back."""
    return {k: v for k, v in opt.state.items() if not isinstance(k, torch.Tensor)}


def run_state_dict_hooks(opt: torch.optim.Optimizer, make) -> dict:
    """``make()``'s state dict between ``opt``'s ``state_dict`` pre- and post-hooks, as torch runs them."""
    for hook in opt._optimizer_state_dict_pre_hooks.values():
        hook(opt)
    state_dict = make()
    for hook in opt._optimizer_state_dict_post_hooks.values():
        result = hook(opt, state_dict)
        if result is not None:
            state_dict = result
    return state_dict


def run_load_pre_hooks(opt: torch.optim.Optimizer, state_dict: dict) -> dict:
    """The dict a load reads: a shallow copy of ``state_dict`` (as torch makes) through ``opt``'s
    ``load_state_dict`` pre-hooks, each of which may change it or return another."""
    state_dict = dict(state_dict)
    for hook in opt._optimizer_load_state_dict_pre_hooks.values():
        result = hook(opt, state_dict)
        if result is not None:
            state_dict = result
    return state_dict


def run_load_post_hooks(opt: torch.optim.Optimizer) -> None:
    for hook in opt._optimizer_load_state_dict_post_hooks.values():
        hook(opt)
