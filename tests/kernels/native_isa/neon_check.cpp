// Standalone check of the NEON kernels, without Python or nanobind.
//
// Built by tests/kernels/test_kernels_neon_qemu.py with an AArch64 cross compiler and
// run under qemu-aarch64 (it runs natively on an AArch64 machine too). It links the
// real dispatch, thread pool and kernel sources and calls the public C++ face
// (kernels.h) with set_isa("neon") and set_isa("scalar"), then checks:
//
//  1. NEON equals scalar BIT FOR BIT on every output (master, moments, weight_out) for
//     every op case x grad dtype x moment dtype x weight_out dtype x size x offset, and
//     at 1 and 2 threads on sizes that span several chunks. On AArch64 both variants
//     round each operation once, in the same order: the body is the same template,
//     the scalar fmadd is fmaf (FMA is base AArch64), and sqrt/div are correctly
//     rounded in both. Any difference is a bug, not an ulp of noise.
//  2. weight_out is the fp32 master rounded to nearest even, compared with this file's
//     own rounding (bf16: exact distance comparison in double; fp16: the hardware's
//     FCVT through __fp16), on the op results and on special values (ties, subnormals,
//     overflow to infinity, NaN) at every vector phase.
//  3. AdamW with fp32 moments agrees with a double-precision evaluation of torch's
//     formula within 16 fp32 ulps of the largest term (see test_kernels_parity.py).
//  4. grad_sumsq is within 1e-5 relative of a double sum, equal for 1 and 2 threads,
//     and propagates inf and NaN.
//  5. No kernel writes outside its buffers (guard bytes on both sides).
//
// Usage: neon_check [--full]. Exit status 0 when every check passes; otherwise 1 and the
// first failures on stderr.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/kernels.h"

#if !defined(__aarch64__)
#error "neon_check.cpp tests the AArch64 NEON kernels: build it with an AArch64 compiler"
#endif

namespace {

namespace k = tierstate::kernels;
using k::DType;

// Prints how long a section took under the emulator (the pytest wrapper sizes its
// timeout from these lines).
struct SectionTimer {
  const char* name;
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  ~SectionTimer() {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("neon_check: %s took %.1f s\n", name, s);
  }
};

int g_failures = 0;
long g_checks = 0;

void fail(const std::string& what) {
  if (g_failures < 40) std::fprintf(stderr, "FAIL: %s\n", what.c_str());
  ++g_failures;
}

void check(bool ok, const std::string& what) {
  ++g_checks;
  if (!ok) fail(what);
}

// ---- deterministic inputs ----------------------------------------------------
struct Rng {
  uint64_t state;
  uint64_t next() {  // splitmix64
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform() { return static_cast<double>(next() >> 11) * 0x1p-53; }
};

// ---- reference rounding (independent of the kernels' own code) ---------------
uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}

float float_of(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

// Round to nearest even by comparing exact distances (double holds every fp32 and
// every difference of two neighbouring bf16 exactly). NaN -> 0x7FC0, as torch writes it.
uint16_t bf16_reference(float x) {
  if (std::isnan(x)) return 0x7FC0;
  const uint32_t u = bits_of(x);
  const uint32_t toward_zero = u & 0xFFFF0000u;
  if (toward_zero == u) return static_cast<uint16_t>(u >> 16);
  const uint32_t away = toward_zero + 0x10000u;  // next bf16 in magnitude (may be inf)
  const double magnitude = std::fabs(static_cast<double>(x));
  const double low = std::fabs(static_cast<double>(float_of(toward_zero)));
  // Past the largest finite bf16 the next step is 2^128, as if the exponent had no bound.
  const double high = ((away >> 16) & 0x7F80u) == 0x7F80u ? 0x1p128 : std::fabs(static_cast<double>(float_of(away)));
  const double below = magnitude - low, above = high - magnitude;
  if (below < above) return static_cast<uint16_t>(toward_zero >> 16);
  if (above < below) return static_cast<uint16_t>(away >> 16);
  return static_cast<uint16_t>(((toward_zero >> 16) & 1u) ? away >> 16 : toward_zero >> 16);
}

uint16_t f16_reference(float x) {  // FCVT: round to nearest even (the FPCR default)
  const __fp16 h = static_cast<__fp16>(x);
  uint16_t u;
  std::memcpy(&u, &h, 2);
  return u;
}

float bf16_value(uint16_t h) { return float_of(static_cast<uint32_t>(h) << 16); }

float f16_value(uint16_t h) {
  __fp16 x;
  std::memcpy(&x, &h, 2);
  return static_cast<float>(x);
}

bool is_nan_bits(DType d, uint32_t b) {
  if (d == DType::kF32) return (b & 0x7FFFFFFFu) > 0x7F800000u;
  if (d == DType::kBF16) return (b & 0x7FFFu) > 0x7F80u;
  return (b & 0x7FFFu) > 0x7C00u;
}

const char* dtype_name(DType d) {
  switch (d) {
    case DType::kF32: return "f32";
    case DType::kBF16: return "bf16";
    case DType::kF16: return "f16";
    default: return "none";
  }
}

size_t dtype_size(DType d) { return d == DType::kF32 ? 4 : 2; }

// ---- buffers with guard bytes -------------------------------------------------
// n elements starting `offset` elements into an allocation, with 64 guard bytes on
// each side; a kernel that writes outside [0, n) changes a guard byte.
constexpr uint8_t kGuardByte = 0xA5;
constexpr size_t kGuardBytes = 64;

struct Guarded {
  DType dtype;
  int64_t n;
  size_t start;  // byte offset of element 0
  std::vector<uint8_t> bytes;

  Guarded(DType d, int64_t count, int64_t offset)
      : dtype(d), n(count), start(kGuardBytes + offset * dtype_size(d)),
        bytes(start + count * dtype_size(d) + kGuardBytes, kGuardByte) {}

  void* data() { return bytes.data() + start; }
  uint32_t bits(int64_t i) const {
    uint32_t b = 0;
    std::memcpy(&b, bytes.data() + start + i * dtype_size(dtype), dtype_size(dtype));
    return b;
  }
  float value(int64_t i) const {
    const uint32_t b = bits(i);
    if (dtype == DType::kF32) return float_of(b);
    return dtype == DType::kBF16 ? bf16_value(static_cast<uint16_t>(b)) : f16_value(static_cast<uint16_t>(b));
  }
  void set(int64_t i, float x) {  // stores x rounded to the buffer's dtype
    uint32_t b = dtype == DType::kF32 ? bits_of(x) : dtype == DType::kBF16 ? bf16_reference(x) : f16_reference(x);
    std::memcpy(bytes.data() + start + i * dtype_size(dtype), &b, dtype_size(dtype));
  }
  bool guards_intact() const {
    const size_t end = start + n * dtype_size(dtype);
    for (size_t i = 0; i < bytes.size(); ++i)
      if ((i < start || i >= end) && bytes[i] != kGuardByte) return false;
    return true;
  }
};

// ---- op cases (the same as tests/kernels/kernel_cases.py) ----------------------
enum class Op { kAdam, kLion, kSgd, kAdagrad };

enum class Init { kSigned01, kPositive001, kPositive1 };

struct Case {
  const char* name;
  Op op;
  std::vector<Init> states;  // in the face's argument order
  k::AdamParams adam{};
  k::LionParams lion{};
  k::SgdParams sgd{};
  k::AdagradParams adagrad{};
};

std::vector<Case> make_cases() {
  const double bc1 = 1 - std::pow(0.9, 3), bc2 = 1 - std::pow(0.999, 3);
  std::vector<Case> cases;
  auto adam = [&](const char* name, std::vector<Init> states, k::AdamParams p) {
    Case c{name, Op::kAdam, std::move(states)};
    c.adam = p;
    cases.push_back(c);
  };
  //    lr    beta1 beta2  eps   wd    decoupled bc1 bc2 maximize grad_scale
  adam("adam-adamw", {Init::kSigned01, Init::kPositive001},
       {1e-3, 0.9, 0.999, 1e-8, 0.01, true, bc1, bc2, false, 1.0});
  adam("adam-l2", {Init::kSigned01, Init::kPositive001},
       {1e-3, 0.9, 0.999, 1e-8, 0.05, false, bc1, bc2, false, 1.0});
  adam("adam-amsgrad", {Init::kSigned01, Init::kPositive001, Init::kPositive001},
       {1e-3, 0.9, 0.999, 1e-8, 0.01, true, bc1, bc2, false, 1.0});
  // beta1 = 0.3: the lerp weight 0.7 >= 0.5 takes torch's other lerp formula.
  adam("adam-maximize-scaled-lowbeta", {Init::kSigned01, Init::kPositive001},
       {1e-3, 0.3, 0.999, 1e-8, 0.0, true, bc1, bc2, true, 0.25});
  auto lion = [&](const char* name, k::LionParams p) {
    Case c{name, Op::kLion, {Init::kSigned01}};
    c.lion = p;
    cases.push_back(c);
  };
  //    lr    beta1 beta2 wd   maximize grad_scale
  lion("lion-default", {1e-4, 0.9, 0.99, 0.1, false, 1.0});
  lion("lion-maximize-lowbeta", {1e-4, 0.2, 0.4, 0.0, true, 3.0});
  auto sgd = [&](const char* name, bool momentum_buffer, k::SgdParams p) {
    Case c{name, Op::kSgd, momentum_buffer ? std::vector<Init>{Init::kSigned01} : std::vector<Init>{}};
    c.sgd = p;
    cases.push_back(c);
  };
  //   lr   momentum dampening wd  nesterov maximize first_step grad_scale
  sgd("sgd-plain", false, {0.1, 0.0, 0.0, 0.01, false, false, false, 1.0});
  sgd("sgd-momentum", true, {0.1, 0.9, 0.1, 0.0, false, false, false, 1.0});
  sgd("sgd-nesterov-first", true, {0.1, 0.9, 0.0, 0.01, true, false, true, 1.0});
  sgd("sgd-nesterov-maximize", true, {0.1, 0.8, 0.0, 0.0, true, true, false, 0.5});
  auto adagrad = [&](const char* name, k::AdagradParams p) {
    Case c{name, Op::kAdagrad, {Init::kPositive1}};
    c.adagrad = p;
    cases.push_back(c);
  };
  //       clr         wd   eps    maximize grad_scale
  adagrad("adagrad-plain", {0.01, 0.0, 1e-10, false, 1.0});
  adagrad("adagrad-wd-maximize", {0.01 / 1.5, 0.1, 1e-10, true, 2.0});
  return cases;
}

struct Config {
  DType grad, moment, out;
  int64_t n;
  int64_t offset;  // elements; each buffer gets its own offset derived from it
  int threads;
  uint64_t seed;
};

std::string describe(const Case& c, const Config& cfg) {
  char text[200];
  std::snprintf(text, sizeof text, "%s grad=%s moments=%s out=%s n=%lld offset=%lld threads=%d", c.name,
                dtype_name(cfg.grad), dtype_name(cfg.moment), dtype_name(cfg.out),
                static_cast<long long>(cfg.n), static_cast<long long>(cfg.offset), cfg.threads);
  return text;
}

// One configuration's inputs, generated once from cfg.seed and copied for each ISA.
struct Inputs {
  Guarded weight, grad;
  std::vector<Guarded> states;
};

// Cheap near-normal values: the sum of four uniforms, centred and scaled to unit
// variance (Box-Muller's log/cos run in qemu's soft float and dominated the run time).
double near_normal(Rng& rng) {
  return (rng.uniform() + rng.uniform() + rng.uniform() + rng.uniform() - 2.0) * 1.7320508075688772;
}

Inputs make_inputs(const Case& c, const Config& cfg) {
  Rng rng{cfg.seed};
  const int64_t n = cfg.n;
  Inputs in{Guarded(DType::kF32, n, cfg.offset), Guarded(cfg.grad, n, (cfg.offset + 1) % 4), {}};
  for (int64_t i = 0; i < n; ++i) in.weight.set(i, static_cast<float>(near_normal(rng)));
  // Gradients with standard deviation 2, one in 16 scaled by 2^-30..2^-14 so that fp16
  // and bf16 loads meet subnormals and the products meet tiny magnitudes.
  for (int64_t i = 0; i < n; ++i) {
    double g = near_normal(rng) * 2;
    if ((rng.next() & 15u) == 0) g = std::ldexp(g, -14 - static_cast<int>(rng.next() % 17));
    in.grad.set(i, static_cast<float>(g));
  }
  for (size_t s = 0; s < c.states.size(); ++s) {
    in.states.emplace_back(cfg.moment, n, static_cast<int64_t>((cfg.offset + 3 + s) % 4));
    for (int64_t i = 0; i < n; ++i) {
      const Init init = c.states[s];
      const double x = init == Init::kSigned01 ? near_normal(rng) * 0.1
                       : init == Init::kPositive001 ? rng.uniform() * 0.01 : rng.uniform();
      in.states[s].set(i, static_cast<float>(x));
    }
  }
  return in;
}

struct Run {
  Guarded weight, grad;
  std::vector<Guarded> states;
  Guarded out;
};

// Runs the op with variant `isa` on a copy of the inputs.
Run run_case(const Case& c, const Config& cfg, const Inputs& in, const char* isa) {
  const int64_t n = cfg.n;
  Run r{in.weight, in.grad, in.states,
        Guarded(cfg.out == DType::kNone ? DType::kBF16 : cfg.out, cfg.out == DType::kNone ? 0 : n,
                (cfg.offset + 2) % 4)};
  k::set_isa(isa);
  k::set_num_threads(cfg.threads);
  float* w = static_cast<float*>(r.weight.data());
  void* out = cfg.out == DType::kNone ? nullptr : r.out.data();
  auto state = [&](size_t s) -> void* { return s < r.states.size() ? r.states[s].data() : nullptr; };
  switch (c.op) {
    case Op::kAdam:
      k::adam_update(w, r.grad.data(), state(0), state(1), state(2), out, n, cfg.grad, cfg.moment, cfg.out, c.adam);
      break;
    case Op::kLion:
      k::lion_update(w, r.grad.data(), state(0), out, n, cfg.grad, cfg.moment, cfg.out, c.lion);
      break;
    case Op::kSgd:
      k::sgd_update(w, r.grad.data(), state(0), out, n, cfg.grad, cfg.moment, cfg.out, c.sgd);
      break;
    case Op::kAdagrad:
      k::adagrad_update(w, r.grad.data(), state(0), out, n, cfg.grad, cfg.moment, cfg.out, c.adagrad);
      break;
  }
  return r;
}

// Bitwise equality, except that any NaN equals any NaN (payloads are not specified).
void compare_bits(const Guarded& neon, const Guarded& scalar, const std::string& what) {
  int64_t mismatches = 0, first = -1;
  for (int64_t i = 0; i < neon.n; ++i) {
    const uint32_t a = neon.bits(i), b = scalar.bits(i);
    if (a != b && !(is_nan_bits(neon.dtype, a) && is_nan_bits(neon.dtype, b))) {
      if (first < 0) first = i;
      ++mismatches;
    }
  }
  char detail[160] = "";
  if (mismatches)
    std::snprintf(detail, sizeof detail, ": %lld elements differ, first at %lld (neon 0x%x, scalar 0x%x)",
                  static_cast<long long>(mismatches), static_cast<long long>(first), neon.bits(first),
                  scalar.bits(first));
  check(mismatches == 0, what + " neon != scalar" + detail);
}

void check_weight_out_rounding(const Run& r, DType out, const std::string& what) {
  if (out == DType::kNone) return;
  int64_t bad = 0, first = -1;
  for (int64_t i = 0; i < r.weight.n; ++i) {
    const float master = r.weight.value(i);
    const uint32_t got = r.out.bits(i);
    const bool ok = std::isnan(master) ? is_nan_bits(out, got) && (out != DType::kBF16 || got == 0x7FC0)
                                       : got == (out == DType::kBF16 ? bf16_reference(master) : f16_reference(master));
    if (!ok) {
      if (first < 0) first = i;
      ++bad;
    }
  }
  check(bad == 0, what + ": weight_out is not the master rounded to nearest even (" + std::to_string(bad) +
                      " elements, first at " + std::to_string(first) + ")");
}

void check_guards(const Run& r, const Inputs& in, const std::string& what) {
  check(r.weight.guards_intact(), what + ": write outside weight");
  check(r.grad.guards_intact(), what + ": write outside grad");
  for (size_t s = 0; s < r.states.size(); ++s)
    check(r.states[s].guards_intact(), what + ": write outside state " + std::to_string(s));
  check(r.out.guards_intact(), what + ": write outside weight_out");
  check(r.grad.bytes == in.grad.bytes, what + ": the gradient must only be read");
}

// AdamW (decoupled decay, fp32 moments, no amsgrad) evaluated in double from the
// inputs; the kernel may differ by 16 fp32 ulps of the largest term of each result.
void check_adamw_against_double(const Case& c, const Inputs& in, const Run& r, const std::string& what) {
  const k::AdamParams& p = c.adam;
  const double ulps16 = 16 * 0x1p-23;
  int64_t bad = 0, first = -1;
  for (int64_t i = 0; i < r.weight.n; ++i) {
    const double g = static_cast<double>(in.grad.value(i)) * p.grad_scale * (p.maximize ? -1 : 1);
    const double m0 = in.states[0].value(i), v0 = in.states[1].value(i), w0 = in.weight.value(i);
    const double m = m0 + (1 - p.beta1) * (g - m0);
    const double v = p.beta2 * v0 + (1 - p.beta2) * g * g;
    const double denom = std::sqrt(v) / std::sqrt(p.bias_correction2) + p.eps;
    const double w = w0 * (1 - p.lr * p.weight_decay) - p.lr / p.bias_correction1 * m / denom;
    const double gm = std::fabs(g);
    const bool ok =
        std::fabs(r.states[0].value(i) - m) <= ulps16 * std::fmax(std::fmax(std::fabs(m0), std::fabs(m)), gm) &&
        std::fabs(r.states[1].value(i) - v) <= ulps16 * std::fmax(std::fmax(v0, v), gm * gm) &&
        std::fabs(r.weight.value(i) - w) <= ulps16 * std::fmax(std::fmax(std::fabs(w0), std::fabs(w)), std::fabs(w - w0));
    if (!ok) {
      if (first < 0) first = i;
      ++bad;
    }
  }
  check(bad == 0, what + ": AdamW differs from the double-precision formula (" + std::to_string(bad) +
                      " elements, first at " + std::to_string(first) + ")");
}

void check_case(const Case& c, const Config& cfg) {
  const std::string what = describe(c, cfg);
  const Inputs in = make_inputs(c, cfg);
  const Run neon = run_case(c, cfg, in, "neon");
  const Run scalar = run_case(c, cfg, in, "scalar");
  check_guards(neon, in, what + " [neon]");
  check_guards(scalar, in, what + " [scalar]");
  compare_bits(neon.weight, scalar.weight, what + " weight");
  for (size_t s = 0; s < neon.states.size(); ++s)
    compare_bits(neon.states[s], scalar.states[s], what + " state " + std::to_string(s));
  if (cfg.out != DType::kNone) compare_bits(neon.out, scalar.out, what + " weight_out");
  check_weight_out_rounding(neon, cfg.out, what + " [neon]");
  if (c.op == Op::kAdam && c.adam.decoupled && c.states.size() == 2 && cfg.moment == DType::kF32)
    check_adamw_against_double(c, in, neon, what + " [neon]");
}

// ---- rounding of special values -------------------------------------------------
// SGD with lr = 0 passes the master through, so weight_out must hold exactly the
// rounding of each value; every value meets every vector phase (and the scalar tail).
void check_special_rounding() {
  const uint32_t special[] = {
      0x3F808000, 0x3F818000, 0xBF808000, 0xBF818000,  // bf16 ties around +-1.0 (even, odd)
      0x3F80FFFF, 0x3F807FFF, 0x7F7FFFFF, 0xFF7FFFFF,  // just off a tie; fp32 max
      0x7F7F8000, 0x00000001, 0x80000001, 0x007FFFFF,  // bf16 tie to inf; fp32 subnormals
      0x00400000, 0x00008000, 0x00018000, 0x7F800000,  // subnormal bf16 ties; +inf
      0xFF800000, 0x7FC00000, 0xFFC00001, 0x7F800001,  // -inf; NaNs (incl. signalling)
      0x00000000, 0x80000000, 0x3F801000, 0x3F803000,  // +-0; fp16 ties near 1.0
      0x477FEFFF, 0x477FF000, 0x33000000, 0x33000001,  // fp16 max / overflow; fp16 subnormal tie
      0x38800000, 0x387FE000, 0x387FF000, 0x337FFFFF,  // fp16 min normal and around it
  };
  const int64_t count = sizeof special / sizeof special[0];
  const k::SgdParams zero_lr{0.0, 0.0, 0.0, 0.0, false, false, false, 1.0};
  for (const char* isa : {"neon", "scalar"}) {
    k::set_isa(isa);
    k::set_num_threads(1);
    for (DType out : {DType::kBF16, DType::kF16}) {
      for (int64_t phase = 0; phase < 5; ++phase) {
        Guarded weight(DType::kF32, count, phase), grad(DType::kF32, count, 0), weight_out(out, count, phase);
        for (int64_t i = 0; i < count; ++i) {
          weight.set(i, float_of(special[(i + phase) % count]));
          grad.set(i, 0.0f);
        }
        k::sgd_update(static_cast<float*>(weight.data()), grad.data(), nullptr, weight_out.data(), count,
                      DType::kF32, DType::kF32, out, zero_lr);
        for (int64_t i = 0; i < count; ++i) {
          const float x = float_of(special[(i + phase) % count]);
          const uint32_t got = weight_out.bits(i);
          const uint16_t want = out == DType::kBF16 ? bf16_reference(x) : f16_reference(x);
          const bool ok = std::isnan(x) ? is_nan_bits(out, got) && (out != DType::kBF16 || got == 0x7FC0) : got == want;
          char text[160];
          std::snprintf(text, sizeof text, "%s: %s rounding of 0x%08X gave 0x%04X, expected 0x%04X", isa,
                        dtype_name(out), special[(i + phase) % count], got, want);
          check(ok, text);
        }
        check(weight_out.guards_intact(), std::string(isa) + ": special rounding wrote outside weight_out");
      }
    }
  }
}

// ---- grad_sumsq ---------------------------------------------------------------
void check_sumsq() {
  Rng rng{7};
  for (DType d : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{15}, int64_t{16}, int64_t{17}, int64_t{255},
                      int64_t{1023}, int64_t{(1 << 18) * 2 + 3}}) {
      Guarded grad(d, n, 1);
      double expected = 0;
      for (int64_t i = 0; i < n; ++i) {
        grad.set(i, static_cast<float>(near_normal(rng)));
        const double x = grad.value(i);
        expected += x * x;
      }
      for (const char* isa : {"neon", "scalar"}) {
        k::set_isa(isa);
        double by_threads[2];
        for (int threads : {1, 2}) {
          k::set_num_threads(threads);
          by_threads[threads - 1] = k::grad_sumsq(grad.data(), n, d, 1.0);
        }
        const std::string what = std::string(isa) + " grad_sumsq " + dtype_name(d) + " n=" + std::to_string(n);
        check(std::fabs(by_threads[0] - expected) <= 1e-5 * expected,
              what + ": " + std::to_string(by_threads[0]) + " vs double sum " + std::to_string(expected));
        check(by_threads[0] == by_threads[1], what + ": differs between 1 and 2 threads");
        k::set_num_threads(1);
        const double scaled = k::grad_sumsq(grad.data(), n, d, 0.125);
        check(std::fabs(scaled - expected / 64) <= 1e-5 * expected / 64, what + ": scale 0.125");
      }
    }
  }
  // A non-finite element anywhere (vector body, tail, a later task) shows in the sum.
  for (const char* isa : {"neon", "scalar"}) {
    k::set_isa(isa);
    for (int64_t position : {int64_t{0}, int64_t{16}, int64_t{1001}, int64_t{(1 << 18) + 1}}) {
      for (bool nan : {false, true}) {
        const int64_t n = (1 << 18) + 2;
        Guarded grad(DType::kBF16, n, 0);
        for (int64_t i = 0; i < n; ++i) grad.set(i, 1.0f);
        grad.set(position, nan ? NAN : INFINITY);
        const double total = k::grad_sumsq(grad.data(), n, DType::kBF16, 1.0);
        check(nan ? std::isnan(total) : std::isinf(total) && total > 0,
              std::string(isa) + " grad_sumsq: " + (nan ? "NaN" : "inf") + " at " + std::to_string(position) +
                  " gave " + std::to_string(total));
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  // --full: every chunked size for every combination and the large size for every case
  // (~2 min under qemu on a 2-core VM); the default quick run takes ~1/5 of that.
  const bool full = argc > 1 && std::string(argv[1]) == "--full";
  try {
    const std::vector<std::string> isas = k::available_isas();
    bool has_neon = false;
    for (const auto& name : isas) has_neon |= name == "neon";
    check(has_neon, "available_isas() lacks \"neon\" on AArch64");
    k::set_isa("auto");
    check(k::current_isa() == "neon", "set_isa(\"auto\") chose " + k::current_isa() + ", expected neon");
    if (!has_neon) {
      std::fprintf(stderr, "neon_check: %d failures\n", g_failures);
      return 1;
    }

    const std::vector<Case> cases = make_cases();
    const DType grads[] = {DType::kF32, DType::kBF16, DType::kF16};
    const DType moments[] = {DType::kF32, DType::kBF16};
    const DType outs[] = {DType::kNone, DType::kBF16, DType::kF16};
    // Empty, below one vector (4), exact multiples, tails of 1..3, then sizes that span
    // 2 and 4 of the smallest tasks with a tail (the quick run keeps the first).
    const int64_t small_sizes[] = {0, 1, 3, 4, 5, 7, 8, 15, 16, 17, 255, 1023};
    const int64_t chunked_sizes[] = {k::kMinTaskElements + 5, 3 * k::kMinTaskElements + 7};
    const int n_chunked = full ? 2 : 1;
    uint64_t seed = 1;
    {
      SectionTimer timer{"op matrix"};
      for (const Case& c : cases) {
        int combo = 0;
        for (DType g : grads) {
          for (DType m : moments) {
            for (DType o : outs) {
              for (int64_t n : small_sizes) check_case(c, {g, m, o, n, (combo + n) % 4, 1, seed++});
              for (int j = 0; j < n_chunked; ++j)
                check_case(c, {g, m, o, chunked_sizes[j], combo % 4, 2 - (combo + j) % 2, seed++});
              ++combo;
            }
          }
        }
        // The parity tests' large size, 2^20 + 3 elements (64 chunks and a tail): the
        // optimizer's mixed-precision dtypes at 1 thread, the other half-precision path at
        // 2. The quick run does this for AdamW only (each takes ~2 s under qemu).
        if (full || std::string(c.name) == "adam-adamw") {
          check_case(c, {DType::kBF16, DType::kF32, DType::kBF16, (1 << 20) + 3, 1, 1, seed++});
          check_case(c, {DType::kF16, DType::kBF16, DType::kF16, (1 << 20) + 3, 3, 2, seed++});
        }
      }
    }
    {
      SectionTimer timer{"special rounding"};
      check_special_rounding();
    }
    {
      SectionTimer timer{"grad_sumsq"};
      check_sumsq();
    }
  } catch (const std::exception& e) {
    fail(std::string("exception: ") + e.what());
  }
  if (g_failures) {
    std::fprintf(stderr, "neon_check: %d of %ld checks failed\n", g_failures, g_checks);
    return 1;
  }
  std::printf("neon_check: all %ld checks passed\n", g_checks);
  return 0;
}
