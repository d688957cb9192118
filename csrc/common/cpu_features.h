// What the CPU (and the OS, for the wide register state) lets the kernels use.
// Detected once from cpuid/xgetbv on x86-64; NEON is part of every AArch64 CPU.
#pragma once

namespace tierstate {

struct CpuFeatures {
  // x86-64
  bool avx2 = false;
  bool fma = false;
  bool f16c = false;
  bool avx512f = false;
  bool avx512bw = false;
  bool avx512vl = false;
  bool avx512dq = false;
  bool avx512_bf16 = false;
  bool avx512vbmi = false;  // byte permutes across a register (VPERMB, VPERMI2B)
  // The OS saves YMM (XCR0 bits 1-2) / ZMM and opmask state (XCR0 bits 5-7) on
  // context switches; without that the instructions exist but must not be used.
  bool os_saves_ymm = false;
  bool os_saves_zmm = false;
  // AArch64
  bool neon = false;

  bool can_run_avx2() const { return avx2 && fma && f16c && os_saves_ymm; }
  bool can_run_avx512() const {
    return avx512f && avx512bw && avx512vl && avx512dq && fma && f16c && os_saves_zmm;
  }
  bool can_run_avx512_bf16() const { return can_run_avx512() && avx512_bf16; }
  bool can_run_avx512_vbmi() const { return can_run_avx512() && avx512vbmi; }
};

// Detected on first call; later calls return the same object.
const CpuFeatures& cpu_features();

}  // namespace tierstate
