"""The vocabulary of a step: phase names, and which phases move bytes over which link.

A *phase* is a named stretch of time on one *lane* (a thread, an I/O stream, a CUDA
stream). Phases on the lane that runs ``opt.step()`` are the step's critical path; phases
on other lanes overlap it. Names are plain strings so that the core can write
``tel.phase("cpu_update")``; :data:`PHASES` is the closed list of them, with what each
covers, and :func:`register_phase` extends it for a new stage of the pipeline.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

_PHASES: dict[str, str] = {
    "grad_transfer": "device->host copies of gradients (the copy itself, usually on a "
    "side stream or I/O thread).",
    "grad_wait": "the step waiting for outstanding gradient copies to land in host memory.",
    "grad_norm": "one read of every gradient for its sum of squares: the global gradient "
    "norm (for clipping and last_grad_norm) and the non-finite check that may skip the step. "
    "Runs on every step that is not updated during backward, clipping asked for or not.",
    "cpu_update": "the native optimizer kernels updating host-resident state.",
    "nvme_read": "reading optimizer state from NVMe files into host buffers (read-ahead).",
    "nvme_write": "writing updated optimizer state from host buffers back to NVMe "
    "(write-behind).",
    "nvme_wait": "the step blocked on NVMe I/O: a read not yet landed, or no free buffer "
    "because writes are behind.",
    "weight_upload": "host->device copies of the updated (rounded) weights.",
    "device_update": "the optimizer update of the state kept on the accelerator.",
    "device_stall": "the step waiting on the accelerator (stream or event synchronise).",
    "weight_fetch": "reading a streamed block's weights from its NVMe home (tierstate.weights), "
    "from the read's start to its completion being seen; lane 'weights'.",
    "weight_wait": "forward, backward or the update waiting on a streamed block's weights: a read "
    "not landed yet, or a write-back that must finish first; lane 'weights'.",
    "backward_wait": "step() waiting for the updates that step_in_backward=True runs during "
    "backward to finish.",
    "backward_rollback": "step_in_backward=True: putting back speculative updates made during backward "
    "(clipping active, a loss-scale change or overflow, gradient accumulation) before the plain step.",
    "other": "step time on the critical path not covered by any phase above: Python "
    "bookkeeping, hooks, scheduling. Computed, never recorded.",
}

PHASES: Mapping[str, str] = MappingProxyType(_PHASES)
"""Phase name -> what it covers. Read-only; extend with :func:`register_phase`."""

RENAMED_PHASES: Mapping[str, str] = MappingProxyType({"clip": "grad_norm"})
"""Old phase name -> current one, for reading traces written before a rename."""

OTHER = "other"


def register_phase(name: str, description: str) -> None:
    """Add a phase name so that :meth:`Telemetry.phase` accepts it.

    Re-registering a name with the same description is a no-op; a different
    description raises, so two stages cannot silently share one name.
    """
    if not isinstance(name, str) or not name or "/" in name:
        raise ValueError(
            f"phase name must be a non-empty string without '/', got {name!r}; "
            "use a short snake_case word such as 'grad_transfer'")
    if not isinstance(description, str) or not description:
        raise ValueError(f"description of phase {name!r} must be a non-empty string, "
                         f"got {description!r}")
    existing = _PHASES.get(name)
    if existing is not None and existing != description:
        raise ValueError(f"phase {name!r} is already registered as {existing!r}; "
                         "pick another name")
    _PHASES[name] = description


TIERS = ("device", "host", "nvme")
DIRECTIONS = ("h2d", "d2h", "read", "write")
# PCIe transfers are booked under the device tier only, so a byte crossing the link is
# counted once, whichever side measured it.
PCIE_DIRECTIONS = ("h2d", "d2h")


@dataclass(frozen=True)
class Channel:
    """A path bytes flow through, the phase that moves them, and the probe's peak for it.

    ``bytes_keys`` are the ``"tier/direction"`` totals that make up its traffic;
    ``phase`` is the phase whose busy time (the union over lanes) is its transfer time.
    """

    name: str
    bytes_keys: tuple[str, ...]
    phase: str
    peak_key: str


# Achieved bandwidth is bytes / (wall time during which at least one lane was in the
# channel's phase). The union, not the sum, so that four I/O streams reading at once
# are compared with the disk's aggregate peak, not with a quarter of it.
CHANNELS: tuple[Channel, ...] = (
    Channel("device/d2h", ("device/d2h",), "grad_transfer", "d2h_gbps"),
    Channel("device/h2d", ("device/h2d",), "weight_upload", "h2d_gbps"),
    Channel("host/rw", ("host/read", "host/write"), "cpu_update", "host_mem_gbps"),
    Channel("nvme/read", ("nvme/read",), "nvme_read", "nvme_read_gbps"),
    Channel("nvme/write", ("nvme/write",), "nvme_write", "nvme_write_gbps"),
)

PEAK_KEYS = tuple(c.peak_key for c in CHANNELS)
CHANNEL_PHASES = frozenset(c.phase for c in CHANNELS)
