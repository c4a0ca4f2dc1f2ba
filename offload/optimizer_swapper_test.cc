// OptimizerSwapper: the pipelined step over an NVMe store gives exactly the in-memory optimizer's
// results, persists across Close/Open, refuses stale gradients, survives injected I/O faults with
// the committed step intact, and recovers the last complete step after a SIGKILL mid-step.
#include "offload/optimizer_swapper.h"

#include <doctest/doctest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "nvme/fault_backend.h"
#include "offload/half.h"
#include "tests/testing.h"
#include "tests/status_testing.h"

namespace memplan::offload {
namespace {

using memplan::testing::TempDir;

constexpr uint64_t kSubGroup = 1024;

// Deterministic values of element e: initial parameters, and the gradient of step t.
float InitialParam(uint64_t e) { return static_cast<float>((e % 97) * 0.01 - 0.48); }
float Grad(uint64_t step, uint64_t e) {
  return static_cast<float>(((e * 31 + step * 17) % 113) * 0.002 - 0.11);
}

OptimizerSwapperOptions MakeOptions(const std::string& dir, SwapOptimizer optimizer,
                                    uint32_t buffers = 3) {
  OptimizerSwapperOptions o;
  o.store.directory = dir;
  o.store.direct = false;  // test directories may sit on tmpfs
  o.store.backend = nvme::BackendKind::kPosix;
  o.store.checksum_block_bytes = 4096;
  o.sub_group_elements = kSubGroup;
  o.buffer_count = buffers;
  o.optimizer = optimizer;
  o.cpu.threads = 2;
  return o;
}

AdamOptions Adam(uint64_t step) {
  AdamOptions a;
  a.lr = 1e-3 * (1.0 + 0.1 * static_cast<double>(step));  // a schedule: options vary per step
  a.weight_decay = 0.01;
  return a;
}

ParamFiller Filler() {
  return [](uint64_t first, std::span<float> out) {
    for (size_t k = 0; k < out.size(); ++k) out[k] = InitialParam(first + k);
    return Status::Ok();
  };
}

Status WriteAllGradients(OptimizerSwapper& swapper, uint64_t step) {
  for (uint64_t i = 0; i < swapper.sub_group_count(); ++i) {
    std::vector<float> g(swapper.SubGroupSize(i));
    for (size_t k = 0; k < g.size(); ++k) g[k] = Grad(step, swapper.SubGroupBegin(i) + k);
    MEMPLAN_RETURN_IF_ERROR(swapper.WriteGradients(i, g));
  }
  return Status::Ok();
}

// The same optimizer over whole arrays in memory.
struct Reference {
  std::vector<float> p, m, v;
  std::unique_ptr<CpuOptimizer> cpu;
  explicit Reference(uint64_t n) : p(n), m(n, 0.0f), v(n, 0.0f) {
    for (uint64_t e = 0; e < n; ++e) p[e] = InitialParam(e);
    CpuOptimizerOptions o;
    o.threads = 1;
    cpu = std::move(CpuOptimizer::Create(o)).value();
  }
  void AdamSteps(uint64_t from, uint64_t to) {
    for (uint64_t t = from + 1; t <= to; ++t) {
      std::vector<float> g(p.size());
      for (size_t e = 0; e < g.size(); ++e) g[e] = Grad(t, e);
      AdamTensors tensors{p, g, m, v, {}, {}, HalfDtype::kNone, {}, HalfDtype::kNone};
      REQUIRE_OK(cpu->AdamStep(Adam(t), static_cast<int64_t>(t), tensors));
    }
  }
};

std::vector<float> ReadAll(OptimizerSwapper& swapper, int state) {
  std::vector<float> out(swapper.num_elements());
  for (uint64_t i = 0; i < swapper.sub_group_count(); ++i) {
    std::span<float> part(out.data() + swapper.SubGroupBegin(i), swapper.SubGroupSize(i));
    Status st = state < 0 ? swapper.ReadParams(i, part) : swapper.ReadState(i, state, part);
    REQUIRE_MESSAGE(st.ok(), st.ToString());
  }
  return out;
}

void RequireEqualBits(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  size_t mismatches = 0;
  for (size_t k = 0; k < a.size(); ++k) mismatches += std::memcmp(&a[k], &b[k], 4) != 0;
  REQUIRE(mismatches == 0);
}

// Makes the swapper's backend a FaultBackend over the POSIX one; *faults points at it once the
// swapper has made it (Create or Open), for the test to arm with SetPlan.
void InstallFaults(OptimizerSwapperOptions& options, nvme::FaultBackend** faults) {
  options.make_backend = [faults]() -> Result<std::unique_ptr<nvme::Backend>> {
    MEMPLAN_ASSIGN_OR_RETURN(auto inner, nvme::CreatePosixBackend({}));
    MEMPLAN_ASSIGN_OR_RETURN(auto wrapped, nvme::FaultBackend::Create(std::move(inner)));
    *faults = wrapped.get();
    return std::unique_ptr<nvme::Backend>(std::move(wrapped));
  };
}

TEST_CASE("OptimizerSwapper steps bit-identically to the in-memory AdamW, for any buffer count") {
  for (uint32_t buffers : {2u, 3u, 5u}) {
    CAPTURE(buffers);
    TempDir dir("swapper-");
    const uint64_t n = 7 * kSubGroup + 300;  // 8 sub-groups, the last one short: > 2x the buffers
    auto swapper = OptimizerSwapper::Create(
        MakeOptions(dir.PathOf("store"), SwapOptimizer::kAdam, buffers), n, Filler());
    REQUIRE_MESSAGE(swapper.ok(), swapper.status().ToString());
    OptimizerSwapper& s = **swapper;
    REQUIRE(s.sub_group_count() == 8);
    REQUIRE(s.SubGroupSize(7) == 300);
    for (uint64_t t = 1; t <= 4; ++t) {
      REQUIRE_OK(WriteAllGradients(s, t));
      std::vector<uint64_t> seen;
      Status st = s.Step(Adam(t), [&](const SubGroupUpdate& u) {
        seen.push_back(u.sub_group);
        CHECK(u.first_element == u.sub_group * kSubGroup);
        CHECK(u.half_params.empty());
        return Status::Ok();
      });
      REQUIRE_MESSAGE(st.ok(), st.ToString());
      CHECK(seen == std::vector<uint64_t>{0, 1, 2, 3, 4, 5, 6, 7});
      CHECK(s.epoch() == t);
    }
    Reference ref(n);
    ref.AdamSteps(0, 4);
    RequireEqualBits(ReadAll(s, -1), ref.p);
    RequireEqualBits(ReadAll(s, 0), ref.m);
    RequireEqualBits(ReadAll(s, 1), ref.v);
    const SwapStepStats last = s.stats().last_step;
    // Each step reads states + gradients and writes states once: 4 KiB header + 12 B/element in,
    // 16 B/element in total read.
    CHECK(last.read_bytes == 8 * 4096 + 16 * n);
    CHECK(last.write_bytes == 8 * 4096 + 12 * n);
    CHECK(s.stats().pool.peak_bytes <=
          buffers * OptimizerSwapper::RequiredSlotBytes(MakeOptions("x", SwapOptimizer::kAdam)) +
              buffers * 4096);
  }
}

// The gradients of step t for sub-group i, as a trainer's backward leaves them in memory.
std::vector<float> GradientsOf(const OptimizerSwapper& s, uint64_t step, uint64_t i) {
  std::vector<float> g(s.SubGroupSize(i));
  for (size_t k = 0; k < g.size(); ++k) g[k] = Grad(step, s.SubGroupBegin(i) + k);
  return g;
}

TEST_CASE("An overlapped step, sub-groups handed over in reverse from another thread, is Step()") {
  for (uint32_t buffers : {2u, 3u}) {
    CAPTURE(buffers);
    TempDir dir("swapper-");
    const uint64_t n = 7 * kSubGroup + 300;
    auto swapper = OptimizerSwapper::Create(
        MakeOptions(dir.PathOf("store"), SwapOptimizer::kAdam, buffers), n, Filler());
    REQUIRE_MESSAGE(swapper.ok(), swapper.status().ToString());
    OptimizerSwapper& s = **swapper;
    uint64_t read_ahead = 0;
    for (uint64_t t = 1; t <= 4; ++t) {
      // Step 3 takes sub-groups 0 and 5 from the store (written the old way), the rest in memory.
      if (t == 3) {
        REQUIRE_OK(s.WriteGradients(0, GradientsOf(s, t, 0)));
        REQUIRE_OK(s.WriteGradients(5, GradientsOf(s, t, 5)));
      }
      std::vector<uint64_t> seen;
      REQUIRE(s.BeginStep(Adam(t), [&](const SubGroupUpdate& u) {
                 seen.push_back(u.sub_group);
                 return Status::Ok();
               }).ok());
      CHECK(s.step_begun());
      CHECK(s.BeginStep(Adam(t)).code() == StatusCode::kFailedPrecondition);
      std::vector<std::vector<float>> grads(s.sub_group_count());
      std::atomic<uint64_t> released{0};
      std::thread backward([&] {
        for (uint64_t i = s.sub_group_count(); i-- > 0;) {
          std::this_thread::sleep_for(std::chrono::milliseconds(2));  // backward computing
          const bool stored = t == 3 && (i == 0 || i == 5);
          if (!stored) grads[i] = GradientsOf(s, t, i);
          Status st = s.StepSubGroup(i, grads[i], {}, [&released] { ++released; });
          CHECK_MESSAGE(st.ok(), st.ToString());
        }
      });
      backward.join();
      CHECK(s.StepSubGroup(2, grads[2]).code() == StatusCode::kInvalidArgument);  // twice
      REQUIRE_OK(s.WaitForUpdates());
      const Status finished = s.FinishStep();
      REQUIRE_MESSAGE(finished.ok(), finished.ToString());
      CHECK_FALSE(s.step_begun());
      CHECK(released == s.sub_group_count());  // every `done` once, the stored ones' included
      CHECK(seen == std::vector<uint64_t>{7, 6, 5, 4, 3, 2, 1, 0});
      CHECK(s.epoch() == t);
      const SwapStepStats last = s.stats().last_step;
      // Gradients in memory are neither written nor read: only the states move.
      const uint64_t stored_grads = t == 3 ? 4 * 2 * kSubGroup : 0;
      CHECK(last.read_bytes == 8 * 4096 + 12 * n + stored_grads);
      CHECK(last.write_bytes == 8 * 4096 + 12 * n);
      CHECK(last.sub_groups_in_memory == (t == 3 ? 6u : 8u));
      CHECK(last.updates_done_s > 0);
      read_ahead += last.sub_groups_read_ahead;
    }
    // The reader is idle between hand-overs: it reads the next sub-groups' states before they
    // come (Note [Reading states ahead]); the exact byte counts above show none was read twice.
    CHECK(read_ahead > 0);
    Reference ref(n);
    ref.AdamSteps(0, 4);
    RequireEqualBits(ReadAll(s, -1), ref.p);
    RequireEqualBits(ReadAll(s, 0), ref.m);
    RequireEqualBits(ReadAll(s, 1), ref.v);
  }
}

TEST_CASE("Sub-groups handed over in an unexpected order: guesses given up, results the same") {
  // The first overlapped step expects backward's order (the last sub-group first); these come
  // first to last, so the states read ahead are given up for the sub-groups that do come. The
  // next step expects the order seen, and reads nothing twice.
  TempDir dir("swapper-");
  const uint64_t n = 6 * kSubGroup;
  auto swapper = OptimizerSwapper::Create(
      MakeOptions(dir.PathOf("store"), SwapOptimizer::kAdam, /*buffers=*/2), n, Filler());
  REQUIRE_OK(swapper);
  OptimizerSwapper& s = **swapper;
  for (uint64_t t = 1; t <= 3; ++t) {
    REQUIRE_OK(s.BeginStep(Adam(t)));
    std::vector<std::vector<float>> grads(s.sub_group_count());
    for (uint64_t i = 0; i < s.sub_group_count(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(3));
      grads[i] = GradientsOf(s, t, i);
      REQUIRE_OK(s.StepSubGroup(i, grads[i]));
    }
    REQUIRE_OK(s.FinishStep());
    const SwapStepStats last = s.stats().last_step;
    CHECK(last.read_bytes >= 6 * 4096 + 12 * n);
    if (t > 1) CHECK(last.read_bytes == 6 * 4096 + 12 * n);
  }
  Reference ref(n);
  ref.AdamSteps(0, 3);
  RequireEqualBits(ReadAll(s, -1), ref.p);
  RequireEqualBits(ReadAll(s, 1), ref.v);
}

TEST_CASE("An abandoned step is not resumed from, even with every sub-group written") {
  // From the third step on, a step writes its sub-groups' other slots in place (their keys exist
  // from two steps before), so a step abandoned after its last sub-group leaves every sub-group
  // holding it whole. Only FinishStep() commits: reopening finds the step before.
  TempDir dir("swapper-");
  const uint64_t n = 4 * kSubGroup;
  const OptimizerSwapperOptions options = MakeOptions(dir.PathOf("store"), SwapOptimizer::kAdam);
  {
    auto swapper = OptimizerSwapper::Create(options, n, Filler());
    REQUIRE_OK(swapper);
    OptimizerSwapper& s = **swapper;
    for (uint64_t t = 1; t <= 3; ++t) {
      REQUIRE_OK(s.BeginStep(Adam(t)));
      std::vector<std::vector<float>> grads(s.sub_group_count());
      for (uint64_t i = 0; i < s.sub_group_count(); ++i) {
        grads[i] = GradientsOf(s, t, i);
        REQUIRE_OK(s.StepSubGroup(i, grads[i]));
      }
      if (t < 3) {
        REQUIRE_OK(s.FinishStep());
      } else {
        REQUIRE_OK(s.WaitForUpdates());  // every sub-group of step 3 is written
        s.AbortStep();
      }
    }
    REQUIRE_OK(s.Close());
  }
  RecoveryReport report;
  auto reopened = OptimizerSwapper::Open(options, &report);
  REQUIRE_MESSAGE(reopened.ok(), reopened.status().ToString());
  CHECK((*reopened)->epoch() == 2);
  Reference ref(n);
  ref.AdamSteps(0, 2);
  RequireEqualBits(ReadAll(**reopened, -1), ref.p);
}

TEST_CASE("An overlapped step refuses misuse and reports a sub-group never handed over") {
  TempDir dir("swapper-");
  const uint64_t n = 4 * kSubGroup;
  auto swapper =
      OptimizerSwapper::Create(MakeOptions(dir.PathOf("store"), SwapOptimizer::kAdam), n, Filler());
  REQUIRE_OK(swapper);
  OptimizerSwapper& s = **swapper;
  std::vector<float> g = GradientsOf(s, 1, 1);
  CHECK(s.StepSubGroup(1, g).code() == StatusCode::kFailedPrecondition);  // nothing begun
  CHECK(s.FinishStep().code() == StatusCode::kFailedPrecondition);
  CHECK(s.BeginStep(SgdOptions{}).code() == StatusCode::kInvalidArgument);
  REQUIRE_OK(s.BeginStep(Adam(1)));
  CHECK(s.Step(Adam(1)).code() == StatusCode::kFailedPrecondition);
  CHECK(s.StepSubGroup(9, g).code() == StatusCode::kInvalidArgument);
  CHECK(s.StepSubGroup(1, std::span<const float>(g).first(10)).code() ==
        StatusCode::kInvalidArgument);
  CHECK(s.StepSubGroup(2, {}).code() == StatusCode::kFailedPrecondition);  // none written
  REQUIRE_OK(s.StepSubGroup(1, g));
  const Status waited = s.WaitForUpdates();
  CHECK(waited.code() == StatusCode::kFailedPrecondition);
  CHECK(waited.message().find("sub-group 0") != std::string::npos);
  const Status finished = s.FinishStep();
  CHECK(finished.code() == StatusCode::kFailedPrecondition);
  CHECK(finished.message().find("sub-group 0 was never handed over") != std::string::npos);
  CHECK(s.epoch() == 0);
  CHECK_FALSE(s.step_begun());
  // Abandoned without a trace; the next step is whole.
  REQUIRE_OK(s.BeginStep(Adam(1)));
  s.AbortStep();
  REQUIRE_OK(WriteAllGradients(s, 1));
  REQUIRE_OK(s.Step(Adam(1)));
  Reference ref(n);
  ref.AdamSteps(0, 1);
  RequireEqualBits(ReadAll(s, -1), ref.p);
}

TEST_CASE("OptimizerSwapper steps 16-bit gradients: half the gradient bytes, the same bits") {
  for (HalfDtype grad_dtype : {HalfDtype::kBf16, HalfDtype::kFp16}) {
    for (nvme::BackendKind backend : {nvme::BackendKind::kPosix, nvme::BackendKind::kAuto}) {
      CAPTURE(HalfDtypeName(grad_dtype));
      CAPTURE(nvme::BackendKindName(backend));
      TempDir dir("swapper-");
      auto options = MakeOptions(dir.PathOf("store"), SwapOptimizer::kAdam);
      options.grad_dtype = grad_dtype;
      options.half_dtype = HalfDtype::kBf16;
      options.store.backend = backend;
      const uint64_t n = 5 * kSubGroup + 77;
      auto swapper = OptimizerSwapper::Create(options, n, Filler());
      REQUIRE_MESSAGE(swapper.ok(), swapper.status().ToString());
      OptimizerSwapper& s = **swapper;
      // The reference: the same gradients, rounded to 16 bits, widened back to fp32 first.
      Reference ref(n);
      std::vector<uint16_t> half_params(n), ref_half(n);
      for (uint64_t t = 1; t <= 3; ++t) {
        std::vector<float> widened(n);
        for (uint64_t i = 0; i < s.sub_group_count(); ++i) {
          std::vector<uint16_t> g(s.SubGroupSize(i));
          for (size_t k = 0; k < g.size(); ++k) {
            const uint64_t e = s.SubGroupBegin(i) + k;
            g[k] =
                grad_dtype == HalfDtype::kBf16 ? FloatToBf16(Grad(t, e)) : FloatToFp16(Grad(t, e));
            widened[e] = grad_dtype == HalfDtype::kBf16 ? Bf16ToFloat(g[k]) : Fp16ToFloat(g[k]);
          }
          CHECK(s.WriteGradients(i, std::vector<float>(g.size())).code() ==
                StatusCode::kFailedPrecondition);
          REQUIRE_OK(s.WriteHalfGradients(i, g));
        }
        REQUIRE(s.Step(Adam(t), [&](const SubGroupUpdate& u) {
                   std::copy(u.half_params.begin(), u.half_params.end(),
                             half_params.begin() + static_cast<int64_t>(u.first_element));
                   return Status::Ok();
                 }).ok());
        AdamTensors tensors{ref.p,    widened,          ref.m, ref.v,           {},
                            ref_half, HalfDtype::kBf16, {},    HalfDtype::kNone};
        REQUIRE_OK(ref.cpu->AdamStep(Adam(t), static_cast<int64_t>(t), tensors));
      }
      RequireEqualBits(ReadAll(s, -1), ref.p);
      RequireEqualBits(ReadAll(s, 0), ref.m);
      RequireEqualBits(ReadAll(s, 1), ref.v);
      CHECK(half_params == ref_half);
      // 6 sub-groups: states and 2-byte gradients in, states out.
      const SwapStepStats last = s.stats().last_step;
      CHECK(last.read_bytes == 6 * 4096 + 14 * n);
      CHECK(last.write_bytes == 6 * 4096 + 12 * n);
      const nvme::SwapStoreStats store = s.stats().store;
      if (store.backend == "io_uring") {
        // Its pinned buffers are registered: every request of a step names one.
        CHECK(store.registered_buffer_bytes >= 3 * OptimizerSwapper::RequiredSlotBytes(options));
        CHECK(store.io.registered_ops > 0);
      }
      REQUIRE_OK(s.Close());
    }
  }
  TempDir dir("swapper-");
  auto fp32 = OptimizerSwapper::Create(MakeOptions(dir.PathOf("store"), SwapOptimizer::kAdam),
                                       kSubGroup, Filler());
  REQUIRE_OK(fp32);
  CHECK((*fp32)->WriteHalfGradients(0, std::vector<uint16_t>(kSubGroup)).code() ==
        StatusCode::kFailedPrecondition);
  auto sgd = MakeOptions(dir.PathOf("sgd"), SwapOptimizer::kSgd);
  sgd.grad_dtype = HalfDtype::kBf16;
  CHECK(sgd.Validate().message().find("needs Adam") != std::string::npos);
}

TEST_CASE("OptimizerSwapper hands the bf16 copy of each sub-group to the callback") {
  TempDir dir("swapper-");
  auto options = MakeOptions(dir.PathOf("store"), SwapOptimizer::kAdam);
  options.half_dtype = HalfDtype::kBf16;
  const uint64_t n = 3 * kSubGroup;
  auto swapper = OptimizerSwapper::Create(options, n, Filler());
  REQUIRE_OK(swapper);
  REQUIRE_OK(WriteAllGradients(**swapper, 1));
  std::vector<uint16_t> half(n);
  REQUIRE((*swapper)
              ->Step(Adam(1),
                     [&](const SubGroupUpdate& u) {
                       REQUIRE(u.half_params.size() == u.params.size());
                       std::copy(u.half_params.begin(), u.half_params.end(),
                                 half.begin() + static_cast<long>(u.first_element));
                       return Status::Ok();
                     })
              .ok());
  std::vector<float> params = ReadAll(**swapper, -1);
  std::vector<uint16_t> expected(n);
  auto cpu = CpuOptimizer::Create({});
  REQUIRE_OK(cpu);
  REQUIRE_OK((*cpu)->ConvertToHalf(params, expected, HalfDtype::kBf16));
  CHECK(half == expected);
}

TEST_CASE("OptimizerSwapper refuses stale gradients and mismatched options") {
  TempDir dir("swapper-");
  auto swapper = OptimizerSwapper::Create(MakeOptions(dir.PathOf("store"), SwapOptimizer::kAdam),
                                          2 * kSubGroup, Filler());
  REQUIRE_OK(swapper);
  OptimizerSwapper& s = **swapper;
  std::vector<float> g(kSubGroup, 0.01f);
  REQUIRE_OK(s.WriteGradients(0, g));
  Status st = s.Step(Adam(1));
  CHECK(st.code() == StatusCode::kFailedPrecondition);
  CHECK(st.message().find("sub-group 1") != std::string::npos);
  REQUIRE_OK(s.WriteGradients(1, g));
  CHECK(s.Step(SgdOptions{}).code() == StatusCode::kInvalidArgument);
  AdamOptions ams = Adam(1);
  ams.amsgrad = true;
  CHECK(s.Step(ams).code() == StatusCode::kInvalidArgument);
  CHECK(s.WriteGradients(0, std::vector<float>(5)).code() == StatusCode::kInvalidArgument);
  CHECK(s.WriteGradients(2, g).code() == StatusCode::kInvalidArgument);
  REQUIRE_OK(s.Step(Adam(1)));
  // Gradients are consumed by a step: the next one needs new ones.
  CHECK(s.Step(Adam(2)).code() == StatusCode::kFailedPrecondition);
  CHECK(s.epoch() == 1);
}

TEST_CASE("OptimizerSwapper options are validated, and Create leaves nothing behind on failure") {
  TempDir dir("swapper-");
  auto options = MakeOptions(dir.PathOf("store"), SwapOptimizer::kAdam);
  options.sub_group_elements = 1000;
  CHECK(OptimizerSwapper::Create(options, 10, Filler()).status().code() ==
        StatusCode::kInvalidArgument);
  options.sub_group_elements = kSubGroup;
  options.buffer_count = 1;
  CHECK(OptimizerSwapper::Create(options, 10, Filler()).status().code() ==
        StatusCode::kInvalidArgument);
  options.buffer_count = 3;
  auto failing = [](uint64_t first, std::span<float>) {
    return first >= kSubGroup ? Status::IoError("checkpoint shard missing") : Status::Ok();
  };
  auto created = OptimizerSwapper::Create(options, 3 * kSubGroup, failing);
  CHECK(created.status().code() == StatusCode::kIoError);
  CHECK(created.status().message().find("sub-group 1") != std::string::npos);
  CHECK_FALSE(std::filesystem::exists(dir.PathOf("store")));
  // A pool whose slots are too small is refused with the size needed.
  PinnedPoolOptions po;
  po.slot_bytes = 4096;
  po.slot_count = 3;
  po.budget_bytes = 3 * 4096;
  auto pool = PinnedPool::Create(po);
  REQUIRE_OK(pool);
  options.pool = pool->get();
  created = OptimizerSwapper::Create(options, 3 * kSubGroup, Filler());
  CHECK(created.status().code() == StatusCode::kInvalidArgument);
  CHECK(created.status().message().find(
            std::to_string(OptimizerSwapper::RequiredSlotBytes(options))) != std::string::npos);
}

TEST_CASE("OptimizerSwapper reopens at its last step after Close, and the states carry on") {
  TempDir dir("swapper-");
  const uint64_t n = 4 * kSubGroup + 10;
  auto options = MakeOptions(dir.PathOf("store"), SwapOptimizer::kAdam);
  {
    auto swapper = OptimizerSwapper::Create(options, n, Filler());
    REQUIRE_OK(swapper);
    for (uint64_t t = 1; t <= 3; ++t) {
      REQUIRE_OK(WriteAllGradients(**swapper, t));
      REQUIRE_OK((*swapper)->Step(Adam(t)));
    }
    REQUIRE_OK((*swapper)->Close());
  }
  CHECK(OptimizerSwapper::Create(options, n, Filler()).status().code() != StatusCode::kOk);
  auto wrong = options;
  wrong.optimizer = SwapOptimizer::kLion;
  CHECK(OptimizerSwapper::Open(wrong).status().code() == StatusCode::kInvalidArgument);
  RecoveryReport report;
  auto swapper = OptimizerSwapper::Open(options, &report);
  REQUIRE_MESSAGE(swapper.ok(), swapper.status().ToString());
  CHECK(report.epoch == 3);
  CHECK_FALSE(report.torn);
  CHECK((*swapper)->epoch() == 3);
  CHECK((*swapper)->num_elements() == n);
  REQUIRE_OK(WriteAllGradients(**swapper, 4));
  REQUIRE_OK((*swapper)->Step(Adam(4)));
  Reference ref(n);
  ref.AdamSteps(0, 4);
  RequireEqualBits(ReadAll(**swapper, -1), ref.p);
  RequireEqualBits(ReadAll(**swapper, 1), ref.v);
}

TEST_CASE("OptimizerSwapper goes back one step on request (max_epoch), not two") {
  // A data-parallel rank one step ahead of another resumes at the other's step.
  TempDir dir("swapper-");
  const uint64_t n = 3 * kSubGroup + 7;
  auto options = MakeOptions(dir.PathOf("store"), SwapOptimizer::kAdam);
  {
    auto swapper = OptimizerSwapper::Create(options, n, Filler());
    REQUIRE_OK(swapper);
    for (uint64_t t = 1; t <= 3; ++t) {
      REQUIRE_OK(WriteAllGradients(**swapper, t));
      REQUIRE_OK((*swapper)->Step(Adam(t)));
    }
    REQUIRE_OK((*swapper)->Close());
  }
  auto too_far = options;
  too_far.max_epoch = 1;
  Status refused = OptimizerSwapper::Open(too_far).status();
  CHECK(refused.code() == StatusCode::kDataLoss);
  CHECK(refused.message().find("no step up to 1") != std::string::npos);
  auto back = options;
  back.max_epoch = 2;
  RecoveryReport report;
  auto swapper = OptimizerSwapper::Open(back, &report);
  REQUIRE_MESSAGE(swapper.ok(), swapper.status().ToString());
  CHECK(report.epoch == 2);
  CHECK((*swapper)->epoch() == 2);
  Reference ref(n);
  ref.AdamSteps(0, 2);
  RequireEqualBits(ReadAll(**swapper, -1), ref.p);
  // Step 3 again, over the step-3 slot, and the run carries on as if never ahead.
  for (uint64_t t = 3; t <= 4; ++t) {
    REQUIRE_OK(WriteAllGradients(**swapper, t));
    REQUIRE_OK((*swapper)->Step(Adam(t)));
  }
  ref.AdamSteps(2, 4);
  RequireEqualBits(ReadAll(**swapper, -1), ref.p);
  RequireEqualBits(ReadAll(**swapper, 0), ref.m);
  REQUIRE_OK((*swapper)->Close());
  auto reopened = OptimizerSwapper::Open(options, &report);
  REQUIRE_OK(reopened);
  CHECK(report.epoch == 4);
}

TEST_CASE("A step that fails on an I/O error keeps the committed step, and can be retried") {
  TempDir dir("swapper-");
  const uint64_t n = 6 * kSubGroup;
  auto options = MakeOptions(dir.PathOf("store"), SwapOptimizer::kAdam);
  nvme::FaultBackend* faults = nullptr;
  InstallFaults(options, &faults);
  auto swapper = OptimizerSwapper::Create(options, n, Filler());
  REQUIRE_MESSAGE(swapper.ok(), swapper.status().ToString());
  OptimizerSwapper& s = **swapper;
  REQUIRE_OK(WriteAllGradients(s, 1));
  REQUIRE_OK(s.Step(Adam(1)));
  REQUIRE_OK(WriteAllGradients(s, 2));
  // The 4th write request of the step fails with EIO: some sub-groups of step 2 are written, one
  // fails, the rest never start.
  nvme::FaultPlan plan;
  plan.fail.op = nvme::OpType::kWrite;
  plan.fail.nth = 4;
  REQUIRE_OK(faults->SetPlan(plan));
  Status st = s.Step(Adam(2));
  CHECK(st.code() == StatusCode::kIoError);
  CHECK(st.message().find("step 2") != std::string::npos);
  CHECK(s.epoch() == 1);
  CHECK(s.stats().failed_steps == 1);
  Reference ref(n);
  ref.AdamSteps(0, 1);
  RequireEqualBits(ReadAll(s, -1), ref.p);  // step 1 intact
  REQUIRE_OK(faults->SetPlan({}));
  REQUIRE_OK(s.Step(Adam(2)));  // the gradients are still there
  ref.AdamSteps(1, 2);
  RequireEqualBits(ReadAll(s, -1), ref.p);
  RequireEqualBits(ReadAll(s, 0), ref.m);

  // Overlapped: the same fault in step 3, its sub-groups handed over in memory, in reverse. The
  // step fails naming the sub-group, every gradient handed over is released, step 2 stays whole,
  // and the step runs again.
  for (int attempt = 0; attempt < 2; ++attempt) {
    CAPTURE(attempt);
    if (attempt == 0) REQUIRE_OK(faults->SetPlan(plan));
    REQUIRE_OK(s.BeginStep(Adam(3)));
    std::vector<std::vector<float>> grads(s.sub_group_count());
    std::atomic<uint64_t> released{0};  // `done` runs on the pipeline's threads
    for (uint64_t i = s.sub_group_count(); i-- > 0;) {
      grads[i] = GradientsOf(s, 3, i);
      REQUIRE_OK(s.StepSubGroup(i, grads[i], {}, [&released] { ++released; }));
    }
    const Status finished = s.FinishStep();
    CHECK(released == s.sub_group_count());
    if (attempt == 0) {
      CHECK(finished.code() == StatusCode::kIoError);
      CHECK(finished.message().find("step 3, writing sub-group") != std::string::npos);
      CHECK(s.epoch() == 2);
      RequireEqualBits(ReadAll(s, -1), ref.p);
      REQUIRE_OK(faults->SetPlan({}));
    } else {
      REQUIRE_MESSAGE(finished.ok(), finished.ToString());
    }
  }
  ref.AdamSteps(2, 3);
  RequireEqualBits(ReadAll(s, -1), ref.p);
  RequireEqualBits(ReadAll(s, 1), ref.v);
}

// Runs steps in a child process that is SIGKILLed mid-step; the parent reopens the store.
void RunKilledChild(const OptimizerSwapperOptions& options, uint64_t steps_done,
                    uint64_t kill_in_sub_group, bool overlapped = false) {
  pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    auto swapper = OptimizerSwapper::Open(options);
    if (!swapper.ok()) ::_exit(3);
    OptimizerSwapper& s = **swapper;
    for (uint64_t t = s.epoch() + 1;; ++t) {
      const bool last = t == steps_done + 1;
      auto on_update = [&](const SubGroupUpdate& u) {
        if (last && u.sub_group == kill_in_sub_group) {
          // Give the writer time to put the sub-groups before this one on disk, then die.
          std::this_thread::sleep_for(std::chrono::milliseconds(300));
          ::raise(SIGKILL);
        }
        return Status::Ok();
      };
      Status st;
      if (overlapped) {  // in reverse, from memory, as backward hands them over
        if (!s.BeginStep(Adam(t), on_update).ok()) ::_exit(4);
        std::vector<std::vector<float>> grads(s.sub_group_count());
        for (uint64_t i = s.sub_group_count(); i-- > 0;) {
          grads[i] = GradientsOf(s, t, i);
          if (!s.StepSubGroup(i, grads[i]).ok()) ::_exit(4);
        }
        st = s.FinishStep();
      } else {
        if (!WriteAllGradients(s, t).ok()) ::_exit(4);
        st = s.Step(Adam(t), on_update);
      }
      if (!st.ok()) ::_exit(5);
    }
  }
  int wstatus = 0;
  REQUIRE(::waitpid(pid, &wstatus, 0) == pid);
  REQUIRE(WIFSIGNALED(wstatus));
  REQUIRE(WTERMSIG(wstatus) == SIGKILL);
}

TEST_CASE("A process SIGKILLed mid-step leaves a store that reports the torn step and resumes") {
  TempDir dir("swapper-");
  const uint64_t n = 8 * kSubGroup;
  auto options = MakeOptions(dir.PathOf("store"), SwapOptimizer::kAdam);
  {
    auto swapper = OptimizerSwapper::Create(options, n, Filler());
    REQUIRE_OK(swapper);
    REQUIRE_OK((*swapper)->Close());
  }
  SUBCASE("killed in an overlapped step, sub-groups stepped in reverse") {
    RunKilledChild(options, 2, 1, /*overlapped=*/true);
    RecoveryReport report;
    auto swapper = OptimizerSwapper::Open(options, &report);
    REQUIRE_MESSAGE(swapper.ok(), swapper.status().ToString());
    CHECK(report.torn);
    CHECK(report.epoch == 2);
    CHECK(report.torn_epoch == 3);
    // Sub-groups 7..2 had step 3 written over their step-1 slot before 1's update died.
    CHECK(report.torn_sub_groups >= 4);
    OptimizerSwapper& s = **swapper;
    Reference ref(n);
    ref.AdamSteps(0, 2);
    RequireEqualBits(ReadAll(s, -1), ref.p);
    RequireEqualBits(ReadAll(s, 0), ref.m);
    REQUIRE_OK(WriteAllGradients(s, 3));
    REQUIRE_OK(s.Step(Adam(3)));
    ref.AdamSteps(2, 3);
    RequireEqualBits(ReadAll(s, -1), ref.p);
  }
  SUBCASE("killed in the first step") {
    RunKilledChild(options, 0, 5);
    RecoveryReport report;
    auto swapper = OptimizerSwapper::Open(options, &report);
    REQUIRE_MESSAGE(swapper.ok(), swapper.status().ToString());
    CHECK(report.torn);
    CHECK(report.epoch == 0);
    CHECK(report.torn_epoch == 1);
    Reference ref(n);
    RequireEqualBits(ReadAll(**swapper, -1), ref.p);
  }
  SUBCASE("killed in the fourth step, after sub-groups were rewritten") {
    RunKilledChild(options, 3, 6);
    RecoveryReport report;
    auto swapper = OptimizerSwapper::Open(options, &report);
    REQUIRE_MESSAGE(swapper.ok(), swapper.status().ToString());
    INFO(report.notes.size());
    CHECK(report.torn);
    CHECK(report.epoch == 3);
    CHECK(report.torn_epoch == 4);
    // With 3 buffers the reader can only have read sub-group 6 into a buffer the writer freed
    // after writing sub-group 3: sub-groups 0..3 had step 4 written over their step-2 slot.
    CHECK(report.torn_sub_groups >= 4);
    OptimizerSwapper& s = **swapper;
    Reference ref(n);
    ref.AdamSteps(0, 3);
    RequireEqualBits(ReadAll(s, -1), ref.p);
    RequireEqualBits(ReadAll(s, 1), ref.v);
    // Resume: step 4 again, then 5, equal to an uninterrupted run.
    for (uint64_t t = 4; t <= 5; ++t) {
      REQUIRE_OK(WriteAllGradients(s, t));
      REQUIRE_OK(s.Step(Adam(t)));
    }
    ref.AdamSteps(3, 5);
    RequireEqualBits(ReadAll(s, -1), ref.p);
    RequireEqualBits(ReadAll(s, 0), ref.m);
    REQUIRE_OK(s.Close());
    RecoveryReport clean;
    auto again = OptimizerSwapper::Open(options, &clean);
    REQUIRE_OK(again);
    CHECK_FALSE(clean.torn);
    CHECK(clean.epoch == 5);
  }
}

// ---- One state slot (Note [One slot per sub-group]) -------------------------------------------

OptimizerSwapperOptions OneSlot(const std::string& dir) {
  OptimizerSwapperOptions o = MakeOptions(dir, SwapOptimizer::kAdam);
  o.state_slots = 1;
  return o;
}

// Steps 1..3 serially and step 4 overlapped (sub-groups in reverse, from memory).
void RunFourSteps(OptimizerSwapper& s) {
  for (uint64_t t = 1; t <= 3; ++t) {
    REQUIRE_OK(WriteAllGradients(s, t));
    REQUIRE_OK(s.Step(Adam(t)));
  }
  REQUIRE_OK(s.BeginStep(Adam(4)));
  std::vector<std::vector<float>> grads(s.sub_group_count());
  for (uint64_t i = s.sub_group_count(); i-- > 0;) {
    grads[i] = GradientsOf(s, 4, i);
    REQUIRE_OK(s.StepSubGroup(i, grads[i]));
  }
  REQUIRE_OK(s.FinishStep());
}

uint64_t FileBytes(const std::string& path) {
  struct stat st {};
  REQUIRE(::stat(path.c_str(), &st) == 0);
  return static_cast<uint64_t>(st.st_size);
}

TEST_CASE("One state slot: the bits of two slots in half the state space, and a clean reopen") {
  TempDir dir("swapper-");
  const uint64_t n = 7 * kSubGroup + 300;  // 8 sub-groups, the last one short
  const OptimizerSwapperOptions two = MakeOptions(dir.PathOf("two"), SwapOptimizer::kAdam);
  const OptimizerSwapperOptions one = OneSlot(dir.PathOf("one"));
  // Exact capacities: per sub-group, each state value (4 KiB header + 12 B/element) and the
  // gradient value rounded to 64 KiB, plus 1 MiB of metadata room.
  CHECK(OptimizerSwapper::RequiredStoreBytes(two, n) == 8 * (2 * 65536 + 65536) + (1 << 20));
  CHECK(OptimizerSwapper::RequiredStoreBytes(one, n) == 8 * (65536 + 65536) + (1 << 20));
  auto a = OptimizerSwapper::Create(two, n, Filler());
  auto b = OptimizerSwapper::Create(one, n, Filler());
  REQUIRE_OK(a);
  REQUIRE_OK(b);
  CHECK((*a)->state_slots() == 2);
  CHECK((*b)->state_slots() == 1);
  // The preallocated data files differ by one copy of the states.
  CHECK(FileBytes(dir.PathOf("two/memplan-swap.data")) -
            FileBytes(dir.PathOf("one/memplan-swap.data")) ==
        8 * 65536);
  RunFourSteps(**a);
  RunFourSteps(**b);
  Reference ref(n);
  ref.AdamSteps(0, 4);
  for (int array = -1; array < 2; ++array) {
    CAPTURE(array);
    const std::vector<float> got = ReadAll(**b, array);
    RequireEqualBits(got, ReadAll(**a, array));
    RequireEqualBits(got, array < 0 ? ref.p : array == 0 ? ref.m : ref.v);
  }
  // The same bytes moved per step; the store holds one copy of the states instead of two: the
  // allocated extents differ by exactly the 8 state values (7 of 16 KiB, one of 8 KiB: 4 KiB
  // header + 3600 bytes, rounded to the store's 4 KiB blocks).
  CHECK((*a)->stats().last_step.write_bytes == (*b)->stats().last_step.write_bytes);
  CHECK((*a)->stats().last_step.read_bytes == (*b)->stats().last_step.read_bytes);
  CHECK((*a)->stats().store.used_bytes - (*b)->stats().store.used_bytes == 7 * 16384 + 8192);
  REQUIRE_OK((*b)->Close());

  auto wrong = one;
  wrong.state_slots = 2;
  Status refused = OptimizerSwapper::Open(wrong).status();
  CHECK(refused.code() == StatusCode::kInvalidArgument);
  CHECK(refused.message().find("keeps 1 state slot per sub-group (state_slots 1), not 2") !=
        std::string::npos);
  RecoveryReport report;
  auto reopened = OptimizerSwapper::Open(one, &report);
  REQUIRE_MESSAGE(reopened.ok(), reopened.status().ToString());
  CHECK(report.epoch == 4);
  CHECK_FALSE(report.torn);
  REQUIRE_OK(WriteAllGradients(**a, 5));
  REQUIRE_OK((*a)->Step(Adam(5)));
  REQUIRE_OK(WriteAllGradients(**reopened, 5));
  REQUIRE_OK((*reopened)->Step(Adam(5)));
  RequireEqualBits(ReadAll(**reopened, -1), ReadAll(**a, -1));
  RequireEqualBits(ReadAll(**reopened, 1), ReadAll(**a, 1));
  // One slot keeps no step before its last.
  REQUIRE_OK((*reopened)->Close());
  auto back = one;
  back.max_epoch = 4;
  Status no_back = OptimizerSwapper::Open(back).status();
  CHECK(no_back.code() == StatusCode::kDataLoss);
  CHECK(no_back.message().find("holds its last step, 5, only") != std::string::npos);

  for (uint32_t slots : {0u, 3u}) {
    auto bad = OneSlot(dir.PathOf("bad"));
    bad.state_slots = slots;
    Status invalid = OptimizerSwapper::Create(bad, n, Filler()).status();
    CHECK(invalid.code() == StatusCode::kInvalidArgument);
    CHECK(invalid.message() == "state_slots must be 1 or 2, not " + std::to_string(slots));
  }
}

// What a torn one-slot store says at Open(): DataLoss, naming the slot count, the interrupted
// step and the way out.
void CheckRefusedAsTorn(const OptimizerSwapperOptions& options, uint64_t step) {
  auto refused = OptimizerSwapper::Open(options);
  REQUIRE_FALSE(refused.ok());
  const Status& st = refused.status();
  CAPTURE(st.ToString());
  CHECK(st.code() == StatusCode::kDataLoss);
  CHECK(st.message().find("step " + std::to_string(step) + " was begun and never committed") !=
        std::string::npos);
  CHECK(st.message().find("one state slot per sub-group (state_slots 1)") != std::string::npos);
  CHECK(st.message().find("restart training from a checkpoint") != std::string::npos);
}

TEST_CASE("One state slot: a process killed mid-step is refused with DataLoss, never resumed") {
  TempDir dir("swapper-");
  const uint64_t n = 8 * kSubGroup;
  const OptimizerSwapperOptions options = OneSlot(dir.PathOf("store"));
  {
    auto swapper = OptimizerSwapper::Create(options, n, Filler());
    REQUIRE_OK(swapper);
    REQUIRE_OK((*swapper)->Close());
  }
  SUBCASE("killed in the fourth step, after sub-groups were rewritten in place") {
    RunKilledChild(options, 3, 6);
    CheckRefusedAsTorn(options, 4);
  }
  SUBCASE("killed in an overlapped step, sub-groups stepped in reverse") {
    RunKilledChild(options, 2, 1, /*overlapped=*/true);
    CheckRefusedAsTorn(options, 3);
  }
  SUBCASE("killed in the first step") {
    RunKilledChild(options, 0, 5);
    CheckRefusedAsTorn(options, 1);
  }
  SUBCASE("markers that disagree with the sub-groups (a hostile or damaged store)") {
    {
      auto swapper = OptimizerSwapper::Open(options);
      REQUIRE_OK(swapper);
      REQUIRE_OK(WriteAllGradients(**swapper, 1));
      REQUIRE_OK((*swapper)->Step(Adam(1)));
      REQUIRE_OK((*swapper)->Close());
    }
    // Both markers rolled back to step 0: every sub-group holds step 1.
    nvme::SwapStoreOptions so = options.store;
    so.open_existing = true;
    so.keep_files = true;
    {
      auto store = nvme::SwapStore::Open(so);
      REQUIRE_OK(store);
      const uint64_t zero = 0;
      const auto bytes = std::as_bytes(std::span<const uint64_t>(&zero, 1));
      REQUIRE_OK((*store)->Put("swapper.begun", bytes));
      REQUIRE_OK((*store)->Put("swapper.committed", bytes));
      REQUIRE_OK((*store)->Close());
    }
    Status st = OptimizerSwapper::Open(options).status();
    CAPTURE(st.ToString());
    CHECK(st.code() == StatusCode::kDataLoss);
    CHECK(st.message().find("sub-group 0 holds step 1 but the last commit is step 0") !=
          std::string::npos);
    {
      auto store = nvme::SwapStore::Open(so);
      REQUIRE_OK(store);
      REQUIRE_OK((*store)->Erase("swapper.committed"));
      REQUIRE_OK((*store)->Close());
    }
    st = OptimizerSwapper::Open(options).status();
    CHECK(st.code() == StatusCode::kDataLoss);
    CHECK(st.message().find("commit marker is unreadable") != std::string::npos);
  }
}

TEST_CASE("One state slot: a step that fails after writing refuses every later step and read") {
  TempDir dir("swapper-");
  const uint64_t n = 6 * kSubGroup;
  auto options = OneSlot(dir.PathOf("store"));
  nvme::FaultBackend* faults = nullptr;
  InstallFaults(options, &faults);
  {
    auto swapper = OptimizerSwapper::Create(options, n, Filler());
    REQUIRE_OK(swapper);
    OptimizerSwapper& s = **swapper;
    REQUIRE_OK(WriteAllGradients(s, 1));
    REQUIRE_OK(s.Step(Adam(1)));
    REQUIRE_OK(WriteAllGradients(s, 2));
    // The 4th write of step 2 fails: sub-groups before it were rewritten in place.
    nvme::FaultPlan plan;
    plan.fail.op = nvme::OpType::kWrite;
    plan.fail.nth = 4;
    REQUIRE_OK(faults->SetPlan(plan));
    Status st = s.Step(Adam(2));
    CHECK(st.code() == StatusCode::kIoError);
    CHECK(s.epoch() == 1);
    CHECK(s.torn_step() == 2);
    REQUIRE_OK(faults->SetPlan({}));
    // A retry would step from a mix of steps 1 and 2: refused, as are reads and loads.
    Status retry = s.Step(Adam(2));
    CAPTURE(retry.ToString());
    CHECK(retry.code() == StatusCode::kDataLoss);
    CHECK(retry.message().find("step 2 stopped after rewriting sub-groups in place") !=
          std::string::npos);
    CHECK(retry.message().find("restart training from a checkpoint") != std::string::npos);
    CHECK(s.BeginStep(Adam(2)).code() == StatusCode::kDataLoss);
    std::vector<float> out(s.SubGroupSize(0));
    CHECK(s.ReadParams(0, out).code() == StatusCode::kDataLoss);
    const bool all[3] = {true, false, false};
    CHECK(s.Load([](uint64_t, int, std::span<float>) { return Status::Ok(); }, all).code() ==
          StatusCode::kDataLoss);
    REQUIRE_OK(s.Close());
  }
  CheckRefusedAsTorn(options, 2);
}

TEST_CASE("One state slot: an abandoned step is torn once written, and harmless before") {
  TempDir dir("swapper-");
  const uint64_t n = 4 * kSubGroup;
  const OptimizerSwapperOptions options = OneSlot(dir.PathOf("store"));
  auto swapper = OptimizerSwapper::Create(options, n, Filler());
  REQUIRE_OK(swapper);
  OptimizerSwapper& s = **swapper;
  REQUIRE_OK(WriteAllGradients(s, 1));
  REQUIRE_OK(s.Step(Adam(1)));
  // Begun and abandoned before any sub-group was handed over (the reader only read ahead): the
  // store is as it was, on disk too.
  REQUIRE_OK(s.BeginStep(Adam(2)));
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  s.AbortStep();
  CHECK(s.torn_step() == 0);
  REQUIRE_OK(s.Close());
  auto reopened = OptimizerSwapper::Open(options);
  REQUIRE_MESSAGE(reopened.ok(), reopened.status().ToString());
  OptimizerSwapper& r = **reopened;
  CHECK(r.epoch() == 1);
  Reference ref(n);
  ref.AdamSteps(0, 1);
  RequireEqualBits(ReadAll(r, -1), ref.p);
  SUBCASE("abandoned after every sub-group was written") {
    REQUIRE_OK(r.BeginStep(Adam(2)));
    std::vector<std::vector<float>> grads(r.sub_group_count());
    for (uint64_t i = 0; i < r.sub_group_count(); ++i) {
      grads[i] = GradientsOf(r, 2, i);
      REQUIRE_OK(r.StepSubGroup(i, grads[i]));
    }
    REQUIRE_OK(r.WaitForUpdates());
    r.AbortStep();
    CHECK(r.torn_step() == 2);
  }
  SUBCASE("run to its end and dropped (a redo of a clipped step)") {
    REQUIRE_OK(r.BeginStep(Adam(2)));
    std::vector<std::vector<float>> grads(r.sub_group_count());
    for (uint64_t i = 0; i < r.sub_group_count(); ++i) {
      grads[i] = GradientsOf(r, 2, i);
      REQUIRE_OK(r.StepSubGroup(i, grads[i], {}, nullptr, /*store_gradients=*/true));
    }
    REQUIRE_OK(r.FinishStep(false));
    CHECK(r.torn_step() == 2);
    CHECK(r.Step(Adam(2)).code() == StatusCode::kDataLoss);
  }
  REQUIRE_OK(r.Close());
  CheckRefusedAsTorn(options, 2);
}

TEST_CASE("SGD and Lion run through the swapper like their in-memory kernels") {
  for (SwapOptimizer kind : {SwapOptimizer::kSgd, SwapOptimizer::kLion}) {
    CAPTURE(SwapOptimizerName(kind));
    TempDir dir("swapper-");
    const uint64_t n = 3 * kSubGroup + 7;
    auto swapper = OptimizerSwapper::Create(MakeOptions(dir.PathOf("store"), kind), n, Filler());
    REQUIRE_OK(swapper);
    std::vector<float> p(n), state(n, 0.0f);
    for (uint64_t e = 0; e < n; ++e) p[e] = InitialParam(e);
    auto cpu = CpuOptimizer::Create({});
    REQUIRE_OK(cpu);
    for (uint64_t t = 1; t <= 3; ++t) {
      REQUIRE_OK(WriteAllGradients(**swapper, t));
      std::vector<float> g(n);
      for (uint64_t e = 0; e < n; ++e) g[e] = Grad(t, e);
      if (kind == SwapOptimizer::kSgd) {
        SgdOptions o;
        REQUIRE_OK((*swapper)->Step(o));
        REQUIRE_OK((*cpu)->SgdStep(o, static_cast<int64_t>(t), p, g, state));
      } else {
        LionOptions o;
        o.weight_decay = 0.1;
        REQUIRE_OK((*swapper)->Step(o));
        REQUIRE_OK((*cpu)->LionStep(o, static_cast<int64_t>(t), p, g, state));
      }
    }
    RequireEqualBits(ReadAll(**swapper, -1), p);
    RequireEqualBits(ReadAll(**swapper, 0), state);
  }
}

}  // namespace
}  // namespace memplan::offload
