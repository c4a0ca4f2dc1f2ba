#include "estimator/hf_config.h"

#include <map>

#include "common/json.h"

namespace memplan::estimator {
namespace {

const std::map<std::string, FamilyBuilder, std::less<>>& Families() {
  static const auto* kFamilies = new std::map<std::string, FamilyBuilder, std::less<>>{
      {"gpt2", &BuildGpt2},       {"gpt_neox", &BuildGptNeox}, {"llama", &BuildLlama},
      {"mistral", &BuildMistral}, {"mixtral", &BuildMixtral},  {"qwen2", &BuildQwen2},
      {"gemma", &BuildGemma},     {"bert", &BuildBert},        {"roberta", &BuildRoberta},
      {"t5", &BuildT5},
  };
  return *kFamilies;
}

std::string JoinSupported() {
  std::string out;
  for (const auto& type : SupportedModelTypes()) out += (out.empty() ? "" : ", ") + type;
  return out;
}

}  // namespace

std::vector<std::string> SupportedModelTypes() {
  std::vector<std::string> out;
  for (const auto& [name, builder] : Families()) out.push_back(name);
  return out;
}

Result<ModelInventory> InventoryFromHfConfigText(std::string_view text, const std::string& source,
                                                 ModelClassChoice choice) {
  MEMPLAN_ASSIGN_OR_RETURN(nlohmann::json config, ParseJson(text, source));
  return InventoryFromHfConfig(config, source, choice);
}

Result<ModelInventory> InventoryFromHfConfig(const nlohmann::json& config,
                                             const std::string& source, ModelClassChoice choice) {
  if (!config.is_object()) {
    return Status::InvalidArgument(source + ": expected a JSON object (a Hugging Face config.json)");
  }
  ConfigReader reader(config, source);
  if (!reader.Has("model_type")) {
    return reader.FieldError("model_type",
                             "is missing; memplan needs it to know the architecture. Supported: " +
                                 JoinSupported() +
                                 ". For other models pass a tensor-shape list or safetensors files");
  }
  MEMPLAN_ASSIGN_OR_RETURN(std::string model_type, reader.StringOr("model_type", ""));
  auto it = Families().find(model_type);
  if (it == Families().end()) {
    return reader.FieldError("model_type",
                             "'" + model_type + "' is not supported. Supported: " +
                                 JoinSupported() +
                                 ". For any other model, pass a tensor-shape list "
                                 "({\"name\": [dims...]}, dumped from PyTorch) or its "
                                 "safetensors files instead");
  }
  std::string architecture;
  if (reader.Has("architectures")) {
    const auto& archs = config["architectures"];
    if (!archs.is_array() || (!archs.empty() && !archs[0].is_string())) {
      return reader.FieldError("architectures", "must be a list of class names");
    }
    if (!archs.empty()) architecture = archs[0].get<std::string>();
  }
  ModelInventory inventory;
  inventory.name = source;
  inventory.model_type = model_type;
  inventory.source = "config";
  FamilyRequest request{reader, choice, architecture};
  MEMPLAN_RETURN_IF_ERROR(it->second(request, &inventory));
  return inventory;
}

}  // namespace memplan::estimator
