"""DTensor helpers: this rank's shard, and the process groups sharding a parameter."""
from __future__ import annotations

import torch
from torch import Tensor

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch build without torch.distributed: no parameter can be a DTensor
    DTensor = ()


def is_dtensor(t) -> bool:
    return isinstance(t, DTensor)


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def is_own_local(t: Tensor) -> bool:
    """Whether :func:`local_tensor` gives ``t`` itself: a real tensor of no subclass."""
    return type(t) in _PLAIN and not t.is_complex()


def local_tensor(t: Tensor) -> Tensor:
    """The plain real tensor the engine reads and writes for ``t``: ``t`` itself, this rank's
    shard when ``t`` is a DTensor (parameters and gradients under FSDP2's ``fully_shard``), or,
    for a complex tensor, its real view (``torch.view_as_real``: real and imaginary parts as a
    last dimension of 2), which torch's Adam, AdamW and Adagrad update element by element, as
    its SGD's complex arithmetic does. Each shares the tensor's storage, so writing into it
    updates the parameter."""
    if type(t) not in _PLAIN and isinstance(t, DTensor):  # (the type test first: most calls, cheaper)
        t = t._local_tensor
    return torch.view_as_real(t.detach()) if t.is_complex() else t


def shard_key(p: Tensor) -> tuple:
    """(mesh, mesh dims that shard ``p``): ranks along those dims hold the other parts of ``p``;
    ``()`` for a parameter every rank holds whole."""
    if not isinstance(p, DTensor):
        return ()
    dims = tuple(d for d, placement in enumerate(p.placements) if placement.is_shard())
    return (p.device_mesh, dims) if dims else ()


def shard_groups(params: list[Tensor]) -> list[tuple[tuple, list]]:
    """One ``(shard key, process groups)`` per way the trainable parameters are sharded, in
    parameter order (the same on every rank, so the collectives match); empty when none is."""
    out: dict[tuple, list] = {}
    for p in params:
        key = shard_key(p)
        if key and key not in out:
            mesh, dims = key
            out[key] = [mesh.get_group(d) for d in dims]
    if out and any(not shard_key(p) for p in params):
        out.setdefault((), [])  # parameters replicated on every rank: their squares count once
    return list(out.items())


def _state_tensor_keys(st: dict) -> list:
    # step is a plain 0-d tensor in torch's AdamW under FSDP2 as well; every other tensor of the
    # parameter's state has the parameter's shape
    return [k for k, v in st.items() if k != "step" and isinstance(v, Tensor) and not isinstance(v, DTensor)]


def present_state(state_dict: dict, param_groups: list[dict]) -> dict:
    """``state_dict`` (torch's schema) with the state of DTensor parameters as DTensors.

    torch's optimizers over FSDP2 parameters keep DTensor state (``zeros_like`` of a DTensor),
    and ``torch.distributed.checkpoint`` relies on it: a DTensor is saved as this rank's shard
    of a global tensor and resharded on load, while a plain tensor is taken as the same whole
    value on every rank (one rank's shard would be saved, and a load on another world size
    finds the wrong shape). The state tensors tierstate exports are this rank's shard, so
    each is wrapped (no copy) with the parameter's mesh, placements, global shape and stride.
    """
    params = {i: p for g_saved, g in zip(state_dict["param_groups"], param_groups)
              for i, p in zip(g_saved["params"], g["params"])}
    for index, st in state_dict["state"].items():
        p = params.get(index)
        if not isinstance(p, DTensor):
            continue
        for key in _state_tensor_keys(st):
            if st[key].numel() != p._local_tensor.numel():
                raise ValueError(
                    f"state_dict(): state {key!r} of parameter {index} has {st[key].numel()} elements, not its "
                    f"shard's {p._local_tensor.numel()}: compressed state (Offload(moment_dtype='q8'), per-block "
                    "scales) cannot be presented as DTensor state for torch.distributed.checkpoint; use "
                    "moment_dtype=torch.bfloat16 or float32 under FSDP2, or save each rank with ts.save_optimizer")
            st[key] = DTensor.from_local(st[key].reshape(p._local_tensor.shape), p.device_mesh, p.placements,
                                         run_check=False, shape=p.shape, stride=p.stride())
    return state_dict


def local_state(state_dict: dict, param_groups: list[dict]) -> dict:
    """A state dict to load, with the state of DTensor parameters as this rank's shards.

    Accepts DTensor state of any placement over the parameter's mesh (redistributed to the
    parameter's: ``set_optimizer_state_dict`` after ``dcp.load`` gives the same placements,
    a full state dict gives ``Replicate``) and plain tensors of the parameter's global shape
    (a state dict of an unsharded run), from which this rank's shard is cut without
    communication. Plain tensors of the shard's shape are taken as the shard. The dict
    given is not changed.
    """
    from torch.distributed.tensor import Replicate  # noqa: PLC0415 - only reached with DTensor parameters

    params = {i: p for g_saved, g in zip(state_dict.get("param_groups", ()), param_groups)
              if isinstance(g_saved, dict) and isinstance(g_saved.get("params"), (list, tuple))
              for i, p in zip(g_saved["params"], g["params"])}
    state = state_dict.get("state")
    if not isinstance(state, dict) or not any(isinstance(p, DTensor) for p in params.values()):
        return state_dict
    out = dict(state)
    for index, st in state.items():
        p = params.get(index)
        if not isinstance(p, DTensor) or not isinstance(st, dict):
            continue
        st = dict(st)
        for key, v in st.items():
            if key == "step" or not isinstance(v, Tensor):
                continue
            if isinstance(v, DTensor):
                if v.device_mesh != p.device_mesh:
                    raise ValueError(f"load_state_dict: state {key!r} of parameter {index} is a DTensor on mesh "
                                     f"{v.device_mesh}, the parameter's mesh is {p.device_mesh}; load state "
                                     "saved over the same mesh, or a full state dict (plain tensors)")
                if tuple(v.placements) != tuple(p.placements):
                    v = v.redistribute(p.device_mesh, p.placements)
                st[key] = v.to_local()
            elif tuple(v.shape) == tuple(p.shape) and tuple(v.shape) != tuple(p._local_tensor.shape):
                whole = DTensor.from_local(v.to(p._local_tensor.device), p.device_mesh,
                                           [Replicate()] * p.device_mesh.ndim, run_check=False)
                st[key] = whole.redistribute(p.device_mesh, p.placements).to_local()
        out[index] = st
    return {**state_dict, "state": out}
