"""Import a script of the checkout's ``benchmarks/`` folder (not a package, not installed) by path."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as the module ``benchmarks_<name>`` (loaded once)."""
    module_name = f"benchmarks_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # before running it: its dataclasses look their module up
    spec.loader.exec_module(module)
    return module
