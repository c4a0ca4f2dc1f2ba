#include "offload/collective.h"

#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

#include "gpu/gpu_runtime.h"
#include "tests/status_testing.h"

namespace memplan::offload {
namespace {

TEST_CASE("ElementBytes") {
  CHECK(ElementBytes(ElementType::kFloat32) == 4);
  CHECK(ElementBytes(ElementType::kBFloat16) == 2);
  CHECK(ElementBytes(ElementType::kFloat16) == 2);
}

// Device buffers of the host-only runtime are host memory, so the test reads them directly.
struct Fixture {
  std::unique_ptr<gpu::Runtime> runtime = gpu::CreateHostOnlyRuntime();
  std::unique_ptr<Collective> collective = CreateSingleProcessCollective(runtime.get());

  void* Device(uint64_t bytes) {
    auto p = runtime->AllocateDevice(bytes);
    REQUIRE_OK(p);
    buffers.push_back(*p);
    return *p;
  }
  ~Fixture() {
    for (void* p : buffers) CHECK_OK(runtime->FreeDevice(p));
  }
  std::vector<void*> buffers;
};

TEST_CASE("single-process collective: world size 1, rank 0") {
  Fixture f;
  CHECK(f.collective->Name() == "single-process");
  CHECK(f.collective->rank() == 0);
  CHECK(f.collective->world_size() == 1);
  // Null runtime: the process-wide host-only one.
  auto fallback = CreateSingleProcessCollective(nullptr);
  CHECK(fallback->world_size() == 1);
}

TEST_CASE("single-process collective: all-gather and reduce-scatter copy rank 0's data") {
  Fixture f;
  constexpr uint64_t kCount = 1000;
  for (ElementType type : {ElementType::kFloat32, ElementType::kBFloat16}) {
    CAPTURE(static_cast<int>(type));
    const uint64_t bytes = kCount * ElementBytes(type);
    std::vector<uint8_t> pattern(bytes);
    std::iota(pattern.begin(), pattern.end(), uint8_t{3});
    void* send = f.Device(bytes);
    void* recv = f.Device(bytes);
    std::memcpy(send, pattern.data(), bytes);

    std::memset(recv, 0, bytes);
    REQUIRE_OK(f.collective->AllGather(send, recv, kCount, type));
    CHECK(std::memcmp(recv, pattern.data(), bytes) == 0);

    std::memset(recv, 0, bytes);
    REQUIRE_OK(f.collective->ReduceScatter(send, recv, kCount, type));
    CHECK(std::memcmp(recv, pattern.data(), bytes) == 0);

    // The sum over one rank is its own data.
    REQUIRE_OK(f.collective->AllReduce(recv, kCount, type));
    CHECK(std::memcmp(recv, pattern.data(), bytes) == 0);

    // In place (send is recv's own slot): nothing to move.
    REQUIRE_OK(f.collective->AllGather(recv, recv, kCount, type));
    CHECK(std::memcmp(recv, pattern.data(), bytes) == 0);
  }
}

TEST_CASE("single-process collective: bad arguments are errors") {
  Fixture f;
  void* a = f.Device(64);
  CHECK(f.collective->AllGather(nullptr, a, 4, ElementType::kFloat32).code() ==
        StatusCode::kInvalidArgument);
  CHECK(f.collective->ReduceScatter(a, nullptr, 4, ElementType::kFloat16).code() ==
        StatusCode::kInvalidArgument);
  CHECK(f.collective->AllReduce(nullptr, 4, ElementType::kFloat32).code() ==
        StatusCode::kInvalidArgument);
  // Nothing to do is fine, whatever the pointers.
  CHECK_OK(f.collective->AllGather(nullptr, nullptr, 0, ElementType::kFloat32));
  CHECK_OK(f.collective->AllReduce(nullptr, 0, ElementType::kFloat32));
  // Partly overlapping buffers would make the copy's result depend on its direction.
  auto* bytes = static_cast<uint8_t*>(a);
  CHECK(f.collective->AllGather(bytes, bytes + 4, 4, ElementType::kFloat32).code() ==
        StatusCode::kInvalidArgument);
  CHECK(f.collective->AllGather(a, a, 4, static_cast<ElementType>(9)).code() ==
        StatusCode::kInvalidArgument);
  CHECK(f.collective->ReduceScatter(a, bytes + 32, UINT64_MAX / 2, ElementType::kFloat32).code() ==
        StatusCode::kOutOfRange);
}

TEST_CASE("NCCL collective refuses what it cannot use") {
  auto host = gpu::CreateHostOnlyRuntime();
  // Without NCCL in the build: Unavailable; with it: the host-only runtime is no CUDA device.
  auto nccl = CreateNcclCollective(host.get(), 0, 1, std::string(128, '\0'));
  REQUIRE_FALSE(nccl.ok());
  CHECK((nccl.status().code() == StatusCode::kUnavailable ||
         nccl.status().code() == StatusCode::kInvalidArgument));
  MESSAGE("CreateNcclCollective(host-only): " << nccl.status().ToString());
}

}  // namespace
}  // namespace memplan::offload
