// PinnedPool: page-locked host memory for the offload engine's swap buffers, allocated once and
// carved into fixed-size slots, under a hard byte budget.
//
// Pinned memory is taken from what the kernel may never swap out, so an unbounded pool gets a
// training job OOM-killed without a word. The pool therefore makes one allocation at Create(),
// checks RLIMIT_MEMLOCK before locking it (saying how to raise the limit), and never allocates
// again: Acquire() hands out a free slot, waits for one, or fails; it never overcommits.
//
// Thread safety: Acquire, Release (through PinnedSlot) and stats() may be called from any thread
// at once. The pool must outlive every PinnedSlot it handed out. No GPU runtime call is made while
// the pool's lock is held (registration happens once, in Create and the destructor).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "common/mutex.h"
#include "common/status.h"
#include "gpu/gpu_runtime.h"
#include "offload/node_budget.h"

namespace memplan::offload {

struct PinnedPoolOptions {
  // Bytes per slot (> 0); rounded up to the page size so every slot is page-aligned. Default 4 MiB.
  uint64_t slot_bytes = uint64_t{4} << 20;
  // Number of slots (> 0). Default 4.
  uint64_t slot_count = 4;
  // Hard cap on the pool's bytes (> 0); the page-rounded slot_bytes * slot_count must fit.
  // Default 16 MiB.
  uint64_t budget_bytes = uint64_t{16} << 20;
  // mlock the allocation (after checking RLIMIT_MEMLOCK). Default false.
  bool lock_memory = false;
  // When no slot is free: true blocks (optionally up to a timeout), false fails at once with
  // ResourceExhausted. Default true.
  bool wait = true;
  // When not empty, the pool's whole allocation is reserved from this NodeBudget (see
  // node_budget.h) before allocating; node_budget_bytes is that budget's node-wide cap.
  std::string node_budget_name;
  uint64_t node_budget_bytes = 0;

  Status Validate() const;
};

// Counters with declared meaning; a snapshot taken under the pool's lock.
struct PinnedPoolStats {
  uint64_t capacity_bytes = 0;  // page-rounded slot bytes * slot count
  uint64_t current_bytes = 0;   // bytes in slots handed out and not yet released
  uint64_t peak_bytes = 0;      // the largest current_bytes seen
  uint64_t acquires = 0;        // Acquire calls that returned a slot
  uint64_t waits = 0;           // Acquire calls that found no free slot and blocked
  uint64_t wait_time_us = 0;    // total time those calls spent blocked
  uint64_t failures = 0;        // Acquire calls that returned an error
};

class PinnedPool;

// One slot, released back to its pool when destroyed. Move-only; an empty (moved-from or
// default) slot releases nothing.
class PinnedSlot {
 public:
  PinnedSlot() = default;
  PinnedSlot(PinnedSlot&& other) noexcept;
  PinnedSlot& operator=(PinnedSlot&& other) noexcept;
  PinnedSlot(const PinnedSlot&) = delete;
  PinnedSlot& operator=(const PinnedSlot&) = delete;
  ~PinnedSlot() { Release(); }

  std::span<std::byte> data() const { return data_; }
  uint64_t index() const { return index_; }
  bool empty() const { return pool_ == nullptr; }
  // Returns the slot to the pool now; a no-op on an empty slot.
  void Release();

 private:
  friend class PinnedPool;
  PinnedSlot(PinnedPool* pool, uint64_t index, std::span<std::byte> data)
      : pool_(pool), index_(index), data_(data) {}

  PinnedPool* pool_ = nullptr;
  uint64_t index_ = 0;
  std::span<std::byte> data_;
};

class PinnedPool {
 public:
  // Allocates, locks (when asked) and registers the pool through `runtime` (nullptr: host-only).
  // Fails with InvalidArgument for bad options, ResourceExhausted when RLIMIT_MEMLOCK is too low
  // (the message says the bytes needed, the limit and how to raise it), when the node budget
  // has no room, or when memory is short.
  static Result<std::unique_ptr<PinnedPool>> Create(const PinnedPoolOptions& options,
                                                    gpu::Runtime* runtime = nullptr);
  // Precondition: every slot has been released.
  ~PinnedPool();
  PinnedPool(const PinnedPool&) = delete;
  PinnedPool& operator=(const PinnedPool&) = delete;

  // A free slot. When none is free: with options.wait, blocks until one is released or `timeout`
  // passes (then Unavailable: retrying may succeed); without, ResourceExhausted at once.
  Result<PinnedSlot> Acquire(std::optional<std::chrono::microseconds> timeout = std::nullopt);

  PinnedPoolStats stats() const;
  uint64_t slot_bytes() const { return slot_bytes_; }
  uint64_t slot_count() const { return slot_count_; }
  // The whole allocation, every slot in it: what an I/O engine registers once (io_uring fixed
  // buffers) so that transfers into any slot skip per-request page pinning.
  std::span<std::byte> memory() const {
    return {base_, static_cast<size_t>(slot_bytes_ * slot_count_)};
  }

 private:
  friend class PinnedSlot;
  PinnedPool(const PinnedPoolOptions& options, uint64_t slot_bytes, std::byte* base,
             gpu::Runtime* runtime, NodeReservation reservation);
  void Release(uint64_t index);

  const PinnedPoolOptions options_;
  const uint64_t slot_bytes_;
  const uint64_t slot_count_;
  std::byte* const base_;
  gpu::Runtime* const runtime_;
  NodeReservation reservation_;  // released after the memory is freed (member order)

  mutable Mutex mu_;
  CondVar slot_freed_;
  std::vector<uint64_t> free_ GUARDED_BY(mu_);  // indices of free slots
  PinnedPoolStats stats_ GUARDED_BY(mu_);
};

}  // namespace memplan::offload
