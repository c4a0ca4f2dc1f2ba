// nvme::FaultBackend: a Backend that forwards everything to another Backend and injects the
// faults a real device produces, so the code above the seam (IoEngine, SwapStore) is tested
// against them on purpose rather than hoped correct. LevelDB's FaultInjectionTestEnv and RocksDB's
// fault-injection filesystem are the models: a wrapper, a plan saying what to break, counters
// saying what was broken.
//
// What can be injected (each kind has its own FaultTrigger: the Nth matching request, a run of
// them, or a seeded probability):
//   - errors: the request is forwarded as usual and, AT COMPLETION, its result is replaced by
//     -error (EIO, ENOSPC, EINTR, EAGAIN, ...). The inner I/O did happen: a failed write may have
//     changed the file, as a failed write on a real device may.
//   - short transfers: AT SUBMIT the request is forwarded with its length cut to
//     `short_keep_bytes`, so the completion honestly reports fewer bytes and no byte beyond them
//     was read or written. Keep it a multiple of the alignment when the inner backend does
//     O_DIRECT I/O, or the inner request fails with EINVAL.
//   - bit flips in reads: after the inner read completes, bit `flip_bit` (modulo the bits
//     transferred) of the caller's buffer is inverted before the completion is returned.
//   - bit flips in writes: the bit is inverted IN THE CALLER'S BUFFER before the request is
//     forwarded and restored after the inner completion, before the caller sees it. So the
//     buffer of a write must be writable memory (IoEngine's are), and no other in-flight request
//     may read the same bytes meanwhile.
//   - a broken backend: Submit() fails with IoError and takes nothing.
// Nothing is ever reported complete that the inner backend did not complete, and every request
// is reported exactly once; faults only change what the completion says.
//
// Determinism: triggers count requests from the last SetPlan(); probabilities draw from
// std::mt19937_64 seeded with `FaultPlan::seed`, consumed in submission order. With one
// submitting thread a plan produces the same faults on every run.
//
// Thread safety: like any Backend, Submit() and Reap() may be called from any number of threads.
// SetPlan(), plan() and counters() may be called at any time from any thread; a new plan applies
// to requests submitted after it (requests already in flight keep the faults decided for them).
#pragma once

#include <cerrno>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>

#include "common/status.h"
#include "nvme/backend.h"

namespace memplan::nvme {

// Which requests a fault hits. Each trigger counts, from the last SetPlan(), the requests whose
// op matches `op` (every op when empty). The request with count c is hit when
// nth <= c < nth + times (times == 0: every one from the nth on), and independently of that with
// chance `probability`.
struct FaultTrigger {
  std::optional<OpType> op;  // count only this op type; empty: every op
  uint64_t nth = 0;          // 1-based count of the first request hit; 0: none by count
  uint64_t times = 1;        // consecutive matching requests hit from the nth; 0: all from then on
  double probability = 0.0;  // in [0, 1]; chance that each matching request is hit

  bool armed() const { return nth != 0 || probability > 0.0; }
};

struct FaultPlan {
  FaultTrigger fail;  // result replaced by -error at completion
  int error = EIO;    // positive errno delivered by `fail`

  FaultTrigger shorten;              // request forwarded with a cut length (at submit)
  uint32_t short_keep_bytes = 4096;  // bytes a shortened request keeps; longer requests only (a
                                     // request of at most this many bytes is left alone); 0 makes
                                     // a zero-progress transfer

  FaultTrigger flip;      // one bit inverted in the data read, or in the data written
  uint64_t flip_bit = 0;  // bit index within the request's transferred bytes (modulo their size)

  // Counts Submit() calls (with at least one request) instead of requests; `op` matches a call by
  // its first request. A hit call returns IoError and takes nothing.
  FaultTrigger submit_fail;

  uint64_t seed = 0;  // for every trigger's `probability`

  // Probabilities in [0, 1], error > 0.
  Status Validate() const;
};

// What was injected since the backend was created (not reset by SetPlan). Each fault is counted
// when the completion carrying it is returned by Reap(); write flips when the inner write
// completes (the device did get the flipped data, whatever else is reported).
struct FaultCounters {
  uint64_t requests = 0;         // requests forwarded to the inner backend
  uint64_t errors = 0;           // completions whose result was replaced by -error
  uint64_t short_transfers = 0;  // completions of shortened requests (not also failed)
  uint64_t read_flips = 0;       // reads delivered with a flipped bit
  uint64_t write_flips = 0;      // writes that reached the inner backend with a flipped bit
  uint64_t submit_failures = 0;  // Submit() calls failed on purpose
  uint64_t total() const {
    return errors + short_transfers + read_flips + write_flips + submit_failures;
  }
};

class FaultBackend : public Backend {
 public:
  // Wraps `inner` (owned). Its capabilities are the inner's with name "fault(<inner name>)". Error:
  // a null inner or an invalid plan (InvalidArgument).
  static Result<std::unique_ptr<FaultBackend>> Create(std::unique_ptr<Backend> inner,
                                                      const FaultPlan& plan = {});
  ~FaultBackend() override;

  // Replaces the plan and restarts the trigger counts and the random sequence. An invalid plan is
  // refused (InvalidArgument) and the old one kept.
  Status SetPlan(const FaultPlan& plan);
  FaultPlan plan() const;
  FaultCounters counters() const;
  Backend* inner() const;

  const Capabilities& capabilities() const override;
  Result<int> RegisterFile(int fd) override;
  Status UnregisterFile(int file) override;
  Status RegisterBuffers(std::span<const iovec> buffers) override;
  // Forwards a private copy of each request (so the caller's Request is never modified) and
  // decides its faults. At most the inner queue depth is in flight, as for the inner backend.
  Result<size_t> Submit(std::span<Request* const> requests) override;
  // Reaps from the inner backend, applies the decided faults, and returns the caller's requests.
  Result<size_t> Reap(std::span<Completion> out, size_t min_complete) override;
  size_t in_flight() const override;

 private:
  struct Impl;
  explicit FaultBackend(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace memplan::nvme
