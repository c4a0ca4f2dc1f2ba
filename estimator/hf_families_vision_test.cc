// Vision-language models (hf_families_vision.cc): Llava and multimodal Gemma-3, against the
// counts Transformers 5 gives for the published configs (tests/oracle/modern_configs; the modern
// oracle checks every tensor name, shape, buffer and Accelerate's sizes).
#include <doctest/doctest.h>

#include <algorithm>
#include <fstream>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "estimator/hf_config.h"
#include "estimator/inventory.h"
#include "tests/estimator_testing.h"

namespace memplan::estimator {
namespace {

using namespace memplan::testing;

nlohmann::json OracleConfig(const std::string& name) {
  std::ifstream in(std::string(MEMPLAN_SOURCE_DIR) + "/tests/oracle/modern_configs/" + name);
  REQUIRE(in.good());
  std::stringstream text;
  text << in.rdbuf();
  return nlohmann::json::parse(text.str());
}

TEST_CASE("vision: llava-1.5-7b is a CLIP tower, a two-layer projector and Vicuna-7B") {
  nlohmann::json config = OracleConfig("llava-1.5-7b.json");
  ModelInventory llava = MustBuild(config);
  CHECK(llava.architecture == "LlavaForConditionalGeneration");
  CHECK(llava.model_type == "llava");
  ModelCounts counts = Counts(llava);
  // Transformers 5 on the meta device: 7,063,427,072; LlavaModel (no lm_head) 6,932,092,928.
  CHECK(counts.params_total == 7'063'427'072ull);
  CHECK(counts.largest_layer_params == 32064ull * 4096);  // embed_tokens (lm_head is untied)
  CHECK(Total(MustBuild(config, ModelClassChoice::kBase)) == 6'932'092'928ull);
  // text_config names no sizes: LlamaConfig's defaults (4096 wide, 32 layers of 11008).
  CHECK(Tensor(llava, "model.language_model.layers.31.mlp.up_proj.weight").shape ==
        Shape{11008, 4096});
  // CLIP: class token, bias-free 14 x 14 patch convolution, 24 x 24 patches + 1 positions.
  CHECK(Tensor(llava, "model.vision_tower.embeddings.patch_embedding.weight").shape ==
        Shape{1024, 3, 14, 14});
  CHECK(llava.Find("model.vision_tower.embeddings.patch_embedding.bias") < 0);
  CHECK(Tensor(llava, "model.vision_tower.embeddings.position_embedding.weight").shape ==
        Shape{577, 1024});
  CHECK(Tensor(llava, "model.multi_modal_projector.linear_1.weight").shape == Shape{4096, 1024});
  CHECK(Tensor(llava, "lm_head.weight").tied_to.empty());
  // Activations follow the language model; the note says the tower's are not modelled.
  REQUIRE(llava.arch.has_value());
  CHECK(llava.arch->hidden == 4096);
  CHECK(llava.arch->layers == 32);
  CHECK(llava.arch->no_split_class == "LlamaDecoderLayer");
  REQUIRE(llava.notes.size() == 1);
  CHECK(llava.notes[0].find("vision tower") != std::string::npos);
  // Accelerate keeps CLIPVisionEmbeddings, CLIPEncoderLayer and LlamaDecoderLayer whole.
  CHECK(std::count(llava.no_split_modules.begin(), llava.no_split_modules.end(),
                   "model.vision_tower.embeddings") == 1);
  CHECK(llava.no_split_modules.size() == 1 + 24 + 32);
}

TEST_CASE("vision: llava's sub-configs take their classes' defaults, tying and feature layers") {
  nlohmann::json config = OracleConfig("llava-1.5-7b.json");
  // No vision_config at all: LlavaConfig's CLIP tower of llava-1.5 (1024 wide, 24 layers).
  nlohmann::json no_vision = config;
  no_vision.erase("vision_config");
  CHECK(Total(MustBuild(no_vision)) == 7'063'427'072ull);
  // A vision_config given, but empty: CLIPVisionConfig's own defaults (768 wide, 32 px patches).
  nlohmann::json bare = config;
  bare["vision_config"] = {{"model_type", "clip_vision_model"}};
  CHECK(Tensor(MustBuild(bare), "model.vision_tower.embeddings.patch_embedding.weight").shape ==
        Shape{768, 3, 32, 32});
  // Two feature layers concatenated: the projector reads twice the width.
  nlohmann::json two = config;
  two["vision_feature_layer"] = {-2, -5};
  CHECK(Tensor(MustBuild(two), "model.multi_modal_projector.linear_1.weight").shape ==
        Shape{4096, 2048});
  two["multimodal_projector_bias"] = false;
  CHECK(MustBuild(two).Find("model.multi_modal_projector.linear_1.bias") < 0);
  // LlavaConfig ties when its text_config does.
  nlohmann::json tied = config;
  tied["text_config"]["tie_word_embeddings"] = true;
  CHECK(Tensor(MustBuild(tied), "lm_head.weight").tied_to ==
        "model.language_model.embed_tokens.weight");
  // The whole model in the config's dtype.
  CHECK(Tensor(MustBuild(config), "model.vision_tower.post_layernorm.weight").dtype == DType::kF16);
}

TEST_CASE("vision: gemma-3-4b-it is a SigLIP tower, a projection and Gemma-3 text, tied") {
  nlohmann::json config = OracleConfig("gemma-3-4b-it.json");
  ModelInventory gemma = MustBuild(config);
  CHECK(gemma.architecture == "Gemma3ForConditionalGeneration");
  ModelCounts counts = Counts(gemma);
  CHECK(counts.params_total == 4'300'079'472ull);  // Transformers 5
  CHECK(Tensor(gemma, "lm_head.weight").tied_to == "model.language_model.embed_tokens.weight");
  // text_config leaves heads and vocabulary to Gemma3TextConfig: 8 heads, 4 KV heads, 262,208.
  CHECK(Tensor(gemma, "model.language_model.layers.0.self_attn.k_proj.weight").shape ==
        Shape{1024, 2560});
  CHECK(Tensor(gemma, "model.language_model.embed_tokens.weight").shape == Shape{262208, 2560});
  // SigLIP: a biased patch convolution, 64 x 64 patches, no class token; no head (use_head false).
  CHECK(Tensor(gemma, "model.vision_tower.embeddings.patch_embedding.bias").shape == Shape{1152});
  CHECK(Tensor(gemma, "model.vision_tower.embeddings.position_embedding.weight").shape ==
        Shape{4096, 1152});
  CHECK(gemma.Find("model.vision_tower.head.probe") < 0);
  CHECK(Tensor(gemma, "model.multi_modal_projector.mm_input_projection_weight").shape ==
        Shape{1152, 2560});
  REQUIRE(gemma.arch.has_value());
  CHECK(gemma.arch->sliding_window == 1024);
  // Gemma3ForSequenceClassification: the multimodal model and a score of the text width.
  nlohmann::json reward = config;
  reward["architectures"] = {"Gemma3ForSequenceClassification"};
  reward["num_labels"] = 1;
  ModelInventory scored = MustBuild(reward);
  CHECK(Tensor(scored, "score.weight").shape == Shape{1, 2560});
  CHECK(scored.Find("lm_head.weight") < 0);
  // With SigLIP's default head: the probe and attention pooling, kept whole by Accelerate.
  nlohmann::json headed = config;
  headed["vision_config"].erase("vision_use_head");
  ModelInventory with_head = MustBuild(headed);
  CHECK(Tensor(with_head, "model.vision_tower.head.attention.in_proj_weight").shape ==
        Shape{3456, 1152});
  CHECK(std::count(with_head.no_split_modules.begin(), with_head.no_split_modules.end(),
                   "model.vision_tower.head") == 1);
}

TEST_CASE("vision: bad sub-configs are refused with the field named") {
  nlohmann::json config = OracleConfig("llava-1.5-7b.json");
  nlohmann::json bad = config;
  bad["text_config"]["model_type"] = "mamba";
  auto built = Build(bad);
  REQUIRE_FALSE(built.ok());
  CHECK(built.status().message().find("field 'text_config': model_type 'mamba'") !=
        std::string::npos);
  bad = config;
  bad["vision_config"] = 3;
  built = Build(bad);
  REQUIRE_FALSE(built.ok());
  CHECK(built.status().message().find("field 'vision_config': must be an object") !=
        std::string::npos);
  // A language model whose class has no defaults here: its size fields are required, and the
  // error says which sub-config lacks them.
  bad = config;
  bad["text_config"] = {{"model_type", "qwen2"}};
  built = Build(bad);
  REQUIRE_FALSE(built.ok());
  CHECK(built.status().message().find("(text_config): field 'hidden_size'") != std::string::npos);
  bad = config;
  bad["architectures"] = {"LlavaForSequenceClassification"};
  CHECK_FALSE(Build(bad).ok());
}

}  // namespace
}  // namespace memplan::estimator
