// AVX2 + FMA + F16C variant (8 floats per vector). Compiled with -mavx2 -mfma
// -mf16c (CMakeLists.txt); dispatch.cpp only calls it when cpu_features() says
// the CPU and OS support all three.
#include <immintrin.h>

#include <cstring>

#define TIERSTATE_KERNEL_ISA isa_avx2
#include "kernels/vec_scalar.h"
#include "kernels/body.h"

namespace tierstate {
namespace kernels {
namespace isa_avx2 {

struct VecAvx2 {
  static constexpr int kWidth = 8;
  static constexpr bool kHasGather = true;  // decode_q8 / encode_q8 gather; the *_loads twins do not
  // No block decode (body.h TableCodec::decode_row): without VBMI a 256-entry byte plane is
  // 16 PSHUFB lookups of 16 entries plus their selects (~48 operations per 8 values,
  // counted, not run), and a scalar loop over the block measured within the drift of the
  // per-vector lookups (benchmarks/README.md, 2026-12-06).
  static constexpr bool kHasRowDecode = false;
  static constexpr bool kHasFp8Pair = true;  // encode_fp8_pair: 2 x kWidth codes at once
  __m256 v;

  static VecAvx2 set1(float x) { return {_mm256_set1_ps(x)}; }
  static VecAvx2 load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static void store(float* p, VecAvx2 x) { _mm256_storeu_ps(p, x.v); }

  static VecAvx2 load_bf16(const uint16_t* p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(wide, 16))};
  }
  // Round to nearest even by integer arithmetic (see f32_to_bf16_rne); NaN -> 0x7FC0.
  static void store_bf16(uint16_t* p, VecAvx2 x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bf16_bits(x));
  }
  static void stream_bf16(uint16_t* p, VecAvx2 x) {  // p: 16-byte aligned
    _mm_stream_si128(reinterpret_cast<__m128i*>(p), bf16_bits(x));
  }
  static __m128i bf16_bits(VecAvx2 x) {
    const __m256i bits = _mm256_castps_si256(x.v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i bias = _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF));
    __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
    const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(x.v, x.v, _CMP_UNORD_Q));
    rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), is_nan);
    // Values fit in 16 bits, so the unsigned-saturating pack is an exact narrowing.
    return _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
  }
  static VecAvx2 load_f16(const uint16_t* p) {
    return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
  }
  static void store_f16(uint16_t* p, VecAvx2 x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm256_cvtps_ph(x.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static void stream_f16(uint16_t* p, VecAvx2 x) {  // p: 16-byte aligned
    _mm_stream_si128(reinterpret_cast<__m128i*>(p),
                     _mm256_cvtps_ph(x.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static void stream_fence() { _mm_sfence(); }
  static void stream_block128(uint16_t* dst, const uint16_t* src) {  // both 32-byte aligned
    for (int k = 0; k < 64; k += 16)
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + k),
                          _mm256_load_si256(reinterpret_cast<const __m256i*>(src + k)));
  }

  friend VecAvx2 operator+(VecAvx2 a, VecAvx2 b) { return {_mm256_add_ps(a.v, b.v)}; }
  friend VecAvx2 operator-(VecAvx2 a, VecAvx2 b) { return {_mm256_sub_ps(a.v, b.v)}; }
  friend VecAvx2 operator*(VecAvx2 a, VecAvx2 b) { return {_mm256_mul_ps(a.v, b.v)}; }
  friend VecAvx2 operator/(VecAvx2 a, VecAvx2 b) { return {_mm256_div_ps(a.v, b.v)}; }
  static VecAvx2 fmadd(VecAvx2 a, VecAvx2 b, VecAvx2 c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
  static VecAvx2 sqrt(VecAvx2 a) { return {_mm256_sqrt_ps(a.v)}; }
  static VecAvx2 abs(VecAvx2 a) {
    return {_mm256_castsi256_ps(_mm256_and_si256(_mm256_castps_si256(a.v), _mm256_set1_epi32(0x7FFFFFFF)))};
  }
  // 8 codes -> table values (one gather).
  static VecAvx2 decode_q8(const uint8_t* codes, const float* table) {
    const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes)));
    return {_mm256_i32gather_ps(table, c, 4)};
  }
  // encode_q8_one (vec_scalar.h) on 8 lanes: one gather of the buckets' words.
  static void encode_q8(uint8_t* out, VecAvx2 y, const QuantMapRef& m) {
    const __m256i mag = q8_magnitude(y);
    store_q8_code(out, _mm256_i32gather_epi32(reinterpret_cast<const int*>(m.lut), q8_bucket(mag, m), 4), mag,
                  y, m);
  }
  // The same lookups, one scalar load per lane instead of a gather (body.h, TableCodec).
  // A 256-bit gather is one instruction but not one memory access: on Zen 1 it is decoded
  // into dozens of uops. The fused q8 step did six gathers per 8 values; over 50M values
  // on two Zen 1 cores it took 220 ms by gathers and 152 ms by loads (2026-12-04).
  static VecAvx2 decode_q8_loads(const uint8_t* codes, const float* table) {
    const __m128 lo = _mm_setr_ps(table[codes[0]], table[codes[1]], table[codes[2]], table[codes[3]]);
    const __m128 hi = _mm_setr_ps(table[codes[4]], table[codes[5]], table[codes[6]], table[codes[7]]);
    return {_mm256_set_m128(hi, lo)};
  }
  static void encode_q8_loads(uint8_t* out, VecAvx2 y, const QuantMapRef& m) {
    const __m256i mag = q8_magnitude(y);
    alignas(32) int32_t b[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(b), q8_bucket(mag, m));
    const uint32_t* lut = m.lut;
    const __m256i w = _mm256_setr_epi32(lut[b[0]], lut[b[1]], lut[b[2]], lut[b[3]], lut[b[4]], lut[b[5]],
                                        lut[b[6]], lut[b[7]]);
    store_q8_code(out, w, mag, y, m);
  }
  // The two encoders' common parts: |y|'s bits, its bucket in m.lut, and the code from the
  // bucket's word w (QuantMapRef).
  static __m256i q8_magnitude(VecAvx2 y) {
    return _mm256_and_si256(_mm256_castps_si256(y.v), _mm256_set1_epi32(0x7FFFFFFF));
  }
  static __m256i q8_bucket(__m256i mag, const QuantMapRef& m) {
    const __m256i b = _mm256_sub_epi32(_mm256_srl_epi32(mag, _mm_cvtsi32_si128(m.lut_shift)),
                                       _mm256_set1_epi32(m.lut_base));
    return _mm256_min_epi32(_mm256_max_epi32(b, _mm256_setzero_si256()), _mm256_set1_epi32(m.lut_size - 1));
  }
  static void store_q8_code(uint8_t* out, __m256i w, __m256i mag, VecAvx2 y, const QuantMapRef& m) {
    // rest >= low, i.e. rest + 1 > low (both below 2**24): -1 where the value reaches the
    // threshold inside its bucket.
    const __m256i rest = _mm256_and_si256(mag, _mm256_set1_epi32(static_cast<int>((1u << m.lut_shift) - 1u)));
    const __m256i up = _mm256_cmpgt_epi32(_mm256_add_epi32(rest, _mm256_set1_epi32(1)), _mm256_srli_epi32(w, 8));
    __m256i c = _mm256_sub_epi32(_mm256_and_si256(w, _mm256_set1_epi32(0xFF)), up);
    if (m.is_signed) {
      const __m256i neg = _mm256_castps_si256(_mm256_cmp_ps(y.v, _mm256_setzero_ps(), _CMP_LT_OQ));
      c = _mm256_or_si256(c, _mm256_and_si256(neg, _mm256_set1_epi32(0x80)));
    }
    // Codes fit in 8 bits, so the saturating packs are exact narrowings.
    const __m128i w16 = _mm_packus_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm_packus_epi16(w16, w16));
  }
  // decode_fp8_one / encode_fp8_one (vec_scalar.h) on 8 lanes, no table.
  // Decoding through the fp16 that holds the code (fp8_as_f16, vec_scalar.h): VCVTPH2PS
  // widens it exactly, subnormals included.
  template <int M, bool kSigned>
  static VecAvx2 decode_fp8(const uint8_t* codes) {
    const __m128i c = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes)));
    __m128i h;
    if (kSigned) {
      h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(c, _mm_set1_epi16(0x7F)), 10 - M),
                       _mm_slli_epi16(_mm_and_si128(c, _mm_set1_epi16(0x80)), 8));
    } else {
      h = _mm_slli_epi16(c, 10 - M);
    }
    return {_mm256_cvtph_ps(h)};
  }
  // encode_fp8_one through the fp16 that holds the code, as in kernels_avx512.cpp (its
  // fp8_f16_bits says why the rounding is exact); the sign goes into the fp32 first, when
  // y < 0, so the fp16 carries it to bit 15. The pair form shifts, clamps and packs 16.
  template <int M, bool kSigned>
  static __m128i fp8_f16_bits(__m256 y) {
    const __m256i a = _mm256_and_si256(_mm256_castps_si256(y), _mm256_set1_epi32(0x7FFFFFFF));
    const __m256i e = _mm256_max_epi32(_mm256_and_si256(a, _mm256_set1_epi32(0x7F800000)),
                                       _mm256_set1_epi32(113 << 23));
    const __m256 c = _mm256_castsi256_ps(_mm256_add_epi32(e, _mm256_set1_epi32((23 - M) << 23)));
    __m256 r = _mm256_sub_ps(_mm256_add_ps(_mm256_castsi256_ps(a), c), c);
    if (kSigned) {
      const __m256 neg = _mm256_cmp_ps(y, _mm256_setzero_ps(), _CMP_LT_OQ);
      r = _mm256_or_ps(r, _mm256_and_ps(neg, _mm256_set1_ps(-0.0f)));
    }
    return _mm256_cvtps_ph(r, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  // fp16 bits -> codes in 16-bit lanes: the magnitude shifted down and clamped, the sign to bit 7.
  template <int M, bool kSigned>
  static __m256i fp8_codes(__m256i h) {
    if (!kSigned) return _mm256_min_epu16(_mm256_srli_epi16(h, 10 - M), _mm256_set1_epi16(255));
    const __m256i mag = _mm256_min_epu16(_mm256_srli_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x7FFF)), 10 - M),
                                         _mm256_set1_epi16(127));
    return _mm256_or_si256(mag, _mm256_and_si256(_mm256_srli_epi16(h, 8), _mm256_set1_epi16(0x80)));
  }
  template <int M, bool kSigned>
  static void encode_fp8(uint8_t* out, VecAvx2 y) {  // the pair's arithmetic on one half
    const __m128i c = _mm256_castsi256_si128(
        fp8_codes<M, kSigned>(_mm256_set_m128i(_mm_setzero_si128(), fp8_f16_bits<M, kSigned>(y.v))));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm_packus_epi16(c, c));
  }
  template <int M, bool kSigned>
  static void encode_fp8_pair(uint8_t* out, VecAvx2 y0, VecAvx2 y1) {
    const __m256i c = fp8_codes<M, kSigned>(_mm256_set_m128i(fp8_f16_bits<M, kSigned>(y1.v), fp8_f16_bits<M, kSigned>(y0.v)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out),
                     _mm_packus_epi16(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1)));
  }
  static __m256i lowbias32(__m256i x) {
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7FEB352D));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(0x846CA68Bu)));
    return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  }
  // f32_to_bf16_sr (vec_scalar.h) on 8 lanes; lane k uses index + k.
  static void store_bf16_sr(uint16_t* p, VecAvx2 x, uint32_t key, uint32_t index) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i idx = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(index)), lanes);
    const __m256i r = _mm256_srli_epi32(lowbias32(_mm256_xor_si256(idx, _mm256_set1_epi32(static_cast<int>(key)))), 16);
    __m256i bits = _mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(x.v), r), 16);
    const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(x.v, x.v, _CMP_UNORD_Q));
    bits = _mm256_blendv_epi8(bits, _mm256_set1_epi32(0x7FC0), is_nan);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1)));
  }
  // comp_unit_one / comp_to_i16 (vec_scalar.h) on 8 lanes.
  // The exponent field in place, as in the AVX-512 variant: three operations, not five.
  static VecAvx2 comp_unit(VecAvx2 m, bool inverse) {
    __m256i e = _mm256_and_si256(_mm256_castps_si256(m.v), _mm256_set1_epi32(0x7F800000));
    e = _mm256_max_epi32(e, _mm256_set1_epi32(24 << 23));
    const __m256i bits = inverse ? _mm256_sub_epi32(_mm256_set1_epi32(static_cast<int>(277u << 23)), e)
                                 : _mm256_sub_epi32(e, _mm256_set1_epi32(23 << 23));
    return {_mm256_castsi256_ps(bits)};
  }
  static VecAvx2 load_i16(const int16_t* p) {
    return {_mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
  }
  static VecAvx2 load_i8(const int8_t* p) {
    return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))))};
  }
  // 8 nibbles from the 4 bytes at bytes + index / 2 (index even); see the AVX-512 variant.
  static VecAvx2 load_u4(const uint8_t* bytes, int64_t index) {
    int32_t word;
    std::memcpy(&word, bytes + (index >> 1), sizeof(word));
    const __m128i w = _mm_cvtepu8_epi16(_mm_cvtsi32_si128(word));
    const __m128i split = _mm_or_si128(_mm_and_si128(w, _mm_set1_epi16(0x000F)),
                                       _mm_and_si128(_mm_slli_epi16(w, 4), _mm_set1_epi16(0x0F00)));
    return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(split))};
  }
  // The low clamp is packs_epi32's saturation (a value below -32768, -inf included,
  // converts to at most -32768 or to INT32_MIN), as in the AVX-512 variant.
  static void store_i16_rne(int16_t* p, VecAvx2 x) {
    __m256 y = _mm256_and_ps(x.v, _mm256_cmp_ps(x.v, x.v, _CMP_ORD_Q));
    y = _mm256_min_ps(y, _mm256_set1_ps(32767.0f));
    const __m256i q = _mm256_cvtps_epi32(_mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)));
  }
  // max(acc, |x|) on the bits as unsigned integers (see the AVX-512 variant).
  static VecAvx2 max_abs(VecAvx2 acc, VecAvx2 x) {
    const __m256i mag = _mm256_and_si256(_mm256_castps_si256(x.v), _mm256_set1_epi32(0x7FFFFFFF));
    return {_mm256_castsi256_ps(_mm256_max_epu32(_mm256_castps_si256(acc.v), mag))};
  }
  // The largest lane of a max_abs accumulator, on the bits as max_abs keeps them (NaN above all).
  static float reduce_max_abs(VecAvx2 acc) {
    const __m256i bits = _mm256_castps_si256(acc.v);
    __m128i m = _mm_max_epu32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(1, 0, 3, 2)));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(2, 3, 0, 1)));
    return bits_float(static_cast<uint32_t>(_mm_cvtsi128_si32(m)));
  }
  static VecAvx2 max_nan(VecAvx2 a, VecAvx2 b) {
    const __m256 unordered = _mm256_cmp_ps(a.v, b.v, _CMP_UNORD_Q);
    return {_mm256_blendv_ps(_mm256_max_ps(a.v, b.v), _mm256_add_ps(a.v, b.v), unordered)};
  }
  static VecAvx2 sign(VecAvx2 a) {
    const __m256 zero = _mm256_setzero_ps();
    const __m256 pos = _mm256_and_ps(_mm256_cmp_ps(a.v, zero, _CMP_GT_OQ), _mm256_set1_ps(1.0f));
    const __m256 neg = _mm256_and_ps(_mm256_cmp_ps(a.v, zero, _CMP_LT_OQ), _mm256_set1_ps(-1.0f));
    return {_mm256_or_ps(pos, neg)};
  }

  struct DAcc {
    __m256d lo, hi;
  };
  static DAcc dacc_zero() { return {_mm256_setzero_pd(), _mm256_setzero_pd()}; }
  static DAcc dacc_add_squares(DAcc acc, VecAvx2 x) {
    const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x.v));
    const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(x.v, 1));
    return {_mm256_fmadd_pd(lo, lo, acc.lo), _mm256_fmadd_pd(hi, hi, acc.hi)};
  }
  static double dacc_total(DAcc acc) {
    alignas(32) double lanes[4];
    _mm256_store_pd(lanes, _mm256_add_pd(acc.lo, acc.hi));
    return (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  }
};

}  // namespace isa_avx2

const KernelTable* avx2_table() {
  using namespace isa_avx2;
  return KernelSet<VecAvx2, VecScalar>::table("avx2");
}

}  // namespace kernels
}  // namespace tierstate
