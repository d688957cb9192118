"""What the step pipeline and the state store may ask of a tier.

The pipeline never asks which kind a tier is; it asks what the kind implies. A new tier
(say, an object store) implements this protocol and is made by :func:`tierstate.tiers.make_tiers`;
nothing outside ``tiers/`` changes.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Protocol, Sequence, runtime_checkable

from torch import Tensor

from ..placement import SubGroup


@runtime_checkable
class Tier(Protocol):
    """A holder of optimizer state for the sub-groups the layout gives it.

    - ``schedule(subgroups, keep_order=False)``: the step will acquire these; the tier
      answers the order it wants them in and may start reading ahead along it
      (``keep_order``: the caller's order is the plan, e.g. the order backward meets them).
    - ``ready(sg)``: whether ``acquire(sg)`` would return without waiting for I/O.
    - ``acquire(sg) -> {key: 1-D tensor}``: flat views of every state key of ``sg``, valid
      until ``release``; ``release(sg, dirty)``: done (dirty state is written back by the
      tier, lazily or not).
    - ``read_range`` / ``write_range``: state outside a step (init, state_dict, loading);
      always the newest values; ``read_range`` never returns device memory.
    - ``drain()`` waits for I/O in flight; ``flush()`` also writes back every dirty buffer.
    - failure reporting (no-ops for memory tiers): ``settle()`` retries failed writes or
      raises before a step changes anything, ``take_write_errors()`` returns (and clears) the
      error of writes that failed during the step, ``lost_error()`` the error of a record
      whose state is lost, ``forget_state()`` drops every record (a load replaces them all).
    """

    does_io: bool  # acquire may wait on storage
    wait_phase: str | None  # telemetry phase a wait in acquire is booked under (None: never waits)
    on_device: bool  # the state lives on the compute device: updated there, gradients read in place
    host_views: bool  # flat_range(key, start, numel) gives views of host memory (optimizer.state holds them),
    # for the keys holds(key, start) says it keeps there

    @property
    def nbytes(self) -> int: ...

    @property
    def pinned_nbytes(self) -> int: ...

    @property
    def spill_folder(self) -> Path | None: ...

    def schedule(self, subgroups: Sequence[SubGroup], keep_order: bool = False) -> list[SubGroup]: ...

    def ready(self, sg: SubGroup) -> bool: ...

    def acquire(self, sg: SubGroup) -> Mapping[str, Tensor]: ...

    def release(self, sg: SubGroup, dirty: bool) -> None: ...

    def read_range(self, key: str, sg: SubGroup, offset: int, numel: int) -> Tensor: ...

    def write_range(self, key: str, sg: SubGroup, offset: int, values: Tensor) -> None: ...

    def drain(self) -> None: ...

    def flush(self) -> None: ...

    def settle(self) -> None: ...

    def take_write_errors(self) -> BaseException | None: ...

    def lost_error(self) -> BaseException | None: ...

    def forget_state(self) -> None: ...

    def close(self) -> None: ...
