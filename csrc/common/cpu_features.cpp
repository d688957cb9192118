// Runtime CPU feature detection. This file is compiled for the baseline ISA
// (x86-64-v2 or the AArch64 default) so it runs on every CPU it may probe.
#include "common/cpu_features.h"

#include <cstdint>

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#endif

namespace tierstate {
namespace {

#if defined(__x86_64__) || defined(_M_X64)
// xgetbv through inline asm: the _xgetbv intrinsic needs -mxsave, which the
// baseline translation unit is deliberately not compiled with.
uint64_t read_xcr0() {
  uint32_t eax = 0, edx = 0;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<uint64_t>(edx) << 32) | eax;
}

CpuFeatures detect() {
  CpuFeatures f;
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid(0, &eax, &ebx, &ecx, &edx)) return f;
  const unsigned max_leaf = eax;

  __get_cpuid(1, &eax, &ebx, &ecx, &edx);
  const bool osxsave = (ecx >> 27) & 1u;
  const bool avx = (ecx >> 28) & 1u;
  f.fma = (ecx >> 12) & 1u;
  f.f16c = (ecx >> 29) & 1u;
  if (osxsave && avx) {
    const uint64_t xcr0 = read_xcr0();
    f.os_saves_ymm = (xcr0 & 0x6u) == 0x6u;     // SSE + AVX state
    f.os_saves_zmm = (xcr0 & 0xE6u) == 0xE6u;   // + opmask, ZMM_Hi256, Hi16_ZMM
  }
  if (max_leaf >= 7) {
    __get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx);
    const unsigned max_subleaf = eax;
    f.avx2 = (ebx >> 5) & 1u;
    f.avx512f = (ebx >> 16) & 1u;
    f.avx512dq = (ebx >> 17) & 1u;
    f.avx512bw = (ebx >> 30) & 1u;
    f.avx512vl = (ebx >> 31) & 1u;
    f.avx512vbmi = (ecx >> 1) & 1u;
    if (max_subleaf >= 1) {
      __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx);
      f.avx512_bf16 = (eax >> 5) & 1u;
    }
  }
  return f;
}
#elif defined(__aarch64__)
CpuFeatures detect() {
  CpuFeatures f;
  f.neon = true;  // Advanced SIMD (incl. fp16<->fp32 conversion) is mandatory in ARMv8-A
  return f;
}
#else
CpuFeatures detect() { return CpuFeatures{}; }
#endif

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = detect();
  return features;
}

}  // namespace tierstate
