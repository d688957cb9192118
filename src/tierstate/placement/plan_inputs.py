"""What a plan is computed from: the request, the machine's rates, the budgets, a placement.

:class:`PlanRequest` mirrors the arguments of ``ts.Offload`` and the optimizer; the optimizer's
per-element state comes in as key names (its rule's ``state_specs``), so placement knows no
optimizer. :class:`Hardware` holds the figures of ``tierstate probe``; :class:`Budgets` what
the run may use. All plain values: the cost model (:mod:`.cost_model`) and the search
(:mod:`.planner`) read them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .defaults import (DEFAULT_SUBGROUP_NUMEL, MASTER_DTYPES, QUANT_MAPS, default_buffer_count, is_own_master,
                       state_bytes_per_element)
from .layout import TierKind
from .model_spec import ModelSpec

GIB = 1 << 30
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


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
    # The fused 8-bit step per map family (params/s; fp32 master, bf16 grad and weight out).
    # Compute-bound where the fp32 step is memory-bound: measured on a 2-vCPU Xeon at 3.6x
    # (dynamic maps) and 1.8x (fp8) the time its bytes take at the fp32 kernel's rate.
    compressed_params_per_s: tuple = ()  # ((maps, params/s), ...)

    def compressed_rate(self, maps: str) -> float:
        """params/s of the fused 8-bit step in the ``maps`` family (0.0 when not measured)."""
        return dict(self.compressed_params_per_s).get(maps, 0.0)

    @classmethod
    def conservative(cls) -> "Hardware":
        # The 8-bit rates keep the ratio to the fp32 step measured on the Xeon (50M parameters,
        # 2 threads: fp32 1.69, dynamic 0.78, fp8 1.55 Gparam/s): 0.14 and 0.27 here.
        return cls(source="conservative defaults (no hardware profile)", host_bandwidth=10e9,
                   step_params_per_s=0.3e9, sumsq_params_per_s=1e9, host_flops=50e9, disk_read=0.5e9,
                   disk_write=0.5e9, h2d=8e9, d2h=8e9, device_flops=50e12, device_bandwidth=500e9,
                   compressed_params_per_s=(("dynamic", 0.14e9), ("fp8", 0.27e9)))

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
        measured = (m.get("compressed_step") or {}).get("by_maps") or {}
        # a profile from before the 8-bit rates were probed: the conservative ones, scaled by how
        # much faster this machine's fp32 step is than the conservative one
        scale = best("optimizer_step", base.step_params_per_s) / base.step_params_per_s
        compressed = tuple((k, float(measured[k]) if measured.get(k) else r * scale)
                           for k, r in base.compressed_params_per_s)
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
            compressed_params_per_s=compressed,
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
    moment_dtype: str = "fp32"  # "fp32", "bf16" or "q8" (Offload.moment_dtype)
    master_dtype: str = "fp32"  # "fp32", "bf16_kahan" or "bf16_sr" (Offload.master_dtype)
    quant_block: int = 256  # Offload.quant_block, for moment_dtype="q8"
    quant_map: str = "dynamic"  # Offload.quant_map, for moment_dtype="q8" (the same bytes either way)
    optimizer: str = ""  # the optimizer's name, shown in the output (the keys below say what it allocates)
    grad_streaming: bool | None = None  # None: on for CUDA, off for CPU (Offload's default)
    keep_device_grads: bool = False
    pin_memory: bool = True
    subgroup_numel: int = DEFAULT_SUBGROUP_NUMEL
    # the NVMe pool's buffers (Offload.buffer_count); None: the optimizer's default
    # (Offload.buffer_count_for), which grows with step_in_backward over streamed weights
    buffer_count: int | None = None
    micro_batch: int | None = None
    seq_len: int | None = None
    grad_accum: int = 1
    activation_checkpointing: bool = False
    # True when the weights are offloaded (``ts.offload_weights``): their compute copy and the
    # activations are then priced by the weight plan (placement/weights_plan.py), not here.
    weights_offloaded: bool = False
    # ts.AdamW(step_in_backward=True): with the weights streamed per block, the default pool
    # holds twice the NVMe records one block's gradients complete (Offload.buffer_count_for)
    step_in_backward: bool = False
    # The optimizer's per-element state besides the master, by torch's key names: the keys its
    # rule declares (``UpdateRule.state_specs``: ``("exp_avg", "exp_avg_sq")`` for AdamW, ``()``
    # for SGD without momentum). ``state_keys`` are moments, stored in ``moment_dtype``;
    # ``fp32_state_keys`` are stored in fp32 whatever ``moment_dtype`` says.
    state_keys: tuple[str, ...] = field(kw_only=True)
    fp32_state_keys: tuple[str, ...] = field(default=(), kw_only=True)

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for name in ("state_keys", "fp32_state_keys"):
            keys = getattr(self, name)
            if isinstance(keys, (str, bytes)) or not isinstance(keys, (tuple, list)):
                raise ValueError(f"{name}={keys!r}: must be a tuple of key names, e.g. ('exp_avg', 'exp_avg_sq') "
                                 "(the names of the rule's state_specs)")
            for key in keys:
                if not isinstance(key, str) or not key:
                    raise ValueError(f"{name}={tuple(keys)!r}: every key must be a non-empty str, got {key!r}")
                if key == "master":
                    raise ValueError(f"{name}={tuple(keys)!r}: 'master' is counted by the planner itself "
                                     "(PlanRequest.needs_master); name only the rule's state keys")
                if key in seen:
                    where = "twice" if list(keys).count(key) > 1 else "also in state_keys"
                    raise ValueError(f"{name}={tuple(keys)!r}: {key!r} {where}; name each key once")
                seen.add(key)
            object.__setattr__(self, name, tuple(keys))
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device={self.device!r}: must be 'cuda' or 'cpu'")
        if self.param_dtype not in DTYPE_BYTES:
            raise ValueError(f"param_dtype={self.param_dtype!r}: must be one of {sorted(DTYPE_BYTES)}")
        if self.moment_dtype not in ("fp32", "bf16", "q8"):
            raise ValueError(f"moment_dtype={self.moment_dtype!r}: moments are stored in 'fp32', 'bf16' or 'q8' "
                             "(Offload.moment_dtype)")
        if self.master_dtype not in MASTER_DTYPES:
            raise ValueError(f"master_dtype={self.master_dtype!r}: must be one of {MASTER_DTYPES}")
        if self.master_dtype != "fp32" and self.moment_dtype != "q8":
            raise ValueError(f"master_dtype={self.master_dtype!r} needs moment_dtype='q8' (the fused 8-bit kernels)")
        qb = self.quant_block
        if isinstance(qb, bool) or not isinstance(qb, int) or not 64 <= qb <= 4096 or qb & (qb - 1):
            raise ValueError(f"quant_block={qb!r}: must be a power of two in [64, 4096], e.g. 256")
        if self.quant_map not in QUANT_MAPS:
            raise ValueError(f"quant_map={self.quant_map!r}: must be one of {QUANT_MAPS} (Offload.quant_map)")
        if self.quant_map != "dynamic" and self.moment_dtype != "q8":
            raise ValueError(f"quant_map={self.quant_map!r} needs moment_dtype='q8' (the maps of 8-bit moments)")
        if not isinstance(self.optimizer, str):
            raise ValueError(f"optimizer={self.optimizer!r}: must be a str (the name shown in the output)")
        for name in ("subgroup_numel", "buffer_count", "grad_accum"):
            value = getattr(self, name)
            if name == "buffer_count" and value is None:
                continue  # the optimizer's default pool
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: must be a positive int"
                                 + (" or None (the optimizer's default pool)" if name == "buffer_count" else ""))
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
    def block_records(self) -> int:
        """The most NVMe records one streamed block's gradients complete during backward, as
        the optimizer counts them to size its default pool (0 unless ``step_in_backward`` over
        weights streamed per block): the largest block's elements over the sub-group size,
        plus one for a block that starts inside a record."""
        if not (self.step_in_backward and self.weights_offloaded and self.model.blocks_known):
            return 0
        return -(-max(self.model.block_numels) // self.subgroup_numel) + 1

    @property
    def pool_buffers(self) -> int:
        """The NVMe pool's buffers: ``buffer_count``, or the optimizer's default
        (:meth:`tierstate.placement.Offload.buffer_count_for`: the larger of 16 + 2 x
        :attr:`block_records` and the buffers of this layout's records that fit in the RAM of
        16 fp32 ones)."""
        if self.buffer_count is not None:
            return self.buffer_count
        return default_buffer_count(self.state_bytes(), self.block_records)

    @property
    def needs_master(self) -> bool:
        """A master copy is stored: accelerator parameters, and host parameters of another
        dtype than the master's (:func:`tierstate.placement.defaults.is_own_master`)."""
        return self.on_accelerator or not is_own_master(self.param_dtype, self.master_dtype)

    def state_bytes(self) -> dict[str, float]:
        """State key -> bytes per element, as the optimizer allocates them (the master last):
        :func:`tierstate.placement.offload.state_bytes_per_element`, the optimizer's own table."""
        return state_bytes_per_element(self.moment_dtype, self.master_dtype, self.quant_block,
                                       moment_keys=self.state_keys, fp32_keys=self.fp32_state_keys,
                                       needs_master=self.needs_master, quant_map=self.quant_map)

    @property
    def state_bytes_per_param(self) -> float:
        return sum(self.state_bytes().values())

    @property
    def master_bytes_per_param(self) -> float:
        """The stored master's share of :attr:`state_bytes_per_param` (``master`` and its
        compensation ``master.comp``)."""
        return sum(b for key, b in self.state_bytes().items() if key.startswith("master"))

    def update_bytes_per_param(self) -> float:
        """Memory traffic of one CPU update of one element (what the kernel reads and writes):
        the gradient, the weight (its master, or the parameter itself where it is its own master,
        with a bf16 one's compensation) and the state read and written, and the rounded
        low-precision weight written beside a stored master."""
        pb = DTYPE_BYTES[self.param_dtype]
        master = self.master_bytes_per_param
        state = self.state_bytes_per_param - master
        if self.needs_master:
            weight, out = master, (pb if self.param_dtype != "fp32" else 0)  # the rounded weight, same pass
        else:
            weight, out = pb + master, 0  # updated in place
        return 2 * weight + pb + 2 * state + out

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
