"""Shared helpers for the kernel tests: the ISA variants this machine runs, unaligned views."""
from __future__ import annotations

import pytest
import torch

import tierstate.kernels as K

from tierstate._native_loader import native_status

NATIVE_ISAS = [isa for isa in K.available_isas() if isa != "reference"]
# The variants whose table-map lookups can go through a gather instruction as well as one
# load per lane (dispatch.cpp times both and keeps the faster): each way must give the same codes.
GATHER_ISAS = [isa for isa in NATIVE_ISAS if isa.startswith("avx")]
ISA_LOOKUPS = [(isa, "loads") for isa in NATIVE_ISAS] + [(isa, "gather") for isa in GATHER_ISAS]
# Without the native module every parity test would skip; test_kernels_faces.py's
# test_native_kernels_are_built fails then unless TIERSTATE_TEST_REFERENCE_ONLY=1 says that
# this run checks the pure-torch reference only, so a broken build cannot pass as skips.
REFERENCE_ONLY_ENV = "TIERSTATE_TEST_REFERENCE_ONLY"
needs_native = pytest.mark.skipif(
    not NATIVE_ISAS, reason=f"tierstate._native did not load: {native_status()[1]}")


def unaligned_view(values: torch.Tensor, offset: int, dtype: torch.dtype) -> torch.Tensor:
    """``values`` copied into a larger NaN-filled buffer, starting ``offset`` elements in,
    so the view's data pointer is not vector-aligned and stray writes are detectable."""
    n = values.numel()
    buffer = torch.full((n + offset + 5,), float("nan"), dtype=dtype)
    view = buffer[offset : offset + n]
    view.copy_(values)
    return view
