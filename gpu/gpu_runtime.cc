// The host-only gpu::Runtime, and the choice between it and CUDA.
#include "gpu/gpu_runtime.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <deque>
#include <iterator>
#include <map>
#include <new>
#include <string>
#include <thread>
#include <utility>

#include "common/mutex.h"
#include "gpu/cuda_runtime_internal.h"

namespace memplan::gpu {
namespace {

constexpr std::align_val_t kDeviceAlignment{256};
using internal::DirectionName;
using internal::kDirections;
using internal::ValidDirection;

// The host's physical memory: the "device" of the host-only runtime can never hold more, so a
// larger request is ResourceExhausted here instead of reaching the allocator (which, under a
// sanitizer, aborts on absurd sizes rather than returning null).
uint64_t PhysicalMemoryBytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long page = ::sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return UINT64_MAX;
  return static_cast<uint64_t>(pages) * static_cast<uint64_t>(page);
}

// Note [Host-only copy lanes]: each direction is a lane: a FIFO of copies, one worker thread that
// runs them in order, and two counters. `submitted` is the last sequence handed out, `completed`
// the last one whose memcpy has returned; since the worker runs the queue in order, every sequence
// <= completed is done, which is what makes Wait(later ticket) imply the earlier ones. The worker
// starts with the lane's first copy, so a runtime that never copies (the default one that
// PinnedPool registers with) costs no thread.
struct Copy {
  uint64_t sequence;
  void* dst;
  const void* src;
  uint64_t bytes;
};

struct ThreadLane {
  Mutex mu;
  CondVar work;  // signalled when `queue` grows or `stop` is set
  CondVar done;  // signalled when `completed` grows
  std::deque<Copy> queue GUARDED_BY(mu);
  uint64_t submitted GUARDED_BY(mu) = 0;
  uint64_t completed GUARDED_BY(mu) = 0;
  bool stop GUARDED_BY(mu) = false;
  std::thread worker GUARDED_BY(mu);  // started by the first copy; joined by the destructor
};

class HostOnlyRuntime final : public Runtime {
 public:
  HostOnlyRuntime() = default;
  HostOnlyRuntime(const HostOnlyRuntime&) = delete;
  HostOnlyRuntime& operator=(const HostOnlyRuntime&) = delete;

  ~HostOnlyRuntime() override {
    for (ThreadLane& lane : lanes_) {
      {
        MutexLock lock(&lane.mu);
        lane.stop = true;
      }
      lane.work.SignalAll();
      // The worker drains its queue before it exits, so every queued copy lands.
      if (lane.worker.joinable()) lane.worker.join();
    }
    for (const auto& [ptr, bytes] : device_) {
      ::operator delete(reinterpret_cast<void*>(ptr), kDeviceAlignment);
    }
  }

  std::string_view Name() const override { return "host-only"; }
  bool has_device() const override { return false; }

  Status RegisterHost(void* ptr, uint64_t bytes) override {
    if (ptr == nullptr || bytes == 0) {
      return Status::InvalidArgument(
          "host-only runtime: RegisterHost needs a non-null pointer and bytes > 0");
    }
    const auto begin = reinterpret_cast<uintptr_t>(ptr);
    if (bytes > UINTPTR_MAX - begin) {
      return Status::InvalidArgument("host-only runtime: RegisterHost range wraps around");
    }
    MutexLock lock(&mem_mu_);
    // Like cudaHostRegister, refuse a range that overlaps one already registered.
    auto next = registered_.lower_bound(begin);
    const bool overlaps_next = next != registered_.end() && next->first < begin + bytes;
    const bool overlaps_prev =
        next != registered_.begin() && std::prev(next)->first + std::prev(next)->second > begin;
    if (overlaps_next || overlaps_prev) {
      return Status::InvalidArgument("host-only runtime: RegisterHost of " + std::to_string(bytes) +
                                     " bytes overlaps memory already registered");
    }
    registered_.emplace(begin, bytes);
    return Status::Ok();
  }

  Status UnregisterHost(void* ptr) override {
    MutexLock lock(&mem_mu_);
    if (registered_.erase(reinterpret_cast<uintptr_t>(ptr)) == 0) {
      return Status::InvalidArgument(
          "host-only runtime: UnregisterHost of memory that was not registered");
    }
    return Status::Ok();
  }

  Result<void*> AllocateDevice(uint64_t bytes) override {
    if (bytes == 0) {
      return Status::InvalidArgument("host-only runtime: AllocateDevice needs bytes > 0");
    }
    if (bytes > PhysicalMemoryBytes()) {
      return Status::ResourceExhausted(
          "host-only runtime: cannot allocate " + std::to_string(bytes) +
          " bytes of device memory: more than the host's physical memory");
    }
    void* ptr = ::operator new(bytes, kDeviceAlignment, std::nothrow);
    if (ptr == nullptr) {
      return Status::ResourceExhausted("host-only runtime: cannot allocate " +
                                       std::to_string(bytes) + " bytes of device memory");
    }
    MutexLock lock(&mem_mu_);
    device_.emplace(reinterpret_cast<uintptr_t>(ptr), bytes);
    const uint64_t in_use = device_bytes_.fetch_add(bytes, std::memory_order_relaxed) + bytes;
    peak_device_bytes_.store(std::max(peak_device_bytes_.load(std::memory_order_relaxed), in_use),
                             std::memory_order_relaxed);
    return ptr;
  }

  Status FreeDevice(void* ptr) override {
    if (ptr == nullptr) return Status::Ok();
    {
      MutexLock lock(&mem_mu_);
      auto it = device_.find(reinterpret_cast<uintptr_t>(ptr));
      if (it == device_.end()) {
        return Status::InvalidArgument(
            "host-only runtime: FreeDevice of a pointer AllocateDevice did not return (or that was "
            "already freed)");
      }
      device_bytes_.fetch_sub(it->second, std::memory_order_relaxed);
      device_.erase(it);
    }
    ::operator delete(ptr, kDeviceAlignment);
    return Status::Ok();
  }

  uint64_t device_bytes_in_use() const override {
    return device_bytes_.load(std::memory_order_relaxed);
  }

  Result<CopyTicket> CopyAsync(CopyDirection direction, void* dst, const void* src,
                               uint64_t bytes) override {
    if (!ValidDirection(direction)) {
      return Status::InvalidArgument("host-only runtime: CopyAsync with an invalid direction");
    }
    if (bytes == 0) return CopyTicket{direction, 0};
    if (dst == nullptr || src == nullptr) {
      return Status::InvalidArgument(std::string("host-only runtime: ") + DirectionName(direction) +
                                     " copy of " + std::to_string(bytes) +
                                     " bytes with a null buffer");
    }
    ThreadLane& lane = lanes_[static_cast<int>(direction)];
    uint64_t sequence;
    {
      MutexLock lock(&lane.mu);
      if (!lane.worker.joinable()) lane.worker = std::thread([&lane] { RunLane(lane); });
      sequence = ++lane.submitted;
      lane.queue.push_back(Copy{sequence, dst, src, bytes});
    }
    lane.work.Signal();
    return CopyTicket{direction, sequence};
  }

  Status Wait(CopyTicket ticket) override {
    MEMPLAN_RETURN_IF_ERROR(CheckTicket(ticket));
    if (ticket.sequence == 0) return Status::Ok();
    ThreadLane& lane = lanes_[static_cast<int>(ticket.direction)];
    MutexLock lock(&lane.mu);
    while (lane.completed < ticket.sequence) lane.done.Wait(&lane.mu);
    return Status::Ok();  // a memcpy cannot fail
  }

  bool Done(CopyTicket ticket) override {
    if (!CheckTicket(ticket).ok()) return true;  // Wait answers at once, with the error
    if (ticket.sequence == 0) return true;
    ThreadLane& lane = lanes_[static_cast<int>(ticket.direction)];
    MutexLock lock(&lane.mu);
    return lane.completed >= ticket.sequence;
  }

  Status Synchronize() override {
    for (ThreadLane& lane : lanes_) {
      MutexLock lock(&lane.mu);
      const uint64_t target = lane.submitted;
      while (lane.completed < target) lane.done.Wait(&lane.mu);
    }
    return Status::Ok();
  }

  uint64_t peak_device_bytes() const override {
    return peak_device_bytes_.load(std::memory_order_relaxed);
  }

  // No streams here: the caller's work is done when it calls, so every fence is already passed.
  Result<Fence> RecordFence(Stream stream) override {
    if (stream.handle != nullptr) {
      return Status::InvalidArgument(
          "host-only runtime: given a GPU stream; the host-only runtime has no streams (a CUDA "
          "caller needs the CUDA runtime)");
    }
    return Fence();
  }
  Status WaitFence(CopyDirection direction, const Fence& fence) override {
    if (!ValidDirection(direction)) {
      return Status::InvalidArgument("host-only runtime: WaitFence with an invalid direction");
    }
    return CheckFence(fence);
  }
  Status WaitFenceOnHost(const Fence& fence) override { return CheckFence(fence); }
  Stream CopyStream(CopyDirection /*direction*/) const override { return Stream(); }
  int device() const override { return -1; }

 private:
  static void RunLane(ThreadLane& lane) {
    MutexLock lock(&lane.mu);
    for (;;) {
      while (!lane.stop && lane.queue.empty()) lane.work.Wait(&lane.mu);
      if (lane.queue.empty()) return;  // stopped and drained
      const Copy copy = lane.queue.front();
      lane.queue.pop_front();
      lock.Unlock();
      // memmove, not memcpy: a device-to-device copy onto itself (an in-place all-gather) is legal.
      std::memmove(copy.dst, copy.src, copy.bytes);
      lock.Lock();
      lane.completed = copy.sequence;
      lane.done.SignalAll();
    }
  }

  static Status CheckFence(const Fence& fence) {
    if (!fence.empty()) {
      return Status::InvalidArgument("host-only runtime: a fence another runtime recorded");
    }
    return Status::Ok();
  }

  Status CheckTicket(CopyTicket ticket) {
    if (!ValidDirection(ticket.direction)) {
      return Status::InvalidArgument("host-only runtime: a ticket with an invalid direction");
    }
    ThreadLane& lane = lanes_[static_cast<int>(ticket.direction)];
    MutexLock lock(&lane.mu);
    if (ticket.sequence > lane.submitted) {
      return Status::InvalidArgument(
          std::string("host-only runtime: ") + DirectionName(ticket.direction) + " ticket " +
          std::to_string(ticket.sequence) + " was never issued by this runtime");
    }
    return Status::Ok();
  }

  std::array<ThreadLane, kDirections> lanes_;  // indexed by CopyDirection

  mutable Mutex mem_mu_;
  std::map<uintptr_t, uint64_t> device_ GUARDED_BY(mem_mu_);      // address -> bytes
  std::map<uintptr_t, uint64_t> registered_ GUARDED_BY(mem_mu_);  // address -> bytes
  std::atomic<uint64_t> device_bytes_{0};       // written under mem_mu_, read without
  std::atomic<uint64_t> peak_device_bytes_{0};  // written under mem_mu_, read without
};

}  // namespace

std::unique_ptr<Runtime> CreateHostOnlyRuntime() { return std::make_unique<HostOnlyRuntime>(); }

Runtime& DefaultHostOnlyRuntime() {
  // Leaked on purpose: PinnedPools (and their destructors, which unregister) may outlive any static
  // destruction order we could pick.
  static Runtime* const runtime = new HostOnlyRuntime();
  return *runtime;
}

Status Runtime::OrderAfter(CopyDirection direction, Stream stream) {
  MEMPLAN_ASSIGN_OR_RETURN(Fence fence, RecordFence(stream));
  return WaitFence(direction, fence);
}

std::unique_ptr<Runtime> CreateBestRuntime(std::string* note, int device) {
  Result<std::unique_ptr<Runtime>> cuda = CreateCudaRuntime(device);
  if (cuda.ok()) {
    if (note != nullptr) {
      *note = std::string((*cuda)->Name()) + ": " + internal::CudaDescription(**cuda);
    }
    return std::move(cuda).value();
  }
  if (note != nullptr) *note = "host-only: " + cuda.status().message();
  return CreateHostOnlyRuntime();
}

}  // namespace memplan::gpu
