// JSON parsing with the limits every reader of user files applies: bounded nesting depth (so a
// hostile file cannot exhaust the stack) and errors that name the source, never exceptions.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <initializer_list>
#include <limits>
#include <string_view>
#include <type_traits>
#include <vector>

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

// Parses `text` as JSON (Note [JSON limits]). A key repeated in one object is an error naming the
// key and the object's path: readers disagree on what it means (Python's json module and nlohmann
// keep the last value, DeepSpeed's config loader refuses it), so memplan never guesses, in any
// file (config.json, a DeepSpeed config, a cluster, runs, a calibration, a Schedule, a request).
// Key order is not kept: see ParseOrderedJsonText.
Result<nlohmann::json> ParseJson(std::string_view text, const std::string& source,
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

// Note [JSON field reader]: the one way a library reads the fields of a JSON object it was given
// (a setup, a schedule, a request, a cluster, a calibration or bench file). Every reader of such an
// object used to carry its own getters, each with its own wording; one reader gives one wording:
//
//   WHERE: 'PATH' must be a number, got "fast"
//   WHERE: 'PATH' must be an integer from 1 to 64, got 0
//   WHERE: 'PATH' is missing
//   WHERE: unknown key 'KEY' (did you mean ...?)
//
// WHERE names the document ("setup JSON", "schedule", "cluster.json"); PATH is the key with the
// path of the object that holds it ("params.buffer_bytes"). Fields are named as they are spelled
// in the JSON, never as CLI flags and never backquoted: the CLI maps backquoted fields to flags
// (tools::FieldsToFlags), and a key in a file is not a flag. An absent key keeps `*out` (the
// caller's default); a present key of the wrong type, null included, is an error.
class JsonFieldReader {
 public:
  // `object` must outlive the reader. `path` is the position of `object` in its document, ending
  // in '.' ("params."), or "" for the root.
  JsonFieldReader(const nlohmann::json& object, std::string where, std::string path = "");

  // Refuses anything but an object ("WHERE: PATH expected an object") and a key not in `known`,
  // with the closest known keys as a suggestion. Call it first: the getters assume an object.
  Status CheckKeys(const std::vector<std::string>& known) const;
  Status CheckKeys(std::initializer_list<std::string_view> known) const;

  bool Has(const char* key) const;
  // "WHERE: 'PATH' is missing" when `key` is absent, Ok otherwise.
  Status Require(const char* key) const;
  // A reader for the object at `key` (which the caller has checked is present); its errors name
  // the key's path.
  JsonFieldReader Child(const char* key) const;

  Status Bool(const char* key, bool* out) const;
  // Any JSON number (integers included).
  Status Number(const char* key, double* out) const;
  Status String(const char* key, std::string* out) const;
  // A String that names something (a GPU, a run, a model, a path): it ends up in reports, configs
  // and launch scripts, so a control character, a line break of any reader or a byte that is not
  // UTF-8 in it (FindControlCharacter, common/printable.h) is refused: "WHERE: 'PATH' holds a
  // control character (\n at byte 4): ...".
  Status Name(const char* key, std::string* out) const;
  // A byte count: a non-negative JSON number (a fraction is dropped) or a size string ("80GiB",
  // common/byte_size.h).
  Status ByteSize(const char* key, uint64_t* out) const;
  // An array of strings.
  Status Strings(const char* key, std::vector<std::string>* out) const;
  // The getter for `out`'s type: Bool, Integer (T's range), Number, String or Strings.
  template <typename T>
  Status Get(const char* key, T* out) const {
    if constexpr (std::is_same_v<T, bool>) {
      return Bool(key, out);
    } else if constexpr (std::is_integral_v<T>) {
      return Integer(key, out);
    } else if constexpr (std::is_same_v<T, double>) {
      return Number(key, out);
    } else if constexpr (std::is_same_v<T, std::string>) {
      return String(key, out);
    } else {
      static_assert(std::is_same_v<T, std::vector<std::string>>);
      return Strings(key, out);
    }
  }
  // A field and where it goes, for GetAll and RequireAll: JsonFieldReader::Field("lr", &o.lr).
  template <typename T>
  struct FieldRef {
    const char* key;
    T* out;
  };
  template <typename T>
  static FieldRef<T> Field(const char* key, T* out) {
    return {key, out};
  }
  // Get for each field in order, stopping at the first error: a struct's fields read in one
  // statement. An absent key keeps its default.
  template <typename... T>
  Status GetAll(FieldRef<T>... fields) const {
    Status status;
    ((status.ok() ? (void)(status = Get(fields.key, fields.out)) : void()), ...);
    return status;
  }
  // GetAll, but an absent key is an error ("is missing"): for documents memplan wrote itself.
  template <typename... T>
  Status RequireAll(FieldRef<T>... fields) const {
    Status status;
    ((status.ok() ? (void)(status = Required(fields.key, fields.out)) : void()), ...);
    return status;
  }
  template <typename T>
  Status Required(const char* key, T* out) const {
    MEMPLAN_RETURN_IF_ERROR(Require(key));
    return Get(key, out);
  }
  // A JSON integer (not 1.0, "4" or true) in [lo, hi]; the default range is T's.
  template <typename T>
  Status Integer(const char* key, T* out, T lo = std::numeric_limits<T>::min(),
                 T hi = std::numeric_limits<T>::max()) const {
    static_assert(std::is_integral_v<T> && !std::is_same_v<T, bool>);
    if (!Has(key)) return Status::Ok();
    const nlohmann::json& v = object_.at(key);
    const bool in_range = Fits(v, lo, hi);
    if (!in_range) {
      return Error(key, "must be an integer from " + std::to_string(lo) + " to " +
                            std::to_string(hi) + ", got " + Got(v));
    }
    *out = v.is_number_unsigned() ? static_cast<T>(v.get<uint64_t>())
                                  : static_cast<T>(v.get<int64_t>());
    return Status::Ok();
  }
  // A string that `parse` (std::string_view -> Result<E>) accepts; its error is prefixed with
  // "WHERE: 'PATH'".
  template <typename E, typename Parse>
  Status Enum(const char* key, Parse parse, E* out) const {
    if (!Has(key)) return Status::Ok();
    std::string text;
    MEMPLAN_RETURN_IF_ERROR(String(key, &text));
    Result<E> value = parse(text);
    if (!value.ok()) return value.status().WithPrefix(where_ + ": '" + Path(key) + "'");
    *out = *value;
    return Status::Ok();
  }

  // "WHERE: 'PATH' PROBLEM", for the checks a caller makes beyond the type.
  Status Error(const char* key, const std::string& problem) const;
  std::string Path(const char* key) const { return path_ + key; }
  const nlohmann::json& object() const { return object_; }

  // How a value appears in an error: scalars as JSON (long ones cut), containers by their type.
  static std::string Got(const nlohmann::json& value);

 private:
  template <typename T>
  static bool Fits(const nlohmann::json& v, T lo, T hi) {
    if (!v.is_number_integer()) return false;
    if (v.is_number_unsigned()) {
      const uint64_t u = v.get<uint64_t>();
      if constexpr (std::is_signed_v<T>) {
        return hi >= 0 && u <= static_cast<uint64_t>(hi) &&
               (lo <= 0 || u >= static_cast<uint64_t>(lo));
      } else {
        return u >= lo && u <= hi;
      }
    }
    const int64_t n = v.get<int64_t>();
    if constexpr (std::is_signed_v<T>) {
      return n >= lo && n <= hi;
    } else {
      return n >= 0 && static_cast<uint64_t>(n) >= lo && static_cast<uint64_t>(n) <= hi;
    }
  }

  const nlohmann::json& object_;
  std::string where_;
  std::string path_;
};

}  // namespace memplan
