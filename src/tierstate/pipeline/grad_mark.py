"""Whether ``param.grad`` is still what some earlier reader saw: the same tensor at the same
version (torch bumps ``_version`` on every in-place change: ``clip_grad_norm_``,
``scaler.unscale_``, accumulation by another backward). The hooks' norms, the gradient stream's
copies and the update during backward each record a mark when they read a gradient and compare
it at ``step()``. The tensor is held weakly: a gradient released once read must be freed. An
in-place change made through ``.data`` escapes the version counter and is not seen.
"""
from __future__ import annotations

import weakref

from torch import Tensor

GradMark = tuple  # (weak reference to the gradient or None, its version or None)


def mark(grad: Tensor | None) -> GradMark:
    """What ``grad`` is now (None: no gradient)."""
    return (None, None) if grad is None else (weakref.ref(grad), grad._version)


def unchanged(m: GradMark, grad: Tensor | None) -> bool:
    """``grad`` is the tensor ``m`` recorded, not changed in place since (no gradient then and
    none now counts as unchanged; a released gradient's mark holds None)."""
    ref, version = m
    seen = None if ref is None else ref()
    return grad is seen and (grad is None or grad._version == version)
