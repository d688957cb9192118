// The boundary between dispatch.cpp (baseline ISA) and the per-ISA translation
// units. Each kernels_<isa>.cpp instantiates the same kernel bodies over its own
// vector type and exports one KernelTable; dispatch.cpp picks a table at run time
// from cpu_features() and splits the work into chunks over the thread pool.
#pragma once

#include <cstdint>

#include "kernels/kernels.h"

namespace tierstate {
namespace kernels {

// Lerp as torch computes it (ATen lerp_vec): for |w| < 0.5, start + w * (end - start);
// else end + (w - 1) * (end - start). `coeff` is w or w - 1, `from_end` picks the base.
struct LerpCoeff {
  float coeff;
  bool from_end;
};

inline LerpCoeff make_lerp(double weight) {
  const float w = static_cast<float>(weight);
  const bool small = (w < 0 ? -w : w) < 0.5f;
  return {small ? w : w - 1.0f, !small};
}

// Scalars are rounded to float the way torch rounds a Python float used with an
// fp32 tensor, so the kernels see the same coefficients as the reference.
struct AdamTask {
  float* weight;
  const void* grad;
  void* exp_avg;
  void* exp_avg_sq;
  void* max_exp_avg_sq;  // null: no amsgrad
  void* weight_out;      // null: no low-precision copy
  DType grad_dtype, moment_dtype, out_dtype;
  float grad_mul;        // +-grad_scale (the sign is `maximize`)
  bool coupled_wd;       // Adam's L2 term: grad += wd * weight
  float wd;
  bool decoupled_wd;     // AdamW: weight *= decay
  float decay;           // 1 - lr * wd
  LerpCoeff m_lerp;      // exp_avg.lerp_(grad, 1 - beta1)
  float beta2, one_minus_beta2;
  // torch: w += -step_size * m / (sqrt(v) / sqrt(bc2) + eps). Multiplying numerator and
  // denominator by sqrt(bc2) leaves one division per element instead of two: the step is
  // bound by the divider, not memory, at 1 thread (68 vs 58 ms per 100M params before).
  float neg_step_size_bc2;  // -lr / bias_correction1 * sqrt(bias_correction2)
  float eps_bc2;            // eps * sqrt(bias_correction2)
};

struct LionTask {
  float* weight;
  const void* grad;
  void* exp_avg;
  void* weight_out;
  DType grad_dtype, moment_dtype, out_dtype;
  float grad_mul;
  bool has_wd;
  float decay;
  LerpCoeff update_lerp;  // sign(exp_avg.lerp(grad, 1 - beta1))
  LerpCoeff m_lerp;       // exp_avg.lerp_(grad, 1 - beta2)
  float neg_lr;
};

struct SgdTask {
  float* weight;
  const void* grad;
  void* momentum_buffer;  // null when momentum == 0
  void* weight_out;
  DType grad_dtype, moment_dtype, out_dtype;
  float grad_mul;
  bool has_wd;
  float wd;
  float momentum, one_minus_dampening;
  bool nesterov, first_step;
  float neg_lr;
};

struct AdagradTask {
  float* weight;
  const void* grad;
  void* state_sum;
  void* weight_out;
  DType grad_dtype, moment_dtype, out_dtype;
  float grad_mul;
  bool has_wd;
  float wd;
  float eps;
  float neg_clr;
};

struct AdamQ8Task {
  void* master;
  void* comp;            // int16 compensation, kBF16Kahan only
  const void* grad;
  uint8_t* m_codes;
  float* m_scale;
  uint8_t* v_codes;
  float* v_scale;
  void* weight_out;
  DType grad_dtype, out_dtype;
  MasterMode master_mode;
  QuantMapRef m_map, v_map;
  int64_t block;
  float grad_mul;
  bool coupled_wd;
  float wd;
  bool decoupled_wd;
  float decay;
  LerpCoeff m_lerp;
  float beta2, one_minus_beta2;
  float neg_step_size_bc2, eps_bc2;  // as in AdamTask
  uint32_t sr_key, index_offset;
  bool table_gather;  // table maps: look codes up by gather (else a load per lane; body.h TableCodec)
  bool table_rows;    // table maps: decode a block's codes at once where the ISA can (TableCodec::decode_row)
};

struct QuantTask {
  const float* x;   // quantize: input; dequantize: output (as float*)
  float* out;
  uint8_t* codes;
  float* scale;
  int64_t block;
  QuantMapRef map;
  bool table_gather;  // as in AdamQ8Task
  bool table_rows;    // as in AdamQ8Task
};

// Group-wise int8 / int4 weights (tierstate/generate/compress.py) widened to out_dtype.
struct GroupDequantTask {
  const uint8_t* codes;  // int8 codes, or int4 codes + 8 packed two per byte (even index low)
  const float* scale;    // one per group
  void* out;
  DType out_dtype;
  int64_t group;
  bool int4;
};

// bf16 weights with 4-bit exponent codes (tierstate/generate/lossless.py), decoded to bf16
// bits. Per block of 64 values: 64 bytes of sign and mantissa (sign in bit 7, mantissa in
// bits 0-6) and 32 code bytes (byte j: value j's code in its low nibble, value j + 32's in
// its high one; a last, partial block keeps that layout). Exponent = (base + code) & 0xFF;
// code 15 marks an escape whose exponent dispatch.cpp patches in afterwards.
struct Exp4Task {
  const uint8_t* sign_mantissa;
  const uint8_t* codes;
  uint16_t* out;
  int64_t n;
  uint32_t base;
};

// Each entry processes elements [begin, end) of its task: a vector loop over the
// widest multiple of the vector width, then the same body over a 1-wide type.
struct KernelTable {
  const char* name;
  void (*adam)(const AdamTask&, int64_t begin, int64_t end);
  void (*lion)(const LionTask&, int64_t begin, int64_t end);
  void (*sgd)(const SgdTask&, int64_t begin, int64_t end);
  void (*adagrad)(const AdagradTask&, int64_t begin, int64_t end);
  double (*sumsq)(const void* grad, DType grad_dtype, int64_t begin, int64_t end);
  // The 8-bit ops take [begin, end) starting on a block boundary.
  void (*adam_q8)(const AdamQ8Task&, int64_t begin, int64_t end);
  void (*quantize)(const QuantTask&, int64_t begin, int64_t end);
  void (*dequantize)(const QuantTask&, int64_t begin, int64_t end);
  // [begin, end) on group boundaries.
  void (*dequantize_groups)(const GroupDequantTask&, int64_t begin, int64_t end);
  // [begin, end) with begin on a 64-value block boundary.
  void (*decode_exp4)(const Exp4Task&, int64_t begin, int64_t end);
  bool has_gather;  // the table maps can look up by gather (QuantTask::table_gather)
  bool has_row_decode;  // the table maps can decode a block at once (QuantTask::table_rows), given the CPU's VBMI
};

const KernelTable* scalar_table();
#if defined(__x86_64__) || defined(_M_X64)
const KernelTable* avx2_table();
const KernelTable* avx512_table();
const KernelTable* avx512_bf16_table();
#endif
#if defined(__aarch64__)
const KernelTable* neon_table();
#endif

}  // namespace kernels
}  // namespace tierstate
