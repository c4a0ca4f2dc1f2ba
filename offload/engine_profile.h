// The engine's step profile: where a step's time went (EngineStats::step_profile, Note
// [Optimizer overlapped with backward] in engine.cc), from the timings the other parts take as
// the step runs. One of the parts Engine::Impl wires together (engine.cc); internal to offload/
// (not installed).
//
// Threads: the trainer's thread only (GradReady(), PrepareStep(), Step()), so it has no mutex.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "offload/engine.h"
#include "offload/engine_home.h"

namespace memplan::offload::internal {

struct StepProfile {
  // Records the step that began at `start` into stats.step_profile; `before_step` sub-groups were
  // updated before Step() was called, `clipping` how the step clipped. Ends the step's timings.
  void Record(EngineStats& stats, const OptimizerHome& optimizer,
              std::chrono::steady_clock::time_point start, bool overlapped, uint64_t before_step,
              const std::string& clipping);

  std::chrono::steady_clock::time_point prepared_at;  // PrepareStep()'s call
  double stall_s = 0;  // GradReady() blocked this step (waiting for a staging slot)
  double norm_s = 0;   // this step's gradient norm: time spent measuring it
};

}  // namespace memplan::offload::internal
