#include "integration/requests.h"

#include <set>
#include <string>
#include <vector>

#include "common/byte_size.h"
#include "common/json.h"
#include "estimator/deepspeed_config.h"
#include "estimator/estimate.h"
#include "estimator/hf_config.h"
#include "estimator/model_source.h"
#include "estimator/shape_list.h"
#include "estimator/training_setup.h"
#include "planner/cluster.h"
#include "planner/emit.h"
#include "planner/job.h"
#include "planner/search.h"

namespace memplan::integration {
namespace {

using nlohmann::json;

// The fields of a request; errors name the key ("request: 'gpus' must be ...").
JsonFieldReader Fields(const json& request) { return JsonFieldReader(request, "request"); }

// Refuses a request that is not an object or has a key not in `allowed`.
Status CheckKeys(const json& request, std::initializer_list<std::string_view> allowed,
                 const char* what) {
  return JsonFieldReader(request, std::string(what) + " request").CheckKeys(allowed);
}

Result<estimator::ModelClassChoice> ModelClass(const json& request) {
  std::string text = "auto";
  MEMPLAN_RETURN_IF_ERROR(Fields(request).String("model_class", &text));
  if (text == "auto") return estimator::ModelClassChoice::kFromArchitectures;
  if (text == "base") return estimator::ModelClassChoice::kBase;
  return Status::InvalidArgument("request: \"model_class\" must be \"auto\" or \"base\", not \"" +
                                 text + "\"");
}

// The model of a request: exactly one of "model", "config", "shapes".
Result<estimator::ModelInventory> RequestModel(const json& request, bool allow_shapes,
                                               std::string* label) {
  const int given = static_cast<int>(request.contains("model")) +
                    static_cast<int>(request.contains("config")) +
                    static_cast<int>(request.contains("shapes"));
  const char* keys =
      allow_shapes ? "\"model\", \"config\" and \"shapes\"" : "\"model\" and \"config\"";
  if (given != 1) {
    return Status::InvalidArgument(std::string("request: give exactly one of ") + keys);
  }
  MEMPLAN_ASSIGN_OR_RETURN(estimator::ModelClassChoice choice, ModelClass(request));
  std::string name = "request";
  MEMPLAN_RETURN_IF_ERROR(Fields(request).Name("name", &name));
  if (request.contains("model")) {
    MEMPLAN_RETURN_IF_ERROR(Fields(request).String("model", label));
    if (label->empty()) return Status::InvalidArgument("request: \"model\" is empty");
    return estimator::LoadModel(*label, choice);
  }
  *label = name;
  estimator::ModelInventory inventory;
  if (request.contains("config")) {
    const json& config = request.at("config");
    if (!config.is_object()) {
      return Status::InvalidArgument("request: \"config\" must be a config.json object");
    }
    MEMPLAN_ASSIGN_OR_RETURN(inventory, estimator::InventoryFromHfConfig(config, name, choice));
  } else {
    if (!allow_shapes) return Status::InvalidArgument("request: \"shapes\" cannot be planned");
    // Re-read as text so that the tensors keep the caller's order (nlohmann::json sorts keys).
    MEMPLAN_ASSIGN_OR_RETURN(
        inventory, estimator::InventoryFromShapeListText(request.at("shapes").dump(), name));
  }
  inventory.name = name;
  return inventory;
}

}  // namespace

Result<nlohmann::json> Estimate(const nlohmann::json& request) {
  MEMPLAN_RETURN_IF_ERROR(CheckKeys(request,
                                    {"model", "config", "shapes", "name", "model_class", "gpus",
                                     "nodes", "buffer_factor", "setup", "deepspeed"},
                                    "estimate"));
  std::string label;
  MEMPLAN_ASSIGN_OR_RETURN(estimator::ModelInventory inventory,
                           RequestModel(request, /*allow_shapes=*/true, &label));
  estimator::DeepSpeedHardware hardware;
  MEMPLAN_RETURN_IF_ERROR(Fields(request).Integer("gpus", &hardware.gpus_per_node));
  MEMPLAN_RETURN_IF_ERROR(Fields(request).Integer("nodes", &hardware.nodes));
  MEMPLAN_RETURN_IF_ERROR(Fields(request).Number("buffer_factor", &hardware.buffer_factor));
  MEMPLAN_RETURN_IF_ERROR(hardware.Validate());
  if (!request.contains("setup") && !request.contains("deepspeed")) {
    MEMPLAN_ASSIGN_OR_RETURN(estimator::Estimate e,
                             estimator::EstimateModelStates(inventory, hardware));
    return estimator::ToJson(e);
  }
  json setup_json = request.value("setup", json::object());
  if (!setup_json.is_object()) {
    return Status::InvalidArgument("request: \"setup\" must be an object of training settings");
  }
  MEMPLAN_ASSIGN_OR_RETURN(estimator::TrainingSetup setup,
                           estimator::TrainingSetupFromJson(setup_json));
  if (request.contains("deepspeed")) {
    const json& config = request.at("deepspeed");
    if (!config.is_object()) {
      return Status::InvalidArgument("request: \"deepspeed\" must be a ds_config.json object");
    }
    std::set<std::string> supplied;
    for (const auto& [key, value] : setup_json.items()) supplied.insert(key);
    const int64_t hidden = inventory.arch.has_value() ? inventory.arch->hidden : 0;
    MEMPLAN_RETURN_IF_ERROR(
        estimator::ApplyDeepSpeedConfig(config, "request.deepspeed", supplied, hidden, &setup));
  }
  setup.gpus_per_node = hardware.gpus_per_node;
  setup.num_nodes = hardware.nodes;
  MEMPLAN_ASSIGN_OR_RETURN(estimator::Estimate e,
                           estimator::EstimateTraining(inventory, hardware, setup));
  return estimator::ToJson(e);
}

Result<nlohmann::json> Plan(const nlohmann::json& request) {
  MEMPLAN_RETURN_IF_ERROR(CheckKeys(request,
                                    {"model",
                                     "config",
                                     "name",
                                     "model_class",
                                     "cluster",
                                     "gpu",
                                     "gpus",
                                     "nodes",
                                     "cpu_mem",
                                     "cpu_cores",
                                     "pcie_gen",
                                     "memlock",
                                     "nvme_path",
                                     "nvme_capacity",
                                     "global_batch",
                                     "global_batch_tokens",
                                     "seq_len",
                                     "precision",
                                     "optimizer",
                                     "lora_rank",
                                     "lora_targets",
                                     "qlora",
                                     "flash_attention",
                                     "foreach",
                                     "fused_optimizer",
                                     "sgd_momentum",
                                     "sequence_parallel",
                                     "autocast",
                                     "gradient_as_bucket_view",
                                     "cuda_context_mib",
                                     "gpu_margin",
                                     "allow_nvme",
                                     "top",
                                     "emit",
                                     "plan_index",
                                     "for_hf_trainer",
                                     "lr",
                                     "accelerate_plugin",
                                     "inter_node_bw",
                                     "zero_stage",
                                     "offload_optimizer",
                                     "offload_param",
                                     "checkpointing",
                                     "micro_batch",
                                     "sharding",
                                     "default_buffers"},
                                    "plan"));
  std::string label;
  MEMPLAN_ASSIGN_OR_RETURN(estimator::ModelInventory inventory,
                           RequestModel(request, /*allow_shapes=*/false, &label));
  if (!inventory.arch) {
    return Status::InvalidArgument(label +
                                   ": planning needs the architecture (a config.json or "
                                   "built-in model)");
  }

  // The cluster: "cluster" first, then the preset keys over it.
  planner::Cluster cluster;
  bool have_gpu = false;
  if (request.contains("cluster")) {
    MEMPLAN_ASSIGN_OR_RETURN(cluster,
                             planner::ClusterFromJson(request.at("cluster"), "request.cluster"));
    have_gpu = true;
  }
  std::string gpu;
  MEMPLAN_RETURN_IF_ERROR(Fields(request).String("gpu", &gpu));
  if (!gpu.empty()) {
    MEMPLAN_ASSIGN_OR_RETURN(cluster.gpu, planner::FindGpuPreset(gpu));
    have_gpu = true;
  }
  if (!have_gpu) return Status::InvalidArgument("request: give \"gpu\" (a preset) or \"cluster\"");
  MEMPLAN_RETURN_IF_ERROR(Fields(request).Integer("gpus", &cluster.gpus_per_node));
  MEMPLAN_RETURN_IF_ERROR(Fields(request).Integer("nodes", &cluster.nodes));
  MEMPLAN_RETURN_IF_ERROR(Fields(request).ByteSize("cpu_mem", &cluster.cpu_memory_bytes));
  MEMPLAN_RETURN_IF_ERROR(Fields(request).Integer("cpu_cores", &cluster.cpu_cores));
  int64_t pcie_gen = cluster.pcie_gen;
  MEMPLAN_RETURN_IF_ERROR(Fields(request).Integer("pcie_gen", &pcie_gen));
  cluster.pcie_gen = static_cast<int>(pcie_gen);
  if (request.contains("memlock") && request.at("memlock") == "unlimited") {
    cluster.memlock_bytes = 0;
  } else {
    MEMPLAN_RETURN_IF_ERROR(Fields(request).ByteSize("memlock", &cluster.memlock_bytes));
  }
  MEMPLAN_RETURN_IF_ERROR(Fields(request).Name("nvme_path", &cluster.nvme_path));
  MEMPLAN_RETURN_IF_ERROR(Fields(request).ByteSize("nvme_capacity", &cluster.nvme_capacity_bytes));
  double inter_node_gbps = 0;
  MEMPLAN_RETURN_IF_ERROR(Fields(request).Number("inter_node_bw", &inter_node_gbps));
  if (request.contains("inter_node_bw")) {
    if (!(inter_node_gbps > 0 && inter_node_gbps <= 1e6)) {
      return Status::InvalidArgument("request: \"inter_node_bw\" must be in (0, 1e6] GB/s");
    }
    cluster.inter_node_bytes_per_s = inter_node_gbps * 1e9;
  }
  MEMPLAN_RETURN_IF_ERROR(cluster.Validate());

  // The job.
  planner::Job job;
  job.model = label;
  estimator::TrainingSetup& s = job.setup;
  std::string precision = cluster.gpu.bf16_flops > 0 ? "bf16-mixed" : "fp16-mixed";
  MEMPLAN_RETURN_IF_ERROR(Fields(request).String("precision", &precision));
  MEMPLAN_ASSIGN_OR_RETURN(s.precision, estimator::ParsePrecision(precision));
  std::string optimizer = "adamw";
  MEMPLAN_RETURN_IF_ERROR(Fields(request).String("optimizer", &optimizer));
  MEMPLAN_ASSIGN_OR_RETURN(s.optimizer, estimator::ParseOptimizer(optimizer));
  MEMPLAN_RETURN_IF_ERROR(Fields(request).Integer("lora_rank", &s.lora_rank));
  if (request.contains("lora_targets")) {
    const json& t = request.at("lora_targets");
    if (!t.is_array()) return Status::InvalidArgument("request: \"lora_targets\" must be a list");
    for (const json& name : t) {
      if (!name.is_string()) {
        return Status::InvalidArgument("request: \"lora_targets\" must hold strings");
      }
      s.lora_targets.push_back(name.get<std::string>());
    }
  }
  MEMPLAN_RETURN_IF_ERROR(Fields(request).Bool("qlora", &s.qlora));
  // The same defaults as `memplan estimate` and `check` (TrainingSetup's own).
  MEMPLAN_RETURN_IF_ERROR(Fields(request).Bool("flash_attention", &s.flash_attention));
  MEMPLAN_RETURN_IF_ERROR(Fields(request).Bool("foreach", &s.foreach));
  MEMPLAN_RETURN_IF_ERROR(Fields(request).Bool("fused_optimizer", &s.fused_optimizer));
  MEMPLAN_RETURN_IF_ERROR(Fields(request).Number("sgd_momentum", &s.sgd_momentum));
  MEMPLAN_RETURN_IF_ERROR(Fields(request).Bool("sequence_parallel", &s.sequence_parallel));
  MEMPLAN_RETURN_IF_ERROR(Fields(request).Bool("autocast", &s.autocast));
  MEMPLAN_RETURN_IF_ERROR(
      Fields(request).Bool("gradient_as_bucket_view", &s.gradient_as_bucket_view));
  MEMPLAN_RETURN_IF_ERROR(Fields(request).Integer("seq_len", &s.seq_len));
  double cuda_context_mib = 1343;
  MEMPLAN_RETURN_IF_ERROR(Fields(request).Number("cuda_context_mib", &cuda_context_mib));
  if (!(cuda_context_mib >= 0 && cuda_context_mib <= 1048576)) {
    return Status::InvalidArgument("request: \"cuda_context_mib\" must be in [0, 1048576]");
  }
  s.cuda_context_bytes = static_cast<int64_t>(cuda_context_mib * 1048576.0);
  int64_t samples = 0, tokens = 0;
  MEMPLAN_RETURN_IF_ERROR(Fields(request).Integer("global_batch", &samples));
  MEMPLAN_RETURN_IF_ERROR(Fields(request).Integer("global_batch_tokens", &tokens));
  if ((samples > 0) == (tokens > 0)) {
    return Status::InvalidArgument(
        "request: give exactly one of \"global_batch\" (samples) and \"global_batch_tokens\", "
        "positive");
  }
  if (tokens > 0) {
    MEMPLAN_ASSIGN_OR_RETURN(job.global_batch,
                             planner::SamplesFromTokens(tokens, s.SeqLenFor(&*inventory.arch)));
  } else {
    job.global_batch = samples;
  }

  // As `memplan plan`: 8-bit AdamW is a candidate unless the optimizer was chosen; the "what if"
  // keys restrict the search.
  planner::SearchOptions options;
  MEMPLAN_RETURN_IF_ERROR(Fields(request).Number("gpu_margin", &options.gpu_safety_fraction));
  MEMPLAN_RETURN_IF_ERROR(Fields(request).Bool("allow_nvme", &options.allow_nvme));
  options.consider_8bit = !request.contains("optimizer");
  int64_t zero_stage = -1, micro_batch = 0;
  MEMPLAN_RETURN_IF_ERROR(Fields(request).Integer("zero_stage", &zero_stage));
  if (zero_stage < -1 || zero_stage > 3) {
    return Status::InvalidArgument("request: \"zero_stage\" must be 0-3");
  }
  options.only_stage = static_cast<int>(zero_stage);
  MEMPLAN_RETURN_IF_ERROR(Fields(request).Integer("micro_batch", &micro_batch));
  if (micro_batch < 0) return Status::InvalidArgument("request: \"micro_batch\" must be >= 1");
  options.only_micro_batch = micro_batch;
  std::string text;
  if (request.contains("offload_optimizer")) {
    MEMPLAN_RETURN_IF_ERROR(Fields(request).String("offload_optimizer", &text));
    MEMPLAN_ASSIGN_OR_RETURN(options.only_offload_optimizer, estimator::ParseOffloadDevice(text));
  }
  if (request.contains("offload_param")) {
    MEMPLAN_RETURN_IF_ERROR(Fields(request).String("offload_param", &text));
    MEMPLAN_ASSIGN_OR_RETURN(options.only_offload_param, estimator::ParseOffloadDevice(text));
  }
  if (request.contains("checkpointing")) {
    MEMPLAN_RETURN_IF_ERROR(Fields(request).String("checkpointing", &text));
    MEMPLAN_ASSIGN_OR_RETURN(options.only_checkpointing, estimator::ParseCheckpointing(text));
  }
  if (request.contains("sharding")) {
    MEMPLAN_RETURN_IF_ERROR(Fields(request).String("sharding", &text));
    if (text != "full" && text != "hybrid") {
      return Status::InvalidArgument("request: \"sharding\" must be \"full\" or \"hybrid\"");
    }
    options.only_sharding =
        text == "hybrid" ? planner::Sharding::kHybrid : planner::Sharding::kFull;
  }
  bool default_buffers = false;
  MEMPLAN_RETURN_IF_ERROR(Fields(request).Bool("default_buffers", &default_buffers));
  options.tune_buffers = !default_buffers;
  MEMPLAN_ASSIGN_OR_RETURN(planner::PlanResult result,
                           planner::SearchPlans(inventory, cluster, job, options));

  int64_t top = 5, index = 0;
  MEMPLAN_RETURN_IF_ERROR(Fields(request).Integer("top", &top));
  if (top < 1) return Status::InvalidArgument("request: \"top\" must be at least 1");
  MEMPLAN_RETURN_IF_ERROR(Fields(request).Integer("plan_index", &index));
  bool for_hf_trainer = false;
  MEMPLAN_RETURN_IF_ERROR(Fields(request).Bool("for_hf_trainer", &for_hf_trainer));
  json answer =
      planner::PlanReportJson(result, cluster, job, inventory, static_cast<size_t>(top),
                              index >= 0 ? static_cast<size_t>(index) : SIZE_MAX, for_hf_trainer);

  // Emitted configurations for one plan.
  if (!request.contains("emit")) return answer;
  const json& emit = request.at("emit");
  if (!emit.is_array()) {
    return Status::InvalidArgument(
        "request: \"emit\" must be a list of \"deepspeed\", \"accelerate\", \"fsdp\", "
        "\"schedule\", \"trainer\"");
  }
  if (result.plans.empty()) {
    return Status::InvalidArgument("no plan fits, so there is nothing to emit");
  }
  if (index < 0 || static_cast<size_t>(index) >= result.plans.size()) {
    return Status::InvalidArgument("request: \"plan_index\" " + std::to_string(index) + ": only " +
                                   std::to_string(result.plans.size()) + " plans fit");
  }
  const planner::Plan& plan = result.plans[static_cast<size_t>(index)];
  planner::EmitOptions emit_options;
  emit_options.for_hf_trainer = for_hf_trainer;
  MEMPLAN_RETURN_IF_ERROR(Fields(request).Number("lr", &emit_options.learning_rate));
  MEMPLAN_RETURN_IF_ERROR(
      Fields(request).String("accelerate_plugin", &emit_options.accelerate_plugin));
  // Each emitter that applies writes its document; one that does not (FSDP for an NVMe plan, a
  // Schedule for a plan that offloads nothing) says why under "not_emitted", as the CLI does.
  json emitted = json::object(), not_emitted = json::object();
  auto keep = [&](const std::string& kind, Result<json> document) {
    if (document.ok()) {
      emitted[kind] = *document;
    } else {
      not_emitted[kind] = document.status().message();
    }
  };
  auto plain = [](Result<nlohmann::ordered_json> j) -> Result<json> {
    if (!j.ok()) return j.status();
    return json::parse(j->dump());
  };
  for (const json& what : emit) {
    const std::string kind = what.is_string() ? what.get<std::string>() : what.dump();
    if (kind == "deepspeed") {
      keep(kind, plain(planner::DeepSpeedConfig(plan, cluster, inventory, emit_options)));
    } else if (kind == "accelerate") {
      auto yaml = planner::AccelerateConfig(plan, cluster, inventory, emit_options);
      keep(kind, yaml.ok() ? Result<json>(json(*yaml)) : Result<json>(yaml.status()));
    } else if (kind == "fsdp") {
      keep(kind, plain(planner::FsdpConfig(plan, cluster, inventory)));
    } else if (kind == "schedule") {
      // With the engine model's prediction for it (planner/engine_model.h), as the CLI's JSON.
      auto schedule = planner::EngineScheduleFor(plan, cluster, inventory);
      if (schedule.ok()) {
        answer["schedule_prediction"] = json::parse(planner::ToJson(schedule->prediction).dump());
        keep(kind, plain(std::move(schedule->json)));
      } else {
        keep(kind, schedule.status());
      }
    } else if (kind == "trainer") {
      keep(kind, plain(planner::TrainerArguments(plan, cluster, inventory, emit_options)));
    } else {
      return Status::InvalidArgument("request: \"emit\": unknown kind " + kind +
                                     " (deepspeed, accelerate, fsdp, schedule, trainer)");
    }
  }
  if (!not_emitted.empty()) answer["not_emitted"] = not_emitted;
  answer["emitted"] = emitted;
  answer["emitted_plan_index"] = index;
  return answer;
}

}  // namespace memplan::integration
