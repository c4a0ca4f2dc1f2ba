#include "planner/job.h"

namespace memplan::planner {

Status Job::ValidateFor(const estimator::ModelInventory& inventory) const {
  if (global_batch < 1 || global_batch > (int64_t{1} << 30)) {
    return Status::InvalidArgument("`global_batch` must be in [1, 2^30] samples, got " +
                                   std::to_string(global_batch));
  }
  estimator::TrainingSetup s = setup;
  s.zero_stage = 0;
  s.offload_optimizer = s.offload_param = estimator::OffloadDevice::kNone;
  s.gpus_per_node = s.num_nodes = 1;
  s.tp = 1;
  return s.ValidateFor(inventory);
}

Result<int64_t> SamplesFromTokens(int64_t tokens, int64_t seq_len) {
  if (tokens < 1 || seq_len < 1) {
    return Status::InvalidArgument("`global_batch_tokens` must be >= 1");
  }
  if (tokens % seq_len != 0) {
    return Status::InvalidArgument("`global_batch_tokens` " + std::to_string(tokens) +
                                   " is not a multiple of the sequence length " +
                                   std::to_string(seq_len));
  }
  return tokens / seq_len;
}

nlohmann::json ToJson(const Job& job, int64_t seq_len) {
  return {{"model", job.model},
          {"global_batch", job.global_batch},
          {"seq_len", seq_len},
          {"tokens_per_step", job.global_batch * seq_len},
          {"precision", std::string(estimator::PrecisionName(job.setup.precision))},
          {"optimizer", std::string(estimator::OptimizerName(job.setup.optimizer))},
          {"lora_rank", job.setup.lora_rank},
          {"qlora", job.setup.qlora},
          {"flash_attention", job.setup.flash_attention}};
}

}  // namespace memplan::planner
