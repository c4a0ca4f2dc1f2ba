// Engine and ParamSwapper on the host-only runtime: training steps through every tier combination
// give exactly the in-memory optimizer's weights; fetched parameters are the 16-bit copies of the
// master weights; the trace is recorded, followed, invalidated and re-recorded; prefetch stays
// within its budgets; a resumed engine carries on from the last step; misuse is an error.
#include "offload/engine.h"

#include <doctest/doctest.h>

#include <cstring>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "nvme/fault_backend.h"
#include "offload/half.h"
#include "schedule/schedule.h"
#include "tests/engine_testing.h"
#include "tests/status_testing.h"

namespace memplan::offload {
namespace {

using memplan::testing::Adam;
using memplan::testing::Init;
using memplan::testing::StartEngine;
using memplan::testing::StartToyEngine;
using memplan::testing::TempDir;
using memplan::testing::TestSchedule;
using memplan::testing::ToyModel;
using Run = memplan::testing::EngineRun;

// The toy model here: module l's weight has `weight` + 100 l elements, every bias 40 (it stays on
// the GPU: it is under the persistence threshold).
ToyModel Model(int layers, uint64_t weight = 3000) { return ToyModel(layers, weight, 40, 100); }

// The gradient of flat element e at step t, exactly representable in bf16.
float GradAt(uint64_t t, uint64_t e) {
  return Bf16ToFloat(FloatToBf16(static_cast<float>(((e * 7 + t * 13) % 61) * 0.003 - 0.09)));
}

// The fetched 16-bit copy of every parameter equals bf16(master weights).
void CheckFetchedAreMaster(Run& run, const ToyModel& model) {
  const memplan::testing::Readout out =
      memplan::testing::MustReadOut(run, model, ElementType::kBFloat16);
  for (size_t i = 0; i < model.params.size(); ++i) {
    size_t wrong = 0;
    for (size_t k = 0; k < out.master[i].size(); ++k) {
      uint16_t half = 0;
      std::memcpy(&half, out.fetched[i].data() + k * 2, 2);
      wrong += half != FloatToBf16(out.master[i][k]);
    }
    CHECK_MESSAGE(wrong == 0, model.params[i].name);
  }
}

// One training step: forward over the modules in `order`, backward in reverse with gradients.
// `prepare`: the optimizer overlapped with backward (PrepareStep before the step's gradients).
void TrainStep(Run& run, const ToyModel& model, uint64_t t, const std::vector<std::string>& order,
               bool prepare = false) {
  if (prepare) REQUIRE_OK(run.engine->PrepareStep(Adam(t)));
  std::vector<std::vector<std::byte>> grads;  // valid until Step()
  REQUIRE_OK(memplan::testing::ForwardBackward(*run.engine, run.ids, model, order, t, GradAt,
                                               ElementType::kBFloat16, &grads));
  REQUIRE_OK(run.engine->Step(Adam(t)));
}

// AdamW over the flat space in memory, for comparison.
std::vector<float> ReferenceWeights(const ToyModel& model, uint64_t steps) {
  const uint64_t n = model.total;
  std::vector<float> p(n), m(n, 0.0f), v(n, 0.0f), g(n);
  for (uint64_t e = 0; e < n; ++e) p[e] = Init(e);
  auto cpu = CpuOptimizer::Create({});
  REQUIRE_OK(cpu);
  for (uint64_t t = 1; t <= steps; ++t) {
    for (uint64_t e = 0; e < n; ++e) g[e] = GradAt(t, e);
    AdamTensors tensors{p, g, m, v, {}, {}, HalfDtype::kNone, {}, HalfDtype::kNone};
    REQUIRE_OK((*cpu)->AdamStep(Adam(t), static_cast<int64_t>(t), tensors));
  }
  return p;
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

TEST_CASE("Engine trains bit-identically to in-memory AdamW on every tier combination") {
  const ToyModel model = Model(4);
  struct Combo {
    Tier params, optimizer;
  };
  for (Combo c : {Combo{Tier::kGpu, Tier::kCpu}, Combo{Tier::kCpu, Tier::kCpu},
                  Combo{Tier::kNvme, Tier::kCpu}, Combo{Tier::kCpu, Tier::kNvme},
                  Combo{Tier::kNvme, Tier::kNvme}, Combo{Tier::kGpu, Tier::kNvme}}) {
    for (bool prepare : {false, true}) {
      CAPTURE(TierName(c.params));
      CAPTURE(TierName(c.optimizer));
      CAPTURE(prepare);
      TempDir dir("engine-");
      Run run = StartEngine(model, TestSchedule(c.params, c.optimizer, dir.PathOf("nvme")));
      CheckFetchedAreMaster(run, model);
      EngineStats before_last;
      for (uint64_t t = 1; t <= 3; ++t) {
        if (t == 3) before_last = run.engine->stats();
        TrainStep(run, model, t, model.modules, prepare);
      }
      const std::vector<float> got = EngineWeights(run, model);
      const std::vector<float> want = ReferenceWeights(model, 3);
      REQUIRE(got.size() == want.size());
      CHECK(std::memcmp(got.data(), want.data(), got.size() * 4) == 0);
      CheckFetchedAreMaster(run, model);
      const EngineStats stats = run.engine->stats();
      CHECK(stats.steps == 3);
      CHECK(stats.epoch == 3);
      CHECK(stats.elements == model.total);
      CHECK(stats.d2h_bytes == 3 * 2 * model.total);
      CHECK(stats.runtime == "host-only");
      if (c.params == Tier::kGpu) {
        CHECK(stats.param.demand_fetches == 0);
        CHECK(stats.param.resident_bytes == 2 * model.total);
      } else {
        CHECK(stats.param.resident_bytes == 2 * 4 * 40);  // the biases
        CHECK(stats.param.h2d_bytes > 0);
      }
      if (c.params == Tier::kNvme) {
        CHECK(stats.param.nvme_read_bytes > 0);
        CHECK(stats.param.nvme_write_bytes == 4 * 2 * model.total);  // start + 3 steps
      }
      const uint64_t sub_groups = (model.total + 2047) / 2048;
      const EngineStepProfile& profile = stats.step_profile;
      CHECK(profile.sub_groups == sub_groups);
      CHECK(profile.step_s > 0);
      CHECK(profile.overlapped == (prepare && c.optimizer == Tier::kNvme));
      if (c.optimizer == Tier::kNvme) {
        // Each step reads every sub-group's header and fp32 master, m, v; serially the gradients
        // too (written during backward, read back), overlapped never. (Overlapped, the first step
        // may read a sub-group's states twice: its reader guessed backward's order before it had
        // seen it; Note [Reading states ahead] in optimizer_swapper.cc. The last step reads each
        // once.)
        const uint64_t states = 4096 * sub_groups + 12 * model.total;
        CHECK(stats.optimizer_read_bytes - before_last.optimizer_read_bytes ==
              states + (prepare ? 0 : 4 * model.total));
        CHECK(stats.optimizer_read_bytes >= 3 * (states + (prepare ? 0 : 4 * model.total)));
        CHECK(stats.optimizer_write_bytes == 3 * states);
        CHECK(stats.grad_write_bytes == (prepare ? 0 : 3 * 4 * model.total));
        CHECK(stats.pinned_bytes > 0);
        CHECK(profile.read_s > 0);
        CHECK(profile.write_s > 0);
        CHECK(profile.sub_groups_before_step <= sub_groups);
        CHECK(profile.overlapped_fraction ==
              doctest::Approx(static_cast<double>(profile.sub_groups_before_step) / sub_groups));
        if (prepare) CHECK(profile.backward_s > 0);
      }
      REQUIRE_OK(run.engine->Close());
    }
  }
}

TEST_CASE("Engine reads NVMe parameters into staging slots that hold whole checksum blocks") {
  // TestSchedule's 4 KiB slots are smaller than the parameter store's checksum blocks, so its
  // reads go through GetRange(); slots of 256 KiB take the blocks a parameter touches whole
  // (SwapStore::GetCovering) and upload from inside them.
  const ToyModel model = Model(4);
  TempDir dir("engine-");
  Schedule schedule = TestSchedule(Tier::kNvme, Tier::kNvme, dir.PathOf("nvme"));
  schedule.param_buffer_bytes = 256 << 10;
  Run run = StartEngine(model, schedule);
  CheckFetchedAreMaster(run, model);
  for (uint64_t t = 1; t <= 3; ++t) TrainStep(run, model, t, model.modules, /*prepare=*/true);
  const std::vector<float> got = EngineWeights(run, model);
  const std::vector<float> want = ReferenceWeights(model, 3);
  REQUIRE(got.size() == want.size());
  CHECK(std::memcmp(got.data(), want.data(), got.size() * 4) == 0);
  CheckFetchedAreMaster(run, model);
  CHECK(run.engine->stats().param.nvme_read_bytes > 0);
  REQUIRE_OK(run.engine->Close());
}

TEST_CASE("A prepared step that fails is abandoned: nothing applied, the weights as before") {
  const ToyModel model = Model(4);
  for (Tier params : {Tier::kCpu, Tier::kNvme}) {
    CAPTURE(TierName(params));
    TempDir dir("engine-");
    nvme::FaultBackend* faults = nullptr;
    Run run;
    EngineOptions options;
    options.schedule = TestSchedule(params, Tier::kNvme, dir.PathOf("nvme"));
    options.make_optimizer_backend = [&]() -> Result<std::unique_ptr<nvme::Backend>> {
      MEMPLAN_ASSIGN_OR_RETURN(auto inner, nvme::CreatePosixBackend({}));
      MEMPLAN_ASSIGN_OR_RETURN(auto wrapped, nvme::FaultBackend::Create(std::move(inner)));
      faults = wrapped.get();
      return std::unique_ptr<nvme::Backend>(std::move(wrapped));
    };
    REQUIRE_OK(StartToyEngine(model, options, &run));
    REQUIRE(faults != nullptr);
    TrainStep(run, model, 1, model.modules, /*prepare=*/true);
    const std::vector<float> after_1 = EngineWeights(run, model);

    // Step() given other options than prepared: refused, the step abandoned.
    REQUIRE_OK(run.engine->PrepareStep(Adam(2)));
    CHECK_OK(run.engine->PrepareStep(Adam(2)));  // replaced before any gradient
    std::vector<std::vector<uint16_t>> grads(model.params.size());
    for (size_t i = model.params.size(); i-- > 0;) {
      grads[i].resize(model.params[i].numel);
      for (size_t k = 0; k < grads[i].size(); ++k) {
        grads[i][k] = FloatToBf16(GradAt(2, model.params[i].flat + k));
      }
      REQUIRE_OK(run.engine->GradReady(run.ids[i], grads[i].data(), ElementType::kBFloat16));
    }
    CHECK(run.engine->PrepareStep(Adam(2)).code() == StatusCode::kFailedPrecondition);
    Status st = run.engine->Step(Adam(3));
    CHECK(st.code() == StatusCode::kFailedPrecondition);
    CHECK(st.message().find("other options") != std::string::npos);
    CHECK(run.engine->stats().epoch == 1);
    CHECK(EngineWeights(run, model) == after_1);
    CheckFetchedAreMaster(run, model);  // the working copies written early were rewritten

    // An I/O error writing a sub-group's states in the background: Step() fails naming it.
    nvme::FaultPlan plan;
    plan.fail.op = nvme::OpType::kWrite;
    plan.fail.nth = 3;
    REQUIRE_OK(faults->SetPlan(plan));
    REQUIRE_OK(run.engine->PrepareStep(Adam(2)));
    for (size_t i = model.params.size(); i-- > 0;) {
      REQUIRE_OK(run.engine->GradReady(run.ids[i], grads[i].data(), ElementType::kBFloat16));
    }
    st = run.engine->Step(Adam(2));
    CHECK(st.code() == StatusCode::kIoError);
    CHECK(st.message().find("step 2, writing sub-group") != std::string::npos);
    CHECK(run.engine->stats().epoch == 1);
    CHECK(EngineWeights(run, model) == after_1);
    CheckFetchedAreMaster(run, model);

    // The step again, and one more: as if nothing had failed.
    REQUIRE_OK(faults->SetPlan({}));
    TrainStep(run, model, 2, model.modules, /*prepare=*/true);
    TrainStep(run, model, 3, model.modules, /*prepare=*/true);
    const std::vector<float> got = EngineWeights(run, model);
    const std::vector<float> want = ReferenceWeights(model, 3);
    REQUIRE(got.size() == want.size());
    CHECK(std::memcmp(got.data(), want.data(), got.size() * 4) == 0);
    CheckFetchedAreMaster(run, model);
    REQUIRE_OK(run.engine->Close());
  }
}

TEST_CASE("Engine holds frozen parameters: fetched every step, never stepped nor written") {
  // m0 and m2's weights frozen (LoRA's base), between trainable ones: the engine lays them out
  // after the trainable ones, on a chunk boundary (Note [Frozen parameters]).
  ToyModel model = Model(4);
  model.params[0].frozen = true;
  model.params[4].frozen = true;
  auto frozen = [&](size_t i) { return model.params[i].frozen; };
  uint64_t trainable = 0;
  for (size_t i = 0; i < model.params.size(); ++i) {
    if (!frozen(i)) trainable += model.params[i].numel;
  }
  // Prepared (the optimizer overlapped with backward, NVMe only): the write-backs during backward
  // never touch the frozen parameters, which backward keeps fetching.
  // Not a structured binding: clang 14 cannot capture one in CAPTURE's lambda.
  for (const auto& tier_and_prepare : {std::pair{Tier::kNvme, false}, std::pair{Tier::kCpu, false},
                                       std::pair{Tier::kNvme, true}}) {
    const Tier tier = tier_and_prepare.first;
    const bool prepare = tier_and_prepare.second;
    CAPTURE(TierName(tier));
    CAPTURE(prepare);
    TempDir dir("engine-");
    Run run = StartEngine(model, TestSchedule(tier, tier, dir.PathOf("nvme")));
    const uint64_t writes_at_start = run.engine->stats().param.nvme_write_bytes;
    std::vector<std::vector<uint16_t>> grads(model.params.size());
    for (uint64_t t = 1; t <= 3; ++t) {
      if (prepare) REQUIRE_OK(run.engine->PrepareStep(Adam(t)));
      for (const std::string& m : model.modules) {
        REQUIRE_OK(run.engine->Fetch(m));
        REQUIRE_OK(run.engine->Release(m));
      }
      for (auto it = model.modules.rbegin(); it != model.modules.rend(); ++it) {
        REQUIRE_OK(run.engine->Fetch(*it));
        for (size_t i = 0; i < model.params.size(); ++i) {
          if (model.params[i].module != *it) continue;
          // A frozen parameter is on the GPU like the others: its init values, unchanged.
          auto ptr = run.engine->DevicePointer(run.ids[i]);
          REQUIRE_OK(ptr);
          const auto* half = static_cast<const uint16_t*>(*ptr);
          grads[i].resize(model.params[i].numel);
          for (size_t k = 0; k < grads[i].size(); ++k) {
            grads[i][k] = FloatToBf16(GradAt(t, model.params[i].flat + k));
          }
          if (frozen(i)) {
            size_t wrong = 0;
            for (size_t k = 0; k < grads[i].size(); ++k) {
              wrong += half[k] != FloatToBf16(Init(model.params[i].flat + k));
            }
            CHECK(wrong == 0);
            Status refused =
                run.engine->GradReady(run.ids[i], grads[i].data(), ElementType::kBFloat16);
            CHECK(refused.code() == StatusCode::kInvalidArgument);
            CHECK(refused.message().find("frozen") != std::string::npos);
            continue;
          }
          REQUIRE(run.engine->GradReady(run.ids[i], grads[i].data(), ElementType::kBFloat16).ok());
        }
        REQUIRE_OK(run.engine->Release(*it));
      }
      Status stepped = run.engine->Step(Adam(t));
      REQUIRE_MESSAGE(stepped.ok(), stepped.ToString());
    }
    // The trainable parameters are where AdamW (elementwise) takes them; frozen ones refuse.
    const std::vector<float> want = ReferenceWeights(model, 3);
    for (size_t i = 0; i < model.params.size(); ++i) {
      std::vector<float> w(model.params[i].numel);
      Status read = run.engine->ReadMasterWeights(run.ids[i], w);
      if (frozen(i)) {
        CHECK(read.code() == StatusCode::kFailedPrecondition);
        continue;
      }
      REQUIRE_OK(read);
      CHECK(std::memcmp(w.data(), want.data() + model.params[i].flat, w.size() * 4) == 0);
    }
    const EngineStats stats = run.engine->stats();
    CHECK(stats.frozen_params == 2);
    CHECK(stats.frozen_elements == model.total - trainable);
    CHECK(stats.optimizer_elements == trainable);
    CHECK(stats.d2h_bytes == 3 * 2 * trainable);
    if (tier == Tier::kNvme) {
      // Each step writes back the trainable parameters only; the frozen ones were written once.
      CHECK(writes_at_start == 2 * model.total);
      CHECK(stats.param.nvme_write_bytes - writes_at_start == 3 * 2 * trainable);
      CHECK(stats.optimizer_write_bytes < 3 * 16 * (trainable + 2048));
      CHECK(stats.step_profile.overlapped == prepare);
    }
    REQUIRE_OK(run.engine->Close());
  }
}

// Trains steps [first, last] with every parameter's gradient except those `skip(i, t)` says have
// none (NoGradient).
void TrainSkipping(Run& run, const ToyModel& model, uint64_t first, uint64_t last,
                   const std::function<bool(size_t, uint64_t)>& skip, bool prepare = false) {
  std::vector<std::vector<uint16_t>> grads(model.params.size());
  for (uint64_t t = first; t <= last; ++t) {
    if (prepare) REQUIRE_OK(run.engine->PrepareStep(Adam(t)));
    for (const std::string& m : model.modules) {
      REQUIRE_OK(run.engine->Fetch(m));
      REQUIRE_OK(run.engine->Release(m));
    }
    for (size_t i = 0; i < model.params.size(); ++i) {
      if (skip(i, t)) {
        REQUIRE_OK(run.engine->NoGradient(run.ids[i]));
        continue;
      }
      grads[i].resize(model.params[i].numel);
      for (size_t k = 0; k < grads[i].size(); ++k) {
        grads[i][k] = FloatToBf16(GradAt(t, model.params[i].flat + k));
      }
      REQUIRE_OK(run.engine->GradReady(run.ids[i], grads[i].data(), ElementType::kBFloat16));
    }
    Status st = run.engine->Step(Adam(t));
    REQUIRE_MESSAGE(st.ok(), st.ToString());
  }
}

TEST_CASE("Engine skips a parameter without a gradient as torch does, across a resume") {
  // m1.weight has no gradient in step 2 and m2.bias none in steps 2 and 3: they keep their values
  // and states, and their own step counts (bias correction) lag the others', as torch's AdamW
  // keeps state["step"] per parameter.
  const ToyModel model = Model(3);
  auto skip = [](size_t i, uint64_t t) {
    return (i == 2 && t == 2) || (i == 5 && t >= 2 && t <= 3);
  };
  std::vector<float> want;
  {
    std::vector<float> p(model.total), m(model.total, 0.0f), v(model.total, 0.0f);
    for (uint64_t e = 0; e < model.total; ++e) p[e] = Init(e);
    auto cpu = CpuOptimizer::Create({});
    REQUIRE_OK(cpu);
    std::vector<int64_t> count(model.params.size(), 0);
    for (uint64_t t = 1; t <= 4; ++t) {
      for (size_t i = 0; i < model.params.size(); ++i) {
        if (skip(i, t)) continue;
        const uint64_t at = model.params[i].flat, n = model.params[i].numel;
        std::vector<float> g(n);
        for (uint64_t k = 0; k < n; ++k) g[k] = GradAt(t, at + k);
        AdamTensors tensors{std::span<float>(p).subspan(at, n),
                            g,
                            std::span<float>(m).subspan(at, n),
                            std::span<float>(v).subspan(at, n),
                            {},
                            {},
                            HalfDtype::kNone,
                            {},
                            HalfDtype::kNone};
        REQUIRE_OK((*cpu)->AdamStep(Adam(t), ++count[i], tensors));
      }
    }
    want = p;
  }
  for (Tier tier : {Tier::kCpu, Tier::kNvme}) {
    for (bool prepare : {false, true}) {
      if (tier == Tier::kCpu && prepare) continue;
      CAPTURE(TierName(tier));
      CAPTURE(prepare);
      TempDir dir("engine-");
      const Schedule schedule = TestSchedule(tier, tier, dir.PathOf("nvme"));
      std::vector<float> got;
      if (tier == Tier::kNvme) {
        {
          Run run = StartEngine(model, schedule);
          TrainSkipping(run, model, 1, 2, skip, prepare);
          REQUIRE_OK(run.engine->Close());
        }
        Run run = StartEngine(model, schedule, /*resume=*/true);
        CHECK(run.engine->stats().epoch == 2);
        TrainSkipping(run, model, 3, 4, skip, prepare);
        got = EngineWeights(run, model);
        CheckFetchedAreMaster(run, model);
        REQUIRE_OK(run.engine->Close());
      } else {
        Run run = StartEngine(model, schedule);
        // A given gradient cannot be declared missing too; an unknown parameter is refused.
        std::vector<uint16_t> grad(model.params[0].numel);
        REQUIRE_OK(run.engine->GradReady(run.ids[0], grad.data(), ElementType::kBFloat16));
        CHECK(run.engine->NoGradient(run.ids[0]).code() == StatusCode::kFailedPrecondition);
        CHECK(run.engine->NoGradient(999).code() == StatusCode::kInvalidArgument);
        REQUIRE_OK(run.engine->Close());
        Run fresh = StartEngine(model, schedule);
        TrainSkipping(fresh, model, 1, 4, skip);
        got = EngineWeights(fresh, model);
        CheckFetchedAreMaster(fresh, model);
        REQUIRE_OK(fresh.engine->Close());
      }
      REQUIRE(got.size() == want.size());
      size_t wrong = 0;
      for (size_t k = 0; k < got.size(); ++k) wrong += std::memcmp(&got[k], &want[k], 4) != 0;
      CHECK(wrong == 0);
    }
  }
}

TEST_CASE("ParamSwapper follows the recorded trace, prefetches within budgets, re-records") {
  const ToyModel model = Model(6, 2000);
  TempDir dir("engine-");
  Schedule s = TestSchedule(Tier::kNvme, Tier::kCpu, dir.PathOf("nvme"));
  // Room for about two weights ahead and three live: prefetch must stop at the budgets.
  s.prefetch_bytes = 2 * 2 * 2500;
  s.max_live_bytes = 3 * 2 * 2600;
  Run run = StartEngine(model, s);
  TrainStep(run, model, 1, model.modules);
  ParamSwapperStats after1 = run.engine->stats().param;
  CHECK(after1.prefetches == 0);  // step 1 only records
  CHECK(after1.trace_complete);
  CHECK(after1.trace_length == 12);  // 6 forward + 6 backward fetches
  for (uint64_t t = 2; t <= 3; ++t) TrainStep(run, model, t, model.modules);
  ParamSwapperStats after3 = run.engine->stats().param;
  CHECK(after3.prefetches > 0);
  CHECK(after3.prefetch_hits > 0);
  CHECK(after3.trace_invalidations == 0);
  CHECK(after3.peak_ahead_bytes <= s.prefetch_bytes);
  CHECK(after3.peak_live_bytes <= s.max_live_bytes);
  CHECK(after3.live_bytes == 0);
  CHECK(after3.ahead_bytes == 0);

  // A different order invalidates the trace; the new order is then recorded and followed.
  std::vector<std::string> swapped = model.modules;
  std::swap(swapped[2], swapped[3]);
  TrainStep(run, model, 4, swapped);
  ParamSwapperStats after4 = run.engine->stats().param;
  CHECK(after4.trace_invalidations == 1);
  const uint64_t hits_before = after4.prefetch_hits;
  TrainStep(run, model, 5, swapped);
  TrainStep(run, model, 6, swapped);
  ParamSwapperStats after6 = run.engine->stats().param;
  CHECK(after6.trace_invalidations == 1);
  CHECK(after6.prefetch_hits > hits_before);
  CHECK(after6.peak_ahead_bytes <= s.prefetch_bytes);
  CHECK(after6.peak_live_bytes <= s.max_live_bytes);
  // The weights are still right.
  const std::vector<float> got = EngineWeights(run, model);
  const std::vector<float> want = ReferenceWeights(model, 6);
  CHECK(std::memcmp(got.data(), want.data(), got.size() * 4) == 0);
}

TEST_CASE("Engine resumes from its NVMe optimizer store") {
  const ToyModel model = Model(3);
  TempDir dir("engine-");
  const Schedule s = TestSchedule(Tier::kNvme, Tier::kNvme, dir.PathOf("nvme"));
  {
    Run run = StartEngine(model, s);
    for (uint64_t t = 1; t <= 2; ++t) TrainStep(run, model, t, model.modules);
    REQUIRE_OK(run.engine->Close());
  }
  RecoveryReport report;
  Run run = StartEngine(model, s, /*resume=*/true, &report);
  CHECK(report.epoch == 2);
  CHECK_FALSE(report.torn);
  CHECK(run.engine->stats().epoch == 2);
  CheckFetchedAreMaster(run, model);
  TrainStep(run, model, 3, model.modules);
  const std::vector<float> got = EngineWeights(run, model);
  const std::vector<float> want = ReferenceWeights(model, 3);
  CHECK(std::memcmp(got.data(), want.data(), got.size() * 4) == 0);
}

TEST_CASE("Engine misuse is an error naming what is wrong") {
  const ToyModel model = Model(2);
  TempDir dir("engine-");
  // Declared before the engine: its asynchronous copy may read it until the engine closes.
  std::vector<uint16_t> grad(model.params[0].numel);
  Run run = StartEngine(model, TestSchedule(Tier::kCpu, Tier::kCpu, dir.PathOf("nvme")));
  Engine& e = *run.engine;
  CHECK(e.Fetch("nope").code() == StatusCode::kNotFound);
  CHECK(e.Release("m0").code() == StatusCode::kFailedPrecondition);
  CHECK(e.DevicePointer(run.ids[0]).status().code() == StatusCode::kFailedPrecondition);
  CHECK_OK(e.DevicePointer(run.ids[1]));  // the bias is resident
  REQUIRE_OK(e.GradReady(run.ids[0], grad.data(), ElementType::kBFloat16));
  CHECK(e.GradReady(run.ids[0], grad.data(), ElementType::kBFloat16).code() ==
        StatusCode::kFailedPrecondition);
  Status st = e.Step(Adam(1));
  CHECK(st.code() == StatusCode::kFailedPrecondition);
  CHECK(st.message().find("m0.bias") != std::string::npos);
  ParamSpec late{"late", "m9", {4}, [](uint64_t, std::span<float>) { return Status::Ok(); }, {}};
  CHECK(e.AddParameter(late).status().code() == StatusCode::kFailedPrecondition);

  EngineOptions options;
  options.schedule = TestSchedule(Tier::kCpu, Tier::kCpu, "");
  options.runtime = &gpu::DefaultHostOnlyRuntime();
  auto fresh = Engine::Create(options);
  REQUIRE_OK(fresh);
  CHECK((*fresh)->AddParameter({"w", "m", {0}, late.init, {}}).status().code() ==
        StatusCode::kInvalidArgument);
  CHECK((*fresh)->Start().code() == StatusCode::kFailedPrecondition);  // nothing registered
  options.schedule.param_tier = Tier::kNvme;                           // no nvme.path
  CHECK(Engine::Create(options).status().code() == StatusCode::kInvalidArgument);
}

TEST_CASE("Schedule JSON round-trips and rejects what it does not know") {
  Schedule s = TestSchedule(Tier::kNvme, Tier::kNvme, "/mnt/nvme/job");
  s.prefetch_bytes = 12345;
  s.nvme_io_threads = 4;
  auto back = ScheduleFromJson(ToJson(s), "schedule.json");
  REQUIRE_MESSAGE(back.ok(), back.status().ToString());
  CHECK(ToJson(*back) == ToJson(s));
  CHECK(back->nvme_io_threads == 4);
  CHECK(ToJson(s)["nvme"]["intra_op_parallelism"] == 4);
  CHECK(ToJson(Schedule{})["params"]["tier"] == "gpu");
  auto parse = [](const char* text) {
    return ScheduleFromJson(nlohmann::json::parse(text), "s.json").status();
  };
  CHECK_OK(parse("{}"));
  Status st = parse(R"({"params": {"teir": "cpu"}})");
  CHECK(st.code() == StatusCode::kInvalidArgument);
  CHECK(st.message().find("teir") != std::string::npos);
  CHECK(parse(R"({"version": 2})").message().find("version") != std::string::npos);
  CHECK(parse(R"({"params": {"tier": "nvme"}})").message().find("nvme.path") != std::string::npos);
  CHECK(parse(R"({"optimizer": {"buffer_count": 70000000000}})").message().find("buffer_count") !=
        std::string::npos);
  CHECK(parse(R"({"optimizer": {"tier": "gpu"}})").code() == StatusCode::kInvalidArgument);
  CHECK(parse(R"({"params": {"prefetch_bytes": -1}})").code() == StatusCode::kInvalidArgument);
  CHECK(parse(R"([])").code() == StatusCode::kInvalidArgument);
  CHECK(parse(R"({"nvme": {"intra_op_parallelism": 0}})")
            .message()
            .find("nvme.intra_op_parallelism") != std::string::npos);
  CHECK(parse(R"({"nvme": {"intra_op_parallelism": 65}})").code() == StatusCode::kInvalidArgument);
  // optimizer.state_slots: absent is 2 (the crash-safe store), 1 is kept, anything else refused
  // naming the key.
  CHECK(ScheduleFromJson(nlohmann::json::parse("{}"), "s.json")->optimizer_state_slots == 2);
  auto one = ScheduleFromJson(nlohmann::json::parse(R"({"optimizer": {"state_slots": 1}})"), "s");
  REQUIRE_OK(one);
  CHECK(one->optimizer_state_slots == 1);
  CHECK(ToJson(*one)["optimizer"]["state_slots"] == 1);
  for (const char* bad :
       {R"({"optimizer": {"state_slots": 0}})", R"({"optimizer": {"state_slots": 3}})",
        R"({"optimizer": {"state_slots": -1}})", R"({"optimizer": {"state_slots": "1"}})"}) {
    CAPTURE(bad);
    Status refused = parse(bad);
    CHECK(refused.code() == StatusCode::kInvalidArgument);
    CHECK(refused.message().find("optimizer.state_slots") != std::string::npos);
  }
}

}  // namespace
}  // namespace memplan::offload
