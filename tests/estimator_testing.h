// Inventory helpers for the estimator's doctest suites: they fail the running test instead of
// returning errors. Header-only; needs MEMPLAN_SOURCE_DIR (see tests/testing.h).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "estimator/hf_config.h"
#include "estimator/inventory.h"
#include "tests/testing.h"

namespace memplan::testing {

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
