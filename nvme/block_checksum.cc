#include "nvme/block_checksum.h"

#include <xxhash.h>

namespace memplan::nvme::internal {

uint64_t BlockChecksum(const std::byte* data, size_t bytes) {
#if MEMPLAN_NVME_AVX2
  static const bool avx2 = __builtin_cpu_supports("avx2");
  if (avx2) return BlockChecksumAvx2(data, bytes);
#endif
  return XXH3_64bits(data, bytes);
}

}  // namespace memplan::nvme::internal
