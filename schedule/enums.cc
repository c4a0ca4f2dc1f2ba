// The names of the Schedule's enums (schedule/enums.h), one table each (common/enum_names.h).
#include "schedule/enums.h"

#include <string>

#include "common/enum_names.h"

namespace memplan::offload {

namespace {

constexpr EnumName<Tier> kTiers[] = {
    {Tier::kGpu, "gpu"}, {Tier::kCpu, "cpu"}, {Tier::kNvme, "nvme"}};
constexpr EnumName<ElementType> kElementTypes[] = {{ElementType::kFloat32, "fp32"},
                                                   {ElementType::kBFloat16, "bf16"},
                                                   {ElementType::kFloat16, "fp16"}};
constexpr EnumName<Durability> kDurabilities[] = {{Durability::kProcessCrash, "process"},
                                                  {Durability::kPowerLoss, "power"}};

}  // namespace

std::string_view DurabilityName(Durability durability) { return NameOf(kDurabilities, durability); }
Result<Durability> ParseDurability(std::string_view text) {
  return ParseName(kDurabilities, text, "durability");
}

std::string_view TierName(Tier tier) { return NameOf(kTiers, tier); }
Result<Tier> ParseTier(std::string_view text) { return ParseName(kTiers, text, "tier"); }
std::string_view ElementTypeName(ElementType type) { return NameOf(kElementTypes, type); }
Result<ElementType> ParseElementType(std::string_view text) {
  return ParseName(kElementTypes, text, "dtype");
}

std::string_view SwapOptimizerName(SwapOptimizer optimizer) {
  switch (optimizer) {
    case SwapOptimizer::kAdam: return "adam";
    case SwapOptimizer::kAdamAmsgrad: return "adam-amsgrad";
    case SwapOptimizer::kSgd: return "sgd";
    case SwapOptimizer::kLion: return "lion";
  }
  return "unknown";
}

Result<SwapOptimizer> ParseSwapOptimizer(std::string_view name) {
  for (SwapOptimizer o : {SwapOptimizer::kAdam, SwapOptimizer::kAdamAmsgrad, SwapOptimizer::kSgd,
                          SwapOptimizer::kLion}) {
    if (name == SwapOptimizerName(o)) return o;
  }
  return Status::InvalidArgument("unknown optimizer \"" + std::string(name) +
                                 "\" (expected adam, adam-amsgrad, sgd or lion)");
}

int SwapOptimizerStates(SwapOptimizer optimizer) {
  switch (optimizer) {
    case SwapOptimizer::kAdam: return 2;
    case SwapOptimizer::kAdamAmsgrad: return 3;
    case SwapOptimizer::kSgd: return 1;
    case SwapOptimizer::kLion: return 1;
  }
  return 0;
}

}  // namespace memplan::offload

namespace memplan::nvme {

namespace {

constexpr EnumName<BackendKind> kBackendKinds[] = {{BackendKind::kAuto, "auto"},
                                                   {BackendKind::kUring, "uring"},
                                                   {BackendKind::kAio, "aio"},
                                                   {BackendKind::kPosix, "posix"},
                                                   {BackendKind::kMemory, "memory"}};

}  // namespace

std::string_view BackendKindName(BackendKind kind) { return NameOf(kBackendKinds, kind); }

Result<BackendKind> ParseBackendKind(std::string_view text) {
  if (text == "io_uring") return BackendKind::kUring;
  if (text == "libaio") return BackendKind::kAio;
  return ParseName(kBackendKinds, text, "backend");
}

}  // namespace memplan::nvme
