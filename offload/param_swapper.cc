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
//
// Note [Device memory of the swapper]
// Every buffer the swapper puts on the GPU is carved from one DeviceArena, allocated in
// Finalize(): the resident parameters, the gpu tier's shards and the resident pack, which are
// fixed, plus room for fetched parameters: max_live_bytes, two of the largest modules (a demand
// fetch may go over the budget while the module before is still held) and the largest parameter
// (fragmentation), but never more than all the parameters that are fetched at all. When a demand
// fetch finds no room, prefetched parameters not yet used are given back and the allocation is
// tried again; a prefetch finding no room is dropped. Only a module set held at once that is
// larger than the arena fails, with ResourceExhausted saying so.
//
// Note [Released buffers and the trainer's stream]
// Release(module, stream) is called when the trainer has *queued* its last kernels on the
// module's parameters, not when they have run (PyTorch's forward hook runs at launch). So a
// released buffer keeps a fence of the trainer's stream, and before the transfer thread hands
// released memory to a new load it makes the load's copy stream wait for those fences
// (cudaStreamWaitEvent: no thread waits). Buffers leave through `pending_free`: ToHomeLocked puts
// them there with their fences, and the transfer thread, before allocating, orders its lane after
// the fences and only then returns the buffers to the arena; copies of one lane run in order, so
// nothing queued later on the lane can touch that memory before the trainer is done with it. A
// parameter kept for reuse keeps its fences until it goes home.
//
// Note [Writes beside loads]
// The engine's overlapped optimizer writes a sub-group's updated working copies to the tier
// (Write(), on its own thread) while the trainer goes on fetching. The parameters it writes have
// had their gradients, so the trainer does not fetch them again in this step, but a load of them
// may still be in flight: a prefetch of the next step's first modules (PrefetchNextStep) that the
// trainer never used, its copy from the pinned arena or its NVMe read not yet done. Write() first
// drops the prefetches of its range not yet started and waits for the loads and copies of the
// others, so that no copy reads bytes being rewritten (and no NVMe read races the chunk's Put,
// which the store would refuse). A parameter of the range fetched after that would get the new
// values, as a fetch after Write() always did.
//
// Note [Re-gathering a kept parameter]
// A parameter kept for reuse after its Release() (Ordering, below) is all-gathered again in place
// by the next Fetch(), and the trainer's kernels of its last use, queued before that Release(),
// may not have run yet. The bytes written are the ones already there (nothing changes a gathered
// parameter within a step), but a write under a reader is still a race (the emulated GPU's
// ThreadSanitizer run found it), and the collective is not ordered after the trainer's streams:
// it runs on a stream of its own and returns when done. So the gather first waits on the host
// for the parameter's fences. The trainer's thread would block in the collective anyway; the
// cost is only the kernels queued on that module, as at the forward/backward turn.
//
// Note [ZeRO-3 partitions]
// With world size W > 1 a parameter of n elements is cut into W shards of s = ceil(n / W)
// elements, rank r owning elements [r * s, (r + 1) * s); past n they are padding, which the engine
// fills with zeros and whose gradients are zero, so the optimizer keeps them zero. A rank's
// partition is its shard of every parameter, in registration order: every rank's has the same
// size (sum of the s), and the tiers hold only that (the pinned arena, the NVMe chunks, the gpu
// tier's shard buffers), as does the engine's optimizer. Shards per parameter (as DeepSpeed cuts
// them) rather than one cut of the flat space make every gather an all-gather of equal counts:
// Load() puts this rank's shard in slot `rank` of a buffer of W * s elements and Fetch()
// all-gathers in place (send == recv + rank * s elements, which NCCL and the thread collective
// accept), leaving the parameter whole in the first n elements.
//
// Ordering. Every rank must issue the same collectives in the same order. The transfer thread's
// order depends on timing (a demand fetch jumps the queue, EndOfStep() drops prefetches not yet
// started), so it never calls the Collective: it only brings this rank's shard from the tier,
// prefetched along the trace as for world size 1. The gathers run in Fetch(), on the trainer's
// thread, in the module's parameter order, for every parameter but those another fetched module
// holds at that moment (whole since its Fetch(): `uses` counts the Fetch() calls not yet released,
// which only the trainer's calls change) and the resident ones. A parameter kept for reuse after
// its Release() is gathered again although it may still be whole: whether it is still there is
// not the trainer's calls' to decide (the transfer thread evicts unused ready parameters when a
// load finds no room, and when that happens depends on when the trainer's streams free memory),
// and a gather decided by it would differ between ranks, which then pair mismatched collectives
// (issue 31: a 2-rank Trainer with gradient checkpointing and evaluation aborted in gloo). Its
// shard is still in place, so only the all-gather is repeated, not the tier read. So the same
// calls on every rank give the same gathers. The cost is that a gather is not overlapped with
// compute as the tier read is; that would need a collective thread fed in call order. Resident
// (small) parameters are kept whole on every rank; their shards are written to a rank-major pack
// that GatherResident() all-gathers in one call and copies out. A failure on one rank (an NVMe
// error in a load) is returned there and not seen by the others, which then wait in their next
// collective (NCCL: until the communicator is aborted; the thread collective: until its timeout
// breaks the group): as with any DDP job, one rank's error ends it.
#include "offload/param_swapper.h"

#include <sys/mman.h>

#include "common/clock.h"
#include "common/mutex.h"
#include "offload/device_arena.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>
#include <thread>
#include <unordered_map>
#include <vector>

namespace memplan::offload {
namespace {

enum class State { kHome, kQueued, kLoading, kReady, kFailed };

std::string ChunkKey(uint64_t chunk) { return "hp." + std::to_string(chunk); }

}  // namespace

uint64_t ShardElements(uint64_t numel, int world_size) {
  const auto world = static_cast<uint64_t>(world_size < 1 ? 1 : world_size);
  return numel / world + (numel % world != 0 ? 1 : 0);
}

Status ParamSwapperOptions::Validate() const {
  if (runtime == nullptr) return Status::InvalidArgument("param swapper: no GPU runtime given");
  if (collective != nullptr) {
    const int world = collective->world_size(), rank = collective->rank();
    if (world < 1 || rank < 0 || rank >= world) {
      return Status::InvalidArgument("param swapper: collective has rank " + std::to_string(rank) +
                                     " of world size " + std::to_string(world));
    }
  }
  if (tier == Tier::kNvme) {
    if (store == nullptr)
      return Status::InvalidArgument("param swapper: nvme tier without a store");
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
    uint64_t flat = 0;        // offset in the flat space of all ranks
    uint64_t shard = 0;       // elements this rank owns (Note [ZeRO-3 partitions]); numel for 1
    uint64_t local = 0;       // offset of those in this rank's partition; flat for world size 1
    uint64_t bytes = 0;       // its GPU buffer: numel, or world_size * shard elements
    uint64_t load_bytes = 0;  // what a fetch brings from the tier: this rank's shard
    uint64_t pack = 0;        // resident, world size > 1: offset of its shard in the pack
    bool resident = false;
    void* device = nullptr;
    void* shard_device = nullptr;  // gpu tier, world size > 1: this rank's shard, for good
    bool gathered = false;         // world size > 1: `device` holds every rank's shard
    State state = State::kHome;
    bool prefetched = false;  // fetched ahead and not yet used by a Fetch()
    int uses = 0;             // Fetch() calls not yet Released
    bool wanted = false;      // a Fetch() waits for it (a prefetch then may not be dropped)
    gpu::CopyTicket ticket;
    Status error;
    // The trainer's streams at its Releases, the latest per stream (Note [Released buffers and
    // the trainer's stream]).
    std::vector<std::pair<void*, gpu::Fence>> fences;
  };

  struct PendingFree {
    void* device = nullptr;
    std::vector<std::pair<void*, gpu::Fence>> fences;
  };

  ParamSwapperOptions options;
  int elem_bytes = 2;
  int world = 1;  // the collective's world size and this rank
  int rank = 0;
  bool finalized = false;
  std::vector<Param> params;
  std::unordered_map<std::string, std::vector<ParamId>> modules;
  uint64_t flat_total = 0;
  uint64_t partition_total = 0;        // this rank's partition (flat_total for world size 1)
  std::vector<uint64_t> segment_ends;  // partition offsets where a Pad() gap starts

  // World size > 1: the resident parameters' shards, every rank's after GatherResident(), rank
  // major ([rank][resident parameter]); pack_elements per rank.
  void* pack_device = nullptr;
  uint64_t pack_elements = 0;

  std::byte* arena = nullptr;  // the cpu tier's pinned copy of this rank's partition
  uint64_t arena_bytes = 0;
  bool arena_registered = false;
  std::vector<PinnedSlot> slots;  // nvme staging; used by the transfer thread only
  std::vector<gpu::CopyTicket> slot_ticket;
  size_t next_slot = 0;

  mutable Mutex mu;
  CondVar job_ready;  // a job was queued, or stop
  CondVar job_done;   // a parameter left queued/loading
  std::deque<ParamId> jobs GUARDED_BY(mu);
  bool loading GUARDED_BY(mu) = false;  // the thread is working on a job
  bool stop GUARDED_BY(mu) = false;
  // Note [Device memory of the swapper].
  std::vector<PendingFree> pending_free GUARDED_BY(mu);
  std::unique_ptr<DeviceArena> device_arena;
  ParamSwapperStats stats GUARDED_BY(mu);
  std::thread worker;

  // Trace: used by the trainer's thread only.
  std::vector<std::string> trace;
  bool recording = true;
  size_t pos = 0;

  ~Impl() {
    {
      MutexLock lock(&mu);
      stop = true;
    }
    job_ready.SignalAll();
    if (worker.joinable()) worker.join();
    (void)options.runtime->Synchronize();
    for (PendingFree& f : pending_free) {
      for (const auto& [stream, fence] : f.fences) (void)options.runtime->WaitFenceOnHost(fence);
    }
    for (Param& p : params) {
      for (const auto& [stream, fence] : p.fences) (void)options.runtime->WaitFenceOnHost(fence);
    }
    pending_free.clear();
    device_arena.reset();  // every buffer above was carved from it
    slots.clear();
    if (arena != nullptr) {
      if (arena_registered) (void)options.runtime->UnregisterHost(arena);
      ::munmap(arena, arena_bytes);
    }
  }

  bool IsModuleKnown(std::string_view module) const {
    return modules.find(std::string(module)) != modules.end();
  }

  // Queues `id` (home) for the transfer thread.
  void EnqueueLocked(ParamId id, bool front, bool prefetch) REQUIRES(mu) {
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

  // The copy lane that loads parameters of this tier.
  gpu::CopyDirection LoadLane() const {
    return options.tier == Tier::kGpu ? gpu::CopyDirection::kDeviceToDevice
                                      : gpu::CopyDirection::kHostToDevice;
  }

  // Sends a parameter home; its GPU memory leaves through pending_free with the fences of the
  // trainer's releases (Note [Released buffers and the trainer's stream]).
  void ToHomeLocked(Param& p) REQUIRES(mu) {
    if (p.device != nullptr) pending_free.push_back({p.device, std::move(p.fences)});
    p.fences.clear();
    p.device = nullptr;
    p.wanted = false;
    p.state = State::kHome;
    stats.live_bytes -= p.bytes;
    if (p.prefetched) stats.ahead_bytes -= p.bytes;
    p.prefetched = false;
    p.gathered = false;
    p.error = Status::Ok();
  }

  // Whether the trace uses `id` in one of the next kReuseModules modules.
  static constexpr size_t kReuseModules = 2;
  bool NextUseSoonLocked(ParamId id) REQUIRES(mu) {
    if (recording) return false;
    for (size_t i = pos; i < std::min(trace.size(), pos + kReuseModules); ++i) {
      const std::vector<ParamId>& list = modules[trace[i]];
      if (std::find(list.begin(), list.end(), id) != list.end()) return true;
    }
    return false;
  }

  // Prefetch along the trace from position `from`, within the budgets.
  void PrefetchLocked(size_t from) REQUIRES(mu) {
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
        MutexLock lock(&mu);
        while (!stop && jobs.empty()) job_ready.Wait(&mu);
        if (stop) return;
        id = jobs.front();
        jobs.pop_front();
        params[id].state = State::kLoading;
        loading = true;
      }
      Param& p = params[id];  // fields other than state are only touched by this thread now
      void* device = nullptr;
      Status status;
      bool dropped = false;
      for (;;) {
        status = AllocateFor(id, &device);
        if (device != nullptr || !status.ok()) break;
        // A prefetch that found no room is given up, quietly (Note [Device memory of the
        // swapper]), unless a Fetch() has come to want it meanwhile: then it is a demand fetch.
        MutexLock lock(&mu);
        if (p.wanted) continue;
        ToHomeLocked(p);
        ++stats.prefetch_wasted;
        loading = false;
        dropped = true;
        break;
      }
      if (dropped) {
        job_done.SignalAll();
        continue;
      }
      gpu::CopyTicket ticket;
      uint64_t read = 0;
      if (status.ok()) status = Load(p, device, &ticket, &read);
      {
        MutexLock lock(&mu);
        p.device = device;
        stats.nvme_read_bytes += read;
        if (status.ok()) {
          p.ticket = ticket;
          p.state = State::kReady;
          if (options.tier != Tier::kGpu) stats.h2d_bytes += p.load_bytes;
        } else {
          p.error = status.WithPrefix("fetching parameter " + p.name);
          p.state = State::kFailed;
        }
        loading = false;
      }
      job_done.SignalAll();
    }
  }

  // Returns the buffers of pending_free to the arena, after ordering the load lane after their
  // fences (Note [Released buffers and the trainer's stream]). The transfer thread's, and
  // Finalize's.
  Status FlushPendingFrees() EXCLUDES(mu) {
    std::vector<PendingFree> freed;
    {
      MutexLock lock(&mu);
      freed.swap(pending_free);
    }
    Status first;
    for (PendingFree& f : freed) {
      for (const auto& [stream, fence] : f.fences) {
        Status waited = options.runtime->WaitFence(LoadLane(), fence);
        if (first.ok() && !waited.ok()) first = waited;
      }
      Status freed_one = device_arena->Free(f.device);
      if (first.ok() && !freed_one.ok()) first = freed_one;
    }
    return first;
  }

  // A buffer for parameter `id` from the arena (Note [Device memory of the swapper]). A prefetch
  // that finds no room gets *device == nullptr and OK; a wanted parameter evicts unused prefetches
  // and tries again.
  Status AllocateFor(ParamId id, void** device) {
    const Param& p = params[id];
    for (;;) {
      MEMPLAN_RETURN_IF_ERROR(FlushPendingFrees());
      Result<void*> allocated = device_arena->Allocate(p.bytes);
      if (allocated.ok()) {
        *device = *allocated;
        return Status::Ok();
      }
      MutexLock lock(&mu);
      if (!p.wanted) return Status::Ok();
      bool evicted = false;
      for (ParamId q = 0; q < params.size(); ++q) {
        Param& other = params[q];
        // Not a parameter a Fetch() is waiting for (`wanted`): only prefetches nobody uses yet.
        if (q == id || other.resident || other.uses > 0 || other.wanted ||
            other.state != State::kReady) {
          continue;
        }
        if (other.prefetched) ++stats.prefetch_wasted;
        ToHomeLocked(other);
        ++stats.arena_evictions;
        evicted = true;
      }
      if (!evicted) {
        return allocated.status().WithPrefix(
            "param swapper: the parameters fetched at once outgrow the GPU memory reserved for "
            "them (raise params.max_live_bytes)");
      }
    }
  }

  // The arena's size (Note [Device memory of the swapper]): what Finalize carves for good, plus
  // the room for fetched parameters.
  uint64_t ArenaBytes() const {
    uint64_t fixed = 0, fetchable = 0, largest = 0;
    std::unordered_map<std::string, uint64_t> module_bytes;
    for (const Param& p : params) {
      if (p.resident) {
        fixed += DeviceArena::Rounded(p.bytes);
      } else {
        fetchable += DeviceArena::Rounded(p.bytes);
        largest = std::max(largest, DeviceArena::Rounded(p.bytes));
        if (world > 1 && options.tier == Tier::kGpu) fixed += DeviceArena::Rounded(p.load_bytes);
      }
    }
    uint64_t largest_module = 0;
    for (const auto& [name, ids] : modules) {
      uint64_t bytes = 0;
      for (ParamId id : ids) {
        if (!params[id].resident) bytes += DeviceArena::Rounded(params[id].bytes);
      }
      largest_module = std::max(largest_module, bytes);
    }
    if (pack_elements > 0) {
      fixed += DeviceArena::Rounded(pack_elements * static_cast<uint64_t>(world) *
                                    static_cast<uint64_t>(elem_bytes));
    }
    const uint64_t room = options.max_live_bytes + 2 * largest_module + largest;
    return fixed + std::min(fetchable, room);
  }

  // Queues the copies that bring this rank's part of `p` (all of it for world size 1) from the tier
  // to its place in `device`: slot `rank` of the gathered buffer.
  Status Load(const Param& p, void* device, gpu::CopyTicket* ticket, uint64_t* read) {
    gpu::Runtime& rt = *options.runtime;
    const uint64_t eb = static_cast<uint64_t>(elem_bytes);
    std::byte* dst = static_cast<std::byte*>(device) + static_cast<uint64_t>(rank) * p.shard * eb;
    const uint64_t begin = p.local * eb;
    if (options.tier == Tier::kGpu) {  // world size > 1: the shard is on the GPU already
      MEMPLAN_ASSIGN_OR_RETURN(*ticket, rt.CopyAsync(gpu::CopyDirection::kDeviceToDevice, dst,
                                                     p.shard_device, p.load_bytes));
      return Status::Ok();
    }
    if (options.tier == Tier::kCpu) {
      MEMPLAN_ASSIGN_OR_RETURN(*ticket, rt.CopyAsync(gpu::CopyDirection::kHostToDevice, dst,
                                                     arena + begin, p.load_bytes));
      return Status::Ok();
    }
    // nvme: chunk by chunk, slot by slot; reading slice k+1 overlaps the upload of slice k. A
    // parameter rarely starts or ends on a checksum block: the blocks it touches are read whole
    // into the slot (aligned: no bounce copies) and the upload starts inside it, so the bytes are
    // copied once, by the upload.
    const uint64_t chunk_bytes = options.chunk_elements * eb;
    uint64_t done = 0;
    while (done < p.load_bytes) {
      const uint64_t at = begin + done;
      const uint64_t chunk = at / chunk_bytes;
      const uint64_t in_chunk = at - chunk * chunk_bytes;
      const size_t s = next_slot++ % slots.size();
      const std::span<std::byte> slot = slots[s].data();
      uint64_t len = std::min<uint64_t>(p.load_bytes - done, chunk_bytes - in_chunk);
      MEMPLAN_RETURN_IF_ERROR(rt.Wait(slot_ticket[s]));  // the slot's previous upload is done
      MEMPLAN_ASSIGN_OR_RETURN(const nvme::SwapStore::CoveredRange got,
                               options.store->GetCovering(ChunkKey(chunk), in_chunk, len, slot));
      const std::byte* staging = slot.data() + got.in_buffer;
      if (got.bytes > 0) {
        len = got.bytes;
      } else {  // a slot smaller than a checksum block
        len = std::min<uint64_t>(len, slot.size());
        MEMPLAN_RETURN_IF_ERROR(
            options.store->GetRange(ChunkKey(chunk), in_chunk, slot.first(len)));
        staging = slot.data();
      }
      *read += len;
      MEMPLAN_ASSIGN_OR_RETURN(slot_ticket[s], rt.CopyAsync(gpu::CopyDirection::kHostToDevice,
                                                            dst + done, staging, len));
      *ticket = slot_ticket[s];
      done += len;
    }
    return Status::Ok();
  }

  // Before partition elements [begin, end) of the tier are rewritten: no load may still read them
  // (Note [Writes beside loads]). Prefetches of those parameters not yet started are dropped, the
  // one loading is waited for, and so are the copies of those loaded.
  Status QuiesceLoads(uint64_t begin, uint64_t end) {
    std::vector<gpu::CopyTicket> copies;
    {
      MutexLock lock(&mu);
      auto overlapping = [&](auto&& fn) REQUIRES(mu) {
        for (auto it = FirstOverlapping(begin); it != params.end() && it->local < end; ++it) {
          if (!it->resident) fn(*it, static_cast<ParamId>(it - params.begin()));
        }
      };
      overlapping([&](Param& p, ParamId id) REQUIRES(mu) {
        if (p.state != State::kQueued || p.wanted) return;
        jobs.erase(std::remove(jobs.begin(), jobs.end(), id), jobs.end());
        ToHomeLocked(p);
        ++stats.prefetch_wasted;
      });
      for (;;) {
        bool busy = false;
        overlapping([&](Param& p, ParamId) {
          busy = busy || p.state == State::kQueued || p.state == State::kLoading;
        });
        if (!busy) break;
        job_done.Wait(&mu);
      }
      overlapping([&](Param& p, ParamId) {
        if (p.state == State::kReady) copies.push_back(p.ticket);
      });
    }
    for (const gpu::CopyTicket& t : copies) MEMPLAN_RETURN_IF_ERROR(options.runtime->Wait(t));
    return Status::Ok();
  }

  // --- Fetch()'s pieces ---

  // Fetch()'s request of `module`'s parameters `ids`: the trace followed (or, where the call
  // departs from it, cut there and recorded again), the parameters at home queued ahead of the
  // prefetches, those queued for a prefetch moved ahead of the others, and, while following the
  // trace, the prefetches after this call queued.
  void RequestLocked(const std::string& module, const std::vector<ParamId>& ids) REQUIRES(mu) {
    ++stats.fetch_calls;
    if (recording) {
      trace.push_back(module);
    } else if (pos < trace.size() && trace[pos] == module) {
      ++pos;
    } else {
      ++stats.trace_invalidations;
      trace.resize(pos);
      trace.push_back(module);
      recording = true;
    }
    for (ParamId id : ids) {
      Param& p = params[id];
      if (p.resident) continue;
      p.wanted = true;
      if (p.state == State::kHome) {
        EnqueueLocked(id, /*front=*/true, /*prefetch=*/false);
        ++stats.demand_fetches;
        if (stats.live_bytes > options.max_live_bytes) ++stats.over_budget_fetches;
      } else if (p.state == State::kQueued) {
        // Needed now: move it ahead of the prefetches.
        auto it = std::find(jobs.begin(), jobs.end(), id);
        if (it != jobs.end()) {
          jobs.erase(it);
          jobs.push_front(id);
        }
      }
    }
    if (!recording) PrefetchLocked(pos);
    stats.trace_length = trace.size();
    stats.trace_complete = !recording;
  }

  // Takes a use of each of `ids` and waits for its load and its copy to the GPU. A parameter whose
  // load failed goes back home, its use given back, and the waiting goes on; the first error is
  // returned.
  Status AwaitLoads(const std::vector<ParamId>& ids) EXCLUDES(mu) {
    Status first_error;
    for (ParamId id : ids) {
      Param& p = params[id];
      gpu::CopyTicket ticket;
      {
        MutexLock lock(&mu);
        ++p.uses;
        if (p.resident) continue;
        while (p.state != State::kReady && p.state != State::kFailed) job_done.Wait(&mu);
        if (p.state == State::kFailed) {
          if (first_error.ok()) first_error = p.error;
          --p.uses;
          ToHomeLocked(p);
          continue;
        }
        if (p.prefetched) {
          ++stats.prefetch_hits;
          stats.ahead_bytes -= p.bytes;
          p.prefetched = false;
        }
        ticket = p.ticket;
      }
      Status waited = options.runtime->Wait(ticket);
      if (!waited.ok() && first_error.ok()) first_error = waited.WithPrefix("fetching " + p.name);
    }
    return first_error;
  }

  // World size > 1: every rank's shard of each of `ids` into its buffer, in the module's parameter
  // order, which is the same on every rank (Note [ZeRO-3 partitions]). Skipped: the resident ones
  // and those an earlier Fetch() still holds (this Fetch() counted in `uses` already), which are
  // whole; nothing else, whatever `gathered` says (Ordering, above). The first error ends it.
  Status GatherShards(const std::vector<ParamId>& ids) EXCLUDES(mu) {
    const auto eb = static_cast<uint64_t>(elem_bytes);
    for (ParamId id : ids) {
      Param& p = params[id];
      std::byte* device = nullptr;
      std::vector<gpu::Fence> fences;
      {
        MutexLock lock(&mu);
        if (p.resident || (p.gathered && p.uses > 1)) continue;
        device = static_cast<std::byte*>(p.device);
        for (const auto& [stream, fence] : p.fences) fences.push_back(fence);
      }
      // A parameter kept for reuse is gathered again in place while the trainer's kernels of its
      // last use may still be reading it (Note [Re-gathering a kept parameter]).
      for (const gpu::Fence& fence : fences) {
        Status waited = options.runtime->WaitFenceOnHost(fence);
        if (!waited.ok()) return waited.WithPrefix("gathering parameter " + p.name);
      }
      Status gathered = options.collective->AllGather(
          device + static_cast<uint64_t>(rank) * p.shard * eb, device, p.shard, options.dtype);
      if (!gathered.ok()) return gathered.WithPrefix("gathering parameter " + p.name);
      MutexLock lock(&mu);
      p.gathered = true;
      stats.allgather_bytes += p.bytes;
    }
    return Status::Ok();
  }

  // Gives back the uses a failed Fetch() took of `ids`, so the caller need not Release a module
  // that failed to arrive; a parameter left without uses goes home.
  void UndoUsesLocked(const std::vector<ParamId>& ids) REQUIRES(mu) {
    for (ParamId id : ids) {
      Param& p = params[id];
      if (p.uses > 0 && p.state != State::kHome) {
        --p.uses;
        if (p.uses == 0 && !p.resident) ToHomeLocked(p);
      }
    }
  }

  // The first parameter whose shard ends after partition element `begin`.
  std::vector<Param>::iterator FirstOverlapping(uint64_t begin) {
    return std::lower_bound(params.begin(), params.end(), begin,
                            [](const Param& p, uint64_t at) { return p.local + p.shard <= at; });
  }
};

ParamSwapper::ParamSwapper(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ParamSwapper::~ParamSwapper() = default;

Result<std::unique_ptr<ParamSwapper>> ParamSwapper::Create(const ParamSwapperOptions& options) {
  MEMPLAN_RETURN_IF_ERROR(options.Validate());
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->elem_bytes = ElementBytes(options.dtype);
  if (options.collective != nullptr) {
    impl->world = options.collective->world_size();
    impl->rank = options.collective->rank();
  }
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
  const auto eb = static_cast<uint64_t>(s.elem_bytes);
  Impl::Param p;
  p.name = name;
  p.numel = numel;
  p.flat = s.flat_total;
  p.shard = ShardElements(numel, s.world);
  p.local = s.partition_total;
  p.bytes = (s.world == 1 ? numel : p.shard * static_cast<uint64_t>(s.world)) * eb;
  p.load_bytes = p.shard * eb;
  // World size 1 keeps every parameter of the gpu tier there; with more ranks the gpu tier holds
  // this rank's shards and only small parameters are kept whole (Note [ZeRO-3 partitions]).
  p.resident =
      (s.world == 1 && s.options.tier == Tier::kGpu) || numel <= s.options.persistence_threshold;
  s.flat_total += numel;
  s.partition_total += p.shard;
  const auto id = static_cast<ParamId>(s.params.size());
  s.params.push_back(std::move(p));
  s.modules[module].push_back(id);
  return id;
}

Status ParamSwapper::Pad(uint64_t elements) {
  Impl& s = *impl_;
  if (s.finalized) return Status::FailedPrecondition("param swapper: Pad() after Finalize()");
  s.segment_ends.push_back(s.partition_total);
  s.partition_total += elements;
  if (s.world == 1) s.flat_total += elements;  // the flat space is the partition
  return Status::Ok();
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
  const auto eb = static_cast<uint64_t>(s.elem_bytes);
  for (Impl::Param& p : s.params) {
    if (p.resident && s.world > 1) {
      p.pack = s.pack_elements;
      s.pack_elements += p.shard;
    }
  }
  if (!s.params.empty()) {
    MEMPLAN_ASSIGN_OR_RETURN(s.device_arena, DeviceArena::Create(&rt, s.ArenaBytes()));
  }
  // The transfer thread has not started, so no one waits for mu here: it is taken for `stats`,
  // which stats() may read from another thread. Only the arena is called under it, not the runtime.
  MutexLock stats_lock(&s.mu);
  for (Impl::Param& p : s.params) {
    if (p.resident) {
      MEMPLAN_ASSIGN_OR_RETURN(p.device, s.device_arena->Allocate(p.bytes));
      p.state = State::kReady;
      p.gathered = true;
      s.stats.resident_bytes += p.bytes;
    } else if (s.world > 1 && s.options.tier == Tier::kGpu) {
      MEMPLAN_ASSIGN_OR_RETURN(p.shard_device, s.device_arena->Allocate(p.load_bytes));
      s.stats.resident_bytes += p.load_bytes;
    }
  }
  if (s.pack_elements > 0) {
    const uint64_t bytes = s.pack_elements * static_cast<uint64_t>(s.world) * eb;
    MEMPLAN_ASSIGN_OR_RETURN(s.pack_device, s.device_arena->Allocate(bytes));
    s.stats.resident_bytes += bytes;
  }
  if (s.device_arena) s.stats.device_arena_bytes = s.device_arena->stats().capacity_bytes;
  stats_lock.Unlock();
  if (s.options.tier == Tier::kCpu && s.partition_total > 0) {
    s.arena_bytes = (s.partition_total * eb + 4095) / 4096 * 4096;
    void* mem =
        ::mmap(nullptr, s.arena_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED) {
      return Status::ResourceExhausted("param swapper: cannot allocate the " +
                                       std::to_string(s.arena_bytes) +
                                       "-byte pinned parameter arena");
    }
    s.arena = static_cast<std::byte*>(mem);
    // Not inherited by a fork (a DataLoader worker): see Note [Pinned memory and fork] in
    // pinned_pool.cc.
    (void)::madvise(s.arena, s.arena_bytes, MADV_DONTFORK);
    MEMPLAN_RETURN_IF_ERROR(rt.RegisterHost(s.arena, s.arena_bytes));
    s.arena_registered = true;
    MutexLock lock(&s.mu);
    s.stats.pinned_bytes += s.arena_bytes;
  }
  if (s.options.tier == Tier::kNvme) {
    for (uint32_t i = 0; i < s.options.staging_slots; ++i) {
      MEMPLAN_ASSIGN_OR_RETURN(PinnedSlot slot, s.options.staging->Acquire());
      {
        MutexLock lock(&s.mu);
        s.stats.pinned_bytes += slot.data().size();
      }
      s.slots.push_back(std::move(slot));
      s.slot_ticket.emplace_back();
    }
  }
  s.worker = std::thread([&s] { s.Run(); });
  s.finalized = true;
  return Status::Ok();
}

uint64_t ParamSwapper::flat_elements() const { return impl_->flat_total; }
uint64_t ParamSwapper::partition_elements() const { return impl_->partition_total; }
int ParamSwapper::world_size() const { return impl_->world; }
int ParamSwapper::rank() const { return impl_->rank; }
uint64_t ParamSwapper::PartitionOffset(ParamId param) const {
  return impl_->params.at(param).local;
}
uint64_t ParamSwapper::ShardSize(ParamId param) const { return impl_->params.at(param).shard; }
uint64_t ParamSwapper::FlatOffset(ParamId param) const { return impl_->params.at(param).flat; }
uint64_t ParamSwapper::Numel(ParamId param) const { return impl_->params.at(param).numel; }
size_t ParamSwapper::param_count() const { return impl_->params.size(); }

Status ParamSwapper::WriteHalf(uint64_t flat_begin, std::span<const uint16_t> values) {
  if (impl_->elem_bytes != 2) {
    return Status::InvalidArgument("param swapper: WriteHalf() on " +
                                   std::string(ElementTypeName(impl_->options.dtype)) +
                                   " working copies; use Write()");
  }
  return Write(flat_begin, std::as_bytes(values));
}

Status ParamSwapper::WriteFloat(uint64_t flat_begin, std::span<const float> values) {
  if (impl_->elem_bytes != 4) {
    return Status::InvalidArgument("param swapper: WriteFloat() on " +
                                   std::string(ElementTypeName(impl_->options.dtype)) +
                                   " working copies; use Write()");
  }
  return Write(flat_begin, std::as_bytes(values));
}

Status ParamSwapper::Write(uint64_t flat_begin, std::span<const std::byte> values) {
  Impl& s = *impl_;
  if (!s.finalized) return Status::FailedPrecondition("param swapper: Write() before Finalize()");
  const uint64_t eb = static_cast<uint64_t>(s.elem_bytes);
  if (values.size() % eb != 0) {
    return Status::InvalidArgument("param swapper: Write() of " + std::to_string(values.size()) +
                                   " bytes, not a whole number of " +
                                   std::string(ElementTypeName(s.options.dtype)) + " elements");
  }
  const uint64_t count = values.size() / eb;
  const uint64_t end = flat_begin + count;
  if (end > s.partition_total || end < flat_begin) {
    return Status::OutOfRange("param swapper: Write() past the partition");
  }
  gpu::Runtime& rt = *s.options.runtime;
  const std::byte* bytes = values.data();
  if (s.options.tier != Tier::kGpu) MEMPLAN_RETURN_IF_ERROR(s.QuiesceLoads(flat_begin, end));
  if (s.options.tier == Tier::kCpu) {
    std::memcpy(s.arena + flat_begin * eb, bytes, values.size());
  } else if (s.options.tier == Tier::kNvme) {
    const uint64_t chunk = s.options.chunk_elements;
    const bool segment_end =
        end == s.partition_total ||
        std::find(s.segment_ends.begin(), s.segment_ends.end(), end) != s.segment_ends.end();
    if (flat_begin % chunk != 0 || (count % chunk != 0 && !segment_end)) {
      return Status::InvalidArgument("param swapper: Write() to NVMe must cover whole chunks");
    }
    for (uint64_t at = flat_begin; at < end; at += chunk) {
      const uint64_t n = std::min(chunk, end - at);
      MEMPLAN_RETURN_IF_ERROR(s.options.store->Put(ChunkKey(at / chunk),
                                                   values.subspan((at - flat_begin) * eb, n * eb)));
    }
    MutexLock lock(&s.mu);
    s.stats.nvme_write_bytes += values.size();
  }
  // What lives on the GPU for good gets its copy updated: resident parameters (world size > 1:
  // their shard in the pack, gathered by GatherResident()) and the gpu tier's shards.
  gpu::CopyTicket last;
  uint64_t uploaded = 0;
  for (auto it = s.FirstOverlapping(flat_begin); it != s.params.end() && it->local < end; ++it) {
    std::byte* base = nullptr;
    if (it->resident) {
      base = s.world == 1 ? static_cast<std::byte*>(it->device)
                          : static_cast<std::byte*>(s.pack_device) +
                                (static_cast<uint64_t>(s.rank) * s.pack_elements + it->pack) * eb;
    } else if (it->shard_device != nullptr) {
      base = static_cast<std::byte*>(it->shard_device);
    } else {
      continue;
    }
    const uint64_t lo = std::max(it->local, flat_begin);
    const uint64_t hi = std::min(it->local + it->shard, end);
    MEMPLAN_ASSIGN_OR_RETURN(
        last, rt.CopyAsync(gpu::CopyDirection::kHostToDevice, base + (lo - it->local) * eb,
                           bytes + (lo - flat_begin) * eb, (hi - lo) * eb));
    uploaded += (hi - lo) * eb;
  }
  MEMPLAN_RETURN_IF_ERROR(rt.Wait(last));  // `values` may be reused once we return
  MutexLock lock(&s.mu);
  s.stats.h2d_bytes += uploaded;
  return Status::Ok();
}

Status ParamSwapper::GatherResident() {
  Impl& s = *impl_;
  if (!s.finalized) {
    return Status::FailedPrecondition("param swapper: GatherResident() before Finalize()");
  }
  if (s.world == 1 || s.pack_elements == 0) return Status::Ok();
  gpu::Runtime& rt = *s.options.runtime;
  const auto eb = static_cast<uint64_t>(s.elem_bytes);
  const uint64_t slot_bytes = s.pack_elements * eb;
  auto* pack = static_cast<std::byte*>(s.pack_device);
  MEMPLAN_RETURN_IF_ERROR(s.options.collective
                              ->AllGather(pack + static_cast<uint64_t>(s.rank) * slot_bytes, pack,
                                          s.pack_elements, s.options.dtype)
                              .WithPrefix("param swapper: gathering the resident parameters"));
  // [rank][parameter] -> each parameter's [rank] slots.
  gpu::CopyTicket last;
  for (const Impl::Param& p : s.params) {
    if (!p.resident) continue;
    for (int r = 0; r < s.world; ++r) {
      const auto q = static_cast<uint64_t>(r);
      MEMPLAN_ASSIGN_OR_RETURN(last,
                               rt.CopyAsync(gpu::CopyDirection::kDeviceToDevice,
                                            static_cast<std::byte*>(p.device) + q * p.shard * eb,
                                            pack + q * slot_bytes + p.pack * eb, p.shard * eb));
    }
  }
  MEMPLAN_RETURN_IF_ERROR(rt.Wait(last));
  MutexLock lock(&s.mu);
  s.stats.allgather_bytes += slot_bytes * static_cast<uint64_t>(s.world);
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
    MutexLock lock(&s.mu);
    s.RequestLocked(mod->first, ids);
  }
  s.job_ready.SignalAll();
  const auto start = std::chrono::steady_clock::now();
  Status first_error = s.AwaitLoads(ids);
  // A rank whose load failed gathers nothing: its peers are then left waiting in the collective,
  // as with any failure of one rank.
  if (s.world > 1 && first_error.ok()) first_error = s.GatherShards(ids);
  const double stalled = SecondsSince(start);
  MutexLock lock(&s.mu);
  s.stats.stall_s += stalled;
  if (!first_error.ok()) s.UndoUsesLocked(ids);
  return first_error;
}

Status ParamSwapper::Release(std::string_view module, gpu::Stream stream) {
  Impl& s = *impl_;
  auto mod = s.modules.find(std::string(module));
  if (mod == s.modules.end()) {
    return Status::NotFound("param swapper: no parameters registered for module " +
                            std::string(module));
  }
  // Where the trainer's kernels on these parameters were queued (Note [Released buffers and the
  // trainer's stream]); recorded before taking the lock, as every runtime call.
  MEMPLAN_ASSIGN_OR_RETURN(gpu::Fence fence, s.options.runtime->RecordFence(stream));
  MutexLock lock(&s.mu);
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
    if (p.resident) continue;
    if (!fence.empty()) {
      auto same = std::find_if(p.fences.begin(), p.fences.end(),
                               [&](const auto& f) { return f.first == stream.handle; });
      if (same != p.fences.end()) {
        same->second = fence;  // later on the same stream: implies the earlier one
      } else {
        p.fences.emplace_back(stream.handle, fence);
      }
    }
    if (p.uses > 0) continue;
    p.wanted = false;
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
  MutexLock lock(&s.mu);
  const Impl::Param& p = s.params[param];
  if (p.resident || (p.state == State::kReady && p.uses > 0)) return p.device;
  return Status::FailedPrecondition("parameter " + p.name + " is not fetched");
}

Status ParamSwapper::EndOfStep() {
  Impl& s = *impl_;
  if (!s.finalized) return Status::Ok();
  std::vector<gpu::CopyTicket> pending;
  {
    MutexLock lock(&s.mu);
    // Drop prefetches not yet started, then wait for the one loading.
    for (ParamId id : s.jobs) s.ToHomeLocked(s.params[id]);
    s.stats.prefetch_wasted += s.jobs.size();
    s.jobs.clear();
    while (s.loading) s.job_done.Wait(&s.mu);
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

Status ParamSwapper::PrefetchNextStep() {
  Impl& s = *impl_;
  if (!s.finalized) return Status::Ok();
  {
    MutexLock lock(&s.mu);
    if (s.recording || s.pos != 0 || s.trace.empty()) return Status::Ok();
    s.PrefetchLocked(0);
  }
  s.job_ready.SignalAll();
  return Status::Ok();
}

ParamSwapperStats ParamSwapper::stats() const {
  ParamSwapperStats out;
  {
    MutexLock lock(&impl_->mu);
    out = impl_->stats;
  }
  if (impl_->device_arena)
    out.device_arena_peak_bytes = impl_->device_arena->stats().peak_in_use_bytes;
  return out;
}

}  // namespace memplan::offload
