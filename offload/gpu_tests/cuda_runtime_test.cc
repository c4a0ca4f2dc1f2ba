// The CUDA gpu::Runtime and the NCCL collective on a real GPU. Exits 77 (CTest's "skipped") when
// CreateCudaRuntime answers Unavailable: no GPU, no usable driver, or a build without CUDA. Any
// other failure to create the runtime is a test failure.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "offload/collective.h"
#include "offload/engine.h"
#include "gpu/gpu_runtime.h"
#include "offload/half.h"
#include "offload/thread_collective.h"
#include "tests/testing.h"
#include "tests/status_testing.h"

namespace memplan::gpu {
namespace {

std::unique_ptr<Runtime> MakeRuntime() {
  auto rt = CreateCudaRuntime(0);
  REQUIRE_MESSAGE(rt.ok(), rt.status().ToString());
  return std::move(rt).value();
}

std::vector<uint8_t> Pattern(size_t bytes, uint32_t seed) {
  std::vector<uint8_t> out(bytes);
  uint32_t x = seed * 2654435761u + 1;
  for (auto& b : out) {
    x = x * 1664525u + 1013904223u;
    b = static_cast<uint8_t>(x >> 24);
  }
  return out;
}

CopyTicket MustCopy(Runtime& rt, CopyDirection d, void* dst, const void* src, uint64_t bytes) {
  auto t = rt.CopyAsync(d, dst, src, bytes);
  REQUIRE_MESSAGE(t.ok(), t.status().ToString());
  return *t;
}

void* MustAllocate(Runtime& rt, uint64_t bytes) {
  auto p = rt.AllocateDevice(bytes);
  REQUIRE_MESSAGE(p.ok(), p.status().ToString());
  return *p;
}

TEST_CASE("cuda runtime: name, device, description") {
  auto rt = MakeRuntime();
  CHECK(rt->Name() == "cuda:0");
  CHECK(rt->has_device());
  std::string note;
  auto best = CreateBestRuntime(&note);
  CHECK(best->has_device());
  CHECK(note.find("cuda:0: ") == 0);
  MESSAGE(note);
  CHECK(CreateCudaRuntime(-2).status().code() == StatusCode::kInvalidArgument);
  CHECK_OK(CreateCudaRuntime(kCurrentDevice));  // the thread's current device
  CHECK(CreateCudaRuntime(4096).status().code() == StatusCode::kInvalidArgument);
}

TEST_CASE("cuda runtime: round trip through the device, registered and pageable host memory") {
  auto rt = MakeRuntime();
  for (bool registered : {true, false}) {
    for (uint64_t bytes : {uint64_t{1}, uint64_t{4097}, uint64_t{17} << 20}) {
      // CUDA pins whole pages, and two small heap buffers may share one: register only buffers
      // large enough to get pages of their own.
      if (registered && bytes < (uint64_t{1} << 20)) continue;
      CAPTURE(registered);
      CAPTURE(bytes);
      auto src = Pattern(bytes, static_cast<uint32_t>(bytes));
      std::vector<uint8_t> back(bytes, 0);
      if (registered) {
        REQUIRE_OK(rt->RegisterHost(src.data(), bytes));
        REQUIRE_OK(rt->RegisterHost(back.data(), bytes));
      }
      void* a = MustAllocate(*rt, bytes);
      void* b = MustAllocate(*rt, bytes);
      CHECK(reinterpret_cast<uintptr_t>(a) % 256 == 0);
      const CopyTicket up = MustCopy(*rt, CopyDirection::kHostToDevice, a, src.data(), bytes);
      // Same stream order across directions is not promised: wait before reading `a` elsewhere.
      REQUIRE_OK(rt->Wait(up));
      REQUIRE_OK(rt->Wait(MustCopy(*rt, CopyDirection::kDeviceToDevice, b, a, bytes)));
      const CopyTicket down = MustCopy(*rt, CopyDirection::kDeviceToHost, back.data(), b, bytes);
      REQUIRE_OK(rt->Wait(down));
      CHECK(rt->Done(down));
      CHECK(back == src);
      CHECK_OK(rt->FreeDevice(a));
      CHECK_OK(rt->FreeDevice(b));
      if (registered) {
        CHECK_OK(rt->UnregisterHost(src.data()));
        CHECK_OK(rt->UnregisterHost(back.data()));
      }
    }
  }
  CHECK(rt->device_bytes_in_use() == 0);
}

TEST_CASE("cuda runtime: more copies in flight than the event ring holds") {
  auto rt = MakeRuntime();
  // 3000 copies > 1024 slots: slots are reused, and tickets whose slot was reused still answer.
  constexpr int kCopies = 3000;
  constexpr uint64_t kBytes = 4096;
  std::vector<uint8_t> host(kBytes * kCopies);
  for (size_t i = 0; i < host.size(); ++i) host[i] = static_cast<uint8_t>(i * 7 + i / 4096);
  REQUIRE_OK(rt->RegisterHost(host.data(), host.size()));
  void* dev = MustAllocate(*rt, host.size());
  std::vector<CopyTicket> tickets;
  for (int i = 0; i < kCopies; ++i) {
    tickets.push_back(MustCopy(*rt, CopyDirection::kHostToDevice,
                               static_cast<uint8_t*>(dev) + i * kBytes, host.data() + i * kBytes,
                               kBytes));
    if (i > 0) CHECK(tickets[i].sequence == tickets[i - 1].sequence + 1);
  }
  // The oldest ticket's event has been re-recorded twice by now.
  CHECK_OK(rt->Wait(tickets.front()));
  CHECK_OK(rt->Wait(tickets.back()));
  for (const auto& t : tickets) CHECK(rt->Done(t));
  std::vector<uint8_t> back(host.size());
  REQUIRE(
      rt->Wait(MustCopy(*rt, CopyDirection::kDeviceToHost, back.data(), dev, back.size())).ok());
  CHECK(back == host);
  CHECK_OK(rt->FreeDevice(dev));
  CHECK_OK(rt->UnregisterHost(host.data()));
}

TEST_CASE("cuda runtime: Done polls; Synchronize waits for all directions") {
  auto rt = MakeRuntime();
  constexpr uint64_t kBytes = uint64_t{256} << 20;
  void* a = MustAllocate(*rt, kBytes);
  void* b = MustAllocate(*rt, kBytes);
  const CopyTicket t = MustCopy(*rt, CopyDirection::kDeviceToDevice, b, a, kBytes);
  int polls = 0;
  while (!rt->Done(t)) ++polls;
  MESSAGE("Done() polled " << polls << " times for a 256 MiB device-to-device copy");
  std::vector<uint8_t> up(1 << 20);
  std::vector<uint8_t> down(1 << 20);
  for (int i = 0; i < 8; ++i) {
    MustCopy(*rt, CopyDirection::kHostToDevice, a, up.data(), up.size());
    MustCopy(*rt, CopyDirection::kDeviceToHost, down.data(), b, down.size());
  }
  CHECK_OK(rt->Synchronize());
  CHECK_OK(rt->FreeDevice(a));
  CHECK_OK(rt->FreeDevice(b));
}

TEST_CASE("cuda runtime: threads without a current device copy") {
  auto rt = MakeRuntime();
  constexpr int kThreads = 8;
  constexpr uint64_t kBytes = 1 << 16;
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      auto dev = rt->AllocateDevice(kBytes);
      if (!dev.ok()) {
        ++failures;
        return;
      }
      for (int r = 0; r < 100; ++r) {
        const auto src = Pattern(kBytes, static_cast<uint32_t>(t * 1000 + r));
        std::vector<uint8_t> back(kBytes);
        auto up = rt->CopyAsync(CopyDirection::kHostToDevice, *dev, src.data(), kBytes);
        if (!up.ok() || !rt->Wait(*up).ok()) ++failures;
        auto down = rt->CopyAsync(CopyDirection::kDeviceToHost, back.data(), *dev, kBytes);
        if (!down.ok() || !rt->Wait(*down).ok() || back != src) ++failures;
      }
      if (!rt->FreeDevice(*dev).ok()) ++failures;
    });
  }
  for (auto& th : threads) th.join();
  CHECK(failures.load() == 0);
  CHECK(rt->device_bytes_in_use() == 0);
}

TEST_CASE("cuda runtime: accounting and errors") {
  auto rt = MakeRuntime();
  void* a = MustAllocate(*rt, 1000);
  CHECK(rt->device_bytes_in_use() == 1000);
  CHECK_OK(rt->FreeDevice(a));
  CHECK(rt->FreeDevice(a).code() == StatusCode::kInvalidArgument);
  CHECK(rt->device_bytes_in_use() == 0);
  CHECK(rt->AllocateDevice(0).status().code() == StatusCode::kInvalidArgument);
  auto huge = rt->AllocateDevice(uint64_t{1} << 60);
  CHECK(huge.status().code() == StatusCode::kResourceExhausted);
  MESSAGE(huge.status().ToString());
  CHECK(rt->device_bytes_in_use() == 0);
  // The failed cudaMalloc left no error behind for the next call.
  void* b = MustAllocate(*rt, 512);
  CHECK_OK(rt->FreeDevice(b));

  std::vector<uint8_t> host(4096);
  CHECK(rt->UnregisterHost(host.data()).code() == StatusCode::kInvalidArgument);
  REQUIRE_OK(rt->RegisterHost(host.data(), host.size()));
  Status twice = rt->RegisterHost(host.data(), host.size());
  CHECK(twice.code() == StatusCode::kInvalidArgument);
  MESSAGE(twice.ToString());  // names the call, the CUDA error and file:line
  CHECK(twice.message().find("cudaHostRegister") != std::string::npos);
  CHECK(twice.message().find("cuda_runtime.cc:") != std::string::npos);
  CHECK_OK(rt->UnregisterHost(host.data()));

  CHECK(rt->CopyAsync(CopyDirection::kHostToDevice, nullptr, host.data(), 8).status().code() ==
        StatusCode::kInvalidArgument);
  CHECK(rt->Wait(CopyTicket{CopyDirection::kDeviceToHost, 99}).code() ==
        StatusCode::kInvalidArgument);
  CHECK(rt->Done(CopyTicket{}));
}

}  // namespace
}  // namespace memplan::gpu

namespace memplan::offload {
namespace {

TEST_CASE("single-process collective over the CUDA runtime") {
  auto rt = gpu::MakeRuntime();
  auto collective = CreateSingleProcessCollective(rt.get());
  constexpr uint64_t kCount = 4096;
  std::vector<float> values(kCount);
  for (uint64_t i = 0; i < kCount; ++i) values[i] = static_cast<float>(i) * 0.5f;
  void* send = gpu::MustAllocate(*rt, kCount * 4);
  void* recv = gpu::MustAllocate(*rt, kCount * 4);
  REQUIRE(rt->Wait(gpu::MustCopy(*rt, gpu::CopyDirection::kHostToDevice, send, values.data(),
                                 kCount * 4))
              .ok());
  REQUIRE_OK(collective->AllGather(send, recv, kCount, ElementType::kFloat32));
  std::vector<float> back(kCount);
  REQUIRE(
      rt->Wait(gpu::MustCopy(*rt, gpu::CopyDirection::kDeviceToHost, back.data(), recv, kCount * 4))
          .ok());
  CHECK(back == values);
  CHECK_OK(rt->FreeDevice(send));
  CHECK_OK(rt->FreeDevice(recv));
}

TEST_CASE("NCCL collective, one rank") {
#if MEMPLAN_HAVE_NCCL
  auto rt = gpu::MakeRuntime();
  auto id = NcclUniqueId();
  REQUIRE_MESSAGE(id.ok(), id.status().ToString());
  CHECK(id->size() == 128);
  CHECK(CreateNcclCollective(rt.get(), 0, 1, "short").status().code() ==
        StatusCode::kInvalidArgument);
  CHECK(CreateNcclCollective(rt.get(), 1, 1, *id).status().code() == StatusCode::kInvalidArgument);
  auto made = CreateNcclCollective(rt.get(), 0, 1, *id);
  REQUIRE_MESSAGE(made.ok(), made.status().ToString());
  Collective& nccl = **made;
  CHECK(nccl.Name() == "nccl");
  CHECK(nccl.rank() == 0);
  CHECK(nccl.world_size() == 1);

  constexpr uint64_t kCount = 1 << 16;
  std::vector<float> values(kCount);
  for (uint64_t i = 0; i < kCount; ++i) values[i] = static_cast<float>(i % 1000) - 3.0f;
  void* send = gpu::MustAllocate(*rt, kCount * 4);
  void* recv = gpu::MustAllocate(*rt, kCount * 4);
  REQUIRE(rt->Wait(gpu::MustCopy(*rt, gpu::CopyDirection::kHostToDevice, send, values.data(),
                                 kCount * 4))
              .ok());
  std::vector<float> back(kCount);
  auto read_back = [&](void* dev) {
    REQUIRE(rt->Wait(gpu::MustCopy(*rt, gpu::CopyDirection::kDeviceToHost, back.data(), dev,
                                   kCount * 4))
                .ok());
  };
  REQUIRE_OK(nccl.AllGather(send, recv, kCount, ElementType::kFloat32));
  read_back(recv);
  CHECK(back == values);
  REQUIRE_OK(nccl.ReduceScatter(send, recv, kCount, ElementType::kFloat32));
  read_back(recv);
  CHECK(back == values);
  REQUIRE_OK(nccl.AllReduce(send, kCount, ElementType::kFloat32));  // sum over one rank
  read_back(send);
  CHECK(back == values);
  REQUIRE_OK(nccl.AllReduce(send, kCount / 2, ElementType::kBFloat16));
  REQUIRE_OK(nccl.AllReduce(send, kCount / 2, ElementType::kFloat16));
  CHECK(nccl.AllGather(nullptr, recv, 4, ElementType::kFloat32).code() ==
        StatusCode::kInvalidArgument);
  CHECK_OK(rt->FreeDevice(send));
  CHECK_OK(rt->FreeDevice(recv));
#else
  auto id = NcclUniqueId();
  CHECK(id.status().code() == StatusCode::kUnavailable);
  MESSAGE("built without NCCL: " << id.status().message());
#endif
}

// ---- The engine on the GPU
// -----------------------------------------------------------------------

// Trains three steps of four one-parameter modules on `runtime` (the CUDA runtime, or the host-only
// one for the reference); gradients are computed on the host from the fetched parameters and
// uploaded, as a trainer without kernels of its own would. Returns every parameter's master
// weights.
// `prepare`: every step prepared, the optimizer overlapped with backward.
std::vector<std::vector<float>> TrainEngine(gpu::Runtime& runtime, Collective* collective,
                                            ElementType dtype, Tier tier, const std::string& dir,
                                            int rank, bool prepare = false) {
  constexpr int kModules = 4;
  constexpr uint64_t kNumel = 5000;
  Schedule s;
  s.param_tier = tier;
  s.param_dtype = dtype;
  s.optimizer_tier = tier == Tier::kNvme ? Tier::kNvme : Tier::kCpu;
  s.persistence_threshold = 0;
  s.prefetch_bytes = kNumel * 4;
  s.max_live_bytes = 2 * kNumel * 4;
  s.sub_group_elements = 4096;
  s.param_buffer_bytes = 8192;
  s.param_buffer_count = 2;
  s.optimizer_threads = 1;
  s.nvme_path = dir;
  s.nvme_backend = nvme::BackendKind::kPosix;
  s.nvme_direct = false;
  EngineOptions options;
  options.schedule = s;
  options.runtime = &runtime;
  options.collective = collective;
  auto engine = Engine::Create(options);
  REQUIRE_MESSAGE(engine.ok(), engine.status().ToString());
  std::vector<ParamId> ids;
  for (int m = 0; m < kModules; ++m) {
    ParamSpec spec{"m" + std::to_string(m) + ".w",
                   "m" + std::to_string(m),
                   {static_cast<int64_t>(kNumel)},
                   [m](uint64_t first, std::span<float> out) {
                     for (size_t k = 0; k < out.size(); ++k) {
                       out[k] = 0.01f * static_cast<float>((first + k + 3 * m) % 17) - 0.08f;
                     }
                     return Status::Ok();
                   },
                   {}};
    ids.push_back(*(*engine)->AddParameter(spec));
  }
  Status started = (*engine)->Start();
  REQUIRE_MESSAGE(started.ok(), started.ToString());
  const auto pb = static_cast<uint64_t>(ElementBytes(dtype));
  std::vector<std::byte> host(kNumel * 4);  // pageable on purpose: the trainer's own memory
  void* grad = gpu::MustAllocate(runtime, kNumel * 4);
  AdamOptions adam;
  adam.lr = 1e-2;
  for (int step = 0; step < 3; ++step) {
    if (prepare) REQUIRE_OK((*engine)->PrepareStep(SwapStepOptions(adam)));
    for (int m = kModules - 1; m >= 0; --m) {
      const std::string module = "m" + std::to_string(m);
      REQUIRE_OK((*engine)->Fetch(module));
      void* w = *(*engine)->DevicePointer(ids[m]);
      REQUIRE(runtime
                  .Wait(gpu::MustCopy(runtime, gpu::CopyDirection::kDeviceToHost, host.data(), w,
                                      kNumel * pb))
                  .ok());
      std::vector<float> g(kNumel);
      for (uint64_t i = 0; i < kNumel; ++i) {
        float v;
        if (pb == 4) {
          std::memcpy(&v, host.data() + i * 4, 4);
        } else {
          uint16_t h;
          std::memcpy(&h, host.data() + i * 2, 2);
          v = Bf16ToFloat(h);
        }
        g[i] = v * 0.5f + static_cast<float>((i + static_cast<uint64_t>(step)) % 7) * 1e-3f +
               static_cast<float>(rank) * 1e-3f;
      }
      REQUIRE(runtime
                  .Wait(gpu::MustCopy(runtime, gpu::CopyDirection::kHostToDevice, grad, g.data(),
                                      kNumel * 4))
                  .ok());
      REQUIRE_OK((*engine)->GradReady(ids[m], grad, ElementType::kFloat32));
      // The copy reads `grad` later, on the gradient stream: wait before it is overwritten.
      REQUIRE_OK(runtime.Synchronize());
      REQUIRE_OK((*engine)->Release(module));
    }
    Status stepped = (*engine)->Step(SwapStepOptions(adam));
    REQUIRE_MESSAGE(stepped.ok(), stepped.ToString());
  }
  std::vector<std::vector<float>> out;
  for (ParamId id : ids) {
    out.emplace_back(kNumel);
    REQUIRE_OK((*engine)->ReadMasterWeights(id, out.back()));
  }
  CHECK((*engine)->stats().peak_device_bytes >= (*engine)->stats().device_arena_bytes);
  CHECK_OK(runtime.FreeDevice(grad));
  REQUIRE_OK((*engine)->Close());
  return out;
}

TEST_CASE("engine on the GPU trains as on the host, bit for bit: fp32 and bf16, cpu and nvme") {
  for (ElementType dtype : {ElementType::kFloat32, ElementType::kBFloat16}) {
    for (Tier tier : {Tier::kCpu, Tier::kNvme}) {
      CAPTURE(ElementTypeName(dtype));
      CAPTURE(TierName(tier));
      testing::TempDir host_dir("gpu-engine-host-"), gpu_dir("gpu-engine-gpu-");
      auto host = gpu::CreateHostOnlyRuntime();
      auto cuda = gpu::MakeRuntime();
      const auto want = TrainEngine(*host, nullptr, dtype, tier, host_dir.PathOf("nvme"), 0);
      const auto got = TrainEngine(*cuda, nullptr, dtype, tier, gpu_dir.PathOf("nvme"), 0);
      for (size_t i = 0; i < want.size(); ++i) {
        CHECK(std::memcmp(got[i].data(), want[i].data(), want[i].size() * 4) == 0);
      }
      if (tier == Tier::kNvme) {  // the optimizer during backward: write-backs beside fetches
        testing::TempDir overlap_dir("gpu-engine-overlap-");
        const auto overlapped = TrainEngine(*cuda, nullptr, dtype, tier, overlap_dir.PathOf("nvme"),
                                            0, /*prepare=*/true);
        for (size_t i = 0; i < want.size(); ++i) {
          CHECK(std::memcmp(overlapped[i].data(), want[i].data(), want[i].size() * 4) == 0);
        }
      }
    }
  }
}

TEST_CASE("ZeRO-3 over two GPUs through NCCL trains as the thread-group collective on the host") {
#if MEMPLAN_HAVE_NCCL
  if (!gpu::CreateCudaRuntime(1).ok()) {
    MESSAGE("one GPU: ZeRO-3 over NCCL needs two");
    return;
  }
  auto group = CreateThreadGroupCollectives(2, nullptr, std::chrono::seconds(60));
  REQUIRE_OK(group);
  const std::string id = *NcclUniqueId();
  std::vector<std::vector<std::vector<float>>> want(2), got(2);
  testing::TempDir dir("gpu-engine-zero3-");
  for (bool nccl : {false, true}) {
    std::vector<std::thread> ranks;
    for (int r = 0; r < 2; ++r) {
      ranks.emplace_back([&, nccl, r] {
        std::unique_ptr<gpu::Runtime> runtime;
        std::unique_ptr<Collective> own;
        Collective* collective = (*group)[static_cast<size_t>(r)].get();
        if (nccl) {
          runtime = std::move(gpu::CreateCudaRuntime(r)).value();
          own = std::move(CreateNcclCollective(runtime.get(), r, 2, id)).value();
          collective = own.get();
        } else {
          runtime = gpu::CreateHostOnlyRuntime();
        }
        (nccl ? got : want)[static_cast<size_t>(r)] =
            TrainEngine(*runtime, collective, ElementType::kBFloat16, Tier::kCpu,
                        dir.PathOf(nccl ? "nccl" : "host"), r);
      });
    }
    for (std::thread& t : ranks) t.join();
  }
  for (int r = 0; r < 2; ++r) {
    for (size_t i = 0; i < want[0].size(); ++i) {
      CHECK(std::memcmp(got[r][i].data(), want[r][i].data(), want[r][i].size() * 4) == 0);
    }
  }
#else
  MESSAGE("built without NCCL");
#endif
}

}  // namespace
}  // namespace memplan::offload

int main(int argc, char** argv) {
  auto runtime = memplan::gpu::CreateCudaRuntime(0);
  if (!runtime.ok()) {
    std::fprintf(stderr, "offload_gpu_test: %s\n", runtime.status().ToString().c_str());
    if (runtime.status().code() == memplan::StatusCode::kUnavailable) {
      std::fprintf(stderr, "offload_gpu_test: skipped (no usable GPU)\n");
      return 77;
    }
    return 1;
  }
  runtime.value().reset();  // each test makes its own
  doctest::Context context(argc, argv);
  return context.run();
}
