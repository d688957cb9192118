"""A parameter's memory as the step needs it: one flat run of its elements.

[Note: parameters are updated through a flat view of their memory]
The step reads and writes each parameter as one flat run of elements (its own master, or
the weight written back from a separate master), as the native kernels and the NVMe
records take them; the state is kept in the same flat order, which is the parameter's
logical order only where its memory is contiguous. So a parameter that is not contiguous
(a transposed weight, a channels_last convolution, a slice with gaps between its elements)
is given contiguous memory of its own, with a warning: when the optimizer is built
(:func:`non_contiguous`, :func:`give_contiguous_memory`), and when its memory is replaced
between steps by memory laid out otherwise (``model.to(memory_format=torch.channels_last)``
after building the optimizer: :class:`tierstate.pipeline.user_writes.ParamMarks`), where
until 2026-12-07 the next step failed inside torch with "view size is not compatible with
input tensor's size and stride".
"""
from __future__ import annotations

import sys
import warnings

from torch import Tensor

from ..dist import is_dtensor, local_tensor
from .host import sole_owner


def _layout(i: int, p: Tensor) -> str:
    return f"params[{i}] (shape {tuple(p.shape)}, strides {tuple(p.stride())})"


def _dense(t: Tensor) -> bool:
    """Whether ``t``'s elements fill a block of memory once each, in some order of its dims."""
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _overlaps(t: Tensor) -> bool:
    """Whether two of ``t``'s elements may share a memory location (an expanded tensor): taken
    in order of stride, each dim must step past all the elements the smaller ones reach."""
    reach = 0
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1):
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False


def _no_other_tensor(t: Tensor) -> bool:
    """Whether no tensor but ``t`` is on its storage (see :func:`tierstate.tiers.host.sole_owner`,
    which also asks that ``t`` span all of it)."""
    storage = t.untyped_storage()
    return sole_owner(t, storage.nbytes())


def non_contiguous(tensors: list[Tensor]) -> list[int]:
    """The indices of the parameters that are not contiguous but can be moved by
    :func:`give_contiguous_memory` (a transposed weight, a channels_last convolution, a slice
    with gaps between its elements such as ``x[..., 0]``); raise ``ValueError``, naming the
    parameter and the fix, for one that cannot be moved without harm."""
    return [i for i, p in enumerate(tensors) if needs_own_memory(i, p)]


def needs_own_memory(i: int, p: Tensor, error: type[Exception] = ValueError) -> bool:
    """Whether ``params[i]`` is not contiguous and can be given memory of its own; raises
    ``error`` naming it and the fix where that would harm (see the note above)."""
    # the memory the step updates, in the parameter's own elements: a DTensor's shard, or a
    # complex parameter itself (a real view of it would be one more tensor on its storage)
    local = p if p.is_complex() else local_tensor(p)
    if local.is_contiguous():
        return False
    what = _layout(i, local)
    if is_dtensor(p):
        raise error(f"{what} is a DTensor whose local shard is not contiguous; tierstate updates a "
                    "parameter through a flat view of its memory: shard contiguous parameters (make the "
                    "module's parameters contiguous before fully_shard)")
    if _overlaps(local):
        raise error(f"{what} is not contiguous and its elements overlap in memory (an expanded tensor): "
                    "an update in place would write one location for several elements; give it memory "
                    "of its own: p.data = p.data.clone()")
    # dense (transposed, channels_last): it must span its storage alone; a slice with gaps
    # between its elements (x[..., 0]): no other tensor may be on its storage
    alone = (sole_owner(local, local.numel() * local.element_size()) if _dense(local)
             else _no_other_tensor(local))
    if not alone:
        raise error(
            f"{what} is not contiguous, and another tensor shares its memory (a view kept elsewhere, such as "
            "the tensor it was transposed or sliced from): tierstate updates a parameter through a flat view of "
            "its memory and would have to give this one memory of its own, which that tensor would not see; "
            "make it contiguous (p.data = p.data.contiguous(), or model.to(memory_format="
            "torch.contiguous_format)), or drop the other reference")
    return True


def give_contiguous_memory(moves: dict[int, Tensor], since_built: bool = False) -> None:
    """Give each parameter of ``moves`` (``params[i]`` by ``i``) contiguous memory of its own,
    its values copied, and warn once naming them. As when a parameter moves onto huge pages
    (``tiers.host``), the Parameter object, its name, hooks and ``requires_grad`` stay;
    ``param.data`` is replaced. ``since_built``: its memory was replaced after the optimizer
    was built (the warning says so)."""
    if not moves:
        return
    named = ", ".join(_layout(i, p) for i, p in moves.items())
    for p in moves.values():
        p.data = p.data.contiguous()
    how = ("given memory that is not contiguous since the optimizer was built" if since_built
           else "not contiguous")
    warnings.warn(
        f"{len(moves)} parameter{'s were' if len(moves) > 1 else ' was'} {how}: {named}; "
        "tierstate updates a parameter through a flat view of its memory, so each now has contiguous memory of "
        "its own, row-major (same values, same Parameter)", UserWarning, stacklevel=caller_level())


def caller_level() -> int:
    """The ``stacklevel`` of the first frame outside tierstate and torch: the line that built the
    optimizer or called ``add_param_group``, however many frames of theirs lie between."""
    frame, level = sys._getframe(1), 1
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not (name == "tierstate" or name.startswith(("tierstate.", "torch."))):
            return level
        frame, level = frame.f_back, level + 1
    return 1
