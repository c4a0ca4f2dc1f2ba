#include "estimator/safetensors.h"

#include <algorithm>
#include <exception>
#include <filesystem>
#include <map>
#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/checked_math.h"
#include "common/file.h"
#include "common/json.h"
#include "common/printable.h"
#include "estimator/shape_list.h"

namespace memplan::estimator {
namespace {

using OrderedJson = nlohmann::ordered_json;

// An index lists one line per tensor; even a 1T-parameter checkpoint's is a few MB.
constexpr uint64_t kMaxIndexBytes = uint64_t{64} << 20;
// A header is {"name": {"shape": [..]}}, three levels; an index two. Deeper input is hostile.
constexpr int kMaxHeaderJsonDepth = 16;

std::string Describe(const OrderedJson& v) {
  std::string s = v.dump(-1, ' ', false, OrderedJson::error_handler_t::replace);
  if (s.size() > 40) s = s.substr(0, 37) + "...";
  return s;
}

std::string FormatShape(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

// Safetensors spells dtypes exactly ("F32", "BF16"); the looser ParseDType would accept names
// that no safetensors writer produces.
std::optional<DType> SafetensorsDType(std::string_view name) {
  static constexpr DType kAll[] = {
      DType::kF64, DType::kF32, DType::kF16, DType::kBF16, DType::kF8E4M3, DType::kF8E5M2,
      DType::kI64, DType::kI32, DType::kI16, DType::kI8,   DType::kU8,     DType::kBool,
  };
  for (DType d : kAll) {
    if (DTypeName(d) == name) return d;
  }
  return std::nullopt;
}

struct HeaderTensor {
  std::string name;
  std::vector<int64_t> shape;
  DType dtype = DType::kF32;
  uint64_t begin = 0;  // data_offsets, relative to the start of the data section
  uint64_t end = 0;
};

Status TensorError(const std::string& path, const std::string& tensor, std::string_view problem) {
  return Status::InvalidArgument(path + ": tensor '" + tensor + "': " + std::string(problem));
}

std::optional<uint64_t> AsUnsigned(const OrderedJson& v) {
  if (v.is_number_unsigned()) return v.get<uint64_t>();
  if (v.is_number_integer() && v.get<int64_t>() >= 0) {
    return static_cast<uint64_t>(v.get<int64_t>());
  }
  return std::nullopt;
}

// `data_bytes` is std::nullopt for a header-only file (its first 8 + N bytes, as an HTTP range
// request returns them): the offsets are then checked against each other only.
Result<HeaderTensor> ReadEntry(const std::string& path, const std::string& name,
                               const OrderedJson& entry, std::optional<uint64_t> data_bytes) {
  if (!entry.is_object()) {
    return TensorError(
        path, name,
        "expected an object with dtype, shape and data_offsets, got " + Describe(entry));
  }
  HeaderTensor t;
  t.name = name;
  auto dtype = entry.find("dtype");
  if (dtype == entry.end() || !dtype->is_string()) {
    return TensorError(path, name, "missing or non-string \"dtype\"");
  }
  auto parsed_dtype = SafetensorsDType(dtype->get<std::string>());
  if (!parsed_dtype) {
    return TensorError(path, name,
                       "unsupported dtype " + Describe(*dtype) +
                           " (memplan reads F64 F32 F16 BF16 F8_E4M3 F8_E5M2 I64 I32 I16 I8 U8 "
                           "BOOL)");
  }
  t.dtype = *parsed_dtype;

  auto shape = entry.find("shape");
  if (shape == entry.end() || !shape->is_array()) {
    return TensorError(path, name, "missing or non-array \"shape\"");
  }
  t.shape.reserve(shape->size());
  for (size_t i = 0; i < shape->size(); ++i) {
    auto dim = AsUnsigned((*shape)[i]);
    if (!dim || *dim > static_cast<uint64_t>(INT64_MAX)) {
      return TensorError(path, name,
                         "shape dim " + std::to_string(i) + " is " + Describe((*shape)[i]) +
                             ", must be a non-negative integer");
    }
    t.shape.push_back(static_cast<int64_t>(*dim));
  }

  auto offsets = entry.find("data_offsets");
  std::optional<uint64_t> begin;
  std::optional<uint64_t> end;
  if (offsets != entry.end() && offsets->is_array() && offsets->size() == 2) {
    begin = AsUnsigned((*offsets)[0]);
    end = AsUnsigned((*offsets)[1]);
  }
  if (!begin || !end) {
    return TensorError(path, name,
                       "\"data_offsets\" must be [begin, end] with non-negative integers, got " +
                           (offsets == entry.end() ? std::string("nothing") : Describe(*offsets)));
  }
  t.begin = *begin;
  t.end = *end;
  const std::string range =
      "data_offsets [" + std::to_string(t.begin) + ", " + std::to_string(t.end) + "]";
  if (t.begin > t.end) return TensorError(path, name, range + " end before they begin");
  if (data_bytes && t.end > *data_bytes) {
    return TensorError(path, name,
                       range + " lie outside the data section, which holds " +
                           std::to_string(*data_bytes) + " bytes (truncated file?)");
  }
  auto numel = CheckedProduct(t.shape);
  auto bytes =
      numel ? CheckedMul(*numel, static_cast<uint64_t>(DTypeBits(t.dtype) / 8)) : std::nullopt;
  if (!bytes) {
    return Status::OutOfRange(path + ": tensor '" + name + "': shape " + FormatShape(t.shape) +
                              " has more bytes than fit in 64 bits");
  }
  if (*bytes != t.end - t.begin) {
    return TensorError(path, name,
                       range + " span " + std::to_string(t.end - t.begin) + " bytes, but shape " +
                           FormatShape(t.shape) + " of " + std::string(DTypeName(t.dtype)) +
                           " needs " + std::to_string(*bytes));
  }
  return t;
}

// Reads and validates one file's header. Tensors come back sorted by data offset, ties kept in
// header order.
Result<std::vector<HeaderTensor>> ReadHeader(const std::string& path) {
  MEMPLAN_ASSIGN_OR_RETURN(uint64_t file_bytes, FileSize(path));
  if (file_bytes < 8) {
    return Status::InvalidArgument(path + ": file is " + std::to_string(file_bytes) +
                                   " bytes, too short for a safetensors header");
  }
  MEMPLAN_ASSIGN_OR_RETURN(std::string prefix, ReadFileRange(path, 0, 8));
  uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; --i) {
    header_bytes = (header_bytes << 8) | static_cast<unsigned char>(prefix[static_cast<size_t>(i)]);
  }
  // Both checks come before any allocation sized by the header's claim.
  if (header_bytes > file_bytes - 8) {
    return Status::InvalidArgument(path + ": header length " + std::to_string(header_bytes) +
                                   " is larger than the file (" + std::to_string(file_bytes) +
                                   " bytes); not a safetensors file, or truncated");
  }
  if (header_bytes > kMaxSafetensorsHeaderBytes) {
    return Status::InvalidArgument(path + ": header length " + std::to_string(header_bytes) +
                                   " exceeds the " + std::to_string(kMaxSafetensorsHeaderBytes) +
                                   "-byte limit; not a safetensors file");
  }
  MEMPLAN_ASSIGN_OR_RETURN(std::string text, ReadFileRange(path, 8, header_bytes));
  MEMPLAN_ASSIGN_OR_RETURN(OrderedJson header,
                           ParseOrderedJsonText(text, path, kMaxHeaderJsonDepth));
  if (!header.is_object()) {
    return Status::InvalidArgument(path + ": header must be a JSON object, got " +
                                   Describe(header));
  }
  // A file that ends where its header does holds no data at all: a header-only copy (memplan
  // fetches headers that way). A file cut anywhere else is refused by the offsets' check.
  std::optional<uint64_t> data_bytes = file_bytes - 8 - header_bytes;
  if (*data_bytes == 0) data_bytes.reset();
  std::vector<HeaderTensor> tensors;
  tensors.reserve(header.size());
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") continue;  // free-form string map; nothing to estimate from
    MEMPLAN_ASSIGN_OR_RETURN(HeaderTensor t, ReadEntry(path, name, entry, data_bytes));
    tensors.push_back(std::move(t));
  }
  std::stable_sort(tensors.begin(), tensors.end(),
                   [](const HeaderTensor& a, const HeaderTensor& b) { return a.begin < b.begin; });
  for (size_t i = 1; i < tensors.size(); ++i) {
    const HeaderTensor& prev = tensors[i - 1];
    const HeaderTensor& cur = tensors[i];
    if (cur.begin < prev.end) {
      return TensorError(path, cur.name,
                         "data_offsets [" + std::to_string(cur.begin) + ", " +
                             std::to_string(cur.end) + "] overlap those of tensor '" + prev.name +
                             "' [" + std::to_string(prev.begin) + ", " + std::to_string(prev.end) +
                             "]");
    }
  }
  return tensors;
}

// Index entries are resolved against the index's directory, by Note [Paths from data]'s rule
// (common/file.h), the one every fetch and cache writer applies too (model_source.cc checks the
// names of an index from the Hub before fetching a shard's header).
Status CheckShardPath(const std::string& index_path, const std::string& tensor,
                      const std::string& shard) {
  return CheckRelativePath(
      shard, index_path + ": weight_map: tensor '" + Printable(tensor) + "': shard path");
}

Result<ModelInventory> ReadIndex(const std::string& index_path) {
  MEMPLAN_ASSIGN_OR_RETURN(std::string text, ReadFileToString(index_path, kMaxIndexBytes));
  MEMPLAN_ASSIGN_OR_RETURN(OrderedJson index,
                           ParseOrderedJsonText(text, index_path, kMaxHeaderJsonDepth));
  if (!index.is_object()) {
    return Status::InvalidArgument(index_path + ": expected a JSON object with \"weight_map\"");
  }
  auto weight_map = index.find("weight_map");
  if (weight_map == index.end() || !weight_map->is_object()) {
    return Status::InvalidArgument(
        index_path + ": field 'weight_map': missing or not an object {\"tensor\": \"shard\"}");
  }
  if (weight_map->empty()) {
    return Status::InvalidArgument(index_path + ": field 'weight_map': names no tensors");
  }
  std::vector<std::pair<std::string, std::string>> mapping;  // tensor -> shard, as written
  // Sorted by shard name, so model-00001-of-00004 comes first and tensors follow the layers.
  std::map<std::string, std::vector<HeaderTensor>> shards;
  for (const auto& [tensor, shard_json] : weight_map->items()) {
    if (!shard_json.is_string()) {
      return Status::InvalidArgument(index_path + ": weight_map: tensor '" + tensor +
                                     "': shard must be a file name, got " + Describe(shard_json));
    }
    std::string shard = shard_json.get<std::string>();
    MEMPLAN_RETURN_IF_ERROR(CheckShardPath(index_path, tensor, shard));
    shards.emplace(shard, std::vector<HeaderTensor>());
    mapping.emplace_back(tensor, std::move(shard));
  }
  const std::filesystem::path dir = std::filesystem::path(index_path).parent_path();
  // Each shard's header is read once, however many tensors the map puts in it.
  std::unordered_map<std::string, const std::string*> owner;  // tensor -> shard holding it
  for (auto& [shard, tensors] : shards) {
    // A shard not downloaded may be there as its header alone (hub.h writes <shard>.header).
    std::string shard_path = (dir / shard).string();
    std::error_code ec;
    if (!std::filesystem::exists(shard_path, ec) &&
        std::filesystem::exists(shard_path + ".header", ec)) {
      shard_path += ".header";
    }
    auto header = ReadHeader(shard_path);
    if (!header.ok()) return header.status().WithPrefix(index_path + ": shard '" + shard + "'");
    tensors = std::move(header).value();
    for (const HeaderTensor& t : tensors) {
      auto [it, inserted] = owner.emplace(t.name, &shard);
      if (!inserted) {
        return Status::InvalidArgument(index_path + ": tensor '" + t.name + "' is in both '" +
                                       *it->second + "' and '" + shard + "'");
      }
    }
  }
  for (const auto& [tensor, shard] : mapping) {
    auto it = owner.find(tensor);
    if (it == owner.end() || *it->second != shard) {
      return Status::InvalidArgument(
          index_path + ": weight_map puts tensor '" + tensor + "' in '" + shard + "', but " +
          (dir / shard).string() + " has no tensor of that name" +
          (it == owner.end() ? std::string() : " (it is in '" + *it->second + "')"));
    }
  }
  ModelInventory inventory;
  inventory.name = index_path;
  inventory.source = "safetensors";
  // Tensors a shard holds beyond the map are kept: loaders read whole shards, so their bytes
  // are real.
  for (const auto& [shard, tensors] : shards) {
    for (const HeaderTensor& t : tensors) {
      Status added = inventory.Add(t.name, t.shape, t.dtype);
      if (!added.ok()) return added.WithPrefix(index_path + ": shard '" + shard + "'");
    }
  }
  ClassifyTensors(&inventory);  // Note [Tensor roles]: names are all a header has
  return inventory;
}

}  // namespace

Result<ModelInventory> InventoryFromSafetensorsFile(const std::string& path) {
  try {
    MEMPLAN_ASSIGN_OR_RETURN(std::vector<HeaderTensor> tensors, ReadHeader(path));
    // Valid safetensors, but an estimate of nothing would only mislead.
    if (tensors.empty()) return Status::InvalidArgument(path + ": holds no tensors");
    ModelInventory inventory;
    inventory.name = path;
    inventory.source = "safetensors";
    for (HeaderTensor& t : tensors) {
      MEMPLAN_RETURN_IF_ERROR(
          inventory.Add(std::move(t.name), std::move(t.shape), t.dtype).WithPrefix(path));
    }
    ClassifyTensors(&inventory);  // Note [Tensor roles]: names are all a header has
    return inventory;
  } catch (const std::exception& e) {
    // Only allocation failure can reach here: every JSON access is type-checked first.
    return Status::ResourceExhausted(path + ": cannot read safetensors header: " + e.what());
  }
}

Result<ModelInventory> InventoryFromSafetensorsIndex(const std::string& index_path) {
  try {
    return ReadIndex(index_path);
  } catch (const std::exception& e) {
    return Status::ResourceExhausted(index_path + ": cannot read safetensors index: " + e.what());
  }
}

}  // namespace memplan::estimator
