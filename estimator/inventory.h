// ModelInventory: every parameter tensor of a model, with where it lives in the module tree.
//
// It is the estimator's input, built from a Hugging Face config.json (hf_config.h), a tensor-shape
// list (shape_list.h) or safetensors headers (safetensors.h). Everything later (DeepSpeed tables,
// activations, plans, offload schedules) is computed from it.
//
// Naming follows PyTorch's `named_parameters()` of the model Transformers would build, so
// inventories can be compared name by name with the real thing. A tied tensor (a Parameter shared
// by two modules, like GPT-2's lm_head.weight and transformer.wte.weight) appears under each name;
// all but the first carry `tied_to`, and counts include it once.
//
// Thread safety: a plain value; no internal synchronisation.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common/status.h"

namespace memplan::estimator {

enum class DType {
  kF64,
  kF32,
  kF16,
  kBF16,
  kF8E4M3,
  kF8E5M2,
  kI64,
  kI32,
  kI16,
  kI8,
  kU8,
  kBool,
};

// Safetensors spelling: "F32", "BF16", "I8", ...
std::string_view DTypeName(DType dtype);
// Bits per element (F32 -> 32, BOOL -> 8 as stored).
int DTypeBits(DType dtype);
// Accepts safetensors ("F32", "BF16"), PyTorch ("float32", "torch.bfloat16", "half", "float") and
// numpy-like ("fp16", "bf16", "int8") spellings, case-insensitive.
Result<DType> ParseDType(std::string_view text);

// Note [Tensor roles]
// What a parameter is in the model, decided in one place per source: the family builders set it
// from the module they emit (hf_family.cc, hf_families_encoder.cc, hf_families_vision.cc), since
// they know which module each tensor belongs to; tensor-shape lists and safetensors headers,
// which carry names only, get it from ClassifyTensor (the one name classifier, inventory.cc).
// Everything downstream (which Linears QLoRA quantises and LoRA adapts, which query/key/value a
// projection computes, where the output head is, which GEMMs a step runs) reads the role, never
// the name.
enum class TensorRole : uint8_t {
  kUnknown,                // a name the classifier could not place (shape lists, safetensors)
  kEmbedding,              // token embedding table [V, h]
  kPositionEmbedding,      // learned absolute position table
  kTokenTypeEmbedding,     // BERT's segment table
  kRelativeAttentionBias,  // T5's relative position bias table
  kNorm,                   // LayerNorm / RMSNorm (block, final, q/k norms)
  kAttentionQ,             // query projection (MLA: q_b_proj, or the full q_proj)
  kAttentionK,
  kAttentionV,
  kAttentionQkv,     // fused query/key/value projection
  kAttentionKv,      // fused key/value projection (GPT-2 cross-attention)
  kAttentionOut,     // attention output projection
  kAttentionQDown,   // MLA: q_a_proj, the query's low-rank down-projection
  kAttentionKvDown,  // MLA: kv_a_proj_with_mqa, the compressed key/value latent
  kAttentionKvUp,    // MLA: kv_b_proj, latent to per-head keys and values
  kAttentionSinks,   // gpt-oss: learned per-head sink logits
  kMlpUp,            // MLP input projection (the only one of an ungated MLP)
  kMlpGate,          // gated MLP: the gate projection
  kMlpGateUp,        // gated MLP: gate and up fused
  kMlpDown,          // MLP output projection
  kRouter,           // MoE router
  kExpertUp,         // routed experts (fused 3-D tensors or one Linear per expert)
  kExpertGate,
  kExpertGateUp,
  kExpertDown,
  kSharedExpertGate,  // Qwen2-MoE: the sigmoid gate of the shared expert
  kHead,              // the language-model output head (to the vocabulary)
  kHeadTransform,     // BERT/DistilBERT MLM head: the dense transform before the decoder
  kClassifier,        // a task head (sequence/token classification, QA, next sentence)
  kPooler,            // BERT's pooler
  kPatchEmbedding,    // a vision tower's patch convolution
  kProjector,         // a multimodal projector (vision width to text width)
  kAdapter,           // LoRA adapters (lora_A / lora_B) found in a checkpoint
  kOther,             // a parameter of none of these kinds (CLIP's class embedding, ...)
};
// The module type a parameter belongs to (nn.Linear, Transformers' Conv1D, ...).
enum class ModuleKind : uint8_t {
  kOther,      // a bare nn.Parameter of the module (routers in Transformers 5, fused experts)
  kLinear,     // nn.Linear: weight [out, in], bias [out]
  kConv1D,     // transformers' Conv1D (GPT-2): weight [in, out], bias [out]
  kEmbedding,  // nn.Embedding: weight [rows, width]
  kNorm,       // LayerNorm / RMSNorm
  kConv2d,     // nn.Conv2d (vision patches)
};

// "attention_q", "mlp_down", "head", ...: the role as JSON and reports spell it.
std::string_view TensorRoleName(TensorRole role);
// The query (1), key (2) and value (4) parts a projection computes; 7 for a fused QKV; 6 for
// a fused key/value; 0 for anything else.
unsigned QkvParts(TensorRole role);
// Embedding-like tables: token, position, segment, relative bias.
bool IsEmbeddingTable(TensorRole role);

struct TensorInfo {
  std::string name;            // "model.layers.0.self_attn.q_proj.weight"
  std::vector<int64_t> shape;  // PyTorch order; [] is a scalar
  DType dtype = DType::kF32;
  uint64_t numel = 0;   // product of shape, overflow-checked when added
  std::string module;   // owning module: name without its last component ("" = root)
  std::string block;    // enclosing repeated block, "model.layers.0" ("" = none)
  int layer = -1;       // index of that block within its stack, -1 when none
  std::string tied_to;  // non-empty: same Parameter as the tensor of that name
  // Note [Tensor roles]: what the tensor is, the module type it belongs to, and whether it is
  // that module's bias (a Linear's or a norm's) rather than its weight.
  TensorRole role = TensorRole::kUnknown;
  ModuleKind kind = ModuleKind::kOther;
  bool bias = false;

  // The weight of an nn.Linear or a Conv1D (not its bias).
  bool IsLinearWeight() const {
    return (kind == ModuleKind::kLinear || kind == ModuleKind::kConv1D) && !bias;
  }
  // A Linear weight's input and output widths, whichever way it is stored (Conv1D: [in, out]).
  int64_t InFeatures() const {
    return shape.size() == 2 ? shape[kind == ModuleKind::kConv1D ? 0 : 1] : 0;
  }
  int64_t OutFeatures() const {
    return shape.size() == 2 ? shape[kind == ModuleKind::kConv1D ? 1 : 0] : 0;
  }
};

// What the family builders say about a tensor they add (Note [Tensor roles]).
struct TensorTraits {
  TensorRole role = TensorRole::kUnknown;
  ModuleKind kind = ModuleKind::kOther;
  bool bias = false;
};

// The one name classifier (Note [Tensor roles]): the role, module kind and bias of a tensor
// known by its name and shape only (tensor-shape lists, safetensors headers), from the module
// names Transformers, PEFT and the checkpoints of the supported families use. `model_type` ("" when
// unknown) tells GPT-2's Conv1D weights ([in, out]) from Linears.
TensorTraits ClassifyTensor(std::string_view name, const std::vector<int64_t>& shape,
                            std::string_view model_type);
struct ModelInventory;
// ClassifyTensor over every tensor of `inventory` (shape lists and safetensors headers, after
// their last tensor is added).
void ClassifyTensors(ModelInventory* inventory);

// The architecture hyperparameters that activation memory depends on (Korthikanti et al.; see
// memory_model.h). The config.json builders fill it with the same defaults they use for the
// tensors; tensor-shape lists and safetensors headers do not carry it (heads, activation and
// dropout cannot be read off shapes), so their inventories leave it empty and the memory model
// says so instead of guessing.
struct ArchitectureInfo {
  int64_t hidden = 0;              // model width h (d_model)
  int64_t layers = 0;              // transformer blocks; for encoder-decoder models the encoder's
  int64_t decoder_layers = 0;      // encoder-decoder only: decoder blocks (self + cross attention)
  int64_t heads = 0;               // query heads a
  int64_t kv_heads = 0;            // key/value heads (== heads for MHA; fewer for GQA/MQA)
  int64_t head_dim = 0;            // per head; heads * head_dim need not equal hidden (Gemma, T5)
  int64_t intermediate = 0;        // FFN width f (per expert for MoE)
  int64_t vocab = 0;               // V
  int64_t max_positions = 0;       // learned/usable positions; 0 when relative (no hard limit)
  bool learned_positions = false;  // absolute position table: seq_len must fit max_positions
  std::string hidden_act;          // "gelu", "gelu_new", "relu", "silu", ... as the config says
  bool gated_mlp = false;          // SwiGLU/GeGLU: two input projections and an elementwise product
  int64_t experts = 0;             // MoE experts per layer; 0 = dense
  int64_t experts_per_token = 0;   // MoE top-k
  double hidden_dropout = 0;       // after attention output and MLP (residual dropout)
  double attention_dropout = 0;    // on the softmax probabilities
  double embedding_dropout = 0;    // on the embedding output
  // An encoder's classification head's dropout (BERT's and RoBERTa's classifier_dropout, else
  // hidden_dropout_prob; DistilBERT's seq_classif_dropout for sequences, dropout for tokens).
  double classifier_dropout = 0;
  bool encoder_decoder = false;
  // Decoder-only: each token attends to those before it, so generation keeps a KV cache.
  bool causal = false;
  // Heads the KV cache holds per layer when that is not kv_heads (0 = kv_heads): Falcon's new
  // decoder architecture broadcasts its KV heads to every query head before caching them.
  int64_t cached_kv_heads = 0;

  // Structures beyond the classic block (filled where the family has them; 0/false/empty = not
  // present). See Note [Architecture beyond the classic block] in hf_family.h.
  int64_t dense_intermediate = 0;   // MoE models: FFN width of their dense (non-MoE) layers
  int64_t moe_layers = 0;           // MoE models: how many of `layers` route through experts
  int64_t shared_intermediate = 0;  // MoE: total width of the always-on shared expert MLP(s)
  int64_t kv_lora_rank = 0;         // MLA: compressed key/value latent width (what is cached)
  int64_t q_lora_rank = 0;          // MLA: query low-rank width (0: a full q_proj)
  int64_t qk_rope_head_dim = 0;     // MLA: rotary part of each query/key head (cached, shared)
  int64_t qk_nope_head_dim = 0;     // MLA: non-rotary part of each query/key head
  int64_t v_head_dim = 0;           // MLA: value head width
  int64_t sliding_window = 0;       // tokens a sliding-window layer attends to (0 = none)
  // Per layer (size `layers`, or empty when every layer is full attention): true where the layer
  // attends within `sliding_window` only.
  std::vector<bool> sliding_layers;
  // Per layer (size `layers`, or empty when every layer has one): true where the layer applies
  // no rotary embedding to its queries and keys (SmolLM3's NoPE layers, `no_rope_layers` 0).
  std::vector<bool> nope_layers;
  bool attention_sinks = false;     // a learned per-head sink logit (gpt-oss)
  bool parallel_attention = false;  // attention and MLP read the same input (GPT-J, Falcon, Phi)
  bool clip_qkv = false;       // OLMo, OLMoE: queries, keys and values clamped in place (clip_qkv)
  int64_t mtp_layers = 0;      // multi-token-prediction modules the checkpoint adds (DeepSeek)
  uint64_t mtp_params = 0;     // their parameters: in the checkpoint, not in the model built
  std::string no_split_class;  // the block class Accelerate/FSDP keep whole: "LlamaDecoderLayer"
  // The norms upcast their input to fp32 before normalising and multiply the weight in after
  // (LlamaRMSNorm and its copies, T5LayerNorm): they keep fp32 inputs under autocast.
  bool norm_upcasts = false;
  // config.json's use_cache (the configuration class's default when absent): Transformers'
  // decoders then fill a DynamicCache even in training, copying every layer's keys and values.
  bool use_cache = false;
  // Position information: the dimensions of each query/key head rotary embeddings rotate (0:
  // none), or ALiBi biases (Bloom, Falcon with alibi, MPT).
  int64_t rotary_dims = 0;
  bool alibi = false;
  // The rotary scaling a config names (rope_scaling / rope_parameters' rope_type, or type in
  // older configs: "llama3", "yarn", "linear", ...); empty when it names none. Frameworks pick
  // their builders by it (torchtune's llama3_1 for "llama3").
  std::string rope_type;
  // Implementation choices a config pins, as it names them (MPT's attn_config.attn_impl:
  // "torch", "flash"; its norm_type: "low_precision_layernorm", "layernorm", ...); empty when
  // the family has no such field or the config leaves it to the framework's default.
  std::string attention_impl;
  std::string norm_type;
  // Options a config sets that change the block's computation but not its tensors, by the
  // config's names, where the family reader knows them (MPT: clip_qkv, softcapping, sliding
  // windows, sequence ids, qk_gn, embedding_fraction, a non-default ffn_act_fn); empty: none.
  std::vector<std::string> block_options;
  // DeepSeek-V3's router and rotation (DeepseekV3Config): top-k weights normalised to sum 1
  // (norm_topk_prob), and the rotary pairs interleaved (rope_interleave); both on by default.
  bool norm_topk_prob = true;
  bool rope_interleave = true;
  // Gemma-2's tanh soft-capping of the attention scores and of the output logits (0: none).
  double attn_softcap = 0;
  double final_softcap = 0;
  // T5: the decoder's output scaled by d_model**-0.5 before lm_head (T5Config's
  // scale_decoder_outputs: true unless the config says tie_word_embeddings false, as T5 v1.1's do).
  bool scale_decoder_output = false;

  // "swiglu", "geglu", "gelu", "relu", ...: the MLP kind for reports.
  std::string MlpKind() const;
};

// Where an inventory's mixture-of-experts weights live. Transformers >= 5 builds each MoE layer's
// experts as one module holding 3-D tensors (`mlp.experts.gate_up_proj` [E, 2F, h]); checkpoints
// and Transformers 4 hold one Linear per expert (`mlp.experts.0.gate_proj.weight`). Counts are
// the same; DeepSpeed's largest layer and ZeRO-3's live parameters are not (see
// Note [Expert layout] in hf_family.h).
enum class ExpertLayout { kFused, kPerExpert };

struct ModelInventory {
  std::string name;          // what the user called it: "llama-2-7b", a path, "org/name"
  std::string model_type;    // config.json's model_type, or "" when unknown (shape lists)
  std::string architecture;  // class built: "LlamaForCausalLM", "LlamaModel", or ""
  std::string model_class;   // "causal_lm", "masked_lm", "seq2seq_lm" or "base"; "" if unknown
  std::string source;        // "config", "builtin", "shape-list", "safetensors"
  std::vector<TensorInfo> tensors;
  // Buffers the model registers (rotary inv_freq, position ids, ...), as PyTorch builds them in
  // fp32: never parameters, never trained, but in Accelerate's sizes (CountParams). Filled by the
  // config.json builders only.
  std::vector<TensorInfo> buffers;
  // Modules Accelerate keeps whole (instances of the model's `_no_split_modules` classes, e.g.
  // "model.layers.0"); empty when unknown (shape lists, safetensors headers).
  std::vector<std::string> no_split_modules;
  // Filled by the config.json builders; empty for shape lists and safetensors headers.
  std::optional<ArchitectureInfo> arch;
  // What the user should know about how the inventory was obtained (a fallback taken, a file
  // fetched), one sentence each; estimates repeat them among their assumptions.
  std::vector<std::string> notes;

  // Appends a tensor, deriving numel, module, block and layer from the name. Fails (naming
  // `name`) on an empty or duplicate name, a negative dim, an overflowing product, or a `tied_to`
  // that names no earlier tensor or a tensor of another shape.
  Status Add(std::string name, std::vector<int64_t> shape, DType dtype = DType::kF32,
             std::string tied_to = "", TensorTraits traits = {});

  // Appends a buffer (validated as Add, without ties).
  Status AddBuffer(std::string name, std::vector<int64_t> shape, DType dtype = DType::kF32);

  // Index of the tensor called `name`, or -1.
  int64_t Find(std::string_view name) const;

 private:
  // Add's lookup of tie targets: a shape list may tie thousands of tensors, and a scan per tie
  // made that quadratic. Hashes of the names -> indices, built at the first tie and extended as
  // tensors are added; every hit is checked against the name, and a miss falls back to Find, so
  // tensors changed behind Add's back cost time, never correctness.
  int64_t FindTieTarget(std::string_view name);
  std::unordered_multimap<size_t, size_t> tie_index_;
  size_t tie_indexed_ = 0;  // tensors[0, tie_indexed_) are in tie_index_
};

// Splits "a.b.3.c.weight" into module "a.b.3.c"; block "a.b.3" and layer 3 come from the first
// all-digit component (the ModuleList index). Exposed for tests.
void DeriveModulePath(std::string_view name, std::string* module, std::string* block, int* layer);

struct ModelCounts {
  uint64_t params_total = 0;          // tied tensors once; buffers are never in an inventory
  uint64_t largest_layer_params = 0;  // DeepSpeed's: most params held directly by one module
  std::string largest_layer_module;   // that module's path ("" = the root module)
  uint64_t largest_block_params = 0;  // largest element of a ModuleList (a repeated block)
  std::string largest_block;          // its path, "" when the model has no repeated blocks
  uint64_t num_tensors = 0;           // including tied aliases
  uint64_t num_tied = 0;
  uint64_t num_blocks = 0;       // number of distinct repeated blocks
  uint64_t bytes_as_stored = 0;  // sum of numel * dtype size, tied once
  uint64_t buffers_total = 0;    // buffer elements (not parameters)
  // Accelerate's calculate_maximum_sizes on the model built in fp32 (what `accelerate
  // estimate-memory` starts from): every parameter once and every buffer, at 4 bytes per float
  // element (8 per int64), and its "largest layer": the largest module that is either one of
  // `no_split_modules` or has no submodules, found by descending from the root (see
  // Note [Accelerate's largest layer] in inventory.cc). 0 when the inventory has no module tree
  // information (shape lists and safetensors headers still get a leaf-module figure).
  uint64_t accelerate_total_bytes = 0;
  uint64_t accelerate_largest_layer_bytes = 0;
  std::string accelerate_largest_layer;  // its module path (the first when several tie)
};

// Fails with OutOfRange if a sum overflows 64 bits.
Result<ModelCounts> CountParams(const ModelInventory& inventory);

}  // namespace memplan::estimator
