// XXH3-64 compiled for AVX2 (this file only is built with -mavx2): xxhash's header-only build,
// private to this file, so it does not clash with the library's symbols.
#include "nvme/block_checksum.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace memplan::nvme::internal {

uint64_t BlockChecksumAvx2(const std::byte* data, size_t bytes) { return XXH3_64bits(data, bytes); }

}  // namespace memplan::nvme::internal
