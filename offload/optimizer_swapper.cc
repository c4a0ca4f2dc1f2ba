// OptimizerSwapper: see optimizer_swapper.h for the contract.
//
// Note [Two slots per sub-group]
// A step rewrites every sub-group's states. Writing them in place would leave, after a crash
// mid-step, a mix of new and old sub-groups and no way back to either whole step. So each
// sub-group has two state values in the store, "state.<i>.0" and "state.<i>.1"; epoch E lives in
// slot E % 2 and carries a header with E. Step E + 1 reads slot E % 2 and writes slot (E + 1) % 2,
// never touching the only copy of epoch E. The commit point is SwapStore::Sync() at the end of the
// step: data fdatasynced, then the index (with the new values' checksums) replaced atomically.
// After a crash the index on disk is the one of the last commit, so:
//   - a slot rewritten since then fails its checksum (DataLoss) or, if never synced, is absent;
//   - slots holding the committed epoch were not written since, and read back whole.
// Open() takes, for every sub-group, the epochs of its readable slots and resumes from the
// largest epoch that every sub-group holds. A slot that is unreadable or ahead of it is the torn
// step; the next step overwrites it. The cost is twice the NVMe space for states, not twice the
// I/O: each step still reads and writes every state once.
//
// Note [The pipeline]
// Three stages, each a thread of the step, connected by queues of buffer indices: the reader
// takes the sub-groups in the order they are handed over and fills free buffers (states, then
// gradients unless they were handed over in memory), the compute thread steps the ready ones and
// runs the update callback, the writer writes them back and frees them. buffer_count bounds the
// data in flight. Any stage's error aborts the queues, every stage drains and returns, and the
// first error is the step's. Step() hands every sub-group over at once, in order.
//
// Note [Reading states ahead]
// A sub-group's states do not depend on its gradients, so the reader need not wait for the
// hand-over to read them: while nothing handed over is waiting, it reads the states of the
// sub-group expected next into a free buffer. The expectation is the order of the last overlapped
// step's hand-overs (training repeats it), at first backward's (the last sub-group first), and
// Step()'s ascending order for Step(). When the sub-group is handed over its buffer goes straight
// to the compute stage (after its stored gradients, if any, are read); at the end of backward the
// last sub-groups' states are then already in memory and only their update and write remain. A
// wrong guess costs one read, never a deadlock: a sub-group handed over that finds no free buffer
// takes the one holding the guess expected last, and the buffers the other stages hold come back
// without the reader. The reader's one queue carries both hand-overs and freed buffers, so that it
// waits for whichever comes first.
//
// Note [Sub-groups as their gradients arrive]
// In a training step the optimizer's sub-groups get their last gradient one after another as
// backward runs (the last sub-group first), so the sub-groups' optimizer work need not wait for
// the whole backward: BeginStep() starts the pipeline before backward, with the step's options
// (which must therefore be known then: the engine decides clipping and overflow with them, Note
// [Clipping by the global norm] in engine.cc), and each
// StepSubGroup() feeds it one sub-group. The pipeline is Step()'s, stage for stage; only the order
// of the sub-groups and the source of the gradients differ. Neither changes a result: every
// sub-group is stepped by the same kernel over its own elements with the same options and step
// count, and in-memory fp32 gradients are the values WriteGradients() would have stored. Nor the
// crash consistency: BeginStep() commits the begun marker before the first write, every sub-group
// is written to its other slot, and only FinishStep() syncs, so a crash or an error anywhere in
// between leaves step epoch() whole, and Open() takes no step past the one FinishStep() last
// committed (kCommittedKey), so an abandoned step is never resumed from. The gradients handed over
// in memory are also never written to the store nor read back: the step moves (4 + 4) bytes less
// per element than Step().
#include "offload/optimizer_swapper.h"

#include <algorithm>
#include <atomic>
#include <array>
#include <chrono>
#include <cstring>
#include <deque>
#include <optional>
#include <random>
#include <thread>

#include <sys/stat.h>
#include <unistd.h>

#include "common/json.h"
#include "common/mutex.h"

namespace memplan::offload {
namespace {

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
constexpr int kMetaVersion = 1;

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

uint64_t RoundUp(uint64_t value, uint64_t to) { return (value + to - 1) / to * to; }

Result<std::unique_ptr<nvme::SwapStore>> OpenStore(const OptimizerSwapperOptions& options,
                                                   const nvme::SwapStoreOptions& store_options) {
  if (!options.make_backend) return nvme::SwapStore::Open(store_options);
  MEMPLAN_ASSIGN_OR_RETURN(std::unique_ptr<nvme::Backend> backend, options.make_backend());
  return nvme::SwapStore::Open(store_options, std::move(backend));
}

std::string StateKey(uint64_t sub_group, uint64_t slot) {
  return "state." + std::to_string(sub_group) + "." + std::to_string(slot);
}
std::string GradKey(uint64_t sub_group) { return "grad." + std::to_string(sub_group); }

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

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

}  // namespace

Status ValidateSwapStepOptions(SwapOptimizer optimizer, const SwapStepOptions& options) {
  switch (optimizer) {
    case SwapOptimizer::kAdam:
    case SwapOptimizer::kAdamAmsgrad: {
      const auto* adam = std::get_if<AdamOptions>(&options);
      if (adam == nullptr) {
        return Status::InvalidArgument("the swapper runs Adam; the step was given other options");
      }
      if (adam->amsgrad != (optimizer == SwapOptimizer::kAdamAmsgrad)) {
        return Status::InvalidArgument("AdamOptions::amsgrad must match the swapper's optimizer (" +
                                       std::string(SwapOptimizerName(optimizer)) + ")");
      }
      return adam->Validate();
    }
    case SwapOptimizer::kSgd: {
      const auto* sgd = std::get_if<SgdOptions>(&options);
      if (sgd == nullptr) {
        return Status::InvalidArgument("the swapper runs SGD; the step was given other options");
      }
      if (sgd->momentum == 0) {
        return Status::InvalidArgument(
            "the swapper's SGD keeps a momentum buffer; momentum must be > 0");
      }
      return sgd->Validate();
    }
    case SwapOptimizer::kLion: {
      const auto* lion = std::get_if<LionOptions>(&options);
      if (lion == nullptr) {
        return Status::InvalidArgument("the swapper runs Lion; the step was given other options");
      }
      return lion->Validate();
    }
  }
  return Status::Internal("unknown optimizer");
}

namespace {

// RunSwapOptimizerStep on elements [a, a + len) of the arrays, in place: each state array's part
// is a span of its own (the kernels take one span per array).
Status StepPart(CpuOptimizer& cpu, SwapOptimizer optimizer, const SwapStepOptions& options,
                int64_t step, std::span<float> params, std::span<const float> grads,
                std::span<float> states, uint64_t a, uint64_t len, std::span<uint16_t> half,
                HalfDtype half_dtype) {
  const uint64_t n = params.size();
  auto state = [&](int k) {
    return states.subspan(static_cast<size_t>(k) * n + a, static_cast<size_t>(len));
  };
  std::span<float> p = params.subspan(a, len);
  std::span<const float> g = grads.subspan(a, len);
  switch (optimizer) {
    case SwapOptimizer::kAdam:
    case SwapOptimizer::kAdamAmsgrad: {
      AdamTensors t;
      t.params = p;
      t.grads = g;
      t.exp_avg = state(0);
      t.exp_avg_sq = state(1);
      if (optimizer == SwapOptimizer::kAdamAmsgrad) t.max_exp_avg_sq = state(2);
      t.half_params = half;
      t.half_dtype = half_dtype;
      return cpu.AdamStep(std::get<AdamOptions>(options), step, t);
    }
    case SwapOptimizer::kSgd:
      return cpu.SgdStep(std::get<SgdOptions>(options), step, p, g, state(0), half, half_dtype);
    case SwapOptimizer::kLion:
      return cpu.LionStep(std::get<LionOptions>(options), step, p, g, state(0), half, half_dtype);
  }
  return Status::Internal("unknown optimizer");
}

}  // namespace

Status RunSegmentedSwapOptimizerStep(CpuOptimizer& cpu, SwapOptimizer optimizer,
                                     std::span<const SwapStepOptions> group_options,
                                     std::span<const StepSegment> segments, std::span<float> params,
                                     std::span<const float> grads, std::span<float> states,
                                     std::span<uint16_t> half, HalfDtype half_dtype) {
  const uint64_t n = params.size();
  const auto count = static_cast<uint64_t>(SwapOptimizerStates(optimizer));
  if (states.size() != n * count || grads.size() != n ||
      (half_dtype != HalfDtype::kNone && half.size() != n)) {
    return Status::InvalidArgument("segmented optimizer step: array sizes do not match");
  }
  uint64_t at = 0;
  for (const StepSegment& seg : segments) {
    if (seg.offset != at || seg.count == 0 || seg.count > n - at || seg.step < 0) {
      return Status::InvalidArgument(
          "segmented optimizer step: segments must cover the "
          "sub-group in order");
    }
    if (seg.group >= group_options.size()) {
      return Status::InvalidArgument("segmented optimizer step: group " +
                                     std::to_string(seg.group) + " of " +
                                     std::to_string(group_options.size()));
    }
    at += seg.count;
  }
  if (at != n) {
    return Status::InvalidArgument("segmented optimizer step: segments cover " +
                                   std::to_string(at) + " of " + std::to_string(n) + " elements");
  }
  for (const StepSegment& seg : segments) {
    const size_t a = seg.offset, len = seg.count;
    std::span<uint16_t> seg_half =
        half_dtype == HalfDtype::kNone ? std::span<uint16_t>() : half.subspan(a, len);
    if (seg.step == 0) {  // skipped: only the 16-bit copy of the unchanged weights
      if (half_dtype != HalfDtype::kNone) {
        MEMPLAN_RETURN_IF_ERROR(cpu.ConvertToHalf(params.subspan(a, len), seg_half, half_dtype));
      }
      continue;
    }
    MEMPLAN_RETURN_IF_ERROR(StepPart(cpu, optimizer, group_options[seg.group], seg.step, params,
                                     grads, states, a, len, seg_half, half_dtype));
  }
  return Status::Ok();
}

Status RunSwapOptimizerStep(CpuOptimizer& cpu, SwapOptimizer optimizer,
                            const SwapStepOptions& options, int64_t step, std::span<float> params,
                            std::span<const float> grads, std::span<float> states,
                            std::span<uint16_t> half, HalfDtype half_dtype,
                            std::span<const uint16_t> half_grads, HalfDtype grad_dtype) {
  const size_t n = params.size();
  if (grad_dtype != HalfDtype::kNone && optimizer != SwapOptimizer::kAdam &&
      optimizer != SwapOptimizer::kAdamAmsgrad) {
    return Status::InvalidArgument("16-bit gradients are stepped by Adam only, not " +
                                   std::string(SwapOptimizerName(optimizer)));
  }
  const int count = SwapOptimizerStates(optimizer);
  if (states.size() != n * static_cast<size_t>(count)) {
    return Status::InvalidArgument("optimizer step: " + std::to_string(states.size()) +
                                   " state elements for " + std::to_string(n) + " params and " +
                                   std::to_string(count) + " states");
  }
  auto state = [&](int k) { return states.subspan(static_cast<size_t>(k) * n, n); };
  switch (optimizer) {
    case SwapOptimizer::kAdam:
    case SwapOptimizer::kAdamAmsgrad: {
      AdamTensors t;
      t.params = params;
      t.grads = grads;
      t.exp_avg = state(0);
      t.exp_avg_sq = state(1);
      if (optimizer == SwapOptimizer::kAdamAmsgrad) t.max_exp_avg_sq = state(2);
      t.half_params = half;
      t.half_dtype = half_dtype;
      t.half_grads = half_grads;
      t.grad_dtype = grad_dtype;
      return cpu.AdamStep(std::get<AdamOptions>(options), step, t);
    }
    case SwapOptimizer::kSgd:
      return cpu.SgdStep(std::get<SgdOptions>(options), step, params, grads, state(0), half,
                         half_dtype);
    case SwapOptimizer::kLion:
      return cpu.LionStep(std::get<LionOptions>(options), step, params, grads, state(0), half,
                          half_dtype);
  }
  return Status::Internal("unknown optimizer");
}

Status OptimizerSwapperOptions::Validate() const {
  if (sub_group_elements == 0 || sub_group_elements % kElementAlign != 0) {
    return Status::InvalidArgument("sub_group_elements must be a positive multiple of 1024, not " +
                                   std::to_string(sub_group_elements));
  }
  if (sub_group_elements > (uint64_t{1} << 34)) {
    return Status::InvalidArgument("sub_group_elements " + std::to_string(sub_group_elements) +
                                   " is too large (at most 2^34)");
  }
  if (buffer_count < 2) {
    return Status::InvalidArgument("buffer_count must be at least 2, not " +
                                   std::to_string(buffer_count));
  }
  if (store.directory.empty()) return Status::InvalidArgument("the store directory is empty");
  if (identity.size() > kMaxIdentityBytes) {
    return Status::InvalidArgument("the store's identity is " + std::to_string(identity.size()) +
                                   " bytes; at most 64 MiB");
  }
  if (grad_dtype != HalfDtype::kNone && optimizer != SwapOptimizer::kAdam &&
      optimizer != SwapOptimizer::kAdamAmsgrad) {
    return Status::InvalidArgument("grad_dtype " + std::string(HalfDtypeName(grad_dtype)) +
                                   " needs Adam; " + std::string(SwapOptimizerName(optimizer)) +
                                   " steps fp32 gradients");
  }
  return cpu.Validate();
}

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

uint64_t OptimizerSwapper::RequiredSlotBytes(const OptimizerSwapperOptions& options) {
  return BufferLayout::Bytes(SwapOptimizerStates(options.optimizer), options.sub_group_elements,
                             options.half_dtype != HalfDtype::kNone, options.grad_dtype);
}

uint64_t OptimizerSwapper::RequiredStoreBytes(const OptimizerSwapperOptions& options,
                                              uint64_t num_elements) {
  // Extents are rounded to the store's alignment, which is at most 64 KiB on any device we know;
  // round every value to 64 KiB and add 1 MiB for the metadata value.
  constexpr uint64_t kExtentAlign = uint64_t{64} << 10;
  const int states = SwapOptimizerStates(options.optimizer);
  const uint64_t sg = options.sub_group_elements;
  const uint64_t full = num_elements / sg;
  const uint64_t tail = num_elements % sg;
  auto per_group = [&](uint64_t n) {
    return 2 * RoundUp(kHeaderBytes + (1 + states) * 4 * n, kExtentAlign) +
           RoundUp(BufferLayout::GradBytes(options.grad_dtype) * n, kExtentAlign);
  };
  return full * per_group(sg) + (tail ? per_group(tail) : 0) + (uint64_t{1} << 20);
}

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
  std::unique_ptr<StepRun> run;      // the begun step, if any
  std::vector<uint64_t> last_order;  // the hand-over order of the last overlapped step
  bool serial = false;               // Step() is beginning its step

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
    if (h.epoch % 2 != slot) {
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

  std::string MetaJson(uint64_t num_elements) const {
    nlohmann::json meta = {{"format", kMetaFormat},
                           {"version", kMetaVersion},
                           {"store_id", store_id},
                           {"num_elements", num_elements},
                           {"sub_group_elements", options.sub_group_elements},
                           {"optimizer", std::string(SwapOptimizerName(options.optimizer))}};
    return meta.dump();
  }

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

OptimizerSwapper::OptimizerSwapper(std::unique_ptr<Impl> impl, uint64_t num_elements,
                                   uint64_t sub_group_elements, uint64_t epoch)
    : impl_(std::move(impl)),
      num_elements_(num_elements),
      sub_group_elements_(sub_group_elements),
      sub_group_count_((num_elements + sub_group_elements - 1) / sub_group_elements),
      epoch_(epoch) {
  impl_->grads_written.assign(sub_group_count_, false);
  impl_->stats.epoch = epoch;
}

OptimizerSwapper::~OptimizerSwapper() { (void)Close(); }

uint64_t OptimizerSwapper::SubGroupSize(uint64_t i) const {
  const uint64_t begin = SubGroupBegin(i);
  return std::min(sub_group_elements_, num_elements_ - begin);
}

Result<std::unique_ptr<OptimizerSwapper>> OptimizerSwapper::Create(
    const OptimizerSwapperOptions& options, uint64_t num_elements, const ParamFiller& fill) {
  MEMPLAN_RETURN_IF_ERROR(options.Validate());
  if (num_elements == 0) return Status::InvalidArgument("num_elements must be > 0");
  if (!fill) return Status::InvalidArgument("no parameter filler given");

  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->states = SwapOptimizerStates(options.optimizer);
  impl->store_id = std::random_device{}() * uint64_t{0x100000000} + std::random_device{}();

  nvme::SwapStoreOptions so = options.store;
  so.open_existing = false;
  so.keep_files = true;
  if (so.capacity_bytes == 0) so.capacity_bytes = RequiredStoreBytes(options, num_elements);
  struct stat st {};
  const bool dir_existed = ::stat(so.directory.c_str(), &st) == 0;
  MEMPLAN_ASSIGN_OR_RETURN(impl->store, OpenStore(options, so));

  const uint64_t sg = options.sub_group_elements;
  auto initialise = [&]() -> Status {
    MEMPLAN_RETURN_IF_ERROR(impl->SetUpBuffers());
    const uint64_t groups = (num_elements + sg - 1) / sg;
    for (uint64_t i = 0; i < groups; ++i) {
      const uint64_t first = i * sg;
      const uint64_t n = std::min(sg, num_elements - first);
      std::span<std::byte> value = impl->Value(0, n);
      std::memset(value.data(), 0, value.size());
      SlotHeader h = impl->MakeHeader(0, i, first, n);
      std::memcpy(value.data(), &h, sizeof(h));
      MEMPLAN_RETURN_IF_ERROR(
          fill(first, impl->Array(0, 0, n))
              .WithPrefix("filling parameters of sub-group " + std::to_string(i)));
      MEMPLAN_RETURN_IF_ERROR(impl->store->Put(StateKey(i, 0), value));
    }
    if (!options.identity.empty()) {
      MEMPLAN_RETURN_IF_ERROR(impl->store->Put(
          kIdentityKey,
          std::span<const std::byte>(reinterpret_cast<const std::byte*>(options.identity.data()),
                                     options.identity.size())));
    }
    const std::string meta = impl->MetaJson(num_elements);
    MEMPLAN_RETURN_IF_ERROR(impl->store->Put(
        kMetaKey,
        std::span<const std::byte>(reinterpret_cast<const std::byte*>(meta.data()), meta.size())));
    return impl->store->Sync();
  };
  if (Status status = initialise(); !status.ok()) {
    // Nothing was committed: leave nothing behind (the store keeps its files on Close, so remove
    // them here, and the directory when this call created it).
    (void)impl->store->Close();
    for (const char* name : {nvme::SwapStore::kDataFileName, nvme::SwapStore::kIndexFileName,
                             nvme::SwapStore::kLockFileName}) {
      ::unlink((so.directory + "/" + name).c_str());
    }
    if (!dir_existed) ::rmdir(so.directory.c_str());
    return status;
  }
  return std::unique_ptr<OptimizerSwapper>(
      new OptimizerSwapper(std::move(impl), num_elements, sg, 0));
}

Result<std::unique_ptr<OptimizerSwapper>> OptimizerSwapper::Open(
    const OptimizerSwapperOptions& options, RecoveryReport* report) {
  MEMPLAN_RETURN_IF_ERROR(options.Validate());
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->states = SwapOptimizerStates(options.optimizer);

  nvme::SwapStoreOptions so = options.store;
  so.open_existing = true;
  so.keep_files = true;
  MEMPLAN_ASSIGN_OR_RETURN(impl->store, OpenStore(options, so));
  const std::string where = "optimizer swapper store " + so.directory;

  // The metadata: geometry and optimizer.
  auto meta_size_or = impl->store->Size(kMetaKey);
  if (!meta_size_or.ok()) {
    return Status::DataLoss(where +
                            ": no metadata; the store was not made by Create(), or its "
                            "creation never completed");
  }
  const uint64_t meta_size = *meta_size_or;
  if (meta_size > (1 << 16)) return Status::DataLoss(where + ": metadata is implausibly large");
  std::string meta_text(meta_size, '\0');
  MEMPLAN_RETURN_IF_ERROR(impl->store->Get(
      kMetaKey, std::span<std::byte>(reinterpret_cast<std::byte*>(meta_text.data()), meta_size)));
  auto meta = ParseJson(meta_text, where + " metadata");
  if (!meta.ok()) return Status::DataLoss(meta.status().message());
  uint64_t num_elements = 0, sub_group_elements = 0;
  try {
    const nlohmann::json& m = *meta;
    if (m.at("format") != kMetaFormat || m.at("version") != kMetaVersion) {
      return Status::DataLoss(where + ": metadata of an unknown format or version");
    }
    impl->store_id = m.at("store_id").get<uint64_t>();
    num_elements = m.at("num_elements").get<uint64_t>();
    sub_group_elements = m.at("sub_group_elements").get<uint64_t>();
    const std::string optimizer = m.at("optimizer").get<std::string>();
    if (optimizer != SwapOptimizerName(options.optimizer)) {
      return Status::InvalidArgument(where + " was created for optimizer " + optimizer + ", not " +
                                     std::string(SwapOptimizerName(options.optimizer)));
    }
  } catch (const nlohmann::json::exception& e) {
    return Status::DataLoss(where + ": bad metadata: " + e.what());
  }
  if (sub_group_elements != options.sub_group_elements) {
    return Status::InvalidArgument(where + " has sub-groups of " +
                                   std::to_string(sub_group_elements) + " elements, not " +
                                   std::to_string(options.sub_group_elements));
  }
  if (num_elements == 0 || sub_group_elements == 0 || sub_group_elements % kElementAlign != 0) {
    return Status::DataLoss(where + ": metadata with an impossible geometry");
  }
  // What the store holds, as its owner described it (none in a store made without one).
  impl->options.identity.clear();
  if (auto size = impl->store->Size(kIdentityKey); size.ok()) {
    if (*size > kMaxIdentityBytes) {
      return Status::DataLoss(where + ": its identity record is implausibly large");
    }
    impl->options.identity.assign(*size, '\0');
    MEMPLAN_RETURN_IF_ERROR(impl->store->Get(
        kIdentityKey,
        std::span<std::byte>(reinterpret_cast<std::byte*>(impl->options.identity.data()), *size)));
  }

  // Recovery: the epochs each sub-group holds whole (Note [Two slots per sub-group]).
  const uint64_t groups = (num_elements + sub_group_elements - 1) / sub_group_elements;
  std::vector<std::array<std::optional<uint64_t>, 2>> held(groups);
  RecoveryReport found;
  for (uint64_t i = 0; i < groups; ++i) {
    const uint64_t first = i * sub_group_elements;
    const uint64_t n = std::min(sub_group_elements, num_elements - first);
    for (uint64_t slot = 0; slot < 2; ++slot) {
      const std::string key = StateKey(i, slot);
      auto size = impl->store->Size(key);
      if (!size.ok()) continue;  // never written, or written after the last commit
      if (*size != kHeaderBytes + (1 + impl->states) * 4 * n) {
        found.notes.push_back(key + ": wrong size " + std::to_string(*size));
        continue;
      }
      SlotHeader h{};
      Status read = impl->store->GetRange(
          key, 0, std::span<std::byte>(reinterpret_cast<std::byte*>(&h), sizeof(h)));
      if (!read.ok()) {
        found.notes.push_back(key + ": unreadable (" + read.message() + ")");
        continue;
      }
      auto epoch = impl->CheckHeader(h, i, slot, first, n);
      if (!epoch.ok()) {
        found.notes.push_back(epoch.status().message());
        continue;
      }
      held[i][slot] = *epoch;
    }
  }
  // The newest epoch every sub-group holds, and not past the commit marker (stores written before
  // the marker existed have none). Sub-group 0's epochs are the only candidates.
  uint64_t marker = UINT64_MAX;
  if (impl->store->Size(kCommittedKey).ok()) {
    Status read = impl->store->Get(
        kCommittedKey, std::span<std::byte>(reinterpret_cast<std::byte*>(&marker), sizeof(marker)));
    if (!read.ok()) {
      found.notes.push_back(std::string(kCommittedKey) + ": " + read.message());
      marker = UINT64_MAX;
    }
  }
  std::optional<uint64_t> committed;
  for (const auto& candidate : held[0]) {
    if (!candidate || *candidate > impl->options.max_epoch || *candidate > marker) continue;
    bool everywhere = std::all_of(held.begin(), held.end(), [&](const auto& slots) {
      return slots[0] == candidate || slots[1] == candidate;
    });
    if (everywhere && (!committed || *candidate > *committed)) committed = candidate;
  }
  if (!committed) {
    std::string detail = found.notes.empty() ? "" : " (first problem: " + found.notes[0] + ")";
    if (impl->options.max_epoch != UINT64_MAX) {
      return Status::DataLoss(where + ": no step up to " + std::to_string(impl->options.max_epoch) +
                              " is held whole by every sub-group (a store keeps its last two "
                              "steps)" +
                              detail);
    }
    return Status::DataLoss(where + ": no step is held whole by every sub-group" + detail);
  }
  found.epoch = *committed;
  // The other slot of each sub-group should hold epoch - 1 (or nothing at epoch 0); anything else
  // there, or a damaged slot, is the trace of a step that did not commit.
  for (uint64_t i = 0; i < groups; ++i) {
    const uint64_t other = (found.epoch + 1) % 2;
    const std::string key = StateKey(i, other);
    const bool exists = impl->store->Size(key).ok();
    const bool expected_previous =
        held[i][other] && found.epoch > 0 && *held[i][other] == found.epoch - 1;
    const bool empty_at_start = !exists && found.epoch == 0;
    if (!expected_previous && !empty_at_start) {
      ++found.torn_sub_groups;
      if (held[i][other] && *held[i][other] > found.epoch) {
        found.notes.push_back(key + ": holds uncommitted epoch " + std::to_string(*held[i][other]));
      }
    }
  }
  // A store whose previous-epoch slots were merely never written (epoch 0 only) is not torn; one
  // where every sub-group has its previous epoch intact is not torn either.
  uint64_t begun = 0;
  if (impl->store->Size(kBegunKey).ok()) {
    Status read = impl->store->Get(
        kBegunKey, std::span<std::byte>(reinterpret_cast<std::byte*>(&begun), sizeof(begun)));
    if (!read.ok()) found.notes.push_back(std::string(kBegunKey) + ": " + read.message());
  }
  if (begun > found.epoch) {
    found.notes.push_back("step " + std::to_string(begun) + " was begun and not committed");
  }
  found.torn = found.torn_sub_groups > 0 || begun > found.epoch;
  if (found.torn) found.torn_epoch = found.epoch + 1;
  if (report != nullptr) *report = found;

  MEMPLAN_RETURN_IF_ERROR(impl->SetUpBuffers());
  auto swapper = std::unique_ptr<OptimizerSwapper>(
      new OptimizerSwapper(std::move(impl), num_elements, sub_group_elements, found.epoch));
  return swapper;
}

Status OptimizerSwapper::WriteGradients(uint64_t sub_group, std::span<const float> grads) {
  if (impl_->options.grad_dtype != HalfDtype::kNone) {
    return Status::FailedPrecondition("the optimizer swapper takes " +
                                      std::string(HalfDtypeName(impl_->options.grad_dtype)) +
                                      " gradients (WriteHalfGradients), not fp32");
  }
  return PutGradients(sub_group, std::as_bytes(grads), grads.size());
}

Status OptimizerSwapper::WriteHalfGradients(uint64_t sub_group, std::span<const uint16_t> grads) {
  if (impl_->options.grad_dtype == HalfDtype::kNone) {
    return Status::FailedPrecondition(
        "the optimizer swapper takes fp32 gradients (WriteGradients), not 16-bit ones");
  }
  return PutGradients(sub_group, std::as_bytes(grads), grads.size());
}

Status OptimizerSwapper::PutGradients(uint64_t sub_group, std::span<const std::byte> bytes,
                                      size_t count) {
  if (impl_->closed) return Status::FailedPrecondition("the optimizer swapper is closed");
  if (sub_group >= sub_group_count_) {
    return Status::InvalidArgument("sub-group " + std::to_string(sub_group) + " out of range (" +
                                   std::to_string(sub_group_count_) + " sub-groups)");
  }
  if (count != SubGroupSize(sub_group)) {
    return Status::InvalidArgument("sub-group " + std::to_string(sub_group) + " has " +
                                   std::to_string(SubGroupSize(sub_group)) + " elements; " +
                                   std::to_string(count) + " gradients given");
  }
  MEMPLAN_RETURN_IF_ERROR(impl_->store->Put(GradKey(sub_group), bytes));
  impl_->grads_written[sub_group] = true;
  return Status::Ok();
}

Status OptimizerSwapper::Step(const SwapStepOptions& options, const UpdateCallback& on_update,
                              const SegmentFn& segments) {
  return Step(std::span<const SwapStepOptions>(&options, 1), on_update, segments);
}

Status OptimizerSwapper::Step(std::span<const SwapStepOptions> options,
                              const UpdateCallback& on_update, const SegmentFn& segments) {
  Impl& s = *impl_;
  if (s.closed) return Status::FailedPrecondition("the optimizer swapper is closed");
  if (s.run) return Status::FailedPrecondition("an overlapped step is begun; FinishStep() it");
  if (options.empty()) return Status::InvalidArgument("step: no options given");
  for (const SwapStepOptions& o : options) {
    MEMPLAN_RETURN_IF_ERROR(ValidateSwapStepOptions(s.options.optimizer, o));
  }
  for (uint64_t i = 0; i < sub_group_count_; ++i) {
    if (!s.grads_written[i]) {
      return Status::FailedPrecondition("gradients of sub-group " + std::to_string(i) +
                                        " have not been written since step " +
                                        std::to_string(epoch_));
    }
  }
  // The serial step is the overlapped one with every sub-group handed over at once, in order,
  // its gradients read from the store.
  s.serial = true;
  Status begun = BeginStep(options, on_update, segments);
  s.serial = false;
  MEMPLAN_RETURN_IF_ERROR(begun);
  for (uint64_t i = 0; i < sub_group_count_; ++i) {
    Status handed = StepSubGroup(i, {});
    if (!handed.ok()) {
      AbortStep();
      return handed;
    }
  }
  return FinishStep();
}

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

bool OptimizerSwapper::step_begun() const { return impl_->run != nullptr; }

uint64_t OptimizerSwapper::SubGroupsUpdated() const {
  if (!impl_->run) return 0;
  MutexLock lock(&impl_->run->mu);
  return impl_->run->updated;
}

Status OptimizerSwapper::BeginStep(const SwapStepOptions& options, const UpdateCallback& on_update,
                                   const SegmentFn& segments) {
  return BeginStep(std::span<const SwapStepOptions>(&options, 1), on_update, segments);
}

Status OptimizerSwapper::BeginStep(std::span<const SwapStepOptions> options,
                                   const UpdateCallback& on_update, const SegmentFn& segments) {
  Impl& s = *impl_;
  if (s.closed) return Status::FailedPrecondition("the optimizer swapper is closed");
  if (s.run) return Status::FailedPrecondition("a step is begun already");
  if (options.empty()) return Status::InvalidArgument("step: no options given");
  for (const SwapStepOptions& o : options) {
    MEMPLAN_RETURN_IF_ERROR(ValidateSwapStepOptions(s.options.optimizer, o));
  }
  auto run = std::make_unique<StepRun>();
  run->options.assign(options.begin(), options.end());
  run->on_update = on_update;
  run->segments = segments;
  run->from = epoch_;
  run->to = epoch_ + 1;
  run->start = std::chrono::steady_clock::now();
  run->jobs.resize(sub_group_count_);
  run->group_of.assign(s.buffers.size(), 0);
  if (s.options.sync_every_step) {
    // Record that step `to` has begun before anything of it is written, so that a crash before its
    // commit is reported as a torn step even where no slot shows it (the first step's slots are
    // new keys, which a crash simply loses).
    const uint64_t begun = run->to;
    MEMPLAN_RETURN_IF_ERROR(s.store->Put(
        kBegunKey,
        std::span<const std::byte>(reinterpret_cast<const std::byte*>(&begun), sizeof(begun))));
    MEMPLAN_RETURN_IF_ERROR(
        s.store->Sync().WithPrefix("beginning step " + std::to_string(run->to)));
  }
  for (size_t b = 0; b < s.buffers.size(); ++b) run->reader_q.Push(kFreed + b);
  run->serial = s.serial;
  run->predicted.resize(sub_group_count_);
  if (s.serial) {  // Step(): in order
    for (uint64_t k = 0; k < sub_group_count_; ++k) run->predicted[k] = k;
  } else if (s.last_order.size() == sub_group_count_) {
    run->predicted = s.last_order;
  } else {  // backward's order: the last sub-group first
    for (uint64_t k = 0; k < sub_group_count_; ++k) run->predicted[k] = sub_group_count_ - 1 - k;
  }
  StepRun& r = *run;
  const uint64_t count = sub_group_count_;
  r.reader = std::thread([this, &s, &r, count] {
    // Note [Reading states ahead].
    std::deque<size_t> free;                // buffers free to fill
    std::deque<uint64_t> pending;           // handed over, not yet read
    std::vector<int64_t> ahead(count, -1);  // the buffer holding sub-group i's states read ahead
    std::vector<bool> handed(count, false);
    size_t guess = 0;  // next candidate in r.predicted
    uint64_t dispatched = 0;
    auto take = [&](size_t value) {
      if (value >= kFreed) {
        free.push_back(value - kFreed);
      } else {
        pending.push_back(value);
        handed[value] = true;
        r.order.push_back(value);
      }
    };
    // Reads sub-group i's states into buffer b (and its stored gradients when `with_grads`).
    auto read = [&](uint64_t i, size_t b, bool states, bool with_grads) -> bool {
      const auto t0 = std::chrono::steady_clock::now();
      const uint64_t n = SubGroupSize(i);
      std::span<std::byte> value = s.Value(b, n);
      Status st;
      if (states) {
        st = s.store->Get(StateKey(i, r.from % 2), value);
        if (st.ok()) {
          SlotHeader h;
          std::memcpy(&h, value.data(), sizeof(h));
          auto epoch = s.CheckHeader(h, i, r.from % 2, SubGroupBegin(i), n);
          if (!epoch.ok()) {
            st = epoch.status();
          } else if (*epoch != r.from) {
            st = Status::DataLoss("state slot " + StateKey(i, r.from % 2) + " holds epoch " +
                                  std::to_string(*epoch) + ", expected " + std::to_string(r.from));
          }
        }
      }
      uint64_t grad_bytes = 0;
      if (st.ok() && with_grads) {
        std::span<std::byte> grads = s.GradBytes(b, n);
        st = s.store->Get(GradKey(i), grads);
        grad_bytes = grads.size();
      }
      r.read_s += SecondsSince(t0);
      if (!st.ok()) {
        r.Abort(st.WithPrefix("step " + std::to_string(r.to) + ", reading sub-group " +
                              std::to_string(i)));
        return false;
      }
      r.read_bytes += (states ? value.size() : 0) + grad_bytes;
      return true;
    };
    while (dispatched < count) {
      bool aborted = false;
      if (std::optional<size_t> value = r.reader_q.TryPop(&aborted)) {
        take(*value);
        continue;
      }
      if (aborted) return;
      if (!pending.empty()) {
        const uint64_t i = pending.front();
        const bool with_grads = r.jobs[i].grads.empty();
        size_t b;
        bool states = true;
        if (ahead[i] >= 0) {
          b = static_cast<size_t>(ahead[i]);
          ahead[i] = -1;
          states = false;
        } else if (!free.empty()) {
          b = free.front();
          free.pop_front();
        } else {
          // Every buffer is busy or holds a guess: give up the guess expected last.
          int64_t victim = -1;
          for (size_t k = r.predicted.size(); k-- > 0 && victim < 0;) {
            if (ahead[r.predicted[k]] >= 0) victim = static_cast<int64_t>(r.predicted[k]);
          }
          if (victim < 0) {
            std::optional<size_t> value = r.reader_q.Pop();
            if (!value) return;
            take(*value);
            continue;
          }
          b = static_cast<size_t>(ahead[victim]);
          ahead[victim] = -1;
          ++r.evicted;
        }
        if (!read(i, b, states, with_grads)) return;
        pending.pop_front();
        r.group_of[b] = i;
        ++dispatched;
        r.ready_q.Push(b);
        continue;
      }
      // Nothing handed over: read the expected next sub-group's states ahead, into a free buffer.
      while (guess < r.predicted.size() &&
             (handed[r.predicted[guess]] || ahead[r.predicted[guess]] >= 0)) {
        ++guess;
      }
      if (!free.empty() && guess < r.predicted.size()) {
        const uint64_t i = r.predicted[guess++];
        const size_t b = free.front();
        free.pop_front();
        if (!read(i, b, /*states=*/true, /*with_grads=*/false)) return;
        ahead[i] = static_cast<int64_t>(b);
        ++r.read_ahead;
        continue;
      }
      const auto g0 = std::chrono::steady_clock::now();
      std::optional<size_t> value = r.reader_q.Pop();
      r.grad_wait_s += SecondsSince(g0);
      if (!value) return;
      take(*value);
    }
  });
  r.computer = std::thread([this, &s, &r, count] {
    for (uint64_t k = 0; k < count; ++k) {
      const auto w0 = std::chrono::steady_clock::now();
      std::optional<size_t> b = r.ready_q.Pop();
      r.wait_s += SecondsSince(w0);
      if (!b) return;
      const auto t0 = std::chrono::steady_clock::now();
      const uint64_t i = r.group_of[*b];
      const uint64_t n = SubGroupSize(i);
      StepRun::Job& job = r.jobs[i];
      if (!r.Claim(i)) return;  // aborted meanwhile
      std::vector<StepSegment> parts = job.segments;
      if (parts.empty() && r.segments) parts = r.segments(i);
      Status st = s.RunKernel(r.options, static_cast<int64_t>(r.to), *b, n, parts, job.grads);
      if (!job.grads.empty()) ++r.in_memory;
      if (!job.store) {
        std::function<void()> done;
        {
          MutexLock lock(&r.mu);
          done = std::move(job.done);
          job.done = nullptr;
        }
        if (done) done();  // the gradients are read
      }
      if (st.ok()) {
        SlotHeader h = s.MakeHeader(r.to, i, SubGroupBegin(i), n);
        std::memcpy(s.Base(*b), &h, sizeof(h));
        if (r.on_update) {
          std::span<uint16_t> half = s.Half(*b, n);
          SubGroupUpdate update{i, SubGroupBegin(i), s.Array(*b, 0, n),
                                std::span<const uint16_t>(half.data(), half.size())};
          st = r.on_update(update).WithPrefix("update callback for sub-group " + std::to_string(i));
        }
      }
      r.compute_s += SecondsSince(t0);
      if (!st.ok()) {
        r.Abort(st.WithPrefix("step " + std::to_string(r.to)));
        return;
      }
      {
        MutexLock lock(&r.mu);
        if (++r.updated == count) r.updates_done_s = SecondsSince(r.start);
      }
      r.cv.SignalAll();
      r.written_q.Push(*b);
    }
  });
  r.writer = std::thread([this, &s, &r, count] {
    for (uint64_t k = 0; k < count; ++k) {
      std::optional<size_t> b = r.written_q.Pop();
      if (!b) return;
      const auto t0 = std::chrono::steady_clock::now();
      const uint64_t i = r.group_of[*b];
      std::span<std::byte> value = s.Value(*b, SubGroupSize(i));
      Status st = s.store->Put(StateKey(i, r.to % 2), value);
      StepRun::Job& job = r.jobs[i];
      uint64_t grad_bytes = 0;
      if (st.ok() && job.store) {
        // Kept for a step run again (FinishStep(false)): beside backward, off its path; not once
        // the caller knows the step stands.
        if (!r.store_stopped.load(std::memory_order_acquire)) {
          const std::span<const std::byte> grads = std::as_bytes(job.grads);
          st = s.store->Put(GradKey(i), grads);
          if (st.ok()) {
            s.grads_written[i] = true;  // the writer is the only one writing them in this step
            grad_bytes = grads.size();
          }
        }
        std::function<void()> done;
        {
          MutexLock lock(&r.mu);
          done = std::move(job.done);
          job.done = nullptr;
        }
        if (done) done();
      }
      r.write_s += SecondsSince(t0);
      if (!st.ok()) {
        r.Abort(st.WithPrefix("step " + std::to_string(r.to) + ", writing sub-group " +
                              std::to_string(i)));
        return;
      }
      r.write_bytes += value.size();
      r.grad_write_bytes += grad_bytes;
      r.reader_q.Push(kFreed + *b);
    }
  });
  s.run = std::move(run);
  return Status::Ok();
}

Status OptimizerSwapper::StepSubGroup(uint64_t sub_group, std::span<const float> grads,
                                      std::vector<StepSegment> segments, std::function<void()> done,
                                      bool store_gradients) {
  Impl& s = *impl_;
  if (!s.run) return Status::FailedPrecondition("no step is begun (BeginStep)");
  StepRun& r = *s.run;
  if (sub_group >= sub_group_count_) {
    return Status::InvalidArgument("sub-group " + std::to_string(sub_group) + " out of range (" +
                                   std::to_string(sub_group_count_) + " sub-groups)");
  }
  StepRun::Job& job = r.jobs[sub_group];
  if (job.submitted) {
    return Status::InvalidArgument("sub-group " + std::to_string(sub_group) + " handed to step " +
                                   std::to_string(r.to) + " twice");
  }
  if (grads.empty()) {
    if (!s.grads_written[sub_group]) {
      return Status::FailedPrecondition("gradients of sub-group " + std::to_string(sub_group) +
                                        " have not been written since step " +
                                        std::to_string(epoch_));
    }
  } else {
    if (s.options.grad_dtype != HalfDtype::kNone) {
      return Status::FailedPrecondition("the optimizer swapper takes " +
                                        std::string(HalfDtypeName(s.options.grad_dtype)) +
                                        " gradients; fp32 ones cannot be handed over");
    }
    if (grads.size() != SubGroupSize(sub_group)) {
      return Status::InvalidArgument("sub-group " + std::to_string(sub_group) + " has " +
                                     std::to_string(SubGroupSize(sub_group)) + " elements; " +
                                     std::to_string(grads.size()) + " gradients given");
    }
  }
  ++r.submitted;
  bool refused = false;  // decided under the lock: Abort() may claim the job as soon as it is out
  {
    MutexLock lock(&r.mu);
    job.submitted = true;
    if (!r.aborted) {
      job.grads = grads;
      job.segments = std::move(segments);
      job.done = std::move(done);
      job.store = store_gradients && !grads.empty();
    } else {
      job.claimed = true;  // the step has failed: nothing will read them
      refused = true;
    }
  }
  if (refused) {
    if (done) done();
    return Status::Ok();
  }
  r.reader_q.Push(sub_group);
  return Status::Ok();
}

Status OptimizerSwapper::WaitForUpdates() {
  Impl& s = *impl_;
  if (!s.run) return Status::FailedPrecondition("no step is begun (BeginStep)");
  StepRun& r = *s.run;
  if (r.submitted < sub_group_count_) {
    for (uint64_t i = 0; i < sub_group_count_; ++i) {
      if (!r.jobs[i].submitted) {
        return Status::FailedPrecondition("step " + std::to_string(r.to) + ": sub-group " +
                                          std::to_string(i) + " was never handed over");
      }
    }
  }
  MutexLock lock(&r.mu);
  while (!r.aborted && r.updated != sub_group_count_) r.cv.Wait(&r.mu);
  lock.Unlock();
  return r.error.Get();
}

Status OptimizerSwapper::FinishStep() { return FinishStep(true); }

Status OptimizerSwapper::FinishStep(bool commit) {
  Impl& s = *impl_;
  if (!s.run) return Status::FailedPrecondition("no step is begun (BeginStep)");
  StepRun& r = *s.run;
  Status status;
  if (r.submitted < sub_group_count_) {
    status = WaitForUpdates();  // names the sub-group never handed over
    r.Abort(status);
  }
  r.Join();
  if (status.ok()) status = r.error.Get();
  if (!commit) {
    // Run to its end and dropped: nothing committed, the stored gradients kept for Step().
    s.stats.last_step.grad_wait_s = r.grad_wait_s;
    const bool serial = r.serial;
    const std::vector<uint64_t> order = r.order;
    s.run.reset();
    if (!serial && order.size() == sub_group_count_) s.last_order = order;
    return status;
  }
  double sync_s = 0;
  if (status.ok()) {
    const uint64_t committed = r.to;
    status = s.store
                 ->Put(kCommittedKey,
                       std::span<const std::byte>(reinterpret_cast<const std::byte*>(&committed),
                                                  sizeof(committed)))
                 .WithPrefix("committing step " + std::to_string(r.to));
  }
  if (status.ok() && s.options.sync_every_step) {
    const auto t0 = std::chrono::steady_clock::now();
    status = s.store->Sync().WithPrefix("committing step " + std::to_string(r.to));
    sync_s = SecondsSince(t0);
  }
  SwapStepStats& last = s.stats.last_step;
  last.total_s = SecondsSince(r.start);
  last.read_s = r.read_s;
  last.write_s = r.write_s;
  last.compute_s = r.compute_s;
  last.compute_wait_s = r.wait_s;
  last.grad_wait_s = r.grad_wait_s;
  last.sync_s = sync_s;
  last.read_bytes = r.read_bytes;
  last.write_bytes = r.write_bytes;
  last.sub_groups_in_memory = r.in_memory;
  {
    MutexLock lock(&r.mu);
    last.updates_done_s = r.updates_done_s;
  }
  last.sub_groups_read_ahead = r.read_ahead;
  const uint64_t to = r.to;
  if (!r.serial && r.order.size() == sub_group_count_) s.last_order = r.order;
  s.run.reset();
  if (!status.ok()) {
    ++s.stats.failed_steps;
    return status;
  }
  epoch_ = to;
  s.stats.epoch = to;
  ++s.stats.steps;
  std::fill(s.grads_written.begin(), s.grads_written.end(), false);
  return Status::Ok();
}

void OptimizerSwapper::StopStoringGradients() {
  if (impl_->run) impl_->run->store_stopped.store(true, std::memory_order_release);
}

void OptimizerSwapper::AbortStep() {
  Impl& s = *impl_;
  if (!s.run) return;
  s.run->Abort(Status::FailedPrecondition("step " + std::to_string(s.run->to) + " abandoned"));
  s.run->Join();
  s.run.reset();
}

Status OptimizerSwapper::ReadState(uint64_t sub_group, int state, std::span<float> out) {
  if (state < 0 || state >= impl_->states) {
    return Status::InvalidArgument("state " + std::to_string(state) + " out of range (" +
                                   std::to_string(impl_->states) + " states)");
  }
  return ReadArray(sub_group, state + 1, out);
}

Status OptimizerSwapper::ReadParams(uint64_t sub_group, std::span<float> out) {
  return ReadArray(sub_group, 0, out);
}

Status OptimizerSwapper::ReadArray(uint64_t sub_group, int array, std::span<float> out) {
  if (sub_group < sub_group_count_ && out.size() != SubGroupSize(sub_group)) {
    return Status::InvalidArgument("sub-group " + std::to_string(sub_group) + " has " +
                                   std::to_string(SubGroupSize(sub_group)) +
                                   " elements; the output holds " + std::to_string(out.size()));
  }
  return ReadRange(sub_group, array, 0, out);
}

Status OptimizerSwapper::ReadRange(uint64_t sub_group, int array, uint64_t offset,
                                   std::span<float> out) {
  Impl& s = *impl_;
  if (s.closed) return Status::FailedPrecondition("the optimizer swapper is closed");
  if (sub_group >= sub_group_count_) {
    return Status::InvalidArgument("sub-group " + std::to_string(sub_group) + " out of range (" +
                                   std::to_string(sub_group_count_) + " sub-groups)");
  }
  const uint64_t n = SubGroupSize(sub_group);
  if (array < 0 || array > s.states) {
    return Status::InvalidArgument("array " + std::to_string(array) + " out of range");
  }
  if (offset > n || out.size() > n - offset) {
    return Status::InvalidArgument("sub-group " + std::to_string(sub_group) + " has " +
                                   std::to_string(n) + " elements; elements [" +
                                   std::to_string(offset) + ", " +
                                   std::to_string(offset + out.size()) + ") asked for");
  }
  const std::string key = StateKey(sub_group, epoch_ % 2);
  SlotHeader h{};
  MEMPLAN_RETURN_IF_ERROR(
      s.store->GetRange(key, 0, std::span<std::byte>(reinterpret_cast<std::byte*>(&h), sizeof(h))));
  MEMPLAN_ASSIGN_OR_RETURN(uint64_t epoch,
                           s.CheckHeader(h, sub_group, epoch_ % 2, SubGroupBegin(sub_group), n));
  if (epoch != epoch_) {
    return Status::DataLoss("state slot " + key + " holds epoch " + std::to_string(epoch) +
                            ", expected " + std::to_string(epoch_));
  }
  const uint64_t at = kHeaderBytes + static_cast<uint64_t>(array) * 4 * n + offset * 4;
  return s.store->GetRange(
      key, at, std::span<std::byte>(reinterpret_cast<std::byte*>(out.data()), out.size_bytes()));
}

const std::string& OptimizerSwapper::identity() const { return impl_->options.identity; }

void OptimizerSwapper::DiscardGradients() {
  std::fill(impl_->grads_written.begin(), impl_->grads_written.end(), false);
}

Status OptimizerSwapper::Load(const ArrayFiller& fill, std::span<const bool> arrays) {
  Impl& s = *impl_;
  if (s.closed) return Status::FailedPrecondition("the optimizer swapper is closed");
  if (s.run) return Status::FailedPrecondition("a step is begun; finish or abort it first");
  if (arrays.size() != static_cast<size_t>(1 + s.states)) {
    return Status::InvalidArgument("load: " + std::to_string(arrays.size()) + " array flags for " +
                                   std::to_string(1 + s.states) + " arrays");
  }
  if (!fill) return Status::InvalidArgument("load: no filler given");
  // As a step (Note [Two slots per sub-group]): the begun marker, every sub-group's new value in
  // its other slot, then the commit; the slot of epoch() is never touched.
  const uint64_t from = epoch_, to = epoch_ + 1;
  MEMPLAN_RETURN_IF_ERROR(s.store->Put(
      kBegunKey, std::span<const std::byte>(reinterpret_cast<const std::byte*>(&to), sizeof(to))));
  MEMPLAN_RETURN_IF_ERROR(s.store->Sync().WithPrefix("beginning load " + std::to_string(to)));
  const size_t b = 0;
  for (uint64_t i = 0; i < sub_group_count_; ++i) {
    const uint64_t n = SubGroupSize(i);
    std::span<std::byte> value = s.Value(b, n);
    const std::string where = "load " + std::to_string(to) + ", sub-group " + std::to_string(i);
    MEMPLAN_RETURN_IF_ERROR(s.store->Get(StateKey(i, from % 2), value).WithPrefix(where));
    SlotHeader h;
    std::memcpy(&h, value.data(), sizeof(h));
    MEMPLAN_ASSIGN_OR_RETURN(const uint64_t held,
                             s.CheckHeader(h, i, from % 2, SubGroupBegin(i), n));
    if (held != from) {
      return Status::DataLoss(where + ": slot holds epoch " + std::to_string(held) + ", expected " +
                              std::to_string(from));
    }
    for (int a = 0; a <= s.states; ++a) {
      if (arrays[static_cast<size_t>(a)]) {
        MEMPLAN_RETURN_IF_ERROR(fill(i, a, s.Array(b, a, n)).WithPrefix(where));
      }
    }
    h = s.MakeHeader(to, i, SubGroupBegin(i), n);
    std::memcpy(value.data(), &h, sizeof(h));
    MEMPLAN_RETURN_IF_ERROR(s.store->Put(StateKey(i, to % 2), value).WithPrefix(where));
  }
  MEMPLAN_RETURN_IF_ERROR(s.store->Put(
      kCommittedKey,
      std::span<const std::byte>(reinterpret_cast<const std::byte*>(&to), sizeof(to))));
  MEMPLAN_RETURN_IF_ERROR(s.store->Sync().WithPrefix("committing load " + std::to_string(to)));
  epoch_ = to;
  s.stats.epoch = to;
  return Status::Ok();
}

Status OptimizerSwapper::Sync() {
  if (impl_->closed) return Status::FailedPrecondition("the optimizer swapper is closed");
  return impl_->store->Sync();
}

OptimizerSwapperStats OptimizerSwapper::stats() const {
  OptimizerSwapperStats out = impl_->stats;
  if (impl_->pool != nullptr) out.pool = impl_->pool->stats();
  if (impl_->store) out.store = impl_->store->stats();
  return out;
}

Status OptimizerSwapper::Close() {
  if (impl_->closed) return Status::Ok();
  AbortStep();  // a begun step is not committed
  Impl& s = *impl_;
  s.closed = true;
  Status status;
  if (s.store) status = s.store->Close();  // keep_files: writes the index, fsyncs the data
  s.buffers.clear();                       // back to the pool before the pool goes
  s.own_pool.reset();
  return status;
}

}  // namespace memplan::offload
