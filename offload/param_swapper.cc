// ParamSwapper: see param_swapper.h for the contract.
//
// Note [Trace-driven prefetch]
// Training runs the same modules in the same order every step, so the order of Fetch() calls in one
// step predicts the next. Step 1 records it (no prefetch: nothing is known yet). From step 2 each
// Fetch() is matched against the trace at the current position: a match advances it and the
// transfer thread is handed the parameters of the next modules in the trace, in order, until a
// budget would be exceeded; a mismatch (dynamic control flow, a changed model) truncates the trace
// at that point and records from there, and prefetching waits until a whole step has been
// recorded again. EndOfStep() frees what was prefetched and not used, so a wrong guess costs
// bandwidth, never memory beyond the budgets.
//
// Note [Parameter states]
//   home    -> queued   (Fetch/prefetch enqueues it; its bytes count as live from here)
//   queued  -> loading  (the transfer thread took it)
//   loading -> ready    (its copies are queued on the runtime; `ticket` is the last one)
//           -> failed   (the error is kept for the Fetch() that waits for it)
//   ready   -> home     (Release() of its last use, or EndOfStep() for an unused prefetch)
// All transitions happen under `mu`; runtime calls and store reads never do.
#include "offload/param_swapper.h"

#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

namespace memplan::offload {
namespace {

enum class State { kHome, kQueued, kLoading, kReady, kFailed };

std::string ChunkKey(uint64_t chunk) { return "hp." + std::to_string(chunk); }

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

Status ParamSwapperOptions::Validate() const {
  if (runtime == nullptr) return Status::InvalidArgument("param swapper: no GPU runtime given");
  if (collective != nullptr && collective->world_size() != 1) {
    return Status::Unimplemented("param swapper: world size " +
                                 std::to_string(collective->world_size()) +
                                 " (ZeRO-3 partitioning across ranks) is not implemented yet");
  }
  if (tier == Tier::kNvme) {
    if (store == nullptr) return Status::InvalidArgument("param swapper: nvme tier without a store");
    if (staging == nullptr || staging_slots < 2) {
      return Status::InvalidArgument("param swapper: nvme tier needs a staging pool, >= 2 slots");
    }
  }
  if (chunk_elements == 0) return Status::InvalidArgument("param swapper: chunk_elements is 0");
  if (prefetch_bytes == 0 || max_live_bytes == 0) {
    return Status::InvalidArgument("param swapper: prefetch and live budgets must be > 0");
  }
  return Status::Ok();
}

struct ParamSwapper::Impl {
  struct Param {
    std::string name;
    uint64_t numel = 0;
    uint64_t flat = 0;
    uint64_t bytes = 0;
    bool resident = false;
    void* device = nullptr;
    State state = State::kHome;
    bool prefetched = false;  // fetched ahead and not yet used by a Fetch()
    int uses = 0;             // Fetch() calls not yet Released
    gpu::CopyTicket ticket;
    Status error;
  };

  ParamSwapperOptions options;
  int elem_bytes = 2;
  bool finalized = false;
  std::vector<Param> params;
  std::unordered_map<std::string, std::vector<ParamId>> modules;
  uint64_t flat_total = 0;

  std::byte* arena = nullptr;  // the cpu tier's pinned copy of the flat space
  uint64_t arena_bytes = 0;
  bool arena_registered = false;
  std::vector<PinnedSlot> slots;            // nvme staging; used by the transfer thread only
  std::vector<gpu::CopyTicket> slot_ticket;
  size_t next_slot = 0;

  mutable std::mutex mu;
  std::condition_variable job_ready;   // a job was queued, or stop
  std::condition_variable job_done;    // a parameter left queued/loading
  std::deque<ParamId> jobs;            // Guarded by mu.
  bool loading = false;                // Guarded by mu: the thread is working on a job.
  bool stop = false;                   // Guarded by mu.
  std::unordered_map<uint64_t, std::vector<void*>> free_device;  // Guarded by mu: by size.
  ParamSwapperStats stats;             // Guarded by mu.
  std::thread worker;

  // Trace: used by the trainer's thread only.
  std::vector<std::string> trace;
  bool recording = true;
  size_t pos = 0;

  ~Impl() {
    {
      std::lock_guard<std::mutex> lock(mu);
      stop = true;
    }
    job_ready.notify_all();
    if (worker.joinable()) worker.join();
    (void)options.runtime->Synchronize();
    for (Param& p : params) {
      if (p.device != nullptr) (void)options.runtime->FreeDevice(p.device);
    }
    for (auto& [size, list] : free_device) {
      for (void* ptr : list) (void)options.runtime->FreeDevice(ptr);
    }
    slots.clear();
    if (arena != nullptr) {
      if (arena_registered) (void)options.runtime->UnregisterHost(arena);
      ::munmap(arena, arena_bytes);
    }
  }

  bool IsModuleKnown(std::string_view module) const {
    return modules.find(std::string(module)) != modules.end();
  }

  // Queues `id` (home) for the transfer thread. Caller holds mu.
  void EnqueueLocked(ParamId id, bool front, bool prefetch) {
    Param& p = params[id];
    p.state = State::kQueued;
    p.prefetched = prefetch;
    stats.live_bytes += p.bytes;
    stats.peak_live_bytes = std::max(stats.peak_live_bytes, stats.live_bytes);
    if (prefetch) {
      stats.ahead_bytes += p.bytes;
      stats.peak_ahead_bytes = std::max(stats.peak_ahead_bytes, stats.ahead_bytes);
      ++stats.prefetches;
    }
    if (front) {
      jobs.push_front(id);
    } else {
      jobs.push_back(id);
    }
  }

  // Returns a home parameter's GPU memory to the cache. Caller holds mu.
  void ToHomeLocked(Param& p) {
    if (p.device != nullptr) free_device[p.bytes].push_back(p.device);
    p.device = nullptr;
    p.state = State::kHome;
    stats.live_bytes -= p.bytes;
    if (p.prefetched) stats.ahead_bytes -= p.bytes;
    p.prefetched = false;
    p.error = Status::Ok();
  }

  // Whether the trace uses `id` in one of the next kReuseModules modules. Caller holds mu.
  static constexpr size_t kReuseModules = 2;
  bool NextUseSoonLocked(ParamId id) {
    if (recording) return false;
    for (size_t i = pos; i < std::min(trace.size(), pos + kReuseModules); ++i) {
      const std::vector<ParamId>& list = modules[trace[i]];
      if (std::find(list.begin(), list.end(), id) != list.end()) return true;
    }
    return false;
  }

  // Prefetch along the trace from position `from`, within the budgets. Caller holds mu.
  void PrefetchLocked(size_t from) {
    for (size_t i = from; i < trace.size(); ++i) {
      for (ParamId id : modules[trace[i]]) {
        Param& p = params[id];
        if (p.resident || p.state != State::kHome) continue;
        if (stats.ahead_bytes + p.bytes > options.prefetch_bytes ||
            stats.live_bytes + p.bytes > options.max_live_bytes) {
          return;
        }
        EnqueueLocked(id, /*front=*/false, /*prefetch=*/true);
      }
    }
  }

  // The transfer thread: loads queued parameters one at a time.
  void Run() {
    for (;;) {
      ParamId id;
      {
        std::unique_lock<std::mutex> lock(mu);
        job_ready.wait(lock, [&] { return stop || !jobs.empty(); });
        if (stop) return;
        id = jobs.front();
        jobs.pop_front();
        params[id].state = State::kLoading;
        loading = true;
      }
      Param& p = params[id];  // fields other than state are only touched by this thread now
      void* device = nullptr;
      {
        std::lock_guard<std::mutex> lock(mu);
        auto it = free_device.find(p.bytes);
        if (it != free_device.end() && !it->second.empty()) {
          device = it->second.back();
          it->second.pop_back();
        }
      }
      Status status;
      if (device == nullptr) {
        auto allocated = options.runtime->AllocateDevice(p.bytes);
        if (allocated.ok()) {
          device = *allocated;
        } else {
          status = allocated.status();
        }
      }
      gpu::CopyTicket ticket;
      uint64_t read = 0;
      if (status.ok()) status = Load(p, device, &ticket, &read);
      {
        std::lock_guard<std::mutex> lock(mu);
        p.device = device;
        stats.nvme_read_bytes += read;
        if (status.ok()) {
          p.ticket = ticket;
          p.state = State::kReady;
          stats.h2d_bytes += p.bytes;
        } else {
          p.error = status.WithPrefix("fetching parameter " + p.name);
          p.state = State::kFailed;
        }
        loading = false;
      }
      job_done.notify_all();
    }
  }

  // Queues the copies that bring `p` to `device`.
  Status Load(const Param& p, void* device, gpu::CopyTicket* ticket, uint64_t* read) {
    gpu::Runtime& rt = *options.runtime;
    const uint64_t begin = p.flat * elem_bytes;
    if (options.tier == Tier::kCpu) {
      MEMPLAN_ASSIGN_OR_RETURN(*ticket, rt.CopyAsync(gpu::CopyDirection::kHostToDevice, device,
                                                     arena + begin, p.bytes));
      return Status::Ok();
    }
    // nvme: chunk by chunk, slot by slot; reading slice k+1 overlaps the upload of slice k.
    const uint64_t chunk_bytes = options.chunk_elements * elem_bytes;
    uint64_t done = 0;
    while (done < p.bytes) {
      const uint64_t at = begin + done;
      const uint64_t chunk = at / chunk_bytes;
      const uint64_t in_chunk = at - chunk * chunk_bytes;
      const size_t s = next_slot++ % slots.size();
      const uint64_t len = std::min<uint64_t>(
          {p.bytes - done, chunk_bytes - in_chunk, slots[s].data().size()});
      MEMPLAN_RETURN_IF_ERROR(rt.Wait(slot_ticket[s]));  // the slot's previous upload is done
      std::byte* staging = slots[s].data().data();
      MEMPLAN_RETURN_IF_ERROR(options.store->GetRange(ChunkKey(chunk), in_chunk,
                                                      std::span<std::byte>(staging, len)));
      *read += len;
      MEMPLAN_ASSIGN_OR_RETURN(
          slot_ticket[s], rt.CopyAsync(gpu::CopyDirection::kHostToDevice,
                                       static_cast<std::byte*>(device) + done, staging, len));
      *ticket = slot_ticket[s];
      done += len;
    }
    return Status::Ok();
  }
};

ParamSwapper::ParamSwapper(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ParamSwapper::~ParamSwapper() = default;

Result<std::unique_ptr<ParamSwapper>> ParamSwapper::Create(const ParamSwapperOptions& options) {
  MEMPLAN_RETURN_IF_ERROR(options.Validate());
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->elem_bytes = ElementBytes(options.dtype);
  return std::unique_ptr<ParamSwapper>(new ParamSwapper(std::move(impl)));
}

Result<ParamId> ParamSwapper::Add(const std::string& name, const std::string& module,
                                  uint64_t numel) {
  Impl& s = *impl_;
  if (s.finalized) return Status::FailedPrecondition("param swapper: Add() after Finalize()");
  if (numel == 0) return Status::InvalidArgument("parameter " + name + " has no elements");
  if (s.params.size() >= (uint64_t{1} << 31)) {
    return Status::ResourceExhausted("param swapper: too many parameters");
  }
  Impl::Param p;
  p.name = name;
  p.numel = numel;
  p.flat = s.flat_total;
  p.bytes = numel * s.elem_bytes;
  p.resident = s.options.tier == Tier::kGpu || numel <= s.options.persistence_threshold;
  s.flat_total += numel;
  const auto id = static_cast<ParamId>(s.params.size());
  s.params.push_back(std::move(p));
  s.modules[module].push_back(id);
  return id;
}

Status ParamSwapper::AddUse(ParamId param, const std::string& module) {
  Impl& s = *impl_;
  if (s.finalized) return Status::FailedPrecondition("param swapper: AddUse() after Finalize()");
  if (param >= s.params.size()) return Status::InvalidArgument("unknown parameter id");
  auto& list = s.modules[module];
  if (std::find(list.begin(), list.end(), param) == list.end()) list.push_back(param);
  return Status::Ok();
}

Status ParamSwapper::Finalize() {
  Impl& s = *impl_;
  if (s.finalized) return Status::FailedPrecondition("param swapper: Finalize() twice");
  gpu::Runtime& rt = *s.options.runtime;
  for (Impl::Param& p : s.params) {
    if (!p.resident) continue;
    MEMPLAN_ASSIGN_OR_RETURN(p.device, rt.AllocateDevice(p.bytes));
    p.state = State::kReady;
    s.stats.resident_bytes += p.bytes;
  }
  if (s.options.tier == Tier::kCpu && s.flat_total > 0) {
    s.arena_bytes = (s.flat_total * s.elem_bytes + 4095) / 4096 * 4096;
    void* mem = ::mmap(nullptr, s.arena_bytes, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED) {
      return Status::ResourceExhausted("param swapper: cannot allocate the " +
                                       std::to_string(s.arena_bytes) +
                                       "-byte pinned parameter arena");
    }
    s.arena = static_cast<std::byte*>(mem);
    MEMPLAN_RETURN_IF_ERROR(rt.RegisterHost(s.arena, s.arena_bytes));
    s.arena_registered = true;
    s.stats.pinned_bytes += s.arena_bytes;
  }
  if (s.options.tier == Tier::kNvme) {
    for (uint32_t i = 0; i < s.options.staging_slots; ++i) {
      MEMPLAN_ASSIGN_OR_RETURN(PinnedSlot slot, s.options.staging->Acquire());
      s.stats.pinned_bytes += slot.data().size();
      s.slots.push_back(std::move(slot));
      s.slot_ticket.emplace_back();
    }
  }
  s.worker = std::thread([&s] { s.Run(); });
  s.finalized = true;
  return Status::Ok();
}

uint64_t ParamSwapper::flat_elements() const { return impl_->flat_total; }
uint64_t ParamSwapper::FlatOffset(ParamId param) const { return impl_->params.at(param).flat; }
uint64_t ParamSwapper::Numel(ParamId param) const { return impl_->params.at(param).numel; }
size_t ParamSwapper::param_count() const { return impl_->params.size(); }

Status ParamSwapper::WriteHalf(uint64_t flat_begin, std::span<const uint16_t> values) {
  Impl& s = *impl_;
  if (!s.finalized) return Status::FailedPrecondition("param swapper: WriteHalf() before Finalize()");
  if (s.elem_bytes != 2) {
    return Status::Unimplemented("param swapper: fp32 working copies are not supported yet");
  }
  const uint64_t end = flat_begin + values.size();
  if (end > s.flat_total || end < flat_begin) {
    return Status::OutOfRange("param swapper: WriteHalf past the flat space");
  }
  gpu::Runtime& rt = *s.options.runtime;
  const auto* bytes = reinterpret_cast<const std::byte*>(values.data());
  if (s.options.tier == Tier::kCpu) {
    std::memcpy(s.arena + flat_begin * 2, bytes, values.size_bytes());
  } else if (s.options.tier == Tier::kNvme) {
    const uint64_t chunk = s.options.chunk_elements;
    if (flat_begin % chunk != 0 || (values.size() % chunk != 0 && end != s.flat_total)) {
      return Status::InvalidArgument("param swapper: WriteHalf to NVMe must cover whole chunks");
    }
    for (uint64_t at = flat_begin; at < end; at += chunk) {
      const uint64_t n = std::min(chunk, end - at);
      MEMPLAN_RETURN_IF_ERROR(s.options.store->Put(
          ChunkKey(at / chunk),
          std::span<const std::byte>(bytes + (at - flat_begin) * 2, n * 2)));
    }
    std::lock_guard<std::mutex> lock(s.mu);
    s.stats.nvme_write_bytes += values.size_bytes();
  }
  // Resident parameters overlapping the range get their GPU copy updated.
  gpu::CopyTicket last;
  uint64_t uploaded = 0;
  auto first = std::lower_bound(
      s.params.begin(), s.params.end(), flat_begin,
      [](const Impl::Param& p, uint64_t at) { return p.flat + p.numel <= at; });
  for (auto it = first; it != s.params.end() && it->flat < end; ++it) {
    if (!it->resident) continue;
    const uint64_t lo = std::max(it->flat, flat_begin);
    const uint64_t hi = std::min(it->flat + it->numel, end);
    MEMPLAN_ASSIGN_OR_RETURN(
        last, rt.CopyAsync(gpu::CopyDirection::kHostToDevice,
                           static_cast<std::byte*>(it->device) + (lo - it->flat) * 2,
                           bytes + (lo - flat_begin) * 2, (hi - lo) * 2));
    uploaded += (hi - lo) * 2;
  }
  MEMPLAN_RETURN_IF_ERROR(rt.Wait(last));  // `values` may be reused once we return
  std::lock_guard<std::mutex> lock(s.mu);
  s.stats.h2d_bytes += uploaded;
  return Status::Ok();
}

Status ParamSwapper::Fetch(std::string_view module) {
  Impl& s = *impl_;
  if (!s.finalized) return Status::FailedPrecondition("param swapper: Fetch() before Finalize()");
  auto mod = s.modules.find(std::string(module));
  if (mod == s.modules.end()) {
    return Status::NotFound("param swapper: no parameters registered for module " +
                            std::string(module));
  }
  const std::vector<ParamId>& ids = mod->second;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    ++s.stats.fetch_calls;
    if (s.recording) {
      s.trace.push_back(mod->first);
    } else if (s.pos < s.trace.size() && s.trace[s.pos] == mod->first) {
      ++s.pos;
    } else {
      ++s.stats.trace_invalidations;
      s.trace.resize(s.pos);
      s.trace.push_back(mod->first);
      s.recording = true;
    }
    for (ParamId id : ids) {
      Impl::Param& p = s.params[id];
      if (p.resident) continue;
      if (p.state == State::kHome) {
        s.EnqueueLocked(id, /*front=*/true, /*prefetch=*/false);
        ++s.stats.demand_fetches;
        if (s.stats.live_bytes > s.options.max_live_bytes) ++s.stats.over_budget_fetches;
      } else if (p.state == State::kQueued) {
        // Needed now: move it ahead of the prefetches.
        auto it = std::find(s.jobs.begin(), s.jobs.end(), id);
        if (it != s.jobs.end()) {
          s.jobs.erase(it);
          s.jobs.push_front(id);
        }
      }
    }
    if (!s.recording) s.PrefetchLocked(s.pos);
    s.stats.trace_length = s.trace.size();
    s.stats.trace_complete = !s.recording;
  }
  s.job_ready.notify_all();

  Status first_error;
  const auto start = std::chrono::steady_clock::now();
  for (ParamId id : ids) {
    Impl::Param& p = s.params[id];
    gpu::CopyTicket ticket;
    {
      std::unique_lock<std::mutex> lock(s.mu);
      ++p.uses;
      if (p.resident) continue;
      s.job_done.wait(lock, [&] { return p.state == State::kReady || p.state == State::kFailed; });
      if (p.state == State::kFailed) {
        if (first_error.ok()) first_error = p.error;
        --p.uses;
        s.ToHomeLocked(p);
        continue;
      }
      if (p.prefetched) {
        ++s.stats.prefetch_hits;
        s.stats.ahead_bytes -= p.bytes;
        p.prefetched = false;
      }
      ticket = p.ticket;
    }
    Status waited = s.options.runtime->Wait(ticket);
    if (!waited.ok() && first_error.ok()) first_error = waited.WithPrefix("fetching " + p.name);
  }
  const double stalled = SecondsSince(start);
  std::lock_guard<std::mutex> lock(s.mu);
  s.stats.stall_s += stalled;
  if (!first_error.ok()) {
    // Undo this call's uses so the caller need not Release a module that failed to arrive.
    for (ParamId id : ids) {
      Impl::Param& p = s.params[id];
      if (p.uses > 0 && p.state != State::kHome) {
        --p.uses;
        if (p.uses == 0 && !p.resident) s.ToHomeLocked(p);
      }
    }
  }
  return first_error;
}

Status ParamSwapper::Release(std::string_view module) {
  Impl& s = *impl_;
  auto mod = s.modules.find(std::string(module));
  if (mod == s.modules.end()) {
    return Status::NotFound("param swapper: no parameters registered for module " +
                            std::string(module));
  }
  std::lock_guard<std::mutex> lock(s.mu);
  for (ParamId id : mod->second) {
    Impl::Param& p = s.params[id];
    if (p.uses == 0) {
      return Status::FailedPrecondition("param swapper: module " + std::string(module) +
                                        " released more often than fetched (parameter " + p.name +
                                        ")");
    }
  }
  for (ParamId id : mod->second) {
    Impl::Param& p = s.params[id];
    --p.uses;
    if (p.uses > 0 || p.resident) continue;
    if (s.NextUseSoonLocked(id) && s.stats.ahead_bytes + p.bytes <= s.options.prefetch_bytes) {
      // Used again by one of the next modules (the forward/backward turn): keep it, counted as
      // fetched ahead, instead of reading it again.
      p.prefetched = true;
      s.stats.ahead_bytes += p.bytes;
      s.stats.peak_ahead_bytes = std::max(s.stats.peak_ahead_bytes, s.stats.ahead_bytes);
      ++s.stats.kept_for_reuse;
      continue;
    }
    s.ToHomeLocked(p);
  }
  return Status::Ok();
}

Result<void*> ParamSwapper::DevicePointer(ParamId param) const {
  const Impl& s = *impl_;
  if (param >= s.params.size()) return Status::InvalidArgument("unknown parameter id");
  std::lock_guard<std::mutex> lock(s.mu);
  const Impl::Param& p = s.params[param];
  if (p.resident || (p.state == State::kReady && p.uses > 0)) return p.device;
  return Status::FailedPrecondition("parameter " + p.name + " is not fetched");
}

Status ParamSwapper::EndOfStep() {
  Impl& s = *impl_;
  if (!s.finalized) return Status::Ok();
  std::vector<gpu::CopyTicket> pending;
  {
    std::unique_lock<std::mutex> lock(s.mu);
    // Drop prefetches not yet started, then wait for the one loading.
    for (ParamId id : s.jobs) s.ToHomeLocked(s.params[id]);
    s.stats.prefetch_wasted += s.jobs.size();
    s.jobs.clear();
    s.job_done.wait(lock, [&] { return !s.loading; });
    for (Impl::Param& p : s.params) {
      if (p.resident || p.uses > 0) continue;
      if (p.state == State::kReady || p.state == State::kFailed) {
        if (p.prefetched) ++s.stats.prefetch_wasted;
        if (p.state == State::kReady) pending.push_back(p.ticket);
        s.ToHomeLocked(p);
      }
    }
    if (s.recording) {
      s.recording = false;  // a whole step recorded: follow it from the next step
    } else if (s.pos != s.trace.size()) {
      ++s.stats.trace_invalidations;  // the step ended early: record the next one afresh
      s.trace.clear();
      s.recording = true;
    }
    s.pos = 0;
    if (s.recording) s.trace.clear();
    s.stats.trace_length = s.trace.size();
    s.stats.trace_complete = !s.recording;
  }
  // Memory freed above may still be the target of a copy: wait before anyone reuses it.
  for (const gpu::CopyTicket& t : pending) MEMPLAN_RETURN_IF_ERROR(s.options.runtime->Wait(t));
  return Status::Ok();
}

ParamSwapperStats ParamSwapper::stats() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->stats;
}

}  // namespace memplan::offload
