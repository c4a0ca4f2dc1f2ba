#include "estimator/hf_cache.h"

#include <doctest/doctest.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tests/testing.h"
#include "tests/status_testing.h"

namespace memplan::estimator {
namespace {

namespace fs = std::filesystem;

using testing::TempDir;

// Prefix of each test case's scratch directory.
constexpr std::string_view kTempPrefix = "memplan_hf_cache_";

// Clears every variable the lookup reads and puts them all back afterwards, so a developer's
// real cache never leaks into (or is touched by) a test.
class ScopedCacheEnv {
 public:
  ScopedCacheEnv() {
    for (const char* name : kNames) {
      const char* value = std::getenv(name);
      saved_.emplace_back(name,
                          value == nullptr ? std::nullopt : std::optional(std::string(value)));
      ::unsetenv(name);
    }
  }
  ~ScopedCacheEnv() {
    for (const auto& [name, value] : saved_) {
      if (value) {
        ::setenv(name, value->c_str(), 1);
      } else {
        ::unsetenv(name);
      }
    }
  }
  ScopedCacheEnv(const ScopedCacheEnv&) = delete;
  ScopedCacheEnv& operator=(const ScopedCacheEnv&) = delete;

  void Set(const char* name, const std::string& value) { ::setenv(name, value.c_str(), 1); }

 private:
  static constexpr const char* kNames[] = {"HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE",
                                           "HF_HOME",      "XDG_CACHE_HOME",
                                           "HOME",         "TRANSFORMERS_CACHE"};
  std::vector<std::pair<const char*, std::optional<std::string>>> saved_;
};

void WriteFile(const fs::path& path, const std::string& text) {
  fs::create_directories(path.parent_path());
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  REQUIRE(f.good());
  f << text;
  REQUIRE(f.good());
}

// A snapshot directory holding a config.json, with a chosen modification time.
fs::path MakeSnapshot(const fs::path& repo_dir, const std::string& revision, int age_s) {
  fs::path snapshot = repo_dir / "snapshots" / revision;
  WriteFile(snapshot / "config.json", R"({"model_type": "gpt2"})");
  fs::last_write_time(snapshot, fs::file_time_type::clock::now() - std::chrono::seconds(age_s));
  return snapshot;
}

const std::string kHash = "0123456789abcdef0123456789abcdef01234567";
const std::string kOtherHash = "fedcba9876543210fedcba9876543210fedcba98";

TEST_CASE("source: HfCacheRoots follows the Hugging Face order of variables") {
  ScopedCacheEnv env;
  CHECK(HfCacheRoots().empty());
  env.Set("HOME", "/home/u");
  CHECK(HfCacheRoots() == std::vector<std::string>{"/home/u/.cache/huggingface/hub"});
  env.Set("XDG_CACHE_HOME", "/xdg");
  CHECK(HfCacheRoots() == std::vector<std::string>{"/xdg/huggingface/hub"});
  env.Set("HF_HOME", "/hf");
  CHECK(HfCacheRoots() == std::vector<std::string>{"/hf/hub"});
  env.Set("HUGGINGFACE_HUB_CACHE", "/legacy-hub");
  CHECK(HfCacheRoots() == std::vector<std::string>{"/legacy-hub"});
  env.Set("HF_HUB_CACHE", "/hub");
  CHECK(HfCacheRoots() == std::vector<std::string>{"/hub"});
  env.Set("TRANSFORMERS_CACHE", "/tf");
  CHECK(HfCacheRoots() == std::vector<std::string>{"/hub", "/tf"});
  // Empty means unset, as in huggingface_hub.
  env.Set("HF_HUB_CACHE", "");
  env.Set("HUGGINGFACE_HUB_CACHE", "");
  CHECK(HfCacheRoots() == std::vector<std::string>{"/hf/hub", "/tf"});
}

TEST_CASE("source: FindHfCacheSnapshot follows refs/main") {
  ScopedCacheEnv env;
  TempDir dir(kTempPrefix);
  env.Set("HF_HUB_CACHE", dir.path().string());
  fs::path repo = dir.path() / "models--org--name";
  fs::path main = MakeSnapshot(repo, kHash, 100);
  MakeSnapshot(repo, kOtherHash, 0);         // newer, but not what main points to
  WriteFile(repo / "refs" / "main", kHash);  // huggingface_hub writes no newline

  auto found = FindHfCacheSnapshot("org/name");
  INFO(found.status().ToString());
  REQUIRE_OK(found);
  CHECK(*found == main.string());
  CHECK(fs::exists(fs::path(*found) / "config.json"));

  WriteFile(repo / "refs" / "main", kHash + "\n");
  found = FindHfCacheSnapshot("org/name");
  REQUIRE_OK(found);
  CHECK(*found == main.string());
}

TEST_CASE("source: FindHfCacheSnapshot falls back to the newest snapshot") {
  ScopedCacheEnv env;
  TempDir dir(kTempPrefix);
  env.Set("HF_HOME", dir.path().string());
  fs::path repo = dir.path() / "hub" / "models--gpt2";
  MakeSnapshot(repo, kHash, 3600);
  fs::path newest = MakeSnapshot(repo, kOtherHash, 10);

  // No refs/main at all; a single-part repo id.
  auto found = FindHfCacheSnapshot("gpt2");
  INFO(found.status().ToString());
  REQUIRE_OK(found);
  CHECK(*found == newest.string());

  // refs/main naming a snapshot that is not there (an interrupted download).
  WriteFile(repo / "refs" / "main", "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa");
  found = FindHfCacheSnapshot("gpt2");
  REQUIRE_OK(found);
  CHECK(*found == newest.string());

  // refs/main that tries to point outside snapshots/ is never used as a path.
  fs::create_directories(repo / "secret");
  WriteFile(repo / "refs" / "main", "../secret");
  found = FindHfCacheSnapshot("gpt2");
  REQUIRE_OK(found);
  CHECK(*found == newest.string());
}

TEST_CASE("source: FindHfCacheSnapshot searches TRANSFORMERS_CACHE after the hub cache") {
  ScopedCacheEnv env;
  TempDir hub(kTempPrefix);
  TempDir legacy(kTempPrefix);
  env.Set("HF_HUB_CACHE", hub.path().string());
  env.Set("TRANSFORMERS_CACHE", legacy.path().string());
  fs::path snapshot = MakeSnapshot(legacy.path() / "models--org--name", kHash, 0);
  auto found = FindHfCacheSnapshot("org/name");
  REQUIRE_OK(found);
  CHECK(*found == snapshot.string());
}

TEST_CASE("source: FindHfCacheSnapshot reports what it searched") {
  ScopedCacheEnv env;
  TempDir dir(kTempPrefix);
  env.Set("HF_HUB_CACHE", dir.path().string());
  auto missing = FindHfCacheSnapshot("org/absent");
  REQUIRE_FALSE(missing.ok());
  CHECK(missing.status().code() == StatusCode::kNotFound);
  const std::string searched = dir.path().string() + "/models--org--absent";
  CHECK(missing.status().message().find("model 'org/absent' is not in the local Hugging Face "
                                        "cache (searched " +
                                        searched + ")") == 0);

  fs::create_directories(dir.path() / "models--org--empty" / "snapshots");
  auto empty = FindHfCacheSnapshot("org/empty");
  REQUIRE_FALSE(empty.ok());
  CHECK(empty.status().message().find("models--org--empty (no snapshots)") != std::string::npos);

  env.Set("HF_HUB_CACHE", "");
  auto no_roots = FindHfCacheSnapshot("org/name");
  REQUIRE_FALSE(no_roots.ok());
  CHECK(no_roots.status().code() == StatusCode::kNotFound);
  CHECK(no_roots.status().message().find("are all unset") != std::string::npos);
}

TEST_CASE("source: FindHfCacheSnapshot refuses what is not a repo id") {
  ScopedCacheEnv env;
  TempDir dir(kTempPrefix);
  env.Set("HF_HUB_CACHE", dir.path().string());
  // A cache entry an escaping id could otherwise reach.
  MakeSnapshot(dir.path() / "models--a--b", kHash, 0);
  for (const char* bad : {"", "../models--a--b", "/etc/passwd", "a/b/c", "a--b", "a/..", "..",
                          "org/", "/name", ".hidden", "a/b.", "with space", "a\\b", "org/name\n"}) {
    CAPTURE(bad);
    auto r = FindHfCacheSnapshot(bad);
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().code() == StatusCode::kInvalidArgument);
    CHECK(r.status().message().find("is not a Hugging Face repo id") != std::string::npos);
  }
  CHECK(FindHfCacheSnapshot(std::string(97, 'a')).status().code() == StatusCode::kInvalidArgument);
  // Legal ids with dots, dashes and underscores.
  for (const char* good : {"meta-llama/Llama-2-7b-hf", "Qwen/Qwen2.5-0.5B", "user_1/m_2", "gpt2"}) {
    CAPTURE(good);
    CHECK(FindHfCacheSnapshot(good).status().code() == StatusCode::kNotFound);
  }
  CHECK_OK(FindHfCacheSnapshot("a/b"));
}

}  // namespace
}  // namespace memplan::estimator
