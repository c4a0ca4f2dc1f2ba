#include "offload/cpu_optimizer_bench.h"

#include <chrono>
#include <cstdlib>
#include <memory>
#include <new>
#include <string>

namespace memplan::offload {
namespace {

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
template <typename T>
using Buffer = std::unique_ptr<T[], FreeDeleter>;

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
  using Clock = std::chrono::steady_clock;
  auto start = Clock::now();
  int steps = 0;
  double elapsed = 0;
  while (steps < options.min_steps || elapsed < options.seconds) {
    MEMPLAN_RETURN_IF_ERROR(optimizer->AdamStep(adam, step++, tensors));
    ++steps;
    elapsed = std::chrono::duration<double>(Clock::now() - start).count();
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

}  // namespace memplan::offload
