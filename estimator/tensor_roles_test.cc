// Tests of Note [Tensor roles] (inventory.h): every tensor of every family the builders know gets
// a role from its builder, and the one name classifier (for shape lists and safetensors headers)
// gives the same role to the same names, so an inventory means the same whatever its source.
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "estimator/builtin_models.h"
#include "estimator/hf_config.h"
#include "estimator/inventory.h"
#include "estimator/shape_list.h"
#include "tests/estimator_testing.h"

namespace memplan::estimator {
namespace {

// Every config the suites build: the built-in models and both oracles' configs.
std::vector<std::pair<std::string, std::string>> AllConfigs() {
  std::vector<std::pair<std::string, std::string>> out;
  for (const BuiltinModel& m : BuiltinModels()) {
    out.emplace_back(std::string(m.name), std::string(m.config_json));
  }
  for (const char* dir : {"/tests/oracle/configs", "/tests/oracle/modern_configs"}) {
    for (const auto& entry :
         std::filesystem::directory_iterator(std::string(MEMPLAN_SOURCE_DIR) + dir)) {
      if (entry.path().extension() != ".json") continue;
      std::ifstream in(entry.path());
      std::stringstream text;
      text << in.rdbuf();
      out.emplace_back(entry.path().filename().string(), text.str());
    }
  }
  return out;
}

void CheckRoles(const ModelInventory& inv, const std::string& what) {
  for (const TensorInfo& t : inv.tensors) {
    INFO(what << ": " << t.name);
    CHECK(t.role != TensorRole::kUnknown);
    const TensorTraits named = ClassifyTensor(t.name, t.shape, inv.model_type);
    CHECK(TensorRoleName(named.role) == TensorRoleName(t.role));
    // A router is a Linear in checkpoints and a bare Parameter in Transformers 5, and a head's
    // bias belongs to the Linear (Phi) or to the head module (RoBERTa): names cannot say which,
    // and nothing downstream needs them to (IsLinearWeight is false for every bias).
    CHECK(named.bias == t.bias);
    if (t.role != TensorRole::kRouter && !t.bias) {
      CHECK(static_cast<int>(named.kind) == static_cast<int>(t.kind));
    }
  }
}

TEST_CASE("roles: the builders give every tensor a role, and the name classifier agrees") {
  size_t built = 0;
  for (const auto& [name, json] : AllConfigs()) {
    for (ModelClassChoice choice :
         {ModelClassChoice::kFromArchitectures, ModelClassChoice::kBase}) {
      Result<ModelInventory> inv = InventoryFromHfConfigText(json, name, choice);
      if (!inv.ok()) continue;  // configs kept to test refusals
      CheckRoles(*inv, name);
      ++built;
      BuildOptions per_expert;
      per_expert.choice = choice;
      per_expert.experts = ExpertLayout::kPerExpert;
      Result<ModelInventory> experts =
          InventoryFromHfConfig(nlohmann::json::parse(json), name, per_expert);
      if (experts.ok()) CheckRoles(*experts, name + " (per expert)");
    }
  }
  CHECK(built > 100);
}

TEST_CASE("roles: what a role decides downstream") {
  ModelInventory llama = memplan::testing::Fixture("llama-2-7b");
  const TensorInfo& q = memplan::testing::Tensor(llama, "model.layers.0.self_attn.q_proj.weight");
  CHECK(q.role == TensorRole::kAttentionQ);
  CHECK(q.IsLinearWeight());
  CHECK(QkvParts(q.role) == 1);
  CHECK(memplan::testing::Tensor(llama, "lm_head.weight").role == TensorRole::kHead);
  CHECK(memplan::testing::Tensor(llama, "model.embed_tokens.weight").kind ==
        ModuleKind::kEmbedding);
  // GPT-2's Conv1D stores [in, out]: the features come from the kind, not the model_type.
  ModelInventory gpt2 = memplan::testing::Fixture("gpt2");
  const TensorInfo& c_fc = memplan::testing::Tensor(gpt2, "transformer.h.0.mlp.c_fc.weight");
  CHECK(c_fc.kind == ModuleKind::kConv1D);
  CHECK(c_fc.InFeatures() == 768);
  CHECK(c_fc.OutFeatures() == 3072);
  CHECK(QkvParts(memplan::testing::Tensor(gpt2, "transformer.h.0.attn.c_attn.weight").role) == 7);
  // A shape list names tensors only; the classifier places them, unknown names stay unknown.
  Result<ModelInventory> list = InventoryFromShapeListText(
      R"({"model_type": "gpt2", "tensors": {"h.0.attn.c_attn.weight": [8, 24],
          "h.0.mlp.c_proj.weight": [32, 8], "h.0.frobnicator.weight": [8, 8],
          "h.0.ln_1.weight": [8], "wte.weight": [100, 8]}})",
      "list.json");
  REQUIRE_MESSAGE(list.ok(), list.status().ToString());
  CHECK(memplan::testing::Tensor(*list, "h.0.attn.c_attn.weight").kind == ModuleKind::kConv1D);
  CHECK(memplan::testing::Tensor(*list, "h.0.mlp.c_proj.weight").role == TensorRole::kMlpDown);
  const TensorInfo& unknown = memplan::testing::Tensor(*list, "h.0.frobnicator.weight");
  CHECK(unknown.role == TensorRole::kUnknown);
  CHECK(unknown.IsLinearWeight());  // a 2-D weight of no known module is still a Linear
  CHECK(memplan::testing::Tensor(*list, "h.0.ln_1.weight").kind == ModuleKind::kNorm);
  CHECK(memplan::testing::Tensor(*list, "wte.weight").kind == ModuleKind::kEmbedding);
}

}  // namespace
}  // namespace memplan::estimator
