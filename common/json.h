// JSON parsing with the limits every reader of user files applies: bounded nesting depth (so a
// hostile file cannot exhaust the stack) and errors that name the source, never exceptions.
#pragma once

#include <algorithm>
#include <cstdint>
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

// Note [JSON limits]: every JSON reader below refuses, with an InvalidArgument error naming
// `source`: invalid JSON (a NUL byte and invalid UTF-8 included), nesting deeper than `max_depth`
// (checked before parsing, so a hostile file cannot exhaust the stack), a key longer than
// kMaxJsonKeyBytes (no real config, header or shape list comes near it; a 15 MiB key made `check`'s
// suggestions take 35 s), and a number that is not finite.
constexpr size_t kMaxJsonKeyBytes = 4096;

// Parses `text` as JSON (Note [JSON limits]). A key repeated in one object keeps its last value, as
// Python's json module does (Hugging Face reads config.json that way). Key order is not kept: see
// ParseOrderedJsonText.
Result<nlohmann::json> ParseJson(std::string_view text, const std::string& source,
                                 int max_depth = 64);

// ParseJson, but a key repeated in one object is an error, as DeepSpeed's config loader makes it
// (its object_pairs_hook refuses duplicates): for DeepSpeed configs.
Result<nlohmann::json> ParseJsonNoRepeatedKeys(std::string_view text, const std::string& source,
                                               int max_depth = 64);

// Parses a user's JSON document keeping key order, in time linear in its size (nlohmann's own
// ordered_json parse is quadratic in the keys of one object; see Note [Linear ordered parse] in
// json.cc). Refuses what ParseJson refuses (Note [JSON limits]) and an object that repeats a key,
// which nlohmann would otherwise resolve silently, and a top-level object or array of more than
// `max_root_members` entries, refused as soon as the parse reaches entry max_root_members + 1 (so
// a 10^6-tensor shape list costs no more than its limit). Use it for any user document whose key
// order matters.
Result<nlohmann::ordered_json> ParseOrderedJsonText(std::string_view text,
                                                    const std::string& source, int max_depth,
                                                    size_t max_root_members = SIZE_MAX);

// An integer field of a user's JSON file, in [lo, hi]. Refuses (InvalidArgument naming `what`)
// anything but a JSON integer (1.0, "4", true) and any value outside the range, including the
// values nlohmann holds as unsigned beyond int64 and those that a narrowing cast would wrap
// (2^32 + 4 read as an int is 4). The one way to read an integer setting from a file.
Result<int64_t> JsonInteger(const nlohmann::json& value, const std::string& what, int64_t lo,
                            int64_t hi);

}  // namespace memplan
