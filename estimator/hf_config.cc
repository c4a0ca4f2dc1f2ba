#include "estimator/hf_config.h"

#include <algorithm>
#include <map>

#include "common/json.h"
#include "estimator/hf_family.h"

namespace memplan::estimator {
namespace {

const std::map<std::string, FamilyBuilder, std::less<>>& Families() {
  // Families with a hand-written builder; the declared ones are in family::Families().
  static const auto* kFamilies = new std::map<std::string, FamilyBuilder, std::less<>>{
      {"bert", &BuildBert}, {"roberta", &BuildRoberta}, {"xlm-roberta", &BuildXlmRoberta},
      {"distilbert", &BuildDistilBert}, {"t5", &BuildT5},
  };
  return *kFamilies;
}

std::string JoinSupported() {
  std::string out;
  for (const auto& type : SupportedModelTypes()) out += (out.empty() ? "" : ", ") + type;
  return out;
}

}  // namespace

Result<DType> ConfigDType(const ConfigReader& config) {
  for (std::string_view field : {std::string_view("dtype"), std::string_view("torch_dtype")}) {
    if (!config.Has(field)) continue;
    MEMPLAN_ASSIGN_OR_RETURN(std::string text, config.StringOr(field, ""));
    Result<DType> parsed = ParseDType(text);
    return parsed.ok() ? *parsed : DType::kF32;
  }
  return DType::kF32;
}

std::vector<std::string> SupportedModelTypes() {
  std::vector<std::string> out;
  for (const auto& [name, builder] : Families()) out.push_back(name);
  for (const family::FamilySpec* spec : family::Families()) {
    out.push_back(std::string(spec->model_type));
  }
  std::sort(out.begin(), out.end());
  return out;
}

Result<ModelInventory> InventoryFromHfConfigText(std::string_view text, const std::string& source,
                                                 ModelClassChoice choice) {
  return InventoryFromHfConfigText(text, source, BuildOptions{choice});
}

Result<ModelInventory> InventoryFromHfConfig(const nlohmann::json& config,
                                             const std::string& source, ModelClassChoice choice) {
  return InventoryFromHfConfig(config, source, BuildOptions{choice});
}

Result<ModelInventory> InventoryFromHfConfigText(std::string_view text, const std::string& source,
                                                 const BuildOptions& options) {
  MEMPLAN_ASSIGN_OR_RETURN(nlohmann::json config, ParseJson(text, source));
  return InventoryFromHfConfig(config, source, options);
}

Result<ModelInventory> InventoryFromHfConfig(const nlohmann::json& config,
                                             const std::string& source,
                                             const BuildOptions& options) {
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
  const family::FamilySpec* spec = family::FindFamily(model_type);
  if (it == Families().end() && spec == nullptr) {
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
  FamilyRequest request{reader, options.choice, architecture, options.experts};
  if (spec != nullptr) {
    MEMPLAN_RETURN_IF_ERROR(family::Build(*spec, request, &inventory));
  } else {
    MEMPLAN_RETURN_IF_ERROR(it->second(request, &inventory));
  }
  return inventory;
}

}  // namespace memplan::estimator
