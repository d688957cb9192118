"""Helpers of the bench tests: a command's options parsed as its CLI parses them, and the skip
for a run without the native module (every tierstate mode refuses the reference kernels)."""
from __future__ import annotations

import argparse
from types import ModuleType

import pytest

from tierstate._native_loader import native_status


def parse_with(module: ModuleType, argv: list[str]) -> argparse.Namespace:
    """``argv`` parsed by the options ``module.add_arguments`` declares."""
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(argv)


def require_native() -> None:
    """Skip the calling test when tierstate._native did not load."""
    ok, why = native_status()
    if not ok:
        pytest.skip(f"tierstate._native did not load: {why}")
