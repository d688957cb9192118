// Standalone check of the 8-bit state kernels on AArch64 (NEON against scalar), without
// Python: built and run under qemu-aarch64 by test_kernels_native_isa.py, which writes the
// maps of tierstate/kernels/quant.py into a folder first (maps.bin, see below): both
// families, the dynamic (table) maps and the fp8 (arithmetic) maps.
//
// On AArch64 the NEON and scalar variants round every operation alike (fmaf is base
// AArch64, sqrt and division are correctly rounded, the encoder is integer arithmetic), so
// every output must be bit-identical: codes, scales, dequantized values, the master (fp32,
// bf16 + int16 compensation, bf16 stochastically rounded) and weight_out, over sizes with
// partial blocks and scalar tails, at 1 and 2 threads; and the group-wise int8 / int4
// weights of generation (dequantize_groups) into every output dtype.
//
// maps.bin: for the dynamic signed, dynamic unsigned, fp8 signed and fp8 unsigned maps:
// int32 lut_size, lut_shift, lut_base, is_signed, fp8_mantissa_bits; float top;
// float table[256]; uint32 lut[lut_size] (QuantMap.lut32; none for the fp8 maps).
// Usage: q8_check MAPS_BIN. Exit status 0 when every check passes.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/kernels.h"

namespace k = tierstate::kernels;

namespace {

struct Map {
  std::vector<float> table;
  std::vector<uint32_t> lut;
  int32_t size = 0, shift = 0, base = 0, is_signed = 0, fp8_bits = 0;
  float top = 1.0f;
  k::QuantMapRef ref() const {
    return {table.data(), lut.data(), size, shift, base, is_signed != 0, fp8_bits, top};
  }
};

bool read_map(FILE* f, Map& m) {
  int32_t head[5];
  if (fread(head, sizeof head, 1, f) != 1 || fread(&m.top, 4, 1, f) != 1) return false;
  m.size = head[0], m.shift = head[1], m.base = head[2], m.is_signed = head[3], m.fp8_bits = head[4];
  m.table.resize(256);
  m.lut.resize(m.size);
  return fread(m.table.data(), 4, 256, f) == 256 &&
         fread(m.lut.data(), 4, m.size, f) == static_cast<size_t>(m.size);
}

uint64_t g_state = 12345;
uint64_t next_bits() {  // splitmix64
  uint64_t z = (g_state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
float next_float() {  // a signed value with magnitude 10**U(-6, 1)
  const uint64_t z = next_bits();
  const double u = static_cast<double>(z >> 11) * 0x1p-53;
  double mag = 1e-6;
  for (int i = 0; i < static_cast<int>(u * 7); ++i) mag *= 10;
  return static_cast<float>((z & 1 ? -1 : 1) * mag * (1 + u));
}

int g_failures = 0;
template <class T>
void same(const std::vector<T>& a, const std::vector<T>& b, const std::string& what) {
  if (a.size() != b.size() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) != 0) {
    if (g_failures++ < 20) std::fprintf(stderr, "FAIL: %s differs between neon and scalar\n", what.c_str());
  }
}

struct State {
  std::vector<float> master32;
  std::vector<uint16_t> master16, out;
  std::vector<int16_t> comp;
  std::vector<uint8_t> mc, vc;
  std::vector<float> ms, vs;
};

// `steps` steps at learning rate `lr` (from the swept masters: lr 0 keeps the compensation's
// unit at every exponent observable, which any real update swamps below e = 24).
State run(const char* isa, int threads, int64_t n, int64_t block, k::MasterMode mode, const Map& sm,
          const Map& um, const std::vector<float>& grad, double lr = 1e-2, int steps = 3) {
  k::set_isa(isa);
  k::set_num_threads(threads);
  g_state = 777 + n;
  State s;
  const int64_t blocks = (n + block - 1) / block;
  s.master32.resize(n);
  s.master16.resize(n);
  s.comp.assign(n, 0);
  s.out.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    s.master32[i] = next_float();
    uint32_t u;
    std::memcpy(&u, &s.master32[i], 4);
    s.master16[i] = static_cast<uint16_t>(u >> 16);
  }
  if (mode == k::MasterMode::kBF16Kahan) {
    // every other bf16 master swept over all 256 exponent fields (the compensation's unit,
    // 2**(max(e, 24) - 150), is clamped below 24; 255 is inf and NaN), with comps across int16
    for (int64_t i = 0; i < n; i += 2) {
      const uint32_t field = static_cast<uint32_t>(i / 2) % 256u, z = static_cast<uint32_t>(next_bits());
      s.master16[i] = static_cast<uint16_t>(((z >> 31) << 15) | (field << 7) | (z & 0x7Fu));
      s.comp[i] = static_cast<int16_t>(z >> 8);
    }
  }
  std::vector<float> m0(n), s0(n);
  for (int64_t i = 0; i < n; ++i) {
    m0[i] = next_float() * 1e-2f;
    s0[i] = std::fabs(next_float()) * 1e-2f;
  }
  s.mc.resize(n);
  s.vc.resize(n);
  s.ms.resize(blocks);
  s.vs.resize(blocks);
  k::quantize_blockwise(m0.data(), s.mc.data(), s.ms.data(), n, block, sm.ref());
  k::quantize_blockwise(s0.data(), s.vc.data(), s.vs.data(), n, block, um.ref());
  void* master = mode == k::MasterMode::kF32 ? static_cast<void*>(s.master32.data()) : s.master16.data();
  for (int step = 1; step <= steps; ++step) {
    const double bc1 = 1 - 0.9 * (step == 1 ? 1 : step == 2 ? 0.9 : 0.81);
    k::AdamQ8Params p{{lr, 0.9, 0.999, 1e-8, 0.1, step != 2, bc1, 0.01 * step, step == 3, 0.5},
                      block, mode, 0xC0FFEEu + step, 5};
    k::adam_q8_update(master, s.comp.data(), grad.data(), s.mc.data(), s.ms.data(), s.vc.data(), s.vs.data(),
                      s.out.data(), n, k::DType::kF32, k::DType::kBF16, sm.ref(), um.ref(), p);
  }
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: q8_check MAPS_BIN\n");
    return 2;
  }
  FILE* f = std::fopen(argv[1], "rb");
  Map maps[4];  // dynamic signed, dynamic unsigned, fp8 signed, fp8 unsigned
  if (f == nullptr || !read_map(f, maps[0]) || !read_map(f, maps[1]) || !read_map(f, maps[2]) ||
      !read_map(f, maps[3])) {
    std::fprintf(stderr, "cannot read the maps from %s\n", argv[1]);
    return 2;
  }
  std::fclose(f);
  long checks = 0;
  for (int family = 0; family < 2; ++family) {
    const Map& sm = maps[2 * family];
    const Map& um = maps[2 * family + 1];
    const std::string fam = family ? " fp8" : " dynamic";
    for (int64_t n : {1, 3, 255, 257, 4099, 70000}) {
      std::vector<float> grad(n);
      g_state = 99 + n;
      for (float& x : grad) x = next_float();
      for (int64_t block : {64, 256}) {
        // quantize / dequantize
        std::vector<uint8_t> c1(n), c2(n);
        std::vector<float> s1((n + block - 1) / block), s2(s1.size()), d1(n), d2(n);
        for (const Map* m : {&sm, &um}) {
          k::set_isa("neon");
          k::quantize_blockwise(grad.data(), c1.data(), s1.data(), n, block, m->ref());
          k::dequantize_blockwise(c1.data(), s1.data(), d1.data(), n, block, m->ref());
          k::set_isa("scalar");
          k::quantize_blockwise(grad.data(), c2.data(), s2.data(), n, block, m->ref());
          k::dequantize_blockwise(c2.data(), s2.data(), d2.data(), n, block, m->ref());
          same(c1, c2, "codes n=" + std::to_string(n) + fam);
          same(s1, s2, "scales n=" + std::to_string(n) + fam);
          same(d1, d2, "dequantized n=" + std::to_string(n) + fam);
          checks += 3;
        }
        for (k::MasterMode mode : {k::MasterMode::kF32, k::MasterMode::kBF16Kahan, k::MasterMode::kBF16SR}) {
          for (int threads : {1, 2}) {
            const State a = run("neon", threads, n, block, mode, sm, um, grad);
            const State b = run("scalar", 1, n, block, mode, sm, um, grad);
            const std::string what = "adam_q8 n=" + std::to_string(n) + " block=" + std::to_string(block) +
                                     " mode=" + std::to_string(static_cast<int>(mode)) + " threads=" +
                                     std::to_string(threads) + fam;
            same(a.master32, b.master32, what + " master32");
            same(a.master16, b.master16, what + " master16");
            same(a.comp, b.comp, what + " comp");
            same(a.out, b.out, what + " weight_out");
            same(a.mc, b.mc, what + " m codes");
            same(a.vc, b.vc, what + " v codes");
            same(a.ms, b.ms, what + " m scales");
            same(a.vs, b.vs, what + " v scales");
            checks += 8;
          }
        }
        // lr 0: the compensation's unit at every exponent; lr 7e35: masters at the top of
        // bf16's range pushed past it (rounded to +-inf), where the compensation saturates
        for (double lr : {0.0, 7e35}) {
          for (int threads : {1, 2}) {
            const State a = run("neon", threads, n, block, k::MasterMode::kBF16Kahan, sm, um, grad, lr, 1);
            const State b = run("scalar", 1, n, block, k::MasterMode::kBF16Kahan, sm, um, grad, lr, 1);
            const std::string what = "adam_q8 lr=" + std::to_string(lr) + " n=" + std::to_string(n) +
                                     " block=" + std::to_string(block) + " threads=" + std::to_string(threads) + fam;
            same(a.master16, b.master16, what + " master16");
            same(a.comp, b.comp, what + " comp");
            checks += 2;
          }
        }
      }
    }
  }
  // group-wise int8 / int4 weights (generation), every output dtype; group 66 has a scalar
  // tail after its vectors (int4's at an odd byte), group 6 is all tail
  for (int bits : {8, 4}) {
    for (int64_t group : {64, 66, 6}) {
      const int64_t n = group * 1007;
      std::vector<uint8_t> codes(bits == 8 ? n : n / 2);
      g_state = 7 + group + bits;
      for (uint8_t& c : codes) c = static_cast<uint8_t>(static_cast<int64_t>(next_float() * 1e6f));  // modulo 256
      std::vector<float> scales(n / group);
      for (float& x : scales) x = std::fabs(next_float());
      for (k::DType dt : {k::DType::kF32, k::DType::kBF16, k::DType::kF16}) {
        const size_t bytes = static_cast<size_t>(n) * (dt == k::DType::kF32 ? 4 : 2);
        std::vector<uint8_t> o1(bytes), o2(bytes);
        k::set_isa("neon");
        k::dequantize_groups(codes.data(), scales.data(), o1.data(), n, group, bits, dt);
        k::set_isa("scalar");
        k::dequantize_groups(codes.data(), scales.data(), o2.data(), n, group, bits, dt);
        same(o1, o2, "dequantize_groups bits=" + std::to_string(bits) + " group=" + std::to_string(group) +
                         " dtype=" + std::to_string(static_cast<int>(dt)));
        ++checks;
      }
    }
  }
  if (g_failures) {
    std::fprintf(stderr, "%d of %ld checks failed\n", g_failures, checks);
    return 1;
  }
  std::printf("q8_check: all %ld checks passed\n", checks);
  return 0;
}
