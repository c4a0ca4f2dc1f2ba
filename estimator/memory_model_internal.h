// The memory model's internals (Note [Memory items] in memory_model_items.cc): the sizes in 128
// bits, the named constants, the item builder, the facts every item reads. Shared by
// memory_model.cc (the estimate: facts, phase totals, constants, notes, comparisons),
// memory_model_activations.cc (what a layer keeps for backward) and memory_model_items.cc (one
// function per allocation behaviour). Internal to the estimator.
#pragma once

#include <cctype>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "estimator/memory_model.h"

namespace memplan::estimator::mm {

// Sizes are products of user-given counts (batch x heads x seq^2 ...): computed in 128 bits and
// narrowed once, so a huge setup is an error rather than a wrapped number.
__extension__ typedef unsigned __int128 Wide;

constexpr uint64_t kMaxBytes = uint64_t{1} << 62;

inline uint64_t Saturate(Wide v) {
  return v > static_cast<Wide>(std::numeric_limits<uint64_t>::max())
             ? std::numeric_limits<uint64_t>::max()
             : static_cast<uint64_t>(v);
}

inline Wide U(int64_t v) { return static_cast<Wide>(v < 0 ? 0 : v); }
inline Wide CeilDiv(Wide a, Wide b) { return b == 0 ? a : (a + b - 1) / b; }
// bytes * fraction, for the few fractional constants (NF4 bits, 4.5x overlap, 10% margin).
inline Wide Scale(Wide bytes, double factor) {
  long double v = static_cast<long double>(bytes) * static_cast<long double>(factor);
  return static_cast<Wide>(std::ceil(v));
}

// --- Constants (each reported in MemoryEstimate::constants) -----------------------------------

constexpr double kDropoutMaskBytes = 1;         // torch.nn.functional.dropout keeps a bool mask
constexpr double kFlashLseBytes = 4;            // fp32 log-sum-exp per head per token
constexpr uint64_t kFlashRngStateBytes = 1024;  // its philox seed and offset, 512 bytes each
constexpr double kNf4Bits = 4.5;                // 4-bit codes + fp32 absmax per 64 weights
constexpr double kNf4DoubleQuantBits = 4.127;   // absmax quantised to 8 bits per 256 blocks
constexpr double kAdam8bitBlock = 256;          // bitsandbytes block-wise quantisation block
constexpr double kOverlapCommFactor = 4.5;      // DeepSpeed docs: overlap_comm ~4.5x buckets
constexpr double kAllocatorMargin = 0.10;       // reserved over allocated, transients only
constexpr double kLogitsForwardFp32Bytes = 8;   // fp32 logits + log-softmax output, per element
constexpr double kLogitsBackwardBytes = 8;      // fp32 grads of log-probs and of the logits
constexpr uint64_t kLitGptLmHeadChunk = 128;    // Lit-GPT's lm_head_chunk_size in finetune/*.py

// Note [Allocator margin]
// PyTorch's caching allocator reserves more than it hands out where blocks of changing sizes are
// allocated and freed every step (activations, gradient temporaries, optimizer temporaries):
// rounding and fragmentation. Model states that are allocated once at start-up as a few large
// tensors (weights, master weights, optimizer states, gradient buffers, DeepSpeed's flat
// buffers) reserve what they use. The margin is therefore 10% of the transient items of a phase,
// not of its total.
//
// How an item is allocated, for the allocator margin (Note [Allocator margin]).
enum class Alloc {
  kOnce,       // a few large tensors allocated at start-up and kept: no fragmentation margin
  kTransient,  // allocated and freed every step (activations, temporaries): margin applies
};

struct Builder {
  std::vector<MemoryItem> items;
  std::vector<Alloc> allocs;  // parallel to items
  bool overflow = false;

  void Add(std::string name, std::string description, Wide gpu, Wide cpu, Wide nvme, Wide pinned,
           unsigned phases, Alloc alloc = Alloc::kOnce) {
    if (gpu > kMaxBytes || cpu > kMaxBytes || nvme > kMaxBytes || pinned > kMaxBytes) {
      overflow = true;
      return;
    }
    if (gpu == 0 && cpu == 0 && nvme == 0 && pinned == 0) return;
    MemoryItem item;
    item.name = std::move(name);
    item.description = std::move(description);
    item.gpu_bytes = static_cast<uint64_t>(gpu);
    item.cpu_bytes = static_cast<uint64_t>(cpu);
    item.nvme_bytes = static_cast<uint64_t>(nvme);
    item.pinned_bytes = static_cast<uint64_t>(pinned);
    item.phases = phases;
    items.push_back(std::move(item));
    allocs.push_back(alloc);
  }
};

inline bool Mixed(Precision p) { return p == Precision::kFp16Mixed || p == Precision::kBf16Mixed; }
inline std::string HalfName(Precision p) {
  return p == Precision::kFp16Mixed ? "fp16" : p == Precision::kFp32 ? "fp32" : "bf16";
}

// What the inventory says about the parameters, for the setup's LoRA/QLoRA/ZeRO-3 choices.
struct ParamFacts {
  Wide total = 0;        // unique parameters
  Wide quantizable = 0;  // block Linear weights (what QLoRA stores in NF4)
  Wide persistent = 0;   // ZeRO-3: tensors at or under the persistence threshold
  Wide factored = 0;     // Adafactor second-moment elements of the trainable tensors
  Wide largest_trainable_tensor = 0;
  Wide lora = 0;               // adapter parameters
  Wide lora_persistent = 0;    // adapters at or under the persistence threshold
  Wide lora_input_width = 0;   // summed input width of the adapted Linears, all layers
  Wide largest_quantized = 0;  // QLoRA: the largest Linear weight stored in NF4
  // Lit-GPT's LoRA, all layers: the input width once per block whose query/key/value are
  // adapted (one LoRAQKVLinear, one dropout) plus the inputs of the other adapted Linears, and
  // the adapted query/key/value output width in blocks that adapt only some of the three
  // (zero_pad's index_copy keeps that update).
  Wide litgpt_lora_input_width = 0;
  Wide litgpt_lora_padded_width = 0;
  // The output head (lm_head): Lightning's bitsandbytes plugin replaces every torch.nn.Linear,
  // the head included.
  Wide head = 0;
  // The head's weight as its gradient arrives first in backward: a tied head's too (its
  // gradient waits in the engine's input buffer for the embedding's).
  Wide head_grad = 0;
};

// Optimizer state bytes for `trainable` elements (plus Adafactor's factored statistics).
Wide OptimizerStateBytes(const TrainingSetup& s, Wide trainable, Wide factored);

struct Activations {
  Wide saved = 0;      // all layers + embeddings/final norm, as kept through forward
  Wide per_layer = 0;  // one layer (the decoder's for encoder-decoder) as saved
  Wide recompute = 0;  // live during the first layer's backward (checkpointing)
  Wide workspace = 0;  // gradient temporaries of one layer
  Wide logits_forward = 0;
  Wide logits_backward = 0;
  // What of logits_forward is still alive when backward starts, where the training code frees
  // the rest first (torchtitan: `del pred`, the fp32 copy never saved); -1: all of it.
  Wide logits_kept = static_cast<Wide>(-1);
  // Bytes per logit the loss keeps (for the constants table): 10 for the full loss.
  double logits_forward_per_logit = 0;
};

// Whether the family's norms upcast the hidden states to fp32 (LlamaRMSNorm and its copies), and
// how many f-wide tensors the MLP activation keeps beyond its input (Transformers' Python
// formulas): memory_model_activations.cc, which counts them, and the estimate's notes read them.
bool UpcastingNorm(const ArchitectureInfo& a);
int ActivationExtraTensors(const std::string& hidden_act);

// What the setup's layers keep for backward, counted from the inventory's shape
// (memory_model_activations.cc).
Activations CountActivations(const ModelInventory& inventory, const TrainingSetup& s,
                             const ParamFacts& f);

// The facts every item reads, computed once per estimate (Note [Memory items]).

struct ItemContext {
  const ModelInventory& inventory;
  const ArchitectureInfo& arch;
  const TrainingSetup& s;  // seq_len resolved
  const ParamFacts& f;
  Activations act;
  bool lora = false;
  bool mixed = false;        // fp16-mixed or bf16-mixed
  bool master = false;       // mixed precision with 16-bit working weights and an fp32 master copy
  Wide w = 2;                // bytes of activations (and of DeepSpeed's working weights)
  Wide param_bytes = 2;      // bytes of a working parameter (fp32 under autocast)
  Wide grad_bytes = 2;       // bytes of a gradient element (fp32 under autocast)
  Wide t = 1, d = 1, g = 1;  // tensor-parallel degree, data-parallel degree, GPUs per node
  Wide trainable = 0;
  Wide frozen_quantized = 0;   // QLoRA: parameters stored in NF4
  Wide largest_quantized = 0;  // QLoRA: the largest of them
  double nf4_bits = kNf4Bits;
  // PyTorch FSDP (the strategy FSDP really uses, NO_SHARD for one rank) and its CPU offload;
  // kNone for DeepSpeed and plain PyTorch.
  FsdpSharding fsdp = FsdpSharding::kNone;
  bool fsdp_offload = false;
  Wide fsdp_param_bytes = 4;  // FSDP's sharded parameters, gradients: fp32 unless bf16-pure
  Wide largest_unit = 0;      // the largest repeated block (FSDP's wrapped unit), tp-split
  std::string half;           // "bf16", "fp16" or "fp32"
  std::string opt_where;      // "none", "cpu" or "nvme"

  const ModelCounts& counts;  // CountParams(inventory), computed once per inventory

  ItemContext(const ModelInventory& i, const TrainingSetup& setup, const ParamFacts& facts,
              const ModelCounts& model_counts)
      : inventory(i), arch(*i.arch), s(setup), f(facts), counts(model_counts) {}

  Wide TpShare(Wide x) const { return CeilDiv(x, t); }
  // A rank's share of an element count partitioned over the data-parallel group from `stage` on.
  Wide Part(Wide x, int from_stage) const {
    return s.zero_stage >= from_stage ? CeilDiv(TpShare(x), d) : TpShare(x);
  }
  // Where the optimizer's partition (master weights, states) lives: per GPU, or per node.
  void PlaceOptimizer(Wide per_rank, Wide* gpu, Wide* cpu, Wide* nvme) const {
    switch (s.offload_optimizer) {
      case OffloadDevice::kNone: *gpu = per_rank; break;
      case OffloadDevice::kCpu: *cpu = per_rank * g; break;
      case OffloadDevice::kNvme: *nvme = per_rank * g; break;
    }
  }
  bool Offloaded() const { return s.offload_optimizer != OffloadDevice::kNone; }
  bool Fsdp() const { return fsdp != FsdpSharding::kNone; }
  // A plain loop's gradients (Note [Gradient storage]): zero_grad(set_to_none=True) since
  // PyTorch 2.0, one micro-batch per step, one GPU, no DeepSpeed or FSDP. None exist until
  // backward makes them; every other setup keeps them from one step to the next.
  bool PlainGradients() const {
    return s.zero_stage == 0 && !Fsdp() && s.DataParallel() == 1 && s.grad_accum == 1 &&
           !s.TorchBefore(2, 0);
  }
  // FSDP's share of `x` elements on a rank: all of them with NO_SHARD.
  Wide FsdpShard(Wide x) const {
    return fsdp == FsdpSharding::kNoShard ? TpShare(x) : CeilDiv(TpShare(x), d);
  }
  std::string FsdpName() const {
    std::string name(FsdpShardingName(fsdp));
    for (char& ch : name) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
    return "FSDP " + name + (fsdp_offload ? " + CPU offload" : "");
  }
};

constexpr unsigned kFwdBwd = kPhaseForward | kPhaseBackward | kPhaseBackwardEnd;

// Runs every item of kItemRules (memory_model_items.cc) over `c`, in report order.
Status AddItems(const ItemContext& c, Builder* out);

}  // namespace memplan::estimator::mm
