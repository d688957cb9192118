"""What the planner needs to know about a model: its parameter tensors and (when known) its shape.

A :class:`ModelSpec` is built from one of four descriptions (:func:`resolve_model`):

- a parameter count: ``"124M"``, ``"7B"``, ``"6.7e9"`` or an int;
- a built-in shape (:data:`BUILTIN_SHAPES`: gpt2 ... gpt2-xl; Llama-architecture models from
  SmolLM-135M to Llama-2-70b, tied embeddings included), counted from the config fields with
  the formulas below, without transformers or a download;
- a transformers config name or path, read with ``AutoConfig.from_pretrained(...,
  local_files_only=True)`` and counted by building the model on the meta device;
- a Python factory ``"pkg.mod:factory"`` returning an ``nn.Module`` (or its parameters),
  called under ``torch.device("meta")`` so no memory is allocated.

The spec keeps every parameter's element count: the planner needs the largest one (first-step
temporaries scale with it) and the per-parameter 64-byte padding of the gradient buffer. When
the repeated blocks are known (built-in shapes, configs and factories: the largest
``nn.ModuleList``, as ``offload_weights(blocks="auto")`` finds them) it also keeps each block's
element count and the count outside the blocks, which the weight planner
(:mod:`.weights_plan`) streams and keeps resident.
"""
from __future__ import annotations

import importlib
import re
from dataclasses import dataclass, field, replace
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
        block_numels: elements of each repeated block (every parameter in it, frozen ones too:
            weight offload streams them all), in execution order; empty when unknown.
        outside_numel: elements of the parameters outside the blocks (embeddings, head, final
            norm; a tied head counted once); 0 when the blocks are unknown.
    """

    name: str
    param_numels: tuple[int, ...]
    shape: TransformerShape | None = None
    source: str = "count"
    notes: tuple[str, ...] = field(default=())
    block_numels: tuple[int, ...] = field(default=())
    outside_numel: int = 0

    @property
    def numel(self) -> int:
        return sum(self.param_numels)

    @property
    def tensors_known(self) -> bool:
        """False when only the total count was given (one entry stands for all tensors)."""
        return self.source != "count"

    @property
    def blocks_known(self) -> bool:
        """True when the repeated blocks are known (what weight offload needs)."""
        return bool(self.block_numels)

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
def gpt2_block_numels(n_embd: int, n_inner: int | None = None) -> list[int]:
    """Parameters of one GPT-2 block (``transformer.h[i]``), in ``named_parameters`` order."""
    h, inner = n_embd, n_inner or 4 * n_embd
    return [h, h,  # ln_1
            h * 3 * h, 3 * h,  # attn.c_attn
            h * h, h,  # attn.c_proj
            h, h,  # ln_2
            h * inner, inner,  # mlp.c_fc
            inner * h, h]  # mlp.c_proj


def gpt2_param_numels(n_layer: int, n_embd: int, vocab_size: int = 50257, n_positions: int = 1024,
                      n_inner: int | None = None) -> list[int]:
    """Parameters of GPT2LMHeadModel (head tied to the token embedding, so counted once)."""
    numels = [vocab_size * n_embd, n_positions * n_embd]
    for _ in range(n_layer):
        numels += gpt2_block_numels(n_embd, n_inner)
    return numels + [n_embd, n_embd]  # ln_f


def llama_block_numels(hidden: int, intermediate: int, n_head: int, n_kv_head: int | None = None) -> list[int]:
    """Parameters of one Llama decoder layer (``model.layers[i]``), in ``named_parameters`` order."""
    kv = hidden // n_head * (n_kv_head or n_head)
    return [hidden * hidden, kv * hidden, kv * hidden, hidden * hidden,  # q, k, v, o
            intermediate * hidden, intermediate * hidden, hidden * intermediate,  # gate, up, down
            hidden, hidden]  # input / post-attention RMSNorm


def llama_param_numels(n_layer: int, hidden: int, intermediate: int, vocab_size: int, n_head: int,
                       n_kv_head: int | None = None, tie_embeddings: bool = False) -> list[int]:
    """Parameters of LlamaForCausalLM (no biases, RMSNorm weights only, grouped-query K/V)."""
    numels = [vocab_size * hidden]
    for _ in range(n_layer):
        numels += llama_block_numels(hidden, intermediate, n_head, n_kv_head)
    numels.append(hidden)  # final norm
    if not tie_embeddings:
        numels.append(vocab_size * hidden)
    return numels


def _with_blocks(spec: ModelSpec, block: list[int], n_layer: int) -> ModelSpec:
    blocks = (sum(block),) * n_layer
    return replace(spec, block_numels=blocks, outside_numel=spec.numel - sum(blocks))


def _gpt2(n_layer: int, n_embd: int, n_head: int) -> ModelSpec:
    spec = ModelSpec("", tuple(gpt2_param_numels(n_layer, n_embd)),
                     TransformerShape(n_layer, n_embd, n_head, 50257, 1024), "builtin formula")
    return _with_blocks(spec, gpt2_block_numels(n_embd), n_layer)


def _llama(n_layer: int, hidden: int, inter: int, n_head: int, n_kv: int, vocab: int = 32000,
           seq: int = 4096, tied: bool = False) -> ModelSpec:
    spec = ModelSpec("", tuple(llama_param_numels(n_layer, hidden, inter, vocab, n_head, n_kv, tied)),
                     TransformerShape(n_layer, hidden, n_head, vocab, seq), "builtin formula")
    return _with_blocks(spec, llama_block_numels(hidden, inter, n_head, n_kv), n_layer)


# Parameter counts as the published models report them: gpt2 124,439,808 (GPT2LMHeadModel);
# smollm-135m 134,515,008 and smollm-360m 361,821,120 (Llama architecture, tied embeddings);
# tinyllama-1.1b 1,100,048,384; llama-3.2-1b 1,235,814,400 and llama-3.2-3b 3,212,749,824
# (tied); llama-7b (Llama-2-7b) 6,738,415,616; llama-3-8b 8,030,261,248; llama-13b
# 13,015,864,320; llama-70b 68,976,648,192.
BUILTIN_SHAPES = {
    "gpt2": lambda: _gpt2(12, 768, 12),
    "gpt2-medium": lambda: _gpt2(24, 1024, 16),
    "gpt2-large": lambda: _gpt2(36, 1280, 20),
    "gpt2-xl": lambda: _gpt2(48, 1600, 25),
    "smollm-135m": lambda: _llama(30, 576, 1536, 9, 3, vocab=49152, seq=2048, tied=True),
    "smollm-360m": lambda: _llama(32, 960, 2560, 15, 5, vocab=49152, seq=2048, tied=True),
    "tinyllama-1.1b": lambda: _llama(22, 2048, 5632, 32, 4, seq=2048),
    "llama-3.2-1b": lambda: _llama(16, 2048, 8192, 32, 8, vocab=128256, seq=131072, tied=True),
    "llama-3.2-3b": lambda: _llama(28, 3072, 8192, 24, 8, vocab=128256, seq=131072, tied=True),
    "llama-7b": lambda: _llama(32, 4096, 11008, 32, 32),
    "llama-3-8b": lambda: _llama(32, 4096, 14336, 32, 8, vocab=128256, seq=8192),
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


def _blocks_of(model) -> tuple[tuple[int, ...], int]:
    """Element counts of the repeated blocks (the ``nn.ModuleList`` holding the most parameters,
    as ``offload_weights(blocks="auto")`` picks them) and of every parameter outside them; a
    parameter shared by two places counted once. ``((), 0)`` when the model has no ModuleList."""
    import torch  # noqa: PLC0415

    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    if not lists:
        return (), 0
    size = lambda lst: sum(p.numel() for p in lst.parameters())  # noqa: E731
    blocks = max(lists, key=size)
    seen: set = set()
    block_numels = []
    for block in blocks:
        fresh = [p for p in block.parameters() if p not in seen]
        seen.update(fresh)
        block_numels.append(sum(p.numel() for p in fresh))
    outside = sum(p.numel() for p in model.parameters() if p not in seen)
    return tuple(block_numels), outside


def _counts_on_meta(build) -> tuple[list[int], tuple[int, ...], int]:
    """Build on the meta device: trainable parameter counts, block counts, count outside blocks."""
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
    blocks, outside = _blocks_of(built) if isinstance(built, torch.nn.Module) else ((), 0)
    return numels, blocks, outside


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
    numels, blocks, outside = _counts_on_meta(lambda: AutoModelForCausalLM.from_config(cfg))
    return ModelSpec(name_or_path, tuple(numels), _shape_from_hf_config(cfg), "transformers config on the meta device",
                     block_numels=blocks, outside_numel=outside)


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

    numels, blocks, outside = _counts_on_meta(build)
    cfg = built_shape[0] if built_shape else None
    shape = None
    if cfg is not None:
        n_layer, hidden = getattr(cfg, "n_layer", None), getattr(cfg, "d_model", None)
        if n_layer and hidden:  # tierstate.demo.model.GPTConfig
            shape = TransformerShape(n_layer, hidden, cfg.n_head, cfg.vocab_size, cfg.max_seq_len)
        else:
            shape = _shape_from_hf_config(cfg)
    return ModelSpec(target, tuple(numels), shape, "factory on the meta device", block_numels=blocks,
                     outside_numel=outside)


def from_param_numels(numels: Sequence[int], name: str = "params", shape: TransformerShape | None = None) -> ModelSpec:
    """A spec for tensors already in hand (``offload="auto"``)."""
    return ModelSpec(name, tuple(int(n) for n in numels), shape, "tensors")


def resolve_model(text: str) -> ModelSpec:
    """Turn a command-line model description into a :class:`ModelSpec` (see the module docstring)."""
    text = str(text).strip()
    if text.lower() in BUILTIN_SHAPES:
        return replace(BUILTIN_SHAPES[text.lower()](), name=text.lower())
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
