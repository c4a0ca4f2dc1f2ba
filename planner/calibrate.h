// Calibration of the step-time model (step_time.h) from measured runs (`memplan calibrate`): the
// constants that differ most between clusters and software stacks are fitted by least squares to
// the step times users measured on their own machines, and `plan --calibration FILE` (and
// `capacity`) use them in place of the priors.
//
// Note [Calibration]
// The fitted constants (names as in the file and on the command line):
//   gemm_efficiency[GPU]  the GPU's sustained GEMM rate / peak at large micro-batch x sequence
//                          (GpuSpec::gemm_efficiency), one per GPU type among the runs;
//   gemm_tokens_half      the micro-batch x sequence at which GEMMs reach half of it
//                          (TimeConstants::gemm_tokens_half): compute efficiency against
//                          micro-batch and sequence;
//   link_efficiency[GPU]  NCCL bus bandwidth / GPU link peak, per GPU type (each has its own
//                          interconnect: NVLink generations, NVSwitch or not, PCIe);
//   network_efficiency    NCCL bus bandwidth / node network (runs on several nodes only);
//   offload_overlap       the fraction of overlappable offload time that overlaps;
//   cpu_adam_factor       the CPU optimizer's speed over the node's rate (bench adam or the
//                          prior; runs that offload the optimizer only).
// Every run is predicted by PredictStepTime with the run's own model, cluster and configuration;
// the residual of a run is predicted / measured - 1 (relative, so that a 20 s step and a 0.2 s step
// count alike). The fit is maximum a posteriori: first the sum of squared residuals alone, whose
// scatter gives the measurement noise s (at least 0.2%); then the residuals / s together with
// each constant's distance from its prior / the prior's width (30% of an efficiency, 0.3 of the
// overlap, 50% of the CPU Adam factor, 1000 tokens for gemm_tokens_half), so that precise runs move
// a constant wherever they pin it and a handful of noisy ones move it only as far as they justify.
// Both are minimised by Levenberg-Marquardt (Eigen's dense solvers for each step, the
// Jacobian by finite differences of the model itself: the exposed-time terms are piecewise linear,
// so the model is used as it is, not a linearisation of it). Bounds: efficiencies in [0.01, 1],
// overlap in [0, 1], CPU Adam factor in [0.05, 5], gemm_tokens_half in [0, 1e6].
// Which constants are fitted: those the runs touch at all (link_efficiency needs runs on several
// GPUs of that type, network_efficiency runs across nodes, offload_overlap and cpu_adam_factor
// runs that offload), fewer runs than those being an error. Standard errors come from the
// curvature of the objective at the solution; a constant whose standard error stays above 25% of
// its value (of 1000 tokens for gemm_tokens_half) is not determined after all: the least certain
// one goes back to its prior and the rest are fitted again. The reason given is the kind of run
// that would determine it, or, when its Jacobian column (normalised, in the order above) adds no
// rank to those before it, that the runs cannot tell it from the other constants (for
// gemm_tokens_half: every run has the same micro-batch x sequence). Constants asked for by name
// (CalibrateOptions::constants) are kept whatever their standard error; one the runs do not touch
// is an error.
//
// Note [Calibration bounds]
// A fit can only move constants within the model; runs the model cannot describe (step times in
// the wrong unit, a run whose file says a cluster or setup other than what ran) still get "best"
// constants, and those would then mislead every plan. So a fit is judged by how well it explains
// its runs, and never written silently when it does not:
//   - the calibrated RMS error above CalibrateOptions::max_rms_error (50% by default; `calibrate
//     --max-error`) is an error: nothing is written;
//   - a constant pinned at a bound (moved there by the fit, or starting there with the runs'
//     optimum past it by more than a standard error) and a run the calibrated model still
//     misses by more than max_rms_error are warnings: `calibrate` prints them and writes them
//     into the file, and `plan` and `capacity` repeat them (derived again from the file's
//     constants and report by CalibrationFromJson, so an older file or an edited one warns too).
//
// Thread safety: pure functions over plain values.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/status.h"
#include "estimator/inventory.h"
#include "estimator/training_setup.h"
#include "planner/cluster.h"
#include "planner/search.h"
#include "planner/step_time.h"

namespace memplan::planner {

// One measured run: what ran where, and how long its optimizer steps took.
struct MeasuredRun {
  std::string id;
  std::string model;               // as --model takes it (built-in name, config.json, repo id)
  bool base_class = false;         // "model_class": "base" (AutoModel), else the architectures'
  Cluster cluster;                 // GPU, nodes, GPUs per node, network, RAM, NVMe
  estimator::TrainingSetup setup;  // precision, optimizer, stage, offload, checkpointing,
                                   // micro_batch, grad_accum, seq_len, pin_memory, ...
  Sharding sharding = Sharding::kFull;
  double step_time_s = 0;  // measured seconds per optimizer step (> 0)
  std::string source;      // who measured it, how (free text)
};

// The runs file, format "memplan.runs/1":
//   {"format": "memplan.runs/1", "runs": [{"id", "model", "model_class": "auto" | "base",
//     "cluster": {plan's --cluster form},
//     "setup": {estimate's "setup" form}, "sharding": "full" | "hybrid", "step_time_s",
//     "source", "environment": {...}}]}
// ("environment" is free-form and ignored). Errors name `source`, the run and the key: a missing
// or non-positive or non-finite step time, an unknown GPU, an unknown key, a setup the estimator
// refuses.
Result<std::vector<MeasuredRun>> RunsFromJson(const nlohmann::json& json,
                                              const std::string& source);
nlohmann::json ToJson(const MeasuredRun& run);

// A run with its model, for Calibrate.
struct CalibrationRun {
  MeasuredRun run;
  const estimator::ModelInventory* inventory = nullptr;  // not owned; outlives Calibrate
};

constexpr double kDefaultMaxRmsError = 0.5;

struct CalibrateOptions {
  // The constants to fit, by name (Note [Calibration]; "gemm_efficiency" means every GPU's,
  // "gemm_efficiency[a100-80]" one GPU's);
  // empty: every constant the runs determine.
  std::vector<std::string> constants;
  int max_iterations = 200;
  // Note [Calibration bounds]: the largest calibrated RMS of predicted / measured - 1 accepted.
  double max_rms_error = kDefaultMaxRmsError;
  // The start and the priors of what is not fitted.
  TimeConstants start = DefaultTimeConstants();
};

struct FittedConstant {
  std::string name;           // "gemm_efficiency[a100-80]", "link_efficiency", ...
  double prior = 0;           // the value before the fit
  double value = 0;           // fitted
  double standard_error = 0;  // 0 when the runs leave no degrees of freedom
  bool at_bound = false;      // the fit stopped at a bound of Note [Calibration]
};

struct RunResidual {
  std::string id;
  double measured_s = 0;
  double prior_s = 0;   // predicted with the priors
  double fitted_s = 0;  // predicted with the fitted constants
};

struct Calibration {
  TimeConstants constants = DefaultTimeConstants();  // fitted values in place of priors
  std::map<std::string, double> gemm_efficiency;     // fitted, per GPU name
  std::map<std::string, double> link_efficiency;     // fitted, per GPU name
  std::vector<FittedConstant> fitted;
  std::vector<std::string> not_determined;  // "network_efficiency: no run spans nodes"
  std::vector<RunResidual> runs;
  double rms_error_prior = 0;  // root mean square of predicted / measured - 1, priors
  double rms_error_fitted = 0;
  double max_rms_error = kDefaultMaxRmsError;  // the bound the fit was accepted under
  // Note [Calibration bounds]: constants pinned at a bound, runs still missed (one line each).
  std::vector<std::string> warnings;
  int iterations = 0;
  std::string source;  // the file it was read from (CalibrationFromJson), for notes
};

// The names of Note [Calibration]'s constants, as `constants` takes them: "gemm_efficiency,
// gemm_tokens_half, link_efficiency, ...".
std::string CalibratedConstantNames();

// Runs Note [Calibration]. Errors: no runs, fewer runs than constants to fit, a named constant
// the runs do not determine or that does not exist, a run the time model cannot take (its model
// lacks the architecture), a fit that does not converge to finite values.
Result<Calibration> Calibrate(const std::vector<CalibrationRun>& runs,
                              const CalibrateOptions& options = {});

// The calibration file, format "memplan.calibration/1": {"format", "constants": {name: value},
// "gpus": {name: {"gemm_efficiency": v, "link_efficiency": v}}, "fitted": [{"name", "prior",
// "value", "standard_error", "at_bound"}], "not_determined": [...], "runs": [{"id", "measured_s",
// "prior_s", "fitted_s"}], "rms_error": {"prior", "fitted"}, "max_rms_error", "warnings": [...],
// "iterations"}. FromJson reads "constants" (network_efficiency, offload_overlap,
// cpu_adam_factor, gemm_tokens_half, and a link_efficiency for every GPU) and "gpus"
// (gemm_efficiency, link_efficiency); the report keys are accepted as they are, and "fitted",
// "runs" and "rms_error" give the warnings of Note [Calibration bounds] again (a constant at a
// bound that the file has no report for counts as pinned unless it is the prior); unknown keys,
// values outside the bounds, GPU names with control characters and a wrong format are errors
// naming `source` and the key.
nlohmann::json ToJson(const Calibration& calibration);
Result<Calibration> CalibrationFromJson(const nlohmann::json& json, const std::string& source);
// Note [Calibration bounds]'s warnings for `calibration`: its pinned constants and the runs it
// misses by more than kDefaultMaxRmsError, and its RMS error when above that.
std::vector<std::string> CalibrationWarnings(const Calibration& calibration);
// What `memplan calibrate` prints: the constants with priors and standard errors, what was not
// determined and why, each run measured / prior / fitted, and the warnings.
std::string FormatCalibrationText(const Calibration& calibration);

// Applies `calibration` to a search: its TimeConstants into `options` (with a note for the
// assumptions, its warnings included; link_efficiency the one fitted for `gpu` when there is
// one), and `gpu`'s gemm_efficiency when the calibration has one for its name. Either pointer may
// be null; with several GPU types, call it once per GPU with its own options.
void ApplyCalibration(const Calibration& calibration, GpuSpec* gpu, SearchOptions* options);

}  // namespace memplan::planner
