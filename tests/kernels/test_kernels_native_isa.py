"""The C++ kernels and thread pool without Python: NEON under qemu, the pool under stress.

tests/kernels/native_isa/ holds standalone drivers that link the real sources in
csrc/ (no nanobind, no torch):

- ``neon_check.cpp`` runs every op x dtype combination x size through the public C++
  face with the "neon" and the "scalar" variant and requires identical bits, checks
  weight_out against its own round-to-nearest-even, AdamW against a double-precision
  evaluation, grad_sumsq, and guard bytes around every buffer. The x86-64 machines we
  build on cannot run NEON, so it is cross-compiled for AArch64 and run under user-mode
  qemu (on an AArch64 machine it is compiled and run natively).
- ``q8_check.cpp`` does the same for the 8-bit (compressed-state) kernels: NEON against
  scalar, bit for bit, under qemu.
- ``crc32c_check.cpp`` checks every CRC-32C variant of csrc/io/crc32c.cpp against the
  portable table and the standard check value over every loop tail, start offset and
  continued CRC: natively (sse4.2, pclmul, avx512-vpclmul where the CPU has it) and, for the
  armv8-crc variant the NVMe records use on ARM machines, cross-compiled and run under qemu.
- ``thread_pool_stress.cpp`` runs 20,000 short jobs while the thread count changes
  between them. Under qemu, where starting a thread is slow, it hung the pool in 3 of 3
  runs of 2,000 jobs before workers started at the current job generation (see
  ThreadPool::start_workers); natively it passes either way, so it runs in both places.

Tools: a host C++ compiler, and for AArch64 ``aarch64-linux-gnu-g++`` plus
``qemu-aarch64`` (Debian/Ubuntu: ``apt-get install g++-aarch64-linux-gnu qemu-user``).
A test whose tools are missing is skipped with that reason.
"""
from __future__ import annotations

import atexit
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CSRC = REPO / "csrc"
DRIVERS = Path(__file__).resolve().parent / "native_isa"
# The flags CMakeLists.txt gives the module (GNU C++17: FMA contraction as in the wheel).
CXXFLAGS = ["-std=gnu++17", "-O3", "-fno-math-errno", "-Wall", "-Wextra", "-pthread", f"-I{CSRC}"]
NEON_SOURCES = ["kernels/dispatch.cpp", "kernels/kernels_scalar.cpp", "kernels/kernels_neon.cpp",
                "common/thread_pool.cpp", "common/cpu_features.cpp",
                "io/crc32c.cpp"]  # the lossless decode takes its record's CRC as it goes
INSTALL_HINT = "apt-get install g++-aarch64-linux-gnu qemu-user"
COMPILE_TIMEOUT_S = 300
# neon_check takes ~9 s (quick) / ~110 s (--full) under qemu on a loaded 2-core VM; the
# stress runs take ~2 s. A run past its limit is reported as a hang.
RUN_TIMEOUT_S = {"quick": 180, "full": 900, "stress": 180}

pytestmark = pytest.mark.skipif(not (CSRC / "kernels" / "body.h").is_file(),
                                reason=f"the C++ sources are not at {CSRC} (an installed copy of the tests?)")


def _aarch64_toolchain() -> tuple[list[str], list[str]] | None:
    """(compiler command, runner prefix) that builds and runs AArch64 code here, or None."""
    if platform.machine() in ("aarch64", "arm64"):
        cxx = shutil.which("g++") or shutil.which("c++")
        return ([cxx], []) if cxx else None
    cxx, qemu = shutil.which("aarch64-linux-gnu-g++"), shutil.which("qemu-aarch64")
    if cxx is None or qemu is None:
        return None
    # Static, so that qemu needs no AArch64 sysroot at run time.
    return [cxx, "-static"], [qemu]


# Object files by (compiler, source), shared by every binary of the test run: the NEON
# kernels went into neon_check and q8_check, each compile ~10 s under -O3 on 2 cores.
_OBJECTS: dict[tuple[tuple[str, ...], Path], Path] = {}
_OBJECT_DIR = Path(tempfile.mkdtemp(prefix="tierstate-native-isa-"))
atexit.register(shutil.rmtree, _OBJECT_DIR, True)


def _compile(compiler: list[str], sources: list[Path], out: Path) -> Path:
    """Build ``out`` from ``sources``: each source not yet compiled by ``compiler`` is
    compiled to an object, side by side, then all are linked."""
    todo = {src: _OBJECT_DIR / f"{len(_OBJECTS) + i}-{src.stem}.o"
            for i, src in enumerate(dict.fromkeys(s for s in sources if (tuple(compiler), s) not in _OBJECTS))}
    jobs = [(src, obj, [*compiler, *CXXFLAGS, "-c", str(src), "-o", str(obj)]) for src, obj in todo.items()]
    procs = [(src, obj, cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
             for src, obj, cmd in jobs]
    for src, obj, cmd, proc in procs:
        _, err = proc.communicate(timeout=COMPILE_TIMEOUT_S)
        assert proc.returncode == 0, f"compiling {src.name} failed:\n{' '.join(cmd)}\n{err[-4000:]}"
        _OBJECTS[(tuple(compiler), src)] = obj
    cmd = [*compiler, *CXXFLAGS, *(str(_OBJECTS[(tuple(compiler), s)]) for s in sources), "-o", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    assert done.returncode == 0, f"linking {out.name} failed:\n{' '.join(cmd)}\n{done.stderr[-4000:]}"
    return out


def _run(runner: list[str], binary: Path, args: list[str], limit_s: int) -> str:
    try:
        done = subprocess.run([*runner, str(binary), *args], capture_output=True, text=True, timeout=limit_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{binary.name} {' '.join(args)} did not finish within {limit_s} s: a hang (deadlock?)")
    assert done.returncode == 0, f"{binary.name} {' '.join(args)} failed (exit {done.returncode}):\n" \
                                 f"{done.stderr[-6000:]}{done.stdout[-2000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def aarch64(tmp_path_factory):
    """(runner prefix, build dir) for AArch64 binaries; skips without the toolchain."""
    toolchain = _aarch64_toolchain()
    if toolchain is None:
        pytest.skip(f"needs aarch64-linux-gnu-g++ and qemu-aarch64 to test the NEON kernels on "
                    f"{platform.machine()} ({INSTALL_HINT})")
    compiler, runner = toolchain
    return compiler, runner, tmp_path_factory.mktemp("aarch64")


@pytest.fixture(scope="module")
def neon_check(aarch64):
    compiler, runner, build = aarch64
    sources = [DRIVERS / "neon_check.cpp", *(CSRC / s for s in NEON_SOURCES)]
    return runner, _compile(compiler, sources, build / "neon_check")


def test_neon_matches_scalar_bit_for_bit(neon_check):
    runner, binary = neon_check
    out = _run(runner, binary, [], RUN_TIMEOUT_S["quick"])
    assert "all" in out and "checks passed" in out, out


def test_q8_neon_matches_scalar_bit_for_bit_under_qemu(aarch64, tmp_path):
    """The NEON variant of the 8-bit kernels against the scalar one, cross-compiled for
    AArch64 and run under qemu (tests/kernels/native_isa/q8_check.cpp says what it checks).
    In this file, not beside the other 8-bit kernel tests, so that it links the NEON objects
    neon_check compiled: pytest-xdist runs a file whole on one worker, and compiling them
    again in another worker cost ~32 s of CPU for the two kernel files alone (-O3, Zen 1 VM)."""
    import torch

    from tierstate.kernels import quant as Q

    compiler, runner, _ = aarch64
    maps = tmp_path / "maps.bin"
    with open(maps, "wb") as f:
        for qmap in (Q.signed_map(), Q.unsigned_map(), Q.fp8_signed_map(), Q.fp8_unsigned_map()):
            head = torch.tensor([qmap.lut32.numel(), qmap.lut_shift, qmap.lut_base, int(qmap.signed),
                                 qmap.fp8_mantissa_bits], dtype=torch.int32)
            for t in (head, torch.tensor([qmap.top], dtype=torch.float32), qmap.table, qmap.lut32):
                f.write(t.contiguous().numpy().tobytes())
    binary = _compile(compiler, [DRIVERS / "q8_check.cpp", *(CSRC / s for s in NEON_SOURCES)],
                      tmp_path / "q8_check")
    out = _run(runner, binary, [str(maps)], RUN_TIMEOUT_S["quick"])
    assert "checks passed" in out, out


@pytest.mark.slow
def test_neon_matches_scalar_bit_for_bit_full(neon_check):
    """Every chunked size for every combination and 2**20 + 3 elements for every case."""
    runner, binary = neon_check
    out = _run(runner, binary, ["--full"], RUN_TIMEOUT_S["full"])
    assert "checks passed" in out, out


def _stress_sources() -> list[Path]:
    return [DRIVERS / "thread_pool_stress.cpp", CSRC / "common" / "thread_pool.cpp"]


def test_thread_pool_survives_thread_count_changes_under_qemu(aarch64):
    compiler, runner, build = aarch64
    binary = _compile(compiler, _stress_sources(), build / "thread_pool_stress")
    out = _run(runner, binary, ["2000"], RUN_TIMEOUT_S["stress"])
    assert "2000 jobs clean" in out, out


def test_thread_pool_survives_thread_count_changes_natively(tmp_path):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("needs a host C++ compiler (g++ or c++) to build the thread pool stress test")
    binary = _compile([cxx], _stress_sources(), tmp_path / "thread_pool_stress")
    out = _run([], binary, ["20000"], RUN_TIMEOUT_S["stress"])
    assert "20000 jobs clean" in out, out


CRC_SOURCES = ["io/crc32c.cpp", "common/cpu_features.cpp", "common/thread_pool.cpp"]


def test_crc32c_armv8_variant_matches_the_table_under_qemu(aarch64):
    compiler, runner, build = aarch64
    sources = [DRIVERS / "crc32c_check.cpp", CSRC / "io" / "crc32c.cpp", CSRC / "common" / "thread_pool.cpp"]
    binary = _compile(compiler, sources, build / "crc32c_check")
    out = _run(runner, binary, ["armv8-crc"], RUN_TIMEOUT_S["stress"])
    assert "checks passed" in out and "armv8-crc" in out, out


def test_crc32c_x86_variants_match_the_table_natively(tmp_path):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("needs a host C++ compiler (g++ or c++) to build the CRC-32C check")
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"the x86 variants do not build on {platform.machine()} (the AArch64 one is checked above)")
    binary = _compile([cxx], [DRIVERS / "crc32c_check.cpp", *(CSRC / s for s in CRC_SOURCES)],
                      tmp_path / "crc32c_check")
    # every x86-64 VM we run on has SSE4.2 and PCLMULQDQ
    out = _run([], binary, ["sse4.2", "pclmul"], RUN_TIMEOUT_S["stress"])
    assert "checks passed" in out and "sse4.2" in out and "pclmul" in out, out
