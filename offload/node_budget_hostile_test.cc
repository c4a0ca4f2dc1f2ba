// NodeBudget against another user on the same node: its segment's name is predictable and /dev/shm
// is writable by all, so a segment planted under our name, by another user or readable by others,
// must be refused before it is read. (Mode 0600 and the per-user name: node_budget_test.cc.)
#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <string>

#include "offload/node_budget.h"

namespace memplan::offload {
namespace {

// Creates /dev/shm/<segment> as a stranger would: `mode`, owned by `uid` when running as root.
void Plant(const std::string& segment, mode_t mode, uid_t uid) {
  int fd = ::shm_open(segment.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, mode);
  REQUIRE(fd >= 0);
  REQUIRE(::ftruncate(fd, 96 * 1024) == 0);
  REQUIRE(::fchmod(fd, mode) == 0);
  if (uid != ::geteuid()) REQUIRE(::fchown(fd, uid, uid) == 0);
  ::close(fd);
}

TEST_CASE("NodeBudget refuses a segment planted under its name, and leaves it alone") {
  const std::string name = "hostile-" + std::to_string(::getpid());
  const std::string segment = NodeBudget::SegmentName(name);
  (void)NodeBudget::Remove(name);
  // Refusing must not change the planted segment: still there, still its size.
  auto expect_left_alone = [&] {
    struct stat st {};
    REQUIRE(::stat(("/dev/shm/" + segment).c_str(), &st) == 0);
    CHECK(st.st_size == 96 * 1024);
  };

  SUBCASE("readable and writable by every user") {
    Plant(segment, 0666, ::geteuid());
    auto budget = NodeBudget::Open({name, 1000});
    REQUIRE_FALSE(budget.ok());
    CHECK(budget.status().code() == StatusCode::kFailedPrecondition);
    CHECK(budget.status().message().find("mode 0666") != std::string::npos);
    CHECK(budget.status().message().find(segment) != std::string::npos);
    expect_left_alone();
  }
  SUBCASE("owned by another user") {
    if (::geteuid() != 0) {
      MESSAGE("skipped: only root can create a segment owned by another user");
      return;
    }
    Plant(segment, 0600, 65534);
    auto budget = NodeBudget::Open({name, 1000});
    REQUIRE_FALSE(budget.ok());
    CHECK(budget.status().code() == StatusCode::kFailedPrecondition);
    CHECK(budget.status().message().find("uid 65534") != std::string::npos);
    expect_left_alone();
  }
  (void)NodeBudget::Remove(name);
}

}  // namespace
}  // namespace memplan::offload
