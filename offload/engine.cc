// Engine: see engine.h for the contract. This file is the conductor (Note [The engine's parts]);
// the parts are in engine_params.cc, engine_optimizer.cc, engine_gradients.cc, engine_profile.cc
// and engine_home.cc, with the Notes on what each does.
//
// Note [The engine's parts]
// Engine::Impl is the conductor: it owns the engine's four parts, wires them to one another at
// construction, and runs the API calls' sequences (Start(), Step(), AbandonStep(), Close()) over
// them, with the per-step state that spans them (the step's norm, whether the skipped parameters'
// zeros were fed). Each part is its own type, in its own file, with its own lock and thread
// contract in its header:
//   - ParamPath (engine_params.h): the registration, this rank's partition, the ParamSwapper and
//     its NVMe store and staging, the working copies' writes. The trainer's thread; no mutex.
//   - OptimizerPath (engine_optimizer.h): the optimizer's home (engine_home.h: NVMe or memory),
//     the step counts and skips, the prepared step, and the hand-over of complete sub-groups to an
//     overlapped step, whose shared state is under its overlap_mu.
//   - GradientPath (engine_gradients.h): the gradients' reduce-scatter, copies and conversion to
//     fp32 by the gradient thread, and the norm's pieces; its queue and first error are under its
//     grad_mu.
//   - StepProfile (engine_profile.h): where each step's time went. The trainer's thread; no mutex.
// The parts reach one another only by the references they are built with (the optimizer path the
// parameter path; the gradient path the other three), never back up to Impl.
//
// Note [ZeRO-3 in the engine]
// With world size W > 1 the ParamSwapper cuts every parameter into W equal shards (Note [ZeRO-3
// partitions] in param_swapper.cc) and this rank's partition, its shards back to back, is all the
// engine's optimizer sees: the sub-groups, the NVMe stores (under <nvme.path>/rank<r>/), Fill()
// (this rank's part of each parameter's init, zeros for the padding), the write-back and the
// resume all work in partition coordinates, with no change from world size 1, where the partition
// is the flat space. What is added is three collectives, all on the trainer's thread so that their
// order is the order of the API calls, the same on every rank by the contract in engine.h: the
// gathers in Fetch() (the ParamSwapper), the reduce-scatter of each gradient in GradReady() (Note
// [Reduce-scattered gradients]) and, after Start()'s and Step()'s write-back, the all-gather of
// the resident parameters' shards (ParamSwapper::GatherResident()). ReadMasterWeights() gathers the
// master shards the same way. Neither the gradient thread nor the swapper's transfer thread ever
// calls the Collective: their progress depends on timing, and two threads on one communicator
// would break NCCL's one-call-at-a-time rule.
//
//
// Note [Optimizer overlapped with backward]
// Serially, Step() runs the whole optimizer after backward: for NVMe states the step is then about
// backward + (read, update, write of every sub-group), not their maximum. Backward completes the
// optimizer's sub-groups one by one (the last first: gradients come in reverse registration
// order), so with PrepareStep() the engine begins the swapper's overlapped step (BeginStep, Note
// [Sub-groups as their gradients arrive] in optimizer_swapper.cc) before backward, and the
// gradient thread hands each sub-group over (HandOver) the moment Accumulate() completes it, its
// fp32 gradients in memory: never written to the store nor read back. The swapper's pipeline reads
// the sub-group's states, steps it, writes the working parameters back to their tier (WriteBack,
// on the pipeline's compute thread: ParamSwapper::Write may run beside the trainer's fetches for
// parameters whose gradients are complete, which this backward does not use again) and writes
// the states to their other slot. Step() then drains the gradients, completes the skipped
// parameters' sub-groups (FeedZeros), waits for the last update, starts prefetching the next
// step's first parameters (ParamSwapper::PrefetchNextStep) and commits. What stays as it was:
//   - Results, bit for bit: each sub-group is stepped by the same kernel with the same options and
//     step counts (Segments(), computed when the sub-group completes: its parameters' counts and
//     skips are final then), and its gradients are the same fp32 values.
//   - Crash consistency: the swapper's begun marker is committed in PrepareStep(), the states go
//     to the other slots, and only Step() commits. param_steps.json is written in Step() before
//     the commit, as LoadStepCounts() accepts (a file one step ahead of the store is undone).
//   - ZeRO-3: the reduce-scatters stay in GradReady() on the trainer's thread, in call order; the
//     background threads call no collective; GatherResident() stays after the commit.
//   - Gradient accumulation: the engine takes one gradient per parameter per step (a trainer sums
//     its micro-steps first, as memplan.torch does), so only the last micro-step's gradients
//     complete a sub-group.
//   - Frozen parameters are outside the optimizer's sub-groups; parameters without a gradient
//     complete theirs in Step(), stepped as segments.
// Options: they must be known before backward. Step() compares its options with the prepared ones
// and abandons the step when they differ. Clipping by the global gradient norm and skipping a step
// whose gradients overflowed are options too; what they decide is known only once every gradient
// is in, so a prepared step that may clip or skip is run as Note [Clipping by the global norm]
// says. Errors: an I/O error in a background sub-group, or the write-back's, fails Step() naming
// the step and the sub-group; the step is abandoned (Abandon()): nothing committed, its gradients
// dropped, the working parameters already written rewritten from the committed master weights,
// so the trainer can run the step again.
//
// Note [Clipping by the global norm]
// torch.nn.utils.clip_grad_norm_(parameters, max_norm, p) multiplies every gradient by
// clamp(max_norm / (norm + 1e-6), max=1), norm the p-norm of all of them (1, 2 or inf), in fp32:
// Tensor.__rtruediv__ makes it reciprocal(norm + 1e-6) * max_norm. An infinite norm gives 0 (the
// finite gradients zeroed, an infinite one NaN), a NaN norm NaN. The engine does the same, at
// Step(), with StepOptions::max_grad_norm:
//   - The norm. Every optimizer sub-group's gradients are measured once, when the sub-group is
//     complete (Accumulate(): MeasureGradients, in double, NaNs and infs counted apart, on the
//     gradient thread, beside backward), into norm_parts. StepNorm() adds them in sub-group order
//     and, with world size > 1, every rank's in rank order (an all-gather: the same bits on every
//     rank, and the norm of the mean gradient the ranks step with). GradientNorm() is the same
//     measurement, for a trainer that logs it (the Hugging Face Trainer's grad_norm) or clips by
//     hand; the step reuses it. Divided by grad_scale, the loss scale the gradients carry.
//   - The coefficient multiplies the gradients through grad_scale: the kernels multiply by
//     1 / grad_scale rounded to float once, so grad_scale = loss_scale / coefficient gives back
//     exactly the coefficient (for a power-of-two loss scale, coefficient / loss_scale); 0 and NaN
//     become +inf and NaN, which the kernels take (cpu_optimizer.h).
//   - skip_nonfinite (a dynamic loss scaler's overflow check): a gradient with an inf or NaN
//     drops the step whole (DropStep(): nothing applied, no step count advances).
// With the optimizer overlapped with backward (PrepareStep), a sub-group is stepped as soon as its
// gradients are complete, before the norm of all of them is known, and Adam is not linear in the
// gradient, nor can a sub-group whose states were written be rescaled afterwards. Three ways were
// weighed: keep every gradient in memory until the norm is known (the step's whole fp32 gradient
// partition in host memory, what NVMe offload exists to avoid); speculate, stepping unclipped and
// undoing; or defer the step. The engine speculates when the last step did not clip and defers
// when it did:
//   - speculated: the prepared step runs beside backward unclipped, as without clipping, and each
//     sub-group's gradients are also written to the store's gradient slot (keep_grads: 4 bytes an
//     element, what the serial step writes anyway) by the optimizer's writer stage after the
//     sub-group's states, off backward's path (OptimizerSwapper::StepSubGroup's
//     store_gradients). When the norm says the coefficient is 1 the step finishes as any
//     overlapped one (step_profile.clipping "speculated"), the gradients not written yet are not
//     (StopStoringGradients); its only extra cost is the writes made before the norm was known.
//   - redone: when the coefficient is below 1, the speculative step is run to its end and dropped
//     uncommitted (FinishStep(false): its states went to the sub-groups' other slots, Note [Two
//     slots per sub-group], and now every sub-group's gradients are stored), and the step runs
//     again serially from the stored gradients, with the coefficient; the working parameters the
//     speculative step wrote are written again by it. The cost is the serial step after backward,
//     plus the speculative tail.
//   - deferred: after a step that clipped, the next probably clips too (a training's norm moves
//     slowly): the prepared step does not run beside backward at all, its gradients go to the
//     store as for a serial step and Step() runs it, clipped: the serial step's cost, no waste.
//     Always, with one state slot (optimizer.state_slots 1): a redone step would have rewritten
//     the only copy of the states (Note [One slot per sub-group] in optimizer_swapper.cc); so is
//     a prepared step that may be skipped (skip_nonfinite).
// So a training whose norm stays under max_grad_norm keeps the overlap; one that clips every step
// runs at the serial step's speed, redoing only the first; bench/clip_bench measures both. The
// results are the serial ones, bit for bit, whichever way a step ran. Without clipping declared
// before backward a prepared step cannot clip (its gradients are not kept): Step() then refuses
// other options as before.
//
//
// Note [Parameter groups]
// torch.optim's param_groups give each group of parameters its own learning rate, weight decay,
// betas (the Hugging Face Trainer: no weight decay for biases and norms; a scheduler per group).
// Each parameter's group is fixed when it is registered (ParamSpec::group); a step's options come
// per group (StepOptions::groups), validated against the Schedule's optimizer. A sub-group spans
// parameters of several groups, so when the groups' options differ it is stepped in segments
// (StepSegment::group, Segments()), each with its group's options, the kernels run in place on the
// segment's part of each state array: the results are those of one kernel call per parameter,
// bit for bit (the kernels are element-wise). Only the loss scale, grad_scale, is one per step.
// With world size > 1 a failed step ends the job, as any one rank's error does (the ranks would no
// longer make the same collectives). Bounds: at most optimizer_buffer_count + 2 sub-groups' fp32
// gradients wait for the optimizer; beyond that the gradient thread waits, and so, through the
// staging slots, does backward (stats().step_profile.stall_s). The cpu optimizer tier steps
// serially even when prepared.
//
//
// Note [Optimizer state in checkpoints]
// ReadOptimizerState() reads this rank's shard of a trainable parameter's master weights or of one
// of its states, between steps, only those bytes of each sub-group (no collective: each rank
// writes its own file, as DeepSpeed's zero checkpoints); ParamStepCount() gives its own step count
// (torch's state["step"], Note [Skipped parameters]). LoadOptimizerState() is the way back, with
// any world size on either side (the trainer assembles this rank's shard from the checkpoint's):
// one pass over the sub-groups through the home's Load(), which on NVMe is a committed step of the
// store (begun marker, the other slots, one sync: a crash or a failed filler leaves the last
// step), in memory all or nothing (made in copies). The store's epoch advances by one, so from then
// on each parameter steps at its own count (segmented); the counts are saved as a step's, with how
// much the load changed them, so a resume undoes a load the store did not commit. The working
// parameters, and with the master weights the frozen ones', are rewritten.
//
#include "offload/engine.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <optional>
#include <thread>
#include <utility>

#include "offload/engine_gradients.h"
#include "offload/engine_home.h"
#include "offload/engine_optimizer.h"
#include "offload/engine_params.h"
#include "offload/engine_profile.h"

namespace memplan::offload {
namespace {

using internal::OptimizerPath;

// Makes the missing parents of `dir` as `mkdir -p` does (mode 0777 less the umask, as Python's
// os.makedirs and DeepSpeed's nvme_path make them).
Status MakeParents(const std::string& dir) {
  std::string::size_type at = 0;
  while ((at = dir.find('/', at + 1)) != std::string::npos) {
    const std::string parent = dir.substr(0, at);
    if (parent.empty() || parent.back() == '/') continue;
    if (::mkdir(parent.c_str(), 0777) != 0 && errno != EEXIST) {
      return Status::FromErrno(errno, "engine: cannot create " + parent);
    }
  }
  return Status::Ok();
}

// Makes `dir` (mode 0700) unless it exists, with its missing parents; it must then be a directory
// owned by us.
Status EnsurePrivateDirectory(const std::string& dir) {
  if (::mkdir(dir.c_str(), 0700) == 0) return Status::Ok();
  if (errno == ENOENT) {
    MEMPLAN_RETURN_IF_ERROR(MakeParents(dir));
    if (::mkdir(dir.c_str(), 0700) == 0) return Status::Ok();
  }
  if (errno != EEXIST) return Status::FromErrno(errno, "engine: cannot create " + dir);
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0) return Status::FromErrno(errno, "engine: cannot stat " + dir);
  if (!S_ISDIR(st.st_mode) || st.st_uid != ::getuid()) {
    return Status::FailedPrecondition("engine: " + dir +
                                      " is not a directory owned by this user (or is a symlink)");
  }
  return Status::Ok();
}

}  // namespace

struct Engine::Impl {
  Impl(const EngineOptions& engine_options, std::unique_ptr<gpu::Runtime> owned,
       gpu::Runtime* gpu_runtime)
      : options(engine_options), own_runtime(std::move(owned)), runtime(gpu_runtime) {}

  EngineOptions options;
  std::unique_ptr<gpu::Runtime> own_runtime;
  gpu::Runtime* const runtime;
  // Note [The engine's parts], in the order they are wired (each takes those above it).
  internal::StepProfile profile;
  internal::ParamPath param_path{options, runtime};
  internal::OptimizerPath optimizer_path{options, runtime, param_path};
  internal::GradientPath gradient_path{options, runtime, param_path, optimizer_path, profile};
  // The trainer thread's, per step: its norm over every rank, once measured (Note [Clipping by
  // the global norm]); whether the zeros of the parameters without a gradient were fed.
  std::optional<GradientNormParts> step_norm;
  bool zeros_fed = false;
  bool started = false;
  bool closed = false;
  EngineStats stats;

  int threads() const {
    const int t = options.schedule.optimizer_threads;
    if (t > 0) return t;
    const long cores = ::sysconf(_SC_NPROCESSORS_ONLN);
    return cores > 0 ? static_cast<int>(std::min<long>(cores, 256)) : 1;
  }

  internal::OptimizerHome& home() const { return *optimizer_path.home; }
  Status WriteWorkingCopies() { return param_path.WriteWorkingCopies(home()); }

  // Ends a prepared step that failed (Note [Optimizer overlapped with backward]): the optimizer's
  // step is abandoned (nothing of it committed), the gradients of the step are dropped, and the
  // working parameters, some of which the step had already written, are rewritten from the last
  // committed step. Returns `error` with what the clean-up found added.
  Status Abandon(Status error) {
    const bool was_overlapped = optimizer_path.overlap;
    DropStep();
    Status restored = param_path.params->EndOfStep();
    if (restored.ok() && was_overlapped) restored = WriteWorkingCopies();
    if (!restored.ok()) {
      return restored.WithPrefix(error.ToString() +
                                 "; then rewriting the working parameters "
                                 "from step " +
                                 std::to_string(home().epoch()));
    }
    return error;
  }

  // Drops everything of the step in progress (AbandonStep(), Abandon(), a skipped step): the
  // optimizer's overlapped step, the gradients queued, summed or stored, an earlier gradient's
  // failure. The caller rewrites the working parameters when an overlapped step had begun.
  void DropStep() {
    if (optimizer_path.overlap) {
      optimizer_path.StopHandOvers();
      home().AbortStep();
    }
    gradient_path.DropStep();
    optimizer_path.AllowHandOvers();
    home().DiscardGradients();
    ResetStep();
  }

  // The per-step state back to "no gradient given yet".
  void ResetStep() {
    optimizer_path.overlap = false;
    optimizer_path.prepared = false;
    optimizer_path.keep_grads = false;
    optimizer_path.clipping.clear();
    step_norm.reset();
    std::fill(optimizer_path.no_gradient.begin(), optimizer_path.no_gradient.end(), uint8_t{0});
    zeros_fed = false;
    gradient_path.ResetGiven();
  }

  // Checks a step's options against the engine: the group count, each group's options for the
  // Schedule's optimizer, one grad_scale, the clipping fields.
  Status ValidateStepOptions(const StepOptions& o) const {
    const uint32_t groups = param_path.groups;
    if (o.groups.empty()) return Status::InvalidArgument("engine: step options without a group");
    if (o.groups.size() != 1 && o.groups.size() != groups) {
      return Status::InvalidArgument("engine: step options for " + std::to_string(o.groups.size()) +
                                     " parameter groups; the parameters are in " +
                                     std::to_string(groups));
    }
    for (size_t g = 0; g < o.groups.size(); ++g) {
      MEMPLAN_RETURN_IF_ERROR(ValidateSwapStepOptions(options.schedule.optimizer, o.groups[g])
                                  .WithPrefix(o.groups.size() == 1
                                                  ? std::string("step options")
                                                  : "step options of group " + std::to_string(g)));
      const double scale = OptimizerPath::GradScale(o.groups[g]);
      const double first = OptimizerPath::GradScale(o.groups[0]);
      if (scale != first && !(std::isnan(scale) && std::isnan(first))) {
        return Status::InvalidArgument(
            "engine: the groups' grad_scale differ; the loss scale is one per step");
      }
    }
    if (!(o.max_grad_norm >= 0)) {
      return Status::InvalidArgument("engine: max_grad_norm must be >= 0 (0: no clipping)");
    }
    return ValidateNormType(o.norm_type).WithPrefix("engine");
  }

  // Completes the sub-groups of the parameters declared with NoGradient() with zeros, once a step
  // (after DrainGradients(): the gradient thread is idle).
  Status FeedMissingZeros() {
    if (zeros_fed) return Status::Ok();
    for (size_t i = 0; i < param_path.specs.size(); ++i) {
      if (optimizer_path.no_gradient[i]) MEMPLAN_RETURN_IF_ERROR(gradient_path.FeedZeros(i));
    }
    zeros_fed = true;  // once, should this step be retried
    return Status::Ok();
  }

  // This step's norm pieces over every rank (Note [Clipping by the global norm]): every
  // sub-group's, in order, then every rank's, in rank order (an all-gather: the same bits on every
  // rank). Measured once a step.
  Result<GradientNormParts> StepNorm() {
    if (step_norm) return *step_norm;
    const auto t0 = std::chrono::steady_clock::now();
    MEMPLAN_RETURN_IF_ERROR(gradient_path.DrainGradients());
    MEMPLAN_RETURN_IF_ERROR(FeedMissingZeros());
    MEMPLAN_ASSIGN_OR_RETURN(const GradientNormParts all, gradient_path.NormOverRanks());
    step_norm = all;
    profile.norm_s += SecondsSince(t0);
    return all;
  }

  // Step()'s work once every gradient is given: the gradient thread drained, the zeros of the
  // parameters without a gradient fed, then the optimizer's step (serial) or the end of the step
  // it has been running beside backward (`overlapped`). On the trainer's thread.
  Status RunStep(const StepOptions& step_options, bool overlapped, bool skipping) {
    MEMPLAN_RETURN_IF_ERROR(gradient_path.DrainGradients());
    if (skipping) MEMPLAN_RETURN_IF_ERROR(FeedMissingZeros());
    MEMPLAN_RETURN_IF_ERROR(param_path.params->EndOfStep());
    OptimizerPath& o = optimizer_path;
    o.segmented = o.segmented || skipping;
    if (o.segmented && !o.steps_path.empty()) {
      MEMPLAN_RETURN_IF_ERROR(o.SaveStepCounts(home().epoch() + 1, true));
    }
    if (!overlapped) {
      SegmentFn segments;
      if (o.segmented || OptimizerPath::GroupsDiffer(step_options)) {
        segments = [&o](uint64_t sg) { return o.Segments(sg); };
      }
      return home().Step(
          step_options.groups, [this](const SubGroupUpdate& u) { return param_path.WriteBack(u); },
          segments);
    }
    // Every working parameter is written: the next step's first parameters can be read while
    // the last states are written and the step commits.
    MEMPLAN_RETURN_IF_ERROR(home().WaitForUpdates());
    MEMPLAN_RETURN_IF_ERROR(param_path.params->PrefetchNextStep());
    return home().FinishStep(true);
  }
};

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Engine::~Engine() { (void)Close(); }

Result<std::unique_ptr<Engine>> Engine::Create(const EngineOptions& options) {
  MEMPLAN_RETURN_IF_ERROR(options.schedule.Validate());
  std::unique_ptr<gpu::Runtime> own_runtime;
  gpu::Runtime* runtime = options.runtime;
  if (runtime == nullptr) {
    own_runtime = gpu::CreateBestRuntime(nullptr, options.device);
    runtime = own_runtime.get();
  }
  auto impl = std::make_unique<Impl>(options, std::move(own_runtime), runtime);
  impl->stats.runtime = std::string(impl->runtime->Name());
  if (options.collective != nullptr) {
    const int world = options.collective->world_size(), rank = options.collective->rank();
    if (world < 1 || rank < 0 || rank >= world) {
      return Status::InvalidArgument(
          "engine: collective " + std::string(options.collective->Name()) + " has rank " +
          std::to_string(rank) + " of world size " + std::to_string(world));
    }
    impl->stats.rank = rank;
    impl->stats.world_size = world;
  }
  return std::unique_ptr<Engine>(new Engine(std::move(impl)));
}

Result<ParamId> Engine::AddParameter(const ParamSpec& spec) {
  Impl& s = *impl_;
  if (s.started) return Status::FailedPrecondition("engine: AddParameter() after Start()");
  return s.param_path.Register(spec);
}

Status Engine::Start(RecoveryReport* report) {
  Impl& s = *impl_;
  if (s.started) return Status::FailedPrecondition("engine: Start() twice");
  if (s.param_path.specs.empty())
    return Status::FailedPrecondition("engine: no parameters registered");
  const Schedule& sc = s.options.schedule;
  const int world = s.stats.world_size;
  const bool nvme = sc.param_tier == Tier::kNvme || sc.optimizer_tier == Tier::kNvme;
  // With world size > 1 every rank has its own stores, under rank<r>/, so that ranks on one node
  // may share nvme.path.
  const std::string nvme_dir =
      world == 1 ? sc.nvme_path : sc.nvme_path + "/rank" + std::to_string(s.stats.rank);
  if (nvme) {
    MEMPLAN_RETURN_IF_ERROR(EnsurePrivateDirectory(sc.nvme_path));
    if (world > 1) MEMPLAN_RETURN_IF_ERROR(EnsurePrivateDirectory(nvme_dir));
  }
  MEMPLAN_ASSIGN_OR_RETURN(const internal::PartitionLayout layout,
                           s.param_path.LayOutPartition(s.stats));
  s.param_path.layout = layout;
  MEMPLAN_RETURN_IF_ERROR(s.param_path.CreateParamSwapper(nvme_dir, layout));
  CpuOptimizerOptions cpu;
  cpu.threads = s.threads();
  MEMPLAN_ASSIGN_OR_RETURN(s.param_path.converter, CpuOptimizer::Create(cpu));
  MEMPLAN_RETURN_IF_ERROR(s.optimizer_path.CreateOptimizer(nvme_dir, cpu, layout.total, report));
  // The working copies, from the master weights (which, after a resume, are the last complete
  // step's), and the frozen parameters' from their init.
  MEMPLAN_RETURN_IF_ERROR(s.WriteWorkingCopies());
  MEMPLAN_RETURN_IF_ERROR(s.param_path.WriteFrozenWorkingCopies(layout));
  MEMPLAN_RETURN_IF_ERROR(s.param_path.params->GatherResident());
  // The pinned buffers pinned_budget_bytes covers (as checked above): the parameter staging and
  // the optimizer's; the gradient staging takes what they leave.
  const uint64_t pinned_used =
      (s.param_path.staging ? s.param_path.staging->stats().capacity_bytes : 0) +
      s.home().pinned_bytes();
  MEMPLAN_RETURN_IF_ERROR(s.gradient_path.Prepare(pinned_used));
  s.optimizer_path.no_gradient.assign(s.param_path.specs.size(), false);
  if (s.options.resume && !s.optimizer_path.steps_path.empty()) {
    MEMPLAN_RETURN_IF_ERROR(s.optimizer_path.LoadStepCounts(s.home().epoch()));
  } else {
    s.optimizer_path.param_steps.assign(s.param_path.specs.size(), s.home().epoch());
  }
  s.gradient_path.StartThread();
  s.stats.params = s.param_path.specs.size();
  s.stats.elements = s.param_path.total_elements;
  s.stats.partition_elements = layout.partition;
  s.stats.optimizer_elements = layout.total;
  s.stats.epoch = s.home().epoch();
  s.stats.groups = s.param_path.groups;
  s.started = true;
  return Status::Ok();
}

Status Engine::Fetch(std::string_view module) {
  Impl& s = *impl_;
  if (!s.started || s.closed) return Status::FailedPrecondition("engine: not started");
  Status status = s.param_path.params->Fetch(module);
  s.stats.peak_device_bytes = std::max(s.stats.peak_device_bytes, s.runtime->device_bytes_in_use());
  return status;
}

Status Engine::Release(std::string_view module, gpu::Stream stream) {
  Impl& s = *impl_;
  if (!s.started || s.closed) return Status::FailedPrecondition("engine: not started");
  return s.param_path.params->Release(module, stream);
}

gpu::Stream Engine::GradientStream() const {
  return impl_->runtime->CopyStream(gpu::CopyDirection::kDeviceToHost);
}

Result<void*> Engine::DevicePointer(ParamId param) const {
  const Impl& s = *impl_;
  if (!s.started) return Status::FailedPrecondition("engine: not started");
  if (param >= s.param_path.specs.size())
    return Status::InvalidArgument("engine: unknown parameter id");
  return s.param_path.params->DevicePointer(s.param_path.swap_id[param]);
}

Status Engine::GradReady(ParamId param, const void* device_grad, ElementType type,
                         gpu::Stream stream) {
  Impl& s = *impl_;
  if (!s.started || s.closed) return Status::FailedPrecondition("engine: not started");
  if (param >= s.param_path.specs.size())
    return Status::InvalidArgument("engine: unknown parameter id");
  if (s.gradient_path.grad_given[param]) {
    return Status::FailedPrecondition("engine: gradient of " + s.param_path.specs[param].name +
                                      " given twice in one step");
  }
  if (s.param_path.specs[param].frozen) {
    return Status::InvalidArgument("engine: " + s.param_path.specs[param].name +
                                   " is frozen; it takes no gradient");
  }
  if (ElementBytes(type) == 0) return Status::InvalidArgument("engine: invalid gradient type");
  if (device_grad == nullptr) {
    return Status::InvalidArgument("engine: gradient of " + s.param_path.specs[param].name +
                                   " is null");
  }
  return s.gradient_path.Give(param, device_grad, type, stream);
}

Status Engine::NoGradient(ParamId param) {
  Impl& s = *impl_;
  if (!s.started || s.closed) return Status::FailedPrecondition("engine: not started");
  if (param >= s.param_path.specs.size())
    return Status::InvalidArgument("engine: unknown parameter id");
  if (s.param_path.specs[param].frozen) {
    return Status::InvalidArgument("engine: " + s.param_path.specs[param].name + " is frozen");
  }
  if (s.gradient_path.grad_given[param]) {
    return Status::FailedPrecondition("engine: " + s.param_path.specs[param].name +
                                      " already has a gradient this step");
  }
  if (!s.optimizer_path.no_gradient[param]) {
    s.optimizer_path.no_gradient[param] = true;
    s.gradient_path.grad_given[param] = true;
    --s.gradient_path.grads_missing;
  }
  return Status::Ok();
}

Status Engine::PrepareStep(const SwapStepOptions& options) {
  return PrepareStep(StepOptions{{options}});
}

Status Engine::PrepareStep(const StepOptions& options) {
  Impl& s = *impl_;
  if (!s.started || s.closed) return Status::FailedPrecondition("engine: not started");
  if (s.gradient_path.grads_missing != s.param_path.trainable_params) {
    return Status::FailedPrecondition(
        "engine: PrepareStep() after the step's first GradReady() or NoGradient(); give the "
        "options before backward, or at Step()");
  }
  MEMPLAN_RETURN_IF_ERROR(s.ValidateStepOptions(options).WithPrefix("engine: PrepareStep()"));
  if (s.optimizer_path.overlap) {  // replaced: nothing was handed over yet
    s.home().AbortStep();
    s.optimizer_path.overlap = false;
  }
  s.optimizer_path.prepared = true;
  s.optimizer_path.prepared_options = options;
  s.profile.prepared_at = std::chrono::steady_clock::now();
  s.optimizer_path.keep_grads = false;
  s.optimizer_path.clipping.clear();
  if (!s.home().CanOverlap()) return Status::Ok();  // the cpu optimizer: serial
  // Note [Clipping by the global norm]: a step that may clip runs beside backward unclipped
  // (keeping its gradients for a redo) unless the last step clipped: then it waits for the norm.
  const bool clips = options.max_grad_norm > 0 && !std::isinf(options.max_grad_norm);
  if (clips && s.optimizer_path.last_clipped) {
    s.optimizer_path.clipping = "deferred";
    return Status::Ok();
  }
  // One state slot: a step dropped after its first sub-group was written would leave the store
  // torn (Note [One slot per sub-group] in optimizer_swapper.cc), so a step that the norm may
  // clip (redone) or skip waits for the norm, serially.
  if ((clips || options.skip_nonfinite) && s.options.schedule.optimizer_state_slots == 1) {
    s.optimizer_path.clipping = clips ? "deferred" : "";
    return Status::Ok();
  }
  MEMPLAN_RETURN_IF_ERROR(s.home().BeginStep(
      options.groups, [&s](const SubGroupUpdate& u) { return s.param_path.WriteBack(u); }));
  s.optimizer_path.overlap_limit = s.options.schedule.optimizer_buffer_count + 2;
  s.optimizer_path.keep_grads = clips;
  s.optimizer_path.clipping = clips ? "speculated" : "";
  s.optimizer_path.overlap = true;
  return Status::Ok();
}

Status Engine::Step(const SwapStepOptions& options) { return Step(StepOptions{{options}}); }

Result<double> Engine::GradientNorm(double norm_type, double grad_scale) {
  Impl& s = *impl_;
  if (!s.started || s.closed) return Status::FailedPrecondition("engine: not started");
  MEMPLAN_RETURN_IF_ERROR(ValidateNormType(norm_type).WithPrefix("engine"));
  if (!(grad_scale > 0) || std::isinf(grad_scale)) {
    return Status::InvalidArgument("engine: grad_scale must be > 0 and finite");
  }
  if (s.gradient_path.grads_missing > 0) {
    for (size_t i = 0; i < s.param_path.specs.size(); ++i) {
      if (!s.gradient_path.grad_given[i] && !s.param_path.specs[i].frozen) {
        return Status::FailedPrecondition(
            "engine: the gradient norm needs every gradient of the step; none yet for " +
            s.param_path.specs[i].name + " (" + std::to_string(s.gradient_path.grads_missing) +
            " missing; NoGradient() declares a parameter without one)");
      }
    }
  }
  Result<GradientNormParts> parts = s.StepNorm();
  if (!parts.ok()) {
    if (s.optimizer_path.overlap) return s.Abandon(parts.status());
    return parts.status();
  }
  MEMPLAN_ASSIGN_OR_RETURN(const double norm, parts->Norm(norm_type));
  return norm / grad_scale;
}

Status Engine::AbandonStep() {
  Impl& s = *impl_;
  if (!s.started || s.closed) return Status::FailedPrecondition("engine: not started");
  const bool overlapped = s.optimizer_path.overlap;
  s.DropStep();
  MEMPLAN_RETURN_IF_ERROR(s.param_path.params->EndOfStep());
  // An overlapped step may have written working parameters already.
  if (overlapped) MEMPLAN_RETURN_IF_ERROR(s.WriteWorkingCopies());
  return Status::Ok();
}

namespace {

// torch.nn.utils.clip_grad_norm_'s coefficient, in its fp32 arithmetic: max_norm / (norm + 1e-6)
// is reciprocal(norm + 1e-6) * max_norm (Tensor.__rtruediv__), clamped to at most 1 (NaN stays).
float ClipCoefficient(double max_norm, double norm) {
  const float denominator = static_cast<float>(norm) + 1e-6f;
  const float coefficient = (1.0f / denominator) * static_cast<float>(max_norm);
  return coefficient > 1.0f ? 1.0f : coefficient;
}

}  // namespace

Status Engine::Step(const StepOptions& options) {
  Impl& s = *impl_;
  if (!s.started || s.closed) return Status::FailedPrecondition("engine: not started");
  const auto start = std::chrono::steady_clock::now();
  if (s.optimizer_path.prepared && !(options == s.optimizer_path.prepared_options)) {
    const Status refused = Status::FailedPrecondition(
        "engine: Step() was given other options than PrepareStep(); the step is abandoned "
        "(nothing of it applied): run its forward and backward again");
    if (s.optimizer_path.overlap) return s.Abandon(refused);
    s.DropStep();
    return refused;
  }
  if (!s.optimizer_path.prepared) MEMPLAN_RETURN_IF_ERROR(s.ValidateStepOptions(options));
  if (s.gradient_path.grads_missing > 0) {
    for (size_t i = 0; i < s.param_path.specs.size(); ++i) {
      if (!s.gradient_path.grad_given[i] && !s.param_path.specs[i].frozen) {
        return Status::FailedPrecondition("engine: no gradient for " + s.param_path.specs[i].name +
                                          " this step (" +
                                          std::to_string(s.gradient_path.grads_missing) +
                                          " missing; NoGradient() skips a parameter)");
      }
    }
  }
  const bool skipping =
      std::find(s.optimizer_path.no_gradient.begin(), s.optimizer_path.no_gradient.end(),
                uint8_t{1}) != s.optimizer_path.no_gradient.end();
  // Note [Clipping by the global norm]: the norm, when the step clips or may skip.
  StepOptions effective = options;
  double norm = -1;
  float coefficient = 1.0f;
  bool skip = false;
  s.profile.norm_s = 0;
  if (options.max_grad_norm > 0 || options.skip_nonfinite || s.step_norm) {
    Result<GradientNormParts> parts = s.StepNorm();
    if (!parts.ok()) {
      if (s.optimizer_path.overlap) return s.Abandon(parts.status().WithPrefix("engine: step"));
      return parts.status();
    }
    const double loss_scale = OptimizerPath::GradScale(options.groups[0]);
    MEMPLAN_ASSIGN_OR_RETURN(const double raw, parts->Norm(options.norm_type));
    norm = raw / loss_scale;
    skip = options.skip_nonfinite && !parts->finite();
    if (!skip && options.max_grad_norm > 0) {
      coefficient = ClipCoefficient(options.max_grad_norm, norm);
      if (coefficient != 1.0f) {
        // The kernels multiply by 1 / grad_scale rounded to float: loss_scale / coefficient
        // gives back exactly coefficient / loss_scale for a power-of-two loss scale (and exactly
        // the coefficient without one); 0 and NaN give +inf and NaN (cpu_optimizer.h).
        for (SwapStepOptions& g : effective.groups) {
          OptimizerPath::SetGradScale(g, loss_scale / static_cast<double>(coefficient));
        }
      }
    }
  }
  s.stats.last_grad_norm = norm;
  s.stats.last_clip_coefficient = coefficient;
  if (skip) {  // GradScaler's skipped step: nothing applied, no count advances
    const bool overlapped = s.optimizer_path.overlap;
    s.DropStep();
    MEMPLAN_RETURN_IF_ERROR(s.param_path.params->EndOfStep());
    if (overlapped) MEMPLAN_RETURN_IF_ERROR(s.WriteWorkingCopies());
    MEMPLAN_RETURN_IF_ERROR(s.param_path.params->GatherResident());
    ++s.stats.skipped_steps;
    s.stats.last_step_skipped = true;
    s.stats.last_step_s = SecondsSince(start);
    return Status::Ok();
  }
  s.stats.last_step_skipped = false;
  bool overlapped = s.optimizer_path.overlap;
  const uint64_t before_step = overlapped ? s.home().SubGroupsUpdated() : 0;
  // A speculated step that stands: the gradients kept for a redo are not written any more.
  if (overlapped && s.optimizer_path.keep_grads && effective == options)
    s.home().StopStoringGradients();
  if (overlapped && !(effective == options)) {
    // The step ran beside backward unclipped, and the norm says it must clip: drop it and run it
    // again from the gradients kept on NVMe (its other slots are rewritten; nothing was committed).
    // Run to its end, uncommitted, so that every sub-group's gradients are stored.
    Status drained = s.gradient_path.DrainGradients();
    if (drained.ok()) drained = s.FeedMissingZeros();
    if (drained.ok()) drained = s.gradient_path.DrainGradients();
    if (drained.ok()) drained = s.home().FinishStep(false);
    if (!drained.ok()) return s.Abandon(drained.WithPrefix("engine: step"));
    s.optimizer_path.overlap = false;
    s.optimizer_path.clipping = "redone";
    overlapped = false;
  }
  Status status = s.RunStep(effective, overlapped, skipping);
  if (!status.ok()) {
    if (overlapped)
      return s.Abandon(
          status.WithPrefix("engine: overlapped step " + std::to_string(s.home().epoch() + 1)));
    return status;
  }
  s.optimizer_path.last_clipped = coefficient != 1.0f;
  const std::string clipping = s.optimizer_path.clipping;
  s.optimizer_path.overlap = false;
  s.optimizer_path.prepared = false;
  s.optimizer_path.keep_grads = false;
  s.step_norm.reset();
  for (size_t i = 0; i < s.param_path.specs.size(); ++i) {
    if (!s.param_path.specs[i].frozen && !s.optimizer_path.no_gradient[i])
      ++s.optimizer_path.param_steps[i];
  }
  std::fill(s.optimizer_path.no_gradient.begin(), s.optimizer_path.no_gradient.end(), uint8_t{0});
  s.zeros_fed = false;
  MEMPLAN_RETURN_IF_ERROR(s.param_path.params->GatherResident());
  s.stats.last_step_s = SecondsSince(start);
  std::fill(s.gradient_path.grad_given.begin(), s.gradient_path.grad_given.end(), false);
  s.gradient_path.grads_missing = s.param_path.trainable_params;
  ++s.stats.steps;
  s.stats.epoch = s.home().epoch();
  s.profile.Record(s.stats, s.home(), start, overlapped, before_step, clipping);
  s.optimizer_path.clipping.clear();
  return Status::Ok();
}

Result<ParamShard> Engine::Shard(ParamId param) const {
  const Impl& s = *impl_;
  if (!s.started) return Status::FailedPrecondition("engine: not started");
  if (param >= s.param_path.specs.size())
    return Status::InvalidArgument("engine: unknown parameter id");
  const ParamId sid = s.param_path.swap_id[param];
  ParamShard shard;
  shard.size = s.param_path.params->ShardSize(sid);
  shard.first = static_cast<uint64_t>(s.param_path.params->rank()) * shard.size;
  shard.numel = s.param_path.params->Numel(sid);
  return shard;
}

int Engine::OptimizerStates() const {
  return SwapOptimizerStates(impl_->options.schedule.optimizer);
}

Status Engine::ReadOptimizerState(ParamId param, int array, std::span<float> out) {
  Impl& s = *impl_;
  if (!s.started || s.closed) return Status::FailedPrecondition("engine: not started");
  if (param >= s.param_path.specs.size())
    return Status::InvalidArgument("engine: unknown parameter id");
  if (s.param_path.specs[param].frozen) {
    return Status::FailedPrecondition("engine: " + s.param_path.specs[param].name +
                                      " is frozen: it has no optimizer state");
  }
  if (array < 0 || array > OptimizerStates()) {
    return Status::InvalidArgument("engine: array " + std::to_string(array) + " of " +
                                   std::to_string(OptimizerStates() + 1));
  }
  if (s.gradient_path.grads_missing != s.param_path.trainable_params || s.optimizer_path.overlap) {
    return Status::FailedPrecondition(
        "engine: the optimizer state is read between steps (gradients of the next step were "
        "given already)");
  }
  const ParamId sid = s.param_path.swap_id[param];
  if (out.size() != s.param_path.params->ShardSize(sid)) {
    return Status::InvalidArgument("engine: output size mismatch (the shard has " +
                                   std::to_string(s.param_path.params->ShardSize(sid)) +
                                   " elements)");
  }
  return s.optimizer_path.ReadPartition(s.param_path.params->PartitionOffset(sid), out, array);
}

Result<uint64_t> Engine::ParamStepCount(ParamId param) const {
  const Impl& s = *impl_;
  if (!s.started) return Status::FailedPrecondition("engine: not started");
  if (param >= s.param_path.specs.size())
    return Status::InvalidArgument("engine: unknown parameter id");
  if (s.param_path.specs[param].frozen) {
    return Status::FailedPrecondition("engine: " + s.param_path.specs[param].name + " is frozen");
  }
  return s.optimizer_path.param_steps[param];
}

Status Engine::LoadOptimizerState(const StateFiller& fill, std::span<const bool> arrays,
                                  std::span<const uint64_t> steps) {
  Impl& s = *impl_;
  if (!s.started || s.closed) return Status::FailedPrecondition("engine: not started");
  if (!fill) return Status::InvalidArgument("engine: no state filler given");
  if (arrays.size() != static_cast<size_t>(1 + OptimizerStates())) {
    return Status::InvalidArgument("engine: " + std::to_string(arrays.size()) +
                                   " array flags; the optimizer has " +
                                   std::to_string(1 + OptimizerStates()) + " arrays");
  }
  if (!steps.empty() && steps.size() != s.param_path.specs.size()) {
    return Status::InvalidArgument("engine: " + std::to_string(steps.size()) + " step counts for " +
                                   std::to_string(s.param_path.specs.size()) + " parameters");
  }
  if (s.gradient_path.grads_missing != s.param_path.trainable_params || s.optimizer_path.overlap ||
      s.optimizer_path.prepared) {
    return Status::FailedPrecondition(
        "engine: the optimizer state is loaded between steps (this step's gradients were given "
        "already: finish or abandon it first)");
  }
  const uint64_t sg_elems = s.home().sub_group_elements();
  const bool any = std::find(arrays.begin(), arrays.end(), true) != arrays.end();
  if (any) {
    // The step counts first, as for a step: a crash before the store's commit leaves a file one
    // step ahead, which a resume undoes (Note [Skipped parameters]).
    if (!steps.empty() && !s.optimizer_path.steps_path.empty()) {
      MEMPLAN_RETURN_IF_ERROR(s.optimizer_path.SaveStepCounts(s.home().epoch() + 1, false, steps));
    }
    MEMPLAN_RETURN_IF_ERROR(s.home().Load(
        [&](uint64_t sg, int array, std::span<float> out) {
          return s.param_path.FillFrom(fill, array, sg * sg_elems, out);
        },
        arrays));
  }
  if (!steps.empty()) {
    for (size_t i = 0; i < s.param_path.specs.size(); ++i) {
      if (!s.param_path.specs[i].frozen) s.optimizer_path.param_steps[i] = steps[i];
    }
  }
  // The store's epoch moved by one with the load: the counts are the parameters' own from now on.
  s.optimizer_path.segmented = true;
  if (!s.optimizer_path.steps_path.empty() && (steps.empty() || !any)) {
    MEMPLAN_RETURN_IF_ERROR(s.optimizer_path.SaveStepCounts(s.home().epoch(), false));
  }
  s.stats.epoch = s.home().epoch();
  MEMPLAN_RETURN_IF_ERROR(s.param_path.params->EndOfStep());
  if (arrays[0]) {
    MEMPLAN_RETURN_IF_ERROR(s.WriteWorkingCopies());
    if (s.param_path.layout.partition > s.param_path.layout.frozen_begin) {
      MEMPLAN_RETURN_IF_ERROR(s.param_path.WriteFrozenWorkingCopies(
          s.param_path.layout, [&](uint64_t at, std::span<float> out) {
            return s.param_path.FillFrom(fill, 0, at, out);
          }));
    }
  }
  return s.param_path.params->GatherResident();
}

Status Engine::ReadMasterWeights(ParamId param, std::span<float> out) {
  Impl& s = *impl_;
  if (!s.started || s.closed) return Status::FailedPrecondition("engine: not started");
  if (param >= s.param_path.specs.size())
    return Status::InvalidArgument("engine: unknown parameter id");
  if (s.param_path.specs[param].frozen) {
    return Status::FailedPrecondition("engine: " + s.param_path.specs[param].name +
                                      " is frozen: it has no master weights (read a fetched "
                                      "working copy)");
  }
  const ParamId sid = s.param_path.swap_id[param];
  const uint64_t n = s.param_path.params->Numel(sid);
  if (out.size() != n) return Status::InvalidArgument("engine: output size mismatch");
  const uint64_t first = s.param_path.params->PartitionOffset(sid);
  const int world = s.param_path.params->world_size();
  if (world == 1) return s.optimizer_path.ReadPartition(first, out);
  // World size > 1: this rank holds one shard; all-gather every rank's, through device memory as
  // the Collective needs.
  const uint64_t shard = s.param_path.params->ShardSize(sid);
  const uint64_t shard_bytes = shard * 4;
  const uint64_t rank = static_cast<uint64_t>(s.param_path.params->rank());
  std::vector<float> all(shard * static_cast<uint64_t>(world));
  MEMPLAN_RETURN_IF_ERROR(
      s.optimizer_path.ReadPartition(first, std::span<float>(all).subspan(rank * shard, shard)));
  MEMPLAN_ASSIGN_OR_RETURN(void* device, s.runtime->AllocateDevice(all.size() * 4));
  Status status = [&]() -> Status {
    auto* base = static_cast<std::byte*>(device);
    MEMPLAN_ASSIGN_OR_RETURN(
        gpu::CopyTicket up,
        s.runtime->CopyAsync(gpu::CopyDirection::kHostToDevice, base + rank * shard_bytes,
                             all.data() + rank * shard, shard_bytes));
    MEMPLAN_RETURN_IF_ERROR(s.runtime->Wait(up));
    MEMPLAN_RETURN_IF_ERROR(s.options.collective->AllGather(base + rank * shard_bytes, base, shard,
                                                            ElementType::kFloat32));
    MEMPLAN_ASSIGN_OR_RETURN(
        gpu::CopyTicket down,
        s.runtime->CopyAsync(gpu::CopyDirection::kDeviceToHost, all.data(), base, all.size() * 4));
    return s.runtime->Wait(down);
  }();
  Status freed = s.runtime->FreeDevice(device);
  MEMPLAN_RETURN_IF_ERROR(status.WithPrefix("engine: gathering the master weights of " +
                                            s.param_path.specs[param].name));
  MEMPLAN_RETURN_IF_ERROR(freed);
  std::copy_n(all.begin(), n, out.begin());
  return Status::Ok();
}

EngineStats Engine::stats() const {
  const Impl& s = *impl_;
  EngineStats out = s.stats;
  out.d2h_bytes = s.gradient_path.d2h_bytes_total();
  out.reduce_scatter_bytes = s.gradient_path.reduce_scatter_bytes;
  if (s.param_path.params) out.param = s.param_path.params->stats();
  if (s.optimizer_path.home) {
    out.optimizer_read_bytes = s.home().read_bytes();
    out.optimizer_write_bytes = s.home().write_bytes();
    out.grad_write_bytes = s.home().grad_write_bytes();
    out.pinned_bytes =
        out.param.pinned_bytes + s.home().pinned_bytes() +
        (s.gradient_path.grad_staging ? s.gradient_path.grad_staging->stats().capacity_bytes : 0);
    const nvme::SwapStoreStats store = s.home().store_stats();
    out.nvme_read_bytes += store.get_bytes;
    out.nvme_write_bytes += store.put_bytes;
  }
  if (s.param_path.param_store) {
    const nvme::SwapStoreStats store = s.param_path.param_store->stats();
    out.nvme_read_bytes += store.get_bytes;
    out.nvme_write_bytes += store.put_bytes;
  }
  out.peak_device_bytes = std::max(out.peak_device_bytes, s.runtime->peak_device_bytes());
  out.device_arena_bytes = out.param.device_arena_bytes + 2 * s.gradient_path.grad_scratch_bytes;
  return out;
}

Status Engine::Close() {
  Impl& s = *impl_;
  if (s.closed) return Status::Ok();
  s.closed = true;
  if (s.optimizer_path.overlap) {  // a prepared step never finished: nothing of it is committed
    s.optimizer_path.StopHandOvers();
    s.home().AbortStep();
  }
  s.gradient_path.Close();
  Status status;
  if (s.param_path.params) status = s.param_path.params->EndOfStep();
  s.param_path.params.reset();  // before the store and staging pool it uses
  if (s.optimizer_path.home) {
    Status closed = s.optimizer_path.home->Close();
    if (status.ok()) status = closed;
  }
  if (s.param_path.param_store) {
    Status closed = s.param_path.param_store->Close();
    if (status.ok()) status = closed;
  }
  s.param_path.staging.reset();
  return status;
}

}  // namespace memplan::offload
