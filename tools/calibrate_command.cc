// `memplan calibrate runs.json`: the step-time model's constants fitted to measured runs
// (planner/calibrate.h), written as a calibration file that `plan` and `capacity` take with
// --calibration.
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/file.h"
#include "common/json.h"
#include "common/printable.h"
#include "estimator/model_source.h"
#include "planner/calibrate.h"
#include "tools/calibration_flags.h"
#include "tools/commands.h"

namespace memplan::tools {

Result<planner::Calibration> ReadCalibrationFile(const std::string& path) {
  MEMPLAN_ASSIGN_OR_RETURN(std::string text, ReadFileToString(path, uint64_t{1} << 24));
  MEMPLAN_ASSIGN_OR_RETURN(nlohmann::json j, ParseJson(text, path));
  return planner::CalibrationFromJson(j, path);
}

std::string CalibrationWarningLines(const planner::Calibration& calibration,
                                    const std::string& path) {
  std::string out;
  for (const std::string& w : calibration.warnings) {
    out += "warning: --calibration " + Printable(path) + ": " + w + "\n";
  }
  return out;
}

namespace {

struct CalibrateFlags {
  std::string runs_file;
  std::string output;
  std::vector<std::string> constants;
  double max_error_percent = planner::kDefaultMaxRmsError * 100;
  std::string format = "text";
  ModelSourceFlags source;
};

void RunCalibrate(const CalibrateFlags& f, Outcome* outcome) {
  auto fail = [&](const Status& s) { Fail(outcome, s); };
  auto text = ReadFileToString(f.runs_file, uint64_t{1} << 26);
  if (!text.ok()) return fail(text.status());
  auto json = ParseJson(*text, f.runs_file);
  if (!json.ok()) return fail(json.status());
  auto runs = planner::RunsFromJson(*json, f.runs_file);
  if (!runs.ok()) return fail(runs.status());
  // Each model once; the inventories outlive the fit.
  std::map<std::string, std::unique_ptr<estimator::ModelInventory>> models;
  std::vector<planner::CalibrationRun> inputs;
  for (const planner::MeasuredRun& run : *runs) {
    auto& slot = models[(run.base_class ? "base:" : "auto:") + run.model];
    if (!slot) {
      auto inventory =
          LoadModelForCli(run.model,
                          run.base_class ? estimator::ModelClassChoice::kBase
                                         : estimator::ModelClassChoice::kFromArchitectures,
                          f.source);
      if (!inventory.ok()) {
        return fail(inventory.status().WithPrefix(f.runs_file + ": run '" + run.id + "'"));
      }
      if (!inventory->arch) {
        return fail(Status::InvalidArgument(f.runs_file + ": run '" + run.id + "': model " +
                                            run.model +
                                            " has no architecture (give a config.json)"));
      }
      slot = std::make_unique<estimator::ModelInventory>(std::move(*inventory));
    }
    inputs.push_back({run, slot.get()});
  }
  planner::CalibrateOptions options;
  options.constants = f.constants;
  options.max_rms_error = f.max_error_percent / 100;
  auto calibration = planner::Calibrate(inputs, options);
  if (!calibration.ok()) return fail(calibration.status().WithPrefix(f.runs_file));
  const std::string file = JsonOutput(planner::ToJson(*calibration));
  std::string report = f.format == "json" ? file : planner::FormatCalibrationText(*calibration);
  if (!f.output.empty()) {
    outcome->files.push_back({f.output, file});
    if (f.format != "json") {
      report +=
          "\nwrote " + f.output + " (use it with `memplan plan --calibration " + f.output + "`)\n";
    }
  }
  outcome->stdout_text = report;
}

}  // namespace

void RegisterCalibrate(CLI::App& app, Outcome* outcome) {
  auto f = std::make_shared<CalibrateFlags>();
  CLI::App* cmd = app.add_subcommand(
      "calibrate",
      "Fit the step-time model's constants (GEMM efficiency against micro-batch x sequence, link "
      "and network efficiency, offload overlap, CPU optimizer speed) to measured step times by "
      "least squares");
  cmd->add_option("runs", f->runs_file,
                  "Measured runs, format memplan.runs/1 (README; bench/measure_peak.py --runs "
                  "writes it)")
      ->required();
  cmd->add_option("-o,--output", f->output,
                  "Write the calibration file here (atomically) for `plan --calibration` and "
                  "`capacity --calibration`");
  cmd->add_option("--constants", f->constants,
                  "Fit only these (comma-separated): " + planner::CalibratedConstantNames() +
                      "; default: every one the runs determine precisely")
      ->delimiter(',');
  cmd->add_option("--max-error", f->max_error_percent,
                  "Refuse the fit (exit 2, nothing written) when the calibrated model still misses "
                  "the runs by more than this RMS error, in percent; constants pinned at a bound "
                  "and runs missed by more than 50% are written with warnings that plan and "
                  "capacity repeat")
      ->check(CLI::Range(0.1, 1e6))
      ->capture_default_str();
  AddFormatOption(cmd, &f->format, "text (a report) or json (the calibration file's contents)");
  f->source.Add(cmd);
  cmd->footer(
      "\nExamples:\n"
      "  memplan calibrate runs.json -o calibration.json\n"
      "  memplan plan --model llama-2-7b --gpu a100-80 --gpus 8 --global-batch 64 --calibration "
      "calibration.json\n"
      "\nA run needs the model, the cluster, the setup it ran (stage, offload, checkpointing, "
      "micro-batch, accumulation, sequence) and its measured seconds per optimizer step. "
      "Constants the runs cannot determine (no multi-node run: network_efficiency) keep their "
      "priors and the report says why. A fit that does not explain its runs (calibrated RMS "
      "error above --max-error) is refused; a constant pinned at a bound is written with a "
      "warning. Exit status: 0 on success, 2 on bad input or data that cannot determine the "
      "constants or that the model cannot explain.");
  cmd->callback([f, outcome] { RunCalibrate(*f, outcome); });
}

}  // namespace memplan::tools
