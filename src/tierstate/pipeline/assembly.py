"""Assembly: from the parameter groups, the rule and the policy to a layout, tiers and a store.

[Note: the device tier in a step]
With ``Offload(gpu=f)`` the first ``f`` of the flat index space lives in a tier on the
parameters' device. Gradients of parameters touching it are not streamed to the host:
they are read from ``param.grad`` where backward left them. A step then (1) queues the
device part's share of the global norm, (2) computes the host part's share with the
native kernel and waits for the device share (clipping and the non-finite skip need the
total before any state moves), (3) queues the device part's update, one fused multi-tensor
launch per parameter group and sub-group, and (4) runs the host and NVMe sub-groups, which
on CUDA overlap (3). At most one parameter straddles the device range and the host range;
its tail is copied to the host at step time and only the tail is uploaded afterwards, its
head being updated in place on the device. A wholly device-resident fp32 parameter is its
own master, as in torch; bf16/fp16 ones keep an fp32 master in the device tier.

[Note: float64 parameters]
torch keeps a float64 parameter's state in float64 and computes its update in float64;
torch's own optimizer tests run in float64 (``test_foreach_matches_forloop``). An optimizer
whose parameters are float64 (or complex128, as their float64 real views) stores every state
key in float64 in its tiers (host RAM or NVMe, 16 B a parameter for Adam), keeps no master
(the parameter is its own, as an fp32 one is) and updates with the reference kernels,
which are torch's single-tensor op sequence, so the result is torch's bit for bit. Beside
narrower parameters (torch's multi-tensor sparse Rosenbrock test puts a float64 parameter
beside a float32 one), the float64 ones are the layout's ``wide`` parameters: their
sub-groups hold only them, and the host tier keeps float64 arenas for those sub-groups beside
the narrow ones (``StateStore.wide_dtypes``); such an optimizer keeps its state in host RAM
(the NVMe records and the device tier have one dtype per key). Narrower or compressed state
would change torch's float64 results and is refused.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from ..dist import local_tensor, shard_groups
from ..placement import Offload, plan_layout
from ..placement.defaults import is_own_master
from ..placement.offload import dtype_name
from ..tiers import (Slot, StateStore, device_heads, device_tier_on_cpu_allowed, make_tiers, tier_fractions)
from ..tiers.host import move_to_huge_pages
from .grads import Gradients
from ..weights import generation as weights_generation
from ..weights import streamed as weights_of
from .weights import WeightsOut


@dataclass
class Parts:
    """What one assembly made; a rebuild (new groups, replaced parameters) makes them anew."""

    device: torch.device
    store: StateStore
    trainable: list[Tensor]
    shard_groups: list
    heads: dict[int, int]  # trainable index -> elements at its head in a tier on the compute device
    grads: Gradients
    weights: WeightsOut
    weights_generation: int  # tierstate.weights.generation() when assembled: re-assemble when it moves

    def close(self) -> None:
        self.grads.close()
        self.store.close()


def assemble(groups: Callable[[], list], rule, offload: Offload, step_in_backward: bool, telemetry,
             held_back: frozenset = frozenset()) -> Parts:
    """The parts of an optimizer over ``groups()``; ``held_back``: parameters placed as frozen
    whatever their ``requires_grad`` (those whose adoption was just refused)."""
    generation = weights_generation()  # read first: a streamer made during assembly moves it
    param_groups = groups()
    params = [p for g in param_groups for p in g["params"]]
    device = params[0].device if params else torch.device("cpu")
    on_accel = device.type != "cpu"
    if offload.gpu > 0 and not on_accel and not device_tier_on_cpu_allowed():
        raise ValueError(
            f"Offload(gpu={offload.gpu}) needs parameters on an accelerator; these are on {device}: "
            "move the model to the accelerator before building the optimizer, or keep the state in host RAM "
            "and on NVMe, e.g. Offload(cpu=0.6, nvme=0.4)")
    if offload.gpu > 0 and step_in_backward:
        raise ValueError(f"step_in_backward=True with Offload(gpu={offload.gpu}): the update during backward "
                         "runs on the host tiers only; use Offload(gpu=0, ...) or step_in_backward=False")
    widths = {is_float64(p) for p in params}  # see the note above
    wide, mixed = widths == {True}, len(widths) == 2
    if True in widths:
        check_float64_offload(offload, mixed)
    slots, trainable = [], []
    for gi, g in enumerate(param_groups):
        for p in g["params"]:
            # torch's Adagrad creates state for every parameter, frozen or not, so eager rules place all;
            # torch steps a tensor whose .grad is set whatever its requires_grad, so one is placed too
            t = len(trainable) if (p.requires_grad or p.grad is not None or rule.eager_state) \
                and p not in held_back else None
            if t is not None:
                trainable.append(p)
            # a streamed weight is updated where it lives (its block's host image), even on an
            # accelerator: it is its own master, as a host parameter of the master's dtype is;
            # a float64 one always is (see the note above)
            own_master = is_float64(p) or is_own_master(dtype_name(local_tensor(p).dtype), offload.master_mode) and (
                not on_accel or weights_of(p) is not None)
            if own_master and p.dtype == torch.float32 and t is not None and not on_accel and weights_of(p) is None \
                    and local_tensor(p) is p:
                move_to_huge_pages(p)  # updated in place by every host step: see the note there
            slots.append(Slot(len(slots), p, gi, t, needs_master=not own_master))
    if offload.gpu > 0 and any(weights_of(p) is not None for p in trainable):
        raise ValueError(f"Offload(gpu={offload.gpu}) with parameters whose weights stream (ts.offload_weights): "
                         "their values live on the host tiers, so their state does too; use Offload(gpu=0, ...)")
    shards = shard_groups(trainable)
    stores_nothing = not any(spec for g in param_groups for spec in rule.state_specs(g)) and not any(
        s.needs_master for s in slots if s.trainable is not None)
    quant = check_compressed(offload, rule, param_groups, trainable)
    # A complex parameter is stepped as its real view, and optimizer.state shows its state as
    # complex views of the host state (torch.view_as_complex), which need an even offset: with
    # a complex parameter every parameter starts, and every tier and sub-group is cut, at an
    # even element (a real one of odd size gets one element of padding). Before 2026-12-07 a
    # complex parameter after a real one of odd size raised "Tensor must have a storage_offset
    # divisible by 2" at its first step.
    align = quant.block_size if quant is not None else 2 if any(p.is_complex() for p in trainable) else 1
    subgroup_numel = offload.subgroup_numel_for(device, step_in_backward=step_in_backward,
                                                streams_weights=any(weights_of(p) is not None for p in trainable))
    layout = plan_layout([local_tensor(p).numel() for p in trainable],
                         tier_fractions(offload, stores_nothing=stores_nothing),
                         subgroup_numel if quant is not None else subgroup_numel // align * align,
                         align=align, wide=[is_float64(p) for p in trainable] if mixed else ())
    if offload.gpu > 0 and shards:
        raise ValueError(f"Offload(gpu={offload.gpu}) with sharded (FSDP2 DTensor) parameters is not supported; "
                         "keep the state on the host tiers, e.g. Offload(cpu=0.6, nvme=0.4)")
    heads = device_heads(layout)
    for s in slots:  # wholly on the device and fp32: the parameter is its own master, as in torch
        if heads.get(s.trainable, -1) == s.param.numel() and s.param.dtype == torch.float32:
            s.needs_master = False
    specs = {}
    for g in param_groups:
        for spec in rule.state_specs(g):
            specs.setdefault(spec.name, spec)
    any_master = any(s.needs_master for s in slots if s.trainable is not None)
    if wide:
        dtypes = {name: torch.float64 for name in specs}
        inits = {name: spec.init for name, spec in specs.items()}
    elif quant is None:
        dtypes = {name: (offload.moment_dtype if spec.moment else torch.float32) for name, spec in specs.items()}
        inits = {name: spec.init for name, spec in specs.items()}
        if any_master:
            dtypes["master"] = torch.float32
    else:
        spec = quant.state_spec(0)
        codes_dtype, scale_dtype = spec[quant.codes_key("exp_avg")][1], spec["exp_avg.scale"][1]
        dtypes = {k: d for name in specs for k, d in ((quant.codes_key(name), codes_dtype),
                                                      (f"{name}.scale", scale_dtype))}
        if any_master:
            dtypes |= {k: spec[k][1] for k in spec if k.startswith("master")}
        elif "master.comp" in spec and trainable:  # bf16 parameters, their own masters, keep the compensation
            dtypes["master.comp"] = spec["master.comp"][1]
        inits = {}
    units = {k: quant.block_size for k in dtypes if k.endswith(".scale")} if quant is not None else None
    by_trainable = {s.trainable: s for s in slots if s.trainable is not None}
    master_on_device = any(by_trainable[t].needs_master for t in heads)
    wide_dtypes = {name: torch.float64 for name in specs} if mixed else {}
    tiers = make_tiers(layout, dtypes, inits, offload, device, master_on_device=master_on_device, telemetry=telemetry,
                       units=units, blocks=streamed_block_subgroups(layout, trainable) if step_in_backward else (),
                       wide_dtypes=wide_dtypes)
    store = StateStore(slots, layout, tiers, dtypes, specs_of=lambda gi: rule.state_specs(groups()[gi]), quant=quant,
                       sr_seed=offload.sr_seed, wide_dtypes=wide_dtypes)
    grads = None
    try:
        grads = Gradients(trainable, heads, offload, device, telemetry, hook_norms=not step_in_backward,
                          sparse_refusal=lambda s: rule.sparse_refusal(groups()[s.group]))
        weights = WeightsOut(store, trainable, heads, device)
        store.values_of = weights.values_of
        for handle in weights.streamed.values():
            handle.streamer.attach_telemetry(telemetry)  # its waits and reads appear in this optimizer's trace
    except BaseException:  # (e.g. pinned memory refused) the tiers' files go now, not at collection
        if grads is not None:
            grads.close()
        store.close()
        raise
    return Parts(device, store, trainable, shards, heads, grads, weights, generation)


def streamed_block_subgroups(layout, trainable: list) -> list[set[int]]:
    """Per block of streamed weights, the sub-groups its parameters span: what one block's
    gradients complete during backward (empty when no weight streams)."""
    spans: dict[tuple[int, int], set[int]] = {}
    for t, p in enumerate(trainable):
        handle = weights_of(p)
        if handle is not None:
            spans.setdefault((id(handle.streamer), handle.block), set()).update(
                seg.subgroup for seg in layout.segments_of(t))
    return list(spans.values())


def is_float64(p: Tensor) -> bool:
    """``p``'s values are float64 (a complex128 parameter's real view too): its state is float64."""
    return local_tensor(p).dtype == torch.float64


def check_float64_offload(offload: Offload, mixed: bool) -> None:
    """Refuse state narrower than float64 for float64 parameters: torch's float64 results
    need float64 moments; and float64 parameters beside narrower ones outside host RAM (see
    [Note: float64 parameters])."""
    if mixed and (offload.nvme > 0 or offload.gpu > 0):
        raise ValueError(
            f"float64 parameters beside narrower ones with Offload(nvme={offload.nvme}, gpu={offload.gpu}): the state "
            "of an optimizer mixing widths is kept in host RAM; use Offload(cpu=1.0) (offload='cpu'), or give the "
            "float64 parameters an optimizer of their own, whose state may go to NVMe")
    if offload.quant_config() is not None or offload.moment_dtype != torch.float32 or offload.master_mode != "fp32":
        raise ValueError(
            f"float64 parameters with Offload(moment_dtype={dtype_name(offload.moment_dtype)!r}, "
            f"master_dtype={offload.master_mode!r}): float64 parameters keep float64 state, as torch's optimizers do; "
            "leave moment_dtype and master_dtype at torch.float32 (their defaults), or train in float32")


def check_compressed(offload: Offload, rule, param_groups: list, trainable: list):
    """The QuantConfig of ``Offload(moment_dtype="q8")`` (None otherwise), refusing what the
    fused 8-bit kernels do not run: other rules than Adam/AdamW, amsgrad, parameters of
    2**32 elements or more (the stochastic-rounding index is 32-bit)."""
    quant = offload.quant_config()
    if quant is None:
        return None
    from ..rules import AdamRule  # noqa: PLC0415

    if not isinstance(rule, AdamRule):
        raise ValueError(f"Offload(moment_dtype='q8') with {rule.torch_name}: compressed state runs in the fused "
                         "Adam/AdamW kernels only; use ts.AdamW / ts.Adam, or moment_dtype=torch.bfloat16")
    for i, g in enumerate(param_groups):
        if g.get("amsgrad"):
            raise ValueError(f"Offload(moment_dtype='q8') with amsgrad=True (param group {i}): the 8-bit kernels "
                             "keep no max_exp_avg_sq; use amsgrad=False or moment_dtype=torch.float32")
    for p in trainable:
        if p.is_complex():
            raise ValueError("Offload(moment_dtype='q8') with a complex parameter: compressed state is kept for "
                             "real parameters; use moment_dtype=torch.float32 or bfloat16 (complex parameters are "
                             "stepped as their real views there)")
        if quant.master != "fp32" and p.dtype == torch.float32 and p.device.type != "cpu" \
                and weights_of(p) is None:
            # the upload copies the stored master itself to the device: a bf16 one, without its
            # compensation, would silently truncate the fp32 weight every step
            raise ValueError(f"Offload(master_dtype={quant.master!r}) with float32 parameters on {p.device}: a "
                             "16-bit master serves 16-bit parameters there; convert the model (model.bfloat16()) "
                             "or keep master_dtype=torch.float32")
        if local_tensor(p).numel() >= 2**32:
            raise ValueError(f"Offload(moment_dtype='q8'): a parameter of {local_tensor(p).numel()} elements; the "
                             "compressed kernels index elements in 32 bits: split it below 2**32 elements")
    return quant
