// ConfigReader: typed, validated access to the fields of a JSON object (a Hugging Face
// config.json, a DeepSpeed config), with errors a user can act on. Every error names the source
// file and the field: "llama/config.json: field 'hidden_size': must be a positive integer, got -4".
//
// Integers are accepted as JSON integers or as floats with an integral value (some configs write
// 4096.0); booleans only as JSON booleans. "Absurd" dimensions (above `kMaxDim`) are refused.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "common/status.h"

namespace memplan::estimator {

class ConfigReader {
 public:
  // Largest value accepted for any single dimension (hidden size, vocab, layers, ...): 2^31 - 1.
  static constexpr int64_t kMaxDim = (int64_t{1} << 31) - 1;

  // `json` must outlive the reader. `source` names the file in errors.
  ConfigReader(const nlohmann::json& json, std::string source)
      : json_(json), source_(std::move(source)) {}

  const std::string& source() const { return source_; }
  const nlohmann::json& json() const { return json_; }
  bool Has(std::string_view field) const;  // present and not null

  // A required dimension in [1, kMaxDim].
  Result<int64_t> Dim(std::string_view field) const;
  // An optional dimension: `fallback` when absent or null, else validated as Dim.
  Result<int64_t> DimOr(std::string_view field, int64_t fallback) const;
  // An optional non-negative integer in [0, kMaxDim] (e.g. a count that may be zero).
  Result<int64_t> CountOr(std::string_view field, int64_t fallback) const;
  Result<bool> BoolOr(std::string_view field, bool fallback) const;
  Result<std::string> StringOr(std::string_view field, std::string fallback) const;
  Result<double> NumberOr(std::string_view field, double fallback) const;
  // An optional number in [0, 1] (a dropout probability).
  Result<double> ProbabilityOr(std::string_view field, double fallback) const;

  // An error naming this source and `field`.
  Status FieldError(std::string_view field, std::string_view problem) const;

 private:
  const nlohmann::json& json_;
  std::string source_;
};

}  // namespace memplan::estimator
