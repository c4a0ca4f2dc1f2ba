// Builds a ModelInventory from a Hugging Face config.json, without weights and without Python.
//
// Supported `model_type`s: SupportedModelTypes(). Each family builder reproduces the parameter
// names and shapes that Transformers' `named_parameters()` gives for the same config, applying
// Transformers' defaults for absent fields. Unsupported types are an error that lists the supported
// ones and points to the shape-list route.
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

// How to build an inventory from a config.json.
struct BuildOptions {
  ModelClassChoice choice = ModelClassChoice::kFromArchitectures;
  // MoE weights as Transformers >= 5 builds them (fused, the default) or as checkpoints and
  // Transformers 4 hold them (one Linear per expert); see Note [Expert layout] in hf_family.h.
  ExpertLayout experts = ExpertLayout::kFused;
  // The model as Transformers >= 5 builds it from the config alone (from_config, as memplan.trace
  // does) rather than as from_pretrained loads a checkpoint. They differ for T5 v1.1 only: its
  // T5Config forces tie_word_embeddings (models/t5/configuration_t5.py __post_init__), so the
  // lm_head built from a config is the shared embedding, while loading a checkpoint whose lm_head
  // differs unties it again.
  bool from_config = false;
};

// Parses `text` (the contents of a config.json; `source` names it in errors) and builds the
// inventory. inventory.name is set to `source`; callers may rename it.
Result<ModelInventory> InventoryFromHfConfigText(std::string_view text, const std::string& source,
                                                 ModelClassChoice choice);
Result<ModelInventory> InventoryFromHfConfig(const nlohmann::json& config,
                                             const std::string& source, ModelClassChoice choice);
Result<ModelInventory> InventoryFromHfConfigText(std::string_view text, const std::string& source,
                                                 const BuildOptions& options);
Result<ModelInventory> InventoryFromHfConfig(const nlohmann::json& config,
                                             const std::string& source,
                                             const BuildOptions& options);

// The model_types InventoryFromHfConfig accepts, sorted. Any other is refused with
// StatusCode::kUnimplemented, so that callers can fall back to the weights' headers.
std::vector<std::string> SupportedModelTypes();

// Gives `inventory` (read from a shape list or safetensors headers, which carry no architecture)
// the architecture `config` describes, so that activations and plans work for it: what the
// family's builder records when memplan builds that model_type (with the no-split modules whose
// paths the inventory has), else the fields most configs name alike (hidden_size / n_embd /
// d_model, num_hidden_layers / n_layer / num_layers, num_attention_heads / n_head, ...), the MLP
// kind judged from the inventory's first block. Sets model_type from the config. Errors name the
// fields looked for; `inventory` is unchanged then.
Status AttachArchitecture(const nlohmann::json& config, const std::string& source,
                          ModelInventory* inventory);

// --- For family builders (hf_families_*.cc) -------------------------------------------------

// What a family builder is asked to build. `architecture` is the requested class name (from
// `architectures[0]`, or "" for the family's default head); builders reject unknown classes with
// an error naming the field 'architectures' and listing the classes they support.
struct FamilyRequest {
  const ConfigReader& config;
  ModelClassChoice choice;
  std::string architecture;
  ExpertLayout experts = ExpertLayout::kFused;
  // Where the model sits inside a larger one ("model.language_model."): prefixed to every name.
  std::string within = {};
  bool from_config = false;  // BuildOptions::from_config
};

// A builder fills `out->tensors` (via out->Add), `out->architecture` (the class actually built,
// e.g. "LlamaForCausalLM" or "LlamaModel") and `out->model_class` ("causal_lm", "masked_lm",
// "seq2seq_lm" or "base"), and `out->arch` (the hyperparameters activations depend on, with the
// same defaults the tensors use). It must not touch the other fields.
using FamilyBuilder = Status (*)(const FamilyRequest& request, ModelInventory* out);

// The storage dtype config.json states: `dtype` (Transformers >= 4.56, preferred as Transformers
// does when both are present) or `torch_dtype`; a spelling ParseDType does not know ("auto")
// means F32, what Transformers builds from a config when told nothing.
Result<DType> ConfigDType(const ConfigReader& config);

// The decoder-only families are tables for the one builder of hf_family.h
// (hf_families_decoder.cc). Defined in hf_families_encoder.cc: bert, roberta, xlm-roberta,
// distilbert, t5.
Status BuildBert(const FamilyRequest& request, ModelInventory* out);
Status BuildRoberta(const FamilyRequest& request, ModelInventory* out);
Status BuildXlmRoberta(const FamilyRequest& request, ModelInventory* out);
Status BuildDistilBert(const FamilyRequest& request, ModelInventory* out);
Status BuildT5(const FamilyRequest& request, ModelInventory* out);

}  // namespace memplan::estimator
