"""Byte-exact round trips through the engine over sizes x threads x backends x
unaligned file offsets x unaligned buffer offsets, checked against plain os.pread."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import tierstate.io as tio
from io_helpers import available_backends

SIZES = [1, 511, 4096, 4097, (1 << 20) + 3, 64 << 20]
THREADS = [1, 2, 4]
FILE_OFFSETS = [0, 3 * 4096 + 7]   # aligned, and unaligned (both head and tail go buffered)
BUF_OFFSETS = [0, 1]               # aligned, and one byte off (the body goes through a bounce buffer)
SENTINEL = 0xA5


@pytest.fixture(scope="module")
def payload() -> np.ndarray:
    return np.random.default_rng(4).integers(0, 256, size=(64 << 20) + 8192, dtype=np.uint8)


def _os_pread(path, size, offset) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, size, offset)
    finally:
        os.close(fd)


@pytest.mark.parametrize("buf_offset", BUF_OFFSETS)
@pytest.mark.parametrize("file_offset", FILE_OFFSETS)
@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("backend", available_backends())
@pytest.mark.parametrize("size", SIZES)
def test_round_trip_is_byte_exact(tmp_path, engine_cache, payload, size, backend, threads,
                                  file_offset, buf_offset):
    engine = engine_cache(backend, threads)
    src = tio.aligned_empty(size + buf_offset)
    src.numpy()[buf_offset:] = payload[:size]
    dst = tio.aligned_empty(size + buf_offset + 64)
    dst.fill_(SENTINEL)
    path = tmp_path / "rt.bin"

    with tio.File(path, "w+", engine=engine) as f:
        assert f.pwrite(src[buf_offset:], offset=file_offset).get() == size
        assert f.size() == file_offset + size
        assert _os_pread(path, size, file_offset) == payload[:size].tobytes()

        got = f.pread(dst[buf_offset:buf_offset + size], offset=file_offset).get()
    assert got == size
    out = dst.numpy()
    assert np.array_equal(out[buf_offset:buf_offset + size], payload[:size])
    # nothing written outside the requested window of the destination
    assert (out[:buf_offset] == SENTINEL).all() and (out[buf_offset + size:] == SENTINEL).all()
    # the bytes before an unaligned file offset are a hole: zeros
    if file_offset:
        assert _os_pread(path, file_offset, 0) == bytes(file_offset)


def test_aligned_request_uses_o_direct_only(tmp_path, engine):
    buf = tio.aligned_empty(3 << 20)
    buf.random_(0, 256)
    with tio.File(tmp_path / "a.bin", "w+", engine=engine) as f:
        if not f.direct:
            pytest.skip(f"O_DIRECT unavailable here: {f.direct_note}")
        f.write(buf)
        f.read(buf)
        assert f.stats() == {"direct": 2 * buf.numel(), "bounced": 0, "buffered": 0}


def test_unaligned_offset_buffers_only_head_and_tail(tmp_path, engine):
    size, offset = (1 << 20) + 3, 7
    buf = tio.aligned_empty(size + 4096)
    with tio.File(tmp_path / "u.bin", "w+", engine=engine) as f:
        if not f.direct:
            pytest.skip(f"O_DIRECT unavailable here: {f.direct_note}")
        a = f.split_align  # the page, or DIOALIGN when larger: see File's docstring
        head = a - offset
        # keep the body's buffer address aligned so it goes direct, not bounced
        view = buf[a - head:a - head + size]
        f.write(view, offset=offset)
        s = f.stats()
        assert s["buffered"] == head + (size - head) % a
        assert s["direct"] == size - s["buffered"] and s["bounced"] == 0


def test_misaligned_buffer_is_bounced_not_buffered(tmp_path, engine):
    buf = tio.aligned_empty((1 << 20) + 1)
    buf.random_(0, 256)
    with tio.File(tmp_path / "b.bin", "w+", engine=engine) as f:
        if not f.direct:
            pytest.skip(f"O_DIRECT unavailable here: {f.direct_note}")
        if f.mem_align == 1:
            pytest.skip("the filesystem accepts any buffer address for O_DIRECT")
        f.write(buf[1:])
        assert f.stats() == {"direct": 0, "bounced": 1 << 20, "buffered": 0}
        back = torch.empty(1 << 20, dtype=torch.uint8)
        f.read(back)
        assert torch.equal(back, buf[1:])


def test_block_size_4k_splits_into_many_tasks(tmp_path, engine_cache, payload):
    engine = engine_cache(available_backends()[-1], 2, block_size=4096)
    size = (1 << 20) + 3
    with tio.File(tmp_path / "s.bin", "w+", engine=engine) as f:
        f.write(payload[:size], offset=5)
        back = np.empty(size, np.uint8)
        assert f.read(back, offset=5) == size
    assert np.array_equal(back, payload[:size])


@pytest.mark.parametrize("backend", available_backends())
def test_buffered_mode_round_trip(tmp_path, engine_cache, payload, backend):
    size = (1 << 20) + 3
    with tio.File(tmp_path / "nd.bin", "w+", direct=False, engine=engine_cache(backend, 2)) as f:
        assert not f.direct and "direct=False" in f.direct_note
        f.write(payload[:size], offset=11)
        back = bytearray(size)
        assert f.read(back, offset=11) == size
        assert f.stats()["direct"] == 0
    assert bytes(back) == payload[:size].tobytes()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_tensor_dtypes_round_trip(tmp_path, engine, dtype):
    t = (torch.randn(12345) * 100).to(dtype)
    back = torch.empty_like(t)
    with tio.File(tmp_path / "t.bin", "w+", engine=engine) as f:
        assert f.write(t) == t.numel() * t.element_size()
        f.read(back)
    assert torch.equal(t.view(torch.uint8), back.view(torch.uint8))


def test_numpy_bytearray_memoryview_bytes(tmp_path, engine):
    arr = np.arange(5000, dtype=np.float64)
    with tio.File(tmp_path / "n.bin", "w+", engine=engine) as f:
        f.write(arr)
        f.write(b"tail-bytes", offset=arr.nbytes)
        back = np.zeros_like(arr)
        f.read(back)
        raw = bytearray(arr.nbytes + 10)
        f.read(memoryview(raw)[100:], offset=100)
    assert np.array_equal(arr, back)
    assert bytes(raw[100:]) == arr.tobytes()[100:] + b"tail-bytes"


def test_size_argument_limits_the_transfer(tmp_path, engine):
    buf = bytearray(b"x" * 100)
    with tio.File(tmp_path / "z.bin", "w+", engine=engine) as f:
        assert f.write(buf, offset=0, size=10) == 10
        assert f.size() == 10
        assert f.write(buf, size=0) == 0
        with pytest.raises(ValueError, match="size=101"):
            f.write(buf, size=101)
