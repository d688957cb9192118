// NEON variant (4 floats per vector) for AArch64, where Advanced SIMD, fp16
// conversion, vector sqrt and divide are all part of the base ISA.
#include <arm_neon.h>

#include <cstring>

#define TIERSTATE_KERNEL_ISA isa_neon
#include "kernels/vec_scalar.h"
#include "kernels/body.h"

namespace tierstate {
namespace kernels {
namespace isa_neon {

struct VecNeon {
  static constexpr int kWidth = 4;
  static constexpr bool kHasGather = false;  // decode_q8 / encode_q8 load lane by lane already
  static constexpr bool kHasRowDecode = false;  // body.h TableCodec::decode_row
  static constexpr bool kHasFp8Pair = false;  // one code at a time (body.h encode_row)
  float32x4_t v;

  static VecNeon set1(float x) { return {vdupq_n_f32(x)}; }
  static VecNeon load(const float* p) { return {vld1q_f32(p)}; }
  static void store(float* p, VecNeon x) { vst1q_f32(p, x.v); }

  static VecNeon load_bf16(const uint16_t* p) {
    return {vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16))};
  }
  // Round to nearest even by integer arithmetic (see f32_to_bf16_rne); NaN -> 0x7FC0.
  static void store_bf16(uint16_t* p, VecNeon x) {
    const uint32x4_t bits = vreinterpretq_u32_f32(x.v);
    const uint32x4_t lsb = vandq_u32(vshrq_n_u32(bits, 16), vdupq_n_u32(1));
    const uint32x4_t biased = vaddq_u32(bits, vaddq_u32(lsb, vdupq_n_u32(0x7FFF)));
    const uint32x4_t is_number = vceqq_f32(x.v, x.v);
    const uint32x4_t rounded = vbslq_u32(is_number, vshrq_n_u32(biased, 16), vdupq_n_u32(0x7FC0));
    vst1_u16(p, vmovn_u32(rounded));
  }
  // Plain stores: streaming (STNP) has not been measured on an AArch64 machine.
  static void stream_bf16(uint16_t* p, VecNeon x) { store_bf16(p, x); }
  static void stream_f16(uint16_t* p, VecNeon x) { store_f16(p, x); }
  static void stream_fence() {}
  static void stream_block128(uint16_t* dst, const uint16_t* src) { std::memcpy(dst, src, 128); }
  static VecNeon load_f16(const uint16_t* p) {
    return {vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p)))};
  }
  // FCVTN rounds with the FPCR mode, round-to-nearest-even unless a program changed it.
  static void store_f16(uint16_t* p, VecNeon x) {
    vst1_u16(p, vreinterpret_u16_f16(vcvt_f16_f32(x.v)));
  }

  friend VecNeon operator+(VecNeon a, VecNeon b) { return {vaddq_f32(a.v, b.v)}; }
  friend VecNeon operator-(VecNeon a, VecNeon b) { return {vsubq_f32(a.v, b.v)}; }
  friend VecNeon operator*(VecNeon a, VecNeon b) { return {vmulq_f32(a.v, b.v)}; }
  friend VecNeon operator/(VecNeon a, VecNeon b) { return {vdivq_f32(a.v, b.v)}; }
  static VecNeon fmadd(VecNeon a, VecNeon b, VecNeon c) { return {vfmaq_f32(c.v, a.v, b.v)}; }
  static VecNeon sqrt(VecNeon a) { return {vsqrtq_f32(a.v)}; }
  static VecNeon abs(VecNeon a) { return {vabsq_f32(a.v)}; }
  // The 8-bit codes lane by lane through the scalar definitions (vec_scalar.h): NEON has
  // no gather, and this path has not been measured on an AArch64 machine.
  static VecNeon decode_q8(const uint8_t* codes, const float* table) {
    const float lanes[4] = {table[codes[0]], table[codes[1]], table[codes[2]], table[codes[3]]};
    return {vld1q_f32(lanes)};
  }
  static void encode_q8(uint8_t* out, VecNeon y, const QuantMapRef& m) {
    float lanes[4];
    vst1q_f32(lanes, y.v);
    for (int k = 0; k < 4; ++k) out[k] = encode_q8_one(lanes[k], m);
  }
  // Decoding through the fp16 that holds the code (fp8_as_f16, vec_scalar.h): FCVTL widens it exactly.
  template <int M, bool kSigned>
  static VecNeon decode_fp8(const uint8_t* codes) {  // fp8_as_f16 on 4 lanes, as the x86 variants
    uint32_t word;  // 4 bytes, as load_i8 reads them
    std::memcpy(&word, codes, sizeof(word));
    const uint16x4_t c = vget_low_u16(vmovl_u8(vreinterpret_u8_u32(vdup_n_u32(word))));
    const uint16x4_t h =
        kSigned ? vorr_u16(vshl_n_u16(vand_u16(c, vdup_n_u16(0x7F)), 10 - M), vshl_n_u16(vand_u16(c, vdup_n_u16(0x80)), 8))
                : vshl_n_u16(c, 10 - M);
    return {vcvt_f32_f16(vreinterpret_f16_u16(h))};
  }
  template <int M, bool kSigned>
  static void encode_fp8(uint8_t* out, VecNeon y) {
    const uint32x4_t bits = vandq_u32(vreinterpretq_u32_f32(y.v), vdupq_n_u32(0x7FFFFFFF));
    const uint32x4_t lsb = vandq_u32(vshrq_n_u32(bits, 23 - M), vdupq_n_u32(1));
    const uint32x4_t rounded = vaddq_u32(vaddq_u32(bits, vdupq_n_u32((1u << (22 - M)) - 1u)), lsb);
    const uint32x4_t normal = vsubq_u32(vshrq_n_u32(rounded, 23 - M), vdupq_n_u32(112u << M));
    // FCVTNS: to nearest, ties to even (the scalar definition's rint under the default mode).
    const uint32x4_t sub = vreinterpretq_u32_s32(vcvtnq_s32_f32(
        vmulq_n_f32(vreinterpretq_f32_u32(bits), static_cast<float>(1u << (14 + M)))));
    uint32x4_t c = vbslq_u32(vcgeq_u32(bits, vdupq_n_u32(113u << 23)), normal, sub);
    c = vminq_u32(c, vdupq_n_u32(kSigned ? 127u : 255u));
    if (kSigned) c = vorrq_u32(c, vandq_u32(vcltq_f32(y.v, vdupq_n_f32(0.0f)), vdupq_n_u32(0x80)));
    for (int k = 0; k < 4; ++k) out[k] = static_cast<uint8_t>(c[k]);
  }
  static void store_bf16_sr(uint16_t* p, VecNeon x, uint32_t key, uint32_t index) {
    float lanes[4];
    vst1q_f32(lanes, x.v);
    for (int k = 0; k < 4; ++k) p[k] = f32_to_bf16_sr(lanes[k], key, index + static_cast<uint32_t>(k));
  }
  // comp_unit_one (vec_scalar.h) on 4 lanes, the exponent field kept in place as in the
  // x86 variants: and, max, sub (integer subtraction wraps, to exactly (277 - e) << 23).
  static VecNeon comp_unit(VecNeon m, bool inverse) {
    int32x4_t e = vreinterpretq_s32_u32(vandq_u32(vreinterpretq_u32_f32(m.v), vdupq_n_u32(0x7F800000u)));
    e = vmaxq_s32(e, vdupq_n_s32(24 << 23));
    const int32x4_t bits = inverse ? vsubq_s32(vdupq_n_s32(static_cast<int32_t>(277u << 23)), e)
                                   : vsubq_s32(e, vdupq_n_s32(23 << 23));
    return {vreinterpretq_f32_s32(bits)};
  }
  static VecNeon load_i16(const int16_t* p) { return {vcvtq_f32_s32(vmovl_s16(vld1_s16(p)))}; }
  // 4 bytes, not vld1_s8's 8: the last vector of a buffer must not read past its end.
  static VecNeon load_i8(const int8_t* p) {
    int32_t word;
    std::memcpy(&word, p, sizeof(word));
    const int8x8_t b = vreinterpret_s8_s32(vdup_n_s32(word));
    return {vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(b))))};
  }
  static VecNeon load_u4(const uint8_t* bytes, int64_t index) {
    const uint8_t b0 = bytes[index >> 1], b1 = bytes[(index >> 1) + 1];
    const uint32_t lanes[4] = {b0 & 0x0Fu, static_cast<uint32_t>(b0 >> 4), b1 & 0x0Fu, static_cast<uint32_t>(b1 >> 4)};
    return {vcvtq_f32_u32(vld1q_u32(lanes))};
  }
  // comp_to_i16 on 4 lanes: FCVTNS rounds to nearest even, gives 0 for NaN and saturates;
  // SQXTN saturates again to int16, which is the clamp.
  static void store_i16_rne(int16_t* p, VecNeon x) { vst1_s16(p, vqmovn_s32(vcvtnq_s32_f32(x.v))); }
  static VecNeon max_nan(VecNeon a, VecNeon b) { return {vmaxq_f32(a.v, b.v)}; }  // FMAX propagates NaN
  static VecNeon max_abs(VecNeon acc, VecNeon x) { return {vmaxq_f32(acc.v, vabsq_f32(x.v))}; }
  // The largest lane of a max_abs accumulator: its lanes are >= +0 or NaN with the sign
  // clear (FABS, then FMAX keeps a NaN), so the unsigned maximum of the bits is the float
  // maximum and puts any NaN above +inf.
  static float reduce_max_abs(VecNeon acc) { return bits_float(vmaxvq_u32(vreinterpretq_u32_f32(acc.v))); }
  static VecNeon sign(VecNeon a) {
    const float32x4_t zero = vdupq_n_f32(0.0f);
    const uint32x4_t pos = vandq_u32(vcgtq_f32(a.v, zero), vreinterpretq_u32_f32(vdupq_n_f32(1.0f)));
    const uint32x4_t neg = vandq_u32(vcltq_f32(a.v, zero), vreinterpretq_u32_f32(vdupq_n_f32(-1.0f)));
    return {vreinterpretq_f32_u32(vorrq_u32(pos, neg))};
  }

  struct DAcc {
    float64x2_t lo, hi;
  };
  static DAcc dacc_zero() { return {vdupq_n_f64(0.0), vdupq_n_f64(0.0)}; }
  static DAcc dacc_add_squares(DAcc acc, VecNeon x) {
    const float64x2_t lo = vcvt_f64_f32(vget_low_f32(x.v));
    const float64x2_t hi = vcvt_high_f64_f32(x.v);
    return {vfmaq_f64(acc.lo, lo, lo), vfmaq_f64(acc.hi, hi, hi)};
  }
  static double dacc_total(DAcc acc) { return vaddvq_f64(vaddq_f64(acc.lo, acc.hi)); }
};

}  // namespace isa_neon

const KernelTable* neon_table() {
  using namespace isa_neon;
  return KernelSet<VecNeon, VecScalar>::table("neon");
}

}  // namespace kernels
}  // namespace tierstate
