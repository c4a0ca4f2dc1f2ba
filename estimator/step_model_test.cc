// The step model against a few traces of the real code (memplan.trace on the `trace` branch:
// tests/accuracy/trace_grid.json, development part; the whole grid is checked by
// estimator_trace_accuracy, CTest trace_grid_accuracy, once the grid is on the branch). These
// points run in CI today: one per framework, the traced peak allocated bytes copied from the grid.
#include "estimator/step_model.h"

#include <doctest/doctest.h>

#include <cmath>
#include <string>

#include <nlohmann/json.hpp>

#include "estimator/memory_model.h"
#include "tests/estimator_testing.h"

namespace memplan::estimator {
namespace {

// Built-in config `name` with `layers` blocks, as memplan.trace builds it (--layers).
ModelInventory WithLayers(const std::string& name, int64_t layers) {
  nlohmann::json config = nlohmann::json::parse(memplan::testing::ReadFixture(name));
  config["num_hidden_layers"] = layers;
  return memplan::testing::MustBuild(config);
}

StepModel MustStep(const ModelInventory& inventory, const TrainingSetup& s) {
  Result<MemoryEstimate> m = EstimateMemory(inventory, s);
  REQUIRE_MESSAGE(m.ok(), m.status().ToString());
  REQUIRE_MESSAGE(m->step.has_value(), m->step_error);
  return *m->step;
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
  s.checkpointing = Checkpointing::kNone;
  s.torch_compile = true;
  Result<MemoryEstimate> compiled = EstimateMemory(llama, s);
  REQUIRE(compiled.ok());
  CHECK(compiled->step_unmodelled);
  CHECK(compiled->step_error.find("torch.compile") != std::string::npos);
  // An encoder: not a Transformers decoder LM.
  const ModelInventory bert = memplan::testing::Fixture("bert-base-uncased");
  TrainingSetup b;
  b.seq_len = 128;
  Result<MemoryEstimate> enc = EstimateMemory(bert, b);
  REQUIRE(enc.ok());
  CHECK(enc->step_unmodelled);
}

}  // namespace
}  // namespace memplan::estimator
