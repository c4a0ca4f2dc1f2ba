#include "estimator/training_setup.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <map>
#include <optional>

#include "common/checked_math.h"
#include "common/json.h"

namespace memplan::estimator {
namespace {

// Largest batch, sequence, accumulation or parallel degree accepted: far beyond any real job, and
// small enough that products of a few of them cannot overflow 64 bits.
constexpr int64_t kMaxCount = int64_t{1} << 24;
// Largest DeepSpeed buffer size (elements) accepted: 2^50 (DeepSpeed configs write up to 1e12).
constexpr int64_t kMaxBufferElements = int64_t{1} << 50;

template <typename E>
struct Names {
  E value;
  std::string_view name;
};

constexpr Names<Precision> kPrecisions[] = {{Precision::kFp32, "fp32"},
                                            {Precision::kFp16Mixed, "fp16-mixed"},
                                            {Precision::kBf16Mixed, "bf16-mixed"},
                                            {Precision::kBf16Pure, "bf16-pure"}};
constexpr Names<Optimizer> kOptimizers[] = {{Optimizer::kAdamW, "adamw"},
                                            {Optimizer::kAdam8bit, "adam8bit"},
                                            {Optimizer::kSgd, "sgd"},
                                            {Optimizer::kLion, "lion"},
                                            {Optimizer::kAdafactor, "adafactor"}};
constexpr Names<Checkpointing> kCheckpointings[] = {{Checkpointing::kNone, "none"},
                                                    {Checkpointing::kSelective, "selective"},
                                                    {Checkpointing::kFull, "full"}};
constexpr Names<OffloadDevice> kDevices[] = {
    {OffloadDevice::kNone, "none"}, {OffloadDevice::kCpu, "cpu"}, {OffloadDevice::kNvme, "nvme"}};
constexpr Names<Framework> kFrameworks[] = {{Framework::kTransformers, "transformers"},
                                            {Framework::kLitGpt, "litgpt"}};
constexpr Names<FsdpSharding> kFsdpShardings[] = {{FsdpSharding::kNone, "none"},
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

template <typename E, size_t N>
std::string_view NameOf(const Names<E> (&table)[N], E value) {
  for (const auto& n : table) {
    if (n.value == value) return n.name;
  }
  return "?";
}

template <typename E, size_t N>
Result<E> Parse(const Names<E> (&table)[N], std::string_view text, std::string_view what) {
  std::string accepted;
  for (const auto& n : table) {
    if (n.name == text) return n.value;
    accepted += (accepted.empty() ? "" : ", ") + std::string(n.name);
  }
  return Status::InvalidArgument("unknown " + std::string(what) + " '" + std::string(text) +
                                 "' (expected one of: " + accepted + ")");
}

Status Range(std::string_view flag, int64_t value, int64_t lo, int64_t hi) {
  if (value < lo || value > hi) {
    return Status::InvalidArgument(std::string(flag) + " must be in [" + std::to_string(lo) +
                                   ", " + std::to_string(hi) + "], got " + std::to_string(value));
  }
  return Status::Ok();
}

std::string LastComponent(const std::string& module) {
  size_t dot = module.rfind('.');
  return dot == std::string::npos ? module : module.substr(dot + 1);
}

bool EndsWith(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

// A Linear (or GPT-2 Conv1D) weight inside a repeated block; embedding-like tables excluded.
bool IsBlockLinearWeight(const TensorInfo& t) {
  if (t.block.empty() || t.shape.size() != 2 || !EndsWith(t.name, ".weight")) return false;
  const std::string leaf = LastComponent(t.module);
  return leaf.find("embedding") == std::string::npos &&
         leaf.find("relative_attention_bias") == std::string::npos;
}

}  // namespace

std::string_view PrecisionName(Precision p) { return NameOf(kPrecisions, p); }
std::string_view OptimizerName(Optimizer o) { return NameOf(kOptimizers, o); }
std::string_view CheckpointingName(Checkpointing c) { return NameOf(kCheckpointings, c); }
std::string_view OffloadDeviceName(OffloadDevice d) { return NameOf(kDevices, d); }
std::string_view FrameworkName(Framework f) { return NameOf(kFrameworks, f); }
std::string_view FsdpShardingName(FsdpSharding f) { return NameOf(kFsdpShardings, f); }
Result<Framework> ParseFramework(std::string_view text) {
  if (text == "lit-gpt") return Framework::kLitGpt;
  return Parse(kFrameworks, text, "framework");
}
Result<FsdpSharding> ParseFsdpSharding(std::string_view text) {
  std::string lower(text);
  for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return Parse(kFsdpShardings, lower, "FSDP sharding strategy");
}

bool TrainingSetup::TorchBefore(int major, int minor) const {
  int have_major = 0, have_minor = 0;
  if (torch_version.empty() || !ParseTorchVersion(torch_version, &have_major, &have_minor)) {
    return false;
  }
  return have_major < major || (have_major == major && have_minor < minor);
}

Result<Precision> ParsePrecision(std::string_view text) {
  return Parse(kPrecisions, text, "precision");
}
Result<Optimizer> ParseOptimizer(std::string_view text) {
  return Parse(kOptimizers, text, "optimizer");
}
Result<Checkpointing> ParseCheckpointing(std::string_view text) {
  return Parse(kCheckpointings, text, "checkpointing");
}
Result<OffloadDevice> ParseOffloadDevice(std::string_view text) {
  return Parse(kDevices, text, "offload device");
}

Status TrainingSetup::Validate() const {
  MEMPLAN_RETURN_IF_ERROR(Range("`micro_batch`", micro_batch, 1, kMaxCount));
  MEMPLAN_RETURN_IF_ERROR(Range("`seq_len`", seq_len, 0, kMaxCount));
  MEMPLAN_RETURN_IF_ERROR(Range("`grad_accum`", grad_accum, 1, kMaxCount));
  MEMPLAN_RETURN_IF_ERROR(Range("`tp`", tp, 1, kMaxCount));
  MEMPLAN_RETURN_IF_ERROR(Range("`zero_stage`", zero_stage, 0, 3));
  MEMPLAN_RETURN_IF_ERROR(Range("`lora_rank`", lora_rank, 0, 65536));
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
  MEMPLAN_RETURN_IF_ERROR(
      Range("offload_optimizer.buffer_count", optimizer_buffer_count, 1, 1024));
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
      return Status::InvalidArgument("`fsdp` offloads to the CPU only (CPUOffload); NVMe offload is "
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
    return Status::InvalidArgument("double quantisation applies to QLoRA's 4-bit base: add `qlora`");
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
  if (arch != nullptr && arch->max_positions > 0) return std::min<int64_t>(arch->max_positions, 2048);
  return 512;
}

std::vector<std::string> DefaultLoraTargets(std::string_view model_type) {
  // peft.utils.constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.
  static const auto* kDefaults = new std::map<std::string, std::vector<std::string>, std::less<>>{
      {"gpt2", {"c_attn"}},          {"gpt_neox", {"query_key_value"}},
      {"llama", {"q_proj", "v_proj"}}, {"mistral", {"q_proj", "v_proj"}},
      {"mixtral", {"q_proj", "v_proj"}}, {"qwen2", {"q_proj", "v_proj"}},
      {"gemma", {"q_proj", "v_proj"}}, {"bert", {"query", "value"}},
      {"roberta", {"query", "value"}}, {"t5", {"q", "v"}},
      {"qwen3", {"q_proj", "v_proj"}}, {"gemma2", {"q_proj", "v_proj"}},
      {"gemma3_text", {"q_proj", "v_proj"}}, {"phi", {"q_proj", "v_proj", "fc1", "fc2"}},
      {"falcon", {"query_key_value"}}, {"bloom", {"query_key_value"}},
      {"gptj", {"q_proj", "v_proj"}}, {"opt", {"q_proj", "v_proj"}},
      {"xlm-roberta", {"query", "value"}},
  };
  auto it = kDefaults->find(model_type);
  return it == kDefaults->end() ? std::vector<std::string>{} : it->second;
}

Result<std::vector<const TensorInfo*>> LoraTargetTensors(const ModelInventory& inventory,
                                                         const TrainingSetup& setup) {
  std::vector<std::string> targets = setup.lora_targets;
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
  for (const TensorInfo& t : inventory.tensors) {
    if (!IsBlockLinearWeight(t)) continue;
    const std::string leaf = LastComponent(t.module);
    available.insert(leaf);
    if (all || std::find(targets.begin(), targets.end(), leaf) != targets.end()) {
      out.push_back(&t);
      matched.insert(leaf);
    }
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
        inventory.name + ": activation memory needs the architecture (hidden size, heads, MLP "
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
      {"qlora", s.qlora},
      {"double_quant", s.double_quant},
      {"micro_batch", s.micro_batch},
      {"seq_len", s.seq_len},
      {"grad_accum", s.grad_accum},
      {"checkpointing", std::string(CheckpointingName(s.checkpointing))},
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
  static const std::vector<std::string> kKeys = {
      "precision", "optimizer", "lora_rank", "lora_targets", "qlora", "double_quant",
      "micro_batch", "seq_len", "grad_accum", "checkpointing", "flash_attention", "tp",
      "sequence_parallel", "foreach", "fused_optimizer", "sgd_momentum", "autocast",
      "gradient_as_bucket_view", "framework", "torch_version", "fsdp",
      "zero_stage", "offload_optimizer", "offload_param", "reduce_bucket_size",
      "allgather_bucket_size", "overlap_comm", "stage3_prefetch_bucket_size",
      "stage3_param_persistence_threshold", "stage3_max_live_parameters", "sub_group_size",
      "pin_memory", "param_buffer_count", "param_buffer_size", "param_max_in_cpu",
      "optimizer_buffer_count",
      "aio_block_size", "aio_queue_depth", "aio_intra_op_parallelism", "gpus_per_node",
      "num_nodes", "cuda_context_bytes"};
  const JsonFieldReader r(j, "setup JSON");
  MEMPLAN_RETURN_IF_ERROR(r.CheckKeys(kKeys));
  TrainingSetup s;
  MEMPLAN_RETURN_IF_ERROR(r.Enum("precision", ParsePrecision, &s.precision));
  MEMPLAN_RETURN_IF_ERROR(r.Enum("optimizer", ParseOptimizer, &s.optimizer));
  MEMPLAN_RETURN_IF_ERROR(r.Get("lora_rank", &s.lora_rank));
  MEMPLAN_RETURN_IF_ERROR(r.Get("lora_targets", &s.lora_targets));
  MEMPLAN_RETURN_IF_ERROR(r.Get("qlora", &s.qlora));
  MEMPLAN_RETURN_IF_ERROR(r.Get("double_quant", &s.double_quant));
  MEMPLAN_RETURN_IF_ERROR(r.Get("micro_batch", &s.micro_batch));
  MEMPLAN_RETURN_IF_ERROR(r.Get("seq_len", &s.seq_len));
  MEMPLAN_RETURN_IF_ERROR(r.Get("grad_accum", &s.grad_accum));
  MEMPLAN_RETURN_IF_ERROR(r.Enum("checkpointing", ParseCheckpointing, &s.checkpointing));
  MEMPLAN_RETURN_IF_ERROR(r.Get("flash_attention", &s.flash_attention));
  MEMPLAN_RETURN_IF_ERROR(r.Get("tp", &s.tp));
  MEMPLAN_RETURN_IF_ERROR(r.Get("sequence_parallel", &s.sequence_parallel));
  MEMPLAN_RETURN_IF_ERROR(r.Get("foreach", &s.foreach));
  MEMPLAN_RETURN_IF_ERROR(r.Get("fused_optimizer", &s.fused_optimizer));
  MEMPLAN_RETURN_IF_ERROR(r.Get("sgd_momentum", &s.sgd_momentum));
  MEMPLAN_RETURN_IF_ERROR(r.Get("autocast", &s.autocast));
  MEMPLAN_RETURN_IF_ERROR(r.Get("gradient_as_bucket_view", &s.gradient_as_bucket_view));
  MEMPLAN_RETURN_IF_ERROR(r.Enum("framework", ParseFramework, &s.framework));
  MEMPLAN_RETURN_IF_ERROR(r.Get("torch_version", &s.torch_version));
  MEMPLAN_RETURN_IF_ERROR(r.Enum("fsdp", ParseFsdpSharding, &s.fsdp));
  MEMPLAN_RETURN_IF_ERROR(r.Get("zero_stage", &s.zero_stage));
  MEMPLAN_RETURN_IF_ERROR(
      r.Enum("offload_optimizer", ParseOffloadDevice, &s.offload_optimizer));
  MEMPLAN_RETURN_IF_ERROR(r.Enum("offload_param", ParseOffloadDevice, &s.offload_param));
  MEMPLAN_RETURN_IF_ERROR(r.Get("reduce_bucket_size", &s.reduce_bucket_size));
  MEMPLAN_RETURN_IF_ERROR(r.Get("allgather_bucket_size", &s.allgather_bucket_size));
  if (r.Has("overlap_comm")) {
    bool overlap = false;
    MEMPLAN_RETURN_IF_ERROR(r.Get("overlap_comm", &overlap));
    s.overlap_comm = overlap;
  }
  MEMPLAN_RETURN_IF_ERROR(
      r.Get("stage3_prefetch_bucket_size", &s.stage3_prefetch_bucket_size));
  MEMPLAN_RETURN_IF_ERROR(r.Get("stage3_param_persistence_threshold",
                                 &s.stage3_param_persistence_threshold));
  MEMPLAN_RETURN_IF_ERROR(
      r.Get("stage3_max_live_parameters", &s.stage3_max_live_parameters));
  MEMPLAN_RETURN_IF_ERROR(r.Get("sub_group_size", &s.sub_group_size));
  MEMPLAN_RETURN_IF_ERROR(r.Get("pin_memory", &s.pin_memory));
  MEMPLAN_RETURN_IF_ERROR(r.Get("param_buffer_count", &s.param_buffer_count));
  MEMPLAN_RETURN_IF_ERROR(r.Get("param_buffer_size", &s.param_buffer_size));
  MEMPLAN_RETURN_IF_ERROR(r.Get("param_max_in_cpu", &s.param_max_in_cpu));
  MEMPLAN_RETURN_IF_ERROR(r.Get("optimizer_buffer_count", &s.optimizer_buffer_count));
  MEMPLAN_RETURN_IF_ERROR(r.Get("aio_block_size", &s.aio_block_size));
  MEMPLAN_RETURN_IF_ERROR(r.Get("aio_queue_depth", &s.aio_queue_depth));
  MEMPLAN_RETURN_IF_ERROR(r.Get("aio_intra_op_parallelism", &s.aio_intra_op_parallelism));
  MEMPLAN_RETURN_IF_ERROR(r.Get("gpus_per_node", &s.gpus_per_node));
  MEMPLAN_RETURN_IF_ERROR(r.Get("num_nodes", &s.num_nodes));
  MEMPLAN_RETURN_IF_ERROR(r.Get("cuda_context_bytes", &s.cuda_context_bytes));
  MEMPLAN_RETURN_IF_ERROR(s.Validate().WithPrefix("setup JSON"));
  return s;
}

// --- DeepSpeed config -------------------------------------------------------------------------

namespace {

// Typed reads of one DeepSpeed config object with "auto" detection. `path` is the key's dotted
// path for errors ("zero_optimization.reduce_bucket_size").
class DsReader {
 public:
  DsReader(const nlohmann::json& j, std::string source, std::string prefix)
      : j_(j), source_(std::move(source)), prefix_(std::move(prefix)) {}

  bool Has(const char* key) const { return j_.is_object() && j_.contains(key) && !j_[key].is_null(); }
  bool IsAuto(const char* key) const {
    return Has(key) && j_[key].is_string() && j_[key].get<std::string>() == "auto";
  }
  const nlohmann::json& At(const char* key) const { return j_[key]; }
  std::string Path(const char* key) const { return prefix_ + key; }

  Status Error(const char* key, const std::string& problem) const {
    return Status::InvalidArgument(source_ + ": '" + Path(key) + "' " + problem);
  }
  // "auto" with no way to fill it.
  Status AutoError(const char* key, const std::string& flag) const {
    return Error(key, "is \"auto\", which only the Hugging Face Trainer fills in; pass " + flag +
                          " to give its value");
  }

  // An integer in [lo, hi]; JSON floats with an integral value (5e8) are accepted.
  Status Int(const char* key, int64_t lo, int64_t hi, int64_t* out) const {
    if (!Has(key)) return Status::Ok();
    const nlohmann::json& v = j_[key];
    if (!v.is_number()) return Error(key, "must be a number, got " + v.dump());
    double d = v.get<double>();
    if (!std::isfinite(d) || std::floor(d) != d || d < static_cast<double>(lo) ||
        d > static_cast<double>(hi)) {
      return Error(key, "must be an integer in [" + std::to_string(lo) + ", " +
                            std::to_string(hi) + "], got " + v.dump());
    }
    *out = v.is_number_integer() ? v.get<int64_t>() : static_cast<int64_t>(d);
    return Status::Ok();
  }
  Status Bool(const char* key, bool* out) const {
    if (!Has(key)) return Status::Ok();
    if (!j_[key].is_boolean()) return Error(key, "must be true or false, got " + j_[key].dump());
    *out = j_[key].get<bool>();
    return Status::Ok();
  }
  Status String(const char* key, std::string* out) const {
    if (!Has(key)) return Status::Ok();
    if (!j_[key].is_string()) return Error(key, "must be a string, got " + j_[key].dump());
    *out = j_[key].get<std::string>();
    return Status::Ok();
  }
  // A sub-object (absent: an empty object), refusing other types.
  Result<nlohmann::json> Object(const char* key) const {
    if (!Has(key)) return nlohmann::json::object();
    if (!j_[key].is_object()) return Error(key, "must be an object");
    return j_[key];
  }

 private:
  const nlohmann::json& j_;
  std::string source_;
  std::string prefix_;
};

// A bucket size that may be "auto": the Trainer fills it from the model width.
Status BucketSize(const DsReader& r, const char* key, int64_t hidden, double factor,
                  int64_t* out) {
  if (r.IsAuto(key)) {
    if (hidden <= 0) {
      return r.Error(key, "is \"auto\" and the model's hidden size is unknown; give a number");
    }
    *out = static_cast<int64_t>(factor * static_cast<double>(hidden) * static_cast<double>(hidden));
    return Status::Ok();
  }
  return r.Int(key, 0, kMaxBufferElements, out);
}

Status Device(const DsReader& r, const char* key, OffloadDevice* out) {
  if (!r.Has(key)) return Status::Ok();
  std::string text;
  MEMPLAN_RETURN_IF_ERROR(r.String(key, &text));
  Result<OffloadDevice> device = ParseOffloadDevice(text);
  if (!device.ok()) return r.Error(key, "must be \"none\", \"cpu\" or \"nvme\", got \"" + text + "\"");
  *out = *device;
  return Status::Ok();
}

}  // namespace

Status ApplyDeepSpeedConfig(const nlohmann::json& config, const std::string& source,
                            const std::set<std::string>& supplied, int64_t hidden,
                            TrainingSetup* setup) {
  if (!config.is_object()) {
    return Status::InvalidArgument(source + ": expected a JSON object (a DeepSpeed config)");
  }
  TrainingSetup s = *setup;
  auto given = [&](const char* field) { return supplied.count(field) > 0; };
  DsReader top(config, source, "");

  // Batch.
  if (top.IsAuto("train_micro_batch_size_per_gpu")) {
    if (!given("micro_batch")) return top.AutoError("train_micro_batch_size_per_gpu", "`micro_batch`");
  } else if (!given("micro_batch")) {
    MEMPLAN_RETURN_IF_ERROR(top.Int("train_micro_batch_size_per_gpu", 1, kMaxCount, &s.micro_batch));
  }
  if (top.IsAuto("gradient_accumulation_steps")) {
    if (!given("grad_accum")) return top.AutoError("gradient_accumulation_steps", "`grad_accum`");
  } else if (!given("grad_accum")) {
    MEMPLAN_RETURN_IF_ERROR(top.Int("gradient_accumulation_steps", 1, kMaxCount, &s.grad_accum));
  }

  // Precision: fp16.enabled / bf16.enabled (older configs: "bfloat16").
  MEMPLAN_ASSIGN_OR_RETURN(nlohmann::json fp16, top.Object("fp16"));
  MEMPLAN_ASSIGN_OR_RETURN(nlohmann::json bf16, top.Object(top.Has("bf16") ? "bf16" : "bfloat16"));
  DsReader fp16_r(fp16, source, "fp16.");
  DsReader bf16_r(bf16, source, top.Has("bf16") ? "bf16." : "bfloat16.");
  if (!given("precision")) {
    if (fp16_r.IsAuto("enabled")) return fp16_r.AutoError("enabled", "`precision`");
    if (bf16_r.IsAuto("enabled")) return bf16_r.AutoError("enabled", "`precision`");
    bool fp16_on = false, bf16_on = false;
    MEMPLAN_RETURN_IF_ERROR(fp16_r.Bool("enabled", &fp16_on));
    MEMPLAN_RETURN_IF_ERROR(bf16_r.Bool("enabled", &bf16_on));
    if (fp16_on && bf16_on) {
      return Status::InvalidArgument(source +
                                     ": 'fp16.enabled' and 'bf16.enabled' are both true; "
                                     "DeepSpeed accepts one of them");
    }
    if (fp16_on) {
      s.precision = Precision::kFp16Mixed;
    } else if (bf16_on) {
      s.precision = Precision::kBf16Mixed;
    } else {
      // Neither enabled (or neither section at all): DeepSpeed trains in fp32.
      s.precision = Precision::kFp32;
    }
  }

  // Optimizer.
  MEMPLAN_ASSIGN_OR_RETURN(nlohmann::json opt, top.Object("optimizer"));
  DsReader opt_r(opt, source, "optimizer.");
  if (opt_r.Has("type") && !given("optimizer")) {
    std::string type;
    MEMPLAN_RETURN_IF_ERROR(opt_r.String("type", &type));
    std::string lower;
    for (char c : type) lower.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
    if (lower == "adam" || lower == "adamw" || lower == "fusedadam" || lower == "cpuadam" ||
        lower == "onebitadam" || lower == "zerooneadam") {
      s.optimizer = Optimizer::kAdamW;
    } else if (lower == "lion" || lower == "fusedlion") {
      s.optimizer = Optimizer::kLion;
    } else {
      return opt_r.Error("type", "'" + type +
                                     "' is not an optimizer memplan models (Adam, AdamW, Lion; "
                                     "pass --optimizer for others)");
    }
    // DeepSpeed builds its own kernels for these (runtime/engine.py _configure_basic_optimizer:
    // FusedAdam, FusedLion, CPU Adam), which update in place, unless params.torch_adam asks for
    // torch.optim's.
    MEMPLAN_ASSIGN_OR_RETURN(nlohmann::json params, opt_r.Object("params"));
    DsReader params_r(params, source, "optimizer.params.");
    bool torch_adam = false;
    MEMPLAN_RETURN_IF_ERROR(params_r.Bool("torch_adam", &torch_adam));
    if (!given("fused_optimizer")) s.fused_optimizer = !torch_adam;
  }

  // ZeRO.
  MEMPLAN_ASSIGN_OR_RETURN(nlohmann::json zero, top.Object("zero_optimization"));
  DsReader z(zero, source, "zero_optimization.");
  int64_t stage = s.zero_stage;
  for (const char* key : {"allgather_bucket_size", "stage3_max_live_parameters",
                          "sub_group_size", "stage"}) {
    if (z.IsAuto(key)) {
      return z.Error(key, "is \"auto\", which the Hugging Face Trainer does not fill either; "
                          "give a number");
    }
  }
  MEMPLAN_RETURN_IF_ERROR(z.Int("stage", 0, 3, &stage));
  if (!given("zero_stage")) s.zero_stage = static_cast<int>(stage);
  bool legacy_cpu_offload = false;
  MEMPLAN_RETURN_IF_ERROR(z.Bool("cpu_offload", &legacy_cpu_offload));
  if (legacy_cpu_offload && !given("offload_optimizer")) s.offload_optimizer = OffloadDevice::kCpu;
  if (z.Has("overlap_comm")) {
    bool overlap = false;
    MEMPLAN_RETURN_IF_ERROR(z.Bool("overlap_comm", &overlap));
    s.overlap_comm = overlap;
  }
  MEMPLAN_RETURN_IF_ERROR(BucketSize(z, "reduce_bucket_size", hidden, 1.0, &s.reduce_bucket_size));
  MEMPLAN_RETURN_IF_ERROR(z.Int("allgather_bucket_size", 0, kMaxBufferElements,
                                &s.allgather_bucket_size));
  MEMPLAN_RETURN_IF_ERROR(BucketSize(z, "stage3_prefetch_bucket_size", hidden, 0.9,
                                     &s.stage3_prefetch_bucket_size));
  if (z.IsAuto("stage3_param_persistence_threshold")) {
    if (hidden <= 0) {
      return z.Error("stage3_param_persistence_threshold",
                     "is \"auto\" and the model's hidden size is unknown; give a number");
    }
    s.stage3_param_persistence_threshold = 10 * hidden;
  } else {
    MEMPLAN_RETURN_IF_ERROR(z.Int("stage3_param_persistence_threshold", 0, kMaxBufferElements,
                                  &s.stage3_param_persistence_threshold));
  }
  MEMPLAN_RETURN_IF_ERROR(z.Int("stage3_max_live_parameters", 0, kMaxBufferElements,
                                &s.stage3_max_live_parameters));
  MEMPLAN_RETURN_IF_ERROR(z.Int("sub_group_size", 0, kMaxBufferElements, &s.sub_group_size));

  MEMPLAN_ASSIGN_OR_RETURN(nlohmann::json off_opt, z.Object("offload_optimizer"));
  DsReader oo(off_opt, source, "zero_optimization.offload_optimizer.");
  OffloadDevice optimizer_device = s.offload_optimizer;
  MEMPLAN_RETURN_IF_ERROR(Device(oo, "device", &optimizer_device));
  if (!given("offload_optimizer")) s.offload_optimizer = optimizer_device;
  MEMPLAN_RETURN_IF_ERROR(oo.Bool("pin_memory", &s.pin_memory));
  MEMPLAN_RETURN_IF_ERROR(oo.Int("buffer_count", 1, 1024, &s.optimizer_buffer_count));
  MEMPLAN_ASSIGN_OR_RETURN(nlohmann::json off_param, z.Object("offload_param"));
  DsReader op(off_param, source, "zero_optimization.offload_param.");
  OffloadDevice param_device = s.offload_param;
  MEMPLAN_RETURN_IF_ERROR(Device(op, "device", &param_device));
  if (!given("offload_param")) s.offload_param = param_device;
  bool param_pin = false;
  MEMPLAN_RETURN_IF_ERROR(op.Bool("pin_memory", &param_pin));
  s.pin_memory = s.pin_memory || param_pin;
  MEMPLAN_RETURN_IF_ERROR(op.Int("buffer_count", 1, 1024, &s.param_buffer_count));
  MEMPLAN_RETURN_IF_ERROR(op.Int("buffer_size", 0, kMaxBufferElements, &s.param_buffer_size));
  MEMPLAN_RETURN_IF_ERROR(op.Int("max_in_cpu", 0, kMaxBufferElements, &s.param_max_in_cpu));

  // Activation checkpointing: DeepSpeed's block configures deepspeed.checkpointing, which
  // checkpoints whole layers; its presence says the job checkpoints.
  if (top.Has("activation_checkpointing") && !given("checkpointing")) {
    MEMPLAN_ASSIGN_OR_RETURN(nlohmann::json ac, top.Object("activation_checkpointing"));
    (void)ac;
    s.checkpointing = Checkpointing::kFull;
  }

  MEMPLAN_ASSIGN_OR_RETURN(nlohmann::json aio, top.Object("aio"));
  DsReader aio_r(aio, source, "aio.");
  MEMPLAN_RETURN_IF_ERROR(aio_r.Int("block_size", 1, kMaxBufferElements, &s.aio_block_size));
  MEMPLAN_RETURN_IF_ERROR(aio_r.Int("queue_depth", 1, 1 << 16, &s.aio_queue_depth));
  MEMPLAN_RETURN_IF_ERROR(
      aio_r.Int("intra_op_parallelism", 1, 64, &s.aio_intra_op_parallelism));

  // train_batch_size = micro * accumulation * data-parallel world: DeepSpeed derives the micro
  // batch from it when train_micro_batch_size_per_gpu is absent, and checks it when both are set.
  if (top.Has("train_batch_size") && !top.IsAuto("train_batch_size") &&
      !top.Has("train_micro_batch_size_per_gpu") && !given("micro_batch") && s.tp >= 1 &&
      s.WorldSize() % s.tp == 0) {
    int64_t total = 0;
    MEMPLAN_RETURN_IF_ERROR(top.Int("train_batch_size", 1, int64_t{1} << 50, &total));
    // --gpus x --nodes reach 2^40, the accumulation 2^24: the product is checked. Past 2^63 no
    // total can fill a micro-batch; the check below then reports the mismatch.
    const std::optional<int64_t> per_micro = CheckedMulInt64(s.grad_accum, s.DataParallel());
    s.micro_batch = per_micro ? std::max<int64_t>(1, total / *per_micro) : 1;
  }
  if (top.Has("train_batch_size") && !top.IsAuto("train_batch_size")) {
    int64_t total = 0;
    MEMPLAN_RETURN_IF_ERROR(top.Int("train_batch_size", 1, int64_t{1} << 50, &total));
    const std::optional<int64_t> product =
        CheckedProductInt64({s.micro_batch, s.grad_accum, s.DataParallel()});
    const std::string want = product ? std::to_string(*product) : "more than 2^63";
    if (s.tp >= 1 && s.WorldSize() % s.tp == 0 && product != total) {
      return top.Error("train_batch_size",
                       "is " + std::to_string(total) + " but micro batch " +
                           std::to_string(s.micro_batch) + " x accumulation " +
                           std::to_string(s.grad_accum) + " x " + std::to_string(s.DataParallel()) +
                           " data-parallel GPUs = " + want);
    }
  }
  MEMPLAN_RETURN_IF_ERROR(s.Validate().WithPrefix(source));
  *setup = s;
  return Status::Ok();
}

}  // namespace memplan::estimator
