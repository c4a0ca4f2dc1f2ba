// JSON parsing with the limits every reader of user files applies: bounded nesting depth (so a
// hostile file cannot exhaust the stack) and errors that name the source, never exceptions.
#pragma once

#include <algorithm>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "common/status.h"

namespace memplan {

// Deepest nesting of objects/arrays in `text`, counted without parsing (strings skipped).
inline int JsonNestingDepth(std::string_view text) {
  int depth = 0, max_depth = 0;
  bool in_string = false, escaped = false;
  for (char c : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      max_depth = std::max(max_depth, ++depth);
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
  return max_depth;
}

// A NUL byte is never valid in JSON text (raw control characters are not allowed even inside
// strings), but nlohmann stops at one as at the end of the input: the bytes after it would be
// silently ignored, and the file read differently from what Python's json module or serde say.
inline Status CheckNoNulByte(std::string_view text, const std::string& source) {
  const size_t nul = text.find('\0');
  if (nul == std::string_view::npos) return Status::Ok();
  return Status::InvalidArgument(source + ": invalid JSON: NUL byte at offset " +
                                 std::to_string(nul));
}

// JSON text for output (stdout, files): indented by 2, with a final newline. Strings that are not
// valid UTF-8 (a path from the command line may be anything) get U+FFFD for the bad bytes, where
// nlohmann's dump() would throw.
template <typename Json>
std::string JsonOutput(const Json& json) {
  return json.dump(2, ' ', false, Json::error_handler_t::replace) + "\n";
}

// Parses `text` as JSON. Invalid JSON (a NUL byte included), invalid UTF-8 and nesting deeper
// than `max_depth` are InvalidArgument errors naming `source`. Key order is not kept: see
// ParseOrderedJsonText.
inline Result<nlohmann::json> ParseJson(std::string_view text, const std::string& source,
                                        int max_depth = 64) {
  MEMPLAN_RETURN_IF_ERROR(CheckNoNulByte(text, source));
  int depth = JsonNestingDepth(text);
  if (depth > max_depth) {
    return Status::InvalidArgument(source + ": JSON nested " + std::to_string(depth) +
                                   " levels deep (limit " + std::to_string(max_depth) + ")");
  }
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    std::string what = e.what();
    // nlohmann prefixes "[json.exception.parse_error.101] "; users need only the rest.
    if (auto pos = what.find("] "); pos != std::string::npos) what = what.substr(pos + 2);
    return Status::InvalidArgument(source + ": invalid JSON: " + what);
  }
}

// Parses a user's JSON document keeping key order, in time linear in its size (nlohmann's own
// ordered_json parse is quadratic in the keys of one object; see Note [Linear ordered parse] in
// json.cc). Refuses, with errors naming `source`: nesting deeper than `max_depth` (checked before
// parsing, as ParseJson does), invalid JSON (including invalid UTF-8 and a NUL byte), and an
// object that repeats a key, which nlohmann would otherwise resolve silently. Use it for any user
// document whose key order matters.
Result<nlohmann::ordered_json> ParseOrderedJsonText(std::string_view text,
                                                    const std::string& source, int max_depth);

}  // namespace memplan
