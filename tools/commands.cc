#include "tools/commands.h"

#include <algorithm>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <unistd.h>

#include "common/file.h"
#include "common/printable.h"
#include "estimator/builtin_models.h"
#include "estimator/deepspeed_config.h"
#include "estimator/estimate.h"
#include "estimator/hf_config.h"
#include "estimator/model_source.h"
#include "estimator/training_setup.h"
#include "planner/engine_model.h"
#include "schedule/schedule.h"
#include "common/json.h"
#include "tools/setup_flags.h"

namespace memplan::tools {
namespace {

using estimator::ModelClassChoice;

// Options shared by the subcommands that describe a model (estimate, inventory).
struct ModelOptions {
  ModelFlags model;
  std::string format = "text";
  std::string output;  // empty: stdout

  void Add(CLI::App* cmd) {
    model.Add(cmd,
              "A built-in model name (see `memplan models`), a config.json, a tensor-shape "
              "list (.json), a .safetensors file, a model.safetensors.index.json, a "
              "directory holding one of these (a Hugging Face cache folder models--org--name "
              "too), or a Hugging Face repo id (org/name): from the local hub cache, else "
              "fetched from the Hub (config.json, or safetensors headers) unless --offline",
              true);
    AddFormatOption(cmd, &format, "Output format: text (for people) or json (for scripts)");
    cmd->add_option("-o,--output", output,
                    "Write the output to this file (atomically: temp file + rename; a new file "
                    "or a regular one, whose mode is kept) instead of stdout");
  }

  Result<estimator::ModelInventory> Load() const { return model.Load(); }
};

// Sends `text` to stdout or to the --output file.
void Emit(const ModelOptions& options, std::string text, Outcome* outcome) {
  EmitReport(options.output, std::move(text), outcome);
}

}  // namespace

void ModelSourceFlags::Add(CLI::App* cmd) {
  cmd->add_flag("--offline", offline,
                "Never use the network: a repo id must be in the local Hugging Face cache (as "
                "HF_HUB_OFFLINE=1)");
  cmd->add_option("--model-config", model_config,
                  "A config.json giving the architecture of a tensor-shape list or safetensors "
                  "headers (hidden size, layers, heads, ...), so that activations and plans work "
                  "for any model");
  cmd->add_option("--expert-layout", expert_layout,
                  "MoE weights: fused (one 3-D tensor per layer's experts, as Transformers >= 5 "
                  "builds them; DeepSpeed's largest layer is then all of a layer's experts) or "
                  "per-expert (one Linear per expert, as checkpoints and Transformers 4 hold "
                  "them)")
      ->check(CLI::IsMember({"fused", "per-expert"}))
      ->capture_default_str();
}

void ModelFlags::Add(CLI::App* cmd, const std::string& model_help, bool required) {
  CLI::Option* option = cmd->add_option("-m,--model", spec, model_help);
  if (required) option->required();
  cmd->add_option("--model-class", model_class,
                  "auto: the class in config.json's `architectures` (task head included, tied "
                  "head counted once); base: what AutoModel builds, no task head (as in "
                  "DeepSpeed's and Accelerate's examples)")
      ->check(CLI::IsMember({"auto", "base"}))
      ->capture_default_str();
  source.Add(cmd);
}

ModelClassChoice ModelFlags::Choice() const {
  return model_class == "base" ? ModelClassChoice::kBase : ModelClassChoice::kFromArchitectures;
}

Result<estimator::ModelInventory> ModelFlags::Load() const {
  return LoadModelForCli(spec, Choice(), source);
}

Result<estimator::ModelInventory> ModelFlags::LoadArchitecture(std::string_view purpose) const {
  auto inventory = Load();
  if (inventory.ok() && !inventory->arch) {
    return Status::InvalidArgument(spec + ": " + std::string(purpose) +
                                   " needs the architecture (a config.json or built-in model), "
                                   "not a tensor-shape list or safetensors header");
  }
  return inventory;
}

Result<estimator::ModelInventory> LoadModelForCli(const std::string& spec,
                                                  estimator::ModelClassChoice choice,
                                                  const ModelSourceFlags& flags) {
  estimator::LoadOptions load;
  load.build.choice = choice;
  load.build.experts = flags.expert_layout == "per-expert" ? estimator::ExpertLayout::kPerExpert
                                                           : estimator::ExpertLayout::kFused;
  load.model_config = flags.model_config;
  load.hub = estimator::HubOptionsFromEnvironment();
  if (flags.offline) {
    load.hub.allow_network = false;
    load.hub.offline_reason = "--offline";
  }
  load.hub.progress = [](const estimator::HubProgress& p) {
    const std::string line =
        "memplan: fetching " + Printable(p.repo_id) + " " + Printable(p.file) + " from " +
        Printable(p.url.substr(0, p.url.find("/", p.url.find("://") + 3))) + "\n";
    [[maybe_unused]] ssize_t ignored = ::write(STDERR_FILENO, line.data(), line.size());
  };
  return estimator::LoadModel(spec, load);
}

namespace {

// `memplan estimate --inference [--context N] [--batch B] [--kv-dtype D] [--encoder-context M]`:
// any of the others implies the first.
struct InferenceFlags {
  bool inference = false;
  int64_t context = 4096;
  int64_t batch = 1;
  std::string kv_dtype;
  int64_t encoder_context = 0;
  CLI::Option* context_option = nullptr;
  CLI::Option* batch_option = nullptr;
  CLI::Option* kv_dtype_option = nullptr;
  CLI::Option* encoder_context_option = nullptr;

  void Add(CLI::App* cmd) {
    const char* group = "Inference (accelerate estimate-memory's table and the KV cache)";
    cmd->add_flag("--inference", inference,
                  "The weights per dtype and largest layer as `accelerate estimate-memory` prints "
                  "them, what NF4 (bitsandbytes) and GPTQ int4 hold tensor by tensor, and the KV "
                  "cache of generating --batch sequences of --context tokens")
        ->group(group);
    context_option = cmd->add_option("--context", context,
                                     "Tokens per sequence held in the KV cache (prompt + output)")
                         ->check(CLI::Range(int64_t{1}, int64_t{1} << 40))
                         ->capture_default_str()
                         ->group(group);
    batch_option = cmd->add_option("--batch", batch, "Sequences generated at once")
                       ->check(CLI::Range(int64_t{1}, int64_t{1} << 30))
                       ->capture_default_str()
                       ->group(group);
    kv_dtype_option = cmd->add_option("--kv-dtype", kv_dtype,
                                      "KV cache dtype (bf16, fp16, fp32, fp8, ...); default: the "
                                      "weights' dtype from the config")
                          ->group(group);
    encoder_context_option =
        cmd->add_option("--encoder-context", encoder_context,
                        "Encoder-decoder models (T5): encoder tokens, whose keys and values each "
                        "decoder layer's cross-attention caches; --context is then the decoder's "
                        "(default: the same as --context)")
            ->check(CLI::Range(int64_t{1}, int64_t{1} << 40))
            ->group(group);
  }
  bool Any() const {
    return inference || context_option->count() > 0 || batch_option->count() > 0 ||
           kv_dtype_option->count() > 0 || encoder_context_option->count() > 0;
  }
  estimator::InferenceSetup Setup() const {
    estimator::InferenceSetup setup;
    setup.batch = batch;
    setup.context = context;
    setup.kv_dtype = kv_dtype;
    setup.encoder_context = encoder_context;
    return setup;
  }
};

// The training-setup flags of `memplan estimate` (issue 3's spelling, which `plan` shares). Any of
// them, or --deepspeed, turns on the memory model's breakdown and comparison tables.
struct SetupOptions {
  std::string precision = "bf16-mixed";
  std::string optimizer = "adamw";
  int zero_stage = 0;
  std::string fsdp = "none";
  std::string offload_optimizer = "none";
  std::string offload_param = "none";
  std::string checkpointing = "none";
  SharedSetupFlags shared;  // --flash-attention/--no-flash-attention, --foreach, ...
  int64_t lora_rank = 0;
  std::vector<std::string> lora_targets;
  bool qlora = false;
  bool double_quant = false;
  int64_t micro_batch = 1;
  int64_t seq_len = 0;
  int64_t grad_accum = 1;
  int64_t tp = 1;
  std::string deepspeed;
  double cuda_context_mib = 1343;
  // Each setup flag with the TrainingSetup field it sets (ApplyDeepSpeedConfig's `supplied`).
  std::vector<std::pair<CLI::Option*, std::string>> flags;
  CLI::Option* deepspeed_flag = nullptr;

  void Add(CLI::App* cmd) {
    auto add = [&](CLI::Option* o, const char* field) {
      o->group("Training setup");
      flags.emplace_back(o, field);
    };
    add(cmd->add_option("--precision", precision, "fp32 | fp16-mixed | bf16-mixed | bf16-pure")
            ->check(CLI::IsMember({"fp32", "fp16-mixed", "bf16-mixed", "bf16-pure"}))
            ->capture_default_str(),
        "precision");
    add(cmd->add_option("--optimizer", optimizer, "adamw | adam8bit | sgd | lion | adafactor")
            ->check(CLI::IsMember({"adamw", "adam8bit", "sgd", "lion", "adafactor"}))
            ->capture_default_str(),
        "optimizer");
    add(cmd->add_option("--zero-stage", zero_stage, "DeepSpeed ZeRO stage 0, 1, 2 or 3")
            ->check(CLI::Range(0, 3))
            ->capture_default_str(),
        "zero_stage");
    add(cmd->add_option("--fsdp", fsdp,
                        "PyTorch FSDP instead of DeepSpeed: full_shard | shard_grad_op | no_shard "
                        "(--offload-param cpu: FSDP's CPU offload)")
            ->check(CLI::IsMember({"none", "full_shard", "shard_grad_op", "no_shard", "FULL_SHARD",
                                   "SHARD_GRAD_OP", "NO_SHARD"}))
            ->capture_default_str(),
        "fsdp");
    add(cmd->add_option("--offload-optimizer", offload_optimizer,
                        "none | cpu | nvme (nvme needs stage 3)")
            ->check(CLI::IsMember({"none", "cpu", "nvme"}))
            ->capture_default_str(),
        "offload_optimizer");
    add(cmd->add_option("--offload-param", offload_param, "none | cpu | nvme (stage 3 only)")
            ->check(CLI::IsMember({"none", "cpu", "nvme"}))
            ->capture_default_str(),
        "offload_param");
    add(cmd->add_option("--checkpointing", checkpointing,
                        "Activation checkpointing: none | selective (Megatron's: the attention "
                        "core recomputed) | full (each block keeps its input; with "
                        "--checkpoint-every K every K-th block) | op (torchtitan's op-level "
                        "selective AC)")
            ->check(CLI::IsMember({"none", "selective", "full", "op"}))
            ->capture_default_str(),
        "checkpointing");
    shared.Add(cmd, "Training setup");
    for (const auto& option : shared.options) flags.push_back(option);
    add(cmd->add_option("--lora-rank", lora_rank, "LoRA rank; only the adapters train")
            ->check(CLI::Range(int64_t{1}, int64_t{65536})),
        "lora_rank");
    add(cmd->add_option("--lora-targets", lora_targets,
                        "Comma-separated module names (q_proj,v_proj) or all-linear; default: "
                        "PEFT's for the model type")
            ->delimiter(','),
        "lora_targets");
    add(cmd->add_flag("--qlora", qlora, "Frozen base Linears in NF4 (needs --lora-rank)"), "qlora");
    add(cmd->add_flag("--double-quant", double_quant, "QLoRA double quantisation (4.127 bits)"),
        "double_quant");
    add(cmd->add_option("--micro-batch", micro_batch, "Sequences per GPU per forward pass")
            ->check(CLI::Range(int64_t{1}, int64_t{1} << 24))
            ->capture_default_str(),
        "micro_batch");
    add(cmd->add_option("--seq-len", seq_len,
                        "Tokens per sequence (default: the model's positions, at most 2048)")
            ->check(CLI::Range(int64_t{1}, int64_t{1} << 24)),
        "seq_len");
    add(cmd->add_option("--grad-accum", grad_accum, "Gradient accumulation steps")
            ->check(CLI::Range(int64_t{1}, int64_t{1} << 24))
            ->capture_default_str(),
        "grad_accum");
    add(cmd->add_option("--tp", tp, "Tensor-parallel degree (divides heads and GPUs)")
            ->check(CLI::Range(int64_t{1}, int64_t{1} << 20))
            ->capture_default_str(),
        "tp");
    add(cmd->add_option("--cuda-context-mib", cuda_context_mib,
                        "CUDA context per GPU in MiB (1343 measured on a V100)")
            ->check(CLI::Range(0.0, 1048576.0))
            ->capture_default_str(),
        "cuda_context_bytes");
    deepspeed_flag = cmd->add_option("--deepspeed", deepspeed,
                                     "A DeepSpeed config (ds_config.json) whose settings to use; "
                                     "flags given as well override it")
                         ->group("Training setup");
  }

  bool Given(const std::string& field) const {
    for (const auto& [option, name] : flags) {
      if (name == field && option->count() > 0) return true;
    }
    return false;
  }
  bool Any() const {
    for (const auto& [option, name] : flags) {
      if (option->count() > 0) return true;
    }
    return deepspeed_flag->count() > 0;
  }

  // The setup: defaults, then --deepspeed's settings, then the flags given.
  Result<estimator::TrainingSetup> Build(const estimator::ModelInventory& inventory,
                                         const estimator::DeepSpeedHardware& hardware) const {
    estimator::TrainingSetup s;
    s.gpus_per_node = hardware.gpus_per_node;
    s.num_nodes = hardware.nodes;
    std::set<std::string> supplied;
    for (const auto& [option, name] : flags) {
      if (option->count() > 0) supplied.insert(name);
    }
    if (!deepspeed.empty()) {
      MEMPLAN_ASSIGN_OR_RETURN(std::string text, ReadFileToString(deepspeed, uint64_t{1} << 24));
      MEMPLAN_ASSIGN_OR_RETURN(nlohmann::json config, ParseJson(text, deepspeed));
      // Apply the flags first, so that "auto" keys take their values.
      MEMPLAN_RETURN_IF_ERROR(ApplyFlags(&s, /*only_given=*/true));
      const int64_t hidden = inventory.arch.has_value() ? inventory.arch->hidden : 0;
      MEMPLAN_RETURN_IF_ERROR(
          estimator::ApplyDeepSpeedConfig(config, deepspeed, supplied, hidden, &s));
    }
    MEMPLAN_RETURN_IF_ERROR(ApplyFlags(&s, /*only_given=*/!deepspeed.empty()));
    return s;
  }

  Status ApplyFlags(estimator::TrainingSetup* s, bool only_given) const {
    auto use = [&](const char* field) { return !only_given || Given(field); };
    if (use("precision")) {
      MEMPLAN_ASSIGN_OR_RETURN(s->precision, estimator::ParsePrecision(precision));
    }
    if (use("optimizer")) {
      MEMPLAN_ASSIGN_OR_RETURN(s->optimizer, estimator::ParseOptimizer(optimizer));
    }
    if (use("zero_stage")) s->zero_stage = zero_stage;
    if (use("fsdp")) {
      MEMPLAN_ASSIGN_OR_RETURN(s->fsdp, estimator::ParseFsdpSharding(fsdp));
    }
    if (use("offload_optimizer")) {
      MEMPLAN_ASSIGN_OR_RETURN(s->offload_optimizer,
                               estimator::ParseOffloadDevice(offload_optimizer));
    }
    if (use("offload_param")) {
      MEMPLAN_ASSIGN_OR_RETURN(s->offload_param, estimator::ParseOffloadDevice(offload_param));
    }
    if (use("checkpointing")) {
      MEMPLAN_ASSIGN_OR_RETURN(s->checkpointing, estimator::ParseCheckpointing(checkpointing));
    }
    shared.Apply(s, only_given);
    if (use("lora_rank")) s->lora_rank = lora_rank;
    if (use("lora_targets")) s->lora_targets = lora_targets;
    if (use("qlora")) s->qlora = qlora;
    if (use("double_quant")) s->double_quant = double_quant;
    if (use("micro_batch")) s->micro_batch = micro_batch;
    if (use("seq_len")) s->seq_len = seq_len;
    if (use("grad_accum")) s->grad_accum = grad_accum;
    if (use("tp")) s->tp = tp;
    if (use("cuda_context_bytes")) {
      s->cuda_context_bytes = static_cast<int64_t>(cuda_context_mib * 1048576.0);
    }
    return Status::Ok();
  }
};

}  // namespace

void EmitReport(const std::string& output, std::string text, Outcome* outcome) {
  if (output.empty()) {
    outcome->stdout_text = std::move(text);
  } else {
    outcome->files.push_back({output, std::move(text)});
  }
}

CLI::Option* AddFormatOption(CLI::App* cmd, std::string* format, const std::string& help) {
  return cmd->add_option("--format", *format, help)
      ->check(CLI::IsMember({"text", "json"}))
      ->capture_default_str();
}

void Fail(Outcome* outcome, const Status& status, FieldFlags overrides) {
  outcome->exit_code = status.code() == StatusCode::kInternal ? kExitInternal : kExitBadInput;
  outcome->error = FieldsToFlags(status.message(), overrides);
}

void RegisterEstimate(CLI::App& app, Outcome* outcome) {
  auto options = std::make_shared<ModelOptions>();
  auto hardware = std::make_shared<estimator::DeepSpeedHardware>();
  auto setup = std::make_shared<SetupOptions>();
  CLI::App* cmd = app.add_subcommand(
      "estimate",
      "Memory needed to train a model: DeepSpeed's ZeRO-2 and ZeRO-3 model-state tables, "
      "reproduced to the byte, from a config.json alone; with a training setup, every byte per "
      "GPU, CPU, NVMe and pinned memory");
  options->Add(cmd);
  cmd->add_option("-g,--gpus", hardware->gpus_per_node, "GPUs per node")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20))
      ->capture_default_str();
  cmd->add_option("-n,--nodes", hardware->nodes, "Number of nodes")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20))
      ->capture_default_str();
  cmd->add_option("--buffer-factor", hardware->buffer_factor,
                  "DeepSpeed's additional_buffer_factor (multiplies CPU memory)")
      ->check(CLI::Range(0.0, 1000.0))
      ->capture_default_str();
  setup->Add(cmd);
  auto inference = std::make_shared<InferenceFlags>();
  inference->Add(cmd);
  auto schedule = std::make_shared<std::string>();
  cmd->add_option("--schedule", *schedule,
                  "Also predict what memplan's offload engine does running this Schedule (from "
                  "`plan --emit-schedule`, or edited): pinned bytes, NVMe bytes per step, peak "
                  "fetched parameter bytes on the GPU, per process of --gpus x --nodes, with "
                  "--grad-accum micro-batches a step (planner/engine_model.h)")
      ->group("Offload engine");
  cmd->footer(
      "\nExamples:\n"
      "  memplan estimate --model llama-2-7b --gpus 4\n"
      "  memplan estimate --model llama-2-7b --gpus 8 --zero-stage 3 --seq-len 4096 "
      "--checkpointing full\n"
      "  memplan estimate --model mistral-7b --lora-rank 16 --qlora --micro-batch 4\n"
      "  memplan estimate --model llama-2-7b --gpus 8 --deepspeed ds_config.json\n"
      "  memplan estimate --model ./config.json --gpus 8 --nodes 2 --format json\n"
      "  memplan estimate --model t5-large --model-class base --gpus 4\n"
      "  memplan estimate --model meta-llama/Llama-3.1-8B --inference --context 8192 --batch 4\n"
      "  memplan estimate --model llama-2-7b --schedule schedule.json\n"
      "\nExit status: 0 on success, 2 on bad input (one line on stderr naming the file and "
      "field).");
  cmd->callback([options, hardware, setup, inference, schedule, outcome] {
    auto inventory = options->Load();
    if (!inventory.ok()) return Fail(outcome, inventory.status());
    // --schedule: read as the engine reads it (defaults, validation), then the engine model.
    std::optional<planner::EnginePrediction> prediction;
    if (!schedule->empty()) {
      auto text = ReadFileToString(*schedule);
      if (!text.ok()) return Fail(outcome, text.status());
      auto doc = ParseJson(*text, *schedule);
      if (!doc.ok()) return Fail(outcome, doc.status());
      auto read = offload::ScheduleFromJson(*doc, *schedule);
      if (!read.ok()) return Fail(outcome, read.status());
      planner::EngineRunOptions run;
      run.world_size = static_cast<int>(hardware->gpus_per_node * hardware->nodes);
      run.micro_batches = static_cast<uint32_t>(std::max<int64_t>(1, setup->grad_accum));
      auto predicted = planner::PredictEngine(*read, *inventory, run);
      if (!predicted.ok()) return Fail(outcome, predicted.status().WithPrefix(*schedule));
      prediction = std::move(*predicted);
    }
    Result<estimator::Estimate> estimate = Status::Internal("unset");
    if (setup->Any()) {
      auto training = setup->Build(*inventory, *hardware);
      if (!training.ok()) return Fail(outcome, training.status());
      estimate = estimator::EstimateTraining(*inventory, *hardware, *training);
    } else {
      estimate = estimator::EstimateModelStates(*inventory, *hardware);
    }
    if (!estimate.ok()) return Fail(outcome, estimate.status());
    if (inference->Any()) {
      Status added = estimator::AddInference(*inventory, inference->Setup(), &*estimate);
      if (!added.ok()) return Fail(outcome, added);
    }
    if (options->format == "json") {
      auto doc = estimator::ToJson(*estimate);
      if (prediction) {
        doc["schedule_prediction"] = nlohmann::json::parse(planner::ToJson(*prediction).dump());
        doc["schedule_prediction"]["path"] = *schedule;
      }
      return Emit(*options, JsonOutput(doc), outcome);
    }
    std::string text = FieldsToFlags(estimator::FormatEstimateText(*estimate));
    if (prediction) text += "\n" + planner::FormatEnginePrediction(*prediction, *schedule);
    Emit(*options, text, outcome);
  });
}

void RegisterInventory(CLI::App& app, Outcome* outcome) {
  auto options = std::make_shared<ModelOptions>();
  CLI::App* cmd = app.add_subcommand(
      "inventory", "Every parameter tensor of a model: name, shape, dtype, module, block, tied-to");
  options->Add(cmd);
  cmd->callback([options, outcome] {
    auto inventory = options->Load();
    if (!inventory.ok()) return Fail(outcome, inventory.status());
    auto counts = estimator::CountParams(*inventory);
    if (!counts.ok()) return Fail(outcome, counts.status());
    Emit(*options,
         options->format == "json" ? JsonOutput(estimator::InventoryToJson(*inventory, *counts))
                                   : estimator::FormatInventoryText(*inventory, *counts),
         outcome);
  });
}

void RegisterModels(CLI::App& app, Outcome* outcome) {
  auto format = std::make_shared<std::string>("text");
  CLI::App* cmd = app.add_subcommand("models", "List the built-in models usable as --model NAME");
  AddFormatOption(cmd, format.get(), "Output format: text or json");
  cmd->callback([format, outcome] {
    nlohmann::json list = nlohmann::json::array();
    std::string text = "Built-in models (use as --model NAME):\n";
    for (const auto& model : estimator::BuiltinModels()) {
      auto inventory = estimator::InventoryFromHfConfigText(
          model.config_json, std::string(model.name), ModelClassChoice::kFromArchitectures);
      if (!inventory.ok()) return Fail(outcome, inventory.status());
      auto counts = estimator::CountParams(*inventory);
      if (!counts.ok()) return Fail(outcome, counts.status());
      list.push_back({{"name", model.name},
                      {"hub_id", model.hub_id},
                      {"model_type", inventory->model_type},
                      {"architecture", inventory->architecture},
                      {"params_total", counts->params_total}});
      char line[256];
      std::snprintf(line, sizeof(line), "  %-18s %-10s %-32s %16s params  %s\n",
                    std::string(model.name).c_str(), inventory->model_type.c_str(),
                    inventory->architecture.c_str(),
                    estimator::WithThousands(counts->params_total).c_str(),
                    std::string(model.hub_id).c_str());
      text += line;
    }
    outcome->stdout_text = *format == "json" ? JsonOutput(list) : text;
  });
}

void RegisterBench(CLI::App& app, Outcome* outcome) {
  CLI::App* bench = app.add_subcommand(
      "bench",
      "Measure this machine: NVMe bandwidth, CPU optimizer (AdamW) throughput, the NVMe "
      "optimizer step");
  bench->require_subcommand(1);
  RegisterBenchNvme(bench, outcome);
  RegisterBenchAdam(bench, outcome);
  RegisterBenchSwap(bench, outcome);
}

}  // namespace memplan::tools
