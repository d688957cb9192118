"""Compressed optimizer state in state dicts: its format, the full-precision export, and
conversion between full and compressed state when one is loaded into the other.

[Note: the state dict of compressed state]
With ``Offload(moment_dtype="q8")`` the state of a parameter of ``n`` elements is kept as
named parts, and ``state_dict()["state"][i]`` holds exactly those (plain tensors, so
``torch.save``, DCP and ``copy.deepcopy`` take them as they take any state):

- ``exp_avg.codes``     uint8, shaped like the parameter: the first moment's 8-bit codes
                        (named ``exp_avg.fp8`` with ``quant_map="fp8"``, and likewise
                        ``exp_avg_sq.fp8``: the part's name says which maps decode it)
- ``exp_avg.scale``     fp32 [ceil(n / B)]: the absmax of each block of B = ``quant_block``
- ``exp_avg_sq.codes``  uint8, shaped like the parameter: codes of sqrt(exp_avg_sq)
- ``exp_avg_sq.scale``  fp32 [ceil(n / B)]
- ``master``            fp32 or bf16 (``master_dtype``), where a master is kept: not for
                        a host parameter that is its own master (fp32 under an fp32
                        master, bf16 under a bf16 one; the parameter holds the value)
- ``master.comp``       int16, only for ``master_dtype="bf16_kahan"``; kept for a bf16
                        parameter that is its own master too: the fp32 weight is then
                        the parameter plus its compensation
- ``step``              as torch

The maps and the encoding are those of :mod:`tierstate.kernels.quant`. The block size is
not stored: a scale count ``ceil(n / B)`` names B wherever B matters (for ``n <= B`` every
block size gives one block over the whole parameter, the same numbers).
:func:`full_state_dict` returns torch's plain schema (``exp_avg``, ``exp_avg_sq`` in fp32,
``master`` in fp32 where one is kept or where a bf16 parameter's compensation holds more
than the parameter does), which ``torch.optim.AdamW`` loads.
"""
from __future__ import annotations

import copy
import warnings

import torch

from ..kernels import quant as Q

MOMENTS = ("exp_avg", "exp_avg_sq")
CODES_SUFFIXES = tuple(f".{part}" for part in Q.CODES_PART.values())  # ".codes", ".fp8": uint8 codes
PART_SUFFIXES = (*CODES_SUFFIXES, ".scale", ".comp")


class StateFormatWarning(UserWarning):
    """A state dict was converted between full-precision and compressed state on load."""


def is_compressed(st: dict) -> bool:
    """Whether one parameter's state holds compressed parts (``exp_avg.codes``, ``exp_avg.fp8``, ...)."""
    return any(isinstance(k, str) and k.endswith(PART_SUFFIXES) for k in st)


def block_of(numel: int, blocks: int, where: str) -> int:
    """The block size whose block count over ``numel`` elements is ``blocks`` (see the note)."""
    for b in (64, 128, 256, 512, 1024, 2048, 4096):
        if Q.n_blocks(numel, b) == blocks:
            return b
    raise ValueError(f"{where}: {blocks} scale(s) for {numel} elements matches no block size in [64, 4096] "
                     "(ceil(numel / block) scales are expected)")


def master_mode_of(st: dict) -> str:
    m = st.get("master")
    if m is None or m.dtype == torch.float32:
        return "fp32"
    return "bf16_kahan" if "master.comp" in st else "bf16_sr"


def to_full(st: dict, numel: int, where: str = "state", own_values=None) -> dict:
    """One parameter's compressed state as full-precision tensors (torch's keys), shaped by
    the codes; ``step`` and any other key kept. ``own_values``: the flat values of a bf16
    parameter that is its own master; with its ``master.comp`` it gives the fp32 ``master``."""
    family = Q.family_of_parts(st)
    m_map, v_map = Q.map_family(family)
    part = Q.CODES_PART[family]
    codes = st[f"exp_avg.{part}"]
    shape = codes.shape
    block = block_of(numel, st["exp_avg.scale"].numel(), where)
    m = Q.dequantize_ref(codes.reshape(-1), st["exp_avg.scale"].float(), m_map, block)
    s = Q.dequantize_ref(st[f"exp_avg_sq.{part}"].reshape(-1), st["exp_avg_sq.scale"].float(), v_map, block)
    out = {k: v for k, v in st.items() if not (k.startswith(MOMENTS) or k.startswith("master"))}
    out["exp_avg"], out["exp_avg_sq"] = m.view(shape), (s * s).view(shape)
    if "master" in st:
        mode = master_mode_of(st)
        part = {"master": st["master"].reshape(-1)}
        if mode == "bf16_kahan":
            part["master.comp"] = st["master.comp"].reshape(-1)
        out["master"] = Q.master_value(Q.QuantConfig(block, mode), part).view(shape)
    elif "master.comp" in st and own_values is not None:
        out["master"] = Q.kahan_value(own_values.reshape(-1), st["master.comp"].reshape(-1)).view(shape)
    return out


def to_compressed(st: dict, config: Q.QuantConfig, keep_master: bool, own_values=None) -> dict:
    """One parameter's full-precision state (torch's keys) as the parts of ``config``.
    ``keep_master``: the target keeps a master (else a saved one is dropped: a host parameter
    that is its own master holds that value). ``own_values``: the flat bf16 values of a
    parameter that is its own ``bf16_kahan`` master; a saved fp32 master then becomes the
    compensation that brings the parameter to it."""
    m = st["exp_avg"].detach().to("cpu", torch.float32)
    shape = m.shape
    out = {k: v for k, v in st.items() if k not in MOMENTS and not k.startswith("master")}
    codes, scale = Q.quantize_ref(m.reshape(-1), config.m_map, config.block_size)
    out[config.codes_key("exp_avg")], out["exp_avg.scale"] = codes.view(shape), scale
    v = st["exp_avg_sq"].detach().to("cpu", torch.float32).reshape(-1)
    codes, scale = Q.quantize_ref(Q.sqrt_exact(v.clamp_min(0)), config.v_map, config.block_size)
    out[config.codes_key("exp_avg_sq")], out["exp_avg_sq.scale"] = codes.view(shape), scale
    if keep_master and "master" in st:
        w = st["master"].detach().to("cpu", torch.float32).reshape(-1)
        if config.master == "fp32":
            out["master"] = w.view(shape)
        else:
            bf = w.to(torch.bfloat16)
            out["master"] = bf.view(shape)
            if config.master == "bf16_kahan":
                out["master.comp"] = Q.kahan_comp(w, bf).view(shape)
    elif config.master == "bf16_kahan" and own_values is not None and "master" in st:
        w = st["master"].detach().to("cpu", torch.float32).reshape(-1)
        out["master.comp"] = Q.kahan_comp(w, own_values.reshape(-1)).view(shape)
    return out


def _same_format(st: dict, config: Q.QuantConfig, numel: int, keep_master: bool, own_comp: bool) -> bool:
    if Q.family_of_parts(st) != config.maps:
        return False  # the other maps' codes
    if st["exp_avg.scale"].numel() != Q.n_blocks(numel, config.block_size):
        return False  # another block size (equal counts mean equal blocks: see the note)
    if "master" in st and (keep_master or own_comp):
        # a bf16 parameter that is its own bf16_kahan master takes a saved bf16_kahan master's
        # compensation as it is (the parameter holds that master); any other master converts
        return master_mode_of(st) == config.master
    return True


def convert_for(opt, state_dict: dict) -> dict:
    """``state_dict`` in the state format of ``opt`` (a tierstate optimizer), converting each
    parameter's state that is in the other one (full <-> compressed, or another block size
    or master mode) with a :class:`StateFormatWarning`; the caller's dict is not changed."""
    state = state_dict.get("state") if isinstance(state_dict, dict) else None
    if not isinstance(state, dict) or not isinstance(state_dict.get("param_groups"), list):
        return state_dict  # check_state_dict names what is wrong
    store = opt.state_store
    config = store.quant
    ids = [i for g in state_dict["param_groups"] if isinstance(g, dict) for i in g.get("params", ())]
    params = [p for g in opt.param_groups for p in g["params"]]
    converted: dict = {}
    for saved_id, p in zip(ids, params):
        st = state.get(saved_id)
        if not isinstance(st, dict) or not st:
            continue
        s = store.slot_of(p)
        if s is None or s.trainable is None:
            continue
        numel = s.local.numel()
        compressed = is_compressed(st)
        where = f"load_state_dict: state of parameter {saved_id}"
        own_comp = config is not None and store.keeps_own_comp(s)
        own = _own_values(store, s) if own_comp or ("master.comp" in st and "master" not in st) else None
        try:
            if config is None and compressed:
                converted[saved_id] = to_full(st, numel, where, own)
            elif config is not None and not compressed:
                if all(k in st for k in MOMENTS):
                    converted[saved_id] = to_compressed(st, config, s.needs_master, own if own_comp else None)
            elif config is not None and not _same_format(st, config, numel, s.needs_master, own_comp):
                converted[saved_id] = to_compressed(to_full(st, numel, where, own), config, s.needs_master,
                                                    own if own_comp else None)
        except KeyError as exc:
            raise ValueError(f"{where} lacks {exc.args[0]!r} (it has {sorted(st)}); compressed state needs "
                             "exp_avg.codes/.scale and exp_avg_sq.codes/.scale (.fp8 in place of .codes for "
                             "quant_map='fp8')") from None
    if not converted:
        return state_dict
    target = (f"compressed state (moment_dtype='q8', quant_block={config.block_size}, master_dtype="
              f"'{config.master}', quant_map='{config.maps}')" if config is not None else "full-precision state")
    warnings.warn(f"load_state_dict: converted the state of {len(converted)} parameter(s) to this optimizer's "
                  f"{target}; 8-bit codes hold the moments to about 1 % (docs/compressed_state.md)",
                  StateFormatWarning, stacklevel=3)
    out = dict(state_dict)
    out["state"] = {**state, **converted}
    return out


def _own_values(store, s):
    """A copy of the flat values of ``s``'s bf16 parameter, the master that a saved state's
    compensation completes (None for another dtype)."""
    if s.param.dtype != torch.bfloat16:
        return None
    with store.values_of(s, False) as flat:
        return flat.detach().to("cpu").clone()


def full_state_dict(opt) -> dict:
    """The optimizer's ``state_dict()`` with every state in full precision, torch's schema:
    ``exp_avg`` and ``exp_avg_sq`` as fp32 tensors shaped like the parameter, ``master`` (fp32)
    where a master is kept and for a bf16 parameter that is its own ``bf16_kahan`` master (the
    parameter plus its compensation), ``step``; loads into ``torch.optim.AdamW`` and into any tierstate
    optimizer. For an optimizer without compressed state it is ``state_dict()`` itself.

    Each parameter's state is expanded in turn (its full-precision copy is 12 B/param while it
    is built): for states larger than RAM, expand from a checkpoint parameter by parameter.
    """
    sd = opt.state_dict()
    if opt.state_store.quant is None:
        return sd
    store = opt.state_store
    params = [p for g in opt.param_groups for p in g["params"]]
    ids = [i for g in sd["param_groups"] for i in g["params"]]
    slots = {i: store.slot_of(p) for i, p in zip(ids, params)}

    def full(i, st: dict) -> dict:
        # the parameter's own values only where its compensation completes them (bf16_kahan)
        own = _own_values(store, slots[i]) if "master.comp" in st and "master" not in st else None
        return to_full(st, slots[i].local.numel(), f"state of parameter {i}", own)

    out = copy.copy(sd)
    # an entry whose key is not a parameter's index (a hook's state["test"]) passes as it is
    out["state"] = {i: full(i, st) if i in slots and is_compressed(st) else st for i, st in sd["state"].items()}
    return out


__all__ = ["StateFormatWarning", "convert_for", "full_state_dict", "is_compressed", "to_compressed", "to_full"]
