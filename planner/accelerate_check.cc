#include "planner/accelerate_check.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "common/checked_math.h"
#include "common/printable.h"
#include "common/suggest.h"
#include "estimator/estimate.h"
#include "estimator/memory_model.h"
#include "estimator/training_setup.h"

namespace memplan::planner {
namespace {

// Note [What Accelerate refuses and ignores]
// Read from Accelerate 1.15 (accelerate/commands/config/config_args.py, commands/launch.py,
// utils/launch.py, utils/dataclasses.py) and tried there, config file by config file:
//   - The file: a missing distributed_type and any top-level key ClusterConfig does not declare
//     are refused at load ("had unknown keys"); enum values are converted there too
//     (DistributedType, ComputeEnvironment), so a misspelt one is refused.
//   - Nested sections: `accelerate launch` copies each key of fsdp_config (adding `fsdp_` when it
//     is missing), deepspeed_config and dynamo_config (`dynamo_`) onto its arguments, skipping
//     argparse's type and choice checks; a key no argument reads is ignored without a word.
//   - Values: mixed_precision and dynamo_backend are checked when the launch environment is
//     built (a YAML `no` unquoted is a boolean there and crashes it); FSDP's values when each
//     rank builds FullyShardedDataParallelPlugin (bad names raise KeyError, bad booleans
//     "invalid truth value"); the layer classes to wrap in prepare() ("Could not find the
//     transformer layer class ...").
//   - FSDP1 / FSDP2: under fsdp_version 1 the strategy is sharding_strategy, which launch always
//     exports (FULL_SHARD by default), so reshard_after_forward is never read (Note [FSDP1's
//     strategy in Accelerate], emit.cc); under 2, sharding_strategy, forward_prefetch,
//     use_orig_params and sync_module_states are not read and reshard_after_forward must be a
//     boolean. Launch refuses cpu_ram_efficient_loading (true unless said) with
//     sync_module_states false, under either version.
//   - DeepSpeed: DeepSpeedPlugin refuses a deepspeed_config_file beside any key it would
//     override (the accelerate config's mixed_precision included); launch never passes
//     offload_*_nvme_path on, so DeepSpeed gets nvme_path "none".
//   - num_processes is the world (all machines); launch divides it by num_machines without
//     checking the remainder, and asks for it when it is missing.
const std::set<std::string>& TopLevelKeys() {
  static const auto* keys = new std::set<std::string>{
      "compute_environment", "distributed_type", "mixed_precision", "use_cpu", "debug",
      "num_processes", "machine_rank", "num_machines", "gpu_ids", "main_process_ip",
      "main_process_port", "rdzv_backend", "same_network", "main_training_function",
      "enable_cpu_affinity", "fp8_config", "deepspeed_config", "fsdp_config", "parallelism_config",
      "megatron_lm_config", "mpirun_config", "downcast_bf16", "tpu_name", "tpu_zone",
      "tpu_use_cluster", "tpu_use_sudo", "command_file", "commands", "tpu_vm", "tpu_env",
      "dynamo_config",
      // Older spellings process_config converts before the key check.
      "fp16", "dynamo_backend"};
  return *keys;
}

const std::vector<std::string>& DistributedTypes() {
  static const auto* types = new std::vector<std::string>{
      "NO",         "MULTI_CPU",   "MULTI_GPU", "MULTI_NPU",   "MULTI_MLU",
      "MULTI_SDAA", "MULTI_MUSA",  "MULTI_XPU", "DEEPSPEED",   "FSDP",
      "XLA",        "MEGATRON_LM", "MULTI_HPU", "MULTI_NEURON"};
  return *types;
}

const std::set<std::string>& FsdpKeys() {
  static const auto* keys = new std::set<std::string>{"fsdp_version",
                                                      "fsdp_sharding_strategy",
                                                      "fsdp_reshard_after_forward",
                                                      "fsdp_offload_params",
                                                      "fsdp_min_num_params",
                                                      "fsdp_auto_wrap_policy",
                                                      "fsdp_transformer_layer_cls_to_wrap",
                                                      "fsdp_backward_prefetch",
                                                      "fsdp_state_dict_type",
                                                      "fsdp_forward_prefetch",
                                                      "fsdp_use_orig_params",
                                                      "fsdp_cpu_ram_efficient_loading",
                                                      "fsdp_sync_module_states",
                                                      "fsdp_activation_checkpointing",
                                                      "fsdp_activation_checkpointing_offload",
                                                      "fsdp_ignored_modules"};
  return *keys;
}

// parallelism_config's keys are launch's argument names whole (launch adds no prefix there).
const std::set<std::string>& ParallelismKeys() {
  static const auto* keys =
      new std::set<std::string>{"parallelism_config_dp_replicate_size",
                                "parallelism_config_dp_shard_size",
                                "parallelism_config_tp_size",
                                "parallelism_config_cp_size",
                                "parallelism_config_cp_backend",
                                "parallelism_config_cp_comm_strategy",
                                "parallelism_config_sp_size",
                                "parallelism_config_sp_backend",
                                "parallelism_config_sp_seq_length",
                                "parallelism_config_sp_seq_length_is_variable",
                                "parallelism_config_sp_attn_implementation"};
  return *keys;
}

const std::set<std::string>& DeepSpeedKeys() {
  static const auto* keys = new std::set<std::string>{"gradient_accumulation_steps",
                                                      "gradient_clipping",
                                                      "zero_stage",
                                                      "offload_optimizer_device",
                                                      "offload_param_device",
                                                      "offload_optimizer_nvme_path",
                                                      "offload_param_nvme_path",
                                                      "zero3_init_flag",
                                                      "zero3_save_16bit_model",
                                                      "deepspeed_config_file",
                                                      "deepspeed_hostfile",
                                                      "deepspeed_multinode_launcher",
                                                      "deepspeed_inclusion_filter",
                                                      "deepspeed_exclusion_filter",
                                                      "deepspeed_moe_layer_cls_names"};
  return *keys;
}

// The deepspeed_config keys DeepSpeedPlugin refuses beside a deepspeed_config_file (its
// _deepspeed_config_checks), the accelerate config's own mixed_precision being the last.
const std::vector<std::string>& KeysAFileReplaces() {
  static const auto* keys = new std::vector<std::string>{
      "gradient_accumulation_steps", "gradient_clipping",     "zero_stage",
      "offload_optimizer_device",    "offload_param_device",  "offload_param_nvme_path",
      "offload_optimizer_nvme_path", "zero3_save_16bit_model"};
  return *keys;
}

std::string AccUpper(std::string s) {
  for (char& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return s;
}

std::string AccLower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::string AccGib(uint64_t bytes) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f GiB", static_cast<double>(bytes) / 0x1p30);
  return text;
}

// What Accelerate's str_to_bool takes (the launcher passes nested values as they are; a YAML
// boolean or 0/1 reaches it as "True"/"1").
std::optional<bool> TruthValue(const nlohmann::json& v) {
  if (v.is_boolean()) return v.get<bool>();
  if (v.is_number_integer() && (v.get<int64_t>() == 0 || v.get<int64_t>() == 1)) {
    return v.get<int64_t>() == 1;
  }
  if (!v.is_string()) return std::nullopt;
  const std::string s = AccLower(v.get<std::string>());
  if (s == "y" || s == "yes" || s == "t" || s == "true" || s == "on" || s == "1") return true;
  if (s == "n" || s == "no" || s == "f" || s == "false" || s == "off" || s == "0") return false;
  return std::nullopt;
}

// A value Python's int() takes: an integer, or a string of digits.
std::optional<int64_t> IntLike(const nlohmann::json& v) {
  if (v.is_number_integer()) return v.get<int64_t>();
  if (!v.is_string()) return std::nullopt;
  const std::string s = v.get<std::string>();
  if (s.empty() || s.size() > 18) return std::nullopt;
  for (char c : s) {
    if (c < '0' || c > '9') return std::nullopt;
  }
  return std::stoll(s);
}

// A scalar as the launcher turns it into an environment variable (str()).
std::string AsText(const nlohmann::json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_boolean()) return v.get<bool>() ? "True" : "False";
  return v.dump();
}

constexpr const char* kStrategies[] = {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD",
                                       "HYBRID_SHARD_ZERO2"};

// FSDP1's strategy name for a value (a name in any case, or 1-5); "" if it is none.
std::string StrategyName(const nlohmann::json& v) {
  if (const std::optional<int64_t> i = IntLike(v); i && *i >= 1 && *i <= 5) {
    return kStrategies[*i - 1];
  }
  if (!v.is_string()) return "";
  const std::string s = AccUpper(v.get<std::string>());
  for (const char* name : kStrategies) {
    if (s == name) return s;
  }
  return "";
}

class AccelerateChecker {
 public:
  explicit AccelerateChecker(const CheckOptions& options) : options_(options) {}

  void Problem(std::string path, std::string message, std::vector<std::string> keys = {}) {
    report_.problems.push_back({std::move(path), std::move(message), std::move(keys)});
  }

  void TopLevel(const nlohmann::json& c) {
    if (!c.contains("distributed_type")) {
      Problem("distributed_type",
              "is missing; Accelerate refuses the file (\"A distributed_type must be specified "
              "in the config file\")");
    } else if (!c["distributed_type"].is_string() ||
               std::find(DistributedTypes().begin(), DistributedTypes().end(),
                         c["distributed_type"].get<std::string>()) == DistributedTypes().end()) {
      const std::string given = AsText(c["distributed_type"]);
      Problem("distributed_type",
              "is " + Printable(given) + ", not a DistributedType (Accelerate refuses the file)" +
                  DidYouMean(ClosestMatches(AccUpper(given), DistributedTypes())));
    } else {
      type_ = c["distributed_type"].get<std::string>();
    }
    if (c.contains("compute_environment")) {
      const nlohmann::json& env = c["compute_environment"];
      if (!env.is_string() || (env.get<std::string>() != "LOCAL_MACHINE" &&
                               env.get<std::string>() != "AMAZON_SAGEMAKER")) {
        Problem("compute_environment",
                "is " + Printable(AsText(env)) +
                    ", neither LOCAL_MACHINE nor AMAZON_SAGEMAKER (Accelerate then reads the file "
                    "as a SageMaker config and refuses its keys)");
      } else if (env.get<std::string>() == "AMAZON_SAGEMAKER") {
        sagemaker_ = true;
        report_.notes.push_back(
            "a SageMaker config: its values are checked as a local one's, its keys are not");
      }
    }
    std::vector<std::string> known(TopLevelKeys().begin(), TopLevelKeys().end());
    for (const auto& [key, value] : c.items()) {
      (void)value;
      if (sagemaker_ || TopLevelKeys().count(key) != 0) continue;
      Problem(key,
              "is not an Accelerate config key: Accelerate refuses the file (\"had unknown "
              "keys\")" +
                  DidYouMean(ClosestMatches(key, known)));
    }
  }

  void MixedPrecision(const nlohmann::json& c) {
    // null is not given: launch then passes its default, no.
    if (!c.contains("mixed_precision") || c["mixed_precision"].is_null()) {
      // The older spelling, which Accelerate's process_config turns into mixed_precision fp16.
      if (c.contains("fp16") && TruthValue(c["fp16"]).value_or(false)) precision_ = "fp16";
      return;
    }
    const nlohmann::json& mp = c["mixed_precision"];
    if (mp.is_boolean()) {
      Problem("mixed_precision",
              std::string("is the boolean ") + (mp.get<bool>() ? "true" : "false") +
                  " (YAML reads an unquoted no / yes as one) and accelerate launch fails on it "
                  "(\"'bool' object has no attribute 'lower'\"); write mixed_precision: 'no' or "
                  "fp16 / bf16 / fp8");
      return;
    }
    const std::string value = mp.is_string() ? AccLower(mp.get<std::string>()) : "";
    if (value != "no" && value != "fp16" && value != "bf16" && value != "fp8") {
      Problem("mixed_precision", "is " + Printable(AsText(mp)) +
                                     "; accelerate launch takes no, fp16, bf16 or fp8 "
                                     "(\"Unknown mixed_precision mode\")");
      return;
    }
    precision_ = value;
  }

  void Dynamo(const nlohmann::json& c) {
    const nlohmann::json* backend = nullptr;
    std::string path;
    if (c.contains("dynamo_config") && c["dynamo_config"].is_object()) {
      const nlohmann::json& d = c["dynamo_config"];
      for (const char* key : {"dynamo_backend", "backend"}) {
        if (d.contains(key)) {
          backend = &d[key];
          path = std::string("dynamo_config.") + key;
        }
      }
    } else if (c.contains("dynamo_backend")) {
      backend = &c["dynamo_backend"];
      path = "dynamo_backend";
    }
    if (backend == nullptr) return;
    static const std::vector<std::string> kBackends = {"NO",
                                                       "EAGER",
                                                       "AOT_EAGER",
                                                       "INDUCTOR",
                                                       "AOT_TS_NVFUSER",
                                                       "NVPRIMS_NVFUSER",
                                                       "CUDAGRAPHS",
                                                       "OFI",
                                                       "FX2TRT",
                                                       "ONNXRT",
                                                       "TENSORRT",
                                                       "AOT_TORCHXLA_TRACE_ONCE",
                                                       "TORCHXLA_TRACE_ONCE",
                                                       "TVM",
                                                       "HPU_BACKEND",
                                                       "NEURON"};
    if (backend->is_boolean()) {
      Problem(path,
              "is a boolean (YAML reads an unquoted no as one) and accelerate launch fails "
              "on it; write 'no' in quotes");
    } else if (!backend->is_string() ||
               std::find(kBackends.begin(), kBackends.end(),
                         AccUpper(backend->get<std::string>())) == kBackends.end()) {
      Problem(path, "is " + Printable(AsText(*backend)) +
                        ", not a dynamo backend accelerate launch knows (\"Unknown dynamo "
                        "backend\")" +
                        DidYouMean(ClosestMatches(AccUpper(AsText(*backend)), kBackends)));
    }
  }

  // Processes against the cluster. num_processes is every machine's (launch divides it by
  // num_machines).
  void Processes(const nlohmann::json& c) {
    int64_t world = options_.world_size;
    if (world == 0 && options_.cluster) world = options_.cluster->WorldSize();
    const int64_t nodes = options_.cluster ? options_.cluster->nodes : 0;
    auto positive = [&](const char* key) -> std::optional<int64_t> {
      if (!c.contains(key)) return std::nullopt;
      const std::optional<int64_t> v = IntLike(c[key]);
      if (!v || *v < (std::string(key) == "machine_rank" ? 0 : 1)) {
        if (!(std::string(key) == "num_processes" && v && *v == -1)) {
          Problem(key, "must be a " +
                           std::string(std::string(key) == "machine_rank" ? "non-negative"
                                                                          : "positive") +
                           " integer, got " + Printable(c[key].dump()));
        }
        return std::nullopt;
      }
      return v;
    };
    const std::optional<int64_t> processes = positive("num_processes");
    const std::optional<int64_t> machines = positive("num_machines");
    const std::optional<int64_t> rank = positive("machine_rank");
    if (type_ == "NO") {
      if (world > 1) {
        Problem("distributed_type", "is NO: accelerate launch starts one process, on one of the " +
                                        std::to_string(world) + " GPUs");
      }
      return;
    }
    const bool on_gpus =
        type_ == "MULTI_GPU" || type_ == "FSDP" || type_ == "DEEPSPEED" || type_ == "MEGATRON_LM";
    if (!processes && (!c.contains("num_processes") || IntLike(c["num_processes"]) == -1)) {
      Problem("num_processes",
              "is not set: accelerate launch stops (\"You need to manually pass "
              "in --num_processes\") unless the command line gives it");
    }
    if (processes && on_gpus && world > 0 && *processes != world) {
      Problem("num_processes",
              "is " + std::to_string(*processes) +
                  ", the processes of all machines together, but the cluster has " +
                  std::to_string(world) + " GPUs: one process per GPU",
              {"num_machines"});
    }
    const int64_t m = machines.value_or(1);
    if (machines && nodes > 0 && *machines != nodes) {
      Problem("num_machines", "is " + std::to_string(*machines) + " but the cluster has " +
                                  std::to_string(nodes) + " nodes");
    }
    if (processes && *processes % m != 0) {
      Problem("num_processes",
              "is " + std::to_string(*processes) + ", not a multiple of num_machines " +
                  std::to_string(m) + ": accelerate launch starts " +
                  std::to_string(*processes / m) + " per machine, " +
                  std::to_string(*processes / m * m) + " in all, without a word",
              {"num_machines"});
    }
    if (rank && *rank >= m) {
      Problem("machine_rank", "is " + std::to_string(*rank) + " but there are " +
                                  std::to_string(m) + " machines (ranks 0 to " +
                                  std::to_string(m - 1) + ")");
    }
    if (m > 1 && (!c.contains("main_process_ip") || c["main_process_ip"].is_null())) {
      Problem("main_process_ip",
              "is not set on " + std::to_string(m) +
                  " machines: the ranks meet at 'None:29500' (accelerate launch does not check)");
    }
    // gpu_ids becomes CUDA_VISIBLE_DEVICES; "all" (or none) leaves every GPU visible.
    if (processes && on_gpus && c.contains("gpu_ids") && !c["gpu_ids"].is_null()) {
      const std::string ids = AsText(c["gpu_ids"]);
      if (AccLower(ids) != "all") {
        const int64_t count = static_cast<int64_t>(std::count(ids.begin(), ids.end(), ',')) + 1;
        const int64_t per_machine = *processes / m;
        if (count < per_machine) {
          Problem("gpu_ids",
                  "names " + std::to_string(count) + " GPU(s) (" + Printable(ids) + ") for " +
                      std::to_string(per_machine) +
                      " processes per machine: ranks would share a GPU",
                  {"num_processes"});
        }
      }
    }
  }

  // A nested section's keys against those launch reads; the keys normalised (prefix added as
  // launch adds it) into `out`.
  void SectionKeys(const nlohmann::json& c, const char* section, const std::string& prefix,
                   const std::set<std::string>& known, nlohmann::json* out) {
    *out = nlohmann::json::object();
    if (!c.contains(section)) return;
    const nlohmann::json& s = c[section];
    if (s.is_null()) return;
    if (!s.is_object()) {
      Problem(section, "must be a mapping of settings, got " + Printable(s.dump()));
      return;
    }
    std::vector<std::string> candidates(known.begin(), known.end());
    for (const auto& [key, value] : s.items()) {
      const std::string name = prefix.empty() || key.rfind(prefix, 0) == 0 ? key : prefix + key;
      if (known.count(name) == 0) {
        Problem(std::string(section) + "." + key,
                "is not a setting accelerate launch reads: Accelerate ignores it without a "
                "word" +
                    DidYouMean(ClosestMatches(name, candidates)));
        continue;
      }
      (*out)[name] = value;
    }
  }

  void Fsdp(const nlohmann::json& c) {
    nlohmann::json f;
    SectionKeys(c, "fsdp_config", "fsdp_", FsdpKeys(), &f);
    if (type_ != "FSDP") {
      if (!f.empty() && !type_.empty()) {
        report_.notes.push_back("fsdp_config is not used: distributed_type is " + type_);
      }
      return;
    }
    auto path = [](const std::string& key) { return "fsdp_config." + key; };
    // Booleans, as the plugin reads them.
    for (const char* key :
         {"fsdp_offload_params", "fsdp_forward_prefetch", "fsdp_use_orig_params",
          "fsdp_cpu_ram_efficient_loading", "fsdp_sync_module_states",
          "fsdp_activation_checkpointing", "fsdp_activation_checkpointing_offload"}) {
      if (f.contains(key) && !TruthValue(f[key])) {
        Problem(path(key), "is " + Printable(AsText(f[key])) +
                               ", not a boolean; FullyShardedDataParallelPlugin raises "
                               "\"invalid truth value\"");
        f.erase(key);
      }
    }
    auto flag = [&](const char* key, bool fallback) {
      return f.contains(key) ? *TruthValue(f[key]) : fallback;
    };
    fsdp_version_ = 1;
    if (f.contains("fsdp_version")) {
      const std::optional<int64_t> v = IntLike(f["fsdp_version"]);
      if (!v || (*v != 1 && *v != 2)) {
        Problem(path("fsdp_version"), "is " + Printable(AsText(f["fsdp_version"])) +
                                          "; Accelerate knows FSDP 1 and 2 (any other fails "
                                          "building the plugin)");
        fsdp_version_ = 0;
      } else {
        fsdp_version_ = static_cast<int>(*v);
      }
    }
    const bool v2 = fsdp_version_ == 2;
    // The strategy.
    strategy_ = "FULL_SHARD";
    if (f.contains("fsdp_sharding_strategy")) {
      const std::string name = StrategyName(f["fsdp_sharding_strategy"]);
      if (name.empty()) {
        Problem(path("fsdp_sharding_strategy"),
                "is " + Printable(AsText(f["fsdp_sharding_strategy"])) +
                    "; FSDP's strategies are FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, "
                    "HYBRID_SHARD_ZERO2 (or 1-5)");
      } else if (v2) {
        Problem(path("fsdp_sharding_strategy"),
                "is not read under fsdp_version 2 (Accelerate ignores it without a word): FSDP2 "
                "shards by fsdp_reshard_after_forward, true like FULL_SHARD, false like "
                "SHARD_GRAD_OP",
                {path("fsdp_version")});
      } else {
        strategy_ = name;
      }
    }
    if (f.contains("fsdp_reshard_after_forward")) {
      const nlohmann::json& r = f["fsdp_reshard_after_forward"];
      if (v2) {
        if (const std::optional<bool> b = TruthValue(r)) {
          strategy_ = *b ? "FULL_SHARD" : "SHARD_GRAD_OP";
        } else {
          Problem(path("fsdp_reshard_after_forward"),
                  "is " + Printable(AsText(r)) +
                      ": under fsdp_version 2 it is true or false (FullyShardedDataParallelPlugin "
                      "raises \"invalid truth value\")");
        }
      } else if (fsdp_version_ == 1) {
        const std::string name = StrategyName(r);
        if (!name.empty() && name != strategy_) {
          Problem(
              path("fsdp_reshard_after_forward"),
              "is " + name +
                  " but under fsdp_version 1 Accelerate takes the strategy from "
                  "fsdp_sharding_strategy (" +
                  strategy_ + (f.contains("fsdp_sharding_strategy") ? "" : ", its default") +
                  ", which accelerate launch always passes) and never reads this: the job runs " +
                  strategy_ + "; write fsdp_sharding_strategy: " + name,
              {path("fsdp_sharding_strategy")});
        }
      }
    }
    if (v2) {
      for (const char* key : {"fsdp_forward_prefetch"}) {
        if (flag(key, false)) {
          Problem(path(key),
                  "is true but FSDP2 has no forward prefetch: under fsdp_version 2 "
                  "Accelerate does not read it");
        }
      }
    }
    // Enums.
    auto one_of = [&](const char* key, const std::vector<std::string>& names,
                      const std::string& what) -> std::string {
      if (!f.contains(key)) return "";
      const nlohmann::json& v = f[key];
      if (const std::optional<int64_t> i = IntLike(v);
          i && *i >= 1 && *i <= static_cast<int64_t>(names.size()) && what != "wrap") {
        return names[static_cast<size_t>(*i - 1)];
      }
      const std::string s = v.is_string() ? AccUpper(v.get<std::string>()) : "";
      if (std::find(names.begin(), names.end(), s) != names.end()) return s;
      std::string list;
      for (const std::string& n : names) list += (list.empty() ? "" : ", ") + n;
      Problem(path(key), "is " + Printable(AsText(v)) + "; Accelerate takes " + list +
                             " (building the plugin fails otherwise)" +
                             DidYouMean(ClosestMatches(AccUpper(AsText(v)), names)));
      return "";
    };
    one_of("fsdp_backward_prefetch", {"BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH"}, "");
    const std::string state_dict = one_of(
        "fsdp_state_dict_type", {"FULL_STATE_DICT", "LOCAL_STATE_DICT", "SHARDED_STATE_DICT"}, "");
    if (v2 && state_dict == "LOCAL_STATE_DICT") {
      Problem(path("fsdp_state_dict_type"),
              "is LOCAL_STATE_DICT, which FSDP2 does not have (Accelerate refuses it); use "
              "SHARDED_STATE_DICT or FULL_STATE_DICT",
              {path("fsdp_version")});
    }
    const std::string policy =
        f.contains("fsdp_auto_wrap_policy")
            ? one_of("fsdp_auto_wrap_policy",
                     {"TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"}, "wrap")
            : "NO_WRAP";
    if (policy == "NO_WRAP") {
      Problem(
          path("fsdp_auto_wrap_policy"),
          std::string(f.contains("fsdp_auto_wrap_policy") ? "is NO_WRAP"
                                                          : "is not set (Accelerate: NO_WRAP)") +
              ": the whole model is one FSDP unit, gathered whole on every GPU for forward "
              "and backward; set TRANSFORMER_BASED_WRAP to shard block by block");
    }
    if (policy == "SIZE_BASED_WRAP" && f.contains("fsdp_min_num_params") &&
        !IntLike(f["fsdp_min_num_params"])) {
      Problem(path("fsdp_min_num_params"),
              "is " + Printable(AsText(f["fsdp_min_num_params"])) +
                  ", not an integer (YAML reads 1e8 as a string and 1.0e+8 as a float); "
                  "building the plugin fails on int(); write 100000000");
    }
    if (policy == "TRANSFORMER_BASED_WRAP") WrapClasses(f);
    // Loading: launch refuses efficient loading without synced module states.
    if (flag("fsdp_cpu_ram_efficient_loading", true) && f.contains("fsdp_sync_module_states") &&
        !flag("fsdp_sync_module_states", true)) {
      Problem(path("fsdp_sync_module_states"),
              "is false while fsdp_cpu_ram_efficient_loading is " +
                  std::string(f.contains("fsdp_cpu_ram_efficient_loading") ? "true"
                                                                           : "true by default") +
                  ": accelerate launch refuses it (\"set --fsdp_sync_module_states to "
                  "True\"), under fsdp_version 2 too",
              {path("fsdp_cpu_ram_efficient_loading")});
    }
    if (flag("fsdp_activation_checkpointing_offload", false)) {
      if (!flag("fsdp_activation_checkpointing", false)) {
        Problem(path("fsdp_activation_checkpointing_offload"),
                "needs fsdp_activation_checkpointing true (Accelerate refuses it otherwise)",
                {path("fsdp_activation_checkpointing")});
      } else if (!v2) {
        Problem(path("fsdp_activation_checkpointing_offload"),
                "needs fsdp_version 2 (Accelerate refuses it otherwise)", {path("fsdp_version")});
      }
    }
    offload_params_ = flag("fsdp_offload_params", false);
    checkpointing_ = flag("fsdp_activation_checkpointing", false);
  }

  // The classes to wrap, as the plugin splits them (on ',', nothing stripped), against the
  // model's block class when the model is known.
  void WrapClasses(const nlohmann::json& f) {
    const std::string path = "fsdp_config.fsdp_transformer_layer_cls_to_wrap";
    std::string block;
    if (options_.model != nullptr && options_.model->arch.has_value()) {
      block = options_.model->arch->no_split_class;
    }
    if (!f.contains("fsdp_transformer_layer_cls_to_wrap")) return;  // the model's _no_split_modules
    const nlohmann::json& v = f["fsdp_transformer_layer_cls_to_wrap"];
    if (!v.is_string()) {
      Problem(path, "is " + std::string(v.is_array() ? "a list" : "not a string") +
                        "; accelerate launch passes its str() on, which names no class "
                        "(prepare() raises \"Could not find the transformer layer class\"): write "
                        "the names comma-separated" +
                        (block.empty() ? "" : ", e.g. " + block));
      return;
    }
    const std::string names = v.get<std::string>();
    std::vector<std::string> classes;
    size_t start = 0;
    while (start <= names.size()) {
      const size_t end = std::min(names.find(',', start), names.size());
      classes.push_back(names.substr(start, end - start));
      start = end + 1;
    }
    for (const std::string& name : classes) {
      if (name.empty() || name.find_first_of(" \t") != std::string::npos) {
        Problem(path, "holds '" + Printable(name) +
                          "': Accelerate splits the names on ',' and strips nothing, so no class "
                          "is called that (prepare() raises \"Could not find the transformer "
                          "layer class\"); write them without spaces");
        return;
      }
    }
    if (!block.empty() && std::find(classes.begin(), classes.end(), block) == classes.end()) {
      std::string near;
      for (const std::string& name : classes) {
        if (AccLower(name) == AccLower(block)) near = " (class names are case-sensitive)";
      }
      Problem(path, "names " + Printable(names) + " but " + options_.model->model_type +
                        "'s blocks are " + block + near +
                        ": prepare() raises \"Could not find the transformer layer class\" for a "
                        "class the model lacks, and blocks not wrapped are gathered whole");
    }
  }

  // parallelism_config: keys without their parallelism_config_ prefix are read by nothing (a
  // dp_shard_size of 2 leaves PARALLELISM_CONFIG_DP_SHARD_SIZE at 1); the sizes' product must be
  // the processes (ParallelismConfig raises in prepare(), DeepSpeed's sequence parallelism aside).
  void Parallelism(const nlohmann::json& c) {
    if (!c.contains("parallelism_config") || c["parallelism_config"].is_null()) return;
    const nlohmann::json& p = c["parallelism_config"];
    if (!p.is_object()) {
      Problem("parallelism_config", "must be a mapping of settings, got " + Printable(p.dump()));
      return;
    }
    const std::string prefix = "parallelism_config_";
    std::vector<std::string> known(ParallelismKeys().begin(), ParallelismKeys().end());
    int64_t total = 1;
    bool sizes_known = true;
    for (const auto& [key, value] : p.items()) {
      const std::string path = "parallelism_config." + key;
      if (ParallelismKeys().count(key) == 0) {
        const bool unprefixed = ParallelismKeys().count(prefix + key) != 0;
        Problem(
            path,
            "is not a setting accelerate launch reads: Accelerate ignores it without a "
            "word" +
                (unprefixed ? " (keys here keep their prefix: did you mean " + prefix + key + "?)"
                            : DidYouMean(ClosestMatches(key, known))));
        continue;
      }
      if (key.size() > 5 && key.compare(key.size() - 5, 5, "_size") == 0) {
        const std::optional<int64_t> size = IntLike(value);
        if (!size || *size < 1) {
          Problem(path, "must be a positive integer, got " + Printable(AsText(value)));
          sizes_known = false;
        } else {
          total = CheckedMulInt64(total, *size).value_or(0);
        }
      }
    }
    const bool deepspeed_sp =
        p.contains(prefix + "sp_backend") && AsText(p[prefix + "sp_backend"]) == "deepspeed" &&
        IntLike(p.value(prefix + "sp_size", nlohmann::json(1))).value_or(1) > 1;
    const std::optional<int64_t> processes =
        c.contains("num_processes") ? IntLike(c["num_processes"]) : std::nullopt;
    if (sizes_known && !deepspeed_sp && processes && *processes >= 1 && total != *processes) {
      Problem("parallelism_config",
              "multiplies to " + std::to_string(total) +
                  " processes (dp_replicate x dp_shard x tp x cp x sp) but num_processes is " +
                  std::to_string(*processes) +
                  ": ParallelismConfig raises \"total_size does not match num_processes\"",
              {"num_processes"});
    }
  }

  void DeepSpeed(const nlohmann::json& c) {
    nlohmann::json d;
    SectionKeys(c, "deepspeed_config", "", DeepSpeedKeys(), &d);
    if (type_ != "DEEPSPEED") {
      if (!d.empty() && !type_.empty()) {
        report_.notes.push_back("deepspeed_config is not used: distributed_type is " + type_);
      }
      return;
    }
    auto path = [](const std::string& key) { return "deepspeed_config." + key; };
    if (d.contains("deepspeed_config_file") && !d["deepspeed_config_file"].is_null()) {
      if (!d["deepspeed_config_file"].is_string() ||
          d["deepspeed_config_file"].get<std::string>().empty()) {
        Problem(path("deepspeed_config_file"), "must be the path of a DeepSpeed config");
      } else {
        deepspeed_file_ = d["deepspeed_config_file"].get<std::string>();
      }
      std::vector<std::string> beside;
      for (const std::string& key : KeysAFileReplaces()) {
        if (d.contains(key)) beside.push_back(path(key));
      }
      if (c.contains("mixed_precision") && !c["mixed_precision"].is_null()) {
        beside.push_back("mixed_precision");
      }
      if (!beside.empty()) {
        std::string list;
        for (const std::string& k : beside) list += (list.empty() ? "" : ", ") + k;
        Problem(path("deepspeed_config_file"),
                "is given with " + list +
                    ", which the DeepSpeed config file sets: Accelerate refuses the pair "
                    "(\"When using deepspeed_config_file, the following accelerate config "
                    "variables will be ignored\"); remove them here and set them in the file",
                beside);
      }
      return;
    }
    // Without a file, Accelerate builds the DeepSpeed config from these keys.
    zero_stage_ = 2;  // DeepSpeedPlugin's default
    if (d.contains("zero_stage")) {
      const std::optional<int64_t> stage = IntLike(d["zero_stage"]);
      if (!stage || *stage < 0 || *stage > 3) {
        Problem(path("zero_stage"), "is " + Printable(AsText(d["zero_stage"])) +
                                        "; ZeRO stages are 0, 1, 2 and 3 (DeepSpeed refuses it "
                                        "in prepare())");
        zero_stage_ = -1;
      } else {
        zero_stage_ = static_cast<int>(*stage);
      }
    }
    for (const auto& [key, field] : {std::pair{"offload_optimizer_device", &offload_optimizer_},
                                     std::pair{"offload_param_device", &offload_param_}}) {
      if (!d.contains(key)) continue;
      const std::string device = AccLower(AsText(d[key]));
      if (device != "none" && device != "cpu" && device != "nvme") {
        Problem(path(key), "is " + Printable(AsText(d[key])) +
                               "; DeepSpeed offloads to none, cpu or nvme (it refuses the config "
                               "in prepare())");
        continue;
      }
      *field = device;
      const std::string nvme_key =
          std::string(key).substr(0, std::string(key).size() - std::string("device").size()) +
          "nvme_path";
      if (device == "nvme") {
        Problem(path(nvme_key),
                "is not passed on by accelerate launch (Accelerate 1.15 exports no variable for "
                "it): DeepSpeed gets nvme_path \"none\" and fails at its first swap; put the "
                "offload in a deepspeed_config_file with its nvme_path",
                {path(key)});
      }
    }
    if (zero_stage_ >= 0 && zero_stage_ != 3) {
      if (offload_param_ != "none") {
        Problem(path("offload_param_device"),
                "is " + offload_param_ +
                    " but DeepSpeed offloads parameters only in ZeRO stage 3 "
                    "(zero_stage is " +
                    std::to_string(zero_stage_) + ")",
                {path("zero_stage")});
      }
      if (offload_optimizer_ == "nvme") {
        Problem(path("offload_optimizer_device"),
                "is nvme, which DeepSpeed supports only in ZeRO stage 3 (zero_stage is " +
                    std::to_string(zero_stage_) + ")",
                {path("zero_stage")});
      }
      if (zero_stage_ == 0 && offload_optimizer_ != "none") {
        Problem(path("offload_optimizer_device"),
                "is " + offload_optimizer_ + " but ZeRO stage 0 offloads nothing",
                {path("zero_stage")});
      }
      if (d.contains("zero3_init_flag") && TruthValue(d["zero3_init_flag"]).value_or(false)) {
        report_.notes.push_back(
            "deepspeed_config.zero3_init_flag is true below ZeRO stage 3: Accelerate sets it "
            "false (a warning)");
      }
    }
    if (d.contains("gradient_accumulation_steps")) {
      const std::optional<int64_t> steps = IntLike(d["gradient_accumulation_steps"]);
      if (!steps || *steps < 1) {
        Problem(path("gradient_accumulation_steps"),
                "must be a positive integer, got " +
                    Printable(d["gradient_accumulation_steps"].dump()));
      } else {
        grad_accum_ = *steps;
      }
    }
  }

  void Fit() {
    if (options_.model == nullptr || !options_.cluster) return;
    if (!report_.problems.empty()) {
      report_.notes.push_back("memory not predicted: fix the problems above first");
      return;
    }
    auto cannot = [&](const std::string& why) {
      report_.notes.push_back("memory not predicted: " + why);
      report_.fit_error = report_.notes.back();
    };
    if (!deepspeed_file_.empty()) return;  // the caller checks the DeepSpeed config it names
    if (type_ != "FSDP" && type_ != "DEEPSPEED" && type_ != "MULTI_GPU" && type_ != "NO") {
      return cannot("distributed_type " + type_ + " is not modelled");
    }
    if (options_.supplied.count("micro_batch") == 0) {
      return cannot(
          "an Accelerate config does not say the micro-batch; pass --micro-batch (the "
          "training script's per-GPU batch)");
    }
    const Cluster& cluster = *options_.cluster;
    estimator::TrainingSetup s = options_.setup;
    s.gpus_per_node = cluster.gpus_per_node;
    s.num_nodes = cluster.nodes;
    if (type_ == "NO") s.gpus_per_node = s.num_nodes = 1;
    s.seq_len = options_.seq_len;
    s.flash_attention = options_.flash_attention;
    if (options_.supplied.count("precision") == 0) {
      if (precision_ == "fp8") return cannot("mixed_precision fp8 is not modelled");
      s.precision = precision_ == "bf16"   ? estimator::Precision::kBf16Mixed
                    : precision_ == "fp16" ? estimator::Precision::kFp16Mixed
                                           : estimator::Precision::kFp32;
    }
    std::vector<std::string> keys;
    if (type_ == "FSDP") {
      std::string strategy = strategy_;
      if (strategy == "HYBRID_SHARD" || strategy == "HYBRID_SHARD_ZERO2") {
        // Sharded within a node, replicated across nodes: each GPU holds what one node's
        // FULL_SHARD (or SHARD_GRAD_OP) would give it.
        s.num_nodes = 1;
        strategy = strategy == "HYBRID_SHARD" ? "FULL_SHARD" : "SHARD_GRAD_OP";
        report_.notes.push_back(strategy_ + ": predicted as " + strategy + " over a node's " +
                                std::to_string(cluster.gpus_per_node) + " GPUs");
      }
      s.fsdp = strategy == "FULL_SHARD"      ? estimator::FsdpSharding::kFullShard
               : strategy == "SHARD_GRAD_OP" ? estimator::FsdpSharding::kShardGradOp
                                             : estimator::FsdpSharding::kNoShard;
      s.zero_stage = 0;
      if (offload_params_) {
        s.offload_param = estimator::OffloadDevice::kCpu;
        s.offload_optimizer = estimator::OffloadDevice::kCpu;
      }
      if (checkpointing_ && options_.supplied.count("checkpointing") == 0) {
        s.checkpointing = estimator::Checkpointing::kFull;
      }
      keys = {fsdp_version_ == 2 ? "fsdp_config.fsdp_reshard_after_forward"
                                 : "fsdp_config.fsdp_sharding_strategy",
              "fsdp_config.fsdp_offload_params", "fsdp_config.fsdp_activation_checkpointing"};
    } else if (type_ == "DEEPSPEED") {
      s.zero_stage = zero_stage_;
      auto device = [](const std::string& d) {
        return d == "cpu"    ? estimator::OffloadDevice::kCpu
               : d == "nvme" ? estimator::OffloadDevice::kNvme
                             : estimator::OffloadDevice::kNone;
      };
      s.offload_optimizer = device(offload_optimizer_);
      s.offload_param = device(offload_param_);
      keys = {"deepspeed_config.zero_stage", "deepspeed_config.offload_optimizer_device",
              "deepspeed_config.offload_param_device"};
    } else {
      s.zero_stage = 0;  // DDP
      keys = {"distributed_type"};
    }
    if (grad_accum_ > 0 && options_.supplied.count("grad_accum") == 0) s.grad_accum = grad_accum_;
    if (Status valid = s.Validate(); !valid.ok()) return cannot(valid.message());
    auto m = estimator::EstimateMemory(*options_.model, s);
    if (!m.ok()) return cannot(m.status().message());
    report_.setup_line = estimator::SetupLine(m->setup);
    report_.predicted = m->peak;
    if (options_.seq_len <= 0) {
      report_.notes.push_back("assumed seq_len " + std::to_string(m->setup.seq_len) +
                              " (the model's positions, at most 2048): an Accelerate config does "
                              "not carry it; pass --seq-len as the job runs it");
    }
    report_.notes.push_back("predicted peak per GPU " + AccGib(m->peak.gpu_bytes) + " (" +
                            m->peak.phase + "), CPU per node " + AccGib(m->peak.cpu_bytes) +
                            ", seq_len " + std::to_string(m->setup.seq_len));
    const uint64_t usable = static_cast<uint64_t>(static_cast<double>(cluster.gpu.memory_bytes) *
                                                  (1 - options_.gpu_safety_fraction));
    if (m->peak.gpu_bytes > usable) {
      Problem(type_ == "FSDP"        ? "fsdp_config"
              : type_ == "DEEPSPEED" ? "deepspeed_config"
                                     : "distributed_type",
              "predicted peak " + AccGib(m->peak.gpu_bytes) + " per GPU (" + m->peak.phase +
                  ") does not fit " + cluster.gpu.name + " (" + AccGib(usable) + " usable of " +
                  AccGib(cluster.gpu.memory_bytes) + "); try `memplan plan`",
              keys);
    }
    if (cluster.cpu_memory_bytes > 0 && m->peak.cpu_bytes > cluster.cpu_memory_bytes / 100 * 85) {
      Problem(type_ == "FSDP" ? "fsdp_config.fsdp_offload_params"
                              : "deepspeed_config.offload_optimizer_device",
              "predicted CPU memory " + AccGib(m->peak.cpu_bytes) + " per node exceeds 85% of " +
                  AccGib(cluster.cpu_memory_bytes) + " RAM");
    }
  }

  CheckReport Take() { return std::move(report_); }

 private:
  const CheckOptions& options_;
  CheckReport report_;
  bool sagemaker_ = false;
  std::string type_;  // distributed_type, when valid
  std::string precision_ = "no";
  // FSDP, as Accelerate would run it.
  int fsdp_version_ = 1;
  std::string strategy_ = "FULL_SHARD";
  bool offload_params_ = false;
  bool checkpointing_ = false;
  // DeepSpeed without a config file.
  std::string deepspeed_file_;
  int zero_stage_ = 2;
  std::string offload_optimizer_ = "none";
  std::string offload_param_ = "none";
  int64_t grad_accum_ = 0;
};

}  // namespace

bool IsAccelerateConfig(const nlohmann::json& config) {
  return config.is_object() &&
         (config.contains("distributed_type") || config.contains("compute_environment"));
}

Result<CheckReport> CheckAccelerateConfig(const nlohmann::json& config,
                                          const CheckOptions& options) {
  if (!config.is_object()) {
    return Status::InvalidArgument("an Accelerate config must be a mapping of settings");
  }
  AccelerateChecker checker(options);
  checker.TopLevel(config);
  checker.MixedPrecision(config);
  checker.Dynamo(config);
  checker.Processes(config);
  checker.Fsdp(config);
  checker.DeepSpeed(config);
  checker.Parallelism(config);
  checker.Fit();
  return checker.Take();
}

}  // namespace memplan::planner
