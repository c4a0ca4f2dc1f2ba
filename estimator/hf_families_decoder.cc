// Config.json -> inventory builders for the decoder-only families: gpt2, gpt_neox, and the
// Llama-like families (llama, mistral, mixtral, qwen2, gemma).
//
// Note [Names and order]
// Each builder emits the parameters of the class Transformers builds for the config, named and
// ordered as `named_parameters(remove_duplicate=False)` yields them: submodules in the order their
// __init__ registers them, a Linear's weight before its bias, a tied head last. Buffers (rotary
// inv_freq, GPT-2's causal "bias" mask) are not parameters and never appear. Layouts are the
// classic ones that published safetensors checkpoints use, so an inventory compares name by name
// with a checkpoint's headers: Mixtral's per-expert `block_sparse_moe.experts.E.w1/w2/w3`, not
// the fused `mlp.experts.gate_up_proj` that newer Transformers builds in memory.
//
// Note [Required size fields]
// Transformers fills every absent field from the config class's defaults. For most fields memplan
// does the same (key/value heads, head_dim, biases, experts, tying). The size-defining fields of
// the Llama-like and GPT-NeoX families (hidden_size, num_hidden_layers, num_attention_heads,
// intermediate_size, vocab_size) are required instead: their class defaults describe one
// particular 7B/20B model, so a truncated or hand-written config would silently come out as that
// model. Every config Transformers saves carries them. GPT-2 is the exception: GPT2Config's
// defaults are exactly the published gpt2 checkpoint, and early GPT-2-family configs rely on them.
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "estimator/hf_config.h"

namespace memplan::estimator {
namespace {

// No published model comes near this (DeepSeek-V3, with 256 experts in 58 MoE layers, has about
// 45,000 tensors), yet a config asking for more would cost hundreds of MiB of inventory before
// any later check could refuse it.
constexpr int64_t kMaxTensors = int64_t{1} << 18;

// Appends tensors of one dtype to an inventory. The first failure (an overflowing shape) is kept
// and later calls do nothing, so a builder reads as the plain list of modules it mirrors; the
// caller returns status() at the end.
class TensorSink {
 public:
  TensorSink(ModelInventory* out, DType dtype) : out_(out), dtype_(dtype) {}

  void Add(std::string name, std::vector<int64_t> shape, std::string tied_to = "") {
    if (!status_.ok()) return;
    status_ = out_->Add(std::move(name), std::move(shape), dtype_, std::move(tied_to));
  }
  // torch.nn.Linear(in, out): weight [out, in], bias [out].
  void Linear(const std::string& module, int64_t in, int64_t out, bool bias) {
    Add(module + ".weight", {out, in});
    if (bias) Add(module + ".bias", {out});
  }
  // transformers' Conv1D(nf=out, nx=in), GPT-2's projection: weight stored transposed, [in, out],
  // and always a bias.
  void Conv1D(const std::string& module, int64_t in, int64_t out) {
    Add(module + ".weight", {in, out});
    Add(module + ".bias", {out});
  }
  // nn.LayerNorm has weight and bias; the RMSNorms of the Llama-like families have a weight only.
  void Norm(const std::string& module, int64_t dim, bool bias) {
    Add(module + ".weight", {dim});
    if (bias) Add(module + ".bias", {dim});
  }

  const Status& status() const { return status_; }

 private:
  ModelInventory* out_;
  DType dtype_;
  Status status_;
};

// The two classes a family builder can build.
struct ClassNames {
  std::string_view base;    // what AutoModel builds: "LlamaModel"
  std::string_view causal;  // the causal-LM class: "LlamaForCausalLM"
};

// Picks the class from the request, records it in `out`, and returns true for the base model.
// A config whose architectures[0] is the base class builds the base class: that is what
// AutoModel.from_config and the checkpoint's own weights agree on.
Result<bool> ChooseClass(const FamilyRequest& request, const ClassNames& names,
                         ModelInventory* out) {
  const bool base = request.choice == ModelClassChoice::kBase || request.architecture == names.base;
  if (!base && !request.architecture.empty() && request.architecture != names.causal) {
    return request.config.FieldError(
        "architectures", "'" + request.architecture +
                             "' is not a class memplan can build for this model_type; " +
                             "supported: " + std::string(names.causal) + " (causal LM) and " +
                             std::string(names.base) +
                             " (base model). To size the base model without its task head, pass "
                             "--model-class base");
  }
  out->architecture = std::string(base ? names.base : names.causal);
  out->model_class = base ? "base" : "causal_lm";
  return base;
}

// Storage dtype of the checkpoint. Transformers 4.56 renamed the saved field from `torch_dtype`
// to `dtype`; both are read. A spelling ParseDType does not know ("auto", a typo) falls back to
// F32, the dtype Transformers builds a model in when told nothing.
Result<DType> ReadDType(const ConfigReader& config) {
  for (std::string_view field : {std::string_view("torch_dtype"), std::string_view("dtype")}) {
    if (!config.Has(field)) continue;
    MEMPLAN_ASSIGN_OR_RETURN(std::string text, config.StringOr(field, ""));
    Result<DType> parsed = ParseDType(text);
    return parsed.ok() ? *parsed : DType::kF32;
  }
  return DType::kF32;
}

// Refuses a config whose layer count would build more than kMaxTensors tensors (see there).
Status CheckTensorBudget(const ConfigReader& config, std::string_view layers_field, int64_t layers,
                         int64_t per_layer) {
  // The handful of tensors outside the blocks (embeddings, final norm, head) is under 16.
  if (layers > (kMaxTensors - 16) / per_layer) {
    return config.FieldError(layers_field,
                             std::to_string(layers) + " layers of " + std::to_string(per_layer) +
                                 " tensors each would exceed memplan's limit of " +
                                 std::to_string(kMaxTensors) +
                                 " tensors per model (no published model comes close)");
  }
  return Status::Ok();
}

// A dimension with the field it was read from, so that later checks name the right one.
struct NamedDim {
  int64_t value = 0;
  std::string_view field;
};

// GPT2Config's attribute_map lets a config spell n_embd as hidden_size (and so on), and
// PretrainedConfig applies such leftover keys after the class's own arguments, so the alias wins
// when a config has both.
Result<NamedDim> Gpt2Dim(const ConfigReader& config, std::string_view alias, std::string_view field,
                         int64_t fallback) {
  std::string_view used = config.Has(alias) ? alias : field;
  MEMPLAN_ASSIGN_OR_RETURN(int64_t value, config.DimOr(used, fallback));
  return NamedDim{value, used};
}

// Switches that tell the Llama-like families apart. Everything else (embedding, RMSNorms, SwiGLU
// MLP, grouped-query attention, head) is shared.
struct LlamaLikeFamily {
  ClassNames names;
  // tie_word_embeddings when absent: the family's config class default (LlamaConfig and the
  // others pass False over PretrainedConfig's True; GemmaConfig keeps True).
  bool tie_default = false;
  // head_dim when the config has none; 0 means hidden_size / num_attention_heads.
  int64_t head_dim_default = 0;
  bool attention_bias_field = false;  // q/k/v/o biases follow config `attention_bias`
  bool mlp_bias_field = false;        // gate/up/down biases follow config `mlp_bias`
  bool qkv_bias = false;              // q/k/v always biased, o_proj never (Qwen2)
  bool moe = false;                   // Mixtral's block_sparse_moe instead of mlp
  // max_position_embeddings and hidden_act when absent: the config class defaults.
  int64_t max_positions_default = 2048;
  std::string_view hidden_act_default = "silu";
};

Status BuildLlamaLike(const FamilyRequest& request, const LlamaLikeFamily& family,
                      ModelInventory* out) {
  const ConfigReader& config = request.config;
  MEMPLAN_ASSIGN_OR_RETURN(bool base, ChooseClass(request, family.names, out));
  MEMPLAN_ASSIGN_OR_RETURN(DType dtype, ReadDType(config));
  MEMPLAN_ASSIGN_OR_RETURN(int64_t hidden, config.Dim("hidden_size"));
  MEMPLAN_ASSIGN_OR_RETURN(int64_t layers, config.Dim("num_hidden_layers"));
  MEMPLAN_ASSIGN_OR_RETURN(int64_t heads, config.Dim("num_attention_heads"));
  MEMPLAN_ASSIGN_OR_RETURN(int64_t intermediate, config.Dim("intermediate_size"));
  MEMPLAN_ASSIGN_OR_RETURN(int64_t vocab, config.Dim("vocab_size"));
  // Absent means multi-head attention, as in the original Llama configs.
  MEMPLAN_ASSIGN_OR_RETURN(int64_t kv_heads, config.DimOr("num_key_value_heads", heads));
  if (heads % kv_heads != 0) {
    return config.FieldError("num_key_value_heads",
                             std::to_string(kv_heads) + " does not divide num_attention_heads " +
                                 std::to_string(heads) +
                                 " (each key/value head serves a whole group of query heads)");
  }
  // Newer configs (Mistral-Nemo, Llama 3.2, Gemma) state head_dim, which then need not divide the
  // hidden size; without it Transformers derives it and older versions refuse a remainder.
  int64_t head_dim = 0;
  if (config.Has("head_dim")) {
    MEMPLAN_ASSIGN_OR_RETURN(head_dim, config.Dim("head_dim"));
  } else if (family.head_dim_default > 0) {
    head_dim = family.head_dim_default;
  } else {
    if (hidden % heads != 0) {
      return config.FieldError("num_attention_heads",
                               std::to_string(heads) + " does not divide hidden_size " +
                                   std::to_string(hidden) +
                                   " and the config has no head_dim to say otherwise");
    }
    head_dim = hidden / heads;
  }
  bool attention_bias = false;
  if (family.attention_bias_field) {
    MEMPLAN_ASSIGN_OR_RETURN(attention_bias, config.BoolOr("attention_bias", false));
  }
  bool mlp_bias = false;
  if (family.mlp_bias_field) {
    MEMPLAN_ASSIGN_OR_RETURN(mlp_bias, config.BoolOr("mlp_bias", false));
  }
  int64_t experts = 0;
  if (family.moe) {
    MEMPLAN_ASSIGN_OR_RETURN(experts, config.DimOr("num_local_experts", 8));
    if (experts > kMaxTensors / 4) {
      return config.FieldError("num_local_experts",
                               std::to_string(experts) +
                                   " experts would exceed memplan's limit of " +
                                   std::to_string(kMaxTensors) + " tensors per model");
    }
  }
  MEMPLAN_ASSIGN_OR_RETURN(bool tie, config.BoolOr("tie_word_embeddings", family.tie_default));
  ArchitectureInfo arch;
  arch.hidden = hidden;
  arch.layers = layers;
  arch.heads = heads;
  arch.kv_heads = kv_heads;
  arch.head_dim = head_dim;
  arch.intermediate = intermediate;
  arch.vocab = vocab;
  // Rotary positions: max_position_embeddings is the trained context, not a table size.
  MEMPLAN_ASSIGN_OR_RETURN(arch.max_positions,
                           config.DimOr("max_position_embeddings", family.max_positions_default));
  // Gemma's newer configs name the MLP activation hidden_activation and keep hidden_act legacy.
  MEMPLAN_ASSIGN_OR_RETURN(arch.hidden_act,
                           config.StringOr("hidden_act", std::string(family.hidden_act_default)));
  if (config.Has("hidden_activation")) {
    MEMPLAN_ASSIGN_OR_RETURN(arch.hidden_act, config.StringOr("hidden_activation", ""));
  }
  arch.gated_mlp = true;
  MEMPLAN_ASSIGN_OR_RETURN(arch.attention_dropout, config.ProbabilityOr("attention_dropout", 0.0));
  if (family.moe) {
    arch.experts = experts;
    MEMPLAN_ASSIGN_OR_RETURN(arch.experts_per_token, config.DimOr("num_experts_per_tok", 2));
    if (arch.experts_per_token > experts) {
      return config.FieldError("num_experts_per_tok",
                               std::to_string(arch.experts_per_token) + " exceeds the " +
                                   std::to_string(experts) + " experts");
    }
  }
  out->arch = arch;
  // Attention: up to 8 tensors; MLP: up to 6, or router + 3 per expert; two norms.
  MEMPLAN_RETURN_IF_ERROR(CheckTensorBudget(config, "num_hidden_layers", layers,
                                            8 + 2 + (family.moe ? 1 + 3 * experts : 6)));

  const int64_t q_dim = heads * head_dim;  // both factors <= 2^31: no overflow
  const int64_t kv_dim = kv_heads * head_dim;
  const bool qkv_bias = attention_bias || family.qkv_bias;
  const std::string prefix = base ? "" : "model.";
  const std::string embedding = prefix + "embed_tokens.weight";

  TensorSink sink(out, dtype);
  sink.Add(embedding, {vocab, hidden});
  for (int64_t i = 0; i < layers; ++i) {
    const std::string layer = prefix + "layers." + std::to_string(i) + ".";
    sink.Linear(layer + "self_attn.q_proj", hidden, q_dim, qkv_bias);
    sink.Linear(layer + "self_attn.k_proj", hidden, kv_dim, qkv_bias);
    sink.Linear(layer + "self_attn.v_proj", hidden, kv_dim, qkv_bias);
    sink.Linear(layer + "self_attn.o_proj", q_dim, hidden, attention_bias);
    if (family.moe) {
      const std::string moe = layer + "block_sparse_moe.";
      sink.Linear(moe + "gate", hidden, experts, /*bias=*/false);
      for (int64_t e = 0; e < experts; ++e) {
        const std::string expert = moe + "experts." + std::to_string(e) + ".";
        sink.Linear(expert + "w1", hidden, intermediate, /*bias=*/false);
        sink.Linear(expert + "w2", intermediate, hidden, /*bias=*/false);
        sink.Linear(expert + "w3", hidden, intermediate, /*bias=*/false);
      }
    } else {
      sink.Linear(layer + "mlp.gate_proj", hidden, intermediate, mlp_bias);
      sink.Linear(layer + "mlp.up_proj", hidden, intermediate, mlp_bias);
      sink.Linear(layer + "mlp.down_proj", intermediate, hidden, mlp_bias);
    }
    sink.Norm(layer + "input_layernorm", hidden, /*bias=*/false);
    sink.Norm(layer + "post_attention_layernorm", hidden, /*bias=*/false);
  }
  sink.Norm(prefix + "norm", hidden, /*bias=*/false);
  if (!base) sink.Add("lm_head.weight", {vocab, hidden}, tie ? embedding : "");
  return sink.status();
}

}  // namespace

Status BuildGpt2(const FamilyRequest& request, ModelInventory* out) {
  const ConfigReader& config = request.config;
  MEMPLAN_ASSIGN_OR_RETURN(bool base, ChooseClass(request, {"GPT2Model", "GPT2LMHeadModel"}, out));
  MEMPLAN_ASSIGN_OR_RETURN(DType dtype, ReadDType(config));
  // GPT2Config defaults: the published 124M gpt2 (see Note [Required size fields]).
  MEMPLAN_ASSIGN_OR_RETURN(NamedDim hidden, Gpt2Dim(config, "hidden_size", "n_embd", 768));
  MEMPLAN_ASSIGN_OR_RETURN(NamedDim layers, Gpt2Dim(config, "num_hidden_layers", "n_layer", 12));
  MEMPLAN_ASSIGN_OR_RETURN(NamedDim heads, Gpt2Dim(config, "num_attention_heads", "n_head", 12));
  MEMPLAN_ASSIGN_OR_RETURN(NamedDim positions,
                           Gpt2Dim(config, "max_position_embeddings", "n_positions", 1024));
  MEMPLAN_ASSIGN_OR_RETURN(int64_t vocab, config.DimOr("vocab_size", 50257));
  // n_inner: null in the config means 4 * n_embd.
  MEMPLAN_ASSIGN_OR_RETURN(int64_t inner, config.DimOr("n_inner", 4 * hidden.value));
  MEMPLAN_ASSIGN_OR_RETURN(bool cross, config.BoolOr("add_cross_attention", false));
  MEMPLAN_ASSIGN_OR_RETURN(bool tie, config.BoolOr("tie_word_embeddings", true));
  if (hidden.value % heads.value != 0) {
    // GPT2Attention raises the same.
    return config.FieldError(heads.field, std::to_string(heads.value) + " does not divide " +
                                              std::string(hidden.field) + " " +
                                              std::to_string(hidden.value));
  }
  MEMPLAN_RETURN_IF_ERROR(CheckTensorBudget(config, layers.field, layers.value, 24));
  ArchitectureInfo arch;
  arch.hidden = hidden.value;
  arch.layers = layers.value;
  arch.heads = arch.kv_heads = heads.value;
  arch.head_dim = hidden.value / heads.value;
  arch.intermediate = inner;
  arch.vocab = vocab;
  arch.max_positions = positions.value;
  arch.learned_positions = true;
  MEMPLAN_ASSIGN_OR_RETURN(arch.hidden_act, config.StringOr("activation_function", "gelu_new"));
  MEMPLAN_ASSIGN_OR_RETURN(arch.hidden_dropout, config.ProbabilityOr("resid_pdrop", 0.1));
  MEMPLAN_ASSIGN_OR_RETURN(arch.attention_dropout, config.ProbabilityOr("attn_pdrop", 0.1));
  MEMPLAN_ASSIGN_OR_RETURN(arch.embedding_dropout, config.ProbabilityOr("embd_pdrop", 0.1));
  out->arch = arch;

  const int64_t h = hidden.value;
  const std::string prefix = base ? "" : "transformer.";
  const std::string embedding = prefix + "wte.weight";

  TensorSink sink(out, dtype);
  sink.Add(embedding, {vocab, h});
  sink.Add(prefix + "wpe.weight", {positions.value, h});
  for (int64_t i = 0; i < layers.value; ++i) {
    const std::string block = prefix + "h." + std::to_string(i) + ".";
    sink.Norm(block + "ln_1", h, /*bias=*/true);
    sink.Conv1D(block + "attn.c_attn", h, 3 * h);
    sink.Conv1D(block + "attn.c_proj", h, h);
    sink.Norm(block + "ln_2", h, /*bias=*/true);
    if (cross) {
      // Cross-attention projects keys and values from the encoder (c_attn) and queries from
      // the decoder (q_attn) separately.
      sink.Conv1D(block + "crossattention.c_attn", h, 2 * h);
      sink.Conv1D(block + "crossattention.q_attn", h, h);
      sink.Conv1D(block + "crossattention.c_proj", h, h);
      sink.Norm(block + "ln_cross_attn", h, /*bias=*/true);
    }
    sink.Conv1D(block + "mlp.c_fc", h, inner);
    sink.Conv1D(block + "mlp.c_proj", inner, h);
  }
  sink.Norm(prefix + "ln_f", h, /*bias=*/true);
  if (!base) sink.Add("lm_head.weight", {vocab, h}, tie ? embedding : "");
  return sink.status();
}

Status BuildGptNeox(const FamilyRequest& request, ModelInventory* out) {
  const ConfigReader& config = request.config;
  MEMPLAN_ASSIGN_OR_RETURN(bool base,
                           ChooseClass(request, {"GPTNeoXModel", "GPTNeoXForCausalLM"}, out));
  MEMPLAN_ASSIGN_OR_RETURN(DType dtype, ReadDType(config));
  MEMPLAN_ASSIGN_OR_RETURN(int64_t hidden, config.Dim("hidden_size"));
  MEMPLAN_ASSIGN_OR_RETURN(int64_t layers, config.Dim("num_hidden_layers"));
  MEMPLAN_ASSIGN_OR_RETURN(int64_t heads, config.Dim("num_attention_heads"));
  MEMPLAN_ASSIGN_OR_RETURN(int64_t intermediate, config.Dim("intermediate_size"));
  MEMPLAN_ASSIGN_OR_RETURN(int64_t vocab, config.Dim("vocab_size"));
  // Both default as in GPTNeoXConfig: biased attention projections, untied embed_out.
  MEMPLAN_ASSIGN_OR_RETURN(bool attention_bias, config.BoolOr("attention_bias", true));
  MEMPLAN_ASSIGN_OR_RETURN(bool tie, config.BoolOr("tie_word_embeddings", false));
  if (hidden % heads != 0) {
    // GPTNeoXConfig raises the same.
    return config.FieldError(
        "num_attention_heads",
        std::to_string(heads) + " does not divide hidden_size " + std::to_string(hidden));
  }
  MEMPLAN_RETURN_IF_ERROR(CheckTensorBudget(config, "num_hidden_layers", layers, 12));
  ArchitectureInfo arch;
  arch.hidden = hidden;
  arch.layers = layers;
  arch.heads = arch.kv_heads = heads;
  arch.head_dim = hidden / heads;
  arch.intermediate = intermediate;
  arch.vocab = vocab;
  MEMPLAN_ASSIGN_OR_RETURN(arch.max_positions, config.DimOr("max_position_embeddings", 2048));
  MEMPLAN_ASSIGN_OR_RETURN(arch.hidden_act, config.StringOr("hidden_act", "gelu"));
  MEMPLAN_ASSIGN_OR_RETURN(arch.hidden_dropout, config.ProbabilityOr("hidden_dropout", 0.0));
  MEMPLAN_ASSIGN_OR_RETURN(arch.attention_dropout, config.ProbabilityOr("attention_dropout", 0.0));
  out->arch = arch;

  const std::string prefix = base ? "" : "gpt_neox.";
  const std::string embedding = prefix + "embed_in.weight";

  TensorSink sink(out, dtype);
  sink.Add(embedding, {vocab, hidden});
  for (int64_t i = 0; i < layers; ++i) {
    const std::string layer = prefix + "layers." + std::to_string(i) + ".";
    // GPTNeoXLayer registers both norms before the attention and the MLP.
    sink.Norm(layer + "input_layernorm", hidden, /*bias=*/true);
    sink.Norm(layer + "post_attention_layernorm", hidden, /*bias=*/true);
    sink.Linear(layer + "attention.query_key_value", hidden, 3 * hidden, attention_bias);
    sink.Linear(layer + "attention.dense", hidden, hidden, attention_bias);
    sink.Linear(layer + "mlp.dense_h_to_4h", hidden, intermediate, /*bias=*/true);
    sink.Linear(layer + "mlp.dense_4h_to_h", intermediate, hidden, /*bias=*/true);
  }
  sink.Norm(prefix + "final_layer_norm", hidden, /*bias=*/true);
  if (!base) sink.Add("embed_out.weight", {vocab, hidden}, tie ? embedding : "");
  return sink.status();
}

Status BuildLlama(const FamilyRequest& request, ModelInventory* out) {
  LlamaLikeFamily family;
  family.names = {"LlamaModel", "LlamaForCausalLM"};
  family.attention_bias_field = true;
  family.mlp_bias_field = true;
  return BuildLlamaLike(request, family, out);
}

Status BuildMistral(const FamilyRequest& request, ModelInventory* out) {
  LlamaLikeFamily family;
  family.names = {"MistralModel", "MistralForCausalLM"};
  family.max_positions_default = 4096 * 32;
  return BuildLlamaLike(request, family, out);
}

Status BuildMixtral(const FamilyRequest& request, ModelInventory* out) {
  LlamaLikeFamily family;
  family.names = {"MixtralModel", "MixtralForCausalLM"};
  family.moe = true;
  family.max_positions_default = 4096 * 32;
  return BuildLlamaLike(request, family, out);
}

Status BuildQwen2(const FamilyRequest& request, ModelInventory* out) {
  LlamaLikeFamily family;
  family.names = {"Qwen2Model", "Qwen2ForCausalLM"};
  family.qkv_bias = true;
  family.max_positions_default = 32768;
  return BuildLlamaLike(request, family, out);
}

Status BuildGemma(const FamilyRequest& request, ModelInventory* out) {
  LlamaLikeFamily family;
  family.names = {"GemmaModel", "GemmaForCausalLM"};
  family.tie_default = true;
  family.head_dim_default = 256;
  family.max_positions_default = 8192;
  family.hidden_act_default = "gelu_pytorch_tanh";
  family.attention_bias_field = true;
  return BuildLlamaLike(request, family, out);
}

}  // namespace memplan::estimator
