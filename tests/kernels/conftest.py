"""Fixtures for the kernel tests."""
from __future__ import annotations

import pytest

import tierstate.kernels as K


@pytest.fixture
def isa_and_threads():
    """Restores the ISA variant, the thread count and the table-map lookup a test changes."""
    isa, threads = K.current_isa(), K.get_num_threads()
    yield
    K.set_isa(isa)
    K.set_num_threads(threads)
    K.set_q8_table_lookup("auto")
    K.set_q8_row_decode(True)
