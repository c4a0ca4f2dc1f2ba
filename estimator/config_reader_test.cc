#include "estimator/config_reader.h"

#include <doctest/doctest.h>

namespace memplan::estimator {
namespace {

TEST_CASE("config reader: fields are validated and errors name the file and field") {
  auto j = nlohmann::json::parse(R"({"hidden_size": 4096, "float_dim": 64.0, "neg": -4,
      "zero": 0, "huge": 1e15, "frac": 2.5, "text": "x", "flag": true, "null_field": null,
      "big": 18446744073709551615})");
  ConfigReader r(j, "cfg.json");
  CHECK(*r.Dim("hidden_size") == 4096);
  CHECK(*r.Dim("float_dim") == 64);
  CHECK(*r.DimOr("absent", 7) == 7);
  CHECK(*r.DimOr("null_field", 9) == 9);
  CHECK(*r.CountOr("zero", 3) == 0);
  CHECK(*r.BoolOr("flag", false));
  CHECK(*r.StringOr("text", "") == "x");
  for (const char* bad : {"neg", "zero", "huge", "frac", "text", "big"}) {
    CAPTURE(bad);
    auto v = r.Dim(bad);
    REQUIRE_FALSE(v.ok());
    CHECK(v.status().message().find(std::string("cfg.json: field '") + bad + "'") == 0);
  }
  auto missing = r.Dim("num_layers");
  CHECK(missing.status().message() ==
        "cfg.json: field 'num_layers': is missing (required for this model type)");
  CHECK_FALSE(r.BoolOr("text", false).ok());
  CHECK_FALSE(r.StringOr("flag", "").ok());
}

}  // namespace
}  // namespace memplan::estimator
