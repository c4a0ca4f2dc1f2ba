#include "estimator/inventory.h"

#include <algorithm>
#include <cctype>
#include <map>
#include <unordered_map>

#include "common/checked_math.h"

namespace memplan::estimator {

std::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF64: return "F64";
    case DType::kF32: return "F32";
    case DType::kF16: return "F16";
    case DType::kBF16: return "BF16";
    case DType::kF8E4M3: return "F8_E4M3";
    case DType::kF8E5M2: return "F8_E5M2";
    case DType::kI64: return "I64";
    case DType::kI32: return "I32";
    case DType::kI16: return "I16";
    case DType::kI8: return "I8";
    case DType::kU8: return "U8";
    case DType::kBool: return "BOOL";
  }
  return "?";
}

int DTypeBits(DType dtype) {
  switch (dtype) {
    case DType::kF64:
    case DType::kI64: return 64;
    case DType::kF32:
    case DType::kI32: return 32;
    case DType::kF16:
    case DType::kBF16:
    case DType::kI16: return 16;
    case DType::kF8E4M3:
    case DType::kF8E5M2:
    case DType::kI8:
    case DType::kU8:
    case DType::kBool: return 8;
  }
  return 0;
}

Result<DType> ParseDType(std::string_view text) {
  std::string s;
  for (char c : text) s.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
  if (s.rfind("torch.", 0) == 0) s = s.substr(6);
  static const std::map<std::string, DType, std::less<>> kNames = {
      {"f64", DType::kF64},        {"float64", DType::kF64},      {"double", DType::kF64},
      {"fp64", DType::kF64},       {"f32", DType::kF32},          {"float32", DType::kF32},
      {"float", DType::kF32},      {"fp32", DType::kF32},         {"f16", DType::kF16},
      {"float16", DType::kF16},    {"half", DType::kF16},         {"fp16", DType::kF16},
      {"bf16", DType::kBF16},      {"bfloat16", DType::kBF16},    {"f8_e4m3", DType::kF8E4M3},
      {"float8_e4m3fn", DType::kF8E4M3}, {"f8_e5m2", DType::kF8E5M2},
      {"float8_e5m2", DType::kF8E5M2},   {"i64", DType::kI64},   {"int64", DType::kI64},
      {"long", DType::kI64},       {"i32", DType::kI32},          {"int32", DType::kI32},
      {"int", DType::kI32},        {"i16", DType::kI16},          {"int16", DType::kI16},
      {"i8", DType::kI8},          {"int8", DType::kI8},          {"u8", DType::kU8},
      {"uint8", DType::kU8},       {"bool", DType::kBool},
  };
  auto it = kNames.find(s);
  if (it == kNames.end()) {
    return Status::InvalidArgument("unknown dtype '" + std::string(text) +
                                   "' (expected e.g. F32, BF16, F16, I8, float32, bfloat16)");
  }
  return it->second;
}

void DeriveModulePath(std::string_view name, std::string* module, std::string* block, int* layer) {
  size_t dot = name.rfind('.');
  *module = dot == std::string_view::npos ? std::string() : std::string(name.substr(0, dot));
  block->clear();
  *layer = -1;
  size_t start = 0;
  // Only module components count; the last component is the parameter's own name.
  while (dot != std::string_view::npos && start < dot) {
    size_t end = name.find('.', start);
    if (end == std::string_view::npos || end > dot) end = dot;
    std::string_view part = name.substr(start, end - start);
    bool digits = !part.empty() && part.size() <= 9 &&
                  std::all_of(part.begin(), part.end(), [](char c) { return c >= '0' && c <= '9'; });
    if (digits) {
      *block = std::string(name.substr(0, end));
      *layer = std::stoi(std::string(part));
      return;
    }
    start = end + 1;
  }
}

std::string ArchitectureInfo::MlpKind() const {
  if (!gated_mlp) return hidden_act;
  if (hidden_act == "silu" || hidden_act == "swish") return "swiglu";
  if (hidden_act.rfind("gelu", 0) == 0) return "geglu";
  if (hidden_act == "relu") return "reglu";
  return "gated-" + hidden_act;
}

int64_t ModelInventory::Find(std::string_view tensor_name) const {
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].name == tensor_name) return static_cast<int64_t>(i);
  }
  return -1;
}

Status ModelInventory::Add(std::string tensor_name, std::vector<int64_t> shape, DType dtype,
                           std::string tied) {
  if (tensor_name.empty()) return Status::InvalidArgument("tensor with an empty name");
  for (int64_t d : shape) {
    if (d < 0) {
      return Status::InvalidArgument("tensor '" + tensor_name + "': negative dimension " +
                                     std::to_string(d));
    }
  }
  auto numel = CheckedProduct(shape);
  if (!numel) {
    return Status::OutOfRange("tensor '" + tensor_name +
                              "': number of elements overflows 64 bits");
  }
  if (!tied.empty()) {
    int64_t target = Find(tied);
    if (target < 0) {
      return Status::InvalidArgument("tensor '" + tensor_name + "' is tied to '" + tied +
                                     "', which is not in the model");
    }
    // Tie to the canonical tensor so chains collapse.
    const TensorInfo& t = tensors[static_cast<size_t>(target)];
    if (t.shape != shape) {
      return Status::InvalidArgument("tensor '" + tensor_name + "' is tied to '" + tied +
                                     "' but has a different shape");
    }
    if (!t.tied_to.empty()) tied = t.tied_to;
  }
  TensorInfo info;
  info.name = std::move(tensor_name);
  info.shape = std::move(shape);
  info.dtype = dtype;
  info.numel = *numel;
  info.tied_to = std::move(tied);
  DeriveModulePath(info.name, &info.module, &info.block, &info.layer);
  tensors.push_back(std::move(info));
  return Status::Ok();
}

Result<ModelCounts> CountParams(const ModelInventory& inventory) {
  ModelCounts counts;
  // Modules in first-appearance (registration) order, so ties go to the module that holds the
  // canonical tensor (model.embed_tokens rather than its tied lm_head).
  std::vector<std::string> module_order;
  std::unordered_map<std::string, uint64_t> per_module;
  std::map<std::string, uint64_t> per_block;
  std::unordered_map<std::string, size_t> seen;
  const Status overflow = Status::OutOfRange("model '" + inventory.name +
                                             "': parameter count overflows 64 bits");
  for (const TensorInfo& t : inventory.tensors) {
    if (!seen.emplace(t.name, 0).second) {
      return Status::InvalidArgument("model '" + inventory.name + "': tensor '" + t.name +
                                     "' appears twice");
    }
    ++counts.num_tensors;
    // DeepSpeed sums module.parameters(recurse=False): a tied alias counts in every module that
    // holds it.
    auto [slot, inserted] = per_module.emplace(t.module, 0);
    if (inserted) module_order.push_back(t.module);
    auto m = CheckedAdd(slot->second, t.numel);
    if (!m) return overflow;
    slot->second = *m;
    if (!t.tied_to.empty()) {
      ++counts.num_tied;
      continue;
    }
    auto total = CheckedAdd(counts.params_total, t.numel);
    if (!total) return overflow;
    counts.params_total = *total;
    auto bytes = CheckedMul(t.numel, static_cast<uint64_t>(DTypeBits(t.dtype)));
    if (!bytes) return overflow;
    auto stored = CheckedAdd(counts.bytes_as_stored, *bytes / 8);
    if (!stored) return overflow;
    counts.bytes_as_stored = *stored;
    if (!t.block.empty()) per_block[t.block] += t.numel;  // bounded by params_total
  }
  for (const std::string& module : module_order) {
    uint64_t n = per_module[module];
    if (n > counts.largest_layer_params) {
      counts.largest_layer_params = n;
      counts.largest_layer_module = module;
    }
  }
  counts.num_blocks = per_block.size();
  for (const auto& [block, n] : per_block) {
    if (n > counts.largest_block_params) {
      counts.largest_block_params = n;
      counts.largest_block = block;
    }
  }
  return counts;
}

}  // namespace memplan::estimator
