#include "planner/calibrate.h"

#include <doctest/doctest.h>

#include <cmath>
#include <random>

#include "estimator/model_source.h"
#include "tests/status_testing.h"

namespace memplan::planner {
namespace {

using estimator::Checkpointing;
using estimator::OffloadDevice;

const estimator::ModelInventory& Llama7b() {
  static const auto* m = new estimator::ModelInventory(
      *estimator::LoadModel("llama-2-7b", estimator::ModelClassChoice::kFromArchitectures));
  return *m;
}

// The constants the synthetic cluster "really" has, all away from the priors.
struct Truth {
  double gemm_efficiency = 0.68;
  double gemm_tokens_half = 700;
  double link_efficiency = 0.60;
  double network_efficiency = 0.55;
  double offload_overlap = 0.60;
  double cpu_adam_factor = 0.75;
};

MeasuredRun MakeRun(const std::string& id, int64_t nodes, int stage, OffloadDevice opt,
                    OffloadDevice param, int64_t micro_batch, int64_t seq, int64_t grad_accum) {
  MeasuredRun r;
  r.id = id;
  r.model = "llama-2-7b";
  r.cluster.gpu = *FindGpuPreset("a100-80");
  r.cluster.gpus_per_node = 8;
  r.cluster.nodes = nodes;
  r.cluster.cpu_cores = 64;
  r.cluster.inter_node_bytes_per_s = 12.5e9;  // a slow network: the gathers show
  r.setup.zero_stage = stage;
  r.setup.offload_optimizer = opt;
  r.setup.offload_param = param;
  r.setup.micro_batch = micro_batch;
  r.setup.grad_accum = grad_accum;
  r.setup.seq_len = seq;
  r.setup.checkpointing = Checkpointing::kFull;
  r.setup.pin_memory = opt != OffloadDevice::kNone || param != OffloadDevice::kNone;
  r.setup.gpus_per_node = 8;
  r.setup.num_nodes = nodes;
  return r;
}

// The step time the truth gives, times (1 + noise).
double Measure(const MeasuredRun& r, const Truth& t, double noise) {
  Cluster c = r.cluster;
  c.gpu.gemm_efficiency = t.gemm_efficiency;
  TimeConstants k = DefaultTimeConstants();
  k.gemm_tokens_half = t.gemm_tokens_half;
  k.link_efficiency = t.link_efficiency;
  k.network_efficiency = t.network_efficiency;
  k.offload_overlap = t.offload_overlap;
  k.cpu_adam_factor = t.cpu_adam_factor;
  auto shape = ModelShapeFor(Llama7b(), r.setup);
  REQUIRE_OK(shape);
  const int64_t batch = r.setup.micro_batch * r.setup.grad_accum * c.WorldSize();
  return PredictStepTime(*shape, c, r.setup, batch, r.setup.pin_memory, r.sharding, k).total_s *
         (1 + noise);
}

// A grid of runs: ZeRO-3 at several micro-batch x sequence sizes on one and two nodes, ZeRO-2,
// and optimizer / parameter offload; measured from `truth` with 0.3% Gaussian noise (the
// spread of a median over a few dozen steps).
std::vector<CalibrationRun> SyntheticRuns(const Truth& truth, uint32_t seed) {
  std::vector<MeasuredRun> runs;
  int n = 0;
  auto id = [&] { return "run-" + std::to_string(++n); };
  for (int64_t nodes : {1, 2}) {
    for (int64_t mb : {1, 2, 4}) {
      for (int64_t seq : {256, 512, 2048}) {
        runs.push_back(
            MakeRun(id(), nodes, 3, OffloadDevice::kNone, OffloadDevice::kNone, mb, seq, 2));
      }
    }
    // Short steps where the collectives show, and offload runs whose transfers overlap.
    runs.push_back(MakeRun(id(), nodes, 3, OffloadDevice::kNone, OffloadDevice::kNone, 1, 128, 1));
    runs.push_back(MakeRun(id(), nodes, 2, OffloadDevice::kNone, OffloadDevice::kNone, 2, 1024, 4));
    runs.push_back(MakeRun(id(), nodes, 2, OffloadDevice::kCpu, OffloadDevice::kNone, 1, 512, 8));
    runs.push_back(MakeRun(id(), nodes, 3, OffloadDevice::kCpu, OffloadDevice::kCpu, 1, 512, 2));
    runs.push_back(MakeRun(id(), nodes, 3, OffloadDevice::kNvme, OffloadDevice::kNone, 1, 512, 4));
    runs.push_back(MakeRun(id(), nodes, 3, OffloadDevice::kCpu, OffloadDevice::kNone, 2, 2048, 1));
    runs.push_back(MakeRun(id(), nodes, 3, OffloadDevice::kNone, OffloadDevice::kNone, 2, 128, 1));
    runs.push_back(MakeRun(id(), nodes, 0, OffloadDevice::kNone, OffloadDevice::kNone, 1, 128, 4));
    runs.push_back(MakeRun(id(), nodes, 0, OffloadDevice::kNone, OffloadDevice::kNone, 1, 256, 4));
    runs.push_back(MakeRun(id(), nodes, 1, OffloadDevice::kNone, OffloadDevice::kNone, 4, 512, 2));
    runs.push_back(MakeRun(id(), nodes, 2, OffloadDevice::kCpu, OffloadDevice::kNone, 1, 256, 16));
    runs.push_back(MakeRun(id(), nodes, 3, OffloadDevice::kNvme, OffloadDevice::kNone, 1, 256, 8));
    // The CPU optimizer's speed against the overlap: the same optimizer step under more and
    // less hidden gradient traffic, and NVMe pipelines slower and faster than the CPU.
    runs.push_back(MakeRun(id(), nodes, 2, OffloadDevice::kCpu, OffloadDevice::kNone, 1, 256, 32));
    runs.push_back(MakeRun(id(), nodes, 2, OffloadDevice::kCpu, OffloadDevice::kNone, 4, 1024, 1));
    runs.push_back(MakeRun(id(), nodes, 3, OffloadDevice::kNvme, OffloadDevice::kNone, 1, 1024, 2));
    runs.push_back(MakeRun(id(), nodes, 3, OffloadDevice::kCpu, OffloadDevice::kCpu, 2, 512, 8));
  }
  std::mt19937 rng(seed);
  std::normal_distribution<double> noise(0, 0.003);
  std::vector<CalibrationRun> out;
  for (MeasuredRun& r : runs) {
    r.step_time_s = Measure(r, truth, noise(rng));
    out.push_back({r, &Llama7b()});
  }
  return out;
}

const FittedConstant* Find(const Calibration& c, const std::string& name) {
  for (const FittedConstant& f : c.fitted) {
    if (f.name == name) return &f;
  }
  return nullptr;
}

TEST_CASE("calibrate: constants synthesised with noise are recovered within 2%") {
  const Truth truth;
  for (uint32_t seed : {1u, 2u, 3u}) {
    auto fit = Calibrate(SyntheticRuns(truth, seed));
    REQUIRE_MESSAGE(fit.ok(), fit.status().message());
    CHECK(fit->not_determined.empty());
    const std::pair<const char*, double> expected[] = {
        {"gemm_efficiency[a100-80]", truth.gemm_efficiency},
        {"gemm_tokens_half", truth.gemm_tokens_half},
        {"link_efficiency[a100-80]", truth.link_efficiency},
        {"network_efficiency", truth.network_efficiency},
        {"offload_overlap", truth.offload_overlap},
        {"cpu_adam_factor", truth.cpu_adam_factor}};
    for (const auto& item : expected) {
      // (Not a structured binding: clang cannot capture one in doctest's lambdas.)
      const std::string name = item.first;
      const double value = item.second;
      const FittedConstant* f = Find(*fit, name);
      REQUIRE_MESSAGE(f != nullptr, name);
      INFO(name << " fitted " << f->value << " +- " << f->standard_error << ", truth " << value);
      CHECK(std::fabs(f->value / value - 1) < 0.02);
      CHECK(f->standard_error > 0);
    }
    CHECK(fit->rms_error_fitted < 0.01);  // about the noise
    CHECK(fit->rms_error_prior > 0.10);   // the priors are far off
  }
}

TEST_CASE("calibrate: a calibrated prediction moves toward held-out measured runs") {
  const std::vector<CalibrationRun> all = SyntheticRuns(Truth{}, 7);
  std::vector<CalibrationRun> train, held_out;
  for (size_t i = 0; i < all.size(); ++i) (i % 3 == 2 ? held_out : train).push_back(all[i]);
  auto fit = Calibrate(train);
  REQUIRE_MESSAGE(fit.ok(), fit.status().message());
  SearchOptions options;
  GpuSpec gpu = *FindGpuPreset("a100-80");
  ApplyCalibration(*fit, &gpu, &options);
  CHECK(gpu.gemm_efficiency != FindGpuPreset("a100-80")->gemm_efficiency);
  CHECK(options.calibration_note.find("link_efficiency") != std::string::npos);
  double prior_sq = 0, fitted_sq = 0;
  for (const CalibrationRun& r : held_out) {
    auto shape = ModelShapeFor(Llama7b(), r.run.setup);
    REQUIRE_OK(shape);
    const int64_t batch =
        r.run.setup.micro_batch * r.run.setup.grad_accum * r.run.cluster.WorldSize();
    const double prior = PredictStepTime(*shape, r.run.cluster, r.run.setup, batch,
                                         r.run.setup.pin_memory, r.run.sharding)
                             .total_s;
    Cluster calibrated = r.run.cluster;
    calibrated.gpu = gpu;
    const double fitted =
        PredictStepTime(*shape, calibrated, r.run.setup, batch, r.run.setup.pin_memory,
                        r.run.sharding, options.time_constants)
            .total_s;
    const double e_prior = prior / r.run.step_time_s - 1, e_fitted = fitted / r.run.step_time_s - 1;
    INFO(r.run.id << ": measured " << r.run.step_time_s << " prior " << prior << " fitted "
                  << fitted);
    CHECK(std::fabs(e_fitted) < std::fabs(e_prior));
    CHECK(std::fabs(e_fitted) < 0.02);
    prior_sq += e_prior * e_prior;
    fitted_sq += e_fitted * e_fitted;
  }
  CHECK(fitted_sq < prior_sq / 25);
}

TEST_CASE("calibrate: what the runs cannot determine is said, or refused when asked for") {
  // One node, one micro-batch x sequence size, no offload: only the GEMM efficiency and the link.
  std::vector<CalibrationRun> runs;
  for (int i = 0; i < 4; ++i) {
    MeasuredRun r = MakeRun("r" + std::to_string(i), 1, i % 2 == 0 ? 3 : 2, OffloadDevice::kNone,
                            OffloadDevice::kNone, 2, 1024, 1 + i);
    r.step_time_s = Measure(r, Truth{}, 0);
    runs.push_back({r, &Llama7b()});
  }
  auto fit = Calibrate(runs);
  REQUIRE_MESSAGE(fit.ok(), fit.status().message());
  CHECK(Find(*fit, "gemm_efficiency[a100-80]") != nullptr);
  CHECK(Find(*fit, "link_efficiency[a100-80]") != nullptr);
  CHECK(Find(*fit, "network_efficiency") == nullptr);
  CHECK(Find(*fit, "gemm_tokens_half") == nullptr);
  std::string why;
  for (const std::string& s : fit->not_determined) why += s + "\n";
  CHECK(why.find("network_efficiency: no run spans nodes") != std::string::npos);
  CHECK(why.find("offload_overlap: no run offloads") != std::string::npos);
  CHECK(why.find("gemm_tokens_half: every run has the same micro-batch x sequence") !=
        std::string::npos);

  CalibrateOptions asked;
  asked.constants = {"network_efficiency"};
  auto refused = Calibrate(runs, asked);
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.status().message().find("no run spans nodes") != std::string::npos);
  asked.constants = {"gemm_efficiency[a100-80]"};
  auto one_gpu = Calibrate(runs, asked);
  REQUIRE_MESSAGE(one_gpu.ok(), one_gpu.status().message());
  REQUIRE(one_gpu->fitted.size() == 1);
  CHECK(one_gpu->fitted[0].name == "gemm_efficiency[a100-80]");
  asked.constants = {"warp_speed"};
  CHECK(Calibrate(runs, asked).status().message().find("not a calibrated constant") !=
        std::string::npos);

  // Fewer runs than constants.
  std::vector<CalibrationRun> one = {runs[0]};
  auto few = Calibrate(one);
  REQUIRE_FALSE(few.ok());
  CHECK(few.status().message().find("1 run cannot determine") != std::string::npos);
  CHECK(Calibrate({}).status().message().find("no runs") != std::string::npos);
}

TEST_CASE("calibrate: the runs file refuses bad data with the run and the key") {
  auto run = [](const std::string& extra) {
    return nlohmann::json::parse(
        R"({"format": "memplan.runs/1", "runs": [{"id": "a", "model": "llama-2-7b",
            "cluster": {"gpu": "a100-80", "gpus_per_node": 8},
            "setup": {"zero_stage": 3, "micro_batch": 1, "seq_len": 2048})" +
        extra + "}]}");
  };
  auto ok = RunsFromJson(run(R"(, "step_time_s": 1.5)"), "runs.json");
  REQUIRE_MESSAGE(ok.ok(), ok.status().message());
  CHECK(ok->at(0).cluster.WorldSize() == 8);
  CHECK(ok->at(0).setup.gpus_per_node == 8);
  // Round trip.
  nlohmann::json again = {{"format", "memplan.runs/1"},
                          {"runs", nlohmann::json::array({ToJson(ok->at(0))})}};
  auto back = RunsFromJson(again, "again");
  REQUIRE_MESSAGE(back.ok(), back.status().message());
  CHECK(back->at(0).step_time_s == 1.5);
  CHECK(back->at(0).setup.zero_stage == 3);

  auto message = [&](const std::string& extra) {
    auto r = RunsFromJson(run(extra), "runs.json");
    return r.ok() ? std::string("accepted") : r.status().message();
  };
  CHECK(message(R"(, "step_time_s": -1)")
            .find("runs.json: run 'a': 'step_time_s' must be a finite number > 0, got -1") !=
        std::string::npos);
  CHECK(message(R"(, "step_time_s": "fast")").find("step_time_s") != std::string::npos);
  CHECK(message("") ==
        "runs.json: run 'a': 'step_time_s' is missing (measured seconds per optimizer step)");
  CHECK(message(R"(, "step_time_s": 1, "colour": 1)")
            .find("runs.json: unknown key 'runs[0].colour'") != std::string::npos);
  // NaN cannot be written in JSON; a parsed NaN (from a non-standard writer) is refused too.
  nlohmann::json nan = run(R"(, "step_time_s": 1)");
  nan["runs"][0]["step_time_s"] = std::nan("");
  CHECK_FALSE(RunsFromJson(nan, "runs.json").ok());
  nlohmann::json unknown = run(R"(, "step_time_s": 1)");
  unknown["runs"][0]["cluster"]["gpu"] = "z100";
  auto bad_gpu = RunsFromJson(unknown, "runs.json");
  REQUIRE_FALSE(bad_gpu.ok());
  CHECK(bad_gpu.status().message().find("'z100': not a known GPU") != std::string::npos);
  CHECK(bad_gpu.status().message().find("run 'a'") != std::string::npos);
  CHECK_FALSE(RunsFromJson(nlohmann::json::parse(R"({"runs": []})"), "x").ok());
}

TEST_CASE("calibrate: the calibration file round-trips and refuses what is out of bounds") {
  auto fit = Calibrate(SyntheticRuns(Truth{}, 11));
  REQUIRE_OK(fit);
  auto back = CalibrationFromJson(ToJson(*fit), "cal.json");
  REQUIRE_MESSAGE(back.ok(), back.status().message());
  CHECK(back->constants.link_efficiency == fit->constants.link_efficiency);
  CHECK(back->constants.gemm_tokens_half == fit->constants.gemm_tokens_half);
  CHECK(back->gemm_efficiency.at("a100-80") == fit->gemm_efficiency.at("a100-80"));
  CHECK(back->runs.size() == fit->runs.size());
  nlohmann::json bad = ToJson(*fit);
  bad["constants"]["link_efficiency"] = 3;
  CHECK(CalibrationFromJson(bad, "cal.json").status().message().find("constants.link_efficiency") !=
        std::string::npos);
  bad = ToJson(*fit);
  bad["format"] = "memplan.calibration/9";
  CHECK_FALSE(CalibrationFromJson(bad, "cal.json").ok());
  bad = ToJson(*fit);
  bad["constants"]["hbm_efficiency"] = 0.5;
  CHECK(CalibrationFromJson(bad, "cal.json").status().message().find("unknown constant") !=
        std::string::npos);
}

}  // namespace
}  // namespace memplan::planner
