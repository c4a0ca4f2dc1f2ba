#include "planner/engine_model.h"

#include <doctest/doctest.h>

#include "estimator/model_source.h"
#include "planner/emit.h"
#include "planner/search.h"
#include "tests/status_testing.h"

namespace memplan::planner {
namespace {

estimator::TensorInfo Tensor(const std::string& name, uint64_t numel, const std::string& module,
                             const std::string& block = "") {
  estimator::TensorInfo t;
  t.name = name;
  t.shape = {static_cast<int64_t>(numel)};
  t.numel = numel;
  t.module = module;
  t.block = block;
  return t;
}

// Four fetch units: an embedding, two blocks (one with a persistent norm) and a head.
estimator::ModelInventory Toy() {
  estimator::ModelInventory m;
  m.tensors = {
      Tensor("emb.weight", 1000, "emb"), Tensor("blocks.0.w", 2000, "blocks.0.lin", "blocks.0"),
      Tensor("blocks.0.n", 10, "blocks.0.norm", "blocks.0"),
      Tensor("blocks.1.w", 2000, "blocks.1.lin", "blocks.1"), Tensor("head.weight", 1000, "head")};
  return m;
}

offload::Schedule ToySchedule() {
  offload::Schedule s;
  s.param_tier = offload::Tier::kNvme;
  s.optimizer_tier = offload::Tier::kNvme;
  s.param_dtype = offload::ElementType::kBFloat16;
  s.persistence_threshold = 100;
  s.prefetch_bytes = 4000;  // one block's weight
  s.max_live_bytes = 10000;
  s.param_buffer_bytes = 4096;
  s.param_buffer_count = 2;
  s.sub_group_elements = 2048;
  s.optimizer_buffer_count = 2;
  return s;
}

TEST_CASE("engine model: pinned buffers, NVMe bytes and live bytes of a toy schedule") {
  EngineRunOptions host;
  host.gpu = false;
  auto p = PredictEngine(ToySchedule(), Toy(), host);
  REQUIRE_MESSAGE(p.ok(), p.status().message());
  CHECK(p->partition_elements == 6010);
  CHECK(p->sub_groups == 3);
  CHECK(p->fetch_units == 4);
  // Staging: 2 x 4 KiB. Optimizer buffer: [4 KiB header + 12 B x 2048 | 4 B x 2048 | 2 B x 2048],
  // each in pages: 28,672 + 8,192 + 4,096, two of them.
  CHECK(p->param_staging_pinned_bytes == 8192);
  CHECK(p->optimizer_pinned_bytes == 2 * 40960);
  CHECK(p->gradient_staging_pinned_bytes == 0);
  CHECK(p->pinned_bytes == 90112);
  // The optimizer reads each sub-group's slot and gradients and writes the slot, the gradients
  // and the step's begin mark: 3 x 4 KiB + 16 B x 6010 each way, plus 8 written.
  CHECK(p->optimizer_read_bytes_per_step == 108448);
  CHECK(p->optimizer_write_bytes_per_step == 108456);
  CHECK(p->param_write_bytes_per_step == 12020);
  // First step: no trace, every unit read for forward and again for backward. Then the trace:
  // the head, released at the forward/backward turn, is kept and not read again; prefetching one
  // block ahead puts two weights on the GPU at once in backward.
  CHECK(p->first_step_param_read_bytes == 24000);
  CHECK(p->param_read_bytes_per_step == 22000);
  CHECK(p->peak_live_param_bytes == 8000);
  CHECK(p->resident_param_bytes == 20);
  CHECK(p->nvme_read_bytes_per_step == 22000 + 108448);
  CHECK(p->nvme_write_bytes_per_step == 12020 + 108456);
  // The stores on the drive: parameters 12,020 B + 3 x 64 KiB + 1 MiB; the optimizer, per
  // sub-group, two state values (4 KiB + 12 B x n, at most 28,672 B) and the gradients, each in
  // 64 KiB, + 1 MiB; with optimizer.state_slots 1, one state value less per sub-group.
  CHECK(p->param_store_bytes == 12020 + 3 * 65536 + 1048576);
  CHECK(p->optimizer_store_bytes == 3 * 3 * 65536 + 1048576);
  CHECK(p->nvme_store_bytes == p->param_store_bytes + p->optimizer_store_bytes);
  offload::Schedule one_slot = ToySchedule();
  one_slot.optimizer_state_slots = 1;
  auto one = PredictEngine(one_slot, Toy(), host);
  REQUIRE_OK(one);
  CHECK(one->optimizer_store_bytes == 3 * 2 * 65536 + 1048576);
  CHECK(one->nvme_write_bytes_per_step == p->nvme_write_bytes_per_step);  // the same traffic

  // With a GPU, four gradient staging slots of the largest shard in fp32 (8,000 B -> 2 pages).
  auto gpu = PredictEngine(ToySchedule(), Toy(), EngineRunOptions{});
  REQUIRE_OK(gpu);
  CHECK(gpu->gradient_staging_pinned_bytes == 4 * 8192);
  CHECK(gpu->pinned_bytes == 90112 + 32768);

  // A smaller prefetch budget: nothing goes ahead, nothing is kept, both passes read everything.
  offload::Schedule tight = ToySchedule();
  tight.prefetch_bytes = 1;
  auto t = PredictEngine(tight, Toy(), host);
  REQUIRE_OK(t);
  CHECK(t->param_read_bytes_per_step == 24000);
  CHECK(t->peak_live_param_bytes == 4000);
}

TEST_CASE("engine model: the engine's refusals, micro-batches, ranks") {
  offload::Schedule s = ToySchedule();
  s.pinned_budget_bytes = 60000;  // less than the optimizer's buffers
  auto refused = PredictEngine(s, Toy(), EngineRunOptions{});
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.status().message().find("optimizer's pinned buffers") != std::string::npos);
  s.pinned_budget_bytes = 90112 + 8192;  // one page per gradient slot is not left
  CHECK_FALSE(PredictEngine(s, Toy(), EngineRunOptions{}).ok());
  s.pinned_budget_bytes = 90112 + 16384;  // the gradient staging takes what is left
  auto squeezed = PredictEngine(s, Toy(), EngineRunOptions{});
  REQUIRE_OK(squeezed);
  CHECK(squeezed->gradient_staging_pinned_bytes == 16384);

  EngineRunOptions two;
  two.gpu = false;
  two.micro_batches = 2;
  auto p = PredictEngine(ToySchedule(), Toy(), two);
  REQUIRE_OK(p);
  CHECK(p->param_read_bytes_per_step > 22000);
  CHECK(p->optimizer_read_bytes_per_step == 108448);  // one optimizer step either way

  EngineRunOptions ranks;
  ranks.gpu = false;
  ranks.world_size = 2;
  auto r = PredictEngine(ToySchedule(), Toy(), ranks);
  REQUIRE_OK(r);
  CHECK(r->partition_elements == 500 + 1000 + 5 + 1000 + 500);

  CHECK_FALSE(PredictEngine(ToySchedule(), estimator::ModelInventory{}, ranks).ok());
}

TEST_CASE("engine model: the Schedule's JSON form") {
  auto d = offload::ScheduleFromJson(nlohmann::json::object(), "schedule");
  REQUIRE_OK(d);
  CHECK(d->sub_group_elements == offload::Schedule{}.sub_group_elements);
  CHECK(d->param_tier == offload::Tier::kGpu);
  auto s = offload::ScheduleFromJson(nlohmann::json::parse(R"({
      "version": 1,
      "params": {"tier": "nvme", "dtype": "fp32", "persistence_threshold": 7,
                 "prefetch_bytes": 1, "max_live_bytes": 2, "buffer_bytes": 8192,
                 "buffer_count": 3},
      "optimizer": {"tier": "nvme", "name": "adam-amsgrad", "sub_group_elements": 4096,
                    "buffer_count": 5, "threads": 0},
      "nvme": {"path": "/x"}, "pinned_budget_bytes": 99})"),
                                     "schedule");
  REQUIRE_MESSAGE(s.ok(), s.status().message());
  CHECK(s->param_tier == offload::Tier::kNvme);
  CHECK(s->param_dtype == offload::ElementType::kFloat32);
  CHECK(offload::SwapOptimizerStates(s->optimizer) == 3);
  CHECK(s->param_buffer_count == 3);
  CHECK(s->optimizer_buffer_count == 5);
  CHECK(s->pinned_budget_bytes == 99);
  auto bad = offload::ScheduleFromJson(nlohmann::json::parse(R"({"params": {"dtype": "int8"}})"),
                                       "schedule");
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.status().message().find("params.dtype") != std::string::npos);
  CHECK_FALSE(
      offload::ScheduleFromJson(nlohmann::json::parse(R"({"params": {"tier": 3}})"), "schedule")
          .ok());
}

TEST_CASE("emit: the Schedule is sized for memplan's engine and predicted by its model") {
  auto model = estimator::LoadModel("llama-2-7b", estimator::ModelClassChoice::kFromArchitectures);
  REQUIRE_OK(model);
  Cluster c;
  c.gpu = *FindGpuPreset("rtx4090");
  c.gpus_per_node = 1;
  c.cpu_memory_bytes = uint64_t{64} << 30;
  c.nvme_path = "/mnt/nvme";
  c.nvme_capacity_bytes = uint64_t{1} << 40;
  Job job;
  job.model = "llama-2-7b";
  job.global_batch = 16;
  job.setup.seq_len = 2048;
  SearchOptions options;
  options.only_offload_optimizer = estimator::OffloadDevice::kNvme;
  options.only_offload_param = estimator::OffloadDevice::kNvme;
  auto r = SearchPlans(*model, c, job, options);
  REQUIRE_MESSAGE(r.ok(), r.status().message());
  REQUIRE_FALSE(r->plans.empty());
  auto e = EngineScheduleFor(r->plans.front(), c, *model);
  REQUIRE_MESSAGE(e.ok(), e.status().message());
  const nlohmann::ordered_json& j = e->json;
  // Within the engine's sub-group cap and half the RAM; the budget is what the engine pins.
  CHECK(j["optimizer"]["sub_group_elements"].get<uint64_t>() <= kMaxEngineSubGroupElements);
  CHECK(j["optimizer"]["sub_group_elements"].get<uint64_t>() % 1024 == 0);
  CHECK(e->prediction.pinned_bytes <= c.cpu_memory_bytes / 2);
  CHECK(j["pinned_budget_bytes"].get<uint64_t>() == e->prediction.pinned_bytes);
  // The file and the fields the prediction used are the same schedule.
  auto read = offload::ScheduleFromJson(nlohmann::json::parse(j.dump()), "schedule");
  REQUIRE_OK(read);
  CHECK(offload::ToOrderedJson(e->schedule) == j);
  CHECK(e->schedule.optimizer == offload::SwapOptimizer::kAdam);
  auto again = PredictEngine(
      *read, *model,
      EngineRunOptions{1, true, static_cast<uint32_t>(r->plans.front().setup.grad_accum)});
  REQUIRE_OK(again);
  CHECK(again->pinned_bytes == e->prediction.pinned_bytes);
  CHECK(again->nvme_read_bytes_per_step == e->prediction.nvme_read_bytes_per_step);
  CHECK(again->peak_live_param_bytes == e->prediction.peak_live_param_bytes);
  // 7B parameters, Adam: every step reads and writes at least 16 B per element.
  CHECK(e->prediction.optimizer_read_bytes_per_step >= 16 * e->prediction.partition_elements);
  CHECK(e->prediction.nvme_read_bytes_per_step > e->prediction.optimizer_read_bytes_per_step);

  // A RAM so small that even the smallest sub-groups do not fit: refused, saying why.
  Cluster tiny = c;
  tiny.cpu_memory_bytes = uint64_t{16} << 20;
  auto refused = EngineScheduleFor(r->plans.front(), tiny, *model);
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.status().message().find("pinned bytes per process") != std::string::npos);
  CHECK(refused.status().message().find("optimizer buffers") != std::string::npos);
}

}  // namespace
}  // namespace memplan::planner
