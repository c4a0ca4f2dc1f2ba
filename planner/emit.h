// Emitters: a Plan as the configuration files the ecosystem runs, and as the Schedule the offload
// engine runs.
//
//   DeepSpeed ds_config.json: complete (batch arithmetic, precision, optimizer, zero_optimization
//     with bucket sizes and offload blocks, nvme_path, aio, activation_checkpointing) and with no
//     "auto" unless for_hf_trainer, where the keys the Hugging Face Trainer fills are "auto".
//   Accelerate config (accelerate.yaml): DeepSpeed plugin (pointing at the ds_config when one is
//     emitted, else inline settings) or FSDP plugin.
//   FSDP arguments (fsdp.json): the torch FSDP constructor arguments equivalent to the plan.
//   Schedule (schedule.json), format "memplan.schedule/1" (Note [Schedule format]).
//
// Note [Schedule format]
// The Schedule is offload::Schedule's JSON form, version 1 (schedule/schedule.h; README "Schedule
// JSON"), written by its one writer in schedule/, which the planner links instead of the engine
// (Note [Schedule contract] in schedule/schedule.h): "params" (tier,
// dtype, persistence_threshold, prefetch_bytes, max_live_bytes, buffer_bytes, buffer_count) from
// the ZeRO-3 settings and offload_param, "optimizer" (tier cpu|nvme, name, sub_group_elements,
// buffer_count, threads) from offload_optimizer, "nvme" (path = <nvme_path>/memplan, block_size
// and queue_depth from the aio settings), and "pinned_budget_bytes". Only plans that offload the
// optimizer have one.
//
// Note [Schedule for memplan's engine]
// The Schedule is run by memplan's own engine, not DeepSpeed, so its buffers are sized for that
// engine (planner/engine_model.h), not copied from the DeepSpeed settings the plan was searched
// with (those describe DeepSpeed's 4-byte swap buffers; the engine's optimizer buffers hold a whole
// sub-group's master weights, states, gradients and 16-bit copy, about 18 bytes an element):
//   - optimizer.sub_group_elements: the plan's sub_group_size, at most kMaxEngineSubGroupElements
//     (16 Mi: a sub-group's state read is then a few hundred MB, far beyond what per-sub-group
//     costs notice, and three buffers pin under 1 GiB) and at most the model's partition (one
//     sub-group for a small model, not a buffer sized for a billion elements), halved until every
//     pinned buffer fits half the RAM per GPU process and RLIMIT_MEMLOCK when known;
//   - optimizer.buffer_count: the plan's, but never more than the sub-groups (at least 2);
//   - params.buffer_bytes: the largest piece one parameter fetch reads into a staging slot (a
//     parameter's shard within one NVMe chunk), at most the plan's buffer; buffer_count 2 to 4
//     (the engine's transfer thread reads slice k+1 while slice k is uploaded);
//   - pinned_budget_bytes: exactly what the engine then pins with a GPU (engine_model's
//     prediction), so the engine starts, and refuses a hand edit that would pin more.
// The prediction for the schedule (EngineScheduleFor) comes from the same model and is what
// `memplan plan` prints beside the file and what the engine's statistics are checked against.
//
// Thread safety: pure functions.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "common/status.h"
#include "estimator/inventory.h"
#include "planner/cluster.h"
#include "planner/engine_model.h"
#include "planner/search.h"

namespace memplan::planner {

struct EmitOptions {
  bool for_hf_trainer = false;  // "auto" for the keys the Hugging Face Trainer fills
  double learning_rate = 1e-4;  // optimizer.params.lr (not for_hf_trainer)
  double weight_decay = 0.0;
  std::string deepspeed_config_path;            // accelerate.yaml refers to it when not empty
  std::string accelerate_plugin = "deepspeed";  // "deepspeed" or "fsdp"
};

// Errors: nothing to emit for a plan that is invalid (Internal).
Result<nlohmann::ordered_json> DeepSpeedConfig(const Plan& plan, const Cluster& cluster,
                                               const estimator::ModelInventory& inventory,
                                               const EmitOptions& options);
// YAML text. FSDP plugin: errors for NVMe offload (FSDP offloads to CPU only) naming
// `accelerate_plugin`.
Result<std::string> AccelerateConfig(const Plan& plan, const Cluster& cluster,
                                     const estimator::ModelInventory& inventory,
                                     const EmitOptions& options);
Result<nlohmann::ordered_json> FsdpConfig(const Plan& plan, const Cluster& cluster,
                                          const estimator::ModelInventory& inventory);
Result<nlohmann::ordered_json> Schedule(const Plan& plan, const Cluster& cluster,
                                        const estimator::ModelInventory& inventory);
// The largest optimizer sub-group a Schedule gets (Note [Schedule for memplan's engine]).
inline constexpr uint64_t kMaxEngineSubGroupElements = uint64_t{16} << 20;
// The Schedule (its JSON, as Schedule() returns it: offload::ToOrderedJson of `schedule`), the
// Schedule itself, and the engine model's prediction for it: with a GPU, world size the cluster's,
// the plan's accumulation.
struct EmittedSchedule {
  nlohmann::ordered_json json;
  offload::Schedule schedule;
  EnginePrediction prediction;
};
Result<EmittedSchedule> EngineScheduleFor(const Plan& plan, const Cluster& cluster,
                                          const estimator::ModelInventory& inventory);
// What the training script sets outside the DeepSpeed / Accelerate files (--emit-trainer):
// {"training_arguments": {...}} with Hugging Face TrainingArguments keyword names (batch,
// accumulation, precision, gradient_checkpointing, the optimizer for 8-bit AdamW, deepspeed when
// a DeepSpeed config is emitted) and {"model": {"attn_implementation": ...}} for
// from_pretrained, plus "notes" in sentences.
Result<nlohmann::ordered_json> TrainerArguments(const Plan& plan, const Cluster& cluster,
                                                const estimator::ModelInventory& inventory,
                                                const EmitOptions& options);

// The transformer layer class for FSDP auto-wrapping ("LlamaDecoderLayer"), "" when unknown.
std::string DecoderLayerClass(const std::string& model_type);
// The same for a built inventory: the block class its builder recorded (every family memplan
// builds from a config.json), else by model_type.
std::string DecoderLayerClass(const estimator::ModelInventory& inventory);

}  // namespace memplan::planner
