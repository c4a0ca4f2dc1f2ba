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

namespace memplan::bench {

struct AdamBenchOptions {
  // Parameters updated per step (>= 1). Default 50M, large enough to defeat the caches.
  uint64_t params = 50'000'000;
  // As CpuOptimizerOptions::threads. Default 1.
  int threads = 1;
  // Also write the updated params as bf16 or fp16 (kNone: fp32 only). Default kNone.
  offload::HalfDtype half_dtype = offload::HalfDtype::kNone;
  // Kernel; empty: the best available.
  std::optional<offload::Isa> isa;
  // Time spent in timed steps (>= 0); at least min_steps steps run. Default 2 s.
  double seconds = 2.0;
  // Timed steps at least (>= 1), after one untimed warm-up step. Default 3.
  int min_steps = 3;

  Status Validate() const;
};

struct AdamBenchResult {
  offload::Isa isa = offload::Isa::kScalar;
  int threads = 1;
  uint64_t params = 0;
  offload::HalfDtype half_dtype = offload::HalfDtype::kNone;
  int steps = 0;                // timed steps
  double seconds = 0;           // time of the timed steps
  uint64_t bytes_per_step = 0;  // 28 per param (read p, g, m, v; write p, m, v) + 2 with half
  double params_per_s = 0;
  double bytes_per_s = 0;
};

struct TriadBenchOptions {
  // Elements of each of the three fp64 arrays (>= 1024). Default 32M (768 MiB in all, as much
  // memory as the default Adam bench's 50M params touch, and far more than any cache).
  uint64_t elements = uint64_t{32} << 20;
  int threads = 1;   // >= 1
  int repeats = 10;  // >= 1, after one untimed pass
  Status Validate() const;
};

struct TriadBenchResult {
  int threads = 1;
  uint64_t elements = 0;
  int repeats = 0;
  uint64_t bytes_per_pass = 0;  // 24 per element: read b and c, write a (STREAM's count)
  double best_bytes_per_s = 0;  // STREAM reports the best pass
  double mean_bytes_per_s = 0;
};

// The STREAM triad a[i] = b[i] + s * c[i] over fp64 arrays, compiled and split over `threads`
// threads as the optimizer splits its step (each thread first-touches its own part): the memory
// bandwidth an element-wise optimizer step can hope for on this machine.
Result<TriadBenchResult> RunTriadBench(const TriadBenchOptions& options);

// Allocates the four fp32 arrays (16 bytes per param, plus 2 with a half copy), runs AdamW steps
// and times them. ResourceExhausted when the memory cannot be had; InvalidArgument on bad options.
Result<AdamBenchResult> RunAdamBench(const AdamBenchOptions& options);

}  // namespace memplan::bench
