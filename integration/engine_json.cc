#include "integration/engine_json.h"

#include <algorithm>
#include <limits>
#include <string>
#include <vector>

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
                                   sub_groups_before_step, overlapped_fraction, clipping, norm_s)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(EngineStats, runtime, steps, epoch, params, elements, rank,
                                   world_size, partition_elements, frozen_params, frozen_elements,
                                   optimizer_elements, param, d2h_bytes, reduce_scatter_bytes,
                                   optimizer_read_bytes, optimizer_write_bytes, grad_write_bytes,
                                   nvme_read_bytes, nvme_write_bytes, groups, skipped_steps,
                                   last_step_skipped, last_grad_norm, last_clip_coefficient,
                                   last_step_s, step_profile, peak_device_bytes, pinned_bytes,
                                   device_arena_bytes)

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

namespace {

// The keys of one group's options (the optimizer's, but the step-wide grad_scale).
std::vector<std::string> GroupKeys(offload::SwapOptimizer optimizer) {
  switch (optimizer) {
    case offload::SwapOptimizer::kAdam:
    case offload::SwapOptimizer::kAdamAmsgrad:
      return {"lr", "beta1", "beta2", "eps", "weight_decay", "decoupled", "bias_correction"};
    case offload::SwapOptimizer::kSgd:
      return {"lr", "momentum", "dampening", "weight_decay", "nesterov"};
    case offload::SwapOptimizer::kLion: return {"lr", "beta1", "beta2", "weight_decay"};
  }
  return {};
}

}  // namespace

Result<offload::StepOptions> EngineStepOptionsFromJson(const json& j,
                                                       offload::SwapOptimizer optimizer) {
  if (!j.is_null() && !j.is_object()) {
    return Status::InvalidArgument("step options: must be a JSON object, got " +
                                   JsonFieldReader::Got(j));
  }
  offload::StepOptions out;
  json common = j.is_null() ? json::object() : j;
  const JsonFieldReader r(common, "step options");
  if (r.Has("max_grad_norm")) {
    const json& v = common.at("max_grad_norm");
    if (v.is_string() && v.get<std::string>() == "inf") {
      out.max_grad_norm = std::numeric_limits<double>::infinity();
    } else if (v.is_number() && v.get<double>() >= 0) {
      out.max_grad_norm = v.get<double>();
    } else {
      return r.Error("max_grad_norm", "must be a number >= 0 (0: no clipping) or \"inf\", got " +
                                          JsonFieldReader::Got(v));
    }
  }
  if (r.Has("norm_type")) {
    const json& v = common.at("norm_type");
    if (v.is_string() && v.get<std::string>() == "inf") {
      out.norm_type = std::numeric_limits<double>::infinity();
    } else if (v.is_number() && (v.get<double>() == 1 || v.get<double>() == 2)) {
      out.norm_type = v.get<double>();
    } else {
      return r.Error("norm_type", "must be 1, 2 or \"inf\", got " + JsonFieldReader::Got(v));
    }
  }
  MEMPLAN_RETURN_IF_ERROR(r.Bool("skip_nonfinite", &out.skip_nonfinite));
  json groups = json::array();
  if (r.Has("groups")) {
    groups = common.at("groups");
    if (!groups.is_array() || groups.empty()) {
      return r.Error("groups", "must be a non-empty array of objects, one per parameter group");
    }
  }
  for (const char* key : {"max_grad_norm", "norm_type", "skip_nonfinite", "groups"}) {
    common.erase(key);
  }
  if (groups.empty()) {
    MEMPLAN_ASSIGN_OR_RETURN(offload::SwapStepOptions one, StepOptionsFromJson(common, optimizer));
    out.groups.push_back(one);
    return out;
  }
  const std::vector<std::string> keys = GroupKeys(optimizer);
  for (size_t g = 0; g < groups.size(); ++g) {
    const std::string what = "step options: groups[" + std::to_string(g) + "]";
    if (!groups[g].is_object()) {
      return Status::InvalidArgument(what + ": must be an object, got " +
                                     JsonFieldReader::Got(groups[g]));
    }
    json merged = common;
    for (const auto& [key, value] : groups[g].items()) {
      if (std::find(keys.begin(), keys.end(), key) == keys.end()) {
        std::string allowed;
        for (const std::string& k : keys) allowed += (allowed.empty() ? "" : ", ") + k;
        return Status::InvalidArgument(what + ": unknown key '" + key + "' (a group takes " +
                                       allowed + ")");
      }
      merged[key] = value;
    }
    Result<offload::SwapStepOptions> one = StepOptionsFromJson(merged, optimizer);
    if (!one.ok()) return one.status().WithPrefix(what);
    out.groups.push_back(*one);
  }
  return out;
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
