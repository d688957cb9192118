"""WeightStreamer: a model's block weights kept on tiers and brought to the compute device
only while a block runs; :func:`offload_weights` builds one.

[Note: the optimizer and streamed weights]
The optimizer never sees a streamed parameter's storage (it is empty between uses). Its
kernels run on the block's *host image* instead (:mod:`.window`): an fp32 parameter is
updated in place there, a bf16/fp16 one gets its rounded weight written there from the
fp32 master the optimizer keeps, exactly as it would write the parameter. Writing the
compute copy with the update costs one write-back of the block per step (2 B/param for
bf16, 4 B for fp32) and no second copy of the weights; deriving the compute copy from the
master on every fetch would read the 4 B master twice a step (forward and backward)
instead of the 2 B copy, 8 B against 6 B of disk traffic per bf16 parameter, and would tie
a frozen parameter (which has no master) to another path. An fp32 model streamed from
NVMe keeps no master at all: the home holds the only copy of each weight, 4 B/param, which
is how a 7B model trains on a disk that could not hold a second copy.
"""
from __future__ import annotations

import contextlib
import os
import threading
import weakref
from typing import Iterator, Sequence

import torch
from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary

from ..dist import expand_rank_template, local_tensor
from ..placement import Offload
from ..placement.defaults import default_nvme_root
from . import fsdp
from .blocks import Block, assign, byte_view, resolve_blocks, typed_view
from .homes import make_home, split_by_fraction
from .hooks import BlockHooks
from .module_state import ModuleStateHooks
from .order import UseOrder
from .streamed_param import guard_conversions, mark, unmark
from .window import Window

TIERS = ("resident", "cpu", "nvme")

# Parameter -> (streamer, block index, place) for every streamed parameter; the optimizer's
# pipeline looks parameters up here. Weak on both sides: neither keeps the other alive.
# (torch's WeakIdKeyDictionary: a WeakKeyDictionary would compare two weak references to
# tensors with Tensor.__eq__, an elementwise read of weights that may have no storage.)
_registry: "WeakIdKeyDictionary" = WeakIdKeyDictionary()
# Parameters a closed streamer left empty -> their names, so a later save names the cause
_closed: "WeakIdKeyDictionary" = WeakIdKeyDictionary()
_generation = [0]  # bumped whenever parameters start or stop streaming


def generation() -> int:
    """Changes whenever some parameter starts or stops streaming (an optimizer re-checks then)."""
    return _generation[0]


class StreamedParam:
    """How the optimizer reaches a streamed parameter's values: through its block's host image."""

    __slots__ = ("_streamer", "block", "place")

    def __init__(self, streamer: "WeightStreamer", block: int, place) -> None:
        self._streamer = weakref.ref(streamer)
        self.block, self.place = block, place

    @property
    def streamer(self) -> "WeightStreamer":
        s = self._streamer()
        if s is None or s.closed:
            raise RuntimeError(f"parameter {self.place.name!r} was streamed by a WeightStreamer that is closed; "
                               "its values are gone")
        return s

    @contextlib.contextmanager
    def for_update(self, refresh: bool = False) -> Iterator[Tensor]:
        """A flat view of the parameter's values in host memory; changes reach the compute copy
        at the block's next use (``refresh``: at once)."""
        s = self.streamer
        with s._lock, s.window.image_for_update(self.block, refresh) as image:
            yield _flat(image, self.place)

    @contextlib.contextmanager
    def for_reading(self) -> Iterator[Tensor]:
        s = self.streamer
        with s._lock, s.window.image_for_reading(self.block) as image:
            yield _flat(image, self.place)


def _flat(image: Tensor, place) -> Tensor:
    p = place.param
    return image[place.byte_offset: place.byte_offset + place.nbytes].view(p.dtype)


def streamed_blocks(params) -> list[list[Tensor]]:
    """The parameters among ``params`` (tensors or param-group dicts) whose weights stream,
    grouped per block of their streamer, in the order they come (the planner prices the
    NVMe pool of ``step_in_backward`` by the largest block)."""
    tensors = [t for item in params for t in (
        ([item["params"]] if isinstance(item.get("params"), Tensor) else list(item.get("params", ())))
        if isinstance(item, dict) else [item])]
    blocks: dict[tuple, list[Tensor]] = {}
    for p in tensors:
        handle = _registry.get(p) if isinstance(p, Tensor) else None
        if handle is not None and p.requires_grad:  # a streamer hashes by identity, as modules do
            blocks.setdefault((handle._streamer(), handle.block), []).append(p)
    return list(blocks.values())


def closed_name(param: Tensor) -> str | None:
    """The name of ``param`` if a WeightStreamer streamed it and was closed (its values are gone)."""
    return _closed.get(param)


def streamed(param: Tensor) -> StreamedParam | None:
    """The handle of a streamed parameter, or None if it is not streamed."""
    entry = _registry.get(param)
    return entry


class WeightStreamer:
    """Keeps the weights of a model's blocks on tiers; see :func:`offload_weights`."""

    def __init__(self, model: nn.Module, tiers: Sequence[str], named_blocks, device: torch.device,
                 prefetch: int, nvme_dir, init, keep_resident=None) -> None:
        self.model_ref = weakref.ref(model)
        self.device = device
        self.prefetch = prefetch
        self.closed = False
        self._lock = threading.RLock()
        # [Note: streaming FSDP2's shards]: under fully_shard a block is this rank's shards
        self.sharded = fsdp.is_sharded(model)
        blocks, _ = _blocks_of(model, named_blocks, keep_resident)
        for b in blocks:
            for pl in b.places:
                if pl.param in _registry:
                    raise ValueError(f"parameter {pl.name!r} is already streamed by another WeightStreamer; "
                                     "close that one first (one streamer per model)")
        self.blocks: list[Block] = []
        kinds: list[str] = []
        for b, tier in zip(blocks, tiers):
            if tier == "resident" or not b.places:
                continue
            b.index = len(self.blocks)  # the window and the order number the streamed blocks densely
            self.blocks.append(b)
            kinds.append(tier)
        self.tiers = tuple(kinds)
        explicit = nvme_dir is not None
        homes = {}
        for kind in ("cpu", "nvme"):
            sizes = {b.index: b.nbytes for b, k in zip(self.blocks, kinds) if k == kind}
            if sizes:
                homes[kind] = make_home(kind, sizes, pin=device.type == "cuda", folder=nvme_dir,
                                        explicit=explicit, default_root=default_nvme_root())
        self._homes = list(homes.values())
        try:
            self.window = Window(self.blocks, [homes[k] for k in kinds], device, prefetch)
            for b in self.blocks:
                self._fill(b, init)
            self._move_resident(model, init)
        except BaseException:
            _close_homes(self._homes)
            raise
        self.order = UseOrder(len(self.blocks), prefetch)
        for b in self.blocks:
            for pl in b.places:
                _registry[pl.param] = StreamedParam(self, b.index, pl)
                mark(pl.param)  # [Note: touching a streamed parameter directly]
        self._unguard = guard_conversions([model, *(b.module for b in self.blocks)])
        _generation[0] += 1
        self._telemetries: "weakref.WeakSet" = weakref.WeakSet()
        self.window.report = self._report
        self.window.pending = self._update_pending
        self.hooks = fsdp.ShardHooks(self) if self.sharded else BlockHooks(self)
        self.state_hooks = ModuleStateHooks(self, model)  # [Note: a streamed model's own state dict]
        self._finalizer = weakref.finalize(self, _close_homes, self._homes)

    # -- construction --------------------------------------------------------------------------
    def _move_resident(self, model: nn.Module, init) -> None:
        """Parameters and buffers outside the streamed blocks live on the compute device for the run."""
        dev = self.device
        streamed_params = {pl.param for b in self.blocks for pl in b.places}
        streamed_mods = {m for b in self.blocks for m in b.module.modules()}
        for mod in model.modules():
            for p in list(mod._parameters.values()):
                if p is None or p in streamed_params:
                    continue
                if p.is_meta:
                    _replace_param(model, p, torch.empty(p.shape, dtype=p.dtype, device=dev))
                elif p.device != dev:
                    p.data = p.data.to(dev)
            if mod not in streamed_mods:
                _materialize_buffers(mod, dev)
        if init is not None:
            with torch.no_grad():
                for mod in model.modules():
                    if mod not in streamed_mods:
                        init(mod)

    def _fill(self, block: Block, init) -> None:
        """Give the block its storage, its parameters their views into it, and the home its bytes."""
        storage = torch.UntypedStorage(block.nbytes, device=self.device)
        block.storage = storage
        meta = any(pl.param.is_meta for pl in block.places)
        if meta and init is None:
            raise ValueError(f"block {block.name!r} is on the meta device and init=None: pass init=<a function "
                             "of a module that initializes its own parameters> (e.g. model._init_weights), "
                             "called on each module once its parameters have memory")
        model = self.model_ref()
        if self.sharded:  # FSDP2's shards become views into the storage, keeping their values
            for pl in block.places:
                item = pl.param.element_size()
                fsdp.repoint(pl, torch.empty(0, dtype=pl.param.dtype, device=self.device).set_(
                    storage, pl.byte_offset // item, (pl.padded_nbytes // item,), (1,)))
            self.window.fill_home(block.index, byte_view(storage, block.nbytes))
            storage.resize_(0)
            return
        places = []
        for pl in block.places:
            view = typed_view(storage, pl)
            if pl.param.is_meta:
                new = nn.Parameter(view, requires_grad=pl.param.requires_grad)
                _replace_param(model, pl.param, new)
                pl = type(pl)(pl.name, new, pl.byte_offset, pl.nbytes)
            else:
                view.copy_(pl.param.detach())
                pl.param.data = view
            places.append(pl)
        block.places = tuple(places)
        for mod in block.module.modules():
            _materialize_buffers(mod, self.device)
        if meta and init is not None:
            with torch.no_grad():
                for mod in block.module.modules():
                    init(mod)
        self.window.fill_home(block.index, byte_view(storage, block.nbytes))
        storage.resize_(0)

    def _update_pending(self, b: int) -> bool:
        """Whether a parameter of block ``b`` holds a gradient the optimizer has not applied yet
        (with ``step_in_backward`` it drops a streamed gradient once applied)."""
        return any(p.grad is not None for p in self.blocks[b].params)

    def attach_telemetry(self, telemetry) -> None:
        """Book this streamer's waits and reads (phases ``weight_wait``, ``weight_fetch`` on lane
        ``weights``) in ``telemetry`` too; an optimizer over streamed parameters attaches its own."""
        self._telemetries.add(telemetry)

    def _report(self, phase: str, seconds: float, start: float) -> None:
        for tel in list(self._telemetries):
            tel.add_phase_time(phase, seconds, lane="weights", start=start)

    # -- what the hooks call -------------------------------------------------------------------
    def _use(self, b: int) -> None:
        upcoming = self.order.note(b)
        up = set(upcoming)
        self.window.write_behind()
        self.window.materialize(b, up)
        for u in upcoming:
            self.window.prefetch(u, up)
        if self.window.cuda and upcoming:
            # the next block's copy up runs on the side stream while this one computes; it is
            # released after its own use, or at the end of backward if the order was wrong
            self.window.materialize(upcoming[0], up)

    def _enter_forward(self, b: int) -> None:
        with self._lock:
            self._use(b)
            self.window.state[b].holds += 1

    def _leave_forward(self, b: int) -> None:
        with self._lock:
            st = self.window.state[b]
            st.holds -= 1
            self.window.release(b)

    def _enter_backward(self, b: int) -> None:
        with self._lock:
            self.window.state[b].backward_holds += 1
            self._use(b)

    def _leave_backward(self, b: int) -> None:
        with self._lock:
            st = self.window.state[b]
            st.backward_holds = max(0, st.backward_holds - 1)
            self.window.release(b)

    def _end_backward(self) -> None:
        with self._lock:
            for b, st in enumerate(self.window.state):
                st.backward_holds = 0
                self.window.release(b)
            self.order.commit()

    # -- public --------------------------------------------------------------------------------
    def block_bytes(self) -> list[int]:
        """Bytes of each streamed block's weights in their compute dtype, in model order."""
        return [b.nbytes for b in self.blocks]

    def resident_bytes(self) -> int:
        """Bytes of the parameters that stay on the compute device (outside the streamed blocks)."""
        model = self.model_ref()
        if model is None:
            return 0
        streamed_params = {pl.param for b in self.blocks for pl in b.places}
        seen: set[Tensor] = set()
        total = 0
        for p in model.parameters():
            if p not in streamed_params and p not in seen:
                seen.add(p)
                total += local_tensor(p).numel() * p.element_size()
        return total

    @contextlib.contextmanager
    def gathered(self, blocks: Sequence[int] | None = None) -> Iterator[None]:
        """Materialize blocks (all by default) for reading their parameters directly, e.g. to
        evaluate a small model or print a weight. Write weights with :meth:`write_param`:
        a change made to a parameter in place inside is kept on the CPU (the storage is the
        block's host image there) but not on CUDA (a device copy). A large model should be read block by
        block (``gathered([i])``), or exported with :func:`tierstate.save_weights`."""
        self._check_open()
        which = range(len(self.blocks)) if blocks is None else list(blocks)
        held = []
        self.window.quiet_growth += 1  # the pool grows for these blocks, as asked, and shrinks after
        try:
            with self._lock:
                for b in which:
                    self.window.materialize(b)
                    self.window.state[b].holds += 1
                    held.append(b)
            yield
        finally:
            with self._lock:
                self.window.quiet_growth -= 1
                for b in held:
                    self.window.state[b].holds -= 1
                    self.window.release(b)

    def read_param(self, param: Tensor) -> Tensor:
        """A CPU copy of a streamed parameter's current values (under FSDP2: this rank's shard,
        in the shape of the parameter's local tensor)."""
        h = self._handle(param)
        with h.for_reading() as flat:
            return flat.clone().view(tuple(local_tensor(param).shape))

    def write_param(self, param: Tensor, value: Tensor) -> None:
        """Set a streamed parameter's values (copied, cast to its dtype; under FSDP2 this rank's
        shard, in the shape of the parameter's local tensor)."""
        h = self._handle(param)
        shape = tuple(local_tensor(param).shape)
        if tuple(value.shape) != shape:
            raise ValueError(f"write_param: value has shape {tuple(value.shape)}, parameter {h.place.name!r} "
                             f"has {shape}" + (" (this rank's shard of an FSDP2 parameter)" if self.sharded else ""))
        with h.for_update(refresh=True) as flat:  # inside gathered() the parameter shows it at once
            flat.copy_(value.detach().reshape(-1).to(device="cpu", dtype=param.dtype))
        # the host image's views have version counters of their own: count the write on the
        # parameter, so an optimizer keeping its master follows it (pipeline/user_writes.py)
        torch.autograd.graph.increment_version(local_tensor(param))

    def named_streamed(self) -> list[tuple[str, Tensor]]:
        """(name, parameter) of every streamed parameter, in model order."""
        return [(pl.name, pl.param) for b in self.blocks for pl in b.places]

    def _handle(self, param: Tensor) -> StreamedParam:
        self._check_open()
        h = _registry.get(param)
        if h is None or h.streamer is not self:
            raise ValueError("that parameter is not streamed by this WeightStreamer")
        return h

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this WeightStreamer is closed")

    def flush(self) -> None:
        """Write every changed NVMe image to its home (a checkpoint of the weights' files)."""
        with self._lock:
            self.window.flush()

    def stats(self) -> dict:
        """What streaming did so far: bytes fetched from NVMe and at what rate, prefetch hits
        and misses, seconds the compute waited, the window's peak, the homes' sizes."""
        c = self.window.counters
        homes = {h.kind: h.nbytes for h in self._homes}
        return {
            "blocks": len(self.blocks),
            "block_tiers": {k: self.tiers.count(k) for k in ("cpu", "nvme") if k in self.tiers},
            "home_bytes": homes,
            "fetch_bytes": c.fetch_bytes,
            "fetch_gbps": (c.fetch_bytes / c.fetch_seconds / 1e9) if c.fetch_seconds > 0 else None,
            "writeback_bytes": c.writeback_bytes,
            "copy_bytes": c.copy_bytes,
            "prefetch_hits": c.prefetch_hits,
            "prefetch_misses": c.prefetch_misses,
            "stall_seconds": c.stall_seconds,
            "materializations": c.materializations,
            "peak_window_bytes": c.peak_materialized_bytes,
            "pool_bytes": self.window.pool_nbytes,
            "pool_grown": c.pool_grown,
            "order_changes": self.order.changes,
        }

    def close(self) -> None:
        """Remove the hooks and the homes' files. The streamed parameters are left empty
        (shape ``(0,)``): save what you need first (:func:`tierstate.save_weights`)."""
        if self.closed:
            return
        with self._lock:
            self.hooks.remove()
            self.state_hooks.remove()
            self._unguard()
            try:
                self.window.close()
            finally:
                for b in self.blocks:
                    for pl in b.places:
                        _registry.pop(pl.param, None)
                        _closed[pl.param] = pl.name
                        unmark(pl.param)
                        if self.sharded:
                            fsdp.empty_shard(pl)
                        else:
                            pl.param.data = torch.empty(0, dtype=pl.param.dtype, device=self.device)
                    if b.storage is not None:
                        b.storage.resize_(0)
                self.closed = True
                _generation[0] += 1
                self._finalizer()

    def __enter__(self) -> "WeightStreamer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        kinds = ", ".join(f"{k}: {self.tiers.count(k)}" for k in ("cpu", "nvme") if k in self.tiers)
        return f"WeightStreamer({len(self.blocks)} blocks ({kinds}), device={self.device}, prefetch={self.prefetch})"


def _blocks_of(model: nn.Module, named_blocks, keep_resident):
    if fsdp.is_sharded(model):
        return fsdp.shard_blocks(model, named_blocks, keep_resident)
    return assign(model, named_blocks, keep_resident)


def _close_homes(homes) -> None:
    for h in homes:
        try:
            h.close()
        except OSError:
            pass


def _replace_param(model: nn.Module, old: Tensor, new_value: Tensor) -> nn.Parameter:
    """Put a new Parameter holding ``new_value`` wherever ``old`` is registered (ties kept)."""
    new = new_value if isinstance(new_value, nn.Parameter) else nn.Parameter(new_value, requires_grad=old.requires_grad)
    for mod in model.modules():
        for name, p in mod._parameters.items():
            if p is old:
                mod._parameters[name] = new
    return new


def _materialize_buffers(mod: nn.Module, device: torch.device) -> None:
    for name, buf in list(mod._buffers.items()):
        if buf is None:
            continue
        if buf.is_meta:
            mod._buffers[name] = torch.empty(buf.shape, dtype=buf.dtype, device=device)
        elif buf.device != device:
            mod._buffers[name] = buf.to(device)


def _tiers_of(offload, nblocks: int, block_nbytes: list[int], device: torch.device) -> list[str]:
    if isinstance(offload, str):
        if offload not in ("cpu", "nvme"):
            raise ValueError(f"offload={offload!r}: expected 'cpu', 'nvme', 'auto', a ts.Offload(cpu=..., nvme=...) "
                             "or a list with one of 'resident', 'cpu', 'nvme' per block")
        return [offload] * nblocks
    if isinstance(offload, Offload):
        if offload.gpu > 0:
            raise ValueError(f"offload=Offload(gpu={offload.gpu}): for weights, keep blocks on the compute device "
                             "with a list of per-block tiers ('resident', 'cpu', 'nvme'), or give cpu/nvme fractions")
        cpu = offload.cpu if offload.cpu is not None else 1.0 - offload.nvme
        return split_by_fraction(block_nbytes, cpu, offload.nvme)
    try:
        tiers = list(offload)
    except TypeError:
        raise TypeError(f"offload={offload!r}: expected 'cpu', 'nvme', 'auto', a ts.Offload or a list of tiers") from None
    if len(tiers) != nblocks or any(t not in TIERS for t in tiers):
        raise ValueError(f"offload=<list of {len(tiers)}>: give one of {TIERS} for each of the {nblocks} blocks")
    return tiers


def offload_weights(model: nn.Module, offload="nvme", *, nvme_dir=None, blocks="auto", prefetch: int = 2,
                    device=None, init=None, keep_resident=None) -> WeightStreamer:
    """Keep the weights of ``model``'s blocks on a tier and bring each to the compute device
    only while it runs (forward, backward, recomputation under activation checkpointing).

    Call it before building the optimizer, which then updates the streamed weights where they
    live (see [Note: the optimizer and streamed weights])::

        ws = ts.offload_weights(model, "nvme", nvme_dir="/mnt/nvme/weights")
        opt = ts.AdamW(model.parameters(), lr=1e-4, offload="nvme", step_in_backward=True)

    Args:
        model: the model; its parameters may be on the CPU, on the compute device, or on the
            meta device (built under ``with torch.device("meta"):``; then ``init`` is required,
            and the model is never whole in memory: each block is materialized, initialized,
            written to its home and released in turn).
        offload: where the blocks live: ``"nvme"`` (files under ``nvme_dir``), ``"cpu"`` (host
            RAM, pinned on CUDA; on a CPU-only machine the weights are already there, so this
            only tests the path), ``ts.Offload(cpu=a, nvme=b)`` (the first blocks, up to the
            fraction ``a`` of the bytes, in RAM, the rest on NVMe), a list with one of
            ``"resident"``, ``"cpu"``, ``"nvme"`` per block, or ``"auto"`` (the planner picks
            from the measured hardware; see ``tierstate plan``).
        nvme_dir: the folder of the NVMe home (claimed for this run and removed at close;
            default: the NVMe root, ``TIERSTATE_NVME_DIR``). Give the optimizer another one.
            ``{rank}`` (and ``{local_rank}``, ``{world_size}``, ``{local_world_size}``) is
            replaced by this process's, so the ranks of a job each get their own folder.
        blocks: ``"auto"`` (the children of the model's largest ``nn.ModuleList``) or a list of
            its modules. Parameters used outside a single block (tied embeddings) stay resident.
        prefetch: blocks read ahead in the order learned from the previous step (>= 0).
        device: the compute device (default: CUDA if available, else the CPU).
        init: for meta models: called with every module once its own parameters and buffers
            have memory (e.g. ``model._init_weights`` of a transformers model).
        keep_resident: ``(name, param) -> bool``: parameters of the blocks to keep on the compute
            device anyway, e.g. ``lambda name, p: p.requires_grad`` for LoRA fine-tuning (the
            frozen base weights stream, the small adapters stay).

    Returns:
        A :class:`WeightStreamer`: ``stats()``, ``gathered()``, ``read_param``/``write_param``,
        ``flush()``, ``close()``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    ddp = next((name or "the model" for name, m in model.named_modules()
                if isinstance(m, nn.parallel.DistributedDataParallel)), None)
    if ddp is not None:  # its buckets alias every gradient, its broadcasts read every weight
        raise TypeError(f"offload_weights: {ddp} is wrapped in DistributedDataParallel, which keeps every weight "
                        "and gradient of its own: across ranks, shard the blocks with FSDP2's fully_shard and stream "
                        "the shards (docs/weights.md)")
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch={prefetch!r}: expected an int >= 0 (blocks read ahead)")
    if init is not None and not callable(init):
        raise TypeError(f"init={init!r}: expected a function of a module, or None")
    if keep_resident is not None and not callable(keep_resident):
        raise TypeError(f"keep_resident={keep_resident!r}: expected a function (name, param) -> bool, or None")
    device_given = device
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device={str(device)!r}: weights stream to 'cpu' or 'cuda'")
    named = resolve_blocks(model, blocks)
    complex_params = [name for name, p in model.named_parameters() if p.is_complex()]
    if complex_params:
        raise TypeError(f"offload_weights: parameter {complex_params[0]!r} is complex; streamed blocks hold real "
                        "weights (bf16/fp16/fp32/fp64): keep complex modules out of the model given, or train without "
                        "weight streaming (the optimizer takes complex parameters in RAM and on NVMe)")
    assigned, resident = _blocks_of(model, named, keep_resident)  # (checks an FSDP2 model's blocks first)
    if fsdp.is_sharded(model):
        fsdp.prepare(model)
        shards_on = fsdp.shard_device(model)
        if device_given is not None and torch.device(device_given).type != shards_on.type:
            raise ValueError(f"device={device_given!r}: under FSDP2 the shards stream to where FSDP keeps them "
                             f"({shards_on}); leave device unset")
        device = shards_on
    nbytes = [b.nbytes for b in assigned]
    if isinstance(offload, str) and offload == "auto":
        from ..placement.auto import choose_weights  # noqa: PLC0415 - the planner and the probe only for "auto"

        resident_bytes = sum(local_tensor(p).numel() * p.element_size() for _, p in resident)
        plan = choose_weights(nbytes, resident_bytes, device, nvme_dir=nvme_dir,
                              max_prefetch=max(prefetch, 1))
        tiers, prefetch = list(plan.tier_of), plan.prefetch
    else:
        tiers = _tiers_of(offload, len(assigned), nbytes, device)
    if nvme_dir is None and isinstance(offload, Offload) and offload.nvme_dir is not None:
        nvme_dir = offload.nvme_dirs[0]
    if isinstance(nvme_dir, (str, os.PathLike)):  # "{rank}": each rank of a job its own folder
        nvme_dir = expand_rank_template(os.fspath(nvme_dir), "nvme_dir")
    if nvme_dir is not None and "nvme" not in tiers and offload != "auto":
        raise ValueError(f"nvme_dir={str(nvme_dir)!r}: no block lives on NVMe with offload={offload!r}")
    return WeightStreamer(model, tiers, named, device, prefetch, nvme_dir, init, keep_resident)
