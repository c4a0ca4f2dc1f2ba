// offload::Engine: the one header a trainer includes to train with memplan's offload engine.
//
// The Engine runs a Schedule (schedule/schedule.h): it owns the parameter swapper (parameters
// resident on the GPU, in pinned CPU memory or on NVMe, fetched per module with trace-driven
// prefetch), the CPU optimizer over fp32 master weights and states (in memory, or on NVMe through
// the pipelined OptimizerSwapper with crash-safe step epochs), the pinned buffers, and the
// gradient path.
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
// bit. The step's options must be known before backward; clipping by the global gradient norm
// and skipping steps whose gradients overflowed are options too (StepOptions), decided by the
// engine once the last gradient is in (Note [Clipping by the global norm] in engine.cc).
//
// Parameter groups (ParamSpec::group, StepOptions::groups): each parameter belongs to one group,
// and each group has optimizer options of its own at every step (torch.optim's param_groups: a
// learning rate, weight decay, betas per group), as data: the optimizer's sub-groups are stepped
// in segments of one group each (Note [Parameter groups] in engine.cc).
//
// Gradient clipping and overflow (StepOptions::max_grad_norm, norm_type, skip_nonfinite): the
// engine measures every gradient as it arrives (GradientNorm(): the global norm over every rank,
// as torch.nn.utils.clip_grad_norm_ computes it), then Step() multiplies the gradients by torch's
// clip coefficient min(1, max_norm / (norm + 1e-6)), or, with skip_nonfinite, skips a step whose
// gradients hold an inf or NaN (what torch's GradScaler does: nothing applied, step counts kept;
// stats().last_step_skipped).
//
// Checkpoints: ReadOptimizerState() reads this rank's shard of a parameter's master weights and
// optimizer states and ParamStepCount() its step count, without a collective; LoadOptimizerState()
// replaces them (all parameters, in one committed step), from a checkpoint of any world size.
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
// of the last complete step. The store records what it holds (every parameter's name, shape,
// frozen flag and dtype, in registration order): a resume whose registration differs in any of
// them is refused, naming the first difference (Note [What a store holds] in engine_params.cc).
// With world size > 1 that is the last step every rank completed: a rank one step ahead of another
// (killed between their commits) goes back one step (a collective in Start(); Note [Resuming ranks]
// in engine_optimizer.cc).
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
#include "schedule/schedule.h"

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
  // written after Start() (Note [Frozen parameters] in engine_params.cc).
  bool frozen = false;
  // Its parameter group: which of StepOptions::groups steps it (0 .. 1023; default 0).
  uint32_t group = 0;
  // The trainer's element type of the parameter ("torch.float32", ...), recorded with the stores
  // so that a resume onto another dtype is refused; empty: not said.
  std::string dtype = {};
};

// The options of one optimizer step (Step(), PrepareStep()).
struct StepOptions {
  // The optimizer's options per parameter group: one entry for every group, or a single entry for
  // them all. Every entry must have the same grad_scale (the loss scale: one per step).
  std::vector<SwapStepOptions> groups;
  // > 0: clip the gradients by their global norm, as torch.nn.utils.clip_grad_norm_(parameters,
  // max_grad_norm, norm_type): multiplied by min(1, max_grad_norm / (norm + 1e-6)) in fp32, the
  // norm of the gradients divided by grad_scale; +inf measures the norm and clips nothing. 0: off
  // (the norm is not measured). Default 0.
  double max_grad_norm = 0;
  // The norm: 1, 2 or +inf. Default 2.
  double norm_type = 2;
  // Skip the step when a gradient holds an inf or NaN (a dynamic loss scaler's overflow): nothing
  // is applied and no step count advances; stats().last_step_skipped says so. Default false: the
  // step runs on them (as torch's optimizers do; with clipping, as clip_grad_norm_ scales them).
  bool skip_nonfinite = false;

  bool operator==(const StepOptions&) const = default;
};

// This rank's shard of a parameter in the optimizer (ReadOptimizerState, LoadOptimizerState):
// elements [first, first + size) of the flattened parameter, those at numel and beyond padding.
struct ParamShard {
  uint64_t first = 0;
  uint64_t size = 0;
  uint64_t numel = 0;
};

// Fills elements [first, first + out.size()) of this rank's shard of `array` of `param` (array 0:
// the fp32 master weights, or a frozen parameter's values; 1..: the optimizer's states in the order
// of SwapOptimizer's comment, Adam: exp_avg, exp_avg_sq[, max_exp_avg_sq]). Only elements before
// the parameter's numel are asked for.
using StateFiller =
    std::function<Status(ParamId param, int array, uint64_t first, std::span<float> out)>;

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
  // Clipping in a prepared step (Note [Clipping by the global norm]): "" (none), "speculated" (the
  // step ran during backward unclipped and the norm said no clipping was needed), "redone" (it
  // did: the speculative step was dropped and the step ran again, serially, from the gradients
  // kept on NVMe), "deferred" (the last step clipped, or the optimizer store keeps one state
  // slot: this one waited for the norm, serially).
  std::string clipping;
  double norm_s = 0;  // Step(): the global norm (draining, the measurement's collective)
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
  uint32_t groups = 1;               // parameter groups (the largest ParamSpec::group + 1)
  uint64_t skipped_steps = 0;        // steps skipped for non-finite gradients (skip_nonfinite)
  bool last_step_skipped = false;    // the last Step() was one of them
  double last_grad_norm = -1;        // its gradients' global norm (divided by grad_scale), when it
                                     // was measured (clipping, skip_nonfinite, GradientNorm());
                                     // -1 otherwise; NaN / inf as torch gives them
  double last_clip_coefficient = 1;  // what the last step multiplied the gradients by (clipping)
  double last_step_s = 0;            // the last Step()'s optimizer time
  EngineStepProfile step_profile;    // the last Step(), stage by stage
  uint64_t peak_device_bytes = 0;    // the runtime's device bytes in use, highest ever (counted
                                     // at every allocation, like cudaMemGetInfo would see them)
  uint64_t pinned_bytes = 0;         // pinned memory the engine holds
  uint64_t device_arena_bytes = 0;   // device memory the engine reserved at Start() and keeps
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
  // skip it (Note [Skipped parameters] in engine_optimizer.cc). Instead of GradReady(), before
  // Step(); no collective: every rank must skip the same parameters. InvalidArgument for a frozen
  // parameter, FailedPrecondition when its gradient was given.
  Status NoGradient(ParamId param);
  // The stream the engine's gradient copies read on ({} on the host-only runtime).
  gpu::Stream GradientStream() const;
  // Runs the optimizer step over all parameters; every parameter's gradient must have been given.
  // After PrepareStep(): finishes the overlapped step; `options` must equal the prepared ones.
  // InvalidArgument for options that do not fit (a group count other than 1 or the groups', a
  // norm_type other than 1, 2, inf); nothing of the step is applied then.
  Status Step(const StepOptions& options);
  // Step() with one options for every group, without clipping.
  Status Step(const SwapStepOptions& options);
  // The global norm (norm_type 1, 2 or inf) of this step's gradients divided by `grad_scale` (the
  // loss scale they carry), over every rank: a collective, which every rank calls. Every
  // gradient must have been given or declared missing (NoGradient(); it counts as zeros, as
  // torch leaves a parameter without grad out). NaN or inf when a gradient holds one, as torch.
  // Step() reuses what this measured. FailedPrecondition before every gradient is in.
  Result<double> GradientNorm(double norm_type = 2, double grad_scale = 1);
  // Abandons the step in progress: every gradient given since the last Step() is dropped (a
  // prepared step's work too: nothing of it is applied, the working parameters rewritten from the
  // last step), and an earlier gradient's failure is forgotten, so that the next step starts
  // clean (after an exception in a trainer's backward, a bad batch, a step the trainer skips). No
  // collective; with world size > 1 every rank must abandon the same step.
  Status AbandonStep();
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
  Status PrepareStep(const StepOptions& options);
  Status PrepareStep(const SwapStepOptions& options);
  // Reads a parameter's fp32 master weights (for checkpoints and tests). With world size > 1 this
  // all-gathers the ranks' shards: a collective, which every rank calls for the same parameter.
  // FailedPrecondition for a frozen parameter (it has no master weights).
  Status ReadMasterWeights(ParamId param, std::span<float> out);

  // Checkpoints (Note [Optimizer state in checkpoints] in engine.cc). Where this rank's shard of
  // `param` lies in the flattened parameter.
  Result<ParamShard> Shard(ParamId param) const;
  // The number of state arrays the optimizer keeps besides the master weights (Adam 2).
  int OptimizerStates() const;
  // Reads this rank's shard of `array` (0: the master weights; 1..OptimizerStates(): the states) of
  // a trainable parameter at the last completed step, padding included (out.size() is the shard's
  // size); no collective. FailedPrecondition for a frozen parameter or in the middle of a step.
  Status ReadOptimizerState(ParamId param, int array, std::span<float> out);
  // The parameter's own step count (torch's state["step"]; Note [Skipped parameters]).
  Result<uint64_t> ParamStepCount(ParamId param) const;
  // Replaces, between steps, the arrays `arrays` says (arrays[k] for array k; 1 +
  // OptimizerStates() entries) of every trainable parameter, and with arrays[0] the frozen
  // parameters' values, from `fill` (this rank's shard of each); `steps` (empty, or one per
  // registered parameter, frozen ones ignored) replaces the step counts. On NVMe the new values are
  // one committed step of the store (a crash leaves the old ones). The working parameters are
  // rewritten; with world size > 1 a collective (the resident parameters' gather), which every
  // rank calls. FailedPrecondition in the middle of a step; on an error (the filler's included)
  // nothing is replaced.
  Status LoadOptimizerState(const StateFiller& fill, std::span<const bool> arrays,
                            std::span<const uint64_t> steps = {});

  EngineStats stats() const;
  // Commits and closes the stores (the NVMe optimizer store is kept for a later resume).
  Status Close();

 private:
  struct Impl;
  explicit Engine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace memplan::offload
