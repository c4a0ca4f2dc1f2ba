// `memplan check ds_config.json` (or an Accelerate config file): the mistakes in an existing
// DeepSpeed or Accelerate config, each on a line with its key path; with --model and --gpu, the
// predicted fit.
#include <filesystem>
#include <memory>
#include <string>

#include "common/checked_math.h"
#include "common/file.h"
#include "common/json.h"
#include "estimator/model_source.h"
#include "planner/accelerate_check.h"
#include "planner/check.h"
#include "planner/cluster.h"
#include "tools/commands.h"
#include "tools/setup_flags.h"
#include "tools/yaml_json.h"

namespace memplan::tools {

// tools/plan_command.cc.
Result<planner::Cluster> BuildClusterForCheck(const std::string& gpu, int64_t gpus, int64_t nodes,
                                              const std::string& cpu_mem,
                                              const std::string& memlock,
                                              const std::string& cluster_file);

namespace {

struct CheckFlags {
  std::string config;
  ModelFlags model;
  std::string gpu;
  std::string cluster_file;
  int64_t gpus = 0;
  int64_t nodes = 0;
  std::string cpu_mem;
  std::string memlock;
  bool for_hf_trainer = false;
  int64_t seq_len = 0;
  int64_t micro_batch = 0;  // 0: the config's (an "auto" one cannot be predicted without it)
  int64_t grad_accum = 0;
  std::string precision;    // empty: the config's
  SharedSetupFlags shared;  // --flash-attention/--no-flash-attention, --foreach, ...
  std::string format = "text";
};

// The config as JSON, and whether it is an Accelerate config. A DeepSpeed config is JSON;
// an Accelerate config is YAML (or JSON, which Accelerate also reads). A file that is neither JSON
// nor an Accelerate config in YAML is reported with its JSON error.
Result<nlohmann::json> ReadConfig(const std::string& path, bool* accelerate) {
  auto text = ReadFileToString(path, uint64_t{1} << 24);
  if (!text.ok()) return text.status();
  // DeepSpeed refuses a config that repeats a key; so does check (bad input, exit 2).
  auto config = ParseJson(*text, path);
  if (config.ok()) {
    *accelerate = planner::IsAccelerateConfig(*config);
    return config;
  }
  // Not JSON: a DeepSpeed config it is not, whatever it holds; a YAML mapping is taken as an
  // Accelerate config (whose checker says what it lacks).
  auto yaml = ParseYamlAsJson(*text, path);
  if (yaml.ok() && yaml->is_object()) {
    *accelerate = true;
    return yaml;
  }
  // A YAML error is the one to show when the file was meant as YAML.
  const std::string extension = std::filesystem::path(path).extension().string();
  if (!yaml.ok() && (extension == ".yaml" || extension == ".yml")) return yaml.status();
  return config.status();
}

// The DeepSpeed config an Accelerate config names (deepspeed_config_file), checked as one the
// Accelerator fills (its "auto" values, as the Trainer's), its findings named under that key.
void CheckNamedDeepSpeedConfig(const nlohmann::json& accelerate, planner::CheckOptions options,
                               planner::CheckReport* report) {
  const nlohmann::json& d = accelerate["deepspeed_config"];
  const std::string file = d["deepspeed_config_file"].get<std::string>();
  const std::string key = "deepspeed_config.deepspeed_config_file";
  std::error_code error;
  if (!std::filesystem::exists(file, error)) {
    if (std::filesystem::path(file).is_absolute()) {
      report->problems.push_back({key,
                                  "is " + file +
                                      ", which does not exist (Accelerate stops: "
                                      "\"Expected a string path to an existing deepspeed config\")",
                                  {}});
    } else {
      report->notes.push_back(key + " " + file +
                              " was not found from here (Accelerate reads it from the directory "
                              "the job starts in): not checked");
      // A fit asked for (--model with --gpu) and not predicted is never "OK".
      if (options.model != nullptr && options.cluster) {
        report->fit_error = "memory not predicted: the DeepSpeed config " + file +
                            " was not found from here; run check where the job starts";
      }
    }
    return;
  }
  bool nested_accelerate = false;  // read as JSON; a DeepSpeed config is never YAML
  auto config = ReadConfig(file, &nested_accelerate);
  if (!config.ok()) {
    report->problems.push_back({key, config.status().message(), {}});
    return;
  }
  options.for_hf_trainer = true;
  options.filled_by_accelerate = true;
  auto named = planner::CheckDeepSpeedConfig(*config, options);
  if (!named.ok()) {
    report->problems.push_back({key, file + ": " + named.status().message(), {}});
    return;
  }
  if (!config->contains("zero_optimization")) {
    report->problems.push_back(
        {key,
         file + " has no zero_optimization: Accelerate refuses it (\"Please specify the ZeRO "
                "optimization config in the DeepSpeed config\")",
         {}});
  }
  auto under = [&](const std::string& path) { return file + ":" + path; };
  for (planner::Finding finding : named->problems) {
    finding.path = under(finding.path);
    for (std::string& k : finding.keys) k = under(k);
    report->problems.push_back(std::move(finding));
  }
  report->notes.push_back(file +
                          " checked as the DeepSpeed config Accelerate fills (\"auto\" "
                          "where the Accelerator or the Trainer fills it)");
  for (const std::string& note : named->notes) report->notes.push_back(file + ": " + note);
  report->setup_line = named->setup_line;
  report->predicted = named->predicted;
  report->fit_error = named->fit_error;
}

void RunCheck(const CheckFlags& f, Outcome* outcome) {
  auto fail = [&](const Status& s) { Fail(outcome, s); };
  bool accelerate = false;
  auto config = ReadConfig(f.config, &accelerate);
  if (!config.ok()) return fail(config.status());
  planner::CheckOptions options;
  options.for_hf_trainer = f.for_hf_trainer;
  options.seq_len = f.seq_len;
  f.shared.Apply(&options.setup, /*only_given=*/false);
  // The Trainer's values for the config's "auto" (issue 31: the note named a flag check lacked).
  if (f.micro_batch > 0) {
    options.setup.micro_batch = f.micro_batch;
    options.supplied.insert("micro_batch");
  }
  if (f.grad_accum > 0) {
    options.setup.grad_accum = f.grad_accum;
    options.supplied.insert("grad_accum");
  }
  if (!f.precision.empty()) {
    auto precision = estimator::ParsePrecision(f.precision);
    if (!precision.ok()) return fail(precision.status());
    options.setup.precision = *precision;
    options.supplied.insert("precision");
  }
  options.flash_attention = options.setup.flash_attention;
  const int64_t gpus = f.gpus > 0 ? f.gpus : 1;
  const int64_t nodes = f.nodes > 0 ? f.nodes : 1;
  if (f.gpus > 0 || f.nodes > 0) options.world_size = CheckedMulInt64(gpus, nodes).value_or(0);
  Result<estimator::ModelInventory> inventory = Status::NotFound("no model");
  if (!f.gpu.empty() || !f.cluster_file.empty()) {
    auto cluster =
        BuildClusterForCheck(f.gpu, f.gpus, f.nodes, f.cpu_mem, f.memlock, f.cluster_file);
    if (!cluster.ok()) return fail(cluster.status());
    options.cluster = *cluster;
    options.world_size = cluster->WorldSize();
  } else if (!f.cpu_mem.empty() || !f.memlock.empty()) {
    return fail(Status::InvalidArgument("--cpu-mem and --memlock need --gpu (or --cluster)"));
  }
  if (!f.model.spec.empty()) {
    if (!options.cluster) {
      return fail(Status::InvalidArgument("--model needs --gpu (or --cluster) to predict the fit"));
    }
    inventory = f.model.LoadArchitecture("predicting the fit");
    if (!inventory.ok()) return fail(inventory.status());
    options.model = &*inventory;
  }
  auto report = accelerate ? planner::CheckAccelerateConfig(*config, options)
                           : planner::CheckDeepSpeedConfig(*config, options);
  if (!report.ok()) return fail(report.status().WithPrefix(f.config));
  if (accelerate && (*config)["distributed_type"] == "DEEPSPEED" &&
      (*config).contains("deepspeed_config") && (*config)["deepspeed_config"].is_object() &&
      (*config)["deepspeed_config"].contains("deepspeed_config_file") &&
      (*config)["deepspeed_config"]["deepspeed_config_file"].is_string() &&
      !(*config)["deepspeed_config"]["deepspeed_config_file"].get<std::string>().empty()) {
    CheckNamedDeepSpeedConfig(*config, options, &*report);
  }
  if (options.cluster && !f.gpu.empty()) {
    const std::string alias = planner::GpuAliasNote(f.gpu);
    if (!alias.empty()) report->notes.insert(report->notes.begin(), alias);
  }
  outcome->stdout_text = f.format == "json"
                             ? JsonOutput(planner::ToJson(*report))
                             : FieldsToFlags(planner::FormatCheckText(*report, f.config));
  outcome->exit_code = report->problems.empty() ? kExitOk : kExitInternal;
  if (report->problems.empty() && !report->fit_error.empty()) {
    // The fit was asked for (--model with --gpu) and could not be predicted: the report says what
    // was checked, then the error, exit 2; never "OK" for a fit no one computed.
    const std::string report_text = outcome->stdout_text;
    Fail(outcome, Status::InvalidArgument("--model " + f.model.spec + ": " + report->fit_error));
    outcome->stdout_text = report_text;
    outcome->report_with_error = true;
  }
}

}  // namespace

void RegisterCheck(CLI::App& app, Outcome* outcome) {
  auto f = std::make_shared<CheckFlags>();
  CLI::App* cmd = app.add_subcommand(
      "check",
      "Find the mistakes in a DeepSpeed config: batch arithmetic, unknown, misspelled, misplaced, "
      "renamed and removed keys, offload without its ZeRO stage, NVMe without nvme_path, \"auto\" "
      "outside "
      "the Hugging Face Trainer, values DeepSpeed refuses or breaks on at start-up (buckets, aio, "
      "swap buffers), bf16 on a GPU without it, pinned memory, and (with --model and --gpu) the "
      "predicted fit with the keys that fill it. An Accelerate config file (YAML or JSON, with "
      "distributed_type) is checked as Accelerate reads it: unknown keys, enums, process counts, "
      "FSDP1/FSDP2 settings Accelerate ignores or refuses, the layer class to wrap against the "
      "model, the DeepSpeed config it names, and the fit (with --micro-batch)");
  cmd->add_option("config", f->config,
                  "The ds_config.json, or the Accelerate config file (accelerate launch "
                  "--config_file), to check")
      ->required();
  f->model.Add(cmd, "Model (as in `memplan estimate`) to predict the fit", false);
  cmd->add_option("--gpu", f->gpu,
                  "GPU preset (a100-80, h100-80, ...), or its name as nvidia-smi prints it");
  cmd->add_option("--cluster", f->cluster_file, "A cluster JSON file");
  cmd->add_option("-g,--gpus", f->gpus, "GPUs per node (for the batch arithmetic)")
      ->check(CLI::Range(int64_t{1}, int64_t{1024}));
  cmd->add_option("-n,--nodes", f->nodes, "Number of nodes")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  cmd->add_option("--cpu-mem", f->cpu_mem, "Host RAM per node (pinned and CPU memory checks)");
  cmd->add_option("--memlock", f->memlock, "RLIMIT_MEMLOCK per process (bytes or unlimited)");
  cmd->add_flag("--for-hf-trainer", f->for_hf_trainer,
                "The config is for the Hugging Face Trainer (\"auto\" allowed where it fills)");
  cmd->add_option("--seq-len", f->seq_len,
                  "Tokens per sequence for the fit (default: min(positions, 2048))")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 24));
  cmd->add_option("--micro-batch", f->micro_batch,
                  "Sequences per GPU per forward pass for the fit, in place of the config's "
                  "(needed when it is \"auto\": the Trainer's per_device_train_batch_size)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  cmd->add_option("--precision", f->precision,
                  "Precision for the fit, in place of the config's (needed when bf16 or fp16 "
                  "\"enabled\" is \"auto\"): bf16-mixed, fp16-mixed, fp32, ...");
  cmd->add_option("--grad-accum", f->grad_accum,
                  "Gradient accumulation steps for the fit, in place of the config's (needed "
                  "when it is \"auto\")")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  f->shared.Add(cmd, "Fit prediction");
  AddFormatOption(cmd, &f->format, "text or json");
  cmd->footer(
      "\nExamples:\n"
      "  memplan check ds_config.json --gpus 8\n"
      "  memplan check ds_config.json --model llama-2-7b --gpu a100-80 --gpus 8 --cpu-mem 1TiB\n"
      "  memplan check fsdp.yaml --model llama-2-7b --gpu h100-80 --gpus 8 --micro-batch 2\n"
      "\nExit status: 0 no problems, 1 problems found (one line each, with the key path), 2 bad "
      "input (unreadable file, invalid JSON or YAML, bad flags), or --model and --gpu given and "
      "the fit "
      "could not be predicted (the report, then why).");
  cmd->callback([f, outcome] { RunCheck(*f, outcome); });
}

}  // namespace memplan::tools
