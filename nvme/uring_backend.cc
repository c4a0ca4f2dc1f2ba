// The io_uring backend (liburing): one ring of queue_depth entries, batch submission (every
// request that fits becomes an SQE, then one io_uring_submit), registered files and buffers when
// the kernel grants them, and batch reaping.
//
// Setup asks for what helps and falls back, saying so in Capabilities::note: SQPOLL when the
// options ask for it, IORING_SETUP_SUBMIT_ALL (Linux 5.18) so one bad SQE does not stop a batch,
// a sparse fixed-file table, fixed-buffer opcodes. Only a ring that cannot be created at all, or a
// kernel without IORING_OP_READ/WRITE (Linux 5.6), is an error; CreateBackend then tries libaio.
//
// Thread safety: Submit, RegisterFile, UnregisterFile and RegisterBuffers serialise on
// `submit_mu_` (they touch the SQ ring and the tables SQEs are built from); Reap serialises on
// `complete_mu_` (the CQ ring). liburing keeps the two sides in separate fields, so one submitter
// and one reaper may run at once, which is the concurrency io_uring is designed for. The two
// mutexes are never held together.
#include <liburing.h>
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "common/mutex.h"
#include "nvme/backend.h"
#include "nvme/backend_internal.h"

namespace memplan::nvme {

namespace {

// Slots in the sparse fixed-file table (bounded by RLIMIT_NOFILE, which the kernel enforces).
// Files registered beyond it are used as plain fds, which is slower per request but correct.
constexpr unsigned kMaxFixedFiles = 1024;
// How long an idle SQPOLL thread spins before it sleeps and needs a wake-up syscall.
constexpr unsigned kSqThreadIdleMs = 1000;

// std::strerror is not thread-safe; error_category::message is (it uses strerror_r).
std::string ErrnoText(int negative_errno) {
  return std::generic_category().message(-negative_errno);
}

class UringBackend final : public Backend {
 public:
  UringBackend(uint32_t queue_depth, uint32_t submit_batch)
      : depth_(queue_depth), submit_batch_(submit_batch), cqes_(queue_depth) {
    capabilities_.name = "io_uring";
    capabilities_.asynchronous = true;
    capabilities_.queue_depth = depth_;
  }

  ~UringBackend() override {
    if (!ring_ready_) return;
    // io_uring_queue_exit returns before the kernel has finished (or cancelled) in-flight
    // requests, which may still be writing into callers' buffers: wait for them first.
    Completion sink[64];
    while (in_flight() > 0) {
      Result<size_t> reaped = Reap(sink, 1);
      if (!reaped.ok() || *reaped == 0) break;
    }
    io_uring_queue_exit(&ring_);
  }

  Status Init(const BackendOptions& options) {
    unsigned submit_all = 0;
#ifdef IORING_SETUP_SUBMIT_ALL
    submit_all = IORING_SETUP_SUBMIT_ALL;
#endif
    // Most wanted first. SUBMIT_ALL is dropped before SQPOLL because an old kernel refuses the
    // unknown flag with EINVAL, which must not be mistaken for "SQPOLL refused".
    std::vector<unsigned> attempts;
    if (options.sqpoll) {
      attempts.push_back(IORING_SETUP_SQPOLL | submit_all);
      if (submit_all != 0) attempts.push_back(IORING_SETUP_SQPOLL);
    }
    attempts.push_back(submit_all);
    if (submit_all != 0) attempts.push_back(0);

    int last_error = 0;
    std::string sqpoll_refusal;
    for (unsigned flags : attempts) {
      io_uring_params params = {};
      params.flags = flags;
      if ((flags & IORING_SETUP_SQPOLL) != 0) params.sq_thread_idle = kSqThreadIdleMs;
      const int rc = io_uring_queue_init_params(depth_, &ring_, &params);
      if (rc < 0) {
        last_error = rc;
        if ((flags & IORING_SETUP_SQPOLL) != 0) sqpoll_refusal = ErrnoText(rc);
        continue;
      }
      // Before Linux 5.11 an SQPOLL ring accepts only fixed files; our plain-fd fallback would
      // then fail every request, so such a ring is not worth having.
      if ((flags & IORING_SETUP_SQPOLL) != 0 &&
          (params.features & IORING_FEAT_SQPOLL_NONFIXED) == 0) {
        io_uring_queue_exit(&ring_);
        ring_ = {};
        sqpoll_refusal = "needs Linux 5.11 (IORING_FEAT_SQPOLL_NONFIXED)";
        continue;
      }
      ring_ready_ = true;
      sqpoll_ = (flags & IORING_SETUP_SQPOLL) != 0;
      break;
    }
    if (!ring_ready_) {
      if (last_error == 0) last_error = -EINVAL;
      return Status::FromErrno(-last_error, "io_uring_queue_init");
    }
    std::vector<std::string> notes;
    if (options.sqpoll && !sqpoll_) notes.push_back("SQPOLL refused: " + sqpoll_refusal);
    capabilities_.sqpoll = sqpoll_;

    io_uring_probe* probe = io_uring_get_probe_ring(&ring_);
    if (probe == nullptr) {
      return Status::FailedPrecondition(
          "io_uring cannot report its opcodes (kernel older than 5.6)");
    }
    const bool has_rw = io_uring_opcode_supported(probe, IORING_OP_READ) &&
                        io_uring_opcode_supported(probe, IORING_OP_WRITE) &&
                        io_uring_opcode_supported(probe, IORING_OP_FSYNC);
    const bool has_fixed = io_uring_opcode_supported(probe, IORING_OP_READ_FIXED) &&
                           io_uring_opcode_supported(probe, IORING_OP_WRITE_FIXED);
    io_uring_free_probe(probe);
    if (!has_rw) {
      return Status::FailedPrecondition("io_uring lacks IORING_OP_READ/WRITE (needs Linux 5.6)");
    }
    capabilities_.registered_buffers = has_fixed;
    if (!has_fixed) notes.push_back("fixed buffers unsupported");

    rlimit files_limit = {};
    unsigned slots = kMaxFixedFiles;
    if (getrlimit(RLIMIT_NOFILE, &files_limit) == 0 && files_limit.rlim_cur < slots) {
      slots = static_cast<unsigned>(files_limit.rlim_cur);
    }
    const int rc = !options.fixed_files ? 0
                   : slots > 0          ? io_uring_register_files_sparse(&ring_, slots)
                                        : -EMFILE;
    if (!options.fixed_files) {
      notes.push_back("fixed files off");
    } else if (rc == 0) {
      fixed_file_slots_ = slots;
      capabilities_.registered_files = true;
    } else {
      notes.push_back("fixed files unavailable: " + ErrnoText(rc));
    }
    if (submit_batch_ == 1) notes.push_back("one request per submission");
    for (size_t i = 0; i < notes.size(); ++i) {
      capabilities_.note += (i > 0 ? "; " : "") + notes[i];
    }
    return Status::Ok();
  }

  const Capabilities& capabilities() const override { return capabilities_; }

  Result<int> RegisterFile(int fd) override {
    MutexLock lock(&submit_mu_);
    MEMPLAN_ASSIGN_OR_RETURN(const int index, files_.Add(fd));
    if (fixed_.size() < files_.size()) fixed_.resize(files_.size(), false);
    fixed_[index] = false;
    if (static_cast<unsigned>(index) < fixed_file_slots_) {
      // A refused update only costs speed: the file is then used as a plain fd.
      fixed_[index] = io_uring_register_files_update(&ring_, index, &fd, 1) == 1;
    }
    return index;
  }

  Status UnregisterFile(int file) override {
    MutexLock lock(&submit_mu_);
    if (files_.Fd(file) >= 0 && fixed_[file]) {
      const int none = -1;
      const int rc = io_uring_register_files_update(&ring_, file, &none, 1);
      if (rc < 0) {
        return Status::FromErrno(-rc, "UnregisterFile: removing file " + std::to_string(file) +
                                          " from the io_uring fixed-file table");
      }
      fixed_[file] = false;
    }
    return files_.Remove(file);
  }

  // Fails (ENOMEM usually means RLIMIT_MEMLOCK) without affecting the ring: requests naming a
  // buffer_index then run as plain reads and writes. Must not race with in-flight requests that
  // use the previous registration's indexes.
  Status RegisterBuffers(std::span<const iovec> buffers) override {
    if (!capabilities_.registered_buffers) return Status::Ok();
    MutexLock lock(&submit_mu_);
    if (!buffers_.empty()) {
      buffers_.clear();
      const int rc = io_uring_unregister_buffers(&ring_);
      if (rc < 0 && rc != -ENXIO) return Status::FromErrno(-rc, "io_uring_unregister_buffers");
    }
    if (buffers.empty()) return Status::Ok();
    const int rc =
        io_uring_register_buffers(&ring_, buffers.data(), static_cast<unsigned>(buffers.size()));
    if (rc < 0) {
      return Status::FromErrno(-rc, "io_uring_register_buffers (" + std::to_string(buffers.size()) +
                                        " buffers; ENOMEM usually means RLIMIT_MEMLOCK)");
    }
    buffers_.assign(buffers.begin(), buffers.end());
    return Status::Ok();
  }

  Result<size_t> Submit(std::span<Request* const> requests) override {
    MEMPLAN_RETURN_IF_ERROR(internal::CheckRequests(requests));
    if (requests.empty()) return size_t{0};
    MutexLock lock(&submit_mu_);
    // Capping what is in flight at queue_depth also keeps the CQ ring (2x the SQ ring) from ever
    // overflowing. Reapers only lower in_flight_, so a stale read errs towards taking fewer.
    const int64_t in_flight = std::max<int64_t>(0, in_flight_.load(std::memory_order_acquire));
    const size_t room = depth_ - std::min<size_t>(static_cast<size_t>(in_flight), depth_);
    const size_t wanted = std::min(requests.size(), room);
    const size_t batch = submit_batch_ == 0 ? wanted : submit_batch_;
    size_t taken_total = 0;
    while (taken_total < wanted) {
      const size_t this_batch = std::min(batch, wanted - taken_total);
      size_t prepared = 0;
      while (prepared < this_batch) {
        io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
        if (sqe == nullptr) break;  // SQ ring full (SQPOLL thread behind): busy
        Prepare(sqe, *requests[taken_total + prepared]);
        ++prepared;
      }
      if (prepared == 0) break;

      handoff_.fetch_add(1, std::memory_order_release);  // Note [kernel handoff]
      const int rc = io_uring_submit(&ring_);
      size_t taken = prepared;
      if (sqpoll_) {
        // The SQEs are in the ring and the kernel thread consumes them on its own; a failure here
        // means that thread is gone, and nothing more can be submitted.
        if (rc < 0) return Status::FromErrno(-rc, "io_uring_submit (SQPOLL thread)");
      } else {
        taken = prepared - RetractUnsubmitted();
        if (rc < 0 && taken == 0 && taken_total == 0 && rc != -EAGAIN && rc != -EBUSY &&
            rc != -EINTR) {
          return Status::FromErrno(-rc, "io_uring_submit");
        }
      }
      in_flight_.fetch_add(static_cast<int64_t>(taken), std::memory_order_release);
      taken_total += taken;
      if (taken < prepared) break;  // the kernel is busy: the caller reaps, then offers the rest
    }
    return taken_total;
  }

  Result<size_t> Reap(std::span<Completion> out, size_t min_complete) override {
    if (out.empty()) return size_t{0};
    MutexLock lock(&complete_mu_);
    size_t got = 0;
    for (;;) {
      // Take everything ready, up to out.size().
      while (got < out.size()) {
        const unsigned batch = static_cast<unsigned>(std::min(out.size() - got, cqes_.size()));
        const unsigned n = io_uring_peek_batch_cqe(&ring_, cqes_.data(), batch);
        if (n == 0) break;
        (void)handoff_.load(std::memory_order_acquire);  // Note [kernel handoff]
        for (unsigned i = 0; i < n; ++i) {
          out[got + i] = Completion{static_cast<Request*>(io_uring_cqe_get_data(cqes_[i])),
                                    static_cast<int64_t>(cqes_[i]->res)};
        }
        io_uring_cq_advance(&ring_, n);
        got += n;
        in_flight_.fetch_sub(n, std::memory_order_acq_rel);
        if (n < batch) break;
      }
      // Only this thread (holding complete_mu_) lowers in_flight_; a submitter that has not yet
      // counted its requests makes it read low, so we may wait for fewer, never for a
      // completion that cannot come.
      const size_t outstanding =
          static_cast<size_t>(std::max<int64_t>(0, in_flight_.load(std::memory_order_acquire)));
      const size_t want = std::min({min_complete, out.size(), got + outstanding});
      if (got >= want) return got;
      io_uring_cqe* cqe = nullptr;
      const int rc = io_uring_wait_cqe_nr(&ring_, &cqe, static_cast<unsigned>(want - got));
      if (rc < 0 && rc != -EINTR && rc != -EAGAIN && rc != -ETIME) {
        // Completions already taken off the ring must reach the caller; the error will repeat.
        if (got > 0) return got;
        return Status::FromErrno(-rc, "io_uring_wait_cqe_nr");
      }
    }
  }

  size_t in_flight() const override {
    return static_cast<size_t>(std::max<int64_t>(0, in_flight_.load(std::memory_order_acquire)));
  }

 private:
  // Fills one SQE.
  void Prepare(io_uring_sqe* sqe, Request& request) REQUIRES(submit_mu_) {
    const int fd = files_.Fd(request.file);
    // An unknown index runs against fd -1 so that the kernel reports -EBADF in the completion.
    const bool fixed_file = fd >= 0 && fixed_[request.file];
    const int target = fixed_file ? request.file : fd;
    const bool fixed_buffer = UsesRegisteredBuffer(request);
    switch (request.op) {
      case OpType::kRead:
        if (fixed_buffer) {
          io_uring_prep_read_fixed(sqe, target, request.buffer, request.length, request.offset,
                                   request.buffer_index);
        } else {
          io_uring_prep_read(sqe, target, request.buffer, request.length, request.offset);
        }
        break;
      case OpType::kWrite:
        if (fixed_buffer) {
          io_uring_prep_write_fixed(sqe, target, request.buffer, request.length, request.offset,
                                    request.buffer_index);
        } else {
          io_uring_prep_write(sqe, target, request.buffer, request.length, request.offset);
        }
        break;
      case OpType::kFsync: io_uring_prep_fsync(sqe, target, IORING_FSYNC_DATASYNC); break;
    }
    if (fixed_file) sqe->flags |= IOSQE_FIXED_FILE;
    io_uring_sqe_set_data(sqe, &request);
  }

  // True when the request names a registered buffer that really contains it; otherwise it runs
  // as a plain read/write instead of failing with EFAULT.
  bool UsesRegisteredBuffer(const Request& request) const REQUIRES(submit_mu_) {
    if (request.buffer_index < 0 || static_cast<size_t>(request.buffer_index) >= buffers_.size()) {
      return false;
    }
    const iovec& registered = buffers_[request.buffer_index];
    const auto* begin = static_cast<const char*>(registered.iov_base);
    const auto* first = static_cast<const char*>(request.buffer);
    return first >= begin && request.length <= registered.iov_len &&
           static_cast<size_t>(first - begin) <= registered.iov_len - request.length;
  }

  // Note [partial submission]: without SQPOLL the kernel consumes SQEs only inside
  // io_uring_enter, so once io_uring_submit returns, *khead says exactly how many it took. SQEs it
  // did not take (-EAGAIN/-EBUSY, or a batch cut short before IORING_SETUP_SUBMIT_ALL) would
  // otherwise stay in the ring and be submitted by some later call, after we told the caller they
  // were not taken and the caller resubmitted them. So we withdraw them: move the SQ tail back to
  // the head. Every Submit ends with head == tail, so nothing of an earlier call is withdrawn.
  // Returns how many SQEs were withdrawn. Never with SQPOLL.
  size_t RetractUnsubmitted() REQUIRES(submit_mu_) {
    io_uring_sq& sq = ring_.sq;
    const unsigned head = std::atomic_ref<unsigned>(*sq.khead).load(std::memory_order_acquire);
    const unsigned unsubmitted = sq.sqe_tail - head;
    if (unsubmitted == 0) return 0;
    sq.sqe_tail = head;
    sq.sqe_head = head;
    std::atomic_ref<unsigned>(*sq.ktail).store(head, std::memory_order_release);
    return unsubmitted;
  }

  const size_t depth_;
  const size_t submit_batch_;  // BackendOptions::submit_batch
  Capabilities capabilities_;  // immutable after Init
  io_uring ring_ = {};         // SQ side under submit_mu_, CQ side under complete_mu_
  bool ring_ready_ = false;    // set once by Init
  bool sqpoll_ = false;        // set once by Init

  // Requests submitted and not yet reaped. Raised after io_uring_submit (under submit_mu_),
  // lowered by Reap (under complete_mu_); may read transiently low (never high) in between.
  std::atomic<int64_t> in_flight_{0};
  // Note [kernel handoff]: a Request* travels from Submit to Reap through the kernel, which
  // ThreadSanitizer cannot see. Submit bumps this counter (release) before the syscall and Reap
  // reads it (acquire) after it sees a CQE, which is always later, so the caller's writes to the
  // Request happen-before the reaping thread's reads, as the kernel already guarantees.
  std::atomic<uint64_t> handoff_{0};

  Mutex submit_mu_;
  internal::FileTable files_ GUARDED_BY(submit_mu_);
  std::vector<bool> fixed_ GUARDED_BY(submit_mu_);  // file index -> in fixed table
  unsigned fixed_file_slots_ = 0;  // set once by Init; 0 when fixed files are unavailable
  std::vector<iovec> buffers_ GUARDED_BY(submit_mu_);  // the registered buffers

  Mutex complete_mu_;
  std::vector<io_uring_cqe*> cqes_ GUARDED_BY(complete_mu_);  // peek batch, depth_ entries
};

}  // namespace

Result<std::unique_ptr<Backend>> CreateUringBackend(const BackendOptions& options) {
  MEMPLAN_RETURN_IF_ERROR(options.Validate());
  auto backend = std::make_unique<UringBackend>(options.queue_depth, options.submit_batch);
  MEMPLAN_RETURN_IF_ERROR(backend->Init(options));
  return std::unique_ptr<Backend>(std::move(backend));
}

}  // namespace memplan::nvme
