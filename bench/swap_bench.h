// The NVMe optimizer step measured against its two limits: the measuring behind `memplan bench
// swap`.
//
// A pipelined step over states on NVMe can be no faster than the slower of moving its bytes at the
// device's bandwidth and running the optimizer over its elements in memory; a good pipeline is
// hardly slower than that. So the bench measures all three on the same directory, threads and
// geometry, in one run:
//   - the device's read and write bandwidth (bench::RunNvmeBench, the store's backend, block size
//   and
//     queue depth), unless the caller passes figures from `memplan bench nvme`;
//   - the compute time: the same CPU AdamW over the same number of elements, sub-group by
//     sub-group, in ordinary memory;
//   - the step time of an OptimizerSwapper over states several times its pinned buffers;
// and reports step / max(I/O time, compute time), where I/O time = bytes read / read bandwidth +
// bytes written / write bandwidth (one device serves both directions).
//
// Thread safety: RunSwapBench may be called from any thread; it uses options.threads threads plus
// the swapper's reader and writer.
#pragma once

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>

#include "common/status.h"
#include "nvme/backend.h"
#include "offload/cpu_optimizer.h"

namespace memplan::bench {

struct SwapBenchOptions {
  // An existing directory; the bench makes a store in a new subdirectory and removes it.
  std::string directory;
  // Parameters in the partition (>= sub_group_elements). Default 64 Mi: 768 MiB of fp32 weights and
  // Adam states on NVMe, four times the default pinned buffers.
  uint64_t params = uint64_t{64} << 20;
  uint64_t sub_group_elements = uint64_t{4} << 20;  // as OptimizerSwapperOptions
  uint32_t buffer_count = 3;                        // as OptimizerSwapperOptions
  int threads = 1;                                  // CPU optimizer threads
  int steps = 3;                                    // timed steps, after one untimed warm-up
  nvme::BackendKind backend = nvme::BackendKind::kAuto;
  bool direct = true;
  uint32_t block_size = 1 << 20;  // IoEngine request size
  uint32_t queue_depth = 32;
  uint32_t io_threads = 1;  // threads each transfer is split across (intra_op_parallelism)
  // Gradients as fp32 (kNone) or 16-bit (the fused kernel; half the gradient bytes), in the step
  // and in the compute reference alike.
  offload::HalfDtype grad_dtype = offload::HalfDtype::kNone;
  bool register_buffers = true;  // the swapper's pinned buffers as io_uring fixed buffers
  // Device bandwidths to compare with (bytes/s), e.g. from `memplan bench nvme`; when absent they
  // are measured here over min(1 GiB, the states' size).
  std::optional<double> read_bytes_per_s, write_bytes_per_s;
  // When set (by a signal handler, say), the bench stops at the next sub-group, removes its store
  // and returns an error (kUnavailable "interrupted").
  const std::atomic<bool>* stop = nullptr;

  Status Validate() const;
};

struct SwapBenchResult {
  uint64_t params = 0, sub_group_elements = 0, sub_groups = 0;
  uint32_t buffer_count = 0;
  int threads = 0, steps = 0;
  uint32_t io_threads = 1;
  offload::HalfDtype grad_dtype = offload::HalfDtype::kNone;
  bool register_buffers = true;
  uint64_t registered_ops = 0;  // requests of the store that named a registered buffer
  std::string backend;          // what the store ran on
  bool direct = false;
  uint64_t pinned_bytes = 0;  // the swapper's pinned buffers
  uint64_t state_bytes = 0;   // one copy of weights + states on NVMe (12 bytes per param)
  uint64_t read_bytes_per_step = 0, write_bytes_per_step = 0;
  double read_bytes_per_s = 0, write_bytes_per_s = 0;  // device bandwidth compared with
  bool bandwidth_measured = false;                     // measured here (not given)
  double io_seconds = 0;                               // bytes per step at those bandwidths
  double compute_seconds = 0;                          // in-memory AdamW over the same elements
  double step_seconds = 0;                             // mean of the timed steps
  double step_seconds_min = 0;
  double ratio = 0;  // step_seconds / max(io_seconds, compute_seconds)
  // The last timed step's stage times (see SwapStepStats).
  double stage_read_s = 0, stage_write_s = 0, stage_compute_s = 0, compute_wait_s = 0, sync_s = 0;
};

// The store under options.directory is removed whatever happens: an error, `stop`, or memory that
// cannot be had (kResourceExhausted; never an exception).
Result<SwapBenchResult> RunSwapBench(const SwapBenchOptions& options);

}  // namespace memplan::bench
