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
// Thread safety: one IoEngine may be used by several threads at once; each call of Read/Write
// blocks its thread until its own transfer completes. Completions of one thread's requests may be
// reaped by another; the engine routes them (one thread at a time reaps for all).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "common/status.h"
#include "nvme/backend.h"

namespace memplan::nvme {

struct IoEngineOptions {
  uint32_t block_size = 1 << 20;  // bytes per request; a multiple of 4096, 4 KiB..64 MiB
  uint32_t max_retries = 16;      // per request, for -EINTR / -EAGAIN / zero-progress short I/O

  Status Validate() const;
};

struct IoStats {
  uint64_t read_bytes = 0;      // includes reads done to merge unaligned writes
  uint64_t write_bytes = 0;
  uint64_t read_ops = 0;        // backend requests
  uint64_t write_ops = 0;
  uint64_t short_transfers = 0; // resubmitted remainders
  uint64_t retries = 0;         // EINTR / EAGAIN, and zero-progress write retries
  uint64_t bounce_bytes = 0;    // bytes that went through bounce buffers (unaligned callers)
};

class IoEngine {
 public:
  // The engine does not own the backend; it must outlive the engine.
  static Result<std::unique_ptr<IoEngine>> Create(Backend* backend, const IoEngineOptions& options);
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

  IoStats stats() const;
  Backend* backend() const;

 private:
  struct Impl;
  explicit IoEngine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace memplan::nvme
