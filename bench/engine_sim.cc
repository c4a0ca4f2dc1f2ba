// engine_sim: a training loop simulated on the host-only GPU runtime, to measure how well the
// offload engine overlaps parameter fetches (NVMe -> pinned -> "GPU") with compute.
//
//   build/bench/engine_sim --path DIR [--layers 16] [--layer-elements 8388608]
//       [--compute-ms 20] [--steps 4] [--buffer-bytes 16M] [--buffer-count 4]
//       [--prefetch-bytes 64M] [--max-live-bytes 96M] [--backend auto] [--io-threads 1]
//       [--no-direct] [--optimizer-tier cpu|nvme] [--overlap] [--json]
//
// Each layer is one module with one bf16 weight of --layer-elements elements on NVMe. A step runs
// forward (Fetch, compute, Release per layer) and backward (the same in reverse, plus the
// gradient), then the optimizer step (CPU; its fp32 master weights and AdamW states in memory, or
// with --optimizer-tier nvme on NVMe, one sub-group per layer). With --overlap every step is
// prepared (Engine::PrepareStep) so the optimizer steps each layer's sub-group during backward,
// as soon as its gradient is in. "Compute" is a busy loop of --compute-ms per module pass.
// Printed per step (the first step only records the trace and is left out):
//   - pass time (forward + backward) and the stall time in it (Fetch() waiting for transfers);
//   - NVMe bytes read, and what they take at the drive's read bandwidth, measured in the same run
//     (bench::RunNvmeBench at the staging buffer size and queue depth);
//   - the ideal pass time, max(compute, I/O), and pass / ideal;
//   - the whole step (pass + Step()), and where the optimizer's time went (the engine's
//     step_profile: Step()'s wait, optimizer compute, state reads and writes, the optimizer
//     waiting for backward, GradReady() stalls, the sub-groups done before Step()).
// Acceptance (issue 6): with compute covering I/O, stall <= 5% of the pass; with --compute-ms 0
// (bandwidth-bound), pass within 10% of bytes / bandwidth.
#include <stdlib.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/byte_size.h"
#include "bench/nvme_bench.h"
#include "offload/engine.h"

namespace {

using memplan::Status;
using Clock = std::chrono::steady_clock;
namespace off = memplan::offload;

struct Flags {
  std::string path;
  int layers = 16;
  uint64_t layer_elements = uint64_t{8} << 20;
  double compute_ms = 20;
  int steps = 4;
  uint64_t buffer_bytes = uint64_t{16} << 20;
  uint32_t buffer_count = 4;
  uint64_t prefetch_bytes = uint64_t{64} << 20;
  uint64_t max_live_bytes = uint64_t{96} << 20;
  uint32_t queue_depth = 32;
  uint32_t io_threads = 1;  // Schedule::nvme_io_threads; the drive is measured at the same count
  std::string backend = "auto";
  bool direct = true;
  bool json = false;
  std::string optimizer_tier = "cpu";
  bool overlap = false;
};

[[noreturn]] void Die(const std::string& message) {
  std::fprintf(stderr, "engine_sim: %s\n", message.c_str());
  std::exit(2);
}

uint64_t ParseSize(const std::string& text) {
  auto v = memplan::ParseByteSize(text, "size");
  if (!v.ok()) Die(v.status().message());
  return *v;
}

Flags Parse(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) Die("missing value after " + a);
      return argv[++i];
    };
    if (a == "--path")
      f.path = next();
    else if (a == "--layers")
      f.layers = std::stoi(next());
    else if (a == "--layer-elements")
      f.layer_elements = std::stoull(next());
    else if (a == "--compute-ms")
      f.compute_ms = std::stod(next());
    else if (a == "--steps")
      f.steps = std::stoi(next());
    else if (a == "--buffer-bytes")
      f.buffer_bytes = ParseSize(next());
    else if (a == "--buffer-count")
      f.buffer_count = static_cast<uint32_t>(std::stoul(next()));
    else if (a == "--prefetch-bytes")
      f.prefetch_bytes = ParseSize(next());
    else if (a == "--max-live-bytes")
      f.max_live_bytes = ParseSize(next());
    else if (a == "--queue-depth")
      f.queue_depth = static_cast<uint32_t>(std::stoul(next()));
    else if (a == "--io-threads")
      f.io_threads = static_cast<uint32_t>(std::stoul(next()));
    else if (a == "--backend")
      f.backend = next();
    else if (a == "--no-direct")
      f.direct = false;
    else if (a == "--optimizer-tier")
      f.optimizer_tier = next();
    else if (a == "--overlap")
      f.overlap = true;
    else if (a == "--json")
      f.json = true;
    else if (a == "--help" || a == "-h") {
      std::printf("see the comment at the top of bench/engine_sim.cc\n");
      std::exit(0);
    } else {
      Die("unknown flag " + a);
    }
  }
  if (f.path.empty()) Die("--path DIR is required");
  if (f.optimizer_tier != "cpu" && f.optimizer_tier != "nvme") {
    Die("--optimizer-tier must be cpu or nvme");
  }
  if (f.layers < 2 || f.steps < 2 || f.layer_elements < 1024) Die("need >= 2 layers and steps");
  return f;
}

void Check(const Status& status, const char* what) {
  if (!status.ok()) Die(std::string(what) + ": " + status.message());
}

void BusyFor(double ms) {
  const auto until = Clock::now() + std::chrono::duration<double, std::milli>(ms);
  while (Clock::now() < until) {
  }
}

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// The drive's read bandwidth at the staging buffer size, measured in `dir` (dies when it cannot
// be).
double DriveReadBandwidth(const Flags& f, memplan::nvme::BackendKind backend,
                          const std::string& dir) {
  memplan::bench::NvmeBenchOptions bench;
  bench.directory = dir;
  bench.size_bytes = std::min<uint64_t>(uint64_t{1} << 30, f.layer_elements * 2 * f.layers);
  bench.size_bytes = bench.size_bytes / 4096 * 4096;
  bench.seconds_per_point = 3;
  bench.direct = f.direct;
  bench.backends = {backend};
  bench.block_sizes = {static_cast<uint32_t>(std::min<uint64_t>(f.buffer_bytes, 64u << 20))};
  bench.queue_depths = {f.queue_depth};
  bench.threads = {f.io_threads};
  auto report = memplan::bench::RunNvmeBench(bench);
  if (!report.ok()) Die(report.status().message());
  if (report->best < 0) Die("the drive bench measured nothing");
  return report->results[static_cast<size_t>(report->best)].read_bytes_per_s();
}

// The simulated model on a started engine: one module "layer<l>" a layer, each with one weight.
struct Sim {
  std::unique_ptr<off::Engine> engine;
  std::vector<off::ParamId> ids;
  std::vector<std::string> modules;
};

// The engine the flags describe, started: parameters on NVMe under `dir`, the optimizer in memory
// or on NVMe (dies when it cannot start).
Sim StartEngine(const Flags& f, memplan::nvme::BackendKind backend, const std::string& dir) {
  off::EngineOptions options;
  off::Schedule& s = options.schedule;
  s.param_tier = off::Tier::kNvme;
  s.optimizer_tier = f.optimizer_tier == "nvme" ? off::Tier::kNvme : off::Tier::kCpu;
  s.persistence_threshold = 0;
  s.prefetch_bytes = f.prefetch_bytes;
  s.max_live_bytes = f.max_live_bytes;
  s.param_buffer_bytes = f.buffer_bytes;
  s.param_buffer_count = f.buffer_count;
  s.sub_group_elements = f.layer_elements / 1024 * 1024;
  s.nvme_path = dir + "/engine";
  s.nvme_backend = backend;
  s.nvme_queue_depth = f.queue_depth;
  s.nvme_io_threads = f.io_threads;
  s.nvme_block_size = 1 << 20;
  s.nvme_direct = f.direct;
  options.runtime = &memplan::gpu::DefaultHostOnlyRuntime();
  auto engine = off::Engine::Create(options);
  if (!engine.ok()) Die(engine.status().message());
  Sim sim;
  sim.engine = std::move(*engine);
  for (int l = 0; l < f.layers; ++l) {
    sim.modules.push_back("layer" + std::to_string(l));
    off::ParamSpec spec{sim.modules.back() + ".weight",
                        sim.modules.back(),
                        {static_cast<int64_t>(f.layer_elements)},
                        [](uint64_t, std::span<float> out) {
                          std::fill(out.begin(), out.end(), 0.01f);
                          return Status::Ok();
                        },
                        {}};
    auto id = sim.engine->AddParameter(spec);
    if (!id.ok()) Die(id.status().message());
    sim.ids.push_back(*id);
  }
  Check(sim.engine->Start(), "start");
  return sim;
}

// Runs training step `step` (forward, backward with `grad` for every layer, Step()) and returns
// its figures; `read_bw`: the drive's read bandwidth, for the I/O time of what it read.
nlohmann::json RunStep(Sim& sim, const Flags& f, int step, const std::vector<uint16_t>& grad,
                       double read_bw) {
  off::Engine& engine = *sim.engine;
  memplan::offload::AdamOptions adam;
  const off::EngineStats before = engine.stats();
  const auto start = Clock::now();
  if (f.overlap) Check(engine.PrepareStep(adam), "prepare step");
  for (int l = 0; l < f.layers; ++l) {
    Check(engine.Fetch(sim.modules[l]), "fetch");
    BusyFor(f.compute_ms);
    Check(engine.Release(sim.modules[l]), "release");
  }
  double grad_s = 0;
  for (int l = f.layers - 1; l >= 0; --l) {
    Check(engine.Fetch(sim.modules[l]), "fetch");
    BusyFor(f.compute_ms);
    const auto g0 = Clock::now();
    Check(engine.GradReady(sim.ids[l], grad.data(), off::ElementType::kBFloat16), "grad");
    grad_s += Since(g0);
    Check(engine.Release(sim.modules[l]), "release");
  }
  const double pass = Since(start);
  const auto opt_start = Clock::now();
  Check(engine.Step(adam), "step");
  const double optimizer_s = Since(opt_start);
  const double total = Since(start);
  const off::EngineStats after = engine.stats();
  const off::EngineStepProfile& prof = after.step_profile;
  const double stall = after.param.stall_s - before.param.stall_s;
  const uint64_t read = after.param.nvme_read_bytes - before.param.nvme_read_bytes;
  const double io = read / read_bw;
  const double compute = 2.0 * f.layers * f.compute_ms / 1000.0;
  const double ideal = std::max(io, compute);
  return {{"step", step},
          {"pass_s", pass},
          {"stall_s", stall},
          {"stall_fraction", stall / pass},
          {"nvme_read_bytes", read},
          {"io_s", io},
          {"compute_s", compute},
          {"ideal_s", ideal},
          {"pass_over_ideal", pass / ideal},
          {"optimizer_s", optimizer_s},
          {"step_total_s", total},
          {"step_profile",
           {{"overlapped", prof.overlapped},
            {"step_s", prof.step_s},
            {"optimizer_s", prof.optimizer_s},
            {"read_s", prof.read_s},
            {"write_s", prof.write_s},
            {"sync_s", prof.sync_s},
            {"backward_wait_s", prof.backward_wait_s},
            {"stall_s", prof.stall_s},
            {"sub_groups", prof.sub_groups},
            {"sub_groups_before_step", prof.sub_groups_before_step},
            {"overlapped_fraction", prof.overlapped_fraction}}},
          {"grad_s", grad_s},
          {"prefetch_hits", after.param.prefetch_hits - before.param.prefetch_hits},
          {"peak_live_bytes", after.param.peak_live_bytes},
          {"peak_ahead_bytes", after.param.peak_ahead_bytes}};
}

// The means over the steps after the first (which only records the trace).
nlohmann::json MeanAfterFirst(const Flags& f, const nlohmann::json& steps) {
  double sum_pass = 0, sum_stall = 0, sum_ideal = 0, sum_io = 0;
  uint64_t sum_read = 0;
  double sum_total = 0, sum_step_wait = 0;
  for (const auto& st : steps) {
    if (st["step"].get<int>() == 1) continue;
    sum_pass += st["pass_s"].get<double>();
    sum_stall += st["stall_s"].get<double>();
    sum_ideal += st["ideal_s"].get<double>();
    sum_io += st["io_s"].get<double>();
    sum_read += st["nvme_read_bytes"].get<uint64_t>();
    sum_total += st["step_total_s"].get<double>();
    sum_step_wait += st["optimizer_s"].get<double>();
  }
  return {{"pass_s", sum_pass / (f.steps - 1)},
          {"stall_fraction", sum_stall / sum_pass},
          {"io_s", sum_io / (f.steps - 1)},
          {"ideal_s", sum_ideal / (f.steps - 1)},
          {"pass_over_ideal", sum_pass / sum_ideal},
          {"step_total_s", sum_total / (f.steps - 1)},
          {"step_wait_s", sum_step_wait / (f.steps - 1)},
          {"nvme_read_bytes", sum_read / (f.steps - 1)}};
}

// The report `out` as a table on stdout.
void PrintText(const Flags& f, const nlohmann::json& out) {
  const auto param_bytes = out["param_bytes"].get<uint64_t>();
  const auto pinned = out["pinned_staging_bytes"].get<uint64_t>();
  const double read_bw = out["drive_read_bytes_per_s"].get<double>();
  std::printf(
      "engine_sim: %d layers x %llu bf16 elements (%.1f MiB on NVMe, %.1fx the %.1f MiB "
      "pinned staging), compute %.1f ms per module pass, drive read %.3g B/s with %u I/O "
      "thread(s)\n",
      f.layers, static_cast<unsigned long long>(f.layer_elements), param_bytes / 1048576.0,
      static_cast<double>(param_bytes) / pinned, pinned / 1048576.0, f.compute_ms, read_bw,
      f.io_threads);
  std::printf("  optimizer %s%s\n", f.optimizer_tier.c_str(),
              f.overlap ? ", overlapped with backward (PrepareStep)" : ", after backward");
  std::printf(
      "  step   pass_s  stall_s  stall%%   io_s  ideal_s  pass/ideal  grad_s  step_s  "
      "total_s | opt_s  read_s write_s  sync_s bwait_s gstall_s  overlap\n");
  for (const auto& st : out["steps"]) {
    const auto& p = st["step_profile"];
    std::printf(
        "  %4d  %7.3f  %7.3f  %5.1f  %6.3f  %7.3f  %9.3f  %6.3f  %6.3f  %7.3f | %5.3f  "
        "%6.3f  %6.3f  %6.3f  %6.3f  %7.3f  %3llu/%-3llu\n",
        st["step"].get<int>(), st["pass_s"].get<double>(), st["stall_s"].get<double>(),
        100 * st["stall_fraction"].get<double>(), st["io_s"].get<double>(),
        st["ideal_s"].get<double>(), st["pass_over_ideal"].get<double>(),
        st["grad_s"].get<double>(), st["optimizer_s"].get<double>(),
        st["step_total_s"].get<double>(), p["optimizer_s"].get<double>(), p["read_s"].get<double>(),
        p["write_s"].get<double>(), p["sync_s"].get<double>(), p["backward_wait_s"].get<double>(),
        p["stall_s"].get<double>(),
        static_cast<unsigned long long>(p["sub_groups_before_step"].get<uint64_t>()),
        static_cast<unsigned long long>(p["sub_groups"].get<uint64_t>()));
  }
  const auto& m = out["mean_after_first"];
  std::printf(
      "  after step 1: stall %.2f%% of the pass, pass / max(compute, I/O) = %.3f; whole "
      "step %.3f s (Step() %.3f s); budgets %s\n",
      100 * m["stall_fraction"].get<double>(), m["pass_over_ideal"].get<double>(),
      m["step_total_s"].get<double>(), m["step_wait_s"].get<double>(),
      out["budgets_held"].get<bool>() ? "held" : "EXCEEDED");
}

}  // namespace

int main(int argc, char** argv) {
  const Flags f = Parse(argc, argv);
  auto backend = memplan::nvme::ParseBackendKind(f.backend);
  if (!backend.ok()) Die(backend.status().message());
  char pattern[4096];
  std::snprintf(pattern, sizeof(pattern), "%s/memplan-engine-sim.XXXXXX", f.path.c_str());
  if (::mkdtemp(pattern) == nullptr) Die("cannot make a directory in " + f.path);
  const std::string dir = pattern;
  struct Cleanup {
    std::string dir;
    ~Cleanup() {
      std::error_code ec;
      std::filesystem::remove_all(dir, ec);
    }
  } cleanup{dir};

  // 1. The drive's read bandwidth; 2. the engine; 3. the training steps.
  const double read_bw = DriveReadBandwidth(f, *backend, dir);
  Sim sim = StartEngine(f, *backend, dir);
  const std::vector<uint16_t> grad(f.layer_elements, 0);
  nlohmann::json steps = nlohmann::json::array();
  for (int step = 1; step <= f.steps; ++step) steps.push_back(RunStep(sim, f, step, grad, read_bw));
  const off::EngineStats final_stats = sim.engine->stats();
  Check(sim.engine->Close(), "close");

  const uint64_t param_bytes = f.layer_elements * 2 * f.layers;
  const uint64_t pinned = f.buffer_bytes * f.buffer_count;
  nlohmann::json out = {
      {"layers", f.layers},
      {"param_bytes", param_bytes},
      {"pinned_staging_bytes", pinned},
      {"params_over_pinned", static_cast<double>(param_bytes) / pinned},
      {"prefetch_bytes", f.prefetch_bytes},
      {"max_live_bytes", f.max_live_bytes},
      {"compute_ms_per_module", f.compute_ms},
      {"io_threads", f.io_threads},
      {"optimizer_tier", f.optimizer_tier},
      {"overlap", f.overlap},
      {"drive_read_bytes_per_s", read_bw},
      {"steps", steps},
      {"mean_after_first", MeanAfterFirst(f, steps)},
      {"budgets_held", final_stats.param.peak_live_bytes <= f.max_live_bytes &&
                           final_stats.param.peak_ahead_bytes <= f.prefetch_bytes}};
  if (f.json) {
    std::printf("%s\n", out.dump(2).c_str());
    return 0;
  }
  PrintText(f, out);
  return 0;
}
