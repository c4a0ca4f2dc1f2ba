// offload::ParamSwapper: parameters live in a tier (GPU, pinned CPU memory, or NVMe) and are put on
// the GPU just before the module that uses them runs, then released after, ZeRO-Infinity style.
//
// Layout. Parameters are registered in order; each one's 16-bit working copy (`dtype`) occupies a
// range of a flat element space, [flat_offset, flat_offset + numel). The optimizer's sub-groups
// cut the same flat space, so an updated sub-group is written back with one WriteHalf() call. On
// NVMe the flat space is stored in chunks of `chunk_elements` (the optimizer's sub-group size),
// one store key per chunk ("hp.<chunk>"); in pinned CPU memory it is one registered arena.
// Parameters of at most `persistence_threshold` elements, and every parameter of the "gpu" tier,
// stay on the GPU for good.
//
// Fetch and prefetch (Note [Trace-driven prefetch] in param_swapper.cc). Fetch(module) makes the
// module's parameters available on the GPU and returns when they are; Release(module) lets them go.
// The order of Fetch() calls in the first step is recorded as the trace; in later steps each
// Fetch() is checked against it (a different module invalidates the trace and recording starts
// again from there) and the parameters of the modules that come next in the trace are fetched
// ahead, by a transfer thread, as far as three budgets allow: `prefetch_bytes` (prefetched and not
// yet used), `max_live_bytes` (everything fetched and on the GPU), and the pinned staging buffers
// NVMe reads go through (NVMe -> pinned -> GPU, the two stages overlapped). A parameter released
// while the trace says one of the next two modules uses it again (the last layer at the turn from
// forward to backward) is kept on the GPU, counted against the prefetch budget, instead of being
// read again. Time a Fetch() spends waiting for transfers is the stall time.
//
// World size > 1 (ZeRO-3 partitioning through the Collective) is not implemented yet: Create()
// refuses it with Unimplemented.
//
// Thread safety: Add/Finalize/WriteHalf/EndOfStep/Fetch/Release/DevicePointer are called from one
// thread (the trainer's); the swapper runs one transfer thread of its own.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "common/status.h"
#include "nvme/swap_store.h"
#include "offload/collective.h"
#include "offload/gpu_runtime.h"
#include "offload/pinned_pool.h"
#include "offload/schedule.h"

namespace memplan::offload {

using ParamId = uint32_t;

struct ParamSwapperOptions {
  Tier tier = Tier::kGpu;
  ElementType dtype = ElementType::kBFloat16;
  uint64_t persistence_threshold = 100000;
  uint64_t prefetch_bytes = uint64_t{256} << 20;
  uint64_t max_live_bytes = uint64_t{1} << 30;
  uint64_t chunk_elements = uint64_t{4} << 20;  // NVMe chunk = the optimizer's sub-group
  gpu::Runtime* runtime = nullptr;              // not owned; required
  Collective* collective = nullptr;             // not owned; null: single process
  nvme::SwapStore* store = nullptr;             // not owned; required for the nvme tier
  PinnedPool* staging = nullptr;                // not owned; required for the nvme tier (>= 2 slots)
  uint32_t staging_slots = 2;                   // slots taken from `staging`

  Status Validate() const;
};

// Counters for the statistics the estimator is checked against. Bytes are of this rank.
struct ParamSwapperStats {
  uint64_t fetch_calls = 0;         // Fetch() calls
  uint64_t demand_fetches = 0;      // parameters fetched because a Fetch() needed them now
  uint64_t prefetches = 0;          // parameters fetched ahead from the trace
  uint64_t prefetch_hits = 0;       // prefetched parameters a Fetch() then used
  uint64_t prefetch_wasted = 0;     // prefetched and released unused at the end of a step
  uint64_t kept_for_reuse = 0;      // released but kept: one of the next two modules uses it
  uint64_t trace_invalidations = 0; // a Fetch() that did not follow the trace
  uint64_t trace_length = 0;        // modules in the current trace
  bool trace_complete = false;      // recorded for a whole step and being followed
  double stall_s = 0;               // time Fetch() waited for transfers
  uint64_t nvme_read_bytes = 0;     // NVMe -> pinned staging
  uint64_t nvme_write_bytes = 0;    // updated parameters written back to NVMe
  uint64_t h2d_bytes = 0;           // pinned host -> GPU (fetches and write-backs)
  uint64_t live_bytes = 0;          // fetched parameters on the GPU now (persistent excluded)
  uint64_t peak_live_bytes = 0;
  uint64_t ahead_bytes = 0;         // prefetched, not yet used
  uint64_t peak_ahead_bytes = 0;
  uint64_t over_budget_fetches = 0; // demand fetches that took live bytes over max_live_bytes
  uint64_t resident_bytes = 0;      // parameters kept on the GPU for good
  uint64_t pinned_bytes = 0;        // the CPU tier's arena plus the staging slots held
};

class ParamSwapper {
 public:
  static Result<std::unique_ptr<ParamSwapper>> Create(const ParamSwapperOptions& options);
  ~ParamSwapper();
  ParamSwapper(const ParamSwapper&) = delete;
  ParamSwapper& operator=(const ParamSwapper&) = delete;

  // Registers a parameter of `numel` elements used by `module` (a name; a parameter shared by
  // two modules is added once and named in both with AddUse). Before Finalize() only.
  Result<ParamId> Add(const std::string& name, const std::string& module, uint64_t numel);
  Status AddUse(ParamId param, const std::string& module);
  // Allocates the tier's storage (GPU copies of resident parameters, the pinned arena) and starts
  // the transfer thread. Values are undefined until written with WriteHalf().
  Status Finalize();

  uint64_t flat_elements() const;  // total elements of the flat space
  uint64_t FlatOffset(ParamId param) const;
  uint64_t Numel(ParamId param) const;
  size_t param_count() const;

  // Writes the 16-bit values of flat elements [flat_begin, flat_begin + values.size()) to where the
  // parameters live (GPU copies, pinned arena, NVMe chunks). For the nvme tier the range must be
  // whole chunks. Not while parameters are fetched (call after EndOfStep()).
  Status WriteHalf(uint64_t flat_begin, std::span<const uint16_t> values);

  Status Fetch(std::string_view module);
  Status Release(std::string_view module);
  // The GPU address of a fetched (or resident) parameter; FailedPrecondition when not on the GPU.
  Result<void*> DevicePointer(ParamId param) const;
  // The end of a training step's forward and backward passes: waits for transfers in flight,
  // releases prefetched parameters that were not used, and ends the trace recording (or notes
  // that the step did not follow it to the end).
  Status EndOfStep();

  ParamSwapperStats stats() const;

 private:
  struct Impl;
  explicit ParamSwapper(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace memplan::offload
