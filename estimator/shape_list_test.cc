#include "estimator/shape_list.h"

#include <doctest/doctest.h>

#include <string>
#include <vector>
#include "tests/status_testing.h"

namespace memplan::estimator {
namespace {

const std::string kSource = "shapes.json";

ModelInventory MustRead(std::string_view text) {
  auto inv = InventoryFromShapeListText(text, kSource);
  INFO(inv.status().ToString());
  REQUIRE_OK(inv);
  return std::move(inv).value();
}

std::vector<std::string> Names(const ModelInventory& inv) {
  std::vector<std::string> out;
  for (const TensorInfo& t : inv.tensors) out.push_back(t.name);
  return out;
}

// The error message, or a marker that makes the test fail when the read succeeded.
std::string ErrorOf(std::string_view text) {
  auto inv = InventoryFromShapeListText(text, kSource);
  return inv.ok() ? std::string("<no error>") : inv.status().message();
}

TEST_CASE("source: shape list as a name -> dims map keeps document order") {
  // Out of alphabetical order on purpose: nlohmann::json would sort "h.10" before "h.2".
  ModelInventory inv = MustRead(R"({
    "wte.weight": [50257, 768],
    "h.2.attn.weight": [768, 2304],
    "h.10.attn.weight": [768, 2304],
    "h.10.attn.bias": [2304],
    "ln_f.scale": []
  })");
  CHECK(inv.source == "shape-list");
  CHECK(inv.name == "shapes.json");
  CHECK(inv.model_type.empty());
  CHECK(Names(inv) == std::vector<std::string>{"wte.weight", "h.2.attn.weight", "h.10.attn.weight",
                                               "h.10.attn.bias", "ln_f.scale"});
  CHECK(inv.tensors[0].shape == std::vector<int64_t>{50257, 768});
  CHECK(inv.tensors[0].dtype == DType::kF32);
  CHECK(inv.tensors[2].layer == 10);
  CHECK(inv.tensors[2].block == "h.10");
  CHECK(inv.tensors[4].shape.empty());
  CHECK(inv.tensors[4].numel == 1);

  auto counts = CountParams(inv);
  REQUIRE_OK(counts);
  CHECK(counts->params_total == 50257ull * 768 + 2 * 768 * 2304 + 2304 + 1);
  CHECK(counts->num_tensors == 5);
  CHECK(counts->num_blocks == 2);
  CHECK(counts->bytes_as_stored == counts->params_total * 4);
}

TEST_CASE("source: shape list object entries carry dtype and tied_to") {
  ModelInventory inv = MustRead(R"({
    "transformer.wte.weight": {"shape": [1000, 64], "dtype": "bf16"},
    "transformer.h.0.mlp.weight": {"shape": [64, 256], "dtype": "torch.float16"},
    "transformer.h.0.mlp.bias": [256],
    "lm_head.weight": {"shape": [1000, 64], "dtype": "BF16", "tied_to": "transformer.wte.weight"}
  })");
  REQUIRE(inv.tensors.size() == 4);
  CHECK(inv.tensors[0].dtype == DType::kBF16);
  CHECK(inv.tensors[1].dtype == DType::kF16);
  CHECK(inv.tensors[2].dtype == DType::kF32);
  CHECK(inv.tensors[3].tied_to == "transformer.wte.weight");
  auto counts = CountParams(inv);
  REQUIRE_OK(counts);
  CHECK(counts->params_total == 1000 * 64 + 64 * 256 + 256);  // the tie counted once
  CHECK(counts->num_tied == 1);
  CHECK(counts->bytes_as_stored == 1000 * 64 * 2 + 64 * 256 * 2 + 256 * 4);
}

TEST_CASE("source: shape list as an array of objects, tied alias before its target") {
  ModelInventory inv = MustRead(R"([
    {"name": "lm_head.weight", "shape": [10, 4], "tied_to": "embed.weight"},
    {"name": "embed.weight", "shape": [10, 4], "dtype": "float16"},
    {"name": "layers.0.w", "shape": [4, 4]}
  ])");
  // The alias waits for its target; everything else keeps document order.
  CHECK(Names(inv) == std::vector<std::string>{"embed.weight", "lm_head.weight", "layers.0.w"});
  CHECK(inv.tensors[1].tied_to == "embed.weight");
  auto counts = CountParams(inv);
  REQUIRE_OK(counts);
  CHECK(counts->params_total == 40 + 16);
}

TEST_CASE("source: shape list wrapper with model_type, default dtype and tied map") {
  ModelInventory inv = MustRead(R"({
    "model_type": "my_arch",
    "dtype": "bfloat16",
    "tensors": {"embed.weight": [32, 8], "blocks.0.w": [8, 8], "blocks.1.w": [8, 8],
                "head.weight": {"shape": [32, 8], "dtype": "f32"}},
    "tied": {"head.weight": "embed.weight", "decoder.embed.weight": "embed.weight"}
  })");
  CHECK(inv.model_type == "my_arch");
  CHECK(Names(inv) == std::vector<std::string>{"embed.weight", "blocks.0.w", "blocks.1.w",
                                               "head.weight", "decoder.embed.weight"});
  CHECK(inv.tensors[0].dtype == DType::kBF16);
  CHECK(inv.tensors[3].dtype == DType::kF32);
  CHECK(inv.tensors[3].tied_to == "embed.weight");
  // An alias absent from the list takes its target's shape and dtype.
  CHECK(inv.tensors[4].shape == std::vector<int64_t>{32, 8});
  CHECK(inv.tensors[4].dtype == DType::kBF16);
  CHECK(inv.tensors[4].tied_to == "embed.weight");
  auto counts = CountParams(inv);
  REQUIRE_OK(counts);
  CHECK(counts->params_total == 32 * 8 + 2 * 64);
  CHECK(counts->num_tied == 2);
  CHECK(counts->num_blocks == 2);

  ModelInventory arr = MustRead(R"({"tensors": [{"name": "a.w", "shape": [3]}]})");
  CHECK(Names(arr) == std::vector<std::string>{"a.w"});
}

TEST_CASE("source: shape list accepts integral floats and a tensor literally named tensors") {
  ModelInventory inv = MustRead(R"({"tensors": [4, 2.0], "x": [1]})");
  CHECK(Names(inv) == std::vector<std::string>{"tensors", "x"});
  CHECK(inv.tensors[0].shape == std::vector<int64_t>{4, 2});
}

TEST_CASE("source: shape list errors name the source and the tensor") {
  CHECK(ErrorOf(R"({"h.0.w": [4, -3]})") ==
        "shapes.json: tensor 'h.0.w': dim 1 is -3, must be >= 0");
  CHECK(ErrorOf(R"({"h.0.w": [4, 2.5]})") ==
        "shapes.json: tensor 'h.0.w': dim 1 is 2.5, must be an integer");
  CHECK(ErrorOf(R"({"h.0.w": ["4"]})") ==
        "shapes.json: tensor 'h.0.w': dim 0 is \"4\", must be an integer");
  CHECK(ErrorOf(R"({"h.0.w": [true]})") ==
        "shapes.json: tensor 'h.0.w': dim 0 is true, must be an integer");
  CHECK(ErrorOf(R"({"h.0.w": [2147483648]})") ==
        "shapes.json: tensor 'h.0.w': dim 0 is 2147483648, above the limit of 2147483647");
  CHECK(ErrorOf(R"({"h.0.w": [1e300]})").find("tensor 'h.0.w': dim 0 is") != std::string::npos);
  CHECK(ErrorOf(R"({"h.0.w": [-1e300]})").find("must be >= 0") != std::string::npos);
  // Each dim is legal; the product is not.
  std::string overflow = ErrorOf(R"({"big": [2147483647, 2147483647, 2147483647]})");
  CHECK(overflow == "shapes.json: tensor 'big': number of elements overflows 64 bits");
  CHECK(ErrorOf(R"({"w": {"shape": [2], "dtype": "float13"}})")
            .find("shapes.json: tensor 'w': unknown dtype 'float13'") == 0);
  CHECK(ErrorOf(R"({"w": {"shape": [2], "dtpye": "bf16"}})") ==
        "shapes.json: tensor 'w': unknown key 'dtpye' (expected shape, dtype, tied_to)");
  CHECK(ErrorOf(R"({"w": {"dtype": "bf16"}})") == "shapes.json: tensor 'w': has no \"shape\"");
  CHECK(ErrorOf(R"({"w": 5})").find("shapes.json: tensor 'w': expected a list of dims") == 0);
  CHECK(ErrorOf(R"({"w": {"shape": 5}})").find("shapes.json: tensor 'w': shape must be") == 0);
}

TEST_CASE("source: shape list refuses empty lists, missing tie targets, cycles, duplicates") {
  CHECK(ErrorOf("{}").find("shapes.json: no tensors") == 0);
  CHECK(ErrorOf("[]").find("shapes.json: no tensors") == 0);
  CHECK(ErrorOf(R"({"tensors": {}})").find("shapes.json: no tensors") == 0);
  CHECK(ErrorOf(R"({"a": [2], "b": {"shape": [2], "tied_to": "c"}})") ==
        "shapes.json: tensor 'b': tied_to 'c' names no tensor in the list");
  CHECK(ErrorOf(R"({"tensors": {"a": [2]}, "tied": {"b": "c"}})") ==
        "shapes.json: field 'tied': 'b' is tied to 'c', which is not in the tensor list");
  CHECK(ErrorOf(R"({"a": {"shape": [2], "tied_to": "b"}, "b": {"shape": [2], "tied_to": "a"}})")
            .find("shapes.json: tensor 'a': tied_to 'b' forms a cycle") == 0);
  CHECK(ErrorOf(R"({"a": {"shape": [2], "tied_to": "a"}})") ==
        "shapes.json: tensor 'a': is tied to itself");
  CHECK(ErrorOf(R"({"a": [2], "b": {"shape": [3], "tied_to": "a"}})") ==
        "shapes.json: tensor 'b' is tied to 'a' but has a different shape");
  CHECK(ErrorOf(R"({"a": [2], "a": [3]})").find("shapes.json: key 'a' appears twice") == 0);
  // Past the size where repeated keys are found by a hash set rather than a scan.
  std::string many = "{";
  for (int i = 0; i < 40; ++i) many += "\"t" + std::to_string(i) + "\": [1], ";
  CHECK(ErrorOf(many + "\"t3\": [1]}") == "shapes.json: key 't3' appears twice in one JSON object");
  CHECK(MustRead(many + "\"t40\": [1]}").tensors.size() == 41);
  CHECK(ErrorOf(R"([{"name": "a", "shape": [2]}, {"name": "a", "shape": [2]}])") ==
        "shapes.json: tensor 'a': is listed twice");
  CHECK(ErrorOf(R"([{"shape": [2]}])").find("shapes.json: entry 0: expected an object") == 0);
  CHECK(ErrorOf(R"({"tensors": {"a": [2]}, "tide": {}})")
            .find("shapes.json: unknown top-level key 'tide'") == 0);
  CHECK(ErrorOf("{\"a\": [2]").find("shapes.json: invalid JSON") == 0);
  CHECK(ErrorOf(R"({"model_type": "llama", "hidden_size": 8})").find("looks like a config.json") !=
        std::string::npos);
}

TEST_CASE("source: shape list refuses deep nesting before parsing") {
  std::string deep = "{\"a\": " + std::string(100000, '[') + std::string(100000, ']') + "}";
  std::string err = ErrorOf(deep);
  CHECK(err == "shapes.json: JSON nested 100001 levels deep (limit 64)");
  // Brackets inside strings do not count.
  std::string name(200, '[');
  ModelInventory inv = MustRead("{\"" + name + "\": [1]}");
  CHECK(inv.tensors[0].name == name);
}

TEST_CASE("source: LooksLikeShapeList tells shape lists from config.json") {
  using nlohmann::json;
  CHECK_FALSE(LooksLikeShapeList(json::parse(
      R"({"model_type": "llama", "hidden_size": 4096, "architectures": ["LlamaForCausalLM"]})")));
  CHECK_FALSE(LooksLikeShapeList(json::parse(R"({"hidden_size": 4096})")));
  CHECK_FALSE(LooksLikeShapeList(json::parse("{}")));
  CHECK_FALSE(LooksLikeShapeList(json::parse("[]")));
  CHECK_FALSE(LooksLikeShapeList(json::parse("5")));
  CHECK(LooksLikeShapeList(json::parse(R"({"a.weight": [4, 4], "b": {"shape": [4]}})")));
  CHECK(LooksLikeShapeList(json::parse(R"([{"name": "a", "shape": [1]}])")));
  CHECK(LooksLikeShapeList(json::parse(R"({"model_type": "x", "tensors": {"a": [1]}})")));
  // A malformed shape list still routes here, where its error is the useful one.
  CHECK(LooksLikeShapeList(json::parse(R"({"a.weight": [4, "x"]})")));
  CHECK(LooksLikeShapeList(nlohmann::ordered_json::parse(R"({"a": [1]})")));
}

TEST_CASE("source: shape list from a parsed nlohmann::json document") {
  auto doc = nlohmann::json::parse(R"({"b.w": [2, 3], "a.w": {"shape": [3], "dtype": "i8"}})");
  auto inv = InventoryFromShapeList(doc, "mem");
  REQUIRE_OK(inv);
  // nlohmann::json has already sorted the keys; the tensors are all there.
  CHECK(Names(*inv) == std::vector<std::string>{"a.w", "b.w"});
  CHECK(inv->tensors[0].dtype == DType::kI8);
  auto bad = InventoryFromShapeList(nlohmann::json::parse(R"({"w": [-1]})"), "mem");
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.status().message() == "mem: tensor 'w': dim 0 is -1, must be >= 0");
}

}  // namespace
}  // namespace memplan::estimator
