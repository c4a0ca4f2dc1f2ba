// The C API's GPU engine (libmemplan_c.so, "runtime": "cuda") on the emulated GPU, driven as a C
// trainer with its own CUDA stream drives it: kernels read the fetched parameters and write the
// gradients late on that stream, the gradients come from a caching allocator and are freed right
// after they are handed over. It must train exactly as the host runtime does.
#include <cuda_runtime_api.h>
#include <doctest/doctest.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "gpu_emulation.h"
#include "memplan.h"

namespace {

using nlohmann::json;

std::string LastError() { return memplan_last_error(); }

constexpr int kModules = 5;
constexpr uint64_t kNumel = 2048;

const char* kSchedule = R"({"version": 1,
  "params": {"tier": "cpu", "dtype": "fp32", "persistence_threshold": 0,
             "prefetch_bytes": 8192, "max_live_bytes": 16384},
  "optimizer": {"tier": "cpu", "name": "adam", "sub_group_elements": 2048, "threads": 1}})";

#ifdef MEMPLAN_TEST_OLD_API  // README.md, "Checking that a test catches its defect"
constexpr int kDevice = 0;   // the old API had no device option
const char* kCudaOptions = R"({"runtime": "cuda"})";
memplan_status ReleaseOn(memplan_engine* e, const char* m, void*) {
  return memplan_engine_release(e, m);
}
memplan_status GradReadyOn(memplan_engine* e, uint32_t p, const void* g, void*) {
  return memplan_engine_grad_ready(e, p, g, MEMPLAN_FLOAT32);
}
void* GradientStream(memplan_engine*) { return nullptr; }
#else
constexpr int kDevice = 1;  // not device 0: the engine must follow the option
const char* kCudaOptions = R"({"runtime": "cuda", "device": 1})";
memplan_status ReleaseOn(memplan_engine* e, const char* m, void* s) {
  return memplan_engine_release_on_stream(e, m, s);
}
memplan_status GradReadyOn(memplan_engine* e, uint32_t p, const void* g, void* s) {
  return memplan_engine_grad_ready_on_stream(e, p, g, MEMPLAN_FLOAT32, s);
}
void* GradientStream(memplan_engine* e) {
  void* s = nullptr;
  REQUIRE(memplan_engine_gradient_stream(e, &s) == MEMPLAN_OK);
  return s;
}
#endif

// Trains 3 steps through the C API; returns the master weights. `cuda`: the emulated GPU (device
// kDevice, kernels on a stream of the trainer's), else the host runtime (kernels run at once).
std::vector<float> TrainThroughC(bool cuda, std::string* runtime_name) {
  cudaStream_t stream = nullptr;
  std::unique_ptr<memplan::gpu_emulation::CachingAllocator> allocator;
  if (cuda) {
    REQUIRE(cudaSetDevice(kDevice) == cudaSuccess);
    REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess);
    allocator = std::make_unique<memplan::gpu_emulation::CachingAllocator>(kDevice);
  }
  auto launch = [&](std::function<void()> body) {
    if (!cuda) return body();
    memplan::gpu_emulation::LaunchKernel(stream, [body = std::move(body)] {
      std::this_thread::sleep_for(std::chrono::microseconds(300));
      body();
    });
  };
  auto view = [cuda](const void* p, uint64_t bytes) {
    return cuda ? memplan::gpu_emulation::DeviceView(p, bytes) : const_cast<void*>(p);
  };
  memplan_engine* engine = nullptr;
  const char* options = cuda ? kCudaOptions : R"({"runtime": "host"})";
  REQUIRE_MESSAGE(memplan_engine_open(kSchedule, options, &engine) == MEMPLAN_OK, LastError());
  std::vector<float> init(kNumel);
  std::vector<uint32_t> ids(kModules);
  for (int m = 0; m < kModules; ++m) {
    for (uint64_t i = 0; i < kNumel; ++i) init[i] = 0.01f * static_cast<float>((m * 7 + i) % 13);
    const int64_t shape[1] = {static_cast<int64_t>(kNumel)};
    const std::string module = "m" + std::to_string(m);
    REQUIRE(memplan_engine_register(engine, (module + ".w").c_str(), module.c_str(), shape, 1,
                                    init.data(), &ids[m]) == MEMPLAN_OK);
  }
  REQUIRE_MESSAGE(memplan_engine_start(engine) == MEMPLAN_OK, LastError());
  auto act = std::make_shared<std::vector<float>>(kModules, 0.0f);
  for (int step = 0; step < 3; ++step) {
    for (int m = 0; m < kModules; ++m) {
      const std::string module = "m" + std::to_string(m);
      REQUIRE(memplan_engine_fetch(engine, module.c_str()) == MEMPLAN_OK);
      void* w = nullptr;
      REQUIRE(memplan_engine_device_pointer(engine, ids[m], &w) == MEMPLAN_OK);
      launch([=] {
        const auto* v = static_cast<const float*>(view(w, kNumel * 4));
        float a = 0;
        for (uint64_t i = 0; i < kNumel; ++i) a += v[i];
        (*act)[m] = a;
      });
      REQUIRE_MESSAGE(ReleaseOn(engine, module.c_str(), stream) == MEMPLAN_OK, LastError());
    }
    for (int m = kModules - 1; m >= 0; --m) {
      const std::string module = "m" + std::to_string(m);
      REQUIRE(memplan_engine_fetch(engine, module.c_str()) == MEMPLAN_OK);
      void* w = nullptr;
      REQUIRE(memplan_engine_device_pointer(engine, ids[m], &w) == MEMPLAN_OK);
      void* g = cuda ? allocator->Allocate(kNumel * 4, stream) : ::operator new(kNumel * 4);
      launch([=] {
        const auto* v = static_cast<const float*>(view(w, kNumel * 4));
        auto* out = static_cast<float*>(view(g, kNumel * 4));
        for (uint64_t i = 0; i < kNumel; ++i) out[i] = v[i] * 0.5f + (*act)[m] * 1e-3f;
      });
      if (cuda) {
        // Hold the engine's gradient lane as a busy copy engine would, so that its copy of `g`
        // runs after the trainer has freed `g` and its next kernel has written the block again,
        // unless the free waited for that lane (the record_stream below).
        memplan::gpu_emulation::LaunchKernel(static_cast<cudaStream_t>(GradientStream(engine)), [] {
          std::this_thread::sleep_for(std::chrono::milliseconds(2));
        });
      }
      REQUIRE_MESSAGE(GradReadyOn(engine, ids[m], g, stream) == MEMPLAN_OK, LastError());
      if (cuda) {
        allocator->RecordStream(g, static_cast<cudaStream_t>(GradientStream(engine)));
        allocator->Free(g);
      } else {
        ::operator delete(g);
      }
      REQUIRE(ReleaseOn(engine, module.c_str(), stream) == MEMPLAN_OK);
    }
    REQUIRE_MESSAGE(memplan_engine_step(engine, R"({"lr": 0.01})") == MEMPLAN_OK, LastError());
  }
  if (cuda) REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
  std::vector<float> master(kNumel * kModules);
  for (int m = 0; m < kModules; ++m) {
    REQUIRE(memplan_engine_read_master(engine, ids[m], master.data() + m * kNumel, kNumel) ==
            MEMPLAN_OK);
  }
  char* stats = nullptr;
  REQUIRE(memplan_engine_stats_json(engine, &stats) == MEMPLAN_OK);
  *runtime_name = json::parse(stats)["runtime"].get<std::string>();
  memplan_string_free(stats);
  REQUIRE(memplan_engine_close(engine) == MEMPLAN_OK);
  if (cuda) {
    allocator.reset();
    REQUIRE(cudaStreamDestroy(stream) == cudaSuccess);
  }
  return master;
}

TEST_CASE(
    "c api: the CUDA engine on its device, ordered after the trainer's stream, trains as the "
    "host engine does") {
  memplan::gpu_emulation::Config c;
  c.devices = 2;
  memplan::gpu_emulation::Reset(c);
  std::string host_name, cuda_name;
  const std::vector<float> want = TrainThroughC(false, &host_name);
  const std::vector<float> got = TrainThroughC(true, &cuda_name);
  CHECK(host_name == "host-only");
  CHECK(cuda_name == "cuda:" + std::to_string(kDevice));
  REQUIRE(got.size() == want.size());
  uint64_t differ = 0;
  for (size_t i = 0; i < got.size(); ++i) differ += std::memcmp(&got[i], &want[i], 4) != 0;
  CHECK(differ == 0);
}

#ifndef MEMPLAN_TEST_OLD_API
TEST_CASE("c api: the CUDA engine refuses what cannot be right") {
  memplan::gpu_emulation::Reset(memplan::gpu_emulation::Config());
  memplan_engine* engine = nullptr;
  // A device the machine does not have.
  CHECK(memplan_engine_open(kSchedule, R"({"runtime": "cuda", "device": 7})", &engine) ==
        MEMPLAN_INVALID_ARGUMENT);
  CHECK(LastError().find("no CUDA device 7") != std::string::npos);
  CHECK(memplan_engine_open(kSchedule, R"({"device": -1})", &engine) == MEMPLAN_INVALID_ARGUMENT);
  CHECK(LastError().find("'device'") != std::string::npos);
  // The host runtime has no streams: a stream given to it is a mix-up.
  REQUIRE(memplan_engine_open(kSchedule, R"({"runtime": "host"})", &engine) == MEMPLAN_OK);
  const int64_t shape[1] = {16};
  uint32_t id = 0;
  REQUIRE(memplan_engine_register(engine, "w", "m", shape, 1, nullptr, &id) == MEMPLAN_OK);
  REQUIRE(memplan_engine_start(engine) == MEMPLAN_OK);
  REQUIRE(memplan_engine_fetch(engine, "m") == MEMPLAN_OK);
  int not_a_stream = 0;
  CHECK(memplan_engine_release_on_stream(engine, "m", &not_a_stream) == MEMPLAN_INVALID_ARGUMENT);
  CHECK(LastError().find("host-only runtime") != std::string::npos);
  CHECK(memplan_engine_release_on_stream(engine, "m", nullptr) == MEMPLAN_OK);
  void* stream = &not_a_stream;
  CHECK(memplan_engine_gradient_stream(engine, &stream) == MEMPLAN_OK);
  CHECK(stream == nullptr);
  CHECK(memplan_engine_close(engine) == MEMPLAN_OK);
}
#endif

}  // namespace
