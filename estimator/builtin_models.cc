#include "estimator/builtin_models.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <map>
#include <string>
#include <vector>

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

bool EqualsIgnoreCase(std::string_view a, std::string_view b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
           return std::tolower(static_cast<unsigned char>(x)) ==
                  std::tolower(static_cast<unsigned char>(y));
         });
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
