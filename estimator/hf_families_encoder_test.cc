// Tests for the bert, roberta and t5 config.json builders (hf_families_encoder.cc), through the
// public InventoryFromHfConfig* entry points.
//
// Fixtures under estimator/models/ are the config.json files published on the Hugging Face Hub.
// Every total below is a published figure or the count Transformers itself gives for that config
// (`sum(p.numel() for p in model.parameters())`, which counts a tied Parameter once), with the
// source beside it; a wrong shape anywhere moves the total and fails the test. The full-order
// cases compare against `named_parameters(remove_duplicate=False)` as printed by Transformers
// 4.44.2 (and identical in 5.x for these classes).
#include <doctest/doctest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "estimator/hf_config.h"
#include "estimator/inventory.h"
#include "tests/estimator_testing.h"

namespace memplan::estimator {
namespace {

// The shared fixture and inventory helpers: Fixture, Build, MustBuild, Counts, Total, Tensor.
using namespace memplan::testing;

bool Has(const ModelInventory& inventory, const std::string& name) {
  return inventory.Find(name) >= 0;
}

// The tensor names in estimator/testdata/FILE, one per line ('#' starts a comment line).
std::vector<std::string> ExpectedNames(const std::string& file) {
  std::ifstream in(std::string(MEMPLAN_SOURCE_DIR) + "/estimator/testdata/" + file);
  REQUIRE_MESSAGE(in.good(), file);
  std::vector<std::string> names;
  for (std::string line; std::getline(in, line);) {
    if (!line.empty() && line[0] != '#') names.push_back(line);
  }
  return names;
}

std::vector<std::string> Names(const ModelInventory& inventory) {
  std::vector<std::string> names;
  for (const TensorInfo& t : inventory.tensors) names.push_back(t.name);
  return names;
}

// The error of building `config`; fails the test when the build succeeds.
Status BuildError(const nlohmann::json& config,
                  ModelClassChoice choice = ModelClassChoice::kFromArchitectures) {
  Result<ModelInventory> inventory = Build(config, choice);
  REQUIRE_MESSAGE(!inventory.ok(), "expected an error for " << config.dump());
  return inventory.status();
}

bool Mentions(const Status& status, const std::string& text) {
  return status.message().find(text) != std::string::npos;
}

nlohmann::json TinyBert() {
  return {{"model_type", "bert"},   {"vocab_size", 11},         {"hidden_size", 8},
          {"num_hidden_layers", 1}, {"num_attention_heads", 2}, {"intermediate_size", 16}};
}

nlohmann::json TinyT5() {
  return {{"model_type", "t5"}, {"vocab_size", 11}, {"d_model", 8},
          {"d_ff", 16},         {"num_layers", 1},  {"num_heads", 2}};
}

// --- bert -------------------------------------------------------------------------------------

TEST_CASE("encoder: bert-base-uncased base model is BertModel with its pooler") {
  ModelInventory inv = Fixture("bert-base-uncased", ModelClassChoice::kBase);
  CHECK(inv.architecture == "BertModel");
  CHECK(inv.model_class == "base");
  // REFERENCE.md section 2 (BertModel with pooler, as AutoModel builds it).
  CHECK(Total(inv) == 109'482'240);
  CHECK(inv.tensors.front().name == "embeddings.word_embeddings.weight");
  CHECK(Tensor(inv, "embeddings.word_embeddings.weight").shape == Shape{30522, 768});
  CHECK(Tensor(inv, "embeddings.position_embeddings.weight").shape == Shape{512, 768});
  CHECK(Tensor(inv, "embeddings.token_type_embeddings.weight").shape == Shape{2, 768});
  CHECK(Tensor(inv, "encoder.layer.11.intermediate.dense.weight").shape == Shape{3072, 768});
  CHECK(Tensor(inv, "encoder.layer.11.output.dense.weight").shape == Shape{768, 3072});
  CHECK(inv.tensors.back().name == "pooler.dense.bias");
  // Buffers are not parameters.
  CHECK_FALSE(Has(inv, "embeddings.position_ids"));
  CHECK_FALSE(Has(inv, "embeddings.token_type_ids"));
  ModelCounts counts = Counts(inv);
  CHECK(counts.num_tied == 0);
  CHECK(counts.num_blocks == 12);
  CHECK(counts.largest_layer_params == 30522 * 768);
  CHECK(counts.largest_layer_module == "embeddings.word_embeddings");
  CHECK(Tensor(inv, "encoder.layer.3.attention.self.key.bias").layer == 3);
  CHECK(Tensor(inv, "encoder.layer.3.attention.self.key.bias").block == "encoder.layer.3");
}

TEST_CASE("encoder: bert-base-uncased builds BertForMaskedLM, as its architectures say") {
  ModelInventory inv = Fixture("bert-base-uncased");
  CHECK(inv.architecture == "BertForMaskedLM");
  CHECK(inv.model_class == "masked_lm");
  // Transformers 4.44.2, BertForMaskedLM(config): BertModel without its pooler (590,592) plus
  // the prediction bias, transform dense and transform LayerNorm.
  CHECK(Total(inv) == 109'514'298);
  CHECK_FALSE(Has(inv, "bert.pooler.dense.weight"));
  CHECK(inv.tensors.front().name == "bert.embeddings.word_embeddings.weight");

  // The head's own bias comes first (module parameters before children's); the decoder's weight
  // is the word embedding and its bias the head's bias.
  const std::vector<std::string> tail = {
      "cls.predictions.bias",
      "cls.predictions.transform.dense.weight",
      "cls.predictions.transform.dense.bias",
      "cls.predictions.transform.LayerNorm.weight",
      "cls.predictions.transform.LayerNorm.bias",
      "cls.predictions.decoder.weight",
      "cls.predictions.decoder.bias",
  };
  std::vector<std::string> names = Names(inv);
  REQUIRE(names.size() > tail.size());
  CHECK(std::vector<std::string>(names.end() - static_cast<int64_t>(tail.size()), names.end()) ==
        tail);
  CHECK(Tensor(inv, "cls.predictions.decoder.weight").tied_to ==
        "bert.embeddings.word_embeddings.weight");
  CHECK(Tensor(inv, "cls.predictions.decoder.weight").shape == Shape{30522, 768});
  CHECK(Tensor(inv, "cls.predictions.decoder.bias").tied_to == "cls.predictions.bias");
  CHECK(Tensor(inv, "cls.predictions.bias").tied_to.empty());
  CHECK(Counts(inv).num_tied == 2);
}

TEST_CASE("encoder: one-layer BertForPreTraining matches Transformers' order tensor by tensor") {
  nlohmann::json config = TinyBert();
  config["architectures"] = {"BertForPreTraining"};
  ModelInventory inv = MustBuild(config);
  CHECK(inv.architecture == "BertForPreTraining");
  CHECK(inv.model_class == "masked_lm");
  const std::vector<std::string> expected = ExpectedNames("bert_for_pretraining_1layer.names");
  CHECK(Names(inv) == expected);
  CHECK(Tensor(inv, "cls.seq_relationship.weight").shape == Shape{2, 8});
  // Transformers 4.44.2, BertForPreTraining(config) for this config.
  CHECK(Total(inv) == 5005);
}

TEST_CASE("encoder: bert decoder options: cross-attention, relative positions, untied head") {
  nlohmann::json config = TinyBert();
  config["architectures"] = {"BertLMHeadModel"};
  config["is_decoder"] = true;
  config["add_cross_attention"] = true;
  config["position_embedding_type"] = "relative_key_query";
  config["max_position_embeddings"] = 40;
  config["tie_word_embeddings"] = false;
  ModelInventory inv = MustBuild(config);
  CHECK(inv.architecture == "BertLMHeadModel");
  CHECK(inv.model_class == "causal_lm");
  CHECK_FALSE(Has(inv, "bert.pooler.dense.weight"));
  // Self-attention gets a distance table of 2 * max_positions - 1 rows by head size, right after
  // value; cross-attention never does.
  const TensorInfo& distance =
      Tensor(inv, "bert.encoder.layer.0.attention.self.distance_embedding.weight");
  CHECK(distance.shape == Shape{79, 4});
  CHECK(inv.Find("bert.encoder.layer.0.attention.self.distance_embedding.weight") ==
        inv.Find("bert.encoder.layer.0.attention.self.value.bias") + 1);
  CHECK(Has(inv, "bert.encoder.layer.0.crossattention.self.query.weight"));
  CHECK(Has(inv, "bert.encoder.layer.0.crossattention.output.LayerNorm.bias"));
  CHECK_FALSE(Has(inv, "bert.encoder.layer.0.crossattention.self.distance_embedding.weight"));
  CHECK(inv.Find("bert.encoder.layer.0.crossattention.output.LayerNorm.bias") <
        inv.Find("bert.encoder.layer.0.intermediate.dense.weight"));
  // tie_word_embeddings: false keeps a separate decoder matrix; the bias stays shared.
  CHECK(Tensor(inv, "cls.predictions.decoder.weight").tied_to.empty());
  CHECK(Tensor(inv, "cls.predictions.decoder.bias").tied_to == "cls.predictions.bias");
  // Transformers 4.44.2, BertLMHeadModel(config) for this config.
  CHECK(Total(inv) == 1847);
}

// --- roberta ----------------------------------------------------------------------------------

TEST_CASE("encoder: roberta-base as RobertaModel and RobertaForMaskedLM") {
  ModelInventory base = Fixture("roberta-base", ModelClassChoice::kBase);
  CHECK(base.architecture == "RobertaModel");
  CHECK(base.model_class == "base");
  // RobertaModel with pooler; Transformers 4.44.2 RobertaModel(config), the "125M" on the Hub.
  CHECK(Total(base) == 124'645'632);
  CHECK(Tensor(base, "embeddings.position_embeddings.weight").shape == Shape{514, 768});
  CHECK(Tensor(base, "embeddings.token_type_embeddings.weight").shape == Shape{1, 768});
  // Transformers 5 registers RoBERTa's padding-aware position table after LayerNorm.
  const std::vector<std::string> embeddings = {
      "embeddings.word_embeddings.weight", "embeddings.token_type_embeddings.weight",
      "embeddings.LayerNorm.weight", "embeddings.LayerNorm.bias",
      "embeddings.position_embeddings.weight"};
  std::vector<std::string> names = Names(base);
  CHECK(std::vector<std::string>(names.begin(), names.begin() + 5) == embeddings);
  CHECK(Has(base, "pooler.dense.weight"));

  ModelInventory mlm = Fixture("roberta-base");
  CHECK(mlm.architecture == "RobertaForMaskedLM");
  CHECK(mlm.model_class == "masked_lm");
  // Transformers 4.44.2, RobertaForMaskedLM(config).
  CHECK(Total(mlm) == 124'697'433);
  CHECK_FALSE(Has(mlm, "roberta.pooler.dense.weight"));
  const std::vector<std::string> head = {"lm_head.bias",
                                         "lm_head.dense.weight",
                                         "lm_head.dense.bias",
                                         "lm_head.layer_norm.weight",
                                         "lm_head.layer_norm.bias",
                                         "lm_head.decoder.weight",
                                         "lm_head.decoder.bias"};
  names = Names(mlm);
  CHECK(std::vector<std::string>(names.end() - 7, names.end()) == head);
  CHECK(Tensor(mlm, "lm_head.decoder.weight").tied_to ==
        "roberta.embeddings.word_embeddings.weight");
  CHECK(Tensor(mlm, "lm_head.decoder.bias").tied_to == "lm_head.bias");
}

TEST_CASE("encoder: RobertaForCausalLM with cross-attention and no segment embeddings") {
  nlohmann::json config = TinyBert();
  config["model_type"] = "roberta";
  config["architectures"] = {"RobertaForCausalLM"};
  config["is_decoder"] = true;
  config["add_cross_attention"] = true;
  config["type_vocab_size"] = 0;
  ModelInventory inv = MustBuild(config);
  CHECK(inv.architecture == "RobertaForCausalLM");
  CHECK(inv.model_class == "causal_lm");
  CHECK(Tensor(inv, "roberta.embeddings.token_type_embeddings.weight").shape == Shape{0, 8});
  CHECK(Has(inv, "roberta.encoder.layer.0.crossattention.self.key.weight"));
  CHECK(Tensor(inv, "lm_head.decoder.weight").tied_to ==
        "roberta.embeddings.word_embeddings.weight");
}

// --- t5 ---------------------------------------------------------------------------------------

TEST_CASE("encoder: t5-large matches DeepSpeed's worked example") {
  ModelInventory inv = Fixture("t5-large");
  CHECK(inv.architecture == "T5ForConditionalGeneration");
  CHECK(inv.model_class == "seq2seq_lm");
  ModelCounts counts = Counts(inv);
  // REFERENCE.md section 1-2, from DeepSpeed's memory docs: P and L for t5-large.
  CHECK(counts.params_total == 737'668'096);
  CHECK(counts.largest_layer_params == 32'899'072);
  // The published file has no num_decoder_layers, feed_forward_proj or tie_word_embeddings:
  // T5Config's defaults (num_layers, "relu", tied) apply.
  CHECK(Has(inv, "decoder.block.23.layer.2.DenseReluDense.wi.weight"));
  CHECK_FALSE(Has(inv, "decoder.block.24.layer.0.SelfAttention.q.weight"));
  CHECK_FALSE(Has(inv, "encoder.block.0.layer.1.DenseReluDense.wi_0.weight"));
  CHECK(Tensor(inv, "encoder.block.5.layer.1.DenseReluDense.wi.weight").shape == Shape{4096, 1024});
  CHECK(Tensor(inv, "encoder.block.5.layer.1.DenseReluDense.wo.weight").shape == Shape{1024, 4096});
  CHECK(Tensor(inv, "encoder.block.0.layer.0.SelfAttention.q.weight").shape == Shape{1024, 1024});
  // Only block 0 of each stack owns the relative position bias; cross-attention has none.
  CHECK(Tensor(inv, "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight").shape ==
        Shape{32, 16});
  CHECK(Has(inv, "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"));
  CHECK_FALSE(Has(inv, "encoder.block.1.layer.0.SelfAttention.relative_attention_bias.weight"));
  CHECK_FALSE(Has(inv, "decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight"));
  CHECK(Tensor(inv, "encoder.embed_tokens.weight").tied_to == "shared.weight");
  CHECK(Tensor(inv, "decoder.embed_tokens.weight").tied_to == "shared.weight");
  CHECK(Tensor(inv, "lm_head.weight").tied_to == "shared.weight");
  CHECK(counts.num_tied == 3);
  CHECK(counts.num_blocks == 48);

  // With the head tied, the base T5Model holds the same parameters.
  ModelInventory base = Fixture("t5-large", ModelClassChoice::kBase);
  CHECK(base.architecture == "T5Model");
  CHECK(base.model_class == "base");
  CHECK_FALSE(Has(base, "lm_head.weight"));
  CHECK(Total(base) == 737'668'096);
}

TEST_CASE("encoder: t5-v1_1-base is gated-gelu with an untied lm_head") {
  ModelInventory inv = Fixture("t5-v1_1-base");
  CHECK(inv.model_class == "seq2seq_lm");
  // Transformers 4.44.2, T5ForConditionalGeneration(config); the Hub lists it as 248M params.
  CHECK(Total(inv) == 247'577'856);
  CHECK(Tensor(inv, "encoder.block.0.layer.1.DenseReluDense.wi_0.weight").shape ==
        Shape{2048, 768});
  CHECK(Tensor(inv, "decoder.block.11.layer.2.DenseReluDense.wi_1.weight").shape ==
        Shape{2048, 768});
  CHECK_FALSE(Has(inv, "encoder.block.0.layer.1.DenseReluDense.wi.weight"));
  CHECK(Tensor(inv, "lm_head.weight").tied_to.empty());
  // The stacks hold the shared module itself, so their embeddings stay tied regardless.
  CHECK(Tensor(inv, "encoder.embed_tokens.weight").tied_to == "shared.weight");
  CHECK(inv.tensors.back().name == "lm_head.weight");

  ModelInventory base = Fixture("t5-v1_1-base", ModelClassChoice::kBase);
  CHECK(base.architecture == "T5Model");
  // Transformers 4.44.2, T5Model(config): the same without lm_head's 32128 x 768.
  CHECK(Total(base) == 222'903'552);
}

TEST_CASE("encoder: one-layer gated T5 matches Transformers' order tensor by tensor") {
  nlohmann::json config = TinyT5();
  config["d_kv"] = 2;
  config["feed_forward_proj"] = "gated-gelu";
  config["tie_word_embeddings"] = false;
  ModelInventory inv = MustBuild(config);
  const std::vector<std::string> expected = ExpectedNames("t5_gated_1layer.names");
  CHECK(Names(inv) == expected);
  // q/k/v project d_model to heads * d_kv; o projects back.
  CHECK(Tensor(inv, "encoder.block.0.layer.0.SelfAttention.k.weight").shape == Shape{4, 8});
  CHECK(Tensor(inv, "decoder.block.0.layer.1.EncDecAttention.o.weight").shape == Shape{8, 4});
  // Transformers 4.44.2, T5ForConditionalGeneration(config) for this config.
  CHECK(Total(inv) == 1512);
}

TEST_CASE("encoder: T5EncoderModel, asymmetric stacks and the base-class override") {
  nlohmann::json config = TinyT5();
  config["architectures"] = {"T5EncoderModel"};
  config["num_layers"] = 3;
  config["num_decoder_layers"] = 2;
  ModelInventory encoder_only = MustBuild(config);
  CHECK(encoder_only.architecture == "T5EncoderModel");
  CHECK(encoder_only.model_class == "base");
  CHECK(Has(encoder_only, "encoder.block.2.layer.1.layer_norm.weight"));
  CHECK_FALSE(Has(encoder_only, "decoder.embed_tokens.weight"));
  CHECK_FALSE(Has(encoder_only, "lm_head.weight"));

  // AutoModel builds T5Model whatever the checkpoint's head.
  ModelInventory base = MustBuild(config, ModelClassChoice::kBase);
  CHECK(base.architecture == "T5Model");
  CHECK(Has(base, "decoder.block.1.layer.2.layer_norm.weight"));
  CHECK_FALSE(Has(base, "decoder.block.2.layer.0.SelfAttention.q.weight"));
  CHECK(Counts(base).num_blocks == 5);
}

// --- defaults, dtypes, errors -----------------------------------------------------------------

TEST_CASE("encoder: absent optional fields take Transformers' defaults") {
  // No architectures: bert and roberta build their masked-LM head, t5 conditional generation.
  ModelInventory bert = MustBuild(TinyBert());
  CHECK(bert.architecture == "BertForMaskedLM");
  CHECK(Tensor(bert, "bert.embeddings.position_embeddings.weight").shape == Shape{512, 8});
  CHECK(Tensor(bert, "bert.embeddings.token_type_embeddings.weight").shape == Shape{2, 8});
  CHECK(Tensor(bert, "cls.predictions.decoder.weight").tied_to ==
        "bert.embeddings.word_embeddings.weight");
  CHECK_FALSE(Has(bert, "bert.encoder.layer.0.attention.self.distance_embedding.weight"));
  CHECK_FALSE(Has(bert, "bert.encoder.layer.0.crossattention.self.query.weight"));
  CHECK(Tensor(bert, "bert.embeddings.word_embeddings.weight").dtype == DType::kF32);

  nlohmann::json roberta_config = TinyBert();
  roberta_config["model_type"] = "roberta";
  CHECK(MustBuild(roberta_config).architecture == "RobertaForMaskedLM");

  ModelInventory t5 = MustBuild(TinyT5());
  CHECK(t5.architecture == "T5ForConditionalGeneration");
  // d_kv 64, 32 buckets, relu FFN, decoder as deep as the encoder, lm_head tied.
  CHECK(Tensor(t5, "encoder.block.0.layer.0.SelfAttention.q.weight").shape == Shape{128, 8});
  CHECK(Tensor(t5, "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight").shape ==
        Shape{32, 2});
  CHECK(Has(t5, "decoder.block.0.layer.2.DenseReluDense.wi.weight"));
  CHECK_FALSE(Has(t5, "decoder.block.1.layer.0.layer_norm.weight"));
  CHECK(Tensor(t5, "lm_head.weight").tied_to == "shared.weight");
}

TEST_CASE("encoder: dtype comes from torch_dtype or dtype; unknown spellings mean fp32") {
  nlohmann::json config = TinyBert();
  config["torch_dtype"] = "float16";
  CHECK(MustBuild(config).tensors.front().dtype == DType::kF16);
  config.erase("torch_dtype");
  config["dtype"] = "bfloat16";  // what newer Transformers write
  ModelInventory bf16 = MustBuild(config);
  CHECK(bf16.tensors.back().dtype == DType::kBF16);
  CHECK(Counts(bf16).bytes_as_stored == Total(bf16) * 2);
  config["torch_dtype"] = "float16";  // newer Transformers prefer `dtype` when both are there
  CHECK(MustBuild(config).tensors.front().dtype == DType::kBF16);
  config["dtype"] = "auto";
  CHECK(MustBuild(config).tensors.front().dtype == DType::kF32);

  nlohmann::json t5 = TinyT5();
  t5["torch_dtype"] = "bfloat16";
  CHECK(MustBuild(t5).tensors.front().dtype == DType::kBF16);
  t5["torch_dtype"] = 16;
  Status s = BuildError(t5);
  CHECK(Mentions(s, "'torch_dtype'"));
}

TEST_CASE("encoder: missing, zero, negative and absurd fields are errors naming the field") {
  struct Case {
    const char* family;
    const char* field;
    nlohmann::json value;  // null: remove the field
  };
  const Case cases[] = {
      {"bert", "hidden_size", nullptr},
      {"bert", "vocab_size", nullptr},
      {"bert", "num_hidden_layers", nullptr},
      {"bert", "num_attention_heads", nullptr},
      {"bert", "intermediate_size", nullptr},
      {"bert", "hidden_size", 0},
      {"bert", "hidden_size", -768},
      {"bert", "hidden_size", 4096.5},
      {"bert", "hidden_size", "768"},
      {"bert", "vocab_size", int64_t{1} << 40},
      {"bert", "num_hidden_layers", 2147483647},
      {"bert", "max_position_embeddings", 0},
      {"bert", "type_vocab_size", -1},
      {"bert", "tie_word_embeddings", "yes"},
      {"bert", "position_embedding_type", 3},
      {"t5", "d_model", nullptr},
      {"t5", "d_ff", nullptr},
      {"t5", "num_layers", nullptr},
      {"t5", "num_heads", nullptr},
      {"t5", "vocab_size", nullptr},
      {"t5", "d_kv", 0},
      {"t5", "num_decoder_layers", -2},
      {"t5", "num_decoder_layers", 1e12},
      {"t5", "relative_attention_num_buckets", 0},
      {"t5", "feed_forward_proj", "gelu-new"},
      {"t5", "feed_forward_proj", "gated-"},
      {"t5", "feed_forward_proj", "gated-a-b"},
      {"t5", "feed_forward_proj", false},
  };
  for (const Case& c : cases) {
    nlohmann::json config = std::string(c.family) == "bert" ? TinyBert() : TinyT5();
    if (c.value.is_null()) {
      config.erase(c.field);
    } else {
      config[c.field] = c.value;
    }
    CAPTURE(config.dump());
    Status s = BuildError(config);
    CHECK(s.code() == StatusCode::kInvalidArgument);
    CHECK(Mentions(s, "test/config.json"));
    CHECK(Mentions(s, std::string("'") + c.field + "'"));
  }
}

TEST_CASE("encoder: heads must divide hidden_size; cross-attention needs a decoder") {
  nlohmann::json config = TinyBert();
  config["num_attention_heads"] = 3;
  Status s = BuildError(config);
  CHECK(Mentions(s, "'num_attention_heads'"));
  CHECK(Mentions(s, "does not divide hidden_size 8"));

  config = TinyBert();
  config["add_cross_attention"] = true;
  s = BuildError(config);
  CHECK(Mentions(s, "'add_cross_attention'"));
  CHECK(Mentions(s, "is_decoder"));
}

TEST_CASE("encoder: an unknown architecture lists the supported classes and the way out") {
  nlohmann::json config = TinyBert();
  config["architectures"] = {"BertForDocumentRanking"};
  Status s = BuildError(config);
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(Mentions(s, "'architectures'"));
  CHECK(Mentions(s, "BertForDocumentRanking"));
  CHECK(Mentions(s, "BertModel, BertForMaskedLM, BertLMHeadModel, BertForSequenceClassification"));
  CHECK(Mentions(s, "`model_class` base"));
  // The base model needs no head, so the same config builds with the override.
  ModelInventory base = MustBuild(config, ModelClassChoice::kBase);
  CHECK(base.architecture == "BertModel");
  CHECK(Has(base, "pooler.dense.weight"));

  nlohmann::json t5 = TinyT5();
  t5["architectures"] = {"T5ForMultipleChoice"};
  s = BuildError(t5);
  CHECK(Mentions(s, "T5Model, T5ForConditionalGeneration, T5EncoderModel"));
  CHECK(MustBuild(t5, ModelClassChoice::kBase).architecture == "T5Model");

  nlohmann::json roberta = TinyBert();
  roberta["model_type"] = "roberta";
  roberta["architectures"] = {"BertForMaskedLM"};  // another family's class
  s = BuildError(roberta);
  CHECK(Mentions(s, "RobertaModel, RobertaForMaskedLM, RobertaForCausalLM"));
  CHECK_FALSE(Mentions(s, "XLMRoberta"));
}

TEST_CASE("encoder: task heads for bert, roberta and t5, sized by num_labels") {
  nlohmann::json config = TinyBert();
  config["id2label"] = {{"0", "a"}, {"1", "b"}, {"2", "c"}};
  const uint64_t encoder = Total(MustBuild(TinyBert(), ModelClassChoice::kBase)) - (8 * 8 + 8);
  // BertForSequenceClassification keeps the pooler; token and QA heads drop it.
  config["architectures"] = {"BertForSequenceClassification"};
  ModelInventory seq = MustBuild(config);
  CHECK(seq.model_class == "sequence_classification");
  CHECK(Tensor(seq, "classifier.weight").shape == Shape{3, 8});
  CHECK(Total(seq) == encoder + (8 * 8 + 8) + (3 * 8 + 3));
  config["architectures"] = {"BertForTokenClassification"};
  CHECK(Total(MustBuild(config)) == encoder + (3 * 8 + 3));
  config["architectures"] = {"BertForQuestionAnswering"};
  CHECK(Tensor(MustBuild(config), "qa_outputs.weight").shape == Shape{3, 8});
  config["architectures"] = {"BertForMultipleChoice"};
  CHECK(Tensor(MustBuild(config), "classifier.weight").shape == Shape{1, 8});
  // RoBERTa's sequence head pools by itself: dense + out_proj, and no pooler.
  config["model_type"] = "roberta";
  config["architectures"] = {"RobertaForSequenceClassification"};
  ModelInventory roberta = MustBuild(config);
  CHECK(Tensor(roberta, "classifier.out_proj.weight").shape == Shape{3, 8});
  CHECK_FALSE(Has(roberta, "roberta.pooler.dense.weight"));
  // T5: around a T5Model, a T5EncoderModel, or the stacks themselves.
  nlohmann::json t5 = TinyT5();
  t5["num_labels"] = 4;
  t5["architectures"] = {"T5ForSequenceClassification"};
  ModelInventory t5_seq = MustBuild(t5);
  CHECK(Tensor(t5_seq, "classification_head.out_proj.weight").shape == Shape{4, 8});
  CHECK(Has(t5_seq, "transformer.decoder.block.0.layer.1.EncDecAttention.q.weight"));
  t5["architectures"] = {"T5ForTokenClassification"};
  ModelInventory t5_token = MustBuild(t5);
  CHECK_FALSE(Has(t5_token, "transformer.decoder.final_layer_norm.weight"));
  CHECK(Tensor(t5_token, "classifier.bias").shape == Shape{4});
  t5["architectures"] = {"T5ForQuestionAnswering"};
  CHECK(Has(MustBuild(t5), "decoder.final_layer_norm.weight"));
}

TEST_CASE("encoder: T5WithLMHeadModel, t5-3b's class name, is T5ForConditionalGeneration") {
  nlohmann::json t5 = TinyT5();
  t5["architectures"] = {"T5WithLMHeadModel"};
  ModelInventory inv = MustBuild(t5);
  CHECK(inv.architecture == "T5ForConditionalGeneration");
  CHECK(inv.model_class == "seq2seq_lm");
  CHECK(Tensor(inv, "lm_head.weight").tied_to == "shared.weight");
}

TEST_CASE("encoder: xlm-roberta registers its heads first; distilbert") {
  nlohmann::json config = TinyBert();
  config["model_type"] = "xlm-roberta";
  config["architectures"] = {"XLMRobertaForMaskedLM"};
  ModelInventory xlmr = MustBuild(config);
  CHECK(xlmr.tensors.front().name == "lm_head.bias");
  // The head's decoder comes first, so the word embedding is the tied alias.
  CHECK(Tensor(xlmr, "roberta.embeddings.word_embeddings.weight").tied_to ==
        "lm_head.decoder.weight");
  config["model_type"] = "roberta";
  config["architectures"] = {"RobertaForMaskedLM"};
  CHECK(Total(MustBuild(config)) == Total(xlmr));

  nlohmann::json distil = {{"model_type", "distilbert"},
                           {"vocab_size", 11},
                           {"dim", 8},
                           {"n_layers", 2},
                           {"n_heads", 2},
                           {"hidden_dim", 16}};
  ModelInventory mlm = MustBuild(distil);
  CHECK(mlm.architecture == "DistilBertForMaskedLM");
  CHECK(Tensor(mlm, "vocab_projector.weight").tied_to ==
        "distilbert.embeddings.word_embeddings.weight");
  CHECK(Tensor(mlm, "distilbert.transformer.layer.1.ffn.lin1.weight").shape == Shape{16, 8});
  // distilbert-base-uncased: 66,985,530 with its MLM head (Transformers' count).
  distil["dim"] = 768;
  distil["n_layers"] = 6;
  distil["n_heads"] = 12;
  distil["hidden_dim"] = 3072;
  distil["vocab_size"] = 30522;
  CHECK(Total(MustBuild(distil)) == 66'985'530);
  distil["architectures"] = {"DistilBertForQuestionAnswering"};
  distil["num_labels"] = 3;
  CHECK(Mentions(BuildError(distil), "2 labels"));
}

TEST_CASE("encoder: buffers and Accelerate's no-split modules") {
  ModelInventory bert = Fixture("bert-base-uncased");
  REQUIRE(bert.buffers.size() == 2);
  CHECK(bert.buffers[0].name == "bert.embeddings.position_ids");
  CHECK(bert.buffers[0].dtype == DType::kI64);
  CHECK(bert.buffers[0].shape == Shape{1, 512});
  CHECK(bert.no_split_modules.front() == "bert.embeddings");
  CHECK(bert.no_split_modules.size() == 13);
  // Accelerate keeps BertEmbeddings whole: word, position and type tables, LayerNorm and the
  // two int64 id buffers, in fp32.
  ModelCounts counts = Counts(bert);
  CHECK(counts.accelerate_largest_layer == "bert.embeddings");
  CHECK(counts.accelerate_largest_layer_bytes ==
        4ull * (30522 + 512 + 2) * 768 + 4 * 2 * 768 + 2 * 8 * 512);
}

}  // namespace
}  // namespace memplan::estimator
