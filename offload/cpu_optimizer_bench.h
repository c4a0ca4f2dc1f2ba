// Throughput of the CPU AdamW step on this machine: the measuring behind `memplan bench adam` and
// bench/adam_vs_torch.py. Memory-bound, so the figure to compare is bytes_per_s against the
// machine's memory bandwidth (a STREAM triad), not FLOPs.
//
// Thread safety: RunAdamBench may be called from any thread; it uses options.threads threads.
#pragma once

#include <cstdint>
#include <optional>

#include "common/status.h"
#include "offload/cpu_optimizer.h"

namespace memplan::offload {

struct AdamBenchOptions {
  // Parameters updated per step (>= 1). Default 50M, large enough to defeat the caches.
  uint64_t params = 50'000'000;
  // As CpuOptimizerOptions::threads. Default 1.
  int threads = 1;
  // Also write the updated params as bf16 or fp16 (kNone: fp32 only). Default kNone.
  HalfDtype half_dtype = HalfDtype::kNone;
  // Kernel; empty: the best available.
  std::optional<Isa> isa;
  // Time spent in timed steps (>= 0); at least min_steps steps run. Default 2 s.
  double seconds = 2.0;
  // Timed steps at least (>= 1), after one untimed warm-up step. Default 3.
  int min_steps = 3;

  Status Validate() const;
};

struct AdamBenchResult {
  Isa isa = Isa::kScalar;
  int threads = 1;
  uint64_t params = 0;
  HalfDtype half_dtype = HalfDtype::kNone;
  int steps = 0;                // timed steps
  double seconds = 0;           // time of the timed steps
  uint64_t bytes_per_step = 0;  // 28 per param (read p, g, m, v; write p, m, v) + 2 with half
  double params_per_s = 0;
  double bytes_per_s = 0;
};

// Allocates the four fp32 arrays (16 bytes per param, plus 2 with a half copy), runs AdamW steps
// and times them. ResourceExhausted when the memory cannot be had; InvalidArgument on bad options.
Result<AdamBenchResult> RunAdamBench(const AdamBenchOptions& options);

}  // namespace memplan::offload
