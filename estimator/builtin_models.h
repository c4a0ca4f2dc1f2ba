// Well-known configs compiled into the binary, usable as `--model llama-2-7b` with no files.
// The JSON texts are the config.json files published on the Hugging Face Hub for these models
// (estimator/models/*.json, embedded at build time).
#pragma once

#include <span>
#include <string_view>

namespace memplan::estimator {

struct BuiltinModel {
  std::string_view name;         // "llama-2-7b"
  std::string_view hub_id;       // "meta-llama/Llama-2-7b-hf"
  std::string_view config_json;  // the config.json text
};

std::span<const BuiltinModel> BuiltinModels();
// nullptr when `name` is not built in (case-insensitive).
const BuiltinModel* FindBuiltinModel(std::string_view name);
// The built-in model published as `hub_id` ("meta-llama/Llama-2-7b-hf"), or nullptr.
const BuiltinModel* FindBuiltinModelByHubId(std::string_view hub_id);

}  // namespace memplan::estimator
