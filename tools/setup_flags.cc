#include "tools/setup_flags.h"

namespace memplan::tools {

void SharedSetupFlags::Add(CLI::App* cmd, const std::string& group) {
  estimator::TrainingSetup& v = values;
  auto add = [&](CLI::Option* o, const char* field) {
    o->group(group);
    options.emplace_back(o, field);
  };
  add(cmd->add_flag("--flash-attention,!--no-flash-attention", v.flash_attention,
                    "Memory-efficient attention (SDPA / FlashAttention: no s x s scores kept); on "
                    "by default, --no-flash-attention for eager attention"),
      "flash_attention");
  add(cmd->add_flag("--foreach,!--no-foreach", v.foreach,
                    "PyTorch optimizer step (ZeRO-0): the foreach implementation, PyTorch's "
                    "default on CUDA (one state-sized temporary); --no-foreach for the "
                    "per-tensor loop"),
      "foreach");
  add(cmd->add_flag("--fused-optimizer", v.fused_optimizer,
                    "torch.optim.AdamW(fused=True): an in-place step without temporaries"),
      "fused_optimizer");
  add(cmd->add_option("--sgd-momentum", v.sgd_momentum,
                      "SGD momentum; 0 (PyTorch's default) keeps no momentum buffer")
          ->check(CLI::Range(0.0, 1.0))
          ->capture_default_str(),
      "sgd_momentum");
  add(cmd->add_flag("--sequence-parallel", v.sequence_parallel,
                    "Megatron sequence parallelism with --tp: norm and dropout activations split "
                    "over the tensor-parallel ranks"),
      "sequence_parallel");
  add(cmd->add_flag("--autocast", v.autocast,
                    "Mixed precision through torch.autocast over fp32 parameters (the Hugging "
                    "Face Trainer without DeepSpeed): fp32 gradients, no master copy; ZeRO-0"),
      "autocast");
  add(cmd->add_option("--framework", framework,
                      "The training code, whose ops decide what a step keeps: transformers "
                      "(Transformers + PEFT, Trainer or Accelerate), torchtune, torchtitan, "
                      "litgpt (Lit-GPT / LitGPT under Lightning Fabric) or llm-foundry (MPT "
                      "under Composer)")
          ->check(CLI::IsMember(
              {"transformers", "litgpt", "lit-gpt", "torchtune", "torchtitan", "llm-foundry"}))
          ->capture_default_str(),
      "framework");
  add(cmd->add_option("--checkpoint-every", v.checkpoint_every,
                      "With --checkpointing full: checkpoint every K-th block only (fms-fsdp's "
                      "p = 1/K, torchtitan's selective K, Transformers' every_n_layers)")
          ->check(CLI::Range(int64_t{1}, int64_t{1} << 24))
          ->capture_default_str(),
      "checkpoint_every");
  add(cmd->add_option("--lora-dropout", v.lora_dropout,
                      "Dropout on each LoRA adapter's input (default: the framework's: PEFT and "
                      "torchtune 0, LitGPT 0.05); above 0 every adapted Linear keeps a mask")
          ->check(CLI::Range(0.0, 0.999)),
      "lora_dropout");
  add(cmd->add_option("--loss", loss,
                      "How the loss meets the logits: full (one logits tensor), chunked "
                      "(torchtune's CEWithChunkedOutputLoss, LitGPT's chunked_cross_entropy) or "
                      "fused (Liger's fused linear cross-entropy: no logits kept)")
          ->check(CLI::IsMember({"full", "chunked", "fused"}))
          ->capture_default_str(),
      "loss");
  add(cmd->add_option("--loss-chunks", v.loss_chunks,
                      "With --loss chunked: the number of chunks (default: the framework's, "
                      "torchtune 8, LitGPT 128-token chunks)")
          ->check(CLI::Range(int64_t{1}, int64_t{1} << 24)),
      "loss_chunks");
  add(cmd->add_flag("--compile", v.torch_compile,
                    "torch.compile of the model: estimated as the eager code, an upper bound "
                    "(Inductor saves at most about what eager autograd saves and fuses "
                    "temporaries away)"),
      "torch_compile");
  add(cmd->add_option("--gpu-arch", v.gpu_arch,
                      "The GPU architecture (sm70 V100, sm80 A100, sm86/sm89 RTX, sm90 H100): "
                      "which attention kernel SDPA picks and the cuBLAS workspace")
          ->capture_default_str(),
      "gpu_arch");
  add(cmd->add_option("--torch-version", v.torch_version,
                      "The PyTorch release (MAJOR.MINOR) where its memory behaviour changed: "
                      "before 1.11 softmax keeps its input too; default: a current release"),
      "torch_version");
  add(cmd->add_flag("--gradient-as-bucket-view", v.gradient_as_bucket_view,
                    "DDP's gradient_as_bucket_view: no second gradient copy in the buckets"),
      "gradient_as_bucket_view");
}

void SharedSetupFlags::Apply(estimator::TrainingSetup* s, bool only_given) const {
  auto use = [&](const char* field) {
    if (!only_given) return true;
    for (const auto& [option, name] : options) {
      if (name == field && option->count() > 0) return true;
    }
    return false;
  };
  if (use("flash_attention")) s->flash_attention = values.flash_attention;
  if (use("foreach")) s->foreach = values.foreach;
  if (use("fused_optimizer")) s->fused_optimizer = values.fused_optimizer;
  if (use("sgd_momentum")) s->sgd_momentum = values.sgd_momentum;
  if (use("sequence_parallel")) s->sequence_parallel = values.sequence_parallel;
  if (use("autocast")) s->autocast = values.autocast;
  if (use("gradient_as_bucket_view")) s->gradient_as_bucket_view = values.gradient_as_bucket_view;
  if (use("framework")) {
    // The option's check admits only names ParseFramework accepts.
    Result<estimator::Framework> parsed = estimator::ParseFramework(framework);
    if (parsed.ok()) s->framework = *parsed;
  }
  if (use("torch_version")) s->torch_version = values.torch_version;
  if (use("checkpoint_every")) s->checkpoint_every = values.checkpoint_every;
  if (use("lora_dropout")) s->lora_dropout = values.lora_dropout;
  if (use("loss")) {
    Result<estimator::Loss> parsed = estimator::ParseLoss(loss);  // checked by the option
    if (parsed.ok()) s->loss = *parsed;
  }
  if (use("loss_chunks")) s->loss_chunks = values.loss_chunks;
  if (use("torch_compile")) s->torch_compile = values.torch_compile;
  if (use("gpu_arch")) s->gpu_arch = values.gpu_arch;
}

void JobSetupFlags::Add(CLI::App* cmd, const std::string& group, const std::string& precision_help,
                        const std::string& optimizer_help) {
  cmd->add_option("--seq-len", seq_len, "Tokens per sequence (default: min(positions, 2048))")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 24))
      ->group(group);
  cmd->add_option("--precision", precision, precision_help)
      ->check(CLI::IsMember({"fp32", "fp16-mixed", "bf16-mixed", "bf16-pure"}))
      ->group(group);
  optimizer_option = cmd->add_option("--optimizer", optimizer, optimizer_help)
                         ->check(CLI::IsMember({"adamw", "adam8bit", "sgd", "lion", "adafactor"}))
                         ->group(group);
  cmd->add_option("--lora-rank", lora_rank, "LoRA rank; only the adapters train")
      ->check(CLI::Range(int64_t{1}, int64_t{65536}))
      ->group(group);
  cmd->add_option("--lora-targets", lora_targets, "Comma-separated module names or all-linear")
      ->delimiter(',')
      ->group(group);
  cmd->add_flag("--qlora", qlora, "Frozen base Linears in NF4 (needs --lora-rank)")->group(group);
  shared.Add(cmd, group);
  cmd->add_option("--cuda-context-mib", cuda_context_mib, "CUDA context per GPU, MiB")
      ->check(CLI::Range(0.0, 1048576.0))
      ->capture_default_str()
      ->group(group);
}

Status JobSetupFlags::Fill(planner::PlanRequest* r) const {
  estimator::TrainingSetup& s = r->setup;
  if (!precision.empty()) {
    MEMPLAN_ASSIGN_OR_RETURN(r->precision, estimator::ParsePrecision(precision));
  }
  if (OptimizerGiven()) {
    MEMPLAN_ASSIGN_OR_RETURN(r->optimizer, estimator::ParseOptimizer(optimizer));
  }
  s.lora_rank = lora_rank;
  s.lora_targets = lora_targets;
  s.qlora = qlora;
  shared.Apply(&s, /*only_given=*/false);
  s.seq_len = seq_len;
  s.cuda_context_bytes = static_cast<int64_t>(cuda_context_mib * 1048576.0);
  return Status::Ok();
}

namespace {

// Each field that a library message may name (Note [Field names in errors]), as the JSON request,
// setup or cluster file spells it, with the flag that sets it. Several fields may share a flag:
// the setup's `gpus_per_node` and `num_nodes` are the request's `gpus` and `nodes`.
constexpr std::pair<std::string_view, std::string_view> kFieldFlags[] = {
    // TrainingSetup and DeepSpeedHardware (estimate, plan, capacity).
    {"micro_batch", "--micro-batch"},
    {"seq_len", "--seq-len"},
    {"grad_accum", "--grad-accum"},
    {"tp", "--tp"},
    {"zero_stage", "--zero-stage"},
    {"lora_rank", "--lora-rank"},
    {"lora_targets", "--lora-targets"},
    {"qlora", "--qlora"},
    {"gpus_per_node", "--gpus"},
    {"num_nodes", "--nodes"},
    {"buffer_factor", "--buffer-factor"},
    {"torch_version", "--torch-version"},
    {"checkpointing", "--checkpointing"},
    {"checkpoint_every", "--checkpoint-every"},
    {"lora_dropout", "--lora-dropout"},
    {"loss", "--loss"},
    {"loss_chunks", "--loss-chunks"},
    {"torch_compile", "--compile"},
    {"gpu_arch", "--gpu-arch"},
    {"framework", "--framework"},
    {"fsdp", "--fsdp"},
    {"offload_param", "--offload-param"},
    {"offload_optimizer", "--offload-optimizer"},
    {"optimizer", "--optimizer"},
    {"sgd_momentum", "--sgd-momentum"},
    {"autocast", "--autocast"},
    {"foreach", "--foreach"},
    {"fused_optimizer", "--fused-optimizer"},
    {"precision", "--precision"},
    // The model (estimate, plan, capacity, inventory).
    {"model", "--model"},
    {"model_class", "--model-class"},
    {"model_config", "--model-config"},
    // Inference (estimate --inference).
    {"batch", "--batch"},
    {"context", "--context"},
    {"encoder_context", "--encoder-context"},
    {"kv_dtype", "--kv-dtype"},
    // Job, Cluster and SearchOptions (plan, capacity).
    {"global_batch", "--global-batch"},
    {"global_batch_tokens", "--global-batch-tokens"},
    {"gpu", "--gpu"},
    {"gpus", "--gpus"},
    {"nodes", "--nodes"},
    {"cluster", "--cluster"},
    {"cpu_mem", "--cpu-mem"},
    {"cpu_cores", "--cpu-cores"},
    {"pcie_gen", "--pcie-gen"},
    {"memlock", "--memlock"},
    {"nvme_path", "--nvme-path"},
    {"nvme_capacity", "--nvme-capacity"},
    {"inter_node_bw", "--inter-node-bw"},
    {"gpu_margin", "--gpu-margin"},
    {"sharding", "--sharding"},
    // Emitting a plan (plan --emit-*).
    {"plan_index", "--plan-index"},
    {"accelerate_plugin", "--accelerate-plugin"},
    {"for_hf_trainer", "--for-hf-trainer"},
    {"deepspeed_config_path", "--emit-deepspeed"},
    {"accelerate_config", "--emit-accelerate"},
    {"launcher", "--emit-launch"},
    {"script", "--launch-script"},
    {"script_args", "--launch-arg"},
    {"master_port", "--master-port"},
    {"slurm_partition", "--slurm-partition"},
    {"slurm_time", "--slurm-time"},
    // CapacityRequest and GpuOffer (capacity).
    {"offers", "--gpu"},
    {"gpu_counts", "--gpus"},
    {"price_per_gpu_hour", "--price"},
    {"tokens", "--tokens"},
    {"max_train_hours", "--max-days"},
    // CalibrateOptions (calibrate).
    {"constants", "--constants"},
    {"max_rms_error", "--max-error"},
};

}  // namespace

std::string_view FlagForField(std::string_view field, FieldFlags overrides) {
  for (const auto& [name, flag] : overrides) {
    if (name == field) return flag;
  }
  for (const auto& [name, flag] : kFieldFlags) {
    if (name == field) return flag;
  }
  return {};
}

std::vector<std::string_view> MappedFields() {
  std::vector<std::string_view> fields;
  for (const auto& [name, flag] : kFieldFlags) fields.push_back(name);
  return fields;
}

std::string FieldsToFlags(std::string_view text, FieldFlags overrides) {
  std::string out;
  out.reserve(text.size());
  size_t i = 0;
  while (i < text.size()) {
    const size_t open = text.find('`', i);
    const size_t close = open == std::string_view::npos ? open : text.find('`', open + 1);
    if (close == std::string_view::npos) break;
    const std::string_view flag = FlagForField(text.substr(open + 1, close - open - 1), overrides);
    if (flag.empty()) {
      // Not a field: keep the first backquote and look again from the second, which may open one.
      out.append(text.substr(i, close - i));
      i = close;
      continue;
    }
    out.append(text.substr(i, open - i));
    out.append(flag);
    i = close + 1;
  }
  out.append(text.substr(i));
  return out;
}

}  // namespace memplan::tools
