"""The inputs of the generation planner on this machine: rates (measured now, or from the
saved ``tierstate probe`` profile), the process's base RSS, and default budgets.

The arithmetic is :mod:`tierstate.placement.generate_plan`; this module measures.
"""
from __future__ import annotations

import copy
import itertools
import os
import time
from pathlib import Path

import torch

from ..placement.auto import HOST_FRACTION, existing_ancestor
from ..placement.defaults import default_nvme_root
from ..placement.generate_plan import (DEFAULT_PREFETCH, GenerateBudget, GenerateHardware, GeneratePlan,
                                       GenerateWorkload, plan_generate, shape_from_config)

DEFAULT_WORKLOAD = GenerateWorkload(batch=8, prompt_len=128, new_tokens=32)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def available_ram() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def default_budget(nvme_dir) -> GenerateBudget:
    """RAM: what the process holds now plus ``HOST_FRACTION`` of the available RAM; disk: the
    free space where the NVMe files would go."""
    from ..io import free_bytes  # noqa: PLC0415

    where = existing_ancestor(nvme_dir if nvme_dir is not None else default_nvme_root())
    return GenerateBudget(ram=rss_bytes() + int(HOST_FRACTION * available_ram()), disk=free_bytes(where))


def _median_time(fn, reps: int, *, min_seconds: float = 0.0, max_reps: int | None = None) -> float:
    """Median seconds of ``fn()`` after one untimed call: ``reps`` timed calls, more (up to
    ``max_reps``) until ``min_seconds`` have been spent timing."""
    fn()
    times = []
    spent = 0.0
    while len(times) < reps or (spent < min_seconds and len(times) < (max_reps or reps)):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        spent += times[-1]
    times.sort()
    return times[len(times) // 2]


# Timing the probes' layer calls for this long at least: the median of 24 decode calls (3 ms
# each, hidden 1024) read 6.9-9.7 GB/s in six probes of one process, of 160 calls 8.4-8.5
# (2-vCPU Zen 4, 2026-12-06), and the planner's all-in-RAM error moved with it.
_PROBE_SECONDS = 0.5


def measure_hardware(config, dtype: torch.dtype, nvme_dir=None, *, disk_bytes: int = 256 << 20,
                     reps: int = 5) -> GenerateHardware:
    """Rates for this model on this machine (for Llama-2-7B shapes 11 s in fp32 and 27 s in bf16
    on a 2-vCPU Zen 1 EPYC without bf16 matrix units, 2026-12-04): the matrix-product rate at the
    model's shapes, the rate weights stream through a matrix-vector product (a 128 MiB weight,
    beyond any cache), O_DIRECT disk rates (``disk_bytes`` written and read under the NVMe
    folder), one layer call's fixed cost (a layer of the model's family at hidden size 64);
    the two compute rates lowered to what one real layer of the model achieves
    (:func:`_real_layer_rates`)."""
    from ..placement.probe import measure_disk  # noqa: PLC0415
    from .adapters import LayerCache, build_meta  # noqa: PLC0415

    shape = shape_from_config(config, torch.empty(0, dtype=dtype).element_size())
    h, inter = min(shape.hidden, 4096), min(shape.intermediate, 11008)
    with torch.no_grad():
        x = torch.randn(64, h, dtype=dtype)
        w = torch.randn(inter, h, dtype=dtype)
        flops = 2 * 64 * h * inter / _median_time(lambda: torch.nn.functional.linear(x, w), reps)
        big = torch.randn((128 << 20) // w.element_size() // h, h, dtype=dtype)
        v = torch.randn(1, h, dtype=dtype)
        ram_bw = big.numel() * big.element_size() / _median_time(lambda: torch.nn.functional.linear(v, big), reps)
        del big
        # one layer call of the family at a tiny width: what a call costs beyond its arithmetic
        small = type(config).from_dict({**config.to_dict(), **_tiny_dims(shape.family)})
        adapter = build_meta(small, None)
        layer = adapter.layers[0].to_empty(device="cpu")
        for p in layer.parameters():
            p.data.normal_(0, 0.02)
        hid = torch.randn(1, 1, 64)
        pos = torch.zeros(1, 1, dtype=torch.long)
        pe = adapter.position_embeddings(hid, pos)
        kv = torch.zeros(1, adapter.kv_heads, 16, adapter.head_dim)

        def call():
            adapter.run_layer(0, hid, None, pos, pe, LayerCache(kv, kv.clone(), 8))
        call_s = _median_time(call, 20)
        flops, ram_bw = _real_layer_rates(config, shape, dtype, call_s, flops, ram_bw)
        dequant_bw = _dequant_rate(shape, dtype, reps)
    folder = Path(nvme_dir) if nvme_dir is not None else default_nvme_root()
    disk = measure_disk(folder, disk_bytes, reps=2)
    return GenerateHardware(f"measured now ({dtype}, disk under {folder})", flops=flops, ram_bandwidth=ram_bw,
                            disk_read=disk["read_bytes_per_s"], disk_write=disk["write_bytes_per_s"],
                            call_seconds=call_s, base_rss=rss_bytes(), dequant_bandwidth=dequant_bw)


def _dequant_rate(shape, dtype: torch.dtype, reps: int) -> float:
    """B/s of int8 codes and scales read plus ``dtype`` written by
    :func:`tierstate.generate.compress.dequantize_into` for one layer's worth of values (at
    most 64 Mi), at the default group; int4 moved the same bytes per second within 5 % (51.4M values,
    Xeon)."""
    from . import compress as cq  # noqa: PLC0415

    g = cq.DEFAULT_GROUP
    n = max(g, min(shape.layer_params[0], 64 << 20)) // g * g
    vn, sn = cq.stored_nbytes(n, "int8", g)
    values = torch.randint(0, 256, (vn,), dtype=torch.uint8)
    scales = torch.rand(sn // 4) * 1e-3
    out = torch.empty(n, dtype=dtype)
    secs = _median_time(lambda: cq.dequantize_into(values, scales, out, "int8", g), reps)
    return (vn + sn + n * out.element_size()) / max(secs, 1e-9)


_PROBE_MICRO_BATCH, _PROBE_PROMPT, _PROBE_CONTEXT = 4, 32, 64
_PROBE_WORKING_SET = 192 << 20  # decode reads its layers from RAM, not from the CPU's caches


def _real_layer_rates(config, shape, dtype: torch.dtype, call_s: float, flops: float,
                      ram_bw: float) -> tuple[float, float]:
    """(flops, RAM bandwidth) as one real decoder layer of this model achieves them, when lower
    than the synthetic rates: a prefill of ``4 x 32`` tokens (compute), and decode steps of 4 rows
    over a 64-token cache cycling over enough copies of the layer that its weights come from RAM.

    Why: the synthetic rates come from one large matrix product and one large matrix-vector
    product, and a layer is seven smaller products plus norms, rotary embeddings and attention.
    With those rates the planner overrated the all-in-RAM placement by 59 % on an 8-layer Llama
    (hidden 1024, bf16, 2-vCPU Zen 4: 137.9 tokens/s predicted, 86.7 measured)."""
    from .adapters import LayerCache, build_meta  # noqa: PLC0415

    one = type(config).from_dict({**config.to_dict(), **({"n_layer": 1} if shape.family == "gpt2"
                                                           else {"num_hidden_layers": 1})})
    adapter = build_meta(one, None)
    wb, params = shape.layer_bytes[0], shape.layer_params[0]
    copies = max(1, min(16, -(-_PROBE_WORKING_SET // max(wb, 1))))
    layers = []
    for _ in range(copies):  # each copy its own memory
        layers.append(copy.deepcopy(adapter.layers[0]).to_empty(device="cpu").to(dtype))
        for prm in layers[-1].parameters():
            prm.data.normal_(0, 0.02)
    mb, q, T = _PROBE_MICRO_BATCH, _PROBE_PROMPT, _PROBE_CONTEXT

    def cache(past: int, max_len: int) -> LayerCache:
        kv = torch.zeros(mb, adapter.kv_heads, max_len, adapter.head_dim, dtype=dtype)
        return LayerCache(kv, kv.clone(), past)  # head-major, as a cache in RAM

    def run(index: int, hid: torch.Tensor, first: int, layer_cache: LayerCache) -> None:
        adapter.layers[0] = layers[index]  # the adapter runs layer 0: point it at this copy
        pos = torch.arange(first, first + hid.shape[1]).expand(mb, -1)
        adapter.run_layer(0, hid, None, pos, adapter.position_embeddings(hid, pos), layer_cache)

    prompt = torch.randn(mb, q, shape.hidden, dtype=dtype)
    prefill_s = _median_time(lambda: run(0, prompt, 0, cache(0, q)), 3, min_seconds=_PROBE_SECONDS, max_reps=15)
    token = torch.randn(mb, 1, shape.hidden, dtype=dtype)
    decode_cache = cache(T, T + 1)
    turn = itertools.count()  # each call on the next copy, so that its weights come from RAM
    decode_s = _median_time(lambda: run(next(turn) % copies, token, T, decode_cache), 3 * copies,
                            min_seconds=_PROBE_SECONDS, max_reps=20 * copies)
    del layers, adapter
    real_flops = 2 * mb * q * params / max(prefill_s - call_s, 1e-9)
    real_ram_bw = wb / max(decode_s - call_s, 1e-9)
    return min(flops, real_flops), min(ram_bw, real_ram_bw)


def _tiny_dims(family: str) -> dict:
    if family == "gpt2":
        return {"n_embd": 64, "n_head": 4, "n_layer": 1, "n_inner": 256}
    return {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
            "num_hidden_layers": 1, "head_dim": 16}


def saved_hardware() -> GenerateHardware:
    """From the saved ``tierstate probe`` profile, else conservative figures."""
    from ..placement.plan_inputs import Hardware  # noqa: PLC0415
    from ..placement.probe import default_profile_path, load_profile  # noqa: PLC0415

    profile = load_profile()
    if profile is None:
        hw = GenerateHardware.conservative()
        return GenerateHardware(hw.source, hw.flops, hw.ram_bandwidth, hw.disk_read, hw.disk_write,
                                hw.call_seconds, rss_bytes())
    return GenerateHardware.from_rates(Hardware.from_profile(profile, f"hardware profile {default_profile_path()}"),
                                       base_rss=rss_bytes())


def plan_for_model(config, dtype: torch.dtype, layer_nbytes, stored_nbytes=None, *, budget=None, nvme_dir=None,
                   micro_batch=None, num_micro_batches=None, workload: GenerateWorkload | None = None,
                   hardware: GenerateHardware | None = None, prefetch: int = DEFAULT_PREFETCH,
                   lossless: bool = False) -> GeneratePlan:
    """The plan for a model whose layers' images are ``layer_nbytes`` (and, compressed,
    ``stored_nbytes``: :func:`tierstate.generate.weight_store.layer_sizes`; ``lossless``: as
    ``compress="lossless"`` stores them, coded on NVMe only)."""
    shape = shape_from_config(config, torch.empty(0, dtype=dtype).element_size(), layer_nbytes, stored_nbytes,
                              lossless)
    return plan_generate(shape, workload or DEFAULT_WORKLOAD, hardware or saved_hardware(),
                         budget if budget is not None else default_budget(nvme_dir),
                         micro_batch=micro_batch, num_micro_batches=num_micro_batches, prefetch=prefetch)
