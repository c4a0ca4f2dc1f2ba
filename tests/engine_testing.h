// Fixtures for the engine's doctest suites (offload/engine_test.cc, engine_fp32_test.cc,
// engine_zero3_test.cc): a toy model of modules, the schedule they run under, an engine started
// on the host-only runtime with the model registered, one training step's forward and backward,
// and what the engine ends with. The functions returning Status may run on a rank's own thread
// (doctest's assertions may not); the others fail the running test. Header-only; needs
// MEMPLAN_SOURCE_DIR (see tests/testing.h).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"
#include "offload/engine.h"
#include "offload/half.h"
#include "schedule/schedule.h"
#include "tests/status_testing.h"
#include "tests/testing.h"

namespace memplan::testing {

// --- The toy model ----------------------------------------------------------------------------

// Modules "m0".."m{k-1}", each with a weight (offloaded: its sizes differ per module) and a bias
// (resident on the GPU whatever the tier: under TestSchedule's persistence threshold), laid out
// one after the other in a flat space of `total` elements.
struct ToyModel {
  struct P {
    std::string name, module;
    uint64_t numel = 0;
    uint64_t flat = 0;                      // where it starts in the flat space
    std::vector<std::string> also_used_by;  // other modules that use it (tied)
    bool frozen = false;                    // takes no gradient (LoRA's base weights)
  };
  std::vector<P> params;
  std::vector<std::string> modules;
  uint64_t total = 0;

  // Module l's weight has `weight + weight_step * l` elements, every bias `bias`.
  ToyModel(int layers, uint64_t weight, uint64_t bias, uint64_t weight_step) {
    for (int l = 0; l < layers; ++l) {
      const std::string m = "m" + std::to_string(l);
      modules.push_back(m);
      Add(m + ".weight", m, weight + weight_step * static_cast<uint64_t>(l));
      Add(m + ".bias", m, bias);
    }
  }

  // Appends a parameter of `module` after the others in the flat space.
  void Add(const std::string& name, const std::string& module, uint64_t numel) {
    params.push_back({name, module, numel, total, {}, false});
    total += numel;
  }
};

// The initial value of flat element `flat`.
inline float Init(uint64_t flat) { return static_cast<float>((flat % 97) * 0.0103 - 0.5); }

// The gradient of flat element e at step t that an engine is given.
using GradFn = std::function<float(uint64_t t, uint64_t e)>;

// The optimizer options of step t: AdamW, the learning rate falling with the step.
inline offload::AdamOptions Adam(uint64_t t) {
  offload::AdamOptions a;
  a.lr = 2e-2 / static_cast<double>(t);
  a.weight_decay = 0.05;
  return a;
}

// --- The schedule -----------------------------------------------------------------------------

// Parameters on `params` as `dtype`, the optimizer on `optimizer`, the NVMe files under `nvme_path`
// (POSIX, buffered); small enough buffers that a toy model crosses their edges: sub-groups cut
// across parameters and a weight spans several parameter staging slots.
inline offload::Schedule TestSchedule(
    offload::Tier params, offload::Tier optimizer, const std::string& nvme_path,
    offload::ElementType dtype = offload::ElementType::kBFloat16) {
  offload::Schedule s;
  s.param_tier = params;
  s.param_dtype = dtype;
  s.optimizer_tier = optimizer;
  s.persistence_threshold = 64;
  s.sub_group_elements = 2048;
  s.param_buffer_bytes = 4096;
  s.param_buffer_count = 2;
  s.optimizer_buffer_count = 3;
  s.optimizer_threads = 2;
  s.nvme_path = nvme_path;
  s.nvme_backend = nvme::BackendKind::kPosix;
  s.nvme_direct = false;
  return s;
}

// --- A started engine -------------------------------------------------------------------------

struct EngineRun {
  // Each run has its own runtime, destroyed (its copy threads joined) after the engine: the
  // process-wide one would keep threads alive, and other tests fork.
  std::unique_ptr<gpu::Runtime> runtime = gpu::CreateHostOnlyRuntime();
  std::unique_ptr<offload::Engine> engine;
  std::vector<offload::ParamId> ids;  // per parameter of the model, in its order
};

// Creates an engine with `options` on `run`'s runtime (options.runtime is replaced), registers
// every parameter of `model` (initialised with Init) and starts it. On failure `run` holds what
// was made so far.
inline Status StartToyEngine(const ToyModel& model, offload::EngineOptions options, EngineRun* run,
                             offload::RecoveryReport* report = nullptr) {
  options.runtime = run->runtime.get();
  MEMPLAN_ASSIGN_OR_RETURN(run->engine, offload::Engine::Create(options));
  for (const ToyModel::P& p : model.params) {
    const uint64_t base = p.flat;
    offload::ParamSpec spec;
    spec.name = p.name;
    spec.module = p.module;
    spec.shape = {static_cast<int64_t>(p.numel)};
    spec.init = [base](uint64_t first, std::span<float> out) {
      for (size_t k = 0; k < out.size(); ++k) out[k] = Init(base + first + k);
      return Status::Ok();
    };
    spec.also_used_by = p.also_used_by;
    spec.frozen = p.frozen;
    MEMPLAN_ASSIGN_OR_RETURN(offload::ParamId id, run->engine->AddParameter(spec));
    run->ids.push_back(id);
  }
  return run->engine->Start(report);
}

// StartToyEngine on one process with `schedule`, failing the test when it fails.
inline EngineRun StartEngine(const ToyModel& model, const offload::Schedule& schedule,
                             bool resume = false, offload::RecoveryReport* report = nullptr) {
  offload::EngineOptions options;
  options.schedule = schedule;
  options.resume = resume;
  EngineRun run;
  REQUIRE_OK(StartToyEngine(model, options, &run, report));
  return run;
}

// --- Training ---------------------------------------------------------------------------------

// Forward over the modules in `order` (Fetch, Release), then backward in reverse: each module
// fetched, each of its trainable parameters given its gradient grad(t, flat element) in
// `grad_type`, the module released. The gradients are kept in `grads` (one per parameter) and must
// stay valid until Step(): the engine copies them asynchronously. `scribble`: each is overwritten
// right after GradReady(), with NaNs were it read again (world size > 1: the gradient has been
// reduced when GradReady returns). The first error ends it.
inline Status ForwardBackward(offload::Engine& engine, const std::vector<offload::ParamId>& ids,
                              const ToyModel& model, const std::vector<std::string>& order,
                              uint64_t t, const GradFn& grad, offload::ElementType grad_type,
                              std::vector<std::vector<std::byte>>* grads, bool scribble = false) {
  for (const std::string& m : order) {
    MEMPLAN_RETURN_IF_ERROR(engine.Fetch(m));
    MEMPLAN_RETURN_IF_ERROR(engine.Release(m));
  }
  grads->resize(model.params.size());
  const auto eb = static_cast<uint64_t>(offload::ElementBytes(grad_type));
  for (auto it = order.rbegin(); it != order.rend(); ++it) {
    MEMPLAN_RETURN_IF_ERROR(engine.Fetch(*it));
    for (size_t i = 0; i < model.params.size(); ++i) {
      const ToyModel::P& p = model.params[i];
      if (p.module != *it || p.frozen) continue;
      // A fetched module's parameters are on the GPU.
      MEMPLAN_RETURN_IF_ERROR(engine.DevicePointer(ids[i]).status());
      std::vector<std::byte>& g = (*grads)[i];
      g.resize(p.numel * eb);
      for (uint64_t k = 0; k < p.numel; ++k) {
        const float v = grad(t, p.flat + k);
        if (grad_type == offload::ElementType::kFloat32) {
          std::memcpy(g.data() + k * 4, &v, 4);
        } else {
          const uint16_t h = offload::FloatToBf16(v);
          std::memcpy(g.data() + k * 2, &h, 2);
        }
      }
      // Host-only runtime: device memory is host memory.
      MEMPLAN_RETURN_IF_ERROR(engine.GradReady(ids[i], g.data(), grad_type));
      if (scribble) std::fill(g.begin(), g.end(), std::byte{0xff});
    }
    MEMPLAN_RETURN_IF_ERROR(engine.Release(*it));
  }
  return Status::Ok();
}

// --- What the engine holds --------------------------------------------------------------------

struct Readout {
  std::vector<std::vector<std::byte>> fetched;  // per parameter, the fetched working copy
  std::vector<std::vector<float>> master;       // per parameter, ReadMasterWeights(); frozen: none
};

// Fetches every parameter's module and copies out its working copy (ElementBytes(param_dtype) an
// element) and, unless frozen, its master weights. The first error ends it.
inline Status ReadOut(offload::Engine& engine, const std::vector<offload::ParamId>& ids,
                      const ToyModel& model, offload::ElementType param_dtype, Readout* out) {
  const auto wb = static_cast<uint64_t>(offload::ElementBytes(param_dtype));
  out->fetched.assign(model.params.size(), {});
  out->master.assign(model.params.size(), {});
  for (size_t i = 0; i < model.params.size(); ++i) {
    const ToyModel::P& p = model.params[i];
    MEMPLAN_RETURN_IF_ERROR(engine.Fetch(p.module));
    MEMPLAN_ASSIGN_OR_RETURN(void* device, engine.DevicePointer(ids[i]));
    const auto* bytes = static_cast<const std::byte*>(device);  // host-only runtime
    out->fetched[i].assign(bytes, bytes + p.numel * wb);
    MEMPLAN_RETURN_IF_ERROR(engine.Release(p.module));
    if (p.frozen) continue;
    out->master[i].resize(p.numel);
    MEMPLAN_RETURN_IF_ERROR(engine.ReadMasterWeights(ids[i], out->master[i]));
  }
  return Status::Ok();
}

// ReadOut of a started run, failing the test when it fails.
inline Readout MustReadOut(EngineRun& run, const ToyModel& model,
                           offload::ElementType param_dtype) {
  Readout out;
  REQUIRE_OK(ReadOut(*run.engine, run.ids, model, param_dtype, &out));
  return out;
}

}  // namespace memplan::testing
