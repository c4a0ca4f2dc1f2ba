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
      case DType::kBF16: return t.dtype;
      default: break;
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

uint64_t CeilDiv(uint64_t a, uint64_t b) { return a / b + (a % b != 0 ? 1 : 0); }

// The weight of an nn.Linear (or GPT-2's Conv1D) that the quantizers replace (Note [Tensor roles]
// in inventory.h): not a router, which Transformers 5 holds as a bare Parameter and the
// quantizers leave in 16 bits.
bool LinearWeight(const TensorInfo& t) {
  return t.IsLinearWeight() && t.role != TensorRole::kRouter;
}

// What each 4-bit quantizer stores for `t`, in bytes (Note [Quantized weights]).
uint64_t Nf4Bytes(uint64_t n) { return CeilDiv(n, 2) + 4 * CeilDiv(n, 64); }
uint64_t Nf4DoubleQuantBytes(uint64_t n) {
  const uint64_t blocks = CeilDiv(n, 64);
  return CeilDiv(n, 2) + blocks + 4 * CeilDiv(blocks, 256) + 4;
}
uint64_t GptqBytes(uint64_t out, uint64_t in) {
  constexpr uint64_t kGroup = 128;
  const uint64_t groups = CeilDiv(in, kGroup);
  return CeilDiv(in, 8) * out * 4        // qweight: eight 4-bit values per int32
         + groups * CeilDiv(out, 8) * 4  // qzeros
         + groups * out * 2              // scales, fp16
         + in * 4;                       // g_idx
}

// Bytes as Accelerate counts a buffer (fp32, integers their own width).
uint64_t BufferBytes(const TensorInfo& b) {
  switch (b.dtype) {
    case DType::kI64:
    case DType::kI32:
    case DType::kI16:
    case DType::kI8:
    case DType::kU8:
    case DType::kBool: return b.numel * static_cast<uint64_t>(DTypeBits(b.dtype) / 8);
    default: return b.numel * 4;
  }
}

bool InModule(const std::string& name, const std::string& module) {
  if (module.empty()) return true;
  return name == module ||
         (name.size() > module.size() && name.compare(0, module.size(), module) == 0 &&
          name[module.size()] == '.');
}

// The rows of the 4-bit quantizers, for the whole model and for Accelerate's largest layer.
Result<std::vector<WeightsRow>> QuantizedRows(const ModelInventory& inventory,
                                              const ModelCounts& counts) {
  const Status overflow = Status::OutOfRange("the quantized weights' size overflows 64 bits");
  const std::string& largest = counts.accelerate_largest_layer;
  // bitsandbytes leaves the output head, tied weights and the last parameter's module alone
  // (Transformers' get_keys_to_not_convert).
  std::string last_module;  // of the last parameter named_parameters() yields (tied ones once)
  for (auto t = inventory.tensors.rbegin(); t != inventory.tensors.rend(); ++t) {
    if (t->tied_to.empty()) {
      last_module = t->module;
      break;
    }
  }
  std::vector<std::string_view> tied_targets;
  for (const TensorInfo& t : inventory.tensors) {
    if (!t.tied_to.empty()) tied_targets.push_back(t.tied_to);
  }
  WeightsRow rows[3] = {{"nf4", 4.5}, {"nf4-dq", 4.127}, {"gptq-int4", 4}};
  rows[0].method = rows[1].method = "bitsandbytes";
  rows[2].method = "gptq";
  const bool falcon = inventory.model_type == "falcon";
  for (const TensorInfo& t : inventory.tensors) {
    if (!t.tied_to.empty()) continue;  // the same storage as its target
    const bool in_largest = !largest.empty() && InModule(t.name, largest);
    const uint64_t kept = 2 * t.numel;  // 16 bits
    const bool linear = LinearWeight(t);
    const bool head =
        t.role == TensorRole::kHead || t.module == last_module ||
        std::find(tied_targets.begin(), tied_targets.end(), t.name) != tied_targets.end();
    // replace_with_bnb_linear takes `type(module) is nn.Linear`: Falcon's projections are
    // FalconLinear, a subclass, and stay as they are.
    const bool bnb = linear && !head && !falcon;
    const bool gptq = linear && !t.block.empty();
    const uint64_t out = static_cast<uint64_t>(t.OutFeatures());
    const uint64_t in = static_cast<uint64_t>(t.InFeatures());
    const uint64_t bytes[3] = {bnb ? Nf4Bytes(t.numel) : kept,
                               bnb ? Nf4DoubleQuantBytes(t.numel) : kept,
                               gptq ? GptqBytes(out, in) : kept};
    const bool quantized[3] = {bnb, bnb, gptq};
    for (int i = 0; i < 3; ++i) {
      auto total = CheckedAdd(rows[i].total_bytes, bytes[i]);
      if (!total) return overflow;
      rows[i].total_bytes = *total;
      if (in_largest) rows[i].largest_layer_bytes += bytes[i];  // <= the total
      if (quantized[i]) rows[i].quantized_params += t.numel;    // <= params_total
    }
  }
  for (const TensorInfo& b : inventory.buffers) {
    for (WeightsRow& row : rows) {
      auto total = CheckedAdd(row.total_bytes, BufferBytes(b));
      if (!total) return overflow;
      row.total_bytes = *total;
      if (!largest.empty() && InModule(b.name, largest)) row.largest_layer_bytes += BufferBytes(b);
    }
  }
  return std::vector<WeightsRow>{rows[0], rows[1], rows[2]};
}

// T5's EncoderDecoderCache: per decoder layer, keys and values of every head (d_kv each) for the
// decoder's tokens (self-attention) and for the encoder's (cross-attention, computed once from
// the encoder's output).
Result<InferenceEstimate> EncoderDecoderCache(const ArchitectureInfo& a,
                                              const InferenceSetup& setup, DType kv_dtype,
                                              InferenceEstimate out) {
  KvCache kv;
  kv.dtype = TorchName(kv_dtype);
  kv.batch = setup.batch;
  kv.context = setup.context;
  kv.encoder_context = setup.encoder_context > 0 ? setup.encoder_context : setup.context;
  kv.layers = a.decoder_layers;
  kv.heads = a.kv_heads > 0 ? a.kv_heads : a.heads;
  kv.key_dim = kv.value_dim = a.head_dim;
  kv.kind = kv.heads == a.heads ? "mha" : kv.heads == 1 ? "mqa" : "gqa";
  const uint64_t element_bytes = static_cast<uint64_t>(DTypeBits(kv_dtype) / 8);
  MEMPLAN_ASSIGN_OR_RETURN(const uint64_t per_token_layer,
                           Product({element_bytes, static_cast<uint64_t>(kv.heads),
                                    static_cast<uint64_t>(kv.key_dim + kv.value_dim)}));
  MEMPLAN_ASSIGN_OR_RETURN(kv.bytes_per_token,
                           Product({per_token_layer, static_cast<uint64_t>(kv.layers)}));
  MEMPLAN_ASSIGN_OR_RETURN(const uint64_t self_bytes,
                           Product({kv.bytes_per_token, static_cast<uint64_t>(setup.context),
                                    static_cast<uint64_t>(setup.batch)}));
  MEMPLAN_ASSIGN_OR_RETURN(kv.cross_attention_bytes,
                           Product({kv.bytes_per_token, static_cast<uint64_t>(kv.encoder_context),
                                    static_cast<uint64_t>(setup.batch)}));
  auto bytes = CheckedAdd(self_bytes, kv.cross_attention_bytes);
  if (!bytes) return Status::OutOfRange("the KV cache's size overflows 64 bits");
  kv.bytes = *bytes;
  out.kv_cache = kv;
  return out;
}

}  // namespace

Result<InferenceEstimate> EstimateInference(const ModelInventory& inventory,
                                            const ModelCounts& counts,
                                            const InferenceSetup& setup) {
  if (setup.batch < 1) {
    return Status::InvalidArgument("`batch` must be at least 1, got " +
                                   std::to_string(setup.batch));
  }
  if (setup.context < 1) {
    return Status::InvalidArgument("`context` must be at least 1, got " +
                                   std::to_string(setup.context));
  }
  if (setup.encoder_context < 0) {
    return Status::InvalidArgument("`encoder_context` must be at least 1, got " +
                                   std::to_string(setup.encoder_context));
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
  MEMPLAN_ASSIGN_OR_RETURN(std::vector<WeightsRow> quantized, QuantizedRows(inventory, counts));
  for (WeightsRow& row : quantized) out.weights.push_back(std::move(row));

  DType kv_dtype = WeightsDType(inventory);
  if (!setup.kv_dtype.empty()) {
    // "fp8"/"float8": the e4m3 format KV caches use (vLLM's and Transformers' default fp8).
    std::string spelled = setup.kv_dtype;
    for (char& c : spelled) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    auto parsed = spelled == "fp8" || spelled == "float8" ? Result<DType>(DType::kF8E4M3)
                                                          : ParseDType(setup.kv_dtype);
    if (!parsed.ok()) return parsed.status().WithPrefix("`kv_dtype`");
    kv_dtype = *parsed;
  }
  if (!inventory.arch) {
    out.notes.push_back(
        "No KV cache: a tensor-shape list or safetensors headers carry no architecture (give "
        "`model_config` config.json)");
    return out;
  }
  const ArchitectureInfo& a = *inventory.arch;
  if (a.encoder_decoder) return EncoderDecoderCache(a, setup, kv_dtype, std::move(out));
  if (!a.causal) {
    out.notes.push_back("No KV cache: an encoder reads the whole input at once");
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
  const uint64_t per_token_layer = element_bytes * static_cast<uint64_t>(kv.heads) *
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
  MEMPLAN_ASSIGN_OR_RETURN(
      kv.bytes, Product({per_token_layer, full_tokens_layers, static_cast<uint64_t>(setup.batch)}));
  if (a.learned_positions && a.max_positions > 0 && setup.context > a.max_positions) {
    out.notes.push_back("The context (" + std::to_string(setup.context) +
                        " tokens) exceeds the model's " + std::to_string(a.max_positions) +
                        " learned positions");
  }
  out.kv_cache = kv;
  return out;
}

}  // namespace memplan::estimator
