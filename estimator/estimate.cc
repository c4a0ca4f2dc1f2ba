#include "estimator/estimate.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "common/json.h"
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

const char* OffloadName(bool offloaded) { return offloaded ? "cpu" : "none"; }

// EstimateFromJson reads what ToJson wrote: every field required (Note [JSON field reader]), except
// those added after the first release, read when present so that older estimate JSON still loads.
using F = JsonFieldReader;
constexpr const char* kWhere = "estimate JSON";

// The value at `key` of `json`, or null when there is none (its fields then read as missing).
const nlohmann::json& Member(const nlohmann::json& json, const char* key) {
  static const nlohmann::json kNone;
  return json.is_object() && json.contains(key) ? json.at(key) : kNone;
}

// An offload device as the DeepSpeed tables write it: "cpu" or "none".
Status ReadDevice(const JsonFieldReader& r, const char* key, bool* offloaded) {
  std::string value;
  MEMPLAN_RETURN_IF_ERROR(r.Required(key, &value));
  if (value != "cpu" && value != "none") return r.Error(key, "must be \"cpu\" or \"none\"");
  *offloaded = value == "cpu";
  return Status::Ok();
}

// The elements of the list at `key`, each read by `read` with a reader whose path is "key[i].".
template <typename Read>
Status ReadList(const nlohmann::json& json, const std::string& path, const char* key, Read read) {
  const nlohmann::json& list = Member(json, key);
  if (!list.is_array()) {
    return Status::InvalidArgument(std::string(kWhere) + ": '" + path + key + "' must be a list");
  }
  for (size_t i = 0; i < list.size(); ++i) {
    MEMPLAN_RETURN_IF_ERROR(
        read(JsonFieldReader(list[i], kWhere, path + key + "[" + std::to_string(i) + "].")));
  }
  return Status::Ok();
}

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
  return {{"gpu_bytes", p.gpu_bytes},       {"gpu_reserved_bytes", p.gpu_reserved_bytes},
          {"cpu_bytes", p.cpu_bytes},       {"nvme_bytes", p.nvme_bytes},
          {"pinned_bytes", p.pinned_bytes}, {"phase", p.phase}};
}

Status PeakFromJson(const nlohmann::json& json, const std::string& path, PeakMemory* p) {
  const JsonFieldReader f(Member(json, "peak"), kWhere, path + "peak.");
  if (f.Has("gpu_reserved_bytes")) {
    MEMPLAN_RETURN_IF_ERROR(f.Get("gpu_reserved_bytes", &p->gpu_reserved_bytes));
  }
  return f.RequireAll(F::Field("gpu_bytes", &p->gpu_bytes), F::Field("cpu_bytes", &p->cpu_bytes),
                      F::Field("nvme_bytes", &p->nvme_bytes),
                      F::Field("pinned_bytes", &p->pinned_bytes), F::Field("phase", &p->phase));
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
    bool varies = false;
    for (uint64_t b : item.gpu_phase_bytes) varies = varies || (b != 0 && b != item.gpu_bytes);
    if (varies) {
      // The step model's items: their GPU bytes in each phase (the column holds the most).
      for (size_t p = 0; p < std::size(kPhases) && p < item.gpu_phase_bytes.size(); ++p) {
        if ((item.phases & kPhases[p]) == 0) continue;
        phases += (phases.empty() ? "" : ", ") + PhaseName(kPhases[p]) + " " +
                  GiB(item.gpu_phase_bytes[p], 0);
      }
    } else if (item.phases == kAllPhases) {
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
  if (m.step.has_value()) {
    out += "GPU includes activations, buffers, the CUDA context (" + GiB(s.cuda_context_bytes, 0) +
           " GiB) and what the caching allocator holds beyond its live blocks, from the step "
           "model's run of the training code; with room to spare it reserves " +
           GiB(m.peak.gpu_reserved_bytes, 0) +
           " GiB (max_memory_reserved). Assumptions and constants: --format json.\n";
  } else {
    out += "GPU includes activations, buffers, the CUDA context (" + GiB(s.cuda_context_bytes, 0) +
           " GiB) and a 10% allocator margin on activations and temporaries (the step model does "
           "not run this setup: " +
           m.step_error +
           "). Assumptions and constants: --format "
           "json.\n";
  }
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
    // FSDP shards instead of ZeRO (zero_stage then 0 or the matching stage): said as FSDP.
    out += (s.fsdp != FsdpSharding::kNone ? ", FSDP " + std::string(FsdpShardingName(s.fsdp))
                                          : ", ZeRO-" + std::to_string(s.zero_stage)) +
           " (offload optimizer " + std::string(OffloadDeviceName(s.offload_optimizer)) +
           ", param " + std::string(OffloadDeviceName(s.offload_param)) + "), micro-batch " +
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
  const JsonFieldReader f(json, kWhere, "inference.");
  MEMPLAN_RETURN_IF_ERROR(
      f.RequireAll(F::Field("batch", &x.setup.batch), F::Field("context", &x.setup.context),
                   F::Field("largest_layer", &x.largest_layer), F::Field("notes", &x.notes)));
  auto read_weights = [&](const JsonFieldReader& row) -> Status {
    WeightsRow r;
    MEMPLAN_RETURN_IF_ERROR(
        row.RequireAll(F::Field("dtype", &r.dtype), F::Field("bits", &r.bits),
                       F::Field("total_bytes", &r.total_bytes),
                       F::Field("largest_layer_bytes", &r.largest_layer_bytes)));
    MEMPLAN_RETURN_IF_ERROR(row.GetAll(F::Field("method", &r.method),
                                       F::Field("quantized_params", &r.quantized_params)));
    x.weights.push_back(r);
    return Status::Ok();
  };
  MEMPLAN_RETURN_IF_ERROR(ReadList(json, "inference.", "weights", read_weights));
  if (json.contains("kv_cache")) {
    const JsonFieldReader k(json["kv_cache"], kWhere, "inference.kv_cache.");
    KvCache kv;
    MEMPLAN_RETURN_IF_ERROR(
        k.RequireAll(F::Field("dtype", &kv.dtype), F::Field("batch", &kv.batch),
                     F::Field("context", &kv.context), F::Field("layers", &kv.layers),
                     F::Field("sliding_layers", &kv.sliding_layers),
                     F::Field("sliding_window", &kv.sliding_window), F::Field("heads", &kv.heads),
                     F::Field("key_dim", &kv.key_dim), F::Field("value_dim", &kv.value_dim),
                     F::Field("bytes_per_token", &kv.bytes_per_token), F::Field("bytes", &kv.bytes),
                     F::Field("kind", &kv.kind)));
    MEMPLAN_RETURN_IF_ERROR(k.GetAll(F::Field("encoder_context", &kv.encoder_context),
                                     F::Field("cross_attention_bytes", &kv.cross_attention_bytes)));
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
    zero2.push_back({{"offload_optimizer", OffloadName(r.offload_optimizer)},
                     {"cpu_bytes", r.cpu_bytes},
                     {"gpu_bytes", r.gpu_bytes}});
  }
  nlohmann::json zero3 = nlohmann::json::array();
  for (const Zero3Row& r : e.zero3) {
    zero3.push_back({{"offload_param", OffloadName(r.offload_param)},
                     {"offload_optimizer", OffloadName(r.offload_optimizer)},
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
    if (!item.gpu_phase_bytes.empty()) {
      // Note [Items from the step model]: the bytes in each phase; gpu_bytes is their maximum.
      nlohmann::json by_phase = nlohmann::json::object();
      for (size_t p = 0; p < item.gpu_phase_bytes.size() && p < std::size(kPhases); ++p) {
        if ((item.phases & kPhases[p]) != 0) {
          by_phase[PhaseName(kPhases[p])] = item.gpu_phase_bytes[p];
        }
      }
      items.back()["gpu_bytes_by_phase"] = by_phase;
    }
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
  if (!m.step_error.empty()) {
    j["step_model"] = {{"error", m.step_error}, {"unmodelled", m.step_unmodelled}};
  }
  if (m.step.has_value()) {
    nlohmann::json sp = nlohmann::json::object();
    for (int p = 0; p < kStepPhases; ++p) {
      const StepPhasePeak& peak = m.step->phases[static_cast<size_t>(p)];
      nlohmann::json cats = nlohmann::json::object();
      for (int c = 0; c < kStepCategories; ++c) {
        cats[std::string(StepCategoryName(static_cast<StepCategory>(c)))] =
            peak.categories[static_cast<size_t>(c)];
      }
      sp[std::string(StepPhaseName(static_cast<StepPhase>(p)))] = {
          {"peak_bytes", peak.bytes}, {"categories", cats}, {"where", peak.where}};
    }
    j["step_model"] = {{"phases", sp},
                       {"peak_phase", std::string(StepPhaseName(m.step->peak_phase))},
                       {"peak_bytes", m.step->peak_bytes},
                       // Note [The caching allocator's reserve]
                       {"allocator",
                        {{"allocated_bytes", m.step->allocator_allocated_bytes},
                         {"reserved_bytes", m.step->reserved_bytes},
                         {"held_bytes", m.step->held_bytes}}}};
  }
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

namespace {

// The step model's run (or why it did not run), as ToJson writes it under "step_model".
Status StepModelFromJson(const nlohmann::json& sm, MemoryEstimate* mem) {
  const JsonFieldReader step(sm, kWhere, "step_model.");
  if (sm.is_object() && sm.contains("error")) {
    MEMPLAN_RETURN_IF_ERROR(step.Required("error", &mem->step_error));
    MEMPLAN_RETURN_IF_ERROR(step.Get("unmodelled", &mem->step_unmodelled));
  } else {
    StepModel run;
    std::string peak_phase;
    MEMPLAN_RETURN_IF_ERROR(step.RequireAll(F::Field("peak_phase", &peak_phase),
                                            F::Field("peak_bytes", &run.peak_bytes)));
    bool known = false;
    for (int p = 0; p < kStepPhases; ++p) {
      const auto phase = static_cast<StepPhase>(p);
      if (StepPhaseName(phase) == peak_phase) {
        run.peak_phase = phase;
        known = true;
      }
      const std::string name(StepPhaseName(phase));
      const nlohmann::json& one = Member(Member(sm, "phases"), name.c_str());
      const JsonFieldReader fr(one, kWhere, "step_model.phases." + name + ".");
      StepPhasePeak& out = run.phases[static_cast<size_t>(p)];
      MEMPLAN_RETURN_IF_ERROR(
          fr.RequireAll(F::Field("peak_bytes", &out.bytes), F::Field("where", &out.where)));
      const nlohmann::json& cats = Member(one, "categories");
      const JsonFieldReader cr(cats, kWhere, "step_model.phases." + name + ".categories.");
      for (int k = 0; k < kStepCategories; ++k) {
        const std::string cat(StepCategoryName(static_cast<StepCategory>(k)));
        MEMPLAN_RETURN_IF_ERROR(cr.Required(cat.c_str(), &out.categories[static_cast<size_t>(k)]));
      }
    }
    if (sm.contains("allocator")) {
      const JsonFieldReader ar(Member(sm, "allocator"), kWhere, "step_model.allocator.");
      MEMPLAN_RETURN_IF_ERROR(
          ar.RequireAll(F::Field("allocated_bytes", &run.allocator_allocated_bytes),
                        F::Field("reserved_bytes", &run.reserved_bytes),
                        F::Field("held_bytes", &run.held_bytes)));
    }
    if (!known) {
      return Status::InvalidArgument(std::string(kWhere) + ": step_model.peak_phase: unknown " +
                                     "phase \"" + peak_phase + "\"");
    }
    mem->step = std::move(run);
  }
  return Status::Ok();
}

}  // namespace

Result<Estimate> EstimateFromJson(const nlohmann::json& json) {
  Estimate e;
  if (!json.is_object()) return Status::InvalidArgument("estimate JSON: expected an object");
  const JsonFieldReader top(json, kWhere);
  const JsonFieldReader model(Member(json, "model"), kWhere, "model.");
  ModelSummary& m = e.model;
  ModelCounts& c = m.counts;
  MEMPLAN_RETURN_IF_ERROR(model.RequireAll(
      F::Field("name", &m.name), F::Field("model_type", &m.model_type),
      F::Field("architecture", &m.architecture), F::Field("model_class", &m.model_class),
      F::Field("source", &m.source), F::Field("params_total", &c.params_total),
      F::Field("largest_layer_params", &c.largest_layer_params),
      F::Field("largest_layer_module", &c.largest_layer_module),
      F::Field("largest_block_params", &c.largest_block_params),
      F::Field("largest_block", &c.largest_block), F::Field("num_blocks", &c.num_blocks),
      F::Field("num_tensors", &c.num_tensors), F::Field("num_tied_tensors", &c.num_tied),
      F::Field("bytes_as_stored", &c.bytes_as_stored)));
  MEMPLAN_RETURN_IF_ERROR(
      model.GetAll(F::Field("buffers_total", &c.buffers_total),
                   F::Field("accelerate_total_bytes", &c.accelerate_total_bytes),
                   F::Field("accelerate_largest_layer_bytes", &c.accelerate_largest_layer_bytes),
                   F::Field("accelerate_largest_layer", &c.accelerate_largest_layer),
                   F::Field("notes", &m.notes)));
  const JsonFieldReader hw(Member(json, "hardware"), kWhere, "hardware.");
  MEMPLAN_RETURN_IF_ERROR(hw.RequireAll(F::Field("nodes", &e.hardware.nodes),
                                        F::Field("gpus_per_node", &e.hardware.gpus_per_node),
                                        F::Field("buffer_factor", &e.hardware.buffer_factor)));
  if (json.contains("inference")) {
    MEMPLAN_ASSIGN_OR_RETURN(e.inference, InferenceFromJson(json["inference"]));
  }
  MEMPLAN_RETURN_IF_ERROR(e.hardware.Validate());
  const nlohmann::json& ds = Member(json, "deepspeed");
  auto read_zero2 = [&](const JsonFieldReader& row) -> Status {
    Zero2Row r;
    MEMPLAN_RETURN_IF_ERROR(ReadDevice(row, "offload_optimizer", &r.offload_optimizer));
    MEMPLAN_RETURN_IF_ERROR(
        row.RequireAll(F::Field("cpu_bytes", &r.cpu_bytes), F::Field("gpu_bytes", &r.gpu_bytes)));
    e.zero2.push_back(r);
    return Status::Ok();
  };
  MEMPLAN_RETURN_IF_ERROR(ReadList(ds, "deepspeed.", "zero2", read_zero2));
  auto read_zero3 = [&](const JsonFieldReader& row) -> Status {
    Zero3Row r;
    int zero_init = 0;
    MEMPLAN_RETURN_IF_ERROR(ReadDevice(row, "offload_param", &r.offload_param));
    MEMPLAN_RETURN_IF_ERROR(ReadDevice(row, "offload_optimizer", &r.offload_optimizer));
    MEMPLAN_RETURN_IF_ERROR(row.RequireAll(F::Field("zero_init", &zero_init),
                                           F::Field("cpu_bytes", &r.cpu_bytes),
                                           F::Field("gpu_bytes", &r.gpu_bytes)));
    r.zero_init = zero_init != 0;
    e.zero3.push_back(r);
    return Status::Ok();
  };
  MEMPLAN_RETURN_IF_ERROR(ReadList(ds, "deepspeed.", "zero3", read_zero3));
  MEMPLAN_RETURN_IF_ERROR(top.Required("assumptions", &e.assumptions));
  if (!json.contains("setup")) return e;
  MemoryEstimate mem;
  MEMPLAN_ASSIGN_OR_RETURN(mem.setup, TrainingSetupFromJson(json["setup"]));
  const JsonFieldReader training(Member(json, "training"), kWhere, "training.");
  MEMPLAN_RETURN_IF_ERROR(
      training.RequireAll(F::Field("params_total", &mem.params_total),
                          F::Field("trainable_params", &mem.trainable_params),
                          F::Field("lora_params", &mem.lora_params),
                          F::Field("activation_bytes_per_layer", &mem.activation_bytes_per_layer)));
  auto read_breakdown = [&](const JsonFieldReader& f) -> Status {
    MemoryItem item;
    std::vector<std::string> phases;
    MEMPLAN_RETURN_IF_ERROR(
        f.RequireAll(F::Field("item", &item.name), F::Field("description", &item.description),
                     F::Field("gpu_bytes", &item.gpu_bytes), F::Field("cpu_bytes", &item.cpu_bytes),
                     F::Field("nvme_bytes", &item.nvme_bytes),
                     F::Field("pinned_bytes", &item.pinned_bytes), F::Field("phases", &phases)));
    MEMPLAN_ASSIGN_OR_RETURN(item.phases, PhaseBits(phases));
    if (f.Has("gpu_bytes_by_phase")) {
      const JsonFieldReader by_phase = f.Child("gpu_bytes_by_phase");
      item.gpu_phase_bytes.assign(std::size(kPhases), 0);
      for (size_t p = 0; p < std::size(kPhases); ++p) {
        const std::string name = PhaseName(kPhases[p]);
        if (!by_phase.Has(name.c_str())) continue;
        MEMPLAN_RETURN_IF_ERROR(by_phase.ByteSize(name.c_str(), &item.gpu_phase_bytes[p]));
      }
    }
    mem.items.push_back(item);
    return Status::Ok();
  };
  MEMPLAN_RETURN_IF_ERROR(ReadList(json, "", "breakdown", read_breakdown));
  auto read_phases = [&](const JsonFieldReader& f) -> Status {
    PhaseTotals p;
    MEMPLAN_RETURN_IF_ERROR(
        f.RequireAll(F::Field("phase", &p.phase), F::Field("gpu_bytes", &p.gpu_bytes),
                     F::Field("gpu_allocated_bytes", &p.gpu_allocated_bytes),
                     F::Field("cpu_bytes", &p.cpu_bytes), F::Field("nvme_bytes", &p.nvme_bytes),
                     F::Field("pinned_bytes", &p.pinned_bytes)));
    mem.phases.push_back(p);
    return Status::Ok();
  };
  MEMPLAN_RETURN_IF_ERROR(ReadList(json, "", "phases", read_phases));
  MEMPLAN_RETURN_IF_ERROR(PeakFromJson(json, "", &mem.peak));
  auto read_constants = [&](const JsonFieldReader& f) -> Status {
    ModelConstant k;
    MEMPLAN_RETURN_IF_ERROR(f.RequireAll(F::Field("name", &k.name), F::Field("value", &k.value),
                                         F::Field("unit", &k.unit), F::Field("source", &k.source)));
    mem.constants.push_back(k);
    return Status::Ok();
  };
  MEMPLAN_RETURN_IF_ERROR(ReadList(json, "", "constants", read_constants));
  MEMPLAN_RETURN_IF_ERROR(top.Required("notes", &mem.notes));
  if (json.contains("step_model")) {
    MEMPLAN_RETURN_IF_ERROR(StepModelFromJson(json["step_model"], &mem));
  }
  auto read_comparison = [&](const JsonFieldReader& f) -> Status {
    ComparisonRow r;
    std::string opt, param;
    MEMPLAN_RETURN_IF_ERROR(
        f.RequireAll(F::Field("zero_stage", &r.zero_stage), F::Field("offload_optimizer", &opt),
                     F::Field("offload_param", &param), F::Field("valid", &r.valid)));
    MEMPLAN_ASSIGN_OR_RETURN(r.offload_optimizer, ParseOffloadDevice(opt));
    MEMPLAN_ASSIGN_OR_RETURN(r.offload_param, ParseOffloadDevice(param));
    if (r.valid) {
      MEMPLAN_RETURN_IF_ERROR(PeakFromJson(f.object(), f.Path(""), &r.peak));
      MEMPLAN_RETURN_IF_ERROR(f.Required("activations_gpu_bytes", &r.activations_gpu_bytes));
    } else {
      MEMPLAN_RETURN_IF_ERROR(f.Required("reason", &r.reason));
    }
    e.comparison.push_back(r);
    return Status::Ok();
  };
  MEMPLAN_RETURN_IF_ERROR(ReadList(json, "", "comparison", read_comparison));
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
