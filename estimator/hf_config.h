// Builds a ModelInventory from a Hugging Face config.json, without weights and without Python.
//
// Supported `model_type`s: gpt2, gpt_neox, llama, mistral, mixtral, qwen2, gemma, bert, roberta,
// t5. Each family builder reproduces the parameter names and shapes that Transformers'
// `named_parameters()` gives for the same config, applying Transformers' defaults for absent fields.
// Unsupported types are an error that lists the supported ones and points to the shape-list route.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/status.h"
#include "estimator/config_reader.h"
#include "estimator/inventory.h"

namespace memplan::estimator {

// Which class to build. kFromArchitectures follows config.json's `architectures[0]` (task head
// included, tied head counted once); when `architectures` is absent it builds the family's
// usual head (causal LM; masked LM for bert/roberta; conditional generation for t5). kBase builds
// what `AutoModel` builds: no task head (what DeepSpeed's and Accelerate's examples use).
enum class ModelClassChoice { kFromArchitectures, kBase };

// Parses `text` (the contents of a config.json; `source` names it in errors) and builds the
// inventory. inventory.name is set to `source`; callers may rename it.
Result<ModelInventory> InventoryFromHfConfigText(std::string_view text, const std::string& source,
                                                 ModelClassChoice choice);
Result<ModelInventory> InventoryFromHfConfig(const nlohmann::json& config,
                                             const std::string& source, ModelClassChoice choice);

// The model_types InventoryFromHfConfig accepts, sorted.
std::vector<std::string> SupportedModelTypes();

// --- For family builders (hf_families_*.cc) -------------------------------------------------

// What a family builder is asked to build. `architecture` is the requested class name (from
// `architectures[0]`, or "" for the family's default head); builders reject unknown classes with
// an error naming the field 'architectures' and listing the classes they support.
struct FamilyRequest {
  const ConfigReader& config;
  ModelClassChoice choice;
  std::string architecture;
};

// A builder fills `out->tensors` (via out->Add), `out->architecture` (the class actually built,
// e.g. "LlamaForCausalLM" or "LlamaModel") and `out->model_class` ("causal_lm", "masked_lm",
// "seq2seq_lm" or "base"), and `out->arch` (the hyperparameters activations depend on, with the
// same defaults the tensors use). It must not touch the other fields.
using FamilyBuilder = Status (*)(const FamilyRequest& request, ModelInventory* out);

// Defined in hf_families_decoder.cc: gpt2, gpt_neox, llama, mistral, mixtral, qwen2, gemma.
Status BuildGpt2(const FamilyRequest& request, ModelInventory* out);
Status BuildGptNeox(const FamilyRequest& request, ModelInventory* out);
Status BuildLlama(const FamilyRequest& request, ModelInventory* out);
Status BuildMistral(const FamilyRequest& request, ModelInventory* out);
Status BuildMixtral(const FamilyRequest& request, ModelInventory* out);
Status BuildQwen2(const FamilyRequest& request, ModelInventory* out);
Status BuildGemma(const FamilyRequest& request, ModelInventory* out);
// Defined in hf_families_encoder.cc: bert, roberta, t5.
Status BuildBert(const FamilyRequest& request, ModelInventory* out);
Status BuildRoberta(const FamilyRequest& request, ModelInventory* out);
Status BuildT5(const FamilyRequest& request, ModelInventory* out);

}  // namespace memplan::estimator
