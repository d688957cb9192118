"""``offload="auto"``: the planner picks the placement when the optimizer is built.

Inputs, in order of preference:

- hardware rates: the saved profile of ``tierstate probe`` (:func:`probe.default_profile_path`);
  without one, a quick built-in probe when ``TIERSTATE_AUTO_PROBE=1`` (about 5 s, not saved),
  else the planner's conservative defaults. Which one was used is logged.
- budgets, read now (not from the profile, which may be old): 80% of the host RAM available
  (``TIERSTATE_AUTO_HOST_FRACTION`` overrides), the free space under the default NVMe folder,
  and on CUDA half of the free device memory (``TIERSTATE_AUTO_DEVICE_FRACTION`` overrides;
  ``0`` keeps all state off the device).

On CUDA the device tier is part of the search (``Offload(gpu=...)``): the planner puts as
much state there as shortens the predicted step within the device budget. The optimizer
is built before the first forward pass, so the activations' memory is unknown then; the
half of the free memory left out of the budget is for them.

The choice and its reason are logged at INFO on the ``"tierstate"`` logger. Moments stay fp32:
"auto" chooses where state lives, never how precise it is.

:func:`choose_weights` is the same for ``offload_weights(..., offload="auto")``: it reads the
same rates and budgets and asks :func:`.weights_plan.plan_weights` which blocks stay resident,
which stream from pinned host RAM or NVMe, and how far ahead to fetch.
"""
from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import Sequence

from .model_spec import from_param_numels
from .offload import Offload, default_nvme_root
from .plan_inputs import Budgets, Hardware, PlanError, PlanRequest, gib
from .planner import choose
from .weights_plan import WeightPlan, plan_weights

_log = logging.getLogger("tierstate")
HOST_FRACTION = 0.8  # headroom for the data loader, activations and the allocator's slack
# Share of the free device memory (at construction) the device tier may plan with: activations,
# the caching allocator's fragmentation and cuBLAS workspaces are not known yet and need the rest.
DEVICE_FRACTION = 0.5
# Smaller sub-groups shrink the NVMe buffer pool (buffer_count records of one sub-group) when
# host RAM is tight; 1 Mi elements (12 MiB AdamW records) still reads in large sequential requests.
SUBGROUP_OPTIONS = (1 << 24, 1 << 22, 1 << 20)
# Fewer pool buffers when even 1 Mi-element records do not fit: each step then moves more of
# its records through the disk, but the state still fits.
BUFFER_OPTIONS = (8, 4, 2)
_DTYPE_NAMES = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}


# Share of the free device memory the weights (resident blocks and the window) may plan with when
# the activations are given; when they are not (0), DEVICE_FRACTION leaves half for them. The
# remaining 10% is for the caching allocator's fragmentation and cuBLAS workspaces.
WEIGHT_DEVICE_FRACTION = 0.9


def _hardware() -> Hardware:
    from . import probe

    path = probe.default_profile_path()
    try:
        profile = probe.load_profile(path)
    except ValueError as exc:
        _log.warning("tierstate: offload='auto' ignores the hardware profile: %s", exc)
        profile = None
    if profile is not None:
        return Hardware.from_profile(profile, source=f"hardware profile {path} ({profile.get('created_at', '?')})")
    if os.environ.get("TIERSTATE_AUTO_PROBE") == "1":
        return Hardware.from_profile(probe.run_probe(quick=True),
                                     source="quick built-in probe (TIERSTATE_AUTO_PROBE=1; not saved)")
    return replace(Hardware.conservative(), source=f"conservative defaults (no hardware profile at {path}; "
                                                   "run `tierstate probe` to measure this machine)")


def existing_ancestor(path) -> str:
    """``path`` or its nearest existing parent: the filesystem a folder not made yet would be on."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def _fraction_env(name: str, default: float, *, zero_ok: bool, hint: str) -> float:
    """A fraction in (0, 1] (or [0, 1] with ``zero_ok``) from environment variable ``name``."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not (0.0 <= value if zero_ok else 0.0 < value) or value > 1.0:
        raise ValueError(f"{name}={raw!r}: must be a number in {'[0' if zero_ok else '(0'}, 1], {hint}")
    return value


def _host_fraction() -> float:
    return _fraction_env("TIERSTATE_AUTO_HOST_FRACTION", HOST_FRACTION, zero_ok=False, hint="e.g. 0.8")


def _device_fraction() -> float:
    return _fraction_env("TIERSTATE_AUTO_DEVICE_FRACTION", DEVICE_FRACTION, zero_ok=True,
                         hint="e.g. 0.5 (0 keeps all optimizer state off the device)")


def device_budget(free_bytes: int, param_bytes: int) -> int | None:
    """Device memory the plan may use: the parameters (already there) plus the allowed share of
    the free memory; None when the share is 0 (then the device tier is not searched)."""
    fraction = _device_fraction()
    return None if fraction == 0.0 else int(free_bytes * fraction) + param_bytes


def offload_from_plan(plan) -> Offload:
    """The :class:`Offload` a plan's placement stands for, with the plan's sub-group size and pool."""
    p, req = plan.placement, plan.request
    compression = {}
    if req.moment_dtype != "fp32" or req.master_dtype != "fp32":  # the request's state format, kept
        # the request's names ("bf16", "q8", "fp32", "bf16_kahan", ...) are Offload's own spellings
        compression = dict(moment_dtype=req.moment_dtype, master_dtype=req.master_dtype,
                           quant_block=req.quant_block, **({"quant_map": req.quant_map}
                                                           if req.moment_dtype == "q8" else {}))
    if p.nvme == 0 and p.gpu == 0:
        return Offload(cpu=1.0, **compression)
    # buffer_count None: the optimizer sizes its pool as the plan priced it (Offload.buffer_count_for)
    return Offload(gpu=p.gpu, cpu=p.cpu, nvme=max(0.0, 1.0 - p.gpu - p.cpu),
                   subgroup_numel=req.subgroup_numel, buffer_count=req.buffer_count, **compression)


def _tensors(params: Sequence) -> list:
    """The tensors of ``params``: tensors, or param-group dicts whose ``"params"`` is a tensor or
    a sequence of them (what an optimizer accepts)."""
    out = []
    for item in params:
        if isinstance(item, dict):
            group = item.get("params", ())
            out.extend([group] if hasattr(group, "requires_grad") else group)
        else:
            out.append(item)
    return out


def _is_float64(p) -> bool:
    """``p`` holds float64 values (complex128 too): its state is float64 (tierstate.pipeline.assembly)."""
    return str(p.dtype) in ("torch.float64", "torch.complex128")


def _priced_numel(p) -> int:
    """The values the planner prices ``p`` as: a complex parameter's state is that of its real
    view (two values per element); a float64 value's state is priced as two fp32 values."""
    return p.numel() * (2 if p.is_complex() else 1) * (2 if _is_float64(p) else 1)


def request_for(trainable: Sequence, *, state_keys: tuple[str, ...], moment_dtype: str = "fp32",
                master_dtype: str = "fp32", quant_block: int = 256, quant_map: str = "dynamic",
                step_in_backward: bool = False, streamed_blocks: Sequence[Sequence] = ()) -> PlanRequest:
    """The :class:`PlanRequest` of ``choose_offload`` for these trainable tensors: their sizes,
    device and dtype, and the blocks of those whose weights stream (``streamed_blocks``)."""
    dtypes = {str(p.dtype) for p in trainable}
    param_dtype = "fp32" if "torch.float32" in dtypes else _DTYPE_NAMES.get(sorted(dtypes)[0], "fp32")
    model = from_param_numels([_priced_numel(p) for p in trainable])
    blocks = tuple(sum(_priced_numel(p) for p in block) for block in streamed_blocks if block)
    if blocks:
        model = replace(model, block_numels=blocks, outside_numel=model.numel - sum(blocks))
    return PlanRequest(model, device="cuda" if trainable[0].device.type == "cuda" else "cpu",
                       param_dtype=param_dtype, state_keys=tuple(state_keys), moment_dtype=moment_dtype,
                       master_dtype=master_dtype, quant_block=quant_block, quant_map=quant_map,
                       weights_offloaded=bool(blocks), step_in_backward=step_in_backward)


def choose_offload(params: Sequence, allow_device_tier: bool = True, *, state_keys: Sequence[str],
                   moment_dtype: str = "fp32", master_dtype: str = "fp32", quant_block: int = 256,
                   quant_map: str = "dynamic", step_in_backward: bool = False,
                   streamed_blocks: Sequence[Sequence] = ()) -> Offload:
    """The :class:`Offload` that the planner predicts fastest within this machine's budgets.

    ``params`` are the optimizer's parameters or its param-group dicts. ``state_keys`` are the
    optimizer's per-element state keys besides the master (its rule's ``state_specs`` names,
    e.g. ``("exp_avg", "exp_avg_sq")``; the union of every group's when they differ, a repeat
    counted once); "auto" keeps them in fp32. ``allow_device_tier=False`` keeps the state off the device even on CUDA (the
    optimizer passes it for ``step_in_backward=True``, which updates the host tiers only).
    ``moment_dtype`` (``"fp32"``, ``"bf16"``, ``"q8"``), ``master_dtype`` (``"fp32"``,
    ``"bf16_kahan"``, ``"bf16_sr"``), ``quant_block`` and ``quant_map`` price the state as
    :class:`Offload` would store it (compressed state keeps off the device tier) and are
    carried into the returned policy. ``streamed_blocks``: the trainable parameters whose
    weights stream (``ts.offload_weights``), one sequence per block; they hold no memory
    between uses, and with ``step_in_backward`` the optimizer's default NVMe pool grows with
    the records one block spans (:meth:`Offload.buffer_count_for`), which the plan prices and
    leaves to the optimizer (the returned policy's ``buffer_count`` is None unless a smaller
    pool had to be chosen).
    Raises ValueError (naming what is missing) when no placement fits.
    """
    import psutil

    if isinstance(state_keys, (str, bytes)):
        raise TypeError(f"state_keys={state_keys!r}: must be a sequence of key names, e.g. ('exp_avg', "
                        "'exp_avg_sq'), not one string")
    state_keys = tuple(dict.fromkeys(state_keys))  # the union of the groups' keys: each counted once
    trainable = [p for p in _tensors(params) if getattr(p, "requires_grad", False)]
    if not trainable:
        _log.info("tierstate: offload='auto' chose Offload(cpu=1.0): no trainable parameters")
        return Offload(cpu=1.0)
    device = trainable[0].device
    on_cuda = device.type == "cuda"
    req = request_for(trainable, state_keys=state_keys, moment_dtype=moment_dtype, master_dtype=master_dtype,
                      quant_block=quant_block, quant_map=quant_map, step_in_backward=step_in_backward,
                      streamed_blocks=streamed_blocks)
    streamed = req.weights_offloaded
    if moment_dtype == "q8":
        allow_device_tier = False  # the device tier runs torch's fused Adam, which has no compressed state
    # The parameters (and any gradients) already exist: they are in use, not in the available figure.
    # With weights streamed, the plan prices no parameter memory (weights_offloaded: the weight
    # plan's), so none is added back to the budget either.
    existing = 0 if streamed else sum(p.numel() * p.element_size() for p in trainable if p.device.type == "cpu")
    existing += sum(p.grad.numel() * p.grad.element_size() for p in trainable
                    if p.grad is not None and p.grad.device.type == "cpu")
    fraction = _host_fraction()
    available = psutil.virtual_memory().available
    nvme_root = existing_ancestor(default_nvme_root())
    st = os.statvfs(nvme_root)
    device_bytes, search_device = None, False
    if on_cuda:
        import torch

        free, _ = torch.cuda.mem_get_info(device)
        param_bytes = sum(p.numel() * p.element_size() for p in trainable)
        share = device_budget(free, param_bytes) if allow_device_tier else None
        search_device = share is not None
        device_bytes = share if search_device else free + param_bytes
    # float64 parameters beside narrower ones keep their state in host RAM (the NVMe records
    # hold one dtype per key; tierstate.pipeline.assembly): no disk to plan with then
    widths = {_is_float64(p) for p in _tensors(params)}
    mixed = len(widths) == 2
    budgets = Budgets(device=device_bytes, host=int(available * fraction) + existing,
                      disk=0 if mixed else st.f_bavail * st.f_frsize, disk_dir=str(default_nvme_root()))
    hw = _hardware()
    try:
        plan = choose(req, hw, budgets, allow_device_tier=search_device,
                      subgroup_options=SUBGROUP_OPTIONS, buffer_options=BUFFER_OPTIONS)
    except PlanError as exc:
        why = ("\nfloat64 parameters beside narrower ones keep their state in host RAM: free memory, or give "
               "the float64 parameters an optimizer of their own, whose state may go to NVMe.") if mixed else ""
        raise ValueError(f"offload='auto' found no placement: {exc}{why}\nPass offload='cpu', 'nvme' or a "
                         "tierstate.Offload(...) explicitly, or free memory/disk.") from exc
    offload = offload_from_plan(plan)
    _log.info(
        "tierstate: offload='auto' chose Offload(gpu=%.3g, cpu=%.3g, nvme=%.3g, subgroup_numel=%s, buffer_count=%s) "
        "for %s params: "
        "%s. Budgets: host %s "
        "(%.0f%% of %s available + %s already held by the parameters), disk %s free under %s, device %s. Predicted "
        "optimizer step %.0f ms (bottleneck: %s). Rates from %s.",
        offload.gpu, offload.cpu, offload.nvme, offload.subgroup_numel, offload.buffer_count, f"{req.model.numel:,}", plan.reason, gib(budgets.host), fraction * 100,
        gib(available), gib(existing), gib(budgets.disk), nvme_root,
        f"{gib(device_bytes)} for the state" if search_device else "not searched", plan.time.optimizer * 1e3,
        plan.time.bottleneck, hw.source)
    return offload


def choose_weights(block_bytes: Sequence[int], resident_bytes: int, device, *, activation_bytes: int = 0,
                   compute_seconds_per_block: float | None = None, max_prefetch: int = 4, nvme_dir=None,
                   host_reserved_bytes: int = 0, micro_batches: int = 1,
                   activation_checkpointing: bool = False) -> WeightPlan:
    """The :class:`~.weights_plan.WeightPlan` for ``offload_weights(..., offload="auto")`` on this machine.

    Args:
        block_bytes: ``WeightStreamer.block_bytes()`` (each block in its compute dtype, in
            execution order).
        resident_bytes: ``WeightStreamer.resident_bytes()`` (parameters outside the blocks).
        device: the compute device (a ``torch.device`` or its string): ``cuda[:i]`` or ``cpu``.
        activation_bytes: one micro-batch's activations when known; with 0, half of the free
            device memory is left for them on CUDA (on CPU the host budget's headroom is).
        compute_seconds_per_block: one block's forward time, e.g. measured on the first step;
            None keeps the default prefetch depth.
        max_prefetch: the deepest prefetch to consider.
        nvme_dir: where NVMe blocks would go (its free space is the disk budget); default the
            default NVMe folder.
        host_reserved_bytes: host RAM already promised elsewhere (the optimizer's state and
            pool), taken off the host budget.
        micro_batches, activation_checkpointing: as in :func:`.weights_plan.plan_weights`.

    Budgets, read now: host RAM ``HOST_FRACTION`` (``TIERSTATE_AUTO_HOST_FRACTION``) of the
    available memory less ``host_reserved_bytes``; on CUDA ``WEIGHT_DEVICE_FRACTION`` of the free
    device memory (``DEVICE_FRACTION`` when ``activation_bytes`` is 0); the free disk under
    ``nvme_dir``. Rates: as for ``offload="auto"`` (the saved probe profile, else conservative).
    The choice is logged at INFO. Raises ValueError naming what does not fit.
    """
    import psutil

    kind = str(device).split(":")[0]
    if kind not in ("cuda", "cpu"):
        raise ValueError(f"device={device!r}: offload='auto' plans weights for a 'cuda' or 'cpu' compute device")
    if isinstance(host_reserved_bytes, bool) or not isinstance(host_reserved_bytes, int) or host_reserved_bytes < 0:
        raise ValueError(f"host_reserved_bytes={host_reserved_bytes!r}: must be an int >= 0 (bytes)")
    fraction = _host_fraction()
    available = psutil.virtual_memory().available
    host = max(0, int(available * fraction) - host_reserved_bytes)
    root = existing_ancestor(nvme_dir if nvme_dir is not None else default_nvme_root())
    st = os.statvfs(root)
    disk = st.f_bavail * st.f_frsize
    if kind == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info(torch.device(device))
        compute_budget = int(free * (WEIGHT_DEVICE_FRACTION if activation_bytes else DEVICE_FRACTION))
    else:
        compute_budget = host
    hw = _hardware()
    try:
        plan = plan_weights(block_bytes, resident_bytes=resident_bytes, compute=kind,
                            compute_memory_budget=compute_budget, host_memory_budget=host, profile=hw,
                            activation_bytes=activation_bytes, compute_seconds_per_block=compute_seconds_per_block,
                            max_prefetch=max_prefetch, disk_budget=disk, micro_batches=micro_batches,
                            activation_checkpointing=activation_checkpointing)
    except PlanError as exc:
        raise ValueError(f"offload_weights(offload='auto') found no placement: {exc}\nPass offload='cpu', 'nvme' "
                         "or a tierstate.Offload(...) explicitly, or free memory/disk.") from exc
    _log.info("tierstate: offload_weights(offload='auto'): %s Budgets: %s %s, host %s (%.0f%% of %s available - "
              "%s reserved), disk %s free under %s. Rates from %s.",
              " ".join(plan.describe()), "device" if kind == "cuda" else "host (compute)", gib(compute_budget),
              gib(host), fraction * 100, gib(available), gib(host_reserved_bytes), gib(disk), root, hw.source)
    return plan
