"""The planner: the placement that minimizes the predicted step time within the budgets.

:func:`choose` searches placements (device share on a grid, then as much host RAM as fits,
the rest on NVMe; smaller sub-groups and buffer pools when the pool does not fit), each
priced by the cost model (:mod:`.cost_model`); :func:`evaluate` prices one placement. The
inputs are :mod:`.plan_inputs`' plain values. ``tierstate plan`` (:mod:`tierstate.plan_cli`)
and ``offload="auto"`` (:mod:`.auto`) are its two faces.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

from .cost_model import BUDGET_NAMES, Kind, MemoryItem, StepTime, memory_breakdown, predict_time, shortfalls
from .layout import TIER_ORDER, TierKind
from .plan_inputs import Budgets, Hardware, Placement, PlanError, PlanRequest, gib


@dataclass
class Plan:
    """A priced placement: its memory by tier and kind, its step time, and why it was chosen."""

    request: PlanRequest
    placement: Placement
    memory: list[MemoryItem]
    time: StepTime
    hardware: Hardware
    budgets: Budgets
    reason: str = ""
    notes: list[str] = field(default_factory=list)

    def tier_total(self, tier: TierKind) -> int:
        return sum(m.nbytes for m in self.memory if m.tier is tier)

    def budget_total(self, name: str) -> int:
        """Bytes planned against the budget called ``name`` ("device", "host" or "disk")."""
        return sum(m.nbytes for m in self.memory if BUDGET_NAMES[m.tier] == name)

    def pinned_total(self) -> int:
        return sum(m.nbytes for m in self.memory if m.pinned)

    def bytes_of(self, tier: TierKind, kind: Kind) -> int:
        return sum(m.nbytes for m in self.memory if m.tier is tier and m.kind is kind)

    def as_dict(self) -> dict:
        req = self.request
        return {
            "model": {"name": req.model.name, "params": req.model.numel, "tensors": len(req.model.param_numels),
                      "source": req.model.source},
            "config": {k: v for k, v in asdict(req).items() if k != "model"} | {"pool_buffers": req.pool_buffers},
            # per stored key, the same table the optimizer keeps (placement.defaults.state_bytes_per_element)
            "state_bytes_per_param": {"total": req.state_bytes_per_param, **req.state_bytes()},
            "placement": asdict(self.placement),
            "reason": self.reason,
            "memory": [{"tier": BUDGET_NAMES[m.tier], "kind": m.kind.value, "bytes": m.nbytes, "pinned": m.pinned,
                        "note": m.note} for m in self.memory],
            "totals": {BUDGET_NAMES[t]: self.tier_total(t) for t in TIER_ORDER} | {"pinned": self.pinned_total()},
            "time_s": asdict(self.time) | {"components": self.time.components()},
            "hardware": asdict(self.hardware),
            "budgets": asdict(self.budgets),
            "notes": list(self.notes),
        }


def evaluate(req: PlanRequest, placement: Placement, hw: Hardware, budgets: Budgets = Budgets(),
             reason: str = "") -> Plan:
    """The plan for a given placement; raises :class:`PlanError` when it breaks a budget."""
    memory = memory_breakdown(req, placement)
    missing = shortfalls(req, memory, budgets)
    if missing:
        raise PlanError(f"Offload(gpu={placement.gpu:g}, cpu={placement.cpu:g}, nvme={placement.nvme:g}) "
                        + "; ".join(missing))
    plan = Plan(req, placement, memory, predict_time(req, placement, hw), hw, budgets, reason)
    plan.notes.extend(req.model.notes)
    return plan


def _fits(req: PlanRequest, placement: Placement, budgets: Budgets) -> bool:
    return not shortfalls(req, memory_breakdown(req, placement), budgets)


def _largest_cpu(req: PlanRequest, gpu: float, budgets: Budgets, steps: int = 40) -> float | None:
    """The largest host fraction that fits next to ``gpu`` (the rest on NVMe), or None."""
    rest = 1.0 - gpu
    if _fits(req, Placement(gpu, rest, 0.0), budgets):
        return rest
    if not _fits(req, Placement(gpu, 0.0, rest), budgets):
        return None
    lo, hi = 0.0, rest  # host use grows and disk use shrinks with the host fraction: bisect
    for _ in range(steps):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _fits(req, Placement(gpu, mid, rest - mid), budgets) else (lo, mid)
    return math.floor(lo * 1000) / 1000


def _explain_infeasible(req: PlanRequest, budgets: Budgets, allow_device_tier: bool) -> str:
    state = req.model.numel * req.state_bytes_per_param
    gpu = 1.0 if allow_device_tier else 0.0
    lines = [f"no placement of the optimizer state ({gib(state)}: {req.model.numel:,} params x "
             f"{req.state_bytes_per_param} B) fits the budgets:"]
    for name, placement in (("all in host RAM", Placement(0.0, 1.0, 0.0)), ("all on NVMe", Placement(0.0, 0.0, 1.0)),
                            ("all on the device", Placement(gpu, 1.0 - gpu, 0.0))):
        if name == "all on the device" and not allow_device_tier:
            continue
        missing = shortfalls(req, memory_breakdown(req, placement), budgets)
        lines.append(f"  {name}: " + "; ".join(missing))
    if budgets.disk is not None:  # the best split: as much as host RAM takes, the rest on disk
        cpu = _largest_cpu(req, 0.0, replace(budgets, disk=None))
        if cpu is not None:
            split = Placement(0.0, cpu, 1.0 - cpu)
            missing = shortfalls(req, memory_breakdown(req, split), budgets)
            lines.append(f"  host RAM full ({cpu:.1%} of the state), the rest on NVMe: " + "; ".join(missing))
    fixes = ["raise the budget named above (--host-mem, --disk or a larger --nvme-dir, --device-mem)"]
    if req.moment_dtype == "fp32":
        fixes.append("use bf16 or 8-bit moments (--moment-dtype bf16: 8 B/param of moments -> 4; --moment-dtype "
                     "q8: -> 2.03)")
    elif req.moment_dtype == "bf16":
        fixes.append("use 8-bit moments (--moment-dtype q8: 4 B/param of moments -> 2.03)")
    if req.moment_dtype == "q8" and req.master_dtype != "bf16_sr":
        now, then = req.master_bytes_per_param, replace(req, master_dtype="bf16_sr").master_bytes_per_param
        if then < now:
            fixes.append(f"use a bf16 master with stochastic rounding (--master-dtype bf16_sr: {now:g} B/param "
                         f"-> {then:g})")
    fixes.append("use a smaller --buffer-count")
    lines.append("Fixes: " + "; or ".join(fixes) + ".")
    return "\n".join(lines)


def choose(req: PlanRequest, hw: Hardware, budgets: Budgets = Budgets(), *, allow_device_tier: bool = False,
           grid: int = 20, subgroup_options: tuple[int, ...] = (),
           buffer_options: tuple[int, ...] = ()) -> Plan:
    """The placement with the smallest predicted step time that fits ``budgets``.

    For each device fraction on a grid of ``1/grid`` (only 0 unless ``allow_device_tier``),
    the host takes as much as fits (host RAM is faster than disk), the rest goes to NVMe;
    the fastest of those candidates wins. ``subgroup_options`` are further sub-group sizes
    to try (largest first) when the NVMe buffer pool of ``req.subgroup_numel`` does not fit:
    the pool is ``buffer_count`` records of one sub-group each, so smaller sub-groups leave
    more host RAM for state; ``buffer_options`` are smaller pools (buffer counts) tried the same
    way. The fastest wins; the returned plan's request carries its size and count.
    Raises :class:`PlanError` naming what is missing.
    """
    sizes = [req.subgroup_numel] + sorted((s for s in subgroup_options if s < req.subgroup_numel), reverse=True)
    # None (the optimizer's default pool) is tried as itself first, then the smaller explicit pools
    counts = [req.buffer_count] + sorted((c for c in buffer_options if c < req.pool_buffers), reverse=True)
    best: Plan | None = None
    for size in sizes:
        for count in counts:
            try:
                plan = _choose_placement(replace(req, subgroup_numel=size, buffer_count=count), hw, budgets,
                                         allow_device_tier, grid)
            except PlanError:
                continue
            if best is None or plan.time.total < best.time.total * 0.99:  # a smaller pool must win by > 1%
                best = plan
    if best is None:
        raise PlanError(_explain_infeasible(req, budgets, allow_device_tier))
    return best


def _choose_placement(req: PlanRequest, hw: Hardware, budgets: Budgets, allow_device_tier: bool, grid: int) -> Plan:
    gpus = [i / grid for i in range(grid + 1)] if (allow_device_tier and req.on_accelerator) else [0.0]
    best: Plan | None = None
    for gpu in gpus:
        cpu = _largest_cpu(req, gpu, budgets)
        if cpu is None:
            continue
        placement = Placement(gpu, cpu, max(0.0, 1.0 - gpu - cpu))
        if placement.nvme > 0 and (hw.disk_read <= 0 or hw.disk_write <= 0):
            continue
        plan = evaluate(req, placement, hw, budgets)
        if best is None or plan.time.total < best.time.total - 1e-9:
            best = plan
    if best is None:
        raise PlanError(_explain_infeasible(req, budgets, allow_device_tier))
    p = best.placement
    if p.nvme == 0 and p.gpu == 0:
        best.reason = "all optimizer state fits in host RAM, the fastest tier that holds it"
    elif p.nvme > 0:
        best.reason = (f"host RAM holds {p.cpu:.1%} of the state within its budget; the remaining {p.nvme:.1%} "
                       "goes to NVMe")
    else:
        best.reason = f"{p.gpu:.0%} on the device gives the shortest predicted step within the device budget"
    if not allow_device_tier and req.on_accelerator:
        best.notes.append("device tier not considered: `tierstate plan --gpu-tier` (allow_device_tier=True) "
                          "also weighs keeping part of the state in device memory")
    return best
