"""CRC-32C of host buffers: known vectors, a pure-Python reference, every variant this CPU runs."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from io_helpers import native_or_skip


def _reference_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _reference_table()


def _reference(data: bytes, crc: int = 0) -> int:
    """Byte-at-a-time CRC-32C straight from the definition (reflected 0x1EDC6F41)."""
    c = crc ^ 0xFFFFFFFF
    for b in data:
        c = _TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def _isas():
    native_or_skip()
    import tierstate.io as tio

    return tio.crc32c_isas()


@pytest.fixture(params=["auto", "avx512-vpclmul", "pclmul", "sse4.2", "armv8-crc", "table"])
def isa(request):
    if request.param != "auto" and request.param not in _isas():
        pytest.skip(f"crc32c variant {request.param} does not run on this CPU/build")
    return None if request.param == "auto" else request.param


# RFC 3720 (iSCSI) B.4 test vectors, and the common check value
VECTORS = [
    (b"123456789", 0xE3069283),
    (bytes(32), 0x8A9136AA),
    (b"\xff" * 32, 0x62A8AB43),
    (bytes(range(32)), 0x46DD794E),
    (bytes(range(31, -1, -1)), 0x113FDB5C),
    (b"", 0),
]


@pytest.mark.parametrize("data,expected", VECTORS)
def test_known_vectors(isa, data, expected):
    import tierstate.io as tio

    assert tio.crc32c(data, isa=isa) == expected
    assert _reference(data) == expected


def test_random_sizes_and_alignments_match_the_reference(isa):
    import tierstate.io as tio

    rng = random.Random(7)
    blob = bytes(rng.getrandbits(8) for _ in range(3 * 8192 * 2 + 5000))
    # around the three-stream block sizes (3 x 8192, 3 x 256), the 8-byte steps, and the folding
    # loops' 256-byte start, 128-byte iterations and 16-byte tail
    sizes = [0, 1, 7, 8, 9, 255, 256, 257, 271, 383, 384, 767, 768, 769, 3 * 8192 - 1, 3 * 8192, 3 * 8192 + 13,
             2 * 3 * 8192 + 777]
    sizes += [rng.randrange(1, len(blob) - 16) for _ in range(12)]
    for size in sizes:
        for align in (0, 1, 3, 5, 8):
            piece = blob[align: align + size]
            assert tio.crc32c(piece, isa=isa) == _reference(piece), (size, align)


def test_continuation_and_buffer_kinds(isa):
    import tierstate.io as tio

    rng = np.random.default_rng(3)
    data = rng.integers(0, 256, 100_003, dtype=np.uint8)
    whole = tio.crc32c(data, isa=isa)
    assert tio.crc32c(data[40_000:], tio.crc32c(data[:40_000], isa=isa), isa=isa) == whole
    assert tio.crc32c(torch.from_numpy(data), isa=isa) == whole
    assert tio.crc32c(bytearray(data.tobytes()), isa=isa) == whole
    assert tio.crc32c(torch.from_numpy(data[:100_000]).view(torch.float32), isa=isa) == \
        tio.crc32c(data[:100_000], isa=isa)


def test_variants_agree_on_a_large_buffer():
    import tierstate.io as tio

    buf = tio.aligned_empty(8 << 20)
    buf.copy_(torch.randint(0, 256, (8 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)))
    values = {isa: tio.crc32c(buf, isa=isa) for isa in _isas()}
    assert len(set(values.values())) == 1, values
    assert _isas()[-1] == "table"


def test_bad_arguments_name_the_fix():
    import tierstate.io as tio

    _isas()
    with pytest.raises(ValueError, match="unknown crc32c variant 'avx9'"):
        tio.crc32c(b"x", isa="avx9")
    with pytest.raises(ValueError, match=r"value=-1"):
        tio.crc32c(b"x", -1)
    with pytest.raises(TypeError, match="not a buffer"):
        tio.crc32c(12345)


@pytest.mark.parametrize("threads", [1, 2, 3, 5])
def test_a_large_buffer_split_over_the_thread_pool_has_the_serial_crc(threads):
    """From 2 MiB the default variant splits the buffer over the kernels' thread pool and joins
    the parts (crc32c_combine); every split, odd length, unaligned start and continuation value
    must give the one-thread CRC of the same bytes."""
    import tierstate.io as tio
    from tierstate.kernels import backend

    serial = _isas()[0]  # a named variant never splits
    data = torch.randint(0, 256, ((6 << 20) + 4099,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    before = backend.get_num_threads()
    backend.set_num_threads(threads)
    try:
        for start, size in [(0, 2 << 20), (1, (2 << 20) - 1), (3, (2 << 20) + 1), (0, 3 << 20), (7, (6 << 20) + 61),
                            (64, 5 << 20), (0, data.numel())]:
            piece = data[start:start + size]
            assert tio.crc32c(piece) == tio.crc32c(piece, isa=serial), (threads, start, size)
            assert tio.crc32c(piece, 0x1234ABCD) == tio.crc32c(piece, 0x1234ABCD, isa=serial), (threads, start, size)
        head, tail = data[:(3 << 20) + 5], data[(3 << 20) + 5:]
        assert tio.crc32c(tail, tio.crc32c(head)) == tio.crc32c(data, isa="table")
    finally:
        backend.set_num_threads(before)
