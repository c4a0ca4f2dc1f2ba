// The inference and loading table: what `accelerate estimate-memory` and the Hugging Face memory
// space show (the weights by dtype, the largest layer), and the KV cache a generation run holds
// for a batch x context, as Transformers allocates it.
//
// Weights: Accelerate's calculate_maximum_sizes on the model built in fp32 (ModelCounts), divided
// as `accelerate estimate-memory` divides it: by 2 for 16-bit, 4 for 8-bit (int8 and fp8), 8 for
// int4. It divides the whole model (buffers, norms and embeddings too), so the quantized rows are
// Accelerate's rough figure rather than what a quantizer keeps in 16 bits; bytes are rounded up.
//
// KV cache: what Transformers' DynamicCache holds after a forward of batch x context tokens, per
// decoder layer: keys and values of [batch, kv heads, tokens, head_dim] in the cache dtype, where
// tokens is the context for a full-attention layer and min(context, sliding_window - 1) for a
// sliding-window one (DynamicSlidingWindowLayer keeps the last window - 1 tokens); MLA (DeepSeek
// V2/V3) caches the compressed latent instead: kv_lora_rank + qk_rope_head_dim per token, one head;
// Falcon's new decoder architecture caches every query head (its keys are broadcast first).
// Encoder-only models have no KV cache; encoder-decoder models are not covered (no kv_cache).
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
  int64_t context = 4096;  // tokens per sequence: prompt and generated
  std::string kv_dtype;    // "" = the dtype the model's weights are stored in (its config's)
};

struct WeightsRow {
  std::string dtype;  // "float32", "float16/bfloat16", "fp8", "int8", "int4"
  double bits = 0;    // per element, as Accelerate divides
  uint64_t total_bytes = 0;
  uint64_t largest_layer_bytes = 0;
};

struct KvCache {
  std::string dtype;        // "bfloat16", ...
  int64_t batch = 0;
  int64_t context = 0;
  int64_t layers = 0;             // decoder layers holding a cache
  int64_t sliding_layers = 0;     // of which sliding-window ones
  int64_t sliding_window = 0;
  int64_t heads = 0;              // cached heads per layer (1 for MLA)
  int64_t key_dim = 0;            // per head: head_dim, or MLA's kv_lora_rank
  int64_t value_dim = 0;          // per head: head_dim, or MLA's qk_rope_head_dim
  uint64_t bytes_per_token = 0;   // one token of one sequence, all layers (before windows)
  uint64_t bytes = 0;             // the whole cache
  std::string kind;               // "mha", "gqa", "mqa", "mla"
};

struct InferenceEstimate {
  InferenceSetup setup;
  std::vector<WeightsRow> weights;
  std::optional<KvCache> kv_cache;  // absent for encoder-only and encoder-decoder models
  std::string largest_layer;        // Accelerate's largest layer (module path)
  std::vector<std::string> notes;   // why there is no KV cache, and what is assumed
};

// The table for `inventory` (counted as `counts`). Without an architecture (a shape list or
// safetensors headers without --model-config) it has the weights only, and a note says why.
// Errors: InvalidArgument for a batch or context < 1 or an unknown KV dtype (naming the flag);
// OutOfRange when the cache's bytes overflow 64 bits. (JSON: estimate.h, as part of Estimate.)
Result<InferenceEstimate> EstimateInference(const ModelInventory& inventory,
                                            const ModelCounts& counts,
                                            const InferenceSetup& setup);

}  // namespace memplan::estimator
