#include "integration/requests.h"

#include <set>
#include <string>
#include <vector>

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

Status CheckKeys(const json& request, const std::set<std::string>& allowed, const char* what) {
  if (!request.is_object()) {
    return Status::InvalidArgument(std::string(what) + " request: expected a JSON object");
  }
  for (const auto& [key, value] : request.items()) {
    if (!allowed.contains(key)) {
      return Status::InvalidArgument(std::string(what) + " request: unknown key \"" + key + "\"");
    }
  }
  return Status::Ok();
}

// Typed getters: absent keys keep `*out`; a present key of the wrong type is an error naming it.
Status GetInt(const json& j, const char* key, int64_t* out) {
  if (!j.contains(key)) return Status::Ok();
  const json& v = j.at(key);
  if (!v.is_number_integer()) {
    return Status::InvalidArgument(std::string("request: \"") + key + "\" must be an integer");
  }
  *out = v.get<int64_t>();
  return Status::Ok();
}
Status GetDouble(const json& j, const char* key, double* out) {
  if (!j.contains(key)) return Status::Ok();
  const json& v = j.at(key);
  if (!v.is_number()) {
    return Status::InvalidArgument(std::string("request: \"") + key + "\" must be a number");
  }
  *out = v.get<double>();
  return Status::Ok();
}
Status GetBool(const json& j, const char* key, bool* out) {
  if (!j.contains(key)) return Status::Ok();
  const json& v = j.at(key);
  if (!v.is_boolean()) {
    return Status::InvalidArgument(std::string("request: \"") + key + "\" must be true or false");
  }
  *out = v.get<bool>();
  return Status::Ok();
}
Status GetString(const json& j, const char* key, std::string* out) {
  if (!j.contains(key)) return Status::Ok();
  const json& v = j.at(key);
  if (!v.is_string()) {
    return Status::InvalidArgument(std::string("request: \"") + key + "\" must be a string");
  }
  *out = v.get<std::string>();
  return Status::Ok();
}
// A byte size: a non-negative integer or a string such as "80GiB".
Status GetBytes(const json& j, const char* key, uint64_t* out) {
  if (!j.contains(key)) return Status::Ok();
  const json& v = j.at(key);
  if (v.is_number_unsigned()) {
    *out = v.get<uint64_t>();
    return Status::Ok();
  }
  if (v.is_string()) {
    MEMPLAN_ASSIGN_OR_RETURN(*out, planner::ParseByteSize(v.get<std::string>(), key));
    return Status::Ok();
  }
  return Status::InvalidArgument(std::string("request: \"") + key +
                                 "\" must be a byte count or a size such as \"80GiB\"");
}

Result<estimator::ModelClassChoice> ModelClass(const json& request) {
  std::string text = "auto";
  MEMPLAN_RETURN_IF_ERROR(GetString(request, "model_class", &text));
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
  const char* keys = allow_shapes ? "\"model\", \"config\" and \"shapes\"" : "\"model\" and \"config\"";
  if (given != 1) {
    return Status::InvalidArgument(std::string("request: give exactly one of ") + keys);
  }
  MEMPLAN_ASSIGN_OR_RETURN(estimator::ModelClassChoice choice, ModelClass(request));
  std::string name = "request";
  MEMPLAN_RETURN_IF_ERROR(GetString(request, "name", &name));
  if (request.contains("model")) {
    MEMPLAN_RETURN_IF_ERROR(GetString(request, "model", label));
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
    MEMPLAN_ASSIGN_OR_RETURN(inventory, estimator::InventoryFromShapeListText(
                                            request.at("shapes").dump(), name));
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
  MEMPLAN_RETURN_IF_ERROR(GetInt(request, "gpus", &hardware.gpus_per_node));
  MEMPLAN_RETURN_IF_ERROR(GetInt(request, "nodes", &hardware.nodes));
  MEMPLAN_RETURN_IF_ERROR(GetDouble(request, "buffer_factor", &hardware.buffer_factor));
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
  MEMPLAN_RETURN_IF_ERROR(CheckKeys(
      request,
      {"model", "config", "name", "model_class", "cluster", "gpu", "gpus", "nodes", "cpu_mem",
       "cpu_cores", "pcie_gen", "memlock", "nvme_path", "nvme_capacity", "global_batch",
       "global_batch_tokens", "seq_len", "precision", "optimizer", "lora_rank", "lora_targets",
       "qlora", "flash_attention", "foreach", "fused_optimizer", "sgd_momentum",
       "sequence_parallel", "autocast", "gradient_as_bucket_view", "cuda_context_mib",
       "gpu_margin", "allow_nvme", "top", "emit",
       "plan_index", "for_hf_trainer", "lr", "accelerate_plugin"},
      "plan"));
  std::string label;
  MEMPLAN_ASSIGN_OR_RETURN(estimator::ModelInventory inventory,
                           RequestModel(request, /*allow_shapes=*/false, &label));
  if (!inventory.arch) {
    return Status::InvalidArgument(label + ": planning needs the architecture (a config.json or "
                                           "built-in model)");
  }

  // The cluster: "cluster" first, then the preset keys over it.
  planner::Cluster cluster;
  bool have_gpu = false;
  if (request.contains("cluster")) {
    MEMPLAN_ASSIGN_OR_RETURN(cluster, planner::ClusterFromJson(request.at("cluster"),
                                                               "request.cluster"));
    have_gpu = true;
  }
  std::string gpu;
  MEMPLAN_RETURN_IF_ERROR(GetString(request, "gpu", &gpu));
  if (!gpu.empty()) {
    MEMPLAN_ASSIGN_OR_RETURN(cluster.gpu, planner::FindGpuPreset(gpu));
    have_gpu = true;
  }
  if (!have_gpu) return Status::InvalidArgument("request: give \"gpu\" (a preset) or \"cluster\"");
  MEMPLAN_RETURN_IF_ERROR(GetInt(request, "gpus", &cluster.gpus_per_node));
  MEMPLAN_RETURN_IF_ERROR(GetInt(request, "nodes", &cluster.nodes));
  MEMPLAN_RETURN_IF_ERROR(GetBytes(request, "cpu_mem", &cluster.cpu_memory_bytes));
  MEMPLAN_RETURN_IF_ERROR(GetInt(request, "cpu_cores", &cluster.cpu_cores));
  int64_t pcie_gen = cluster.pcie_gen;
  MEMPLAN_RETURN_IF_ERROR(GetInt(request, "pcie_gen", &pcie_gen));
  cluster.pcie_gen = static_cast<int>(pcie_gen);
  if (request.contains("memlock") && request.at("memlock") == "unlimited") {
    cluster.memlock_bytes = 0;
  } else {
    MEMPLAN_RETURN_IF_ERROR(GetBytes(request, "memlock", &cluster.memlock_bytes));
  }
  MEMPLAN_RETURN_IF_ERROR(GetString(request, "nvme_path", &cluster.nvme_path));
  MEMPLAN_RETURN_IF_ERROR(GetBytes(request, "nvme_capacity", &cluster.nvme_capacity_bytes));
  MEMPLAN_RETURN_IF_ERROR(cluster.Validate());

  // The job.
  planner::Job job;
  job.model = label;
  estimator::TrainingSetup& s = job.setup;
  std::string precision = cluster.gpu.bf16_flops > 0 ? "bf16-mixed" : "fp16-mixed";
  MEMPLAN_RETURN_IF_ERROR(GetString(request, "precision", &precision));
  MEMPLAN_ASSIGN_OR_RETURN(s.precision, estimator::ParsePrecision(precision));
  std::string optimizer = "adamw";
  MEMPLAN_RETURN_IF_ERROR(GetString(request, "optimizer", &optimizer));
  MEMPLAN_ASSIGN_OR_RETURN(s.optimizer, estimator::ParseOptimizer(optimizer));
  MEMPLAN_RETURN_IF_ERROR(GetInt(request, "lora_rank", &s.lora_rank));
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
  MEMPLAN_RETURN_IF_ERROR(GetBool(request, "qlora", &s.qlora));
  // The same defaults as `memplan estimate` and `check` (TrainingSetup's own).
  MEMPLAN_RETURN_IF_ERROR(GetBool(request, "flash_attention", &s.flash_attention));
  MEMPLAN_RETURN_IF_ERROR(GetBool(request, "foreach", &s.foreach));
  MEMPLAN_RETURN_IF_ERROR(GetBool(request, "fused_optimizer", &s.fused_optimizer));
  MEMPLAN_RETURN_IF_ERROR(GetDouble(request, "sgd_momentum", &s.sgd_momentum));
  MEMPLAN_RETURN_IF_ERROR(GetBool(request, "sequence_parallel", &s.sequence_parallel));
  MEMPLAN_RETURN_IF_ERROR(GetBool(request, "autocast", &s.autocast));
  MEMPLAN_RETURN_IF_ERROR(
      GetBool(request, "gradient_as_bucket_view", &s.gradient_as_bucket_view));
  MEMPLAN_RETURN_IF_ERROR(GetInt(request, "seq_len", &s.seq_len));
  double cuda_context_mib = 1343;
  MEMPLAN_RETURN_IF_ERROR(GetDouble(request, "cuda_context_mib", &cuda_context_mib));
  if (!(cuda_context_mib >= 0 && cuda_context_mib <= 1048576)) {
    return Status::InvalidArgument("request: \"cuda_context_mib\" must be in [0, 1048576]");
  }
  s.cuda_context_bytes = static_cast<int64_t>(cuda_context_mib * 1048576.0);
  int64_t samples = 0, tokens = 0;
  MEMPLAN_RETURN_IF_ERROR(GetInt(request, "global_batch", &samples));
  MEMPLAN_RETURN_IF_ERROR(GetInt(request, "global_batch_tokens", &tokens));
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

  planner::SearchOptions options;
  MEMPLAN_RETURN_IF_ERROR(GetDouble(request, "gpu_margin", &options.gpu_safety_fraction));
  MEMPLAN_RETURN_IF_ERROR(GetBool(request, "allow_nvme", &options.allow_nvme));
  MEMPLAN_ASSIGN_OR_RETURN(planner::PlanResult result,
                           planner::SearchPlans(inventory, cluster, job, options));

  int64_t top = 5;
  MEMPLAN_RETURN_IF_ERROR(GetInt(request, "top", &top));
  if (top < 1) return Status::InvalidArgument("request: \"top\" must be at least 1");
  json answer = planner::ToJson(result, cluster, job);
  if (answer["plans"].size() > static_cast<size_t>(top)) {
    json kept = json::array();
    for (int64_t i = 0; i < top; ++i) kept.push_back(answer["plans"][i]);
    answer["plans"] = kept;
  }

  // Emitted configurations for one plan.
  if (!request.contains("emit")) return answer;
  const json& emit = request.at("emit");
  if (!emit.is_array()) {
    return Status::InvalidArgument(
        "request: \"emit\" must be a list of \"deepspeed\", \"accelerate\", \"fsdp\", \"schedule\"");
  }
  int64_t index = 0;
  MEMPLAN_RETURN_IF_ERROR(GetInt(request, "plan_index", &index));
  if (result.plans.empty()) {
    return Status::InvalidArgument("no plan fits, so there is nothing to emit");
  }
  if (index < 0 || static_cast<size_t>(index) >= result.plans.size()) {
    return Status::InvalidArgument("request: \"plan_index\" " + std::to_string(index) + ": only " +
                                   std::to_string(result.plans.size()) + " plans fit");
  }
  const planner::Plan& plan = result.plans[static_cast<size_t>(index)];
  planner::EmitOptions emit_options;
  MEMPLAN_RETURN_IF_ERROR(GetBool(request, "for_hf_trainer", &emit_options.for_hf_trainer));
  MEMPLAN_RETURN_IF_ERROR(GetDouble(request, "lr", &emit_options.learning_rate));
  MEMPLAN_RETURN_IF_ERROR(GetString(request, "accelerate_plugin", &emit_options.accelerate_plugin));
  json emitted = json::object();
  for (const json& what : emit) {
    const std::string kind = what.is_string() ? what.get<std::string>() : what.dump();
    if (kind == "deepspeed") {
      MEMPLAN_ASSIGN_OR_RETURN(auto ds,
                               planner::DeepSpeedConfig(plan, cluster, inventory, emit_options));
      emitted["deepspeed"] = json::parse(ds.dump());
    } else if (kind == "accelerate") {
      MEMPLAN_ASSIGN_OR_RETURN(emitted["accelerate"],
                               planner::AccelerateConfig(plan, cluster, inventory, emit_options));
    } else if (kind == "fsdp") {
      MEMPLAN_ASSIGN_OR_RETURN(auto fsdp, planner::FsdpConfig(plan, cluster, inventory));
      emitted["fsdp"] = json::parse(fsdp.dump());
    } else if (kind == "schedule") {
      MEMPLAN_ASSIGN_OR_RETURN(auto schedule, planner::Schedule(plan, cluster, inventory));
      emitted["schedule"] = json::parse(schedule.dump());
    } else {
      return Status::InvalidArgument("request: \"emit\": unknown kind " + kind +
                                     " (deepspeed, accelerate, fsdp, schedule)");
    }
  }
  answer["emitted"] = emitted;
  answer["emitted_plan_index"] = index;
  return answer;
}

}  // namespace memplan::integration
