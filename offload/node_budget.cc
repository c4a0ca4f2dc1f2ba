#include "offload/node_budget.h"

#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <boost/interprocess/exceptions.hpp>
#include <boost/interprocess/managed_shared_memory.hpp>
#include <boost/interprocess/permissions.hpp>
#include <boost/interprocess/shared_memory_object.hpp>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>
#include <utility>

namespace memplan::offload {
namespace bip = boost::interprocess;
namespace {

constexpr int kMaxEntries = 1024;
constexpr uint64_t kSegmentBytes = 96 * 1024;
// The name of the state object in the segment; bumped whenever SharedState's layout changes, so a
// segment left by an older build is reported, not misread.
constexpr const char* kStateName = "state-v2";

// What /proc says of a process: its state letter and its start time (clock ticks since boot,
// field 22 of /proc/<pid>/stat), which tells a pid's reuse from its first owner.
struct ProcessInfo {
  char state = '?';
  uint64_t start_time = 0;
};

std::optional<ProcessInfo> ReadProcessInfo(int pid) {
  const std::string path = "/proc/" + std::to_string(pid) + "/stat";
  std::FILE* f = std::fopen(path.c_str(), "re");
  if (f == nullptr) return std::nullopt;
  char buf[1024];
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  // The command name (field 2) is in parentheses and may hold anything, ')' included: fields 3 on
  // start after the last ')'.
  const char* p = std::strrchr(buf, ')');
  if (p == nullptr) return std::nullopt;
  ProcessInfo info;
  unsigned long long start = 0;
  // Fields 3 (state) .. 22 (starttime): skip the 18 fields between them.
  if (std::sscanf(p + 1,
                  " %c %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s "
                  "%*s %llu",
                  &info.state, &start) != 2) {
    return std::nullopt;
  }
  info.start_time = start;
  return info;
}

// Start time of this process, 0 when /proc cannot tell.
uint64_t SelfStartTime() {
  auto info = ReadProcessInfo(static_cast<int>(::getpid()));
  return info ? info->start_time : 0;
}

struct Entry {
  int pid = 0;              // 0: free
  uint64_t start_time = 0;  // of that pid's process when it reserved; 0: unknown
  uint64_t id = 0;
  uint64_t bytes = 0;
};

// Whether the owner of `e` is gone: no such pid, a zombie (dead but not yet reaped), or the pid
// now names another process (a different start time).
bool Dead(const Entry& e) {
  if (::kill(e.pid, 0) != 0 && errno == ESRCH) return true;
  auto info = ReadProcessInfo(e.pid);
  if (!info) return false;  // no /proc (or a race with its exit): trust kill()
  if (info->state == 'Z' || info->state == 'X') return true;
  return e.start_time != 0 && info->start_time != e.start_time;
}

// Lives in the segment; constructed once by find_or_construct, which Boost makes atomic across
// processes. The mutex is a process-shared ROBUST pthread mutex: when a process dies holding it,
// the next locker is told (EOWNERDEAD) and takes it over, instead of every rank blocking forever.
struct SharedState {
  explicit SharedState(uint64_t budget) : budget_bytes(budget) {
    pthread_mutexattr_t attr;
    pthread_mutexattr_init(&attr);
    pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
    pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
    pthread_mutex_init(&mu, &attr);
    pthread_mutexattr_destroy(&attr);
  }
  pthread_mutex_t mu;
  uint64_t budget_bytes;
  uint64_t next_id = 1;
  uint64_t recovered_locks = 0;  // times a dead holder's lock was taken over
  Entry entries[kMaxEntries];
};

// Holds SharedState::mu. Every critical section below leaves the entries valid after each single
// store (an entry is claimed by writing its pid last), so a holder that died mid-way leaves
// nothing to repair beyond marking the mutex consistent.
class SharedLock {
 public:
  explicit SharedLock(SharedState& s) : s_(s) {
    int rc = pthread_mutex_lock(&s_.mu);
    if (rc == EOWNERDEAD) {
      pthread_mutex_consistent(&s_.mu);
      ++s_.recovered_locks;
      rc = 0;
    }
    locked_ = rc == 0;
    error_ = rc;
  }
  ~SharedLock() {
    if (locked_) pthread_mutex_unlock(&s_.mu);
  }
  SharedLock(const SharedLock&) = delete;
  SharedLock& operator=(const SharedLock&) = delete;
  Status status(const std::string& name) const {
    if (locked_) return Status::Ok();
    return Status::FromErrno(error_, "node budget '" + name + "': cannot lock its mutex");
  }

 private:
  SharedState& s_;
  bool locked_ = false;
  int error_ = 0;
};

}  // namespace

struct NodeBudget::Impl {
  bip::managed_shared_memory segment;
  SharedState* state = nullptr;
  uint64_t start_time = SelfStartTime();
};

Status NodeBudgetOptions::Validate() const {
  if (name.empty() || name.size() > 64) {
    return Status::InvalidArgument("node budget: name must be 1 to 64 characters");
  }
  for (char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '_' || c == '.' || c == '-';
    if (!ok) return Status::InvalidArgument("node budget: name '" + name + "' has a bad char");
  }
  if (budget_bytes == 0) return Status::InvalidArgument("node budget: budget_bytes must be > 0");
  return Status::Ok();
}

std::string NodeBudget::SegmentName(std::string_view name) {
  return "memplan-" + std::to_string(::getuid()) + "-" + std::string(name);
}

Status NodeBudget::Remove(std::string_view name) {
  bip::shared_memory_object::remove(SegmentName(name).c_str());
  return Status::Ok();
}

// The segment's name is predictable, and /dev/shm is writable by every user: another user may
// create it first, with a mode that lets them change what we read. Refuses a segment that is not a
// regular file of this user's with no group or other permissions. Once it is ours, no one else can
// replace it (/dev/shm is sticky). OK when there is no segment yet.
namespace {
Status CheckSegmentOwner(const std::string& segment_name) {
  int fd = ::shm_open(segment_name.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC, 0);
  if (fd < 0) {
    if (errno == ENOENT) return Status::Ok();
    return Status::FromErrno(errno, "node budget '" + segment_name + "': cannot open");
  }
  struct stat st {};
  const int stat_result = ::fstat(fd, &st);
  const int stat_errno = errno;
  ::close(fd);
  if (stat_result != 0) {
    return Status::FromErrno(stat_errno, "node budget '" + segment_name + "': cannot stat");
  }
  if (!S_ISREG(st.st_mode) || st.st_uid != ::geteuid() || (st.st_mode & 077) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof(mode), "%04o", static_cast<unsigned>(st.st_mode & 07777));
    return Status::FailedPrecondition(
        "node budget '/dev/shm/" + segment_name + "' is not a private segment of this user (uid " +
        std::to_string(st.st_uid) + ", mode " + mode +
        "); another user may have created it: remove it, or use another budget name");
  }
  return Status::Ok();
}
}  // namespace

Result<std::shared_ptr<NodeBudget>> NodeBudget::Open(const NodeBudgetOptions& options) {
  MEMPLAN_RETURN_IF_ERROR(options.Validate());
  const std::string segment_name = SegmentName(options.name);
  // Before mapping it (a hostile segment must not be read), and after (it may have been created
  // in between).
  MEMPLAN_RETURN_IF_ERROR(CheckSegmentOwner(segment_name));
  auto impl = std::make_unique<Impl>();
  // Boost.Interprocess reports errors by exception; this is the module boundary that converts.
  try {
    bip::permissions perm(0600);  // per user: other users must not read or change our budget
    impl->segment = bip::managed_shared_memory(bip::open_or_create, segment_name.c_str(),
                                               kSegmentBytes, nullptr, perm);
    MEMPLAN_RETURN_IF_ERROR(CheckSegmentOwner(segment_name));
    impl->state = impl->segment.find_or_construct<SharedState>(kStateName)(options.budget_bytes);
  } catch (const bip::interprocess_exception& e) {
    return Status::IoError("node budget '" + segment_name + "': " + e.what());
  }
  if (impl->state->budget_bytes != options.budget_bytes) {
    return Status::FailedPrecondition(
        "node budget '" + segment_name + "' exists with budget_bytes " +
        std::to_string(impl->state->budget_bytes) + ", not " +
        std::to_string(options.budget_bytes) + "; every rank must pass the same");
  }
  return std::shared_ptr<NodeBudget>(new NodeBudget(segment_name, std::move(impl)));
}

NodeBudget::NodeBudget(std::string name, std::unique_ptr<Impl> impl)
    : name_(std::move(name)), impl_(std::move(impl)) {}

NodeBudget::~NodeBudget() = default;

Result<NodeReservation> NodeBudget::Reserve(uint64_t bytes) {
  if (bytes == 0) return Status::InvalidArgument("node budget: reserve 0 bytes");
  SharedState& s = *impl_->state;
  SharedLock lock(s);
  MEMPLAN_RETURN_IF_ERROR(lock.status(name_));
  uint64_t used = 0;
  Entry* slot = nullptr;
  for (Entry& e : s.entries) {
    if (e.pid != 0 && Dead(e)) e.pid = 0;  // reclaim a dead process's share
    if (e.pid == 0) {
      if (slot == nullptr) slot = &e;
    } else {
      used += e.bytes;
    }
  }
  if (bytes > s.budget_bytes || used > s.budget_bytes - bytes) {
    return Status::ResourceExhausted("node budget '" + name_ + "': budget " +
                                     std::to_string(s.budget_bytes) + " bytes, used " +
                                     std::to_string(used) + ", requested " + std::to_string(bytes));
  }
  if (slot == nullptr) {
    return Status::ResourceExhausted("node budget '" + name_ + "': more than " +
                                     std::to_string(kMaxEntries) + " live reservations");
  }
  // Claim the entry with its pid last, so a holder killed half-way leaves a free entry.
  slot->start_time = impl_->start_time;
  slot->id = s.next_id++;
  slot->bytes = bytes;
  std::atomic_signal_fence(std::memory_order_seq_cst);  // the compiler must not store pid first
  slot->pid = static_cast<int>(::getpid());
  NodeReservation r;
  r.budget_ = shared_from_this();
  r.id_ = slot->id;
  r.bytes_ = bytes;
  r.pid_ = slot->pid;
  return r;
}

Result<NodeBudgetUsage> NodeBudget::Usage() {
  SharedState& s = *impl_->state;
  SharedLock lock(s);
  MEMPLAN_RETURN_IF_ERROR(lock.status(name_));
  NodeBudgetUsage u;
  u.budget_bytes = s.budget_bytes;
  u.recovered_locks = s.recovered_locks;
  for (const Entry& e : s.entries) {
    if (e.pid == 0 || Dead(e)) continue;
    u.used_bytes += e.bytes;
    ++u.reservations;
  }
  return u;
}

void NodeBudget::Release(uint64_t id) {
  SharedState& s = *impl_->state;
  SharedLock lock(s);
  if (!lock.status(name_).ok()) return;  // the entry is reclaimed once this process is gone
  for (Entry& e : s.entries) {
    if (e.pid != 0 && e.id == id) e.pid = 0;
  }
}

void NodeBudget::DebugWithLockHeld(const std::function<void()>& fn) {
  SharedLock lock(*impl_->state);
  fn();
}

NodeReservation::NodeReservation(NodeReservation&& other) noexcept
    : budget_(std::move(other.budget_)),
      id_(other.id_),
      bytes_(std::exchange(other.bytes_, 0)),
      pid_(other.pid_) {}

NodeReservation& NodeReservation::operator=(NodeReservation&& other) noexcept {
  if (this != &other) {
    Release();
    budget_ = std::move(other.budget_);
    id_ = other.id_;
    bytes_ = std::exchange(other.bytes_, 0);
    pid_ = other.pid_;
  }
  return *this;
}

void NodeReservation::Release() {
  if (!budget_) return;
  // A forked child inherits the object but not the share; only the owner gives it back.
  if (pid_ == static_cast<int>(::getpid())) budget_->Release(id_);
  budget_.reset();
  bytes_ = 0;
}

}  // namespace memplan::offload
