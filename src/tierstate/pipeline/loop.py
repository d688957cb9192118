"""The sub-group loop: acquire -> submit to an executor -> release when its completion is done.

    each tier plans its part (schedule)  ->  repeat: take a ready sub-group, acquire its views
    (the NVMe tier's read-ahead has usually landed it), hand them to the executor for its
    tier, and release every sub-group whose completion is done (it becomes evictable; an
    I/O tier writes it back when it reuses the buffer)

The loop knows tiers, sub-groups and executors, not optimizers.

[Note: interleaving tiers]
With ``Offload(cpu=0.5, nvme=0.5)`` the host sub-groups need no I/O while the NVMe ones
wait on the disk. Rather than walking the flat index space in order (and blocking on
the disk in the middle), the loop takes the next I/O sub-group whenever its read has
landed and fills the waits with in-memory sub-groups. Sub-groups on the compute device go
first: their executor only queues kernels, which then run beside the host's. Every update
is elementwise on its own segment, so the order changes nothing in the result, only where
the waits go.

The step ends without waiting for write-behind: what is still in flight (or still dirty
in the NVMe pool) overlaps whatever runs before the next step, and every later reader
of the state goes through the tier, which orders it after those writes.

[Note: I/O failures in the loop]
A failed write never interrupts the loop: the tier keeps that record in RAM and the
optimizer raises the write's error once the step is complete. A failed read (EIO, a
checksum mismatch, a truncated file) surfaces from ``acquire`` as
:class:`~tierstate.io.StateLostError` and ends the loop there: the sub-groups updated
before it stay updated (they are released once their completions are done), the rest are
untouched, and the state is to be reloaded from a checkpoint (tierstate.tiers.nvme_ledger,
[Note: what a failed I/O leaves]).
"""
from __future__ import annotations

from collections import deque
from contextlib import nullcontext
from typing import Callable, Mapping, Sequence

from ..placement import Segment, SubGroup
from .executors import Executor


def _priority(tier) -> tuple[bool, bool]:
    """Device sub-groups first (their executor only queues), then I/O ones (see [Note: interleaving tiers])."""
    return (not tier.on_device, not tier.does_io)


def _submit(tier, sg: SubGroup, segments: Sequence[Segment], executor: Executor, telemetry):
    """Acquire ``sg`` (a wait is booked under the tier's ``wait_phase``) and hand it to ``executor``;
    the completion it returns. A failed submit releases the sub-group before it raises."""
    with telemetry.phase(tier.wait_phase) if tier.wait_phase else nullcontext():
        views = tier.acquire(sg)
    try:
        return executor.submit(sg, segments, views)
    except BaseException:
        tier.release(sg, dirty=True)  # a failed update may have written part: the tier's truth
        raise


def update_planned(tier, sg: SubGroup, segments: Sequence[Segment], executor: Executor, telemetry) -> None:
    """Update one sub-group whose tier was told the plan already (the in-backward driver's order):
    acquire, submit, wait for the completion, release. Unlike :func:`run_subgroups` it does not
    call ``schedule``, which would replace the tier's read-ahead plan with this one sub-group."""
    completion = _submit(tier, sg, segments, executor, telemetry)
    try:
        completion.wait()
    finally:
        tier.release(sg, dirty=True)


def _submit_in_memory(tier, subgroups: list[SubGroup], segments: Mapping, executor) -> None:
    """Every sub-group of a tier that does no I/O, acquired (views, no copy) and handed to the
    executor's ``submit_many`` at once: its segments in one native call where they can be."""
    items = []
    try:
        for sg in subgroups:
            items.append((sg, segments[sg.index], tier.acquire(sg)))
        executor.submit_many(items).wait()
    finally:
        for sg, _, _ in items:
            tier.release(sg, dirty=True)


def run_subgroups(work: Sequence[tuple[SubGroup, list[Segment]]], tiers: Mapping, executor_for: Callable,
                  telemetry) -> None:
    """Update every listed segment once, sub-group by sub-group.

    ``tiers``: ``{sg.tier: tier}``; ``executor_for(tier) -> Executor``. Each tier is told the
    sub-groups it holds and answers the order it wants them in (an I/O tier reads ahead along
    it); the loop then takes, among the tiers' next sub-groups, one that is ready, by
    :func:`_priority`, and blocks (booked under the tier's ``wait_phase``) only when none is.
    Where one tier without I/O in host memory holds them all, they go to the executor's
    ``submit_many`` together (see :meth:`HostExecutor.submit_many`).
    """
    segments = {sg.index: segs for sg, segs in work}
    pending: dict = {}
    for kind, tier in tiers.items():
        mine = [sg for sg, _ in work if sg.tier is kind]
        if mine:
            pending[kind] = deque(tier.schedule(mine))
    if len(pending) == 1:  # one tier holds every sub-group: in host memory, one submit for all
        kind, queue = next(iter(pending.items()))
        tier = tiers[kind]
        executor = executor_for(tier)
        if not tier.does_io and not tier.on_device and hasattr(executor, "submit_many"):
            _submit_in_memory(tier, list(queue), segments, executor)
            return
    order = sorted(pending, key=lambda k: _priority(tiers[k]))
    held: deque = deque()  # (tier, sub-group, completion), in submission order
    try:
        while order:
            kind = next((k for k in order if tiers[k].ready(pending[k][0])), order[0])
            queue = pending[kind]
            sg = queue.popleft()
            if not queue:
                order.remove(kind)
            tier = tiers[kind]
            held.append((tier, sg, _submit(tier, sg, segments[sg.index], executor_for(tier), telemetry)))
            # release whatever is done, in any order: a device launch still running must not keep
            # an I/O tier's buffer from its pool (the next acquire may need it back)
            for item in [h for h in held if h[2].done()]:
                held.remove(item)
                item[0].release(item[1], dirty=True)
    finally:
        while held:
            done_tier, done_sg, completion = held.popleft()
            try:
                completion.wait()
            finally:
                done_tier.release(done_sg, dirty=True)


__all__ = ["Executor", "run_subgroups", "update_planned"]
