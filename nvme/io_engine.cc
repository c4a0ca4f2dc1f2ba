#include "nvme/io_engine.h"

#include <algorithm>
#include <cassert>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <limits>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/checked_math.h"
#include "common/mutex.h"

namespace memplan::nvme {

// Note [IoEngine transfers]
//
// One Read/Write/Sync call is a Transfer. Its thread plans the byte range into pieces, keeps up to
// the backend's queue depth of them in flight, and handles each piece's completion itself
// (short-transfer remainders, retries, bounce copies, errors). Pieces live in Slots: a Transfer
// has one Slot per queue entry, and a Request's user_data points at its Slot, which points at its
// Transfer.
//
// Reaping. Several threads may run transfers on one engine, and a completion reaped by one may
// belong to another. One thread at a time holds the reaper role (Impl::reaping_): it calls
// Backend::Reap without the engine lock, then, under the lock, pushes each completion onto its
// owner's done list and wakes the waiters. A thread waiting for its completions either takes the
// role (when free) or sleeps on the condition variable. Threads therefore never block each other
// inside Reap, and whoever reaps routes for everyone. A single condition variable with
// notify_all keeps this obviously free of lost wake-ups; there are few threads per engine and one
// wake-up per reaped batch, not per byte.
//
// Busy. When the backend takes fewer requests than offered and this transfer has nothing of its
// own in flight (other threads fill the queue), the thread waits for any reap at all (the
// engine's reap epoch moving) and offers again.
//
// Failure. The first error of a transfer stops it from submitting; it then waits for every piece
// it still has in flight before returning, so no request referencing the caller's buffer
// outlives the call. The one exception is a backend whose Reap() itself fails: it cannot say
// what is still in flight, so the engine reports its error to every waiting transfer and refuses
// further I/O (FailedPrecondition) rather than hang.
//
// Alignment. For a direct (O_DIRECT) file of alignment A, the range [offset, offset + length) is
// planned as up to three segments: the unaligned head block and tail block go through bounce
// buffers (read-modify-write for writes: the block is read, the caller's bytes merged in, the
// whole block written), and the aligned middle goes straight to or from the caller's buffer
// when the buffer is aligned where the middle starts; otherwise the middle goes through bounce
// buffers too, in block-size pieces (no read needed: those pieces are fully covered). A fully
// aligned transfer thus copies nothing. Consequences: a direct write whose end is unaligned and
// beyond the end of the file extends the file with zeros to the next alignment boundary, and two
// concurrent unaligned writes that share an alignment block must be serialised by the caller.
//
// Allocation. Transfers (with their slots, queues and lazily allocated bounce buffers) are pooled
// by the engine, so a steady stream of transfers allocates nothing.

// Note [Parallel slices]
// With options.threads T > 1 a Read/Write of L bytes (L of at least two blocks) is cut into
// n = min(T, ceil(L / block_size)) slices of about L / n bytes. Cut points are file offsets rounded
// down to the file's alignment, so each slice is an ordinary transfer (its own head/tail bounce
// and read-modify-write when the call is unaligned) and no two slices share an alignment block;
// the bytes each thread moves are therefore exactly those of the call, as with T = 1.
//
// Lanes. Each backend the engine was given is a Lane: its routing state (the reaper role, the
// reap epoch, the broken flag; Note [IoEngine transfers]) and its pool of transfers. The calling
// thread runs its slices on lane 0 and worker w on lane (w + 1) % lanes, so with T backends every
// thread has its own io_uring ring or libaio context, as DeepSpeed gives every thread its own
// context; with fewer backends some threads share one, which the routing above already handles.
//
// Hand-off. A split call is a Job on the caller's stack: the caller queues it once per extra slice
// for the T - 1 workers, then claims slices (an atomic counter) and runs them itself until none
// is left; a worker that pops the job claims from the same counter. So a slice never waits for a
// busy worker: when the workers are taken (another caller's slices), the caller runs its own
// slices one after another, as with T = 1. Before returning, the caller takes its job's
// unconsumed queue entries back and waits for the workers that popped one (`holders`) to let go,
// so no worker touches the job after the call returns. The first error of any slice is the
// call's; the other slices run to their end (every request finished before the call returns).

namespace {

constexpr uint32_t kMinBlockSize = 4096;
constexpr uint32_t kMaxBlockSize = 64u << 20;
constexpr uint32_t kMaxRetriesLimit = 100000;
constexpr uint32_t kMaxAlignment = 1u << 20;
constexpr uint32_t kMaxThreads = 64;
// How long a transfer keeps offering requests to a backend that refuses them while nothing at all
// is in flight, before calling it a backend bug rather than spinning forever.
constexpr std::chrono::seconds kMaxStall{5};

struct FreeDeleter {
  void operator()(std::byte* p) const { std::free(p); }
};
using AlignedBuffer = std::unique_ptr<std::byte, FreeDeleter>;

// Sleeps before resubmitting a request that failed with -EINTR / -EAGAIN: 40 us doubling to 1 ms.
void Backoff(uint32_t attempt) {
  uint32_t us = std::min<uint32_t>(1000, 20u << std::min<uint32_t>(attempt, 6));
  std::this_thread::sleep_for(std::chrono::microseconds(us));
}

struct FileInfo {
  std::vector<int> backend_files;  // by lane: the index RegisterFile returned there
  std::string label;
  bool direct = false;
  uint32_t alignment = 1;  // for buffers, offsets and lengths; 1 when not direct
  // Under IoEngine::Impl::files_mu; not GUARDED_BY: a FileInfo has no path to its engine's mutex.
  bool removed = false;
};

struct Transfer;
struct Lane;

// One piece of a transfer in a queue entry; see Note [IoEngine transfers].
struct Slot {
  Request request;  // what the backend gets; user_data points at this Slot
  Transfer* owner = nullptr;

  // Written by the reaper under the lane's mu, read by the owner after taking its done list
  // (Transfer::done_head, which is GUARDED_BY): not annotated, as they are guarded only while on
  // a done list.
  Slot* next_done = nullptr;
  int64_t result = 0;

  // The piece, owned by the transfer's thread.
  uint64_t piece_offset = 0;  // file offset where the piece starts
  uint32_t piece_length = 0;  // bytes in the piece
  uint32_t progress = 0;      // bytes of the piece done
  uint32_t need = 0;          // reads: bytes from the start that must exist (the rest may be EOF)
  uint32_t retries = 0;       // EINTR / EAGAIN / zero-progress attempts so far
  std::byte* data = nullptr;  // the piece's bytes: in the caller's buffer, or the bounce buffer
  bool bounce = false;
  bool merging = false;         // a write piece reading the old block first (read-modify-write)
  std::byte* caller = nullptr;  // bounce pieces: the caller's bytes the piece covers...
  uint32_t copy_at = 0;         // ...found at data + copy_at...
  uint32_t copy_length = 0;     // ...for this many bytes

  AlignedBuffer bounce_buffer;  // kept across transfers; grown when too small
  size_t bounce_size = 0;
  size_t bounce_alignment = 0;
};

struct Segment {
  uint64_t begin = 0, end = 0;
  bool bounce = false;
};

// One backend and its completion routing; see Note [Parallel slices].
struct Lane {
  explicit Lane(Backend* b)
      : backend(b),
        queue_depth(std::max<uint32_t>(1, b->capabilities().queue_depth)),
        reap_buffer(queue_depth) {}

  Backend* const backend;
  const uint32_t queue_depth;
  int index = 0;  // in Impl::lanes

  Mutex pool_mu;
  std::vector<std::unique_ptr<Transfer>> pool GUARDED_BY(pool_mu);  // idle transfers

  // Completion routing; see Note [IoEngine transfers].
  Mutex mu;
  CondVar cv;
  bool reaping GUARDED_BY(mu) = false;     // a thread holds the reaper role
  uint64_t reap_epoch GUARDED_BY(mu) = 0;  // bumped after every reap
  Status broken GUARDED_BY(mu);            // a failed Backend::Reap, sticky
  std::vector<Completion> reap_buffer;     // used only by the reaper-role holder
};

// A call in progress (pooled); see Note [IoEngine transfers].
struct Transfer {
  Transfer(Lane* l, size_t queue_depth) : slots(queue_depth), lane(l) {
    free.reserve(queue_depth);
    ready.reserve(queue_depth);
    submit.reserve(queue_depth);
    for (Slot& s : slots) {
      s.owner = this;
      free.push_back(&s);
    }
  }

  std::vector<Slot> slots;
  std::vector<Slot*> free;                         // slots with no piece
  std::vector<Slot*> ready;                        // pieces to submit (or resubmit), oldest first
  std::vector<Request*> submit;                    // scratch for Backend::Submit
  Slot* done_head GUARDED_BY(lane->mu) = nullptr;  // completions routed to this transfer
  Lane* const lane;                                // the backend this transfer runs on

  // The call; set by Start().
  OpType op = OpType::kRead;
  const FileInfo* file = nullptr;
  uint64_t offset = 0;
  uint64_t length = 0;
  std::byte* buffer = nullptr;
  uint32_t chunk = 0;  // most bytes per piece
  Segment segments[3];
  int segment_count = 0;
  int segment = 0;         // next segment to cut pieces from
  uint64_t cursor = 0;     // next file offset in that segment
  uint32_t in_flight = 0;  // own pieces submitted and not yet handled
  Status status;           // first error

  bool more_pieces() const { return segment < segment_count; }
  bool failed() const { return !status.ok(); }
  void Fail(Status s) {
    if (status.ok()) status = std::move(s);
  }
};

// A split call; see Note [Parallel slices]. Lives on the caller's stack.
struct Slice {
  uint64_t offset = 0, length = 0;
  std::byte* buffer = nullptr;
};
struct Job {
  OpType op = OpType::kRead;
  const FileInfo* file = nullptr;
  std::vector<Slice> slices;
  std::atomic<size_t> next{0};  // next slice to claim
  Mutex mu;
  CondVar cv;
  size_t done GUARDED_BY(mu) = 0;  // slices finished
  // Workers that popped this job and run it. Under IoEngine::Impl::work_mu; not GUARDED_BY: a Job
  // has no path to its engine's mutex.
  int holders = 0;
  Status status GUARDED_BY(mu);  // the first error
};

}  // namespace

Status IoEngineOptions::Validate() const {
  if (block_size < kMinBlockSize || block_size > kMaxBlockSize || block_size % 4096 != 0) {
    return Status::InvalidArgument(
        "I/O block size must be a multiple of 4096 between 4 KiB and 64 MiB, got " +
        std::to_string(block_size));
  }
  if (threads < 1 || threads > kMaxThreads) {
    return Status::InvalidArgument("I/O threads (intra_op_parallelism) must be between 1 and " +
                                   std::to_string(kMaxThreads) + ", got " +
                                   std::to_string(threads));
  }
  if (max_retries > kMaxRetriesLimit) {
    return Status::InvalidArgument("I/O max retries must be at most " +
                                   std::to_string(kMaxRetriesLimit) + ", got " +
                                   std::to_string(max_retries));
  }
  return Status::Ok();
}

struct IoEngine::Impl {
  Impl(std::span<Backend* const> backends, const IoEngineOptions& o) : options(o) {
    for (Backend* b : backends) {
      lanes.push_back(std::make_unique<Lane>(b));
      lanes.back()->index = static_cast<int>(lanes.size() - 1);
    }
    for (uint32_t w = 0; w + 1 < options.threads; ++w) {
      workers.emplace_back([this, w] { WorkerLoop(*lanes[(w + 1) % lanes.size()]); });
    }
  }
  ~Impl() {
    {
      MutexLock lock(&work_mu);
      stop = true;
    }
    work_cv.SignalAll();
    for (std::thread& w : workers) w.join();
  }

  Status Run(OpType op, int file, uint64_t offset, std::byte* buffer, uint64_t length);
  Status RunSlice(Lane& lane, OpType op, const FileInfo* file, uint64_t offset, std::byte* buffer,
                  uint64_t length);
  void PlanSlices(const FileInfo& file, uint64_t offset, uint64_t length, std::byte* buffer,
                  std::vector<Slice>& out) const;
  Status RunSplit(Job& job);
  void ClaimAndRun(Job& job, Lane& lane);
  void WorkerLoop(Lane& lane);

  Transfer* Acquire(Lane& lane);
  void Release(Transfer* t);
  Status Start(Transfer& t, OpType op, const FileInfo* file, uint64_t offset, std::byte* buffer,
               uint64_t length);
  Status SetUpPiece(Transfer& t, Slot& s);
  Status Drive(Transfer& t);
  Slot* WaitForCompletions(Transfer& t, bool any_reap);
  void Handle(Transfer& t, Slot& s, int64_t result);
  void Finish(Transfer& t, Slot& s);
  std::string Where(const Transfer& t, const Slot& s) const;

  // The registered region holding [data, data + length), or -1. Regions are set while no
  // transfer runs (RegisterBuffers' contract), so reading them needs no lock.
  int RegisteredIndex(const std::byte* data, uint64_t length) const {
    for (size_t i = 0; i < registered.size(); ++i) {
      const auto* begin = static_cast<const std::byte*>(registered[i].iov_base);
      if (data >= begin && length <= registered[i].iov_len &&
          static_cast<uint64_t>(data - begin) <= registered[i].iov_len - length) {
        return static_cast<int>(i);
      }
    }
    return -1;
  }

  const IoEngineOptions options;
  std::vector<std::unique_ptr<Lane>> lanes;  // fixed after construction
  std::vector<iovec> registered;             // see RegisteredIndex

  Mutex files_mu;
  std::vector<std::unique_ptr<FileInfo>> files GUARDED_BY(files_mu);  // entries never move

  // Parallel slices; see Note [Parallel slices].
  Mutex work_mu;
  CondVar work_cv;
  std::deque<Job*> work GUARDED_BY(work_mu);  // one entry per slice offered to the workers
  bool stop GUARDED_BY(work_mu) = false;
  std::vector<std::thread> workers;

  std::atomic<uint64_t> read_bytes{0}, write_bytes{0}, read_ops{0}, write_ops{0},
      short_transfers{0}, retries{0}, bounce_bytes{0}, split_transfers{0}, registered_ops{0};
};

// ---- Transfers ----------------------------------------------------------------------------------

Transfer* IoEngine::Impl::Acquire(Lane& lane) {
  {
    MutexLock lock(&lane.pool_mu);
    if (!lane.pool.empty()) {
      Transfer* t = lane.pool.back().release();
      lane.pool.pop_back();
      return t;
    }
  }
  return new Transfer(&lane, lane.queue_depth);
}

void IoEngine::Impl::Release(Transfer* t) {
  MutexLock lock(&t->lane->pool_mu);
  t->lane->pool.emplace_back(t);
}

std::string IoEngine::Impl::Where(const Transfer& t, const Slot& s) const {
  std::string where = std::string(OpTypeName(t.op)) + " file '" + t.file->label + "'";
  if (t.op == OpType::kFsync) return where;
  return where + " at offset " + std::to_string(s.request.offset) + " (" +
         std::to_string(s.request.length) + " bytes)";
}

Status IoEngine::Impl::Start(Transfer& t, OpType op, const FileInfo* file, uint64_t offset,
                             std::byte* buffer, uint64_t length) {
  t.op = op;
  t.file = file;
  t.offset = offset;
  t.length = length;
  t.buffer = buffer;
  t.status = Status::Ok();
  t.segment = 0;
  t.segment_count = 0;
  const uint64_t a = file->alignment;
  const uint64_t end = offset + length;
  if (op == OpType::kFsync) {
    t.chunk = 0;
    t.segments[t.segment_count++] = Segment{0, 0, false};
  } else if (a <= 1) {
    t.chunk = options.block_size;
    t.segments[t.segment_count++] = Segment{offset, end, false};
  } else {
    // Pieces of a direct file start and end on alignment boundaries.
    t.chunk = static_cast<uint32_t>(std::max<uint64_t>(a, RoundDown(options.block_size, a)));
    const uint64_t head_end = RoundUp(offset, a);
    const uint64_t tail_begin = RoundDown(end, a);
    if (head_end > tail_begin) {
      // Begins and ends inside one block.
      t.segments[t.segment_count++] = Segment{RoundDown(offset, a), RoundUp(end, a), true};
    } else {
      // The caller's buffer can take the middle directly only if it is aligned where the middle
      // begins; otherwise the middle goes through bounce buffers as well.
      const bool middle_bounce =
          (reinterpret_cast<uintptr_t>(buffer) + (head_end - offset)) % a != 0;
      if (offset != head_end) {
        t.segments[t.segment_count++] = Segment{RoundDown(offset, a), head_end, true};
      }
      if (head_end < tail_begin) {
        t.segments[t.segment_count++] = Segment{head_end, tail_begin, middle_bounce};
      }
      if (end != tail_begin) {
        t.segments[t.segment_count++] = Segment{tail_begin, RoundUp(end, a), true};
      }
    }
  }
  t.cursor = t.segments[0].begin;
  return Status::Ok();
}

// Cuts the next piece from the plan into `s`.
Status IoEngine::Impl::SetUpPiece(Transfer& t, Slot& s) {
  const Segment& seg = t.segments[t.segment];
  const uint64_t begin = t.cursor;
  const uint64_t end = t.op == OpType::kFsync ? begin : std::min(seg.end, begin + t.chunk);
  t.cursor = end;
  if (t.cursor >= seg.end && ++t.segment < t.segment_count) t.cursor = t.segments[t.segment].begin;

  s.piece_offset = begin;
  s.piece_length = static_cast<uint32_t>(end - begin);
  s.progress = 0;
  s.retries = 0;
  s.merging = false;
  s.bounce = seg.bounce;
  if (!seg.bounce) {
    s.data = t.buffer == nullptr ? nullptr : t.buffer + (begin - t.offset);
    s.need = s.piece_length;
  } else {
    const size_t alignment = std::max<size_t>(t.file->alignment, sizeof(void*));
    if (s.bounce_size < s.piece_length || s.bounce_alignment < alignment) {
      s.bounce_buffer.reset();
      s.bounce_size = 0;
      void* p = nullptr;
      if (posix_memalign(&p, alignment, s.piece_length) != 0) {
        return Status::ResourceExhausted(std::string(OpTypeName(t.op)) + " file '" + t.file->label +
                                         "': cannot allocate a " + std::to_string(s.piece_length) +
                                         "-byte aligned bounce buffer");
      }
      s.bounce_buffer.reset(static_cast<std::byte*>(p));
      s.bounce_size = s.piece_length;
      s.bounce_alignment = alignment;
    }
    s.data = s.bounce_buffer.get();
    const uint64_t lo = std::max(begin, t.offset);
    const uint64_t hi = std::min(end, t.offset + t.length);
    s.caller = t.buffer + (lo - t.offset);
    s.copy_at = static_cast<uint32_t>(lo - begin);
    s.copy_length = static_cast<uint32_t>(hi - lo);
    s.need = static_cast<uint32_t>(hi - begin);
    if (t.op == OpType::kWrite) {
      if (lo != begin || hi != end) {
        s.merging = true;
      } else {
        std::memcpy(s.data, s.caller, s.copy_length);
        bounce_bytes.fetch_add(s.copy_length, std::memory_order_relaxed);
      }
    }
  }
  s.request.op = s.merging ? OpType::kRead : t.op;
  s.request.file = t.file->backend_files[t.lane->index];
  s.request.offset = begin;
  s.request.buffer = s.data;
  s.request.length = s.piece_length;
  s.request.buffer_index =
      s.bounce || s.data == nullptr ? -1 : RegisteredIndex(s.data, s.piece_length);
  if (s.request.buffer_index >= 0) registered_ops.fetch_add(1, std::memory_order_relaxed);
  s.request.user_data = reinterpret_cast<uint64_t>(&s);
  return Status::Ok();
}

void IoEngine::Impl::Finish(Transfer& t, Slot& s) { t.free.push_back(&s); }

// Handles one completion of `t`'s piece `s`: done, resubmit (short transfer, retry), or fail.
void IoEngine::Impl::Handle(Transfer& t, Slot& s, int64_t result) {
  --t.in_flight;
  const bool reading = s.request.op == OpType::kRead;  // includes the merge read of a write
  if (result < 0) {
    const int err = static_cast<int>(-result);
    const bool transient = err == EINTR || err == EAGAIN;
    if (transient && !t.failed() && s.retries < options.max_retries) {
      ++s.retries;
      retries.fetch_add(1, std::memory_order_relaxed);
      Backoff(s.retries);
      t.ready.push_back(&s);
      return;
    }
    std::string where = Where(t, s);
    if (transient) where += " (gave up after " + std::to_string(s.retries) + " retries)";
    if (s.merging) where += " (reading the block to merge an unaligned write)";
    t.Fail(Status::FromErrno(err, where));
    Finish(t, s);
    return;
  }
  if (t.failed()) {
    Finish(t, s);  // draining after another piece failed
    return;
  }
  if (static_cast<uint64_t>(result) > s.request.length) {
    t.Fail(Status::Internal(Where(t, s) + ": backend " + t.lane->backend->capabilities().name +
                            " reported " + std::to_string(result) + " bytes transferred"));
    Finish(t, s);
    return;
  }
  (reading ? read_bytes : write_bytes).fetch_add(result, std::memory_order_relaxed);
  s.progress += static_cast<uint32_t>(result);
  if (s.progress < s.piece_length) {
    // O_DIRECT only stops at an unaligned count at the end of the file; the remainder would be
    // refused (EINVAL) anyway.
    const bool eof = result == 0 || (t.file->alignment > 1 && s.progress % t.file->alignment != 0);
    if (reading && eof) {
      if (!s.merging && s.progress < s.need) {
        t.Fail(Status::OutOfRange(std::string(OpTypeName(t.op)) + " file '" + t.file->label +
                                  "': end of file at offset " +
                                  std::to_string(s.piece_offset + s.progress) + " (transfer of " +
                                  std::to_string(t.length) + " bytes at offset " +
                                  std::to_string(t.offset) + ")"));
        Finish(t, s);
        return;
      }
      // Enough: a merge read past EOF reads zeros, and a bounce read only needs its window.
      std::memset(s.data + s.progress, 0, s.piece_length - s.progress);
      s.progress = s.piece_length;
    } else if (result == 0) {
      // A write that moved nothing: bounded retries like EAGAIN, then give up.
      if (s.retries < options.max_retries) {
        ++s.retries;
        retries.fetch_add(1, std::memory_order_relaxed);
        Backoff(s.retries);
        t.ready.push_back(&s);
        return;
      }
      t.Fail(Status::IoError(Where(t, s) + ": no progress after " + std::to_string(s.retries) +
                             " retries"));
      Finish(t, s);
      return;
    } else {
      short_transfers.fetch_add(1, std::memory_order_relaxed);
      s.request.offset += static_cast<uint64_t>(result);
      s.request.buffer = static_cast<std::byte*>(s.request.buffer) + result;
      s.request.length -= static_cast<uint32_t>(result);
      t.ready.push_back(&s);
      return;
    }
  }
  // The piece is complete.
  if (s.merging) {
    std::memcpy(s.data + s.copy_at, s.caller, s.copy_length);
    bounce_bytes.fetch_add(s.copy_length, std::memory_order_relaxed);
    s.merging = false;
    s.progress = 0;
    s.request.op = OpType::kWrite;
    s.request.offset = s.piece_offset;
    s.request.buffer = s.data;
    s.request.length = s.piece_length;
    t.ready.push_back(&s);
    return;
  }
  if (s.bounce && t.op == OpType::kRead) {
    std::memcpy(s.caller, s.data + s.copy_at, s.copy_length);
    bounce_bytes.fetch_add(s.copy_length, std::memory_order_relaxed);
  }
  Finish(t, s);
}

// Returns `t`'s routed completions (a list through next_done), reaping for everyone when no other
// thread is. With `any_reap`, also returns (possibly empty) once any reap has happened, so a
// transfer refused by a full queue can offer again. Returns null with `t` failed when the backend
// is broken.
Slot* IoEngine::Impl::WaitForCompletions(Transfer& t, bool any_reap) {
  Lane& l = *t.lane;
  MutexLock lock(&l.mu);
  t.lane->mu.AssertHeld();  // it is l.mu: the analysis does not follow the reference
  const uint64_t epoch = l.reap_epoch;
  while (t.done_head == nullptr && !(any_reap && l.reap_epoch != epoch) && l.broken.ok()) {
    if (l.reaping) {
      l.cv.Wait(&l.mu);
      continue;
    }
    l.reaping = true;
    lock.Unlock();
    // Waits for one completion: this transfer has a request in flight, or the queue is full of
    // other transfers' (and if it has emptied meanwhile, Reap returns at once).
    Result<size_t> reaped = l.backend->Reap(l.reap_buffer, 1);
    lock.Lock();
    l.reaping = false;
    if (!reaped.ok()) {
      l.broken = reaped.status().WithPrefix("backend " + l.backend->capabilities().name + " reap");
    } else {
      for (size_t i = 0; i < *reaped; ++i) {
        // user_data is the Slot* SetUpPiece stored.
        auto* slot = reinterpret_cast<Slot*>(  // NOLINT(performance-no-int-to-ptr)
            l.reap_buffer[i].request->user_data);
        slot->result = l.reap_buffer[i].result;
        // A lane's backend completes only the requests of that lane's transfers.
        assert(slot->owner->lane == &l);
        slot->owner->lane->mu.AssertHeld();
        slot->next_done = slot->owner->done_head;
        slot->owner->done_head = slot;
      }
    }
    ++l.reap_epoch;
    l.cv.SignalAll();
  }
  // Routed newest first; handle them in completion order.
  Slot* list = nullptr;
  while (t.done_head != nullptr) {
    Slot* next = t.done_head->next_done;
    t.done_head->next_done = list;
    list = t.done_head;
    t.done_head = next;
  }
  if (list == nullptr && !l.broken.ok()) t.Fail(l.broken);
  return list;
}

// Runs `t` to the end; see Note [IoEngine transfers].
Status IoEngine::Impl::Drive(Transfer& t) {
  Backend* const backend = t.lane->backend;
  bool stalled = false;
  std::chrono::steady_clock::time_point stall_start;
  while (true) {
    if (t.failed()) {
      // Pieces waiting to be (re)submitted are not in flight: drop them.
      for (Slot* s : t.ready) Finish(t, *s);
      t.ready.clear();
    }
    while (!t.failed() && !t.free.empty() && t.more_pieces()) {
      Slot* s = t.free.back();
      t.free.pop_back();
      Status set_up = SetUpPiece(t, *s);
      if (!set_up.ok()) {
        t.Fail(set_up);
        Finish(t, *s);
        break;
      }
      t.ready.push_back(s);
    }
    bool refused = false;
    if (!t.failed() && !t.ready.empty()) {
      t.submit.clear();
      for (Slot* s : t.ready) t.submit.push_back(&s->request);
      Result<size_t> taken = backend->Submit(t.submit);
      if (!taken.ok()) {
        t.Fail(taken.status().WithPrefix(std::string(OpTypeName(t.op)) + " file '" + t.file->label +
                                         "': backend " + backend->capabilities().name));
        for (Slot* s : t.ready) Finish(t, *s);
        t.ready.clear();
      } else {
        const size_t k = std::min(*taken, t.ready.size());
        for (size_t i = 0; i < k; ++i) {
          const OpType op = t.ready[i]->request.op;
          if (op != OpType::kFsync) {
            (op == OpType::kWrite ? write_ops : read_ops).fetch_add(1, std::memory_order_relaxed);
          }
        }
        t.in_flight += static_cast<uint32_t>(k);
        t.ready.erase(t.ready.begin(), t.ready.begin() + static_cast<ptrdiff_t>(k));
        refused = !t.ready.empty();
      }
    }
    if (t.in_flight == 0) {
      if (t.failed()) return t.status;
      if (t.ready.empty() && !t.more_pieces()) return Status::Ok();
      // Refused with nothing of ours in flight: other transfers fill the queue, and a reap will
      // make room. With nothing in flight anywhere that can only be a moment (a wrapper between
      // its inner reap and freeing its own slot), unless the backend refuses work for good.
      if (backend->in_flight() == 0) {
        const auto now = std::chrono::steady_clock::now();
        if (!stalled) {
          stalled = true;
          stall_start = now;
        } else if (now - stall_start > kMaxStall) {
          t.Fail(Status::Internal(std::string(OpTypeName(t.op)) + " file '" + t.file->label +
                                  "': backend " + backend->capabilities().name +
                                  " takes no requests with none in flight"));
          continue;
        }
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      } else {
        stalled = false;
      }
    } else {
      stalled = false;
    }
    Slot* done = WaitForCompletions(t, refused || t.in_flight == 0);
    if (done == nullptr && t.failed() && t.in_flight > 0) {
      // Broken backend: see Note [IoEngine transfers].
      for (Slot* s : t.ready) Finish(t, *s);
      t.ready.clear();
      t.in_flight = 0;
      for (Slot& s : t.slots) {
        if (std::find(t.free.begin(), t.free.end(), &s) == t.free.end()) t.free.push_back(&s);
      }
      return t.status;
    }
    while (done != nullptr) {
      Slot* next = done->next_done;
      Handle(t, *done, done->result);
      done = next;
    }
  }
}

Status IoEngine::Impl::Run(OpType op, int file, uint64_t offset, std::byte* buffer,
                           uint64_t length) {
  const FileInfo* info = nullptr;
  {
    MutexLock lock(&files_mu);
    if (file >= 0 && static_cast<size_t>(file) < files.size() && !files[file]->removed) {
      info = files[file].get();
    }
  }
  if (info == nullptr) {
    return Status::InvalidArgument(std::string(OpTypeName(op)) + ": file " + std::to_string(file) +
                                   " is not registered with the engine");
  }
  if (op != OpType::kFsync) {
    if (length == 0) return Status::Ok();
    if (buffer == nullptr) {
      return Status::InvalidArgument(std::string(OpTypeName(op)) + " file '" + info->label +
                                     "': null buffer for " + std::to_string(length) + " bytes");
    }
    // off_t is signed; also keeps the alignment arithmetic clear of overflow.
    constexpr uint64_t kMaxEnd = std::numeric_limits<int64_t>::max() - kMaxAlignment;
    if (offset > kMaxEnd || length > kMaxEnd - offset) {
      return Status::InvalidArgument(std::string(OpTypeName(op)) + " file '" + info->label +
                                     "': " + std::to_string(length) + " bytes at offset " +
                                     std::to_string(offset) + " exceed the largest file offset");
    }
  }
  if (op == OpType::kFsync || options.threads == 1 ||
      length < 2 * static_cast<uint64_t>(options.block_size)) {
    return RunSlice(*lanes[0], op, info, offset, buffer, length);
  }
  Job job;
  job.op = op;
  job.file = info;
  PlanSlices(*info, offset, length, buffer, job.slices);
  if (job.slices.size() == 1) return RunSlice(*lanes[0], op, info, offset, buffer, length);
  split_transfers.fetch_add(1, std::memory_order_relaxed);
  return RunSplit(job);
}

Status IoEngine::Impl::RunSlice(Lane& lane, OpType op, const FileInfo* file, uint64_t offset,
                                std::byte* buffer, uint64_t length) {
  {
    MutexLock lock(&lane.mu);
    if (!lane.broken.ok()) {
      return Status::FailedPrecondition(
          std::string(OpTypeName(op)) + " file '" + file->label +
          "': the engine's backend failed earlier: " + lane.broken.message());
    }
  }
  Transfer* t = Acquire(lane);
  Status status = Start(*t, op, file, offset, buffer, length);
  if (status.ok()) status = Drive(*t);
  Release(t);
  return status;
}

// Cuts [offset, offset + length) into slices; see Note [Parallel slices].
void IoEngine::Impl::PlanSlices(const FileInfo& file, uint64_t offset, uint64_t length,
                                std::byte* buffer, std::vector<Slice>& out) const {
  const uint64_t block = options.block_size;
  const uint64_t n = std::min<uint64_t>(options.threads, (length + block - 1) / block);
  const uint64_t per = (length + n - 1) / n;
  const uint64_t a = file.alignment;
  const uint64_t end = offset + length;
  uint64_t begin = offset;
  for (uint64_t k = 1; k <= n && begin < end; ++k) {
    uint64_t cut = k == n ? end : RoundDown(offset + k * per, a);
    if (cut <= begin) continue;  // a slice smaller than one alignment block: merged into the next
    cut = std::min(cut, end);
    out.push_back(Slice{begin, cut - begin, buffer + (begin - offset)});
    begin = cut;
  }
}

void IoEngine::Impl::ClaimAndRun(Job& job, Lane& lane) {
  for (;;) {
    const size_t k = job.next.fetch_add(1, std::memory_order_relaxed);
    if (k >= job.slices.size()) return;
    const Slice& slice = job.slices[k];
    Status status = RunSlice(lane, job.op, job.file, slice.offset, slice.buffer, slice.length);
    {
      MutexLock lock(&job.mu);
      if (!status.ok() && job.status.ok()) job.status = std::move(status);
      ++job.done;
    }
    job.cv.SignalAll();
  }
}

Status IoEngine::Impl::RunSplit(Job& job) {
  {
    MutexLock lock(&work_mu);
    for (size_t k = 1; k < job.slices.size(); ++k) work.push_back(&job);
  }
  work_cv.SignalAll();
  ClaimAndRun(job, *lanes[0]);
  {
    // Take back the entries no worker popped; wait for those that did to let go of the job.
    MutexLock lock(&work_mu);
    work.erase(std::remove(work.begin(), work.end(), &job), work.end());
    while (job.holders != 0) work_cv.Wait(&work_mu);
  }
  MutexLock lock(&job.mu);
  while (job.done != job.slices.size()) job.cv.Wait(&job.mu);
  return job.status;
}

void IoEngine::Impl::WorkerLoop(Lane& lane) {
  for (;;) {
    Job* job = nullptr;
    {
      MutexLock lock(&work_mu);
      while (!stop && work.empty()) work_cv.Wait(&work_mu);
      if (stop) return;
      job = work.front();
      work.pop_front();
      ++job->holders;
    }
    ClaimAndRun(*job, lane);
    {
      MutexLock lock(&work_mu);
      --job->holders;
    }
    // The owner waits on work_cv for holders to reach 0.
    work_cv.SignalAll();
  }
}

// ---- IoEngine -----------------------------------------------------------------------------------

std::vector<iovec> RegistrationRegions(void* base, uint64_t bytes) {
  constexpr uint64_t kMaxRegion = uint64_t{1} << 30;  // io_uring refuses larger fixed buffers
  std::vector<iovec> out;
  auto* p = static_cast<std::byte*>(base);
  for (uint64_t at = 0; at < bytes; at += kMaxRegion) {
    out.push_back(iovec{p + at, static_cast<size_t>(std::min(kMaxRegion, bytes - at))});
  }
  return out;
}

IoEngine::IoEngine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
IoEngine::~IoEngine() = default;

Result<std::unique_ptr<IoEngine>> IoEngine::Create(Backend* backend,
                                                   const IoEngineOptions& options) {
  Backend* const one[] = {backend};
  return Create(std::span<Backend* const>(one), options);
}

Result<std::unique_ptr<IoEngine>> IoEngine::Create(std::span<Backend* const> backends,
                                                   const IoEngineOptions& options) {
  if (backends.empty()) return Status::InvalidArgument("I/O engine: no backend");
  for (Backend* b : backends) {
    if (b == nullptr) return Status::InvalidArgument("I/O engine: no backend");
  }
  MEMPLAN_RETURN_IF_ERROR(options.Validate());
  if (backends.size() > options.threads) {
    return Status::InvalidArgument("I/O engine: " + std::to_string(backends.size()) +
                                   " backends for " + std::to_string(options.threads) +
                                   " threads (at most one backend per thread)");
  }
  for (size_t i = 0; i < backends.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      if (backends[i] == backends[j]) {
        return Status::InvalidArgument("I/O engine: the same backend given twice");
      }
    }
  }
  return std::unique_ptr<IoEngine>(new IoEngine(std::make_unique<Impl>(backends, options)));
}

Result<int> IoEngine::AddFile(int fd, std::string label, bool direct) {
  auto info = std::make_unique<FileInfo>();
  info->direct = direct;
  info->alignment = direct ? DirectIoAlignment(fd, true) : 1;
  if (info->alignment == 0) info->alignment = 1;
  if (!IsPowerOfTwo(info->alignment) || info->alignment > kMaxAlignment) {
    return Status::InvalidArgument("file '" + label + "': unsupported O_DIRECT alignment " +
                                   std::to_string(info->alignment));
  }
  for (const auto& lane : impl_->lanes) {
    Result<int> index = lane->backend->RegisterFile(fd);
    if (!index.ok()) {
      // Undo the lanes done so far, so a failed AddFile leaves nothing registered.
      for (size_t i = 0; i < info->backend_files.size(); ++i) {
        (void)impl_->lanes[i]->backend->UnregisterFile(info->backend_files[i]);
      }
      return index.status().WithPrefix("file '" + label + "'");
    }
    info->backend_files.push_back(*index);
  }
  info->label = std::move(label);
  MutexLock lock(&impl_->files_mu);
  impl_->files.push_back(std::move(info));
  return static_cast<int>(impl_->files.size() - 1);
}

Status IoEngine::RemoveFile(int file) {
  MutexLock lock(&impl_->files_mu);
  if (file < 0 || static_cast<size_t>(file) >= impl_->files.size() || impl_->files[file]->removed) {
    return Status::InvalidArgument("I/O engine: file " + std::to_string(file) +
                                   " is not registered");
  }
  FileInfo& info = *impl_->files[file];
  Status first;
  for (size_t i = 0; i < impl_->lanes.size(); ++i) {
    Status status = impl_->lanes[i]->backend->UnregisterFile(info.backend_files[i]);
    if (!status.ok() && first.ok()) first = status.WithPrefix("file '" + info.label + "'");
  }
  MEMPLAN_RETURN_IF_ERROR(first);
  info.removed = true;
  return Status::Ok();
}

Status IoEngine::Read(int file, uint64_t offset, void* buffer, uint64_t length) {
  return impl_->Run(OpType::kRead, file, offset, static_cast<std::byte*>(buffer), length);
}

Status IoEngine::Write(int file, uint64_t offset, const void* buffer, uint64_t length) {
  // Backends only read a write's buffer (FaultBackend's write bit flips aside; see its header).
  return impl_->Run(OpType::kWrite, file, offset,
                    static_cast<std::byte*>(const_cast<void*>(buffer)), length);
}

Status IoEngine::Sync(int file) { return impl_->Run(OpType::kFsync, file, 0, nullptr, 0); }

Status IoEngine::RegisterBuffers(std::span<const iovec> buffers) {
  impl_->registered.clear();
  Status first;
  for (const auto& lane : impl_->lanes) {
    Status status = lane->backend->RegisterBuffers(buffers);
    if (!status.ok() && first.ok()) first = status;
  }
  if (!first.ok()) {
    // Some backend refused: use none, so no request names a region a backend does not have.
    for (const auto& lane : impl_->lanes) (void)lane->backend->RegisterBuffers({});
    return first;
  }
  bool any = false;
  for (const auto& lane : impl_->lanes)
    any = any || lane->backend->capabilities().registered_buffers;
  if (any) impl_->registered.assign(buffers.begin(), buffers.end());
  return Status::Ok();
}

IoStats IoEngine::stats() const {
  IoStats s;
  s.read_bytes = impl_->read_bytes.load(std::memory_order_relaxed);
  s.write_bytes = impl_->write_bytes.load(std::memory_order_relaxed);
  s.read_ops = impl_->read_ops.load(std::memory_order_relaxed);
  s.write_ops = impl_->write_ops.load(std::memory_order_relaxed);
  s.short_transfers = impl_->short_transfers.load(std::memory_order_relaxed);
  s.retries = impl_->retries.load(std::memory_order_relaxed);
  s.bounce_bytes = impl_->bounce_bytes.load(std::memory_order_relaxed);
  s.split_transfers = impl_->split_transfers.load(std::memory_order_relaxed);
  s.registered_ops = impl_->registered_ops.load(std::memory_order_relaxed);
  return s;
}

Backend* IoEngine::backend() const { return impl_->lanes[0]->backend; }
uint32_t IoEngine::threads() const { return impl_->options.threads; }
size_t IoEngine::backend_count() const { return impl_->lanes.size(); }

}  // namespace memplan::nvme
