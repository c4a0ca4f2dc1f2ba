// Collective: the seam through which the offload engine gathers parameter partitions and reduces
// gradients across the data-parallel ranks (ZeRO-3).
//
// Two implementations:
//   - CreateSingleProcessCollective(): world size 1. All-gather and reduce-scatter are copies
//     (through the runtime's memory, so device buffers work), all-reduce is a no-op.
//   - CreateNcclCollective() (built where NCCL is found): ncclAllGather / ncclReduceScatter /
//     ncclAllReduce on the runtime's device, on the collective's own stream; the ranks agree on a
//     ncclUniqueId out of band (the caller passes it, e.g. through a file or the launcher).
//
// Buffers are device buffers of the Runtime the collective was made with. Every call is
// synchronous from the caller's view: it returns when the result is in `recv` (the NCCL version
// synchronises its stream), which keeps the engine's ordering simple; overlap comes from running
// collectives on the engine's transfer threads, not from the caller's. A collective is not ordered
// after the runtime's copy streams: Wait for the copies that fill `send` before the call. The
// single-process all-gather and reduce-scatter take a kDeviceToDevice ticket of the runtime.
//
// Thread safety: one call at a time per Collective (NCCL communicators are not thread-safe).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "common/status.h"
#include "gpu/gpu_runtime.h"
#include "schedule/enums.h"

namespace memplan::offload {

// ElementType (fp32, bf16, fp16) and its names are in schedule/enums.h: a Schedule names one.
int ElementBytes(ElementType type);  // 4, 2, 2; 0 for a value outside the enum

class Collective {
 public:
  virtual ~Collective() = default;
  virtual std::string_view Name() const = 0;  // "single-process", "nccl"
  virtual int rank() const = 0;
  virtual int world_size() const = 0;

  // recv (count * world_size elements) = the ranks' send buffers (count elements each), in rank
  // order.
  virtual Status AllGather(const void* send, void* recv, uint64_t count, ElementType type) = 0;
  // recv (count elements) = the sum over ranks of their send[rank * count, (rank + 1) * count).
  virtual Status ReduceScatter(const void* send, void* recv, uint64_t count, ElementType type) = 0;
  // buffer (count elements) = the sum over ranks, in place.
  virtual Status AllReduce(void* buffer, uint64_t count, ElementType type) = 0;
};

// World size 1 over `runtime` (not owned; must outlive the collective; null means
// gpu::DefaultHostOnlyRuntime()).
std::unique_ptr<Collective> CreateSingleProcessCollective(gpu::Runtime* runtime);

struct NcclOptions {
  // The longest any wait for the other ranks may take: creating the communicator (every rank must
  // join) and each collective. Past it the communicator is aborted and the call fails with IoError
  // naming the rank, the call and the wait, instead of hanging. Default 10 minutes (PyTorch's).
  std::chrono::milliseconds timeout{std::chrono::minutes(10)};
};

// NCCL over the CUDA runtime `runtime` (not owned; must outlive the collective), on its device
// (each rank's runtime on a GPU of its own: NCCL refuses two ranks on one GPU). `unique_id` is the
// 128-byte ncclUniqueId that rank 0 made with NcclUniqueId() and every rank was given; this blocks
// until all `world_size` ranks have joined, or options.timeout has passed (IoError). Unavailable
// without NCCL; InvalidArgument for a runtime that is not CUDA's, a rank outside [0, world_size)
// or an id of the wrong size. A call that fails inside NCCL (a peer died, the network failed) or
// outlasts the timeout aborts the communicator, and every later call is FailedPrecondition: make a
// new collective. bf16 calls on an NCCL older than 2.10 are Unimplemented.
Result<std::unique_ptr<Collective>> CreateNcclCollective(gpu::Runtime* runtime, int rank,
                                                         int world_size,
                                                         const std::string& unique_id,
                                                         const NcclOptions& options = {});
Result<std::string> NcclUniqueId();

}  // namespace memplan::offload
