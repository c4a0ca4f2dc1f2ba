// Encoder and defensive decoder of the swap index file; see Note [Swap index
// format].
#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <unordered_set>
#include <utility>

#include "common/checked_math.h"
#include "nvme/swap_index_internal.h"

namespace memplan::nvme::internal {
namespace {

// Offset of the key count in the header (patched by Finish()).
constexpr size_t kKeyCountOffset = 32;
constexpr uint64_t kMinAlignBytes = 4096;
constexpr uint64_t kMaxDataFileBytes = uint64_t{1} << 62;

void PutU32(std::string &out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}

void PutU64(std::string &out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}

uint64_t LoadLe(const char *p, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(p[i]);
  return v;
}

// Reads fixed-width fields from the bytes before the trailer; every read is
// bounds-checked and a failed one says which field ran past the end and where.
class Reader {
 public:
  Reader(std::string_view bytes, const std::string &label) : bytes_(bytes), label_(label) {}

  size_t pos() const { return pos_; }
  size_t left() const { return bytes_.size() - pos_; }

  Status U32(const char *field, uint32_t *out) {
    MEMPLAN_RETURN_IF_ERROR(Need(field, 4));
    *out = static_cast<uint32_t>(LoadLe(bytes_.data() + pos_, 4));
    pos_ += 4;
    return Status::Ok();
  }
  Status U64(const char *field, uint64_t *out) {
    MEMPLAN_RETURN_IF_ERROR(Need(field, 8));
    *out = LoadLe(bytes_.data() + pos_, 8);
    pos_ += 8;
    return Status::Ok();
  }
  Status Bytes(const char *field, size_t n, std::string_view *out) {
    MEMPLAN_RETURN_IF_ERROR(Need(field, n));
    *out = bytes_.substr(pos_, n);
    pos_ += n;
    return Status::Ok();
  }

 private:
  Status Need(const char *field, uint64_t n) const {
    if (n <= left()) return Status::Ok();
    return Status::DataLoss(label_ + ": truncated: " + field + " at byte " + std::to_string(pos_) +
                            " needs " + std::to_string(n) + " bytes, " + std::to_string(left()) +
                            " left");
  }

  std::string_view bytes_;
  const std::string &label_;
  size_t pos_ = 0;
};

}  // namespace

uint64_t SwapIndexChecksum(std::string_view bytes) {
  return XXH3_64bits(bytes.data(), bytes.size());
}

SwapIndexEncoder::SwapIndexEncoder(uint64_t data_file_bytes, uint32_t checksum_block_bytes,
                                   uint32_t alignment_bytes) {
  out_.append(kSwapIndexMagic, sizeof(kSwapIndexMagic));
  PutU32(out_, kSwapIndexVersion);
  PutU32(out_, checksum_block_bytes);
  PutU32(out_, alignment_bytes);
  PutU32(out_, 0);
  PutU64(out_, data_file_bytes);
  PutU64(out_, 0);  // key count, patched by Finish()
}

void SwapIndexEncoder::Add(std::string_view key, uint64_t offset, uint64_t extent_bytes,
                           uint64_t size, std::span<const uint64_t> checksums) {
  PutU32(out_, static_cast<uint32_t>(key.size()));
  out_.append(key);
  PutU64(out_, offset);
  PutU64(out_, extent_bytes);
  PutU64(out_, size);
  PutU64(out_, checksums.size());
  for (uint64_t sum : checksums) PutU64(out_, sum);
  ++count_;
}

std::string SwapIndexEncoder::Finish() {
  for (int i = 0; i < 8; ++i) {
    out_[kKeyCountOffset + i] = static_cast<char>((count_ >> (8 * i)) & 0xFF);
  }
  PutU64(out_, SwapIndexChecksum(out_));
  return std::move(out_);
}

std::string EncodeSwapIndex(const SwapIndex &index) {
  SwapIndexEncoder encoder(index.data_file_bytes, index.checksum_block_bytes,
                           index.alignment_bytes);
  for (const SwapIndexEntry &e : index.entries) {
    encoder.Add(e.key, e.offset, e.extent_bytes, e.size, e.checksums);
  }
  return encoder.Finish();
}

Result<SwapIndex> DecodeSwapIndex(std::string_view bytes, const std::string &label) {
  auto bad = [&label](const std::string &what) { return Status::DataLoss(label + ": " + what); };
  if (bytes.size() < kSwapIndexHeaderBytes + kSwapIndexTrailerBytes) {
    return bad("truncated: " + std::to_string(bytes.size()) +
               " bytes, shorter than an empty index (" +
               std::to_string(kSwapIndexHeaderBytes + kSwapIndexTrailerBytes) + " bytes)");
  }
  if (bytes.size() > kMaxSwapIndexBytes) {
    return bad(std::to_string(bytes.size()) + " bytes, larger than any index this store writes (" +
               std::to_string(kMaxSwapIndexBytes) + " bytes)");
  }
  if (std::memcmp(bytes.data(), kSwapIndexMagic, sizeof(kSwapIndexMagic)) != 0) {
    return bad("not a memplan swap index (bad magic)");
  }
  const uint32_t version = static_cast<uint32_t>(LoadLe(bytes.data() + 8, 4));
  if (version != kSwapIndexVersion) {
    return bad("format version " + std::to_string(version) + ", this build reads version " +
               std::to_string(kSwapIndexVersion));
  }
  const std::string_view body = bytes.substr(0, bytes.size() - kSwapIndexTrailerBytes);
  const uint64_t stored_sum = LoadLe(bytes.data() + body.size(), 8);
  if (SwapIndexChecksum(body) != stored_sum) {
    return bad("checksum mismatch (the file is corrupt or was truncated)");
  }

  Reader r(body, label);
  SwapIndex index;
  std::string_view magic;
  uint32_t version_again = 0;
  uint32_t reserved = 0;
  uint64_t key_count = 0;
  MEMPLAN_RETURN_IF_ERROR(r.Bytes("magic", sizeof(kSwapIndexMagic), &magic));
  MEMPLAN_RETURN_IF_ERROR(r.U32("version", &version_again));
  MEMPLAN_RETURN_IF_ERROR(r.U32("checksum block size", &index.checksum_block_bytes));
  MEMPLAN_RETURN_IF_ERROR(r.U32("alignment", &index.alignment_bytes));
  MEMPLAN_RETURN_IF_ERROR(r.U32("reserved field", &reserved));
  MEMPLAN_RETURN_IF_ERROR(r.U64("data file size", &index.data_file_bytes));
  MEMPLAN_RETURN_IF_ERROR(r.U64("key count", &key_count));

  const uint64_t block = index.checksum_block_bytes;
  const uint64_t align = index.alignment_bytes;
  if (reserved != 0) return bad("reserved header field is " + std::to_string(reserved) + ", not 0");
  if (block < kMinAlignBytes || !IsPowerOfTwo(block)) {
    return bad("checksum block size " + std::to_string(block) +
               " is not a power of two of at least 4096");
  }
  if (align < kMinAlignBytes || !IsPowerOfTwo(align)) {
    return bad("alignment " + std::to_string(align) + " is not a power of two of at least 4096");
  }
  if (index.data_file_bytes == 0 || index.data_file_bytes % kMinAlignBytes != 0 ||
      index.data_file_bytes > kMaxDataFileBytes) {
    return bad("data file size " + std::to_string(index.data_file_bytes) +
               " is not a positive multiple of 4096 up to 2^62");
  }
  const uint64_t usable_bytes = index.data_file_bytes / align * align;
  // Every key takes at least its fixed fields, so the count is bounded by the
  // bytes left.
  if (key_count > r.left() / kSwapIndexEntryFixedBytes) {
    return bad("key count " + std::to_string(key_count) + " does not fit in the " +
               std::to_string(r.left()) + " bytes that follow the header");
  }
  index.entries.reserve(static_cast<size_t>(key_count));
  std::unordered_set<std::string_view> seen;
  seen.reserve(static_cast<size_t>(key_count));

  for (uint64_t i = 0; i < key_count; ++i) {
    const std::string where =
        "key #" + std::to_string(i) + " (at byte " + std::to_string(r.pos()) + ")";
    uint32_t key_bytes = 0;
    MEMPLAN_RETURN_IF_ERROR(r.U32("key length", &key_bytes));
    if (key_bytes > kMaxSwapIndexKeyBytes) {
      return bad(where + ": key length " + std::to_string(key_bytes) + " exceeds the limit of " +
                 std::to_string(kMaxSwapIndexKeyBytes));
    }
    std::string_view key;
    MEMPLAN_RETURN_IF_ERROR(r.Bytes("key", key_bytes, &key));
    SwapIndexEntry e;
    uint64_t checksum_count = 0;
    MEMPLAN_RETURN_IF_ERROR(r.U64("extent offset", &e.offset));
    MEMPLAN_RETURN_IF_ERROR(r.U64("extent size", &e.extent_bytes));
    MEMPLAN_RETURN_IF_ERROR(r.U64("value size", &e.size));
    MEMPLAN_RETURN_IF_ERROR(r.U64("checksum count", &checksum_count));
    const std::string named = where + " '" + std::string(key) + "'";
    if (!seen.insert(key).second) return bad(named + ": appears twice");
    if (e.size > usable_bytes) {
      return bad(named + ": value size " + std::to_string(e.size) + " exceeds the data file's " +
                 std::to_string(usable_bytes) + " usable bytes");
    }
    const uint64_t want_extent = (e.size + align - 1) / align * align;  // no overflow: size < 2^62
    if (e.extent_bytes != want_extent) {
      return bad(named + ": extent of " + std::to_string(e.extent_bytes) + " bytes for a " +
                 std::to_string(e.size) + "-byte value (expected " + std::to_string(want_extent) +
                 ")");
    }
    if (e.offset % align != 0 || e.offset > usable_bytes ||
        e.extent_bytes > usable_bytes - e.offset) {
      return bad(named + ": extent [" + std::to_string(e.offset) + ", +" +
                 std::to_string(e.extent_bytes) + ") is unaligned or outside the data file's " +
                 std::to_string(usable_bytes) + " usable bytes (alignment " +
                 std::to_string(align) + ")");
    }
    const uint64_t want_sums = (e.size + block - 1) / block;
    if (checksum_count != want_sums) {
      return bad(named + ": " + std::to_string(checksum_count) + " checksums for a " +
                 std::to_string(e.size) + "-byte value (expected " + std::to_string(want_sums) +
                 ")");
    }
    // Bounded by the bytes left (checked before the reserve, so a lying count
    // allocates nothing).
    if (checksum_count > r.left() / 8) {
      return bad(named + ": " + std::to_string(checksum_count) +
                 " checksums run past the end of the file");
    }
    e.checksums.resize(static_cast<size_t>(checksum_count));
    for (uint64_t &sum : e.checksums) MEMPLAN_RETURN_IF_ERROR(r.U64("checksum", &sum));
    e.key.assign(key);
    index.entries.push_back(std::move(e));
  }
  if (r.left() != 0) {
    return bad(std::to_string(r.left()) + " unexpected bytes after the last key (at byte " +
               std::to_string(r.pos()) + ")");
  }

  // No two non-empty extents may share a byte (empty values own no extent).
  std::vector<const SwapIndexEntry *> by_offset;
  by_offset.reserve(index.entries.size());
  for (const SwapIndexEntry &e : index.entries) {
    if (e.extent_bytes > 0) by_offset.push_back(&e);
  }
  std::sort(by_offset.begin(), by_offset.end(),
            [](const SwapIndexEntry *a, const SwapIndexEntry *b) { return a->offset < b->offset; });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const SwapIndexEntry &prev = *by_offset[i - 1];
    const SwapIndexEntry &next = *by_offset[i];
    if (prev.offset + prev.extent_bytes > next.offset) {
      return bad("the extents of keys '" + prev.key + "' [" + std::to_string(prev.offset) + ", +" +
                 std::to_string(prev.extent_bytes) + ") and '" + next.key + "' [" +
                 std::to_string(next.offset) + ", +" + std::to_string(next.extent_bytes) +
                 ") overlap");
    }
  }
  return index;
}

}  // namespace memplan::nvme::internal
