// nvme::IoEngine: large reads and writes at device speed on top of any Backend.
//
// A transfer of any byte length at any offset is split into `block_size` pieces kept in flight up
// to the backend's queue depth. Short transfers are resubmitted for the remainder; -EINTR and
// -EAGAIN are retried (bounded); any other error fails the whole transfer with a Status naming the
// operation, the file's label, the offset and the errno. Nothing is reported complete that is not.
//
// O_DIRECT alignment is the engine's job: when a caller's buffer, offset or length is not aligned
// to the file's alignment, the unaligned head/tail go through pre-allocated aligned bounce buffers
// (read-modify-write for writes), so callers may pass any byte length.
//
// Edge cases callers should know:
//   - If the backend's own Reap() fails, that error is returned even though requests may still be
//     in flight (waiting could hang), and the engine refuses all further I/O (FailedPrecondition).
//   - A direct write whose unaligned end lies past the end of the file extends the file with zeros
//     up to the next alignment boundary.
//   - Two concurrent unaligned writes touching the same alignment block must be ordered by the
//     caller (each does a read-modify-write of that block).
//
// Parallel transfers (DeepSpeed's intra_op_parallelism): with `threads` T > 1, a Read or Write of
// at least two blocks is cut into up to T contiguous slices whose boundaries fall on the file's
// alignment (so no two slices share an alignment block), and each slice is driven by its own
// thread, the caller's included, each on its own backend when the engine was given several (one
// io_uring ring or libaio context per thread). Where one thread cannot keep the device busy (a
// memory-backed file, where the kernel copies in the submitting thread; a RAID-0 of NVMe drives)
// this multiplies the bandwidth. See Note [Parallel slices] in io_engine.cc.
//
// Registered buffers: RegisterBuffers() hands long-lived caller memory (a pinned pool) to every
// backend (io_uring fixed buffers); requests whose bytes lie inside a registered region then name
// it, and the kernel skips pinning the pages per request.
//
// Thread safety: one IoEngine may be used by several threads at once; each call of Read/Write
// blocks its thread until its own transfer completes. Completions of one thread's requests may be
// reaped by another; the engine routes them (one thread at a time reaps for all).
// RegisterBuffers() must not run while a transfer is in flight.
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"
#include "nvme/backend.h"

namespace memplan::nvme {

struct IoEngineOptions {
  uint32_t block_size = 1 << 20;  // bytes per request; a multiple of 4096, 4 KiB..64 MiB
  uint32_t max_retries = 16;      // per request, for -EINTR / -EAGAIN / zero-progress short I/O
  // Threads one transfer is split across (DeepSpeed's aio.intra_op_parallelism), the caller's
  // included: 1..64. The engine starts threads - 1 workers of its own. Default 1.
  uint32_t threads = 1;

  Status Validate() const;
};

struct IoStats {
  uint64_t read_bytes = 0;  // includes reads done to merge unaligned writes
  uint64_t write_bytes = 0;
  uint64_t read_ops = 0;  // backend requests
  uint64_t write_ops = 0;
  uint64_t short_transfers = 0;  // resubmitted remainders
  uint64_t retries = 0;          // EINTR / EAGAIN, and zero-progress write retries
  uint64_t bounce_bytes = 0;     // bytes that went through bounce buffers (unaligned callers)
  uint64_t split_transfers = 0;  // Read/Write calls cut into parallel slices
  uint64_t registered_ops = 0;   // requests that named a registered buffer
};

// `bytes` of memory at `base` cut into the regions one registration takes (io_uring: at most
// 1 GiB a buffer), for IoEngine::RegisterBuffers / SwapStore::RegisterBuffers.
std::vector<iovec> RegistrationRegions(void* base, uint64_t bytes);

class IoEngine {
 public:
  // The engine does not own the backend; it must outlive the engine.
  static Result<std::unique_ptr<IoEngine>> Create(Backend* backend, const IoEngineOptions& options);
  // The same over several backends of one kind (not owned; at least one, at most
  // options.threads): slice k of a split transfer runs on backends[k % size]. Backends whose files
  // are separate stores (the memory backend) must not be given more than once: give one, which
  // the threads then share.
  static Result<std::unique_ptr<IoEngine>> Create(std::span<Backend* const> backends,
                                                  const IoEngineOptions& options);
  ~IoEngine();

  // Registers an open fd. `label` names the file in errors (usually its path). `direct` says the fd
  // was opened with O_DIRECT (then alignment rules apply; see DirectIoAlignment).
  Result<int> AddFile(int fd, std::string label, bool direct);
  Status RemoveFile(int file);

  // Blocking transfers of exactly `length` bytes; a read past the end of the file is an error
  // (OutOfRange) naming the file and offset.
  Status Read(int file, uint64_t offset, void* buffer, uint64_t length);
  Status Write(int file, uint64_t offset, const void* buffer, uint64_t length);
  Status Sync(int file);

  // Registers long-lived buffers with every backend (replacing an earlier registration; empty:
  // none). Backends without the capability ignore it. Fails when a backend refuses (ENOMEM:
  // RLIMIT_MEMLOCK); the engine then uses no registered buffers, which only costs speed.
  Status RegisterBuffers(std::span<const iovec> buffers);

  IoStats stats() const;
  Backend* backend() const;  // the first backend
  uint32_t threads() const;
  size_t backend_count() const;

 private:
  struct Impl;
  explicit IoEngine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace memplan::nvme
