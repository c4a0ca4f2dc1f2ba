// The engine's step profile: see engine_profile.h.
#include "offload/engine_profile.h"

#include <algorithm>

namespace memplan::offload::internal {

// Note [Optimizer overlapped with backward]: where the step that began at `start` went.
void StepProfile::Record(EngineStats& stats, const OptimizerHome& optimizer,
                         std::chrono::steady_clock::time_point start, bool overlapped,
                         uint64_t before_step, const std::string& clipping) {
  const SwapStepStats last = optimizer.last_step();
  EngineStepProfile& p = stats.step_profile;
  p = EngineStepProfile();
  p.overlapped = overlapped;
  p.backward_s = overlapped ? std::chrono::duration<double>(start - prepared_at).count() : 0.0;
  p.step_s = stats.last_step_s;
  p.optimizer_s = last.compute_s;
  p.read_s = last.read_s;
  p.write_s = last.write_s;
  p.sync_s = last.sync_s;
  p.backward_wait_s = overlapped ? last.grad_wait_s : 0.0;
  p.stall_s = stall_s;
  p.sub_groups = optimizer.sub_group_count();
  p.sub_groups_before_step = before_step;
  p.overlapped_fraction =
      static_cast<double>(before_step) / static_cast<double>(std::max<uint64_t>(p.sub_groups, 1));
  p.clipping = clipping;
  p.norm_s = norm_s;
  stall_s = 0;
}

}  // namespace memplan::offload::internal
