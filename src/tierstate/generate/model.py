"""``OffloadedLM``: generate with a causal LM whose weights live in host RAM and on NVMe."""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import Tensor, nn

from ..placement.generate_plan import DEFAULT_PREFETCH
from ..placement.offload import Offload
from ..weights.homes import split_by_fraction
from .adapters import build_meta
from .compress import DEFAULT_GROUP, LOSSLESS
from .kv_store import KVStore
from .sampling import Sampler
from .schedule import RoundStats, run_round
from .source import ModuleSource, SafetensorsSource, iter_aliases
from .weight_store import WeightStore

TIERS = ("cpu", "nvme")


def _tiers(arg, nbytes: Sequence[int], what: str) -> list[str]:
    """Per-layer tiers from ``"cpu"``, ``"nvme"``, ``Offload(cpu=a, nvme=b)`` or a list."""
    n = len(nbytes)
    if isinstance(arg, str):
        if arg not in TIERS:
            raise ValueError(f"{what}={arg!r}: expected 'cpu', 'nvme', 'auto', a tierstate.Offload(cpu=..., "
                             "nvme=...) or a list of 'cpu'/'nvme' per layer")
        return [arg] * n
    if isinstance(arg, Offload):
        if arg.gpu:
            raise ValueError(f"{what}=Offload(gpu={arg.gpu}): OffloadedLM computes on the CPU; give the fraction "
                             "to cpu= or nvme=")
        return split_by_fraction(list(nbytes), arg.cpu, arg.nvme)
    if isinstance(arg, (list, tuple)):
        if len(arg) != n or any(t not in TIERS for t in arg):
            raise ValueError(f"{what}={list(arg)!r}: a list needs one of 'cpu'/'nvme' per layer ({n} layers)")
        return list(arg)
    raise TypeError(f"{what}={arg!r}: expected 'cpu', 'nvme', 'auto', a tierstate.Offload or a list of tiers")


def _positive(name: str, v, allow_none: bool = True):
    if v is None and allow_none:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{name}={v!r}: expected an int >= 1")
    return v


class OffloadedLM:
    """A GPT-2 or Llama causal LM whose decoder layers' weights live in host RAM and/or NVMe
    files and whose KV cache lives on its own tier, generating with FlexGen's block schedule.

    Build it with :meth:`from_pretrained`; call :meth:`generate`. Close it (or use ``with``)
    to remove its NVMe files.
    """

    def __init__(self, adapter, weights: WeightStore, *, kv, nvme_dir, micro_batch, num_micro_batches,
                 dtype, tokenizer, plan=None, resident_nbytes: int = 0) -> None:
        self.adapter = adapter
        self.weights = weights
        self.kv = kv
        self.nvme_dir = nvme_dir
        self.micro_batch = micro_batch
        self.num_micro_batches = num_micro_batches
        self.dtype = dtype
        self.tokenizer = tokenizer
        self.plan = plan
        self.resident_nbytes = resident_nbytes
        self.last_stats: RoundStats | None = None
        self.closed = False

    @property
    def config(self):
        return self.adapter.model.config

    @property
    def weight_tiers(self) -> list[str]:
        return list(self.weights.tiers)

    # -- building ------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, model, *, weights="auto", kv="cpu", nvme_dir=None, micro_batch: int | None = None,
                        num_micro_batches: int = 1, dtype: torch.dtype | None = None,
                        prefetch: int = DEFAULT_PREFETCH,
                        attn_implementation: str | None = None, tokenizer=None, budget=None, workload=None,
                        hardware=None, compress: str | None = None, group: int | None = None) -> "OffloadedLM":
        """Load a causal LM's weights into their tiers, a tensor at a time.

        Args:
            model: a folder saved by ``save_pretrained`` (``config.json`` and
                ``model.safetensors`` or its shards; the weights are read with plain file reads
                straight into their tier, never the whole model in RAM), a single
                ``.safetensors`` file next to a ``config.json``, or a transformers
                ``GPT2LMHeadModel``/``LlamaForCausalLM`` object (its tensors are copied; the
                object is left as it was).
            weights: where the decoder layers' weights live: ``"cpu"`` (host RAM), ``"nvme"``
                (one O_DIRECT record per layer under ``nvme_dir``), ``ts.Offload(cpu=a,
                nvme=b)`` (the first layers up to ``a`` of the bytes in RAM), a list of
                ``"cpu"``/``"nvme"`` per layer, or ``"auto"`` (the planner chooses from the
                measured hardware and ``budget``). Embeddings, final norm and head stay in RAM.
            kv: where the KV cache lives, the same spellings, per layer.
            nvme_dir: folder for the NVMe files (``weights/`` and ``kv/`` are made inside and
                removed at close). Default: ``TIERSTATE_NVME_DIR`` or the default root.
            micro_batch: sequences per micro-batch (default: the batch / ``num_micro_batches``).
            num_micro_batches: micro-batches sharing each layer's weights per read.
            dtype: compute and storage dtype of floating weights (default: the checkpoint's).
            prefetch: NVMe layers read ahead of the one running (>= 1; default 2: with one,
                the disk idles between reads, see ``DEFAULT_PREFETCH``).
            attn_implementation: transformers' attention ("sdpa" by default, "eager").
            tokenizer: a tokenizer for string prompts (default: the folder's, when it has one).
            budget: for ``"auto"``: a ``tierstate.placement.generate_plan.GenerateBudget``
                (default: the RSS now plus 80% of the available RAM; the free disk).
            workload: for ``"auto"``: the ``GenerateWorkload(batch, prompt_len, new_tokens)``
                to plan for (default 8 prompts of 128 tokens, 32 new tokens each).
            hardware: for ``"auto"``: a ``GenerateHardware`` (default: the saved ``tierstate
                probe`` profile, else conservative rates; ``tierstate.generate.policy.
                measure_hardware`` measures them at the model's shapes: 11-27 s for a 7B model on
                a 2-vCPU VM).
            compress: ``"int8"`` or ``"int4"``: store the layers' matrices group-wise quantized
                (``group`` values per float32 scale, default 64; only with ``compress``) in
                their tiers, dequantized to ``dtype``
                when a layer is fetched (:mod:`tierstate.generate.compress`); None: as loaded.
                The planner and ``Offload`` fractions count the stored (compressed) bytes; the
                planner adds the compute buffer and the dequantization time.
                ``"lossless"`` (bf16 only): the layers kept on NVMe store each matrix's exponents
                in 4 bits (:mod:`tierstate.generate.lossless`): ~0.75x of their bytes read per
                step, decoded to the same bits, so the tokens are the uncompressed model's.
                Layers in RAM stay as they are; ``Offload`` fractions count the bf16 bytes.
        """
        from transformers import AutoConfig, PreTrainedModel  # noqa: PLC0415

        _positive("micro_batch", micro_batch)
        _positive("num_micro_batches", num_micro_batches, allow_none=False)
        _positive("prefetch", prefetch, allow_none=False)
        if group is None:
            group = DEFAULT_GROUP
        elif compress is None or compress == LOSSLESS:
            raise ValueError(f"group={group!r} applies to quantized layers: pass compress='int8' or 'int4' with it "
                             f"(compress={compress!r} has no groups)")
        if weights != "auto" and kv != "auto":  # what only the planner reads, given without it
            planner_inputs = (("budget", budget), ("workload", workload), ("hardware", hardware))
            given = [n for n, v in planner_inputs if v is not None]
            if given:
                raise ValueError(f"{', '.join(given)}: the planner's inputs, used only with weights='auto' or "
                                 "kv='auto'; drop them or let the planner choose")
        if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
            raise TypeError(f"dtype={dtype!r}: expected a floating torch.dtype (torch.float32, torch.bfloat16) or None")
        if nvme_dir is not None and not isinstance(nvme_dir, (str, os.PathLike)):
            raise TypeError(f"nvme_dir={nvme_dir!r}: expected a folder path (str or os.PathLike) or None")
        if isinstance(model, PreTrainedModel):
            config = model.config
            source = ModuleSource(model)
        elif isinstance(model, nn.Module):
            raise TypeError(f"model is a {type(model).__name__}: expected a transformers GPT2LMHeadModel or "
                            "LlamaForCausalLM, or the folder of one saved with save_pretrained")
        elif isinstance(model, (str, os.PathLike)):
            path = Path(model)
            if not path.exists():
                raise FileNotFoundError(2, "no such model folder or safetensors file", str(path))
            folder = path if path.is_dir() else path.parent
            if not (folder / "config.json").is_file():
                raise FileNotFoundError(2, "no config.json: pass the folder written by save_pretrained", str(folder))
            config = AutoConfig.from_pretrained(folder)
            source = SafetensorsSource(path)
            if tokenizer is None and any((folder / f).is_file() for f in ("tokenizer.json", "vocab.json",
                                                                           "tokenizer.model")):
                from transformers import AutoTokenizer  # noqa: PLC0415

                tokenizer = AutoTokenizer.from_pretrained(folder)
        else:
            raise TypeError(f"model={model!r}: expected a folder path or a transformers model")
        try:
            return cls._build(config, source, weights=weights, kv=kv, nvme_dir=nvme_dir, micro_batch=micro_batch,
                              num_micro_batches=num_micro_batches, dtype=dtype, prefetch=prefetch,
                              attn_implementation=attn_implementation, tokenizer=tokenizer, budget=budget,
                              workload=workload, hardware=hardware, compress=compress, group=group)
        finally:
            source.close()

    @classmethod
    def _build(cls, config, source, *, weights, kv, nvme_dir, micro_batch, num_micro_batches, dtype, prefetch,
               attn_implementation, tokenizer, budget, workload, hardware, compress, group) -> "OffloadedLM":
        adapter = build_meta(config, attn_implementation)
        model = adapter.model
        prefix = adapter.layer_prefix + "."
        if dtype is None:
            first = next(n for n, _ in iter_aliases(model) if n in source and source.spec(n)[0].is_floating_point)
            dtype = source.spec(first)[0]
        from .weight_store import layer_sizes  # noqa: PLC0415

        layer_nbytes, stored_nbytes = layer_sizes(adapter.layers, dtype, compress, group)
        plan = None
        if weights == "auto" or kv == "auto":
            from .policy import plan_for_model  # noqa: PLC0415

            plan = plan_for_model(config, dtype, layer_nbytes, stored_nbytes, budget=budget, nvme_dir=nvme_dir,
                                  micro_batch=micro_batch, num_micro_batches=None if micro_batch is None
                                  else num_micro_batches, workload=workload, hardware=hardware, prefetch=prefetch,
                                  lossless=compress == LOSSLESS)
            if weights == "auto":
                weights = plan.weight_tiers
            if kv == "auto":
                kv = plan.kv_tiers
            if micro_batch is None:
                micro_batch, num_micro_batches = plan.micro_batch, plan.num_micro_batches
        # lossless layers sit in RAM uncoded: fractions of RAM count their bf16 bytes
        w_tiers = _tiers(weights, layer_nbytes if compress == LOSSLESS else stored_nbytes or layer_nbytes,
                         "weights")
        kv_tiers = _tiers(kv, [1] * len(layer_nbytes), "kv")
        if nvme_dir is None and isinstance(weights, Offload) and weights.nvme_dir is not None:
            nvme_dir = weights.nvme_dirs[0]
        # resident tensors (embeddings, final norm, head): loaded now, in RAM
        resident = 0
        with torch.no_grad():
            for first, names in iter_aliases(model):
                if first.startswith(prefix):
                    continue
                key = next((n for n in names if n in source), None)
                if key is None:
                    raise ValueError(f"the checkpoint has no tensor {first!r}"
                                     + (f" (nor {', '.join(names[1:])})" if len(names) > 1 else "")
                                     + ": it was saved from another architecture")
                mod_name, _, attr = first.rpartition(".")
                mod = model.get_submodule(mod_name)
                meta = getattr(mod, attr)
                t = torch.empty(meta.shape, dtype=dtype if meta.dtype.is_floating_point else meta.dtype)
                source.read_into(key, t)
                resident += t.numel() * t.element_size()
                value = nn.Parameter(t, requires_grad=False) if isinstance(meta, nn.Parameter) else t
                for n in names:
                    mn, _, a = n.rpartition(".")
                    m = model.get_submodule(mn)
                    if a in m._parameters:
                        m._parameters[a] = value
                    else:
                        m._buffers[a] = value
        store = WeightStore(adapter.layers, w_tiers, dtype, nvme_dir=nvme_dir, prefetch=prefetch, compress=compress,
                            group=group)
        try:
            missing = [f"{prefix}{i}.{s.name}" for i, (slots, _) in enumerate(store.layouts) for s in slots
                       if f"{prefix}{i}.{s.name}" not in source]
            if missing:
                raise ValueError(f"the checkpoint lacks {len(missing)} layer tensor(s), e.g. {missing[:4]}: it was "
                                 "saved from another architecture or is incomplete")
            store.fill(source, [f"{prefix}{i}" for i in range(len(adapter.layers))])
        except BaseException:
            store.close()
            raise
        return cls(adapter, store, kv=kv_tiers, nvme_dir=nvme_dir, micro_batch=micro_batch,
                   num_micro_batches=num_micro_batches, dtype=dtype, tokenizer=tokenizer, plan=plan,
                   resident_nbytes=resident)

    # -- generating ----------------------------------------------------------------------------
    def _encode(self, inputs, attention_mask, pad_token_id):
        if isinstance(inputs, Tensor):
            if inputs.dim() != 2 or inputs.dtype not in (torch.int64, torch.int32):
                raise ValueError(f"input_ids: expected a [batch, tokens] integer tensor, got {inputs.dtype} "
                                 f"{list(inputs.shape)}")
            ids = inputs.long().cpu()
            if attention_mask is None:
                mask = torch.ones_like(ids)
            else:
                if not isinstance(attention_mask, Tensor) or attention_mask.shape != ids.shape:
                    raise ValueError(f"attention_mask: expected a tensor of input_ids' shape {list(ids.shape)}")
                mask = attention_mask.long().cpu()
            return ids, mask
        if isinstance(inputs, str) or (isinstance(inputs, (list, tuple)) and inputs
                                       and all(isinstance(p, str) for p in inputs)):
            prompts = [inputs] if isinstance(inputs, str) else list(inputs)
            if self.tokenizer is None:
                raise ValueError("string prompts need a tokenizer: pass tokenizer= to from_pretrained, or token ids")
            seqs = [self.tokenizer(p)["input_ids"] for p in prompts]
        elif isinstance(inputs, (list, tuple)) and inputs and all(isinstance(p, (list, tuple)) for p in inputs):
            seqs = [list(p) for p in inputs]
        else:
            raise TypeError(f"inputs={inputs!r:.80}: expected a [batch, tokens] tensor, a list of token-id lists "
                            "or a list of strings")
        if any(len(s) == 0 for s in seqs):
            raise ValueError("inputs: every prompt needs at least one token")
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, s in enumerate(seqs):  # left padding: every prompt ends where generation starts
            ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s):] = 1
        return ids, mask

    def generate(self, inputs, attention_mask: Tensor | None = None, *, max_new_tokens: int,
                 do_sample: bool = False, temperature: float | None = None, top_k: int | None = None,
                 top_p: float | None = None, seed: int | None = None, eos_token_id=None,
                 pad_token_id: int | None = None, micro_batch: int | None = None,
                 num_micro_batches: int | None = None, progress: Callable[[int, int], None] | None = None) -> Tensor:
        """Generate ``max_new_tokens`` tokens per prompt (fewer when every row has stopped).

        Returns ``[batch, prompt + new]`` token ids as transformers' ``generate`` does (rows
        that stopped early continue with ``pad_token_id``). ``inputs``: a ``[batch, tokens]``
        tensor (left-padded, with ``attention_mask``), a list of token-id lists, or a list
        of strings (padded on the left here). ``eos_token_id``: an int or a list of stop
        tokens (default: the config's). Sampling draws from ``torch.Generator().manual_seed(seed)``
        (see :mod:`tierstate.generate.sampling` for what matches transformers).
        """
        if self.closed:
            raise ValueError("this OffloadedLM is closed: build a new one with OffloadedLM.from_pretrained")
        _positive("max_new_tokens", max_new_tokens, allow_none=False)
        mb = _positive("micro_batch", micro_batch) or self.micro_batch
        nmb = _positive("num_micro_batches", num_micro_batches) or self.num_micro_batches
        cfg = self.config
        if eos_token_id is None:
            eos_token_id = getattr(cfg, "eos_token_id", None)
        eos_list = [] if eos_token_id is None else ([eos_token_id] if isinstance(eos_token_id, int)
                                                    else list(eos_token_id))
        if any(not isinstance(e, int) or isinstance(e, bool) for e in eos_list):
            raise TypeError(f"eos_token_id={eos_token_id!r}: expected an int, a list of ints, or None")
        if pad_token_id is None:
            pad_token_id = getattr(cfg, "pad_token_id", None)
            if pad_token_id is None:
                pad_token_id = eos_list[0] if eos_list else 0
        sampler = Sampler(do_sample, temperature, top_k, top_p, seed)
        ids, mask = self._encode(inputs, attention_mask, pad_token_id)
        batch = ids.shape[0]
        if mb is None:
            mb = math.ceil(batch / nmb)
        round_rows = mb * nmb
        eos = torch.tensor(eos_list, dtype=torch.long) if eos_list else None
        allow_skip = bool(mask.all())
        outs, total = [], RoundStats()
        for r0 in range(0, batch, round_rows):
            rows = min(round_rows, batch - r0)
            sizes = [min(mb, rows - k) for k in range(0, rows, mb)]
            kv = KVStore(len(self.adapter.layers), sizes, self.adapter.kv_heads, self.adapter.head_dim,
                         ids.shape[1] + max_new_tokens, self.dtype, self.kv, nvme_dir=self.nvme_dir)
            try:
                w0, ws0 = self.weights.read_bytes, self.weights.stall_seconds
                out, st = run_round(self.adapter, self.weights, kv, ids[r0:r0 + rows], mask[r0:r0 + rows],
                                    micro_sizes=sizes, max_new_tokens=max_new_tokens, sampler=sampler, eos=eos,
                                    pad_token_id=pad_token_id, allow_mask_skip=allow_skip, dtype=self.dtype,
                                    progress=progress)
                st.weight_read_bytes -= w0
                st.weight_stall_seconds -= ws0
            finally:
                self.weights.release_all()  # a round that failed part-way holds read-ahead buffers
                kv.close()
            outs.append(out)
            for f in ("sequences", "prefill_seconds", "decode_seconds", "weight_read_bytes", "kv_read_bytes",
                      "kv_write_bytes", "weight_stall_seconds", "kv_stall_seconds"):
                setattr(total, f, getattr(total, f) + getattr(st, f))
            total.steps = max(total.steps, st.steps)
        width = max(o.shape[1] for o in outs)
        outs = [torch.cat([o, o.new_full((o.shape[0], width - o.shape[1]), pad_token_id)], dim=1) for o in outs]
        self.last_stats = total
        return torch.cat(outs)

    def stats(self) -> dict:
        """The last generate call's figures: tokens, seconds, bytes read, tokens/s."""
        s = self.last_stats
        if s is None:
            return {}
        seconds = s.prefill_seconds + s.decode_seconds
        tokens = s.sequences * s.steps
        return {"sequences": s.sequences, "new_tokens_per_sequence": s.steps, "tokens": tokens,
                "seconds": seconds, "prefill_seconds": s.prefill_seconds, "decode_seconds": s.decode_seconds,
                "tokens_per_s": tokens / seconds if seconds > 0 else float("nan"),
                "weight_read_bytes": s.weight_read_bytes, "kv_read_bytes": s.kv_read_bytes,
                "kv_write_bytes": s.kv_write_bytes, "weight_stall_seconds": s.weight_stall_seconds,
                "kv_stall_seconds": s.kv_stall_seconds,
                "host_weight_bytes": self.weights.host_nbytes + self.resident_nbytes,
                "nvme_weight_bytes": self.weights.nvme_nbytes, "weight_pool_bytes": self.weights.pool_nbytes}

    def close(self) -> None:
        """Remove the NVMe files and free the host images. Idempotent."""
        if not self.closed:
            self.closed = True
            self.weights.close()

    def __enter__(self) -> "OffloadedLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        t = self.weights.tiers
        return (f"OffloadedLM({self.adapter.family}, {len(t)} layers: {t.count('cpu')} in RAM, {t.count('nvme')} on "
                f"NVMe; KV {self.kv.count('cpu')} layers in RAM, {self.kv.count('nvme')} on NVMe; "
                f"{self.dtype})")
