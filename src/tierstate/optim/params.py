"""The checks on what an optimizer is given: the ``params`` argument and each parameter group.

torch accepts any iterable of tensors, of ``(name, tensor)`` pairs or of group dicts; so
does tierstate, with the checks torch leaves out where leaving them out would corrupt state
(a set's order changes between runs; a tensor twice would be stepped twice).
"""
from __future__ import annotations

import sys
import warnings
from typing import Iterable

import torch
from torch import Tensor

from ..dist import is_dtensor, local_tensor
from ..tiers.host import sole_owner

# complex: stepped as its real view (two floats per element), as torch's optimizers do
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.complex64, torch.float64, torch.complex128)
# float64 parameters keep float64 state, as torch's do: see [Note: float64 parameters] in
# tierstate.pipeline.assembly
FLOAT64_DTYPES = (torch.float64, torch.complex128)


def params_list(params: Iterable, owner: str) -> list:
    """``params`` as the list torch's constructor takes, read once."""
    if isinstance(params, set):
        raise TypeError(
            "params is a set: its ordering changes between runs, and a state_dict maps state to parameters "
            "by position; pass a list (e.g. list(model.parameters()))")
    if isinstance(params, Tensor):
        raise TypeError("params argument given to the optimizer should be an iterable of Tensors or dicts, but got "
                        f"a {torch.typename(params)}; pass [tensor]")
    try:
        params = list(params)  # once: a generator read twice (offload='auto', then torch) would be empty
    except TypeError:
        raise TypeError("params argument given to the optimizer should be an iterable of Tensors or dicts, but got "
                        f"{type(params).__name__}; pass model.parameters() or a list of tensors or of param group "
                        "dicts") from None
    if not params:
        raise ValueError(f"{owner} got no trainable parameter: the parameter list is empty (was a "
                         "generator such as model.parameters() used up before?); pass the parameters to train")
    return params


def checked_group(param_group: dict, param_groups: list[dict], defaults: dict, rule) -> dict:
    """Check a group about to be added (``param_groups`` are the groups already there) and return
    it with its ``params`` as a list; raise, naming the argument and the fix, before anything changes."""
    if not isinstance(param_group, dict):
        raise TypeError(f"param_group must be a dict, but got {type(param_group).__name__}: give a dict with a "
                        "'params' entry")
    where = f"param_groups[{len(param_groups)}]['params']"
    if "params" not in param_group:
        raise ValueError(f"param_groups[{len(param_groups)}] has no 'params' entry: give the tensors to "
                         "optimize as {'params': [...], ...}")
    params = param_group["params"]
    if isinstance(params, Tensor):
        params = [params]
    elif isinstance(params, set):
        raise TypeError(f"{where} is a set: its ordering changes between runs, and a state_dict maps state to "
                        "parameters by position; pass a list (e.g. list(module.parameters()))")
    else:
        try:
            params = list(params)
        except TypeError:
            raise TypeError(f"{where} is a {type(params).__name__}; give a tensor or an iterable of tensors "
                            "(module.parameters())") from None
    param_group["params"] = params  # the list, not the generator it came from (read once, here)
    tensors = [p[1] if isinstance(p, tuple) and len(p) == 2 else p for p in params]
    # where each tensor already is (tensors hash by identity): in the groups there, in this one
    elsewhere = {p: f"param_groups[{gi}]['params'][{i}]" for gi, g in enumerate(param_groups)
                 for i, p in enumerate(g["params"])}
    here: dict[Tensor, str] = {}
    kept: list[int] = []  # the first place of each tensor in this group
    for i, p in enumerate(tensors):
        if not isinstance(p, Tensor):
            raise TypeError(f"optimizer can only optimize Tensors, but one of the params is {torch.typename(p)}: "
                            f"params[{i}]; give torch Tensors (model.parameters())")
        if not p.is_leaf:
            raise ValueError(f"can't optimize a non-leaf Tensor: params[{i}] was computed from others; optimize "
                             "the leaf tensors (nn.Parameter) instead")
        if p.dtype not in SUPPORTED_DTYPES:
            if p.is_floating_point():
                fix = ("cast the model with model.float() (or .bfloat16()), or give these parameters to a "
                       "torch.optim optimizer")
            else:
                fix = "only floating-point parameters are trained; leave this tensor out of the optimizer"
            raise TypeError(f"params[{i}] has dtype {p.dtype}; supported: float32, bfloat16, float16, float64, "
                            f"complex64, complex128 ({fix})")
        if (p.is_complex() or p.dtype in FLOAT64_DTYPES) and (p.device.type != "cpu" or is_dtensor(p)):
            kind = "complex" if p.is_complex() else "float64"
            raise TypeError(f"params[{i}] is a {kind} {'DTensor' if is_dtensor(p) else 'parameter'} on {p.device}: "
                            f"tierstate steps {kind} parameters of one process on the CPU only; keep them there, "
                            "or give them to a torch.optim optimizer of their own")
        # torch refuses a tensor in two groups, in these words; a tensor twice in one group it only
        # warns about, and then updates once per occurrence with one state (two Adam steps a step).
        # A parameter has one slot of state here, so it is kept once (below): updated once a step.
        if p in elsewhere:
            raise ValueError(
                f"some parameters appear in more than one parameter group: {where}[{i}] is the same tensor as "
                f"{elsewhere[p]}; a parameter may appear once in an optimizer: remove the duplicate (e.g. tied "
                "weights: pass the shared tensor once)")
        if p in here:
            warnings.warn(
                "optimizer contains a parameter group with duplicate parameters; in future, this will cause an "
                f"error (torch's words): {where}[{i}] is the same tensor as {here[p]}; tierstate keeps it once "
                "and updates it once per step (torch's optimizers update it once per occurrence): remove the "
                "duplicate", UserWarning, stacklevel=_caller_level())
            continue
        here[p] = f"{where}[{i}]"
        kept.append(i)
    if len(kept) < len(tensors):
        params, tensors = [params[i] for i in kept], [tensors[i] for i in kept]
        param_group["params"] = params
    merged = dict(param_group)
    for key, value in defaults.items():
        merged.setdefault(key, value)
    rule.validate(merged)
    to_move = non_contiguous(tensors)
    devices = {p.device for g in param_groups for p in g["params"]} | {p.device for p in tensors}
    if len(devices) > 1:
        raise ValueError(f"params are on {len(devices)} devices ({', '.join(sorted(str(d) for d in devices))}); "
                         "one optimizer takes parameters of one device (use one optimizer per device)")
    for i, p in enumerate(tensors):
        if local_tensor(p).is_meta:
            raise ValueError(
                f"params[{i}] (shape {tuple(p.shape)}) is on the meta device: it has no values to optimize, and "
                "its state would be allocated for nothing; materialize the model first (module.to_empty("
                "device=...) and initialize it, or load its weights) and build the optimizer after")
    give_contiguous_memory(tensors, to_move)
    return param_group


def _layout(i: int, p: Tensor) -> str:
    return f"params[{i}] (shape {tuple(p.shape)}, strides {tuple(p.stride())})"


def _dense(t: Tensor) -> bool:
    """Whether ``t``'s elements fill a block of memory once each, in some order of its dims."""
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _overlaps(t: Tensor) -> bool:
    """Whether two of ``t``'s elements may share a memory location (an expanded tensor): taken
    in order of stride, each dim must step past all the elements the smaller ones reach."""
    reach = 0
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1):
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False


def _no_other_tensor(t: Tensor) -> bool:
    """Whether no tensor but ``t`` is on its storage (see :func:`tierstate.tiers.host.sole_owner`,
    which also asks that ``t`` span all of it)."""
    storage = t.untyped_storage()
    return sole_owner(t, storage.nbytes())


def non_contiguous(tensors: list[Tensor]) -> list[int]:
    """The indices of the parameters that are not contiguous but can be moved by
    :func:`give_contiguous_memory` (a transposed weight, a channels_last convolution, a slice
    with gaps between its elements such as ``x[..., 0]``); raise, naming
    the parameter and the fix, for one that cannot be moved without harm.

    [Note: parameters are updated through a flat view of their memory]
    The step reads and writes each parameter as one flat run of elements (its own master, or
    the weight written back from a separate master), as the native kernels and the NVMe
    records take them; the state is kept in the same flat order, which is the parameter's
    logical order only where its memory is contiguous."""
    moves = []
    for i, p in enumerate(tensors):
        # the memory the step updates, in the parameter's own elements: a DTensor's shard, or a
        # complex parameter itself (a real view of it would be one more tensor on its storage)
        local = p if p.is_complex() else local_tensor(p)
        if local.is_contiguous():
            continue
        what = _layout(i, local)
        if is_dtensor(p):
            raise ValueError(f"{what} is a DTensor whose local shard is not contiguous; tierstate updates a "
                             "parameter through a flat view of its memory: shard contiguous parameters (make the "
                             "module's parameters contiguous before fully_shard)")
        if _overlaps(local):
            raise ValueError(f"{what} is not contiguous and its elements overlap in memory (an expanded tensor): "
                             "an update in place would write one location for several elements; give it memory "
                             "of its own before building the optimizer: p.data = p.data.clone()")
        # dense (transposed, channels_last): it must span its storage alone; a slice with gaps
        # between its elements (x[..., 0]): no other tensor may be on its storage
        alone = (sole_owner(local, local.numel() * local.element_size()) if _dense(local)
                 else _no_other_tensor(local))
        if not alone:
            raise ValueError(
                f"{what} is not contiguous, and another tensor shares its memory (a view kept elsewhere, such as "
                "the tensor it was transposed or sliced from): tierstate updates a parameter through a flat view of "
                "its memory and would have to give this one memory of its own, which that tensor would not see; "
                "make it contiguous before building the optimizer (p.data = p.data.contiguous(), or "
                "model.to(memory_format=torch.contiguous_format)), or drop the other reference")
        moves.append(i)
    return moves


def give_contiguous_memory(tensors: list[Tensor], indices: list[int]) -> None:
    """Give each of ``tensors[indices]`` contiguous memory of its own, its values copied, and
    warn once naming them. As when a parameter moves onto huge pages (``tiers.host``), the
    Parameter object, its name, hooks and ``requires_grad`` stay; ``param.data`` is replaced
    (see [Note: parameters are updated through a flat view of their memory])."""
    if not indices:
        return
    named = ", ".join(_layout(i, tensors[i]) for i in indices)
    for i in indices:
        tensors[i].data = tensors[i].data.contiguous()
    warnings.warn(
        f"{len(indices)} parameter{'s were' if len(indices) > 1 else ' was'} not contiguous: {named}; "
        "tierstate updates a parameter through a flat view of its memory, so each now has contiguous memory of "
        "its own, row-major (same values, same Parameter)", UserWarning, stacklevel=_caller_level())


def _caller_level() -> int:
    """The ``stacklevel`` of the first frame outside tierstate and torch: the line that built the
    optimizer or called ``add_param_group``, however many frames of theirs lie between."""
    frame, level = sys._getframe(1), 1
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not (name == "tierstate" or name.startswith(("tierstate.", "torch."))):
            return level
        frame, level = frame.f_back, level + 1
    return 1


def check_something_to_train(owner: str, params: list) -> None:
    """Parameter groups that hold no parameter at all are refused (a generator passed twice, a
    filter that left nothing); parameters that are all frozen are taken, as torch takes them:
    they step once given a ``.grad`` (unfrozen, or set by hand; its state starts then), and
    until then ``step()`` does nothing, which a warning says once (for ``nn.Parameter`` objects)."""
    if not params:
        raise ValueError(f"{owner} got no parameter: its parameter groups are empty (was a generator passed "
                         "twice, or a filter left nothing?); pass the parameters to train, e.g. model.parameters()")
    # plain tensors (not nn.Parameter) without requires_grad are how torch's own tests and
    # hand-written loops give gradients (.grad set by hand): stepped when they have one, no warning
    if not any(p.requires_grad for p in params) and any(isinstance(p, torch.nn.Parameter) for p in params):
        warnings.warn(f"{owner}: all {len(params)} parameters have requires_grad=False; step() updates only "
                      "those given a .grad, as torch's optimizers do: none until some are unfrozen",
                      UserWarning, stacklevel=_caller_level())
