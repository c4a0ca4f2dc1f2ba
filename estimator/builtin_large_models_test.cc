// The built-in configs added for the planner's scenarios (llama-2-70b, bert-large-uncased),
// checked against their published parameter counts.
#include <doctest/doctest.h>

#include <filesystem>
#include <string>

#include "estimator/builtin_models.h"
#include "estimator/inventory.h"
#include "tests/estimator_testing.h"

namespace memplan::estimator {
namespace {

using namespace memplan::testing;

TEST_CASE("builtin: llama-2-70b has 68,976,648,192 parameters (LlamaForCausalLM)") {
  ModelInventory llama = Fixture("llama-2-70b");
  ModelCounts counts = Counts(llama);
  // 80 layers x (2 x 8192^2 + 2 x 8192 x 1024 (8 kv heads x 128) + 3 x 8192 x 28672 + 2 x 8192)
  // + embedding and head 2 x 32000 x 8192 + final norm 8192.
  CHECK(counts.params_total == 68'976'648'192ull);
  CHECK(counts.largest_layer_params == 32000ull * 8192);  // embedding (or head) > an MLP matrix
  CHECK(Tensor(llama, "model.layers.0.self_attn.k_proj.weight").shape == Shape{1024, 8192});
  CHECK(llama.arch->kv_heads == 8);
  ModelInventory base = Fixture("llama-2-70b", ModelClassChoice::kBase);
  CHECK(Counts(base).params_total == 68'976'648'192ull - 32000ull * 8192);
  REQUIRE(FindBuiltinModel("llama-2-70b") != nullptr);
  CHECK(FindBuiltinModel("llama-2-70b")->hub_id == "meta-llama/Llama-2-70b-hf");
}

TEST_CASE("builtin: bert-large-uncased has 335,141,888 parameters as BertModel with pooler") {
  // Hugging Face: bert-large-uncased BertModel 335,141,888; BertForMaskedLM drops the pooler and
  // adds the prediction head transform (1024^2 + 1024 + 2 x 1024) and the 30,522 decoder bias.
  CHECK(Counts(Fixture("bert-large-uncased", ModelClassChoice::kBase)).params_total ==
        335'141'888ull);
  CHECK(Counts(Fixture("bert-large-uncased")).params_total == 335'174'458ull);
}

TEST_CASE("builtin: every file of estimator/models is a model by its whole name, with its Hub id") {
  // "qwen2.5-7b.json" is qwen2.5-7b, not "qwen2" (the name ends at the last dot only).
  size_t files = 0;
  for (const auto& entry :
       std::filesystem::directory_iterator(std::string(MEMPLAN_SOURCE_DIR) + "/estimator/models")) {
    const std::string name = entry.path().stem().string();
    CAPTURE(name);
    ++files;
    const BuiltinModel* model = FindBuiltinModel(name);
    REQUIRE(model != nullptr);
    CHECK(model->name == name);
    CHECK_FALSE(model->hub_id.empty());
    CHECK(FindBuiltinModelByHubId(model->hub_id) == model);
  }
  CHECK(BuiltinModels().size() == files);
}

}  // namespace
}  // namespace memplan::estimator
