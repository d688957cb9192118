"""Fixtures for the I/O engine tests: engines per backend and thread count."""
from __future__ import annotations

import pytest

from io_helpers import native_or_skip


@pytest.fixture(scope="session")
def engine_cache():
    """Engines keyed by (backend, threads, block_size), shared across tests and closed at the end."""
    native_or_skip()
    import tierstate.io as tio

    cache: dict[tuple[str, int, int], tio.Engine] = {}

    def get(backend: str, threads: int, block_size: int = 256 << 10) -> tio.Engine:
        key = (backend, threads, block_size)
        if key not in cache:
            cache[key] = tio.Engine(backend=backend, threads=threads, queue_depth=8, block_size=block_size)
            assert cache[key].backend == backend
        return cache[key]

    yield get
    for eng in cache.values():
        eng.close()


@pytest.fixture
def engine(engine_cache):
    return engine_cache("threads", 2)


