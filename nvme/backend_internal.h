// Private helpers shared by the Backend implementations in nvme/ (backend.cc, posix_backend.cc,
// uring_backend.cc, aio_backend.cc) and their tests. Not part of the public API: nothing outside
// nvme/ includes this header.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "common/mutex.h"
#include "common/status.h"
#include "nvme/backend.h"

namespace memplan::nvme::internal {

// The file table every kernel-backed backend keeps: index (what requests carry) -> fd (what the
// kernel needs). Freed indexes are reused, so a long-lived backend's table stays as small as the
// most files it ever had open at once. Grows only in Add(), never on the I/O path.
//
// Thread safety: none; the owning backend guards it with its submission mutex, which is also the
// lock Submit() holds while it turns indexes into fds.
class FileTable {
 public:
  // Returns the index for `fd`. Fails (EBADF, naming the fd) when `fd` is not an open descriptor,
  // so a bad fd is reported here rather than as a failed request later.
  Result<int> Add(int fd);
  // Fails with InvalidArgument when `index` is not registered.
  Status Remove(int index);
  // The fd behind `index`, or -1 when it is not registered. A request carrying an unknown index
  // is therefore issued against fd -1 and completes with -EBADF, as a closed fd would.
  int Fd(int index) const {
    return index >= 0 && static_cast<size_t>(index) < fds_.size() ? fds_[index] : -1;
  }
  size_t size() const { return fds_.size(); }

 private:
  std::vector<int> fds_;  // -1 marks a free slot
};

// Note [File table under the submission lock]
// The libaio and POSIX backends turn a request's file index into its fd while Submit queues it,
// under their submission mutex, so that neither a worker thread nor the kernel path ever reads
// the table. Registering and unregistering a file take that same mutex: a request submitted after
// UnregisterFile returns finds no fd and completes with -EBADF, never with a reused one. Neither
// backend can use registered buffers (pread/pwrite and io_submit take plain addresses). The
// io_uring backend keeps its own table, as it also mirrors it into the ring's fixed files.
//
// The base of those two backends: their capabilities, the submission mutex (which the derived
// class's Submit also holds for its own queue) and the file table it guards.
class FileTableBackend : public Backend {
 public:
  const Capabilities& capabilities() const final { return capabilities_; }

  Result<int> RegisterFile(int fd) final {
    MutexLock lock(&submit_mu_);
    return files_.Add(fd);
  }

  Status UnregisterFile(int file) final {
    MutexLock lock(&submit_mu_);
    return files_.Remove(file);
  }

  // Accepted and ignored, as the contract allows.
  Status RegisterBuffers(std::span<const iovec> /*buffers*/) final { return Status::Ok(); }

 protected:
  FileTableBackend(std::string name, bool asynchronous, uint32_t queue_depth) {
    capabilities_.name = std::move(name);
    capabilities_.asynchronous = asynchronous;
    capabilities_.queue_depth = queue_depth;
  }

  Capabilities capabilities_;  // immutable after construction
  Mutex submit_mu_;
  FileTable files_ GUARDED_BY(submit_mu_);
};

// Rejects a span containing a null request before anything is queued (a caller bug that would
// otherwise crash a worker or the kernel path).
Status CheckRequests(std::span<Request* const> requests);

// Test seam for OpenFile(): makes the O_DIRECT open, or the first O_DIRECT read, fail with EINVAL
// the way tmpfs before Linux 6.6 or some FUSE filesystems do, so the buffered fallback can be
// tested on any machine.
struct OpenFaults {
  bool refuse_direct_open = false;  // open(O_DIRECT) / fcntl(F_SETFL, O_DIRECT) -> EINVAL
  bool refuse_direct_io = false;    // the probing O_DIRECT pread -> EINVAL
};
Result<int> OpenFileWithFaults(const std::string& path, const OpenOptions& options,
                               bool* direct_used, const OpenFaults& faults);

}  // namespace memplan::nvme::internal
