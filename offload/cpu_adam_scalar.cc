// The portable optimizer kernels: the reference the vector kernels match bit for bit, and what runs
// on a CPU without AVX2.
#include "offload/cpu_optimizer_internal.h"

namespace memplan::offload::internal {

void AdamScalar(const AdamKernelArgs& args, size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i) AdamElement(args, i);
}

void ToHalfScalar(const float* src, uint16_t* dst, HalfDtype dtype, size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i) dst[i] = ToHalf(src[i], dtype);
}

}  // namespace memplan::offload::internal
