// DeviceArena: one allocation of device memory, made once, that the offload engine carves its GPU
// buffers from.
//
// Why: the engine shares the GPU with the trainer, whose own allocator (PyTorch's caching
// allocator) must know how much it can have. Buffers allocated one cudaMalloc each, and cached by
// exact size, grow with every new size seen and are never given back, so the engine's share of the
// GPU depends on the model's shapes and on timing. An arena is sized once, when the engine starts,
// from the Schedule (ParamSwapper::ArenaBytes), so the engine's device memory is a number the
// trainer knows before its first step, and stays that number: the trainer gets the rest.
//
// Allocation is best fit over the free ranges, in 256-byte units (CUDA's alignment), coalescing
// on Free. Fragmentation can refuse a request that the free bytes would hold; callers then give
// back what they can (prefetched buffers not yet used) and try again.
//
// Thread safety: Allocate, Free and the statistics may be called from any thread.
#pragma once

#include <cstdint>
#include <map>
#include <memory>

#include "common/mutex.h"
#include "common/status.h"
#include "gpu/gpu_runtime.h"

namespace memplan::offload {

struct DeviceArenaStats {
  uint64_t capacity_bytes = 0;  // the one allocation
  uint64_t in_use_bytes = 0;    // carved out now (rounded to 256 bytes each)
  uint64_t peak_in_use_bytes = 0;
  uint64_t largest_free_bytes = 0;
  uint64_t allocations = 0;
  uint64_t failures = 0;  // requests refused (no free range large enough)
};

class DeviceArena {
 public:
  // Allocates `bytes` (> 0) of device memory from `runtime` (not owned; must outlive the arena).
  // ResourceExhausted (from the runtime) when the device has no room.
  static Result<std::unique_ptr<DeviceArena>> Create(gpu::Runtime* runtime, uint64_t bytes);
  ~DeviceArena();  // frees the allocation; every buffer must be unused by then
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;

  // `bytes` (> 0) of the arena, 256-byte aligned; ResourceExhausted when no free range holds it
  // (the message says the arena's size, what is in use and the largest free range).
  Result<void*> Allocate(uint64_t bytes);
  // Returns a buffer Allocate() handed out; InvalidArgument for anything else.
  Status Free(void* ptr);

  DeviceArenaStats stats() const;

  // `bytes` rounded up to the arena's unit: what a buffer of that size takes.
  static uint64_t Rounded(uint64_t bytes);

 private:
  DeviceArena(gpu::Runtime* runtime, std::byte* base, uint64_t bytes);

  gpu::Runtime* const runtime_;
  std::byte* const base_;
  mutable Mutex mu_;
  std::map<uint64_t, uint64_t> used_ GUARDED_BY(mu_);  // offset -> bytes.
  std::map<uint64_t, uint64_t> free_ GUARDED_BY(mu_);  // offset -> bytes, coalesced.
  DeviceArenaStats stats_ GUARDED_BY(mu_);
};

}  // namespace memplan::offload
