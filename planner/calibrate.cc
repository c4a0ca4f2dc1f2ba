#include "planner/calibrate.h"

#include <Eigen/Dense>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <set>

#include "common/json.h"
#include "common/printable.h"

namespace memplan::planner {
namespace {

using estimator::TrainingSetup;

constexpr const char* kRunsFormat = "memplan.runs/1";
constexpr const char* kCalibrationFormat = "memplan.calibration/1";

std::string Fmt(const char* format, double v) {
  char text[64];
  std::snprintf(text, sizeof(text), format, v);
  return text;
}

// One fitted quantity: where it lives, its scale (the fit works in value / scale) and bounds.
struct Parameter {
  std::string name;  // "gemm_efficiency[a100-80]", "network_efficiency", ...
  std::string base;  // the constant: "gemm_efficiency", "link_efficiency", ...
  std::string gpu;   // per-GPU constants: the GPU it belongs to
  double scale = 1, lo = 0, hi = 1;
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
  for (const std::string& g : gpus) {
    out.push_back({"gemm_efficiency[" + g + "]", "gemm_efficiency", g, 1, 0.01, 1.0});
  }
  for (const std::string& g : gpus) {
    out.push_back({"link_efficiency[" + g + "]", "link_efficiency", g, 1, 0.01, 1.0});
  }
  out.push_back({"network_efficiency", "network_efficiency", "", 1, 0.01, 1.0});
  out.push_back({"offload_overlap", "offload_overlap", "", 1, 0.0, 1.0});
  out.push_back({"cpu_adam_factor", "cpu_adam_factor", "", 1, 0.05, 5.0});
  out.push_back({"gemm_tokens_half", "gemm_tokens_half", "", 1000, 0.0, 1e6});
  return out;
}

// The constants with `values` (one per parameter) in place.
struct Model {
  const std::vector<CalibrationRun>* runs;
  std::vector<ModelShape> shapes;
  std::vector<Parameter> params;
  TimeConstants base;

  double Get(const Parameter& p, const TimeConstants& k, const GpuSpec& gpu) const {
    if (p.base == "gemm_efficiency") return gpu.gemm_efficiency;
    if (p.base == "link_efficiency") return k.link_efficiency;
    if (p.name == "network_efficiency") return k.network_efficiency;
    if (p.name == "offload_overlap") return k.offload_overlap;
    if (p.name == "cpu_adam_factor") return k.cpu_adam_factor;
    return k.gemm_tokens_half;
  }

  // Predicted step time of run `i` with parameter values `v`.
  double Predict(size_t i, const Eigen::VectorXd& v) const {
    const CalibrationRun& r = (*runs)[i];
    Cluster c = r.run.cluster;
    TimeConstants k = base;
    for (size_t j = 0; j < params.size(); ++j) {
      const Parameter& p = params[j];
      if (!p.gpu.empty()) {
        if (p.gpu != c.gpu.name) continue;
        (p.base == "gemm_efficiency" ? c.gpu.gemm_efficiency : k.link_efficiency) =
            v[static_cast<Eigen::Index>(j)];
      } else if (p.name == "network_efficiency") {
        k.network_efficiency = v[static_cast<Eigen::Index>(j)];
      } else if (p.name == "offload_overlap") {
        k.offload_overlap = v[static_cast<Eigen::Index>(j)];
      } else if (p.name == "cpu_adam_factor") {
        k.cpu_adam_factor = v[static_cast<Eigen::Index>(j)];
      } else {
        k.gemm_tokens_half = v[static_cast<Eigen::Index>(j)];
      }
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
      const double h = 1e-4 * p.scale;
      Eigen::VectorXd up = v, down = v;
      up[c] = std::min(p.hi, v[c] + h);
      down[c] = std::max(p.lo, v[c] - h);
      const double span = (up[c] - down[c]) / p.scale;
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

  // The candidates, as asked for.
  std::vector<Parameter> candidates = Candidates(runs);
  std::set<std::string> asked(options.constants.begin(), options.constants.end());
  if (!asked.empty()) {
    std::set<std::string> known = {"gemm_efficiency", "link_efficiency"};
    for (const Parameter& p : candidates) {
      known.insert(p.base);
      known.insert(p.name);  // one GPU's: "gemm_efficiency[a100-80]"
    }
    for (const std::string& name : asked) {
      if (known.count(name) == 0) {
        return Status::InvalidArgument(
            "`constants` " + name +
            ": not a calibrated constant (gemm_efficiency, gemm_tokens_half, link_efficiency, "
            "network_efficiency, offload_overlap, cpu_adam_factor)");
      }
    }
    std::vector<Parameter> kept;
    for (const Parameter& p : candidates) {
      if (asked.count(p.base) > 0 || asked.count(p.name) > 0) kept.push_back(p);
    }
    candidates = kept;
  }
  // Values at the prior.
  auto prior_of = [&](const Parameter& p) {
    for (const CalibrationRun& r : runs) {
      if (p.base == "gemm_efficiency" && r.run.cluster.gpu.name == p.gpu) {
        return r.run.cluster.gpu.gemm_efficiency;
      }
    }
    return model.Get(p, options.start, GpuSpec{});
  };
  model.params = candidates;
  Eigen::VectorXd v(static_cast<Eigen::Index>(candidates.size()));
  for (size_t j = 0; j < candidates.size(); ++j) {
    v[static_cast<Eigen::Index>(j)] =
        std::clamp(prior_of(candidates[j]), candidates[j].lo, candidates[j].hi);
  }

  // The Jacobian at the priors says which candidates the runs touch (Note [Calibration]).
  Calibration result;
  result.constants = options.start;
  const Eigen::MatrixXd j0 = model.Jacobian(v);
  std::vector<size_t> kept;
  auto why_not = [&](const Parameter& p, bool touched) -> std::string {
    if (!touched) {
      if (p.base == "link_efficiency") return p.name + ": no run has more than one GPU";
      if (p.name == "network_efficiency") return p.name + ": no run spans nodes";
      if (p.name == "cpu_adam_factor") return p.name + ": no run offloads the optimizer";
      if (p.name == "offload_overlap") {
        return p.name + ": no run offloads (or its offload time has nothing to overlap)";
      }
      if (p.name == "gemm_tokens_half") return p.name + ": no run's GEMMs are compute-bound";
      return p.name + ": no run's time depends on it";
    }
    if (p.name == "gemm_tokens_half") {
      return p.name +
             ": every run has the same micro-batch x sequence per GPU, which cannot tell it from "
             "gemm_efficiency (measure two or more sizes)";
    }
    return p.name + ": the runs cannot tell it from the other constants";
  };
  // Which candidates the runs touch at all; of those, which ones the runs cannot tell from the
  // candidates before them (the normalised columns, in priority order, do not raise the rank):
  // these are fitted all the same, since the priors make the fit well posed, and when one of
  // them turns out too uncertain, that is the reason given.
  const double column_floor = 1e-6;
  std::vector<bool> collinear(candidates.size(), false);
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
      collinear[c] = !(sv[sv.size() - 1] > 1e-3 * sv[0]);
      if (!collinear[c]) independent.push_back(c);
    }
    const Parameter& p = candidates[c];
    if (touched) {
      kept.push_back(c);
    } else if (asked.count(p.base) > 0 || asked.count(p.name) > 0) {
      return Status::InvalidArgument("`constants`: cannot fit " + why_not(p, touched));
    } else {
      result.not_determined.push_back(why_not(p, touched));
    }
  }
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

  // Levenberg-Marquardt over the kept parameters, in value / scale units; then the standard
  // errors. A constant the runs pin down too loosely (standard error above kMaxRelativeError of
  // its value, or of its scale for gemm_tokens_half) is not determined after all: the least
  // certain one goes back to its prior and the rest are fitted again (unless asked for by name).
  const double prior_cost = model.Residuals(v).squaredNorm();
  std::vector<Parameter> fit_params;
  Eigen::VectorXd x, x_prior, se;
  std::vector<bool> pinned;  // at a bound that the objective pushes it past
  double cost = 0;
  const auto n = static_cast<double>(runs.size());
  while (true) {
    fit_params.clear();
    for (size_t c : kept) fit_params.push_back(candidates[c]);
    model.params = fit_params;
    x.resize(static_cast<Eigen::Index>(kept.size()));
    for (size_t k = 0; k < kept.size(); ++k) {
      x[static_cast<Eigen::Index>(k)] = v[static_cast<Eigen::Index>(kept[k])];
    }
    x_prior = x;
    auto clamp = [&](Eigen::VectorXd y) {
      for (Eigen::Index k = 0; k < y.size(); ++k) {
        y[k] = std::clamp(y[k], fit_params[static_cast<size_t>(k)].lo,
                          fit_params[static_cast<size_t>(k)].hi);
      }
      return y;
    };
    Eigen::VectorXd scales(x.size());
    for (Eigen::Index k = 0; k < x.size(); ++k)
      scales[k] = fit_params[static_cast<size_t>(k)].scale;
    // Prior widths (Note [Calibration]).
    Eigen::VectorXd widths(x.size());
    for (Eigen::Index k = 0; k < x.size(); ++k) {
      const Parameter& p = fit_params[static_cast<size_t>(k)];
      widths[k] = p.name == "gemm_tokens_half"  ? 1000.0
                  : p.name == "offload_overlap" ? 0.3
                  : p.name == "cpu_adam_factor" ? 0.5
                                                : 0.3 * std::max(x_prior[k], 0.05);
    }
    // The objective: data residuals / `noise`, and, when `with_prior`, (x - prior) / width.
    auto residuals = [&](const Eigen::VectorXd& y, double noise, bool with_prior) {
      const Eigen::VectorXd rd = model.Residuals(y) / noise;
      if (!with_prior) return rd;
      Eigen::VectorXd out(rd.size() + y.size());
      out << rd, (y - x_prior).cwiseQuotient(widths);
      return out;
    };
    auto jacobian = [&](const Eigen::VectorXd& y, double noise, bool with_prior) {
      const Eigen::MatrixXd jd = model.Jacobian(y) / noise;
      if (!with_prior) return jd;
      Eigen::MatrixXd out(jd.rows() + y.size(), y.size());
      out << jd, Eigen::MatrixXd(scales.cwiseQuotient(widths).asDiagonal());
      return out;
    };
    auto minimise = [&](double noise, bool with_prior) {
      Eigen::VectorXd r = residuals(x, noise, with_prior);
      double c = r.squaredNorm();
      double lambda = 1e-3;
      int it = 0;
      for (; it < options.max_iterations; ++it) {
        const Eigen::MatrixXd j = jacobian(x, noise, with_prior);
        Eigen::MatrixXd a = j.transpose() * j;
        Eigen::VectorXd g = j.transpose() * r;
        // A constant at a bound that the descent pushes further out stays there this step (an
        // active set), so the others are not dragged along a clamped direction.
        for (Eigen::Index k = 0; k < x.size(); ++k) {
          const Parameter& p = fit_params[static_cast<size_t>(k)];
          if ((x[k] <= p.lo && g[k] > 0) || (x[k] >= p.hi && g[k] < 0)) {
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
          const Eigen::VectorXd candidate = clamp(x + step.cwiseProduct(scales));
          const Eigen::VectorXd rc = residuals(candidate, noise, with_prior);
          const double c2 = rc.squaredNorm();
          if (std::isfinite(c2) && c2 < c) {
            gain = c - c2;
            moved = (candidate - x).cwiseQuotient(scales).norm();
            x = candidate;
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
      result.iterations += it;
    };
    // First the data alone: its scatter is the measurement noise (at least kNoiseFloor); then the
    // data against the priors, each residual weighed by that noise (a maximum a posteriori fit).
    constexpr double kNoiseFloor = 0.002;
    minimise(1.0, false);
    const auto m = static_cast<double>(kept.size());
    const double data_cost = model.Residuals(x).squaredNorm();
    const double noise = std::max(kNoiseFloor, n > m ? std::sqrt(data_cost / (n - m)) : 0.02);
    minimise(noise, true);
    for (Eigen::Index k = 0; k < x.size(); ++k) {
      if (!std::isfinite(x[k])) return Status::Internal("calibrate: the fit diverged");
    }
    cost = model.Residuals(x).squaredNorm();

    // Standard errors from the curvature of the objective at the solution, in value units.
    const Eigen::MatrixXd jf = jacobian(x, noise, true);
    const Eigen::MatrixXd cov =
        (jf.transpose() * jf).completeOrthogonalDecomposition().pseudoInverse();
    se = Eigen::VectorXd::Zero(x.size());
    for (Eigen::Index k = 0; k < x.size(); ++k) {
      se[k] = std::sqrt(std::max(0.0, cov(k, k))) * scales[k];
    }
    // A constant at a bound is pinned there when the fit moved it there, or when it started
    // there and the unbounded optimum lies past the bound by more than a standard error: either
    // way the runs want a value the model does not allow (Note [Calibration bounds]).
    const Eigen::VectorXd gradient = jf.transpose() * residuals(x, noise, true);
    const Eigen::MatrixXd curvature = jf.transpose() * jf;
    pinned.assign(static_cast<size_t>(x.size()), false);
    for (Eigen::Index k = 0; k < x.size(); ++k) {
      const Parameter& p = fit_params[static_cast<size_t>(k)];
      const bool at_lo = x[k] <= p.lo + 1e-12, at_hi = x[k] >= p.hi - 1e-12;
      if (!at_lo && !at_hi) continue;
      const double step = -gradient[k] / std::max(curvature(k, k), 1e-12) * scales[k];
      const bool outward = (at_lo && step < 0) || (at_hi && step > 0);
      pinned[static_cast<size_t>(k)] =
          x[k] != x_prior[k] || (outward && std::fabs(step) > std::max(se[k], 1e-3 * scales[k]));
    }
    // The least certain constant not asked for by name, if any is too uncertain.
    constexpr double kMaxRelativeError = 0.25;
    Eigen::Index worst = -1;
    double worst_ratio = kMaxRelativeError;
    for (Eigen::Index k = 0; k < x.size(); ++k) {
      const Parameter& p = fit_params[static_cast<size_t>(k)];
      if (asked.count(p.base) > 0 || asked.count(p.name) > 0) continue;
      const double ratio =
          se[k] / std::max(std::fabs(x[k]), p.base == "gemm_tokens_half" ? p.scale : 1e-9);
      if (ratio > worst_ratio) {
        worst_ratio = ratio;
        worst = k;
      }
    }
    if (worst < 0) break;
    const Parameter& dropped = fit_params[static_cast<size_t>(worst)];
    result.not_determined.push_back(
        (collinear[kept[static_cast<size_t>(worst)]] ? why_not(dropped, true) + "; "
                                                     : dropped.name + ": ") +
        "too uncertain from these runs (" + Fmt("%.3g", x[worst]) + " +- " +
        Fmt("%.2g", se[worst]) + "); prior " + Fmt("%.4g", x_prior[worst]) + " kept");
    kept.erase(kept.begin() + worst);
    if (kept.empty()) {
      return Status::InvalidArgument(
          "calibrate: the runs determine none of the constants "
          "precisely (" +
          result.not_determined.back() + ")");
    }
  }
  for (size_t k = 0; k < kept.size(); ++k) {
    const Parameter& p = fit_params[k];
    const auto e = static_cast<Eigen::Index>(k);
    FittedConstant f;
    f.name = p.name;
    f.prior = x_prior[e];
    f.value = x[e];
    f.standard_error = se[e];
    f.at_bound = pinned[k];
    result.fitted.push_back(f);
    if (p.base == "gemm_efficiency") {
      result.gemm_efficiency[p.gpu] = x[e];
    } else if (p.base == "link_efficiency") {
      result.link_efficiency[p.gpu] = x[e];
    } else if (p.name == "network_efficiency") {
      result.constants.network_efficiency = x[e];
    } else if (p.name == "offload_overlap") {
      result.constants.offload_overlap = x[e];
    } else if (p.name == "cpu_adam_factor") {
      result.constants.cpu_adam_factor = x[e];
    } else {
      result.constants.gemm_tokens_half = x[e];
    }
  }
  for (size_t i = 0; i < runs.size(); ++i) {
    RunResidual rr;
    rr.id = runs[i].run.id;
    rr.measured_s = runs[i].run.step_time_s;
    rr.prior_s = model.Predict(i, x_prior);
    rr.fitted_s = model.Predict(i, x);
    result.runs.push_back(rr);
  }
  result.rms_error_prior = std::sqrt(prior_cost / n);
  result.rms_error_fitted = std::sqrt(cost / n);
  result.max_rms_error = options.max_rms_error;

  // Note [Calibration bounds]: a fit that does not explain its runs is refused; what it explains
  // with a constant pinned at a bound, or with runs it still misses, is written with warnings.
  const RunResidual* worst = nullptr;
  for (const RunResidual& r : result.runs) {
    if (worst == nullptr || std::fabs(r.fitted_s / r.measured_s - 1) >
                                std::fabs(worst->fitted_s / worst->measured_s - 1)) {
      worst = &r;
    }
  }
  if (!(result.rms_error_fitted <= options.max_rms_error)) {
    return Status::InvalidArgument(
        "calibrate: the calibrated model still misses the runs by " +
        Fmt("%.3g%%", result.rms_error_fitted * 100) + " RMS (" +
        Fmt("%.3g%%", result.rms_error_prior * 100) + " with the priors), more than the " +
        Fmt("%.3g%%", options.max_rms_error * 100) + " `max_rms_error` accepts; the worst, run '" +
        Printable(worst->id) + "': measured " + Fmt("%.4g", worst->measured_s) +
        " s, calibrated model " + Fmt("%.4g", worst->fitted_s) +
        " s. The runs measure something the model does not describe: check that step_time_s is "
        "seconds per optimizer step and that each run's model, cluster (GPU, nodes, network) and "
        "setup are what ran. Nothing was written");
  }
  result.warnings = CalibrationWarnings(result);
  return result;
}

std::vector<std::string> CalibrationWarnings(const Calibration& c) {
  std::vector<std::string> out;
  const std::string bound = Fmt("%.3g%%", kDefaultMaxRmsError * 100);
  if (c.rms_error_fitted > kDefaultMaxRmsError) {
    out.push_back("the calibrated model misses its runs by " +
                  Fmt("%.3g%%", c.rms_error_fitted * 100) + " RMS, more than the " + bound +
                  " `memplan calibrate` accepts by default: its constants do not describe those "
                  "runs, and plans made with them are doubtful");
  }
  for (const FittedConstant& f : c.fitted) {
    if (!f.at_bound) continue;
    out.push_back(Printable(f.name) + " = " + Fmt("%.4g", f.value) + " is pinned at its bound" +
                  (f.prior > 0 || f.name == "offload_overlap" || f.name == "gemm_tokens_half"
                       ? " (prior " + Fmt("%.4g", f.prior) + ")"
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
                    Fmt("%+.0f%%", error * 100) + " (measured " + Fmt("%.4g", r.measured_s) +
                    " s, predicted " + Fmt("%.4g", r.fitted_s) + " s)");
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
    if (f.name == "link_efficiency") constants[f.name] = c.constants.link_efficiency;
    if (f.name == "network_efficiency") constants[f.name] = c.constants.network_efficiency;
    if (f.name == "offload_overlap") constants[f.name] = c.constants.offload_overlap;
    if (f.name == "cpu_adam_factor") constants[f.name] = c.constants.cpu_adam_factor;
    if (f.name == "gemm_tokens_half") constants[f.name] = c.constants.gemm_tokens_half;
  }
  for (const auto& [gpu, value] : c.gemm_efficiency) gpus[gpu]["gemm_efficiency"] = value;
  for (const auto& [gpu, value] : c.link_efficiency) gpus[gpu]["link_efficiency"] = value;
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
        double* target = name == "link_efficiency"      ? &c.constants.link_efficiency
                         : name == "network_efficiency" ? &c.constants.network_efficiency
                         : name == "offload_overlap"    ? &c.constants.offload_overlap
                         : name == "cpu_adam_factor"    ? &c.constants.cpu_adam_factor
                         : name == "gemm_tokens_half"   ? &c.constants.gemm_tokens_half
                                                        : nullptr;
        if (target == nullptr) return Status::InvalidArgument(what + ": unknown constant");
        const bool ok = name == "gemm_tokens_half"  ? (x >= 0 && x <= 1e6)
                        : name == "offload_overlap" ? (x >= 0 && x <= 1)
                        : name == "cpu_adam_factor" ? (x >= 0.05 && x <= 5)
                                                    : (x >= 0.01 && x <= 1);
        if (!ok) return Status::InvalidArgument(what + ": outside its bounds");
        *target = x;
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
          if (name != "gemm_efficiency" && name != "link_efficiency") {
            return Status::InvalidArgument(what + "." + name + ": unknown constant");
          }
          if (!v.is_number() || !std::isfinite(v.get<double>()) || v.get<double>() < 0.01 ||
              v.get<double>() > 1) {
            return Status::InvalidArgument(what + "." + name +
                                           ": expected a number in "
                                           "[0.01, 1]");
          }
          (name == "gemm_efficiency" ? c.gemm_efficiency : c.link_efficiency)[gpu] =
              v.get<double>();
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
    const std::string base = f.name.substr(0, f.name.find('['));
    const TimeConstants k = DefaultTimeConstants();
    const double lo = base == "gemm_tokens_half" || base == "offload_overlap" ? 0.0
                      : base == "cpu_adam_factor"                             ? 0.05
                                                                              : 0.01;
    const double hi = base == "gemm_tokens_half" ? 1e6 : base == "cpu_adam_factor" ? 5.0 : 1.0;
    const double prior = base == "gemm_tokens_half"     ? k.gemm_tokens_half
                         : base == "offload_overlap"    ? k.offload_overlap
                         : base == "cpu_adam_factor"    ? k.cpu_adam_factor
                         : base == "network_efficiency" ? k.network_efficiency
                         : base == "link_efficiency"    ? k.link_efficiency
                                                        : -1;  // gemm: the GPU's preset
    f.prior = std::max(prior, 0.0);
    f.at_bound = (f.value <= lo || f.value >= hi) && f.value != prior;
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
                  f.value, f.standard_error > 0 ? Fmt("%.2g", f.standard_error).c_str() : "-",
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
  out += "RMS error of the step times: " + Fmt("%.1f%%", c.rms_error_prior * 100) +
         " with the priors, " + Fmt("%.1f%%", c.rms_error_fitted * 100) + " calibrated.\n";
  if (!c.warnings.empty()) {
    out +=
        "\nWarnings (Note [Calibration bounds]; written into the file, and repeated by plan and "
        "capacity):\n";
    for (const std::string& w : c.warnings) out += "  - warning: " + w + "\n";
  }
  return out;
}

void ApplyCalibration(const Calibration& c, GpuSpec* gpu, SearchOptions* options) {
  if (gpu != nullptr) {
    if (auto it = c.gemm_efficiency.find(gpu->name); it != c.gemm_efficiency.end()) {
      gpu->gemm_efficiency = it->second;
    }
  }
  if (options != nullptr) {
    options->time_constants.link_efficiency = c.constants.link_efficiency;
    if (gpu != nullptr) {
      if (auto it = c.link_efficiency.find(gpu->name); it != c.link_efficiency.end()) {
        options->time_constants.link_efficiency = it->second;
      }
    }
    options->time_constants.network_efficiency = c.constants.network_efficiency;
    options->time_constants.offload_overlap = c.constants.offload_overlap;
    options->time_constants.cpu_adam_factor = c.constants.cpu_adam_factor;
    options->time_constants.gemm_tokens_half = c.constants.gemm_tokens_half;
    std::string names;
    for (const FittedConstant& f : c.fitted) {
      // Another GPU's efficiencies do not apply to this search's GPU.
      const size_t bracket = f.name.find('[');
      if (gpu != nullptr && bracket != std::string::npos &&
          f.name.substr(bracket) != "[" + gpu->name + "]") {
        continue;
      }
      names += (names.empty() ? "" : ", ") + f.name + " = " + Fmt("%.4g", f.value);
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
