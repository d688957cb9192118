"""The generation planner: where a causal LM's layer weights and KV cache live, and how the
batch is cut into micro-batches, to maximize tokens/s within RAM and disk budgets.

Pure arithmetic over the model's shape, the workload, the budgets and measured rates: no
tensor, no file. :func:`plan_generate` returns a :class:`GeneratePlan` that
``OffloadedLM.from_pretrained(..., weights="auto")`` follows and ``tierstate plan MODEL
--generate`` prints with its rejected alternatives.

[Note: the time model of the block schedule]
A round of ``R = micro_batch x num_micro_batches`` sequences generates its tokens layer-major
(:mod:`tierstate.generate.schedule`). For one step at context length ``T`` (``q`` new tokens
per sequence: the prompt at prefill, 1 after), layer ``l`` costs

    compute_l = sum over micro-batches j of
                  call + max(2 * mb_j * q * params_l / flops,  weight_bytes_l / ram_bw)
                       + (2 * mb_j * T * kv_row) / ram_bw            (attention reads the cache)
    io_l      = weight_bytes_l / disk_read                 if the layer's weights are on NVMe
              + sum_j (kv_read_bytes_j / disk_read + kv_write_bytes_j / disk_write)  if its KV is

and the step takes ``sum_l max(compute_l, io_l)``: the next layers' weights (``prefetch`` of
them, :data:`DEFAULT_PREFETCH`) and the next layer's KV records are read while this one
computes, so a layer waits for the slower of the two. ``call`` is the fixed cost of one layer
call (Python, transformers' module dispatch): ~0.1-0.5 ms, measured, and what makes many
tiny micro-batches slow. The weights are read from RAM once per micro-batch (a decode step is
a matrix-vector product per sequence row block, bound by memory bandwidth), which is why
fewer, larger micro-batches win when RAM, not the disk, is the limit. The head
(``vocab x hidden``) runs once per micro-batch per step the same way. Tokens/s = sequences x
new tokens / the rounds' time.

A layer stored compressed (``compress="int8"``/``"int4"``) reads its stored bytes from disk
and is dequantized once per step into the compute buffer before its micro-batches run: its
``compute_l`` gains ``(stored_bytes_l + weight_bytes_l) / dequant_bw`` (the codes read and the
compute dtype written, at the measured rate of the native kernel; ``ram_bw`` when none was
measured. On a 2-vCPU Xeon it moved 17 GB/s of that traffic for a 51.4M-value layer, and
36-42 GB/s for a 12.8M-value one, which the CPU's 480 MB L3 held),
and its ``io_l`` reads ``stored_bytes_l`` instead of ``weight_bytes_l``. A ``"lossless"``
store (:mod:`tierstate.generate.lossless`) codes only its NVMe layers: those read and decode
their stored bytes as above, while layers in RAM keep ``weight_bytes_l`` and no decode.

[Note: the memory model]
RAM = ``base`` (the process before any weight: Python, torch, transformers; measured)
+ resident tensors (embeddings, final norm, head) + layers kept in RAM (their stored bytes)
+ the NVMe weight pool (``prefetch + 1`` buffers of the largest stored record) + with
compression, the compute buffer (the largest layer in the compute dtype) + KV records in RAM
+ the NVMe KV pool (:func:`kv_pool_records` buffers of the largest record, and one more of
its size: the head-major scratch the attention over an NVMe record reads) + activations (the
hidden states of the whole round, and one micro-batch's largest temporaries at prefill:
``q x (6 hidden + 4 intermediate)`` elements and a float32 norm, plus the round's float32
logits) + a runtime constant (first-use imports, thread pools; measured). Disk = the NVMe
weight records + the NVMe KV records.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Sequence

from .plan_inputs import PlanError, gib

RECORD_ALIGN = 4096  # the O_DIRECT record alignment of tierstate.weights.homes
# NVMe layers read ahead of the one running. Two, not one: with a single read in flight the
# disk idles from each read's end until the next is queued. 16-layer Llama (hidden 2048), 14
# layers on NVMe, 4 prompts, 24 new tokens, 2-vCPU Xeon, OMP_WAIT_POLICY=PASSIVE, two runs each: bf16 4.22/4.13 ->
# 4.76/4.67 tokens/s, int8 layers 6.50/6.44 -> 8.73/8.86, int4 11.77/12.09 -> 14.73/14.87;
# three ahead: int4 15.84/14.43. The cost is one more buffer of the largest stored layer.
DEFAULT_PREFETCH = 2
# RSS a generate call adds beyond the parts the model names: modules imported on first use
# (masking, attention), the I/O engine's and torch's thread pools, allocator slack. Measured
# 17.7 MB on two runs of benchmarks/generate_capacity.py --size small (all-RAM and streamed);
# 24 MiB keeps a margin.
RUNTIME_OVERHEAD = 24 << 20


def _up(n: float) -> int:
    return int(math.ceil(n / RECORD_ALIGN) * RECORD_ALIGN)


@dataclass(frozen=True)
class GenerateShape:
    """What the planner needs of a causal LM."""

    family: str
    n_layers: int
    hidden: int
    intermediate: int
    vocab: int
    n_heads: int
    kv_heads: int
    head_dim: int
    layer_bytes: tuple[int, ...]  # each layer's image (its parameters, 64-byte aligned)
    resident_bytes: int  # embeddings, final norm, head (a tied head once)
    dtype_bytes: int
    # each layer as stored in its tier when compressed (codes, scales, the vectors as they
    # are); None: as layer_bytes (not compressed)
    stored_layer_bytes: tuple[int, ...] | None = None
    # compress="lossless": only NVMe layers are coded; RAM layers, the weight pool and the
    # NVMe records keep layer_bytes (a coded record fills part of its room)
    lossless: bool = False

    @property
    def layer_params(self) -> tuple[int, ...]:
        return tuple(b // self.dtype_bytes for b in self.layer_bytes)

    @property
    def compressed(self) -> bool:
        return self.stored_layer_bytes is not None

    @property
    def stored_bytes(self) -> tuple[int, ...]:
        """Each layer's bytes in RAM or on disk (the compressed size when compressed)."""
        return self.stored_layer_bytes if self.stored_layer_bytes is not None else self.layer_bytes


def shape_from_config(config, dtype_bytes: int, layer_bytes: Sequence[int] | None = None,
                      stored_layer_bytes: Sequence[int] | None = None, lossless: bool = False) -> GenerateShape:
    """A :class:`GenerateShape` from a transformers GPT-2 or Llama config (arithmetic only);
    ``stored_layer_bytes``: each layer's compressed size
    (:func:`tierstate.generate.weight_store.layer_sizes` computes both lists from the model)."""
    mt = getattr(config, "model_type", None)
    if mt == "gpt2":
        h, L, nh = config.n_embd, config.n_layer, config.n_head
        inter = config.n_inner or 4 * h
        kvh, hd, vocab = nh, h // nh, config.vocab_size
        per_layer = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * inter + inter) + (inter * h + h)
        resident = (vocab * h + config.n_positions * h + 2 * h) * dtype_bytes
    elif mt == "llama":
        h, L, nh = config.hidden_size, config.num_hidden_layers, config.num_attention_heads
        inter = config.intermediate_size
        kvh = config.num_key_value_heads or nh
        hd = getattr(config, "head_dim", None) or h // nh
        vocab = config.vocab_size
        bias = 1 if getattr(config, "attention_bias", False) else 0
        per_layer = (2 * h + h * nh * hd + 2 * h * kvh * hd + nh * hd * h + 3 * h * inter
                     + bias * (nh * hd + 2 * kvh * hd + h))
        tied = getattr(config, "tie_word_embeddings", False)
        resident = (vocab * h * (1 if tied else 2) + h) * dtype_bytes
    else:
        raise ValueError(f"model_type={mt!r}: the generation planner knows gpt2 and llama")
    if layer_bytes is None:
        layer_bytes = [per_layer * dtype_bytes] * L
    if stored_layer_bytes is not None and len(stored_layer_bytes) != len(layer_bytes):
        raise ValueError(f"stored_layer_bytes: {len(stored_layer_bytes)} entries for {len(layer_bytes)} layers")
    if lossless and stored_layer_bytes is None:
        raise ValueError("lossless=True needs stored_layer_bytes (the coded layers' estimated sizes)")
    stored = None if stored_layer_bytes is None else tuple(int(b) for b in stored_layer_bytes)
    return GenerateShape(mt, L, h, inter, vocab, nh, kvh, hd, tuple(int(b) for b in layer_bytes), int(resident),
                         dtype_bytes, stored, bool(lossless))


@dataclass(frozen=True)
class GenerateWorkload:
    batch: int  # sequences to generate for
    prompt_len: int  # tokens per prompt (padded)
    new_tokens: int


@dataclass(frozen=True)
class GenerateHardware:
    """Measured rates (see ``tierstate.generate.calibrate``) or given ones."""

    source: str
    flops: float  # FLOP/s of the layers' matrix products (the compute dtype)
    ram_bandwidth: float  # B/s of weights streamed through a matrix-vector product
    disk_read: float  # B/s, O_DIRECT
    disk_write: float
    call_seconds: float  # one layer call's fixed cost
    base_rss: int  # bytes of the process before any weight
    # B/s of codes read plus compute dtype written when compressed layers are dequantized
    # (measured by tierstate.generate.policy.measure_hardware); 0: ram_bandwidth
    dequant_bandwidth: float = 0.0

    @classmethod
    def from_rates(cls, hardware, *, call_seconds: float = 3e-4, base_rss: int = 700 << 20) -> "GenerateHardware":
        """From a :class:`~tierstate.placement.plan_inputs.Hardware` (a ``tierstate probe``
        profile): its matmul rate, RAM bandwidth and disk rates."""
        return cls(hardware.source, flops=hardware.host_flops, ram_bandwidth=hardware.host_bandwidth,
                   disk_read=hardware.disk_read, disk_write=hardware.disk_write, call_seconds=call_seconds,
                   base_rss=base_rss)

    @classmethod
    def conservative(cls) -> "GenerateHardware":
        return cls("conservative defaults (nothing measured)", flops=50e9, ram_bandwidth=10e9, disk_read=0.5e9,
                   disk_write=0.5e9, call_seconds=3e-4, base_rss=700 << 20)


@dataclass(frozen=True)
class GenerateBudget:
    ram: int | None = None  # bytes of RAM the process may use (peak RSS), None: unchecked
    disk: int | None = None  # bytes under the NVMe folder, None: unchecked


@dataclass(frozen=True)
class Choice:
    weight_cpu_layers: int  # the first k layers' weights in RAM, the rest on NVMe
    kv_cpu_layers: int  # the first m layers' KV in RAM, the rest on NVMe
    micro_batch: int
    num_micro_batches: int


@dataclass(frozen=True)
class GeneratePlan:
    """The chosen placement and batch cut, what it is predicted to do, and what was rejected."""

    weight_tiers: tuple[str, ...]
    kv_tiers: tuple[str, ...]
    micro_batch: int
    num_micro_batches: int
    tokens_per_s: float
    seconds: float
    bottleneck: str
    ram_bytes: int
    disk_bytes: int
    breakdown: dict
    hardware_source: str
    rejected: tuple[tuple[str, str], ...] = field(default=())

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> list[str]:
        w, k = self.weight_tiers, self.kv_tiers
        lines = [
            f"weights: {w.count('cpu')} layers in RAM, {w.count('nvme')} on NVMe; "
            f"KV cache: {k.count('cpu')} layers in RAM, {k.count('nvme')} on NVMe",
            f"batch cut: micro_batch={self.micro_batch} x num_micro_batches={self.num_micro_batches}",
            f"predicted: {self.tokens_per_s:.2f} tokens/s ({self.seconds:.2f} s), bottleneck: {self.bottleneck}",
            f"memory: RAM {gib(self.ram_bytes)} (peak RSS), disk {gib(self.disk_bytes)}",
            f"rates: {self.hardware_source}",
        ]
        if self.rejected:
            lines.append("rejected:")
            lines += [f"  {what}: {why}" for what, why in self.rejected]
        return lines


def _describe(c: Choice, L: int) -> str:
    return (f"weights {c.weight_cpu_layers}/{L} layers in RAM, KV {c.kv_cpu_layers}/{L} in RAM, "
            f"micro_batch={c.micro_batch} x {c.num_micro_batches}")


def _cut(n: int, mb: int) -> list[int]:
    return [min(mb, n - k) for k in range(0, n, mb)]


def kv_row_bytes(shape: GenerateShape, mb: int) -> int:
    return mb * shape.kv_heads * shape.head_dim * shape.dtype_bytes


def kv_pool_records(micro_batches: int, nvme_records: int) -> int:
    """Buffers of the NVMe KV pool: a layer's records in use, the next layer's read ahead, and
    one whose write may still be in flight (``2 J + 1`` for ``J`` micro-batches).

    The next layer's records are read before its weights because a disk serves its queue in
    order: read one record ahead instead (a pool of 3), the second micro-batch's record was
    asked for after the next layer's weights (25 MB) and waited for all of them, with the CPU
    idle. With weights and KV on NVMe (8 layers, hidden 1024, 2 micro-batches of 4, a 2-vCPU
    Xeon) the KV wait was 0.72-0.89 s of a 1.9-2.1 s generate."""
    return min(2 * micro_batches + 1, nvme_records)


def memory(shape: GenerateShape, wl: GenerateWorkload, hw: GenerateHardware, c: Choice,
           prefetch: int = DEFAULT_PREFETCH) -> tuple[int, int, dict]:
    """(RAM, disk, parts) of a choice: see the memory model note."""
    L = shape.n_layers
    k, m = c.weight_cpu_layers, c.kv_cpu_layers
    rows = min(c.micro_batch * c.num_micro_batches, wl.batch)
    sizes = _cut(rows, c.micro_batch)
    max_len = wl.prompt_len + wl.new_tokens
    room = shape.layer_bytes if shape.lossless else shape.stored_bytes  # RAM images and NVMe records
    host_w = sum(room[:k])
    nvme_records = [_up(b) for b in room[k:]]
    w_pool = min(prefetch + 1, len(nvme_records)) * max(nvme_records, default=0)
    decoded = shape.compressed and (k < L or not shape.lossless)
    compute_buffer = max(shape.layer_bytes, default=0) if decoded else 0
    kv_rec = [2 * _up(max_len * kv_row_bytes(shape, mb)) for mb in sizes]
    kv_host = m * sum(kv_rec)
    kv_pool = kv_pool_records(len(sizes), (L - m) * len(sizes)) * max(kv_rec) if m < L else 0
    kv_scratch = max(kv_rec) if m < L else 0
    e = shape.dtype_bytes
    # the round's hidden states; one micro-batch's prefill temporaries (q, k, v, attention out,
    # residual, the float32 norm; gate, up, their product and the activation of the MLP); logits
    acts = (rows * wl.prompt_len * shape.hidden * e
            + c.micro_batch * wl.prompt_len * ((6 * shape.hidden + 4 * shape.intermediate) * e + 4 * shape.hidden)
            + 2 * rows * shape.vocab * 4)
    parts = {"base": hw.base_rss, "resident": shape.resident_bytes, "weights_in_ram": host_w, "weight_pool": w_pool,
             "compute_buffer": compute_buffer, "kv_in_ram": kv_host, "kv_pool": kv_pool, "kv_scratch": kv_scratch,
             "activations": acts,
             "runtime": RUNTIME_OVERHEAD}
    disk = sum(nvme_records) + (L - m) * sum(kv_rec)
    return sum(parts.values()), disk, parts


def _layer_classes(shape: GenerateShape, k: int, m: int) -> dict[tuple[int, int, int, bool, bool], int]:
    """Layers that cost the same: (bytes, stored bytes, params, weights on NVMe, KV on NVMe) -> how many."""
    out: dict[tuple[int, int, int, bool, bool], int] = {}
    for layer, (wb, sb, params) in enumerate(zip(shape.layer_bytes, shape.stored_bytes, shape.layer_params)):
        key = (wb, sb, params, layer >= k, layer >= m)
        out[key] = out.get(key, 0) + 1
    return out


def _step(shape: GenerateShape, hw: GenerateHardware, classes, sizes: list[int], q: int, T: int, acc: dict) -> float:
    """One step of one round: every layer over every micro-batch, then the head. Micro-batches
    of one size cost the same: a round has at most two sizes, priced once each."""
    counts: dict[int, int] = {}
    for mb in sizes:
        counts[mb] = counts.get(mb, 0) + 1
    total = 0.0
    for (wb, sb, params, w_nvme, kv_nvme), count in classes.items():
        comp = calls = ram = kv_io = 0.0
        if shape.compressed and (w_nvme or not shape.lossless):  # decoded once per step, before the micro-batches
            comp += (sb + wb) / (hw.dequant_bandwidth or hw.ram_bandwidth)
        for mb, n in counts.items():
            row = kv_row_bytes(shape, mb)
            comp += n * (max(2 * mb * q * params / hw.flops, wb / hw.ram_bandwidth)
                         + 4 * mb * q * T * shape.n_heads * shape.head_dim / hw.flops)
            calls += n * hw.call_seconds
            ram += n * 2 * T * row / hw.ram_bandwidth
            if kv_nvme:
                past = T - q
                kv_io += n * (2 * _up(past * row) / hw.disk_read if past else 0.0)
                kv_io += n * 2 * (_up(T * row) - (past * row) // RECORD_ALIGN * RECORD_ALIGN) / hw.disk_write
        w_io = sb / hw.disk_read if w_nvme else 0.0
        cpu_side, io = comp + calls + ram, w_io + kv_io
        t = max(cpu_side, io) * count
        total += t
        if io > cpu_side:
            acc["disk_weights" if w_io >= kv_io else "disk_kv"] += t
        else:
            acc[max((("compute", comp), ("calls", calls), ("ram", ram)), key=lambda kv: kv[1])[0]] += t
    head = sum(n * (hw.call_seconds + max(2 * mb * shape.vocab * shape.hidden / hw.flops,
                                          shape.vocab * shape.hidden * shape.dtype_bytes / hw.ram_bandwidth))
               for mb, n in counts.items())
    acc["compute"] += head
    return total + head


DECODE_SAMPLES = 8  # decode steps priced exactly; the others are interpolated (cost is near-linear in T)


def timing(shape: GenerateShape, wl: GenerateWorkload, hw: GenerateHardware, c: Choice) -> tuple[float, dict]:
    """Seconds for the whole workload and where they go (see the time model note)."""
    classes = _layer_classes(shape, c.weight_cpu_layers, c.kv_cpu_layers)
    rows = c.micro_batch * c.num_micro_batches
    acc = {"compute": 0.0, "calls": 0.0, "ram": 0.0, "disk_weights": 0.0, "disk_kv": 0.0}
    total = 0.0
    full, last = divmod(wl.batch, rows)
    for n_rows, times in ((rows, full), (last, 1 if last else 0)):
        if not times:
            continue
        sizes = _cut(n_rows, c.micro_batch)
        part = {key: 0.0 for key in acc}
        t = _step(shape, hw, classes, sizes, wl.prompt_len, wl.prompt_len, part)
        decode = wl.new_tokens - 1
        if decode:
            picks = sorted({1 + round(i * (decode - 1) / max(DECODE_SAMPLES - 1, 1)) for i in range(DECODE_SAMPLES)})
            picks = [p for p in picks if 1 <= p <= decode]
            sub = {key: 0.0 for key in acc}
            s = sum(_step(shape, hw, classes, sizes, 1, wl.prompt_len + p, sub) for p in picks)
            scale = decode / len(picks)
            t += s * scale
            for key in part:
                part[key] += sub[key] * scale
        total += t * times
        for key in acc:
            acc[key] += part[key] * times
    return total, acc


_BOTTLENECK = {"compute": "compute (matrix products on the CPU)", "calls": "per-layer-call overhead (many small "
               "micro-batches)", "ram": "RAM bandwidth (KV cache reads)", "disk_weights": "disk reads of the weights",
               "disk_kv": "disk traffic of the KV cache"}


def _candidates(shape: GenerateShape, wl: GenerateWorkload, micro_batch: int | None,
                num_micro_batches: int | None) -> list[Choice]:
    L = shape.n_layers
    ks = sorted(set(range(L + 1))) if L <= 48 else sorted(set(list(range(0, L + 1, max(1, L // 24))) + [L]))
    ms = sorted({0, L // 4, L // 2, (3 * L) // 4, L})
    if micro_batch is not None:
        mbs = [micro_batch]
    else:
        mbs = sorted({min(2 ** i, wl.batch) for i in range(0, 16) if 2 ** i <= 2 * wl.batch} | {wl.batch})
    out = []
    for mb in mbs:
        if num_micro_batches is not None:
            nmbs = [num_micro_batches]
        else:
            most = math.ceil(wl.batch / mb)
            nmbs = sorted({min(2 ** i, most) for i in range(0, 16) if 2 ** i <= 2 * most} | {most})
        for nmb in nmbs:
            for k in ks:
                for m in ms:
                    out.append(Choice(k, m, mb, nmb))
    return out


def plan_generate(shape: GenerateShape, workload: GenerateWorkload, hardware: GenerateHardware,
                  budget: GenerateBudget = GenerateBudget(), *, micro_batch: int | None = None,
                  num_micro_batches: int | None = None, prefetch: int = DEFAULT_PREFETCH,
                  show_rejected: int = 6) -> GeneratePlan:
    """The fastest placement and batch cut that fits ``budget``; ``PlanError`` naming the
    smallest need when none does."""
    for name, v in (("batch", workload.batch), ("prompt_len", workload.prompt_len),
                    ("new_tokens", workload.new_tokens)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r}: expected an int >= 1")
    L = shape.n_layers
    scored, refused = [], []
    for c in _candidates(shape, workload, micro_batch, num_micro_batches):
        ram, disk, parts = memory(shape, workload, hardware, c, prefetch)
        if budget.ram is not None and ram > budget.ram:
            refused.append((c, ram, disk, f"needs {gib(ram)} of RAM, the budget is {gib(budget.ram)}"))
            continue
        if budget.disk is not None and disk > budget.disk:
            refused.append((c, ram, disk, f"needs {gib(disk)} of disk, the budget is {gib(budget.disk)}"))
            continue
        scored.append((c, ram, disk, parts))
    if not scored:
        least = min(refused, key=lambda r: r[1])
        raise PlanError(f"no placement fits: the smallest ({_describe(least[0], L)}) {least[3]}; raise the RAM "
                        "budget, give disk space, or lower the batch or the prompt length")
    timed = []
    for c, ram, disk, parts in scored:
        secs, acc = timing(shape, workload, hardware, c)
        timed.append((secs, -c.weight_cpu_layers, -c.kv_cpu_layers, c, ram, disk, parts, acc))
    timed.sort(key=lambda t: (t[0], t[1], t[2]))
    secs, _, _, best, ram, disk, parts, acc = timed[0]
    tokens = workload.batch * workload.new_tokens
    rejected = []
    seen = set()
    for t in timed[1:]:
        c = t[3]
        key = (c.micro_batch, c.num_micro_batches, c.weight_cpu_layers == L, c.kv_cpu_layers == L)
        if key in seen:
            continue
        seen.add(key)
        rejected.append((_describe(c, L), f"{tokens / t[0]:.2f} tokens/s predicted ({t[0] / secs:.2f}x the time)"))
        if len(rejected) >= show_rejected // 2:
            break
    for c, r, d, why in sorted(refused, key=lambda r: -r[0].weight_cpu_layers)[: show_rejected - len(rejected)]:
        rejected.append((_describe(c, L), why))
    bottleneck = _BOTTLENECK[max(acc, key=acc.get)]
    return GeneratePlan(
        weight_tiers=tuple("cpu" if i < best.weight_cpu_layers else "nvme" for i in range(L)),
        kv_tiers=tuple("cpu" if i < best.kv_cpu_layers else "nvme" for i in range(L)),
        micro_batch=best.micro_batch, num_micro_batches=best.num_micro_batches, tokens_per_s=tokens / secs,
        seconds=secs, bottleneck=bottleneck, ram_bytes=ram, disk_bytes=disk,
        breakdown={"ram_parts": parts, "seconds_by_limit": acc}, hardware_source=hardware.source,
        rejected=tuple(rejected))
