#include "common/json.h"

#include "common/byte_size.h"
#include "common/printable.h"
#include "common/suggest.h"

#include <cmath>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <type_traits>
#include <unordered_set>
#include <utility>
#include <vector>

namespace memplan {
namespace {

// Note [Linear ordered parse]: ordered_json's own parser inserts each key with a linear search
// of its object (50k keys: 10 s optimised), so a big MoE checkpoint's header or index takes
// minutes and a hostile one hours. This SAX handler appends to the object's underlying vector
// instead and catches repeated keys itself, which nlohmann would otherwise resolve silently (the
// last value winning). The same handler builds plain nlohmann::json documents (ParseJson), so
// every JSON reader applies the same limits (Note [JSON limits] in json.h), repeated keys
// included, while it parses.
template <typename Json>
class JsonBuilder {
 public:
  static constexpr bool kOrdered = std::is_same_v<Json, nlohmann::ordered_json>;

  explicit JsonBuilder(size_t max_root_members) : max_root_members_(max_root_members) {}

  Json& root() { return root_; }
  const std::string& error() const { return error_; }
  const std::string& refusal() const { return refusal_; }

  bool null() { return Put(Json(nullptr)); }
  bool boolean(bool v) { return Put(Json(v)); }
  bool number_integer(typename Json::number_integer_t v) { return Put(Json(v)); }
  bool number_unsigned(typename Json::number_unsigned_t v) { return Put(Json(v)); }
  bool number_float(typename Json::number_float_t v, const std::string& text) {
    // nlohmann refuses 1e999 itself; this keeps any other road to an infinity or NaN closed.
    if (!std::isfinite(v)) return Refuse("number " + text + " is not finite");
    return Put(Json(v));
  }
  bool string(std::string& v) { return Put(Json(std::move(v))); }
  bool binary(typename Json::binary_t& v) { return Put(Json::binary(std::move(v))); }
  bool start_object(std::size_t /*elements*/) {
    open_keys_.emplace_back();
    return Open(Json::object());
  }
  bool key(std::string& k) {
    if (k.size() > kMaxJsonKeyBytes) {
      return Refuse("a key of " + std::to_string(k.size()) + " bytes (limit " +
                    std::to_string(kMaxJsonKeyBytes) + ")");
    }
    if (IsRepeated(k)) {
      // Readers differ on what it means (Python and nlohmann keep the last value, DeepSpeed
      // refuses it): memplan never guesses.
      return Refuse("key '" + Printable(k) + "' appears twice in one JSON object" +
                    (open_.size() <= 1 ? std::string() : " ('" + Printable(OpenPath()) + "')"));
    }
    key_ = std::move(k);
    return true;
  }
  bool end_object() {
    open_keys_.pop_back();
    open_.pop_back();
    names_.pop_back();
    return true;
  }
  bool start_array(std::size_t /*elements*/) { return Open(Json::array()); }
  bool end_array() {
    open_.pop_back();
    names_.pop_back();
    return true;
  }
  bool parse_error(std::size_t /*position*/, const std::string& /*last_token*/,
                   const typename Json::exception& e) {
    error_ = e.what();
    return false;
  }

 private:
  static constexpr size_t kScanLimit = 16;  // object size from which repeated keys use a set

  bool Refuse(std::string why) {
    refusal_ = std::move(why);
    return false;
  }
  // Stores `v` where the parser is; returns where it went. A pointer to an open container stays
  // valid: only the innermost open container grows, and it is the last element of its parent (or
  // a node of a std::map, which does not move).
  Json* Place(Json v) {
    if (open_.empty()) {
      root_ = std::move(v);
      return &root_;
    }
    Json& parent = *open_.back();
    if (parent.is_array()) {
      auto& array = parent.template get_ref<typename Json::array_t&>();
      array.push_back(std::move(v));
      return &array.back();
    }
    auto& object = parent.template get_ref<typename Json::object_t&>();
    if constexpr (kOrdered) {
      // The vector's own emplace_back: key uniqueness was checked in key().
      object.emplace_back(std::move(key_), std::move(v));
      return &object.back().second;
    } else {
      Json& slot = object[std::move(key_)];  // new: key() refused a repeated one
      slot = std::move(v);
      return &slot;
    }
  }
  // Most objects are a tensor's three fields: scanning them beats building a hash set, which
  // only pays once an object is large.
  bool IsRepeated(const std::string& k) {
    const auto& object = open_.back()->template get_ref<const typename Json::object_t&>();
    if constexpr (!kOrdered) {
      return object.count(k) > 0;
    } else {
      std::unique_ptr<std::unordered_set<std::string>>& keys = open_keys_.back();
      if (!keys && object.size() < kScanLimit) {
        return std::any_of(object.begin(), object.end(),
                           [&](const auto& entry) { return entry.first == k; });
      }
      if (!keys) {
        keys = std::make_unique<std::unordered_set<std::string>>();
        for (const auto& entry : object) keys->insert(entry.first);
      }
      return !keys->insert(k).second;
    }
  }
  // Only the document's own entries are counted (a shape list's tensors); nested containers
  // (a config.json's id2label map) are bounded by the file's size alone.
  bool Full() {
    if (open_.size() != 1 || open_.back()->size() < max_root_members_) return false;
    Refuse("more than " + std::to_string(max_root_members_) +
           " entries at the top level (the limit for this file)");
    return true;
  }
  bool Put(Json v) {
    if (Full()) return false;
    Place(std::move(v));
    return true;
  }
  bool Open(Json v) {
    if (Full()) return false;
    std::string name;
    if (!open_.empty()) {
      name = open_.back()->is_array() ? "[" + std::to_string(open_.back()->size()) + "]" : key_;
    }
    open_.push_back(Place(std::move(v)));
    names_.push_back(std::move(name));
    return true;
  }
  // Where the innermost open container is: "params", "runs[2].cluster".
  std::string OpenPath() const {
    std::string path;
    for (size_t i = 1; i < names_.size(); ++i) {
      if (!path.empty() && (names_[i].empty() || names_[i][0] != '[')) path += '.';
      path += names_[i];
    }
    return path;
  }

  size_t max_root_members_;
  Json root_;
  std::vector<Json*> open_;
  std::vector<std::string> names_;  // per open container: its key, or "[index]" in an array
  std::vector<std::unique_ptr<std::unordered_set<std::string>>> open_keys_;  // per open object
  std::string key_;
  std::string error_;
  std::string refusal_;
};

template <typename Json>
Result<Json> Parse(std::string_view text, const std::string& source, int max_depth,
                   size_t max_root_members = SIZE_MAX) {
  MEMPLAN_RETURN_IF_ERROR(CheckNoNulByte(text, source));
  int depth = JsonNestingDepth(text);
  if (depth > max_depth) {
    return Status::InvalidArgument(source + ": JSON nested " + std::to_string(depth) +
                                   " levels deep (limit " + std::to_string(max_depth) + ")");
  }
  try {
    JsonBuilder<Json> builder(max_root_members);
    bool ok = Json::sax_parse(text, &builder);
    if (!builder.refusal().empty()) {
      return Status::InvalidArgument(source + ": " + builder.refusal());
    }
    if (!ok) {
      std::string what = builder.error();
      // nlohmann prefixes "[json.exception.parse_error.101] "; users need only the rest.
      if (auto pos = what.find("] "); pos != std::string::npos) what = what.substr(pos + 2);
      return Status::InvalidArgument(source + ": invalid JSON: " + what);
    }
    return std::move(builder.root());
  } catch (const std::exception& e) {
    // sax_parse reports syntax errors through the builder; only allocation failure throws.
    return Status::ResourceExhausted(source + ": cannot parse JSON: " + e.what());
  }
}

}  // namespace

Result<nlohmann::json> ParseJson(std::string_view text, const std::string& source, int max_depth) {
  return Parse<nlohmann::json>(text, source, max_depth);
}

Result<nlohmann::ordered_json> ParseOrderedJsonText(std::string_view text,
                                                    const std::string& source, int max_depth,
                                                    size_t max_root_members) {
  return Parse<nlohmann::ordered_json>(text, source, max_depth, max_root_members);
}

Result<int64_t> JsonInteger(const nlohmann::json& value, const std::string& what, int64_t lo,
                            int64_t hi) {
  const std::string range = "an integer from " + std::to_string(lo) + " to " + std::to_string(hi);
  if (!value.is_number_integer()) {
    const bool number = value.is_number_float();
    return Status::InvalidArgument(what + ": must be " + range + ", got " +
                                   (number ? value.dump() : std::string("a ") + value.type_name()));
  }
  const bool beyond_int64 =
      value.is_number_unsigned() && value.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX);
  const int64_t v = beyond_int64 ? INT64_MAX : value.get<int64_t>();
  if (beyond_int64 || v < lo || v > hi) {
    return Status::InvalidArgument(what + ": must be " + range + ", got " + value.dump());
  }
  return v;
}

JsonFieldReader::JsonFieldReader(const nlohmann::json& object, std::string where, std::string path)
    : object_(object), where_(std::move(where)), path_(std::move(path)) {}

Status JsonFieldReader::CheckKeys(const std::vector<std::string>& known) const {
  if (!object_.is_object()) {
    const std::string what = path_.empty() ? "" : " '" + path_.substr(0, path_.size() - 1) + "'";
    return Status::InvalidArgument(where_ + ":" + what + " expected an object, got " +
                                   Got(object_));
  }
  for (const auto& item : object_.items()) {
    if (std::find(known.begin(), known.end(), item.key()) == known.end()) {
      return Status::InvalidArgument(where_ + ": unknown key '" + Path(item.key().c_str()) + "'" +
                                     DidYouMean(ClosestMatches(item.key(), known)));
    }
  }
  return Status::Ok();
}

Status JsonFieldReader::CheckKeys(std::initializer_list<std::string_view> known) const {
  return CheckKeys(std::vector<std::string>(known.begin(), known.end()));
}

bool JsonFieldReader::Has(const char* key) const {
  return object_.is_object() && object_.contains(key);
}

Status JsonFieldReader::Require(const char* key) const {
  return Has(key) ? Status::Ok() : Error(key, "is missing");
}

JsonFieldReader JsonFieldReader::Child(const char* key) const {
  return JsonFieldReader(object_.at(key), where_, Path(key) + ".");
}

namespace {

// A field whose JSON type `is` says it holds a T, read as one; `kind` names the type for errors.
template <typename T>
Status ReadScalar(const JsonFieldReader& r, const char* key,
                  bool (nlohmann::json::*is)() const noexcept, const char* kind, T* out) {
  if (!r.Has(key)) return Status::Ok();
  const nlohmann::json& v = r.object().at(key);
  if (!(v.*is)()) return r.Error(key, std::string("must be ") + kind + ", got " + r.Got(v));
  *out = v.get<T>();
  return Status::Ok();
}

}  // namespace

Status JsonFieldReader::Bool(const char* key, bool* out) const {
  return ReadScalar(*this, key, &nlohmann::json::is_boolean, "true or false", out);
}

Status JsonFieldReader::Number(const char* key, double* out) const {
  return ReadScalar(*this, key, &nlohmann::json::is_number, "a number", out);
}

Status JsonFieldReader::String(const char* key, std::string* out) const {
  return ReadScalar(*this, key, &nlohmann::json::is_string, "a string", out);
}

Status JsonFieldReader::Name(const char* key, std::string* out) const {
  std::string text;
  if (!Has(key)) return Status::Ok();
  MEMPLAN_RETURN_IF_ERROR(String(key, &text));
  const size_t bad = FindControlCharacter(text);
  if (bad != std::string::npos) {
    uint32_t code = 0;
    const size_t length = DecodeUtf8(text, bad, &code);
    const std::string what = Printable(text.substr(bad, length == 0 ? 1 : length));
    return Error(key, "holds a control character (" + what + " at byte " + std::to_string(bad) +
                          "): '" + Printable(text) +
                          "'; a name ends up in reports, configs and launch scripts, so it may "
                          "not hold line breaks, control characters or bytes that are not UTF-8");
  }
  *out = std::move(text);
  return Status::Ok();
}

Status JsonFieldReader::ByteSize(const char* key, uint64_t* out) const {
  if (!Has(key)) return Status::Ok();
  const nlohmann::json& v = object_.at(key);
  if (v.is_number_unsigned()) {
    *out = v.get<uint64_t>();
  } else if (v.is_number_integer() && v.get<int64_t>() >= 0) {
    *out = static_cast<uint64_t>(v.get<int64_t>());
  } else if (v.is_number_float() && v.get<double>() >= 0 && v.get<double>() < 1.8e19) {
    *out = static_cast<uint64_t>(v.get<double>());
  } else if (v.is_string()) {
    Result<uint64_t> bytes = ParseByteSize(v.get<std::string>(), where_ + ": '" + Path(key) + "'");
    if (!bytes.ok()) return bytes.status();
    *out = *bytes;
  } else {
    return Error(key, "must be a byte count or a size such as \"80GiB\", got " + Got(v));
  }
  return Status::Ok();
}

Status JsonFieldReader::Strings(const char* key, std::vector<std::string>* out) const {
  if (!Has(key)) return Status::Ok();
  const nlohmann::json& v = object_.at(key);
  const bool strings =
      v.is_array() && std::all_of(v.begin(), v.end(), [](const auto& e) { return e.is_string(); });
  if (!strings) return Error(key, "must be a list of strings, got " + Got(v));
  *out = v.get<std::vector<std::string>>();
  return Status::Ok();
}

Status JsonFieldReader::Error(const char* key, const std::string& problem) const {
  return Status::InvalidArgument(where_ + ": '" + Path(key) + "' " + problem);
}

std::string JsonFieldReader::Got(const nlohmann::json& value) {
  if (value.is_object()) return "an object";
  if (value.is_array()) return "an array";
  constexpr size_t kMaxShown = 64;
  std::string text = value.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  if (text.size() > kMaxShown) text = text.substr(0, kMaxShown) + "...";
  return text;
}

}  // namespace memplan
