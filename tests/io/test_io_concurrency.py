"""Many futures in flight at once, from several Python threads, on every backend."""
from __future__ import annotations

import threading

import numpy as np
import pytest

import tierstate.io as tio
from io_helpers import available_backends


@pytest.mark.parametrize("backend", available_backends())
def test_many_futures_in_flight(tmp_path, engine_cache, backend):
    engine = engine_cache(backend, 2, block_size=64 << 10)
    rng = np.random.default_rng(7)
    nreq, piece = 96, (192 << 10) + 5      # odd size: every request has buffered and direct parts
    chunks = [rng.integers(0, 256, piece, dtype=np.uint8) for _ in range(nreq)]
    with tio.File(tmp_path / "c.bin", "w+", engine=engine) as f:
        futs = [f.pwrite(c, offset=i * piece) for i, c in enumerate(chunks)]
        assert sum(fut.get() for fut in futs) == nreq * piece
        outs = [np.empty(piece, np.uint8) for _ in range(nreq)]
        futs = [f.pread(o, offset=i * piece) for i, o in enumerate(outs)]
        assert all(fut.get() == piece for fut in futs)
    for c, o in zip(chunks, outs):
        assert np.array_equal(c, o)


@pytest.mark.parametrize("backend", available_backends())
def test_python_threads_share_one_engine(tmp_path, engine_cache, backend):
    engine = engine_cache(backend, 4, block_size=64 << 10)
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            data = np.random.default_rng(k).integers(0, 256, (1 << 20) + k, dtype=np.uint8)
            with tio.File(tmp_path / f"t{k}.bin", "w+", engine=engine) as f:
                for rep in range(4):
                    f.write(data, offset=rep * 4099)
                    back = np.empty_like(data)
                    assert f.read(back, offset=rep * 4099) == data.nbytes
                    assert np.array_equal(back, data)
        except BaseException as exc:  # reported by the main thread below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_dropped_futures_and_close_wait_for_the_io(tmp_path, engine_cache):
    engine = engine_cache(available_backends()[-1], 2, block_size=64 << 10)
    path = tmp_path / "d.bin"
    with tio.File(path, "w", engine=engine) as f:
        for i in range(32):
            # the only reference to each buffer is inside the future, which is dropped
            f.pwrite(np.full(100_000, i, np.uint8), offset=i * 100_000)
    data = np.frombuffer(path.read_bytes(), np.uint8)
    assert data.size == 32 * 100_000
    assert np.array_equal(data.reshape(32, 100_000)[:, 0], np.arange(32))
    assert (data.reshape(32, 100_000) == np.arange(32)[:, None]).all()


def test_engine_close_finishes_queued_work(tmp_path):
    eng = tio.Engine(backend="threads", threads=1, block_size=4096)
    buf = np.arange(1 << 20, dtype=np.uint8)
    f = tio.File(tmp_path / "q.bin", "w+", engine=eng)
    futs = [f.pwrite(buf, offset=i << 20) for i in range(4)]
    eng.close()                                  # returns once the queue is drained
    assert all(fut.done() for fut in futs) and sum(fut.get() for fut in futs) == 4 << 20
    with pytest.raises(ValueError, match="shut down"):
        f.pwrite(buf)
    f.close()
