// The vocabulary of the Schedule (schedule/schedule.h): the enums its fields take, with their
// names in the JSON form and the parsers of those names. They are declared here, in the namespaces
// of the modules that act on them (offload:: for tiers, element types and optimizers, nvme:: for
// backends), so that the planner, which writes Schedules, can name them without linking the
// engine or the storage seam (Note [Schedule contract] in schedule/schedule.h). Each module's own
// header (offload/collective.h, offload/optimizer_swapper.h, nvme/backend.h) includes this one, so
// code there spells them as before.
//
// Thread safety: plain values and stateless functions.
#pragma once

#include <string_view>

#include "common/durability.h"
#include "common/status.h"

namespace memplan::offload {

// Where a Schedule keeps parameters or optimizer state between uses.
enum class Tier { kGpu, kCpu, kNvme };
std::string_view TierName(Tier tier);  // "gpu", "cpu", "nvme"
Result<Tier> ParseTier(std::string_view text);

// The element types the engine moves and reduces (a Collective's unit, a parameter's working
// copy). ElementBytes, which sizes transfers, stays with the Collective (offload/collective.h).
enum class ElementType { kFloat32, kBFloat16, kFloat16 };
std::string_view ElementTypeName(ElementType type);  // "fp32", "bf16", "fp16"
Result<ElementType> ParseElementType(std::string_view text);

// Which optimizer the swapper runs; fixed when the store is created, because it decides how many
// state arrays each sub-group has.
enum class SwapOptimizer {
  kAdam,         // Adam / AdamW: m, v
  kAdamAmsgrad,  // Adam / AdamW with AMSGrad: m, v, max v
  kSgd,          // SGD with momentum: momentum buffer
  kLion,         // Lion: m
};
std::string_view SwapOptimizerName(SwapOptimizer optimizer);  // "adam", "adam-amsgrad", ...
Result<SwapOptimizer> ParseSwapOptimizer(std::string_view name);
// Number of fp32 state arrays the optimizer keeps besides the master weights. Here rather than in
// offload/optimizer_swapper.h because the planner's engine model (planner/engine_model.cc) sizes
// the optimizer's buffers with it, and the two must not drift apart.
int SwapOptimizerStates(SwapOptimizer optimizer);

// What the NVMe optimizer's per-step commit survives (optimizer.durability; memplan::Durability in
// common/durability.h): "process" (a killed process; the default) or "power" (a power loss too).
std::string_view DurabilityName(Durability durability);
Result<Durability> ParseDurability(std::string_view text);

}  // namespace memplan::offload

namespace memplan::nvme {

// Which Backend (nvme/backend.h) CreateBackend builds; kAuto: the best one this machine supports.
enum class BackendKind { kAuto, kUring, kAio, kPosix, kMemory };
std::string_view BackendKindName(BackendKind kind);  // "auto", "uring", "aio", "posix", "memory"
// Also accepts "io_uring" and "libaio", which are never printed.
Result<BackendKind> ParseBackendKind(std::string_view text);

}  // namespace memplan::nvme
