// The on-disk format of SwapStore's index file (SwapStore::kIndexFileName), its
// encoder and its decoder. Private to nvme/ (swap_store.cc and the tests); not
// installed.
//
// Note [Swap index format]
// Little-endian, fixed-width integers, no padding:
//
//   header (40 bytes)
//     0   char[8]  magic "MPSWPIDX"
//     8   u32      format version (kSwapIndexVersion)
//     12  u32      checksum_block_bytes
//     16  u32      alignment_bytes: every extent starts and ends on a multiple
//     of it 20  u32      reserved, 0 24  u64      data_file_bytes: the size of
//     the data file the extents lie in 32  u64      key count
//   per key (36 bytes + key + 8 per checksum)
//         u32      key length (<= kMaxSwapIndexKeyBytes), then the key's bytes
//         u64      extent offset, u64 extent bytes, u64 value size
//         u64      checksum count (= ceil(value size / checksum_block_bytes)),
//         then the XXH3-64
//                  checksums of the value's blocks
//   trailer
//         u64      XXH3-64 of every byte before it
//
// The decoder treats the file as hostile: every length is checked against the
// bytes left before it is used, so a count cannot make it allocate more than
// the file's size justifies, and every field is checked against the others (see
// DecodeSwapIndex). A new field means a new version.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace memplan::nvme::internal {

inline constexpr char kSwapIndexMagic[8] = {'M', 'P', 'S', 'W', 'P', 'I', 'D', 'X'};
inline constexpr uint32_t kSwapIndexVersion = 1;
inline constexpr size_t kSwapIndexHeaderBytes = 40;
inline constexpr size_t kSwapIndexTrailerBytes = 8;
// Fixed bytes of one key's record: key length, offset, extent, size, checksum
// count.
inline constexpr size_t kSwapIndexEntryFixedBytes = 4 + 4 * 8;
inline constexpr size_t kMaxSwapIndexKeyBytes = 4096;
// Largest index file written or read. Its size is about 8 bytes per checksum
// block plus the keys, so this covers half a TiB of values at 4 KiB checksum
// blocks (128 TiB at the 1 MiB default).
inline constexpr uint64_t kMaxSwapIndexBytes = uint64_t{1} << 30;

struct SwapIndexEntry {
  std::string key;
  uint64_t offset = 0;
  uint64_t extent_bytes = 0;
  uint64_t size = 0;
  std::vector<uint64_t> checksums;
};

struct SwapIndex {
  uint64_t data_file_bytes = 0;
  uint32_t checksum_block_bytes = 0;
  uint32_t alignment_bytes = 0;
  std::vector<SwapIndexEntry> entries;  // in file order
};

// Builds an index file key by key, so the store can encode straight from its
// own entries without copying them first. Checks nothing: the decoder is the
// one place that validates.
class SwapIndexEncoder {
 public:
  SwapIndexEncoder(uint64_t data_file_bytes, uint32_t checksum_block_bytes,
                   uint32_t alignment_bytes);
  void Add(std::string_view key, uint64_t offset, uint64_t extent_bytes, uint64_t size,
           std::span<const uint64_t> checksums);
  // Patches in the key count, appends the trailer and returns the bytes. Call
  // once.
  std::string Finish();

 private:
  std::string out_;
  uint64_t count_ = 0;
};

std::string EncodeSwapIndex(const SwapIndex &index);

// Parses and validates an index file's bytes. `label` (the file's path) starts
// every message. Errors are DataLoss, saying what is wrong and where: too
// short, bad magic, unsupported version, trailer checksum mismatch, a header
// field out of range (checksum block or alignment not a power of two of at
// least 4096, data file size not a positive multiple of 4096 within 2^62), a
// count or length running past the end, a key longer than kMaxSwapIndexKeyBytes
// or repeated, an extent unaligned, not equal to the value size rounded up to
// the alignment, past the last whole alignment block of the data file or
// overlapping another key's extent, a checksum count other than ceil(size /
// checksum_block_bytes), or bytes left over after the last key. Memory used is
// bounded by a small multiple of bytes.size().
Result<SwapIndex> DecodeSwapIndex(std::string_view bytes, const std::string &label);

// XXH3-64 as used by the trailer (exposed so tests can reseal a hand-edited
// index).
uint64_t SwapIndexChecksum(std::string_view bytes);

}  // namespace memplan::nvme::internal
