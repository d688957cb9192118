"""Who lives where: the offload policy, sub-group partitioning and (later) the planner.

Pure: nothing here touches a tensor or a file.
"""
from .layout import Layout, Segment, SubGroup, TierKind, plan_layout, tier_sizes
from .offload import DEFAULT_BUFFER_COUNT, DEFAULT_SUBGROUP_NUMEL, OFFLOAD_MODES, Offload, default_nvme_root

__all__ = [
    "Offload", "OFFLOAD_MODES", "DEFAULT_SUBGROUP_NUMEL", "DEFAULT_BUFFER_COUNT", "default_nvme_root",
    "Layout", "Segment", "SubGroup", "TierKind", "plan_layout", "tier_sizes",
]
