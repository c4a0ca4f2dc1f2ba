// offload::ParamSwapper: parameters live in a tier (GPU, pinned CPU memory, or NVMe) and are put on
// the GPU just before the module that uses them runs, then released after, ZeRO-Infinity style.
//
// Layout. Parameters are registered in order; each one's working copy (`dtype`: bf16 or fp16 bit
// patterns, or fp32; every tier, buffer and budget counts ElementBytes(dtype) bytes an element)
// occupies a range of a flat element space, [flat_offset, flat_offset + numel). The optimizer's
// sub-groups cut the same space, so an updated sub-group is written back with one Write() call. On
// NVMe the space is stored in chunks of `chunk_elements` (the optimizer's sub-group size), one
// store key per chunk ("hp.<chunk>"); in pinned CPU memory it is one registered arena. Parameters
// of at most `persistence_threshold` elements, and with world size 1 every parameter of the "gpu"
// tier, stay on the GPU for good ("resident").
//
// World size > 1: ZeRO-3 partitions (Note [ZeRO-3 partitions] in param_swapper.cc). Each parameter
// is cut into world_size shards of ShardElements(numel, world_size) elements (the last padded),
// and this rank keeps only shard `rank` of every parameter, back to back: its partition, of
// partition_elements() elements, the same on every rank. The tiers, Write() and the optimizer's
// sub-groups work in partition coordinates (PartitionOffset(), ShardSize()); with world size 1 the
// partition is the flat space. Fetch() loads this rank's shards and all-gathers the module's
// parameters through the Collective into whole GPU buffers (world_size * shard elements, the first
// numel meaningful); resident parameters are kept whole on every rank and refreshed by
// GatherResident() after a write. Every rank must make the same calls in the same order: Fetch,
// Release, EndOfStep, Write and GatherResident (the collectives run inside Fetch and
// GatherResident, on the calling thread, in an order that follows from that call sequence alone).
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
// GPU memory (Note [Device memory of the swapper] in param_swapper.cc): one DeviceArena, sized in
// Finalize() from the parameters and max_live_bytes, holds every buffer the swapper puts on the
// GPU; stats().device_arena_bytes is its size, the swapper's whole share of the GPU.
//
// Streams: Fetch() returns when the module's parameters are on the GPU (its copies are complete),
// so the trainer may use them from any stream. Release(module, stream) takes the stream the
// trainer queued its kernels on: the buffers are not reused before that stream's work queued so
// far has run (Note [Released buffers and the trainer's stream]).
//
// Thread safety: Add/Finalize/Write*/GatherResident/EndOfStep/PrefetchNextStep/Fetch/Release/
// DevicePointer are called from one thread (the trainer's), with one exception: Write*() may also
// run on another thread (the engine's optimizer, overlapped with backward) while the trainer
// fetches and releases, for ranges of parameters that are not fetched nor fetched again until
// the next EndOfStep() (a parameter whose gradient is complete). The swapper runs one transfer
// thread of its own, which never calls the Collective.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "common/status.h"
#include "nvme/swap_store.h"
#include "offload/collective.h"
#include "gpu/gpu_runtime.h"
#include "offload/pinned_pool.h"
#include "schedule/schedule.h"

namespace memplan::offload {

using ParamId = uint32_t;

// Elements of each rank's shard of a parameter of `numel` elements: ceil(numel / world_size).
uint64_t ShardElements(uint64_t numel, int world_size);

struct ParamSwapperOptions {
  Tier tier = Tier::kGpu;
  ElementType dtype = ElementType::kBFloat16;
  uint64_t persistence_threshold = 100000;
  uint64_t prefetch_bytes = uint64_t{256} << 20;
  uint64_t max_live_bytes = uint64_t{1} << 30;
  uint64_t chunk_elements = uint64_t{4} << 20;  // NVMe chunk = the optimizer's sub-group
  gpu::Runtime* runtime = nullptr;              // not owned; required
  Collective* collective = nullptr;             // not owned; null: single process; world size
                                                // > 1 partitions the parameters (ZeRO-3)
  nvme::SwapStore* store = nullptr;             // not owned; required for the nvme tier
  PinnedPool* staging = nullptr;  // not owned; required for the nvme tier (>= 2 slots)
  uint32_t staging_slots = 2;     // slots taken from `staging`

  Status Validate() const;
};

// Counters for the statistics the estimator is checked against. Bytes are of this rank.
struct ParamSwapperStats {
  uint64_t fetch_calls = 0;          // Fetch() calls
  uint64_t demand_fetches = 0;       // parameters fetched because a Fetch() needed them now
  uint64_t prefetches = 0;           // parameters fetched ahead from the trace
  uint64_t prefetch_hits = 0;        // prefetched parameters a Fetch() then used
  uint64_t prefetch_wasted = 0;      // prefetched and released unused at the end of a step
  uint64_t kept_for_reuse = 0;       // released but kept: one of the next two modules uses it
  uint64_t trace_invalidations = 0;  // a Fetch() that did not follow the trace
  uint64_t trace_length = 0;         // modules in the current trace
  bool trace_complete = false;       // recorded for a whole step and being followed
  double stall_s = 0;                // time Fetch() waited for transfers
  uint64_t nvme_read_bytes = 0;      // NVMe -> pinned staging
  uint64_t nvme_write_bytes = 0;     // updated parameters written back to NVMe
  uint64_t h2d_bytes = 0;            // pinned host -> GPU (fetches and write-backs)
  uint64_t allgather_bytes = 0;      // world size > 1: gathered buffers filled (all ranks' bytes)
  uint64_t live_bytes = 0;           // fetched parameters on the GPU now (persistent excluded)
  uint64_t peak_live_bytes = 0;
  uint64_t ahead_bytes = 0;  // prefetched, not yet used
  uint64_t peak_ahead_bytes = 0;
  uint64_t over_budget_fetches = 0;      // demand fetches that took live bytes over max_live_bytes
  uint64_t resident_bytes = 0;           // kept on the GPU for good (parameters, gpu-tier shards)
  uint64_t pinned_bytes = 0;             // the CPU tier's arena plus the staging slots held
  uint64_t device_arena_bytes = 0;       // the GPU memory the swapper reserved at Finalize()
  uint64_t device_arena_peak_bytes = 0;  // the most of it in use at once
  uint64_t arena_evictions = 0;          // unused prefetches given back to make room for a fetch
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
  // Leaves `elements` partition elements unused before the next parameter (every rank's
  // partition alike), so that it starts where the caller needs it (the engine starts its frozen
  // parameters on a chunk boundary). The range before the gap then ends a segment: a Write() to
  // NVMe may end there with a partial chunk, as at the end of the partition. Before Finalize().
  Status Pad(uint64_t elements);
  // Allocates the tier's storage (GPU copies of resident parameters, the pinned arena) and starts
  // the transfer thread. Values are undefined until written with WriteHalf().
  Status Finalize();

  uint64_t flat_elements() const;  // total elements of the flat space
  uint64_t FlatOffset(ParamId param) const;
  uint64_t Numel(ParamId param) const;
  size_t param_count() const;
  int world_size() const;
  int rank() const;
  // This rank's partition: its size (flat_elements() for world size 1), where a parameter's shard
  // starts in it, and the shard's size. The shard holds the parameter's elements [rank * ShardSize,
  // (rank + 1) * ShardSize), those past Numel() being padding.
  uint64_t partition_elements() const;
  uint64_t PartitionOffset(ParamId param) const;
  uint64_t ShardSize(ParamId param) const;

  // Writes the working-dtype values of partition elements [flat_begin, flat_begin + n), n =
  // values.size() / ElementBytes(dtype), to where the parameters live (GPU copies, pinned arena,
  // NVMe chunks); `values` holds n elements of `dtype` (bf16/fp16 bit patterns, or fp32), and may
  // be reused when this returns. For the nvme tier the range must be whole chunks. Not while
  // parameters of the range are fetched (see Thread safety). With world size > 1, resident
  // parameters see the new values after GatherResident(). InvalidArgument for a size that is not
  // whole elements, OutOfRange past the partition; an NVMe or copy error is returned as is, leaving
  // the range partly written.
  Status Write(uint64_t flat_begin, std::span<const std::byte> values);
  // Write() for a 16-bit dtype (InvalidArgument for fp32) and for fp32 (InvalidArgument otherwise).
  Status WriteHalf(uint64_t flat_begin, std::span<const uint16_t> values);
  Status WriteFloat(uint64_t flat_begin, std::span<const float> values);

  // World size > 1: all-gathers the resident parameters' shards (a collective: every rank calls
  // it, after the same writes). A no-op for world size 1.
  Status GatherResident();

  // Makes the module's parameters available on the GPU (whole: with world size > 1 they are
  // gathered from every rank); returns when they are, or the first error (the module then needs no
  // Release()).
  Status Fetch(std::string_view module);
  // `stream`: where the trainer queued its work on the module's parameters (see "Streams" above;
  // {}: the legacy default stream on CUDA). InvalidArgument for a stream the runtime refuses (a
  // CUDA stream given to the host-only runtime, a stream of another device); nothing is released
  // then.
  Status Release(std::string_view module, gpu::Stream stream = {});
  // The GPU address of a fetched (or resident) parameter; FailedPrecondition when not on the GPU.
  Result<void*> DevicePointer(ParamId param) const;
  // The end of a training step's forward and backward passes: waits for transfers in flight,
  // releases prefetched parameters that were not used, and ends the trace recording (or notes
  // that the step did not follow it to the end).
  Status EndOfStep();
  // After EndOfStep() and the write-back of every updated parameter: starts fetching the first
  // modules of the next step along the trace, within the budgets, so that they load while the
  // optimizer finishes its step (its last writes and the commit). A no-op without a whole trace.
  Status PrefetchNextStep();

  ParamSwapperStats stats() const;

 private:
  struct Impl;
  explicit ParamSwapper(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace memplan::offload
