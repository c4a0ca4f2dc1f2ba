#include "estimator/builtin_models.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <map>
#include <string>
#include <vector>

#include "common/strings.h"

namespace memplan::estimator {
namespace {

struct Embedded {
  std::string_view name;
  std::string_view json;
};

constexpr Embedded kEmbedded[] = {
#include "builtin_models_data.inc"
    {"", ""},  // end marker; also keeps the array non-empty
};

// Where each built-in config was published; shown by `memplan models`.
const std::map<std::string_view, std::string_view>& HubIds() {
  static const auto* kIds = new std::map<std::string_view, std::string_view>{
      {"bert-base-uncased", "google-bert/bert-base-uncased"},
      {"bert-large-uncased", "google-bert/bert-large-uncased"},
      {"gemma-2b", "google/gemma-2b"},
      {"gemma-7b", "google/gemma-7b"},
      {"gpt2", "openai-community/gpt2"},
      {"llama-2-7b", "meta-llama/Llama-2-7b-hf"},
      {"llama-2-70b", "meta-llama/Llama-2-70b-hf"},
      {"mistral-7b", "mistralai/Mistral-7B-v0.1"},
      {"mixtral-8x7b", "mistralai/Mixtral-8x7B-v0.1"},
      {"pythia-160m", "EleutherAI/pythia-160m"},
      {"pythia-1b", "EleutherAI/pythia-1b"},
      {"qwen2-0.5b", "Qwen/Qwen2-0.5B"},
      {"qwen2-7b", "Qwen/Qwen2-7B"},
      {"roberta-base", "FacebookAI/roberta-base"},
      {"t5-large", "google-t5/t5-large"},
      {"t5-v1_1-base", "google/t5-v1_1-base"},
      {"flan-t5-base", "google/flan-t5-base"},
      {"llama-3.1-8b", "meta-llama/Llama-3.1-8B"},
      {"llama-3.1-70b", "meta-llama/Llama-3.1-70B"},
      {"llama-3.2-1b", "meta-llama/Llama-3.2-1B"},
      {"llama-3.2-3b", "meta-llama/Llama-3.2-3B"},
      {"llama-3.3-70b", "meta-llama/Llama-3.3-70B-Instruct"},
      {"qwen2.5-0.5b", "Qwen/Qwen2.5-0.5B"},
      {"qwen2.5-7b", "Qwen/Qwen2.5-7B"},
      {"qwen2.5-72b", "Qwen/Qwen2.5-72B"},
      {"qwen3-0.6b", "Qwen/Qwen3-0.6B"},
      {"qwen3-8b", "Qwen/Qwen3-8B"},
      {"qwen3-32b", "Qwen/Qwen3-32B"},
      {"qwen3-30b-a3b", "Qwen/Qwen3-30B-A3B"},
      {"qwen3-235b-a22b", "Qwen/Qwen3-235B-A22B"},
      {"gemma-2-2b", "google/gemma-2-2b"},
      {"gemma-2-9b", "google/gemma-2-9b"},
      {"gemma-2-27b", "google/gemma-2-27b"},
      {"gemma-3-1b", "google/gemma-3-1b-pt"},
      {"mistral-nemo", "mistralai/Mistral-Nemo-Base-2407"},
      {"mpt-7b", "mosaicml/mpt-7b"},
      {"mixtral-8x22b", "mistralai/Mixtral-8x22B-v0.1"},
      {"phi-3-mini", "microsoft/Phi-3-mini-4k-instruct"},
      {"phi-3-medium", "microsoft/Phi-3-medium-4k-instruct"},
      {"deepseek-v3", "deepseek-ai/DeepSeek-V3"},
      {"deepseek-v2-lite", "deepseek-ai/DeepSeek-V2-Lite"},
      {"gpt-oss-20b", "openai/gpt-oss-20b"},
      {"gpt-oss-120b", "openai/gpt-oss-120b"},
  };
  return *kIds;
}

std::vector<BuiltinModel> MakeTable() {
  std::vector<BuiltinModel> out;
  for (const Embedded& e : kEmbedded) {
    if (e.name.empty()) continue;
    auto it = HubIds().find(e.name);
    out.push_back({e.name, it == HubIds().end() ? std::string_view() : it->second, e.json});
  }
  return out;
}

}  // namespace

std::span<const BuiltinModel> BuiltinModels() {
  static const auto* kTable = new std::vector<BuiltinModel>(MakeTable());
  return *kTable;
}

const BuiltinModel* FindBuiltinModel(std::string_view name) {
  for (const BuiltinModel& m : BuiltinModels()) {
    if (EqualsIgnoreCase(m.name, name)) return &m;
  }
  return nullptr;
}

const BuiltinModel* FindBuiltinModelByHubId(std::string_view hub_id) {
  for (const BuiltinModel& m : BuiltinModels()) {
    if (!m.hub_id.empty() && EqualsIgnoreCase(m.hub_id, hub_id)) return &m;
  }
  return nullptr;
}

}  // namespace memplan::estimator
