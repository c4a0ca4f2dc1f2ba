// The engine's optimizer path: the optimizer's home (engine_home.h) and what a step needs of it
// beyond the gradients: the per-parameter step counts and skips (Note [Skipped parameters] in
// engine_optimizer.cc), the prepared step's state, and the hand-over of complete sub-groups to an
// optimizer stepping beside backward (Note [Optimizer overlapped with backward] in engine.cc). One
// of the parts Engine::Impl wires together (engine.cc); internal to offload/ (not installed).
//
// Threads: the trainer's thread, except HandOver() and TakeFreedBuffers(), which the gradient
// thread calls, and the done callbacks HandOver() gives the optimizer, which its compute thread
// runs. What they share is under overlap_mu. The step state (`prepared`, `overlap`, `keep_grads`,
// `no_gradient`, `param_steps`) is written by the trainer's thread only while the gradient thread
// is idle (before a step's first gradient is queued, after GradientPath::Drain()), and read by the
// gradient thread for the jobs queued after.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/mutex.h"
#include "common/status.h"
#include "offload/cpu_optimizer.h"
#include "offload/engine.h"
#include "offload/engine_home.h"
#include "offload/engine_params.h"
#include "offload/optimizer_swapper.h"

namespace memplan::offload::internal {

class OptimizerPath {
 public:
  OptimizerPath(const EngineOptions& engine_options, gpu::Runtime* gpu_runtime, ParamPath& params)
      : options(engine_options), runtime(gpu_runtime), param_path(params) {}

  // Start()'s: the optimizer's home for `total` elements, on the schedule's optimizer tier.
  Status CreateOptimizer(const std::string& nvme_dir, const CpuOptimizerOptions& cpu,
                         uint64_t total, RecoveryReport* report);

  // The gradient thread's: sub-group `sg` of an overlapped step is complete, in `grads`.
  Status HandOver(uint64_t sg, std::vector<float> grads) EXCLUDES(overlap_mu);
  // The gradient thread's: moves the buffers the optimizer has read into `into`.
  void TakeFreedBuffers(std::vector<std::vector<float>>& into) EXCLUDES(overlap_mu);
  // StopHandOvers() until AllowHandOvers(): the gradient thread drops what it would hand over.
  void StopHandOvers() EXCLUDES(overlap_mu);
  void AllowHandOvers() EXCLUDES(overlap_mu);

  std::vector<StepSegment> Segments(uint64_t sg);
  Status SaveStepCounts(uint64_t epoch, bool stepping, std::span<const uint64_t> loaded = {});
  Status LoadStepCounts(uint64_t epoch);
  Status ReadPartition(uint64_t first, std::span<float> out, int array = 0);

  // Step options (Note [Parameter groups] in engine.cc).
  static bool SameOptions(const StepOptions& options, uint32_t a, uint32_t b);
  static bool GroupsDiffer(const StepOptions& options);
  static double GradScale(const SwapStepOptions& o);
  static void SetGradScale(SwapStepOptions& o, double scale);

  const EngineOptions& options;
  gpu::Runtime* const runtime;
  ParamPath& param_path;
  std::unique_ptr<OptimizerHome> home;
  // Note [Skipped parameters]: per trainable parameter (by spec), torch's per-parameter step
  // count; NoGradient() marks; whether the counts may differ (then every Step() runs segmented).
  std::vector<uint64_t> param_steps;
  std::vector<uint8_t> no_gradient;  // bytes: the gradient thread reads its sub-groups' entries
  bool segmented = false;
  std::string steps_path;  // optimizer on NVMe: where the counts are kept for a resume
  // Note [Optimizer overlapped with backward]. `overlap` and `prepared` are the trainer thread's,
  // written only while the gradient thread is idle (before the step's first gradient is queued,
  // after DrainGradients()); the gradient thread reads `overlap` for the jobs queued after.
  bool prepared = false;  // PrepareStep() was called for the coming step
  bool overlap = false;   // ... and the optimizer runs it beside backward
  // ... and may have to run it again (clipping): its gradients also go to the NVMe store.
  bool keep_grads = false;
  StepOptions prepared_options;
  std::string clipping;       // step_profile.clipping of the step in progress
  bool last_clipped = false;  // the last step's clip coefficient was < 1 (or its norm not finite)
  // Sub-groups' gradients handed to the optimizer and not yet read by it: at most overlap_limit
  // (the optimizer's buffers and two more); the gradient thread waits beyond that.
  uint64_t overlap_limit = 0;

 private:
  Result<std::unique_ptr<OptimizerSwapper>> ReopenOptimizer(OptimizerSwapperOptions oo,
                                                            uint64_t total, RecoveryReport* report);
  Status OpenNvmeOptimizer(const std::string& nvme_dir, const CpuOptimizerOptions& cpu,
                           uint64_t total, RecoveryReport* report);
  Result<uint64_t> OldestEpoch(uint64_t epoch);

  Mutex overlap_mu;
  CondVar overlap_cv;
  uint64_t overlap_outstanding GUARDED_BY(overlap_mu) = 0;
  std::vector<std::vector<float>> overlap_free GUARDED_BY(overlap_mu);  // buffers read, to reuse
  bool overlap_abandoned GUARDED_BY(overlap_mu) = false;                // drop hand-overs
  // Hand-overs between their check of overlap_abandoned and the optimizer's StepSubGroup return:
  // the optimizer's step may not be abandoned (its run destroyed) while one is in flight.
  uint64_t overlap_handing GUARDED_BY(overlap_mu) = 0;
};

}  // namespace memplan::offload::internal
