// The memory and traffic of memplan's own offload engine (offload::Engine) running a Schedule: what
// `memplan plan --emit-schedule` sizes the Schedule with and predicts for it, and what the engine's
// statistics are checked against (tests/python/test_plan_to_run.py).
//
// The estimator's memory model (estimator/memory_model.h) describes DeepSpeed: its swap buffers
// hold 4 bytes an element, its traffic is DeepSpeed's. memplan's engine is another program: its
// optimizer buffers hold the fp32 master weights, every optimizer state, the fp32 gradients and the
// 16-bit copy of a whole sub-group (about 18 bytes an element for Adam), its parameter reads follow
// a recorded trace within byte budgets, and every optimizer step reads and writes whole sub-groups
// with a page of header each. This file is that program's model, from the Schedule itself
// (offload::Schedule, a plain value; the planner does not link the engine: offload/ sits beside it,
// not below; both link the Schedule, schedule/: Note [Schedule contract] in schedule/schedule.h).
//
// Note [Engine model]
// Given the Schedule's fields and the parameters as the engine registers them (the inventory's
// tensors, tied ones once, in order; fetch units as memplan.torch groups them: one per repeated
// block, the `_no_split_modules` class, and one per other module), the model computes:
//   - pinned bytes: the parameter staging slots (nvme tier: buffer_count x buffer_bytes, pages),
//     the cpu tier's arena (the partition in the working dtype, pages), the optimizer's buffers
//     (nvme: buffer_count x [page header + (1 + states) x 4 B x sub_group | 4 B gradients x
//     sub_group | 2 B 16-bit copy x sub_group], each part in pages) and, on a runtime with a GPU,
//     the gradient staging (4 slots of the largest trainable shard in fp32, at most 4 MiB each,
//     at most what pinned_budget_bytes leaves): exactly the engine's allocations (engine.cc,
//     optimizer_swapper.cc, param_swapper.cc);
//   - NVMe bytes per step, read and written, as the stores count them: the parameter reads of a
//     step's fetches, found by running the parameter swapper's own bookkeeping (trace recorded in
//     the first step, prefetch along it from the second within prefetch_bytes and max_live_bytes,
//     a parameter released but used again within two modules kept) over the fetch sequence
//     (forward through the units, backward through them in reverse, once per micro-batch); the
//     write-back of the updated working copies (the trainable partition in the working dtype);
//     and the optimizer's read of each sub-group's state slot and gradients, its write of the new
//     state slot, the gradients written as the backward produces them, and the step's begin mark;
//   - the NVMe stores' size on the drive, as the engine preallocates them (the optimizer's with
//     optimizer.state_slots copies of the master weights and states);
//   - the peak of live parameter bytes (fetched parameters on the GPU, persistent ones excluded:
//     ParamSwapperStats::peak_live_bytes) from the same run of the bookkeeping.
// It leaves out what depends on timing (a prefetch the transfer thread drops for want of room) and
// what a trainer may do differently (parameters that get no gradient, frozen parameters: every
// parameter is taken to train; a module order other than the inventory's).
//
// Thread safety: pure functions over plain values.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/status.h"
#include "estimator/inventory.h"
#include "schedule/schedule.h"

namespace memplan::planner {

struct EngineRunOptions {
  int world_size = 1;          // ranks; each holds a 1/world_size shard of every parameter
  bool gpu = true;             // a runtime with a GPU: the gradient staging is pinned
  uint32_t micro_batches = 1;  // forward and backward passes per optimizer step
};

struct EnginePrediction {
  // Pinned host memory the engine holds from Start() on (EngineStats::pinned_bytes).
  uint64_t param_staging_pinned_bytes = 0;
  uint64_t param_arena_pinned_bytes = 0;
  uint64_t optimizer_pinned_bytes = 0;
  uint64_t gradient_staging_pinned_bytes = 0;  // 0 without a GPU
  uint64_t pinned_bytes = 0;                   // their sum
  // NVMe bytes per step from the second step on (the trace followed), as the stores count them.
  uint64_t param_read_bytes_per_step = 0;
  uint64_t param_write_bytes_per_step = 0;
  uint64_t optimizer_read_bytes_per_step = 0;
  uint64_t optimizer_write_bytes_per_step = 0;  // gradients and the begin mark included
  uint64_t nvme_read_bytes_per_step = 0;
  uint64_t nvme_write_bytes_per_step = 0;
  uint64_t first_step_param_read_bytes = 0;  // the first step records the trace: no prefetch
  // What the NVMe stores take on the drive (preallocated at Start()): the parameters' working
  // copies and the optimizer's master weights, states (optimizer.state_slots copies) and
  // gradients, with the engine's extent rounding.
  uint64_t param_store_bytes = 0;
  uint64_t optimizer_store_bytes = 0;
  uint64_t nvme_store_bytes = 0;
  // Fetched parameters on the GPU at once, the most (ParamSwapperStats::peak_live_bytes), and the
  // parameters kept there for good.
  uint64_t peak_live_param_bytes = 0;
  uint64_t resident_param_bytes = 0;
  // The geometry behind them.
  uint64_t params = 0;              // registered (tied tensors once)
  uint64_t partition_elements = 0;  // this rank's
  uint64_t sub_groups = 0;
  uint64_t fetch_units = 0;
  uint64_t largest_piece_bytes = 0;  // the largest NVMe parameter read into one staging slot
  std::vector<std::string> assumptions;
};

// What the engine does with `schedule` (schedule/schedule.h; callers read a Schedule's JSON with
// offload::ScheduleFromJson, the engine's own reader). Of its fields the model reads the tiers, the
// parameters' dtype (4 bytes for fp32, else 2), the persistence threshold, prefetch and live
// budgets, the staging and optimizer buffers, the optimizer (its state arrays:
// offload::SwapOptimizerStates), the sub-group size, state_slots and pinned_budget_bytes; the nvme
// section and optimizer_threads change no byte it predicts.
// Errors: an inventory without parameters, world_size or micro_batches < 1, zero sizes.
Result<EnginePrediction> PredictEngine(const offload::Schedule& schedule,
                                       const estimator::ModelInventory& inventory,
                                       const EngineRunOptions& run);

// JSON form (plan's "schedule_prediction"): the fields above by their names.
nlohmann::ordered_json ToJson(const EnginePrediction& prediction);
// One line for people: "memplan's engine on <schedule> (predicted, per GPU process): 1.3 GiB
// pinned, NVMe ... read and ... written per step, ... of NVMe stores, at most ... of fetched
// parameters on the GPU (... resident)\n".
std::string FormatEnginePrediction(const EnginePrediction& prediction, const std::string& schedule);

}  // namespace memplan::planner
