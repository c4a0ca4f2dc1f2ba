#include "bench/swap_bench.h"

#include <stdlib.h>
#include <sys/statvfs.h>

#include <cerrno>
#include <cstdio>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <new>
#include <vector>

#include "common/byte_size.h"
#include "bench/nvme_bench.h"
#include "offload/half.h"
#include "offload/optimizer_swapper.h"

namespace memplan::bench {

using offload::AdamOptions;
using offload::AdamTensors;
using offload::CpuOptimizer;
using offload::CpuOptimizerOptions;
using offload::FloatToBf16;
using offload::FloatToFp16;
using offload::HalfDtype;
using offload::OptimizerSwapper;
using offload::OptimizerSwapperOptions;
using offload::OptimizerSwapperStats;
using offload::SwapOptimizer;
using offload::SwapStepStats;

namespace {

using Clock = std::chrono::steady_clock;

Status Stopped(const SwapBenchOptions& options) {
  if (options.stop != nullptr && options.stop->load(std::memory_order_relaxed)) {
    return Status::Unavailable("interrupted");
  }
  return Status::Ok();
}

double Since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// A directory made for the bench and removed with everything in it, whatever happens.
class ScratchDir {
 public:
  static Result<ScratchDir> Make(const std::string& parent) {
    std::string pattern = parent + "/memplan-swap-bench.XXXXXX";
    if (::mkdtemp(pattern.data()) == nullptr) {
      return Status::FromErrno(errno, "cannot make a bench directory in " + parent);
    }
    return ScratchDir(pattern);
  }
  ScratchDir(ScratchDir&& other) noexcept : path_(std::move(other.path_)) { other.path_.clear(); }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  ScratchDir& operator=(ScratchDir&&) = delete;
  ~ScratchDir() {
    if (path_.empty()) return;
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  explicit ScratchDir(std::string path) : path_(std::move(path)) {}
  std::string path_;
};

// Seconds of one in-memory AdamW pass over `params` elements, sub-group by sub-group (the mean of
// `steps` passes after a warm-up).
Result<double> ComputeSeconds(const SwapBenchOptions& options) {
  CpuOptimizerOptions cpu_options;
  cpu_options.threads = options.threads;
  MEMPLAN_ASSIGN_OR_RETURN(auto cpu, CpuOptimizer::Create(cpu_options));
  const uint64_t sg = options.sub_group_elements;
  std::vector<float> p(sg, 0.25f), g(sg, 0.01f), m(sg, 0.0f), v(sg, 0.0f);
  std::vector<uint16_t> g16(sg, FloatToBf16(0.01f));
  AdamOptions adam;
  int64_t t = 1;
  auto pass = [&]() -> Status {
    for (uint64_t first = 0; first < options.params; first += sg) {
      MEMPLAN_RETURN_IF_ERROR(Stopped(options));
      const size_t n = std::min(sg, options.params - first);
      AdamTensors tensors;
      tensors.params = {p.data(), n};
      if (options.grad_dtype == HalfDtype::kNone) {
        tensors.grads = {g.data(), n};
      } else {
        tensors.half_grads = {g16.data(), n};
        tensors.grad_dtype = options.grad_dtype;
      }
      tensors.exp_avg = {m.data(), n};
      tensors.exp_avg_sq = {v.data(), n};
      MEMPLAN_RETURN_IF_ERROR(cpu->AdamStep(adam, t++, tensors));
    }
    return Status::Ok();
  };
  MEMPLAN_RETURN_IF_ERROR(pass());
  const auto start = Clock::now();
  for (int s = 0; s < options.steps; ++s) MEMPLAN_RETURN_IF_ERROR(pass());
  return Since(start) / options.steps;
}

}  // namespace

Status SwapBenchOptions::Validate() const {
  if (directory.empty()) return Status::InvalidArgument("the bench directory is empty");
  if (sub_group_elements == 0 || sub_group_elements % 1024 != 0) {
    return Status::InvalidArgument("sub-group elements must be a positive multiple of 1024");
  }
  if (params < sub_group_elements || params > (uint64_t{1} << 36)) {
    return Status::InvalidArgument("params must be in [sub-group elements, 2^36], got " +
                                   std::to_string(params));
  }
  if (buffer_count < 2) return Status::InvalidArgument("buffers must be at least 2");
  if (threads < 1 || threads > 4096) return Status::InvalidArgument("threads must be in 1..4096");
  if (steps < 1) return Status::InvalidArgument("steps must be at least 1");
  if (block_size < 4096 || block_size % 4096 != 0) {
    return Status::InvalidArgument("block size must be a multiple of 4096");
  }
  if (queue_depth < 1 || queue_depth > 4096) {
    return Status::InvalidArgument("queue depth must be in 1..4096");
  }
  if (io_threads < 1 || io_threads > 64) {
    return Status::InvalidArgument("I/O threads must be in 1..64");
  }
  for (const auto& bw : {read_bytes_per_s, write_bytes_per_s}) {
    if (bw && !(*bw > 0)) return Status::InvalidArgument("bandwidths must be > 0");
  }
  return Status::Ok();
}

namespace {

// The device's read and write bandwidth at the store's block size and queue depth, into `r`: the
// options' figures where both are given, else an NVMe bench of one point in `directory`.
Status MeasureBandwidth(const SwapBenchOptions& options, const std::string& directory,
                        SwapBenchResult* r) {
  if (options.read_bytes_per_s && options.write_bytes_per_s) {
    r->read_bytes_per_s = *options.read_bytes_per_s;
    r->write_bytes_per_s = *options.write_bytes_per_s;
    return Status::Ok();
  }
  NvmeBenchOptions bench;
  bench.directory = directory;
  bench.size_bytes = std::min<uint64_t>(uint64_t{1} << 30, r->state_bytes / 4096 * 4096);
  bench.size_bytes = std::max<uint64_t>(bench.size_bytes, options.block_size);
  bench.seconds_per_point = 3.0;
  bench.direct = options.direct;
  bench.backends = {options.backend};
  bench.block_sizes = {options.block_size};
  bench.queue_depths = {options.queue_depth};
  bench.threads = {options.io_threads};
  bench.stop = options.stop;
  MEMPLAN_ASSIGN_OR_RETURN(NvmeBenchReport report, RunNvmeBench(bench));
  MEMPLAN_RETURN_IF_ERROR(Stopped(options));
  if (report.best < 0) return Status::Internal("the NVMe bench measured nothing");
  const NvmeBenchResult& best = report.results[static_cast<size_t>(report.best)];
  r->read_bytes_per_s = options.read_bytes_per_s.value_or(best.read_bytes_per_s());
  r->write_bytes_per_s = options.write_bytes_per_s.value_or(best.write_bytes_per_s());
  r->bandwidth_measured = true;
  return Status::Ok();
}

// The swapper the bench steps: AdamW over a store in `directory`, as the options configure it.
OptimizerSwapperOptions SwapperOptions(const SwapBenchOptions& options,
                                       const std::string& directory) {
  OptimizerSwapperOptions so;
  so.store.directory = directory;
  so.store.direct = options.direct;
  so.store.backend = options.backend;
  so.store.backend_options.queue_depth = options.queue_depth;
  so.store.engine_options.block_size = options.block_size;
  so.store.engine_options.threads = options.io_threads;
  so.sub_group_elements = options.sub_group_elements;
  so.buffer_count = options.buffer_count;
  so.optimizer = SwapOptimizer::kAdam;
  so.grad_dtype = options.grad_dtype;
  so.register_buffers = options.register_buffers;
  so.cpu.threads = options.threads;
  return so;
}

// The pipelined optimizer step over a store in `directory`: a warm-up step, then options.steps
// timed ones, each after every sub-group's gradients are written; their times, the last step's
// traffic and stage times, and the swapper's configuration as it ran, into `r`.
Status MeasureSwappedSteps(const SwapBenchOptions& options, const std::string& directory,
                           SwapBenchResult* r) {
  MEMPLAN_ASSIGN_OR_RETURN(
      auto swapper, OptimizerSwapper::Create(SwapperOptions(options, directory), options.params,
                                             [&](uint64_t, std::span<float> out) {
                                               std::fill(out.begin(), out.end(), 0.25f);
                                               return Stopped(options);
                                             }));
  std::vector<float> grads(options.sub_group_elements, 0.01f);
  std::vector<uint16_t> half_grads(
      options.sub_group_elements,
      options.grad_dtype == HalfDtype::kFp16 ? FloatToFp16(0.01f) : FloatToBf16(0.01f));
  auto write_grads = [&]() -> Status {
    for (uint64_t i = 0; i < swapper->sub_group_count(); ++i) {
      MEMPLAN_RETURN_IF_ERROR(Stopped(options));
      const size_t n = swapper->SubGroupSize(i);
      MEMPLAN_RETURN_IF_ERROR(
          options.grad_dtype == HalfDtype::kNone
              ? swapper->WriteGradients(i, std::span<const float>(grads.data(), n))
              : swapper->WriteHalfGradients(i, std::span<const uint16_t>(half_grads.data(), n)));
    }
    return Status::Ok();
  };
  double total = 0;
  for (int s = 0; s <= options.steps; ++s) {
    MEMPLAN_RETURN_IF_ERROR(write_grads());
    AdamOptions adam;
    MEMPLAN_RETURN_IF_ERROR(swapper->Step(adam));
    const SwapStepStats& last = swapper->stats().last_step;
    if (s == 0) continue;  // warm-up
    total += last.total_s;
    r->step_seconds_min = s == 1 ? last.total_s : std::min(r->step_seconds_min, last.total_s);
  }
  const OptimizerSwapperStats stats = swapper->stats();
  r->step_seconds = total / options.steps;
  r->read_bytes_per_step = stats.last_step.read_bytes;
  r->write_bytes_per_step = stats.last_step.write_bytes;
  r->stage_read_s = stats.last_step.read_s;
  r->stage_write_s = stats.last_step.write_s;
  r->stage_compute_s = stats.last_step.compute_s;
  r->compute_wait_s = stats.last_step.compute_wait_s;
  r->sync_s = stats.last_step.sync_s;
  r->pinned_bytes = stats.pool.capacity_bytes;
  r->backend = stats.store.backend;
  r->registered_ops = stats.store.io.registered_ops;
  r->direct = stats.store.direct;
  return swapper->Close();
}

Result<SwapBenchResult> Run(const SwapBenchOptions& options) {
  MEMPLAN_ASSIGN_OR_RETURN(ScratchDir scratch, ScratchDir::Make(options.directory));

  SwapBenchResult r;
  r.params = options.params;
  r.sub_group_elements = options.sub_group_elements;
  r.sub_groups = (options.params + options.sub_group_elements - 1) / options.sub_group_elements;
  r.buffer_count = options.buffer_count;
  r.threads = options.threads;
  r.io_threads = options.io_threads;
  r.grad_dtype = options.grad_dtype;
  r.register_buffers = options.register_buffers;
  r.steps = options.steps;
  r.state_bytes = 12 * options.params;
  // 1. The device's bandwidth; 2. the optimizer alone; 3. the pipelined step over the store.
  MEMPLAN_RETURN_IF_ERROR(MeasureBandwidth(options, scratch.path(), &r));
  MEMPLAN_ASSIGN_OR_RETURN(r.compute_seconds, ComputeSeconds(options));
  MEMPLAN_RETURN_IF_ERROR(MeasureSwappedSteps(options, scratch.path() + "/store", &r));
  r.io_seconds =
      r.read_bytes_per_step / r.read_bytes_per_s + r.write_bytes_per_step / r.write_bytes_per_s;
  r.ratio = r.step_seconds / std::max(r.io_seconds, r.compute_seconds);
  return r;
}

}  // namespace

namespace {

// MemAvailable of /proc/meminfo in bytes; 0 when it cannot be read (then nothing is checked).
uint64_t MemAvailableBytes() {
  std::ifstream meminfo("/proc/meminfo");
  std::string line;
  while (std::getline(meminfo, line)) {
    unsigned long long kib = 0;
    if (std::sscanf(line.c_str(), "MemAvailable: %llu kB", &kib) == 1) return kib * 1024;
  }
  return 0;
}

// Note [Bench swap resources]: what the flags ask for is checked against the machine before
// anything is allocated or written, so that a size it cannot hold is one line and exit 2 rather
// than an allocation failure part-way (which valgrind, or an overcommitting kernel's OOM killer,
// turns into a crash) or a disk filled to ENOSPC. RAM: the swapper's pinned buffers (value, fp32
// and 16-bit gradients: about 18 bytes an element each), the compute reference's four fp32 arrays
// and the gradient source vectors, per sub-group element. Disk: two state slots of 12 bytes and
// the gradients, per parameter, plus the bandwidth file (at most 1 GiB).
Status CheckResources(const SwapBenchOptions& options) {
  const uint64_t sg = options.sub_group_elements;
  const double ram = static_cast<double>(sg) * (20.0 * options.buffer_count + 32.0);
  if (const uint64_t available = MemAvailableBytes();
      available > 0 && ram > static_cast<double>(available)) {
    return Status::ResourceExhausted(
        "not enough memory: " + std::to_string(options.buffer_count) +
        " buffers of sub-groups of " + std::to_string(sg) + " elements need about " +
        FormatByteSize(static_cast<uint64_t>(std::min(ram, 0x1p63))) + " of RAM, " +
        FormatByteSize(available) + " is available (use a smaller --sub-group or --buffers)");
  }
  struct statvfs fs {};
  if (::statvfs(options.directory.c_str(), &fs) == 0) {
    const double disk = 28.0 * static_cast<double>(options.params) + 0x1p30;
    const double free_bytes = static_cast<double>(fs.f_bavail) * static_cast<double>(fs.f_frsize);
    if (disk > free_bytes) {
      return Status::ResourceExhausted(
          "not enough disk at " + options.directory + ": " + std::to_string(options.params) +
          " parameters need about " +
          FormatByteSize(static_cast<uint64_t>(std::min(disk, 0x1p63))) + ", " +
          FormatByteSize(static_cast<uint64_t>(free_bytes)) + " is free (use a smaller --params)");
    }
  }
  return Status::Ok();
}

}  // namespace

Result<SwapBenchResult> RunSwapBench(const SwapBenchOptions& options) {
  MEMPLAN_RETURN_IF_ERROR(options.Validate());
  MEMPLAN_RETURN_IF_ERROR(CheckResources(options));
  // The buffers are as large as the flags say; a size this machine cannot hold ends here, with the
  // scratch directory already removed by the unwinding.
  try {
    return Run(options);
  } catch (const std::bad_alloc&) {
    return Status::ResourceExhausted("not enough memory for " + std::to_string(options.params) +
                                     " parameters in sub-groups of " +
                                     std::to_string(options.sub_group_elements) +
                                     " (about 16 bytes each in RAM)");
  }
}

}  // namespace memplan::bench
