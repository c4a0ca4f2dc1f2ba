#include "common/strings.h"

#include <doctest/doctest.h>

#include <cstdlib>
#include <string>

namespace memplan {
namespace {

TEST_CASE("strings: LastComponent and BeforeLastComponent split at the last separator") {
  CHECK(LastComponent("model.layers.0.mlp.down_proj", '.') == "down_proj");
  CHECK(BeforeLastComponent("model.layers.0.mlp.down_proj", '.') == "model.layers.0.mlp");
  // No separator: the whole string is the last component, nothing comes before it.
  CHECK(LastComponent("lm_head", '.') == "lm_head");
  CHECK(BeforeLastComponent("lm_head", '.').empty());
  // A separator at either end leaves an empty side.
  CHECK(LastComponent("model.", '.').empty());
  CHECK(BeforeLastComponent("model.", '.') == "model");
  CHECK(LastComponent(".weight", '.') == "weight");
  CHECK(BeforeLastComponent(".weight", '.').empty());
  CHECK(LastComponent("", '.').empty());
  CHECK(BeforeLastComponent("", '.').empty());
  // Only the given separator counts.
  CHECK(LastComponent("a/b.c", '/') == "b.c");
  CHECK(BeforeLastComponent("a/b.c", '/') == "a");
  // Walking a module path up, as the inventory readers do, ends at the empty string.
  std::string walked;
  for (std::string_view m = "a.b.c"; !m.empty(); m = BeforeLastComponent(m, '.')) {
    walked += std::string(m) + "|";
  }
  CHECK(walked == "a.b.c|a.b|a|");
}

TEST_CASE("strings: the views point into the argument") {
  const std::string name = "transformer.h.0.attn.c_attn.weight";
  const std::string_view last = LastComponent(name, '.');
  const std::string_view before = BeforeLastComponent(name, '.');
  CHECK(last.data() == name.data() + name.size() - 6);
  CHECK(before.data() == name.data());
}

TEST_CASE("strings: EndsWith") {
  CHECK(EndsWith("model.safetensors", ".safetensors"));
  CHECK(EndsWith("model.safetensors.index.json", ".safetensors.index.json"));
  CHECK_FALSE(EndsWith("model.safetensors.index.json", ".safetensors"));
  CHECK_FALSE(EndsWith("json", ".json"));  // the suffix is longer than the string
  CHECK(EndsWith("x", ""));
  CHECK(EndsWith("", ""));
  CHECK_FALSE(EndsWith("", "x"));
}

TEST_CASE("strings: BaseName and DirName") {
  CHECK(BaseName("/tmp/run/ds_config.json") == "ds_config.json");
  CHECK(BaseName("ds_config.json") == "ds_config.json");
  CHECK(BaseName("dir/").empty());
  CHECK(DirName("/tmp/run/ds_config.json") == "/tmp/run");
  CHECK(DirName("run/ds_config.json") == "run");
  CHECK(DirName("ds_config.json") == ".");
  CHECK(DirName("/ds_config.json") == "/");
  CHECK(DirName("") == ".");
}

TEST_CASE("strings: EqualsIgnoreCase and EnvOrEmpty") {
  CHECK(EqualsIgnoreCase("Meta-Llama", "meta-llama"));
  CHECK(EqualsIgnoreCase("", ""));
  CHECK_FALSE(EqualsIgnoreCase("llama", "llama2"));
  CHECK_FALSE(EqualsIgnoreCase("llama", "llamb"));
  ::setenv("MEMPLAN_STRINGS_TEST_VAR", "x", 1);
  CHECK(EnvOrEmpty("MEMPLAN_STRINGS_TEST_VAR") == "x");
  ::unsetenv("MEMPLAN_STRINGS_TEST_VAR");
  CHECK(EnvOrEmpty("MEMPLAN_STRINGS_TEST_VAR").empty());
}

}  // namespace
}  // namespace memplan
