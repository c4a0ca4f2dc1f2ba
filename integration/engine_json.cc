#include "integration/engine_json.h"

#include <string>

#include "common/json.h"

namespace memplan::offload {

// The engine's statistics as JSON (ToJson below): each object's keys are its field names. These
// live here, not in offload/, which knows nothing of JSON.
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(ParamSwapperStats, fetch_calls, demand_fetches, prefetches,
                                   prefetch_hits, prefetch_wasted, kept_for_reuse,
                                   trace_invalidations, trace_length, trace_complete, stall_s,
                                   nvme_read_bytes, nvme_write_bytes, h2d_bytes, allgather_bytes,
                                   live_bytes, peak_live_bytes, ahead_bytes, peak_ahead_bytes,
                                   over_budget_fetches, resident_bytes, pinned_bytes,
                                   device_arena_bytes, device_arena_peak_bytes, arena_evictions)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(EngineStepProfile, overlapped, backward_s, step_s, optimizer_s,
                                   read_s, write_s, sync_s, backward_wait_s, stall_s, sub_groups,
                                   sub_groups_before_step, overlapped_fraction)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(EngineStats, runtime, steps, epoch, params, elements, rank,
                                   world_size, partition_elements, frozen_params, frozen_elements,
                                   optimizer_elements, param, d2h_bytes, reduce_scatter_bytes,
                                   optimizer_read_bytes, optimizer_write_bytes, grad_write_bytes,
                                   nvme_read_bytes, nvme_write_bytes, last_step_s, step_profile,
                                   peak_device_bytes, pinned_bytes, device_arena_bytes)

}  // namespace memplan::offload

namespace memplan::integration {
namespace {

using nlohmann::json;

}  // namespace

Result<offload::SwapStepOptions> StepOptionsFromJson(const json& j,
                                                     offload::SwapOptimizer optimizer) {
  const std::string what =
      "step options (" + std::string(offload::SwapOptimizerName(optimizer)) + ")";
  const JsonFieldReader r(j, what);
  switch (optimizer) {
    case offload::SwapOptimizer::kAdam:
    case offload::SwapOptimizer::kAdamAmsgrad: {
      MEMPLAN_RETURN_IF_ERROR(r.CheckKeys({"lr", "beta1", "beta2", "eps", "weight_decay",
                                           "decoupled", "bias_correction", "grad_scale"}));
      offload::AdamOptions o;
      o.amsgrad = optimizer == offload::SwapOptimizer::kAdamAmsgrad;
      MEMPLAN_RETURN_IF_ERROR(r.Number("lr", &o.lr));
      MEMPLAN_RETURN_IF_ERROR(r.Number("beta1", &o.beta1));
      MEMPLAN_RETURN_IF_ERROR(r.Number("beta2", &o.beta2));
      MEMPLAN_RETURN_IF_ERROR(r.Number("eps", &o.eps));
      MEMPLAN_RETURN_IF_ERROR(r.Number("weight_decay", &o.weight_decay));
      MEMPLAN_RETURN_IF_ERROR(r.Bool("decoupled", &o.decoupled));
      MEMPLAN_RETURN_IF_ERROR(r.Bool("bias_correction", &o.bias_correction));
      MEMPLAN_RETURN_IF_ERROR(r.Number("grad_scale", &o.grad_scale));
      MEMPLAN_RETURN_IF_ERROR(o.Validate());
      return offload::SwapStepOptions(o);
    }
    case offload::SwapOptimizer::kSgd: {
      MEMPLAN_RETURN_IF_ERROR(
          r.CheckKeys({"lr", "momentum", "dampening", "weight_decay", "nesterov", "grad_scale"}));
      offload::SgdOptions o;
      MEMPLAN_RETURN_IF_ERROR(r.Number("lr", &o.lr));
      MEMPLAN_RETURN_IF_ERROR(r.Number("momentum", &o.momentum));
      MEMPLAN_RETURN_IF_ERROR(r.Number("dampening", &o.dampening));
      MEMPLAN_RETURN_IF_ERROR(r.Number("weight_decay", &o.weight_decay));
      MEMPLAN_RETURN_IF_ERROR(r.Bool("nesterov", &o.nesterov));
      MEMPLAN_RETURN_IF_ERROR(r.Number("grad_scale", &o.grad_scale));
      MEMPLAN_RETURN_IF_ERROR(o.Validate());
      return offload::SwapStepOptions(o);
    }
    case offload::SwapOptimizer::kLion: {
      MEMPLAN_RETURN_IF_ERROR(r.CheckKeys({"lr", "beta1", "beta2", "weight_decay", "grad_scale"}));
      offload::LionOptions o;
      MEMPLAN_RETURN_IF_ERROR(r.Number("lr", &o.lr));
      MEMPLAN_RETURN_IF_ERROR(r.Number("beta1", &o.beta1));
      MEMPLAN_RETURN_IF_ERROR(r.Number("beta2", &o.beta2));
      MEMPLAN_RETURN_IF_ERROR(r.Number("weight_decay", &o.weight_decay));
      MEMPLAN_RETURN_IF_ERROR(r.Number("grad_scale", &o.grad_scale));
      MEMPLAN_RETURN_IF_ERROR(o.Validate());
      return offload::SwapStepOptions(o);
    }
  }
  return Status::Internal("step options: unknown optimizer");
}

json ToJson(const offload::EngineStats& s) { return s; }

Result<EngineOpenOptions> EngineOpenOptionsFromJson(const json& j) {
  EngineOpenOptions o;
  if (j.is_null()) return o;
  const JsonFieldReader r(j, "engine options");
  MEMPLAN_RETURN_IF_ERROR(r.CheckKeys({"runtime", "resume", "device"}));
  MEMPLAN_RETURN_IF_ERROR(r.String("runtime", &o.runtime));
  if (o.runtime != "auto" && o.runtime != "host" && o.runtime != "cuda") {
    return r.Error("runtime", "must be \"auto\", \"host\" or \"cuda\", not \"" + o.runtime + "\"");
  }
  MEMPLAN_RETURN_IF_ERROR(r.Bool("resume", &o.resume));
  if (r.Has("device") && !j.at("device").is_null()) {
    int device = 0;
    if (!r.Integer("device", &device, 0, 1024).ok()) {
      return r.Error("device",
                     "must be a CUDA device ordinal (0, 1, ...) or null (the calling thread's "
                     "current device)");
    }
    o.device = device;
  }
  return o;
}

}  // namespace memplan::integration
