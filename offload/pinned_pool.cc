#include "offload/pinned_pool.h"

#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cassert>
#include <cerrno>
#include <cstring>
#include <string>
#include <utility>

namespace memplan::offload {
namespace {

uint64_t PageBytes() { return static_cast<uint64_t>(::sysconf(_SC_PAGESIZE)); }

// Mentions every place a memlock limit is set, because which one applies depends on how the job
// was started (a shell, a PAM login, a systemd unit or a container).
std::string MemlockAdvice() {
  return "raise it with 'ulimit -l <KiB>' (or 'ulimit -l unlimited'), a 'memlock' line in "
         "/etc/security/limits.conf, LimitMEMLOCK= in the systemd unit, or --ulimit memlock=-1 "
         "for a container";
}

// RLIMIT_MEMLOCK is checked up front so the user gets a clear message instead of a bare mlock
// ENOMEM. Conservative: the kernel exempts CAP_IPC_LOCK holders, but we apply the soft limit to
// everyone so a job behaves the same whoever starts it.
Status CheckMemlockLimit(uint64_t bytes) {
  struct rlimit limit {};
  if (::getrlimit(RLIMIT_MEMLOCK, &limit) != 0) {
    return Status::FromErrno(errno, "getrlimit(RLIMIT_MEMLOCK)");
  }
  if (limit.rlim_cur == RLIM_INFINITY || bytes <= limit.rlim_cur) return Status::Ok();
  return Status::ResourceExhausted("pinned pool needs " + std::to_string(bytes) +
                                   " bytes of locked memory but RLIMIT_MEMLOCK "
                                   "(ulimit -l) is " +
                                   std::to_string(limit.rlim_cur) + " bytes; " + MemlockAdvice());
}

}  // namespace

Status PinnedPoolOptions::Validate() const {
  if (slot_bytes == 0) return Status::InvalidArgument("pinned pool: slot_bytes must be > 0");
  if (slot_count == 0) return Status::InvalidArgument("pinned pool: slot_count must be > 0");
  if (budget_bytes == 0) return Status::InvalidArgument("pinned pool: budget_bytes must be > 0");
  const uint64_t page = PageBytes();
  if (slot_bytes > UINT64_MAX - page) {
    return Status::InvalidArgument("pinned pool: slot_bytes too large");
  }
  const uint64_t rounded = (slot_bytes + page - 1) / page * page;
  if (rounded > budget_bytes / slot_count) {
    return Status::InvalidArgument("pinned pool: slot_count " + std::to_string(slot_count) +
                                   " x slot_bytes " + std::to_string(rounded) +
                                   " (page-rounded) exceeds budget_bytes " +
                                   std::to_string(budget_bytes));
  }
  return Status::Ok();
}

Result<std::unique_ptr<PinnedPool>> PinnedPool::Create(const PinnedPoolOptions& options,
                                                       gpu::Runtime* runtime) {
  MEMPLAN_RETURN_IF_ERROR(options.Validate());
  const uint64_t page = PageBytes();
  const uint64_t slot_bytes = (options.slot_bytes + page - 1) / page * page;
  const uint64_t total = slot_bytes * options.slot_count;
  if (options.lock_memory) MEMPLAN_RETURN_IF_ERROR(CheckMemlockLimit(total));
  NodeReservation reservation;
  if (!options.node_budget_name.empty()) {
    MEMPLAN_ASSIGN_OR_RETURN(
        std::shared_ptr<NodeBudget> budget,
        NodeBudget::Open({options.node_budget_name, options.node_budget_bytes}));
    MEMPLAN_ASSIGN_OR_RETURN(reservation, budget->Reserve(total));
  }
  // mmap rather than new: page alignment for O_DIRECT and DMA, and the memory goes back to the OS
  // at destruction instead of staying in the heap.
  void* base = ::mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED) {
    return Status::FromErrno(errno, "pinned pool: mmap of " + std::to_string(total) + " bytes");
  }
  // Note [Pinned memory and fork]: a fork (a DataLoader worker, a subprocess) would otherwise share
  // these pages copy-on-write; the first write to them in either process then moves the parent's
  // page to a new physical page behind the back of the DMA engine, which keeps writing the old one
  // (silently lost copies), and the child holds pinned memory it never uses. MADV_DONTFORK keeps
  // the mapping out of children, as CUDA's own pinned allocations are kept.
  if (::madvise(base, total, MADV_DONTFORK) != 0) {
    const int err = errno;
    ::munmap(base, total);
    return Status::FromErrno(err, "pinned pool: madvise(MADV_DONTFORK)");
  }
  if (options.lock_memory && ::mlock(base, total) != 0) {
    const int err = errno;
    ::munmap(base, total);
    return Status::ResourceExhausted("pinned pool: mlock of " + std::to_string(total) +
                                     " bytes failed (" + std::string(std::strerror(err)) + "); " +
                                     MemlockAdvice());
  }
  if (runtime == nullptr) runtime = &gpu::DefaultHostOnlyRuntime();
  // Note [No runtime call under the lock]: registration can take the GPU runtime's global lock
  // and be slow; doing it once here, before the pool exists and so before any lock of ours, keeps
  // Acquire/Release from ever waiting on the runtime (PyTorch's CachingHostAllocator rule).
  if (Status s = runtime->RegisterHost(base, total); !s.ok()) {
    ::munmap(base, total);
    return s.WithPrefix("pinned pool: registering with " + std::string(runtime->Name()));
  }
  return std::unique_ptr<PinnedPool>(new PinnedPool(
      options, slot_bytes, static_cast<std::byte*>(base), runtime, std::move(reservation)));
}

PinnedPool::PinnedPool(const PinnedPoolOptions& options, uint64_t slot_bytes, std::byte* base,
                       gpu::Runtime* runtime, NodeReservation reservation)
    : options_(options),
      slot_bytes_(slot_bytes),
      slot_count_(options.slot_count),
      base_(base),
      runtime_(runtime),
      reservation_(std::move(reservation)) {
  // Lowest index on top, so a lightly used pool touches the same slots (and pages) again.
  free_.reserve(slot_count_);
  for (uint64_t i = slot_count_; i > 0; --i) free_.push_back(i - 1);
  stats_.capacity_bytes = slot_bytes_ * slot_count_;
}

PinnedPool::~PinnedPool() {
  assert(free_.size() == slot_count_ && "PinnedPool destroyed with slots still acquired");
  // Outside any lock; see Note [No runtime call under the lock]. A failure cannot be reported
  // from a destructor, and the memory is freed below either way.
  (void)runtime_->UnregisterHost(base_);
  ::munmap(base_, slot_bytes_ * slot_count_);  // also unlocks
}

Result<PinnedSlot> PinnedPool::Acquire(std::optional<std::chrono::microseconds> timeout) {
  MutexLock lock(&mu_);
  if (free_.empty()) {
    if (!options_.wait) {
      ++stats_.failures;
      return Status::ResourceExhausted("pinned pool: all " + std::to_string(slot_count_) +
                                       " slots of " + std::to_string(slot_bytes_) +
                                       " bytes are in use");
    }
    ++stats_.waits;
    const auto start = std::chrono::steady_clock::now();
    if (timeout) {
      const auto deadline = start + *timeout;
      while (free_.empty() && slot_freed_.WaitUntil(&mu_, deadline)) {
      }
    } else {
      while (free_.empty()) slot_freed_.Wait(&mu_);
    }
    const bool got = !free_.empty();
    stats_.wait_time_us +=
        static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::microseconds>(
                                  std::chrono::steady_clock::now() - start)
                                  .count());
    if (!got) {
      ++stats_.failures;
      return Status::Unavailable("pinned pool: no slot was released within " +
                                 std::to_string(timeout->count()) + " us");
    }
  }
  const uint64_t index = free_.back();
  free_.pop_back();
  ++stats_.acquires;
  stats_.current_bytes += slot_bytes_;
  if (stats_.current_bytes > stats_.peak_bytes) stats_.peak_bytes = stats_.current_bytes;
  return PinnedSlot(this, index, std::span<std::byte>(base_ + index * slot_bytes_, slot_bytes_));
}

void PinnedPool::Release(uint64_t index) {
  {
    MutexLock lock(&mu_);
    free_.push_back(index);
    stats_.current_bytes -= slot_bytes_;
  }
  slot_freed_.Signal();
}

PinnedPoolStats PinnedPool::stats() const {
  MutexLock lock(&mu_);
  return stats_;
}

PinnedSlot::PinnedSlot(PinnedSlot&& other) noexcept
    : pool_(std::exchange(other.pool_, nullptr)), index_(other.index_), data_(other.data_) {
  other.data_ = {};
}

PinnedSlot& PinnedSlot::operator=(PinnedSlot&& other) noexcept {
  if (this != &other) {
    Release();
    pool_ = std::exchange(other.pool_, nullptr);
    index_ = other.index_;
    data_ = std::exchange(other.data_, {});
  }
  return *this;
}

void PinnedSlot::Release() {
  if (pool_ == nullptr) return;
  std::exchange(pool_, nullptr)->Release(index_);
  data_ = {};
}

}  // namespace memplan::offload
