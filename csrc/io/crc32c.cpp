// CRC-32C in three variants; see crc32c.h.
//
// The hardware loops run three independent CRC streams over three adjacent blocks and
// join them with a "shift by n zero bytes" operator (M. Adler's method): the crc32
// instruction has a latency of 3 cycles and a throughput of 1 per cycle on x86 cores
// since Nehalem, so one stream reaches a third of what the unit can do. On the
// reference VM (Zen 4) three streams measured 11 GB/s per core (CPU time, 64 MiB buffer).
#include "io/crc32c.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "common/faster_of_two.h"
#include "common/thread_pool.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#include <nmmintrin.h>

#include "common/cpu_features.h"
#define TIERSTATE_CRC_X86 1
#elif defined(__aarch64__) && defined(__linux__)
#include <arm_acle.h>
#include <asm/hwcap.h>
#include <sys/auxv.h>
#define TIERSTATE_CRC_ARM 1
#endif

namespace tierstate::io {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // reflected 0x1EDC6F41

// ---- portable: slicing-by-8 -----------------------------------------------------------
struct Tables {
  uint32_t byte[8][256];
  // Operators that append 8192 and 256 zero bytes to a CRC state (the block sizes of
  // the three-stream loops), as four 256-entry tables each.
  uint32_t long_zeros[4][256];
  uint32_t short_zeros[4][256];
};

uint32_t gf2_times(const uint32_t* mat, uint32_t vec) {
  uint32_t sum = 0;
  while (vec) {
    if (vec & 1) sum ^= *mat;
    vec >>= 1;
    ++mat;
  }
  return sum;
}

void gf2_square(uint32_t* square, const uint32_t* mat) {
  for (int n = 0; n < 32; ++n) square[n] = gf2_times(mat, mat[n]);
}

// The operator that appends ``len`` zero bytes (``len`` a power of two).
void zeros_op(uint32_t* even, size_t len) {
  uint32_t odd[32];
  odd[0] = kPoly;  // one zero bit
  uint32_t row = 1;
  for (int n = 1; n < 32; ++n) {
    odd[n] = row;
    row <<= 1;
  }
  gf2_square(even, odd);  // two zero bits
  gf2_square(odd, even);  // four
  // eight zero bits (one byte) and up, squaring once per halving of len
  do {
    gf2_square(even, odd);
    len >>= 1;
    if (len == 0) return;
    gf2_square(odd, even);
    len >>= 1;
  } while (len);
  std::memcpy(even, odd, sizeof(odd));
}

void zeros_table(uint32_t zeros[4][256], size_t len) {
  uint32_t op[32];
  zeros_op(op, len);
  for (uint32_t n = 0; n < 256; ++n) {
    zeros[0][n] = gf2_times(op, n);
    zeros[1][n] = gf2_times(op, n << 8);
    zeros[2][n] = gf2_times(op, n << 16);
    zeros[3][n] = gf2_times(op, n << 24);
  }
}

const Tables& tables() {
  static const Tables* t = [] {
    auto* tab = new Tables;
    for (uint32_t n = 0; n < 256; ++n) {
      uint32_t c = n;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
      tab->byte[0][n] = c;
    }
    for (uint32_t n = 0; n < 256; ++n) {
      uint32_t c = tab->byte[0][n];
      for (int k = 1; k < 8; ++k) {
        c = tab->byte[0][c & 0xff] ^ (c >> 8);
        tab->byte[k][n] = c;
      }
    }
    zeros_table(tab->long_zeros, 8192);
    zeros_table(tab->short_zeros, 256);
    return tab;
  }();
  return *t;
}

inline uint32_t shift(const uint32_t zeros[4][256], uint32_t crc) {
  return zeros[0][crc & 0xff] ^ zeros[1][(crc >> 8) & 0xff] ^ zeros[2][(crc >> 16) & 0xff] ^
         zeros[3][crc >> 24];
}

uint32_t crc_table(uint32_t crc, const void* data, size_t len) {
  const Tables& t = tables();
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t c = ~crc;
  while (len && (reinterpret_cast<uintptr_t>(p) & 7)) {
    c = t.byte[0][(c ^ *p++) & 0xff] ^ (c >> 8);
    --len;
  }
  while (len >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    w ^= c;  // little endian: the low four bytes meet the running CRC
    c = t.byte[7][w & 0xff] ^ t.byte[6][(w >> 8) & 0xff] ^ t.byte[5][(w >> 16) & 0xff] ^
        t.byte[4][(w >> 24) & 0xff] ^ t.byte[3][(w >> 32) & 0xff] ^ t.byte[2][(w >> 40) & 0xff] ^
        t.byte[1][(w >> 48) & 0xff] ^ t.byte[0][w >> 56];
    p += 8;
    len -= 8;
  }
  while (len--) c = t.byte[0][(c ^ *p++) & 0xff] ^ (c >> 8);
  return ~c;
}

// ---- hardware: the same loop over the instruction of each architecture -----------------
#define TIERSTATE_CRC_HW_BODY(CRC8, CRC64)                                          \
  const Tables& t = tables();                                                       \
  const auto* p = static_cast<const unsigned char*>(data);                          \
  uint64_t c0 = static_cast<uint32_t>(~crc);                                        \
  while (len && (reinterpret_cast<uintptr_t>(p) & 7)) {                             \
    c0 = CRC8(static_cast<uint32_t>(c0), *p++);                                     \
    --len;                                                                          \
  }                                                                                 \
  for (size_t block : {size_t(8192), size_t(256)}) {                                \
    const auto& zeros = block == 8192 ? t.long_zeros : t.short_zeros;               \
    while (len >= 3 * block) {                                                      \
      uint64_t c1 = 0, c2 = 0;                                                      \
      const unsigned char* end = p + block;                                         \
      do {                                                                          \
        uint64_t a, b, d;                                                           \
        std::memcpy(&a, p, 8);                                                      \
        std::memcpy(&b, p + block, 8);                                              \
        std::memcpy(&d, p + 2 * block, 8);                                          \
        c0 = CRC64(c0, a);                                                          \
        c1 = CRC64(c1, b);                                                          \
        c2 = CRC64(c2, d);                                                          \
        p += 8;                                                                     \
      } while (p < end);                                                            \
      c0 = shift(zeros, static_cast<uint32_t>(c0)) ^ c1;                            \
      c0 = shift(zeros, static_cast<uint32_t>(c0)) ^ c2;                            \
      p += 2 * block;                                                               \
      len -= 3 * block;                                                             \
    }                                                                               \
  }                                                                                 \
  while (len >= 8) {                                                                \
    uint64_t a;                                                                     \
    std::memcpy(&a, p, 8);                                                          \
    c0 = CRC64(c0, a);                                                              \
    p += 8;                                                                         \
    len -= 8;                                                                       \
  }                                                                                 \
  while (len--) c0 = CRC8(static_cast<uint32_t>(c0), *p++);                         \
  return ~static_cast<uint32_t>(c0);

#if defined(TIERSTATE_CRC_X86)
__attribute__((target("sse4.2"))) uint32_t crc_sse42(uint32_t crc, const void* data, size_t len) {
#define X86_CRC8(c, b) _mm_crc32_u8((c), (b))
#define X86_CRC64(c, w) _mm_crc32_u64((c), (w))
  TIERSTATE_CRC_HW_BODY(X86_CRC8, X86_CRC64)
#undef X86_CRC8
#undef X86_CRC64
}

bool have_hw() { return __builtin_cpu_supports("sse4.2"); }

// ---- x86 with AVX-512 VPCLMULQDQ: folding by carry-less multiplication -------------------
// Four 512-bit accumulators (sixteen 128-bit lanes) fold 256 bytes per iteration: a lane
// x standing D bits before the data it meets is replaced by x.lo * K(D+32) ^ x.hi *
// K(D-32), which is congruent to it shifted by D bits modulo P. The last 128 bits are
// reduced with the crc32 instruction itself (two 64-bit steps from 0), whose raw CRC of
// them equals that of everything folded. One crc32 per 8 bytes is bound by the
// instruction's throughput; this is bound by memory: 16-18 GB/s against 11 (crc32c.h).
bool have_vpclmul() {
  return tierstate::cpu_features().can_run_avx512() && __builtin_cpu_supports("vpclmulqdq");
}

// reflect32(x^e mod P) << 1: the bit-reflected remainder, aligned for pclmulqdq's product
uint64_t fold_constant(unsigned e) {
  uint32_t r = 1;
  for (unsigned i = 0; i < e; ++i) r = (r << 1) ^ ((r & 0x80000000u) ? 0x1EDC6F41u : 0u);
  uint32_t reflected = 0;
  for (int i = 0; i < 32; ++i)
    if (r & (1u << i)) reflected |= 1u << (31 - i);
  return static_cast<uint64_t>(reflected) << 1;
}

struct FoldConstants {
  uint64_t k2048[2], k1024[2], k512[2], k384[2], k256[2], k128[2];  // {lo: D+32, hi: D-32}
};

const FoldConstants& fold_constants() {
  static const FoldConstants c = [] {
    FoldConstants f;
    auto set = [](uint64_t* k, unsigned d) {
      k[0] = fold_constant(d + 32);
      k[1] = fold_constant(d - 32);
    };
    set(f.k2048, 2048);
    set(f.k1024, 1024);
    set(f.k512, 512);
    set(f.k384, 384);
    set(f.k256, 256);
    set(f.k128, 128);
    return f;
  }();
  return c;
}

// The end of both folding loops: the 128 bits left reduced with the crc32 instruction (two
// 64-bit steps from 0: their raw CRC equals that of everything folded into them), then the
// last len < 16 bytes at p.
__attribute__((target("sse4.2"))) inline uint32_t finish_folded(__m128i v, const unsigned char* p, size_t len) {
  uint64_t c = _mm_crc32_u64(0, static_cast<uint64_t>(_mm_cvtsi128_si64(v)));
  c = _mm_crc32_u64(c, static_cast<uint64_t>(_mm_extract_epi64(v, 1)));
  while (len >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    c = _mm_crc32_u64(c, w);
    p += 8;
    len -= 8;
  }
  while (len--) c = _mm_crc32_u8(static_cast<uint32_t>(c), *p++);
  return ~static_cast<uint32_t>(c);
}

#define TIERSTATE_VPCLMUL_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,vpclmulqdq,pclmul,sse4.2")))

TIERSTATE_VPCLMUL_TARGET inline __m512i fold512(__m512i x, __m512i k, __m512i data) {
  return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x, k, 0x00), _mm512_clmulepi64_epi128(x, k, 0x11),
                                   data, 0x96);  // a ^ b ^ c
}

TIERSTATE_VPCLMUL_TARGET inline __m128i fold128(__m128i x, const uint64_t* k) {
  __m128i kk = _mm_set_epi64x(static_cast<long long>(k[1]), static_cast<long long>(k[0]));
  return _mm_xor_si128(_mm_clmulepi64_si128(x, kk, 0x00), _mm_clmulepi64_si128(x, kk, 0x11));
}


// The zero-masked forms of the broadcast and the extracts below are the same instructions;
// the unmasked intrinsics' "undefined" pass-through operand made GCC 12 warn
// (-Wmaybe-uninitialized inside avx512fintrin.h).
TIERSTATE_VPCLMUL_TARGET uint32_t crc_vpclmul(uint32_t crc, const void* data, size_t len) {
  if (len < 512) return crc_sse42(crc, data, len);
  const FoldConstants& k = fold_constants();
  const auto* p = static_cast<const unsigned char*>(data);
  __m512i x0 = _mm512_loadu_si512(p);
  __m512i x1 = _mm512_loadu_si512(p + 64);
  __m512i x2 = _mm512_loadu_si512(p + 128);
  __m512i x3 = _mm512_loadu_si512(p + 192);
  x0 = _mm512_xor_si512(x0, _mm512_zextsi128_si512(_mm_cvtsi32_si128(static_cast<int>(~crc))));
  p += 256;
  len -= 256;
  const __m512i k4 = _mm512_maskz_broadcast_i32x4(
      0xFFFF, _mm_set_epi64x(static_cast<long long>(k.k2048[1]), static_cast<long long>(k.k2048[0])));
  while (len >= 256) {
    x0 = fold512(x0, k4, _mm512_loadu_si512(p));
    x1 = fold512(x1, k4, _mm512_loadu_si512(p + 64));
    x2 = fold512(x2, k4, _mm512_loadu_si512(p + 128));
    x3 = fold512(x3, k4, _mm512_loadu_si512(p + 192));
    p += 256;
    len -= 256;
  }
  const __m512i k1 = _mm512_maskz_broadcast_i32x4(
      0xFFFF, _mm_set_epi64x(static_cast<long long>(k.k512[1]), static_cast<long long>(k.k512[0])));
  __m512i x = fold512(x0, k1, x1);
  x = fold512(x, k1, x2);
  x = fold512(x, k1, x3);
  while (len >= 64) {
    x = fold512(x, k1, _mm512_loadu_si512(p));
    p += 64;
    len -= 64;
  }
  __m128i v = _mm512_maskz_extracti32x4_epi32(0xFF, x, 3);
  v = _mm_xor_si128(v, fold128(_mm512_maskz_extracti32x4_epi32(0xFF, x, 0), k.k384));
  v = _mm_xor_si128(v, fold128(_mm512_maskz_extracti32x4_epi32(0xFF, x, 1), k.k256));
  v = _mm_xor_si128(v, fold128(_mm512_maskz_extracti32x4_epi32(0xFF, x, 2), k.k128));
  return finish_folded(v, p, len);
}
// ---- x86 with PCLMULQDQ (every x86-64 core since 2010): the same folding, 128 bits wide --
// Eight 128-bit accumulators fold 128 bytes per iteration (fold distance 1024 bits),
// enough independent carry-less products in flight to cover the instruction's latency.
// Where the crc32 instruction is slow this is the fast one. On a Zen 1 EPYC (family 23,
// model 1), one core, three interleaved rounds: crc32 with three streams 5.9 GB/s in L2
// (256 KiB), 5.3-5.4 over 8 MiB and from DRAM (256 MiB); this 9.7, 7.9-8.1 and 6.7-6.9.
bool have_pclmul() { return __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.2"); }

#define TIERSTATE_PCLMUL_TARGET __attribute__((target("pclmul,sse4.2")))

TIERSTATE_PCLMUL_TARGET inline __m128i fold_into(__m128i x, __m128i k, __m128i data) {
  return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11)), data);
}

TIERSTATE_PCLMUL_TARGET inline __m128i load128(const unsigned char* p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}

TIERSTATE_PCLMUL_TARGET uint32_t crc_pclmul(uint32_t crc, const void* data, size_t len) {
  if (len < 256) return crc_sse42(crc, data, len);
  const FoldConstants& k = fold_constants();
  const auto* p = static_cast<const unsigned char*>(data);
  __m128i x[8];
  for (int j = 0; j < 8; ++j) x[j] = load128(p + 16 * j);
  x[0] = _mm_xor_si128(x[0], _mm_cvtsi32_si128(static_cast<int>(~crc)));
  p += 128;
  len -= 128;
  const __m128i k8 = _mm_set_epi64x(static_cast<long long>(k.k1024[1]), static_cast<long long>(k.k1024[0]));
  while (len >= 128) {
    for (int j = 0; j < 8; ++j) x[j] = fold_into(x[j], k8, load128(p + 16 * j));
    p += 128;
    len -= 128;
  }
  const __m128i k1 = _mm_set_epi64x(static_cast<long long>(k.k128[1]), static_cast<long long>(k.k128[0]));
  __m128i v = x[0];
  for (int j = 1; j < 8; ++j) v = fold_into(v, k1, x[j]);
  while (len >= 16) {
    v = fold_into(v, k1, load128(p));
    p += 16;
    len -= 16;
  }
  return finish_folded(v, p, len);
}
constexpr const char* kHwName = "sse4.2";
#define TIERSTATE_CRC_HW crc_sse42

#elif defined(TIERSTATE_CRC_ARM)
__attribute__((target("+crc"))) uint32_t crc_armv8(uint32_t crc, const void* data, size_t len) {
#define ARM_CRC8(c, b) __crc32cb((c), (b))
#define ARM_CRC64(c, w) __crc32cd(static_cast<uint32_t>(c), (w))
  TIERSTATE_CRC_HW_BODY(ARM_CRC8, ARM_CRC64)
#undef ARM_CRC8
#undef ARM_CRC64
}

bool have_hw() { return (getauxval(AT_HWCAP) & HWCAP_CRC32) != 0; }
constexpr const char* kHwName = "armv8-crc";
#define TIERSTATE_CRC_HW crc_armv8
#endif

using CrcFn = uint32_t (*)(uint32_t, const void*, size_t);

#if defined(TIERSTATE_CRC_X86)
// Which of the crc32-instruction loop and the 128-bit folding is faster depends on the
// core: on the Zen 1 EPYC above folding did 9.7 GB/s in L2 against 5.9, while Intel's
// optimization manuals give crc32 one per cycle, about what 128-bit folding reaches (not
// measured on an Intel core without AVX-512 here). So both are timed once, on a
// 256 KiB buffer (L2-resident on every such core), three rounds each, interleaved: 0.7 ms
// at the first CRC of the process on the Zen 1 VM (0.70, 0.70, and 4.8 ms beside a build).
// Both give the same value, so only the speed depends on the outcome.
bool pclmul_is_faster() {
  static const bool faster = [] {
    std::vector<unsigned char> buf(size_t{256} << 10);
    for (size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<unsigned char>((i * 2654435761u) >> 13);
    volatile uint32_t sink = 0;
    return second_is_faster([&](int pclmul) {
      sink = sink ^ (pclmul ? crc_pclmul(0, buf.data(), buf.size()) : crc_sse42(0, buf.data(), buf.size()));
    }, 3);
  }();
  return faster;
}

// The 128-bit folding in place of the crc32 loop (have_pclmul implies SSE4.2, so both run).
bool pclmul_preferred() { return have_pclmul() && pclmul_is_faster(); }
#endif

CrcFn best() {
#if defined(TIERSTATE_CRC_X86)
  if (have_vpclmul()) return crc_vpclmul;
  if (pclmul_preferred()) return crc_pclmul;
#endif
#if defined(TIERSTATE_CRC_HW)
  if (have_hw()) return TIERSTATE_CRC_HW;
#endif
  return crc_table;
}

// Operators appending 2^k zero bytes to a CRC register, k = 0..63 (8 KiB, built once).
struct PowerOps {
  uint32_t op[64][32];
};

const PowerOps& power_ops() {
  static const PowerOps* ops = [] {
    auto* p = new PowerOps;
    zeros_op(p->op[0], 1);
    for (int k = 1; k < 64; ++k) gf2_square(p->op[k], p->op[k - 1]);
    return p;
  }();
  return *ops;
}

// Above this size a CRC is split over the kernels' thread pool. One core reads DRAM at
// 14-15 GB/s here, the CRC itself runs at 90+ GB/s in cache (Xeon VM, AVX-512 folding),
// so a large record's CRC is bound by one core's memory bandwidth: two threads measured
// 28 GB/s over an 808 MiB buffer. Below ~2 MiB the pool's hand-off (microseconds) is
// not worth it.
constexpr size_t kParallelMin = size_t{2} << 20;
// Chunk starts are kept on cache-line boundaries.
constexpr size_t kChunkAlign = 64;

}  // namespace

uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, size_t len_b) {
  // With the pre- and post-inversion of the standard CRC, crc(A + B) = Z(crc(A)) ^ crc(B),
  // Z appending len_b zero bytes to a register (Z is linear, so the inversions cancel).
  const PowerOps& ops = power_ops();
  for (int k = 0; len_b; ++k, len_b >>= 1) {
    if (len_b & 1) crc_a = gf2_times(ops.op[k], crc_a);
  }
  return crc_a ^ crc_b;
}

uint32_t crc32c_serial(uint32_t crc, const void* data, size_t nbytes) {
  static const CrcFn fn = best();
  return fn(crc, data, nbytes);
}

uint32_t crc32c(uint32_t crc, const void* data, size_t nbytes) {
  static const CrcFn fn = best();
  ThreadPool& pool = ThreadPool::instance();
  const int64_t threads = std::min<int64_t>(
      {pool.num_threads(), 64, static_cast<int64_t>(nbytes / (kParallelMin / 2))});  // >= 1 MiB a chunk
  if (threads < 2 || nbytes < kParallelMin) return fn(crc, data, nbytes);
  // Chunk i covers [start[i], start[i + 1]); chunk 0 continues from ``crc``, the rest
  // start from 0 and are joined in order.
  const auto* base = static_cast<const unsigned char*>(data);
  size_t start[65];
  uint32_t part[64];
  const size_t chunk = (nbytes / threads + kChunkAlign - 1) / kChunkAlign * kChunkAlign;
  for (int64_t i = 0; i < threads; ++i) start[i] = std::min(nbytes, static_cast<size_t>(i) * chunk);
  start[threads] = nbytes;
  auto body = [&](int64_t i) { part[i] = fn(i == 0 ? crc : 0, base + start[i], start[i + 1] - start[i]); };
  pool.parallel_for(threads, body);
  uint32_t out = part[0];
  for (int64_t i = 1; i < threads; ++i) out = crc32c_combine(out, part[i], start[i + 1] - start[i]);
  return out;
}

uint32_t crc32c_with(const std::string& isa, uint32_t crc, const void* data, size_t nbytes) {
  if (isa == "table") return crc_table(crc, data, nbytes);
#if defined(TIERSTATE_CRC_X86)
  if (isa == "avx512-vpclmul") {
    if (!have_vpclmul()) throw std::invalid_argument("crc32c variant " + isa + " is not supported by this CPU");
    return crc_vpclmul(crc, data, nbytes);
  }
  if (isa == "pclmul") {
    if (!have_pclmul()) throw std::invalid_argument("crc32c variant " + isa + " is not supported by this CPU");
    return crc_pclmul(crc, data, nbytes);
  }
#endif
#if defined(TIERSTATE_CRC_HW)
  if (isa == kHwName) {
    if (!have_hw()) throw std::invalid_argument("crc32c variant " + isa + " is not supported by this CPU");
    return TIERSTATE_CRC_HW(crc, data, nbytes);
  }
#endif
  throw std::invalid_argument("unknown crc32c variant '" + isa + "'; available: see crc32c_isas()");
}

std::vector<std::string> crc32c_isas() {
  std::vector<std::string> out;
#if defined(TIERSTATE_CRC_X86)
  if (have_vpclmul()) out.push_back("avx512-vpclmul");
  const bool pclmul_first = pclmul_preferred();
  if (pclmul_first) out.push_back("pclmul");
#endif
#if defined(TIERSTATE_CRC_HW)
  if (have_hw()) out.push_back(kHwName);
#endif
#if defined(TIERSTATE_CRC_X86)
  if (have_pclmul() && !pclmul_first) out.push_back("pclmul");
#endif
  out.push_back("table");
  return out;
}

}  // namespace tierstate::io
