"""A streamed parameter saved while its block has memory is saved as what it is to torch: an
``nn.Parameter`` (a ``torch.Tensor`` for an alias), never tierstate's checking class.

Streamed parameters are ``StreamedParameter``s and their aliases ``_StreamedAlias``es
([Note: touching a streamed parameter directly]). Until 2026-12-07, ``torch.save`` of either
inside ``ws.gathered()`` (``torch.save(p)``, ``torch.save({n: p.detach() ...})``) wrote those
classes into the file, and ``torch.load`` (``weights_only=True``, torch's default) refused it:
"Unsupported global: tierstate.weights.streamed_param...".
"""
from __future__ import annotations

import copy
import io

import pytest
import torch

import tierstate as ts

pytest.importorskip("transformers")


def _model():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50, n_positions=16))


@pytest.mark.parametrize("what", ["param", "detach", "data", "view", "dict", "list"])
def test_saved_inside_gathered_loads_with_weights_only(what):
    model = _model()
    ws = ts.offload_weights(model, "cpu")
    try:
        p = model.transformer.h[0].mlp.c_fc.weight
        with ws.gathered():
            obj = {"param": lambda: p, "detach": lambda: p.detach(), "data": lambda: p.data,
                   "view": lambda: p.view(-1), "dict": lambda: {"w": p.detach()},
                   "list": lambda: [p.detach(), p.T]}[what]()
            buf = io.BytesIO()
            torch.save(obj, buf)
            expect = p.detach().clone()
        buf.seek(0)
        loaded = torch.load(buf)  # weights_only=True: torch's default
        first = loaded["w"] if what == "dict" else loaded[0] if what == "list" else loaded
        assert type(first) is (torch.nn.Parameter if what == "param" else torch.Tensor), type(first)
        assert torch.equal(first.reshape(expect.shape), expect)
        if what == "list":
            assert type(loaded[1]) is torch.Tensor and torch.equal(loaded[1], expect.T)
    finally:
        ws.close()


def test_deepcopy_inside_gathered_is_a_parameter_of_its_own():
    model = _model()
    ws = ts.offload_weights(model, "cpu")
    try:
        p = model.transformer.h[0].mlp.c_fc.weight
        with ws.gathered():
            c = copy.deepcopy(p)
            d = copy.deepcopy(p.detach())
        assert type(c) is torch.nn.Parameter and torch.equal(c, ws.read_param(p))
        assert type(d) is torch.Tensor and torch.equal(d, ws.read_param(p))
    finally:
        ws.close()
