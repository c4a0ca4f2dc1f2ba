#include "gpu/gpu_runtime.h"

#include <doctest/doctest.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>
#include "tests/status_testing.h"

namespace memplan::gpu {
namespace {

std::vector<uint8_t> Pattern(size_t bytes, uint32_t seed) {
  std::vector<uint8_t> out(bytes);
  uint32_t x = seed * 2654435761u + 1;
  for (auto& b : out) {
    x = x * 1664525u + 1013904223u;
    b = static_cast<uint8_t>(x >> 24);
  }
  return out;
}

// Device memory freed at the end of the scope.
struct DeviceBuffer {
  DeviceBuffer(Runtime& rt, uint64_t bytes) : runtime(rt) {
    auto p = runtime.AllocateDevice(bytes);
    REQUIRE_OK(p);
    ptr = *p;
  }
  ~DeviceBuffer() { CHECK_OK(runtime.FreeDevice(ptr)); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  Runtime& runtime;
  void* ptr = nullptr;
};

CopyTicket MustCopy(Runtime& rt, CopyDirection d, void* dst, const void* src, uint64_t bytes) {
  auto t = rt.CopyAsync(d, dst, src, bytes);
  REQUIRE_MESSAGE(t.ok(), t.status().ToString());
  return *t;
}

TEST_CASE("host-only runtime: what it is") {
  auto rt = CreateHostOnlyRuntime();
  CHECK(rt->Name() == "host-only");
  CHECK_FALSE(rt->has_device());
  CHECK(&DefaultHostOnlyRuntime() == &DefaultHostOnlyRuntime());
  CHECK(DefaultHostOnlyRuntime().Name() == "host-only");
}

TEST_CASE("host-only runtime: host -> device -> host round trip is byte-exact") {
  auto rt = CreateHostOnlyRuntime();
  // Odd sizes, so no copy is a neat multiple of anything.
  for (uint64_t bytes : {uint64_t{1}, uint64_t{255}, uint64_t{4097}, uint64_t{3} << 20}) {
    CAPTURE(bytes);
    const auto src = Pattern(bytes, static_cast<uint32_t>(bytes));
    std::vector<uint8_t> back(bytes, 0);
    DeviceBuffer dev(*rt, bytes);
    CHECK(reinterpret_cast<uintptr_t>(dev.ptr) % 256 == 0);
    const CopyTicket up = MustCopy(*rt, CopyDirection::kHostToDevice, dev.ptr, src.data(), bytes);
    CHECK(up.direction == CopyDirection::kHostToDevice);
    CHECK(up.sequence > 0);
    REQUIRE_OK(rt->Wait(up));
    const CopyTicket down =
        MustCopy(*rt, CopyDirection::kDeviceToHost, back.data(), dev.ptr, bytes);
    REQUIRE_OK(rt->Wait(down));
    CHECK(rt->Done(down));
    CHECK(back == src);
  }
}

TEST_CASE("host-only runtime: device -> device copies") {
  auto rt = CreateHostOnlyRuntime();
  const auto src = Pattern(10007, 3);
  std::vector<uint8_t> back(src.size());
  DeviceBuffer a(*rt, src.size());
  DeviceBuffer b(*rt, src.size());
  REQUIRE(
      rt->Wait(MustCopy(*rt, CopyDirection::kHostToDevice, a.ptr, src.data(), src.size())).ok());
  REQUIRE_OK(rt->Wait(MustCopy(*rt, CopyDirection::kDeviceToDevice, b.ptr, a.ptr, src.size())));
  REQUIRE(
      rt->Wait(MustCopy(*rt, CopyDirection::kDeviceToHost, back.data(), b.ptr, back.size())).ok());
  CHECK(back == src);
}

TEST_CASE("host-only runtime: tickets of a direction complete in submission order") {
  auto rt = CreateHostOnlyRuntime();
  constexpr int kCopies = 64;
  constexpr uint64_t kBytes = 1 << 16;
  DeviceBuffer dev(*rt, kBytes);
  std::vector<std::vector<uint8_t>> sources;
  for (int i = 0; i < kCopies; ++i) sources.push_back(Pattern(kBytes, 100 + i));
  std::vector<CopyTicket> tickets;
  // Every copy overwrites the same device buffer: only in-order execution leaves the last one.
  for (const auto& src : sources) {
    tickets.push_back(MustCopy(*rt, CopyDirection::kHostToDevice, dev.ptr, src.data(), kBytes));
  }
  for (size_t i = 1; i < tickets.size(); ++i) {
    CHECK(tickets[i].sequence == tickets[i - 1].sequence + 1);
  }
  // Waiting for the last implies every earlier one is done.
  REQUIRE_OK(rt->Wait(tickets.back()));
  for (const auto& t : tickets) CHECK(rt->Done(t));
  std::vector<uint8_t> back(kBytes);
  REQUIRE_OK(rt->Wait(MustCopy(*rt, CopyDirection::kDeviceToHost, back.data(), dev.ptr, kBytes)));
  CHECK(back == sources.back());
}

TEST_CASE("host-only runtime: directions have their own sequences") {
  auto rt = CreateHostOnlyRuntime();
  // Separate buffers per direction: directions are not ordered with each other.
  DeviceBuffer up_dev(*rt, 64);
  DeviceBuffer down_dev(*rt, 64);
  std::vector<uint8_t> up_host(64, 7);
  std::vector<uint8_t> down_host(64);
  const CopyTicket up1 =
      MustCopy(*rt, CopyDirection::kHostToDevice, up_dev.ptr, up_host.data(), 64);
  const CopyTicket up2 =
      MustCopy(*rt, CopyDirection::kHostToDevice, up_dev.ptr, up_host.data(), 64);
  const CopyTicket down1 =
      MustCopy(*rt, CopyDirection::kDeviceToHost, down_host.data(), down_dev.ptr, 64);
  CHECK(up1.sequence == 1);
  CHECK(up2.sequence == 2);
  CHECK(down1.sequence == 1);
  CHECK(down1.direction == CopyDirection::kDeviceToHost);
  CHECK_OK(rt->Synchronize());
}

TEST_CASE("host-only runtime: Done polls until the copy lands") {
  auto rt = CreateHostOnlyRuntime();
  constexpr uint64_t kBytes = uint64_t{32} << 20;
  const auto src = Pattern(kBytes, 9);
  DeviceBuffer dev(*rt, kBytes);
  const CopyTicket t = MustCopy(*rt, CopyDirection::kHostToDevice, dev.ptr, src.data(), kBytes);
  int polls = 0;
  while (!rt->Done(t)) {
    ++polls;
    std::this_thread::yield();
  }
  // Done() answering true means the bytes are there, without a Wait.
  CHECK(std::memcmp(dev.ptr, src.data(), kBytes) == 0);
  CHECK_OK(rt->Wait(t));
  MESSAGE("Done() polled " << polls << " times before the 32 MiB copy landed");
}

TEST_CASE("host-only runtime: empty tickets and zero-byte copies") {
  auto rt = CreateHostOnlyRuntime();
  CHECK(rt->Done(CopyTicket{}));
  CHECK_OK(rt->Wait(CopyTicket{}));
  auto t = rt->CopyAsync(CopyDirection::kDeviceToHost, nullptr, nullptr, 0);
  REQUIRE_OK(t);
  CHECK(t->sequence == 0);
  CHECK_OK(rt->Wait(*t));
  CHECK_OK(rt->Synchronize());  // nothing queued yet
}

TEST_CASE("host-only runtime: Synchronize waits for every direction") {
  auto rt = CreateHostOnlyRuntime();
  constexpr uint64_t kBytes = 1 << 20;
  // Directions are not ordered with each other, so no buffer is written by one direction while
  // another touches it: a is only written, c only read, d only written.
  DeviceBuffer a(*rt, kBytes);
  DeviceBuffer c(*rt, kBytes);
  DeviceBuffer d(*rt, kBytes);
  const auto src = Pattern(kBytes, 1);
  const auto on_device = Pattern(kBytes, 2);
  std::memcpy(c.ptr, on_device.data(), kBytes);
  std::vector<uint8_t> back(kBytes);
  std::vector<CopyTicket> tickets;
  for (int i = 0; i < 16; ++i) {
    tickets.push_back(MustCopy(*rt, CopyDirection::kHostToDevice, a.ptr, src.data(), kBytes));
    tickets.push_back(MustCopy(*rt, CopyDirection::kDeviceToHost, back.data(), c.ptr, kBytes));
    tickets.push_back(MustCopy(*rt, CopyDirection::kDeviceToDevice, d.ptr, c.ptr, kBytes));
  }
  REQUIRE_OK(rt->Synchronize());
  for (const auto& t : tickets) CHECK(rt->Done(t));
  CHECK(std::memcmp(a.ptr, src.data(), kBytes) == 0);
  CHECK(back == on_device);
  CHECK(std::memcmp(d.ptr, on_device.data(), kBytes) == 0);
}

TEST_CASE("host-only runtime: destroying it finishes the copies queued") {
  constexpr uint64_t kBytes = 4 << 20;
  const auto src = Pattern(kBytes, 5);
  std::vector<std::vector<uint8_t>> dst(8, std::vector<uint8_t>(kBytes, 0));
  {
    auto rt = CreateHostOnlyRuntime();
    // Device memory is only ever read here, and the runtime frees it on destruction.
    auto dev = rt->AllocateDevice(kBytes);
    REQUIRE_OK(dev);
    std::memcpy(*dev, src.data(), kBytes);
    for (auto& d : dst) MustCopy(*rt, CopyDirection::kDeviceToHost, d.data(), *dev, kBytes);
  }
  for (const auto& d : dst) CHECK(d == src);
}

TEST_CASE("host-only runtime: many threads copying at once") {
  auto rt = CreateHostOnlyRuntime();
  constexpr int kThreads = 8;
  constexpr int kRounds = 50;
  constexpr uint64_t kBytes = 8191;
  std::atomic<int> failures{0};
  std::atomic<bool> stop_polling{false};
  std::vector<CopyTicket> shared_tickets(kThreads);
  std::atomic<int> published{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      auto dev = rt->AllocateDevice(kBytes);
      if (!dev.ok()) {
        ++failures;
        return;
      }
      uint64_t last_up = 0;
      for (int r = 0; r < kRounds; ++r) {
        const auto src = Pattern(kBytes, static_cast<uint32_t>(t * 1000 + r));
        std::vector<uint8_t> back(kBytes);
        auto up = rt->CopyAsync(CopyDirection::kHostToDevice, *dev, src.data(), kBytes);
        if (!up.ok() || up->sequence <= last_up) ++failures;  // sequences only increase
        if (!up.ok()) break;
        last_up = up->sequence;
        if (r == 0) {
          shared_tickets[t] = *up;
          published.fetch_add(1, std::memory_order_release);
        }
        if (!rt->Wait(*up).ok()) ++failures;
        auto down = rt->CopyAsync(CopyDirection::kDeviceToHost, back.data(), *dev, kBytes);
        if (!down.ok() || !rt->Wait(*down).ok() || back != src) ++failures;
      }
      if (!rt->FreeDevice(*dev).ok()) ++failures;
    });
  }
  // Meanwhile another thread polls and synchronises.
  std::thread poller([&] {
    while (!stop_polling.load()) {
      if (published.load(std::memory_order_acquire) == kThreads) {
        for (const auto& t : shared_tickets) (void)rt->Done(t);
      }
      if (!rt->Synchronize().ok()) ++failures;
      (void)rt->device_bytes_in_use();
    }
  });
  for (auto& th : threads) th.join();
  stop_polling = true;
  poller.join();
  CHECK(failures.load() == 0);
  CHECK(rt->device_bytes_in_use() == 0);
}

TEST_CASE("host-only runtime: device memory is accounted") {
  auto rt = CreateHostOnlyRuntime();
  CHECK(rt->device_bytes_in_use() == 0);
  auto a = rt->AllocateDevice(1000);
  auto b = rt->AllocateDevice(24);
  REQUIRE_OK(a);
  REQUIRE_OK(b);
  CHECK(*a != *b);
  CHECK(reinterpret_cast<uintptr_t>(*b) % 256 == 0);
  CHECK(rt->device_bytes_in_use() == 1024);
  CHECK_OK(rt->FreeDevice(*a));
  CHECK(rt->device_bytes_in_use() == 24);
  CHECK_OK(rt->FreeDevice(nullptr));
  CHECK(rt->device_bytes_in_use() == 24);
  // Freeing twice is caught, and changes nothing.
  Status twice = rt->FreeDevice(*a);
  CHECK(twice.code() == StatusCode::kInvalidArgument);
  CHECK(rt->device_bytes_in_use() == 24);
  CHECK_OK(rt->FreeDevice(*b));
  CHECK(rt->device_bytes_in_use() == 0);
}

TEST_CASE("host-only runtime: bad arguments are errors") {
  auto rt = CreateHostOnlyRuntime();
  std::vector<uint8_t> host(16);
  int not_device = 0;

  SUBCASE("allocation") {
    CHECK(rt->AllocateDevice(0).status().code() == StatusCode::kInvalidArgument);
    auto huge = rt->AllocateDevice(UINT64_MAX / 2);
    CHECK(huge.status().code() == StatusCode::kResourceExhausted);
    CHECK(rt->FreeDevice(&not_device).code() == StatusCode::kInvalidArgument);
    CHECK(rt->device_bytes_in_use() == 0);
  }
  SUBCASE("copies") {
    auto null_dst = rt->CopyAsync(CopyDirection::kHostToDevice, nullptr, host.data(), 16);
    CHECK(null_dst.status().code() == StatusCode::kInvalidArgument);
    CHECK(null_dst.status().message().find("null") != std::string::npos);
    auto null_src = rt->CopyAsync(CopyDirection::kDeviceToHost, host.data(), nullptr, 16);
    CHECK(null_src.status().code() == StatusCode::kInvalidArgument);
    auto bad_direction =
        rt->CopyAsync(static_cast<CopyDirection>(7), host.data(), host.data() + 8, 8);
    CHECK(bad_direction.status().code() == StatusCode::kInvalidArgument);
  }
  SUBCASE("tickets never issued") {
    const CopyTicket future{CopyDirection::kDeviceToHost, 5};
    Status s = rt->Wait(future);
    CHECK(s.code() == StatusCode::kInvalidArgument);
    CHECK(s.message().find("never issued") != std::string::npos);
    CHECK(rt->Done(future));  // "done": Wait answers at once
    CHECK(rt->Wait(CopyTicket{static_cast<CopyDirection>(-1), 1}).code() ==
          StatusCode::kInvalidArgument);
  }
  SUBCASE("registration") {
    CHECK(rt->RegisterHost(nullptr, 16).code() == StatusCode::kInvalidArgument);
    CHECK(rt->RegisterHost(host.data(), 0).code() == StatusCode::kInvalidArgument);
    CHECK(rt->UnregisterHost(host.data()).code() == StatusCode::kInvalidArgument);
    REQUIRE_OK(rt->RegisterHost(host.data(), 16));
    // Overlapping a registered range, from either side.
    CHECK(rt->RegisterHost(host.data() + 8, 8).code() == StatusCode::kInvalidArgument);
    CHECK(rt->RegisterHost(host.data(), 1).code() == StatusCode::kInvalidArgument);
    CHECK(rt->UnregisterHost(host.data() + 1).code() == StatusCode::kInvalidArgument);
    CHECK_OK(rt->UnregisterHost(host.data()));
    CHECK(rt->UnregisterHost(host.data()).code() == StatusCode::kInvalidArgument);
    // Adjacent ranges do not overlap.
    CHECK_OK(rt->RegisterHost(host.data(), 8));
    CHECK_OK(rt->RegisterHost(host.data() + 8, 8));
    CHECK_OK(rt->UnregisterHost(host.data()));
    CHECK_OK(rt->UnregisterHost(host.data() + 8));
  }
}

TEST_CASE("host-only runtime: no streams; a GPU stream or a foreign fence is refused") {
  auto rt = CreateHostOnlyRuntime();
  auto fence = rt->RecordFence(Stream{});
  REQUIRE_OK(fence);
  CHECK(fence->empty());
  CHECK_OK(rt->WaitFence(CopyDirection::kHostToDevice, *fence));
  CHECK_OK(rt->WaitFenceOnHost(*fence));
  CHECK_OK(rt->OrderAfter(CopyDirection::kDeviceToHost, Stream{}));
  int not_a_stream = 0;
  auto refused = rt->RecordFence(Stream{&not_a_stream});
  CHECK(refused.status().code() == StatusCode::kInvalidArgument);
  CHECK(refused.status().message().find("no streams") != std::string::npos);
  CHECK(rt->OrderAfter(CopyDirection::kDeviceToHost, Stream{&not_a_stream}).code() ==
        StatusCode::kInvalidArgument);
  const Fence foreign(std::make_shared<int>(1));
  CHECK(rt->WaitFence(CopyDirection::kHostToDevice, foreign).code() ==
        StatusCode::kInvalidArgument);
  CHECK(rt->CopyStream(CopyDirection::kDeviceToHost).handle == nullptr);
  CHECK(rt->device() == -1);
  void* a = *rt->AllocateDevice(1000);
  void* b = *rt->AllocateDevice(3000);
  CHECK_OK(rt->FreeDevice(a));
  CHECK(rt->peak_device_bytes() == 4000);  // counted at each allocation
  CHECK_OK(rt->FreeDevice(b));
  CHECK(rt->peak_device_bytes() == 4000);
}

TEST_CASE("CreateCudaRuntime and CreateBestRuntime say why there is no GPU") {
  auto cuda = CreateCudaRuntime(0);
  std::string note;
  auto best = CreateBestRuntime(&note);
  REQUIRE(best != nullptr);
  if (cuda.ok()) {
    // A machine with a GPU: the CUDA runtime is chosen and described.
    CHECK(best->has_device());
    CHECK(note.find("cuda:0") == 0);
  } else {
    CHECK(cuda.status().code() == StatusCode::kUnavailable);
    CHECK(cuda.status().message().find("no usable GPU") != std::string::npos);
    CHECK(best->Name() == "host-only");
    CHECK_FALSE(best->has_device());
    CHECK(note.find("host-only") == 0);
    // The note carries the reason, e.g. "cudaGetDeviceCount failed: CUDA driver version is
    // insufficient for CUDA runtime version" or "memplan was built without CUDA".
    CHECK(note.find(cuda.status().message()) != std::string::npos);
    MESSAGE("CreateBestRuntime: " << note);
  }
  CHECK(CreateBestRuntime() != nullptr);  // the note is optional
}

}  // namespace
}  // namespace memplan::gpu
