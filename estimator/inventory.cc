#include "estimator/inventory.h"

#include <algorithm>
#include <bit>
#include <cctype>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <map>
#include <string_view>
#include <unordered_map>
#include <unordered_set>

#include "common/strings.h"
#include "common/checked_math.h"

namespace memplan::estimator {

std::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF64: return "F64";
    case DType::kF32: return "F32";
    case DType::kF16: return "F16";
    case DType::kBF16: return "BF16";
    case DType::kF8E4M3: return "F8_E4M3";
    case DType::kF8E5M2: return "F8_E5M2";
    case DType::kI64: return "I64";
    case DType::kI32: return "I32";
    case DType::kI16: return "I16";
    case DType::kI8: return "I8";
    case DType::kU8: return "U8";
    case DType::kBool: return "BOOL";
  }
  return "?";
}

int DTypeBits(DType dtype) {
  switch (dtype) {
    case DType::kF64:
    case DType::kI64: return 64;
    case DType::kF32:
    case DType::kI32: return 32;
    case DType::kF16:
    case DType::kBF16:
    case DType::kI16: return 16;
    case DType::kF8E4M3:
    case DType::kF8E5M2:
    case DType::kI8:
    case DType::kU8:
    case DType::kBool: return 8;
  }
  return 0;
}

Result<DType> ParseDType(std::string_view text) {
  std::string s;
  for (char c : text) s.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
  if (s.rfind("torch.", 0) == 0) s = s.substr(6);
  static const std::map<std::string, DType, std::less<>> kNames = {
      {"f64", DType::kF64},        {"float64", DType::kF64},
      {"double", DType::kF64},     {"fp64", DType::kF64},
      {"f32", DType::kF32},        {"float32", DType::kF32},
      {"float", DType::kF32},      {"fp32", DType::kF32},
      {"f16", DType::kF16},        {"float16", DType::kF16},
      {"half", DType::kF16},       {"fp16", DType::kF16},
      {"bf16", DType::kBF16},      {"bfloat16", DType::kBF16},
      {"f8_e4m3", DType::kF8E4M3}, {"float8_e4m3fn", DType::kF8E4M3},
      {"f8_e5m2", DType::kF8E5M2}, {"float8_e5m2", DType::kF8E5M2},
      {"i64", DType::kI64},        {"int64", DType::kI64},
      {"long", DType::kI64},       {"i32", DType::kI32},
      {"int32", DType::kI32},      {"int", DType::kI32},
      {"i16", DType::kI16},        {"int16", DType::kI16},
      {"i8", DType::kI8},          {"int8", DType::kI8},
      {"u8", DType::kU8},          {"uint8", DType::kU8},
      {"bool", DType::kBool},
  };
  auto it = kNames.find(s);
  if (it == kNames.end()) {
    return Status::InvalidArgument("unknown dtype '" + std::string(text) +
                                   "' (expected e.g. F32, BF16, F16, I8, float32, bfloat16)");
  }
  return it->second;
}

void DeriveModulePath(std::string_view name, std::string* module, std::string* block, int* layer) {
  // Only module components count; the last component is the parameter's own name.
  const std::string_view path = BeforeLastComponent(name, '.');
  *module = std::string(path);
  block->clear();
  *layer = -1;
  size_t start = 0;
  while (start < path.size()) {
    size_t end = path.find('.', start);
    if (end == std::string_view::npos) end = path.size();
    std::string_view part = path.substr(start, end - start);
    bool digits =
        !part.empty() && part.size() <= 9 &&
        std::all_of(part.begin(), part.end(), [](char c) { return c >= '0' && c <= '9'; });
    if (digits) {
      *block = std::string(name.substr(0, end));
      int index = 0;
      for (char c : part) index = index * 10 + (c - '0');  // at most 9 digits: no overflow
      *layer = index;
      return;
    }
    start = end + 1;
  }
}

std::string_view TensorRoleName(TensorRole role) {
  switch (role) {
    case TensorRole::kUnknown: return "unknown";
    case TensorRole::kEmbedding: return "embedding";
    case TensorRole::kPositionEmbedding: return "position_embedding";
    case TensorRole::kTokenTypeEmbedding: return "token_type_embedding";
    case TensorRole::kRelativeAttentionBias: return "relative_attention_bias";
    case TensorRole::kNorm: return "norm";
    case TensorRole::kAttentionQ: return "attention_q";
    case TensorRole::kAttentionK: return "attention_k";
    case TensorRole::kAttentionV: return "attention_v";
    case TensorRole::kAttentionQkv: return "attention_qkv";
    case TensorRole::kAttentionKv: return "attention_kv";
    case TensorRole::kAttentionOut: return "attention_out";
    case TensorRole::kAttentionQDown: return "attention_q_down";
    case TensorRole::kAttentionKvDown: return "attention_kv_down";
    case TensorRole::kAttentionKvUp: return "attention_kv_up";
    case TensorRole::kAttentionSinks: return "attention_sinks";
    case TensorRole::kMlpUp: return "mlp_up";
    case TensorRole::kMlpGate: return "mlp_gate";
    case TensorRole::kMlpGateUp: return "mlp_gate_up";
    case TensorRole::kMlpDown: return "mlp_down";
    case TensorRole::kRouter: return "router";
    case TensorRole::kExpertUp: return "expert_up";
    case TensorRole::kExpertGate: return "expert_gate";
    case TensorRole::kExpertGateUp: return "expert_gate_up";
    case TensorRole::kExpertDown: return "expert_down";
    case TensorRole::kSharedExpertGate: return "shared_expert_gate";
    case TensorRole::kHead: return "head";
    case TensorRole::kHeadTransform: return "head_transform";
    case TensorRole::kClassifier: return "classifier";
    case TensorRole::kPooler: return "pooler";
    case TensorRole::kPatchEmbedding: return "patch_embedding";
    case TensorRole::kProjector: return "projector";
    case TensorRole::kAdapter: return "adapter";
    case TensorRole::kOther: return "other";
  }
  return "?";
}

unsigned QkvParts(TensorRole role) {
  switch (role) {
    case TensorRole::kAttentionQ: return 1;
    case TensorRole::kAttentionK: return 2;
    case TensorRole::kAttentionV: return 4;
    case TensorRole::kAttentionKv: return 6;
    case TensorRole::kAttentionQkv: return 7;
    default: return 0;
  }
}

bool IsEmbeddingTable(TensorRole role) {
  return role == TensorRole::kEmbedding || role == TensorRole::kPositionEmbedding ||
         role == TensorRole::kTokenTypeEmbedding || role == TensorRole::kRelativeAttentionBias;
}

namespace {

bool OneOf(std::string_view s, std::initializer_list<std::string_view> names) {
  return std::find(names.begin(), names.end(), s) != names.end();
}

bool Contains(std::string_view s, std::string_view part) {
  return s.find(part) != std::string_view::npos;
}

std::string Lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

// The role of module `leaf` whose parent module is `parent` (both "" when absent), as the
// families' modelling code and their checkpoints name them.
TensorRole RoleOfModule(std::string_view leaf, std::string_view parent, std::string_view path) {
  using R = TensorRole;
  const std::string low = Lower(leaf);
  if (OneOf(leaf, {"lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B"})) {
    return R::kAdapter;
  }
  if (leaf == "relative_attention_bias") return R::kRelativeAttentionBias;
  if (leaf == "token_type_embeddings") return R::kTokenTypeEmbedding;
  if (OneOf(leaf, {"wpe", "embed_positions", "position_embeddings", "position_embedding",
                   "distance_embedding"})) {
    return R::kPositionEmbedding;
  }
  if (OneOf(leaf,
            {"embed_tokens", "wte", "word_embeddings", "embed_in", "shared", "tok_embeddings"})) {
    return R::kEmbedding;
  }
  if (leaf == "patch_embedding") return R::kPatchEmbedding;
  if (Contains(low, "norm") || (low.size() >= 2 && low.compare(0, 2, "ln") == 0)) {
    return R::kNorm;
  }
  if (Contains(path, "multi_modal_projector") || OneOf(leaf, {"project_in", "project_out"})) {
    return R::kProjector;
  }
  // Output heads and task heads.
  if (OneOf(leaf, {"lm_head", "embed_out", "vocab_projector", "predictions"}) ||
      (leaf == "output" && parent.empty()) ||
      (leaf == "decoder" && OneOf(parent, {"predictions", "lm_head"}))) {
    return R::kHead;
  }
  if (OneOf(leaf, {"score", "classifier", "qa_outputs", "seq_relationship", "pre_classifier"}) ||
      parent == "classification_head" || parent == "classifier") {
    return R::kClassifier;
  }
  if (parent == "pooler") return R::kPooler;
  if (leaf == "vocab_transform" || parent == "transform" ||
      (leaf == "dense" && parent == "lm_head")) {
    return R::kHeadTransform;
  }
  // Mixture of experts: routed experts, their router, the shared expert's gate.
  if (leaf == "shared_expert_gate") return R::kSharedExpertGate;
  const bool expert = Contains(path, ".experts.") || parent == "experts";
  if (expert) {
    // Fused experts hold their biases as Parameters of their own (gpt-oss: down_proj_bias).
    std::string_view base = leaf;
    if (base.size() > 5 && base.substr(base.size() - 5) == "_bias") {
      base = base.substr(0, base.size() - 5);
    }
    if (OneOf(base, {"gate_proj", "w1"})) return R::kExpertGate;
    if (OneOf(base, {"up_proj", "w3"})) return R::kExpertUp;
    if (OneOf(base, {"down_proj", "w2"})) return R::kExpertDown;
    if (base == "gate_up_proj") return R::kExpertGateUp;
  }
  // GraniteMoE's checkpoints: block_sparse_moe.input_linear / output_linear hold every expert
  // ([E, 2F, h] and [E, h, F]), and router.layer is its router's Linear.
  if (parent == "block_sparse_moe" && leaf == "input_linear") return R::kExpertGateUp;
  if (parent == "block_sparse_moe" && leaf == "output_linear") return R::kExpertDown;
  if (leaf == "router" || (leaf == "layer" && parent == "router") ||
      (leaf == "gate" && OneOf(parent, {"mlp", "block_sparse_moe", "moe"}))) {
    return R::kRouter;
  }
  // Attention.
  // BERT's attention output is attention.output.dense; GPT-NeoX's attention.dense.
  const bool in_attention =
      Contains(Lower(parent), "att") || (parent == "output" && Contains(path, "attention.output"));
  if (leaf == "sinks") return R::kAttentionSinks;
  if (OneOf(leaf, {"q_proj", "query", "q", "wq", "q_b_proj", "q_attn", "q_lin"}))
    return R::kAttentionQ;
  if (OneOf(leaf, {"k_proj", "key", "k", "wk", "k_lin"})) return R::kAttentionK;
  if (OneOf(leaf, {"v_proj", "value", "v", "wv", "v_lin"})) return R::kAttentionV;
  if (leaf == "c_attn") {
    return parent == "crossattention" ? R::kAttentionKv : R::kAttentionQkv;
  }
  if (OneOf(leaf, {"query_key_value", "qkv_proj", "Wqkv", "W_pack", "qkv", "attn", "in_proj_weight",
                   "in_proj_bias"})) {
    return R::kAttentionQkv;
  }
  if (leaf == "q_a_proj") return R::kAttentionQDown;
  if (leaf == "kv_a_proj_with_mqa") return R::kAttentionKvDown;
  if (leaf == "kv_b_proj") return R::kAttentionKvUp;
  if (OneOf(leaf, {"o_proj", "out_proj", "out_lin"})) return R::kAttentionOut;
  // MLPs (gated: gate and up; Meta's w1/w3, Lit-GPT's fc_1/fc_2; T5's wi_0/wi_1).
  if (OneOf(leaf, {"gate_proj", "w1", "fc_1", "wi_0"})) return R::kMlpGate;
  if (OneOf(leaf, {"up_proj", "w3", "fc_2", "wi_1", "fc1", "c_fc", "dense_h_to_4h", "lin1", "wi",
                   "fc", "w_in", "fc_in"})) {
    return R::kMlpUp;
  }
  if (leaf == "gate_up_proj") return R::kMlpGateUp;
  if (OneOf(leaf, {"down_proj", "w2", "fc2", "dense_4h_to_h", "lin2", "w_out", "fc_out"})) {
    return R::kMlpDown;
  }
  if (leaf == "wo") return parent == "DenseReluDense" ? R::kMlpDown : R::kAttentionOut;
  if (leaf == "o") return R::kAttentionOut;
  if (leaf == "c_proj" || leaf == "proj") {
    return OneOf(parent, {"mlp", "ffn"}) ? R::kMlpDown : R::kAttentionOut;
  }
  if (leaf == "dense") {
    if (parent == "intermediate") return R::kMlpUp;
    if (in_attention) return R::kAttentionOut;
    if (parent == "output") return R::kMlpDown;  // BERT's layer.N.output.dense
  }
  return R::kUnknown;
}

}  // namespace

TensorTraits ClassifyTensor(std::string_view name, const std::vector<int64_t>& shape,
                            std::string_view model_type) {
  TensorTraits out;
  // Split off the parameter's own name, then the module's last two components.
  const std::string_view own = LastComponent(name, '.');
  const std::string_view module = BeforeLastComponent(name, '.');
  const bool weight = own == "weight", bias = own == "bias";
  // A bare Parameter (fused experts, sinks, class embeddings) is named after itself.
  std::string_view path = weight || bias ? module : name;
  auto numeric = [](std::string_view s) {
    return !s.empty() &&
           std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
  };
  // A module that is an element of a ModuleList is named by the list (StableLM's
  // "q_layernorm.norms.3").
  if (numeric(LastComponent(path, '.')) && path.find('.') != std::string_view::npos) {
    path = BeforeLastComponent(path, '.');
  }
  const std::string_view leaf = LastComponent(path, '.');
  std::string_view parent = LastComponent(BeforeLastComponent(path, '.'), '.');
  // Skip a ModuleList index between a module and its parent ("experts.3.w1": parent "experts").
  if (numeric(parent)) {
    parent = LastComponent(BeforeLastComponent(BeforeLastComponent(path, '.'), '.'), '.');
  }
  out.role = RoleOfModule(leaf, parent, name);
  out.bias = bias || (!weight && leaf.size() > 5 && leaf.substr(leaf.size() - 5) == "_bias");
  if (!weight && !bias) {
    out.kind = ModuleKind::kOther;
    if (out.role == TensorRole::kUnknown) out.role = TensorRole::kOther;
    return out;
  }
  switch (out.role) {
    case TensorRole::kEmbedding:
    case TensorRole::kPositionEmbedding:
    case TensorRole::kTokenTypeEmbedding:
    case TensorRole::kRelativeAttentionBias: out.kind = ModuleKind::kEmbedding; break;
    case TensorRole::kNorm: out.kind = ModuleKind::kNorm; break;
    case TensorRole::kPatchEmbedding: out.kind = ModuleKind::kConv2d; break;
    default: {
      // A 2-D weight (and its bias) of anything else is a Linear: checkpoints store no other
      // 2-D module weights. GPT-2's projections are Conv1D ([in, out]).
      const bool conv1d =
          model_type == "gpt2" && OneOf(leaf, {"c_attn", "c_proj", "c_fc", "q_attn"});
      if (weight ? shape.size() == 2 : true) {
        out.kind = conv1d ? ModuleKind::kConv1D : ModuleKind::kLinear;
      }
      if (weight && shape.size() != 2) out.kind = ModuleKind::kOther;
      break;
    }
  }
  return out;
}

void ClassifyTensors(ModelInventory* inventory) {
  for (TensorInfo& t : inventory->tensors) {
    const TensorTraits traits = ClassifyTensor(t.name, t.shape, inventory->model_type);
    t.role = traits.role;
    t.kind = traits.kind;
    t.bias = traits.bias;
  }
}

std::string ArchitectureInfo::MlpKind() const {
  if (!gated_mlp) return hidden_act;
  if (hidden_act == "silu" || hidden_act == "swish") return "swiglu";
  if (hidden_act.rfind("gelu", 0) == 0) return "geglu";
  if (hidden_act == "relu") return "reglu";
  return "gated-" + hidden_act;
}

int64_t ModelInventory::Find(std::string_view tensor_name) const {
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].name == tensor_name) return static_cast<int64_t>(i);
  }
  return -1;
}

int64_t ModelInventory::FindTieTarget(std::string_view tensor_name) {
  if (tie_indexed_ > tensors.size()) {  // tensors were removed behind Add's back
    tie_index_.clear();
    tie_indexed_ = 0;
  }
  for (; tie_indexed_ < tensors.size(); ++tie_indexed_) {
    tie_index_.emplace(std::hash<std::string_view>{}(tensors[tie_indexed_].name), tie_indexed_);
  }
  // The first tensor of that name, as Find gives it (a duplicate is CountParams' error).
  int64_t found = -1;
  auto [first, last] = tie_index_.equal_range(std::hash<std::string_view>{}(tensor_name));
  for (auto it = first; it != last; ++it) {
    if (it->second < tensors.size() && tensors[it->second].name == tensor_name &&
        (found < 0 || it->second < static_cast<size_t>(found))) {
      found = static_cast<int64_t>(it->second);
    }
  }
  return found >= 0 ? found : Find(tensor_name);
}

namespace {

// The element count of a tensor or buffer (`what`) called `name`, refusing an empty name, a
// negative dimension and an overflowing product.
Result<uint64_t> ValidNumel(std::string_view what, const std::string& name,
                            const std::vector<int64_t>& shape) {
  if (name.empty()) return Status::InvalidArgument(std::string(what) + " with an empty name");
  for (int64_t d : shape) {
    if (d < 0) {
      return Status::InvalidArgument(std::string(what) + " '" + name + "': negative dimension " +
                                     std::to_string(d));
    }
  }
  auto numel = CheckedProduct(shape);
  if (!numel) {
    return Status::OutOfRange(std::string(what) + " '" + name +
                              "': number of elements overflows 64 bits");
  }
  return *numel;
}

}  // namespace

Status ModelInventory::Add(std::string tensor_name, std::vector<int64_t> shape, DType dtype,
                           std::string tied, TensorTraits traits) {
  MEMPLAN_ASSIGN_OR_RETURN(uint64_t numel, ValidNumel("tensor", tensor_name, shape));
  if (!tied.empty()) {
    int64_t target = FindTieTarget(tied);
    if (target < 0) {
      return Status::InvalidArgument("tensor '" + tensor_name + "' is tied to '" + tied +
                                     "', which is not in the model");
    }
    // Tie to the canonical tensor so chains collapse.
    const TensorInfo& t = tensors[static_cast<size_t>(target)];
    if (t.shape != shape) {
      return Status::InvalidArgument("tensor '" + tensor_name + "' is tied to '" + tied +
                                     "' but has a different shape");
    }
    if (!t.tied_to.empty()) tied = t.tied_to;
  }
  TensorInfo info;
  info.name = std::move(tensor_name);
  info.shape = std::move(shape);
  info.dtype = dtype;
  info.numel = numel;
  info.tied_to = std::move(tied);
  info.role = traits.role;
  info.kind = traits.kind;
  info.bias = traits.bias;
  DeriveModulePath(info.name, &info.module, &info.block, &info.layer);
  tensors.push_back(std::move(info));
  return Status::Ok();
}

Status ModelInventory::AddBuffer(std::string buffer_name, std::vector<int64_t> shape, DType dtype) {
  MEMPLAN_ASSIGN_OR_RETURN(uint64_t numel, ValidNumel("buffer", buffer_name, shape));
  TensorInfo info;
  info.name = std::move(buffer_name);
  info.shape = std::move(shape);
  info.dtype = dtype;
  info.numel = numel;
  DeriveModulePath(info.name, &info.module, &info.block, &info.layer);
  buffers.push_back(std::move(info));
  return Status::Ok();
}

namespace {

// Note [Accelerate's largest layer]
// accelerate.utils.calculate_maximum_sizes (what `accelerate estimate-memory` prints) sums every
// parameter (tied ones once, under the first name) and every buffer of the model built in fp32,
// then descends from the root's children: a module that is an instance of a `_no_split_modules`
// class, or that has no submodules, is one "layer" (its whole subtree); any other module is
// replaced by its children. So a tensor belongs to the first no-split module on its path, else to
// its own module if that module has no submodules, else to no layer at all (a parameter held
// directly by a module that also has submodules, like BERT's cls.predictions.bias, is never
// compared). A tensor of the root itself is its own layer. Ties go to the layer visited first.
uint64_t AccelerateBytes(const TensorInfo& t) {
  // create_empty_model builds in fp32; integer tensors keep their own type. Accelerate's
  // dtype_byte_size counts a bool as one bit (GPT-BigCode's causal table), though it takes a byte.
  switch (t.dtype) {
    case DType::kBool: return (t.numel + 7) / 8;
    case DType::kI64:
    case DType::kI32:
    case DType::kI16:
    case DType::kI8:
    case DType::kU8: return t.numel * static_cast<uint64_t>(DTypeBits(t.dtype) / 8);
    default: return t.numel * 4;
  }
}

// One module of the tree the tensor names describe.
struct ModuleEntry {
  std::string_view path;
  int32_t parent = -1;
  int32_t outermost = -1;    // the outermost no-split module at or above (-1: none)
  int32_t first_leaf = -1;   // the tensors held directly, a list in ModuleTree::leaves_
  int32_t first_child = -1;  // the submodules, a list through next_sibling
  int32_t next_sibling = -1;
  int32_t children = 0;
  int32_t leaves = 0;    // tensors held directly
  bool indexed = false;  // its children are in ModuleTree's table (too many to scan)
  bool unsplit_known = false;
  bool no_split = false;
  bool accelerate_layer = false;
  uint32_t accelerate_order = 0;
  uint64_t direct_params = 0;     // DeepSpeed: parameters held directly, tied aliases included
  uint64_t block_params = 0;      // a repeated block's parameters, each once
  uint64_t accelerate_bytes = 0;  // as an Accelerate layer
};

// Note [Module tree cursor]
// The module tree the tensor names describe, entries in first-appearance order in one vector (so
// ties go to the module registered first, and scans stay in cache). A module's parent is its
// path up to the last '.', as in PyTorch. Lookups walk from the previous one, as a shell walks
// from its working directory: up to the deepest module the two paths share, then down one
// component at a time, finding each child among its siblings. Tensors come in module order
// (named_parameters(), safetensors' sorted names), so almost every step is "same module" or "a
// new child of the last one". Children are scanned while few; a module with many (a ModuleList
// of layers or experts) has them in an open-addressing table instead. Any order stays correct,
// only slower. A per-expert DeepSeek-V3 (47,000 tensors, 64,000 modules) counts in a few
// milliseconds; a hash lookup per module spent most of that time in cache misses.
class ModuleTree {
 public:
  explicit ModuleTree(size_t expected) {
    entries_.reserve(expected);
    entries_.push_back(ModuleEntry{});  // the root, ""
    cursor_.push_back(0);
  }

  int32_t Get(std::string_view path) {
    // Up: the deepest module on the cursor that is `path` or one of its ancestors. Every cursor
    // entry is a prefix of the deepest one, so one comparison bounds them all.
    const size_t shared = SharedPrefix(entries_[cursor_.back()].path, path);
    while (cursor_.size() > 1) {
      const size_t length = entries_[cursor_.back()].path.size();
      if (length <= shared && (length == path.size() || path[length] == '.')) break;
      cursor_.pop_back();
    }
    // Down: one component at a time.
    int32_t id = cursor_.back();
    while (entries_[id].path.size() < path.size()) {
      const size_t dot = path.find('.', entries_[id].path.size() + 1);
      const std::string_view child = path.substr(0, dot);
      size_t hash = 0;
      int32_t found = FindChild(id, child, &hash);
      if (found < 0) found = AddChild(id, child, hash);
      id = found;
      cursor_.push_back(id);
    }
    return id;
  }
  // The ancestor of `id` (or `id` itself) whose path is `length` long.
  int32_t Ancestor(int32_t id, size_t length) const {
    while (id >= 0 && entries_[id].path.size() > length) id = entries_[id].parent;
    return id;
  }
  // Records that `id` holds tensor `tensor` directly; false when it already holds one of that
  // name (the names of one module's tensors differ in their leaf only).
  // A module's leaves are scanned while few; past kScanLeaves (a shape list of 10^5 tensors at the
  // root, a flat safetensors file) their names go into a set of the module's own, so that adding
  // n leaves stays linear.
  bool AddLeaf(int32_t id, int32_t tensor, const std::vector<TensorInfo>& tensors) {
    const std::string& name = tensors[tensor].name;
    ModuleEntry& e = entries_[id];
    if (e.leaves < kScanLeaves) {
      for (int32_t i = e.first_leaf; i >= 0; i = leaves_[i].next) {
        if (tensors[leaves_[i].tensor].name == name) return false;
      }
    } else {
      auto& names = leaf_names_[id];
      if (names.empty()) {
        for (int32_t i = e.first_leaf; i >= 0; i = leaves_[i].next) {
          names.insert(tensors[leaves_[i].tensor].name);
        }
      }
      if (!names.insert(name).second) return false;
    }
    leaves_.push_back({tensor, e.first_leaf});
    e.first_leaf = static_cast<int32_t>(leaves_.size() - 1);
    ++e.leaves;
    return true;
  }
  int32_t Outermost(int32_t id) {
    if (id < 0) return -1;
    ModuleEntry& e = entries_[id];
    if (!e.unsplit_known) {
      const int32_t above = Outermost(e.parent);
      entries_[id].outermost = above >= 0 ? above : entries_[id].no_split ? id : -1;
      entries_[id].unsplit_known = true;
    }
    return entries_[id].outermost;
  }
  std::vector<ModuleEntry>& entries() { return entries_; }
  void ReserveLeaves(size_t n) { leaves_.reserve(n); }

 private:
  // Children scanned in their list; more go into the table.
  static constexpr int32_t kScanChildren = 16;
  static constexpr int32_t kScanLeaves = 16;

  struct Slot {
    uint64_t hash = 0;
    int32_t id = -1;  // -1: free
  };
  struct Leaf {
    int32_t tensor;
    int32_t next;
  };

  // The length of the longest common prefix, eight bytes at a time.
  static size_t SharedPrefix(std::string_view a, std::string_view b) {
    const size_t n = std::min(a.size(), b.size());
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
      uint64_t x = 0, y = 0;
      std::memcpy(&x, a.data() + i, 8);
      std::memcpy(&y, b.data() + i, 8);
      if (x != y) {
        const uint64_t d = x ^ y;
        const int bits =
            std::endian::native == std::endian::little ? std::countr_zero(d) : std::countl_zero(d);
        return i + static_cast<size_t>(bits / 8);
      }
    }
    while (i < n && a[i] == b[i]) ++i;
    return i;
  }

  // A child's key in the table: its parent and its last component (short: "17", "gate_proj"),
  // FNV-1a, mixed.
  size_t Hash(int32_t parent, std::string_view child) const {
    const size_t own = entries_[parent].path.size() + (parent == 0 ? 0 : 1);
    uint64_t h = 0xcbf29ce484222325ull ^ (static_cast<uint64_t>(parent) * 0x9e3779b97f4a7c15ull);
    for (size_t i = std::min(own, child.size()); i < child.size(); ++i) {
      h = (h ^ static_cast<unsigned char>(child[i])) * 0x100000001b3ull;
    }
    // MurmurHash3's finaliser: FNV's low bits alone cluster for keys like "0".."255".
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ull;
    h ^= h >> 33;
    return static_cast<size_t>(h);
  }
  // The child of `parent` whose path is `child`, or -1; `*hash` is its key when the parent's
  // children are indexed.
  int32_t FindChild(int32_t parent, std::string_view child, size_t* hash) const {
    if (!entries_[parent].indexed) {
      for (int32_t c = entries_[parent].first_child; c >= 0; c = entries_[c].next_sibling) {
        if (entries_[c].path == child) return c;
      }
      return -1;
    }
    *hash = Hash(parent, child);
    const size_t mask = slots_.size() - 1;
    for (size_t at = *hash & mask; slots_[at].id >= 0; at = (at + 1) & mask) {
      if (slots_[at].hash == *hash && entries_[slots_[at].id].path == child) {
        return slots_[at].id;
      }
    }
    return -1;
  }

  int32_t AddChild(int32_t parent, std::string_view child, size_t hash) {
    const int32_t id = static_cast<int32_t>(entries_.size());
    entries_.push_back(ModuleEntry{});
    ModuleEntry& e = entries_.back();
    e.path = child;
    e.parent = parent;
    ModuleEntry& p = entries_[parent];
    e.next_sibling = p.first_child;
    p.first_child = id;
    ++p.children;
    if (p.indexed) {
      Index(id, hash);
    } else if (p.children > kScanChildren) {
      p.indexed = true;
      for (int32_t c = p.first_child; c >= 0; c = entries_[c].next_sibling) {
        Index(c, Hash(parent, entries_[c].path));
      }
    }
    return id;
  }

  void Index(int32_t id, size_t hash) {
    if (2 * (indexed_ + 1) > slots_.size()) {  // keep the load at most 1/2
      std::vector<Slot> old(std::max<size_t>(1024, 2 * slots_.size()));
      old.swap(slots_);
      indexed_ = 0;
      for (const Slot& s : old) {
        if (s.id >= 0) Index(s.id, s.hash);
      }
    }
    const size_t mask = slots_.size() - 1;
    size_t at = hash & mask;
    while (slots_[at].id >= 0) at = (at + 1) & mask;
    slots_[at] = {hash, id};
    ++indexed_;
  }

  std::vector<ModuleEntry> entries_;
  std::vector<int32_t> cursor_;  // the root, then each module down to the last one found
  std::vector<Slot> slots_;
  size_t indexed_ = 0;
  std::vector<Leaf> leaves_;
  std::unordered_map<int32_t, std::unordered_set<std::string_view>>
      leaf_names_;  // past kScanLeaves
};

}  // namespace

Result<ModelCounts> CountParams(const ModelInventory& inventory) {
  ModelCounts counts;
  const Status overflow =
      Status::OutOfRange("model '" + inventory.name + "': parameter count overflows 64 bits");
  // Keys view the inventory's own strings (Note [Module tree cursor]).
  ModuleTree tree(2 * inventory.tensors.size() + inventory.buffers.size() +
                  inventory.no_split_modules.size() + 64);
  tree.ReserveLeaves(inventory.tensors.size());
  std::vector<ModuleEntry>& entries = tree.entries();
  for (const std::string& path : inventory.no_split_modules) {
    const int32_t id = tree.Get(path);
    entries[id].no_split = true;
  }
  std::vector<int32_t> owners;
  owners.reserve(inventory.tensors.size());
  for (size_t i = 0; i < inventory.tensors.size(); ++i) {
    const TensorInfo& t = inventory.tensors[i];
    const int32_t id = tree.Get(t.module);
    owners.push_back(id);
    ModuleEntry* e = &entries[id];
    if (!tree.AddLeaf(id, static_cast<int32_t>(i), inventory.tensors)) {
      return Status::InvalidArgument("model '" + inventory.name + "': tensor '" + t.name +
                                     "' appears twice");
    }
    ++counts.num_tensors;
    // DeepSpeed sums module.parameters(recurse=False): a tied alias counts in every module that
    // holds it.
    auto direct = CheckedAdd(e->direct_params, t.numel);
    if (!direct) return overflow;
    e->direct_params = *direct;
    if (!t.tied_to.empty()) {
      ++counts.num_tied;
      continue;
    }
    auto total = CheckedAdd(counts.params_total, t.numel);
    if (!total) return overflow;
    counts.params_total = *total;
    auto bytes = CheckedMul(t.numel, static_cast<uint64_t>(DTypeBits(t.dtype)));
    if (!bytes) return overflow;
    auto stored = CheckedAdd(counts.bytes_as_stored, *bytes / 8);
    if (!stored) return overflow;
    counts.bytes_as_stored = *stored;
    if (!t.block.empty()) {
      entries[tree.Ancestor(id, t.block.size())].block_params += t.numel;  // <= the total
    }
  }
  std::vector<int32_t> buffer_owners;
  for (const TensorInfo& b : inventory.buffers) {
    buffer_owners.push_back(tree.Get(b.module));
    auto sum = CheckedAdd(counts.buffers_total, b.numel);
    if (!sum) return overflow;
    counts.buffers_total = *sum;
  }

  // DeepSpeed's largest layer and the largest repeated block. Among equals: the module
  // registered first, the block whose path sorts first ("h.0" before "h.1").
  ModuleEntry* largest = nullptr;
  uint64_t largest_params = 0;
  ModuleEntry* largest_block = nullptr;
  for (ModuleEntry& e : entries) {
    if (e.direct_params > largest_params) {
      largest_params = e.direct_params;
      largest = &e;
    }
    if (e.block_params > 0) {
      ++counts.num_blocks;
      if (largest_block == nullptr || e.block_params > largest_block->block_params ||
          (e.block_params == largest_block->block_params && e.path < largest_block->path)) {
        largest_block = &e;
      }
    }
  }
  if (largest != nullptr) {
    counts.largest_layer_params = largest->direct_params;
    counts.largest_layer_module = std::string(largest->path);
  }
  if (largest_block != nullptr) {
    counts.largest_block_params = largest_block->block_params;
    counts.largest_block = std::string(largest_block->path);
  }

  // Accelerate (Note [Accelerate's largest layer]): every parameter once, every buffer.
  uint32_t visit = 0;
  std::unordered_map<std::string_view, uint64_t> root_tensors;  // tensors of the root itself
  auto add = [&](const TensorInfo& t, int32_t id) -> bool {
    const uint64_t bytes = AccelerateBytes(t);
    auto sum = CheckedAdd(counts.accelerate_total_bytes, bytes);
    if (!sum) return false;
    counts.accelerate_total_bytes = *sum;
    const int32_t outer = tree.Outermost(id);
    ModuleEntry* layer = outer >= 0 ? &entries[outer] : nullptr;
    if (layer == nullptr) {
      if (t.module.empty()) {
        root_tensors[t.name] += bytes;
        return true;
      }
      if (entries[id].children > 0) return true;  // held directly by a module with submodules
      layer = &entries[id];
    }
    if (!layer->accelerate_layer) {
      layer->accelerate_layer = true;
      layer->accelerate_order = ++visit;
    }
    layer->accelerate_bytes += bytes;  // bounded by the total
    return true;
  };
  for (size_t i = 0; i < inventory.tensors.size(); ++i) {
    if (inventory.tensors[i].tied_to.empty() && !add(inventory.tensors[i], owners[i])) {
      return overflow;
    }
  }
  for (size_t i = 0; i < inventory.buffers.size(); ++i) {
    if (!add(inventory.buffers[i], buffer_owners[i])) return overflow;
  }
  ModuleEntry* accelerate = nullptr;
  for (ModuleEntry& e : entries) {
    if (e.accelerate_layer &&
        (accelerate == nullptr || e.accelerate_bytes > accelerate->accelerate_bytes ||
         (e.accelerate_bytes == accelerate->accelerate_bytes &&
          e.accelerate_order < accelerate->accelerate_order))) {
      accelerate = &e;
    }
  }
  if (accelerate != nullptr) {
    counts.accelerate_largest_layer_bytes = accelerate->accelerate_bytes;
    counts.accelerate_largest_layer = std::string(accelerate->path);
  }
  for (const auto& [name, bytes] : root_tensors) {
    if (bytes > counts.accelerate_largest_layer_bytes) {
      counts.accelerate_largest_layer_bytes = bytes;
      counts.accelerate_largest_layer = std::string(name);
    }
  }
  return counts;
}

}  // namespace memplan::estimator
