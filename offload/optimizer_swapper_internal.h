// OptimizerSwapper's internals, shared by optimizer_swapper.cc (the store: creating, opening and
// recovering it, gradients, reads, loads) and optimizer_swapper_step.cc (the step's pipeline): the
// slot format, the buffer layout, OptimizerSwapper::Impl and the begun step's StepRun. Internal to
// offload/ (not installed); nothing else includes it.
#pragma once

#include <atomic>
#include <chrono>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/clock.h"
#include "common/mutex.h"
#include "offload/optimizer_swapper.h"

namespace memplan::offload {

constexpr uint64_t kHeaderBytes = 4096;
constexpr uint64_t kElementAlign =
    1024;  // sub-group sizes are multiples: arrays stay 4 KiB-aligned
constexpr char kSlotMagic[8] = {'M', 'P', 'S', 'W', 'S', 'L', 'O', 'T'};
constexpr uint32_t kSlotVersion = 1;
constexpr const char* kMetaKey = "swapper.meta";
// The step last begun, committed before its first write (Note [Two slots per sub-group]).
constexpr const char* kBegunKey = "swapper.begun";
// The step last committed, written by FinishStep() just before its sync: Open() takes no newer
// step, even one every sub-group holds whole. An abandoned step (AbortStep, or a Close() with a
// step begun) may have written every sub-group's other slot in place (its keys exist from two
// steps before), and must still not be resumed from (Note [Two slots per sub-group]).
constexpr const char* kCommittedKey = "swapper.committed";
// OptimizerSwapperOptions::identity, written by Create() before its commit.
constexpr const char* kIdentityKey = "swapper.identity";
constexpr uint64_t kMaxIdentityBytes = uint64_t{64} << 20;
constexpr const char* kMetaFormat = "memplan-optimizer-swapper";
// Version 1: two state slots per sub-group. Version 2 adds "state_slots" (1): a memplan that
// reads version 1 only refuses such a store rather than misreading its one slot as a torn step.
constexpr int kMetaVersion = 1;
constexpr int kMetaVersionSlots = 2;

// The first bytes of every state value. Fixed-width fields, little-endian as the host (a store
// is not meant to move between machines of different byte order).
struct SlotHeader {
  char magic[8];
  uint32_t version;
  uint32_t state_count;
  uint64_t store_id;
  uint64_t epoch;
  uint64_t sub_group;
  uint64_t first_element;
  uint64_t elements;
};
static_assert(sizeof(SlotHeader) <= kHeaderBytes);

inline uint64_t RoundUp(uint64_t value, uint64_t to) { return (value + to - 1) / to * to; }

inline std::string StateKey(uint64_t sub_group, uint64_t slot) {
  return "state." + std::to_string(sub_group) + "." + std::to_string(slot);
}
inline std::string GradKey(uint64_t sub_group) { return "grad." + std::to_string(sub_group); }

// A closable queue of buffer indices for one pipeline edge. Abort() wakes every waiter; after it
// Pop() returns nothing.
class IndexQueue {
 public:
  void Push(size_t value) {
    {
      MutexLock lock(&mu_);
      items_.push_back(value);
    }
    cv_.Signal();
  }
  std::optional<size_t> Pop() {
    MutexLock lock(&mu_);
    while (!aborted_ && items_.empty()) cv_.Wait(&mu_);
    if (aborted_) return std::nullopt;
    size_t value = items_.front();
    items_.pop_front();
    return value;
  }
  // Pop() without waiting: nothing when empty; `aborted` set when the queue was aborted.
  std::optional<size_t> TryPop(bool* aborted) {
    MutexLock lock(&mu_);
    *aborted = aborted_;
    if (aborted_ || items_.empty()) return std::nullopt;
    size_t value = items_.front();
    items_.pop_front();
    return value;
  }
  void Abort() {
    {
      MutexLock lock(&mu_);
      aborted_ = true;
    }
    cv_.SignalAll();
  }

 private:
  Mutex mu_;
  CondVar cv_;
  std::deque<size_t> items_ GUARDED_BY(mu_);
  bool aborted_ GUARDED_BY(mu_) = false;
};

// The reader's one queue: sub-groups handed over and buffers freed, as tagged values (a freed
// buffer b is kFreed + b), so that it waits for either (Note [Reading states ahead]).
constexpr size_t kFreed = size_t{1} << 62;

// The first error of a step, shared by its stages.
class FirstError {
 public:
  void Set(Status status) {
    MutexLock lock(&mu_);
    if (status_.ok()) status_ = std::move(status);
  }
  Status Get() const {
    MutexLock lock(&mu_);
    return status_;
  }

 private:
  mutable Mutex mu_;
  Status status_ GUARDED_BY(mu_);
};

// Layout of one pinned buffer; every region starts on a 4 KiB boundary:
//   [header][params][state 0]..[state S-1] | [grads] | [half params]
// The first part, header through the last state, is exactly one state value in the store. The
// grads region holds 4 bytes an element, or 2 with a 16-bit grad_dtype.
struct BufferLayout {
  static uint64_t GradBytes(HalfDtype grad_dtype) { return grad_dtype == HalfDtype::kNone ? 4 : 2; }
  static uint64_t GradOffset(int states, uint64_t cap) {
    return RoundUp(kHeaderBytes + (1 + states) * 4 * cap, 4096);
  }
  static uint64_t HalfOffset(int states, uint64_t cap, HalfDtype grad_dtype) {
    return GradOffset(states, cap) + RoundUp(GradBytes(grad_dtype) * cap, 4096);
  }
  static uint64_t Bytes(int states, uint64_t cap, bool half, HalfDtype grad_dtype) {
    return HalfOffset(states, cap, grad_dtype) + (half ? RoundUp(2 * cap, 4096) : 0);
  }
};

struct OptimizerSwapper::Impl {
  OptimizerSwapperOptions options;
  int states = 0;
  uint64_t store_id = 0;
  std::unique_ptr<nvme::SwapStore> store;
  std::unique_ptr<PinnedPool> own_pool;
  PinnedPool* pool = nullptr;
  std::vector<PinnedSlot> buffers;
  std::unique_ptr<CpuOptimizer> cpu;
  std::vector<bool> grads_written;
  OptimizerSwapperStats stats;
  bool closed = false;
  uint32_t slots = 2;  // state slots per sub-group (options', or the store's)
  // One slot: the step that failed or was abandoned after rewriting a sub-group in place (Note
  // [One slot per sub-group]); 0 when none.
  uint64_t torn_step = 0;
  std::unique_ptr<StepRun> run;      // the begun step, if any
  std::vector<uint64_t> last_order;  // the hand-over order of the last overlapped step
  bool serial = false;               // Step() is beginning its step

  // The slot that holds (or receives) epoch E's states.
  uint64_t SlotOf(uint64_t epoch) const { return slots == 1 ? 0 : epoch % 2; }

  // The refusal of a torn one-slot store (Note [One slot per sub-group]); `what` is refused.
  Status TornError(const std::string& what) const {
    return Status::DataLoss(
        what + ": step " + std::to_string(torn_step) +
        " stopped after rewriting sub-groups in place, and the optimizer store keeps one state "
        "slot per sub-group (state_slots 1), so it now holds a mix of steps " +
        std::to_string(torn_step - 1) + " and " + std::to_string(torn_step) +
        " that cannot be resumed; restart training from a checkpoint");
  }

  // Views into buffer b holding a sub-group of n elements.
  std::byte* Base(size_t b) const { return buffers[b].data().data(); }
  std::span<float> Array(size_t b, int index, uint64_t n) const {  // 0 params, 1.. states
    auto* p = reinterpret_cast<float*>(Base(b) + kHeaderBytes) + static_cast<uint64_t>(index) * n;
    return {p, static_cast<size_t>(n)};
  }
  // The gradients region, as bytes: 4 or 2 an element (grad_dtype).
  std::span<std::byte> GradBytes(size_t b, uint64_t n) const {
    return {Base(b) + BufferLayout::GradOffset(states, options.sub_group_elements),
            static_cast<size_t>(n * BufferLayout::GradBytes(options.grad_dtype))};
  }
  std::span<float> Grads(size_t b, uint64_t n) const {
    if (options.grad_dtype != HalfDtype::kNone) return {};
    return {reinterpret_cast<float*>(GradBytes(b, n).data()), static_cast<size_t>(n)};
  }
  std::span<const uint16_t> HalfGrads(size_t b, uint64_t n) const {
    if (options.grad_dtype == HalfDtype::kNone) return {};
    return {reinterpret_cast<const uint16_t*>(GradBytes(b, n).data()), static_cast<size_t>(n)};
  }
  std::span<uint16_t> Half(size_t b, uint64_t n) const {
    if (options.half_dtype == HalfDtype::kNone) return {};
    auto* p = reinterpret_cast<uint16_t*>(
        Base(b) + BufferLayout::HalfOffset(states, options.sub_group_elements, options.grad_dtype));
    return {p, static_cast<size_t>(n)};
  }
  std::span<std::byte> Value(size_t b, uint64_t n) const {
    return {Base(b), static_cast<size_t>(kHeaderBytes + (1 + states) * 4 * n)};
  }

  SlotHeader MakeHeader(uint64_t epoch, uint64_t sub_group, uint64_t first, uint64_t n) const {
    SlotHeader h{};
    std::memcpy(h.magic, kSlotMagic, sizeof(h.magic));
    h.version = kSlotVersion;
    h.state_count = static_cast<uint32_t>(states);
    h.store_id = store_id;
    h.epoch = epoch;
    h.sub_group = sub_group;
    h.first_element = first;
    h.elements = n;
    return h;
  }

  // Checks a header read from slot `slot` of `sub_group`; returns its epoch.
  Result<uint64_t> CheckHeader(const SlotHeader& h, uint64_t sub_group, uint64_t slot,
                               uint64_t first, uint64_t n) const {
    const std::string where = "state slot " + StateKey(sub_group, slot);
    if (std::memcmp(h.magic, kSlotMagic, sizeof(h.magic)) != 0 || h.version != kSlotVersion) {
      return Status::DataLoss(where + ": not a memplan optimizer-swapper slot");
    }
    if (h.store_id != store_id || h.sub_group != sub_group || h.first_element != first ||
        h.elements != n || h.state_count != static_cast<uint32_t>(states)) {
      return Status::DataLoss(where + ": header belongs to another store or sub-group");
    }
    if (h.epoch % 2 != slot && slots == 2) {
      return Status::DataLoss(where + ": holds epoch " + std::to_string(h.epoch) +
                              ", which belongs in the other slot");
    }
    return h.epoch;
  }

  Status SetUpBuffers() {
    const uint64_t need =
        BufferLayout::Bytes(states, options.sub_group_elements,
                            options.half_dtype != HalfDtype::kNone, options.grad_dtype);
    if (options.pool != nullptr) {
      pool = options.pool;
      if (pool->slot_bytes() < need) {
        return Status::InvalidArgument(
            "the pinned pool's slots hold " + std::to_string(pool->slot_bytes()) +
            " bytes; the swapper needs " + std::to_string(need) +
            " per buffer (sub_group_elements " + std::to_string(options.sub_group_elements) + ")");
      }
    } else {
      PinnedPoolOptions po;
      po.slot_bytes = need;
      po.slot_count = options.buffer_count;
      po.budget_bytes = RoundUp(need, 4096) * options.buffer_count;
      po.lock_memory = options.lock_memory;
      po.wait = false;
      po.node_budget_name = options.node_budget_name;
      po.node_budget_bytes = options.node_budget_bytes;
      MEMPLAN_ASSIGN_OR_RETURN(own_pool, PinnedPool::Create(po, options.runtime));
      pool = own_pool.get();
    }
    for (uint32_t i = 0; i < options.buffer_count; ++i) {
      MEMPLAN_ASSIGN_OR_RETURN(PinnedSlot slot, pool->Acquire());
      buffers.push_back(std::move(slot));
    }
    if (options.register_buffers) {
      // Every transfer of a step goes to or from these buffers: io_uring then skips pinning
      // their pages per request. Refused (RLIMIT_MEMLOCK) is only slower; the store says so.
      const std::span<std::byte> memory = pool->memory();
      (void)store->RegisterBuffers(nvme::RegistrationRegions(memory.data(), memory.size()));
    }
    MEMPLAN_ASSIGN_OR_RETURN(cpu, CpuOptimizer::Create(options.cpu));
    return Status::Ok();
  }

  // Open()'s steps (optimizer_swapper.cc).
  Status ReadMeta(const std::string& where, uint64_t& num_elements, uint64_t& sub_group_elements);
  Result<RecoveryReport> Recover(const std::string& where, uint64_t num_elements,
                                 uint64_t sub_group_elements);

  std::string MetaJson(uint64_t num_elements) const {
    nlohmann::json meta = {{"format", kMetaFormat},
                           {"version", slots == 2 ? kMetaVersion : kMetaVersionSlots},
                           {"store_id", store_id},
                           {"num_elements", num_elements},
                           {"sub_group_elements", options.sub_group_elements},
                           {"optimizer", std::string(SwapOptimizerName(options.optimizer))}};
    if (slots != 2) meta["state_slots"] = slots;
    return meta.dump();
  }
  // One slot: a step (or load) `to` ended uncommitted. `wrote`: it rewrote a sub-group, and the
  // store is torn; otherwise its begun marker is put back to the committed step, so that the
  // store reopens as it was (Note [One slot per sub-group]).
  void EndUncommitted(uint64_t to, bool wrote);
  // One slot: Open()'s recovery (Note [One slot per sub-group]).
  Result<RecoveryReport> RecoverOneSlot(const std::string& where, uint64_t num_elements,
                                        uint64_t sub_group_elements);

  // `in_memory`: fp32 gradients handed over (StepSubGroup); empty: those read into buffer b.
  // `group_options`: per parameter group; unsegmented, the sub-group takes the first.
  Status RunKernel(std::span<const SwapStepOptions> group_options, int64_t step, size_t b,
                   uint64_t n, const std::vector<StepSegment>& segments,
                   std::span<const float> in_memory) {
    std::span<float> params = Array(b, 0, n);
    std::span<float> state_arrays(params.data() + n, static_cast<size_t>(states) * n);
    const std::span<const float> grads = in_memory.empty() ? Grads(b, n) : in_memory;
    if (!segments.empty()) {
      if (options.grad_dtype != HalfDtype::kNone) {
        return Status::InvalidArgument(
            "skipped parameters and parameter groups need fp32 gradients in the swapper");
      }
      return RunSegmentedSwapOptimizerStep(*cpu, options.optimizer, group_options, segments, params,
                                           grads, state_arrays, Half(b, n), options.half_dtype);
    }
    return RunSwapOptimizerStep(*cpu, options.optimizer, group_options[0], step, params, grads,
                                state_arrays, Half(b, n), options.half_dtype, HalfGrads(b, n),
                                options.grad_dtype);
  }
};

// One begun step: its pipeline (Note [The pipeline]) and what each sub-group was handed over with.
struct OptimizerSwapper::StepRun {
  // Set by StepSubGroup() under mu before the sub-group is queued; afterwards only `claimed`
  // changes, under mu: whoever claims a job calls its `done` (the compute thread once the kernel
  // has read the gradients, or Abort() for a job the compute thread will never take).
  struct Job {
    bool submitted = false;
    std::span<const float> grads;       // empty: read from the store
    std::vector<StepSegment> segments;  // empty: the SegmentFn's
    std::function<void()> done;
    bool claimed = false;
    bool store = false;  // the writer stores `grads` too; `done` is the writer's (or Join's)
  };
  std::vector<SwapStepOptions> options;  // per parameter group
  UpdateCallback on_update;
  SegmentFn segments;
  uint64_t from = 0, to = 0;
  std::chrono::steady_clock::time_point start;
  IndexQueue reader_q, ready_q, written_q;  // reader_q: sub-groups handed over, freed buffers
  std::vector<uint64_t> predicted;          // the expected order of the hand-overs (read-ahead)
  std::vector<uint64_t> order;              // the order they came in (the reader's)
  bool serial = false;                      // begun by Step()
  std::vector<Job> jobs;
  std::vector<uint64_t> group_of;  // which sub-group buffer b holds; set by its producer
  uint64_t submitted = 0;          // the caller's
  FirstError error;
  std::thread reader, computer, writer;
  Mutex mu;
  CondVar cv;  // an update done, or the step aborted
  uint64_t updated GUARDED_BY(mu) = 0;
  bool aborted GUARDED_BY(mu) = false;
  double updates_done_s GUARDED_BY(mu) = 0;
  // Written by one stage each, read after the join.
  double read_s = 0, write_s = 0, compute_s = 0, wait_s = 0, grad_wait_s = 0;
  uint64_t read_bytes = 0, write_bytes = 0, in_memory = 0, read_ahead = 0, evicted = 0;
  uint64_t grad_write_bytes = 0;           // the writer's, for store_gradients jobs
  std::atomic<bool> store_stopped{false};  // StopStoringGradients()
  // The writer began writing a sub-group's states (set before its first Put): with one slot the
  // store's committed step is no longer whole from then on (Note [One slot per sub-group]).
  std::atomic<bool> wrote{false};

  // Stops the step: every stage returns at its next queue operation, and the gradients handed
  // over that the compute thread has not taken are released at once (the producer may be waiting
  // for them).
  void Abort(Status status) {
    error.Set(std::move(status));
    reader_q.Abort();
    ready_q.Abort();
    written_q.Abort();
    std::vector<std::function<void()>> release;
    {
      MutexLock lock(&mu);
      aborted = true;
      for (Job& job : jobs) {
        if (job.submitted && !job.claimed) {
          job.claimed = true;
          if (job.done) release.push_back(std::move(job.done));
        }
      }
    }
    cv.SignalAll();
    for (auto& done : release) done();
  }
  // The three stages (Note [The pipeline] in optimizer_swapper_step.cc), each on its own thread,
  // for the swapper `sw` whose Impl is `s`.
  void RunReader(const OptimizerSwapper& sw, Impl& s);
  void RunComputer(const OptimizerSwapper& sw, Impl& s);
  void RunWriter(const OptimizerSwapper& sw, Impl& s);
  // Claims job i for the compute thread; false when Abort() has released it.
  bool Claim(uint64_t i) {
    MutexLock lock(&mu);
    if (jobs[i].claimed) return false;
    jobs[i].claimed = true;
    return true;
  }
  void Join() {
    if (reader.joinable()) reader.join();
    if (computer.joinable()) computer.join();
    if (writer.joinable()) writer.join();
    // A stored job the writer never reached (the step failed) still gives its gradients back.
    std::vector<std::function<void()>> release;
    {
      MutexLock lock(&mu);
      for (Job& job : jobs) {
        if (job.done) release.push_back(std::move(job.done));
        job.done = nullptr;
      }
    }
    for (auto& done : release) done();
  }
};

}  // namespace memplan::offload
