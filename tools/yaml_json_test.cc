#include "tools/yaml_json.h"

#include <doctest/doctest.h>

#include <fstream>
#include <iterator>
#include <string>

#include "tests/status_testing.h"

namespace memplan::tools {
namespace {

nlohmann::json Yaml(const std::string& text) {
  auto j = ParseYamlAsJson(text, "a.yaml");
  REQUIRE_OK(j);
  return *j;
}

std::string YamlError(const std::string& text) {
  auto j = ParseYamlAsJson(text, "a.yaml");
  REQUIRE_FALSE(j.ok());
  return j.status().message();
}

TEST_CASE("yaml: an Accelerate config reads as PyYAML's safe_load reads it") {
  const nlohmann::json j = Yaml(
      "compute_environment: LOCAL_MACHINE\n"
      "debug: false\n"
      "distributed_type: FSDP\n"
      "downcast_bf16: 'no'\n"
      "fsdp_config:\n"
      "  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n"
      "  fsdp_offload_params: false\n"
      "  fsdp_sharding_strategy: 1\n"
      "  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer\n"
      "gpu_ids: all\n"
      "mixed_precision: bf16   # a comment\n"
      "num_processes: 8\n"
      "tpu_env: []\n"
      "main_process_ip: 10.0.0.1\n"
      "learning_rate: 1.5\n");
  CHECK(j["debug"] == false);
  CHECK(j["downcast_bf16"] == "no");  // quoted: a string, not the boolean `no` is
  CHECK(j["fsdp_config"]["fsdp_offload_params"] == false);
  CHECK(j["fsdp_config"]["fsdp_sharding_strategy"] == 1);
  CHECK(j["fsdp_config"]["fsdp_sharding_strategy"].is_number_integer());
  CHECK(j["num_processes"] == 8);
  CHECK(j["tpu_env"] == nlohmann::json::array());
  CHECK(j["mixed_precision"] == "bf16");
  CHECK(j["main_process_ip"] == "10.0.0.1");
  CHECK(j["learning_rate"] == 1.5);
}

TEST_CASE("yaml: plain scalars resolve by YAML 1.1's implicit types") {
  const nlohmann::json j = Yaml(
      "a: yes\nb: Off\nc: 0x1F\nd: 017\ne: 1_000\nf: 1:30\ng: 1e5\nh: 1.0e+2\ni: ~\nj:\n"
      "k: 'yes'\nl: !!str 12\nm: -7\nn: 0b101\no: 1.0e5\np: .5\nq: \"on\"\n");
  CHECK(j["a"] == true);
  CHECK(j["b"] == false);
  CHECK(j["c"] == 31);
  CHECK(j["d"] == 15);  // octal, as YAML 1.1
  CHECK(j["e"] == 1000);
  CHECK(j["f"] == 90);       // base 60
  CHECK(j["g"] == "1e5");    // no dot: a string to PyYAML
  CHECK(j["h"] == 100.0);    // the exponent's sign is needed
  CHECK(j["o"] == "1.0e5");  // ... or it is a string
  CHECK(j["i"].is_null());
  CHECK(j["j"].is_null());
  CHECK(j["k"] == "yes");
  CHECK(j["l"] == "12");
  CHECK(j["m"] == -7);
  CHECK(j["n"] == 5);
  CHECK(j["p"] == 0.5);
  CHECK(j["q"] == "on");
}

TEST_CASE("yaml: anchors, aliases and merge keys, as safe_load reads them") {
  const nlohmann::json j = Yaml(
      "base: &b {fsdp_version: 2, fsdp_offload_params: true}\n"
      "fsdp_config:\n  <<: *b\n  fsdp_offload_params: false\n"
      "list: [*b, *b]\n");
  CHECK(j["fsdp_config"]["fsdp_version"] == 2);
  CHECK(j["fsdp_config"]["fsdp_offload_params"] == false);  // the mapping's own key wins
  CHECK(j["list"][1]["fsdp_version"] == 2);
  CHECK(YamlError("a: *nope\n").find("names no anchor") != std::string::npos);
  CHECK(YamlError("a: {<<: 3}\n").find("merge key") != std::string::npos);
}

TEST_CASE("yaml: what safe_load refuses, or memplan will not guess, is an error with the line") {
  CHECK(YamlError("a: 1\nb: [1, 2\n").find("a.yaml:") == 0);
  CHECK(YamlError("a: 1\nb: 2\na: 3\n").find("a.yaml:3: repeats the key 'a'") == 0);
  CHECK(YamlError("a: !!python/object:os.system x\n").find("refuses") != std::string::npos);
  CHECK(YamlError("a: 99999999999999999999\n").find("outside 64 bits") != std::string::npos);
  CHECK(YamlError("a: .inf\n").find("not finite") != std::string::npos);
  CHECK(YamlError("a: 1\n---\nb: 2\n").find("more than one YAML document") != std::string::npos);
  CHECK(YamlError(std::string("a: 1\n\0", 6)).find("NUL") != std::string::npos);
  // Bytes that are not UTF-8 (a fuzz find: they reached a JSON dump, which threw).
  CHECK(YamlError("distributed_type: \"DEE\xedPSPEED\"\n").find("not UTF-8 at offset 22") !=
        std::string::npos);
  CHECK(Yaml("a: \"\xc3\xa9\"")["a"] == "\xc3\xa9");
  // Nested aliases expand exponentially ("a billion laughs"): bounded.
  std::string laughs = "a: &a [x, x, x, x, x, x, x, x, x, x]\n";
  for (char c = 'b'; c <= 'j'; ++c) {
    const std::string prev(1, static_cast<char>(c - 1));
    laughs += std::string(1, c) + ": &" + c + " [*" + prev + ", *" + prev + ", *" + prev + ", *" +
              prev + ", *" + prev + ", *" + prev + ", *" + prev + ", *" + prev + ", *" + prev +
              ", *" + prev + "]\n";
  }
  CHECK(YamlError(laughs).find("aliases") != std::string::npos);
  std::string deep;
  for (int i = 0; i < 100; ++i) deep += "[";
  CHECK(YamlError(deep + std::string(100, ']')).find("deeper") != std::string::npos);
  CHECK(Yaml("-9223372036854775808") == INT64_MIN);
  CHECK(YamlError("a: 99999999999999999999:30\n").find("outside 64 bits") != std::string::npos);
  CHECK(YamlError("a: 9223372036854775808\n").find("outside 64 bits") != std::string::npos);
  CHECK(Yaml("").is_null());
  CHECK(Yaml("# only a comment\n").is_null());
  // A broken flow mapping the fuzzer wrote (482 bytes) made yaml-cpp take minutes and gigabytes;
  // libyaml stops where PyYAML does.
  std::ifstream broken(std::string(MEMPLAN_SOURCE_DIR) +
                       "/fuzz/regressions/accelerate_check/timeout-yaml-cpp-broken-flow-mapping");
  const std::string text((std::istreambuf_iterator<char>(broken)),
                         std::istreambuf_iterator<char>());
  REQUIRE(text.size() == 482);
  CHECK(YamlError(text).find("a.yaml:4: not YAML: did not find expected <document start>") == 0);
  std::string nested = "a: ";
  for (int i = 0; i < 5000; ++i) nested += "[";
  CHECK(YamlError(nested).find("nested deeper than 64 levels") != std::string::npos);
  std::string keys;
  for (int i = 0; keys.size() <= kMaxYamlBytes; ++i) keys += "k" + std::to_string(i) + ": 1\n";
  CHECK(YamlError(keys).find("a YAML config may have") != std::string::npos);
}

}  // namespace
}  // namespace memplan::tools
