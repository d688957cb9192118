"""One optimizer step as a stream of sub-groups through their tiers.

    each tier plans its part (schedule)  ->  repeat: acquire a sub-group (the NVMe tier's
    read-ahead has usually landed it) -> update its segments -> release it (it becomes
    evictable; the NVMe tier writes it back when it reuses the buffer)

The pipeline knows tiers and segments, not optimizers: the caller passes a function that
updates one segment given the sub-group's flat state views.

[Note: interleaving tiers]
With ``Offload(cpu=0.5, nvme=0.5)`` the host sub-groups need no I/O while the NVMe ones
wait on the disk. Rather than walking the flat index space in order (and blocking on
the disk in the middle), the loop takes the next NVMe sub-group whenever its read has
landed and fills the waits with host sub-groups. Every update is elementwise on its own
segment, so the order changes nothing in the result, only where the waits go.

The step ends without waiting for write-behind: what is still in flight (or still dirty
in the NVMe pool) overlaps whatever runs before the next step, and every later reader
of the state goes through the tier, which orders it after those writes.

[Note: I/O failures in the loop]
A failed NVMe write never interrupts the loop: the tier keeps that record in RAM and the
optimizer raises the write's error once the step is complete. A failed read (EIO, a
checksum mismatch, a truncated file) surfaces from ``acquire`` as
:class:`~tierstate.io.StateLostError` and ends the loop there: the sub-groups updated
before it stay updated (they were released), the rest are untouched, and the state is
to be reloaded from a checkpoint (tierstate.tiers.nvme, [Note: what a failed I/O leaves]).
"""
from __future__ import annotations

from collections import deque
from contextlib import nullcontext
from typing import Callable, Mapping, Sequence

from torch import Tensor

from ..placement import Segment, SubGroup, TierKind

SegmentUpdate = Callable[[Segment, Mapping[str, Tensor]], None]

# Which tier's sub-group to take first when several are ready: NVMe, so that its buffers
# are released (and its I/O keeps moving) as early as possible.
_PRIORITY = (TierKind.NVME, TierKind.HOST, TierKind.DEVICE)


def _wait_span(telemetry, kind: TierKind):
    """Time blocked on a tier: only the NVMe tier can make the step wait."""
    return telemetry.phase("nvme_wait") if kind is TierKind.NVME else nullcontext()


def run_subgroups(work: Sequence[tuple[SubGroup, list[Segment]]], tiers: Mapping[TierKind, object],
                  update: SegmentUpdate, telemetry) -> None:
    """Update every listed segment once, sub-group by sub-group.

    Each tier is told the sub-groups it holds and answers the order it wants them in (the
    NVMe tier reads ahead along it); the loop then takes, among the tiers' next
    sub-groups, one that is ready, preferring NVMe (see [Note: interleaving tiers]), and
    blocks (booked as ``nvme_wait``) only when none is.
    """
    segments = {sg.index: segs for sg, segs in work}
    pending: dict[TierKind, deque] = {}
    for kind, tier in tiers.items():
        mine = [sg for sg, _ in work if sg.tier is kind]
        if mine:
            pending[kind] = deque(tier.schedule(mine))
    order = [k for k in _PRIORITY if k in pending]
    while order:
        kind = next((k for k in order if tiers[k].ready(pending[k][0])), order[0])
        queue = pending[kind]
        sg = queue.popleft()
        if not queue:
            order.remove(kind)
        tier = tiers[kind]
        with _wait_span(telemetry, kind):
            views = tier.acquire(sg)
        try:
            with telemetry.phase("cpu_update"):
                for seg in segments[sg.index]:
                    update(seg, views)
        finally:  # a failed update may have written part of the state: keep it as the tier's truth
            tier.release(sg, dirty=True)
