#include "planner/emit.h"

#include <algorithm>
#include <map>

#include "planner/generated_text.h"
#include "schedule/schedule.h"

namespace memplan::planner {
namespace {

using estimator::Checkpointing;
using estimator::OffloadDevice;
using estimator::Precision;
using nlohmann::ordered_json;

const char* DeviceName(OffloadDevice d) {
  switch (d) {
    case OffloadDevice::kNone: return "none";
    case OffloadDevice::kCpu: return "cpu";
    case OffloadDevice::kNvme: return "nvme";
  }
  return "none";
}

// Where swap files go: a folder under the NVMe path, as DeepSpeed creates per-rank folders itself.
std::string NvmePath(const Cluster& c) { return c.nvme_path.empty() ? "/local_nvme" : c.nvme_path; }

// DeepSpeed 0.19 removed MiCS, its only ZeRO-3 sharding within a node group. Like every emitter
// error, the message does not say which emitter refused: the caller does (the CLI's flag, the
// request's "not_emitted" key).
Status HybridForDeepSpeed(const Plan& plan) {
  if (plan.sharding != Sharding::kHybrid || plan.setup.zero_stage != 3) return Status::Ok();
  return Status::InvalidArgument(
      "plan " + plan.family +
      " shards within each node, which DeepSpeed cannot since it removed MiCS (0.19); emit it "
      "for FSDP (FSDP arguments, or `accelerate_plugin` fsdp: HYBRID_SHARD) or choose `sharding` "
      "full");
}

// FSDP's name for the plan's sharding.
std::string FsdpStrategy(const Plan& plan) {
  const int stage = plan.setup.zero_stage;
  if (stage == 3) return plan.sharding == Sharding::kHybrid ? "HYBRID_SHARD" : "FULL_SHARD";
  return stage >= 1 ? "SHARD_GRAD_OP" : "NO_SHARD";
}

}  // namespace

std::string DecoderLayerClass(const std::string& model_type) {
  static const std::map<std::string, std::string> kClasses = {
      {"llama", "LlamaDecoderLayer"},     {"mistral", "MistralDecoderLayer"},
      {"mixtral", "MixtralDecoderLayer"}, {"qwen2", "Qwen2DecoderLayer"},
      {"gemma", "GemmaDecoderLayer"},     {"gpt2", "GPT2Block"},
      {"gpt_neox", "GPTNeoXLayer"},       {"bert", "BertLayer"},
      {"roberta", "RobertaLayer"},        {"t5", "T5Block"}};
  auto it = kClasses.find(model_type);
  return it == kClasses.end() ? "" : it->second;
}

std::string DecoderLayerClass(const estimator::ModelInventory& inventory) {
  if (inventory.arch.has_value() && !inventory.arch->no_split_class.empty()) {
    return inventory.arch->no_split_class;
  }
  return DecoderLayerClass(inventory.model_type);
}

Result<ordered_json> DeepSpeedConfig(const Plan& plan, const Cluster& cluster,
                                     const estimator::ModelInventory& inventory,
                                     const EmitOptions& options) {
  const estimator::TrainingSetup& s = plan.setup;
  if (s.zero_stage < 0 || s.zero_stage > 3) return Status::Internal("plan with a bad ZeRO stage");
  MEMPLAN_RETURN_IF_ERROR(HybridForDeepSpeed(plan));
  const bool hf = options.for_hf_trainer;
  const ordered_json kAuto = "auto";
  const int64_t hidden = inventory.arch ? inventory.arch->hidden : 0;
  ordered_json ds;
  const int64_t world = cluster.WorldSize();
  if (hf) {
    ds["train_batch_size"] = kAuto;
    ds["train_micro_batch_size_per_gpu"] = kAuto;
    ds["gradient_accumulation_steps"] = kAuto;
    ds["gradient_clipping"] = kAuto;
  } else {
    ds["train_batch_size"] = s.micro_batch * s.grad_accum * world;
    ds["train_micro_batch_size_per_gpu"] = s.micro_batch;
    ds["gradient_accumulation_steps"] = s.grad_accum;
    ds["gradient_clipping"] = 1.0;
  }
  ds["steps_per_print"] = 100;
  ds["wall_clock_breakdown"] = false;
  switch (s.precision) {
    case Precision::kBf16Mixed:
    case Precision::kBf16Pure: ds["bf16"] = {{"enabled", hf ? kAuto : ordered_json(true)}}; break;
    case Precision::kFp16Mixed:
      ds["fp16"] = {{"enabled", hf ? kAuto : ordered_json(true)},
                    {"loss_scale", 0},
                    {"loss_scale_window", 1000},
                    {"initial_scale_power", 16},
                    {"hysteresis", 2},
                    {"min_loss_scale", 1}};
      break;
    case Precision::kFp32: break;
  }
  // DeepSpeed's own optimizers (CPU Adam when offloaded); others come from the training script.
  if (s.optimizer == estimator::Optimizer::kAdamW || s.optimizer == estimator::Optimizer::kLion) {
    ordered_json params;
    params["lr"] = hf ? kAuto : ordered_json(options.learning_rate);
    params["betas"] =
        hf ? kAuto
           : ordered_json::array({0.9, s.optimizer == estimator::Optimizer::kLion ? 0.99 : 0.999});
    if (s.optimizer == estimator::Optimizer::kAdamW)
      params["eps"] = hf ? kAuto : ordered_json(1e-8);
    params["weight_decay"] = hf ? kAuto : ordered_json(options.weight_decay);
    ds["optimizer"] = {{"type", s.optimizer == estimator::Optimizer::kLion ? "Lion" : "AdamW"},
                       {"params", params}};
  } else {
    ds["zero_allow_untested_optimizer"] = true;
  }

  ordered_json z;
  z["stage"] = s.zero_stage;
  if (s.zero_stage >= 1) {
    z["overlap_comm"] = s.OverlapComm();
    z["contiguous_gradients"] = true;
    z["reduce_scatter"] = true;
    z["reduce_bucket_size"] = hf && hidden > 0 ? kAuto : ordered_json(s.reduce_bucket_size);
    if (s.zero_stage <= 2) {
      z["allgather_partitions"] = true;
      z["allgather_bucket_size"] = s.allgather_bucket_size;
    } else {
      z["stage3_prefetch_bucket_size"] =
          hf && hidden > 0 ? kAuto : ordered_json(s.stage3_prefetch_bucket_size);
      z["stage3_param_persistence_threshold"] =
          hf && hidden > 0 ? kAuto : ordered_json(s.stage3_param_persistence_threshold);
      z["stage3_max_live_parameters"] = s.stage3_max_live_parameters;
      // With the parameters on NVMe every gathered parameter holds a swap buffer: keep no more
      // than the live limit gathered for reuse (Note [Tuned buffers]).
      z["stage3_max_reuse_distance"] =
          s.offload_param == OffloadDevice::kNvme ? s.stage3_max_live_parameters : 1000000000;
      z["stage3_gather_16bit_weights_on_model_save"] = true;
      z["sub_group_size"] = s.sub_group_size;
    }
  }
  if (s.offload_optimizer != OffloadDevice::kNone) {
    ordered_json o;
    o["device"] = DeviceName(s.offload_optimizer);
    if (s.offload_optimizer == OffloadDevice::kNvme) {
      MEMPLAN_RETURN_IF_ERROR(RequireUtf8(NvmePath(cluster), "`nvme_path`"));
      o["nvme_path"] = NvmePath(cluster);
    }
    o["pin_memory"] = s.pin_memory;
    if (s.offload_optimizer == OffloadDevice::kNvme) {
      o["buffer_count"] = s.optimizer_buffer_count;
      o["pipeline_read"] = true;
      o["pipeline_write"] = true;
      o["fast_init"] = false;
    }
    z["offload_optimizer"] = o;
  }
  if (s.offload_param != OffloadDevice::kNone) {
    ordered_json p;
    p["device"] = DeviceName(s.offload_param);
    if (s.offload_param == OffloadDevice::kNvme) {
      MEMPLAN_RETURN_IF_ERROR(RequireUtf8(NvmePath(cluster), "`nvme_path`"));
      p["nvme_path"] = NvmePath(cluster);
    }
    p["pin_memory"] = s.pin_memory;
    if (s.offload_param == OffloadDevice::kNvme) {
      p["buffer_count"] = s.param_buffer_count;
      p["buffer_size"] = s.param_buffer_size;
    }
    p["max_in_cpu"] = 1000000000;
    z["offload_param"] = p;
  }
  ds["zero_optimization"] = z;
  if (s.checkpointing != Checkpointing::kNone) {
    // Configures deepspeed.checkpointing; the model must also checkpoint (for Hugging Face models:
    // model.gradient_checkpointing_enable()).
    ds["activation_checkpointing"] = {
        {"partition_activations", false},           {"cpu_checkpointing", false},
        {"contiguous_memory_optimization", false},  {"number_checkpoints", nullptr},
        {"synchronize_checkpoint_boundary", false}, {"profile", false}};
  }
  if (s.offload_optimizer == OffloadDevice::kNvme || s.offload_param == OffloadDevice::kNvme) {
    ds["aio"] = {{"block_size", s.aio_block_size},
                 {"queue_depth", s.aio_queue_depth},
                 {"intra_op_parallelism", s.aio_intra_op_parallelism},
                 {"single_submit", false},
                 {"overlap_events", true},
                 {"use_gds", false}};
  }
  return ds;
}

Result<std::string> AccelerateConfig(const Plan& plan, const Cluster& cluster,
                                     const estimator::ModelInventory& inventory,
                                     const EmitOptions& options) {
  const estimator::TrainingSetup& s = plan.setup;
  std::string mixed = s.precision == Precision::kFp16Mixed ? "fp16"
                      : s.precision == Precision::kFp32    ? "'no'"
                                                           : "bf16";
  std::string y = "# accelerate launch --config_file <this file> train.py\n" +
                  CommentLine("Written by memplan plan: " + plan.family + ", micro-batch " +
                              std::to_string(s.micro_batch) + " x " + std::to_string(s.grad_accum) +
                              " accumulation.");
  y += "compute_environment: LOCAL_MACHINE\ndebug: false\n";
  if (options.accelerate_plugin == "fsdp") {
    if (s.offload_optimizer == OffloadDevice::kNvme || s.offload_param == OffloadDevice::kNvme) {
      return Status::InvalidArgument(
          "`accelerate_plugin` fsdp: the plan offloads to NVMe, which FSDP cannot; use the "
          "DeepSpeed plugin or another plan (`plan_index`)");
    }
    const std::string strategy = FsdpStrategy(plan);
    const std::string layer = DecoderLayerClass(inventory);
    y += "distributed_type: FSDP\ndowncast_bf16: 'no'\nfsdp_config:\n";
    if (layer.empty()) {
      y += "  fsdp_auto_wrap_policy: SIZE_BASED_WRAP\n  fsdp_min_num_params: 100000000\n";
    } else {
      MEMPLAN_ASSIGN_OR_RETURN(std::string layer_class,
                               YamlScalar(layer, "the model's decoder layer class"));
      y += "  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n"
           "  fsdp_transformer_layer_cls_to_wrap: " +
           layer_class + "\n";
    }
    y += "  fsdp_backward_prefetch: BACKWARD_PRE\n";
    y += "  fsdp_cpu_ram_efficient_loading: true\n";
    y += "  fsdp_forward_prefetch: false\n";
    y += std::string("  fsdp_offload_params: ") +
         (s.offload_param != OffloadDevice::kNone || s.offload_optimizer != OffloadDevice::kNone
              ? "true"
              : "false") +
         "\n";
    // Note [FSDP1's strategy in Accelerate]: under fsdp_version 1 Accelerate 1.15 takes the
    // strategy from sharding_strategy, which `accelerate launch` always exports (FULL_SHARD when
    // the file is silent), and reads reshard_after_forward only when it is unset: a strategy
    // written as fsdp_reshard_after_forward alone is silently FULL_SHARD. sharding_strategy is
    // "deprecated" there, a warning; it is the key FSDP1 obeys.
    y += "  fsdp_sharding_strategy: " + strategy + "\n";
    y += "  fsdp_state_dict_type: SHARDED_STATE_DICT\n";
    y += "  fsdp_sync_module_states: true\n";
    y += "  fsdp_use_orig_params: true\n";
    y += "  fsdp_version: 1\n";
    y += std::string("  fsdp_activation_checkpointing: ") +
         (s.checkpointing != Checkpointing::kNone ? "true" : "false") + "\n";
  } else {
    MEMPLAN_RETURN_IF_ERROR(HybridForDeepSpeed(plan));
    y += "distributed_type: DEEPSPEED\ndeepspeed_config:\n";
    if (!options.deepspeed_config_path.empty()) {
      MEMPLAN_ASSIGN_OR_RETURN(std::string config_file, YamlQuoted(options.deepspeed_config_path,
                                                                   "`deepspeed_config_path`"));
      y += "  deepspeed_config_file: " + config_file + "\n";
      y += std::string("  zero3_init_flag: ") + (s.zero_stage == 3 ? "true" : "false") + "\n";
    } else {
      // Accelerate 1.15's launcher passes no offload_*_nvme_path on: DeepSpeed would get
      // nvme_path "none" (Note [What Accelerate refuses and ignores], accelerate_check.cc). The
      // NVMe path has to travel in a DeepSpeed config file.
      if (s.offload_optimizer == OffloadDevice::kNvme || s.offload_param == OffloadDevice::kNvme) {
        return Status::InvalidArgument(
            "the plan offloads to NVMe and accelerate launch does not pass an NVMe path on "
            "(DeepSpeed would get nvme_path \"none\"): write the DeepSpeed config too "
            "(`deepspeed_config_path`), which the Accelerate config then names");
      }
      y += "  gradient_accumulation_steps: " + std::to_string(s.grad_accum) + "\n";
      y += "  gradient_clipping: 1.0\n";
      y += std::string("  offload_optimizer_device: ") + DeviceName(s.offload_optimizer) + "\n";
      y += std::string("  offload_param_device: ") + DeviceName(s.offload_param) + "\n";
      y += std::string("  zero3_init_flag: ") + (s.zero_stage == 3 ? "true" : "false") + "\n";
      if (s.zero_stage == 3) y += "  zero3_save_16bit_model: true\n";
      y += "  zero_stage: " + std::to_string(s.zero_stage) + "\n";
    }
    y += "downcast_bf16: 'no'\n";
  }
  y += "machine_rank: 0\nmain_training_function: main\n";
  // With a DeepSpeed config file its precision block rules, and Accelerate's launcher refuses a
  // mixed_precision beside it (DeepSpeedPlugin._deepspeed_config_checks); Accelerate reads the
  // precision back from the file.
  const bool deepspeed_file =
      options.accelerate_plugin != "fsdp" && !options.deepspeed_config_path.empty();
  if (!deepspeed_file) y += "mixed_precision: " + mixed + "\n";
  y += "num_machines: " + std::to_string(cluster.nodes) + "\n";
  y += "num_processes: " + std::to_string(cluster.WorldSize()) + "\n";
  y += "rdzv_backend: static\nsame_network: true\ntpu_env: []\ntpu_use_cluster: false\n"
       "tpu_use_sudo: false\nuse_cpu: false\n";
  return y;
}

Result<ordered_json> FsdpConfig(const Plan& plan, const Cluster& cluster,
                                const estimator::ModelInventory& inventory) {
  const estimator::TrainingSetup& s = plan.setup;
  if (s.offload_optimizer == OffloadDevice::kNvme || s.offload_param == OffloadDevice::kNvme) {
    return Status::InvalidArgument(
        "the plan offloads to NVMe, which FSDP cannot; choose a plan without NVMe "
        "(`plan_index`)");
  }
  const std::string dtype = s.precision == Precision::kFp16Mixed ? "float16"
                            : s.precision == Precision::kFp32    ? "float32"
                                                                 : "bfloat16";
  ordered_json j;
  const std::string strategy = FsdpStrategy(plan);
  j["sharding_strategy"] = strategy;
  j["cpu_offload"] = {{"offload_params", s.offload_param != OffloadDevice::kNone ||
                                             s.offload_optimizer != OffloadDevice::kNone}};
  j["mixed_precision"] = {{"param_dtype", dtype}, {"reduce_dtype", dtype}, {"buffer_dtype", dtype}};
  const std::string layer = DecoderLayerClass(inventory);
  if (layer.empty()) {
    j["auto_wrap_policy"] = {{"policy", "size_based"}, {"min_num_params", 100000000}};
  } else {
    j["auto_wrap_policy"] = {{"policy", "transformer"},
                             {"transformer_layer_cls", ordered_json::array({layer})}};
  }
  j["backward_prefetch"] = "BACKWARD_PRE";
  j["forward_prefetch"] = false;
  j["limit_all_gathers"] = true;
  j["use_orig_params"] = true;
  j["sync_module_states"] = true;
  j["activation_checkpointing"] = s.checkpointing != Checkpointing::kNone;
  j["micro_batch_size_per_gpu"] = s.micro_batch;
  j["gradient_accumulation_steps"] = s.grad_accum;
  j["world_size"] = cluster.WorldSize();
  const bool offload = j["cpu_offload"]["offload_params"].get<bool>();
  const std::string short_dtype = s.precision == Precision::kFp16Mixed ? "fp16"
                                  : s.precision == Precision::kFp32    ? "fp32"
                                                                       : "bf16";
  // The same plan as keyword arguments of Accelerate's FullyShardedDataParallelPlugin (FSDP1
  // names of Accelerate 1.x) ...
  ordered_json acc;
  acc["fsdp_version"] = 1;
  acc["sharding_strategy"] = strategy;  // Note [FSDP1's strategy in Accelerate]
  acc["cpu_offload"] = offload;
  acc["backward_prefetch"] = "BACKWARD_PRE";
  acc["mixed_precision_policy"] = short_dtype;
  if (layer.empty()) {
    acc["auto_wrap_policy"] = "size_based_wrap";
    acc["min_num_params"] = 100000000;
  } else {
    acc["auto_wrap_policy"] = "transformer_based_wrap";
    acc["transformer_cls_names_to_wrap"] = ordered_json::array({layer});
  }
  acc["state_dict_type"] = "SHARDED_STATE_DICT";
  acc["limit_all_gathers"] = true;
  acc["use_orig_params"] = true;
  acc["sync_module_states"] = true;
  acc["forward_prefetch"] = false;
  acc["activation_checkpointing"] = s.checkpointing != Checkpointing::kNone;
  acc["cpu_ram_efficient_loading"] = true;
  j["accelerate"] = acc;
  // ... and of torch FSDP2's fully_shard, applied to each decoder layer and then the root: the
  // mesh is (replicas, shards): one replica per node under hybrid sharding, one shard group per
  // GPU without sharding.
  const int64_t world = cluster.WorldSize();
  const int64_t shards = strategy == "HYBRID_SHARD" ? cluster.gpus_per_node
                         : strategy == "NO_SHARD"   ? 1
                                                    : world;
  ordered_json fs;
  fs["reshard_after_forward"] = strategy == "FULL_SHARD" || strategy == "HYBRID_SHARD";
  fs["mp_policy"] = {{"param_dtype", dtype}, {"reduce_dtype", dtype}};
  fs["offload_policy"] = offload ? "CPUOffloadPolicy" : "OffloadPolicy";
  fs["mesh"] = {{"shape", ordered_json::array({world / shards, shards})},
                {"mesh_dim_names", ordered_json::array({"replicate", "shard"})}};
  j["fully_shard"] = fs;
  return j;
}

Result<EmittedSchedule> EngineScheduleFor(const Plan& plan, const Cluster& cluster,
                                          const estimator::ModelInventory& inventory) {
  const estimator::TrainingSetup& s = plan.setup;
  if (s.offload_optimizer == OffloadDevice::kNone) {
    return Status::InvalidArgument(
        "plan " + plan.family +
        " offloads nothing, and the offload engine runs only plans whose optimizer is on the CPU "
        "or NVMe; emit a DeepSpeed config instead, or choose an offload plan (`plan_index`)");
  }
  if (s.optimizer != estimator::Optimizer::kAdamW && s.optimizer != estimator::Optimizer::kLion) {
    return Status::InvalidArgument("the offload engine's CPU optimizers are Adam/AdamW and Lion");
  }
  auto engine_tier = [](OffloadDevice d) {
    return d == OffloadDevice::kNone  ? offload::Tier::kGpu
           : d == OffloadDevice::kCpu ? offload::Tier::kCpu
                                      : offload::Tier::kNvme;
  };
  const uint64_t w = s.precision == Precision::kFp32 ? 4 : 2;
  EmittedSchedule out;
  offload::Schedule& e = out.schedule;
  e.param_tier = engine_tier(s.offload_param);
  // 4 bytes an element for fp32, else 2 (w), as the engine model reads the dtype.
  e.param_dtype = s.precision == Precision::kFp32        ? offload::ElementType::kFloat32
                  : s.precision == Precision::kFp16Mixed ? offload::ElementType::kFloat16
                                                         : offload::ElementType::kBFloat16;
  e.persistence_threshold = static_cast<uint64_t>(s.stage3_param_persistence_threshold);
  e.prefetch_bytes =
      std::max<uint64_t>(1, static_cast<uint64_t>(s.stage3_prefetch_bucket_size) * w);
  e.max_live_bytes = std::max<uint64_t>(1, static_cast<uint64_t>(s.stage3_max_live_parameters) * w);
  e.optimizer_tier = engine_tier(s.offload_optimizer);
  // Adam/AdamW (two states) or Lion (one): the only optimizers let through above.
  e.optimizer = s.optimizer == estimator::Optimizer::kLion ? offload::SwapOptimizer::kLion
                                                           : offload::SwapOptimizer::kAdam;
  e.optimizer_threads = 0;  // the engine picks
  EngineRunOptions run;
  run.world_size = static_cast<int>(cluster.WorldSize());
  run.gpu = true;
  run.micro_batches = static_cast<uint32_t>(std::max<int64_t>(1, s.grad_accum));

  // Note [Schedule for memplan's engine]: sized from the model, within the pinned memory a
  // process may lock.
  MEMPLAN_ASSIGN_OR_RETURN(EnginePrediction shape, PredictEngine(e, inventory, run));
  const uint64_t partition = (shape.partition_elements + 1023) / 1024 * 1024;
  uint64_t sub_group = std::min<uint64_t>(
      {std::max<uint64_t>(1024, static_cast<uint64_t>(s.sub_group_size) / 1024 * 1024),
       kMaxEngineSubGroupElements, partition});
  uint64_t limit = 0;  // pinned bytes per process; 0: unknown
  const auto per_node = static_cast<uint64_t>(std::max<int64_t>(1, cluster.gpus_per_node));
  if (cluster.cpu_memory_bytes > 0) limit = cluster.cpu_memory_bytes / 2 / per_node;
  if (cluster.memlock_bytes > 0) {
    limit = limit > 0 ? std::min(limit, cluster.memlock_bytes) : cluster.memlock_bytes;
  }
  for (;;) {
    e.sub_group_elements = sub_group;
    e.pinned_budget_bytes = 0;
    // Staging slots as large as the largest piece a fetch reads into one (a parameter's shard,
    // within a chunk), never larger than DeepSpeed's buffer; two to four of them.
    e.param_buffer_bytes =
        std::max<uint64_t>(4096, static_cast<uint64_t>(s.param_buffer_size) * w / 4096 * 4096);
    e.param_buffer_count = static_cast<uint32_t>(std::clamp<int64_t>(s.param_buffer_count, 2, 4));
    MEMPLAN_ASSIGN_OR_RETURN(EnginePrediction first, PredictEngine(e, inventory, run));
    if (first.largest_piece_bytes > 0) {
      e.param_buffer_bytes =
          std::max<uint64_t>(4096, (first.largest_piece_bytes + 4095) / 4096 * 4096);
    }
    // Never more optimizer buffers than sub-groups (the engine needs two).
    e.optimizer_buffer_count = static_cast<uint32_t>(std::clamp<uint64_t>(
        first.sub_groups, 2,
        static_cast<uint64_t>(std::max<int64_t>(2, s.optimizer_buffer_count))));
    MEMPLAN_ASSIGN_OR_RETURN(out.prediction, PredictEngine(e, inventory, run));
    // Smaller sub-groups shrink only the optimizer's buffers.
    if (limit == 0 || out.prediction.pinned_bytes <= limit || sub_group <= 1024 ||
        out.prediction.optimizer_pinned_bytes == 0) {
      break;
    }
    sub_group = std::max<uint64_t>(1024, sub_group / 2 / 1024 * 1024);
  }
  if (limit > 0 && out.prediction.pinned_bytes > limit) {
    const EnginePrediction& p = out.prediction;
    return Status::InvalidArgument(
        "memplan's engine needs " + std::to_string(p.pinned_bytes) +
        " pinned bytes per process for plan " + plan.family + " (parameter arena " +
        std::to_string(p.param_arena_pinned_bytes) + ", optimizer buffers " +
        std::to_string(p.optimizer_pinned_bytes) + " with sub-groups of " +
        std::to_string(e.sub_group_elements) + " elements, staging " +
        std::to_string(p.param_staging_pinned_bytes + p.gradient_staging_pinned_bytes) +
        "); the limit is " + std::to_string(limit) +
        " (half the RAM per GPU process, RLIMIT_MEMLOCK)");
  }
  // The budget is what the engine will pin: it starts with exactly that, and refuses a change
  // that would take more.
  e.pinned_budget_bytes = out.prediction.pinned_bytes;

  const bool nvme =
      s.offload_optimizer == OffloadDevice::kNvme || s.offload_param == OffloadDevice::kNvme;
  if (nvme) MEMPLAN_RETURN_IF_ERROR(RequireUtf8(NvmePath(cluster), "`nvme_path`"));
  e.nvme_path = nvme ? NvmePath(cluster) + "/memplan" : "";
  e.nvme_backend = nvme::BackendKind::kAuto;
  // The setup allows aio block sizes up to 2^50; the Schedule holds 32 bits (and the engine
  // refuses blocks over 64 MiB), so a larger one is refused here rather than cut.
  if (s.aio_block_size > int64_t{UINT32_MAX}) {
    return Status::InvalidArgument("aio.block_size " + std::to_string(s.aio_block_size) +
                                   " is larger than memplan's engine reads");
  }
  e.nvme_block_size = static_cast<uint32_t>(s.aio_block_size);
  e.nvme_queue_depth = static_cast<uint32_t>(s.aio_queue_depth);          // 1..2^16
  e.nvme_io_threads = static_cast<uint32_t>(s.aio_intra_op_parallelism);  // 1..64
  e.nvme_direct = true;
  out.json = offload::ToOrderedJson(e);
  return out;
}

Result<ordered_json> Schedule(const Plan& plan, const Cluster& cluster,
                              const estimator::ModelInventory& inventory) {
  MEMPLAN_ASSIGN_OR_RETURN(EmittedSchedule emitted, EngineScheduleFor(plan, cluster, inventory));
  return std::move(emitted.json);
}

Result<ordered_json> TrainerArguments(const Plan& plan, const Cluster& cluster,
                                      const estimator::ModelInventory& inventory,
                                      const EmitOptions& options) {
  const estimator::TrainingSetup& s = plan.setup;
  ordered_json args;
  args["per_device_train_batch_size"] = s.micro_batch;
  args["gradient_accumulation_steps"] = s.grad_accum;
  args["bf16"] = s.precision == Precision::kBf16Mixed || s.precision == Precision::kBf16Pure;
  args["fp16"] = s.precision == Precision::kFp16Mixed;
  // The Trainer switches full recomputation on or off; a plan that needs selective recomputation
  // (the attention core only) gets full, which fits in less memory but recomputes more than the
  // plan's step time assumed: said in `differences` and the notes (issue 31, item 8).
  args["gradient_checkpointing"] = s.checkpointing != Checkpointing::kNone;
  // Not part of the plan: the fine-tune's choice, written as memplan's defaults and said so.
  args["learning_rate"] = options.learning_rate;
  args["weight_decay"] = options.weight_decay;
  args["lr_scheduler_type"] = "linear";
  args["warmup_steps"] = 0;
  args["max_grad_norm"] = 1.0;
  if (s.optimizer == estimator::Optimizer::kAdam8bit) args["optim"] = "adamw_bnb_8bit";
  if (!options.deepspeed_config_path.empty()) args["deepspeed"] = options.deepspeed_config_path;
  ordered_json model;
  model["attn_implementation"] = AttnImplementation(s, inventory);
  ordered_json j;
  j["training_arguments"] = args;
  j["model"] = model;
  j["world_size"] = cluster.WorldSize();
  std::vector<std::string> notes = TrainerSettings(plan, inventory, options.for_hf_trainer);
  ordered_json differences = ordered_json::array();
  if (s.checkpointing == Checkpointing::kSelective) {
    differences.push_back(
        {{"field", "gradient_checkpointing"},
         {"plan", "selective"},
         {"written", "full"},
         {"why",
          "the Trainer has no flag for selective recomputation; full recomputation fits too "
          "(it keeps less) but runs slower than the plan's step time, which assumed selective"}});
    notes.push_back(
        "gradient_checkpointing=True is full recomputation, not the plan's selective one (the "
        "Trainer has no flag for it): the job fits, slower than planned; for the plan's speed "
        "wrap each layer's attention in torch.utils.checkpoint instead");
  }
  notes.push_back(
      "learning_rate, weight_decay, lr_scheduler_type and warmup_steps are not part of the plan: "
      "memplan wrote its defaults (--lr, weight decay 0, the Trainer's linear schedule without "
      "warm-up); set the fine-tune's own");
  j["differences"] = differences;
  j["notes"] = notes;
  return j;
}

}  // namespace memplan::planner
