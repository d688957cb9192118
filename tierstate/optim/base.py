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
low-precision or accelerator parameters). State held elsewhere (NVMe, or a parameter
straddling tiers) is read on demand by ``state_dict()``.
"""
from __future__ import annotations

import logging
import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch import Tensor

from .. import kernels
from ..pipeline import run_subgroups
from ..placement import Layout, Offload, Segment, TierKind, plan_layout
from ..telemetry import Telemetry
from ..tiers import HostTier, packed_arena
from .grad_stream import GradStream
from .rules import UpdateRule

_log = logging.getLogger("tierstate")

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
NONFINITE_POLICIES = ("skip", "raise")

# GradScaler hands itself to optimizers whose step() takes ``grad_scaler`` and warns that
# this contract is being deprecated. We need that contract: our gradients live on the host,
# where GradScaler's own inf check cannot see them, so the check and its record for
# ``scaler.update()`` happen here.
warnings.filterwarnings("ignore", message="GradScaler is going to stop passing itself", category=FutureWarning)


@dataclass(eq=False)  # slots are compared by identity, never by their tensors' values
class _Slot:
    """One parameter of the optimizer, whatever its tier."""

    index: int  # position in the flattened param_groups, as in torch's state_dict
    param: Tensor
    group: int  # index into param_groups
    trainable: int | None  # index into the layout (None: frozen at construction)
    needs_master: bool  # an fp32 master copy exists in the tiers
    initialized: bool = False  # state exists in torch's sense (first step with a grad done)
    master_ready: bool = False  # master holds the parameter's value
    written: bool = False  # its state regions may differ from the init values the tiers start with
    step: int = 0


class OffloadOptimizer(torch.optim.Optimizer):
    """Base class of tierstate's optimizers; see :class:`tierstate.AdamW` for the arguments."""

    _step_supports_amp_scaling = True
    rule: UpdateRule

    def __init__(self, params: Iterable, defaults: dict, *, offload: "str | Offload" = "cpu",
                 max_grad_norm: float | None = None, on_nonfinite: str = "skip", telemetry: bool = True) -> None:
        if not isinstance(offload, (str, Offload)):
            raise TypeError(f"offload must be 'cpu', 'nvme', 'auto' or a tierstate.Offload, got {type(offload).__name__}")
        if isinstance(offload, str) and offload == "auto":
            params = list(params)
            offload = self._choose_auto(params)
        self.offload = Offload.from_mode(offload)
        if max_grad_norm is not None:
            if isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float)) or not max_grad_norm > 0:
                raise ValueError(f"max_grad_norm={max_grad_norm!r}: must be a positive number, or None to disable clipping")
        if on_nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"on_nonfinite={on_nonfinite!r}: must be one of {NONFINITE_POLICIES}")
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.on_nonfinite = on_nonfinite
        self.telemetry = Telemetry(enabled=telemetry)
        self._configure_health()
        self._engine_ready = False
        self._slots: list[_Slot] = []
        self.skipped_steps = 0
        self._steps_taken = 0  # step() calls, for telemetry's step index
        self.last_grad_norm: float | None = None
        super().__init__(params, defaults)
        self._build_engine()

    # -- construction ----------------------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        params = param_group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        for i, p in enumerate(params):
            if not isinstance(p, Tensor):
                raise TypeError(f"params[{i}] is a {type(p).__name__}; an optimizer takes torch Tensors (model.parameters())")
            if not p.is_leaf:
                raise ValueError(
                    f"params[{i}] is not a leaf tensor (it was computed from others); optimize the leaf "
                    "tensors (nn.Parameter) instead"
                )
            if p.dtype not in _SUPPORTED_DTYPES:
                raise TypeError(f"params[{i}] has dtype {p.dtype}; supported: float32, bfloat16, float16")
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for key, value in self.defaults.items():
            group.setdefault(key, value)
        self.rule.validate(group)
        devices = {p.device for g in self.param_groups for p in g["params"]}
        if len(devices) > 1:
            raise ValueError(
                f"params are on {len(devices)} devices ({', '.join(sorted(str(d) for d in devices))}); "
                "one optimizer takes parameters of one device (use one optimizer per device)"
            )
        if self._engine_ready:  # a group added after construction: re-place the state
            self._rebuild_engine()

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
    def _choose_auto(params: list) -> Offload:
        try:
            from ..placement.auto import choose_offload
        except ImportError as exc:
            raise ValueError(
                "offload='auto' needs the placement planner (tierstate.placement.auto), which is not "
                f"available in this build ({exc}); pass offload='cpu' or 'nvme' or a tierstate.Offload(...)"
            ) from exc
        return choose_offload(params)

    def _all_params(self) -> list[Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _build_engine(self) -> None:
        params = self._all_params()
        self.device = params[0].device if params else torch.device("cpu")
        on_accel = self.device.type != "cpu"
        if self.offload.gpu > 0 and not on_accel:
            raise ValueError(f"Offload(gpu={self.offload.gpu}) needs parameters on an accelerator; these are on {self.device}")
        if self.offload.gpu > 0:
            raise NotImplementedError(
                f"Offload(gpu={self.offload.gpu}): keeping part of the state on the accelerator is not "
                "supported yet; place it in host RAM and on NVMe, e.g. Offload(cpu=0.6, nvme=0.4)")
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
        self._slot_of = {id(s.param): s for s in slots}  # parameters are hashed by identity, as in torch
        fractions = {TierKind.DEVICE: self.offload.gpu, TierKind.HOST: self.offload.cpu, TierKind.NVME: self.offload.nvme}
        self.layout: Layout = plan_layout([p.numel() for p in trainable], fractions, self.offload.subgroup_numel)
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
        self._grads = GradStream(trainable, keep_device_grads=self.offload.keep_device_grads, pin_memory=pin,
                                 telemetry=self.telemetry) if streaming and trainable else None
        self._staging: dict[int, Tensor] = {}  # CUDA: pinned low-precision weights, written by the kernels
        self._staging_arena: Tensor | None = None
        if self.device.type == "cuda":
            low = [(i, p) for i, p in enumerate(trainable) if p.dtype != torch.float32]
            self._staging_arena, views = packed_arena([p for _, p in low], pin_memory=True, zero=False)
            self._staging = {i: v for (i, _), v in zip(low, views)}
        self._upload_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._upload_done = None
        if self.rule.eager_state:
            for s in slots:
                if s.trainable is not None:
                    self._init_state(s)
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
        if s.param.numel() and self.layout.tier_of_param(s.trainable) is not TierKind.HOST:
            return None
        start = self.layout.param_starts[s.trainable]
        return host.flat_range(key, start, s.param.numel()).view(s.param.shape)

    def _state_keys(self, s: _Slot) -> list[str]:
        keys = [spec.name for spec in self.rule.state_specs(self.param_groups[s.group])]
        return keys + (["master"] if s.needs_master else [])

    def _publish(self, s: _Slot) -> None:
        """Fill ``optimizer.state[p]`` of a slot (see the note at the top of the file).

        The views stay valid as long as the tiers do, so a step only refreshes ``step``
        (:meth:`_publish_step`); this runs when state starts existing or is loaded.
        """
        st = self.state[s.param]
        if self.rule.has_step:
            st["step"] = torch.tensor(float(s.step), dtype=torch.float32)
        for key in self._state_keys(s):
            if key == "master" and not s.master_ready:
                continue  # filled from the parameter at its first step
            view = self._host_view(s, key)
            if view is not None:
                st[key] = view

    def _publish_step(self, s: _Slot) -> None:
        if self.rule.has_step:
            self.state[s.param]["step"].fill_(float(s.step))  # in place, as torch increments it

    def _read_state(self, s: _Slot, key: str) -> Tensor:
        """A parameter's state ``key`` as a CPU tensor shaped like the parameter."""
        view = self._host_view(s, key)
        if view is not None:
            return view
        dtype = self._state_dtypes[key]
        out = torch.empty(s.param.numel(), dtype=dtype)
        for seg in self._segments(s):
            sg = self.layout.subgroups[seg.subgroup]
            tier = self.tiers[sg.tier]
            out[seg.param_offset: seg.param_offset + seg.numel] = tier.read_range(key, sg, seg.subgroup_offset, seg.numel)
        return out.view(s.param.shape)

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
            fill = torch.full((1,), spec.init, dtype=self._state_dtypes[spec.name]).expand(s.param.numel())
            self._write_state(s, spec.name, fill)

    def _init_state(self, s: _Slot) -> None:
        """First step of a parameter with a gradient: its state starts existing (torch semantics)."""
        self._reset_to_init(s)
        s.written = False
        s.initialized = True
        s.step = 0
        self._publish(s)

    def _ensure_master(self, s: _Slot) -> None:
        if s.needs_master and not s.master_ready:
            flat = s.param.detach().reshape(-1)
            for seg in self._segments(s):  # segment by segment: temporaries stay sub-group sized
                sg = self.layout.subgroups[seg.subgroup]
                piece = flat[seg.param_offset: seg.param_offset + seg.numel].to("cpu", torch.float32)
                self.tiers[sg.tier].write_range("master", sg, seg.subgroup_offset, piece)
            s.master_ready = True

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
                if not isinstance(value, Tensor) or value.numel() != s.param.numel():
                    got = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
                    raise ValueError(
                        f"load_state_dict: state {key!r} of parameter {s.index} has shape {got}, "
                        f"the parameter has shape {tuple(s.param.shape)}"
                    )
                self._write_state(s, key, value)
        if "step" in state:
            s.step = int(float(state["step"]))
        s.master_ready = ("master" in state) if master_ready is None else master_ready
        self._publish(s)

    # -- the step --------------------------------------------------------------------------------
    def _host_grad(self, s: _Slot) -> Tensor | None:
        if self._grads is not None and s.trainable is not None:
            return self._grads.grad(s.trainable)
        g = s.param.grad
        if g is None:
            return None
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
        finally:
            if workers:
                for thread, start, end in kernels.drain_worker_spans():
                    tel.add_phase_time("cpu_update", end - start, lane=f"cpu-worker-{thread}", start=start)
                kernels.record_worker_spans(False)
            self._last_stats = tel.end_step()
        return loss

    def _step(self, tel, grad_scaler) -> None:
        self._steps_taken += 1
        if self._upload_done is not None:  # the staging buffers are about to be rewritten
            with tel.phase("device_stall"):
                self._upload_done.synchronize()
        if self._grads is not None:
            with tel.phase("grad_wait"):
                self._grads.wait()
        self._adopt_new_trainables()
        active = [(s, g) for s in self._slots if s.trainable is not None and (g := self._host_grad(s)) is not None]
        inv_scale, prior_inf, record, scaled = self._scaler_inputs(grad_scaler)

        grad_scale = inv_scale
        if active:  # one read of the gradients gives both the global norm and the non-finite check
            with tel.phase("clip"):
                sumsq = sum(kernels.grad_sumsq(g, inv_scale) for _, g in active)
            finite = math.isfinite(sumsq) and not prior_inf
            if record is not None:
                record["found_inf_per_device"] = {torch.device("cpu"): torch.tensor([0.0 if finite else 1.0])}
            if not finite:
                if scaled:
                    self.telemetry.count("skipped_steps")
                    self.skipped_steps += 1
                    return  # GradScaler lowers its scale in update(); nothing to say
                if self.on_nonfinite == "raise":
                    bad = [s.index for s, g in active if not math.isfinite(kernels.grad_sumsq(g))]
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
                grad_scale = inv_scale * min(1.0, self.max_grad_norm / (norm + 1e-6))

        grads: dict[int, Tensor] = {}
        fresh: set[int] = set()
        for s, g in active:
            if not s.initialized:
                self._init_state(s)
                fresh.add(s.trainable)
            self._ensure_master(s)
            s.written = True
            s.step += 1
            grads[s.trainable] = g
            read, written = self._kernel_traffic(s, g)
            tel.add_bytes("host", "read", read)
            tel.add_bytes("host", "write", written)
        by_trainable = {s.trainable: s for s, _ in active}
        work = []
        for sg in self.layout.subgroups:
            segs = [seg for seg in sg.segments if seg.param_index in grads]
            if segs:
                work.append((sg, segs))

        def update(seg: Segment, views) -> None:
            s = by_trainable[seg.param_index]
            lo, hi = seg.subgroup_offset, seg.subgroup_offset + seg.numel
            plo, phi = seg.param_offset, seg.param_offset + seg.numel
            state = {k: v[lo:hi] for k, v in views.items() if k != "master"}
            weight, weight_out = self._weight_views(s, views, lo, hi, plo, phi)
            self.rule.update(weight=weight, grad=grads[seg.param_index][plo:phi], state=state, weight_out=weight_out,
                             group=self.param_groups[s.group], step=s.step, first_step=seg.param_index in fresh,
                             grad_scale=grad_scale)

        run_subgroups(work, self.tiers, update, tel)
        for s, _ in active:
            if s.trainable in fresh or s.needs_master and "master" not in self.state[s.param]:
                self._publish(s)
            else:
                self._publish_step(s)
        if self.device.type == "cuda":
            self._upload(tel, [s for s, _ in active])
        for tier_name, nbytes in self.tier_bytes().items():
            tel.set_gauge(f"tier_bytes/{tier_name}", nbytes)
        if self.device.type == "cuda":
            tel.set_gauge("pinned_bytes", self._pinned_bytes())
            tel.set_gauge("device_mem", torch.cuda.memory_allocated(self.device))

    def _pinned_bytes(self) -> int:
        """Page-locked host memory this optimizer holds (arenas, gradient arena, staging, NVMe pool)."""
        tensors = [t for tier in self.tiers.values() for t in getattr(tier, "arenas", {}).values()]
        tensors += [self._grads.arena] if self._grads is not None else []
        tensors += [self._staging_arena] if self._staging_arena is not None else []
        total = sum(t.untyped_storage().nbytes() for t in tensors if t.is_pinned())
        nvme = self.tiers.get(TierKind.NVME)
        return total + (nvme.pool_nbytes if nvme is not None and nvme.pin_memory else 0)

    def _kernel_traffic(self, s: _Slot, grad: Tensor) -> tuple[int, int]:
        """Host-memory bytes the update of one parameter reads and writes (one fused pass)."""
        n = s.param.numel()
        state = sum(self._state_dtypes[k].itemsize for k in self._state_keys(s) if k != "master")
        weight = 4 if s.needs_master else s.param.element_size()  # the master, or the fp32 param itself
        out = s.param.element_size() if s.needs_master and s.param.dtype != torch.float32 else 0
        return n * (grad.element_size() + state + weight), n * (state + weight + out)

    def _weight_views(self, s: _Slot, views, lo: int, hi: int, plo: int, phi: int) -> tuple[Tensor, Tensor | None]:
        """(fp32 weight the kernel updates, low-precision output it also writes, or None)."""
        if not s.needs_master:  # an fp32 parameter in host memory is its own master
            return s.param.data.view(-1)[plo:phi], None
        weight = views["master"][lo:hi]
        if s.param.dtype == torch.float32:
            return weight, None  # uploaded from the master itself
        if self.device.type == "cpu":
            return weight, s.param.data.view(-1)[plo:phi]
        return weight, self._staging[s.trainable][plo:phi]

    def _upload(self, tel, slots: list[_Slot]) -> None:
        """CUDA: copy updated weights to the device on a side stream; the compute stream waits for it."""
        with tel.phase("weight_upload"), torch.cuda.stream(self._upload_stream):
            for s in slots:
                src = self._staging.get(s.trainable) if s.param.dtype != torch.float32 else self._read_state(s, "master")
                s.param.data.view(-1).copy_(src.view(-1), non_blocking=True)
                tel.add_bytes("device", "h2d", src.numel() * src.element_size())
            done = torch.cuda.Event()
            done.record(self._upload_stream)
        torch.cuda.current_stream(self.device).wait_event(done)
        self._upload_done = done

    def _adopt_new_trainables(self) -> None:
        """A parameter frozen at construction that now has a gradient gets a place in the tiers."""
        late = [s for s in self._slots if s.trainable is None and s.param.requires_grad and s.param.grad is not None]
        if not late:
            return
        pending = {}
        if self._grads is not None:  # gradients already streamed to the host survive the re-placement
            pending = {id(s.param): self._grads.grad(s.trainable).clone() for s in self._slots
                       if s.trainable is not None and self._grads.grad(s.trainable) is not None}
        self._rebuild_engine()
        if self._grads is not None:
            for s in self._slots:
                g = pending.get(id(s.param))
                if g is None and s.param.grad is not None:
                    g = s.param.grad.detach().reshape(-1).to("cpu")
                    if not self.offload.keep_device_grads:
                        s.param.grad = None
                if g is not None:
                    self._grads.host[s.trainable].copy_(g)
                    self._grads.valid[s.trainable] = True

    # -- torch.optim surface ---------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
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
        nvme = self.tiers.get(TierKind.NVME)
        if nvme is not None and self._state_dict_in_files(nvme):
            from ..checkpoint import mmap_state_dict

            return mmap_state_dict(self, nvme.folders[0] / "state-dict")
        sd = super().state_dict()
        index_of = {}
        for g_saved, g in zip(sd["param_groups"], self.param_groups):
            for idx, p in zip(g_saved["params"], g["params"]):
                index_of[id(p)] = idx
        sd["state"] = {index_of[id(s.param)]: self._export_state(s) for s in self._slots if s.initialized}
        return sd

    def _state_dict_in_files(self, nvme) -> bool:
        if self.state_dict_mmap is not None:
            return bool(self.state_dict_mmap)
        import psutil

        return nvme.nbytes > psutil.virtual_memory().available // 2

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict of this optimizer or of its torch namesake; state stays in its tiers."""
        saved_state = state_dict.get("state", {})
        groups = state_dict.get("param_groups")
        if groups is None:
            raise ValueError("load_state_dict: the state dict has no 'param_groups' (is it an optimizer state dict?)")
        super().load_state_dict({**state_dict, "state": {}})
        for g in self.param_groups:
            self.rule.validate(g)
        saved_ids = [i for g in groups for i in g["params"]]
        for s in self._slots:
            s.initialized, s.master_ready, s.step = False, False, 0
        self.state.clear()
        slot_list = [self._slot_of[id(p)] for p in self._all_params()]
        for saved_id, s in zip(saved_ids, slot_list):
            st = saved_state.get(saved_id)
            if st and s.trainable is not None:
                self._import_state(s, st)

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
