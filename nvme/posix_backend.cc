// The POSIX backend: a fixed pool of worker threads doing one pread / pwrite / fdatasync per
// request. It works on every kernel and filesystem, and is the fallback when neither io_uring nor
// libaio can be set up.
//
// Layout: a request ring of queue_depth slots (Submit -> workers) under `submit_mu_`, and a
// completion ring of queue_depth slots (workers -> Reap) under `complete_mu_`. A request holds one
// unit of `in_flight_` from Submit until it is reaped, and Submit never lets in_flight_ exceed
// queue_depth, so neither ring can overflow and nothing is allocated per request.
//
// Thread safety: Submit, Reap, RegisterFile, UnregisterFile and in_flight may be called from any
// thread. Lock order: the two mutexes are never held together.
#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "common/mutex.h"
#include "nvme/backend.h"
#include "nvme/backend_internal.h"

namespace memplan::nvme {

namespace {

// Files and buffers: Note [File table under the submission lock] in nvme/backend_internal.h.
class PosixBackend final : public internal::FileTableBackend {
 public:
  explicit PosixBackend(const BackendOptions& options)
      : FileTableBackend("posix", /*asynchronous=*/false, options.queue_depth),
        depth_(options.queue_depth),
        pending_(depth_),
        done_(depth_) {}

  ~PosixBackend() override {
    {
      MutexLock lock(&submit_mu_);
      stopping_ = true;
    }
    work_cv_.SignalAll();
    // Workers drain the request ring before they exit, so no I/O touches a caller's buffer after
    // the destructor returns.
    for (std::thread& worker : workers_) worker.join();
  }

  // Starts the workers. Thread creation failing is reported, not thrown.
  Status Start(uint32_t threads) {
    workers_.reserve(threads);
    for (uint32_t i = 0; i < threads; ++i) {
      try {
        workers_.emplace_back([this] { WorkerLoop(); });
      } catch (const std::system_error& e) {
        return Status::ResourceExhausted("posix backend: starting worker thread " +
                                         std::to_string(i) + ": " + e.what());
      }
    }
    return Status::Ok();
  }

  Result<size_t> Submit(std::span<Request* const> requests) override {
    MEMPLAN_RETURN_IF_ERROR(internal::CheckRequests(requests));
    if (requests.empty()) return size_t{0};
    size_t taken = 0;
    {
      MutexLock lock(&submit_mu_);
      // Only reapers lower in_flight_ concurrently, which only makes room: a stale read here can
      // make us take fewer, never too many.
      const size_t in_flight = in_flight_.load(std::memory_order_relaxed);
      const size_t room = depth_ - std::min<size_t>(in_flight, depth_);
      taken = std::min(requests.size(), room);
      for (size_t i = 0; i < taken; ++i) {
        pending_[(pending_head_ + pending_count_) % depth_] =
            Pending{requests[i], files_.Fd(requests[i]->file)};
        ++pending_count_;
      }
      in_flight_.fetch_add(taken, std::memory_order_relaxed);
    }
    if (taken == 1) {
      work_cv_.Signal();
    } else if (taken > 1) {
      work_cv_.SignalAll();
    }
    return taken;
  }

  Result<size_t> Reap(std::span<Completion> out, size_t min_complete) override {
    if (out.empty()) return size_t{0};
    MutexLock lock(&complete_mu_);
    // Re-evaluated on every wake-up: another reaper may have taken completions this one was
    // counting on, and then in_flight_ (which only reapers lower, under this mutex) is lower too.
    auto ready = [&]() REQUIRES(complete_mu_) {
      const size_t want =
          std::min({min_complete, out.size(), in_flight_.load(std::memory_order_relaxed)});
      return done_count_ >= want;
    };
    if (!ready()) {
      ++waiting_reapers_;
      while (!ready()) done_cv_.Wait(&complete_mu_);
      --waiting_reapers_;
    }
    const size_t n = std::min(out.size(), done_count_);
    for (size_t i = 0; i < n; ++i) {
      out[i] = done_[done_head_];
      done_head_ = (done_head_ + 1) % depth_;
    }
    done_count_ -= n;
    in_flight_.fetch_sub(n, std::memory_order_relaxed);
    // Other waiting reapers must recompute what they can still expect.
    if (n > 0 && waiting_reapers_ > 0) done_cv_.SignalAll();
    return n;
  }

  size_t in_flight() const override { return in_flight_.load(std::memory_order_relaxed); }

 private:
  struct Pending {
    Request* request = nullptr;
    int fd = -1;  // resolved at Submit, under submit_mu_, so workers never read the file table
  };

  void WorkerLoop() {
    pthread_setname_np(pthread_self(), "memplan-posixio");
    for (;;) {
      Pending job;
      {
        MutexLock lock(&submit_mu_);
        while (!stopping_ && pending_count_ == 0) work_cv_.Wait(&submit_mu_);
        if (pending_count_ == 0) return;  // stopping, and the ring is drained
        job = pending_[pending_head_];
        pending_head_ = (pending_head_ + 1) % depth_;
        --pending_count_;
      }
      const int64_t result = Execute(*job.request, job.fd);
      {
        MutexLock lock(&complete_mu_);
        done_[(done_head_ + done_count_) % depth_] = Completion{job.request, result};
        ++done_count_;
        if (waiting_reapers_ > 0) done_cv_.SignalAll();
      }
    }
  }

  // One system call per request: a short count is reported as is (the contract leaves retrying
  // the remainder to IoEngine), and so are EINTR and EAGAIN.
  static int64_t Execute(const Request& request, int fd) {
    ssize_t n = -1;
    switch (request.op) {
      case OpType::kRead:
        n = ::pread(fd, request.buffer, request.length, static_cast<off_t>(request.offset));
        break;
      case OpType::kWrite:
        n = ::pwrite(fd, request.buffer, request.length, static_cast<off_t>(request.offset));
        break;
      case OpType::kFsync:
        // Data plus the metadata needed to read it back (size), as io_uring's
        // IORING_FSYNC_DATASYNC and libaio's FDSYNC do.
        n = ::fdatasync(fd);
        break;
    }
    return n < 0 ? -static_cast<int64_t>(errno) : static_cast<int64_t>(n);
  }

  const size_t depth_;
  std::vector<std::thread> workers_;

  // Requests submitted and not yet reaped: raised by Submit under submit_mu_, lowered by Reap
  // under complete_mu_; read without a lock by in_flight().
  std::atomic<size_t> in_flight_{0};

  // submit_mu_ (FileTableBackend's) also guards the request ring.
  CondVar work_cv_;  // workers wait for pending_count_ > 0 or stopping_
  std::vector<Pending> pending_ GUARDED_BY(submit_mu_);  // ring of depth_ slots
  size_t pending_head_ GUARDED_BY(submit_mu_) = 0;
  size_t pending_count_ GUARDED_BY(submit_mu_) = 0;
  bool stopping_ GUARDED_BY(submit_mu_) = false;

  Mutex complete_mu_;
  CondVar done_cv_;  // reapers wait for completions or a lower in_flight_
  std::vector<Completion> done_ GUARDED_BY(complete_mu_);  // ring of depth_ slots
  size_t done_head_ GUARDED_BY(complete_mu_) = 0;
  size_t done_count_ GUARDED_BY(complete_mu_) = 0;
  size_t waiting_reapers_ GUARDED_BY(complete_mu_) = 0;
};

}  // namespace

Result<std::unique_ptr<Backend>> CreatePosixBackend(const BackendOptions& options) {
  MEMPLAN_RETURN_IF_ERROR(options.Validate());
  auto backend = std::make_unique<PosixBackend>(options);
  // On failure the destructor stops and joins the workers already started.
  MEMPLAN_RETURN_IF_ERROR(backend->Start(options.posix_threads));
  return std::unique_ptr<Backend>(std::move(backend));
}

}  // namespace memplan::nvme
