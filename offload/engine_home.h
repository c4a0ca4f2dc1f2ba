// The engine's optimizer homes (Note [Two optimizer homes] in engine_home.cc): where the fp32
// master weights, optimizer states and gradients live, behind one interface, so that the gradient
// path (engine_gradients.h) and the write-back do not care which one runs. Owned and called by the
// optimizer path (engine_optimizer.h); internal to offload/ (not installed).
//
// Threads: a home is called from the trainer's thread, except WriteGradients(), DirectGradients()
// and StepSubGroup(), which the gradient thread calls for the sub-groups it completes while the
// trainer's thread does not touch them (Note [Optimizer overlapped with backward] in engine.cc).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/clock.h"
#include "common/status.h"
#include "offload/cpu_optimizer.h"
#include "offload/engine.h"
#include "offload/half.h"
#include "offload/optimizer_swapper.h"

namespace memplan::offload::internal {

// The optimizer's 16-bit output for working parameters of `type`; kNone for fp32, whose working
// copy is the master weights themselves (Note [fp32 working parameters] in engine_params.cc).
HalfDtype ToHalf(ElementType type);

// The optimizer's home (Note [Two optimizer homes]).
class OptimizerHome {
 public:
  virtual ~OptimizerHome() = default;
  virtual uint64_t sub_group_elements() const = 0;
  virtual uint64_t sub_group_count() const = 0;
  virtual uint64_t SubGroupSize(uint64_t sg) const = 0;
  virtual Status WriteGradients(uint64_t sg, std::span<const float> grads) = 0;
  // Where sub-group sg's gradients can be written in place (then WriteGradients is given this
  // same span and copies nothing); empty when the home has no such buffer.
  virtual std::span<float> DirectGradients(uint64_t /*sg*/) { return {}; }
  // `options`: per parameter group (Note [Parameter groups]); `segments`: per-parameter step
  // counts, groups and skipped parameters (Note [Skipped parameters]); null: every element at the
  // home's epoch + 1 with options[0].
  virtual Status Step(std::span<const SwapStepOptions> options, const UpdateCallback& on_update,
                      const SegmentFn& segments) = 0;
  // Elements [offset, offset + out.size()) of sub-group sg's array (0 the master weights, 1.. the
  // states) at the last step.
  virtual Status ReadRange(uint64_t sg, int array, uint64_t offset, std::span<float> out) = 0;
  Status ReadParams(uint64_t sg, std::span<float> out) { return ReadRange(sg, 0, 0, out); }
  // Replaces the arrays `arrays` says of every sub-group from `fill`, all or nothing, as one step
  // of the home's epoch (Note [Optimizer state in checkpoints]).
  virtual Status Load(const OptimizerSwapper::ArrayFiller& fill, std::span<const bool> arrays) = 0;
  // Forgets the gradients of a step the trainer abandoned.
  virtual void DiscardGradients() = 0;
  // What the store holds (Note [What a store holds]); empty in memory.
  virtual std::string identity() const { return {}; }
  // The overlapped step (Note [Optimizer overlapped with backward]), as the OptimizerSwapper's
  // calls of the same names; only a home that CanOverlap() has them.
  virtual bool CanOverlap() const { return false; }
  virtual Status BeginStep(std::span<const SwapStepOptions> /*options*/,
                           const UpdateCallback& /*on_update*/) {
    return Status::Unimplemented("engine: this optimizer home steps serially");
  }
  virtual Status StepSubGroup(uint64_t /*sg*/, std::span<const float> /*grads*/,
                              std::vector<StepSegment> /*segments*/, std::function<void()> /*done*/,
                              bool /*store*/) {
    return Status::Unimplemented("engine: this optimizer home steps serially");
  }
  virtual uint64_t SubGroupsUpdated() const { return 0; }
  virtual Status WaitForUpdates() { return Status::Ok(); }
  // `commit` false: run to its end and dropped, the stored gradients kept (a redo).
  virtual Status FinishStep(bool /*commit*/) { return Status::Ok(); }
  virtual void AbortStep() {}
  virtual void StopStoringGradients() {}
  // The last step's stage times (the swapper's; the in-memory home fills compute only).
  virtual SwapStepStats last_step() const = 0;
  virtual uint64_t epoch() const = 0;
  virtual uint64_t pinned_bytes() const = 0;
  virtual uint64_t read_bytes() const = 0;
  virtual uint64_t write_bytes() const = 0;
  // Gradients written to the store for a serial step (read back by it: in read_bytes).
  virtual uint64_t grad_write_bytes() const { return 0; }
  // The optimizer store's own counters (gradients included); 0 in memory.
  virtual nvme::SwapStoreStats store_stats() const { return {}; }
  virtual Status Close() = 0;
};

// The optimizer on NVMe: the OptimizerSwapper `swapper`.
std::unique_ptr<OptimizerHome> MakeNvmeHome(std::unique_ptr<OptimizerSwapper> swapper);

// The optimizer in host memory (ZeRO-Offload): `n` elements in sub-groups of `sub_group`, the
// master weights from `fill`.
Result<std::unique_ptr<OptimizerHome>> MakeMemoryHome(SwapOptimizer optimizer, HalfDtype half,
                                                      const CpuOptimizerOptions& cpu_options,
                                                      uint64_t n, uint64_t sub_group,
                                                      const ParamFiller& fill);

// FailedPrecondition when another process, or another engine of this one, holds the swap store in
// `dir` (its flock); `what` names the store ("parameter", "optimizer").
Status RefuseLiveStore(const std::string& dir, std::string_view what);

}  // namespace memplan::offload::internal
