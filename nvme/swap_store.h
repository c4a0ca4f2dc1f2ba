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
// Thread safety: all methods may be called concurrently; distinct keys proceed in parallel (the
// index is locked only to look up or allocate, never across I/O). Operations on ONE key are not
// queued: any number of Get()s of a key may run together, but a Put() or Erase() of a key that
// another thread is reading or writing, or a Get() of a key being written, fails at once with
// FailedPrecondition naming the key. Such an overlap is an ordering bug in the caller (a read
// racing the write it needs), and failing loudly beats returning torn or stale data silently.
// Close() fails with FailedPrecondition while any operation is in flight; after Close() every
// other method fails with FailedPrecondition.
//
// Durability. The index (key -> extent, size, checksums) lives in memory and is written to
// `kIndexFileName` by Sync() (and by Close() with `keep_files`): the data file is fdatasynced
// first, then the index replaced atomically (temp file + fsync + rename + directory fsync). A store
// opened with `open_existing` loads the last synced index, so after a crash it finds every key as
// of the last Sync(). A key rewritten in place after that Sync() keeps its old checksums in the
// index, so reading it reports DataLoss rather than returning torn bytes (or its old value, if none
// of the new bytes reached the file): callers that need the previous value to survive a crash (the
// optimizer swapper) write new values under new keys and Sync() at their commit points. Keys
// created after the last Sync() are absent on reopen; their extents are free. Keys erased or moved
// (re-Put with another rounded size) after it come back with their synced extent: their old value
// if those bytes were not reused since, else DataLoss. The index file is checked on load (magic,
// version, its own XXH3-64, every extent inside the data file, aligned and not overlapping
// another, sizes and checksum counts consistent): a bad index is DataLoss naming the file. The
// memory backend keeps the bytes in the process only, so a store reopened on it reads no values
// back (I/O errors); reopening is for the kernel-backed backends.
// Sync(Durability::kProcessCrash) commits for a process that may be killed but a machine that
// stays up: the index is written and renamed, with no fdatasync of the data file and no fsync of
// the index (Note [Durability levels] in common/file.cc). The values it describes have finished
// writing, so the kernel holds them whoever dies; a power loss or kernel crash before a later
// kPowerLoss Sync() may lose any of them, or the rename, and a reopened store then reads each
// value as one it held at some commit or as DataLoss (every block is checksummed), never as a mix
// that passes its checksums.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/durability.h"
#include "common/status.h"
#include "nvme/backend.h"
#include "nvme/io_engine.h"

namespace memplan::nvme {

struct SwapStoreOptions {
  std::string directory;                    // created if absent (0700); must not be shared
  uint64_t capacity_bytes = 0;              // preallocated up front; > 0
  uint32_t checksum_block_bytes = 1 << 20;  // one XXH3-64 checksum per this many bytes
  bool direct = true;                       // O_DIRECT, falling back to buffered when refused
  bool keep_files = false;                  // leave the files on Close (for restart after a crash)
  // Open a store left by an earlier run (its directory, data file and index must exist; the data
  // file's size must be `capacity_bytes` rounded up to 4 KiB, as Open() created it, or
  // `capacity_bytes` may be 0 to take it from the file; `checksum_block_bytes` must match the
  // index). Without it, Open() refuses a directory that already holds a data file (and deletes an
  // index file found there without one: it describes bytes that are gone). A reopened store keeps
  // its files on Close() only if `keep_files` is set, as for a new one.
  bool open_existing = false;
  BackendKind backend = BackendKind::kAuto;
  BackendOptions backend_options;
  IoEngineOptions engine_options;

  Status Validate() const;
};

// Latency of successful operations. `count` and `max_us` cover the store's lifetime; the
// percentiles cover the most recent SwapStore::kLatencyWindow operations, so a long run reports
// its current behaviour at a bounded memory cost.
struct LatencyStats {
  uint64_t count = 0;
  double p50_us = 0, p90_us = 0, p99_us = 0, max_us = 0;
};

struct SwapStoreStats {
  uint64_t capacity_bytes = 0;
  uint64_t used_bytes = 0;  // allocated extents
  uint64_t keys = 0;
  uint64_t put_bytes = 0, get_bytes = 0;  // successful operations only
  uint64_t puts = 0, gets = 0;            // gets (and get_latency, get_bytes) include GetRange()
  LatencyStats put_latency, get_latency;
  IoStats io;
  std::string backend;           // which backend runs it
  std::string backend_note;      // why that backend (CreateBackend's note); may be empty
  bool direct = false;           // O_DIRECT in use
  uint32_t alignment_bytes = 0;  // extents start and end on multiples of this
  uint32_t io_threads = 1;       // engine_options.threads: threads one transfer is split across
  uint32_t io_backends = 1;      // backends (rings, contexts) those threads use
  uint64_t registered_buffer_bytes = 0;  // bytes registered through RegisterBuffers (in use)
};

class SwapStore {
 public:
  // Names of the store's files inside SwapStoreOptions::directory.
  static constexpr const char* kDataFileName = "memplan-swap.data";
  static constexpr const char* kLockFileName = "memplan-swap.lock";
  static constexpr const char* kIndexFileName = "memplan-swap.index";
  // Longest key Put() accepts (the index file stores keys up to this length).
  static constexpr size_t kMaxKeyBytes = 4096;
  // Latency samples kept per operation kind for the percentiles in stats().
  static constexpr size_t kLatencyWindow = 4096;

  // Opens (creating) a store. Errors: invalid options; directory not ours or a symlink; store
  // locked by another process (FailedPrecondition naming the pid in the lock file when readable);
  // not enough space (ResourceExhausted with bytes needed and free).
  // With `open_existing`, reopens the store kept in the directory instead; a lock file left by a
  // process that died is taken over (the lock is an flock, which dies with its holder). Errors
  // then also: the directory, data file or index file missing (NotFound; for the index, the
  // store was never synced); the data file not a private regular file owned by this user
  // (FailedPrecondition); `capacity_bytes` or `checksum_block_bytes` not the store's
  // (InvalidArgument naming both values); a corrupt index (DataLoss naming the file and what is
  // wrong). A failed reopen leaves the files as it found them.
  static Result<std::unique_ptr<SwapStore>> Open(const SwapStoreOptions& options);
  // The same, running on a backend the caller made (the store owns it from now on; on error it is
  // destroyed). `options.backend` and `options.backend_options` are then ignored. This is the seam
  // for tests that wrap a real backend in a FaultBackend.
  static Result<std::unique_ptr<SwapStore>> Open(const SwapStoreOptions& options,
                                                 std::unique_ptr<Backend> backend);
  ~SwapStore();

  // Stores `data` under `key`, replacing any earlier value. Errors: no room (ResourceExhausted
  // naming the key, the bytes needed and the bytes free; the earlier value is then kept); the key
  // busy in another thread (FailedPrecondition); a key longer than kMaxKeyBytes
  // (InvalidArgument); an I/O error (the key is then removed, since its bytes on disk are no
  // longer known to be whole).
  Status Put(const std::string& key, std::span<const std::byte> data);
  // Reads the value of `key` into `out`, whose size must equal Size(key) (else InvalidArgument).
  // Errors: NotFound; FailedPrecondition while the key is being written; DataLoss naming the key
  // and the byte offset (within the value) of the first block whose checksum does not match; an
  // I/O error. On error the contents of `out` are unspecified.
  Status Get(const std::string& key, std::span<std::byte> out);
  // Reads `out.size()` bytes of `key`'s value starting at byte `offset` into `out`, verifying only
  // the checksum blocks the range touches (so a small header can be read without reading the
  // whole value); it reads exactly those blocks, using a scratch buffer of at most out.size() + 2
  // blocks when the range does not start and end on block boundaries. Counts as a reader of the
  // key, as Get() does. An empty range at any offset up to the value's size succeeds without I/O.
  // Errors as for Get() (DataLoss only for a bad block inside the range); OutOfRange when the
  // range passes the end of the value.
  Status GetRange(const std::string& key, uint64_t offset, std::span<std::byte> out);
  // Where GetCovering() put the range: its first byte at `buffer[in_buffer]`, `bytes` of it there.
  struct CoveredRange {
    uint64_t in_buffer = 0;
    uint64_t bytes = 0;
  };
  // GetRange() without its scratch buffer and copy, for a caller that can use the range where it
  // lands: reads the checksum blocks that [offset, offset + max_bytes) touches, as many whole
  // blocks as fit in `buffer`, straight into `buffer` (an aligned buffer of a direct store is read
  // without bounce copies), verifies them, and says where the range starts in `buffer` and how
  // much of it is there (less than max_bytes when the blocks do not all fit). Bytes 0 when not
  // even the first block fits (nothing read; use GetRange()) or max_bytes is 0. Errors as for
  // GetRange(); the contents of `buffer` are then unspecified.
  Result<CoveredRange> GetCovering(const std::string& key, uint64_t offset, uint64_t max_bytes,
                                   std::span<std::byte> buffer);
  // Size of the last value stored under `key`; NotFound when there is none.
  Result<uint64_t> Size(const std::string& key) const;
  Status Erase(const std::string& key);   // frees the extent; NotFound when absent
  std::vector<std::string> Keys() const;  // sorted

  // Makes every Put() and Erase() completed so far durable and findable after a crash: fdatasyncs
  // the data file, then atomically replaces the index file (see "Durability" above). Operations
  // still in flight when Sync() is called may or may not be included: a key whose in-flight Put
  // rewrites its extent in place is recorded with its previous value (which then reads as that
  // value or as DataLoss after a crash); a key whose first Put is in flight, or whose Put moved it
  // to a new extent (a different rounded size), is left out. Concurrent Sync()s run one at a time.
  // Errors: FailedPrecondition after Close(); an I/O error (when the fdatasync, the write or the
  // rename fails, the previous index file is still in place; when only the fsync of the directory
  // after the rename fails, the new index is in place but may not survive a power loss);
  // ResourceExhausted when the index would exceed 1 GiB (use larger checksum blocks).
  // kProcessCrash: the same ordering without the flushes (see "Durability" above).
  Status Sync(Durability durability = Durability::kPowerLoss);

  // Registers long-lived buffers (a pinned pool's memory) with the store's backends, so that
  // Get/Put from and into them skip per-request page pinning (io_uring fixed buffers); replaces an
  // earlier registration; empty: none. Errors: FailedPrecondition while any operation is in
  // flight or after Close(); a backend's refusal (ENOMEM: RLIMIT_MEMLOCK), after which no
  // buffers are registered, which costs only speed.
  Status RegisterBuffers(std::span<const iovec> buffers);

  SwapStoreStats stats() const;
  // Releases the backend, the files and the lock. With `keep_files` the data file is fsynced, the
  // index written as by Sync() (not when the fsync failed) and the files stay; otherwise they are
  // removed, the index file too (without an fsync: bytes about to be deleted need not reach the
  // device), and so is the directory if Open() created it and it is now empty (a reopening Open()
  // never creates it).
  // Cleanup runs to the end even when a step fails; the first failure is returned. Idempotent.
  Status Close();

  // FOR TESTS ONLY: the byte offset of `key`'s extent in the data file, so a test can corrupt the
  // bytes on disk and check that Get() notices. Not part of the supported API.
  Result<uint64_t> DebugFileOffset(const std::string& key) const;

 private:
  struct Impl;
  explicit SwapStore(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace memplan::nvme
