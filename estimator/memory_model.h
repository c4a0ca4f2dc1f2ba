// The itemised training-memory model: every byte a training step needs, per tier (per GPU; per
// node CPU, NVMe, and pinned host memory as a subset of CPU), per phase of the step.
//
// Beyond DeepSpeed's model states (deepspeed.h, kept exact and separate) it counts activations
// from the architecture (Korthikanti et al. 2022, generalised to GQA, gated MLPs, MoE top-k,
// dropout on/off, flash attention, selective/full recompute and tensor parallelism), logits and
// loss, communication buckets, ZeRO-3 live-parameter and prefetch buffers, NVMe swap buffers, the
// optimizer-step transient, the CUDA context and the caching allocator's margin.
//
// Note [Phases]
// A step passes through phases that hold different things: at the end of the forward pass every
// layer's saved activations and the logits are live; at the start of the backward pass those are
// still live, plus the logits' gradient, the one layer being recomputed (checkpointing) and that
// layer's gradient temporaries; at the end of the backward pass the activations are gone and all
// gradients exist; in the optimizer step the fp32 gradients and the optimizer's temporaries
// appear. Memory falls monotonically through the backward pass in between (each layer frees more
// activation than it adds gradient), so these four points bound it. The peak is the largest phase
// total, never a sum of per-item maxima, and the report says which phase sets it.
//
// Note [Gradient storage]
// Gradients count in every phase where they persist: DeepSpeed keeps its gradient partitions (and
// DDP its buckets) allocated across steps, gradient accumulation carries them through the forward
// pass, and before PyTorch 2.0 zero_grad() zeroed them in place. A plain loop with
// zero_grad(set_to_none=True) (the default since 2.0), one micro-batch per step, one GPU and no
// DeepSpeed or FSDP has none in its forward; the first layer of backward holds the head's and
// its block's (`grads_first_layer`), the end of backward all of them (`grads`), as the step model
// runs it.
//
// Every constant used is returned in `constants`, with its value and where it comes from.
//
// Thread safety: pure functions over plain values.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"
#include "estimator/inventory.h"
#include "estimator/step_model.h"
#include "estimator/training_setup.h"

namespace memplan::estimator {

// Phases of a training step (see Note [Phases]), as bits for MemoryItem::phases.
enum Phase : unsigned {
  kPhaseForward = 1,        // "forward": end of the forward pass
  kPhaseBackward = 2,       // "backward": first layer of backward, recomputed if checkpointing
  kPhaseBackwardEnd = 4,    // "backward_end": all gradients produced
  kPhaseOptimizerStep = 8,  // "optimizer_step"
  kAllPhases = 15,
};
constexpr Phase kPhases[] = {kPhaseForward, kPhaseBackward, kPhaseBackwardEnd, kPhaseOptimizerStep};
std::string PhaseName(Phase phase);

struct MemoryItem {
  std::string name;              // stable key: "params_working", "activations", ...
  std::string description;       // one line for people: what it is, dtype, how it is split
  uint64_t gpu_bytes = 0;        // per GPU
  uint64_t cpu_bytes = 0;        // per node, pinned included
  uint64_t nvme_bytes = 0;       // per node
  uint64_t pinned_bytes = 0;     // per node, a part of cpu_bytes
  unsigned phases = kAllPhases;  // Phase bits where the item is live
  // The GPU bytes in each phase (kPhases order) for an item whose size changes from phase to
  // phase (the step model's, Note [Items from the step model]); gpu_bytes is then their
  // maximum. Empty: gpu_bytes in every phase of `phases`.
  std::vector<uint64_t> gpu_phase_bytes;

  // The item's GPU bytes in `phase` (a single Phase bit): 0 where it is not live.
  uint64_t GpuBytesIn(Phase phase) const;
};

// Tier totals of one phase. gpu_bytes includes the allocator margin and the CUDA context.
struct PhaseTotals {
  std::string phase;
  uint64_t gpu_bytes = 0;
  uint64_t gpu_allocated_bytes = 0;  // what torch.cuda.max_memory_allocated would show
  uint64_t cpu_bytes = 0;
  uint64_t nvme_bytes = 0;
  uint64_t pinned_bytes = 0;
};

// Each tier's maximum over the phases; `phase` is the phase that sets the GPU peak.
struct PeakMemory {
  uint64_t gpu_bytes = 0;
  // What torch.cuda.max_memory_reserved would show on a GPU with room to spare (no CUDA
  // context): the caching allocator keeps what it freed instead of giving it back (Note [The
  // caching allocator's reserve]). gpu_bytes is what the step needs: on a full GPU the allocator
  // gives back its wholly free segments and tries again.
  uint64_t gpu_reserved_bytes = 0;
  uint64_t cpu_bytes = 0;
  uint64_t nvme_bytes = 0;
  uint64_t pinned_bytes = 0;
  std::string phase;
};

// A constant the model used: name, value, unit, and why that value.
struct ModelConstant {
  std::string name;
  double value = 0;
  std::string unit;
  std::string source;
};

struct MemoryEstimate {
  TrainingSetup setup;                      // as used: seq_len resolved, gpus/nodes filled
  uint64_t params_total = 0;                // model parameters (tied once), adapters excluded
  uint64_t trainable_params = 0;            // all of them, or the LoRA adapters
  uint64_t lora_params = 0;                 // adapter parameters; 0 without LoRA
  uint64_t activation_bytes_per_layer = 0;  // one (decoder or only) layer as saved, per GPU
  std::vector<MemoryItem> items;            // the breakdown, in report order
  std::vector<PhaseTotals> phases;          // in step order
  PeakMemory peak;
  std::vector<ModelConstant> constants;
  std::vector<std::string> notes;  // assumptions in sentences
  // The step model's run (Note [The step model] in step_model.h), when it knows the setup's
  // training code.
  std::optional<StepModel> step;
  std::string step_error;  // why the step model did not run, when it did not
  // The step model refused the setup as one it does not model yet (kUnimplemented), rather than
  // failing on it (an overflow, a bad LoRA target).
  bool step_unmodelled = false;
};

// The model for one setup. Errors: setup.ValidateFor(inventory) failures (bad combinations, an
// inventory without architecture), overflow.
Result<MemoryEstimate> EstimateMemory(const ModelInventory& inventory, const TrainingSetup& setup);
// The same, for a caller that has counted the inventory already (`counts` must be
// CountParams(inventory)): a per-expert DeepSeek-V3 has 45,000 tensors to count. `step_model`
// false skips the step model (MemoryEstimate::step stays empty): the planner, which judges fit by
// the itemised peak, evaluates hundreds of configurations.
Result<MemoryEstimate> EstimateMemory(const ModelInventory& inventory, const TrainingSetup& setup,
                                      const ModelCounts& counts, bool step_model = true);

// Step-model runs kept from one EstimateMemory call to the next on the same inventory (Note
// [Reusing a step]): the planner tries one setup under many ZeRO stages, offloads, buffer sizes
// and cluster sizes, and the step model tells only a few of them apart. Thread-safe: capacity's
// searches share one.
class StepModelCache {
 public:
  size_t runs() const;  // step-model runs made (and kept)
  size_t hits() const;  // estimates that reused one

 private:
  friend struct StepCacheAccess;
  struct Run {
    StepStates states;
    std::optional<StepModel> step;
    Status error;
  };
  mutable std::mutex mu_;
  std::map<std::string, Run> runs_;
  size_t hits_ = 0;
};

// The same as EstimateMemory(inventory, setup, counts), reusing `cache`'s step-model runs (made
// on this inventory) where the step model cannot tell the setups apart.
Result<MemoryEstimate> EstimateMemory(const ModelInventory& inventory, const TrainingSetup& setup,
                                      const ModelCounts& counts, StepModelCache* cache);

// One row of the stage x offload comparison: the same setup with another ZeRO stage and offload.
struct ComparisonRow {
  int zero_stage = 0;
  OffloadDevice offload_optimizer = OffloadDevice::kNone;
  OffloadDevice offload_param = OffloadDevice::kNone;
  bool valid = false;
  std::string reason;  // why not valid (the validation error)
  PeakMemory peak;
  uint64_t activations_gpu_bytes = 0;  // activations + recompute + logits at the GPU peak phase
};

// ZeRO 0; 1 and 2 with optimizer offload none/cpu; 3 with (optimizer, param) in (none, none),
// (cpu, none), (cpu, cpu), (nvme, none), (nvme, cpu), (nvme, nvme). Rows the setup cannot run
// (an optimizer DeepSpeed cannot offload, QLoRA with parameter offload) are kept with a reason.
Result<std::vector<ComparisonRow>> CompareZeroStages(const ModelInventory& inventory,
                                                     const TrainingSetup& setup);
Result<std::vector<ComparisonRow>> CompareZeroStages(const ModelInventory& inventory,
                                                     const TrainingSetup& setup,
                                                     const ModelCounts& counts);

// --- Building blocks, exposed for tests -------------------------------------------------------

// The ZeRO paper's per-GPU model-state accounting (Rajbhandari et al. 2020, §5): 2 bytes of fp16
// parameters and 2 of fp16 gradients per parameter, plus K bytes of optimizer state (K = 12 for
// mixed-precision Adam), partitioned over `gpus` by stage: 0 (2+2+K)P; 1 4P + KP/N;
// 2 2P + (2+K)P/N; 3 (4+K)P/N. Exact rational arithmetic, truncated to bytes.
uint64_t ZeroPaperBytesPerGpu(uint64_t params, uint64_t gpus, int stage, uint64_t k = 12);

// One transformer layer's shape for activation counting.
struct LayerShape {
  int64_t seq = 0;     // s (query side)
  int64_t kv_seq = 0;  // keys/values length (s for self-attention; encoder's for cross)
  int64_t batch = 0;   // b
  int64_t hidden = 0;  // h
  int64_t heads = 0;   // a
  int64_t kv_heads = 0;
  int64_t head_dim = 0;
  int64_t ffn = 0;      // f
  bool gated = false;   // SwiGLU/GeGLU
  int64_t experts = 0;  // 0 = dense
  int64_t top_k = 0;
  bool hidden_dropout = false;
  bool attention_dropout = false;
  bool cross_attention = false;  // an encoder-decoder attention block follows self-attention
  int64_t tp = 1;
  // Megatron sequence parallelism: the norm and dropout activations are split over tp as well.
  bool sequence_parallel = false;
  // The norms keep their input in fp32 (Transformers' LlamaRMSNorm and its copies upcast the
  // hidden states before normalising) instead of the activation dtype.
  bool norm_fp32 = false;
  // The norm's weight trains and its multiply keeps the normalised tensor for the weight's
  // gradient (Transformers' RMSNorm: weight * hidden_states.to(input_dtype)).
  bool norm_keeps_normalized = false;
  // LoRA: the base Linears are frozen, so autograd keeps no input for their weight gradients.
  bool frozen_linears = false;
  // QLoRA: bitsandbytes' MatMul4Bit keeps each quantised Linear's input anyway.
  bool quantized_linears = false;
  // LoRA adapters: the summed input width of the adapted Linears of one layer; each keeps its
  // dropout mask and the dropped-out input for lora_A's gradient.
  int64_t adapter_input_width = 0;
  // Attention whose widths are not heads x head_dim (MLA): the value width (0 = the key width),
  // and the compressed latents each token keeps (MLA's q_a and kv_a outputs and their norms).
  int64_t v_width = 0;
  int64_t latent_width = 0;
  // MoE: the always-on shared-expert MLP's width beside the routed experts (0 = none).
  int64_t shared_ffn = 0;
  // Lit-GPT's LoRAQKVLinear on a subset of the fused query/key/value: zero_pad's index_copy keeps
  // the adapters' update (this width, the adapted output features) for its backward.
  int64_t adapter_padded_width = 0;
  // Lit-GPT's attention: the fused QKV output stays alive as long as the value (a view of it) is
  // kept by the attention, beside the roped query and key copies; with grouped keys and values it
  // keeps query-wide copies of all three instead.
  bool fused_qkv_kept = false;
  // One matmul computes query, key and value (torchtitan 0.3's wqkv): what a per-op checkpoint
  // policy counting matmuls sees.
  bool fused_qkv_matmul = false;
  // The MLP activation's own saved tensors beyond its input, each f wide: Transformers' Python
  // formulas (NewGELUActivation, "gelu_new", keeps 0.5x, tanh(...) and 1 + tanh(...): 3);
  // fused kernels (F.gelu, F.silu) keep none.
  int mlp_activation_extra = 0;
  // PyTorch before 1.11: softmax keeps its input (the masked scores) as well as its output.
  bool softmax_keeps_input = false;
};

// Bytes of activations one layer keeps for its backward pass, per GPU, with `elem_bytes` per
// activation element (2 for 16-bit, 4 for fp32) and 1 byte per dropout-mask element.
//   none: Korthikanti's sbh(10 + 24/t + 5as/(ht)) for a GPT-3 layer (f = 4h, GeLU, MHA, dropout),
//         every term derived from `shape` otherwise; with sequence parallelism sbh(34/t +
//         5as/(ht));
//   selective: without the attention core (scores, softmax, dropout; with flash attention its
//         output statistics), as Megatron's selective recompute: sbh(10 + 24/t);
//   full: the layer input only, 2sbh.
// flash: the s x s terms become per-head fp32 log-sum-exp statistics (4 bytes x a x s x b / t).
// frozen_linears: the inputs kept only for Linear weight gradients are not kept (autograd's mm
// saves its first operand only when the weight requires grad), unless quantized_linears.
uint64_t LayerActivationBytes(const LayerShape& shape, int elem_bytes, bool flash,
                              Checkpointing checkpointing);

}  // namespace memplan::estimator
