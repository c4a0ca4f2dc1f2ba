// Tests for the families declared for the one builder (hf_family.h): structure each family's
// switches select, MoE placement and layouts, MLA, sliding windows, heads and labels.
//
// Totals are what Transformers 5.23 builds for the same configs (tests/oracle/
// modern_oracle_test.py checks every tensor of these and more); each also matches the rounded
// figure the model's Hub page publishes, so a wrong shape anywhere moves the count and fails.
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "estimator/hf_config.h"
#include "estimator/inventory.h"
#include "tests/estimator_testing.h"

namespace memplan::estimator {
namespace {

using namespace memplan::testing;

nlohmann::json FixtureJson(const std::string& name) {
  return nlohmann::json::parse(ReadFixture(name));
}

ModelInventory PerExpert(const nlohmann::json& config) {
  BuildOptions options;
  options.experts = ExpertLayout::kPerExpert;
  Result<ModelInventory> inventory = InventoryFromHfConfig(config, "test/config.json", options);
  REQUIRE_MESSAGE(inventory.ok(), inventory.status().ToString());
  return std::move(inventory).value();
}

std::string BuildError(const nlohmann::json& config) {
  Result<ModelInventory> inventory = Build(config);
  REQUIRE_FALSE_MESSAGE(inventory.ok(), "expected an error for " << config.dump());
  return inventory.status().message();
}

bool Contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST_CASE("family: qwen3 has per-head q/k norms; Qwen3-8B is 8.19B") {
  ModelInventory qwen = Fixture("qwen3-8b");
  CHECK(Total(qwen) == 8'190'735'360ull);
  CHECK(Tensor(qwen, "model.layers.0.self_attn.q_norm.weight").shape == Shape{128});
  CHECK(Tensor(qwen, "model.layers.35.self_attn.k_norm.weight").shape == Shape{128});
  // head_dim 128 with 32 heads is 4096 = hidden; without head_dim, Qwen3Config's default is 128.
  nlohmann::json config = FixtureJson("qwen3-0.6b");
  CHECK(Total(Fixture("qwen3-0.6b")) == 596'049'920ull);  // tied head
  config.erase("head_dim");
  CHECK(Tensor(MustBuild(config), "model.layers.0.self_attn.q_proj.weight").shape ==
        Shape{16 * 128, 1024});
}

TEST_CASE("family: qwen3_moe places experts by decoder_sparse_step and mlp_only_layers") {
  nlohmann::json config = FixtureJson("qwen3-30b-a3b");
  ModelInventory fused = MustBuild(config);
  ModelCounts counts = Counts(fused);
  CHECK(counts.params_total == 30'532'122'624ull);
  // Fused (Transformers 5): a layer's 128 experts are one module, DeepSpeed's largest.
  CHECK(counts.largest_layer_params == 128ull * 3 * 2048 * 768);
  CHECK(counts.largest_layer_module == "model.layers.0.mlp.experts");
  REQUIRE(fused.arch.has_value());
  CHECK(fused.arch->experts == 128);
  CHECK(fused.arch->experts_per_token == 8);
  CHECK(fused.arch->intermediate == 768);
  CHECK(fused.arch->moe_layers == 48);
  CHECK(fused.arch->no_split_class == "Qwen3MoeDecoderLayer");
  // Per expert, as the checkpoint stores it: the same total, 128 x 3 Linears per layer.
  ModelInventory per_expert = PerExpert(config);
  CHECK(Total(per_expert) == 30'532'122'624ull);
  CHECK(Tensor(per_expert, "model.layers.47.mlp.experts.127.down_proj.weight").shape ==
        Shape{2048, 768});
  CHECK(Counts(per_expert).largest_layer_module == "model.embed_tokens");

  // Every second layer sparse, and layer 1 dense too: 24 MoE layers become 23, and each dense
  // layer holds an intermediate_size MLP instead of experts and router.
  const uint64_t moe_layer = 128ull * 3 * 2048 * 768 + 128ull * 2048;
  const uint64_t dense_layer = 3ull * 2048 * 6144;
  config["decoder_sparse_step"] = 2;
  config["mlp_only_layers"] = {1};
  ModelInventory sparse = MustBuild(config);
  CHECK(sparse.arch->moe_layers == 23);
  CHECK(sparse.arch->dense_intermediate == 6144);
  CHECK(Total(sparse) == 30'532'122'624ull - 25 * (moe_layer - dense_layer));
  CHECK(Tensor(sparse, "model.layers.0.mlp.gate_proj.weight").shape == Shape{6144, 2048});
  CHECK(sparse.Find("model.layers.1.mlp.experts.gate_up_proj") < 0);
  CHECK(sparse.Find("model.layers.3.mlp.experts.gate_up_proj") >= 0);
  config["mlp_only_layers"] = "1";
  CHECK(Contains(BuildError(config), "'mlp_only_layers'"));
}

TEST_CASE("family: qwen2_moe has a gated shared expert beside the routed ones") {
  ModelInventory qwen = Fixture("qwen2-7b");  // a dense sibling for contrast: no experts
  CHECK(qwen.arch->experts == 0);
  nlohmann::json config = FixtureJson("qwen2.5-0.5b");
  config["model_type"] = "qwen2_moe";
  config["architectures"] = {"Qwen2MoeForCausalLM"};
  config["num_experts"] = 4;
  config["num_experts_per_tok"] = 2;
  config["moe_intermediate_size"] = 64;
  config["shared_expert_intermediate_size"] = 128;
  ModelInventory moe = MustBuild(config);
  CHECK(Tensor(moe, "model.layers.0.mlp.shared_expert.gate_proj.weight").shape == Shape{128, 896});
  CHECK(Tensor(moe, "model.layers.0.mlp.shared_expert_gate.weight").shape == Shape{1, 896});
  CHECK(Tensor(moe, "model.layers.0.mlp.experts.gate_up_proj").shape == Shape{4, 128, 896});
  CHECK(Tensor(moe, "model.layers.0.self_attn.q_proj.bias").shape == Shape{896});
  CHECK(moe.arch->shared_intermediate == 128);
  ModelInventory per_expert = PerExpert(config);
  CHECK(Tensor(per_expert, "model.layers.0.mlp.experts.3.up_proj.weight").shape == Shape{64, 896});
  CHECK(Tensor(per_expert, "model.layers.0.mlp.gate.weight").shape == Shape{4, 896});
  CHECK(Total(per_expert) == Total(moe));
}

TEST_CASE("family: deepseek_v3 is MLA with dense first layers, shared experts and an MTP module") {
  ModelInventory v3 = Fixture("deepseek-v3");
  ModelCounts counts = Counts(v3);
  CHECK(counts.params_total == 671'026'404'352ull);
  REQUIRE(v3.arch.has_value());
  const ArchitectureInfo& a = *v3.arch;
  CHECK(a.moe_layers == 61 - 3);
  CHECK(a.dense_intermediate == 18432);
  CHECK(a.intermediate == 2048);
  CHECK(a.shared_intermediate == 2048);
  CHECK(a.kv_lora_rank == 512);
  CHECK(a.qk_rope_head_dim == 64);
  CHECK(a.q_lora_rank == 1536);
  CHECK(a.head_dim == 192);
  // The checkpoint's "685B": one more MoE layer with its own embedding, head, two norms and a
  // 2h -> h projection, in the checkpoint but not in the model Transformers builds. (The Hub's
  // safetensors total adds the FP8 weights' block scales on top.)
  CHECK(a.mtp_layers == 1);
  uint64_t moe_layer = 0;
  for (const TensorInfo& t : v3.tensors) moe_layer += t.block == "model.layers.3" ? t.numel : 0;
  CHECK(a.mtp_params == moe_layer + 2ull * 129280 * 7168 + 3 * 7168 + 2ull * 7168 * 7168);
  CHECK(counts.params_total + a.mtp_params == 684'489'830'400ull);
  CHECK(Tensor(v3, "model.layers.0.mlp.gate_proj.weight").shape == Shape{18432, 7168});
  CHECK(Tensor(v3, "model.layers.3.self_attn.q_a_proj.weight").shape == Shape{1536, 7168});
  CHECK(Tensor(v3, "model.layers.3.self_attn.kv_a_proj_with_mqa.weight").shape == Shape{576, 7168});
  CHECK(Tensor(v3, "model.layers.3.self_attn.kv_b_proj.weight").shape == Shape{128 * 256, 512});
  CHECK(Tensor(v3, "model.layers.3.mlp.shared_experts.down_proj.weight").shape ==
        Shape{7168, 2048});
  // The router's score-correction bias is a buffer, not a parameter.
  CHECK(v3.Find("model.layers.3.mlp.gate.e_score_correction_bias") < 0);
  bool bias_buffer = false;
  for (const TensorInfo& b : v3.buffers) {
    bias_buffer |= b.name == "model.layers.3.mlp.gate.e_score_correction_bias";
  }
  CHECK(bias_buffer);

  // q_lora_rank null: a full q_proj (DeepSeek-V2-Lite).
  ModelInventory lite = Fixture("deepseek-v2-lite");
  CHECK(Total(lite) == 15'706'484'224ull);
  CHECK(Tensor(lite, "model.layers.0.self_attn.q_proj.weight").shape == Shape{16 * 192, 2048});
  CHECK(lite.Find("model.layers.0.self_attn.q_a_proj.weight") < 0);
  CHECK(lite.arch->mtp_params == 0);
}

TEST_CASE("family: sliding-window layers come from layer_types or the family's rule") {
  ModelInventory gemma2 = Fixture("gemma-2-9b");
  CHECK(Total(gemma2) == 9'241'705'984ull);
  REQUIRE(gemma2.arch->sliding_layers.size() == 42);
  CHECK(gemma2.arch->sliding_window == 4096);
  CHECK(gemma2.arch->sliding_layers[0]);
  CHECK_FALSE(gemma2.arch->sliding_layers[1]);
  CHECK(Tensor(gemma2, "model.layers.0.pre_feedforward_layernorm.weight").shape == Shape{3584});
  ModelInventory gemma3 = Fixture("gemma-3-1b");
  // Gemma-3: five sliding layers, then one full (sliding_window_pattern 6).
  CHECK(gemma3.arch->sliding_layers[4]);
  CHECK_FALSE(gemma3.arch->sliding_layers[5]);
  CHECK(gemma3.arch->sliding_window == 512);
  CHECK(Tensor(gemma3, "model.layers.0.self_attn.q_norm.weight").shape == Shape{256});
  // gpt-oss states layer_types; a wrong length is an error naming the field.
  nlohmann::json oss = FixtureJson("gpt-oss-20b");
  ModelInventory gpt_oss = MustBuild(oss);
  CHECK(Total(gpt_oss) == 20'914'757'184ull);
  CHECK(gpt_oss.arch->attention_sinks);
  CHECK(Tensor(gpt_oss, "model.layers.0.self_attn.sinks").shape == Shape{64});
  CHECK(Tensor(gpt_oss, "model.layers.0.mlp.experts.gate_up_proj").shape ==
        Shape{32, 2880, 2 * 2880});
  CHECK(Tensor(gpt_oss, "model.layers.0.mlp.router.bias").shape == Shape{32});
  oss["layer_types"] = {"full_attention"};
  CHECK(Contains(BuildError(oss), "'layer_types'"));
  // Mistral: sliding_window applies to every layer; Mistral-Nemo's null turns it off.
  CHECK(Fixture("mistral-7b").arch->sliding_layers.size() == 32);
  CHECK(Fixture("mistral-nemo").arch->sliding_layers.empty());
  // Qwen2.5 states a window but does not use it.
  CHECK(Fixture("qwen2.5-7b").arch->sliding_layers.empty());
}

TEST_CASE("family: falcon's three attention layouts and norm arrangements") {
  nlohmann::json falcon = {{"model_type", "falcon"},
                           {"hidden_size", 64},
                           {"num_hidden_layers", 1},
                           {"num_attention_heads", 4},
                           {"vocab_size", 100}};
  // Falcon-7B style (the defaults): multi-query, parallel attention with one norm.
  ModelInventory mq = MustBuild(falcon);
  CHECK(Tensor(mq, "transformer.h.0.self_attention.query_key_value.weight").shape ==
        Shape{64 + 2 * 16, 64});
  CHECK(mq.Find("transformer.h.0.input_layernorm.bias") >= 0);
  CHECK(mq.arch->kv_heads == 1);
  CHECK(Tensor(mq, "lm_head.weight").tied_to == "transformer.word_embeddings.weight");
  // Falcon-40B style: grouped kv heads and ln_attn + ln_mlp.
  falcon["new_decoder_architecture"] = true;
  falcon["num_kv_heads"] = 2;
  ModelInventory gqa = MustBuild(falcon);
  CHECK(Tensor(gqa, "transformer.h.0.self_attention.query_key_value.weight").shape ==
        Shape{(4 + 2 * 2) * 16, 64});
  CHECK(gqa.Find("transformer.h.0.ln_mlp.weight") >= 0);
  CHECK(gqa.Find("transformer.h.0.input_layernorm.weight") < 0);
  // falcon-rw style: sequential blocks with biases.
  falcon["new_decoder_architecture"] = false;
  falcon["multi_query"] = false;
  falcon["parallel_attn"] = false;
  falcon["bias"] = true;
  ModelInventory seq = MustBuild(falcon);
  CHECK(Tensor(seq, "transformer.h.0.self_attention.query_key_value.bias").shape == Shape{3 * 64});
  CHECK(seq.Find("transformer.h.0.post_attention_layernorm.weight") >= 0);
}

TEST_CASE("family: opt projects a narrower embedding and may drop its final norm") {
  nlohmann::json opt = {{"model_type", "opt"},
                        {"hidden_size", 64},
                        {"num_hidden_layers", 1},
                        {"num_attention_heads", 4},
                        {"ffn_dim", 128},
                        {"vocab_size", 100},
                        {"max_position_embeddings", 32},
                        {"word_embed_proj_dim", 16},
                        {"do_layer_norm_before", false}};
  ModelInventory inv = MustBuild(opt);
  CHECK(Tensor(inv, "model.decoder.embed_tokens.weight").shape == Shape{100, 16});
  CHECK(Tensor(inv, "model.decoder.embed_positions.weight").shape == Shape{34, 64});
  CHECK(Tensor(inv, "model.decoder.project_in.weight").shape == Shape{64, 16});
  CHECK(inv.Find("model.decoder.final_layer_norm.weight") < 0);
  CHECK(Tensor(inv, "lm_head.weight").shape == Shape{100, 16});
  CHECK(Tensor(inv, "lm_head.weight").tied_to == "model.decoder.embed_tokens.weight");
}

TEST_CASE("family: task heads size their output by num_labels or id2label") {
  nlohmann::json config = FixtureJson("llama-3.2-1b");
  config["architectures"] = {"LlamaForSequenceClassification"};
  config["id2label"] = {{"0", "bad"}, {"1", "ok"}, {"2", "good"}};
  ModelInventory reward = MustBuild(config);
  CHECK(reward.architecture == "LlamaForSequenceClassification");
  CHECK(reward.model_class == "sequence_classification");
  CHECK(Tensor(reward, "score.weight").shape == Shape{3, 2048});
  CHECK(reward.Find("score.bias") < 0);
  CHECK(reward.Find("lm_head.weight") < 0);
  config.erase("id2label");
  config["num_labels"] = 1;  // a reward model
  CHECK(Tensor(MustBuild(config), "score.weight").shape == Shape{1, 2048});
  config.erase("num_labels");  // PretrainedConfig's default: 2
  CHECK(Tensor(MustBuild(config), "score.weight").shape == Shape{2, 2048});
  // Llama's QA head wraps the model as `transformer`; Mistral's as `model`.
  config["architectures"] = {"LlamaForQuestionAnswering"};
  ModelInventory qa = MustBuild(config);
  CHECK(Tensor(qa, "qa_outputs.bias").shape == Shape{2});
  CHECK(qa.Find("transformer.embed_tokens.weight") >= 0);
  config["architectures"] = {"LlamaForTokenClassification"};
  CHECK(Tensor(MustBuild(config), "score.bias").shape == Shape{2});
  config["id2label"] = "not a map";
  CHECK(Contains(BuildError(config), "'id2label'"));
}

TEST_CASE("family: every declared family builds its causal LM and its base model") {
  for (const char* name : {"qwen3-0.6b", "gemma-2-2b", "gemma-3-1b", "phi-3-mini",
                           "deepseek-v2-lite", "gpt-oss-20b", "mistral-nemo", "llama-3.2-3b"}) {
    CAPTURE(name);
    ModelInventory causal = Fixture(name);
    ModelInventory base = Fixture(name, ModelClassChoice::kBase);
    CHECK(causal.model_class == "causal_lm");
    CHECK(base.model_class == "base");
    CHECK(Total(causal) >= Total(base));
    CHECK(causal.arch->no_split_class.find("DecoderLayer") != std::string::npos);
    CHECK(causal.no_split_modules.size() == static_cast<size_t>(causal.arch->layers));
    CHECK_FALSE(causal.buffers.empty());  // rotary inv_freq tables
  }
}

}  // namespace
}  // namespace memplan::estimator
