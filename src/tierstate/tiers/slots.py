"""One optimizer parameter as the state store sees it, and the lifecycles of its state.

[Note: the lifecycle of a parameter's state]
torch creates a parameter's state at its first step with a gradient; until then
``optimizer.state[p]`` has no entry. The tiers, though, hold every element from the
start, at the rule's init values. Whether those regions may be trusted to hold the
init values decides whether starting the state must write them, which on NVMe is a read
and a write of every record it touches::

    FRESH --first step--> AT_INIT --update--> LIVE
      ^                                        |
      +--(forgotten: AT_INIT)   LIVE --forgotten--> FORGOTTEN --first step--> AT_INIT (rewritten)

``load_state_dict`` forgets every state; a loaded one is LIVE at once.

[Note: the master copy's lifecycle]
A low-precision or accelerator parameter keeps an fp32 master in the tiers, filled from
the parameter before its first update. A piece in an I/O tier is not written then: the
step streams that record anyway, and the update copies the piece in (a 13-record model
with a 4-buffer pool reads 21 and writes 17 records in its first step when each master
piece goes through the pool first, 9 and 8 otherwise). Such pieces are PENDING until
then, and anything that reads the state first has them written
(:meth:`tierstate.tiers.StateStore.write_pending_masters`).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..dist import is_own_local, local_tensor


class StateLife(enum.Enum):
    """Whether a parameter's state exists (torch's sense) and what its regions in the tiers hold."""

    FRESH = "fresh"  # no state; the regions hold the init values
    FORGOTTEN = "forgotten"  # no state; the regions may hold a forgotten state's values
    AT_INIT = "at_init"  # state exists, at its init values (not updated yet)
    LIVE = "live"  # state exists and may differ from the init values

    @property
    def exists(self) -> bool:
        return self in (StateLife.AT_INIT, StateLife.LIVE)

    @property
    def regions_dirty(self) -> bool:
        """The regions may differ from the init values: starting the state must write them."""
        return self in (StateLife.FORGOTTEN, StateLife.LIVE)

    def forgotten(self) -> "StateLife":
        return StateLife.FORGOTTEN if self.regions_dirty else StateLife.FRESH


class MasterLife(enum.Enum):
    """The fp32 master copy of a parameter (see [Note: the master copy's lifecycle])."""

    ABSENT = "absent"  # not filled from the parameter yet
    PENDING = "pending"  # filled, except pieces in I/O tiers that their first update copies in
    READY = "ready"  # holds the parameter's value in every tier

    @property
    def filled(self) -> bool:
        """The master holds (or, for pending pieces, stands for) the parameter's value."""
        return self is not MasterLife.ABSENT


@dataclass(eq=False)  # compared by identity, never by their tensors' values
class Slot:
    """One parameter of the optimizer, whatever its tiers."""

    index: int  # position in the flattened param_groups, as in torch's state_dict
    param: Tensor
    group: int  # index into param_groups
    trainable: int | None  # index into the layout (None: frozen at construction, no state)
    # a master copy (``master``) exists in the tiers; False for a host parameter that is its own
    # master (fp32 under an fp32 master, bf16 under a bf16 one: tierstate.placement.defaults.is_own_master)
    needs_master: bool
    life: StateLife = StateLife.FRESH
    master: MasterLife = MasterLife.ABSENT
    # (sub-group, param offset) of the master pieces still PENDING
    pending_pieces: set = field(default_factory=set)
    step: int = 0
    # torch's dtype of ``step``, fixed when the state starts or is loaded (store.scalar_dtype);
    # None while the parameter has no state
    step_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        # a plain real tensor is its own local tensor: ``local`` is read several times per
        # parameter and step, and local_tensor's checks cost ~0.3 us each (a parameter's class
        # is fixed, and a change of dtype, to complex or not, is refused by the step)
        self._plain = is_own_local(self.param)

    @property
    def local(self) -> Tensor:
        """What the state mirrors: the parameter, or this rank's shard of it (FSDP2)."""
        return self.param if self._plain else local_tensor(self.param)

    @property
    def has_state(self) -> bool:
        return self.life.exists
