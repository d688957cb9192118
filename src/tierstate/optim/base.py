"""OffloadOptimizer: the torch.optim face shared by every tierstate optimizer.

It holds what torch code sees (arguments, ``param_groups``, ``state``, ``step``,
``zero_grad``, ``state_dict``/``load_state_dict``, the GradScaler contract) and nothing
of how a step runs: the math is a rule (:mod:`tierstate.rules`), the state lives in a
:class:`~tierstate.tiers.StateStore` over tiers, and a step is a
:class:`~tierstate.pipeline.StepEngine`'s.
"""
from __future__ import annotations

import copy
import logging
import weakref
from typing import Any, Callable, Iterable

import torch
from torch import Tensor

from .. import host_allocator, kernels
from ..dist import exit_drain
from ..dist import failure as fail_fast
from ..dist import local_state, present_state
from ..dist.ranks import group_world_size
from ..dist.zero import partition_group_of_caller
from ..io import first_noting_others
from ..kernels.omp_handover import hand_over_cores
from ..pipeline import StepCounters, StepEngine, StepPolicy
from ..placement import Offload
from ..telemetry import Telemetry
from ..tiers import fused_group, loaded_step_dtype, step_tensor
from ..weights import streamed_blocks
from .amp import scaling_of
from .health import configure_health
from .params import check_something_to_train, checked_group, params_list
from .state_view import ParamState, as_stored_state, as_torch_state, publish, publish_steps

NONFINITE_POLICIES = ("skip", "raise")
_log = logging.getLogger("tierstate")


class OffloadOptimizer(torch.optim.Optimizer):
    """Base class of tierstate's optimizers; see :class:`tierstate.AdamW` for the arguments."""

    _step_supports_amp_scaling = True
    # a streamed weight is updated in its block's host image (weights/streamed_param.py
    # refuses other optimizers over one)
    updates_streamed_weights = True
    rule: Any  # a tierstate.rules.UpdateRule, set by each optimizer class
    # state_dict() of state in I/O tiers: None = file-backed tensors when that state exceeds half
    # the available RAM, True = always, False = never (plain CPU tensors).
    state_dict_mmap: bool | None = None

    def __init__(self, params: Iterable, defaults: dict, *, offload: "str | Offload" = "cpu",
                 max_grad_norm: float | None = None, on_nonfinite: str = "skip", telemetry: bool = True,
                 step_in_backward: bool = False, nvme_dir=None) -> None:
        if not isinstance(offload, (str, Offload)):
            raise TypeError(f"offload must be 'cpu', 'nvme', 'auto' or a tierstate.Offload, got {type(offload).__name__}")
        if nvme_dir is not None:
            offload = Offload.with_nvme_dir(offload, nvme_dir)
        # the hyper-parameters first, as torch's optimizers check them before reading params
        self.rule.validate(defaults)
        params = params_list(params, type(self).__name__)
        if isinstance(offload, str) and offload == "auto":
            offload = self._choose_auto(params, defaults, step_in_backward=step_in_backward)
        self.offload = Offload.from_mode(offload)
        if max_grad_norm is not None:
            if isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float)) or not max_grad_norm > 0:
                raise ValueError(f"max_grad_norm={max_grad_norm!r}: must be a positive number, or None to disable clipping")
        if on_nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"on_nonfinite={on_nonfinite!r}: must be one of {NONFINITE_POLICIES}")
        if not isinstance(step_in_backward, bool):
            raise TypeError(f"step_in_backward must be True or False, got {step_in_backward!r}")
        if step_in_backward and group_world_size() > 1:
            # DDP and FSDP reduce gradients across ranks after the per-parameter hooks this mode
            # runs on, so an update there would use this rank's unreduced gradient.
            raise ValueError(
                f"step_in_backward=True in a process group of {group_world_size()} ranks: "
                "data-parallel wrappers reduce gradients after the hooks this mode updates in, so each rank "
                "would step on its own gradient; use step_in_backward=False with DDP/FSDP")
        self.step_in_backward = step_in_backward
        # built by torch's ZeroRedundancyOptimizer: this rank holds a part of the parameters, and
        # clipping needs the norm over all parts (tierstate.dist.zero)
        self._partition_group = partition_group_of_caller()
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.on_nonfinite = on_nonfinite
        self.telemetry = Telemetry(enabled=telemetry)
        configure_health(self.telemetry)
        self._counters = StepCounters()
        self._engine: StepEngine | None = None
        super().__init__(params, defaults)
        check_something_to_train(type(self).__name__, self._all_params())
        self._engine = StepEngine(self, self.rule, self.offload, self._policy(), self.telemetry, self._counters)
        take = weakref.WeakMethod(self._take_dropped_state)  # the engine must not keep the optimizer alive
        self._engine.before_update = lambda: (method := take()) is not None and method()
        self._publish_all()
        exit_drain.install()  # one rank of several: gloo's threads finish before Python ends
        fail_fast.arm()  # one rank of several: its failure ends the others, naming it
        # CPU training: keep freed host memory for reuse (see tierstate.host_allocator), the
        # policy actually in effect ("system" where the C library has no such knob).
        host_allocator.adopt(self.offload.host_allocator_for(self.device))
        self.host_allocator = host_allocator.policy()

    def _policy(self) -> StepPolicy:
        return StepPolicy(self.max_grad_norm, self.on_nonfinite, self.step_in_backward, self._partition_group)

    def _choose_auto(self, params: list, defaults: dict, step_in_backward: bool) -> Offload:
        try:
            from ..placement.auto import choose_offload
        except ImportError as exc:
            raise ValueError(
                "offload='auto' needs the placement planner (tierstate.placement.auto), which is not "
                f"available in this build ({exc}); pass offload='cpu' or 'nvme' or a tierstate.Offload(...)"
            ) from exc
        # the per-element state the planner prices: the rule's keys for every group's arguments
        groups = [defaults | g if isinstance(g, dict) else defaults for g in params]
        keys = [spec.name for g in groups for spec in self.rule.state_specs(g)]
        # step_in_backward updates the host tiers only: no device tier then
        return choose_offload(params, allow_device_tier=not step_in_backward, state_keys=keys,
                              step_in_backward=step_in_backward, streamed_blocks=streamed_blocks(params))

    # -- what the engine holds, as torch code and tools ask for it -------------------------------
    @property
    def state_store(self):
        """The :class:`~tierstate.tiers.StateStore` holding every parameter's state."""
        return self._engine.store

    @property
    def tiers(self) -> dict:
        return self._engine.store.tiers

    @property
    def layout(self):
        return self._engine.store.layout

    @property
    def device(self) -> torch.device:
        return self._engine.device

    @property
    def releases_param_grads(self) -> bool:
        """Whether backward's gradients are copied to host buffers as they are produced and
        ``param.grad`` is then released (the gradient stream without ``keep_device_grads``:
        the default for CUDA parameters). Code between backward and ``step()`` then finds
        ``param.grad`` None: ``torch.nn.utils.clip_grad_norm_`` clips nothing; clip with
        ``max_grad_norm=``."""
        grads = self._engine.parts.grads
        return grads.stream is not None and not grads.keep_device_grads

    @property
    def steps_taken(self) -> int:
        """``step()`` calls so far (kept by checkpoints; telemetry's step index)."""
        return self._counters.steps_taken

    @steps_taken.setter
    def steps_taken(self, value: int) -> None:
        self._counters.steps_taken = int(value)

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for a non-finite gradient."""
        return self._counters.skipped_steps

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._counters.skipped_steps = int(value)

    @property
    def rollbacks(self) -> int:
        """``step_in_backward=True``: steps whose speculative updates during backward were rolled
        back (clipping active, a loss-scale change or overflow, accumulation); see
        :mod:`tierstate.pipeline.backward`, [Note: speculative updates and rollback]."""
        return self._counters.rollbacks

    @property
    def last_grad_norm(self) -> float | None:
        """The global gradient norm of the last step that ran (before clipping)."""
        return self._counters.last_grad_norm

    def _all_params(self) -> list[Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    # -- torch.optim surface ---------------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        """torch's ``add_param_group``, checked before anything changes: a refused group leaves the
        optimizer as it was. ``params`` may be any iterable of tensors or of ``(name, tensor)``
        pairs (turned into a list, as torch does), not a set; a tensor may appear once in the
        whole optimizer; hyper-parameters are validated as at construction."""
        super().add_param_group(checked_group(param_group, self.param_groups, self.defaults, self.rule))
        if self._engine is not None:  # a group added after construction: re-place the state
            try:
                self._engine.rebuild(undo=self.param_groups.pop)  # refused there: the group goes again
            finally:
                self._publish_all()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._engine.backward_open:
            # step_in_backward=True already applied part of this step during backward; dropping
            # the gradients now would leave the state half stepped, so the step is completed.
            _log.warning(
                "tierstate: zero_grad() after a backward whose updates already ran (step_in_backward=True)"
                " without step(); completing the step first")
            try:
                self.step()
            finally:  # a write error raised at the end of that step must not leave its gradients to accumulate
                self._zero_grad(set_to_none)
            return
        self._zero_grad(set_to_none)

    def _zero_grad(self, set_to_none: bool) -> None:
        super().zero_grad(set_to_none=set_to_none)
        self._engine.reset_grads(set_to_none)

    # a function torch.compile traces runs this step eagerly, as it runs torch's own foreach
    # and fused steps: the native kernels and the I/O engine are opaque to it, and tracing
    # into them only ends in graph breaks and a warning per break
    @torch.compiler.disable
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, grad_scaler=None):
        """One optimizer step over every parameter that has a gradient.

        Args:
            closure: re-evaluates the model and returns the loss (torch semantics).
            grad_scaler: passed by ``torch.amp.GradScaler.step``; do not pass it yourself.

        What an I/O failure of the NVMe tier leaves (see [Note: what a failed I/O leaves] in
        :mod:`tierstate.tiers.nvme_ledger`):

        - a failed *write* (``DiskFullError`` on a full or thinly provisioned disk, EIO): the
          step completes in memory, parameters and state exactly as after it; the error
          (path, errno) is raised at the end of ``step()``, a failure on another file or disk
          in the same step attached as a note (Python >= 3.11). The records that could not be
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
        self._engine.check_open()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # torch's OpenMP workers still spin after backward: give their cores to the kernels (once
        # a step, not per update inside backward, where torch would restart them for every
        # autograd node: see kernels/omp_handover.py)
        hand_over_cores()
        tel = self.telemetry
        tel.begin_step(self._counters.steps_taken)
        workers = tel.enabled and tel.tracing  # one trace lane per kernel thread, only while tracing
        if workers:
            kernels.record_worker_spans(True)
        try:
            engine = self._engine
            engine.store.check_specs(self.param_groups)  # compressed state: before anything changes
            engine.policy = self._policy()  # the attributes may be changed between steps, as torch's
            # gradient-stream copies of a param.grad changed after backward (clip_grad_norm_,
            # scaler.unscale_) are made again: they then hold what param.grad holds
            refreshed = engine.parts.grads.refresh()
            host_copies = engine.parts.grads.stream is not None and not refreshed
            result = engine.step(scaling_of(self, grad_scaler, host_copies=host_copies))
            if result.rebuilt:
                self._publish_all()
            counted = []
            for s in result.stepped:
                if s.trainable in result.fresh or s.needs_master and "master" not in self.state[s.param]:
                    publish(self, engine.store, s, self.rule.has_step)
                elif self.rule.has_step:
                    counted.append(s)
            publish_steps(self, counted)
            if result.error is not None:
                raise result.error
            failed = engine.store.take_write_errors()
            weights_failed = engine.parts.weights.take_write_errors()  # a streamed block's, kept in RAM
            failed = first_noting_others([failed, weights_failed])
            if failed is not None:  # the step is complete in memory
                raise failed
        finally:
            if workers:
                for thread, start, end in kernels.drain_worker_spans():
                    tel.add_phase_time("cpu_update", end - start, lane=f"cpu-worker-{thread}", start=start)
                kernels.record_worker_spans(False)
            self._last_stats = tel.end_step()
        return loss

    # -- state outside a step --------------------------------------------------------------------
    def _publish_all(self) -> None:
        store = self._engine.store
        for s in store.slots:
            if s.has_state:
                publish(self, store, s, self.rule.has_step)

    def sync_state(self) -> None:
        """Bring the tiers up to date before state is read or written outside ``step()``: the
        updates ``step_in_backward`` runs during backward land, pending master pieces are
        written, and parameters FSDP2 replaced are followed. ``state_dict``, ``load_state_dict``
        and the checkpoint streamer call it; so may code reading :attr:`state_store`."""
        if self._engine.before_state_access():  # rebuilt over replaced parameters: new host views
            self._publish_all()

    def refresh_state_view(self) -> None:
        """Fill ``optimizer.state`` from the store, after state was written through
        :attr:`state_store` (as :func:`tierstate.load_optimizer` does)."""
        self._publish_all()

    def _read_on_demand(self, param: Tensor, key: str) -> Tensor:
        """``optimizer.state[param][key]`` for a key not held in the dict: a CPU copy read from the
        tiers. KeyError where the parameter has no such state (as torch's dict)."""
        store = self._engine.store
        s = store.slot_of(param)
        if s is None or s.trainable is None or not s.has_state or key not in store.held_keys(s):
            raise KeyError(key)
        self.sync_state()
        value = store.read(s, key)
        return self._engine.copies.hand_out(s, key, value, as_torch_state(param, value))

    def _take_dropped_state(self) -> None:
        """torch code resets a parameter's state by dropping its ``optimizer.state`` entry
        (``optimizer.state.clear()``, ``optimizer.state = defaultdict(dict)``, ``del
        optimizer.state[p]``) and sets it by assigning a dict: before a step updates anything,
        a dropped state starts afresh at that step and an assigned one is loaded, as torch's
        optimizers read ``optimizer.state`` (see [Note: writes into optimizer.state])."""
        store = self._engine.store
        for s in store.slots:
            entry = self.state.get(s.param)
            if isinstance(entry, ParamState) or (entry is None and not s.has_state) or s.trainable is None:
                continue  # the common case first: this check runs before every step
            if not store.keys(s) and not self.rule.has_step:
                continue  # no state kept (SGD without momentum): torch keeps no entry either
            store.forget(s)
            if entry:
                store.import_(s, as_stored_state(s.param, entry))
            if entry is not None:
                del self.state[s.param]
            if s.has_state:
                publish(self, store, s, self.rule.has_step)

    def _assign_state(self, param: Tensor, key, value) -> bool:
        """``optimizer.state[param][key] = value`` for a key of its state or ``step``: the value
        is written into the state (see [Note: writes into optimizer.state]); False for any
        other key, or a parameter without state, which the dict keeps as given."""
        store = self._engine.store
        s = store.slot_of(param)
        if s is None or s.trainable is None or not s.has_state:
            return False
        st = self.state[param]
        if key == "step" and self.rule.has_step:
            self.sync_state()
            s.step = int(float(value))
            s.step_dtype = loaded_step_dtype(value, saved_fused=False)
            st.keep("step", step_tensor(s.step, s.step_dtype) if not isinstance(value, Tensor) else value)
            return True
        if key not in store.held_keys(s) or not isinstance(value, Tensor):
            return False
        held = dict.get(st, key)
        if held is not None and held.data_ptr() == value.data_ptr() and held.device == value.device:
            return True  # its own view given back (frameworks moving the state "to" the CPU)
        stored = as_stored_state(param, {key: value})[key]
        if stored.numel() != store.item_count(s, key):
            raise ValueError(f"optimizer.state[params[{s.index}]][{key!r}] = a tensor of shape {tuple(value.shape)}: "
                             f"the state of a parameter of shape {tuple(param.shape)} holds {store.item_count(s, key)} "
                             "items; assign a tensor of as many (e.g. torch.zeros_like(param))")
        self.sync_state()
        store.write(s, key, stored)
        return True

    def state_dict(self) -> dict:
        """torch's schema: ``{"state": {index: {key: tensor}}, "param_groups": [...]}``.

        Keys are torch's (``step``, ``exp_avg``, ...) plus ``master`` for parameters with an
        fp32 master copy. Host-tier state is returned as views (no copy, like torch returns
        its live state tensors); state in other tiers is read into new CPU tensors, or, when
        it is larger than half the available RAM (see ``state_dict_mmap``), into tensors
        mapped from unlinked files in the NVMe tier's folder, so the dict never has to fit in
        RAM (:func:`tierstate.checkpoint.mmap_state_dict`).
        """
        from ..checkpoint import torch_hooks  # noqa: PLC0415 - checkpoint is above tiers only

        return torch_hooks.run_state_dict_hooks(self, self._state_dict_from_tiers)

    def _state_dict_from_tiers(self) -> dict:
        from ..checkpoint import torch_hooks  # noqa: PLC0415

        self.sync_state()
        store = self._engine.store
        folder = store.spill_folder
        if folder is not None and self._state_dict_in_files(store):
            from ..checkpoint import mmap_state_dict

            sd = mmap_state_dict(self, folder)
        else:
            sd = torch_hooks.packed(self)
            index_of = {p: idx for idx, p in self._by_saved_index(sd)}
            sd["state"] = {index_of[s.param]: st for s in store.slots
                           if s.has_state and (st := store.export(s, self.rule.has_step))}
            sd["state"].update(torch_hooks.entries_not_of_parameters(self))
        for idx, p in self._by_saved_index(sd):  # complex parameters' state as torch's complex tensors
            if p.is_complex() and idx in sd["state"]:
                sd["state"][idx] = {k: as_torch_state(p, v) for k, v in sd["state"][idx].items()}
        return present_state(sd, self.param_groups)  # FSDP2: DTensor state, as torch's (for DCP)

    def _by_saved_index(self, state_dict: dict):
        """(index in ``state_dict``, this optimizer's parameter) for each parameter its param groups
        list, group by group (what torch's load pairs); nothing for a malformed dict, whose
        ``check_state_dict`` names what is wrong."""
        groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        for g_saved, g in zip(groups if isinstance(groups, list) else (), self.param_groups):
            ids = g_saved.get("params") if isinstance(g_saved, dict) else None
            yield from zip(ids if isinstance(ids, (list, tuple)) else (), g["params"])

    def _state_dict_in_files(self, store) -> bool:
        if self.state_dict_mmap is not None:
            return bool(self.state_dict_mmap)
        import psutil

        return store.spilled_nbytes > psutil.virtual_memory().available // 2

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict of this optimizer or of its torch namesake; state stays in its tiers.

        Everything is checked before anything is applied: hyper-parameters as at construction,
        every state tensor's size; a refused state dict leaves the optimizer as it was. torch's
        implementation switches in the saved groups (``fused=True`` of a torch run) describe
        how torch computed, not what: they are replaced by this optimizer's (tierstate always
        runs its own fused kernels).
        """
        self.sync_state()
        from ..checkpoint import torch_hooks  # noqa: PLC0415
        from ..checkpoint.compressed import convert_for  # noqa: PLC0415
        from ..checkpoint.state_dict import check_state_dict  # noqa: PLC0415 - checkpoint is above tiers only

        state_dict = torch_hooks.run_load_pre_hooks(self, state_dict)
        state_dict = local_state(state_dict, self.param_groups)  # FSDP2: DTensor state -> this rank's shards
        state_dict = self._complex_as_stored(state_dict)
        state_dict = convert_for(self, state_dict)  # full <-> compressed state, with a warning
        merged = check_state_dict(self, state_dict)  # all of it, before anything is replaced
        saved_state = state_dict.get("state", {})
        pairs = list(self._by_saved_index(state_dict))  # (saved index, parameter), checked above
        # torch keeps a loaded step's dtype unless the group it was saved from was fused or capturable
        saved_fused = {i: fused_group(g) for g in state_dict["param_groups"] for i in g["params"]}
        self.take_param_groups(state_dict["param_groups"], merged)
        store = self._engine.store
        for saved_id, p in pairs:
            st = saved_state.get(saved_id)
            s = store.slot_of(p)
            if st and s.trainable is not None:
                store.import_(s, st, saved_fused=saved_fused.get(saved_id, False))
                publish(self, store, s, self.rule.has_step)
        self._engine.copies.let_go()  # copies read before the load no longer show the state
        known = {saved_id for saved_id, _ in pairs}
        for key, value in saved_state.items():  # an entry that is not a parameter's, as torch keeps it
            if key not in known:
                self.state[key] = value
        torch_hooks.run_load_post_hooks(self)

    def _complex_as_stored(self, state_dict):
        """A state dict to load with the complex state of complex parameters as real views (the
        dict given is not changed)."""
        state = state_dict.get("state") if isinstance(state_dict, dict) else None
        if not isinstance(state, dict):
            return state_dict  # check_state_dict names what is wrong
        out = dict(state)
        for idx, p in self._by_saved_index(state_dict):
            if p.is_complex() and isinstance(state.get(idx), dict):
                out[idx] = as_stored_state(p, state[idx])
        return {**state_dict, "state": out}

    def take_param_groups(self, param_groups: list[dict], merged: list[dict] | None = None) -> None:
        """The first half of a load (torch's semantics): take the saved groups' hyper-parameters
        (``merged``: as :meth:`loaded_group` makes them) and forget every state; the state is
        then written through :attr:`state_store`. Used by ``load_state_dict`` and
        :func:`tierstate.load_optimizer`, which validated the groups before."""
        from ..checkpoint.torch_hooks import without_state_dict_hooks  # noqa: PLC0415

        merged = merged if merged is not None else [self.loaded_group(g) for g in param_groups]
        with without_state_dict_hooks(self):  # load_state_dict runs them, around the whole load
            super().load_state_dict({"state": {}, "param_groups": param_groups})
        for g, m in zip(self.param_groups, merged):
            g.update({k: v for k, v in m.items() if k not in ("params", "param_names")})
        self._engine.store.forget_all()
        self.state.clear()
        keys = {spec.name for g in self.param_groups for spec in self.rule.state_specs(g)}
        if keys != {k.split(".")[0] for k in self._engine.store.dtypes} - {"master"}:  # "exp_avg.codes": a part
            # the loaded hyper-parameters keep other state keys (amsgrad=True adds max_exp_avg_sq,
            # momentum > 0 a momentum_buffer): place the state anew; every state was just forgotten
            self._engine.rebuild()

    def loaded_group(self, saved: dict) -> dict:
        """A saved param group's hyper-parameters as this optimizer will hold them: this
        optimizer's implementation switches; for a key an older torch release did not save,
        the value torch gives it (``maximize=False``: UpdateRule.added_later); its defaults
        for the other keys the group lacks. Not validated here: the loaders check every group
        before applying any."""
        group = {k: v for k, v in saved.items() if k not in ("params", "param_names")}
        for key in self.rule.flags:
            if key in group and key in self.defaults:
                group[key] = self.defaults[key]
        for key, value in self.rule.added_later.items():
            group.setdefault(key, value)
        for key, value in self.defaults.items():
            group.setdefault(key, value)
        return group

    # -- reporting and lifetime ------------------------------------------------------------------
    def stats(self):
        """Telemetry of the last step (a :class:`tierstate.telemetry.StepStats`; ``.as_dict()``)."""
        return self.telemetry.last

    def tier_bytes(self) -> dict:
        """Bytes of optimizer state (incl. masters and host gradient buffers) held per tier."""
        return self._engine.tier_bytes()

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

    # -- copies ------------------------------------------------------------------------------
    def __deepcopy__(self, memo: dict) -> "OffloadOptimizer":
        """A new optimizer of this class over copies of the parameters, as torch's
        ``copy.deepcopy(optimizer)`` gives: the same copies a deepcopy of the model in the
        same call makes (``copy.deepcopy((model, opt))``), the same constructor arguments,
        param groups, state and step counts, in tiers of its own; the two are independent
        from then on. State on NVMe under an ``nvme_dir`` named explicitly cannot be copied
        (one folder holds one run's files): TypeError, with the way to do it by hand."""
        if self.offload.nvme > 0 and self.offload.nvme_dir is not None:
            raise TypeError(
                f"copy.deepcopy of a {type(self).__name__} whose state is on NVMe under nvme_dir="
                f"{self.offload.nvme_dir!r}: a copy needs its own folder, and one folder holds one run's files; "
                f"build the copy yourself with its own nvme_dir (or none, for a per-run folder under "
                f"TIERSTATE_NVME_DIR) and load_state_dict(optimizer.state_dict()) into it")
        import inspect  # noqa: PLC0415 - only a copy needs it

        accepted = inspect.signature(type(self).__init__).parameters
        hyper = {k: copy.deepcopy(v, memo) for k, v in self.defaults.items() if k in accepted}
        groups = []
        for g in self.param_groups:
            group = {k: copy.deepcopy(v, memo) for k, v in g.items() if k != "params"}
            group["params"] = [copy.deepcopy(p, memo) for p in g["params"]]
            groups.append(group)
        twin = type(self)(groups, **hyper, offload=self.offload, max_grad_norm=self.max_grad_norm,
                          on_nonfinite=self.on_nonfinite, telemetry=self.telemetry.enabled,
                          step_in_backward=self.step_in_backward)
        twin.load_state_dict(self._state_dict_from_tiers())  # no hooks: torch's deepcopy runs none either
        memo[id(self)] = twin
        return twin

    def __getstate__(self):
        raise TypeError(
            f"a {type(self).__name__} cannot be pickled: its state lives in host buffers, NVMe files and native "
            "engines of this process; save optimizer.state_dict() (torch.save) or a checkpoint "
            "(tierstate.save_optimizer), and load it into a new optimizer")

    def close(self) -> None:
        """Release host buffers, files and hooks now (also done when the optimizer is collected)."""
        if self.__dict__.get("_engine") is not None:
            self._engine.close()

    def __del__(self) -> None:  # files of the NVMe tier must not outlive the run
        try:
            self.close()  # a forwarding wrapper (LightningOptimizer) owns no engine
        except Exception:  # noqa: BLE001 - interpreter shutdown: nothing left to report to
            pass


__all__ = ["NONFINITE_POLICIES", "OffloadOptimizer"]
