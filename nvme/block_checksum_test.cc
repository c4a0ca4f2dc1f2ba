#include "nvme/block_checksum.h"

#include <doctest/doctest.h>
#include <xxhash.h>

#include <random>
#include <vector>

namespace memplan::nvme::internal {
namespace {

// The stored checksums are xxhash's XXH3-64: whichever code computes them must give its values,
// or stores written by one build would not read in another.
TEST_CASE("block checksum: the library's XXH3-64, for every size and alignment") {
  std::mt19937_64 rng(7);
  std::vector<std::byte> data((1 << 20) + 64);
  for (std::byte& b : data) b = static_cast<std::byte>(rng());
  for (size_t size :
       {size_t{0}, size_t{1}, size_t{3}, size_t{16}, size_t{17}, size_t{128}, size_t{129},
        size_t{240}, size_t{241}, size_t{1023}, size_t{4096}, size_t{65536} + 5, size_t{1} << 20}) {
    for (size_t shift : {size_t{0}, size_t{1}, size_t{13}}) {
      const std::byte* p = data.data() + shift;
      CHECK(BlockChecksum(p, size) == XXH3_64bits(p, size));
    }
  }
#if MEMPLAN_NVME_AVX2
  if (__builtin_cpu_supports("avx2")) {
    CHECK(BlockChecksumAvx2(data.data() + 1, 100000) == XXH3_64bits(data.data() + 1, 100000));
  }
#endif
}

}  // namespace
}  // namespace memplan::nvme::internal
