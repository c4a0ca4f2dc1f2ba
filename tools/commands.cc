#include "tools/commands.h"

#include <memory>

#include "common/file.h"
#include "estimator/builtin_models.h"
#include "estimator/estimate.h"
#include "estimator/hf_config.h"
#include "estimator/model_source.h"

namespace memplan::tools {
namespace {

using estimator::ModelClassChoice;

int ExitCodeFor(const Status& status) {
  return status.code() == StatusCode::kInternal ? kExitInternal : kExitBadInput;
}

void Fail(Outcome* outcome, const Status& status) {
  outcome->exit_code = ExitCodeFor(status);
  outcome->error = status.message();
}

// Options shared by the subcommands that read a model.
struct ModelOptions {
  std::string model;
  std::string model_class = "auto";
  std::string format = "text";
  std::string output;  // empty: stdout

  void Add(CLI::App* cmd) {
    cmd->add_option("-m,--model", model,
                    "A built-in model name (see `memplan models`), a config.json, a tensor-shape "
                    "list (.json), a .safetensors file, a model.safetensors.index.json, a "
                    "directory holding one of these, or a Hugging Face repo id (org/name) found "
                    "in the local hub cache (never downloaded)")
        ->required();
    cmd->add_option("--model-class", model_class,
                    "auto: the class in config.json's `architectures` (task head included, tied "
                    "head counted once); base: what AutoModel builds, no task head (as in "
                    "DeepSpeed's and Accelerate's examples)")
        ->check(CLI::IsMember({"auto", "base"}))
        ->capture_default_str();
    cmd->add_option("--format", format, "Output format: text (for people) or json (for scripts)")
        ->check(CLI::IsMember({"text", "json"}))
        ->capture_default_str();
    cmd->add_option("-o,--output", output,
                    "Write the output to this file (atomically: temp file + rename) instead of "
                    "stdout");
  }

  ModelClassChoice Choice() const {
    return model_class == "base" ? ModelClassChoice::kBase : ModelClassChoice::kFromArchitectures;
  }
};

// Sends `text` to stdout or to the --output file.
void Emit(const ModelOptions& options, std::string text, Outcome* outcome) {
  if (options.output.empty()) {
    outcome->stdout_text = std::move(text);
    return;
  }
  Status status = WriteFileAtomically(options.output, text);
  if (!status.ok()) Fail(outcome, status);
}

}  // namespace

void RegisterEstimate(CLI::App& app, Outcome* outcome) {
  auto options = std::make_shared<ModelOptions>();
  auto hardware = std::make_shared<estimator::DeepSpeedHardware>();
  CLI::App* cmd = app.add_subcommand(
      "estimate",
      "Memory needed to train a model: DeepSpeed's ZeRO-2 and ZeRO-3 model-state tables, "
      "reproduced to the byte, from a config.json alone");
  options->Add(cmd);
  cmd->add_option("-g,--gpus", hardware->gpus_per_node, "GPUs per node")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20))
      ->capture_default_str();
  cmd->add_option("-n,--nodes", hardware->nodes, "Number of nodes")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20))
      ->capture_default_str();
  cmd->add_option("--buffer-factor", hardware->buffer_factor,
                  "DeepSpeed's additional_buffer_factor (multiplies CPU memory)")
      ->check(CLI::Range(0.0, 1000.0))
      ->capture_default_str();
  cmd->footer(
      "\nExamples:\n"
      "  memplan estimate --model llama-2-7b --gpus 4\n"
      "  memplan estimate --model ./config.json --gpus 8 --nodes 2 --format json\n"
      "  memplan estimate --model t5-large --model-class base --gpus 4\n"
      "\nExit status: 0 on success, 2 on bad input (one line on stderr naming the file and "
      "field).");
  cmd->callback([options, hardware, outcome] {
    auto inventory = estimator::LoadModel(options->model, options->Choice());
    if (!inventory.ok()) return Fail(outcome, inventory.status());
    auto estimate = estimator::EstimateModelStates(*inventory, *hardware);
    if (!estimate.ok()) return Fail(outcome, estimate.status());
    Emit(*options,
         options->format == "json" ? estimator::ToJson(*estimate).dump(2) + "\n"
                                   : estimator::FormatEstimateText(*estimate),
         outcome);
  });
}

void RegisterInventory(CLI::App& app, Outcome* outcome) {
  auto options = std::make_shared<ModelOptions>();
  CLI::App* cmd = app.add_subcommand(
      "inventory",
      "Every parameter tensor of a model: name, shape, dtype, module, block, tied-to");
  options->Add(cmd);
  cmd->callback([options, outcome] {
    auto inventory = estimator::LoadModel(options->model, options->Choice());
    if (!inventory.ok()) return Fail(outcome, inventory.status());
    auto counts = estimator::CountParams(*inventory);
    if (!counts.ok()) return Fail(outcome, counts.status());
    Emit(*options,
         options->format == "json" ? estimator::InventoryToJson(*inventory, *counts).dump(2) + "\n"
                                   : estimator::FormatInventoryText(*inventory, *counts),
         outcome);
  });
}

void RegisterModels(CLI::App& app, Outcome* outcome) {
  auto format = std::make_shared<std::string>("text");
  CLI::App* cmd = app.add_subcommand("models", "List the built-in models usable as --model NAME");
  cmd->add_option("--format", *format, "Output format: text or json")
      ->check(CLI::IsMember({"text", "json"}))
      ->capture_default_str();
  cmd->callback([format, outcome] {
    nlohmann::json list = nlohmann::json::array();
    std::string text = "Built-in models (use as --model NAME):\n";
    for (const auto& model : estimator::BuiltinModels()) {
      auto inventory = estimator::InventoryFromHfConfigText(
          model.config_json, std::string(model.name), ModelClassChoice::kFromArchitectures);
      if (!inventory.ok()) return Fail(outcome, inventory.status());
      auto counts = estimator::CountParams(*inventory);
      if (!counts.ok()) return Fail(outcome, counts.status());
      list.push_back({{"name", model.name},
                      {"hub_id", model.hub_id},
                      {"model_type", inventory->model_type},
                      {"architecture", inventory->architecture},
                      {"params_total", counts->params_total}});
      char line[256];
      std::snprintf(line, sizeof(line), "  %-18s %-10s %-32s %16s params  %s\n",
                    std::string(model.name).c_str(), inventory->model_type.c_str(),
                    inventory->architecture.c_str(),
                    estimator::WithThousands(counts->params_total).c_str(),
                    std::string(model.hub_id).c_str());
      text += line;
    }
    outcome->stdout_text = *format == "json" ? list.dump(2) + "\n" : text;
  });
}

void RegisterBench(CLI::App& app, Outcome* outcome) {
  CLI::App* bench = app.add_subcommand(
      "bench",
      "Measure this machine: NVMe bandwidth, CPU optimizer (AdamW) throughput, the NVMe "
      "optimizer step");
  bench->require_subcommand(1);
  RegisterBenchNvme(bench, outcome);
  RegisterBenchAdam(bench, outcome);
  RegisterBenchSwap(bench, outcome);
}

}  // namespace memplan::tools
