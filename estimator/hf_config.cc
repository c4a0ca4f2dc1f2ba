#include "estimator/hf_config.h"

#include <algorithm>
#include <map>
#include <unordered_set>

#include "common/strings.h"
#include "common/json.h"
#include "common/suggest.h"
#include "estimator/hf_family.h"

namespace memplan::estimator {
namespace {

const std::map<std::string, FamilyBuilder, std::less<>>& Families() {
  // Families with a hand-written builder; the declared ones are in family::Families().
  static const auto* kFamilies = new std::map<std::string, FamilyBuilder, std::less<>>{
      {"bert", &BuildBert},
      {"roberta", &BuildRoberta},
      {"xlm-roberta", &BuildXlmRoberta},
      {"distilbert", &BuildDistilBert},
      {"t5", &BuildT5},
  };
  return *kFamilies;
}

std::string JoinSupported() {
  std::string out;
  for (const auto& type : SupportedModelTypes()) out += (out.empty() ? "" : ", ") + type;
  return out;
}

}  // namespace

Result<DType> ConfigDType(const ConfigReader& config) {
  for (std::string_view field : {std::string_view("dtype"), std::string_view("torch_dtype")}) {
    if (!config.Has(field)) continue;
    MEMPLAN_ASSIGN_OR_RETURN(std::string text, config.StringOr(field, ""));
    Result<DType> parsed = ParseDType(text);
    return parsed.ok() ? *parsed : DType::kF32;
  }
  return DType::kF32;
}

std::vector<std::string> SupportedModelTypes() {
  std::vector<std::string> out;
  for (const auto& [name, builder] : Families()) out.push_back(name);
  for (const family::FamilySpec* spec : family::Families()) {
    out.push_back(std::string(spec->model_type));
  }
  for (const family::CompositeSpec* spec : family::Composites()) {
    out.push_back(std::string(spec->model_type));
  }
  std::sort(out.begin(), out.end());
  return out;
}

Result<ModelInventory> InventoryFromHfConfigText(std::string_view text, const std::string& source,
                                                 ModelClassChoice choice) {
  return InventoryFromHfConfigText(text, source, BuildOptions{choice});
}

Result<ModelInventory> InventoryFromHfConfig(const nlohmann::json& config,
                                             const std::string& source, ModelClassChoice choice) {
  return InventoryFromHfConfig(config, source, BuildOptions{choice});
}

Result<ModelInventory> InventoryFromHfConfigText(std::string_view text, const std::string& source,
                                                 const BuildOptions& options) {
  MEMPLAN_ASSIGN_OR_RETURN(nlohmann::json config, ParseJson(text, source));
  return InventoryFromHfConfig(config, source, options);
}

Result<ModelInventory> InventoryFromHfConfig(const nlohmann::json& config,
                                             const std::string& source,
                                             const BuildOptions& options) {
  if (!config.is_object()) {
    return Status::InvalidArgument(source +
                                   ": expected a JSON object (a Hugging Face config.json)");
  }
  ConfigReader reader(config, source);
  if (!reader.Has("model_type")) {
    return reader.FieldError(
        "model_type",
        "is missing; memplan needs it to know the architecture. Supported: " + JoinSupported() +
            ". For other models pass a tensor-shape list or safetensors files");
  }
  MEMPLAN_ASSIGN_OR_RETURN(std::string model_type, reader.StringOr("model_type", ""));
  auto it = Families().find(model_type);
  const family::FamilySpec* spec = family::FindFamily(model_type);
  const family::CompositeSpec* composite = family::FindComposite(model_type);
  if (it == Families().end() && spec == nullptr && composite == nullptr) {
    return Status::Unimplemented(
        source + ": field 'model_type': '" + model_type + "' is not supported" +
        DidYouMean(ClosestMatches(model_type, SupportedModelTypes())) +
        ". Supported: " + JoinSupported() +
        ". For any other model, pass a tensor-shape list ({\"name\": [dims...]}, dumped from "
        "PyTorch) or its safetensors files instead, with `model_config` config.json for "
        "activations");
  }
  std::string architecture;
  if (reader.Has("architectures")) {
    const auto& archs = config["architectures"];
    if (!archs.is_array() || (!archs.empty() && !archs[0].is_string())) {
      return reader.FieldError("architectures", "must be a list of class names");
    }
    if (!archs.empty()) architecture = archs[0].get<std::string>();
  }
  ModelInventory inventory;
  inventory.name = source;
  inventory.model_type = model_type;
  inventory.source = "config";
  FamilyRequest request{reader, options.choice, architecture, options.experts};
  request.from_config = options.from_config;
  if (spec != nullptr) {
    MEMPLAN_RETURN_IF_ERROR(family::Build(*spec, request, &inventory));
  } else if (composite != nullptr) {
    MEMPLAN_RETURN_IF_ERROR(family::BuildComposite(*composite, request, &inventory));
  } else {
    MEMPLAN_RETURN_IF_ERROR(it->second(request, &inventory));
  }
  return inventory;
}

namespace {

// The first of `fields` the config has, with its value; {"", 0} when none.
struct Found {
  std::string field;
  int64_t value = 0;
};

Result<Found> FirstDim(const ConfigReader& config, std::initializer_list<const char*> fields) {
  for (const char* field : fields) {
    if (!config.Has(field)) continue;
    MEMPLAN_ASSIGN_OR_RETURN(int64_t v, config.Dim(field));
    return Found{field, v};
  }
  return Found{};
}

Result<Found> RequiredDim(const ConfigReader& config, std::initializer_list<const char*> fields) {
  MEMPLAN_ASSIGN_OR_RETURN(Found f, FirstDim(config, fields));
  if (!f.field.empty()) return f;
  std::string names;
  for (const char* field : fields) names += std::string(names.empty() ? "" : ", ") + field;
  return Status::InvalidArgument(config.source() + ": the architecture needs one of the fields " +
                                 names);
}

// Widths of the first block's 2-D weights that differ from the hidden size: an MLP that holds
// two matrices of width f (up and down) is plain; three (gate, up, down) or a 2f-wide fused
// gate_up is gated.
bool GatedMlp(const ModelInventory& inventory, int64_t hidden, int64_t ffn) {
  std::string first_block;
  int with_ffn = 0;
  bool fused = false;
  for (const TensorInfo& t : inventory.tensors) {
    if (t.block.empty() || t.shape.size() != 2) continue;
    if (first_block.empty()) first_block = t.block;
    if (t.block != first_block) continue;
    const bool has_hidden = t.shape[0] == hidden || t.shape[1] == hidden;
    if (has_hidden && (t.shape[0] == ffn || t.shape[1] == ffn)) ++with_ffn;
    if (has_hidden && (t.shape[0] == 2 * ffn || t.shape[1] == 2 * ffn)) fused = true;
  }
  return with_ffn >= 3 || fused;
}

}  // namespace

Status AttachArchitecture(const nlohmann::json& config, const std::string& source,
                          ModelInventory* inventory) {
  if (!config.is_object()) {
    return Status::InvalidArgument(source +
                                   ": expected a JSON object (a Hugging Face config.json)");
  }
  ConfigReader reader(config, source);
  MEMPLAN_ASSIGN_OR_RETURN(std::string model_type, reader.StringOr("model_type", ""));
  // A family memplan builds: its own architecture, exactly.
  if (!model_type.empty() &&
      (Families().count(model_type) > 0 || family::FindFamily(model_type) != nullptr ||
       family::FindComposite(model_type) != nullptr)) {
    MEMPLAN_ASSIGN_OR_RETURN(ModelInventory built,
                             InventoryFromHfConfig(config, source, ModelClassChoice::kBase));
    std::unordered_set<std::string_view> blocks;
    for (const TensorInfo& t : inventory->tensors) {
      for (std::string_view m = t.module; !m.empty(); m = BeforeLastComponent(m, '.')) {
        if (!blocks.insert(m).second) break;
      }
    }
    // The base model's no-split paths, with or without the head class's prefix ("model.").
    for (const std::string& path : built.no_split_modules) {
      for (const std::string& candidate : {path, "model." + path, "transformer." + path,
                                           "gpt_neox." + path, "bert." + path, "roberta." + path}) {
        if (blocks.count(candidate) > 0) {
          inventory->no_split_modules.push_back(candidate);
          break;
        }
      }
    }
    inventory->arch = built.arch;
    inventory->model_type = model_type;
    return Status::Ok();
  }
  ArchitectureInfo a;
  MEMPLAN_ASSIGN_OR_RETURN(Found hidden, RequiredDim(reader, {"hidden_size", "n_embd", "d_model",
                                                              "dim", "model_dim", "embed_dim"}));
  MEMPLAN_ASSIGN_OR_RETURN(Found layers, RequiredDim(reader, {"num_hidden_layers", "n_layer",
                                                              "num_layers", "n_layers"}));
  MEMPLAN_ASSIGN_OR_RETURN(
      Found heads, RequiredDim(reader, {"num_attention_heads", "n_head", "num_heads", "n_heads"}));
  MEMPLAN_ASSIGN_OR_RETURN(Found vocab,
                           RequiredDim(reader, {"vocab_size", "padded_vocab_size", "n_vocab"}));
  MEMPLAN_ASSIGN_OR_RETURN(Found kv, FirstDim(reader, {"num_key_value_heads", "num_kv_heads",
                                                       "n_kv_heads", "multi_query_group_num"}));
  MEMPLAN_ASSIGN_OR_RETURN(Found head_dim, FirstDim(reader, {"head_dim", "d_kv", "kv_channels"}));
  MEMPLAN_ASSIGN_OR_RETURN(
      Found ffn, FirstDim(reader, {"intermediate_size", "ffn_dim", "n_inner", "d_ff", "hidden_dim",
                                   "ffn_hidden_size", "ffn_size"}));
  MEMPLAN_ASSIGN_OR_RETURN(
      Found positions, FirstDim(reader, {"max_position_embeddings", "n_positions", "max_seq_len",
                                         "seq_length", "n_ctx", "max_sequence_length"}));
  MEMPLAN_ASSIGN_OR_RETURN(Found experts,
                           FirstDim(reader, {"num_local_experts", "num_experts", "n_routed_experts",
                                             "moe_num_experts"}));
  MEMPLAN_ASSIGN_OR_RETURN(
      Found top_k, FirstDim(reader, {"num_experts_per_tok", "moe_top_k", "top_k", "moe_k"}));
  a.hidden = hidden.value;
  a.layers = layers.value;
  a.heads = heads.value;
  a.vocab = vocab.value;
  a.kv_heads = kv.field.empty() ? heads.value : kv.value;
  if (head_dim.field.empty() && hidden.value % heads.value != 0) {
    return reader.FieldError(heads.field, std::to_string(heads.value) + " does not divide " +
                                              hidden.field + " " + std::to_string(hidden.value) +
                                              " and the config has no head_dim");
  }
  a.head_dim = head_dim.field.empty() ? hidden.value / heads.value : head_dim.value;
  a.intermediate = ffn.field.empty() ? 4 * hidden.value : ffn.value;
  a.max_positions = positions.value;
  a.experts = experts.value;
  a.experts_per_token = experts.value > 0 ? std::max<int64_t>(top_k.value, 1) : 0;
  if (a.experts > 0) a.moe_layers = a.layers;
  a.gated_mlp = GatedMlp(*inventory, a.hidden, a.intermediate);
  for (const char* field : {"hidden_act", "hidden_activation", "activation_function", "activation",
                            "feed_forward_proj"}) {
    if (reader.Has(field) && config[field].is_string()) {
      a.hidden_act = config[field].get<std::string>();
      break;
    }
  }
  for (const char* field : {"attention_dropout", "attn_pdrop", "attention_probs_dropout_prob"}) {
    if (reader.Has(field)) {
      MEMPLAN_ASSIGN_OR_RETURN(a.attention_dropout, reader.ProbabilityOr(field, 0.0));
      break;
    }
  }
  for (const char* field : {"hidden_dropout", "resid_pdrop", "hidden_dropout_prob", "dropout"}) {
    if (reader.Has(field)) {
      MEMPLAN_ASSIGN_OR_RETURN(a.hidden_dropout, reader.ProbabilityOr(field, 0.0));
      break;
    }
  }
  for (const TensorInfo& t : inventory->tensors) {
    if (t.role == TensorRole::kPositionEmbedding)
      a.learned_positions = true;  // Note [Tensor roles]
  }
  // Decoder-only when the config names a causal-LM class or says it is a decoder.
  if (reader.Has("architectures") && config["architectures"].is_array()) {
    for (const auto& name : config["architectures"]) {
      if (name.is_string() && name.get<std::string>().find("ForCausalLM") != std::string::npos) {
        a.causal = true;
      }
    }
  }
  if (reader.Has("is_decoder") && config["is_decoder"].is_boolean() &&
      config["is_decoder"].get<bool>()) {
    a.causal = true;
  }
  inventory->arch = a;
  if (!model_type.empty()) inventory->model_type = model_type;
  return Status::Ok();
}

}  // namespace memplan::estimator
