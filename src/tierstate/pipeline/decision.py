"""The norm and non-finite decision: one read of the gradients gives both.

Clipping and the non-finite skip need the global gradient norm before any state moves, so
a step first sums the squares of every gradient (host part with the native kernel, the
device part queued first so it overlaps), across ranks where FSDP2 shards the parameters,
and only then decides: run (with the clip coefficient folded into the gradient scale), skip,
or raise.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .. import kernels
from ..dist import shard_key


def found_inf_by_unscale(record: dict) -> bool | None:
    """Whether ``scaler.unscale_(opt)`` found an inf in ``param.grad`` (it unscaled them in place),
    from the scaler's per-optimizer ``record``; None when unscale_ has not run this step."""
    from torch.amp.grad_scaler import OptState

    if record["stage"] is not OptState.UNSCALED:
        return None
    return any(bool(v.item()) for v in record["found_inf_per_device"].values())


@dataclass
class Scaling:
    """What a loss scaler says about this step's gradients (built by the torch face from
    ``GradScaler``'s contract; see :mod:`tierstate.optim.amp`).

    ``inv_scale``: the inverse loss scale to apply to the host gradients; ``prior_inf``: an inf
    was already found in them; ``record``: the scaler's per-optimizer record (its
    ``found_inf_per_device`` is set here); ``scaled``: a loss scaler manages the step (then an
    inf skips silently: the scaler backs off).
    """

    inv_scale: float = 1.0
    prior_inf: bool = False
    record: dict | None = None
    scaled: bool = False

    def for_device_grads(self) -> tuple[float, bool]:
        """(inverse scale, inf already found) for the gradients left in ``param.grad``.

        ``scaler.unscale_(opt)`` unscales in place what it finds in ``param.grad``: with the
        device tier that includes the device part's gradients even when the host part's were
        streamed away (and so are still scaled)."""
        found = None if self.record is None else found_inf_by_unscale(self.record)
        return (self.inv_scale, False) if found is None else (1.0, found)

    def report(self, finite: bool) -> None:
        """Tell the scaler whether this step's gradients were finite (its ``update()`` reads it)."""
        if self.record is not None:
            self.record["found_inf_per_device"] = {torch.device("cpu"): torch.tensor([0.0 if finite else 1.0])}


class Verdict(enum.Enum):
    RUN = "run"
    SKIP = "skip"  # non-finite: every state untouched
    NOTHING = "nothing"  # no parameter has a gradient


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    sumsq: float = 0.0
    grad_scale: float = 1.0  # applied to the host gradients: inverse loss scale x clip coefficient
    device_grad_scale: float = 1.0  # the same for the gradients left on the device

    @property
    def norm(self) -> float:
        return math.sqrt(self.sumsq)


def device_sumsq(device_grads: dict[int, Tensor], heads: dict[int, int], scale: float) -> "Tensor | float":
    """The device part's sum of squares of ``grad * scale``, in float64, as a tensor on the device.

    Queued, not waited for (on CUDA): the caller reads it after the host part's sum. inf/nan propagate.
    """
    parts = [g[: heads[t]] for t, g in device_grads.items()]
    if not parts:
        return 0.0
    norms = torch.stack(torch._foreach_norm(parts, 2, dtype=torch.float64))
    return norms.square().sum() * (scale * scale)


def sumsq_over_shards(active: list, shard_groups: list, inv_scale: float, prior_inf: bool,
                      device: torch.device) -> tuple[float, bool]:
    """(squared gradient norm over every rank's shards, whether any rank saw an inf).

    Under FSDP2 each rank holds the gradient of its shards only: the global norm (for
    clipping) sums the squares over the ranks that hold the other shards, and a non-finite
    gradient on one rank must skip the step on all of them, or their replicas diverge.
    Every rank takes part, with gradients or not, or the others wait forever.
    """
    keys = [key for key, _ in shard_groups]
    parts = [0.0] * len(shard_groups)
    for s, g in active:
        parts[keys.index(shard_key(s.param))] += kernels.grad_sumsq(g, inv_scale)
    total, any_inf = 0.0, prior_inf
    for (_, groups), part in zip(shard_groups, parts):
        # float64: the squares of ~1e9 gradient elements keep their low digits
        buf = torch.tensor([part, 1.0 if prior_inf else 0.0], dtype=torch.float64, device=device)
        for group in groups:
            torch.distributed.all_reduce(buf, group=group)
        total += float(buf[0])
        any_inf = any_inf or float(buf[1]) > 0
    return total, any_inf


def decide(active: list, host_grads: dict, device_grads: dict, heads: dict[int, int], scaling: Scaling,
           shard_groups: list, max_grad_norm: float | None, device: torch.device, telemetry,
           hook_sumsq=None) -> Decision:
    """Sum the squares of every gradient once and decide the step (see the module's docstring).

    ``hook_sumsq(slot, scale)``: the sum of squares taken in backward when still valid, else None
    (:class:`tierstate.pipeline.grads.HookNorms`); the gradients it answers are not read again."""
    inv_scale, prior_inf = scaling.inv_scale, scaling.prior_inf
    device_scale, device_prior_inf = scaling.for_device_grads() if device_grads else (1.0, False)
    if shard_groups:  # (no device tier with sharded parameters: refused at construction)
        with telemetry.phase("grad_norm"):
            sumsq, prior_inf = sumsq_over_shards(active, shard_groups, inv_scale, prior_inf, device)
    elif active:
        # per parameter, in host_grads' order whichever way it is known: the same additions as
        # when every gradient is read here, so the same sum bit for bit
        parts = {t: hook_sumsq(s, inv_scale) if hook_sumsq is not None and host_grads[t][1] == 0 else None
                 for s, _ in active if (t := s.trainable) in host_grads}
        sumsq = 0.0
        if device_grads or any(v is None for v in parts.values()):
            with telemetry.phase("grad_norm"):
                queued = device_sumsq(device_grads, heads, device_scale)  # queued first: overlaps the host part
                for t, v in parts.items():
                    if v is None:
                        g, first = host_grads[t]
                        parts[t] = kernels.grad_sumsq(g[first:], inv_scale)
                sumsq = sum(parts[t] for t in host_grads)
                if device_grads:
                    sumsq += float(queued)
        else:
            sumsq = sum(parts[t] for t in host_grads)
        prior_inf = prior_inf or device_prior_inf
    if not active:
        return Decision(Verdict.NOTHING)
    finite = math.isfinite(sumsq) and not prior_inf
    scaling.report(finite)
    if not finite:
        return Decision(Verdict.SKIP, sumsq)
    clip = 1.0
    if max_grad_norm is not None:
        # torch.nn.utils.clip_grad_norm_: coefficient max_norm / (norm + 1e-6), clamped to 1
        clip = min(1.0, max_grad_norm / (math.sqrt(sumsq) + 1e-6))
    return Decision(Verdict.RUN, sumsq, inv_scale * clip, device_scale * clip)
