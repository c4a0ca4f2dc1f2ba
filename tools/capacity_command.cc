// `memplan capacity`: which GPU type, how many and how many nodes, for how long and at what cost
// (planner/capacity.h), as a table, JSON, and a cost-against-time picture (--svg).
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/byte_size.h"
#include "common/file.h"
#include "common/json.h"
#include "common/printable.h"
#include "estimator/model_source.h"
#include "estimator/training_setup.h"
#include "planner/capacity.h"
#include "planner/cluster.h"
#include "planner/job.h"
#include "planner/plan_request.h"
#include "planner/svg.h"
#include "tools/calibration_flags.h"
#include "tools/commands.h"
#include "tools/setup_flags.h"

namespace memplan::tools {
namespace {

// Where capacity spells a field its own way (FieldsToFlags): an offer's node size is
// --gpus-per-node here, while plan's --gpus is GPUs per node.
constexpr std::pair<std::string_view, std::string_view> kCapacityFlags[] = {
    {"gpus_per_node", "--gpus-per-node"},
};

struct CapacityFlags {
  ModelFlags model;
  std::string gpus_text;  // GPU types, comma-separated
  std::string counts_text = "1-64";
  int64_t gpus_per_node = 0;        // 0: 8, or the cluster file's
  std::vector<std::string> prices;  // "2.5" (every type) or "h100-80=2.5"
  std::string tokens_text;
  double max_days = 0;
  std::string cluster_file;
  std::string cpu_mem;
  int64_t cpu_cores = 0;
  int pcie_gen = 0;
  double inter_node_gbps = 0;
  std::string memlock;
  std::string nvme_path, nvme_capacity;
  int64_t global_batch = 0;
  std::string global_batch_tokens;
  JobSetupFlags job;  // --seq-len, --precision, --optimizer, ...
  double gpu_margin = 0.05;
  bool no_nvme = false;
  int threads = 0;
  std::string calibration;
  std::string format = "text";
  std::string output;
  std::string svg;
};

Result<nlohmann::json> ReadJsonFile(const std::string& path) {
  MEMPLAN_ASSIGN_OR_RETURN(std::string text, ReadFileToString(path, uint64_t{1} << 24));
  return ParseJson(text, path);
}

// The offers from --cluster and --gpu, with --price and --gpus-per-node applied
// (planner::ChooseOffers).
Result<std::vector<planner::GpuOffer>> BuildOffers(const CapacityFlags& f, planner::Cluster* node) {
  std::vector<planner::GpuOffer> listed;
  if (!f.cluster_file.empty()) {
    MEMPLAN_ASSIGN_OR_RETURN(nlohmann::json j, ReadJsonFile(f.cluster_file));
    MEMPLAN_ASSIGN_OR_RETURN(listed, planner::OffersFromJson(j, f.cluster_file, node));
  }
  std::vector<std::string> names;
  size_t start = 0;
  while (!f.gpus_text.empty() && start <= f.gpus_text.size()) {
    size_t comma = f.gpus_text.find(',', start);
    if (comma == std::string::npos) comma = f.gpus_text.size();
    names.push_back(f.gpus_text.substr(start, comma - start));
    start = comma + 1;
  }
  return planner::ChooseOffers(std::move(listed), names, f.gpus_per_node, f.prices);
}

// The node flags and the job flags as a PlanRequest (its cluster, GPU and counts are unused:
// the offers and counts set them).
Status FillPlanRequest(const CapacityFlags& f, planner::PlanRequest* r) {
  planner::ClusterSettings& n = r->node;
  if (!f.cpu_mem.empty()) {
    MEMPLAN_ASSIGN_OR_RETURN(n.cpu_memory_bytes, ParseByteSize(f.cpu_mem, "--cpu-mem"));
  }
  if (f.cpu_cores > 0) n.cpu_cores = f.cpu_cores;
  if (f.pcie_gen > 0) n.pcie_gen = f.pcie_gen;
  if (f.inter_node_gbps > 0) n.inter_node_bytes_per_s = f.inter_node_gbps * 1e9;
  if (!f.memlock.empty()) {
    MEMPLAN_ASSIGN_OR_RETURN(n.memlock, planner::Memlock::Parse(f.memlock, "--memlock"));
  }
  if (!f.nvme_path.empty()) n.nvme_path = f.nvme_path;
  if (!f.nvme_capacity.empty()) {
    MEMPLAN_ASSIGN_OR_RETURN(n.nvme_capacity_bytes,
                             ParseByteSize(f.nvme_capacity, "--nvme-capacity"));
  }
  r->model = f.model.spec;
  r->global_batch = f.global_batch;
  if (!f.global_batch_tokens.empty()) {
    MEMPLAN_ASSIGN_OR_RETURN(
        double tokens, planner::ParseTokenCount(f.global_batch_tokens, "--global-batch-tokens"));
    if (tokens > 1e15 || tokens != std::floor(tokens)) {
      return Status::InvalidArgument(
          "--global-batch-tokens must be a whole number of tokens below 1e15");
    }
    r->global_batch_tokens = static_cast<int64_t>(tokens);
  }
  MEMPLAN_RETURN_IF_ERROR(f.job.Fill(r));
  r->search.gpu_safety_fraction = f.gpu_margin;
  r->search.allow_nvme = !f.no_nvme;
  return Status::Ok();
}

void RunCapacity(const CapacityFlags& f, Outcome* outcome) {
  auto fail = [&](const Status& s) { Fail(outcome, s, kCapacityFlags); };
  if (f.tokens_text.empty()) {
    return fail(Status::InvalidArgument("--tokens is required: the training budget (1T, 300B)"));
  }
  {
    // Which of the two was given (the tokens are parsed below): planner::CheckBatch's rule.
    planner::PlanRequest given;
    given.global_batch = f.global_batch;
    given.global_batch_tokens = f.global_batch_tokens.empty() ? 0 : 1;
    if (Status s = planner::CheckBatch(given); !s.ok()) return fail(s);
  }
  planner::CapacityRequest request;
  auto offers = BuildOffers(f, &request.node);
  if (!offers.ok()) return fail(offers.status());
  request.offers = std::move(*offers);
  auto counts = planner::ParseGpuCounts(f.counts_text, "--gpus");
  if (!counts.ok()) return fail(counts.status());
  request.gpu_counts = *counts;
  auto tokens = planner::ParseTokenCount(f.tokens_text, "--tokens");
  if (!tokens.ok()) return fail(tokens.status());
  request.tokens = *tokens;
  request.threads = f.threads;
  request.max_train_hours = f.max_days * 24;
  planner::PlanRequest plan;  // the node settings and the job, resolved as `memplan plan`'s
  if (Status s = FillPlanRequest(f, &plan); !s.ok()) return fail(s);
  plan.node.ApplyTo(&request.node);

  auto inventory = f.model.LoadArchitecture("capacity planning");
  if (!inventory.ok()) return fail(inventory.status());
  // Each GPU type's precision is DefaultPrecision's when none is given (fp16_fallback).
  auto job = planner::ResolveJob(plan, /*gpu=*/nullptr, *inventory->arch);
  if (!job.ok()) return fail(job.status());
  request.fp16_fallback = !plan.precision.has_value();
  request.search = planner::ResolveSearch(plan);
  std::string warnings;  // a calibration's, repeated (Note [Calibration bounds])
  nlohmann::json warning_list = nlohmann::json::array();
  if (!f.calibration.empty()) {
    auto calibration = ReadCalibrationFile(f.calibration);
    if (!calibration.ok()) return fail(calibration.status());
    warnings = CalibrationWarningLines(*calibration, f.calibration);
    warning_list = calibration->warnings;
    for (planner::GpuOffer& offer : request.offers) {
      planner::SearchOptions own = request.search;
      planner::ApplyCalibration(*calibration, &offer.gpu, &own);
      offer.time_constants = own.time_constants;
    }
    planner::ApplyCalibration(*calibration, nullptr, &request.search);
  }
  auto result = planner::PlanCapacity(*inventory, *job, request);
  if (!result.ok()) return fail(result.status());
  std::string text;
  if (f.format == "json") {
    nlohmann::json report = planner::ToJson(*result, request, *job);
    if (!f.calibration.empty()) report["calibration_warnings"] = warning_list;
    text = JsonOutput(report);
  } else {
    text = warnings +
           FieldsToFlags(planner::FormatCapacityText(*result, request, *job), kCapacityFlags);
  }
  if (!f.svg.empty()) {
    outcome->files.push_back({f.svg, planner::CapacitySvg(*result, request, *job)});
    if (f.format != "json") text += "\nwrote " + f.svg + " (cost against time to train)\n";
  }
  EmitReport(f.output, std::move(text), outcome);
}

}  // namespace

void RegisterCapacity(CLI::App& app, Outcome* outcome) {
  auto f = std::make_shared<CapacityFlags>();
  CLI::App* cmd = app.add_subcommand(
      "capacity",
      "Which GPU type, how many, for how long and at what cost: the fastest plan of every GPU "
      "type x count, and the fewest GPUs that fit, the fastest and the cheapest for a token "
      "budget");
  f->model.Add(cmd,
               "A model as in `memplan plan`: a built-in name, a config.json, or a Hugging Face "
               "repo id",
               true);
  const char* gpus = "GPUs and prices";
  cmd->add_option("--gpu", f->gpus_text,
                  "GPU types, comma-separated presets (v100-16, v100-32, a100-40, a100-80, "
                  "a800-80, h100-80, h100-96, h200, h200-nvl, b200, mi300x, l40s, a10g, l4, t4, "
                  "rtx3090, rtx4090), or the names of --cluster's types to keep")
      ->group(gpus);
  cmd->add_option("-g,--gpus", f->counts_text,
                  "Total GPU counts to try: 8-512 (doubling: 8, 16, ..., 512), 8,24,64, or both")
      ->capture_default_str()
      ->group(gpus);
  cmd->add_option("--gpus-per-node", f->gpus_per_node,
                  "GPUs per node for every type (default 8, or each type's in --cluster); larger "
                  "counts run on whole nodes")
      ->check(CLI::Range(int64_t{1}, int64_t{1024}))
      ->group(gpus);
  cmd->add_option("--price", f->prices,
                  "Price per GPU-hour: one number for a single type, else TYPE=PRICE for each "
                  "(a100-80=1.8,h100-80=2.9); the cluster file's price_per_gpu_hour otherwise")
      ->delimiter(',')
      ->group(gpus);
  cmd->add_option("--tokens", f->tokens_text,
                  "The training budget in tokens: 1T, 300B, 15e12 (required)")
      ->group(gpus);
  cmd->add_option("--max-days", f->max_days,
                  "A deadline: the fewest GPUs and the cheapest among the points that train "
                  "within it")
      ->check(CLI::Range(0.001, 1e7))
      ->group(gpus);
  cmd->add_option("--cluster", f->cluster_file,
                  "A capacity cluster JSON: {\"gpus\": [\"a100-80\", {\"preset\": \"h100-80\", "
                  "\"price_per_gpu_hour\": 2.9, \"gpus_per_node\": 8}, {custom GPU figures}], "
                  "node keys as in plan's --cluster}; or a plan cluster file (one type)")
      ->group(gpus);
  const char* node = "Each node";
  cmd->add_option("--cpu-mem", f->cpu_mem, "Host RAM per node: 1TiB, 512GiB")->group(node);
  cmd->add_option("--cpu-cores", f->cpu_cores, "CPU cores per node")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 16))
      ->group(node);
  cmd->add_option("--pcie-gen", f->pcie_gen, "PCIe generation of the GPU links (3-6)")
      ->check(CLI::Range(3, 6))
      ->group(node);
  cmd->add_option("--inter-node-bw", f->inter_node_gbps,
                  "Network per node, GB/s per direction (default: each GPU's reference server)")
      ->check(CLI::Range(0.001, 1e6))
      ->group(node);
  cmd->add_option("--memlock", f->memlock, "RLIMIT_MEMLOCK per process (bytes, 64GiB, unlimited)")
      ->group(node);
  cmd->add_option("--nvme-path", f->nvme_path, "Directory on each node's NVMe drive")->group(node);
  cmd->add_option("--nvme-capacity", f->nvme_capacity, "Space for swap files per node")
      ->group(node);
  const char* job = "Job";
  cmd->add_option("--global-batch", f->global_batch, "Sequences per optimizer step, all GPUs")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30))
      ->group(job);
  cmd->add_option("--global-batch-tokens", f->global_batch_tokens,
                  "Tokens per optimizer step (4M, 4194304; a multiple of --seq-len)")
      ->group(job);
  f->job.Add(cmd, job,
             "fp32 | fp16-mixed | bf16-mixed | bf16-pure (default bf16-mixed; fp16-mixed on GPUs "
             "without bf16)",
             "adamw | adam8bit | sgd | lion | adafactor (default adamw; without the flag 8-bit "
             "AdamW is also tried)");
  const char* search = "Search and output";
  cmd->add_option("--gpu-margin", f->gpu_margin,
                  "Fraction of GPU memory kept free beyond the estimate's own margins")
      ->check(CLI::Range(0.0, 0.9))
      ->capture_default_str()
      ->group(search);
  cmd->add_flag("--no-nvme", f->no_nvme, "Do not consider NVMe offload")->group(search);
  cmd->add_option("--calibration", f->calibration,
                  "Step-time constants fitted to your runs (`memplan calibrate` output)")
      ->group(search);
  cmd->add_option("--threads", f->threads,
                  "Searches run in parallel (default: the cores, at most 8); the answer does "
                  "not depend on it")
      ->check(CLI::Range(1, 256))
      ->group(search);
  AddFormatOption(cmd, &f->format, "text or json")->group(search);
  cmd->add_option("-o,--output", f->output,
                  "Write the report to this file (atomically, with --svg: both or neither)")
      ->group(search);
  cmd->add_option("--svg", f->svg,
                  "Draw cost (GPU-hours without prices) against time to train as an SVG file")
      ->group(search);
  cmd->footer(
      "\nExamples:\n"
      "  memplan capacity --model llama-3.1-70b --gpu a100-80,h100-80,mi300x --gpus 8-512 "
      "--tokens 1T --global-batch-tokens 4194304 --seq-len 8192 --price "
      "a100-80=1.8,h100-80=2.9,mi300x=2.5 --svg cost.svg\n"
      "  memplan capacity --model llama-2-7b --cluster offers.json --gpus 1-64 --tokens 300B "
      "--global-batch 512 --seq-len 4096 --format json\n"
      "\nEach GPU type x count is a full `memplan plan` search; rerun `memplan plan` with the "
      "chosen --gpu, --gpus (per node) and --nodes to emit its configs and launch script.\n"
      "Exit status: 0 on success (also when nothing fits), 2 on bad input.");
  cmd->callback([f, outcome] { RunCapacity(*f, outcome); });
}

}  // namespace memplan::tools
