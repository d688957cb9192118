"""Fixtures for the tier tests: the native I/O engine, and a private NVMe root per test."""
from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _native_io():
    from tierstate._native_loader import native, native_status

    if native() is None:
        pytest.skip(f"the native module did not load ({native_status()[1]}); build it with scripts/build_native.sh")


@pytest.fixture
def nvme_root(tmp_path, monkeypatch):
    """A real-disk folder used as TIERSTATE_NVME_DIR, so default run folders land there."""
    root = tmp_path / "nvme-root"
    monkeypatch.setenv("TIERSTATE_NVME_DIR", str(root))
    return root
