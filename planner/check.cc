#include "planner/check.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdio>
#include <map>
#include <optional>
#include <set>

#include "estimator/deepspeed_config.h"
#include "estimator/estimate.h"
#include "common/checked_math.h"
#include "common/printable.h"
#include "common/suggest.h"
#include "estimator/memory_model.h"
#include "estimator/training_setup.h"
#include "planner/search.h"

namespace memplan::planner {
namespace {

using Keys = std::set<std::string>;
using estimator::MemoryItem;

// Note [DeepSpeed's keys]
// The keys DeepSpeed reads in each section this checker knows: 0.16's and 0.19's (each name read
// by either version, less what 0.19 refuses: Removed()). Sections not listed here
// (optimizer/scheduler params, monitors, profilers) are free-form or checked by DeepSpeed itself.
// An unknown key is refused by DeepSpeed in the sections its pydantic classes read
// (RefusesUnknown) and ignored elsewhere: both are problems (a misspelling DeepSpeed ignores is a
// setting silently lost), and the message says which. At the top level and in the sections
// DeepSpeed ignores, a key that starts with "_" is a comment ("_comment" in LLaMA-Factory's
// configs) and is let be. tests/plan_consumers/check_verdicts_test.py puts the same keys through
// DeepSpeed 0.19's own classes.
// Laid out by hand, several keys a line, as DeepSpeed's config reference lists them.
// clang-format off
const std::map<std::string, Keys>& Sections() {
  static const auto* kSections = new std::map<std::string, Keys>{
      {"",
       {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
        "steps_per_print", "wall_clock_breakdown", "dump_state", "gradient_clipping",
        "prescale_gradients", "gradient_predivide_factor", "fp16", "bf16", "optimizer",
        "scheduler", "zero_optimization", "zero_allow_untested_optimizer",
        "zero_force_ds_cpu_optimizer", "activation_checkpointing", "aio", "flops_profiler",
        "tensorboard", "wandb", "csv_monitor", "comet", "comms_logger", "communication_data_type",
        "seq_parallel_communication_data_type", "autotuning", "data_efficiency", "checkpoint",
        "data_types", "pipeline", "memory_breakdown", "disable_allgather", "torch_autocast",
        "compile", "hybrid_engine", "weight_quantization", "timers",
        "use_data_before_expert_parallelism", "dataloader_drop_last", "vocabulary_size",
        "sequence_parallel_size", "data_parallel_size",
        // DeepSpeed 0.19's (0.16 ignores them)
        "tensor_parallel", "expert_parallel", "gradient_allreduce_op", "log_level",
        "managed_gradient_accumulation", "datastates_ckpt", "disable_python_gc"}},
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
        "zero_quantized_nontrainable_weights", "zero_quantized_gradients",
        "memory_efficient_linear", "pipeline_loading_checkpoint", "override_module_apply",
        "log_trace_cache_warnings",
        // DeepSpeed 0.19's (0.16 refuses them)
        "allgather_sequential", "stage3_allgather_sequential", "compute_grad_norm",
        "enable_sanity_checks", "leaf_module", "parameter_alignment",
        "save_muon_momentum_buffer_in_memory", "zenflow"}},
      {"zero_optimization.offload_param",
       {"device", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pin_memory"}},
      {"zero_optimization.offload_optimizer",
       {"device", "nvme_path", "buffer_count", "pin_memory", "pipeline_read", "pipeline_write",
        "fast_init", "ratio", "cpuadam_cores_perc", "super_offload"}},
      {"aio",
       {"block_size", "queue_depth", "intra_op_parallelism", "single_submit", "overlap_events",
        "use_gds"}},
      {"fp16",
       {"enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window",
        "hysteresis", "consecutive_hysteresis", "min_loss_scale", "fp16_master_weights_and_grads"}},
      {"bf16",
       {"enabled", "immediate_grad_update", "check_grad_overflow", "bf16_master_weights_and_grads",
        "bf16_optimizer_states"}},
      {"activation_checkpointing",
       {"partition_activations", "contiguous_memory_optimization", "cpu_checkpointing",
        "number_checkpoints", "synchronize_checkpoint_boundary", "profile"}},
  };
  return *kSections;
}
// clang-format on

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

// What DeepSpeed 0.19 took out, and refuses a config that still has (its runtime/config.py lists
// them with the issue that explains): key path -> what it was. 0.16 read every one.
const std::map<std::string, std::string>& Removed() {
  static const auto* kRemoved = new std::map<std::string, std::string>{
      {"amp", "NVIDIA Apex AMP (use bf16, fp16 or torch_autocast)"},
      {"compression_training", "the compression library"},
      {"curriculum_learning",
       "the top-level curriculum_learning (use "
       "data_efficiency.data_sampling.curriculum_learning)"},
      {"eigenvalue", "eigenvalue-based Mixture-of-Quantization"},
      {"elasticity", "elastic training (set the batch keys directly)"},
      {"graph_harvesting", "graph harvesting"},
      {"nebula", "Nebula checkpointing"},
      {"progressive_layer_drop", "Progressive Layer Dropping"},
      {"quantize_training", "Mixture-of-Quantization"},
      {"sparse_attention", "Sparse Attention"},
      {"sparse_gradients",
       "sparse compression of dense embedding gradients (an embedding built "
       "with sparse=True still reduces sparsely, with no key)"},
      {"zero_optimization.mics_shard_size", "MiCS sharding"},
      {"zero_optimization.mics_hierarchical_params_gather", "MiCS sharding"},
      {"zero_optimization.zeropp_loco_param",
       "LoCo-ZeRO++ (without the key, ZeRO++'s quantized gradients run without LoCo)"},
  };
  return *kRemoved;
}

// The sections DeepSpeed reads with pydantic classes that forbid other keys: an unknown key there
// fails DeepSpeedConfig (fp16 and bf16 since 0.19; 0.16 ignored theirs).
bool RefusesUnknown(const std::string& section) {
  return section == "zero_optimization" || section == "zero_optimization.offload_param" ||
         section == "zero_optimization.offload_optimizer" || section == "fp16" || section == "bf16";
}

// Where the Hugging Face Trainer fills "auto".
bool TrainerFills(const std::string& path) {
  static const Keys kFilled = {"train_batch_size",
                               "train_micro_batch_size_per_gpu",
                               "gradient_accumulation_steps",
                               "gradient_clipping",
                               "fp16.enabled",
                               "bf16.enabled",
                               "zero_optimization.reduce_bucket_size",
                               "zero_optimization.stage3_prefetch_bucket_size",
                               "zero_optimization.stage3_param_persistence_threshold"};
  return kFilled.count(path) > 0 || path.rfind("optimizer.params.", 0) == 0 ||
         path.rfind("scheduler.params.", 0) == 0;
}

// What Accelerate's DeepSpeedPlugin fills in a deepspeed_config_file besides what the Trainer
// (or its Accelerator, the same keys) fills: its __post_init__ sets these from its own settings.
bool AccelerateFills(const std::string& path) {
  static const Keys kFilled = {"zero_optimization.stage",
                               "zero_optimization.offload_optimizer.device",
                               "zero_optimization.offload_optimizer.nvme_path",
                               "zero_optimization.offload_param.device",
                               "zero_optimization.offload_param.nvme_path",
                               "zero_optimization.stage3_gather_16bit_weights_on_model_save"};
  return kFilled.count(path) > 0;
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
    report_.problems.push_back({std::move(path), std::move(message), {}});
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
      if (auto r = Removed().find(path); r != Removed().end()) {
        Problem(path, "removed in DeepSpeed 0.19, which refuses a config that has it: " +
                          r->second + "; delete it (0.16 read it)");
        continue;
      }
      if (!key.empty() && key[0] == '_' && !RefusesUnknown(section)) continue;  // a comment
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
      Problem(path, "unknown key" +
                        (best <= limit ? "; did you mean " + nearest + "?" : std::string()) +
                        (RefusesUnknown(section) ? " (DeepSpeed refuses the config)"
                                                 : " (DeepSpeed ignores it)"));
    }
  }

  void Autos(const nlohmann::json& value, const std::string& path) {
    if (value.is_object()) {
      for (const auto& [key, child] : value.items()) Autos(child, Join(path, key));
    } else if (value.is_array()) {
      for (size_t i = 0; i < value.size(); ++i)
        Autos(value[i], path + "[" + std::to_string(i) + "]");
    } else if (value.is_string() && value.get<std::string>() == "auto") {
      if (!options_.for_hf_trainer) {
        Problem(path,
                "\"auto\" is filled only by the Hugging Face Trainer (`for_hf_trainer`); "
                "DeepSpeed alone refuses it: give a value");
      } else if (!TrainerFills(path) && !(options_.filled_by_accelerate && AccelerateFills(path))) {
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

  // Note [The data-parallel world of the batch]
  // DeepSpeedConfig checks train_batch_size = micro x accumulation x its world_size, which is the
  // data-parallel world, not the GPUs: with Ulysses' `sequence_parallel_size` (DeepSpeed 0.19)
  // it is the GPUs / sequence_parallel_size (runtime/config.py), and with `data_parallel_size`
  // beside it deepspeed.initialize builds a (data, sequence) device mesh that must cover every
  // GPU, whose data dimension is the world. AutoTP's `tensor_parallel.autotp_size` does not
  // change it: deepspeed.initialize builds the config without an mpu, over every GPU.
  // `world` (0 = unknown) becomes the data-parallel world, `gpus` its wording and `keys` the keys
  // that size it; false when they cannot (a problem is reported).
  bool DataParallelWorld(const nlohmann::json& c, int64_t* world, std::string* gpus,
                         std::vector<std::string>* keys) {
    if (!c.contains("sequence_parallel_size")) return true;
    const std::optional<int64_t> sp = PositiveInt(c, "", "sequence_parallel_size");
    if (!sp) return false;
    keys->push_back("sequence_parallel_size");
    if (c.contains("data_parallel_size")) {
      const std::optional<int64_t> given = PositiveInt(c, "", "data_parallel_size");
      if (!given) return false;
      const int64_t dp = *given;
      keys->push_back("data_parallel_size");
      if (*world > 0 && CheckedProductInt64({dp, *sp}) != *world) {
        Problem(
            "data_parallel_size",
            "is " + std::to_string(dp) + " but data_parallel_size x sequence_parallel_size (" +
                Product(CheckedProductInt64({dp, *sp})) + ") must be the " +
                std::to_string(*world) +
                " GPUs: deepspeed.initialize builds its (data, sequence) device mesh from them");
        return false;
      }
      *world = dp;
      *gpus = std::to_string(dp) + " data-parallel ranks (data_parallel_size)";
      return true;
    }
    if (*world == 0) return true;
    if (*world % *sp != 0) {
      Problem("sequence_parallel_size",
              "is " + std::to_string(*sp) + ", which does not divide the " +
                  std::to_string(*world) +
                  " GPUs: DeepSpeed's data-parallel world (GPUs / sequence_parallel_size) is not "
                  "whole and no train_batch_size matches it");
      return false;
    }
    *gpus = std::to_string(*world / *sp) + " data-parallel ranks (" + std::to_string(*world) +
            " GPUs / sequence_parallel_size " + std::to_string(*sp) + ")";
    *world /= *sp;
    return true;
  }

  void Batch(const nlohmann::json& c) {
    auto total = PositiveInt(c, "", "train_batch_size");
    auto micro = PositiveInt(c, "", "train_micro_batch_size_per_gpu");
    auto accum = PositiveInt(c, "", "gradient_accumulation_steps");
    int64_t world = options_.world_size;
    if (world == 0 && options_.cluster) world = options_.cluster->WorldSize();
    std::vector<std::string> keys;  // what besides the batch keys sizes `world`
    std::string gpus = std::to_string(world) + " GPUs";
    if (!DataParallelWorld(c, &world, &gpus, &keys)) return;
    auto problem = [&](std::string message) {
      report_.problems.push_back({"train_batch_size", std::move(message), keys});
    };
    if (total && micro && accum) {
      const std::optional<int64_t> want = CheckedProductInt64({*micro, *accum, world});
      const std::optional<int64_t> step = CheckedProductInt64({*micro, *accum});
      if (world > 0 && want != total) {
        problem("is " + std::to_string(*total) + " but train_micro_batch_size_per_gpu " +
                std::to_string(*micro) + " x gradient_accumulation_steps " +
                std::to_string(*accum) + " x " + gpus + " = " + Product(want));
      } else if (world == 0 && !MultipleOf(*total, step)) {
        problem("is " + std::to_string(*total) +
                ", not a multiple of micro-batch x accumulation = " + Product(step));
      }
    } else if (total && micro && world > 0 &&
               !MultipleOf(*total, CheckedProductInt64({*micro, world}))) {
      problem("is " + std::to_string(*total) +
              ", not a multiple of train_micro_batch_size_per_gpu x " + gpus);
    } else if (total && accum && !micro && world > 0 &&
               !MultipleOf(*total, CheckedProductInt64({*accum, world}))) {
      // DeepSpeed derives the micro-batch as train_batch_size / (accumulation x GPUs).
      problem("is " + std::to_string(*total) +
              ", not a multiple of gradient_accumulation_steps x " + gpus);
    } else if (!c.contains("train_batch_size") && !c.contains("train_micro_batch_size_per_gpu")) {
      Problem("train_batch_size",
              "neither train_batch_size nor train_micro_batch_size_per_gpu is given; DeepSpeed "
              "needs at least one");
    }
  }

  // fp16 / bf16 "enabled": true (not "auto", which the Trainer fills, nor anything else).
  static bool Enabled(const nlohmann::json& c, const char* section) {
    if (!c.contains(section) || !c[section].is_object()) return false;
    const nlohmann::json& s = c[section];
    return s.contains("enabled") && s["enabled"].is_boolean() && s["enabled"].get<bool>();
  }

  // A boolean `key` of section `section` that is true.
  static bool True(const nlohmann::json& c, const char* section, const char* key) {
    if (!c.contains(section) || !c[section].is_object()) return false;
    const nlohmann::json& s = c[section];
    return s.contains(key) && s[key].is_boolean() && s[key].get<bool>();
  }

  static int64_t ZeroStage(const nlohmann::json& c) {
    if (!c.contains("zero_optimization") || !c["zero_optimization"].is_object()) return 0;
    const nlohmann::json& z = c["zero_optimization"];
    return z.contains("stage") && z["stage"].is_number_integer() ? z["stage"].get<int64_t>() : 0;
  }

  void Precision(const nlohmann::json& c) {
    if (Enabled(c, "fp16") && Enabled(c, "bf16")) {
      Problem("bf16.enabled", "fp16 and bf16 are both enabled; DeepSpeed refuses this");
    }
    // 16-bit master weights (DeepSpeed 0.19's runtime/config.py asserts these at start-up).
    const int64_t stage = ZeroStage(c);
    for (const auto& [section, key] : {std::pair{"bf16", "bf16_master_weights_and_grads"},
                                       std::pair{"bf16", "bf16_optimizer_states"},
                                       std::pair{"fp16", "fp16_master_weights_and_grads"}}) {
      if (True(c, section, key) && (stage < 1 || stage > 3)) {
        Problem(Join(section, key), "needs ZeRO stage 1, 2 or 3 (stage is " +
                                        std::to_string(stage) + "); DeepSpeed asserts at start-up");
      }
    }
    if (True(c, "bf16", "bf16_optimizer_states") &&
        !True(c, "bf16", "bf16_master_weights_and_grads")) {
      Problem("bf16.bf16_optimizer_states",
              "needs bf16.bf16_master_weights_and_grads true; DeepSpeed 0.19 asserts at start-up");
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
    for (const char* key :
         {"overlap_comm", "contiguous_gradients", "reduce_scatter", "allgather_partitions"}) {
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
          Problem(path + ".device",
                  "must be \"none\", \"cpu\" or \"nvme\", got \"" + device + "\"");
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
        Problem(path + ".device",
                "nvme optimizer offload needs ZeRO stage 3 (ZeRO-Infinity); "
                "stage " +
                    std::to_string(stage) + " offloads to cpu only");
      }
      if (device == "nvme" && (!o.contains("nvme_path") || !o["nvme_path"].is_string() ||
                               o["nvme_path"].get<std::string>().empty())) {
        Problem(path + ".nvme_path", "device is nvme but no nvme_path is given");
      }
      if (o.contains("pin_memory") && !o["pin_memory"].is_boolean()) {
        Problem(path + ".pin_memory", "must be true or false, got " + o["pin_memory"].dump());
      }
    }
  }

  // Note [Values DeepSpeed refuses]
  // DeepSpeed's pydantic config classes (0.19: runtime/zero/config.py, offload_config.py) refuse
  // reduce_bucket_size <= 0 (0.16 took 0), a negative count, size or threshold anywhere in
  // zero_optimization and its offload sections, and an offload ratio outside [0, 1]; JSON floats
  // with an integral value (5e8) are integers to them, 5.5 is not. Other values pass the config
  // and break at engine start, which check reports the same way:
  //   aio (swap_tensor/aio_config.py reads it unchecked; csrc/aio takes C ints): queue_depth < 1
  //     gives io_queue_init no queue and the submit loop no slot, intra_op_parallelism < 1 no I/O
  //     thread and a zero alignment (a division by it in the swappers), block_size < 1 a division
  //     by it; block_size must also be a multiple of 4096, since the files are opened O_DIRECT and
  //     each request starts at a multiple of block_size; every one must fit a C int.
  //   NVMe offload (partitioned_param_swapper, optimizer_utils): buffer_count 0 leaves no buffer
  //     to swap into, buffer_size 0 none that holds a parameter; with the model, a buffer must hold
  //     the largest swappable parameter partition (get_buffer asserts) and, with the optimizer on
  //     NVMe too, the largest optimizer sub-group (_initialize_from_swapped_fp16_params asserts).
  //   sub_group_size above 2^50 elements (4 PiB of fp32 state) is no sub-grouping at all: absurd.
  // The same configs go through DeepSpeed's own classes in
  // tests/plan_consumers/check_verdicts_test.py.
  std::optional<int64_t> Integer(const nlohmann::json& object, const std::string& section,
                                 const std::string& key, int64_t lo, int64_t hi,
                                 const std::string& why) {
    if (!object.is_object() || !object.contains(key)) return std::nullopt;
    const nlohmann::json& v = object[key];
    if (v.is_null() || (v.is_string() && v.get<std::string>() == "auto")) return std::nullopt;
    // An int64 when the value is one: integers as they are (an unsigned one above 2^63 - 1 is
    // not), floats with an integral value within (-2^63, 2^63) cast.
    std::optional<int64_t> n;
    if (v.is_number_unsigned()) {
      if (v.get<uint64_t>() <= static_cast<uint64_t>(INT64_MAX)) n = v.get<int64_t>();
    } else if (v.is_number_integer()) {
      n = v.get<int64_t>();
    } else if (v.is_number_float()) {
      const double d = v.get<double>();
      if (std::floor(d) == d && std::fabs(d) < 0x1p63) n = static_cast<int64_t>(d);
    }
    if (!n || *n < lo || *n > hi) {
      Problem(Join(section, key), "must be an integer in [" + std::to_string(lo) + ", " +
                                      std::to_string(hi) + "], got " + v.dump() + ": " + why);
      return std::nullopt;
    }
    return n;
  }

  void Values(const nlohmann::json& c) {
    const size_t before = report_.problems.size();
    ValuesOf(c);
    // The swap-buffer checks read these values: not from a config whose values are refused.
    values_ok_ = report_.problems.size() == before;
  }

  void ValuesOf(const nlohmann::json& c) {
    static constexpr int64_t kMax = INT64_MAX;
    static constexpr int64_t kAbsurd = int64_t{1} << 50;
    const std::string refused = "DeepSpeed's config refuses it";
    if (c.contains("zero_optimization") && c["zero_optimization"].is_object()) {
      const nlohmann::json& z = c["zero_optimization"];
      const std::string zs = "zero_optimization";
      Integer(z, zs, "reduce_bucket_size", 1, kMax,
              "DeepSpeed 0.19 refuses 0 (0.16 took it) and every version a negative size");
      for (const char* key :
           {"allgather_bucket_size", "prefetch_bucket_size", "stage3_prefetch_bucket_size",
            "param_persistence_threshold", "stage3_param_persistence_threshold",
            "model_persistence_threshold", "stage3_model_persistence_threshold",
            "max_live_parameters", "stage3_max_live_parameters", "max_reuse_distance",
            "stage3_max_reuse_distance", "zero_hpz_partition_size"}) {
        const auto value = Integer(z, zs, key, 0, kMax, refused);
        if (value && std::string(key).find("max_reuse_distance") != std::string::npos) {
          reuse_distance_ = *value;
        }
      }
      sub_group_size_ = Integer(z, zs, "sub_group_size", 0, kAbsurd,
                                "DeepSpeed refuses a negative one, and more than 2^50 elements "
                                "(4 PiB of fp32 state) is no sub-grouping, only a typo: a "
                                "sub-group's fp32 state is converted and swapped whole, so give at "
                                "most the parameters per GPU (DeepSpeed's default is 1e9)")
                            .value_or(1000000000);
      const bool stage3 = z.contains("stage") && z["stage"] == 3;
      for (const char* which : {"offload_param", "offload_optimizer"}) {
        if (!z.contains(which) || !z[which].is_object()) continue;
        const nlohmann::json& o = z[which];
        const std::string os = zs + "." + which;
        const bool param = std::string(which) == "offload_param";
        const bool nvme = stage3 && o.contains("device") && o["device"] == "nvme";
        const std::string empty = param ? "an NVMe parameter offload swaps through these buffers; "
                                          "DeepSpeed asserts at start-up with none"
                                        : "an NVMe optimizer offload swaps through these buffers; "
                                          "DeepSpeed has none to swap into";
        const auto count =
            Integer(o, os, "buffer_count", nvme ? 1 : 0, kMax, nvme ? empty : refused);
        if (param) {
          param_nvme_ = nvme;
          param_buffer_count_ = count.value_or(5);
          param_buffer_size_ =
              Integer(o, os, "buffer_size", nvme ? 1 : 0, kMax, nvme ? empty : refused)
                  .value_or(100000000);
          Integer(o, os, "max_in_cpu", 0, kMax, refused);
        } else {
          optimizer_nvme_ = nvme;
          if (o.contains("ratio") && !o["ratio"].is_null() &&
              (!o["ratio"].is_number() || o["ratio"].is_boolean() || o["ratio"].get<double>() < 0 ||
               o["ratio"].get<double>() > 1)) {
            Problem(os + ".ratio",
                    "must be a number in [0, 1], got " + o["ratio"].dump() + ": " + refused);
          }
        }
      }
      const nlohmann::json threshold =
          z.contains("stage3_param_persistence_threshold")
              ? z["stage3_param_persistence_threshold"]
              : z.value("param_persistence_threshold", nlohmann::json(100000));
      if (threshold.is_number()) persistence_threshold_ = threshold.get<double>();
    }
    if (!c.contains("aio") || !c["aio"].is_object()) return;
    const nlohmann::json& a = c["aio"];
    const std::string why_int = "DeepSpeed's aio op takes a C int";
    const int64_t kInt = INT32_MAX;
    if (auto block =
            Integer(a, "aio", "block_size", 1, kInt,
                    "each request of the O_DIRECT swap files is block_size long; " + why_int)) {
      if (*block % 4096 != 0) {
        Problem(
            "aio.block_size",
            "is " + std::to_string(*block) +
                ", not a multiple of 4096: the swap files are "
                "opened O_DIRECT and each request starts at a multiple of block_size, which the "
                "kernel refuses (EINVAL) unless it is aligned to the device's 4096-byte blocks");
      }
      aio_block_size_ = *block;
    }
    Integer(a, "aio", "queue_depth", 1, kInt,
            "libaio's io_setup needs at least one slot and DeepSpeed's submit loop waits forever "
            "for one");
    if (auto threads = Integer(a, "aio", "intra_op_parallelism", 1, kInt,
                               "DeepSpeed starts that many I/O threads and divides its alignment "
                               "by it; 0 breaks the first swap")) {
      aio_threads_ = *threads;
    }
    for (const char* key : {"single_submit", "overlap_events", "use_gds"}) {
      if (a.contains(key) && !a[key].is_boolean()) {
        Problem(Join("aio", key), "must be true or false, got " + a[key].dump());
      }
    }
  }

  static bool HalfPrecision(const nlohmann::json& c) {
    return Enabled(c, "fp16") || Enabled(c, "bf16");
  }

  // bf16 on a GPU without it: DeepSpeed's engine raises "Type bf16 is not supported on your
  // device" (engine._do_sanity_check).
  void Bf16(const nlohmann::json& c) {
    if (!options_.cluster || options_.cluster->gpu.bf16_flops > 0) return;
    if (Enabled(c, "bf16")) {
      Problem("bf16.enabled", options_.cluster->gpu.name +
                                  " has no bf16 (DeepSpeed's engine raises \"Type bf16 is not "
                                  "supported on your device\"); use fp16 with loss scaling");
    }
  }

  // Swap buffers against the model (Note [Values DeepSpeed refuses]), as DeepSpeed lays them
  // out: a parameter is swapped when it is above the persistence threshold and its partition
  // (ceil(numel / GPUs) elements) is at least max(1 MiB, aio block) long.
  void SwapBuffers(const nlohmann::json& c) {
    if (!values_ok_ || !param_nvme_ || options_.model == nullptr || !options_.cluster) return;
    const uint64_t world =
        static_cast<uint64_t>(std::max<int64_t>(options_.cluster->WorldSize(), 1));
    const uint64_t elem = HalfPrecision(c) ? 2 : 4;
    const uint64_t min_aio_bytes =
        std::max<uint64_t>(uint64_t{1} << 20, static_cast<uint64_t>(aio_block_size_));
    const uint64_t align = std::max<uint64_t>(1024 * static_cast<uint64_t>(aio_threads_) / elem, 1);
    auto aligned = [&](uint64_t n) { return (n + align - 1) / align * align; };
    uint64_t largest = 0, largest_group = 0, group = 0;
    std::string largest_name;
    for (const estimator::TensorInfo& t : options_.model->tensors) {
      if (!t.tied_to.empty()) continue;
      const uint64_t part = (t.numel + world - 1) / world;
      if (static_cast<double>(t.numel) > persistence_threshold_ && part * elem >= min_aio_bytes &&
          part > largest) {
        largest = part;
        largest_name = t.name;
      }
      group += part;  // stage3._create_fp16_sub_groups: partitions accumulate to sub_group_size
      if (group >= static_cast<uint64_t>(sub_group_size_)) {
        largest_group = std::max(largest_group, group);
        group = 0;
      }
    }
    largest_group = std::max(largest_group, group);
    // A gathered parameter keeps its buffer while it is reused within stage3_max_reuse_distance
    // (partitioned_param_swapper.swap_in asserts "Not enough swap buffers" otherwise).
    const int64_t need = NvmeBuffersNeeded(
        *options_.model, reuse_distance_, static_cast<int64_t>(persistence_threshold_),
        static_cast<int64_t>((min_aio_bytes + elem - 1) / elem), static_cast<int64_t>(world));
    if (param_buffer_count_ < need) {
      report_.problems.push_back(
          {"zero_optimization.offload_param.buffer_count",
           "is " + std::to_string(param_buffer_count_) + ", fewer than the " +
               std::to_string(need) +
               " swap buffers DeepSpeed holds at once: the swapped "
               "parameters within stage3_max_reuse_distance (" +
               std::to_string(reuse_distance_) +
               " elements) stay gathered, plus one module's (partitioned_param_swapper asserts "
               "\"Not enough swap buffers\"); raise buffer_count or lower "
               "stage3_max_reuse_distance",
           {"zero_optimization.stage3_max_reuse_distance"}});
    }
    const std::string path = "zero_optimization.offload_param.buffer_size";
    if (largest > static_cast<uint64_t>(param_buffer_size_)) {
      Problem(path, "is " + std::to_string(param_buffer_size_) + " elements, less than " +
                        Printable(largest_name) + "'s partition of " + std::to_string(largest) +
                        " on " + std::to_string(world) +
                        " GPUs: DeepSpeed's partitioned_param_swapper asserts \"More elements than "
                        "buffer size\" at start-up; give at least " +
                        std::to_string(largest));
    } else if (optimizer_nvme_ &&
               aligned(static_cast<uint64_t>(param_buffer_size_)) < aligned(largest_group)) {
      Finding f{path,
                "is " + std::to_string(param_buffer_size_) +
                    " elements, less than the largest optimizer sub-group of " +
                    std::to_string(aligned(largest_group)) + " (sub_group_size " +
                    std::to_string(sub_group_size_) +
                    "): DeepSpeed's optimizer swapper asserts \"numel of fp16 buffers ... is too "
                    "small for initializing fp32 params\"; raise buffer_size or lower "
                    "sub_group_size",
                {"zero_optimization.sub_group_size"}};
      report_.problems.push_back(std::move(f));
    }
  }

  // Without the model, the parameter swap buffers alone (buffer_count x buffer_size, locked by
  // DeepSpeed's aio handle whatever pin_memory says) against RLIMIT_MEMLOCK; with the model, Fit
  // compares every pinned buffer.
  void LockedWithoutModel(const nlohmann::json& c) {
    if (!values_ok_ || !param_nvme_ || options_.model != nullptr || !options_.cluster ||
        options_.cluster->memlock_bytes == 0) {
      return;
    }
    const std::optional<int64_t> bytes =
        CheckedProductInt64({param_buffer_count_, param_buffer_size_, HalfPrecision(c) ? 2 : 4});
    if (bytes && static_cast<uint64_t>(*bytes) <= options_.cluster->memlock_bytes) return;
    report_.problems.push_back(
        {"zero_optimization.offload_param.buffer_size",
         "buffer_count " + std::to_string(param_buffer_count_) + " x buffer_size " +
             std::to_string(param_buffer_size_) + " elements lock " +
             (bytes ? Gib(static_cast<uint64_t>(*bytes)) : std::string("more than 2^63 bytes")) +
             " per process but RLIMIT_MEMLOCK is " + Gib(options_.cluster->memlock_bytes) +
             " (DeepSpeed's aio handle locks them at start-up); raise it (ulimit -l unlimited) or "
             "lower buffer_count / buffer_size",
         {"zero_optimization.offload_param.buffer_count"}});
  }

  // Note [Keys that fill the GPU]
  // An out-of-memory finding names what to change, not only the stage: the largest items of the
  // predicted breakdown at the peak phase (per GPU, or pinned per node for memlock), each with the
  // config keys that size it, and those keys in Finding::keys.
  static std::vector<std::string> KeysOf(const std::string& item, int64_t stage) {
    // sub_group_size is ZeRO-3's (DeepSpeedZeroOptimizer_Stage3 steps its partition in
    // sub-groups); below stage 3 a rank steps its whole partition at once, which a higher stage
    // shards.
    if (item == "optimizer_step_transient" && stage < 3) return {"zero_optimization.stage"};
    static const auto* kKeys = new std::map<std::string, std::vector<std::string>>{
        {"params_working", {"zero_optimization.stage", "zero_optimization.offload_param"}},
        {"params_master", {"zero_optimization.stage", "zero_optimization.offload_optimizer"}},
        {"grads", {"zero_optimization.stage"}},
        {"grads_fp32", {"zero_optimization.stage"}},
        {"ddp_grad_buckets", {"zero_optimization.reduce_bucket_size"}},
        {"optimizer_states", {"zero_optimization.stage", "zero_optimization.offload_optimizer"}},
        {"optimizer_step_transient", {"zero_optimization.sub_group_size"}},
        {"nvme_optimizer_swap_buffers",
         {"zero_optimization.offload_optimizer.buffer_count", "zero_optimization.sub_group_size"}},
        {"nvme_param_swap_buffers",
         {"zero_optimization.offload_param.buffer_count",
          "zero_optimization.offload_param.buffer_size"}},
        {"nvme_param_flat_buffer", {"zero_optimization.sub_group_size"}},
        {"activations", {"train_micro_batch_size_per_gpu"}},
        {"temporaries", {"train_micro_batch_size_per_gpu"}},
        {"grads_in_flight", {"train_micro_batch_size_per_gpu"}},
        {"activation_recompute", {"train_micro_batch_size_per_gpu"}},
        {"backward_workspace", {"train_micro_batch_size_per_gpu"}},
        {"logits_and_loss", {"train_micro_batch_size_per_gpu"}},
        {"logits_grad", {"train_micro_batch_size_per_gpu"}},
        {"comm_reduce_bucket",
         {"zero_optimization.reduce_bucket_size", "zero_optimization.overlap_comm"}},
        {"comm_allgather_bucket",
         {"zero_optimization.allgather_bucket_size", "zero_optimization.overlap_comm"}},
        {"zero3_live_params",
         {"zero_optimization.stage3_prefetch_bucket_size",
          "zero_optimization.stage3_max_live_parameters"}},
        {"zero3_block_grads", {"zero_optimization.stage"}},
    };
    auto it = kKeys->find(item);
    return it == kKeys->end() ? std::vector<std::string>{} : it->second;
  }

  static std::string Culprits(const estimator::MemoryEstimate& m, uint64_t MemoryItem::*bytes,
                              std::vector<std::string>* keys) {
    // GPU items at the GPU's peak phase; pinned buffers live through the step (per node).
    const bool gpu = bytes == &MemoryItem::gpu_bytes;
    const int64_t stage = m.setup.zero_stage;
    unsigned phase = estimator::kAllPhases;
    std::optional<estimator::Phase> peak;
    for (estimator::Phase p : estimator::kPhases) {
      if (gpu && estimator::PhaseName(p) == m.peak.phase) {
        phase = p;
        peak = p;
      }
    }
    // An item's bytes at the peak phase (the step model's items change from phase to phase).
    auto at_peak = [&](const MemoryItem& item) {
      return peak.has_value() ? item.GpuBytesIn(*peak) : item.*bytes;
    };
    std::vector<const MemoryItem*> items;
    for (const MemoryItem& item : m.items) {
      if ((item.phases & phase) != 0 && at_peak(item) > 0 && !KeysOf(item.name, stage).empty()) {
        items.push_back(&item);
      }
    }
    std::stable_sort(items.begin(), items.end(), [&](const MemoryItem* a, const MemoryItem* b) {
      return at_peak(*a) > at_peak(*b);
    });
    if (items.size() > 4) items.resize(4);
    std::string out;
    for (const MemoryItem* item : items) {
      std::string names;
      for (const std::string& key : KeysOf(item->name, stage)) {
        names += (names.empty() ? "" : ", ") + key;
        if (std::find(keys->begin(), keys->end(), key) == keys->end()) keys->push_back(key);
      }
      out +=
          (out.empty() ? "" : "; ") + item->name + " " + Gib(at_peak(*item)) + " (" + names + ")";
    }
    if (out.empty()) return out;
    return (gpu ? ", the most at " + m.peak.phase + ": " : std::string(", per node the most: ")) +
           out;
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
    Status applied = estimator::ApplyDeepSpeedConfig(c, "config", options_.supplied, hidden, &s);
    if (!applied.ok()) {
      report_.notes.push_back("memory not predicted: " + applied.message());
      report_.fit_error = report_.notes.back();
      return;
    }
    auto m = estimator::EstimateMemory(*options_.model, s);
    if (m.ok()) {
      report_.setup_line = estimator::SetupLine(m->setup);
      report_.predicted = m->peak;
    }
    if (!m.ok()) {
      report_.notes.push_back("memory not predicted: " + m.status().message());
      report_.fit_error = report_.notes.back();
      return;
    }
    const uint64_t usable = static_cast<uint64_t>(static_cast<double>(cluster.gpu.memory_bytes) *
                                                  (1 - options_.gpu_safety_fraction));
    // What the prediction assumed that the config does not say (issue 31 item 10: DeepSpeed's
    // ds_report shows what it assumed; a silent seq 2048 misleads a job that runs 4096).
    if (options_.seq_len <= 0) {
      report_.notes.push_back("assumed seq_len " + std::to_string(m->setup.seq_len) +
                              " (the model's positions, at most 2048): a DeepSpeed config does "
                              "not carry it; pass --seq-len as the job runs it");
    }
    if (m->setup.fused_optimizer && options_.supplied.count("fused_optimizer") == 0 &&
        c.contains("optimizer")) {
      report_.notes.push_back(
          "assumed the optimizer runs as DeepSpeed builds it from optimizer.type (a fused kernel "
          "updating in place; `memplan plan` counts torch's foreach temporaries instead, "
          "so its peak can be higher by about one state-sized buffer)");
    }
    // Settings the estimator does not model, said next to the prediction they change.
    if (True(c, "bf16", "bf16_master_weights_and_grads") ||
        True(c, "fp16", "fp16_master_weights_and_grads")) {
      report_.notes.push_back(
          "the prediction counts fp32 master weights, gradients and optimizer states; with "
          "16-bit master weights and gradients (bf16_optimizer_states: states too) DeepSpeed "
          "keeps less, so the optimizer's share is an upper bound");
    }
    for (const char* key : {"tensor_parallel", "sequence_parallel_size"}) {
      if (!c.contains(key)) continue;
      const nlohmann::json& v = c[key];
      const nlohmann::json size =
          v.is_object() ? v.value("autotp_size", nlohmann::json(1)) : nlohmann::json(v);
      if (size.is_number() && size.get<double>() > 1) {
        report_.notes.push_back(std::string("the prediction is for data parallelism over every "
                                            "GPU: memplan does not model ") +
                                key + " " + size.dump() + " (its sharding lowers the peak)");
      }
    }
    report_.notes.push_back(
        "predicted peak per GPU " + Gib(m->peak.gpu_bytes) + " (" + m->peak.phase +
        "), CPU per node " + Gib(m->peak.cpu_bytes) + ", pinned " + Gib(m->peak.pinned_bytes) +
        ", NVMe " + Gib(m->peak.nvme_bytes) + ", seq_len " + std::to_string(m->setup.seq_len));
    if (m->peak.gpu_bytes > usable) {
      Finding f{"zero_optimization.stage",
                "predicted peak " + Gib(m->peak.gpu_bytes) + " per GPU does not fit " +
                    cluster.gpu.name + " (" + Gib(usable) + " usable of " +
                    Gib(cluster.gpu.memory_bytes) + ")",
                {}};
      f.message += Culprits(*m, &MemoryItem::gpu_bytes, &f.keys) + "; try `memplan plan`";
      report_.problems.push_back(std::move(f));
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
      Finding f{"aio",
                "each process locks " +
                    Gib(m->peak.pinned_bytes / static_cast<uint64_t>(cluster.gpus_per_node)) +
                    " of swap buffers but RLIMIT_MEMLOCK is " + Gib(cluster.memlock_bytes),
                {}};
      f.message += Culprits(*m, &MemoryItem::pinned_bytes, &f.keys) +
                   "; raise it (ulimit -l unlimited) or lower those";
      report_.problems.push_back(std::move(f));
    }
  }

  CheckReport Take() { return std::move(report_); }

 private:
  const CheckOptions& options_;
  CheckReport report_;
  // What Values read for the checks that follow (DeepSpeed's defaults where the config is silent).
  bool values_ok_ = true;
  int64_t sub_group_size_ = 1000000000;
  bool param_nvme_ = false;
  bool optimizer_nvme_ = false;
  int64_t param_buffer_count_ = 5;
  int64_t param_buffer_size_ = 100000000;
  double persistence_threshold_ = 100000;
  int64_t reuse_distance_ = 1000000000;
  int64_t aio_block_size_ = 1048576;
  int64_t aio_threads_ = 1;
};

}  // namespace

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
  checker.Values(config);
  checker.Bf16(config);
  checker.SwapBuffers(config);
  checker.LockedWithoutModel(config);
  checker.Fit(config);
  return checker.Take();
}

nlohmann::json ToJson(const CheckReport& report) {
  nlohmann::json problems = nlohmann::json::array();
  for (const Finding& f : report.problems) {
    nlohmann::json finding = {{"path", f.path}, {"message", f.message}};
    if (!f.keys.empty()) finding["keys"] = f.keys;
    problems.push_back(std::move(finding));
  }
  nlohmann::json j = {
      {"ok", report.problems.empty()}, {"problems", problems}, {"notes", report.notes}};
  if (!report.setup_line.empty()) j["setup_line"] = report.setup_line;
  if (!report.fit_error.empty()) j["fit_error"] = report.fit_error;
  if (report.predicted) {
    const estimator::PeakMemory& p = *report.predicted;
    j["predicted"] = {{"gpu_bytes", p.gpu_bytes},
                      {"cpu_bytes", p.cpu_bytes},
                      {"nvme_bytes", p.nvme_bytes},
                      {"pinned_bytes", p.pinned_bytes},
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
  if (!report.problems.empty()) {
    out += std::to_string(report.problems.size()) + " problem(s) in " + Printable(source) + "\n";
  } else if (!report.fit_error.empty()) {
    out += "NOT OK: " + Printable(source) +
           " has no other problems memplan knows of, but the fit asked for was not predicted\n";
  } else {
    out += "OK: " + Printable(source) + " has no problems memplan knows of\n";
  }
  return out;
}

}  // namespace memplan::planner
