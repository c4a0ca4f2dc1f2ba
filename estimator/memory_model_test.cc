// The memory model against published figures: the ZeRO paper's example, Korthikanti et al.'s
// per-layer activation formulas, and a measured BERT-large training run; plus how items move
// between tiers and phases when the setup changes.
#include "estimator/memory_model.h"

#include "estimator/estimate.h"

#include <doctest/doctest.h>

#include <string>

#include "tests/estimator_testing.h"

namespace memplan::estimator {
namespace {

using memplan::testing::MustBuild;

constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr uint64_t kGiB = uint64_t{1} << 30;

MemoryEstimate MustEstimate(const ModelInventory& inventory, const TrainingSetup& setup) {
  Result<MemoryEstimate> m = EstimateMemory(inventory, setup);
  REQUIRE_MESSAGE(m.ok(), m.status().ToString());
  return std::move(m).value();
}

const MemoryItem* Item(const MemoryEstimate& m, const std::string& name) {
  for (const MemoryItem& item : m.items) {
    if (item.name == name) return &item;
  }
  return nullptr;
}

uint64_t Gpu(const MemoryEstimate& m, const std::string& name) {
  const MemoryItem* item = Item(m, name);
  return item == nullptr ? 0 : item->gpu_bytes;
}

const PhaseTotals& PhaseOf(const MemoryEstimate& m, const std::string& name) {
  for (const PhaseTotals& p : m.phases) {
    if (p.phase == name) return p;
  }
  FAIL("no phase " << name);
  return m.phases.front();
}

// --- ZeRO paper -------------------------------------------------------------------------------

TEST_CASE("memory model: the ZeRO paper's 7.5B-parameter example on 64 GPUs") {
  // Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"
  // (SC'20), Figure 1: Psi = 7.5B, N_d = 64, K = 12 -> 120 GB (baseline), 31.4 GB (P_os),
  // 16.6 GB (P_os+g), 1.9 GB (P_os+g+p), GB = 1e9 bytes.
  constexpr uint64_t kPsi = 7'500'000'000;
  CHECK(ZeroPaperBytesPerGpu(kPsi, 64, 0) == 120'000'000'000);
  CHECK(ZeroPaperBytesPerGpu(kPsi, 64, 1) == 31'406'250'000);
  CHECK(ZeroPaperBytesPerGpu(kPsi, 64, 2) == 16'640'625'000);
  CHECK(ZeroPaperBytesPerGpu(kPsi, 64, 3) == 1'875'000'000);
  auto gb1 = [](uint64_t bytes) { return static_cast<double>(bytes) / 1e9; };
  CHECK(gb1(ZeroPaperBytesPerGpu(kPsi, 64, 1)) == doctest::Approx(31.4).epsilon(0.002));
  CHECK(gb1(ZeroPaperBytesPerGpu(kPsi, 64, 2)) == doctest::Approx(16.6).epsilon(0.003));
  CHECK(gb1(ZeroPaperBytesPerGpu(kPsi, 64, 3)) == doctest::Approx(1.9).epsilon(0.02));
}

TEST_CASE("memory model: model states follow the paper's partitioning, plus fp32 gradients") {
  // A shape list carries no architecture; use a small GPT-2 whose counts are easy to follow.
  ModelInventory gpt2 = MustBuild({{"model_type", "gpt2"}});
  TrainingSetup s;
  s.precision = Precision::kBf16Mixed;
  s.gpus_per_node = 8;
  s.micro_batch = 1;
  s.seq_len = 128;
  const uint64_t p = 124439808;
  for (int stage = 0; stage <= 3; ++stage) {
    CAPTURE(stage);
    s.zero_stage = stage;
    MemoryEstimate m = MustEstimate(gpt2, s);
    const uint64_t os = stage >= 1 ? (p + 7) / 8 : p;
    const uint64_t gr = stage >= 2 ? (p + 7) / 8 : p;
    CHECK(Gpu(m, "params_master") == 4 * os);
    CHECK(Gpu(m, "optimizer_states") == 8 * os);
    CHECK(Gpu(m, "grads") == 2 * gr);
    CHECK(Gpu(m, "grads_fp32") == 4 * os);
    CHECK((Item(m, "grads_fp32")->phases & kPhaseForward) == 0);  // a step transient
    if (stage < 3) CHECK(Gpu(m, "params_working") == 2 * p);
  }
}

// --- Korthikanti ------------------------------------------------------------------------------

// GPT-3 175B's layer (Korthikanti et al. 2022, Table 3): s = 2048, b = 1, h = 12288, a = 96,
// f = 4h, MHA, GeLU, dropout on, no flash attention.
LayerShape Gpt3Layer(int64_t tp) {
  LayerShape l;
  l.seq = l.kv_seq = 2048;
  l.batch = 1;
  l.hidden = 12288;
  l.heads = l.kv_heads = 96;
  l.head_dim = 128;
  l.ffn = 4 * 12288;
  l.hidden_dropout = l.attention_dropout = true;
  l.tp = tp;
  return l;
}

TEST_CASE("memory model: Korthikanti's per-layer activation formulas, exact") {
  const uint64_t s = 2048, b = 1, h = 12288, a = 96;
  const uint64_t sbh = s * b * h;
  // No parallelism: sbh(34 + 5as/h) = sbh * (34 + 80).
  CHECK(LayerActivationBytes(Gpt3Layer(1), 2, false, Checkpointing::kNone) ==
        sbh * 34 + 5 * a * s * s * b);
  CHECK(LayerActivationBytes(Gpt3Layer(1), 2, false, Checkpointing::kNone) == 2'868'903'936);
  // Tensor parallel t = 8: sbh(10 + 24/t + 5as/(ht)).
  CHECK(LayerActivationBytes(Gpt3Layer(8), 2, false, Checkpointing::kNone) ==
        sbh * (10 + 24 / 8) + 5 * a * s * s * b / 8);
  CHECK(LayerActivationBytes(Gpt3Layer(8), 2, false, Checkpointing::kNone) == 578'813'952);
  // Selective recompute: sbh(10 + 24/t).
  CHECK(LayerActivationBytes(Gpt3Layer(8), 2, false, Checkpointing::kSelective) == sbh * 13);
  CHECK(LayerActivationBytes(Gpt3Layer(1), 2, false, Checkpointing::kSelective) == sbh * 34);
  // Full recompute: the layer input, 2sbh.
  CHECK(LayerActivationBytes(Gpt3Layer(8), 2, false, Checkpointing::kFull) == 2 * sbh);
  // Flash attention: the 5as^2b term becomes fp32 log-sum-exp, 4asb.
  CHECK(LayerActivationBytes(Gpt3Layer(1), 2, true, Checkpointing::kNone) ==
        sbh * 34 + 4 * a * s * b);
}

TEST_CASE("memory model: GQA, SwiGLU, no dropout and MoE change the constants") {
  LayerShape l = Gpt3Layer(1);
  const uint64_t s = 2048, h = 12288, a = 96;
  const uint64_t sbh = s * h;
  l.hidden_dropout = l.attention_dropout = false;
  // No dropout: no masks (2 sbh) and no dropout output (2as^2b) or mask (as^2b).
  CHECK(LayerActivationBytes(l, 2, false, Checkpointing::kNone) == sbh * 32 + 2 * a * s * s);
  // GQA with 8 key/value heads: K and V shrink from 2sbh each to 2sbh * 8/96.
  l.kv_heads = 8;
  CHECK(LayerActivationBytes(l, 2, false, Checkpointing::kNone) ==
        sbh * 28 + 2 * 2 * s * 8 * 128 + 2 * a * s * s);
  // SwiGLU with f = 4h: four f-wide tensors (gate, up, act(gate), product) instead of two.
  l.kv_heads = 96;
  l.gated = true;
  CHECK(LayerActivationBytes(l, 2, false, Checkpointing::kNone) == sbh * 48 + 2 * a * s * s);
  // MoE top-2 of 8 experts: the MLP runs twice per token, plus dispatch copies and router.
  l.gated = false;
  l.experts = 8;
  l.top_k = 2;
  CHECK(LayerActivationBytes(l, 2, false, Checkpointing::kNone) ==
        sbh * (32 + 16) + 2 * 2 * 2 * sbh + 2 * 4 * s * 8 + 2 * a * s * s);
}

// --- Published measurement --------------------------------------------------------------------

// bert-large-uncased's config.json as published on the Hugging Face Hub.
const char* kBertLarge = R"({
  "architectures": ["BertForMaskedLM"], "attention_probs_dropout_prob": 0.1,
  "hidden_act": "gelu", "hidden_dropout_prob": 0.1, "hidden_size": 1024,
  "initializer_range": 0.02, "intermediate_size": 4096, "layer_norm_eps": 1e-12,
  "max_position_embeddings": 512, "model_type": "bert", "num_attention_heads": 16,
  "num_hidden_layers": 24, "pad_token_id": 0, "type_vocab_size": 2, "vocab_size": 30522})";

TEST_CASE("memory model: bert-large fp32 AdamW batch 4 x 512 lands within 10% of the measurement") {
  // Hugging Face Transformers docs, "Model training anatomy" (model_memory_anatomy): training
  // bert-large-uncased (AutoModelForSequenceClassification: BertModel with pooler + a 2-way
  // classifier) in fp32 with AdamW, per_device_train_batch_size 4, sequence length 512, on one
  // V100-16GB: nvidia-smi shows 14,949 MB in use, of which 1,343 MB is the CUDA context
  // (measured there by allocating one tiny tensor). nvidia-smi's MB are MiB.
  constexpr uint64_t kMeasuredMiB = 14949;
  constexpr uint64_t kContextMiB = 1343;
  Result<ModelInventory> bert =
      InventoryFromHfConfigText(kBertLarge, "bert-large-uncased", ModelClassChoice::kBase);
  REQUIRE(bert.ok());
  TrainingSetup s;
  s.precision = Precision::kFp32;
  s.optimizer = Optimizer::kAdamW;
  s.micro_batch = 4;
  s.seq_len = 512;
  s.cuda_context_bytes = kContextMiB * kMiB;
  MemoryEstimate m = MustEstimate(*bert, s);
  CHECK(m.params_total == 335141888);  // + 2,050 classifier parameters in the measured model
  CHECK(Gpu(m, "params_working") == 4 * m.params_total);
  CHECK(Gpu(m, "grads") == 4 * m.params_total);
  CHECK(Gpu(m, "optimizer_states") == 8 * m.params_total);
  CHECK(Gpu(m, "cuda_context") == kContextMiB * kMiB);
  // Per layer in fp32: 66 bytes x sbh + 9 bytes x as^2b (softmax 4, dropout mask 1, output 4).
  const uint64_t sbh = 512 * 4 * 1024, as2b = uint64_t{16} * 512 * 512 * 4;
  CHECK(m.activation_bytes_per_layer == 66 * sbh + 9 * as2b);
  CHECK(m.peak.phase == "backward");
  const double predicted_mib = static_cast<double>(m.peak.gpu_bytes) / kMiB;
  const double ratio = predicted_mib / kMeasuredMiB;
  MESSAGE("bert-large predicted " << predicted_mib << " MiB vs measured " << kMeasuredMiB
                                  << " MiB: ratio " << ratio);
  CHECK(ratio > 0.9);
  CHECK(ratio < 1.1);
}

// --- Tiers, phases, LoRA ----------------------------------------------------------------------

TEST_CASE("memory model: offload moves optimizer state and parameters off the GPU") {
  ModelInventory llama = memplan::testing::Fixture("llama-2-7b");
  TrainingSetup s;
  s.gpus_per_node = 8;
  s.seq_len = 4096;
  s.zero_stage = 3;
  MemoryEstimate none = MustEstimate(llama, s);
  s.offload_optimizer = OffloadDevice::kCpu;
  s.offload_param = OffloadDevice::kCpu;
  s.pin_memory = true;
  MemoryEstimate cpu = MustEstimate(llama, s);
  CHECK(Gpu(cpu, "optimizer_states") == 0);
  CHECK(Item(cpu, "optimizer_states")->cpu_bytes == Gpu(none, "optimizer_states") * 8);
  CHECK(cpu.peak.gpu_bytes < none.peak.gpu_bytes);
  CHECK(cpu.peak.pinned_bytes > 0);
  CHECK(cpu.peak.pinned_bytes <= cpu.peak.cpu_bytes);
  s.offload_optimizer = OffloadDevice::kNvme;
  s.offload_param = OffloadDevice::kNvme;
  MemoryEstimate nvme = MustEstimate(llama, s);
  CHECK(Item(nvme, "optimizer_states")->nvme_bytes == Gpu(none, "optimizer_states") * 8);
  // 5 buffers x 1e8 elements x bf16 per rank, 8 ranks.
  CHECK(Item(nvme, "nvme_param_swap_buffers")->pinned_bytes == uint64_t{5} * 100000000 * 2 * 8);
  CHECK(nvme.peak.nvme_bytes > 0);
  // With DeepSpeed's default sub_group_size (1e9 > this 842M-element partition) the optimizer
  // swap buffers hold 4 whole partitions in fp32: more host memory than CPU offload needs.
  const uint64_t partition = (6738415616 + 7) / 8;
  CHECK(Item(nvme, "nvme_optimizer_swap_buffers")->pinned_bytes == 4 * partition * 4 * 8);
  CHECK(nvme.peak.cpu_bytes > cpu.peak.cpu_bytes);
  // A smaller sub_group_size (what DeepSpeed recommends for NVMe) shrinks them.
  s.sub_group_size = 100000000;
  MemoryEstimate small = MustEstimate(llama, s);
  CHECK(Item(small, "nvme_optimizer_swap_buffers")->pinned_bytes == uint64_t{4} * 100000000 * 4 * 8);
  CHECK(small.peak.cpu_bytes < cpu.peak.cpu_bytes);
}

TEST_CASE("memory model: the peak is one phase's total, not a sum of maxima") {
  ModelInventory gpt2 = MustBuild({{"model_type", "gpt2"}});
  TrainingSetup s;
  s.precision = Precision::kFp32;
  s.micro_batch = 8;
  s.seq_len = 1024;
  MemoryEstimate m = MustEstimate(gpt2, s);
  uint64_t sum_of_items = 0;
  for (const MemoryItem& item : m.items) sum_of_items += item.gpu_bytes;
  CHECK(m.peak.gpu_bytes < sum_of_items);
  CHECK(m.peak.gpu_bytes == PhaseOf(m, m.peak.phase).gpu_bytes);
  for (const PhaseTotals& p : m.phases) CHECK(p.gpu_bytes <= m.peak.gpu_bytes);
  // Activations dominate here, so the backward start sets the peak.
  CHECK(m.peak.phase == "backward");
  // Checkpointing moves it: activations shrink to one input per layer.
  s.checkpointing = Checkpointing::kFull;
  MemoryEstimate ckpt = MustEstimate(gpt2, s);
  CHECK(Gpu(ckpt, "activations") < Gpu(m, "activations") / 10);
  CHECK(Gpu(ckpt, "activation_recompute") == m.activation_bytes_per_layer);
  CHECK(ckpt.peak.gpu_bytes < m.peak.gpu_bytes);
}

TEST_CASE("memory model: LoRA trains adapters only; QLoRA stores the base in NF4") {
  ModelInventory llama = memplan::testing::Fixture("llama-2-7b");
  TrainingSetup s;
  s.lora_rank = 16;  // PEFT's default targets for llama: q_proj, v_proj
  s.seq_len = 512;
  MemoryEstimate lora = MustEstimate(llama, s);
  // q_proj and v_proj are 4096 x 4096 in each of 32 layers: r * (4096 + 4096) each.
  const uint64_t adapters = uint64_t{32} * 2 * 16 * (4096 + 4096);
  CHECK(lora.lora_params == adapters);
  CHECK(lora.trainable_params == adapters);
  CHECK(Gpu(lora, "optimizer_states") == 8 * adapters);
  CHECK(Gpu(lora, "params_working") == 2 * (6738415616 + adapters));
  s.qlora = true;
  MemoryEstimate qlora = MustEstimate(llama, s);
  // Block Linears: 32 layers x (4 x 4096^2 + 3 x 4096 x 11008).
  const uint64_t linears = uint64_t{32} * (4 * 4096 * 4096 + 3 * 4096 * 11008);
  CHECK(Gpu(qlora, "params_quantized") == (linears * 9 + 15) / 16);  // 4.5 bits
  CHECK(Gpu(qlora, "params_working") == 2 * (6738415616 - linears + adapters));
  s.double_quant = true;
  MemoryEstimate dq = MustEstimate(llama, s);
  CHECK(Gpu(dq, "params_quantized") < Gpu(qlora, "params_quantized"));
}

TEST_CASE("memory model: the stage x offload comparison keeps rows it cannot run, with reasons") {
  ModelInventory gpt2 = MustBuild({{"model_type", "gpt2"}});
  TrainingSetup s;
  s.optimizer = Optimizer::kSgd;
  s.gpus_per_node = 4;
  s.seq_len = 256;
  auto rows = CompareZeroStages(gpt2, s);
  REQUIRE(rows.ok());
  REQUIRE(rows->size() == 11);
  CHECK((*rows)[0].valid);
  CHECK_FALSE((*rows)[2].valid);  // sgd cannot be offloaded
  CHECK((*rows)[2].reason.find("cannot be offloaded") != std::string::npos);
  CHECK((*rows)[5].valid);
  CHECK((*rows)[5].peak.gpu_bytes < (*rows)[0].peak.gpu_bytes);
  CHECK((*rows)[5].activations_gpu_bytes > 0);
}

TEST_CASE("memory model: a shape list has no architecture, and the error says what to pass") {
  ModelInventory inv;
  inv.name = "shapes.json";
  inv.source = "shape-list";
  REQUIRE(inv.Add("h.0.w", {4, 4}).ok());
  TrainingSetup s;
  Result<MemoryEstimate> m = EstimateMemory(inv, s);
  REQUIRE_FALSE(m.ok());
  CHECK(m.status().message().find("config.json") != std::string::npos);
  CHECK(kGiB > 0);
}

TEST_CASE("memory model: the estimate's new JSON keys round-trip") {
  ModelInventory llama = memplan::testing::Fixture("llama-2-7b");
  TrainingSetup s;
  s.zero_stage = 3;
  s.offload_optimizer = OffloadDevice::kNvme;
  s.lora_rank = 8;
  s.seq_len = 1024;
  DeepSpeedHardware hw{.nodes = 2, .gpus_per_node = 4};
  Result<Estimate> e = EstimateTraining(llama, hw, s);
  REQUIRE_MESSAGE(e.ok(), e.status().ToString());
  REQUIRE(e->memory.has_value());
  CHECK(e->memory->setup.num_nodes == 2);
  const nlohmann::json j = ToJson(*e);
  for (const char* key : {"setup", "breakdown", "peak", "phases", "constants", "comparison"}) {
    CAPTURE(key);
    CHECK(j.contains(key));
  }
  Result<Estimate> back = EstimateFromJson(j);
  REQUIRE_MESSAGE(back.ok(), back.status().ToString());
  CHECK(ToJson(*back) == j);
  CHECK(back->memory->peak.gpu_bytes == e->memory->peak.gpu_bytes);
  nlohmann::json broken = j;
  broken["breakdown"][0]["phases"] = {"lunch"};
  CHECK_FALSE(EstimateFromJson(broken).ok());
}

}  // namespace
}  // namespace memplan::estimator
