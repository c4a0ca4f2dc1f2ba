// Reading a DeepSpeed config (ds_config.json) into a TrainingSetup: the one place memplan reads
// DeepSpeed's keys (`memplan estimate --deepspeed`, the JSON requests' "deepspeed", and the
// setup `memplan check` verifies). Writing DeepSpeed configs is planner/emit.h; checking one
// against DeepSpeed's own rules is planner/check.h; DeepSpeed's estimator tables are
// estimator/deepspeed.h.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <set>
#include <string>

#include "common/status.h"
#include "estimator/training_setup.h"

namespace memplan::estimator {

// Reads the settings of a DeepSpeed config into `setup` (fields the config does not mention are
// left as they are): zero_optimization (stage, buckets, overlap_comm, offload_optimizer/param
// with device, pin_memory, buffer_count, buffer_size; legacy cpu_offload), fp16/bf16 enabled,
// train_micro_batch_size_per_gpu, gradient_accumulation_steps, optimizer.type,
// activation_checkpointing (present: full checkpointing), aio.
//
// A setting whose field is in `supplied` (the TrainingSetup field names the caller set itself,
// e.g. from flags: "micro_batch", "grad_accum", "precision", "optimizer", "zero_stage",
// "offload_optimizer", "offload_param", "checkpointing") keeps the caller's value, "auto" or not.
// Other "auto" values (the Hugging Face Trainer fills those): bucket sizes are filled as the
// Trainer does from the model width `hidden` (h*h, 0.9*h*h, 10*h) when hidden > 0; any other "auto"
// is an error naming the key and the field that supplies it (`micro_batch`). Errors name `source`
// and the key.
Status ApplyDeepSpeedConfig(const nlohmann::json& config, const std::string& source,
                            const std::set<std::string>& supplied, int64_t hidden,
                            TrainingSetup* setup);

}  // namespace memplan::estimator
