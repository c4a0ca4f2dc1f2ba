// offload::Engine: the one header a trainer includes to train with memplan's offload engine.
//
// The Engine runs a Schedule (schedule.h): it owns the parameter swapper (parameters resident on
// the GPU, in pinned CPU memory or on NVMe, fetched per module with trace-driven prefetch), the CPU
// optimizer over fp32 master weights and states (in memory, or on NVMe through the pipelined
// OptimizerSwapper with crash-safe step epochs), the pinned buffers, and the gradient path.
//
// Use:
//   auto engine = Engine::Create({schedule});              // runtime: CUDA if usable, else host
//   ParamId w = engine->AddParameter({"layers.0.w", "layers.0", {1024, 1024}, init}).value();
//   engine->Start();                                        // builds the stores, fills weights
//   for each step:
//     for each module in forward order:  Fetch(module); DevicePointer(...); compute; Release(module)
//     for each module in backward order: Fetch(module); compute grads; GradReady(param, grad);
//                                        Release(module)
//     Step(adam_options);                                   // CPU optimizer, parameters updated
//
// Gradient path: GradReady(param, device_grad, dtype) queues the gradient's copy to the host and
// returns; a gradient thread converts it to fp32 into the optimizer sub-groups it covers and hands
// each sub-group to the optimizer as soon as all its gradients are in. Step() runs the optimizer over every sub-group and writes the
// updated 16-bit parameters back to where the Schedule keeps them (GPU copies, pinned arena, NVMe).
//
// Restart: with `resume`, Start() reopens the NVMe optimizer store (the master weights are the
// truth), reports what recovery found, and rewrites the 16-bit parameters from the master weights
// of the last complete step.
//
// Statistics (stats()): bytes moved per tier and direction, stall time, peak GPU and pinned bytes;
// the estimator's predictions are checked against them.
//
// Thread safety: one trainer thread calls the Engine; it runs its own transfer and I/O threads.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "offload/collective.h"
#include "offload/gpu_runtime.h"
#include "offload/optimizer_swapper.h"
#include "offload/param_swapper.h"
#include "offload/schedule.h"

namespace memplan::offload {

// Fills elements [first, first + out.size()) of a parameter's initial fp32 values.
using ParamInit = std::function<Status(uint64_t first, std::span<float> out)>;

struct ParamSpec {
  std::string name;                  // unique, e.g. "model.layers.0.mlp.up_proj.weight"
  std::string module;                // the module whose Fetch() brings it, e.g. "model.layers.0"
  std::vector<int64_t> shape;        // all > 0
  ParamInit init;                    // required
  std::vector<std::string> also_used_by;  // other modules that use the same parameter (tied)
};

struct EngineOptions {
  Schedule schedule;
  gpu::Runtime* runtime = nullptr;   // not owned; null: CreateBestRuntime()
  Collective* collective = nullptr;  // not owned; null: single process
  bool resume = false;               // reopen the NVMe optimizer store left by an earlier run
};

struct EngineStats {
  std::string runtime;                // "host-only", "cuda:0"
  uint64_t steps = 0;
  uint64_t epoch = 0;                 // the optimizer's last committed step
  uint64_t params = 0;                // parameters registered
  uint64_t elements = 0;              // their elements
  ParamSwapperStats param;            // fetches, prefetch, stall, NVMe/H2D bytes, live bytes
  uint64_t d2h_bytes = 0;             // gradients copied to the host
  uint64_t optimizer_read_bytes = 0;  // NVMe optimizer store, all steps
  uint64_t optimizer_write_bytes = 0;
  double last_step_s = 0;             // the last Step()'s optimizer time
  uint64_t peak_device_bytes = 0;     // the runtime's device bytes in use, highest seen
  uint64_t pinned_bytes = 0;          // pinned memory the engine holds
};

class Engine {
 public:
  static Result<std::unique_ptr<Engine>> Create(const EngineOptions& options);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Registers a parameter; before Start() only.
  Result<ParamId> AddParameter(const ParamSpec& spec);
  // Creates the stores and fills the parameters (or, with resume, recovers them). `report`
  // (optional) receives what recovery found.
  Status Start(RecoveryReport* report = nullptr);

  Status Fetch(std::string_view module);
  Status Release(std::string_view module);
  // The GPU address of a fetched parameter's working copy (schedule.param_dtype elements).
  Result<void*> DevicePointer(ParamId param) const;
  // The gradient of `param` (its numel elements of `type`, on the GPU), for this step. The copy is
  // asynchronous: `device_grad` must stay valid and unchanged until Step(). At most a few
  // gradients are in flight; beyond that GradReady() waits. An earlier gradient's failure is
  // returned by the next GradReady() or Step().
  Status GradReady(ParamId param, const void* device_grad, ElementType type);
  // Runs the optimizer step over all parameters; every parameter's gradient must have been given.
  Status Step(const SwapStepOptions& options);
  // Reads a parameter's fp32 master weights (for checkpoints and tests).
  Status ReadMasterWeights(ParamId param, std::span<float> out);

  EngineStats stats() const;
  // Commits and closes the stores (the NVMe optimizer store is kept for a later resume).
  Status Close();

 private:
  struct Impl;
  explicit Engine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace memplan::offload
