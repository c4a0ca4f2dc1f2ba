// Vision towers and the vision-language models built around them, as tables for the builders of
// hf_family.h (Note [Multimodal models]): clip_vision_model and siglip_vision_model (the towers),
// llava (LlavaForConditionalGeneration) and gemma3 (Gemma3ForConditionalGeneration). Names and
// order as Transformers 5 registers them (Note [Names and order] in hf_families_decoder.cc);
// tests/oracle/modern_oracle_test.py checks them against it.
#include <iterator>
#include <span>
#include <string_view>

#include "estimator/hf_family.h"

namespace memplan::estimator::family {
namespace {

// --- Vision towers ---

// CLIPVisionConfig and SiglipVisionConfig: the same fields; their defaults describe the base
// towers, and published composite configs rely on them (Note [Multimodal models]).
constexpr DimField kClipVisionDims[] = {
    Default(Dim::kHidden, "hidden_size", 768),
    Default(Dim::kLayers, "num_hidden_layers", 12),
    Default(Dim::kHeads, "num_attention_heads", 12),
    SameAs(Dim::kKvHeads, "", Dim::kHeads),
    Quotient(Dim::kHeadDim, "", Dim::kHidden, Dim::kHeads),
    Default(Dim::kIntermediate, "intermediate_size", 3072),
    Default(Dim::kChannels, "num_channels", 3),
    Default(Dim::kImageSize, "image_size", 224),
    Default(Dim::kPatchSize, "patch_size", 32),
};
constexpr DimField kSiglipVisionDims[] = {
    Default(Dim::kHidden, "hidden_size", 768),
    Default(Dim::kLayers, "num_hidden_layers", 12),
    Default(Dim::kHeads, "num_attention_heads", 12),
    SameAs(Dim::kKvHeads, "", Dim::kHeads),
    Quotient(Dim::kHeadDim, "", Dim::kHidden, Dim::kHeads),
    Default(Dim::kIntermediate, "intermediate_size", 3072),
    Default(Dim::kChannels, "num_channels", 3),
    Default(Dim::kImageSize, "image_size", 224),
    Default(Dim::kPatchSize, "patch_size", 16),
};
constexpr FlagField kSiglipVisionFlags[] = {{Flag::kVisionHead, "vision_use_head", true}};

// The encoder layer's attention: k, v, q, out, all biased.
constexpr Part kVisionAttention[] = {
    Linear("self_attn.k_proj", W::kHidden, W::kHidden, kYes).As(R::kAttentionK),
    Linear("self_attn.v_proj", W::kHidden, W::kHidden, kYes).As(R::kAttentionV),
    Linear("self_attn.q_proj", W::kHidden, W::kHidden, kYes).As(R::kAttentionQ),
    Linear("self_attn.out_proj", W::kHidden, W::kHidden, kYes).As(R::kAttentionOut),
};
constexpr Part kVisionMlp[] = {
    Linear("mlp.fc1", W::kHidden, W::kFfn, kYes).As(R::kMlpUp),
    Linear("mlp.fc2", W::kFfn, W::kHidden, kYes).As(R::kMlpDown),
};

// CLIP: a class token, a bias-free patch convolution, a position per patch and the class token,
// and a pre-LayerNorm ("pre_layrnorm", as spelled); layers register attention before their norms.
constexpr Part kClipVisionBefore[] = {
    Param("embeddings.class_embedding", W::kHidden).As(R::kOther),
    PatchConv("embeddings.patch_embedding", W::kChannels, W::kHidden, kNo),
    Embedding("embeddings.position_embedding", W::kPatchesPlusOne, W::kHidden),
    IdsBuffer("embeddings.position_ids", W::kOne, W::kPatchesPlusOne),
    Norm("pre_layrnorm", W::kHidden, kYes),
};
constexpr Part kClipVisionLayer[] = {
    Include(kVisionAttention),
    Norm("layer_norm1", W::kHidden, kYes),
    Include(kVisionMlp),
    Norm("layer_norm2", W::kHidden, kYes),
};
constexpr Part kVisionAfter[] = {Norm("post_layernorm", W::kHidden, kYes)};

// SigLIP: a biased patch convolution, a position per patch, no class token; norms first; and,
// with vision_use_head, an attention-pooling head (a probe and nn.MultiheadAttention's fused
// in_proj).
constexpr Part kSiglipVisionBefore[] = {
    PatchConv("embeddings.patch_embedding", W::kChannels, W::kHidden, kYes),
    Embedding("embeddings.position_embedding", W::kPatches, W::kHidden),
    IdsBuffer("embeddings.position_ids", W::kOne, W::kPatches),
};
constexpr Part kSiglipVisionLayer[] = {
    Norm("layer_norm1", W::kHidden, kYes),
    Include(kVisionAttention),
    Norm("layer_norm2", W::kHidden, kYes),
    Include(kVisionMlp),
};
constexpr Part kSiglipHead[] = {
    Param("head.probe", W::kOne, W::kOne, W::kHidden).As(R::kOther),
    Param("head.attention.in_proj_weight", W::kQkv, W::kHidden).As(R::kAttentionQkv),
    BiasParam("head.attention.in_proj_bias", W::kQkv).As(R::kAttentionQkv),
    Linear("head.attention.out_proj", W::kHidden, W::kHidden, kYes).As(R::kAttentionOut),
    Norm("head.layernorm", W::kHidden, kYes),
    Linear("head.mlp.fc1", W::kHidden, W::kFfn, kYes).As(R::kMlpUp),
    Linear("head.mlp.fc2", W::kFfn, W::kHidden, kYes).As(R::kMlpDown),
};
constexpr Part kSiglipVisionAfter[] = {
    Norm("post_layernorm", W::kHidden, kYes),
    Include(kSiglipHead, If(Flag::kVisionHead)),
};
constexpr std::string_view kEmbeddings[] = {"embeddings"};
constexpr std::string_view kEmbeddingsAndHead[] = {"embeddings", "head"};

constexpr FamilySpec kTowers[] = {
    {.model_type = "clip_vision_model",
     .class_prefix = "CLIPVision",
     .no_split_class = "CLIPEncoderLayer",
     .dims = kClipVisionDims,
     .before = kClipVisionBefore,
     .layers = "encoder.layers",
     .no_split_parts = kEmbeddings,
     .layer = kClipVisionLayer,
     .after = kVisionAfter,
     .gated_mlp = false,
     .act_default = "quick_gelu"},
    {.model_type = "siglip_vision_model",
     .class_prefix = "SiglipVision",
     .no_split_class = "SiglipEncoderLayer",
     .dims = kSiglipVisionDims,
     .flags = kSiglipVisionFlags,
     .before = kSiglipVisionBefore,
     .layers = "encoder.layers",
     .no_split_parts = kEmbeddingsAndHead,
     .layer = kSiglipVisionLayer,
     .after = kSiglipVisionAfter,
     .gated_mlp = false,
     .act_default = "gelu_pytorch_tanh"},
};
constexpr const FamilySpec* kTowerList[] = {&kTowers[0], &kTowers[1]};

// --- llava ---

// LlavaConfig's SubConfigSpec: a CLIP tower sized as llava-1.5's when vision_config is absent,
// and a language model of model_type llama when text_config says none. A text_config left
// partly empty takes its class's defaults (llava-1.5-7b's has no hidden_size: LlamaConfig's).
constexpr SubConfigDefault kLlavaVisionAbsent[] = {
    {"clip_vision_model", "intermediate_size", 4096},
    {"clip_vision_model", "hidden_size", 1024},
    {"clip_vision_model", "patch_size", 14},
    {"clip_vision_model", "image_size", 336},
    {"clip_vision_model", "num_hidden_layers", 24},
    {"clip_vision_model", "num_attention_heads", 16},
};
// The configuration classes' defaults for the size fields of the language models composites
// hold (see Note [Required size fields] in hf_families_decoder.cc: standalone, they are required).
constexpr SubConfigDefault kTextDefaults[] = {
    {"llama", "hidden_size", 4096},
    {"llama", "intermediate_size", 11008},
    {"llama", "num_hidden_layers", 32},
    {"llama", "num_attention_heads", 32},
    {"llama", "vocab_size", 32000},
    {"mistral", "hidden_size", 4096},
    {"mistral", "intermediate_size", 14336},
    {"mistral", "num_hidden_layers", 32},
    {"mistral", "num_attention_heads", 32},
    {"mistral", "num_key_value_heads", 8},
    {"mistral", "vocab_size", 32000},
    {"gemma3_text", "hidden_size", 2304},
    {"gemma3_text", "intermediate_size", 9216},
    {"gemma3_text", "num_hidden_layers", 26},
    {"gemma3_text", "num_attention_heads", 8},
    {"gemma3_text", "num_key_value_heads", 4},
    {"gemma3_text", "vocab_size", 262208},
};
constexpr FlagField kLlavaFlags[] = {{Flag::kMlpBias, "multimodal_projector_bias", true}};
// The projector: vision width (x the feature layers concatenated) -> text width -> text width.
constexpr Part kLlavaProjector[] = {
    Linear("multi_modal_projector.linear_1", W::kVisionFeatures, W::kHidden, If(Flag::kMlpBias))
        .As(R::kProjector),
    Linear("multi_modal_projector.linear_2", W::kHidden, W::kHidden, If(Flag::kMlpBias))
        .As(R::kProjector),
};

// --- gemma3 ---

// Gemma3MultiModalProjector: a bare projection matrix [vision, text] and an RMSNorm of the
// vision width (its average pool has no parameters).
constexpr Part kGemma3Projector[] = {
    Param("multi_modal_projector.mm_input_projection_weight", W::kVisionHidden, W::kHidden)
        .As(R::kProjector),
    Norm("multi_modal_projector.mm_soft_emb_norm", W::kVisionHidden),
};
constexpr Part kCompositeScore[] = {Linear("score", W::kHidden, W::kLabels).As(R::kClassifier)};
constexpr HeadSpec kGemma3CompositeHeads[] = {
    {HeadKind::kSequence, "ForSequenceClassification", "model", kCompositeScore}};

constexpr CompositeSpec kComposites[] = {
    {.model_type = "llava",
     .class_prefix = "Llava",
     .causal_class = "LlavaForConditionalGeneration",
     .vision = {"vision_config", "clip_vision_model", {}, kLlavaVisionAbsent},
     .text = {"text_config", "llama", kTextDefaults, kTextDefaults},
     .flags = kLlavaFlags,
     .projector = kLlavaProjector,
     .tie_default = false,
     .tie_from_text = true},
    {.model_type = "gemma3",
     .class_prefix = "Gemma3",
     .causal_class = "Gemma3ForConditionalGeneration",
     .vision = {"vision_config", "siglip_vision_model"},
     .text = {"text_config", "gemma3_text", kTextDefaults, kTextDefaults},
     .projector = kGemma3Projector,
     .heads = kGemma3CompositeHeads,
     .tie_default = true},
};
constexpr const CompositeSpec* kCompositeList[] = {&kComposites[0], &kComposites[1]};
static_assert(std::size(kCompositeList) == std::size(kComposites));

}  // namespace

std::span<const FamilySpec* const> VisionTowers() { return kTowerList; }
std::span<const CompositeSpec* const> Composites() { return kCompositeList; }

const CompositeSpec* FindComposite(std::string_view model_type) {
  for (const CompositeSpec* spec : kCompositeList) {
    if (spec->model_type == model_type) return spec;
  }
  return nullptr;
}

}  // namespace memplan::estimator::family
