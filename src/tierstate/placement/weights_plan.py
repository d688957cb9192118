"""The weight planner: which blocks stay resident, which stream and from where, how far ahead.

Pure arithmetic over per-block byte counts, budgets and a hardware profile: no tensor, no file,
no clock. :func:`plan_weights` returns a :class:`WeightPlan` that ``offload_weights(...,
offload="auto")`` follows and ``tierstate plan --offload-weights auto`` prints.

[Note: the tiers a block can live on]
- ``resident``: on the compute device for the whole step (on a CPU compute device: in host RAM);
- ``cpu``: a home in pinned host RAM, copied to the device around each use. Only for a CUDA
  compute device: on a CPU the weights already are in host RAM, and copying them from RAM to RAM
  buys nothing, so ``cpu`` is never chosen there;
- ``nvme``: a record in a file on the NVMe folder, read into a host image (pinned on CUDA)
  around each use; the compute copy is rewritten with the optimizer's update once per step.
Resident blocks are the first ones in execution order: the forward pass starts on them, and
their compute hides the first fetches of the streamed ones.

[Note: the window and the prefetch depth]
This mirrors the weight streamer (``tierstate.weights``). NVMe blocks are read into host
*images* from a pool of ``prefetch + 2`` buffers of the largest NVMe record (4 KiB-aligned):
the block in use, the one whose write-back may still be in flight, and ``prefetch`` read ahead
(never more buffers than NVMe blocks). That pool is the window: ``window_blocks`` buffers,
``window_bytes`` = ``window_blocks * the largest NVMe record``, in host RAM (pinned on CUDA).
A ``cpu`` home is its own image. The compute device holds the streamed block that runs, and on
CUDA also the next one, whose copy up overlaps this one's compute: ``materialized_blocks`` = 1
on a CPU, 2 on CUDA, each the size of the largest streamed block. Every pinned allocation (each
``cpu`` home, each pool buffer) takes its size rounded up to a page (:func:`tierstate.io.
page_locked_empty`; torch's pinned allocator, which rounds to a power of two, is not used).
A fetch of block ``i`` takes ``fetch_s`` = the sum of its stages (disk read, then the PCIe copy);
it hides under the compute of the blocks before it when ``prefetch >= ceil(fetch_s / compute_s)``
with ``compute_s`` one block's forward (the shortest compute a fetch must hide behind: backward
is taken as 2x forward, as in :mod:`.cost_model`). The planner asks for that depth, capped at
``max_prefetch``, and takes less only when the memory does not allow it.

[Note: the weight time model]
Per micro-batch each streamed block is fetched twice: for its forward, and for its backward
(under activation checkpointing the recomputation runs right before the backward, on the same
fetch). With ``d`` fetches in flight, a streamed block takes ``max(c, s, fetch_s / d)`` where
``c`` is its compute in that pass and ``s`` its slowest stage (``c + fetch_s`` when ``d = 0``:
fetched on demand); a resident block takes ``c``. Each pass also waits once for the first fetch
(the window's fill), less the compute of the resident blocks that run before it. After the
optimizer update the NVMe blocks' compute copy is written back once (``disk_write``), which
the next forward's reads share the disk with, so it is added. Disk reads and writes are priced
as a sum (concurrent reads and writes on one disk took the sum of their times: see
:mod:`.probe`). The optimizer's own NVMe traffic shares the same disk; ``tierstate plan`` adds
the two plans' times for the joint step.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Sequence

from .plan_inputs import Hardware, PlanError, gib

RECORD_ALIGN = 4096  # an NVMe record's alignment (O_DIRECT), as the streamer's NVMe home keeps it

RESIDENT, CPU, NVME = "resident", "cpu", "nvme"
WEIGHT_TIERS = (RESIDENT, CPU, NVME)
COMPUTE_DEVICES = ("cpu", "cuda")
# Prefetch depth when one block's compute time is unknown: the streamer's own default (2 blocks
# ahead), enough to overlap a fetch with the compute of the two blocks before it.
DEFAULT_PREFETCH = 2
BACKWARD_FACTOR = 2.0  # backward ~2x forward (two matmuls per forward one)
FETCHES_PER_MICRO_BATCH = 2  # forward, backward (recompute shares the backward's fetch)
# Candidates within 1% of the fastest predicted step are taken as equally fast; among them the
# one moving fewest bytes (most blocks resident), then the deeper prefetch (never beyond the depth
# that hides a fetch: it absorbs the jitter of fetch times the model does not see), then less RAM.
TIE_TOLERANCE = 0.01


@dataclass(frozen=True)
class WeightPlan:
    """Where each block's compute-dtype weights live, the window, and what a step costs.

    Fields the weight streamer follows: :attr:`tier_of` (per block, in execution order:
    ``"resident"``, ``"cpu"`` or ``"nvme"``), :attr:`prefetch` (blocks fetched ahead),
    :attr:`window_blocks` (the pool of host images NVMe blocks are read into: ``prefetch + 2``,
    at most the NVMe blocks; 0 without NVMe blocks). The rest is the prediction: bytes moved per step per tier, seconds, the
    bottleneck, the memory it takes, and the alternatives that lost with why.
    """

    compute: str  # "cuda" or "cpu"
    block_bytes: tuple[int, ...]
    resident_bytes: int  # parameters outside the blocks, always on the compute device
    tier_of: tuple[str, ...]
    prefetch: int
    window_blocks: int  # host images of NVMe blocks (the streamer's pool)
    window_bytes: int  # window_blocks * the largest NVMe record
    materialized_blocks: int  # streamed blocks on the compute device at once: 1 on a CPU, 2 on CUDA
    materialized_bytes: int  # materialized_blocks * the largest streamed block
    host_peak_bytes: int  # host RAM the weights take at peak (pinned homes + window; on CPU also resident)
    pinned_bytes: int  # of host_peak_bytes: page-locked
    compute_peak_bytes: int  # compute-device memory at peak: resident + materialized + activations
    disk_bytes: int  # files on the NVMe folder: the nvme blocks' compute copy
    activation_bytes: int
    disk_read_bytes: int  # per training step (all micro-batches)
    disk_write_bytes: int
    pcie_bytes: int  # host -> device, per step
    fetch_seconds: float  # one fetch of the largest streamed block from the slowest home; 0 when none
    compute_seconds: float | None  # forward + backward of the blocks, per step; None when not given
    disk_seconds: float
    pcie_seconds: float
    step_seconds: float | None  # the blocks' share of a step: compute + waits on weights + write-back
    bottleneck: str  # "compute", "disk" or "pcie"
    reason: str
    rejected: tuple[str, ...] = field(default=())
    notes: tuple[str, ...] = field(default=())

    def blocks_on(self, tier: str) -> tuple[int, ...]:
        """Indices of the blocks on ``tier`` ("resident", "cpu" or "nvme")."""
        if tier not in WEIGHT_TIERS:
            raise ValueError(f"tier={tier!r}: must be one of {WEIGHT_TIERS}")
        return tuple(i for i, t in enumerate(self.tier_of) if t == tier)

    def bytes_on(self, tier: str) -> int:
        """Bytes of the blocks on ``tier``."""
        return sum(self.block_bytes[i] for i in self.blocks_on(tier))

    @property
    def streamed(self) -> int:
        """How many blocks are streamed (not resident)."""
        return sum(t != RESIDENT for t in self.tier_of)

    @property
    def stall_seconds(self) -> float | None:
        """Predicted seconds per step spent waiting on weights (fetches not hidden, write-back)."""
        if self.step_seconds is None or self.compute_seconds is None:
            return None
        return max(0.0, self.step_seconds - self.compute_seconds)

    def as_dict(self) -> dict:
        out = asdict(self)
        out["tier_of"] = list(self.tier_of)
        out["block_bytes"] = list(self.block_bytes)
        out["blocks"] = {t: len(self.blocks_on(t)) for t in WEIGHT_TIERS}
        out["bytes"] = {t: self.bytes_on(t) for t in WEIGHT_TIERS}
        out["stall_seconds"] = self.stall_seconds
        return out

    def describe(self) -> list[str]:
        """The plan in a few lines for people: placement, window, traffic, time, alternatives."""
        n = len(self.tier_of)
        where = "device" if self.compute == "cuda" else "host RAM"
        parts = []
        for tier, label in ((RESIDENT, f"resident ({where})"), (CPU, "pinned host RAM"), (NVME, "NVMe")):
            idx = self.blocks_on(tier)
            if idx:
                parts.append(f"{len(idx)} {label} [{_ranges(idx)}] {gib(self.bytes_on(tier))}")
        lines = [f"weights: {n} blocks: " + ", ".join(parts) + f"; outside the blocks {gib(self.resident_bytes)} "
                 f"resident - {self.reason}"]
        if self.streamed:
            pool = f"window {self.window_blocks} NVMe images ({gib(self.window_bytes)}), " if self.window_blocks else ""
            lines.append(f"{pool}prefetch {self.prefetch}, {self.materialized_blocks} streamed on the compute device "
                         f"({gib(self.materialized_bytes)}); one fetch {self.fetch_seconds * 1e3:.1f} ms")
        if self.compute == "cuda":
            lines.append(f"memory: device {gib(self.compute_peak_bytes)} (activations {gib(self.activation_bytes)} "
                         f"included), host RAM {gib(self.host_peak_bytes)} (pinned {gib(self.pinned_bytes)}), disk "
                         f"{gib(self.disk_bytes)}")
        else:
            lines.append(f"memory: host RAM {gib(self.host_peak_bytes)} for the weights + activations "
                         f"{gib(self.activation_bytes)} = {gib(self.compute_peak_bytes)}, disk {gib(self.disk_bytes)}")
        lines.append(f"per step: disk read {gib(self.disk_read_bytes)}, disk write {gib(self.disk_write_bytes)}, "
                     f"PCIe {gib(self.pcie_bytes)}")
        if self.step_seconds is not None:
            lines.append(f"predicted: {self.step_seconds * 1e3:.1f} ms for the blocks (compute "
                         f"{self.compute_seconds * 1e3:.1f} ms, waiting on weights {self.stall_seconds * 1e3:.1f} ms); "
                         f"bottleneck: {self.bottleneck}")
        else:
            lines.append(f"predicted: disk {self.disk_seconds * 1e3:.1f} ms, PCIe {self.pcie_seconds * 1e3:.1f} ms per "
                         f"step; compute unknown (give the compute time per block); bottleneck: {self.bottleneck}")
        lines += [f"rejected: {r}" for r in self.rejected]
        lines += list(self.notes)
        return lines


def _blocks(count: int) -> str:
    return f"{count} block" if count == 1 else f"{count} blocks"


def _ranges(indices: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    out, start = [], None
    for i, k in enumerate(indices):
        if start is None:
            start = k
        if i + 1 == len(indices) or indices[i + 1] != k + 1:
            out.append(f"{start}" if start == k else f"{start}-{k}")
            start = None
    return ", ".join(out)


# -- inputs -----------------------------------------------------------------------------------------
def _int_arg(name: str, value, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}={value!r}: must be an int (bytes), not {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}={value!r}: must be >= {minimum}")
    return value


def _hardware_of(profile) -> Hardware:
    if profile is None:
        return Hardware.conservative()
    if isinstance(profile, Hardware):
        return profile
    if isinstance(profile, dict):
        if "measurements" not in profile:
            raise ValueError("profile: a dict without 'measurements' is not a `tierstate probe` profile; pass "
                             "probe.load_profile(...), a placement.plan_inputs.Hardware, or None (conservative rates)")
        return Hardware.from_profile(profile)
    raise TypeError(f"profile={type(profile).__name__}: expected a Hardware, a `tierstate probe` profile dict, or "
                    "None (conservative rates)")


@dataclass(frozen=True)
class _Inputs:
    blocks: tuple[int, ...]
    resident: int
    compute: str
    compute_budget: int
    host_budget: int
    disk_budget: int | None
    hw: Hardware
    activations: int
    compute_s: float | None  # one block's forward, one micro-batch
    max_prefetch: int
    micro_batches: int
    checkpointing: bool
    tier: str


@dataclass(frozen=True)
class _Candidate:
    plan: WeightPlan
    n_resident: int

    @property
    def key_time(self) -> float:
        p = self.plan
        return p.step_seconds if p.step_seconds is not None else p.disk_seconds + p.pcie_seconds


def _stages(inp: _Inputs, tier: str, nbytes: int) -> list[float]:
    """Seconds of each stage of one fetch of ``nbytes`` from ``tier``."""
    hw = inp.hw
    stages = []
    if tier == NVME:
        stages.append(nbytes / hw.disk_read)
    if inp.compute == "cuda":
        stages.append(nbytes / hw.h2d)
    return stages


def _desired_prefetch(inp: _Inputs, fetch_s: float) -> int:
    if inp.compute_s is None:
        return min(DEFAULT_PREFETCH, inp.max_prefetch)
    return min(inp.max_prefetch, max(1, math.ceil(fetch_s / inp.compute_s - 1e-9)))


def _record(nbytes: int) -> int:
    """An NVMe record: the block's bytes rounded up to the 4 KiB O_DIRECT alignment."""
    return (nbytes + RECORD_ALIGN - 1) // RECORD_ALIGN * RECORD_ALIGN


def _pool(inp: _Inputs, nvme: list[int], prefetch: int) -> tuple[int, int, int]:
    """(buffers, bytes, host bytes taken) of the image pool for the NVMe blocks ``nvme``."""
    if not nvme:
        return 0, 0, 0
    count = min(prefetch + 2, len(nvme))
    record = _record(max(inp.blocks[i] for i in nvme))
    taken = count * record  # a record is whole pages already
    return count, count * record, taken


def _homes(inp: _Inputs, streamed: list[int], prefetch: int) -> tuple[list[str], int] | str:
    """Tiers of the streamed blocks (on CUDA ``cpu`` homes first, while host RAM allows beside
    the NVMe image pool) and the pinned host bytes of the homes; or why they do not fit."""
    blocks, hw = inp.blocks, inp.hw
    if inp.compute == "cpu" or inp.tier == NVME:
        tiers, homes = [NVME] * len(streamed), 0
    else:
        cost = [_record(blocks[i]) for i in streamed]
        if sum(cost) <= inp.host_budget:
            return [CPU] * len(streamed), sum(cost)
        if inp.tier == CPU:
            return (f"pinned host homes for {_blocks(len(streamed))} need {gib(sum(cost))} of host RAM, "
                    f"host_memory_budget {gib(inp.host_budget)}")
        # the most leading blocks in pinned RAM such that the image pool for the rest still fits
        prefix = [0]
        for c in cost:
            prefix.append(prefix[-1] + c)
        suffix_max = [0] * (len(streamed) + 1)
        for j in range(len(streamed) - 1, -1, -1):
            suffix_max[j] = max(suffix_max[j + 1], blocks[streamed[j]])
        n_cpu = 0
        for j in range(len(streamed) - 1, -1, -1):
            pool = min(prefetch + 2, len(streamed) - j) * _record(suffix_max[j])
            if prefix[j] + pool <= inp.host_budget:
                n_cpu = j
                break
        tiers, homes = [CPU] * n_cpu + [NVME] * (len(streamed) - n_cpu), prefix[n_cpu]
    if not (hw.disk_read > 0 and hw.disk_write > 0):
        return "no disk read/write rates in the profile for NVMe homes (run `tierstate probe --nvme-dir DIR`)"
    return tiers, homes


def _homes_text(plan: WeightPlan) -> str:
    return ", ".join(f"{len(plan.blocks_on(t))} {label}" for t, label in ((CPU, "in pinned RAM"), (NVME, "on NVMe"))
                     if plan.blocks_on(t))


def _evaluate(inp: _Inputs, n_resident: int, prefetch: int, reason: str = "") -> _Candidate | str:
    """The plan keeping the first ``n_resident`` blocks resident with ``prefetch`` blocks ahead, or
    a sentence saying which budget it breaks."""
    blocks, hw = inp.blocks, inp.hw
    n = len(blocks)
    streamed = list(range(n_resident, n))
    n_s = len(streamed)
    prefetch = min(prefetch, max(n_s - 1, 0))
    largest = max((blocks[i] for i in streamed), default=0)
    materialized = min(2 if inp.compute == "cuda" else 1, n_s)
    homes = _homes(inp, streamed, prefetch) if n_s else ([], 0)
    if isinstance(homes, str):
        return homes
    stream_tiers, home_bytes = homes
    tier_of = tuple([RESIDENT] * n_resident + stream_tiers)
    window, window_bytes, pool_taken = _pool(inp, [i for i in streamed if tier_of[i] == NVME], prefetch)
    resident_blocks = sum(blocks[:n_resident])
    parts = [f"outside the blocks {gib(inp.resident)}", f"{_blocks(n_resident)} resident {gib(resident_blocks)}"]
    if materialized:
        parts.append(f"{materialized} streamed x {gib(largest)}")
    if inp.compute == "cuda":
        pinned = host_bytes = home_bytes + pool_taken
        if host_bytes > inp.host_budget:
            return (f"needs {gib(host_bytes)} of pinned host RAM (homes {gib(home_bytes)} + {window} NVMe images "
                    f"{gib(pool_taken)}), host_memory_budget {gib(inp.host_budget)}")
        compute_peak = inp.resident + resident_blocks + materialized * largest + inp.activations
        where, budget = "device memory", inp.compute_budget
    else:
        pinned = 0
        host_bytes = inp.resident + resident_blocks + materialized * largest + window_bytes  # activations apart
        compute_peak = host_bytes + inp.activations
        where, budget = "host RAM", min(inp.compute_budget, inp.host_budget)
        if window:
            parts.append(f"{window} NVMe images x {gib(window_bytes // window)}")
    if compute_peak > budget:
        return (f"needs {gib(compute_peak)} of {where} ({' + '.join(parts)} + activations {gib(inp.activations)}), "
                f"budget {gib(budget)}")
    nvme_bytes = sum(blocks[i] for i, t in zip(range(n), tier_of) if t == NVME)
    if nvme_bytes and inp.disk_budget is not None and nvme_bytes > inp.disk_budget:
        return f"needs {gib(nvme_bytes)} of disk for the NVMe blocks, disk_budget {gib(inp.disk_budget)}"

    m = inp.micro_batches
    streamed_bytes = sum(blocks[i] for i in streamed)
    disk_read = FETCHES_PER_MICRO_BATCH * m * nvme_bytes
    disk_write = nvme_bytes
    pcie = FETCHES_PER_MICRO_BATCH * m * streamed_bytes if inp.compute == "cuda" else 0
    disk_s = (disk_read / hw.disk_read + disk_write / hw.disk_write) if nvme_bytes else 0.0
    pcie_s = pcie / hw.h2d if pcie else 0.0
    fetch_of = {i: sum(_stages(inp, tier_of[i], blocks[i])) for i in streamed}
    slowest_stage = {i: max(_stages(inp, tier_of[i], blocks[i])) for i in streamed}
    fetch_s = max(fetch_of.values(), default=0.0)

    compute_total = step = None
    if inp.compute_s is not None:
        c_fwd = inp.compute_s
        c_bwd = inp.compute_s * (BACKWARD_FACTOR + (1.0 if inp.checkpointing else 0.0))
        compute_total = m * n * (c_fwd + c_bwd)
        per_micro = 0.0
        for c in (c_fwd, c_bwd):
            per_micro += n_resident * c
            for i in streamed:
                if prefetch == 0:
                    per_micro += c + fetch_of[i]
                else:
                    per_micro += max(c, slowest_stage[i], fetch_of[i] / prefetch)
        if n_s and prefetch:
            first = fetch_of[streamed[0]]
            per_micro += max(0.0, first - n_resident * c_fwd)  # forward: resident blocks run first
            per_micro += fetch_of[streamed[-1]]  # backward starts on the last (streamed) block
        step = m * per_micro + (disk_write / hw.disk_write if disk_write else 0.0)
    parts = {"compute": compute_total or 0.0, "disk": disk_s, "pcie": pcie_s}
    bottleneck = max(parts, key=parts.get) if (n_s or compute_total) else "compute"
    if compute_total is None and not n_s:
        bottleneck = "compute"
    plan = WeightPlan(
        compute=inp.compute, block_bytes=blocks, resident_bytes=inp.resident, tier_of=tier_of,
        prefetch=prefetch if n_s else 0, window_blocks=window, window_bytes=window_bytes,
        materialized_blocks=materialized, materialized_bytes=materialized * largest,
        host_peak_bytes=host_bytes, pinned_bytes=pinned,
        compute_peak_bytes=compute_peak, disk_bytes=nvme_bytes, activation_bytes=inp.activations,
        disk_read_bytes=disk_read, disk_write_bytes=disk_write, pcie_bytes=pcie, fetch_seconds=fetch_s,
        compute_seconds=compute_total, disk_seconds=disk_s, pcie_seconds=pcie_s, step_seconds=step,
        bottleneck=bottleneck, reason=reason)
    return _Candidate(plan, n_resident)


def plan_weights(block_bytes: Sequence[int], *, resident_bytes: int, compute: str, compute_memory_budget: int,
                 host_memory_budget: int, profile, activation_bytes: int, compute_seconds_per_block: float | None,
                 max_prefetch: int = 4, disk_budget: int | None = None, micro_batches: int = 1,
                 activation_checkpointing: bool = False, tier: str = "auto") -> WeightPlan:
    """Choose where each block's weights live, the window and the prefetch depth.

    Args:
        block_bytes: bytes of each repeated block in its compute dtype, in execution order
            (``WeightStreamer.block_bytes()``).
        resident_bytes: bytes of the parameters outside the blocks (embeddings, head, norms:
            ``WeightStreamer.resident_bytes()``); they stay on the compute device.
        compute: ``"cuda"`` or ``"cpu"``: where the blocks run.
        compute_memory_budget: bytes of compute-device memory the weights and activations may
            take (on ``"cpu"`` this is host RAM, the same memory as ``host_memory_budget``: the
            plan keeps within both, so the smaller binds).
        host_memory_budget: bytes of host RAM the weights may take beside the optimizer state
            (pinned ``cpu`` homes and the NVMe image pool on CUDA; on CPU the resident blocks, the
            block that runs and the image pool).
        profile: the hardware rates: a :class:`~tierstate.placement.plan_inputs.Hardware`, a
            ``tierstate probe`` profile dict (``probe.load_profile()``), or None for the
            conservative defaults.
        activation_bytes: activations of one micro-batch on the compute device (0 if unknown).
        compute_seconds_per_block: seconds of one block's forward for one micro-batch (backward
            is taken as 2x); None when unknown: the prefetch depth is then ``DEFAULT_PREFETCH``
            and no step time is predicted.
        max_prefetch: the deepest prefetch to consider (0 fetches each block on demand).
        disk_budget: bytes of free disk for the NVMe blocks' files; None: unchecked.
        micro_batches: forward/backward passes per optimizer step (gradient accumulation).
        activation_checkpointing: backward recomputes each block's forward (more compute per
            fetch; the number of fetches stays two per micro-batch).
        tier: ``"auto"`` (the fastest within the budgets), or ``"cpu"``/``"nvme"`` to stream
            every block from that tier (only the window and prefetch are chosen).

    Returns the fastest :class:`WeightPlan` within the budgets (ties: most blocks resident,
    then the deeper prefetch up to the wanted depth, then less host RAM), with the alternatives
    that lost.
    Raises TypeError/ValueError naming a bad argument, and
    :class:`~tierstate.placement.plan_inputs.PlanError` (a ValueError) when not even every block
    streamed without prefetch fits, naming the budget and the need.
    """
    if isinstance(block_bytes, (str, bytes)) or not isinstance(block_bytes, Sequence):
        raise TypeError(f"block_bytes={block_bytes!r}: must be a sequence of ints (bytes per block), e.g. "
                        "WeightStreamer.block_bytes()")
    if not block_bytes:
        raise ValueError("block_bytes=[]: give at least one block (the model's repeated blocks, in execution order)")
    blocks = tuple(_int_arg(f"block_bytes[{i}]", b, 1) for i, b in enumerate(block_bytes))
    resident = _int_arg("resident_bytes", resident_bytes)
    if compute not in COMPUTE_DEVICES:
        raise ValueError(f"compute={compute!r}: must be 'cuda' or 'cpu' (where the blocks run)")
    compute_budget = _int_arg("compute_memory_budget", compute_memory_budget)
    host_budget = _int_arg("host_memory_budget", host_memory_budget)
    activations = _int_arg("activation_bytes", activation_bytes)
    if disk_budget is not None:
        _int_arg("disk_budget", disk_budget)
    if isinstance(max_prefetch, bool) or not isinstance(max_prefetch, int) or max_prefetch < 0:
        raise ValueError(f"max_prefetch={max_prefetch!r}: must be an int >= 0 (0 fetches each block on demand)")
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches={micro_batches!r}: must be an int >= 1 (gradient accumulation steps)")
    if compute_seconds_per_block is not None:
        if isinstance(compute_seconds_per_block, bool) or not isinstance(compute_seconds_per_block, (int, float)) \
                or not math.isfinite(compute_seconds_per_block) or compute_seconds_per_block <= 0:
            raise ValueError(f"compute_seconds_per_block={compute_seconds_per_block!r}: must be a finite number of "
                             "seconds > 0 (one block's forward), or None when unknown")
    if tier not in ("auto", CPU, NVME):
        raise ValueError(f"tier={tier!r}: must be 'auto', 'cpu' or 'nvme'")
    if compute == "cpu" and tier == CPU:
        raise ValueError("tier='cpu' with compute='cpu': the weights already are in host RAM, and streaming them "
                         "from RAM to RAM buys nothing; use tier='nvme' or 'auto'")
    hw = _hardware_of(profile)
    if compute == "cuda" and hw.h2d <= 0:
        raise ValueError("profile: no host-to-device rate (h2d) for compute='cuda'; run `tierstate probe` on the "
                         "CUDA machine or pass None for conservative rates")
    inp = _Inputs(blocks, resident, compute, compute_budget, host_budget, disk_budget, hw, activations,
                  None if compute_seconds_per_block is None else float(compute_seconds_per_block), max_prefetch,
                  micro_batches, bool(activation_checkpointing), tier)
    return _choose(inp)


def _choose(inp: _Inputs) -> WeightPlan:
    n = len(inp.blocks)
    residents = range(n, -1, -1) if inp.tier == "auto" else (0,)
    candidates: list[_Candidate] = []
    refusals: dict[tuple[int, int], str] = {}
    wanted: dict[int, int] = {}
    for k in residents:
        if k == n:
            got = _evaluate(inp, n, 0)
            (candidates.append(got) if isinstance(got, _Candidate) else refusals.__setitem__((n, 0), got))
            continue
        probe = _evaluate(inp, k, 0)  # the homes and fetch time do not depend on the depth
        fetch_s = probe.plan.fetch_seconds if isinstance(probe, _Candidate) else _nominal_fetch(inp, k)
        want = min(_desired_prefetch(inp, fetch_s), max(n - k - 1, 0))
        wanted[k] = want
        for d in range(want, -1, -1):  # a shallower pool may leave room for more pinned homes: price each
            got = _evaluate(inp, k, d)
            if isinstance(got, _Candidate):
                candidates.append(got)
            else:
                refusals[(k, d)] = got
    if not candidates:
        raise PlanError(_infeasible(inp, refusals))
    fastest = min(c.key_time for c in candidates)
    near = [c for c in candidates if c.key_time <= fastest * (1 + TIE_TOLERANCE) + 1e-12]
    best = min(near, key=lambda c: (-c.n_resident, -c.plan.prefetch, c.plan.host_peak_bytes))
    return _explain(inp, best, candidates, refusals, wanted)


def _nominal_fetch(inp: _Inputs, k: int) -> float:
    largest = max(inp.blocks[k:])
    tier = NVME if inp.compute == "cpu" or inp.tier == NVME else CPU
    return sum(_stages(inp, tier, largest)) if (tier != NVME or inp.hw.disk_read > 0) else 0.0


def _infeasible(inp: _Inputs, refusals: dict[tuple[int, int], str]) -> str:
    smallest = refusals.get((0, 0)) or next(iter(refusals.values()), "no candidate")
    where = "device memory" if inp.compute == "cuda" else "host RAM"
    fixes = [f"raise compute_memory_budget ({where})" if inp.compute == "cuda" else "raise the host RAM budget",
             "lower activation_bytes (a smaller micro-batch, activation checkpointing)"]
    if inp.compute == "cuda":
        fixes.append("raise host_memory_budget (pinned homes and NVMe images)")
    return (f"no weight placement fits: even with every block streamed and no prefetch it {smallest}. Fixes: "
            + "; or ".join(fixes) + ".")


def _explain(inp: _Inputs, best: _Candidate, candidates: list[_Candidate],
             refusals: dict[tuple[int, int], str], wanted: dict[int, int]) -> WeightPlan:
    p, n, k = best.plan, len(inp.blocks), best.n_resident
    where = "on the device" if inp.compute == "cuda" else "in host RAM"
    ms = lambda c: f"{c.key_time * 1e3:.1f} ms"  # noqa: E731
    if k == n:
        reason = f"every block fits {where} next to the activations"
    else:
        homes = []
        if p.blocks_on(CPU):
            homes.append(f"{len(p.blocks_on(CPU))} from pinned host RAM")
        if p.blocks_on(NVME):
            homes.append(f"{len(p.blocks_on(NVME))} from NVMe")
        reason = (f"{k} of {n} blocks fit {where} beside the streamed ones; the other {n - k} stream "
                  f"({', '.join(homes)})") if k else f"all {n} blocks stream ({', '.join(homes)})"
        if inp.tier != "auto":
            reason = f"tier={inp.tier!r}: every block streams from it"
    rejected = []
    by_k: dict[int, _Candidate] = {}  # the fastest candidate per number of resident blocks
    for c in candidates:
        if c.n_resident not in by_k or c.key_time < by_k[c.n_resident].key_time:
            by_k[c.n_resident] = c
    by_kd = {(c.n_resident, c.plan.prefetch): c for c in candidates}
    if inp.tier == "auto" and k < n:
        rejected.append(f"all {n} blocks resident: {refusals.get((n, 0), 'slower')}")
        if k + 1 < n and (k + 1) in by_k:  # fits, but slower (a tie would have chosen it)
            more = by_k[k + 1]
            rejected.append(f"{_blocks(k + 1)} resident: leaves room for prefetch {more.plan.prefetch} only, "
                            f"{ms(more)} predicted against {ms(best)}")
        elif k + 1 < n:
            why = refusals.get((k + 1, 0)) or next((v for (kk, _), v in refusals.items() if kk == k + 1), "does not fit")
            rejected.append(f"{_blocks(k + 1)} resident: {why}")
    if 0 < k < n and (k - 1) in by_k and inp.tier == "auto":
        rejected.append(f"{_blocks(k - 1)} resident: {ms(by_k[k - 1])} predicted against {ms(best)}, no gain")
    if p.streamed:
        want = wanted.get(k, p.prefetch)
        if p.prefetch < want:
            deeper = by_kd.get((k, want))
            rejected.append(f"prefetch {want} (what hides a fetch): " + (
                f"{ms(deeper)} predicted against {ms(best)} ({_homes_text(deeper.plan)})" if deeper
                else refusals.get((k, want), "does not fit")))
        elif p.prefetch < min(inp.max_prefetch, p.streamed - 1):
            deeper = _evaluate(inp, k, p.prefetch + 1)
            if isinstance(deeper, _Candidate):
                hidden = inp.compute_s is not None
                rejected.append(f"prefetch {p.prefetch + 1}: "
                                + (f"no faster: a fetch ({p.fetch_seconds * 1e3:.1f} ms) already hides under "
                                   f"{p.prefetch} blocks' forward ({inp.compute_s * 1e3:.1f} ms each)" if hidden else
                                   "compute time per block unknown: the default depth is kept")
                                + f"; {gib(deeper.plan.host_peak_bytes - p.host_peak_bytes)} more host RAM")
            else:
                rejected.append(f"prefetch {p.prefetch + 1}: {deeper}")
        if inp.compute == "cuda" and p.blocks_on(NVME) and inp.tier == "auto":
            need = sum(_record(inp.blocks[i]) for i in range(k, n))
            rejected.append(f"all {p.streamed} streamed blocks in pinned host RAM: needs {gib(need)}, "
                            f"host_memory_budget {gib(inp.host_budget)}")
    if inp.compute == "cpu" and p.streamed:
        rejected.append("'cpu' tier: on a CPU compute device the weights already are in host RAM; streaming them "
                        "from RAM to RAM buys nothing")
    notes = []
    if inp.compute_s is None and p.streamed:
        notes.append(f"compute time per block unknown: prefetch {p.prefetch} is the default depth, not fitted to "
                     "the fetch time")
    return replace(p, reason=reason, rejected=tuple(rejected), notes=tuple(notes))
