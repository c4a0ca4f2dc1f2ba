// The memory model against published figures: the ZeRO paper's example, Korthikanti et al.'s
// per-layer activation formulas, and a measured BERT-large training run; plus how items move
// between tiers and phases when the setup changes.
#include "estimator/memory_model.h"

#include "estimator/estimate.h"

#include <doctest/doctest.h>

#include <string>

#include "tests/estimator_testing.h"
#include "tests/status_testing.h"

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

// The per-layer formulas alone, as for a setup the step model refuses (Note [Items from the step
// model]): the tests below pin them.
MemoryEstimate MustEstimateFormulas(const ModelInventory& inventory, const TrainingSetup& setup) {
  Result<ModelCounts> counts = CountParams(inventory);
  REQUIRE_MESSAGE(counts.ok(), counts.status().ToString());
  Result<MemoryEstimate> m = EstimateMemory(inventory, setup, *counts, /*step_model=*/false);
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
    // ZeRO-0/1/2: the whole fp32 partition; ZeRO-3 one sub-group (<= 1e9 elements) at a time,
    // flattened in 16-bit and converted (stage3.py _prepare_fp32_grad_for_sub_group).
    CHECK(Gpu(m, "grads_fp32") == (stage < 3 ? 4 * os : 6 * os));
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

TEST_CASE("memory model: torchtitan's per-op selective checkpointing keeps every second matmul") {
  // The small Llama of tests/trace/test_trace.py's Torchtitan case, whose traced block keeps
  // 1,844,224 bytes: 2 x 256 tokens, hidden 256, 4 heads of 64, 2 KV heads, SwiGLU MLP 512.
  LayerShape l;
  l.seq = l.kv_seq = 256;
  l.batch = 2;
  l.hidden = 256;
  l.heads = 4;
  l.kv_heads = 2;
  l.head_dim = 64;
  l.ffn = 512;
  l.gated = true;
  l.fused_qkv_matmul = true;  // torchtitan 0.3's wqkv
  const uint64_t tokens = 512;
  // The input, wqkv's output (1st matmul), w1's (3rd) and w2's (5th), the attention's output,
  // its fp32 log-sum-exp and its RNG seed and offset.
  const uint64_t want = tokens * 2 * (256 + 512 + 512 + 256 + 256) + 4 * 4 * tokens + 2 * 512;
  CHECK(want == 1'844'224);
  CHECK(LayerActivationBytes(l, 2, true, Checkpointing::kOp) == want);
  // With separate projections (torchtitan before 0.3) the count shifts: the input, wq, wv, w1,
  // w2 and the attention's output kept (wk, wo and w3 recomputed).
  l.fused_qkv_matmul = false;
  CHECK(LayerActivationBytes(l, 2, true, Checkpointing::kOp) ==
        tokens * 2 * (256 + 256 + 128 + 512 + 256 + 256) + 4 * 4 * tokens + 2 * 512);
  // Never more than no checkpointing keeps, never less than the input alone.
  CHECK(LayerActivationBytes(l, 2, true, Checkpointing::kOp) <
        LayerActivationBytes(l, 2, true, Checkpointing::kNone));
  CHECK(LayerActivationBytes(l, 2, true, Checkpointing::kOp) >
        LayerActivationBytes(l, 2, true, Checkpointing::kFull));
}

TEST_CASE("memory model: checkpointing every K-th block keeps the others whole") {
  ModelInventory llama = memplan::testing::Fixture("llama-2-7b");  // 32 blocks
  TrainingSetup s;
  s.seq_len = 1024;
  s.micro_batch = 2;
  s.checkpointing = Checkpointing::kNone;
  const MemoryEstimate none = MustEstimateFormulas(llama, s);
  s.checkpointing = Checkpointing::kFull;
  const MemoryEstimate every1 = MustEstimateFormulas(llama, s);
  s.checkpoint_every = 2;
  const MemoryEstimate every2 = MustEstimateFormulas(llama, s);
  s.checkpoint_every = 3;
  const MemoryEstimate every3 = MustEstimateFormulas(llama, s);
  const uint64_t whole = none.activation_bytes_per_layer;
  const uint64_t input = every1.activation_bytes_per_layer;
  REQUIRE(whole > input);
  // Blocks 0, 2, ..., 30 checkpointed: 16 kept whole; every 3rd: 11 checkpointed, 21 whole.
  CHECK(Gpu(every2, "activations") == Gpu(every1, "activations") + 16 * (whole - input));
  CHECK(Gpu(every3, "activations") == Gpu(every1, "activations") + 21 * (whole - input));
  CHECK(Gpu(every3, "activations") < Gpu(none, "activations"));
  CHECK(PhaseOf(every2, "backward").gpu_bytes > PhaseOf(every1, "backward").gpu_bytes);
}

TEST_CASE("memory model: the loss decides what the logits keep") {
  ModelInventory llama = memplan::testing::Fixture("llama-2-7b");  // vocabulary 32000
  TrainingSetup s;
  s.seq_len = 1024;
  s.micro_batch = 2;
  const uint64_t elems = 2 * 1024 * 32000;
  const MemoryEstimate full = MustEstimateFormulas(llama, s);
  // Full: bf16 logits, their fp32 copy and the fp32 log-softmax; fp32 gradients of both.
  CHECK(Gpu(full, "logits_and_loss") == elems * 10);
  CHECK(Gpu(full, "logits_grad") == elems * 8);
  // torchtune's chunked loss (8 chunks): bf16 logits and each chunk's fp32 log-softmax kept,
  // one chunk's fp32 copy and gradients at a time.
  s.loss = Loss::kChunked;
  const MemoryEstimate chunked = MustEstimateFormulas(llama, s);
  CHECK(Gpu(chunked, "logits_and_loss") == elems * 6 + elems / 8 * 4);
  CHECK(Gpu(chunked, "logits_grad") == elems / 8 * 8);
  s.loss_chunks = 16;
  CHECK(Gpu(MustEstimateFormulas(llama, s), "logits_grad") == elems / 16 * 8);
  // Liger's fused linear cross-entropy: chunks of next_pow2(ceil(2048 / ceil(32000 / 4096)))
  // = 256 rows of logits, grad_input [2048, 4096] and grad_weight [32000, 4096], in bf16.
  s.loss = Loss::kFused;
  s.loss_chunks = 0;
  const MemoryEstimate fused = MustEstimateFormulas(llama, s);
  CHECK(Gpu(fused, "logits_and_loss") ==
        (uint64_t{256} * 32000 + uint64_t{2048} * 4096 + uint64_t{32000} * 4096) * 2);
  CHECK(Gpu(fused, "logits_grad") == 0);
  // torchtitan's whole-logits loss: the same three tensors while the loss runs, then `del pred`
  // before backward leaves only the fp32 log-softmax.
  s.loss = Loss::kFull;
  s.framework = Framework::kTorchtitan;
  const MemoryEstimate titan = MustEstimateFormulas(llama, s);
  const MemoryItem* forward_only = Item(titan, "logits_and_loss");
  REQUIRE(forward_only != nullptr);
  CHECK(forward_only->gpu_bytes == elems * 10);
  CHECK((forward_only->phases & kPhaseBackward) == 0);
  CHECK(Gpu(titan, "loss_log_softmax") == elems * 4);
  CHECK(Gpu(titan, "logits_grad") == elems * 8);
  // Backward: 6 bytes a logit fewer, and the allocator margin's 10% of them.
  CHECK(PhaseOf(full, "backward").gpu_bytes - PhaseOf(titan, "backward").gpu_bytes ==
        elems * 6 + elems * 6 / 10);
  // torchtitan's ChunkedLossWrapper: one chunk's bf16 logits, fp32 log-softmax and two fp32
  // gradients, and the hidden states' fp32 gradient, in the forward; backward starts from that
  // gradient in bf16, with no logits left.
  s.loss = Loss::kChunked;
  s.loss_chunks = 8;
  const MemoryEstimate titan_chunked = MustEstimateFormulas(llama, s);
  const uint64_t hidden = uint64_t{2} * 1024 * 4096;
  CHECK(Gpu(titan_chunked, "logits_and_loss") == elems / 8 * 14 + hidden * 4);
  CHECK(Gpu(titan_chunked, "loss_log_softmax") == hidden * 2);
  CHECK(Gpu(titan_chunked, "logits_grad") == 0);
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

TEST_CASE("memory model: MLA's narrower values and latents, shared experts, dense layers") {
  LayerShape l = Gpt3Layer(1);
  const uint64_t s = 2048, h = 12288, a = 96;
  const uint64_t sbh = s * h;
  l.hidden_dropout = l.attention_dropout = false;
  const uint64_t plain = LayerActivationBytes(l, 2, false, Checkpointing::kNone);
  // MLA: values of 64 per head instead of 128 (V and the output projection's input halve), and
  // 1000 latent elements per token.
  l.v_width = a * 64;
  l.latent_width = 1000;
  CHECK(LayerActivationBytes(l, 2, false, Checkpointing::kNone) ==
        plain - 2 * 2 * s * a * 64 + 2 * s * 1000);
  // A shared expert of width h beside top-2 of 8 routed experts: one more ungated MLP, with its
  // own input.
  l = Gpt3Layer(1);
  l.hidden_dropout = l.attention_dropout = false;
  l.experts = 8;
  l.top_k = 2;
  const uint64_t routed = LayerActivationBytes(l, 2, false, Checkpointing::kNone);
  l.shared_ffn = static_cast<int64_t>(h);
  CHECK(LayerActivationBytes(l, 2, false, Checkpointing::kNone) ==
        routed + s * h * (2 + 2) + 2 * sbh);

  // The mapping from the built models: DeepSeek-V2-Lite's first layer is dense, the other 26
  // route through 6 of 64 experts beside two shared ones, and its attention is MLA.
  ModelInventory lite = memplan::testing::Fixture("deepseek-v2-lite");
  TrainingSetup setup;
  setup.seq_len = 1024;
  setup.flash_attention = true;
  MemoryEstimate m = MustEstimateFormulas(lite, setup);
  LayerShape moe;
  moe.seq = moe.kv_seq = 1024;
  moe.batch = 1;
  moe.hidden = 2048;
  moe.heads = moe.kv_heads = 16;
  moe.head_dim = 192;
  moe.ffn = 1408;
  moe.gated = true;
  moe.experts = 64;
  moe.top_k = 6;
  moe.norm_fp32 = moe.norm_keeps_normalized = true;
  moe.v_width = 16 * 128;
  moe.latent_width = (512 + 64) + 512;  // no query latent: q_lora_rank is null
  moe.shared_ffn = 2 * 1408;
  CHECK(m.activation_bytes_per_layer == LayerActivationBytes(moe, 2, true, Checkpointing::kNone));
  LayerShape dense = moe;
  dense.experts = dense.top_k = 0;
  dense.shared_ffn = 0;
  dense.ffn = 10944;
  const MemoryItem* activations = Item(m, "activations");
  REQUIRE(activations != nullptr);
  const uint64_t layers = 26 * LayerActivationBytes(moe, 2, true, Checkpointing::kNone) +
                          LayerActivationBytes(dense, 2, true, Checkpointing::kNone);
  CHECK(activations->gpu_bytes >= layers);
  CHECK(activations->gpu_bytes < layers + 4 * 1024 * 2048 * 2);  // + embedding and final norm
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
  REQUIRE_OK(bert);
  TrainingSetup s;
  s.precision = Precision::kFp32;
  s.optimizer = Optimizer::kAdamW;
  s.micro_batch = 4;
  s.seq_len = 512;
  s.flash_attention = false;  // the page's run used eager attention
  s.foreach = false;          // and the Trainer's AdamW of the time, a per-tensor loop
  s.cuda_context_bytes = kContextMiB * kMiB;
  // January 2022: PyTorch 1.10, whose zero_grad() zeroed the gradients in place (they stay
  // allocated from step to step) and whose softmax kept its input too (pytorch#64000).
  s.torch_version = "1.10";
  MemoryEstimate m = MustEstimate(*bert, s);
  CHECK(m.params_total == 335141888);  // + 2,050 classifier parameters in the measured model
  CHECK(Gpu(m, "params_working") == 4 * m.params_total);
  CHECK(Gpu(m, "grads") == 4 * m.params_total);
  CHECK(Gpu(m, "optimizer_states") == 8 * m.params_total);
  CHECK(Gpu(m, "cuda_context") == kContextMiB * kMiB);
  // Per layer in fp32: 66 bytes x sbh + 13 bytes x as^2b (the softmax's input 4 and output 4,
  // dropout mask 1, dropout output 4).
  const uint64_t sbh = 512 * 4 * 1024, as2b = uint64_t{16} * 512 * 512 * 4;
  CHECK(m.activation_bytes_per_layer == 66 * sbh + 13 * as2b);
  CHECK(Item(m, "grads_first_layer") == nullptr);  // zeroed in place: all of them all along
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
  // swap buffers hold 4 whole partitions in fp32.
  const uint64_t partition = (6738415616 + 7) / 8;
  CHECK(Item(nvme, "nvme_optimizer_swap_buffers")->pinned_bytes == 4 * partition * 4 * 8);
  // A smaller sub_group_size (what DeepSpeed recommends for NVMe) shrinks them.
  s.sub_group_size = 100000000;
  MemoryEstimate small = MustEstimate(llama, s);
  CHECK(Item(small, "nvme_optimizer_swap_buffers")->pinned_bytes ==
        uint64_t{4} * 100000000 * 4 * 8);
  CHECK(small.peak.cpu_bytes < cpu.peak.cpu_bytes);
}

TEST_CASE("memory model: the peak is one phase's total, not a sum of maxima") {
  ModelInventory gpt2 = MustBuild({{"model_type", "gpt2"}});
  TrainingSetup s;
  s.precision = Precision::kFp32;
  s.micro_batch = 8;
  s.seq_len = 1024;
  MemoryEstimate m = MustEstimateFormulas(gpt2, s);
  uint64_t sum_of_items = 0;
  for (const MemoryItem& item : m.items) sum_of_items += item.gpu_bytes;
  CHECK(m.peak.gpu_bytes < sum_of_items);
  CHECK(m.peak.gpu_bytes == PhaseOf(m, m.peak.phase).gpu_bytes);
  for (const PhaseTotals& p : m.phases) CHECK(p.gpu_bytes <= m.peak.gpu_bytes);
  // Activations dominate here, so the backward start sets the peak.
  CHECK(m.peak.phase == "backward");
  // Checkpointing moves it: activations shrink to one input per layer.
  s.checkpointing = Checkpointing::kFull;
  MemoryEstimate ckpt = MustEstimateFormulas(gpt2, s);
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
  REQUIRE_OK(rows);
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
  REQUIRE_OK(inv.Add("h.0.w", {4, 4}));
  TrainingSetup s;
  Result<MemoryEstimate> m = EstimateMemory(inv, s);
  REQUIRE_FALSE(m.ok());
  CHECK(m.status().message().find("config.json") != std::string::npos);
  CHECK(kGiB > 0);
}

// --- Framework behaviours (issue 14) -------------------------------------------------------------

TEST_CASE(
    "memory model: ZeRO-3 with the optimizer on NVMe keeps only 16-bit gradients in host memory") {
  // deepspeed/runtime/zero/stage3.py: _setup_for_real_optimizer allocates
  // grad_partitions_flat_buffer (the 16-bit gradient partition, gradient_accumulation_dtype = the
  // model dtype) on the offload device, and partition_grads -> _swap_out_offload_fp32_gradients ->
  // optimizer_swapper.swap_out_gradients writes the fp32 gradients of swappable sub-groups to NVMe.
  ModelInventory llama = memplan::testing::Fixture("llama-2-7b");
  TrainingSetup s;
  s.gpus_per_node = 8;
  s.seq_len = 1024;
  s.zero_stage = 3;
  s.offload_optimizer = OffloadDevice::kNvme;
  s.offload_param = OffloadDevice::kNvme;
  s.pin_memory = true;
  MemoryEstimate m = MustEstimate(llama, s);
  const uint64_t partition = (6738415616 + 7) / 8;
  REQUIRE(Item(m, "grads") != nullptr);
  CHECK(Item(m, "grads")->cpu_bytes == partition * 2 * 8);
  CHECK(Item(m, "grads")->pinned_bytes == partition * 2 * 8);
  // The 65 RMSNorm weights' fp32 gradient partitions (4096 / 8 elements, 2 KiB) are under the
  // swapper's 1 MiB minimum and stay in host memory (Note [NVMe partitions]); every other
  // tensor divides evenly by 8.
  const uint64_t norms = 65 * 4096;
  CHECK(Item(m, "grads_fp32")->cpu_bytes == norms / 8 * 4 * 8);
  CHECK(Item(m, "grads_fp32")->nvme_bytes == (partition - norms / 8) * 4 * 8);
  // NVMe holds fp32 master weights, both Adam moments and the fp32 gradients: 16 B/param.
  CHECK(Item(m, "params_master")->nvme_bytes + Item(m, "optimizer_states")->nvme_bytes +
            Item(m, "grads_fp32")->nvme_bytes + Item(m, "grads_fp32")->cpu_bytes ==
        partition * 8 * 16);
  // With the optimizer in host memory, fp32 gradient buffers per sub-group stay there.
  s.offload_optimizer = OffloadDevice::kCpu;
  MemoryEstimate cpu = MustEstimate(llama, s);
  CHECK(Item(cpu, "grads_fp32")->cpu_bytes == partition * 4 * 8);
  CHECK(Item(cpu, "grads")->cpu_bytes == partition * 2 * 8);
}

TEST_CASE("memory model: ZeRO-3 NVMe swap files are the bytes DeepSpeed 0.19 wrote") {
  // Measured by bench/deepspeed_nvme_truth.py --preset gpt2 (tests/accuracy/deepspeed_nvme.json):
  // GPT-2 124M (n_positions 128), ZeRO-3 bf16, offload_param and offload_optimizer on NVMe, one
  // rank, aio.block_size 1 MiB. deepspeed/runtime/swap_tensor/partitioned_param_swapper.py
  // swappable_tensor: a 16-bit partition of at least max(MIN_AIO_BYTES, block_size) = 1 MiB goes
  // to a file of its own, rounded up to AIO_ALIGNED_BYTES (the embedding: 50257 x 768 x 2 ->
  // 77,195,264); a smaller one stays in host memory. Transformers builds the tied lm_head as its
  // own Linear inside zero.Init before tying it: its partition leaves a second embedding-sized
  // file. optimizer_utils.py _swap_out_gradients: fp32 gradients under 1 MiB (biases, norms, the
  // 128 x 768 position embedding) stay in memory as unswapped_gradients.
  ModelInventory gpt2 = MustBuild({{"model_type", "gpt2"},
                                   {"architectures", {"GPT2LMHeadModel"}},
                                   {"n_embd", 768},
                                   {"n_layer", 12},
                                   {"n_head", 12},
                                   {"n_positions", 128},
                                   {"vocab_size", 50257}});
  TrainingSetup s;
  s.seq_len = 128;
  s.micro_batch = 2;
  s.zero_stage = 3;
  s.offload_optimizer = OffloadDevice::kNvme;
  s.offload_param = OffloadDevice::kNvme;
  s.pin_memory = true;
  MemoryEstimate m = MustEstimate(gpt2, s);
  REQUIRE(m.params_total == 123751680);
  // 12 x (768x768 + 768x2304 + 2 x 768x3072) x 2 bytes, and two embedding-sized files.
  CHECK(Item(m, "params_working")->nvme_bytes ==
        12 * (1179648 + 3538944 + 2 * 4718592) + 2 * uint64_t{77195264});
  CHECK(Item(m, "params_working")->nvme_bytes == 324259840);
  CHECK(Item(m, "grads_fp32")->nvme_bytes == 494128128);
  CHECK(Item(m, "grads_fp32")->cpu_bytes == 123751680 * uint64_t{4} - 494128128);
  CHECK(m.peak.nvme_bytes == 2303408128);
  // A larger aio.block_size raises the minimum: the 768 x 768 projections (1,179,648 bytes in
  // bf16) then stay in host memory.
  s.aio_block_size = 2 * 1048576;
  MemoryEstimate big = MustEstimate(gpt2, s);
  CHECK(Item(big, "params_working")->nvme_bytes == 324259840 - 12 * uint64_t{1179648});
  // stage3.py _create_param_groups_fp16_flat_cpu_memory: every trainable partition also lives
  // in a pinned 16-bit flat host buffer (max_in_cpu defaults to 1e9 elements), the small ones
  // included; measured as resident memory (bench/deepspeed_nvme_truth.py).
  CHECK(Item(big, "params_working")->cpu_bytes == 0);
  CHECK(Item(m, "nvme_param_flat_buffer")->cpu_bytes == 123751680 * uint64_t{2});
  CHECK(Item(m, "nvme_param_flat_buffer")->pinned_bytes == 123751680 * uint64_t{2});
  // Beyond max_in_cpu the rest stays on NVMe, swapped out through one buffer of the largest
  // sub-group (partitioned_param_swapper.py reserve_partitioned_swap_space).
  s.param_max_in_cpu = 50000000;
  s.sub_group_size = 100000000;
  MemoryEstimate capped = MustEstimate(gpt2, s);
  CHECK(Item(capped, "nvme_param_flat_buffer")->cpu_bytes == (50000000 + 100000000) * uint64_t{2});
  s.offload_param = OffloadDevice::kCpu;
  CHECK(Item(MustEstimate(gpt2, s), "nvme_param_flat_buffer") == nullptr);
}

TEST_CASE("memory model: ZeRO-3 charges one flat reduce bucket, not 4.5x overlap_comm") {
  // stage3.py _setup_for_real_optimizer: with contiguous_gradients (the default) one IPG bucket
  // buffer of reduce_bucket_size elements per gradient dtype, allocated at start-up.
  ModelInventory llama = memplan::testing::Fixture("llama-2-7b");
  TrainingSetup s;
  s.gpus_per_node = 8;
  s.seq_len = 1024;
  s.zero_stage = 3;
  MemoryEstimate m = MustEstimate(llama, s);
  CHECK(Gpu(m, "comm_reduce_bucket") == uint64_t{500000000} * 2);
  CHECK(Item(m, "comm_reduce_bucket")->phases == kAllPhases);
  // A small model no longer peaks higher under ZeRO-3 than under ZeRO-2.
  ModelInventory gpt2 = MustBuild({{"model_type", "gpt2"}});
  s.seq_len = 512;
  s.zero_stage = 2;
  const uint64_t zero2 = MustEstimate(gpt2, s).peak.gpu_bytes;
  s.zero_stage = 3;
  CHECK(MustEstimate(gpt2, s).peak.gpu_bytes < zero2);
}

TEST_CASE("memory model: the ZeRO-3 step converts one sub-group of gradients to fp32 at a time") {
  // stage3.py step: _prepare_fp32_grad_for_sub_group flattens a sub-group's 16-bit gradients and
  // converts them to fp32, _optimizer_step, then _release_sub_group sets .grad = None.
  ModelInventory llama = memplan::testing::Fixture("llama-2-70b");
  TrainingSetup s;
  s.gpus_per_node = 8;
  s.num_nodes = 2;
  s.seq_len = 2048;
  s.zero_stage = 3;
  s.checkpointing = Checkpointing::kFull;
  MemoryEstimate m = MustEstimate(llama, s);
  CHECK(Gpu(m, "grads_fp32") == uint64_t{1000000000} * (4 + 2));
  CHECK(Item(m, "grads_fp32")->phases == kPhaseOptimizerStep);
  s.sub_group_size = 100000000;
  CHECK(Gpu(MustEstimate(llama, s), "grads_fp32") == uint64_t{100000000} * 6);
}

TEST_CASE(
    "memory model: the allocator margin covers activations and temporaries, not model states") {
  // PyTorch's caching allocator rounds and fragments blocks that come and go every step;
  // weights, master weights, optimizer states and gradient buffers are allocated once.
  ModelInventory gpt2 = MustBuild({{"model_type", "gpt2"}});
  TrainingSetup s;
  s.precision = Precision::kFp32;
  s.micro_batch = 4;
  s.seq_len = 512;
  MemoryEstimate m = MustEstimateFormulas(gpt2, s);
  const PhaseTotals& peak = PhaseOf(m, m.peak.phase);
  uint64_t transient = 0;
  Phase phase = kPhaseForward;
  for (Phase p : kPhases) {
    if (PhaseName(p) == m.peak.phase) phase = p;
  }
  for (const char* name : {"activations", "activation_recompute", "backward_workspace",
                           "logits_and_loss", "logits_grad", "optimizer_step_transient"}) {
    const MemoryItem* item = Item(m, name);
    if (item != nullptr && (item->phases & phase) != 0) transient += item->gpu_bytes;
  }
  const uint64_t margin = Gpu(m, "allocator_margin");
  CHECK(margin >= transient / 10);  // 10%, rounded up
  CHECK(margin <= transient / 10 + 1);
  CHECK(peak.gpu_bytes == peak.gpu_allocated_bytes + margin + s.cuda_context_bytes);
}

TEST_CASE(
    "memory model: the PyTorch optimizer step's temporaries follow foreach, fused, momentum") {
  // torch/optim/adam.py: _multi_tensor_adam (foreach) builds exp_avg_sq_sqrt for all parameters
  // at once; _single_tensor_adam (foreach=False) one tensor at a time; fused=True updates in
  // place. torch/optim/sgd.py: momentum 0 (the default) keeps no momentum_buffer.
  ModelInventory gpt2 = MustBuild({{"model_type", "gpt2"}});
  TrainingSetup s;
  s.precision = Precision::kFp32;
  s.seq_len = 128;
  const uint64_t p = 124439808;
  const uint64_t wte = uint64_t{50257} * 768;
  CHECK(Gpu(MustEstimateFormulas(gpt2, s), "optimizer_step_transient") == 4 * p);
  s.foreach = false;
  CHECK(Gpu(MustEstimateFormulas(gpt2, s), "optimizer_step_transient") == 2 * wte * 4);
  s.fused_optimizer = true;
  CHECK(Item(MustEstimateFormulas(gpt2, s), "optimizer_step_transient") == nullptr);
  s.fused_optimizer = false;
  s.optimizer = Optimizer::kSgd;
  MemoryEstimate sgd = MustEstimateFormulas(gpt2, s);
  CHECK(Item(sgd, "optimizer_states") == nullptr);
  CHECK(Item(sgd, "optimizer_step_transient") == nullptr);
  s.sgd_momentum = 0.9;
  CHECK(Gpu(MustEstimateFormulas(gpt2, s), "optimizer_states") == 4 * p);
}

TEST_CASE("memory model: torch.autocast keeps fp32 weights and gradients, no master or fp32 copy") {
  // torch.autocast over fp32 parameters (Hugging Face Trainer fp16/bf16 without DeepSpeed): the
  // optimizer steps the fp32 parameters on their fp32 gradients; autocast caches 16-bit weight
  // copies for the forward pass (torch/csrc/autograd ... cached_cast).
  ModelInventory gpt2 = MustBuild({{"model_type", "gpt2"}});
  TrainingSetup s;
  s.precision = Precision::kBf16Mixed;
  s.seq_len = 128;
  const uint64_t p = 124439808;
  MemoryEstimate ds = MustEstimateFormulas(gpt2, s);
  CHECK(Gpu(ds, "params_master") == 4 * p);
  CHECK(Gpu(ds, "grads_fp32") == 4 * p);
  s.autocast = true;
  MemoryEstimate amp = MustEstimateFormulas(gpt2, s);
  CHECK(Gpu(amp, "params_working") == 4 * p);
  CHECK(Gpu(amp, "grads") == 4 * p);
  CHECK(Item(amp, "params_master") == nullptr);
  CHECK(Item(amp, "grads_fp32") == nullptr);
  CHECK(Gpu(amp, "autocast_weight_copies") == 2 * p);
  CHECK(Item(amp, "autocast_recompute_copies") == nullptr);
  // Every block checkpointed: no block saves its weights' copies. The forward holds the cached
  // copies of the trainable weights (cached_cast caches leaves that require grad: with LoRA the
  // adapters only, never the frozen base), and a block's backward the copies its recompute
  // casts again. The step model agrees (grid: LoRA with full checkpointing, exact).
  s.checkpointing = Checkpointing::kFull;
  const MemoryEstimate ckpt = MustEstimateFormulas(gpt2, s);
  CHECK(Gpu(ckpt, "autocast_weight_copies") == 2 * p);
  CHECK(Gpu(ckpt, "autocast_recompute_copies") == 2 * uint64_t{7'087'872});
  s.lora_rank = 8;
  s.lora_targets = {"c_attn"};
  const MemoryEstimate lora = MustEstimateFormulas(gpt2, s);
  CHECK(Gpu(lora, "autocast_weight_copies") == 2 * lora.lora_params);
  CHECK(Gpu(lora, "autocast_recompute_copies") == 2 * uint64_t{7'087'872});
  s.lora_rank = 0;
  s.lora_targets.clear();
  s.checkpointing = Checkpointing::kNone;
  s.zero_stage = 2;
  CHECK_FALSE(s.Validate().ok());
}

TEST_CASE("memory model: a plain loop's gradients appear during backward") {
  // Note [Gradient storage]: zero_grad(set_to_none=True) frees them each step (PyTorch >= 2.0);
  // the first layer of backward holds the head's (GPT-2's is tied: its gradient waits in the
  // engine's input buffer) and the last block's, backward's end all of them.
  ModelInventory gpt2 = MustBuild({{"model_type", "gpt2"}});
  TrainingSetup s;
  s.precision = Precision::kFp32;
  s.seq_len = 256;
  const MemoryEstimate plain = MustEstimateFormulas(gpt2, s);
  REQUIRE(Item(plain, "grads") != nullptr);
  CHECK(Item(plain, "grads")->phases == (kPhaseBackwardEnd | kPhaseOptimizerStep));
  CHECK(Gpu(plain, "grads_first_layer") == (uint64_t{50257} * 768 + 7'087'872) * 4);
  // Gradient accumulation carries them across micro-batches; PyTorch 1.x zeroed them in place.
  for (int variant = 0; variant < 2; ++variant) {
    TrainingSetup t = s;
    if (variant == 0) t.grad_accum = 2;
    if (variant == 1) t.torch_version = "1.13";
    const MemoryEstimate kept = MustEstimateFormulas(gpt2, t);
    CHECK(Item(kept, "grads")->phases == kAllPhases);
    CHECK(Item(kept, "grads_first_layer") == nullptr);
  }
}

TEST_CASE("memory model: DDP keeps a second copy of the gradients in its buckets") {
  // torch/nn/parallel/distributed.py: the reducer's buckets cover every gradient; with
  // gradient_as_bucket_view=False (the default) .grad is a separate tensor. The formulas here;
  // the step model's in "gradients that persist".
  ModelInventory gpt2 = MustBuild({{"model_type", "gpt2"}});
  TrainingSetup s;
  s.precision = Precision::kFp32;
  s.seq_len = 256;
  const uint64_t one_gpu = MustEstimateFormulas(gpt2, s).peak.gpu_bytes;
  CHECK(Item(MustEstimateFormulas(gpt2, s), "ddp_grad_buckets") == nullptr);
  s.gpus_per_node = 2;
  MemoryEstimate ddp = MustEstimateFormulas(gpt2, s);
  CHECK(Gpu(ddp, "ddp_grad_buckets") == uint64_t{124439808} * 4);
  CHECK(ddp.peak.gpu_bytes == one_gpu + uint64_t{124439808} * 4);
  s.gradient_as_bucket_view = true;
  CHECK(MustEstimateFormulas(gpt2, s).peak.gpu_bytes == one_gpu);
}

TEST_CASE("memory model: LoRA keeps no frozen Linear inputs; QLoRA's bitsandbytes matmul does") {
  // Autograd's mm keeps its first operand only for the weight's gradient (derivatives.yaml, mm:
  // mat2 needs self), so frozen Linears keep no input; bitsandbytes' MatMul4Bit.forward keeps
  // ctx.tensors = (A, B) whenever the input needs a gradient, and dequantises the weight to a
  // 16-bit copy (F.dequantize_4bit(B, quant_state).to(A.dtype)) in forward and backward.
  ModelInventory llama = memplan::testing::Fixture("llama-2-7b");
  TrainingSetup s;
  s.precision = Precision::kBf16Pure;
  s.seq_len = 1024;
  MemoryEstimate full = MustEstimate(llama, s);
  s.lora_rank = 8;
  MemoryEstimate lora = MustEstimate(llama, s);
  s.qlora = true;
  MemoryEstimate qlora = MustEstimate(llama, s);
  const uint64_t sbh = uint64_t{1024} * 4096;
  // Frozen: no QKV, output-projection... inputs of the Linears (flash keeps the attention output),
  // nor the MLP's first and second Linear inputs; the norms keep fp32 inputs either way; the
  // adapters (q_proj, v_proj: 2 x 4096 wide) keep mask and input.
  const uint64_t linear_inputs = 2 * sbh + 2 * sbh + 2 * uint64_t{1024} * 11008;
  const uint64_t normalized = 2 * 2 * sbh;  // the norm weights are frozen too
  const uint64_t adapters = (1 + 2) * uint64_t{1024} * 2 * 4096;
  CHECK(lora.activation_bytes_per_layer ==
        full.activation_bytes_per_layer - linear_inputs - normalized + adapters);
  CHECK(qlora.activation_bytes_per_layer == lora.activation_bytes_per_layer + linear_inputs);
  CHECK(Gpu(qlora, "qlora_dequant_workspace") == uint64_t{4096} * 11008 * 2);
}

TEST_CASE("memory model: Transformers' RMSNorm keeps its input in fp32") {
  // transformers/models/llama/modeling_llama.py LlamaRMSNorm.forward: hidden_states.to(float32),
  // then weight * hidden_states.to(input_dtype): the fp32 input and, for the weight's gradient,
  // the normalised 16-bit tensor are kept.
  LayerShape l = Gpt3Layer(1);
  const uint64_t sbh = uint64_t{2048} * 12288;
  const uint64_t plain = LayerActivationBytes(l, 2, true, Checkpointing::kNone);
  l.norm_fp32 = true;
  CHECK(LayerActivationBytes(l, 2, true, Checkpointing::kNone) == plain + 2 * (4 - 2) * sbh);
  l.norm_keeps_normalized = true;
  CHECK(LayerActivationBytes(l, 2, true, Checkpointing::kNone) ==
        plain + 2 * (4 - 2) * sbh + 2 * 2 * sbh);
}

TEST_CASE("memory model: sequence parallelism and selective recompute with flash attention") {
  // Korthikanti et al. 2022, Table 2: tensor + sequence parallel sbh(34/t + 5as/(ht)); selective
  // recompute with sequence parallelism sbh(34/t). Megatron's selective recompute checkpoints the
  // core attention whether or not it is a flash kernel (megatron/core/transformer: recompute
  // "core_attn"), so flash attention's statistics are recomputed too.
  const uint64_t s = 2048, b = 1, h = 12288, a = 96;
  const uint64_t sbh = s * b * h;
  LayerShape l = Gpt3Layer(8);
  l.sequence_parallel = true;
  CHECK(LayerActivationBytes(l, 2, false, Checkpointing::kNone) ==
        sbh * 34 / 8 + 5 * a * s * s * b / 8);
  CHECK(LayerActivationBytes(l, 2, false, Checkpointing::kSelective) == sbh * 34 / 8);
  l.sequence_parallel = false;
  CHECK(LayerActivationBytes(l, 2, true, Checkpointing::kSelective) == sbh * 13);
  CHECK(LayerActivationBytes(l, 2, true, Checkpointing::kNone) == sbh * 13 + 4 * a * s * b / 8);
  // In a model, selective recompute with flash now holds one layer's core attention in backward.
  ModelInventory llama = memplan::testing::Fixture("llama-2-7b");
  TrainingSetup setup;
  setup.gpus_per_node = 8;
  setup.tp = 8;
  setup.seq_len = 4096;
  setup.checkpointing = Checkpointing::kSelective;
  CHECK(Gpu(MustEstimate(llama, setup), "activation_recompute") == 4 * uint64_t{32} * 4096 / 8);
  setup.sequence_parallel = true;
  setup.checkpointing = Checkpointing::kNone;
  const uint64_t sp = MustEstimate(llama, setup).activation_bytes_per_layer;
  setup.sequence_parallel = false;
  CHECK(sp < MustEstimate(llama, setup).activation_bytes_per_layer);
}

TEST_CASE("memory model: one set of defaults: memory-efficient attention on") {
  // Transformers' default attention is SDPA since 4.36; estimate, check, plan and the JSON
  // requests all start from TrainingSetup's defaults.
  TrainingSetup s;
  CHECK(s.flash_attention);
  CHECK(s.foreach);
  CHECK_FALSE(s.fused_optimizer);
  CHECK(s.sgd_momentum == 0);
  Result<TrainingSetup> from_json = TrainingSetupFromJson(nlohmann::json::object());
  REQUIRE_OK(from_json);
  CHECK(ToJson(*from_json) == ToJson(s));
  nlohmann::json j = ToJson(s);
  for (const char* key : {"foreach", "fused_optimizer", "sgd_momentum", "sequence_parallel",
                          "autocast", "gradient_as_bucket_view"}) {
    CAPTURE(key);
    CHECK(j.contains(key));
  }
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
  REQUIRE(back->memory->step.has_value());
  CHECK(back->memory->step->peak_bytes == e->memory->step->peak_bytes);
  {
    // A setup the step model does not run: its reason and kind round-trip too.
    TrainingSetup fused = s;
    fused.loss = Loss::kFused;
    Result<Estimate> f = EstimateTraining(llama, hw, fused);
    REQUIRE_MESSAGE(f.ok(), f.status().ToString());
    CHECK(f->memory->step_unmodelled);
    const nlohmann::json fj = ToJson(*f);
    CHECK(fj["step_model"]["unmodelled"] == true);
    Result<Estimate> fb = EstimateFromJson(fj);
    REQUIRE_MESSAGE(fb.ok(), fb.status().ToString());
    CHECK(fb->memory->step_unmodelled);
    CHECK(fb->memory->step_error == f->memory->step_error);
    CHECK(ToJson(*fb) == fj);
  }
  nlohmann::json broken = j;
  broken["breakdown"][0]["phases"] = {"lunch"};
  CHECK_FALSE(EstimateFromJson(broken).ok());
}

// --- Framework and version behaviours (issue 14, second round) ---------------------------------

TEST_CASE("memory model: before PyTorch 1.11 softmax keeps its input too") {
  // pytorch/pytorch#64000: _softmax's derivative was _softmax_backward_data(grad, result, dim,
  // self), so autograd saved the input (the masked scores) beside the output; #65242 (PyTorch
  // 1.11) passes the input dtype instead. The Hugging Face anatomy runs date from January 2022.
  LayerShape l = Gpt3Layer(1);
  const uint64_t s = 2048, a = 96;
  const uint64_t current = LayerActivationBytes(l, 2, false, Checkpointing::kNone);
  const uint64_t flash = LayerActivationBytes(l, 2, true, Checkpointing::kNone);
  l.softmax_keeps_input = true;
  CHECK(LayerActivationBytes(l, 2, false, Checkpointing::kNone) == current + 2 * a * s * s);
  CHECK(LayerActivationBytes(l, 2, true, Checkpointing::kNone) == flash);  // no score matrix

  Result<ModelInventory> bert =
      InventoryFromHfConfigText(kBertLarge, "bert-large-uncased", ModelClassChoice::kBase);
  REQUIRE_OK(bert);
  TrainingSetup setup;
  setup.precision = Precision::kFp32;
  setup.micro_batch = 4;
  setup.seq_len = 512;
  setup.flash_attention = false;
  const uint64_t sbh = 512 * 4 * 1024, as2b = uint64_t{16} * 512 * 512 * 4;
  setup.torch_version = "2.1";
  CHECK(MustEstimate(*bert, setup).activation_bytes_per_layer == 66 * sbh + 9 * as2b);
  setup.torch_version = "1.10.1+cu113";
  CHECK(MustEstimate(*bert, setup).activation_bytes_per_layer == 66 * sbh + 13 * as2b);
  for (const char* bad : {"1", "abc", "1.x", "2.1x", ".1"}) {
    CAPTURE(bad);
    setup.torch_version = bad;
    CHECK_FALSE(setup.Validate().ok());
  }
}

TEST_CASE("memory model: Transformers' gelu_new keeps three more MLP-wide tensors") {
  // transformers/activations.py NewGELUActivation: 0.5 * x * (1 + tanh(c * (x + 0.044715 x^3)))
  // in Python: autograd keeps tanh's output, 1 + tanh(...) and 0.5 * x (the final product's
  // operands) besides x; GELUActivation ("gelu") calls the fused F.gelu, which keeps x only.
  const uint64_t s = 256, h = 768, f = 3072;
  ModelInventory gelu_new = MustBuild({{"model_type", "gpt2"}});
  ModelInventory gelu = MustBuild({{"model_type", "gpt2"}, {"activation_function", "gelu"}});
  TrainingSetup setup;
  setup.precision = Precision::kFp32;
  setup.seq_len = s;
  const uint64_t fused = MustEstimate(gelu, setup).activation_bytes_per_layer;
  CHECK(MustEstimate(gelu_new, setup).activation_bytes_per_layer == fused + 3 * 4 * s * f);
  LayerShape l = Gpt3Layer(1);
  const uint64_t base = LayerActivationBytes(l, 2, true, Checkpointing::kNone);
  l.mlp_activation_extra = 6;  // FastGELUActivation ("gelu_fast")
  CHECK(LayerActivationBytes(l, 2, true, Checkpointing::kNone) ==
        base + 6 * 2 * uint64_t{2048} * 4 * 12288);
  (void)h;
}

TEST_CASE("memory model: Lit-GPT's LoRA, fused QKV, fp32 logits and QLoRA of every Linear") {
  // Lit-GPT at 8641822 (tutorials/resource-tables.md): lit_gpt/lora.py LoRAQKVLinear applies one
  // lora_dropout to the block input and zero_pad()s the q/v update with index_copy, which keeps
  // its source for backward; lit_gpt/model.py CausalSelfAttention keeps the fused qkv output
  // alive through the value view given to SDPA, beside the roped query and key (torch.cat
  // copies); RMSNorm upcasts to fp32; finetune/lora.py runs lm_head in 128-position chunks that
  // Fabric's precision plugin converts to fp32 (convert_output) for chunked_cross_entropy.
  ModelInventory llama = memplan::testing::Fixture("llama-2-7b");
  TrainingSetup s;
  s.precision = Precision::kBf16Pure;
  s.lora_rank = 8;
  s.lora_targets = {"q_proj", "v_proj"};
  s.seq_len = 1304;
  s.framework = Framework::kLitGpt;
  const uint64_t sbh = uint64_t{1304} * 4096, sbf = uint64_t{1304} * 11008;
  MemoryEstimate lora = MustEstimateFormulas(llama, s);
  // Bytes per token x width: norms 2 x 4 (fp32), fused qkv 6, roped q and k 4, SDPA output 2,
  // lora_dropout mask and output 3, zero-padded update 2 x 2 (q and v) = 27; MLP 3 x 2 = 6;
  // plus SDPA's fp32 log-sum-exp.
  CHECK(lora.activation_bytes_per_layer == 27 * sbh + 6 * sbf + 4 * 32 * 1304);
  CHECK(Gpu(lora, "logits_and_loss") == 8 * uint64_t{1304} * 32000);
  CHECK(Gpu(lora, "logits_grad") == 8 * uint64_t{128} * 32000);
  // The same model under Transformers + PEFT: two dropouts (q_proj, v_proj), no padded update,
  // q/k/v as the attention keeps them (3 x 2).
  s.framework = Framework::kTransformers;
  CHECK(MustEstimateFormulas(llama, s).activation_bytes_per_layer ==
        8 * sbh + 6 * sbh + 2 * sbh + 2 * 3 * sbh + 6 * sbf + 4 * 32 * 1304);
  // QLoRA: Lightning's BitsandbytesPrecision quantises lm_head too, from fp16 copies, so the
  // dequantised head exists in fp16 and bf16 at once; MatMul4Bit keeps every Linear's input.
  s.framework = Framework::kLitGpt;
  s.qlora = true;
  MemoryEstimate qlora = MustEstimateFormulas(llama, s);
  CHECK(Gpu(qlora, "qlora_dequant_workspace") == 2 * 2 * uint64_t{32000} * 4096);
  CHECK(qlora.activation_bytes_per_layer == lora.activation_bytes_per_layer + 4 * sbh + 2 * sbf);
  s.framework = Framework::kTransformers;
  MemoryEstimate peft = MustEstimateFormulas(llama, s);
  CHECK(Gpu(peft, "params_working") - Gpu(qlora, "params_working") == 2 * uint64_t{32000} * 4096);
  CHECK(Gpu(peft, "qlora_dequant_workspace") == 2 * uint64_t{4096} * 11008);
}

ModelInventory Gpt2Xl() {
  return MustBuild({{"model_type", "gpt2"}, {"n_embd", 1600}, {"n_layer", 48}, {"n_head", 25}});
}

TEST_CASE("memory model: FSDP shards flat parameters, gradients and states; units gathered") {
  // torch/distributed/fsdp: each rank keeps its shard of every wrapped unit's FlatParameter in
  // the parameter dtype, reduce-scatters the unit's gradient into a sharded .grad, and a
  // torch.optim optimizer steps the shards (states shard-sized); FULL_SHARD gathers a unit for
  // its forward and backward and frees it after (one more prefetched); no DeepSpeed buckets.
  ModelInventory xl = Gpt2Xl();
  const uint64_t p = memplan::testing::Total(xl);
  const uint64_t block = memplan::testing::Counts(xl).largest_block_params;
  TrainingSetup s;
  s.precision = Precision::kFp32;
  s.gpus_per_node = 2;
  s.seq_len = 128;
  s.flash_attention = false;
  s.fsdp = FsdpSharding::kFullShard;
  MemoryEstimate full = MustEstimateFormulas(xl, s);
  CHECK(Gpu(full, "params_working") == 4 * ((p + 1) / 2));
  CHECK(Gpu(full, "grads") == 4 * ((p + 1) / 2));
  CHECK(Gpu(full, "optimizer_states") == 8 * ((p + 1) / 2));
  CHECK(Item(full, "params_master") == nullptr);
  CHECK(Item(full, "comm_reduce_bucket") == nullptr);
  CHECK(Item(full, "ddp_grad_buckets") == nullptr);
  CHECK(Gpu(full, "fsdp_unsharded_params") == 2 * block * 4);
  CHECK((Item(full, "fsdp_unsharded_params")->phases & kPhaseOptimizerStep) == 0);
  // torch.optim's foreach path admits plain Tensors and Parameters only: FlatParameters get the
  // per-tensor loop, two temporaries of the largest flat shard.
  CHECK(Gpu(full, "optimizer_step_transient") == 2 * ((block + 1) / 2) * 4);
  // SHARD_GRAD_OP keeps every unit gathered from its forward to its backward.
  s.fsdp = FsdpSharding::kShardGradOp;
  CHECK(Gpu(MustEstimateFormulas(xl, s), "fsdp_unsharded_params") == p * 4);
  // CPU offload: shards of parameters and gradients and the states in (pinned) host memory.
  s.fsdp = FsdpSharding::kFullShard;
  s.offload_param = OffloadDevice::kCpu;
  MemoryEstimate offload = MustEstimateFormulas(xl, s);
  CHECK(Gpu(offload, "params_working") == 0);
  CHECK(Item(offload, "params_working")->cpu_bytes == 2 * 4 * ((p + 1) / 2));
  CHECK(Item(offload, "params_working")->pinned_bytes == 2 * 4 * ((p + 1) / 2));
  CHECK(Item(offload, "optimizer_states")->cpu_bytes == 2 * 8 * ((p + 1) / 2));
  CHECK(Item(offload, "optimizer_step_transient") == nullptr);
  CHECK(Gpu(offload, "fsdp_unsharded_params") == 2 * block * 4);
  // One GPU: FSDP clamps to NO_SHARD (torch/distributed/fsdp/_init_utils.py), which with CPU
  // offload copies every unit to the GPU and frees none before backward.
  s.gpus_per_node = 1;
  CHECK(s.EffectiveFsdp() == FsdpSharding::kNoShard);
  MemoryEstimate one = MustEstimateFormulas(xl, s);
  CHECK(Gpu(one, "fsdp_unsharded_params") == p * 4);
  CHECK(PhaseOf(one, "backward").gpu_allocated_bytes >
        PhaseOf(offload, "backward").gpu_allocated_bytes + (p - 2 * block) * 4 - kGiB);
  // Contradictory or impossible combinations name the fields (Note [Field names in errors]).
  s.gpus_per_node = 2;
  s.zero_stage = 2;
  CHECK(s.Validate().message().find("`fsdp`") != std::string::npos);
  s.zero_stage = 0;
  s.offload_param = OffloadDevice::kNvme;
  CHECK_FALSE(s.Validate().ok());
  s.offload_param = OffloadDevice::kNone;
  s.offload_optimizer = OffloadDevice::kCpu;
  CHECK(s.Validate().message().find("`offload_param` cpu") != std::string::npos);
}

TEST_CASE("memory model: framework, torch_version and fsdp round-trip through JSON") {
  TrainingSetup s;
  s.framework = Framework::kLitGpt;
  s.torch_version = "1.10";
  s.fsdp = FsdpSharding::kShardGradOp;
  s.gpus_per_node = 2;
  const nlohmann::json j = ToJson(s);
  CHECK(j["framework"] == "litgpt");
  CHECK(j["fsdp"] == "shard_grad_op");
  Result<TrainingSetup> back = TrainingSetupFromJson(j);
  REQUIRE_MESSAGE(back.ok(), back.status().ToString());
  CHECK(ToJson(*back) == j);
  CHECK_OK(ParseFsdpSharding("FULL_SHARD"));
  CHECK_FALSE(ParseFramework("megatron").ok());
}

uint64_t StepAt(const MemoryEstimate& m, StepPhase p) {
  return m.step->phases[static_cast<size_t>(p)].bytes;
}

TEST_CASE("memory model: where the step model runs, its categories are each phase's items") {
  // Note [Items from the step model].
  ModelInventory gpt2 = MustBuild({{"model_type", "gpt2"}});
  TrainingSetup s;
  s.precision = Precision::kBf16Mixed;
  s.autocast = true;
  s.seq_len = 512;
  s.micro_batch = 4;
  const MemoryEstimate m = MustEstimate(gpt2, s);
  REQUIRE(m.step.has_value());
  for (const char* formula :
       {"logits_and_loss", "logits_grad", "activation_recompute", "backward_workspace",
        "grads_first_layer", "autocast_weight_copies"}) {
    CAPTURE(formula);
    CHECK(Item(m, formula) == nullptr);
  }
  const MemoryItem* act = Item(m, "activations");
  REQUIRE(act != nullptr);
  REQUIRE(act->gpu_phase_bytes.size() == 4);
  CHECK(act->GpuBytesIn(kPhaseOptimizerStep) == 0);
  CHECK(act->gpu_bytes == std::max(act->gpu_phase_bytes[0], act->gpu_phase_bytes[1]));
  // A plain loop: the step model lays out the states too, so each phase is its peak.
  CHECK(PhaseOf(m, "forward").gpu_allocated_bytes ==
        std::max(StepAt(m, StepPhase::kForward), StepAt(m, StepPhase::kLoss)));
  CHECK(PhaseOf(m, "backward").gpu_allocated_bytes == StepAt(m, StepPhase::kBackward));
  CHECK(PhaseOf(m, "optimizer_step").gpu_allocated_bytes == StepAt(m, StepPhase::kOptimizerStep));
  // The gradients appear as backward makes them.
  CHECK(Item(m, "grads")->GpuBytesIn(kPhaseForward) == 0);
  CHECK(Item(m, "grads")->GpuBytesIn(kPhaseOptimizerStep) > 0);
  // The allocator's margin is its replay's (Note [The caching allocator's reserve]).
  CHECK(Gpu(m, "allocator_margin") == m.step->held_bytes - m.step->allocator_allocated_bytes);
  CHECK(m.peak.gpu_bytes == PhaseOf(m, m.peak.phase).gpu_allocated_bytes +
                                Gpu(m, "allocator_margin") + Gpu(m, "cuda_context"));
  CHECK(m.peak.gpu_reserved_bytes == PhaseOf(m, m.peak.phase).gpu_allocated_bytes +
                                         m.step->reserved_bytes -
                                         m.step->allocator_allocated_bytes);
  CHECK(m.step->reserved_bytes >= m.step->held_bytes);
  CHECK(m.step->held_bytes >= m.step->allocator_allocated_bytes);
  // The formulas, for comparison, count more for the logits of a model this small.
  const MemoryEstimate f = MustEstimateFormulas(gpt2, s);
  CHECK(f.peak.gpu_bytes > m.peak.gpu_bytes);
}

TEST_CASE("memory model: gradients that persist are added into, not made again") {
  // Note [Gradients that persist]: with accumulation the step's gradients stay the kept ones.
  ModelInventory gpt2 = MustBuild({{"model_type", "gpt2"}});
  TrainingSetup s;
  s.precision = Precision::kFp32;
  s.seq_len = 256;
  s.grad_accum = 2;
  const MemoryEstimate m = MustEstimate(gpt2, s);
  REQUIRE(m.step.has_value());
  const auto grads = [&](StepPhase p) {
    return m.step->phases[static_cast<size_t>(p)]
        .categories[static_cast<size_t>(StepCategory::kGradients)];
  };
  CHECK(grads(StepPhase::kForward) == Gpu(m, "grads"));
  CHECK(grads(StepPhase::kOptimizerStep) == Gpu(m, "grads"));
  CHECK(Item(m, "grads")->phases == kAllPhases);
  // DDP: the buckets beside them, through the step.
  s.grad_accum = 1;
  s.gpus_per_node = 2;
  const MemoryEstimate ddp = MustEstimate(gpt2, s);
  REQUIRE(ddp.step.has_value());
  CHECK(PhaseOf(ddp, "optimizer_step").gpu_allocated_bytes ==
        PhaseOf(m, "optimizer_step").gpu_allocated_bytes + uint64_t{124439808} * 4);
}

TEST_CASE("memory model: a step-model run is reused across what it cannot tell apart") {
  // Note [Reusing a step]: ZeRO stages, offload and buckets change the states, not the step.
  ModelInventory llama = memplan::testing::Fixture("llama-2-7b");
  const ModelCounts counts = *CountParams(llama);
  StepModelCache cache;
  TrainingSetup s;
  s.seq_len = 512;
  s.gpus_per_node = 4;
  s.checkpointing = Checkpointing::kFull;
  int tried = 0;
  for (int stage : {1, 2, 3}) {
    for (OffloadDevice opt : {OffloadDevice::kNone, OffloadDevice::kCpu}) {
      TrainingSetup t = s;
      t.zero_stage = stage;
      t.offload_optimizer = opt;
      t.reduce_bucket_size = 100'000'000 * stage;
      CAPTURE(stage);
      const MemoryEstimate direct = MustEstimate(llama, t);
      Result<MemoryEstimate> cached = EstimateMemory(llama, t, counts, &cache);
      REQUIRE(cached.ok());
      ++tried;
      REQUIRE(direct.step.has_value());
      REQUIRE(cached->step.has_value());
      CHECK(cached->step->peak_bytes == direct.step->peak_bytes);
      CHECK(cached->step->reserved_bytes == direct.step->reserved_bytes);
      CHECK(cached->peak.gpu_bytes == direct.peak.gpu_bytes);
      CHECK(cached->peak.gpu_reserved_bytes == direct.peak.gpu_reserved_bytes);
      REQUIRE(cached->phases.size() == direct.phases.size());
      for (size_t p = 0; p < direct.phases.size(); ++p) {
        CHECK(cached->phases[p].gpu_allocated_bytes == direct.phases[p].gpu_allocated_bytes);
      }
    }
  }
  CHECK(cache.runs() == 1);
  CHECK(cache.hits() == static_cast<size_t>(tried - 1));
  // Another micro-batch is another run.
  s.zero_stage = 2;
  s.micro_batch = 2;
  REQUIRE(EstimateMemory(llama, s, counts, &cache).ok());
  CHECK(cache.runs() == 2);
  // A plain loop lays out its own states; its kept gradients still move: accumulation on one
  // GPU and DDP's buckets on four are one run.
  ModelInventory gpt2 = MustBuild({{"model_type", "gpt2"}});
  const ModelCounts gpt2_counts = *CountParams(gpt2);
  TrainingSetup p;
  p.precision = Precision::kBf16Mixed;
  p.autocast = true;
  p.seq_len = 512;
  p.grad_accum = 2;
  const size_t runs = cache.runs();
  for (int64_t gpus : {1, 4}) {
    p.gpus_per_node = gpus;
    const MemoryEstimate direct = MustEstimate(gpt2, p);
    Result<MemoryEstimate> cached = EstimateMemory(gpt2, p, gpt2_counts, &cache);
    REQUIRE(cached.ok());
    CAPTURE(gpus);
    CHECK(cached->step->peak_bytes == direct.step->peak_bytes);
    CHECK(cached->step->reserved_bytes == direct.step->reserved_bytes);
    CHECK(cached->peak.gpu_bytes == direct.peak.gpu_bytes);
  }
  CHECK(cache.runs() == runs + 1);
}

}  // namespace
}  // namespace memplan::estimator
