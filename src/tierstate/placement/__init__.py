"""Who lives where: the offload policy, the sub-group layout, the planner and ``offload="auto"``.

Arithmetic, testable without a tensor or a file: the policy (:mod:`.offload`), the layout
(:mod:`.layout`, with :class:`TierKind`, the one tier enum), the model shapes
(:mod:`.model_spec`) and the planner (its inputs :mod:`.plan_inputs`, its cost model
:mod:`.cost_model`, its search :mod:`.planner`); the weight planner (:mod:`.weights_plan`: which
blocks stay resident, which stream from pinned host RAM or NVMe, window and prefetch) and the
two planned together (:mod:`.joint`). :mod:`.auto` reads this machine's budgets for
``offload="auto"`` (state and weights); the probe (:mod:`.probe`) is the part that measures the
machine. Nothing here imports the optimizer: callers pass the optimizer's state keys.
"""
from .layout import Layout, Segment, SubGroup, TierKind, plan_layout, tier_sizes
from .offload import DEFAULT_BUFFER_COUNT, DEFAULT_SUBGROUP_NUMEL, OFFLOAD_MODES, Offload, default_nvme_root
from .weights_plan import WeightPlan, plan_weights

__all__ = [
    "Offload", "OFFLOAD_MODES", "DEFAULT_SUBGROUP_NUMEL", "DEFAULT_BUFFER_COUNT", "default_nvme_root",
    "Layout", "Segment", "SubGroup", "TierKind", "plan_layout", "tier_sizes", "WeightPlan", "plan_weights",
]
