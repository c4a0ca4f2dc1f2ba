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
//     for each module in forward order:  Fetch(module); DevicePointer(...); compute on stream s;
//                                        Release(module, s)
//     for each module in backward order: Fetch(module); compute grads on s;
//                                        GradReady(param, grad, dtype, s); Release(module, s)
//     Step(adam_options);                                   // CPU optimizer, parameters updated
//
// Overlapping the optimizer with backward: PrepareStep(adam_options) before a step's first
// GradReady() lets the engine step each optimizer sub-group as soon as its last gradient is in,
// during backward, and Step(adam_options) then only finishes what is left (Note [Optimizer
// overlapped with backward] in engine.cc). The results are those of the serial order, bit for
// bit. The step's options must be known before backward to do this: a trainer that clips by the
// global gradient norm, or skips fp16 steps whose gradients overflowed, knows them only after
// backward, so it does not call PrepareStep() and its steps stay serial.
//
// Streams (the contract with a trainer's GPU work). The trainer queues its kernels on streams of
// its own (PyTorch's current stream) and the engine copies on streams of the runtime's; nothing
// orders the two unless the trainer says which of its streams it used:
//   - Fetch(module) returns when the parameters are on the GPU: kernels on any stream queued after
//     it may read them, until Release.
//   - Release(module, stream): the trainer's kernels reading the parameters were queued on `stream`
//     (they may still be running: a forward hook releases at launch). The engine does not reuse the
//     buffers before that stream's work queued so far has run.
//   - GradReady(param, grad, type, stream): the gradient is being (or has been) written by work
//     queued on `stream`; the engine's copy waits for that work. The copy reads `grad` later, on
//     GradientStream(): the trainer must not write or free `grad` before that copy is done: record
//     it on GradientStream() (PyTorch: grad.record_stream(torch.cuda.ExternalStream(...)), so the
//     caching allocator waits for the copy before reusing the memory), or keep it until Step().
//     With world size > 1, or on the host-only runtime, `grad` is free when GradReady returns.
//   - The default stream {} is CUDA's legacy default stream (PyTorch's default stream), which CUDA
//     orders after every blocking stream. The host-only runtime has no streams and refuses one.
// The engine never waits for the trainer's streams on a thread: it orders its own copy streams
// after them (cudaStreamWaitEvent).
//
// Device: a runtime the engine makes itself (options.runtime null) is on options.device, by default
// the calling thread's current CUDA device (torch.cuda.set_device), never a fixed GPU 0.
//
// Working parameters are schedule.param_dtype: bf16 or fp16 copies that the optimizer writes in the
// same pass as it updates the fp32 master weights, or fp32, when the working copy is the master
// weights themselves (after every Step() a fetched parameter equals ReadMasterWeights() bit for
// bit).
//
// Gradient path: GradReady(param, device_grad, dtype, stream) queues the gradient's copy into
// pinned host staging and returns; a gradient thread converts it to fp32 into the optimizer
// sub-groups it covers and hands each sub-group to the optimizer as soon as all its gradients are
// in (stored for Step(), or, in a prepared step, stepped at once). Step() runs the optimizer over
// every sub-group (in a prepared step: over those left) and writes the updated working parameters
// back to where the Schedule keeps them (GPU copies, pinned arena, NVMe).
//
// Data parallel (ZeRO-3), with a Collective of world size > 1 (NCCL, or the thread-group one of
// thread_collective.h): every rank runs its own Engine over the same parameters, and each rank's
// tiers and optimizer hold only its partition: a 1/world_size shard of every parameter (padded so
// every rank's shard of a parameter has the same size; stats().partition_elements). Fetch()
// all-gathers the module's parameters whole onto the GPU (parameters under the persistence
// threshold are kept whole on every rank; the gpu tier keeps each rank's shards on its GPU and
// gathers them per Fetch() too); GradReady() takes the rank's full gradient and
// reduce-scatters it, so each rank's optimizer gets the sum over ranks of its shard, divided by the
// world size: the mean gradient, as DeepSpeed and DDP average; Step() updates and writes back each
// rank's shard. The collectives run inside Start, Fetch, GradReady, Step and ReadMasterWeights, on
// the calling thread, so every rank must make the same calls (these, and Release) in the same
// order, as with any collective; an error on one rank leaves the others waiting in their next
// collective, and ends the job. With nvme tiers each rank keeps its stores under
// <nvme.path>/rank<r>/, so the ranks of a node may share one nvme.path; a resume needs the same
// world size.
//
// Frozen parameters (ParamSpec::frozen): fetched like the others and held on the same tier, but
// never given a gradient (GradReady() refuses them), never stepped, never written after Start()
// (they have no master weights: ReadMasterWeights() refuses them; read a fetched working copy).
// The optimizer, its stores and its pinned buffers cover only the other parameters, so a frozen
// base many times the host memory costs only its parameter tier (LoRA).
//
// Restart: with `resume`, Start() reopens the NVMe optimizer store (the master weights are the
// truth), reports what recovery found, and rewrites the working parameters from the master weights
// of the last complete step. With world size > 1 that is the last step every rank completed: a
// rank one step ahead of another (killed between their commits) goes back one step (a collective
// in Start(); Note [Resuming ranks] in engine.cc).
//
// Statistics (stats()): bytes moved per tier and direction, stall time, peak GPU and pinned bytes;
// the estimator's predictions are checked against them. step_profile says where the last Step()'s
// time went (EngineStepProfile). GPU memory: the engine reserves its share
// at Start() (the parameter swapper's DeviceArena, and for world size > 1 two reduce-scatter
// buffers) and keeps to it: stats().device_arena_bytes, known before the first step, is what the
// trainer's allocator must leave free.
//
// Thread safety: one trainer thread calls the Engine; it runs its own transfer and I/O threads. The
// Engines of the ranks of one process (the thread-group collective) are independent objects, each
// called from its own trainer thread.
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
#include "gpu/gpu_runtime.h"
#include "offload/optimizer_swapper.h"
#include "offload/param_swapper.h"
#include "offload/schedule.h"

namespace memplan::offload {

// Fills elements [first, first + out.size()) of a parameter's initial fp32 values.
using ParamInit = std::function<Status(uint64_t first, std::span<float> out)>;

struct ParamSpec {
  std::string name;            // unique, e.g. "model.layers.0.mlp.up_proj.weight"
  std::string module;          // the module whose Fetch() brings it, e.g. "model.layers.0"
  std::vector<int64_t> shape;  // all > 0
  ParamInit init;              // required
  std::vector<std::string> also_used_by;  // other modules that use the same parameter (tied)
  // A frozen parameter (requires_grad=False: LoRA's base weights) is held and fetched like the
  // others, on the Schedule's tier, but takes no gradient, has no optimizer state and is never
  // written after Start() (Note [Frozen parameters] in engine.cc).
  bool frozen = false;
};

struct EngineOptions {
  Schedule schedule;
  gpu::Runtime* runtime = nullptr;   // not owned; null: CreateBestRuntime(nullptr, device)
  int device = gpu::kCurrentDevice;  // the CUDA device of a runtime the engine makes itself
  Collective* collective = nullptr;  // not owned; null: single process; world size > 1: ZeRO-3
  bool resume = false;               // reopen the NVMe optimizer store left by an earlier run
  // Test seam: when set, the NVMe optimizer store runs on the backend this returns (e.g. an
  // nvme::FaultBackend) instead of one made from the schedule.
  std::function<Result<std::unique_ptr<nvme::Backend>>()> make_optimizer_backend;
};

// Where the last Step()'s time went. Times are seconds of wall clock; busy times of the optimizer's
// stages may overlap each other (they are threads of a pipeline) and the trainer's backward.
struct EngineStepProfile {
  bool overlapped = false;     // the step was prepared (PrepareStep) and ran during backward
  double backward_s = 0;       // overlapped: from PrepareStep() to the Step() call, the
                               // window the optimizer ran in beside backward; 0 otherwise
  double step_s = 0;           // the Step() call: what the trainer waited after backward
  double optimizer_s = 0;      // CPU optimizer kernels and working-parameter write-backs
  double read_s = 0;           // optimizer state reads (and stored gradients), NVMe busy time
  double write_s = 0;          // optimizer state writes, NVMe busy time
  double sync_s = 0;           // the step's commit (fdatasync and index)
  double backward_wait_s = 0;  // overlapped: the optimizer idle, waiting for backward to
                               // complete its next sub-group
  double stall_s = 0;          // GradReady() blocked this step: backward waiting for the
                               // engine (staging slots full; overlapped: the optimizer behind)
  uint64_t sub_groups = 0;     // optimizer sub-groups stepped
  uint64_t sub_groups_before_step = 0;  // of those, updated before Step() was called
  double overlapped_fraction = 0;       // sub_groups_before_step / sub_groups
};

struct EngineStats {
  std::string runtime;  // "host-only", "cuda:0"
  uint64_t steps = 0;
  uint64_t epoch = 0;                 // the optimizer's last committed step
  uint64_t params = 0;                // parameters registered
  uint64_t elements = 0;              // their elements
  int rank = 0;                       // this rank and the world size (the Collective's; 0 of 1
  int world_size = 1;                 // without one)
  uint64_t partition_elements = 0;    // elements this rank's tiers hold: `elements` for world
                                      // size 1, about elements / world_size otherwise
  uint64_t frozen_params = 0;         // of `params`, the frozen ones
  uint64_t frozen_elements = 0;       // their elements (in `elements`)
  uint64_t optimizer_elements = 0;    // elements this rank's optimizer holds: its partition of
                                      // the parameters that are not frozen
  ParamSwapperStats param;            // fetches, prefetch, stall, NVMe/H2D bytes, live bytes
  uint64_t d2h_bytes = 0;             // gradients copied to the host (this rank's shards)
  uint64_t reduce_scatter_bytes = 0;  // world size > 1: gradient bytes reduce-scattered (padded)
  uint64_t optimizer_read_bytes = 0;  // NVMe optimizer store, all steps
  uint64_t optimizer_write_bytes = 0;
  uint64_t grad_write_bytes = 0;  // gradients written to the NVMe optimizer store for serial
                                  // steps (an overlapped step keeps them in memory)
  // Bytes the NVMe stores (parameters and optimizer) read and wrote since Start() began, as they
  // count them: every parameter read, write-back, sub-group state, gradient and step mark
  // (optimizer_write_bytes above leaves out the gradients). What planner/engine_model.h predicts.
  uint64_t nvme_read_bytes = 0;
  uint64_t nvme_write_bytes = 0;
  double last_step_s = 0;           // the last Step()'s optimizer time
  EngineStepProfile step_profile;   // the last Step(), stage by stage
  uint64_t peak_device_bytes = 0;   // the runtime's device bytes in use, highest ever (counted
                                    // at every allocation, like cudaMemGetInfo would see them)
  uint64_t pinned_bytes = 0;        // pinned memory the engine holds
  uint64_t device_arena_bytes = 0;  // device memory the engine reserved at Start() and keeps
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
  // `stream`: where the trainer queued the kernels that read the module's parameters (see Streams
  // above). InvalidArgument for a stream the runtime refuses; nothing is released then.
  Status Release(std::string_view module, gpu::Stream stream = {});
  // The GPU address of a fetched parameter's working copy (numel schedule.param_dtype elements;
  // with world size > 1 the buffer is padded to a multiple of the world size).
  Result<void*> DevicePointer(ParamId param) const;
  // The gradient of `param` (its numel elements of `type`, on the GPU), for this step, written by
  // work queued on `stream`. The copy is asynchronous: `device_grad` must stay valid and unchanged
  // until the copy, ordered on GradientStream(), is done (see Streams above), at the latest until
  // Step(). A few staging slots are in flight; beyond that GradReady() waits. An earlier
  // gradient's failure is returned by the next GradReady() or Step(). With world size > 1 this is
  // this rank's gradient; it is reduce-scattered across the ranks before GradReady() returns
  // (`device_grad` may then be reused at once); 16-bit gradients are summed as the Collective sums
  // them (the thread-group one in fp32, rounded once; NCCL rounds to the type at every hop).
  Status GradReady(ParamId param, const void* device_grad, ElementType type,
                   gpu::Stream stream = {});
  // `param` has no gradient this step (torch: its grad is None): Step() leaves its weights and
  // optimizer states unchanged and does not advance its own step count, as torch's optimizers
  // skip it (Note [Skipped parameters] in engine.cc). Instead of GradReady(), before Step(); no
  // collective: every rank must skip the same parameters. InvalidArgument for a frozen parameter,
  // FailedPrecondition when its gradient was given.
  Status NoGradient(ParamId param);
  // The stream the engine's gradient copies read on ({} on the host-only runtime).
  gpu::Stream GradientStream() const;
  // Runs the optimizer step over all parameters; every parameter's gradient must have been given.
  // After PrepareStep(): finishes the overlapped step; `options` must equal the prepared ones.
  Status Step(const SwapStepOptions& options);
  // Gives the options of the coming Step() before its gradients, so that its optimizer runs
  // overlapped with backward (Note [Optimizer overlapped with backward] in engine.cc): each
  // sub-group is stepped (states read, updated, written back, working parameters written to
  // their tier) as soon as its last gradient arrives. Call it before the step's first GradReady()
  // or NoGradient() (FailedPrecondition after), on every rank; calling it again before then
  // replaces the options. Needs the optimizer on nvme: with the cpu optimizer tier it is accepted
  // and the step runs serially (stats().step_profile.overlapped false). If the prepared step
  // fails (an I/O error in a sub-group's step, the write-back, or Step() given other options:
  // FailedPrecondition), Step() returns the error naming the sub-group, and the step is
  // abandoned: nothing of it is committed, the working parameters are rewritten from the last
  // committed step, and its gradients are dropped, so the trainer runs the step's forward and
  // backward again. A parameter's updated working copy is written to its tier while backward
  // still runs: that backward does not read it again, since a parameter's gradient is complete
  // only after its last use.
  Status PrepareStep(const SwapStepOptions& options);
  // Reads a parameter's fp32 master weights (for checkpoints and tests). With world size > 1 this
  // all-gathers the ranks' shards: a collective, which every rank calls for the same parameter.
  // FailedPrecondition for a frozen parameter (it has no master weights).
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
