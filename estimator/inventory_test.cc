#include "estimator/inventory.h"

#include <doctest/doctest.h>

#include "estimator/estimate.h"
#include "tests/status_testing.h"

namespace memplan::estimator {
namespace {

TEST_CASE("inventory: module, block and layer come from the name") {
  std::string module, block;
  int layer = 0;
  DeriveModulePath("model.layers.12.self_attn.q_proj.weight", &module, &block, &layer);
  CHECK(module == "model.layers.12.self_attn.q_proj");
  CHECK(block == "model.layers.12");
  CHECK(layer == 12);
  DeriveModulePath("encoder.block.0.layer.1.DenseReluDense.wi.weight", &module, &block, &layer);
  CHECK(block == "encoder.block.0");
  CHECK(layer == 0);
  DeriveModulePath("lm_head.weight", &module, &block, &layer);
  CHECK(module == "lm_head");
  CHECK(block.empty());
  CHECK(layer == -1);
  DeriveModulePath("bias", &module, &block, &layer);
  CHECK(module.empty());
}

TEST_CASE("inventory: tied tensors count once in totals, in every module for DeepSpeed's L") {
  ModelInventory inv;
  inv.name = "tiny";
  REQUIRE_OK(inv.Add("wte.weight", {100, 8}));
  REQUIRE_OK(inv.Add("h.0.fc.weight", {8, 32}, DType::kBF16));
  REQUIRE_OK(inv.Add("h.0.fc.bias", {32}, DType::kBF16));
  REQUIRE_OK(inv.Add("h.1.fc.weight", {8, 32}));
  REQUIRE_OK(inv.Add("lm_head.weight", {100, 8}, DType::kF32, "wte.weight"));
  auto counts = CountParams(inv);
  REQUIRE_OK(counts);
  CHECK(counts->params_total == 800 + 256 + 32 + 256);
  CHECK(counts->largest_layer_params == 800);
  CHECK(counts->largest_layer_module == "wte");  // ties go to the first module registered
  CHECK(counts->largest_block_params == 288);
  CHECK(counts->largest_block == "h.0");
  CHECK(counts->num_blocks == 2);
  CHECK(counts->num_tensors == 5);
  CHECK(counts->num_tied == 1);
  CHECK(counts->bytes_as_stored == 800 * 4 + 288 * 2 + 256 * 4);
}

TEST_CASE("inventory: Accelerate's largest layer keeps no-split modules whole") {
  ModelInventory inv;
  inv.name = "tiny";
  REQUIRE_OK(inv.Add("embed.weight", {10, 4}));           // 40 elements, a leaf
  REQUIRE_OK(inv.Add("layers.0.attn.q.weight", {4, 4}));  // layer 0: 16 + 16 + 4
  REQUIRE_OK(inv.Add("layers.0.mlp.up.weight", {4, 4}));
  REQUIRE_OK(inv.Add("layers.0.norm.weight", {4}));
  REQUIRE_OK(inv.Add("layers.1.attn.q.weight", {4, 4}));
  // A parameter of a module that also has submodules is never a layer (BERT's
  // cls.predictions.bias), and a tied alias counts once, under its first name.
  REQUIRE_OK(inv.Add("head.bias", {100}));
  REQUIRE_OK(inv.Add("head.decoder.weight", {10, 4}, DType::kF32, "embed.weight"));
  REQUIRE_OK(inv.AddBuffer("rotary.inv_freq", {2}));
  REQUIRE_OK(inv.AddBuffer("embed.ids", {1, 3}, DType::kI64));
  inv.no_split_modules = {"layers.0", "layers.1"};
  auto count = [&] {
    Result<ModelCounts> c = CountParams(inv);
    REQUIRE_OK(c);
    return *c;
  };
  ModelCounts counts = count();
  CHECK(counts.buffers_total == 5);
  CHECK(counts.accelerate_total_bytes == 4 * (40 + 36 + 16 + 100 + 2) + 8 * 3);
  // embed (40 x 4 + its 3 int64 ids = 184 bytes) beats layers.0 (36 x 4 = 144 bytes).
  CHECK(counts.accelerate_largest_layer == "embed");
  CHECK(counts.accelerate_largest_layer_bytes == 40 * 4 + 3 * 8);
  // Without no-split modules each leaf stands alone; head.bias is still never a layer.
  inv.no_split_modules.clear();
  counts = count();
  CHECK(counts.accelerate_largest_layer == "embed");
  inv.no_split_modules = {"layers"};  // the whole stack as one
  counts = count();
  CHECK(counts.accelerate_largest_layer == "layers");
  CHECK(counts.accelerate_largest_layer_bytes == (36 + 16) * 4);
}

TEST_CASE("inventory: bad tensors are refused with the tensor's name") {
  ModelInventory inv;
  Status s = inv.Add("a.weight", {4, -1});
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(s.message().find("a.weight") != std::string::npos);
  s = inv.Add("b.weight", {int64_t{1} << 40, int64_t{1} << 40});
  CHECK(s.code() == StatusCode::kOutOfRange);
  s = inv.Add("c.weight", {4}, DType::kF32, "missing.weight");
  CHECK(s.code() == StatusCode::kInvalidArgument);
  REQUIRE_OK(inv.Add("d.weight", {4}));
  CHECK_FALSE(inv.Add("e.weight", {5}, DType::kF32, "d.weight").ok());  // shape differs
  CHECK(inv.Add("", {1}).code() == StatusCode::kInvalidArgument);
}

TEST_CASE("inventory: parameter totals that overflow 64 bits are errors") {
  ModelInventory inv;
  REQUIRE_OK(inv.Add("a", {int64_t{1} << 62}));
  REQUIRE_OK(inv.Add("b", {int64_t{1} << 62}));
  REQUIRE_OK(inv.Add("c", {int64_t{1} << 62}));
  REQUIRE_OK(inv.Add("d", {int64_t{1} << 62}));
  CHECK(CountParams(inv).status().code() == StatusCode::kOutOfRange);
}

TEST_CASE("inventory: dtype spellings") {
  CHECK(*ParseDType("BF16") == DType::kBF16);
  CHECK(*ParseDType("torch.bfloat16") == DType::kBF16);
  CHECK(*ParseDType("float16") == DType::kF16);
  CHECK(*ParseDType("F8_E4M3") == DType::kF8E4M3);
  CHECK_FALSE(ParseDType("complex64").ok());
  CHECK(DTypeBits(DType::kBF16) == 16);
}

TEST_CASE("estimate: JSON round-trips and keeps the public schema") {
  ModelInventory inv;
  inv.name = "tiny";
  inv.model_type = "gpt2";
  inv.architecture = "GPT2Model";
  inv.model_class = "base";
  inv.source = "config";
  REQUIRE_OK(inv.Add("wte.weight", {1000, 64}));
  REQUIRE_OK(inv.Add("h.0.mlp.weight", {64, 256}));
  auto e = EstimateModelStates(inv, DeepSpeedHardware{.nodes = 2, .gpus_per_node = 4});
  REQUIRE_OK(e);
  nlohmann::json j = ToJson(*e);
  CHECK(j["model"]["params_total"] == 80384);
  CHECK(j["model"]["largest_layer_params"] == 64000);
  CHECK(j["model"]["model_class"] == "base");
  CHECK(j["hardware"]["nodes"] == 2);
  CHECK(j["hardware"]["gpus_per_node"] == 4);
  REQUIRE(j["deepspeed"]["zero2"].size() == 2);
  REQUIRE(j["deepspeed"]["zero3"].size() == 6);
  CHECK(j["deepspeed"]["zero3"][0]["offload_param"] == "cpu");
  CHECK(j["deepspeed"]["zero3"][0]["zero_init"] == 1);
  CHECK(j["deepspeed"]["zero3"][4]["offload_optimizer"] == "none");
  auto back = EstimateFromJson(j);
  REQUIRE_OK(back);
  CHECK(ToJson(*back) == j);
  nlohmann::json broken = j;
  broken["deepspeed"]["zero3"][1].erase("cpu_bytes");
  auto bad = EstimateFromJson(broken);
  CHECK(bad.status().message() == "estimate JSON: 'deepspeed.zero3[1].cpu_bytes' is missing");
  broken = j;
  broken["deepspeed"]["zero2"][0]["offload_optimizer"] = "disk";
  CHECK(EstimateFromJson(broken).status().message() ==
        "estimate JSON: 'deepspeed.zero2[0].offload_optimizer' must be \"cpu\" or \"none\"");
  broken = j;
  broken["model"]["params_total"] = "many";
  CHECK(EstimateFromJson(broken).status().message().find(
            "estimate JSON: 'model.params_total' must be an integer") == 0);
  broken = j;
  broken["deepspeed"].erase("zero2");
  CHECK(EstimateFromJson(broken).status().message() ==
        "estimate JSON: 'deepspeed.zero2' must be a list");
}

TEST_CASE("estimate: a model with no parameters is an error") {
  ModelInventory inv;
  inv.name = "empty";
  CHECK(EstimateModelStates(inv, DeepSpeedHardware{}).status().code() ==
        StatusCode::kInvalidArgument);
}

TEST_CASE("estimate: thousands separators") {
  CHECK(WithThousands(0) == "0");
  CHECK(WithThousands(999) == "999");
  CHECK(WithThousands(1000) == "1,000");
  CHECK(WithThousands(6738415616) == "6,738,415,616");
}

}  // namespace
}  // namespace memplan::estimator
