// Engine with fp32 working parameters (params.dtype "fp32") on the host-only runtime: on every
// parameter tier x optimizer tier the fetched working copy is the master weights bit for bit after
// every step, and those follow AdamW as cpu_optimizer.h documents it; a model many times the pinned
// budget trains with parameters and optimizer on NVMe; a resumed engine rewrites the fp32 working
// copies from the last complete step; the ParamSwapper refuses writes of the wrong width.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "offload/engine.h"
#include "schedule/schedule.h"
#include "tests/engine_testing.h"
#include "tests/status_testing.h"

namespace memplan::offload {
namespace {

using memplan::testing::Adam;
using memplan::testing::Init;
using memplan::testing::StartEngine;
using memplan::testing::TempDir;
using memplan::testing::ToyModel;
using Run = memplan::testing::EngineRun;

// Module l's weight has `weight` + 37 l elements (offloaded), every bias `bias` (under the
// persistence threshold, so resident on the GPU whatever the tier).
ToyModel Model(int layers, uint64_t weight, uint64_t bias) {
  return ToyModel(layers, weight, bias, 37);
}

// A full-precision gradient (not representable in 16 bits, so a 16-bit path would show).
float GradAt(uint64_t t, uint64_t e) {
  const uint64_t h = (e * 7919 + t * 104729) % 1000003;
  return static_cast<float>(static_cast<double>(h) / 1000003.0 * 0.2 - 0.1);
}

Schedule Fp32Schedule(Tier params, Tier optimizer, const std::string& path) {
  return memplan::testing::TestSchedule(params, optimizer, path, ElementType::kFloat32);
}

// Forward over every module, then backward with fp32 gradients, then the optimizer step.
void TrainStep(Run& run, const ToyModel& model, uint64_t t) {
  std::vector<std::vector<std::byte>> grads;  // valid until Step()
  REQUIRE_OK(memplan::testing::ForwardBackward(*run.engine, run.ids, model, model.modules, t,
                                               GradAt, ElementType::kFloat32, &grads));
  REQUIRE_OK(run.engine->Step(Adam(t)));
}

// AdamW over the flat space, written out from Note [AdamW formula] (cpu_optimizer.cc): fp32
// element-wise work, the per-step scalars in double rounded to float once.
std::vector<float> ReferenceWeights(const ToyModel& model, uint64_t steps) {
  const uint64_t n = model.total;
  std::vector<float> p(n), m(n, 0.0f), v(n, 0.0f);
  for (uint64_t e = 0; e < n; ++e) p[e] = Init(e);
  for (uint64_t t = 1; t <= steps; ++t) {
    const AdamOptions a = Adam(t);
    const double bc1 = 1.0 - std::pow(a.beta1, static_cast<double>(t));
    const double bc2 = 1.0 - std::pow(a.beta2, static_cast<double>(t));
    const auto decay = static_cast<float>(1.0 - a.lr * a.weight_decay);
    const auto beta1 = static_cast<float>(a.beta1);
    const auto one_minus_beta1 = static_cast<float>(1.0 - a.beta1);
    const auto beta2 = static_cast<float>(a.beta2);
    const auto one_minus_beta2 = static_cast<float>(1.0 - a.beta2);
    const auto bc2_sqrt = static_cast<float>(std::sqrt(bc2));
    const auto eps = static_cast<float>(a.eps);
    const auto neg_step = static_cast<float>(-(a.lr / bc1));
    for (uint64_t e = 0; e < n; ++e) {
      const float g = GradAt(t, e);
      float x = p[e] * decay;
      m[e] = std::fma(g, one_minus_beta1, m[e] * beta1);  // torch's rounding
      const float gg = one_minus_beta2 * g;
      v[e] = std::fma(gg, g, v[e] * beta2);
      const float denom = std::sqrt(v[e]) / bc2_sqrt + eps;
      const float step = neg_step * m[e];
      x = x + step / denom;
      p[e] = x;
    }
  }
  return p;
}

// Every parameter, fetched: its fp32 working copy equals its master weights bit for bit and the
// reference within a few float roundings.
void CheckFetched(Run& run, const ToyModel& model, const std::vector<float>& want) {
  const memplan::testing::Readout out =
      memplan::testing::MustReadOut(run, model, ElementType::kFloat32);
  for (size_t i = 0; i < model.params.size(); ++i) {
    const ToyModel::P& p = model.params[i];
    CAPTURE(p.name);
    const std::vector<float>& master = out.master[i];
    REQUIRE(master.size() == p.numel);
    CHECK(std::memcmp(out.fetched[i].data(), master.data(), p.numel * 4) == 0);
    size_t far = 0;
    for (uint64_t k = 0; k < p.numel; ++k) {
      const double w = want[p.flat + k];
      far += std::fabs(master[k] - w) > 1e-6 * std::fabs(w) + 1e-7;
    }
    CHECK(far == 0);
  }
}

TEST_CASE(
    "Engine with fp32 working parameters: fetched == master weights on "
    "every tier") {
  const ToyModel model = Model(4, 3000, 40);
  struct Combo {
    Tier params, optimizer;
  };
  for (Combo c : {Combo{Tier::kGpu, Tier::kCpu}, Combo{Tier::kCpu, Tier::kCpu},
                  Combo{Tier::kNvme, Tier::kCpu}, Combo{Tier::kGpu, Tier::kNvme},
                  Combo{Tier::kCpu, Tier::kNvme}, Combo{Tier::kNvme, Tier::kNvme}}) {
    CAPTURE(TierName(c.params));
    CAPTURE(TierName(c.optimizer));
    TempDir dir("engine-fp32-");
    Run run = StartEngine(model, Fp32Schedule(c.params, c.optimizer, dir.PathOf("nvme")));
    CheckFetched(run, model, ReferenceWeights(model, 0));
    constexpr uint64_t kSteps = 4;
    for (uint64_t t = 1; t <= kSteps; ++t) {
      TrainStep(run, model, t);
      CheckFetched(run, model, ReferenceWeights(model, t));
    }
    const EngineStats stats = run.engine->stats();
    CHECK(stats.steps == kSteps);
    CHECK(stats.d2h_bytes == kSteps * 4 * model.total);
    if (c.params == Tier::kGpu) {
      CHECK(stats.param.resident_bytes == 4 * model.total);
      CHECK(stats.param.demand_fetches == 0);
    } else {
      CHECK(stats.param.resident_bytes == 4 * 4 * 40);  // the biases, 4 bytes an element
      CHECK(stats.param.demand_fetches > 0);
    }
    if (c.params == Tier::kNvme) {
      // Start plus every step rewrites the whole flat space, 4 bytes an element.
      CHECK(stats.param.nvme_write_bytes == (kSteps + 1) * 4 * model.total);
      CHECK(stats.param.nvme_read_bytes > 0);
    }
    if (c.params == Tier::kCpu) CHECK(stats.param.pinned_bytes >= 4 * model.total);
    REQUIRE_OK(run.engine->Close());
  }
}

TEST_CASE(
    "Engine with fp32 parameters and optimizer on NVMe trains a model "
    "many times the pinned "
    "budget") {
  const ToyModel model =
      Model(24, 12000, 48);  // ~1.2 MB of fp32 parameters, ~4.6 MB with Adam's states
  TempDir dir("engine-fp32-");
  Schedule s = Fp32Schedule(Tier::kNvme, Tier::kNvme, dir.PathOf("nvme"));
  s.pinned_budget_bytes = 160 << 10;
  s.prefetch_bytes = 3 * 4 * 12000;
  s.max_live_bytes = 5 * 4 * 13000;
  Run run = StartEngine(model, s);
  for (uint64_t t = 1; t <= 3; ++t) TrainStep(run, model, t);
  CheckFetched(run, model, ReferenceWeights(model, 3));
  const EngineStats stats = run.engine->stats();
  CHECK(stats.pinned_bytes <= s.pinned_budget_bytes);
  CHECK(4 * model.total > 6 * s.pinned_budget_bytes);
  CHECK(stats.param.prefetch_hits > 0);
  CHECK(stats.param.peak_live_bytes <= s.max_live_bytes);
  CHECK(stats.param.nvme_read_bytes >=
        3 * 4 * (model.total - 24 * 48));  // every weight, every step
}

TEST_CASE("Engine with fp32 parameters resumes from its NVMe optimizer store") {
  const ToyModel model = Model(3, 2500, 40);
  for (Tier params : {Tier::kCpu, Tier::kNvme}) {
    CAPTURE(TierName(params));
    TempDir dir("engine-fp32-");
    const Schedule s = Fp32Schedule(params, Tier::kNvme, dir.PathOf("nvme"));
    {
      Run run = StartEngine(model, s);
      for (uint64_t t = 1; t <= 2; ++t) TrainStep(run, model, t);
      REQUIRE_OK(run.engine->Close());
    }
    RecoveryReport report;
    Run run = StartEngine(model, s, /*resume=*/true, &report);
    CHECK(report.epoch == 2);
    CHECK_FALSE(report.torn);
    CheckFetched(run, model, ReferenceWeights(model, 2));
    TrainStep(run, model, 3);
    CheckFetched(run, model, ReferenceWeights(model, 3));
  }
}

TEST_CASE("ParamSwapper writes whole elements of its working dtype only") {
  auto runtime = gpu::CreateHostOnlyRuntime();
  for (ElementType dtype : {ElementType::kFloat32, ElementType::kBFloat16}) {
    CAPTURE(ElementTypeName(dtype));
    ParamSwapperOptions o;
    o.tier = Tier::kCpu;
    o.dtype = dtype;
    o.persistence_threshold = 4;
    o.runtime = runtime.get();
    auto swapper = ParamSwapper::Create(o);
    REQUIRE_OK(swapper);
    ParamSwapper& ps = **swapper;
    REQUIRE_OK(ps.Add("w", "m", 100));
    REQUIRE_OK(ps.Add("b", "m", 3));
    REQUIRE_OK(ps.Finalize());
    std::vector<float> f(103);
    std::vector<uint16_t> h(103);
    for (size_t k = 0; k < f.size(); ++k) f[k] = static_cast<float>(k) * 0.5f;
    const bool fp32 = dtype == ElementType::kFloat32;
    CHECK(ps.WriteFloat(0, f).code() == (fp32 ? StatusCode::kOk : StatusCode::kInvalidArgument));
    CHECK(ps.WriteHalf(0, h).code() == (fp32 ? StatusCode::kInvalidArgument : StatusCode::kOk));
    CHECK(ps.Write(0, std::as_bytes(std::span<const float>(f)).first(7)).code() ==
          StatusCode::kInvalidArgument);
    CHECK(ps.Write(1, std::as_bytes(std::span<const float>(f))).code() == StatusCode::kOutOfRange);
    if (!fp32) continue;
    REQUIRE_OK(ps.Fetch("m"));
    auto w = ps.DevicePointer(0);
    auto b = ps.DevicePointer(1);
    REQUIRE_OK(w);
    REQUIRE_OK(b);
    CHECK(std::memcmp(*w, f.data(), 100 * 4) == 0);
    CHECK(std::memcmp(*b, f.data() + 100, 3 * 4) == 0);
    REQUIRE_OK(ps.Release("m"));
    CHECK(ps.stats().resident_bytes == 3 * 4);
  }
}

}  // namespace
}  // namespace memplan::offload
