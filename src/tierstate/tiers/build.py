"""make_tiers: the tiers a layout needs, one per kind with elements, each made by its own class."""
from __future__ import annotations

from typing import Mapping, Sequence

import torch

from ..placement import Layout, Offload, TierKind
from .device import DeviceTier
from .host import HostTier


def make_tiers(layout: Layout, dtypes: Mapping[str, torch.dtype], inits: Mapping[str, float], offload: Offload,
               device: torch.device, *, master_on_device: bool, telemetry,
               units: Mapping[str, int] | None = None, blocks: Sequence[set[int]] = (),
               wide_dtypes: Mapping[str, torch.dtype] | None = None) -> dict:
    """``{kind: tier}`` for every kind the layout gives elements to.

    ``master_on_device``: whether a parameter in the device range keeps an fp32 master there
    (an fp32 parameter wholly on the device is its own master, as in torch, so the device
    tier then holds no master arena). Host arenas are pinned for a CUDA device. ``units``:
    state key -> elements per stored item (a compressed moment's block scale).
    ``blocks``: per block of streamed weights, the sub-group indices its gradients complete
    during backward (sizes the NVMe tier's read-ahead; empty when no update runs in backward).
    ``wide_dtypes``: the dtypes of the state of the layout's ``wide`` sub-groups (float64
    parameters beside narrower ones), which only the host tier holds.
    """
    pin = offload.pin_memory and device.type == "cuda"
    tiers: dict = {}
    if layout.tier_numel[TierKind.DEVICE] > 0:
        tiers[TierKind.DEVICE] = DeviceTier(
            layout, {k: d for k, d in dtypes.items() if k != "master" or master_on_device}, inits, device, units)
    if layout.tier_numel[TierKind.HOST] > 0:
        tiers[TierKind.HOST] = HostTier(layout, dtypes, inits, pin_memory=pin, units=units, wide_dtypes=wide_dtypes)
    if layout.tier_numel[TierKind.NVME] > 0:
        from .nvme import NvmeTier  # noqa: PLC0415 - the NVMe tier loads the I/O engine

        own = {sg.index for sg in layout.subgroups if sg.tier is TierKind.NVME}
        tiers[TierKind.NVME] = NvmeTier(layout, dtypes, inits, offload, telemetry=telemetry, units=units,
                                        block_records=max((len(b & own) for b in blocks), default=0))
        for folder in offload.nvme_dirs:  # warn when a drive of the tier nearly fills up
            if folder.is_dir():
                telemetry.watch_disk(folder)
    return tiers


def tier_fractions(offload: Offload, *, stores_nothing: bool) -> dict:
    """The layout's fractions per tier kind. ``stores_nothing``: the rule keeps no per-element
    state and no parameter needs a master (SGD without momentum on fp32 host parameters): an
    NVMe tier would hold no file, so its share goes to the (empty) host tier."""
    fractions = {TierKind.DEVICE: offload.gpu, TierKind.HOST: offload.cpu, TierKind.NVME: offload.nvme}
    if stores_nothing and fractions[TierKind.NVME] > 0:
        fractions[TierKind.HOST] += fractions[TierKind.NVME]
        fractions[TierKind.NVME] = 0.0
    return fractions


def device_heads(layout: Layout) -> dict[int, int]:
    """{trainable index: how many of its first elements lie in a tier on the compute device}.

    The device range comes first in the flat index space, so a parameter's device part is
    always its head."""
    heads: dict[int, int] = {}
    for sg in layout.subgroups:
        if sg.tier is TierKind.DEVICE:
            for seg in sg.segments:
                heads[seg.param_index] = heads.get(seg.param_index, 0) + seg.numel
    return heads
