// Runtime ISA choice and the split of one update into chunks over the thread pool.
// Compiled for the baseline ISA: nothing here may execute a wider instruction.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <mutex>
#include <stdexcept>
#include <utility>
#include <vector>

#include "common/cpu_features.h"
#include "common/faster_of_two.h"
#include "common/thread_pool.h"
#include "io/crc32c.h"
#include "kernels/isa_table.h"
#include "kernels/kernels.h"

namespace tierstate {
namespace kernels {
namespace {

struct Variant {
  const char* name;
  const KernelTable* (*table)();
  bool (*supported)();
};

// Widest first: "auto" takes the first supported one.
const std::vector<Variant>& variants() {
  static const std::vector<Variant> all = {
#if defined(__x86_64__) || defined(_M_X64)
      {"avx512_bf16", &avx512_bf16_table, [] { return cpu_features().can_run_avx512_bf16(); }},
      {"avx512", &avx512_table, [] { return cpu_features().can_run_avx512(); }},
      {"avx2", &avx2_table, [] { return cpu_features().can_run_avx2(); }},
#endif
#if defined(__aarch64__)
      {"neon", &neon_table, [] { return cpu_features().neon; }},
#endif
      {"scalar", &scalar_table, [] { return true; }},
  };
  return all;
}

const KernelTable* best_table() {
  for (const Variant& v : variants())
    if (v.supported()) return v.table();
  return scalar_table();
}

std::atomic<const KernelTable*>& active_table() {
  static std::atomic<const KernelTable*> table{best_table()};
  return table;
}

const KernelTable& table() { return *active_table().load(std::memory_order_acquire); }

// Chunk boundaries fall on 64-byte lines of `anchor` (weight_out or the weight, or
// the gradient for grad_sumsq), so full-width accesses to the anchor never split a
// cache line even when a view starts at an unaligned element offset.
struct ChunkPlan {
  int64_t n, head, n_tasks, chunk;
  int64_t begin(int64_t task) const { return task == 0 ? 0 : std::min(n, head + task * chunk); }
  int64_t end(int64_t task) const { return std::min(n, head + (task + 1) * chunk); }
};

ChunkPlan plan_chunks(const void* anchor, int64_t n, int64_t element_size, int64_t chunk) {
  const auto address = reinterpret_cast<uintptr_t>(anchor);
  int64_t head = static_cast<int64_t>((64 - address % 64) % 64) / element_size;
  if (address % element_size != 0 || head >= n) head = 0;
  const int64_t rest = n - head;
  const int64_t n_tasks = std::max<int64_t>(1, (rest + chunk - 1) / chunk);
  return {n, head, n_tasks, chunk};
}

// grad_sumsq reads one stream and does two flops per element: a 16 Ki-element task (32 KiB
// of bf16, ~1 us) is no longer than the cost of taking and reducing it, so its tasks are
// 16x larger (the loop still reduces to double every kSumsqBlockElements, see body.h).
// Fixed, not per thread count: the sum must not depend on the thread count.
constexpr int64_t kSumsqChunkElements = 16 * kSumsqBlockElements;

// Task size for an update of n elements: ~8 tasks per thread, in [kMinTaskElements,
// kMaxTaskElements] (kernels.h), a multiple of 4096 elements so that every task after the
// aligned head starts on a cache line of the anchor plan_chunks aligns to (4096 x 2 bytes
// of bf16 = 128 lines), which the streaming stores need.
int64_t update_task_elements(int64_t n) {
  const int64_t threads = ThreadPool::instance().num_threads();
  const int64_t per_task = (n + 8 * threads - 1) / (8 * threads);
  const int64_t rounded = (per_task + 4095) / 4096 * 4096;
  return std::min(kMaxTaskElements, std::max(kMinTaskElements, rounded));
}

// The chunks of one update task. They align to weight_out's lines when there is one, so
// that its streaming stores (see body.h) are aligned in every chunk; else to the weight's.
template <class Task>
ChunkPlan update_plan(const Task& task, int64_t n) {
  const int64_t chunk = update_task_elements(n);
  return task.weight_out != nullptr ? plan_chunks(task.weight_out, n, 2, chunk)
                                    : plan_chunks(task.weight, n, sizeof(float), chunk);
}

template <class Task>
void run_chunked(const Task& task, int64_t n, void (*kernel)(const Task&, int64_t, int64_t)) {
  if (n <= 0) return;
  const ChunkPlan plan = update_plan(task, n);
  auto body = [&](int64_t i) { kernel(task, plan.begin(i), plan.end(i)); };
  ThreadPool::instance().parallel_for(plan.n_tasks, body);
}

void check_common(const void* weight, const void* grad, int64_t n, DType grad_dtype,
                  DType moment_dtype, DType out_dtype) {
  if (n < 0) throw std::invalid_argument("n must be >= 0");
  if (n > 0 && (weight == nullptr || grad == nullptr))
    throw std::invalid_argument("weight and grad must be non-null");
  if (grad_dtype != DType::kF32 && grad_dtype != DType::kBF16 && grad_dtype != DType::kF16)
    throw std::invalid_argument("grad dtype must be fp32, bf16 or fp16");
  if (moment_dtype != DType::kF32 && moment_dtype != DType::kBF16)
    throw std::invalid_argument("moment dtype must be fp32 or bf16");
  if (out_dtype != DType::kNone && out_dtype != DType::kBF16 && out_dtype != DType::kF16)
    throw std::invalid_argument("weight_out dtype must be bf16, fp16 or none");
}

float grad_multiplier(double grad_scale, bool maximize) {
  return static_cast<float>(maximize ? -grad_scale : grad_scale);
}

// The fields every op's task has: the weight, the gradient, the low-precision output and
// the dtypes, plus the gradient's multiplier (loss-scale/clip factor, negated to maximize).
template <class Task>
void set_common(Task& t, float* weight, const void* grad, void* weight_out, DType grad_dtype,
                DType moment_dtype, DType out_dtype, double grad_scale, bool maximize) {
  t.weight = weight;
  t.grad = grad;
  t.weight_out = weight_out;
  t.grad_dtype = grad_dtype;
  t.moment_dtype = moment_dtype;
  t.out_dtype = weight_out == nullptr ? DType::kNone : out_dtype;
  t.grad_mul = grad_multiplier(grad_scale, maximize);
}

AdamTask adam_task(float* weight, const void* grad, void* exp_avg, void* exp_avg_sq, void* max_exp_avg_sq,
                   void* weight_out, int64_t n, DType grad_dtype, DType moment_dtype, DType out_dtype,
                   const AdamParams& p) {
  check_common(weight, grad, n, grad_dtype, moment_dtype, out_dtype);
  if (n > 0 && (exp_avg == nullptr || exp_avg_sq == nullptr))
    throw std::invalid_argument("exp_avg and exp_avg_sq must be non-null");
  AdamTask t{};
  set_common(t, weight, grad, weight_out, grad_dtype, moment_dtype, out_dtype, p.grad_scale, p.maximize);
  t.exp_avg = exp_avg;
  t.exp_avg_sq = exp_avg_sq;
  t.max_exp_avg_sq = max_exp_avg_sq;
  t.coupled_wd = p.weight_decay != 0 && !p.decoupled;
  t.decoupled_wd = p.weight_decay != 0 && p.decoupled;
  t.wd = static_cast<float>(p.weight_decay);
  t.decay = static_cast<float>(1.0 - p.lr * p.weight_decay);
  t.m_lerp = make_lerp(1.0 - p.beta1);
  t.beta2 = static_cast<float>(p.beta2);
  t.one_minus_beta2 = static_cast<float>(1.0 - p.beta2);
  const double bc2_sqrt = std::sqrt(p.bias_correction2);
  t.neg_step_size_bc2 = static_cast<float>(-(p.lr / p.bias_correction1) * bc2_sqrt);
  t.eps_bc2 = static_cast<float>(p.eps * bc2_sqrt);
  return t;
}

}  // namespace

void adam_update(float* weight, const void* grad, void* exp_avg, void* exp_avg_sq,
                 void* max_exp_avg_sq, void* weight_out, int64_t n, DType grad_dtype,
                 DType moment_dtype, DType out_dtype, const AdamParams& p) {
  const AdamTask t = adam_task(weight, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, weight_out, n, grad_dtype,
                               moment_dtype, out_dtype, p);
  run_chunked(t, n, table().adam);
}

void adam_update_many(const AdamJob* jobs, int64_t count) {
  if (count < 0) throw std::invalid_argument("count must be >= 0");
  std::vector<AdamTask> tasks;
  std::vector<ChunkPlan> plans;
  std::vector<std::pair<int64_t, int64_t>> units;  // (job, chunk of that job)
  tasks.reserve(static_cast<size_t>(count));
  plans.reserve(static_cast<size_t>(count));
  for (int64_t j = 0; j < count; ++j) {  // every job is checked before any is run
    const AdamJob& b = jobs[j];
    tasks.push_back(adam_task(b.weight, b.grad, b.exp_avg, b.exp_avg_sq, b.max_exp_avg_sq, b.weight_out, b.n,
                              b.grad_dtype, b.moment_dtype, b.out_dtype, b.p));
    plans.push_back(b.n > 0 ? update_plan(tasks.back(), b.n) : ChunkPlan{0, 0, 0, 1});
    for (int64_t c = 0; c < plans.back().n_tasks; ++c) units.emplace_back(j, c);
  }
  const auto kernel = table().adam;
  auto body = [&](int64_t i) {
    const auto [j, c] = units[static_cast<size_t>(i)];
    kernel(tasks[static_cast<size_t>(j)], plans[static_cast<size_t>(j)].begin(c), plans[static_cast<size_t>(j)].end(c));
  };
  ThreadPool::instance().parallel_for(static_cast<int64_t>(units.size()), body);
}

void lion_update(float* weight, const void* grad, void* exp_avg, void* weight_out, int64_t n,
                 DType grad_dtype, DType moment_dtype, DType out_dtype, const LionParams& p) {
  check_common(weight, grad, n, grad_dtype, moment_dtype, out_dtype);
  if (n > 0 && exp_avg == nullptr) throw std::invalid_argument("exp_avg must be non-null");
  LionTask t{};
  set_common(t, weight, grad, weight_out, grad_dtype, moment_dtype, out_dtype, p.grad_scale, p.maximize);
  t.exp_avg = exp_avg;
  t.has_wd = p.weight_decay != 0;
  t.decay = static_cast<float>(1.0 - p.lr * p.weight_decay);
  t.update_lerp = make_lerp(1.0 - p.beta1);
  t.m_lerp = make_lerp(1.0 - p.beta2);
  t.neg_lr = static_cast<float>(-p.lr);
  run_chunked(t, n, table().lion);
}

void sgd_update(float* weight, const void* grad, void* momentum_buffer, void* weight_out,
                int64_t n, DType grad_dtype, DType moment_dtype, DType out_dtype,
                const SgdParams& p) {
  check_common(weight, grad, n, grad_dtype, moment_dtype, out_dtype);
  if (n > 0 && p.momentum != 0 && momentum_buffer == nullptr)
    throw std::invalid_argument("momentum != 0 needs a momentum_buffer");
  SgdTask t{};
  set_common(t, weight, grad, weight_out, grad_dtype, moment_dtype, out_dtype, p.grad_scale, p.maximize);
  t.momentum_buffer = p.momentum != 0 ? momentum_buffer : nullptr;
  t.has_wd = p.weight_decay != 0;
  t.wd = static_cast<float>(p.weight_decay);
  t.momentum = static_cast<float>(p.momentum);
  t.one_minus_dampening = static_cast<float>(1.0 - p.dampening);
  t.nesterov = p.nesterov;
  t.first_step = p.first_step;
  t.neg_lr = static_cast<float>(-p.lr);
  run_chunked(t, n, table().sgd);
}

void adagrad_update(float* weight, const void* grad, void* state_sum, void* weight_out,
                    int64_t n, DType grad_dtype, DType moment_dtype, DType out_dtype,
                    const AdagradParams& p) {
  check_common(weight, grad, n, grad_dtype, moment_dtype, out_dtype);
  if (n > 0 && state_sum == nullptr) throw std::invalid_argument("state_sum must be non-null");
  AdagradTask t{};
  set_common(t, weight, grad, weight_out, grad_dtype, moment_dtype, out_dtype, p.grad_scale, p.maximize);
  t.state_sum = state_sum;
  t.has_wd = p.weight_decay != 0;
  t.wd = static_cast<float>(p.weight_decay);
  t.eps = static_cast<float>(p.eps);
  t.neg_clr = static_cast<float>(-p.clr);
  run_chunked(t, n, table().adagrad);
}

double grad_sumsq(const void* grad, int64_t n, DType grad_dtype, double scale) {
  if (n < 0) throw std::invalid_argument("n must be >= 0");
  if (n == 0) return 0.0;
  if (grad == nullptr) throw std::invalid_argument("grad must be non-null");
  if (grad_dtype != DType::kF32 && grad_dtype != DType::kBF16 && grad_dtype != DType::kF16)
    throw std::invalid_argument("grad dtype must be fp32, bf16 or fp16");
  const KernelTable& k = table();
  const ChunkPlan plan = plan_chunks(grad, n, grad_dtype == DType::kF32 ? 4 : 2, kSumsqChunkElements);
  std::vector<double> partial(static_cast<size_t>(plan.n_tasks), 0.0);
  auto body = [&](int64_t i) { partial[i] = k.sumsq(grad, grad_dtype, plan.begin(i), plan.end(i)); };
  ThreadPool::instance().parallel_for(plan.n_tasks, body);
  double total = 0.0;
  for (double s : partial) total += s;  // fixed order: the sum does not depend on the thread count
  return total * (scale * scale);
}

namespace {

void check_quant(int64_t n, int64_t block_size, const QuantMapRef& map, const char* what) {
  if (n < 0) throw std::invalid_argument("n must be >= 0");
  if (block_size < kMinQuantBlock || block_size > kMaxQuantBlock || (block_size & (block_size - 1)) != 0)
    throw std::invalid_argument("block_size must be a power of two in [64, 4096]");
  if (map.fp8_mantissa_bits == 0) {
    if (map.table == nullptr || map.lut == nullptr || map.lut_size < 1 || map.lut_shift < 0 ||
        map.lut_shift > 23 || map.top != 1.0f)
      throw std::invalid_argument(std::string("invalid quantization map for ") + what);
    return;
  }
  // The fp8 maps: sign + E4M3 (top 1.875) or unsigned E4M4 (top 1.9375).
  const bool fp8_signed = map.fp8_mantissa_bits == kFp8SignedMantissaBits && map.is_signed && map.top == 1.875f;
  const bool fp8_unsigned = map.fp8_mantissa_bits == kFp8UnsignedMantissaBits && !map.is_signed &&
                            map.top == 1.9375f;
  if (!fp8_signed && !fp8_unsigned)
    throw std::invalid_argument(std::string("invalid fp8 quantization map for ") + what);
}

// Tasks of whole blocks: the update's usual task size is a multiple of 4096 elements, so
// of every allowed block size. No aligned head: a head would cut a block.
template <class Task>
void run_blocks(const Task& task, int64_t n, void (*kernel)(const Task&, int64_t, int64_t)) {
  if (n <= 0) return;
  const int64_t chunk = update_task_elements(n);
  const int64_t n_tasks = (n + chunk - 1) / chunk;
  auto body = [&](int64_t i) { kernel(task, i * chunk, std::min(n, (i + 1) * chunk)); };
  ThreadPool::instance().parallel_for(n_tasks, body);
}

// ---- table maps: gather or a load per lane ----
// A table map's lookups (body.h, TableCodec) are a gather per vector or a scalar load per
// lane; the codes are the same. Which is faster is a property of the core, not of the ISA:
// on a 2-core Zen 1 EPYC the fused q8 step over 50M values took 220 ms by gathers and 152 ms
// by loads. So, once per kernel table, at its first table-map call, both are timed on that
// map (quantize + dequantize of 16 Ki values, five interleaved rounds, the best of each:
// ~1 ms) unless set_q8_table_lookup() fixed the choice.
enum class Lookup : int { kAuto = 0, kGather = 1, kLoads = 2 };
std::atomic<int> g_lookup_mode{static_cast<int>(Lookup::kAuto)};

// Whether a variant that can (KernelTable::has_row_decode) decodes a block's codes at once
// by byte permutes (body.h TableCodec::decode_row) on a CPU with AVX512-VBMI. On unless
// set_q8_row_decode(false) (tests: the per-vector decode must give the same bits).
std::atomic<bool> g_row_decode{true};

bool table_rows(const KernelTable& k, const QuantMapRef& map) {
  return map.fp8_mantissa_bits == 0 && k.has_row_decode && g_row_decode.load(std::memory_order_relaxed) &&
         cpu_features().can_run_avx512_vbmi();
}

bool time_gather_faster(const KernelTable& k, const QuantMapRef& map) {
  constexpr int64_t n = 16384, block = 256;
  std::vector<float> x(n), back(n), scale(n / block);
  std::vector<uint8_t> codes(n);
  uint32_t state = 12345;
  for (float& v : x) {  // values over the map's whole range, signs mixed
    state = state * 1664525u + 1013904223u;
    v = std::ldexp(static_cast<float>(state >> 8) / 16777216.0f, -static_cast<int>(state & 15)) *
        ((state & 16) ? -1.0f : 1.0f);
  }
  const bool rows = table_rows(k, map);  // then only the encoder's lookups differ
  return second_is_faster([&](int gather) {
    k.quantize(QuantTask{x.data(), nullptr, codes.data(), scale.data(), block, map, gather == 1, rows}, 0, n);
    k.dequantize(QuantTask{nullptr, back.data(), codes.data(), scale.data(), block, map, gather == 1, rows}, 0, n);
  }, 5);
}

std::mutex g_lookup_mutex;
std::vector<std::pair<const KernelTable*, bool>> g_timed;  // guarded by g_lookup_mutex

// 1 (gather) or 0 (loads) where the choice is made for table k: fixed by
// set_q8_table_lookup, or timed already; -1 while "auto" has not timed it.
int decided_lookup(const KernelTable& k) {
  if (!k.has_gather) return 0;
  const auto mode = static_cast<Lookup>(g_lookup_mode.load(std::memory_order_relaxed));
  if (mode != Lookup::kAuto) return mode == Lookup::kGather ? 1 : 0;
  std::lock_guard<std::mutex> lock(g_lookup_mutex);
  for (const auto& [table, gather] : g_timed)
    if (table == &k) return gather ? 1 : 0;
  return -1;
}

bool table_gather(const KernelTable& k, const QuantMapRef& map) {
  if (map.fp8_mantissa_bits != 0) return false;
  const int decided = decided_lookup(k);
  if (decided >= 0) return decided == 1;
  // Timed under the lock (~1 ms, once), so that a racing first call waits for the answer.
  std::lock_guard<std::mutex> lock(g_lookup_mutex);
  for (const auto& [table, gather] : g_timed)
    if (table == &k) return gather;
  const bool gather = time_gather_faster(k, map);
  g_timed.emplace_back(&k, gather);
  return gather;
}

}  // namespace

void adam_q8_update(void* master, void* master_comp, const void* grad, uint8_t* m_codes,
                    float* m_scale, uint8_t* v_codes, float* v_scale, void* weight_out, int64_t n,
                    DType grad_dtype, DType out_dtype, const QuantMapRef& m_map,
                    const QuantMapRef& v_map, const AdamQ8Params& p) {
  check_common(master, grad, n, grad_dtype, DType::kF32, out_dtype);
  check_quant(n, p.block_size, m_map, "exp_avg");
  check_quant(n, p.block_size, v_map, "exp_avg_sq");
  if (!m_map.is_signed || v_map.is_signed || (m_map.fp8_mantissa_bits == 0) != (v_map.fp8_mantissa_bits == 0))
    throw std::invalid_argument("exp_avg needs the signed map and exp_avg_sq the unsigned map of one family "
                                "(both table maps or both fp8 maps)");
  if (n > 0 && (m_codes == nullptr || m_scale == nullptr || v_codes == nullptr || v_scale == nullptr))
    throw std::invalid_argument("the codes and scales of exp_avg and exp_avg_sq must be non-null");
  if (p.master != MasterMode::kF32 && p.master != MasterMode::kBF16Kahan && p.master != MasterMode::kBF16SR)
    throw std::invalid_argument("master mode must be fp32, bf16_kahan or bf16_sr");
  if (n > 0 && p.master == MasterMode::kBF16Kahan && master_comp == nullptr)
    throw std::invalid_argument("bf16_kahan needs the master.comp buffer");
  if (n > 0 && static_cast<uint64_t>(p.index_offset) + static_cast<uint64_t>(n) > (uint64_t{1} << 32))
    throw std::invalid_argument("index_offset + n must not exceed 2**32");
  const AdamParams& a = p.adam;
  AdamQ8Task t{};
  t.master = master;
  t.comp = p.master == MasterMode::kBF16Kahan ? master_comp : nullptr;
  t.grad = grad;
  t.m_codes = m_codes;
  t.m_scale = m_scale;
  t.v_codes = v_codes;
  t.v_scale = v_scale;
  t.weight_out = weight_out;
  t.grad_dtype = grad_dtype;
  t.out_dtype = weight_out == nullptr ? DType::kNone : out_dtype;
  t.master_mode = p.master;
  t.m_map = m_map;
  t.v_map = v_map;
  t.block = p.block_size;
  t.grad_mul = grad_multiplier(a.grad_scale, a.maximize);
  t.coupled_wd = a.weight_decay != 0 && !a.decoupled;
  t.decoupled_wd = a.weight_decay != 0 && a.decoupled;
  t.wd = static_cast<float>(a.weight_decay);
  t.decay = static_cast<float>(1.0 - a.lr * a.weight_decay);
  t.m_lerp = make_lerp(1.0 - a.beta1);
  t.beta2 = static_cast<float>(a.beta2);
  t.one_minus_beta2 = static_cast<float>(1.0 - a.beta2);
  const double bc2_sqrt = std::sqrt(a.bias_correction2);
  t.neg_step_size_bc2 = static_cast<float>(-(a.lr / a.bias_correction1) * bc2_sqrt);
  t.eps_bc2 = static_cast<float>(a.eps * bc2_sqrt);
  t.sr_key = p.sr_key;
  t.index_offset = p.index_offset;
  const KernelTable& k = table();
  t.table_gather = table_gather(k, m_map);
  t.table_rows = table_rows(k, m_map);
  run_blocks(t, n, k.adam_q8);
}

void quantize_blockwise(const float* x, uint8_t* codes, float* scale, int64_t n, int64_t block_size,
                        const QuantMapRef& map) {
  check_quant(n, block_size, map, "quantize_blockwise");
  if (n > 0 && (x == nullptr || codes == nullptr || scale == nullptr))
    throw std::invalid_argument("x, codes and scale must be non-null");
  const KernelTable& k = table();
  const QuantTask t{x, nullptr, codes, scale, block_size, map, table_gather(k, map), table_rows(k, map)};
  run_blocks(t, n, k.quantize);
}

void dequantize_blockwise(const uint8_t* codes, const float* scale, float* out, int64_t n,
                          int64_t block_size, const QuantMapRef& map) {
  check_quant(n, block_size, map, "dequantize_blockwise");
  if (n > 0 && (out == nullptr || codes == nullptr || scale == nullptr))
    throw std::invalid_argument("codes, scale and out must be non-null");
  const KernelTable& k = table();
  const QuantTask t{nullptr, out, const_cast<uint8_t*>(codes), const_cast<float*>(scale), block_size, map,
                    table_gather(k, map), table_rows(k, map)};
  run_blocks(t, n, k.dequantize);
}

// Tasks of whole groups, ~64 Ki values each: a 37.7M-value layer makes ~575 tasks, so
// the two threads share it evenly and a task's 64-192 KiB of codes and output is ~10 us.
void dequantize_groups(const uint8_t* codes, const float* scale, void* out, int64_t n, int64_t group,
                       int bits, DType out_dtype) {
  if (n < 0) throw std::invalid_argument("n must be >= 0");
  if (group < 2 || group % 2 != 0) throw std::invalid_argument("group must be an even number >= 2");
  if (n % group != 0) throw std::invalid_argument("n must be a whole number of groups");
  if (bits != 8 && bits != 4) throw std::invalid_argument("bits must be 8 or 4");
  if (out_dtype != DType::kF32 && out_dtype != DType::kBF16 && out_dtype != DType::kF16)
    throw std::invalid_argument("out_dtype must be float32, bfloat16 or float16");
  if (n == 0) return;
  if (codes == nullptr || scale == nullptr || out == nullptr)
    throw std::invalid_argument("codes, scale and out must be non-null");
  const GroupDequantTask t{codes, scale, out, out_dtype, group, bits == 4};
  const int64_t chunk = std::max<int64_t>(1, (int64_t{1} << 16) / group) * group;
  const int64_t n_tasks = (n + chunk - 1) / chunk;
  const auto kernel = table().dequantize_groups;
  auto body = [&](int64_t i) { kernel(t, i * chunk, std::min(n, (i + 1) * chunk)); };
  ThreadPool::instance().parallel_for(n_tasks, body);
}

// The 4-bit exponent codes' ops run on tasks of 64 Ki values (1,024 blocks; decoding one is
// 96 KiB in, 128 KiB out), so a 51.4M-value layer makes ~785 tasks that the threads share
// evenly.
namespace {
constexpr int64_t kExp4Task = int64_t{1} << 16;

int64_t exp4_tasks(int64_t n) { return (n + kExp4Task - 1) / kExp4Task; }

// fn(task, begin, end) for each of the exp4_tasks(n) tasks of [0, n), on the thread pool.
template <class Fn>
void for_exp4_tasks(int64_t n, Fn&& fn) {
  auto body = [&](int64_t t) { fn(t, t * kExp4Task, std::min(n, (t + 1) * kExp4Task)); };
  ThreadPool::instance().parallel_for(exp4_tasks(n), body);
}

inline uint32_t exponent_of(uint16_t v) { return (v >> 7) & 0xFFu; }

// v's code for the window [base, base + 15): exponent - base, or 15 (an escape) outside it
inline uint32_t exp4_code(uint16_t v, uint32_t base) {
  const uint32_t d = (exponent_of(v) - base) & 0xFFu;  // exponent - base, mod 256
  return d < 15u ? d : 15u;
}
}  // namespace

// Code bytes of the values before index ``end`` (a multiple of 64, or n): 32 per started block.
inline int64_t exp4_code_bytes(int64_t end) { return (end + 63) / 64 * 32; }

// Values a task decodes before it takes the CRC of their bytes: 4 KiB of sign/mantissa bytes
// and 2 KiB of codes, still in L1 (32 KiB on the cores we know) when the CRC reads them.
constexpr int64_t kExp4CrcChunk = 4096;

// The escapes (~1.5e-4 of the values of a normally distributed matrix) are patched by the
// caller's thread after the decode.
uint32_t decode_exp4_bf16(const uint8_t* sign_mantissa, const uint8_t* codes, uint32_t base, uint16_t* out,
                          int64_t n, const uint32_t* escape_index, const uint8_t* escape_exponent, int64_t escapes,
                          int64_t part_nbytes, uint32_t crc) {
  if (n < 0) throw std::invalid_argument("n must be >= 0");
  if (escapes < 0) throw std::invalid_argument("escapes must be >= 0");
  if (base > 255) throw std::invalid_argument("base must be an exponent byte (0-255)");
  const bool checked = part_nbytes >= 0;
  if (n == 0) return checked ? io::crc32c(crc, sign_mantissa, static_cast<size_t>(part_nbytes)) : crc;
  if (sign_mantissa == nullptr || codes == nullptr || out == nullptr)
    throw std::invalid_argument("sign_mantissa, codes and out must be non-null");
  if (escapes > 0 && (escape_index == nullptr || escape_exponent == nullptr))
    throw std::invalid_argument("escape_index and escape_exponent must be non-null when escapes > 0");
  const int64_t code_bytes = exp4_code_bytes(n);
  if (checked && (codes < sign_mantissa + n || sign_mantissa + part_nbytes < codes + code_bytes))
    throw std::invalid_argument("part_nbytes: the codes must follow the sign/mantissa bytes inside the part");
  for (int64_t k = 0; k < escapes; ++k)  // before any write: a bad index leaves out untouched
    if (static_cast<int64_t>(escape_index[k]) >= n) throw std::invalid_argument("an escape index is >= n");
  const Exp4Task t{sign_mantissa, codes, out, n, base};
  const auto kernel = table().decode_exp4;
  if (!checked) {
    for_exp4_tasks(n, [&](int64_t, int64_t begin, int64_t end) { kernel(t, begin, end); });
  } else {
    // each task's CRCs of its sign/mantissa bytes and of its codes, with their lengths,
    // joined in task order below
    struct Piece {
      uint32_t sm_crc = 0, code_crc = 0;
      size_t sm_len = 0, code_len = 0;
    };
    std::vector<Piece> pieces(static_cast<size_t>(exp4_tasks(n)));
    for_exp4_tasks(n, [&](int64_t task, int64_t begin, int64_t end) {
      Piece& p = pieces[static_cast<size_t>(task)];
      for (int64_t b = begin; b < end; b += kExp4CrcChunk) {
        const int64_t e = std::min(end, b + kExp4CrcChunk);
        kernel(t, b, e);
        p.sm_crc = io::crc32c_serial(p.sm_crc, sign_mantissa + b, static_cast<size_t>(e - b));
        p.code_crc = io::crc32c_serial(p.code_crc, codes + b / 2, static_cast<size_t>(exp4_code_bytes(e) - b / 2));
      }
      p.sm_len = static_cast<size_t>(end - begin);
      p.code_len = static_cast<size_t>(exp4_code_bytes(end) - begin / 2);
    });
    uint32_t sm_all = 0, code_all = 0;
    for (const Piece& p : pieces) {
      sm_all = io::crc32c_combine(sm_all, p.sm_crc, p.sm_len);
      code_all = io::crc32c_combine(code_all, p.code_crc, p.code_len);
    }
    crc = io::crc32c_combine(crc, sm_all, static_cast<size_t>(n));
    crc = io::crc32c_serial(crc, sign_mantissa + n, static_cast<size_t>(codes - (sign_mantissa + n)));
    crc = io::crc32c_combine(crc, code_all, static_cast<size_t>(code_bytes));
    crc = io::crc32c_serial(crc, codes + code_bytes, static_cast<size_t>(sign_mantissa + part_nbytes - (codes + code_bytes)));
  }
  for (int64_t k = 0; k < escapes; ++k) {
    uint16_t& v = out[escape_index[k]];
    v = static_cast<uint16_t>((v & 0x807Fu) | (static_cast<uint32_t>(escape_exponent[k]) << 7));
  }
  return crc;
}

// The encoder runs once per matrix, at load: plain loops, no ISA variants. It writes what
// lossless.py's torch path writes, byte for byte (tests/generate/test_generate_lossless.py).
void exponent_histogram_bf16(const uint16_t* src, int64_t n, int64_t* hist) {
  if (n < 0) throw std::invalid_argument("n must be >= 0");
  if (hist == nullptr || (n > 0 && src == nullptr)) throw std::invalid_argument("src and hist must be non-null");
  const int64_t n_tasks = exp4_tasks(n);
  std::vector<int64_t> partial(static_cast<size_t>(n_tasks) * 256, 0);
  for_exp4_tasks(n, [&](int64_t t, int64_t begin, int64_t end) {
    int64_t* h = partial.data() + t * 256;
    for (int64_t i = begin; i < end; ++i) ++h[exponent_of(src[i])];
  });
  for (int e = 0; e < 256; ++e) hist[e] = 0;
  for (int64_t t = 0; t < n_tasks; ++t)
    for (int e = 0; e < 256; ++e) hist[e] += partial[static_cast<size_t>(t * 256 + e)];
}

int64_t encode_exp4_bf16(const uint16_t* src, int64_t n, uint32_t base, uint8_t* sign_mantissa, uint8_t* codes,
                         uint32_t* escape_index, uint8_t* escape_exponent, int64_t escape_room) {
  if (n < 0 || escape_room < 0) throw std::invalid_argument("n and escape_room must be >= 0");
  if (n >= (int64_t{1} << 32)) throw std::invalid_argument("n must be < 2**32 (escape indices are uint32)");
  // base + 14 <= 255: the window never wraps, so "outside it" means what lossless.py's torch path says
  if (base > 241) throw std::invalid_argument("base must be 0-241 (the first of 15 exponents)");
  if (n == 0) return 0;
  if (src == nullptr || sign_mantissa == nullptr || codes == nullptr)
    throw std::invalid_argument("src, sign_mantissa and codes must be non-null");
  const int64_t n_tasks = exp4_tasks(n);
  std::vector<int64_t> found(static_cast<size_t>(n_tasks), 0);
  for_exp4_tasks(n, [&](int64_t t, int64_t begin, int64_t end) {
    int64_t escapes = 0;
    for (int64_t b = begin; b < end; b += 64) {
      uint8_t* c = codes + b / 2;
      for (int j = 0; j < 32; ++j) c[j] = 0;
      for (int64_t i = b; i < std::min(end, b + 64); ++i) {
        const uint16_t v = src[i];
        sign_mantissa[i] = static_cast<uint8_t>(((v >> 8) & 0x80u) | (v & 0x7Fu));
        const uint32_t code = exp4_code(v, base);
        escapes += code == 15u;
        const int64_t j = i - b;
        c[j & 31] |= static_cast<uint8_t>(j < 32 ? code : code << 4);
      }
    }
    found[static_cast<size_t>(t)] = escapes;
  });
  int64_t total = 0;
  for (int64_t f : found) total += f;
  if (total > escape_room) throw std::length_error("more escapes than escape_room");
  if (total > 0 && (escape_index == nullptr || escape_exponent == nullptr))
    throw std::invalid_argument("escape_index and escape_exponent must be non-null when there are escapes");
  std::vector<int64_t> first(static_cast<size_t>(n_tasks), 0);  // each task's first escape slot
  for (int64_t t = 1; t < n_tasks; ++t) first[t] = first[t - 1] + found[t - 1];
  for_exp4_tasks(n, [&](int64_t t, int64_t begin, int64_t end) {
    if (found[static_cast<size_t>(t)] == 0) return;
    int64_t k = first[static_cast<size_t>(t)];
    for (int64_t i = begin; i < end; ++i) {
      if (exp4_code(src[i], base) == 15u) {
        escape_index[k] = static_cast<uint32_t>(i);
        escape_exponent[k] = static_cast<uint8_t>(exponent_of(src[i]));
        ++k;
      }
    }
  });
  return total;
}

std::vector<std::string> available_isas() {
  std::vector<std::string> names;
  for (const Variant& v : variants())
    if (v.supported()) names.emplace_back(v.name);
  return names;
}

std::string current_isa() { return table().name; }

void set_isa(const std::string& name) {
  if (name == "auto") {
    active_table().store(best_table(), std::memory_order_release);
    return;
  }
  std::string known;
  for (const Variant& v : variants()) {
    if (name == v.name) {
      if (!v.supported())
        throw std::invalid_argument("ISA variant '" + name + "' is not supported by this CPU/OS");
      active_table().store(v.table(), std::memory_order_release);
      return;
    }
    known += (known.empty() ? "" : ", ") + std::string(v.name);
  }
  throw std::invalid_argument("unknown ISA variant '" + name + "'; this build has: auto, " + known);
}

std::string q8_table_lookup() {
  const int decided = decided_lookup(table());
  return decided < 0 ? "untimed" : decided == 1 ? "gather" : "loads";
}

void set_q8_table_lookup(const std::string& mode) {
  Lookup m;
  if (mode == "auto") m = Lookup::kAuto;
  else if (mode == "gather") m = Lookup::kGather;
  else if (mode == "loads") m = Lookup::kLoads;
  else throw std::invalid_argument("unknown table lookup '" + mode + "'; use 'auto', 'gather' or 'loads'");
  g_lookup_mode.store(static_cast<int>(m), std::memory_order_relaxed);
}

bool q8_row_decode() {
  const QuantMapRef any_table_map{};  // fp8_mantissa_bits 0
  return table_rows(table(), any_table_map);
}

void set_q8_row_decode(bool on) { g_row_decode.store(on, std::memory_order_relaxed); }

void set_num_threads(int n) {
  if (n < 1) throw std::invalid_argument("num_threads must be >= 1");
  ThreadPool::instance().set_num_threads(n);
}

int num_threads() { return ThreadPool::instance().num_threads(); }

void record_worker_spans(bool on) { ThreadPool::instance().set_span_recording(on); }

std::vector<std::tuple<int, int64_t, int64_t>> drain_worker_spans() {
  std::vector<std::tuple<int, int64_t, int64_t>> out;
  for (const auto& s : ThreadPool::instance().drain_spans()) out.emplace_back(s.worker, s.start_ns, s.end_ns);
  return out;
}

}  // namespace kernels
}  // namespace tierstate
