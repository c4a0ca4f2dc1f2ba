// nvme::SwapStore: tensors by key in preallocated files on an NVMe directory, with per-block
// checksums. The offload engine keeps optimizer states and parameters here (ZeRO-Infinity).
//
//   - Open() creates (or verifies it owns) the directory, takes an exclusive lock file so a second
//     process cannot use the same store by mistake, and preallocates `capacity_bytes` with
//     fallocate, so a full disk is reported at open, not mid-training.
//   - Put(key, data) allocates an extent (first fit over free extents, aligned to the block size;
//     a re-Put of the same size reuses the extent) and writes data and checksums; Get(key, out)
//     reads and verifies every checksum block (XXH3-64 over `checksum_block_bytes`); a mismatch
//     is DataLoss naming the key and the byte offset of the bad block.
//   - Close() (and the destructor) removes the store's files unless `keep_files`.
// Files are created 0600 with O_NOFOLLOW | O_EXCL; the directory is created 0700.
//
// Thread safety: all methods may be called concurrently; distinct keys proceed in parallel.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"
#include "nvme/backend.h"
#include "nvme/io_engine.h"

namespace memplan::nvme {

struct SwapStoreOptions {
  std::string directory;               // created if absent (0700); must not be shared
  uint64_t capacity_bytes = 0;         // preallocated up front; > 0
  uint32_t checksum_block_bytes = 1 << 20;  // one XXH3-64 checksum per this many bytes
  bool direct = true;                  // O_DIRECT, falling back to buffered when refused
  bool keep_files = false;             // leave the files on Close (for restart after a crash)
  BackendKind backend = BackendKind::kAuto;
  BackendOptions backend_options;
  IoEngineOptions engine_options;

  Status Validate() const;
};

struct LatencyStats {
  uint64_t count = 0;
  double p50_us = 0, p90_us = 0, p99_us = 0, max_us = 0;
};

struct SwapStoreStats {
  uint64_t capacity_bytes = 0;
  uint64_t used_bytes = 0;       // allocated extents
  uint64_t keys = 0;
  uint64_t put_bytes = 0, get_bytes = 0;
  uint64_t puts = 0, gets = 0;
  LatencyStats put_latency, get_latency;
  IoStats io;
  std::string backend;           // which backend runs it
  bool direct = false;           // O_DIRECT in use
};

class SwapStore {
 public:
  // Opens (creating) a store. Errors: invalid options; directory not ours or a symlink; store
  // locked by another process (FailedPrecondition naming the pid in the lock file when readable);
  // not enough space (ResourceExhausted with bytes needed and free).
  static Result<std::unique_ptr<SwapStore>> Open(const SwapStoreOptions& options);
  ~SwapStore();

  Status Put(const std::string& key, std::span<const std::byte> data);
  Status Get(const std::string& key, std::span<std::byte> out);  // out.size() must equal Size(key)
  Result<uint64_t> Size(const std::string& key) const;
  Status Erase(const std::string& key);  // frees the extent
  std::vector<std::string> Keys() const;

  SwapStoreStats stats() const;
  // Flushes and, unless keep_files, removes the store's files. Idempotent.
  Status Close();

 private:
  struct Impl;
  explicit SwapStore(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace memplan::nvme
