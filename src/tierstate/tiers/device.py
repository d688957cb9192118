"""DeviceTier: optimizer state kept in the parameters' own device memory.

The sub-groups of ``Offload(gpu=...)`` live here. Their update runs on the device with
torch's own kernels (``torch._fused_adamw_`` and friends, see
:meth:`tierstate.rules.UpdateRule.update_on_device`), launched before the host part
of the step so that, on CUDA, both run at the same time.

[Note: one arena per key, as in the host tier]
The tier holds one flat tensor per state key over the device range of the layout
(``layout.tier_numel[DEVICE]`` elements); sub-group ``sg`` owns
``arena[key][sg.tier_offset : sg.tier_offset + sg.numel]``. ``acquire`` hands out views
of the device memory; nothing is copied during a step. Reads and writes outside a step
(``read_range`` / ``write_range``: init, ``state_dict``, checkpoints) cross to the host:
``read_range`` always returns a new CPU tensor, never a device tensor or a view, because
``optimizer.state`` and state dicts must never hold device memory (frameworks would move
it around, and a view would change under the caller's feet at the next step).

The tier does not care which device it is given: that is what lets the tests run it on
CPU parameters (``TIERSTATE_DEVICE_TIER_ON_CPU=1``, see :class:`tierstate.Offload`)
with exactly the code a GPU runs.
"""
from __future__ import annotations

import os
from typing import Mapping

import torch
from torch import Tensor

from ..placement import Layout, SubGroup, TierKind
from .host import ArenaTier, item_range

DEVICE_TIER_ON_CPU_ENV = "TIERSTATE_DEVICE_TIER_ON_CPU"


def device_tier_on_cpu_allowed() -> bool:
    """Whether ``$TIERSTATE_DEVICE_TIER_ON_CPU`` lets ``Offload(gpu>0)`` run on CPU parameters.

    A testing aid (documented on :class:`tierstate.Offload`): the device tier then keeps its
    state in host memory and updates it with the same torch kernels it uses on a GPU, so its
    logic is exercised on machines without one. ``"1"`` allows, unset/empty/``"0"`` does not.
    """
    raw = os.environ.get(DEVICE_TIER_ON_CPU_ENV, "")
    if raw not in ("", "0", "1"):
        raise ValueError(f"{DEVICE_TIER_ON_CPU_ENV}={raw!r}: must be '1' (run Offload(gpu>0) on CPU parameters, "
                         "a testing aid) or '0'/unset")
    return raw == "1"


class DeviceTier(ArenaTier):
    """One flat buffer per state key over the device range of the layout, on ``device``."""

    kind = TierKind.DEVICE
    on_device = True  # updated by the device executor; its gradients are read from param.grad
    host_views = False  # optimizer.state must never hold device memory

    def __init__(self, layout: Layout, dtypes: Mapping[str, torch.dtype], inits: Mapping[str, float],
                 device: torch.device, units: Mapping[str, int] | None = None) -> None:
        self.layout = layout
        self.units = dict(units or {})
        self.device = torch.device(device)
        self.numel = layout.tier_numel[TierKind.DEVICE]
        self.arenas: dict[str, Tensor] = {}
        for key, dtype in dtypes.items():
            # torch.full allocates and fills in one kernel; a failure here is the device's
            # out-of-memory error, raised at construction rather than mid-step.
            self.arenas[key] = torch.full((item_range(self.units.get(key, 1), 0, self.numel)[1],), float(inits.get(key, 0.0)), dtype=dtype, device=self.device)

    def drain(self) -> None:
        """Wait for the updates queued on the device (CUDA runs them asynchronously)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def flush(self) -> None:
        """Nothing to write back; waits like :meth:`drain` so the state is final."""
        self.drain()

    def read_range(self, key: str, sg: SubGroup, offset: int, numel: int) -> Tensor:
        """``numel`` elements of ``key`` from ``offset`` inside ``sg``, as a new CPU tensor.

        On CUDA the copy runs on the current stream, after every update queued on it.
        """
        lo = self._items(key, sg, offset)
        return self.arenas[key][lo: lo + numel].to("cpu", copy=True)

    def write_range(self, key: str, sg: SubGroup, offset: int, values: Tensor) -> None:
        """Store ``values`` (any device; converted to the key's dtype) at ``offset`` inside ``sg``."""
        lo = self._items(key, sg, offset)
        self.arenas[key][lo: lo + values.numel()].copy_(values)

    def close(self) -> None:
        self.arenas.clear()
