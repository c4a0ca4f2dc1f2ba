// Declarative descriptions of Hugging Face model families, and the one builder that interprets
// them (hf_family.cc). Internal to the estimator: hf_config.cc dispatches a config.json's
// model_type here; the tables live in hf_families_decoder.cc.
//
// A family is described, not programmed: which config.json fields give which size (and their
// defaults, read from the family's configuration class), which switches change the structure
// (biases, tying, norms), and the modules of the model in the order Transformers registers them
// (the order named_parameters() yields): what comes before the repeated blocks, one block, what
// comes after, and the task heads. Adding a family is a new table; a new kind of structure is a
// new Part kind or width here.
//
// Note [Architecture beyond the classic block]
// Newer families add structure the classic Korthikanti layer lacks, and the builder records it in
// ArchitectureInfo for activations and the KV cache:
//   - MoE placement: every layer (Mixtral, gpt-oss), every `decoder_sparse_step`-th layer except
//     `mlp_only_layers` (Qwen2-MoE, Qwen3-MoE), or every layer from `first_k_dense_replace` on
//     (DeepSeek); shared experts beside the routed ones (Qwen2-MoE: one MLP of
//     shared_expert_intermediate_size and a sigmoid gate; DeepSeek: n_shared_experts x
//     moe_intermediate_size as one MLP).
//   - MLA (DeepSeek-V2/V3): queries through a q_lora_rank bottleneck (or a full q_proj when the
//     rank is null), keys and values from one compressed latent of kv_lora_rank plus a shared
//     rotary key of qk_rope_head_dim; the cache holds that latent, not per-head keys and values.
//   - Sliding-window layers (Gemma-2/3, gpt-oss, Qwen with use_sliding_window), from the config's
//     `layer_types` or the family's rule when absent.
//   - gpt-oss's attention sinks and biased MoE, Falcon/GPT-J/Phi's parallel attention.
//
// Note [Expert layout]
// Transformers >= 5 fuses each MoE layer's experts into one module of 3-D tensors
// (`mlp.experts.gate_up_proj` [E, 2F, h], `down_proj` [E, h, F]) and converts checkpoints when
// loading; Transformers 4 and the published safetensors hold one Linear per expert
// (`mlp.experts.3.gate_proj.weight`; Mixtral: `block_sparse_moe.experts.3.w1.weight`). Counts
// agree, but DeepSpeed's largest layer and what ZeRO-3 gathers at once do not: fused, all of a
// layer's experts are one parameter. ExpertLayout::kFused (the default) describes the model
// Transformers builds today; kPerExpert the checkpoint and Transformers 4. gpt-oss was published
// fused, so both layouts are the same for it.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

#include "common/status.h"
#include "estimator/config_reader.h"
#include "estimator/hf_config.h"
#include "estimator/inventory.h"

namespace memplan::estimator::family {

// The sizes every family's config maps onto.
enum class Dim : uint8_t {
  kHidden,
  kLayers,
  kHeads,
  kKvHeads,
  kHeadDim,
  kIntermediate,
  kVocab,
  kPositions,
  kExperts,             // routed experts per MoE layer
  kTopK,                // experts per token
  kMoeIntermediate,     // one routed expert's FFN width
  kSharedIntermediate,  // width of the shared-expert MLP (Qwen2-MoE); DeepSeek: see kSharedExperts
  kSharedExperts,       // DeepSeek: shared experts, fused into one MLP of kSharedExperts x kMoe...
  kQLoraRank,           // MLA; 0 = full q_proj
  kKvLoraRank,
  kQkNopeHeadDim,
  kQkRopeHeadDim,
  kVHeadDim,
  kEmbedProj,        // OPT's word_embed_proj_dim
  kRotaryDim,        // GPT-J's rotary_dim (its sinusoid table's width)
  kSlidingWindow,    // 0 = none
  kSparseStep,       // Qwen-MoE decoder_sparse_step
  kFirstDense,       // DeepSeek first_k_dense_replace
  kMaxWindowLayers,  // Qwen max_window_layers
  kSlidingPattern,   // Gemma-3 sliding_window_pattern
  kMtpLayers,        // DeepSeek-V3 num_nextn_predict_layers
  kChannels,         // vision towers: image channels (num_channels)
  kImageSize,        // vision towers: image side in pixels
  kPatchSize,        // vision towers: patch side in pixels
  kVisionHidden,     // multimodal models: the vision tower's width (for the projector)
  kFeatureLayers,    // Llava: vision layers whose outputs the projector concatenates
  kCount,
};

// How a Dim is read from config.json. The kinds mirror what configuration classes do for an
// absent field: refuse (kRequired; see Note [Required size fields] in hf_families_decoder.cc),
// a constant, another size, a quotient (head_dim = hidden / heads) or a multiple (4 x hidden).
struct DimField {
  enum Kind : uint8_t { kRequired, kDefault, kSameAs, kQuotient, kMultiple };
  Dim dim;
  std::string_view field;
  Kind kind = kDefault;
  int64_t value = 0;  // kDefault: the default; kMultiple: the factor
  Dim a = Dim::kHidden;
  Dim b = Dim::kHeads;
  // Another spelling of the field (a configuration class's attribute_map, or an older name);
  // Transformers applies it after the class's own arguments, so it wins when both are present.
  std::string_view alias = {};
  // JSON null means "none" (0), as q_lora_rank: null does; an absent field still takes the
  // default. Zero is then allowed as a value.
  bool zero_allowed = false;
};

constexpr DimField Required(Dim d, std::string_view f, std::string_view alias = {}) {
  return {d, f, DimField::kRequired, 0, Dim::kHidden, Dim::kHeads, alias};
}
constexpr DimField Default(Dim d, std::string_view f, int64_t v, std::string_view alias = {}) {
  return {d, f, DimField::kDefault, v, Dim::kHidden, Dim::kHeads, alias};
}
// A count that may be zero or null (sliding_window: null, q_lora_rank: null).
constexpr DimField Optional(Dim d, std::string_view f, int64_t v) {
  return {d, f, DimField::kDefault, v, Dim::kHidden, Dim::kHeads, {}, true};
}
constexpr DimField SameAs(Dim d, std::string_view f, Dim a) {
  return {d, f, DimField::kSameAs, 0, a};
}
constexpr DimField Quotient(Dim d, std::string_view f, Dim a, Dim b) {
  return {d, f, DimField::kQuotient, 0, a, b};
}
constexpr DimField Multiple(Dim d, std::string_view f, int64_t k, Dim a) {
  return {d, f, DimField::kMultiple, k, a};
}

// Structural switches. Most come from config.json or are constants of the family (FlagField);
// the last group the builder sets from the sizes, the layer being built and the requested layout.
enum class Flag : uint8_t {
  kAlways,
  kTie,      // tie_word_embeddings
  kQkvBias,  // q/k/v projections (or the fused qkv) have biases
  kOBias,    // the attention output projection has a bias
  kMlpBias,
  kNormBias,         // LayerNorm (weight and bias) rather than RMSNorm (weight only)
  kNormAffine,       // OPT's layer_norm_elementwise_affine: norms have parameters at all
  kHeadQkNorm,       // RMSNorm over each head's queries and keys (Qwen3, Gemma-3)
  kFullQkNorm,       // RMSNorm over all queries and all keys (OLMo-2)
  kQkLayerNorm,      // Phi's qk_layernorm: LayerNorm over each head
  kPerHeadQkNorm,    // StableLM's qk_layernorm: one LayerNorm module per head
  kNoInputNorm,      // OLMo-2: no norm before attention
  kSandwichNorms,    // Gemma-2/3: pre- and post-feedforward norms as well
  kPostFfNorm,       // a norm after the MLP (Gemma-2/3, OLMo-2)
  kScaledEmbedding,  // Gemma: the embedding holds an embed_scale buffer
  kRotaryPerType,    // Gemma-3: one rotary table per attention type
  kNewDecoderArch,   // Falcon
  kMultiQuery,       // Falcon
  kParallelAttn,     // Falcon
  kTwoNorms,         // Falcon: ln_attn and ln_mlp
  kFinalNorm,        // OPT: do_layer_norm_before and not _remove_final_layer_norm
  kRemoveFinalNorm,  // OPT: _remove_final_layer_norm
  kUseSlidingWindow,
  kRouterBiasBuffer,  // DeepSeek-V3: the router's e_score_correction_bias buffer
  kCrossAttention,    // GPT-2's add_cross_attention
  kVisionHead,        // SigLIP's vision_use_head: the attention-pooling head
  kLearnedPositions,  // MPT: a learned position table (learned_pos_emb without ALiBi or RoPE)
  kGatedMlp,          // MPT: ffn_config.ffn_type mptglu, a gated MLP
  kAlibi,             // Falcon's alibi: ALiBi biases instead of rotary embeddings
  // Set by the builder:
  kProjectInOut,  // OPT: word_embed_proj_dim != hidden_size
  kQLora,         // MLA: q_lora_rank is set
  kMoeLayer,      // this layer routes through experts
  kDenseLayer,    // this layer has a plain MLP
  kFused,         // ExpertLayout::kFused
  kPerExpert,     // ExpertLayout::kPerExpert
  kCount,
};

// A switch read from config.json (`field`, with its default), or a constant of the family when
// `field` is empty.
struct FlagField {
  Flag flag;
  std::string_view field;
  bool value = false;
};
// Switches a family always has, as a bit set for FamilySpec::on: On(Flag::kRotary, ...).
template <typename... Flags>
constexpr uint64_t On(Flags... flags) {
  return ((uint64_t{1} << static_cast<int>(flags)) | ... | 0);
}
static_assert(static_cast<int>(Flag::kCount) <= 64);

// When a part (or its bias) exists: both conditions must hold.
struct Cond {
  Flag flag = Flag::kAlways;
  bool negate = false;
  Flag also = Flag::kAlways;
  bool also_negate = false;
};
constexpr Cond kYes{};
constexpr Cond kNo{Flag::kAlways, true};
constexpr Cond If(Flag f) { return {f}; }
constexpr Cond IfNot(Flag f) { return {f, true}; }
constexpr Cond Both(Flag f, Flag g) { return {f, false, g}; }

// A tensor dimension, as the family's modules compute it.
enum class W : uint8_t {
  kNone,
  kOne,
  kTwo,
  kHidden,  // h
  kVocab,   // V
  kQ,       // heads x head_dim
  kKv,      // kv_heads x head_dim
  kQkv,     // (heads + 2 kv_heads) x head_dim: fused q/k/v
  kKvPair,  // 2 x kv_heads x head_dim: fused k/v
  kFfn,     // intermediate
  kFfn2,    // 2 x intermediate: fused gate and up
  kExperts,
  kMoeFfn,     // one expert's width
  kMoeFfn2,    // 2 x one expert's width
  kSharedFfn,  // the shared-expert MLP's width
  kHeadDim,
  kHeads,
  kKvHeads,         // key/value heads (a count: StableLM's per-head norms)
  kQRank,           // MLA q_lora_rank
  kQHeads,          // MLA heads x (qk_nope + qk_rope)
  kKvA,             // MLA kv_lora_rank + qk_rope
  kKvRank,          // MLA kv_lora_rank
  kKvB,             // MLA heads x (qk_nope + v_head_dim)
  kVOut,            // MLA heads x v_head_dim
  kEmbedProj,       // OPT word_embed_proj_dim
  kPositions,       // max_position_embeddings
  kPositionsOpt,    // OPT's learned positions: max_position_embeddings + 2
  kLabels,          // num_labels (or len(id2label))
  kRotaryHalf,      // rotary inv_freq length: ceil(rotary dims / 2)
  kRotaryDim,       // GPT-J rotary_dim (or h when absent)
  kChannels,        // vision towers: image channels
  kPatches,         // vision towers: (image_size / patch_size)^2
  kPatchesPlusOne,  // CLIP: the patches and the class token
  kVisionHidden,    // multimodal: the vision tower's width
  kVisionFeatures,  // Llava: vision width x feature layers (the projector's input)
};

enum class Kind : uint8_t {
  kLinear,      // nn.Linear(a -> b): weight [b, a], bias [b] when `bias` holds
  kConv1D,      // transformers' Conv1D(a -> b), GPT-2's: weight stored [a, b], always a bias
  kEmbedding,   // nn.Embedding(a rows, b cols): weight [a, b]
  kNorm,        // weight [a], bias [a] when `bias` holds (RMSNorm: bias never)
  kParam,       // a bare nn.Parameter named `name`, shape [a] / [a, b] / [a, b, c]; a bias
                // of its module when `bias` holds (BiasParam)
  kBuffer,      // a buffer (fp32), shape as kParam
  kIdsBuffer,   // an int64 buffer (position ids), shape as kParam
  kMaskBuffer,  // a bool buffer (GPT-BigCode's causal `bias`), shape as kParam
  kConv2d,      // nn.Conv2d(a channels -> b, kernel = stride = the patch): weight [b, a, p, p]
  kRotaryPerLayerType,  // Gemma-3: inv_freq and original_inv_freq per attention type present
  kPerExpert,           // the next `group` parts repeat once per expert (or per `a`: Repeat), "{e}"
                        // replaced by the index
  kInclude,  // the parts of `include`, in order (shared sub-lists: one attention, one MLP)
};

// Note [Tensor roles] (inventory.h): each Linear, Conv1D and bare Parameter part says what it is;
// the builder gives embeddings (by their rows: vocabulary or positions), norms, patch
// convolutions, the LM head and task heads theirs, and hf_family_test checks that no tensor of
// any family is left without one.
using R = TensorRole;

struct Part {
  Kind kind;
  std::string_view name;
  W a = W::kNone;
  W b = W::kNone;
  W c = W::kNone;
  Cond bias = kNo;
  Cond when = kYes;
  int group = 0;  // kPerExpert: how many following parts form one expert
  std::span<const Part> include = {};
  TensorRole role = TensorRole::kUnknown;
  W d = W::kNone;  // a fourth dimension (GPT-Neo's [1, 1, P, P] causal tables)

  // This part with role `r`: Linear("self_attn.q_proj", ...).As(R::kAttentionQ).
  constexpr Part As(TensorRole r) const {
    Part p = *this;
    p.role = r;
    return p;
  }
};

constexpr Part Linear(std::string_view n, W in, W out, Cond bias = kNo, Cond when = kYes) {
  return {Kind::kLinear, n, in, out, W::kNone, bias, when};
}
constexpr Part Conv1D(std::string_view n, W in, W out, Cond when = kYes) {
  return {Kind::kConv1D, n, in, out, W::kNone, kYes, when};
}
constexpr Part Embedding(std::string_view n, W rows, W cols, Cond when = kYes) {
  return {Kind::kEmbedding, n, rows, cols, W::kNone, kNo, when};
}
constexpr Part Norm(std::string_view n, W dim, Cond bias = kNo, Cond when = kYes) {
  return {Kind::kNorm, n, dim, W::kNone, W::kNone, bias, when};
}
constexpr Part Param(std::string_view n, W a, W b = W::kNone, W c = W::kNone, Cond when = kYes) {
  return {Kind::kParam, n, a, b, c, kNo, when};
}
// A bare nn.Parameter that is a bias (gpt-oss's fused expert and router biases).
constexpr Part BiasParam(std::string_view n, W a, W b = W::kNone) {
  return {Kind::kParam, n, a, b, W::kNone, kYes, kYes};
}
constexpr Part Buffer(std::string_view n, W a, W b = W::kNone, Cond when = kYes) {
  return {Kind::kBuffer, n, a, b, W::kNone, kNo, when};
}
constexpr Part IdsBuffer(std::string_view n, W a, W b = W::kNone) {
  return {Kind::kIdsBuffer, n, a, b, W::kNone, kNo, kYes};
}
constexpr Part MaskBuffer(std::string_view n, W a, W b = W::kNone, W c = W::kNone, W d = W::kNone) {
  return {Kind::kMaskBuffer, n, a, b, c, kNo, kYes, 0, {}, TensorRole::kUnknown, d};
}
constexpr Part PatchConv(std::string_view n, W in, W out, Cond bias) {
  return {Kind::kConv2d, n, in, out, W::kNone, bias, kYes};
}
constexpr Part PerExpert(int parts, Cond when) {
  return {Kind::kPerExpert, "", W::kExperts, W::kNone, W::kNone, kNo, when, parts};
}
// The next `parts` parts once per `count` (W::kHeads: StableLM's per-head query norms).
constexpr Part Repeat(int parts, W count, Cond when) {
  return {Kind::kPerExpert, "", count, W::kNone, W::kNone, kNo, when, parts};
}
constexpr Part Include(std::span<const Part> parts, Cond when = kYes) {
  return {Kind::kInclude, "", W::kNone, W::kNone, W::kNone, kNo, when, 0, parts};
}

// Which layers route through experts.
enum class MoePlacement : uint8_t {
  kNone,
  kEveryLayer,  // Mixtral, gpt-oss
  kSparseStep,  // Qwen-MoE: (i + 1) % decoder_sparse_step == 0 and i not in mlp_only_layers
  kAfterDense,  // DeepSeek: i >= first_k_dense_replace
};

// Which layers attend within a sliding window when config.json has no `layer_types`.
enum class SlidingRule : uint8_t {
  kNone,
  kEveryLayer,        // Mistral, Starcoder2, Phi-3: sliding_window on every layer when set
  kEveryLayerIfUsed,  // Qwen3-MoE: the same, when use_sliding_window
  kAlternate,         // Gemma-2, gpt-oss: even layers (i + 1) % 2 != 0
  kPattern,           // Gemma-3: all but every sliding_window_pattern-th layer
  kQwen,              // Qwen2/3: use_sliding_window and i >= max_window_layers
  kQwen2Moe,          // Qwen2-MoE: use_sliding_window, (i + 1) % 2 != 0 and i < max_window_layers
  kOlmo3,             // OLMo 3: (i + 1) % 4 != 0
  kNopeIfUsed,        // SmolLM3: use_sliding_window, sliding_window set, and a NoPE layer
};

enum class HeadKind : uint8_t { kSequence, kToken, kQuestionAnswering };

// A task-head class: <class prefix> + suffix, wrapping the base model under `prefix`.
struct HeadSpec {
  HeadKind kind;
  std::string_view suffix;  // "ForSequenceClassification"
  std::string_view prefix;  // the base model's attribute: "model", "transformer"
  std::span<const Part> parts;
};

// The values the builder works with, after reading and adjusting.
struct Values {
  int64_t dims[static_cast<int>(Dim::kCount)] = {};
  std::string_view fields[static_cast<int>(Dim::kCount)] = {};  // the spelling each was read from
  bool flags[static_cast<int>(Flag::kCount)] = {};
  int64_t labels = 2;
  double partial_rotary = 1.0;
  // Set by a family's `adjust` when its dropout lives in a nested config (MPT's attn_config);
  // negative: read FamilySpec::attention_dropout_field.
  double attention_dropout = -1;
  // Set by a family's `adjust`: ArchitectureInfo's attention_impl and norm_type.
  std::string attention_impl, norm_type;
  std::vector<std::string> block_options;  // ArchitectureInfo's
  bool clip_qkv = false;                   // ArchitectureInfo's
  int64_t Get(Dim d) const { return dims[static_cast<int>(d)]; }
  void Set(Dim d, int64_t v) { dims[static_cast<int>(d)] = v; }
  std::string_view Field(Dim d) const { return fields[static_cast<int>(d)]; }
  bool Is(Flag f) const { return flags[static_cast<int>(f)]; }
  void Set(Flag f, bool v) { flags[static_cast<int>(f)] = v; }
};

struct FamilySpec {
  std::string_view model_type;
  std::string_view class_prefix;       // "Llama": LlamaModel, LlamaForCausalLM, Llama + head suffix
  std::string_view base_class = {};    // when not <prefix>Model: "Gemma3TextModel"
  std::string_view causal_class = {};  // when not <prefix>ForCausalLM: "Gemma3ForCausalLM"
  // The causal-LM class of the model's own (trust_remote_code) modelling code, which published
  // config.json files name: MPT's "MPTForCausalLM". Built as the causal-LM class.
  std::string_view remote_causal_class = {};
  std::string_view no_split_class = {};        // when not <prefix>DecoderLayer
  std::string_view prefix = "model";           // the base model inside the causal-LM class
  std::span<const DimField> common_dims = {};  // read first: sizes shared with other families
  std::span<const DimField> dims = {};         // then the family's own
  std::span<const DimField> more_dims = {};    // then more shared ones (MLA's)
  std::span<const FlagField> flags = {};
  uint64_t on = 0;  // switches always on, On(...)
  // Corrections no table can express (Falcon's head layout rules); may refuse the config.
  Status (*adjust)(const ConfigReader& config, Values* values) = nullptr;
  std::span<const Part> before = {};  // relative to the base model
  std::string_view layers = "layers";
  // Modules outside the layers whose classes are in `_no_split_modules` (a vision tower's
  // embeddings), kept whole by Accelerate when the model has them.
  std::span<const std::string_view> no_split_parts = {};
  std::span<const Part> layer = {};  // relative to one layer
  std::span<const Part> after = {};
  Part lm_head = Linear("lm_head", W::kHidden, W::kVocab).As(R::kHead);
  std::string_view tied_embedding = "embed_tokens.weight";  // relative to the base model
  std::span<const HeadSpec> heads = {};
  MoePlacement moe = MoePlacement::kNone;
  SlidingRule sliding = SlidingRule::kNone;
  bool gated_mlp = true;
  bool learned_positions = false;
  // use_cache when config.json does not say (the configuration class's default).
  bool use_cache_default = true;
  // The norms are LayerNorms even where they have no bias (MPT's no_bias), so they do not
  // upcast as LlamaRMSNorm does (ArchitectureInfo::norm_upcasts).
  bool layer_norm = false;
  bool parallel_attention = false;
  bool attention_sinks = false;
  bool mla = false;
  bool partial_rotary = false;  // rotary inv_freq covers partial_rotary_factor of head_dim
  double partial_rotary_default = 1.0;
  std::string_view partial_rotary_field = "partial_rotary_factor";  // its top-level spelling
  std::string_view act_field = "hidden_act";
  std::string_view act_alias =
      {};  // a newer name that wins when present (Gemma's hidden_activation)
  std::string_view act_default = "silu";
  std::string_view attention_dropout_field = "attention_dropout";
  double attention_dropout_default = 0;
  std::string_view hidden_dropout_field = {};
  double hidden_dropout_default = 0;
  std::string_view embedding_dropout_field = {};
  double embedding_dropout_default = 0;
  // The checkpoint adds this many multi-token-prediction modules beyond the layers Transformers
  // builds (DeepSeek-V3's num_nextn_predict_layers); reported, not built.
  bool mtp = false;
  // Rotary position embeddings (partial_rotary and kRotaryDim say over how much of a head).
  bool rotary = true;
  // Some layers skip them (SmolLM3): `no_rope_layers` (1 = RoPE, 0 = NoPE per layer), else every
  // `no_rope_layer_interval`-th layer (default 4) is a NoPE layer.
  bool nope_layers = false;
  // Only the sliding-window layers rotate (Cohere2: its full-attention layers are NoPE). With
  // `rope_without_window` every layer rotates when the config has no window (EXAONE 4);
  // without it no layer does (Cohere2).
  bool nope_full_layers = false;
  bool rope_without_window = false;
  // ALiBi biases (Bloom, MPT; Falcon when its `alibi` flag is set).
  bool alibi = false;
  // attn_logit_softcapping / final_logit_softcapping (Gemma-2, Gemma-3), with the configuration
  // class's defaults (0: None).
  bool softcapping = false;
  double attn_softcap_default = 0;
  double final_softcap_default = 0;
};

// num_labels as PretrainedConfig resolves it: the size of id2label when given, else num_labels,
// else 2.
Result<int64_t> NumLabels(const ConfigReader& config);

// The table of families (hf_families_decoder.cc), and the one builder.
const FamilySpec* FindFamily(std::string_view model_type);
std::span<const FamilySpec* const> Families();
Status Build(const FamilySpec& spec, const FamilyRequest& request, ModelInventory* out);

// Note [Multimodal models]
// A vision-language model (Llava, Gemma-3) is three models in one: a vision tower (a FamilySpec
// of its own, built from `vision_config`), a projector from the tower's width to the language
// model's (parts of the composite), and a language model built by its own family from
// `text_config`, each under the composite's module path. Published configs leave most sub-config
// fields to their classes' defaults (llava-1.5-7b's text_config has no hidden_size), so a
// composite names those defaults, as its configuration class does. Activations are the language
// model's; the vision tower's are not modelled, and the inventory says so.

// A sub-model's configuration: the field, its model_type when absent, and the defaults its
// configuration class gives the size fields for each model_type it may hold.
struct SubConfigDefault {
  std::string_view model_type;
  std::string_view field;
  int64_t value;
};
struct SubConfig {
  std::string_view field;                           // "vision_config", "text_config"
  std::string_view default_type;                    // "clip_vision_model", "llama"
  std::span<const SubConfigDefault> defaults = {};  // used when the field is absent
  // The defaults of the whole sub-config when the composite's config has none at all
  // (LlavaConfig's SubConfigSpec init_kwargs).
  std::span<const SubConfigDefault> when_absent = {};
};

struct CompositeSpec {
  std::string_view model_type;    // "llava"
  std::string_view class_prefix;  // "Llava": LlavaModel, Llava + head suffix
  std::string_view causal_class;  // "LlavaForConditionalGeneration"
  SubConfig vision;
  SubConfig text;
  std::span<const DimField> dims = {};  // the composite's own (vision_feature_layer)
  std::span<const FlagField> flags = {};
  std::span<const Part> projector = {};  // relative to the base model
  std::span<const HeadSpec> heads = {};
  bool tie_default = false;  // tie_word_embeddings when the config does not say
  // LlavaConfig ties when either it or its text_config says so.
  bool tie_from_text = false;
};

// The vision towers composites build (hf_families_vision.cc): CLIP's and SigLIP's.
std::span<const FamilySpec* const> VisionTowers();
const CompositeSpec* FindComposite(std::string_view model_type);
std::span<const CompositeSpec* const> Composites();
Status BuildComposite(const CompositeSpec& spec, const FamilyRequest& request, ModelInventory* out);

}  // namespace memplan::estimator::family
