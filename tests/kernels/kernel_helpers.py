"""Shared helpers for the kernel tests: the ISA variants this machine runs, unaligned views."""
from __future__ import annotations

import pytest
import torch

import tierstate.kernels as K

NATIVE_ISAS = [isa for isa in K.available_isas() if isa != "reference"]
needs_native = pytest.mark.skipif(not NATIVE_ISAS, reason="tierstate._native is not built")


def unaligned_view(values: torch.Tensor, offset: int, dtype: torch.dtype) -> torch.Tensor:
    """``values`` copied into a larger NaN-filled buffer, starting ``offset`` elements in,
    so the view's data pointer is not vector-aligned and stray writes are detectable."""
    n = values.numel()
    buffer = torch.full((n + offset + 5,), float("nan"), dtype=dtype)
    view = buffer[offset : offset + n]
    view.copy_(values)
    return view
