#include "estimator/shape_list.h"

#include <algorithm>
#include <cmath>
#include <exception>
#include <memory>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "common/json.h"
#include "estimator/config_reader.h"

namespace memplan::estimator {
namespace {

using OrderedJson = nlohmann::ordered_json;

// The deepest real shape list is {"tensors": [{"shape": [..]}]}: four levels. The limit only has
// to stop hostile input before the parser spends memory on it, so it is common/json.h's default.
constexpr int kMaxShapeListDepth = 64;

std::string Describe(const OrderedJson& v) {
  std::string s = v.dump(-1, ' ', false, OrderedJson::error_handler_t::replace);
  if (s.size() > 40) s = s.substr(0, 37) + "...";
  return s;
}

// The wrapper form {"tensors": ...}, told apart from a model with a tensor called "tensors"
// (whose value would be a dim array or an object with a "shape" array).
template <typename Json>
bool IsWrapper(const Json& doc) {
  if (!doc.is_object()) return false;
  auto it = doc.find("tensors");
  if (it == doc.end()) return false;
  if (it->is_object()) {
    auto shape = it->find("shape");
    return shape == it->end() || !shape->is_array();
  }
  return it->is_array() && !it->empty() && it->front().is_object();
}

template <typename Json>
bool LooksLikeShapeListImpl(const Json& doc) {
  if (doc.is_array()) {
    return !doc.empty() &&
           std::all_of(doc.begin(), doc.end(), [](const Json& e) { return e.is_object(); });
  }
  if (!doc.is_object() || doc.empty()) return false;
  if (IsWrapper(doc)) return true;
  auto type = doc.find("model_type");
  if (type != doc.end() && type->is_string()) return false;
  // Every config.json has scalar fields (hidden_size, vocab_size); a shape list has none.
  return std::all_of(doc.begin(), doc.end(),
                     [](const Json& v) { return v.is_array() || v.is_object(); });
}

struct Entry {
  std::string name;
  std::vector<int64_t> shape;
  DType dtype = DType::kF32;
  std::string tied_to;
};

class Reader {
 public:
  explicit Reader(const std::string& source) : source_(source) {}

  Status Read(const OrderedJson& doc, ModelInventory* out);

 private:
  Status Error(std::string_view problem) const {
    return Status::InvalidArgument(source_ + ": " + std::string(problem));
  }
  Status TensorError(std::string_view tensor, std::string_view problem) const {
    return Error("tensor '" + std::string(tensor) + "': " + std::string(problem));
  }

  Status ReadTensors(const OrderedJson& tensors);
  Status ReadSpec(std::string name, const OrderedJson& spec, bool name_in_spec);
  Result<int64_t> ReadDim(const std::string& tensor, size_t index, const OrderedJson& v) const;
  Status ApplyTies(const OrderedJson& tied);
  Status AddAll(ModelInventory* out) const;

  const std::string& source_;
  DType default_dtype_ = DType::kF32;
  std::vector<Entry> entries_;
  std::unordered_map<std::string, size_t> index_;  // name -> position in entries_
};

Status Reader::Read(const OrderedJson& doc, ModelInventory* out) {
  out->name = source_;
  out->source = "shape-list";
  const OrderedJson* tensors = &doc;
  const OrderedJson* tied = nullptr;
  if (IsWrapper(doc)) {
    for (const auto& [key, value] : doc.items()) {
      if (key == "tensors") {
        tensors = &value;
      } else if (key == "model_type") {
        if (!value.is_string()) return Error("field 'model_type': must be a string");
        out->model_type = value.get<std::string>();
      } else if (key == "dtype") {
        if (!value.is_string()) return Error("field 'dtype': must be a string");
        auto dtype = ParseDType(value.get<std::string>());
        if (!dtype.ok()) return dtype.status().WithPrefix(source_ + ": field 'dtype'");
        default_dtype_ = *dtype;
      } else if (key == "tied") {
        tied = &value;
      } else {
        return Error("unknown top-level key '" + key +
                     "' (beside \"tensors\" a shape list may have model_type, dtype, tied)");
      }
    }
  } else if (doc.is_object()) {
    auto type = doc.find("model_type");
    if (type != doc.end() && type->is_string()) {
      return Error("has a string 'model_type', so it looks like a config.json, not a shape list");
    }
  }
  MEMPLAN_RETURN_IF_ERROR(ReadTensors(*tensors));
  if (tied != nullptr) MEMPLAN_RETURN_IF_ERROR(ApplyTies(*tied));
  return AddAll(out);
}

Status Reader::ReadTensors(const OrderedJson& tensors) {
  if ((tensors.is_object() || tensors.is_array()) && tensors.size() > kMaxShapeListTensors) {
    return Error("more than " + std::to_string(kMaxShapeListTensors) + " tensors (" +
                 std::to_string(tensors.size()) + "; the limit for a shape list)");
  }
  if (tensors.is_object()) {
    for (const auto& [name, spec] : tensors.items()) {
      MEMPLAN_RETURN_IF_ERROR(ReadSpec(name, spec, false));
    }
  } else if (tensors.is_array()) {
    for (size_t i = 0; i < tensors.size(); ++i) {
      const OrderedJson& spec = tensors[i];
      auto name = spec.is_object() ? spec.find("name") : spec.end();
      if (!spec.is_object() || name == spec.end() || !name->is_string()) {
        return Error("entry " + std::to_string(i) +
                     ": expected an object with a string \"name\" and a \"shape\", got " +
                     Describe(spec));
      }
      MEMPLAN_RETURN_IF_ERROR(ReadSpec(name->get<std::string>(), spec, true));
    }
  } else {
    return Error(
        "expected a JSON object {\"name\": [dims...]} or an array of "
        "{\"name\", \"shape\"} objects, got " +
        Describe(tensors));
  }
  if (entries_.empty()) {
    return Error("no tensors; a shape list names at least one tensor and its shape");
  }
  return Status::Ok();
}

Result<int64_t> Reader::ReadDim(const std::string& tensor, size_t index,
                                const OrderedJson& v) const {
  const std::string where = "dim " + std::to_string(index) + " is " + Describe(v);
  // Same policy as ConfigReader: integers, or floats with an integral value (4096.0).
  double as_double = 0;
  if (v.is_number_unsigned()) {
    uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(ConfigReader::kMaxDim)) {
      return TensorError(tensor,
                         where + ", above the limit of " + std::to_string(ConfigReader::kMaxDim));
    }
    return static_cast<int64_t>(u);
  }
  if (v.is_number_integer()) {
    as_double = static_cast<double>(v.get<int64_t>());
  } else if (v.is_number_float()) {
    as_double = v.get<double>();
    if (!std::isfinite(as_double) || as_double != std::floor(as_double)) {
      return TensorError(tensor, where + ", must be an integer");
    }
  } else {
    return TensorError(tensor, where + ", must be an integer");
  }
  if (as_double < 0) return TensorError(tensor, where + ", must be >= 0");
  if (as_double > static_cast<double>(ConfigReader::kMaxDim)) {
    return TensorError(tensor,
                       where + ", above the limit of " + std::to_string(ConfigReader::kMaxDim));
  }
  return static_cast<int64_t>(as_double);
}

Status Reader::ReadSpec(std::string name, const OrderedJson& spec, bool name_in_spec) {
  if (name.empty()) return Error("a tensor has an empty name");
  if (index_.count(name) != 0) return TensorError(name, "is listed twice");
  Entry entry;
  entry.dtype = default_dtype_;
  const OrderedJson* shape = nullptr;
  if (spec.is_array()) {
    shape = &spec;
  } else if (spec.is_object()) {
    for (const auto& [key, value] : spec.items()) {
      if (key == "shape") {
        shape = &value;
      } else if (key == "dtype") {
        if (!value.is_string()) {
          return TensorError(name, "dtype must be a string, got " + Describe(value));
        }
        auto dtype = ParseDType(value.get<std::string>());
        if (!dtype.ok()) return TensorError(name, dtype.status().message());
        entry.dtype = *dtype;
      } else if (key == "tied_to") {
        if (value.is_null()) continue;
        if (!value.is_string()) {
          return TensorError(name, "tied_to must be a tensor name, got " + Describe(value));
        }
        entry.tied_to = value.get<std::string>();
      } else if (!(name_in_spec && key == "name")) {
        // A misspelt "dtype" would otherwise silently count the tensor as F32.
        return TensorError(name, "unknown key '" + key + "' (expected shape, dtype, tied_to)");
      }
    }
    if (shape == nullptr) return TensorError(name, "has no \"shape\"");
  } else {
    return TensorError(
        name, "expected a list of dims or an object with \"shape\", got " + Describe(spec));
  }
  if (!shape->is_array()) {
    return TensorError(name, "shape must be a list of dims, got " + Describe(*shape));
  }
  entry.shape.reserve(shape->size());
  for (size_t i = 0; i < shape->size(); ++i) {
    MEMPLAN_ASSIGN_OR_RETURN(int64_t dim, ReadDim(name, i, (*shape)[i]));
    entry.shape.push_back(dim);
  }
  if (entry.tied_to == name) return TensorError(name, "is tied to itself");
  entry.name = std::move(name);
  index_.emplace(entry.name, entries_.size());
  entries_.push_back(std::move(entry));
  return Status::Ok();
}

Status Reader::ApplyTies(const OrderedJson& tied) {
  if (!tied.is_object()) {
    return Error("field 'tied': must be an object {\"alias\": \"canonical\"}, got " +
                 Describe(tied));
  }
  for (const auto& [alias, canonical_json] : tied.items()) {
    if (!canonical_json.is_string()) {
      return Error("field 'tied': alias '" + alias + "' must map to a tensor name, got " +
                   Describe(canonical_json));
    }
    std::string canonical = canonical_json.get<std::string>();
    auto target = index_.find(canonical);
    if (target == index_.end()) {
      return Error("field 'tied': '" + alias + "' is tied to '" + canonical +
                   "', which is not in the tensor list");
    }
    if (alias == canonical) return TensorError(alias, "is tied to itself");
    auto existing = index_.find(alias);
    if (existing != index_.end()) {
      Entry& entry = entries_[existing->second];
      if (!entry.tied_to.empty() && entry.tied_to != canonical) {
        return TensorError(
            alias, "tied_to says '" + entry.tied_to + "' but 'tied' says '" + canonical + "'");
      }
      entry.tied_to = canonical;
      continue;
    }
    // named_parameters() lists a shared Parameter once, so the alias takes its target's shape.
    Entry entry = entries_[target->second];
    entry.name = alias;
    entry.tied_to = canonical;
    index_.emplace(alias, entries_.size());
    entries_.push_back(std::move(entry));
  }
  return Status::Ok();
}

Status Reader::AddAll(ModelInventory* out) const {
  for (const Entry& entry : entries_) {
    if (!entry.tied_to.empty() && index_.count(entry.tied_to) == 0) {
      return TensorError(entry.name, "tied_to '" + entry.tied_to + "' names no tensor in the list");
    }
  }
  // ModelInventory::Add needs a tie target added first; a tensor listed before its target
  // waits for it, keeping document order otherwise. Linear, however long the chains.
  std::unordered_set<std::string> added;
  std::unordered_map<std::string, std::vector<size_t>> waiting;  // target -> entries
  std::vector<size_t> ready;
  auto add = [&](size_t first) -> Status {
    ready.assign(1, first);
    while (!ready.empty()) {
      const Entry& e = entries_[ready.back()];
      ready.pop_back();
      MEMPLAN_RETURN_IF_ERROR(out->Add(e.name, e.shape, e.dtype, e.tied_to).WithPrefix(source_));
      added.insert(e.name);
      auto w = waiting.find(e.name);
      if (w == waiting.end()) continue;
      // Reversed so the stack releases waiters in document order.
      ready.insert(ready.end(), w->second.rbegin(), w->second.rend());
      waiting.erase(w);
    }
    return Status::Ok();
  };
  for (size_t i = 0; i < entries_.size(); ++i) {
    const Entry& e = entries_[i];
    if (e.tied_to.empty() || added.count(e.tied_to) != 0) {
      MEMPLAN_RETURN_IF_ERROR(add(i));
    } else {
      waiting[e.tied_to].push_back(i);
    }
  }
  if (!waiting.empty()) {
    // Every target exists, so what still waits is a cycle; name its earliest member.
    size_t first = entries_.size();
    for (const auto& [target, list] : waiting) first = std::min(first, list.front());
    return TensorError(entries_[first].name,
                       "tied_to '" + entries_[first].tied_to + "' forms a cycle of ties");
  }
  return Status::Ok();
}

}  // namespace

bool LooksLikeShapeList(const nlohmann::ordered_json& doc) { return LooksLikeShapeListImpl(doc); }

bool LooksLikeShapeList(const nlohmann::json& doc) { return LooksLikeShapeListImpl(doc); }

Result<ModelInventory> InventoryFromShapeList(const nlohmann::ordered_json& doc,
                                              const std::string& source) {
  ModelInventory inventory;
  try {
    Reader reader(source);
    MEMPLAN_RETURN_IF_ERROR(reader.Read(doc, &inventory));
  } catch (const std::exception& e) {
    // Only allocation failure can reach here; the reader checks types before every get<>.
    return Status::ResourceExhausted(source + ": cannot read shape list: " + e.what());
  }
  ClassifyTensors(&inventory);  // Note [Tensor roles]: names are all a shape list has
  return inventory;
}

Result<ModelInventory> InventoryFromShapeList(const nlohmann::json& doc,
                                              const std::string& source) {
  OrderedJson ordered;
  try {
    ordered = OrderedJson(doc);
  } catch (const std::exception& e) {
    return Status::ResourceExhausted(source + ": cannot copy shape list: " + e.what());
  }
  return InventoryFromShapeList(ordered, source);
}

Result<ModelInventory> InventoryFromShapeListText(std::string_view text,
                                                  const std::string& source) {
  MEMPLAN_ASSIGN_OR_RETURN(OrderedJson doc, ParseOrderedJsonText(text, source, kMaxShapeListDepth,
                                                                 kMaxShapeListTensors));
  return InventoryFromShapeList(doc, source);
}

}  // namespace memplan::estimator
