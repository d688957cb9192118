"""Which implementation the kernel faces run: the native ISA variant, or the reference.

The native module offers one kernel table per instruction-set variant, widest first:
``avx512_bf16`` (AVX-512 with the CPU's own bf16 rounding), ``avx512``, ``avx2``
(AVX2 + FMA + F16C), ``neon`` (AArch64) and ``scalar``. ``auto`` picks the widest the
CPU and OS support; ``reference`` runs the pure-torch code in ``reference.py``.

Environment, read on first use:
- ``TIERSTATE_ISA``: one of the names above (default ``auto``).
- ``TIERSTATE_NUM_THREADS``: threads per kernel call (default: the CPUs this process
  may run on, ``os.sched_getaffinity``, divided by ``LOCAL_WORLD_SIZE`` so that the
  ranks of one node do not oversubscribe it).
"""
from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from types import ModuleType
from typing import Any

from .._native_loader import native, native_status

_log = logging.getLogger("tierstate")

REFERENCE = "reference"
AUTO = "auto"

_configured = False
_use_reference = False
_num_threads: int | None = None


def default_num_threads() -> int:
    """Threads per kernel call when nothing is configured: this process's CPUs / local ranks."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity API (macOS): all CPUs
        cpus = os.cpu_count() or 1
    local_world = _positive_int_env("LOCAL_WORLD_SIZE") or 1
    return max(1, cpus // local_world)


def _positive_int_env(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{name}={raw!r} must be a positive integer; unset it or set e.g. {name}=2")
    return value


_stale_warned = False


def _kernel_module() -> ModuleType | None:
    """``tierstate._native.kernels``, or None when the module (or that part of it) is missing."""
    global _stale_warned
    mod = native()
    if mod is None:
        return None
    kernels = getattr(mod, "kernels", None)
    if kernels is None and not _stale_warned:
        _stale_warned = True
        _log.warning("tierstate: the native module at %s has no kernels (an old build?); using the "
                     "pure-torch reference kernels. Rebuild it with `pip install --no-build-isolation -e .`",
                     getattr(mod, "__file__", "?"))
    return kernels


def _configure(kernels: ModuleType | None) -> None:
    """Applies TIERSTATE_NUM_THREADS / TIERSTATE_ISA on first use; a bad value raises
    on every use until it is fixed."""
    global _configured, _num_threads
    if _num_threads is None:
        _num_threads = _positive_int_env("TIERSTATE_NUM_THREADS") or default_num_threads()
    if kernels is not None:
        kernels.set_num_threads(_num_threads)
    isa = os.environ.get("TIERSTATE_ISA", "").strip()
    if isa:
        try:
            _select(isa)
        except ValueError as exc:
            raise ValueError(f"environment variable TIERSTATE_ISA: {exc}") from None
    _configured = True


def native_kernels() -> ModuleType | None:
    """The native kernel module when it loads and the reference is not forced, else None."""
    kernels = _kernel_module()
    if not _configured:
        _configure(kernels)
    if kernels is None or _use_reference:
        return None
    return kernels


def available_isas() -> list[str]:
    """Variants this CPU and build can run, widest first, then ``"reference"``."""
    kernels = _kernel_module()
    names = list(kernels.available_isas()) if kernels is not None else []
    return names + [REFERENCE]


def current_isa() -> str:
    """The variant the faces use now (``"reference"`` for the pure-torch code)."""
    kernels = native_kernels()
    return REFERENCE if kernels is None else str(kernels.current_isa())


def set_isa(name: str) -> None:
    """Forces an ISA variant: ``"auto"``, ``"avx512_bf16"``, ``"avx512"``, ``"avx2"``,
    ``"neon"``, ``"scalar"`` or ``"reference"`` (pure torch).

    Raises ValueError when this CPU/build cannot run ``name`` (the message lists what it can).
    """
    if not isinstance(name, str):
        raise TypeError(f"set_isa: name must be a str such as 'auto' or 'avx2', got {type(name).__name__}")
    if not _configured:
        _configure(_kernel_module())  # so that TIERSTATE_ISA does not override this call later
    _select(name)


def _select(name: str) -> None:
    global _use_reference
    name = name.strip().lower()
    kernels = _kernel_module()
    if name == REFERENCE or (name == AUTO and kernels is None):
        _use_reference = name == REFERENCE
        return
    if kernels is None:
        _, error = native_status()
        raise ValueError(
            f"set_isa({name!r}): the native module is not loaded ({error}); only 'reference' "
            "is available. Build it with `pip install --no-build-isolation -e .`"
        )
    try:
        kernels.set_isa(name)
    except ValueError as exc:
        raise ValueError(f"set_isa({name!r}): {exc}; available: {', '.join(available_isas())}") from None
    _use_reference = False


@contextlib.contextmanager
def use_isa(name: str) -> Iterator[None]:
    """Runs the body with ISA variant ``name``, then restores the previous one."""
    previous = current_isa()
    set_isa(name)
    try:
        yield
    finally:
        set_isa(previous)


def set_num_threads(n: int) -> None:
    """Threads per kernel call, the caller included (overrides TIERSTATE_NUM_THREADS)."""
    global _num_threads
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"set_num_threads: n must be a positive int, got {n!r}")
    _num_threads = n
    kernels = _kernel_module()
    if not _configured:
        _configure(kernels)
    if kernels is not None:
        kernels.set_num_threads(n)


def get_num_threads() -> int:
    """Threads per kernel call, the caller included."""
    native_kernels()  # applies the defaults on first use
    return _num_threads if _num_threads is not None else default_num_threads()


# The modes of set_q8_table_lookup.
TABLE_LOOKUPS = ("auto", "gather", "loads")


def q8_table_lookup() -> str:
    """How the current variant looks up the codes of the table maps (``quant_map="dynamic"``):
    ``"gather"`` (the ISA's gather instruction) or ``"loads"`` (a scalar load per lane).

    Under ``"auto"`` (the default) a variant times both at its first table-map call (~1 ms);
    asked before that, this makes that call. Both give the same codes. Variants without a
    gather (scalar, NEON) and the pure-torch reference answer ``"loads"``.
    """
    kernels = native_kernels()
    if kernels is None:
        return "loads"
    choice = str(kernels.q8_table_lookup())
    if choice == "untimed":
        import torch

        from .ops import quantize_blockwise
        from .quant import signed_map

        quantize_blockwise(torch.zeros(256), signed_map(), 256)
        choice = str(kernels.q8_table_lookup())
    return choice


def set_q8_table_lookup(mode: str) -> None:
    """Fixes how the table maps' codes are looked up: ``"auto"`` (the default: each ISA
    variant times both at its first table-map call and keeps the faster), ``"gather"`` or
    ``"loads"``. The codes are the same either way; only the speed differs. A no-op
    without the native module."""
    if not isinstance(mode, str) or mode not in TABLE_LOOKUPS:
        raise ValueError(f"set_q8_table_lookup(mode={mode!r}): must be one of {', '.join(TABLE_LOOKUPS)}")
    kernels = native_kernels()
    if kernels is not None:
        kernels.set_q8_table_lookup(mode)


def q8_row_decode() -> bool:
    """Whether the current variant decodes the table maps' codes a block at a time, by byte
    permutes through the table's four byte planes (the AVX-512 variants on a CPU with
    AVX512-VBMI: Zen 4, Ice Lake and later Xeons), instead of per vector as
    :func:`q8_table_lookup` says. The encoder's lookups are unaffected. Same values either way."""
    kernels = native_kernels()
    return bool(kernels.q8_row_decode()) if kernels is not None else False


def set_q8_row_decode(on: bool) -> None:
    """Allows (``True``, the default) or forbids the block-at-a-time decode of
    :func:`q8_row_decode`; forbidding it is for comparisons and tests. A no-op without the
    native module."""
    if not isinstance(on, bool):
        raise TypeError(f"set_q8_row_decode(on={on!r}): must be True or False")
    kernels = native_kernels()
    if kernels is not None:
        kernels.set_q8_row_decode(on)


def backend_info() -> dict[str, Any]:
    """What runs the kernels: ``{"native": bool, "isa": str, "threads": int,
    "available_isas": [...], "q8_table_lookup": str, "q8_row_decode": bool,
    "native_error": str | None}``."""
    loaded, error = native_status()
    return {
        "native": loaded and _kernel_module() is not None,
        "isa": current_isa(),
        "threads": get_num_threads(),
        "available_isas": available_isas(),
        "q8_table_lookup": q8_table_lookup(),
        "q8_row_decode": q8_row_decode(),
        "native_error": error,
    }


def record_worker_spans(on: bool) -> None:
    """Start (``True``) or stop and discard (``False``) recording when each kernel thread
    works; read them with :func:`drain_worker_spans`. A no-op without the native module."""
    kernels = native_kernels()
    if kernels is not None:
        kernels.record_worker_spans(bool(on))


def drain_worker_spans() -> list[tuple[int, float, float]]:
    """Recorded kernel-thread busy spans as ``(thread, start_s, end_s)`` on the clock of
    ``time.perf_counter()`` (CLOCK_MONOTONIC on Linux); thread 0 is the caller. Clears them."""
    kernels = native_kernels()
    if kernels is None:
        return []
    return [(w, a / 1e9, b / 1e9) for w, a, b in kernels.drain_worker_spans()]
