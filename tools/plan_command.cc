// `memplan plan`: the fastest configuration that fits a cluster, explained, emitted as DeepSpeed /
// Accelerate / FSDP configs and an offload Schedule, and drawn as an SVG picture (--svg).
#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/file.h"
#include "common/byte_size.h"
#include "common/json.h"
#include "common/strings.h"
#include "estimator/model_source.h"
#include "estimator/training_setup.h"
#include "planner/cluster.h"
#include "planner/emit.h"
#include "planner/job.h"
#include "planner/launch.h"
#include "planner/plan_request.h"
#include "planner/search.h"
#include "planner/svg.h"
#include "tools/calibration_flags.h"
#include "tools/commands.h"
#include "tools/setup_flags.h"

namespace memplan::tools {
namespace {

// The cluster flags shared by `plan` and `check`.
struct ClusterFlags {
  std::string cluster_file;
  bool detect = false;
  std::string gpu;
  int64_t gpus = 0;   // 0: 1, or what --detect / --cluster says
  int64_t nodes = 0;  // 0: 1
  std::string cpu_mem;
  int64_t cpu_cores = 0;
  int pcie_gen = 0;
  double inter_node_gbps = 0;  // GB/s; 0: default
  std::string memlock;
  std::string nvme_path;
  std::string nvme_capacity;
  std::string nvme_bench;
  std::string adam_bench;

  void Add(CLI::App* cmd, bool gpu_required_hint) {
    const char* group = "Cluster";
    cmd->add_option("--cluster", cluster_file,
                    "A cluster JSON file (see README); flags override it")
        ->group(group);
    cmd->add_flag("--detect", detect,
                  "Read this machine: RAM, cores, memlock, free space at --nvme-path, GPUs "
                  "through the CUDA driver")
        ->group(group);
    cmd->add_option(
           "--gpu", gpu,
           std::string("GPU preset: v100-16, v100-32, a100-40, a100-80, a800-80, "
                       "h100-80, h100-96, h200, h200-nvl, b200, mi300x, l40s, a10g, l4, "
                       "t4, rtx3090, rtx4090") +
               (gpu_required_hint ? " (needed unless --cluster or --detect finds one)" : ""))
        ->group(group);
    cmd->add_option("-g,--gpus", gpus, "GPUs per node (default 1)")
        ->check(CLI::Range(int64_t{1}, int64_t{1024}))
        ->group(group);
    cmd->add_option("-n,--nodes", nodes, "Number of nodes (default 1)")
        ->check(CLI::Range(int64_t{1}, int64_t{1} << 20))
        ->group(group);
    cmd->add_option("--cpu-mem", cpu_mem, "Host RAM per node: 1TiB, 512GiB, or bytes")
        ->group(group);
    cmd->add_option("--cpu-cores", cpu_cores, "CPU cores per node (CPU-optimizer prior)")
        ->check(CLI::Range(int64_t{1}, int64_t{1} << 16))
        ->group(group);
    cmd->add_option("--pcie-gen", pcie_gen, "PCIe generation of the GPU links (3, 4, 5)")
        ->check(CLI::Range(3, 6))
        ->group(group);
    cmd->add_option("--inter-node-bw", inter_node_gbps,
                    "Network bandwidth per node, GB/s per direction (default 25)")
        ->check(CLI::Range(0.001, 1e6))
        ->group(group);
    cmd->add_option("--memlock", memlock,
                    "RLIMIT_MEMLOCK per process (bytes, 64GiB, or unlimited); default: unchecked "
                    "(or this machine's with --detect)")
        ->group(group);
    cmd->add_option("--nvme-path", nvme_path, "Directory on the NVMe drive for swap files")
        ->group(group);
    cmd->add_option("--nvme-capacity", nvme_capacity, "Space for swap files per node: 4TiB")
        ->group(group);
    cmd->add_option("--nvme-bench", nvme_bench,
                    "A `memplan bench nvme --format json` result: measured NVMe bandwidth")
        ->group(group);
    cmd->add_option("--adam-bench", adam_bench,
                    "A `memplan bench adam --format json` result: measured CPU optimizer speed")
        ->group(group);
  }

  Result<nlohmann::json> ReadJson(const std::string& path) const {
    MEMPLAN_ASSIGN_OR_RETURN(std::string text, ReadFileToString(path, uint64_t{1} << 24));
    return ParseJson(text, path);
  }

  // The cluster of a PlanRequest from --cluster / --detect (read here), the preset, the node
  // flags and the measured benches; planner::ResolveCluster applies them (Note [Plan defaults]).
  Status Fill(planner::PlanRequest* r, std::string* note) const {
    if (!cluster_file.empty()) {
      MEMPLAN_ASSIGN_OR_RETURN(nlohmann::json j, ReadJson(cluster_file));
      MEMPLAN_ASSIGN_OR_RETURN(r->cluster, planner::ClusterFromJson(j, cluster_file));
    }
    if (detect) {
      MEMPLAN_ASSIGN_OR_RETURN(planner::Cluster d, planner::DetectCluster(nvme_path, note));
      planner::Cluster c = r->cluster.value_or(planner::Cluster{});
      if (!r->cluster && d.gpu.memory_bytes > 0) {
        c.gpu = d.gpu;
        c.gpus_per_node = d.gpus_per_node;
      }
      c.cpu_memory_bytes = d.cpu_memory_bytes;
      c.cpu_cores = d.cpu_cores;
      c.memlock_bytes = d.memlock_bytes;
      if (!d.nvme_path.empty()) {
        c.nvme_path = d.nvme_path;
        c.nvme_capacity_bytes = d.nvme_capacity_bytes;
      }
      r->cluster = c;
    }
    planner::ClusterSettings& n = r->node;
    n.gpu = gpu;
    if (!r->HasGpu()) {
      return Status::InvalidArgument(
          "no GPU given: use --gpu PRESET, --cluster FILE, or --detect on a machine with GPUs");
    }
    if (gpus > 0) n.gpus_per_node = gpus;
    if (nodes > 0) n.nodes = nodes;
    if (!cpu_mem.empty()) {
      MEMPLAN_ASSIGN_OR_RETURN(n.cpu_memory_bytes, ParseByteSize(cpu_mem, "--cpu-mem"));
    }
    if (cpu_cores > 0) n.cpu_cores = cpu_cores;
    if (pcie_gen > 0) n.pcie_gen = pcie_gen;
    if (inter_node_gbps > 0) n.inter_node_bytes_per_s = inter_node_gbps * 1e9;
    if (!memlock.empty()) {
      MEMPLAN_ASSIGN_OR_RETURN(n.memlock, planner::Memlock::Parse(memlock, "--memlock"));
    }
    if (!nvme_path.empty()) n.nvme_path = nvme_path;
    if (!nvme_capacity.empty()) {
      MEMPLAN_ASSIGN_OR_RETURN(n.nvme_capacity_bytes,
                               ParseByteSize(nvme_capacity, "--nvme-capacity"));
    }
    if (!nvme_bench.empty()) {
      MEMPLAN_ASSIGN_OR_RETURN(nlohmann::json j, ReadJson(nvme_bench));
      r->nvme_bench = planner::BenchInput{std::move(j), nvme_bench};
    }
    if (!adam_bench.empty()) {
      MEMPLAN_ASSIGN_OR_RETURN(nlohmann::json j, ReadJson(adam_bench));
      r->adam_bench = planner::BenchInput{std::move(j), adam_bench};
    }
    return Status::Ok();
  }
};

struct PlanFlags {
  ModelFlags model;
  ClusterFlags cluster;
  int64_t global_batch = 0;
  int64_t global_batch_tokens = 0;
  // --precision empty: bf16-mixed, or fp16-mixed on GPUs without bf16.
  JobSetupFlags job;
  // "What if": restrict the search to a given configuration (scored like any plan).
  int zero_stage = -1;
  std::string offload_optimizer, offload_param, checkpointing, sharding;
  int64_t micro_batch = 0;
  bool default_buffers = false;  // DeepSpeed's default buffer sizes instead of tuned ones
  double gpu_margin = 0.05;
  bool no_nvme = false;
  size_t top = 5;
  size_t plan_index = 0;
  std::string format = "text";
  std::string output;
  std::string emit_deepspeed, emit_accelerate, emit_fsdp, emit_schedule, emit_trainer;
  std::string svg;  // the picture of the top plans; empty: none
  std::string accelerate_plugin = "deepspeed";
  bool for_hf_trainer = false;
  double lr = 1e-4;
  // --emit-launch KIND FILE and what the launch runs.
  std::vector<std::string> emit_launch;
  std::string launch_script = "train.py";
  std::vector<std::string> launch_args;
  int master_port = 29500;
  std::string slurm_partition, slurm_time;
  std::string calibration;  // --calibration FILE: fitted step-time constants
};

// A file the flags ask for: where, what, and the note for its "wrote" line.
struct NotedFile {
  std::string path;
  std::string text;
  std::string note;
};

// The emitted configs of the chosen plan (--emit-*) and the picture of the top plans (--svg),
// added to `*outcome`'s files (which the driver writes all or nothing, with -o's), each with a
// "wrote PATH (...)" line added to `*written`. An emitter that does not apply to the plan (FSDP
// for an NVMe plan, a Schedule for a plan that offloads nothing) is skipped with a "not written
// PATH: why" line while the others are written. Errors: emit flags when no plan fits or
// --plan-index is past the plans.
Status AddFiles(const PlanFlags& f, const planner::PlanResult& result,
                const planner::Cluster& cluster, const planner::Job& job,
                const planner::SearchOptions& search_options,
                const estimator::ModelInventory& inventory, std::string* written,
                nlohmann::ordered_json* schedule_prediction, Outcome* outcome) {
  std::vector<NotedFile> files;
  std::string schedule_note;
  const bool any_emit = !f.emit_deepspeed.empty() || !f.emit_accelerate.empty() ||
                        !f.emit_fsdp.empty() || !f.emit_schedule.empty() ||
                        !f.emit_trainer.empty() || !f.emit_launch.empty();
  if (any_emit) {
    if (result.plans.empty()) {
      return Status::InvalidArgument(
          "no plan fits, so there is nothing to emit (the report above says why and what would "
          "make one fit)");
    }
    if (f.plan_index >= result.plans.size()) {
      return Status::InvalidArgument("--plan-index " + std::to_string(f.plan_index + 1) +
                                     ": only " + std::to_string(result.plans.size()) +
                                     " plans fit");
    }
    const planner::Plan& plan = result.plans[f.plan_index];
    const std::string note = "plan " + std::to_string(f.plan_index + 1) + ": " + plan.family;
    planner::EmitOptions options;
    options.for_hf_trainer = f.for_hf_trainer;
    options.learning_rate = f.lr;
    options.deepspeed_config_path = f.emit_deepspeed;
    options.accelerate_plugin = f.accelerate_plugin;
    // The emitters' errors do not say which emitter refused: `flag` does, before the message
    // with its fields as flags.
    auto add = [&](const std::string& path, Result<std::string> text, const std::string& flag) {
      if (text.ok()) {
        files.push_back({path, *text, note});
      } else {
        *written += "not written " + path + ": " + (flag.empty() ? "" : flag + ": ") +
                    FieldsToFlags(text.status().message()) + "\n";
      }
    };
    auto dump = [](Result<nlohmann::ordered_json> j) -> Result<std::string> {
      if (!j.ok()) return j.status();
      return JsonOutput(*j);
    };
    if (!f.emit_deepspeed.empty()) {
      add(f.emit_deepspeed, dump(planner::DeepSpeedConfig(plan, cluster, inventory, options)),
          "--emit-deepspeed");
    }
    if (!f.emit_accelerate.empty()) {
      add(f.emit_accelerate, planner::AccelerateConfig(plan, cluster, inventory, options),
          "--emit-accelerate");
    }
    if (!f.emit_fsdp.empty()) {
      add(f.emit_fsdp, dump(planner::FsdpConfig(plan, cluster, inventory)), "--emit-fsdp");
    }
    if (!f.emit_schedule.empty()) {
      Result<planner::EmittedSchedule> emitted =
          planner::EngineScheduleFor(plan, cluster, inventory);
      if (emitted.ok()) {
        add(f.emit_schedule, JsonOutput(emitted->json), "--emit-schedule");
        const planner::EnginePrediction& p = emitted->prediction;
        *schedule_prediction = planner::ToJson(p);
        (*schedule_prediction)["path"] = f.emit_schedule;
        // Said after the "wrote" lines (Note [Schedule for memplan's engine]).
        schedule_note = planner::FormatEnginePrediction(p, f.emit_schedule);
      } else {
        add(f.emit_schedule, emitted.status(), "--emit-schedule");
      }
    }
    if (!f.emit_trainer.empty()) {
      add(f.emit_trainer, dump(planner::TrainerArguments(plan, cluster, inventory, options)),
          "--emit-trainer");
    }
    if (!f.emit_launch.empty()) {
      MEMPLAN_ASSIGN_OR_RETURN(planner::Launcher launcher,
                               planner::ParseLauncher(f.emit_launch[0]));
      planner::LaunchOptions launch;
      launch.launcher = launcher;
      launch.script = f.launch_script;
      launch.script_args = f.launch_args;
      // The launch passes the DeepSpeed config it was emitted with; a DeepSpeed file that was
      // not written (a hybrid plan) is not passed.
      if (!f.emit_deepspeed.empty() &&
          std::any_of(files.begin(), files.end(),
                      [&](const NotedFile& x) { return x.path == f.emit_deepspeed; })) {
        launch.deepspeed_config = f.emit_deepspeed;
      }
      if (!f.emit_accelerate.empty() &&
          std::any_of(files.begin(), files.end(),
                      [&](const NotedFile& x) { return x.path == f.emit_accelerate; })) {
        launch.accelerate_config = f.emit_accelerate;
      }
      launch.for_hf_trainer = f.for_hf_trainer;
      launch.master_port = f.master_port;
      launch.job_name = "memplan-" + std::string(BaseName(f.model.spec));
      launch.slurm_partition = f.slurm_partition;
      launch.slurm_time = f.slurm_time;
      Result<std::string> script = planner::LaunchScript(plan, cluster, launch);
      const bool hybrid_deepspeed =
          launcher == planner::Launcher::kDeepSpeed && plan.sharding == planner::Sharding::kHybrid;
      if (!script.ok() && !hybrid_deepspeed) return script.status();
      add(f.emit_launch[1], script, "");  // its errors name `launcher`
    }
  }
  if (!f.svg.empty()) {
    const size_t shown = std::min(f.top, result.plans.size());
    files.push_back({f.svg, planner::PlansSvg(result, cluster, job, f.top, search_options),
                     shown == 0 ? std::string("picture: no plan fits")
                                : "picture of the top " + std::to_string(shown) +
                                      (shown == 1 ? " plan" : " plans")});
  }
  for (NotedFile& file : files) {
    *written += "wrote " + file.path + " (" + file.note + ")\n";
    outcome->files.push_back({std::move(file.path), std::move(file.text)});
  }
  *written += schedule_note;
  return Status::Ok();
}

// The PlanRequest of the flags (the model's label, the cluster, the job, the what-if
// restrictions, a calibration); every default is planner::Resolve's (Note [Plan defaults]).
Status FillRequest(const PlanFlags& f, planner::PlanRequest* r, std::string* note) {
  r->model = f.model.spec;
  r->global_batch = f.global_batch;
  r->global_batch_tokens = f.global_batch_tokens;
  MEMPLAN_RETURN_IF_ERROR(f.cluster.Fill(r, note));
  if (!f.calibration.empty()) {
    MEMPLAN_ASSIGN_OR_RETURN(r->calibration, ReadCalibrationFile(f.calibration));
  }
  MEMPLAN_RETURN_IF_ERROR(f.job.Fill(r));
  planner::SearchOptions& o = r->search;
  o.gpu_safety_fraction = f.gpu_margin;
  o.allow_nvme = !f.no_nvme;
  o.only_stage = f.zero_stage;
  o.only_micro_batch = f.micro_batch;
  o.tune_buffers = !f.default_buffers;
  if (!f.offload_optimizer.empty()) {
    MEMPLAN_ASSIGN_OR_RETURN(o.only_offload_optimizer,
                             estimator::ParseOffloadDevice(f.offload_optimizer));
  }
  if (!f.offload_param.empty()) {
    MEMPLAN_ASSIGN_OR_RETURN(o.only_offload_param, estimator::ParseOffloadDevice(f.offload_param));
  }
  if (!f.checkpointing.empty()) {
    MEMPLAN_ASSIGN_OR_RETURN(o.only_checkpointing, estimator::ParseCheckpointing(f.checkpointing));
  }
  if (!f.sharding.empty()) {
    MEMPLAN_ASSIGN_OR_RETURN(o.only_sharding, planner::ParseSharding(f.sharding, "--sharding"));
  }
  return Status::Ok();
}

void RunPlan(const PlanFlags& f, Outcome* outcome) {
  auto fail = [&](const Status& s) { Fail(outcome, s); };
  planner::PlanRequest request;
  request.global_batch = f.global_batch;
  request.global_batch_tokens = f.global_batch_tokens;
  if (Status s = planner::CheckBatch(request); !s.ok()) return fail(s);
  auto inventory = f.model.LoadArchitecture("planning");
  if (!inventory.ok()) return fail(inventory.status());
  std::string note;
  if (Status s = FillRequest(f, &request, &note); !s.ok()) return fail(s);
  auto resolved = planner::Resolve(request, *inventory->arch);
  if (!resolved.ok()) return fail(resolved.status());
  const planner::Cluster* cluster = &resolved->cluster;
  const planner::Job& job = resolved->job;
  const planner::SearchOptions& options = resolved->options;
  const std::optional<planner::Calibration>& calibration = request.calibration;
  // A calibration's warnings, repeated (Note [Calibration bounds]).
  const std::string warnings =
      calibration ? CalibrationWarningLines(*calibration, f.calibration) : "";
  auto result = planner::SearchPlans(*inventory, *cluster, job, options);
  if (!result.ok()) return fail(result.status());
  if (!note.empty()) result->assumptions.push_back("--detect: " + note);
  for (const std::string& n : resolved->notes) result->assumptions.push_back(FieldsToFlags(n));

  std::string written;
  nlohmann::ordered_json schedule_prediction;  // --emit-schedule: the engine model's prediction
  Status emitted = AddFiles(f, *result, *cluster, job, options, *inventory, &written,
                            &schedule_prediction, outcome);
  // The plan the emitters write (or would write): what the trainer must also do.
  const planner::Plan* chosen = nullptr;
  if (f.plan_index < result->plans.size()) chosen = &result->plans[f.plan_index];
  std::string text;
  if (f.format == "json") {
    nlohmann::json report = planner::PlanReportJson(*result, *cluster, job, *inventory, f.top,
                                                    f.plan_index, f.for_hf_trainer);
    if (!schedule_prediction.is_null()) report["schedule_prediction"] = schedule_prediction;
    if (calibration) report["calibration_warnings"] = calibration->warnings;
    text = JsonOutput(report);
  } else {
    text = warnings + FieldsToFlags(planner::FormatPlanText(*result, *cluster, job, f.top));
    if (chosen != nullptr) {
      text += "\nThe trainer must also (plan " + std::to_string(f.plan_index + 1) + "):\n";
      for (const std::string& line :
           planner::TrainerSettings(*chosen, *inventory, f.for_hf_trainer)) {
        text += "  - " + line + "\n";
      }
    }
    text += written.empty() ? "" : "\n" + written;
  }
  if (!emitted.ok()) {
    // Nothing fits: the report first (why, and what would make a plan fit), then the error,
    // exit 2; no file is written.
    outcome->files.clear();
    fail(emitted);
    if (result->plans.empty() && f.output.empty()) {
      outcome->stdout_text = text;
      outcome->report_with_error = true;
    }
    return;
  }
  EmitReport(f.output, std::move(text), outcome);
}

}  // namespace

void RegisterPlan(CLI::App& app, Outcome* outcome) {
  auto f = std::make_shared<PlanFlags>();
  CLI::App* cmd = app.add_subcommand(
      "plan",
      "The fastest training configuration that fits a cluster (ZeRO stage x offload x "
      "checkpointing x micro-batch), explained, and written as DeepSpeed / Accelerate / FSDP "
      "configs");
  f->model.Add(cmd,
               "A model as in `memplan estimate`: a built-in name (see `memplan models`), a "
               "config.json, or a Hugging Face repo id (the local hub cache, else the Hub "
               "unless --offline)",
               true);
  f->cluster.Add(cmd, true);
  const char* job = "Job";
  cmd->add_option("--global-batch", f->global_batch, "Sequences per optimizer step, all GPUs")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30))
      ->group(job);
  cmd->add_option("--global-batch-tokens", f->global_batch_tokens,
                  "Tokens per optimizer step (a multiple of --seq-len)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 50))
      ->group(job);
  f->job.Add(cmd, job,
             "fp32 | fp16-mixed | bf16-mixed | bf16-pure (default: bf16-mixed, fp16-mixed on "
             "GPUs without bf16)",
             "adamw | adam8bit | sgd | lion | adafactor (default adamw; without the flag 8-bit "
             "AdamW is also tried where it is faster)");
  const char* what_if =
      "What if (restrict the search; a given configuration is scored like any plan)";
  cmd->add_option("--zero-stage", f->zero_stage, "Only this ZeRO stage (0-3)")
      ->check(CLI::Range(0, 3))
      ->group(what_if);
  cmd->add_option("--offload-optimizer", f->offload_optimizer, "Only this optimizer placement")
      ->check(CLI::IsMember({"none", "cpu", "nvme"}))
      ->group(what_if);
  cmd->add_option("--offload-param", f->offload_param, "Only this parameter placement (stage 3)")
      ->check(CLI::IsMember({"none", "cpu", "nvme"}))
      ->group(what_if);
  cmd->add_option("--checkpointing", f->checkpointing, "Only this activation checkpointing")
      ->check(CLI::IsMember({"none", "selective", "full", "op"}))
      ->group(what_if);
  cmd->add_option("--micro-batch", f->micro_batch,
                  "Only this micro-batch (it must divide the sequences per GPU)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 24))
      ->group(what_if);
  cmd->add_option("--sharding", f->sharding,
                  "ZeRO-3 across nodes: full (over all GPUs) or hybrid (within each node: FSDP "
                  "HYBRID_SHARD; DeepSpeed removed MiCS in 0.19, so only the FSDP files apply)")
      ->check(CLI::IsMember({"full", "hybrid"}))
      ->group(what_if);
  cmd->add_flag("--default-buffers", f->default_buffers,
                "Keep DeepSpeed's default bucket and buffer sizes instead of tuning them")
      ->group(what_if);
  const char* search = "Search and output";
  cmd->add_option("--gpu-margin", f->gpu_margin,
                  "Fraction of GPU memory kept free beyond the estimate's own margins")
      ->check(CLI::Range(0.0, 0.9))
      ->capture_default_str()
      ->group(search);
  cmd->add_flag("--no-nvme", f->no_nvme, "Do not consider NVMe offload")->group(search);
  cmd->add_option("--top", f->top, "Plans to show")
      ->check(CLI::Range(size_t{1}, size_t{100}))
      ->capture_default_str()
      ->group(search);
  AddFormatOption(cmd, &f->format, "text or json")->group(search);
  cmd->add_option("-o,--output", f->output,
                  "Write the report to this file (atomically, with the --emit-* and --svg files: "
                  "all are written or none)")
      ->group(search);
  cmd->add_option("--svg", f->svg,
                  "Draw the top plans side by side as an SVG file (atomically): peak memory per "
                  "tier against capacity, and the step time split into compute, communication, "
                  "offload and optimizer; when nothing fits, why")
      ->group(search);
  const char* emit = "Emit (files written atomically)";
  cmd->add_option("--plan-index", f->plan_index, "Which plan to emit: 1 = the best (default)")
      ->check(CLI::Range(size_t{1}, size_t{100}))
      ->group(emit);
  cmd->add_option("--emit-deepspeed", f->emit_deepspeed, "Write a DeepSpeed ds_config.json")
      ->group(emit);
  cmd->add_option("--emit-accelerate", f->emit_accelerate, "Write an Accelerate config (YAML)")
      ->group(emit);
  cmd->add_option("--accelerate-plugin", f->accelerate_plugin, "deepspeed or fsdp")
      ->check(CLI::IsMember({"deepspeed", "fsdp"}))
      ->capture_default_str()
      ->group(emit);
  cmd->add_option("--emit-fsdp", f->emit_fsdp, "Write FSDP arguments (JSON)")->group(emit);
  cmd->add_option("--emit-schedule", f->emit_schedule,
                  "Write the offload engine's Schedule (JSON, memplan.schedule/1)")
      ->group(emit);
  cmd->add_option("--emit-trainer", f->emit_trainer,
                  "Write the Hugging Face TrainingArguments and model settings the plan assumes "
                  "(JSON: gradient checkpointing, attention implementation, batch, precision)")
      ->group(emit);
  cmd->add_flag("--for-hf-trainer", f->for_hf_trainer,
                "Use \"auto\" where the Hugging Face Trainer fills values")
      ->group(emit);
  cmd->add_option("--lr", f->lr, "optimizer.params.lr in the DeepSpeed config")
      ->check(CLI::Range(0.0, 10.0))
      ->capture_default_str()
      ->group(emit);
  cmd->add_option("--emit-launch", f->emit_launch,
                  "KIND FILE: write what starts the job (a bash script): slurm (an sbatch script: "
                  "nodes, tasks, --gres=gpu:N, srun torchrun or accelerate launch), torchrun, "
                  "deepspeed or accelerate (the launcher's command line), passing the configs "
                  "emitted with it")
      ->expected(2)
      ->group(emit);
  cmd->add_option("--launch-script", f->launch_script, "The training script the launch runs")
      ->capture_default_str()
      ->group(emit);
  cmd->add_option("--launch-arg", f->launch_args,
                  "One argument for the training script, verbatim (repeat for several; "
                  "--launch-arg=--epochs for one that starts with -)")
      ->group(emit);
  cmd->add_option("--master-port", f->master_port, "Rendezvous port of the launch")
      ->check(CLI::Range(1, 65535))
      ->capture_default_str()
      ->group(emit);
  cmd->add_option("--slurm-partition", f->slurm_partition,
                  "#SBATCH --partition of the sbatch "
                  "script")
      ->group(emit);
  cmd->add_option("--slurm-time", f->slurm_time,
                  "#SBATCH --time of the sbatch script "
                  "(D-HH:MM:SS)")
      ->group(emit);
  cmd->add_option("--calibration", f->calibration,
                  "Step-time constants fitted to your runs (`memplan calibrate` output)")
      ->group(search);
  cmd->footer(
      "\nExamples:\n"
      "  memplan plan --model llama-2-7b --gpu a100-80 --gpus 8 --global-batch 64 --seq-len 2048\n"
      "  memplan plan --model llama-2-70b --gpu a100-80 --gpus 8 --nodes 2 --cpu-mem 1TiB "
      "--global-batch 32 --emit-deepspeed ds_config.json\n"
      "  memplan plan --model llama-2-7b --gpu rtx4090 --cpu-mem 64GiB --nvme-path /mnt/nvme "
      "--nvme-capacity 1TiB --nvme-bench nvme.json --global-batch 16\n"
      "  memplan plan --model llama-2-70b --gpu a100-80 --gpus 8 --nodes 2 --cpu-mem 1TiB "
      "--global-batch 64 --svg plans.svg\n"
      "  memplan plan --model llama-2-70b --gpu a800-80 --gpus 8 --nodes 4 --cpu-mem 1TiB "
      "--global-batch 256 --emit-deepspeed ds.json --emit-launch slurm job.sbatch\n"
      "\nExit status: 0 on success (also when nothing fits: see \"rejected\"), 2 on bad input.");
  cmd->callback([f, outcome] {
    PlanFlags flags = *f;
    if (flags.plan_index > 0) flags.plan_index -= 1;  // 1-based on the command line
    RunPlan(flags, outcome);
  });
}

// Shared with check_command.cc.
Result<planner::Cluster> BuildClusterForCheck(const std::string& gpu, int64_t gpus, int64_t nodes,
                                              const std::string& cpu_mem,
                                              const std::string& memlock,
                                              const std::string& cluster_file) {
  ClusterFlags flags;
  flags.gpu = gpu;
  flags.gpus = gpus;
  flags.nodes = nodes;
  flags.cpu_mem = cpu_mem;
  flags.memlock = memlock;
  flags.cluster_file = cluster_file;
  std::string note;
  planner::PlanRequest request;
  MEMPLAN_RETURN_IF_ERROR(flags.Fill(&request, &note));
  return planner::ResolveCluster(request);
}

}  // namespace memplan::tools
