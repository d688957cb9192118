"""Weights and optimizer state planned together: they share host RAM and the disk.

:func:`plan_joint` splits the host RAM budget between the weight plan
(:func:`.weights_plan.plan_weights`) and the optimizer-state plan (:func:`.planner.choose`, or
:func:`.planner.evaluate` for a given placement), tries each split on a grid, and keeps the one
with the shortest predicted step. Per byte of host RAM, a streamed block kept in RAM saves three
bytes of disk traffic per step (two reads and its write-back), a byte of optimizer state two (its
read and its write), so neither side is given priority: the grid prices both.

[Note: the joint step]
The optimizer plan's step (:func:`.cost_model.predict_time`) already holds the compute, the
optimizer step and the weight upload after the update. With the weights offloaded on CUDA, a
streamed block is uploaded by its fetches (the weight plan's PCIe bytes), so the upload of that
share of the weights is taken off the optimizer's step; the weight plan then adds the time the
step waits on weights (fetches not hidden, the NVMe write-back). Both sides' disk traffic is
priced at the same disk rates and added, as concurrent reads and writes on one disk take the sum
of their times.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .cost_model import activation_bytes, memory_breakdown
from .layout import TierKind
from .plan_inputs import DTYPE_BYTES, Budgets, Hardware, Placement, PlanError, PlanRequest, gib
from .planner import Plan, choose, evaluate
from .weights_plan import RESIDENT, WeightPlan, plan_weights

# Shares of the host RAM budget offered to the weights (the rest to the optimizer state): a
# 10% grid, plus whatever the weights need at the least (their smallest window).
HOST_SHARES = tuple(i / 10 for i in range(10, -1, -1))
ATTENTION_FLOPS_PER_TOKEN = 4  # x seq_len x hidden, per layer, forward (cost_model counts 12 for fwd+bwd)


@dataclass
class JointPlan:
    """The weight plan and the optimizer-state plan that share this machine's budgets."""

    weights: WeightPlan
    state: Plan
    step_seconds: float | None  # the joint predicted step (see the note at the top)
    budgets: Budgets
    weights_host_budget: int  # the share of the host budget the weight plan was given

    def usage(self) -> dict[str, dict[str, int | None]]:
        """Bytes per budget ("device", "host", "disk"): weights, state, total and the budget."""
        w, on_cuda = self.weights, self.weights.compute == "cuda"
        weights = {"device": w.compute_peak_bytes if on_cuda else 0,
                   "host": w.host_peak_bytes if on_cuda else w.compute_peak_bytes,  # CPU: activations in RAM
                   "disk": w.disk_bytes}
        budget = {"device": self.budgets.device, "host": self.budgets.host, "disk": self.budgets.disk}
        out = {}
        for name in ("device", "host", "disk"):
            state = self.state.budget_total(name)
            out[name] = {"weights": weights[name], "state": state, "total": weights[name] + state,
                         "budget": budget[name]}
        return out

    def as_dict(self) -> dict:
        return {"step_s": self.step_seconds, "weights_host_budget": self.weights_host_budget, "usage": self.usage()}


def weight_inputs(req: PlanRequest, hw: Hardware) -> tuple[list[int], int, int, float | None]:
    """Per-block bytes, bytes outside the blocks, one micro-batch's activations, and one block's
    forward seconds (None without a micro-batch and sequence length) for ``req``'s model."""
    spec = req.model
    if not spec.blocks_known:
        raise ValueError(f"model={spec.name!r}: weight offload needs the model's repeated blocks; give a built-in "
                         "shape (gpt2, llama-7b, ...), a transformers config or pkg.mod:factory, not a bare count")
    pb = DTYPE_BYTES[req.param_dtype]
    blocks = [n * pb for n in spec.block_numels]
    act, _ = activation_bytes(req)
    compute_s = None
    if req.micro_batch is not None and req.seq_len is not None:
        tokens = req.micro_batch * req.seq_len
        mean_block = sum(spec.block_numels) / len(spec.block_numels)
        flops = 2.0 * mean_block * tokens
        if spec.shape is not None:
            flops += ATTENTION_FLOPS_PER_TOKEN * req.seq_len * spec.shape.hidden * tokens
        compute_s = flops / (hw.device_flops if req.on_accelerator else hw.host_flops)
    return blocks, spec.outside_numel * pb, act, compute_s


def plan_joint(req: PlanRequest, hw: Hardware, budgets: Budgets, *, weights_tier: str = "auto",
               max_prefetch: int = 4, allow_device_tier: bool = False,
               placement: Placement | None = None) -> JointPlan:
    """The weight plan and the optimizer-state plan with the shortest joint step within ``budgets``.

    ``req`` describes the training run as for :func:`.planner.choose` (its model must know its
    blocks); ``weights_tier`` is ``"auto"``, ``"cpu"`` or ``"nvme"`` (as ``plan_weights``'s
    ``tier``); ``placement`` fixes the optimizer state's placement instead of choosing it.
    Raises :class:`PlanError` naming what does not fit, ValueError for a model without blocks.
    """
    if budgets.host is None:
        raise ValueError("budgets.host=None: planning weights and state together needs a host RAM budget")
    blocks, outside, act, compute_s = weight_inputs(req, hw)
    compute = "cuda" if req.on_accelerator else "cpu"
    if compute == "cuda" and budgets.device is None:
        raise ValueError("weight offload on cuda needs a device memory budget: give --device-mem (or a hardware "
                         "profile measured on the CUDA machine)")
    state_req = replace(req, weights_offloaded=True)
    state_device_min = sum(m.nbytes for m in memory_breakdown(state_req, Placement(0.0, 1.0, 0.0))
                           if m.tier is TierKind.DEVICE)

    def weights_for(host_share: int) -> WeightPlan:
        return plan_weights(
            blocks, resident_bytes=outside, compute=compute,
            compute_memory_budget=(budgets.device - state_device_min) if compute == "cuda" else host_share,
            host_memory_budget=host_share, profile=hw, activation_bytes=act, compute_seconds_per_block=compute_s,
            max_prefetch=max_prefetch, disk_budget=budgets.disk, micro_batches=req.grad_accum,
            activation_checkpointing=req.activation_checkpointing, tier=weights_tier)

    best: JointPlan | None = None
    weights_errors: list[str] = []
    state_errors: list[str] = []
    for share in HOST_SHARES:
        host_share = int(budgets.host * share)
        try:
            w = weights_for(host_share)
        except PlanError as exc:
            weights_errors.append(str(exc))
            continue
        used_host = w.host_peak_bytes if compute == "cuda" else w.compute_peak_bytes
        rest = replace(budgets, host=budgets.host - used_host,
                       disk=None if budgets.disk is None else budgets.disk - w.disk_bytes,
                       device=None if budgets.device is None else budgets.device - (
                           w.compute_peak_bytes if compute == "cuda" else 0),
                       pinned=None if budgets.pinned is None else budgets.pinned - w.pinned_bytes)
        try:
            if placement is not None:
                state = evaluate(state_req, placement, hw, rest, reason="given by --placement")
            else:
                state = choose(state_req, hw, rest, allow_device_tier=allow_device_tier)
        except PlanError as exc:
            state_errors.append(f"with {gib(used_host)} of host RAM and {gib(w.disk_bytes)} of disk for the weights: "
                                f"{exc}")
            continue
        # the plans were checked against what was left: report them against the whole budgets
        state.budgets = budgets
        joint = JointPlan(w, state, _joint_step(w, state), budgets, host_share)
        if best is None or _key(joint) < _key(best) * (1 - 1e-3):
            best = joint
    if best is None:
        if len(weights_errors) == len(HOST_SHARES):
            raise PlanError(weights_errors[0])
        # the last split tried gives the state the most room: its shortfall is the telling one
        raise PlanError("no split of host RAM and disk between the weights and the optimizer state fits; "
                        + (state_errors[-1] if state_errors else weights_errors[-1]))
    return best


def _key(joint: JointPlan) -> float:
    if joint.step_seconds is not None:
        return joint.step_seconds
    w = joint.weights
    return joint.state.time.total + w.disk_seconds + w.pcie_seconds


def _joint_step(w: WeightPlan, state: Plan) -> float | None:
    if w.step_seconds is None or state.time.compute is None:
        return None
    streamed = sum(b for b, t in zip(w.block_bytes, w.tier_of) if t != RESIDENT)
    upload = state.time.weight_h2d * streamed / (sum(w.block_bytes) + w.resident_bytes)
    return state.time.total - upload + (w.stall_seconds or 0.0)
