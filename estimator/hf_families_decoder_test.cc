// Tests for the decoder-only config.json builders (hf_families_decoder.cc), through the public
// InventoryFromHfConfig* entry points.
//
// The fixtures under estimator/models/ are the config.json files published on the Hugging Face
// Hub; each total below is a figure published for that real model (source named beside it), so a
// wrong shape anywhere in a builder moves the count and fails the test.
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "estimator/hf_config.h"
#include "estimator/inventory.h"
#include "tests/estimator_testing.h"
#include "tests/status_testing.h"

namespace memplan::estimator {
namespace {

// The shared fixture and inventory helpers: Fixture, Build, MustBuild, Counts, Total, Tensor.
using namespace memplan::testing;

nlohmann::json FixtureJson(const std::string& name) {
  return nlohmann::json::parse(ReadFixture(name));
}

// The error message of a build that must fail; fails the test when it succeeds.
std::string BuildError(const nlohmann::json& config,
                       ModelClassChoice choice = ModelClassChoice::kFromArchitectures) {
  Result<ModelInventory> inventory = Build(config, choice);
  REQUIRE_FALSE_MESSAGE(inventory.ok(), "expected an error for " << config.dump());
  CHECK(inventory.status().code() == StatusCode::kInvalidArgument);
  return inventory.status().message();
}

bool Contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// Names of the tensors of one block, in inventory order.
std::vector<std::string> BlockNames(const ModelInventory& inventory, const std::string& block) {
  std::vector<std::string> names;
  for (const TensorInfo& t : inventory.tensors) {
    if (t.block == block) names.push_back(t.name);
  }
  return names;
}

}  // namespace

TEST_CASE("decoder: gpt2 matches the published 124,439,808 parameters") {
  ModelInventory gpt2 = Fixture("gpt2");
  ModelCounts counts = Counts(gpt2);
  // REFERENCE.md section 2: gpt2, head tied to wte (also the "124M" of the gpt2 model card).
  CHECK(counts.params_total == 124'439'808);
  // DeepSpeed's L: the largest module's own parameters, the 50257 x 768 token embedding (the tied
  // head holds the same Parameter; the tie goes to the module registered first).
  CHECK(counts.largest_layer_params == 38'597'376);
  CHECK(counts.largest_layer_module == "transformer.wte");
  // One GPT-2 block: 12 H^2 + 13 H.
  CHECK(counts.largest_block_params == 7'087'872);
  CHECK(counts.largest_block == "transformer.h.0");
  CHECK(counts.num_blocks == 12);
  CHECK(counts.num_tensors == 2 + 12 * 12 + 2 + 1);
  CHECK(counts.num_tied == 1);
  // No torch_dtype in this config: F32.
  CHECK(counts.bytes_as_stored == 124'439'808ull * 4);
  CHECK(gpt2.architecture == "GPT2LMHeadModel");
  CHECK(gpt2.model_class == "causal_lm");
  CHECK(gpt2.model_type == "gpt2");

  // Conv1D stores its weight as [in, out].
  CHECK(Tensor(gpt2, "transformer.h.0.attn.c_attn.weight").shape == Shape{768, 2304});
  CHECK(Tensor(gpt2, "transformer.h.0.attn.c_attn.bias").shape == Shape{2304});
  CHECK(Tensor(gpt2, "transformer.h.11.mlp.c_fc.weight").shape == Shape{768, 3072});
  CHECK(Tensor(gpt2, "transformer.h.11.mlp.c_proj.weight").shape == Shape{3072, 768});
  CHECK(Tensor(gpt2, "transformer.wpe.weight").shape == Shape{1024, 768});
  CHECK(Tensor(gpt2, "transformer.h.3.attn.c_proj.weight").dtype == DType::kF32);
  const TensorInfo& head = gpt2.tensors.back();
  CHECK(head.name == "lm_head.weight");
  CHECK(head.tied_to == "transformer.wte.weight");
  CHECK(head.shape == Shape{50257, 768});
  CHECK(gpt2.tensors.front().name == "transformer.wte.weight");
  CHECK(gpt2.Find("transformer.h.0.attn.bias") < 0);  // the causal mask is a buffer
  CHECK(BlockNames(gpt2, "transformer.h.5") ==
        std::vector<std::string>{
            "transformer.h.5.ln_1.weight", "transformer.h.5.ln_1.bias",
            "transformer.h.5.attn.c_attn.weight", "transformer.h.5.attn.c_attn.bias",
            "transformer.h.5.attn.c_proj.weight", "transformer.h.5.attn.c_proj.bias",
            "transformer.h.5.ln_2.weight", "transformer.h.5.ln_2.bias",
            "transformer.h.5.mlp.c_fc.weight", "transformer.h.5.mlp.c_fc.bias",
            "transformer.h.5.mlp.c_proj.weight", "transformer.h.5.mlp.c_proj.bias"});
}

TEST_CASE("decoder: gpt2 base model is GPT2Model without prefix or head") {
  ModelInventory base = Fixture("gpt2", ModelClassChoice::kBase);
  CHECK(base.architecture == "GPT2Model");
  CHECK(base.model_class == "base");
  // The tied head adds no parameters, so the base model has the same total.
  CHECK(Total(base) == 124'439'808);
  CHECK(base.tensors.front().name == "wte.weight");
  CHECK(Tensor(base, "h.0.ln_1.weight").shape == Shape{768});
  CHECK(Tensor(base, "ln_f.bias").shape == Shape{768});
  CHECK(base.Find("lm_head.weight") < 0);
  CHECK(base.Find("transformer.wte.weight") < 0);
  CHECK(Counts(base).num_tensors == 2 + 12 * 12 + 2);

  // A config naming the base class builds it too.
  nlohmann::json config = FixtureJson("gpt2");
  config["architectures"] = {"GPT2Model"};
  ModelInventory named = MustBuild(config);
  CHECK(named.architecture == "GPT2Model");
  CHECK(named.Find("h.0.ln_1.weight") >= 0);
}

TEST_CASE("decoder: gpt2 applies GPT2Config defaults for absent fields") {
  // GPT2Config() is the published gpt2 itself.
  ModelInventory bare = MustBuild({{"model_type", "gpt2"}});
  CHECK(Total(bare) == 124'439'808);
  CHECK(bare.architecture == "GPT2LMHeadModel");
  CHECK(Tensor(bare, "lm_head.weight").tied_to == "transformer.wte.weight");

  // n_inner given: the MLP width follows it.
  ModelInventory inner = MustBuild({{"model_type", "gpt2"}, {"n_inner", 1024}});
  CHECK(Tensor(inner, "transformer.h.0.mlp.c_fc.weight").shape == Shape{768, 1024});
  CHECK(Total(inner) == 124'439'808 - 12 * 2 * 768 * (3072 - 1024) - 12 * (3072 - 1024));
  // n_inner null is the same as absent.
  CHECK(Total(MustBuild({{"model_type", "gpt2"}, {"n_inner", nullptr}})) == 124'439'808);

  // Transformers' attribute_map aliases (hidden_size for n_embd, ...) are honoured.
  ModelInventory alias = MustBuild({{"model_type", "gpt2"},
                                    {"hidden_size", 64},
                                    {"num_attention_heads", 4},
                                    {"num_hidden_layers", 2},
                                    {"max_position_embeddings", 32},
                                    {"vocab_size", 100}});
  CHECK(Tensor(alias, "transformer.wpe.weight").shape == Shape{32, 64});
  CHECK(Total(alias) == 100 * 64 + 32 * 64 + 2 * (12 * 64 * 64 + 13 * 64) + 2 * 64);

  // Untied head: its own V x H matrix.
  ModelInventory untied = MustBuild({{"model_type", "gpt2"}, {"tie_word_embeddings", false}});
  CHECK(Tensor(untied, "lm_head.weight").tied_to.empty());
  CHECK(Total(untied) == 124'439'808 + 50257 * 768);

  // Cross-attention adds q_attn, a 2H c_attn and a third LayerNorm per block.
  ModelInventory cross = MustBuild({{"model_type", "gpt2"}, {"add_cross_attention", true}});
  CHECK(Tensor(cross, "transformer.h.0.crossattention.c_attn.weight").shape == Shape{768, 1536});
  CHECK(Tensor(cross, "transformer.h.0.crossattention.q_attn.weight").shape == Shape{768, 768});
  CHECK(Total(cross) == 124'439'808 + 12 * (768 * 1536 + 1536 + 2 * (768 * 768 + 768) + 2 * 768));
}

TEST_CASE("decoder: llama-2-7b matches the published counts, causal LM and base") {
  ModelInventory llama = Fixture("llama-2-7b");
  ModelCounts counts = Counts(llama);
  // REFERENCE.md section 2: Llama-2-7b LlamaForCausalLM 6,738,415,616 (Meta's "7B").
  CHECK(counts.params_total == 6'738'415'616);
  // REFERENCE.md section 2: L = 131,072,000 (32000 x 4096, embedding or head).
  CHECK(counts.largest_layer_params == 131'072'000);
  CHECK(counts.num_tied == 0);
  CHECK(counts.num_tensors == 1 + 32 * 9 + 1 + 1);
  // torch_dtype float16.
  CHECK(counts.bytes_as_stored == 6'738'415'616ull * 2);
  CHECK(llama.architecture == "LlamaForCausalLM");
  CHECK(llama.model_class == "causal_lm");
  CHECK(Tensor(llama, "model.layers.0.self_attn.q_proj.weight").shape == Shape{4096, 4096});
  CHECK(Tensor(llama, "model.layers.31.mlp.down_proj.weight").shape == Shape{4096, 11008});
  CHECK(Tensor(llama, "model.layers.31.mlp.down_proj.weight").dtype == DType::kF16);
  CHECK(Tensor(llama, "lm_head.weight").tied_to.empty());
  CHECK(llama.tensors.front().name == "model.embed_tokens.weight");
  CHECK(llama.tensors[llama.tensors.size() - 2].name == "model.norm.weight");
  CHECK(llama.Find("model.layers.0.self_attn.rotary_emb.inv_freq") < 0);  // a buffer
  // Registration order of LlamaDecoderLayer: attention, MLP, then both norms.
  CHECK(BlockNames(llama, "model.layers.0") ==
        std::vector<std::string>{
            "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
            "model.layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.o_proj.weight",
            "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight",
            "model.layers.0.mlp.down_proj.weight", "model.layers.0.input_layernorm.weight",
            "model.layers.0.post_attention_layernorm.weight"});
  CHECK(Tensor(llama, "model.layers.7.mlp.up_proj.weight").layer == 7);

  ModelInventory base = Fixture("llama-2-7b", ModelClassChoice::kBase);
  ModelCounts base_counts = Counts(base);
  // REFERENCE.md section 2: base LlamaModel 6,607,343,616 (what DeepSpeed's AutoModel examples
  // count).
  CHECK(base_counts.params_total == 6'607'343'616);
  CHECK(base_counts.largest_layer_params == 131'072'000);
  CHECK(base_counts.largest_layer_module == "embed_tokens");
  CHECK(base.architecture == "LlamaModel");
  CHECK(base.model_class == "base");
  CHECK(base.tensors.front().name == "embed_tokens.weight");
  CHECK(Tensor(base, "layers.0.self_attn.q_proj.weight").shape == Shape{4096, 4096});
  CHECK(Tensor(base, "norm.weight").shape == Shape{4096});
  CHECK(base.Find("lm_head.weight") < 0);
  CHECK(base.Find("model.embed_tokens.weight") < 0);
}

TEST_CASE("decoder: mistral-7b matches the published 7,241,732,096 parameters") {
  ModelInventory mistral = Fixture("mistral-7b");
  // Hugging Face Hub safetensors metadata for mistralai/Mistral-7B-v0.1: 7,241,732,096
  // (the "7.24B params" on the model page).
  CHECK(Total(mistral) == 7'241'732'096);
  CHECK(Counts(mistral).largest_layer_params == 131'072'000);
  CHECK(mistral.architecture == "MistralForCausalLM");
  // Grouped-query attention: 8 key/value heads of 128.
  CHECK(Tensor(mistral, "model.layers.0.self_attn.k_proj.weight").shape == Shape{1024, 4096});
  CHECK(Tensor(mistral, "model.layers.0.self_attn.v_proj.weight").shape == Shape{1024, 4096});
  CHECK(Tensor(mistral, "model.layers.0.self_attn.o_proj.weight").shape == Shape{4096, 4096});
  CHECK(Tensor(mistral, "model.layers.0.mlp.gate_proj.weight").dtype == DType::kBF16);
  CHECK(mistral.Find("model.layers.0.self_attn.q_proj.bias") < 0);
  CHECK(Counts(mistral).bytes_as_stored == 7'241'732'096ull * 2);
}

TEST_CASE("decoder: mixtral-8x7b matches the published 46,702,792,704 parameters") {
  BuildOptions per_expert;
  per_expert.experts = ExpertLayout::kPerExpert;
  Result<ModelInventory> built =
      InventoryFromHfConfigText(ReadFixture("mixtral-8x7b"), "mixtral-8x7b", per_expert);
  REQUIRE_OK(built);
  ModelInventory mixtral = *built;
  ModelCounts counts = Counts(mixtral);
  // Hugging Face Hub safetensors metadata for mistralai/Mixtral-8x7B-v0.1:
  // 46,702,792,704 (the "46.7B" of Mistral AI's announcement).
  CHECK(counts.params_total == 46'702'792'704);
  // One Linear per expert: DeepSpeed's largest module is the token embedding.
  CHECK(counts.largest_layer_params == 131'072'000);
  CHECK(counts.num_tensors == 1 + 32 * (4 + 1 + 8 * 3 + 2) + 1 + 1);
  CHECK(mixtral.architecture == "MixtralForCausalLM");
  // Classic checkpoint layout: router `gate` and per-expert w1/w2/w3.
  CHECK(Tensor(mixtral, "model.layers.0.block_sparse_moe.gate.weight").shape == Shape{8, 4096});
  CHECK(Tensor(mixtral, "model.layers.0.block_sparse_moe.experts.0.w1.weight").shape ==
        Shape{14336, 4096});
  CHECK(Tensor(mixtral, "model.layers.31.block_sparse_moe.experts.7.w2.weight").shape ==
        Shape{4096, 14336});
  CHECK(Tensor(mixtral, "model.layers.31.block_sparse_moe.experts.7.w3.weight").shape ==
        Shape{14336, 4096});
  CHECK(mixtral.Find("model.layers.0.block_sparse_moe.experts.8.w1.weight") < 0);
  CHECK(mixtral.Find("model.layers.0.block_sparse_moe.gate.bias") < 0);
  CHECK(mixtral.Find("model.layers.0.mlp.gate_proj.weight") < 0);
  // Experts belong to their decoder layer's block.
  const TensorInfo& w2 = Tensor(mixtral, "model.layers.5.block_sparse_moe.experts.3.w2.weight");
  CHECK(w2.block == "model.layers.5");
  CHECK(w2.layer == 5);
  CHECK(w2.module == "model.layers.5.block_sparse_moe.experts.3.w2");
  const std::vector<std::string> order = BlockNames(mixtral, "model.layers.0");
  REQUIRE(order.size() == 4 + 1 + 24 + 2);
  CHECK(order[4] == "model.layers.0.block_sparse_moe.gate.weight");
  CHECK(order[5] == "model.layers.0.block_sparse_moe.experts.0.w1.weight");
  CHECK(order[6] == "model.layers.0.block_sparse_moe.experts.0.w2.weight");
  CHECK(order[29] == "model.layers.0.input_layernorm.weight");

  // Fused, as Transformers >= 5 builds it (the default): the router, then every expert of a layer
  // in two 3-D tensors; the same total, but DeepSpeed's largest module holds all 8 experts.
  ModelInventory fused = Fixture("mixtral-8x7b");
  ModelCounts fused_counts = Counts(fused);
  CHECK(fused_counts.params_total == 46'702'792'704);
  CHECK(fused_counts.largest_layer_params == 8ull * 3 * 4096 * 14336);
  CHECK(fused_counts.largest_layer_module == "model.layers.0.mlp.experts");
  CHECK(BlockNames(fused, "model.layers.0") ==
        std::vector<std::string>{
            "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
            "model.layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.o_proj.weight",
            "model.layers.0.mlp.gate.weight", "model.layers.0.mlp.experts.gate_up_proj",
            "model.layers.0.mlp.experts.down_proj", "model.layers.0.input_layernorm.weight",
            "model.layers.0.post_attention_layernorm.weight"});
  CHECK(Tensor(fused, "model.layers.0.mlp.experts.gate_up_proj").shape ==
        Shape{8, 2 * 14336, 4096});
  CHECK(Tensor(fused, "model.layers.0.mlp.experts.down_proj").shape == Shape{8, 4096, 14336});

  // num_local_experts defaults to 8 (MixtralConfig).
  nlohmann::json config = FixtureJson("mixtral-8x7b");
  config.erase("num_local_experts");
  CHECK(Total(MustBuild(config)) == 46'702'792'704);
  config["num_local_experts"] = 4;
  CHECK(Total(MustBuild(config)) == 46'702'792'704 - int64_t{32} * 4 * (3 * 4096 * 14336 + 4096));
}

TEST_CASE("decoder: qwen2-7b matches the published 7,615,616,512 parameters") {
  ModelInventory qwen = Fixture("qwen2-7b");
  // Hugging Face Hub safetensors metadata for Qwen/Qwen2-7B: 7,615,616,512 (the "7.62B params"
  // on the model page; Qwen2.5-7B, with identical dimensions, publishes the same total).
  CHECK(Total(qwen) == 7'615'616'512);
  CHECK(qwen.architecture == "Qwen2ForCausalLM");
  // Qwen2: q/k/v carry biases, o_proj does not.
  CHECK(Tensor(qwen, "model.layers.0.self_attn.q_proj.bias").shape == Shape{3584});
  CHECK(Tensor(qwen, "model.layers.0.self_attn.k_proj.bias").shape == Shape{512});
  CHECK(Tensor(qwen, "model.layers.0.self_attn.v_proj.bias").shape == Shape{512});
  CHECK(qwen.Find("model.layers.0.self_attn.o_proj.bias") < 0);
  CHECK(qwen.Find("model.layers.0.mlp.gate_proj.bias") < 0);
  CHECK(BlockNames(qwen, "model.layers.0")[0] == "model.layers.0.self_attn.q_proj.weight");
  CHECK(BlockNames(qwen, "model.layers.0")[1] == "model.layers.0.self_attn.q_proj.bias");
  // 152064 x 3584 embedding.
  CHECK(Counts(qwen).largest_layer_params == 544'997'376);

  // Qwen2-0.5B's shape: tied head via the config (qwen2's own default is untied). Published
  // total: 494,032,768 (Hub safetensors metadata of Qwen/Qwen2-0.5B and Qwen2.5-0.5B).
  nlohmann::json small = FixtureJson("qwen2-7b");
  small["hidden_size"] = 896;
  small["intermediate_size"] = 4864;
  small["num_hidden_layers"] = 24;
  small["num_attention_heads"] = 14;
  small["num_key_value_heads"] = 2;
  small["vocab_size"] = 151936;
  small["tie_word_embeddings"] = true;
  ModelInventory tied = MustBuild(small);
  CHECK(Total(tied) == 494'032'768);
  CHECK(Tensor(tied, "lm_head.weight").tied_to == "model.embed_tokens.weight");
}

TEST_CASE("decoder: gemma-2b matches the Gemma report's parameter counts") {
  ModelInventory gemma = Fixture("gemma-2b");
  ModelCounts counts = Counts(gemma);
  // Gemma report (Gemma Team, 2024), Table 2: 2B non-embedding parameters 1,981,884,416. Its
  // embedding count (524,550,144) is for a 256,128-entry vocabulary; the Hub checkpoint's
  // embedding has 256,000 rows, hence 256,000 x 2048 here. Head tied (GemmaConfig default).
  CHECK(counts.params_total == 1'981'884'416ull + 256'000ull * 2048);
  CHECK(counts.params_total == 2'506'172'416);
  CHECK(counts.num_tied == 1);
  CHECK(gemma.architecture == "GemmaForCausalLM");
  CHECK(Tensor(gemma, "lm_head.weight").tied_to == "model.embed_tokens.weight");
  // 8 query heads and 1 key/value head of 256: head_dim does not come from hidden_size.
  CHECK(Tensor(gemma, "model.layers.0.self_attn.q_proj.weight").shape == Shape{2048, 2048});
  CHECK(Tensor(gemma, "model.layers.0.self_attn.k_proj.weight").shape == Shape{256, 2048});
  CHECK(Tensor(gemma, "model.layers.0.self_attn.o_proj.weight").shape == Shape{2048, 2048});
  CHECK(Tensor(gemma, "model.norm.weight").shape == Shape{2048});

  // Gemma's defaults: head_dim 256 and a tied head when the config says nothing.
  nlohmann::json config = FixtureJson("gemma-2b");
  config.erase("head_dim");
  ModelInventory defaults = MustBuild(config);
  CHECK(Total(defaults) == 2'506'172'416);
  CHECK(Tensor(defaults, "lm_head.weight").tied_to == "model.embed_tokens.weight");
  config["tie_word_embeddings"] = false;
  CHECK(Total(MustBuild(config)) == 2'506'172'416 + 256'000ull * 2048);

  // The base model loses only the alias.
  ModelInventory base = Fixture("gemma-2b", ModelClassChoice::kBase);
  CHECK(base.architecture == "GemmaModel");
  CHECK(Total(base) == 2'506'172'416);
  CHECK(Counts(base).num_tied == 0);
}

TEST_CASE("decoder: pythia-160m (gpt_neox) matches the published 162,322,944 parameters") {
  ModelInventory pythia = Fixture("pythia-160m");
  ModelCounts counts = Counts(pythia);
  // EleutherAI/pythia-160m model card (naming table): 162,322,944 total parameters, of which
  // 85,056,000 non-embedding; embed_in and embed_out are separate 50304 x 768 matrices.
  CHECK(counts.params_total == 162'322'944);
  CHECK(counts.params_total - 2 * 50304 * 768 == 85'056'000);
  CHECK(counts.largest_layer_params == 50304 * 768);
  CHECK(counts.num_tied == 0);
  CHECK(pythia.architecture == "GPTNeoXForCausalLM");
  CHECK(Tensor(pythia, "gpt_neox.layers.0.attention.query_key_value.weight").shape ==
        Shape{2304, 768});
  CHECK(Tensor(pythia, "gpt_neox.layers.0.attention.query_key_value.bias").shape == Shape{2304});
  CHECK(Tensor(pythia, "gpt_neox.layers.11.mlp.dense_4h_to_h.weight").shape == Shape{768, 3072});
  CHECK(Tensor(pythia, "embed_out.weight").tied_to.empty());
  CHECK(pythia.tensors.back().name == "embed_out.weight");
  CHECK(BlockNames(pythia, "gpt_neox.layers.0")[0] == "gpt_neox.layers.0.input_layernorm.weight");
  CHECK(BlockNames(pythia, "gpt_neox.layers.0")[4] ==
        "gpt_neox.layers.0.attention.query_key_value.weight");
  CHECK(Tensor(pythia, "gpt_neox.final_layer_norm.bias").dtype == DType::kF16);

  ModelInventory base = Fixture("pythia-160m", ModelClassChoice::kBase);
  CHECK(base.architecture == "GPTNeoXModel");
  CHECK(Total(base) == 162'322'944 - 50304 * 768);
  CHECK(base.tensors.front().name == "embed_in.weight");
  CHECK(base.Find("final_layer_norm.weight") >= 0);
  CHECK(base.Find("embed_out.weight") < 0);

  // attention_bias false drops the query_key_value and dense biases.
  nlohmann::json config = FixtureJson("pythia-160m");
  config["attention_bias"] = false;
  ModelInventory unbiased = MustBuild(config);
  CHECK(Total(unbiased) == 162'322'944 - 12 * (2304 + 768));
  CHECK(unbiased.Find("gpt_neox.layers.0.attention.dense.bias") < 0);
  config["tie_word_embeddings"] = true;
  CHECK(Tensor(MustBuild(config), "embed_out.weight").tied_to == "gpt_neox.embed_in.weight");
}

TEST_CASE("decoder: llama-like defaults and switches") {
  nlohmann::json config = FixtureJson("llama-2-7b");

  // num_key_value_heads absent: multi-head attention, same model.
  config.erase("num_key_value_heads");
  CHECK(Total(MustBuild(config)) == 6'738'415'616);
  // tie_word_embeddings absent: LlamaConfig's default is untied.
  config.erase("tie_word_embeddings");
  CHECK(Tensor(MustBuild(config), "lm_head.weight").tied_to.empty());
  // Tied (as in Llama 3.2 1B): the head becomes an alias and the base model's total.
  config["tie_word_embeddings"] = true;
  ModelInventory tied = MustBuild(config);
  CHECK(Tensor(tied, "lm_head.weight").tied_to == "model.embed_tokens.weight");
  CHECK(Total(tied) == 6'607'343'616);
  config.erase("tie_word_embeddings");

  // attention_bias covers q, k, v and o; mlp_bias all three MLP projections.
  config["attention_bias"] = true;
  config["mlp_bias"] = true;
  ModelInventory biased = MustBuild(config);
  CHECK(Tensor(biased, "model.layers.0.self_attn.o_proj.bias").shape == Shape{4096});
  CHECK(Tensor(biased, "model.layers.0.mlp.gate_proj.bias").shape == Shape{11008});
  CHECK(Tensor(biased, "model.layers.0.mlp.down_proj.bias").shape == Shape{4096});
  CHECK(Total(biased) == 6'738'415'616 + 32 * (4 * 4096 + 2 * 11008 + 4096));
  config.erase("attention_bias");
  config.erase("mlp_bias");

  // An explicit head_dim is honoured even when heads x head_dim != hidden_size
  // (Mistral-Nemo: hidden 5120, 32 heads of 128, 8 key/value heads).
  nlohmann::json nemo = FixtureJson("mistral-7b");
  nemo["hidden_size"] = 5120;
  nemo["head_dim"] = 128;
  ModelInventory wide = MustBuild(nemo);
  CHECK(Tensor(wide, "model.layers.0.self_attn.q_proj.weight").shape == Shape{4096, 5120});
  CHECK(Tensor(wide, "model.layers.0.self_attn.k_proj.weight").shape == Shape{1024, 5120});
  CHECK(Tensor(wide, "model.layers.0.self_attn.o_proj.weight").shape == Shape{5120, 4096});
  // head_dim null means "derive it".
  nemo["hidden_size"] = 4096;
  nemo["head_dim"] = nullptr;
  CHECK(Total(MustBuild(nemo)) == 7'241'732'096);

  // dtype: "dtype" (Transformers >= 4.56) is read too; an unknown spelling falls back to F32.
  config.erase("torch_dtype");
  CHECK(Tensor(MustBuild(config), "model.norm.weight").dtype == DType::kF32);
  config["dtype"] = "bfloat16";
  CHECK(Tensor(MustBuild(config), "model.norm.weight").dtype == DType::kBF16);
  config["dtype"] = "auto";
  CHECK(Tensor(MustBuild(config), "model.norm.weight").dtype == DType::kF32);
  config["dtype"] = 16;
  CHECK(Contains(BuildError(config), "'dtype'"));
}

TEST_CASE("decoder: SmolLM3's NoPE layers and its sliding windows, as SmolLM3Config fills them") {
  nlohmann::json smol = {{"model_type", "smollm3"},  {"hidden_size", 256},
                         {"intermediate_size", 512}, {"num_hidden_layers", 8},
                         {"num_attention_heads", 4}, {"num_key_value_heads", 2},
                         {"vocab_size", 1000},       {"architectures", {"SmolLM3ForCausalLM"}}};
  auto nope = [](const nlohmann::json& config) {
    ModelInventory m = MustBuild(config);
    REQUIRE(m.arch.has_value());
    return std::make_pair(m.arch->nope_layers, m.arch->sliding_layers);
  };
  using Layers = std::vector<bool>;
  // Every fourth layer by default (no_rope_layer_interval 4); no sliding window unless asked.
  CHECK(nope(smol).first == Layers{false, false, false, true, false, false, false, true});
  CHECK(nope(smol).second.empty());
  smol["no_rope_layer_interval"] = 2;
  CHECK(nope(smol).first == Layers{false, true, false, true, false, true, false, true});
  // An explicit list (1 = RoPE), at least one entry per layer; all RoPE is no NoPE layer at all.
  smol["no_rope_layers"] = {1, 0, 1, 1, 1, 1, 1, 0, 1};
  CHECK(nope(smol).first == Layers{false, true, false, false, false, false, false, true});
  smol["no_rope_layers"] = {1, 1, 1, 1, 1, 1, 1, 1};
  CHECK(nope(smol).first.empty());
  // Sliding windows on the NoPE layers, with use_sliding_window and a window.
  smol["no_rope_layers"] = {1, 1, 1, 0, 1, 1, 1, 0};
  smol["use_sliding_window"] = true;
  smol["sliding_window"] = 128;
  CHECK(nope(smol).second == Layers{false, false, false, true, false, false, false, true});
  smol["no_rope_layers"] = {1, 0, 1};
  CHECK(Contains(BuildError(smol), "'no_rope_layers'"));
  smol["no_rope_layers"] = {1, 0, 1, 1, "x", 1, 1, 1};
  CHECK(Contains(BuildError(smol), "'no_rope_layers'"));
  smol.erase("no_rope_layers");
  smol["no_rope_layer_interval"] = 0;
  CHECK(Contains(BuildError(smol), "'no_rope_layer_interval'"));
}

TEST_CASE("decoder: gpt_bigcode (StarCoder) as GPTBigCodeConfig builds it") {
  // bigcode/starcoderbase-1b's sizes; 1,137,207,296 is what Transformers 5 builds from its
  // config.json (tests/oracle/modern_configs/starcoderbase-1b.json, checked by oracle_modern).
  nlohmann::json config = {{"model_type", "gpt_bigcode"},
                           {"architectures", {"GPTBigCodeForCausalLM"}},
                           {"n_embd", 2048},
                           {"n_head", 16},
                           {"n_inner", 8192},
                           {"n_layer", 24},
                           {"n_positions", 8192},
                           {"vocab_size", 49152}};
  const ModelInventory mq = MustBuild(config);
  CHECK(Total(mq) == 1'137'207'296);
  // multi_query (the default): one key/value head, so c_attn is 2048 + 2 x 128 wide.
  CHECK(Tensor(mq, "transformer.h.0.attn.c_attn.weight").shape == Shape{2304, 2048});
  CHECK(Tensor(mq, "transformer.h.0.attn.c_attn.bias").shape == Shape{2304});
  CHECK(mq.tensors.back().tied_to == "transformer.wte.weight");  // the head is tied by default
  // The non-persistent causal table: n_positions^2 bools, a byte each (Accelerate counts a bit).
  REQUIRE(mq.buffers.size() == 1);
  CHECK(mq.buffers[0].name == "transformer.bias");
  CHECK(mq.buffers[0].dtype == DType::kBool);
  CHECK(mq.buffers[0].numel == 8192 * 8192);
  CHECK(Counts(mq).accelerate_total_bytes == 1'137'207'296ull * 4 + 8192ull * 8192 / 8);

  config["multi_query"] = false;
  config["tie_word_embeddings"] = false;
  const ModelInventory mha = MustBuild(config);
  CHECK(Tensor(mha, "transformer.h.0.attn.c_attn.weight").shape == Shape{6144, 2048});
  CHECK(Tensor(mha, "lm_head.weight").shape == Shape{49152, 2048});
  CHECK(Total(mha) == 1'137'207'296 + 24ull * (6144 - 2304) * 2049 + 49152ull * 2048);

  config.erase("n_inner");  // None: 4 x n_embd
  CHECK(Tensor(MustBuild(config), "transformer.h.0.mlp.c_fc.weight").shape == Shape{8192, 2048});
  config["add_cross_attention"] = true;
  CHECK(Contains(BuildError(config), "'add_cross_attention'"));
  config.erase("add_cross_attention");
  config["n_head"] = 15;
  CHECK(Contains(BuildError(config), "'n_head'"));
  config.erase("n_embd");
  CHECK(Contains(BuildError(config), "'n_embd'"));
}

TEST_CASE("decoder: stablelm's qkv bias, per-head norms and parallel residual") {
  // stabilityai/stablelm-2-1_6b: 1,644,515,328 parameters (its model card's 1.6 B; Transformers
  // 5 builds the same count, oracle_modern).
  nlohmann::json config = {{"model_type", "stablelm"},  {"architectures", {"StableLmForCausalLM"}},
                           {"hidden_size", 2048},       {"intermediate_size", 5632},
                           {"num_attention_heads", 32}, {"num_hidden_layers", 24},
                           {"num_key_value_heads", 32}, {"use_qkv_bias", true},
                           {"vocab_size", 100352}};
  const ModelInventory small = MustBuild(config);
  CHECK(Total(small) == 1'644'515'328);
  CHECK(Tensor(small, "model.layers.0.self_attn.q_proj.bias").shape == Shape{2048});
  CHECK(Tensor(small, "model.layers.0.input_layernorm.bias").shape == Shape{2048});
  CHECK(Tensor(small, "model.layers.0.post_attention_layernorm.weight").shape == Shape{2048});
  // partial_rotary_factor 0.25 by default: inv_freq covers 16 of each head's 64 dimensions.
  CHECK(small.buffers[0].name == "model.rotary_emb.inv_freq");
  CHECK(small.buffers[0].numel == 8);

  // stablelm-2-12b's switches: one bias-free LayerNorm per query head, then per key/value head,
  // and no post_attention_layernorm with the parallel residual.
  config["use_qkv_bias"] = false;
  config["qk_layernorm"] = true;
  config["use_parallel_residual"] = true;
  config["num_key_value_heads"] = 8;
  const ModelInventory big = MustBuild(config);
  const std::vector<std::string> names = BlockNames(big, "model.layers.0");
  CHECK(small.Find("model.layers.0.self_attn.q_layernorm.norms.0.weight") < 0);
  CHECK(Tensor(big, "model.layers.0.self_attn.q_layernorm.norms.31.weight").shape == Shape{64});
  CHECK(Tensor(big, "model.layers.0.self_attn.k_layernorm.norms.7.weight").shape == Shape{64});
  CHECK(big.Find("model.layers.0.self_attn.k_layernorm.norms.8.weight") < 0);
  CHECK(big.Find("model.layers.0.post_attention_layernorm.weight") < 0);
  CHECK(big.Find("model.layers.0.self_attn.q_proj.bias") < 0);
  CHECK(names.size() == 4 + 32 + 8 + 3 + 2);
  CHECK(Total(big) == Total(small) - 24ull * (3 * 2048 + 2 * 2048) -
                          24ull * 2 * 2048 * (2048 - 512) + 24ull * (32 + 8) * 64);
  config.erase("num_key_value_heads");  // StableLmConfig's default: 32 whatever the heads
  config["num_attention_heads"] = 16;
  CHECK(Contains(BuildError(config), "'num_key_value_heads'"));
}

TEST_CASE("decoder: olmo has no norm tensors, and clip_qkv is read") {
  // allenai/OLMo-1B-hf: 1,176,764,416 parameters (its model card's 1.18 B), tied; OlmoLayerNorm
  // has neither weight nor bias, so a block is its attention and MLP.
  nlohmann::json config = {{"model_type", "olmo"},        {"architectures", {"OlmoForCausalLM"}},
                           {"hidden_size", 2048},         {"intermediate_size", 8192},
                           {"num_attention_heads", 16},   {"num_hidden_layers", 16},
                           {"tie_word_embeddings", true}, {"clip_qkv", nullptr},
                           {"vocab_size", 50304}};
  const ModelInventory olmo = MustBuild(config);
  CHECK(Total(olmo) == 1'176'764'416);
  CHECK(BlockNames(olmo, "model.layers.0").size() == 7);
  for (const TensorInfo& t : olmo.tensors) CHECK(t.role != TensorRole::kNorm);
  REQUIRE(olmo.arch.has_value());
  CHECK_FALSE(olmo.arch->clip_qkv);
  config["clip_qkv"] = 8.0;  // OLMo-7B-0424
  CHECK(MustBuild(config).arch->clip_qkv);
  config["clip_qkv"] = "8";
  CHECK(Contains(BuildError(config), "'clip_qkv'"));
  config["clip_qkv"] = -1;
  CHECK(Contains(BuildError(config), "'clip_qkv'"));
}

TEST_CASE("decoder: cohere's tied head, one norm per block and [heads, head_dim] q/k norms") {
  // CohereForAI/aya-23-8B: 8,028,033,024 parameters (its model card's 8 B; Transformers 5 builds
  // the same, oracle_modern).
  nlohmann::json config = {{"model_type", "cohere"},    {"architectures", {"CohereForCausalLM"}},
                           {"hidden_size", 4096},       {"intermediate_size", 14336},
                           {"num_attention_heads", 32}, {"num_key_value_heads", 8},
                           {"num_hidden_layers", 32},   {"logit_scale", 0.125},
                           {"vocab_size", 256000}};
  const ModelInventory aya = MustBuild(config);
  CHECK(Total(aya) == 8'028'033'024);
  CHECK(aya.tensors.back().tied_to == "model.embed_tokens.weight");
  CHECK(BlockNames(aya, "model.layers.0").size() == 4 + 3 + 1);
  CHECK(aya.Find("model.layers.0.input_layernorm.bias") < 0);
  REQUIRE(aya.arch.has_value());
  CHECK(aya.arch->parallel_attention);
  config["use_qk_norm"] = true;  // Command R+
  const ModelInventory plus = MustBuild(config);
  CHECK(Tensor(plus, "model.layers.0.self_attn.q_norm.weight").shape == Shape{32, 128});
  CHECK(Tensor(plus, "model.layers.0.self_attn.k_norm.weight").shape == Shape{8, 128});
  CHECK(Tensor(plus, "model.layers.0.self_attn.k_norm.weight").role == TensorRole::kNorm);
  CHECK(Total(plus) == Total(aya) + 32ull * (32 + 8) * 128);
}

TEST_CASE("decoder: cohere2 rotates only on its sliding layers") {
  nlohmann::json config = {{"model_type", "cohere2"},   {"architectures", {"Cohere2ForCausalLM"}},
                           {"hidden_size", 4096},       {"intermediate_size", 14336},
                           {"num_attention_heads", 32}, {"num_key_value_heads", 8},
                           {"num_hidden_layers", 8},    {"vocab_size", 256000}};
  // Cohere2Config: sliding_window 4096 and sliding_window_pattern 4 by default.
  const ModelInventory r7b = MustBuild(config);
  REQUIRE(r7b.arch.has_value());
  const std::vector<bool> sliding = {true, true, true, false, true, true, true, false};
  CHECK(r7b.arch->sliding_window == 4096);
  CHECK(r7b.arch->sliding_layers == sliding);
  CHECK(r7b.arch->nope_layers ==
        std::vector<bool>{false, false, false, true, false, false, false, true});
  config["layer_types"] = {"sliding_attention", "full_attention",   "sliding_attention",
                           "full_attention",    "full_attention",   "full_attention",
                           "full_attention",    "sliding_attention"};
  CHECK(MustBuild(config).arch->nope_layers ==
        std::vector<bool>{false, true, false, true, true, true, true, false});
}

TEST_CASE("decoder: nemotron's ungated MLP, biased norms and half-rotated heads") {
  // nvidia/Mistral-NeMo-Minitron-8B-Base: 8,120,836,096 parameters (Transformers 5's count,
  // oracle_modern; the model card's 8 B).
  nlohmann::json config = {{"model_type", "nemotron"},
                           {"architectures", {"NemotronForCausalLM"}},
                           {"head_dim", 128},
                           {"hidden_size", 4096},
                           {"intermediate_size", 16384},
                           {"num_attention_heads", 32},
                           {"num_key_value_heads", 8},
                           {"num_hidden_layers", 40},
                           {"vocab_size", 131072}};
  const ModelInventory m = MustBuild(config);
  CHECK(Total(m) == 8'120'836'096);
  CHECK(m.Find("model.layers.0.mlp.gate_proj.weight") < 0);
  CHECK(Tensor(m, "model.layers.0.post_attention_layernorm.bias").shape == Shape{4096});
  REQUIRE(m.arch.has_value());
  CHECK(m.arch->hidden_act == "relu2");
  CHECK_FALSE(m.arch->gated_mlp);
  CHECK(m.buffers[0].numel == 32);  // partial_rotary_factor 0.5 of 128: 32 frequencies
}

TEST_CASE("decoder: exaone4's window pattern, as a number, a string or none") {
  nlohmann::json config = {{"model_type", "exaone4"},
                           {"architectures", {"Exaone4ForCausalLM"}},
                           {"head_dim", 128},
                           {"hidden_size", 5120},
                           {"intermediate_size", 27392},
                           {"num_attention_heads", 40},
                           {"num_key_value_heads", 8},
                           {"num_hidden_layers", 8},
                           {"vocab_size", 102400}};
  const std::vector<bool> lllg = {true, true, true, false, true, true, true, false};
  const std::vector<bool> global = {false, false, false, true, false, false, false, true};
  // Exaone4Config's defaults: a 4096 window, every fourth layer global and without rotation.
  const ModelInventory m = MustBuild(config);
  REQUIRE(m.arch.has_value());
  CHECK(m.arch->sliding_layers == lllg);
  CHECK(m.arch->nope_layers == global);
  CHECK(m.Find("model.layers.0.input_layernorm.weight") < 0);
  CHECK(Tensor(m, "model.layers.0.post_feedforward_layernorm.weight").shape == Shape{5120});
  CHECK(Tensor(m, "model.layers.0.self_attn.k_norm.weight").shape == Shape{128});
  config["sliding_window_pattern"] = "LLLG";  // as published, with or without layer_types
  CHECK(MustBuild(config).arch->nope_layers == global);
  config["sliding_window_pattern"] = "LGLL";
  CHECK(Contains(BuildError(config), "'sliding_window_pattern'"));
  config["sliding_window_pattern"] = 2;
  CHECK(MustBuild(config).arch->nope_layers ==
        std::vector<bool>{false, true, false, true, false, true, false, true});
  // No window (EXAONE 4.0 1.2B): every layer global, every layer rotated.
  config["sliding_window"] = nullptr;
  config["sliding_window_pattern"] = nullptr;
  const ModelInventory full = MustBuild(config);
  CHECK(full.arch->sliding_layers.empty());
  CHECK(full.arch->nope_layers.empty());
}

TEST_CASE("decoder: gpt_neo's causal tables, and attention_types checked against num_layers") {
  // EleutherAI/gpt-neo-1.3B: 1,315,575,808 parameters (its model card's 1.3 B), tied.
  nlohmann::json config = {{"model_type", "gpt_neo"},
                           {"architectures", {"GPTNeoForCausalLM"}},
                           {"attention_types", {{{"global", "local"}, 12}}},
                           {"hidden_size", 2048},
                           {"num_heads", 16},
                           {"num_layers", 24},
                           {"vocab_size", 50257}};
  const ModelInventory neo = MustBuild(config);
  CHECK(Total(neo) == 1'315'575'808);
  CHECK(Tensor(neo, "transformer.h.0.attn.attention.out_proj.bias").shape == Shape{2048});
  CHECK(neo.Find("transformer.h.0.attn.attention.q_proj.bias") < 0);
  // One bool [1, 1, 2048, 2048] causal table per layer (banded on the local ones).
  REQUIRE(neo.buffers.size() == 24);
  CHECK(neo.buffers[5].name == "transformer.h.5.attn.attention.bias");
  CHECK(neo.buffers[5].shape == Shape{1, 1, 2048, 2048});
  CHECK(neo.buffers[5].dtype == DType::kBool);
  config["num_layers"] = 12;
  CHECK(Contains(BuildError(config), "'attention_types'"));
  config["attention_types"] = {{{"global", "sparse"}, 6}};
  CHECK(Contains(BuildError(config), "'attention_types'"));
  config["attention_types"] = {{{"global"}, 12}};
  CHECK(Total(MustBuild(config)) < Total(neo));
}

TEST_CASE("decoder: ernie4_5's biases and arcee's ungated MLP") {
  // baidu/ERNIE-4.5-0.3B-PT: 360,748,032 parameters (its model card's 0.36 B), tied, head_dim
  // 128 by default.
  nlohmann::json ernie = {{"model_type", "ernie4_5"},  {"architectures", {"Ernie4_5ForCausalLM"}},
                          {"hidden_size", 1024},       {"intermediate_size", 3072},
                          {"num_attention_heads", 16}, {"num_key_value_heads", 2},
                          {"num_hidden_layers", 18},   {"vocab_size", 103424}};
  CHECK(Total(MustBuild(ernie)) == 360'748'032);
  ernie["use_bias"] = true;
  const ModelInventory biased = MustBuild(ernie);
  CHECK(Tensor(biased, "model.layers.0.self_attn.o_proj.bias").shape == Shape{1024});
  CHECK(Tensor(biased, "model.layers.0.mlp.down_proj.bias").shape == Shape{1024});
  CHECK(Total(biased) == 360'748'032 + 18ull * (2048 + 2 * 256 + 1024 + 2 * 3072 + 1024));
  // Arcee: up and down only, relu2 by default.
  nlohmann::json arcee = {{"model_type", "arcee"},     {"architectures", {"ArceeForCausalLM"}},
                          {"hidden_size", 2560},       {"intermediate_size", 18432},
                          {"num_attention_heads", 20}, {"num_key_value_heads", 4},
                          {"head_dim", 128},           {"num_hidden_layers", 2},
                          {"vocab_size", 128004}};
  const ModelInventory afm = MustBuild(arcee);
  CHECK(afm.Find("model.layers.0.mlp.gate_proj.weight") < 0);
  REQUIRE(afm.arch.has_value());
  CHECK(afm.arch->hidden_act == "relu2");
  CHECK(Total(afm) ==
        2 * 128004ull * 2560 + 2560 +
            2ull * (2560 * 2560 + 2 * 2560 * 512 + 2560 * 2560 + 2 * 2560 * 18432 + 2 * 2560));
}

TEST_CASE("decoder: errors name the field at fault") {
  nlohmann::json llama = FixtureJson("llama-2-7b");

  SUBCASE("missing hidden_size") {
    llama.erase("hidden_size");
    std::string error = BuildError(llama);
    CHECK(Contains(error, "test/config.json"));
    CHECK(Contains(error, "'hidden_size'"));
    CHECK(Contains(error, "missing"));
  }
  SUBCASE("missing size fields of gpt_neox") {
    nlohmann::json pythia = FixtureJson("pythia-160m");
    pythia.erase("intermediate_size");
    CHECK(Contains(BuildError(pythia), "'intermediate_size'"));
  }
  SUBCASE("zero, negative, fractional and absurd dimensions") {
    llama["num_hidden_layers"] = 0;
    CHECK(Contains(BuildError(llama), "'num_hidden_layers'"));
    llama["num_hidden_layers"] = 32;
    llama["vocab_size"] = -5;
    std::string negative = BuildError(llama);
    CHECK(Contains(negative, "'vocab_size'"));
    CHECK(Contains(negative, "negative"));
    llama["vocab_size"] = 32000.5;
    CHECK(Contains(BuildError(llama), "'vocab_size'"));
    llama["vocab_size"] = 32000;
    llama["intermediate_size"] = 1e12;
    std::string absurd = BuildError(llama);
    CHECK(Contains(absurd, "'intermediate_size'"));
    CHECK(Contains(absurd, "absurdly large"));
    CHECK(Contains(BuildError({{"model_type", "gpt2"}, {"n_embd", 0}}), "'n_embd'"));
    CHECK(Contains(BuildError({{"model_type", "gpt2"}, {"n_head", -12}}), "'n_head'"));
  }
  SUBCASE("heads that do not divide the hidden size") {
    llama["num_attention_heads"] = 30;
    llama["num_key_value_heads"] = 30;
    std::string error = BuildError(llama);
    CHECK(Contains(error, "'num_attention_heads'"));
    CHECK(Contains(error, "4096"));
    CHECK(Contains(BuildError({{"model_type", "gpt2"}, {"n_head", 7}}), "'n_head'"));
    CHECK(Contains(BuildError({{"model_type", "gpt2"}, {"num_attention_heads", 7}}),
                   "'num_attention_heads'"));
    nlohmann::json pythia = FixtureJson("pythia-160m");
    pythia["num_attention_heads"] = 7;
    CHECK(Contains(BuildError(pythia), "'num_attention_heads'"));
  }
  SUBCASE("key/value heads that do not divide the query heads") {
    llama["num_key_value_heads"] = 5;
    CHECK(Contains(BuildError(llama), "'num_key_value_heads'"));
  }
  SUBCASE("unknown architecture") {
    llama["architectures"] = {"LlamaForMultipleChoice"};
    std::string error = BuildError(llama);
    CHECK(Contains(error, "'architectures'"));
    CHECK(Contains(error, "LlamaForMultipleChoice"));
    CHECK(Contains(error, "LlamaForSequenceClassification"));
    CHECK(Contains(error, "LlamaForCausalLM"));
    CHECK(Contains(error, "LlamaModel"));
    CHECK(Contains(error, "`model_class` base"));
    // As the message suggests, the base model can still be built.
    ModelInventory base = MustBuild(llama, ModelClassChoice::kBase);
    CHECK(Total(base) == 6'607'343'616);
    CHECK(
        Contains(BuildError({{"model_type", "gpt2"}, {"architectures", {"GPT2DoubleHeadsModel"}}}),
                 "GPT2LMHeadModel"));
  }
  SUBCASE("layer and expert counts that would build an absurd number of tensors") {
    llama["num_hidden_layers"] = 2'000'000'000;
    CHECK(Contains(BuildError(llama), "'num_hidden_layers'"));
    nlohmann::json mixtral = FixtureJson("mixtral-8x7b");
    mixtral["num_local_experts"] = 1'000'000;
    CHECK(Contains(BuildError(mixtral), "'num_local_experts'"));
    CHECK(Contains(BuildError({{"model_type", "gpt2"}, {"n_layer", 100'000'000}}), "'n_layer'"));
  }
  SUBCASE("wrong JSON types") {
    llama["tie_word_embeddings"] = "no";
    CHECK(Contains(BuildError(llama), "'tie_word_embeddings'"));
    llama["tie_word_embeddings"] = false;
    llama["torch_dtype"] = 16;
    CHECK(Contains(BuildError(llama), "'torch_dtype'"));
  }
}

TEST_CASE("decoder: mpt follows the config as llm-foundry does") {
  // mosaicml/mpt-7b: 6,649,286,656 parameters (the Hub page's 6.7B), tied head, ALiBi, no
  // biases, no position table.
  ModelInventory mpt = Fixture("mpt-7b");
  CHECK(mpt.architecture == "MptForCausalLM");  // config.json names the remote MPTForCausalLM
  CHECK(Total(mpt) == 6'649'286'656ull);
  CHECK(Tensor(mpt, "lm_head.weight").tied_to == "transformer.wte.weight");
  CHECK(mpt.Find("transformer.wpe.weight") < 0);
  CHECK(mpt.Find("transformer.blocks.0.norm_1.bias") < 0);
  CHECK(Tensor(mpt, "transformer.blocks.31.ffn.up_proj.weight").shape == Shape{16384, 4096});
  REQUIRE(mpt.arch.has_value());
  CHECK(mpt.arch->hidden_act == "gelu");
  CHECK_FALSE(mpt.arch->gated_mlp);
  CHECK_FALSE(mpt.arch->learned_positions);  // ALiBi: max_seq_len is no hard limit
  CHECK(mpt.arch->alibi);
  CHECK(mpt.arch->attention_impl == "torch");  // the Hub config's attn_config.attn_impl
  CHECK(mpt.arch->norm_type == "low_precision_layernorm");
  CHECK_FALSE(mpt.arch->norm_upcasts);  // LayerNorm without bias, not an RMS norm
  CHECK(mpt.arch->no_split_class == "MptBlock");

  nlohmann::json config = FixtureJson("mpt-7b");
  SUBCASE("expansion_ratio, no_bias, grouped-query attention, q/k LayerNorms, GLU") {
    config["expansion_ratio"] = 2.5;
    config["no_bias"] = false;
    config["attn_config"]["attn_type"] = "grouped_query_attention";
    config["attn_config"]["kv_n_heads"] = 8;
    config["attn_config"]["qk_ln"] = true;
    config["ffn_config"] = {{"ffn_type", "mptglu"}};
    ModelInventory m = MustBuild(config);
    CHECK(Tensor(m, "transformer.blocks.0.ffn.up_proj.weight").shape == Shape{10240, 4096});
    CHECK(Tensor(m, "transformer.blocks.0.ffn.gate_proj.weight").shape == Shape{10240, 4096});
    CHECK(Tensor(m, "transformer.blocks.0.attn.Wqkv.weight").shape ==
          Shape{4096 + 2 * 8 * 128, 4096});
    CHECK(Tensor(m, "transformer.blocks.0.attn.Wqkv.bias").shape == Shape{4096 + 2 * 8 * 128});
    CHECK(Tensor(m, "transformer.blocks.0.attn.k_ln.weight").shape == Shape{8 * 128});
    CHECK(Tensor(m, "transformer.blocks.0.norm_1.bias").shape == Shape{4096});
    REQUIRE(m.arch.has_value());
    CHECK(m.arch->kv_heads == 8);
    CHECK(m.arch->gated_mlp);
    CHECK(m.arch->intermediate == 10240);
  }
  SUBCASE("learned positions only without ALiBi and RoPE") {
    config["attn_config"]["alibi"] = false;
    ModelInventory m = MustBuild(config);
    CHECK(Tensor(m, "transformer.wpe.weight").shape == Shape{2048, 4096});
    CHECK(m.arch->learned_positions);
    CHECK_FALSE(m.arch->alibi);  // attn_config.alibi, not a family constant
    config["attn_config"]["rope"] = true;
    CHECK(MustBuild(config).Find("transformer.wpe.weight") < 0);
  }
  SUBCASE("errors name the nested field") {
    config["attn_config"]["attn_type"] = "sliding";
    CHECK(Contains(BuildError(config), "(attn_config): field 'attn_type'"));
    config["attn_config"] = 3;
    CHECK(Contains(BuildError(config), "'attn_config'"));
    config.erase("attn_config");
    config["expansion_ratio"] = -1;
    CHECK(Contains(BuildError(config), "'expansion_ratio'"));
  }
}

TEST_CASE("decoder: shapes that overflow are errors, not wrapped numbers") {
  // Every dim is within limits, but the expert matrices' element counts sum past 2^64.
  nlohmann::json config = FixtureJson("mixtral-8x7b");
  config["hidden_size"] = int64_t{1} << 30;
  config["intermediate_size"] = (int64_t{1} << 31) - 1;
  config["num_attention_heads"] = 1;
  config["num_key_value_heads"] = 1;
  Result<ModelInventory> inventory = Build(config);
  if (inventory.ok()) {
    Result<ModelCounts> counts = CountParams(*inventory);
    CHECK_FALSE(counts.ok());
    CHECK(counts.status().code() == StatusCode::kOutOfRange);
  } else {
    CHECK(inventory.status().code() == StatusCode::kOutOfRange);
  }
}

}  // namespace memplan::estimator
