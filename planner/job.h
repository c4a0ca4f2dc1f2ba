// Job: what is to be trained, independent of where: the model, the global batch (samples, or
// tokens converted to samples), the sequence length, and the training settings the planner does
// not search over (precision, optimizer, LoRA/QLoRA, flash attention). The planner searches ZeRO
// stage, offload, checkpointing and micro-batch for it (search.h).
//
// Thread safety: a plain value.
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "common/status.h"
#include "estimator/inventory.h"
#include "estimator/training_setup.h"

namespace memplan::planner {

struct Job {
  std::string model;         // as the user named it (--model)
  int64_t global_batch = 0;  // samples per optimizer step over all GPUs (train_batch_size)
  // The fixed settings: precision, optimizer, LoRA, flash_attention, seq_len (0: the model's
  // default), cuda_context_bytes. Stage, offload, checkpointing, micro_batch, grad_accum and the
  // GPU counts in it are ignored: the search sets them.
  estimator::TrainingSetup setup;

  // global_batch >= 1, and the fixed settings valid for the model (TrainingSetup::ValidateFor).
  Status ValidateFor(const estimator::ModelInventory& inventory) const;
};

// Samples from a token count: tokens / seq_len, which must divide exactly. Errors name the field
// (Note [Field names in errors] in estimator/training_setup.h).
Result<int64_t> SamplesFromTokens(int64_t tokens, int64_t seq_len);

// {"model", "global_batch", "seq_len", "tokens_per_step", "precision", "optimizer", "lora_rank",
//  "qlora", "flash_attention"}; `seq_len` is the resolved one.
nlohmann::json ToJson(const Job& job, int64_t seq_len);

}  // namespace memplan::planner
