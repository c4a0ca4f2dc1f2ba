#include "estimator/estimate.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "common/printable.h"

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
      {"buffers_total", c.buffers_total},
      {"accelerate_total_bytes", c.accelerate_total_bytes},
      {"accelerate_largest_layer_bytes", c.accelerate_largest_layer_bytes},
      {"accelerate_largest_layer", c.accelerate_largest_layer},
      {"notes", m.notes},
  };
}

// Fields added after the first release: read when present, so older estimate JSON still loads.
template <typename T>
Status GetIfPresent(const nlohmann::json& object, const char* key, T* out) {
  if (!object.is_object() || !object.contains(key)) return Status::Ok();
  try {
    *out = object.at(key).get<T>();
  } catch (const nlohmann::json::exception&) {
    return Status::InvalidArgument(std::string("estimate JSON: model.") + key +
                                   " has the wrong type");
  }
  return Status::Ok();
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

std::vector<std::string> PhaseList(unsigned phases) {
  std::vector<std::string> out;
  for (Phase p : kPhases) {
    if ((phases & p) != 0) out.push_back(PhaseName(p));
  }
  return out;
}

Result<unsigned> PhaseBits(const std::vector<std::string>& names) {
  unsigned bits = 0;
  for (const std::string& name : names) {
    bool found = false;
    for (Phase p : kPhases) {
      if (PhaseName(p) == name) {
        bits |= p;
        found = true;
      }
    }
    if (!found) return Status::InvalidArgument("estimate JSON: unknown phase '" + name + "'");
  }
  return bits;
}

nlohmann::json PeakToJson(const PeakMemory& p) {
  return {{"gpu_bytes", p.gpu_bytes},
          {"cpu_bytes", p.cpu_bytes},
          {"nvme_bytes", p.nvme_bytes},
          {"pinned_bytes", p.pinned_bytes},
          {"phase", p.phase}};
}

Status PeakFromJson(const Fields& f, PeakMemory* p) {
  MEMPLAN_RETURN_IF_ERROR(f.Get("gpu_bytes", &p->gpu_bytes));
  MEMPLAN_RETURN_IF_ERROR(f.Get("cpu_bytes", &p->cpu_bytes));
  MEMPLAN_RETURN_IF_ERROR(f.Get("nvme_bytes", &p->nvme_bytes));
  MEMPLAN_RETURN_IF_ERROR(f.Get("pinned_bytes", &p->pinned_bytes));
  return f.Get("phase", &p->phase);
}

std::string ConstantText(const ModelConstant& c) {
  char value[64];
  std::snprintf(value, sizeof(value), "%.15g", c.value);
  return c.name + " = " + value + " " + c.unit + ": " + c.source;
}

// Bytes as GiB with two decimals, right-aligned in `width`.
std::string GiB(uint64_t bytes, int width = 8) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%*.2f", width, static_cast<double>(bytes) / (1 << 30));
  return buf;
}

std::string FormatMemoryText(const Estimate& e) {
  const MemoryEstimate& m = *e.memory;
  const TrainingSetup& s = m.setup;
  std::string out = "\nTrainable: " + WithThousands(m.trainable_params) + " of " +
                    WithThousands(m.params_total + m.lora_params) + " parameters";
  if (s.lora_rank > 0) {
    out += " (LoRA rank " + std::to_string(s.lora_rank) + (s.qlora ? ", QLoRA NF4 base" : "") + ")";
  }
  out += "\n\nMemory for this setup (GiB; GPU per GPU; CPU, NVMe and pinned per node):\n";
  char line[512];
  std::snprintf(line, sizeof(line), "  %-28s %8s %8s %8s %8s  %s\n", "item", "GPU", "CPU", "NVMe",
                "pinned", "live in");
  out += line;
  for (const MemoryItem& item : m.items) {
    std::string phases;
    if (item.phases == kAllPhases) {
      phases = "all";
    } else {
      for (const std::string& p : PhaseList(item.phases)) phases += (phases.empty() ? "" : ",") + p;
    }
    std::snprintf(line, sizeof(line), "  %-28s %s %s %s %s  %s\n", item.name.c_str(),
                  GiB(item.gpu_bytes).c_str(), GiB(item.cpu_bytes).c_str(),
                  GiB(item.nvme_bytes).c_str(), GiB(item.pinned_bytes).c_str(), phases.c_str());
    out += line;
  }
  std::snprintf(line, sizeof(line), "  %-28s %s %s %s %s  GPU peak in %s\n", "peak",
                GiB(m.peak.gpu_bytes).c_str(), GiB(m.peak.cpu_bytes).c_str(),
                GiB(m.peak.nvme_bytes).c_str(), GiB(m.peak.pinned_bytes).c_str(),
                m.peak.phase.c_str());
  out += line;
  out += "  GPU by phase:";
  for (const PhaseTotals& p : m.phases) out += "  " + p.phase + " " + GiB(p.gpu_bytes, 0);
  out +=
      "\n  The peak is the largest phase total, not the column sum; items are live only in "
      "their phases.\n";

  out += "\nZeRO stage x offload, same setup (GiB; GPU per GPU; CPU, NVMe and pinned per node):\n";
  std::snprintf(line, sizeof(line), "  %-5s %-5s %-5s %8s  %-14s %8s %8s %8s %8s\n", "stage",
                "optim", "param", "GPU", "GPU phase", "activ.", "CPU", "pinned", "NVMe");
  out += line;
  for (const ComparisonRow& r : e.comparison) {
    if (!r.valid) {
      std::snprintf(line, sizeof(line), "  %-5d %-5s %-5s  n/a: %s\n", r.zero_stage,
                    std::string(OffloadDeviceName(r.offload_optimizer)).c_str(),
                    std::string(OffloadDeviceName(r.offload_param)).c_str(), r.reason.c_str());
    } else {
      std::snprintf(line, sizeof(line), "  %-5d %-5s %-5s %s  %-14s %s %s %s %s\n", r.zero_stage,
                    std::string(OffloadDeviceName(r.offload_optimizer)).c_str(),
                    std::string(OffloadDeviceName(r.offload_param)).c_str(),
                    GiB(r.peak.gpu_bytes).c_str(), r.peak.phase.c_str(),
                    GiB(r.activations_gpu_bytes).c_str(), GiB(r.peak.cpu_bytes).c_str(),
                    GiB(r.peak.pinned_bytes).c_str(), GiB(r.peak.nvme_bytes).c_str());
    }
    out += line;
  }
  out += "GPU includes activations, buffers, the CUDA context (" + GiB(s.cuda_context_bytes, 0) +
         " GiB) and a 10% allocator margin on activations and temporaries. Assumptions and "
         "constants: --format json.\n";
  return out;
}

}  // namespace

std::string SetupLine(const TrainingSetup& s, bool searched) {
  std::string optimizer = std::string(OptimizerName(s.optimizer));
  if (s.optimizer == Optimizer::kSgd && s.sgd_momentum > 0) {
    char m[32];
    std::snprintf(m, sizeof(m), "%g", s.sgd_momentum);
    optimizer += std::string(" momentum ") + m;
  }
  optimizer += s.fused_optimizer ? " (fused)" : s.foreach ? " (foreach)" : " (for-loop)";
  std::string out = "Training setup: " + std::string(PrecisionName(s.precision)) +
                    (s.autocast ? " (torch.autocast)" : "") + ", " + optimizer;
  if (searched) {
    out += ", seq " + std::to_string(s.seq_len);
  } else {
    out += ", ZeRO-" + std::to_string(s.zero_stage) + " (offload optimizer " +
           std::string(OffloadDeviceName(s.offload_optimizer)) + ", param " +
           std::string(OffloadDeviceName(s.offload_param)) + "), micro-batch " +
           std::to_string(s.micro_batch) + " x seq " + std::to_string(s.seq_len) + ", grad-accum " +
           std::to_string(s.grad_accum) + ", checkpointing " +
           std::string(CheckpointingName(s.checkpointing));
  }
  out += std::string(", flash attention ") + (s.flash_attention ? "on" : "off") + ", tp " +
         std::to_string(s.tp) + (s.sequence_parallel ? " (sequence parallel)" : "");
  if (s.lora_rank > 0) {
    out += ", LoRA rank " + std::to_string(s.lora_rank) + (s.qlora ? " QLoRA" : "");
  }
  if (searched) out += "; searched: ZeRO stage, offload, checkpointing, micro-batch";
  return out;
}

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
  for (const std::string& note : inventory.notes) e.assumptions.push_back(note);
  e.model.notes = inventory.notes;
  return e;
}

nlohmann::json InferenceToJson(const InferenceEstimate& x) {
  nlohmann::json weights = nlohmann::json::array();
  for (const WeightsRow& r : x.weights) {
    nlohmann::json row = {{"dtype", r.dtype},
                          {"bits", r.bits},
                          {"total_bytes", r.total_bytes},
                          {"largest_layer_bytes", r.largest_layer_bytes}};
    if (r.method != "accelerate") {
      row["method"] = r.method;
      row["quantized_params"] = r.quantized_params;
    }
    weights.push_back(std::move(row));
  }
  nlohmann::json j = {
      {"reproduces",
       "accelerate estimate-memory (calculate_maximum_sizes of the model in fp32, "
       "divided per dtype); nf4, nf4-dq, gptq-int4: the quantizers' storage per "
       "tensor; KV cache: transformers DynamicCache (EncoderDecoderCache for T5)"},
      {"batch", x.setup.batch},
      {"context", x.setup.context},
      {"largest_layer", x.largest_layer},
      {"weights", weights},
      {"notes", x.notes},
  };
  if (x.kv_cache.has_value()) {
    const KvCache& k = *x.kv_cache;
    j["kv_cache"] = {{"dtype", k.dtype},
                     {"batch", k.batch},
                     {"context", k.context},
                     {"layers", k.layers},
                     {"sliding_layers", k.sliding_layers},
                     {"sliding_window", k.sliding_window},
                     {"heads", k.heads},
                     {"key_dim", k.key_dim},
                     {"value_dim", k.value_dim},
                     {"bytes_per_token", k.bytes_per_token},
                     {"bytes", k.bytes},
                     {"kind", k.kind}};
    if (k.encoder_context > 0) {
      j["kv_cache"]["encoder_context"] = k.encoder_context;
      j["kv_cache"]["cross_attention_bytes"] = k.cross_attention_bytes;
    }
  }
  return j;
}

Result<InferenceEstimate> InferenceFromJson(const nlohmann::json& json) {
  InferenceEstimate x;
  Fields f(json, "inference");
  MEMPLAN_RETURN_IF_ERROR(f.Get("batch", &x.setup.batch));
  MEMPLAN_RETURN_IF_ERROR(f.Get("context", &x.setup.context));
  MEMPLAN_RETURN_IF_ERROR(f.Get("largest_layer", &x.largest_layer));
  MEMPLAN_RETURN_IF_ERROR(f.Get("notes", &x.notes));
  if (!json.contains("weights") || !json["weights"].is_array()) {
    return Status::InvalidArgument("estimate JSON: inference.weights must be a list");
  }
  for (const auto& row_json : json["weights"]) {
    Fields row(row_json, "inference.weights[]");
    WeightsRow r;
    MEMPLAN_RETURN_IF_ERROR(row.Get("dtype", &r.dtype));
    MEMPLAN_RETURN_IF_ERROR(row.Get("bits", &r.bits));
    MEMPLAN_RETURN_IF_ERROR(row.Get("total_bytes", &r.total_bytes));
    MEMPLAN_RETURN_IF_ERROR(row.Get("largest_layer_bytes", &r.largest_layer_bytes));
    MEMPLAN_RETURN_IF_ERROR(GetIfPresent(row_json, "method", &r.method));
    MEMPLAN_RETURN_IF_ERROR(GetIfPresent(row_json, "quantized_params", &r.quantized_params));
    x.weights.push_back(r);
  }
  if (json.contains("kv_cache")) {
    Fields k(json["kv_cache"], "inference.kv_cache");
    KvCache kv;
    MEMPLAN_RETURN_IF_ERROR(k.Get("dtype", &kv.dtype));
    MEMPLAN_RETURN_IF_ERROR(k.Get("batch", &kv.batch));
    MEMPLAN_RETURN_IF_ERROR(k.Get("context", &kv.context));
    MEMPLAN_RETURN_IF_ERROR(k.Get("layers", &kv.layers));
    MEMPLAN_RETURN_IF_ERROR(k.Get("sliding_layers", &kv.sliding_layers));
    MEMPLAN_RETURN_IF_ERROR(k.Get("sliding_window", &kv.sliding_window));
    MEMPLAN_RETURN_IF_ERROR(k.Get("heads", &kv.heads));
    MEMPLAN_RETURN_IF_ERROR(k.Get("key_dim", &kv.key_dim));
    MEMPLAN_RETURN_IF_ERROR(k.Get("value_dim", &kv.value_dim));
    MEMPLAN_RETURN_IF_ERROR(k.Get("bytes_per_token", &kv.bytes_per_token));
    MEMPLAN_RETURN_IF_ERROR(k.Get("bytes", &kv.bytes));
    MEMPLAN_RETURN_IF_ERROR(k.Get("kind", &kv.kind));
    MEMPLAN_RETURN_IF_ERROR(GetIfPresent(json["kv_cache"], "encoder_context", &kv.encoder_context));
    MEMPLAN_RETURN_IF_ERROR(
        GetIfPresent(json["kv_cache"], "cross_attention_bytes", &kv.cross_attention_bytes));
    x.kv_cache = kv;
  }
  return x;
}

// Bytes in the unit that reads best (KiB .. TiB, two decimals), as Accelerate's convert_bytes.
std::string Readable(uint64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024 && unit < 4) {
    value /= 1024;
    ++unit;
  }
  char text[32];
  std::snprintf(text, sizeof text, unit == 0 ? "%.0f %s" : "%.2f %s", value, units[unit]);
  return text;
}

std::string FormatInferenceText(const InferenceEstimate& x) {
  std::string out =
      "\nLoading the weights (accelerate estimate-memory: calculate_maximum_sizes of the model in "
      "fp32, divided per dtype):\n";
  char line[160];
  std::snprintf(line, sizeof line, "  %-18s %14s %14s\n", "dtype", "largest layer", "total size");
  out += line;
  bool quantizers = false;
  for (const WeightsRow& r : x.weights) {
    if (r.method != "accelerate" && !quantizers) {
      quantizers = true;
      out += "4-bit quantizers, tensor by tensor (the rest kept in 16 bits):\n";
    }
    std::snprintf(line, sizeof line, "  %-18s %14s %14s", r.dtype.c_str(),
                  Readable(r.largest_layer_bytes).c_str(), Readable(r.total_bytes).c_str());
    out += line;
    if (r.method != "accelerate") {
      out += "  (" + WithThousands(r.quantized_params) + " params quantized, " + r.method + ")";
    }
    out += "\n";
  }
  if (!x.largest_layer.empty()) out += "  largest layer: " + x.largest_layer + "\n";
  if (x.kv_cache.has_value()) {
    const KvCache& k = *x.kv_cache;
    out += std::string(k.encoder_context > 0 ? "\nKV cache (Transformers' EncoderDecoderCache), "
                                             : "\nKV cache (Transformers' DynamicCache), ") +
           k.dtype + ", batch " + std::to_string(k.batch) + " x context " +
           std::to_string(k.context) + ": " + Readable(k.bytes) + "\n";
    std::string shape = k.kind == "mla" ? "MLA latent " + std::to_string(k.key_dim) +
                                              " + rotary key " + std::to_string(k.value_dim)
                                        : std::to_string(k.heads) + " KV heads x " +
                                              std::to_string(k.key_dim) + " (" + k.kind + ")";
    out += "  " + std::to_string(k.layers) + (k.encoder_context > 0 ? " decoder" : "") +
           " layers, " + shape + ": " + Readable(k.bytes_per_token) + " per token";
    if (k.encoder_context > 0) {
      out += "; self-attention over " + std::to_string(k.context) +
             " decoder tokens and cross-attention over " + std::to_string(k.encoder_context) +
             " encoder tokens (" + Readable(k.cross_attention_bytes) + ")";
    }
    if (k.sliding_layers > 0) {
      out += "; " + std::to_string(k.sliding_layers) + " sliding-window layers keep at most " +
             std::to_string(k.sliding_window - 1) + " tokens";
    }
    out += "\n";
    for (const WeightsRow& r : x.weights) {
      if (r.bits == 16) {
        out +=
            "  weights (" + r.dtype + ") + KV cache: " + Readable(r.total_bytes + k.bytes) + "\n";
      }
    }
  }
  for (const std::string& note : x.notes) out += "  note: " + note + "\n";
  return out;
}

Result<Estimate> EstimateTraining(const ModelInventory& inventory,
                                  const DeepSpeedHardware& hardware, const TrainingSetup& setup) {
  MEMPLAN_ASSIGN_OR_RETURN(Estimate e, EstimateModelStates(inventory, hardware));
  TrainingSetup s = setup;
  s.gpus_per_node = hardware.gpus_per_node;
  s.num_nodes = hardware.nodes;
  MEMPLAN_ASSIGN_OR_RETURN(MemoryEstimate m, EstimateMemory(inventory, s, e.model.counts));
  MEMPLAN_ASSIGN_OR_RETURN(e.comparison, CompareZeroStages(inventory, s, e.model.counts));
  for (const std::string& note : m.notes) e.assumptions.push_back(note);
  for (const ModelConstant& c : m.constants) e.assumptions.push_back(ConstantText(c));
  e.memory = std::move(m);
  return e;
}

Status AddInference(const ModelInventory& inventory, const InferenceSetup& setup,
                    Estimate* estimate) {
  MEMPLAN_ASSIGN_OR_RETURN(InferenceEstimate x,
                           EstimateInference(inventory, estimate->model.counts, setup));
  for (const std::string& note : x.notes) estimate->assumptions.push_back(note);
  estimate->inference = std::move(x);
  return Status::Ok();
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
  nlohmann::json j = {
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
  if (e.inference.has_value()) j["inference"] = InferenceToJson(*e.inference);
  if (!e.memory.has_value()) return j;
  const MemoryEstimate& m = *e.memory;
  j["setup"] = ToJson(m.setup);
  j["training"] = {{"params_total", m.params_total},
                   {"trainable_params", m.trainable_params},
                   {"lora_params", m.lora_params},
                   {"activation_bytes_per_layer", m.activation_bytes_per_layer}};
  nlohmann::json items = nlohmann::json::array();
  for (const MemoryItem& item : m.items) {
    items.push_back({{"item", item.name},
                     {"description", item.description},
                     {"gpu_bytes", item.gpu_bytes},
                     {"cpu_bytes", item.cpu_bytes},
                     {"nvme_bytes", item.nvme_bytes},
                     {"pinned_bytes", item.pinned_bytes},
                     {"phases", PhaseList(item.phases)}});
  }
  j["breakdown"] = items;
  nlohmann::json phases = nlohmann::json::array();
  for (const PhaseTotals& p : m.phases) {
    phases.push_back({{"phase", p.phase},
                      {"gpu_bytes", p.gpu_bytes},
                      {"gpu_allocated_bytes", p.gpu_allocated_bytes},
                      {"cpu_bytes", p.cpu_bytes},
                      {"nvme_bytes", p.nvme_bytes},
                      {"pinned_bytes", p.pinned_bytes}});
  }
  j["phases"] = phases;
  j["peak"] = PeakToJson(m.peak);
  nlohmann::json constants = nlohmann::json::array();
  for (const ModelConstant& c : m.constants) {
    constants.push_back(
        {{"name", c.name}, {"value", c.value}, {"unit", c.unit}, {"source", c.source}});
  }
  j["constants"] = constants;
  nlohmann::json notes = m.notes;
  j["notes"] = notes;
  nlohmann::json rows = nlohmann::json::array();
  for (const ComparisonRow& r : e.comparison) {
    nlohmann::json row = {
        {"zero_stage", r.zero_stage},
        {"offload_optimizer", std::string(OffloadDeviceName(r.offload_optimizer))},
        {"offload_param", std::string(OffloadDeviceName(r.offload_param))},
        {"valid", r.valid}};
    if (r.valid) {
      row["peak"] = PeakToJson(r.peak);
      row["activations_gpu_bytes"] = r.activations_gpu_bytes;
    } else {
      row["reason"] = r.reason;
    }
    rows.push_back(row);
  }
  j["comparison"] = rows;
  return j;
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
  const nlohmann::json model_json = json.value("model", nlohmann::json());
  MEMPLAN_RETURN_IF_ERROR(GetIfPresent(model_json, "buffers_total", &m.counts.buffers_total));
  MEMPLAN_RETURN_IF_ERROR(
      GetIfPresent(model_json, "accelerate_total_bytes", &m.counts.accelerate_total_bytes));
  MEMPLAN_RETURN_IF_ERROR(GetIfPresent(model_json, "accelerate_largest_layer_bytes",
                                       &m.counts.accelerate_largest_layer_bytes));
  MEMPLAN_RETURN_IF_ERROR(
      GetIfPresent(model_json, "accelerate_largest_layer", &m.counts.accelerate_largest_layer));
  MEMPLAN_RETURN_IF_ERROR(GetIfPresent(model_json, "notes", &m.notes));
  Fields hw(json.value("hardware", nlohmann::json()), "hardware");
  MEMPLAN_RETURN_IF_ERROR(hw.Get("nodes", &e.hardware.nodes));
  MEMPLAN_RETURN_IF_ERROR(hw.Get("gpus_per_node", &e.hardware.gpus_per_node));
  MEMPLAN_RETURN_IF_ERROR(hw.Get("buffer_factor", &e.hardware.buffer_factor));
  if (json.contains("inference")) {
    MEMPLAN_ASSIGN_OR_RETURN(e.inference, InferenceFromJson(json["inference"]));
  }
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
  if (!json.contains("setup")) return e;
  MemoryEstimate mem;
  MEMPLAN_ASSIGN_OR_RETURN(mem.setup, TrainingSetupFromJson(json["setup"]));
  Fields training(json.value("training", nlohmann::json()), "training");
  MEMPLAN_RETURN_IF_ERROR(training.Get("params_total", &mem.params_total));
  MEMPLAN_RETURN_IF_ERROR(training.Get("trainable_params", &mem.trainable_params));
  MEMPLAN_RETURN_IF_ERROR(training.Get("lora_params", &mem.lora_params));
  MEMPLAN_RETURN_IF_ERROR(
      training.Get("activation_bytes_per_layer", &mem.activation_bytes_per_layer));
  for (const char* list : {"breakdown", "phases", "constants", "notes", "comparison"}) {
    if (!json.contains(list) || !json[list].is_array()) {
      return Status::InvalidArgument(std::string("estimate JSON: ") + list + " must be a list");
    }
  }
  for (const auto& item_json : json["breakdown"]) {
    Fields f(item_json, "breakdown[]");
    MemoryItem item;
    std::vector<std::string> phases;
    MEMPLAN_RETURN_IF_ERROR(f.Get("item", &item.name));
    MEMPLAN_RETURN_IF_ERROR(f.Get("description", &item.description));
    MEMPLAN_RETURN_IF_ERROR(f.Get("gpu_bytes", &item.gpu_bytes));
    MEMPLAN_RETURN_IF_ERROR(f.Get("cpu_bytes", &item.cpu_bytes));
    MEMPLAN_RETURN_IF_ERROR(f.Get("nvme_bytes", &item.nvme_bytes));
    MEMPLAN_RETURN_IF_ERROR(f.Get("pinned_bytes", &item.pinned_bytes));
    MEMPLAN_RETURN_IF_ERROR(f.Get("phases", &phases));
    MEMPLAN_ASSIGN_OR_RETURN(item.phases, PhaseBits(phases));
    mem.items.push_back(item);
  }
  for (const auto& phase_json : json["phases"]) {
    Fields f(phase_json, "phases[]");
    PhaseTotals p;
    MEMPLAN_RETURN_IF_ERROR(f.Get("phase", &p.phase));
    MEMPLAN_RETURN_IF_ERROR(f.Get("gpu_bytes", &p.gpu_bytes));
    MEMPLAN_RETURN_IF_ERROR(f.Get("gpu_allocated_bytes", &p.gpu_allocated_bytes));
    MEMPLAN_RETURN_IF_ERROR(f.Get("cpu_bytes", &p.cpu_bytes));
    MEMPLAN_RETURN_IF_ERROR(f.Get("nvme_bytes", &p.nvme_bytes));
    MEMPLAN_RETURN_IF_ERROR(f.Get("pinned_bytes", &p.pinned_bytes));
    mem.phases.push_back(p);
  }
  MEMPLAN_RETURN_IF_ERROR(
      PeakFromJson(Fields(json.value("peak", nlohmann::json()), "peak"), &mem.peak));
  for (const auto& c_json : json["constants"]) {
    Fields f(c_json, "constants[]");
    ModelConstant c;
    MEMPLAN_RETURN_IF_ERROR(f.Get("name", &c.name));
    MEMPLAN_RETURN_IF_ERROR(f.Get("value", &c.value));
    MEMPLAN_RETURN_IF_ERROR(f.Get("unit", &c.unit));
    MEMPLAN_RETURN_IF_ERROR(f.Get("source", &c.source));
    mem.constants.push_back(c);
  }
  MEMPLAN_RETURN_IF_ERROR(top.Get("notes", &mem.notes));
  for (const auto& r_json : json["comparison"]) {
    Fields f(r_json, "comparison[]");
    ComparisonRow r;
    std::string opt, param;
    MEMPLAN_RETURN_IF_ERROR(f.Get("zero_stage", &r.zero_stage));
    MEMPLAN_RETURN_IF_ERROR(f.Get("offload_optimizer", &opt));
    MEMPLAN_RETURN_IF_ERROR(f.Get("offload_param", &param));
    MEMPLAN_RETURN_IF_ERROR(f.Get("valid", &r.valid));
    MEMPLAN_ASSIGN_OR_RETURN(r.offload_optimizer, ParseOffloadDevice(opt));
    MEMPLAN_ASSIGN_OR_RETURN(r.offload_param, ParseOffloadDevice(param));
    if (r.valid) {
      MEMPLAN_RETURN_IF_ERROR(PeakFromJson(
          Fields(r_json.value("peak", nlohmann::json()), "comparison[].peak"), &r.peak));
      MEMPLAN_RETURN_IF_ERROR(f.Get("activations_gpu_bytes", &r.activations_gpu_bytes));
    } else {
      MEMPLAN_RETURN_IF_ERROR(f.Get("reason", &r.reason));
    }
    e.comparison.push_back(r);
  }
  e.memory = std::move(mem);
  return e;
}

std::string FormatEstimateText(const Estimate& e) {
  const ModelSummary& m = e.model;
  const ModelCounts& c = m.counts;
  std::string out = e.memory.has_value() ? SetupLine(e.memory->setup) + "\n" : std::string();
  // Names and notes may carry text from the user's files: escaped (common/printable.h).
  out += "Model: " + Printable(m.name);
  std::string kind = m.architecture;
  if (!m.model_type.empty()) kind += (kind.empty() ? "" : ", ") + m.model_type;
  if (!kind.empty()) out += " (" + Printable(kind) + ")";
  out += "\n  params_total          " + WithThousands(c.params_total) +
         "\n  largest_layer_params  " + WithThousands(c.largest_layer_params);
  if (c.largest_layer_params > 0) {
    out += "  (" + (c.largest_layer_module.empty() ? "<root>" : Printable(c.largest_layer_module)) +
           ")";
  }
  if (c.largest_block_params > 0) {
    out += "\n  largest_block_params  " + WithThousands(c.largest_block_params) + "  (" +
           Printable(c.largest_block) + ", one of " + std::to_string(c.num_blocks) + " blocks)";
  }
  for (const std::string& note : m.notes) out += "\n  note: " + Printable(note);
  if (e.inference.has_value() && !e.memory.has_value()) {
    return out + "\n" + FormatInferenceText(*e.inference);
  }
  if (e.inference.has_value()) out += "\n" + FormatInferenceText(*e.inference);
  out += "\n\nZeRO-2, DeepSpeed estimate_zero2_model_states_mem_needs:\n";
  out += FormatZero2Text(c.params_total, e.hardware, e.zero2);
  out += "\nZeRO-3, DeepSpeed estimate_zero3_model_states_mem_needs:\n";
  out += FormatZero3Text(c.params_total, c.largest_layer_params, e.hardware, e.zero3);
  char factor[64];
  std::snprintf(factor, sizeof(factor), "%g", e.hardware.buffer_factor);
  out +=
      "\n\"GB\" above is DeepSpeed's label for GiB (2^30 bytes). CPU is per node, GPU per GPU;\n"
      "model states only (no activations, buffers or CUDA context); buffer factor " +
      std::string(factor) + " on CPU.\nExact bytes: --format json.\n";
  if (e.memory.has_value()) out += FormatMemoryText(e);
  return out;
}

nlohmann::json InventoryToJson(const ModelInventory& inventory, const ModelCounts& counts) {
  ModelSummary summary{inventory.name,        inventory.model_type, inventory.architecture,
                       inventory.model_class, inventory.source,     counts,
                       inventory.notes};
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
  nlohmann::json buffers = nlohmann::json::array();
  for (const TensorInfo& b : inventory.buffers) {
    buffers.push_back({{"name", b.name},
                       {"shape", b.shape},
                       {"dtype", std::string(DTypeName(b.dtype))},
                       {"numel", b.numel}});
  }
  nlohmann::json out = {
      {"model", SummaryToJson(summary)}, {"tensors", tensors}, {"buffers", buffers}};
  if (inventory.arch.has_value() && inventory.arch->mtp_params > 0) {
    out["model"]["mtp_layers"] = inventory.arch->mtp_layers;
    out["model"]["mtp_params"] = inventory.arch->mtp_params;
  }
  if (!inventory.no_split_modules.empty() && inventory.arch.has_value()) {
    out["model"]["no_split_class"] = inventory.arch->no_split_class;
  }
  return out;
}

std::string FormatInventoryText(const ModelInventory& inventory, const ModelCounts& counts) {
  // Names come from the user's file: escaped (a '\n' or an escape sequence in a tensor name must
  // not split a row or reach the terminal), and padded by what is printed, never cut.
  auto pad = [](std::string text, size_t to) {
    if (text.size() < to) text.append(to - text.size(), ' ');
    return text;
  };
  std::vector<std::string> names;
  names.reserve(inventory.tensors.size());
  size_t width = 4;
  for (const TensorInfo& t : inventory.tensors) {
    names.push_back(Printable(t.name));
    width = std::max(width, names.back().size());
  }
  std::string out;
  for (size_t k = 0; k < inventory.tensors.size(); ++k) {
    const TensorInfo& t = inventory.tensors[k];
    std::string shape = "[";
    for (size_t i = 0; i < t.shape.size(); ++i) {
      shape += (i ? ", " : "") + std::to_string(t.shape[i]);
    }
    shape += "]";
    const std::string numel = WithThousands(t.numel);
    out += pad(names[k], width) + "  " + pad(std::string(DTypeName(t.dtype)), 6) + " " +
           pad(shape, 20) + " " + std::string(numel.size() < 15 ? 15 - numel.size() : 0, ' ') +
           numel;
    if (!t.tied_to.empty()) out += "  tied to " + Printable(t.tied_to);
    out += "\n";
  }
  out += std::to_string(counts.num_tensors) + " tensors (" + std::to_string(counts.num_tied) +
         " tied), " + WithThousands(counts.params_total) + " parameters\n";
  return out;
}

}  // namespace memplan::estimator
