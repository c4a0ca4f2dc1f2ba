// The one builder for declared families (hf_family.h): reads the sizes and switches a FamilySpec
// names, then emits its parts in order.
#include "estimator/hf_family.h"

#include <algorithm>
#include <charconv>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace memplan::estimator::family {
namespace {

// No published model comes near this (DeepSeek-V3 per expert: about 45,000 tensors), yet a config
// asking for more would cost hundreds of MiB of inventory before any later check could refuse it.
constexpr int64_t kMaxTensors = int64_t{1} << 18;

// Reads one size as `field` describes it; `values` holds the sizes read before it.
Status ReadDim(const ConfigReader& config, const DimField& f, Values* values) {
  std::string_view used = !f.alias.empty() && config.Has(f.alias) ? f.alias : f.field;
  values->fields[static_cast<int>(f.dim)] = used;
  if (config.Has(used)) {
    int64_t v = 0;
    if (f.zero_allowed) {
      MEMPLAN_ASSIGN_OR_RETURN(v, config.CountOr(used, 0));
    } else {
      MEMPLAN_ASSIGN_OR_RETURN(v, config.Dim(used));
    }
    values->Set(f.dim, v);
    return Status::Ok();
  }
  const nlohmann::json& json = config.json();
  if (f.zero_allowed && json.contains(used)) {  // present and null: "none"
    values->Set(f.dim, 0);
    return Status::Ok();
  }
  switch (f.kind) {
    case DimField::kRequired: return config.Dim(used).status();
    case DimField::kDefault: values->Set(f.dim, f.value); break;
    case DimField::kSameAs: values->Set(f.dim, values->Get(f.a)); break;
    case DimField::kQuotient: {
      const int64_t num = values->Get(f.a), den = values->Get(f.b);
      if (den == 0 || num % den != 0) {
        // Name the field the user can fix, as the modelling code's own check does.
        return config.FieldError(
            values->Field(f.b),
            std::to_string(den) + " does not divide " + std::string(values->Field(f.a)) + " " +
                std::to_string(num) +
                (f.field.empty()
                     ? std::string()
                     : " and the config has no " + std::string(f.field) + " to say otherwise"));
      }
      values->Set(f.dim, num / den);
      break;
    }
    case DimField::kMultiple: {
      const int64_t v = f.value * values->Get(f.a);
      if (v > ConfigReader::kMaxDim) {
        return config.FieldError(
            used, "is absent and its default, " + std::to_string(v) + ", is absurdly large");
      }
      values->Set(f.dim, v);
      break;
    }
  }
  return Status::Ok();
}

// partial_rotary_factor: in rope_parameters (Transformers >= 4.56), rope_scaling, or at the top
// (older configs, under `field`: GPT-NeoX's rotary_pct).
Result<double> PartialRotary(const ConfigReader& config, std::string_view field, double fallback) {
  for (const char* nested : {"rope_parameters", "rope_scaling"}) {
    if (!config.Has(nested) || !config.json()[nested].is_object()) continue;
    const nlohmann::json& rope = config.json()[nested];
    auto it = rope.find("partial_rotary_factor");
    if (it != rope.end() && it->is_number()) fallback = it->get<double>();
  }
  MEMPLAN_ASSIGN_OR_RETURN(double p, config.NumberOr(field, fallback));
  if (!(p > 0 && p <= 1)) return config.FieldError(field, "must be in (0, 1]");
  return p;
}

}  // namespace

Result<int64_t> NumLabels(const ConfigReader& config) {
  if (config.Has("id2label")) {
    const nlohmann::json& map = config.json()["id2label"];
    if (!map.is_object() || map.empty()) {
      return config.FieldError("id2label", "must be a non-empty object {\"0\": \"LABEL\", ...}");
    }
    if (map.size() > static_cast<size_t>(ConfigReader::kMaxDim)) {
      return config.FieldError("id2label", "has absurdly many labels");
    }
    return static_cast<int64_t>(map.size());
  }
  return config.DimOr("num_labels", 2);
}

namespace {

Result<Values> ReadValues(const FamilySpec& spec, const FamilyRequest& request) {
  const ConfigReader& config = request.config;
  Values v;
  for (const DimField& f : spec.common_dims) MEMPLAN_RETURN_IF_ERROR(ReadDim(config, f, &v));
  for (const DimField& f : spec.dims) MEMPLAN_RETURN_IF_ERROR(ReadDim(config, f, &v));
  for (const DimField& f : spec.more_dims) MEMPLAN_RETURN_IF_ERROR(ReadDim(config, f, &v));
  v.Set(Flag::kAlways, true);
  for (int f = 0; f < static_cast<int>(Flag::kCount); ++f) {
    if ((spec.on >> f) & 1) v.Set(static_cast<Flag>(f), true);
  }
  for (const FlagField& f : spec.flags) {
    bool b = f.value;
    if (!f.field.empty()) {
      MEMPLAN_ASSIGN_OR_RETURN(b, config.BoolOr(f.field, f.value));
    }
    v.Set(f.flag, b);
  }
  MEMPLAN_ASSIGN_OR_RETURN(v.labels, NumLabels(config));
  if (spec.partial_rotary) {
    MEMPLAN_ASSIGN_OR_RETURN(v.partial_rotary, PartialRotary(config, spec.partial_rotary_field,
                                                             spec.partial_rotary_default));
  }
  v.Set(Flag::kProjectInOut,
        v.Get(Dim::kEmbedProj) != 0 && v.Get(Dim::kEmbedProj) != v.Get(Dim::kHidden));
  v.Set(Flag::kQLora, v.Get(Dim::kQLoraRank) > 0);
  v.Set(Flag::kFused, request.experts == ExpertLayout::kFused);
  v.Set(Flag::kPerExpert, request.experts == ExpertLayout::kPerExpert);
  if (spec.adjust != nullptr) MEMPLAN_RETURN_IF_ERROR(spec.adjust(config, &v));
  const int64_t heads = v.Get(Dim::kHeads), kv = v.Get(Dim::kKvHeads);
  if (heads > 0 && kv > 0 && heads % kv != 0) {
    return config.FieldError(v.Field(Dim::kKvHeads),
                             std::to_string(kv) + " does not divide " +
                                 std::string(v.Field(Dim::kHeads)) + " " + std::to_string(heads) +
                                 " (each key/value head serves a whole group of query heads)");
  }
  if (spec.moe != MoePlacement::kNone && v.Get(Dim::kTopK) > v.Get(Dim::kExperts)) {
    return config.FieldError(v.Field(Dim::kTopK),
                             std::to_string(v.Get(Dim::kTopK)) + " exceeds the " +
                                 std::to_string(v.Get(Dim::kExperts)) + " experts");
  }
  return v;
}

bool Holds(const Cond& c, const Values& v) {
  return v.Is(c.flag) != c.negate && v.Is(c.also) != c.also_negate;
}

int64_t RotaryHalf(const Values& v) {
  const int64_t dim =
      static_cast<int64_t>(static_cast<double>(v.Get(Dim::kHeadDim)) * v.partial_rotary);
  return (dim + 1) / 2;
}

// Every width is a sum of products of two dimensions below 2^31: no overflow in 64 bits.
int64_t Width(W w, const Values& v) {
  const int64_t h = v.Get(Dim::kHidden), a = v.Get(Dim::kHeads), kv = v.Get(Dim::kKvHeads),
                d = v.Get(Dim::kHeadDim);
  switch (w) {
    case W::kNone: return 0;
    case W::kOne: return 1;
    case W::kTwo: return 2;
    case W::kHidden: return h;
    case W::kVocab: return v.Get(Dim::kVocab);
    case W::kQ: return a * d;
    case W::kKv: return kv * d;
    case W::kQkv: return (a + 2 * kv) * d;
    case W::kKvPair: return 2 * kv * d;
    case W::kFfn: return v.Get(Dim::kIntermediate);
    case W::kFfn2: return 2 * v.Get(Dim::kIntermediate);
    case W::kExperts: return v.Get(Dim::kExperts);
    case W::kMoeFfn: return v.Get(Dim::kMoeIntermediate);
    case W::kMoeFfn2: return 2 * v.Get(Dim::kMoeIntermediate);
    case W::kSharedFfn:
      return v.Get(Dim::kSharedExperts) > 0
                 ? v.Get(Dim::kSharedExperts) * v.Get(Dim::kMoeIntermediate)
                 : v.Get(Dim::kSharedIntermediate);
    case W::kHeadDim: return d;
    case W::kHeads: return a;
    case W::kKvHeads: return kv;
    case W::kQRank: return v.Get(Dim::kQLoraRank);
    case W::kQHeads: return a * (v.Get(Dim::kQkNopeHeadDim) + v.Get(Dim::kQkRopeHeadDim));
    case W::kKvA: return v.Get(Dim::kKvLoraRank) + v.Get(Dim::kQkRopeHeadDim);
    case W::kKvRank: return v.Get(Dim::kKvLoraRank);
    case W::kKvB: return a * (v.Get(Dim::kQkNopeHeadDim) + v.Get(Dim::kVHeadDim));
    case W::kVOut: return a * v.Get(Dim::kVHeadDim);
    case W::kEmbedProj: return v.Get(Dim::kEmbedProj) > 0 ? v.Get(Dim::kEmbedProj) : h;
    case W::kPositions: return v.Get(Dim::kPositions);
    case W::kPositionsOpt: return v.Get(Dim::kPositions) + 2;
    case W::kLabels: return v.labels;
    case W::kRotaryHalf: return RotaryHalf(v);
    case W::kRotaryDim: return v.Get(Dim::kRotaryDim) > 0 ? v.Get(Dim::kRotaryDim) : h;
    case W::kChannels: return v.Get(Dim::kChannels);
    case W::kPatches:
    case W::kPatchesPlusOne: {
      const int64_t side =
          v.Get(Dim::kPatchSize) > 0 ? v.Get(Dim::kImageSize) / v.Get(Dim::kPatchSize) : 0;
      return side * side + (w == W::kPatchesPlusOne ? 1 : 0);
    }
    case W::kVisionHidden: return v.Get(Dim::kVisionHidden);
    case W::kVisionFeatures:
      return v.Get(Dim::kVisionHidden) * std::max<int64_t>(v.Get(Dim::kFeatureLayers), 1);
  }
  return 0;
}

std::vector<int64_t> Shape(const Part& p, const Values& v) {
  std::vector<int64_t> shape;
  for (W w : {p.a, p.b, p.c, p.d}) {
    if (w != W::kNone) shape.push_back(Width(w, v));
  }
  return shape;
}

// Appends tensors; the first failure is kept and later calls do nothing. Names are composed in
// one reused buffer and each tensor's name allocated once: a per-expert DeepSeek-V3 has 47,000
// tensors, and temporaries per name cost more than the tensors themselves.
class Sink {
 public:
  Sink(ModelInventory* out, DType dtype) : out_(out), dtype_(dtype) {}
  // Starts a module name: `prefix` then `pattern` with "{e}" replaced by `expert`.
  void Begin(std::string_view prefix, std::string_view pattern, int64_t expert) {
    base_.assign(prefix);
    const size_t at = expert >= 0 ? pattern.find("{e}") : std::string_view::npos;
    if (at == std::string_view::npos) {
      base_.append(pattern);
      return;
    }
    base_.append(pattern.substr(0, at));
    char digits[24];
    const auto [end, error] = std::to_chars(digits, digits + sizeof(digits), expert);
    base_.append(digits, end);
    base_.append(pattern.substr(at + 3));
  }
  // Adds `base + suffix` (suffix "" for a bare Parameter).
  void Param(std::string_view suffix, std::vector<int64_t> shape, TensorTraits traits,
             std::string tied_to = "") {
    if (status_.ok()) status_ = out_->Add(Name(suffix), std::move(shape), dtype_, tied_to, traits);
  }
  void Buffer(std::string_view suffix, std::vector<int64_t> shape, DType dtype = DType::kF32) {
    if (status_.ok()) status_ = out_->AddBuffer(Name(suffix), std::move(shape), dtype);
  }
  const Status& status() const { return status_; }

 private:
  std::string Name(std::string_view suffix) const {
    std::string name;
    name.reserve(base_.size() + suffix.size());
    name.append(base_).append(suffix);
    return name;
  }

  ModelInventory* out_;
  DType dtype_;
  Status status_;
  std::string base_;
};

// The layer types present, for Gemma-3's per-type rotary tables.
struct LayerContext {
  std::set<std::string> attention_types;  // "full_attention", "sliding_attention"
};

// The role of a part (Note [Tensor roles]): its own, or what its kind says for the kinds whose
// role the builder knows (embeddings by their rows, norms, patch convolutions).
TensorRole RoleOf(const Part& p, TensorRole fallback) {
  if (p.role != TensorRole::kUnknown) return p.role;
  switch (p.kind) {
    case Kind::kEmbedding:
      return p.a == W::kVocab                                  ? TensorRole::kEmbedding
             : p.a == W::kPositions || p.a == W::kPositionsOpt ? TensorRole::kPositionEmbedding
             : p.a == W::kPatches || p.a == W::kPatchesPlusOne ? TensorRole::kPositionEmbedding
                                                               : fallback;
    case Kind::kNorm: return TensorRole::kNorm;
    case Kind::kConv2d: return TensorRole::kPatchEmbedding;
    default: return fallback;
  }
}

// `fallback`: the role of parts that name none (a task head's Linears: kClassifier).
void EmitPart(const Part& p, const std::string& prefix, int64_t expert, const Values& v,
              const LayerContext& ctx, Sink* sink, TensorRole fallback = TensorRole::kUnknown) {
  sink->Begin(prefix, p.name, expert);
  const TensorRole role = RoleOf(p, fallback);
  auto traits = [role](ModuleKind kind, bool bias) { return TensorTraits{role, kind, bias}; };
  switch (p.kind) {
    case Kind::kLinear:
      sink->Param(".weight", {Width(p.b, v), Width(p.a, v)}, traits(ModuleKind::kLinear, false));
      if (Holds(p.bias, v)) {
        sink->Param(".bias", {Width(p.b, v)}, traits(ModuleKind::kLinear, true));
      }
      break;
    case Kind::kConv1D:
      sink->Param(".weight", {Width(p.a, v), Width(p.b, v)}, traits(ModuleKind::kConv1D, false));
      sink->Param(".bias", {Width(p.b, v)}, traits(ModuleKind::kConv1D, true));
      break;
    case Kind::kEmbedding:
      sink->Param(".weight", {Width(p.a, v), Width(p.b, v)}, traits(ModuleKind::kEmbedding, false));
      break;
    case Kind::kNorm:
      // A norm over [heads, head_dim] has a 2-D weight (Cohere's q_norm and k_norm).
      sink->Param(".weight",
                  p.b == W::kNone ? std::vector<int64_t>{Width(p.a, v)}
                                  : std::vector<int64_t>{Width(p.a, v), Width(p.b, v)},
                  traits(ModuleKind::kNorm, false));
      if (Holds(p.bias, v)) sink->Param(".bias", {Width(p.a, v)}, traits(ModuleKind::kNorm, true));
      break;
    case Kind::kParam:
      sink->Param("", Shape(p, v), traits(ModuleKind::kOther, Holds(p.bias, v)));
      break;
    case Kind::kBuffer: sink->Buffer("", Shape(p, v)); break;
    case Kind::kIdsBuffer: sink->Buffer("", Shape(p, v), DType::kI64); break;
    case Kind::kMaskBuffer: sink->Buffer("", Shape(p, v), DType::kBool); break;
    case Kind::kConv2d: {
      const int64_t patch = v.Get(Dim::kPatchSize);
      sink->Param(".weight", {Width(p.b, v), Width(p.a, v), patch, patch},
                  traits(ModuleKind::kConv2d, false));
      if (Holds(p.bias, v)) {
        sink->Param(".bias", {Width(p.b, v)}, traits(ModuleKind::kConv2d, true));
      }
      break;
    }
    case Kind::kRotaryPerLayerType:
      for (const std::string& type : ctx.attention_types) {
        sink->Buffer("." + type + "_inv_freq", {RotaryHalf(v)});
        sink->Buffer("." + type + "_original_inv_freq", {RotaryHalf(v)});
      }
      break;
    case Kind::kPerExpert:
    case Kind::kInclude: break;  // handled by EmitParts
  }
}

void EmitParts(std::span<const Part> parts, const std::string& prefix, const Values& v,
               const LayerContext& ctx, Sink* sink, TensorRole fallback = TensorRole::kUnknown) {
  for (size_t i = 0; i < parts.size(); ++i) {
    const Part& p = parts[i];
    if (p.kind == Kind::kPerExpert) {
      const size_t n = std::min(static_cast<size_t>(p.group), parts.size() - i - 1);
      if (Holds(p.when, v)) {
        for (int64_t e = 0; e < Width(p.a, v); ++e) {
          for (size_t j = 1; j <= n; ++j) {
            if (Holds(parts[i + j].when, v)) {
              EmitPart(parts[i + j], prefix, e, v, ctx, sink, fallback);
            }
          }
        }
      }
      i += n;
      continue;
    }
    if (!Holds(p.when, v)) continue;
    if (p.kind == Kind::kInclude) {
      EmitParts(p.include, prefix, v, ctx, sink, fallback);
    } else {
      EmitPart(p, prefix, -1, v, ctx, sink, fallback);
    }
  }
}

// Upper bound on the tensors one layer emits (two per part, experts expanded).
int64_t TensorsPerLayer(std::span<const Part> parts, const Values& v) {
  int64_t n = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    if (parts[i].kind == Kind::kPerExpert) {
      n += 2 * parts[i].group * std::max<int64_t>(Width(parts[i].a, v), 1);
      i += static_cast<size_t>(parts[i].group);
    } else if (parts[i].kind == Kind::kInclude) {
      n += TensorsPerLayer(parts[i].include, v);
    } else {
      n += 2;
    }
  }
  return n;
}

// Whether the block's norms are RMS norms (no bias), which in these families (LlamaRMSNorm and its
// copies) upcast their input to fp32: true when every norm the block has is bias-free.
bool RmsNorms(std::span<const Part> parts, const Values& v, bool* any) {
  for (const Part& p : parts) {
    if (!Holds(p.when, v)) continue;
    if (p.kind == Kind::kInclude && !RmsNorms(p.include, v, any)) return false;
    if (p.kind == Kind::kNorm) {
      if (Holds(p.bias, v)) return false;
      *any = true;
    }
  }
  return true;
}

// mlp_only_layers: the layers Qwen-MoE keeps dense.
Result<std::set<int64_t>> MlpOnlyLayers(const ConfigReader& config) {
  std::set<int64_t> out;
  if (!config.Has("mlp_only_layers")) return out;
  const nlohmann::json& list = config.json()["mlp_only_layers"];
  if (!list.is_array()) return config.FieldError("mlp_only_layers", "must be a list of layers");
  for (const auto& item : list) {
    if (!item.is_number_integer() || item.get<int64_t>() < 0) {
      return config.FieldError("mlp_only_layers", "must list layer indices (integers >= 0)");
    }
    out.insert(item.get<int64_t>());
  }
  return out;
}

bool MoeLayer(const FamilySpec& spec, const Values& v, const std::set<int64_t>& mlp_only,
              int64_t i) {
  switch (spec.moe) {
    case MoePlacement::kNone: return false;
    case MoePlacement::kEveryLayer: return true;
    case MoePlacement::kSparseStep: {
      const int64_t step = std::max<int64_t>(v.Get(Dim::kSparseStep), 1);
      return mlp_only.count(i) == 0 && v.Get(Dim::kExperts) > 0 && (i + 1) % step == 0;
    }
    case MoePlacement::kAfterDense: return i >= v.Get(Dim::kFirstDense);
  }
  return false;
}

// Which layers apply no rotary embedding (FamilySpec::nope_layers; empty when all do), as
// SmolLM3Config fills no_rope_layers.
Result<std::vector<bool>> NopeLayers(const FamilySpec& spec, const ConfigReader& config,
                                     const Values& v) {
  const int64_t layers = v.Get(Dim::kLayers);
  if (!spec.nope_layers) return std::vector<bool>{};
  std::vector<bool> nope(static_cast<size_t>(layers), false);
  if (config.Has("no_rope_layers") && !config.json()["no_rope_layers"].is_null()) {
    const nlohmann::json& list = config.json()["no_rope_layers"];
    // "at least the same length as the number of layers" (SmolLM3Config's docstring).
    if (!list.is_array() || static_cast<int64_t>(list.size()) < layers) {
      return config.FieldError("no_rope_layers", "must list 1 (RoPE) or 0 (NoPE) for each of the " +
                                                     std::to_string(layers) + " layers");
    }
    for (size_t i = 0; i < nope.size(); ++i) {
      const nlohmann::json& x = list[i];
      if (!x.is_number_integer() && !x.is_boolean()) {
        return config.FieldError("no_rope_layers", "must be a list of 1 (RoPE) or 0 (NoPE)");
      }
      nope[i] = x.is_boolean() ? !x.get<bool>() : x.get<int64_t>() == 0;
    }
    return nope;
  }
  MEMPLAN_ASSIGN_OR_RETURN(int64_t interval, config.DimOr("no_rope_layer_interval", 4));
  for (int64_t i = 0; i < layers; ++i) nope[static_cast<size_t>(i)] = (i + 1) % interval == 0;
  return nope;
}

// Which layers attend within the sliding window: config.json's `layer_types` when present, else
// the family's rule (the one its configuration class applies).
Result<std::vector<bool>> SlidingLayers(const FamilySpec& spec, const ConfigReader& config,
                                        const Values& v) {
  const int64_t layers = v.Get(Dim::kLayers);
  std::vector<bool> sliding(static_cast<size_t>(layers), false);
  if (config.Has("layer_types")) {
    const nlohmann::json& types = config.json()["layer_types"];
    if (!types.is_array() || static_cast<int64_t>(types.size()) != layers) {
      return config.FieldError(
          "layer_types", "must list one attention type per layer (" + std::to_string(layers) + ")");
    }
    for (size_t i = 0; i < types.size(); ++i) {
      if (!types[i].is_string()) {
        return config.FieldError("layer_types", "must be a list of strings");
      }
      sliding[i] = types[i].get<std::string>() == "sliding_attention";
    }
    return sliding;
  }
  const bool use = v.Is(Flag::kUseSlidingWindow);
  MEMPLAN_ASSIGN_OR_RETURN(std::vector<bool> nope, NopeLayers(spec, config, v));
  for (int64_t i = 0; i < layers; ++i) {
    bool s = false;
    switch (spec.sliding) {
      case SlidingRule::kNone: break;
      case SlidingRule::kEveryLayer: s = v.Get(Dim::kSlidingWindow) > 0; break;
      case SlidingRule::kEveryLayerIfUsed: s = use && v.Get(Dim::kSlidingWindow) > 0; break;
      case SlidingRule::kAlternate: s = (i + 1) % 2 != 0; break;
      case SlidingRule::kPattern: {
        const int64_t pattern = std::max<int64_t>(v.Get(Dim::kSlidingPattern), 1);
        s = (i + 1) % pattern != 0;
        break;
      }
      case SlidingRule::kQwen:
        s = use && v.Get(Dim::kSlidingWindow) > 0 && i >= v.Get(Dim::kMaxWindowLayers);
        break;
      case SlidingRule::kQwen2Moe:
        s = use && (i + 1) % 2 != 0 && i < v.Get(Dim::kMaxWindowLayers);
        break;
      case SlidingRule::kOlmo3: s = (i + 1) % 4 != 0; break;
      case SlidingRule::kNopeIfUsed:
        s = use && v.Get(Dim::kSlidingWindow) > 0 && !nope.empty() && nope[static_cast<size_t>(i)];
        break;
    }
    sliding[static_cast<size_t>(i)] = s;
  }
  return sliding;
}

std::string ClassName(std::string_view prefix, std::string_view suffix) {
  return std::string(prefix) + std::string(suffix);
}

}  // namespace

namespace {

// The multi-token-prediction modules a DeepSeek-V3 checkpoint carries beyond the built layers:
// one more MoE decoder layer with its own embedding, two norms, a 2h -> h projection and a head.
Result<uint64_t> MtpParams(const FamilySpec& spec, const Values& v, const LayerContext& ctx,
                           DType dtype) {
  if (!spec.mtp || v.Get(Dim::kMtpLayers) <= 0) return uint64_t{0};
  ModelInventory scratch;
  Sink mtp(&scratch, dtype);
  Values layer = v;
  layer.Set(Flag::kMoeLayer, spec.moe != MoePlacement::kNone);
  layer.Set(Flag::kDenseLayer, spec.moe == MoePlacement::kNone);
  EmitParts(spec.layer, "mtp.", layer, ctx, &mtp);
  MEMPLAN_RETURN_IF_ERROR(mtp.status());
  const uint64_t h = static_cast<uint64_t>(v.Get(Dim::kHidden));
  uint64_t per = 2 * static_cast<uint64_t>(v.Get(Dim::kVocab)) * h + 3 * h + 2 * h * h;
  for (const TensorInfo& t : scratch.tensors) per += t.numel;
  return per * static_cast<uint64_t>(v.Get(Dim::kMtpLayers));
}

// The architecture facts of the built model (ArchitectureInfo), from the family's spec and the
// config's values: what the activations, the step model and the planner read.
Result<ArchitectureInfo> ArchitectureOf(const FamilySpec& spec, const ConfigReader& config,
                                        const Values& v, const std::vector<bool>& sliding,
                                        int64_t moe_layers, uint64_t mtp_params) {
  const int64_t layers = v.Get(Dim::kLayers);
  ArchitectureInfo arch;
  arch.hidden = v.Get(Dim::kHidden);
  arch.layers = layers;
  arch.heads = v.Get(Dim::kHeads);
  arch.kv_heads = v.Get(Dim::kKvHeads);
  arch.head_dim = v.Get(Dim::kHeadDim);
  arch.vocab = v.Get(Dim::kVocab);
  arch.max_positions = v.Get(Dim::kPositions);
  arch.learned_positions = spec.learned_positions || v.Is(Flag::kLearnedPositions);
  arch.gated_mlp = spec.gated_mlp || v.Is(Flag::kGatedMlp);
  arch.intermediate = v.Get(Dim::kIntermediate);
  if (spec.moe != MoePlacement::kNone && moe_layers > 0) {
    arch.experts = v.Get(Dim::kExperts);
    arch.experts_per_token = v.Get(Dim::kTopK);
    arch.moe_layers = moe_layers;
    if (v.Get(Dim::kMoeIntermediate) > 0) {
      arch.intermediate = v.Get(Dim::kMoeIntermediate);
      if (moe_layers < layers) arch.dense_intermediate = v.Get(Dim::kIntermediate);
    }
    arch.shared_intermediate = Width(W::kSharedFfn, v);
  }
  if (spec.mla) {
    arch.q_lora_rank = v.Get(Dim::kQLoraRank);
    arch.kv_lora_rank = v.Get(Dim::kKvLoraRank);
    arch.qk_nope_head_dim = v.Get(Dim::kQkNopeHeadDim);
    arch.qk_rope_head_dim = v.Get(Dim::kQkRopeHeadDim);
    arch.v_head_dim = v.Get(Dim::kVHeadDim);
    arch.head_dim = arch.qk_nope_head_dim + arch.qk_rope_head_dim;
    arch.kv_heads = arch.heads;
  }
  if (std::find(sliding.begin(), sliding.end(), true) != sliding.end() &&
      v.Get(Dim::kSlidingWindow) > 0) {
    arch.sliding_window = v.Get(Dim::kSlidingWindow);
    arch.sliding_layers = sliding;
  }
  MEMPLAN_ASSIGN_OR_RETURN(std::vector<bool> nope, NopeLayers(spec, config, v));
  if (spec.nope_full_layers) {
    // Cohere2Attention rotates where its sliding_window is set: a sliding layer of a config
    // with a window; Exaone4Attention also where the config has no window at all.
    const bool window = v.Get(Dim::kSlidingWindow) > 0;
    nope.assign(sliding.size(), false);
    for (size_t i = 0; i < sliding.size(); ++i) {
      nope[i] = window ? !sliding[i] : !spec.rope_without_window;
    }
  }
  if (std::find(nope.begin(), nope.end(), true) != nope.end()) arch.nope_layers = nope;
  arch.attention_sinks = spec.attention_sinks;
  arch.causal = true;  // every family of this builder is a decoder-only model
  if (v.Is(Flag::kNewDecoderArch)) arch.cached_kv_heads = arch.heads;
  arch.parallel_attention = spec.parallel_attention || v.Is(Flag::kParallelAttn);
  arch.mtp_layers = spec.mtp ? v.Get(Dim::kMtpLayers) : 0;
  arch.mtp_params = mtp_params;
  bool any_norm = false;
  arch.norm_upcasts = !spec.layer_norm && RmsNorms(spec.layer, v, &any_norm) && any_norm;
  MEMPLAN_ASSIGN_OR_RETURN(arch.use_cache, config.BoolOr("use_cache", spec.use_cache_default));
  arch.alibi = spec.alibi || v.Is(Flag::kAlibi);
  if (spec.softcapping) {
    // null means no capping (Gemma-3's default), an absent field the class's default.
    auto cap = [&](const char* field, double fallback) -> Result<double> {
      if (config.json().contains(field) && config.json()[field].is_null()) return 0.0;
      MEMPLAN_ASSIGN_OR_RETURN(double c, config.NumberOr(field, fallback));
      if (!(c >= 0) || c > 1e9) return config.FieldError(field, "must be a positive number");
      return c;
    };
    MEMPLAN_ASSIGN_OR_RETURN(arch.attn_softcap,
                             cap("attn_logit_softcapping", spec.attn_softcap_default));
    MEMPLAN_ASSIGN_OR_RETURN(arch.final_softcap,
                             cap("final_logit_softcapping", spec.final_softcap_default));
  }
  if (spec.rotary && !arch.alibi) {
    arch.rotary_dims = v.Get(Dim::kRotaryDim) > 0 ? v.Get(Dim::kRotaryDim) : 2 * RotaryHalf(v);
    if (spec.mla) arch.rotary_dims = v.Get(Dim::kQkRopeHeadDim);
    for (const char* nested : {"rope_scaling", "rope_parameters"}) {
      if (!config.Has(nested) || !config.json()[nested].is_object()) continue;
      const nlohmann::json& rope = config.json()[nested];
      for (const char* key : {"rope_type", "type"}) {
        auto it = rope.find(key);
        if (it != rope.end() && it->is_string() && arch.rope_type.empty()) {
          arch.rope_type = it->get<std::string>().substr(0, 64);
        }
      }
    }
    if (arch.rope_type == "default") arch.rope_type.clear();
  }
  arch.no_split_class = spec.no_split_class.empty() ? ClassName(spec.class_prefix, "DecoderLayer")
                                                    : std::string(spec.no_split_class);
  MEMPLAN_ASSIGN_OR_RETURN(arch.hidden_act,
                           config.StringOr(spec.act_field, std::string(spec.act_default)));
  if (!spec.act_alias.empty() && config.Has(spec.act_alias)) {
    MEMPLAN_ASSIGN_OR_RETURN(arch.hidden_act, config.StringOr(spec.act_alias, ""));
  }
  arch.attention_impl = v.attention_impl;
  arch.norm_type = v.norm_type;
  arch.block_options = v.block_options;
  arch.clip_qkv = v.clip_qkv;
  if (spec.mla && spec.model_type == "deepseek_v2") {
    // DeepseekV2Moe's routing: "greedy" (V2-Lite) or "group_limited_greedy" (V2), whose group
    // mask the step model does not run (it refuses a block option it does not know).
    MEMPLAN_ASSIGN_OR_RETURN(std::string topk, config.StringOr("topk_method", "greedy"));
    if (topk != "greedy") arch.block_options.push_back("topk_method " + topk);
  }
  if (spec.model_type == "glm4_moe") {
    // Glm4MoeTopkRouter is DeepSeek-V3's: norm_topk_prob on by default.
    MEMPLAN_ASSIGN_OR_RETURN(arch.norm_topk_prob, config.BoolOr("norm_topk_prob", true));
  }
  if (spec.mla && spec.model_type == "deepseek_v3") {
    // DeepseekV3TopkRouter (Transformers 5) scores with a sigmoid whatever scoring_func and
    // topk_method say; what changes its ops is norm_topk_prob, and the rotation's layout.
    MEMPLAN_ASSIGN_OR_RETURN(arch.norm_topk_prob, config.BoolOr("norm_topk_prob", true));
    MEMPLAN_ASSIGN_OR_RETURN(arch.rope_interleave, config.BoolOr("rope_interleave", true));
  }
  if (spec.model_type == "qwen2_moe" || spec.model_type == "qwen3_moe" ||
      spec.model_type == "olmoe") {
    // Their TopKRouter divides the top-k weights by their sum only when norm_topk_prob (off by
    // default); Mixtral's always does.
    MEMPLAN_ASSIGN_OR_RETURN(arch.norm_topk_prob, config.BoolOr("norm_topk_prob", false));
  }
  if (v.attention_dropout >= 0) {
    arch.attention_dropout = v.attention_dropout;
  } else if (!spec.attention_dropout_field.empty()) {
    MEMPLAN_ASSIGN_OR_RETURN(
        arch.attention_dropout,
        config.ProbabilityOr(spec.attention_dropout_field, spec.attention_dropout_default));
  }
  if (!spec.hidden_dropout_field.empty()) {
    MEMPLAN_ASSIGN_OR_RETURN(
        arch.hidden_dropout,
        config.ProbabilityOr(spec.hidden_dropout_field, spec.hidden_dropout_default));
  }
  if (!spec.embedding_dropout_field.empty()) {
    MEMPLAN_ASSIGN_OR_RETURN(
        arch.embedding_dropout,
        config.ProbabilityOr(spec.embedding_dropout_field, spec.embedding_dropout_default));
  }
  // The token classifiers' dropout (GenericForTokenClassification and the families' own):
  // classifier_dropout, else hidden_dropout, else 0.1.
  arch.classifier_dropout = 0.1;
  for (const char* field : {"classifier_dropout", "hidden_dropout"}) {
    if (config.Has(field)) {
      MEMPLAN_ASSIGN_OR_RETURN(arch.classifier_dropout, config.ProbabilityOr(field, 0.1));
      break;
    }
  }
  return arch;
}

}  // namespace

Status Build(const FamilySpec& spec, const FamilyRequest& request, ModelInventory* out) {
  const ConfigReader& config = request.config;
  // The class: base, causal LM, or one of the task heads.
  const std::string base_class = spec.base_class.empty() ? ClassName(spec.class_prefix, "Model")
                                                         : std::string(spec.base_class);
  const std::string causal_class = spec.causal_class.empty()
                                       ? ClassName(spec.class_prefix, "ForCausalLM")
                                       : std::string(spec.causal_class);
  const HeadSpec* head = nullptr;
  bool base = request.choice == ModelClassChoice::kBase || request.architecture == base_class;
  const bool remote_causal =
      !spec.remote_causal_class.empty() && request.architecture == spec.remote_causal_class;
  if (!base && !request.architecture.empty() && request.architecture != causal_class &&
      !remote_causal) {
    for (const HeadSpec& h : spec.heads) {
      if (request.architecture == ClassName(spec.class_prefix, h.suffix)) head = &h;
    }
    if (head == nullptr) {
      std::string supported = causal_class + ", " + base_class;
      for (const HeadSpec& h : spec.heads)
        supported += ", " + ClassName(spec.class_prefix, h.suffix);
      return config.FieldError("architectures",
                               "'" + request.architecture +
                                   "' is not a class memplan can build for this model_type "
                                   "(supported: " +
                                   supported +
                                   "); pass `model_class` base to size the base model without "
                                   "its task head");
    }
  }
  MEMPLAN_ASSIGN_OR_RETURN(Values v, ReadValues(spec, request));
  MEMPLAN_ASSIGN_OR_RETURN(DType dtype, ConfigDType(config));
  // The limits first: nothing per layer or per expert is built (not even a flag per layer) for a
  // config that asks for billions of them.
  const int64_t layers = v.Get(Dim::kLayers);
  if (v.Get(Dim::kExperts) > kMaxTensors / 8) {
    return config.FieldError(v.Field(Dim::kExperts),
                             std::to_string(v.Get(Dim::kExperts)) +
                                 " experts would exceed memplan's limit of " +
                                 std::to_string(kMaxTensors) + " tensors per model");
  }
  const int64_t per_layer = std::max<int64_t>(TensorsPerLayer(spec.layer, v), 1);
  if (layers > (kMaxTensors - 64) / per_layer) {
    return config.FieldError(
        v.Field(Dim::kLayers),
        std::to_string(layers) + " layers of up to " + std::to_string(per_layer) +
            " tensors each would exceed memplan's limit of " + std::to_string(kMaxTensors) +
            " tensors per model (no published model comes close)");
  }
  MEMPLAN_ASSIGN_OR_RETURN(std::set<int64_t> mlp_only, MlpOnlyLayers(config));
  MEMPLAN_ASSIGN_OR_RETURN(std::vector<bool> sliding, SlidingLayers(spec, config, v));

  std::string prefix = request.within;
  if (base) {
    out->architecture = base_class;
    out->model_class = "base";
  } else if (head != nullptr) {
    out->architecture = ClassName(spec.class_prefix, head->suffix);
    out->model_class = head->kind == HeadKind::kSequence ? "sequence_classification"
                       : head->kind == HeadKind::kToken  ? "token_classification"
                                                         : "question_answering";
    prefix += std::string(head->prefix) + ".";
  } else {
    out->architecture = causal_class;
    out->model_class = "causal_lm";
    prefix += std::string(spec.prefix) + ".";
  }

  LayerContext ctx;
  for (bool s : sliding) ctx.attention_types.insert(s ? "sliding_attention" : "full_attention");
  // Sized up front: a per-expert DeepSeek-V3 has 45,000 tensors, moved many times otherwise.
  out->tensors.reserve(static_cast<size_t>(layers * per_layer / 2 + 64));
  Sink sink(out, dtype);
  EmitParts(spec.before, prefix, v, ctx, &sink);
  int64_t moe_layers = 0;
  for (int64_t i = 0; i < layers; ++i) {
    const bool moe = MoeLayer(spec, v, mlp_only, i);
    moe_layers += moe ? 1 : 0;
    Values layer = v;
    layer.Set(Flag::kMoeLayer, moe);
    layer.Set(Flag::kDenseLayer, !moe);
    const std::string path = prefix + std::string(spec.layers) + "." + std::to_string(i);
    out->no_split_modules.push_back(path);
    EmitParts(spec.layer, path + ".", layer, ctx, &sink);
  }
  EmitParts(spec.after, prefix, v, ctx, &sink);
  for (std::string_view part : spec.no_split_parts) {
    const std::string path = prefix + std::string(part);
    for (const TensorInfo& t : out->tensors) {
      if (t.name.size() > path.size() && t.name.compare(0, path.size(), path) == 0 &&
          t.name[path.size()] == '.') {
        out->no_split_modules.push_back(path);
        break;
      }
    }
  }
  if (!base && head == nullptr) {
    const Part& lm = spec.lm_head;
    sink.Begin(request.within, lm.name, -1);
    sink.Param(".weight", {Width(lm.b, v), Width(lm.a, v)},
               {TensorRole::kHead, ModuleKind::kLinear, false},
               v.Is(Flag::kTie) ? prefix + std::string(spec.tied_embedding) : "");
    if (Holds(lm.bias, v)) {
      sink.Param(".bias", {Width(lm.b, v)}, {TensorRole::kHead, ModuleKind::kLinear, true});
    }
  } else if (head != nullptr) {
    EmitParts(head->parts, request.within, v, ctx, &sink, TensorRole::kClassifier);
  }
  MEMPLAN_RETURN_IF_ERROR(sink.status());

  MEMPLAN_ASSIGN_OR_RETURN(const uint64_t mtp_params, MtpParams(spec, v, ctx, dtype));
  MEMPLAN_ASSIGN_OR_RETURN(out->arch,
                           ArchitectureOf(spec, config, v, sliding, moe_layers, mtp_params));
  return Status::Ok();
}

namespace {

// The JSON of sub-model `sub` as its configuration class would complete it: its model_type
// (the composite's default when absent), the class defaults of the size fields it leaves out,
// and the composite's dtype (the whole model is built in one).
Result<nlohmann::json> SubConfigJson(const ConfigReader& config, const SubConfig& sub) {
  const nlohmann::json& top = config.json();
  nlohmann::json out = nlohmann::json::object();
  const bool absent = !config.Has(sub.field);
  if (!absent) {
    if (!top[std::string(sub.field)].is_object()) {
      return config.FieldError(sub.field, "must be an object (the sub-model's config)");
    }
    out = top[std::string(sub.field)];
  }
  if (!out.contains("model_type") || out["model_type"].is_null()) {
    out["model_type"] = std::string(sub.default_type);
  }
  if (!out["model_type"].is_string()) {
    return config.FieldError(sub.field, "its model_type must be a string");
  }
  const std::string type = out["model_type"].get<std::string>();
  for (const SubConfigDefault& d : absent ? sub.when_absent : sub.defaults) {
    if (d.model_type == type && (!out.contains(d.field) || out[std::string(d.field)].is_null())) {
      out[std::string(d.field)] = d.value;
    }
  }
  for (const char* dtype : {"dtype", "torch_dtype"}) {
    if (top.contains(dtype) && !top[dtype].is_null()) {
      out.erase("dtype");
      out.erase("torch_dtype");
      out[dtype] = top[dtype];
      break;
    }
  }
  return out;
}

// What building a sub-model gave: its family, the width of its hidden states, and whether its
// config ties its embeddings.
struct SubModel {
  const FamilySpec* spec = nullptr;
  int64_t hidden = 0;
  bool tie = false;
};

// Builds sub-model `sub` of `config` (its base model) under `within`.
Result<SubModel> BuildSub(const ConfigReader& config, const SubConfig& sub,
                          std::span<const FamilySpec* const> families, const std::string& within,
                          ExpertLayout experts, ModelInventory* out) {
  MEMPLAN_ASSIGN_OR_RETURN(nlohmann::json json, SubConfigJson(config, sub));
  const std::string type = json["model_type"].get<std::string>();
  SubModel built;
  std::string known;
  for (const FamilySpec* f : families) {
    if (f->model_type == type) built.spec = f;
    known += (known.empty() ? "" : ", ") + std::string(f->model_type);
  }
  if (built.spec == nullptr) {
    return config.FieldError(
        sub.field,
        "model_type '" + type + "' is not one memplan builds here (supported: " + known + ")");
  }
  ConfigReader reader(json, config.source() + " (" + std::string(sub.field) + ")");
  FamilyRequest request{reader, ModelClassChoice::kBase, "", experts, within};
  MEMPLAN_RETURN_IF_ERROR(Build(*built.spec, request, out));
  built.hidden = out->arch->hidden;
  for (const FlagField& f : built.spec->flags) {
    if (f.flag == Flag::kTie && !f.field.empty()) {
      MEMPLAN_ASSIGN_OR_RETURN(built.tie, reader.BoolOr(f.field, f.value));
    }
  }
  return built;
}

}  // namespace

Status BuildComposite(const CompositeSpec& spec, const FamilyRequest& request,
                      ModelInventory* out) {
  const ConfigReader& config = request.config;
  const std::string base_class = std::string(spec.class_prefix) + "Model";
  const HeadSpec* head = nullptr;
  const bool base = request.choice == ModelClassChoice::kBase || request.architecture == base_class;
  if (!base && !request.architecture.empty() && request.architecture != spec.causal_class) {
    for (const HeadSpec& h : spec.heads) {
      if (request.architecture == ClassName(spec.class_prefix, h.suffix)) head = &h;
    }
    if (head == nullptr) {
      std::string supported = std::string(spec.causal_class) + ", " + base_class;
      for (const HeadSpec& h : spec.heads) {
        supported += ", " + ClassName(spec.class_prefix, h.suffix);
      }
      return config.FieldError("architectures",
                               "'" + request.architecture +
                                   "' is not a class memplan can build for this model_type "
                                   "(supported: " +
                                   supported +
                                   "); pass `model_class` base to size the base model without "
                                   "its task head");
    }
  }
  // The composite's own sizes and switches, read as the families read theirs.
  Values v;
  for (const DimField& f : spec.dims) MEMPLAN_RETURN_IF_ERROR(ReadDim(config, f, &v));
  v.Set(Flag::kAlways, true);
  for (const FlagField& f : spec.flags) {
    bool b = f.value;
    if (!f.field.empty()) {
      MEMPLAN_ASSIGN_OR_RETURN(b, config.BoolOr(f.field, f.value));
    }
    v.Set(f.flag, b);
  }
  MEMPLAN_ASSIGN_OR_RETURN(v.labels, NumLabels(config));
  MEMPLAN_ASSIGN_OR_RETURN(DType dtype, ConfigDType(config));
  // Llava's vision_feature_layer: one layer (an index) or several (a list), concatenated.
  int64_t feature_layers = 1;
  if (config.Has("vision_feature_layer") && config.json()["vision_feature_layer"].is_array()) {
    feature_layers = static_cast<int64_t>(config.json()["vision_feature_layer"].size());
    if (feature_layers == 0) {
      return config.FieldError("vision_feature_layer", "must name at least one layer");
    }
  }
  v.Set(Dim::kFeatureLayers, feature_layers);

  // Registered as vision tower, projector, language model; the projector needs both widths, so
  // the language model is built first, aside, and appended after it.
  const std::string prefix =
      request.within +
      (base ? std::string() : std::string(head != nullptr ? head->prefix : "model") + ".");
  ModelInventory text;
  MEMPLAN_ASSIGN_OR_RETURN(
      SubModel language,
      BuildSub(config, spec.text, Families(), prefix + "language_model.", request.experts, &text));
  MEMPLAN_ASSIGN_OR_RETURN(SubModel vision,
                           BuildSub(config, spec.vision, VisionTowers(), prefix + "vision_tower.",
                                    request.experts, out));
  const int64_t vision_layers = out->arch->layers;
  v.Set(Dim::kHidden, language.hidden);
  v.Set(Dim::kVisionHidden, vision.hidden);
  v.Set(Dim::kVocab, text.arch->vocab);
  LayerContext ctx;
  Sink sink(out, dtype);
  EmitParts(spec.projector, prefix, v, ctx, &sink);
  MEMPLAN_RETURN_IF_ERROR(sink.status());
  out->tensors.insert(out->tensors.end(), std::make_move_iterator(text.tensors.begin()),
                      std::make_move_iterator(text.tensors.end()));
  out->buffers.insert(out->buffers.end(), std::make_move_iterator(text.buffers.begin()),
                      std::make_move_iterator(text.buffers.end()));
  out->no_split_modules.insert(out->no_split_modules.end(), text.no_split_modules.begin(),
                               text.no_split_modules.end());
  if (base) {
    out->architecture = base_class;
    out->model_class = "base";
  } else if (head != nullptr) {
    out->architecture = ClassName(spec.class_prefix, head->suffix);
    out->model_class = "sequence_classification";
    EmitParts(head->parts, request.within, v, ctx, &sink, TensorRole::kClassifier);
  } else {
    out->architecture = std::string(spec.causal_class);
    out->model_class = "causal_lm";
    MEMPLAN_ASSIGN_OR_RETURN(bool tie, config.BoolOr("tie_word_embeddings", spec.tie_default));
    if (spec.tie_from_text && language.tie) tie = true;
    sink.Begin(request.within, "lm_head", -1);
    sink.Param(".weight", {v.Get(Dim::kVocab), language.hidden},
               {TensorRole::kHead, ModuleKind::kLinear, false},
               tie ? prefix + "language_model." + std::string(language.spec->tied_embedding) : "");
  }
  MEMPLAN_RETURN_IF_ERROR(sink.status());
  out->arch = text.arch;
  out->notes.push_back("Activations are the language model's; the vision tower's (" +
                       std::to_string(vision_layers) +
                       " layers over each image's patches) are not modelled");
  return Status::Ok();
}

}  // namespace memplan::estimator::family
