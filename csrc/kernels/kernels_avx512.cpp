// AVX-512 variants (16 floats per vector), compiled with -mavx512f/bw/vl/dq/bf16
// -mfma -mf16c (CMakeLists.txt). Two instantiations:
//   "avx512_bf16": rounds to bf16 with VCVTNEPS2BF16 (CPUs with AVX512_BF16);
//   "avx512":      rounds by integer arithmetic, for AVX-512 CPUs without it.
// dispatch.cpp calls each only when cpu_features() allows it.
#include <immintrin.h>

#define TIERSTATE_KERNEL_ISA isa_avx512
#include "kernels/vec_scalar.h"
#include "kernels/body.h"

namespace tierstate {
namespace kernels {
namespace isa_avx512 {

// Round to nearest even by integer arithmetic (see f32_to_bf16_rne); NaN -> 0x7FC0.
inline __m256i bf16_bits_rne(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i bias = _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
  const __mmask16 is_nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, is_nan, _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(rounded);
}

// codes[0, n) (n a multiple of 64) -> out[0, n), the fp32 values of a 256-entry table held
// as four byte planes (planes[p][c] is byte p of table[c]; body.h TableCodec). Per 64
// codes: for each plane, VPERMI2B looks the low 7 bits up in each half of the plane and
// the code's bit 7 picks the half; the planes' bytes are then interleaved into 64 floats.
// The interleave (UNPCK within 128-bit lanes) would leave lane L of output register k
// holding codes 16 L + 4 k + (0..3); the codes are permuted first so that it holds
// codes 16 k + 4 L + (0..3), i.e. the outputs come out in order. Needs AVX512-VBMI
// (dispatch.cpp asks cpu_features() before it enables this).
__attribute__((target("avx512vbmi"))) void decode_q8_row_vbmi(const uint8_t* codes, int64_t n,
                                                              const uint8_t (*planes)[256], float* out) {
  alignas(64) static constexpr uint8_t kOrder[64] = {
      0, 1, 2, 3, 16, 17, 18, 19, 32, 33, 34, 35, 48, 49, 50, 51,
      4, 5, 6, 7, 20, 21, 22, 23, 36, 37, 38, 39, 52, 53, 54, 55,
      8, 9, 10, 11, 24, 25, 26, 27, 40, 41, 42, 43, 56, 57, 58, 59,
      12, 13, 14, 15, 28, 29, 30, 31, 44, 45, 46, 47, 60, 61, 62, 63};
  const __m512i order = _mm512_load_si512(kOrder);
  __m512i plane[4][4];  // 16 registers: the four planes, 64 codes' bytes a register
  for (int p = 0; p < 4; ++p)
    for (int q = 0; q < 4; ++q) plane[p][q] = _mm512_load_si512(planes[p] + 64 * q);
  for (int64_t i = 0; i < n; i += 64) {
    const __m512i c = _mm512_permutexvar_epi8(order, _mm512_loadu_si512(codes + i));
    const __mmask64 upper = _mm512_movepi8_mask(c);  // bit 7: codes 128-255
    __m512i b[4];
    for (int p = 0; p < 4; ++p) {
      const __m512i first = _mm512_permutex2var_epi8(plane[p][0], c, plane[p][1]);
      const __m512i second = _mm512_permutex2var_epi8(plane[p][2], c, plane[p][3]);
      b[p] = _mm512_mask_blend_epi8(upper, first, second);
    }
    const __m512i w01_lo = _mm512_unpacklo_epi8(b[0], b[1]), w01_hi = _mm512_unpackhi_epi8(b[0], b[1]);
    const __m512i w23_lo = _mm512_unpacklo_epi8(b[2], b[3]), w23_hi = _mm512_unpackhi_epi8(b[2], b[3]);
    _mm512_storeu_si512(out + i, _mm512_unpacklo_epi16(w01_lo, w23_lo));
    _mm512_storeu_si512(out + i + 16, _mm512_unpackhi_epi16(w01_lo, w23_lo));
    _mm512_storeu_si512(out + i + 32, _mm512_unpacklo_epi16(w01_hi, w23_hi));
    _mm512_storeu_si512(out + i + 48, _mm512_unpackhi_epi16(w01_hi, w23_hi));
  }
}

template <bool kNativeBf16>
struct VecAvx512 {
  static constexpr int kWidth = 16;
  static constexpr bool kHasGather = true;  // decode_q8 / encode_q8 gather; the *_loads twins do not
  static constexpr bool kHasRowDecode = true;  // with VBMI: decode_q8_row_vbmi
  static constexpr bool kHasFp8Pair = true;  // encode_fp8_pair: 2 x kWidth codes at once
  static void decode_q8_row(const uint8_t* codes, int64_t n, const uint8_t (*planes)[256], float* out) {
    decode_q8_row_vbmi(codes, n, planes, out);
  }
  __m512 v;

  static VecAvx512 set1(float x) { return {_mm512_set1_ps(x)}; }
  static VecAvx512 load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static void store(float* p, VecAvx512 x) { _mm512_storeu_ps(p, x.v); }

  static VecAvx512 load_bf16(const uint16_t* p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16))};
  }
  static void store_bf16(uint16_t* p, VecAvx512 x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_bits(x));
  }
  static void stream_bf16(uint16_t* p, VecAvx512 x) {  // p: 32-byte aligned
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), bf16_bits(x));
  }
  static __m256i bf16_bits(VecAvx512 x) {
    __m256i out;
    if constexpr (kNativeBf16) {
      // VCVTNEPS2BF16 rounds to nearest even but flushes subnormal inputs to zero
      // and keeps NaN payloads; those lanes (fpclass: QNaN 0x01, subnormal 0x20,
      // SNaN 0x80) take the integer path, so every variant writes the same bits
      // (subnormals rounded like torch, NaN as 0x7FC0).
      out = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x.v));
      const __mmask16 special = _mm512_fpclass_ps_mask(x.v, 0xA1);
      if (special) out = _mm256_mask_mov_epi16(out, special, bf16_bits_rne(x.v));
    } else {
      out = bf16_bits_rne(x.v);
    }
    return out;
  }
  static VecAvx512 load_f16(const uint16_t* p) {
    return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
  }
  static void store_f16(uint16_t* p, VecAvx512 x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(x.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static void stream_f16(uint16_t* p, VecAvx512 x) {  // p: 32-byte aligned
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(x.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static void stream_fence() { _mm_sfence(); }
  static void stream_block128(uint16_t* dst, const uint16_t* src) {  // both 64-byte aligned
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst), _mm512_load_si512(src));
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + 32), _mm512_load_si512(src + 32));
  }

  friend VecAvx512 operator+(VecAvx512 a, VecAvx512 b) { return {_mm512_add_ps(a.v, b.v)}; }
  friend VecAvx512 operator-(VecAvx512 a, VecAvx512 b) { return {_mm512_sub_ps(a.v, b.v)}; }
  friend VecAvx512 operator*(VecAvx512 a, VecAvx512 b) { return {_mm512_mul_ps(a.v, b.v)}; }
  friend VecAvx512 operator/(VecAvx512 a, VecAvx512 b) { return {_mm512_div_ps(a.v, b.v)}; }
  static VecAvx512 fmadd(VecAvx512 a, VecAvx512 b, VecAvx512 c) {
    return {_mm512_fmadd_ps(a.v, b.v, c.v)};
  }
  static VecAvx512 sqrt(VecAvx512 a) { return {_mm512_sqrt_ps(a.v)}; }
  static VecAvx512 abs(VecAvx512 a) {
    return {_mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(a.v), _mm512_set1_epi32(0x7FFFFFFF)))};
  }
  // 16 codes -> table values (one gather).
  static VecAvx512 decode_q8(const uint8_t* codes, const float* table) {
    const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
    return {_mm512_i32gather_ps(c, table, 4)};
  }
  // encode_q8_one (vec_scalar.h) on 16 lanes: one gather of the buckets' words.
  static void encode_q8(uint8_t* out, VecAvx512 y, const QuantMapRef& m) {
    const __m512i mag = q8_magnitude(y);
    store_q8_code(out, _mm512_i32gather_epi32(q8_bucket(mag, m), m.lut, 4), mag, y, m);
  }
  // The same lookups, one scalar load per lane instead of a gather (body.h, TableCodec).
  static VecAvx512 decode_q8_loads(const uint8_t* codes, const float* table) {
    alignas(64) float lanes[16];
    for (int k = 0; k < 16; ++k) lanes[k] = table[codes[k]];
    return {_mm512_load_ps(lanes)};
  }
  static void encode_q8_loads(uint8_t* out, VecAvx512 y, const QuantMapRef& m) {
    const __m512i mag = q8_magnitude(y);
    alignas(64) uint32_t lane[16];
    _mm512_store_si512(lane, q8_bucket(mag, m));
    for (int k = 0; k < 16; ++k) lane[k] = m.lut[lane[k]];
    store_q8_code(out, _mm512_load_si512(lane), mag, y, m);
  }
  // The two encoders' common parts: |y|'s bits, its bucket in m.lut, and the code from the
  // bucket's word w (QuantMapRef).
  static __m512i q8_magnitude(VecAvx512 y) {
    return _mm512_and_si512(_mm512_castps_si512(y.v), _mm512_set1_epi32(0x7FFFFFFF));
  }
  static __m512i q8_bucket(__m512i mag, const QuantMapRef& m) {
    const __m512i b = _mm512_sub_epi32(_mm512_srl_epi32(mag, _mm_cvtsi32_si128(m.lut_shift)),
                                       _mm512_set1_epi32(m.lut_base));
    return _mm512_min_epi32(_mm512_max_epi32(b, _mm512_setzero_si512()), _mm512_set1_epi32(m.lut_size - 1));
  }
  static void store_q8_code(uint8_t* out, __m512i w, __m512i mag, VecAvx512 y, const QuantMapRef& m) {
    const __m512i rest = _mm512_and_si512(mag, _mm512_set1_epi32(static_cast<int>((1u << m.lut_shift) - 1u)));
    const __mmask16 up = _mm512_cmpge_epi32_mask(rest, _mm512_srli_epi32(w, 8));
    __m512i c = _mm512_and_si512(w, _mm512_set1_epi32(0xFF));
    c = _mm512_mask_add_epi32(c, up, c, _mm512_set1_epi32(1));
    if (m.is_signed) {
      const __mmask16 neg = _mm512_cmp_ps_mask(y.v, _mm512_setzero_ps(), _CMP_LT_OQ);
      c = _mm512_mask_or_epi32(c, neg, c, _mm512_set1_epi32(0x80));
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi32_epi8(c));
  }
  // decode_fp8_one / encode_fp8_one (vec_scalar.h) on 16 lanes, no table. Decoding goes
  // through the fp16 that holds the code (fp8_as_f16): VCVTPH2PS widens it exactly,
  // subnormals included, whatever MXCSR.DAZ says.
  template <int M, bool kSigned>
  static VecAvx512 decode_fp8(const uint8_t* codes) {
    const __m256i c = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
    __m256i h;
    if (kSigned) {
      h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(c, _mm256_set1_epi16(0x7F)), 10 - M),
                          _mm256_slli_epi16(_mm256_and_si256(c, _mm256_set1_epi16(0x80)), 8));
    } else {
      h = _mm256_slli_epi16(c, 10 - M);
    }
    return {_mm512_cvtph_ps(h)};
  }
  // encode_fp8_one (vec_scalar.h) through the fp16 that holds the code: fp8_f16_bits rounds
  // |y| to the code's precision in fp32 and converts it exactly, the code is then the fp16's
  // bits shifted down (fp8_as_f16 backwards), in 16-bit lanes. The pair form shifts, clamps
  // and narrows 32 codes at once: 23 instructions per 32 signed codes against 32 for the
  // rounding in 32-bit integers it replaced (benchmarks/README.md, 2026-12-06 10:30 UTC).
  template <int M>
  static __m256i fp8_f16_bits(__m512 y) {
    // r = (|y| + C) - C with C = 2**(max(e, -14) + 23 - M), e the exponent of |y|: the sum
    // lies in [C, 2C), whose ulp is 2**(e - M) (2**-(14 + M) below 2**-14), so the add
    // rounds |y| to nearest even there, once, and the subtraction is exact. r fits an fp16
    // (M + 1 significant bits, fp8's subnormals are fp16 subnormals): VCVTPS2PH is exact,
    // and overflows to inf (clamped like NaN) only above the top code. A denormal |y|
    // under MXCSR.DAZ reads as 0 and gives code 0, as it does without DAZ.
    const __m512i a = _mm512_and_si512(_mm512_castps_si512(y), _mm512_set1_epi32(0x7FFFFFFF));
    const __m512i e = _mm512_max_epi32(_mm512_and_si512(a, _mm512_set1_epi32(0x7F800000)),
                                       _mm512_set1_epi32(113 << 23));
    const __m512 c = _mm512_castsi512_ps(_mm512_add_epi32(e, _mm512_set1_epi32((23 - M) << 23)));
    const __m512 r = _mm512_sub_ps(_mm512_add_ps(_mm512_castsi512_ps(a), c), c);
    return _mm512_cvtps_ph(r, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  template <int M, bool kSigned>
  static void encode_fp8(uint8_t* out, VecAvx512 y) {
    __m256i c = _mm256_min_epu16(_mm256_srli_epi16(fp8_f16_bits<M>(y.v), 10 - M),
                                 _mm256_set1_epi16(kSigned ? 127 : 255));
    if (kSigned) {
      const __mmask16 neg = _mm512_cmp_ps_mask(y.v, _mm512_setzero_ps(), _CMP_LT_OQ);
      c = _mm256_mask_add_epi16(c, neg, c, _mm256_set1_epi16(0x80));  // c < 128: add is or
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_cvtepi16_epi8(c));
  }
  template <int M, bool kSigned>
  static void encode_fp8_pair(uint8_t* out, VecAvx512 y0, VecAvx512 y1) {
    const __m512i h = _mm512_inserti64x4(_mm512_castsi256_si512(fp8_f16_bits<M>(y0.v)), fp8_f16_bits<M>(y1.v), 1);
    __m512i c = _mm512_min_epu16(_mm512_srli_epi16(h, 10 - M), _mm512_set1_epi16(kSigned ? 127 : 255));
    if (kSigned) {
      const __mmask32 neg = _mm512_kunpackw(_mm512_cmp_ps_mask(y1.v, _mm512_setzero_ps(), _CMP_LT_OQ),
                                            _mm512_cmp_ps_mask(y0.v, _mm512_setzero_ps(), _CMP_LT_OQ));
      c = _mm512_mask_add_epi16(c, neg, c, _mm512_set1_epi16(0x80));
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi16_epi8(c));
  }
  static __m512i lowbias32(__m512i x) {
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7FEB352D));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(0x846CA68Bu)));
    return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  }
  // f32_to_bf16_sr (vec_scalar.h) on 16 lanes; lane k uses index + k.
  static void store_bf16_sr(uint16_t* p, VecAvx512 x, uint32_t key, uint32_t index) {
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(index)), lanes);
    const __m512i r = _mm512_srli_epi32(lowbias32(_mm512_xor_si512(idx, _mm512_set1_epi32(static_cast<int>(key)))), 16);
    __m512i bits = _mm512_srli_epi32(_mm512_add_epi32(_mm512_castps_si512(x.v), r), 16);
    const __mmask16 is_nan = _mm512_cmp_ps_mask(x.v, x.v, _CMP_UNORD_Q);
    bits = _mm512_mask_mov_epi32(bits, is_nan, _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bits));
  }
  // comp_unit_one / comp_to_i16 (vec_scalar.h) on 16 lanes.
  // The exponent field is kept in place (e << 23): and, max, sub, where shifting it down
  // and back took five operations. (277 << 23) wraps in 32 bits, and so does the
  // difference, to exactly (277 - e) << 23 for the e >= 24 the max leaves.
  static VecAvx512 comp_unit(VecAvx512 m, bool inverse) {
    __m512i e = _mm512_and_si512(_mm512_castps_si512(m.v), _mm512_set1_epi32(0x7F800000));
    e = _mm512_max_epi32(e, _mm512_set1_epi32(24 << 23));
    const __m512i bits = inverse ? _mm512_sub_epi32(_mm512_set1_epi32(static_cast<int>(277u << 23)), e)
                                 : _mm512_sub_epi32(e, _mm512_set1_epi32(23 << 23));
    return {_mm512_castsi512_ps(bits)};
  }
  static VecAvx512 load_i16(const int16_t* p) {
    return {_mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))))};
  }
  static VecAvx512 load_i8(const int8_t* p) {
    return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
  }
  // 16 nibbles from the 8 bytes at bytes + index / 2 (index even): each byte widened to a
  // 16-bit lane holds its low nibble in the low byte and its high nibble in the high one,
  // which is the element order once the 16 bytes widen to 32-bit lanes.
  static VecAvx512 load_u4(const uint8_t* bytes, int64_t index) {
    const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + (index >> 1))));
    const __m128i split = _mm_or_si128(_mm_and_si128(w, _mm_set1_epi16(0x000F)),
                                       _mm_and_si128(_mm_slli_epi16(w, 4), _mm_set1_epi16(0x0F00)));
    return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(split))};
  }
  // comp_to_i16 in four operations, two of them off the value's dependency chain: NaN lanes
  // are zeroed by the conversion's mask; the low clamp is the narrowing's saturation (a
  // value below -32768, -inf included, converts to at most -32768 or to INT32_MIN, which
  // saturates to -32768); the high one stays a min, as +inf converts to INT32_MIN too.
  static void store_i16_rne(int16_t* p, VecAvx512 x) {
    const __mmask16 ordered = _mm512_cmp_ps_mask(x.v, x.v, _CMP_ORD_Q);
    const __m512 y = _mm512_min_ps(x.v, _mm512_set1_ps(32767.0f));
    const __m512i q = _mm512_maskz_cvt_roundps_epi32(ordered, y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtsepi32_epi16(q));
  }
  // max(acc, |x|) for a running absmax (acc: +0 or earlier results, sign clear): on the
  // bits, as unsigned integers, which order non-negative floats as floats and put every
  // NaN above +inf, so a NaN stays (its payload may be another NaN's). Two operations where
  // abs then max_nan took four, and one on the loop-carried chain.
  static VecAvx512 max_abs(VecAvx512 acc, VecAvx512 x) {
    const __m512i mag = _mm512_and_si512(_mm512_castps_si512(x.v), _mm512_set1_epi32(0x7FFFFFFF));
    return {_mm512_castsi512_ps(_mm512_max_epu32(_mm512_castps_si512(acc.v), mag))};
  }
  // The largest lane of a max_abs accumulator, on the bits as max_abs keeps them (NaN above
  // all): four shuffle-and-max steps, where 16 scalar NaN-checked maxima per block (a
  // compare, a flag and a spill each) had taken ~16 % of the fp8 update's time.
  static float reduce_max_abs(VecAvx512 acc) {
    return bits_float(_mm512_reduce_max_epu32(_mm512_castps_si512(acc.v)));
  }
  static VecAvx512 max_nan(VecAvx512 a, VecAvx512 b) {
    const __mmask16 unordered = _mm512_cmp_ps_mask(a.v, b.v, _CMP_UNORD_Q);
    return {_mm512_mask_add_ps(_mm512_max_ps(a.v, b.v), unordered, a.v, b.v)};
  }
  static VecAvx512 sign(VecAvx512 a) {
    const __m512 zero = _mm512_setzero_ps();
    const __mmask16 pos = _mm512_cmp_ps_mask(a.v, zero, _CMP_GT_OQ);
    const __mmask16 neg = _mm512_cmp_ps_mask(a.v, zero, _CMP_LT_OQ);
    const __m512 ones = _mm512_maskz_mov_ps(pos, _mm512_set1_ps(1.0f));
    return {_mm512_mask_mov_ps(ones, neg, _mm512_set1_ps(-1.0f))};
  }

  struct DAcc {
    __m512d lo, hi;
  };
  static DAcc dacc_zero() { return {_mm512_setzero_pd(), _mm512_setzero_pd()}; }
  static DAcc dacc_add_squares(DAcc acc, VecAvx512 x) {
    const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x.v));
    const __m512d hi = _mm512_cvtps_pd(_mm512_extractf32x8_ps(x.v, 1));
    return {_mm512_fmadd_pd(lo, lo, acc.lo), _mm512_fmadd_pd(hi, hi, acc.hi)};
  }
  static double dacc_total(DAcc acc) { return _mm512_reduce_add_pd(_mm512_add_pd(acc.lo, acc.hi)); }
};

}  // namespace isa_avx512

const KernelTable* avx512_table() {
  using namespace isa_avx512;
  return KernelSet<VecAvx512<false>, VecScalar>::table("avx512");
}

const KernelTable* avx512_bf16_table() {
  using namespace isa_avx512;
  return KernelSet<VecAvx512<true>, VecScalar>::table("avx512_bf16");
}

}  // namespace kernels
}  // namespace tierstate
