// Engine features a trainer relies on (issue 31): clipping by the global gradient norm as torch's
// clip_grad_norm_ (serial, and overlapped with backward: speculated, redone, deferred), over
// ranks; parameter groups; a step skipped for non-finite gradients; an abandoned step; the
// optimizer's state read out and loaded back; the store's record of what it holds (issue 30 H3);
// nvme.path's missing parents; a store in use. Each against an in-memory reference to the bit.
#include <doctest/doctest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "offload/cpu_optimizer.h"
#include "offload/engine.h"
#include "offload/half.h"
#include "schedule/schedule.h"
#include "offload/thread_collective.h"
#include "tests/engine_testing.h"
#include "tests/status_testing.h"

namespace memplan::offload {
namespace {

using memplan::testing::Init;
using memplan::testing::StartEngine;
using memplan::testing::TempDir;
using memplan::testing::TestSchedule;
using memplan::testing::ToyModel;
using Run = memplan::testing::EngineRun;

ToyModel Model() { return ToyModel(3, 2500, 40, 700); }

// Gradients whose norm grows with the step (so max_norm cuts between steps), fp32.
float Grad(uint64_t t, uint64_t e) {
  const float base = static_cast<float>(((e * 13 + t * 7) % 101) * 0.002 - 0.1);
  return base * static_cast<float>(t);
}

AdamOptions Options(uint64_t t) {
  AdamOptions a;
  a.lr = 1e-2 / static_cast<double>(t);
  a.weight_decay = 0.05;
  return a;
}

// torch.nn.utils.clip_grad_norm_'s fp32 coefficient for `norm` (Tensor.__rtruediv__ is
// reciprocal() * max_norm), clamped to 1.
float TorchCoefficient(double max_norm, double norm) {
  const float denominator = static_cast<float>(norm) + 1e-6f;
  const float c = (1.0f / denominator) * static_cast<float>(max_norm);
  return c > 1.0f ? 1.0f : c;
}

struct Reference {
  std::vector<float> weights;
  std::vector<double> norms;
  std::vector<float> coefficients;
};

// AdamW over the flat space in memory, each step's gradients multiplied by torch's clip
// coefficient first (max_norm 0: none); per-group options by `group_of(e)`.
Reference ReferenceRun(const ToyModel& model, uint64_t steps, double max_norm,
                       const std::function<AdamOptions(uint64_t t, uint64_t e)>& options) {
  const uint64_t n = model.total;
  Reference out;
  std::vector<float> p(n), m(n, 0.0f), v(n, 0.0f), g(n);
  for (uint64_t e = 0; e < n; ++e) p[e] = Init(e);
  auto cpu = CpuOptimizer::Create({});
  REQUIRE_OK(cpu);
  for (uint64_t t = 1; t <= steps; ++t) {
    double squares = 0;
    for (uint64_t e = 0; e < n; ++e) {
      g[e] = Grad(t, e);
      squares += static_cast<double>(g[e]) * g[e];
    }
    const double norm = std::sqrt(squares);
    out.norms.push_back(norm);
    const float c = max_norm > 0 ? TorchCoefficient(max_norm, norm) : 1.0f;
    out.coefficients.push_back(c);
    for (uint64_t e = 0; e < n; ++e) {
      g[e] = g[e] * c;
      // One element at a time: each may have its own group's options.
      AdamTensors one{std::span<float>(&p[e], 1),
                      std::span<const float>(&g[e], 1),
                      std::span<float>(&m[e], 1),
                      std::span<float>(&v[e], 1),
                      {},
                      {},
                      HalfDtype::kNone,
                      {},
                      HalfDtype::kNone};
      REQUIRE_OK((*cpu)->AdamStep(options(t, e), static_cast<int64_t>(t), one));
    }
  }
  out.weights = p;
  return out;
}

std::vector<float> EngineWeights(Run& run, const ToyModel& model) {
  std::vector<float> all;
  for (size_t i = 0; i < model.params.size(); ++i) {
    std::vector<float> w(model.params[i].numel);
    REQUIRE_OK(run.engine->ReadMasterWeights(run.ids[i], w));
    all.insert(all.end(), w.begin(), w.end());
  }
  return all;
}

// One step: forward and backward (fp32 gradients), then Step(options); `prepare` first.
void TrainStep(Run& run, const ToyModel& model, uint64_t t, const StepOptions& options,
               bool prepare) {
  if (prepare) REQUIRE_OK(run.engine->PrepareStep(options));
  std::vector<std::vector<std::byte>> grads;
  REQUIRE_OK(memplan::testing::ForwardBackward(*run.engine, run.ids, model, model.modules, t, Grad,
                                               ElementType::kFloat32, &grads));
  REQUIRE_OK(run.engine->Step(options));
}

TEST_CASE("GradientNormParts add up and give torch's norms, NaN and inf included") {
  const std::vector<float> a = {3.0f, -4.0f, 0.5f, 1e-3f, -2.0f, 7.0f, 0.0f, -1.0f, 2.5f};
  GradientNormParts whole = MeasureGradients(a);
  GradientNormParts split = MeasureGradients(std::span<const float>(a).first(4));
  split.Add(MeasureGradients(std::span<const float>(a).subspan(4)));
  double squares = 0, abs = 0, max = 0;
  for (float x : a) {
    squares += static_cast<double>(x) * x;
    abs += std::fabs(x);
    max = std::max(max, static_cast<double>(std::fabs(x)));
  }
  for (const GradientNormParts* p : {&whole, &split}) {
    CHECK(p->finite());
    CHECK(*p->Norm(2) == doctest::Approx(std::sqrt(squares)).epsilon(1e-15));
    CHECK(*p->Norm(1) == doctest::Approx(abs).epsilon(1e-15));
    CHECK(*p->Norm(std::numeric_limits<double>::infinity()) == max);
  }
  CHECK(!whole.Norm(3).ok());
  std::vector<float> bad = a;
  bad[1] = std::numeric_limits<float>::infinity();
  GradientNormParts inf = MeasureGradients(bad);
  CHECK(!inf.finite());
  CHECK(std::isinf(*inf.Norm(2)));
  bad[8] = std::numeric_limits<float>::quiet_NaN();
  CHECK(std::isnan(*MeasureGradients(bad).Norm(std::numeric_limits<double>::infinity())));
}

TEST_CASE("Engine clips by the global norm as torch's clip_grad_norm_, to the bit") {
  const ToyModel model = Model();
  const uint64_t steps = 5;
  const Reference unclipped =
      ReferenceRun(model, steps, 0, [](uint64_t t, uint64_t) { return Options(t); });
  // Between the second and third step's norms: steps 1-2 unclipped, 3-5 clipped.
  const double max_norm = (unclipped.norms[1] + unclipped.norms[2]) / 2;
  const Reference want =
      ReferenceRun(model, steps, max_norm, [](uint64_t t, uint64_t) { return Options(t); });
  REQUIRE(want.coefficients[0] == 1.0f);
  REQUIRE(want.coefficients[3] < 1.0f);
  struct Case {
    Tier optimizer;
    bool prepare;
  };
  for (Case c : {Case{Tier::kCpu, false}, Case{Tier::kNvme, false}, Case{Tier::kNvme, true}}) {
    CAPTURE(TierName(c.optimizer));
    CAPTURE(c.prepare);
    TempDir dir("engine-clip-");
    Run run = StartEngine(
        model, TestSchedule(Tier::kCpu, c.optimizer, dir.PathOf("nvme"), ElementType::kFloat32));
    std::vector<std::string> clipping;
    for (uint64_t t = 1; t <= steps; ++t) {
      StepOptions o{{Options(t)}, max_norm};
      TrainStep(run, model, t, o, c.prepare);
      const EngineStats stats = run.engine->stats();
      CHECK(stats.last_grad_norm == doctest::Approx(want.norms[t - 1]).epsilon(1e-12));
      CHECK(stats.last_clip_coefficient == want.coefficients[t - 1]);
      clipping.push_back(stats.step_profile.clipping);
    }
    const std::vector<float> got = EngineWeights(run, model);
    CHECK(std::memcmp(got.data(), want.weights.data(), got.size() * 4) == 0);
    if (c.prepare) {
      // Note [Clipping by the global norm]: speculated while steps did not clip, redone at the
      // first that did, deferred after it.
      CHECK(clipping ==
            std::vector<std::string>{"speculated", "speculated", "redone", "deferred", "deferred"});
    }
  }
}

TEST_CASE("Engine with one state slot: the same bits; a step that may clip waits for the norm") {
  // optimizer.state_slots 1 (Note [One slot per sub-group] in optimizer_swapper.cc): a prepared
  // step that may clip or skip is never run beside backward, since a redone or dropped step would
  // have rewritten the only copy of the states; one that cannot runs beside backward as with two
  // slots. The results are the serial step's, bit for bit, and a clean close resumes.
  const ToyModel model = Model();
  const uint64_t steps = 5;
  const Reference unclipped =
      ReferenceRun(model, steps, 0, [](uint64_t t, uint64_t) { return Options(t); });
  const double max_norm = (unclipped.norms[1] + unclipped.norms[2]) / 2;
  const Reference clipped =
      ReferenceRun(model, steps, max_norm, [](uint64_t t, uint64_t) { return Options(t); });
  for (bool clip : {false, true}) {
    CAPTURE(clip);
    TempDir dir("engine-oneslot-");
    Schedule sc = TestSchedule(Tier::kCpu, Tier::kNvme, dir.PathOf("nvme"), ElementType::kFloat32);
    sc.optimizer_state_slots = 1;
    const uint64_t first = clip ? steps : 3;
    {
      Run run = StartEngine(model, sc);
      for (uint64_t t = 1; t <= first; ++t) {
        TrainStep(run, model, t, StepOptions{{Options(t)}, clip ? max_norm : 0.0}, true);
        const EngineStepProfile profile = run.engine->stats().step_profile;
        CHECK(profile.overlapped == !clip);
        CHECK(profile.clipping == (clip ? "deferred" : ""));
      }
      if (clip) {
        const std::vector<float> got = EngineWeights(run, model);
        CHECK(std::memcmp(got.data(), clipped.weights.data(), got.size() * 4) == 0);
        continue;
      }
      REQUIRE_OK(run.engine->Close());
    }
    // Resumed after a clean close: the rest of the run, as if never interrupted.
    RecoveryReport report;
    Run run = StartEngine(model, sc, /*resume=*/true, &report);
    CHECK(report.epoch == first);
    CHECK_FALSE(report.torn);
    for (uint64_t t = first + 1; t <= steps; ++t) {
      TrainStep(run, model, t, StepOptions{{Options(t)}}, true);
    }
    const std::vector<float> got = EngineWeights(run, model);
    CHECK(std::memcmp(got.data(), unclipped.weights.data(), got.size() * 4) == 0);
  }
  Schedule bad = TestSchedule(Tier::kCpu, Tier::kNvme, "/x", ElementType::kFloat32);
  bad.optimizer_state_slots = 3;
  Status refused = bad.Validate();
  CHECK(refused.code() == StatusCode::kInvalidArgument);
  CHECK(refused.message().find("schedule: optimizer.state_slots must be 1") == 0);
}

TEST_CASE("Engine measures the global norm over ZeRO-3 ranks and clips them alike") {
  const ToyModel model = Model();
  const int world = 2;
  auto group = CreateThreadGroupCollectives(world, nullptr, std::chrono::seconds(20));
  REQUIRE_OK(group);
  std::vector<double> norms(world);
  std::vector<std::vector<float>> weights(world);
  std::vector<Status> status(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      const auto i = static_cast<size_t>(r);
      status[i] = [&]() -> Status {
        Run run;
        EngineOptions options;
        options.schedule = TestSchedule(Tier::kCpu, Tier::kCpu, "", ElementType::kFloat32);
        options.collective = (*group)[i].get();
        MEMPLAN_RETURN_IF_ERROR(memplan::testing::StartToyEngine(model, options, &run));
        std::vector<std::vector<std::byte>> grads;
        // Every rank the same gradient: the mean is that gradient, its norm the one-rank norm.
        MEMPLAN_RETURN_IF_ERROR(memplan::testing::ForwardBackward(
            *run.engine, run.ids, model, model.modules, 1, Grad, ElementType::kFloat32, &grads));
        MEMPLAN_ASSIGN_OR_RETURN(norms[i], run.engine->GradientNorm(2));
        MEMPLAN_RETURN_IF_ERROR(run.engine->Step(StepOptions{{Options(1)}, 0.5}));
        for (size_t k = 0; k < model.params.size(); ++k) {
          std::vector<float> w(model.params[k].numel);
          MEMPLAN_RETURN_IF_ERROR(run.engine->ReadMasterWeights(run.ids[k], w));
          weights[i].insert(weights[i].end(), w.begin(), w.end());
        }
        return run.engine->Close();
      }();
    });
  }
  for (std::thread& t : threads) t.join();
  for (const Status& s : status) REQUIRE_MESSAGE(s.ok(), s.ToString());
  const Reference one =
      ReferenceRun(model, 1, 0.5, [](uint64_t t, uint64_t) { return Options(t); });
  CHECK(norms[0] == norms[1]);
  CHECK(norms[0] == doctest::Approx(one.norms[0]).epsilon(1e-12));
  CHECK(weights[0] == weights[1]);
  CHECK(std::memcmp(weights[0].data(), one.weights.data(), one.weights.size() * 4) == 0);
}

TEST_CASE("Engine steps parameter groups with options of their own, to the bit") {
  ToyModel model = Model();
  // Biases (every second parameter) in group 1: no decay, another learning rate.
  auto group_of = [&](uint64_t e) {
    for (size_t i = 0; i < model.params.size(); ++i) {
      const ToyModel::P& p = model.params[i];
      if (e >= p.flat && e < p.flat + p.numel) return static_cast<uint32_t>(i % 2);
    }
    return 0u;
  };
  auto options = [&](uint64_t t, uint32_t g) {
    AdamOptions a = Options(t);
    if (g == 1) {
      a.weight_decay = 0;
      a.lr = 3e-2 / static_cast<double>(t);
      a.beta2 = 0.99;
    }
    return a;
  };
  const Reference want =
      ReferenceRun(model, 3, 0, [&](uint64_t t, uint64_t e) { return options(t, group_of(e)); });
  for (Tier tier : {Tier::kCpu, Tier::kNvme}) {
    for (bool prepare : {false, true}) {
      CAPTURE(TierName(tier));
      CAPTURE(prepare);
      TempDir dir("engine-groups-");
      Run run;
      EngineOptions eo;
      eo.schedule = TestSchedule(Tier::kCpu, tier, dir.PathOf("nvme"), ElementType::kFloat32);
      eo.runtime = run.runtime.get();
      auto engine = Engine::Create(eo);
      REQUIRE_OK(engine);
      run.engine = std::move(*engine);
      for (size_t i = 0; i < model.params.size(); ++i) {
        const ToyModel::P& p = model.params[i];
        ParamSpec spec;
        spec.name = p.name;
        spec.module = p.module;
        spec.shape = {static_cast<int64_t>(p.numel)};
        const uint64_t base = p.flat;
        spec.init = [base](uint64_t first, std::span<float> out) {
          for (size_t k = 0; k < out.size(); ++k) out[k] = Init(base + first + k);
          return Status::Ok();
        };
        spec.group = static_cast<uint32_t>(i % 2);
        auto id = run.engine->AddParameter(spec);
        REQUIRE_OK(id);
        run.ids.push_back(*id);
      }
      REQUIRE_OK(run.engine->Start());
      CHECK(run.engine->stats().groups == 2);
      for (uint64_t t = 1; t <= 3; ++t) {
        TrainStep(run, model, t, StepOptions{{options(t, 0), options(t, 1)}}, prepare);
      }
      const std::vector<float> got = EngineWeights(run, model);
      CHECK(std::memcmp(got.data(), want.weights.data(), got.size() * 4) == 0);
      // Three groups' options for two groups: refused, nothing applied.
      CHECK(run.engine->Step(StepOptions{{options(4, 0), options(4, 1), options(4, 1)}}).code() ==
            StatusCode::kInvalidArgument);
    }
  }
}

TEST_CASE("Engine skips a step whose gradients overflowed, as GradScaler does") {
  const ToyModel model = Model();
  TempDir dir("engine-skip-");
  for (bool prepare : {false, true}) {
    CAPTURE(prepare);
    Run run =
        StartEngine(model, TestSchedule(Tier::kNvme, Tier::kNvme, dir.PathOf(prepare ? "p" : "s")));
    const Reference want =
        ReferenceRun(model, 1, 0, [](uint64_t t, uint64_t) { return Options(t); });
    StepOptions skip{{Options(1)}, 0, 2, true};
    if (prepare) REQUIRE_OK(run.engine->PrepareStep(skip));
    std::vector<std::vector<std::byte>> grads;
    auto nan_grad = [](uint64_t t, uint64_t e) {
      return e == 100 ? std::numeric_limits<float>::quiet_NaN() : Grad(t, e);
    };
    REQUIRE_OK(memplan::testing::ForwardBackward(*run.engine, run.ids, model, model.modules, 1,
                                                 nan_grad, ElementType::kFloat32, &grads));
    REQUIRE_OK(run.engine->Step(skip));
    EngineStats stats = run.engine->stats();
    CHECK(stats.last_step_skipped);
    CHECK(stats.skipped_steps == 1);
    CHECK(stats.epoch == 0);
    CHECK(std::isnan(stats.last_grad_norm));
    // The next step is the first: the same result as if the skipped one never was.
    StepOptions next{{Options(1)}, 0, 2, true};
    if (prepare) REQUIRE_OK(run.engine->PrepareStep(next));
    REQUIRE_OK(memplan::testing::ForwardBackward(*run.engine, run.ids, model, model.modules, 1,
                                                 Grad, ElementType::kFloat32, &grads));
    REQUIRE_OK(run.engine->Step(next));
    CHECK(!run.engine->stats().last_step_skipped);
    const memplan::testing::Readout out =
        memplan::testing::MustReadOut(run, model, ElementType::kBFloat16);
    for (size_t i = 0; i < model.params.size(); ++i) {
      CHECK(std::memcmp(out.master[i].data(), want.weights.data() + model.params[i].flat,
                        model.params[i].numel * 4) == 0);
    }
  }
}

TEST_CASE("AbandonStep leaves the engine as if the step never began") {
  const ToyModel model = Model();
  const Reference want = ReferenceRun(model, 2, 0, [](uint64_t t, uint64_t) { return Options(t); });
  for (bool prepare : {false, true}) {
    CAPTURE(prepare);
    TempDir dir("engine-abandon-");
    Run run = StartEngine(
        model, TestSchedule(Tier::kCpu, Tier::kNvme, dir.PathOf("nvme"), ElementType::kFloat32));
    TrainStep(run, model, 1, StepOptions{{Options(1)}}, prepare);
    // Half a step: some gradients given (a backward that raised), or a prepared step running.
    if (prepare) REQUIRE_OK(run.engine->PrepareStep(Options(2)));
    std::vector<std::byte> junk(model.params[0].numel * 4, std::byte{0x7f});
    REQUIRE_OK(run.engine->GradReady(run.ids[0], junk.data(), ElementType::kFloat32));
    REQUIRE_OK(run.engine->AbandonStep());
    TrainStep(run, model, 2, StepOptions{{Options(2)}}, prepare);
    const std::vector<float> got = EngineWeights(run, model);
    CHECK(std::memcmp(got.data(), want.weights.data(), got.size() * 4) == 0);
    CHECK(run.engine->stats().steps == 2);
  }
}

TEST_CASE("Engine's optimizer state reads out and loads into another engine, to the bit") {
  const ToyModel model = Model();
  const Reference want = ReferenceRun(model, 4, 0, [](uint64_t t, uint64_t) { return Options(t); });
  for (Tier from : {Tier::kCpu, Tier::kNvme}) {
    for (Tier to : {Tier::kCpu, Tier::kNvme}) {
      CAPTURE(TierName(from));
      CAPTURE(TierName(to));
      TempDir dir("engine-state-");
      Run a = StartEngine(model,
                          TestSchedule(Tier::kCpu, from, dir.PathOf("a"), ElementType::kFloat32));
      for (uint64_t t = 1; t <= 2; ++t) TrainStep(a, model, t, StepOptions{{Options(t)}}, false);
      const int arrays = 1 + a.engine->OptimizerStates();
      REQUIRE(arrays == 3);
      std::vector<std::vector<std::vector<float>>> saved(model.params.size());
      std::vector<uint64_t> steps;
      for (size_t i = 0; i < model.params.size(); ++i) {
        auto shard = a.engine->Shard(a.ids[i]);
        REQUIRE_OK(shard);
        CHECK(shard->first == 0);
        CHECK(shard->size == model.params[i].numel);
        saved[i].assign(static_cast<size_t>(arrays), std::vector<float>(shard->size));
        for (int k = 0; k < arrays; ++k) {
          REQUIRE_OK(a.engine->ReadOptimizerState(a.ids[i], k, saved[i][static_cast<size_t>(k)]));
        }
        auto count = a.engine->ParamStepCount(a.ids[i]);
        REQUIRE_OK(count);
        steps.push_back(*count);
      }
      CHECK(steps == std::vector<uint64_t>(model.params.size(), 2));
      // Another engine, other sub-groups: the state fills it, the training goes on as before.
      Schedule other = TestSchedule(Tier::kNvme, to, dir.PathOf("b"), ElementType::kFloat32);
      other.sub_group_elements = 1024;
      Run b = StartEngine(model, other);
      const bool all[3] = {true, true, true};
      StateFiller fill = [&](ParamId param, int array, uint64_t first, std::span<float> out) {
        const std::vector<float>& src = saved[param][static_cast<size_t>(array)];
        std::copy_n(src.begin() + static_cast<int64_t>(first), out.size(), out.begin());
        return Status::Ok();
      };
      REQUIRE_OK(b.engine->LoadOptimizerState(fill, all, steps));
      for (uint64_t t = 3; t <= 4; ++t) TrainStep(b, model, t, StepOptions{{Options(t)}}, false);
      const std::vector<float> got = EngineWeights(b, model);
      CHECK(std::memcmp(got.data(), want.weights.data(), got.size() * 4) == 0);
      // A filler that fails: nothing of the load is applied.
      const std::vector<float> before = EngineWeights(b, model);
      StateFiller broken = [](ParamId param, int, uint64_t, std::span<float> out) {
        std::fill(out.begin(), out.end(), 42.0f);
        return param == 3 ? Status::DataLoss("torn") : Status::Ok();
      };
      CHECK(b.engine->LoadOptimizerState(broken, all).code() == StatusCode::kDataLoss);
      CHECK(EngineWeights(b, model) == before);
    }
  }
}

TEST_CASE("A resume onto a store written for another registration is refused, naming it") {
  const ToyModel model = Model();
  TempDir dir("engine-identity-");
  const Schedule schedule = TestSchedule(Tier::kCpu, Tier::kNvme, dir.PathOf("nvme"));
  {
    Run run = StartEngine(model, schedule);
    TrainStep(run, model, 1, StepOptions{{Options(1)}}, false);
    REQUIRE_OK(run.engine->Close());
  }
  // The same element count, two parameters swapped.
  ToyModel swapped = model;
  std::swap(swapped.params[0], swapped.params[2]);
  EngineOptions options;
  options.schedule = schedule;
  options.resume = true;
  Run run;
  Status refused = memplan::testing::StartToyEngine(swapped, options, &run);
  CHECK(refused.code() == StatusCode::kInvalidArgument);
  CHECK_MESSAGE(refused.message().find("parameter #0 is 'm0.weight'") != std::string::npos,
                refused.message());
  CHECK_MESSAGE(refused.message().find("and 'm1.weight'") != std::string::npos, refused.message());
  // The registration it was written for resumes.
  Run again = StartEngine(model, schedule, /*resume=*/true);
  CHECK(again.engine->stats().epoch == 1);
}

TEST_CASE("Engine makes nvme.path's missing parents and names a store in use") {
  const ToyModel model = Model();
  TempDir dir("engine-paths-");
  const std::string path = dir.PathOf("a/b/c");
  Run first = StartEngine(model, TestSchedule(Tier::kNvme, Tier::kNvme, path));
  struct stat st {};
  REQUIRE(::stat(path.c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0700);
  EngineOptions options;
  options.schedule = TestSchedule(Tier::kNvme, Tier::kNvme, path);
  Run second;
  Status busy = memplan::testing::StartToyEngine(model, options, &second);
  CHECK(busy.code() == StatusCode::kFailedPrecondition);
  CHECK_MESSAGE(busy.message().find("in use by pid " + std::to_string(::getpid()) +
                                    " (this process") != std::string::npos,
                busy.message());
}

}  // namespace
}  // namespace memplan::offload
