"""Who lives where: the offload policy, the sub-group layout, the planner and ``offload="auto"``.

The policy, the layout and the planner are arithmetic, testable without a tensor or a file;
the probe (:mod:`tierstate.placement.probe`) is the part that measures the machine.
"""
from .layout import Layout, Segment, SubGroup, TierKind, plan_layout, tier_sizes
from .offload import DEFAULT_BUFFER_COUNT, DEFAULT_SUBGROUP_NUMEL, OFFLOAD_MODES, Offload, default_nvme_root

__all__ = [
    "Offload", "OFFLOAD_MODES", "DEFAULT_SUBGROUP_NUMEL", "DEFAULT_BUFFER_COUNT", "default_nvme_root",
    "Layout", "Segment", "SubGroup", "TierKind", "plan_layout", "tier_sizes",
]
