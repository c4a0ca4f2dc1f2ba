#include "estimator/memory_model.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <map>
#include <optional>
#include <string>

namespace memplan::estimator {
namespace {

// Sizes are products of user-given counts (batch x heads x seq^2 ...): computed in 128 bits and
// narrowed once, so a huge setup is an error rather than a wrapped number.
__extension__ typedef unsigned __int128 Wide;

constexpr uint64_t kMaxBytes = uint64_t{1} << 62;

uint64_t Saturate(Wide v) {
  return v > static_cast<Wide>(std::numeric_limits<uint64_t>::max())
             ? std::numeric_limits<uint64_t>::max()
             : static_cast<uint64_t>(v);
}

Wide U(int64_t v) { return static_cast<Wide>(v < 0 ? 0 : v); }
Wide CeilDiv(Wide a, Wide b) { return b == 0 ? a : (a + b - 1) / b; }
// bytes * fraction, for the few fractional constants (NF4 bits, 4.5x overlap, 10% margin).
Wide Scale(Wide bytes, double factor) {
  long double v = static_cast<long double>(bytes) * static_cast<long double>(factor);
  return static_cast<Wide>(std::ceil(v));
}

// --- Constants (each reported in MemoryEstimate::constants) -----------------------------------

constexpr double kDropoutMaskBytes = 1;        // torch.nn.functional.dropout keeps a bool mask
constexpr double kFlashLseBytes = 4;           // fp32 log-sum-exp per head per token
constexpr double kNf4Bits = 4.5;               // 4-bit codes + fp32 absmax per 64 weights
constexpr double kNf4DoubleQuantBits = 4.127;  // absmax quantised to 8 bits per 256 blocks
constexpr double kAdam8bitBlock = 256;         // bitsandbytes block-wise quantisation block
constexpr double kOverlapCommFactor = 4.5;     // DeepSpeed docs: overlap_comm ~4.5x buckets
constexpr double kAllocatorMargin = 0.10;      // reserved over allocated, transients only
constexpr double kLogitsForwardFp32Bytes = 8;  // fp32 logits + log-softmax output, per element
constexpr double kLogitsBackwardBytes = 8;     // fp32 grads of log-probs and of the logits
constexpr uint64_t kLitGptLmHeadChunk = 128;   // Lit-GPT's lm_head_chunk_size in finetune/*.py

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

bool Mixed(Precision p) { return p == Precision::kFp16Mixed || p == Precision::kBf16Mixed; }
std::string HalfName(Precision p) {
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
};

Result<ParamFacts> Facts(const ModelInventory& inventory, const TrainingSetup& setup) {
  ParamFacts f;
  const Wide threshold = U(setup.stage3_param_persistence_threshold);
  std::vector<const TensorInfo*> targets;
  if (setup.lora_rank > 0) {
    MEMPLAN_ASSIGN_OR_RETURN(targets, LoraTargetTensors(inventory, setup));
  }
  for (const TensorInfo& t : inventory.tensors) {
    if (!t.tied_to.empty()) continue;
    f.total += t.numel;
    if (t.numel <= threshold) f.persistent += t.numel;
    // QLoRA stores the Linear weights of the blocks in NF4 (Note [Tensor roles]).
    if (!t.block.empty() && t.IsLinearWeight()) {
      f.quantizable += t.numel;
      f.largest_quantized = std::max<Wide>(f.largest_quantized, t.numel);
    }
    if (t.role == TensorRole::kHead && t.IsLinearWeight()) f.head += t.numel;
    if (setup.lora_rank == 0) {
      f.factored += t.shape.size() >= 2
                        ? U(t.shape[0]) + U(t.numel / std::max<int64_t>(t.shape[0], 1))
                        : static_cast<Wide>(t.numel);
      f.largest_trainable_tensor = std::max<Wide>(f.largest_trainable_tensor, t.numel);
    }
  }
  const Wide r = U(setup.lora_rank);
  // Per block: which of q/k/v are adapted, their input width and adapted output width.
  struct QkvLora {
    unsigned parts = 0;
    Wide input = 0, output = 0;
  };
  std::map<std::string, QkvLora> qkv_by_block;
  for (const TensorInfo* t : targets) {
    // A [r, in] and B [out, r] whichever way the weight is stored (Linear [out, in], Conv1D
    // [in, out]): r * (in + out).
    const Wide a = r * U(t->shape[1]), b = r * U(t->shape[0]);
    f.lora += a + b;
    // The input width: Linear weights are [out, in], GPT-2's Conv1D weights [in, out].
    const Wide in_width = U(t->InFeatures());
    const Wide out_width = U(t->OutFeatures());
    f.lora_input_width += in_width;
    const unsigned part = QkvParts(t->role);
    if (part == 0) {
      f.litgpt_lora_input_width += in_width;
    } else {
      QkvLora& q = qkv_by_block[t->block];
      q.parts |= part;
      q.input = in_width;
      q.output += out_width;
    }
    for (Wide m : {a, b}) {
      if (m <= threshold) f.lora_persistent += m;
      f.largest_trainable_tensor = std::max(f.largest_trainable_tensor, m);
    }
    f.factored += (r + U(t->shape[1])) + (U(t->shape[0]) + r);
  }
  for (const auto& [block, q] : qkv_by_block) {
    f.litgpt_lora_input_width += q.input;
    if (q.parts != 7) f.litgpt_lora_padded_width += q.output;
  }
  return f;
}

// Optimizer state bytes for `trainable` elements (plus Adafactor's factored statistics).
Wide OptimizerStateBytes(const TrainingSetup& s, Wide trainable, Wide factored) {
  const bool pure = s.precision == Precision::kBf16Pure;
  switch (s.optimizer) {
    case Optimizer::kAdamW: return trainable * (pure ? 4 : 8);
    case Optimizer::kAdam8bit:
      return trainable * 2 + CeilDiv(trainable, static_cast<Wide>(kAdam8bitBlock)) * 2 * 4;
    case Optimizer::kSgd: return s.sgd_momentum > 0 ? trainable * (pure ? 2 : 4) : 0;
    case Optimizer::kLion: return trainable * (pure ? 2 : 4);
    case Optimizer::kAdafactor: return trainable * (pure ? 2 : 4) + factored * 4;
  }
  return 0;
}

struct Activations {
  Wide saved = 0;      // all layers + embeddings/final norm, as kept through forward
  Wide per_layer = 0;  // one layer (the decoder's for encoder-decoder) as saved
  Wide recompute = 0;  // live during the first layer's backward (checkpointing)
  Wide workspace = 0;  // gradient temporaries of one layer
  Wide logits_forward = 0;
  Wide logits_backward = 0;
  // Bytes per logit the loss keeps (for the constants table): 10 for the full loss.
  double logits_forward_per_logit = 0;
};

// Note [Architecture facts for activations]
// The one place where the model's architecture (ArchitectureInfo, filled by the config.json
// builders) becomes the per-layer shape that LayerActivationBytes counts. A new architecture fact
// that changes activations (attention widths that differ from heads x head_dim, shared experts,
// sliding-window attention, ...) goes into ArchitectureInfo, then LayerShape, is mapped here, and
// is counted in LayerActivationBytes; nothing else reads ArchitectureInfo for activations.
// Families whose Transformers norm upcasts the hidden states to fp32 before normalising and
// multiplies the weight in after (LlamaRMSNorm and its copies: mistral, mixtral, qwen2, gemma;
// T5LayerNorm computes its variance in fp32 the same way).
// The family builders record it (ArchitectureInfo::norm_upcasts).
bool UpcastingNorm(const ArchitectureInfo& a) { return a.norm_upcasts; }

// Transformers' activations (transformers/activations.py ACT2FN), by config name: the f-wide
// tensors autograd keeps beyond the activation's input. The Python formulas keep their
// intermediates: NewGELUActivation ("gelu_new", also "gelu_accurate"), 0.5 * x * (1 + tanh(...)),
// keeps 0.5x, tanh(...) and 1 + tanh(...); FastGELUActivation ("gelu_fast") those and the
// products inside tanh's argument (six); QuickGELUActivation, x * sigmoid(1.702x), the sigmoid.
// F.gelu, F.silu and the tanh-approximate F.gelu ("gelu_pytorch_tanh") are fused kernels keeping
// their input only.
int ActivationExtraTensors(const std::string& hidden_act) {
  if (hidden_act == "gelu_new" || hidden_act == "gelu_accurate") return 3;
  if (hidden_act == "gelu_fast") return 6;
  if (hidden_act == "quick_gelu") return 1;
  return 0;
}

LayerShape ShapeFor(const ModelInventory& inventory, const TrainingSetup& s, int64_t seq,
                    const ParamFacts& f) {
  const ArchitectureInfo& a = *inventory.arch;
  LayerShape l;
  l.seq = l.kv_seq = seq;
  l.batch = s.micro_batch;
  l.hidden = a.hidden;
  l.heads = a.heads;
  l.kv_heads = a.kv_heads;
  l.head_dim = a.head_dim;
  l.ffn = a.intermediate;
  l.gated = a.gated_mlp;
  l.experts = a.experts;
  l.top_k = a.experts_per_token;
  l.hidden_dropout = a.hidden_dropout > 0;
  l.attention_dropout = a.attention_dropout > 0;
  l.tp = s.tp;
  l.sequence_parallel = s.sequence_parallel && s.tp > 1;
  const bool sixteen_bit = s.precision != Precision::kFp32;
  l.norm_fp32 = sixteen_bit && UpcastingNorm(a);
  l.frozen_linears = s.lora_rank > 0;
  l.quantized_linears = s.lora_rank > 0 && s.qlora;
  l.norm_keeps_normalized = UpcastingNorm(a) && !l.frozen_linears;
  const Wide layers = U(std::max<int64_t>(a.layers + a.decoder_layers, 1));
  // MLA: keys are heads x (qk_nope + qk_rope) wide (head_dim), values heads x v_head_dim; each
  // token also keeps the query latent (q_a_proj output and its norm) and the key/value latent
  // (kv_a_proj output, and the norm of its kv_lora_rank part).
  if (a.kv_lora_rank > 0) {
    l.v_width = a.heads * a.v_head_dim;
    l.latent_width = 2 * a.q_lora_rank + (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank;
  }
  l.shared_ffn = a.shared_intermediate;
  const bool litgpt = s.framework == Framework::kLitGpt;
  l.adapter_input_width = static_cast<int64_t>(
      CeilDiv(litgpt ? f.litgpt_lora_input_width : f.lora_input_width, layers));
  l.adapter_padded_width =
      litgpt ? static_cast<int64_t>(CeilDiv(f.litgpt_lora_padded_width, layers)) : 0;
  l.fused_qkv_kept = litgpt;
  // Lit-GPT's MLPs call the fused torch.nn.functional.gelu / silu.
  l.mlp_activation_extra = litgpt ? 0 : ActivationExtraTensors(a.hidden_act);
  l.softmax_keeps_input = s.TorchBefore(1, 11);
  // Sliding windows and attention sinks leave the saved tensors as they are: eager and SDPA
  // attention compute the full s x s scores and mask them, and flash attention keeps one
  // log-sum-exp per query either way; a sink adds one column to s x s scores.
  return l;
}

Activations CountActivations(const ModelInventory& inventory, const TrainingSetup& s,
                             const ParamFacts& f) {
  const ArchitectureInfo& a = *inventory.arch;
  const int e = s.precision == Precision::kFp32 ? 4 : 2;
  const int64_t seq = s.SeqLenFor(&a);
  Activations out;
  LayerShape self = ShapeFor(inventory, s, seq, f);
  LayerShape dec = self;
  dec.cross_attention = a.encoder_decoder;
  Wide enc_layer = LayerActivationBytes(self, e, s.flash_attention, s.checkpointing);
  // MoE models whose first (DeepSeek) or listed (Qwen mlp_only_layers) layers are dense: those
  // layers hold one dense_intermediate-wide MLP instead of the experts.
  const int64_t dense_layers =
      a.experts > 0 && a.moe_layers > 0 ? std::max<int64_t>(a.layers - a.moe_layers, 0) : 0;
  Wide dense_layer_bytes = 0;
  if (dense_layers > 0) {
    LayerShape dense = self;
    dense.experts = dense.top_k = 0;
    dense.shared_ffn = 0;
    dense.ffn = a.dense_intermediate > 0 ? a.dense_intermediate : a.intermediate;
    dense_layer_bytes = LayerActivationBytes(dense, e, s.flash_attention, s.checkpointing);
  }
  const Wide dec_layer = LayerActivationBytes(dec, e, s.flash_attention, s.checkpointing);
  const Wide sbh = U(seq) * U(s.micro_batch) * U(a.hidden);
  // Per stack, outside the layers: the embedding dropout mask and the final norm's input; a
  // quantised output head (Lit-GPT QLoRA) keeps the final norm's output too (MatMul4Bit's A).
  const bool litgpt = s.framework == Framework::kLitGpt;
  const Wide stack_extra = sbh * (self.norm_fp32 ? 4 : e) + (a.embedding_dropout > 0 ? sbh : 0) +
                           (litgpt && self.quantized_linears && f.head > 0 ? sbh * e : 0);
  if (a.encoder_decoder) {
    // Encoder stack, decoder stack, and the encoder output every cross-attention reads.
    out.saved =
        U(a.layers) * enc_layer + U(a.decoder_layers) * dec_layer + 2 * stack_extra + sbh * e;
    out.per_layer = dec_layer;
  } else {
    out.saved =
        U(a.layers - dense_layers) * enc_layer + U(dense_layers) * dense_layer_bytes + stack_extra;
    out.per_layer = enc_layer;
  }
  const LayerShape& top = a.encoder_decoder ? dec : self;
  const Wide full = LayerActivationBytes(top, e, s.flash_attention, Checkpointing::kNone);
  if (s.checkpointing == Checkpointing::kFull) {
    out.recompute = full;
    if (s.checkpoint_every > 1) {
      // Every K-th block checkpointed (Transformers' `layer_index % every_n_layers == 0`,
      // fms-fsdp's p = 1/K, torchtitan's selective K): ceil(L / K) blocks keep their input only,
      // the others everything an unchecked block of the stack's top type keeps.
      const int64_t total = a.encoder_decoder ? a.layers + a.decoder_layers : a.layers;
      const int64_t kept = total - (total + s.checkpoint_every - 1) / s.checkpoint_every;
      const Wide ckpt = LayerActivationBytes(top, e, s.flash_attention, Checkpointing::kFull);
      if (kept > 0 && full > ckpt) out.saved += U(kept) * (full - ckpt);
    }
  } else if (s.checkpointing == Checkpointing::kSelective) {
    out.recompute =
        full - LayerActivationBytes(top, e, s.flash_attention, Checkpointing::kSelective);
  }
  const Wide t = U(s.tp);
  const Wide b = U(s.micro_batch);
  Wide attention_ws = s.flash_attention ? 0 : 2 * e * U(a.heads) * U(seq) * U(seq) * b / t;
  Wide mlp_ws = 2 * e * U(seq) * b * U(a.intermediate) * (a.gated_mlp ? 2 : 1) *
                std::max<Wide>(U(a.experts_per_token), 1) / t;
  out.workspace = std::max({attention_ws, mlp_ws, 2 * e * sbh});
  // Vocabulary-wide logits only for the language-model heads; a classification or QA head's
  // handful of outputs per token is negligible.
  const bool lm_head = inventory.model_class == "causal_lm" ||
                       inventory.model_class == "masked_lm" ||
                       inventory.model_class == "seq2seq_lm";
  if (lm_head && a.vocab > 0) {
    const Wide elems = CeilDiv(U(seq) * b * U(a.vocab), t);
    if (litgpt) {
      // Lit-GPT (finetune/*.py): the head runs in chunks of 128 positions (lm_head_chunk_size)
      // and Fabric's precision plugin returns them converted to fp32 (convert_output), which
      // chunked_cross_entropy's fp32 log-softmax keeps; backward then goes chunk by chunk.
      out.logits_forward = Scale(elems, kLogitsForwardFp32Bytes);
      const Wide chunk = CeilDiv(std::min<Wide>(U(seq), kLitGptLmHeadChunk) * b * U(a.vocab), t);
      out.logits_backward = Scale(chunk, kLogitsBackwardBytes);
    } else if (s.loss == Loss::kChunked) {
      // torchtune's CEWithChunkedOutputLoss (torchtune/modules/loss/ce_chunked_output_loss.py):
      // the model returns the logits in N chunks (the head runs per chunk), all kept in the
      // compute dtype; the loss upcasts one chunk at a time (a transient) and cross_entropy's
      // log_softmax keeps each chunk's fp32 output for backward; backward then runs chunk by
      // chunk through the head, so the fp32 gradients are one chunk's.
      const Wide n = U(s.loss_chunks > 0 ? s.loss_chunks : 8);
      const Wide chunk = CeilDiv(elems, n);
      out.logits_forward = elems * (e == 2 ? 2 : 0) + elems * 4 + chunk * 4;
      out.logits_backward = Scale(chunk, kLogitsBackwardBytes);
      out.logits_forward_per_logit = (e == 2 ? 2 : 0) + 4;
    } else if (s.loss == Loss::kFused) {
      // Liger's fused linear cross-entropy (liger_kernel/ops/fused_linear_cross_entropy.py):
      // the logits are never whole; the forward computes them in chunks of
      // next_power_of_2(ceil(BT / ceil(V / H))) rows in the input dtype, writes the loss's
      // gradient in place and keeps grad_input [BT, H] (and grad_weight [V, H] when the head
      // trains) for backward, which only scales them.
      const Wide h = U(a.hidden);
      const Wide bt = U(seq) * b;
      const Wide inc = CeilDiv(U(a.vocab), std::max<Wide>(h, 1));
      Wide rows = 1;
      while (rows < CeilDiv(bt, std::max<Wide>(inc, 1))) rows *= 2;
      const bool head_trains = s.lora_rank == 0;
      out.logits_forward = CeilDiv(std::min(rows, bt) * U(a.vocab), t) * e + bt * h * e +
                           (head_trains ? U(a.vocab) * h * e / t : 0);
      out.logits_backward = 0;
      out.logits_forward_per_logit = 0;
    } else {
      out.logits_forward = elems * (e == 2 ? 2 : 0) + Scale(elems, kLogitsForwardFp32Bytes);
      out.logits_backward = Scale(elems, kLogitsBackwardBytes);
      out.logits_forward_per_logit = kLogitsForwardFp32Bytes + (e == 2 ? 2 : 0);
    }
    // PyTorch before 1.11: log_softmax keeps its input (the fp32 logits copy) as well.
    if (s.TorchBefore(1, 11)) out.logits_forward += elems * 4;
  }
  return out;
}

}  // namespace

std::string PhaseName(Phase phase) {
  switch (phase) {
    case kPhaseForward: return "forward";
    case kPhaseBackward: return "backward";
    case kPhaseBackwardEnd: return "backward_end";
    case kPhaseOptimizerStep: return "optimizer_step";
    case kAllPhases: return "all";
  }
  return "?";
}

uint64_t ZeroPaperBytesPerGpu(uint64_t params, uint64_t gpus, int stage, uint64_t k) {
  const Wide p = params, n = std::max<uint64_t>(gpus, 1);
  Wide bytes = 0;
  switch (stage) {
    case 0: bytes = (4 + k) * p; break;
    case 1: bytes = 4 * p + k * p / n; break;
    case 2: bytes = 2 * p + (2 + k) * p / n; break;
    default: bytes = (4 + k) * p / n; break;
  }
  return Saturate(bytes);
}

uint64_t LayerActivationBytes(const LayerShape& l, int elem_bytes, bool flash,
                              Checkpointing checkpointing) {
  const Wide e = static_cast<Wide>(elem_bytes);
  const Wide s = U(l.seq), b = U(l.batch), h = U(l.hidden), t = U(std::max<int64_t>(l.tp, 1));
  const Wide sbh = s * b * h;
  if (checkpointing == Checkpointing::kFull) return Saturate(e * sbh);  // the layer input
  const Wide mask = l.hidden_dropout ? 1 : 0;
  const Wide q_width = U(l.heads) * U(l.head_dim), kv_width = U(l.kv_heads) * U(l.head_dim);
  // Attention core: softmax output, plus dropout mask and dropout output when dropout is on;
  // flash attention keeps only the per-head log-sum-exp.
  auto core = [&](Wide kv_seq) -> Wide {
    if (flash) return static_cast<Wide>(kFlashLseBytes) * U(l.heads) * s * b / t;
    Wide per = e + (l.attention_dropout ? static_cast<Wide>(kDropoutMaskBytes) + e : 0) +
               (l.softmax_keeps_input ? e : 0);
    return per * U(l.heads) * s * kv_seq * b / t;
  };
  // Megatron's selective recompute drops the core attention (flash or not) and recomputes it.
  const bool keep_core = checkpointing == Checkpointing::kNone;
  // A Linear keeps its input only for its weight's gradient: not when the weight is frozen
  // (LoRA), unless bitsandbytes' 4-bit matmul keeps it anyway (QLoRA).
  const bool linear_inputs = !l.frozen_linears || l.quantized_linears;
  const Wide lin = linear_inputs ? e : 0;
  // Each norm keeps its input (in fp32 when it upcasts), the normalised tensor when its weight
  // trains and upcasts, and the following Linear's input.
  const Wide norm = (l.norm_fp32 ? 4 : e) + (l.norm_keeps_normalized ? e : 0) + lin;
  // Replicated across tensor-parallel ranks (split with sequence parallelism): the norm and
  // first-Linear inputs of each block and the dropout masks after each block.
  // Self-attention: norm, QKV input, Q, K, V, output-projection input (flash attention keeps it
  // as its output in any case), dropout mask.
  const Wide out_proj = flash || linear_inputs ? e : 0;
  const Wide v_width = l.v_width > 0 ? U(l.v_width) : kv_width;
  // The output projection reads the values' width (heads x v_head_dim under MLA).
  const Wide o_width = l.v_width > 0 ? v_width : q_width;
  Wide replicated = norm * sbh + mask * sbh + e * s * b * U(l.latent_width);
  // Query, key and value as the attention keeps them. Lit-GPT (fused_qkv_kept): the fused
  // output, kept whole by the value view, plus the roped query and key copies; with grouped
  // keys and values the key and value are expanded to query width and copied, and the fused
  // output is freed.
  Wide qkv_width = q_width + kv_width + v_width;
  if (l.fused_qkv_kept) {
    qkv_width = l.kv_heads == l.heads ? qkv_width + q_width + kv_width : 3 * q_width;
  }
  Wide sharded = e * s * b * qkv_width + out_proj * s * b * o_width;
  Wide core_bytes = core(U(l.kv_seq));
  if (l.cross_attention) {
    // Encoder-decoder attention: norm, Q input, Q, K and V over the encoder sequence,
    // output-projection input, dropout mask; its scores are s x kv_seq.
    const Wide kv_s = U(l.kv_seq);
    replicated += norm * sbh + mask * sbh;
    sharded += e * b * (s * q_width + 2 * kv_s * kv_width) + out_proj * b * s * q_width;
    core_bytes += core(kv_s);
  }
  // MLP: norm, first-Linear input, then per token the activation's input and output (gated:
  // gate, up, act(gate) and the product, which is the second Linear's input), dropout mask. MoE:
  // each token's MLP runs in top-k experts, with the token copied in and out of each, and the
  // router's fp32 logits and probabilities.
  replicated += norm * sbh + mask * sbh;
  Wide mlp = s * b * U(l.ffn) * ((l.gated ? 3 : 1) * e + lin + U(l.mlp_activation_extra) * e);
  if (l.experts > 0) {
    const Wide k = U(std::max<int64_t>(l.top_k, 1));
    mlp *= k;
    replicated += 2 * e * k * sbh + 2 * 4 * s * b * U(l.experts);
    // The shared expert(s): one more dense MLP every token passes, with its own input.
    if (l.shared_ffn > 0)
      mlp += s * b * U(l.shared_ffn) * ((l.gated ? 3 : 1) * e + lin) + lin * sbh;
  }
  sharded += mlp;
  // LoRA adapters (PEFT / Lit-GPT LoRALinear): lora_dropout's mask and output, lora_A's input.
  replicated += (static_cast<Wide>(kDropoutMaskBytes) + e) * s * b * U(l.adapter_input_width);
  sharded += e * s * b * U(l.adapter_padded_width);
  Wide total = (l.sequence_parallel ? replicated / t : replicated) + sharded / t +
               (keep_core ? core_bytes : 0);
  return Saturate(total);
}

namespace {

// Note [Memory items]
// Each memory item is one allocation behaviour of a framework, modelled by one small function
// below that says what it is, where the framework allocates it (file and function), and in which
// phases (Note [Phases]) it is live. kItemRules lists them in report order; EstimateMemory runs
// them over one ItemContext (the facts every item reads, computed once) and takes the peak as the
// largest phase total. To check one item against DeepSpeed's or PyTorch's source, read its
// function alone.
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

// Note [NVMe partitions]
// ZeRO-3 with offload_param nvme swaps a parameter's 16-bit partition out only when
// AsyncPartitionedParameterSwapper.swappable_tensor holds: at least max(MIN_AIO_BYTES = 1 MiB,
// aio.block_size) bytes (deepspeed/runtime/swap_tensor/partitioned_param_swapper.py; the caller is
// partition_parameters.py Init._partition_param). A smaller partition stays in host memory, pinned
// with pin_memory. Each swapped partition has a file of its own, its length rounded up to
// AIO_ALIGNED_BYTES (1024, swap_tensor/utils.py). Transformers builds a tied output head as a
// Linear of its own inside zero.Init and ties it to the embedding afterwards, so that Linear's
// partition is swapped out once and its file stays on the drive beside the embedding's.
// The optimizer swapper applies the same size rule to each parameter's fp32 gradient partition
// (swap_tensor/optimizer_utils.py _swap_out_gradients): a smaller one is kept in host memory
// (unswapped_gradients). Measured with DeepSpeed 0.19 (tests/accuracy/deepspeed_nvme.json).
constexpr Wide kMinAioBytes = Wide{1} << 20;
constexpr Wide kAioAlignedBytes = 1024;

struct NvmeSplit {
  Wide nvme = 0;    // bytes written to swap files, per GPU
  Wide memory = 0;  // bytes kept in host memory, per GPU
};

// The inventory's partitions of `elem_bytes` per element, split by the swapper's size rule.
// `params`: the 16-bit working partitions (persistent tensors excluded: they stay whole on the
// GPU; tied aliases count as the file their construction left); otherwise the fp32 gradients.
NvmeSplit NvmePartitions(const ItemContext& c, Wide elem_bytes, bool params) {
  NvmeSplit out;
  const Wide min_aio = std::max<Wide>(kMinAioBytes, U(c.s.aio_block_size));
  const Wide threshold = U(c.s.stage3_param_persistence_threshold);
  for (const TensorInfo& t : c.inventory.tensors) {
    const bool alias = !t.tied_to.empty();
    if (params ? U(t.numel) <= threshold : alias) continue;
    const Wide bytes = CeilDiv(c.TpShare(U(t.numel)), c.d) * elem_bytes;
    if (bytes >= min_aio) {
      out.nvme += params ? CeilDiv(bytes, kAioAlignedBytes) * kAioAlignedBytes : bytes;
    } else if (!alias) {
      out.memory += bytes;
    }
  }
  return out;
}

// params_working, params_quantized, autocast_weight_copies. The working copy of every parameter
// (16-bit in mixed and pure precision, fp32 in fp32 and under autocast), adapters included,
// QLoRA's quantised Linears excluded. ZeRO-3 partitions each over the data-parallel group and
// keeps tensors of at most stage3_param_persistence_threshold elements whole on every GPU
// (deepspeed/runtime/zero/partition_parameters.py, Init._partition_param; stage3.py
// persistent_parameters); offload_param moves the partitions to host memory or NVMe
// (partitioned_param_swapper.py). All phases.
Status ParamsWorking(const ItemContext& c, Builder* out) {
  const TrainingSetup& s = c.s;
  const Wide plain = c.f.total - c.frozen_quantized + c.f.lora;
  Wide gpu = 0, cpu = 0, nvme = 0, pinned = 0;
  std::string how;
  if (c.Fsdp()) {
    // FSDP flattens each wrapped unit's parameters and keeps this rank's shard in the parameter
    // dtype (fp32 under MixedPrecision, which casts only the gathered copy): FlatParamHandle's
    // local shard (torch/distributed/fsdp/_flat_param.py); CPUOffload(offload_params=True)
    // keeps it in pinned host memory.
    const Wide shard = c.FsdpShard(plain) * c.fsdp_param_bytes;
    how = ", " + c.FsdpName() +
          (c.fsdp == FsdpSharding::kNoShard
               ? std::string(" (not sharded)")
               : " (sharded over " + std::to_string(static_cast<uint64_t>(c.d)) + " GPUs)");
    if (c.fsdp_offload) {
      cpu = pinned = shard * c.g;
    } else {
      gpu = shard;
    }
    out->Add("params_working",
             "parameters, " + std::string(c.fsdp_param_bytes == 4 ? "fp32" : "bf16") + how, gpu,
             cpu, 0, pinned, kAllPhases);
  } else if (s.zero_stage == 3) {
    const Wide persistent = c.f.persistent + c.f.lora_persistent;
    const Wide persistent_bytes = c.TpShare(persistent) * c.w;
    const Wide shard = CeilDiv(c.TpShare(plain - persistent), c.d) * c.w;
    gpu = persistent_bytes;
    how = ", ZeRO-3 partitioned over " + std::to_string(static_cast<uint64_t>(c.d)) +
          " GPUs (tensors <= " + std::to_string(s.stage3_param_persistence_threshold) +
          " elements kept whole)";
    if (s.offload_param == OffloadDevice::kCpu) {
      cpu = shard * c.g;
      if (s.pin_memory) pinned = cpu;
      how += ", partitions offloaded to CPU";
    } else if (s.offload_param == OffloadDevice::kNvme) {
      nvme = shard * c.g;
      how += ", partitions offloaded to NVMe";
      if (c.frozen_quantized == 0) {  // Note [NVMe partitions]
        const NvmeSplit split = NvmePartitions(c, c.w, /*params=*/true);
        const Wide adapters = CeilDiv(c.TpShare(c.f.lora - c.f.lora_persistent), c.d) * c.w;
        nvme = (split.nvme + adapters) * c.g;
        // The small partitions of trainable tensors move into nvme_param_flat_buffer with the
        // rest when it holds the whole partition; frozen ones (LoRA's base) stay where they are.
        const bool flat_holds_all = U(s.param_max_in_cpu) >= c.Part(c.trainable, 1);
        cpu = (c.lora || !flat_holds_all ? split.memory : 0) * c.g;
        if (s.pin_memory) pinned = cpu;
        how += " (those under max(1 MiB, aio.block_size) kept in host memory)";
      }
    } else {
      gpu += shard;
    }
  } else {
    gpu = c.TpShare(plain) * c.param_bytes;
  }
  if (!c.Fsdp()) {
    out->Add("params_working",
             "parameters, " + std::string(s.autocast ? "fp32" : c.half) + " working copy" + how,
             gpu, cpu, nvme, pinned, kAllPhases);
  }
  if (s.autocast) {
    // torch.autocast casts each weight to 16-bit when an op uses it and keeps the copy in its
    // cast cache for the rest of the forward pass; backward keeps it for the input gradient
    // (torch/csrc/autograd/autocast: cached_cast).
    out->Add("autocast_weight_copies", "16-bit copies of the weights made by torch.autocast",
             c.TpShare(c.f.total) * 2, 0, 0, 0, kPhaseForward | kPhaseBackward, Alloc::kTransient);
  }
  if (c.frozen_quantized > 0) {
    // bitsandbytes Params4bit: 4-bit codes plus the quantisation state (absmax per 64 weights).
    const Wide q = Scale(c.Part(c.frozen_quantized, 3), c.nf4_bits / 8);
    out->Add("params_quantized",
             "frozen base Linears in NF4 (" + std::string(s.double_quant ? "4.127" : "4.5") +
                 " bits per parameter)",
             q, 0, 0, 0, kAllPhases);
    // bitsandbytes MatMul4Bit.forward/backward dequantise each weight to a 16-bit copy for the
    // matmul (F.dequantize_4bit(B, quant_state).to(A.dtype)); one Linear at a time. The copy is
    // in the dtype the weight was quantised from: Transformers quantises the loaded bf16 weights
    // (one copy), Lightning's plugin (fabric/plugins/precision/bitsandbytes.py, _Linear4bit)
    // quantises an fp16 copy, so dequantize_4bit returns fp16 and .to(bf16) makes a second.
    const Wide copies = s.framework == Framework::kLitGpt && c.w == 2 ? 2 : 1;
    out->Add("qlora_dequant_workspace",
             copies == 2 ? "fp16 and bf16 copies of the Linear being dequantised (bitsandbytes "
                           "MatMul4Bit on weights Lightning quantised from fp16)"
                         : "16-bit copy of the Linear being dequantised (bitsandbytes MatMul4Bit)",
             copies * c.TpShare(c.largest_quantized) * c.w, 0, 0, 0, kPhaseForward | kPhaseBackward,
             Alloc::kTransient);
  }
  return Status::Ok();
}

// params_master. Mixed precision keeps fp32 master weights of the trainable parameters in the
// optimizer's partition (DeepSpeed stage_1_and_2.py single_partition_of_fp32_groups, stage3.py
// fp32_partitioned_groups_flat), on the optimizer's device. Not under autocast, whose weights are
// fp32 already. All phases.
Status ParamsMaster(const ItemContext& c, Builder* out) {
  if (!c.master) return Status::Ok();
  Wide gpu = 0, cpu = 0, nvme = 0;
  c.PlaceOptimizer(c.Part(c.trainable, 1) * 4, &gpu, &cpu, &nvme);
  out->Add("params_master",
           "fp32 master weights of the trainable parameters" +
               std::string(c.s.zero_stage >= 1 ? ", ZeRO-partitioned" : "") +
               (c.Offloaded() ? ", on " + c.opt_where : ""),
           gpu, cpu, nvme, 0, kAllPhases);
  return Status::Ok();
}

// grads, grads_fp32. Note [Gradient storage]. Without optimizer offload: the gradient (its
// partition from ZeRO-2 on) in the working dtype, plus in mixed precision the fp32 copy the
// optimizer steps on: the whole partition for ZeRO-0/1/2 (stage_1_and_2.py
// single_partition_of_fp32_groups[i].grad), one sub-group at a time for ZeRO-3, which flattens a
// sub-group's 16-bit gradients, converts them to fp32, steps and frees them
// (stage3.py _prepare_fp32_grad_for_sub_group / _release_sub_group).
// With optimizer offload, ZeRO-3 keeps the 16-bit gradient partition in host memory
// (stage3.py grad_partitions_flat_buffer on the offload device, pinned with pin_memory) and
// converts each reduced partition to fp32 on the way: into an fp32 buffer per sub-group in host
// memory for offload_optimizer cpu, swapped out to NVMe for nvme
// (stage3.py partition_grads -> optimizer_swapper.swap_out_gradients). ZeRO-1/2 copy the reduced
// partition into an fp32 gradient buffer in host memory (stage_1_and_2.py
// async_accumulate_grad_in_cpu_via_gpu).
Status Grads(const ItemContext& c, Builder* out) {
  const TrainingSetup& s = c.s;
  if (c.Fsdp()) {
    // FSDP reduce-scatters each unit's gradient and keeps this rank's shard as the flat
    // parameter's .grad, in the parameter dtype (_post_backward_hook, _cast_grad_to_param_dtype);
    // with CPUOffload the shard is copied to pinned host memory (_offload_grad).
    const Wide bytes = c.FsdpShard(c.trainable) * c.fsdp_param_bytes;
    out->Add("grads",
             "gradients of the trainable parameters, " + c.FsdpName() +
                 (c.fsdp == FsdpSharding::kNoShard ? "" : ", sharded"),
             c.fsdp_offload ? 0 : bytes, c.fsdp_offload ? bytes * c.g : 0, 0,
             c.fsdp_offload ? bytes * c.g : 0, kAllPhases);
    return Status::Ok();
  }
  if (!c.Offloaded()) {
    out->Add("grads",
             std::string(s.autocast ? "fp32" : c.half) + " gradients of the trainable parameters" +
                 std::string(s.zero_stage >= 2 ? ", ZeRO-partitioned" : ""),
             c.Part(c.trainable, 2) * c.grad_bytes, 0, 0, 0, kAllPhases);
    if (!c.master) return Status::Ok();
    if (s.zero_stage == 3) {
      const Wide sub_group = std::min(U(s.sub_group_size), c.Part(c.trainable, 1));
      out->Add("grads_fp32",
               "one sub-group's gradients flattened (" + c.half +
                   ") and converted to fp32 for the step: min(sub_group_size, partition) x " +
                   std::to_string(static_cast<uint64_t>(4 + c.w)) + " bytes",
               sub_group * (4 + c.w), 0, 0, 0, kPhaseOptimizerStep, Alloc::kTransient);
    } else {
      out->Add("grads_fp32",
               "fp32 copy of the gradient partition the optimizer steps on (step transient)",
               c.Part(c.trainable, 1) * 4, 0, 0, 0, kPhaseOptimizerStep, Alloc::kTransient);
    }
    return Status::Ok();
  }
  const Wide partition = c.Part(c.trainable, 1);
  if (s.zero_stage == 3) {
    const Wide half = partition * c.w * c.g;
    out->Add("grads",
             c.half + " gradient partitions in host memory (ZeRO-3 with offloaded optimizer)", 0,
             half, 0, s.pin_memory ? half : 0, kAllPhases);
  }
  const Wide fp32 = partition * 4 * c.g;
  if (s.zero_stage == 3 && s.offload_optimizer == OffloadDevice::kNvme) {
    Wide swapped = fp32, kept = 0;
    if (!c.lora && c.frozen_quantized == 0) {  // Note [NVMe partitions]
      const NvmeSplit split = NvmePartitions(c, 4, /*params=*/false);
      swapped = split.nvme * c.g;
      kept = split.memory * c.g;
    }
    out->Add("grads_fp32",
             "fp32 gradient partitions swapped out to NVMe with the optimizer state (those under "
             "max(1 MiB, aio.block_size) kept in host memory)",
             0, kept, swapped, 0, kAllPhases);
  } else {
    out->Add("grads_fp32", "fp32 gradient partitions in host memory (offloaded optimizer)", 0, fp32,
             0, s.pin_memory ? fp32 : 0, kAllPhases);
  }
  return Status::Ok();
}

// ddp_grad_buckets. torch DistributedDataParallel's reducer allocates flat buckets covering every
// gradient when it is built; unless gradient_as_bucket_view, the parameters' .grad tensors are
// separate and the buckets are a second copy (torch/nn/parallel/distributed.py,
// gradient_as_bucket_view: "the saved memory size will be equal to the total gradients size").
// ZeRO-0 on more than one data-parallel rank. All phases.
Status DdpBuckets(const ItemContext& c, Builder* out) {
  const TrainingSetup& s = c.s;
  if (s.zero_stage != 0 || c.Fsdp() || s.DataParallel() <= 1 || s.gradient_as_bucket_view) {
    return Status::Ok();
  }
  out->Add("ddp_grad_buckets",
           "DDP gradient buckets, a second copy of the gradients (gradient_as_bucket_view off)",
           c.TpShare(c.trainable) * c.grad_bytes, 0, 0, 0, kAllPhases);
  return Status::Ok();
}

// optimizer_states. The optimizer's state tensors for the trainable partition (torch.optim's
// state dict; DeepSpeed's partitioned optimizer), on the optimizer's device. SGD keeps a momentum
// buffer only with momentum > 0 (torch/optim/sgd.py). All phases.
Status OptimizerStates(const ItemContext& c, Builder* out) {
  const TrainingSetup& s = c.s;
  if (c.Fsdp()) {
    // A torch.optim optimizer over the sharded flat parameters: its states are shard-sized, on
    // the CPU with CPUOffload (the parameters it steps live there).
    const Wide factored = c.FsdpShard(c.f.factored);
    const Wide bytes = OptimizerStateBytes(s, c.FsdpShard(c.trainable), factored);
    out->Add("optimizer_states",
             std::string(OptimizerName(s.optimizer)) + " states, " + c.FsdpName() +
                 (c.fsdp_offload ? ", on cpu" : ""),
             c.fsdp_offload ? 0 : bytes, c.fsdp_offload ? bytes * c.g : 0, 0, 0, kAllPhases);
    return Status::Ok();
  }
  Wide gpu = 0, cpu = 0, nvme = 0;
  const Wide factored =
      s.zero_stage >= 1 ? CeilDiv(c.TpShare(c.f.factored), c.d) : c.TpShare(c.f.factored);
  c.PlaceOptimizer(OptimizerStateBytes(s, c.Part(c.trainable, 1), factored), &gpu, &cpu, &nvme);
  out->Add("optimizer_states",
           std::string(OptimizerName(s.optimizer)) + " states" +
               (s.zero_stage >= 1 ? ", ZeRO-partitioned" : "") +
               (c.Offloaded() ? ", on " + c.opt_where : ""),
           gpu, cpu, nvme, 0, kAllPhases);
  return Status::Ok();
}

// optimizer_step_transient. A PyTorch optimizer on the GPU (ZeRO-0): torch/optim/adam.py
// _multi_tensor_adam (foreach, PyTorch's default on CUDA) builds exp_avg_sq_sqrt for every
// parameter at once, one state-sized tensor set; _single_tensor_adam (foreach=False) builds it one
// tensor at a time (sqrt, then the division: two temporaries of the largest tensor); the fused
// kernel (fused=True) updates in place. SGD updates in place (torch/optim/sgd.py, no weight
// decay). DeepSpeed's optimizers (ZeRO >= 1: FusedAdam, CPU Adam) update in place.
Status OptimizerStepTransient(const ItemContext& c, Builder* out) {
  const TrainingSetup& s = c.s;
  if ((s.zero_stage != 0 && !c.Fsdp()) || c.fsdp_offload || s.fused_optimizer) {
    return Status::Ok();
  }
  const Wide state_elem = s.precision == Precision::kBf16Pure ? 2 : 4;
  // Under FSDP the optimizer sees one flat parameter per wrapped unit (its shard).
  const Wide largest =
      c.Fsdp() && !c.lora ? c.FsdpShard(c.largest_unit) : c.f.largest_trainable_tensor;
  const Wide all = c.Fsdp() ? c.FsdpShard(c.trainable) : c.TpShare(c.trainable);
  Wide transient = 0;
  std::string how;
  // torch.optim takes its foreach path only for plain Tensors and Parameters
  // (torch/optim/optimizer.py _default_to_fused_or_foreach checks the exact type): FSDP's
  // FlatParameter gets the per-tensor loop.
  const bool foreach = s.foreach && !c.Fsdp();
  switch (s.optimizer) {
    case Optimizer::kAdamW:
    case Optimizer::kLion:
      if (foreach) {
        transient = all * state_elem;
        how = "torch foreach: one state-sized tensor set";
      } else {
        transient = 2 * largest * state_elem;
        how = "per-tensor loop: two temporaries of the largest tensor";
      }
      break;
    case Optimizer::kAdafactor:
      transient = 2 * 4 * largest;
      how = "factored update of the largest tensor";
      break;
    case Optimizer::kSgd:
    case Optimizer::kAdam8bit: break;
  }
  out->Add("optimizer_step_transient", "temporaries of the optimizer step (" + how + ")", transient,
           0, 0, 0, kPhaseOptimizerStep, Alloc::kTransient);
  return Status::Ok();
}

// nvme_optimizer_swap_buffers. ZeRO-Infinity's optimizer swapper stages sub-groups through
// buffer_count pinned fp32 buffers of the largest sub-group (min(sub_group_size, partition))
// (deepspeed/runtime/swap_tensor/optimizer_utils.py, SwapBufferManager). All phases.
Status NvmeOptimizerSwapBuffers(const ItemContext& c, Builder* out) {
  if (c.s.offload_optimizer != OffloadDevice::kNvme) return Status::Ok();
  const Wide sub_group = std::min(U(c.s.sub_group_size), c.Part(c.trainable, 1));
  const Wide buffers = U(c.s.optimizer_buffer_count) * sub_group * 4 * c.g;
  out->Add("nvme_optimizer_swap_buffers",
           "pinned swap buffers for optimizer state: buffer_count x min(sub_group_size, "
           "partition) x fp32",
           0, buffers, 0, buffers, kAllPhases);
  return Status::Ok();
}

// nvme_param_flat_buffer. With offload_param nvme, ZeRO-3 still gives the trainable parameters
// 16-bit partitions a flat host buffer, pinned, of up to offload_param.max_in_cpu elements
// (default 1e9) per rank, and moves the partitions into it: they live in host memory as well as
// in their swap files (deepspeed/runtime/zero/stage3.py _create_param_groups_fp16_flat_cpu_memory,
// _configure_tensor_swapping). Sub-groups beyond max_in_cpu stay on NVMe and are swapped out
// after the step through one pinned buffer of the largest sub-group's parameters
// (partitioned_param_swapper.py reserve_partitioned_swap_space). All phases.
Status NvmeParamFlatBuffer(const ItemContext& c, Builder* out) {
  if (c.s.zero_stage != 3 || c.s.offload_param != OffloadDevice::kNvme) return Status::Ok();
  const Wide partition = c.Part(c.trainable, 1);
  const Wide flat = std::min(U(c.s.param_max_in_cpu), partition);
  Wide bytes = flat * c.w;
  std::string how = "min(max_in_cpu, partition)";
  if (flat < partition) {
    bytes += std::min(U(c.s.sub_group_size), partition) * c.d * c.w;
    how += " + a reuse buffer of the largest sub-group";
  }
  bytes *= c.g;
  out->Add("nvme_param_flat_buffer",
           "pinned flat " + c.half +
               " buffer of the trainable parameters' partitions in host "
               "memory beside their swap files: " +
               how,
           0, bytes, 0, bytes, kAllPhases);
  return Status::Ok();
}

// nvme_param_swap_buffers. offload_param: nvme reads partitions through buffer_count pinned
// buffers of buffer_size elements (deepspeed/runtime/swap_tensor/partitioned_param_swapper.py,
// AsyncPartitionedParameterSwapper). All phases.
Status NvmeParamSwapBuffers(const ItemContext& c, Builder* out) {
  if (c.s.offload_param != OffloadDevice::kNvme) return Status::Ok();
  const Wide buffers = U(c.s.param_buffer_count) * U(c.s.param_buffer_size) * c.w * c.g;
  out->Add("nvme_param_swap_buffers",
           "pinned swap buffers for parameters: buffer_count x buffer_size x " + c.half, 0, buffers,
           0, buffers, kAllPhases);
  return Status::Ok();
}

// activations, activation_recompute, backward_workspace, logits_and_loss, logits_grad: what
// autograd saves for the backward pass (CountActivations, Korthikanti et al.), live from the
// forward pass to the first layer of backward; the recomputed layer and the layer's gradient
// temporaries in backward; the logits and the loss's log-softmax, and their gradients.
Status ActivationItems(const ItemContext& c, Builder* out) {
  const TrainingSetup& s = c.s;
  const Activations& act = c.act;
  const Alloc tr = Alloc::kTransient;
  out->Add("activations",
           "saved activations, " + std::to_string(c.arch.layers + c.arch.decoder_layers) +
               " layers (" + std::string(CheckpointingName(s.checkpointing)) + " checkpointing" +
               (s.flash_attention ? ", flash attention" : "") + ")",
           act.saved, 0, 0, 0, kPhaseForward | kPhaseBackward, tr);
  out->Add("activation_recompute", "one layer's recomputed activations during its backward pass",
           act.recompute, 0, 0, 0, kPhaseBackward, tr);
  out->Add("backward_workspace", "gradient temporaries of the layer in backward", act.workspace, 0,
           0, 0, kPhaseBackward | kPhaseBackwardEnd, tr);
  const Loss loss = c.s.loss;
  out->Add("logits_and_loss",
           loss == Loss::kFused
               ? "fused linear cross-entropy: one chunk of logits and the gradients it keeps"
           : loss == Loss::kChunked
               ? "logits b*s*V (" + c.half + ", in chunks) and each chunk's fp32 log-softmax"
               : "logits b*s*V (" + c.half + " and fp32) and the log-softmax kept by the loss",
           act.logits_forward, 0, 0, 0, kPhaseForward | kPhaseBackward, tr);
  out->Add("logits_grad", "fp32 gradients of the log-probabilities and logits", act.logits_backward,
           0, 0, 0, kPhaseBackward, tr);
  return Status::Ok();
}

// comm_reduce_bucket, comm_allgather_bucket. ZeRO-3 allocates one flat gradient bucket of
// reduce_bucket_size elements per gradient dtype at start-up when contiguous_gradients is on, its
// default (stage3.py _setup_for_real_optimizer, the IPG bucket buffer). ZeRO-1/2: the gradient
// reduce buckets during backward and the parameter all-gather buckets after the step, x4.5 with
// overlap_comm (the Hugging Face DeepSpeed guide's rule for ZeRO-2).
Status CommBuckets(const ItemContext& c, Builder* out) {
  const TrainingSetup& s = c.s;
  if (s.zero_stage < 1 || c.Fsdp()) return Status::Ok();
  const Wide reduce_elems = std::min(U(s.reduce_bucket_size), c.TpShare(c.trainable));
  if (s.zero_stage == 3) {
    out->Add("comm_reduce_bucket",
             "flat gradient bucket of reduce_bucket_size elements (contiguous_gradients)",
             reduce_elems * c.w, 0, 0, 0, kAllPhases);
    return Status::Ok();
  }
  const double factor = s.OverlapComm() ? kOverlapCommFactor : 1.0;
  out->Add("comm_reduce_bucket",
           "gradient reduce buckets (reduce_bucket_size" +
               std::string(s.OverlapComm() ? " x 4.5 with overlap_comm" : "") + ")",
           Scale(reduce_elems * c.w, factor), 0, 0, 0, kPhaseBackward | kPhaseBackwardEnd,
           Alloc::kTransient);
  const Wide gather =
      Scale(std::min(U(s.allgather_bucket_size), c.TpShare(c.f.total + c.f.lora)) * c.w, factor);
  out->Add("comm_allgather_bucket", "parameter all-gather buckets after the step", gather, 0, 0, 0,
           kPhaseOptimizerStep, Alloc::kTransient);
  return Status::Ok();
}

// zero3_live_params, zero3_block_grads. ZeRO-3 gathers the current block's parameters and
// prefetches up to stage3_prefetch_bucket_size more, capped by stage3_max_live_parameters
// (deepspeed/runtime/zero/partitioned_param_coordinator.py, fetch_sub_module); in backward the
// block's full gradients exist until reduce-scattered.
Status Zero3Buffers(const ItemContext& c, Builder* out) {
  const TrainingSetup& s = c.s;
  if (s.zero_stage != 3 || c.Fsdp()) return Status::Ok();
  const Wide block = c.TpShare(c.counts.largest_block_params);
  const Wide live = std::min(U(s.stage3_max_live_parameters),
                             block + std::min(U(s.stage3_prefetch_bucket_size), block));
  out->Add("zero3_live_params",
           "gathered parameters of the current block plus the prefetch bucket "
           "(stage3_prefetch_bucket_size), capped by stage3_max_live_parameters",
           live * c.w, 0, 0, 0, kFwdBwd, Alloc::kTransient);
  const Wide block_trainable =
      c.lora ? CeilDiv(c.TpShare(c.f.lora),
                       U(std::max<int64_t>(c.arch.layers + c.arch.decoder_layers, 1)))
             : block;
  out->Add("zero3_block_grads", "full gradients of the current block before reduce-scatter",
           block_trainable * c.w, 0, 0, 0, kPhaseBackward | kPhaseBackwardEnd, Alloc::kTransient);
  return Status::Ok();
}

// fsdp_unsharded_params, fsdp_unit_grads. FSDP all-gathers a wrapped unit's flat parameter
// in the compute dtype before the unit runs (FlatParamHandle.unshard from _pre_forward and
// _pre_backward_hook, torch/distributed/fsdp/_runtime_utils.py). FULL_SHARD frees it after the
// unit's forward and after its backward (reshard) and prefetches the next unit in backward
// (BackwardPrefetch.BACKWARD_PRE); SHARD_GRAD_OP keeps every unit unsharded from its forward
// until its backward; NO_SHARD with CPU offload copies each unit to the GPU and frees nothing
// before backward. In backward the unit's unsharded gradient lives until it is reduce-scattered
// (or copied to the CPU).
Status FsdpUnits(const ItemContext& c, Builder* out) {
  if (!c.Fsdp()) return Status::Ok();
  const Wide all = c.TpShare(c.f.total - c.frozen_quantized + c.f.lora);
  const Wide unit = std::min(all, c.largest_unit);
  const unsigned live_phases = kPhaseForward | kPhaseBackward;
  Wide live = 0;
  std::string how;
  switch (c.fsdp) {
    case FsdpSharding::kFullShard:
      live = std::min(all, 2 * unit);
      how = "the current unit and the one prefetched";
      break;
    case FsdpSharding::kShardGradOp:
      live = all;
      how = "every unit, kept from its forward until its backward (SHARD_GRAD_OP)";
      break;
    case FsdpSharding::kNoShard:
      live = c.fsdp_offload ? all : 0;
      how = "every unit copied from the CPU, kept until after backward (NO_SHARD)";
      break;
    case FsdpSharding::kNone: break;
  }
  out->Add("fsdp_unsharded_params", "unsharded parameters on the GPU: " + how, live * c.w, 0, 0, 0,
           live_phases, Alloc::kTransient);
  if (c.fsdp != FsdpSharding::kNoShard || c.fsdp_offload) {
    const Wide grads = c.lora
                           ? CeilDiv(c.TpShare(c.f.lora),
                                     U(std::max<int64_t>(c.arch.layers + c.arch.decoder_layers, 1)))
                           : unit;
    out->Add("fsdp_unit_grads",
             "the unit's unsharded gradient before reduce-scatter (or the copy to the CPU)",
             (grads + (c.fsdp == FsdpSharding::kNoShard ? 0 : CeilDiv(grads, c.d))) * c.w, 0, 0, 0,
             kPhaseBackward | kPhaseBackwardEnd, Alloc::kTransient);
  }
  return Status::Ok();
}

struct ItemRule {
  const char* items;  // the breakdown items it adds, for readers
  Status (*add)(const ItemContext&, Builder*);
};

// Every item of the model, in report order (cuda_context and allocator_margin are added with the
// phase totals).
constexpr ItemRule kItemRules[] = {
    {"params_working, autocast_weight_copies, params_quantized, qlora_dequant_workspace",
     ParamsWorking},
    {"params_master", ParamsMaster},
    {"grads, grads_fp32", Grads},
    {"ddp_grad_buckets", DdpBuckets},
    {"optimizer_states", OptimizerStates},
    {"optimizer_step_transient", OptimizerStepTransient},
    {"nvme_optimizer_swap_buffers", NvmeOptimizerSwapBuffers},
    {"nvme_param_swap_buffers", NvmeParamSwapBuffers},
    {"nvme_param_flat_buffer", NvmeParamFlatBuffer},
    {"activations, activation_recompute, backward_workspace, logits_and_loss, logits_grad",
     ActivationItems},
    {"comm_reduce_bucket, comm_allgather_bucket", CommBuckets},
    {"zero3_live_params, zero3_block_grads", Zero3Buffers},
    {"fsdp_unsharded_params, fsdp_unit_grads", FsdpUnits},
};

// Phase totals and the peak (Note [Phases]); the CUDA context and the allocator margin are added
// to each phase's GPU total and reported as items.
void TotalPhases(const ItemContext& c, Builder* out, MemoryEstimate* m) {
  const Wide context = U(c.s.cuda_context_bytes);
  Wide peak_margin = 0;
  for (Phase phase : kPhases) {
    PhaseTotals totals;
    totals.phase = PhaseName(phase);
    Wide gpu = 0, cpu = 0, nvme = 0, pinned = 0, transient = 0;
    for (size_t i = 0; i < out->items.size(); ++i) {
      const MemoryItem& item = out->items[i];
      if ((item.phases & phase) == 0) continue;
      if (out->allocs[i] == Alloc::kTransient) transient += item.gpu_bytes;
      gpu += item.gpu_bytes;
      cpu += item.cpu_bytes;
      nvme += item.nvme_bytes;
      pinned += item.pinned_bytes;
    }
    const Wide margin = Scale(transient, kAllocatorMargin);
    totals.gpu_allocated_bytes = Saturate(gpu);
    totals.gpu_bytes = Saturate(gpu + margin + context);
    totals.cpu_bytes = Saturate(cpu);
    totals.nvme_bytes = Saturate(nvme);
    totals.pinned_bytes = Saturate(pinned);
    if (totals.gpu_bytes > m->peak.gpu_bytes || m->peak.phase.empty()) {
      m->peak.gpu_bytes = totals.gpu_bytes;
      m->peak.phase = totals.phase;
      peak_margin = margin;
    }
    m->peak.cpu_bytes = std::max(m->peak.cpu_bytes, totals.cpu_bytes);
    m->peak.nvme_bytes = std::max(m->peak.nvme_bytes, totals.nvme_bytes);
    m->peak.pinned_bytes = std::max(m->peak.pinned_bytes, totals.pinned_bytes);
    m->phases.push_back(totals);
  }
  out->Add("cuda_context", "CUDA context, runtime and kernels (per GPU process)", context, 0, 0, 0,
           kAllPhases);
  out->Add("allocator_margin",
           "caching-allocator rounding and fragmentation: 10% of the activations and "
           "temporaries at the peak phase",
           peak_margin, 0, 0, 0, kAllPhases);
}

std::vector<ModelConstant> Constants(const ItemContext& c, const TrainingSetup& input) {
  const TrainingSetup& s = c.s;
  const Activations& act = c.act;
  const bool fp32 = s.precision == Precision::kFp32;
  return {
      {"activation_element_bytes", fp32 ? 4.0 : 2.0, "bytes",
       "activations are kept in the compute dtype (Korthikanti et al. 2022 count 16-bit)"},
      {"dropout_mask_bytes", kDropoutMaskBytes, "bytes/element",
       "PyTorch dropout keeps a bool mask (Korthikanti: 1 byte)"},
      {"flash_lse_bytes", kFlashLseBytes, "bytes per head per token",
       "FlashAttention keeps fp32 log-sum-exp statistics instead of the s x s scores"},
      {"working_param_bytes", static_cast<double>(c.w), "bytes/param",
       fp32 ? "fp32 training" : "16-bit working copy (mixed or pure precision)"},
      {"master_param_bytes", c.mixed ? 4.0 : 0.0, "bytes/param",
       "fp32 master weights in mixed precision (ZeRO paper: part of K = 12)"},
      {"optimizer_state_bytes", static_cast<double>(OptimizerStateBytes(s, 1 << 20, 0)) / (1 << 20),
       "bytes/param",
       "adamw 8 (m, v fp32), adam8bit 2 + fp32 absmax per 256-element block per state, sgd and "
       "lion 4, adafactor 4 + factored rows/cols; halved states in bf16-pure (REFERENCE 4)"},
      {"nf4_bits_per_param", c.frozen_quantized > 0 ? c.nf4_bits : 0.0, "bits",
       "QLoRA NF4: 4-bit codes + fp32 absmax per 64 (4.5); double quantisation 4.127"},
      {"overlap_comm_factor",
       s.zero_stage >= 1 && s.zero_stage <= 2 && s.OverlapComm() ? kOverlapCommFactor : 1.0,
       "x bucket bytes",
       "ZeRO-1/2: the Hugging Face DeepSpeed guide's overlap_comm rule (about 4.5x the bucket "
       "sizes); ZeRO-3 allocates one flat reduce bucket (stage3.py IPG buffer)"},
      {"logits_forward_bytes",
       act.logits_forward_per_logit > 0 ? act.logits_forward_per_logit
                                        : (act.logits_forward > 0 && s.loss != Loss::kFused
                                               ? kLogitsForwardFp32Bytes + (fp32 ? 0 : 2)
                                               : 0.0),
       "bytes per logit", "compute-dtype logits, fp32 upcast and log-softmax kept by the loss"},
      {"logits_backward_bytes", act.logits_backward > 0 ? kLogitsBackwardBytes : 0.0,
       "bytes per logit", "fp32 gradients of log-probabilities and logits at backward start"},
      {"cuda_context_bytes", static_cast<double>(s.cuda_context_bytes), "bytes",
       "measured 1,343 MiB on a V100 (Hugging Face, model memory anatomy); GPU/driver dependent"},
      {"allocator_margin_fraction", kAllocatorMargin, "of activations and temporaries",
       "PyTorch caching allocator: reserved exceeds allocated by block rounding and "
       "fragmentation where blocks come and go every step; start-up model states excluded"},
      {"seq_len", static_cast<double>(s.seq_len), "tokens",
       input.seq_len > 0 ? "given" : "default: min(max_position_embeddings, 2048), else 512"},
  };
}

std::vector<std::string> Notes(const ItemContext& c) {
  std::vector<std::string> notes = {
      "Peak is the largest of four phases (end of forward; first layer of backward with its "
      "recompute; end of backward; optimizer step), per tier; the GPU peak's phase is reported.",
      "Activations per layer follow Korthikanti et al. 2022 (sbh(34 + 5as/h) for a GPT-3 layer), "
      "with each term derived from the model: GQA key/value width, gated MLP (4 f-wide tensors), "
      "MoE top-k, dropout masks only where dropout is on, flash attention, tensor and sequence "
      "parallelism.",
      "Gradients are counted in every phase (DeepSpeed keeps its gradient partitions allocated; "
      "accumulation carries them through the forward pass).",
      "Tensor parallelism divides all parameters by tp (norms and biases are in fact replicated).",
      "Encoder-decoder models: the decoder sequence is as long as the encoder's (`seq_len`).",
      "CPU, NVMe and pinned bytes are per node (all local ranks); GPU bytes are per GPU. Model "
      "loading (a full copy per rank without zero.Init) is not included.",
  };
  if (c.s.zero_stage == 0 && c.master) {
    notes.push_back(
        "ZeRO-0 in mixed precision is counted like DeepSpeed's: 16-bit working weights and "
        "gradients plus fp32 master weights (`autocast` counts torch.autocast over fp32 "
        "parameters instead).");
  }
  const TrainingSetup& s = c.s;
  notes.push_back(
      "The allocator margin (10%) applies to activations and per-step temporaries only; model "
      "states allocated once at start-up are counted as allocated (Note [Allocator margin]).");
  if (UpcastingNorm(c.arch) && s.precision != Precision::kFp32) {
    notes.push_back(
        "The norms keep their input in fp32 (Transformers' LlamaRMSNorm and its copies upcast "
        "before normalising), and the normalised tensor when their weight trains.");
  }
  if (c.lora) {
    notes.push_back(
        "LoRA: only the adapters (" + std::to_string(static_cast<uint64_t>(c.f.lora)) +
        " parameters) train; the frozen Linears keep no input for a weight gradient (autograd's "
        "mm saves its input only when the weight requires grad), each adapter keeps its dropout "
        "mask and input" +
        (s.qlora ? "; bitsandbytes' MatMul4Bit keeps every quantised Linear's input "
                   "(ctx.tensors = (A, B)) and dequantises one 16-bit weight at a time"
                 : std::string()) +
        ".");
  }
  if ((s.zero_stage == 0 || c.Fsdp()) && !c.Offloaded() && !c.fsdp_offload) {
    std::string how = s.fused_optimizer        ? "fused (in place, no temporaries)"
                      : s.foreach && !c.Fsdp() ? "foreach (one state-sized temporary per step)"
                                               : "a per-tensor loop (temporaries of the largest "
                                                 "tensor; FSDP's FlatParameters get no foreach)";
    notes.push_back("The optimizer step runs PyTorch's " + how +
                    " implementation (torch/optim/adam.py); `foreach` and `fused_optimizer` "
                    "choose.");
  }
  if (s.optimizer == Optimizer::kSgd) {
    notes.push_back(s.sgd_momentum > 0
                        ? "SGD with momentum keeps one momentum buffer per parameter."
                        : "SGD without momentum (PyTorch's default) keeps no optimizer state.");
  }
  if (s.autocast) {
    notes.push_back(
        "torch.autocast over fp32 parameters: fp32 weights and gradients stepped directly (no "
        "master copy, no fp32 gradient copy), plus autocast's 16-bit weight copies through "
        "forward and backward.");
  }
  if (s.zero_stage == 0 && s.DataParallel() > 1) {
    notes.push_back(
        s.gradient_as_bucket_view
            ? "DDP with gradient_as_bucket_view: the gradients are views of the reducer's buckets."
            : "DDP keeps its gradient buckets, a second copy of the gradients "
              "(gradient_as_bucket_view off, PyTorch's default).");
  }
  if (s.zero_stage == 3) {
    notes.push_back(
        "ZeRO-3: one flat reduce bucket of reduce_bucket_size elements (contiguous_gradients); "
        "the optimizer step converts one sub-group (<= sub_group_size elements) of gradients "
        "to fp32 at a time (stage3.py _prepare_fp32_grad_for_sub_group / _release_sub_group).");
    if (c.Offloaded()) {
      notes.push_back(
          "ZeRO-3 with an offloaded optimizer keeps the 16-bit gradient partition in host memory; "
          "the fp32 gradients go to an fp32 buffer in host memory (cpu) or are swapped out to "
          "NVMe with the optimizer state (nvme: stage3.py partition_grads -> "
          "swap_out_gradients).");
    }
    if (s.offload_param == OffloadDevice::kNvme || s.offload_optimizer == OffloadDevice::kNvme) {
      notes.push_back(
          "NVMe: a partition of at least max(1 MiB, aio.block_size) bytes gets a swap file of its "
          "own (1 KiB aligned), a smaller one stays in host memory (swappable_tensor); a tied "
          "output head built inside zero.Init leaves a file of its own; with offload_param nvme "
          "the trainable 16-bit partitions also live in a pinned flat host buffer of up to "
          "offload_param.max_in_cpu elements (stage3.py "
          "_create_param_groups_fp16_flat_cpu_memory). Measured with DeepSpeed 0.19 "
          "(bench/deepspeed_nvme_truth.py).");
    }
  }
  if (c.Fsdp()) {
    notes.push_back(
        c.FsdpName() +
        ": each rank keeps its shard of the flat parameters, gradients and optimizer "
        "states (parameters and gradients in fp32 under mixed precision, on the CPU with CPU "
        "offload, where the optimizer then steps); a wrapped unit (the largest repeated block) is "
        "gathered in the compute dtype while it runs" +
        (s.fsdp != c.fsdp ? std::string("; with one data-parallel rank FSDP uses NO_SHARD, which "
                                        "keeps every gathered unit on the GPU from forward to "
                                        "backward (torch/distributed/fsdp/_init_utils.py)")
                          : std::string()) +
        ".");
  }
  if (s.framework == Framework::kLitGpt) {
    notes.push_back(
        "Lit-GPT: LoRA on the fused QKV Linear keeps one dropout per block input and, when only "
        "some of q/k/v are adapted, the zero-padded update (index_copy's source); the fused QKV "
        "output stays alive through the value view beside the roped query and key; the head runs "
        "in 128-position chunks that Fabric converts to fp32 for the loss" +
        (s.qlora ? std::string("; QLoRA quantises every Linear, the head included, from fp16 "
                               "copies, so dequantising makes an fp16 and a bf16 copy")
                 : std::string()) +
        ".");
  }
  if (s.TorchBefore(1, 11)) {
    notes.push_back("PyTorch " + s.torch_version +
                    ": softmax and log_softmax keep their input as well as their output for "
                    "backward (fixed in 1.11, pytorch#64000).");
  }
  if (ActivationExtraTensors(c.arch.hidden_act) > 0 && s.framework == Framework::kTransformers) {
    notes.push_back("The MLP activation '" + c.arch.hidden_act +
                    "' is a Python formula in Transformers (transformers/activations.py); autograd "
                    "keeps " +
                    std::to_string(ActivationExtraTensors(c.arch.hidden_act)) +
                    " intermediate tensors of the MLP width besides its input.");
  }
  if (s.tp > 1) {
    notes.push_back(s.sequence_parallel
                        ? "Sequence parallelism splits the norm and dropout activations over tp."
                        : "Tensor parallelism without sequence parallelism replicates the norm and "
                          "dropout activations on every tp rank.");
  }
  if (s.checkpointing == Checkpointing::kSelective) {
    notes.push_back(
        "Selective recompute drops the core attention and recomputes it in backward, as "
        "Megatron's does, with or without flash attention (Korthikanti et al. 2022).");
  }
  return notes;
}

// The facts of an inventory that do not depend on the ZeRO stage or offload, computed once for
// all rows of a comparison: a per-expert DeepSeek-V3 has 45,000 tensors.
struct InventoryFacts {
  ParamFacts f;
  ModelCounts counts;
};

// `counts` is CountParams(inventory) when the caller has it, else nullptr.
Result<InventoryFacts> FactsFor(const ModelInventory& inventory, const TrainingSetup& s,
                                const ModelCounts* counts) {
  InventoryFacts out;
  MEMPLAN_ASSIGN_OR_RETURN(out.f, Facts(inventory, s));
  if (out.f.total == 0) {
    return Status::InvalidArgument(inventory.name + ": the model has no parameters");
  }
  if (counts != nullptr) {
    out.counts = *counts;
  } else {
    MEMPLAN_ASSIGN_OR_RETURN(out.counts, CountParams(inventory));
  }
  return out;
}

// `step`: also run the step model (the comparison rows, which report the itemised peak only,
// skip it: eleven step simulations of a 47,000-tensor MoE would cost 300 ms).
Result<MemoryEstimate> EstimateWith(const ModelInventory& inventory, const TrainingSetup& input,
                                    const InventoryFacts* known, const ModelCounts* counts,
                                    bool step = true) {
  MEMPLAN_RETURN_IF_ERROR(input.ValidateFor(inventory));
  TrainingSetup s = input;
  s.seq_len = s.SeqLenFor(&*inventory.arch);
  InventoryFacts computed;
  if (known == nullptr) {
    MEMPLAN_ASSIGN_OR_RETURN(computed, FactsFor(inventory, s, counts));
    known = &computed;
  }
  const ParamFacts& f = known->f;

  ItemContext c(inventory, s, f, known->counts);
  c.lora = s.lora_rank > 0;
  c.mixed = Mixed(s.precision);
  c.master = c.mixed && !s.autocast;
  c.w = s.precision == Precision::kFp32 ? 4 : 2;
  c.param_bytes = s.autocast ? 4 : c.w;
  c.grad_bytes = s.autocast ? 4 : c.w;
  c.t = U(s.tp);
  c.d = U(s.DataParallel());
  c.g = U(s.gpus_per_node);
  c.trainable = c.lora ? f.lora : f.total;
  const bool litgpt = s.framework == Framework::kLitGpt;
  c.frozen_quantized = c.lora && s.qlora ? f.quantizable + (litgpt ? f.head : 0) : 0;
  c.largest_quantized = std::max(f.largest_quantized, litgpt ? f.head : Wide{0});
  c.fsdp = s.EffectiveFsdp();
  c.fsdp_offload = c.Fsdp() && s.offload_param == OffloadDevice::kCpu;
  c.fsdp_param_bytes = s.precision == Precision::kBf16Pure ? 2 : 4;
  if (c.Fsdp()) c.master = false;  // FSDP's sharded parameters are the fp32 copy
  c.largest_unit = c.TpShare(c.counts.largest_block_params > 0 ? c.counts.largest_block_params
                                                               : f.largest_trainable_tensor);
  c.nf4_bits = s.double_quant ? kNf4DoubleQuantBits : kNf4Bits;
  c.half = HalfName(s.precision);
  c.opt_where = std::string(OffloadDeviceName(s.offload_optimizer));
  c.act = CountActivations(inventory, s, f);

  Builder out;
  for (const ItemRule& rule : kItemRules) MEMPLAN_RETURN_IF_ERROR(rule.add(c, &out));
  if (out.overflow) {
    return Status::OutOfRange(inventory.name +
                              ": the memory needed overflows 2^62 bytes; check "
                              "`micro_batch` and `seq_len`");
  }
  MemoryEstimate m;
  m.setup = s;
  m.params_total = static_cast<uint64_t>(f.total);
  m.trainable_params = static_cast<uint64_t>(c.trainable);
  m.lora_params = static_cast<uint64_t>(f.lora);
  m.activation_bytes_per_layer = Saturate(c.act.per_layer);
  TotalPhases(c, &out, &m);
  if (step) {
    // The step model (Note [The step model]) over the model states the items above place.
    StepStates st;
    auto gpu_of = [&](std::string_view name) {
      uint64_t b = 0;
      for (const MemoryItem& item : out.items) {
        if (item.name == name) b += item.gpu_bytes;
      }
      return b;
    };
    st.parameters = gpu_of("params_working") + gpu_of("params_quantized") + gpu_of("params_master");
    for (const TensorInfo& b : inventory.buffers) {
      st.buffers += AllocatorRound(b.numel * static_cast<uint64_t>(DTypeBits(b.dtype) / 8));
    }
    st.optimizer_states = gpu_of("optimizer_states");
    const bool plain = s.zero_stage == 0 && !c.Fsdp() && s.DataParallel() == 1 && s.grad_accum == 1;
    st.persistent_gradients = plain ? 0 : gpu_of("grads") + gpu_of("ddp_grad_buckets");
    st.plain_gradients = plain;
    st.torch_optimizer = s.zero_stage == 0 || c.Fsdp();
    st.from_inventory = s.zero_stage == 0 && !c.Fsdp();
    const uint64_t tokens = static_cast<uint64_t>(s.micro_batch) * static_cast<uint64_t>(s.seq_len);
    st.other = CublasWorkspaceBytes(s.GpuSm()) + 2 * AllocatorRound(tokens * 8);
    Result<StepModel> sim = SimulateStep(inventory, s, st);
    if (sim.ok()) {
      m.step = std::move(sim).value();
    } else {
      m.step_error = sim.status().message();
      m.step_unmodelled = sim.status().code() == StatusCode::kUnimplemented;
    }
  }
  m.items = std::move(out.items);
  m.constants = Constants(c, input);
  m.notes = Notes(c);
  return m;
}

}  // namespace

Result<MemoryEstimate> EstimateMemory(const ModelInventory& inventory, const TrainingSetup& input) {
  return EstimateWith(inventory, input, nullptr, nullptr);
}

Result<MemoryEstimate> EstimateMemory(const ModelInventory& inventory, const TrainingSetup& input,
                                      const ModelCounts& counts, bool step_model) {
  return EstimateWith(inventory, input, nullptr, &counts, step_model);
}

namespace {

Result<std::vector<ComparisonRow>> Compare(const ModelInventory& inventory,
                                           const TrainingSetup& setup, const ModelCounts* counts) {
  struct Combo {
    int stage;
    OffloadDevice opt, param;
  };
  using D = OffloadDevice;
  const Combo combos[] = {{0, D::kNone, D::kNone}, {1, D::kNone, D::kNone}, {1, D::kCpu, D::kNone},
                          {2, D::kNone, D::kNone}, {2, D::kCpu, D::kNone},  {3, D::kNone, D::kNone},
                          {3, D::kCpu, D::kNone},  {3, D::kCpu, D::kCpu},   {3, D::kNvme, D::kNone},
                          {3, D::kNvme, D::kCpu},  {3, D::kNvme, D::kNvme}};
  std::vector<ComparisonRow> rows;
  std::optional<InventoryFacts> facts;  // the same for every row: computed at the first
  for (const Combo& c : combos) {
    TrainingSetup s = setup;
    s.zero_stage = c.stage;
    s.offload_optimizer = c.opt;
    s.offload_param = c.param;
    ComparisonRow row;
    row.zero_stage = c.stage;
    row.offload_optimizer = c.opt;
    row.offload_param = c.param;
    Status valid = s.Validate();
    if (!valid.ok()) {
      row.reason = valid.message();
      rows.push_back(row);
      continue;
    }
    if (!facts.has_value()) {
      MEMPLAN_RETURN_IF_ERROR(s.ValidateFor(inventory));
      MEMPLAN_ASSIGN_OR_RETURN(facts, FactsFor(inventory, s, counts));
    }
    Result<MemoryEstimate> m = EstimateWith(inventory, s, &*facts, nullptr, /*step=*/false);
    if (!m.ok()) return m.status();
    row.valid = true;
    row.peak = m->peak;
    Phase peak_phase = kPhaseForward;
    for (Phase p : kPhases) {
      if (PhaseName(p) == m->peak.phase) peak_phase = p;
    }
    for (const MemoryItem& item : m->items) {
      if ((item.phases & peak_phase) != 0 &&
          (item.name == "activations" || item.name == "activation_recompute" ||
           item.name.rfind("logits", 0) == 0)) {
        row.activations_gpu_bytes += item.gpu_bytes;
      }
    }
    rows.push_back(row);
  }
  return rows;
}

}  // namespace

Result<std::vector<ComparisonRow>> CompareZeroStages(const ModelInventory& inventory,
                                                     const TrainingSetup& setup) {
  return Compare(inventory, setup, nullptr);
}

Result<std::vector<ComparisonRow>> CompareZeroStages(const ModelInventory& inventory,
                                                     const TrainingSetup& setup,
                                                     const ModelCounts& counts) {
  return Compare(inventory, setup, &counts);
}

}  // namespace memplan::estimator
