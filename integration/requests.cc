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
#include "planner/capacity.h"
#include "planner/cluster.h"
#include "planner/emit.h"
#include "planner/job.h"
#include "planner/plan_request.h"
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

namespace {

// What a plan request asks of the answer: how many plans, and which configurations of which plan.
struct PlanOutput {
  int64_t top = 5, index = 0;
  bool for_hf_trainer = false;
  planner::EmitOptions emit;
  const json* kinds = nullptr;  // "emit", when given
};

Result<PlanOutput> ReadPlanOutput(const json& request) {
  PlanOutput out;
  MEMPLAN_RETURN_IF_ERROR(Fields(request).Integer("top", &out.top));
  if (out.top < 1) return Status::InvalidArgument("request: \"top\" must be at least 1");
  MEMPLAN_RETURN_IF_ERROR(Fields(request).Integer("plan_index", &out.index));
  MEMPLAN_RETURN_IF_ERROR(Fields(request).Bool("for_hf_trainer", &out.for_hf_trainer));
  out.emit.for_hf_trainer = out.for_hf_trainer;
  MEMPLAN_RETURN_IF_ERROR(Fields(request).Number("lr", &out.emit.learning_rate));
  MEMPLAN_RETURN_IF_ERROR(Fields(request).String("accelerate_plugin", &out.emit.accelerate_plugin));
  if (request.contains("emit")) {
    out.kinds = &request.at("emit");
    if (!out.kinds->is_array()) {
      return Status::InvalidArgument(
          "request: \"emit\" must be a list of \"deepspeed\", \"accelerate\", \"fsdp\", "
          "\"schedule\", \"trainer\"");
    }
  }
  return out;
}

// The configurations "emit" names for plans[index], under "emitted" (and "not_emitted": why an
// emitter that does not apply wrote nothing, as the CLI says), added to `*answer`.
Status EmitConfigs(const PlanOutput& out, const planner::PlanResult& result,
                   const planner::Cluster& cluster, const estimator::ModelInventory& inventory,
                   json* answer) {
  if (result.plans.empty()) {
    return Status::InvalidArgument("no plan fits, so there is nothing to emit");
  }
  if (out.index < 0 || static_cast<size_t>(out.index) >= result.plans.size()) {
    return Status::InvalidArgument("request: \"plan_index\" " + std::to_string(out.index) +
                                   ": only " + std::to_string(result.plans.size()) + " plans fit");
  }
  const planner::Plan& plan = result.plans[static_cast<size_t>(out.index)];
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
  for (const json& what : *out.kinds) {
    const std::string kind = what.is_string() ? what.get<std::string>() : what.dump();
    if (kind == "deepspeed") {
      keep(kind, plain(planner::DeepSpeedConfig(plan, cluster, inventory, out.emit)));
    } else if (kind == "accelerate") {
      auto yaml = planner::AccelerateConfig(plan, cluster, inventory, out.emit);
      keep(kind, yaml.ok() ? Result<json>(json(*yaml)) : Result<json>(yaml.status()));
    } else if (kind == "fsdp") {
      keep(kind, plain(planner::FsdpConfig(plan, cluster, inventory)));
    } else if (kind == "schedule") {
      // With the engine model's prediction for it (planner/engine_model.h), as the CLI's JSON.
      auto schedule = planner::EngineScheduleFor(plan, cluster, inventory);
      if (schedule.ok()) {
        (*answer)["schedule_prediction"] =
            json::parse(planner::ToJson(schedule->prediction).dump());
        keep(kind, plain(std::move(schedule->json)));
      } else {
        keep(kind, schedule.status());
      }
    } else if (kind == "trainer") {
      keep(kind, plain(planner::TrainerArguments(plan, cluster, inventory, out.emit)));
    } else {
      return Status::InvalidArgument("request: \"emit\": unknown kind " + kind +
                                     " (deepspeed, accelerate, fsdp, schedule, trainer)");
    }
  }
  if (!not_emitted.empty()) (*answer)["not_emitted"] = not_emitted;
  (*answer)["emitted"] = emitted;
  (*answer)["emitted_plan_index"] = out.index;
  return Status::Ok();
}

}  // namespace

// Parse (planner::PlanRequestFromJson), resolve (planner::Resolve: every default, Note [Plan
// defaults]), search, emit.
Result<nlohmann::json> Plan(const nlohmann::json& request) {
  std::vector<std::string> deprecations;
  MEMPLAN_ASSIGN_OR_RETURN(
      planner::PlanRequest plan_request,
      planner::PlanRequestFromJson(request,
                                   {"model", "config", "name", "model_class", "top", "emit",
                                    "plan_index", "for_hf_trainer", "lr", "accelerate_plugin"},
                                   &deprecations));
  MEMPLAN_ASSIGN_OR_RETURN(estimator::ModelInventory inventory,
                           RequestModel(request, /*allow_shapes=*/false, &plan_request.model));
  if (!inventory.arch) {
    return Status::InvalidArgument(plan_request.model +
                                   ": planning needs the architecture (a config.json or "
                                   "built-in model)");
  }
  if (!plan_request.HasGpu()) {
    return Status::InvalidArgument("request: give \"gpu\" (a preset) or \"cluster\"");
  }
  MEMPLAN_ASSIGN_OR_RETURN(PlanOutput out, ReadPlanOutput(request));
  MEMPLAN_ASSIGN_OR_RETURN(planner::ResolvedPlan resolved,
                           planner::Resolve(plan_request, *inventory.arch));
  MEMPLAN_ASSIGN_OR_RETURN(
      planner::PlanResult result,
      planner::SearchPlans(inventory, resolved.cluster, resolved.job, resolved.options));
  for (std::string& note : resolved.notes) result.assumptions.push_back(std::move(note));
  json answer = planner::PlanReportJson(
      result, resolved.cluster, resolved.job, inventory, static_cast<size_t>(out.top),
      out.index >= 0 ? static_cast<size_t>(out.index) : SIZE_MAX, out.for_hf_trainer);
  if (!deprecations.empty()) answer["deprecations"] = deprecations;
  if (out.kinds == nullptr) return answer;
  MEMPLAN_RETURN_IF_ERROR(EmitConfigs(out, result, resolved.cluster, inventory, &answer));
  return answer;
}

namespace {

// "gpu": a list of GPU type names, or one comma-separated string as the CLI's --gpu.
Result<std::vector<std::string>> GpuNames(const json& request) {
  std::vector<std::string> names;
  if (!request.contains("gpu")) return names;
  const json& gpu = request.at("gpu");
  if (gpu.is_string()) {
    const std::string text = gpu.get<std::string>();
    size_t start = 0;
    while (start <= text.size()) {
      size_t comma = text.find(',', start);
      if (comma == std::string::npos) comma = text.size();
      names.push_back(text.substr(start, comma - start));
      start = comma + 1;
    }
    return names;
  }
  MEMPLAN_RETURN_IF_ERROR(Fields(request).Strings("gpu", &names));
  return names;
}

// "price": one number (every type), or {"a100-80": 1.8, ...}; as --price's "TYPE=PRICE" texts.
Result<std::vector<std::string>> Prices(const json& request) {
  std::vector<std::string> prices;
  if (!request.contains("price")) return prices;
  const json& price = request.at("price");
  auto text = [](const json& v) -> Result<std::string> {
    if (!v.is_number()) {
      return Status::InvalidArgument(
          "request: \"price\" must be a number per GPU-hour or an "
          "object of them by GPU type, got " +
          std::string(v.type_name()));
    }
    return v.dump();
  };
  if (price.is_object()) {
    for (const auto& [type, value] : price.items()) {
      MEMPLAN_ASSIGN_OR_RETURN(std::string p, text(value));
      prices.push_back(type + "=" + p);
    }
  } else {
    MEMPLAN_ASSIGN_OR_RETURN(std::string p, text(price));
    prices.push_back(p);
  }
  return prices;
}

// A count ("1T", "300B", "4M") or a number, as the CLI's text.
std::string CountText(const json& v) { return v.is_string() ? v.get<std::string>() : v.dump(); }

}  // namespace

// As `memplan capacity --format json`: parse (the node, job and setup keys through planner's plan
// request reader), resolve the job once (each GPU type's precision in PlanCapacity), search.
Result<nlohmann::json> Capacity(const nlohmann::json& request) {
  std::vector<std::string> deprecations;
  MEMPLAN_ASSIGN_OR_RETURN(planner::PlanRequest plan,
                           planner::CapacityJobFromJson(
                               request,
                               {"model", "config", "name", "model_class", "gpu", "cluster", "gpus",
                                "gpus_per_node", "price", "tokens", "max_days", "threads"},
                               &deprecations));
  if (!request.contains("tokens")) {
    return Status::InvalidArgument("request: \"tokens\" is required: the training budget");
  }
  MEMPLAN_RETURN_IF_ERROR(planner::CheckBatch(plan));
  planner::CapacityRequest capacity;
  std::vector<planner::GpuOffer> listed;
  if (request.contains("cluster")) {
    MEMPLAN_ASSIGN_OR_RETURN(
        listed, planner::OffersFromJson(request.at("cluster"), "request.cluster", &capacity.node));
  }
  MEMPLAN_ASSIGN_OR_RETURN(std::vector<std::string> names, GpuNames(request));
  if (names.empty() && listed.empty()) {
    return Status::InvalidArgument(
        "request: give \"gpu\" (GPU types) or \"cluster\" (with a 'gpus' list)");
  }
  int64_t gpus_per_node = 0;  // 0: each offer's own (8, or the cluster document's)
  MEMPLAN_RETURN_IF_ERROR(
      Fields(request).Integer("gpus_per_node", &gpus_per_node, int64_t{1}, int64_t{1024}));
  MEMPLAN_ASSIGN_OR_RETURN(std::vector<std::string> prices, Prices(request));
  MEMPLAN_ASSIGN_OR_RETURN(capacity.offers,
                           planner::ChooseOffers(std::move(listed), names, gpus_per_node, prices));
  std::string counts = "1-64";  // as --gpus: "8-512", "8,16,64", or a list of counts
  if (request.contains("gpus")) {
    const json& g = request.at("gpus");
    if (g.is_array()) {
      counts.clear();
      for (const json& c : g) counts += (counts.empty() ? "" : ",") + CountText(c);
    } else {
      counts = CountText(g);
    }
  }
  MEMPLAN_ASSIGN_OR_RETURN(capacity.gpu_counts,
                           planner::ParseGpuCounts(counts, "request: \"gpus\""));
  MEMPLAN_ASSIGN_OR_RETURN(
      capacity.tokens,
      planner::ParseTokenCount(CountText(request.at("tokens")), "request: \"tokens\""));
  double max_days = 0;  // as --max-days: none, or in [0.001, 1e7]
  MEMPLAN_RETURN_IF_ERROR(Fields(request).Number("max_days", &max_days));
  if (request.contains("max_days") && !(max_days >= 0.001 && max_days <= 1e7)) {
    return Status::InvalidArgument("request: \"max_days\" must be in [0.001, 1e7] days");
  }
  capacity.max_train_hours = max_days * 24;
  int64_t threads = 0;  // as --threads: 0 (the cores, at most 8) or 1-256
  MEMPLAN_RETURN_IF_ERROR(Fields(request).Integer("threads", &threads, int64_t{0}, int64_t{256}));
  capacity.threads = static_cast<int>(threads);
  plan.node.ApplyTo(&capacity.node);
  MEMPLAN_ASSIGN_OR_RETURN(estimator::ModelInventory inventory,
                           RequestModel(request, /*allow_shapes=*/false, &plan.model));
  if (!inventory.arch) {
    return Status::InvalidArgument(plan.model + ": capacity planning needs the architecture");
  }
  MEMPLAN_ASSIGN_OR_RETURN(planner::Job job,
                           planner::ResolveJob(plan, /*gpu=*/nullptr, *inventory.arch));
  capacity.fp16_fallback = !plan.precision.has_value();
  capacity.search = planner::ResolveSearch(plan);
  MEMPLAN_ASSIGN_OR_RETURN(planner::CapacityResult result,
                           planner::PlanCapacity(inventory, job, capacity));
  json answer = planner::ToJson(result, capacity, job);
  if (!deprecations.empty()) answer["deprecations"] = deprecations;
  return answer;
}

}  // namespace memplan::integration
