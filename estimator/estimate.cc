#include "estimator/estimate.h"

#include <cstdio>

namespace memplan::estimator {
namespace {

nlohmann::json SummaryToJson(const ModelSummary& m) {
  const ModelCounts& c = m.counts;
  return {
      {"name", m.name},
      {"model_type", m.model_type},
      {"architecture", m.architecture},
      {"model_class", m.model_class},
      {"source", m.source},
      {"params_total", c.params_total},
      {"largest_layer_params", c.largest_layer_params},
      {"largest_layer_module", c.largest_layer_module},
      {"largest_block_params", c.largest_block_params},
      {"largest_block", c.largest_block},
      {"num_blocks", c.num_blocks},
      {"num_tensors", c.num_tensors},
      {"num_tied_tensors", c.num_tied},
      {"bytes_as_stored", c.bytes_as_stored},
  };
}

const char* Device(bool offloaded) { return offloaded ? "cpu" : "none"; }

// Typed field access for EstimateFromJson.
class Fields {
 public:
  Fields(nlohmann::json j, std::string where) : j_(std::move(j)), where_(std::move(where)) {}

  template <typename T>
  Status Get(const char* key, T* out) const {
    if (!j_.is_object() || !j_.contains(key)) {
      return Status::InvalidArgument("estimate JSON: " + where_ + "." + key + " is missing");
    }
    try {
      *out = j_.at(key).get<T>();
    } catch (const nlohmann::json::exception&) {
      return Status::InvalidArgument("estimate JSON: " + where_ + "." + key +
                                     " has the wrong type");
    }
    return Status::Ok();
  }
  Status Device(const char* key, bool* offloaded) const {
    std::string value;
    MEMPLAN_RETURN_IF_ERROR(Get(key, &value));
    if (value != "cpu" && value != "none") {
      return Status::InvalidArgument("estimate JSON: " + where_ + "." + key +
                                     " must be \"cpu\" or \"none\"");
    }
    *offloaded = value == "cpu";
    return Status::Ok();
  }

 private:
  nlohmann::json j_;  // a copy: callers pass temporaries from json::value()
  std::string where_;
};

}  // namespace

std::string WithThousands(uint64_t value) {
  std::string digits = std::to_string(value);
  std::string out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out.push_back(',');
    out.push_back(digits[i]);
  }
  return out;
}

Result<Estimate> EstimateModelStates(const ModelInventory& inventory,
                                     const DeepSpeedHardware& hardware) {
  MEMPLAN_RETURN_IF_ERROR(hardware.Validate());
  Estimate e;
  e.model.name = inventory.name;
  e.model.model_type = inventory.model_type;
  e.model.architecture = inventory.architecture;
  e.model.model_class = inventory.model_class;
  e.model.source = inventory.source;
  MEMPLAN_ASSIGN_OR_RETURN(e.model.counts, CountParams(inventory));
  if (e.model.counts.params_total == 0) {
    return Status::InvalidArgument(inventory.name + ": the model has no parameters");
  }
  e.hardware = hardware;
  const ModelCounts& c = e.model.counts;
  MEMPLAN_ASSIGN_OR_RETURN(e.zero2, Zero2Table(c.params_total, hardware));
  MEMPLAN_ASSIGN_OR_RETURN(e.zero3, Zero3Table(c.params_total, c.largest_layer_params, hardware));
  e.assumptions = {
      "Model states only (parameters, gradients, Adam optimizer states), as DeepSpeed's "
      "estimate_zero2/zero3_model_states_mem_needs (DeepSpeed >= 0.14.3) compute them; "
      "activations, buffers and the CUDA context are not included.",
      "params_total counts tied (shared) tensors once and excludes buffers; "
      "largest_layer_params is the most parameters held directly by one module.",
      "cpu_bytes are per node, gpu_bytes per GPU; buffer_factor multiplies CPU memory only.",
  };
  if (inventory.model_class == "base") {
    e.assumptions.push_back(
        "Base model without task head (what AutoModel builds), as in DeepSpeed's examples.");
  }
  return e;
}

nlohmann::json ToJson(const Estimate& e) {
  nlohmann::json zero2 = nlohmann::json::array();
  for (const Zero2Row& r : e.zero2) {
    zero2.push_back({{"offload_optimizer", Device(r.offload_optimizer)},
                     {"cpu_bytes", r.cpu_bytes},
                     {"gpu_bytes", r.gpu_bytes}});
  }
  nlohmann::json zero3 = nlohmann::json::array();
  for (const Zero3Row& r : e.zero3) {
    zero3.push_back({{"offload_param", Device(r.offload_param)},
                     {"offload_optimizer", Device(r.offload_optimizer)},
                     {"zero_init", r.zero_init ? 1 : 0},
                     {"cpu_bytes", r.cpu_bytes},
                     {"gpu_bytes", r.gpu_bytes}});
  }
  return {
      {"model", SummaryToJson(e.model)},
      {"hardware",
       {{"nodes", e.hardware.nodes},
        {"gpus_per_node", e.hardware.gpus_per_node},
        {"buffer_factor", e.hardware.buffer_factor}}},
      {"deepspeed",
       {{"reproduces",
         "deepspeed>=0.14.3 estimate_zero2_model_states_mem_needs, "
         "estimate_zero3_model_states_mem_needs"},
        {"zero2", zero2},
        {"zero3", zero3}}},
      {"assumptions", e.assumptions},
  };
}

Result<Estimate> EstimateFromJson(const nlohmann::json& json) {
  Estimate e;
  Fields top(json, "");
  if (!json.is_object()) return Status::InvalidArgument("estimate JSON: expected an object");
  Fields model(json.value("model", nlohmann::json()), "model");
  ModelSummary& m = e.model;
  MEMPLAN_RETURN_IF_ERROR(model.Get("name", &m.name));
  MEMPLAN_RETURN_IF_ERROR(model.Get("model_type", &m.model_type));
  MEMPLAN_RETURN_IF_ERROR(model.Get("architecture", &m.architecture));
  MEMPLAN_RETURN_IF_ERROR(model.Get("model_class", &m.model_class));
  MEMPLAN_RETURN_IF_ERROR(model.Get("source", &m.source));
  MEMPLAN_RETURN_IF_ERROR(model.Get("params_total", &m.counts.params_total));
  MEMPLAN_RETURN_IF_ERROR(model.Get("largest_layer_params", &m.counts.largest_layer_params));
  MEMPLAN_RETURN_IF_ERROR(model.Get("largest_layer_module", &m.counts.largest_layer_module));
  MEMPLAN_RETURN_IF_ERROR(model.Get("largest_block_params", &m.counts.largest_block_params));
  MEMPLAN_RETURN_IF_ERROR(model.Get("largest_block", &m.counts.largest_block));
  MEMPLAN_RETURN_IF_ERROR(model.Get("num_blocks", &m.counts.num_blocks));
  MEMPLAN_RETURN_IF_ERROR(model.Get("num_tensors", &m.counts.num_tensors));
  MEMPLAN_RETURN_IF_ERROR(model.Get("num_tied_tensors", &m.counts.num_tied));
  MEMPLAN_RETURN_IF_ERROR(model.Get("bytes_as_stored", &m.counts.bytes_as_stored));
  Fields hw(json.value("hardware", nlohmann::json()), "hardware");
  MEMPLAN_RETURN_IF_ERROR(hw.Get("nodes", &e.hardware.nodes));
  MEMPLAN_RETURN_IF_ERROR(hw.Get("gpus_per_node", &e.hardware.gpus_per_node));
  MEMPLAN_RETURN_IF_ERROR(hw.Get("buffer_factor", &e.hardware.buffer_factor));
  MEMPLAN_RETURN_IF_ERROR(e.hardware.Validate());
  const nlohmann::json ds = json.value("deepspeed", nlohmann::json());
  for (const char* stage : {"zero2", "zero3"}) {
    if (!ds.is_object() || !ds.contains(stage) || !ds[stage].is_array()) {
      return Status::InvalidArgument(std::string("estimate JSON: deepspeed.") + stage +
                                     " must be a list");
    }
  }
  for (const auto& row_json : ds["zero2"]) {
    Fields row(row_json, "deepspeed.zero2[]");
    Zero2Row r;
    MEMPLAN_RETURN_IF_ERROR(row.Device("offload_optimizer", &r.offload_optimizer));
    MEMPLAN_RETURN_IF_ERROR(row.Get("cpu_bytes", &r.cpu_bytes));
    MEMPLAN_RETURN_IF_ERROR(row.Get("gpu_bytes", &r.gpu_bytes));
    e.zero2.push_back(r);
  }
  for (const auto& row_json : ds["zero3"]) {
    Fields row(row_json, "deepspeed.zero3[]");
    Zero3Row r;
    int zero_init = 0;
    MEMPLAN_RETURN_IF_ERROR(row.Device("offload_param", &r.offload_param));
    MEMPLAN_RETURN_IF_ERROR(row.Device("offload_optimizer", &r.offload_optimizer));
    MEMPLAN_RETURN_IF_ERROR(row.Get("zero_init", &zero_init));
    MEMPLAN_RETURN_IF_ERROR(row.Get("cpu_bytes", &r.cpu_bytes));
    MEMPLAN_RETURN_IF_ERROR(row.Get("gpu_bytes", &r.gpu_bytes));
    r.zero_init = zero_init != 0;
    e.zero3.push_back(r);
  }
  MEMPLAN_RETURN_IF_ERROR(top.Get("assumptions", &e.assumptions));
  return e;
}

std::string FormatEstimateText(const Estimate& e) {
  const ModelSummary& m = e.model;
  const ModelCounts& c = m.counts;
  std::string out = "Model: " + m.name;
  std::string kind = m.architecture;
  if (!m.model_type.empty()) kind += (kind.empty() ? "" : ", ") + m.model_type;
  if (!kind.empty()) out += " (" + kind + ")";
  out += "\n  params_total          " + WithThousands(c.params_total) +
         "\n  largest_layer_params  " + WithThousands(c.largest_layer_params);
  if (c.largest_layer_params > 0) {
    out += "  (" + (c.largest_layer_module.empty() ? "<root>" : c.largest_layer_module) + ")";
  }
  if (c.largest_block_params > 0) {
    out += "\n  largest_block_params  " + WithThousands(c.largest_block_params) + "  (" +
           c.largest_block + ", one of " + std::to_string(c.num_blocks) + " blocks)";
  }
  out += "\n\nZeRO-2, DeepSpeed estimate_zero2_model_states_mem_needs:\n";
  out += FormatZero2Text(c.params_total, e.hardware, e.zero2);
  out += "\nZeRO-3, DeepSpeed estimate_zero3_model_states_mem_needs:\n";
  out += FormatZero3Text(c.params_total, c.largest_layer_params, e.hardware, e.zero3);
  char factor[64];
  std::snprintf(factor, sizeof(factor), "%g", e.hardware.buffer_factor);
  out += "\n\"GB\" above is DeepSpeed's label for GiB (2^30 bytes). CPU is per node, GPU per GPU;\n"
         "model states only (no activations, buffers or CUDA context); buffer factor " +
         std::string(factor) + " on CPU.\nExact bytes: --format json.\n";
  return out;
}

nlohmann::json InventoryToJson(const ModelInventory& inventory, const ModelCounts& counts) {
  ModelSummary summary{inventory.name, inventory.model_type, inventory.architecture,
                       inventory.model_class, inventory.source, counts};
  nlohmann::json tensors = nlohmann::json::array();
  for (const TensorInfo& t : inventory.tensors) {
    tensors.push_back({{"name", t.name},
                       {"shape", t.shape},
                       {"dtype", std::string(DTypeName(t.dtype))},
                       {"numel", t.numel},
                       {"module", t.module},
                       {"block", t.block},
                       {"layer", t.layer},
                       {"tied_to", t.tied_to}});
  }
  return {{"model", SummaryToJson(summary)}, {"tensors", tensors}};
}

std::string FormatInventoryText(const ModelInventory& inventory, const ModelCounts& counts) {
  std::string out;
  size_t width = 4;
  for (const TensorInfo& t : inventory.tensors) width = std::max(width, t.name.size());
  char line[1024];
  for (const TensorInfo& t : inventory.tensors) {
    std::string shape = "[";
    for (size_t i = 0; i < t.shape.size(); ++i) {
      shape += (i ? ", " : "") + std::to_string(t.shape[i]);
    }
    shape += "]";
    std::string note = t.tied_to.empty() ? "" : "  tied to " + t.tied_to;
    std::snprintf(line, sizeof(line), "%-*s  %-6s %-20s %15s%s\n", static_cast<int>(width),
                  t.name.c_str(), std::string(DTypeName(t.dtype)).c_str(), shape.c_str(),
                  WithThousands(t.numel).c_str(), note.c_str());
    out += line;
  }
  out += std::to_string(counts.num_tensors) + " tensors (" + std::to_string(counts.num_tied) +
         " tied), " + WithThousands(counts.params_total) + " parameters\n";
  return out;
}

}  // namespace memplan::estimator
