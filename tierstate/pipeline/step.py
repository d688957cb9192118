"""One optimizer step as a stream of sub-groups through their tiers.

    for each sub-group with work:   acquire (read-ahead done by the tier) -> update its
                                    segments -> release (write-behind done by the tier)

The pipeline knows tiers and segments, not optimizers: the caller passes a function that
updates one segment given the sub-group's flat state views.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, Mapping, Sequence

from torch import Tensor

from ..placement import Segment, SubGroup, TierKind

SegmentUpdate = Callable[[Segment, Mapping[str, Tensor]], None]


def _wait_span(telemetry, kind: TierKind):
    """Time blocked on a tier: only the NVMe tier can make the step wait."""
    return telemetry.phase("nvme_wait") if kind is TierKind.NVME else nullcontext()


def run_subgroups(work: Sequence[tuple[SubGroup, list[Segment]]], tiers: Mapping[TierKind, object],
                  update: SegmentUpdate, telemetry) -> None:
    """Update every listed segment, sub-group by sub-group, in the order given.

    Each tier is first told its part of the order (so the NVMe tier can read ahead), then
    the sub-groups are acquired, updated and released one after the other; finally every
    tier drains its write-behind, so the step ends with all state durable in its tier.
    """
    for kind, tier in tiers.items():
        tier.schedule([sg for sg, _ in work if sg.tier is kind])
    for sg, segments in work:
        tier = tiers[sg.tier]
        with _wait_span(telemetry, sg.tier):
            views = tier.acquire(sg)
        with telemetry.phase("cpu_update"):
            for seg in segments:
                update(seg, views)
        tier.release(sg, dirty=True)
    for kind, tier in tiers.items():
        with _wait_span(telemetry, kind):
            tier.drain()
