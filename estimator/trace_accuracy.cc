// Holds the step model (Note [The step model]) to the traced grid: each grid point's setup is run
// through EstimateMemory and its predicted peak allocated bytes, and the categories at the traced
// peak's phase, are compared with the trace of the real code (memplan.trace, docs/trace.md "The
// grid"). Prints the median and worst |error| per framework and fails when a point is beyond the
// bounds given.
//
// Usage: estimator_trace_accuracy [--peak-bound F] [--category-bound F]
//            [--bound FRAMEWORK=PEAK,CATEGORY]... [--max-beyond N] [--show N] [--detail]
//            [--itemised] [--phases]
//            GRID.json...
// (--bound: other bounds for one framework's points; --max-beyond: how many points may be
// beyond their bounds (default 0); --detail: the categories of each point
// shown beyond the bounds; --itemised: the per-layer formulas' peak too; --phases: a point is
// also beyond when any phase's peak, not only the traced peak's, is beyond the peak bound). A
// point whose setup the step model does not run (it says so: MPT under Transformers, say) is
// counted and listed as refused but does not fail the run; any other refusal does.
// Exit: 0 within the bounds, 1 beyond them, 2 a usage or input error, 77 when no grid file exists
// (the grid is data checked in by the trace work; CTest counts 77 as skipped).
//
// Errors: peak |predicted - traced| / traced. A category's error is relative to the larger of its
// traced bytes and 1% of the traced peak, so that a category of a few KiB (buffers, the batch)
// does not turn a 512-byte rounding difference into 100%.
//
// A model_config path in a grid record is relative to the repository the grid file sits in
// (GRID/../..); the record's `layers` replaces the config's block count as the tracer does
// (memplan/trace_transformers.py _LAYER_FIELDS).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/file.h"
#include "estimator/hf_config.h"
#include "estimator/memory_model.h"
#include "estimator/training_setup.h"

namespace {

using memplan::Result;
using memplan::Status;
using namespace memplan::estimator;

struct PointResult {
  std::string id, framework;
  double peak_error = 0;      // signed, relative
  double category_error = 0;  // worst, absolute, relative (see above)
  std::string worst_category;
  std::string error;        // the estimator refused the point
  bool unmodelled = false;  // refused as a setup the step model does not run
  std::string detail;       // traced vs predicted bytes per category at the traced peak's phase
  // The itemised memory model's allocated peak (its phases' max_memory_allocated, no context or
  // margin) against the traced peak: what plan and check stand on. Reported, not bounded.
  double itemised_error = 0;
  bool has_itemised = false;  // the estimate ran, whether or not the step model did
  double phase_error = 0;     // the worst |error| of a phase's peak (--phases bounds it)
};

Result<ModelInventory> Inventory(const std::filesystem::path& root, const nlohmann::json& rec) {
  const std::string rel = rec.at("model_config").get<std::string>();
  MEMPLAN_ASSIGN_OR_RETURN(std::string text, memplan::ReadFileToString((root / rel).string()));
  nlohmann::json config = nlohmann::json::parse(text, nullptr, false);
  if (config.is_discarded()) return Status::InvalidArgument(rel + ": not JSON");
  const nlohmann::json& setup = rec.at("setup");
  if (setup.contains("layers") && setup["layers"].is_number_integer()) {
    const int64_t layers = setup["layers"].get<int64_t>();
    bool set = false;
    for (const char* field : {"num_hidden_layers", "n_layer", "num_layers", "n_layers"}) {
      if (config.contains(field)) {
        config[field] = layers;
        set = true;
        break;
      }
    }
    if (!set) config["num_hidden_layers"] = layers;
    for (const char* field : {"layer_types", "sliding_window_pattern_list", "attention_layers"}) {
      if (config.contains(field) && config[field].is_array() &&
          static_cast<int64_t>(config[field].size()) > layers) {
        nlohmann::json cut = nlohmann::json::array();
        for (int64_t i = 0; i < layers; ++i) cut.push_back(config[field][static_cast<size_t>(i)]);
        config[field] = cut;
      }
    }
    // GPT-Neo's attention_types ([[["global", "local"], 12]]) must expand to the layer count:
    // the first `layers` types, one pair each.
    if (config.contains("attention_types") && config["attention_types"].is_array()) {
      nlohmann::json cut = nlohmann::json::array();
      for (const nlohmann::json& item : config["attention_types"]) {
        if (!item.is_array() || item.size() != 2 || !item[1].is_number_integer()) break;
        for (int64_t r = 0; r < item[1].get<int64_t>(); ++r) {
          for (const nlohmann::json& t : item[0]) {
            if (static_cast<int64_t>(cut.size()) < layers) cut.push_back({{t}, 1});
          }
        }
      }
      config["attention_types"] = cut;
    }
    if (config.value("model_type", "") == "t5") {
      config["num_layers"] = layers;
      config["num_decoder_layers"] = layers;
    }
  }
  // memplan.trace builds the model from the config (from_config), not from a checkpoint.
  BuildOptions options;
  options.from_config = true;
  MEMPLAN_ASSIGN_OR_RETURN(ModelInventory inv, InventoryFromHfConfig(config, rel, options));
  return inv;
}

// The grid's setup as TrainingSetup fields (docs/trace.md names the grid's values).
Result<TrainingSetup> Setup(const nlohmann::json& rec) {
  const nlohmann::json& j = rec.at("setup");
  TrainingSetup s;
  MEMPLAN_ASSIGN_OR_RETURN(s.framework, ParseFramework(j.at("framework").get<std::string>()));
  const std::string precision = j.at("precision").get<std::string>();
  if (precision == "bf16") {
    s.precision = Precision::kBf16Pure;
  } else if (precision == "fp32") {
    s.precision = Precision::kFp32;
  } else {
    // The frameworks' mixed precision is torch.autocast over fp32 parameters (HF Trainer's
    // bf16=True, Fabric's "bf16-mixed"), not DeepSpeed's 16-bit working copy.
    MEMPLAN_ASSIGN_OR_RETURN(s.precision, ParsePrecision(precision));
    s.autocast = true;
  }
  const std::string optimizer = j.at("optimizer").get<std::string>();
  if (optimizer == "adamw-fused") {
    s.optimizer = Optimizer::kAdamW;
    s.fused_optimizer = true;
  } else if (optimizer == "adamw-forloop") {
    s.optimizer = Optimizer::kAdamW;
    s.foreach = false;
  } else if (optimizer == "sgd-momentum") {
    s.optimizer = Optimizer::kSgd;
    s.sgd_momentum = 0.9;
  } else {
    MEMPLAN_ASSIGN_OR_RETURN(s.optimizer, ParseOptimizer(optimizer));
  }
  s.micro_batch = j.at("micro_batch").get<int64_t>();
  s.seq_len = j.at("seq_len").get<int64_t>();
  MEMPLAN_ASSIGN_OR_RETURN(s.checkpointing,
                           ParseCheckpointing(j.at("checkpointing").get<std::string>()));
  s.checkpoint_every = j.value("checkpoint_every", 1);
  MEMPLAN_ASSIGN_OR_RETURN(s.loss, ParseLoss(j.at("loss").get<std::string>()));
  // LitGPT's chunks are its own 128 positions (memplan.trace passes lm_head_chunk_size=128
  // whatever loss_chunks says).
  if (s.loss == Loss::kChunked && s.framework != Framework::kLitGpt && j.contains("loss_chunks") &&
      j["loss_chunks"].is_number()) {
    s.loss_chunks = j["loss_chunks"].get<int64_t>();
  }
  s.lora_rank = j.value("lora_rank", 0);
  if (j.contains("lora_targets") && j["lora_targets"].is_array()) {
    s.lora_targets = j["lora_targets"].get<std::vector<std::string>>();
  }
  s.qlora = j.value("qlora", false);
  s.flash_attention = j.value("attention", "sdpa") != "eager";
  const std::string gpu = j.value("gpu", "a100");
  static const std::map<std::string, std::string> kArch = {
      {"a100", "sm80"}, {"h100", "sm90"}, {"rtx4090", "sm89"}, {"v100", "sm70"}};
  if (rec.contains("gpu_arch") && rec["gpu_arch"].is_string()) {
    s.gpu_arch = rec["gpu_arch"].get<std::string>();
  } else if (kArch.count(gpu) > 0) {
    s.gpu_arch = kArch.at(gpu);
  }
  s.torch_compile = j.value("compile", false);
  // torchtitan shards with FSDP2 over its ranks (on one rank too); its mixed precision is
  // FSDP's policy (bf16 parameters gathered for compute), not autocast.
  if (s.framework == Framework::kTorchtitan) {
    s.autocast = false;
    s.fsdp = FsdpSharding::kFullShard;
    s.zero_stage = 3;
    s.gpus_per_node = std::max<int64_t>(j.value("ranks", 1), 1);
  }
  return s;
}

PointResult Check(const std::filesystem::path& root, const nlohmann::json& rec) {
  PointResult r;
  r.id = rec.value("id", "?");
  r.framework = rec.at("setup").value("framework", "?");
  Result<ModelInventory> inv = Inventory(root, rec);
  if (!inv.ok()) {
    r.error = inv.status().ToString();
    return r;
  }
  Result<TrainingSetup> setup = Setup(rec);
  if (!setup.ok()) {
    r.error = setup.status().ToString();
    return r;
  }
  Result<MemoryEstimate> m = EstimateMemory(*inv, *setup);
  if (!m.ok()) {
    r.error = m.status().ToString();
    return r;
  }
  const nlohmann::json& peak = rec.at("peak");
  const double traced = peak.at("bytes").get<double>();
  // The itemised model runs where the step model does not: it is what users get there.
  uint64_t itemised = 0;
  for (const PhaseTotals& t : m->phases) itemised = std::max(itemised, t.gpu_allocated_bytes);
  r.itemised_error = (static_cast<double>(itemised) - traced) / traced;
  r.has_itemised = true;
  if (!m->step.has_value()) {
    r.error = "step model: " + m->step_error;
    r.unmodelled = m->step_unmodelled;
    return r;
  }
  r.peak_error = (static_cast<double>(m->step->peak_bytes) - traced) / traced;
  const std::string phase = peak.at("phase").get<std::string>();
  const StepPhasePeak* at = nullptr;
  for (int p = 0; p < kStepPhases; ++p) {
    if (StepPhaseName(static_cast<StepPhase>(p)) == phase) {
      at = &m->step->phases[static_cast<size_t>(p)];
    }
  }
  if (at == nullptr) {
    r.error = "unknown phase " + phase;
    return r;
  }
  // Where each peak is: a category off by much while the peak is close is often the two peaks
  // falling at different moments of the phase.
  r.detail += "      traced peak at " + peak.value("op", std::string("?")) + " in " +
              (peak.contains("module") && peak.at("module").is_string()
                   ? peak.at("module").get<std::string>()
                   : std::string("?")) +
              "; predicted at " + at->where + "\n";
  // Each phase's peak, traced and predicted: where the peaks of a close total fall apart.
  if (rec.contains("phases") && rec["phases"].is_object()) {
    for (int p = 0; p < kStepPhases; ++p) {
      const std::string name(StepPhaseName(static_cast<StepPhase>(p)));
      if (!rec["phases"].contains(name)) continue;
      const double want = rec["phases"][name].value("peak_bytes", 0.0);
      const double got = static_cast<double>(m->step->phases[static_cast<size_t>(p)].bytes);
      r.phase_error = std::max(r.phase_error, std::fabs(got - want) / std::max(want, 1.0));
      char line[200];
      std::snprintf(line, sizeof line,
                    "      phase %-15s traced %14.0f predicted %14.0f (%+.2f%%) at %s\n",
                    name.c_str(), want, got, 100 * (got - want) / std::max(want, 1.0),
                    m->step->phases[static_cast<size_t>(p)].where.c_str());
      r.detail += line;
      // The categories at that phase's peak, where they differ.
      const nlohmann::json& cats = rec["phases"][name].contains("categories")
                                       ? rec["phases"][name]["categories"]
                                       : nlohmann::json::object();
      for (int c = 0; c < kStepCategories; ++c) {
        const std::string cname(StepCategoryName(static_cast<StepCategory>(c)));
        const double cw = cats.value(cname, 0.0);
        const double cg = static_cast<double>(
            m->step->phases[static_cast<size_t>(p)].categories[static_cast<size_t>(c)]);
        if (cw == cg) continue;
        std::snprintf(line, sizeof line, "        %-21s traced %14.0f predicted %14.0f\n",
                      cname.c_str(), cw, cg);
        r.detail += line;
      }
    }
  }
  for (int c = 0; c < kStepCategories; ++c) {
    const std::string name(StepCategoryName(static_cast<StepCategory>(c)));
    const double want = peak.at("categories").value(name, 0.0);
    const double got = static_cast<double>(at->categories[static_cast<size_t>(c)]);
    const double err = std::fabs(got - want) / std::max(want, 0.01 * traced);
    if (want != 0 || got != 0) {
      char line[160];
      std::snprintf(line, sizeof line, "      %-21s traced %14.0f predicted %14.0f (%+.2f%%)\n",
                    name.c_str(), want, got, 100 * (got - want) / std::max(want, 1.0));
      r.detail += line;
    }
    if (err > r.category_error) {
      r.category_error = err;
      r.worst_category = name;
    }
  }
  return r;
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

}  // namespace

int main(int argc, char** argv) {
  double peak_bound = 0.02, category_bound = 0.05;
  int show = 10;
  size_t max_beyond = 0;  // points allowed beyond their bounds (known, listed)
  bool detail = false, itemised = false, phases = false;
  std::map<std::string, std::pair<double, double>> framework_bounds;  // --bound FW=PEAK,CAT
  std::vector<std::string> files;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if ((a == "--peak-bound" || a == "--category-bound" || a == "--show" || a == "--max-beyond") &&
        i + 1 < argc) {
      const double v = std::atof(argv[++i]);
      if (a == "--peak-bound") peak_bound = v;
      if (a == "--category-bound") category_bound = v;
      if (a == "--show") show = static_cast<int>(v);
      if (a == "--max-beyond") max_beyond = static_cast<size_t>(std::max(0.0, v));
    } else if (a == "--bound" && i + 1 < argc) {
      const std::string v = argv[++i];
      const size_t eq = v.find('='), comma = v.find(',');
      if (eq == std::string::npos || comma == std::string::npos || comma < eq) {
        std::fprintf(stderr, "--bound: expected FRAMEWORK=PEAK,CATEGORY, got %s\n", v.c_str());
        return 2;
      }
      framework_bounds[v.substr(0, eq)] = {std::atof(v.substr(eq + 1, comma - eq - 1).c_str()),
                                           std::atof(v.substr(comma + 1).c_str())};
    } else if (a == "--detail") {
      detail = true;
    } else if (a == "--itemised") {
      itemised = true;
    } else if (a == "--phases") {
      phases = true;
    } else if (!a.empty() && a[0] == '-') {
      std::fprintf(stderr,
                   "usage: %s [--peak-bound F] [--category-bound F] [--bound FW=PEAK,CAT]... "
                   "[--show N] [--detail] [--itemised] [--phases] GRID.json...\n",
                   argv[0]);
      return 2;
    } else {
      files.push_back(a);
    }
  }
  std::vector<PointResult> results;
  int present = 0;
  for (const std::string& file : files) {
    if (!std::filesystem::exists(file)) {
      std::printf("%s: not present, skipped\n", file.c_str());
      continue;
    }
    ++present;
    Result<std::string> text = memplan::ReadFileToString(file);
    if (!text.ok()) {
      std::fprintf(stderr, "%s\n", text.status().ToString().c_str());
      return 2;
    }
    const nlohmann::json grid = nlohmann::json::parse(*text, nullptr, false);
    if (grid.is_discarded() || !grid.contains("records") || !grid["records"].is_array()) {
      std::fprintf(stderr, "%s: not a memplan-trace-grid file\n", file.c_str());
      return 2;
    }
    const std::filesystem::path root =
        std::filesystem::absolute(file).parent_path().parent_path().parent_path();
    for (const nlohmann::json& rec : grid["records"]) {
      try {
        results.push_back(Check(root, rec));
      } catch (const nlohmann::json::exception& e) {
        std::fprintf(stderr, "%s: malformed record: %s\n", file.c_str(), e.what());
        return 2;
      }
    }
  }
  if (present == 0) {
    std::printf("no grid file present: skipped\n");
    return 77;
  }
  std::map<std::string, std::vector<const PointResult*>> by_framework;
  for (const PointResult& r : results) by_framework[r.framework].push_back(&r);
  bool fail = false;
  std::printf("%-14s %6s %7s %12s %12s %14s %s\n", "framework", "points", "refused", "median|peak|",
              "worst|peak|", "worst category", "");
  for (const auto& [fw, rs] : by_framework) {
    std::vector<double> peaks;
    double worst_peak = 0, worst_cat = 0;
    std::string worst_cat_name;
    int refused = 0;
    for (const PointResult* r : rs) {
      if (!r->error.empty()) {
        ++refused;
        continue;
      }
      peaks.push_back(std::fabs(r->peak_error));
      worst_peak = std::max(worst_peak, std::fabs(r->peak_error));
      if (r->category_error > worst_cat) {
        worst_cat = r->category_error;
        worst_cat_name = r->worst_category;
      }
    }
    std::printf("%-14s %6zu %7d %11.2f%% %11.2f%% %13.2f%% %s\n", fw.c_str(), rs.size(), refused,
                100 * Median(peaks), 100 * worst_peak, 100 * worst_cat, worst_cat_name.c_str());
  }
  if (itemised) {
    // The itemised model (plan's and check's) against the same traces: signed errors.
    // Points the step model does not run are in it too (`unmod`): there the itemised model is
    // all an estimate has.
    std::printf("\nitemised model's allocated peak against the traces (signed):\n");
    std::printf("%-14s %6s %6s %10s %10s %10s %s\n", "framework", "points", "unmod", "median",
                "min", "max", "worst point");
    for (const auto& [fw, rs] : by_framework) {
      std::vector<double> errs;
      int unmod = 0;
      const PointResult* worst = nullptr;
      for (const PointResult* r : rs) {
        if (!r->has_itemised || (!r->error.empty() && !r->unmodelled)) continue;
        unmod += r->unmodelled;
        errs.push_back(r->itemised_error);
        if (worst == nullptr || std::fabs(r->itemised_error) > std::fabs(worst->itemised_error)) {
          worst = r;
        }
      }
      if (errs.empty()) continue;
      std::printf("%-14s %6zu %6d %9.2f%% %9.2f%% %9.2f%% %s\n", fw.c_str(), errs.size(), unmod,
                  100 * Median(errs), 100 * *std::min_element(errs.begin(), errs.end()),
                  100 * *std::max_element(errs.begin(), errs.end()), worst->id.c_str());
    }
  }
  std::vector<const PointResult*> bad;
  int unmodelled = 0;
  for (const PointResult& r : results) {
    if (r.unmodelled) {
      ++unmodelled;
      continue;
    }
    double pb = peak_bound, cb = category_bound;
    auto it = framework_bounds.find(r.framework);
    if (it != framework_bounds.end()) std::tie(pb, cb) = it->second;
    if (!r.error.empty() || std::fabs(r.peak_error) > pb || r.category_error > cb ||
        (phases && r.phase_error > pb)) {
      bad.push_back(&r);
    }
  }
  std::printf("%d points not modelled (the step model refuses the setup; counted as refused)\n",
              unmodelled);
  std::sort(bad.begin(), bad.end(), [](const PointResult* a, const PointResult* b) {
    const double ea = a->error.empty() ? std::fabs(a->peak_error) : 1e9;
    const double eb = b->error.empty() ? std::fabs(b->peak_error) : 1e9;
    return ea > eb;
  });
  std::printf("%zu of %zu points beyond peak %.1f%% / category %.1f%%", bad.size(), results.size(),
              100 * peak_bound, 100 * category_bound);
  for (const auto& [fw, b] : framework_bounds) {
    std::printf(" (%s: %.1f%% / %.1f%%)", fw.c_str(), 100 * b.first, 100 * b.second);
  }
  std::printf("\n");
  for (size_t i = 0; i < bad.size() && static_cast<int>(i) < show; ++i) {
    const PointResult& r = *bad[i];
    if (!r.error.empty()) {
      std::printf("  %s: refused: %s\n", r.id.c_str(), r.error.c_str());
    } else {
      std::printf("  %s: peak %+.2f%%, worst category %s %.2f%%", r.id.c_str(), 100 * r.peak_error,
                  r.worst_category.c_str(), 100 * r.category_error);
      if (phases) std::printf(", worst phase %.2f%%", 100 * r.phase_error);
      std::printf("\n");
      if (detail) std::printf("%s", r.detail.c_str());
    }
  }
  fail = bad.size() > max_beyond;
  if (!bad.empty() && !fail) {
    std::printf("(at most %zu allowed beyond: --max-beyond)\n", max_beyond);
  }
  return fail ? 1 : 0;
}
