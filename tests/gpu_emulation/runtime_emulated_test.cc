// The emulated GPU itself (what it makes visible), and the real CudaRuntime and NcclCollective on
// it: streams and fences, devices, faults, deadlines.
#include <cuda_runtime_api.h>
#include <doctest/doctest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gpu_emulation.h"
#include "offload/collective.h"
#include "gpu/gpu_runtime.h"
#include "offload/param_swapper.h"
#include "tests/status_testing.h"
#ifdef MEMPLAN_TEST_OLD_API
#include "old_api.h"
#endif

namespace memplan::emulated {
namespace {

using gpu::CopyDirection;
using gpu::CopyTicket;

struct Fresh {
  explicit Fresh(int devices = 2,
                 std::chrono::milliseconds collective_timeout = std::chrono::seconds(20)) {
    gpu_emulation::Config c;
    c.devices = devices;
    c.collective_timeout = collective_timeout;
    gpu_emulation::Reset(c);
  }
};

std::unique_ptr<gpu::Runtime> Cuda(int device = 0) {
  auto rt = gpu::CreateCudaRuntime(device);
  REQUIRE_MESSAGE(rt.ok(), rt.status().ToString());
  return std::move(rt).value();
}

// A page-aligned host buffer, registered with the runtime while it lives.
struct Pinned {
  Pinned(gpu::Runtime& runtime, size_t size) : rt(runtime) {
    data = static_cast<std::byte*>(::operator new (size, std::align_val_t{4096}));
    std::memset(data, 0, size);
    REQUIRE_OK(rt.RegisterHost(data, size));
  }
  ~Pinned() {
    (void)rt.UnregisterHost(data);
    ::operator delete (data, std::align_val_t{4096});
  }
  gpu::Runtime& rt;
  std::byte* data;
};

// A stream of the trainer's, on `device`.
struct TrainerStream {
  explicit TrainerStream(int device = 0) {
    REQUIRE(cudaSetDevice(device) == cudaSuccess);
    REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess);
  }
  ~TrainerStream() {
    (void)cudaStreamSynchronize(stream);
    (void)cudaStreamDestroy(stream);
  }
  cudaStream_t stream = nullptr;
};

// A kernel that writes `value` into the first `bytes` of `device` after `ms` milliseconds.
void LateWrite(cudaStream_t stream, void* device, size_t bytes, int value, int ms) {
  gpu_emulation::LaunchKernel(stream, [=] {
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    std::memset(gpu_emulation::DeviceView(device, bytes), value, bytes);
  });
}

// ---- The emulation makes bugs visible
// ------------------------------------------------------------

TEST_CASE("emulation: host code that dereferences device memory faults") {
  Fresh fresh;
  auto rt = Cuda();
  void* device = *rt->AllocateDevice(4096);
  const pid_t child = ::fork();
  if (child == 0) {
    std::signal(SIGSEGV, SIG_DFL);  // not doctest's handler: die as a program would
    volatile char c = *static_cast<volatile char*>(device);  // a bug: device memory
    (void)c;
    ::_exit(0);
  }
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  // Killed by SIGSEGV (or, under a sanitizer, reported and exited non-zero): never a clean exit.
  CHECK_FALSE((WIFEXITED(status) && WEXITSTATUS(status) == 0));
  CHECK_OK(rt->FreeDevice(device));
}

#ifndef MEMPLAN_TEST_OLD_API  // fences are new
TEST_CASE("emulation: a copy not ordered after a kernel reads what was there before") {
  Fresh fresh;
  auto rt = Cuda();
  TrainerStream trainer;
  void* device = *rt->AllocateDevice(4096);
  Pinned host(*rt, 4096);
  REQUIRE_OK(rt->Wait(*rt->CopyAsync(CopyDirection::kHostToDevice, device, host.data, 4096)));
  LateWrite(trainer.stream, device, 4096, 7, 30);
  // Not ordered: the copy stream does not wait for the trainer's kernel.
  REQUIRE_OK(rt->Wait(*rt->CopyAsync(CopyDirection::kDeviceToHost, host.data, device, 4096)));
  CHECK(host.data[0] == std::byte{0});
  // Ordered with a fence: it sees the kernel's bytes.
  LateWrite(trainer.stream, device, 4096, 9, 30);
  REQUIRE_OK(rt->OrderAfter(CopyDirection::kDeviceToHost, gpu::Stream{trainer.stream}));
  REQUIRE_OK(rt->Wait(*rt->CopyAsync(CopyDirection::kDeviceToHost, host.data, device, 4096)));
  CHECK(host.data[0] == std::byte{9});
  CHECK(host.data[4095] == std::byte{9});
  CHECK_OK(rt->FreeDevice(device));
}
#endif

TEST_CASE("emulation: pageable copies are synchronous, pinned ones are not") {
  Fresh fresh;
  auto rt = Cuda();
  TrainerStream trainer;
  void* device = *rt->AllocateDevice(4096);
  REQUIRE(cudaMemsetAsync(device, 3, 4096, trainer.stream) == cudaSuccess);
  REQUIRE(cudaStreamSynchronize(trainer.stream) == cudaSuccess);
  gpu_emulation::ResetCounters();
  // Device to pageable memory: the host waits for the stream and the copy.
  std::vector<std::byte> pageable(4096);
  LateWrite(trainer.stream, device, 4096, 5, 20);
  REQUIRE(cudaMemcpyAsync(pageable.data(), device, 4096, cudaMemcpyDeviceToHost, trainer.stream) ==
          cudaSuccess);
  CHECK(pageable[0] == std::byte{5});  // already there: the call was synchronous
  // Device to pinned memory: queued; the call returns before the kernel has even run.
  Pinned pinned(*rt, 4096);
  LateWrite(trainer.stream, device, 4096, 6, 50);
  REQUIRE(cudaMemcpyAsync(pinned.data, device, 4096, cudaMemcpyDeviceToHost, trainer.stream) ==
          cudaSuccess);
  CHECK(pinned.data[0] == std::byte{0});
  REQUIRE(cudaStreamSynchronize(trainer.stream) == cudaSuccess);
  CHECK(pinned.data[0] == std::byte{6});
  const gpu_emulation::Counters c = gpu_emulation::GetCounters();
  CHECK(c.d2h_pageable_bytes == 4096);
  CHECK(c.d2h_pinned_bytes == 4096);
  CHECK(c.pageable_copies == 1);
  CHECK_OK(rt->FreeDevice(device));
}

TEST_CASE("emulation: capped device memory, injected faults, and their Status") {
  gpu_emulation::Config c;
  c.device_bytes = uint64_t{64} << 20;
  gpu_emulation::Reset(c);
  auto rt = Cuda();
  auto too_big = rt->AllocateDevice(uint64_t{65} << 20);
  CHECK(too_big.status().code() == StatusCode::kResourceExhausted);
  MESSAGE(too_big.status().ToString());
  void* a = *rt->AllocateDevice(uint64_t{60} << 20);
  CHECK(rt->AllocateDevice(uint64_t{8} << 20).status().code() == StatusCode::kResourceExhausted);
  CHECK_OK(rt->FreeDevice(a));
  CHECK(gpu_emulation::GetCounters().failed_mallocs == 2);
  // The second copy fails as a broken transfer would: IoError naming the call and the error.
  void* d = *rt->AllocateDevice(4096);
  Pinned host(*rt, 4096);
  gpu_emulation::FailNthCall("cudaMemcpyAsync", 2, cudaErrorLaunchFailure);
  CHECK_OK(rt->CopyAsync(CopyDirection::kHostToDevice, d, host.data, 4096));
  auto failed = rt->CopyAsync(CopyDirection::kHostToDevice, d, host.data, 4096);
  CHECK(failed.status().code() == StatusCode::kIoError);
  CHECK(failed.status().message().find("cudaMemcpyAsync") != std::string::npos);
  CHECK(failed.status().message().find("cudaErrorLaunchFailure") != std::string::npos);
  CHECK_OK(rt->CopyAsync(CopyDirection::kHostToDevice, d, host.data, 4096));  // one-shot
  CHECK_OK(rt->Synchronize());
  CHECK_OK(rt->FreeDevice(d));
}

// ---- CudaRuntime on the emulation
// ----------------------------------------------------------------

TEST_CASE("cuda runtime: waits sleep, they do not spin") {  // a defect the review listed as lower
  Fresh fresh;
  auto rt = Cuda();
  void* d = *rt->AllocateDevice(1 << 20);
  Pinned host(*rt, 1 << 20);
  gpu_emulation::ResetCounters();
  for (int i = 0; i < 8; ++i) {
    REQUIRE_OK(rt->Wait(*rt->CopyAsync(CopyDirection::kHostToDevice, d, host.data, 1 << 20)));
  }
  CHECK(gpu_emulation::GetCounters().event_syncs > 0);
  CHECK(gpu_emulation::GetCounters().spin_waits == 0);
  CHECK_OK(rt->FreeDevice(d));
}

TEST_CASE("cuda runtime: the current device by default; devices are checked") {
  Fresh fresh;
  std::string name;
  std::thread t([&] {
    if (cudaSetDevice(1) != cudaSuccess) return;
    auto rt = gpu::CreateCudaRuntime();
    if (rt.ok()) name = std::string((*rt)->Name());
  });
  t.join();
  CHECK(name == "cuda:1");
  CHECK(gpu::CreateCudaRuntime(2).status().code() == StatusCode::kInvalidArgument);
  CHECK(gpu::CreateCudaRuntime(-2).status().code() == StatusCode::kInvalidArgument);
  auto rt0 = Cuda(0);
  auto rt1 = Cuda(1);
  // Memory of GPU 1 given to the runtime of GPU 0: refused, not copied across.
  void* on1 = *rt1->AllocateDevice(4096);
  Pinned host(*rt0, 4096);
  auto crossed = rt0->CopyAsync(CopyDirection::kHostToDevice, on1, host.data, 4096);
  CHECK(crossed.status().code() == StatusCode::kInvalidArgument);
#ifndef MEMPLAN_TEST_OLD_API
  // A stream of GPU 1 given to the runtime of GPU 0.
  TrainerStream other(1);
  auto fence = rt0->RecordFence(gpu::Stream{other.stream});
  CHECK(fence.status().code() == StatusCode::kInvalidArgument);
  MESSAGE(fence.status().ToString());
#endif
  CHECK_OK(rt1->FreeDevice(on1));
}

// ---- NcclCollective on the emulation
// -------------------------------------------------------------

// Runs `body(rank)` on `world` threads, each with its own current device `rank`.
template <typename Body>
std::vector<Status> OnRanks(int world, Body body) {
  std::vector<Status> status(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      if (cudaSetDevice(r) != cudaSuccess) {
        status[static_cast<size_t>(r)] = Status::Internal("cudaSetDevice");
        return;
      }
      status[static_cast<size_t>(r)] = body(r);
    });
  }
  for (std::thread& t : threads) t.join();
  return status;
}

TEST_CASE("defect 4: ranks on their own current devices form a communicator (no duplicate GPU)") {
  Fresh fresh(2);
  const std::string id = *offload::NcclUniqueId();
  std::vector<float> sums(2, 0.0f);
  auto status = OnRanks(2, [&](int r) -> Status {
    // Neither rank names a device: each runtime follows its thread's current device.
    MEMPLAN_ASSIGN_OR_RETURN(auto rt, gpu::CreateCudaRuntime());
    MEMPLAN_ASSIGN_OR_RETURN(auto nccl, offload::CreateNcclCollective(rt.get(), r, 2, id));
    MEMPLAN_ASSIGN_OR_RETURN(void* d, rt->AllocateDevice(4096));
    Pinned host(*rt, 4096);
    const float v = static_cast<float>(r + 1);
    std::memcpy(host.data, &v, 4);
    MEMPLAN_RETURN_IF_ERROR(
        rt->Wait(*rt->CopyAsync(CopyDirection::kHostToDevice, d, host.data, 4)));
    MEMPLAN_RETURN_IF_ERROR(nccl->AllReduce(d, 1, offload::ElementType::kFloat32));
    MEMPLAN_RETURN_IF_ERROR(
        rt->Wait(*rt->CopyAsync(CopyDirection::kDeviceToHost, host.data, d, 4)));
    std::memcpy(&sums[static_cast<size_t>(r)], host.data, 4);
    return rt->FreeDevice(d);
  });
  for (const Status& s : status) CHECK_MESSAGE(s.ok(), s.ToString());
  CHECK(sums[0] == 3.0f);
  CHECK(sums[1] == 3.0f);
}

TEST_CASE("defect 5: a rank that never joins fails the others' init at the deadline, not never") {
  Fresh fresh(2, std::chrono::seconds(10));
  auto rt = Cuda(0);
  offload::NcclOptions options;
  options.timeout = std::chrono::milliseconds(500);
  const auto start = std::chrono::steady_clock::now();
  auto made = offload::CreateNcclCollective(rt.get(), 0, 2, *offload::NcclUniqueId(), options);
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  CHECK(made.status().code() == StatusCode::kIoError);
  MESSAGE(made.status().ToString());
  CHECK(made.status().message().find("rank 0 of 2") != std::string::npos);
  CHECK(made.status().message().find("did not finish within 0.5 s") != std::string::npos);
  CHECK(waited < 5.0);  // the emulation's own watchdog (10 s) did not have to end it
}

TEST_CASE("defect 5: a rank that stops calling fails its peers' collective at the deadline") {
  Fresh fresh(2, std::chrono::seconds(10));
  const std::string id = *offload::NcclUniqueId();
  double waited = 0;
  Status second;
  auto status = OnRanks(2, [&](int r) -> Status {
    MEMPLAN_ASSIGN_OR_RETURN(auto rt, gpu::CreateCudaRuntime());
    offload::NcclOptions options;
    options.timeout = std::chrono::milliseconds(500);
    MEMPLAN_ASSIGN_OR_RETURN(auto nccl, offload::CreateNcclCollective(rt.get(), r, 2, id, options));
    MEMPLAN_ASSIGN_OR_RETURN(void* d, rt->AllocateDevice(8192));
    Status result;
    if (r == 0) {  // rank 1 has "died": it never makes this call
      const auto start = std::chrono::steady_clock::now();
      result = nccl->AllGather(d, d, 1024, offload::ElementType::kFloat32);
      waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      second = nccl->AllGather(d, d, 1024, offload::ElementType::kFloat32);
    }
    MEMPLAN_RETURN_IF_ERROR(rt->FreeDevice(d));
    return result;
  });
  CHECK_OK(status[1]);
  CHECK(status[0].code() == StatusCode::kIoError);
  MESSAGE(status[0].ToString());
  CHECK(status[0].message().find("ncclAllGather(1024 x fp32) did not finish within") !=
        std::string::npos);
  CHECK(waited < 5.0);
  CHECK(second.code() == StatusCode::kFailedPrecondition);  // aborted: make a new one
}

TEST_CASE(
    "emulated NCCL: ranks that issue different collectives are told which, not left hanging") {
  Fresh fresh(2, std::chrono::seconds(10));
  const std::string id = *offload::NcclUniqueId();
  auto status = OnRanks(2, [&](int r) -> Status {
    MEMPLAN_ASSIGN_OR_RETURN(auto rt, gpu::CreateCudaRuntime());
    MEMPLAN_ASSIGN_OR_RETURN(auto nccl, offload::CreateNcclCollective(rt.get(), r, 2, id));
    MEMPLAN_ASSIGN_OR_RETURN(void* d, rt->AllocateDevice(8192));
    Status result = r == 0 ? nccl->AllGather(d, d, 1024, offload::ElementType::kFloat32)
                           : nccl->ReduceScatter(d, d, 512, offload::ElementType::kFloat32);
    MEMPLAN_RETURN_IF_ERROR(rt->FreeDevice(d));
    return result;
  });
  for (const Status& s : status) {
    CHECK(s.code() == StatusCode::kInvalidArgument);  // ncclInvalidUsage
    MESSAGE(s.ToString());
    CHECK(s.message().find("rank 0: #1 AllGather(1024 x fp32)") != std::string::npos);
    CHECK(s.message().find("rank 1: #1 ReduceScatter(512 x fp32)") != std::string::npos);
  }
}

TEST_CASE("nccl collective: bf16 on an NCCL without it is Unimplemented, not a garbage sum") {
  gpu_emulation::Config c;
  c.nccl_version = 20900;  // 2.9: no ncclBfloat16
  gpu_emulation::Reset(c);
  auto rt = Cuda(0);
  auto nccl = offload::CreateNcclCollective(rt.get(), 0, 1, *offload::NcclUniqueId());
  REQUIRE_MESSAGE(nccl.ok(), nccl.status().ToString());
  void* d = *rt->AllocateDevice(4096);
  Status s = (*nccl)->AllReduce(d, 1024, offload::ElementType::kBFloat16);
  CHECK(s.code() == StatusCode::kUnimplemented);
  MESSAGE(s.ToString());
  CHECK_OK((*nccl)->AllReduce(d, 1024, offload::ElementType::kFloat16));
  CHECK_OK(rt->FreeDevice(d));
}

// ---- Synchronisations a test must see go missing (mutate.py beside this file)
// ------------------------------------------------

#ifndef MEMPLAN_TEST_OLD_API  // fences are new
// A kernel on `stream` that runs until `*release` is set (or for 10 s, so that a broken test ends)
// and then sets `*done`: work that holds whatever is ordered after it.
void HeldKernel(cudaStream_t stream, std::shared_ptr<std::atomic<bool>> release,
                std::shared_ptr<std::atomic<bool>> done) {
  gpu_emulation::LaunchKernel(stream, [release, done] {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!release->load() && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    done->store(true);
  });
}

TEST_CASE("cuda runtime: WaitFenceOnHost returns only after the fence's work has run") {
  Fresh fresh;
  auto rt = Cuda();
  TrainerStream trainer;
  auto release = std::make_shared<std::atomic<bool>>(false);
  auto done = std::make_shared<std::atomic<bool>>(false);
  HeldKernel(trainer.stream, release, done);
  auto fence = rt->RecordFence(gpu::Stream{trainer.stream});
  REQUIRE_OK(fence);
  std::thread releaser([release] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    release->store(true);
  });
  // The host may free or reuse what the kernel reads once this returns.
  CHECK_OK(rt->WaitFenceOnHost(*fence));
  CHECK(done->load());
  releaser.join();
}

TEST_CASE("cuda runtime: destroying it waits for the copies it queued") {
  // gpu_runtime.h: "Destroying a runtime waits for the copies it has queued". cudaStreamDestroy
  // does not (it returns at once and lets the work finish), so a copy into memory the runtime does
  // not own (a tensor's, here a buffer registered outside it) could land after the destructor.
  Fresh fresh;
  TrainerStream trainer;
  void* device = nullptr;
  REQUIRE(cudaMalloc(&device, 4096) == cudaSuccess);
  gpu_emulation::KernelWrite(trainer.stream, device, std::vector<std::byte>(4096, std::byte{7}));
  REQUIRE(cudaStreamSynchronize(trainer.stream) == cudaSuccess);
  auto* host = static_cast<std::byte*>(::operator new (4096, std::align_val_t{4096}));
  std::memset(host, 0, 4096);
  REQUIRE(cudaHostRegister(host, 4096, cudaHostRegisterPortable) == cudaSuccess);
  auto release = std::make_shared<std::atomic<bool>>(false);
  auto done = std::make_shared<std::atomic<bool>>(false);
  std::thread releaser;
  {
    auto rt = Cuda();
    HeldKernel(trainer.stream, release, done);
    REQUIRE_OK(rt->OrderAfter(CopyDirection::kDeviceToHost, gpu::Stream{trainer.stream}));
    REQUIRE_OK(rt->CopyAsync(CopyDirection::kDeviceToHost, host, device, 4096));
    releaser = std::thread([release] {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      release->store(true);
    });
  }  // the runtime goes with its copy queued behind the kernel
  CHECK(host[0] == std::byte{7});
  CHECK(host[4095] == std::byte{7});
  releaser.join();
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  CHECK(cudaHostUnregister(host) == cudaSuccess);
  ::operator delete (host, std::align_val_t{4096});
  CHECK(cudaFree(device) == cudaSuccess);
}

TEST_CASE("cuda runtime: a full event ring makes CopyAsync wait for the oldest copy") {
  // gpu_runtime.h: CopyAsync blocks when 1024 copies of the direction are in flight until the
  // oldest is done (Note [Event ring]); a caller that never waits cannot queue without bound.
  Fresh fresh;
  auto rt = Cuda();
  TrainerStream trainer;
  void* device = *rt->AllocateDevice(4096);
  {
    Pinned host(*rt, 4096);
    auto release = std::make_shared<std::atomic<bool>>(false);
    auto done = std::make_shared<std::atomic<bool>>(false);
    HeldKernel(trainer.stream, release, done);
    // Every copy below starts after the held kernel.
    REQUIRE_OK(rt->OrderAfter(CopyDirection::kHostToDevice, gpu::Stream{trainer.stream}));
    constexpr int kRing = 1024;
    auto first = rt->CopyAsync(CopyDirection::kHostToDevice, device, host.data, 64);
    REQUIRE_OK(first);
    CHECK_FALSE(rt->Done(*first));  // held: Done polls, it does not guess
    std::atomic<int> queued{1};
    std::atomic<bool> last_saw_kernel_done{false};
    std::thread producer([&] {
      for (int i = 1; i <= kRing; ++i) {
        if (!rt->CopyAsync(CopyDirection::kHostToDevice, device, host.data, 64).ok()) return;
        if (i == kRing) last_saw_kernel_done = done->load();
        ++queued;
      }
    });
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (queued.load() < kRing && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    CHECK(queued.load() == kRing);  // the ring is full: copy 1025 waits for copy 1
    release->store(true);
    producer.join();
    CHECK(queued.load() == kRing + 1);
    CHECK(last_saw_kernel_done.load());  // copy 1 ran, so the kernel before it had
    CHECK(rt->Done(*first));
    CHECK_OK(rt->Synchronize());
  }
  CHECK_OK(rt->FreeDevice(device));
}

TEST_CASE("param swapper: EndOfStep waits for the copies of the prefetches it drops") {
  // A prefetch dropped at the end of a step may still be copying from the pinned arena into its
  // buffer; EndOfStep must not return before that copy is done, since the optimizer then writes
  // the arena (Write) and the buffer is handed out again.
  Fresh fresh;
  auto rt = Cuda();
  TrainerStream trainer;
  constexpr uint64_t kBig = 16384, kSmall = 4096;  // bf16 elements
  offload::ParamSwapperOptions o;
  o.tier = offload::Tier::kCpu;
  o.dtype = offload::ElementType::kBFloat16;
  o.persistence_threshold = 0;
  o.runtime = rt.get();
  // C is prefetched only once A has been released (live budget), so its load is ordered after
  // the fence of A's release: after the trainer's held kernel.
  o.max_live_bytes = 2 * kBig * 2;
  o.prefetch_bytes = (kBig + kSmall) * 2;
  auto made = offload::ParamSwapper::Create(o);
  REQUIRE_OK(made);
  offload::ParamSwapper& swapper = **made;
  REQUIRE_OK(swapper.Add("a", "A", kBig));
  REQUIRE_OK(swapper.Add("b", "B", kBig));
  REQUIRE_OK(swapper.Add("c", "C", kSmall));
  REQUIRE_OK(swapper.Finalize());
  const gpu::Stream stream{trainer.stream};
  for (const char* m : {"A", "B", "C"}) {  // step 1 records the trace
    REQUIRE_OK(swapper.Fetch(m));
    REQUIRE_OK(swapper.Release(m, stream));
  }
  REQUIRE_OK(swapper.EndOfStep());
  const uint64_t loaded_before = swapper.stats().h2d_bytes;
  REQUIRE_OK(swapper.Fetch("A"));
  // B, prefetched with A, is loaded before the kernel below holds the lane.
  const auto wait_loaded = [&](uint64_t bytes) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (swapper.stats().h2d_bytes < bytes && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return swapper.stats().h2d_bytes;
  };
  REQUIRE(wait_loaded(loaded_before + 2 * (2 * kBig)) == loaded_before + 2 * (2 * kBig));
  auto release = std::make_shared<std::atomic<bool>>(false);
  auto done = std::make_shared<std::atomic<bool>>(false);
  HeldKernel(trainer.stream, release, done);
  REQUIRE_OK(swapper.Release("A", stream));
  REQUIRE_OK(swapper.Fetch("B"));  // prefetches C, whose copy waits for the kernel
  const uint64_t want = loaded_before + 2 * (2 * kBig + kSmall);
  REQUIRE(wait_loaded(want) == want);  // C's copy is queued
  REQUIRE_OK(swapper.Release("B", stream));
  std::thread releaser([release] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    release->store(true);
  });
  REQUIRE_OK(swapper.EndOfStep());  // the step ends before C: its prefetch is dropped
  CHECK(done->load());              // ... and its copy, after the kernel, has run
  CHECK(swapper.stats().prefetch_wasted >= 1);
  // The optimizer's write-back into the arena C's copy read (ThreadSanitizer sees a race here
  // when EndOfStep did not wait).
  std::vector<uint16_t> values(swapper.partition_elements(), 0x3f80);
  CHECK_OK(swapper.WriteHalf(0, values));
  releaser.join();
}

TEST_CASE("param swapper: GatherResident returns with the gathered parameters in place") {
  // ZeRO-3 keeps small parameters whole on every rank: GatherResident all-gathers their shards
  // into a pack and copies each out on the device-to-device lane, which nothing orders with the
  // trainer's kernels that read them next: it must wait for those copies.
  Fresh fresh(2);
  const std::string id = *offload::NcclUniqueId();
  constexpr uint64_t kNumel = 1000;  // a shard of 500 per rank
  auto status = OnRanks(2, [&](int r) -> Status {
    MEMPLAN_ASSIGN_OR_RETURN(auto rt, gpu::CreateCudaRuntime());
    MEMPLAN_ASSIGN_OR_RETURN(auto nccl, offload::CreateNcclCollective(rt.get(), r, 2, id));
    TrainerStream trainer(r);
    offload::ParamSwapperOptions o;
    o.tier = offload::Tier::kCpu;
    o.dtype = offload::ElementType::kFloat32;
    o.persistence_threshold = kNumel;  // resident
    o.runtime = rt.get();
    o.collective = nccl.get();
    MEMPLAN_ASSIGN_OR_RETURN(auto swapper, offload::ParamSwapper::Create(o));
    MEMPLAN_ASSIGN_OR_RETURN(offload::ParamId w, swapper->Add("w", "M", kNumel));
    MEMPLAN_RETURN_IF_ERROR(swapper->Finalize());
    std::vector<float> shard(swapper->partition_elements());
    for (size_t i = 0; i < shard.size(); ++i) shard[i] = static_cast<float>(r * 1000 + i);
    MEMPLAN_RETURN_IF_ERROR(swapper->WriteFloat(0, shard));
    // The device-to-device lane is held until 50 ms from now.
    auto release = std::make_shared<std::atomic<bool>>(false);
    auto done = std::make_shared<std::atomic<bool>>(false);
    HeldKernel(trainer.stream, release, done);
    MEMPLAN_RETURN_IF_ERROR(
        rt->OrderAfter(CopyDirection::kDeviceToDevice, gpu::Stream{trainer.stream}));
    std::thread releaser([release] {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      release->store(true);
    });
    Status gathered = swapper->GatherResident();
    releaser.join();
    MEMPLAN_RETURN_IF_ERROR(gathered);
    MEMPLAN_ASSIGN_OR_RETURN(void* device, swapper->DevicePointer(w));
    std::vector<float> whole(kNumel);
    MEMPLAN_ASSIGN_OR_RETURN(CopyTicket down, rt->CopyAsync(CopyDirection::kDeviceToHost,
                                                            whole.data(), device, kNumel * 4));
    MEMPLAN_RETURN_IF_ERROR(rt->Wait(down));
    for (uint64_t i = 0; i < kNumel; ++i) {
      const float want = static_cast<float>(i < 500 ? i : 1000 + (i - 500));
      if (whole[i] != want) {
        return Status::Internal("rank " + std::to_string(r) + ": element " + std::to_string(i) +
                                " is " + std::to_string(whole[i]) + ", not " +
                                std::to_string(want));
      }
    }
    return Status::Ok();
  });
  for (const Status& s : status) CHECK_MESSAGE(s.ok(), s.ToString());
}
#endif

}  // namespace
}  // namespace memplan::emulated
