// NodeBudget across processes: the total granted never exceeds the budget, a SIGKILLed process's
// share is reclaimed, the segment is private to its user (0600); and PinnedPool reserving from it.
#include "offload/node_budget.h"

#include <doctest/doctest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <string>
#include <vector>

#include "offload/pinned_pool.h"
#include "tests/status_testing.h"

namespace memplan::offload {
namespace {

// A name unique to this run and test; the segment is removed when the test ends.
class ScopedBudgetName {
 public:
  explicit ScopedBudgetName(std::string_view tag)
      : name_("test-" + std::to_string(::getpid()) + "-" + std::string(tag)) {
    (void)NodeBudget::Remove(name_);
  }
  ~ScopedBudgetName() { (void)NodeBudget::Remove(name_); }
  const std::string& get() const { return name_; }

 private:
  std::string name_;
};

// What a forked holder does once it holds its bytes.
enum class HolderEnd {
  kWaitForKill,  // waits until it is killed
  kExit,         // exits at once without releasing them: its entry stays in the segment
};

// Forks a process that opens the budget `name` (1000 bytes), reserves 900 of them and then ends
// as `end` says. Returns its pid once it holds the bytes; the caller reaps it.
pid_t ForkHolder(const std::string& name, HolderEnd end) {
  int ready[2];
  REQUIRE(::pipe(ready) == 0);
  pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    auto mine = NodeBudget::Open({name, 1000});
    auto r = mine.ok() ? (*mine)->Reserve(900) : Result<NodeReservation>(mine.status());
    char c = r.ok() ? 'y' : 'n';
    (void)!::write(ready[1], &c, 1);
    if (end == HolderEnd::kExit) ::_exit(0);
    for (;;) ::pause();
  }
  ::close(ready[1]);
  char c = 0;
  REQUIRE(::read(ready[0], &c, 1) == 1);
  ::close(ready[0]);
  REQUIRE(c == 'y');
  return pid;
}

TEST_CASE("NodeBudget segment is per user with mode 0600 and removed at the end") {
  ScopedBudgetName name("mode");
  const std::string path = "/dev/shm/" + NodeBudget::SegmentName(name.get());
  {
    auto budget = NodeBudget::Open({name.get(), 1000});
    REQUIRE_OK(budget);
    struct stat st {};
    REQUIRE(::stat(path.c_str(), &st) == 0);
    CHECK((st.st_mode & 0777) == 0600);
    CHECK(st.st_uid == ::getuid());
    CHECK(NodeBudget::SegmentName(name.get()).find(std::to_string(::getuid())) !=
          std::string::npos);
  }
  REQUIRE_OK(NodeBudget::Remove(name.get()));
  struct stat st {};
  CHECK(::stat(path.c_str(), &st) != 0);
}

TEST_CASE("NodeBudget grants within the budget, releases on destruction, names the numbers") {
  ScopedBudgetName name("basic");
  auto budget = NodeBudget::Open({name.get(), 1000});
  REQUIRE_OK(budget);
  {
    auto a = (*budget)->Reserve(600);
    REQUIRE_OK(a);
    auto b = (*budget)->Reserve(500);
    REQUIRE_FALSE(b.ok());
    CHECK(b.status().code() == StatusCode::kResourceExhausted);
    CHECK(b.status().message().find("budget 1000") != std::string::npos);
    CHECK(b.status().message().find("used 600") != std::string::npos);
    CHECK(b.status().message().find("requested 500") != std::string::npos);
    CHECK((*budget)->Usage()->used_bytes == 600);
  }
  CHECK((*budget)->Usage()->used_bytes == 0);
  CHECK_OK((*budget)->Reserve(1000));
  CHECK(NodeBudget::Open({name.get(), 2000}).status().code() == StatusCode::kFailedPrecondition);
  CHECK(NodeBudget::Open({"bad/name", 10}).status().code() == StatusCode::kInvalidArgument);
}

TEST_CASE("NodeBudget never grants more than the budget to processes racing for it") {
  ScopedBudgetName name("race");
  auto budget = NodeBudget::Open({name.get(), 1000});
  REQUIRE_OK(budget);
  // Each child reports through its exit code whether it got 300 bytes, holding them until every
  // child has tried, so the grants overlap; at most 3 of 8 can fit.
  int go[2];
  int tried[2];
  REQUIRE(::pipe(go) == 0);
  REQUIRE(::pipe(tried) == 0);
  std::vector<pid_t> kids;
  for (int i = 0; i < 8; ++i) {
    pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      ::close(go[1]);
      auto mine = NodeBudget::Open({name.get(), 1000});
      if (!mine.ok()) ::_exit(2);
      auto r = (*mine)->Reserve(300);
      char c = 't';
      (void)!::write(tried[1], &c, 1);
      (void)!::read(go[0], &c, 1);  // returns when the parent closes the pipe
      ::_exit(r.ok() ? 1 : 0);
    }
    kids.push_back(pid);
  }
  ::close(go[0]);
  ::close(tried[1]);
  // Every child has tried (and the winners still hold their bytes) before any may exit, so a late
  // child cannot win bytes an earlier one gave back.
  for (int i = 0; i < 8; ++i) {
    char c;
    REQUIRE(::read(tried[0], &c, 1) == 1);
  }
  ::close(tried[0]);
  CHECK((*budget)->Usage()->used_bytes == 900);
  ::close(go[1]);
  int granted = 0;
  for (pid_t pid : kids) {
    int status = 0;
    REQUIRE(::waitpid(pid, &status, 0) == pid);
    REQUIRE(WIFEXITED(status));
    REQUIRE(WEXITSTATUS(status) != 2);
    granted += WEXITSTATUS(status);
  }
  CHECK(granted == 3);
  CHECK((*budget)->Usage()->used_bytes == 0);
}

TEST_CASE("NodeBudget reclaims the share of a process killed with SIGKILL") {
  ScopedBudgetName name("kill");
  auto budget = NodeBudget::Open({name.get(), 1000});
  REQUIRE_OK(budget);
  const pid_t pid = ForkHolder(name.get(), HolderEnd::kWaitForKill);
  CHECK_FALSE((*budget)->Reserve(200).ok());
  ::kill(pid, SIGKILL);
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);  // reaped: a zombie would still own its pid
  auto r = (*budget)->Reserve(900);
  CHECK_OK(r);
  CHECK((*budget)->Usage()->used_bytes == 900);
}

TEST_CASE("NodeBudget reclaims the share of a zombie (exited, not yet reaped)") {
  ScopedBudgetName name("zombie");
  auto budget = NodeBudget::Open({name.get(), 1000});
  REQUIRE_OK(budget);
  // It exits holding the entry; the parent does not reap it yet.
  const pid_t pid = ForkHolder(name.get(), HolderEnd::kExit);
  // Wait until the child is a zombie (its pid still exists: kill(pid, 0) succeeds).
  siginfo_t info{};
  REQUIRE(::waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOWAIT) == 0);
  REQUIRE(::kill(pid, 0) == 0);
  auto r = (*budget)->Reserve(900);
  CHECK_OK(r);
  CHECK((*budget)->Usage()->used_bytes == 900);
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
}

TEST_CASE("NodeBudget recovers its lock from a process killed while holding it") {
  ScopedBudgetName name("lock");
  auto budget = NodeBudget::Open({name.get(), 1000});
  REQUIRE_OK(budget);
  pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    auto mine = NodeBudget::Open({name.get(), 1000});
    if (mine.ok()) (*mine)->DebugWithLockHeld([] { ::raise(SIGKILL); });
    ::_exit(1);
  }
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  REQUIRE(WIFSIGNALED(status));
  // With a plain process-shared mutex the next line would block forever: fail loudly instead.
  ::alarm(30);
  auto r = (*budget)->Reserve(400);
  ::alarm(0);
  REQUIRE_OK(r);
  auto usage = (*budget)->Usage();
  REQUIRE_OK(usage);
  CHECK(usage->used_bytes == 400);
  CHECK(usage->recovered_locks == 1);
}

TEST_CASE("PinnedPool reserves its whole allocation from the named node budget") {
  ScopedBudgetName name("pool");
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  PinnedPoolOptions o;
  o.slot_bytes = page;
  o.slot_count = 2;
  o.budget_bytes = 2 * page;
  o.node_budget_name = name.get();
  o.node_budget_bytes = 3 * page;
  auto budget = NodeBudget::Open({name.get(), 3 * page});
  REQUIRE_OK(budget);
  {
    auto pool = PinnedPool::Create(o);
    REQUIRE_OK(pool);
    CHECK((*budget)->Usage()->used_bytes == 2 * page);
    auto second = PinnedPool::Create(o);
    CHECK(second.status().code() == StatusCode::kResourceExhausted);
    CHECK(second.status().message().find("requested " + std::to_string(2 * page)) !=
          std::string::npos);
  }
  CHECK((*budget)->Usage()->used_bytes == 0);
}

}  // namespace
}  // namespace memplan::offload
