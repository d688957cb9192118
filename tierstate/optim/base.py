"""OffloadOptimizer: the torch.optim front shared by every tierstate optimizer.

It does bookkeeping only: parameter slots, step counts, gradient sources, scaling and
clipping, state_dict. The math is an :class:`~tierstate.optim.rules.UpdateRule`; where
state lives is a :class:`~tierstate.placement.Layout` over tiers; one step is
:func:`~tierstate.pipeline.run_subgroups`.

[Note: what optimizer.state holds]
Frameworks (Lightning, Accelerate) move every tensor found in ``optimizer.state`` to the
accelerator, so it must never hold device tensors, and it must not hold copies either (a
copy is memory the user did not ask for). ``optimizer.state[p]`` therefore holds the
``step`` tensor (CPU, float32, as torch) and, for parameters whose state lives wholly in
the host tier, views into the host arenas under torch's key names (plus ``master`` for
low-precision or accelerator parameters). State held elsewhere (the device tier, NVMe,
or a parameter straddling tiers) is read on demand, as new CPU tensors, by ``state_dict()``
and by a lookup of its key (``optimizer.state[p]["exp_avg"]``, ``.get``: see
:class:`ParamState`), never by iterating the dict.

[Note: the device tier in a step]
With ``Offload(gpu=f)`` the first ``f`` of the flat index space lives in a
:class:`~tierstate.tiers.DeviceTier` on the parameters' device. Gradients of parameters
touching it are not streamed to the host: they are read from ``param.grad`` where
backward left them. A step then (1) queues the device part's share of the global norm,
(2) computes the host part's share with the native kernel and waits for the device share
(clipping and the non-finite skip need the total before any state moves), (3) queues the
device part's update, one fused multi-tensor launch per parameter group, and (4) runs the
host and NVMe sub-groups, which on CUDA overlap (3). At most one parameter straddles the
device range and the host range; its tail is copied to the host at step time and only the
tail is uploaded afterwards, its head being updated in place on the device. A wholly
device-resident fp32 parameter is its own master, as in torch; bf16/fp16 ones keep an
fp32 master in the device tier.
"""
from __future__ import annotations

import logging
import math
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch import Tensor

from .. import host_allocator, kernels
from ..pipeline import run_subgroups
from ..placement import Layout, Offload, Segment, TierKind, plan_layout
from ..telemetry import Telemetry
from ..tiers import DeviceTier, HostTier, packed_arena
from ..tiers.device import device_tier_on_cpu_allowed
from .grad_stream import GradStream
from .rules import UpdateRule, UpdateTask

_log = logging.getLogger("tierstate")

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch build without torch.distributed: no parameter can be a DTensor
    DTensor = ()

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
NONFINITE_POLICIES = ("skip", "raise")

# GradScaler hands itself to optimizers whose step() takes ``grad_scaler`` and warns that
# this contract is being deprecated. We need that contract: our gradients live on the host,
# where GradScaler's own inf check cannot see them, so the check and its record for
# ``scaler.update()`` happen here.
warnings.filterwarnings("ignore", message="GradScaler is going to stop passing itself", category=FutureWarning)


def local_tensor(t: Tensor) -> Tensor:
    """The plain tensor the engine reads and writes for ``t``: ``t`` itself, or this rank's shard
    when ``t`` is a DTensor (parameters and gradients under FSDP2's ``fully_shard``). The shard is
    the DTensor's own storage, so writing into it updates the parameter."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _shard_key(p: Tensor) -> tuple:
    """(mesh, mesh dims that shard ``p``): ranks along those dims hold the other parts of ``p``."""
    if not isinstance(p, DTensor):
        return ()
    dims = tuple(d for d, placement in enumerate(p.placements) if placement.is_shard())
    return (p.device_mesh, dims) if dims else ()


def _shard_groups(params: list[Tensor]) -> list[tuple[tuple, list]]:
    """One ``(shard key, process groups)`` per way the trainable parameters are sharded, in
    parameter order (the same on every rank, so the collectives match); empty when none is."""
    out: dict[tuple, list] = {}
    for p in params:
        key = _shard_key(p)
        if key and key not in out:
            mesh, dims = key
            out[key] = [mesh.get_group(d) for d in dims]
    if out and any(not _shard_key(p) for p in params):
        out.setdefault((), [])  # parameters replicated on every rank: their squares count once
    return list(out.items())


@dataclass(eq=False)  # slots are compared by identity, never by their tensors' values
class _Slot:
    """One parameter of the optimizer, whatever its tier."""

    index: int  # position in the flattened param_groups, as in torch's state_dict
    param: Tensor
    group: int  # index into param_groups
    trainable: int | None  # index into the layout (None: frozen at construction)
    needs_master: bool  # an fp32 master copy exists in the tiers
    initialized: bool = False  # state exists in torch's sense (first step with a grad done)
    master_ready: bool = False  # master holds the parameter's value (see _ensure_master)
    # (sub-group, param offset) of the NVMe segments whose master the next update copies in
    master_pending: set = field(default_factory=set)
    written: bool = False  # its state regions may differ from the init values the tiers start with
    step: int = 0

    @property
    def local(self) -> Tensor:
        """What the state mirrors: the parameter, or this rank's shard of it (FSDP2)."""
        return local_tensor(self.param)


class ParamState(dict):
    """``optimizer.state[p]`` of a tierstate optimizer (see [Note: what optimizer.state holds]).

    A dict of what is held without a copy: ``step`` and views of host-tier state. A state key
    held elsewhere (NVMe, the device tier, a parameter straddling tiers) is not an entry, so
    iterating the dict (``items()``, ``values()``: what frameworks do to move tensors) never
    reads it, and ``key in state`` answers for the held entries only, like ``keys()``;
    ``state[key]`` and ``state.get(key)`` read it on demand into a new CPU tensor, a copy whose
    changes do not reach the state. A key the parameter's state does not have raises
    ``KeyError``, as torch's dict does.
    """

    def __init__(self, optimizer: "OffloadOptimizer", param: Tensor, items=()) -> None:
        super().__init__(items)
        self._optimizer = weakref.ref(optimizer)  # no cycle, and deepcopy shares it (weakrefs are atomic)
        self._param = param

    def __missing__(self, key):
        opt = self._optimizer()
        if opt is None:
            raise KeyError(key)
        return opt._read_on_demand(self._param, key)

    def get(self, key, default=None):
        try:
            return self[key]
        except KeyError:
            return default

    def __reduce__(self):  # pickled and deep-copied as the plain dict it holds
        return dict, (dict(self),)


class OffloadOptimizer(torch.optim.Optimizer):
    """Base class of tierstate's optimizers; see :class:`tierstate.AdamW` for the arguments."""

    _step_supports_amp_scaling = True
    rule: UpdateRule

    def __init__(self, params: Iterable, defaults: dict, *, offload: "str | Offload" = "cpu",
                 max_grad_norm: float | None = None, on_nonfinite: str = "skip", telemetry: bool = True,
                 step_in_backward: bool = False, nvme_dir=None) -> None:
        if not isinstance(offload, (str, Offload)):
            raise TypeError(f"offload must be 'cpu', 'nvme', 'auto' or a tierstate.Offload, got {type(offload).__name__}")
        if nvme_dir is not None:
            offload = Offload.with_nvme_dir(offload, nvme_dir)
        if isinstance(params, set):
            raise TypeError(
                "params is a set: its ordering changes between runs, and a state_dict maps state to parameters "
                "by position; pass a list (e.g. list(model.parameters()))")
        if isinstance(params, Tensor):
            raise TypeError("params argument given to the optimizer should be an iterable of Tensors or dicts, but got "
                            f"a {torch.typename(params)}; pass [tensor]")
        params = list(params)  # once: a generator read twice (offload='auto', then torch) would be empty
        if not params:
            raise ValueError(f"{type(self).__name__} got no trainable parameter: the parameter list is empty (was a "
                             "generator such as model.parameters() used up before?); pass the parameters to train")
        if isinstance(offload, str) and offload == "auto":
            offload = self._choose_auto(params, allow_device_tier=not step_in_backward)
        self.offload = Offload.from_mode(offload)
        if max_grad_norm is not None:
            if isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float)) or not max_grad_norm > 0:
                raise ValueError(f"max_grad_norm={max_grad_norm!r}: must be a positive number, or None to disable clipping")
        if on_nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"on_nonfinite={on_nonfinite!r}: must be one of {NONFINITE_POLICIES}")
        if not isinstance(step_in_backward, bool):
            raise TypeError(f"step_in_backward must be True or False, got {step_in_backward!r}")
        if step_in_backward and max_grad_norm is not None:
            raise ValueError(
                f"step_in_backward=True with max_grad_norm={max_grad_norm!r}: clipping needs the global gradient "
                "norm before the first update, which an update during backward cannot wait for; pass "
                "max_grad_norm=None or step_in_backward=False")
        if step_in_backward and torch.distributed.is_available() and torch.distributed.is_initialized() \
                and torch.distributed.get_world_size() > 1:
            # DDP and FSDP reduce gradients across ranks after the per-parameter hooks this mode
            # runs on, so an update there would use this rank's unreduced gradient.
            raise ValueError(
                f"step_in_backward=True in a process group of {torch.distributed.get_world_size()} ranks: "
                "data-parallel wrappers reduce gradients after the hooks this mode updates in, so each rank "
                "would step on its own gradient; use step_in_backward=False with DDP/FSDP")
        self.step_in_backward = step_in_backward
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.on_nonfinite = on_nonfinite
        self.telemetry = Telemetry(enabled=telemetry)
        self._configure_health()
        self._engine_ready = False
        self._backward = None
        self._slots: list[_Slot] = []
        self.skipped_steps = 0
        self._steps_taken = 0  # step() calls, for telemetry's step index
        self.last_grad_norm: float | None = None
        super().__init__(params, defaults)
        self._refuse_nothing_to_train()
        self._build_engine()
        # CPU training: keep freed host memory for reuse (see tierstate.host_allocator), the
        # policy actually in effect ("system" where the C library has no such knob).
        wanted = self.offload.host_allocator_for(self.device)
        if wanted == "retain":
            host_allocator.retain_freed_memory()
        self.host_allocator = host_allocator.policy()

    # -- construction ----------------------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        """torch's ``add_param_group``, checked before anything changes: a refused group leaves the
        optimizer as it was. ``params`` may be any iterable of tensors or of ``(name, tensor)``
        pairs (turned into a list, as torch does), not a set; a tensor may appear once in the
        whole optimizer; hyper-parameters are validated as at construction."""
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict with a 'params' entry, got {type(param_group).__name__}")
        where = f"param_groups[{len(self.param_groups)}]['params']"
        if "params" not in param_group:
            raise ValueError(f"param_groups[{len(self.param_groups)}] has no 'params' entry: give the tensors to "
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
        seen = {id(p): f"param_groups[{gi}]['params'][{i}]"
                for gi, g in enumerate(self.param_groups) for i, p in enumerate(g["params"])}
        for i, p in enumerate(tensors):
            if not isinstance(p, Tensor):
                raise TypeError(f"params[{i}] is a {type(p).__name__}; an optimizer takes torch Tensors (model.parameters())")
            if not p.is_leaf:
                raise ValueError(
                    f"params[{i}] is not a leaf tensor (it was computed from others); optimize the leaf "
                    "tensors (nn.Parameter) instead"
                )
            if p.dtype not in _SUPPORTED_DTYPES:
                raise TypeError(f"params[{i}] has dtype {p.dtype}; supported: float32, bfloat16, float16")
            # torch warns on a duplicate in one group and refuses one in two; tierstate refuses both:
            # one tensor updated twice per step with one state differs from torch's result (3e-3 after
            # 3 Adam steps), and a parameter must have one slot of state
            if id(p) in seen:
                raise ValueError(
                    f"{where}[{i}] is the same tensor as {seen[id(p)]}: a parameter may appear once in an "
                    "optimizer; remove the duplicate (e.g. tied weights: pass the shared tensor once)")
            seen[id(p)] = f"{where}[{i}]"
        merged = dict(param_group)
        for key, value in self.defaults.items():
            merged.setdefault(key, value)
        self.rule.validate(merged)
        devices = {p.device for g in self.param_groups for p in g["params"]} | {p.device for p in tensors}
        if len(devices) > 1:
            raise ValueError(
                f"params are on {len(devices)} devices ({', '.join(sorted(str(d) for d in devices))}); "
                "one optimizer takes parameters of one device (use one optimizer per device)"
            )
        for i, p in enumerate(tensors):
            if local_tensor(p).is_meta:
                raise ValueError(
                    f"params[{i}] (shape {tuple(p.shape)}) is on the meta device: it has no values to optimize, and "
                    "its state would be allocated for nothing; materialize the model first (module.to_empty("
                    "device=...) and initialize it, or load its weights) and build the optimizer after")
        super().add_param_group(param_group)
        if self._engine_ready:  # a group added after construction: re-place the state
            self._rebuild_engine()

    def _refuse_nothing_to_train(self) -> None:
        """An optimizer over no trainable parameter would step nothing, silently."""
        params = self._all_params()
        if not any(p.requires_grad for p in params):
            what = (f"all {len(params)} parameters have requires_grad=False" if params
                    else "its parameter groups are empty (was a generator passed twice, or a filter left nothing?)")
            raise ValueError(
                f"{type(self).__name__} got no trainable parameter: {what}; pass the parameters to train "
                "(e.g. [p for p in model.parameters() if p.requires_grad]) and unfreeze them first")

    def _configure_health(self) -> None:
        """Peaks from a saved `tierstate probe` profile (for achieved-vs-peak and the slow-tier
        warning) and the host-RAM warning at 90 % of this machine's RAM."""
        from ..placement.probe import load_profile, peaks_from_profile

        try:
            profile = load_profile()
        except (OSError, ValueError) as exc:  # a stale or broken profile must not stop training
            _log.warning("tierstate: hardware profile ignored (%s)", exc)
            profile = None
        if profile is not None:
            self.telemetry.set_peaks(peaks_from_profile(profile))
        import psutil

        self.telemetry.set_host_budget(psutil.virtual_memory().total)
        self._watched_dirs: set = set()  # filled once the NVMe tier has made its folders

    @staticmethod
    def _choose_auto(params: list, allow_device_tier: bool = True) -> Offload:
        try:
            from ..placement.auto import choose_offload
        except ImportError as exc:
            raise ValueError(
                "offload='auto' needs the placement planner (tierstate.placement.auto), which is not "
                f"available in this build ({exc}); pass offload='cpu' or 'nvme' or a tierstate.Offload(...)"
            ) from exc
        return choose_offload(params, allow_device_tier=allow_device_tier)

    def _all_params(self) -> list[Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _build_engine(self) -> None:
        params = self._all_params()
        self.device = params[0].device if params else torch.device("cpu")
        on_accel = self.device.type != "cpu"
        if self.offload.gpu > 0 and not on_accel and not device_tier_on_cpu_allowed():
            raise ValueError(
                f"Offload(gpu={self.offload.gpu}) needs parameters on an accelerator; these are on {self.device}: "
                "move the model to the accelerator before building the optimizer, or keep the state in host RAM "
                "and on NVMe, e.g. Offload(cpu=0.6, nvme=0.4)")
        if self.offload.gpu > 0 and self.step_in_backward:
            raise ValueError(f"step_in_backward=True with Offload(gpu={self.offload.gpu}): the update during backward "
                             "runs on the host tiers only; use Offload(gpu=0, ...) or step_in_backward=False")
        slots, trainable = [], []
        for gi, g in enumerate(self.param_groups):
            for p in g["params"]:
                # torch's Adagrad creates state for every parameter, frozen or not, so eager rules place all
                t = len(trainable) if p.requires_grad or self.rule.eager_state else None
                if t is not None:
                    trainable.append(p)
                slots.append(_Slot(len(slots), p, gi, t, needs_master=on_accel or p.dtype != torch.float32))
        self._slots = slots
        self._trainable = trainable
        self._shard_groups = _shard_groups(trainable)
        self._slot_of = {id(s.param): s for s in slots}  # parameters are hashed by identity, as in torch
        self._slot_by_trainable = {s.trainable: s for s in slots if s.trainable is not None}
        fractions = {TierKind.DEVICE: self.offload.gpu, TierKind.HOST: self.offload.cpu, TierKind.NVME: self.offload.nvme}
        stateless = not any(spec for g in self.param_groups for spec in self.rule.state_specs(g)) and not any(
            s.needs_master for s in slots if s.trainable is not None)
        if stateless and fractions[TierKind.NVME] > 0:
            # SGD without momentum on fp32 host parameters stores nothing per element: an NVMe tier
            # would hold no file, so its share is placed in the (empty) host tier instead
            fractions[TierKind.HOST] += fractions[TierKind.NVME]
            fractions[TierKind.NVME] = 0.0
        self.layout: Layout = plan_layout([local_tensor(p).numel() for p in trainable], fractions,
                                          self.offload.subgroup_numel)
        if self.offload.gpu > 0 and self._shard_groups:
            raise ValueError(f"Offload(gpu={self.offload.gpu}) with sharded (FSDP2 DTensor) parameters is not supported; "
                             "keep the state on the host tiers, e.g. Offload(cpu=0.6, nvme=0.4)")
        self._device_numel = self._device_heads()
        self._device_subgroups = frozenset(sg.index for sg in self.layout.subgroups if sg.tier is TierKind.DEVICE)
        for s in slots:  # wholly on the device and fp32: the parameter is its own master, as in torch
            if self._device_numel.get(s.trainable, -1) == s.param.numel() and s.param.dtype == torch.float32:
                s.needs_master = False
        specs = {}
        for g in self.param_groups:
            for spec in self.rule.state_specs(g):
                specs.setdefault(spec.name, spec)
        self._specs = specs
        dtypes = {name: (self.offload.moment_dtype if spec.moment else torch.float32) for name, spec in specs.items()}
        inits = {name: spec.init for name, spec in specs.items()}
        if any(s.needs_master for s in slots if s.trainable is not None):
            dtypes["master"] = torch.float32
        pin = self.offload.pin_memory and self.device.type == "cuda"
        self.tiers: dict[TierKind, Any] = {}
        if self.layout.tier_numel[TierKind.DEVICE] > 0:
            # no master arena on the device unless a parameter there has one (fp32 ones are their own)
            master_here = any(self._slot_by_trainable[t].needs_master for t in self._device_numel)
            self.tiers[TierKind.DEVICE] = DeviceTier(
                self.layout, {k: d for k, d in dtypes.items() if k != "master" or master_here}, inits, self.device)
        if self.layout.tier_numel[TierKind.HOST] > 0:
            self.tiers[TierKind.HOST] = HostTier(self.layout, dtypes, inits, pin_memory=pin)
        if self.layout.tier_numel[TierKind.NVME] > 0:
            from ..tiers.nvme import NvmeTier  # noqa: PLC0415 - the NVMe tier loads the I/O engine
            self.tiers[TierKind.NVME] = NvmeTier(self.layout, dtypes, inits, self.offload, telemetry=self.telemetry)
            for folder in self.offload.nvme_dirs:  # warn when a drive of the tier nearly fills up
                if folder not in self._watched_dirs and folder.is_dir():
                    self.telemetry.watch_disk(folder)
                    self._watched_dirs.add(folder)
        self._state_dtypes = dtypes
        streaming = self.offload.grad_streaming
        if streaming is None:
            streaming = self.device.type == "cuda"
        if any(isinstance(p, DTensor) for p in trainable):
            # FSDP2 assigns each sharded gradient after its reduce-scatter instead of accumulating
            # it, so the post-accumulate-grad hooks the stream relies on never fire: read .grad.
            streaming = False
        # parameters touching the device tier keep their gradients on the device (not streamed)
        streamed = [t for t in range(len(trainable)) if t not in self._device_numel]
        self._stream_index = {t: k for k, t in enumerate(streamed)}
        self._grads = GradStream([trainable[t] for t in streamed], keep_device_grads=self.offload.keep_device_grads,
                                 pin_memory=pin, telemetry=self.telemetry) if streaming and streamed else None
        self._staging: dict[int, Tensor] = {}  # CUDA: pinned low-precision weights, written by the kernels
        self._staging_arena: Tensor | None = None
        if self.device.type == "cuda":
            low = [(i, local_tensor(p)) for i, p in enumerate(trainable)
                   if p.dtype != torch.float32 and self._device_numel.get(i, 0) < local_tensor(p).numel()]
            self._staging_arena, views = packed_arena([p for _, p in low], pin_memory=True, zero=False)
            self._staging = {i: v for (i, _), v in zip(low, views)}
        self._upload_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._upload_done = None
        if self.rule.eager_state:
            for s in slots:
                if s.trainable is not None:
                    self._init_state(s)
        if self.step_in_backward and trainable:
            from .backward_update import BackwardUpdater  # noqa: PLC0415 - only this mode needs it

            self._backward = BackwardUpdater(self)
            self._backward.plan_next()
        self._engine_ready = True

    def _rebuild_engine(self) -> None:
        saved = {id(s.param): self._export_state(s) for s in self._slots if s.initialized}
        masters = {id(s.param): s.master_ready for s in self._slots}
        self._close_engine()
        self._build_engine()
        for s in self._slots:
            if id(s.param) in saved:
                self._import_state(s, saved[id(s.param)], master_ready=masters[id(s.param)])

    def _close_engine(self) -> None:
        if getattr(self, "_backward", None) is not None:
            self._backward.close()
            self._backward = None
        if getattr(self, "_grads", None) is not None:
            self._grads.close()
        for tier in getattr(self, "tiers", {}).values():
            tier.close()
        self.tiers = {}

    def close(self) -> None:
        """Release host buffers, files and hooks now (also done when the optimizer is collected)."""
        self._close_engine()

    def __del__(self) -> None:  # files of the NVMe tier must not outlive the run
        if "tiers" not in self.__dict__:  # a forwarding wrapper (LightningOptimizer) owns no engine
            return
        try:
            self._close_engine()
        except Exception:  # noqa: BLE001 - interpreter shutdown: nothing left to report to
            pass

    # -- state views -----------------------------------------------------------------------------
    def _segments(self, s: _Slot) -> list[Segment]:
        return self.layout.segments_of(s.trainable) if s.trainable is not None else []

    def _host_view(self, s: _Slot, key: str) -> Tensor | None:
        """The host-tier view of a parameter's state ``key`` (shaped like it), if it has one."""
        host = self.tiers.get(TierKind.HOST)
        if host is None or s.trainable is None or key not in host.arenas:
            return None
        if s.local.numel() and self.layout.tier_of_param(s.trainable) is not TierKind.HOST:
            return None
        start = self.layout.param_starts[s.trainable]
        return host.flat_range(key, start, s.local.numel()).view(s.local.shape)

    def _state_keys(self, s: _Slot) -> list[str]:
        keys = [spec.name for spec in self.rule.state_specs(self.param_groups[s.group])]
        return keys + (["master"] if s.needs_master else [])

    def _publish(self, s: _Slot) -> None:
        """Fill ``optimizer.state[p]`` of a slot (see the note at the top of the file).

        The views stay valid as long as the tiers do, so a step only refreshes ``step``
        (:meth:`_publish_step`); this runs when state starts existing or is loaded.
        """
        if not self.rule.has_step and not self._state_keys(s):
            return  # torch keeps no entry for a parameter without state (SGD without momentum)
        st = self.state.get(s.param)
        if not isinstance(st, ParamState):
            st = self.state[s.param] = ParamState(self, s.param, st or {})
        if self.rule.has_step:
            st["step"] = torch.tensor(float(s.step), dtype=torch.float32)
        for key in self._state_keys(s):
            if key == "master" and not s.master_ready:
                continue  # filled from the parameter at its first step
            view = self._host_view(s, key)
            if view is not None:
                st[key] = view

    def _read_on_demand(self, param: Tensor, key: str) -> Tensor:
        """``optimizer.state[param][key]`` for a key not held in the dict: a CPU copy read from the
        tiers. KeyError where the parameter has no such state (as torch's dict)."""
        s = self._slot_of.get(id(param))
        if s is None or s.param is not param or s.trainable is None or not s.initialized \
                or key not in self._state_keys(s) or (key == "master" and not s.master_ready):
            raise KeyError(key)
        self._before_state_access()
        return self._read_state(s, key)

    def _publish_step(self, s: _Slot) -> None:
        if self.rule.has_step:
            self.state[s.param]["step"].fill_(float(s.step))  # in place, as torch increments it

    def _read_state(self, s: _Slot, key: str) -> Tensor:
        """A parameter's state ``key`` as a CPU tensor shaped like the parameter."""
        view = self._host_view(s, key)
        if view is not None:
            return view
        return self._read_flat(s, key).view(s.local.shape)

    def _read_flat(self, s: _Slot, key: str, first: int = 0) -> Tensor:
        """A flat CPU copy of state ``key`` of parameter ``s`` from element ``first`` on, read
        segment by segment from whichever tiers hold them."""
        out = torch.empty(s.local.numel() - first, dtype=self._state_dtypes[key])
        for seg in self._segments(s):
            if seg.param_offset < first:
                continue
            sg = self.layout.subgroups[seg.subgroup]
            lo = seg.param_offset - first
            out[lo: lo + seg.numel] = self.tiers[sg.tier].read_range(key, sg, seg.subgroup_offset, seg.numel)
        return out

    def _write_state(self, s: _Slot, key: str, value: Tensor) -> None:
        flat = value.detach().reshape(-1).to("cpu")
        for seg in self._segments(s):
            sg = self.layout.subgroups[seg.subgroup]
            tier = self.tiers[sg.tier]
            tier.write_range(key, sg, seg.subgroup_offset, flat[seg.param_offset: seg.param_offset + seg.numel])

    def _reset_to_init(self, s: _Slot, skip: dict | None = None) -> None:
        """Write the init value of each state key (except those given in ``skip``) of a slot
        whose regions were written before; the tiers start at the init values otherwise."""
        if not s.written:
            return
        for spec in self.rule.state_specs(self.param_groups[s.group]):
            if skip is not None and skip.get(spec.name) is not None:
                continue
            # stride 0: no parameter-sized temporary (glibc would keep the freed heap as RSS)
            fill = torch.full((1,), spec.init, dtype=self._state_dtypes[spec.name]).expand(s.local.numel())
            self._write_state(s, spec.name, fill)

    def _init_state(self, s: _Slot) -> None:
        """First step of a parameter with a gradient: its state starts existing (torch semantics)."""
        self._reset_to_init(s)
        s.written = False
        s.initialized = True
        s.step = 0
        self._publish(s)

    def _ensure_master(self, s: _Slot) -> None:
        """Fill a slot's master from its parameter, before its first update.

        An NVMe piece is not written here: written through the pool, parameter by parameter,
        every record would be read, filled and written back once before the step streams it
        again, doubling the first step's I/O (a 13-record model with a 4-buffer pool: 21 reads
        and 17 writes in step 0 against 9 and 8 afterwards). Its update copies it into the
        record the step holds anyway (:meth:`_update_segment`); anything that reads the state
        before that goes through :meth:`_before_state_access`, which writes what is pending."""
        if s.needs_master and not s.master_ready:
            flat = s.local.detach().reshape(-1)
            for seg in self._segments(s):  # segment by segment: temporaries stay sub-group sized
                if self.layout.subgroups[seg.subgroup].tier is TierKind.NVME:
                    s.master_pending.add((seg.subgroup, seg.param_offset))
                else:
                    self._write_master_piece(flat, seg)
            s.master_ready = True

    def _write_master_piece(self, flat: Tensor, seg: Segment) -> None:
        """Write the piece ``seg`` of a parameter's flat value into its sub-group's master."""
        sg = self.layout.subgroups[seg.subgroup]
        piece = flat[seg.param_offset: seg.param_offset + seg.numel]
        if sg.tier is not TierKind.DEVICE:  # the device tier copies straight from the parameter
            piece = piece.to("cpu", torch.float32)
        self.tiers[sg.tier].write_range("master", sg, seg.subgroup_offset, piece)

    def _write_pending_masters(self) -> None:
        """Write the master pieces :meth:`_ensure_master` left for updates that have not run."""
        for s in self._slots:
            if not s.master_pending:
                continue
            flat = s.local.detach().reshape(-1)
            for seg in self._segments(s):
                if (seg.subgroup, seg.param_offset) in s.master_pending:
                    self._write_master_piece(flat, seg)
            s.master_pending.clear()

    def _export_state(self, s: _Slot) -> dict:
        out = {key: self._read_state(s, key) for key in self._state_keys(s) if key != "master" or s.master_ready}
        if self.rule.has_step:
            out["step"] = torch.tensor(float(s.step), dtype=torch.float32)
        return out

    def _import_state(self, s: _Slot, state: dict, master_ready: bool | None = None) -> None:
        if not s.initialized:
            # Only keys the state dict lacks start from their init value: the given ones may be
            # this optimizer's own views (DCP loads in place), which a reset would wipe first.
            self._reset_to_init(s, skip=state)
            s.initialized, s.step, s.written = True, 0, True
        for key in self._state_keys(s):
            if key in state and state[key] is not None:
                value = state[key]
                if not isinstance(value, Tensor) or value.numel() != s.local.numel():
                    got = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
                    raise ValueError(
                        f"load_state_dict: state {key!r} of parameter {s.index} has shape {got}, "
                        f"the parameter has shape {tuple(s.local.shape)}"
                    )
                self._write_state(s, key, value)
        if "step" in state:
            s.step = int(float(state["step"]))
        s.master_ready = ("master" in state) if master_ready is None else master_ready
        self._publish(s)

    # -- the step --------------------------------------------------------------------------------
    def _host_grad(self, s: _Slot) -> Tensor | None:
        if self._grads is not None and (k := self._stream_index.get(s.trainable)) is not None:
            return self._grads.grad(k)
        g = s.param.grad
        if g is None:
            return None
        g = local_tensor(g)
        if g.is_sparse:
            raise TypeError("tierstate optimizers do not support sparse gradients (use dense embeddings)")
        if g.device.type != "cpu":
            with self.telemetry.phase("grad_transfer"):
                g = g.detach().to("cpu")
            self.telemetry.add_bytes("device", "d2h", g.numel() * g.element_size())
        return g.detach().reshape(-1)

    def _scaler_inputs(self, grad_scaler) -> tuple[float, bool, dict | None, bool]:
        """(inverse loss scale to apply, inf already found, the scaler's per-optimizer record,
        whether a loss scaler manages this step: then an inf skips silently, the scaler backs off)."""
        if grad_scaler is None and getattr(self, "grad_scale", None) is not None:
            # GradScaler's attribute protocol (used when a wrapper hides our grad_scaler argument)
            return 1.0 / float(self.grad_scale), bool(float(getattr(self, "found_inf", 0.0))), None, True
        if grad_scaler is None or not grad_scaler.is_enabled():
            return 1.0, False, None, False
        from torch.amp.grad_scaler import OptState
        record = grad_scaler._per_optimizer_states[id(self)]
        # Gradients read from param.grad were unscaled in place by scaler.unscale_(opt);
        # host copies made by the gradient stream never were.
        if record["stage"] is OptState.UNSCALED and self._grads is None:
            prior = any(bool(v.item()) for v in record["found_inf_per_device"].values())
            return 1.0, prior, record, True
        return 1.0 / grad_scaler.get_scale(), False, record, True

    def _note_skip(self, why: str) -> None:
        self.skipped_steps += 1
        self.telemetry.count("skipped_steps")
        _log.warning("tierstate: step skipped (%s); all optimizer state left untouched (%d skipped so far)",
                     why, self.skipped_steps)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, grad_scaler=None):
        """One optimizer step over every parameter that has a gradient.

        Args:
            closure: re-evaluates the model and returns the loss (torch semantics).
            grad_scaler: passed by ``torch.amp.GradScaler.step``; do not pass it yourself.

        What an I/O failure of the NVMe tier leaves (see [Note: what a failed I/O leaves] in
        :mod:`tierstate.tiers.nvme`):

        - a failed *write* (``DiskFullError`` on a full or thinly provisioned disk, EIO): the
          step completes in memory, parameters and state exactly as after it; the error
          (path, errno) is raised at the end of ``step()``. The records that could not be
          written stay in RAM, ``state_dict()`` and ``save_optimizer`` read them there, and the
          next ``step()`` writes them first: while they still cannot be written it raises
          before changing anything (parameters and state exactly as before it), and once
          the cause is fixed it proceeds. Nothing is sticky.
        - a failed *read* (EIO, a short read, a state file truncated or changed by another
          process, a CRC-32C mismatch): raises :class:`tierstate.io.StateLostError`. That
          record's state is lost, and parameters updated earlier in the same step stay
          updated; every later ``step()`` and read of it raise the same until a checkpoint is
          loaded (``tierstate.load_optimizer`` or ``load_state_dict``).
        - with ``step_in_backward=True`` the updates run during backward, so a step cannot
          refuse to start: a failed write is raised at the end of ``step()`` as above, and the
          record is written again when it is next evicted (each step updates it).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        tel = self.telemetry
        tel.begin_step(self._steps_taken)
        workers = tel.enabled and tel.tracing  # one trace lane per kernel thread, only while tracing
        if workers:
            kernels.record_worker_spans(True)
        try:
            self._step(tel, grad_scaler)
            nvme = self.tiers.get(TierKind.NVME)
            failed = nvme.take_write_errors() if nvme is not None else None
            if failed is not None:  # the step is complete in memory; the records wait in RAM
                raise failed
        finally:
            if workers:
                for thread, start, end in kernels.drain_worker_spans():
                    tel.add_phase_time("cpu_update", end - start, lane=f"cpu-worker-{thread}", start=start)
                kernels.record_worker_spans(False)
            self._last_stats = tel.end_step()
        return loss

    def _step(self, tel, grad_scaler) -> None:
        nvme = self.tiers.get(TierKind.NVME)
        backward_open = self._backward is not None and self._backward.open
        if nvme is not None and not backward_open:
            nvme.settle()  # earlier failed writes retried, or raise with nothing changed yet
        self._steps_taken += 1
        if self._upload_done is not None:  # the staging buffers are about to be rewritten
            with tel.phase("device_stall"):
                self._upload_done.synchronize()
        if self._grads is not None:
            with tel.phase("grad_wait"):
                self._grads.wait()
        backward = self._backward if self._backward is not None and self._backward.open else None
        if backward is not None:
            backward.finish()
        else:
            self._follow_replaced_params()
            self._adopt_new_trainables()
        active = [(s, g) for s in self._slots if s.trainable is not None and (g := self._grad_of(s)) is not None]
        inv_scale, prior_inf, record, scaled = self._scaler_inputs(grad_scaler)
        if backward is not None:
            self._finish_backward_step(tel, backward, active, scaled)
            return

        grad_scale = inv_scale
        host_grads, device_grads = self._grads_by_tier(active)
        device_scale, device_prior_inf = self._device_scaler_inputs(record, inv_scale) if device_grads else (1.0, False)
        device_grad_scale = device_scale
        if self._shard_groups:  # every rank takes part, with gradients or not, or the others wait forever
            with tel.phase("grad_norm"):  # (no device tier with sharded parameters: refused at construction)
                sumsq, prior_inf = self._sumsq_over_shards(active, inv_scale, prior_inf)
        elif active:  # one read of the gradients gives both the global norm and the non-finite check
            with tel.phase("grad_norm"):
                device_sumsq = self._device_sumsq(device_grads, device_scale)  # queued first: overlaps the host part
                sumsq = sum(kernels.grad_sumsq(g[first:], inv_scale) for g, first in host_grads.values())
                if device_grads:
                    sumsq += float(device_sumsq)
            prior_inf = prior_inf or device_prior_inf
        if active:
            finite = math.isfinite(sumsq) and not prior_inf
            if record is not None:
                record["found_inf_per_device"] = {torch.device("cpu"): torch.tensor([0.0 if finite else 1.0])}
            if not finite:
                if scaled:
                    self.telemetry.count("skipped_steps")
                    self.skipped_steps += 1
                    return  # GradScaler lowers its scale in update(); nothing to say
                if self.on_nonfinite == "raise":
                    bad = [s.index for s, g in active if not bool(torch.isfinite(g).all())]
                    raise FloatingPointError(
                        f"non-finite gradient in parameter(s) {bad[:8]} (inf or nan); pass on_nonfinite='skip' "
                        "to skip such steps, or use torch.amp.GradScaler"
                    )
                self._note_skip(f"non-finite gradient, total squared norm {sumsq}")
                return
            norm = math.sqrt(sumsq)
            self.last_grad_norm = norm
            if sumsq == 0.0 and not self.state and all(
                    float(g["lr"]) == 0.0 and self.rule.zero_step_is_noop(g) for g in self.param_groups):
                # torch.distributed.checkpoint's _init_optim_state: a step with zero gradients and
                # lr 0 only to make state exist. Its outcome is known (state at init, step 1), so
                # no sub-group is streamed through the tiers for it.
                for s, _ in active:
                    self._init_state(s)
                    s.step = 1
                    self._publish_step(s)
                return
            if self.max_grad_norm is not None:
                # torch.nn.utils.clip_grad_norm_: coefficient max_norm / (norm + 1e-6), clamped to 1
                clip = min(1.0, self.max_grad_norm / (norm + 1e-6))
                grad_scale, device_grad_scale = inv_scale * clip, device_scale * clip

        grads: dict[int, Tensor] = {}
        fresh: set[int] = set()
        for s, g in active:
            host = host_grads.get(s.trainable)
            if self._prepare_slot(s, None if host is None else host[0][host[1]:]):
                fresh.add(s.trainable)
            if host is not None:
                grads[s.trainable] = host[0]
        if device_grads:
            self._launch_device_part(tel, device_grads, fresh, device_grad_scale)
        work = self._work(grads, skip=self._device_subgroups)

        def update(seg: Segment, views) -> None:
            self._update_segment(seg, views, grads[seg.param_index], first_step=seg.param_index in fresh,
                                 grad_scale=grad_scale)

        run_subgroups(work, self.tiers, update, tel)
        self._after_update(tel, [s for s, _ in active], fresh)

    def _prepare_slot(self, s: _Slot, grad: Tensor | None) -> bool:
        """Make a parameter ready for its update (state, master, step count); True if its state is new.

        ``grad``: the part of its gradient the host kernels read (None: it is wholly in the device tier).
        """
        fresh = not s.initialized
        if fresh:
            self._init_state(s)
        self._ensure_master(s)
        s.written = True
        s.step += 1
        if grad is not None:
            read, written = self._kernel_traffic(s, grad)
            self.telemetry.add_bytes("host", "read", read)
            self.telemetry.add_bytes("host", "write", written)
        return fresh

    def _work(self, grads: dict, skip: set[int] = frozenset()) -> list[tuple]:
        """(sub-group, its segments with a gradient) for every sub-group not in ``skip``, in layout order."""
        work = []
        for sg in self.layout.subgroups:
            if sg.index in skip:
                continue
            segs = [seg for seg in sg.segments if seg.param_index in grads]
            if segs:
                work.append((sg, segs))
        return work

    def _update_segment(self, seg: Segment, views, grad: Tensor, *, first_step: bool, grad_scale: float) -> None:
        """One fused kernel call: the piece ``seg`` of a parameter, given its sub-group's state views."""
        s = self._slot_by_trainable[seg.param_index]
        lo, hi = seg.subgroup_offset, seg.subgroup_offset + seg.numel
        plo, phi = seg.param_offset, seg.param_offset + seg.numel
        if s.master_pending and (seg.subgroup, plo) in s.master_pending:  # see _ensure_master
            views["master"][lo:hi].copy_(s.local.detach().reshape(-1)[plo:phi])
            s.master_pending.discard((seg.subgroup, plo))
        state = {k: v[lo:hi] for k, v in views.items() if k != "master"}
        weight, weight_out = self._weight_views(s, views, lo, hi, plo, phi)
        self.rule.update(weight=weight, grad=grad[plo:phi], state=state, weight_out=weight_out,
                         group=self.param_groups[s.group], step=s.step, first_step=first_step, grad_scale=grad_scale)

    def _after_update(self, tel, slots: list[_Slot], fresh: set[int]) -> None:
        """Publish the stepped parameters' state, upload their weights (CUDA) and set the gauges."""
        for s in slots:
            if s.trainable in fresh or s.needs_master and "master" not in self.state[s.param]:
                self._publish(s)
            else:
                self._publish_step(s)
        if self.device.type == "cuda":
            self._upload(tel, slots)
        for tier_name, nbytes in self.tier_bytes().items():
            tel.set_gauge(f"tier_bytes/{tier_name}", nbytes)
        if self.device.type == "cuda":
            tel.set_gauge("pinned_bytes", self._pinned_bytes())
            tel.set_gauge("device_mem", torch.cuda.memory_allocated(self.device))

    def _finish_backward_step(self, tel, backward, active: list, scaled: bool) -> None:
        """step() after a backward whose sub-groups were (partly) updated by the
        :class:`~tierstate.optim.backward_update.BackwardUpdater`: update what is left
        (sub-groups with a parameter that got no gradient during backward, or whose gradient
        is final only at its end), publish, and plan the next backward's I/O.

        Every parameter ends either wholly updated or untouched: one whose gradient the worker
        took (and found finite) gets its remaining pieces here even when a later gradient was
        non-finite; then this raises ``FloatingPointError`` naming the non-finite ones.
        """
        bad = list(backward.nonfinite)
        try:
            if scaled:
                raise ValueError("step_in_backward=True does not work with a GradScaler: unscaling and the inf "
                                 "check need every gradient before the first update; use bf16 (no scaler) or "
                                 "step_in_backward=False")
            late = [s.index for s in self._slots if s.trainable is None and s.param.requires_grad
                    and s.param.grad is not None]
            if late:
                raise RuntimeError(
                    f"step_in_backward=True: parameter(s) {late[:8]} were frozen when the optimizer was built and "
                    "now have gradients; their state cannot be placed while backward updates run. Build the "
                    "optimizer after unfreezing them, or use step_in_backward=False")
            grads = dict(backward.grads)
            fresh = set(backward.fresh)
            extra = [(s, g) for s, g in active if s.trainable not in backward.prepared]
            sumsq = backward.sumsq
            if not bad and extra:  # gradients that reached step() without passing a hook (set by hand)
                with tel.phase("grad_norm"):
                    for s, g in extra:
                        value = kernels.grad_sumsq(g)
                        if math.isfinite(value):
                            sumsq += value
                        else:
                            bad.append(s.index)
            if not bad:
                self.last_grad_norm = math.sqrt(sumsq)
                for s, g in extra:
                    if self._prepare_slot(s, g):
                        fresh.add(s.trainable)
                    grads[s.trainable] = g
            work = self._work(grads, skip={sg.index for sg in backward.done})

            def update(seg: Segment, views) -> None:
                self._update_segment(seg, views, grads[seg.param_index], first_step=seg.param_index in fresh,
                                     grad_scale=1.0)

            run_subgroups(work, self.tiers, update, tel)
            self._after_update(tel, [self._slot_by_trainable[t] for t in grads], fresh)
        finally:
            backward.close_cycle()
        backward.plan_next()
        if bad:
            self.skipped_steps += 1
            self.telemetry.count("skipped_steps")
            raise FloatingPointError(
                f"non-finite gradient in parameter(s) {bad[:8]} (inf or nan) with step_in_backward=True: parameters "
                "whose gradients were handed over before it are updated, the others are untouched (this mode "
                "cannot skip a whole step; use step_in_backward=False for on_nonfinite='skip')")

    # -- the device tier (see [Note: the device tier in a step]) ---------------------------------------
    def _device_heads(self) -> dict[int, int]:
        """{trainable index: how many of its first elements lie in the device tier}, for those with any.

        The device range comes first in the flat index space, so a parameter's device part is
        always its head."""
        heads: dict[int, int] = {}
        for sg in self.layout.subgroups:
            if sg.tier is TierKind.DEVICE:
                for seg in sg.segments:
                    heads[seg.param_index] = heads.get(seg.param_index, 0) + seg.numel
        return heads

    def _grad_of(self, s: _Slot) -> Tensor | None:
        """The flat gradient a step reads: ``param.grad`` where it lies for a parameter touching
        the device tier, else the host gradient (:meth:`_host_grad`)."""
        if s.trainable not in self._device_numel:
            return self._host_grad(s)
        g = s.param.grad
        if g is None:
            return None
        if g.is_sparse:
            raise TypeError("tierstate optimizers do not support sparse gradients (use dense embeddings)")
        return g.detach().reshape(-1)

    def _grads_by_tier(self, active: list) -> tuple[dict[int, tuple[Tensor, int]], dict[int, Tensor]]:
        """Split the gradients of a step between the host kernels and the device tier.

        Returns ``{trainable: (host gradient indexed like the parameter, first element the
        host part reads)}`` and ``{trainable: device gradient}``. The one parameter straddling
        the device range gets a host buffer of its full size of which only the tail is copied
        (and read); the head is never touched.
        """
        host: dict[int, tuple[Tensor, int]] = {}
        device: dict[int, Tensor] = {}
        for s, g in active:
            head = self._device_numel.get(s.trainable, 0)
            if head == 0:
                host[s.trainable] = (g, 0)
                continue
            device[s.trainable] = g
            if head == g.numel():
                continue
            if g.device.type != "cpu":
                tail = g[head:]
                with self.telemetry.phase("grad_transfer"):
                    buffer = torch.empty(g.numel(), dtype=g.dtype)
                    buffer[head:].copy_(tail)
                self.telemetry.add_bytes("device", "d2h", tail.numel() * tail.element_size())
                g = buffer
            host[s.trainable] = (g, head)
        return host, device

    @staticmethod
    def _device_scaler_inputs(record: dict | None, inv_scale: float) -> tuple[float, bool]:
        """(inverse loss scale for the gradients left in ``param.grad``, inf already found in them).

        ``scaler.unscale_(opt)`` unscales in place what it finds in ``param.grad``: with the
        device tier that includes the device part's gradients even when the host part's were
        streamed away (and so are still scaled)."""
        if record is None:
            return inv_scale, False
        from torch.amp.grad_scaler import OptState
        if record["stage"] is OptState.UNSCALED:
            return 1.0, any(bool(v.item()) for v in record["found_inf_per_device"].values())
        return inv_scale, False

    def _device_sumsq(self, device_grads: dict[int, Tensor], scale: float) -> "Tensor | float":
        """The device part's sum of squares of ``grad * scale``, in float64, as a tensor on the device.

        Queued, not waited for (on CUDA): the caller reads it after the host part's sum. inf/nan propagate.
        """
        heads = [g[: self._device_numel[t]] for t, g in device_grads.items()]
        if not heads:
            return 0.0
        norms = torch.stack(torch._foreach_norm(heads, 2, dtype=torch.float64))
        return norms.square().sum() * (scale * scale)

    def _launch_device_part(self, tel, device_grads: dict[int, Tensor], fresh: set[int], grad_scale: float) -> None:
        """Queue the update of every device-tier segment with a gradient: one
        :meth:`~tierstate.optim.rules.UpdateRule.update_on_device` call per parameter group.

        On CUDA this returns once the kernels are queued on the current stream, so the host
        part runs meanwhile; the next forward is queued behind them on that stream."""
        tier = self.tiers[TierKind.DEVICE]
        tasks: dict[int, list[UpdateTask]] = {}
        held = []
        for sg in self.layout.subgroups:
            if sg.tier is not TierKind.DEVICE:
                continue
            segs = [seg for seg in sg.segments if seg.param_index in device_grads]
            if not segs:
                continue
            views = tier.acquire(sg)
            held.append(sg)
            for seg in segs:
                s = self._slot_by_trainable[seg.param_index]
                lo, hi = seg.subgroup_offset, seg.subgroup_offset + seg.numel
                plo, phi = seg.param_offset, seg.param_offset + seg.numel
                piece = s.param.data.view(-1)[plo:phi]
                weight, weight_out = (views["master"][lo:hi], piece) if s.needs_master else (piece, None)
                state = {k: v[lo:hi] for k, v in views.items() if k != "master"}
                tasks.setdefault(s.group, []).append(UpdateTask(
                    weight, device_grads[seg.param_index][plo:phi], state, weight_out, s.step,
                    seg.param_index in fresh))
        try:
            with tel.phase("device_update"):
                for group_index, group_tasks in tasks.items():
                    self.rule.update_on_device(group_tasks, group=self.param_groups[group_index],
                                               grad_scale=grad_scale)
        finally:
            for sg in held:
                tier.release(sg, dirty=True)

    def _pinned_bytes(self) -> int:
        """Page-locked host memory this optimizer holds (arenas, gradient arena, staging, NVMe pool)."""
        tensors = [t for tier in self.tiers.values() for t in getattr(tier, "arenas", {}).values()]
        tensors += [self._grads.arena] if self._grads is not None else []
        tensors += [self._staging_arena] if self._staging_arena is not None else []
        total = sum(t.untyped_storage().nbytes() for t in tensors if t.is_pinned())
        nvme = self.tiers.get(TierKind.NVME)
        return total + (nvme.pool_nbytes if nvme is not None and nvme.pin_memory else 0)

    def _kernel_traffic(self, s: _Slot, grad: Tensor) -> tuple[int, int]:
        """Host-memory bytes the update of (the host part of) one parameter reads and writes (one fused pass)."""
        n = grad.numel()
        state = sum(self._state_dtypes[k].itemsize for k in self._state_keys(s) if k != "master")
        weight = 4 if s.needs_master else s.local.element_size()  # the master, or the fp32 param itself
        out = s.local.element_size() if s.needs_master and s.param.dtype != torch.float32 else 0
        return n * (grad.element_size() + state + weight), n * (state + weight + out)

    def _weight_views(self, s: _Slot, views, lo: int, hi: int, plo: int, phi: int) -> tuple[Tensor, Tensor | None]:
        """(fp32 weight the kernel updates, low-precision output it also writes, or None)."""
        if not s.needs_master:  # an fp32 parameter in host memory is its own master
            return s.local.data.view(-1)[plo:phi], None
        weight = views["master"][lo:hi]
        if s.param.dtype == torch.float32:
            return weight, None  # uploaded from the master itself
        if self.device.type == "cpu":
            return weight, s.local.data.view(-1)[plo:phi]
        return weight, self._staging[s.trainable][plo:phi]

    def _upload(self, tel, slots: list[_Slot]) -> None:
        """CUDA: copy updated weights to the device on a side stream; the compute stream waits for it."""
        with tel.phase("weight_upload"), torch.cuda.stream(self._upload_stream):
            for s in slots:
                head = self._device_numel.get(s.trainable, 0)  # elements updated in place on the device
                if head == s.local.numel():
                    continue
                if s.param.dtype != torch.float32:
                    src = self._staging[s.trainable].view(-1)[head:]
                else:
                    # past the device head (which is the device tier's, updated in place there)
                    src = self._read_state(s, "master").view(-1) if head == 0 else self._read_flat(s, "master", head)
                s.local.data.view(-1)[head:].copy_(src, non_blocking=True)
                tel.add_bytes("device", "h2d", src.numel() * src.element_size())
            done = torch.cuda.Event()
            done.record(self._upload_stream)
        torch.cuda.current_stream(self.device).wait_event(done)
        self._upload_done = done

    def _sumsq_over_shards(self, active, inv_scale: float, prior_inf: bool) -> tuple[float, bool]:
        """(squared gradient norm over every rank's shards, whether any rank saw an inf).

        Under FSDP2 each rank holds the gradient of its shards only: the global norm (for
        clipping) sums the squares over the ranks that hold the other shards, and a non-finite
        gradient on one rank must skip the step on all of them, or their replicas diverge.
        """
        shard_dims_of = {id(s.param): _shard_key(s.param) for s, _ in active}
        parts = [0.0] * len(self._shard_groups)
        keys = [key for key, _ in self._shard_groups]
        for s, g in active:
            parts[keys.index(shard_dims_of[id(s.param)])] += kernels.grad_sumsq(g, inv_scale)
        total = 0.0
        any_inf = prior_inf
        for (_, groups), part in zip(self._shard_groups, parts):
            # float64: the squares of ~1e9 gradient elements keep their low digits
            buf = torch.tensor([part, 1.0 if prior_inf else 0.0], dtype=torch.float64, device=self.device)
            for group in groups:
                torch.distributed.all_reduce(buf, group=group)
            total += float(buf[0])
            any_inf = any_inf or float(buf[1]) > 0
        return total, any_inf

    def _before_state_access(self) -> None:
        """Before reading or writing state outside ``step()``: let the updates that
        ``step_in_backward`` runs during backward land first (its worker owns the tiers until
        then; the step stays open for ``step()`` to finish), write the master pieces still
        waiting for their first update (:meth:`_ensure_master`), and follow parameters that
        FSDP2 replaced."""
        if self._backward is not None and self._backward.open:
            self._backward.finish()
        self._write_pending_masters()
        self._follow_replaced_params()

    def _follow_replaced_params(self) -> None:
        """Re-place the state when ``param_groups`` now holds other parameter objects.

        Accelerate's FSDP2 preparation builds the optimizer over the full parameters and then
        swaps them in ``param_groups`` for the sharded DTensors ``fully_shard`` made (HF Trainer
        does this for ``optimizer_cls_and_kwargs``). Before the first step there is no state to
        carry, so the engine is simply built again over the new parameters; after it, the state
        of a replaced parameter would have no owner, so that is refused.
        """
        params = self._all_params()
        if len(params) == len(self._slots) and all(p is s.param for p, s in zip(params, self._slots)):
            return
        lost = [s.index for s in self._slots if s.initialized and not any(p is s.param for p in params)]
        if lost:
            raise RuntimeError(
                f"param_groups no longer hold parameter(s) {lost[:8]} of this optimizer, which have state; "
                "parameters may be replaced (e.g. by FSDP2 wrapping) only before the first step. Wrap the "
                "model first, or save the optimizer state and load it into one built over the new parameters"
            )
        self._rebuild_engine()

    def _adopt_new_trainables(self) -> None:
        """A parameter frozen at construction that now has a gradient gets a place in the tiers."""
        late = [s for s in self._slots if s.trainable is None and s.param.requires_grad and s.param.grad is not None]
        if not late:
            return
        pending = {}
        if self._grads is not None:  # gradients already streamed to the host survive the re-placement
            pending = {id(s.param): g.clone() for s in self._slots
                       if s.trainable in self._stream_index and (g := self._host_grad(s)) is not None}
        self._rebuild_engine()
        if self._grads is not None or pending:
            for s in self._slots:
                g = pending.get(id(s.param))
                k = self._stream_index.get(s.trainable)
                if k is None:  # now touches the device tier (or frozen): its gradient is read from param.grad
                    if g is not None and s.param.grad is None:
                        s.param.grad = g.view(s.param.shape).to(s.param.device, s.param.dtype)
                    continue
                if g is None and s.param.grad is not None:
                    g = local_tensor(s.param.grad).detach().reshape(-1).to("cpu")
                    if not self.offload.keep_device_grads:
                        s.param.grad = None
                if g is not None:
                    self._grads.host[k].copy_(g)
                    self._grads.valid[k] = True

    # -- torch.optim surface ---------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._backward is not None and self._backward.open:
            # step_in_backward=True already applied part of this step during backward; dropping
            # the gradients now would leave the state half stepped, so the step is completed.
            _log.warning("tierstate: zero_grad() after a backward whose updates already ran (step_in_backward=True)"
                         " without step(); completing the step first")
            try:
                self.step()
            finally:  # a write error raised at the end of that step must not leave its gradients to accumulate
                self._zero_grad(set_to_none)
            return
        self._zero_grad(set_to_none)

    def _zero_grad(self, set_to_none: bool) -> None:
        super().zero_grad(set_to_none=set_to_none)
        if self._grads is not None:
            self._grads.reset(set_to_none)

    # state_dict() of NVMe state: None = file-backed tensors when that state exceeds half the
    # available RAM, True = always, False = never (plain CPU tensors).
    state_dict_mmap: bool | None = None

    def state_dict(self) -> dict:
        """torch's schema: ``{"state": {index: {key: tensor}}, "param_groups": [...]}``.

        Keys are torch's (``step``, ``exp_avg``, ...) plus ``master`` for parameters with an
        fp32 master copy. Host-tier state is returned as views (no copy, like torch returns
        its live state tensors); state in other tiers is read into new CPU tensors, or, when
        it is larger than half the available RAM (see ``state_dict_mmap``), into tensors
        mapped from unlinked files in the NVMe tier's folder, so the dict never has to fit in
        RAM (:func:`tierstate.checkpoint.mmap_state_dict`).
        """
        self._before_state_access()
        nvme = self.tiers.get(TierKind.NVME)
        if nvme is not None and self._state_dict_in_files(nvme):
            from ..checkpoint import mmap_state_dict

            return mmap_state_dict(self, nvme.folders[0] / "state-dict")
        sd = super().state_dict()
        index_of = {}
        for g_saved, g in zip(sd["param_groups"], self.param_groups):
            for idx, p in zip(g_saved["params"], g["params"]):
                index_of[id(p)] = idx
        sd["state"] = {index_of[id(s.param)]: st for s in self._slots if s.initialized and (st := self._export_state(s))}
        return sd

    def _state_dict_in_files(self, nvme) -> bool:
        if self.state_dict_mmap is not None:
            return bool(self.state_dict_mmap)
        import psutil

        return nvme.nbytes > psutil.virtual_memory().available // 2

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict of this optimizer or of its torch namesake; state stays in its tiers.

        Everything is checked before anything is applied: hyper-parameters as at construction,
        every state tensor's size; a refused state dict leaves the optimizer as it was. torch's
        implementation switches in the saved groups (``fused=True`` of a torch run) describe
        how torch computed, not what: they are replaced by this optimizer's (tierstate always
        runs its own fused kernels).
        """
        self._before_state_access()
        from ..checkpoint.state_dict import check_state_dict  # noqa: PLC0415 - checkpoint imports optim

        merged = check_state_dict(self, state_dict)  # all of it, before anything is replaced
        groups = state_dict["param_groups"]
        saved_state = state_dict.get("state", {})
        saved_ids = [i for g in groups for i in g["params"]]
        slot_list = [self._slot_of[id(p)] for p in self._all_params()]
        # -- checked: apply
        super().load_state_dict({**state_dict, "state": {}})
        if TierKind.NVME in self.tiers:  # every state is replaced: no record need be read back
            self.tiers[TierKind.NVME].forget_state()
        for g, m in zip(self.param_groups, merged):
            g.update({k: v for k, v in m.items() if k not in ("params", "param_names")})
        for s in self._slots:
            s.initialized, s.master_ready, s.step = False, False, 0
        self.state.clear()
        keys = {spec.name for g in self.param_groups for spec in self.rule.state_specs(g)}
        if keys != set(self._specs):
            # the loaded hyper-parameters keep other state keys (amsgrad=True adds max_exp_avg_sq,
            # momentum > 0 a momentum_buffer): place the state anew; every state was just forgotten
            self._rebuild_engine()
            slot_list = [self._slot_of[id(p)] for p in self._all_params()]
        for saved_id, s in zip(saved_ids, slot_list):
            st = saved_state.get(saved_id)
            if st and s.trainable is not None:
                self._import_state(s, st)

    def _loaded_group(self, saved: dict) -> dict:
        """A saved param group's hyper-parameters as this optimizer will hold them: this
        optimizer's implementation switches, its defaults for keys the group lacks. Not
        validated here: the loaders check every group before applying any
        (:func:`tierstate.checkpoint.state_dict.check_state_dict`, ``load_optimizer``)."""
        group = {k: v for k, v in saved.items() if k not in ("params", "param_names")}
        for key in self.rule.flags:
            if key in group and key in self.defaults:
                group[key] = self.defaults[key]
        for key, value in self.defaults.items():
            group.setdefault(key, value)
        return group

    def stats(self):
        """Telemetry of the last step (a :class:`tierstate.telemetry.StepStats`; ``.as_dict()``)."""
        return self.telemetry.last

    def tier_bytes(self) -> dict:
        """Bytes of optimizer state (incl. masters and host gradient buffers) held per tier."""
        out = {kind.value: tier.nbytes for kind, tier in self.tiers.items()}
        if self._grads is not None:
            out["host_grads"] = self._grads.nbytes
        return out

    def trace(self, path) -> None:
        """Start writing a Chrome/Perfetto trace of every step to ``path``.

        The file is written by :meth:`stop_trace`, or at interpreter exit; view it in Perfetto
        or plot it with ``tierstate report PATH``. ``TIERSTATE_TRACE=path`` does the same
        for every optimizer of a process.
        """
        self.telemetry.start_trace(path)

    def stop_trace(self):
        """Write the trace started by :meth:`trace` and return its path."""
        return self.telemetry.stop_trace()
