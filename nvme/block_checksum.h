// The checksum of a SwapStore block: XXH3-64 (the value stored in the index), computed by the
// widest vector code the CPU runs. Every path gives the same value (XXH3 is defined bit for bit,
// whatever the vectors), so stores stay readable across machines and builds; the choice is only
// speed: the library's build is SSE2, and a step hashes every byte it reads and writes.
// Thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>

namespace memplan::nvme::internal {

uint64_t BlockChecksum(const std::byte* data, size_t bytes);

// The AVX2 build of XXH3-64 (block_checksum_avx2.cc); only on x86-64, only where the CPU has AVX2.
uint64_t BlockChecksumAvx2(const std::byte* data, size_t bytes);

}  // namespace memplan::nvme::internal
