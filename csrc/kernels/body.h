// The kernel bodies: one per op, written once over a vector type V (see
// vec_scalar.h for the interface) and instantiated by every kernels_<isa>.cpp inside
// its own namespace TIERSTATE_KERNEL_ISA.
//
// The arithmetic follows tierstate/kernels/reference.py (torch's single-tensor
// optimizers) operation by operation; where torch rounds twice and we fuse (a*b+c),
// results differ by an ulp or so, which the parity tests bound.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels/isa_table.h"

#ifndef TIERSTATE_KERNEL_ISA
#error "define TIERSTATE_KERNEL_ISA (the per-ISA namespace) before including body.h"
#endif

namespace tierstate {
namespace kernels {
namespace TIERSTATE_KERNEL_ISA {

template <DType D>
using DTypeTag = std::integral_constant<DType, D>;

template <class V, DType D>
inline V load_as(const void* base, int64_t i) {
  if constexpr (D == DType::kF32) return V::load(static_cast<const float*>(base) + i);
  else if constexpr (D == DType::kBF16) return V::load_bf16(static_cast<const uint16_t*>(base) + i);
  else return V::load_f16(static_cast<const uint16_t*>(base) + i);
}

template <class V, DType D>
inline void store_as(void* base, int64_t i, V x) {
  if constexpr (D == DType::kF32) V::store(static_cast<float*>(base) + i, x);
  else if constexpr (D == DType::kBF16) V::store_bf16(static_cast<uint16_t*>(base) + i, x);
  else if constexpr (D == DType::kF16) V::store_f16(static_cast<uint16_t*>(base) + i, x);
  // DType::kNone: no low-precision copy requested
}

// [Note: streaming stores for weight_out]
// weight_out is only written in a step, never read, so an ordinary store first reads
// each of its lines into the cache (read-for-ownership). Non-temporal stores skip that
// read and the later eviction. Measured on the Zen 4 (EPYC, family 25 model 17) VM (100M params, 2 threads,
// interleaved with torch's fused fp32 AdamW): the mixed-precision step went from
// 1.20-1.22x to 0.98-1.00x of that floor. The master and moments are read before they
// are written, so streaming them would save nothing. Streaming needs the store address
// aligned to the vector's output width; dispatch.cpp aligns chunks to weight_out's cache
// lines, so only a misaligned (odd-byte) buffer falls back to ordinary stores.
template <class V>
inline bool can_stream_out(const void* weight_out, int64_t begin) {
  if constexpr (V::kWidth == 1) {
    return false;
  } else {
    if (weight_out == nullptr) return false;
    const auto address = reinterpret_cast<uintptr_t>(static_cast<const uint16_t*>(weight_out) + begin);
    return address % (2 * V::kWidth) == 0;
  }
}

template <class V, DType O>
inline void store_out(void* base, int64_t i, V x, bool stream) {
  if constexpr (V::kWidth > 1 && O == DType::kBF16) {
    if (stream) return V::stream_bf16(static_cast<uint16_t*>(base) + i, x);
  } else if constexpr (V::kWidth > 1 && O == DType::kF16) {
    if (stream) return V::stream_f16(static_cast<uint16_t*>(base) + i, x);
  }
  store_as<V, O>(base, i, x);
}

// Streaming stores are weakly ordered: fence them before the chunk counts as done.
template <class V>
inline void end_stream(bool stream) {
  if constexpr (V::kWidth > 1) {
    if (stream) V::stream_fence();
  }
}

// torch's lerp (ATen lerp_vec): start + w * (end - start), or for |w| >= 0.5
// end + (w - 1) * (end - start), which keeps lerp(a, b, 1) == b exact.
template <class V>
inline V lerp(V start, V end, V coeff, bool from_end) {
  const V diff = end - start;
  return V::fmadd(coeff, diff, from_end ? end : start);
}

// Calls f(tag) with the dtype as a compile-time constant.
template <class F>
inline void visit_value_dtype(DType d, F&& f) {
  if (d == DType::kBF16) f(DTypeTag<DType::kBF16>{});
  else if (d == DType::kF16) f(DTypeTag<DType::kF16>{});
  else f(DTypeTag<DType::kF32>{});
}

template <class F>
inline void visit_out_dtype(DType d, F&& f) {
  if (d == DType::kBF16) f(DTypeTag<DType::kBF16>{});
  else if (d == DType::kF16) f(DTypeTag<DType::kF16>{});
  else f(DTypeTag<DType::kNone>{});
}

// ---- Adam / AdamW -----------------------------------------------------------
template <class V, DType G, DType M, DType O, bool kAmsgrad>
void adam_loop(const AdamTask& t, int64_t begin, int64_t end) {
  // Copy everything into locals: stores through the float pointers below could
  // alias the task's fields, which would force reloads in the loop.
  float* const weight = t.weight;
  const void* const grad = t.grad;
  void* const exp_avg = t.exp_avg;
  void* const exp_avg_sq = t.exp_avg_sq;
  void* const max_exp_avg_sq = t.max_exp_avg_sq;
  void* const weight_out = t.weight_out;
  const bool coupled_wd = t.coupled_wd, decoupled_wd = t.decoupled_wd;
  const bool m_from_end = t.m_lerp.from_end;
  const V grad_mul = V::set1(t.grad_mul), wd = V::set1(t.wd), decay = V::set1(t.decay);
  const V m_coeff = V::set1(t.m_lerp.coeff);
  const V beta2 = V::set1(t.beta2), one_minus_beta2 = V::set1(t.one_minus_beta2);
  const V neg_step_size_bc2 = V::set1(t.neg_step_size_bc2), eps_bc2 = V::set1(t.eps_bc2);

  const bool stream = can_stream_out<V>(weight_out, begin);
  for (int64_t i = begin; i < end; i += V::kWidth) {
    V g = load_as<V, G>(grad, i) * grad_mul;
    V w = V::load(weight + i);
    if (coupled_wd) g = V::fmadd(w, wd, g);      // grad.add(weight, alpha=wd)
    if (decoupled_wd) w = w * decay;             // weight.mul_(1 - lr * wd)
    const V m = lerp(load_as<V, M>(exp_avg, i), g, m_coeff, m_from_end);
    const V v = V::fmadd(one_minus_beta2 * g, g, load_as<V, M>(exp_avg_sq, i) * beta2);
    V v_used = v;
    if constexpr (kAmsgrad) {
      v_used = V::max_nan(load_as<V, M>(max_exp_avg_sq, i), v);
      store_as<V, M>(max_exp_avg_sq, i, v_used);
    }
    const V denom = V::sqrt(v_used) + eps_bc2;   // (sqrt(v) / sqrt(bc2) + eps) * sqrt(bc2)
    w = V::fmadd(neg_step_size_bc2, m / denom, w);  // weight.addcdiv_(m, denom, value=-step_size)
    V::store(weight + i, w);
    store_as<V, M>(exp_avg, i, m);
    store_as<V, M>(exp_avg_sq, i, v);
    store_out<V, O>(weight_out, i, w, stream);
  }
  end_stream<V>(stream);
}

template <class V>
void adam_range(const AdamTask& t, int64_t begin, int64_t end) {
  visit_value_dtype(t.grad_dtype, [&](auto g) {
    visit_value_dtype(t.moment_dtype, [&](auto m) {
      visit_out_dtype(t.out_dtype, [&](auto o) {
        constexpr DType kG = decltype(g)::value, kM = decltype(m)::value, kO = decltype(o)::value;
        if constexpr (kM != DType::kF16) {  // moments are fp32 or bf16 only
          if (t.max_exp_avg_sq != nullptr) adam_loop<V, kG, kM, kO, true>(t, begin, end);
          else adam_loop<V, kG, kM, kO, false>(t, begin, end);
        }
      });
    });
  });
}

// ---- Lion -------------------------------------------------------------------
template <class V, DType G, DType M, DType O>
void lion_loop(const LionTask& t, int64_t begin, int64_t end) {
  float* const weight = t.weight;
  const void* const grad = t.grad;
  void* const exp_avg = t.exp_avg;
  void* const weight_out = t.weight_out;
  const bool has_wd = t.has_wd;
  const bool update_from_end = t.update_lerp.from_end, m_from_end = t.m_lerp.from_end;
  const V grad_mul = V::set1(t.grad_mul), decay = V::set1(t.decay);
  const V update_coeff = V::set1(t.update_lerp.coeff), m_coeff = V::set1(t.m_lerp.coeff);
  const V neg_lr = V::set1(t.neg_lr);

  const bool stream = can_stream_out<V>(weight_out, begin);
  for (int64_t i = begin; i < end; i += V::kWidth) {
    const V g = load_as<V, G>(grad, i) * grad_mul;
    const V m = load_as<V, M>(exp_avg, i);
    V w = V::load(weight + i);
    if (has_wd) w = w * decay;
    const V update = V::sign(lerp(m, g, update_coeff, update_from_end));
    w = V::fmadd(update, neg_lr, w);             // weight.add_(update, alpha=-lr)
    V::store(weight + i, w);
    store_as<V, M>(exp_avg, i, lerp(m, g, m_coeff, m_from_end));
    store_out<V, O>(weight_out, i, w, stream);
  }
  end_stream<V>(stream);
}

template <class V>
void lion_range(const LionTask& t, int64_t begin, int64_t end) {
  visit_value_dtype(t.grad_dtype, [&](auto g) {
    visit_value_dtype(t.moment_dtype, [&](auto m) {
      visit_out_dtype(t.out_dtype, [&](auto o) {
        constexpr DType kG = decltype(g)::value, kM = decltype(m)::value, kO = decltype(o)::value;
        if constexpr (kM != DType::kF16) lion_loop<V, kG, kM, kO>(t, begin, end);
      });
    });
  });
}

// ---- SGD (optionally with (Nesterov) momentum) -------------------------------
template <class V, DType G, DType M, DType O, bool kMomentum>
void sgd_loop(const SgdTask& t, int64_t begin, int64_t end) {
  float* const weight = t.weight;
  const void* const grad = t.grad;
  void* const buffer = t.momentum_buffer;
  void* const weight_out = t.weight_out;
  const bool has_wd = t.has_wd, nesterov = t.nesterov, first_step = t.first_step;
  const V grad_mul = V::set1(t.grad_mul), wd = V::set1(t.wd);
  const V momentum = V::set1(t.momentum), one_minus_dampening = V::set1(t.one_minus_dampening);
  const V neg_lr = V::set1(t.neg_lr);

  const bool stream = can_stream_out<V>(weight_out, begin);
  for (int64_t i = begin; i < end; i += V::kWidth) {
    V g = load_as<V, G>(grad, i) * grad_mul;
    V w = V::load(weight + i);
    if (has_wd) g = V::fmadd(w, wd, g);          // grad.add(weight, alpha=wd)
    if constexpr (kMomentum) {
      // The first step starts the buffer at the gradient itself (no dampening), as
      // torch's clone(grad) does.
      const V buf = first_step ? g
                               : V::fmadd(g, one_minus_dampening, load_as<V, M>(buffer, i) * momentum);
      store_as<V, M>(buffer, i, buf);
      g = nesterov ? V::fmadd(buf, momentum, g) : buf;
    }
    w = V::fmadd(g, neg_lr, w);                  // weight.add_(g, alpha=-lr)
    V::store(weight + i, w);
    store_out<V, O>(weight_out, i, w, stream);
  }
  end_stream<V>(stream);
}

template <class V>
void sgd_range(const SgdTask& t, int64_t begin, int64_t end) {
  visit_value_dtype(t.grad_dtype, [&](auto g) {
    visit_value_dtype(t.moment_dtype, [&](auto m) {
      visit_out_dtype(t.out_dtype, [&](auto o) {
        constexpr DType kG = decltype(g)::value, kM = decltype(m)::value, kO = decltype(o)::value;
        if constexpr (kM != DType::kF16) {
          if (t.momentum_buffer != nullptr) sgd_loop<V, kG, kM, kO, true>(t, begin, end);
          else sgd_loop<V, kG, kM, kO, false>(t, begin, end);
        }
      });
    });
  });
}

// ---- Adagrad ----------------------------------------------------------------
template <class V, DType G, DType M, DType O>
void adagrad_loop(const AdagradTask& t, int64_t begin, int64_t end) {
  float* const weight = t.weight;
  const void* const grad = t.grad;
  void* const state_sum = t.state_sum;
  void* const weight_out = t.weight_out;
  const bool has_wd = t.has_wd;
  const V grad_mul = V::set1(t.grad_mul), wd = V::set1(t.wd), eps = V::set1(t.eps);
  const V neg_clr = V::set1(t.neg_clr);

  const bool stream = can_stream_out<V>(weight_out, begin);
  for (int64_t i = begin; i < end; i += V::kWidth) {
    V g = load_as<V, G>(grad, i) * grad_mul;
    V w = V::load(weight + i);
    if (has_wd) g = V::fmadd(w, wd, g);
    const V s = V::fmadd(g, g, load_as<V, M>(state_sum, i));  // state_sum.addcmul_(g, g)
    const V std_dev = V::sqrt(s) + eps;
    w = V::fmadd(neg_clr, g / std_dev, w);       // weight.addcdiv_(g, std, value=-clr)
    V::store(weight + i, w);
    store_as<V, M>(state_sum, i, s);
    store_out<V, O>(weight_out, i, w, stream);
  }
  end_stream<V>(stream);
}

template <class V>
void adagrad_range(const AdagradTask& t, int64_t begin, int64_t end) {
  visit_value_dtype(t.grad_dtype, [&](auto g) {
    visit_value_dtype(t.moment_dtype, [&](auto m) {
      visit_out_dtype(t.out_dtype, [&](auto o) {
        constexpr DType kG = decltype(g)::value, kM = decltype(m)::value, kO = decltype(o)::value;
        if constexpr (kM != DType::kF16) adagrad_loop<V, kG, kM, kO>(t, begin, end);
      });
    });
  });
}

// ---- sum of squares ---------------------------------------------------------
// Sum of squares of [begin, end) with fp32 accumulators reduced to double every
// kSumsqBlockElements: each of the 4 x kWidth lanes sums <= 16384 / 4 squares before that
// (relative error <= ~1e-5; torch's own fp32 norm is no better). Converting every element
// to double instead ran at 19-31 GB/s, half the memory bandwidth. Four independent chains
// hide the FMA latency.
template <class V, DType G>
double sumsq_block(const void* grad, int64_t begin, int64_t end) {
  V a0 = V::set1(0.0f), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = begin;
  for (; i + 4 * V::kWidth <= end; i += 4 * V::kWidth) {
    const V x0 = load_as<V, G>(grad, i), x1 = load_as<V, G>(grad, i + V::kWidth);
    const V x2 = load_as<V, G>(grad, i + 2 * V::kWidth), x3 = load_as<V, G>(grad, i + 3 * V::kWidth);
    a0 = V::fmadd(x0, x0, a0);
    a1 = V::fmadd(x1, x1, a1);
    a2 = V::fmadd(x2, x2, a2);
    a3 = V::fmadd(x3, x3, a3);
  }
  for (; i + V::kWidth <= end; i += V::kWidth) {
    const V x = load_as<V, G>(grad, i);
    a0 = V::fmadd(x, x, a0);
  }
  float lanes[4 * V::kWidth];
  V::store(lanes, a0);
  V::store(lanes + V::kWidth, a1);
  V::store(lanes + 2 * V::kWidth, a2);
  V::store(lanes + 3 * V::kWidth, a3);
  double total = 0.0;
  for (float lane : lanes) total += lane;
  return total;
}

template <class V, DType G>
double sumsq_loop(const void* grad, int64_t begin, int64_t end) {
  double total = 0.0;
  for (int64_t b = begin; b < end; b += kSumsqBlockElements)
    total += sumsq_block<V, G>(grad, b, std::min(end, b + kSumsqBlockElements));
  return total;
}

template <class V>
double sumsq_range(const void* grad, DType grad_dtype, int64_t begin, int64_t end) {
  double total = 0.0;
  visit_value_dtype(grad_dtype, [&](auto g) { total = sumsq_loop<V, decltype(g)::value>(grad, begin, end); });
  return total;
}

// ---- compressed state: 8-bit moments, fp32 / bf16 master ----------------------
// One pass per block: dequantize m and sqrt(v), update in fp32 exactly as adam_loop,
// write the master, keep the new m and sqrt(v) in two fp32 rows of the block (L1), then
// encode both rows with the block's new absmax. The specification is quant.py.

// NaN if either is NaN (the scale of a block with a NaN must be NaN), else the larger.
inline float max_nan_scalar(float a, float b) {
  if (a != a || b != b) return a + b;
  return a > b ? a : b;
}


// The two kinds of 8-bit map (QuantMapRef) as codecs over a vector type W: a table map
// (decode: one lookup; encode: bucket, then one threshold) or an fp8 map (arithmetic only).
// A table map's lookups go through W's gather instruction or one scalar load per lane:
// which is faster depends on the core (dispatch.cpp times both), the codes do not. The
// choice is a branch per vector, not a template parameter: the branch always goes one way
// in a call, and a second instantiation of every fused loop took a 2-core build from 88 s
// to 109 s.
//
// Where W can (kHasRowDecode: AVX-512 with VBMI), a block's codes are decoded all at once
// before its update instead (decode_row): 64 codes per step through the table's four byte
// planes, two byte permutes and a blend per plane, 2.3 ns per 16 codes against 5.9 ns for
// a 16-lane gather (Zen 4, one core, codes and table in L1). The planes are laid out here,
// once per task (1 KiB, from the 256 fp32 values).
struct TableCodec {
  TableCodec(const QuantMapRef& m, bool table_gather, bool table_rows = false)
      : map(m), gather(table_gather), rows(table_rows) {
    if (!rows) return;
    for (int c = 0; c < 256; ++c) {
      const uint32_t bits = float_bits(map.table[c]);
      for (int p = 0; p < 4; ++p) planes[p][c] = static_cast<uint8_t>(bits >> (8 * p));
    }
  }
  QuantMapRef map;
  bool gather;
  bool rows;
  alignas(64) uint8_t planes[4][256];
  // Writes the table values of codes[0, n) to row[0, n) and returns true, or returns false
  // (the caller decodes per vector).
  template <class V>
  bool decode_row(const uint8_t* codes, int64_t n, float* row) const {
    if constexpr (V::kHasRowDecode) {
      if (!rows) return false;
      const int64_t whole = n / 64 * 64;
      V::decode_q8_row(codes, whole, planes, row);
      for (int64_t i = whole; i < n; ++i) row[i] = map.table[codes[i]];
      return true;
    }
    return false;
  }
  template <class W>
  W decode(const uint8_t* codes) const {
    if constexpr (W::kHasGather) {
      if (!gather) return W::decode_q8_loads(codes, map.table);
    }
    return W::decode_q8(codes, map.table);
  }
  template <class W>
  void encode(uint8_t* out, W y) const {
    if constexpr (W::kHasGather) {
      if (!gather) return W::encode_q8_loads(out, y, map);
    }
    W::encode_q8(out, y, map);
  }
  static constexpr bool kEncodesPairs = false;  // a lookup per vector: nothing to share
};

template <int M, bool kSigned>
struct Fp8Codec {
  Fp8Codec(const QuantMapRef&, bool, bool = false) {}
  template <class V>
  bool decode_row(const uint8_t*, int64_t, float*) const { return false; }  // arithmetic per vector
  template <class W>
  W decode(const uint8_t* codes) const { return W::template decode_fp8<M, kSigned>(codes); }
  template <class W>
  void encode(uint8_t* out, W y) const { W::template encode_fp8<M, kSigned>(out, y); }
  // 2 x W::kWidth codes at once, where W can (kHasFp8Pair): encode_row.
  static constexpr bool kEncodesPairs = true;
  template <class W>
  void encode_pair(uint8_t* out, W y0, W y1) const { W::template encode_fp8_pair<M, kSigned>(out, y0, y1); }
};
using Fp8SignedCodec = Fp8Codec<kFp8SignedMantissaBits, true>;
using Fp8UnsignedCodec = Fp8Codec<kFp8UnsignedMantissaBits, false>;

// Elements [i0, i1) of the block that starts at b0, over vector type W. Returns the
// absmax of the new m and of the new sqrt(v) through amax_m / amax_s.
// m_mul / s_mul: the blocks' dequantization multipliers (scale / map top). from_rows: the
// block's old codes are decoded in m_row / s_row already (TableCodec::decode_row); each
// element's new m and sqrt(v) overwrite them there after they are read.
template <class W, DType G, DType O, MasterMode MM, class CM, class CV>
inline void adam_q8_elements(const AdamQ8Task& t, const CM& m_codec, const CV& v_codec, int64_t i0,
                             int64_t i1, int64_t b0, float m_mul, float s_mul, float* m_row, float* s_row,
                             float& amax_m, float& amax_s, bool stream, bool from_rows) {
  const void* const grad = t.grad;
  float* const master32 = static_cast<float*>(t.master);
  uint16_t* const master16 = static_cast<uint16_t*>(t.master);
  int16_t* const comp = static_cast<int16_t*>(t.comp);
  const uint8_t* const m_codes = t.m_codes;
  const uint8_t* const v_codes = t.v_codes;
  void* const weight_out = t.weight_out;
  const bool coupled_wd = t.coupled_wd, decoupled_wd = t.decoupled_wd;
  const bool m_from_end = t.m_lerp.from_end;
  const uint32_t sr_key = t.sr_key, index_offset = t.index_offset;
  const W grad_mul = W::set1(t.grad_mul), wd = W::set1(t.wd), decay = W::set1(t.decay);
  const W m_coeff = W::set1(t.m_lerp.coeff);
  const W beta2 = W::set1(t.beta2), one_minus_beta2 = W::set1(t.one_minus_beta2);
  const W neg_step_size_bc2 = W::set1(t.neg_step_size_bc2), eps_bc2 = W::set1(t.eps_bc2);
  const W ms = W::set1(m_mul), ss = W::set1(s_mul);
  W am = W::set1(0.0f), as = W::set1(0.0f);

  for (int64_t i = i0; i < i1; i += W::kWidth) {
    W g = load_as<W, G>(grad, i) * grad_mul;
    W w;
    if constexpr (MM == MasterMode::kF32) w = W::load(master32 + i);
    else if constexpr (MM == MasterMode::kBF16Kahan) {
      const W master = W::load_bf16(master16 + i);
      w = W::fmadd(W::load_i16(comp + i), W::comp_unit(master, false), master);  // the product is exact
    } else {
      w = W::load_bf16(master16 + i);
    }
    if (coupled_wd) g = W::fmadd(w, wd, g);
    if (decoupled_wd) w = w * decay;
    const W m_old = (from_rows ? W::load(m_row + (i - b0)) : m_codec.template decode<W>(m_codes + i)) * ms;
    const W s_old = (from_rows ? W::load(s_row + (i - b0)) : v_codec.template decode<W>(v_codes + i)) * ss;
    const W m = lerp(m_old, g, m_coeff, m_from_end);
    const W v = W::fmadd(one_minus_beta2 * g, g, (s_old * s_old) * beta2);
    const W s = W::sqrt(v);
    w = W::fmadd(neg_step_size_bc2, m / (s + eps_bc2), w);
    if constexpr (MM == MasterMode::kF32) {
      W::store(master32 + i, w);
      store_out<W, O>(weight_out, i, w, stream);
    } else if constexpr (MM == MasterMode::kBF16Kahan) {
      // master = bf16(w); comp = (w - master) in units of 2**-16 of master's bf16 ulp,
      // rounded to nearest even: w - master is exact in fp32 and at most half an ulp, so
      // comp holds it to 2**-17 ulp (quant.py: "bf16_kahan").
      W::store_bf16(master16 + i, w);
      const W rounded = W::load_bf16(master16 + i);
      W::store_i16_rne(comp + i, (w - rounded) * W::comp_unit(rounded, true));
      store_out<W, O>(weight_out, i, w, stream);
    } else {
      W::store_bf16_sr(master16 + i, w, sr_key, index_offset + static_cast<uint32_t>(i));
      store_out<W, O>(weight_out, i, W::load_bf16(master16 + i), stream);
    }
    W::store(m_row + (i - b0), m);
    W::store(s_row + (i - b0), s);
    am = W::max_abs(am, m);
    as = W::max_abs(as, s);  // s >= +0 or NaN: its absolute value is itself
  }
  amax_m = max_nan_scalar(amax_m, W::reduce_max_abs(am));
  amax_s = max_nan_scalar(amax_s, W::reduce_max_abs(as));
}

// The stored scale and the multiplier that normalises the block to the map's top value:
// a non-finite absmax gives scale NaN (and code 0 everywhere); an absmax below FLT_MIN
// (where top / absmax could overflow), multiplier 0 (code 0: the block dequantizes to zero).
inline float block_scale(float absmax, float top, float& inv, bool& finite) {
  finite = absmax - absmax == 0.0f;
  inv = finite && absmax >= 1.17549435e-38f ? top / absmax : 0.0f;
  return finite ? absmax : __builtin_nanf("");
}

// Encodes row[0, i1 - i0) into codes[i0, i1) (a block, or its W-wide part).
template <class W, class C>
inline void encode_row(const float* row, uint8_t* codes, int64_t i0, int64_t i1, float inv, const C& codec) {
  const W winv = W::set1(inv);
  int64_t i = i0;
  if constexpr (C::kEncodesPairs && W::kHasFp8Pair) {
    for (; i + 2 * W::kWidth <= i1; i += 2 * W::kWidth) {
      codec.template encode_pair<W>(codes + i, W::load(row + (i - i0)) * winv,
                                    W::load(row + (i - i0) + W::kWidth) * winv);
    }
  }
  for (; i < i1; i += W::kWidth) codec.template encode<W>(codes + i, W::load(row + (i - i0)) * winv);
}

template <class V, class S, class C>
inline void encode_block(const float* row, uint8_t* codes, int64_t b0, int64_t b1, float absmax,
                         float* scale_out, float top, const C& codec) {
  float inv;
  bool finite;
  *scale_out = block_scale(absmax, top, inv, finite);
  if (!finite) {
    std::memset(codes + b0, 0, static_cast<size_t>(b1 - b0));
    return;
  }
  const int64_t mid = b0 + (b1 - b0) / V::kWidth * V::kWidth;
  encode_row<V>(row, codes, b0, mid, inv, codec);
  encode_row<S>(row + (mid - b0), codes, mid, b1, inv, codec);
}

template <class V, class S, DType G, DType O, MasterMode MM, class CM, class CV>
void adam_q8_loop(const AdamQ8Task& t, int64_t begin, int64_t end) {
  alignas(64) float m_row[kMaxQuantBlock];
  alignas(64) float s_row[kMaxQuantBlock];
  const CM m_codec{t.m_map, t.table_gather, t.table_rows};
  const CV v_codec{t.v_map, t.table_gather, t.table_rows};
  const float m_top = t.m_map.top, v_top = t.v_map.top;
  const bool stream = can_stream_out<V>(t.weight_out, begin);
  for (int64_t b0 = begin; b0 < end; b0 += t.block) {
    const int64_t b1 = std::min(end, b0 + t.block);
    const int64_t blk = b0 / t.block;
    const int64_t mid = b0 + (b1 - b0) / V::kWidth * V::kWidth;
    const float m_mul = t.m_scale[blk] / m_top, s_mul = t.v_scale[blk] / v_top;
    float amax_m = 0.0f, amax_s = 0.0f;
    // Both codecs are table maps or both fp8 maps (dispatch.cpp), so both decode rows or neither.
    const bool from_rows = m_codec.template decode_row<V>(t.m_codes + b0, b1 - b0, m_row) &&
                           v_codec.template decode_row<V>(t.v_codes + b0, b1 - b0, s_row);
    adam_q8_elements<V, G, O, MM>(t, m_codec, v_codec, b0, mid, b0, m_mul, s_mul, m_row, s_row, amax_m, amax_s,
                                  stream, from_rows);
    adam_q8_elements<S, G, O, MM>(t, m_codec, v_codec, mid, b1, b0, m_mul, s_mul, m_row, s_row, amax_m, amax_s,
                                  false, from_rows);
    encode_block<V, S>(m_row, t.m_codes, b0, b1, amax_m, t.m_scale + blk, m_top, m_codec);
    encode_block<V, S>(s_row, t.v_codes, b0, b1, amax_s, t.v_scale + blk, v_top, v_codec);
  }
  end_stream<V>(stream);
}

template <class V, class S>
void adam_q8_range(const AdamQ8Task& t, int64_t begin, int64_t end) {
  // dispatch.cpp accepts either two table maps or the two fp8 maps.
  const bool fp8 = t.m_map.fp8_mantissa_bits != 0;
  visit_value_dtype(t.grad_dtype, [&](auto g) {
    visit_out_dtype(t.out_dtype, [&](auto o) {
      constexpr DType kG = decltype(g)::value, kO = decltype(o)::value;
      auto run = [&](auto mode) {
        constexpr MasterMode kM = decltype(mode)::value;
        if (fp8) adam_q8_loop<V, S, kG, kO, kM, Fp8SignedCodec, Fp8UnsignedCodec>(t, begin, end);
        else adam_q8_loop<V, S, kG, kO, kM, TableCodec, TableCodec>(t, begin, end);
      };
      switch (t.master_mode) {
        case MasterMode::kF32: run(std::integral_constant<MasterMode, MasterMode::kF32>{}); break;
        case MasterMode::kBF16Kahan: run(std::integral_constant<MasterMode, MasterMode::kBF16Kahan>{}); break;
        case MasterMode::kBF16SR: run(std::integral_constant<MasterMode, MasterMode::kBF16SR>{}); break;
      }
    });
  });
}

// Calls f with the codec of `map` (a table map or one of the two fp8 maps).
template <class F>
inline void visit_codec(const QuantMapRef& map, bool table_gather, bool table_rows, F&& f) {
  if (map.fp8_mantissa_bits == 0) f(TableCodec{map, table_gather, table_rows});
  else if (map.is_signed) f(Fp8SignedCodec{map, table_gather});
  else f(Fp8UnsignedCodec{map, table_gather});
}

template <class V, class S>
void quantize_range(const QuantTask& t, int64_t begin, int64_t end) {
  visit_codec(t.map, t.table_gather, t.table_rows, [&](const auto& codec) {
    for (int64_t b0 = begin; b0 < end; b0 += t.block) {
      const int64_t b1 = std::min(end, b0 + t.block);
      const int64_t mid = b0 + (b1 - b0) / V::kWidth * V::kWidth;
      V acc = V::set1(0.0f);
      for (int64_t i = b0; i < mid; i += V::kWidth) acc = V::max_abs(acc, V::load(t.x + i));
      float absmax = V::reduce_max_abs(acc);
      for (int64_t i = mid; i < b1; ++i) absmax = max_nan_scalar(absmax, S::abs(S::load(t.x + i)).v);
      encode_block<V, S>(t.x + b0, t.codes, b0, b1, absmax, t.scale + b0 / t.block, t.map.top, codec);
    }
  });
}

template <class W, class C>
inline void decode_span(const QuantTask& t, const C& codec, int64_t i0, int64_t i1, float mul) {
  const W wm = W::set1(mul);
  for (int64_t i = i0; i < i1; i += W::kWidth) W::store(t.out + i, codec.template decode<W>(t.codes + i) * wm);
}

template <class W>
inline void scale_span(float* x, int64_t i0, int64_t i1, float mul) {
  const W wm = W::set1(mul);
  for (int64_t i = i0; i < i1; i += W::kWidth) W::store(x + i, W::load(x + i) * wm);
}

template <class V, class S>
void dequantize_range(const QuantTask& t, int64_t begin, int64_t end) {
  visit_codec(t.map, t.table_gather, t.table_rows, [&](const auto& codec) {
    for (int64_t b0 = begin; b0 < end; b0 += t.block) {
      const int64_t b1 = std::min(end, b0 + t.block);
      const int64_t mid = b0 + (b1 - b0) / V::kWidth * V::kWidth;
      const float mul = t.scale[b0 / t.block] / t.map.top;
      if (codec.template decode_row<V>(t.codes + b0, b1 - b0, t.out + b0)) {
        scale_span<V>(t.out, b0, mid, mul);  // the same one product per value as decode_span
        scale_span<S>(t.out, mid, b1, mul);
        continue;
      }
      decode_span<V>(t, codec, b0, mid, mul);
      decode_span<S>(t, codec, mid, b1, mul);
    }
  });
}

// ---- group-wise int8 / int4 weights -----------------------------------------
// value = float(code) * scale, rounded once into the output dtype: the bits of
// compress.py's torch path (codes widened to fp32, multiplied in fp32, copied out).
template <class W>
inline W group_code(const GroupDequantTask& t, int64_t i) {
  return t.int4 ? W::load_u4(t.codes, i) - W::set1(8.0f) : W::load_i8(reinterpret_cast<const int8_t*>(t.codes) + i);
}

template <class W, DType kOut>
inline void group_span(const GroupDequantTask& t, int64_t i0, int64_t i1, float scale) {
  const W s = W::set1(scale);
  for (int64_t i = i0; i < i1; i += W::kWidth) {
    const W y = group_code<W>(t, i) * s;
    if constexpr (kOut == DType::kF32) W::store(static_cast<float*>(t.out) + i, y);
    if constexpr (kOut == DType::kBF16) W::store_bf16(static_cast<uint16_t*>(t.out) + i, y);
    if constexpr (kOut == DType::kF16) W::store_f16(static_cast<uint16_t*>(t.out) + i, y);
  }
}

template <class V, class S, DType kOut>
void dequantize_groups_typed(const GroupDequantTask& t, int64_t begin, int64_t end) {
  for (int64_t g0 = begin; g0 < end; g0 += t.group) {
    const int64_t g1 = std::min(end, g0 + t.group);
    const int64_t mid = g0 + (g1 - g0) / V::kWidth * V::kWidth;  // even: g0 and kWidth are
    const float scale = t.scale[g0 / t.group];
    group_span<V, kOut>(t, g0, mid, scale);
    group_span<S, kOut>(t, mid, g1, scale);
  }
}

template <class V, class S>
void dequantize_groups_range(const GroupDequantTask& t, int64_t begin, int64_t end) {
  switch (t.out_dtype) {
    case DType::kF32: return dequantize_groups_typed<V, S, DType::kF32>(t, begin, end);
    case DType::kBF16: return dequantize_groups_typed<V, S, DType::kBF16>(t, begin, end);
    default: return dequantize_groups_typed<V, S, DType::kF16>(t, begin, end);
  }
}

// ---- bf16 weights with 4-bit exponent codes -----------------------------------
// Plain byte arithmetic over blocks of 64: with a constant trip count of 32 the compiler
// vectorizes each half-block loop for the ISA this file is built for (zero-extend bytes to
// 16 bits, shift, mask, or); no table lookup, since the exponent is base + code.
inline uint16_t exp4_bits(uint8_t sign_mantissa, uint32_t exponent) {
  return static_cast<uint16_t>(((sign_mantissa & 0x80u) << 8) | ((exponent & 0xFFu) << 7) | (sign_mantissa & 0x7Fu));
}

inline void decode_exp4_block(const uint8_t* __restrict sm, const uint8_t* __restrict codes, uint32_t base,
                              uint16_t* __restrict out) {
  for (int j = 0; j < 32; ++j) out[j] = exp4_bits(sm[j], base + (codes[j] & 0x0Fu));
  for (int j = 0; j < 32; ++j) out[32 + j] = exp4_bits(sm[32 + j], base + (codes[j] >> 4));
}

// The decoded weights are written once and read by the layer's matrix products after the
// whole layer is decoded (100+ MB, beyond any cache), so each block goes through a 128-byte
// buffer in L1 and out with streaming stores: no read-for-ownership of the output's lines
// ([Note: streaming stores for weight_out]).
template <class V>
void decode_exp4_range(const Exp4Task& t, int64_t begin, int64_t end) {
  int64_t b = begin;
  if constexpr (V::kWidth > 1) {
    // begin is a whole number of 64-value blocks (128 bytes): every block keeps out's alignment
    if (reinterpret_cast<uintptr_t>(t.out + begin) % 64 == 0 && b + 64 <= end) {
      alignas(64) uint16_t block[64];
      for (; b + 64 <= end; b += 64) {
        decode_exp4_block(t.sign_mantissa + b, t.codes + b / 2, t.base, block);
        V::stream_block128(t.out + b, block);
      }
      V::stream_fence();
    }
  }
  for (; b + 64 <= end; b += 64) decode_exp4_block(t.sign_mantissa + b, t.codes + b / 2, t.base, t.out + b);
  for (int64_t i = b; i < end; ++i) {  // the last, partial block (same layout)
    const int64_t j = i - b;
    const uint8_t c = t.codes[b / 2 + (j & 31)];
    t.out[i] = exp4_bits(t.sign_mantissa[i], t.base + (j < 32 ? c & 0x0Fu : c >> 4));
  }
}

// ---- vector body + scalar tail ----------------------------------------------
template <class V>
inline int64_t vector_end(int64_t begin, int64_t end) {
  return begin + (end - begin) / V::kWidth * V::kWidth;
}

template <class V, class S>
struct KernelSet {
  static void adam(const AdamTask& t, int64_t b, int64_t e) {
    const int64_t m = vector_end<V>(b, e);
    adam_range<V>(t, b, m);
    adam_range<S>(t, m, e);
  }
  static void lion(const LionTask& t, int64_t b, int64_t e) {
    const int64_t m = vector_end<V>(b, e);
    lion_range<V>(t, b, m);
    lion_range<S>(t, m, e);
  }
  static void sgd(const SgdTask& t, int64_t b, int64_t e) {
    const int64_t m = vector_end<V>(b, e);
    sgd_range<V>(t, b, m);
    sgd_range<S>(t, m, e);
  }
  static void adagrad(const AdagradTask& t, int64_t b, int64_t e) {
    const int64_t m = vector_end<V>(b, e);
    adagrad_range<V>(t, b, m);
    adagrad_range<S>(t, m, e);
  }
  static double sumsq(const void* grad, DType d, int64_t b, int64_t e) {
    const int64_t m = vector_end<V>(b, e);
    return sumsq_range<V>(grad, d, b, m) + sumsq_range<S>(grad, d, m, e);
  }
  static const KernelTable* table(const char* name) {
    static const KernelTable t{name, &adam, &lion, &sgd, &adagrad, &sumsq,
                               &adam_q8_range<V, S>, &quantize_range<V, S>, &dequantize_range<V, S>,
                               &dequantize_groups_range<V, S>, &decode_exp4_range<V>, V::kHasGather,
                               V::kHasRowDecode};
    return &t;
  }
};

}  // namespace TIERSTATE_KERNEL_ISA
}  // namespace kernels
}  // namespace tierstate
