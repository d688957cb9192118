// The 1-wide vector type: the whole "scalar" ISA variant, and the tail of every
// wider one. Included by each kernels_<isa>.cpp inside its own namespace
// (TIERSTATE_KERNEL_ISA), so the copies compiled with different -m flags never
// merge at link time.
//
// bf16 and fp16 conversions are integer/bit arithmetic that is exact on every CPU:
// round-to-nearest-even, NaN kept NaN (bf16 NaN becomes 0x7FC0, as torch writes it),
// subnormals kept (unlike VCVTNEPS2BF16, which flushes them to zero).
#include <cstdint>
#include <cstring>

#include "kernels/kernels.h"

#ifndef TIERSTATE_KERNEL_ISA
#error "define TIERSTATE_KERNEL_ISA (the per-ISA namespace) before including vec_scalar.h"
#endif

namespace tierstate {
namespace kernels {
namespace TIERSTATE_KERNEL_ISA {

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint16_t f32_to_bf16_rne(float f) {
  const uint32_t u = float_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;  // NaN
  // Adding 0x7FFF plus the lowest kept bit rounds ties to the even neighbour;
  // a carry into the exponent is the correct round-up (up to infinity).
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

inline float bf16_to_f32(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

inline uint16_t f32_to_f16_rne(float f) {
  const uint32_t u = float_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t mag = u & 0x7FFFFFFFu;
  if (mag >= 0x7F800000u)  // inf stays inf; NaN stays NaN (quiet, top payload bits kept)
    return static_cast<uint16_t>(sign | (mag > 0x7F800000u ? 0x7E00u | ((mag >> 13) & 0x3FFu) : 0x7C00u));
  if (mag >= 0x477FF000u)  // >= 65520 = max half + half an ulp: rounds to inf
    return static_cast<uint16_t>(sign | 0x7C00u);
  if (mag < 0x38800000u) {  // below 2^-14: a half subnormal (or zero)
    // Adding 0.5f puts the value's 2^-24 units (the half subnormal step) in the low
    // mantissa bits of 0.5f's representation, rounded to nearest even by the FPU.
    const float shifted = bits_float(mag) + 0.5f;
    return static_cast<uint16_t>(sign | (float_bits(shifted) - 0x3F000000u));
  }
  // Normal: rebias the exponent (127 -> 15: subtract 112 << 23) and round away 13
  // mantissa bits to nearest even; a carry into the exponent is the right result.
  const uint32_t odd = (mag >> 13) & 1u;
  return static_cast<uint16_t>(sign | ((mag - (112u << 23) + 0xFFFu + odd) >> 13));
}

inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu;
  const uint32_t mantissa = h & 0x3FFu;
  if (exponent == 0x1F) return bits_float(sign | 0x7F800000u | (mantissa << 13));
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in fp32
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-08f;
    return sign ? -magnitude : magnitude;
  }
  return bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

// Chris Wellons' lowbias32: the counter-based hash of stochastic rounding (quant.py).
inline uint32_t lowbias32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

// fp32 -> bf16 by stochastic rounding: add 16 random bits below the kept ones and
// truncate. NaN -> 0x7FC0; an infinity has zero low bits, so it stays infinite.
inline uint16_t f32_to_bf16_sr(float f, uint32_t key, uint32_t index) {
  const uint32_t u = float_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  return static_cast<uint16_t>((u + (lowbias32(index ^ key) >> 16)) >> 16);
}

// The unit of the bf16_kahan compensation term for a master of value m (quant.py):
// 2**-16 of m's bf16 ulp, 2**(e - 150) for m's biased exponent e, with e raised to at
// least 24 so that the unit and its inverse (2**(150 - e)) are normal fp32 numbers.
inline float comp_unit_one(float m, bool inverse) {
  uint32_t e = (float_bits(m) >> 23) & 0xFFu;
  if (e < 24) e = 24;
  return bits_float((inverse ? 277u - e : e - 23u) << 23);
}

// The compensation term as int16: NaN -> 0, clamped to [-32768, 32767], nearest even.
inline int16_t comp_to_i16(float x) {
  float y = x == x ? x : 0.0f;
  y = y < -32768.0f ? -32768.0f : (y > 32767.0f ? 32767.0f : y);
  return static_cast<int16_t>(__builtin_rintf(y));
}

// The code of y under map m (see QuantMapRef): one bucket lookup, one integer compare.
inline uint8_t encode_q8_one(float y, const QuantMapRef& m) {
  const uint32_t mag = float_bits(y) & 0x7FFFFFFFu;
  int32_t b = static_cast<int32_t>(mag >> m.lut_shift) - m.lut_base;
  b = b < 0 ? 0 : b;
  b = b >= m.lut_size ? m.lut_size - 1 : b;
  const uint32_t w = m.lut[b];
  int32_t c = static_cast<int32_t>(w & 0xFFu);
  c += static_cast<int32_t>((mag & ((1u << m.lut_shift) - 1u)) >= (w >> 8));
  // Branch-free: the signs of moments are random, a branch would mispredict half the time.
  c |= static_cast<int32_t>(m.is_signed & (y < 0.0f)) << 7;
  return static_cast<uint8_t>(c);
}

// ---- fp8 maps (quant.py "fp8 maps"): M mantissa bits, 4 exponent bits, bias 15 ----
// A magnitude code c < 2**M is subnormal, c * 2**-(14 + M); above, the fp32 whose bits are
// (c + (112 << M)) << (23 - M), i.e. (1 + f / 2**M) * 2**(e - 15).
template <int M>
inline float fp8_magnitude(uint32_t c) {
  return c < (1u << M) ? static_cast<float>(c) * (1.0f / static_cast<float>(1u << (14 + M)))
                       : bits_float((c + (112u << M)) << (23 - M));
}

// The same value as an fp16: with 4 exponent bits, bias 15 and M mantissa bits, a code is an
// fp16 whose exponent field's top bit is 0 and whose mantissa's low 10 - M bits are 0 (its
// subnormals are fp16 subnormals), so the vector variants decode with the hardware's exact
// fp16 -> fp32 conversion.
template <int M, bool kSigned>
inline uint16_t fp8_as_f16(uint8_t code) {
  const uint32_t mag = kSigned ? code & 0x7Fu : code;
  return static_cast<uint16_t>((mag << (10 - M)) | (kSigned ? (code & 0x80u) << 8 : 0u));
}

template <int M, bool kSigned>
inline float decode_fp8_one(uint8_t code) {
  const float mag = fp8_magnitude<M>(kSigned ? code & 0x7Fu : code);
  return kSigned ? bits_float(float_bits(mag) | (static_cast<uint32_t>(code & 0x80u) << 24)) : mag;
}

// The code of |y| rounded to nearest, ties to even: at or above 2**-14, the fp32 bits
// rounded to M mantissa bits (the carry moves into the exponent); below, |y| * 2**(14 + M)
// rounded to an integer (exact product; rint under the default rounding mode). Clamped to
// the largest code; the sign goes to bit 7 when y < 0.
template <int M, bool kSigned>
inline uint8_t encode_fp8_one(float y) {
  const uint32_t bits = float_bits(y) & 0x7FFFFFFFu;
  int32_t c;
  if (bits >= (113u << 23)) {
    const uint32_t lsb = (bits >> (23 - M)) & 1u;
    c = static_cast<int32_t>((bits + ((1u << (22 - M)) - 1u) + lsb) >> (23 - M)) - (112 << M);
  } else {
    c = static_cast<int32_t>(__builtin_rintf(bits_float(bits) * static_cast<float>(1u << (14 + M))));
  }
  const int32_t top = kSigned ? 127 : 255;
  c = c > top ? top : c;
  if (kSigned) c |= static_cast<int32_t>(y < 0.0f) << 7;
  return static_cast<uint8_t>(c);
}

struct VecScalar {
  static constexpr int kWidth = 1;
  static constexpr bool kHasGather = false;  // decode_q8 / encode_q8 load lane by lane already
  static constexpr bool kHasRowDecode = false;  // body.h TableCodec::decode_row
  static constexpr bool kHasFp8Pair = false;  // one code at a time (body.h encode_row)
  float v;

  static VecScalar set1(float x) { return {x}; }
  static VecScalar load(const float* p) { return {*p}; }
  static void store(float* p, VecScalar x) { *p = x.v; }
  static VecScalar load_bf16(const uint16_t* p) { return {bf16_to_f32(*p)}; }
  static void store_bf16(uint16_t* p, VecScalar x) { *p = f32_to_bf16_rne(x.v); }
  static VecScalar load_f16(const uint16_t* p) { return {f16_to_f32(*p)}; }
  static void store_f16(uint16_t* p, VecScalar x) { *p = f32_to_f16_rne(x.v); }

  friend VecScalar operator+(VecScalar a, VecScalar b) { return {a.v + b.v}; }
  friend VecScalar operator-(VecScalar a, VecScalar b) { return {a.v - b.v}; }
  friend VecScalar operator*(VecScalar a, VecScalar b) { return {a.v * b.v}; }
  friend VecScalar operator/(VecScalar a, VecScalar b) { return {a.v / b.v}; }
  // a * b + c. Fused where the translation unit has FMA (the tails of the AVX2 and
  // AVX-512 variants, so tail and body round alike); two roundings in the baseline
  // build, where a software fmaf would cost ~100x.
  static VecScalar fmadd(VecScalar a, VecScalar b, VecScalar c) {
#if defined(__FMA__) || defined(__aarch64__)
    return {__builtin_fmaf(a.v, b.v, c.v)};
#else
    return {a.v * b.v + c.v};
#endif
  }
  static VecScalar sqrt(VecScalar a) { return {__builtin_sqrtf(a.v)}; }
  static VecScalar abs(VecScalar a) { return {bits_float(float_bits(a.v) & 0x7FFFFFFFu)}; }
  static VecScalar decode_q8(const uint8_t* codes, const float* table) { return {table[*codes]}; }
  static void encode_q8(uint8_t* out, VecScalar y, const QuantMapRef& m) { *out = encode_q8_one(y.v, m); }
  template <int M, bool kSigned>
  static VecScalar decode_fp8(const uint8_t* codes) { return {decode_fp8_one<M, kSigned>(*codes)}; }
  template <int M, bool kSigned>
  static void encode_fp8(uint8_t* out, VecScalar y) { *out = encode_fp8_one<M, kSigned>(y.v); }
  static void store_bf16_sr(uint16_t* p, VecScalar x, uint32_t key, uint32_t index) {
    *p = f32_to_bf16_sr(x.v, key, index);
  }
  static VecScalar comp_unit(VecScalar m, bool inverse) { return {comp_unit_one(m.v, inverse)}; }
  static VecScalar load_i16(const int16_t* p) { return {static_cast<float>(*p)}; }
  static VecScalar load_i8(const int8_t* p) { return {static_cast<float>(*p)}; }
  // Element `index` of nibbles packed two per byte, the even index in the low nibble.
  static VecScalar load_u4(const uint8_t* bytes, int64_t index) {
    return {static_cast<float>((bytes[index >> 1] >> ((index & 1) * 4)) & 0x0F)};
  }
  static void store_i16_rne(int16_t* p, VecScalar x) { *p = comp_to_i16(x.v); }
  // max(acc, |x|) of a running absmax, NaN if either is (the vector variants' max_abs).
  static VecScalar max_abs(VecScalar acc, VecScalar x) {
    const uint32_t a = float_bits(acc.v), b = float_bits(x.v) & 0x7FFFFFFFu;
    return {bits_float(a > b ? a : b)};
  }
  // The largest lane of a max_abs accumulator (its only lane here).
  static float reduce_max_abs(VecScalar acc) { return acc.v; }
  // torch.maximum: NaN if either is NaN.
  static VecScalar max_nan(VecScalar a, VecScalar b) {
    if (a.v != a.v || b.v != b.v) return {a.v + b.v};
    return {a.v > b.v ? a.v : b.v};
  }
  // torch.sign: -1, 0 or 1; 0 for NaN.
  static VecScalar sign(VecScalar a) {
    return {static_cast<float>((0.0f < a.v) - (a.v < 0.0f))};
  }

  using DAcc = double;
  static DAcc dacc_zero() { return 0.0; }
  static DAcc dacc_add_squares(DAcc acc, VecScalar x) {
    const double d = x.v;
    return acc + d * d;
  }
  static double dacc_total(DAcc acc) { return acc; }
};

}  // namespace TIERSTATE_KERNEL_ISA
}  // namespace kernels
}  // namespace tierstate
