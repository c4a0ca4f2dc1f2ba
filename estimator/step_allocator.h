// The CUDA caching allocator's reserved memory over a step's allocations (Note [The caching
// allocator's reserve]). Internal to the estimator: the step model (step_model.cc) replays the
// allocations its Graph logged.
//
// Thread safety: pure functions over plain values.
#pragma once

#include <cstdint>
#include <vector>

namespace memplan::estimator::step {

// One allocation or free, in program order: `id` names the allocation (its free carries the
// same id), `bytes` its request (already rounded to 512 bytes).
struct AllocatorEvent {
  int id = -1;
  bool alloc = true;
  uint64_t bytes = 0;
  int stream = 0;  // the CUDA stream it is allocated on: each has its own cached blocks
};

struct AllocatorPeaks {
  uint64_t allocated = 0;  // the most bytes of live blocks at once (max_memory_allocated)
  uint64_t reserved = 0;   // the most bytes of segments at once (max_memory_reserved)
  // The most bytes of segments holding a live block at once: what the allocator cannot give
  // back when a cudaMalloc fails (it frees its wholly free segments and retries).
  uint64_t held = 0;
};

// Replays `events` through the caching allocator's rules, each stream's blocks its own, with
// unlimited device memory (no segment is ever released). A free of an id not allocated, and an
// event of id -1, are ignored.
AllocatorPeaks ReplayCachingAllocator(const std::vector<AllocatorEvent>& events);

}  // namespace memplan::estimator::step
