#include "planner/step_time.h"

#include <doctest/doctest.h>

#include <algorithm>

#include "estimator/model_source.h"
#include "tests/status_testing.h"

namespace memplan::planner {
namespace {

using estimator::Checkpointing;
using estimator::OffloadDevice;
using estimator::Precision;
using estimator::TrainingSetup;

Cluster A100s(int64_t gpus, int64_t nodes = 1) {
  Cluster c;
  c.gpu = *FindGpuPreset("a100-80");
  c.gpus_per_node = gpus;
  c.nodes = nodes;
  c.cpu_memory_bytes = uint64_t{1} << 40;
  c.cpu_cores = 64;
  return c;
}

// A model the arithmetic can follow: 32 layers of one 4096 x 4096 Linear each, no attention work
// beyond what the test sets, no elementwise traffic, no logits.
ModelShape Toy() {
  ModelShape m;
  m.params = 32.0 * 4096 * 4096;
  m.trainable = m.params;
  m.layers = 32;
  m.hidden = 4096;
  m.attention_width = 0;
  m.heads = 32;
  m.vocab = 0;
  m.seq_len = 4096;
  m.layer_gemms = {Gemm{4096, 4096, 1, false, false, 32}};
  return m;
}

TimeConstants Quiet() {
  TimeConstants k = DefaultTimeConstants();
  k.launch_s_per_layer = 0;
  k.sharded_hook_s = 0;
  k.collective_latency_s = 0;
  k.overlap_interference = 0;
  k.step_fixed_s = 0;
  k.gemm_k_overhead = 0;
  return k;
}

TEST_CASE("step time: GEMMs are timed by their roofline, forward 1x, backward 2x, recompute 1x") {
  const TimeConstants k = Quiet();
  const Cluster c = A100s(1);
  TrainingSetup s;
  s.micro_batch = 2;
  s.grad_accum = 1;
  const ModelShape m = Toy();
  StepTime t = PredictStepTime(m, c, s, 2, true, Sharding::kFull, k);
  // Compute-bound: M = 8192 tokens. 32 layers x 3 GEMMs x 2 M K N at 80% of 312 TFLOPS.
  const double one = 2.0 * 8192 * 4096 * 4096 / (312e12 * 0.80);
  CHECK(t.gemm_s == doctest::Approx(32 * 3 * one));
  CHECK(t.model_flops == doctest::Approx(6 * m.params * 8192));
  CHECK(t.hardware_flops == doctest::Approx(t.model_flops));
  // Full recompute runs the forward again: 4 GEMMs, HFU counts it, MFU does not.
  s.checkpointing = Checkpointing::kFull;
  StepTime full = PredictStepTime(m, c, s, 2, true, Sharding::kFull, k);
  CHECK(full.gemm_s == doctest::Approx(32 * 4 * one));
  CHECK(full.model_flops == doctest::Approx(t.model_flops));
  CHECK(full.hardware_flops == doctest::Approx(8 * m.params * 8192));
  // Every 2nd block checkpointed (fms-fsdp's p = 1/2, torchtitan's selective 2): half the layers
  // recompute their forward.
  s.checkpoint_every = 2;
  StepTime half = PredictStepTime(m, c, s, 2, true, Sharding::kFull, k);
  CHECK(half.gemm_s == doctest::Approx(32 * 3.5 * one));
  CHECK(half.hardware_flops == doctest::Approx(7 * m.params * 8192));
  s.checkpoint_every = 1;
  // torchtitan's op-level SAC saves every other matmul's output: half the GEMMs run again.
  s.checkpointing = Checkpointing::kOp;
  StepTime op = PredictStepTime(m, c, s, 2, true, Sharding::kFull, k);
  CHECK(op.gemm_s == doctest::Approx(32 * 3.5 * one));
  CHECK(op.hardware_flops == doctest::Approx(7 * m.params * 8192));
  CHECK(op.attention_s == doctest::Approx(t.attention_s));
  s.checkpointing = Checkpointing::kFull;
  // Memory-bound when M is small: one token reads the whole weight.
  TrainingSetup tiny = s;
  tiny.checkpointing = Checkpointing::kNone;
  tiny.micro_batch = 1;
  ModelShape short_seq = m;
  short_seq.seq_len = 1;
  StepTime t1 = PredictStepTime(short_seq, c, tiny, 1, true, Sharding::kFull, k);
  const double weight_read = 2.0 * (4096 + 4096.0 * 4096 + 4096) / (2039e9 * 0.80);
  CHECK(t1.gemm_s == doctest::Approx(32 * 3 * weight_read));
}

TEST_CASE("step time: narrow GEMMs pay the tile overhead, wide ones do not") {
  TimeConstants k = Quiet();
  k.gemm_k_overhead = 256;
  const Cluster c = A100s(1);
  TrainingSetup s;
  s.micro_batch = 2;
  ModelShape wide = Toy();
  wide.layer_gemms = {Gemm{8192, 8192, 1, false, false, 32}};
  StepTime w = PredictStepTime(wide, c, s, 2, true, Sharding::kFull, k);
  CHECK(w.gemm_s == doctest::Approx(32 * 3 * 2.0 * 8192 * 8192 * 8192 / (312e12 * 0.80)));
  ModelShape narrow = Toy();
  narrow.layer_gemms = {Gemm{1024, 1024, 1, false, false, 32}};
  StepTime n = PredictStepTime(narrow, c, s, 2, true, Sharding::kFull, k);
  const double ideal = 32 * 3 * 2.0 * 8192 * 1024 * 1024 / (312e12 * 0.80);
  CHECK(n.gemm_s == doctest::Approx(ideal * (1024 + 256) / 1024 * 8192 / (8192 + 256)));
}

TEST_CASE("step time: ZeRO-3 gathers twice and reduce-scatters every micro-batch") {
  const TimeConstants k = Quiet();
  const Cluster c = A100s(8);
  TrainingSetup s;
  s.zero_stage = 3;
  s.micro_batch = 1;
  s.grad_accum = 4;
  const ModelShape m = Toy();
  StepTime t = PredictStepTime(m, c, s, 32, true, Sharding::kFull, k);
  const double bytes = 2 * m.params;
  const double gather = bytes * 7 / 8 / (300e9 * k.link_efficiency);
  CHECK(t.comm_s == doctest::Approx(4 * 3 * gather));
  // Hidden behind compute except the first gather and last reduce-scatter of each micro-batch.
  CHECK(t.exposed_comm_s == doctest::Approx(4 * 2 * gather / 32));
  // Across nodes the node's network is the limit.
  const Cluster two = A100s(8, 2);
  StepTime t2 = PredictStepTime(m, two, s, 64, true, Sharding::kFull, k);
  const double across = bytes * 15 / 16 / (200e9 * k.network_efficiency);
  CHECK(t2.comm_s == doctest::Approx(4 * 3 * across));
  // Hybrid sharding gathers within the node and all-reduces each GPU's gradient shard across.
  StepTime h = PredictStepTime(m, two, s, 64, true, Sharding::kHybrid, k);
  const double allreduce = 2 * (bytes / 8) * 0.5 * 8 / (200e9 * k.network_efficiency);
  CHECK(h.comm_s == doctest::Approx(4 * (3 * gather + allreduce)));
}

TEST_CASE("step time: collectives overlapped with compute still slow it") {
  TimeConstants k = Quiet();
  const Cluster c = A100s(8);
  TrainingSetup s;
  s.zero_stage = 3;
  s.micro_batch = 1;
  const ModelShape m = Toy();
  const StepTime quiet = PredictStepTime(m, c, s, 8, true, Sharding::kFull, k);
  k.overlap_interference = 0.25;
  const StepTime busy = PredictStepTime(m, c, s, 8, true, Sharding::kFull, k);
  CHECK(busy.compute_s == doctest::Approx(quiet.compute_s + 0.25 * quiet.comm_s));
}

TEST_CASE("step time: CPU offload pays the CPU step, its host passes and the copies") {
  const TimeConstants k = Quiet();
  Cluster c = A100s(2);
  c.cpu_adam_params_per_s = 2e9;
  TrainingSetup s;
  s.zero_stage = 2;
  s.offload_optimizer = OffloadDevice::kCpu;
  s.micro_batch = 4;
  ModelShape m = Toy();
  m.seq_len = 512;
  StepTime t = PredictStepTime(m, c, s, 8, true, Sharding::kFull, k);
  const double adam = m.params / 2e9;
  CHECK(t.optimizer_s ==
        doctest::Approx(adam * (1 + k.cpu_extra_bytes_per_param / k.cpu_adam_bytes_per_param)));
  // Two A100s share one host link: fp32 gradients down, 16-bit parameters up.
  const double pcie = 32e9 * 0.8 / 2;
  CHECK(t.pcie_s == doctest::Approx((4 + 2) * (m.params / 2) / pcie));
  // Pageable memory halves the rate.
  CHECK(PredictStepTime(m, c, s, 8, false, Sharding::kFull, k).pcie_s ==
        doctest::Approx(2 * t.pcie_s));
  CHECK(t.bound == "CPU optimizer");
}

TEST_CASE("step time: NVMe optimizer and parameters") {
  const TimeConstants k = Quiet();
  Cluster c = A100s(1);
  c.nvme_path = "/nvme";
  TrainingSetup s;
  s.zero_stage = 3;
  s.offload_optimizer = OffloadDevice::kNvme;
  s.offload_param = OffloadDevice::kNvme;
  const ModelShape m = Toy();
  StepTime t = PredictStepTime(m, c, s, 1, true, Sharding::kFull, k);
  const double states = m.params * 12;  // fp32 master + m + v
  const double params = m.params * 2;
  CHECK(t.nvme_s == doctest::Approx(states / kNvmeReadPrior + states / kNvmeWritePrior +
                                    2 * params / kNvmeReadPrior + params / kNvmeWritePrior));
}

TEST_CASE("step time: LoRA's MFU counts LoRA's FLOPs; QLoRA pays its dequantisation") {
  auto inventory =
      estimator::LoadModel("llama-2-7b", estimator::ModelClassChoice::kFromArchitectures);
  REQUIRE_OK(inventory);
  TrainingSetup s;
  s.seq_len = 1024;
  s.lora_rank = 16;
  auto lora = ModelShapeFor(*inventory, s);
  REQUIRE_OK(lora);
  TrainingSetup q = s;
  q.qlora = true;
  auto qlora = ModelShapeFor(*inventory, q);
  REQUIRE_OK(qlora);
  const Cluster c = A100s(1);
  StepTime tl = PredictStepTime(*lora, c, s, 1, true);
  StepTime tq = PredictStepTime(*qlora, c, q, 1, true);
  // 4 FLOPs per frozen parameter per token (no weight gradient), 6 per adapter parameter.
  const double attention = 12.0 * 1024 * 4096 * 32;
  const double frozen = lora->params - 2 * 32000.0 * 4096;  // embedding out, head frozen in
  CHECK(tl.model_flops / 1024 ==
        doctest::Approx(4 * (frozen + 32000.0 * 4096) + 6 * lora->trainable + attention)
            .epsilon(0.001));
  CHECK(qlora->quantized_params > 6e9);
  CHECK(tq.total_s > tl.total_s);
  CHECK(tq.model_flops == doctest::Approx(tl.model_flops));
}

TEST_CASE("step time: shapes from the inventory") {
  auto inventory =
      estimator::LoadModel("llama-2-7b", estimator::ModelClassChoice::kFromArchitectures);
  REQUIRE_OK(inventory);
  TrainingSetup s;
  s.seq_len = 4096;
  auto m = ModelShapeFor(*inventory, s);
  REQUIRE_OK(m);
  double gemm_params = 0;
  for (const Gemm& g : m->layer_gemms) gemm_params += g.count * g.k * g.n;
  CHECK(gemm_params == doctest::Approx(32.0 * (4 * 4096 * 4096 + 3 * 4096 * 11008)));
  REQUIRE(m->head_gemms.size() == 1);
  CHECK(m->head_gemms[0].n == 32000);
  CHECK(m->activation_bytes_per_token_layer > 0);
  CHECK(m->trainable == m->params);
}

}  // namespace
}  // namespace memplan::planner
