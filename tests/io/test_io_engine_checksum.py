"""``checksum=True``: the engine's checksum thread takes the CRC-32C of the bytes a request moves.

The NVMe tier relies on it to check every record it reads and to note the CRC of every
record it writes, so the value must be exactly :func:`tierstate.io.crc32c` of those
bytes whatever path each piece took (O_DIRECT, bounced, buffered head and tail), however
many tasks the request was split into and whichever order they finished in.
"""
from __future__ import annotations

import numpy as np
import pytest

import tierstate.io as tio
from io_helpers import available_backends

SIZES = [1, 4095, 4096, 3 * (256 << 10) + 17, 8 << 20]  # one task; several tasks of the 256 KiB engines
FILE_OFFSETS = [0, 4096 + 7]  # aligned; unaligned (buffered head and tail)
BUF_OFFSETS = [0, 1]  # aligned; one byte off (the body bounces)


@pytest.fixture(scope="module")
def payload() -> np.ndarray:
    return np.random.default_rng(11).integers(0, 256, size=(8 << 20) + 4096, dtype=np.uint8)


@pytest.mark.parametrize("buf_offset", BUF_OFFSETS)
@pytest.mark.parametrize("file_offset", FILE_OFFSETS)
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("backend", available_backends())
@pytest.mark.parametrize("size", SIZES)
def test_the_engines_crc_is_the_crc_of_the_bytes_moved(tmp_path, engine_cache, payload, size, backend, threads,
                                                        file_offset, buf_offset):
    engine = engine_cache(backend, threads)
    src = tio.aligned_empty(size + buf_offset)
    src.numpy()[buf_offset:] = payload[:size]
    dst = tio.aligned_empty(size + buf_offset)
    want = tio.crc32c(payload[:size].tobytes())
    with tio.File(tmp_path / "c.bin", "w+", engine=engine) as f:
        wrote = f.pwrite(src[buf_offset:], offset=file_offset, checksum=True)
        assert wrote.get() == size
        assert wrote.crc() == want
        read = f.pread(dst[buf_offset:], offset=file_offset, checksum=True)
        assert read.get() == size
        assert read.crc() == want
    assert np.array_equal(dst.numpy()[buf_offset:], payload[:size])


@pytest.mark.parametrize("backend", available_backends())
def test_a_read_past_the_end_checksums_what_it_read(tmp_path, engine_cache, payload, backend):
    engine = engine_cache(backend, 2)
    have = (256 << 10) * 2 + 100  # the file ends inside the third task
    with tio.File(tmp_path / "short.bin", "w+", engine=engine) as f:
        f.write(payload[:have].copy())
        buf = tio.aligned_empty(1 << 20)
        fut = f.pread(buf, 0, checksum=True)
        assert fut.get() == have
        assert fut.crc() == tio.crc32c(payload[:have].tobytes())


def test_an_empty_request_has_the_crc_of_nothing(tmp_path, engine):
    with tio.File(tmp_path / "e.bin", "w+", engine=engine) as f:
        fut = f.pwrite(tio.aligned_empty(4096), 0, size=0, checksum=True)
        assert fut.get() == 0
        assert fut.crc() == tio.crc32c(b"") == 0


def test_crc_without_checksum_names_the_argument(tmp_path, engine):
    with tio.File(tmp_path / "n.bin", "w+", engine=engine) as f:
        fut = f.pwrite(tio.aligned_empty(4096), 0)
        fut.get()
        with pytest.raises(ValueError, match="checksum=true"):
            fut.crc()


def test_a_request_failed_before_the_disk_has_no_crc(tmp_path, engine):
    from tierstate.io.faults import fail_nth

    with tio.File(tmp_path / "f.bin", "w+", engine=engine) as f, fail_nth("write", 1):
        fut = f.pwrite(tio.aligned_empty(4096), 0, checksum=True)
        with pytest.raises(OSError):
            fut.get()
        with pytest.raises(ValueError, match="failed before reaching the disk"):
            fut.crc()
