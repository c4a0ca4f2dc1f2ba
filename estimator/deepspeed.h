// DeepSpeed's model-state memory estimators, reproduced to the byte.
//
// These mirror `estimate_zero2_model_states_mem_needs` (DeepSpeed >= 0.14.3) and
// `estimate_zero3_model_states_mem_needs`, including their floating-point evaluation order and
// truncation to integer bytes, so a DeepSpeed user sees the same numbers (REFERENCE.md §1). They
// count model states only (parameters, gradients, Adam states); the full estimator adds the rest.
// DeepSpeed has no ZeRO-1 or NVMe rows, and neither do these tables.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"

namespace memplan::estimator {

struct DeepSpeedHardware {
  int64_t nodes = 1;           // number of nodes (n); >= 1
  int64_t gpus_per_node = 1;   // GPUs per node (g); >= 1
  double buffer_factor = 1.5;  // DeepSpeed's additional_buffer_factor; multiplies CPU memory only

  // Refuses values < 1, a non-finite or negative factor, and absurd sizes (> 2^20 GPUs), naming
  // the field (Note [Field names in errors] in training_setup.h).
  Status Validate() const;
};

struct Zero2Row {
  bool offload_optimizer = false;  // offload_optimizer=cpu
  uint64_t cpu_bytes = 0;          // per node
  uint64_t gpu_bytes = 0;          // per GPU
};

struct Zero3Row {
  bool offload_param = false;      // offload_param=cpu
  bool offload_optimizer = false;  // offload_optimizer=cpu
  bool zero_init = false;          // deepspeed.zero.Init used to build the model
  uint64_t cpu_bytes = 0;          // per node
  uint64_t gpu_bytes = 0;          // per GPU
};

// One row of each estimator. Errors: invalid hardware, or a result that does not fit in 64 bits.
Result<Zero2Row> EstimateZero2(uint64_t total_params, const DeepSpeedHardware& hw,
                               bool offload_optimizer);
Result<Zero3Row> EstimateZero3(uint64_t total_params, uint64_t largest_layer_params,
                               const DeepSpeedHardware& hw, bool offload_param,
                               bool offload_optimizer, bool zero_init);

// The rows in DeepSpeed's printing order: ZeRO-2 optimizer offload cpu, none; ZeRO-3 optimizer
// offload cpu then none, within that param offload cpu then none (param=cpu with optimizer=none
// skipped), within that zero_init 1 then 0.
Result<std::vector<Zero2Row>> Zero2Table(uint64_t total_params, const DeepSpeedHardware& hw);
Result<std::vector<Zero3Row>> Zero3Table(uint64_t total_params, uint64_t largest_layer_params,
                                         const DeepSpeedHardware& hw);

// DeepSpeed's `*_all_cold` printout, line for line ("GB" there is GiB, 2^30 bytes).
std::string FormatZero2Text(uint64_t total_params, const DeepSpeedHardware& hw,
                            const std::vector<Zero2Row>& rows);
std::string FormatZero3Text(uint64_t total_params, uint64_t largest_layer_params,
                            const DeepSpeedHardware& hw, const std::vector<Zero3Row>& rows);

}  // namespace memplan::estimator
