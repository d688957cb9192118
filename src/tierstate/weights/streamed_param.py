"""What a streamed parameter does when code touches it outside its block's use.

[Note: touching a streamed parameter directly]
Between uses a streamed parameter's storage is resized to 0 (its block's memory is back in
the window's pool): the tensor keeps its shape but its data pointer is null. torch's kernels
do not check that, so until 2026-12-07 any direct read (``p.sum()``, ``p.norm()`` in a
logging callback, ``p.clone()``, ``parameters_to_vector``, W&B's histograms,
``copy.deepcopy`` of a layer, ``torch.save(p)``) or a conversion (``model.half()``) read
through the null pointer and the process died with SIGSEGV.

Each streamed parameter is now a :class:`StreamedParameter` (an ``nn.Parameter`` subclass,
the same object: its class is swapped in place, so the optimizer's and the user's references
stay valid). Its ``__torch_function__`` lets every call through while the block has memory
(inside the block's forward and backward, and inside ``ws.gathered()``) and, between uses:

- passes metadata (shape, dtype, device, grad, ``numel``, ``zeros_like``, hooks, ...);
- refuses a read or a write with a RuntimeError naming the parameter and the way to its
  values (``ws.read_param`` / ``ws.write_param`` / ``ws.gathered()``); nothing is changed;
- refuses ``.data`` and ``detach()`` too: an alias would reach code that no check sees
  (DistributedDataParallel's broadcast of every ``param.detach()`` ended the process).
  torch's own ``Module._save_to_state_dict`` gets an alias that keeps these checks (the
  entry the state-dict hooks replace with a copy: [Note: a streamed model's own state
  dict]), and so does any caller while the block has memory, for these and for views
  (``kept = p.detach()`` or ``w = p.T`` inside ``ws.gathered()``, read after it, raises
  instead of reading the released storage);
- lets a conversion that changes nothing (``model.to("cpu")`` on the CPU) return the
  parameter itself, and refuses one that would (``model.half()``): the block's layout is
  fixed when ``offload_weights`` is called. The model and each block also check every
  streamed parameter before ``Module._apply`` starts, so a refused ``model.half()`` leaves
  the resident parameters as they were, too (see :func:`guard_conversions`). Under torch's
  future conversion flags (swap or overwrite module parameters on conversion) a no-op
  conversion passes too: the streamed parameters skip it (:func:`_hide_streamed`).

A torch optimizer (any optimizer without ``updates_streamed_weights = True``, which
tierstate's set) is refused before its step changes anything when it holds a streamed
parameter: a global step pre-hook, which returns at once while nothing streams.

Assigning ``param.data = other`` to a streamed parameter would detach it from its block
(the forward would use the new tensor, the optimizer would keep updating the block): it is
refused, except for the parameter itself (what ``Module._apply`` assigns after a no-op).

The cost is a Python call per torch function on a streamed parameter: a tiny Linear's
forward took 7.1 us against 4.6 (2-vCPU Zen 5 VM, 2026-12-07); a 124M GPT-2's forward makes
360 such calls, ~0.9 ms against 254 ms for its 128-token forward on that VM.
Parameters of another ``nn.Parameter`` subclass keep their own class and are not checked.

Under FSDP2 a streamed parameter is a DTensor whose local tensor (this rank's shard) loses
its storage between uses. It becomes a :class:`StreamedDTensor` (the DTensor class swapped
in place, as above), with the same checks on the DTensor itself: DTensor's own
``__torch_function__`` is off, so every torch call on the parameter reaches DTensor's
dispatch, which runs the op on the local tensor in C++, past any check put on the shard
(with the checked class on the shard, ``p.sum()`` raised but ``p.clone()`` still crashed,
torch 2.13, 2026-12-07); checked on the DTensor, both raise. ``to_local()``,
``full_tensor()`` and ``redistribute()`` (Python methods that hand the shard out) are checked
too. FSDP2 itself never calls a torch function on a sharded parameter between its unshards
(it gathers from ``_sharded_param_data``), and the optimizer reads the shard's address. An
alias taken while the shard has memory (``with ws.gathered(): kept = p.to_local()``, or
``p.detach()``, a view) is checked too, as above.
Before 2026-12-07 each of ``p.sum()``, ``p.norm()``, ``p.clone()``, ``p.to_local().sum()``,
``torch.save(p)`` on such a parameter ended the rank with SIGSEGV.
"""
from __future__ import annotations

import sys
import types
from typing import Any, Callable

import torch
from torch import Tensor, nn
from torch._C import DisableTorchFunctionSubclass
from torch.optim.optimizer import register_optimizer_step_pre_hook

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch build without torch.distributed
    DTensor = None



def _descriptors(names: tuple[str, ...], setters: tuple[str, ...] = ()) -> set:
    out = set()
    for n in names:
        d = getattr(Tensor, n, None)
        if d is not None and hasattr(d, "__get__"):
            out.add(d.__get__)
    for n in setters:
        d = getattr(Tensor, n, None)
        if d is not None and hasattr(d, "__set__"):
            out.add(d.__set__)
    return out


def _functions(owner, names: tuple[str, ...]) -> set:
    return {getattr(owner, n) for n in names if hasattr(owner, n)}


# Calls that read no values (torch hands property reads to __torch_function__ as __get__).
_METADATA = frozenset(
    _descriptors(("shape", "dtype", "device", "layout", "requires_grad", "grad", "_grad", "grad_fn", "_grad_fn",
                  "is_leaf", "ndim", "names", "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_sparse_csr",
                  "is_quantized", "is_mkldnn", "is_nested", "is_xpu", "is_mps", "is_mtia", "is_ipu", "is_xla",
                  "is_vulkan", "is_maia", "itemsize", "nbytes", "_version", "_base", "output_nr", "retains_grad",
                  "_backward_hooks", "_post_accumulate_grad_hooks"),
                 setters=("requires_grad", "grad", "_grad", "_backward_hooks", "_post_accumulate_grad_hooks"))
    | _functions(Tensor, ("size", "dim", "ndimension", "numel", "nelement", "element_size", "stride",
                          "storage_offset", "is_contiguous", "is_floating_point", "is_complex", "is_signed",
                          "get_device", "requires_grad_", "register_hook", "register_post_accumulate_grad_hook",
                          "retain_grad", "untyped_storage", "_typed_storage", "data_ptr", "__len__", "is_pinned",
                          "is_shared", "_is_view", "is_inference", "has_names", "dim_order", "_is_zerotensor",
                          "new_empty", "new_zeros", "new_ones", "new_full", "__dir__", "_fix_weakref"))
    | _functions(torch, ("empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like",
                         "randint_like", "numel", "is_floating_point", "is_complex",
                         "_has_compatible_shallow_copy_type"))
)
# Calls whose result shares the parameter's storage: refused, but for torch's own
# Module._save_to_state_dict (the entry a state dict replaces, or keeps as a placeholder
# when the copies would not fit in RAM), where the alias keeps the checks. An alias given
# to any caller would reach C++ that no check sees: DistributedDataParallel broadcasts
# param.detach() of every parameter when it is built (it ended the process).
_ALIASING = frozenset({Tensor.detach, Tensor.data.__get__})
_SAVE_TO_STATE_DICT = nn.Module._save_to_state_dict.__code__
# Views: taken while the block has memory they share its storage too, so they come back as
# checked aliases (``with ws.gathered(): w = p.T``, read after, crashed). Between uses a view
# is refused as a read. (torch's list of view ops, "Tensor Views"; ``reshape`` may copy, and
# a checked copy passes every check: it never loses its memory.)
_VIEW_NAMES = ("view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "squeeze", "unsqueeze", "t",
               "transpose", "swapaxes", "swapdims", "permute", "movedim", "moveaxis", "narrow", "select",
               "__getitem__", "expand", "expand_as", "as_strided", "unfold", "diagonal", "split",
               "split_with_sizes", "tensor_split", "chunk", "unbind", "hsplit", "vsplit", "dsplit",
               "view_as_real", "view_as_complex")
_VIEWS = frozenset(_functions(Tensor, _VIEW_NAMES) | _functions(torch, _VIEW_NAMES)
                   | _descriptors(("T", "mT", "H", "mH", "real", "imag")))
# Conversions: the parameter itself where they change nothing, refused where they would.
_CONVERSIONS = frozenset(_functions(Tensor, ("to", "cuda", "cpu", "float", "half", "bfloat16", "double", "type",
                                             "contiguous", "type_as")))
_IN_PLACE_DUNDERS = frozenset(_functions(Tensor, (
    "__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
    "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__")))
_DATA_SET = Tensor.data.__set__


def _released(t: Tensor) -> bool:
    """Whether ``t`` has elements but its storage no bytes for them (call with the checks off)."""
    n = t.numel()
    return n > 0 and t.untyped_storage().nbytes() < (t.storage_offset() + n) * t.element_size()


def _registry():
    """The streamer's registry of streamed parameters (parameter -> its handle, which holds
    its name); streamer.py imports this module, so the lookup is made when needed."""
    from .streamer import _registry as registry  # noqa: PLC0415

    return registry


def _name(t: Tensor) -> str:
    handle = _registry().get(t)
    return handle.place.name if handle is not None else getattr(t, "_tierstate_name", "<streamed parameter>")


def _values(t: Tensor) -> Tensor:
    """The tensor whose storage a checked ``t`` uses: this rank's shard of an FSDP2 parameter,
    else ``t`` itself."""
    return t._local_tensor if type(t) in _SHARDED else t


def _first_released(args, kwargs) -> Tensor | None:
    for group in (args, kwargs.values() if kwargs else ()):
        for a in group:
            if type(a) in _ALL_CHECKED:
                if _released(_values(a)):
                    return a
            elif type(a) in (list, tuple):
                for b in a:
                    if type(b) in _ALL_CHECKED and _released(_values(b)):
                        return b
    return None


def _refuse_released(t: Tensor, what: str, error: type = RuntimeError) -> None:
    """Raise ``error`` (the read refusal) if ``t``'s storage is released."""
    with DisableTorchFunctionSubclass():
        if _released(_values(t)):
            raise error(str(refusal("read", what, t)))


def _describe(t: Tensor) -> str:
    if _SHARDED and type(t) in _SHARDED:
        kind, held = "StreamedDTensor", "its shard has no memory between its block's uses; this rank's shard"
    else:
        kind = "StreamedParameter" if isinstance(t, nn.Parameter) else "alias of StreamedParameter"
        held = "no memory between its block's uses; values"
    return (f"{kind}({_name(t)!r}, shape={tuple(t.shape)}, dtype={t.dtype}, device={t.device}: "
            f"streamed by tierstate.offload_weights, {held}: ws.read_param(p))")


def _call_name(func: Callable) -> str:
    name = getattr(func, "__name__", None) or repr(func)
    owner = getattr(func, "__self__", None)
    if name in ("__get__", "__set__") and owner is not None:
        name = f".{getattr(owner, '__name__', '?')}"
    return name


# What each refusal says after "<call>: parameter '<name>' is streamed (tierstate.offload_weights)".
_NO_MEMORY = " and holds no memory outside its block's forward and backward"
_READ = ("Read its values with ws.read_param(param) (a copy), or inside `with ws.gathered():` (all blocks; "
         "ws.gathered([i]) for block i)")
_WRITE = "set its values with ws.write_param(param, value) (the optimizer's master follows)"
_HOW = {
    "read": f"{_NO_MEMORY}. {_READ}; save the model with model.state_dict() or {{save}}",
    "alias": f"{_NO_MEMORY}, so it has no alias to give. {_READ}; {_WRITE}. torch's DistributedDataParallel "
             "reads every weight when it is built and keeps buckets of every gradient: across ranks, shard the "
             "blocks with FSDP2's fully_shard and stream the shards (docs/weights.md)",
    "write": f"{_NO_MEMORY}. {_WRITE[0].upper()}{_WRITE[1:]}, or load them with model.load_state_dict",
    "conversion": "; its dtype, device and layout are fixed when offload_weights is called. Convert the model "
                  "first (model.to(...), then ts.offload_weights(model, ...)); the compute device is "
                  "offload_weights' device argument",
}


def refusal(kind: str, what: str, t: Tensor) -> RuntimeError:
    """The error for a ``kind`` ("read", "alias", "write", "conversion") of call ``what`` on
    the streamed parameter ``t``."""
    save = "tierstate.save_weights"
    if _SHARDED and type(t) in _SHARDED or getattr(t, "_tierstate_shard", False):
        # an FSDP2 shard (or its to_local()): no DDP advice, and its model saves through DCP
        kind, save = "read" if kind == "alias" else kind, "torch.distributed.checkpoint"
    how = _HOW[kind].replace("{save}", save)
    return RuntimeError(f"{what}: parameter {_name(t)!r} is streamed (tierstate.offload_weights){how}")


def _probe(t: Tensor) -> Tensor:
    """A stand-in for ``t`` in a conversion: its dtype, device and rank (a layout change such
    as ``channels_last`` needs the rank), no elements (a 0-dim one: one)."""
    return torch.empty((0, *t.shape[1:]) if t.dim() else (), dtype=t.dtype, device=t.device)


def _is_write(func: Callable, kwargs) -> bool:
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or func in _IN_PLACE_DUNDERS or \
        (bool(kwargs) and kwargs.get("out") is not None)


def _checked_call(func, args, kwargs):
    """``__torch_function__`` of a streamed parameter, an alias of one, or an FSDP2 shard's
    DTensor (see the note), with torch functions off for subclasses: every call while the
    storage has memory (an alias or view coming back checked), metadata always, and a
    ``param.data = other`` never; a call when it has none goes to :func:`_on_released`."""
    if func in _METADATA:
        return func(*args, **kwargs)
    if func == _DATA_SET:  # (a new method-wrapper object at each access: equal, not identical)
        target, value = args[0], args[1]
        if value is not target and _registry().get(target) is not None:  # the parameter, not an alias of it
            raise refusal("write", "param.data = tensor (it would no longer be the block's)", target)
        return func(*args, **kwargs)
    held = _first_released(args, kwargs)
    if held is None:
        if (func in _ALIASING or func in _VIEWS) and args and type(args[0]) in _ALL_CHECKED:
            # an alias shares the block's storage: kept checked for when it has none
            # (``with ws.gathered(): kept = p.detach()``, read after, crashed)
            return _alias(func(*args, **kwargs), _name(args[0]))
        return func(*args, **kwargs)
    return _on_released(func, args, kwargs, held)


def _on_released(func, args, kwargs, held: Tensor):
    """What call ``func`` gets when ``held`` has no memory: torch's ``Module._save_to_state_dict``
    a checked alias (the entry the state-dict hooks replace with a copy, or keep as a
    placeholder where the copies would not fit in RAM), a conversion that changes nothing the
    parameter itself (tried on a stand-in), ``format`` the description; anything else is
    refused."""
    if func in _ALIASING:
        if sys._getframe(3).f_code is _SAVE_TO_STATE_DICT:  # (1: _checked_call, 2: __torch_function__)
            return _alias(func(*args, **kwargs), _name(held))
        raise refusal("alias", _call_name(func), held)
    if func in _CONVERSIONS:
        probe = _probe(_values(held))
        out = func(*(probe if a is held else a for a in args), **kwargs)
        if out is probe:
            return held
        if not isinstance(out, Tensor):
            return func(*args, **kwargs)  # Tensor.type() with no argument: its name
        raise refusal("conversion", f"Tensor.{_call_name(func)}", held)
    if func is Tensor.__format__:
        return format(_describe(held), *args[1:])
    raise refusal("write" if _is_write(func, kwargs) else "read", _call_name(func), held)


class _PlainCopies:
    """Pickling and ``copy.deepcopy`` of a checked tensor: refused (TypeError) while its storage
    is released, else made of the class it stands for (``nn.Parameter``, ``Tensor``,
    ``DTensor``): torch records ``type(self)`` to rebuild a pickled tensor, and ``torch.load``'s
    ``weights_only`` refused tierstate's class in the file; a copy has memory of its own (and
    torch's deepcopy of a wrapper subclass wants ``clone()`` to return the same class, which
    DTensor's does not)."""

    def __reduce_ex__(self, proto):
        _refuse_released(self, "pickling it (torch.save, pickle, multiprocessing)", TypeError)
        return _as_plain(self, lambda: self.__reduce_ex__(proto))

    def __deepcopy__(self, memo):
        _refuse_released(self, "copy.deepcopy", TypeError)
        return _as_plain(self, lambda: self.__deepcopy__(memo))


class _Checked:
    """The checks (see the note), shared by the parameter and its aliases."""

    @classmethod
    def __torch_function__(cls, func, types_, args=(), kwargs=None):
        with DisableTorchFunctionSubclass():
            return _checked_call(func, args, kwargs or {})

    def __repr__(self, *args, **kwargs) -> str:
        with DisableTorchFunctionSubclass():
            if _released(self):
                return _describe(self)
            prefix = "Parameter containing:\n" if isinstance(self, nn.Parameter) else ""
            return prefix + Tensor.__repr__(self, *args, **kwargs)

    __reduce_ex__ = _PlainCopies.__reduce_ex__
    __deepcopy__ = _PlainCopies.__deepcopy__


class StreamedParameter(_Checked, nn.Parameter):
    """An ``nn.Parameter`` whose values live in its block's storage only while the block runs
    (see [Note: touching a streamed parameter directly])."""


class _StreamedAlias(_Checked, Tensor):
    """``param.data`` / ``param.detach()`` / a view of a streamed parameter: checked once the
    parameter's storage is released."""


_PLAIN_OF: dict = {}  # the checking class -> the class it stands for (filled below)
_OWN_ATTRS = ("_tierstate_name", "_tierstate_shard")


def _as_plain(t: Tensor, call: Callable):
    """``call()`` with ``t`` seen as the class it stands for (``nn.Parameter``, ``Tensor``,
    ``DTensor``) and without tierstate's attributes: what torch pickles or copies of it names
    no tierstate class."""
    cls = type(t)
    own = {k: t.__dict__.pop(k) for k in _OWN_ATTRS if k in t.__dict__}
    t.__class__ = _PLAIN_OF[cls]
    try:
        return call()
    finally:
        t.__class__ = cls
        t.__dict__.update(own)


_CHECKED = (StreamedParameter, _StreamedAlias)
_PLAIN_OF.update({StreamedParameter: nn.Parameter, _StreamedAlias: Tensor})


if DTensor is not None:
    class StreamedDTensor(DTensor):
        """An FSDP2 parameter (a DTensor) whose shard lives in its block's storage only while
        FSDP2 gathers the block (see [Note: touching a streamed parameter directly])."""

        __slots__ = ()

        @classmethod
        def __torch_function__(cls, func, types_, args=(), kwargs=None):
            with DisableTorchFunctionSubclass():  # (DTensor's own is off: the call goes to its dispatch)
                return _checked_call(func, args, kwargs or {})

        __reduce_ex__ = _PlainCopies.__reduce_ex__
        __deepcopy__ = _PlainCopies.__deepcopy__

        def to_local(self, *args, **kwargs):
            _refuse_released(self, "DTensor.to_local (the shard)")
            local = _alias(super().to_local(*args, **kwargs), _name(self))  # checked once the shard is released
            local._tierstate_shard = True
            return local

        def full_tensor(self, *args, **kwargs):
            _refuse_released(self, "DTensor.full_tensor")
            return super().full_tensor(*args, **kwargs)

        def redistribute(self, *args, **kwargs):
            _refuse_released(self, "DTensor.redistribute")
            return super().redistribute(*args, **kwargs)

        def __repr__(self, *args, **kwargs) -> str:
            if _released(self._local_tensor):
                return _describe(self)
            return DTensor.__repr__(self, *args, **kwargs)

    _SHARDED: tuple = (StreamedDTensor,)
    _PLAIN_OF[StreamedDTensor] = DTensor
else:
    _SHARDED = ()
_ALL_CHECKED = _CHECKED + _SHARDED


def _alias(t, name: str):
    """A checked alias of what a view or alias call returned (kept as is when it holds no
    tensor): an FSDP2 shard's DTensor made a StreamedDTensor, any other tensor a _StreamedAlias."""
    if isinstance(t, (tuple, list)):  # split, chunk, unbind
        return type(t)(_alias(x, name) for x in t)
    if not isinstance(t, Tensor):
        return t
    if _SHARDED and type(t) is DTensor:
        t.__class__ = StreamedDTensor
        t._tierstate_name = name
        return t
    out = t.as_subclass(_StreamedAlias)
    out._tierstate_name = name
    return out


def _refuse_other_optimizers(optimizer, args, kwargs) -> None:
    """A global step pre-hook: torch's own optimizers (and others that write parameters) are
    refused over streamed weights before they change anything. (Without it torch's SGD
    updated the resident parameters, then stopped at the first streamed one.)"""
    if not _registry() or getattr(type(optimizer), "updates_streamed_weights", False):
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            if type(p) is StreamedParameter or type(p) in _SHARDED:
                raise RuntimeError(
                    f"{type(optimizer).__name__}.step(): parameter {_name(p)!r} is streamed "
                    "(tierstate.offload_weights), and this optimizer writes a parameter's memory, which a streamed "
                    "one has only while its block runs. Build a tierstate optimizer over the model (ts.AdamW, "
                    "ts.Adam, ts.SGD, ts.Lion, ts.Adagrad): it updates a streamed weight where it lives. Nothing "
                    "was changed")


_optimizer_hook: list = []


def mark(param: nn.Parameter) -> nn.Parameter:
    """Make ``param`` (a plain ``nn.Parameter``, or FSDP2's DTensor parameter, in place) a
    StreamedParameter (a StreamedDTensor); another subclass is left as it is. Its name is its
    streamer's (the registry)."""
    if not _optimizer_hook:
        _optimizer_hook.append(register_optimizer_step_pre_hook(_refuse_other_optimizers))
    if type(param) is nn.Parameter:
        param.__class__ = StreamedParameter
    elif _SHARDED and type(param) is DTensor:
        param.__class__ = StreamedDTensor
    return param


def unmark(param: Tensor) -> None:
    """Make ``param`` a plain ``nn.Parameter`` (a DTensor) again (its streamer closed)."""
    if type(param) is StreamedParameter:
        param.__class__ = nn.Parameter
    elif _SHARDED and type(param) in _SHARDED:
        param.__class__ = DTensor


def guard_conversions(modules) -> Callable[[], None]:
    """Check every streamed parameter under each module before ``Module._apply`` changes
    anything (``model.half()``, ``.to(dtype)``, ``.cuda()``); returns the undo."""
    installed = []
    for module in modules:
        if "_apply" in module.__dict__:
            continue
        original = type(module)._apply

        def _apply(self, fn, *args, _original=original, **kwargs):
            _check_conversion(self, fn)
            hidden = _hide_streamed(self)
            try:
                return _original(self, fn, *args, **kwargs)
            finally:
                _restore_streamed(hidden)

        module.__dict__["_apply"] = types.MethodType(_apply, module)
        installed.append(module)

    def undo() -> None:
        for m in installed:
            m.__dict__.pop("_apply", None)
    return undo


def _hide_streamed(module: nn.Module) -> list[tuple[dict, list[tuple[str, Any]]]]:
    """Take the streamed parameters out of every ``_parameters`` dict under ``module`` while
    ``Module._apply`` runs a conversion :func:`_check_conversion` found changes none of them.

    Under torch's future flags (``torch.__future__.set_swap_module_params_on_conversion`` or
    ``set_overwrite_module_params_on_conversion``) ``_apply`` wraps even an unchanged
    parameter in a new ``nn.Parameter`` and swaps it in or assigns it: that detached a
    released one and a no-op ``model.to("cpu")`` raised ("Couldn't swap LayerNorm.weight").
    Without the flags it assigns ``param.data = param``, which changes nothing either, so the
    streamed parameters skip the conversion in every mode (:func:`_check_conversion` ran it on
    each of them already, through their checks, so one that would touch their memory, as
    ``model.share_memory()`` does, was refused before anything changed). Returns what
    :func:`_restore_streamed` puts back, each dict in its own key order (the order of
    ``model.parameters()``, which optimizers' param groups follow)."""
    hidden = []
    for m in module.modules():
        params = m._parameters
        if any(type(p) is StreamedParameter for p in params.values()):
            before = list(params.items())
            hidden.append((params, before))
            for name, p in before:
                if type(p) is StreamedParameter:
                    del params[name]
    return hidden


def _restore_streamed(hidden: list[tuple[dict, list[tuple[str, Any]]]]) -> None:
    for params, before in hidden:
        now = dict(params)  # the other parameters as the conversion left them
        params.clear()
        params.update((name, p if type(p) is StreamedParameter else now.get(name, p)) for name, p in before)


def _check_conversion(module: nn.Module, fn: Callable[[Tensor], Any]) -> None:
    for p in module.parameters():
        if type(p) in _SHARDED:  # even a conversion that changes nothing: FSDP2 swaps every parameter for a new one
            raise RuntimeError(
                f"{type(module).__name__}._apply (model.to(), .half(), .cuda(), ...): parameter {_name(p)!r} is a "
                "shard streamed by tierstate.offload_weights, and FSDP2's _apply replaces every sharded parameter "
                "(torch.utils.swap_tensors), which would cut the shard from its block's storage. Move or convert "
                "the model before ts.offload_weights. Nothing was changed")
        if type(p) is not StreamedParameter:
            continue
        with torch.no_grad(), DisableTorchFunctionSubclass():
            probe = _probe(p)
            changed = fn(probe) is not probe
        if changed:
            raise refusal("conversion", f"{type(module).__name__}._apply (model.half(), .to(), .cuda(), ...)", p)
        with torch.no_grad():  # the parameter itself through its checks: an in-place function that
            fn(p)  # returns its argument (model.share_memory()) still touches the storage, and is refused
