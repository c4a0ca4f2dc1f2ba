// The CUDA gpu::Runtime: cudaMalloc, cudaHostRegister, and cudaMemcpyAsync on one non-blocking
// stream per copy direction, with an event per copy. Compiled only where the CUDA toolkit was found
// (MEMPLAN_HAVE_CUDA); cuda_runtime_stub.cc stands in otherwise.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "common/mutex.h"
#include "gpu/cuda_check.h"
#include "gpu/cuda_runtime_internal.h"
#include "gpu/gpu_runtime.h"

namespace memplan::gpu {
namespace {

using internal::DirectionName;
using internal::kDirections;
using internal::ScopedDevice;
using internal::ValidDirection;

// Note [Event ring]: a ticket is (direction, sequence); the copy with sequence s recorded its
// completion in the event of slot s % kRingSize of its direction's ring. Events are created the
// first time their slot is used and re-recorded from then on, so a steady stream of copies creates
// none. Before slot s % kRingSize is reused for copy s, its previous copy s - kRingSize must be
// known complete (its event is about to be overwritten); copies of a direction complete in stream
// order, so it usually is, and otherwise CopyAsync waits for it: the ring bounds the copies in
// flight per direction, which is back-pressure, not a deadlock, since queued copies finish on their
// own. `completed` is the highest sequence known done (every lower one is done too). It is why a
// ticket whose slot was reused is still answered: reuse first raised `completed` past it. Wait and
// Done call into CUDA without the lane's lock; if the slot is re-recorded meanwhile they observe a
// later copy of the same stream, which implies theirs.
constexpr uint64_t kRingSize = 1024;

// Note [Blocking waits]: events are made with cudaEventBlockingSync, so a thread in Wait() or
// WaitFenceOnHost() sleeps until the copy is done instead of spinning a core in
// cudaEventSynchronize (CUDA's default), which the CPU optimizer and the NVMe threads need.
constexpr unsigned kEventFlags = cudaEventDisableTiming | cudaEventBlockingSync;

// Note [Streams of the caller]: a Fence is an event recorded on the caller's stream; WaitFence
// queues cudaStreamWaitEvent on a copy stream, which captures the event's state at that call, so
// the copy stream waits for exactly the work the fence marked, and the event may be re-recorded
// at once. Fences come and go by the thousand (one per Release), so their events are recycled
// through a pool; the pool is shared with the fences (a fence may outlive nothing of the runtime
// but its pool), and destroys its events when the last of them is gone.
class EventPool {
 public:
  explicit EventPool(int device) : device_(device) {}
  ~EventPool() {
    ScopedDevice device(device_);
    (void)device.Enter();
    for (cudaEvent_t event : free_) (void)cudaEventDestroy(event);
    (void)cudaGetLastError();
  }
  // An event of the pool's device; the caller's device must be current.
  Result<cudaEvent_t> Take() {
    {
      MutexLock lock(&mu_);
      if (!free_.empty()) {
        cudaEvent_t event = free_.back();
        free_.pop_back();
        return event;
      }
    }
    cudaEvent_t event = nullptr;
    MEMPLAN_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&event, kEventFlags));
    return event;
  }
  void Give(cudaEvent_t event) {
    MutexLock lock(&mu_);
    free_.push_back(event);
  }

 private:
  const int device_;
  Mutex mu_;
  std::vector<cudaEvent_t> free_ GUARDED_BY(mu_);
};

struct FenceState {
  const void* owner = nullptr;  // the runtime that recorded it
  cudaEvent_t event = nullptr;
  std::shared_ptr<EventPool> pool;
  ~FenceState() {
    if (event != nullptr) pool->Give(event);
  }
};

struct Slot {
  cudaEvent_t event = nullptr;
  uint64_t sequence = 0;  // the copy whose completion the event records; 0: none yet
};

struct StreamLane {
  Mutex mu;
  cudaStream_t stream = nullptr;  // created by Init, destroyed by the destructor; fixed between
  std::vector<Slot> ring GUARDED_BY(mu);  // kRingSize slots
  uint64_t submitted GUARDED_BY(mu) = 0;  // the last sequence handed out
  uint64_t completed GUARDED_BY(mu) = 0;  // every sequence <= completed is done
  Status error GUARDED_BY(mu);            // the first error Wait has not reported yet
};

cudaMemcpyKind KindOf(CopyDirection direction) {
  switch (direction) {
    case CopyDirection::kHostToDevice: return cudaMemcpyHostToDevice;
    case CopyDirection::kDeviceToHost: return cudaMemcpyDeviceToHost;
    case CopyDirection::kDeviceToDevice: return cudaMemcpyDeviceToDevice;
  }
  return cudaMemcpyDefault;
}

// Keeps the first error of several.
void KeepFirst(Status& first, const Status& next) {
  if (first.ok() && !next.ok()) first = next;
}

// Hands out the lane's unreported error, if any, and forgets it.
Status TakeError(StreamLane& lane) REQUIRES(lane.mu) {
  return std::exchange(lane.error, Status::Ok());
}

class CudaRuntime final : public Runtime {
 public:
  static Result<std::unique_ptr<Runtime>> Create(int device);

  CudaRuntime(const CudaRuntime&) = delete;
  CudaRuntime& operator=(const CudaRuntime&) = delete;

  // Waits for the queued copies, then releases what is left: events, streams, device memory and
  // registrations. Errors cannot be reported from here and are ignored (at process exit the CUDA
  // runtime may already be unloading, and every call fails with cudaErrorCudartUnloading).
  ~CudaRuntime() override {
    ScopedDevice device(device_);
    (void)device.Enter();
    for (StreamLane& lane : lanes_) {
      if (lane.stream != nullptr) (void)cudaStreamSynchronize(lane.stream);
    }
    for (StreamLane& lane : lanes_) {
      for (Slot& slot : lane.ring) {
        if (slot.event != nullptr) (void)cudaEventDestroy(slot.event);
      }
      if (lane.stream != nullptr) (void)cudaStreamDestroy(lane.stream);
    }
    events_.reset();  // outstanding fences keep the pool alive until they go
    for (const auto& [ptr, bytes] : device_memory_) (void)cudaFree(ptr);
    for (const auto& [ptr, bytes] : registered_) (void)cudaHostUnregister(ptr);
    (void)cudaGetLastError();
  }

  std::string_view Name() const override { return name_; }
  bool has_device() const override { return true; }
  int device() const override { return device_; }
  const std::string& description() const { return description_; }

  Status RegisterHost(void* ptr, uint64_t bytes) override {
    if (ptr == nullptr || bytes == 0) {
      return Status::InvalidArgument(name_ +
                                     ": RegisterHost needs a non-null pointer and bytes > 0");
    }
    MEMPLAN_CUDA_ON_DEVICE(device_);
    // Portable: pinned for every device's context, so a buffer may serve more than one GPU.
    MEMPLAN_CUDA_RETURN_IF_ERROR(cudaHostRegister(ptr, bytes, cudaHostRegisterPortable));
    MutexLock lock(&mem_mu_);
    registered_.emplace(ptr, bytes);
    return Status::Ok();
  }

  Status UnregisterHost(void* ptr) override {
    {
      MutexLock lock(&mem_mu_);
      if (registered_.erase(ptr) == 0) {
        return Status::InvalidArgument(name_ +
                                       ": UnregisterHost of memory that was not registered");
      }
    }
    // Whatever happens, the memory is forgotten: the caller frees it next.
    MEMPLAN_CUDA_ON_DEVICE(device_);
    MEMPLAN_CUDA_RETURN_IF_ERROR(cudaHostUnregister(ptr));
    return Status::Ok();
  }

  Result<void*> AllocateDevice(uint64_t bytes) override {
    if (bytes == 0) return Status::InvalidArgument(name_ + ": AllocateDevice needs bytes > 0");
    MEMPLAN_CUDA_ON_DEVICE(device_);
    void* ptr = nullptr;
    const cudaError_t err = cudaMalloc(&ptr, bytes);
    if (err == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      size_t free_bytes = 0;
      size_t total_bytes = 0;
      std::string room;
      if (cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess) {
        room = " (" + std::to_string(free_bytes) + " of " + std::to_string(total_bytes) +
               " bytes free)";
      }
      (void)cudaGetLastError();
      return Status::ResourceExhausted(name_ + ": cannot allocate " + std::to_string(bytes) +
                                       " bytes of device memory" + room);
    }
    if (err != cudaSuccess) return MEMPLAN_CUDA_STATUS(err, "cudaMalloc(&ptr, bytes)");
    MutexLock lock(&mem_mu_);
    device_memory_.emplace(ptr, bytes);
    const uint64_t in_use = device_bytes_.fetch_add(bytes, std::memory_order_relaxed) + bytes;
    peak_device_bytes_.store(std::max(peak_device_bytes_.load(std::memory_order_relaxed), in_use),
                             std::memory_order_relaxed);
    return ptr;
  }

  Status FreeDevice(void* ptr) override {
    if (ptr == nullptr) return Status::Ok();
    MEMPLAN_CUDA_ON_DEVICE(device_);
    {
      MutexLock lock(&mem_mu_);
      auto it = device_memory_.find(ptr);
      if (it == device_memory_.end()) {
        return Status::InvalidArgument(
            name_ +
            ": FreeDevice of a pointer AllocateDevice did not return (or that was already freed)");
      }
      device_bytes_.fetch_sub(it->second, std::memory_order_relaxed);
      device_memory_.erase(it);
    }
    // A cudaFree that fails does so on a broken context, where the memory is lost either way; the
    // accounting above has already let it go.
    MEMPLAN_CUDA_RETURN_IF_ERROR(cudaFree(ptr));
    return Status::Ok();
  }

  uint64_t device_bytes_in_use() const override {
    return device_bytes_.load(std::memory_order_relaxed);
  }

  Result<CopyTicket> CopyAsync(CopyDirection direction, void* dst, const void* src,
                               uint64_t bytes) override {
    if (!ValidDirection(direction)) {
      return Status::InvalidArgument(name_ + ": CopyAsync with an invalid direction");
    }
    if (bytes == 0) return CopyTicket{direction, 0};
    if (dst == nullptr || src == nullptr) {
      return Status::InvalidArgument(name_ + ": " + DirectionName(direction) + " copy of " +
                                     std::to_string(bytes) + " bytes with a null buffer");
    }
    MEMPLAN_CUDA_ON_DEVICE(device_);
    StreamLane& lane = lanes_[static_cast<int>(direction)];
    // Held across the enqueue so that sequence order is stream order.
    MutexLock lock(&lane.mu);
    const uint64_t sequence = lane.submitted + 1;
    Slot& slot = lane.ring[sequence % kRingSize];
    if (slot.event == nullptr) {
      cudaEvent_t event = nullptr;  // assigned only on success: the destructor destroys it
      MEMPLAN_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&event, kEventFlags));
      slot.event = event;
    } else if (slot.sequence > lane.completed) {
      // The ring is full; see Note [Event ring].
      MEMPLAN_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(slot.event));
      lane.completed = slot.sequence;
    }
    MEMPLAN_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, KindOf(direction), lane.stream));
    // Should this fail, the copy above still runs, in order, without a ticket: Synchronize and any
    // later ticket's Wait cover it.
    MEMPLAN_CUDA_RETURN_IF_ERROR(cudaEventRecord(slot.event, lane.stream));
    slot.sequence = sequence;
    lane.submitted = sequence;
    return CopyTicket{direction, sequence};
  }

  Status Wait(CopyTicket ticket) override {
    if (!ValidDirection(ticket.direction)) {
      return Status::InvalidArgument(name_ + ": a ticket with an invalid direction");
    }
    if (ticket.sequence == 0) return Status::Ok();
    StreamLane& lane = lanes_[static_cast<int>(ticket.direction)];
    cudaEvent_t event = nullptr;
    {
      MutexLock lock(&lane.mu);
      if (ticket.sequence > lane.submitted) return NeverIssued(ticket);
      if (ticket.sequence <= lane.completed) return TakeError(lane);
      event = lane.ring[ticket.sequence % kRingSize].event;
    }
    MEMPLAN_CUDA_ON_DEVICE(device_);
    // Outside the lock, so other threads keep queueing while this one blocks.
    const cudaError_t err = cudaEventSynchronize(event);
    MutexLock lock(&lane.mu);
    if (err != cudaSuccess) {
      KeepFirst(lane.error, MEMPLAN_CUDA_STATUS(err, "cudaEventSynchronize(copy event)"));
      return TakeError(lane);
    }
    lane.completed = std::max(lane.completed, ticket.sequence);
    return TakeError(lane);
  }

  bool Done(CopyTicket ticket) override {
    if (!ValidDirection(ticket.direction) || ticket.sequence == 0) return true;
    StreamLane& lane = lanes_[static_cast<int>(ticket.direction)];
    cudaEvent_t event = nullptr;
    {
      MutexLock lock(&lane.mu);
      // A ticket never issued is "done": Wait answers it at once, with the error.
      if (ticket.sequence > lane.submitted || ticket.sequence <= lane.completed) return true;
      event = lane.ring[ticket.sequence % kRingSize].event;
    }
    ScopedDevice device(device_);
    if (Status entered = device.Enter(); !entered.ok()) {
      MutexLock lock(&lane.mu);
      KeepFirst(lane.error, entered);
      return true;  // Wait reports it
    }
    const cudaError_t err = cudaEventQuery(event);
    if (err == cudaErrorNotReady) (void)cudaGetLastError();  // not an error; PyTorch clears it too
    MutexLock lock(&lane.mu);
    if (err == cudaSuccess) {
      lane.completed = std::max(lane.completed, ticket.sequence);
      return true;
    }
    if (err == cudaErrorNotReady) return ticket.sequence <= lane.completed;
    KeepFirst(lane.error, MEMPLAN_CUDA_STATUS(err, "cudaEventQuery(copy event)"));
    return true;
  }

  Status Synchronize() override {
    MEMPLAN_CUDA_ON_DEVICE(device_);
    Status first;
    for (StreamLane& lane : lanes_) {
      uint64_t target;
      {
        MutexLock lock(&lane.mu);
        target = lane.submitted;
      }
      const cudaError_t err = cudaStreamSynchronize(lane.stream);
      MutexLock lock(&lane.mu);
      if (err != cudaSuccess) {
        KeepFirst(lane.error, MEMPLAN_CUDA_STATUS(err, "cudaStreamSynchronize(copy stream)"));
      } else {
        lane.completed = std::max(lane.completed, target);
      }
      KeepFirst(first, TakeError(lane));
    }
    return first;
  }

  uint64_t peak_device_bytes() const override {
    return peak_device_bytes_.load(std::memory_order_relaxed);
  }

  Result<Fence> RecordFence(Stream stream) override {
    MEMPLAN_CUDA_ON_DEVICE(device_);
    auto state = std::make_shared<FenceState>();
    state->owner = this;
    state->pool = events_;
    MEMPLAN_ASSIGN_OR_RETURN(cudaEvent_t event, events_->Take());
    const cudaError_t err = cudaEventRecord(event, static_cast<cudaStream_t>(stream.handle));
    if (err != cudaSuccess) {
      events_->Give(event);
      return MEMPLAN_CUDA_STATUS(err, "cudaEventRecord(fence, caller's stream)")
          .WithPrefix(name_ + ": the caller's stream (of another device?)");
    }
    state->event = event;
    return Fence(std::shared_ptr<void>(std::move(state)));
  }

  Status WaitFence(CopyDirection direction, const Fence& fence) override {
    if (!ValidDirection(direction)) {
      return Status::InvalidArgument(name_ + ": WaitFence with an invalid direction");
    }
    if (fence.empty()) return Status::Ok();
    MEMPLAN_ASSIGN_OR_RETURN(cudaEvent_t event, EventOf(fence));
    MEMPLAN_CUDA_ON_DEVICE(device_);
    StreamLane& lane = lanes_[static_cast<int>(direction)];
    MutexLock lock(&lane.mu);  // ordered with CopyAsync's enqueues
    MEMPLAN_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(lane.stream, event, 0));
    return Status::Ok();
  }

  Status WaitFenceOnHost(const Fence& fence) override {
    if (fence.empty()) return Status::Ok();
    MEMPLAN_ASSIGN_OR_RETURN(cudaEvent_t event, EventOf(fence));
    MEMPLAN_CUDA_ON_DEVICE(device_);
    MEMPLAN_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(event));
    return Status::Ok();
  }

  Stream CopyStream(CopyDirection direction) const override {
    if (!ValidDirection(direction)) return Stream();
    return Stream{lanes_[static_cast<int>(direction)].stream};
  }

 private:
  CudaRuntime(int device, std::string description)
      : device_(device),
        name_("cuda:" + std::to_string(device)),
        description_(std::move(description)),
        events_(std::make_shared<EventPool>(device)) {}

  Result<cudaEvent_t> EventOf(const Fence& fence) const {
    const auto* state = static_cast<const FenceState*>(fence.state());
    if (state->owner != this) {
      return Status::InvalidArgument(name_ + ": a fence another runtime recorded");
    }
    return state->event;
  }

  // Creates the streams. On failure the destructor releases what was made.
  Status Init() {
    MEMPLAN_CUDA_ON_DEVICE(device_);
    for (StreamLane& lane : lanes_) {
      {
        MutexLock lock(&lane.mu);  // no other thread has the runtime yet; for the analysis
        lane.ring.resize(kRingSize);
      }
      cudaStream_t stream = nullptr;  // assigned only on success: the destructor destroys it
      MEMPLAN_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      lane.stream = stream;
    }
    return Status::Ok();
  }

  Status NeverIssued(CopyTicket ticket) const {
    return Status::InvalidArgument(name_ + ": " + DirectionName(ticket.direction) + " ticket " +
                                   std::to_string(ticket.sequence) +
                                   " was never issued by this runtime");
  }

  const int device_;
  const std::string name_;
  const std::string description_;
  std::array<StreamLane, kDirections> lanes_;  // indexed by CopyDirection

  mutable Mutex mem_mu_;
  std::map<void*, uint64_t> device_memory_ GUARDED_BY(mem_mu_);  // cudaMalloc'd pointer -> bytes
  std::map<void*, uint64_t> registered_ GUARDED_BY(mem_mu_);     // registered pointer -> bytes
  std::atomic<uint64_t> device_bytes_{0};       // written under mem_mu_, read without
  std::atomic<uint64_t> peak_device_bytes_{0};  // written under mem_mu_, read without
  std::shared_ptr<EventPool> events_;           // the fences' events (Note [Streams of the caller])
};

Result<std::unique_ptr<Runtime>> CudaRuntime::Create(int device) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    // Any error here means no GPU we could use: no driver, a driver older than this runtime, no
    // device node in a container, CUDA_VISIBLE_DEVICES naming nothing...
    (void)cudaGetLastError();
    return Status::Unavailable(std::string("no usable GPU: cudaGetDeviceCount failed: ") +
                               cudaGetErrorString(err) + " (" + cudaGetErrorName(err) + ")");
  }
  if (count == 0) return Status::Unavailable("no usable GPU: CUDA sees no device");
  if (device == kCurrentDevice) {
    // The caller's choice (torch.cuda.set_device), read without creating a context.
    MEMPLAN_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  }
  if (device < 0 || device >= count) {
    return Status::InvalidArgument("no CUDA device " + std::to_string(device) +
                                   ": the machine has " + std::to_string(count));
  }
  cudaDeviceProp prop{};
  {
    // Creating the device's context is where an exclusive-process GPU already in use, or one out of
    // memory, first fails: also "no usable GPU".
    ScopedDevice scoped(device);
    Status s = scoped.Enter();
    if (s.ok()) {
      const cudaError_t ctx = cudaFree(nullptr);
      if (ctx != cudaSuccess) s = MEMPLAN_CUDA_STATUS(ctx, "cudaFree(nullptr) (context creation)");
    }
    if (!s.ok()) {
      return Status::Unavailable("no usable GPU: cuda:" + std::to_string(device) + ": " +
                                 s.message());
    }
    MEMPLAN_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, device));
  }
  char memory[32];
  std::snprintf(memory, sizeof(memory), "%.1f GiB",
                static_cast<double>(prop.totalGlobalMem) / (1024.0 * 1024.0 * 1024.0));
  std::string description = std::string(prop.name) + ", " + memory + ", compute capability " +
                            std::to_string(prop.major) + "." + std::to_string(prop.minor);
  std::unique_ptr<CudaRuntime> runtime(new CudaRuntime(device, std::move(description)));
  MEMPLAN_RETURN_IF_ERROR(runtime->Init());
  return std::unique_ptr<Runtime>(std::move(runtime));
}

}  // namespace

Result<std::unique_ptr<Runtime>> CreateCudaRuntime(int device) {
  return CudaRuntime::Create(device);
}

namespace internal {

int CudaDeviceOf(const Runtime& runtime) {
  const auto* cuda = dynamic_cast<const CudaRuntime*>(&runtime);
  return cuda != nullptr ? cuda->device() : -1;
}

std::string CudaDescription(const Runtime& runtime) {
  const auto* cuda = dynamic_cast<const CudaRuntime*>(&runtime);
  return cuda != nullptr ? cuda->description() : std::string();
}

}  // namespace internal
}  // namespace memplan::gpu
