// PinnedPool: slots, the hard budget, waiting and timeouts, exact statistics, alignment, and the
// RLIMIT_MEMLOCK check's message.
#include "offload/pinned_pool.h"

#include <doctest/doctest.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <set>
#include <string>
#include <thread>
#include <vector>
#include "tests/status_testing.h"

namespace memplan::offload {
namespace {

const uint64_t kPage = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));

PinnedPoolOptions SmallOptions(uint64_t slots) {
  PinnedPoolOptions o;
  o.slot_bytes = 3 * kPage;
  o.slot_count = slots;
  o.budget_bytes = 3 * kPage * slots;
  return o;
}

TEST_CASE("PinnedPool hands out distinct page-aligned slots and takes them back") {
  auto pool = PinnedPool::Create(SmallOptions(3));
  REQUIRE_OK(pool);
  std::vector<PinnedSlot> slots;
  std::set<uint64_t> indices;
  for (int i = 0; i < 3; ++i) {
    auto slot = (*pool)->Acquire();
    REQUIRE_OK(slot);
    CHECK(reinterpret_cast<uintptr_t>(slot->data().data()) % kPage == 0);
    CHECK(slot->data().size() == 3 * kPage);
    slot->data()[0] = std::byte{1};
    slot->data()[slot->data().size() - 1] = std::byte{2};
    indices.insert(slot->index());
    slots.push_back(std::move(*slot));
  }
  CHECK(indices.size() == 3);
  slots.clear();
  CHECK((*pool)->stats().current_bytes == 0);
  CHECK_OK((*pool)->Acquire());
}

TEST_CASE("PinnedPool memory is not inherited by a fork (a DataLoader worker)") {
  PinnedPoolOptions o;
  o.slot_bytes = 4096;
  o.slot_count = 2;
  o.budget_bytes = 8192;
  auto pool = PinnedPool::Create(o);
  REQUIRE_OK(pool);
  auto slot = (*pool)->Acquire();
  REQUIRE_OK(slot);
  void* page = slot->data().data();
  const pid_t child = ::fork();
  if (child == 0) {
    // In the child the range must not be mapped: msync answers ENOMEM for unmapped memory.
    ::_exit(::msync(page, 4096, MS_ASYNC) != 0 && errno == ENOMEM ? 0 : 1);
  }
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  CHECK((WIFEXITED(status) && WEXITSTATUS(status) == 0));
  CHECK(::msync(page, 4096, MS_ASYNC) == 0);  // still mapped here
}

TEST_CASE("PinnedPool slot bytes are rounded up to the page size") {
  PinnedPoolOptions o;
  o.slot_bytes = kPage + 1;
  o.slot_count = 2;
  o.budget_bytes = 4 * kPage;
  auto pool = PinnedPool::Create(o);
  REQUIRE_OK(pool);
  CHECK((*pool)->slot_bytes() == 2 * kPage);
  o.budget_bytes = 4 * kPage - 1;  // the rounded slots no longer fit
  CHECK(PinnedPool::Create(o).status().code() == StatusCode::kInvalidArgument);
}

TEST_CASE("PinnedPool options are validated") {
  PinnedPoolOptions o = SmallOptions(2);
  o.slot_count = 0;
  CHECK(o.Validate().code() == StatusCode::kInvalidArgument);
  o = SmallOptions(2);
  o.slot_bytes = 0;
  CHECK(o.Validate().code() == StatusCode::kInvalidArgument);
  o = SmallOptions(2);
  o.budget_bytes = o.budget_bytes - 1;
  CHECK(o.Validate().code() == StatusCode::kInvalidArgument);
  CHECK(o.Validate().message().find("exceeds budget_bytes") != std::string::npos);
}

TEST_CASE("PinnedPool without wait fails at once and never overcommits") {
  PinnedPoolOptions o = SmallOptions(2);
  o.wait = false;
  auto pool = PinnedPool::Create(o);
  REQUIRE_OK(pool);
  auto a = (*pool)->Acquire();
  auto b = (*pool)->Acquire();
  REQUIRE_OK(a);
  REQUIRE_OK(b);
  auto c = (*pool)->Acquire();
  CHECK(c.status().code() == StatusCode::kResourceExhausted);
  PinnedPoolStats s = (*pool)->stats();
  CHECK(s.current_bytes == s.capacity_bytes);
  CHECK(s.failures == 1);
  CHECK(s.waits == 0);
}

TEST_CASE("PinnedPool waiting acquire is woken by a release from another thread") {
  auto pool = PinnedPool::Create(SmallOptions(1));
  REQUIRE_OK(pool);
  auto held = (*pool)->Acquire();
  REQUIRE_OK(held);
  std::atomic<bool> got{false};
  std::thread waiter([&] {
    auto slot = (*pool)->Acquire();
    got = slot.ok();
  });
  // Wait until the waiter is blocked (waits counts it), so the release really wakes it.
  while ((*pool)->stats().waits == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  CHECK_FALSE(got.load());
  held->Release();
  waiter.join();
  CHECK(got.load());
  PinnedPoolStats s = (*pool)->stats();
  CHECK(s.acquires == 2);
  CHECK(s.waits == 1);
  CHECK(s.failures == 0);
  CHECK(s.current_bytes == 0);
}

TEST_CASE("PinnedPool acquire with a timeout gives up with Unavailable") {
  auto pool = PinnedPool::Create(SmallOptions(1));
  REQUIRE_OK(pool);
  auto held = (*pool)->Acquire();
  REQUIRE_OK(held);
  const auto start = std::chrono::steady_clock::now();
  auto late = (*pool)->Acquire(std::chrono::milliseconds(30));
  const auto waited = std::chrono::steady_clock::now() - start;
  CHECK(late.status().code() == StatusCode::kUnavailable);
  CHECK(late.status().retryable());
  CHECK(waited >= std::chrono::milliseconds(30));
  PinnedPoolStats s = (*pool)->stats();
  CHECK(s.waits == 1);
  CHECK(s.failures == 1);
  CHECK(s.wait_time_us >= 30000);
}

TEST_CASE("PinnedPool statistics are exact") {
  auto pool = PinnedPool::Create(SmallOptions(3));
  REQUIRE_OK(pool);
  const uint64_t slot = (*pool)->slot_bytes();
  {
    auto a = (*pool)->Acquire();
    auto b = (*pool)->Acquire();
    CHECK((*pool)->stats().current_bytes == 2 * slot);
  }
  auto c = (*pool)->Acquire();
  PinnedPoolStats s = (*pool)->stats();
  CHECK(s.capacity_bytes == 3 * slot);
  CHECK(s.current_bytes == slot);
  CHECK(s.peak_bytes == 2 * slot);
  CHECK(s.acquires == 3);
  CHECK(s.waits == 0);
  CHECK(s.wait_time_us == 0);
  CHECK(s.failures == 0);
}

TEST_CASE("PinnedPool many threads never exceed the budget") {
  auto pool = PinnedPool::Create(SmallOptions(2));
  REQUIRE_OK(pool);
  std::atomic<int> in_use{0};
  std::atomic<int> max_in_use{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 200; ++i) {
        auto slot = (*pool)->Acquire();
        if (!slot.ok()) continue;
        int now = ++in_use;
        int prev = max_in_use.load();
        while (now > prev && !max_in_use.compare_exchange_weak(prev, now)) {
        }
        --in_use;
      }
    });
  }
  for (auto& t : threads) t.join();
  CHECK(max_in_use.load() <= 2);
  PinnedPoolStats s = (*pool)->stats();
  CHECK(s.acquires == 800);
  CHECK(s.peak_bytes <= s.capacity_bytes);
  CHECK(s.current_bytes == 0);
}

TEST_CASE("PinnedPool checks RLIMIT_MEMLOCK up front and says how to raise it") {
  // In a child, so the lowered limit does not leak into the other tests.
  int fds[2];
  REQUIRE(::pipe(fds) == 0);
  pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    ::close(fds[0]);
    struct rlimit limit {};
    ::getrlimit(RLIMIT_MEMLOCK, &limit);
    limit.rlim_cur = 64 * 1024;
    if (::setrlimit(RLIMIT_MEMLOCK, &limit) != 0) ::_exit(2);
    PinnedPoolOptions o;
    o.slot_bytes = 1 << 20;
    o.slot_count = 2;
    o.budget_bytes = 2 << 20;
    o.lock_memory = true;
    auto pool = PinnedPool::Create(o);
    std::string msg = pool.ok() ? "ok" : pool.status().ToString();
    (void)!::write(fds[1], msg.data(), msg.size());
    ::_exit(pool.status().code() == StatusCode::kResourceExhausted ? 0 : 1);
  }
  ::close(fds[1]);
  std::string msg;
  char buf[512];
  for (ssize_t n; (n = ::read(fds[0], buf, sizeof buf)) > 0;) msg.append(buf, n);
  ::close(fds[0]);
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  INFO(msg);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  CHECK(msg.find("2097152 bytes") != std::string::npos);
  CHECK(msg.find("65536 bytes") != std::string::npos);
  CHECK(msg.find("ulimit -l") != std::string::npos);
  CHECK(msg.find("limits.conf") != std::string::npos);
  CHECK(msg.find("LimitMEMLOCK") != std::string::npos);
}

TEST_CASE("PinnedPool locks memory within the limit") {
  PinnedPoolOptions o = SmallOptions(2);
  o.lock_memory = true;
  auto pool = PinnedPool::Create(o);
  REQUIRE_OK(pool);
  CHECK_OK((*pool)->Acquire());
}

}  // namespace
}  // namespace memplan::offload
