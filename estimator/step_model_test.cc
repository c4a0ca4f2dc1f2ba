// The step model against a few traces of the real code (memplan.trace on the `trace` branch:
// tests/accuracy/trace_grid.json, development part; the whole grid is checked by
// estimator_trace_accuracy, CTest trace_grid_accuracy, once the grid is on the branch). These
// points run in CI today: one per framework, the traced peak allocated bytes copied from the grid.
#include "estimator/step_model.h"

#include <doctest/doctest.h>

#include <array>
#include <fstream>
#include <cmath>
#include <string>

#include <nlohmann/json.hpp>

#include "common/file.h"
#include "estimator/memory_model.h"
#include "estimator/step_graph.h"
#include "estimator/step_ops.h"
#include "tests/estimator_testing.h"

namespace memplan::estimator {
namespace {

// Built-in config `name` with `layers` blocks, as memplan.trace builds it (--layers).
ModelInventory WithLayers(const std::string& name, int64_t layers) {
  nlohmann::json config = nlohmann::json::parse(memplan::testing::ReadFixture(name));
  config["num_hidden_layers"] = layers;
  return memplan::testing::MustBuild(config);
}

// A config.json of the source tree (`path` relative to it) with `layers` blocks.
nlohmann::json SourceConfig(const std::string& path, int64_t layers) {
  std::ifstream in(std::string(MEMPLAN_SOURCE_DIR) + "/" + path);
  REQUIRE_MESSAGE(in.good(), "missing " << path);
  nlohmann::json config = nlohmann::json::parse(in);
  config["num_hidden_layers"] = layers;
  return config;
}

// A real-shaped config of tests/oracle/modern_configs with two blocks.
ModelInventory Modern(const std::string& name) {
  return memplan::testing::MustBuild(
      SourceConfig("tests/oracle/modern_configs/" + name + ".json", 2));
}

StepModel MustStep(const ModelInventory& inventory, const TrainingSetup& s) {
  Result<MemoryEstimate> m = EstimateMemory(inventory, s);
  REQUIRE_MESSAGE(m.ok(), m.status().ToString());
  REQUIRE_MESSAGE(m->step.has_value(), m->step_error);
  return *m->step;
}

std::array<uint64_t, kStepPhases> PhasePeaks(const StepModel& m) {
  std::array<uint64_t, kStepPhases> out{};
  for (size_t p = 0; p < out.size(); ++p) out[p] = m.phases[p].bytes;
  return out;
}

double Error(uint64_t predicted, uint64_t traced) {
  return (static_cast<double>(predicted) - static_cast<double>(traced)) /
         static_cast<double>(traced);
}

TEST_CASE("step model: Transformers Llama, autocast bf16, AdamW, against its trace") {
  // transformers/llama-3.2-1b/L2/b1s1024/bf16-mixed/sdpa/ckpt-{none,full}/loss-full/adamw/a100
  const ModelInventory llama = WithLayers("llama-3.2-1b", 2);
  TrainingSetup s;
  s.precision = Precision::kBf16Mixed;
  s.autocast = true;
  s.micro_batch = 1;
  s.seq_len = 1024;
  const StepModel none = MustStep(llama, s);
  CHECK(none.peak_phase == StepPhase::kBackward);
  CHECK(std::abs(Error(none.peak_bytes, 8'258'897'920)) < 0.005);
  s.checkpointing = Checkpointing::kFull;
  const StepModel full = MustStep(llama, s);
  CHECK(std::abs(Error(full.peak_bytes, 8'258'897'920)) < 0.005);
  // Checkpointing keeps each block's input only: less alive through the forward pass.
  const auto forward = static_cast<size_t>(StepPhase::kForward);
  CHECK(full.phases[forward].categories[static_cast<size_t>(StepCategory::kActivations)] <
        none.phases[forward].categories[static_cast<size_t>(StepCategory::kActivations)]);
  // LoRA with checkpointing, forward and backward to the byte (the grid's lora16 point): each
  // checkpoint keeps the layer's keyword arguments, the position ids with the rotary tables
  // (1024 int64s; 8 KiB short in both phases without them).
  s.micro_batch = 2;
  s.lora_rank = 16;
  const StepModel lora = MustStep(llama, s);
  CHECK(lora.phases[forward].bytes == 2'675'500'032);
  CHECK(lora.phases[static_cast<size_t>(StepPhase::kBackward)].bytes == 5'276'592'128);
}

TEST_CASE("step model: torchtune QLoRA with its chunked loss, against its trace") {
  // torchtune/llama-3.2-1b/L2/b2s2048/bf16/sdpa/ckpt-full/loss-chunked8/adamw-fused/a100/qlora8
  const ModelInventory llama = WithLayers("llama-3.2-1b", 2);
  TrainingSetup s;
  s.framework = Framework::kTorchtune;
  s.precision = Precision::kBf16Pure;
  s.fused_optimizer = true;
  s.micro_batch = 2;
  s.seq_len = 2048;
  s.checkpointing = Checkpointing::kFull;
  s.loss = Loss::kChunked;
  s.loss_chunks = 8;
  s.lora_rank = 8;
  s.qlora = true;
  const StepModel m = MustStep(llama, s);
  CHECK(m.peak_phase == StepPhase::kLoss);
  CHECK(std::abs(Error(m.peak_bytes, 4'116'124'160)) < 0.005);
  // The full fine-tune's forward peaks in the chunked output projection, with forward's `h` (the
  // last layer's output) still alive beside unembed's normalized one: 16 MiB short without it,
  // 21.5 KiB over with it.
  s.lora_rank = 0;
  s.qlora = false;
  const auto forward = static_cast<size_t>(StepPhase::kForward);
  const uint64_t traced = 3'516'161'024;
  const uint64_t predicted = MustStep(llama, s).phases[forward].bytes;
  CHECK(predicted >= traced);
  CHECK(predicted - traced < 32 * 1024);
}

TEST_CASE("step model: LitGPT LoRA under Fabric's bf16-mixed, against its trace") {
  // litgpt/llama-2-7b/L2/b1s1024/bf16-mixed/sdpa/ckpt-none/loss-full/adamw/a100/lora8
  const ModelInventory llama = WithLayers("llama-2-7b", 2);
  TrainingSetup s;
  s.framework = Framework::kLitGpt;
  s.precision = Precision::kBf16Mixed;
  s.autocast = true;
  s.micro_batch = 1;
  s.seq_len = 1024;
  s.lora_rank = 8;
  const StepModel m = MustStep(llama, s);
  CHECK(std::abs(Error(m.peak_bytes, 4'402'769'920)) < 0.01);
  // The adapted projections are the ones LoraTargetTensors resolves, whatever they are called:
  // Hugging Face's names give LitGPT's default (query and value) to the byte; adapting key too
  // changes it (all three parts adapted: zero_pad's index_copy is not needed, so it is less).
  s.lora_targets = {"q_proj", "v_proj"};
  CHECK(PhasePeaks(MustStep(llama, s)) == PhasePeaks(m));
  s.lora_targets = {"query", "value"};
  CHECK(PhasePeaks(MustStep(llama, s)) == PhasePeaks(m));
  s.lora_targets = {"query", "key", "value"};
  CHECK(MustStep(llama, s).peak_bytes < m.peak_bytes);
  // The full fine-tune in pure bf16, every phase to the byte: LitGPT's query is a torch.cat, so
  // flash attention's output is laid out heads-major and y.transpose(1, 2).reshape copies it
  // (16 MiB short in the forward without that copy).
  TrainingSetup pure;
  pure.framework = Framework::kLitGpt;
  pure.precision = Precision::kBf16Pure;
  pure.micro_batch = 1;
  pure.seq_len = 1024;
  CHECK(PhasePeaks(MustStep(llama, pure)) ==
        std::array<uint64_t, kStepPhases>{4'584'486'912, 4'780'967'936, 5'353'292'800,
                                          6'678'732'800});
}

// llm-foundry's MPT-1B shape (scripts/train/yamls/pretrain/mpt-1b.yaml; the grid's
// tests/accuracy/trace_models/mpt-1b.json) with `layers` blocks.
ModelInventory Mpt1b(int64_t layers) {
  nlohmann::json config = {
      {"architectures", {"MPTForCausalLM"}},
      {"model_type", "mpt"},
      {"d_model", 2048},
      {"n_heads", 16},
      {"n_layers", layers},
      {"expansion_ratio", 4},
      {"max_seq_len", 2048},
      {"vocab_size", 50368},
      {"no_bias", true},
      {"norm_type", "low_precision_layernorm"},
      {"attn_config", {{"alibi", true}, {"attn_impl", "torch"}, {"attn_pdrop", 0}}},
  };
  return memplan::testing::MustBuild(config);
}

TEST_CASE("step model: llm-foundry's MPT (ALiBi, LPLayerNorm, Composer's AdamW), against traces") {
  // llm-foundry/mpt-1b/L2/b2s1024/{bf16-mixed,bf16}/sdpa/ckpt-none/loss-full/adamw/a100 and
  // .../b1s2048/bf16-mixed/sdpa/ckpt-full/...: the traced peaks, copied from the grid.
  const ModelInventory mpt = Mpt1b(2);
  TrainingSetup s;
  s.framework = Framework::kLlmFoundry;
  s.precision = Precision::kBf16Mixed;
  s.autocast = true;
  s.micro_batch = 2;
  s.seq_len = 1024;
  const StepModel mixed = MustStep(mpt, s);
  CHECK(mixed.peak_phase == StepPhase::kBackward);
  CHECK(std::abs(Error(mixed.peak_bytes, 4'583'864'320)) < 0.001);
  // Composer's DecoupledAdamW steps tensor by tensor: two temporaries of the embedding.
  const auto step = static_cast<size_t>(StepPhase::kOptimizerStep);
  const auto transients = static_cast<size_t>(StepCategory::kOptimizerTransients);
  CHECK(mixed.phases[step].categories[transients] == 2 * uint64_t{50368} * 2048 * 4);
  s.precision = Precision::kBf16Pure;
  s.autocast = false;
  CHECK(std::abs(Error(MustStep(mpt, s).peak_bytes, 2'540'614'656)) < 0.001);
  s.precision = Precision::kBf16Mixed;
  s.autocast = true;
  s.micro_batch = 1;
  s.seq_len = 2048;
  s.checkpointing = Checkpointing::kFull;
  CHECK(std::abs(Error(MustStep(mpt, s).peak_bytes, 4'138'169'344)) < 0.005);
}

// The four phases' peaks of a step: forward, loss, backward, optimizer step.
TEST_CASE("step model: Transformers' encoder masked LMs, against their traces") {
  // transformers/<model>/L2/.../a100 of the grid: each phase's traced peak allocated bytes,
  // copied from the grid: every phase exact.
  const ModelInventory bert = WithLayers("bert-base-uncased", 2);
  TrainingSetup s;
  s.precision = Precision::kBf16Mixed;
  s.autocast = true;
  s.micro_batch = 4;
  s.seq_len = 512;
  // bert-base-uncased/L2/b4s512/bf16-mixed/sdpa/ckpt-none: the loss's backward is the peak.
  const StepModel none = MustStep(bert, s);
  CHECK(none.peak_phase == StepPhase::kBackward);
  CHECK(PhasePeaks(none) ==
        std::array<uint64_t, kStepPhases>{842'267'648, 1'211'031'552, 1'329'668'096, 781'056'000});
  // ckpt-full: each BertLayer keeps its input only.
  s.checkpointing = Checkpointing::kFull;
  CHECK(PhasePeaks(MustStep(bert, s)) ==
        std::array<uint64_t, kStepPhases>{722'465'792, 1'091'229'696, 1'181'554'688, 781'056'000});
  // b2s128/bf16-mixed/eager: BERT's eager_attention_forward (the matmuls' reshape copies,
  // fp32 softmax and dropout); the peak is the tied word embedding's two gradients summed.
  s.checkpointing = Checkpointing::kNone;
  s.flash_attention = false;
  s.micro_batch = 2;
  s.seq_len = 128;
  const StepModel eager = MustStep(bert, s);
  CHECK(eager.phases[0].bytes == 590'806'016);
  CHECK(eager.phases[1].bytes == 636'902'400);
  CHECK(eager.phases[2].bytes == 814'230'528);
  // roberta-base/L2/b2s512/fp32/sdpa (memory-efficient attention; position ids from the
  // input ids, the token types gathered at them).
  TrainingSetup f;
  f.precision = Precision::kFp32;
  f.micro_batch = 2;
  f.seq_len = 512;
  const StepModel roberta = MustStep(WithLayers("roberta-base", 2), f);
  CHECK(roberta.phases[0].bytes == 980'745'728);
  CHECK(roberta.phases[1].bytes == 1'186'632'192);
  CHECK(roberta.phases[2].bytes == 1'392'517'632);
  // distilbert-base-uncased/L2/b4s512/bf16-mixed/sdpa/ckpt-none: no token types, no dropout
  // on the attention output.
  Result<std::string> text =
      memplan::ReadFileToString(std::string(MEMPLAN_SOURCE_DIR) +
                                "/tests/oracle/modern_configs/distilbert-base-uncased.json");
  REQUIRE(text.ok());
  nlohmann::json distil = nlohmann::json::parse(*text);
  distil["n_layers"] = 2;
  s.flash_attention = true;
  s.micro_batch = 4;
  s.seq_len = 512;
  CHECK(PhasePeaks(MustStep(memplan::testing::MustBuild(distil), s)) ==
        std::array<uint64_t, kStepPhases>{839'095'296, 1'207'859'200, 1'326'495'744, 781'021'184});
}

TEST_CASE("step model: torchtitan's Llama 3 under FSDP2, against its traces") {
  // Three points of the grid, each phase's traced peak allocated bytes copied from it
  // (Note [FSDP2 in the step model], Note [torchtitan's per-op checkpointing]):
  //   llama-3.1-8b/L2/b2s2048/bf16-mixed/sdpa/ckpt-op/loss-chunked8/adamw-fused/a100/fsdp8:
  //     op checkpointing, eight ranks, the chunked loss (each chunk's backward in the loss);
  //   llama-2-7b/L2/b2s2048/bf16-mixed/sdpa/ckpt-none/loss-full/adamw/a100/fsdp2: whole
  //     logits, backward prefetch, foreach AdamW;
  //   llama-3.2-1b/L2/b1s2048/bf16-mixed/sdpa/ckpt-full/loss-chunked8/adamw-fused/a100: a tied
  //     head in one unit with the embedding and the norm, one rank, full checkpointing.
  // The optimizer step lacks clip_grad_norm_'s per-tensor norms (512 bytes each).
  auto setup = [](int64_t ranks, int64_t batch, Checkpointing c, Loss loss, bool fused) {
    TrainingSetup s;
    s.framework = Framework::kTorchtitan;
    s.precision = Precision::kBf16Mixed;
    s.autocast = false;
    s.fsdp = FsdpSharding::kFullShard;
    s.zero_stage = 3;
    s.gpus_per_node = ranks;
    s.micro_batch = batch;
    s.seq_len = 2048;
    s.checkpointing = c;
    s.loss = loss;
    if (loss == Loss::kChunked) s.loss_chunks = 8;
    s.fused_optimizer = fused;
    return s;
  };
  // To the kilobyte (the loss's scalars aside); the optimizer step to 10 KiB (the norms).
  auto check = [](const StepModel& m, const std::array<uint64_t, kStepPhases>& traced) {
    for (size_t p = 0; p < kStepPhases; ++p) {
      const double bound = p + 1 == kStepPhases ? 1e-5 : 2e-6;
      CHECK_MESSAGE(std::abs(Error(m.phases[p].bytes, traced[p])) < bound,
                    StepPhaseName(static_cast<StepPhase>(p)));
    }
  };
  const StepModel op = MustStep(WithLayers("llama-3.1-8b", 2),
                                setup(8, 2, Checkpointing::kOp, Loss::kChunked, true));
  check(op, {4'947'452'416, 8'598'358'016, 6'170'068'480, 2'984'504'320});
  CHECK(op.peak_phase == StepPhase::kLoss);
  const StepModel full_loss =
      MustStep(WithLayers("llama-2-7b", 2), setup(2, 2, Checkpointing::kNone, Loss::kFull, false));
  check(full_loss, {6'148'220'928, 6'911'577'088, 7'173'721'088, 6'679'830'528});
  // The all-gather outputs between units are communication: in forward, the previous unit's
  // until the next copy-out.
  CHECK(full_loss.phases[0].categories[static_cast<size_t>(StepCategory::kCommunication)] > 0);
  const StepModel tied = MustStep(WithLayers("llama-3.2-1b", 2),
                                  setup(1, 1, Checkpointing::kFull, Loss::kChunked, true));
  check(tied, {5'697'212'416, 7'365'113'344, 8'268'358'656, 6'158'631'936});
  // One rank: no collective buffers at all.
  for (const StepPhasePeak& p : tied.phases) {
    CHECK(p.categories[static_cast<size_t>(StepCategory::kCommunication)] == 0);
  }
}

TEST_CASE("step model: the encoders' sequence and token classifiers, against their traces") {
  // Note [Encoder classifiers in the step model]; each figure the traced peak of the grid's point
  // (transformers/<model>/L2/b8s512/...), exact to the byte.
  TrainingSetup s;
  s.precision = Precision::kBf16Mixed;
  s.autocast = true;
  s.micro_batch = 8;
  s.seq_len = 512;
  // BertForTokenClassification: the forward peaks at the last layer's output norm, with
  // BertModel's embedding_output and BertOutput's locals alive.
  const StepModel token = MustStep(Modern("bert-base-ner"), s);
  CHECK(token.peak_phase == StepPhase::kForward);
  CHECK(token.peak_bytes == 816'264'704);
  // DistilBertForSequenceClassification under LoRA (q_lin, v_lin), fp16: the frozen embeddings'
  // dropout keeps no mask.
  TrainingSetup lora = s;
  lora.precision = Precision::kFp16Mixed;
  lora.lora_rank = 16;
  lora.lora_targets = {"q_lin", "v_lin"};
  const StepModel sequence = MustStep(Modern("distilbert-sst2"), lora);
  CHECK(sequence.peak_phase == StepPhase::kForward);
  CHECK(sequence.peak_bytes == 429'246'464);
  // The loss phase starts when the classifier's forward ends, and the model's forward computes
  // the loss with its pooled_output / sequence_output (the dropout's output) still a local: the
  // tracer took the whole forward for the forward phase until the head was the classifier.
  const auto loss = static_cast<size_t>(StepPhase::kLoss);
  CHECK(sequence.phases[loss].bytes == 386'422'272);
  lora.lora_targets = {};
  CHECK(MustStep(Modern("bert-base-ner"), lora).phases[loss].bytes == 400'549'888);
  // The masked LM under LoRA without checkpointing: 3 MiB over (that mask) before.
  TrainingSetup mlm = s;
  mlm.lora_rank = 16;
  const StepModel masked = MustStep(WithLayers("bert-base-uncased", 2), mlm);
  CHECK(masked.peak_bytes == 1'696'181'248);
}

TEST_CASE("step model: decoder sequence and token classifiers, against their traces") {
  // Note [Decoder classifiers in the step model]: the score Linear in place of the LM head (it
  // used to run as a vocabulary-wide head of no weight: +54% to +233%, or an overflow). Each
  // figure is the traced peak of the grid's point (transformers/<model>/L2/b8s512/bf16-mixed/
  // sdpa/ckpt-none/.../lora16-q_proj+v_proj), exact to the byte.
  auto config = [](const std::string& path) {
    return memplan::testing::MustBuild(SourceConfig(path, 2));
  };
  TrainingSetup s;
  s.precision = Precision::kBf16Mixed;
  s.autocast = true;
  s.micro_batch = 8;
  s.seq_len = 512;
  s.lora_rank = 16;
  s.lora_targets = {"q_proj", "v_proj"};
  // A reward model: one label, MSELoss on the last token's score.
  const StepModel reward =
      MustStep(config("tests/oracle/modern_configs/llama-3.1-8b-reward.json"), s);
  CHECK(reward.peak_phase == StepPhase::kBackward);
  CHECK(reward.peak_bytes == 6'295'376'384);
  // The loss phase peaks at the argmax over the non-padding positions: non_pad_mask and
  // token_indices are the forward's locals, their product a temporary.
  const auto loss = static_cast<size_t>(StepPhase::kLoss);
  CHECK(reward.phases[loss].bytes == 6'094'379'008);
  // Two labels: cross_entropy on the pooled logits.
  const StepModel sst2 = MustStep(config("tests/accuracy/trace_models/qwen2.5-0.5b-sst2.json"), s);
  CHECK(sst2.peak_bytes == 1'204'008'960);
  CHECK(sst2.phases[loss].bytes == 1'116'384'256);
  // A token classifier: dropout, score, fp32 logits.
  const StepModel ner = MustStep(config("tests/accuracy/trace_models/llama-3.2-1b-ner.json"), s);
  CHECK(ner.peak_bytes == 2'636'976'640);
  CHECK(ner.phases[loss].bytes == 2'578'809'344);
  // In pure bf16 their forward peaks in the final norm's weight multiplication, with the norm's
  // fp32 hidden_states and variance, and the model's inputs_embeds, still locals (the LM head
  // peaks later, when they are gone).
  TrainingSetup pure;
  pure.precision = Precision::kBf16Pure;
  pure.micro_batch = 4;
  pure.seq_len = 512;
  const auto forward = static_cast<size_t>(StepPhase::kForward);
  CHECK(MustStep(config("tests/accuracy/trace_models/llama-3.2-1b-ner.json"), pure)
            .phases[forward]
            .bytes == 2'826'961'408);
  CHECK(MustStep(config("tests/oracle/modern_configs/llama-3.1-8b-reward.json"), pure)
            .phases[forward]
            .bytes == 6'735'093'248);
}

TEST_CASE("step model: full-width q/k norms are the attention's, whatever their width") {
  // OLMo 2's and OLMoE's q_norm and k_norm are as wide as the hidden states. Told apart from the
  // block's norms by width, they were taken for block norms and never run: the norms' weight
  // gradients were missing (32 KiB per layer at the optimizer step) and the forward short by
  // what they save. Now told apart by their module (self_attn). The backward and optimizer-step
  // peaks of the grid's points, to the byte (their forward phases are still tens of MiB off,
  // docs/accuracy.md).
  const auto backward = static_cast<size_t>(StepPhase::kBackward);
  const auto step = static_cast<size_t>(StepPhase::kOptimizerStep);
  TrainingSetup s;
  s.precision = Precision::kBf16Pure;
  s.micro_batch = 2;
  s.seq_len = 512;
  const StepModel olmo2 = MustStep(Modern("olmo-2-1124-7b"), s);
  CHECK(olmo2.phases[backward].bytes == 9'831'892'992);
  CHECK(olmo2.phases[step].bytes == 12'277'171'200);
  TrainingSetup m;
  m.precision = Precision::kBf16Mixed;
  m.autocast = true;
  m.micro_batch = 1;
  m.seq_len = 1024;
  const StepModel olmoe = MustStep(Modern("olmoe-1b-7b"), m);
  CHECK(olmoe.phases[backward].bytes == 16'739'911'680);
  CHECK(olmoe.phases[step].bytes == 20'912'194'560);
}

TEST_CASE("step model: Falcon's FalconLinear and ALiBi locals, against its traces") {
  // FalconLinear is `input @ weight.T` then `+ bias`: autocast casts the transposed view anew at
  // every call (it caches leaves only) and the fp32 bias promotes the sum to fp32. Run as
  // F.linear, the checkpointed forward kept every layer's cached weight casts (+6.84% over its
  // trace) and the plain forward had 16-bit projections (-1.51%). A checkpoint also keeps the
  // layer's ALiBi tensor and the rotary tables FalconModel makes without using them. The grid's
  // falcon-rw-1b points (b1s1024, bf16-mixed): forward, loss and backward to the byte (the
  // optimizer step was and is 8 KiB under its trace).
  TrainingSetup s;
  s.precision = Precision::kBf16Mixed;
  s.autocast = true;
  s.micro_batch = 1;
  s.seq_len = 1024;
  const ModelInventory falcon = Modern("falcon-rw-1b");
  const StepModel plain = MustStep(falcon, s);
  CHECK(PhasePeaks(plain) == std::array<uint64_t, kStepPhases>{3'337'448'448, 3'749'548'544,
                                                               4'092'610'560, 4'083'172'352});
  s.checkpointing = Checkpointing::kFull;
  const StepModel full = MustStep(falcon, s);
  CHECK(PhasePeaks(full) == std::array<uint64_t, kStepPhases>{2'935'161'856, 3'347'261'952,
                                                              4'092'610'560, 4'083'172'352});
}

TEST_CASE("step model: flash attention's output follows the query's layout") {
  // A partial rotation cats the rotated and passed parts of each head, so the query is laid out
  // heads-major, flash attention's output too, and sdpa_attention_forward's
  // transpose(1, 2).contiguous() copies it (a no-op after a full rotation). Pythia and Phi-2
  // were one such copy a layer short in every phase.
  TrainingSetup s;
  s.precision = Precision::kBf16Pure;
  s.micro_batch = 2;
  s.seq_len = 512;
  CHECK(PhasePeaks(MustStep(WithLayers("pythia-160m", 2), s))[0] == 713'876'480);
  CHECK(PhasePeaks(MustStep(Modern("phi-2"), s))[0] == 2'935'094'272);
}

TEST_CASE("step model: GPT-J's eager attention computes its scores in fp32") {
  // GPTJAttention._attn casts query and key to fp32 (locals until it returns) before q @ k^T.
  // The grid's pure-bf16 point (L2, b2s512): the forward was 0.91% short without them, 0.02%
  // with them.
  TrainingSetup s;
  s.precision = Precision::kBf16Pure;
  s.micro_batch = 2;
  s.seq_len = 512;
  s.flash_attention = false;
  const StepModel gptj = MustStep(Modern("gpt-j-6b"), s);
  CHECK(std::abs(Error(gptj.phases[static_cast<size_t>(StepPhase::kForward)].bytes,
                       5'611'208'192)) < 0.001);
}

TEST_CASE("step model: an MoE block's locals live until it returns") {
  // grouped_mm_experts_forward keeps the down projection's output (proj_out), the sorted ids,
  // the histogram and the offsets until it returns; the block keeps the router's logits (`_`),
  // weights and indices. OLMoE's and Qwen's routers cast the weights to the logits' dtype and
  // normalize them only with norm_topk_prob (off by default), Mixtral's always. A checkpointed
  // forward saves nothing, so these locals are what its peak inside the experts holds: OLMoE's
  // LoRA point was 2.44% short there, Mixtral's 64 KiB. The grid's points, to the byte.
  const auto forward = static_cast<size_t>(StepPhase::kForward);
  const auto backward = static_cast<size_t>(StepPhase::kBackward);
  TrainingSetup s;
  s.precision = Precision::kBf16Mixed;
  s.autocast = true;
  s.micro_batch = 2;
  s.seq_len = 1024;
  s.checkpointing = Checkpointing::kFull;
  s.lora_rank = 16;
  s.lora_targets = {"q_proj", "v_proj"};
  const StepModel olmoe = MustStep(Modern("olmoe-1b-7b"), s);
  CHECK(olmoe.phases[forward].bytes == 4'798'924'800);
  const StepModel mixtral = MustStep(WithLayers("mixtral-8x7b", 2), s);
  CHECK(mixtral.phases[forward].bytes == 13'815'359'488);
  CHECK(mixtral.phases[backward].bytes == 14'377'471'488);
  TrainingSetup pure;
  pure.precision = Precision::kBf16Pure;
  pure.micro_batch = 2;
  pure.seq_len = 512;
  CHECK(MustStep(Modern("olmoe-1b-7b"), pure).phases[forward].bytes == 6'820'401'152);
}

TEST_CASE("step model: SDPA's math backend computes 16-bit attention in fp32") {
  // A V100 (sm70) has no bf16 kernel in flash or memory-efficient attention: SDPA runs its math
  // composite, which upcasts q, k and v and keeps the fp32 score matrix for softmax's backward
  // (512 MiB a layer here). The grid's Llama-3.1-8B V100 point (L2, b1s2048, bf16-mixed),
  // forward, loss and backward to the byte.
  TrainingSetup s;
  s.precision = Precision::kBf16Mixed;
  s.autocast = true;
  s.micro_batch = 1;
  s.seq_len = 2048;
  s.gpu_arch = "sm70";
  const StepModel v100 = MustStep(WithLayers("llama-3.1-8b", 2), s);
  CHECK(v100.phases[static_cast<size_t>(StepPhase::kForward)].bytes == 22'667'518'976);
  CHECK(v100.phases[static_cast<size_t>(StepPhase::kLoss)].bytes == 24'768'883'200);
  CHECK(v100.phases[static_cast<size_t>(StepPhase::kBackward)].bytes == 25'227'094'016);
}

TEST_CASE("step graph: hooks, a backward inside the forward, a selective checkpoint's cache") {
  using step::DT;
  using step::Graph;
  using step::T;
  constexpr step::Wide kN = 1 << 20;  // 4 MiB in fp32
  Graph g;
  // A hook recorded after an op runs before that op's backward; one recorded before, after it.
  std::vector<std::string> order;
  T x = g.New(kN, DT::kF32, true);
  g.RecordHook([&] { order.push_back("after the op's backward"); });
  T y = step::Apply(g, step::Unary::kSilu, x);
  g.RecordHook([&] { order.push_back("before the op's backward"); });
  // A backward of its own from a second loss: only its nodes run, and the gradient it gives a
  // detached leaf is taken from there.
  T leaf = g.New(kN, DT::kF32, true);
  const size_t mark = g.NodeCount();
  T inner = step::MeanRows(g, step::Apply(g, step::Unary::kSilu, leaf), kN);
  g.BackwardTail(inner, mark);
  CHECK(g.NodeCount() == mark);
  CHECK(order.empty());
  const int leaf_grad = g.TakeGrad(leaf);
  REQUIRE(leaf_grad >= 0);
  CHECK(g.TakeGrad(leaf) == -1);
  g.Unref(leaf_grad);
  // A cached tensor (the cache's own reference) handed to the next op made: no allocation, and
  // the cache's reference goes with it.
  T cached = g.Alias(y);
  const step::Wide before = g.live();
  g.ReuseNext({cached});
  T again = g.New(kN, DT::kF32, false);
  CHECK(g.live() == before);
  g.Drop(again);
  CHECK(g.live() == before);  // y's own reference remains
  T loss = step::MeanRows(g, y, kN);
  g.Drop(y);
  g.Backward(loss);
  REQUIRE_FALSE(g.stale());
  CHECK(order == std::vector<std::string>{"before the op's backward", "after the op's backward"});
}

TEST_CASE("step graph: a checkpoint's last ops that save nothing run before its recompute") {
  // Note [What runs before the recompute] and Note [The recompute's own ops] (step_graph.cc), on
  // a block shaped as a decoder layer's LoRA'd Linear: z = x + x, the block's own op; then
  // y = silu(z) + scale(silu(z)), the base path and the adapter's, each silu saving z; the scale
  // and the last sum save nothing. Tensors of 4 MiB.
  using step::DT;
  using step::Graph;
  using step::T;
  constexpr step::Wide kN = 1 << 20;
  constexpr uint64_t kMiB = 1 << 20;
  const auto backward = static_cast<size_t>(StepPhase::kBackward);
  const auto activations = static_cast<size_t>(StepCategory::kActivations);
  const auto temporaries = static_cast<size_t>(StepCategory::kTemporaries);
  auto run = [&](bool body) {
    Graph g;
    auto block = [&g, body](T in) {
      g.SetBlockBody(body);
      T z = step::Add(g, in, in);
      g.SetBlockBody(false);
      T u = step::Apply(g, step::Unary::kSilu, z);
      T v = step::Apply(g, step::Unary::kSilu, z);
      g.Drop(z);
      T s = step::Scale(g, v);
      g.Drop(v);
      T y = step::Add(g, u, s);
      g.Drop(u);
      g.Drop(s);
      return y;
    };
    T x = g.New(kN, DT::kF32, true);
    g.SetSaving(false);
    T y = block(x);
    g.SetSaving(true);
    g.RecordCheckpoint(x, y, block);
    T loss = step::MeanRows(g, y, kN);
    g.Drop(y);
    g.SetPhase(StepPhase::kBackward);
    g.Backward(loss);
    REQUIRE_FALSE(g.stale());
    return g.peaks()[backward];
  };
  // The peak is in the recompute, which stops when the second silu saves z (Note [The recompute
  // stops at the last saved tensor]): v, the scale and the sum are not made again. Activations
  // x, z and u (12 MiB), the loss and its seed (512 bytes each); temporaries the last sum's
  // gradient, kept for the base path's silu, and the scale's, for the adapter's (8 MiB). Were the
  // scale's backward run after the recompute, its 4 MiB would not be there; were the recompute
  // run to the end, v and s would add 8 MiB of activations.
  const StepPhasePeak peak = run(false);
  CHECK(peak.bytes == 20 * kMiB + 1024);
  CHECK(peak.categories[temporaries] == 8 * kMiB);
  CHECK(peak.categories[activations] == 12 * kMiB + 1024);
  CHECK(peak.where == " recompute");
  // z made by the block's own code in the recompute is a temporary, as torch's tracker counts it
  // when the checkpointed function is not a module call; the bytes are the same.
  const StepPhasePeak body = run(true);
  CHECK(body.bytes == peak.bytes);
  CHECK(body.categories[temporaries] == 12 * kMiB);
  CHECK(body.categories[activations] == 8 * kMiB + 1024);
}

// estimator/models/<name>.json with `layers` blocks in each stack, built as memplan.trace builds
// it (from_config: T5 v1.1's lm_head tied to the shared embedding).
ModelInventory T5WithLayers(const std::string& name, int64_t layers) {
  Result<std::string> text = memplan::ReadFileToString(std::string(MEMPLAN_SOURCE_DIR) +
                                                       "/estimator/models/" + name + ".json");
  REQUIRE(text.ok());
  nlohmann::json config = nlohmann::json::parse(*text);
  config["num_layers"] = layers;
  config["num_decoder_layers"] = layers;
  BuildOptions options;
  options.from_config = true;
  Result<ModelInventory> inv = InventoryFromHfConfig(config, name, options);
  REQUIRE_MESSAGE(inv.ok(), inv.status().ToString());
  return std::move(inv).value();
}

TEST_CASE("step model: Transformers' T5ForConditionalGeneration, against its traces") {
  // transformers/<model>/L2/.../a100 of the grid: each phase's traced peak allocated bytes,
  // copied from the grid.
  TrainingSetup s;
  s.precision = Precision::kBf16Mixed;
  s.autocast = true;
  s.micro_batch = 4;
  s.seq_len = 512;
  // t5-v1_1-base/L2/b4s512/bf16-mixed/sdpa/ckpt-none: gated gelu_new, no output scaling, the
  // decoder's EncoderDecoderCache; the loss's backward is the peak.
  const ModelInventory v11 = T5WithLayers("t5-v1_1-base", 2);
  const StepModel none = MustStep(v11, s);
  CHECK(none.peak_phase == StepPhase::kBackward);
  // Every phase exact: the loss with decoder_outputs and sequence_output still the forward's
  // locals (it was 6 MiB low without them).
  CHECK(PhasePeaks(none) == std::array<uint64_t, kStepPhases>{1'716'923'392, 2'111'713'280,
                                                              2'230'727'168, 1'162'801'152});
  // b16s512, ckpt-full: every T5Block of both stacks checkpointed. The cross-attention's zero
  // bias, a leaf made to require grad, goes with its .grad after the decoder's backward (6 MiB
  // more in the optimizer step without that).
  s.checkpointing = Checkpointing::kFull;
  s.micro_batch = 16;
  CHECK(PhasePeaks(MustStep(v11, s)) ==
        std::array<uint64_t, kStepPhases>{1'664'013'312, 3'243'169'792, 3'678'329'344,
                                          1'162'899'456});
  // b2s128/bf16-mixed/eager: the position bias added to the scores; the optimizer step peaks.
  s.checkpointing = Checkpointing::kNone;
  s.flash_attention = false;
  s.micro_batch = 2;
  s.seq_len = 128;
  CHECK(MustStep(v11, s).peak_bytes == 1'162'772'480);
  // t5-large/L2/b2s512/fp32/sdpa: ReLU, the decoder's output scaled by d_model**-0.5.
  TrainingSetup f;
  f.precision = Precision::kFp32;
  f.micro_batch = 2;
  f.seq_len = 512;
  CHECK(MustStep(T5WithLayers("t5-large", 2), f).peak_bytes == 2'009'312'256);
}

TEST_CASE("step model: Transformers DeepSeek-V2 (MLA, MoE with shared experts), against traces") {
  // transformers/deepseek-v2-lite/L2/.../sdpa/.../adamw/a100 of the grid: each phase's traced
  // peak allocated bytes, copied from the grid. Layer 0 is dense (first_k_dense_replace), layer
  // 1 a MoE; the attention's query/key heads (192) are wider than its value heads (128), so
  // SDPA runs the memory-efficient kernel.
  const ModelInventory deepseek = WithLayers("deepseek-v2-lite", 2);
  TrainingSetup s;
  s.precision = Precision::kBf16Mixed;
  s.autocast = true;
  s.micro_batch = 1;
  s.seq_len = 1024;
  s.checkpointing = Checkpointing::kFull;
  // b1s1024/bf16-mixed/ckpt-full: the optimizer step is the peak.
  const StepModel full = MustStep(deepseek, s);
  CHECK(full.peak_phase == StepPhase::kOptimizerStep);
  CHECK(PhasePeaks(full) == std::array<uint64_t, kStepPhases>{13'931'938'816, 14'770'809'344,
                                                              17'381'525'504, 21'714'240'512});
  // b2s512/bf16/ckpt-none: DynamicCache keeps the latent and the rotary key of each layer; the
  // router's fp32 copies of its input and weight are saved by its Linear. The backward and the
  // optimizer step are exact; the forward and the loss are 512 KiB short (docs/accuracy.md).
  TrainingSetup b;
  b.precision = Precision::kBf16Pure;
  b.micro_batch = 2;
  b.seq_len = 512;
  const StepModel none = MustStep(deepseek, b);
  CHECK(none.peak_bytes == 10'861'388'800);
  CHECK(none.phases[2].bytes == 8'695'031'808);
  CHECK(std::abs(Error(none.phases[0].bytes, 7'114'794'496)) < 0.0001);
  CHECK(std::abs(Error(none.phases[1].bytes, 7'953'673'216)) < 0.0001);
}

TEST_CASE(
    "step model: Transformers DeepSeek-V3 (its rotation and sigmoid router), against traces") {
  // transformers/deepseek-v3/L4/...: three dense layers (first_k_dense_replace) and one MoE layer
  // of 256 experts in 8 groups, the query through q_lora_rank (Note [DeepSeek-V3 in the step
  // model]). Each phase's traced peak allocated bytes, copied from the grid.
  const ModelInventory v3 = WithLayers("deepseek-v3", 4);
  TrainingSetup s;
  s.precision = Precision::kBf16Mixed;
  s.autocast = true;
  s.micro_batch = 1;
  s.seq_len = 512;
  const StepModel full = MustStep(v3, s);
  CHECK(full.peak_phase == StepPhase::kOptimizerStep);
  CHECK(full.peak_bytes == 302'230'267'904);
  // LoRA on q_b_proj and kv_b_proj with checkpointing: the activations decide the peak, in
  // backward; each phase within 0.01% (a few KiB of the router's selection).
  s.checkpointing = Checkpointing::kFull;
  s.lora_rank = 16;
  s.lora_targets = {"q_b_proj", "kv_b_proj"};
  const StepModel lora = MustStep(v3, s);
  CHECK(lora.peak_phase == StepPhase::kBackward);
  const std::array<uint64_t, kStepPhases> traced{62'587'842'560, 63'110'039'040, 63'220'134'912,
                                                 60'528'957'440};
  for (size_t p = 0; p < traced.size(); ++p) {
    CHECK(std::abs(Error(lora.phases[p].bytes, traced[p])) < 0.0001);
  }
  // Without norm_topk_prob the in-place division and what it keeps (the divisor and the clone of
  // the weights: 512 tokens x 8 experts in bf16, 512 fp32 sums) are gone from the MoE layer.
  ModelInventory unnormed = v3;
  unnormed.arch->norm_topk_prob = false;
  s.checkpointing = Checkpointing::kNone;
  const StepModel a = MustStep(v3, s);
  const StepModel b = MustStep(unnormed, s);
  CHECK(a.phases[0].bytes - b.phases[0].bytes == 512 * 8 * 2 + 512 * 4);
}

TEST_CASE(
    "step model: Transformers gpt-oss (sinks, alternating masks, biased MoE), against traces") {
  // transformers/gpt-oss-20b/L2/b1s512/fp32/eager/ckpt-none/loss-full/adamw/a100 of the grid:
  // each phase's traced peak allocated bytes, copied from the grid, all four exact. Layer 0 is a
  // sliding-window layer, layer 1 a full one (layer_types cut to the two layers as the tracer
  // does); the foreach AdamW's sqrt(v) of the decayed group peaks.
  nlohmann::json config = nlohmann::json::parse(memplan::testing::ReadFixture("gpt-oss-20b"));
  config["num_hidden_layers"] = 2;
  config["layer_types"] = {"sliding_attention", "full_attention"};
  const ModelInventory oss = memplan::testing::MustBuild(config);
  TrainingSetup s;
  s.precision = Precision::kFp32;
  s.micro_batch = 1;
  s.seq_len = 512;
  s.flash_attention = false;
  const StepModel m = MustStep(oss, s);
  CHECK(m.peak_phase == StepPhase::kOptimizerStep);
  CHECK(PhasePeaks(m) == std::array<uint64_t, kStepPhases>{34'795'884'544, 35'207'718'400,
                                                           44'888'739'840, 56'099'082'240});
}

TEST_CASE("step model: an activation it does not run is said, not hidden") {
  nlohmann::json config = nlohmann::json::parse(memplan::testing::ReadFixture("llama-3.2-1b"));
  config["num_hidden_layers"] = 2;
  TrainingSetup s;
  s.seq_len = 512;
  auto said = [&](const char* act) {
    config["hidden_act"] = act;
    Result<MemoryEstimate> m = EstimateMemory(memplan::testing::MustBuild(config), s);
    REQUIRE(m.ok());
    REQUIRE(m->step.has_value());
    for (const std::string& note : m->step->notes) {
      if (note.find("is run as GELU") != std::string::npos) return true;
    }
    return false;
  };
  CHECK(said("mish"));
  CHECK_FALSE(said("silu"));
  CHECK_FALSE(said("relu2"));
  CHECK_FALSE(said("gelu"));
}

TEST_CASE("step model: a family without SDPA in Transformers runs eager attention") {
  // Gemma-2 refuses SDPA (_supports_sdpa = False) and GPT-J has no SDPA path: what Transformers
  // runs by default is eager, score matrices included, whatever --flash-attention says.
  TrainingSetup s;
  s.seq_len = 1024;
  const ModelInventory models[] = {
      WithLayers("gemma-2-2b", 2),
      memplan::testing::MustBuild(SourceConfig("tests/oracle/modern_configs/gpt-j-6b.json", 2))};
  for (const ModelInventory& m : models) {
    INFO(m.model_type);
    s.flash_attention = true;
    Result<MemoryEstimate> flash = EstimateMemory(m, s);
    s.flash_attention = false;
    Result<MemoryEstimate> eager = EstimateMemory(m, s);
    REQUIRE(flash.ok());
    REQUIRE(eager.ok());
    REQUIRE(flash->step.has_value());
    for (size_t p = 0; p < kStepPhases; ++p) {
      CHECK(flash->step->phases[p].bytes == eager->step->phases[p].bytes);
    }
    bool said = false;
    for (const std::string& note : flash->step->notes) {
      said = said || note.find("has no SDPA path in Transformers") != std::string::npos;
    }
    CHECK(said);
  }
  // Llama's SDPA keeps no score matrices: less than its eager attention.
  const ModelInventory llama = WithLayers("llama-3.2-1b", 2);
  s.flash_attention = true;
  Result<MemoryEstimate> sdpa = EstimateMemory(llama, s);
  s.flash_attention = false;
  Result<MemoryEstimate> eager = EstimateMemory(llama, s);
  REQUIRE(sdpa.ok());
  REQUIRE(eager.ok());
  const auto forward = static_cast<size_t>(StepPhase::kForward);
  CHECK(sdpa->step->phases[forward].bytes < eager->step->phases[forward].bytes);
}

TEST_CASE("step model: what it does not run is refused as unmodelled, not run as another setup") {
  const ModelInventory llama = WithLayers("llama-3.2-1b", 2);
  TrainingSetup s;
  s.seq_len = 512;
  for (Checkpointing c : {Checkpointing::kSelective, Checkpointing::kOp}) {
    s.checkpointing = c;
    Result<MemoryEstimate> m = EstimateMemory(llama, s);
    REQUIRE(m.ok());
    CHECK_FALSE(m->step.has_value());
    CHECK(m->step_unmodelled);
  }
  // bitsandbytes' QLoRA (Transformers + PEFT, LitGPT) is not run as a frozen bf16 Linear.
  s.checkpointing = Checkpointing::kNone;
  s.lora_rank = 8;
  s.qlora = true;
  Result<MemoryEstimate> bnb = EstimateMemory(llama, s);
  REQUIRE(bnb.ok());
  CHECK(bnb->step_unmodelled);
  CHECK(bnb->step_error.find("bitsandbytes") != std::string::npos);
  s.lora_rank = 0;
  s.qlora = false;
  // torch.compile runs as the eager code, an upper bound (Note [torch.compile as an upper
  // bound]), and says so.
  Result<MemoryEstimate> eager = EstimateMemory(llama, s);
  REQUIRE(eager.ok());
  REQUIRE(eager->step.has_value());
  s.torch_compile = true;
  Result<MemoryEstimate> compiled = EstimateMemory(llama, s);
  REQUIRE(compiled.ok());
  REQUIRE(compiled->step.has_value());
  CHECK(compiled->step->peak_bytes == eager->step->peak_bytes);
  CHECK(compiled->peak.gpu_bytes == eager->peak.gpu_bytes);
  bool said = false;
  for (const std::string& note : compiled->step->notes) {
    said = said || note.find("torch.compile: run as the eager code, an upper bound") == 0;
  }
  CHECK(said);
  s.torch_compile = false;
  // An encoder with a head the step model does not run: question answering, a one-label
  // sequence classifier (a regression), or the masked LM with BERT's next-sentence head and
  // pooler. A classifier of two labels runs.
  nlohmann::json bert_config =
      nlohmann::json::parse(memplan::testing::ReadFixture("bert-base-uncased"));
  bert_config["num_hidden_layers"] = 2;
  TrainingSetup b;
  b.seq_len = 128;
  bert_config["architectures"] = {"BertForSequenceClassification"};
  bert_config["id2label"] = {{"0", "NEGATIVE"}, {"1", "POSITIVE"}};
  Result<MemoryEstimate> two = EstimateMemory(memplan::testing::MustBuild(bert_config), b);
  REQUIRE(two.ok());
  CHECK(two->step.has_value());
  bert_config["id2label"] = {{"0", "SCORE"}};
  Result<MemoryEstimate> one = EstimateMemory(memplan::testing::MustBuild(bert_config), b);
  REQUIRE(one.ok());
  CHECK(one->step_unmodelled);
  CHECK(one->step_error.find("one-label classifier") != std::string::npos);
  bert_config.erase("id2label");
  bert_config["architectures"] = {"BertForQuestionAnswering"};
  Result<MemoryEstimate> enc = EstimateMemory(memplan::testing::MustBuild(bert_config), b);
  REQUIRE(enc.ok());
  CHECK(enc->step_unmodelled);
  bert_config["architectures"] = {"BertForPreTraining"};
  Result<MemoryEstimate> nsp = EstimateMemory(memplan::testing::MustBuild(bert_config), b);
  REQUIRE(nsp.ok());
  CHECK(nsp->step_unmodelled);
  CHECK(nsp->step_error.find("pooler or a classifier") != std::string::npos);
  // DeepSeek-V2's group-limited routing (the full model's) is not run as V2-Lite's greedy one.
  nlohmann::json deepseek_config =
      nlohmann::json::parse(memplan::testing::ReadFixture("deepseek-v2-lite"));
  deepseek_config["num_hidden_layers"] = 2;
  Result<MemoryEstimate> greedy = EstimateMemory(memplan::testing::MustBuild(deepseek_config), b);
  REQUIRE(greedy.ok());
  CHECK_FALSE(greedy->step_unmodelled);
  deepseek_config["topk_method"] = "group_limited_greedy";
  Result<MemoryEstimate> grouped = EstimateMemory(memplan::testing::MustBuild(deepseek_config), b);
  REQUIRE(grouped.ok());
  CHECK(grouped->step_unmodelled);
  // OLMoE's clip_qkv clamps the query, key and value in place, and each ClampBackward keeps a
  // clone of what it clamped: 3 x 128 tokens x 2048 bf16 values more saved per layer.
  nlohmann::json olmoe_config = SourceConfig("tests/oracle/modern_configs/olmoe-1b-7b.json", 2);
  Result<MemoryEstimate> unclipped = EstimateMemory(memplan::testing::MustBuild(olmoe_config), b);
  REQUIRE(unclipped.ok());
  CHECK(unclipped->step.has_value());
  olmoe_config["clip_qkv"] = 8.0;
  Result<MemoryEstimate> clipped_olmoe =
      EstimateMemory(memplan::testing::MustBuild(olmoe_config), b);
  REQUIRE(clipped_olmoe.ok());
  REQUIRE(clipped_olmoe->step.has_value());
  const auto forward = static_cast<size_t>(StepPhase::kForward);
  CHECK(clipped_olmoe->step->phases[forward].bytes ==
        unclipped->step->phases[forward].bytes + 2 * 3 * 128 * 2048 * 2);
  // llm-foundry runs MPT only; an MPT with rotary embeddings instead of ALiBi is not run as
  // ALiBi; Llama under llm-foundry is refused.
  TrainingSetup f;
  f.framework = Framework::kLlmFoundry;
  f.seq_len = 512;
  Result<MemoryEstimate> other = EstimateMemory(llama, f);
  REQUIRE(other.ok());
  CHECK(other->step_unmodelled);
  CHECK(other->step_error.find("MPT") != std::string::npos);
  nlohmann::json rope = nlohmann::json::parse(R"({"architectures": ["MPTForCausalLM"],
      "model_type": "mpt", "d_model": 256, "n_heads": 4, "n_layers": 2, "vocab_size": 1000,
      "attn_config": {"alibi": false, "rope": true, "attn_impl": "torch"}})");
  Result<MemoryEstimate> roped = EstimateMemory(memplan::testing::MustBuild(rope), f);
  REQUIRE(roped.ok());
  CHECK(roped->step_unmodelled);
  CHECK(roped->step_error.find("rope") != std::string::npos);
  // llm-foundry's default attention is flash_attn's, and a plain LayerNorm under autocast is
  // another norm: neither is run as the torch attention with LPLayerNorm.
  rope["attn_config"] = {{"alibi", true}};
  Result<MemoryEstimate> flash = EstimateMemory(memplan::testing::MustBuild(rope), f);
  REQUIRE(flash.ok());
  CHECK(flash->step_unmodelled);
  CHECK(flash->step_error.find("'flash', the default") != std::string::npos);
  rope["attn_config"]["attn_impl"] = "torch";
  rope["norm_type"] = "layernorm";
  f.precision = Precision::kBf16Mixed;
  f.autocast = true;
  Result<MemoryEstimate> plain = EstimateMemory(memplan::testing::MustBuild(rope), f);
  REQUIRE(plain.ok());
  CHECK(plain->step_unmodelled);
  CHECK(plain->step_error.find("norm_type 'layernorm'") != std::string::npos);
  // Options that add ops without tensors are named, not dropped.
  rope["norm_type"] = "low_precision_layernorm";
  rope["attn_config"]["clip_qkv"] = 8;
  rope["final_logit_softcapping"] = 30.0;
  Result<MemoryEstimate> clipped = EstimateMemory(memplan::testing::MustBuild(rope), f);
  REQUIRE(clipped.ok());
  CHECK(clipped->step_unmodelled);
  CHECK(clipped->step_error.find("clip_qkv, final_logit_softcapping") != std::string::npos);
  // Under Transformers an MPT is refused, with or without ALiBi.
  rope.erase("final_logit_softcapping");
  rope["attn_config"] = {{"alibi", false}, {"attn_impl", "torch"}};
  Result<MemoryEstimate> hf = EstimateMemory(memplan::testing::MustBuild(rope), b);
  REQUIRE(hf.ok());
  CHECK(hf->step_unmodelled);
}

}  // namespace
}  // namespace memplan::estimator
