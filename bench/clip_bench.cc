// clip_bench: what clipping by the global gradient norm costs the optimizer overlapped with
// backward (issue 31; Note [Clipping by the global norm] in offload/engine.cc).
//
//   build/bench/clip_bench --path DIR [--layers 8] [--layer-elements 4194304] [--compute-ms 20]
//       [--rounds 7] [--no-direct] [--json]
//
// A training step is simulated on the host-only GPU runtime as bench/engine_sim does: each layer
// is one module with one bf16 weight on NVMe, forward and backward busy for --compute-ms a module
// pass, the optimizer's fp32 master weights and AdamW states on NVMe (one sub-group a layer). Six
// engines, each in its own directory, train side by side, one step each per round, in an order
// that rotates every round (so the machine's noise falls on all alike):
//   overlap            PrepareStep: the optimizer steps each sub-group during backward
//   overlap+clip idle  the same, clipping declared (max_grad_norm) but never active: every step is
//                      run beside backward unclipped, its gradients also kept on NVMe, and kept
//   overlap+clip on    clipping active every step: the first is redone after backward, then every
//                      step waits for the norm (deferred: the serial step)
//   overlap+clip alt   the gradients' norm above max_grad_norm every other step: steps alternate
//                      between deferred (after a clipped one) and speculated or redone
//   serial             Step() after backward, no clipping
//   serial+clip on     Step() after backward, clipping active every step
// Printed: per mode the median over rounds (the first round, which records the fetch trace, left
// out) of the step's time (backward pass + Step()), Step()'s wait after backward, and the
// clipping decisions seen; then each mode's step time over "overlap"'s and over "serial"'s.
#include <stdlib.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/byte_size.h"
#include "gpu/gpu_runtime.h"
#include "offload/engine.h"
#include "offload/half.h"

namespace {

using memplan::Status;
using Clock = std::chrono::steady_clock;
namespace off = memplan::offload;

struct Flags {
  std::string path;
  int layers = 8;
  uint64_t layer_elements = uint64_t{4} << 20;
  double compute_ms = 20;
  int rounds = 7;
  bool direct = true;
  bool json = false;
};

[[noreturn]] void Die(const std::string& message) {
  std::fprintf(stderr, "clip_bench: %s\n", message.c_str());
  std::exit(2);
}

void Check(const Status& status, const char* what) {
  if (!status.ok()) Die(std::string(what) + ": " + status.message());
}

Flags Parse(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) Die(a + " needs a value");
      return argv[++i];
    };
    if (a == "--path") {
      f.path = value();
    } else if (a == "--layers") {
      f.layers = std::atoi(value().c_str());
    } else if (a == "--layer-elements") {
      auto v = memplan::ParseByteSize(value(), "--layer-elements");
      if (!v.ok()) Die(v.status().message());
      f.layer_elements = *v;
    } else if (a == "--compute-ms") {
      f.compute_ms = std::atof(value().c_str());
    } else if (a == "--rounds") {
      f.rounds = std::atoi(value().c_str());
    } else if (a == "--no-direct") {
      f.direct = false;
    } else if (a == "--json") {
      f.json = true;
    } else if (a == "--help" || a == "-h") {
      std::printf(
          "clip_bench --path DIR [--layers 8] [--layer-elements 4194304] [--compute-ms 20]\n"
          "           [--rounds 7] [--no-direct] [--json]\n"
          "The overlapped optimizer's step time with clipping by the global norm on and off.\n");
      std::exit(0);
    } else {
      Die("unknown flag " + a);
    }
  }
  if (f.path.empty()) Die("--path DIR is required");
  if (f.layers < 2 || f.rounds < 2 || f.layer_elements < 1024) Die("need >= 2 layers, rounds");
  return f;
}

void BusyFor(double ms) {
  const auto until = Clock::now() + std::chrono::duration<double, std::milli>(ms);
  while (Clock::now() < until) {
  }
}

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

struct Mode {
  std::string name;
  bool overlap = false;
  double max_grad_norm = 0;  // 0: no clipping
  bool alternate = false;    // the gradients' norm above max_grad_norm every other step
};

struct Sim {
  Mode mode;
  std::unique_ptr<off::Engine> engine;
  std::vector<off::ParamId> ids;
  std::vector<std::string> modules;
  int step = 0;
  std::vector<double> step_s, wait_s;
  std::map<std::string, int> clipping;
};

Sim Start(const Flags& f, const Mode& mode, const std::string& dir) {
  off::EngineOptions options;
  off::Schedule& s = options.schedule;
  s.param_tier = off::Tier::kNvme;
  s.optimizer_tier = off::Tier::kNvme;
  s.persistence_threshold = 0;
  s.prefetch_bytes = f.layer_elements * 2 * 4;
  s.max_live_bytes = f.layer_elements * 2 * 6;
  s.param_buffer_bytes = std::min<uint64_t>(f.layer_elements * 2, uint64_t{16} << 20);
  s.param_buffer_count = 4;
  s.sub_group_elements = f.layer_elements / 1024 * 1024;
  s.nvme_path = dir;
  s.nvme_direct = f.direct;
  options.runtime = &memplan::gpu::DefaultHostOnlyRuntime();
  auto engine = off::Engine::Create(options);
  if (!engine.ok()) Die(engine.status().message());
  Sim sim;
  sim.mode = mode;
  sim.engine = std::move(*engine);
  for (int l = 0; l < f.layers; ++l) {
    sim.modules.push_back("layer" + std::to_string(l));
    off::ParamSpec spec;
    spec.name = sim.modules.back() + ".weight";
    spec.module = sim.modules.back();
    spec.shape = {static_cast<int64_t>(f.layer_elements)};
    spec.init = [](uint64_t, std::span<float> out) {
      std::fill(out.begin(), out.end(), 0.01f);
      return Status::Ok();
    };
    auto id = sim.engine->AddParameter(spec);
    if (!id.ok()) Die(id.status().message());
    sim.ids.push_back(*id);
  }
  Check(sim.engine->Start(), "start");
  return sim;
}

// One training step of `sim`; records its times after the first.
void Step(Sim& sim, const Flags& f, const std::vector<uint16_t>& small,
          const std::vector<uint16_t>& large) {
  off::Engine& engine = *sim.engine;
  ++sim.step;
  off::StepOptions options{{off::AdamOptions()}, sim.mode.max_grad_norm};
  const std::vector<uint16_t>& grad =
      sim.mode.alternate ? (sim.step % 2 == 0 ? large : small) : large;
  const auto start = Clock::now();
  if (sim.mode.overlap) Check(engine.PrepareStep(options), "prepare");
  for (int l = 0; l < f.layers; ++l) {
    Check(engine.Fetch(sim.modules[l]), "fetch");
    BusyFor(f.compute_ms);
    Check(engine.Release(sim.modules[l]), "release");
  }
  for (int l = f.layers - 1; l >= 0; --l) {
    Check(engine.Fetch(sim.modules[l]), "fetch");
    BusyFor(f.compute_ms);
    Check(engine.GradReady(sim.ids[l], grad.data(), off::ElementType::kBFloat16), "grad");
    Check(engine.Release(sim.modules[l]), "release");
  }
  const auto backward_done = Clock::now();
  Check(engine.Step(options), "step");
  if (sim.step == 1) return;  // the trace is recorded in the first step
  sim.wait_s.push_back(Since(backward_done));
  sim.step_s.push_back(Since(start));
  const std::string clipping = engine.stats().step_profile.clipping;
  ++sim.clipping[clipping.empty() ? "-" : clipping];
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const Flags f = Parse(argc, argv);
  // The bf16 gradients: every element 0.01 or 0.03; max_grad_norm between their norms (or far
  // below or above both).
  const double elements = static_cast<double>(f.layer_elements) * f.layers;
  const double small_norm = 0.01 * std::sqrt(elements), large_norm = 0.03 * std::sqrt(elements);
  const std::vector<uint16_t> small(f.layer_elements, memplan::offload::FloatToBf16(0.01f));
  const std::vector<uint16_t> large(f.layer_elements, memplan::offload::FloatToBf16(0.03f));
  const double between = (small_norm + large_norm) / 2;
  const std::vector<Mode> modes = {
      {"overlap", true, 0, false},
      {"overlap+clip idle", true, 1e30, false},
      {"overlap+clip on", true, small_norm / 10, false},
      {"overlap+clip alt", true, between, true},
      {"serial", false, 0, false},
      {"serial+clip on", false, small_norm / 10, false},
  };
  std::error_code ec;
  std::filesystem::create_directories(f.path, ec);
  std::vector<Sim> sims;
  for (size_t m = 0; m < modes.size(); ++m) {
    sims.push_back(Start(f, modes[m], f.path + "/clip_bench" + std::to_string(m)));
  }
  for (int round = 0; round < f.rounds; ++round) {
    for (size_t k = 0; k < sims.size(); ++k) {
      Step(sims[(k + static_cast<size_t>(round)) % sims.size()], f, small, large);
    }
  }
  nlohmann::json out = {{"layers", f.layers},
                        {"layer_elements", f.layer_elements},
                        {"compute_ms", f.compute_ms},
                        {"rounds", f.rounds},
                        {"modes", nlohmann::json::array()}};
  const double base = Median(sims[0].step_s), serial = Median(sims[4].step_s);
  for (Sim& sim : sims) {
    const double step = Median(sim.step_s);
    out["modes"].push_back({{"name", sim.mode.name},
                            {"step_s", step},
                            {"step_wait_s", Median(sim.wait_s)},
                            {"over_overlap", step / base},
                            {"over_serial", step / serial},
                            {"clipping", sim.clipping}});
    Check(sim.engine->Close(), "close");
  }
  for (size_t m = 0; m < modes.size(); ++m) {
    std::filesystem::remove_all(f.path + "/clip_bench" + std::to_string(m), ec);
  }
  if (f.json) {
    std::printf("%s\n", out.dump(2).c_str());
    return 0;
  }
  std::printf(
      "clip_bench: %d layers x %s bf16 (optimizer states on NVMe), compute %.0f ms a module "
      "pass, medians of %d interleaved rounds\n",
      f.layers, memplan::FormatByteSize(f.layer_elements * 2).c_str(), f.compute_ms, f.rounds - 1);
  std::printf("%-18s %9s %11s %13s %11s  %s\n", "mode", "step_s", "Step() wait", "/ overlap",
              "/ serial", "clipping");
  for (const auto& m : out["modes"]) {
    std::string clipping;
    for (const auto& [k, v] : m["clipping"].items()) {
      clipping += (clipping.empty() ? "" : " ") + k + "x" + std::to_string(v.get<int>());
    }
    std::printf("%-18s %9.3f %11.3f %13.3f %11.3f  %s\n", m["name"].get<std::string>().c_str(),
                m["step_s"].get<double>(), m["step_wait_s"].get<double>(),
                m["over_overlap"].get<double>(), m["over_serial"].get<double>(), clipping.c_str());
  }
  return 0;
}
