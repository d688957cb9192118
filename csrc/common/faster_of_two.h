// Which of two implementations of one computation runs faster on this core, timed once at
// first use. Used where the answer depends on the core rather than on the ISA (the CRC-32C
// folding against the crc32 instruction, io/crc32c.cpp; the 8-bit maps' gathers against
// scalar loads, kernels/dispatch.cpp): both variants give the same result, so only the
// speed depends on the outcome.
#pragma once

#include <algorithm>
#include <chrono>

namespace tierstate {

// run(0) and run(1), `rounds` times each, interleaved so that a slow moment of the machine
// hits both; compares the fastest run of each. True when run(1) is faster.
template <class Run>
bool second_is_faster(Run&& run, int rounds) {
  double best[2] = {1e30, 1e30};
  for (int round = 0; round < rounds; ++round) {
    for (int which = 0; which < 2; ++which) {
      const auto t0 = std::chrono::steady_clock::now();
      run(which);
      best[which] = std::min(best[which], std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
  }
  return best[1] < best[0];
}

}  // namespace tierstate
