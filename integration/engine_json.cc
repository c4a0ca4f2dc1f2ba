#include "integration/engine_json.h"

#include <string>

#include "common/json.h"

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

json ToJson(const offload::EngineStats& s) {
  const offload::ParamSwapperStats& p = s.param;
  return json{
      {"runtime", s.runtime},
      {"steps", s.steps},
      {"epoch", s.epoch},
      {"params", s.params},
      {"elements", s.elements},
      {"rank", s.rank},
      {"world_size", s.world_size},
      {"partition_elements", s.partition_elements},
      {"frozen_params", s.frozen_params},
      {"frozen_elements", s.frozen_elements},
      {"optimizer_elements", s.optimizer_elements},
      {"param",
       {{"fetch_calls", p.fetch_calls},
        {"demand_fetches", p.demand_fetches},
        {"prefetches", p.prefetches},
        {"prefetch_hits", p.prefetch_hits},
        {"prefetch_wasted", p.prefetch_wasted},
        {"kept_for_reuse", p.kept_for_reuse},
        {"trace_invalidations", p.trace_invalidations},
        {"trace_length", p.trace_length},
        {"trace_complete", p.trace_complete},
        {"stall_s", p.stall_s},
        {"nvme_read_bytes", p.nvme_read_bytes},
        {"nvme_write_bytes", p.nvme_write_bytes},
        {"h2d_bytes", p.h2d_bytes},
        {"allgather_bytes", p.allgather_bytes},
        {"live_bytes", p.live_bytes},
        {"peak_live_bytes", p.peak_live_bytes},
        {"ahead_bytes", p.ahead_bytes},
        {"peak_ahead_bytes", p.peak_ahead_bytes},
        {"over_budget_fetches", p.over_budget_fetches},
        {"resident_bytes", p.resident_bytes},
        {"pinned_bytes", p.pinned_bytes},
        {"device_arena_bytes", p.device_arena_bytes},
        {"device_arena_peak_bytes", p.device_arena_peak_bytes},
        {"arena_evictions", p.arena_evictions}}},
      {"d2h_bytes", s.d2h_bytes},
      {"reduce_scatter_bytes", s.reduce_scatter_bytes},
      {"optimizer_read_bytes", s.optimizer_read_bytes},
      {"optimizer_write_bytes", s.optimizer_write_bytes},
      {"grad_write_bytes", s.grad_write_bytes},
      {"nvme_read_bytes", s.nvme_read_bytes},
      {"nvme_write_bytes", s.nvme_write_bytes},
      {"last_step_s", s.last_step_s},
      {"step_profile",
       {{"overlapped", s.step_profile.overlapped},
        {"backward_s", s.step_profile.backward_s},
        {"step_s", s.step_profile.step_s},
        {"optimizer_s", s.step_profile.optimizer_s},
        {"read_s", s.step_profile.read_s},
        {"write_s", s.step_profile.write_s},
        {"sync_s", s.step_profile.sync_s},
        {"backward_wait_s", s.step_profile.backward_wait_s},
        {"stall_s", s.step_profile.stall_s},
        {"sub_groups", s.step_profile.sub_groups},
        {"sub_groups_before_step", s.step_profile.sub_groups_before_step},
        {"overlapped_fraction", s.step_profile.overlapped_fraction}}},
      {"peak_device_bytes", s.peak_device_bytes},
      {"pinned_bytes", s.pinned_bytes},
      {"device_arena_bytes", s.device_arena_bytes},
  };
}

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
