// The engine's parameter path: the registration (every ParamSpec, in order), this rank's
// partition of it (Note [Frozen parameters] in engine_params.cc), the ParamSwapper that holds the
// working copies on their tier (with its NVMe store and pinned staging), and the writes of those
// copies from the optimizer's master weights. One of the parts Engine::Impl wires together
// (engine.cc); internal to offload/ (not installed).
//
// Threads: built and changed on the trainer's thread, before Start() returns; after it only the
// ParamSwapper changes (its own locks). The gradient thread reads the registration and the
// partition's layout, which no longer change then; WriteBack() runs on the optimizer's compute
// thread (ParamSwapper::Write takes its own locks). So ParamPath has no mutex of its own.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"
#include "nvme/swap_store.h"
#include "offload/cpu_optimizer.h"
#include "offload/engine.h"
#include "offload/engine_home.h"
#include "offload/optimizer_swapper.h"
#include "offload/param_swapper.h"
#include "offload/pinned_pool.h"

namespace memplan::offload::internal {

// What this rank's partition (Note [ZeRO-3 partitions] in param_swapper.cc) holds; the flat
// space itself for world size 1.
struct PartitionLayout {
  uint64_t total = 0;         // the trainable parameters' elements: what the optimizer holds
  uint64_t frozen_begin = 0;  // where the frozen parameters start, on a chunk boundary
  uint64_t partition = 0;     // what the parameter tier holds
};

class ParamPath {
 public:
  ParamPath(const EngineOptions& engine_options, gpu::Runtime* gpu_runtime)
      : options(engine_options), runtime(gpu_runtime) {}

  // AddParameter()'s checks and record: a new parameter's id, or why `spec` is refused.
  Result<ParamId> Register(const ParamSpec& spec);

  // --- Start()'s pieces, in the order it runs them ---
  Result<PartitionLayout> LayOutPartition(EngineStats& stats);
  Status OpenParamStore(const std::string& nvme_dir, uint64_t partition);
  Status CreateParamSwapper(const std::string& nvme_dir, const PartitionLayout& partition);
  Status WriteWorkingCopies(OptimizerHome& optimizer);
  Status WriteFrozenWorkingCopies(
      const PartitionLayout& partition,
      const std::function<Status(uint64_t, std::span<float>)>& fill = nullptr);

  // Partition coordinates: the parameters' init, a checkpoint's values, an update's write-back.
  Status Fill(uint64_t first, std::span<float> out);
  Status FillFrom(const StateFiller& fill, int array, uint64_t first, std::span<float> out);
  Status WriteBack(const SubGroupUpdate& u);

  // The registration as a store records it, and the check of a store's record against it (Note
  // [What a store holds]).
  std::string Identity() const;
  Status CheckIdentity(const std::string& stored, const std::string& dir,
                       RecoveryReport* report) const;

  // The largest trainable parameter's shard, in elements (what one gradient needs).
  uint64_t LargestTrainableShard() const;

  const EngineOptions& options;
  gpu::Runtime* const runtime;
  std::vector<ParamSpec> specs;  // in registration (= flat) order
  std::vector<uint64_t> numels;  // specs[i]'s element count, checked in Register()
  // Note [Frozen parameters]: the swapper's id of specs[i], and the spec of each swapper id.
  std::vector<ParamId> swap_id;
  std::vector<size_t> spec_of;
  uint64_t trainable_params = 0;
  uint64_t total_elements = 0;  // their sum
  // Note [Parameter groups]: the number of groups (the largest ParamSpec::group + 1).
  uint32_t groups = 1;
  PartitionLayout layout;  // Start()'s
  std::unique_ptr<nvme::SwapStore> param_store;
  std::unique_ptr<PinnedPool> staging;
  std::unique_ptr<ParamSwapper> params;
  std::unique_ptr<CpuOptimizer> converter;  // fp32 -> 16-bit for the working copies

 private:
  template <typename PartFn>
  Status ForEachPiece(uint64_t first, std::span<float> out, PartFn&& part);
};

}  // namespace memplan::offload::internal
