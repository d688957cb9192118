"""The planner's cost model: bytes per tier and state kind, and predicted seconds per step.

Pure arithmetic over a :class:`~tierstate.placement.plan_inputs.PlanRequest`, a
:class:`~tierstate.placement.plan_inputs.Placement` and a
:class:`~tierstate.placement.plan_inputs.Hardware`: no tensor, no file, no clock.
:mod:`.planner` searches the placements it prices.

[Note: what the memory accounting mirrors]
Every figure follows what an optimizer allocates (:mod:`tierstate.pipeline.assembly`), so
a test can hold the two against each other:

- host tier: one arena per state key over the host range (``master`` fp32 only when the
  parameters are low precision or on an accelerator; moments in ``moment_dtype``);
- device tier (``Offload(gpu=...)``): the same keys in device memory; parameters touching
  it keep their gradients in ``param.grad`` on the device (they are not streamed) and need
  no staging tensor when wholly inside it;
- NVMe tier: the same keys in files, plus a pool of ``buffer_count`` host records of one
  sub-group each;
- gradients: ``param.grad`` where backward leaves it, or (grad streaming, the CUDA
  default) one host arena with every parameter's slice padded to 64 bytes;
- CUDA, low-precision parameters: one pinned staging arena (64 B slices) for the upload;
- pinned memory: the arenas, the NVMe pool and the staging are page-locked at their own
  size (:func:`tierstate.io.page_locked_empty`: ``cudaHostRegister`` on tierstate's own
  mappings). Only the per-parameter accumulation scratch comes from torch's
  CachingHostAllocator, which rounds every request up to a power of two; that rounding is
  its own line (``pinned_rounding``) so nobody mistakes it for state;
- the first step creates each parameter's state from a full-size temporary (and the
  fp32 master from ``param.float()``): the largest parameter sets that transient peak;
- with the weights offloaded (``PlanRequest.weights_offloaded``) the compute copy of the
  parameters and the activations are priced by the weight plan (:mod:`.weights_plan`), so
  this breakdown leaves them out; without gradient streaming, a streamed block's gradients
  go to the optimizer when the block is released, so ``param.grad`` is priced for the
  parameters outside the blocks and two blocks (the one in backward and the one handed over).

[Note: the step-time model]
One training step = compute (6 FLOPs per parameter per token, plus attention, at the
measured matmul rate; under activation checkpointing plus the blocks' forward again, 2 FLOPs per
block parameter per token) + the gradient copy to the host that backward could not hide
(backward is taken as 2/3 of compute) + the optimizer step + the weight upload. The
optimizer step is the gradient pass (global norm and inf check: one read of every host
copy of an accelerator's gradients; a CPU gradient's is taken in backward) plus the sub-group
pipeline, in which the CPU update and the NVMe reads/writes overlap: max(CPU time, disk time +
one record's update). The NVMe pool is a write-back
cache that keeps the last ``buffer_count`` records of a step for the next one, so a step
reads and writes ``S - buffer_count`` of its ``S`` records. CPU update time is the configuration's
bytes per parameter divided by the byte rate of the measured fp32 Adam kernel (28 B per
parameter), so a bf16-moment or low-precision configuration is priced by its traffic; 8-bit
moments take the longer of that and the probed rate of their fused step (``Hardware.
compressed_rate``): the 8-bit kernels are compute-bound, at 1.8-3.6x their traffic's time on
a 2-vCPU Xeon.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from .layout import TierKind, tier_sizes
from .plan_inputs import DTYPE_BYTES, Budgets, Hardware, Placement, PlanError, PlanRequest, gib, pow2_ceil

GRAD_ALIGN = 64  # bytes per gradient slice in the host gradient arena (tiers/host.py packed_arena)
GRAD_BUCKET_BYTES = 32 << 20  # CUDA gradient-stream bucket (pipeline/grad_stream.py)
RECORD_ALIGN = 4096  # O_DIRECT: every key of an NVMe record starts on a page
ADAM_KERNEL_BYTES = 28  # fp32 Adam: read w, g, m, v (16 B) + write w, m, v (12 B)
BACKWARD_SHARE = 2.0 / 3.0  # backward is ~2x forward: the share of compute a gradient copy can hide behind


class Kind(str, enum.Enum):
    """What a :class:`MemoryItem` holds (``moments``: the rule's state keys, fp32 ones included)."""

    PARAM = "param"
    GRAD = "grad"
    MASTER = "master"
    MOMENTS = "moments"
    HOST_GRAD_BUFFER = "host_grad_buffer"
    GRAD_ACCUM_SCRATCH = "grad_accum_scratch"
    WEIGHT_STAGING = "weight_staging"
    NVME_BUFFER_POOL = "nvme_buffer_pool"
    PINNED_ROUNDING = "pinned_rounding"
    FIRST_STEP_TEMPORARY = "first_step_temporary"
    ACTIVATIONS = "activations"


# The budget each tier's bytes count against, as the output names it (the columns of the
# `tierstate plan` table, the "tier" of each JSON memory item, the keys of its "totals"):
# the same words as the budgets (--device-mem, --host-mem, --disk).
BUDGET_NAMES = {TierKind.DEVICE: "device", TierKind.HOST: "host", TierKind.NVME: "disk"}


@dataclass(frozen=True)
class MemoryItem:
    tier: TierKind  # where the bytes are: device memory, host RAM, or files on the NVMe disk
    kind: Kind
    nbytes: int
    pinned: bool = False
    note: str = ""


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds per training step, by component."""

    compute: float | None  # forward + backward (None: no micro-batch given)
    grad_d2h: float  # gradient copies to the host, all of them
    grad_d2h_exposed: float  # the part backward does not hide
    weight_h2d: float
    grad_pass: float  # global norm / inf check over the host gradients
    cpu_update: float
    disk: float  # NVMe reads + writes
    device_update: float
    optimizer: float  # opt.step() as a whole
    total: float
    bottleneck: str  # compute | pcie | cpu_step | disk

    def components(self) -> dict[str, float]:
        return {"compute": self.compute or 0.0, "pcie": self.grad_d2h_exposed + self.weight_h2d,
                "cpu_step": self.grad_pass + self.cpu_update, "disk": self.disk}


# -- memory ---------------------------------------------------------------------------------------------
def activation_bytes(req: PlanRequest) -> tuple[int, str]:
    """Activations of one micro-batch (bytes, and how they were estimated); 0 when the shape,
    micro-batch or sequence length is unknown."""
    shape = req.model.shape
    if shape is None or req.micro_batch is None or req.seq_len is None:
        return 0, ""
    s, b, h, L = req.seq_len, req.micro_batch, shape.hidden, shape.n_layer
    scale = DTYPE_BYTES[req.param_dtype] / 2
    # Korthikanti et al. 2022: 34*s*b*h bytes per layer at 16 bits with fused (flash/SDPA)
    # attention; with checkpointing only each layer's input (2*s*b*h) stays, plus one layer live.
    per_layer = 34 * s * b * h * scale
    layers = (2 * s * b * h * scale * L + per_layer) if req.activation_checkpointing else per_layer * L
    logits = 2 * s * b * shape.vocab_size * 4  # fp32 logits and their gradient
    return int(layers + logits), "estimate (Korthikanti et al. 2022, fused attention)"


def _device_touching(numels, n_device: int) -> tuple[list[bool], list[bool]]:
    """Per parameter: whether it has elements in the device range (the first ``n_device`` of
    the flat index space), and whether it lies wholly inside it (as the optimizer decides)."""
    touching, inside, start = [], [], 0
    for n in numels:
        touching.append(n > 0 and start < n_device)
        inside.append(n > 0 and start + n <= n_device)
        start += n
    return touching, inside


def memory_breakdown(req: PlanRequest, placement: Placement) -> list[MemoryItem]:
    """Bytes per tier and state kind for ``req`` placed as ``placement`` (see the note at the top)."""
    model = req.model
    numels = model.param_numels
    n_total = model.numel
    pb = DTYPE_BYTES[req.param_dtype]
    keys = req.state_bytes()
    sizes = tier_sizes(n_total, placement.fractions())
    on_dev = req.on_accelerator
    param_tier = TierKind.DEVICE if on_dev else TierKind.HOST
    # with weight offload the compute copy and the activations are the weight plan's (weights_plan.py)
    items: list[MemoryItem] = [] if req.weights_offloaded else [MemoryItem(param_tier, Kind.PARAM, n_total * pb)]
    rounding = 0

    # gradients: parameters touching the device tier keep theirs on the device, the others are streamed
    touching, wholly_device = _device_touching(numels, sizes[TierKind.DEVICE])
    streamed = [n for n, t in zip(numels, touching) if not t]
    device_grads = sum(n for n, t in zip(numels, touching) if t)
    if req.streaming:
        arena = sum((n * pb + GRAD_ALIGN - 1) // GRAD_ALIGN * GRAD_ALIGN for n in streamed)
        items.append(MemoryItem(TierKind.HOST, Kind.HOST_GRAD_BUFFER, arena, req.pinned, "one arena, 64 B slices"))
        if req.keep_device_grads or not on_dev:
            kept = n_total * pb if req.keep_device_grads else model.largest_param * pb
            items.append(MemoryItem(param_tier, Kind.GRAD, kept, False,
                                    "param.grad kept" if req.keep_device_grads else "one param.grad before its copy"))
        else:
            items.append(MemoryItem(TierKind.DEVICE, Kind.GRAD, min(sum(streamed) * pb, GRAD_BUCKET_BYTES
                                                                + max(streamed, default=0) * pb),
                                    False, "one bucket in flight"))
            if device_grads:
                items.append(MemoryItem(TierKind.DEVICE, Kind.GRAD, device_grads * pb, False,
                                        "param.grad of the parameters touching the device tier"))
        if on_dev and req.grad_accum > 1:
            scratch = sum(pow2_ceil(n * pb) for n in streamed)
            items.append(MemoryItem(TierKind.HOST, Kind.GRAD_ACCUM_SCRATCH, sum(n * pb for n in streamed), req.pinned,
                                    "pinned scratch per parameter for accumulation"))
            rounding += scratch - sum(n * pb for n in streamed)
    elif req.weights_offloaded and model.blocks_known:
        # a released block's gradient is handed to the optimizer with it: param.grad lives for the
        # parameters outside the blocks and for two blocks (the one in backward, the one handed over)
        live = min(n_total, model.outside_numel + 2 * max(model.block_numels))
        items.append(MemoryItem(param_tier, Kind.GRAD, live * pb, False,
                                "param.grad outside the blocks + 2 blocks (released with their block)"))
    else:
        items.append(MemoryItem(param_tier, Kind.GRAD, n_total * pb, False, "param.grad"))

    # state per tier
    for tier, pinned in ((TierKind.DEVICE, False), (TierKind.HOST, req.pinned), (TierKind.NVME, False)):
        numel = sizes[tier]
        if numel == 0:
            continue
        master = numel * keys.get("master", 0)
        moments = numel * sum(b for k, b in keys.items() if k != "master")
        if master:
            items.append(MemoryItem(tier, Kind.MASTER, master, pinned))
        if moments:
            items.append(MemoryItem(tier, Kind.MOMENTS, moments, pinned))

    nvme_numel = sizes[TierKind.NVME]
    if nvme_numel:
        record_numel = min(req.subgroup_numel, nvme_numel)
        record = sum((record_numel * b + RECORD_ALIGN - 1) // RECORD_ALIGN * RECORD_ALIGN for b in keys.values())
        n_records = min(req.pool_buffers, math.ceil(nvme_numel / req.subgroup_numel))
        items.append(MemoryItem(TierKind.HOST, Kind.NVME_BUFFER_POOL, n_records * record, req.pinned,
                                f"{n_records} x {gib(record)} records"))

    staged = [n for n, inside in zip(numels, wholly_device) if not inside]
    if on_dev and req.param_dtype != "fp32" and staged:
        # one packed arena (tiers.packed_arena), 64 B slices, page-locked once
        staging = sum((n * pb + GRAD_ALIGN - 1) // GRAD_ALIGN * GRAD_ALIGN for n in staged)
        items.append(MemoryItem(TierKind.HOST, Kind.WEIGHT_STAGING, staging, req.pinned, "one arena, 64 B slices"))

    if rounding:
        items.append(MemoryItem(TierKind.HOST, Kind.PINNED_ROUNDING, rounding, True,
                                "torch's CachingHostAllocator rounds each scratch up to a power of two"))

    # The first step fills each parameter's state from a full-size temporary, one parameter
    # at a time, and builds the master from param.float(): the largest parameter sets the peak.
    if sizes[TierKind.HOST] or sizes[TierKind.NVME]:
        fills = [b for k, b in keys.items() if k != "master"]
        temp = model.largest_param * max(fills + [4 if req.needs_master and req.param_dtype != "fp32" else 0])
        if temp:
            items.append(MemoryItem(TierKind.HOST, Kind.FIRST_STEP_TEMPORARY, temp, False, "largest parameter"))

    act, note = activation_bytes(req)
    if act and not req.weights_offloaded:
        items.append(MemoryItem(param_tier, Kind.ACTIVATIONS, act, False, note))
    return items


# -- time -----------------------------------------------------------------------------------------------
def predict_time(req: PlanRequest, placement: Placement, hw: Hardware) -> StepTime:
    """Seconds per step by component (see the note at the top of the module)."""
    n_total = req.model.numel
    sizes = tier_sizes(n_total, placement.fractions())
    n_dev, n_host, n_nvme = sizes[TierKind.DEVICE], sizes[TierKind.HOST], sizes[TierKind.NVME]
    pb = DTYPE_BYTES[req.param_dtype]
    kernel_rate = hw.step_params_per_s * ADAM_KERNEL_BYTES  # bytes/s of the measured kernel
    per_param = req.update_bytes_per_param()
    seconds_per_param = per_param / kernel_rate
    compressed_rate = hw.compressed_rate(req.quant_map) if req.moment_dtype == "q8" else 0.0
    if compressed_rate > 0:
        seconds_per_param = max(seconds_per_param, 1.0 / compressed_rate)
    cpu_host = n_host * seconds_per_param
    cpu_nvme = n_nvme * seconds_per_param
    # A CPU gradient's norm is taken by its hook in backward, while the gradient is in cache
    # (pipeline/grads.py HookNorms; in backward.py for step_in_backward): no pass in the step.
    # The host copies of accelerator gradients are read once more for it.
    grad_pass = (n_host + n_nvme) * pb / (hw.sumsq_params_per_s * 4) if req.on_accelerator else 0.0

    state = req.state_bytes_per_param
    disk = 0.0
    pipeline = cpu_host + cpu_nvme
    if n_nvme:
        if hw.disk_read <= 0 or hw.disk_write <= 0:
            raise PlanError("an NVMe fraction needs disk read/write rates: run `tierstate probe --nvme-dir DIR`")
        records = math.ceil(n_nvme / req.subgroup_numel)
        # The pool is a write-back cache: the last buffer_count records of a step stay in RAM
        # and the next step starts on them, so a step moves S - buffer_count records each way
        # and has no fill bubble (tiers/nvme.py, "the buffer pool is a write-back cache").
        moved = max(0, records - req.pool_buffers) * (n_nvme / records) * state
        disk = moved / hw.disk_read + moved / hw.disk_write
        # Disk-bound: I/O back to back plus one record's update, which sits between its read and write.
        pipeline = max(pipeline, disk + (cpu_nvme / records if moved else 0.0))

    compute = None
    tokens = req.tokens_per_step
    if tokens is not None:
        flops = 6.0 * n_total * tokens
        shape = req.model.shape
        if shape is not None:
            flops += 12.0 * shape.n_layer * shape.hidden * req.seq_len * tokens  # attention scores and mix
        if req.activation_checkpointing:  # backward recomputes each block's forward (a third of its compute)
            if req.model.blocks_known and shape is not None:
                flops += (2.0 * sum(req.model.block_numels) + 4.0 * shape.n_layer * shape.hidden * req.seq_len) * tokens
            else:
                flops *= 4.0 / 3.0
        compute = flops / (hw.device_flops if req.on_accelerator else hw.host_flops)

    d2h = h2d = 0.0
    if req.on_accelerator:
        d2h = req.grad_accum * (n_host + n_nvme) * pb / hw.d2h
        h2d = (n_host + n_nvme) * (pb if req.param_dtype != "fp32" else 4) / hw.h2d
    # the recomputed forward runs inside backward: with checkpointing backward is 3 of 4 parts
    share = 0.75 if req.activation_checkpointing else BACKWARD_SHARE
    d2h_exposed = max(0.0, d2h - share * compute) if compute is not None else d2h
    device_update = 0.0
    if n_dev:
        device_update = n_dev * (per_param + state) / max(hw.device_bandwidth, 1.0)
    optimizer = max(device_update, grad_pass + pipeline)
    total = (compute or 0.0) + d2h_exposed + optimizer + h2d
    parts = {"compute": compute or 0.0, "pcie": d2h_exposed + h2d, "cpu_step": grad_pass + cpu_host + cpu_nvme,
             "disk": disk}
    bottleneck = max(parts, key=parts.get)
    return StepTime(compute, d2h, d2h_exposed, h2d, grad_pass, cpu_host + cpu_nvme, disk, device_update,
                    optimizer, total, bottleneck)


# -- budgets ----------------------------------------------------------------------------------------------
def shortfalls(req: PlanRequest, memory: list[MemoryItem], budgets: Budgets) -> list[str]:
    """What ``memory`` needs beyond ``budgets``, one sentence per exceeded budget."""
    def total(tier: TierKind) -> int:
        return sum(m.nbytes for m in memory if m.tier is tier)

    out = []
    if budgets.device is not None and total(TierKind.DEVICE) > budgets.device:
        out.append(f"needs {gib(total(TierKind.DEVICE))} of device memory, {gib(budgets.device)} available")
    if budgets.host is not None and total(TierKind.HOST) > budgets.host:
        out.append(f"needs {gib(total(TierKind.HOST))} of host memory, {gib(budgets.host)} available")
    pinned = sum(m.nbytes for m in memory if m.pinned)
    if budgets.pinned is not None and pinned > budgets.pinned:
        out.append(f"needs {gib(pinned)} of pinned host memory, {gib(budgets.pinned)} allowed")
    if budgets.disk is not None and total(TierKind.NVME) > budgets.disk:
        out.append(f"needs {gib(total(TierKind.NVME))} of disk under {budgets.disk_dir}, {gib(budgets.disk)} free")
    return out
