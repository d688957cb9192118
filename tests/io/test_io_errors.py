"""Failures become typed OSError subclasses carrying path, offset and errno: missing
files, wrong modes, reads past the end, a read-only filesystem, a full disk, space
reservation, and io_uring being refused by the kernel."""
from __future__ import annotations

import errno
import os
import platform
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import tierstate.io as tio
from io_helpers import available_backends, mounted, native_or_skip, remount_read_only


def test_open_missing_file_is_typed(tmp_path, engine):
    path = tmp_path / "missing" / "x.bin"
    with pytest.raises(tio.FileIONotFoundError) as info:
        tio.File(path, "r", engine=engine)
    err = info.value
    assert isinstance(err, FileNotFoundError) and isinstance(err, tio.FileIOError)
    assert err.errno == errno.ENOENT and err.filename == str(path) and err.offset is None


def test_exclusive_create_of_existing_file(tmp_path, engine):
    path = tmp_path / "e.bin"
    path.write_bytes(b"1")
    with pytest.raises(FileExistsError) as info:
        tio.File(path, "x", engine=engine)
    assert info.value.errno == errno.EEXIST


def test_write_on_read_only_handle_carries_offset(tmp_path, engine):
    path = tmp_path / "r.bin"
    path.write_bytes(bytes(8192))
    with tio.File(path, "r", engine=engine) as f:
        with pytest.raises(tio.FileIOError) as info:
            f.write(bytearray(4096), offset=4096)
    assert info.value.errno == errno.EBADF
    assert info.value.filename == str(path) and info.value.offset == 4096


@pytest.mark.parametrize("aligned", [True, False], ids=["aligned-buffer", "unaligned-buffer"])
@pytest.mark.parametrize("backend", available_backends())
def test_reads_past_eof_return_short_counts(tmp_path, engine_cache, backend, aligned):
    """Short counts at the end, and not one byte of the buffer touched past them: an aligned
    buffer takes the O_DIRECT path, whose last block would otherwise be written whole."""
    engine = engine_cache(backend, 2, block_size=4096)
    data = np.random.default_rng(1).integers(0, 256, 10_000, dtype=np.uint8)
    path = tmp_path / "eof.bin"
    path.write_bytes(data.tobytes())
    with tio.File(path, "r", engine=engine) as f:
        memory = tio.aligned_empty((64 << 10) + 1, 4096).numpy()
        buf = memory[:64 << 10] if aligned else memory[1:]
        buf[:] = 7
        assert f.read(buf, offset=0) == 10_000              # spans many 4 KiB tasks past the end
        assert np.array_equal(buf[:10_000], data) and (buf[10_000:] == 7).all()
        assert f.read(buf[:8192], offset=8000) == 2000      # straddles the end
        assert f.read(buf[:4096], offset=10_000) == 0       # at the end
        assert f.read(buf[:4096], offset=1 << 40) == 0      # far past it
        with pytest.raises(tio.ShortReadError) as info:
            f.read_exact(buf[:8192], offset=8000)
        assert isinstance(info.value, EOFError) and isinstance(info.value, OSError)
        assert (info.value.expected, info.value.got, info.value.offset) == (8192, 2000, 8000)
        assert f.read_exact(buf[:2000], offset=8000) == 2000


def test_bad_arguments_name_the_fix(tmp_path, engine):
    with tio.File(tmp_path / "b.bin", "w+", engine=engine) as f:
        with pytest.raises(ValueError, match="offset=-1"):
            f.write(bytearray(1), offset=-1)
        with pytest.raises(ValueError, match="read-only"):
            f.read(b"immutable")
        with pytest.raises(ValueError, match="non-contiguous"):
            f.write(torch.zeros(4, 4).t())
        with pytest.raises(TypeError, match="not a buffer"):
            f.write(12345)
    with pytest.raises(ValueError, match="closed"):
        f.write(bytearray(1))
    with pytest.raises(ValueError, match="mode='a'"):
        tio.File(tmp_path / "b.bin", "a", engine=engine)
    with pytest.raises(ValueError, match="block_size=1000"):
        tio.Engine(block_size=1000)
    with pytest.raises(ValueError, match="backend='spdk'"):
        tio.Engine(backend="spdk")
    with pytest.raises(ValueError, match="alignment=3"):
        tio.aligned_empty(10, alignment=3)


@pytest.mark.parametrize("alignment", [None, 512, 1 << 16])
def test_aligned_empty(alignment):
    native_or_skip()
    t = tio.aligned_empty(100_003, alignment)
    assert t.dtype == torch.uint8 and t.numel() == 100_003
    assert t.data_ptr() % (alignment or tio.DEFAULT_ALIGNMENT) == 0
    t.fill_(3)
    assert int(t.sum()) == 300_009


def test_aligned_empty_huge_pages():
    """Buffers of a huge page or more are huge-page aligned and asked to be backed by huge
    pages, MADV_HUGEPAGE: the mapping's "hg" flag (see aligned_empty: direct requests over
    4 KiB pages split at the device's segment limit). Whether the kernel then finds free
    huge pages is its business, not ours: on a fragmented VM it backed 6 of 8 MiB, or none."""
    native_or_skip()
    page = tio.huge_page_size()
    if page == 0:
        pytest.skip("transparent huge pages are off in this kernel (/sys/kernel/mm/transparent_hugepage)")
    big = tio.aligned_empty(4 * page)
    assert big.data_ptr() % page == 0
    big.fill_(1)
    assert "hg" in tio.mapping_fields(big.data_ptr())["VmFlags"].split()
    assert "hg" in tio.mapping_fields(big.data_ptr() + 4 * page - 1)["VmFlags"].split()
    small = tio.aligned_empty(page // 2)  # below one huge page: plain 4 KiB alignment suffices
    assert small.data_ptr() % tio.DEFAULT_ALIGNMENT == 0
    forced_off = tio.aligned_empty(4 * page, huge_pages=False)
    assert forced_off.data_ptr() % tio.DEFAULT_ALIGNMENT == 0 and forced_off.numel() == 4 * page


# ---- read-only filesystem ------------------------------------------------------------

@pytest.mark.parametrize("backend", available_backends())
def test_read_only_filesystem(tmp_path, engine_cache, backend):
    engine = engine_cache(backend, 1)
    with mounted(tmp_path, "tmpfs", 4) as mnt:
        (mnt / "existing.bin").write_bytes(b"abc" * 1000)
        os.sync()
        remount_read_only(mnt)
        with pytest.raises(tio.ReadOnlyFilesystemError) as info:
            tio.File(mnt / "new.bin", "w", engine=engine)
        assert info.value.errno == errno.EROFS and info.value.filename == str(mnt / "new.bin")
        with pytest.raises(tio.ReadOnlyFilesystemError):
            tio.File(mnt / "existing.bin", "r+", engine=engine)
        with tio.File(mnt / "existing.bin", "r", engine=engine) as f:   # reading still works
            buf = bytearray(3000)
            assert f.read(buf) == 3000 and bytes(buf) == b"abc" * 1000


# ---- a filesystem refusing O_DIRECT ----------------------------------------------------

@pytest.mark.parametrize("backend", available_backends())
def test_filesystem_refusing_o_direct_falls_back_to_buffered(tmp_path, engine_cache, backend, caplog):
    engine = engine_cache(backend, 2)
    with mounted(tmp_path, "ramfs", 0) as mnt:
        data = np.random.default_rng(2).integers(0, 256, (1 << 20) + 3, dtype=np.uint8)
        with caplog.at_level("WARNING", logger="tierstate"):
            f = tio.File(mnt / "r.bin", "w+", engine=engine)
        with f:
            assert not f.direct and "O_DIRECT refused" in f.direct_note and "Invalid argument" in f.direct_note
            assert f.write(data, offset=4096) == data.nbytes
            back = np.empty_like(data)
            assert f.read(back, offset=4096) == data.nbytes
            assert f.stats() == {"direct": 0, "bounced": 0, "buffered": 2 * data.nbytes}
        assert np.array_equal(back, data)
        assert "O_DIRECT refused" in caplog.text


# ---- full disk -----------------------------------------------------------------------

@pytest.mark.parametrize("fs", ["tmpfs", "ext4"])
@pytest.mark.parametrize("backend", available_backends())
def test_full_disk_raises_enospc_and_claims_nothing(tmp_path, engine_cache, fs, backend):
    engine = engine_cache(backend, 2)
    size_mib = 4 if fs == "tmpfs" else 8   # ext4 needs some room for its own metadata
    with mounted(tmp_path, fs, size_mib) as mnt:
        path = mnt / "big.bin"
        buf = tio.aligned_empty((size_mib + 4) << 20)
        buf.fill_(1)
        with tio.File(path, "w", engine=engine) as f:
            fut = f.pwrite(buf, offset=0)
            with pytest.raises(tio.DiskFullError) as info:
                fut.get()
            assert fut.done()
            with pytest.raises(tio.DiskFullError):   # asking again gives the same answer
                fut.get()
        err = info.value
        assert err.errno == errno.ENOSPC and err.filename == str(path)
        # the lowest failing offset: tasks run concurrently (io_uring may allocate the tail's blocks
        # first), so even offset 0 can be the one refused
        assert err.offset is not None and 0 <= err.offset < buf.numel()
        assert "No space left" in str(err)

        with pytest.raises(tio.DiskFullError) as res:
            tio.reserve(mnt / "reserved.bin", 64 << 20)
        msg = str(res.value)
        assert f"under {mnt}" in msg and "needs 0.0625 GiB" in msg and " B) free" in msg


def test_reserve_allocates_and_names_the_shortfall(tmp_path):
    path = tmp_path / "r.bin"
    tio.reserve(path, 3 << 20)
    st = os.stat(path)
    assert st.st_size == 3 << 20 and st.st_blocks * 512 >= 3 << 20
    tio.reserve(path, 3 << 20)   # already allocated: nothing more is needed
    with pytest.raises(tio.DiskFullError) as info:
        tio.reserve(tmp_path / "huge.bin", 1 << 60)
    assert info.value.errno == errno.ENOSPC
    assert "needs 1.07e+09 GiB" in str(info.value) and str(tmp_path) in str(info.value)
    assert not (tmp_path / "huge.bin").exists()


# ---- io_uring refused by the kernel ----------------------------------------------------

_SECCOMP_DENY_URING = textwrap.dedent("""
    import ctypes, json, struct
    # seccomp filter: io_uring_setup (x86-64 syscall 425) fails with EPERM, as in a
    # container whose runtime forbids io_uring; every other syscall is allowed.
    prog = [(0x20, 0, 0, 0),                 # A = seccomp_data.nr
            (0x15, 0, 1, 425),               # if A == __NR_io_uring_setup
            (0x06, 0, 0, 0x00050000 | 1),    #   return ERRNO(EPERM)
            (0x06, 0, 0, 0x7FFF0000)]        # return ALLOW
    raw = b"".join(struct.pack("HBBI", *ins) for ins in prog)
    filt = ctypes.create_string_buffer(raw)
    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
    fprog = Fprog(len(prog), ctypes.addressof(filt))
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(38, 1, 0, 0, 0) == 0                       # PR_SET_NO_NEW_PRIVS
    assert libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) == 0     # PR_SET_SECCOMP, FILTER
    import tierstate.io as tio
    out = {"available": tio.uring_available()}
    eng = tio.Engine(backend="auto")
    out["auto"] = [eng.backend, eng.backend_note]
    with tio.File(PATH, "w+", engine=eng) as f:
        out["written"] = f.write(bytearray(b"z" * 100_000), offset=3)
    eng.close()
    try:
        tio.Engine(backend="uring")
        out["forced"] = "no error"
    except OSError as e:
        out["forced"] = [type(e).__name__, e.errno, str(e)]
    print(json.dumps(out))
""")


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the seccomp filter hard-codes x86-64 syscall numbers")
def test_uring_refused_falls_back_to_threads(tmp_path):
    native_or_skip()
    import json

    code = f"PATH = {str(tmp_path / 'f.bin')!r}\n" + _SECCOMP_DENY_URING
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ.copy())
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["available"][0] is False and "EPERM" in out["available"][1]
    assert out["auto"][0] == "threads" and "EPERM" in out["auto"][1] and "thread pool" in out["auto"][1]
    assert out["written"] == 100_000
    assert out["forced"][1] == errno.EOPNOTSUPP and "EPERM" in out["forced"][2]
    assert (tmp_path / "f.bin").read_bytes() == bytes(3) + b"z" * 100_000


# ---- a short write is continued, then its error is raised with the exact offset ---------

_FSIZE_LIMIT = textwrap.dedent("""
    import json, resource, signal
    import numpy as np
    import tierstate.io as tio
    # RLIMIT_FSIZE makes the kernel cut a write short at the limit, and fail the next one
    # with EFBIG (SIGXFSZ ignored so that it is an errno, not a kill).
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, LIMIT))
    out = {}
    for backend in BACKENDS:
        eng = tio.Engine(backend=backend, threads=1, block_size=1 << 20)
        with tio.File(f"{PATH}.{backend}", "w", engine=eng) as f:
            try:
                f.write(np.ones(4 << 20, np.uint8))
                out[backend] = "no error"
            except OSError as e:
                out[backend] = [type(e).__name__, e.errno, e.offset]
        eng.close()
    print(json.dumps(out))
""")


def test_short_write_is_continued_then_raised(tmp_path):
    native_or_skip()
    import json

    limit = (1 << 20) + (512 << 10)   # inside the second 1 MiB task, 4 KiB aligned
    code = (f"PATH = {str(tmp_path / 'lim.bin')!r}\nLIMIT = {limit}\n"
            f"BACKENDS = {available_backends()!r}\n" + _FSIZE_LIMIT)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ.copy())
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for backend in available_backends():
        # the first failure is exactly at the limit: the short part before it was kept,
        # the continuation hit EFBIG, and later tasks fail at their own (higher) offsets
        assert out[backend] == ["FileIOError", errno.EFBIG, limit], (backend, out)
        assert os.path.getsize(tmp_path / f"lim.bin.{backend}") == limit


def test_huge_page_buffers_are_untouched_memory_even_where_malloc_would_reuse_some():
    """The huge-page advice only shapes pages faulted in after it: memory the C heap hands
    back after an earlier user touched it stays on 4 KiB pages (direct reads into it ran at
    1.3-1.7 GB/s against 2.8-3.0 on huge pages, Zen 4 VM). glibc serves a block from such
    memory once its mmap threshold has risen (it rises to the size of any mmapped block freed,
    up to 32 MiB, and host_allocator.retain_freed_memory() sends every block to the heap), so
    a huge-page buffer must be a fresh mapping of its own: no page present before first use."""
    import ctypes

    native_or_skip()
    page = tio.huge_page_size()
    if page == 0:
        pytest.skip("transparent huge pages are off in this kernel (/sys/kernel/mm/transparent_hugepage)")
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)
    libc.free(libc.malloc(24 << 20))  # an mmapped block freed: the threshold rises to 24 MiB
    held = []
    for _ in range(4):  # touched blocks from the heap, freed: what the next allocations reuse
        p = libc.malloc(12 << 20)
        ctypes.memset(p, 1, 12 << 20)
        held.append(p)
    guard = libc.malloc(4096)  # above them in the heap: their free space cannot be trimmed away
    for p in held:
        libc.free(p)
    bufs = [tio.aligned_empty(4 * page) for _ in range(3)]
    for buf in bufs:
        fields = tio.mapping_fields(buf.data_ptr())
        assert fields is not None and fields["Rss"] == "0 kB", f"a buffer on memory already touched: {fields}"
        assert fields["start"] <= buf.data_ptr() and buf.data_ptr() + buf.numel() <= fields["end"]
        assert "hg" in fields["VmFlags"].split()
        buf.fill_(2)
        assert int(buf[:: 1 << 20].sum()) == 2 * (buf.numel() >> 20)
    libc.free(guard)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes (add_note) are Python 3.11's")
def test_first_noting_others_names_each_other_file_once():
    """The error a step raises carries one note per other file and errno that failed in it
    (a full disk fails every record of its file: one note, not one per record)."""
    from tierstate.io import first_noting_others
    from tierstate.io.errors import io_error

    state = [io_error(errno.ENOSPC, "/disk1/state-0.bin", off, "write") for off in (0, 65536, 131072)]
    weights = io_error(errno.EIO, "/disk2/weights-0.bin", 0, "write")
    first = first_noting_others([None, *state, weights, None])
    assert first is state[0]
    assert first.__notes__ == [f"also failed in this step: FileIOError: {weights}"]
    assert first_noting_others([None]) is None
    alone = io_error(errno.EIO, "/disk2/weights-0.bin", 0, "write")
    assert first_noting_others([alone]) is alone and not getattr(alone, "__notes__", None)
