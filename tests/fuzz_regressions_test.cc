// Replays every fuzz seed (fuzz/corpus/<target>/) and every input that once crashed a fuzz target
// (fuzz/regressions/<target>/) through the targets' own code (fuzz/fuzz_targets.cc), so the
// ordinary test suite, with any compiler and under the sanitizer job, keeps them fixed. Each input
// must finish with a Status (parsers' errors are expected) well within the fuzzers' timeout.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <string>
#include <vector>

#include "common/json.h"
#include "estimator/model_source.h"
#include "estimator/safetensors.h"
#include "fuzz/fuzz_targets.h"
#include "tests/testing.h"

namespace memplan::fuzz {
namespace {

namespace fs = std::filesystem;

using TargetFn = Status (*)(std::string_view);

// The files of fuzz/<kind>/<target>/, sorted so a failure names the same file every run.
std::vector<fs::path> Inputs(const std::string& kind, const std::string& target) {
  std::vector<fs::path> out;
  const fs::path dir = fs::path(MEMPLAN_SOURCE_DIR) / "fuzz" / kind / target;
  if (!fs::is_directory(dir)) return out;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.is_regular_file()) out.push_back(entry.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Runs every input of `target`; returns how many there were.
size_t Replay(const std::string& target, TargetFn fn) {
  size_t count = 0;
  for (const char* kind : {"corpus", "regressions"}) {
    for (const fs::path& path : Inputs(kind, target)) {
      CAPTURE(path.string());
      const std::string bytes = testing::ReadWholeFile(path);
      const auto start = std::chrono::steady_clock::now();
      Status status = fn(bytes);
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      CHECK_MESSAGE(status.ok(), status.ToString());
      CHECK(seconds < 10.0);  // the fuzzers' -timeout
      ++count;
    }
  }
  return count;
}

TEST_CASE("fuzz regressions: config.json inputs") { CHECK(Replay("hf_config", &HfConfigOne) > 0); }

TEST_CASE("fuzz regressions: shape-list inputs") { CHECK(Replay("shape_list", &ShapeListOne) > 0); }

TEST_CASE("fuzz regressions: safetensors inputs") {
  CHECK(Replay("safetensors", &SafetensorsOne) > 0);
}

TEST_CASE("fuzz regressions: DeepSpeed config inputs") {
  CHECK(Replay("deepspeed_config", &DeepSpeedConfigOne) > 0);
}

TEST_CASE("fuzz regressions: DeepSpeed config checker inputs") {
  CHECK(Replay("deepspeed_check", &DeepSpeedCheckOne) > 0);
}

TEST_CASE("fuzz regressions: Accelerate config checker inputs") {
  CHECK(Replay("accelerate_check", &AccelerateCheckOne) > 0);
}

TEST_CASE("fuzz regressions: swap index inputs") { CHECK(Replay("swap_index", &SwapIndexOne) > 0); }

TEST_CASE("fuzz regressions: command lines") { CHECK(Replay("cli", &CliOne) > 0); }

TEST_CASE("fuzz regressions: check's batch arithmetic") {
  CHECK(Replay("check_arithmetic", &CheckArithmeticOne) > 0);
}

TEST_CASE("fuzz regressions: launch scripts from hostile fields") {
  CHECK(Replay("launch_script", &LaunchScriptOne) > 0);
}

// Found by checking that the size-limit test fails without the limit, not by a fuzzer: nlohmann
// stops at a NUL byte as at the end of the input, so a file read the bytes after it as nothing.
TEST_CASE("fuzz regressions: a NUL byte in JSON is an error, not the end of the document") {
  const fs::path dir = fs::path(MEMPLAN_SOURCE_DIR) / "fuzz" / "regressions";
  const std::string config = (dir / "hf_config" / "nul_then_garbage.json").string();
  auto model = estimator::LoadModel(config, estimator::ModelClassChoice::kFromArchitectures);
  REQUIRE_FALSE(model.ok());
  CHECK(model.status().message() == config + ": invalid JSON: NUL byte at offset 145");

  const std::string shard = (dir / "safetensors" / "nul_in_header.safetensors").string();
  auto header = estimator::InventoryFromSafetensorsFile(shard);
  REQUIRE_FALSE(header.ok());
  CHECK(header.status().message() == shard + ": invalid JSON: NUL byte at offset 54");

  const std::string ds = testing::ReadWholeFile(dir / "deepspeed_config" / "nul_then_garbage.json");
  auto parsed = ParseJson(ds, "ds_config.json");
  REQUIRE_FALSE(parsed.ok());
  CHECK(parsed.status().message() == "ds_config.json: invalid JSON: NUL byte at offset 35");
  CHECK(ParseOrderedJsonText(ds, "ds_config.json", 64).status().message() ==
        "ds_config.json: invalid JSON: NUL byte at offset 35");
}

}  // namespace
}  // namespace memplan::fuzz
