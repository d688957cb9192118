// Scalar variant: the kernel bodies over the 1-wide type. Compiled for the baseline
// ISA; the fallback on CPUs without AVX2 (or NEON) and a reference for the tests.
#define TIERSTATE_KERNEL_ISA isa_scalar
#include "kernels/vec_scalar.h"
#include "kernels/body.h"

namespace tierstate {
namespace kernels {

const KernelTable* scalar_table() {
  using namespace isa_scalar;
  return KernelSet<VecScalar, VecScalar>::table("scalar");
}

}  // namespace kernels
}  // namespace tierstate
