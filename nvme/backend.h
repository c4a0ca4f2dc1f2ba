// nvme::Backend: the storage seam. One small asynchronous contract that io_uring, libaio, a POSIX
// thread pool, an in-memory store and a fault-injecting wrapper all implement, so everything above
// (IoEngine, SwapStore, the offload engine) is written and tested once.
//
// Contract (fio-style queued / completed / busy):
//   - The caller owns every Request and its buffer until the request is reaped. Backends never
//     allocate per request: queues are sized at creation (`BackendOptions::queue_depth`).
//   - Submit() takes as many of the given requests as fit and returns how many it took (a prefix
//     of the span). Taking fewer than offered is "busy", not an error: reap, then submit the rest.
//     A non-OK Status means the backend itself is broken (ring setup lost, worker died).
//   - Reap() returns completions. Each carries the request and its result: bytes transferred
//     (>= 0), or -errno. A result smaller than the request's length is a SHORT TRANSFER: a normal
//     outcome the caller (IoEngine) resubmits for the remainder; backends never hide or retry it.
//     Likewise -EINTR / -EAGAIN are reported, not retried, by backends.
//   - A request is reported complete exactly once, and only after the data is in the caller's
//     buffer (reads) or handed to the kernel/device (writes).
//
// Thread safety: Submit() and Reap() may be called concurrently from any number of threads;
// implementations serialise internally (submission side and completion side under separate
// locks). RegisterFile/UnregisterFile must not race with in-flight requests on that file.
#pragma once

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "schedule/enums.h"

namespace memplan::nvme {

enum class OpType : uint8_t { kRead, kWrite, kFsync };
std::string_view OpTypeName(OpType op);  // "read", "write", "fsync"

struct Request {
  OpType op = OpType::kRead;
  int file = -1;           // index returned by Backend::RegisterFile
  uint64_t offset = 0;     // byte offset in the file
  void* buffer = nullptr;  // caller-owned; aligned to Capabilities::alignment for direct I/O
  uint32_t length = 0;     // bytes; 0 for kFsync
  int buffer_index = -1;   // index of a registered buffer containing `buffer`, or -1
  uint64_t user_data = 0;  // opaque to the backend
};

struct Completion {
  Request* request = nullptr;
  int64_t result = 0;  // bytes transferred (may be < length: short transfer), or -errno
};

struct Capabilities {
  std::string name;                 // "io_uring", "libaio", "posix", "memory", "fault(<inner>)"
  bool asynchronous = false;        // true when the kernel does the I/O without our threads
  bool registered_buffers = false;  // RegisterBuffers() does something
  bool registered_files = false;
  bool sqpoll = false;       // io_uring kernel submission thread in use
  uint32_t queue_depth = 0;  // most requests in flight at once
  // What was asked for and not granted, and why (e.g. "SQPOLL refused: Operation not permitted");
  // empty when everything asked for is in use.
  std::string note;
};

// BackendKind (auto, uring, aio, posix, memory) and its names are in schedule/enums.h: a Schedule
// names one.

struct BackendOptions {
  uint32_t queue_depth = 32;  // requests in flight; 1..4096
  bool sqpoll = false;        // io_uring only: ask for a kernel submission thread; falls back
  // io_uring only: register the files in a fixed-file table (the kernel skips the fd lookup and
  // reference per request). Default on; off only to measure what it gains.
  bool fixed_files = true;
  // io_uring only: most requests handed to the kernel per io_uring_enter; 0 (default): every
  // request that fits goes in one call (batched submission). 1 submits them one by one, for
  // measuring what batching gains.
  uint32_t submit_batch = 0;
  uint32_t posix_threads = 4;  // POSIX backend worker threads; 1..256
  // The file (or the directory that will hold it) the backend will serve, when known. kAuto
  // then looks at its filesystem: see Note [Memory filesystems] in backend.cc. Empty: not known.
  std::string path;

  Status Validate() const;
};

class Backend {
 public:
  virtual ~Backend() = default;
  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;

  virtual const Capabilities& capabilities() const = 0;

  // Takes a file descriptor the caller opened (and still owns) and returns the index requests use.
  // The kernel-backed backends refuse an fd that is not open (an error naming the fd), and
  // complete a request naming an index that is not (or no longer) registered with -EBADF.
  virtual Result<int> RegisterFile(int fd) = 0;
  virtual Status UnregisterFile(int file) = 0;
  // Optional: pins buffers for zero-copy submission (io_uring fixed buffers). Replaces any earlier
  // registration. Backends without the capability accept and ignore it.
  virtual Status RegisterBuffers(std::span<const iovec> buffers) = 0;

  // See the contract above. Returns the number of requests taken, a prefix of `requests`.
  virtual Result<size_t> Submit(std::span<Request* const> requests) = 0;
  // Waits until at least `min_complete` completions are available (0: do not wait; it is clamped
  // to the number in flight so it never waits forever), then returns up to out.size() of them.
  virtual Result<size_t> Reap(std::span<Completion> out, size_t min_complete) = 0;
  // Requests submitted and not yet reaped.
  virtual size_t in_flight() const = 0;

 protected:
  Backend() = default;
};

// What CreateBackend chose and why (the caller decides whether and where to log it).
struct BackendChoice {
  std::unique_ptr<Backend> backend;
  BackendKind kind = BackendKind::kAuto;
  std::string note;  // e.g. "io_uring unavailable (EPERM: disabled by sysctl); using libaio"
};

// kAuto probes io_uring -> libaio -> POSIX at run time (and what this build has); for a
// `options.path` on a memory filesystem (tmpfs, ramfs) libaio comes first (Note [Memory
// filesystems] in backend.cc). An explicit kind that cannot be set up is an error saying why.
// kMemory is the in-memory test backend.
Result<BackendChoice> CreateBackend(BackendKind kind, const BackendOptions& options);

// Backends for an IoEngine of `threads` threads (1..64): one per thread, all of the kind
// CreateBackend picks for `kind` (kAuto probes once), so that each thread has its own io_uring ring
// or libaio context, as DeepSpeed gives each of its threads. The memory backend keeps a file's
// bytes inside one backend object, so for kMemory there is one, which the threads share.
struct BackendSet {
  std::vector<std::unique_ptr<Backend>> backends;  // at least one
  BackendKind kind = BackendKind::kAuto;
  std::string note;  // CreateBackend's, for the first
  std::vector<Backend*> pointers() const;
};
Result<BackendSet> CreateBackends(BackendKind kind, const BackendOptions& options,
                                  uint32_t threads);

// Individual constructors (each returns Unimplemented/FailedPrecondition when unavailable).
Result<std::unique_ptr<Backend>> CreateUringBackend(const BackendOptions& options);
Result<std::unique_ptr<Backend>> CreateAioBackend(const BackendOptions& options);
Result<std::unique_ptr<Backend>> CreatePosixBackend(const BackendOptions& options);
// Files for the memory backend are fds of anything; data lives in memory keyed by file index.
Result<std::unique_ptr<Backend>> CreateMemoryBackend(const BackendOptions& options);

// True when `path` (or, when it does not exist yet, its directory) is on tmpfs or ramfs.
bool OnMemoryFilesystem(const std::string& path);

// Opens `path` for the engine. With `direct`, tries O_DIRECT and falls back to buffered I/O when
// the filesystem refuses it (EINVAL: tmpfs, some network filesystems); `*direct_used` says which.
// A non-empty file is also probed with one aligned O_DIRECT read at offset 0, because some
// filesystems accept O_DIRECT at open and refuse the I/O; an empty file is taken as opened.
// Errors name the path. The fd is O_CLOEXEC; the caller closes it.
struct OpenOptions {
  bool create = false;     // O_CREAT (mode 0600)
  bool exclusive = false;  // O_EXCL (with create)
  bool truncate = false;
  bool write = true;  // O_RDWR, else O_RDONLY
  bool direct = true;
  bool nofollow = true;  // O_NOFOLLOW: refuse a symlink at the final component
};
Result<int> OpenFile(const std::string& path, const OpenOptions& options, bool* direct_used);

// Alignment O_DIRECT needs for buffers, offsets and lengths on `fd` (logical block size; 4096 when
// it cannot be found). 1 for buffered fds.
uint32_t DirectIoAlignment(int fd, bool direct);

}  // namespace memplan::nvme
