#include "estimator/inference.h"

#include <doctest/doctest.h>

#include <string>

#include "estimator/estimate.h"
#include "estimator/hf_config.h"
#include "estimator/model_source.h"
#include "tests/estimator_testing.h"
#include "tests/status_testing.h"

namespace memplan::estimator {
namespace {

using testing::Counts;

InferenceEstimate Infer(const std::string& model, int64_t batch, int64_t context,
                        const std::string& kv_dtype = "bf16") {
  auto inventory = LoadModel(model, ModelClassChoice::kFromArchitectures);
  REQUIRE_MESSAGE(inventory.ok(), inventory.status().ToString());
  auto inference = EstimateInference(*inventory, Counts(*inventory), {batch, context, kv_dtype});
  REQUIRE_MESSAGE(inference.ok(), inference.status().ToString());
  return *inference;
}

uint64_t KvBytes(const std::string& model, int64_t batch, int64_t context) {
  InferenceEstimate e = Infer(model, batch, context);
  REQUIRE(e.kv_cache.has_value());
  return e.kv_cache->bytes;
}

std::string Source(const std::string& rel) { return std::string(MEMPLAN_SOURCE_DIR) + "/" + rel; }

TEST_CASE("inference: KV cache bytes are those of Transformers' DynamicCache") {
  // Each figure: the bytes of the keys and values a DynamicCache holds after a bf16 forward of
  // 2 x 5000 tokens on the meta device (Transformers 5.23; tests/oracle/inference_oracle_test.py
  // checks the same in CI for more families).
  CHECK(KvBytes("llama-3.2-1b", 2, 24) == 1'572'864);      // GQA: 16 x 2 x 2 x 8 x 24 x 64 x 2
  CHECK(KvBytes("gemma-2-2b", 2, 5000) == 968'581'120);    // every other layer keeps 4095 tokens
  CHECK(KvBytes("gemma-3-1b", 2, 5000) == 63'983'616);     // five in six layers keep 511
  CHECK(KvBytes("mistral-7b", 2, 5000) == 1'073'479'680);  // every layer keeps 4095
  CHECK(KvBytes("phi-3-mini", 2, 5000) == 1'609'039'872);  // every layer keeps 2046
  CHECK(KvBytes("gpt-oss-20b", 2, 5000) == 252'002'304);   // sliding layers keep 127
  CHECK(KvBytes("deepseek-v2-lite", 2, 5000) == 311'040'000);  // MLA: 512 + 64 per token
  CHECK(KvBytes(Source("tests/oracle/modern_configs/falcon-7b.json"), 2, 5000) ==
        81'920'000);  // multi-query: one head
  // Falcon's new decoder architecture broadcasts its 8 KV heads to all 128 before caching.
  CHECK(KvBytes(Source("tests/oracle/modern_configs/falcon-40b.json"), 2, 5000) == 19'660'800'000);
}

TEST_CASE("inference: the weights rows are accelerate estimate-memory's") {
  auto inventory = LoadModel("llama-3.1-8b", ModelClassChoice::kFromArchitectures);
  REQUIRE_OK(inventory);
  const ModelCounts counts = Counts(*inventory);
  InferenceEstimate e = Infer("llama-3.1-8b", 1, 4096);
  REQUIRE(e.weights.size() == 8);  // Accelerate's five, then nf4, nf4-dq, gptq-int4
  CHECK(e.weights[0].dtype == "float32");
  CHECK(e.weights[0].total_bytes == counts.accelerate_total_bytes);
  CHECK(e.weights[0].largest_layer_bytes == counts.accelerate_largest_layer_bytes);
  CHECK(e.weights[1].total_bytes == counts.accelerate_total_bytes / 2);
  CHECK(e.weights[3].dtype == "int8");
  CHECK(e.weights[3].total_bytes == counts.accelerate_total_bytes / 4);
  CHECK(e.weights[4].dtype == "int4");
  CHECK(e.weights[4].total_bytes == (counts.accelerate_total_bytes + 7) / 8);
  CHECK(e.largest_layer == counts.accelerate_largest_layer);
  // Llama 3.1 8B: 32 layers x 2 x 8 heads x 128 x 2 bytes = 128 KiB per token.
  REQUIRE(e.kv_cache.has_value());
  CHECK(e.kv_cache->bytes_per_token == 131'072);
  CHECK(e.kv_cache->bytes == 131'072ull * 4096);
  CHECK(e.kv_cache->kind == "gqa");
  CHECK(e.kv_cache->dtype == "bfloat16");
  // Default KV dtype: the weights' (the config's torch_dtype).
  CHECK(Infer("llama-3.1-8b", 1, 4096, "").kv_cache->dtype == "bfloat16");
  CHECK(Infer("llama-3.1-8b", 1, 4096, "fp8").kv_cache->bytes == 131'072ull * 4096 / 2);
}

TEST_CASE("inference: encoders have no KV cache; bad settings are named") {
  InferenceEstimate bert = Infer("bert-base-uncased", 1, 128);
  CHECK_FALSE(bert.kv_cache.has_value());
  REQUIRE(bert.notes.size() == 1);
  CHECK(bert.notes[0].find("encoder") != std::string::npos);
  auto inventory = LoadModel("gpt2", ModelClassChoice::kFromArchitectures);
  REQUIRE_OK(inventory);
  CHECK(EstimateInference(*inventory, Counts(*inventory), {0, 10, ""}).status().message() ==
        "`batch` must be at least 1, got 0");
  CHECK(EstimateInference(*inventory, Counts(*inventory), {1, -1, ""}).status().message() ==
        "`context` must be at least 1, got -1");
  CHECK(EstimateInference(*inventory, Counts(*inventory), {1, 10, "int3"})
            .status()
            .message()
            .find("`kv_dtype`") == 0);
  // GPT-2: MHA, learned positions; a context past them is noted.
  InferenceEstimate gpt2 = Infer("gpt2", 1, 2048);
  REQUIRE(gpt2.kv_cache.has_value());
  CHECK(gpt2.kv_cache->kind == "mha");
  CHECK(gpt2.kv_cache->bytes == 12ull * 2 * 12 * 64 * 2 * 2048);
  REQUIRE(gpt2.notes.size() == 1);
  CHECK(gpt2.notes[0].find("exceeds the model's 1024 learned positions") != std::string::npos);
}

TEST_CASE("inference: NF4 and GPTQ hold 4-bit Linear weights and their scales, the rest 16-bit") {
  // A one-layer Llama (h 64, FFN 128, 4 heads, vocabulary 100, untied): seven Linears, q/k/v/o
  // 64 x 64 and gate/up/down 64 x 128 (40,960 weights); the embedding, the head and three norms
  // (12,992) stay 16-bit; two rotary buffers of 8 fp32 (64 bytes).
  nlohmann::json config = {{"model_type", "llama"},
                           {"hidden_size", 64},
                           {"intermediate_size", 128},
                           {"num_hidden_layers", 1},
                           {"num_attention_heads", 4},
                           {"vocab_size", 100},
                           {"architectures", {"LlamaForCausalLM"}}};
  ModelInventory tiny = testing::MustBuild(config);
  InferenceSetup setup;
  auto e = EstimateInference(tiny, Counts(tiny), setup);
  REQUIRE_OK(e);
  REQUIRE(e->weights.size() == 8);
  const WeightsRow &nf4 = e->weights[5], &dq = e->weights[6], &gptq = e->weights[7];
  CHECK(nf4.dtype == "nf4");
  CHECK(nf4.method == "bitsandbytes");
  CHECK(nf4.quantized_params == 40'960);
  // 4096 weights: 2048 bytes of codes + 64 blocks x 4 bytes of absmax = 2304; 8192: 4608.
  CHECK(nf4.total_bytes == 4 * 2304 + 3 * 4608 + 2 * 12'992 + 64);
  // Double quantisation: 64 one-byte absmax + one fp32 scale (per 256 blocks) + one fp32 offset.
  CHECK(dq.total_bytes == 4 * (2048 + 64 + 4 + 4) + 3 * (4096 + 128 + 4 + 4) + 2 * 12'992 + 64);
  // GPTQ, groups of 128: q [64 out, 64 in]: qweight 8 x 64 int32, qzeros 1 x 8 int32, scales
  // 1 x 64 fp16, g_idx 64 int32 = 2464 bytes; gate/up [128, 64] 4672; down [64, 128] 4768.
  CHECK(gptq.method == "gptq");
  CHECK(gptq.total_bytes == 4 * 2464 + 2 * 4672 + 4768 + 2 * 12'992 + 64);
  CHECK(gptq.quantized_params == 40'960);

  // Llama 3.1 8B: every Linear of the 32 layers is quantized; the head and embedding are not.
  InferenceEstimate llama = Infer("llama-3.1-8b", 1, 4096);
  CHECK(llama.weights[5].quantized_params == 6'979'321'856ull);
  CHECK(llama.weights[7].quantized_params == 6'979'321'856ull);
  // bitsandbytes quantizes Linears outside the blocks too (GPT-2's head is tied: kept); GPTQ only
  // those inside the blocks. Falcon's FalconLinear is not an nn.Linear to bitsandbytes.
  InferenceEstimate gpt2 = Infer("gpt2", 1, 128);
  CHECK(gpt2.weights[5].quantized_params == 12ull * (768 * 2304 + 768 * 768 + 2 * 768 * 3072));
  auto falcon = LoadModel(Source("tests/oracle/modern_configs/falcon-7b.json"),
                          ModelClassChoice::kFromArchitectures);
  REQUIRE_OK(falcon);
  auto falcon_e = EstimateInference(*falcon, Counts(*falcon), setup);
  REQUIRE_OK(falcon_e);
  CHECK(falcon_e->weights[5].quantized_params == 0);
  CHECK(falcon_e->weights[7].quantized_params > 0);
}

TEST_CASE("inference: T5's EncoderDecoderCache: decoder self-attention and cross-attention") {
  // t5-large: 24 decoder layers x 16 heads x d_kv 64, fp32 (its config names no dtype): keys and
  // values 8 KiB per token per layer. Checked against the EncoderDecoderCache Transformers 5
  // fills in a meta-device forward by tests/oracle/inference_oracle_test.py.
  auto t5 = LoadModel("t5-large", ModelClassChoice::kFromArchitectures);
  REQUIRE_OK(t5);
  InferenceSetup setup;
  setup.batch = 2;
  setup.context = 10;
  setup.encoder_context = 512;
  auto e = EstimateInference(*t5, Counts(*t5), setup);
  REQUIRE_OK(e);
  REQUIRE(e->kv_cache.has_value());
  CHECK(e->kv_cache->layers == 24);
  CHECK(e->kv_cache->bytes_per_token == 196'608);
  CHECK(e->kv_cache->encoder_context == 512);
  CHECK(e->kv_cache->cross_attention_bytes == 196'608ull * 512 * 2);
  CHECK(e->kv_cache->bytes == 196'608ull * (10 + 512) * 2);
  // Without an encoder length: the context, both ways.
  setup.encoder_context = 0;
  e = EstimateInference(*t5, Counts(*t5), setup);
  REQUIRE_OK(e);
  CHECK(e->kv_cache->bytes == 196'608ull * 20 * 2);
  // The estimate's JSON carries the new fields and reads back (a public interface).
  auto with_states = EstimateModelStates(*t5, DeepSpeedHardware{});
  REQUIRE_OK(with_states);
  setup.encoder_context = 300;
  REQUIRE_OK(AddInference(*t5, setup, &*with_states));
  auto parsed = EstimateFromJson(ToJson(*with_states));
  REQUIRE_OK(parsed);
  REQUIRE(parsed->inference.has_value());
  CHECK(parsed->inference->kv_cache->encoder_context == 300);
  CHECK(parsed->inference->kv_cache->cross_attention_bytes == 196'608ull * 300 * 2);
  CHECK(parsed->inference->weights[7].method == "gptq");
  CHECK(parsed->inference->weights[7].quantized_params ==
        with_states->inference->weights[7].quantized_params);
  CHECK(ToJson(*parsed) == ToJson(*with_states));
  setup.encoder_context = -3;
  CHECK(EstimateInference(*t5, Counts(*t5), setup).status().message() ==
        "`encoder_context` must be at least 1, got -3");
}

}  // namespace
}  // namespace memplan::estimator
