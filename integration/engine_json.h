// integration::engine_json: the offload Engine's knobs and statistics as JSON, so that the C API
// and the Python package drive it with the same documents.
//
//   Step options (by the Schedule's optimizer; absent keys keep the C++ defaults, unknown keys are
//   errors naming the key):
//     adam / adam-amsgrad: {"lr", "beta1", "beta2", "eps", "weight_decay", "decoupled",
//                           "bias_correction", "grad_scale"}   (amsgrad follows the Schedule)
//     sgd:                 {"lr", "momentum", "dampening", "weight_decay", "nesterov",
//     "grad_scale"} lion:                {"lr", "beta1", "beta2", "weight_decay", "grad_scale"}
//   and for every optimizer (offload::StepOptions):
//     "groups": [{...}, ...]  one object per parameter group (ParamSpec::group), each with the
//                             optimizer's keys but grad_scale, overriding the top-level values for
//                             that group (torch.optim's param_groups); absent: one for all
//     "max_grad_norm": 0      clip by the global gradient norm (0: off; "inf": measure only)
//     "norm_type": 2          1, 2 or "inf"
//     "skip_nonfinite": false skip a step whose gradients hold an inf or NaN (loss scaling)
//   Open options: {"runtime": "auto" | "host" | "cuda", "resume": false, "device": null}; "device"
//   is the CUDA device ordinal of the runtime (null or absent: the calling thread's current device,
//   as torch.cuda.set_device leaves it)
//   Statistics: every EngineStats field by its C++ name, "param" holding ParamSwapperStats'.
//
// Thread safety: plain functions.
#pragma once

#include <nlohmann/json.hpp>

#include "common/status.h"
#include "offload/engine.h"

namespace memplan::integration {

Result<offload::SwapStepOptions> StepOptionsFromJson(const nlohmann::json& json,
                                                     offload::SwapOptimizer optimizer);
// The whole step: per-group options, clipping, skipping (above).
Result<offload::StepOptions> EngineStepOptionsFromJson(const nlohmann::json& json,
                                                       offload::SwapOptimizer optimizer);
nlohmann::json ToJson(const offload::EngineStats& stats);

struct EngineOpenOptions {
  std::string runtime = "auto";  // "auto": CUDA when usable, else host; "host"; "cuda"
  bool resume = false;
  int device = -1;  // gpu::kCurrentDevice: the calling thread's current device
};
Result<EngineOpenOptions> EngineOpenOptionsFromJson(const nlohmann::json& json);

}  // namespace memplan::integration
