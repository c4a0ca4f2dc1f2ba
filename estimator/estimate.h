// Estimate: the estimator's answer for one model on one hardware setup, as a plain struct that
// serialises to JSON and back (the CLI, the C API and Python all pass this same object).
//
// It carries the model's counts and DeepSpeed's model-state tables (to the byte) and, when a
// training setup is given, the itemised per-tier memory model (memory_model.h) beside them: the
// breakdown for that setup, its peak and phase, and the ZeRO stage x offload comparison.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/status.h"
#include "estimator/deepspeed.h"
#include "estimator/inference.h"
#include "estimator/inventory.h"
#include "estimator/memory_model.h"
#include "estimator/training_setup.h"

namespace memplan::estimator {

struct ModelSummary {
  std::string name;          // as the user named it
  std::string model_type;    // "llama"; "" for shape lists without one
  std::string architecture;  // "LlamaForCausalLM"
  std::string model_class;   // "causal_lm" | "masked_lm" | "seq2seq_lm" | "base" | ""
  std::string source;        // "builtin" | "config" | "shape-list" | "safetensors"
  ModelCounts counts;
  std::vector<std::string> notes;  // ModelInventory::notes (also among the assumptions)
};

struct Estimate {
  ModelSummary model;
  DeepSpeedHardware hardware;
  std::vector<Zero2Row> zero2;           // DeepSpeed's order
  std::vector<Zero3Row> zero3;           // DeepSpeed's order
  std::vector<std::string> assumptions;  // stated in the output, one sentence each
  // Present when a training setup was given (EstimateTraining).
  std::optional<MemoryEstimate> memory;
  std::vector<ComparisonRow> comparison;  // ZeRO stages x offload for the same setup
  // Present when the inference table was asked for (AddInference; `estimate --inference`).
  std::optional<InferenceEstimate> inference;
};

// Counts the inventory and fills the DeepSpeed tables. Errors: invalid hardware, overflow.
Result<Estimate> EstimateModelStates(const ModelInventory& inventory,
                                     const DeepSpeedHardware& hardware);

// EstimateModelStates plus the memory model for `setup` (whose gpus_per_node and num_nodes are
// taken from `hardware`) and the stage x offload comparison. Errors: those of both, and the
// setup's validation against the model.
Result<Estimate> EstimateTraining(const ModelInventory& inventory,
                                  const DeepSpeedHardware& hardware, const TrainingSetup& setup);

// Adds the inference and loading table (inference.h) for `inventory`, counted as in `estimate`,
// to `estimate`; its notes join the assumptions.
Status AddInference(const ModelInventory& inventory, const InferenceSetup& setup,
                    Estimate* estimate);

// JSON form (schema documented in README.md; a public interface: fields are only ever added).
nlohmann::json ToJson(const Estimate& estimate);
// Inverse of ToJson; errors name the missing or mistyped field.
Result<Estimate> EstimateFromJson(const nlohmann::json& json);

// Human-readable report: a model summary line, then DeepSpeed's ZeRO-2 and ZeRO-3 printouts
// verbatim, then the GiB caveat once; with a training setup, then its breakdown table (items x
// tiers) and the stage x offload comparison. With the inference table (and no training setup),
// the summary and that table only, as `accelerate estimate-memory` prints it.
std::string FormatEstimateText(const Estimate& estimate);

// `memplan inventory --format json`: model summary plus every tensor.
nlohmann::json InventoryToJson(const ModelInventory& inventory, const ModelCounts& counts);
// Human-readable tensor table.
std::string FormatInventoryText(const ModelInventory& inventory, const ModelCounts& counts);

// The one-line summary of a training setup that every report prints first: precision,
// optimizer and its implementation, ZeRO stage and offload, batch, sequence, accumulation,
// checkpointing, attention, parallelism. `searched`: the planner's form, without the settings it
// searches (stage, offload, checkpointing, micro-batch, accumulation).
std::string SetupLine(const TrainingSetup& setup, bool searched = false);

// 1234567 -> "1,234,567".
std::string WithThousands(uint64_t value);

}  // namespace memplan::estimator
