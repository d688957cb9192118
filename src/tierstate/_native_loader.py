"""Loads the compiled ``tierstate._native`` module, or explains why it could not.

``TIERSTATE_NATIVE_PATH`` points at a specific build of the module (a developer's
``build/*/_native*.so``); otherwise the module installed beside this file is used.
When neither loads, tierstate falls back to its pure-torch reference kernels and the
I/O paths that need the engine raise; :func:`native_status` says why, and the first
use logs a warning once.
"""
from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
from types import ModuleType

_log = logging.getLogger("tierstate")
_module: ModuleType | None = None
_error: str | None = None
_loaded = False
_warned = False


def _load() -> None:
    global _module, _error, _loaded
    _loaded = True
    path = os.environ.get("TIERSTATE_NATIVE_PATH")
    try:
        if path:
            spec = importlib.util.spec_from_file_location("tierstate._native", path)
            if spec is None or spec.loader is None:
                raise ImportError(f"TIERSTATE_NATIVE_PATH={path!r} is not a loadable extension module")
            mod = importlib.util.module_from_spec(spec)
            sys.modules["tierstate._native"] = mod
            spec.loader.exec_module(mod)
            _module = mod
        else:
            _module = importlib.import_module("tierstate._native")
    except ImportError as exc:  # a missing or broken build: fall back, say why
        sys.modules.pop("tierstate._native", None)
        _module = None
        _error = f"{type(exc).__name__}: {exc}"


def native() -> ModuleType | None:
    """The native module, or None (with a one-time warning) when it cannot load."""
    global _warned
    if not _loaded:
        _load()
    if _module is None and not _warned:
        _warned = True
        _log.warning(
            "tierstate: the native module could not be loaded (%s); using the pure-torch "
            "reference kernels, which are several times slower. Reinstall with "
            "`pip install --no-build-isolation -e .` to build it.",
            _error,
        )
    return _module


def native_status() -> tuple[bool, str | None]:
    """(loaded, error message when not loaded)."""
    if not _loaded:
        _load()
    return _module is not None, _error
