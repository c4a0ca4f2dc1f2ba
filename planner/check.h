// CheckDeepSpeedConfig: finds the mistakes in an existing DeepSpeed config (ds_config.json) that
// make DeepSpeed refuse it, silently ignore a setting, or run out of memory: batch arithmetic,
// unknown or misspelled keys (with the nearest known key), keys in the wrong section, offload
// without the ZeRO stage that supports it, NVMe offload without nvme_path, renamed keys
// (aio.thread_count), "auto" outside the Hugging Face Trainer, fp16 and bf16 both on, values
// DeepSpeed's config classes refuse or that break its engine start (Note [Values DeepSpeed
// refuses] in check.cc: negative buckets, aio queue_depth 0, a block not O_DIRECT-aligned, swap
// buffers too small for the largest parameter), bf16 on a GPU without it, pinned memory against
// RAM and RLIMIT_MEMLOCK, and, with a model and GPUs, the predicted fit with the keys that fill it.
//
// Every finding names its key path ("zero_optimization.offload_param.device"). Findings are
// problems; nothing here prints.
//
// Thread safety: pure function.
#pragma once

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/status.h"
#include "estimator/inventory.h"
#include "estimator/memory_model.h"
#include "estimator/training_setup.h"
#include "planner/cluster.h"

namespace memplan::planner {

struct CheckOptions {
  bool for_hf_trainer = false;  // "auto" allowed where the Trainer fills it
  // With for_hf_trainer: the config is an Accelerate config's deepspeed_config_file, whose
  // DeepSpeedPlugin also fills the ZeRO stage, the offload devices and NVMe paths and
  // stage3_gather_16bit_weights_on_model_save.
  bool filled_by_accelerate = false;
  int64_t world_size = 0;  // GPUs in all; 0 = unknown (batch arithmetic checked for whole-ness)
  // With a model and a cluster: the predicted fit (GPU, CPU, pinned, memlock).
  const estimator::ModelInventory* model = nullptr;
  std::optional<Cluster> cluster;  // gpus_per_node/nodes give world_size when it is 0
  double gpu_safety_fraction = 0.05;
  // What a DeepSpeed config does not say but the fit depends on (as `memplan plan` assumes).
  int64_t seq_len = 0;          // 0: the model's default (min(positions, 2048))
  bool flash_attention = true;  // memory-efficient attention (SDPA / FlashAttention)
  // The rest of the setup the config does not say (the optimizer implementation, sequence
  // parallelism, ...): the fit starts from it, then seq_len, flash_attention and the config.
  estimator::TrainingSetup setup;
  // Fields of `setup` given by the caller that fill the config's "auto" (the Hugging Face Trainer's
  // values: "micro_batch", "grad_accum", "precision") or override it, for the fit.
  std::set<std::string> supplied;
};

struct Finding {
  std::string path;     // "zero_optimization.offload_param"; "" for the whole config
  std::string message;  // what is wrong and what to do
  // The config keys whose values cause it, when they are others than `path` (an out-of-memory
  // finding names the buckets and batch that fill the GPU, a memlock one the swap buffers).
  std::vector<std::string> keys;
};

struct CheckReport {
  std::string setup_line;  // the setup the fit was predicted for (estimator SetupLine); "" if none
  std::optional<estimator::PeakMemory> predicted;  // the predicted peak, when computed
  std::vector<Finding> problems;
  std::vector<std::string> notes;  // what was checked, predicted memory when computed
  // With a model and a cluster and no problem found: why the fit asked for could not be
  // predicted (the setup the config and options give is one the estimator refuses: a sequence
  // longer than the model's positions, ...); "" when it was predicted or not asked for. The CLI
  // makes it an error (exit 2): "OK" would claim a fit no one checked.
  std::string fit_error;
};

// Errors only for input that is not a DeepSpeed config at all (not a JSON object).
Result<CheckReport> CheckDeepSpeedConfig(const nlohmann::json& config, const CheckOptions& options);

nlohmann::json ToJson(const CheckReport& report);
// One line per problem: "<path>: <message>", then "OK: ..." or a count.
std::string FormatCheckText(const CheckReport& report, const std::string& source);

}  // namespace memplan::planner
