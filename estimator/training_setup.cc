#include "estimator/training_setup.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <map>
#include <optional>

#include "common/strings.h"
#include "common/enum_names.h"
#include "common/json.h"

namespace memplan::estimator {
namespace {

constexpr EnumName<Precision> kPrecisions[] = {{Precision::kFp32, "fp32"},
                                               {Precision::kFp16Mixed, "fp16-mixed"},
                                               {Precision::kBf16Mixed, "bf16-mixed"},
                                               {Precision::kBf16Pure, "bf16-pure"}};
constexpr EnumName<Optimizer> kOptimizers[] = {{Optimizer::kAdamW, "adamw"},
                                               {Optimizer::kAdam8bit, "adam8bit"},
                                               {Optimizer::kSgd, "sgd"},
                                               {Optimizer::kLion, "lion"},
                                               {Optimizer::kAdafactor, "adafactor"}};
constexpr EnumName<Checkpointing> kCheckpointings[] = {{Checkpointing::kNone, "none"},
                                                       {Checkpointing::kSelective, "selective"},
                                                       {Checkpointing::kFull, "full"},
                                                       {Checkpointing::kOp, "op"}};
constexpr EnumName<Loss> kLosses[] = {
    {Loss::kFull, "full"}, {Loss::kChunked, "chunked"}, {Loss::kFused, "fused"}};
constexpr EnumName<OffloadDevice> kDevices[] = {
    {OffloadDevice::kNone, "none"}, {OffloadDevice::kCpu, "cpu"}, {OffloadDevice::kNvme, "nvme"}};
constexpr EnumName<Framework> kFrameworks[] = {{Framework::kTransformers, "transformers"},
                                               {Framework::kLitGpt, "litgpt"},
                                               {Framework::kTorchtune, "torchtune"},
                                               {Framework::kTorchtitan, "torchtitan"},
                                               {Framework::kLlmFoundry, "llm-foundry"}};
constexpr EnumName<FsdpSharding> kFsdpShardings[] = {{FsdpSharding::kNone, "none"},
                                                     {FsdpSharding::kFullShard, "full_shard"},
                                                     {FsdpSharding::kShardGradOp, "shard_grad_op"},
                                                     {FsdpSharding::kNoShard, "no_shard"}};

// "MAJOR.MINOR" (a patch or local suffix after it is ignored: "1.10.1", "2.1.0+cu121").
bool ParseTorchVersion(std::string_view text, int* major, int* minor) {
  size_t i = 0;
  auto number = [&](int* out) {
    size_t start = i;
    int64_t v = 0;
    while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i])) && i - start < 4) {
      v = v * 10 + (text[i] - '0');
      ++i;
    }
    *out = static_cast<int>(v);
    return i > start;
  };
  if (!number(major) || i >= text.size() || text[i] != '.') return false;
  ++i;
  if (!number(minor)) return false;
  return i == text.size() || text[i] == '.' || text[i] == '+';
}

Status Range(std::string_view flag, int64_t value, int64_t lo, int64_t hi) {
  if (value < lo || value > hi) {
    return Status::InvalidArgument(std::string(flag) + " must be in [" + std::to_string(lo) + ", " +
                                   std::to_string(hi) + "], got " + std::to_string(value));
  }
  return Status::Ok();
}

// A Linear (or GPT-2 Conv1D) weight inside a repeated block (Note [Tensor roles]).
bool IsBlockLinearWeight(const TensorInfo& t) { return !t.block.empty() && t.IsLinearWeight(); }

}  // namespace

std::string_view PrecisionName(Precision p) { return NameOf(kPrecisions, p); }
std::string_view OptimizerName(Optimizer o) { return NameOf(kOptimizers, o); }
std::string_view CheckpointingName(Checkpointing c) { return NameOf(kCheckpointings, c); }
std::string_view LossName(Loss l) { return NameOf(kLosses, l); }
Result<Loss> ParseLoss(std::string_view text) { return ParseName(kLosses, text, "loss"); }
std::string_view OffloadDeviceName(OffloadDevice d) { return NameOf(kDevices, d); }
std::string_view FrameworkName(Framework f) { return NameOf(kFrameworks, f); }
std::string_view FsdpShardingName(FsdpSharding f) { return NameOf(kFsdpShardings, f); }
Result<Framework> ParseFramework(std::string_view text) {
  if (text == "lit-gpt") return Framework::kLitGpt;
  if (text == "llm_foundry" || text == "llmfoundry") return Framework::kLlmFoundry;
  return ParseName(kFrameworks, text, "framework");
}
Result<FsdpSharding> ParseFsdpSharding(std::string_view text) {
  std::string lower(text);
  for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return ParseName(kFsdpShardings, lower, "FSDP sharding strategy");
}

// "sm80", "sm_90", "8.0", "9.0a" -> 80, 90; 0 when it is none of these.
static int ParseGpuArch(std::string_view text) {
  std::string t(text);
  for (char& c : t) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (t.rfind("sm", 0) == 0) {
    t = t.substr(t[2] == '_' ? 3 : 2);
  } else {
    const size_t dot = t.find('.');
    if (dot == std::string::npos) return 0;
    t = t.substr(0, dot) + t.substr(dot + 1);
  }
  while (!t.empty() && std::isalpha(static_cast<unsigned char>(t.back()))) t.pop_back();
  if (t.empty() || t.size() > 3) return 0;
  int v = 0;
  for (char c : t) {
    if (!std::isdigit(static_cast<unsigned char>(c))) return 0;
    v = v * 10 + (c - '0');
  }
  return v >= 50 && v <= 200 ? v : 0;
}

double TrainingSetup::LoraDropout() const {
  if (lora_dropout >= 0) return lora_dropout;
  return framework == Framework::kLitGpt ? 0.05 : 0.0;
}

int TrainingSetup::GpuSm() const {
  const int sm = ParseGpuArch(gpu_arch);
  return sm == 0 ? 80 : sm;
}

bool TrainingSetup::TorchBefore(int major, int minor) const {
  int have_major = 0, have_minor = 0;
  if (torch_version.empty() || !ParseTorchVersion(torch_version, &have_major, &have_minor)) {
    return false;
  }
  return have_major < major || (have_major == major && have_minor < minor);
}

Result<Precision> ParsePrecision(std::string_view text) {
  return ParseName(kPrecisions, text, "precision");
}
Result<Optimizer> ParseOptimizer(std::string_view text) {
  return ParseName(kOptimizers, text, "optimizer");
}
Result<Checkpointing> ParseCheckpointing(std::string_view text) {
  return ParseName(kCheckpointings, text, "checkpointing");
}
Result<OffloadDevice> ParseOffloadDevice(std::string_view text) {
  return ParseName(kDevices, text, "offload device");
}

Status TrainingSetup::Validate() const {
  MEMPLAN_RETURN_IF_ERROR(Range("`micro_batch`", micro_batch, 1, kMaxCount));
  MEMPLAN_RETURN_IF_ERROR(Range("`seq_len`", seq_len, 0, kMaxCount));
  MEMPLAN_RETURN_IF_ERROR(Range("`grad_accum`", grad_accum, 1, kMaxCount));
  MEMPLAN_RETURN_IF_ERROR(Range("`tp`", tp, 1, kMaxCount));
  MEMPLAN_RETURN_IF_ERROR(Range("`zero_stage`", zero_stage, 0, 3));
  MEMPLAN_RETURN_IF_ERROR(Range("`lora_rank`", lora_rank, 0, 65536));
  MEMPLAN_RETURN_IF_ERROR(Range("`checkpoint_every`", checkpoint_every, 1, kMaxCount));
  MEMPLAN_RETURN_IF_ERROR(Range("`loss_chunks`", loss_chunks, 0, kMaxCount));
  if (!(lora_dropout >= -1 && lora_dropout < 1)) {
    return Status::InvalidArgument("`lora_dropout` must be in [0, 1), got " +
                                   std::to_string(lora_dropout));
  }
  if (checkpoint_every > 1 && checkpointing != Checkpointing::kFull) {
    return Status::InvalidArgument(
        "`checkpoint_every` " + std::to_string(checkpoint_every) +
        " picks which blocks full checkpointing wraps: use `checkpointing` full");
  }
  if (loss_chunks > 0 && loss != Loss::kChunked) {
    return Status::InvalidArgument("`loss_chunks` needs `loss` chunked");
  }
  if (ParseGpuArch(gpu_arch) == 0) {
    return Status::InvalidArgument("`gpu_arch` '" + gpu_arch +
                                   "': expected a compute capability such as sm80 (A100), sm90 "
                                   "(H100) or 8.9");
  }
  MEMPLAN_RETURN_IF_ERROR(Range("`gpus_per_node`", gpus_per_node, 1, kMaxCount));
  MEMPLAN_RETURN_IF_ERROR(Range("`num_nodes`", num_nodes, 1, kMaxCount));
  MEMPLAN_RETURN_IF_ERROR(Range("cuda_context_bytes", cuda_context_bytes, 0, int64_t{1} << 40));
  const std::pair<std::string_view, int64_t> buffers[] = {
      {"reduce_bucket_size", reduce_bucket_size},
      {"allgather_bucket_size", allgather_bucket_size},
      {"stage3_prefetch_bucket_size", stage3_prefetch_bucket_size},
      {"stage3_param_persistence_threshold", stage3_param_persistence_threshold},
      {"stage3_max_live_parameters", stage3_max_live_parameters},
      {"sub_group_size", sub_group_size},
      {"offload_param.buffer_size", param_buffer_size},
      {"offload_param.max_in_cpu", param_max_in_cpu},
      {"aio.block_size", aio_block_size}};
  for (const auto& [name, value] : buffers) {
    MEMPLAN_RETURN_IF_ERROR(Range(name, value, 0, kMaxBufferElements));
  }
  MEMPLAN_RETURN_IF_ERROR(Range("offload_param.buffer_count", param_buffer_count, 1, 1024));
  MEMPLAN_RETURN_IF_ERROR(Range("offload_optimizer.buffer_count", optimizer_buffer_count, 1, 1024));
  MEMPLAN_RETURN_IF_ERROR(Range("aio.queue_depth", aio_queue_depth, 1, 1 << 16));
  MEMPLAN_RETURN_IF_ERROR(Range("aio.intra_op_parallelism", aio_intra_op_parallelism, 1, 64));
  int major = 0, minor = 0;
  if (!torch_version.empty() && !ParseTorchVersion(torch_version, &major, &minor)) {
    return Status::InvalidArgument("`torch_version` '" + torch_version +
                                   "': expected MAJOR.MINOR, e.g. 1.10 or 2.1");
  }
  if (WorldSize() % tp != 0) {
    return Status::InvalidArgument("`tp` " + std::to_string(tp) + " does not divide the " +
                                   std::to_string(WorldSize()) +
                                   " GPUs (`gpus_per_node` x `num_nodes`); the data-parallel "
                                   "degree would not be whole");
  }
  if (fsdp != FsdpSharding::kNone) {
    const int stage = fsdp == FsdpSharding::kFullShard     ? 3
                      : fsdp == FsdpSharding::kShardGradOp ? 2
                                                           : 0;
    if (zero_stage != 0 && zero_stage != stage) {
      return Status::InvalidArgument("`zero_stage` " + std::to_string(zero_stage) +
                                     " contradicts `fsdp` " + std::string(FsdpShardingName(fsdp)) +
                                     " (which shards like stage " + std::to_string(stage) + ")");
    }
    if (offload_param == OffloadDevice::kNvme || offload_optimizer == OffloadDevice::kNvme) {
      return Status::InvalidArgument(
          "`fsdp` offloads to the CPU only (CPUOffload); NVMe offload is "
          "DeepSpeed's (drop `fsdp`, use `zero_stage` 3)");
    }
    if (offload_optimizer == OffloadDevice::kCpu && offload_param != OffloadDevice::kCpu) {
      return Status::InvalidArgument(
          "`fsdp` with `offload_optimizer` cpu: FSDP moves the optimizer to the CPU only with the "
          "parameters (CPUOffload(offload_params=True)); add `offload_param` cpu");
    }
  } else if (offload_param != OffloadDevice::kNone && zero_stage != 3) {
    return Status::InvalidArgument(
        "`offload_param` " + std::string(OffloadDeviceName(offload_param)) +
        " needs `zero_stage` 3 (DeepSpeed offloads parameters only in ZeRO-3), got stage " +
        std::to_string(zero_stage));
  }
  if (fsdp == FsdpSharding::kNone && offload_optimizer != OffloadDevice::kNone && zero_stage == 0) {
    return Status::InvalidArgument("`offload_optimizer` " +
                                   std::string(OffloadDeviceName(offload_optimizer)) +
                                   " needs ZeRO (`zero_stage` 1, 2 or 3)");
  }
  if (offload_optimizer == OffloadDevice::kNvme && zero_stage != 3) {
    return Status::InvalidArgument(
        "`offload_optimizer` nvme needs `zero_stage` 3 (ZeRO-Infinity); stages 1 and 2 offload "
        "the optimizer to cpu only");
  }
  if (fsdp == FsdpSharding::kNone && offload_optimizer != OffloadDevice::kNone &&
      (optimizer == Optimizer::kAdam8bit || optimizer == Optimizer::kSgd ||
       optimizer == Optimizer::kAdafactor)) {
    return Status::InvalidArgument(
        "`optimizer` " + std::string(OptimizerName(optimizer)) +
        " cannot be offloaded: DeepSpeed's CPU optimizers are Adam/AdamW, Adagrad and Lion; use "
        "`optimizer` adamw or lion, or `offload_optimizer` none");
  }
  if (!(sgd_momentum >= 0 && sgd_momentum <= 1)) {
    return Status::InvalidArgument("`sgd_momentum` must be in [0, 1], got " +
                                   std::to_string(sgd_momentum));
  }
  if (autocast && precision != Precision::kFp16Mixed && precision != Precision::kBf16Mixed) {
    return Status::InvalidArgument(
        "`autocast` is mixed precision over fp32 parameters: use `precision` fp16-mixed or "
        "bf16-mixed");
  }
  if (autocast && (zero_stage != 0 || fsdp != FsdpSharding::kNone)) {
    return Status::InvalidArgument(
        "`autocast` describes a plain PyTorch trainer (ZeRO-0); DeepSpeed's ZeRO stages keep "
        "their own 16-bit weights and fp32 master copy");
  }
  if (qlora && lora_rank == 0) {
    return Status::InvalidArgument(
        "`qlora` trains LoRA adapters on a 4-bit frozen base: give `lora_rank` too");
  }
  if (double_quant && !qlora) {
    return Status::InvalidArgument(
        "double quantisation applies to QLoRA's 4-bit base: add `qlora`");
  }
  if (!lora_targets.empty() && lora_rank == 0) {
    return Status::InvalidArgument("`lora_targets` needs `lora_rank`");
  }
  if (lora_rank > 0 && optimizer == Optimizer::kAdam8bit) {
    return Status::InvalidArgument(
        "`optimizer` adam8bit with LoRA: the base model is frozen and only the small adapters "
        "train, which bitsandbytes keeps in 32-bit anyway (tensors under 4096 elements), so 8-bit "
        "states save nothing; use `optimizer` adamw");
  }
  if (qlora && offload_param != OffloadDevice::kNone) {
    return Status::InvalidArgument(
        "`qlora` with `offload_param`: DeepSpeed cannot offload bitsandbytes 4-bit weights");
  }
  return Status::Ok();
}

int64_t TrainingSetup::SeqLenFor(const ArchitectureInfo* arch) const {
  if (seq_len > 0) return seq_len;
  if (arch != nullptr && arch->max_positions > 0)
    return std::min<int64_t>(arch->max_positions, 2048);
  return 512;
}

std::vector<std::string> DefaultLoraTargets(std::string_view model_type) {
  // peft.utils.constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.
  static const auto* kDefaults = new std::map<std::string, std::vector<std::string>, std::less<>>{
      {"gpt2", {"c_attn"}},
      {"gpt_neox", {"query_key_value"}},
      {"llama", {"q_proj", "v_proj"}},
      {"mistral", {"q_proj", "v_proj"}},
      {"mixtral", {"q_proj", "v_proj"}},
      {"qwen2", {"q_proj", "v_proj"}},
      {"gemma", {"q_proj", "v_proj"}},
      {"bert", {"query", "value"}},
      {"roberta", {"query", "value"}},
      {"t5", {"q", "v"}},
      {"qwen3", {"q_proj", "v_proj"}},
      {"gemma2", {"q_proj", "v_proj"}},
      {"gemma3_text", {"q_proj", "v_proj"}},
      {"phi", {"q_proj", "v_proj", "fc1", "fc2"}},
      {"falcon", {"query_key_value"}},
      {"bloom", {"query_key_value"}},
      {"gptj", {"q_proj", "v_proj"}},
      {"opt", {"q_proj", "v_proj"}},
      {"xlm-roberta", {"query", "value"}},
      // PEFT 0.21's further defaults (peft/utils/constants.py
      // TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING).
      {"phi3", {"qkv_proj"}},
      {"olmo2", {"q_proj", "v_proj"}},
      {"starcoder2", {"q_proj", "v_proj"}},
      {"qwen2_moe", {"q_proj", "v_proj"}},
      {"qwen3_moe", {"q_proj", "v_proj"}},
      {"gpt_bigcode", {"c_attn"}},
      {"stablelm", {"q_proj", "v_proj"}},
      {"olmo", {"q_proj", "v_proj"}},
      {"gpt_neo", {"q_proj", "v_proj"}},
  };
  auto it = kDefaults->find(model_type);
  return it == kDefaults->end() ? std::vector<std::string>{} : it->second;
}

bool TransformersRunsSdpa(std::string_view model_type) {
  for (std::string_view eager : {"gemma2", "gpt_oss", "bloom", "gptj", "gpt_neo", "mpt"}) {
    if (model_type == eager) return false;
  }
  return true;
}

namespace {

// The framework's own names for what its LoRA adapts, as roles (Note [Tensor roles]):
// torchtune's lora_attn_modules / apply_lora_to_mlp / apply_lora_to_output, LitGPT's
// lora_query ... lora_head. Empty when `name` is none of them (then it is a module name, as
// PEFT's target_modules are).
std::vector<TensorRole> FrameworkTargetRoles(Framework f, std::string_view name) {
  using R = TensorRole;
  const std::vector<TensorRole> mlp = {R::kMlpGate, R::kMlpUp, R::kMlpGateUp, R::kMlpDown};
  if (f == Framework::kLitGpt) {
    if (name == "query") return {R::kAttentionQ, R::kAttentionQkv};
    if (name == "key") return {R::kAttentionK, R::kAttentionQkv};
    if (name == "value") return {R::kAttentionV, R::kAttentionQkv};
    if (name == "projection") return {R::kAttentionOut};
    if (name == "mlp") return mlp;
    if (name == "head") return {R::kHead};
  }
  if (f == Framework::kTorchtune) {
    if (name == "q_proj") return {R::kAttentionQ};
    if (name == "k_proj") return {R::kAttentionK};
    if (name == "v_proj") return {R::kAttentionV};
    if (name == "output_proj") return {R::kAttentionOut};
    if (name == "mlp") return mlp;
    if (name == "output") return {R::kHead};
  }
  return {};
}

}  // namespace

Result<std::vector<const TensorInfo*>> LoraTargetTensors(const ModelInventory& inventory,
                                                         const TrainingSetup& setup) {
  std::vector<std::string> targets = setup.lora_targets;
  if (targets.empty()) {
    // LitGPT's finetune/lora.py adapts the query and value projections by default, as PEFT
    // does for most model types.
    if (setup.framework == Framework::kLitGpt) targets = {"query", "value"};
    // torchtune's LoRA recipe configs (recipes/configs/*/*_lora*.yaml): lora_attn_modules
    // [q_proj, v_proj, output_proj], apply_lora_to_mlp: True.
    if (setup.framework == Framework::kTorchtune) {
      targets = {"q_proj", "v_proj", "output_proj", "mlp"};
    }
  }
  if (targets.empty()) {
    targets = DefaultLoraTargets(inventory.model_type);
    if (targets.empty()) {
      return Status::InvalidArgument(
          "`lora_targets` is needed: PEFT has no default target modules for this model (" +
          (inventory.model_type.empty() ? std::string("no model_type") : inventory.model_type) +
          "); name the Linear modules (e.g. q_proj,v_proj) or pass all-linear");
    }
  }
  const bool all = std::find(targets.begin(), targets.end(), "all-linear") != targets.end();
  std::vector<const TensorInfo*> out;
  std::set<std::string> matched, available;
  std::set<const TensorInfo*> picked;
  for (const TensorInfo& t : inventory.tensors) {
    const bool head = t.role == TensorRole::kHead && t.IsLinearWeight();
    if (!IsBlockLinearWeight(t) && !head) continue;
    const std::string leaf(LastComponent(t.module, '.'));
    if (!head) available.insert(leaf);
    bool take = false;
    for (const std::string& target : targets) {
      const std::vector<TensorRole> roles = FrameworkTargetRoles(setup.framework, target);
      const bool by_role = std::find(roles.begin(), roles.end(), t.role) != roles.end();
      if (by_role || (!head && (all || target == leaf))) {
        take = true;
        matched.insert(target);
      }
    }
    if (all && !head) matched.insert("all-linear");
    if (take && picked.insert(&t).second) out.push_back(&t);
  }
  for (const std::string& target : targets) {
    if (target == "all-linear" || matched.count(target) > 0) continue;
    std::string names;
    for (const auto& a : available) names += (names.empty() ? "" : ", ") + a;
    return Status::InvalidArgument("`lora_targets`: '" + target +
                                   "' names no Linear inside the model's blocks (there are: " +
                                   (names.empty() ? std::string("none") : names) + ")");
  }
  return out;
}

Status TrainingSetup::ValidateFor(const ModelInventory& inventory) const {
  MEMPLAN_RETURN_IF_ERROR(Validate());
  if (!inventory.arch.has_value()) {
    return Status::InvalidArgument(
        inventory.name +
        ": activation memory needs the architecture (hidden size, heads, MLP "
        "kind, dropout), which a " +
        (inventory.source.empty() ? std::string("tensor list") : inventory.source) +
        " does not carry; pass the model's config.json (or its directory) instead");
  }
  const ArchitectureInfo& a = *inventory.arch;
  if (a.heads % tp != 0 || a.kv_heads % tp != 0) {
    return Status::InvalidArgument("`tp` " + std::to_string(tp) + " must divide the " +
                                   std::to_string(a.heads) + " attention heads and " +
                                   std::to_string(a.kv_heads) +
                                   " key/value heads (Megatron splits attention by heads)");
  }
  if (a.intermediate % tp != 0) {
    return Status::InvalidArgument("`tp` " + std::to_string(tp) + " must divide the MLP width " +
                                   std::to_string(a.intermediate));
  }
  const int64_t s = SeqLenFor(&a);
  if (a.learned_positions && s > a.max_positions) {
    return Status::InvalidArgument("`seq_len` " + std::to_string(s) + " exceeds the model's " +
                                   std::to_string(a.max_positions) +
                                   " learned positions (max_position_embeddings)");
  }
  if (lora_rank > 0) {
    MEMPLAN_ASSIGN_OR_RETURN(auto targets, LoraTargetTensors(inventory, *this));
    (void)targets;
  }
  return Status::Ok();
}

// --- JSON -------------------------------------------------------------------------------------

nlohmann::json ToJson(const TrainingSetup& s) {
  nlohmann::json j = {
      {"precision", std::string(PrecisionName(s.precision))},
      {"optimizer", std::string(OptimizerName(s.optimizer))},
      {"lora_rank", s.lora_rank},
      {"lora_targets", s.lora_targets},
      {"lora_dropout", s.lora_dropout},
      {"qlora", s.qlora},
      {"double_quant", s.double_quant},
      {"micro_batch", s.micro_batch},
      {"seq_len", s.seq_len},
      {"grad_accum", s.grad_accum},
      {"checkpointing", std::string(CheckpointingName(s.checkpointing))},
      {"checkpoint_every", s.checkpoint_every},
      {"loss", std::string(LossName(s.loss))},
      {"loss_chunks", s.loss_chunks},
      {"torch_compile", s.torch_compile},
      {"gpu_arch", s.gpu_arch},
      {"flash_attention", s.flash_attention},
      {"tp", s.tp},
      {"sequence_parallel", s.sequence_parallel},
      {"foreach", s.foreach},
      {"fused_optimizer", s.fused_optimizer},
      {"sgd_momentum", s.sgd_momentum},
      {"autocast", s.autocast},
      {"gradient_as_bucket_view", s.gradient_as_bucket_view},
      {"framework", std::string(FrameworkName(s.framework))},
      {"torch_version", s.torch_version},
      {"fsdp", std::string(FsdpShardingName(s.fsdp))},
      {"zero_stage", s.zero_stage},
      {"offload_optimizer", std::string(OffloadDeviceName(s.offload_optimizer))},
      {"offload_param", std::string(OffloadDeviceName(s.offload_param))},
      {"reduce_bucket_size", s.reduce_bucket_size},
      {"allgather_bucket_size", s.allgather_bucket_size},
      {"overlap_comm", s.OverlapComm()},
      {"stage3_prefetch_bucket_size", s.stage3_prefetch_bucket_size},
      {"stage3_param_persistence_threshold", s.stage3_param_persistence_threshold},
      {"stage3_max_live_parameters", s.stage3_max_live_parameters},
      {"sub_group_size", s.sub_group_size},
      {"pin_memory", s.pin_memory},
      {"param_buffer_count", s.param_buffer_count},
      {"param_buffer_size", s.param_buffer_size},
      {"param_max_in_cpu", s.param_max_in_cpu},
      {"optimizer_buffer_count", s.optimizer_buffer_count},
      {"aio_block_size", s.aio_block_size},
      {"aio_queue_depth", s.aio_queue_depth},
      {"aio_intra_op_parallelism", s.aio_intra_op_parallelism},
      {"gpus_per_node", s.gpus_per_node},
      {"num_nodes", s.num_nodes},
      {"cuda_context_bytes", s.cuda_context_bytes},
  };
  return j;
}

Result<TrainingSetup> TrainingSetupFromJson(const nlohmann::json& j) {
  static const std::vector<std::string> kKeys = {"precision",
                                                 "optimizer",
                                                 "lora_rank",
                                                 "lora_targets",
                                                 "lora_dropout",
                                                 "qlora",
                                                 "double_quant",
                                                 "micro_batch",
                                                 "seq_len",
                                                 "grad_accum",
                                                 "checkpointing",
                                                 "checkpoint_every",
                                                 "loss",
                                                 "loss_chunks",
                                                 "torch_compile",
                                                 "gpu_arch",
                                                 "flash_attention",
                                                 "tp",
                                                 "sequence_parallel",
                                                 "foreach",
                                                 "fused_optimizer",
                                                 "sgd_momentum",
                                                 "autocast",
                                                 "gradient_as_bucket_view",
                                                 "framework",
                                                 "torch_version",
                                                 "fsdp",
                                                 "zero_stage",
                                                 "offload_optimizer",
                                                 "offload_param",
                                                 "reduce_bucket_size",
                                                 "allgather_bucket_size",
                                                 "overlap_comm",
                                                 "stage3_prefetch_bucket_size",
                                                 "stage3_param_persistence_threshold",
                                                 "stage3_max_live_parameters",
                                                 "sub_group_size",
                                                 "pin_memory",
                                                 "param_buffer_count",
                                                 "param_buffer_size",
                                                 "param_max_in_cpu",
                                                 "optimizer_buffer_count",
                                                 "aio_block_size",
                                                 "aio_queue_depth",
                                                 "aio_intra_op_parallelism",
                                                 "gpus_per_node",
                                                 "num_nodes",
                                                 "cuda_context_bytes"};
  using F = JsonFieldReader;
  const JsonFieldReader r(j, "setup JSON");
  MEMPLAN_RETURN_IF_ERROR(r.CheckKeys(kKeys));
  TrainingSetup s;
  MEMPLAN_RETURN_IF_ERROR(r.Enum("precision", ParsePrecision, &s.precision));
  MEMPLAN_RETURN_IF_ERROR(r.Enum("optimizer", ParseOptimizer, &s.optimizer));
  MEMPLAN_RETURN_IF_ERROR(
      r.GetAll(F::Field("lora_rank", &s.lora_rank), F::Field("lora_targets", &s.lora_targets),
               F::Field("lora_dropout", &s.lora_dropout), F::Field("qlora", &s.qlora),
               F::Field("double_quant", &s.double_quant), F::Field("micro_batch", &s.micro_batch),
               F::Field("seq_len", &s.seq_len), F::Field("grad_accum", &s.grad_accum)));
  MEMPLAN_RETURN_IF_ERROR(r.Enum("checkpointing", ParseCheckpointing, &s.checkpointing));
  MEMPLAN_RETURN_IF_ERROR(r.Enum("loss", ParseLoss, &s.loss));
  MEMPLAN_RETURN_IF_ERROR(r.GetAll(
      F::Field("checkpoint_every", &s.checkpoint_every), F::Field("loss_chunks", &s.loss_chunks),
      F::Field("torch_compile", &s.torch_compile), F::Field("gpu_arch", &s.gpu_arch)));
  MEMPLAN_RETURN_IF_ERROR(
      r.GetAll(F::Field("flash_attention", &s.flash_attention), F::Field("tp", &s.tp),
               F::Field("sequence_parallel", &s.sequence_parallel), F::Field("foreach", &s.foreach),
               F::Field("fused_optimizer", &s.fused_optimizer),
               F::Field("sgd_momentum", &s.sgd_momentum), F::Field("autocast", &s.autocast),
               F::Field("gradient_as_bucket_view", &s.gradient_as_bucket_view)));
  MEMPLAN_RETURN_IF_ERROR(r.Enum("framework", ParseFramework, &s.framework));
  MEMPLAN_RETURN_IF_ERROR(r.Get("torch_version", &s.torch_version));
  MEMPLAN_RETURN_IF_ERROR(r.Enum("fsdp", ParseFsdpSharding, &s.fsdp));
  MEMPLAN_RETURN_IF_ERROR(r.Get("zero_stage", &s.zero_stage));
  MEMPLAN_RETURN_IF_ERROR(r.Enum("offload_optimizer", ParseOffloadDevice, &s.offload_optimizer));
  MEMPLAN_RETURN_IF_ERROR(r.Enum("offload_param", ParseOffloadDevice, &s.offload_param));
  MEMPLAN_RETURN_IF_ERROR(r.GetAll(F::Field("reduce_bucket_size", &s.reduce_bucket_size),
                                   F::Field("allgather_bucket_size", &s.allgather_bucket_size)));
  if (r.Has("overlap_comm")) {
    bool overlap = false;
    MEMPLAN_RETURN_IF_ERROR(r.Get("overlap_comm", &overlap));
    s.overlap_comm = overlap;
  }
  MEMPLAN_RETURN_IF_ERROR(r.GetAll(
      F::Field("stage3_prefetch_bucket_size", &s.stage3_prefetch_bucket_size),
      F::Field("stage3_param_persistence_threshold", &s.stage3_param_persistence_threshold),
      F::Field("stage3_max_live_parameters", &s.stage3_max_live_parameters),
      F::Field("sub_group_size", &s.sub_group_size), F::Field("pin_memory", &s.pin_memory),
      F::Field("param_buffer_count", &s.param_buffer_count),
      F::Field("param_buffer_size", &s.param_buffer_size),
      F::Field("param_max_in_cpu", &s.param_max_in_cpu),
      F::Field("optimizer_buffer_count", &s.optimizer_buffer_count),
      F::Field("aio_block_size", &s.aio_block_size),
      F::Field("aio_queue_depth", &s.aio_queue_depth),
      F::Field("aio_intra_op_parallelism", &s.aio_intra_op_parallelism),
      F::Field("gpus_per_node", &s.gpus_per_node), F::Field("num_nodes", &s.num_nodes),
      F::Field("cuda_context_bytes", &s.cuda_context_bytes)));
  MEMPLAN_RETURN_IF_ERROR(s.Validate().WithPrefix("setup JSON"));
  return s;
}

}  // namespace memplan::estimator
