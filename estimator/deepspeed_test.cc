// DeepSpeed's model-state estimators, every row, to the byte. Expected values are DeepSpeed's own
// formulas (REFERENCE.md §1) evaluated in Python, plus DeepSpeed's published t5-large example.
#include "estimator/deepspeed.h"

#include <doctest/doctest.h>

#include <vector>
#include "tests/status_testing.h"

namespace memplan::estimator {
namespace {

constexpr uint64_t kT5LargeParams = 737668096;
constexpr uint64_t kT5LargeLargestLayer = 32899072;  // 32128 x 1024 shared embedding

struct Bytes {
  uint64_t cpu, gpu;
};

std::vector<Bytes> Z3(uint64_t p, uint64_t l, DeepSpeedHardware hw) {
  auto rows = Zero3Table(p, l, hw);
  REQUIRE_OK(rows);
  std::vector<Bytes> out;
  for (const auto& r : *rows) out.push_back({r.cpu_bytes, r.gpu_bytes});
  return out;
}

std::vector<Bytes> Z2(uint64_t p, DeepSpeedHardware hw) {
  auto rows = Zero2Table(p, hw);
  REQUIRE_OK(rows);
  std::vector<Bytes> out;
  for (const auto& r : *rows) out.push_back({r.cpu_bytes, r.gpu_bytes});
  return out;
}

void CheckRows(const std::vector<Bytes>& got, const std::vector<Bytes>& want) {
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    CAPTURE(i);
    CHECK(got[i].cpu == want[i].cpu);
    CHECK(got[i].gpu == want[i].gpu);
  }
}

TEST_CASE("deepspeed: t5-large on 4 GPUs reproduces DeepSpeed's worked example") {
  DeepSpeedHardware hw{.nodes = 1, .gpus_per_node = 4};
  auto rows = Z3(kT5LargeParams, kT5LargeLargestLayer, hw);
  constexpr uint64_t kMiB = 1 << 20;
  // Docs: largest layer memory 125 MiB; both offloaded 125 MiB per GPU; optimizer offloaded only
  // 477 MiB; no offload 3291 MiB.
  CHECK(rows[0].gpu / kMiB == 125);
  CHECK(rows[2].gpu / kMiB == 477);
  CHECK(rows[4].gpu / kMiB == 3291);
  CheckRows(rows, {{19917038592, 131596288},
                   {19917038592, 131596288},
                   {17704034304, 500430336},
                   {17704034304, 500430336},
                   {789577728, 3451102720},
                   {17704034304, 3451102720}});
  CheckRows(Z2(kT5LargeParams, hw), {{17704034304, 1475336192}, {17704034304, 4794842624}});
}

TEST_CASE("deepspeed: row order and option flags follow DeepSpeed's loops") {
  auto rows = Zero3Table(1000, 10, DeepSpeedHardware{});
  REQUIRE_OK(rows);
  REQUIRE(rows->size() == 6);
  const bool want[6][3] = {{true, true, true},   {true, true, false},  {false, true, true},
                           {false, true, false}, {false, false, true}, {false, false, false}};
  for (int i = 0; i < 6; ++i) {
    CAPTURE(i);
    CHECK((*rows)[i].offload_param == want[i][0]);
    CHECK((*rows)[i].offload_optimizer == want[i][1]);
    CHECK((*rows)[i].zero_init == want[i][2]);
  }
  auto z2 = Zero2Table(1000, DeepSpeedHardware{});
  REQUIRE_OK(z2);
  CHECK((*z2)[0].offload_optimizer);
  CHECK_FALSE((*z2)[1].offload_optimizer);
}

TEST_CASE("deepspeed: one GPU, where max(4g, 18/n) picks 18") {
  DeepSpeedHardware hw{.nodes = 1, .gpus_per_node = 1};
  CheckRows(Z3(kT5LargeParams, kT5LargeLargestLayer, hw), {{19917038592, 131596288},
                                                           {19917038592, 131596288},
                                                           {17704034304, 1606932480},
                                                           {17704034304, 1606932480},
                                                           {197394432, 13409622016},
                                                           {4426008576, 13409622016}});
  CheckRows(Z2(kT5LargeParams, hw), {{17704034304, 1475336192}, {4426008576, 14753361920}});
}

TEST_CASE("deepspeed: inexact 1/n (7 nodes of 3 GPUs) truncates like Python") {
  DeepSpeedHardware hw{.nodes = 7, .gpus_per_node = 3};
  CheckRows(Z3(kT5LargeParams, kT5LargeLargestLayer, hw), {{2845291227, 131596288},
                                                           {13278025728, 131596288},
                                                           {2529147757, 201850392},
                                                           {13278025728, 201850392},
                                                           {592183296, 763883227},
                                                           {13278025728, 763883227}});
  CheckRows(Z2(kT5LargeParams, hw), {{92946180096, 1475336192}, {13278025728, 2107623131}});
}

TEST_CASE("deepspeed: Llama-2-7b base, 3 nodes x 8 GPUs, buffer factor 1.3") {
  DeepSpeedHardware hw{.nodes = 3, .gpus_per_node = 8, .buffer_factor = 1.3};
  CheckRows(Z3(6607343616, 131072000, hw), {{51537280204, 524288000},
                                            {274865494425, 524288000},
                                            {45810915737, 1074899968},
                                            {274865494425, 1074899968},
                                            {5452595200, 5479795712},
                                            {274865494425, 5479795712}});
  CheckRows(Z2(6607343616, hw), {{824596483276, 13214687232}, {274865494425, 18170194944}});
}

TEST_CASE("deepspeed: invalid hardware and overflow are errors, not numbers") {
  CHECK(EstimateZero2(10, DeepSpeedHardware{.nodes = 0}, true).status().code() ==
        StatusCode::kInvalidArgument);
  CHECK(EstimateZero3(10, 1, DeepSpeedHardware{.gpus_per_node = 0}, true, true, true)
            .status()
            .code() == StatusCode::kInvalidArgument);
  CHECK(EstimateZero3(10, 1, DeepSpeedHardware{.buffer_factor = -1}, true, true, true)
            .status()
            .code() == StatusCode::kInvalidArgument);
  const uint64_t huge = uint64_t{1} << 62;
  CHECK(EstimateZero2(huge, DeepSpeedHardware{}, false).status().code() == StatusCode::kOutOfRange);
  CHECK(EstimateZero3(10, huge, DeepSpeedHardware{}, true, true, true).status().code() ==
        StatusCode::kOutOfRange);
}

TEST_CASE("deepspeed: text layout matches DeepSpeed's printout") {
  DeepSpeedHardware hw{.nodes = 1, .gpus_per_node = 4};
  auto z3 = Zero3Table(kT5LargeParams, kT5LargeLargestLayer, hw);
  REQUIRE_OK(z3);
  CHECK(FormatZero3Text(kT5LargeParams, kT5LargeLargestLayer, hw, *z3) ==
        "Estimated memory needed for params, optim states and gradients for a:\n"
        "HW: Setup with 1 node, 4 GPUs per node.\n"
        "SW: Model with 737M total params, 32M largest layer params.\n"
        "  per CPU  |  per GPU |   Options\n"
        "   18.55GB |   0.12GB | offload_param=cpu , offload_optimizer=cpu , zero_init=1\n"
        "   18.55GB |   0.12GB | offload_param=cpu , offload_optimizer=cpu , zero_init=0\n"
        "   16.49GB |   0.47GB | offload_param=none, offload_optimizer=cpu , zero_init=1\n"
        "   16.49GB |   0.47GB | offload_param=none, offload_optimizer=cpu , zero_init=0\n"
        "    0.74GB |   3.21GB | offload_param=none, offload_optimizer=none, zero_init=1\n"
        "   16.49GB |   3.21GB | offload_param=none, offload_optimizer=none, zero_init=0\n");
  DeepSpeedHardware two{.nodes = 2, .gpus_per_node = 1};
  auto z2 = Zero2Table(kT5LargeParams, two);
  REQUIRE_OK(z2);
  CHECK(FormatZero2Text(kT5LargeParams, two, *z2) ==
        "Estimated memory needed for params, optim states and gradients for a:\n"
        "HW: Setup with 2 nodes, 1 GPU per node.\n"
        "SW: Model with 737M total params.\n"
        "  per CPU  |  per GPU |   Options\n"
        "   16.49GB |   1.37GB | offload_optimizer=cpu \n"
        "    4.12GB |   7.56GB | offload_optimizer=none\n");
}

}  // namespace
}  // namespace memplan::estimator
