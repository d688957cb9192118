"""The planner: bytes per tier, predicted step time, and the placement that minimizes it.

Pure arithmetic over a :class:`~tierstate.placement.model_spec.ModelSpec`, a
:class:`Hardware` (figures from ``tierstate probe``) and :class:`Budgets`: no tensor, no
file, no clock. ``tierstate plan`` (plan_cli.py) and ``offload="auto"`` (auto.py) are its
two faces.

[Note: what the memory accounting mirrors]
Every figure follows what :class:`~tierstate.optim.base.OffloadOptimizer` allocates, so a
test can hold the two against each other:

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
- pinned memory: torch's CachingHostAllocator rounds every pinned allocation up to a
  power of two, so a 5 GiB arena takes 8 GiB of page-locked RAM. The rounding is its own
  line (``pinned_rounding``) so nobody mistakes it for state;
- the first step creates each parameter's state from a full-size temporary (and the
  fp32 master from ``param.float()``): the largest parameter sets that transient peak.

[Note: the step-time model]
One training step = compute (6 FLOPs per parameter per token, plus attention, at the
measured matmul rate) + the gradient copy to the host that backward could not hide
(backward is taken as 2/3 of compute) + the optimizer step + the weight upload. The
optimizer step is the gradient pass (global norm and inf check: one read of every
gradient) plus the sub-group pipeline, in which the CPU update and the NVMe reads/writes
overlap: max(CPU time, disk time + one record's update). The NVMe pool is a write-back
cache that keeps the last ``buffer_count`` records of a step for the next one, so a step
reads and writes ``S - buffer_count`` of its ``S`` records. CPU update time is the configuration's
bytes per parameter divided by the byte rate of the measured fp32 Adam kernel (28 B per
parameter), so a bf16-moment or low-precision configuration is priced by its traffic.
"""
from __future__ import annotations

import enum
import math
from dataclasses import asdict, dataclass, field, replace

from .defaults import DEFAULT_BUFFER_COUNT, DEFAULT_SUBGROUP_NUMEL
from .layout import TierKind, tier_sizes
from .model_spec import ModelSpec

GIB = 1 << 30
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# Per-element state tensors of each rule besides the master (see tierstate.optim.rules).
OPTIMIZER_MOMENTS = {"adamw": 2, "adam": 2, "lion": 1, "sgd": 1, "adagrad": 1}
GRAD_ALIGN = 64  # bytes per gradient slice in the host gradient arena (tiers/host.py packed_arena)
GRAD_BUCKET_BYTES = 32 << 20  # CUDA gradient-stream bucket (optim/grad_stream.py)
RECORD_ALIGN = 4096  # O_DIRECT: every key of an NVMe record starts on a page
ADAM_KERNEL_BYTES = 28  # fp32 Adam: read w, g, m, v (16 B) + write w, m, v (12 B)
BACKWARD_SHARE = 2.0 / 3.0  # backward is ~2x forward: the share of compute a gradient copy can hide behind


class Tier(str, enum.Enum):
    DEVICE = "device"
    HOST = "host"
    DISK = "disk"


class Kind(str, enum.Enum):
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


class PlanError(ValueError):
    """No placement meets the budgets; the message says what is missing."""


def pow2_ceil(nbytes: int) -> int:
    """What torch's CachingHostAllocator reserves for a pinned request of ``nbytes``."""
    return 0 if nbytes <= 0 else 1 << (int(nbytes) - 1).bit_length()


def gib(nbytes: float) -> str:
    """``41.2 GiB`` / ``1.25 GiB`` / ``96 MiB``: enough digits to tell need from budget."""
    if nbytes >= 10 * GIB:
        return f"{nbytes / GIB:.1f} GiB"
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / (1 << 20):.0f} MiB"


# -- inputs ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Hardware:
    """Rates the time model needs, in bytes/s, params/s and FLOP/s.

    Built from a probe profile (:meth:`from_profile`) or :meth:`conservative` (figures
    below most machines of 2020 or later, so a plan made without a probe errs slow).
    """

    source: str
    host_bandwidth: float  # STREAM triad, best thread count, B/s
    step_params_per_s: float  # fp32 Adam kernel (28 B/param), best thread count
    sumsq_params_per_s: float  # gradient norm pass over fp32 gradients
    host_flops: float  # matmul FLOP/s on the CPU
    disk_read: float = 0.0  # B/s, 0 when no disk was measured
    disk_write: float = 0.0
    h2d: float = 0.0  # pinned host -> device, B/s
    d2h: float = 0.0
    device_flops: float = 0.0
    device_bandwidth: float = 0.0
    device_free: int = 0
    threads: int = 1

    @classmethod
    def conservative(cls) -> "Hardware":
        return cls(source="conservative defaults (no hardware profile)", host_bandwidth=10e9,
                   step_params_per_s=0.3e9, sumsq_params_per_s=1e9, host_flops=50e9, disk_read=0.5e9,
                   disk_write=0.5e9, h2d=8e9, d2h=8e9, device_flops=50e12, device_bandwidth=500e9)

    @classmethod
    def from_profile(cls, profile: dict, source: str = "hardware profile") -> "Hardware":
        """Read the figures of a ``tierstate probe`` profile (schema 1); missing ones stay conservative."""
        base = cls.conservative()
        m = profile.get("measurements", {})

        def best(key: str, default: float) -> float:
            entry = m.get(key) or {}
            value = entry.get("best")
            return float(value) if value else default

        disks = [d for d in m.get("nvme", []) if d.get("read_bytes_per_s") and d.get("write_bytes_per_s")]
        cuda = m.get("cuda") or {}
        step = m.get("optimizer_step") or {}
        return cls(
            source=source,
            host_bandwidth=best("host_memory_bandwidth", base.host_bandwidth),
            step_params_per_s=best("optimizer_step", base.step_params_per_s),
            sumsq_params_per_s=best("grad_sumsq", base.sumsq_params_per_s),
            host_flops=best("host_matmul", base.host_flops),
            disk_read=min((d["read_bytes_per_s"] for d in disks), default=base.disk_read),
            disk_write=min((d["write_bytes_per_s"] for d in disks), default=base.disk_write),
            h2d=float(cuda.get("h2d_bytes_per_s") or base.h2d),
            d2h=float(cuda.get("d2h_bytes_per_s") or base.d2h),
            device_flops=float(cuda.get("matmul_flops") or base.device_flops),
            device_bandwidth=float(cuda.get("device_bandwidth_bytes_per_s") or base.device_bandwidth),
            device_free=int(cuda.get("free_bytes") or 0),
            threads=int(step.get("best_threads") or 1),
        )


@dataclass(frozen=True)
class Budgets:
    """What the run may use, in bytes; None means unlimited (not checked)."""

    device: int | None = None
    host: int | None = None
    pinned: int | None = None
    disk: int | None = None
    disk_dir: str = "the NVMe directory"


@dataclass(frozen=True)
class PlanRequest:
    """A training configuration to plan for (mirrors the arguments of ``ts.Offload``/``ts.AdamW``)."""

    model: ModelSpec
    device: str = "cuda"  # where the model's parameters live: "cuda" or "cpu"
    param_dtype: str = "bf16"
    moment_dtype: str = "fp32"
    optimizer: str = "adamw"
    amsgrad: bool = False
    grad_streaming: bool | None = None  # None: on for CUDA, off for CPU (Offload's default)
    keep_device_grads: bool = False
    pin_memory: bool = True
    subgroup_numel: int = DEFAULT_SUBGROUP_NUMEL
    buffer_count: int = DEFAULT_BUFFER_COUNT
    micro_batch: int | None = None
    seq_len: int | None = None
    grad_accum: int = 1
    activation_checkpointing: bool = False

    def __post_init__(self) -> None:
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device={self.device!r}: must be 'cuda' or 'cpu'")
        for name in ("param_dtype", "moment_dtype"):
            if getattr(self, name) not in DTYPE_BYTES:
                raise ValueError(f"{name}={getattr(self, name)!r}: must be one of {sorted(DTYPE_BYTES)}")
        if self.moment_dtype == "fp16":
            raise ValueError("moment_dtype='fp16': moments are stored in fp32 or bf16 (Offload.moment_dtype)")
        if self.optimizer not in OPTIMIZER_MOMENTS:
            raise ValueError(f"optimizer={self.optimizer!r}: must be one of {sorted(OPTIMIZER_MOMENTS)}")
        for name in ("subgroup_numel", "buffer_count", "grad_accum"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: must be a positive int")
        for name in ("micro_batch", "seq_len"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r}: must be a positive int or None")

    @property
    def on_accelerator(self) -> bool:
        return self.device == "cuda"

    @property
    def streaming(self) -> bool:
        return self.on_accelerator if self.grad_streaming is None else self.grad_streaming

    @property
    def pinned(self) -> bool:
        return self.on_accelerator and self.pin_memory

    @property
    def needs_master(self) -> bool:
        return self.on_accelerator or self.param_dtype != "fp32"

    def state_keys(self) -> dict[str, int]:
        """State key -> bytes per element, as the optimizer allocates them."""
        mb = DTYPE_BYTES[self.moment_dtype]
        n = OPTIMIZER_MOMENTS[self.optimizer] + (1 if self.amsgrad and self.optimizer in ("adam", "adamw") else 0)
        keys = {f"moment{i}": mb for i in range(n)}
        if self.needs_master:
            keys["master"] = 4
        return keys

    @property
    def state_bytes_per_param(self) -> int:
        return sum(self.state_keys().values())

    def update_bytes_per_param(self) -> int:
        """Memory traffic of one CPU update of one element (what the kernel reads and writes)."""
        pb, mb = DTYPE_BYTES[self.param_dtype], DTYPE_BYTES[self.moment_dtype]
        moments = len(self.state_keys()) - (1 if self.needs_master else 0)
        out = pb if self.param_dtype != "fp32" else 0  # the rounded weight written in the same pass
        return 8 + pb + 2 * mb * moments + out

    @property
    def tokens_per_step(self) -> int | None:
        if self.micro_batch is None or self.seq_len is None:
            return None
        return self.micro_batch * self.seq_len * self.grad_accum


@dataclass(frozen=True)
class Placement:
    """Fractions of the optimizer state per tier (as ``ts.Offload(gpu, cpu, nvme)``)."""

    gpu: float
    cpu: float
    nvme: float

    def fractions(self) -> dict:
        return {TierKind.DEVICE: self.gpu, TierKind.HOST: self.cpu, TierKind.NVME: self.nvme}


# -- outputs --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MemoryItem:
    tier: Tier
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


@dataclass
class Plan:
    request: PlanRequest
    placement: Placement
    memory: list[MemoryItem]
    time: StepTime
    hardware: Hardware
    budgets: Budgets
    reason: str = ""
    notes: list[str] = field(default_factory=list)

    def tier_total(self, tier: Tier) -> int:
        return sum(m.nbytes for m in self.memory if m.tier is tier)

    def pinned_total(self) -> int:
        return sum(m.nbytes for m in self.memory if m.pinned)

    def bytes_of(self, tier: Tier, kind: Kind) -> int:
        return sum(m.nbytes for m in self.memory if m.tier is tier and m.kind is kind)

    def as_dict(self) -> dict:
        req = self.request
        return {
            "model": {"name": req.model.name, "params": req.model.numel, "tensors": len(req.model.param_numels),
                      "source": req.model.source},
            "config": {k: v for k, v in asdict(req).items() if k != "model"},
            "placement": asdict(self.placement),
            "reason": self.reason,
            "memory": [{"tier": m.tier.value, "kind": m.kind.value, "bytes": m.nbytes, "pinned": m.pinned,
                        "note": m.note} for m in self.memory],
            "totals": {t.value: self.tier_total(t) for t in Tier} | {"pinned": self.pinned_total()},
            "time_s": asdict(self.time) | {"components": self.time.components()},
            "hardware": asdict(self.hardware),
            "budgets": asdict(self.budgets),
            "notes": list(self.notes),
        }


# -- memory ---------------------------------------------------------------------------------------------
def _activation_bytes(req: PlanRequest) -> tuple[int, str]:
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
    keys = req.state_keys()
    sizes = tier_sizes(n_total, placement.fractions())
    on_dev = req.on_accelerator
    param_tier = Tier.DEVICE if on_dev else Tier.HOST
    items: list[MemoryItem] = [MemoryItem(param_tier, Kind.PARAM, n_total * pb)]
    rounding = 0

    # gradients: parameters touching the device tier keep theirs on the device, the others are streamed
    touching, wholly_device = _device_touching(numels, sizes[TierKind.DEVICE])
    streamed = [n for n, t in zip(numels, touching) if not t]
    device_grads = sum(n for n, t in zip(numels, touching) if t)
    if req.streaming:
        arena = sum((n * pb + GRAD_ALIGN - 1) // GRAD_ALIGN * GRAD_ALIGN for n in streamed)
        items.append(MemoryItem(Tier.HOST, Kind.HOST_GRAD_BUFFER, arena, req.pinned, "one arena, 64 B slices"))
        rounding += pow2_ceil(arena) - arena if req.pinned else 0
        if req.keep_device_grads or not on_dev:
            kept = n_total * pb if req.keep_device_grads else model.largest_param * pb
            items.append(MemoryItem(param_tier, Kind.GRAD, kept, False,
                                    "param.grad kept" if req.keep_device_grads else "one param.grad before its copy"))
        else:
            items.append(MemoryItem(Tier.DEVICE, Kind.GRAD, min(sum(streamed) * pb, GRAD_BUCKET_BYTES
                                                                + max(streamed, default=0) * pb),
                                    False, "one bucket in flight"))
            if device_grads:
                items.append(MemoryItem(Tier.DEVICE, Kind.GRAD, device_grads * pb, False,
                                        "param.grad of the parameters touching the device tier"))
        if on_dev and req.grad_accum > 1:
            scratch = sum(pow2_ceil(n * pb) for n in streamed)
            items.append(MemoryItem(Tier.HOST, Kind.GRAD_ACCUM_SCRATCH, sum(n * pb for n in streamed), req.pinned,
                                    "pinned scratch per parameter for accumulation"))
            rounding += scratch - sum(n * pb for n in streamed)
    else:
        items.append(MemoryItem(param_tier, Kind.GRAD, n_total * pb, False, "param.grad"))

    # state per tier
    for kind_tier, tier, pinned in ((TierKind.DEVICE, Tier.DEVICE, False), (TierKind.HOST, Tier.HOST, req.pinned),
                                    (TierKind.NVME, Tier.DISK, False)):
        numel = sizes[kind_tier]
        if numel == 0:
            continue
        master = numel * keys.get("master", 0)
        moments = numel * sum(b for k, b in keys.items() if k != "master")
        if master:
            items.append(MemoryItem(tier, Kind.MASTER, master, pinned))
        items.append(MemoryItem(tier, Kind.MOMENTS, moments, pinned))
        if pinned:
            rounding += sum(pow2_ceil(numel * b) - numel * b for b in keys.values())

    nvme_numel = sizes[TierKind.NVME]
    if nvme_numel:
        record_numel = min(req.subgroup_numel, nvme_numel)
        record = sum((record_numel * b + RECORD_ALIGN - 1) // RECORD_ALIGN * RECORD_ALIGN for b in keys.values())
        n_records = min(req.buffer_count, math.ceil(nvme_numel / req.subgroup_numel))
        items.append(MemoryItem(Tier.HOST, Kind.NVME_BUFFER_POOL, n_records * record, req.pinned,
                                f"{n_records} x {gib(record)} records"))
        rounding += n_records * (pow2_ceil(record) - record) if req.pinned else 0

    staged = [n for n, inside in zip(numels, wholly_device) if not inside]
    if on_dev and req.param_dtype != "fp32" and staged:
        # one packed arena (tiers.packed_arena), 64 B slices, pinned once: rounded once
        staging = sum((n * pb + GRAD_ALIGN - 1) // GRAD_ALIGN * GRAD_ALIGN for n in staged)
        items.append(MemoryItem(Tier.HOST, Kind.WEIGHT_STAGING, staging, req.pinned, "one arena, 64 B slices"))
        rounding += pow2_ceil(staging) - staging if req.pinned else 0

    if rounding:
        items.append(MemoryItem(Tier.HOST, Kind.PINNED_ROUNDING, rounding, True,
                                "CachingHostAllocator rounds each pinned block to a power of two"))

    # The first step fills each parameter's state from a full-size temporary, one parameter
    # at a time, and builds the master from param.float(): the largest parameter sets the peak.
    if sizes[TierKind.HOST] or sizes[TierKind.NVME]:
        temp = model.largest_param * max(DTYPE_BYTES[req.moment_dtype],
                                         4 if req.needs_master and req.param_dtype != "fp32" else 0)
        if temp:
            items.append(MemoryItem(Tier.HOST, Kind.FIRST_STEP_TEMPORARY, temp, False, "largest parameter"))

    act, note = _activation_bytes(req)
    if act:
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
    cpu_host = n_host * per_param / kernel_rate
    cpu_nvme = n_nvme * per_param / kernel_rate
    grad_pass = (n_host + n_nvme) * pb / (hw.sumsq_params_per_s * 4)

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
        moved = max(0, records - req.buffer_count) * (n_nvme / records) * state
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
        compute = flops / (hw.device_flops if req.on_accelerator else hw.host_flops)

    d2h = h2d = 0.0
    if req.on_accelerator:
        d2h = req.grad_accum * (n_host + n_nvme) * pb / hw.d2h
        h2d = (n_host + n_nvme) * (pb if req.param_dtype != "fp32" else 4) / hw.h2d
    d2h_exposed = max(0.0, d2h - BACKWARD_SHARE * compute) if compute is not None else d2h
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


# -- placement ------------------------------------------------------------------------------------------
def shortfalls(req: PlanRequest, memory: list[MemoryItem], budgets: Budgets) -> list[str]:
    """What ``memory`` needs beyond ``budgets``, one sentence per exceeded budget."""
    def total(tier: Tier) -> int:
        return sum(m.nbytes for m in memory if m.tier is tier)

    out = []
    if budgets.device is not None and total(Tier.DEVICE) > budgets.device:
        out.append(f"needs {gib(total(Tier.DEVICE))} of device memory, {gib(budgets.device)} available")
    if budgets.host is not None and total(Tier.HOST) > budgets.host:
        out.append(f"needs {gib(total(Tier.HOST))} of host memory, {gib(budgets.host)} available")
    pinned = sum(m.nbytes for m in memory if m.pinned)
    if budgets.pinned is not None and pinned > budgets.pinned:
        out.append(f"needs {gib(pinned)} of pinned host memory, {gib(budgets.pinned)} allowed")
    if budgets.disk is not None and total(Tier.DISK) > budgets.disk:
        out.append(f"needs {gib(total(Tier.DISK))} of disk under {budgets.disk_dir}, {gib(budgets.disk)} free")
    return out


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
    if req.moment_dtype != "bf16":
        fixes.append("use bf16 moments (--moment-dtype bf16)")
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
    counts = [req.buffer_count] + sorted((c for c in buffer_options if c < req.buffer_count), reverse=True)
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

