// Resolves what a user passes as --model into a ModelInventory.
//
// Order: an existing path (a config.json, a shape list, a .safetensors file or a header-only copy,
// a model.safetensors.index.json, a directory holding one of these: config.json first, then
// model.safetensors.index.json, then model.safetensors; or a Hugging Face cache folder
// models--org--name, which resolves to the snapshot refs/main names); a built-in model name; a
// Hugging Face repo id "org/name": the local hub cache (matched ignoring case), else a built-in
// model published under that id, else, when LoadOptions::hub allows it, the Hub itself
// (hub.h). Errors say which of these were tried, and suggest the closest built-in names.
//
// A config.json whose model_type memplan cannot build, beside safetensors (or in a Hub repo that
// has them), falls back to the tensors of the safetensors headers; the inventory's notes say so,
// and the config's generic fields still give the architecture for activations.
#pragma once

#include <string>

#include "common/status.h"
#include "estimator/hf_config.h"
#include "estimator/hub.h"
#include "estimator/inventory.h"

namespace memplan::estimator {

struct LoadOptions {
  BuildOptions build;
  // Network access for repo ids not in the cache; off unless the caller allows it (the CLI does,
  // unless --offline or HF_HUB_OFFLINE).
  HubOptions hub;
  // A config.json describing the architecture of an inventory that has none (a shape list,
  // safetensors headers): with it, activations and plans work for any model.
  std::string model_config;
};

Result<ModelInventory> LoadModel(const std::string& spec, ModelClassChoice choice);
Result<ModelInventory> LoadModel(const std::string& spec, const BuildOptions& options);
Result<ModelInventory> LoadModel(const std::string& spec, const LoadOptions& options);

}  // namespace memplan::estimator
