"""Where state lives: each tier owns its storage; the StateStore maps parameters onto them.

- :class:`StateStore` (``store.py``): every parameter's state, read and written by parameter
  and key, piece by piece; the lifecycle of each parameter's state (``slots.py``).
- :class:`Tier` (``protocol.py``): what the step pipeline may ask of a tier (does it do I/O,
  which phase its waits are booked under, is it on the compute device), never its kind.
- :class:`DeviceTier` keeps its state on the parameters' device (``Offload(gpu=...)``),
  :class:`HostTier` in host RAM, :class:`NvmeTier` in files behind a bounded buffer pool;
  :func:`make_tiers` makes those a layout needs. Only this package names a tier kind.
"""
from .build import device_heads, make_tiers, tier_fractions
from .device import DeviceTier, device_tier_on_cpu_allowed
from .host import HostTier, packed_arena
from .protocol import Tier
from .slots import MasterLife, Slot, StateLife
from .store import StateStore, fused_group, loaded_step_dtype, resident_values, scalar_dtype, step_tensor

__all__ = ["DeviceTier", "HostTier", "MasterLife", "NvmeTier", "Slot", "StateLife", "StateStore", "Tier", "resident_values",
           "step_tensor", "scalar_dtype", "loaded_step_dtype", "fused_group", "device_heads",
           "device_tier_on_cpu_allowed", "make_tiers", "packed_arena", "tier_fractions"]


def __getattr__(name: str):
    if name == "NvmeTier":  # imported on use: it loads the native I/O engine
        from .nvme import NvmeTier

        return NvmeTier
    raise AttributeError(f"module 'tierstate.tiers' has no attribute {name!r}")
