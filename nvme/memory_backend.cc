// The in-memory Backend: every registered file is a growable byte vector, and requests complete
// inside Submit(), so tests of everything above the seam (IoEngine, SwapStore, the offload engine)
// run anywhere, fast, and deterministically.
//
// It keeps the contract's shape so code tested on it behaves the same on a real backend: at most
// `queue_depth` requests are in flight (submitted and not reaped) and Submit() takes only what
// fits; a read past the end of a file is a short transfer (0 bytes at or beyond the end); nothing
// is retried or hidden.
//
// Thread safety: Submit() and Reap() may be called concurrently. `mu_` guards the queue
// accounting and the completion ring; the copies themselves run outside it, under the target
// file's own reader/writer lock, so concurrent requests on different files (or reads of one file)
// proceed in parallel.
#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <new>
#include <vector>

#include "common/mutex.h"
#include "nvme/backend.h"

namespace memplan::nvme {
namespace {

// A file larger than this is refused (-EFBIG) rather than attempted: growing the vector zero-fills
// every page, so a stray huge offset would otherwise take the machine's memory down with it.
constexpr uint64_t kMaxFileBytes = uint64_t{64} << 30;

struct MemFile {
  SharedMutex mu;
  std::vector<std::byte> data GUARDED_BY(mu);
};

class MemoryBackend final : public Backend {
 public:
  explicit MemoryBackend(uint32_t queue_depth) : ring_(queue_depth) {
    capabilities_.name = "memory";
    capabilities_.queue_depth = queue_depth;
  }

  const Capabilities& capabilities() const override { return capabilities_; }

  Result<int> RegisterFile(int fd) override {
    if (fd < 0) {
      return Status::InvalidArgument("memory backend: bad file descriptor " + std::to_string(fd));
    }
    // Indexes are never reused, so a request carrying a stale one fails with EBADF instead of
    // landing in another file's data.
    WriterMutexLock lock(&files_mu_);
    files_.push_back(std::make_shared<MemFile>());
    return static_cast<int>(files_.size() - 1);
  }

  Status UnregisterFile(int file) override {
    WriterMutexLock lock(&files_mu_);
    if (file < 0 || static_cast<size_t>(file) >= files_.size() || files_[file] == nullptr) {
      return Status::InvalidArgument("memory backend: file " + std::to_string(file) +
                                     " is not registered");
    }
    files_[file].reset();
    return Status::Ok();
  }

  Status RegisterBuffers(std::span<const iovec> /*buffers*/) override { return Status::Ok(); }

  Result<size_t> Submit(std::span<Request* const> requests) override {
    for (const Request* r : requests) {
      if (r == nullptr) return Status::InvalidArgument("memory backend: null request submitted");
    }
    size_t taken = 0;
    {
      // Reserve queue slots first: the copies below happen without the lock, and a concurrent
      // Submit must not overfill the queue meanwhile.
      MutexLock lock(&mu_);
      taken = std::min<size_t>(requests.size(), capabilities_.queue_depth - in_flight_);
      in_flight_ += taken;
    }
    for (size_t i = 0; i < taken; ++i) {
      int64_t result = Execute(*requests[i]);
      MutexLock lock(&mu_);
      ring_[(ring_head_ + ready_) % ring_.size()] = Completion{requests[i], result};
      ++ready_;
    }
    if (taken > 0) ready_cv_.SignalAll();
    return taken;
  }

  Result<size_t> Reap(std::span<Completion> out, size_t min_complete) override {
    MutexLock lock(&mu_);
    // in_flight_ is re-read on every wake-up: another reaper may have taken what we waited for,
    // and the clamp must follow it so this never waits for completions that cannot come.
    while (ready_ < std::min({min_complete, in_flight_, out.size()})) ready_cv_.Wait(&mu_);
    size_t n = std::min(out.size(), ready_);
    for (size_t i = 0; i < n; ++i) {
      out[i] = ring_[ring_head_];
      ring_head_ = (ring_head_ + 1) % ring_.size();
    }
    ready_ -= n;
    in_flight_ -= n;
    return n;
  }

  size_t in_flight() const override {
    MutexLock lock(&mu_);
    return in_flight_;
  }

 private:
  // Performs one request; returns bytes transferred or -errno, as a kernel would.
  int64_t Execute(const Request& r) {
    std::shared_ptr<MemFile> file;
    {
      ReaderMutexLock lock(&files_mu_);
      if (r.file >= 0 && static_cast<size_t>(r.file) < files_.size()) file = files_[r.file];
    }
    if (file == nullptr) return -EBADF;
    if (r.op == OpType::kFsync) return 0;
    if (r.length > 0 && r.buffer == nullptr) return -EFAULT;
    if (r.offset > kMaxFileBytes || r.length > kMaxFileBytes - r.offset) return -EFBIG;
    if (r.op == OpType::kRead) {
      ReaderMutexLock lock(&file->mu);
      if (r.offset >= file->data.size()) return 0;
      size_t n = std::min<uint64_t>(r.length, file->data.size() - r.offset);
      std::memcpy(r.buffer, file->data.data() + r.offset, n);
      return static_cast<int64_t>(n);
    }
    WriterMutexLock lock(&file->mu);
    uint64_t end = r.offset + r.length;
    if (file->data.size() < end) {
      try {
        file->data.resize(end);
      } catch (const std::bad_alloc&) {
        return -ENOMEM;
      }
    }
    std::memcpy(file->data.data() + r.offset, r.buffer, r.length);
    return r.length;
  }

  Capabilities capabilities_;

  SharedMutex files_mu_;
  // Null once unregistered.
  std::vector<std::shared_ptr<MemFile>> files_ GUARDED_BY(files_mu_);

  mutable Mutex mu_;
  CondVar ready_cv_;
  size_t in_flight_ GUARDED_BY(mu_) = 0;          // submitted, not yet reaped
  std::vector<Completion> ring_ GUARDED_BY(mu_);  // queue_depth slots, FIFO of finished requests
  size_t ring_head_ GUARDED_BY(mu_) = 0;
  size_t ready_ GUARDED_BY(mu_) = 0;  // finished, waiting in ring_
};

}  // namespace

Result<std::unique_ptr<Backend>> CreateMemoryBackend(const BackendOptions& options) {
  MEMPLAN_RETURN_IF_ERROR(options.Validate().WithPrefix("memory backend"));
  return std::unique_ptr<Backend>(new MemoryBackend(options.queue_depth));
}

}  // namespace memplan::nvme
