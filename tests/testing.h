// Shared helpers for the doctest suites: a scratch directory, the model fixtures under
// estimator/models/, and inventory helpers that fail the running test instead of returning errors.
// Header-only; include it as "tests/testing.h" from a test built with MEMPLAN_SOURCE_DIR defined.
#pragma once

#include <doctest/doctest.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "estimator/hf_config.h"
#include "estimator/inventory.h"

#ifndef MEMPLAN_SOURCE_DIR
#error "tests/testing.h needs MEMPLAN_SOURCE_DIR (the project source directory) defined"
#endif

namespace memplan::testing {

// --- Scratch directory ------------------------------------------------------------------------

// A fresh directory $TMPDIR/<prefix>XXXXXX (or under /tmp), removed with everything in it when
// the object goes away.
class TempDir {
 public:
  explicit TempDir(std::string_view prefix) {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/" +
                          std::string(prefix) + "XXXXXX";
    REQUIRE(::mkdtemp(pattern.data()) != nullptr);
    path_ = pattern;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::filesystem::path& path() const { return path_; }

  // The full path of `name` (which may hold '/') inside the directory, as a string; nothing is
  // created.
  std::string PathOf(const std::string& name) const { return (path_ / name).string(); }

  // Writes `content` to `name` inside the directory, replacing any file there; returns its path.
  std::filesystem::path Write(const std::string& name, const std::string& content) const {
    std::filesystem::path p = path_ / name;
    std::ofstream out(p, std::ios::binary | std::ios::trunc);
    out << content;
    out.close();
    REQUIRE_MESSAGE(!out.fail(), "cannot write " << p.string());
    return p;
  }

 private:
  std::filesystem::path path_;
};

// --- Model fixtures ---------------------------------------------------------------------------

// The text of estimator/models/<name>.json; fails the test when it is missing.
inline std::string ReadFixture(const std::string& name) {
  std::ifstream in(std::string(MEMPLAN_SOURCE_DIR) + "/estimator/models/" + name + ".json");
  REQUIRE_MESSAGE(in.good(), "missing fixture " << name);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// --- Inventories ------------------------------------------------------------------------------

using Shape = std::vector<int64_t>;

// The inventory of fixture `name`; fails the test when it does not build.
inline estimator::ModelInventory Fixture(
    const std::string& name,
    estimator::ModelClassChoice choice = estimator::ModelClassChoice::kFromArchitectures) {
  Result<estimator::ModelInventory> inventory =
      estimator::InventoryFromHfConfigText(ReadFixture(name), name, choice);
  REQUIRE_MESSAGE(inventory.ok(), inventory.status().ToString());
  return std::move(inventory).value();
}

// Builds `config` as if read from test/config.json.
inline Result<estimator::ModelInventory> Build(
    const nlohmann::json& config,
    estimator::ModelClassChoice choice = estimator::ModelClassChoice::kFromArchitectures) {
  return estimator::InventoryFromHfConfig(config, "test/config.json", choice);
}

// Build(), failing the test when the build fails.
inline estimator::ModelInventory MustBuild(
    const nlohmann::json& config,
    estimator::ModelClassChoice choice = estimator::ModelClassChoice::kFromArchitectures) {
  Result<estimator::ModelInventory> inventory = Build(config, choice);
  REQUIRE_MESSAGE(inventory.ok(), inventory.status().ToString());
  return std::move(inventory).value();
}

// The counts of `inventory`; fails the test when counting fails.
inline estimator::ModelCounts Counts(const estimator::ModelInventory& inventory) {
  Result<estimator::ModelCounts> counts = estimator::CountParams(inventory);
  REQUIRE_MESSAGE(counts.ok(), counts.status().ToString());
  return *counts;
}

inline uint64_t Total(const estimator::ModelInventory& inventory) {
  return Counts(inventory).params_total;
}

// The tensor called `name`; fails the test when it is missing.
inline const estimator::TensorInfo& Tensor(const estimator::ModelInventory& inventory,
                                           const std::string& name) {
  int64_t index = inventory.Find(name);
  REQUIRE_MESSAGE(index >= 0, "no tensor " << name);
  return inventory.tensors[static_cast<size_t>(index)];
}

}  // namespace memplan::testing
