"""The check ``OffloadOptimizer.load_state_dict`` runs before it changes anything.

``load_state_dict`` first replaces ``param_groups`` and forgets every state, then imports
the given state parameter by parameter; a bad value found along the way would leave the
optimizer half loaded (hyper-parameters replaced, state gone or partly written). So every
part of the dict is checked first, as :func:`tierstate.checkpoint.load_optimizer` checks
a checkpoint: group count and sizes, every hyper-parameter with the rule's own
``validate`` (the function the constructor runs), and for every parameter that will take
state: each key the rule keeps present, a floating-point tensor of the parameter's size,
and a whole, non-negative ``step`` for rules that count steps.
"""
from __future__ import annotations

import math
import numbers

from torch import Tensor


def _step_value(value) -> float | None:
    """The step as a float, or None when it is not a single real number."""
    if isinstance(value, Tensor):
        return float(value.item()) if value.numel() == 1 and not value.is_complex() else None
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    return None


def check_state_dict(opt, state_dict) -> list[dict]:
    """Raise ValueError/TypeError, naming the part and the fix, if ``opt`` must not load ``state_dict``.

    ``opt`` is a :class:`tierstate.optim.base.OffloadOptimizer`; nothing of it is changed.
    Returns the saved param groups as ``opt`` will hold them (validated; ``params`` are
    ``opt``'s own tensors).
    """
    name = type(opt).__name__
    if not isinstance(state_dict, dict):
        raise TypeError("load_state_dict: expected a dict (an optimizer state_dict()), got "
                        f"{type(state_dict).__name__}")
    groups = state_dict.get("param_groups")
    if not isinstance(groups, list):
        raise ValueError("load_state_dict: the state dict has no 'param_groups' list (is it an optimizer state dict?)")
    state = state_dict.get("state", {})
    if not isinstance(state, dict):
        raise TypeError("load_state_dict: 'state' must be a dict of parameter index -> state, got "
                        f"{type(state).__name__}")
    if len(groups) != len(opt.param_groups):
        raise ValueError(f"loaded state dict has a different number of parameter groups (torch's words): the "
                         f"state dict has {len(groups)} param group(s), this {name} has {len(opt.param_groups)}; "
                         "load a state dict of an optimizer over the same parameter groups")
    needed = opt.rule.required_keys()
    merged = []
    for gi, (saved, current) in enumerate(zip(groups, opt.param_groups)):
        if not isinstance(saved, dict) or not isinstance(saved.get("params"), (list, tuple)):
            raise ValueError(f"load_state_dict: param_groups[{gi}] must be a dict with a 'params' list")
        if len(saved["params"]) != len(current["params"]):
            raise ValueError("loaded state dict contains a parameter group that doesn't match the size of "
                             f"optimizer's group (torch's words): param_groups[{gi}] has {len(saved['params'])} "
                             f"parameter(s) in the state dict, {len(current['params'])} in this {name}")
        missing = sorted(set(needed) - set(saved))
        if missing:
            raise ValueError(f"load_state_dict: param_groups[{gi}] lacks {missing[0]!r}, which {name} needs "
                             f"(its default is {needed[missing[0]]!r}); add it to the state dict")
        # torch's implementation switches (fused=True) become this optimizer's, absent keys its defaults
        group = {**opt.loaded_group(saved), "params": current["params"]}
        try:
            opt.rule.validate(group)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"load_state_dict: param_groups[{gi}] is refused, as {name}(...) would refuse it: "
                            f"{exc}; nothing was loaded") from None
        merged.append(group)

    for gi, saved_id, p in ((gi, i, p) for gi, (g, cur) in enumerate(zip(groups, opt.param_groups))
                            for i, p in zip(g["params"], cur["params"])):
        st = state.get(saved_id)
        s = opt.state_store.slot_of(p)
        if not st or s.trainable is None:
            continue  # no state to load, or a frozen parameter, whose state load_state_dict ignores
        if not isinstance(st, dict):
            raise TypeError(f"load_state_dict: state of parameter {saved_id} must be a dict of key -> tensor, "
                            f"got {type(st).__name__}")
        numel, shape = s.local.numel(), tuple(s.local.shape)
        keys = [spec.name for spec in opt.rule.state_specs(merged[gi])]
        store = opt.state_store
        if store.quant is not None:  # compressed parts (tierstate.checkpoint.compressed)
            _check_parts(store, s, st, saved_id, keys)
            keys = []
        for key in keys + (["master"] if "master" in st and store.quant is None else []):
            value = st.get(key)
            if value is None:
                raise ValueError(f"load_state_dict: state {key!r} of parameter {saved_id} is missing (it has "
                                 f"{sorted(st)}); {name} with these hyper-parameters keeps {keys}")
            if not isinstance(value, Tensor) or value.numel() != numel:
                got = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
                raise ValueError(f"load_state_dict: state {key!r} of parameter {saved_id} has shape {got}, "
                                 f"the parameter has shape {shape}")
            if not value.dtype.is_floating_point:
                raise TypeError(f"load_state_dict: state {key!r} of parameter {saved_id} has dtype {value.dtype}; "
                                 "optimizer state is floating point (e.g. torch.float32)")
        if opt.rule.has_step:
            step = _step_value(st.get("step"))
            if step is None or not math.isfinite(step) or step < 0 or step != int(step):
                raise ValueError(f"load_state_dict: state 'step' of parameter {saved_id} is {st.get('step')!r}; "
                                 f"{name} needs a whole number >= 0 (the parameter's step count) for every "
                                 "parameter with state")
    return merged


def _check_parts(store, s, st: dict, saved_id, names: list) -> None:
    """The compressed parts of one parameter's state: present, of the stored dtype and item count."""
    expected = [k for n in names for k in (store.quant.codes_key(n), f"{n}.scale")]
    if "master" in st and s.needs_master:
        expected += [k for k in store.dtypes if k.startswith("master")]
    # any other master part given that this parameter keeps (the compensation of a bf16
    # parameter that is its own master) is checked too, before anything is written
    expected += [k for k in store.keys(s) if k.startswith("master") and k in st and k not in expected]
    for key in expected:
        value = st.get(key)
        if value is None:
            raise ValueError(f"load_state_dict: state {key!r} of parameter {saved_id} is missing (it has {sorted(st)}); "
                             f"this optimizer keeps compressed state: {expected}")
        want = store.item_count(s, key)
        if not isinstance(value, Tensor) or value.numel() != want:
            got = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise ValueError(f"load_state_dict: state {key!r} of parameter {saved_id} has shape {got}; {want} "
                             f"item(s) expected for a parameter of shape {tuple(s.local.shape)}")
        if value.dtype != store.dtype(s, key):
            raise TypeError(f"load_state_dict: state {key!r} of parameter {saved_id} has dtype {value.dtype}; "
                            f"this optimizer stores it as {store.dtype(s, key)}")


__all__ = ["check_state_dict"]
