#include "estimator/inference.h"

#include <algorithm>
#include <cctype>

#include "common/checked_math.h"

namespace memplan::estimator {
namespace {

// Rounded up: Accelerate divides the fp32 bytes and prints the fraction.
uint64_t Divide(uint64_t bytes, uint64_t by) { return bytes / by + (bytes % by != 0 ? 1 : 0); }

// The dtype the weights are stored in, from the first floating-point tensor (the config's
// torch_dtype / dtype; fp32 when it names none).
DType WeightsDType(const ModelInventory& inventory) {
  for (const TensorInfo& t : inventory.tensors) {
    switch (t.dtype) {
      case DType::kF64:
      case DType::kF32:
      case DType::kF16:
      case DType::kBF16:
        return t.dtype;
      default:
        break;
    }
  }
  return DType::kF32;
}

std::string TorchName(DType dtype) {
  switch (dtype) {
    case DType::kF64: return "float64";
    case DType::kF32: return "float32";
    case DType::kF16: return "float16";
    case DType::kBF16: return "bfloat16";
    case DType::kF8E4M3: return "float8_e4m3fn";
    case DType::kF8E5M2: return "float8_e5m2";
    default: return std::string(DTypeName(dtype));
  }
}

Result<uint64_t> Product(std::initializer_list<uint64_t> factors) {
  uint64_t out = 1;
  for (uint64_t f : factors) {
    auto next = CheckedMul(out, f);
    if (!next) return Status::OutOfRange("the KV cache's size overflows 64 bits");
    out = *next;
  }
  return out;
}

}  // namespace

Result<InferenceEstimate> EstimateInference(const ModelInventory& inventory,
                                            const ModelCounts& counts,
                                            const InferenceSetup& setup) {
  if (setup.batch < 1) {
    return Status::InvalidArgument("--batch must be at least 1, got " +
                                   std::to_string(setup.batch));
  }
  if (setup.context < 1) {
    return Status::InvalidArgument("--context must be at least 1, got " +
                                   std::to_string(setup.context));
  }
  InferenceEstimate out;
  out.setup = setup;
  out.largest_layer = counts.accelerate_largest_layer;
  // accelerate estimate-memory's rows and divisors (commands/estimate.py), with fp8 beside int8.
  struct Row {
    const char* dtype;
    double bits;
    uint64_t divisor;
  };
  for (const Row& r : {Row{"float32", 32, 1}, Row{"float16/bfloat16", 16, 2}, Row{"fp8", 8, 4},
                       Row{"int8", 8, 4}, Row{"int4", 4, 8}}) {
    out.weights.push_back({r.dtype, r.bits, Divide(counts.accelerate_total_bytes, r.divisor),
                           Divide(counts.accelerate_largest_layer_bytes, r.divisor)});
  }

  DType kv_dtype = WeightsDType(inventory);
  if (!setup.kv_dtype.empty()) {
    // "fp8"/"float8": the e4m3 format KV caches use (vLLM's and Transformers' default fp8).
    std::string spelled = setup.kv_dtype;
    for (char& c : spelled) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    auto parsed = spelled == "fp8" || spelled == "float8" ? Result<DType>(DType::kF8E4M3)
                                                          : ParseDType(setup.kv_dtype);
    if (!parsed.ok()) return parsed.status().WithPrefix("--kv-dtype");
    kv_dtype = *parsed;
  }
  if (!inventory.arch) {
    out.notes.push_back(
        "No KV cache: a tensor-shape list or safetensors headers carry no architecture (give "
        "--model-config config.json)");
    return out;
  }
  const ArchitectureInfo& a = *inventory.arch;
  if (!a.causal) {
    out.notes.push_back(a.encoder_decoder
                            ? "No KV cache figure: encoder-decoder models are not covered yet"
                            : "No KV cache: an encoder reads the whole input at once");
    return out;
  }
  KvCache kv;
  kv.dtype = TorchName(kv_dtype);
  kv.batch = setup.batch;
  kv.context = setup.context;
  kv.layers = a.layers;
  if (a.kv_lora_rank > 0) {  // MLA: the compressed latent and the shared rotary key
    kv.heads = 1;
    kv.key_dim = a.kv_lora_rank;
    kv.value_dim = a.qk_rope_head_dim;
    kv.kind = "mla";
  } else {
    kv.heads = a.cached_kv_heads > 0 ? a.cached_kv_heads : a.kv_heads;
    kv.key_dim = kv.value_dim = a.head_dim;
    kv.kind = a.kv_heads == a.heads ? "mha" : a.kv_heads == 1 ? "mqa" : "gqa";
  }
  const uint64_t element_bytes = static_cast<uint64_t>(DTypeBits(kv_dtype) / 8);
  const uint64_t per_token_layer =
      element_bytes * static_cast<uint64_t>(kv.heads) *
      static_cast<uint64_t>(kv.key_dim + kv.value_dim);
  uint64_t full_tokens_layers = 0;  // sum over layers of the tokens each holds
  const int64_t sliding_tokens =
      a.sliding_window > 0 ? std::min(setup.context, a.sliding_window - 1) : setup.context;
  kv.sliding_window = a.sliding_window;
  for (int64_t layer = 0; layer < a.layers; ++layer) {
    const bool sliding = a.sliding_window > 0 &&
                         static_cast<size_t>(layer) < a.sliding_layers.size() &&
                         a.sliding_layers[static_cast<size_t>(layer)];
    if (sliding) ++kv.sliding_layers;
    full_tokens_layers += static_cast<uint64_t>(sliding ? sliding_tokens : setup.context);
  }
  MEMPLAN_ASSIGN_OR_RETURN(kv.bytes_per_token,
                           Product({per_token_layer, static_cast<uint64_t>(a.layers)}));
  MEMPLAN_ASSIGN_OR_RETURN(kv.bytes, Product({per_token_layer, full_tokens_layers,
                                              static_cast<uint64_t>(setup.batch)}));
  if (a.learned_positions && a.max_positions > 0 && setup.context > a.max_positions) {
    out.notes.push_back("The context (" + std::to_string(setup.context) +
                        " tokens) exceeds the model's " + std::to_string(a.max_positions) +
                        " learned positions");
  }
  out.kv_cache = kv;
  return out;
}

}  // namespace memplan::estimator
