#include "common/json.h"

#include <exception>
#include <memory>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

namespace memplan {
namespace {

using OrderedJson = nlohmann::ordered_json;

// Note [Linear ordered parse]: ordered_json's own parser inserts each key with a linear search
// of its object (50k keys: 10 s optimised), so a big MoE checkpoint's header or index takes
// minutes and a hostile one hours. This SAX handler appends to the object's underlying vector
// instead and catches repeated keys itself, which nlohmann would otherwise resolve silently.
class OrderedJsonBuilder {
 public:
  using Json = nlohmann::ordered_json;

  Json& root() { return root_; }
  const std::string& error() const { return error_; }
  const std::string& repeated_key() const { return repeated_key_; }

  bool null() { return Put(Json(nullptr)); }
  bool boolean(bool v) { return Put(Json(v)); }
  bool number_integer(Json::number_integer_t v) { return Put(Json(v)); }
  bool number_unsigned(Json::number_unsigned_t v) { return Put(Json(v)); }
  bool number_float(Json::number_float_t v, const std::string& /*text*/) { return Put(Json(v)); }
  bool string(std::string& v) { return Put(Json(std::move(v))); }
  bool binary(Json::binary_t& v) { return Put(Json::binary(std::move(v))); }
  bool start_object(std::size_t /*elements*/) {
    open_keys_.emplace_back();
    return Open(Json::object());
  }
  bool key(std::string& k) {
    if (IsRepeated(k)) {
      repeated_key_ = k;
      return false;
    }
    key_ = std::move(k);
    return true;
  }
  bool end_object() {
    open_keys_.pop_back();
    open_.pop_back();
    return true;
  }
  bool start_array(std::size_t /*elements*/) { return Open(Json::array()); }
  bool end_array() {
    open_.pop_back();
    return true;
  }
  bool parse_error(std::size_t /*position*/, const std::string& /*last_token*/,
                   const Json::exception& e) {
    error_ = e.what();
    return false;
  }

 private:
  static constexpr size_t kScanLimit = 16;  // object size from which repeated keys use a set

  // Stores `v` where the parser is; returns where it went. A pointer to an open container stays
  // valid: only the innermost open container grows, and it is the last element of its parent.
  Json* Place(Json v) {
    if (open_.empty()) {
      root_ = std::move(v);
      return &root_;
    }
    Json& parent = *open_.back();
    if (parent.is_array()) {
      auto& array = parent.get_ref<Json::array_t&>();
      array.push_back(std::move(v));
      return &array.back();
    }
    // The vector's own emplace_back: key uniqueness was checked in key().
    auto& object = parent.get_ref<Json::object_t&>();
    object.emplace_back(std::move(key_), std::move(v));
    return &object.back().second;
  }
  // Most objects are a tensor's three fields: scanning them beats building a hash set, which
  // only pays once an object is large.
  bool IsRepeated(const std::string& k) {
    const auto& object = open_.back()->get_ref<const Json::object_t&>();
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
  bool Put(Json v) {
    Place(std::move(v));
    return true;
  }
  bool Open(Json v) {
    open_.push_back(Place(std::move(v)));
    return true;
  }

  Json root_;
  std::vector<Json*> open_;
  std::vector<std::unique_ptr<std::unordered_set<std::string>>> open_keys_;  // per open object
  std::string key_;
  std::string error_;
  std::string repeated_key_;
};

}  // namespace

Result<nlohmann::ordered_json> ParseOrderedJsonText(std::string_view text,
                                                    const std::string& source, int max_depth) {
  // Same checks and messages as common/json.h's ParseJson, whose ordered_json form this replaces.
  MEMPLAN_RETURN_IF_ERROR(CheckNoNulByte(text, source));
  int depth = JsonNestingDepth(text);
  if (depth > max_depth) {
    return Status::InvalidArgument(source + ": JSON nested " + std::to_string(depth) +
                                   " levels deep (limit " + std::to_string(max_depth) + ")");
  }
  try {
    OrderedJsonBuilder builder;
    bool ok = OrderedJson::sax_parse(text, &builder);
    if (!builder.repeated_key().empty()) {
      return Status::InvalidArgument(source + ": key '" + builder.repeated_key() +
                                     "' appears twice in one JSON object");
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

}  // namespace memplan
