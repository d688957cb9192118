// CRC-32C (Castagnoli, the iSCSI/ext4 polynomial 0x1EDC6F41, reflected 0x82F63B78) of
// host memory, used to verify that a record read back from a scratch file is the one
// written. Five variants, the best one chosen at run time (never by -march):
//   - "avx512-vpclmul": 512-bit carry-less multiplication folding (x86 with AVX-512 and
//                  VPCLMULQDQ), the last 128 bits reduced with the crc32 instruction;
//   - "pclmul":    the same folding 128 bits wide (any x86-64 with PCLMULQDQ and SSE4.2),
//                  chosen over "sse4.2" where a timing at first use finds it faster;
//   - "sse4.2":    the x86 crc32 instruction, three interleaved streams;
//   - "armv8-crc": the AArch64 CRC32C instructions, three interleaved streams;
//   - "table":     slicing-by-8 tables, any CPU.
// All return the same value (the standard CRC-32C: "123456789" -> 0xE3069283).
// Per core, over a 64 MiB buffer in DRAM on the reference VM (Zen 4, CPU time):
// avx512-vpclmul 16-18 GB/s (bound by memory), sse4.2 11 GB/s, table 1.8 GB/s. On a Zen 1
// EPYC: pclmul 6.7-6.9 GB/s (9.7 in L2), sse4.2 5.3-5.4 (5.9 in L2).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace tierstate::io {

// CRC-32C of [data, data + nbytes) continuing from ``crc`` (0 to start), with the
// variant chosen at run time; a buffer of 2 MiB or more is split over the kernels'
// thread pool (tierstate::ThreadPool) and the parts joined with crc32c_combine.
uint32_t crc32c(uint32_t crc, const void* data, size_t nbytes);
// The same on the calling thread only, whatever the size (the I/O engine's workers, which
// must not wait on the kernels' pool).
uint32_t crc32c_serial(uint32_t crc, const void* data, size_t nbytes);
// The CRC-32C of A followed by B, from crc(A), crc(B) and B's length in bytes.
uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, size_t len_b);
// The same with a named variant; throws std::invalid_argument if it cannot run here.
uint32_t crc32c_with(const std::string& isa, uint32_t crc, const void* data, size_t nbytes);
// Variants this CPU and build can run, fastest first ("table" is always last).
std::vector<std::string> crc32c_isas();

}  // namespace tierstate::io
