// Engine with world size > 1 (ZeRO-3 partitions) on the host-only runtime: 2 and 4 ranks on
// threads, joined by the thread-group collective, each with its own Engine, fed different
// gradients, end every step with exactly the parameters of one rank fed the mean of those
// gradients; every rank's tiers and optimizer hold about 1/world_size of the elements; a
// partitioned NVMe run resumes.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "offload/engine.h"
#include "offload/half.h"
#include "schedule/schedule.h"
#include "offload/thread_collective.h"
#include "tests/engine_testing.h"
#include "tests/status_testing.h"

namespace memplan::offload {
namespace {

using memplan::testing::Adam;
using memplan::testing::GradFn;
using memplan::testing::Init;
using memplan::testing::TempDir;
using memplan::testing::ToyModel;

// Module l's weight has 3001 + 37 l elements (offloaded; sizes that no world size divides), every
// bias 41 and m0 has a 3-element parameter "m0.scale" after the others (both resident: under the
// persistence threshold; the 3-element one has ranks whose shard is all padding). m0's weight is
// tied: the last module uses it too.
ToyModel Model(int layers) {
  ToyModel model(layers, 3001, 41, 37);
  model.Add("m0.scale", "m0", 3);
  model.params[0].also_used_by = {model.modules.back()};
  return model;
}

// Rank r's gradient of flat element e at step t.
float RankGrad(int r, uint64_t t, uint64_t e) {
  const uint64_t h = (e * 7919 + t * 104729 + static_cast<uint64_t>(r) * 15485863) % 1000003;
  return static_cast<float>(static_cast<double>(h) / 1000003.0 * 0.2 - 0.1) *
         (1.0f + 0.5f * static_cast<float>(r));
}

// What the ranks' gradients reduce to: summed in fp32 in rank order (as the thread collective
// does), rounded to the gradient type, divided by the world size.
float MeanGrad(int world, uint64_t t, uint64_t e, ElementType type) {
  float sum = RankGrad(0, t, e);
  if (type == ElementType::kBFloat16) sum = Bf16ToFloat(FloatToBf16(sum));
  for (int r = 1; r < world; ++r) {
    float g = RankGrad(r, t, e);
    if (type == ElementType::kBFloat16) g = Bf16ToFloat(FloatToBf16(g));
    sum += g;
  }
  if (type == ElementType::kBFloat16) sum = Bf16ToFloat(FloatToBf16(sum));
  return sum / static_cast<float>(world);
}

// TestSchedule with one optimizer thread a rank.
Schedule MakeSchedule(Tier params, Tier optimizer, ElementType dtype, const std::string& path) {
  Schedule s = memplan::testing::TestSchedule(params, optimizer, path, dtype);
  s.optimizer_threads = 1;
  return s;
}

// What one rank (or the single-rank reference) ends with: the working copies and master weights
// read out after the last step, and the engine's statistics.
struct Outcome : memplan::testing::Readout {
  EngineStats stats;
};

// TrainRank's `crash`: kNoCrash; kCrashBeforeLastStep, the rank is killed before its last Step();
// kSurvivor, another rank is, and this one stops after its last Step(). Neither reads out.
constexpr int kNoCrash = 0, kCrashBeforeLastStep = 1, kSurvivor = 2;

// Trains `steps` steps from `first_step` on one engine; every rank runs this on its own thread.
// Gradients are given in `grad_type`; each is overwritten right after GradReady() when `reuse`
// (world size > 1: the gradient has been reduced when GradReady returns).
Status TrainRank(const ToyModel& model, const Schedule& schedule, Collective* collective,
                 bool resume, uint64_t first_step, uint64_t steps, const GradFn& grad,
                 ElementType grad_type, bool reuse, Outcome* out, int crash = kNoCrash,
                 bool prepare = false) {
  memplan::testing::EngineRun run;
  EngineOptions options;
  options.schedule = schedule;
  options.collective = collective;
  options.resume = resume;
  MEMPLAN_RETURN_IF_ERROR(memplan::testing::StartToyEngine(model, options, &run));
  Engine& engine = *run.engine;
  for (uint64_t t = first_step; t < first_step + steps; ++t) {
    if (prepare) MEMPLAN_RETURN_IF_ERROR(engine.PrepareStep(Adam(t)));
    std::vector<std::vector<std::byte>> grads;  // kept until Step()
    MEMPLAN_RETURN_IF_ERROR(memplan::testing::ForwardBackward(engine, run.ids, model, model.modules,
                                                              t, grad, grad_type, &grads, reuse));
    if (crash == kCrashBeforeLastStep && t + 1 == first_step + steps) break;
    MEMPLAN_RETURN_IF_ERROR(engine.Step(Adam(t)));
  }
  if (crash != kNoCrash) return engine.Close();  // what a killed job leaves on disk
  // A frozen parameter has no master weights: its fetched copy is compared.
  MEMPLAN_RETURN_IF_ERROR(
      memplan::testing::ReadOut(engine, run.ids, model, schedule.param_dtype, out));
  out->stats = engine.stats();
  return engine.Close();
}

// Runs `world` ranks on threads; returns their outcomes.
std::vector<Outcome> TrainRanks(int world, const ToyModel& model, const Schedule& schedule,
                                bool resume, uint64_t first_step, uint64_t steps,
                                ElementType grad_type, int skip_last_step_rank = -1,
                                bool prepare = false) {
  auto group = CreateThreadGroupCollectives(world, nullptr, std::chrono::seconds(20));
  REQUIRE_OK(group);
  std::vector<Outcome> outcomes(static_cast<size_t>(world));
  std::vector<Status> status(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      const auto i = static_cast<size_t>(r);
      status[i] = TrainRank(
          model, schedule, (*group)[i].get(), resume, first_step, steps,
          [r](uint64_t t, uint64_t e) { return RankGrad(r, t, e); }, grad_type, /*reuse=*/true,
          &outcomes[i],
          skip_last_step_rank < 0 ? kNoCrash
                                  : (r == skip_last_step_rank ? kCrashBeforeLastStep : kSurvivor),
          prepare);
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < world; ++r) {
    CAPTURE(r);
    REQUIRE_MESSAGE(status[static_cast<size_t>(r)].ok(), status[static_cast<size_t>(r)].ToString());
  }
  return outcomes;
}

Outcome TrainReference(int world, const ToyModel& model, const Schedule& schedule, uint64_t steps,
                       ElementType grad_type) {
  Outcome out;
  Status st = TrainRank(
      model, schedule, nullptr, false, 1, steps,
      [world, grad_type](uint64_t t, uint64_t e) { return MeanGrad(world, t, e, grad_type); },
      ElementType::kFloat32, /*reuse=*/false, &out);
  REQUIRE_MESSAGE(st.ok(), st.ToString());
  return out;
}

void CheckSameAsReference(const ToyModel& model, const std::vector<Outcome>& ranks,
                          const Outcome& want) {
  for (size_t r = 0; r < ranks.size(); ++r) {
    CAPTURE(r);
    for (size_t i = 0; i < model.params.size(); ++i) {
      CAPTURE(model.params[i].name);
      CHECK(ranks[r].fetched[i] == want.fetched[i]);
      // A frozen parameter has no master weights: both empty (memcmp of two null data()
      // pointers is undefined, as UBSan says, even for 0 bytes).
      REQUIRE(ranks[r].master[i].size() == want.master[i].size());
      if (!want.master[i].empty()) {
        CHECK(std::memcmp(ranks[r].master[i].data(), want.master[i].data(),
                          want.master[i].size() * 4) == 0);
      }
    }
  }
}

uint64_t Partition(const ToyModel& model, int world) {
  uint64_t n = 0;
  for (const ToyModel::P& p : model.params) n += ShardElements(p.numel, world);
  return n;
}

TEST_CASE(
    "ZeRO-3 on threads: every rank ends with the parameters of one rank fed the mean "
    "gradient") {
  const ToyModel model = Model(4);
  constexpr uint64_t kSteps = 3;
  struct Combo {
    Tier params, optimizer;
  };
  for (int world : {2, 4}) {
    for (Combo c : {Combo{Tier::kGpu, Tier::kCpu}, Combo{Tier::kCpu, Tier::kCpu},
                    Combo{Tier::kNvme, Tier::kCpu}, Combo{Tier::kCpu, Tier::kNvme},
                    Combo{Tier::kNvme, Tier::kNvme}}) {
      CAPTURE(world);
      CAPTURE(TierName(c.params));
      CAPTURE(TierName(c.optimizer));
      TempDir dir("engine-zero3-");
      // Every rank is given the same nvme.path: the engine keeps each rank's stores apart.
      const Schedule s =
          MakeSchedule(c.params, c.optimizer, ElementType::kFloat32, dir.PathOf("ranks"));
      const std::vector<Outcome> ranks =
          TrainRanks(world, model, s, false, 1, kSteps, ElementType::kFloat32);
      const Schedule single =
          MakeSchedule(c.params, c.optimizer, ElementType::kFloat32, dir.PathOf("single"));
      const Outcome want = TrainReference(world, model, single, kSteps, ElementType::kFloat32);
      CheckSameAsReference(model, ranks, want);
      // The fp32 working copy is the master weights.
      for (size_t i = 0; i < model.params.size(); ++i) {
        CHECK(std::memcmp(ranks[0].fetched[i].data(), ranks[0].master[i].data(),
                          ranks[0].master[i].size() * 4) == 0);
      }
      const uint64_t partition = Partition(model, world);
      const auto w = static_cast<uint64_t>(world);
      CHECK(partition * w >= model.total);
      CHECK(partition * w < model.total + w * model.params.size());
      for (int r = 0; r < world; ++r) {
        CAPTURE(r);
        const EngineStats& st = ranks[static_cast<size_t>(r)].stats;
        CHECK(st.rank == r);
        CHECK(st.world_size == world);
        CHECK(st.elements == model.total);
        CHECK(st.partition_elements == partition);
        CHECK(st.d2h_bytes == kSteps * 4 * partition);
        CHECK(st.reduce_scatter_bytes == kSteps * 4 * w * partition);
        CHECK(st.param.allgather_bytes > 0);
        if (c.params == Tier::kNvme) {
          // Start and every step write this rank's partition, no more.
          CHECK(st.param.nvme_write_bytes == (kSteps + 1) * 4 * partition);
        }
        if (c.optimizer == Tier::kNvme) {
          // About 1/world_size of what one rank holding everything writes.
          CHECK(st.optimizer_write_bytes * w * 10 < want.stats.optimizer_write_bytes * 13);
          CHECK(st.optimizer_write_bytes * w * 10 > want.stats.optimizer_write_bytes * 7);
        }
      }
      CHECK(want.stats.world_size == 1);
      CHECK(want.stats.partition_elements == model.total);
    }
  }
}

TEST_CASE("ZeRO-3 on threads, the optimizer overlapped with backward: the serial results") {
  // Every rank prepares its steps; the reduce-scatters stay in GradReady() in call order and the
  // background sub-group steps call no collective, so the ranks end where one rank stepping
  // serially on the mean gradient does, bit for bit, and a rank that stopped before its last
  // step still resumes with the others at the step they all completed.
  const ToyModel model = Model(4);
  for (Tier params : {Tier::kCpu, Tier::kNvme}) {
    CAPTURE(TierName(params));
    TempDir dir("engine-zero3-");
    const Schedule s =
        MakeSchedule(params, Tier::kNvme, ElementType::kFloat32, dir.PathOf("ranks"));
    const std::vector<Outcome> ranks =
        TrainRanks(2, model, s, false, 1, 3, ElementType::kFloat32, -1, /*prepare=*/true);
    const Schedule single =
        MakeSchedule(params, Tier::kNvme, ElementType::kFloat32, dir.PathOf("single"));
    const Outcome want = TrainReference(2, model, single, 3, ElementType::kFloat32);
    CheckSameAsReference(model, ranks, want);
    for (const Outcome& rank : ranks) CHECK(rank.stats.step_profile.overlapped);
  }
  // A rank that stopped with its last step prepared (half stepped during its backward) and never
  // finished: nothing of that step is committed, and the ranks resume together (no resident
  // parameters, so Step() has no collective; Note [Resuming ranks]).
  TempDir dir("engine-zero3-");
  Schedule s = MakeSchedule(Tier::kNvme, Tier::kNvme, ElementType::kFloat32, dir.PathOf("ranks"));
  s.persistence_threshold = 0;
  (void)TrainRanks(2, model, s, false, 1, 3, ElementType::kFloat32, /*skip_last_step_rank=*/1,
                   /*prepare=*/true);
  const std::vector<Outcome> ranks =
      TrainRanks(2, model, s, true, 3, 2, ElementType::kFloat32, -1, /*prepare=*/true);
  for (const Outcome& o : ranks) CHECK(o.stats.epoch == 4);
  Schedule single = s;
  single.nvme_path = dir.PathOf("single");
  CheckSameAsReference(model, ranks, TrainReference(2, model, single, 4, ElementType::kFloat32));
}

TEST_CASE("ZeRO-3 on threads: bf16 parameters and gradients gather and reduce in 16 bits") {
  const ToyModel model = Model(3);
  TempDir dir("engine-zero3-");
  const Schedule s =
      MakeSchedule(Tier::kCpu, Tier::kCpu, ElementType::kBFloat16, dir.PathOf("nvme"));
  const std::vector<Outcome> ranks = TrainRanks(2, model, s, false, 1, 2, ElementType::kBFloat16);
  const Outcome want = TrainReference(2, model, s, 2, ElementType::kBFloat16);
  CheckSameAsReference(model, ranks, want);
  // The fetched bf16 copy is the rounded master weights.
  for (size_t i = 0; i < model.params.size(); ++i) {
    size_t wrong = 0;
    for (size_t k = 0; k < ranks[1].master[i].size(); ++k) {
      uint16_t h;
      std::memcpy(&h, ranks[1].fetched[i].data() + k * 2, 2);
      wrong += h != FloatToBf16(ranks[1].master[i][k]);
    }
    CHECK(wrong == 0);
  }
}

TEST_CASE("ZeRO-3 on threads: a partitioned NVMe run resumes on every rank") {
  const ToyModel model = Model(3);
  TempDir dir("engine-zero3-");
  const Schedule s =
      MakeSchedule(Tier::kNvme, Tier::kNvme, ElementType::kFloat32, dir.PathOf("nvme"));
  (void)TrainRanks(4, model, s, false, 1, 2, ElementType::kFloat32);
  const std::vector<Outcome> ranks = TrainRanks(4, model, s, true, 3, 1, ElementType::kFloat32);
  for (const Outcome& o : ranks) CHECK(o.stats.epoch == 3);
  const Outcome want = TrainReference(
      4, model, MakeSchedule(Tier::kNvme, Tier::kNvme, ElementType::kFloat32, dir.PathOf("single")),
      3, ElementType::kFloat32);
  CheckSameAsReference(model, ranks, want);
}

TEST_CASE("ZeRO-3 on threads: a rank a step behind the others makes them all resume there") {
  // No resident parameters: Step() has no collective, so one rank can commit a step another never
  // reached (killed between them). On resume the ranks agree on the oldest rank's last step.
  const ToyModel model = Model(2);
  TempDir dir("engine-zero3-");
  Schedule s = MakeSchedule(Tier::kNvme, Tier::kNvme, ElementType::kFloat32, dir.PathOf("nvme"));
  s.persistence_threshold = 0;
  (void)TrainRanks(2, model, s, false, 1, 3, ElementType::kFloat32, /*skip_last_step_rank=*/1);
  const std::vector<Outcome> ranks = TrainRanks(2, model, s, true, 3, 2, ElementType::kFloat32);
  for (const Outcome& o : ranks) CHECK(o.stats.epoch == 4);
  Schedule single = s;
  single.nvme_path = dir.PathOf("single");
  CheckSameAsReference(model, ranks, TrainReference(2, model, single, 4, ElementType::kFloat32));
}

TEST_CASE("ZeRO-3 on threads: frozen parameters are sharded, gathered, never stepped") {
  // m0's and m2's weights frozen (m0's is tied to the last module too): every rank holds a shard
  // of them after the trainable ones, fetches gather them whole, and the trainable ones end as
  // one rank fed the mean gradient.
  ToyModel model = Model(3);
  model.params[0].frozen = true;
  model.params[4].frozen = true;
  TempDir dir("engine-zero3-");
  const Schedule s =
      MakeSchedule(Tier::kNvme, Tier::kNvme, ElementType::kBFloat16, dir.PathOf("nvme"));
  const std::vector<Outcome> ranks = TrainRanks(2, model, s, false, 1, 3, ElementType::kFloat32);
  Schedule single = s;
  single.nvme_path = dir.PathOf("single");
  const Outcome want = TrainReference(2, model, single, 3, ElementType::kFloat32);
  CheckSameAsReference(model, ranks, want);
  for (const Outcome& o : ranks) {
    CHECK(o.stats.frozen_params == 2);
    CHECK(o.stats.optimizer_elements * 2 < o.stats.elements - o.stats.frozen_elements + 8);
    // The frozen weights are their init values, rounded to bf16.
    for (size_t i : {size_t{0}, size_t{4}}) {
      const ToyModel::P& p = model.params[i];
      size_t wrong = 0;
      for (uint64_t k = 0; k < p.numel; ++k) {
        uint16_t h = 0;
        std::memcpy(&h, o.fetched[i].data() + k * 2, 2);
        wrong += h != FloatToBf16(Init(p.flat + k));
      }
      CHECK(wrong == 0);
    }
  }
}

TEST_CASE("ZeRO-3 on threads: ranks that fetch different modules get an error, not a hang") {
  ToyModel model = Model(2);
  model.params[0].also_used_by.clear();  // m1 fetches its own weights only
  TempDir dir("engine-zero3-");
  auto group = CreateThreadGroupCollectives(2, nullptr, std::chrono::seconds(20));
  REQUIRE_OK(group);
  std::vector<Status> fetched(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      memplan::testing::EngineRun run;
      EngineOptions options;
      options.schedule = MakeSchedule(Tier::kCpu, Tier::kCpu, ElementType::kFloat32, "");
      options.collective = (*group)[static_cast<size_t>(r)].get();
      Status st = memplan::testing::StartToyEngine(model, options, &run);
      // The ranks disagree: rank 0 fetches m0, rank 1 m1, whose weights differ in size.
      if (st.ok()) st = run.engine->Fetch(r == 0 ? "m0" : "m1");
      fetched[static_cast<size_t>(r)] = st;
      if (run.engine != nullptr) (void)run.engine->Close();
    });
  }
  for (std::thread& t : threads) t.join();
  for (const Status& st : fetched) {
    CHECK(st.code() == StatusCode::kInvalidArgument);
    CHECK(st.message().find("same calls") != std::string::npos);
  }
}

}  // namespace
}  // namespace memplan::offload
