"""The checks on what an optimizer is given: the ``params`` argument and each parameter group.

torch accepts any iterable of tensors, of ``(name, tensor)`` pairs or of group dicts; so
does tierstate, with the checks torch leaves out where leaving them out would corrupt state
(a set's order changes between runs; a tensor twice would be stepped twice).
"""
from __future__ import annotations

import warnings
from typing import Iterable

import torch
from torch import Tensor

from ..dist import is_dtensor, local_tensor
from ..tiers.param_memory import caller_level as _caller_level
from ..tiers.param_memory import give_contiguous_memory, non_contiguous

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
    give_contiguous_memory({i: tensors[i] for i in to_move})
    return param_group


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
