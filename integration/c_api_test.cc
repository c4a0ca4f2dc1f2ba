// The C API (memplan.h) through libmemplan_c.so, as a C trainer uses it: estimate and plan give the
// same documents as integration::requests (and the CLI); an engine opened from schedule JSON
// trains two modules' parameters on the host runtime, with the first AdamW step checked element by
// element; failures come back as the right memplan_status with a message naming the culprit, and
// nothing throws across the boundary.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "integration/requests.h"
#include "memplan.h"
#include "tests/testing.h"
#include "tests/status_testing.h"

namespace {

using memplan::testing::TempDir;
using nlohmann::json;

// Takes ownership of a string the C API handed out.
struct CString {
  char* text = nullptr;
  ~CString() { memplan_string_free(text); }
  json Parse() const {
    REQUIRE(text != nullptr);
    return json::parse(text);
  }
};

std::string LastError() { return memplan_last_error(); }

TEST_CASE("c api: version, ABI and status names") {
  CHECK(memplan_abi_version() == MEMPLAN_ABI_VERSION);
  CHECK(std::string(memplan_version()) == MEMPLAN_VERSION);
  CHECK(std::string(memplan_status_name(MEMPLAN_OK)) == "OK");
  CHECK(std::string(memplan_status_name(MEMPLAN_INVALID_ARGUMENT)) == "INVALID_ARGUMENT");
  CHECK(std::string(memplan_status_name(MEMPLAN_INTERNAL)) == "INTERNAL");
  memplan_string_free(nullptr);  // a no-op, as free(NULL)
}

TEST_CASE("c api: estimate of a built-in model is the requests.h answer") {
  const char* request = R"({"model": "llama-2-7b", "gpus": 4})";
  CString answer;
  REQUIRE_MESSAGE(memplan_estimate_json(request, &answer.text) == MEMPLAN_OK, LastError());
  const json got = answer.Parse();
  auto expected = memplan::integration::Estimate(json::parse(request));
  REQUIRE_OK(expected);
  CHECK(got == *expected);
  // The published parameter count; ZeRO-2 with the optimizer offloaded keeps the 16-bit
  // parameters on each GPU, 2 bytes a parameter (estimate_zero2_model_states_mem_needs).
  CHECK(got["model"]["params_total"] == 6738415616);
  CHECK(got["hardware"]["gpus_per_node"] == 4);
  CHECK(got["deepspeed"]["zero2"][0]["offload_optimizer"] == "cpu");
  CHECK(got["deepspeed"]["zero2"][0]["gpu_bytes"] == uint64_t{2} * 6738415616);

  // The shorthand gives the same document.
  CString path;
  REQUIRE_MESSAGE(memplan_estimate_path("llama-2-7b", 4, 1, &path.text) == MEMPLAN_OK, LastError());
  CHECK(path.Parse() == got);
}

TEST_CASE("c api: a bad request is INVALID_ARGUMENT naming the key, and *out is NULL") {
  char* answer = reinterpret_cast<char*>(&answer);  // garbage the call must overwrite
  CHECK(memplan_estimate_json(R"({"model": "llama-2-7b", "gpuz": 4})", &answer) ==
        MEMPLAN_INVALID_ARGUMENT);
  CHECK(answer == nullptr);
  CHECK(LastError().find("unknown key 'gpuz' (did you mean gpus?)") != std::string::npos);
  CHECK(LastError().find("memplan_estimate_json") == 0);

  CHECK(memplan_estimate_json(R"({"model": "llama-2-7b", "gpus": "four"})", &answer) ==
        MEMPLAN_INVALID_ARGUMENT);
  CHECK(LastError().find("request: 'gpus' must be an integer") != std::string::npos);

  CHECK(memplan_estimate_json("{not json", &answer) == MEMPLAN_INVALID_ARGUMENT);
  CHECK(LastError().find("invalid JSON") != std::string::npos);

  CHECK(memplan_estimate_json(nullptr, &answer) == MEMPLAN_INVALID_ARGUMENT);
  CHECK(LastError().find("request_json") != std::string::npos);
  CHECK(memplan_estimate_json("{}", nullptr) == MEMPLAN_INVALID_ARGUMENT);
  CHECK(LastError().find("answer_json") != std::string::npos);

  CHECK(memplan_estimate_path("no-such-model-anywhere", 1, 1, &answer) != MEMPLAN_OK);
  CHECK(answer == nullptr);
  CHECK(memplan_estimate_path("llama-2-7b", 0, 1, &answer) == MEMPLAN_INVALID_ARGUMENT);

  CHECK(memplan_plan_json(R"({"model": "llama-2-7b", "gpu": "a100-80", "colour": 1})", &answer) ==
        MEMPLAN_INVALID_ARGUMENT);
  CHECK(LastError().find("colour") != std::string::npos);
}

TEST_CASE("c api: plan of llama-2-7b on 8 x a100-80 with the DeepSpeed config emitted") {
  const char* request = R"({"model": "llama-2-7b", "gpu": "a100-80", "gpus": 8,
                            "global_batch": 64, "seq_len": 2048, "emit": ["deepspeed"]})";
  CString answer;
  REQUIRE_MESSAGE(memplan_plan_json(request, &answer.text) == MEMPLAN_OK, LastError());
  const json got = answer.Parse();
  REQUIRE(got.contains("plans"));
  CHECK(!got["plans"].empty());
  CHECK(got["plans"].size() <= 5);
  REQUIRE(got.contains("emitted"));
  CHECK(got["emitted"].contains("deepspeed"));
  CHECK(got["emitted"]["deepspeed"].contains("zero_optimization"));
  CHECK(got["emitted_plan_index"] == 0);
  auto expected = memplan::integration::Plan(json::parse(request));
  REQUIRE_OK(expected);
  CHECK(got == *expected);
}

// Note [Field names in errors]: a C caller wrote "micro_batch" in its request, never the CLI's
// --micro-batch, so the planner's errors and the answer's words name the request's fields.
TEST_CASE("c api: plan errors name the request's fields, not CLI flags") {
  char* answer = nullptr;
  CHECK(memplan_plan_json(R"({"model": "llama-2-7b", "gpu": "a100-80", "gpus": 8,
                              "global_batch": 64, "micro_batch": 3})",
                          &answer) == MEMPLAN_INVALID_ARGUMENT);
  CHECK(answer == nullptr);
  CHECK(LastError().find("`micro_batch` 3 does not divide the 8 sequences per GPU of "
                         "`global_batch` 64") != std::string::npos);
  CHECK(LastError().find("--") == std::string::npos);
  CHECK(memplan_plan_json(R"({"model": "llama-2-7b", "gpu": "a100-80", "gpus": 6,
                              "global_batch": 64})",
                          &answer) == MEMPLAN_INVALID_ARGUMENT);
  CHECK(LastError().find("`global_batch` 64 is not a multiple of the 6 GPUs") != std::string::npos);
  CHECK(memplan_plan_json(R"({"model": "llama-2-7b", "gpu": "z100", "global_batch": 64})",
                          &answer) == MEMPLAN_INVALID_ARGUMENT);
  CHECK(LastError().find("`gpu` 'z100': not a known GPU") != std::string::npos);

  // A plan that does not fit says what would, in the request's words.
  CString nofit;
  REQUIRE_MESSAGE(memplan_plan_json(R"({"model": "llama-2-70b", "gpu": "rtx4090", "gpus": 8,
                                        "global_batch": 64, "seq_len": 4096})",
                                    &nofit.text) == MEMPLAN_OK,
                  LastError());
  const std::string words = nofit.Parse().dump();
  CHECK(words.find("--") == std::string::npos);
  CHECK(words.find("`cpu_mem`") != std::string::npos);  // host RAM not checked: give `cpu_mem`
}

// ---- Engine -------------------------------------------------------------------------------------

std::string ScheduleJson(const std::string& dtype, const std::string& path) {
  const json schedule = {
      {"version", 1},
      // Threshold 0: every parameter goes through the NVMe store, none stays resident.
      {"params",
       {{"tier", "nvme"},
        {"dtype", dtype},
        {"persistence_threshold", 0},
        {"buffer_bytes", 4096},
        {"buffer_count", 2}}},
      {"optimizer",
       {{"tier", "cpu"}, {"name", "adam"}, {"sub_group_elements", 1024}, {"threads", 1}}},
      {"nvme", {{"path", path}, {"backend", "posix"}, {"direct", false}}},
  };
  return schedule.dump();
}

uint16_t FloatToBf16Bits(float f) {  // truncation: the test's values are exact in bf16
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return static_cast<uint16_t>(bits >> 16);
}

// The first AdamW step as Note [AdamW formula] (offload/cpu_optimizer.cc) does it: scalars in
// double rounded to float once, element-wise work in float, moments starting at zero.
float FirstAdamWStep(float p, float g, double lr, double wd) {
  const double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  const auto decay = static_cast<float>(1.0 - lr * wd);
  const auto one_minus_beta1 = static_cast<float>(1.0 - beta1);
  const auto one_minus_beta2 = static_cast<float>(1.0 - beta2);
  const auto bias_correction2_sqrt = static_cast<float>(std::sqrt(1.0 - beta2));
  const auto neg_step_size = static_cast<float>(-(lr / (1.0 - beta1)));
  p = p * decay;
  const float m = 0.0f * static_cast<float>(beta1) + one_minus_beta1 * g;
  const float v = 0.0f * static_cast<float>(beta2) + one_minus_beta2 * g * g;
  const float denom = std::sqrt(v) / bias_correction2_sqrt + static_cast<float>(eps);
  return p + neg_step_size * m / denom;
}

struct TestParam {
  const char* name;
  const char* module;
  std::vector<int64_t> shape;
  std::vector<float> init;
  std::vector<float> grad;
  uint32_t id = 0;
};

// Three parameters in two modules; values multiples of 1/8 in [-1, 1] (exact in bf16), gradients
// with zeros among them (an element whose first step is the weight decay alone).
std::vector<TestParam> TestModel() {
  std::vector<TestParam> params = {{"m0.weight", "m0", {4, 8}, {}, {}},
                                   {"m0.bias", "m0", {8}, {}, {}},
                                   {"m1.weight", "m1", {8, 3}, {}, {}}};
  int k = 0;
  for (TestParam& p : params) {
    int64_t n = 1;
    for (int64_t d : p.shape) n *= d;
    for (int64_t i = 0; i < n; ++i, ++k) {
      p.init.push_back(static_cast<float>((k * 5) % 17 - 8) / 8.0f);
      p.grad.push_back(static_cast<float>((k * 7) % 11 - 5) * 0.25f);
    }
  }
  return params;
}

// Opens an engine with `dtype` working parameters (every dtype must be supported).
void Open(const std::string& dtype, const std::string& path, memplan_engine** engine) {
  const memplan_status s =
      memplan_engine_open(ScheduleJson(dtype, path).c_str(), R"({"runtime": "host"})", engine);
  REQUIRE_MESSAGE(s == MEMPLAN_OK, LastError());
  REQUIRE(*engine != nullptr);
}

void RoundTrip(const std::string& dtype) {
  TempDir dir("memplan_capi_");
  memplan_engine* engine = nullptr;
  Open(dtype, dir.PathOf("nvme"), &engine);

  std::vector<TestParam> params = TestModel();
  for (TestParam& p : params) {
    REQUIRE_MESSAGE(memplan_engine_register(engine, p.name, p.module, p.shape.data(),
                                            static_cast<int32_t>(p.shape.size()), p.init.data(),
                                            &p.id) == MEMPLAN_OK,
                    LastError());
  }
  CHECK(params[0].id == 0);
  CHECK(params[2].id == 2);
  uint64_t numel = 0;
  REQUIRE(memplan_engine_numel(engine, params[2].id, &numel) == MEMPLAN_OK);
  CHECK(numel == 24);

  // Before start: no fetch, no pointer.
  CHECK(memplan_engine_fetch(engine, "m0") == MEMPLAN_FAILED_PRECONDITION);
  CHECK(LastError().find("not started") != std::string::npos);
  void* pointer = nullptr;
  CHECK(memplan_engine_device_pointer(engine, 0, &pointer) == MEMPLAN_FAILED_PRECONDITION);

  REQUIRE_MESSAGE(memplan_engine_start(engine) == MEMPLAN_OK, LastError());
  CHECK(memplan_engine_start(engine) == MEMPLAN_FAILED_PRECONDITION);
  uint32_t late = 0;
  const int64_t one = 1;
  CHECK(memplan_engine_register(engine, "late", "m0", &one, 1, nullptr, &late) ==
        MEMPLAN_FAILED_PRECONDITION);
  CHECK(memplan_engine_fetch(engine, "no-such-module") == MEMPLAN_NOT_FOUND);
  CHECK(LastError().find("no-such-module") != std::string::npos);

  // Forward: each module's working copies hold the initial values (bf16: exactly, as chosen).
  for (const char* module : {"m0", "m1"}) {
    REQUIRE_MESSAGE(memplan_engine_fetch(engine, module) == MEMPLAN_OK, LastError());
    for (const TestParam& p : params) {
      if (std::string(p.module) != module) continue;
      REQUIRE_MESSAGE(memplan_engine_device_pointer(engine, p.id, &pointer) == MEMPLAN_OK,
                      LastError());
      REQUIRE(pointer != nullptr);
      for (size_t i = 0; i < p.init.size(); ++i) {
        if (dtype == "fp32") {
          CHECK(static_cast<const float*>(pointer)[i] == p.init[i]);
        } else {
          CHECK(static_cast<const uint16_t*>(pointer)[i] == FloatToBf16Bits(p.init[i]));
        }
      }
    }
    REQUIRE_MESSAGE(memplan_engine_release(engine, module) == MEMPLAN_OK, LastError());
  }
  // Backward: fp32 gradients (host memory is "device" memory on the host runtime).
  for (const TestParam& p : params) {
    REQUIRE_MESSAGE(
        memplan_engine_grad_ready(engine, p.id, p.grad.data(), MEMPLAN_FLOAT32) == MEMPLAN_OK,
        LastError());
  }
  CHECK(memplan_engine_step(engine, R"({"lr": 0.1, "momentum": 0.9})") == MEMPLAN_INVALID_ARGUMENT);
  CHECK(LastError().find("momentum") != std::string::npos);
  REQUIRE_MESSAGE(memplan_engine_step(engine, R"({"lr": 0.1})") == MEMPLAN_OK, LastError());

  const double lr = 0.1, wd = 0.01;  // weight_decay: AdamOptions' default
  for (const TestParam& p : params) {
    std::vector<float> master(p.init.size());
    REQUIRE_MESSAGE(
        memplan_engine_read_master(engine, p.id, master.data(), master.size()) == MEMPLAN_OK,
        LastError());
    for (size_t i = 0; i < master.size(); ++i) {
      const float expected = FirstAdamWStep(p.init[i], p.grad[i], lr, wd);
      CHECK(master[i] == doctest::Approx(expected).epsilon(1e-6));
      // Roughly: the first step moves each weight by -lr * sign(g), plus the decay.
      const float sign = p.grad[i] > 0 ? 1.0f : (p.grad[i] < 0 ? -1.0f : 0.0f);
      const double rough = p.init[i] - lr * sign - lr * wd * p.init[i];
      CHECK(master[i] == doctest::Approx(rough).epsilon(1e-5));
    }
  }
  std::vector<float> wrong(3);
  CHECK(memplan_engine_read_master(engine, params[0].id, wrong.data(), wrong.size()) ==
        MEMPLAN_INVALID_ARGUMENT);

  CString stats;
  REQUIRE_MESSAGE(memplan_engine_stats_json(engine, &stats.text) == MEMPLAN_OK, LastError());
  const json s = stats.Parse();
  CHECK(s["steps"] == 1);
  CHECK(s["params"] == 3);
  CHECK(s["elements"] == 32 + 8 + 24);
  CHECK(s["runtime"] == "host-only");
  CHECK(s["param"]["fetch_calls"] == 2);
  CHECK(s["param"]["nvme_write_bytes"].get<uint64_t>() > 0);

  CHECK(memplan_engine_close(engine) == MEMPLAN_OK);
}

TEST_CASE("c api: engine round trip, bf16 working parameters on NVMe") { RoundTrip("bf16"); }

TEST_CASE("c api: engine round trip, fp32 working parameters on NVMe") { RoundTrip("fp32"); }

TEST_CASE("c api: tied parameter, zero init, and a step without every gradient") {
  TempDir dir("memplan_capi_");
  memplan_engine* engine = nullptr;
  Open("bf16", dir.PathOf("nvme"), &engine);
  const int64_t shape[] = {2, 4};
  uint32_t embed = 0, head = 0;
  REQUIRE(memplan_engine_register(engine, "embed", "embed", shape, 2, nullptr, &embed) ==
          MEMPLAN_OK);
  REQUIRE(memplan_engine_register(engine, "head.bias", "head", shape, 1, nullptr, &head) ==
          MEMPLAN_OK);
  REQUIRE_MESSAGE(memplan_engine_add_use(engine, embed, "head") == MEMPLAN_OK, LastError());
  CHECK(memplan_engine_add_use(engine, 7, "head") == MEMPLAN_INVALID_ARGUMENT);
  CHECK(LastError().find("7") != std::string::npos);
  REQUIRE_MESSAGE(memplan_engine_start(engine) == MEMPLAN_OK, LastError());

  // "head" brings the tied embedding too; NULL init gave zeros.
  REQUIRE_MESSAGE(memplan_engine_fetch(engine, "head") == MEMPLAN_OK, LastError());
  void* pointer = nullptr;
  REQUIRE_MESSAGE(memplan_engine_device_pointer(engine, embed, &pointer) == MEMPLAN_OK,
                  LastError());
  for (int i = 0; i < 8; ++i) CHECK(static_cast<const uint16_t*>(pointer)[i] == 0);
  REQUIRE(memplan_engine_release(engine, "head") == MEMPLAN_OK);

  const std::vector<float> grad(8, 1.0f);
  REQUIRE(memplan_engine_grad_ready(engine, embed, grad.data(), MEMPLAN_FLOAT32) == MEMPLAN_OK);
  CHECK(memplan_engine_grad_ready(engine, head, grad.data(), static_cast<memplan_dtype>(9)) ==
        MEMPLAN_INVALID_ARGUMENT);
  CHECK(memplan_engine_step(engine, nullptr) == MEMPLAN_FAILED_PRECONDITION);
  CHECK(LastError().find("head.bias") != std::string::npos);
  // Declared without a gradient, head.bias is skipped (left at its zeros); the step runs.
  std::vector<float> before(2);  // head.bias: shape {2}
  REQUIRE(memplan_engine_read_master(engine, head, before.data(), 2) == MEMPLAN_OK);
  REQUIRE_MESSAGE(memplan_engine_no_gradient(engine, head) == MEMPLAN_OK, LastError());
  REQUIRE_MESSAGE(memplan_engine_step(engine, nullptr) == MEMPLAN_OK, LastError());
  std::vector<float> after(2);
  REQUIRE(memplan_engine_read_master(engine, head, after.data(), 2) == MEMPLAN_OK);
  CHECK(before == after);
  std::vector<float> embedding(8);
  REQUIRE(memplan_engine_read_master(engine, embed, embedding.data(), 8) == MEMPLAN_OK);
  CHECK(embedding[0] != 0.0f);  // stepped: its gradient was given
  CHECK(memplan_engine_close(engine) == MEMPLAN_OK);
}

TEST_CASE("c api: a frozen parameter is fetched with its values and never stepped") {
  TempDir dir("memplan_capi_");
  memplan_engine* engine = nullptr;
  Open("fp32", dir.PathOf("nvme"), &engine);
  const int64_t shape[] = {3000};
  std::vector<float> base(3000), adapter(3000, 0.5f);
  for (size_t i = 0; i < base.size(); ++i) base[i] = static_cast<float>(i) * 0.001f;
  uint32_t frozen = 0, trained = 0;
  REQUIRE(memplan_engine_register(engine, "base", "m", shape, 1, base.data(), &frozen) ==
          MEMPLAN_OK);
  REQUIRE(memplan_engine_register(engine, "adapter", "m", shape, 1, adapter.data(), &trained) ==
          MEMPLAN_OK);
  REQUIRE_MESSAGE(memplan_engine_freeze(engine, frozen) == MEMPLAN_OK, LastError());
  CHECK(memplan_engine_freeze(engine, 9) == MEMPLAN_INVALID_ARGUMENT);
  REQUIRE_MESSAGE(memplan_engine_start(engine) == MEMPLAN_OK, LastError());
  CHECK(memplan_engine_freeze(engine, frozen) == MEMPLAN_FAILED_PRECONDITION);
  const std::vector<float> grad(3000, 1.0f);
  for (int step = 0; step < 2; ++step) {
    REQUIRE(memplan_engine_fetch(engine, "m") == MEMPLAN_OK);
    void* pointer = nullptr;
    REQUIRE(memplan_engine_device_pointer(engine, frozen, &pointer) == MEMPLAN_OK);
    CHECK(std::memcmp(pointer, base.data(), base.size() * 4) == 0);
    REQUIRE(memplan_engine_release(engine, "m") == MEMPLAN_OK);
    CHECK(memplan_engine_grad_ready(engine, frozen, grad.data(), MEMPLAN_FLOAT32) ==
          MEMPLAN_INVALID_ARGUMENT);
    REQUIRE(memplan_engine_grad_ready(engine, trained, grad.data(), MEMPLAN_FLOAT32) == MEMPLAN_OK);
    REQUIRE_MESSAGE(memplan_engine_step(engine, nullptr) == MEMPLAN_OK, LastError());
  }
  std::vector<float> out(3000);
  CHECK(memplan_engine_read_master(engine, frozen, out.data(), out.size()) ==
        MEMPLAN_FAILED_PRECONDITION);
  REQUIRE(memplan_engine_read_master(engine, trained, out.data(), out.size()) == MEMPLAN_OK);
  CHECK(out[0] < 0.5f);  // stepped against a positive gradient
  CHECK(memplan_engine_close(engine) == MEMPLAN_OK);
}

TEST_CASE("c api: a prepared step runs during backward and ends where the serial one does") {
  TempDir dir("memplan_capi_");
  // Both stores on NVMe; sub-groups of 1024 elements, so the 3000-element parameters span several.
  json schedule = json::parse(ScheduleJson("fp32", dir.PathOf("serial")));
  schedule["optimizer"]["tier"] = "nvme";
  std::vector<std::vector<float>> results;
  for (bool prepare : {false, true}) {
    CAPTURE(prepare);
    schedule["nvme"]["path"] = dir.PathOf(prepare ? "prepared" : "serial");
    memplan_engine* engine = nullptr;
    REQUIRE_MESSAGE(memplan_engine_open(schedule.dump().c_str(), R"({"runtime": "host"})",
                                        &engine) == MEMPLAN_OK,
                    LastError());
    const int64_t shape[] = {3000};
    std::vector<std::vector<float>> init(3, std::vector<float>(3000));
    uint32_t ids[3];
    for (int p = 0; p < 3; ++p) {
      for (size_t i = 0; i < 3000; ++i) init[p][i] = static_cast<float>((i * (p + 3)) % 17) * 0.01f;
      const std::string name = "w" + std::to_string(p), module = "m" + std::to_string(p);
      REQUIRE(memplan_engine_register(engine, name.c_str(), module.c_str(), shape, 1,
                                      init[p].data(), &ids[p]) == MEMPLAN_OK);
    }
    REQUIRE_MESSAGE(memplan_engine_start(engine) == MEMPLAN_OK, LastError());
    CHECK(memplan_engine_prepare_step(nullptr, nullptr) == MEMPLAN_INVALID_ARGUMENT);
    std::vector<float> grad(3000);
    for (int step = 1; step <= 3; ++step) {
      const std::string options = R"({"lr": )" + std::to_string(0.01 * step) + "}";
      if (prepare) {
        REQUIRE_MESSAGE(memplan_engine_prepare_step(engine, options.c_str()) == MEMPLAN_OK,
                        LastError());
      }
      for (int p = 2; p >= 0; --p) {  // backward: the last parameter's gradient first
        for (size_t i = 0; i < grad.size(); ++i) {
          grad[i] = static_cast<float>((i * 7 + step * 3 + p) % 23) * 0.01f - 0.1f;
        }
        REQUIRE(memplan_engine_grad_ready(engine, ids[p], grad.data(), MEMPLAN_FLOAT32) ==
                MEMPLAN_OK);
        if (prepare) {
          CHECK(memplan_engine_prepare_step(engine, options.c_str()) ==
                MEMPLAN_FAILED_PRECONDITION);
        }
      }
      REQUIRE_MESSAGE(memplan_engine_step(engine, options.c_str()) == MEMPLAN_OK, LastError());
    }
    char* text = nullptr;
    REQUIRE(memplan_engine_stats_json(engine, &text) == MEMPLAN_OK);
    const json stats = json::parse(text);
    memplan_string_free(text);
    CHECK(stats.at("step_profile").at("overlapped") == prepare);
    CHECK(stats.at("step_profile").at("sub_groups") == 9);
    CHECK(stats.at("step_profile").at("step_s").get<double>() > 0);
    std::vector<float> all;
    for (uint32_t id : ids) {
      std::vector<float> out(3000);
      REQUIRE(memplan_engine_read_master(engine, id, out.data(), out.size()) == MEMPLAN_OK);
      all.insert(all.end(), out.begin(), out.end());
    }
    results.push_back(all);
    if (prepare) {
      // Other options at step(): refused, and the step is abandoned (nothing applied).
      REQUIRE(memplan_engine_prepare_step(engine, R"({"lr": 0.5})") == MEMPLAN_OK);
      for (uint32_t id : ids) {
        REQUIRE(memplan_engine_grad_ready(engine, id, grad.data(), MEMPLAN_FLOAT32) == MEMPLAN_OK);
      }
      CHECK(memplan_engine_step(engine, R"({"lr": 0.25})") == MEMPLAN_FAILED_PRECONDITION);
      CHECK(LastError().find("other options") != std::string::npos);
      std::vector<float> out(3000);
      REQUIRE(memplan_engine_read_master(engine, ids[0], out.data(), out.size()) == MEMPLAN_OK);
      CHECK(std::memcmp(out.data(), all.data(), out.size() * 4) == 0);
    }
    CHECK(memplan_engine_close(engine) == MEMPLAN_OK);
  }
  REQUIRE(results[0].size() == results[1].size());
  CHECK(std::memcmp(results[0].data(), results[1].data(), results[0].size() * 4) == 0);
}

// A C trainer's state filler: the saved shards of every parameter, by id and array.
struct SavedState {
  std::vector<std::vector<std::vector<float>>> arrays;  // [param][array] this rank's shard
};

int FillFromSaved(void* user, uint32_t param, int32_t array, uint64_t first, float* out,
                  uint64_t count) {
  const auto* saved = static_cast<const SavedState*>(user);
  const std::vector<float>& src = saved->arrays[param][static_cast<size_t>(array)];
  if (first + count > src.size()) return 1;
  std::memcpy(out, src.data() + first, count * sizeof(float));
  return 0;
}

TEST_CASE("c api: groups, clipping, the gradient norm, an abandoned step, state out and back") {
  TempDir dir("memplan_capi_");
  std::vector<TestParam> params = TestModel();
  auto open = [&](const std::string& sub, memplan_engine** engine) {
    Open("fp32", dir.PathOf(sub), engine);
    for (TestParam& p : params) {
      REQUIRE_MESSAGE(memplan_engine_register(*engine, p.name, p.module, p.shape.data(),
                                              static_cast<int32_t>(p.shape.size()), p.init.data(),
                                              &p.id) == MEMPLAN_OK,
                      LastError());
    }
    // The bias in group 1: no weight decay, another learning rate.
    REQUIRE(memplan_engine_set_group(*engine, params[1].id, 1) == MEMPLAN_OK);
    CHECK(memplan_engine_set_group(*engine, params[1].id, 5000) == MEMPLAN_INVALID_ARGUMENT);
    REQUIRE_MESSAGE(memplan_engine_start(*engine) == MEMPLAN_OK, LastError());
  };
  auto backward = [&](memplan_engine* engine, float scale) {
    for (const char* module : {"m1", "m0"}) {
      REQUIRE(memplan_engine_fetch(engine, module) == MEMPLAN_OK);
      REQUIRE(memplan_engine_release(engine, module) == MEMPLAN_OK);
    }
    for (TestParam& p : params) {
      for (float& g : p.grad) g *= scale;
      REQUIRE_MESSAGE(
          memplan_engine_grad_ready(engine, p.id, p.grad.data(), MEMPLAN_FLOAT32) == MEMPLAN_OK,
          LastError());
      for (float& g : p.grad) g /= scale;
    }
  };
  const char* options =
      R"({"lr": 0.1, "groups": [{}, {"lr": 0.05, "weight_decay": 0}], "max_grad_norm": 1.0})";
  memplan_engine* engine = nullptr;
  open("a", &engine);
  backward(engine, 1.0f);
  double norm = 0, squares = 0;
  for (const TestParam& p : params) {
    for (float g : p.grad) squares += static_cast<double>(g) * g;
  }
  REQUIRE_MESSAGE(memplan_engine_gradient_norm(engine, 2.0, 1.0, &norm) == MEMPLAN_OK, LastError());
  CHECK(norm == doctest::Approx(std::sqrt(squares)).epsilon(1e-12));
  CHECK(memplan_engine_gradient_norm(engine, 3.0, 1.0, &norm) == MEMPLAN_INVALID_ARGUMENT);
  REQUIRE_MESSAGE(memplan_engine_step(engine, options) == MEMPLAN_OK, LastError());
  CString stats;
  REQUIRE(memplan_engine_stats_json(engine, &stats.text) == MEMPLAN_OK);
  const json s = stats.Parse();
  CHECK(s["groups"] == 2);
  CHECK(s["last_clip_coefficient"].get<double>() < 1.0);  // the norm is above 1
  // Half a step, abandoned: the next step as if it never was.
  REQUIRE(memplan_engine_grad_ready(engine, params[0].id, params[0].grad.data(), MEMPLAN_FLOAT32) ==
          MEMPLAN_OK);
  REQUIRE_MESSAGE(memplan_engine_abandon_step(engine) == MEMPLAN_OK, LastError());
  CHECK(memplan_engine_step(engine, options) == MEMPLAN_FAILED_PRECONDITION);
  // The state out: each parameter's shard (all of it on one rank) of its three arrays.
  int32_t states = 0;
  REQUIRE(memplan_engine_optimizer_states(engine, &states) == MEMPLAN_OK);
  REQUIRE(states == 2);
  SavedState saved;
  std::vector<uint64_t> steps;
  for (const TestParam& p : params) {
    uint64_t first = 1, size = 0, step = 0;
    REQUIRE(memplan_engine_shard(engine, p.id, &first, &size) == MEMPLAN_OK);
    CHECK(first == 0);
    CHECK(size == p.init.size());
    saved.arrays.emplace_back();
    for (int32_t a = 0; a <= states; ++a) {
      std::vector<float> out(size);
      REQUIRE_MESSAGE(memplan_engine_read_state(engine, p.id, a, out.data(), size) == MEMPLAN_OK,
                      LastError());
      saved.arrays.back().push_back(out);
    }
    REQUIRE(memplan_engine_param_step(engine, p.id, &step) == MEMPLAN_OK);
    steps.push_back(step);
  }
  CHECK(steps == std::vector<uint64_t>(params.size(), 1));
  // A second step here, and in a fresh engine loaded with the state: the same weights.
  backward(engine, 3.0f);
  REQUIRE_MESSAGE(memplan_engine_step(engine, options) == MEMPLAN_OK, LastError());
  memplan_engine* fresh = nullptr;
  open("b", &fresh);
  const uint8_t all[3] = {1, 1, 1};
  REQUIRE_MESSAGE(memplan_engine_load_state(fresh, FillFromSaved, &saved, all, 3, steps.data(),
                                            steps.size()) == MEMPLAN_OK,
                  LastError());
  backward(fresh, 3.0f);
  REQUIRE_MESSAGE(memplan_engine_step(fresh, options) == MEMPLAN_OK, LastError());
  for (const TestParam& p : params) {
    std::vector<float> a(p.init.size()), b(p.init.size());
    REQUIRE(memplan_engine_read_master(engine, p.id, a.data(), a.size()) == MEMPLAN_OK);
    REQUIRE(memplan_engine_read_master(fresh, p.id, b.data(), b.size()) == MEMPLAN_OK);
    CHECK(a == b);
  }
  // A filler that fails: the load is refused, nothing applied.
  SavedState short_state = saved;
  short_state.arrays[2][1].resize(3);
  CHECK(memplan_engine_load_state(fresh, FillFromSaved, &short_state, all, 3, nullptr, 0) !=
        MEMPLAN_OK);
  CHECK(LastError().find("filler") != std::string::npos);
  CHECK(memplan_engine_close(engine) == MEMPLAN_OK);
  CHECK(memplan_engine_close(fresh) == MEMPLAN_OK);
}

TEST_CASE("c api: engine argument errors") {
  TempDir dir("memplan_capi_");
  memplan_engine* engine = reinterpret_cast<memplan_engine*>(&engine);  // garbage to overwrite
  CHECK(memplan_engine_open("{\"params\": {\"tier\": \"nvme\"}}", nullptr, &engine) ==
        MEMPLAN_INVALID_ARGUMENT);
  CHECK(engine == nullptr);
  CHECK(LastError().find("nvme.path") != std::string::npos);
  CHECK(memplan_engine_open(ScheduleJson("bf16", dir.PathOf("n")).c_str(), R"({"runtime": "tpu"})",
                            &engine) == MEMPLAN_INVALID_ARGUMENT);
  CHECK(LastError().find("runtime") != std::string::npos);
  CHECK(memplan_engine_open(ScheduleJson("bf16", dir.PathOf("n")).c_str(), R"({"resumed": 1})",
                            &engine) == MEMPLAN_INVALID_ARGUMENT);
  CHECK(LastError().find("resumed") != std::string::npos);
  CHECK(memplan_engine_open(nullptr, nullptr, &engine) == MEMPLAN_INVALID_ARGUMENT);
  CHECK(LastError().find("schedule_json") != std::string::npos);
  CHECK(memplan_engine_open("{}", nullptr, nullptr) == MEMPLAN_INVALID_ARGUMENT);

  // A NULL handle is INVALID_ARGUMENT everywhere (close: a no-op).
  uint32_t id = 0;
  uint64_t numel = 0;
  void* pointer = nullptr;
  float out = 0;
  char* text = nullptr;
  const int64_t one = 1;
  CHECK(memplan_engine_register(nullptr, "a", "m", &one, 1, nullptr, &id) ==
        MEMPLAN_INVALID_ARGUMENT);
  CHECK(LastError() == "memplan_engine_register: engine is NULL");
  CHECK(memplan_engine_add_use(nullptr, 0, "m") == MEMPLAN_INVALID_ARGUMENT);
  CHECK(memplan_engine_start(nullptr) == MEMPLAN_INVALID_ARGUMENT);
  CHECK(memplan_engine_fetch(nullptr, "m") == MEMPLAN_INVALID_ARGUMENT);
  CHECK(memplan_engine_release(nullptr, "m") == MEMPLAN_INVALID_ARGUMENT);
  CHECK(memplan_engine_device_pointer(nullptr, 0, &pointer) == MEMPLAN_INVALID_ARGUMENT);
  CHECK(memplan_engine_numel(nullptr, 0, &numel) == MEMPLAN_INVALID_ARGUMENT);
  CHECK(memplan_engine_grad_ready(nullptr, 0, &out, MEMPLAN_FLOAT32) == MEMPLAN_INVALID_ARGUMENT);
  CHECK(memplan_engine_step(nullptr, nullptr) == MEMPLAN_INVALID_ARGUMENT);
  CHECK(memplan_engine_read_master(nullptr, 0, &out, 1) == MEMPLAN_INVALID_ARGUMENT);
  CHECK(memplan_engine_stats_json(nullptr, &text) == MEMPLAN_INVALID_ARGUMENT);
  CHECK(text == nullptr);
  CHECK(memplan_engine_close(nullptr) == MEMPLAN_OK);

  // Registration mistakes are reported by the call that made them.
  REQUIRE(memplan_engine_open(ScheduleJson("bf16", dir.PathOf("n")).c_str(), nullptr, &engine) ==
          MEMPLAN_OK);
  const int64_t bad_shape[] = {4, 0};
  CHECK(memplan_engine_register(engine, "w", "m", bad_shape, 2, nullptr, &id) ==
        MEMPLAN_INVALID_ARGUMENT);
  CHECK(LastError().find("dimension 1") != std::string::npos);
  CHECK(memplan_engine_register(engine, "w", "m", nullptr, 2, nullptr, &id) ==
        MEMPLAN_INVALID_ARGUMENT);
  CHECK(LastError().find("shape") != std::string::npos);
  CHECK(memplan_engine_register(engine, "w", nullptr, &one, 1, nullptr, &id) ==
        MEMPLAN_INVALID_ARGUMENT);
  CHECK(LastError().find("module") != std::string::npos);
  CHECK(memplan_engine_register(engine, "w", "m", &one, -1, nullptr, &id) ==
        MEMPLAN_INVALID_ARGUMENT);
  REQUIRE(memplan_engine_register(engine, "w", "m", &one, 1, nullptr, &id) == MEMPLAN_OK);
  CHECK(memplan_engine_register(engine, "w", "m", &one, 1, nullptr, &id) ==
        MEMPLAN_INVALID_ARGUMENT);
  CHECK(LastError().find("twice") != std::string::npos);
  CHECK(memplan_engine_numel(engine, 1, &numel) == MEMPLAN_INVALID_ARGUMENT);
  CHECK(memplan_engine_device_pointer(engine, 0, nullptr) == MEMPLAN_INVALID_ARGUMENT);
  CHECK(LastError().find("pointer") != std::string::npos);
  CHECK(memplan_engine_close(engine) == MEMPLAN_OK);  // never started: nothing to commit
}

TEST_CASE("c api: the cuda runtime opens on a GPU machine and is UNAVAILABLE elsewhere") {
  TempDir dir("memplan_capi_");
  memplan_engine* engine = nullptr;
  const memplan_status s = memplan_engine_open(ScheduleJson("bf16", dir.PathOf("n")).c_str(),
                                               R"({"runtime": "cuda"})", &engine);
  if (s == MEMPLAN_OK) {
    MESSAGE("CUDA runtime available");
    CString stats;
    REQUIRE(memplan_engine_stats_json(engine, &stats.text) == MEMPLAN_OK);
    CHECK(stats.Parse()["runtime"].get<std::string>().rfind("cuda:", 0) == 0);
    CHECK(memplan_engine_close(engine) == MEMPLAN_OK);
  } else {
    CHECK(s == MEMPLAN_UNAVAILABLE);
    CHECK(engine == nullptr);
    CHECK(!LastError().empty());
  }
}

TEST_CASE("c api: the last error is per thread") {
  char* answer = nullptr;
  REQUIRE(memplan_estimate_json("[]", &answer) == MEMPLAN_INVALID_ARGUMENT);
  const std::string mine = LastError();
  std::string theirs = "unset";
  std::thread other([&] { theirs = memplan_last_error(); });
  other.join();
  CHECK(theirs.empty());
  CHECK(LastError() == mine);
}

}  // namespace
