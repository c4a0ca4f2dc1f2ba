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

// A price per GPU-hour: a decimal number (common/byte_size.h's one grammar: "0x10" is not 16) in
// [0, 1e6]; one too small for a double (1e-400) is 0, as any tiny price rounds.
Result<double> ParsePrice(const std::string& text, const std::string& what) {
  const std::optional<double> v = ParseDecimalNumber(text);
  if (!v) {
    return Status::InvalidArgument("--price " + what + ": '" + Printable(text) +
                                   "' is not a price per GPU-hour (a decimal number: 2.5, 0.8)");
  }
  if (!std::isfinite(*v) || *v < 0 || *v > 1e6) {
    return Status::InvalidArgument("--price " + what + ": " + Printable(text) +
                                   " is not in [0, 1e6] per GPU-hour");
  }
  return *v;
}

// The offers from --cluster and --gpu, with --price and --gpus-per-node applied.
Result<std::vector<planner::GpuOffer>> BuildOffers(const CapacityFlags& f, planner::Cluster* node) {
  std::vector<planner::GpuOffer> offers;
  if (!f.cluster_file.empty()) {
    MEMPLAN_ASSIGN_OR_RETURN(nlohmann::json j, ReadJsonFile(f.cluster_file));
    MEMPLAN_ASSIGN_OR_RETURN(offers, planner::OffersFromJson(j, f.cluster_file, node));
  }
  if (!f.gpus_text.empty()) {
    // --gpu picks (and orders) the types: a file's type keeps its figures and price.
    std::vector<planner::GpuOffer> chosen;
    size_t start = 0;
    while (start <= f.gpus_text.size()) {
      size_t comma = f.gpus_text.find(',', start);
      if (comma == std::string::npos) comma = f.gpus_text.size();
      const std::string name = f.gpus_text.substr(start, comma - start);
      start = comma + 1;
      auto same = std::find_if(offers.begin(), offers.end(),
                               [&](const planner::GpuOffer& o) { return o.gpu.name == name; });
      if (same != offers.end()) {
        chosen.push_back(*same);
        continue;
      }
      MEMPLAN_ASSIGN_OR_RETURN(planner::GpuSpec gpu, planner::FindGpuPreset(name));
      planner::GpuOffer offer;
      offer.gpu = gpu;
      chosen.push_back(offer);
    }
    offers = std::move(chosen);
  }
  if (offers.empty()) {
    return Status::InvalidArgument(
        "no GPU type given: use --gpu a100-80,h100-80,... or --cluster "
        "FILE with a 'gpus' list");
  }
  if (f.gpus_per_node > 0) {
    for (planner::GpuOffer& o : offers) o.gpus_per_node = f.gpus_per_node;
  }
  // Each type's price is given once: "a100-80=1,a100-80=2" (or "a100=1,a100-80=2", the same
  // type) is refused like `--gpu a100-80,a100-80`, not resolved by order. A bare price is every
  // other type's, wherever it stands in the list.
  std::optional<double> every;
  std::vector<const planner::GpuOffer*> priced;
  for (const std::string& price : f.prices) {
    const size_t eq = price.find('=');
    if (eq == std::string::npos) {
      if (offers.size() > 1 && f.prices.size() == 1) {
        return Status::InvalidArgument("--price " + Printable(price) +
                                       ": with several GPU types give "
                                       "TYPE=PRICE for each (--price a100-80=1.8,h100-80=2.9)");
      }
      if (every) {
        return Status::InvalidArgument("--price " + Printable(price) +
                                       ": a price for every GPU type is given twice");
      }
      MEMPLAN_ASSIGN_OR_RETURN(every, ParsePrice(price, "for every GPU type"));
      continue;
    }
    const std::string name = price.substr(0, eq);
    auto it = std::find_if(offers.begin(), offers.end(),
                           [&](const planner::GpuOffer& o) { return o.gpu.name == name; });
    if (it == offers.end()) {
      // A preset alias ("h100") names the type its preset resolves to.
      auto preset = planner::FindGpuPreset(name);
      if (preset.ok()) {
        it = std::find_if(offers.begin(), offers.end(),
                          [&](const planner::GpuOffer& o) { return o.gpu.name == preset->name; });
      }
    }
    if (it == offers.end()) {
      return Status::InvalidArgument("--price " + Printable(price) + ": '" + Printable(name) +
                                     "' is not one of the GPU types searched");
    }
    if (std::find(priced.begin(), priced.end(), &*it) != priced.end()) {
      return Status::InvalidArgument("--price " + Printable(price) + ": " + it->gpu.name +
                                     " is given a price twice");
    }
    priced.push_back(&*it);
    MEMPLAN_ASSIGN_OR_RETURN(it->price_per_gpu_hour,
                             ParsePrice(price.substr(eq + 1), Printable(name)));
  }
  if (every) {
    for (planner::GpuOffer& o : offers) {
      if (std::find(priced.begin(), priced.end(), &o) == priced.end()) {
        o.price_per_gpu_hour = *every;
      }
    }
  }
  return offers;
}

void RunCapacity(const CapacityFlags& f, Outcome* outcome) {
  auto fail = [&](const Status& s) { Fail(outcome, s, kCapacityFlags); };
  if (f.tokens_text.empty()) {
    return fail(Status::InvalidArgument("--tokens is required: the training budget (1T, 300B)"));
  }
  if ((f.global_batch > 0) == !f.global_batch_tokens.empty()) {
    return fail(
        Status::InvalidArgument("give exactly one of --global-batch (samples) and "
                                "--global-batch-tokens"));
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
  planner::Cluster& node = request.node;
  if (!f.cpu_mem.empty()) {
    auto v = ParseByteSize(f.cpu_mem, "--cpu-mem");
    if (!v.ok()) return fail(v.status());
    node.cpu_memory_bytes = *v;
  }
  if (f.cpu_cores > 0) node.cpu_cores = f.cpu_cores;
  if (f.pcie_gen > 0) node.pcie_gen = f.pcie_gen;
  if (f.inter_node_gbps > 0) node.inter_node_bytes_per_s = f.inter_node_gbps * 1e9;
  if (!f.memlock.empty() && f.memlock != "unlimited") {
    auto v = ParseByteSize(f.memlock, "--memlock");
    if (!v.ok()) return fail(v.status());
    node.memlock_bytes = *v;
  } else if (f.memlock == "unlimited") {
    node.memlock_bytes = 0;
  }
  if (!f.nvme_path.empty()) node.nvme_path = f.nvme_path;
  if (!f.nvme_capacity.empty()) {
    auto v = ParseByteSize(f.nvme_capacity, "--nvme-capacity");
    if (!v.ok()) return fail(v.status());
    node.nvme_capacity_bytes = *v;
  }

  auto inventory = f.model.LoadArchitecture("capacity planning");
  if (!inventory.ok()) return fail(inventory.status());
  planner::Job job;
  job.model = f.model.spec;
  estimator::TrainingSetup& s = job.setup;
  Status applied = f.job.Apply(f.job.precision.empty() ? "bf16-mixed" : f.job.precision, &s);
  if (!applied.ok()) return fail(applied);
  request.fp16_fallback = f.job.precision.empty();
  if (!f.global_batch_tokens.empty()) {
    auto batch_tokens = planner::ParseTokenCount(f.global_batch_tokens, "--global-batch-tokens");
    if (!batch_tokens.ok()) return fail(batch_tokens.status());
    if (*batch_tokens > 1e15 || *batch_tokens != std::floor(*batch_tokens)) {
      return fail(
          Status::InvalidArgument("--global-batch-tokens must be a whole number of tokens "
                                  "below 1e15"));
    }
    auto samples = planner::SamplesFromTokens(static_cast<int64_t>(*batch_tokens),
                                              s.SeqLenFor(&*inventory->arch));
    if (!samples.ok()) return fail(samples.status());
    job.global_batch = *samples;
  } else {
    job.global_batch = f.global_batch;
  }
  request.search.gpu_safety_fraction = f.gpu_margin;
  request.search.allow_nvme = !f.no_nvme;
  request.search.consider_8bit = !f.job.OptimizerGiven();
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
  auto result = planner::PlanCapacity(*inventory, job, request);
  if (!result.ok()) return fail(result.status());
  std::string text;
  if (f.format == "json") {
    nlohmann::json report = planner::ToJson(*result, request, job);
    if (!f.calibration.empty()) report["calibration_warnings"] = warning_list;
    text = JsonOutput(report);
  } else {
    text = warnings +
           FieldsToFlags(planner::FormatCapacityText(*result, request, job), kCapacityFlags);
  }
  if (!f.svg.empty()) {
    outcome->files.push_back({f.svg, planner::CapacitySvg(*result, request, job)});
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
