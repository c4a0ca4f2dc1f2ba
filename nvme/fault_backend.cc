#include "nvme/fault_backend.h"

#include <algorithm>
#include <atomic>
#include <random>
#include <string>
#include <vector>

#include "common/mutex.h"

namespace memplan::nvme {
namespace {

// Bits of FaultSlot::counted: which trigger counts a request advanced, so a request the inner
// backend did not take can be un-counted and the Nth-request triggers stay exact.
enum : uint8_t { kCountedFail = 1, kCountedShort = 2, kCountedFlip = 4 };

// The private copy of one in-flight request. A slot belongs to the submitter from the moment it
// leaves the free list until the inner Submit returns, then to whichever thread reaps it; the
// inner backend's own synchronisation orders the hand-over, so the fields need no lock.
struct FaultSlot {
  Request shadow;               // what the inner backend sees; user_data = this slot's index
  Request* original = nullptr;  // what the caller submitted, returned in the completion
  bool fail = false;
  int error = 0;
  bool shortened = false;
  bool flip_read = false;
  uint64_t flip_bit = 0;       // read flips: FaultPlan::flip_bit when submitted
  bool write_flipped = false;  // a bit of the caller's buffer is inverted until completion
  size_t flip_byte = 0;        // write flips: where the inverted bit is
  uint8_t flip_mask = 0;
  uint8_t counted = 0;  // kCounted* bits
};

void FlipBit(void* buffer, size_t byte, uint8_t mask) {
  static_cast<unsigned char*>(buffer)[byte] ^= mask;
}

Status ValidateTrigger(const FaultTrigger& t, const char* name) {
  // Written so that NaN fails too.
  if (!(t.probability >= 0.0 && t.probability <= 1.0)) {
    return Status::InvalidArgument(std::string("fault plan: ") + name +
                                   ".probability must be in [0, 1], got " +
                                   std::to_string(t.probability));
  }
  return Status::Ok();
}

}  // namespace

Status FaultPlan::Validate() const {
  MEMPLAN_RETURN_IF_ERROR(ValidateTrigger(fail, "fail"));
  MEMPLAN_RETURN_IF_ERROR(ValidateTrigger(shorten, "shorten"));
  MEMPLAN_RETURN_IF_ERROR(ValidateTrigger(flip, "flip"));
  MEMPLAN_RETURN_IF_ERROR(ValidateTrigger(submit_fail, "submit_fail"));
  if (error <= 0) {
    return Status::InvalidArgument("fault plan: error must be a positive errno, got " +
                                   std::to_string(error));
  }
  return Status::Ok();
}

struct FaultBackend::Impl {
  Impl(std::unique_ptr<Backend> inner_backend, const FaultPlan& p)
      : inner(std::move(inner_backend)),
        capabilities(inner->capabilities()),
        plan(p),
        rng(p.seed),
        slots(std::max<uint32_t>(1, inner->capabilities().queue_depth)) {
    capabilities.name = "fault(" + inner->capabilities().name + ")";
    forward.reserve(slots.size());
    free_slots.reserve(slots.size());
    for (size_t i = slots.size(); i > 0; --i) free_slots.push_back(static_cast<uint32_t>(i - 1));
  }
  // The inner backend goes first: a thread-pool backend may still be finishing requests that
  // point at our slots while it shuts down.
  ~Impl() { inner.reset(); }

  // Advances `count` when `r` matches the trigger and says whether `r` is hit.
  bool Hit(const FaultTrigger& t, uint64_t& count, const Request& r, uint8_t bit, FaultSlot* slot)
      REQUIRES(plan_mu) {
    if (!t.armed() || (t.op.has_value() && *t.op != r.op)) return false;
    ++count;
    if (slot != nullptr) slot->counted |= bit;
    bool hit = t.nth != 0 && count >= t.nth && (t.times == 0 || count - t.nth < t.times);
    // Always draw when a probability is set, so the random sequence does not depend on `nth`.
    if (t.probability > 0.0) {
      double u = static_cast<double>(rng() >> 11) * 0x1.0p-53;  // portable, unlike <random>'s
      hit = hit || u < t.probability;
    }
    return hit;
  }

  void Uncount(const FaultSlot& s) REQUIRES(plan_mu) {
    if (s.counted & kCountedFail) --fail_count;
    if (s.counted & kCountedShort) --short_count;
    if (s.counted & kCountedFlip) --flip_count;
  }

  std::unique_ptr<Backend> inner;
  Capabilities capabilities;

  // Held across the inner Submit so decisions, counts and forwarding happen in one order (the
  // contract lets backends serialise submission anyway).
  mutable Mutex plan_mu;
  FaultPlan plan GUARDED_BY(plan_mu);
  uint64_t fail_count GUARDED_BY(plan_mu) = 0;
  uint64_t short_count GUARDED_BY(plan_mu) = 0;
  uint64_t flip_count GUARDED_BY(plan_mu) = 0;
  uint64_t submit_count GUARDED_BY(plan_mu) = 0;
  std::mt19937_64 rng GUARDED_BY(plan_mu);
  std::vector<Request*> forward GUARDED_BY(plan_mu);  // scratch for the inner Submit

  // One slot per inner queue entry: a free slot means the inner backend has room, so the inner
  // Submit takes everything offered unless something else shares the inner backend.
  std::vector<FaultSlot> slots;  // fixed size; see FaultSlot for who owns an entry
  mutable Mutex slots_mu ACQUIRED_AFTER(plan_mu);
  std::vector<uint32_t> free_slots GUARDED_BY(slots_mu);

  std::atomic<uint64_t> requests{0}, errors{0}, short_transfers{0}, read_flips{0}, write_flips{0},
      submit_failures{0};
};

FaultBackend::FaultBackend(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
FaultBackend::~FaultBackend() = default;

Result<std::unique_ptr<FaultBackend>> FaultBackend::Create(std::unique_ptr<Backend> inner,
                                                           const FaultPlan& plan) {
  if (inner == nullptr) return Status::InvalidArgument("fault backend: no inner backend");
  MEMPLAN_RETURN_IF_ERROR(plan.Validate());
  return std::unique_ptr<FaultBackend>(
      new FaultBackend(std::make_unique<Impl>(std::move(inner), plan)));
}

Status FaultBackend::SetPlan(const FaultPlan& plan) {
  MEMPLAN_RETURN_IF_ERROR(plan.Validate());
  MutexLock lock(&impl_->plan_mu);
  impl_->plan = plan;
  impl_->fail_count = impl_->short_count = impl_->flip_count = impl_->submit_count = 0;
  impl_->rng.seed(plan.seed);
  return Status::Ok();
}

FaultPlan FaultBackend::plan() const {
  MutexLock lock(&impl_->plan_mu);
  return impl_->plan;
}

FaultCounters FaultBackend::counters() const {
  FaultCounters c;
  c.requests = impl_->requests.load(std::memory_order_relaxed);
  c.errors = impl_->errors.load(std::memory_order_relaxed);
  c.short_transfers = impl_->short_transfers.load(std::memory_order_relaxed);
  c.read_flips = impl_->read_flips.load(std::memory_order_relaxed);
  c.write_flips = impl_->write_flips.load(std::memory_order_relaxed);
  c.submit_failures = impl_->submit_failures.load(std::memory_order_relaxed);
  return c;
}

Backend* FaultBackend::inner() const { return impl_->inner.get(); }

const Capabilities& FaultBackend::capabilities() const { return impl_->capabilities; }

Result<int> FaultBackend::RegisterFile(int fd) { return impl_->inner->RegisterFile(fd); }

Status FaultBackend::UnregisterFile(int file) { return impl_->inner->UnregisterFile(file); }

Status FaultBackend::RegisterBuffers(std::span<const iovec> buffers) {
  return impl_->inner->RegisterBuffers(buffers);
}

Result<size_t> FaultBackend::Submit(std::span<Request* const> requests) {
  Impl& m = *impl_;
  if (requests.empty()) return size_t{0};
  for (const Request* r : requests) {
    if (r == nullptr) return Status::InvalidArgument("fault backend: null request submitted");
  }
  MutexLock plan_lock(&m.plan_mu);
  if (m.Hit(m.plan.submit_fail, m.submit_count, *requests[0], 0, nullptr)) {
    m.submit_failures.fetch_add(1, std::memory_order_relaxed);
    return Status::IoError("fault injection: " + m.capabilities.name + " submit failed");
  }

  m.forward.clear();
  {
    MutexLock slots_lock(&m.slots_mu);
    size_t n = std::min(requests.size(), m.free_slots.size());
    for (size_t i = 0; i < n; ++i) {
      uint32_t index = m.free_slots.back();
      m.free_slots.pop_back();
      m.forward.push_back(&m.slots[index].shadow);
      m.slots[index].shadow.user_data = index;
    }
  }

  for (size_t i = 0; i < m.forward.size(); ++i) {
    FaultSlot& s = m.slots[m.forward[i]->user_data];
    uint64_t index = s.shadow.user_data;
    s = FaultSlot{};
    s.original = requests[i];
    s.shadow = *requests[i];
    s.shadow.user_data = index;
    const Request& r = s.shadow;
    s.fail = m.Hit(m.plan.fail, m.fail_count, r, kCountedFail, &s);
    s.error = m.plan.error;
    if (m.Hit(m.plan.shorten, m.short_count, r, kCountedShort, &s) && r.op != OpType::kFsync &&
        r.length > m.plan.short_keep_bytes) {
      s.shortened = true;
      s.shadow.length = m.plan.short_keep_bytes;
    }
    if (m.Hit(m.plan.flip, m.flip_count, r, kCountedFlip, &s) && s.shadow.length > 0) {
      if (r.op == OpType::kRead) {
        s.flip_read = true;
        s.flip_bit = m.plan.flip_bit;
      } else if (r.op == OpType::kWrite) {
        uint64_t bit = m.plan.flip_bit % (uint64_t{s.shadow.length} * 8);
        s.flip_byte = bit / 8;
        s.flip_mask = static_cast<uint8_t>(1u << (bit % 8));
        FlipBit(s.shadow.buffer, s.flip_byte, s.flip_mask);
        s.write_flipped = true;
      }
    }
  }

  Result<size_t> taken = m.inner->Submit(m.forward);
  size_t k = taken.ok() ? std::min(*taken, m.forward.size()) : 0;
  // Whatever the inner backend did not take was never submitted: undo its write flip and counts.
  MutexLock slots_lock(&m.slots_mu);
  for (size_t i = k; i < m.forward.size(); ++i) {
    FaultSlot& s = m.slots[m.forward[i]->user_data];
    if (s.write_flipped) FlipBit(s.shadow.buffer, s.flip_byte, s.flip_mask);
    m.Uncount(s);
    m.free_slots.push_back(static_cast<uint32_t>(s.shadow.user_data));
  }
  if (!taken.ok()) return taken.status();
  m.requests.fetch_add(k, std::memory_order_relaxed);
  return k;
}

Result<size_t> FaultBackend::Reap(std::span<Completion> out, size_t min_complete) {
  Impl& m = *impl_;
  MEMPLAN_ASSIGN_OR_RETURN(size_t n, m.inner->Reap(out, min_complete));
  MutexLock slots_lock(&m.slots_mu);
  for (size_t i = 0; i < n; ++i) {
    Completion& c = out[i];
    uint64_t index = c.request != nullptr ? c.request->user_data : m.slots.size();
    if (index >= m.slots.size() || c.request != &m.slots[index].shadow) {
      return Status::Internal("fault backend: inner backend " + m.inner->capabilities().name +
                              " returned a request it was not given");
    }
    FaultSlot& s = m.slots[index];
    if (s.write_flipped) {
      FlipBit(s.shadow.buffer, s.flip_byte, s.flip_mask);
      m.write_flips.fetch_add(1, std::memory_order_relaxed);
    }
    if (s.fail) {
      c.result = -s.error;
      m.errors.fetch_add(1, std::memory_order_relaxed);
    } else if (c.result >= 0) {
      if (s.shortened) m.short_transfers.fetch_add(1, std::memory_order_relaxed);
      if (s.flip_read && c.result > 0) {
        uint64_t bit = s.flip_bit % (static_cast<uint64_t>(c.result) * 8);
        FlipBit(s.shadow.buffer, bit / 8, static_cast<uint8_t>(1u << (bit % 8)));
        m.read_flips.fetch_add(1, std::memory_order_relaxed);
      }
    }
    c.request = s.original;
    m.free_slots.push_back(static_cast<uint32_t>(index));
  }
  return n;
}

// Counted by our slots rather than asked of the inner backend: a request the inner backend has
// completed is still in flight here until our Reap() hands it back.
size_t FaultBackend::in_flight() const {
  MutexLock lock(&impl_->slots_mu);
  return impl_->slots.size() - impl_->free_slots.size();
}

}  // namespace memplan::nvme
