// gpu::Runtime: the seam through which the offload engine uses a GPU: page-locking ("registering")
// host memory it allocated itself, device memory, and asynchronous copies between the two on
// dedicated streams, one per direction, so that uploads, downloads and compute overlap.
//
// Two implementations:
//   - The host-only runtime (CreateHostOnlyRuntime): for machines without a GPU. "Device" memory
//     is ordinary host memory and a copy is a memcpy run by one worker thread per direction, in
//     submission order, so the whole engine runs and is tested on any machine, with real
//     asynchrony. Registering host memory only records the range, so that unregistering what was
//     never registered is caught here as it would be by CUDA.
//   - The CUDA runtime (CreateCudaRuntime, built where the toolkit is found): cudaMalloc,
//     cudaHostRegister, cudaMemcpyAsync on one non-blocking stream per direction, and an event per
//     copy. Every CUDA call is checked; errors come back as Status naming the call, the CUDA error
//     and the file and line.
//
// Copies. CopyAsync() queues a copy on the direction's stream and returns a ticket; copies of one
// direction complete in submission order. Wait(ticket) blocks until that copy (and so every
// earlier one of its direction) is done, and returns the first error of that direction since the
// last Wait that reported one; a ticket this runtime never issued is InvalidArgument. Done(ticket)
// polls; it also answers true when the copy failed (Wait then says how). Host buffers of copies
// should be registered or pinned (CUDA otherwise copies synchronously through a staging buffer);
// both buffers must stay valid and untouched until the copy is waited for. Destroying a runtime
// waits for the copies it has queued.
//
// Streams of the caller (Note [Streams of the caller] in cuda_runtime.cc). The trainer computes
// on streams of its own (PyTorch's current stream), which the runtime's copy streams know nothing
// of. A caller that hands the runtime a buffer its own kernels use says on which stream they were
// queued (a Stream), and the runtime orders against it with a Fence: RecordFence(stream) marks the
// work queued on that stream so far, WaitFence(direction, fence) makes the direction's later
// copies start after that work (cudaEventRecord + cudaStreamWaitEvent; no thread waits). The
// reverse, the caller's stream waiting for a copy, is the caller's: CopyStream(direction) names the
// stream a direction's copies run on (for tensor.record_stream, so that PyTorch's caching
// allocator does not reuse a buffer the copy still reads).
//
// These calls may be slow and may take the runtime's own locks (cudaHostRegister serialises with
// every other CUDA call in the process), so callers never make them while holding a lock of their
// own; see Note [No runtime call under the lock] in offload/pinned_pool.cc.
//
// Thread safety: implementations are safe to call from any thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>

#include "common/status.h"

namespace memplan::gpu {

// Each direction has its own stream (CUDA) or worker thread (host-only), so copies of different
// directions overlap, and are not ordered with each other: a buffer one direction writes must not
// be touched by another until that copy is waited for. kDeviceToDevice copies between two buffers
// of device memory (the single-process collective's all-gather and reduce-scatter).
enum class CopyDirection { kHostToDevice, kDeviceToHost, kDeviceToDevice };

// Identifies one queued copy. Tickets of one direction increase in submission order.
struct CopyTicket {
  CopyDirection direction = CopyDirection::kHostToDevice;
  uint64_t sequence = 0;  // 0: no copy (an empty ticket, already done)
};

// A stream of the caller's, by its native handle: on the CUDA runtime a cudaStream_t of the
// runtime's device; nullptr is the legacy default stream (PyTorch's default stream), which CUDA
// orders after every blocking stream's earlier work. The host-only runtime has no streams (its
// callers' work is done when they call it) and refuses a non-null handle: a CUDA stream given to
// the host runtime is a mix-up of runtimes.
struct Stream {
  void* handle = nullptr;
};

// A point in a stream: the work queued on it before RecordFence() returned it. Copyable; the
// runtime recycles what backs it when the last copy is gone. An empty Fence (the default, and every
// fence of the host-only runtime) is already passed. Must not outlive the runtime that made it.
class Fence {
 public:
  Fence() = default;
  explicit Fence(std::shared_ptr<void> state) : state_(std::move(state)) {}
  bool empty() const { return state_ == nullptr; }
  void* state() const { return state_.get(); }  // for the runtime that made it

 private:
  std::shared_ptr<void> state_;
};

// The calling thread's current CUDA device: the default wherever a device can be chosen.
constexpr int kCurrentDevice = -1;

class Runtime {
 public:
  virtual ~Runtime() = default;

  // A short name for messages and logs ("host-only", "cuda:0").
  virtual std::string_view Name() const = 0;
  // True for a real GPU (device memory is not host-addressable).
  virtual bool has_device() const = 0;

  // Registers [ptr, ptr + bytes) with the runtime. The caller keeps ownership of the memory and
  // must call UnregisterHost(ptr) before freeing it. On failure nothing is registered.
  virtual Status RegisterHost(void* ptr, uint64_t bytes) = 0;
  // Undoes RegisterHost(ptr). Unregistering memory that was not registered is an error.
  virtual Status UnregisterHost(void* ptr) = 0;

  // Device memory of `bytes` (> 0) bytes, 256-byte aligned; ResourceExhausted when the device has
  // no room. FreeDevice(nullptr) is a no-op; freeing a pointer AllocateDevice did not return (or
  // returned and was already freed) is InvalidArgument. Memory still allocated when the runtime is
  // destroyed is freed then.
  virtual Result<void*> AllocateDevice(uint64_t bytes) = 0;
  virtual Status FreeDevice(void* ptr) = 0;
  // Bytes of device memory this runtime has allocated and not freed.
  virtual uint64_t device_bytes_in_use() const = 0;

  // Queues a copy of `bytes` bytes (host -> device: dst on the device, src on the host; device ->
  // host: the reverse; device -> device: both on the device). bytes == 0 returns an empty ticket;
  // a null buffer with bytes > 0 is InvalidArgument. The CUDA runtime blocks here when 1024 copies
  // of the direction are already in flight (its ring of events is full) until the oldest is done.
  virtual Result<CopyTicket> CopyAsync(CopyDirection direction, void* dst, const void* src,
                                       uint64_t bytes) = 0;
  virtual Status Wait(CopyTicket ticket) = 0;
  virtual bool Done(CopyTicket ticket) = 0;
  // Waits for every copy queued so far in every direction; returns the first error of any
  // direction not yet reported by Wait (and so reports it).
  virtual Status Synchronize() = 0;

  // The most device bytes this runtime has had allocated at once (device_bytes_in_use()'s peak),
  // counted at every allocation, so that it compares with what cudaMemGetInfo saw.
  virtual uint64_t peak_device_bytes() const = 0;

  // See "Streams of the caller" above. RecordFence: InvalidArgument for a stream this runtime
  // cannot use (the host-only runtime: any non-null handle; CUDA: a stream of another device, as
  // cudaEventRecord says). WaitFence: the direction's copies queued after this call start after the
  // fence's work; InvalidArgument for a fence of another runtime. WaitFenceOnHost blocks the
  // calling thread until the fence's work is done.
  virtual Result<Fence> RecordFence(Stream stream) = 0;
  virtual Status WaitFence(CopyDirection direction, const Fence& fence) = 0;
  virtual Status WaitFenceOnHost(const Fence& fence) = 0;
  // RecordFence(stream) then WaitFence(direction, it): `direction`'s later copies follow the work
  // queued on `stream` so far.
  Status OrderAfter(CopyDirection direction, Stream stream);
  // The native stream `direction`'s copies run on (a cudaStream_t); {} on the host-only runtime.
  virtual Stream CopyStream(CopyDirection direction) const = 0;
  // The CUDA device ordinal, -1 for the host-only runtime.
  virtual int device() const = 0;
};

// A runtime for machines without a GPU (see the header comment). Its copy threads start on the
// first copy and stop in the destructor, after finishing the copies queued.
std::unique_ptr<Runtime> CreateHostOnlyRuntime();

// The process-wide host-only runtime; never destroyed, safe from any thread.
Runtime& DefaultHostOnlyRuntime();

// The CUDA runtime on `device` (kCurrentDevice: the calling thread's current device, as PyTorch's
// torch.cuda.set_device leaves it; device 0 on a thread that never chose one). Unavailable when
// this build has no CUDA or the machine no usable GPU (any error from cudaGetDeviceCount counts as
// "no GPU"; the message says which); InvalidArgument when `device` is not one of the machine's
// GPUs.
Result<std::unique_ptr<Runtime>> CreateCudaRuntime(int device = kCurrentDevice);

// CUDA (on `device`, as above) when a GPU is usable, else host-only; `note` (optional) says which
// and why. An invalid `device` on a machine with GPUs is not "no GPU": it falls back too, and the
// note says so; callers that must not run on the host ask CreateCudaRuntime.
std::unique_ptr<Runtime> CreateBestRuntime(std::string* note = nullptr,
                                           int device = kCurrentDevice);

}  // namespace memplan::gpu
