#include "planner/check.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <set>

#include "estimator/estimate.h"
#include "common/checked_math.h"
#include "common/printable.h"
#include "estimator/memory_model.h"
#include "estimator/training_setup.h"

namespace memplan::planner {
namespace {

using Keys = std::set<std::string>;

// The keys DeepSpeed (0.16) reads in each section this checker knows. Sections not listed here
// (optimizer/scheduler params, monitors, profilers) are free-form or checked by DeepSpeed itself.
const std::map<std::string, Keys>& Sections() {
  static const auto* kSections = new std::map<std::string, Keys>{
      {"",
       {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
        "steps_per_print", "wall_clock_breakdown", "dump_state", "gradient_clipping",
        "prescale_gradients", "gradient_predivide_factor", "sparse_gradients", "fp16", "bf16",
        "amp", "optimizer", "scheduler", "zero_optimization", "zero_allow_untested_optimizer",
        "zero_force_ds_cpu_optimizer", "activation_checkpointing", "aio", "flops_profiler",
        "tensorboard", "wandb", "csv_monitor", "comet", "communication_data_type",
        "seq_parallel_communication_data_type", "elasticity", "autotuning", "data_efficiency",
        "curriculum_learning", "compression_training", "checkpoint", "data_types", "pipeline",
        "memory_breakdown", "sparse_attention", "eigenvalue", "progressive_layer_drop",
        "quantize_training", "nebula", "disable_allgather", "torch_autocast", "compile",
        "hybrid_engine", "weight_quantization", "timers", "graph_harvesting",
        "use_data_before_expert_parallelism", "dataloader_drop_last", "zero_allow_comm_data_type_fp32",
        "mics_shard_size", "load_universal_checkpoint", "monitor_config"}},
      {"zero_optimization",
       {"stage", "contiguous_gradients", "reduce_scatter", "reduce_bucket_size",
        "use_multi_rank_bucket_allreduce", "allgather_partitions", "allgather_bucket_size",
        "overlap_comm", "load_from_fp32_weights", "elastic_checkpoint", "offload_param",
        "offload_optimizer", "sub_group_size", "cpu_offload", "cpu_offload_param",
        "cpu_offload_use_pin_memory", "prefetch_bucket_size", "stage3_prefetch_bucket_size",
        "param_persistence_threshold", "stage3_param_persistence_threshold",
        "model_persistence_threshold", "stage3_model_persistence_threshold",
        "max_live_parameters", "stage3_max_live_parameters", "max_reuse_distance",
        "stage3_max_reuse_distance", "gather_16bit_weights_on_model_save",
        "stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
        "module_granularity_threshold", "stage3_module_granularity_threshold",
        "use_all_reduce_for_fetch_params", "stage3_use_all_reduce_for_fetch_params",
        "ignore_unused_parameters", "legacy_stage1", "round_robin_gradients",
        "zero_hpz_partition_size", "zero_quantized_weights",
        "zero_quantized_nontrainable_weights", "zero_quantized_gradients", "zeropp_loco_param",
        "mics_shard_size", "mics_hierarchical_params_gather", "memory_efficient_linear",
        "pipeline_loading_checkpoint", "override_module_apply", "log_trace_cache_warnings"}},
      {"zero_optimization.offload_param",
       {"device", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pin_memory"}},
      {"zero_optimization.offload_optimizer",
       {"device", "nvme_path", "buffer_count", "pin_memory", "pipeline_read", "pipeline_write",
        "fast_init", "ratio"}},
      {"aio",
       {"block_size", "queue_depth", "intra_op_parallelism", "single_submit", "overlap_events",
        "use_gds"}},
      {"fp16",
       {"enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window",
        "hysteresis", "consecutive_hysteresis", "min_loss_scale", "fp16_master_weights_and_grads"}},
      {"bf16", {"enabled", "immediate_grad_update", "check_grad_overflow"}},
      {"activation_checkpointing",
       {"partition_activations", "contiguous_memory_optimization", "cpu_checkpointing",
        "number_checkpoints", "synchronize_checkpoint_boundary", "profile"}},
  };
  return *kSections;
}

// Old names DeepSpeed no longer reads (or reads under a new name): key path -> what to use.
const std::map<std::string, std::string>& Renamed() {
  static const auto* kRenamed = new std::map<std::string, std::string>{
      {"aio.thread_count",
       "renamed intra_op_parallelism in DeepSpeed 0.15 (newer versions ignore thread_count)"},
      {"zero_optimization.cpu_offload",
       "deprecated: use zero_optimization.offload_optimizer {\"device\": \"cpu\"}"},
      {"zero_optimization.cpu_offload_param",
       "deprecated: use zero_optimization.offload_param {\"device\": \"cpu\"}"},
      {"zero_optimization.cpu_offload_use_pin_memory",
       "deprecated: use pin_memory inside offload_optimizer / offload_param"},
      {"zero_optimization.stage3_gather_fp16_weights_on_model_save",
       "renamed stage3_gather_16bit_weights_on_model_save"},
      {"bfloat16", "renamed bf16"},
  };
  return *kRenamed;
}

// Where the Hugging Face Trainer fills "auto".
bool TrainerFills(const std::string& path) {
  static const Keys kFilled = {
      "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
      "gradient_clipping", "fp16.enabled", "bf16.enabled",
      "zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
      "zero_optimization.stage3_param_persistence_threshold"};
  return kFilled.count(path) > 0 || path.rfind("optimizer.params.", 0) == 0 ||
         path.rfind("scheduler.params.", 0) == 0;
}

std::string Join(const std::string& section, const std::string& key) {
  return section.empty() ? key : section + "." + key;
}

std::string Gib(uint64_t bytes) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f GiB", static_cast<double>(bytes) / 0x1p30);
  return text;
}

class Checker {
 public:
  explicit Checker(const CheckOptions& options) : options_(options) {}

  void Problem(std::string path, std::string message) {
    report_.problems.push_back({std::move(path), std::move(message)});
  }

  void CheckKeys(const nlohmann::json& object, const std::string& section) {
    const auto& sections = Sections();
    auto known = sections.find(section);
    if (known == sections.end() || !object.is_object()) return;
    for (const auto& [key, value] : object.items()) {
      const std::string path = Join(section, key);
      if (auto r = Renamed().find(path); r != Renamed().end()) {
        Problem(path, r->second);
        continue;
      }
      if (known->second.count(key) > 0) {
        if (value.is_object() && sections.count(path) > 0) CheckKeys(value, path);
        continue;
      }
      // Known in another section: misplaced.
      std::string home;
      for (const auto& [other, keys] : sections) {
        if (other == section || keys.count(key) == 0) continue;
        const std::string name = other.empty() ? "the top level" : other;
        home = home.empty() ? name : home + " or " + name;
      }
      if (!home.empty()) {
        Problem(path, "belongs in " + home + ", not " +
                          (section.empty() ? std::string("at the top level") : "in " + section) +
                          " (DeepSpeed ignores or rejects it here)");
        continue;
      }
      // Note [Bounded suggestions]: a suggestion is within `limit` edits, and an edit distance is
      // at least the difference in length, so a candidate that differs more in length is not
      // measured: a long key (up to common/json.h's kMaxJsonKeyBytes) costs nothing.
      const size_t limit = std::max<size_t>(2, key.size() / 4);
      std::string nearest;
      size_t best = SIZE_MAX;
      for (const std::string& candidate : known->second) {
        const size_t gap = key.size() > candidate.size() ? key.size() - candidate.size()
                                                         : candidate.size() - key.size();
        if (gap > limit) continue;
        const size_t d = EditDistance(key, candidate);
        if (d < best) {
          best = d;
          nearest = candidate;
        }
      }
      Problem(path, "unknown key" + (best <= limit ? "; did you mean " + nearest + "?"
                                                   : std::string()));
    }
  }

  void Autos(const nlohmann::json& value, const std::string& path) {
    if (value.is_object()) {
      for (const auto& [key, child] : value.items()) Autos(child, Join(path, key));
    } else if (value.is_array()) {
      for (size_t i = 0; i < value.size(); ++i) Autos(value[i], path + "[" + std::to_string(i) + "]");
    } else if (value.is_string() && value.get<std::string>() == "auto") {
      if (!options_.for_hf_trainer) {
        Problem(path, "\"auto\" is filled only by the Hugging Face Trainer (--for-hf-trainer); "
                      "DeepSpeed alone refuses it: give a value");
      } else if (!TrainerFills(path)) {
        Problem(path, "\"auto\" here is not filled by the Hugging Face Trainer: give a value");
      }
    }
  }

  // A positive integer, or nullopt (problem recorded) / absent / "auto".
  std::optional<int64_t> PositiveInt(const nlohmann::json& object, const std::string& section,
                                     const std::string& key) {
    if (!object.is_object() || !object.contains(key)) return std::nullopt;
    const nlohmann::json& v = object[key];
    if (v.is_string() && v.get<std::string>() == "auto") return std::nullopt;
    if (!v.is_number_integer() || v.get<int64_t>() < 1) {
      Problem(Join(section, key), "must be a positive integer, got " + v.dump());
      return std::nullopt;
    }
    return v.get<int64_t>();
  }

  // The factors are any positive int64 a config holds: every product is checked (a wrapped
  // micro x accumulation once reached 0 and the modulo below killed `check` with SIGFPE).
  static std::string Product(std::optional<int64_t> value) {
    return value ? std::to_string(*value) : std::string("more than 2^63");
  }
  static bool MultipleOf(int64_t total, std::optional<int64_t> step) {
    return step && total % *step == 0;
  }

  void Batch(const nlohmann::json& c) {
    auto total = PositiveInt(c, "", "train_batch_size");
    auto micro = PositiveInt(c, "", "train_micro_batch_size_per_gpu");
    auto accum = PositiveInt(c, "", "gradient_accumulation_steps");
    int64_t world = options_.world_size;
    if (world == 0 && options_.cluster) world = options_.cluster->WorldSize();
    if (total && micro && accum) {
      const std::optional<int64_t> want = CheckedProductInt64({*micro, *accum, world});
      const std::optional<int64_t> step = CheckedProductInt64({*micro, *accum});
      if (world > 0 && want != total) {
        Problem("train_batch_size",
                "is " + std::to_string(*total) + " but train_micro_batch_size_per_gpu " +
                    std::to_string(*micro) + " x gradient_accumulation_steps " +
                    std::to_string(*accum) + " x " + std::to_string(world) +
                    " GPUs = " + Product(want));
      } else if (world == 0 && !MultipleOf(*total, step)) {
        Problem("train_batch_size", "is " + std::to_string(*total) +
                                        ", not a multiple of micro-batch x accumulation = " +
                                        Product(step));
      }
    } else if (total && micro && world > 0 &&
               !MultipleOf(*total, CheckedProductInt64({*micro, world}))) {
      Problem("train_batch_size", "is " + std::to_string(*total) +
                                      ", not a multiple of train_micro_batch_size_per_gpu x " +
                                      std::to_string(world) + " GPUs");
    } else if (!c.contains("train_batch_size") && !c.contains("train_micro_batch_size_per_gpu")) {
      Problem("train_batch_size",
              "neither train_batch_size nor train_micro_batch_size_per_gpu is given; DeepSpeed "
              "needs at least one");
    }
  }

  void Precision(const nlohmann::json& c) {
    auto enabled = [&](const char* section) {
      if (!c.contains(section) || !c[section].is_object()) return false;
      const nlohmann::json& s = c[section];
      return s.contains("enabled") && s["enabled"].is_boolean() && s["enabled"].get<bool>();
    };
    if (enabled("fp16") && enabled("bf16")) {
      Problem("bf16.enabled", "fp16 and bf16 are both enabled; DeepSpeed refuses this");
    }
  }

  void Zero(const nlohmann::json& c) {
    if (!c.contains("zero_optimization")) return;
    const nlohmann::json& z = c["zero_optimization"];
    if (!z.is_object()) {
      Problem("zero_optimization", "must be an object");
      return;
    }
    int stage = 0;
    if (z.contains("stage")) {
      const nlohmann::json& s = z["stage"];
      if (!s.is_number_integer() || s.get<int64_t>() < 0 || s.get<int64_t>() > 3) {
        Problem("zero_optimization.stage", "must be 0, 1, 2 or 3, got " + s.dump());
        return;
      }
      stage = s.get<int>();
    }
    for (const char* key : {"overlap_comm", "contiguous_gradients", "reduce_scatter",
                            "allgather_partitions"}) {
      if (z.contains(key) && !z[key].is_boolean()) {
        Problem(Join("zero_optimization", key), "must be true or false, got " + z[key].dump());
      }
    }
    for (const char* which : {"offload_optimizer", "offload_param"}) {
      const std::string path = std::string("zero_optimization.") + which;
      if (!z.contains(which)) continue;
      const nlohmann::json& o = z[which];
      if (o.is_null()) continue;
      if (!o.is_object()) {
        Problem(path, "must be an object");
        continue;
      }
      std::string device = "none";
      if (o.contains("device")) {
        if (!o["device"].is_string()) {
          Problem(path + ".device", "must be \"none\", \"cpu\" or \"nvme\"");
          continue;
        }
        device = o["device"].get<std::string>();
        if (device != "none" && device != "cpu" && device != "nvme") {
          Problem(path + ".device", "must be \"none\", \"cpu\" or \"nvme\", got \"" + device + "\"");
          continue;
        }
      }
      if (device == "none") continue;
      const bool param = std::string(which) == "offload_param";
      if (param && stage != 3) {
        Problem(path, "offload_param needs ZeRO stage 3 (stage is " + std::to_string(stage) +
                          "); DeepSpeed ignores it below stage 3");
      } else if (!param && stage == 0) {
        Problem(path, "offload_optimizer needs ZeRO stage 1, 2 or 3 (stage is 0)");
      } else if (!param && device == "nvme" && stage != 3) {
        Problem(path + ".device", "nvme optimizer offload needs ZeRO stage 3 (ZeRO-Infinity); "
                                  "stage " + std::to_string(stage) + " offloads to cpu only");
      }
      if (device == "nvme" &&
          (!o.contains("nvme_path") || !o["nvme_path"].is_string() ||
           o["nvme_path"].get<std::string>().empty())) {
        Problem(path + ".nvme_path", "device is nvme but no nvme_path is given");
      }
      if (o.contains("pin_memory") && !o["pin_memory"].is_boolean()) {
        Problem(path + ".pin_memory", "must be true or false, got " + o["pin_memory"].dump());
      }
    }
  }

  // Predicted memory with a model and a cluster: fit on the GPUs, CPU RAM, pinned memory, memlock.
  void Fit(const nlohmann::json& c) {
    if (options_.model == nullptr || !options_.cluster) return;
    if (!report_.problems.empty()) {
      report_.notes.push_back("memory not predicted: fix the problems above first");
      return;
    }
    const Cluster& cluster = *options_.cluster;
    // The same setup `memplan estimate --deepspeed` builds: defaults, then the config (which
    // fills DeepSpeed's own defaults where it is silent: fp32, the micro-batch from
    // train_batch_size).
    estimator::TrainingSetup s = options_.setup;
    s.gpus_per_node = cluster.gpus_per_node;
    s.num_nodes = cluster.nodes;
    s.seq_len = options_.seq_len;
    s.flash_attention = options_.flash_attention;
    const int64_t hidden = options_.model->arch ? options_.model->arch->hidden : 0;
    Status applied = estimator::ApplyDeepSpeedConfig(c, "config", {}, hidden, &s);
    if (!applied.ok()) {
      report_.notes.push_back("memory not predicted: " + applied.message());
      return;
    }
    auto m = estimator::EstimateMemory(*options_.model, s);
    if (m.ok()) {
      report_.setup_line = estimator::SetupLine(m->setup);
      report_.predicted = m->peak;
    }
    if (!m.ok()) {
      report_.notes.push_back("memory not predicted: " + m.status().message());
      return;
    }
    const uint64_t usable = static_cast<uint64_t>(static_cast<double>(cluster.gpu.memory_bytes) *
                                                  (1 - options_.gpu_safety_fraction));
    report_.notes.push_back("predicted peak per GPU " + Gib(m->peak.gpu_bytes) + " (" +
                            m->peak.phase + "), CPU per node " + Gib(m->peak.cpu_bytes) +
                            ", pinned " + Gib(m->peak.pinned_bytes) + ", NVMe " +
                            Gib(m->peak.nvme_bytes) + ", seq_len " +
                            std::to_string(m->setup.seq_len));
    if (m->peak.gpu_bytes > usable) {
      Problem("zero_optimization.stage",
              "predicted peak " + Gib(m->peak.gpu_bytes) + " per GPU does not fit " +
                  cluster.gpu.name + " (" + Gib(usable) + " usable of " +
                  Gib(cluster.gpu.memory_bytes) + "); try `memplan plan`");
    }
    if (cluster.cpu_memory_bytes > 0) {
      if (m->peak.cpu_bytes > ScaleDown(cluster.cpu_memory_bytes, 85, 100)) {
        Problem("zero_optimization.offload_optimizer",
                "predicted CPU memory " + Gib(m->peak.cpu_bytes) + " per node exceeds 85% of " +
                    Gib(cluster.cpu_memory_bytes) + " RAM");
      }
      if (m->peak.pinned_bytes > cluster.cpu_memory_bytes / 2) {
        Problem("zero_optimization.offload_optimizer.pin_memory",
                "pins " + Gib(m->peak.pinned_bytes) + " per node, more than half of " +
                    Gib(cluster.cpu_memory_bytes) + " RAM; set pin_memory false or offload less");
      }
    }
    const bool nvme = s.offload_optimizer == estimator::OffloadDevice::kNvme ||
                      s.offload_param == estimator::OffloadDevice::kNvme;
    if (nvme && cluster.memlock_bytes > 0 &&
        m->peak.pinned_bytes / static_cast<uint64_t>(cluster.gpus_per_node) >
            cluster.memlock_bytes) {
      Problem("aio", "each process locks " +
                         Gib(m->peak.pinned_bytes / static_cast<uint64_t>(cluster.gpus_per_node)) +
                         " of swap buffers but RLIMIT_MEMLOCK is " + Gib(cluster.memlock_bytes) +
                         "; raise it (ulimit -l unlimited) or lower buffer_count / buffer_size");
    }
  }

  CheckReport Take() { return std::move(report_); }

 private:
  const CheckOptions& options_;
  CheckReport report_;
};

}  // namespace

size_t EditDistance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = up;
    }
  }
  return row[b.size()];
}

Result<CheckReport> CheckDeepSpeedConfig(const nlohmann::json& config,
                                         const CheckOptions& options) {
  if (!config.is_object()) {
    return Status::InvalidArgument("a DeepSpeed config must be a JSON object");
  }
  Checker checker(options);
  checker.CheckKeys(config, "");
  checker.Autos(config, "");
  checker.Batch(config);
  checker.Precision(config);
  checker.Zero(config);
  checker.Fit(config);
  return checker.Take();
}

nlohmann::json ToJson(const CheckReport& report) {
  nlohmann::json problems = nlohmann::json::array();
  for (const Finding& f : report.problems) {
    problems.push_back({{"path", f.path}, {"message", f.message}});
  }
  nlohmann::json j = {{"ok", report.problems.empty()}, {"problems", problems}, {"notes", report.notes}};
  if (!report.setup_line.empty()) j["setup_line"] = report.setup_line;
  if (report.predicted) {
    const estimator::PeakMemory& p = *report.predicted;
    j["predicted"] = {{"gpu_bytes", p.gpu_bytes}, {"cpu_bytes", p.cpu_bytes},
                      {"nvme_bytes", p.nvme_bytes}, {"pinned_bytes", p.pinned_bytes},
                      {"phase", p.phase}};
  }
  return j;
}

std::string FormatCheckText(const CheckReport& report, const std::string& source) {
  // Key paths and messages quote the config's keys, and `source` is a path: escaped, one line
  // each whatever they hold.
  std::string out = report.setup_line.empty() ? std::string() : report.setup_line + "\n";
  for (const Finding& f : report.problems) {
    out += Printable(f.path) + ": " + Printable(f.message) + "\n";
  }
  for (const std::string& n : report.notes) out += "note: " + Printable(n) + "\n";
  out += report.problems.empty()
             ? "OK: " + Printable(source) + " has no problems memplan knows of\n"
             : std::to_string(report.problems.size()) + " problem(s) in " + Printable(source) +
                   "\n";
  return out;
}

}  // namespace memplan::planner
