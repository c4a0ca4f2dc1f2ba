#include "planner/search.h"

#include <doctest/doctest.h>

#include <chrono>
#include <cstdio>

#include "estimator/model_source.h"
#include "planner/capacity.h"
#include "planner/check.h"
#include "planner/cluster.h"
#include "planner/emit.h"
#include "tests/status_testing.h"
#include "tests/testing.h"

namespace memplan::planner {
namespace {

using estimator::Checkpointing;
using estimator::OffloadDevice;

estimator::ModelInventory Model(const std::string& name) {
  auto m = estimator::LoadModel(name, estimator::ModelClassChoice::kFromArchitectures);
  REQUIRE_MESSAGE(m.ok(), m.status().message());
  return *m;
}

Cluster A100x8() {
  Cluster c;
  c.gpu = *FindGpuPreset("a100-80");
  c.gpus_per_node = 8;
  c.cpu_memory_bytes = uint64_t{1} << 40;
  c.cpu_cores = 64;
  return c;
}

Job MakeJob(const std::string& model, int64_t global_batch, int64_t seq) {
  Job job;
  job.model = model;
  job.global_batch = global_batch;
  job.setup.seq_len = seq;
  job.setup.flash_attention = true;
  return job;
}

const Plan* FindFamily(const PlanResult& r, const std::string& family) {
  for (const Plan& p : r.plans) {
    if (p.family == family) return &p;
  }
  return nullptr;
}

const Rejection* FindRejected(const PlanResult& r, const std::string& family) {
  for (const Rejection& x : r.rejected) {
    if (x.plan == family) return &x;
  }
  return nullptr;
}

TEST_CASE("cluster: presets and bench inputs") {
  CHECK(FindGpuPreset("A100").value().name == "a100-80");
  CHECK(FindGpuPreset("h200")->memory_bytes == uint64_t{143771} << 20);
  CHECK(FindGpuPreset("v100-16")->bf16_flops == 0);
  CHECK_FALSE(FindGpuPreset("tpu-v5").ok());
  // As people write them and nvidia-smi prints them (Note [GPU names]).
  // (A pair, not a structured binding: clang 14 cannot capture one in doctest's lambdas.)
  for (const std::pair<std::string, std::string>& name :
       std::vector<std::pair<std::string, std::string>>{{"h100-80gb", "h100-80"},
                                                        {"NVIDIA H100 80GB HBM3", "h100-80"},
                                                        {"H100-SXM", "h100-80"},
                                                        {"NVIDIA A100-SXM4-40GB", "a100-40"},
                                                        {"NVIDIA A100-SXM4-80GB", "a100-80"},
                                                        {"Tesla V100-SXM2-16GB", "v100-16"},
                                                        {"NVIDIA GeForce RTX 4090", "rtx4090"},
                                                        {"NVIDIA H200 NVL", "h200-nvl"},
                                                        {"AMD Instinct MI300X", "mi300x"},
                                                        {"Tesla T4", "t4"},
                                                        {"h200_141gb", "h200"}}) {
    auto gpu = FindGpuPreset(name.first);
    REQUIRE_MESSAGE(gpu.ok(), name.first);
    CHECK_MESSAGE(gpu->name == name.second, name.first);
  }
  // A PCIe or NVL part is another GPU: no preset, not the SXM one.
  CHECK_FALSE(FindGpuPreset("NVIDIA A100 80GB PCIe").ok());
  CHECK_FALSE(FindGpuPreset("NVIDIA H100 NVL").ok());
  CHECK_FALSE(FindGpuPreset("").ok());
  CHECK_FALSE(FindGpuPreset("gb").ok());
  CHECK(GpuAliasNote("H100-80GB").empty());  // the full preset, however written
  // A short name that picks one of several presets says so (issue 31 item 10).
  CHECK(GpuAliasNote("A100") ==
        "--gpu A100 is the a100-80 preset (80.0 GiB); for another card of this GPU give its "
        "preset: a100-40");
  CHECK(GpuAliasNote("v100").find("the v100-32 preset") != std::string::npos);
  CHECK(GpuAliasNote("h100").find(": h100-96") != std::string::npos);
  CHECK(GpuAliasNote("a100-80").empty());  // a full preset name
  CHECK(GpuAliasNote("4090").empty());     // rtx4090: one preset
  CHECK(GpuAliasNote("tpu-v5").empty());   // unknown: FindGpuPreset's error says it

  Cluster c = A100x8();
  CHECK(c.PcieBytesPerS() == doctest::Approx(32e9 * 0.8));
  CHECK(c.NvmeReadBytesPerS() == kNvmeReadPrior);
  CHECK(c.CpuAdamParamsPerS() == doctest::Approx(3.5e9));  // 64 cores x 1e8, capped
  nlohmann::json bench = {{"path", "/mnt/nvme"},
                          {"best", {{"read_bytes_per_s", 6.5e9}, {"write_bytes_per_s", 5.0e9}}},
                          {"aio", {{"block_size", 8388608}, {"queue_depth", 32}}}};
  REQUIRE_OK(ApplyNvmeBench(bench, "nvme.json", &c));
  CHECK(c.NvmeReadBytesPerS() == 6.5e9);
  CHECK(c.NvmeWriteBytesPerS() == 5.0e9);
  CHECK(c.nvme_path == "/mnt/nvme");
  CHECK(c.aio_block_size == 8388608);
  CHECK_FALSE(ApplyNvmeBench(nlohmann::json{{"best", nullptr}}, "n.json", &c).ok());
  // One reader of the report for the planner and `bench swap`: a direction not measured (null) is
  // 0, a measured one must be positive, and the aio block is a hint.
  Result<NvmeBenchReading> reading = NvmeBenchFromJson(
      {{"best", {{"read_bytes_per_s", nullptr}, {"write_bytes_per_s", 2e9}}},
       {"aio",
        {{"aio", {{"queue_depth", 8}, {"intra_op_parallelism", 99}, {"block_size", "1M"}}}}}},
      "n.json");
  REQUIRE_OK(reading);
  CHECK(reading->read_bytes_per_s == 0);
  CHECK(reading->write_bytes_per_s == 2e9);
  CHECK(reading->aio_queue_depth == 8);
  CHECK_FALSE(reading->aio_intra_op_parallelism.has_value());
  CHECK_FALSE(reading->aio_block_size.has_value());
  CHECK(NvmeBenchFromJson({{"best", {{"read_bytes_per_s", -1}}}}, "n.json").status().message() ==
        "n.json: 'best.read_bytes_per_s' must be a positive number, got -1");
  REQUIRE_OK(ApplyAdamBench({{"params_per_s", 1.2e9}, {"threads", 64}}, "adam.json", &c));
  CHECK(c.CpuAdamParamsPerS() == 1.2e9);

  // JSON round trip keeps what the planner uses.
  auto back = ClusterFromJson(
      ToJson(c)["gpu"].is_object()
          ? nlohmann::json{{"gpu", "a100-80"}, {"gpus_per_node", 8}, {"cpu_memory_bytes", "1TiB"}}
          : nlohmann::json(),
      "cluster.json");
  REQUIRE_OK(back);
  CHECK(back->WorldSize() == 8);
  CHECK(back->cpu_memory_bytes == uint64_t{1} << 40);
  auto bad = ClusterFromJson({{"gpu", "a100-80"}, {"gpus", 8}}, "cluster.json");
  CHECK(bad.status().message() ==
        "cluster.json: unknown key 'gpus' (did you mean gpu or gpus_per_node?)");
  bad = ClusterFromJson({{"gpu", {{"preset", "a100-80"}, {"hbm_bytes", 1}}}}, "cluster.json");
  CHECK(bad.status().message() ==
        "cluster.json: unknown key 'gpu.hbm_bytes' (did you mean hbm_bytes_per_s?)");
  bad = ClusterFromJson({{"gpu", "a100-80"}, {"nodes", 0}}, "cluster.json");
  CHECK(bad.status().message() ==
        "cluster.json: 'nodes' must be an integer from 1 to 1048576, got 0");
}

TEST_CASE("search: llama-2-7b on 8 x A100-80 keeps everything on the GPUs") {
  estimator::ModelInventory llama = Model("llama-2-7b");
  auto r = SearchPlans(llama, A100x8(), MakeJob("llama-2-7b", 64, 2048));
  REQUIRE_MESSAGE(r.ok(), r.status().message());
  REQUIRE(!r->plans.empty());
  const Plan& best = r->plans.front();
  CHECK(best.setup.offload_optimizer == OffloadDevice::kNone);
  CHECK(best.setup.offload_param == OffloadDevice::kNone);
  CHECK(best.setup.zero_stage >= 1);
  CHECK(best.setup.micro_batch * best.setup.grad_accum * 8 == 64);
  // Plain DDP needs 16+ bytes per parameter on each GPU: about 110 GiB; it cannot fit.
  const Rejection* ddp = FindRejected(*r, "ZeRO-0 (DDP)");
  REQUIRE(ddp != nullptr);
  CHECK(ddp->reason.find("per GPU, has 76.0 usable of 80.0") != std::string::npos);
  // Ranked fastest first (Note [Ranking]: a later plan keeping the job's optimizer is never
  // faster than an earlier one by more than the noise), every plan within its GPU budget.
  for (size_t i = 0; i < r->plans.size(); ++i) {
    CHECK(r->plans[i].peak.gpu_bytes <= r->plans[i].gpu_capacity_bytes);
    for (size_t j = 0; j < i; ++j) {
      if (r->plans[i].setup.optimizer != r->plans[j].setup.optimizer) continue;
      CHECK(r->plans[i].tokens_per_s <= r->plans[j].tokens_per_s * 1.03);
    }
  }
  // CPU offload is slower here: the CPU Adam step is exposed.
  const Plan* offload = FindFamily(*r, "ZeRO-2 + optimizer on CPU");
  REQUIRE(offload != nullptr);
  CHECK(offload->tokens_per_s < best.tokens_per_s);
  CHECK(offload->why.find("the optimizer step (CPU optimizer") != std::string::npos);
  // No NVMe path: NVMe families are rejected with the reason.
  const Rejection* nvme = FindRejected(*r, "ZeRO-3 + optimizer on NVMe");
  REQUIRE(nvme != nullptr);
  CHECK(nvme->reason == "no NVMe drive given (`nvme_path`)");
}

TEST_CASE("search: the Trainer's attention is what Transformers runs for the family") {
  // Llama loads with SDPA; Gemma-2 refuses it (_supports_sdpa = False), so its plan assumes and
  // writes eager attention, and says why.
  for (const char* name : {"llama-2-7b", "gemma-2-2b"}) {
    INFO(name);
    estimator::ModelInventory m = Model(name);
    auto r = SearchPlans(m, A100x8(), MakeJob(name, 64, 2048));
    REQUIRE_MESSAGE(r.ok(), r.status().message());
    REQUIRE(!r->plans.empty());
    const Plan& best = r->plans.front();
    const bool gemma = std::string(name) == "gemma-2-2b";
    CHECK(TrainerSettingsJson(best, m)["attn_implementation"] == (gemma ? "eager" : "sdpa"));
    bool said = false;
    for (const std::string& line : TrainerSettings(best, m, false)) {
      said = said || line.find("has no SDPA path in Transformers") != std::string::npos;
    }
    CHECK(said == gemma);
  }
}

TEST_CASE("search: feasibility follows the limits (GPU, CPU, NVMe)") {
  estimator::ModelInventory llama = Model("llama-2-7b");
  Cluster c;
  c.gpu = *FindGpuPreset("rtx4090");
  c.cpu_memory_bytes = uint64_t{64} << 30;
  c.cpu_cores = 16;
  Job job = MakeJob("llama-2-7b", 16, 2048);
  auto r = SearchPlans(llama, c, job);
  REQUIRE_OK(r);
  // Nothing fits a 24 GB card with 64 GiB RAM and no NVMe: the fp32 optimizer states alone are
  // 12 bytes x 6.7e9 = 75 GiB.
  CHECK(r->plans.empty());
  const Rejection* cpu = FindRejected(*r, "ZeRO-3 + optimizer on CPU + params on CPU");
  REQUIRE(cpu != nullptr);
  CHECK(cpu->reason.find("GiB of CPU memory per node, has") != std::string::npos);

  c.nvme_path = "/mnt/nvme";
  c.nvme_capacity_bytes = uint64_t{1} << 40;
  r = SearchPlans(llama, c, job);
  REQUIRE_OK(r);
  REQUIRE(!r->plans.empty());
  const Plan& best = r->plans.front();
  CHECK(best.setup.offload_optimizer == OffloadDevice::kNvme);
  CHECK(best.peak.gpu_bytes <= best.gpu_capacity_bytes);
  CHECK(best.peak.cpu_bytes <= uint64_t{64} << 30);
  CHECK(best.peak.nvme_bytes > 0);

  // A small drive rejects NVMe plans on capacity.
  c.nvme_capacity_bytes = uint64_t{10} << 30;
  r = SearchPlans(llama, c, job);
  REQUIRE_OK(r);
  CHECK(r->plans.empty());
  const Rejection* small = FindRejected(*r, "ZeRO-3 + optimizer on NVMe + params on NVMe");
  REQUIRE(small != nullptr);
  CHECK(small->reason.find("GiB of NVMe per node, has 9.0 usable of 10.0") != std::string::npos);
}

// Note [Field names in errors]: C and Python callers never typed a flag, so the planner's errors
// name the request's fields; the CLI maps them to its flags (tests/plan_cli_test.cc).
TEST_CASE("search: bad input is refused with the field named, not a flag") {
  estimator::ModelInventory llama = Model("llama-2-7b");
  auto r = SearchPlans(llama, A100x8(), MakeJob("llama-2-7b", 12, 2048));
  CHECK(r.status().message().find("`global_batch` 12 is not a multiple of the 8 GPUs") == 0);
  Cluster v100 = A100x8();
  v100.gpu = *FindGpuPreset("v100-32");
  r = SearchPlans(llama, v100, MakeJob("llama-2-7b", 64, 2048));
  CHECK(r.status().message().find("no bf16 support; use `precision` fp16-mixed") !=
        std::string::npos);
  SearchOptions options;
  options.only_micro_batch = 3;
  r = SearchPlans(llama, A100x8(), MakeJob("llama-2-7b", 64, 2048), options);
  CHECK(r.status().message() ==
        "`micro_batch` 3 does not divide the 8 sequences per GPU of `global_batch` 64");
  options.only_micro_batch = -1;
  CHECK(options.Validate().message() == "`micro_batch` must be >= 1");
  options = {};
  options.gpu_safety_fraction = 1.5;
  CHECK(options.Validate().message() == "`gpu_margin` must be in [0, 1)");
  Cluster c = A100x8();
  c.gpus_per_node = 0;
  CHECK(c.Validate().message() == "`gpus_per_node` must be in [1, 1024], got 0");
  CHECK(FindGpuPreset("z100").status().message().find("`gpu` 'z100': not a known GPU") == 0);

  CapacityRequest capacity;
  capacity.offers.push_back({*FindGpuPreset("a100-80"), 2.0, 8, std::nullopt});
  capacity.gpu_counts = {8};
  capacity.tokens = 0;
  CHECK(capacity.Validate().message() == "`tokens` must be a positive number of tokens below 1e18");
  capacity.tokens = 1e12;
  capacity.offers[0].gpus_per_node = 2048;
  CHECK(capacity.Validate().message() ==
        "`gpus_per_node` for a100-80 must be in [1, 1024], got 2048");
  // Every message above names a field, none a flag.
  for (const std::string& m :
       {r.status().message(), options.Validate().message(), capacity.Validate().message()}) {
    CHECK(m.find("--") == std::string::npos);
  }
}

TEST_CASE("search: llama-2-70b over the whole grid within the latency budget") {
  estimator::ModelInventory llama = Model("llama-2-70b");
  Cluster c = A100x8();
  c.nvme_path = "/mnt/nvme";
  c.nvme_capacity_bytes = uint64_t{4} << 40;
  const auto start = std::chrono::steady_clock::now();
  auto r = SearchPlans(llama, c, MakeJob("llama-2-70b", 64, 2048));
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  REQUIRE_OK(r);
  std::printf(
      "SearchPlans llama-2-70b, 8 x a100-80, %lld of %lld configurations evaluated: %.1f ms\n",
      static_cast<long long>(r->configurations), static_cast<long long>(r->grid_size), ms);
  // 14 families x 3 checkpointing modes x micro-batches {1, 2, 4, 8}; larger micro-batches of a
  // family are skipped once a smaller one does not fit.
  CHECK(r->grid_size == 14 * 3 * 4);
  CHECK(r->configurations > 14);
  CHECK(r->configurations <= r->grid_size);  // a grid point counts once, whatever its buffers
  // The target is 200 ms in a release build; ten times that, and five times more under the
  // sanitizers (ASan/UBSan's debug build once took 2195 ms on this shared 2-vCPU VM).
  CHECK(ms < 2000 * (memplan::testing::kSanitizerBuild ? 5 : 1));
  REQUIRE(!r->plans.empty());
  // 70B needs 16 bytes x 69e9 / 8 = 128 GiB of model states per GPU without offload or ZeRO-3.
  const Rejection* z2 = FindRejected(*r, "ZeRO-2");
  REQUIRE(z2 != nullptr);
  CHECK(z2->reason.find("per GPU, has 76.0 usable of 80.0") != std::string::npos);
}

TEST_CASE("emit: the DeepSpeed config of each plan passes check and keeps the batch arithmetic") {
  estimator::ModelInventory llama = Model("llama-2-7b");
  Cluster c = A100x8();
  c.nvme_path = "/mnt/nvme";
  c.nvme_capacity_bytes = uint64_t{4} << 40;
  auto r = SearchPlans(llama, c, MakeJob("llama-2-7b", 64, 2048));
  REQUIRE_OK(r);
  REQUIRE(r->plans.size() >= 5);
  for (const Plan& plan : r->plans) {
    CAPTURE(plan.family);
    auto ds = DeepSpeedConfig(plan, c, llama, {});
    REQUIRE_OK(ds);
    CHECK((*ds)["train_batch_size"] == 64);
    CHECK((*ds)["train_micro_batch_size_per_gpu"].get<int64_t>() *
              (*ds)["gradient_accumulation_steps"].get<int64_t>() * 8 ==
          64);
    CHECK((*ds)["zero_optimization"]["stage"] == plan.setup.zero_stage);
    CHECK(ds->dump().find("auto") == std::string::npos);
    CheckOptions options;
    options.model = &llama;
    options.cluster = c;
    options.seq_len = 2048;
    auto report = CheckDeepSpeedConfig(nlohmann::json::parse(ds->dump()), options);
    REQUIRE_OK(report);
    for (const Finding& f : report->problems) FAIL_CHECK(f.path << ": " << f.message);
    const bool nvme = plan.setup.offload_optimizer == OffloadDevice::kNvme ||
                      plan.setup.offload_param == OffloadDevice::kNvme;
    CHECK(ds->contains("aio") == nvme);
  }
  // For the Hugging Face Trainer: "auto" where it fills, and check accepts that only so.
  EmitOptions hf;
  hf.for_hf_trainer = true;
  auto ds = DeepSpeedConfig(r->plans.front(), c, llama, hf);
  REQUIRE_OK(ds);
  CHECK((*ds)["train_micro_batch_size_per_gpu"] == "auto");
  CheckOptions trainer;
  trainer.for_hf_trainer = true;
  CHECK(CheckDeepSpeedConfig(nlohmann::json::parse(ds->dump()), trainer)->problems.empty());
  CHECK(!CheckDeepSpeedConfig(nlohmann::json::parse(ds->dump()), {})->problems.empty());
}

TEST_CASE("emit: Accelerate, FSDP and Schedule") {
  estimator::ModelInventory llama = Model("llama-2-7b");
  Cluster c = A100x8();
  auto r = SearchPlans(llama, c, MakeJob("llama-2-7b", 64, 2048));
  REQUIRE_OK(r);
  const Plan& best = r->plans.front();
  EmitOptions options;
  auto yaml = AccelerateConfig(best, c, llama, options);
  REQUIRE_OK(yaml);
  CHECK(yaml->find("distributed_type: DEEPSPEED\n") != std::string::npos);
  CHECK(yaml->find("zero_stage: " + std::to_string(best.setup.zero_stage) + "\n") !=
        std::string::npos);
  CHECK(yaml->find("num_processes: 8\n") != std::string::npos);
  options.accelerate_plugin = "fsdp";
  yaml = AccelerateConfig(best, c, llama, options);
  REQUIRE_OK(yaml);
  CHECK(yaml->find("fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer\n") != std::string::npos);
  auto fsdp = FsdpConfig(best, c, llama);
  REQUIRE_OK(fsdp);
  CHECK((*fsdp)["sharding_strategy"] ==
        (best.setup.zero_stage == 3 ? "FULL_SHARD" : "SHARD_GRAD_OP"));
  // No offload: the engine has nothing to run.
  auto none = Schedule(best, c, llama);
  REQUIRE_FALSE(none.ok());
  CHECK(none.status().message().find("choose an offload plan (`plan_index`)") != std::string::npos);
  const Plan* offload = FindFamily(*r, "ZeRO-3 + optimizer on CPU + params on CPU");
  REQUIRE(offload != nullptr);
  auto schedule = Schedule(*offload, c, llama);
  REQUIRE_OK(schedule);
  CHECK((*schedule)["version"] == 1);
  CHECK((*schedule)["params"]["tier"] == "cpu");
  CHECK((*schedule)["optimizer"]["tier"] == "cpu");
  CHECK((*schedule)["optimizer"]["sub_group_elements"].get<uint64_t>() % 1024 == 0);
}

TEST_CASE("emit: what the consumers refuse (tests/plan_consumers runs them for real)") {
  estimator::ModelInventory llama = Model("llama-2-7b");
  Cluster c = A100x8();
  c.nodes = 2;
  auto r = SearchPlans(llama, c, MakeJob("llama-2-7b", 64, 2048));
  REQUIRE_OK(r);
  const Plan& best = r->plans.front();
  // Accelerate's launcher refuses mixed_precision beside a DeepSpeed config file; the path is
  // quoted so that " #" does not start a comment.
  EmitOptions options;
  options.deepspeed_config_path = "/runs/a #1: b/ds'\"config\n.json";
  auto yaml = AccelerateConfig(best, c, llama, options);
  REQUIRE_OK(yaml);
  // Double-quoted, so that a newline is kept rather than folded into a space.
  CHECK(yaml->find("  deepspeed_config_file: \"/runs/a #1: b/ds'\\\"config\\n.json\"\n") !=
        std::string::npos);
  options.deepspeed_config_path = "/runs/\xff.json";  // YAML cannot hold bytes that are not UTF-8
  yaml = AccelerateConfig(best, c, llama, options);
  REQUIRE_FALSE(yaml.ok());
  CHECK(yaml.status().message().find("not UTF-8") != std::string::npos);
  options.deepspeed_config_path = "/runs/a #1: b/ds.json";
  yaml = AccelerateConfig(best, c, llama, options);
  REQUIRE_OK(yaml);
  CHECK(yaml->find("mixed_precision") == std::string::npos);
  options.deepspeed_config_path.clear();
  yaml = AccelerateConfig(best, c, llama, options);
  REQUIRE_OK(yaml);
  CHECK(yaml->find("mixed_precision: bf16\n") != std::string::npos);

  // Hybrid sharding: FSDP's HYBRID_SHARD over (nodes, GPUs per node); DeepSpeed 0.19 has no
  // MiCS, so its emitters decline.
  Plan hybrid = best;
  hybrid.setup.zero_stage = 3;
  hybrid.sharding = Sharding::kHybrid;
  auto fsdp = FsdpConfig(hybrid, c, llama);
  REQUIRE_OK(fsdp);
  CHECK((*fsdp)["sharding_strategy"] == "HYBRID_SHARD");
  CHECK((*fsdp)["accelerate"]["sharding_strategy"] == "HYBRID_SHARD");
  CHECK_FALSE((*fsdp)["accelerate"].contains("reshard_after_forward"));
  CHECK((*fsdp)["fully_shard"]["mesh"]["shape"] == nlohmann::ordered_json::array({2, 8}));
  CHECK((*fsdp)["fully_shard"]["reshard_after_forward"] == true);
  auto ds = DeepSpeedConfig(hybrid, c, llama, {});
  REQUIRE_FALSE(ds.ok());
  CHECK(ds.status().message().find("MiCS") != std::string::npos);
  // Which emitter declined is the caller's to say (the CLI's flag, the request's "not_emitted"
  // key); the message names the fields that would change it.
  CHECK(ds.status().message().find("choose `sharding` full") != std::string::npos);
  CHECK(ds.status().message().find("--") == std::string::npos);
  CHECK_FALSE(AccelerateConfig(hybrid, c, llama, {}).ok());
  options.accelerate_plugin = "fsdp";
  yaml = AccelerateConfig(hybrid, c, llama, options);
  REQUIRE_OK(yaml);
  // Under FSDP1 Accelerate obeys sharding_strategy (Note [FSDP1's strategy in Accelerate]).
  CHECK(yaml->find("  fsdp_sharding_strategy: HYBRID_SHARD\n") != std::string::npos);
  CHECK(yaml->find("fsdp_reshard_after_forward") == std::string::npos);
}

TEST_CASE("emit: parameters on NVMe get the swap buffers DeepSpeed asserts on") {
  estimator::ModelInventory llama = Model("llama-2-7b");
  Cluster c;
  c.gpu = *FindGpuPreset("rtx4090");
  c.cpu_memory_bytes = uint64_t{128} << 30;
  c.nvme_path = "/mnt/nvme";
  c.nvme_capacity_bytes = uint64_t{4} << 40;
  auto r = SearchPlans(llama, c, MakeJob("llama-2-7b", 16, 2048));
  REQUIRE_OK(r);
  int checked = 0;
  for (const Plan& plan : r->plans) {
    if (plan.setup.offload_param != OffloadDevice::kNvme) continue;
    ++checked;
    auto ds = DeepSpeedConfig(plan, c, llama, {});
    REQUIRE_OK(ds);
    const nlohmann::ordered_json& z = (*ds)["zero_optimization"];
    // One layer (202,383,360 elements, rounded up to a million) stays gathered for reuse; its
    // seven Linears and the next module's one each hold a buffer.
    CHECK(z["stage3_max_reuse_distance"] == 203000000);
    CHECK(z["stage3_max_live_parameters"] == 203000000);
    CHECK(z["offload_param"]["buffer_count"].get<int64_t>() >= 8);
    // The largest partition: the embedding (one GPU), 131,072,000 elements.
    int64_t size = 131072000;
    if (plan.setup.offload_optimizer == OffloadDevice::kNvme) {
      size += z["sub_group_size"].get<int64_t>();  // a sub-group of 16-bit parameters
    }
    CHECK(z["offload_param"]["buffer_size"].get<int64_t>() >= size);
  }
  CHECK(checked >= 1);
}

// Issue 16, build 5: an out-of-memory finding names the keys that fill the GPU, and a memlock one
// the swap buffers, both in the message and in Finding::keys (JSON "keys").
TEST_CASE("check: out-of-memory and memlock findings name the keys that cause them") {
  estimator::ModelInventory llama = Model("llama-2-7b");
  CheckOptions options;
  options.model = &llama;
  options.cluster = A100x8();
  options.cluster->gpu = *FindGpuPreset("a100-40");
  options.seq_len = 2048;
  nlohmann::json ds = {{"train_batch_size", 64},
                       {"train_micro_batch_size_per_gpu", 8},
                       {"bf16", {{"enabled", true}}},
                       {"zero_optimization", {{"stage", 1}, {"reduce_bucket_size", 4000000000}}}};
  auto report = CheckDeepSpeedConfig(ds, options);
  REQUIRE_OK(report);
  REQUIRE(report->problems.size() == 1);
  const Finding& oom = report->problems[0];
  CHECK(oom.path == "zero_optimization.stage");
  const auto& keys = oom.keys;
  auto has = [&](const std::string& k) {
    return std::find(keys.begin(), keys.end(), k) != keys.end();
  };
  CHECK(has("train_micro_batch_size_per_gpu"));
  CHECK(has("zero_optimization.reduce_bucket_size"));  // a 4e9-element bucket is 7.5 GiB x 4.5
  CHECK(oom.message.find("comm_reduce_bucket") != std::string::npos);
  CHECK(ToJson(*report)["problems"][0]["keys"].size() == keys.size());
  // ZeRO-0 (LLaMA-Factory's ds_z0_config.json): the optimizer step's transient is the whole
  // model's, which a higher stage shards; sub_group_size is ZeRO-3's and does not size it.
  ds["zero_optimization"] = {{"stage", 0}};
  ds["train_micro_batch_size_per_gpu"] = 1;
  ds["train_batch_size"] = 8;
  report = CheckDeepSpeedConfig(ds, options);
  REQUIRE_OK(report);
  REQUIRE(report->problems.size() == 1);
  CHECK(report->problems[0].message.find("optimizer_step_transient 25.1 GiB "
                                         "(zero_optimization.stage)") != std::string::npos);
  CHECK(std::find(report->problems[0].keys.begin(), report->problems[0].keys.end(),
                  "zero_optimization.sub_group_size") == report->problems[0].keys.end());

  // NVMe swap buffers beyond RLIMIT_MEMLOCK: the buffer keys are named.
  options.cluster->gpu = *FindGpuPreset("a100-80");
  options.cluster->memlock_bytes = uint64_t{1} << 30;
  nlohmann::json nvme = {{"train_batch_size", 8},
                         {"train_micro_batch_size_per_gpu", 1},
                         {"bf16", {{"enabled", true}}},
                         {"zero_optimization",
                          {{"stage", 3},
                           {"stage3_max_reuse_distance", 0},
                           {"offload_param",
                            {{"device", "nvme"},
                             {"nvme_path", "/nvme"},
                             {"buffer_count", 5},
                             {"buffer_size", 200000000}}}}}};
  report = CheckDeepSpeedConfig(nvme, options);
  REQUIRE_OK(report);
  REQUIRE(report->problems.size() == 1);
  CHECK(report->problems[0].path == "aio");
  CHECK(report->problems[0].message.find("nvme_param_swap_buffers") != std::string::npos);
  CHECK(std::find(report->problems[0].keys.begin(), report->problems[0].keys.end(),
                  "zero_optimization.offload_param.buffer_size") != report->problems[0].keys.end());
  // Without the model: buffer_count x buffer_size x 2 bytes = 2.0 GiB against the same 1 GiB.
  options.model = nullptr;
  report = CheckDeepSpeedConfig(nvme, options);
  REQUIRE_OK(report);
  REQUIRE(report->problems.size() == 1);
  CHECK(report->problems[0].path == "zero_optimization.offload_param.buffer_size");
  CHECK(report->problems[0].message.find("lock 1.9 GiB per process") != std::string::npos);
  options.cluster->memlock_bytes = uint64_t{2} << 30;  // 2e9 bytes fit 2 GiB
  CHECK(CheckDeepSpeedConfig(nvme, options)->problems.empty());
}

TEST_CASE("check: bf16 on a GPU without it") {
  CheckOptions options;
  options.cluster = A100x8();
  nlohmann::json ds = {{"train_batch_size", 8}, {"bf16", {{"enabled", true}}}};
  CHECK(CheckDeepSpeedConfig(ds, options)->problems.empty());
  for (const char* gpu : {"v100-32", "v100-16"}) {
    options.cluster->gpu = *FindGpuPreset(gpu);
    auto report = CheckDeepSpeedConfig(ds, options);
    REQUIRE(report->problems.size() == 1);
    CHECK(report->problems[0].path == "bf16.enabled");
  }
  ds["bf16"]["enabled"] = false;
  ds["fp16"] = {{"enabled", true}};
  CHECK(CheckDeepSpeedConfig(ds, options)->problems.empty());
  // "auto" (the Trainer fills it from its own flags): not a finding, and no exception either.
  options.for_hf_trainer = true;
  ds["bf16"]["enabled"] = "auto";
  ds["fp16"]["enabled"] = "auto";
  ds["zero_optimization"] = {{"stage", 3},
                             {"offload_param", {{"device", "nvme"}, {"nvme_path", "/nvme"}}}};
  options.cluster->memlock_bytes = uint64_t{1} << 20;
  auto report = CheckDeepSpeedConfig(ds, options);
  REQUIRE_OK(report);
  REQUIRE(report->problems.size() == 1);  // 5 x 1e8 fp32 elements (no 16-bit enabled) > 1 MiB
  CHECK(report->problems[0].message.find("lock 1.9 GiB") != std::string::npos);
}

TEST_CASE("check: integers as DeepSpeed reads them, and no more than int64 holds") {
  auto problems = [](const nlohmann::json& value) {
    nlohmann::json ds = {{"train_batch_size", 8},
                         {"zero_optimization", {{"stage", 2}, {"allgather_bucket_size", value}}}};
    return CheckDeepSpeedConfig(ds, {})->problems.size();
  };
  CHECK(problems(5e8) == 0);
  CHECK(problems(int64_t{0}) == 0);
  CHECK(problems(INT64_MAX) == 0);
  CHECK(problems(uint64_t{1} << 63) == 1);  // once wrapped to a negative int64
  CHECK(problems(9.3e18) == 1);             // a cast beyond int64 is undefined
  CHECK(problems(-1) == 1);
  CHECK(problems(5.5) == 1);
}

TEST_CASE("check: suggestions use edit distance") {
  // The distance is common/suggest's EditDistance (suggest_test.cc): a missing letter and a swap
  // of two neighbours are one edit each.
  auto suggestion = [](const std::string& key) {
    auto report = CheckDeepSpeedConfig({{"zero_optimization", {{key, true}}}}, {});
    REQUIRE_OK(report);
    for (const Finding& f : report->problems) {
      if (f.path == "zero_optimization." + key) return f.message;
    }
    return std::string();
  };
  CHECK(suggestion("overlap_com") ==
        "unknown key; did you mean overlap_comm? (DeepSpeed refuses the config)");
  CHECK(suggestion("contigous_gradients") ==
        "unknown key; did you mean contiguous_gradients? (DeepSpeed refuses the config)");
  CHECK(suggestion("overlpa_comm") ==
        "unknown key; did you mean overlap_comm? (DeepSpeed refuses the config)");
  CHECK(CheckDeepSpeedConfig(nlohmann::json::array(), {}).status().message() ==
        "a DeepSpeed config must be a JSON object");
}

TEST_CASE("check: DeepSpeed 0.19's keys, the keys it removed, and comments") {
  // Note [DeepSpeed's keys]: each case is a config as it is found in the wild (LLaMA-Factory's
  // examples/deepspeed, axolotl's deepspeed_configs), cut to the key in question.
  auto findings = [](const nlohmann::json& extra) {
    nlohmann::json ds = {{"train_micro_batch_size_per_gpu", 1},
                         {"bf16", {{"enabled", true}}},
                         {"zero_optimization", {{"stage", 3}}}};
    ds.merge_patch(extra);
    auto report = CheckDeepSpeedConfig(ds, {});
    REQUIRE_OK(report);
    std::vector<std::string> out;
    for (const Finding& f : report->problems) out.push_back(f.path + ": " + f.message);
    return out;
  };
  using Lines = std::vector<std::string>;
  // Keys DeepSpeed 0.19 reads (AutoTP, the comms logger, ZenFlow, SuperOffload, 16-bit masters).
  CHECK(findings(
            {{"tensor_parallel", {{"autotp_size", 2}}},
             {"comms_logger", {{"enabled", false}}},
             {"gradient_allreduce_op", "mean"},
             {"zero_optimization",
              {{"zenflow", nlohmann::json::object()},
               {"offload_optimizer", {{"device", "cpu"}, {"super_offload", true}}}}},
             {"bf16", {{"bf16_master_weights_and_grads", true}, {"bf16_optimizer_states", true}}}})
            .empty());
  // A top-level comment is let be; in a section whose pydantic class forbids other keys it is not.
  CHECK(findings({{"_comment", "supported models: ..."}}).empty());
  CHECK(findings({{"zero_optimization", {{"_comment", "x"}}}}) ==
        Lines{"zero_optimization._comment: unknown key (DeepSpeed refuses the config)"});
  CHECK(findings({{"comms_config", {{"verbose", false}}}}) ==
        Lines{"comms_config: unknown key (DeepSpeed ignores it)"});
  // monitor_config is DeepSpeed's attribute, not a key it reads (its monitors are top-level keys).
  CHECK(findings({{"monitor_config", {{"enabled", true}}}}) ==
        Lines{"monitor_config: unknown key (DeepSpeed ignores it)"});
  // Removed in 0.19, which refuses them.
  const Lines removed = findings({{"elasticity", {{"enabled", false}}},
                                  {"amp", {{"enabled", false}}},
                                  {"zero_optimization", {{"mics_shard_size", 8}}}});
  REQUIRE(removed.size() == 3);
  CHECK(removed[0].find("amp: removed in DeepSpeed 0.19, which refuses a config that has it: "
                        "NVIDIA Apex AMP") == 0);
  CHECK(removed[1].find("elasticity: removed in DeepSpeed 0.19") == 0);
  CHECK(removed[2].find("zero_optimization.mics_shard_size: removed in DeepSpeed 0.19") == 0);
  // 16-bit master weights: ZeRO 1-3 only, and bf16 states only with bf16 masters.
  CHECK(findings({{"zero_optimization", {{"stage", 0}}},
                  {"bf16", {{"bf16_master_weights_and_grads", true}}}}) ==
        Lines{"bf16.bf16_master_weights_and_grads: needs ZeRO stage 1, 2 or 3 (stage is 0); "
              "DeepSpeed asserts at start-up"});
  CHECK(findings({{"bf16", {{"bf16_optimizer_states", true}}}}) ==
        Lines{"bf16.bf16_optimizer_states: needs bf16.bf16_master_weights_and_grads true; "
              "DeepSpeed 0.19 asserts at start-up"});
}

TEST_CASE("search: the checkpointing policies each framework offers, the tightest last") {
  using estimator::Framework;
  auto labels = [](Framework f) {
    std::vector<std::string> out;
    for (const CheckpointPolicy& p : FrameworkCheckpointPolicies(f)) {
      estimator::TrainingSetup s;
      s.checkpointing = p.checkpointing;
      s.checkpoint_every = p.every;
      out.push_back(CheckpointLabel(s));
    }
    return out;
  };
  CHECK(labels(Framework::kTransformers) == std::vector<std::string>{"none", "selective", "full"});
  CHECK(labels(Framework::kTorchtitan) == std::vector<std::string>{"none", "op", "full/2", "full"});
  CHECK(labels(Framework::kTorchtune) == std::vector<std::string>{"none", "full/2", "full"});
  CHECK(labels(Framework::kLitGpt) == std::vector<std::string>{"none", "full"});
  CHECK(labels(Framework::kLlmFoundry) == std::vector<std::string>{"none", "full"});
}

}  // namespace
}  // namespace memplan::planner
