// Resolves what a user passes as --model into a ModelInventory.
//
// Order: a built-in model name; an existing path (a config.json, a shape list, a .safetensors
// file, a model.safetensors.index.json, or a directory holding one of these: config.json first,
// then model.safetensors.index.json, then model.safetensors); a Hugging Face repo id "org/name"
// found in the local hub cache. Errors say which of these were tried.
#pragma once

#include <string>

#include "common/status.h"
#include "estimator/hf_config.h"
#include "estimator/inventory.h"

namespace memplan::estimator {

Result<ModelInventory> LoadModel(const std::string& spec, ModelClassChoice choice);
Result<ModelInventory> LoadModel(const std::string& spec, const BuildOptions& options);

}  // namespace memplan::estimator
