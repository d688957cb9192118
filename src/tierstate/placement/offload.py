"""The offload policy: which fraction of the optimizer state lives in which tier."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence, Union

import torch

from .defaults import (DEFAULT_BUFFER_COUNT, DEFAULT_QUANT_BLOCK, DEFAULT_QUANT_MAP, DEFAULT_SUBGROUP_NUMEL,
                       HOST_SUBGROUP_NUMEL, MASTER_DTYPES, Q8, QUANT_BLOCK_RANGE, QUANT_MAPS, default_buffer_count,
                       default_nvme_root, nvme_dirs_of, state_bytes_per_element)

PathLike = Union[str, os.PathLike]

OFFLOAD_MODES = ("cpu", "nvme", "auto")
HOST_ALLOCATOR_POLICIES = ("retain", "retain_small", "system")
# The dtype names the CLI takes (`--moment-dtype bf16`), accepted for the torch dtypes they name.
DTYPE_SPELLINGS = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


def dtype_name(dtype) -> str:
    """``torch.float32`` -> ``"fp32"``, ``torch.bfloat16`` -> ``"bf16"``, ``"q8"`` -> ``"q8"``."""
    return {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(dtype, dtype if isinstance(dtype, str) else str(dtype))


@dataclass(frozen=True)
class Offload:
    """Where the optimizer state lives, as fractions of it per tier.

    ``gpu + cpu + nvme`` must be 1; a fraction not given is 0, except ``cpu``, which takes
    what the others leave (``Offload(nvme=1.0)`` is all on NVMe, ``Offload(nvme=0.4)`` puts
    0.6 in host RAM, ``Offload()`` all of it). The state is cut into sub-groups of
    ``subgroup_numel`` elements at most, each in one tier; the tiers hold the requested
    fractions to the element (each tier's last sub-group may be shorter).

    Args:
        gpu: fraction kept in the parameters' device memory and updated there by torch's
            own kernels (``torch._fused_adamw_``/``_fused_adam_`` for AdamW/Adam, elementwise
            torch ops for the others), queued before the host part so that on CUDA both run
            at once. Needs the parameters on an accelerator. Their gradients stay in
            ``param.grad`` (not streamed); ``optimizer.state`` lists only ``step`` for them (``state[p][key]`` reads a CPU copy) and
            ``state_dict()`` reads their state as CPU tensors. Testing aid: with the
            environment variable ``TIERSTATE_DEVICE_TIER_ON_CPU=1`` (read when the optimizer
            is built) the device tier also runs on CPU parameters, keeping its "device" state
            in host memory and running the very code a GPU runs, so it is tested on machines
            without one; it is slower than ``cpu=`` there and not meant for training.
        cpu: fraction kept in host RAM and updated by the native kernels (default: ``1 - gpu - nvme``).
        nvme: fraction kept in files under ``nvme_dir``, streamed through a bounded pool.
        nvme_dir: a folder or a list of folders (one per drive; sub-groups are striped
            across them). Default: :func:`default_nvme_root`.
        subgroup_numel: elements per sub-group (the unit of placement and streaming). Default
            (None): 4 Mi elements (``DEFAULT_SUBGROUP_NUMEL``: an NVMe record of 48 MiB at most,
            the unit the disk moves, and what ``step_in_backward`` updates at once); 32 Mi
            (``HOST_SUBGROUP_NUMEL``) for CPU parameters whose state is all in host RAM and
            that step after backward, where a sub-group only costs a kernel call
            (:meth:`subgroup_numel_for`).
        buffer_count: host buffers in the NVMe streaming pool (>= 2: one being updated,
            one in flight; never more than the tier has sub-groups); host RAM of the NVMe
            tier is bounded by this pool. Default (None): 16 records of fp32 state (512-768
            MiB at the default sub-group size), or as many compressed records as fit in that
            RAM (63 for q8 moments under a bf16_sr master); with ``step_in_backward=True``
            over weights streamed per block (:func:`tierstate.offload_weights`), at least 16
            plus the records two blocks' gradients complete (:meth:`buffer_count_for`: 112
            for a Llama-2-7B layer with bf16 moments, 1.75 GiB), so one block's state is read
            while the one before is updated.
        moment_dtype: how the Adam moments are stored: ``torch.float32``, ``torch.bfloat16``
            (saves 4 B/param of memory traffic and storage) or ``"q8"``: blockwise 8-bit codes
            with an fp32 scale per ``quant_block`` elements (2.03 B/param for both moments
            instead of 8; format and maps in ``docs/compressed_state.md``). ``"q8"`` is for
            ``ts.AdamW``/``ts.Adam`` without amsgrad, on the host and NVMe tiers. The torch
            dtypes may be spelled as on the CLI: ``"fp32"``/``"float32"``, ``"bf16"``/``"bfloat16"``.
        master_dtype: how the master weight is stored: ``torch.float32`` (or ``"fp32"``), ``"bf16_kahan"``
            (bf16 plus an int16 compensation term: the fp32 weight to 24 significant bits, 4
            B, and the stored master is a ready bf16 weight) or ``"bf16_sr"`` (bf16 with
            seeded stochastic rounding, 2 B). The 16-bit modes need ``moment_dtype="q8"``.
            A bf16 parameter in host memory is its own bf16 master (updated in place; only
            ``"bf16_kahan"``'s 2 B compensation is stored beside it); fp32 parameters and
            parameters on an accelerator keep a stored master.
        quant_block: elements per quantization block of ``"q8"`` (a power of two in [64,
            4096]; 256 by default: 1.58 % update error, 128 gives 1.32 % for 0.03 B/param more).
        quant_map: the 8-bit maps of ``"q8"``: ``"dynamic"`` (default: bitsandbytes' dynamic-tree
            maps, decoded and encoded through tables) or ``"fp8"`` (8-bit floats: sign + E4M3
            for ``exp_avg``, E4M4 for ``sqrt(exp_avg_sq)``, decoded and encoded by arithmetic:
            the fused step takes 0.4-0.8x the dynamic maps' time on a Xeon, at a larger update
            error; figures in ``docs/compressed_state.md``). Same bytes either way.
        sr_seed: seed of ``"bf16_sr"``'s rounding; each parameter mixes its index in, and the
            rounding of an element depends on (seed, parameter, step, element) only, so a run
            is reproducible whatever the thread count or tier.
        pin_memory: page-lock host buffers when a CUDA device is used.
        grad_streaming: copy each gradient to a host buffer from a backward hook as soon
            as it is produced (default: on for CUDA parameters, off for CPU ones, whose
            gradients already are in host RAM).
        keep_device_grads: keep ``param.grad`` on the device after it was streamed to the
            host (default False: its memory is released once copied, and ``param.grad`` is
            None after backward, so code that reads or changes gradients between backward
            and ``step()`` finds none: ``torch.nn.utils.clip_grad_norm_`` then clips nothing
            and returns 0. Clip with the optimizer's ``max_grad_norm=``, which clips the
            streamed gradients, or set this to True to keep ``param.grad``: a gradient
            changed after its copy, or assigned, is then copied again before the step, so
            ``clip_grad_norm_`` and ``scaler.unscale_`` work as with torch's optimizers).
        host_allocator: ``"retain"``: keep host memory that torch frees in the process heap
            for reuse (:func:`tierstate.host_allocator.retain_freed_memory`, process-wide),
            so forward and backward on CPU parameters stop page-faulting (GPT-2 124M fp32 on
            a 2-vCPU VM: 140-210 K faults and ~0.5 CPU-s of kernel time per step less; RSS
            then stays near its high-water mark: +0.34 GiB there). ``"retain_small"``: the
            heap is kept, and serves blocks below 32 MiB; a larger block it has no room for
            is mapped, and returned to the system when freed
            (:func:`tierstate.host_allocator.retain_small_blocks`). ``"system"``:
            leave the C allocator alone. Default (None): ``"retain"`` for CPU parameters whose
            state is all in host RAM (no ``nvme`` part), ``"retain_small"`` for CPU
            parameters with an NVMe tier (chosen to bound host memory: GPT-2 124M fp32 with
            its state on NVMe peaked at 3.08-3.10 GiB, as under ``"system"``, against plain
            torch's 3.72-3.77, and its step was 1.08-1.12x torch's against 1.18-1.22x; under
            ``"system"`` glibc cut the heap back after each step and the next forward faulted
            it in again), ``"system"`` for accelerator parameters. The environment variable
            ``TIERSTATE_HOST_ALLOCATOR=system|retain_small|retain`` overrides the default, not
            an explicit value. With an NVMe tier, ``"retain"`` is the choice for speed when RAM
            is not the limit (``docs/step_modes.md``).
    """

    gpu: float = 0.0
    cpu: float | None = None  # None: the remainder, 1 - gpu - nvme
    nvme: float = 0.0
    nvme_dir: PathLike | Sequence[PathLike] | None = None
    subgroup_numel: int | None = None
    buffer_count: int | None = None
    moment_dtype: torch.dtype | str = torch.float32
    master_dtype: torch.dtype | str = torch.float32
    quant_block: int = DEFAULT_QUANT_BLOCK
    quant_map: str = DEFAULT_QUANT_MAP
    sr_seed: int = 0
    pin_memory: bool = True
    grad_streaming: bool | None = None
    keep_device_grads: bool = False
    host_allocator: str | None = None
    nvme_dirs: tuple[Path, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.cpu is None:
            for name in ("gpu", "nvme"):
                value = getattr(self, name)
                if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 <= value <= 1.0:
                    raise ValueError(f"Offload({name}={value!r}): a tier's fraction must be a number in [0, 1]")
            rest = 1.0 - self.gpu - self.nvme
            if rest < -1e-6:
                raise ValueError(
                    f"Offload(gpu={self.gpu}, nvme={self.nvme}): the fractions sum to {self.gpu + self.nvme:g}; "
                    "they must sum to 1 (e.g. Offload(gpu=0.3, nvme=0.7)); what they leave goes to cpu")
            object.__setattr__(self, "cpu", max(0.0, rest) if rest > 1e-9 else 0.0)
        for name in ("gpu", "cpu", "nvme"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 <= value <= 1.0:
                raise ValueError(f"Offload({name}={value!r}): a tier's fraction must be a number in [0, 1]")
        total = self.gpu + self.cpu + self.nvme
        if abs(total - 1.0) > 1e-6:
            raise ValueError(
                f"Offload(gpu={self.gpu}, cpu={self.cpu}, nvme={self.nvme}): the fractions sum to "
                f"{total:g}; they must sum to 1 (e.g. Offload(cpu=0.6, nvme=0.4))"
            )
        if self.subgroup_numel is not None and (not isinstance(self.subgroup_numel, int)
                                                or isinstance(self.subgroup_numel, bool) or self.subgroup_numel < 1024):
            raise ValueError(
                f"Offload(subgroup_numel={self.subgroup_numel!r}): must be an int >= 1024, or None for the default "
                f"({DEFAULT_SUBGROUP_NUMEL}; {HOST_SUBGROUP_NUMEL} for CPU parameters with all state in RAM)"
            )
        if self.buffer_count is not None and (not isinstance(self.buffer_count, int)
                                              or isinstance(self.buffer_count, bool) or self.buffer_count < 2):
            raise ValueError(f"Offload(buffer_count={self.buffer_count!r}): must be an int >= 2, or None for the "
                             f"default ({DEFAULT_BUFFER_COUNT} records of fp32 state, more of compressed state "
                             f"and for weights streamed per block)")
        # the strings the CLI takes (`--moment-dtype bf16`), stored as the torch dtype they name
        for name in ("moment_dtype", "master_dtype"):
            spelled = getattr(self, name)
            dtype = DTYPE_SPELLINGS.get(spelled) if isinstance(spelled, str) else None
            if dtype is not None and not (name == "master_dtype" and dtype is torch.bfloat16):
                object.__setattr__(self, name, dtype)
        self._check_compression()
        for name in ("pin_memory", "keep_device_grads") + (("grad_streaming",) if self.grad_streaming is not None else ()):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"Offload({name}={getattr(self, name)!r}): must be True or False"
                                + (" (or None for the default)" if name == "grad_streaming" else ""))
        if self.host_allocator is not None and self.host_allocator not in HOST_ALLOCATOR_POLICIES:
            raise ValueError(f"Offload(host_allocator={self.host_allocator!r}): must be one of "
                             f"{HOST_ALLOCATOR_POLICIES}, or None for the default (retain on CPU parameters)")
        object.__setattr__(self, "nvme_dirs", nvme_dirs_of(self.nvme_dir))

    def _check_compression(self) -> None:
        if not any(self.moment_dtype is d or self.moment_dtype == d for d in (torch.float32, torch.bfloat16, Q8)):
            raise ValueError(f"Offload(moment_dtype={self.moment_dtype!r}): must be torch.float32 (or 'fp32'), "
                             "torch.bfloat16 (or 'bf16') or 'q8' (blockwise 8-bit moments)")
        if self.master_dtype == torch.bfloat16 or DTYPE_SPELLINGS.get(self.master_dtype) is torch.bfloat16:
            raise ValueError(f"Offload(master_dtype={self.master_dtype!r}): a plain bf16 master loses updates below "
                             "its resolution; choose 'bf16_kahan' (bf16 + compensation, 4 B) or 'bf16_sr' "
                             "(stochastic rounding, 2 B), or torch.float32")
        if not (self.master_dtype == torch.float32 or self.master_dtype in MASTER_DTYPES[1:]):
            raise ValueError(f"Offload(master_dtype={self.master_dtype!r}): must be torch.float32 (or 'fp32'), "
                             "'bf16_kahan' or 'bf16_sr'")
        if self.master_dtype != torch.float32 and self.moment_dtype != Q8:
            raise ValueError(f"Offload(master_dtype={self.master_dtype!r}, moment_dtype={self.moment_dtype!r}): a "
                             "16-bit master runs in the fused 8-bit kernels only; add moment_dtype='q8'")
        qb = self.quant_block
        lo, hi = QUANT_BLOCK_RANGE
        if isinstance(qb, bool) or not isinstance(qb, int) or not lo <= qb <= hi or qb & (qb - 1):
            raise ValueError(f"Offload(quant_block={qb!r}): must be a power of two in [{lo}, {hi}], e.g. 256")
        if self.quant_map not in QUANT_MAPS:
            raise ValueError(f"Offload(quant_map={self.quant_map!r}): must be one of "
                             f"{', '.join(map(repr, QUANT_MAPS))}")
        if self.quant_map != DEFAULT_QUANT_MAP and self.moment_dtype != Q8:
            raise ValueError(f"Offload(quant_map={self.quant_map!r}, moment_dtype={self.moment_dtype!r}): the maps "
                             "are those of 8-bit moments; add moment_dtype='q8'")
        if isinstance(self.sr_seed, bool) or not isinstance(self.sr_seed, int) or not 0 <= self.sr_seed < 2**64:
            raise ValueError(f"Offload(sr_seed={self.sr_seed!r}): must be an int in [0, 2**64), e.g. 0")
        if self.compressed:
            if self.subgroup_numel is not None and self.subgroup_numel % qb:
                raise ValueError(f"Offload(subgroup_numel={self.subgroup_numel}, quant_block={qb}): sub-groups "
                                 f"must hold whole blocks; use a multiple of {qb}, e.g. {self.subgroup_numel // qb * qb or qb}")
            if self.gpu > 0:
                raise ValueError(f"Offload(gpu={self.gpu}, moment_dtype={self.moment_dtype!r}, master_dtype="
                                 f"{self.master_dtype!r}): the device tier runs torch's fused Adam, which has no "
                                 "compressed state; keep the compressed state on the host and NVMe tiers "
                                 "(Offload(gpu=0, ...)) or use moment_dtype=torch.bfloat16 with gpu > 0")

    @property
    def compressed(self) -> bool:
        """Whether the state is compressed (8-bit moments, perhaps a 16-bit master)."""
        return self.moment_dtype == Q8

    @property
    def master_mode(self) -> str:
        """``"fp32"``, ``"bf16_kahan"`` or ``"bf16_sr"``."""
        return "fp32" if self.master_dtype == torch.float32 else self.master_dtype

    def quant_config(self):
        """The :class:`tierstate.kernels.quant.QuantConfig` of a compressed policy, else None."""
        if not self.compressed:
            return None
        from ..kernels.quant import QuantConfig  # noqa: PLC0415 - placement stays importable without kernels

        return QuantConfig(block_size=self.quant_block, master=self.master_mode, maps=self.quant_map)

    def bytes_per_element(self, *, moment_keys=("exp_avg", "exp_avg_sq"), needs_master: bool = True) -> dict:
        """Stored bytes per parameter of each state key under this policy (:func:`state_bytes_per_element`)."""
        return state_bytes_per_element(dtype_name(self.moment_dtype), self.master_mode, self.quant_block,
                                       moment_keys=moment_keys, needs_master=needs_master, quant_map=self.quant_map)

    @classmethod
    def from_mode(cls, mode: "str | Offload", **overrides) -> "Offload":
        """``"cpu"`` -> all state in host RAM; ``"nvme"`` -> all state in files."""
        if isinstance(mode, Offload):
            return mode
        if mode == "cpu":
            return cls(cpu=1.0, **overrides)
        if mode == "nvme":
            return cls(cpu=0.0, nvme=1.0, **overrides)
        raise ValueError(
            f"offload={mode!r} is not a known mode: use one of {OFFLOAD_MODES} or a tierstate.Offload(...)"
        )

    @classmethod
    def with_nvme_dir(cls, mode: "str | Offload", nvme_dir) -> "Offload":
        """The policy of an optimizer's ``offload=mode, nvme_dir=nvme_dir`` (the shorthand of
        ``Offload(nvme_dir=...)``). Refused where the folder would go unused or is given twice."""
        if isinstance(mode, Offload):
            if mode.nvme_dir is not None:
                raise ValueError(
                    f"nvme_dir={str(nvme_dir)!r} given both to the optimizer and as Offload(nvme_dir="
                    f"{mode.nvme_dir!r}); give it in one place")
            if mode.nvme == 0:
                raise ValueError(f"nvme_dir={str(nvme_dir)!r} with {mode!r}: that policy keeps no state on NVMe; "
                                 "give it an nvme fraction, e.g. Offload(cpu=0.6, nvme=0.4)")
            return dataclasses.replace(mode, nvme_dir=nvme_dir)
        if mode == "nvme":
            return cls.from_mode(mode, nvme_dir=nvme_dir)
        if mode == "cpu":
            raise ValueError(f"nvme_dir={str(nvme_dir)!r} with offload='cpu': that mode keeps no state on NVMe; "
                             "use offload='nvme' or an Offload(...) with an nvme fraction")
        if mode == "auto":
            raise ValueError(
                f"nvme_dir={str(nvme_dir)!r} with offload='auto': the planner measures its disk budget at "
                "the default NVMe root; set TIERSTATE_NVME_DIR to the folder instead, or pick the placement "
                "yourself with offload=Offload(..., nvme_dir=...)")
        return cls.from_mode(mode)

    def subgroup_numel_for(self, device: torch.device, *, step_in_backward: bool, streams_weights: bool = False) -> int:
        """The sub-group size of an optimizer over parameters on ``device``: ``subgroup_numel``
        when given; else 32 Mi elements when the state is all in host RAM, the parameters on
        the CPU, and the update runs after backward on resident weights; 4 Mi otherwise (see
        ``subgroup_numel``; the measurements are in tierstate.placement.defaults)."""
        if self.subgroup_numel is not None:
            return self.subgroup_numel
        host_only = self.gpu == 0 and self.nvme == 0 and device.type == "cpu"
        if host_only and not step_in_backward and not streams_weights:
            return HOST_SUBGROUP_NUMEL
        return DEFAULT_SUBGROUP_NUMEL

    def buffer_count_for(self, block_records: int = 0, bytes_per_element: Mapping[str, float] | None = None) -> int:
        """The NVMe pool's size: ``buffer_count`` when given; else the larger of 16 plus
        twice ``block_records`` (the most NVMe records one block's gradients complete when
        the update runs during backward over weights streamed per block; 0 otherwise) and
        the buffers that fit in the RAM of 16 records of the same keys at fp32 (16 for fp32
        state, 63 for q8 moments under a bf16_sr master on bf16 parameters:
        :func:`tierstate.placement.defaults.default_buffer_count`, from
        ``bytes_per_element``, the record's key -> stored bytes; not counted when not given).

        Why: with ``step_in_backward`` a block's gradients complete its records within its
        backward, and read-ahead keeps up only if a block's records fit in the pool beside
        the ones being updated and written (see [Note: a plan in a fixed order] in
        tierstate.tiers.nvme). A Llama-2-7B layer spans 48 records of 4 Mi elements
        (``benchmarks/capacity.py --size 7b``, 2-vCPU Xeon VM): with 16 buffers the optimizer
        waited 17-23 s a step for its records and a step took 62-65 s; with this default (112
        buffers, a block's 48 records read ahead) it waited 9.5-11 s and a step took 47-49 s,
        for a peak RSS of 9.34 GiB against 8.04."""
        if self.buffer_count is not None:
            return self.buffer_count
        return default_buffer_count(bytes_per_element or {}, block_records)

    def host_allocator_for(self, device: torch.device) -> str:
        """The host-allocator policy for parameters on ``device`` (see ``host_allocator``)."""
        if self.host_allocator is not None:
            return self.host_allocator
        env = os.environ.get("TIERSTATE_HOST_ALLOCATOR")
        if env:
            if env not in HOST_ALLOCATOR_POLICIES:
                raise ValueError(f"TIERSTATE_HOST_ALLOCATOR={env!r}: must be one of {HOST_ALLOCATOR_POLICIES} "
                                 "(or unset for the default)")
            return env
        if device.type != "cpu":
            return "system"
        return "retain" if self.nvme == 0 else "retain_small"
