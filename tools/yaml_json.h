// ParseYamlAsJson: a YAML document (an Accelerate config file, as `accelerate config` writes it)
// read as Accelerate reads it, into JSON for the checker (planner/accelerate_check.h).
//
// Accelerate loads its config with PyYAML's safe_load, which resolves plain scalars by YAML 1.1's
// rules: `yes`, `on` and `True` are booleans, `0x10` is an int, `1.0` a float, but `1e5` (no dot)
// a string. libyaml (PyYAML's own C parser) parses; the scalars are resolved here as PyYAML
// resolves them (Note [Plain scalars as PyYAML reads them] in yaml_json.cc), anchors, aliases and
// merge keys (`<<`) included, so a value checked here is the value Accelerate would see. Lives in
// tools/ (Note [YAML at the edge] in yaml_json.cc).
//
// Refused (InvalidArgument naming `source`, with the line): more than kMaxYamlBytes, bytes that
// are not UTF-8, text that is not YAML, more than one document, a tag safe_load refuses
// (`!!python/...`), a key that is not a scalar, a mapping that repeats a key (PyYAML keeps the
// last value silently; memplan never guesses, as for JSON: Note [JSON limits] in common/json.h),
// nesting deeper than `max_depth`, aliases that expand past a million values, an integer past
// 64 bits, a float that is not finite.
//
// Thread safety: pure function.
#pragma once

#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "common/status.h"

namespace memplan::tools {

// The largest YAML document read: 256 KiB (an Accelerate config is a few kilobytes).
constexpr size_t kMaxYamlBytes = size_t{256} << 10;

Result<nlohmann::json> ParseYamlAsJson(std::string_view text, const std::string& source,
                                       int max_depth = 64);

}  // namespace memplan::tools
