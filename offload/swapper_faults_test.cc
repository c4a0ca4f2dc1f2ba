// Faults injected under the OptimizerSwapper (nvme::FaultBackend between it and the disk), checked
// for what the user sees: EIO on a read names the store key (sub-group and state slot) it failed
// on, ENOSPC on a write says the device is full and which key, and neither loses the last
// committed step. (EIO on a write and SIGKILL mid-step: optimizer_swapper_test.cc.)
#include <doctest/doctest.h>

#include <cerrno>
#include <string>
#include <vector>

#include "nvme/fault_backend.h"
#include "offload/optimizer_swapper.h"
#include "tests/testing.h"
#include "tests/status_testing.h"

namespace memplan::offload {
namespace {

constexpr uint64_t kSubGroup = 1024;

float Grad(uint64_t step, uint64_t e) {
  return static_cast<float>(((e * 31 + step * 17) % 113) * 0.002 - 0.11);
}

struct Faulty {
  std::unique_ptr<OptimizerSwapper> swapper;
  nvme::FaultBackend* faults = nullptr;
};

// A swapper of 4 sub-groups of AdamW states whose store's backend is a FaultBackend.
void Make(const std::string& dir, Faulty* out, Durability durability = Durability::kProcessCrash) {
  OptimizerSwapperOptions o;
  o.durability = durability;
  o.store.directory = dir;
  o.store.direct = false;  // test directories may sit on tmpfs
  o.store.backend = nvme::BackendKind::kPosix;
  o.store.checksum_block_bytes = 4096;
  o.sub_group_elements = kSubGroup;
  o.buffer_count = 2;
  o.optimizer = SwapOptimizer::kAdam;
  o.cpu.threads = 1;
  o.make_backend = [out]() -> Result<std::unique_ptr<nvme::Backend>> {
    MEMPLAN_ASSIGN_OR_RETURN(auto inner, nvme::CreatePosixBackend({}));
    MEMPLAN_ASSIGN_OR_RETURN(auto wrapped, nvme::FaultBackend::Create(std::move(inner)));
    out->faults = wrapped.get();
    return std::unique_ptr<nvme::Backend>(std::move(wrapped));
  };
  auto swapper = OptimizerSwapper::Create(o, 4 * kSubGroup, [](uint64_t first, std::span<float> p) {
    for (size_t k = 0; k < p.size(); ++k) p[k] = static_cast<float>((first + k) % 7) * 0.1f;
    return Status::Ok();
  });
  REQUIRE_MESSAGE(swapper.ok(), swapper.status().ToString());
  out->swapper = std::move(swapper).value();
  REQUIRE(out->faults != nullptr);
}

Status WriteAllGradients(OptimizerSwapper& s, uint64_t step) {
  for (uint64_t i = 0; i < s.sub_group_count(); ++i) {
    std::vector<float> g(s.SubGroupSize(i));
    for (size_t k = 0; k < g.size(); ++k) g[k] = Grad(step, s.SubGroupBegin(i) + k);
    MEMPLAN_RETURN_IF_ERROR(s.WriteGradients(i, g));
  }
  return Status::Ok();
}

AdamOptions Adam() {
  AdamOptions a;
  a.lr = 1e-3;
  return a;
}

std::vector<float> Params(OptimizerSwapper& s) {
  std::vector<float> out(s.num_elements());
  for (uint64_t i = 0; i < s.sub_group_count(); ++i) {
    std::span<float> part(out.data() + s.SubGroupBegin(i), s.SubGroupSize(i));
    Status st = s.ReadParams(i, part);
    REQUIRE_MESSAGE(st.ok(), st.ToString());
  }
  return out;
}

TEST_CASE("swapper faults: EIO on a read fails the step naming the key, and the step survives") {
  testing::TempDir dir("memplan_swapfault_");
  Faulty f;
  Make(dir.PathOf("store"), &f);
  OptimizerSwapper& s = *f.swapper;
  REQUIRE_OK(WriteAllGradients(s, 1));
  REQUIRE_OK(s.Step(Adam()));
  const std::vector<float> after_step1 = Params(s);
  REQUIRE_OK(WriteAllGradients(s, 2));

  nvme::FaultPlan plan;
  plan.fail.op = nvme::OpType::kRead;
  plan.fail.nth = 3;  // a read in the middle of the step's read-ahead
  plan.error = EIO;
  REQUIRE_OK(f.faults->SetPlan(plan));
  Status st = s.Step(Adam());
  CHECK(st.code() == StatusCode::kIoError);
  CAPTURE(st.ToString());
  // The user learns which value could not be read: a state slot or a gradient of a sub-group.
  const bool names_key = st.message().find("'state.") != std::string::npos ||
                         st.message().find("'grad.") != std::string::npos;
  CHECK(names_key);
  CHECK(st.message().find("Input/output error") != std::string::npos);
  CHECK(s.epoch() == 1);

  REQUIRE_OK(f.faults->SetPlan({}));
  CHECK(Params(s) == after_step1);  // the committed step is intact
  REQUIRE_OK(s.Step(Adam()));       // and the failed one can be retried
  CHECK(s.epoch() == 2);
}

TEST_CASE("swapper faults: ENOSPC on a write fails the step as out of space, naming the key") {
  testing::TempDir dir("memplan_swapfault_");
  Faulty f;
  Make(dir.PathOf("store"), &f);
  OptimizerSwapper& s = *f.swapper;
  REQUIRE_OK(WriteAllGradients(s, 1));
  REQUIRE_OK(s.Step(Adam()));
  const std::vector<float> after_step1 = Params(s);
  REQUIRE_OK(WriteAllGradients(s, 2));

  nvme::FaultPlan plan;
  plan.fail.op = nvme::OpType::kWrite;
  plan.fail.nth = 2;
  plan.error = ENOSPC;
  REQUIRE_OK(f.faults->SetPlan(plan));
  Status st = s.Step(Adam());
  CAPTURE(st.ToString());
  CHECK(st.code() == StatusCode::kResourceExhausted);
  CHECK(st.message().find("No space left on device") != std::string::npos);
  CHECK(st.message().find("'state.") != std::string::npos);
  CHECK(s.epoch() == 1);

  REQUIRE_OK(f.faults->SetPlan({}));
  CHECK(Params(s) == after_step1);
  REQUIRE_OK(s.Step(Adam()));
  CHECK(s.epoch() == 2);
}

TEST_CASE("swapper faults: a step's commit flushes the drive only with durability kPowerLoss") {
  // Every fsync fails. The default commit (kProcessCrash: Note [Commits without a flush]) issues
  // none, so steps commit; kPowerLoss flushes at the commit, so its step fails there, uncommitted.
  nvme::FaultPlan plan;
  plan.fail.op = nvme::OpType::kFsync;
  plan.fail.nth = 1;
  plan.fail.times = 0;
  for (Durability d : {Durability::kProcessCrash, Durability::kPowerLoss}) {
    CAPTURE(static_cast<int>(d));
    testing::TempDir dir("memplan_swapfault_");
    Faulty f;
    Make(dir.PathOf("store"), &f, d);
    OptimizerSwapper& s = *f.swapper;
    REQUIRE_OK(f.faults->SetPlan(plan));
    REQUIRE_OK(WriteAllGradients(s, 1));
    Status st = s.Step(Adam());
    if (d == Durability::kProcessCrash) {
      REQUIRE_OK(st);
      CHECK(s.epoch() == 1);
      CHECK(f.faults->counters().errors == 0);
      CHECK(s.stats().last_step.sync_s < 0.5);
      // An explicit Sync() flushes whatever the option says.
      CHECK(s.Sync().code() == StatusCode::kIoError);
    } else {
      CHECK(st.code() == StatusCode::kIoError);
      CHECK(st.message().find("fdatasync") != std::string::npos);
      CHECK(s.epoch() == 0);
      CHECK(f.faults->counters().errors >= 1);
    }
    REQUIRE_OK(f.faults->SetPlan({}));
  }
}

}  // namespace
}  // namespace memplan::offload
