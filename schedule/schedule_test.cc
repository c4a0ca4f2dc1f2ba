// The Schedule contract linked alone, as the planner links it: the JSON a default Schedule writes,
// key for key in the README's order, and every enum's names both ways. The round trip and the
// reader's errors are tested beside the engine that runs it (offload/engine_test.cc).
#include "schedule/schedule.h"

#include <doctest/doctest.h>

#include <string>

#include "schedule/enums.h"

namespace memplan::offload {
namespace {

TEST_CASE("A default Schedule writes the documented JSON, keys in order") {
  CHECK(
      ToOrderedJson(Schedule{}).dump() ==
      R"({"version":1,"params":{"tier":"gpu","dtype":"bf16","persistence_threshold":100000,)"
      R"("prefetch_bytes":268435456,"max_live_bytes":1073741824,"buffer_bytes":67108864,)"
      R"("buffer_count":4},"optimizer":{"tier":"cpu","name":"adam","sub_group_elements":4194304,)"
      R"("buffer_count":3,"threads":0,"state_slots":2,"durability":"process"},"nvme":{"path":"","backend":"auto","block_size":1048576,)"
      R"("queue_depth":32,"intra_op_parallelism":1,"direct":true},"pinned_budget_bytes":0})");
}

TEST_CASE("Every enum of the Schedule parses the name it prints") {
  for (Tier t : {Tier::kGpu, Tier::kCpu, Tier::kNvme}) {
    auto back = ParseTier(TierName(t));
    REQUIRE(back.ok());
    CHECK(*back == t);
  }
  for (ElementType e : {ElementType::kFloat32, ElementType::kBFloat16, ElementType::kFloat16}) {
    auto back = ParseElementType(ElementTypeName(e));
    REQUIRE(back.ok());
    CHECK(*back == e);
  }
  for (SwapOptimizer o : {SwapOptimizer::kAdam, SwapOptimizer::kAdamAmsgrad, SwapOptimizer::kSgd,
                          SwapOptimizer::kLion}) {
    auto back = ParseSwapOptimizer(SwapOptimizerName(o));
    REQUIRE(back.ok());
    CHECK(*back == o);
    CHECK(SwapOptimizerStates(o) >= 1);
  }
  for (nvme::BackendKind k :
       {nvme::BackendKind::kAuto, nvme::BackendKind::kUring, nvme::BackendKind::kAio,
        nvme::BackendKind::kPosix, nvme::BackendKind::kMemory}) {
    auto back = nvme::ParseBackendKind(nvme::BackendKindName(k));
    REQUIRE(back.ok());
    CHECK(*back == k);
  }
  for (Durability d : {Durability::kProcessCrash, Durability::kPowerLoss}) {
    auto back = ParseDurability(DurabilityName(d));
    REQUIRE(back.ok());
    CHECK(*back == d);
  }
  CHECK(DurabilityName(Durability::kProcessCrash) == "process");
  auto flush =
      ScheduleFromJson(nlohmann::json::parse(R"({"optimizer":{"durability":"power"}})"), "");
  REQUIRE(flush.ok());
  CHECK(flush->optimizer_durability == Durability::kPowerLoss);
  auto unknown =
      ScheduleFromJson(nlohmann::json::parse(R"({"optimizer":{"durability":"disk"}})"), "");
  REQUIRE_FALSE(unknown.ok());
  CHECK(unknown.status().message().find("unknown durability 'disk' (expected process or power)") !=
        std::string::npos);
  // The spellings accepted and never printed.
  CHECK(*nvme::ParseBackendKind("io_uring") == nvme::BackendKind::kUring);
  CHECK(*nvme::ParseBackendKind("libaio") == nvme::BackendKind::kAio);
  auto bad = ParseTier("disk");
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.status().message() == "unknown tier 'disk' (expected gpu, cpu or nvme)");
}

}  // namespace
}  // namespace memplan::offload
