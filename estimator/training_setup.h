// TrainingSetup: how a model is to be trained (precision, optimizer, LoRA/QLoRA, batch and
// sequence, activation checkpointing, tensor parallelism, ZeRO stage and offload, DeepSpeed's
// buffer sizes), as one plain struct that the CLI, JSON and a DeepSpeed config all fill.
//
// The memory model (memory_model.h) reads it; the planner will enumerate it. Names follow
// DeepSpeed's config keys where a DeepSpeed user would look for them (REFERENCE.md §7), and the
// CLI spells each field as one flag (`--zero-stage`, `--offload-optimizer`, ...).
//
// Validation happens where a setup enters: Validate() checks the setup on its own (ranges and
// combinations DeepSpeed or PEFT refuse or that make no sense), ValidateFor() checks it against a
// model (tensor-parallel degree vs heads, sequence length vs learned positions).
//
// Note [Field names in errors]
// The library is called from the CLI, from C and from Python, whose users typed different names
// for the same knob (`--micro-batch`, "micro_batch", micro_batch=). So its errors, and the words
// of its answers (notes, suggestions, rejection reasons), name a field as the setup's or the
// request's JSON spells it, in backquotes: "`micro_batch` must be in [1, 1073741824], got 0",
// "`global_batch` 12 is not a multiple of the 8 GPUs", "an NVMe drive (`nvme_path`)"; never a
// flag. The CLI turns each backquoted field into its flag (tools/setup_flags.h, FieldsToFlags) in
// what it prints for people (error lines and text output), so a CLI user reads "--micro-batch
// ..."; JSON documents keep the field names, the same for every caller. A new field in a message
// needs its flag in that mapping (tools/setup_flags_test.cc scans the library for them).
//
// Thread safety: a plain value; no internal synchronisation.
#pragma once

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/status.h"
#include "estimator/inventory.h"

namespace memplan::estimator {

enum class Precision {
  kFp32,       // fp32 weights, gradients, optimizer states and activations
  kFp16Mixed,  // fp16 working weights, gradients and activations; fp32 master weights and states
  kBf16Mixed,  // the same with bf16
  kBf16Pure,   // bf16 everywhere, optimizer states included; no fp32 master copy
};
enum class Optimizer {
  kAdamW,      // torch AdamW / DeepSpeed (Fused|CPU)Adam: m and v
  kAdam8bit,   // bitsandbytes 8-bit AdamW: block-wise quantised m and v
  kSgd,        // SGD; a momentum buffer only with sgd_momentum > 0 (PyTorch's default is 0)
  kLion,       // one momentum buffer
  kAdafactor,  // factored second moment plus a first moment
};
// Activation checkpointing, as the frameworks name their policies (Note [Checkpointing
// policies] in memory_model.h). `checkpoint_every` K > 1 with kFull checkpoints every K-th
// block only (fms-fsdp's p = 1/K, torchtitan's selective "K", Transformers'
// gradient_checkpointing_enable(every_n_layers=K)).
enum class Checkpointing {
  kNone,       // every layer keeps all its activations
  kSelective,  // Megatron's selective recompute: the attention core (softmax, dropout) recomputed
  kFull,       // each layer keeps its input only and is recomputed in backward
  kOp,         // torchtitan's op-level selective AC: the outputs of matmuls (every other one),
               // attention and reduce-scatters saved, the rest recomputed ("selective op")
};
// How the loss meets the logits.
enum class Loss {
  kFull,     // one logits tensor for the whole micro-batch (Transformers' ForCausalLMLoss)
  kChunked,  // the head and cross-entropy in chunks: torchtune's CEWithChunkedOutputLoss (8),
             // LitGPT's chunked_cross_entropy (128-token chunks)
  kFused,    // a fused linear cross-entropy kernel that never materialises the logits (Liger's
             // LigerFusedLinearCrossEntropyLoss)
};
enum class OffloadDevice { kNone, kCpu, kNvme };
// Which model code and training loop allocate the activations (the model states do not depend on
// it): Hugging Face Transformers (with PEFT and bitsandbytes through Transformers, the Trainer or
// Accelerate), Lit-GPT / LitGPT (its own GPT, LoRA and chunked loss under Lightning Fabric),
// torchtune (its TransformerDecoder, LoRA/QLoRA on torchao NF4, chunked loss), torchtitan (its
// Llama under FSDP2 with its AC modes), or llm-foundry (MPT under Composer).
enum class Framework { kTransformers, kLitGpt, kTorchtune, kTorchtitan, kLlmFoundry };
// PyTorch FSDP's sharding strategy, when FSDP rather than DeepSpeed shards the model states.
enum class FsdpSharding {
  kNone,         // no FSDP (DeepSpeed ZeRO per zero_stage, or plain PyTorch / DDP)
  kFullShard,    // parameters, gradients and optimizer state sharded; units resharded after use
  kShardGradOp,  // gradients and optimizer state sharded; parameters unsharded forward to backward
  kNoShard,      // nothing sharded (FSDP's own choice whenever the world size is 1)
};

std::string_view PrecisionName(Precision p);  // "fp32", "fp16-mixed", "bf16-mixed", "bf16-pure"
std::string_view OptimizerName(Optimizer o);  // "adamw", "adam8bit", "sgd", "lion", "adafactor"
std::string_view CheckpointingName(Checkpointing c);  // "none", "selective", "full", "op"
std::string_view LossName(Loss l);                    // "full", "chunked", "fused"
std::string_view OffloadDeviceName(OffloadDevice d);  // "none", "cpu", "nvme"
std::string_view FrameworkName(Framework f);          // "transformers", "litgpt", "torchtune", ...
std::string_view FsdpShardingName(FsdpSharding f);    // "none", "full_shard", ...
// Inverses; errors list the accepted spellings.
Result<Precision> ParsePrecision(std::string_view text);
Result<Optimizer> ParseOptimizer(std::string_view text);
Result<Checkpointing> ParseCheckpointing(std::string_view text);
Result<Loss> ParseLoss(std::string_view text);
Result<OffloadDevice> ParseOffloadDevice(std::string_view text);
Result<Framework> ParseFramework(std::string_view text);
Result<FsdpSharding> ParseFsdpSharding(std::string_view text);  // also FULL_SHARD, ...

struct TrainingSetup {
  // The largest batch, sequence, accumulation or parallel degree accepted (by Validate and by the
  // DeepSpeed config reader): far beyond any real job, and small enough that products of a few of
  // them cannot overflow 64 bits.
  static constexpr int64_t kMaxCount = int64_t{1} << 24;
  // The largest DeepSpeed buffer size (elements) accepted: 2^50 (DeepSpeed configs write up to
  // 1e12).
  static constexpr int64_t kMaxBufferElements = int64_t{1} << 50;

  Precision precision = Precision::kBf16Mixed;
  Optimizer optimizer = Optimizer::kAdamW;

  // LoRA: rank 0 is full fine-tuning. With a rank, only the adapters train: for each targeted
  // Linear of shape [out, in] an A [r, in] and a B [out, r]; the base model is frozen.
  int64_t lora_rank = 0;
  // Module names (the last component of the module path: "q_proj", "c_attn", "query") or
  // "all-linear" (every Linear inside the repeated blocks). Empty: PEFT's default for the
  // model_type (q/v projections).
  std::vector<std::string> lora_targets;
  // Dropout on each adapter's input; negative: the framework's default (PEFT's and torchtune's
  // 0, LitGPT's 0.05). Above 0 each adapted Linear keeps a mask and the dropped input.
  double lora_dropout = -1;
  bool qlora = false;         // frozen base Linears in NF4 (4.5 bits per parameter)
  bool double_quant = false;  // QLoRA's double quantisation of the scales (4.127 bits)

  int64_t micro_batch = 1;  // sequences per GPU per forward (train_micro_batch_size_per_gpu)
  int64_t seq_len = 0;      // tokens per sequence; 0 = min(model's positions, 2048), or 512
  int64_t grad_accum = 1;   // micro-batches per optimizer step (gradient_accumulation_steps)
  Checkpointing checkpointing = Checkpointing::kNone;
  // With checkpointing full: only every K-th block is checkpointed (1: all of them).
  int64_t checkpoint_every = 1;
  // How the loss meets the logits, and into how many chunks kChunked splits them (0: the
  // framework's own: torchtune's 8; LitGPT's 128-token chunks).
  Loss loss = Loss::kFull;
  int64_t loss_chunks = 0;
  // torch.compile of the model (torchtitan's compile, torchtune's compile, the Trainer's
  // torch_compile): Inductor's partitioner saves the matmul inputs, the attention outputs and
  // the norms' statistics and recomputes the pointwise ops in backward.
  bool torch_compile = false;
  // The GPU architecture the kernels run on ("sm80": A100; sm70 V100, sm86/sm89 RTX 30/40,
  // sm90 H100/H200, sm100 B200): decides which attention kernel SDPA picks (and what it keeps)
  // and the cuBLAS workspace.
  std::string gpu_arch = "sm80";
  // Memory-efficient attention (FlashAttention, SDPA): no s x s score matrices are kept. On by
  // default, as in Transformers since 4.36 (SDPA) and in every memplan command.
  bool flash_attention = true;
  int64_t tp = 1;  // tensor-parallel degree t (Megatron-style)
  // Megatron's sequence parallelism (with tp > 1): the norm and dropout activations, which tensor
  // parallelism alone replicates, are split over the tp ranks too.
  bool sequence_parallel = false;

  // How the optimizer step runs (ZeRO-0, a PyTorch optimizer on the GPU):
  // foreach: torch.optim's multi-tensor path, PyTorch's default on CUDA (one state-sized
  // temporary for the whole step); false: the per-tensor loop (temporaries of the largest tensor).
  bool foreach = true;
  // fused: torch.optim.AdamW(fused=True), one in-place kernel without temporaries (overrides
  // foreach).
  bool fused_optimizer = false;
  // SGD momentum; 0 (PyTorch's default) keeps no momentum buffer.
  double sgd_momentum = 0;
  // Mixed precision through torch.autocast over fp32 parameters (the Hugging Face Trainer or
  // Accelerate without DeepSpeed): fp32 weights and gradients that the optimizer steps directly,
  // no master copy and no fp32 gradient copy, and autocast's 16-bit weight copies through forward
  // and backward. ZeRO-0 only; needs fp16-mixed or bf16-mixed.
  bool autocast = false;
  // torch DistributedDataParallel(gradient_as_bucket_view=...): with false (PyTorch's default) the
  // reducer's buckets hold a second copy of every gradient. ZeRO-0 on more than one GPU only.
  bool gradient_as_bucket_view = false;

  // The training code (see Framework). Lit-GPT: LoRA on its fused QKV Linear (one dropout for the
  // shared input; the zero-padded update kept by index_copy), the fused QKV output kept whole by
  // the value view next to the roped query and key, Fabric's fp32 copy of the chunked logits, and
  // QLoRA quantising every Linear (lm_head included) through fp16.
  Framework framework = Framework::kTransformers;
  // The PyTorch release the job runs ("1.10", "2.1"); empty: a current one. Before 1.11, softmax
  // and log_softmax kept their input for backward as well as their output (pytorch#64000, fixed
  // for 1.11 by #65242).
  std::string torch_version;

  // PyTorch FSDP shards the model states instead of DeepSpeed (zero_stage then stays 0 or names
  // the matching stage: full_shard 3, shard_grad_op 2, no_shard 0). offload_param cpu is FSDP's
  // CPUOffload(offload_params=True): parameters and gradients on the CPU, where the optimizer
  // steps. With one data-parallel rank FSDP uses NO_SHARD whatever is asked.
  FsdpSharding fsdp = FsdpSharding::kNone;

  int zero_stage = 0;                                      // 0 (plain data parallel), 1, 2, 3
  OffloadDevice offload_optimizer = OffloadDevice::kNone;  // stage >= 1; nvme needs stage 3
  OffloadDevice offload_param = OffloadDevice::kNone;      // stage 3 only

  // DeepSpeed zero_optimization buffer sizes, in elements, with DeepSpeed's defaults.
  int64_t reduce_bucket_size = 500000000;
  int64_t allgather_bucket_size = 500000000;
  // Unset: DeepSpeed's behaviour (on for stage 3, off otherwise).
  std::optional<bool> overlap_comm;
  int64_t stage3_prefetch_bucket_size = 50000000;
  int64_t stage3_param_persistence_threshold = 100000;
  int64_t stage3_max_live_parameters = 1000000000;
  int64_t sub_group_size = 1000000000;
  // offload_param / offload_optimizer: pin_memory, and the NVMe swap buffer pools.
  bool pin_memory = false;                // DeepSpeed's default
  int64_t param_buffer_count = 5;         // offload_param.buffer_count
  int64_t param_buffer_size = 100000000;  // offload_param.buffer_size, elements
  int64_t param_max_in_cpu = 1000000000;  // offload_param.max_in_cpu, elements
  int64_t optimizer_buffer_count = 4;     // offload_optimizer.buffer_count
  int64_t aio_block_size = 1048576;       // aio.block_size, bytes (kept for plans)
  int64_t aio_queue_depth = 8;            // aio.queue_depth (kept for plans)
  int64_t aio_intra_op_parallelism = 1;   // aio.intra_op_parallelism: I/O threads per
                                          // transfer (kept for plans)

  int64_t gpus_per_node = 1;
  int64_t num_nodes = 1;
  // Driver + CUDA runtime + kernels, per GPU; measured 1,343 MiB on a V100 (Hugging Face, "model
  // memory anatomy"). Depends on GPU, driver and CUDA version (lazy loading lowers it).
  int64_t cuda_context_bytes = int64_t{1343} << 20;

  // overlap_comm as DeepSpeed applies it.
  bool OverlapComm() const { return overlap_comm.value_or(zero_stage == 3); }
  int64_t WorldSize() const { return gpus_per_node * num_nodes; }
  // Data-parallel degree: world size / tp.
  int64_t DataParallel() const { return WorldSize() / tp; }
  // The FSDP strategy FSDP really uses: NO_SHARD when there is one data-parallel rank
  // (torch/distributed/fsdp/_init_utils.py clamps it, "functionally equivalent").
  FsdpSharding EffectiveFsdp() const {
    return fsdp != FsdpSharding::kNone && DataParallel() == 1 ? FsdpSharding::kNoShard : fsdp;
  }
  // torch_version before MAJOR.MINOR (false when torch_version is empty: a current release).
  bool TorchBefore(int major, int minor) const;
  // lora_dropout as the framework applies it.
  double LoraDropout() const;
  // gpu_arch's compute capability x 10 (sm80 -> 80).
  int GpuSm() const;

  // Ranges and combinations that make no sense on their own: offload without the ZeRO stage that
  // supports it, QLoRA without LoRA, 8-bit Adam on LoRA adapters, an optimizer DeepSpeed cannot
  // offload, a world size tp does not divide. Errors name the field (Note [Field names in errors]).
  Status Validate() const;
  // Validate() plus what depends on the model: tp must divide heads and key/value heads, seq_len
  // must fit learned position tables, LoRA targets must name modules of the model, activations
  // need the architecture.
  Status ValidateFor(const ModelInventory& inventory) const;
  // seq_len with the 0 default resolved for `arch`.
  int64_t SeqLenFor(const ArchitectureInfo* arch) const;
};

// The Linear weights LoRA adapts: 2-D `.weight` tensors inside the repeated blocks whose module's
// last name component is in setup.lora_targets ("all-linear": all of them; empty: PEFT's default
// for the model_type). Errors: a target that matches nothing (listing the module names there are),
// or no default for an unknown model_type.
Result<std::vector<const TensorInfo*>> LoraTargetTensors(const ModelInventory& inventory,
                                                         const TrainingSetup& setup);
// PEFT's default target modules for `model_type` ("llama" -> q_proj, v_proj); empty if unknown.
std::vector<std::string> DefaultLoraTargets(std::string_view model_type);

// Whether Transformers (5.x) runs `model_type` through torch's scaled_dot_product_attention.
// Gemma-2 and gpt-oss refuse it (_supports_sdpa = False), and BLOOM, GPT-J, GPT-Neo and MPT
// have no SDPA path: their default attention is eager, whatever flash_attention says (only
// attn_implementation="flash_attention_2", not modelled, would spare their score matrices).
bool TransformersRunsSdpa(std::string_view model_type);

// JSON form (README "JSON output", key "setup"); FromJson accepts any subset of the keys (absent
// keys keep the defaults) and refuses unknown keys and wrong types, naming them.
nlohmann::json ToJson(const TrainingSetup& setup);
Result<TrainingSetup> TrainingSetupFromJson(const nlohmann::json& json);

}  // namespace memplan::estimator
