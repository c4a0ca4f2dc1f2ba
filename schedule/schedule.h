// offload::Schedule: what the offload engine must do for one training job, as plain data. The
// planner produces it (`memplan plan --emit-schedule schedule.json`); a trainer may also write it
// by hand. Its JSON form is a public interface (README, "Schedule JSON"); keys are only added.
//
//   {
//     "version": 1,
//     "params":    {"tier": "gpu" | "cpu" | "nvme", "dtype": "bf16" | "fp16" | "fp32",
//                   "persistence_threshold": 100000, "prefetch_bytes": 268435456,
//                   "max_live_bytes": 1073741824, "buffer_bytes": 67108864, "buffer_count": 4},
//     "optimizer": {"tier": "cpu" | "nvme", "name": "adam" | "adam-amsgrad" | "sgd" | "lion",
//                   "sub_group_elements": 4194304, "buffer_count": 3, "threads": 0,
//                   "state_slots": 2},
//     "nvme":      {"path": "/mnt/nvme/memplan", "backend": "auto", "block_size": 1048576,
//                   "queue_depth": 32, "intra_op_parallelism": 1, "direct": true},
//     "pinned_budget_bytes": 0
//   }
//
// Meaning:
//   - params.tier: where a parameter's working copy (params.dtype) lives between uses. "gpu":
//     resident (no parameter offload); "cpu": pinned host memory, uploaded per use; "nvme": the
//     NVMe store, read through pinned staging buffers per use. Parameters of at most
//     persistence_threshold elements stay on the GPU whatever the tier (DeepSpeed's
//     stage3_param_persistence_threshold).
//   - prefetch_bytes: most bytes being fetched ahead of their use at once
//     (stage3_prefetch_bucket_size); max_live_bytes: most bytes of fetched parameters on the GPU
//     at once, prefetched ones included (stage3_max_live_parameters, in bytes). A module that alone
//     needs more than max_live_bytes is still fetched when asked for (counted in the statistics).
//   - buffer_bytes x buffer_count: the pinned staging buffers NVMe parameter reads go through.
//   - optimizer: the CPU optimizer and where its fp32 master weights, states and gradients live:
//     "cpu" (a SwapStore in memory) or "nvme" (the NVMe store, pipelined in sub-groups). threads 0:
//     every core. state_slots (nvme): 2 keeps each sub-group's states twice on the drive, so a
//     crash mid-step resumes from the last step; 1 rewrites them in place in half the space, and
//     a step interrupted after its first write leaves a store that cannot be resumed (training
//     restarts from a checkpoint: Note [One slot per sub-group] in offload/optimizer_swapper.cc).
//     Absent: 2. durability (nvme): what each step's commit survives: "process" (the default: a
//     process killed anywhere resumes from its last step; no flush of the drive per step) or
//     "power" (a power loss or kernel crash too: the drive flushed at every commit; Note [Commits
//     without a flush] in offload/optimizer_swapper.cc).
//   - nvme.path: a directory the engine may create and own (two stores: params/ and optimizer/;
//     with world size > 1, under rank<r>/ for each rank).
//   - pinned_budget_bytes: cap on the engine's pinned memory (0: no cap beyond the buffers above).
//
// Note [Schedule contract]
// The Schedule is the one document both sides link: the planner writes it (planner/emit.cc) and
// models the engine running it (planner/engine_model.cc), the engine runs it (offload/engine.h).
// So it lives in its own library, memplan::schedule, over common/ only, with the enums its fields
// take (schedule/enums.h); the planner links it and not the engine, which sits beside the planner,
// not below it (docs/architecture.md, "Layers"). The types keep the namespace of the module that
// acts on them (offload::Schedule, offload::Tier, nvme::BackendKind). The top-level CMakeLists.txt
// fails the configure when memplan_planner reaches memplan_offload or memplan_nvme, and the test
// planner_layering fails when a planner/ file includes an offload/ or nvme/ header.
//
// Thread safety: a plain value.
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "common/status.h"
#include "schedule/enums.h"

namespace memplan::offload {

struct Schedule {
  static constexpr int kVersion = 1;

  Tier param_tier = Tier::kGpu;
  ElementType param_dtype = ElementType::kBFloat16;
  uint64_t persistence_threshold = 100000;  // elements
  uint64_t prefetch_bytes = uint64_t{256} << 20;
  uint64_t max_live_bytes = uint64_t{1} << 30;
  uint64_t param_buffer_bytes = uint64_t{64} << 20;
  uint32_t param_buffer_count = 4;

  Tier optimizer_tier = Tier::kCpu;  // cpu or nvme
  SwapOptimizer optimizer = SwapOptimizer::kAdam;
  uint64_t sub_group_elements = uint64_t{4} << 20;
  uint32_t optimizer_buffer_count = 3;
  int optimizer_threads = 0;
  uint32_t optimizer_state_slots = 2;  // 1 or 2
  Durability optimizer_durability = Durability::kProcessCrash;

  std::string nvme_path;
  nvme::BackendKind nvme_backend = nvme::BackendKind::kAuto;
  uint32_t nvme_block_size = 1 << 20;
  uint32_t nvme_queue_depth = 32;
  // Threads each transfer is split across, each with its own ring or aio context (DeepSpeed's
  // aio.intra_op_parallelism), 1..64: for storage one thread cannot saturate (RAID-0).
  uint32_t nvme_io_threads = 1;
  bool nvme_direct = true;

  uint64_t pinned_budget_bytes = 0;

  // Ranges and combinations: nvme tiers need nvme.path, the optimizer cannot be on the GPU (the
  // engine's optimizer is the CPU one), buffers and sizes positive, sub_group_elements a multiple
  // of 1024. Errors name the JSON key.
  Status Validate() const;
};

// The JSON form, keys in the order the README documents them (version, params, optimizer, nvme,
// pinned_budget_bytes): the one writer of a Schedule, `plan --emit-schedule` included.
nlohmann::ordered_json ToOrderedJson(const Schedule& schedule);
nlohmann::json ToJson(const Schedule& schedule);
// Reads the JSON form; absent keys keep their defaults; unknown keys, wrong types and a version
// other than 1 are errors naming the key (prefixed with `source`). Validates.
Result<Schedule> ScheduleFromJson(const nlohmann::json& json, const std::string& source);

}  // namespace memplan::offload
