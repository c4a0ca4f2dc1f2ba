// CheckAccelerateConfig: finds the mistakes in an existing Hugging Face Accelerate config file
// (what `accelerate config` writes and `accelerate launch --config_file` reads), read into JSON
// (tools/yaml_json.h reads the YAML), the way CheckDeepSpeedConfig does for a DeepSpeed config:
// what Accelerate refuses at load, launch, plugin construction or prepare(), what it silently
// ignores or changes, and, with a model and a cluster, the predicted fit.
//
// The rules are Accelerate 1.15's, each with where Accelerate enforces it (Note [What Accelerate
// refuses and ignores] in accelerate_check.cc): unknown top-level keys (refused), the enums
// (distributed_type, mixed_precision, the FSDP strategy, prefetch, state dict and wrap policy),
// booleans, process counts against the cluster, keys inside fsdp_config and deepspeed_config
// that Accelerate never reads, FSDP1 / FSDP2 differences (a strategy written where that version
// does not read it), CPU-RAM-efficient loading without synced module states, the layer class to
// wrap against the model's blocks, a deepspeed_config_file beside the keys it replaces, and NVMe
// paths the launcher drops.
//
// Findings and the report are CheckDeepSpeedConfig's (planner/check.h); nothing here prints.
// The DeepSpeed config a deepspeed_config_file names is the caller's to read and check.
//
// Thread safety: pure function.
#pragma once

#include <nlohmann/json.hpp>

#include "common/status.h"
#include "planner/check.h"

namespace memplan::planner {

// A JSON object with `distributed_type` or `compute_environment` at the top: what every
// Accelerate config holds and no DeepSpeed config does.
bool IsAccelerateConfig(const nlohmann::json& config);

// Errors only for input that is not an object. options.supplied "micro_batch" (with
// setup.micro_batch) is needed for the fit: an Accelerate config does not carry the batch.
Result<CheckReport> CheckAccelerateConfig(const nlohmann::json& config,
                                          const CheckOptions& options);

}  // namespace memplan::planner
