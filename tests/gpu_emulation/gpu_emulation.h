// The emulated GPU's test controls. The emulation itself (README.md beside this file) is a shared
// library that exports the subset of the CUDA runtime and NCCL APIs memplan calls, linked in place
// of libcudart and libnccl in a -DMEMPLAN_GPU_EMULATION=ON build; this header is what tests add on
// top: configuration, counters, fault injection, "kernels" on a stream, and a caching-allocator
// stub like PyTorch's.
//
// Test code only: nothing installed includes this header or links the library.
//
// Thread safety: every function may be called from any thread.
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace memplan::gpu_emulation {

constexpr int kMaxDevices = 8;

struct Config {
  int devices = 2;                             // 1..kMaxDevices
  uint64_t device_bytes = uint64_t{80} << 30;  // per device; sparse (a memfd), so 80 GiB is cheap
  uint64_t seed = 1;                           // the streams' random delays derive from it
  uint32_t max_delay_us = 200;                 // each stream operation starts 0..max µs late
  // A rank waiting this long in a collective (or in communicator init) for its peers fails with
  // ncclSystemError and a message naming the ranks missing and the calls each rank issued.
  std::chrono::milliseconds collective_timeout{20000};
  int nccl_version = 22809;  // what ncclGetVersion answers (2.28.9); bf16 needs >= 21000
};

// Replaces the configuration. Everything must be idle and released first: no device memory, no
// streams or events, no registered host memory, no communicators; the process aborts with a
// message otherwise (a test that leaked). Counters and fault injections are reset too, and every
// device's context is "not created" again. The first use of the emulation reads the configuration
// from the environment: MEMPLAN_GPU_EMULATION_DEVICES, _DEVICE_BYTES, _SEED, _MAX_DELAY_US.
void Reset(const Config& config);
Config CurrentConfig();

struct Counters {
  uint64_t h2d_pinned_bytes = 0;    // host -> device from registered host memory (asynchronous)
  uint64_t h2d_pageable_bytes = 0;  // ... from pageable memory (staged: the host waits)
  uint64_t d2h_pinned_bytes = 0;
  uint64_t d2h_pageable_bytes = 0;  // device -> pageable host memory: synchronous
  uint64_t d2d_bytes = 0;
  uint64_t pageable_copies = 0;     // copies that made the host wait for their stream
  uint64_t stream_syncs = 0;        // cudaStreamSynchronize calls
  uint64_t event_syncs = 0;         // cudaEventSynchronize calls
  uint64_t spin_waits = 0;          // ... on an event without cudaEventBlockingSync (a busy core)
  uint64_t device_syncs = 0;        // cudaDeviceSynchronize, and cudaFree's implicit one
  uint64_t stream_wait_events = 0;  // cudaStreamWaitEvent calls that had something to wait for
  uint64_t event_records = 0;
  uint64_t mallocs = 0;
  uint64_t failed_mallocs = 0;  // cudaErrorMemoryAllocation answers
  uint64_t frees = 0;
  uint64_t kernels = 0;      // LaunchKernel calls
  uint64_t collectives = 0;  // NCCL collectives issued (all ranks)
  uint64_t device_bytes_in_use[kMaxDevices] = {};
  uint64_t peak_device_bytes[kMaxDevices] = {};  // since Reset or ResetPeaks
  bool context_created[kMaxDevices] = {};        // cudaSetDevice / first use made the context
};
Counters GetCounters();
// Peaks restart from the bytes in use now; the other counters are zeroed.
void ResetCounters();

// Fault injection: the `nth` call (1: the next one) of `function` ("cudaMemcpyAsync",
// "cudaMalloc", "ncclAllGather", ...) from now on fails with `error` (a cudaError_t, or an
// ncclResult_t for nccl* functions) and does nothing else. Several may be armed at once.
void FailNthCall(const std::string& function, uint64_t nth, int error);
void ClearFaults();

// Kernels. LaunchKernel queues `body` on `stream` (which must be a stream of the emulation, or 0
// for the current device's legacy default stream): it runs on that stream's worker after the work
// queued before it, and after the stream's random delay, as a real kernel would. Inside `body`,
// DeviceView turns a device pointer into the emulator's read-write view of it.
void LaunchKernel(cudaStream_t stream, std::function<void()> body);
// The host-addressable view of [ptr, ptr + bytes) of device memory. Meant for kernels, and for a
// test that has synchronised; aborts with a message when the range is not allocated device memory.
void* DeviceView(const void* ptr, uint64_t bytes);
// The device owning `ptr`, or -1 when it is not device memory.
int DeviceOf(const void* ptr);

// Kernel helpers: copy `bytes` of device memory into `*out` when the kernel runs (a late read, as a
// kernel reading its inputs), and write `data` into device memory when it runs.
void KernelRead(cudaStream_t stream, const void* src, uint64_t bytes,
                std::shared_ptr<std::vector<std::byte>> out);
void KernelWrite(cudaStream_t stream, void* dst, std::vector<std::byte> data);

// A stub of PyTorch's CUDA caching allocator, on the capped device memory of `device`: blocks are
// carved from cudaMalloc'd segments and cached when freed. A freed block is reused at once by an
// allocation on the stream it was allocated on (stream order makes that safe for kernels on that
// stream), which is why memory handed to another stream must be recorded on it (RecordStream, as
// tensor.record_stream): such a block is not reused until the work queued on the recorded streams
// when it was freed has finished. Not thread-safe (torch's is; tests drive it from one thread).
class CachingAllocator {
 public:
  explicit CachingAllocator(int device);
  ~CachingAllocator();  // frees the segments (the device must be idle)
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  // nullptr when the device is out of memory even after the cache was emptied.
  void* Allocate(uint64_t bytes, cudaStream_t stream);
  void Free(void* ptr);
  void RecordStream(void* ptr, cudaStream_t stream);
  uint64_t allocated_bytes() const { return allocated_; }
  uint64_t reserved_bytes() const { return reserved_; }
  uint64_t peak_allocated_bytes() const { return peak_allocated_; }

 private:
  struct Block {
    uint64_t bytes = 0;
    cudaStream_t stream = nullptr;
    std::vector<cudaStream_t> recorded;  // other streams that use it
    std::vector<cudaEvent_t> pending;    // recorded at Free on those streams; reuse waits
    bool in_use = false;
  };
  void* TakeCached(uint64_t bytes, cudaStream_t stream);
  void EmptyCache();

  const int device_;
  std::map<void*, Block> blocks_;
  uint64_t allocated_ = 0;
  uint64_t reserved_ = 0;
  uint64_t peak_allocated_ = 0;
};

}  // namespace memplan::gpu_emulation
