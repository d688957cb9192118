"""``model.state_dict()`` and ``model.load_state_dict()`` through a streamer's homes.

[Note: a streamed model's own state dict]
Between uses a streamed parameter has no storage (its block's storage is resized to 0), so
torch's ``Module.state_dict()`` would hand out empty-storage views as weights: reading one
dereferenced a null pointer (the process died with SIGSEGV; now it raises, see [Note:
touching a streamed parameter directly]), and ``load_state_dict`` would copy into it.
torch, Trainer's model save, ``save_pretrained``, Accelerate and Lightning all go through
those two methods, so the streamer hooks them on every module that owns a streamed
parameter:

- state dict (post-hook): each streamed entry becomes a copy read from the block's home
  (``read_param``; one read of a block serves all its parameters while the block stays in
  the window's pool). The copy is the weight at that moment: unlike a resident model's
  entries it does not change with later steps. ``state_dict(keep_vars=True)`` still gives
  the Parameter objects, as torch does (their values: ``read_param``).
- a model whose streamed weights do not fit in the available RAM does not fit in its own
  state dict: there the model's ``state_dict()`` keeps the parameters as its streamed
  entries (reading one raises, naming ``read_param``) and warns once per call,
  naming :func:`tierstate.save_weights`. Reading them all would end in the OOM killer, and
  code that takes only a few entries (PEFT saves its adapters from the whole state dict)
  keeps working for a base model larger than RAM. The check is made once, on the model the
  streamer was built on; a submodule's state dict is always copied (a pre-hook on each
  part resets the decision when the part is called on its own: a model call that raised
  midway had left it set, and the part's next state dict held placeholders).
- load (pre-hook): an entry of the right shape is written to the home (``write_param``:
  cast, the optimizer's master refreshed at its next step as after any write of a weight)
  and taken out of the dict torch loads from; the post-hook then takes its key out of
  ``missing_keys``. An entry of another shape or type is left to torch, which reports it in
  its own words and copies nothing.

``copy.deepcopy`` of the model (or of a block) is refused with a TypeError that says what to
do: a copy's parameters would be empty too, and torch's ``Parameter.__deepcopy__`` clones
them, which read the missing memory and ended the process (an EMA's ``deepcopy(model)``).
The refusal is a state-dict pre-hook whose ``__deepcopy__`` raises: ``deepcopy`` copies a
module's hooks before its submodules, so it fires before any streamed parameter is cloned.

Under FSDP2 the parameters are DTensors of this rank's shards: the state dict's entry is a
DTensor over a copy of the shard, with the parameter's mesh and placements, and loading takes
a DTensor sharded as the parameter is (what ``torch.distributed.checkpoint`` hands back) and
writes its local shard; another layout is left to torch and FSDP2.
"""
from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import psutil
from torch import Tensor, nn

from ..dist import local_tensor

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch build without torch.distributed
    DTensor = ()

if TYPE_CHECKING:
    from .streamer import WeightStreamer

RAM_LEFT_FREE = 1 << 30  # what a model's state dict of copies must leave of the available RAM


def available_ram() -> int:
    """Bytes of RAM the kernel can give without swapping (psutil's ``available``)."""
    return psutil.virtual_memory().available


class _RefuseDeepcopy:
    """A no-op state-dict pre-hook whose deep copy raises (see the note)."""

    def __call__(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        return None

    def __deepcopy__(self, memo):
        raise TypeError(
            "copy.deepcopy of a model whose weights stream (tierstate.offload_weights): its streamed parameters "
            "hold no memory between uses, and neither would a copy's. For a copy of the weights (an EMA), build "
            "the model again and load model.state_dict() into it (or stream it with its own offload_weights); "
            "to read a weight, use ws.read_param(param)")


class ModuleStateHooks:
    """The state-dict hooks of one streamer's modules; :meth:`remove` takes them off."""

    def __init__(self, streamer: "WeightStreamer", model: nn.Module) -> None:
        self.streamer = streamer
        self._handles = []
        self._copying = True  # False within a model state_dict() call whose copies would not fit in RAM
        # by identity (a set of tensors would compare them with ==); the blocks keep them alive
        self._ids = {id(pl.param) for b in streamer.blocks for pl in b.places}
        self._handles.append(model.register_state_dict_pre_hook(lambda *args: self._decide(*args)))
        for module in {id(m): m for m in [model, *(b.module for b in streamer.blocks)]}.values():
            self._handles.append(module.register_state_dict_pre_hook(_RefuseDeepcopy()))
        for module in model.modules():
            if module is not model:
                self._handles.append(module.register_state_dict_pre_hook(self._part_call))
            names = tuple(n for n, p in module._parameters.items() if p is not None and id(p) in self._ids)
            if names:
                written: list[str] = []  # keys this module's pre-hook loaded, for its post-hook
                asked = {"keep_vars": False}  # what this module's state_dict() was last asked for
                self._handles += [
                    module.register_state_dict_pre_hook(self._note_keep_vars(asked)),
                    module.register_state_dict_post_hook(self._read(names, asked)),
                    module.register_load_state_dict_pre_hook(self._write(names, written)),
                    module.register_load_state_dict_post_hook(self._not_missing(written)),
                ]
        # after the model's own entries were read, if it owns a streamed parameter itself
        # (a function of its own: torch marks a post-hook with an attribute, which a bound method refuses)
        self._handles.append(model.register_state_dict_post_hook(lambda *args: self._done()))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    @staticmethod
    def _note_keep_vars(asked: dict):
        def hook(module: nn.Module, prefix: str, keep_vars: bool) -> None:
            asked["keep_vars"] = keep_vars
        return hook

    def _part_call(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if not prefix:
            # a part's own state_dict() (inside the model's call torch gives every part its
            # prefix): copied, whatever a model call that raised midway left in the flag
            self._copying = True

    def _read(self, names: tuple[str, ...], asked: dict):
        def hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
            if asked["keep_vars"] or not self._copying:
                return  # the Parameter objects themselves, as torch gives them
            for name in names:
                key = prefix + name
                param = module._parameters[name]
                if key in state_dict and self._streams(param):
                    state_dict[key] = self._copy_of(param)
        return hook

    def _decide(self, model: nn.Module, prefix: str, keep_vars: bool) -> None:
        if keep_vars:
            return
        need = sum(self.streamer.block_bytes())
        free = available_ram()
        self._copying = need <= free - RAM_LEFT_FREE
        if not self._copying:
            warnings.warn(
                f"state_dict(): the streamed weights ({need / 2**30:.2f} GiB) do not fit in the available RAM "
                f"({free / 2**30:.2f} GiB): their entries are the parameters, which hold no memory between uses "
                "(reading one raises). Save the weights with tierstate.save_weights(model, path), a "
                "tensor at a time, or read one with ws.read_param(param)", RuntimeWarning, stacklevel=4)

    def _done(self) -> None:
        self._copying = True

    def _streams(self, param) -> bool:
        # FSDP2 swaps the gathered parameters in while a block runs: those are not the shards
        return id(param) in self._ids

    def _copy_of(self, param: Tensor) -> Tensor:
        values = self.streamer.read_param(param)
        if not isinstance(param, DTensor):
            return values
        return DTensor.from_local(values.to(local_tensor(param).device), param.device_mesh, param.placements,
                                  run_check=False, shape=param.shape, stride=param.stride())

    def _write(self, names: tuple[str, ...], written: list[str]):
        def hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata, strict, missing_keys,
                 unexpected_keys, error_msgs) -> None:
            for name in names:
                key = prefix + name
                value = state_dict.get(key)
                param = module._parameters[name]
                if not (isinstance(value, Tensor) and value.shape == param.shape and self._streams(param)):
                    continue
                if isinstance(param, DTensor):
                    if not (isinstance(value, DTensor) and value.placements == param.placements
                            and value.device_mesh == param.device_mesh):
                        continue  # not sharded as the parameter is: torch's and FSDP2's to handle
                    value = value.to_local()
                self.streamer.write_param(param, value)
                del state_dict[key]  # torch's copy of the dict: the caller's stays whole
                written.append(key)
        return hook

    @staticmethod
    def _not_missing(written: list[str]):
        def hook(module: nn.Module, incompatible_keys) -> None:
            for key in written:
                if key in incompatible_keys.missing_keys:
                    incompatible_keys.missing_keys.remove(key)
            written.clear()
        return hook
