// Public C++ face of the optimizer kernels (the only header bindings.cpp needs).
//
// Contract (mirrors tierstate/kernels/reference.py): every pointer addresses n
// contiguous elements; weight is the fp32 master; grad is fp32/bf16/fp16 and only
// read; the moments share one dtype (fp32 or bf16, computed in fp32, stored rounded
// to nearest even); weight_out (bf16/fp16 or null) receives the updated weight
// rounded to its dtype in the same pass. Hyper-parameters, step counts and bias
// corrections all come from the caller: the kernels hold no state.
// The functions block until done and use the process thread pool; they never touch
// Python, so callers may release the GIL around them.
#pragma once

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

namespace tierstate {
namespace kernels {

// Element types, with the codes the Python faces pass.
enum class DType : int { kF32 = 0, kBF16 = 1, kF16 = 2, kNone = 3 };

struct AdamParams {
  double lr, beta1, beta2, eps, weight_decay;
  bool decoupled;  // AdamW: weight *= 1 - lr * weight_decay; else Adam: grad += weight_decay * weight
  double bias_correction1, bias_correction2;
  bool maximize;
  double grad_scale;  // folds loss-scale unscaling and clipping into the same pass
};

struct LionParams {
  double lr, beta1, beta2, weight_decay;
  bool maximize;
  double grad_scale;
};

struct SgdParams {
  double lr, momentum, dampening, weight_decay;
  bool nesterov, maximize, first_step;
  double grad_scale;
};

struct AdagradParams {
  double clr, weight_decay, eps;  // clr = lr / (1 + (step - 1) * lr_decay)
  bool maximize;
  double grad_scale;
};

void adam_update(float* weight, const void* grad, void* exp_avg, void* exp_avg_sq,
                 void* max_exp_avg_sq, void* weight_out, int64_t n, DType grad_dtype,
                 DType moment_dtype, DType out_dtype, const AdamParams& p);

// One adam_update per job, all in one parallel pass of the thread pool: a model of many
// small tensors pays one dispatch per step instead of one per tensor (each job's chunks
// are those adam_update would cut, so every element is updated exactly as there). Jobs
// must not overlap one another's writes.
struct AdamJob {
  float* weight;
  const void* grad;
  void* exp_avg;
  void* exp_avg_sq;
  void* max_exp_avg_sq;
  void* weight_out;
  int64_t n;
  DType grad_dtype, moment_dtype, out_dtype;
  AdamParams p;
};
void adam_update_many(const AdamJob* jobs, int64_t count);

void lion_update(float* weight, const void* grad, void* exp_avg, void* weight_out, int64_t n,
                 DType grad_dtype, DType moment_dtype, DType out_dtype, const LionParams& p);

// momentum_buffer may be null when p.momentum == 0.
void sgd_update(float* weight, const void* grad, void* momentum_buffer, void* weight_out,
                int64_t n, DType grad_dtype, DType moment_dtype, DType out_dtype,
                const SgdParams& p);

void adagrad_update(float* weight, const void* grad, void* state_sum, void* weight_out,
                    int64_t n, DType grad_dtype, DType moment_dtype, DType out_dtype,
                    const AdagradParams& p);

// Sum of (grad * scale)^2 accumulated in double; inf/nan propagate. The result does
// not depend on the thread count (partial sums per fixed chunk, added in order).
double grad_sumsq(const void* grad, int64_t n, DType grad_dtype, double scale);

// ---- compressed state: blockwise 8-bit moments, fp32 or bf16 master ----
// The maps and the state layout are specified in tierstate/kernels/quant.py (module doc);
// the tables come from there, so Python and C++ share one definition of each map.

// An 8-bit map: table[256] is the value of each code (times the block scale); the code of
// a magnitude a in [0, ~1] is the number of thresholds <= a. It takes one lookup: with
// b = clamp((bits(a) >> lut_shift) - lut_base, 0, lut_size - 1) and w = lut[b],
// code = (w & 0xFF) + ((bits(a) & (2**lut_shift - 1)) >= (w >> 8)). The buckets are cut
// so that at most one threshold lies strictly inside each; w holds the count of thresholds
// at or below the bucket's low end and the low bits of the one inside (its high bits are
// the bucket's own, and positive floats order as their bits), or 2**lut_shift where there
// is none (quant_maps.py: QuantMap.lut32). The two maps' tables take 5.6 + 12.8 KB. Until
// 2026-12-06 the same encoder took two dependent lookups: a byte of code per bucket, then
// that code's fp32 threshold (6.1 KB); with one lookup the fused q8 step over 50M values
// took 59.6 ms instead of 88.1 (Zen 4, 2 threads). Before that, int32 codes with a
// separate per-bucket threshold array (two independent lookups, 37 KB, more than Zen 4's
// 32 KB L1D) had made the fused q8 step 4.6x the fp32 step's time.
// A signed map puts the sign in bit 7.
//
// An fp8 map (fp8_mantissa_bits 3 or 4, quant.py "fp8 maps") needs no tables: its codes are
// 8-bit floats (4 exponent bits, bias 15, subnormals, no inf/NaN), encoded by integer
// arithmetic on the fp32 bits (~5 cycles per 16 values on AVX-512, against ~24 for the two
// dependent gathers of the table encoder above; a Xeon, one core, values in L1) and decoded
// by widening the fp16 that holds the code (vec_scalar.h: fp8_as_f16). A block is scaled so
// that its absmax meets the map's top value (`top`: 1 for the table maps, the largest fp8
// value otherwise): y = x * (top / absmax), value = code's value * (absmax / top).
struct QuantMapRef {
  const float* table;
  const uint32_t* lut;
  int32_t lut_size, lut_shift, lut_base;
  bool is_signed;
  int32_t fp8_mantissa_bits;  // 0: a table map; 3 (signed) or 4 (unsigned): an fp8 map
  float top;                  // value of the largest code
};

// The two fp8 maps: sign + E4M3 for the first moment, E4M4 for sqrt(v).
constexpr int kFp8SignedMantissaBits = 3;
constexpr int kFp8UnsignedMantissaBits = 4;

// How the master weight is stored: fp32; bf16 plus an int16 compensation term (the fp32
// weight is master + comp * 2**-16 ulp(master)); bf16 with stochastic rounding.
enum class MasterMode : int { kF32 = 0, kBF16Kahan = 1, kBF16SR = 2 };

// Blocks of the 8-bit formats: a power of two in [kMinQuantBlock, kMaxQuantBlock]. The
// update tasks are multiples of 4096 elements (dispatch.cpp), so they cut at block
// boundaries; a block's two fp32 scratch rows (2 x 4096 x 4 B = 32 KiB) stay on the stack.
constexpr int64_t kMinQuantBlock = 64;
constexpr int64_t kMaxQuantBlock = 4096;

struct AdamQ8Params {
  AdamParams adam;     // lr, betas, eps, weight decay, bias corrections, maximize, grad_scale
  int64_t block_size;
  MasterMode master;
  uint32_t sr_key;        // stochastic rounding: quant.py's sr_key(seed, step)
  uint32_t index_offset;  // index of element 0 within its parameter (for the SR hash)
};

// One Adam/AdamW step on compressed state (amsgrad is not offered). master: fp32 or bf16
// per p.master; master_comp: int16, only for kBF16Kahan (else null); m: signed-map codes and
// per-block absmax; v: codes of sqrt(v) in the unsigned map and per-block max sqrt(v).
void adam_q8_update(void* master, void* master_comp, const void* grad, uint8_t* m_codes,
                    float* m_scale, uint8_t* v_codes, float* v_scale, void* weight_out, int64_t n,
                    DType grad_dtype, DType out_dtype, const QuantMapRef& m_map,
                    const QuantMapRef& v_map, const AdamQ8Params& p);

// Blockwise encoding of the fp32 x (magnitudes |x| for an unsigned map) and its inverse.
void quantize_blockwise(const float* x, uint8_t* codes, float* scale, int64_t n, int64_t block_size,
                        const QuantMapRef& map);
void dequantize_blockwise(const uint8_t* codes, const float* scale, float* out, int64_t n,
                          int64_t block_size, const QuantMapRef& map);

// ---- compressed weights for generation ----
// n values of a matrix quantized group-wise (tierstate/generate/compress.py): bits 8 reads
// int8 codes, bits 4 reads codes + 8 two per byte (the even index in the low nibble); each
// group of `group` values (even, n a multiple of it) has one fp32 scale. out (out_dtype:
// fp32, bf16 or fp16) receives float(code) * scale rounded once to nearest even.
void dequantize_groups(const uint8_t* codes, const float* scale, void* out, int64_t n, int64_t group,
                       int bits, DType out_dtype);

// n bf16 values stored as sign+mantissa bytes and 4-bit exponent codes
// (tierstate/generate/lossless.py; layout in isa_table.h Exp4Task) written to out as bf16
// bits: exponent (base + code) & 0xFF, then the `escapes` values whose code is 15 get
// their exponent bytes: out[escape_index[k]] takes escape_exponent[k]. Indices must be
// < n; they are checked. With part_nbytes >= 0 it also returns the CRC-32C of the coded
// matrix, the part_nbytes bytes from sign_mantissa (its sign/mantissa bytes, codes, escapes
// and the padding between them, as lossless.py lays them out), continued from crc; each task
// takes its chunks' CRCs right after decoding them, while they are in L1, and the pieces are
// joined with crc32c_combine. Without, it returns crc unchanged.
uint32_t decode_exp4_bf16(const uint8_t* sign_mantissa, const uint8_t* codes, uint32_t base, uint16_t* out,
                          int64_t n, const uint32_t* escape_index, const uint8_t* escape_exponent, int64_t escapes,
                          int64_t part_nbytes = -1, uint32_t crc = 0);

// The encoder's two passes (tierstate/generate/lossless.py chooses base between them):
// hist[e] (256 int64, overwritten) counts the n bf16 values whose exponent byte is e; then
// encode_exp4_bf16 writes sign_mantissa (n bytes), codes (32 per started 64-value block,
// layout in isa_table.h Exp4Task, a partial last block padded with code 0) and the escapes
// in index order; it returns how many escapes it found and throws std::length_error,
// having written no escape, when there are more than escape_room.
void exponent_histogram_bf16(const uint16_t* src, int64_t n, int64_t* hist);
int64_t encode_exp4_bf16(const uint16_t* src, int64_t n, uint32_t base, uint8_t* sign_mantissa, uint8_t* codes,
                         uint32_t* escape_index, uint8_t* escape_exponent, int64_t escape_room);

// ---- ISA selection and threads ----
// Variants, widest first: "avx512_bf16" (AVX-512 with native bf16 rounding),
// "avx512", "avx2", "neon", "scalar".
std::vector<std::string> available_isas();   // the ones this CPU and build can run
std::string current_isa();
void set_isa(const std::string& name);       // "auto" or a variant; throws std::invalid_argument
void set_num_threads(int n);
int num_threads();

// How the table maps' codes are looked up (dispatch.cpp): "gather" (the ISA's gather
// instruction) or "loads" (a scalar load per lane); same codes either way. "auto" (the
// default) times both once per ISA variant at its first table-map call. q8_table_lookup()
// answers for the current variant: "gather", "loads", or "untimed" before that first call.
std::string q8_table_lookup();
void set_q8_table_lookup(const std::string& mode);  // "auto", "gather", "loads"; throws std::invalid_argument
// Whether the current variant decodes the table maps' codes a block at a time by byte
// permutes (AVX-512 variants on a CPU with AVX512-VBMI; body.h TableCodec) rather than per
// vector as q8_table_lookup() says; same values either way. On where possible;
// set_q8_row_decode(false) turns it off (the encoder's lookups are unaffected).
bool q8_row_decode();
void set_q8_row_decode(bool on);

// Per-thread busy spans of kernel calls, for traces: (thread, start ns, end ns) with
// CLOCK_MONOTONIC times; thread 0 is the caller.
void record_worker_spans(bool on);
std::vector<std::tuple<int, int64_t, int64_t>> drain_worker_spans();

// Elements per task of the update ops: dispatch.cpp aims at 8 tasks per thread (so a
// thread that the OS preempts holds back at most ~1/8 of its share) within these bounds.
// The step streams every array once and reuses nothing, so a task need not fit a cache.
// Measured at 100M params, 2 threads (AdamW, bf16 grad/weight, fp32 moments), each task
// size interleaved with torch's fused fp32 step in one process: 16 Ki-element tasks took
// 0.3-5.1% (median 1.8%) longer than 256 Ki-element ones in 10 paired runs, 64 Ki ones
// 0.5-3% longer in 3. Software prefetch 512-2048 elements ahead (+4-17%) and two vectors
// per loop iteration (within noise) did not help.
constexpr int64_t kMinTaskElements = 16384;
constexpr int64_t kMaxTaskElements = 262144;

// grad_sumsq accumulates fp32 squares over blocks of this many elements, then adds each
// block's total in double (see body.h and the error bound in test_kernels_rounding.py).
constexpr int64_t kSumsqBlockElements = 16384;

}  // namespace kernels
}  // namespace tierstate
