#include "bench/adam_bench.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <new>
#include <string>
#include <thread>
#include <vector>

namespace memplan::bench {

using offload::AdamOptions;
using offload::AdamTensors;
using offload::CpuOptimizer;
using offload::CpuOptimizerOptions;
using offload::HalfDtype;

namespace {

struct AlignedFree {
  void operator()(void* p) const { std::free(p); }
};
template <typename T>
using Buffer = std::unique_ptr<T[], AlignedFree>;

// Cache-line aligned, uninitialised (the optimizer's threads touch it first).
template <typename T>
Buffer<T> Allocate(uint64_t count) {
  size_t bytes = (count * sizeof(T) + 63) / 64 * 64;
  return Buffer<T>(static_cast<T*>(std::aligned_alloc(64, bytes)));
}

}  // namespace

Status AdamBenchOptions::Validate() const {
  if (params == 0 || params > (uint64_t{1} << 36)) {
    return Status::InvalidArgument("params: must be in [1, 2^36], got " + std::to_string(params));
  }
  if (!(seconds >= 0 && seconds <= 86400)) {
    return Status::InvalidArgument("seconds: must be in [0, 86400]");
  }
  if (min_steps < 1) return Status::InvalidArgument("min_steps: must be >= 1");
  CpuOptimizerOptions optimizer;
  optimizer.threads = threads;
  optimizer.isa = isa;
  return optimizer.Validate();
}

Result<AdamBenchResult> RunAdamBench(const AdamBenchOptions& options) {
  MEMPLAN_RETURN_IF_ERROR(options.Validate());
  CpuOptimizerOptions optimizer_options;
  optimizer_options.threads = options.threads;
  optimizer_options.isa = options.isa;
  MEMPLAN_ASSIGN_OR_RETURN(std::unique_ptr<CpuOptimizer> optimizer,
                           CpuOptimizer::Create(optimizer_options));
  uint64_t n = options.params;
  Buffer<float> params = Allocate<float>(n);
  Buffer<float> grads = Allocate<float>(n);
  Buffer<float> exp_avg = Allocate<float>(n);
  Buffer<float> exp_avg_sq = Allocate<float>(n);
  Buffer<uint16_t> half;
  if (options.half_dtype != HalfDtype::kNone) half = Allocate<uint16_t>(n);
  bool have_half = options.half_dtype == HalfDtype::kNone || half != nullptr;
  if (!params || !grads || !exp_avg || !exp_avg_sq || !have_half) {
    return Status::ResourceExhausted("cannot allocate the bench arrays for " + std::to_string(n) +
                                     " params (" + std::to_string(n * 18 / (1 << 20)) + " MiB)");
  }
  // Values that keep every step finite; the kernel's speed does not depend on them.
  for (uint64_t i = 0; i < n; ++i) {
    params[i] = 0.5f - static_cast<float>(i % 1024) * (1.0f / 1024);
    grads[i] = static_cast<float>(i % 977) * (1.0f / 977) - 0.5f;
    exp_avg[i] = 0;
    exp_avg_sq[i] = 0;
  }
  AdamTensors tensors;
  tensors.params = {params.get(), n};
  tensors.grads = {grads.get(), n};
  tensors.exp_avg = {exp_avg.get(), n};
  tensors.exp_avg_sq = {exp_avg_sq.get(), n};
  if (half) tensors.half_params = {half.get(), n};
  tensors.half_dtype = options.half_dtype;
  AdamOptions adam;

  int64_t step = 1;
  MEMPLAN_RETURN_IF_ERROR(optimizer->AdamStep(adam, step++, tensors));  // warm-up: page faults
  auto start = std::chrono::steady_clock::now();
  int steps = 0;
  double elapsed = 0;
  while (steps < options.min_steps || elapsed < options.seconds) {
    MEMPLAN_RETURN_IF_ERROR(optimizer->AdamStep(adam, step++, tensors));
    ++steps;
    elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }

  AdamBenchResult result;
  result.isa = optimizer->isa();
  result.threads = optimizer->threads();
  result.params = n;
  result.half_dtype = options.half_dtype;
  result.steps = steps;
  result.seconds = elapsed;
  result.bytes_per_step = n * (28 + (options.half_dtype == HalfDtype::kNone ? 0 : 2));
  result.params_per_s = static_cast<double>(n) * steps / elapsed;
  result.bytes_per_s = static_cast<double>(result.bytes_per_step) * steps / elapsed;
  return result;
}

Status TriadBenchOptions::Validate() const {
  if (elements < 1024 || elements > (uint64_t{1} << 34)) {
    return Status::InvalidArgument("triad elements: must be in [1024, 2^34], got " +
                                   std::to_string(elements));
  }
  if (threads < 1 || threads > 4096) return Status::InvalidArgument("triad threads: 1..4096");
  if (repeats < 1) return Status::InvalidArgument("triad repeats: must be >= 1");
  return Status::Ok();
}

namespace {

// One triad pass over [begin, end).
void TriadRange(double* a, const double* b, const double* c, double scalar, uint64_t begin,
                uint64_t end) {
  for (uint64_t i = begin; i < end; ++i) a[i] = b[i] + scalar * c[i];
}

// Runs fn(part_begin, part_end) on `threads` threads over [0, n), the caller taking part 0, and
// returns when all are done. Parts are contiguous and 64-element aligned, the same on every call,
// so each thread keeps touching the memory it first touched.
template <typename Fn>
void Parallel(int threads, uint64_t n, Fn fn) {
  std::vector<std::thread> workers;
  const uint64_t chunk = (n / threads + 63) / 64 * 64;
  for (int t = 1; t < threads; ++t) {
    const uint64_t begin = std::min(n, chunk * t), end = std::min(n, chunk * (t + 1));
    workers.emplace_back([=] { fn(begin, end); });
  }
  fn(0, std::min(n, chunk));
  for (auto& w : workers) w.join();
}

}  // namespace

Result<TriadBenchResult> RunTriadBench(const TriadBenchOptions& options) {
  MEMPLAN_RETURN_IF_ERROR(options.Validate());
  const uint64_t n = options.elements;
  Buffer<double> a = Allocate<double>(n), b = Allocate<double>(n), c = Allocate<double>(n);
  if (!a || !b || !c) {
    return Status::ResourceExhausted("cannot allocate the triad's arrays (" +
                                     std::to_string(n * 24 / (1 << 20)) + " MiB)");
  }
  double* pa = a.get();
  double* pb = b.get();
  double* pc = c.get();
  Parallel(options.threads, n, [=](uint64_t begin, uint64_t end) {
    for (uint64_t i = begin; i < end; ++i) {
      pa[i] = 0.0;
      pb[i] = 1.0;
      pc[i] = 2.0;
    }
  });
  const double scalar = 3.0;
  Parallel(options.threads, n,
           [=](uint64_t x, uint64_t y) { TriadRange(pa, pb, pc, scalar, x, y); });
  TriadBenchResult result;
  result.threads = options.threads;
  result.elements = n;
  result.repeats = options.repeats;
  result.bytes_per_pass = 24 * n;
  double total = 0;
  for (int r = 0; r < options.repeats; ++r) {
    const auto start = std::chrono::steady_clock::now();
    Parallel(options.threads, n,
             [=](uint64_t x, uint64_t y) { TriadRange(pa, pb, pc, scalar, x, y); });
    const double elapsed =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    total += elapsed;
    result.best_bytes_per_s = std::max(result.best_bytes_per_s, result.bytes_per_pass / elapsed);
  }
  // Use the result so the passes cannot be optimised away.
  if (pa[n / 2] != 1.0 + scalar * 2.0) return Status::Internal("triad computed a wrong value");
  result.mean_bytes_per_s = result.bytes_per_pass * options.repeats / total;
  return result;
}

}  // namespace memplan::bench
