// End-to-end tests of the memplan CLI as a user runs it: exit status, what goes to stdout and
// stderr, golden output, JSON schema, and every bad-input case of issue 2.
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "tests/loopback_http.h"
#include "tests/testing.h"

namespace {

namespace fs = std::filesystem;
using Run = memplan::testing::CommandResult;
using memplan::testing::ReadWholeFile;

using memplan::testing::TempDir;

// Prefix of each scratch directory.
constexpr std::string_view kTempPrefix = "memplan-cli.";

// Runs memplan with stdout and stderr captured to files (so stderr is not a terminal).
Run Memplan(const std::vector<std::string>& args) {
  return memplan::testing::RunCommand(MEMPLAN_BINARY, args);
}

// Bad input: exit 2, nothing on stdout, exactly one line on stderr containing every `needle`.
void ExpectBadInput(const Run& run, const std::vector<std::string>& needles) {
  CHECK(run.exit_code == 2);
  CHECK(run.out.empty());
  REQUIRE_FALSE(run.err.empty());
  CHECK(run.err.back() == '\n');
  CHECK(run.err.find('\n') == run.err.size() - 1);  // one line
  for (const auto& n : needles) {
    CAPTURE(n);
    CHECK(run.err.find(n) != std::string::npos);
  }
  CAPTURE(run.err);
}

std::string Source(const std::string& rel) { return std::string(MEMPLAN_SOURCE_DIR) + "/" + rel; }

TEST_CASE("cli: golden text table for t5-large (base) on 4 GPUs") {
  Run run = Memplan({"estimate", "--model", "t5-large", "--model-class", "base", "--gpus", "4"});
  REQUIRE(run.exit_code == 0);
  CHECK(run.err.empty());
  std::string golden = ReadWholeFile(Source("tests/golden/estimate_t5-large_base_4gpus.txt"));
  REQUIRE_FALSE(golden.empty());
  CHECK(run.out == golden);
}

TEST_CASE("cli: JSON output has the public schema and exact bytes") {
  Run run = Memplan({"estimate", "--model", "llama-2-7b", "--gpus", "4", "--format", "json"});
  REQUIRE(run.exit_code == 0);
  auto j = nlohmann::json::parse(run.out);
  CHECK(j["model"]["name"] == "llama-2-7b");
  CHECK(j["model"]["model_type"] == "llama");
  CHECK(j["model"]["model_class"] == "causal_lm");
  CHECK(j["model"]["params_total"] == 6738415616);
  CHECK(j["model"]["largest_layer_params"] == 131072000);
  CHECK(j["model"]["largest_block_params"] == 202383360);
  CHECK(j["hardware"]["nodes"] == 1);
  CHECK(j["hardware"]["gpus_per_node"] == 4);
  REQUIRE(j["deepspeed"]["zero2"].size() == 2);
  REQUIRE(j["deepspeed"]["zero3"].size() == 6);
  // ZeRO-3 no offload, zero_init=1: 4L + int(18P/4); CPU: L * 4 * 4 * 1.5.
  const auto& row = j["deepspeed"]["zero3"][4];
  CHECK(row["offload_param"] == "none");
  CHECK(row["offload_optimizer"] == "none");
  CHECK(row["zero_init"] == 1);
  CHECK(row["gpu_bytes"] == uint64_t{4} * 131072000 + uint64_t{18} * 6738415616 / 4);
  CHECK(row["cpu_bytes"] == uint64_t{131072000} * 4 * 4 * 3 / 2);
  CHECK(j["deepspeed"]["zero2"][0]["offload_optimizer"] == "cpu");
  CHECK(j["deepspeed"]["zero2"][0]["gpu_bytes"] == uint64_t{2} * 6738415616);
  CHECK(j["assumptions"].size() >= 1);
}

TEST_CASE("cli: --model-class base gives AutoModel's count") {
  Run run =
      Memplan({"estimate", "--model", "llama-2-7b", "--model-class", "base", "--format", "json"});
  REQUIRE(run.exit_code == 0);
  auto j = nlohmann::json::parse(run.out);
  CHECK(j["model"]["params_total"] == 6607343616);
  CHECK(j["model"]["model_class"] == "base");
}

TEST_CASE("cli: every built-in model estimates, fast") {
  Run list = Memplan({"models", "--format", "json"});
  REQUIRE(list.exit_code == 0);
  auto models = nlohmann::json::parse(list.out);
  REQUIRE(models.size() >= 5);
  std::vector<std::string> names;
  for (const auto& m : models) names.push_back(m["name"]);
  for (const char* want : {"gpt2", "bert-base-uncased", "t5-large", "llama-2-7b", "mistral-7b"}) {
    CHECK(std::find(names.begin(), names.end(), want) != names.end());
  }
  for (const auto& name : names) {
    CAPTURE(name);
    auto start = std::chrono::steady_clock::now();
    Run run = Memplan({"estimate", "--model", name, "--gpus", "4"});
    auto ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start);
    CHECK(run.exit_code == 0);
    CHECK(run.out.find("per CPU  |  per GPU") != std::string::npos);
    // The 50 ms budget is measured by bench/estimate_latency.sh; here a loose bound that a
    // loaded CI machine still meets but a pathological slowdown does not.
    CHECK(ms.count() < 1000);
  }
  Run text = Memplan({"models"});
  CHECK(text.exit_code == 0);
  CHECK(text.out.find("llama-2-7b") != std::string::npos);
}

TEST_CASE("cli: --version and --help") {
  Run v = Memplan({"--version"});
  CHECK(v.exit_code == 0);
  CHECK(v.out.rfind("memplan ", 0) == 0);
  Run h = Memplan({"estimate", "--help"});
  CHECK(h.exit_code == 0);
  CHECK(h.out.find("--gpus") != std::string::npos);
  CHECK(h.out.find("--model-class") != std::string::npos);
  Run none = Memplan({});
  CHECK(none.exit_code == 2);
  CHECK(none.out.empty());
}

TEST_CASE("cli: --output writes the file, and writes nothing when it fails") {
  TempDir tmp(kTempPrefix);
  fs::path out = tmp.path() / "estimate.json";
  Run run = Memplan({"estimate", "--model", "gpt2", "--format", "json", "-o", out.string()});
  REQUIRE(run.exit_code == 0);
  CHECK(run.out.empty());
  CHECK(nlohmann::json::parse(ReadWholeFile(out))["model"]["params_total"] == 124439808);
  fs::path bad = tmp.path() / "missing-dir" / "x.json";
  Run fail = Memplan({"estimate", "--model", "gpt2", "-o", bad.string()});
  ExpectBadInput(fail, {"missing-dir"});
  Run bad_model = Memplan({"estimate", "--model", "nope", "-o", (tmp.path() / "y.json").string()});
  CHECK(bad_model.exit_code == 2);
  CHECK_FALSE(fs::exists(tmp.path() / "y.json"));
  // Only the output file is in the directory: no temporary left behind.
  int entries = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(tmp.path())) ++entries;
  CHECK(entries == 1);
}

TEST_CASE("cli: bad input gets one line naming the file and field, exit 2, empty stdout") {
  TempDir tmp(kTempPrefix);
  const std::string base = R"("model_type": "llama", "vocab_size": 32000, "hidden_size": 4096,
      "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32)";
  auto config = [&](const std::string& name, const std::string& body) {
    return tmp.Write(name, body).string();
  };

  SUBCASE("missing file") {
    std::string p = (tmp.path() / "absent" / "config.json").string();
    ExpectBadInput(Memplan({"estimate", "--model", p}), {p});
  }
  SUBCASE("unreadable file") {
    std::string p = config("secret.json", "{" + base + "}");
    ::chmod(p.c_str(), 0);
    if (::geteuid() != 0) ExpectBadInput(Memplan({"estimate", "--model", p}), {p});
  }
  SUBCASE("directory without a model") {
    fs::create_directory(tmp.path() / "empty");
    ExpectBadInput(Memplan({"estimate", "--model", (tmp.path() / "empty").string()}),
                   {"empty", "config.json"});
  }
  SUBCASE("invalid JSON") {
    std::string p = config("broken.json", "{\"model_type\": \"llama\", ");
    ExpectBadInput(Memplan({"estimate", "--model", p}), {p, "invalid JSON"});
  }
  SUBCASE("unknown model_type lists the supported ones and the shape-list route") {
    std::string p = config("unknown.json", R"({"model_type": "mamba", "hidden_size": 10})");
    ExpectBadInput(Memplan({"estimate", "--model", p}),
                   {p, "'model_type'", "mamba", "llama", "t5", "shape"});
  }
  SUBCASE("missing dimension") {
    std::string p = config("missing.json", R"({"model_type": "llama", "vocab_size": 32000,
        "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32})");
    ExpectBadInput(Memplan({"estimate", "--model", p}), {p, "'hidden_size'", "missing"});
  }
  SUBCASE("zero, negative and absurd dimensions") {
    for (const char* value : {"0", "-4096", "1e15", "99999999999"}) {
      CAPTURE(value);
      std::string body = "{" + base + R"(, "num_hidden_layers": )" + value + "}";
      std::string p = config(std::string("dim") + value + ".json", body);
      ExpectBadInput(Memplan({"estimate", "--model", p}), {p, "'num_hidden_layers'"});
    }
  }
  SUBCASE("--gpus 0 and --nodes -1") {
    ExpectBadInput(Memplan({"estimate", "--model", "gpt2", "--gpus", "0"}), {"--gpus"});
    ExpectBadInput(Memplan({"estimate", "--model", "gpt2", "--nodes", "-1"}), {"--nodes"});
    ExpectBadInput(Memplan({"estimate", "--model", "gpt2", "--gpus", "four"}), {"--gpus"});
  }
  SUBCASE("safetensors header that lies about its length") {
    std::string bytes(8, '\0');
    uint64_t claimed = uint64_t{1} << 40;
    for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((claimed >> (8 * i)) & 0xff);
    bytes += R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})";
    std::string p = tmp.Write("model.safetensors", bytes).string();
    ExpectBadInput(Memplan({"estimate", "--model", p}), {p});
  }
  SUBCASE("unsupported architecture class") {
    std::string p = config("head.json", "{" + base + R"(, "architectures": ["LlamaForAudio"]})");
    ExpectBadInput(Memplan({"estimate", "--model", p}), {p, "'architectures'"});
  }
}

TEST_CASE("cli: inventory lists every tensor with tied aliases") {
  Run run = Memplan({"inventory", "--model", "gpt2", "--format", "json"});
  REQUIRE(run.exit_code == 0);
  auto j = nlohmann::json::parse(run.out);
  CHECK(j["model"]["params_total"] == 124439808);
  bool found_head = false;
  for (const auto& t : j["tensors"]) {
    if (t["name"] == "lm_head.weight") {
      found_head = true;
      CHECK(t["tied_to"] == "transformer.wte.weight");
      CHECK(t["shape"] == nlohmann::json::array({50257, 768}));
    }
  }
  CHECK(found_head);
}

// --- Training setup (issue 3) -------------------------------------------------------------------

TEST_CASE("cli: golden breakdown and comparison for llama-2-7b, ZeRO-3 on 8 GPUs") {
  Run run = Memplan({"estimate", "--model", "llama-2-7b", "--gpus", "8", "--zero-stage", "3",
                     "--seq-len", "4096", "--checkpointing", "full", "--flash-attention"});
  REQUIRE(run.exit_code == 0);
  CHECK(run.err.empty());
  std::string golden =
      ReadWholeFile(Source("tests/golden/estimate_llama-2-7b_zero3_8gpus_seq4096.txt"));
  REQUIRE_FALSE(golden.empty());
  CHECK(run.out == golden);
  // The setup line first, then the DeepSpeed tables, unchanged.
  Run plain = Memplan({"estimate", "--model", "llama-2-7b", "--gpus", "8"});
  REQUIRE(plain.exit_code == 0);
  CHECK(run.out.rfind("Training setup: ", 0) == 0);
  CHECK(run.out.find(plain.out) == run.out.find('\n') + 1);
}

TEST_CASE("cli: setup flags add setup, breakdown, peak and assumptions to the JSON") {
  Run run = Memplan({"estimate", "--model", "gpt2", "--format", "json", "--precision", "fp32",
                     "--optimizer", "adamw", "--micro-batch", "4", "--seq-len", "512",
                     "--grad-accum", "2", "--zero-stage", "2", "--gpus", "2"});
  REQUIRE(run.exit_code == 0);
  auto j = nlohmann::json::parse(run.out);
  CHECK(j["model"]["params_total"] == 124439808);  // the old keys stay
  REQUIRE(j["deepspeed"]["zero2"].size() == 2);
  CHECK(j["setup"]["precision"] == "fp32");
  CHECK(j["setup"]["micro_batch"] == 4);
  CHECK(j["setup"]["seq_len"] == 512);
  CHECK(j["setup"]["grad_accum"] == 2);
  CHECK(j["setup"]["zero_stage"] == 2);
  CHECK(j["setup"]["gpus_per_node"] == 2);
  bool found_grads = false;
  for (const auto& item : j["breakdown"]) {
    REQUIRE(item.contains("gpu_bytes"));
    REQUIRE(item.contains("cpu_bytes"));
    REQUIRE(item.contains("nvme_bytes"));
    REQUIRE(item.contains("pinned_bytes"));
    if (item["item"] == "grads") {
      found_grads = true;
      CHECK(item["gpu_bytes"] == uint64_t{4} * 124439808 / 2);  // fp32, ZeRO-2 over 2 GPUs
    }
  }
  CHECK(found_grads);
  const auto& peak = j["peak"];
  for (const char* key : {"gpu_bytes", "cpu_bytes", "nvme_bytes", "pinned_bytes", "phase"}) {
    CAPTURE(key);
    CHECK(peak.contains(key));
  }
  CHECK(peak["phase"] == "backward");
  CHECK(peak["gpu_bytes"].get<uint64_t>() > uint64_t{4} * 124439808);
  CHECK(j["constants"].size() >= 5);
  bool context = false;
  for (const auto& c : j["constants"]) context |= c["name"] == "cuda_context_bytes";
  CHECK(context);
  CHECK(j["assumptions"].size() > 5);
  CHECK(j["comparison"].size() == 11);
}

TEST_CASE("cli: no setup flag, no new keys (old output unchanged)") {
  Run run = Memplan({"estimate", "--model", "gpt2", "--format", "json"});
  REQUIRE(run.exit_code == 0);
  auto j = nlohmann::json::parse(run.out);
  CHECK_FALSE(j.contains("setup"));
  CHECK_FALSE(j.contains("peak"));
}

TEST_CASE("cli: bad training setups get one line and exit 2") {
  ExpectBadInput(
      Memplan({"estimate", "--model", "gpt2", "--zero-stage", "2", "--offload-param", "cpu"}),
      {"--offload-param", "stage 3"});
  ExpectBadInput(Memplan({"estimate", "--model", "gpt2", "--qlora"}), {"--lora-rank"});
  ExpectBadInput(
      Memplan({"estimate", "--model", "llama-2-7b", "--lora-rank", "8", "--optimizer", "adam8bit"}),
      {"adam8bit"});
  ExpectBadInput(Memplan({"estimate", "--model", "llama-2-7b", "--gpus", "6", "--tp", "6"}),
                 {"--tp", "heads"});
  ExpectBadInput(Memplan({"estimate", "--model", "gpt2", "--precision", "fp8"}), {"--precision"});
  ExpectBadInput(Memplan({"estimate", "--model", "gpt2", "--seq-len", "4096"}),
                 {"--seq-len", "1024"});
  ExpectBadInput(
      Memplan({"estimate", "--model", "gpt2", "--lora-rank", "8", "--lora-targets", "q_proj"}),
      {"q_proj", "c_attn"});
}

TEST_CASE("cli: the library names setup fields, the CLI prints them as flags") {
  // Note [Field names in errors]: C and Python callers read `tp`, `gpus_per_node`; people at the
  // command line read the flags they typed, in errors and in text output alike.
  Run tp = Memplan({"estimate", "--model", "llama-2-7b", "--gpus", "8", "--tp", "3"});
  ExpectBadInput(tp, {"--tp 3 does not divide the 8 GPUs (--gpus x --nodes)"});
  CHECK(tp.err.find('`') == std::string::npos);
  const std::vector<std::string> sgd = {"estimate", "--model",      "gpt2", "--optimizer",
                                        "sgd",      "--zero-stage", "3"};
  Run text = Memplan(sgd);
  REQUIRE(text.exit_code == 0);
  CHECK(text.out.find("--optimizer sgd cannot be offloaded") != std::string::npos);
  CHECK(text.out.find("use --optimizer adamw or lion, or --offload-optimizer none") !=
        std::string::npos);
  CHECK(text.out.find('`') == std::string::npos);
  std::vector<std::string> as_json = sgd;
  as_json.insert(as_json.end(), {"--format", "json"});
  Run json = Memplan(as_json);
  REQUIRE(json.exit_code == 0);
  CHECK(json.out.find("`optimizer` sgd cannot be offloaded") != std::string::npos);
}

TEST_CASE("cli: --deepspeed reads the config; flags fill its \"auto\" values") {
  TempDir tmp(kTempPrefix);
  std::string ds = tmp.Write("ds_config.json", R"({
      "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 1,
      "bf16": {"enabled": true},
      "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                            "offload_param": {"device": "cpu"},
                            "reduce_bucket_size": "auto"}})")
                       .string();
  Run missing = Memplan({"estimate", "--model", "llama-2-7b", "--deepspeed", ds});
  ExpectBadInput(missing, {ds, "train_micro_batch_size_per_gpu", "--micro-batch"});
  Run run = Memplan({"estimate", "--model", "llama-2-7b", "--gpus", "8", "--deepspeed", ds,
                     "--micro-batch", "2", "--seq-len", "2048", "--format", "json"});
  REQUIRE(run.exit_code == 0);
  auto j = nlohmann::json::parse(run.out);
  CHECK(j["setup"]["zero_stage"] == 3);
  CHECK(j["setup"]["offload_optimizer"] == "cpu");
  CHECK(j["setup"]["offload_param"] == "cpu");
  CHECK(j["setup"]["micro_batch"] == 2);
  CHECK(j["setup"]["reduce_bucket_size"] == 4096 * 4096);
  CHECK(j["peak"]["cpu_bytes"].get<uint64_t>() > 0);
  std::string bad = tmp.Write("bad.json", R"({"zero_optimization": {"stage": "three"}})").string();
  ExpectBadInput(Memplan({"estimate", "--model", "gpt2", "--deepspeed", bad}),
                 {bad, "zero_optimization.stage"});
}

// --- The Hub (a fake one on loopback: tests never reach the network) -------------------------

// memplan run with `env` set first (HF_* variables), capturing as Memplan does.
Run MemplanWithEnv(const std::vector<std::string>& env, const std::vector<std::string>& args) {
  std::vector<std::string> all = {
      "-u", "HF_TOKEN", "-u", "HF_HUB_OFFLINE", "-u", "TRANSFORMERS_OFFLINE"};
  all.insert(all.end(), env.begin(), env.end());
  all.push_back(MEMPLAN_BINARY);
  all.insert(all.end(), args.begin(), args.end());
  return memplan::testing::RunCommand("env", all);
}

TEST_CASE("cli: --model org/name is fetched from the Hub into the cache, never when offline") {
  TempDir tmp(kTempPrefix);
  memplan::testing::FakeHub hub;
  hub.files["org/tiny"]["config.json"] = ReadWholeFile(Source("estimator/models/gpt2.json"));
  const std::vector<std::string> env = {"HF_ENDPOINT=" + hub.endpoint(),
                                        "HF_HUB_CACHE=" + tmp.PathOf("hub"),
                                        "HF_HOME=" + tmp.PathOf("home")};
  // --offline and HF_HUB_OFFLINE=1: not one connection, and the error says why.
  Run offline = MemplanWithEnv(env, {"estimate", "--model", "org/tiny", "--offline"});
  ExpectBadInput(offline, {"org/tiny", "not in the local Hugging Face cache",
                           "fetching from the Hub is off (--offline)"});
  std::vector<std::string> env_offline = env;
  env_offline.push_back("HF_HUB_OFFLINE=1");
  Run offline_env = MemplanWithEnv(
      env_offline, {"plan", "--model", "org/tiny", "--gpu", "a100-80", "--global-batch", "8"});
  ExpectBadInput(offline_env, {"fetching from the Hub is off (HF_HUB_OFFLINE=1)"});
  CHECK(hub.connections() == 0);
  CHECK_FALSE(fs::exists(tmp.PathOf("hub")));

  Run fetched = MemplanWithEnv(env, {"estimate", "--model", "org/tiny"});
  REQUIRE(fetched.exit_code == 0);
  CHECK(fetched.out.find("124,439,808") != std::string::npos);
  CHECK(fetched.err == "memplan: fetching org/tiny config.json from " + hub.endpoint() + "\n");
  CHECK(hub.connections() == 1);
  // Now in the cache: offline works, and nothing more is asked of the server.
  Run cached = MemplanWithEnv(env_offline, {"estimate", "--model", "org/tiny", "--format", "json"});
  REQUIRE(cached.exit_code == 0);
  CHECK(cached.err.empty());
  CHECK(hub.connections() == 1);

  // A gated repository: the error says to accept the licence and log in.
  hub.gated = {"meta-llama/Llama-4-Secret"};
  Run gated = MemplanWithEnv(env, {"estimate", "--model", "meta-llama/Llama-4-Secret"});
  CHECK(gated.exit_code == 2);
  CHECK(gated.err.find("gated repository: accept its licence") != std::string::npos);
}

TEST_CASE("cli: did you mean, for built-in names and flags") {
  ExpectBadInput(Memplan({"estimate", "--model", "lama-3.1-8b"}),
                 {"model 'lama-3.1-8b'", "(did you mean llama-3.1-8b?)"});
  ExpectBadInput(Memplan({"estimate", "--model", "gpt2", "--gpu", "4"}),
                 {"--gpu", "(did you mean --gpus or --gpu-arch?)"});
}

TEST_CASE("cli: estimate --inference prints accelerate's table and the KV cache") {
  Run text = Memplan(
      {"estimate", "--model", "llama-3.1-8b", "--inference", "--context", "8192", "--batch", "2"});
  REQUIRE(text.exit_code == 0);
  CHECK(text.err.empty());
  CHECK(text.out.find("accelerate estimate-memory") != std::string::npos);
  CHECK(text.out.find("float16/bfloat16") != std::string::npos);
  CHECK(text.out.find("int4") != std::string::npos);
  // 32 layers x 2 x 8 heads x 128 x 2 bytes = 128 KiB a token; x 8192 x 2 = 2 GiB.
  CHECK(text.out.find("bfloat16, batch 2 x context 8192: 2.00 GiB") != std::string::npos);
  CHECK(text.out.find("128.00 KiB per token") != std::string::npos);
  CHECK(text.out.find("ZeRO-2") == std::string::npos);

  Run json = Memplan({"estimate", "--model", "llama-3.1-8b", "--context", "8192", "--batch", "2",
                      "--kv-dtype", "fp8", "--format", "json"});
  REQUIRE(json.exit_code == 0);
  auto doc = nlohmann::json::parse(json.out);
  const auto& inference = doc["inference"];
  CHECK(inference["kv_cache"]["bytes"] == 131072ull * 8192 * 2 / 2);
  CHECK(inference["kv_cache"]["dtype"] == "float8_e4m3fn");
  CHECK(inference["weights"][0]["total_bytes"] == doc["model"]["accelerate_total_bytes"]);
  CHECK(doc.contains("deepspeed"));  // JSON keeps every table

  ExpectBadInput(Memplan({"estimate", "--model", "gpt2", "--inference", "--kv-dtype", "int3"}),
                 {"--kv-dtype"});
  ExpectBadInput(Memplan({"estimate", "--model", "gpt2", "--context", "0"}), {"--context"});
  ExpectBadInput(Memplan({"estimate", "--model", "t5-large", "--encoder-context", "0"}),
                 {"--encoder-context"});

  // The quantizers' rows, and T5's cache: 24 decoder layers x 8 KiB a token (fp32), over 16
  // decoder tokens and 512 encoder tokens.
  CHECK(text.out.find("nf4") != std::string::npos);
  CHECK(text.out.find("6,979,321,856 params quantized, gptq") != std::string::npos);
  Run t5 = Memplan({"estimate", "--model", "t5-large", "--context", "16", "--encoder-context",
                    "512", "--format", "json"});
  REQUIRE(t5.exit_code == 0);
  auto t5_doc = nlohmann::json::parse(t5.out)["inference"];
  CHECK(t5_doc["kv_cache"]["encoder_context"] == 512);
  CHECK(t5_doc["kv_cache"]["cross_attention_bytes"] == 196'608ull * 512);
  CHECK(t5_doc["kv_cache"]["bytes"] == 196'608ull * (16 + 512));
  CHECK(t5_doc["weights"][5]["dtype"] == "nf4");
  CHECK(t5_doc["weights"][5]["method"] == "bitsandbytes");
}

TEST_CASE("cli: every causal LM built in or in the oracle's configs estimates training and plans") {
  std::vector<fs::path> configs;
  for (const char* dir : {"estimator/models", "tests/oracle/modern_configs"}) {
    for (const auto& entry : fs::directory_iterator(Source(dir))) configs.push_back(entry.path());
  }
  int causal = 0;
  for (const fs::path& path : configs) {
    auto config = nlohmann::json::parse(ReadWholeFile(path));
    const std::string arch = config.value("architectures", nlohmann::json::array()).empty()
                                 ? std::string()
                                 : config["architectures"][0].get<std::string>();
    if (arch.find("ForCausalLM") == std::string::npos &&
        arch.find("LMHeadModel") == std::string::npos &&
        arch.find("ForConditionalGeneration") == std::string::npos) {  // and Llava, Gemma-3
      continue;
    }
    if (arch.rfind("T5", 0) == 0) continue;
    ++causal;
    CAPTURE(path.string());
    Run estimate = Memplan({"estimate", "--model", path.string(), "--micro-batch", "1", "--seq-len",
                            "1024", "--zero-stage", "3", "--format", "json"});
    CHECK(estimate.exit_code == 0);
    CAPTURE(estimate.err);
    Run plan = Memplan({"plan", "--model", path.string(), "--gpu", "h100-80", "--gpus", "8",
                        "--nodes", "4", "--global-batch", "256", "--seq-len", "1024"});
    CHECK(plan.exit_code == 0);
    CAPTURE(plan.err);
    Run inference =
        Memplan({"estimate", "--model", path.string(), "--inference", "--format", "json"});
    REQUIRE(inference.exit_code == 0);
    CHECK(nlohmann::json::parse(inference.out)["inference"].contains("kv_cache"));
  }
  CHECK(causal >= 40);
}

}  // namespace
