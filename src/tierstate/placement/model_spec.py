"""What the planner needs to know about a model: its parameter tensors and (when known) its shape.

A :class:`ModelSpec` is built from one of four descriptions (:func:`resolve_model`):

- a parameter count: ``"124M"``, ``"7B"``, ``"6.7e9"`` or an int;
- a built-in shape (:data:`BUILTIN_SHAPES`: gpt2 ... gpt2-xl, llama-7b/13b/70b), counted from
  the config fields with the formulas below, without transformers or a download;
- a transformers config name or path, read with ``AutoConfig.from_pretrained(...,
  local_files_only=True)`` and counted by building the model on the meta device;
- a Python factory ``"pkg.mod:factory"`` returning an ``nn.Module`` (or its parameters),
  called under ``torch.device("meta")`` so no memory is allocated.

The spec keeps every parameter's element count: the planner needs the largest one (first-step
temporaries scale with it) and the per-parameter 64-byte padding of the gradient buffer.
"""
from __future__ import annotations

import importlib
import re
from dataclasses import dataclass, field
from typing import Sequence

_SUFFIX = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}


@dataclass(frozen=True)
class TransformerShape:
    """Fields of a decoder-only transformer that activation and FLOP estimates need."""

    n_layer: int
    hidden: int
    n_head: int
    vocab_size: int
    max_seq_len: int


@dataclass(frozen=True)
class ModelSpec:
    """A model as the planner sees it.

    Args:
        name: how the model was named on the command line.
        param_numels: element count of every trainable parameter (a single entry when only
            the total is known).
        shape: transformer fields when known (activation and FLOP estimates need them).
        source: how the counts were obtained ("count", "builtin formula", "meta device").
    """

    name: str
    param_numels: tuple[int, ...]
    shape: TransformerShape | None = None
    source: str = "count"
    notes: tuple[str, ...] = field(default=())

    @property
    def numel(self) -> int:
        return sum(self.param_numels)

    @property
    def tensors_known(self) -> bool:
        """False when only the total count was given (one entry stands for all tensors)."""
        return self.source != "count"

    @property
    def largest_param(self) -> int:
        """Elements of the largest tensor; 0 when unknown (a bare count)."""
        return max(self.param_numels, default=0) if self.tensors_known else 0


def parse_count(text: "str | int | float") -> int:
    """``"124M"`` -> 124_000_000; also ``"7B"``, ``"1.5e9"``, ``"350k"``, ints."""
    if isinstance(text, bool):
        raise TypeError(f"parameter count {text!r}: expected a number such as 124M or 7e9")
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBgGtT]?)\s*", str(text))
        if not m:
            raise ValueError(f"parameter count {text!r}: expected a number such as 124M, 7B or 6.7e9")
        value = float(m.group(1)) * _SUFFIX[m.group(2).upper()]
    if value < 1:
        raise ValueError(f"parameter count {text!r}: must be at least 1")
    return int(round(value))


# -- built-in shapes ---------------------------------------------------------------------------------
def gpt2_param_numels(n_layer: int, n_embd: int, vocab_size: int = 50257, n_positions: int = 1024,
                      n_inner: int | None = None) -> list[int]:
    """Parameters of GPT2LMHeadModel (head tied to the token embedding, so counted once)."""
    h, inner = n_embd, n_inner or 4 * n_embd
    numels = [vocab_size * h, n_positions * h]
    for _ in range(n_layer):
        numels += [h, h,  # ln_1
                   h * 3 * h, 3 * h,  # attn.c_attn
                   h * h, h,  # attn.c_proj
                   h, h,  # ln_2
                   h * inner, inner,  # mlp.c_fc
                   inner * h, h]  # mlp.c_proj
    return numels + [h, h]  # ln_f


def llama_param_numels(n_layer: int, hidden: int, intermediate: int, vocab_size: int, n_head: int,
                       n_kv_head: int | None = None, tie_embeddings: bool = False) -> list[int]:
    """Parameters of LlamaForCausalLM (no biases, RMSNorm weights only, grouped-query K/V)."""
    kv = hidden // n_head * (n_kv_head or n_head)
    numels = [vocab_size * hidden]
    for _ in range(n_layer):
        numels += [hidden * hidden, kv * hidden, kv * hidden, hidden * hidden,  # q, k, v, o
                   intermediate * hidden, intermediate * hidden, hidden * intermediate,  # gate, up, down
                   hidden, hidden]  # input / post-attention RMSNorm
    numels.append(hidden)  # final norm
    if not tie_embeddings:
        numels.append(vocab_size * hidden)
    return numels


def _gpt2(n_layer: int, n_embd: int, n_head: int) -> ModelSpec:
    return ModelSpec("", tuple(gpt2_param_numels(n_layer, n_embd)),
                     TransformerShape(n_layer, n_embd, n_head, 50257, 1024), "builtin formula")


def _llama(n_layer: int, hidden: int, inter: int, n_head: int, n_kv: int, vocab: int = 32000,
           seq: int = 4096) -> ModelSpec:
    return ModelSpec("", tuple(llama_param_numels(n_layer, hidden, inter, vocab, n_head, n_kv)),
                     TransformerShape(n_layer, hidden, n_head, vocab, seq), "builtin formula")


# gpt2: 124,439,808 parameters (as GPT2LMHeadModel reports); llama-7b: 6,738,415,616.
BUILTIN_SHAPES = {
    "gpt2": lambda: _gpt2(12, 768, 12),
    "gpt2-medium": lambda: _gpt2(24, 1024, 16),
    "gpt2-large": lambda: _gpt2(36, 1280, 20),
    "gpt2-xl": lambda: _gpt2(48, 1600, 25),
    "llama-7b": lambda: _llama(32, 4096, 11008, 32, 32),
    "llama-13b": lambda: _llama(40, 5120, 13824, 40, 40),
    "llama-70b": lambda: _llama(80, 8192, 28672, 64, 8),
}


# -- transformers configs and factories ---------------------------------------------------------------
def _shape_from_hf_config(cfg) -> TransformerShape | None:
    get = lambda *names: next((getattr(cfg, n) for n in names if getattr(cfg, n, None)), None)  # noqa: E731
    layers, hidden = get("num_hidden_layers", "n_layer"), get("hidden_size", "n_embd")
    heads, vocab = get("num_attention_heads", "n_head"), get("vocab_size")
    seq = get("max_position_embeddings", "n_positions") or 2048
    if not (layers and hidden and heads and vocab):
        return None
    return TransformerShape(int(layers), int(hidden), int(heads), int(vocab), int(seq))


def _numels_on_meta(build) -> list[int]:
    import torch  # noqa: PLC0415 - only this path needs torch

    with torch.device("meta"):
        built = build()
    params = built.parameters() if hasattr(built, "parameters") else built
    numels, seen = [], set()
    for p in params:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"the factory returned {type(p).__name__} among its parameters; return an nn.Module "
                            "or an iterable of tensors")
        # tied weights are one parameter, as in model.parameters(); tensors hash by identity, and
        # holding them keeps a generator's freed tensor from handing its address to the next one
        if p in seen or not p.requires_grad:
            continue
        seen.add(p)
        numels.append(p.numel())
    return numels


def from_hf_config(name_or_path: str) -> ModelSpec:
    """A transformers config (hub name already in the local cache, or a folder/file path)."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM  # noqa: PLC0415
    except ImportError as exc:
        raise ValueError(f"model={name_or_path!r} looks like a transformers config, but transformers is not "
                         f"installed ({exc}); pip install transformers, or give a parameter count") from exc
    try:
        cfg = AutoConfig.from_pretrained(name_or_path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"model={name_or_path!r}: no transformers config found locally (local_files_only=True): {exc}. "
            f"Give a config folder/file, a built-in shape ({', '.join(BUILTIN_SHAPES)}), a parameter count "
            "or pkg.mod:factory") from exc
    numels = _numels_on_meta(lambda: AutoModelForCausalLM.from_config(cfg))
    return ModelSpec(name_or_path, tuple(numels), _shape_from_hf_config(cfg), "transformers config on the meta device")


def from_factory(target: str) -> ModelSpec:
    """``"pkg.mod:factory"``: import, call ``factory()`` on the meta device, count its parameters."""
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"model={target!r}: cannot import {module_name!r} ({exc}); is it on PYTHONPATH?") from exc
    factory = module
    for part in attr.split("."):
        factory = getattr(factory, part, None)
        if factory is None:
            raise ValueError(f"model={target!r}: {module_name} has no attribute {attr!r}")
    if not callable(factory):
        raise TypeError(f"model={target!r}: {attr} is a {type(factory).__name__}, not a callable returning a model")
    built_shape: list = []

    def build():
        model = factory()
        built_shape.append(getattr(model, "config", None))
        return model

    numels = _numels_on_meta(build)
    cfg = built_shape[0] if built_shape else None
    shape = None
    if cfg is not None:
        n_layer, hidden = getattr(cfg, "n_layer", None), getattr(cfg, "d_model", None)
        if n_layer and hidden:  # tierstate.demo.model.GPTConfig
            shape = TransformerShape(n_layer, hidden, cfg.n_head, cfg.vocab_size, cfg.max_seq_len)
        else:
            shape = _shape_from_hf_config(cfg)
    return ModelSpec(target, tuple(numels), shape, "factory on the meta device")


def from_param_numels(numels: Sequence[int], name: str = "params", shape: TransformerShape | None = None) -> ModelSpec:
    """A spec for tensors already in hand (``offload="auto"``)."""
    return ModelSpec(name, tuple(int(n) for n in numels), shape, "tensors")


def resolve_model(text: str) -> ModelSpec:
    """Turn a command-line model description into a :class:`ModelSpec` (see the module docstring)."""
    text = str(text).strip()
    if text.lower() in BUILTIN_SHAPES:
        spec = BUILTIN_SHAPES[text.lower()]()
        return ModelSpec(text.lower(), spec.param_numels, spec.shape, spec.source)
    try:
        count = parse_count(text)
    except ValueError:
        pass
    else:
        return ModelSpec(text, (count,), None, "count",
                         ("only the total is known: gradient padding and first-step temporaries are estimated "
                          "as if the model were one tensor",))
    if ":" in text and not text.startswith(("/", ".")) and "/" not in text.split(":")[0]:
        return from_factory(text)
    return from_hf_config(text)
