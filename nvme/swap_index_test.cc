// The swap index decoder against corrupt and hostile files: it must say DataLoss, name the file
// and what is wrong, never crash, and never allocate more than the file's size justifies.
#include <doctest/doctest.h>

#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include "nvme/swap_index_internal.h"
#include "tests/status_testing.h"

namespace memplan::nvme::internal {
namespace {

constexpr uint32_t kBlock = 4096;
constexpr uint32_t kAlign = 4096;
constexpr uint64_t kFileBytes = 64 * 4096;
const std::string kLabel = "/some/dir/memplan-swap.index";

// Offsets in the header (Note [Swap index format]).
constexpr size_t kVersionAt = 8;
constexpr size_t kBlockAt = 12;
constexpr size_t kAlignAt = 16;
constexpr size_t kReservedAt = 20;
constexpr size_t kFileBytesAt = 24;
constexpr size_t kCountAt = 32;

SwapIndexEntry Entry(std::string key, uint64_t offset, uint64_t size) {
  SwapIndexEntry e;
  e.key = std::move(key);
  e.offset = offset;
  e.size = size;
  e.extent_bytes = (size + kAlign - 1) / kAlign * kAlign;
  for (uint64_t at = 0; at < size; at += kBlock) e.checksums.push_back(0x1000 + at);
  return e;
}

SwapIndex Sample() {
  SwapIndex index;
  index.data_file_bytes = kFileBytes;
  index.checksum_block_bytes = kBlock;
  index.alignment_bytes = kAlign;
  index.entries.push_back(Entry("alpha", 0, 3 * kBlock + 17));
  index.entries.push_back(Entry("", 0, 0));  // empty key, empty value: no extent
  index.entries.push_back(Entry("gamma", 8 * kAlign, kBlock));
  index.entries.push_back(Entry(std::string(kMaxSwapIndexKeyBytes, 'k'), 20 * kAlign, 1));
  return index;
}

void PutLe(std::string& bytes, size_t at, uint64_t v, int width) {
  for (int i = 0; i < width; ++i) bytes[at + i] = static_cast<char>((v >> (8 * i)) & 0xFF);
}

// Recomputes the trailer so a hand-edited file gets past the checksum to the field checks.
std::string Reseal(std::string bytes) {
  const size_t body = bytes.size() - kSwapIndexTrailerBytes;
  PutLe(bytes, body, SwapIndexChecksum(std::string_view(bytes).substr(0, body)), 8);
  return bytes;
}

// Decodes `bytes`, requiring DataLoss whose message names the file and contains `what`.
void RequireDataLoss(const std::string& bytes, std::string_view what) {
  Result<SwapIndex> r = DecodeSwapIndex(bytes, kLabel);
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().code() == StatusCode::kDataLoss);
  CHECK_MESSAGE(r.status().message().rfind(kLabel + ": ", 0) == 0, r.status().message());
  CHECK_MESSAGE(r.status().message().find(what) != std::string::npos, r.status().message());
}

TEST_CASE("swap index: encode then decode gives back every field") {
  const SwapIndex in = Sample();
  const std::string bytes = EncodeSwapIndex(in);
  CHECK(bytes.size() == kSwapIndexHeaderBytes + kSwapIndexTrailerBytes +
                            4 * kSwapIndexEntryFixedBytes + 5 + 5 + kMaxSwapIndexKeyBytes +
                            8 * (4 + 0 + 1 + 1));
  Result<SwapIndex> out = DecodeSwapIndex(bytes, kLabel);
  REQUIRE_MESSAGE(out.ok(), out.status().ToString());
  CHECK(out->data_file_bytes == in.data_file_bytes);
  CHECK(out->checksum_block_bytes == in.checksum_block_bytes);
  CHECK(out->alignment_bytes == in.alignment_bytes);
  REQUIRE(out->entries.size() == in.entries.size());
  for (size_t i = 0; i < in.entries.size(); ++i) {
    CAPTURE(i);
    CHECK(out->entries[i].key == in.entries[i].key);
    CHECK(out->entries[i].offset == in.entries[i].offset);
    CHECK(out->entries[i].extent_bytes == in.entries[i].extent_bytes);
    CHECK(out->entries[i].size == in.entries[i].size);
    CHECK(out->entries[i].checksums == in.entries[i].checksums);
  }

  SwapIndex empty;
  empty.data_file_bytes = kFileBytes;
  empty.checksum_block_bytes = 1 << 20;
  empty.alignment_bytes = 1 << 16;
  Result<SwapIndex> none = DecodeSwapIndex(EncodeSwapIndex(empty), kLabel);
  REQUIRE_OK(none);
  CHECK(none->entries.empty());
  CHECK(none->alignment_bytes == 1 << 16);
}

TEST_CASE("swap index: every truncation is DataLoss") {
  const std::string bytes = EncodeSwapIndex(Sample());
  for (size_t n = 0; n < bytes.size(); ++n) {
    CAPTURE(n);
    Result<SwapIndex> r = DecodeSwapIndex(std::string_view(bytes).substr(0, n), kLabel);
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().code() == StatusCode::kDataLoss);
  }
  RequireDataLoss(bytes.substr(0, 10), "truncated: 10 bytes");
  // Resealed truncations get past the checksum: the length checks catch them.
  std::string cut = bytes.substr(0, kSwapIndexHeaderBytes + 40);
  cut.append(8, '\0');
  PutLe(cut, kCountAt, 1, 8);
  PutLe(cut, kSwapIndexHeaderBytes, 100, 4);  // the first key's length
  RequireDataLoss(Reseal(cut), "truncated: key at byte 44 needs 100 bytes, 36 left");
  PutLe(cut, kCountAt, 2, 8);
  RequireDataLoss(Reseal(cut), "key count 2 does not fit in the 40 bytes that follow the header");
}

TEST_CASE("swap index: every flipped byte is DataLoss") {
  const std::string bytes = EncodeSwapIndex(Sample());
  for (size_t at = 0; at < bytes.size(); ++at) {
    for (unsigned char mask : {0x01, 0x80}) {
      std::string bad = bytes;
      bad[at] = static_cast<char>(bad[at] ^ mask);
      Result<SwapIndex> r = DecodeSwapIndex(bad, kLabel);
      if (r.ok() || r.status().code() != StatusCode::kDataLoss) {
        FAIL_CHECK("byte " << at << " mask " << int{mask} << ": " << r.status().ToString());
      }
    }
  }
  std::string bad = bytes;
  bad[kSwapIndexHeaderBytes + 3] ^= 0x04;
  RequireDataLoss(bad, "checksum mismatch");
  bad = bytes;
  bad[0] = 'X';
  RequireDataLoss(bad, "bad magic");
}

TEST_CASE("swap index: header fields out of range are DataLoss naming the field") {
  const std::string bytes = EncodeSwapIndex(Sample());
  struct Case {
    size_t at;
    int width;
    uint64_t value;
    const char* what;
  };
  const std::vector<Case> cases = {
      {kVersionAt, 4, 2, "format version 2, this build reads version 1"},
      {kBlockAt, 4, 0, "checksum block size 0 is not a power of two"},
      {kBlockAt, 4, 3 * 4096, "checksum block size 12288"},
      {kBlockAt, 4, 2048, "checksum block size 2048"},
      {kAlignAt, 4, 512, "alignment 512"},
      {kAlignAt, 4, 4097, "alignment 4097"},
      {kReservedAt, 4, 1, "reserved header field is 1"},
      {kFileBytesAt, 8, 0, "data file size 0"},
      {kFileBytesAt, 8, kFileBytes + 1, "is not a positive multiple of 4096"},
      {kFileBytesAt, 8, uint64_t{1} << 63, "is not a positive multiple of 4096"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.what);
    std::string bad = bytes;
    PutLe(bad, c.at, c.value, c.width);
    RequireDataLoss(Reseal(bad), c.what);
  }
  // The version is checked before the trailer, so a file of another version says so even though
  // its trailer may be computed differently.
  std::string unsealed = bytes;
  PutLe(unsealed, kVersionAt, 9, 4);
  RequireDataLoss(unsealed, "format version 9");
}

TEST_CASE("swap index: huge counts and lengths are refused before anything is allocated") {
  const std::string bytes = EncodeSwapIndex(Sample());
  for (uint64_t count : {uint64_t{5}, uint64_t{1} << 40, std::numeric_limits<uint64_t>::max()}) {
    CAPTURE(count);
    std::string bad = bytes;
    PutLe(bad, kCountAt, count, 8);
    // 5 fits by size but runs out of bytes at the fifth key; the others do not fit at all.
    RequireDataLoss(Reseal(bad), count == 5 ? "truncated: key length" : "does not fit");
  }
  std::string fewer = bytes;
  PutLe(fewer, kCountAt, 3, 8);
  RequireDataLoss(Reseal(fewer), "unexpected bytes after the last key");

  // The first key's length, then its checksum count.
  const size_t key_len_at = kSwapIndexHeaderBytes;
  for (uint32_t len : {uint32_t{kMaxSwapIndexKeyBytes + 1}, std::numeric_limits<uint32_t>::max()}) {
    std::string bad = bytes;
    PutLe(bad, key_len_at, len, 4);
    RequireDataLoss(Reseal(bad), "exceeds the limit of 4096");
  }
  const size_t count_at = key_len_at + 4 + 5 + 3 * 8;
  std::string bad = bytes;
  PutLe(bad, count_at, std::numeric_limits<uint64_t>::max(), 8);
  RequireDataLoss(Reseal(bad), "checksums for a 12305-byte value (expected 4)");

  // A value size that would need more checksums than the file holds, consistently declared.
  SwapIndex big = Sample();
  big.data_file_bytes = uint64_t{1} << 40;
  big.entries.resize(1);
  big.entries[0].size = uint64_t{1} << 39;
  big.entries[0].extent_bytes = uint64_t{1} << 39;
  big.entries[0].checksums.assign(2, 0);
  std::string lying = EncodeSwapIndex(big);
  PutLe(lying, count_at, (uint64_t{1} << 39) / kBlock, 8);
  RequireDataLoss(Reseal(lying), "checksums run past the end of the file");
}

TEST_CASE("swap index: inconsistent entries are DataLoss naming the key") {
  struct Case {
    const char* name;
    SwapIndex index;
    const char* what;
  };
  std::vector<Case> cases;
  auto with = [&](const char* name, const char* what, auto edit) {
    SwapIndex index = Sample();
    edit(index);
    cases.push_back({name, std::move(index), what});
  };
  with("overlap", "'alpha' [0, +16384) and 'gamma' [12288, +4096) overlap",
       [](SwapIndex& x) { x.entries[2].offset = 3 * kAlign; });
  with("same extent", "overlap", [](SwapIndex& x) { x.entries[2].offset = 0; });
  with("unaligned", "'gamma': extent [32769, +4096) is unaligned",
       [](SwapIndex& x) { x.entries[2].offset = 8 * kAlign + 1; });
  with("past the end", "outside the data file's 262144 usable bytes",
       [](SwapIndex& x) { x.entries[2].offset = kFileBytes; });
  with("wrapping", "outside",
       [](SwapIndex& x) { x.entries[2].offset = std::numeric_limits<uint64_t>::max() - 4095; });
  with("ends past the end", "'alpha': extent [253952, +16384) is unaligned or outside",
       [](SwapIndex& x) { x.entries[0].offset = kFileBytes - 2 * kAlign; });
  with("extent too small", "extent of 4096 bytes for a 12305-byte value",
       [](SwapIndex& x) { x.entries[0].extent_bytes = kAlign; });
  with("extent too large", "expected 4096", [](SwapIndex& x) { x.entries[2].extent_bytes *= 2; });
  with("size beyond the file", "exceeds the data file's",
       [](SwapIndex& x) { x.entries[2].size = kFileBytes + 1; });
  with("too few checksums", "3 checksums for a 12305-byte value (expected 4)",
       [](SwapIndex& x) { x.entries[0].checksums.pop_back(); });
  with("too many checksums", "2 checksums for a 4096-byte value (expected 1)",
       [](SwapIndex& x) { x.entries[2].checksums.push_back(7); });
  with("duplicate key", "'gamma': appears twice",
       [](SwapIndex& x) { x.entries.push_back(Entry("gamma", 30 * kAlign, 10)); });
  with("partial last alignment block",
       "'tail': extent [262144, +65536) is unaligned or outside "
       "the data file's 262144 usable bytes (alignment 65536)",
       [](SwapIndex& x) {
         // 64 KiB alignment over 260 KiB: the last 4 KiB are not a whole block, so not usable.
         x.alignment_bytes = 1 << 16;
         x.data_file_bytes = kFileBytes + 4096;
         x.entries.assign(1, Entry("tail", kFileBytes, 1));
         x.entries[0].extent_bytes = 1 << 16;
       });
  for (const Case& c : cases) {
    CAPTURE(c.name);
    RequireDataLoss(EncodeSwapIndex(c.index), c.what);
  }
}

}  // namespace
}  // namespace memplan::nvme::internal
