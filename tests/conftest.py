"""Session checks for the whole suite.

The native module: tests of the tiers, kernels and pipeline skip when ``tierstate._native``
cannot load, which is right for a source checkout nobody built, and wrong for an install
that built it (the README's ``pip install``): there a missing or broken module would let the
suite pass with no native code at all. So when the tierstate under test was installed with
the module (its file sits in the package, or the install's file list names one), a failure
to load it ends the run with an error before any test.
"""
from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

import pytest


def _native_expected() -> str | None:
    """Why the native module must load here, or None when this tierstate was never built."""
    import tierstate

    pkg = Path(tierstate.__file__).resolve().parent
    present = sorted(p.name for p in pkg.glob("_native*") if p.suffix in (".so", ".pyd"))
    if present:
        return f"{pkg / present[0]} is installed"
    try:
        dist = importlib.metadata.distribution("tierstate")
    except importlib.metadata.PackageNotFoundError:
        return None
    if Path(dist.locate_file("tierstate/__init__.py")).resolve().parent != pkg:
        return None  # the tierstate imported is not this install's (a checkout on sys.path)
    listed = [str(f) for f in dist.files or () if str(f).startswith("tierstate/_native") and
              str(f).endswith((".so", ".pyd"))]
    return f"the install of {pkg} lists {listed[0]}" if listed else None


# [Note: the suite runs on every core, one torch thread per worker]
# `pytest` runs the suite in pytest-xdist workers, one per CPU (at most 4: a few tests hold
# several GiB, and 24 GiB is this kind of machine's memory), each file whole on one worker
# (--dist loadfile, so a module's expensive fixture runs once). Most of the suite's time is
# subprocesses importing torch and waiting on them, which two workers overlap. Each worker's torch
# keeps cores / workers intra-op threads: with two workers of two OpenMP threads each, their
# spinning workers took turns on the two cores and tests/generate/test_generate_parity.py went
# from 5 s to 69 s. On a 2-vCPU AMD EPYC on 2026-12-03, one run after the other: 1588 s in one
# process, 939 s in two workers of two torch threads, 677 s in two workers of one (a clean
# clone's .ci/run then took 1048 s in all, pytest 794 s of it with the NEON checks under qemu).
# `pytest -n 0` runs it in one process (`-p no:xdist` would not: addopts names -n, which it unloads).
MAX_WORKERS = 4


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    # xdist's own "auto" counts physical cores (psutil): half the vCPUs where a VM presents them as
    # SMT siblings, and all of the machine's under taskset; this counts the CPUs the run may use
    return max(1, min(_cpus(), MAX_WORKERS))


def pytest_configure(config: pytest.Config) -> None:
    # Every child process the tests start (launched ranks, examples, the CLI) dumps the Python
    # stack of each of its threads if it dies of SIGABRT or SIGSEGV. A 2-rank torchrun example
    # aborted at exit once ("terminate called without an active exception") in a full 2-core
    # run on 2026-12-04 and in none of 38 launches after it, idle or loaded: the next such
    # failure must say which thread it was.
    os.environ.setdefault("PYTHONFAULTHANDLER", "1")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        torch.set_num_threads(max(1, _cpus() // workers))


def pytest_sessionstart(session: pytest.Session) -> None:
    from tierstate._native_loader import native_status

    why = _native_expected()
    loaded, error = native_status()
    if why is not None and not loaded:
        pytest.exit(f"the native module tierstate._native did not load although {why}: {error}. "
                    "Rebuild it (pip install .) rather than letting its tests skip.", returncode=3)


@pytest.fixture
def tiny_llama():
    """A factory of small random-init transformers Llamas (``tiny_llama(layers=2)``): hidden 64,
    MLP 172, 2 heads, vocabulary 128, untied head; skips where transformers is missing."""
    transformers = pytest.importorskip("transformers")
    import torch

    def make(layers: int = 2):
        cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=172, num_hidden_layers=layers,
                                       num_attention_heads=2, num_key_value_heads=2, vocab_size=128,
                                       max_position_embeddings=64, tie_word_embeddings=False)
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(cfg)

    return make


@pytest.fixture
def torch_pinned_bytes():
    """A function: the bytes torch's CachingHostAllocator holds now (``allocated_bytes.current``,
    or ``reserved_bytes.current`` where only that is kept), or None on a torch without
    ``torch.cuda.host_memory_stats`` (before 2.6). The CUDA tests compare it before and after
    tierstate page-locks memory of its own: it must not move."""
    import torch

    def held() -> int | None:
        if not hasattr(torch.cuda, "host_memory_stats"):
            return None
        stats = torch.cuda.host_memory_stats()
        key = next((k for k in ("allocated_bytes.current", "reserved_bytes.current") if k in stats), None)
        assert key is not None, f"host_memory_stats() has neither byte count: {sorted(stats)[:12]}"
        return stats[key]

    return held
