// TrainingSetup: bad combinations get clear errors, the JSON form round-trips, and DeepSpeed
// configs are read as DeepSpeed and the Hugging Face Trainer read them.
#include "estimator/training_setup.h"

#include <doctest/doctest.h>

#include <string>

#include "estimator/deepspeed_config.h"
#include "tests/estimator_testing.h"
#include "tests/status_testing.h"

namespace memplan::estimator {
namespace {

void ExpectError(const Status& status, const std::string& needle) {
  REQUIRE_FALSE(status.ok());
  CAPTURE(status.message());
  CHECK(status.message().find(needle) != std::string::npos);
}

TEST_CASE("training setup: the defaults are valid") {
  TrainingSetup s;
  CHECK_OK(s.Validate());
  CHECK_FALSE(s.OverlapComm());
  s.zero_stage = 3;
  CHECK(s.OverlapComm());  // DeepSpeed turns it on for stage 3
}

TEST_CASE("training setup: bad combinations are refused, naming the flag") {
  TrainingSetup s;
  SUBCASE("offload_param without stage 3") {
    s.zero_stage = 2;
    s.offload_param = OffloadDevice::kCpu;
    ExpectError(s.Validate(), "`offload_param` cpu needs `zero_stage` 3");
  }
  SUBCASE("optimizer offload without ZeRO") {
    s.offload_optimizer = OffloadDevice::kCpu;
    ExpectError(s.Validate(), "needs ZeRO");
  }
  SUBCASE("optimizer to NVMe below stage 3") {
    s.zero_stage = 2;
    s.offload_optimizer = OffloadDevice::kNvme;
    ExpectError(s.Validate(), "ZeRO-Infinity");
  }
  SUBCASE("QLoRA without LoRA") {
    s.qlora = true;
    ExpectError(s.Validate(), "`lora_rank`");
  }
  SUBCASE("LoRA with 8-bit Adam on a frozen model") {
    s.lora_rank = 8;
    s.optimizer = Optimizer::kAdam8bit;
    ExpectError(s.Validate(), "adam8bit with LoRA");
  }
  SUBCASE("an optimizer DeepSpeed cannot offload") {
    s.zero_stage = 2;
    s.offload_optimizer = OffloadDevice::kCpu;
    s.optimizer = Optimizer::kSgd;
    ExpectError(s.Validate(), "cannot be offloaded");
  }
  SUBCASE("tp not dividing the GPUs") {
    s.gpus_per_node = 4;
    s.tp = 3;
    ExpectError(s.Validate(), "`tp` 3 does not divide");
  }
  SUBCASE("zero micro-batch") {
    s.micro_batch = 0;
    ExpectError(s.Validate(), "`micro_batch`");
  }
}

TEST_CASE("training setup: checks against the model") {
  ModelInventory llama = memplan::testing::Fixture("llama-2-7b");               // 32 heads
  ModelInventory gpt2 = memplan::testing::MustBuild({{"model_type", "gpt2"}});  // 1024 positions
  TrainingSetup s;
  s.gpus_per_node = 8;
  s.tp = 8;
  CHECK_OK(s.ValidateFor(llama));
  s.gpus_per_node = 6;
  s.tp = 6;
  ExpectError(s.ValidateFor(llama), "must divide the 32 attention heads");
  TrainingSetup t;
  t.seq_len = 2048;
  ExpectError(t.ValidateFor(gpt2), "exceeds the model's 1024 learned positions");
  t.seq_len = 0;
  CHECK(t.SeqLenFor(&*gpt2.arch) == 1024);
  CHECK(t.SeqLenFor(&*llama.arch) == 2048);
  t.lora_rank = 8;
  t.lora_targets = {"q_proj"};
  ExpectError(t.ValidateFor(gpt2), "'q_proj' names no Linear");
  t.lora_targets = {"c_attn", "c_proj"};
  CHECK_OK(t.ValidateFor(gpt2));
}

TEST_CASE("training setup: architecture info comes from the config builders") {
  ModelInventory mixtral = memplan::testing::Fixture("mixtral-8x7b");
  REQUIRE(mixtral.arch.has_value());
  CHECK(mixtral.arch->experts == 8);
  CHECK(mixtral.arch->experts_per_token == 2);
  CHECK(mixtral.arch->kv_heads == 8);
  CHECK(mixtral.arch->MlpKind() == "swiglu");
  ModelInventory bert = memplan::testing::Fixture("bert-base-uncased");
  CHECK(bert.arch->hidden_dropout == doctest::Approx(0.1));
  CHECK(bert.arch->MlpKind() == "gelu");
  CHECK(bert.arch->learned_positions);
  ModelInventory t5 = memplan::testing::Fixture("t5-v1_1-base");
  CHECK(t5.arch->encoder_decoder);
  CHECK(t5.arch->MlpKind() == "geglu");
  ModelInventory gemma = memplan::testing::Fixture("gemma-2b");
  CHECK(gemma.arch->kv_heads == 1);
  CHECK(gemma.arch->head_dim == 256);
}

TEST_CASE("training setup: JSON round trip") {
  TrainingSetup s;
  s.precision = Precision::kFp16Mixed;
  s.optimizer = Optimizer::kLion;
  s.lora_rank = 16;
  s.lora_targets = {"q_proj", "v_proj"};
  s.qlora = true;
  s.double_quant = true;
  s.micro_batch = 4;
  s.seq_len = 4096;
  s.grad_accum = 8;
  s.checkpointing = Checkpointing::kSelective;
  s.flash_attention = true;
  s.zero_stage = 3;
  s.offload_optimizer = OffloadDevice::kNvme;
  s.sub_group_size = 12345;
  s.overlap_comm = false;
  s.gpus_per_node = 8;
  s.tp = 2;
  Result<TrainingSetup> back = TrainingSetupFromJson(ToJson(s));
  REQUIRE_MESSAGE(back.ok(), back.status().ToString());
  CHECK(ToJson(*back) == ToJson(s));
  CHECK(back->precision == Precision::kFp16Mixed);
  CHECK(back->lora_targets == s.lora_targets);
  CHECK_FALSE(back->OverlapComm());
  ExpectError(TrainingSetupFromJson({{"zero_stage", "three"}}).status(), "'zero_stage'");
  ExpectError(TrainingSetupFromJson({{"precision", "fp8"}}).status(), "unknown precision 'fp8'");
  ExpectError(TrainingSetupFromJson({{"bogus", 1}}).status(), "unknown key 'bogus'");
  // nlohmann's get<int> would read 2.5 as 2 and true as 1; a setup field is read strictly.
  ExpectError(TrainingSetupFromJson({{"micro_batch", 2.5}}).status(),
              "setup JSON: 'micro_batch' must be an integer from");
  ExpectError(TrainingSetupFromJson({{"grad_accum", true}}).status(),
              "setup JSON: 'grad_accum' must be an integer from");
  ExpectError(TrainingSetupFromJson({{"micro_bach", 2}}).status(),
              "setup JSON: unknown key 'micro_bach' (did you mean micro_batch?)");
}

TEST_CASE("training setup: frameworks, checkpointing policies, losses, compile and GPU arch") {
  TrainingSetup s;
  s.framework = Framework::kTorchtitan;
  s.checkpointing = Checkpointing::kOp;
  s.loss = Loss::kChunked;
  s.loss_chunks = 16;
  s.torch_compile = true;
  s.gpu_arch = "sm90";
  CHECK_OK(s.Validate());
  CHECK(s.GpuSm() == 90);
  Result<TrainingSetup> back = TrainingSetupFromJson(ToJson(s));
  REQUIRE_MESSAGE(back.ok(), back.status().ToString());
  CHECK(ToJson(*back) == ToJson(s));
  CHECK(ToJson(s)["framework"] == "torchtitan");
  CHECK(ToJson(s)["checkpointing"] == "op");
  CHECK(ToJson(s)["loss"] == "chunked");
  for (const char* name : {"transformers", "litgpt", "torchtune", "torchtitan", "llm-foundry"}) {
    Result<Framework> f = ParseFramework(name);
    REQUIRE_MESSAGE(f.ok(), f.status().ToString());
    CHECK(FrameworkName(*f) == name);
  }
  CHECK(*ParseFramework("lit-gpt") == Framework::kLitGpt);
  for (const char* arch : {"sm80", "SM_90", "8.9", "9.0a", "sm100"}) {
    s.gpu_arch = arch;
    CHECK_OK(s.Validate());
  }
  s.gpu_arch = "8.9";
  CHECK(s.GpuSm() == 89);

  TrainingSetup bad;
  bad.checkpoint_every = 2;  // without full checkpointing
  ExpectError(bad.Validate(), "`checkpoint_every` 2");
  bad.checkpointing = Checkpointing::kFull;
  CHECK_OK(bad.Validate());
  bad.checkpoint_every = 0;
  ExpectError(bad.Validate(), "`checkpoint_every`");
  TrainingSetup chunks;
  chunks.loss_chunks = 8;
  ExpectError(chunks.Validate(), "`loss_chunks` needs `loss` chunked");
  TrainingSetup arch;
  arch.gpu_arch = "a100";
  ExpectError(arch.Validate(), "`gpu_arch` 'a100'");
  ExpectError(TrainingSetupFromJson({{"loss", "focal"}}).status(), "unknown loss 'focal'");
  ExpectError(TrainingSetupFromJson({{"checkpointing", "some"}}).status(), "checkpointing");
}

TEST_CASE("training setup: a DeepSpeed config's settings are read") {
  const nlohmann::json config = nlohmann::json::parse(R"({
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 4,
    "train_batch_size": 64,
    "bf16": {"enabled": true},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
    "zero_optimization": {
      "stage": 3, "overlap_comm": false, "reduce_bucket_size": 2e8,
      "stage3_prefetch_bucket_size": 1.5e7, "stage3_param_persistence_threshold": 1e4,
      "stage3_max_live_parameters": 1e9, "sub_group_size": 1e8,
      "offload_optimizer": {"device": "nvme", "nvme_path": "/local", "pin_memory": true,
                            "buffer_count": 6},
      "offload_param": {"device": "cpu", "buffer_count": 7, "buffer_size": 2e8,
                        "max_in_cpu": 3e8}
    },
    "activation_checkpointing": {"partition_activations": false},
    "aio": {"block_size": 8388608, "queue_depth": 32, "intra_op_parallelism": 4}
  })");
  TrainingSetup s;
  s.gpus_per_node = 8;
  REQUIRE_OK(ApplyDeepSpeedConfig(config, "ds.json", {}, 4096, &s));
  CHECK(s.micro_batch == 2);
  CHECK(s.grad_accum == 4);
  CHECK(s.precision == Precision::kBf16Mixed);
  CHECK(s.optimizer == Optimizer::kAdamW);
  CHECK(s.zero_stage == 3);
  CHECK_FALSE(s.OverlapComm());
  CHECK(s.reduce_bucket_size == 200000000);
  CHECK(s.stage3_prefetch_bucket_size == 15000000);
  CHECK(s.stage3_param_persistence_threshold == 10000);
  CHECK(s.sub_group_size == 100000000);
  CHECK(s.offload_optimizer == OffloadDevice::kNvme);
  CHECK(s.offload_param == OffloadDevice::kCpu);
  CHECK(s.pin_memory);
  CHECK(s.optimizer_buffer_count == 6);
  CHECK(s.param_buffer_count == 7);
  CHECK(s.param_buffer_size == 200000000);
  CHECK(s.param_max_in_cpu == 300000000);
  CHECK(s.checkpointing == Checkpointing::kFull);
  CHECK(s.aio_block_size == 8388608);
  CHECK(s.aio_queue_depth == 32);
  CHECK(s.aio_intra_op_parallelism == 4);
}

TEST_CASE("training setup: DeepSpeed \"auto\" values") {
  const nlohmann::json config = nlohmann::json::parse(R"({
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto", "fp16": {"enabled": "auto"},
    "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
      "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto"}})");
  TrainingSetup s;
  Status missing = ApplyDeepSpeedConfig(config, "ds.json", {}, 4096, &s);
  ExpectError(missing, "ds.json: 'train_micro_batch_size_per_gpu' is \"auto\"");
  CHECK(missing.message().find("pass `micro_batch`") != std::string::npos);
  s.micro_batch = 3;
  Status precision =
      ApplyDeepSpeedConfig(config, "ds.json", {"micro_batch", "grad_accum"}, 4096, &s);
  ExpectError(precision, "'fp16.enabled' is \"auto\"");
  s.precision = Precision::kFp16Mixed;
  REQUIRE(
      ApplyDeepSpeedConfig(config, "ds.json", {"micro_batch", "grad_accum", "precision"}, 4096, &s)
          .ok());
  CHECK(s.micro_batch == 3);
  // The Trainer's fills: h*h, 0.9*h*h, 10*h.
  CHECK(s.reduce_bucket_size == 4096 * 4096);
  CHECK(s.stage3_prefetch_bucket_size == 15099494);
  CHECK(s.stage3_param_persistence_threshold == 40960);
  Status no_hidden =
      ApplyDeepSpeedConfig(config, "ds.json", {"micro_batch", "grad_accum", "precision"}, 0, &s);
  ExpectError(no_hidden, "'zero_optimization.reduce_bucket_size'");
}

TEST_CASE("training setup: DeepSpeed config errors name the key") {
  TrainingSetup s;
  ExpectError(ApplyDeepSpeedConfig({{"zero_optimization", {{"stage", 4}}}}, "ds.json", {}, 0, &s),
              "'zero_optimization.stage'");
  ExpectError(ApplyDeepSpeedConfig({{"fp16", {{"enabled", true}}}, {"bf16", {{"enabled", true}}}},
                                   "ds.json", {}, 0, &s),
              "both true");
  ExpectError(ApplyDeepSpeedConfig(
                  {{"zero_optimization", {{"stage", 2}, {"offload_param", {{"device", "cpu"}}}}}},
                  "ds.json", {}, 0, &s),
              "needs `zero_stage` 3");
  ExpectError(ApplyDeepSpeedConfig({{"train_micro_batch_size_per_gpu", 2},
                                    {"gradient_accumulation_steps", 1},
                                    {"train_batch_size", 5}},
                                   "ds.json", {}, 0, &s),
              "'train_batch_size' is 5");
  ExpectError(
      ApplyDeepSpeedConfig({{"zero_optimization", {{"offload_optimizer", {{"device", "gpu"}}}}}},
                           "ds.json", {}, 0, &s),
      "'zero_optimization.offload_optimizer.device'");
}

TEST_CASE("training setup: Ulysses' sequence_parallel_size divides the batch's world") {
  // DeepSpeedConfig's world_size is the GPUs / sequence_parallel_size, or data_parallel_size
  // (Note [The data-parallel world of the batch] in planner/check.cc): 8 GPUs, SP 2, 4 ranks.
  TrainingSetup s;
  s.gpus_per_node = 8;
  REQUIRE_OK(ApplyDeepSpeedConfig(
      {{"train_batch_size", 16}, {"gradient_accumulation_steps", 2}, {"sequence_parallel_size", 2}},
      "ds.json", {}, 0, &s));
  CHECK(s.micro_batch == 2);  // 16 / (2 x 4), not 16 / (2 x 8)
  s = TrainingSetup{};
  s.gpus_per_node = 8;
  REQUIRE_OK(ApplyDeepSpeedConfig({{"train_batch_size", 8},
                                   {"train_micro_batch_size_per_gpu", 1},
                                   {"gradient_accumulation_steps", 4},
                                   {"sequence_parallel_size", 4},
                                   {"data_parallel_size", 2}},
                                  "ds.json", {}, 0, &s));
  CHECK(s.micro_batch == 1);
  ExpectError(ApplyDeepSpeedConfig({{"train_batch_size", 8},
                                    {"train_micro_batch_size_per_gpu", 1},
                                    {"gradient_accumulation_steps", 1},
                                    {"sequence_parallel_size", 2}},
                                   "ds.json", {}, 0, &s),
              "x 4 data-parallel ranks (sequence_parallel_size 2) = 4");
  ExpectError(ApplyDeepSpeedConfig({{"train_batch_size", 8}, {"sequence_parallel_size", 3}},
                                   "ds.json", {}, 0, &s),
              "'sequence_parallel_size' is 3, which does not divide the 8 GPUs");
}

}  // namespace
}  // namespace memplan::estimator
