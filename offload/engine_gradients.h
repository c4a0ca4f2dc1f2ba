// The engine's gradient path: each GradReady() gradient, reduce-scattered across the ranks (Note
// [Reduce-scattered gradients] in engine_gradients.cc), copied to the host through pinned staging
// slots (Note [Asynchronous gradients] below) and converted to fp32 by the gradient thread into
// the optimizer's sub-groups; each complete sub-group is measured for the norm (Note [Clipping by
// the global norm] in engine.cc) and handed to the optimizer path. One of the parts Engine::Impl
// wires together (engine.cc); internal to offload/ (not installed).
//
// Note [Asynchronous gradients]
// GradReady() orders the engine's device-to-host stream after the trainer's stream (a fence: the
// gradient's kernels may still be queued), queues the gradient's copy into pinned staging slots,
// a slot's worth at a time, and returns; no thread waits for the GPU there. The gradient thread
// waits for each slot's copy, converts to fp32 into the sub-group buffers, gives the slot back,
// and hands full sub-groups to the optimizer (for the NVMe optimizer that is a store write), so
// the trainer's backward pass does not wait for any of it; GradReady() waits only when every slot
// is taken. Pinned slots make the copies truly asynchronous (CUDA copies to pageable memory
// synchronously, through its own staging) and bound the host memory. On a runtime without a
// device there are no streams and nothing to pin: the gradient is copied whole into a recycled
// host buffer before GradReady() returns (so the caller's buffer is free at once) and converted by
// the gradient thread as above. Step() drains the queue first.
//
// Threads: the trainer's thread queues (Give()) and the gradient thread (RunGradients()) takes;
// the queue, the recycled host buffers, the free scratch buffers and the first error are under
// grad_mu. The gradient thread alone touches the sub-group buffers (grad_buffers,
// grad_buffer_free) and norm_parts while it runs; the trainer's thread touches them only once
// DrainGradients() has returned (the thread idle). grad_given and grads_missing are the trainer
// thread's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common/mutex.h"
#include "common/status.h"
#include "offload/cpu_optimizer.h"
#include "offload/engine.h"
#include "offload/engine_optimizer.h"
#include "offload/engine_params.h"
#include "offload/engine_profile.h"
#include "offload/pinned_pool.h"

namespace memplan::offload::internal {

class GradientPath {
 public:
  GradientPath(const EngineOptions& engine_options, gpu::Runtime* gpu_runtime, ParamPath& params,
               OptimizerPath& optimizer_path, StepProfile& step_profile)
      : options(engine_options),
        runtime(gpu_runtime),
        param_path(params),
        optimizer(optimizer_path),
        profile(step_profile) {}

  // Start()'s: the pinned staging (a runtime with a device; the pinned budget less `pinned_used`)
  // and, with world size > 1, the reduce-scatter's scratch; then every step's bookkeeping.
  Status Prepare(uint64_t pinned_used);
  void StartThread();

  // GradReady() once its arguments are checked: queues the gradient of `param` (an engine id).
  Status Give(ParamId param, const void* device_grad, ElementType type, gpu::Stream stream)
      EXCLUDES(grad_mu);
  // Completes the gradients of a parameter declared with NoGradient() with zeros.
  Status FeedZeros(size_t spec);
  // Waits until every queued gradient is in the optimizer; returns the first failure.
  Status DrainGradients() EXCLUDES(grad_mu);
  // This step's norm pieces: every sub-group's, in order, then every rank's, in rank order.
  // After DrainGradients().
  Result<GradientNormParts> NormOverRanks();
  // The first failure of this step's gradients (Ok when none).
  Status FirstError() const EXCLUDES(grad_mu);
  // Drops the step's gradients: the first failure, the partial sub-groups, what was given.
  // After DrainGradients().
  void DropStep() EXCLUDES(grad_mu);
  // The step's gradients back to "none given yet".
  void ResetGiven();
  uint64_t d2h_bytes_total() const EXCLUDES(grad_mu);
  // Stops the gradient thread and frees the staging and scratch buffers.
  void Close() EXCLUDES(grad_mu);

  const EngineOptions& options;
  gpu::Runtime* const runtime;
  ParamPath& param_path;
  OptimizerPath& optimizer;
  StepProfile& profile;
  // The trainer thread's: which parameters have their gradient (or NoGradient()) this step.
  std::vector<bool> grad_given;
  uint64_t grads_missing = 0;
  // Note [Clipping by the global norm]: per optimizer sub-group, the pieces of its gradients' norm,
  // measured by whoever completes the sub-group (the gradient thread; FeedZeros() on the trainer's
  // thread while the gradient thread is idle), read by the trainer thread after DrainGradients().
  std::vector<GradientNormParts> norm_parts;
  uint64_t reduce_scatter_bytes = 0;         // the trainer thread's (EngineStats)
  uint64_t grad_scratch_bytes = 0;           // each of the two scratch buffers
  std::unique_ptr<PinnedPool> grad_staging;  // kGradSlots pinned slots (a runtime with a device)

 private:
  struct GradBuffer {
    std::vector<float> data;
    uint64_t received = 0;
  };
  // One copy of a gradient (or of a slot's worth of it) to the host, for the gradient thread.
  struct GradJob {
    ParamId param = 0;
    ElementType type = ElementType::kFloat32;
    uint64_t first = 0;  // partition offset and element count of what `slot` receives: the
    uint64_t count = 0;  // parameter's shard (all of it for world size 1), a slot at a time
    gpu::CopyTicket ticket;
    PinnedSlot slot;              // a runtime with a device: the pinned staging slot
    std::vector<std::byte> host;  // the host-only runtime: a recycled host buffer
    void* scratch = nullptr;      // world size > 1, last slot of a gradient: the device buffer the
                                  // copies read from, free once this copy is done
    const std::byte* data() const { return slot.empty() ? host.data() : slot.data().data(); }
  };
  static constexpr uint64_t kGradSlots = 4;
  static constexpr uint64_t kMaxGradSlotBytes = uint64_t{4} << 20;
  static constexpr uint64_t kPageBytes = 4096;

  Status AllocateGradientScratch() EXCLUDES(grad_mu);
  Status CreateGradientStaging(uint64_t pinned_used);
  void RunGradients() EXCLUDES(grad_mu);
  Status Accumulate(const GradJob& job);
  std::vector<float> TakeGradBuffer(uint64_t size);
  Result<void*> ReduceScatterGradient(ParamId param, const void* device_grad, ElementType type,
                                      uint64_t count, gpu::Stream stream) EXCLUDES(grad_mu);
  Status QueueGradientCopies(ParamId param, ElementType type, uint64_t first, const std::byte* src,
                             uint64_t bytes, void* scratch) EXCLUDES(grad_mu);
  Status CopyGradientToHost(ParamId param, ElementType type, uint64_t first, const std::byte* src,
                            uint64_t bytes) EXCLUDES(grad_mu);
  Result<GradientNormParts> GatherNormParts(const GradientNormParts& mine);
  void StopGradients() EXCLUDES(grad_mu);

  mutable Mutex grad_mu;
  CondVar grad_cv;  // a job queued / finished, or stop
  std::deque<GradJob> grad_jobs GUARDED_BY(grad_mu);
  std::vector<std::vector<std::byte>> grad_free GUARDED_BY(grad_mu);  // recycled host buffers
  bool grad_busy GUARDED_BY(grad_mu) = false;
  bool grad_stop GUARDED_BY(grad_mu) = false;
  Status grad_error GUARDED_BY(grad_mu);  // the first failure
  uint64_t d2h_bytes GUARDED_BY(grad_mu) = 0;
  // World size > 1 (Note [Reduce-scattered gradients]): two device buffers of world_size times the
  // largest shard, allocated in Start(), and a device buffer of zeros for the padding.
  std::vector<void*> grad_scratch_free GUARDED_BY(grad_mu);
  std::vector<void*> grad_scratch_all;
  void* grad_zeros = nullptr;
  std::thread grad_worker;
  std::unordered_map<uint64_t, GradBuffer> grad_buffers;  // the gradient thread's only
  std::vector<std::vector<float>> grad_buffer_free;       // the gradient thread's only
};

}  // namespace memplan::offload::internal
