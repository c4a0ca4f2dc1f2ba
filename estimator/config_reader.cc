#include "estimator/config_reader.h"

#include <cmath>

namespace memplan::estimator {
namespace {

std::string Describe(const nlohmann::json& v) {
  std::string s = v.dump(-1, ' ', true, nlohmann::json::error_handler_t::replace);
  if (s.size() > 40) s = s.substr(0, 37) + "...";
  return s;
}

}  // namespace

bool ConfigReader::Has(std::string_view field) const {
  if (!json_.is_object()) return false;
  auto it = json_.find(field);
  return it != json_.end() && !it->is_null();
}

Status ConfigReader::FieldError(std::string_view field, std::string_view problem) const {
  return Status::InvalidArgument(source_ + ": field '" + std::string(field) +
                                 "': " + std::string(problem));
}

Result<int64_t> ConfigReader::CountOr(std::string_view field, int64_t fallback) const {
  if (!Has(field)) return fallback;
  const nlohmann::json& v = *json_.find(field);
  int64_t out = 0;
  if (v.is_number_integer()) {
    if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(kMaxDim)) {
      return FieldError(field, "value " + Describe(v) + " is absurdly large (limit " +
                                   std::to_string(kMaxDim) + ")");
    }
    out = v.get<int64_t>();
  } else if (v.is_number_float()) {
    double d = v.get<double>();
    if (!std::isfinite(d) || d != std::floor(d)) {
      return FieldError(field, "must be an integer, got " + Describe(v));
    }
    if (std::fabs(d) > static_cast<double>(kMaxDim)) {
      return FieldError(field, "value " + Describe(v) + " is absurdly large (limit " +
                                   std::to_string(kMaxDim) + ")");
    }
    out = static_cast<int64_t>(d);
  } else {
    return FieldError(field, "must be an integer, got " + Describe(v));
  }
  if (out < 0) return FieldError(field, "must not be negative, got " + std::to_string(out));
  if (out > kMaxDim) {
    return FieldError(field, "value " + std::to_string(out) + " is absurdly large (limit " +
                                 std::to_string(kMaxDim) + ")");
  }
  return out;
}

Result<int64_t> ConfigReader::DimOr(std::string_view field, int64_t fallback) const {
  if (!Has(field)) return fallback;
  MEMPLAN_ASSIGN_OR_RETURN(int64_t v, CountOr(field, fallback));
  if (v == 0) return FieldError(field, "must be a positive integer, got 0");
  return v;
}

Result<int64_t> ConfigReader::Dim(std::string_view field) const {
  if (!Has(field)) return FieldError(field, "is missing (required for this model type)");
  return DimOr(field, 0);
}

Result<bool> ConfigReader::BoolOr(std::string_view field, bool fallback) const {
  if (!Has(field)) return fallback;
  const nlohmann::json& v = *json_.find(field);
  if (!v.is_boolean()) return FieldError(field, "must be true or false, got " + Describe(v));
  return v.get<bool>();
}

Result<std::string> ConfigReader::StringOr(std::string_view field, std::string fallback) const {
  if (!Has(field)) return fallback;
  const nlohmann::json& v = *json_.find(field);
  if (!v.is_string()) return FieldError(field, "must be a string, got " + Describe(v));
  return v.get<std::string>();
}

Result<double> ConfigReader::NumberOr(std::string_view field, double fallback) const {
  if (!Has(field)) return fallback;
  const nlohmann::json& v = *json_.find(field);
  if (!v.is_number()) return FieldError(field, "must be a number, got " + Describe(v));
  double d = v.get<double>();
  if (!std::isfinite(d)) return FieldError(field, "must be finite");
  return d;
}

Result<double> ConfigReader::ProbabilityOr(std::string_view field, double fallback) const {
  MEMPLAN_ASSIGN_OR_RETURN(double p, NumberOr(field, fallback));
  if (p < 0 || p > 1) return FieldError(field, "must be a probability in [0, 1]");
  return p;
}

}  // namespace memplan::estimator
