// Standalone check of csrc/io/crc32c.cpp's variants against the portable table variant
// and the standard check value, without Python: on x86-64 it runs natively (sse4.2, and
// avx512-vpclmul where the CPU has it); cross-compiled for AArch64 and run under qemu it
// checks the armv8-crc variant, which no x86 machine can run.
//
// For sizes 0..1100 (every tail of the 8-byte and three-stream loops), the three-stream
// block boundaries (3 x 256 and 3 x 8192 bytes, +-1) and 1 MiB + 5, each at start offsets
// 0..7, and for a CRC continued from a previous value, every variant must equal "table".
// Exit status 0 and "crc32c: N checks passed (variants ...)" on success.
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "common/thread_pool.h"
#include "io/crc32c.h"

using tierstate::io::crc32c_isas;
using tierstate::io::crc32c_with;

int main(int argc, char** argv) {
  std::vector<std::string> want;
  for (int i = 1; i < argc; ++i) want.emplace_back(argv[i]);  // variants that must be available here
  const std::vector<std::string> isas = crc32c_isas();
  for (const auto& w : want) {
    bool found = false;
    for (const auto& isa : isas) found = found || isa == w;
    if (!found) {
      std::fprintf(stderr, "variant %s is not available here\n", w.c_str());
      return 2;
    }
  }
  const char* check = "123456789";
  std::vector<uint8_t> buf((1u << 20) + 5 + 8);
  uint64_t x = 0x9E3779B97F4A7C15ull;
  for (auto& b : buf) {  // xorshift64: bytes that exercise every bit
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    b = static_cast<uint8_t>(x >> 56);
  }
  std::vector<size_t> sizes;
  for (size_t n = 0; n <= 1100; ++n) sizes.push_back(n);
  for (size_t block : {size_t{256}, size_t{8192}})
    for (size_t n : {3 * block - 1, 3 * block, 3 * block + 1, 6 * block + 7}) sizes.push_back(n);
  sizes.push_back((1u << 20) + 5);
  long checks = 0, failures = 0;
  for (const auto& isa : isas) {
    const uint32_t v = crc32c_with(isa, 0, check, 9);
    ++checks;
    if (v != 0xE3069283u) {
      std::fprintf(stderr, "%s: crc32c(\"123456789\") = %08x, expected e3069283\n", isa.c_str(), v);
      ++failures;
    }
    for (size_t n : sizes) {
      for (size_t off = 0; off < 8; ++off) {
        const uint8_t* p = buf.data() + off;
        const uint32_t ref = crc32c_with("table", 0, p, n);
        const uint32_t got = crc32c_with(isa, 0, p, n);
        // continued: the first third, then the rest, from the previous value
        const uint32_t part = crc32c_with(isa, crc32c_with(isa, 0, p, n / 3), p + n / 3, n - n / 3);
        checks += 2;
        if (got != ref || part != ref) {
          if (++failures <= 10)
            std::fprintf(stderr, "%s: size %zu offset %zu: %08x (continued %08x), table %08x\n", isa.c_str(), n,
                         off, got, part, ref);
        }
      }
    }
  }
  // crc32c() splits a buffer of 2 MiB or more over the thread pool and joins the parts with
  // crc32c_combine: every split must give the one-thread value of the best variant.
  std::vector<uint8_t> big((6u << 20) + 77);
  for (auto& b : big) x ^= x << 13, x ^= x >> 7, x ^= x << 17, b = static_cast<uint8_t>(x >> 56);
  for (int threads : {1, 2, 3, 7}) {
    tierstate::ThreadPool::instance().set_num_threads(threads);
    for (size_t n : {size_t{2} << 20, (size_t{2} << 20) + 1, (size_t{5} << 20) + 13, big.size() - 3}) {
      for (size_t off : {size_t{0}, size_t{3}}) {
        const uint32_t ref = crc32c_with(isas.front(), 0x1234ABCDu, big.data() + off, n);
        const uint32_t got = tierstate::io::crc32c(0x1234ABCDu, big.data() + off, n);
        ++checks;
        if (got != ref && ++failures <= 10)
          std::fprintf(stderr, "split over %d threads: size %zu offset %zu: %08x, one thread %08x\n", threads, n,
                       off, got, ref);
      }
    }
  }
  if (failures) {
    std::fprintf(stderr, "crc32c: %ld of %ld checks failed\n", failures, checks);
    return 1;
  }
  std::printf("crc32c: %ld checks passed (variants", checks);
  for (const auto& isa : isas) std::printf(" %s", isa.c_str());
  std::printf(")\n");
  return 0;
}
