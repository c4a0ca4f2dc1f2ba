#include "offload/node_budget.h"

#include <signal.h>
#include <unistd.h>

#include <boost/interprocess/exceptions.hpp>
#include <boost/interprocess/managed_shared_memory.hpp>
#include <boost/interprocess/permissions.hpp>
#include <boost/interprocess/shared_memory_object.hpp>
#include <boost/interprocess/sync/interprocess_mutex.hpp>
#include <boost/interprocess/sync/scoped_lock.hpp>
#include <boost/date_time/posix_time/posix_time_types.hpp>
#include <cerrno>
#include <utility>

namespace memplan::offload {
namespace bip = boost::interprocess;
namespace {

constexpr int kMaxEntries = 1024;
constexpr uint64_t kSegmentBytes = 64 * 1024;

struct Entry {
  int pid = 0;  // 0: free
  uint64_t id = 0;
  uint64_t bytes = 0;
};

// Lives in the segment; constructed once by find_or_construct, which Boost makes atomic across
// processes.
struct SharedState {
  explicit SharedState(uint64_t budget) : budget_bytes(budget) {}
  bip::interprocess_mutex mu;
  uint64_t budget_bytes;
  uint64_t next_id = 1;
  Entry entries[kMaxEntries];
};

bool Dead(int pid) { return ::kill(pid, 0) != 0 && errno == ESRCH; }

}  // namespace

struct NodeBudget::Impl {
  bip::managed_shared_memory segment;
  SharedState* state = nullptr;
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

Result<std::shared_ptr<NodeBudget>> NodeBudget::Open(const NodeBudgetOptions& options) {
  MEMPLAN_RETURN_IF_ERROR(options.Validate());
  const std::string segment_name = SegmentName(options.name);
  auto impl = std::make_unique<Impl>();
  // Boost.Interprocess reports errors by exception; this is the module boundary that converts.
  try {
    bip::permissions perm(0600);  // per user: other users must not read or change our budget
    impl->segment = bip::managed_shared_memory(bip::open_or_create, segment_name.c_str(),
                                               kSegmentBytes, nullptr, perm);
    impl->state = impl->segment.find_or_construct<SharedState>("state")(options.budget_bytes);
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
  bip::scoped_lock<bip::interprocess_mutex> lock(s.mu);
  uint64_t used = 0;
  Entry* slot = nullptr;
  for (Entry& e : s.entries) {
    if (e.pid != 0 && Dead(e.pid)) e = Entry{};  // reclaim a dead process's share
    if (e.pid == 0) {
      if (slot == nullptr) slot = &e;
    } else {
      used += e.bytes;
    }
  }
  if (bytes > s.budget_bytes || used > s.budget_bytes - bytes) {
    return Status::ResourceExhausted("node budget '" + name_ + "': budget " +
                                     std::to_string(s.budget_bytes) + " bytes, used " +
                                     std::to_string(used) + ", requested " +
                                     std::to_string(bytes));
  }
  if (slot == nullptr) {
    return Status::ResourceExhausted("node budget '" + name_ + "': more than " +
                                     std::to_string(kMaxEntries) + " live reservations");
  }
  *slot = Entry{static_cast<int>(::getpid()), s.next_id++, bytes};
  NodeReservation r;
  r.budget_ = shared_from_this();
  r.id_ = slot->id;
  r.bytes_ = bytes;
  r.pid_ = slot->pid;
  return r;
}

Result<NodeBudgetUsage> NodeBudget::Usage() {
  SharedState& s = *impl_->state;
  bip::scoped_lock<bip::interprocess_mutex> lock(s.mu);
  NodeBudgetUsage u;
  u.budget_bytes = s.budget_bytes;
  for (const Entry& e : s.entries) {
    if (e.pid == 0 || Dead(e.pid)) continue;
    u.used_bytes += e.bytes;
    ++u.reservations;
  }
  return u;
}

void NodeBudget::Release(uint64_t id) {
  SharedState& s = *impl_->state;
  bip::scoped_lock<bip::interprocess_mutex> lock(s.mu);
  for (Entry& e : s.entries) {
    if (e.pid != 0 && e.id == id) e = Entry{};
  }
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
