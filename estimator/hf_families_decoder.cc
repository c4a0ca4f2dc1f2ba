// The decoder-only families as tables for the one builder of hf_family.h: gpt2, gpt_neox, llama,
// mistral, mixtral, qwen2, qwen3, qwen2_moe, qwen3_moe, gemma, gemma2, gemma3_text, olmo2,
// olmo, olmo3, olmoe, hunyuan_v1_dense, glm, glm4, ministral, smollm3, granite, seed_oss,
// starcoder2, phi, phi3, deepseek_v2, deepseek_v3, gpt_oss, falcon, bloom, gptj, opt, mpt,
// stablelm, gpt_bigcode.
//
// Note [Names and order]
// Each table lists the parameters of the class Transformers (5.x) builds for the config, named and
// ordered as `named_parameters(remove_duplicate=False)` yields them: a module's own parameters
// before its submodules', submodules in the order their __init__ registers them, a Linear's weight
// before its bias, a tied head last; and its buffers (rotary inv_freq, ...), which are never
// parameters but count in Accelerate's sizes. Where Transformers 5 renamed what checkpoints and
// Transformers 4 call otherwise, the checkpoint's name stays when the structure is the same
// (GPT-NeoX's `embed_out`); MoE experts follow ExpertLayout (Note [Expert layout] in hf_family.h).
// tests/oracle/modern_oracle_test.py checks every table against Transformers 5, names and order
// included; oracle_test.py checks the families Transformers 4.47 knows against it.
//
// Note [Required size fields]
// Transformers fills every absent field from the config class's defaults. For most fields memplan
// does the same (key/value heads, head_dim, biases, experts, tying). The size-defining fields of
// every family but GPT-2 (hidden_size, num_hidden_layers, num_attention_heads, intermediate_size,
// vocab_size, under each family's names) are required instead: their class defaults describe one
// particular model, so a truncated or hand-written config would silently come out as that model.
// Every config Transformers saves carries them. GPT-2 is the exception: GPT2Config's defaults are
// exactly the published gpt2 checkpoint, and early GPT-2-family configs rely on them.
#include <array>
#include <iterator>
#include <utility>
#include <span>
#include <string>
#include <string_view>

#include "estimator/hf_family.h"

namespace memplan::estimator::family {
namespace {

// The size fields every Llama-descended config writes under these names (see Note [Required size
// fields]).
constexpr DimField kLlamaCore[] = {
    Required(Dim::kHidden, "hidden_size"),
    Required(Dim::kLayers, "num_hidden_layers"),
    Required(Dim::kHeads, "num_attention_heads"),
    SameAs(Dim::kKvHeads, "num_key_value_heads", Dim::kHeads),
    Required(Dim::kIntermediate, "intermediate_size"),
    Required(Dim::kVocab, "vocab_size"),
};

// --- Shared parts ---

// Self-attention of the Llama descendants: q, k, v, o, with the optional learned sinks (a Parameter
// of the attention module itself, so listed before its Linears) and q/k norms.
constexpr Part kLlamaAttention[] = {
    Param("self_attn.sinks", W::kHeads, W::kNone, W::kNone, If(Flag::kAlways))
        .As(R::kAttentionSinks),
    Linear("self_attn.q_proj", W::kHidden, W::kQ, If(Flag::kQkvBias)).As(R::kAttentionQ),
    Linear("self_attn.k_proj", W::kHidden, W::kKv, If(Flag::kQkvBias)).As(R::kAttentionK),
    Linear("self_attn.v_proj", W::kHidden, W::kKv, If(Flag::kQkvBias)).As(R::kAttentionV),
    Linear("self_attn.o_proj", W::kQ, W::kHidden, If(Flag::kOBias)).As(R::kAttentionOut),
    Norm("self_attn.q_norm", W::kHeadDim, kNo, If(Flag::kHeadQkNorm)),
    Norm("self_attn.k_norm", W::kHeadDim, kNo, If(Flag::kHeadQkNorm)),
    Norm("self_attn.q_norm", W::kQ, kNo, If(Flag::kFullQkNorm)),
    Norm("self_attn.k_norm", W::kKv, kNo, If(Flag::kFullQkNorm)),
};
// Without sinks (the first entry only exists for gpt-oss).
constexpr std::span<const Part> kLlamaAttentionNoSinks = std::span(kLlamaAttention).subspan(1);

constexpr Part kGatedMlp[] = {
    Linear("mlp.gate_proj", W::kHidden, W::kFfn, If(Flag::kMlpBias)).As(R::kMlpGate),
    Linear("mlp.up_proj", W::kHidden, W::kFfn, If(Flag::kMlpBias)).As(R::kMlpUp),
    Linear("mlp.down_proj", W::kFfn, W::kHidden, If(Flag::kMlpBias)).As(R::kMlpDown),
};

constexpr Part kLlamaNorms[] = {
    Norm("input_layernorm", W::kHidden, If(Flag::kNormBias), IfNot(Flag::kNoInputNorm)),
    Norm("post_attention_layernorm", W::kHidden, If(Flag::kNormBias)),
    Norm("pre_feedforward_layernorm", W::kHidden, kNo, If(Flag::kSandwichNorms)),
    Norm("post_feedforward_layernorm", W::kHidden, kNo, If(Flag::kPostFfNorm)),
};

constexpr Part kLlamaLayer[] = {
    Include(kLlamaAttentionNoSinks),
    Include(kGatedMlp),
    Include(kLlamaNorms),
};

constexpr Part kLlamaBefore[] = {
    Embedding("embed_tokens", W::kVocab, W::kHidden),
    Buffer("embed_tokens.embed_scale", W::kNone, W::kNone, If(Flag::kScaledEmbedding)),
};

// The final norm, then the rotary embedding's inv_freq and original_inv_freq buffers.
constexpr Part kRotary[] = {
    Buffer("rotary_emb.inv_freq", W::kRotaryHalf),
    Buffer("rotary_emb.original_inv_freq", W::kRotaryHalf),
};
constexpr Part kLlamaAfter[] = {
    Norm("norm", W::kHidden, If(Flag::kNormBias)),
    Include(kRotary, IfNot(Flag::kRotaryPerType)),
    {Kind::kRotaryPerLayerType, "rotary_emb", W::kNone, W::kNone, W::kNone, kNo,
     If(Flag::kRotaryPerType)},
};

// --- Task heads (Transformers' Generic* heads and their older per-family copies) ---

constexpr Part kScore[] = {Linear("score", W::kHidden, W::kLabels).As(R::kClassifier)};
constexpr Part kScoreBiased[] = {Linear("score", W::kHidden, W::kLabels, kYes).As(R::kClassifier)};
constexpr Part kClassifierHead[] = {
    Linear("classifier", W::kHidden, W::kLabels, kYes).As(R::kClassifier)};
constexpr Part kQaOutputs[] = {Linear("qa_outputs", W::kHidden, W::kTwo, kYes).As(R::kClassifier)};

constexpr HeadSpec Seq(std::string_view prefix = "model") {
  return {HeadKind::kSequence, "ForSequenceClassification", prefix, kScore};
}
constexpr HeadSpec Token(std::string_view prefix = "model") {
  return {HeadKind::kToken, "ForTokenClassification", prefix, kScoreBiased};
}
constexpr HeadSpec Qa(std::string_view prefix) {
  return {HeadKind::kQuestionAnswering, "ForQuestionAnswering", prefix, kQaOutputs};
}

// Llama, Qwen2, Qwen3 and Qwen3-MoE build their QA head around `transformer`.
constexpr HeadSpec kHeadsQaTransformer[] = {Seq(), Token(), Qa("transformer")};
constexpr HeadSpec kHeadsQaModel[] = {Seq(), Token(), Qa("model")};
constexpr HeadSpec kHeadsSeqToken[] = {Seq(), Token()};
constexpr HeadSpec kHeadsSeq[] = {Seq()};

// --- llama ---

constexpr DimField kLlamaDims[] = {
    Quotient(Dim::kHeadDim, "head_dim", Dim::kHidden, Dim::kHeads),
    Default(Dim::kPositions, "max_position_embeddings", 2048),
};
constexpr FlagField kLlamaFlags[] = {
    {Flag::kTie, "tie_word_embeddings", false},
    {Flag::kQkvBias, "attention_bias", false},
    {Flag::kOBias, "attention_bias", false},
    {Flag::kMlpBias, "mlp_bias", false},
};

// --- mistral, mixtral ---

constexpr DimField kMistralDims[] = {
    Quotient(Dim::kHeadDim, "head_dim", Dim::kHidden, Dim::kHeads),
    Default(Dim::kPositions, "max_position_embeddings", 4096 * 32),
    Optional(Dim::kSlidingWindow, "sliding_window", 4096),
};
constexpr DimField kMixtralDims[] = {
    Quotient(Dim::kHeadDim, "head_dim", Dim::kHidden, Dim::kHeads),
    Default(Dim::kPositions, "max_position_embeddings", 4096 * 32),
    Optional(Dim::kSlidingWindow, "sliding_window", 0),
    Default(Dim::kExperts, "num_local_experts", 8),
    Default(Dim::kTopK, "num_experts_per_tok", 2),
};
constexpr FlagField kUntied[] = {{Flag::kTie, "tie_word_embeddings", false}};
constexpr FlagField kUntiedAttentionBias[] = {
    {Flag::kTie, "tie_word_embeddings", false},
    {Flag::kQkvBias, "attention_bias", false},
    {Flag::kOBias, "attention_bias", false},
};

// Mixtral's experts, fused (Transformers >= 5: `mlp`, router first) or per expert
// (checkpoints: `block_sparse_moe`, w1 = gate, w2 = down, w3 = up).
constexpr Part kMixtralMoe[] = {
    Param("mlp.gate.weight", W::kExperts, W::kHidden, W::kNone, If(Flag::kFused)).As(R::kRouter),
    Param("mlp.experts.gate_up_proj", W::kExperts, W::kFfn2, W::kHidden, If(Flag::kFused))
        .As(R::kExpertGateUp),
    Param("mlp.experts.down_proj", W::kExperts, W::kHidden, W::kFfn, If(Flag::kFused))
        .As(R::kExpertDown),
    Linear("block_sparse_moe.gate", W::kHidden, W::kExperts, kNo, If(Flag::kPerExpert))
        .As(R::kRouter),
    PerExpert(3, If(Flag::kPerExpert)),
    Linear("block_sparse_moe.experts.{e}.w1", W::kHidden, W::kFfn).As(R::kExpertGate),
    Linear("block_sparse_moe.experts.{e}.w2", W::kFfn, W::kHidden).As(R::kExpertDown),
    Linear("block_sparse_moe.experts.{e}.w3", W::kHidden, W::kFfn).As(R::kExpertUp),
};
constexpr Part kMixtralLayer[] = {
    Include(kLlamaAttentionNoSinks),
    Include(kMixtralMoe),
    Include(kLlamaNorms),
};

// --- qwen2, qwen3 ---

constexpr DimField kQwenDims[] = {
    Quotient(Dim::kHeadDim, "head_dim", Dim::kHidden, Dim::kHeads),
    Default(Dim::kPositions, "max_position_embeddings", 32768),
    Optional(Dim::kSlidingWindow, "sliding_window", 4096),
    Default(Dim::kMaxWindowLayers, "max_window_layers", 28),
};
constexpr DimField kQwen3Dims[] = {
    Default(Dim::kHeadDim, "head_dim", 128),
    Default(Dim::kPositions, "max_position_embeddings", 32768),
    Optional(Dim::kSlidingWindow, "sliding_window", 4096),
    Default(Dim::kMaxWindowLayers, "max_window_layers", 28),
};
constexpr FlagField kQwen2Flags[] = {
    {Flag::kTie, "tie_word_embeddings", false},
    {Flag::kUseSlidingWindow, "use_sliding_window", false},
};
constexpr FlagField kQwen3Flags[] = {
    {Flag::kTie, "tie_word_embeddings", false},
    {Flag::kQkvBias, "attention_bias", false},
    {Flag::kOBias, "attention_bias", false},
    {Flag::kUseSlidingWindow, "use_sliding_window", false},
};

// --- qwen2_moe, qwen3_moe ---

constexpr DimField kQwen2MoeDims[] = {
    Quotient(Dim::kHeadDim, "head_dim", Dim::kHidden, Dim::kHeads),
    Default(Dim::kPositions, "max_position_embeddings", 32768),
    Optional(Dim::kSlidingWindow, "sliding_window", 4096),
    Default(Dim::kMaxWindowLayers, "max_window_layers", 28),
    Default(Dim::kSparseStep, "decoder_sparse_step", 1),
    Default(Dim::kExperts, "num_experts", 60),
    Default(Dim::kTopK, "num_experts_per_tok", 4),
    Default(Dim::kMoeIntermediate, "moe_intermediate_size", 1408),
    Default(Dim::kSharedIntermediate, "shared_expert_intermediate_size", 5632),
};
constexpr DimField kQwen3MoeDims[] = {
    Quotient(Dim::kHeadDim, "head_dim", Dim::kHidden, Dim::kHeads),
    Default(Dim::kPositions, "max_position_embeddings", 32768),
    Optional(Dim::kSlidingWindow, "sliding_window", 4096),
    Default(Dim::kSparseStep, "decoder_sparse_step", 1),
    // Qwen3MoeConfig's attribute_map reads num_experts as num_local_experts.
    {Dim::kExperts, "num_experts", DimField::kDefault, 128, Dim::kHidden, Dim::kHeads,
     "num_local_experts"},
    Default(Dim::kTopK, "num_experts_per_tok", 8),
    Default(Dim::kMoeIntermediate, "moe_intermediate_size", 768),
};
constexpr FlagField kQwen2MoeFlags[] = {
    {Flag::kTie, "tie_word_embeddings", false},
    {Flag::kQkvBias, "qkv_bias", true},
    {Flag::kUseSlidingWindow, "use_sliding_window", false},
};

// Routed experts of one width (moe_intermediate_size), fused or one MLP per expert, and their
// router: a plain weight (a Linear without bias when per expert: the same tensor).
constexpr Part kRoutedExperts[] = {
    Param("mlp.experts.gate_up_proj", W::kExperts, W::kMoeFfn2, W::kHidden, If(Flag::kFused))
        .As(R::kExpertGateUp),
    Param("mlp.experts.down_proj", W::kExperts, W::kHidden, W::kMoeFfn, If(Flag::kFused))
        .As(R::kExpertDown),
    PerExpert(3, If(Flag::kPerExpert)),
    Linear("mlp.experts.{e}.gate_proj", W::kHidden, W::kMoeFfn).As(R::kExpertGate),
    Linear("mlp.experts.{e}.up_proj", W::kHidden, W::kMoeFfn).As(R::kExpertUp),
    Linear("mlp.experts.{e}.down_proj", W::kMoeFfn, W::kHidden).As(R::kExpertDown),
};
constexpr Part kRouter[] = {Param("mlp.gate.weight", W::kExperts, W::kHidden).As(R::kRouter)};

// Qwen2-MoE: router, experts, then the shared expert and its sigmoid gate.
constexpr Part kQwen2Moe[] = {
    Include(kRouter),
    Include(kRoutedExperts),
    Linear("mlp.shared_expert.gate_proj", W::kHidden, W::kSharedFfn).As(R::kMlpGate),
    Linear("mlp.shared_expert.up_proj", W::kHidden, W::kSharedFfn).As(R::kMlpUp),
    Linear("mlp.shared_expert.down_proj", W::kSharedFfn, W::kHidden).As(R::kMlpDown),
    Linear("mlp.shared_expert_gate", W::kHidden, W::kOne).As(R::kSharedExpertGate),
};
constexpr Part kQwen2MoeLayer[] = {
    Include(kLlamaAttentionNoSinks),
    Include(kGatedMlp, If(Flag::kDenseLayer)),
    Include(kQwen2Moe, If(Flag::kMoeLayer)),
    Include(kLlamaNorms),
};
// Qwen3-MoE registers its experts before the router.
constexpr Part kQwen3Moe[] = {Include(kRoutedExperts), Include(kRouter)};
constexpr Part kQwen3MoeLayer[] = {
    Include(kLlamaAttentionNoSinks),
    Include(kGatedMlp, If(Flag::kDenseLayer)),
    Include(kQwen3Moe, If(Flag::kMoeLayer)),
    Include(kLlamaNorms),
};

// --- gemma, gemma2, gemma3_text ---

constexpr DimField kGemmaDims[] = {
    Default(Dim::kHeadDim, "head_dim", 256),
    Default(Dim::kPositions, "max_position_embeddings", 8192),
};
constexpr DimField kGemma2Dims[] = {
    Default(Dim::kHeadDim, "head_dim", 256),
    Default(Dim::kPositions, "max_position_embeddings", 8192),
    Optional(Dim::kSlidingWindow, "sliding_window", 4096),
};
constexpr DimField kGemma3Dims[] = {
    Default(Dim::kHeadDim, "head_dim", 256),
    Default(Dim::kPositions, "max_position_embeddings", 131072),
    Optional(Dim::kSlidingWindow, "sliding_window", 4096),
    Default(Dim::kSlidingPattern, "sliding_window_pattern", 6),
};
// tie_word_embeddings true by default; attention_bias on all four projections.
constexpr FlagField kGemmaFlags[] = {
    {Flag::kTie, "tie_word_embeddings", true},
    {Flag::kQkvBias, "attention_bias", false},
    {Flag::kOBias, "attention_bias", false},
};
constexpr HeadSpec kGemma3Heads[] = {
    {HeadKind::kSequence, "TextForSequenceClassification", "model", kScore}};

// --- olmo2, starcoder2 ---

constexpr DimField kOlmo2Dims[] = {
    Quotient(Dim::kHeadDim, "head_dim", Dim::kHidden, Dim::kHeads),
    Default(Dim::kPositions, "max_position_embeddings", 2048),
};

// OLMo 3: OLMo 2 with sliding-window attention on three layers of four (Olmo3Config's
// layer_types, which saved configs carry) and a rotary embedding per attention type.
constexpr DimField kOlmo3Dims[] = {
    Quotient(Dim::kHeadDim, "head_dim", Dim::kHidden, Dim::kHeads),
    Default(Dim::kPositions, "max_position_embeddings", 2048),
    Optional(Dim::kSlidingWindow, "sliding_window", 4096),
};

// OLMoE: Llama's pre-norm block with OLMo 2's full-width q/k norms and Mixtral's fused experts
// (intermediate_size wide) behind Qwen2-MoE's router (OlmoeTopKRouter), in every layer.
constexpr DimField kOlmoeDims[] = {
    Quotient(Dim::kHeadDim, "head_dim", Dim::kHidden, Dim::kHeads),
    Default(Dim::kPositions, "max_position_embeddings", 4096),
    Default(Dim::kExperts, "num_experts", 64),
    Default(Dim::kTopK, "num_experts_per_tok", 8),
};
// OlmoAttention's and OlmoeAttention's clip_qkv (a number, or null for none) clamps the query,
// key and value in place: ops without tensors of their own (ArchitectureInfo::clip_qkv).
Status AdjustClipQkv(const ConfigReader& config, Values* v) {
  if (!config.Has("clip_qkv") || config.json()["clip_qkv"].is_null()) return Status::Ok();
  if (!config.json()["clip_qkv"].is_number() || config.json()["clip_qkv"].get<double>() <= 0) {
    return config.FieldError("clip_qkv", "must be a positive number or null");
  }
  v->clip_qkv = true;
  return Status::Ok();
}

// --- olmo (OLMo 1, OLMo 1.7) ---

// OlmoLayerNorm has no parameters: the layers hold their attention and MLP only, and the model
// no final norm tensor. Llama's layout otherwise (head_dim from the config when given).
constexpr Part kOlmoLayer[] = {
    Include(kLlamaAttentionNoSinks),
    Include(kGatedMlp),
};

// HunYuan dense (Hunyuan-0.5B to 7B): Llama's block whose attention also has per-head
// query_layernorm and key_layernorm, applied after the rotation (the step model's
// Family::qk_norm_after_rotary), and whose MLP never has biases.
constexpr DimField kHunyuanDims[] = {
    Quotient(Dim::kHeadDim, "head_dim", Dim::kHidden, Dim::kHeads),
    Default(Dim::kPositions, "max_position_embeddings", 2048),
};
constexpr Part kHunyuanLayer[] = {
    Linear("self_attn.q_proj", W::kHidden, W::kQ, If(Flag::kQkvBias)).As(R::kAttentionQ),
    Linear("self_attn.k_proj", W::kHidden, W::kKv, If(Flag::kQkvBias)).As(R::kAttentionK),
    Linear("self_attn.v_proj", W::kHidden, W::kKv, If(Flag::kQkvBias)).As(R::kAttentionV),
    Linear("self_attn.o_proj", W::kQ, W::kHidden, If(Flag::kOBias)).As(R::kAttentionOut),
    Norm("self_attn.query_layernorm", W::kHeadDim, kNo),
    Norm("self_attn.key_layernorm", W::kHeadDim, kNo),
    Include(kGatedMlp),
    Include(kLlamaNorms),
};

// --- glm, glm4 ---

// GLM-4 (glm: GLM-4-9B; glm4: the 0414 models): Llama's attention with q/k/v biases
// (attention_bias, on by default) and rotary over half of each head, Phi-3's fused gate_up_proj;
// Glm4DecoderLayer adds a norm after each branch (post_self_attn_layernorm, post_mlp_layernorm,
// registered after the other two), which the step model runs as Gemma 2's sandwich.
constexpr DimField kGlmDims[] = {
    Default(Dim::kHeadDim, "head_dim", 128),
    Default(Dim::kPositions, "max_position_embeddings", 131072),
};
constexpr FlagField kGlmFlags[] = {
    {Flag::kTie, "tie_word_embeddings", false},
    {Flag::kQkvBias, "attention_bias", true},
};
constexpr Part kGlmMlp[] = {
    Linear("mlp.gate_up_proj", W::kHidden, W::kFfn2).As(R::kMlpGateUp),
    Linear("mlp.down_proj", W::kFfn, W::kHidden).As(R::kMlpDown),
};
constexpr Part kGlmLayer[] = {
    Include(kLlamaAttentionNoSinks),
    Include(kGlmMlp),
    Include(kLlamaNorms),
};
constexpr Part kGlm4Layer[] = {
    Include(kLlamaAttentionNoSinks),
    Include(kGlmMlp),
    Include(kLlamaNorms),
    Norm("post_self_attn_layernorm", W::kHidden, kNo),
    Norm("post_mlp_layernorm", W::kHidden, kNo),
};

// --- granite ---

constexpr DimField kGraniteDims[] = {
    Quotient(Dim::kHeadDim, "head_dim", Dim::kHidden, Dim::kHeads),
    Default(Dim::kPositions, "max_position_embeddings", 2048),
};

// --- seed_oss ---

constexpr DimField kSeedOssDims[] = {
    Default(Dim::kHeadDim, "head_dim", 128),
    Default(Dim::kPositions, "max_position_embeddings", 524288),
};
// Biased q/k/v by default, o_proj by its own switch.
constexpr FlagField kSeedOssFlags[] = {
    {Flag::kTie, "tie_word_embeddings", false},
    {Flag::kQkvBias, "attention_bias", true},
    {Flag::kOBias, "attention_out_bias", false},
    {Flag::kMlpBias, "mlp_bias", false},
};

// --- smollm3 ---

constexpr DimField kSmolLm3Dims[] = {
    Quotient(Dim::kHeadDim, "head_dim", Dim::kHidden, Dim::kHeads),
    Default(Dim::kPositions, "max_position_embeddings", 32768),
    Optional(Dim::kSlidingWindow, "sliding_window", 0),
};
constexpr FlagField kSmolLm3Flags[] = {
    {Flag::kTie, "tie_word_embeddings", true},
    {Flag::kQkvBias, "attention_bias", false},
    {Flag::kOBias, "attention_bias", false},
    {Flag::kMlpBias, "mlp_bias", false},
    {Flag::kUseSlidingWindow, "use_sliding_window", false},
};

constexpr DimField kStarcoder2Dims[] = {
    Quotient(Dim::kHeadDim, "head_dim", Dim::kHidden, Dim::kHeads),
    Default(Dim::kPositions, "max_position_embeddings", 4096),
    Optional(Dim::kSlidingWindow, "sliding_window", 0),
};
constexpr FlagField kStarcoder2Flags[] = {
    {Flag::kTie, "tie_word_embeddings", true},
    {Flag::kQkvBias, "use_bias", true},
    {Flag::kOBias, "use_bias", true},
    {Flag::kMlpBias, "use_bias", true},
};
constexpr Part kStarcoder2Layer[] = {
    Include(kLlamaAttentionNoSinks),
    Linear("mlp.c_fc", W::kHidden, W::kFfn, If(Flag::kMlpBias)).As(R::kMlpUp),
    Linear("mlp.c_proj", W::kFfn, W::kHidden, If(Flag::kMlpBias)).As(R::kMlpDown),
    Include(kLlamaNorms),
};

// --- phi, phi3 ---

constexpr DimField kPhiDims[] = {
    Quotient(Dim::kHeadDim, "head_dim", Dim::kHidden, Dim::kHeads),
    Default(Dim::kPositions, "max_position_embeddings", 2048),
};
constexpr FlagField kPhiFlags[] = {
    {Flag::kTie, "tie_word_embeddings", false},
    {Flag::kQkLayerNorm, "qk_layernorm", false},
};
// Phi's attention output is `dense`; its optional q/k LayerNorms span hidden / heads.
constexpr Part kPhiLayer[] = {
    Linear("self_attn.q_proj", W::kHidden, W::kQ, kYes).As(R::kAttentionQ),
    Linear("self_attn.k_proj", W::kHidden, W::kKv, kYes).As(R::kAttentionK),
    Linear("self_attn.v_proj", W::kHidden, W::kKv, kYes).As(R::kAttentionV),
    Linear("self_attn.dense", W::kQ, W::kHidden, kYes).As(R::kAttentionOut),
    Norm("self_attn.q_layernorm", W::kHeadDim, kYes, If(Flag::kQkLayerNorm)),
    Norm("self_attn.k_layernorm", W::kHeadDim, kYes, If(Flag::kQkLayerNorm)),
    Linear("mlp.fc1", W::kHidden, W::kFfn, kYes).As(R::kMlpUp),
    Linear("mlp.fc2", W::kFfn, W::kHidden, kYes).As(R::kMlpDown),
    Norm("input_layernorm", W::kHidden, kYes),
};
constexpr Part kPhiAfter[] = {
    Norm("final_layernorm", W::kHidden, kYes),
    Include(kRotary),
};

constexpr DimField kPhi3Dims[] = {
    Quotient(Dim::kHeadDim, "head_dim", Dim::kHidden, Dim::kHeads),
    Default(Dim::kPositions, "max_position_embeddings", 4096),
    Optional(Dim::kSlidingWindow, "sliding_window", 0),
};
// Phi-3 fuses q/k/v and gate/up, and registers o_proj before qkv_proj.
constexpr Part kPhi3Layer[] = {
    Linear("self_attn.o_proj", W::kQ, W::kHidden).As(R::kAttentionOut),
    Linear("self_attn.qkv_proj", W::kHidden, W::kQkv).As(R::kAttentionQkv),
    Linear("mlp.gate_up_proj", W::kHidden, W::kFfn2).As(R::kMlpGateUp),
    Linear("mlp.down_proj", W::kFfn, W::kHidden).As(R::kMlpDown),
    Include(kLlamaNorms),
};

// --- deepseek_v2, deepseek_v3 ---

// Multi-head latent attention's ranks and head widths: the same fields and defaults in V2 and V3.
constexpr DimField kMlaDims[] = {
    Optional(Dim::kQLoraRank, "q_lora_rank", 1536),
    Default(Dim::kKvLoraRank, "kv_lora_rank", 512),
    Default(Dim::kQkNopeHeadDim, "qk_nope_head_dim", 128),
    Default(Dim::kQkRopeHeadDim, "qk_rope_head_dim", 64),
    Default(Dim::kVHeadDim, "v_head_dim", 128),
    SameAs(Dim::kHeadDim, "", Dim::kQkRopeHeadDim),
};
constexpr DimField kDeepseekV2Dims[] = {
    Default(Dim::kPositions, "max_position_embeddings", 2048),
    {Dim::kExperts, "n_routed_experts", DimField::kDefault, 64, Dim::kHidden, Dim::kHeads,
     "num_experts"},
    // DeepseekV2Config's default is None, which only a config without MoE layers survives.
    Default(Dim::kTopK, "num_experts_per_tok", 0),
    Default(Dim::kMoeIntermediate, "moe_intermediate_size", 1407),
    Default(Dim::kSharedExperts, "n_shared_experts", 2),
    Optional(Dim::kFirstDense, "first_k_dense_replace", 0),  // 0: every layer is MoE
};
constexpr DimField kDeepseekV3Dims[] = {
    Default(Dim::kPositions, "max_position_embeddings", 4096),
    {Dim::kExperts, "n_routed_experts", DimField::kDefault, 256, Dim::kHidden, Dim::kHeads,
     "num_local_experts"},
    Default(Dim::kTopK, "num_experts_per_tok", 8),
    Default(Dim::kMoeIntermediate, "moe_intermediate_size", 2048),
    Default(Dim::kSharedExperts, "n_shared_experts", 1),
    Optional(Dim::kFirstDense, "first_k_dense_replace", 3),
    {Dim::kMtpLayers, "num_nextn_predict_layers", DimField::kDefault, 1, Dim::kHidden, Dim::kHeads,
     "num_mtp_layers", true},
};
constexpr FlagField kDeepseekV2Flags[] = {
    {Flag::kTie, "tie_word_embeddings", false},
    {Flag::kQkvBias, "attention_bias", false},
    {Flag::kMlpBias, "mlp_bias", false},
};
constexpr FlagField kDeepseekV3Flags[] = {
    {Flag::kTie, "tie_word_embeddings", false},
    {Flag::kQkvBias, "attention_bias", false},
};
// Multi-head latent attention: the query through a q_lora_rank bottleneck (or a full q_proj),
// keys and values from one compressed latent plus a shared rotary key. attention_bias covers the
// down-projections and o_proj.
constexpr Part kMlaAttention[] = {
    Linear("self_attn.q_proj", W::kHidden, W::kQHeads, kNo, IfNot(Flag::kQLora)).As(R::kAttentionQ),
    Linear("self_attn.q_a_proj", W::kHidden, W::kQRank, If(Flag::kQkvBias), If(Flag::kQLora))
        .As(R::kAttentionQDown),
    Norm("self_attn.q_a_layernorm", W::kQRank, kNo, If(Flag::kQLora)),
    Linear("self_attn.q_b_proj", W::kQRank, W::kQHeads, kNo, If(Flag::kQLora)).As(R::kAttentionQ),
    Linear("self_attn.kv_a_proj_with_mqa", W::kHidden, W::kKvA, If(Flag::kQkvBias))
        .As(R::kAttentionKvDown),
    Norm("self_attn.kv_a_layernorm", W::kKvRank),
    Linear("self_attn.kv_b_proj", W::kKvRank, W::kKvB).As(R::kAttentionKvUp),
    Linear("self_attn.o_proj", W::kVOut, W::kHidden, If(Flag::kQkvBias)).As(R::kAttentionOut),
};
// Routed experts, the router, then the shared experts (one MLP n_shared_experts wide). V3's
// router keeps its e_score_correction_bias as a buffer.
constexpr Part kDeepseekMoe[] = {
    Include(kRoutedExperts),
    Include(kRouter),
    Buffer("mlp.gate.e_score_correction_bias", W::kExperts, W::kNone, If(Flag::kRouterBiasBuffer)),
    Linear("mlp.shared_experts.gate_proj", W::kHidden, W::kSharedFfn, If(Flag::kMlpBias))
        .As(R::kMlpGate),
    Linear("mlp.shared_experts.up_proj", W::kHidden, W::kSharedFfn, If(Flag::kMlpBias))
        .As(R::kMlpUp),
    Linear("mlp.shared_experts.down_proj", W::kSharedFfn, W::kHidden, If(Flag::kMlpBias))
        .As(R::kMlpDown),
};
constexpr Part kDeepseekLayer[] = {
    Include(kMlaAttention),
    Include(kGatedMlp, If(Flag::kDenseLayer)),
    Include(kDeepseekMoe, If(Flag::kMoeLayer)),
    Include(kLlamaNorms),
};
constexpr Part kDeepseekBefore[] = {Embedding("embed_tokens", W::kVocab, W::kHidden)};

// --- glm4_moe (GLM-4.5, GLM-4.6) ---

constexpr DimField kGlm4MoeDims[] = {
    Quotient(Dim::kHeadDim, "head_dim", Dim::kHidden, Dim::kHeads),
    Default(Dim::kPositions, "max_position_embeddings", 131072),
    {Dim::kExperts, "n_routed_experts", DimField::kDefault, 128, Dim::kHidden, Dim::kHeads,
     "num_local_experts"},
    Default(Dim::kTopK, "num_experts_per_tok", 8),
    Default(Dim::kMoeIntermediate, "moe_intermediate_size", 1408),
    Default(Dim::kSharedExperts, "n_shared_experts", 1),
    Optional(Dim::kFirstDense, "first_k_dense_replace", 1),
    {Dim::kMtpLayers, "num_nextn_predict_layers", DimField::kDefault, 1, Dim::kHidden, Dim::kHeads,
     "num_mtp_layers", true},
};
// attention_bias covers q, k and v (o_proj has none); use_qk_norm adds per-head q and k norms.
constexpr FlagField kGlm4MoeFlags[] = {
    {Flag::kTie, "tie_word_embeddings", false},
    {Flag::kQkvBias, "attention_bias", false},
    {Flag::kHeadQkNorm, "use_qk_norm", false},
};
// Glm4MoeDecoderLayer: Llama's attention, a dense MLP for the first first_k_dense_replace layers
// and DeepSeek-V3's experts, router (with its e_score_correction_bias buffer) and shared
// experts after.
constexpr Part kGlm4MoeLayer[] = {
    Include(kLlamaAttentionNoSinks),
    Include(kGatedMlp, If(Flag::kDenseLayer)),
    Include(kDeepseekMoe, If(Flag::kMoeLayer)),
    Include(kLlamaNorms),
};

// --- gpt_oss ---

constexpr DimField kGptOssDims[] = {
    Quotient(Dim::kHeadDim, "head_dim", Dim::kHidden, Dim::kHeads),
    Default(Dim::kPositions, "max_position_embeddings", 131072),
    Optional(Dim::kSlidingWindow, "sliding_window", 128),
    {Dim::kExperts, "num_local_experts", DimField::kDefault, 128, Dim::kHidden, Dim::kHeads,
     "num_experts"},
    Default(Dim::kTopK, "num_experts_per_tok", 4),
};
constexpr FlagField kGptOssFlags[] = {
    {Flag::kTie, "tie_word_embeddings", false},
    {Flag::kQkvBias, "attention_bias", true},
    {Flag::kOBias, "attention_bias", true},
};
// A biased router, and experts stored [E, in, out] with biases: published this way.
constexpr Part kGptOssMoe[] = {
    Param("mlp.router.weight", W::kExperts, W::kHidden).As(R::kRouter),
    BiasParam("mlp.router.bias", W::kExperts).As(R::kRouter),
    Param("mlp.experts.gate_up_proj", W::kExperts, W::kHidden, W::kFfn2).As(R::kExpertGateUp),
    BiasParam("mlp.experts.gate_up_proj_bias", W::kExperts, W::kFfn2).As(R::kExpertGateUp),
    Param("mlp.experts.down_proj", W::kExperts, W::kFfn, W::kHidden).As(R::kExpertDown),
    BiasParam("mlp.experts.down_proj_bias", W::kExperts, W::kHidden).As(R::kExpertDown),
};
constexpr Part kGptOssLayer[] = {
    Include(kLlamaAttention),
    Include(kGptOssMoe),
    Include(kLlamaNorms),
};

// --- falcon ---

constexpr DimField kFalconDims[] = {
    {Dim::kHidden, "hidden_size", DimField::kRequired, 0, Dim::kHidden, Dim::kHeads, "n_embed"},
    Required(Dim::kLayers, "num_hidden_layers"),
    Required(Dim::kHeads, "num_attention_heads"),
    SameAs(Dim::kKvHeads, "num_kv_heads", Dim::kHeads),
    Quotient(Dim::kHeadDim, "", Dim::kHidden, Dim::kHeads),
    Multiple(Dim::kIntermediate, "ffn_hidden_size", 4, Dim::kHidden),
    Required(Dim::kVocab, "vocab_size"),
    Default(Dim::kPositions, "max_position_embeddings", 2048),
};
constexpr FlagField kFalconFlags[] = {
    {Flag::kTie, "tie_word_embeddings", true},
    {Flag::kQkvBias, "bias", false},
    {Flag::kNewDecoderArch, "new_decoder_architecture", false},
    {Flag::kMultiQuery, "multi_query", true},
    {Flag::kParallelAttn, "parallel_attn", true},
    {Flag::kAlibi, "alibi", false},
};

// FalconAttention: the fused projection holds heads + 2 x kv_heads heads, where kv_heads is
// num_kv_heads with the new decoder architecture, else 1 (multi-query) or all heads; the norms
// are post_attention + input (sequential), ln_attn + ln_mlp (num_ln_in_parallel_attn 2, the
// default of the new architecture) or one input_layernorm.
Status AdjustFalcon(const ConfigReader& config, Values* v) {
  if (v->Get(Dim::kHidden) % v->Get(Dim::kHeads) != 0) {
    return config.FieldError("num_attention_heads", std::to_string(v->Get(Dim::kHeads)) +
                                                        " does not divide hidden_size " +
                                                        std::to_string(v->Get(Dim::kHidden)));
  }
  if (!v->Is(Flag::kNewDecoderArch)) {
    v->Set(Dim::kKvHeads, v->Is(Flag::kMultiQuery) ? 1 : v->Get(Dim::kHeads));
  }
  int64_t parallel_norms = v->Is(Flag::kNewDecoderArch) ? 2 : 1;
  MEMPLAN_ASSIGN_OR_RETURN(parallel_norms, config.DimOr("num_ln_in_parallel_attn", parallel_norms));
  v->Set(Flag::kTwoNorms, parallel_norms == 2);
  return Status::Ok();
}

constexpr Part kFalconLayer[] = {
    Linear("self_attention.query_key_value", W::kHidden, W::kQkv, If(Flag::kQkvBias))
        .As(R::kAttentionQkv),
    Linear("self_attention.dense", W::kHidden, W::kHidden, If(Flag::kQkvBias)).As(R::kAttentionOut),
    Linear("mlp.dense_h_to_4h", W::kHidden, W::kFfn, If(Flag::kQkvBias)).As(R::kMlpUp),
    Linear("mlp.dense_4h_to_h", W::kFfn, W::kHidden, If(Flag::kQkvBias)).As(R::kMlpDown),
    Norm("post_attention_layernorm", W::kHidden, kYes, IfNot(Flag::kParallelAttn)),
    Norm("input_layernorm", W::kHidden, kYes, IfNot(Flag::kParallelAttn)),
    Norm("ln_attn", W::kHidden, kYes, Both(Flag::kParallelAttn, Flag::kTwoNorms)),
    Norm("ln_mlp", W::kHidden, kYes, Both(Flag::kParallelAttn, Flag::kTwoNorms)),
    Norm("input_layernorm", W::kHidden, kYes, {Flag::kParallelAttn, false, Flag::kTwoNorms, true}),
};
constexpr Part kWordEmbeddings[] = {Embedding("word_embeddings", W::kVocab, W::kHidden)};
constexpr Part kLnF[] = {Norm("ln_f", W::kHidden, kYes)};
constexpr Part kFalconAfter[] = {Norm("ln_f", W::kHidden, kYes), Include(kRotary)};
// GPT-2, Falcon, Bloom: score, classifier and qa_outputs around `transformer`.
constexpr HeadSpec kTransformerHeads[] = {
    {HeadKind::kSequence, "ForSequenceClassification", "transformer", kScore},
    {HeadKind::kToken, "ForTokenClassification", "transformer", kClassifierHead},
    Qa("transformer"),
};

// --- bloom ---

constexpr DimField kBloomDims[] = {
    {Dim::kHidden, "hidden_size", DimField::kRequired, 0, Dim::kHidden, Dim::kHeads, "n_embed"},
    {Dim::kLayers, "n_layer", DimField::kRequired, 0, Dim::kHidden, Dim::kHeads,
     "num_hidden_layers"},
    {Dim::kHeads, "n_head", DimField::kRequired, 0, Dim::kHidden, Dim::kHeads,
     "num_attention_heads"},
    SameAs(Dim::kKvHeads, "", Dim::kHeads),
    Quotient(Dim::kHeadDim, "", Dim::kHidden, Dim::kHeads),
    Multiple(Dim::kIntermediate, "", 4, Dim::kHidden),
    Required(Dim::kVocab, "vocab_size"),
};
constexpr FlagField kBloomFlags[] = {{Flag::kTie, "tie_word_embeddings", true}};
constexpr Part kBloomBefore[] = {
    Embedding("word_embeddings", W::kVocab, W::kHidden),
    Norm("word_embeddings_layernorm", W::kHidden, kYes),
};
constexpr Part kBloomLayer[] = {
    Norm("input_layernorm", W::kHidden, kYes),
    Linear("self_attention.query_key_value", W::kHidden, W::kQkv, kYes).As(R::kAttentionQkv),
    Linear("self_attention.dense", W::kHidden, W::kHidden, kYes).As(R::kAttentionOut),
    Norm("post_attention_layernorm", W::kHidden, kYes),
    Linear("mlp.dense_h_to_4h", W::kHidden, W::kFfn, kYes).As(R::kMlpUp),
    Linear("mlp.dense_4h_to_h", W::kFfn, W::kHidden, kYes).As(R::kMlpDown),
};

// --- gptj ---

constexpr DimField kGptjDims[] = {
    {Dim::kHidden, "n_embd", DimField::kRequired, 0, Dim::kHidden, Dim::kHeads, "hidden_size"},
    {Dim::kLayers, "n_layer", DimField::kRequired, 0, Dim::kHidden, Dim::kHeads,
     "num_hidden_layers"},
    {Dim::kHeads, "n_head", DimField::kRequired, 0, Dim::kHidden, Dim::kHeads,
     "num_attention_heads"},
    SameAs(Dim::kKvHeads, "", Dim::kHeads),
    Quotient(Dim::kHeadDim, "", Dim::kHidden, Dim::kHeads),
    Multiple(Dim::kIntermediate, "n_inner", 4, Dim::kHidden),
    Required(Dim::kVocab, "vocab_size"),
    {Dim::kPositions, "n_positions", DimField::kDefault, 2048, Dim::kHidden, Dim::kHeads,
     "max_position_embeddings"},
    Optional(Dim::kRotaryDim, "rotary_dim", 64),
};
constexpr FlagField kGptjFlags[] = {{Flag::kTie, "tie_word_embeddings", false}};
// GPT-J's sinusoid table is a buffer of every attention layer.
constexpr Part kGptjLayer[] = {
    Norm("ln_1", W::kHidden, kYes),
    Buffer("attn.embed_positions", W::kPositions, W::kRotaryDim),
    Linear("attn.k_proj", W::kHidden, W::kHidden).As(R::kAttentionK),
    Linear("attn.v_proj", W::kHidden, W::kHidden).As(R::kAttentionV),
    Linear("attn.q_proj", W::kHidden, W::kHidden).As(R::kAttentionQ),
    Linear("attn.out_proj", W::kHidden, W::kHidden).As(R::kAttentionOut),
    Linear("mlp.fc_in", W::kHidden, W::kFfn, kYes).As(R::kMlpUp),
    Linear("mlp.fc_out", W::kFfn, W::kHidden, kYes).As(R::kMlpDown),
};
constexpr Part kWte[] = {Embedding("wte", W::kVocab, W::kHidden)};
// GPTJForQuestionAnswering sizes its output by num_labels, not 2.
constexpr Part kGptjQa[] = {Linear("qa_outputs", W::kHidden, W::kLabels, kYes).As(R::kClassifier)};
constexpr HeadSpec kGptjHeads[] = {
    {HeadKind::kSequence, "ForSequenceClassification", "transformer", kScore},
    {HeadKind::kQuestionAnswering, "ForQuestionAnswering", "transformer", kGptjQa},
};

// --- gpt_neo ---

constexpr DimField kGptNeoDims[] = {
    Required(Dim::kHidden, "hidden_size"),
    Required(Dim::kLayers, "num_layers", "num_hidden_layers"),
    Required(Dim::kHeads, "num_heads", "num_attention_heads"),
    SameAs(Dim::kKvHeads, "", Dim::kHeads),
    Quotient(Dim::kHeadDim, "", Dim::kHidden, Dim::kHeads),
    Multiple(Dim::kIntermediate, "intermediate_size", 4, Dim::kHidden),
    Required(Dim::kVocab, "vocab_size"),
    Default(Dim::kPositions, "max_position_embeddings", 2048),
};
constexpr FlagField kGptNeoFlags[] = {{Flag::kTie, "tie_word_embeddings", true}};
// GPTNeoConfig: attention_types ([[["global", "local"], 12]]) must expand to one type per
// layer, or the class refuses the config.
Status AdjustGptNeo(const ConfigReader& config, Values* v) {
  if (v->Get(Dim::kHidden) % v->Get(Dim::kHeads) != 0) {
    return config.FieldError("num_heads", std::to_string(v->Get(Dim::kHeads)) +
                                              " does not divide hidden_size " +
                                              std::to_string(v->Get(Dim::kHidden)));
  }
  if (!config.Has("attention_types") || config.json()["attention_types"].is_null()) {
    return Status::Ok();
  }
  const nlohmann::json& types = config.json()["attention_types"];
  int64_t layers = 0;
  bool ok = types.is_array();
  for (const nlohmann::json& item : ok ? types : nlohmann::json::array()) {
    if (!item.is_array() || item.size() != 2 || !item[0].is_array() ||
        !item[1].is_number_integer() || item[1].get<int64_t>() < 0) {
      ok = false;
      break;
    }
    for (const nlohmann::json& t : item[0]) {
      if (t != "global" && t != "local") ok = false;
    }
    layers += static_cast<int64_t>(item[0].size()) * item[1].get<int64_t>();
  }
  if (!ok) {
    return config.FieldError("attention_types",
                             "must list [[\"global\" or \"local\", ...], repeats] pairs");
  }
  if (layers != v->Get(Dim::kLayers)) {
    return config.FieldError("attention_types", "expands to " + std::to_string(layers) +
                                                    " layers, not num_layers " +
                                                    std::to_string(v->Get(Dim::kLayers)));
  }
  return Status::Ok();
}
// GPTNeoBlock: ln_1, the attention (k, v, q without biases, out_proj with one; a bool
// max_positions^2 causal table per layer, banded on the local layers), ln_2, the MLP.
constexpr Part kGptNeoLayer[] = {
    Norm("ln_1", W::kHidden, kYes),
    MaskBuffer("attn.attention.bias", W::kOne, W::kOne, W::kPositions, W::kPositions),
    Linear("attn.attention.k_proj", W::kHidden, W::kHidden).As(R::kAttentionK),
    Linear("attn.attention.v_proj", W::kHidden, W::kHidden).As(R::kAttentionV),
    Linear("attn.attention.q_proj", W::kHidden, W::kHidden).As(R::kAttentionQ),
    Linear("attn.attention.out_proj", W::kHidden, W::kHidden, kYes).As(R::kAttentionOut),
    Norm("ln_2", W::kHidden, kYes),
    Linear("mlp.c_fc", W::kHidden, W::kFfn, kYes).As(R::kMlpUp),
    Linear("mlp.c_proj", W::kFfn, W::kHidden, kYes).As(R::kMlpDown),
};

// --- opt ---

constexpr DimField kOptDims[] = {
    Required(Dim::kHidden, "hidden_size"),
    Required(Dim::kLayers, "num_hidden_layers"),
    Required(Dim::kHeads, "num_attention_heads"),
    SameAs(Dim::kKvHeads, "", Dim::kHeads),
    Quotient(Dim::kHeadDim, "", Dim::kHidden, Dim::kHeads),
    Required(Dim::kIntermediate, "ffn_dim"),
    Required(Dim::kVocab, "vocab_size"),
    Default(Dim::kPositions, "max_position_embeddings", 2048),
    SameAs(Dim::kEmbedProj, "word_embed_proj_dim", Dim::kHidden),
};
constexpr FlagField kOptFlags[] = {
    {Flag::kTie, "tie_word_embeddings", true},
    {Flag::kQkvBias, "enable_bias", true},
    {Flag::kNormAffine, "layer_norm_elementwise_affine", true},
    {Flag::kFinalNorm, "do_layer_norm_before", true},
    {Flag::kRemoveFinalNorm, "_remove_final_layer_norm", false},
};
Status AdjustOpt(const ConfigReader&, Values* v) {
  v->Set(Flag::kFinalNorm, v->Is(Flag::kFinalNorm) && !v->Is(Flag::kRemoveFinalNorm));
  return Status::Ok();
}
constexpr Part kOptBefore[] = {
    Embedding("decoder.embed_tokens", W::kVocab, W::kEmbedProj),
    Embedding("decoder.embed_positions", W::kPositionsOpt, W::kHidden),
    Linear("decoder.project_out", W::kHidden, W::kEmbedProj, kNo, If(Flag::kProjectInOut))
        .As(R::kProjector),
    Linear("decoder.project_in", W::kEmbedProj, W::kHidden, kNo, If(Flag::kProjectInOut))
        .As(R::kProjector),
    Norm("decoder.final_layer_norm", W::kHidden, kYes, Both(Flag::kFinalNorm, Flag::kNormAffine)),
};
constexpr Part kOptLayer[] = {
    Linear("self_attn.k_proj", W::kHidden, W::kHidden, If(Flag::kQkvBias)).As(R::kAttentionK),
    Linear("self_attn.v_proj", W::kHidden, W::kHidden, If(Flag::kQkvBias)).As(R::kAttentionV),
    Linear("self_attn.q_proj", W::kHidden, W::kHidden, If(Flag::kQkvBias)).As(R::kAttentionQ),
    Linear("self_attn.out_proj", W::kHidden, W::kHidden, If(Flag::kQkvBias)).As(R::kAttentionOut),
    Norm("self_attn_layer_norm", W::kHidden, kYes, If(Flag::kNormAffine)),
    Linear("fc1", W::kHidden, W::kFfn, If(Flag::kQkvBias)).As(R::kMlpUp),
    Linear("fc2", W::kFfn, W::kHidden, If(Flag::kQkvBias)).As(R::kMlpDown),
    Norm("final_layer_norm", W::kHidden, kYes, If(Flag::kNormAffine)),
};
// OPT's heads read the projected width.
constexpr Part kOptScore[] = {Linear("score", W::kEmbedProj, W::kLabels).As(R::kClassifier)};
constexpr Part kOptQa[] = {Linear("qa_outputs", W::kEmbedProj, W::kTwo, kYes).As(R::kClassifier)};
constexpr HeadSpec kOptHeads[] = {
    {HeadKind::kSequence, "ForSequenceClassification", "model", kOptScore},
    {HeadKind::kQuestionAnswering, "ForQuestionAnswering", "model", kOptQa},
};

// --- gpt2 ---

// GPT2Config's defaults are the published gpt2 (Note [Required size fields]); its attribute_map
// lets hidden_size etc. stand for n_embd etc., and then wins.
constexpr DimField kGpt2Dims[] = {
    Default(Dim::kHidden, "n_embd", 768, "hidden_size"),
    Default(Dim::kLayers, "n_layer", 12, "num_hidden_layers"),
    Default(Dim::kHeads, "n_head", 12, "num_attention_heads"),
    SameAs(Dim::kKvHeads, "", Dim::kHeads),
    Quotient(Dim::kHeadDim, "", Dim::kHidden, Dim::kHeads),
    Multiple(Dim::kIntermediate, "n_inner", 4, Dim::kHidden),
    Default(Dim::kVocab, "vocab_size", 50257),
    Default(Dim::kPositions, "n_positions", 1024, "max_position_embeddings"),
};
constexpr FlagField kGpt2Flags[] = {
    {Flag::kTie, "tie_word_embeddings", true},
    {Flag::kCrossAttention, "add_cross_attention", false},
};
constexpr Part kGpt2Before[] = {
    Embedding("wte", W::kVocab, W::kHidden),
    Embedding("wpe", W::kPositions, W::kHidden),
};
// Cross-attention projects keys and values from the encoder (c_attn) and queries from the decoder
// (q_attn) separately.
constexpr Part kGpt2Layer[] = {
    Norm("ln_1", W::kHidden, kYes),
    Conv1D("attn.c_attn", W::kHidden, W::kQkv).As(R::kAttentionQkv),
    Conv1D("attn.c_proj", W::kHidden, W::kHidden).As(R::kAttentionOut),
    Norm("ln_2", W::kHidden, kYes),
    Conv1D("crossattention.c_attn", W::kHidden, W::kKvPair, If(Flag::kCrossAttention))
        .As(R::kAttentionKv),
    Conv1D("crossattention.q_attn", W::kHidden, W::kHidden, If(Flag::kCrossAttention))
        .As(R::kAttentionQ),
    Conv1D("crossattention.c_proj", W::kHidden, W::kHidden, If(Flag::kCrossAttention))
        .As(R::kAttentionOut),
    Norm("ln_cross_attn", W::kHidden, kYes, If(Flag::kCrossAttention)),
    Conv1D("mlp.c_fc", W::kHidden, W::kFfn).As(R::kMlpUp),
    Conv1D("mlp.c_proj", W::kFfn, W::kHidden).As(R::kMlpDown),
};
// --- cohere (Command R, Aya) ---

constexpr DimField kCohereDims[] = {
    Quotient(Dim::kHeadDim, "head_dim", Dim::kHidden, Dim::kHeads),
    Default(Dim::kPositions, "max_position_embeddings", 8192),
};
constexpr FlagField kCohereFlags[] = {
    {Flag::kTie, "tie_word_embeddings", true},
    {Flag::kQkvBias, "attention_bias", false},
    {Flag::kOBias, "attention_bias", false},
    {Flag::kHeadQkNorm, "use_qk_norm", false},
};
// CohereDecoderLayer: the attention (with use_qk_norm a CohereLayerNorm over [heads, head_dim]
// for the queries and over [kv_heads, head_dim] for the keys), the MLP, and one
// input_layernorm that both branches read (the residual is parallel).
constexpr Part kCohereLayer[] = {
    Include(kLlamaAttentionNoSinks.first(4)),
    {Kind::kNorm, "self_attn.q_norm", W::kHeads, W::kHeadDim, W::kNone, kNo, If(Flag::kHeadQkNorm)},
    {Kind::kNorm, "self_attn.k_norm", W::kKvHeads, W::kHeadDim, W::kNone, kNo,
     If(Flag::kHeadQkNorm)},
    Include(kGatedMlp),
    Norm("input_layernorm", W::kHidden),
};

// Cohere2 (Command R7B, Command A): Cohere's block without q/k norms; three sliding-window layers
// with rotary embeddings, then one full-attention layer without (sliding_window_pattern 4).
constexpr DimField kCohere2Dims[] = {
    Quotient(Dim::kHeadDim, "head_dim", Dim::kHidden, Dim::kHeads),
    Default(Dim::kPositions, "max_position_embeddings", 8192),
    Optional(Dim::kSlidingWindow, "sliding_window", 4096),
    Default(Dim::kSlidingPattern, "sliding_window_pattern", 4),
};
constexpr FlagField kCohere2Flags[] = {
    {Flag::kTie, "tie_word_embeddings", true},
    {Flag::kQkvBias, "attention_bias", false},
    {Flag::kOBias, "attention_bias", false},
};

// --- nemotron (Nemotron-4, Minitron) ---

constexpr DimField kNemotronDims[] = {
    Quotient(Dim::kHeadDim, "head_dim", Dim::kHidden, Dim::kHeads),
    Default(Dim::kPositions, "max_position_embeddings", 4096),
};
// NemotronDecoderLayer: Llama's attention (a partial rotation, half of each head by default), an
// ungated MLP (up, relu2, down) and LayerNorm1P norms with biases. ArceeDecoderLayer is the same
// with RMSNorms and the whole head rotated.
constexpr Part kUngatedLlamaLayer[] = {
    Include(kLlamaAttentionNoSinks.first(4)),
    Linear("mlp.up_proj", W::kHidden, W::kFfn, If(Flag::kMlpBias)).As(R::kMlpUp),
    Linear("mlp.down_proj", W::kFfn, W::kHidden, If(Flag::kMlpBias)).As(R::kMlpDown),
    Include(kLlamaNorms),
};

// --- exaone4 (EXAONE 4.0) ---

constexpr DimField kExaone4Dims[] = {
    Quotient(Dim::kHeadDim, "head_dim", Dim::kHidden, Dim::kHeads),
    Default(Dim::kPositions, "max_position_embeddings", 2048),
    Optional(Dim::kSlidingWindow, "sliding_window", 4096),
};
// Exaone4Config: sliding_window_pattern is a number (every n-th layer global) or, in published
// configs, a string such as "LLLG" beside an explicit layer_types; null without a window.
Status AdjustExaone4(const ConfigReader& config, Values* v) {
  int64_t pattern = v->Get(Dim::kSlidingWindow) > 0 ? 4 : 0;
  if (config.Has("sliding_window_pattern")) {
    const nlohmann::json& p = config.json()["sliding_window_pattern"];
    if (p.is_string()) {
      const std::string text = p.get<std::string>();
      if (text.empty() || text.find_first_not_of("LG") != std::string::npos ||
          text.find('G') != text.size() - 1 || text.back() != 'G') {
        return config.FieldError("sliding_window_pattern",
                                 "'" + text + "' is not local layers then one global ('LLLG')");
      }
      pattern = static_cast<int64_t>(text.size());
    } else if (!p.is_null()) {
      MEMPLAN_ASSIGN_OR_RETURN(pattern, config.DimOr("sliding_window_pattern", pattern));
    }
  }
  if (v->Get(Dim::kSlidingWindow) <= 0) pattern = 0;
  v->Set(Dim::kSlidingPattern, pattern);
  return Status::Ok();
}
// Exaone4DecoderLayer: the attention with per-head q_norm and k_norm, the MLP, then the norms
// after each branch (post_attention_layernorm, post_feedforward_layernorm), none before.
constexpr FlagField kExaone4Flags[] = {{Flag::kTie, "tie_word_embeddings", false}};

// --- granitemoe (Granite 3.0/3.1 MoE) ---

constexpr DimField kGraniteMoeDims[] = {
    Quotient(Dim::kHeadDim, "", Dim::kHidden, Dim::kHeads),
    Default(Dim::kPositions, "max_position_embeddings", 2048),
    Default(Dim::kExperts, "num_local_experts", 8),
    Default(Dim::kTopK, "num_experts_per_tok", 2),
};
// GraniteMoeDecoderLayer: the attention, both norms, then block_sparse_moe: its router's weight
// and the experts fused, gate and up together (Transformers 5); the checkpoints' (and
// Transformers 4's) router.layer, input_linear and output_linear are the same tensors.
constexpr Part kGraniteMoeLayer[] = {
    Include(kLlamaAttentionNoSinks.first(4)),
    Norm("input_layernorm", W::kHidden),
    Norm("post_attention_layernorm", W::kHidden),
    Param("block_sparse_moe.router.weight", W::kExperts, W::kHidden, W::kNone, If(Flag::kFused))
        .As(R::kRouter),
    Param("block_sparse_moe.experts.gate_up_proj", W::kExperts, W::kFfn2, W::kHidden,
          If(Flag::kFused))
        .As(R::kExpertGateUp),
    Param("block_sparse_moe.experts.down_proj", W::kExperts, W::kHidden, W::kFfn, If(Flag::kFused))
        .As(R::kExpertDown),
    Param("block_sparse_moe.input_linear.weight", W::kExperts, W::kFfn2, W::kHidden,
          If(Flag::kPerExpert))
        .As(R::kExpertGateUp),
    Param("block_sparse_moe.output_linear.weight", W::kExperts, W::kHidden, W::kFfn,
          If(Flag::kPerExpert))
        .As(R::kExpertDown),
    Linear("block_sparse_moe.router.layer", W::kHidden, W::kExperts, kNo, If(Flag::kPerExpert))
        .As(R::kRouter),
};

// --- arcee (AFM) ---

constexpr DimField kArceeDims[] = {
    Quotient(Dim::kHeadDim, "head_dim", Dim::kHidden, Dim::kHeads),
    Default(Dim::kPositions, "max_position_embeddings", 4096),
};

// --- ernie4_5 (ERNIE 4.5 dense) ---

constexpr DimField kErnieDims[] = {
    Default(Dim::kHeadDim, "head_dim", 128),
    Default(Dim::kPositions, "max_position_embeddings", 131072),
};
// use_bias: every Linear of the block has a bias (the attention's four and the MLP's three).
constexpr FlagField kErnieFlags[] = {
    {Flag::kTie, "tie_word_embeddings", true},
    {Flag::kQkvBias, "use_bias", false},
    {Flag::kOBias, "use_bias", false},
    {Flag::kMlpBias, "use_bias", false},
};

// --- helium (Kyutai) ---

constexpr DimField kHeliumDims[] = {
    Default(Dim::kHeadDim, "head_dim", 128),
    Default(Dim::kPositions, "max_position_embeddings", 4096),
};
// attention_bias covers q, k and v; o_proj has none.
constexpr FlagField kHeliumFlags[] = {
    {Flag::kTie, "tie_word_embeddings", false},
    {Flag::kQkvBias, "attention_bias", false},
    {Flag::kMlpBias, "mlp_bias", false},
};

// --- stablelm ---

// StableLmConfig: num_key_value_heads defaults to 32 whatever the heads (the class's default).
constexpr DimField kStableLmCore[] = {
    Required(Dim::kHidden, "hidden_size"),
    Required(Dim::kLayers, "num_hidden_layers"),
    Required(Dim::kHeads, "num_attention_heads"),
    Default(Dim::kKvHeads, "num_key_value_heads", 32),
    Required(Dim::kIntermediate, "intermediate_size"),
    Required(Dim::kVocab, "vocab_size"),
};
constexpr DimField kStableLmDims[] = {
    Quotient(Dim::kHeadDim, "", Dim::kHidden, Dim::kHeads),
    Default(Dim::kPositions, "max_position_embeddings", 4096),
};
constexpr FlagField kStableLmFlags[] = {
    {Flag::kTie, "tie_word_embeddings", false},
    {Flag::kQkvBias, "use_qkv_bias", false},
    {Flag::kPerHeadQkNorm, "qk_layernorm", false},
    {Flag::kParallelAttn, "use_parallel_residual", false},
};
// StableLmDecoderLayer: the attention (q/k/v with use_qkv_bias, o without; with qk_layernorm
// a StableLmLayerNormPerHead of one bias-free LayerNorm per query head, then per key/value
// head), the MLP, input_layernorm, and post_attention_layernorm unless the residual is parallel.
constexpr Part kStableLmLayer[] = {
    Linear("self_attn.q_proj", W::kHidden, W::kQ, If(Flag::kQkvBias)).As(R::kAttentionQ),
    Linear("self_attn.k_proj", W::kHidden, W::kKv, If(Flag::kQkvBias)).As(R::kAttentionK),
    Linear("self_attn.v_proj", W::kHidden, W::kKv, If(Flag::kQkvBias)).As(R::kAttentionV),
    Linear("self_attn.o_proj", W::kQ, W::kHidden).As(R::kAttentionOut),
    Repeat(1, W::kHeads, If(Flag::kPerHeadQkNorm)),
    Norm("self_attn.q_layernorm.norms.{e}", W::kHeadDim),
    Repeat(1, W::kKvHeads, If(Flag::kPerHeadQkNorm)),
    Norm("self_attn.k_layernorm.norms.{e}", W::kHeadDim),
    Include(kGatedMlp),
    Norm("input_layernorm", W::kHidden, kYes),
    Norm("post_attention_layernorm", W::kHidden, kYes, IfNot(Flag::kParallelAttn)),
};

// --- gpt_bigcode (StarCoder, SantaCoder) ---

// GPTBigCodeConfig's attribute_map spells the sizes as GPT-2 does; its defaults describe no
// published model, so the sizes are required (Note [Required size fields]).
constexpr DimField kGptBigcodeDims[] = {
    Required(Dim::kHidden, "n_embd", "hidden_size"),
    Required(Dim::kLayers, "n_layer", "num_hidden_layers"),
    Required(Dim::kHeads, "n_head", "num_attention_heads"),
    SameAs(Dim::kKvHeads, "", Dim::kHeads),
    Quotient(Dim::kHeadDim, "", Dim::kHidden, Dim::kHeads),
    Multiple(Dim::kIntermediate, "n_inner", 4, Dim::kHidden),
    Required(Dim::kVocab, "vocab_size"),
    Default(Dim::kPositions, "n_positions", 1024, "max_position_embeddings"),
};
constexpr FlagField kGptBigcodeFlags[] = {
    {Flag::kTie, "tie_word_embeddings", true},
    {Flag::kMultiQuery, "multi_query", true},
    {Flag::kCrossAttention, "add_cross_attention", false},
};
// GPTBigCodeAttention: one key/value head with multi_query (the default), else one per head;
// hidden_size must split into whole heads. Cross-attention (an encoder-decoder use) is refused.
Status AdjustGptBigcode(const ConfigReader& config, Values* v) {
  if (v->Get(Dim::kHidden) % v->Get(Dim::kHeads) != 0) {
    return config.FieldError("n_head", std::to_string(v->Get(Dim::kHeads)) +
                                           " does not divide n_embd " +
                                           std::to_string(v->Get(Dim::kHidden)));
  }
  if (v->Is(Flag::kCrossAttention)) {
    return config.FieldError("add_cross_attention",
                             "cross-attention layers are not supported for gpt_bigcode");
  }
  v->Set(Dim::kKvHeads, v->Is(Flag::kMultiQuery) ? 1 : v->Get(Dim::kHeads));
  return Status::Ok();
}
constexpr HeadSpec kGptBigcodeHeads[] = {
    {HeadKind::kSequence, "ForSequenceClassification", "transformer", kScore},
    {HeadKind::kToken, "ForTokenClassification", "transformer", kClassifierHead},
};
constexpr Part kGptBigcodeLayer[] = {
    Norm("ln_1", W::kHidden, kYes),
    Linear("attn.c_attn", W::kHidden, W::kQkv, kYes).As(R::kAttentionQkv),
    Linear("attn.c_proj", W::kHidden, W::kHidden, kYes).As(R::kAttentionOut),
    Norm("ln_2", W::kHidden, kYes),
    Linear("mlp.c_fc", W::kHidden, W::kFfn, kYes).As(R::kMlpUp),
    Linear("mlp.c_proj", W::kFfn, W::kHidden, kYes).As(R::kMlpDown),
};
// ln_f, then GPTBigCodeModel's non-persistent causal `bias`: a bool max_positions^2 table.
constexpr Part kGptBigcodeAfter[] = {
    Norm("ln_f", W::kHidden, kYes),
    MaskBuffer("bias", W::kPositions, W::kPositions),
};

// --- gpt_neox ---

constexpr DimField kGptNeoxDims[] = {
    Required(Dim::kHidden, "hidden_size"),
    Required(Dim::kLayers, "num_hidden_layers"),
    Required(Dim::kHeads, "num_attention_heads"),
    SameAs(Dim::kKvHeads, "", Dim::kHeads),
    Quotient(Dim::kHeadDim, "", Dim::kHidden, Dim::kHeads),
    Required(Dim::kIntermediate, "intermediate_size"),
    Required(Dim::kVocab, "vocab_size"),
    Default(Dim::kPositions, "max_position_embeddings", 2048),
};
constexpr FlagField kGptNeoxFlags[] = {
    {Flag::kTie, "tie_word_embeddings", false},
    {Flag::kQkvBias, "attention_bias", true},
};
// GPTNeoXLayer registers both norms before the attention and the MLP.
constexpr Part kGptNeoxLayer[] = {
    Norm("input_layernorm", W::kHidden, kYes),
    Norm("post_attention_layernorm", W::kHidden, kYes),
    Linear("attention.query_key_value", W::kHidden, W::kQkv, If(Flag::kQkvBias))
        .As(R::kAttentionQkv),
    Linear("attention.dense", W::kHidden, W::kHidden, If(Flag::kQkvBias)).As(R::kAttentionOut),
    Linear("mlp.dense_h_to_4h", W::kHidden, W::kFfn, kYes).As(R::kMlpUp),
    Linear("mlp.dense_4h_to_h", W::kFfn, W::kHidden, kYes).As(R::kMlpDown),
};
constexpr Part kGptNeoxBefore[] = {Embedding("embed_in", W::kVocab, W::kHidden)};
constexpr Part kGptNeoxAfter[] = {Norm("final_layer_norm", W::kHidden, kYes), Include(kRotary)};
constexpr HeadSpec kGptNeoxHeads[] = {
    {HeadKind::kSequence, "ForSequenceClassification", "gpt_neox", kScore},
    {HeadKind::kToken, "ForTokenClassification", "gpt_neox", kClassifierHead},
    Qa("gpt_neox"),
};

// --- mpt ---

// MosaicML's MPT as llm-foundry builds it (llmfoundry/models/mpt/modeling_mpt.py, layers/
// attention.py, ffn.py), which honours every field of the config. Transformers' MptForCausalLM
// (models/mpt/modeling_mpt.py) builds the same tensors for every published MPT (expansion_ratio 4,
// no_bias true, multi-head attention, ALiBi), but ignores those fields otherwise: its MLP is
// always 4 x d_model wide, it never has biases or a position table, and it reads attn_type only
// to validate it. memplan follows the fields, as llm-foundry does; the oracle checks the
// published configs against Transformers.
constexpr DimField kMptDims[] = {
    Required(Dim::kHidden, "d_model", "hidden_size"),
    Required(Dim::kLayers, "n_layers", "num_hidden_layers"),
    Required(Dim::kHeads, "n_heads", "num_attention_heads"),
    SameAs(Dim::kKvHeads, "", Dim::kHeads),
    Quotient(Dim::kHeadDim, "", Dim::kHidden, Dim::kHeads),
    Default(Dim::kIntermediate, "", 0),  // expansion_ratio x d_model, set by AdjustMpt
    Required(Dim::kVocab, "vocab_size"),
    Default(Dim::kPositions, "max_seq_len", 2048),
};
constexpr FlagField kMptFlags[] = {{Flag::kTie, "tie_word_embeddings", true}};

// expansion_ratio (an int or a float: llm-foundry's resolve_ffn_hidden_size takes
// int(d_model x expansion_ratio)), no_bias (true by default in Transformers' MptConfig; every
// published config says so), attn_config (attn_type, kv_n_heads, qk_ln, alibi, rope, attn_pdrop)
// and ffn_config.ffn_type.
Status AdjustMpt(const ConfigReader& config, Values* v) {
  MEMPLAN_ASSIGN_OR_RETURN(const double ratio, config.NumberOr("expansion_ratio", 4));
  const double width = ratio * static_cast<double>(v->Get(Dim::kHidden));
  if (!(ratio > 0) || width < 1 || width > static_cast<double>(ConfigReader::kMaxDim)) {
    return config.FieldError("expansion_ratio", "must make a positive MLP width below 2^31");
  }
  v->Set(Dim::kIntermediate, static_cast<int64_t>(width));
  MEMPLAN_ASSIGN_OR_RETURN(const bool no_bias, config.BoolOr("no_bias", true));
  for (Flag f : {Flag::kQkvBias, Flag::kOBias, Flag::kMlpBias, Flag::kNormBias}) {
    v->Set(f, !no_bias);
  }
  const nlohmann::json empty = nlohmann::json::object();
  if (config.Has("attn_config") && !config.json()["attn_config"].is_object()) {
    return config.FieldError("attn_config", "must be an object");
  }
  const nlohmann::json& attn_json =
      config.Has("attn_config") ? config.json()["attn_config"] : empty;
  ConfigReader attn(attn_json, config.source() + " (attn_config)");
  MEMPLAN_ASSIGN_OR_RETURN(const std::string type,
                           attn.StringOr("attn_type", "multihead_attention"));
  if (type == "multiquery_attention") {
    v->Set(Dim::kKvHeads, 1);
  } else if (type == "grouped_query_attention") {
    MEMPLAN_ASSIGN_OR_RETURN(const int64_t kv, attn.DimOr("kv_n_heads", 1));
    v->Set(Dim::kKvHeads, kv);
  } else if (type != "multihead_attention") {
    return attn.FieldError("attn_type",
                           "'" + type +
                               "' is not one of multihead_attention, multiquery_attention, "
                               "grouped_query_attention");
  }
  MEMPLAN_ASSIGN_OR_RETURN(v->attention_impl, attn.StringOr("attn_impl", ""));
  MEMPLAN_ASSIGN_OR_RETURN(v->norm_type, config.StringOr("norm_type", ""));
  MEMPLAN_ASSIGN_OR_RETURN(const bool qk_ln, attn.BoolOr("qk_ln", false));
  v->Set(Flag::kFullQkNorm, qk_ln);
  MEMPLAN_ASSIGN_OR_RETURN(const bool alibi, attn.BoolOr("alibi", true));
  MEMPLAN_ASSIGN_OR_RETURN(const bool rope, attn.BoolOr("rope", false));
  MEMPLAN_ASSIGN_OR_RETURN(const bool learned, config.BoolOr("learned_pos_emb", true));
  // MPTConfig.__init__: "alibi or rope is turned on, setting `learned_pos_emb` to `False`".
  v->Set(Flag::kLearnedPositions, learned && !alibi && !rope);
  v->Set(Flag::kAlibi, alibi);
  MEMPLAN_ASSIGN_OR_RETURN(v->attention_dropout, attn.ProbabilityOr("attn_pdrop", 0.0));
  // Options that add ops to MPT's block or loss without adding tensors (modeling_mpt.py,
  // attention.py, ffn.py), recorded so that what models the ops can tell them apart.
  auto set = [](const nlohmann::json& j, const char* field) {
    return j.contains(field) && !j[field].is_null() && j[field] != false;
  };
  for (const char* field : {"clip_qkv", "attn_logit_softcapping", "attn_uses_sequence_id", "qk_gn",
                            "attn_temperature_tuning"}) {
    if (set(attn_json, field)) v->block_options.emplace_back(field);
  }
  if (set(attn_json, "sliding_window_size") && attn_json["sliding_window_size"] != -1) {
    v->block_options.emplace_back("sliding_window_size");
  }
  if (set(config.json(), "final_logit_softcapping")) {
    v->block_options.emplace_back("final_logit_softcapping");
  }
  if (set(config.json(), "embedding_fraction") && config.json()["embedding_fraction"] != 1 &&
      config.json()["embedding_fraction"] != 1.0) {
    v->block_options.emplace_back("embedding_fraction");
  }
  if (config.Has("ffn_config")) {
    if (!config.json()["ffn_config"].is_object()) {
      return config.FieldError("ffn_config", "must be an object");
    }
    ConfigReader ffn(config.json()["ffn_config"], config.source() + " (ffn_config)");
    MEMPLAN_ASSIGN_OR_RETURN(const std::string ffn_type, ffn.StringOr("ffn_type", "mptmlp"));
    if (ffn_type != "mptmlp" && ffn_type != "mptglu") {
      return ffn.FieldError("ffn_type", "'" + ffn_type +
                                            "' is not one memplan builds (mptmlp, mptglu; "
                                            "te_ln_mlp and MoE FFNs are not supported)");
    }
    v->Set(Flag::kGatedMlp, ffn_type == "mptglu");
    // ffn_act_fn: GELU (approximate 'none') unless the config names another.
    const nlohmann::json& ffn_json = config.json()["ffn_config"];
    if (ffn_json.contains("ffn_act_fn") && !ffn_json["ffn_act_fn"].is_null() &&
        ffn_json["ffn_act_fn"] != nlohmann::json{{"name", "gelu"}, {"approximate", "none"}}) {
      v->block_options.emplace_back("ffn_act_fn");
    }
  }
  return Status::Ok();
}

constexpr Part kMptBefore[] = {
    Embedding("wte", W::kVocab, W::kHidden),
    Embedding("wpe", W::kPositions, W::kHidden, If(Flag::kLearnedPositions)),
};
// MPTBlock: norm_1, attn (Wqkv, the optional q/k LayerNorms, out_proj), norm_2, ffn (up, down,
// then MPTGLU's gate).
constexpr Part kMptLayer[] = {
    Norm("norm_1", W::kHidden, If(Flag::kNormBias)),
    Linear("attn.Wqkv", W::kHidden, W::kQkv, If(Flag::kQkvBias)).As(R::kAttentionQkv),
    Norm("attn.q_ln", W::kQ, If(Flag::kNormBias), If(Flag::kFullQkNorm)),
    Norm("attn.k_ln", W::kKv, If(Flag::kNormBias), If(Flag::kFullQkNorm)),
    Linear("attn.out_proj", W::kQ, W::kHidden, If(Flag::kOBias)).As(R::kAttentionOut),
    Norm("norm_2", W::kHidden, If(Flag::kNormBias)),
    Linear("ffn.up_proj", W::kHidden, W::kFfn, If(Flag::kMlpBias)).As(R::kMlpUp),
    Linear("ffn.down_proj", W::kFfn, W::kHidden, If(Flag::kMlpBias)).As(R::kMlpDown),
    Linear("ffn.gate_proj", W::kHidden, W::kFfn, If(Flag::kMlpBias), If(Flag::kGatedMlp))
        .As(R::kMlpGate),
};
constexpr Part kMptAfter[] = {Norm("norm_f", W::kHidden, If(Flag::kNormBias))};
constexpr HeadSpec kMptHeads[] = {
    {HeadKind::kSequence, "ForSequenceClassification", "transformer", kScore},
    {HeadKind::kToken, "ForTokenClassification", "transformer", kClassifierHead},
    Qa("transformer"),
};

// --- The table ---

// A Llama descendant: the Llama size fields, embedding, layer and final norm unless the family
// says otherwise. Each entry then states only how the family differs.
constexpr FamilySpec LlamaLike(FamilySpec spec) {
  if (spec.common_dims.empty()) spec.common_dims = kLlamaCore;
  if (spec.before.empty()) spec.before = kLlamaBefore;
  if (spec.layer.empty()) spec.layer = kLlamaLayer;
  if (spec.after.empty()) spec.after = kLlamaAfter;
  return spec;
}

// One family is a few lines of the fields it sets, packed as a table (clang-format would give each
// field its own line).
// clang-format off
constexpr FamilySpec kFamilies[] = {
    {.model_type = "gpt2", .class_prefix = "GPT2", .causal_class = "GPT2LMHeadModel",
     .no_split_class = "GPT2Block", .prefix = "transformer", .dims = kGpt2Dims, .flags = kGpt2Flags,
     .before = kGpt2Before, .layers = "h", .layer = kGpt2Layer, .after = kLnF,
     .tied_embedding = "wte.weight", .heads = kTransformerHeads, .gated_mlp = false,
     .learned_positions = true, .act_field = "activation_function", .act_default = "gelu_new",
     .attention_dropout_field = "attn_pdrop", .attention_dropout_default = 0.1,
     .hidden_dropout_field = "resid_pdrop", .hidden_dropout_default = 0.1,
     .embedding_dropout_field = "embd_pdrop", .embedding_dropout_default = 0.1, .rotary = false},
    // Cohere: CohereLayerNorm (mean-centred, weight only), interleaved rotary, the logits
    // scaled by logit_scale; no task heads.
    LlamaLike({.model_type = "cohere", .class_prefix = "Cohere", .dims = kCohereDims,
               .flags = kCohereFlags, .layer = kCohereLayer, .layer_norm = true,
               .parallel_attention = true}),
    LlamaLike({.model_type = "cohere2", .class_prefix = "Cohere2", .dims = kCohere2Dims,
               .flags = kCohere2Flags, .layer = kCohereLayer, .sliding = SlidingRule::kPattern,
               .layer_norm = true, .parallel_attention = true, .nope_full_layers = true}),
    LlamaLike({.model_type = "nemotron", .class_prefix = "Nemotron", .dims = kNemotronDims,
               .flags = kLlamaFlags, .on = On(Flag::kNormBias), .layer = kUngatedLlamaLayer,
               .heads = kHeadsQaTransformer, .gated_mlp = false, .layer_norm = true,
               .partial_rotary = true, .partial_rotary_default = 0.5, .act_default = "relu2"}),
    LlamaLike({.model_type = "exaone4", .class_prefix = "Exaone4", .dims = kExaone4Dims,
               .flags = kExaone4Flags,
               .on = On(Flag::kHeadQkNorm, Flag::kNoInputNorm, Flag::kPostFfNorm),
               .adjust = &AdjustExaone4, .heads = kHeadsQaTransformer,
               .sliding = SlidingRule::kPattern, .nope_full_layers = true,
               .rope_without_window = true}),
    // GraniteMoE: Granite's multipliers around Mixtral-like routed experts (no task heads).
    LlamaLike({.model_type = "granitemoe", .class_prefix = "GraniteMoe", .dims = kGraniteMoeDims,
               .flags = kUntiedAttentionBias, .layer = kGraniteMoeLayer,
               .moe = MoePlacement::kEveryLayer}),
    LlamaLike({.model_type = "arcee", .class_prefix = "Arcee", .dims = kArceeDims,
               .flags = kLlamaFlags, .layer = kUngatedLlamaLayer, .heads = kHeadsQaTransformer,
               .gated_mlp = false, .act_default = "relu2"}),
    LlamaLike({.model_type = "ernie4_5", .class_prefix = "Ernie4_5", .dims = kErnieDims,
               .flags = kErnieFlags}),
    LlamaLike({.model_type = "glm4_moe", .class_prefix = "Glm4Moe", .dims = kGlm4MoeDims,
               .flags = kGlm4MoeFlags, .on = On(Flag::kRouterBiasBuffer), .layer = kGlm4MoeLayer,
               .moe = MoePlacement::kAfterDense, .partial_rotary = true,
               .partial_rotary_default = 0.5, .mtp = true}),
    LlamaLike({.model_type = "helium", .class_prefix = "Helium", .dims = kHeliumDims,
               .flags = kHeliumFlags, .heads = kHeadsSeqToken}),
    LlamaLike({.model_type = "stablelm", .class_prefix = "StableLm", .common_dims = kStableLmCore,
               .dims = kStableLmDims, .flags = kStableLmFlags, .on = On(Flag::kNormBias),
               .layer = kStableLmLayer, .heads = kHeadsSeqToken, .layer_norm = true,
               .partial_rotary = true, .partial_rotary_default = 0.25,
               .hidden_dropout_field = "hidden_dropout"}),
    {.model_type = "gpt_bigcode", .class_prefix = "GPTBigCode", .no_split_class = "GPTBigCodeBlock",
     .prefix = "transformer", .dims = kGptBigcodeDims, .flags = kGptBigcodeFlags,
     .adjust = &AdjustGptBigcode, .before = kGpt2Before, .layers = "h", .layer = kGptBigcodeLayer,
     .after = kGptBigcodeAfter, .tied_embedding = "wte.weight", .heads = kGptBigcodeHeads,
     .gated_mlp = false, .learned_positions = true, .act_field = "activation_function",
     .act_default = "gelu_pytorch_tanh", .attention_dropout_field = "attn_pdrop",
     .attention_dropout_default = 0.1, .hidden_dropout_field = "resid_pdrop",
     .hidden_dropout_default = 0.1, .embedding_dropout_field = "embd_pdrop",
     .embedding_dropout_default = 0.1, .rotary = false},
    {.model_type = "gpt_neox", .class_prefix = "GPTNeoX", .no_split_class = "GPTNeoXLayer",
     .prefix = "gpt_neox", .dims = kGptNeoxDims, .flags = kGptNeoxFlags, .before = kGptNeoxBefore,
     .layer = kGptNeoxLayer, .after = kGptNeoxAfter,
     .lm_head = Linear("embed_out", W::kHidden, W::kVocab).As(R::kHead), .tied_embedding = "embed_in.weight",
     .heads = kGptNeoxHeads, .gated_mlp = false, .partial_rotary = true,
     .partial_rotary_default = 0.25, .partial_rotary_field = "rotary_pct", .act_default = "gelu",
     .hidden_dropout_field = "hidden_dropout"},
    LlamaLike({.model_type = "llama", .class_prefix = "Llama", .dims = kLlamaDims,
               .flags = kLlamaFlags, .heads = kHeadsQaTransformer}),
    LlamaLike({.model_type = "mistral", .class_prefix = "Mistral", .dims = kMistralDims,
               .flags = kUntied, .heads = kHeadsQaModel, .sliding = SlidingRule::kEveryLayer}),
    LlamaLike({.model_type = "mixtral", .class_prefix = "Mixtral", .dims = kMixtralDims,
               .flags = kUntied, .layer = kMixtralLayer, .heads = kHeadsQaModel,
               .moe = MoePlacement::kEveryLayer, .sliding = SlidingRule::kEveryLayer}),
    LlamaLike({.model_type = "qwen2", .class_prefix = "Qwen2", .dims = kQwenDims,
               .flags = kQwen2Flags, .on = On(Flag::kQkvBias), .heads = kHeadsQaTransformer,
               .sliding = SlidingRule::kQwen}),
    LlamaLike({.model_type = "qwen3", .class_prefix = "Qwen3", .dims = kQwen3Dims,
               .flags = kQwen3Flags, .on = On(Flag::kHeadQkNorm), .heads = kHeadsQaTransformer,
               .sliding = SlidingRule::kQwen}),
    LlamaLike({.model_type = "qwen2_moe", .class_prefix = "Qwen2Moe", .dims = kQwen2MoeDims,
               .flags = kQwen2MoeFlags, .layer = kQwen2MoeLayer, .heads = kHeadsQaModel,
               .moe = MoePlacement::kSparseStep, .sliding = SlidingRule::kQwen2Moe}),
    LlamaLike({.model_type = "qwen3_moe", .class_prefix = "Qwen3Moe", .dims = kQwen3MoeDims,
               .flags = kQwen3Flags, .on = On(Flag::kHeadQkNorm), .layer = kQwen3MoeLayer,
               .heads = kHeadsQaTransformer, .moe = MoePlacement::kSparseStep,
               .sliding = SlidingRule::kEveryLayerIfUsed}),
    LlamaLike({.model_type = "gemma", .class_prefix = "Gemma", .dims = kGemmaDims,
               .flags = kGemmaFlags, .on = On(Flag::kScaledEmbedding), .heads = kHeadsSeqToken,
               .act_alias = "hidden_activation", .act_default = "gelu_pytorch_tanh"}),
    LlamaLike({.model_type = "gemma2", .class_prefix = "Gemma2", .dims = kGemma2Dims,
               .flags = kGemmaFlags,
               .on = On(Flag::kScaledEmbedding, Flag::kSandwichNorms, Flag::kPostFfNorm),
               .heads = kHeadsSeqToken, .sliding = SlidingRule::kAlternate,
               .act_field = "hidden_activation", .act_default = "gelu_pytorch_tanh",
               .softcapping = true, .attn_softcap_default = 50.0,
               .final_softcap_default = 30.0}),
    LlamaLike({.model_type = "gemma3_text", .class_prefix = "Gemma3",
               .base_class = "Gemma3TextModel", .dims = kGemma3Dims, .flags = kGemmaFlags,
               .on = On(Flag::kScaledEmbedding, Flag::kSandwichNorms, Flag::kPostFfNorm,
                        Flag::kHeadQkNorm, Flag::kRotaryPerType),
               .heads = kGemma3Heads, .sliding = SlidingRule::kPattern,
               .act_field = "hidden_activation", .act_default = "gelu_pytorch_tanh",
               .softcapping = true}),
    LlamaLike({.model_type = "olmo2", .class_prefix = "Olmo2", .dims = kOlmo2Dims,
               .flags = kUntiedAttentionBias,
               .on = On(Flag::kFullQkNorm, Flag::kNoInputNorm, Flag::kPostFfNorm),
               .heads = kHeadsSeq}),
    LlamaLike({.model_type = "olmo3", .class_prefix = "Olmo3", .dims = kOlmo3Dims,
               .flags = kUntiedAttentionBias,
               .on = On(Flag::kFullQkNorm, Flag::kNoInputNorm, Flag::kPostFfNorm,
                        Flag::kRotaryPerType),
               .heads = kHeadsSeq, .sliding = SlidingRule::kOlmo3}),
    LlamaLike({.model_type = "olmo", .class_prefix = "Olmo", .dims = kLlamaDims,
               .flags = kUntiedAttentionBias, .adjust = &AdjustClipQkv, .layer = kOlmoLayer,
               .after = kRotary, .heads = kHeadsSeq, .layer_norm = true}),
    LlamaLike({.model_type = "olmoe", .class_prefix = "Olmoe", .dims = kOlmoeDims,
               .flags = kUntiedAttentionBias, .on = On(Flag::kFullQkNorm),
               .adjust = &AdjustClipQkv, .layer = kMixtralLayer, .moe = MoePlacement::kEveryLayer}),
    LlamaLike({.model_type = "hunyuan_v1_dense", .class_prefix = "HunYuanDenseV1",
               .dims = kHunyuanDims, .flags = kUntiedAttentionBias, .layer = kHunyuanLayer,
               .heads = kHeadsSeq}),
    LlamaLike({.model_type = "glm", .class_prefix = "Glm", .dims = kGlmDims, .flags = kGlmFlags,
               .layer = kGlmLayer, .heads = kHeadsSeqToken, .partial_rotary = true,
               .partial_rotary_default = 0.5}),
    LlamaLike({.model_type = "glm4", .class_prefix = "Glm4", .dims = kGlmDims, .flags = kGlmFlags,
               .layer = kGlm4Layer, .heads = kHeadsSeqToken, .partial_rotary = true,
               .partial_rotary_default = 0.5}),
    // Ministral: Mistral's config, Qwen2's modules without their q/k/v biases.
    LlamaLike({.model_type = "ministral", .class_prefix = "Ministral", .dims = kMistralDims,
               .flags = kUntied, .heads = kHeadsQaTransformer,
               .sliding = SlidingRule::kEveryLayer}),
    // SmolLM3: Llama's modules (Qwen2's rotary embedding, the same buffers), with no rotary
    // embedding on every fourth layer (no_rope_layers) and tied embeddings by default.
    LlamaLike({.model_type = "smollm3", .class_prefix = "SmolLM3", .dims = kSmolLm3Dims,
               .flags = kSmolLm3Flags, .heads = kHeadsQaTransformer,
               .sliding = SlidingRule::kNopeIfUsed, .nope_layers = true}),
    // Granite: Llama's tensors; its multipliers (embedding, residual, attention, logits) are
    // computation only (the step model's Family::granite_multipliers). No task heads.
    LlamaLike({.model_type = "granite", .class_prefix = "Granite", .dims = kGraniteDims,
               .flags = kLlamaFlags}),
    // Seed-OSS: Llama's block with q/k/v biases and dropout (0.1 by default) on the attention's
    // and the MLP's outputs.
    LlamaLike({.model_type = "seed_oss", .class_prefix = "SeedOss", .dims = kSeedOssDims,
               .flags = kSeedOssFlags, .heads = kHeadsQaTransformer,
               .attention_dropout_default = 0.1, .hidden_dropout_field = "residual_dropout",
               .hidden_dropout_default = 0.1}),
    LlamaLike({.model_type = "starcoder2", .class_prefix = "Starcoder2", .dims = kStarcoder2Dims,
               .flags = kStarcoder2Flags, .on = On(Flag::kNormBias), .layer = kStarcoder2Layer,
               .heads = kHeadsSeqToken, .sliding = SlidingRule::kEveryLayer, .gated_mlp = false,
               .act_default = "gelu_pytorch_tanh", .hidden_dropout_field = "residual_dropout",
               .embedding_dropout_field = "embedding_dropout"}),
    LlamaLike({.model_type = "phi", .class_prefix = "Phi", .dims = kPhiDims, .flags = kPhiFlags,
               .layer = kPhiLayer, .after = kPhiAfter,
               .lm_head = Linear("lm_head", W::kHidden, W::kVocab, kYes).As(R::kHead), .heads = kHeadsSeqToken,
               .gated_mlp = false, .parallel_attention = true, .partial_rotary = true,
               .partial_rotary_default = 0.5, .act_default = "gelu_new",
               .hidden_dropout_field = "resid_pdrop", .embedding_dropout_field = "embd_pdrop"}),
    LlamaLike({.model_type = "phi3", .class_prefix = "Phi3", .dims = kPhi3Dims, .flags = kUntied,
               .layer = kPhi3Layer, .heads = kHeadsSeqToken, .sliding = SlidingRule::kEveryLayer,
               .partial_rotary = true, .hidden_dropout_field = "resid_pdrop",
               .embedding_dropout_field = "embd_pdrop"}),
    LlamaLike({.model_type = "deepseek_v2", .class_prefix = "DeepseekV2", .dims = kDeepseekV2Dims,
               .more_dims = kMlaDims, .flags = kDeepseekV2Flags, .before = kDeepseekBefore,
               .layer = kDeepseekLayer, .heads = kHeadsSeq, .moe = MoePlacement::kAfterDense,
               .mla = true}),
    LlamaLike({.model_type = "deepseek_v3", .class_prefix = "DeepseekV3", .dims = kDeepseekV3Dims,
               .more_dims = kMlaDims, .flags = kDeepseekV3Flags, .on = On(Flag::kRouterBiasBuffer),
               .before = kDeepseekBefore, .layer = kDeepseekLayer, .heads = kHeadsSeqToken,
               .moe = MoePlacement::kAfterDense, .mla = true, .mtp = true}),
    LlamaLike({.model_type = "gpt_oss", .class_prefix = "GptOss", .dims = kGptOssDims,
               .flags = kGptOssFlags, .layer = kGptOssLayer, .heads = kHeadsSeqToken,
               .moe = MoePlacement::kEveryLayer, .sliding = SlidingRule::kAlternate,
               .attention_sinks = true}),
    {.model_type = "falcon", .class_prefix = "Falcon", .prefix = "transformer", .dims = kFalconDims,
     .flags = kFalconFlags, .on = On(Flag::kNormBias), .adjust = &AdjustFalcon,
     .before = kWordEmbeddings, .layers = "h", .layer = kFalconLayer, .after = kFalconAfter,
     .tied_embedding = "word_embeddings.weight", .heads = kTransformerHeads, .gated_mlp = false,
     .act_field = "activation", .act_default = "gelu", .hidden_dropout_field = "hidden_dropout"},
    {.model_type = "bloom", .class_prefix = "Bloom", .no_split_class = "BloomBlock",
     .prefix = "transformer", .dims = kBloomDims, .flags = kBloomFlags, .before = kBloomBefore,
     .layers = "h", .layer = kBloomLayer, .after = kLnF, .tied_embedding = "word_embeddings.weight",
     .heads = kTransformerHeads, .gated_mlp = false, .act_field = {}, .act_default = "gelu",
     .hidden_dropout_field = "hidden_dropout", .rotary = false, .alibi = true},
    {.model_type = "gptj", .class_prefix = "GPTJ", .no_split_class = "GPTJBlock",
     .prefix = "transformer", .dims = kGptjDims, .flags = kGptjFlags, .before = kWte, .layers = "h",
     .layer = kGptjLayer, .after = kLnF, .lm_head = Linear("lm_head", W::kHidden, W::kVocab, kYes).As(R::kHead),
     .tied_embedding = "wte.weight", .heads = kGptjHeads, .gated_mlp = false,
     .parallel_attention = true, .act_field = "activation_function", .act_default = "gelu_new",
     .attention_dropout_field = "attn_pdrop", .hidden_dropout_field = "resid_pdrop",
     .embedding_dropout_field = "embd_pdrop"},
    {.model_type = "gpt_neo", .class_prefix = "GPTNeo", .no_split_class = "GPTNeoBlock",
     .prefix = "transformer", .dims = kGptNeoDims, .flags = kGptNeoFlags, .adjust = &AdjustGptNeo,
     .before = kGpt2Before, .layers = "h", .layer = kGptNeoLayer, .after = kLnF,
     .tied_embedding = "wte.weight", .heads = kTransformerHeads, .gated_mlp = false,
     .learned_positions = true, .act_field = "activation_function", .act_default = "gelu_new",
     .hidden_dropout_field = "resid_dropout", .embedding_dropout_field = "embed_dropout",
     .rotary = false},
    {.model_type = "opt", .class_prefix = "OPT", .dims = kOptDims, .flags = kOptFlags,
     .adjust = &AdjustOpt, .before = kOptBefore, .layers = "decoder.layers", .layer = kOptLayer,
     .lm_head = Linear("lm_head", W::kEmbedProj, W::kVocab).As(R::kHead),
     .tied_embedding = "decoder.embed_tokens.weight", .heads = kOptHeads, .gated_mlp = false,
     .learned_positions = true, .act_field = "activation_function", .act_default = "relu",
     .hidden_dropout_field = "dropout", .hidden_dropout_default = 0.1, .rotary = false},
    {.model_type = "mpt", .class_prefix = "Mpt", .remote_causal_class = "MPTForCausalLM",
     .no_split_class = "MptBlock",
     .prefix = "transformer", .dims = kMptDims, .flags = kMptFlags, .adjust = &AdjustMpt,
     .before = kMptBefore, .layers = "blocks", .layer = kMptLayer, .after = kMptAfter,
     .tied_embedding = "wte.weight", .heads = kMptHeads, .gated_mlp = false,
     .use_cache_default = false, .layer_norm = true, .act_field = {}, .act_default = "gelu",
     .attention_dropout_field = {}, .hidden_dropout_field = "resid_pdrop",
     .embedding_dropout_field = "emb_pdrop", .rotary = false},
};
// clang-format on

// Pointers to every entry of kFamilies, in order.
template <size_t... I>
constexpr std::array<const FamilySpec*, sizeof...(I)> PointersTo(std::index_sequence<I...>) {
  return {&kFamilies[I]...};
}
constexpr auto kFamilyList = PointersTo(std::make_index_sequence<std::size(kFamilies)>());

}  // namespace

std::span<const FamilySpec* const> Families() { return kFamilyList; }

const FamilySpec* FindFamily(std::string_view model_type) {
  for (const FamilySpec* spec : kFamilyList) {
    if (spec->model_type == model_type) return spec;
  }
  return nullptr;
}

}  // namespace memplan::estimator::family
