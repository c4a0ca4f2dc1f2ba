#include "planner/calibrate.h"

#include <Eigen/Dense>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <set>

#include "common/json.h"
#include "common/strings.h"
#include "common/printable.h"

namespace memplan::planner {
namespace {

using estimator::TrainingSetup;

constexpr const char* kRunsFormat = "memplan.runs/1";
constexpr const char* kCalibrationFormat = "memplan.calibration/1";

// Note [Calibration]'s constants: the one table every use reads (the candidates of a fit, where a
// value lives in the model, its bounds and prior width, the file's keys, why runs leave it
// undetermined, the lists users read). In priority order: the fit's, the file's "fitted" list's.
struct ConstantSpec {
  const char* name;
  double TimeConstants::*constant;  // where it lives in TimeConstants; nullptr: in GpuSpec
  double GpuSpec::*gpu_constant;    // where it lives in the GPU's spec; nullptr: above
  // One per GPU type: the fitted values by GPU name ("gemm_efficiency[a100-80]", the file's
  // "gpus" entries); nullptr: one for all (the file's "constants").
  std::map<std::string, double> Calibration::*per_gpu;
  double lo, hi;          // bounds
  double scale;           // the fit works in value / scale
  double prior_width;     // the prior's width; 0: 30% of the prior (at least of 0.05)
  double error_floor;     // a standard error is relative to max(|value|, this)
  int listed;             // position in the lists users read (--help, errors)
  const char* untouched;  // why, when no run's time depends on it
  const char* collinear;  // why, when the runs cannot tell it from those before it; null: generic
};

const ConstantSpec kConstants[] = {
    {"gemm_efficiency", nullptr, &GpuSpec::gemm_efficiency, &Calibration::gemm_efficiency, 0.01,
     1.0, 1, 0, 1e-9, 0, "no run's time depends on it", nullptr},
    {"link_efficiency", &TimeConstants::link_efficiency, nullptr, &Calibration::link_efficiency,
     0.01, 1.0, 1, 0, 1e-9, 2, "no run has more than one GPU", nullptr},
    {"network_efficiency", &TimeConstants::network_efficiency, nullptr, nullptr, 0.01, 1.0, 1, 0,
     1e-9, 3, "no run spans nodes", nullptr},
    {"offload_overlap", &TimeConstants::offload_overlap, nullptr, nullptr, 0.0, 1.0, 1, 0.3, 1e-9,
     4, "no run offloads (or its offload time has nothing to overlap)", nullptr},
    {"cpu_adam_factor", &TimeConstants::cpu_adam_factor, nullptr, nullptr, 0.05, 5.0, 1, 0.5, 1e-9,
     5, "no run offloads the optimizer", nullptr},
    {"gemm_tokens_half", &TimeConstants::gemm_tokens_half, nullptr, nullptr, 0.0, 1e6, 1000, 1000,
     1000, 1, "no run's GEMMs are compute-bound",
     "every run has the same micro-batch x sequence per GPU, which cannot tell it from "
     "gemm_efficiency (measure two or more sizes)"},
};

// The table's entry for `name`, a constant ("link_efficiency") or one GPU's ("...[a100-80]").
const ConstantSpec* FindConstant(const std::string& name) {
  const std::string base = name.substr(0, name.find('['));
  for (const ConstantSpec& spec : kConstants) {
    if (base == spec.name) return &spec;
  }
  return nullptr;
}

// Where `spec`'s value lives for a run on `gpu` with constants `k`.
double& Slot(const ConstantSpec& spec, TimeConstants& k, GpuSpec& gpu) {
  return spec.gpu_constant != nullptr ? gpu.*spec.gpu_constant : k.*spec.constant;
}

// One fitted quantity: a constant, for one GPU (per-GPU constants) or for all.
struct Parameter {
  std::string name;  // "gemm_efficiency[a100-80]", "network_efficiency", ...
  const ConstantSpec* spec = nullptr;
  std::string gpu;  // per-GPU constants: the GPU it belongs to
  double scale() const { return spec->scale; }
  double lo() const { return spec->lo; }
  double hi() const { return spec->hi; }
};

// The constants of Note [Calibration], in priority order, for the runs' GPUs.
std::vector<Parameter> Candidates(const std::vector<CalibrationRun>& runs) {
  std::vector<Parameter> out;
  std::vector<std::string> gpus;
  for (const CalibrationRun& r : runs) {
    if (std::find(gpus.begin(), gpus.end(), r.run.cluster.gpu.name) == gpus.end()) {
      gpus.push_back(r.run.cluster.gpu.name);
    }
  }
  for (const ConstantSpec& spec : kConstants) {
    if (spec.per_gpu == nullptr) {
      out.push_back({spec.name, &spec, ""});
      continue;
    }
    for (const std::string& g : gpus) out.push_back({spec.name + ("[" + g + "]"), &spec, g});
  }
  return out;
}

// The constants with `values` (one per parameter) in place.
struct Model {
  const std::vector<CalibrationRun>* runs;
  std::vector<ModelShape> shapes;
  std::vector<Parameter> params;
  TimeConstants base;

  // Predicted step time of run `i` with parameter values `v`.
  double Predict(size_t i, const Eigen::VectorXd& v) const {
    const CalibrationRun& r = (*runs)[i];
    Cluster c = r.run.cluster;
    TimeConstants k = base;
    for (size_t j = 0; j < params.size(); ++j) {
      const Parameter& p = params[j];
      if (!p.gpu.empty() && p.gpu != c.gpu.name) continue;
      Slot(*p.spec, k, c.gpu) = v[static_cast<Eigen::Index>(j)];
    }
    const TrainingSetup& s = r.run.setup;
    const int64_t batch = s.micro_batch * s.grad_accum * c.WorldSize();
    return PredictStepTime(shapes[i], c, s, batch, s.pin_memory, r.run.sharding, k).total_s;
  }

  Eigen::VectorXd Residuals(const Eigen::VectorXd& v) const {
    Eigen::VectorXd r(static_cast<Eigen::Index>(runs->size()));
    for (size_t i = 0; i < runs->size(); ++i) {
      r[static_cast<Eigen::Index>(i)] = Predict(i, v) / (*runs)[i].run.step_time_s - 1;
    }
    return r;
  }

  // d residual / d (value / scale), by central differences (one-sided at a bound).
  Eigen::MatrixXd Jacobian(const Eigen::VectorXd& v) const {
    const auto n = static_cast<Eigen::Index>(runs->size());
    const auto m = static_cast<Eigen::Index>(params.size());
    Eigen::MatrixXd j(n, m);
    for (Eigen::Index c = 0; c < m; ++c) {
      const Parameter& p = params[static_cast<size_t>(c)];
      const double h = 1e-4 * p.scale();
      Eigen::VectorXd up = v, down = v;
      up[c] = std::min(p.hi(), v[c] + h);
      down[c] = std::max(p.lo(), v[c] - h);
      const double span = (up[c] - down[c]) / p.scale();
      const Eigen::VectorXd d = (Residuals(up) - Residuals(down)) / span;
      j.col(c) = d;
    }
    return j;
  }
};

// One run of a memplan.runs/1 file, the index-th of its list.
Result<MeasuredRun> RunFromJson(const nlohmann::json& r, const std::string& source, size_t index) {
  using F = JsonFieldReader;
  MeasuredRun run;
  run.id = "run " + std::to_string(index + 1);
  const JsonFieldReader at_index(r, source, "runs[" + std::to_string(index) + "].");
  MEMPLAN_RETURN_IF_ERROR(at_index.CheckKeys({"id", "environment", "model", "source", "cluster",
                                              "setup", "model_class", "sharding", "step_time_s"}));
  MEMPLAN_RETURN_IF_ERROR(at_index.Name("id", &run.id));
  if (run.id.empty()) return at_index.Error("id", "must be a non-empty string");
  // From here on errors name the run by its id, as a user finds it in the file.
  const JsonFieldReader f(r, source + ": run '" + run.id + "'");
  std::string model_class = "auto", sharding = "full";
  MEMPLAN_RETURN_IF_ERROR(f.Require("model"));
  MEMPLAN_RETURN_IF_ERROR(f.Name("model", &run.model));
  MEMPLAN_RETURN_IF_ERROR(f.GetAll(F::Field("source", &run.source),
                                   F::Field("model_class", &model_class),
                                   F::Field("sharding", &sharding)));
  if (model_class != "auto" && model_class != "base") {
    return f.Error("model_class", "must be \"auto\" or \"base\"");
  }
  run.base_class = model_class == "base";
  if (sharding != "full" && sharding != "hybrid") {
    return f.Error("sharding", "must be \"full\" or \"hybrid\"");
  }
  run.sharding = sharding == "hybrid" ? Sharding::kHybrid : Sharding::kFull;
  if (!f.Has("step_time_s")) {
    return f.Error("step_time_s", "is missing (measured seconds per optimizer step)");
  }
  MEMPLAN_RETURN_IF_ERROR(f.Number("step_time_s", &run.step_time_s));
  if (!std::isfinite(run.step_time_s) || !(run.step_time_s > 0)) {
    return f.Error("step_time_s",
                   "must be a finite number > 0, got " + JsonFieldReader::Got(r.at("step_time_s")));
  }
  MEMPLAN_RETURN_IF_ERROR(f.Require("cluster"));
  MEMPLAN_RETURN_IF_ERROR(f.Require("setup"));
  auto cluster = ClusterFromJson(r.at("cluster"), "cluster");
  if (!cluster.ok()) return cluster.status().WithPrefix(source + ": run '" + run.id + "'");
  run.cluster = *cluster;
  auto setup = estimator::TrainingSetupFromJson(r.at("setup"));
  if (!setup.ok()) return setup.status().WithPrefix(source + ": run '" + run.id + "'");
  run.setup = *setup;
  run.setup.gpus_per_node = run.cluster.gpus_per_node;
  run.setup.num_nodes = run.cluster.nodes;
  if (Status valid = run.setup.Validate(); !valid.ok()) {
    return valid.WithPrefix(source + ": run '" + run.id + "'");
  }
  return run;
}

}  // namespace

Result<std::vector<MeasuredRun>> RunsFromJson(const nlohmann::json& json,
                                              const std::string& source) {
  const JsonFieldReader top(json, source);
  MEMPLAN_RETURN_IF_ERROR(top.CheckKeys({"format", "runs", "about"}));
  std::string format;
  MEMPLAN_RETURN_IF_ERROR(top.Required("format", &format));
  if (format != kRunsFormat) {
    return top.Error("format", std::string("must be \"") + kRunsFormat +
                                   "\" (the file `bench/measure_peak.py --runs` writes)");
  }
  MEMPLAN_RETURN_IF_ERROR(top.Require("runs"));
  const nlohmann::json& list = json.at("runs");
  if (!list.is_array()) return top.Error("runs", "must be a list of measured runs");
  if (list.size() > 10000) return top.Error("runs", "holds more than 10000 runs");
  std::vector<MeasuredRun> runs;
  std::set<std::string> ids;
  for (size_t i = 0; i < list.size(); ++i) {
    MEMPLAN_ASSIGN_OR_RETURN(MeasuredRun run, RunFromJson(list[i], source, i));
    if (!ids.insert(run.id).second) {
      return Status::InvalidArgument(source + ": run '" + run.id + "': the id is used twice");
    }
    runs.push_back(std::move(run));
  }
  return runs;
}

nlohmann::json ToJson(const MeasuredRun& run) {
  return {{"id", run.id},
          {"model", run.model},
          {"model_class", run.base_class ? "base" : "auto"},
          {"cluster", ToJson(run.cluster)},
          {"setup", estimator::ToJson(run.setup)},
          {"sharding", run.sharding == Sharding::kHybrid ? "hybrid" : "full"},
          {"step_time_s", run.step_time_s},
          {"source", run.source}};
}

namespace {

bool AskedFor(const Parameter& p, const std::set<std::string>& asked) {
  return asked.count(p.spec->name) > 0 || asked.count(p.name) > 0;
}

// The candidates, as `constants` asks for them (all when empty); an unknown name is an error.
Result<std::vector<Parameter>> AskedCandidates(const std::vector<CalibrationRun>& runs,
                                               const std::set<std::string>& asked) {
  std::vector<Parameter> candidates = Candidates(runs);
  if (asked.empty()) return candidates;
  std::set<std::string> known;
  for (const ConstantSpec& spec : kConstants) known.insert(spec.name);
  for (const Parameter& p : candidates) known.insert(p.name);  // one GPU's: "...[a100-80]"
  for (const std::string& name : asked) {
    if (known.count(name) == 0) {
      return Status::InvalidArgument("`constants` " + name + ": not a calibrated constant (" +
                                     CalibratedConstantNames() + ")");
    }
  }
  std::vector<Parameter> kept;
  for (const Parameter& p : candidates) {
    if (AskedFor(p, asked)) kept.push_back(p);
  }
  return kept;
}

// The candidates' values at their priors: a GPU's own gemm_efficiency, else `start`'s.
Eigen::VectorXd Priors(const std::vector<Parameter>& candidates,
                       const std::vector<CalibrationRun>& runs, const TimeConstants& start) {
  Eigen::VectorXd v(static_cast<Eigen::Index>(candidates.size()));
  for (size_t j = 0; j < candidates.size(); ++j) {
    const Parameter& p = candidates[j];
    TimeConstants k = start;
    GpuSpec gpu;
    for (const CalibrationRun& r : runs) {
      if (p.spec->gpu_constant != nullptr && r.run.cluster.gpu.name == p.gpu) {
        gpu = r.run.cluster.gpu;
        break;
      }
    }
    v[static_cast<Eigen::Index>(j)] = std::clamp(Slot(*p.spec, k, gpu), p.lo(), p.hi());
  }
  return v;
}

// Why the runs leave `p` undetermined: no run's time depends on it (`touched` false), or they
// cannot tell it from the constants before it.
std::string WhyNot(const Parameter& p, bool touched) {
  if (!touched) return p.name + ": " + p.spec->untouched;
  if (p.spec->collinear != nullptr) return p.name + ": " + p.spec->collinear;
  return p.name + ": the runs cannot tell it from the other constants";
}

// Which candidates the runs touch at all (kept; the others are not determined, an error when
// asked for by name); of those, which ones the runs cannot tell from the candidates before them
// (the normalised Jacobian columns at the priors, in priority order, do not raise the rank):
// these are fitted all the same, since the priors make the fit well posed, and when one of them
// turns out too uncertain, that is the reason given.
struct Screened {
  std::vector<size_t> kept;
  std::vector<bool> collinear;  // per candidate
};
Result<Screened> Screen(const Model& model, const std::vector<Parameter>& candidates,
                        const Eigen::VectorXd& v, const std::set<std::string>& asked,
                        std::vector<std::string>* not_determined) {
  const Eigen::MatrixXd j0 = model.Jacobian(v);
  const double column_floor = 1e-6;
  Screened out;
  out.collinear.assign(candidates.size(), false);
  std::vector<size_t> independent;
  for (size_t c = 0; c < candidates.size(); ++c) {
    const Eigen::VectorXd col = j0.col(static_cast<Eigen::Index>(c));
    const bool touched = col.norm() > column_floor;
    if (touched && static_cast<Eigen::Index>(independent.size() + 1) <= j0.rows()) {
      Eigen::MatrixXd sub(j0.rows(), static_cast<Eigen::Index>(independent.size() + 1));
      for (size_t k = 0; k < independent.size(); ++k) {
        const Eigen::VectorXd kc = j0.col(static_cast<Eigen::Index>(independent[k]));
        sub.col(static_cast<Eigen::Index>(k)) = kc / kc.norm();
      }
      sub.col(static_cast<Eigen::Index>(independent.size())) = col / col.norm();
      Eigen::JacobiSVD<Eigen::MatrixXd> svd(sub);
      const Eigen::VectorXd sv = svd.singularValues();
      out.collinear[c] = !(sv[sv.size() - 1] > 1e-3 * sv[0]);
      if (!out.collinear[c]) independent.push_back(c);
    }
    const Parameter& p = candidates[c];
    if (touched) {
      out.kept.push_back(c);
    } else if (AskedFor(p, asked)) {
      return Status::InvalidArgument("`constants`: cannot fit " + WhyNot(p, touched));
    } else {
      not_determined->push_back(WhyNot(p, touched));
    }
  }
  return out;
}

// One maximum a posteriori fit of `params` (Note [Calibration]): the values, their standard
// errors, which are pinned at a bound, the data's cost.
struct Fitted {
  std::vector<Parameter> params;
  Eigen::VectorXd x, x_prior, se;
  std::vector<bool> pinned;  // at a bound that the objective pushes it past
  double cost = 0;
};

// Levenberg-Marquardt over `params`, in value / scale units, against the data residuals / noise
// and, with the prior, (x - prior) / width.
class MapFit {
 public:
  MapFit(const Model& model, const std::vector<Parameter>& params, const Eigen::VectorXd& prior)
      : model_(model), params_(params), prior_(prior) {
    scales_.resize(prior.size());
    widths_.resize(prior.size());
    for (Eigen::Index k = 0; k < prior.size(); ++k) {
      const ConstantSpec& spec = *params[static_cast<size_t>(k)].spec;
      scales_[k] = spec.scale;
      widths_[k] = spec.prior_width > 0 ? spec.prior_width : 0.3 * std::max(prior[k], 0.05);
    }
  }
  const Eigen::VectorXd& scales() const { return scales_; }

  Eigen::VectorXd Residuals(const Eigen::VectorXd& y, double noise, bool with_prior) const {
    const Eigen::VectorXd rd = model_.Residuals(y) / noise;
    if (!with_prior) return rd;
    Eigen::VectorXd out(rd.size() + y.size());
    out << rd, (y - prior_).cwiseQuotient(widths_);
    return out;
  }
  Eigen::MatrixXd Jacobian(const Eigen::VectorXd& y, double noise, bool with_prior) const {
    const Eigen::MatrixXd jd = model_.Jacobian(y) / noise;
    if (!with_prior) return jd;
    Eigen::MatrixXd out(jd.rows() + y.size(), y.size());
    out << jd, Eigen::MatrixXd(scales_.cwiseQuotient(widths_).asDiagonal());
    return out;
  }

  // Minimises from `x` in place; returns the iterations taken.
  int Minimise(Eigen::VectorXd* x, double noise, bool with_prior, int max_iterations) const {
    Eigen::VectorXd r = Residuals(*x, noise, with_prior);
    double c = r.squaredNorm();
    double lambda = 1e-3;
    int it = 0;
    for (; it < max_iterations; ++it) {
      const Eigen::MatrixXd j = Jacobian(*x, noise, with_prior);
      Eigen::MatrixXd a = j.transpose() * j;
      Eigen::VectorXd g = j.transpose() * r;
      // A constant at a bound that the descent pushes further out stays there this step (an
      // active set), so the others are not dragged along a clamped direction.
      for (Eigen::Index k = 0; k < x->size(); ++k) {
        const Parameter& p = params_[static_cast<size_t>(k)];
        if (((*x)[k] <= p.lo() && g[k] > 0) || ((*x)[k] >= p.hi() && g[k] < 0)) {
          a.row(k).setZero();
          a.col(k).setZero();
          a(k, k) = 1;
          g[k] = 0;
        }
      }
      bool improved = false;
      double gain = 0, moved = 0;
      for (int tries = 0; tries < 40 && !improved; ++tries) {
        Eigen::MatrixXd damped = a;
        for (Eigen::Index k = 0; k < a.rows(); ++k) {
          damped(k, k) += lambda * std::max(a(k, k), 1e-12);
        }
        const Eigen::VectorXd step = damped.ldlt().solve(-g);
        const Eigen::VectorXd candidate = Clamp(*x + step.cwiseProduct(scales_));
        const Eigen::VectorXd rc = Residuals(candidate, noise, with_prior);
        const double c2 = rc.squaredNorm();
        if (std::isfinite(c2) && c2 < c) {
          gain = c - c2;
          moved = (candidate - *x).cwiseQuotient(scales_).norm();
          *x = candidate;
          r = rc;
          c = c2;
          lambda = std::max(lambda / 3, 1e-9);
          improved = true;
        } else {
          lambda *= 4;
        }
      }
      // Converged: no step lowers the cost, or the last one barely did or barely moved.
      if (!improved || gain <= 1e-10 * std::max(c, 1e-20) || moved < 1e-9) break;
    }
    return it;
  }

 private:
  Eigen::VectorXd Clamp(Eigen::VectorXd y) const {
    for (Eigen::Index k = 0; k < y.size(); ++k) {
      const Parameter& p = params_[static_cast<size_t>(k)];
      y[k] = std::clamp(y[k], p.lo(), p.hi());
    }
    return y;
  }

  const Model& model_;
  const std::vector<Parameter>& params_;
  Eigen::VectorXd prior_, scales_, widths_;
};

// Fits the kept candidates from their priors `v`: first the data alone, whose scatter is the
// measurement noise (at least kNoiseFloor); then the data against the priors, each residual
// weighed by that noise. Then the standard errors and the constants pinned at a bound.
Result<Fitted> FitKept(Model* model, const std::vector<Parameter>& candidates,
                       const std::vector<size_t>& kept, const Eigen::VectorXd& v,
                       int max_iterations, int* iterations) {
  Fitted f;
  for (size_t c : kept) f.params.push_back(candidates[c]);
  model->params = f.params;
  f.x.resize(static_cast<Eigen::Index>(kept.size()));
  for (size_t k = 0; k < kept.size(); ++k) {
    f.x[static_cast<Eigen::Index>(k)] = v[static_cast<Eigen::Index>(kept[k])];
  }
  f.x_prior = f.x;
  const MapFit fit(*model, f.params, f.x_prior);
  const Eigen::VectorXd& scales = fit.scales();
  constexpr double kNoiseFloor = 0.002;
  *iterations += fit.Minimise(&f.x, 1.0, false, max_iterations);
  const auto n = static_cast<double>(model->runs->size());
  const auto m = static_cast<double>(kept.size());
  const double data_cost = model->Residuals(f.x).squaredNorm();
  const double noise = std::max(kNoiseFloor, n > m ? std::sqrt(data_cost / (n - m)) : 0.02);
  *iterations += fit.Minimise(&f.x, noise, true, max_iterations);
  for (Eigen::Index k = 0; k < f.x.size(); ++k) {
    if (!std::isfinite(f.x[k])) return Status::Internal("calibrate: the fit diverged");
  }
  f.cost = model->Residuals(f.x).squaredNorm();

  // Standard errors from the curvature of the objective at the solution, in value units.
  const Eigen::MatrixXd jf = fit.Jacobian(f.x, noise, true);
  const Eigen::MatrixXd cov =
      (jf.transpose() * jf).completeOrthogonalDecomposition().pseudoInverse();
  f.se = Eigen::VectorXd::Zero(f.x.size());
  for (Eigen::Index k = 0; k < f.x.size(); ++k) {
    f.se[k] = std::sqrt(std::max(0.0, cov(k, k))) * scales[k];
  }
  // A constant at a bound is pinned there when the fit moved it there, or when it started there
  // and the unbounded optimum lies past the bound by more than a standard error: either way the
  // runs want a value the model does not allow (Note [Calibration bounds]).
  const Eigen::VectorXd gradient = jf.transpose() * fit.Residuals(f.x, noise, true);
  const Eigen::MatrixXd curvature = jf.transpose() * jf;
  f.pinned.assign(static_cast<size_t>(f.x.size()), false);
  for (Eigen::Index k = 0; k < f.x.size(); ++k) {
    const Parameter& p = f.params[static_cast<size_t>(k)];
    const bool at_lo = f.x[k] <= p.lo() + 1e-12, at_hi = f.x[k] >= p.hi() - 1e-12;
    if (!at_lo && !at_hi) continue;
    const double step = -gradient[k] / std::max(curvature(k, k), 1e-12) * scales[k];
    const bool outward = (at_lo && step < 0) || (at_hi && step > 0);
    f.pinned[static_cast<size_t>(k)] =
        f.x[k] != f.x_prior[k] ||
        (outward && std::fabs(step) > std::max(f.se[k], 1e-3 * scales[k]));
  }
  return f;
}

// The least certain constant not asked for by name whose standard error is above
// kMaxRelativeError of its value (of its error floor near 0); -1 when none is.
Eigen::Index MostUncertain(const Fitted& f, const std::set<std::string>& asked) {
  constexpr double kMaxRelativeError = 0.25;
  Eigen::Index worst = -1;
  double worst_ratio = kMaxRelativeError;
  for (Eigen::Index k = 0; k < f.x.size(); ++k) {
    const Parameter& p = f.params[static_cast<size_t>(k)];
    if (AskedFor(p, asked)) continue;
    const double ratio = f.se[k] / std::max(std::fabs(f.x[k]), p.spec->error_floor);
    if (ratio > worst_ratio) {
      worst_ratio = ratio;
      worst = k;
    }
  }
  return worst;
}

// The fitted constants into `result`: the report's list and the values the plans use.
void RecordFitted(const Fitted& f, Calibration* result) {
  for (size_t k = 0; k < f.params.size(); ++k) {
    const Parameter& p = f.params[k];
    const auto e = static_cast<Eigen::Index>(k);
    result->fitted.push_back({p.name, f.x_prior[e], f.x[e], f.se[e], f.pinned[k]});
    if (p.spec->per_gpu != nullptr) {
      ((*result).*(p.spec->per_gpu))[p.gpu] = f.x[e];
    } else {
      result->constants.*(p.spec->constant) = f.x[e];
    }
  }
}

// Note [Calibration bounds]: a fit that does not explain its runs is refused.
Status CheckExplains(const Calibration& result, const CalibrateOptions& options) {
  const RunResidual* worst = nullptr;
  for (const RunResidual& r : result.runs) {
    if (worst == nullptr || std::fabs(r.fitted_s / r.measured_s - 1) >
                                std::fabs(worst->fitted_s / worst->measured_s - 1)) {
      worst = &r;
    }
  }
  if (result.rms_error_fitted <= options.max_rms_error) return Status::Ok();
  return Status::InvalidArgument(
      "calibrate: the calibrated model still misses the runs by " +
      FormatDouble("%.3g%%", result.rms_error_fitted * 100) + " RMS (" +
      FormatDouble("%.3g%%", result.rms_error_prior * 100) + " with the priors), more than the " +
      FormatDouble("%.3g%%", options.max_rms_error * 100) +
      " `max_rms_error` accepts; the worst, run '" + Printable(worst->id) + "': measured " +
      FormatDouble("%.4g", worst->measured_s) + " s, calibrated model " +
      FormatDouble("%.4g", worst->fitted_s) +
      " s. The runs measure something the model does not describe: check that step_time_s is "
      "seconds per optimizer step and that each run's model, cluster (GPU, nodes, network) and "
      "setup are what ran. Nothing was written");
}

}  // namespace

std::string CalibratedConstantNames() {
  std::vector<const ConstantSpec*> listed;
  for (const ConstantSpec& spec : kConstants) listed.push_back(&spec);
  std::sort(listed.begin(), listed.end(),
            [](const ConstantSpec* a, const ConstantSpec* b) { return a->listed < b->listed; });
  std::string names;
  for (const ConstantSpec* spec : listed)
    names += (names.empty() ? "" : ", ") + std::string(spec->name);
  return names;
}

Result<Calibration> Calibrate(const std::vector<CalibrationRun>& runs,
                              const CalibrateOptions& options) {
  if (runs.empty()) return Status::InvalidArgument("calibrate: no runs");
  Model model;
  model.runs = &runs;
  model.base = options.start;
  for (const CalibrationRun& r : runs) {
    if (r.inventory == nullptr) return Status::Internal("calibrate: a run without its model");
    auto shape = ModelShapeFor(*r.inventory, r.run.setup);
    if (!shape.ok()) return shape.status().WithPrefix("run '" + r.run.id + "'");
    model.shapes.push_back(*shape);
  }
  const std::set<std::string> asked(options.constants.begin(), options.constants.end());
  MEMPLAN_ASSIGN_OR_RETURN(const std::vector<Parameter> candidates, AskedCandidates(runs, asked));
  model.params = candidates;
  const Eigen::VectorXd v = Priors(candidates, runs, options.start);

  // The Jacobian at the priors says which candidates the runs touch (Note [Calibration]).
  Calibration result;
  result.constants = options.start;
  MEMPLAN_ASSIGN_OR_RETURN(Screened screened,
                           Screen(model, candidates, v, asked, &result.not_determined));
  std::vector<size_t>& kept = screened.kept;
  if (kept.empty()) {
    return Status::InvalidArgument(
        "calibrate: the runs determine none of the constants (" +
        (result.not_determined.empty() ? std::string("none asked") : result.not_determined[0]) +
        ")");
  }
  if (runs.size() < kept.size()) {
    std::string names;
    for (size_t c : kept) names += (names.empty() ? "" : ", ") + candidates[c].name;
    return Status::InvalidArgument("calibrate: " + std::to_string(runs.size()) +
                                   (runs.size() == 1 ? " run" : " runs") + " cannot determine " +
                                   std::to_string(kept.size()) + " constants (" + names +
                                   "): measure at least " + std::to_string(kept.size()) +
                                   " runs, or fit fewer with `constants`");
  }

  // The fit; a constant the runs pin down too loosely is not determined after all: the least
  // certain one goes back to its prior and the rest are fitted again (unless asked for by name).
  const double prior_cost = model.Residuals(v).squaredNorm();
  Fitted fit;
  while (true) {
    MEMPLAN_ASSIGN_OR_RETURN(
        fit, FitKept(&model, candidates, kept, v, options.max_iterations, &result.iterations));
    const Eigen::Index worst = MostUncertain(fit, asked);
    if (worst < 0) break;
    const Parameter& dropped = fit.params[static_cast<size_t>(worst)];
    result.not_determined.push_back(
        (screened.collinear[kept[static_cast<size_t>(worst)]] ? WhyNot(dropped, true) + "; "
                                                              : dropped.name + ": ") +
        "too uncertain from these runs (" + FormatDouble("%.3g", fit.x[worst]) + " +- " +
        FormatDouble("%.2g", fit.se[worst]) + "); prior " +
        FormatDouble("%.4g", fit.x_prior[worst]) + " kept");
    kept.erase(kept.begin() + worst);
    if (kept.empty()) {
      return Status::InvalidArgument(
          "calibrate: the runs determine none of the constants "
          "precisely (" +
          result.not_determined.back() + ")");
    }
  }
  RecordFitted(fit, &result);
  for (size_t i = 0; i < runs.size(); ++i) {
    result.runs.push_back({runs[i].run.id, runs[i].run.step_time_s, model.Predict(i, fit.x_prior),
                           model.Predict(i, fit.x)});
  }
  const auto n = static_cast<double>(runs.size());
  result.rms_error_prior = std::sqrt(prior_cost / n);
  result.rms_error_fitted = std::sqrt(fit.cost / n);
  result.max_rms_error = options.max_rms_error;
  MEMPLAN_RETURN_IF_ERROR(CheckExplains(result, options));
  result.warnings = CalibrationWarnings(result);
  return result;
}

std::vector<std::string> CalibrationWarnings(const Calibration& c) {
  std::vector<std::string> out;
  const std::string bound = FormatDouble("%.3g%%", kDefaultMaxRmsError * 100);
  if (c.rms_error_fitted > kDefaultMaxRmsError) {
    out.push_back("the calibrated model misses its runs by " +
                  FormatDouble("%.3g%%", c.rms_error_fitted * 100) + " RMS, more than the " +
                  bound +
                  " `memplan calibrate` accepts by default: its constants do not describe those "
                  "runs, and plans made with them are doubtful");
  }
  for (const FittedConstant& f : c.fitted) {
    if (!f.at_bound) continue;
    out.push_back(Printable(f.name) + " = " + FormatDouble("%.4g", f.value) +
                  " is pinned at its bound" +
                  // A prior of 0 is unknown (a file without a report) unless 0 is in bounds.
                  (f.prior > 0 || (FindConstant(f.name) != nullptr && FindConstant(f.name)->lo <= 0)
                       ? " (prior " + FormatDouble("%.4g", f.prior) + ")"
                       : std::string()) +
                  ": the runs ask for a value the model does not allow, which usually means a "
                  "run's file says another cluster or setup than what ran (GPU, network, "
                  "offload) or step times in another unit; predictions that lean on it are "
                  "doubtful");
  }
  for (const RunResidual& r : c.runs) {
    if (!(r.measured_s > 0) || !(r.fitted_s > 0)) continue;  // a file's report without figures
    const double error = r.fitted_s / r.measured_s - 1;
    if (std::fabs(error) > kDefaultMaxRmsError) {
      out.push_back("run '" + Printable(r.id) + "': the calibrated model is still off by " +
                    FormatDouble("%+.0f%%", error * 100) + " (measured " +
                    FormatDouble("%.4g", r.measured_s) + " s, predicted " +
                    FormatDouble("%.4g", r.fitted_s) + " s)");
    }
  }
  return out;
}

nlohmann::json ToJson(const Calibration& c) {
  nlohmann::json constants = nlohmann::json::object();
  nlohmann::json gpus = nlohmann::json::object();
  nlohmann::json fitted = nlohmann::json::array();
  for (const FittedConstant& f : c.fitted) {
    fitted.push_back({{"name", f.name},
                      {"prior", f.prior},
                      {"value", f.value},
                      {"standard_error", f.standard_error},
                      {"at_bound", f.at_bound}});
    // One for all GPUs (a per-GPU one's name has its GPU in brackets).
    const ConstantSpec* spec = FindConstant(f.name);
    if (spec != nullptr && spec->constant != nullptr && f.name == spec->name) {
      constants[f.name] = c.constants.*(spec->constant);
    }
  }
  for (const ConstantSpec& spec : kConstants) {
    if (spec.per_gpu == nullptr) continue;
    for (const auto& [gpu, value] : c.*(spec.per_gpu)) gpus[gpu][spec.name] = value;
  }
  nlohmann::json runs = nlohmann::json::array();
  for (const RunResidual& r : c.runs) {
    runs.push_back({{"id", r.id},
                    {"measured_s", r.measured_s},
                    {"prior_s", r.prior_s},
                    {"fitted_s", r.fitted_s}});
  }
  return {{"format", kCalibrationFormat},
          {"constants", constants},
          {"gpus", gpus},
          {"fitted", fitted},
          {"not_determined", c.not_determined},
          {"runs", runs},
          {"rms_error", {{"prior", c.rms_error_prior}, {"fitted", c.rms_error_fitted}}},
          {"max_rms_error", c.max_rms_error},
          {"warnings", c.warnings},
          {"iterations", c.iterations}};
}

Result<Calibration> CalibrationFromJson(const nlohmann::json& json, const std::string& source) {
  if (!json.is_object()) return Status::InvalidArgument(source + ": expected a JSON object");
  auto format = json.find("format");
  if (format == json.end() || *format != kCalibrationFormat) {
    return Status::InvalidArgument(source + ": 'format' must be \"" + kCalibrationFormat +
                                   "\" (the file `memplan calibrate` writes)");
  }
  static const std::set<std::string> kReport = {"format",   "fitted",    "not_determined",
                                                "runs",     "rms_error", "max_rms_error",
                                                "warnings", "iterations"};
  Calibration c;
  c.source = source;
  for (const auto& [key, value] : json.items()) {
    if (kReport.count(key) > 0) continue;
    if (key == "constants") {
      if (!value.is_object())
        return Status::InvalidArgument(source + ": 'constants' must be an object");
      for (const auto& [name, v] : value.items()) {
        const std::string what = source + ": constants." + name;
        if (!v.is_number() || !std::isfinite(v.get<double>())) {
          return Status::InvalidArgument(what + ": expected a number");
        }
        const double x = v.get<double>();
        // One for all GPUs: those in TimeConstants (not "gemm_efficiency[a100-80]").
        const ConstantSpec* spec = FindConstant(name);
        if (spec == nullptr || spec->constant == nullptr || name != spec->name) {
          return Status::InvalidArgument(what + ": unknown constant");
        }
        if (!(x >= spec->lo && x <= spec->hi)) {
          return Status::InvalidArgument(what + ": outside its bounds");
        }
        c.constants.*(spec->constant) = x;
        c.fitted.push_back({name, 0, x, 0, false});
      }
    } else if (key == "gpus") {
      if (!value.is_object()) return Status::InvalidArgument(source + ": 'gpus' must be an object");
      for (const auto& [gpu, entry] : value.items()) {
        const std::string what = source + ": gpus." + Printable(gpu);
        if (FindControlCharacter(gpu) != std::string::npos) {
          return Status::InvalidArgument(what + ": a GPU name may not hold control characters");
        }
        if (!entry.is_object()) return Status::InvalidArgument(what + ": expected an object");
        for (const auto& [name, v] : entry.items()) {
          const ConstantSpec* spec = FindConstant(name);
          if (spec == nullptr || spec->per_gpu == nullptr || name != spec->name) {
            return Status::InvalidArgument(what + "." + name + ": unknown constant");
          }
          if (!v.is_number() || !std::isfinite(v.get<double>()) || v.get<double>() < spec->lo ||
              v.get<double>() > spec->hi) {
            return Status::InvalidArgument(what + "." + name + ": expected a number in [" +
                                           FormatDouble("%g", spec->lo) + ", " +
                                           FormatDouble("%g", spec->hi) + "]");
          }
          (c.*(spec->per_gpu))[gpu] = v.get<double>();
          c.fitted.push_back({name + "[" + gpu + "]", 0, v.get<double>(), 0, false});
        }
      }
    } else {
      return Status::InvalidArgument(source + ": unknown key '" + key + "'");
    }
  }
  // The report, as far as it is well formed, for Note [Calibration bounds]'s warnings.
  auto number = [](const nlohmann::json& o, const char* key) {
    return o.is_object() && o.contains(key) && o[key].is_number() ? o[key].get<double>() : 0.0;
  };
  if (auto runs = json.find("runs"); runs != json.end() && runs->is_array()) {
    for (const nlohmann::json& r : *runs) {
      if (r.is_object() && r.contains("id") && r["id"].is_string()) {
        c.runs.push_back({r["id"].get<std::string>(), number(r, "measured_s"), number(r, "prior_s"),
                          number(r, "fitted_s")});
      }
    }
  }
  if (auto rms = json.find("rms_error"); rms != json.end()) {
    c.rms_error_prior = number(*rms, "prior");
    c.rms_error_fitted = number(*rms, "fitted");
  }
  if (c.fitted.empty()) {
    return Status::InvalidArgument(source + ": no constants (neither 'constants' nor 'gpus')");
  }
  const nlohmann::json* report = nullptr;
  if (auto f = json.find("fitted"); f != json.end() && f->is_array()) report = &*f;
  for (FittedConstant& f : c.fitted) {
    const nlohmann::json* entry = nullptr;
    if (report != nullptr) {
      for (const nlohmann::json& e : *report) {
        if (e.is_object() && e.contains("name") && e["name"] == f.name) entry = &e;
      }
    }
    if (entry != nullptr) {
      f.prior = number(*entry, "prior");
      f.standard_error = number(*entry, "standard_error");
      f.at_bound = entry->contains("at_bound") && (*entry)["at_bound"] == true;
      continue;
    }
    // No report for it: at a bound and not the prior counts as pinned.
    const ConstantSpec& spec = *FindConstant(f.name);  // read above from the table's names
    const TimeConstants k = DefaultTimeConstants();
    // The prior: TimeConstants' default; a GPU's own (gemm_efficiency) is unknown here.
    const double prior = spec.constant != nullptr ? k.*(spec.constant) : -1;
    f.prior = std::max(prior, 0.0);
    f.at_bound = (f.value <= spec.lo || f.value >= spec.hi) && f.value != prior;
  }
  c.warnings = CalibrationWarnings(c);
  return c;
}

std::string FormatCalibrationText(const Calibration& c) {
  std::string out = "Calibrated from " + std::to_string(c.runs.size()) + " measured run(s) (" +
                    std::to_string(c.iterations) + " Levenberg-Marquardt iterations):\n";
  char line[512];
  std::snprintf(line, sizeof(line), "  %-34s %10s %10s %12s\n", "constant", "prior", "fitted",
                "std. error");
  out += line;
  for (const FittedConstant& f : c.fitted) {
    std::snprintf(line, sizeof(line), "  %-34s %10.4g %10.4g %12s%s\n", f.name.c_str(), f.prior,
                  f.value,
                  f.standard_error > 0 ? FormatDouble("%.2g", f.standard_error).c_str() : "-",
                  f.at_bound ? "  (at its bound)" : "");
    out += line;
  }
  if (!c.not_determined.empty()) {
    out += "Not determined by these runs (priors kept):\n";
    for (const std::string& s : c.not_determined) out += "  - " + s + "\n";
  }
  out += "\n";
  std::snprintf(line, sizeof(line), "  %-34s %10s %10s %8s %10s %8s\n", "run", "measured", "prior",
                "error", "fitted", "error");
  out += line;
  for (const RunResidual& r : c.runs) {
    std::snprintf(line, sizeof(line), "  %-34s %10.4g %10.4g %+7.1f%% %10.4g %+7.1f%%\n",
                  r.id.substr(0, 34).c_str(), r.measured_s, r.prior_s,
                  (r.prior_s / r.measured_s - 1) * 100, r.fitted_s,
                  (r.fitted_s / r.measured_s - 1) * 100);
    out += line;
  }
  out += "RMS error of the step times: " + FormatDouble("%.1f%%", c.rms_error_prior * 100) +
         " with the priors, " + FormatDouble("%.1f%%", c.rms_error_fitted * 100) + " calibrated.\n";
  if (!c.warnings.empty()) {
    out +=
        "\nWarnings (Note [Calibration bounds]; written into the file, and repeated by plan and "
        "capacity):\n";
    for (const std::string& w : c.warnings) out += "  - warning: " + w + "\n";
  }
  return out;
}

void ApplyCalibration(const Calibration& c, GpuSpec* gpu, SearchOptions* options) {
  // Every constant: the one for all GPUs, then the one fitted for `gpu`, where each lives.
  for (const ConstantSpec& spec : kConstants) {
    if (options != nullptr && spec.constant != nullptr) {
      options->time_constants.*(spec.constant) = c.constants.*(spec.constant);
    }
  }
  for (const ConstantSpec& spec : kConstants) {
    if (gpu == nullptr || spec.per_gpu == nullptr) continue;
    const auto it = (c.*(spec.per_gpu)).find(gpu->name);
    if (it == (c.*(spec.per_gpu)).end()) continue;
    if (spec.gpu_constant != nullptr) {
      (*gpu).*(spec.gpu_constant) = it->second;
    } else if (options != nullptr) {
      options->time_constants.*(spec.constant) = it->second;
    }
  }
  if (options != nullptr) {
    std::string names;
    for (const FittedConstant& f : c.fitted) {
      // Another GPU's efficiencies do not apply to this search's GPU.
      const size_t bracket = f.name.find('[');
      if (gpu != nullptr && bracket != std::string::npos &&
          f.name.substr(bracket) != "[" + gpu->name + "]") {
        continue;
      }
      names += (names.empty() ? "" : ", ") + f.name + " = " + FormatDouble("%.4g", f.value);
    }
    options->calibration_note = (c.source.empty() ? std::string("calibration") : c.source) +
                                (c.runs.empty() ? std::string()
                                                : " (" + std::to_string(c.runs.size()) +
                                                      (c.runs.size() == 1 ? " run)" : " runs)")) +
                                ": " + names;
    for (const std::string& w : c.warnings) options->calibration_note += "; WARNING: " + w;
  }
}

}  // namespace memplan::planner
