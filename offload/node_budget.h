// NodeBudget: one pinned-memory budget shared by every process (rank) of a user on one machine.
//
// Each rank sizes its own PinnedPool, but the ranks share the machine's RAM; together they can lock
// more than it has and get OOM-killed. The budget lives in a small POSIX shared-memory segment
// ("/dev/shm/memplan-<uid>-<name>", mode 0600) holding the node budget and one entry per live
// reservation with its owner's pid and start time. Reserve() grants bytes only while the sum of
// live reservations stays within the budget; entries of processes that are gone are reclaimed by
// the next Reserve(): no such pid, a zombie not yet reaped, or a pid reused by a newer process (its
// start time in /proc differs).
//
// Thread safety: Reserve, Usage and NodeReservation's destructor may be called from any thread;
// the segment's mutex orders them across threads and processes. It is a robust process-shared
// mutex: a process killed while holding it does not block the others (the next locker takes it
// over; NodeBudgetUsage::recovered_locks counts it). Every process must see the same pid namespace
// (one container, or the host).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "common/status.h"

namespace memplan::offload {

struct NodeBudgetOptions {
  // Names the budget ([A-Za-z0-9_.-], 1 to 64 chars); the segment is memplan-<uid>-<name>.
  std::string name;
  // The node-wide cap in bytes (> 0). Every process opening an existing budget must pass the same.
  uint64_t budget_bytes = 0;

  Status Validate() const;
};

struct NodeBudgetUsage {
  uint64_t budget_bytes = 0;
  uint64_t used_bytes = 0;  // sum of live reservations
  uint64_t reservations = 0;
  uint64_t recovered_locks = 0;  // times a lock held by a dead process was taken over
};

class NodeBudget;

// Bytes granted by a NodeBudget, returned when destroyed (only by the process that reserved them;
// a forked child's copy returns nothing). Move-only.
class NodeReservation {
 public:
  NodeReservation() = default;
  NodeReservation(NodeReservation&& other) noexcept;
  NodeReservation& operator=(NodeReservation&& other) noexcept;
  NodeReservation(const NodeReservation&) = delete;
  NodeReservation& operator=(const NodeReservation&) = delete;
  ~NodeReservation() { Release(); }

  uint64_t bytes() const { return bytes_; }
  void Release();

 private:
  friend class NodeBudget;
  std::shared_ptr<NodeBudget> budget_;
  uint64_t id_ = 0;
  uint64_t bytes_ = 0;
  int pid_ = 0;
};

class NodeBudget : public std::enable_shared_from_this<NodeBudget> {
 public:
  // Opens the budget, creating its segment (mode 0600) when absent. FailedPrecondition when an
  // existing segment has another budget_bytes, or is not this user's with mode 0600 (another user
  // created it first); IoError when shared memory cannot be opened.
  static Result<std::shared_ptr<NodeBudget>> Open(const NodeBudgetOptions& options);
  // "memplan-<uid>-<name>", the name under /dev/shm.
  static std::string SegmentName(std::string_view name);
  // Removes the segment; processes that have it open keep using it. OK if it does not exist.
  static Status Remove(std::string_view name);

  ~NodeBudget();

  // Grants `bytes` (> 0) to this process, or ResourceExhausted naming the budget, the bytes in use
  // and the bytes requested. Reclaims dead processes' reservations first.
  Result<NodeReservation> Reserve(uint64_t bytes);
  Result<NodeBudgetUsage> Usage();
  const std::string& name() const { return name_; }

  // FOR TESTS ONLY: runs fn while holding the budget's mutex (fn may kill the process, to test
  // that the others recover). Not part of the supported API.
  void DebugWithLockHeld(const std::function<void()>& fn);

 private:
  struct Impl;
  friend class NodeReservation;
  NodeBudget(std::string name, std::unique_ptr<Impl> impl);
  void Release(uint64_t id);

  std::string name_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace memplan::offload
