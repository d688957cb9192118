"""The inputs of the generation planner on this machine: rates (measured now, or from the
saved ``tierstate probe`` profile), the process's base RSS, and default budgets.

The arithmetic is :mod:`tierstate.placement.generate_plan`; this module measures.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from ..placement.auto import HOST_FRACTION, existing_ancestor
from ..placement.defaults import default_nvme_root
from ..placement.generate_plan import (GenerateBudget, GenerateHardware, GeneratePlan, GenerateWorkload,
                                       plan_generate, shape_from_config)

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


def _median_time(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def measure_hardware(config, dtype: torch.dtype, nvme_dir=None, *, disk_bytes: int = 256 << 20,
                     reps: int = 5) -> GenerateHardware:
    """Rates for this model on this machine, in a few seconds: the matrix-product rate at the
    model's shapes, the rate weights stream through a matrix-vector product (a 128 MiB weight,
    beyond any cache), O_DIRECT disk rates (``disk_bytes`` written and read under the NVMe
    folder), one layer call's fixed cost (a layer of the model's family at hidden size 64)."""
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
        kv = torch.zeros(16, 1, adapter.kv_heads, adapter.head_dim)

        def call():
            adapter.run_layer(0, hid, None, pos, pe, LayerCache(kv, kv.clone(), 8))
        call_s = _median_time(call, 20)
    folder = Path(nvme_dir) if nvme_dir is not None else default_nvme_root()
    disk = measure_disk(folder, disk_bytes, reps=2)
    return GenerateHardware(f"measured now ({dtype}, disk under {folder})", flops=flops, ram_bandwidth=ram_bw,
                            disk_read=disk["read_bytes_per_s"], disk_write=disk["write_bytes_per_s"],
                            call_seconds=call_s, base_rss=rss_bytes())


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


def plan_for_model(config, dtype: torch.dtype, layer_nbytes, *, budget=None, nvme_dir=None, micro_batch=None,
                   num_micro_batches=None, workload: GenerateWorkload | None = None,
                   hardware: GenerateHardware | None = None) -> GeneratePlan:
    shape = shape_from_config(config, torch.empty(0, dtype=dtype).element_size(), layer_nbytes)
    return plan_generate(shape, workload or DEFAULT_WORKLOAD, hardware or saved_hardware(),
                         budget if budget is not None else default_budget(nvme_dir),
                         micro_batch=micro_batch, num_micro_batches=num_micro_batches)
