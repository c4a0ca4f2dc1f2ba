// The libaio backend (Linux native AIO): io_setup(queue_depth), a pool of queue_depth iocbs
// allocated once, io_submit of every request that fits, io_getevents to reap. Truly asynchronous
// only for O_DIRECT files; on buffered files io_submit does the I/O before it returns, which is
// still correct, just synchronous.
//
// Partial submission, handled as the kernel reports it (DeepSpeed's csrc/aio asserts instead):
// io_submit returns how many iocbs it queued. When it stops at an iocb it rejects, it returns
// the count before it, or -errno when that iocb is the first. -EAGAIN means "no resources now",
// i.e. busy, and the rest is handed back untaken. Any other -errno is that one request's fate
// (EBADF, EINVAL), so it is completed with that result without reaching the kernel, exactly as
// io_uring would report it in a CQE, and submission goes on with the next.
//
// Thread safety: Submit, RegisterFile and UnregisterFile serialise on `submit_mu_`; Reap on
// `complete_mu_`. The iocb free-list and the synthetic completions (refused requests) are shared
// by both sides under `slots_mu_`, a leaf lock taken briefly inside either of the others and
// never while waiting.
#include <libaio.h>
#include <time.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <string>
#include <utility>
#include <vector>

#include "common/mutex.h"
#include "nvme/backend.h"
#include "nvme/backend_internal.h"

namespace memplan::nvme {

namespace {

// Files and buffers: Note [File table under the submission lock] in nvme/backend_internal.h.
class AioBackend final : public internal::FileTableBackend {
 public:
  explicit AioBackend(uint32_t queue_depth)
      : FileTableBackend("libaio", /*asynchronous=*/true, queue_depth),
        depth_(queue_depth),
        iocbs_(depth_),
        batch_(depth_),
        batch_slots_(depth_),
        batch_queued_(depth_),
        refused_(depth_),
        free_slots_(depth_),
        synthetic_(depth_),
        events_(depth_) {
    for (size_t i = 0; i < depth_; ++i) free_slots_[i] = static_cast<uint32_t>(depth_ - 1 - i);
    free_count_ = depth_;
  }

  ~AioBackend() override {
    // io_destroy cancels what it can and blocks until every outstanding iocb has completed, so no
    // I/O touches a caller's buffer after this returns.
    if (ctx_ != nullptr) io_destroy(ctx_);
  }

  Status Init() {
    const int rc = io_setup(static_cast<int>(depth_), &ctx_);
    if (rc < 0) {
      ctx_ = nullptr;
      // EAGAIN here is the system-wide /proc/sys/fs/aio-max-nr, not a transient condition.
      return Status::FromErrno(-rc, "io_setup(" + std::to_string(depth_) + ")" +
                                        (rc == -EAGAIN ? " (fs.aio-max-nr exhausted?)" : ""));
    }
    return Status::Ok();
  }

  Result<size_t> Submit(std::span<Request* const> requests) override {
    MEMPLAN_RETURN_IF_ERROR(internal::CheckRequests(requests));
    if (requests.empty()) return size_t{0};
    MutexLock lock(&submit_mu_);
    // Reapers only lower in_flight_, so a stale read errs towards taking fewer.
    const auto in_flight =
        static_cast<size_t>(std::max<int64_t>(0, in_flight_.load(std::memory_order_acquire)));
    size_t prepared = std::min(requests.size(), depth_ - std::min(in_flight, depth_));
    if (prepared == 0) return size_t{0};
    {
      // Every unreaped kernel request holds one iocb, and reapers free iocbs before they lower
      // in_flight_, so `prepared` free ones exist; the clamp only guards that reasoning.
      MutexLock slots_lock(&slots_mu_);
      prepared = std::min(prepared, free_count_);
      for (size_t i = 0; i < prepared; ++i) batch_slots_[i] = free_slots_[--free_count_];
    }
    for (size_t i = 0; i < prepared; ++i) {
      iocb* cb = &iocbs_[batch_slots_[i]];
      Prepare(cb, *requests[i]);
      batch_[i] = cb;
      batch_queued_[i] = false;
    }

    size_t taken = 0;   // requests[0, taken) are queued in the kernel or refused (completed)
    size_t queued = 0;  // of those, how many the kernel queued
    size_t refused = 0;
    while (taken < prepared) {
      const int rc = io_submit(ctx_, static_cast<long>(prepared - taken), &batch_[taken]);
      if (rc > 0) {
        for (size_t i = taken; i < taken + static_cast<size_t>(rc); ++i) batch_queued_[i] = true;
        taken += static_cast<size_t>(rc);
        queued += static_cast<size_t>(rc);
        continue;
      }
      if (rc == 0 || rc == -EAGAIN || rc == -EINTR) break;  // busy: hand the rest back
      // iocb `taken` was refused on its own merits: that is its completion.
      refused_[refused++] = Completion{requests[taken], rc};
      ++taken;
    }
    {
      MutexLock slots_lock(&slots_mu_);
      // iocbs of refused and untaken requests go back now; queued ones come back at Reap.
      for (size_t i = 0; i < prepared; ++i) {
        if (!batch_queued_[i]) free_slots_[free_count_++] = batch_slots_[i];
      }
      for (size_t i = 0; i < refused; ++i) {
        synthetic_[(synthetic_head_ + synthetic_count_) % depth_] = refused_[i];
        ++synthetic_count_;
      }
    }
    kernel_in_flight_.fetch_add(static_cast<int64_t>(queued), std::memory_order_release);
    in_flight_.fetch_add(static_cast<int64_t>(taken), std::memory_order_release);
    return taken;
  }

  Result<size_t> Reap(std::span<Completion> out, size_t min_complete) override {
    if (out.empty()) return size_t{0};
    MutexLock lock(&complete_mu_);
    size_t got = 0;
    {
      MutexLock slots_lock(&slots_mu_);
      while (got < out.size() && synthetic_count_ > 0) {
        out[got++] = synthetic_[synthetic_head_];
        synthetic_head_ = (synthetic_head_ + 1) % depth_;
        --synthetic_count_;
      }
    }
    if (got > 0) in_flight_.fetch_sub(static_cast<int64_t>(got), std::memory_order_acq_rel);

    for (;;) {
      const size_t room = std::min(out.size() - got, depth_);
      if (room == 0) return got;
      // Only the kernel's requests can be waited for (synthetic completions pushed after the
      // drain above are picked up next time). kernel_in_flight_ is lowered only here, under
      // complete_mu_, and reads low (never high) while a submitter has not yet counted its
      // iocbs, so the wait below never outlasts the completions that can come.
      const size_t kernel = static_cast<size_t>(
          std::max<int64_t>(0, kernel_in_flight_.load(std::memory_order_acquire)));
      const size_t want = std::min(min_complete, out.size());
      const size_t need = std::min(want > got ? want - got : 0, std::min(kernel, room));
      timespec no_wait = {0, 0};
      const int rc = io_getevents(ctx_, static_cast<long>(need), static_cast<long>(room),
                                  events_.data(), need == 0 ? &no_wait : nullptr);
      if (rc == -EINTR) continue;
      if (rc < 0) {
        if (got > 0) return got;  // hand over what we have; the error will repeat
        return Status::FromErrno(-rc, "io_getevents");
      }
      if (rc == 0) return got;
      {
        MutexLock slots_lock(&slots_mu_);
        for (int i = 0; i < rc; ++i) {
          const io_event& event = events_[i];
          free_slots_[free_count_++] = static_cast<uint32_t>(event.obj - iocbs_.data());
          out[got++] = Completion{static_cast<Request*>(event.data), ResultOf(event)};
        }
      }
      kernel_in_flight_.fetch_sub(rc, std::memory_order_acq_rel);
      in_flight_.fetch_sub(rc, std::memory_order_acq_rel);
      if (got >= want || static_cast<size_t>(rc) < room) return got;
    }
  }

  size_t in_flight() const override {
    return static_cast<size_t>(std::max<int64_t>(0, in_flight_.load(std::memory_order_acquire)));
  }

 private:
  // res is bytes transferred or -errno (stored in an unsigned long); res2 is 0 on every current
  // kernel, but a negative res2 with a non-negative res is an error too.
  static int64_t ResultOf(const io_event& event) {
    const auto res = static_cast<long>(event.res);
    const auto res2 = static_cast<long>(event.res2);
    if (res >= 0 && res2 < 0) return res2;
    return res;
  }

  // Fills one iocb.
  void Prepare(iocb* cb, Request& request) REQUIRES(submit_mu_) {
    // An unknown index becomes fd -1: io_submit refuses it with EBADF, which Submit turns into
    // this request's completion.
    const int fd = files_.Fd(request.file);
    switch (request.op) {
      case OpType::kRead:
        io_prep_pread(cb, fd, request.buffer, request.length,
                      static_cast<long long>(request.offset));
        break;
      case OpType::kWrite:
        io_prep_pwrite(cb, fd, request.buffer, request.length,
                       static_cast<long long>(request.offset));
        break;
      case OpType::kFsync: io_prep_fdsync(cb, fd); break;
    }
    cb->data = &request;
  }

  const size_t depth_;
  io_context_t ctx_ = nullptr;  // set once by Init

  // Requests submitted and not yet reaped (kernel and synthetic). Raised by Submit after
  // io_submit (under submit_mu_), lowered by Reap (under complete_mu_). A reaper can see a
  // completion before its submitter has counted it, so it may read transiently low, even
  // negative (hence signed, and clamped where read), never high. The Request itself is
  // synchronised through slots_mu_, which both sides take around the kernel handoff.
  std::atomic<int64_t> in_flight_{0};
  std::atomic<int64_t> kernel_in_flight_{0};  // of those, queued in the kernel

  std::vector<iocb> iocbs_;  // the pool; an iocb is owned by whoever holds its slot index

  // submit_mu_ and files_: FileTableBackend.
  std::vector<iocb*> batch_ GUARDED_BY(submit_mu_);           // io_submit's argument
  std::vector<uint32_t> batch_slots_ GUARDED_BY(submit_mu_);  // their iocb indexes
  std::vector<bool> batch_queued_ GUARDED_BY(submit_mu_);     // accepted by io_submit
  std::vector<Completion> refused_ GUARDED_BY(submit_mu_);    // refused by io_submit

  Mutex slots_mu_ ACQUIRED_AFTER(submit_mu_, complete_mu_);  // leaf lock
  std::vector<uint32_t> free_slots_ GUARDED_BY(slots_mu_);   // stack of free iocb indexes
  size_t free_count_ GUARDED_BY(slots_mu_) = 0;
  std::vector<Completion> synthetic_ GUARDED_BY(slots_mu_);  // ring of depth_ slots
  size_t synthetic_head_ GUARDED_BY(slots_mu_) = 0;
  size_t synthetic_count_ GUARDED_BY(slots_mu_) = 0;

  Mutex complete_mu_;
  std::vector<io_event> events_ GUARDED_BY(complete_mu_);  // io_getevents' buffer
};

}  // namespace

Result<std::unique_ptr<Backend>> CreateAioBackend(const BackendOptions& options) {
  MEMPLAN_RETURN_IF_ERROR(options.Validate());
  auto backend = std::make_unique<AioBackend>(options.queue_depth);
  MEMPLAN_RETURN_IF_ERROR(backend->Init());
  return std::unique_ptr<Backend>(std::move(backend));
}

}  // namespace memplan::nvme
