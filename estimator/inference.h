// The inference and loading table: what `accelerate estimate-memory` and the Hugging Face memory
// space show (the weights by dtype, the largest layer), and the KV cache a generation run holds
// for a batch x context, as Transformers allocates it.
//
// Weights: Accelerate's calculate_maximum_sizes on the model built in fp32 (ModelCounts), divided
// as `accelerate estimate-memory` divides it: by 2 for 16-bit, 4 for 8-bit (int8 and fp8), 8 for
// int4. It divides the whole model (buffers, norms and embeddings too), so those rows are
// Accelerate's rough figure rather than what a quantizer keeps in 16 bits; bytes are rounded up.
//
// Note [Quantized weights]
// Three more rows say what the 4-bit quantizers hold, tensor by tensor (bitsandbytes is not a
// dependency of the oracle environment: these follow its documented storage layout, and
// Transformers 5's choice of modules):
//   - nf4: bitsandbytes' Linear4bit as Transformers' BitsAndBytesConfig(load_in_4bit) makes it:
//     every module that is exactly an nn.Linear (or GPT-2's Conv1D; Falcon's FalconLinear, a
//     subclass, is left alone) except the output head (lm_head, a tied weight, the module of the
//     model's last parameter) stores its weight as packed 4-bit codes (numel / 2 bytes) plus one
//     fp32 absmax per block of 64 elements (4.5 bits per weight); tests/oracle/
//     inference_oracle_test.py checks which parameters against Transformers' own selection;
//   - nf4-dq: the same with bnb_4bit_use_double_quant: the absmax quantized to 8 bits, one fp32
//     scale per 256 blocks and one fp32 offset per tensor (about 4.127 bits per weight);
//   - gptq-int4: GPTQ (AutoGPTQ / GPTQModel, as Transformers loads it) with 4 bits and groups of
//     128 inputs: the Linear weights inside the repeated blocks only, each [out, in] as qweight
//     (int32, in x out / 2 bytes), qzeros (int32, 4 bits per output per group), scales (fp16 per
//     output per group) and g_idx (int32 per input).
// Everything else (embeddings, norms, biases, the head, routers, fused 3-D expert weights, which
// are not nn.Linear) stays in 16 bits, and buffers as Accelerate counts them.
//
// KV cache: what Transformers' DynamicCache holds after a forward of batch x context tokens, per
// decoder layer: keys and values of [batch, kv heads, tokens, head_dim] in the cache dtype, where
// tokens is the context for a full-attention layer and min(context, sliding_window - 1) for a
// sliding-window one (DynamicSlidingWindowLayer keeps the last window - 1 tokens); MLA (DeepSeek
// V2/V3) caches the compressed latent instead: kv_lora_rank + qk_rope_head_dim per token, one head;
// Falcon's new decoder architecture caches every query head (its keys are broadcast first).
// Encoder-decoder models (T5) hold an EncoderDecoderCache: per decoder layer, a self-attention
// cache of the decoder's tokens (the context) and a cross-attention cache of the encoder's
// (encoder_context; default: the context), keys and values of d_kv per head. Encoder-only models
// have no KV cache.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"
#include "estimator/inventory.h"

namespace memplan::estimator {

struct InferenceSetup {
  int64_t batch = 1;
  int64_t context = 4096;       // tokens per sequence: prompt and generated (the decoder's, for T5)
  std::string kv_dtype;         // "" = the dtype the model's weights are stored in (its config's)
  int64_t encoder_context = 0;  // encoder-decoder models: encoder tokens; 0 = the context
};

struct WeightsRow {
  // "float32", "float16/bfloat16", "fp8", "int8", "int4" (Accelerate's division); "nf4",
  // "nf4-dq", "gptq-int4" (Note [Quantized weights])
  std::string dtype;
  double bits = 0;  // per element, as Accelerate divides; per quantized weight for the others
  uint64_t total_bytes = 0;
  uint64_t largest_layer_bytes = 0;
  // "accelerate" (its division of the fp32 size), "bitsandbytes" or "gptq" (the quantizers'
  // storage, Note [Quantized weights]).
  std::string method = "accelerate";
  // The quantizers' rows: the parameters stored quantized (the rest stay 16-bit).
  uint64_t quantized_params = 0;
};

struct KvCache {
  std::string dtype;  // "bfloat16", ...
  int64_t batch = 0;
  int64_t context = 0;
  int64_t layers = 0;          // decoder layers holding a cache
  int64_t sliding_layers = 0;  // of which sliding-window ones
  int64_t sliding_window = 0;
  int64_t heads = 0;             // cached heads per layer (1 for MLA)
  int64_t key_dim = 0;           // per head: head_dim, or MLA's kv_lora_rank
  int64_t value_dim = 0;         // per head: head_dim, or MLA's qk_rope_head_dim
  uint64_t bytes_per_token = 0;  // one token of one sequence, all layers (before windows)
  uint64_t bytes = 0;            // the whole cache (self- and cross-attention)
  std::string kind;              // "mha", "gqa", "mqa", "mla"
  // Encoder-decoder models: the encoder tokens each decoder layer's cross-attention caches, and
  // those bytes (part of `bytes`); 0 for decoder-only models.
  int64_t encoder_context = 0;
  uint64_t cross_attention_bytes = 0;
};

struct InferenceEstimate {
  InferenceSetup setup;
  std::vector<WeightsRow> weights;
  std::optional<KvCache> kv_cache;  // absent for encoder-only models
  std::string largest_layer;        // Accelerate's largest layer (module path)
  std::vector<std::string> notes;   // why there is no KV cache, and what is assumed
};

// The table for `inventory` (counted as `counts`). Without an architecture (a shape list or
// safetensors headers without --model-config) it has the weights only, and a note says why.
// Errors: InvalidArgument for a batch or context < 1, an encoder context < 0, or an unknown KV
// dtype (naming the field: `batch`, `context`, `encoder_context`, `kv_dtype`);
// OutOfRange when the cache's bytes overflow 64 bits. (JSON: estimate.h, as part of Estimate.)
Result<InferenceEstimate> EstimateInference(const ModelInventory& inventory,
                                            const ModelCounts& counts, const InferenceSetup& setup);

}  // namespace memplan::estimator
