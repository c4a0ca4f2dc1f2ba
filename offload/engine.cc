// Engine: see engine.h for the contract.
//
// Note [Two optimizer homes]
// The Schedule's optimizer tier decides where the fp32 master weights, states and gradients live:
// "nvme" runs the OptimizerSwapper (a store on disk, pipelined sub-groups, crash-safe epochs);
// "cpu" keeps them in ordinary host memory and runs the same kernels over the same sub-groups
// (ZeRO-Offload). Both present the same small interface below, so the gradient path and the
// write-back of updated parameters do not care which one runs.
//
// Note [fp32 working parameters]
// With params.dtype fp32 the working copy the trainer computes with is the master weights
// themselves, so there is no 16-bit copy to make: the optimizer runs with HalfDtype::kNone (the
// NVMe swapper's buffers then have no half section) and the write-back hands the sub-group's
// updated fp32 values, as the optimizer left them, to ParamSwapper::WriteFloat(). Every tier then
// holds 4 bytes per element (the pinned arena, the NVMe chunks "hp.<chunk>", the GPU copies and
// the budgets, all in bytes, follow ElementBytes(dtype)), and a fetched parameter equals
// ReadMasterWeights() bit for bit after every Step() and after a resume.
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
// Note [Skipped parameters]
// torch's optimizers skip a parameter whose gradient is None: its weights and states stay as they
// are and its own step count (the bias correction's t) does not advance. NoGradient() declares
// that for a parameter in this step; Step() then feeds zeros for it through the gradient path
// (so every sub-group's gradients are whole, as the homes require) and runs the optimizer over
// segments (StepSegment): each trainable parameter's shard at its own count + 1, a skipped one not
// at all (its 16-bit copy is still produced for the write-back). Counts are kept per parameter
// (param_steps); until a parameter is first skipped they all equal the epoch and the step runs
// unsegmented, as before. With the optimizer on NVMe they are saved, once any differ, beside the
// stores in param_steps.json before each step (written atomically, with which parameters that
// step advances), so a resume at the store's step, or at the step before (a step written there
// but not committed in the store), restores them exactly. A forgotten gradient (neither given nor
// declared) is still an error. NoGradient() calls no collective: with world size > 1 every rank
// must skip the same parameters (as every rank must give the same gradients).
//
// Note [Resuming ranks]
// Each rank commits its own optimizer store at the end of its Step(), and nothing orders those
// commits across ranks: a rank killed between them (Step() has no collective once no parameter is
// resident) leaves the others one step ahead of it. So with resume and world size > 1, Start()
// all-gathers the ranks' last complete steps and every rank resumes at the oldest: a rank ahead
// reopens its store at that step (OptimizerSwapperOptions::max_epoch), which each sub-group still
// holds in its other slot. Two steps apart cannot happen (no rank starts step E + 1 before every
// rank's gradients of step E were reduced, which needs them all alive past their backward).
//
// Note [Reduce-scattered gradients]
// GradReady() gets the rank's whole gradient. It is copied into a device buffer of W * shard
// elements whose padding is zeroed, reduce-scattered in place (slot `rank` receives the sum over
// ranks of every rank's slot `rank`), and only that shard goes to the host, asynchronously as for
// world size 1; the buffer returns to a free list when that copy is done. The gradient thread then
// divides by W while converting to fp32: the optimizer sees the mean gradient over ranks, as with
// DeepSpeed's default averaging and PyTorch DDP, so hyperparameters tuned with the global batch's
// mean loss carry over. Summing first and dividing once, in fp32 (rather than dividing each rank's
// gradient before the sum, DeepSpeed's gradient_predivide_factor), costs no extra pass on the GPU
// and for W a power of two the division is exact: with the thread collective, whose fp32 sums run
// in rank order, W ranks then end bit for bit where one rank fed the mean gradient does. The price
// is that a 16-bit sum can overflow where every term does not (fp16 above 65504): scale the loss
// for that, as for fp16 training anyway. The reduce-scatter is synchronous (as every Collective
// call), so `device_grad` is free when GradReady() returns.
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
// So a training whose norm stays under max_grad_norm keeps the overlap; one that clips every step
// runs at the serial step's speed, redoing only the first; bench/clip_bench measures both. The
// results are the serial ones, bit for bit, whichever way a step ran. Without clipping declared
// before backward a prepared step cannot clip (its gradients are not kept): Step() then refuses
// other options as before.
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
// Note [What a store holds]
// The optimizer store outlives its process (resume), and its states are meaningful only for the
// parameters that wrote them. Its element count alone cannot tell another registration with the
// same count (two layers defined in the other order, a renamed or reshaped parameter): a resume
// would put one parameter's weights and moments on another, silently (issue 30 H3). So the store
// records the registration (Identity(): every parameter's name, shape, frozen flag and the
// trainer's dtype, in order), written by OptimizerSwapper::Create() before its first commit, and a
// resume compares it with this engine's, refusing the first difference by name. A store made by an
// older memplan records none: it is accepted on its element count, with a note in the recovery
// report. A live store, of another process or another engine of this one, is refused as in use
// (LockHolder: the store's flock), never taken for a crashed run's.
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
// Note [Frozen parameters]
// A frozen parameter is in the ParamSwapper like any other (fetched, gathered, on its tier) but not
// in the optimizer. The swapper's partition is laid out trainable parameters first, in
// registration order, then the frozen ones, so the optimizer's sub-groups cover a prefix of it,
// [0, optimizer_elements), with no holes: nothing of the optimizer (its NVMe store, its pinned
// buffers, the gradient scratch and staging, sized by the largest trainable shard) grows with a
// frozen base. The frozen part starts at a chunk boundary (ParamSwapper::Pad()), so the NVMe
// write-back of the last trainable sub-group never touches a chunk holding frozen values; those
// are written once, in Start(), from their init (with resume too: they never change, and their
// init gives them again), and never after. ParamIds stay the registration indices; swap_id maps
// them to the swapper's.
#include "offload/engine.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <cmath>
#include <optional>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <deque>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <utility>

#include <fstream>

#include <nlohmann/json.hpp>

#include "common/json.h"
#include "common/mutex.h"
#include "offload/half.h"

namespace memplan::offload {
namespace {

constexpr uint32_t kMaxGroups = 1024;  // ParamSpec::group's bound

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// The optimizer's 16-bit output for working parameters of `type`; kNone for fp32, whose working
// copy is the master weights themselves (Note [fp32 working parameters]).
HalfDtype ToHalf(ElementType type) {
  switch (type) {
    case ElementType::kFloat32: return HalfDtype::kNone;
    case ElementType::kFloat16: return HalfDtype::kFp16;
    case ElementType::kBFloat16: return HalfDtype::kBf16;
  }
  return HalfDtype::kNone;
}

// The optimizer's home (Note [Two optimizer homes]).
class OptimizerHome {
 public:
  virtual ~OptimizerHome() = default;
  virtual uint64_t sub_group_elements() const = 0;
  virtual uint64_t sub_group_count() const = 0;
  virtual uint64_t SubGroupSize(uint64_t sg) const = 0;
  virtual Status WriteGradients(uint64_t sg, std::span<const float> grads) = 0;
  // Where sub-group sg's gradients can be written in place (then WriteGradients is given this
  // same span and copies nothing); empty when the home has no such buffer.
  virtual std::span<float> DirectGradients(uint64_t /*sg*/) { return {}; }
  // `options`: per parameter group (Note [Parameter groups]); `segments`: per-parameter step
  // counts, groups and skipped parameters (Note [Skipped parameters]); null: every element at the
  // home's epoch + 1 with options[0].
  virtual Status Step(std::span<const SwapStepOptions> options, const UpdateCallback& on_update,
                      const SegmentFn& segments) = 0;
  // Elements [offset, offset + out.size()) of sub-group sg's array (0 the master weights, 1.. the
  // states) at the last step.
  virtual Status ReadRange(uint64_t sg, int array, uint64_t offset, std::span<float> out) = 0;
  Status ReadParams(uint64_t sg, std::span<float> out) { return ReadRange(sg, 0, 0, out); }
  // Replaces the arrays `arrays` says of every sub-group from `fill`, all or nothing, as one step
  // of the home's epoch (Note [Optimizer state in checkpoints]).
  virtual Status Load(const OptimizerSwapper::ArrayFiller& fill, std::span<const bool> arrays) = 0;
  // Forgets the gradients of a step the trainer abandoned.
  virtual void DiscardGradients() = 0;
  // What the store holds (Note [What a store holds]); empty in memory.
  virtual std::string identity() const { return {}; }
  // The overlapped step (Note [Optimizer overlapped with backward]), as the OptimizerSwapper's
  // calls of the same names; only a home that CanOverlap() has them.
  virtual bool CanOverlap() const { return false; }
  virtual Status BeginStep(std::span<const SwapStepOptions> /*options*/,
                           const UpdateCallback& /*on_update*/) {
    return Status::Unimplemented("engine: this optimizer home steps serially");
  }
  virtual Status StepSubGroup(uint64_t /*sg*/, std::span<const float> /*grads*/,
                              std::vector<StepSegment> /*segments*/, std::function<void()> /*done*/,
                              bool /*store*/) {
    return Status::Unimplemented("engine: this optimizer home steps serially");
  }
  virtual uint64_t SubGroupsUpdated() const { return 0; }
  virtual Status WaitForUpdates() { return Status::Ok(); }
  // `commit` false: run to its end and dropped, the stored gradients kept (a redo).
  virtual Status FinishStep(bool /*commit*/) { return Status::Ok(); }
  virtual void AbortStep() {}
  virtual void StopStoringGradients() {}
  // The last step's stage times (the swapper's; the in-memory home fills compute only).
  virtual SwapStepStats last_step() const = 0;
  virtual uint64_t epoch() const = 0;
  virtual uint64_t pinned_bytes() const = 0;
  virtual uint64_t read_bytes() const = 0;
  virtual uint64_t write_bytes() const = 0;
  // Gradients written to the store for a serial step (read back by it: in read_bytes).
  virtual uint64_t grad_write_bytes() const { return 0; }
  // The optimizer store's own counters (gradients included); 0 in memory.
  virtual nvme::SwapStoreStats store_stats() const { return {}; }
  virtual Status Close() = 0;
};

class NvmeHome final : public OptimizerHome {
 public:
  explicit NvmeHome(std::unique_ptr<OptimizerSwapper> swapper) : s_(std::move(swapper)) {}
  uint64_t sub_group_elements() const override { return s_->sub_group_elements(); }
  uint64_t sub_group_count() const override { return s_->sub_group_count(); }
  uint64_t SubGroupSize(uint64_t sg) const override { return s_->SubGroupSize(sg); }
  Status WriteGradients(uint64_t sg, std::span<const float> grads) override {
    MEMPLAN_RETURN_IF_ERROR(s_->WriteGradients(sg, grads));
    grad_write_.fetch_add(grads.size_bytes(), std::memory_order_relaxed);
    return Status::Ok();
  }
  Status Step(std::span<const SwapStepOptions> options, const UpdateCallback& on_update,
              const SegmentFn& segments) override {
    Status status = s_->Step(options, on_update, segments);
    const SwapStepStats& last = s_->stats().last_step;
    read_ += last.read_bytes;
    write_ += last.write_bytes;
    return status;
  }
  Status ReadRange(uint64_t sg, int array, uint64_t offset, std::span<float> out) override {
    return s_->ReadRange(sg, array, offset, out);
  }
  Status Load(const OptimizerSwapper::ArrayFiller& fill, std::span<const bool> arrays) override {
    return s_->Load(fill, arrays);
  }
  void DiscardGradients() override { s_->DiscardGradients(); }
  std::string identity() const override { return s_->identity(); }
  bool CanOverlap() const override { return true; }
  Status BeginStep(std::span<const SwapStepOptions> options,
                   const UpdateCallback& on_update) override {
    return s_->BeginStep(options, on_update, nullptr);
  }
  Status StepSubGroup(uint64_t sg, std::span<const float> grads, std::vector<StepSegment> segments,
                      std::function<void()> done, bool store) override {
    return s_->StepSubGroup(sg, grads, std::move(segments), std::move(done), store);
  }
  uint64_t SubGroupsUpdated() const override { return s_->SubGroupsUpdated(); }
  Status WaitForUpdates() override { return s_->WaitForUpdates(); }
  Status FinishStep(bool commit) override {
    Status status = s_->FinishStep(commit);
    const SwapStepStats& last = s_->stats().last_step;
    read_ += last.read_bytes;
    write_ += last.write_bytes;
    return status;
  }
  void AbortStep() override { s_->AbortStep(); }
  void StopStoringGradients() override { s_->StopStoringGradients(); }
  SwapStepStats last_step() const override { return s_->stats().last_step; }
  uint64_t epoch() const override { return s_->epoch(); }
  uint64_t pinned_bytes() const override { return s_->stats().pool.capacity_bytes; }
  uint64_t read_bytes() const override { return read_; }
  uint64_t write_bytes() const override { return write_; }
  uint64_t grad_write_bytes() const override { return grad_write_.load(std::memory_order_relaxed); }
  nvme::SwapStoreStats store_stats() const override { return s_->stats().store; }
  Status Close() override { return s_->Close(); }

 private:
  std::unique_ptr<OptimizerSwapper> s_;
  uint64_t read_ = 0, write_ = 0;
  std::atomic<uint64_t> grad_write_{0};  // written by the gradient thread
};

class MemoryHome final : public OptimizerHome {
 public:
  static Result<std::unique_ptr<MemoryHome>> Create(SwapOptimizer optimizer, HalfDtype half,
                                                    const CpuOptimizerOptions& cpu_options,
                                                    uint64_t n, uint64_t sub_group,
                                                    const ParamFiller& fill) {
    auto home = std::unique_ptr<MemoryHome>(new MemoryHome());
    home->optimizer_ = optimizer;
    home->half_ = half;
    home->n_ = n;
    home->sg_ = sub_group;
    home->states_ = SwapOptimizerStates(optimizer);
    MEMPLAN_ASSIGN_OR_RETURN(home->cpu_, CpuOptimizer::Create(cpu_options));
    try {
      home->params_.resize(n);
      home->grads_.resize(n);
      home->grads_written_.assign(home->sub_group_count(), false);
      home->state_.assign(home->sub_group_count(), {});
      if (half != HalfDtype::kNone) home->half_buffer_.resize(std::min(n, sub_group));
    } catch (const std::bad_alloc&) {
      return Status::ResourceExhausted("engine: cannot allocate the optimizer's host memory for " +
                                       std::to_string(n) + " parameters");
    }
    for (uint64_t sg = 0; sg < home->sub_group_count(); ++sg) {
      const uint64_t first = sg * sub_group;
      const uint64_t size = home->SubGroupSize(sg);
      MEMPLAN_RETURN_IF_ERROR(fill(first, std::span<float>(home->params_.data() + first, size)));
      home->state_[sg].assign(size * home->states_, 0.0f);
    }
    return home;
  }
  uint64_t sub_group_elements() const override { return sg_; }
  uint64_t sub_group_count() const override { return (n_ + sg_ - 1) / sg_; }
  uint64_t SubGroupSize(uint64_t sg) const override { return std::min(sg_, n_ - sg * sg_); }
  Status WriteGradients(uint64_t sg, std::span<const float> grads) override {
    if (sg >= sub_group_count() || grads.size() != SubGroupSize(sg)) {
      return Status::InvalidArgument("engine: bad gradient sub-group");
    }
    float* dst = grads_.data() + sg * sg_;
    if (grads.data() != dst) std::copy(grads.begin(), grads.end(), dst);
    grads_written_[sg] = true;
    return Status::Ok();
  }
  std::span<float> DirectGradients(uint64_t sg) override {
    return {grads_.data() + sg * sg_, static_cast<size_t>(SubGroupSize(sg))};
  }
  Status Step(std::span<const SwapStepOptions> options, const UpdateCallback& on_update,
              const SegmentFn& segments) override {
    if (options.empty()) return Status::InvalidArgument("engine: step without options");
    for (const SwapStepOptions& o : options) {
      MEMPLAN_RETURN_IF_ERROR(ValidateSwapStepOptions(optimizer_, o));
    }
    for (uint64_t sg = 0; sg < sub_group_count(); ++sg) {
      if (!grads_written_[sg]) {
        return Status::FailedPrecondition("gradients of sub-group " + std::to_string(sg) +
                                          " have not been written since step " +
                                          std::to_string(epoch_));
      }
    }
    const int64_t step = static_cast<int64_t>(epoch_ + 1);
    const auto start = std::chrono::steady_clock::now();
    last_ = SwapStepStats();
    for (uint64_t sg = 0; sg < sub_group_count(); ++sg) {
      const uint64_t first = sg * sg_, size = SubGroupSize(sg);
      std::span<float> params(params_.data() + first, size);
      std::span<uint16_t> half;  // empty for kNone: no 16-bit copy
      if (half_ != HalfDtype::kNone) half = std::span<uint16_t>(half_buffer_.data(), size);
      const std::span<const float> grads(grads_.data() + first, size);
      const std::vector<StepSegment> parts = segments ? segments(sg) : std::vector<StepSegment>();
      if (parts.empty()) {
        MEMPLAN_RETURN_IF_ERROR(RunSwapOptimizerStep(*cpu_, optimizer_, options[0], step, params,
                                                     grads, state_[sg], half, half_));
      } else {
        MEMPLAN_RETURN_IF_ERROR(RunSegmentedSwapOptimizerStep(
            *cpu_, optimizer_, options, parts, params, grads, state_[sg], half, half_));
      }
      if (on_update) {
        MEMPLAN_RETURN_IF_ERROR(on_update({sg, first, params, half}));
      }
    }
    ++epoch_;
    std::fill(grads_written_.begin(), grads_written_.end(), false);
    last_.total_s = last_.compute_s = SecondsSince(start);
    return Status::Ok();
  }
  SwapStepStats last_step() const override { return last_; }
  Status ReadRange(uint64_t sg, int array, uint64_t offset, std::span<float> out) override {
    if (sg >= sub_group_count() || array < 0 || array > states_) {
      return Status::InvalidArgument("engine: bad sub-group read");
    }
    const uint64_t n = SubGroupSize(sg);
    if (offset > n || out.size() > n - offset) {
      return Status::InvalidArgument("engine: bad sub-group read");
    }
    const float* from = array == 0 ? params_.data() + sg * sg_
                                   : state_[sg].data() + static_cast<uint64_t>(array - 1) * n;
    std::copy_n(from + offset, out.size(), out.begin());
    return Status::Ok();
  }
  // All or nothing, as a torch optimizer's load_state_dict: the new values are made in copies and
  // take the old ones' place only once every sub-group's are complete.
  Status Load(const OptimizerSwapper::ArrayFiller& fill, std::span<const bool> arrays) override {
    if (arrays.size() != static_cast<size_t>(1 + states_)) {
      return Status::InvalidArgument("engine: load with the wrong number of arrays");
    }
    std::vector<float> params;
    std::vector<std::vector<float>> state;
    try {
      if (arrays[0]) params = params_;
      if (std::find(arrays.begin() + 1, arrays.end(), true) != arrays.end()) state = state_;
    } catch (const std::bad_alloc&) {
      return Status::ResourceExhausted("engine: no host memory for a copy of the optimizer");
    }
    for (uint64_t sg = 0; sg < sub_group_count(); ++sg) {
      const uint64_t first = sg * sg_, size = SubGroupSize(sg);
      if (arrays[0]) MEMPLAN_RETURN_IF_ERROR(fill(sg, 0, {params.data() + first, size}));
      for (int a = 1; a <= states_; ++a) {
        if (!arrays[static_cast<size_t>(a)]) continue;
        MEMPLAN_RETURN_IF_ERROR(
            fill(sg, a, {state[sg].data() + static_cast<uint64_t>(a - 1) * size, size}));
      }
    }
    if (arrays[0]) params_.swap(params);
    if (!state.empty()) state_.swap(state);
    ++epoch_;
    return Status::Ok();
  }
  void DiscardGradients() override {
    std::fill(grads_written_.begin(), grads_written_.end(), false);
  }
  uint64_t epoch() const override { return epoch_; }
  uint64_t pinned_bytes() const override { return 0; }
  uint64_t read_bytes() const override { return 0; }
  uint64_t write_bytes() const override { return 0; }
  Status Close() override { return Status::Ok(); }

 private:
  MemoryHome() = default;
  SwapOptimizer optimizer_ = SwapOptimizer::kAdam;
  HalfDtype half_ = HalfDtype::kBf16;
  uint64_t n_ = 0, sg_ = 0, epoch_ = 0;
  int states_ = 0;
  std::unique_ptr<CpuOptimizer> cpu_;
  std::vector<float> params_, grads_;
  std::vector<std::vector<float>> state_;  // per sub-group, states back to back
  std::vector<bool> grads_written_;
  std::vector<uint16_t> half_buffer_;
  SwapStepStats last_;
};

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

// The pid holding the flock on a swap store's lock file (SwapStore::TakeLock), -1 when it is held
// by a process that wrote no pid, 0 when nobody holds it (or there is no such file).
int LockHolder(const std::string& lock_path) {
  const int fd = ::open(lock_path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return 0;
  int holder = 0;
  if (::flock(fd, LOCK_SH | LOCK_NB) != 0) {
    holder = -1;
    if (errno == EWOULDBLOCK) {
      char buf[32] = {};
      const ssize_t n = ::pread(fd, buf, sizeof(buf) - 1, 0);
      int pid = 0;
      if (n > 0) std::from_chars(buf, buf + n, pid);
      if (pid > 0) holder = pid;
    }
  }
  ::close(fd);  // releases a lock we took
  return holder;
}

}  // namespace

struct Engine::Impl {
  EngineOptions options;
  std::unique_ptr<gpu::Runtime> own_runtime;
  gpu::Runtime* runtime = nullptr;
  std::unique_ptr<nvme::SwapStore> param_store;
  std::unique_ptr<PinnedPool> staging;
  std::unique_ptr<ParamSwapper> params;
  std::unique_ptr<OptimizerHome> optimizer;
  std::unique_ptr<CpuOptimizer> converter;  // fp32 -> 16-bit for the initial write-back
  std::vector<ParamSpec> specs;             // in registration (= flat) order
  std::vector<uint64_t> numels;             // specs[i]'s element count, checked in AddParameter
  // Note [Frozen parameters]: the swapper's id of specs[i], and the spec of each swapper id.
  std::vector<ParamId> swap_id;
  std::vector<size_t> spec_of;
  uint64_t trainable_params = 0;
  uint64_t total_elements = 0;  // their sum
  std::vector<bool> grad_given;
  uint64_t grads_missing = 0;
  // Note [Skipped parameters]: per trainable parameter (by spec), torch's per-parameter step
  // count; NoGradient() marks; whether this step's skipped ones had their zeros fed; whether the
  // counts may differ (then every Step() runs segmented).
  std::vector<uint64_t> param_steps;
  std::vector<uint8_t> no_gradient;  // bytes: the gradient thread reads its sub-groups' entries
  bool zeros_fed = false;
  bool segmented = false;
  std::string steps_path;  // optimizer on NVMe: where the counts are kept for a resume
  // Note [Parameter groups]: the number of groups (the largest ParamSpec::group + 1).
  uint32_t groups = 1;
  // Note [Clipping by the global norm]: per optimizer sub-group, the pieces of its gradients' norm,
  // measured by whoever completes the sub-group (the gradient thread; FeedZeros() on the trainer's
  // thread while the gradient thread is idle), read by the trainer thread after DrainGradients().
  std::vector<GradientNormParts> norm_parts;
  std::optional<GradientNormParts> step_norm;  // this step's over every rank, once measured
  double norm_s = 0;                           // the trainer thread's: time spent measuring it
  bool last_clipped = false;  // the last step's clip coefficient was < 1 (or its norm not finite)
  struct GradBuffer {
    std::vector<float> data;
    uint64_t received = 0;
  };
  // Note [Asynchronous gradients]: GradReady() orders the engine's device-to-host stream after the
  // trainer's stream (a fence: the gradient's kernels may still be queued), queues the gradient's
  // copy into pinned staging slots, a slot's worth at a time, and returns; no thread waits for the
  // GPU there. The gradient thread waits for each slot's copy, converts to fp32 into the sub-group
  // buffers, gives the slot back, and hands full sub-groups to the optimizer (for the NVMe
  // optimizer that is a store write), so the trainer's backward pass does not wait for any of it;
  // GradReady() waits only when every slot is taken. Pinned slots make the copies truly
  // asynchronous (CUDA copies to pageable memory synchronously, through its own staging) and bound
  // the host memory. On a runtime without a device there are no streams and nothing to pin: the
  // gradient is copied whole into a recycled host buffer before GradReady() returns (so the
  // caller's buffer is free at once) and converted by the gradient thread as above. Step() drains
  // the queue first.
  struct GradJob {
    ParamId param = 0;
    ElementType type = ElementType::kFloat32;
    uint64_t first = 0;  // partition offset and element count of what `slot` receives: the
    uint64_t count = 0;  // parameter's shard (all of it for world size 1), a slot at a time
    gpu::CopyTicket ticket;
    PinnedSlot slot;              // a runtime with a device: the pinned staging slot
    std::vector<std::byte> host;  // the host-only runtime: a recycled host buffer
    void* scratch = nullptr;      // world size > 1, last slot of a gradient: the device buffer the
                                  // copies read from, free once this copy is done
    const std::byte* data() const { return slot.empty() ? host.data() : slot.data().data(); }
  };
  static constexpr uint64_t kGradSlots = 4;
  static constexpr uint64_t kMaxGradSlotBytes = uint64_t{4} << 20;
  static constexpr uint64_t kPageBytes = 4096;
  std::unique_ptr<PinnedPool> grad_staging;  // kGradSlots pinned slots (a runtime with a device)
  mutable Mutex grad_mu;
  CondVar grad_cv;  // a job queued / finished, or stop
  std::deque<GradJob> grad_jobs GUARDED_BY(grad_mu);
  std::vector<std::vector<std::byte>> grad_free GUARDED_BY(grad_mu);  // recycled host buffers
  bool grad_busy GUARDED_BY(grad_mu) = false;
  bool grad_stop GUARDED_BY(grad_mu) = false;
  Status grad_error GUARDED_BY(grad_mu);  // the first failure
  uint64_t d2h_bytes GUARDED_BY(grad_mu) = 0;
  // World size > 1 (Note [Reduce-scattered gradients]): two device buffers of world_size times the
  // largest shard, allocated in Start(), and a device buffer of zeros for the padding.
  std::vector<void*> grad_scratch_free GUARDED_BY(grad_mu);
  std::vector<void*> grad_scratch_all;
  uint64_t grad_scratch_bytes = 0;
  void* grad_zeros = nullptr;
  std::thread grad_worker;
  std::unordered_map<uint64_t, GradBuffer> grad_buffers;  // the gradient thread's only
  std::vector<std::vector<float>> grad_buffer_free;       // the gradient thread's only
  // Note [Optimizer overlapped with backward]. `overlap` and `prepared` are the trainer thread's,
  // written only while the gradient thread is idle (before the step's first gradient is queued,
  // after DrainGradients()); the gradient thread reads `overlap` for the jobs queued after.
  bool prepared = false;  // PrepareStep() was called for the coming step
  bool overlap = false;   // ... and the optimizer runs it beside backward
  // ... and may have to run it again (clipping): its gradients also go to the NVMe store.
  bool keep_grads = false;
  StepOptions prepared_options;
  std::string clipping;  // step_profile.clipping of the step in progress
  std::chrono::steady_clock::time_point prepared_at;
  // Sub-groups' gradients handed to the optimizer and not yet read by it: at most overlap_limit
  // (the optimizer's buffers and two more); the gradient thread waits beyond that.
  uint64_t overlap_limit = 0;
  Mutex overlap_mu;
  CondVar overlap_cv;
  uint64_t overlap_outstanding GUARDED_BY(overlap_mu) = 0;
  std::vector<std::vector<float>> overlap_free GUARDED_BY(overlap_mu);  // buffers read, to reuse
  bool overlap_abandoned GUARDED_BY(overlap_mu) = false;                // drop hand-overs
  // Hand-overs between their check of overlap_abandoned and the optimizer's StepSubGroup return:
  // the optimizer's step may not be abandoned (its run destroyed) while one is in flight.
  uint64_t overlap_handing GUARDED_BY(overlap_mu) = 0;
  double stall_s = 0;  // the trainer thread's: GradReady() blocked this step
  bool started = false;
  bool closed = false;
  EngineStats stats;

  int threads() const {
    const int t = options.schedule.optimizer_threads;
    if (t > 0) return t;
    const long cores = ::sysconf(_SC_NPROCESSORS_ONLN);
    return cores > 0 ? static_cast<int>(std::min<long>(cores, 256)) : 1;
  }

  // Calls part(i, e, piece) for the pieces of partition elements [first, first + out.size()) that
  // are elements [e, e + piece.size()) of parameter specs[i] (this rank's shard of it: Note [ZeRO-3
  // partitions] in param_swapper.cc), and zeros the padding past each parameter's end. With world
  // size 1 the partition is the flat space.
  template <typename PartFn>
  Status ForEachPiece(uint64_t first, std::span<float> out, PartFn&& part) {
    const uint64_t end = first + out.size();
    // The parameter holding `first`: the last with partition offset <= first.
    size_t lo = 0, hi = spec_of.size();
    while (hi - lo > 1) {
      const size_t mid = (lo + hi) / 2;
      if (params->PartitionOffset(static_cast<ParamId>(mid)) <= first) {
        lo = mid;
      } else {
        hi = mid;
      }
    }
    const auto rank = static_cast<uint64_t>(params->rank());
    for (size_t k = lo; k < spec_of.size(); ++k) {
      const auto id = static_cast<ParamId>(k);
      const size_t i = spec_of[k];
      const uint64_t local = params->PartitionOffset(id), shard = params->ShardSize(id);
      if (local >= end) break;
      const uint64_t a = std::max(first, local), b = std::min(end, local + shard);
      if (a >= b) continue;
      // Partition elements [a, b) are the parameter's elements [e, e + (b - a)).
      const uint64_t e = rank * shard + (a - local);
      const uint64_t numel = params->Numel(id);
      std::span<float> dst = out.subspan(a - first, b - a);
      const uint64_t real = e >= numel ? 0 : std::min(b - a, numel - e);
      if (real > 0) MEMPLAN_RETURN_IF_ERROR(part(i, e, dst.first(real)));
      std::fill(dst.begin() + static_cast<int64_t>(real), dst.end(), 0.0f);
    }
    return Status::Ok();
  }

  // Fills partition elements [first, first + out.size()) from the parameters' init functions.
  Status Fill(uint64_t first, std::span<float> out) {
    return ForEachPiece(first, out, [this](size_t i, uint64_t e, std::span<float> piece) {
      return specs[i].init(e, piece).WithPrefix("initialising parameter " + specs[i].name);
    });
  }

  // Fills partition elements [first, first + out.size()) of `array` from a StateFiller (Note
  // [Optimizer state in checkpoints]): shard-relative offsets, as Shard() describes them.
  Status FillFrom(const StateFiller& fill, int array, uint64_t first, std::span<float> out) {
    const auto rank = static_cast<uint64_t>(params->rank());
    return ForEachPiece(first, out, [&](size_t i, uint64_t e, std::span<float> piece) {
      const uint64_t shard = params->ShardSize(swap_id[i]);
      return fill(static_cast<ParamId>(i), array, e - rank * shard, piece)
          .WithPrefix("loading parameter " + specs[i].name);
    });
  }

  // Writes an updated sub-group's working copy back to the parameters' tier: the optimizer's
  // 16-bit copy, or for fp32 the master weights themselves.
  Status WriteBack(const SubGroupUpdate& u) {
    if (options.schedule.param_dtype == ElementType::kFloat32) {
      return params->WriteFloat(u.first_element, u.params);
    }
    return params->WriteHalf(u.first_element, u.half_params);
  }

  // Converts one copied gradient into the sub-group buffers; full sub-groups go to the optimizer.
  Status Accumulate(const GradJob& job) {
    const uint64_t n = job.count;
    const int eb = ElementBytes(job.type);
    const uint64_t sg_elems = optimizer->sub_group_elements();
    const uint64_t first = job.first;
    const int world = params->world_size();
    uint64_t done = 0;
    while (done < n) {
      const uint64_t at = first + done;
      const uint64_t sg = at / sg_elems;
      const uint64_t in_sg = at - sg * sg_elems;
      const uint64_t size = optimizer->SubGroupSize(sg);
      const uint64_t len = std::min(n - done, size - in_sg);
      GradBuffer& buf = grad_buffers[sg];
      std::span<float> direct = optimizer->DirectGradients(sg);
      float* base = direct.data();
      if (base == nullptr) {
        if (buf.data.empty()) buf.data = TakeGradBuffer(size);
        base = buf.data.data();
      }
      float* dst = base + in_sg;
      const std::byte* src = job.data() + done * eb;
      // Slots are page-aligned, host buffers come from operator new: aligned for uint16_t.
      const auto* half = reinterpret_cast<const uint16_t*>(src);
      switch (job.type) {
        case ElementType::kFloat32: std::memcpy(dst, src, len * 4); break;
        case ElementType::kBFloat16:
          for (uint64_t k = 0; k < len; ++k) dst[k] = Bf16ToFloat(half[k]);
          break;
        case ElementType::kFloat16:
          for (uint64_t k = 0; k < len; ++k) dst[k] = Fp16ToFloat(half[k]);
          break;
      }
      if (world > 1) {  // the sum over ranks -> their mean (Note [Reduce-scattered gradients])
        const auto w = static_cast<float>(world);
        for (uint64_t k = 0; k < len; ++k) dst[k] = dst[k] / w;
      }
      buf.received += len;
      if (buf.received == size) {
        // Note [Clipping by the global norm]: every sub-group's gradients are measured once, whole.
        norm_parts[sg] = MeasureGradients(std::span<const float>(base, size));
        if (overlap) {
          MEMPLAN_RETURN_IF_ERROR(HandOver(sg, std::move(buf.data)));
        } else {
          MEMPLAN_RETURN_IF_ERROR(
              optimizer->WriteGradients(sg, std::span<const float>(base, size)));
          if (!buf.data.empty()) grad_buffer_free.push_back(std::move(buf.data));
        }
        grad_buffers.erase(sg);
      }
      done += len;
    }
    return Status::Ok();
  }

  // A sub-group gradient buffer of `size` elements: a recycled one of that size (the gradient
  // thread's, or one the optimizer has read), else a new one. Taking any other size would allocate,
  // fault in and zero 4 bytes an element again every step (the last sub-group is shorter).
  std::vector<float> TakeGradBuffer(uint64_t size) {
    {
      MutexLock lock(&overlap_mu);
      for (std::vector<float>& b : overlap_free) grad_buffer_free.push_back(std::move(b));
      overlap_free.clear();
    }
    for (size_t i = grad_buffer_free.size(); i-- > 0;) {
      if (grad_buffer_free[i].size() == size) {
        std::vector<float> out = std::move(grad_buffer_free[i]);
        grad_buffer_free[i] = std::move(grad_buffer_free.back());
        grad_buffer_free.pop_back();
        return out;
      }
    }
    return std::vector<float>(size);
  }

  // An overlapped step's sub-group `sg` has all its gradients (in `grads`): hands it to the
  // optimizer, which steps it in the background and gives the buffer back once it has read it
  // (Note [Optimizer overlapped with backward]). Waits while overlap_limit sub-groups are handed
  // over and unread: backward then waits for the optimizer (the stall).
  Status HandOver(uint64_t sg, std::vector<float> grads) {
    {
      MutexLock lock(&overlap_mu);
      while (overlap_outstanding >= overlap_limit && !overlap_abandoned) {
        overlap_cv.Wait(&overlap_mu);
      }
      if (overlap_abandoned) {
        overlap_free.push_back(std::move(grads));
        return Status::Ok();
      }
      ++overlap_outstanding;
      ++overlap_handing;
    }
    auto held = std::make_shared<std::vector<float>>(std::move(grads));
    std::function<void()> done = [this, held] {
      {
        MutexLock lock(&overlap_mu);
        overlap_free.push_back(std::move(*held));
        --overlap_outstanding;
      }
      overlap_cv.SignalAll();
    };
    // Each trainable parameter's shard at its own next step: one segment at the optimizer's next
    // step is the unsegmented step, bit for bit, and cheaper.
    std::vector<StepSegment> parts = Segments(sg);
    if (parts.size() == 1 && parts[0].step == static_cast<int64_t>(optimizer->epoch() + 1) &&
        SameOptions(prepared_options, parts[0].group, 0)) {
      parts.clear();
    }
    const std::span<const float> view(held->data(), held->size());
    // keep_grads: the optimizer's writer stores them too, for a redo (Note [Clipping by the
    // global norm]).
    Status handed = optimizer->StepSubGroup(sg, view, std::move(parts), done, keep_grads);
    if (!handed.ok()) done();  // refused: the optimizer keeps nothing of it
    {
      MutexLock lock(&overlap_mu);
      --overlap_handing;
    }
    overlap_cv.SignalAll();
    return handed;
  }

  // Makes the gradient thread drop what it would still hand over and waits for a hand-over in
  // progress to reach the optimizer: after it the optimizer's step may be abandoned (AbortStep
  // destroys what StepSubGroup uses; the two run on different threads).
  void StopHandOvers() {
    MutexLock lock(&overlap_mu);
    overlap_abandoned = true;
    overlap_cv.SignalAll();  // a hand-over waiting for room gives up
    while (overlap_handing > 0) overlap_cv.Wait(&overlap_mu);
  }

  // Writes the working copies of the trainable parameters from the optimizer's master weights
  // (after Start(), which may have resumed, and after an abandoned step).
  Status WriteWorkingCopies() {
    const Schedule& sc = options.schedule;
    const HalfDtype half_dtype = ToHalf(sc.param_dtype);
    const uint64_t sg_elems = optimizer->sub_group_elements();
    std::vector<float> master(std::min(sg_elems, optimizer->SubGroupSize(0)));
    std::vector<uint16_t> half(half_dtype == HalfDtype::kNone ? 0 : master.size());
    for (uint64_t sg = 0; sg < optimizer->sub_group_count(); ++sg) {
      const uint64_t n = optimizer->SubGroupSize(sg);
      std::span<float> m(master.data(), n);
      MEMPLAN_RETURN_IF_ERROR(optimizer->ReadParams(sg, m));
      if (half_dtype == HalfDtype::kNone) {
        MEMPLAN_RETURN_IF_ERROR(params->WriteFloat(sg * sg_elems, m));
        continue;
      }
      std::span<uint16_t> h(half.data(), n);
      MEMPLAN_RETURN_IF_ERROR(converter->ConvertToHalf(m, h, half_dtype));
      MEMPLAN_RETURN_IF_ERROR(params->WriteHalf(sg * sg_elems, h));
    }
    return Status::Ok();
  }

  // Ends a prepared step that failed (Note [Optimizer overlapped with backward]): the optimizer's
  // step is abandoned (nothing of it committed), the gradients of the step are dropped, and the
  // working parameters, some of which the step had already written, are rewritten from the last
  // committed step. Returns `error` with what the clean-up found added.
  Status Abandon(Status error) {
    const bool was_overlapped = overlap;
    DropStep();
    Status restored = params->EndOfStep();
    if (restored.ok() && was_overlapped) restored = WriteWorkingCopies();
    if (!restored.ok()) {
      return restored.WithPrefix(error.ToString() +
                                 "; then rewriting the working parameters "
                                 "from step " +
                                 std::to_string(optimizer->epoch()));
    }
    return error;
  }

  // Drops everything of the step in progress (AbandonStep(), Abandon(), a skipped step): the
  // optimizer's overlapped step, the gradients queued, summed or stored, an earlier gradient's
  // failure. The caller rewrites the working parameters when an overlapped step had begun.
  void DropStep() {
    if (overlap) {
      StopHandOvers();
      optimizer->AbortStep();
    }
    (void)DrainGradients();  // the step's gradients are dropped, a failed copy's included
    {
      MutexLock lock(&grad_mu);
      grad_error = Status::Ok();
    }
    {
      MutexLock lock(&overlap_mu);
      overlap_abandoned = false;
    }
    for (auto& [sg, buf] : grad_buffers) {
      if (!buf.data.empty()) grad_buffer_free.push_back(std::move(buf.data));
    }
    grad_buffers.clear();
    optimizer->DiscardGradients();
    ResetStep();
  }

  // The per-step state back to "no gradient given yet".
  void ResetStep() {
    overlap = false;
    prepared = false;
    keep_grads = false;
    clipping.clear();
    step_norm.reset();
    std::fill(grad_given.begin(), grad_given.end(), false);
    std::fill(no_gradient.begin(), no_gradient.end(), uint8_t{0});
    zeros_fed = false;
    grads_missing = trainable_params;
  }

  // Whether group `a`'s options equal group `b`'s in `options` (one entry: every group's).
  static bool SameOptions(const StepOptions& options, uint32_t a, uint32_t b) {
    if (options.groups.size() <= 1 || a == b) return true;
    return options.groups[a] == options.groups[b];
  }
  static bool GroupsDiffer(const StepOptions& options) {
    for (size_t g = 1; g < options.groups.size(); ++g) {
      if (!(options.groups[g] == options.groups[0])) return true;
    }
    return false;
  }

  // Checks a step's options against the engine: the group count, each group's options for the
  // Schedule's optimizer, one grad_scale, the clipping fields.
  Status ValidateStepOptions(const StepOptions& o) const {
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
      if (GradScale(o.groups[g]) != GradScale(o.groups[0]) &&
          !(std::isnan(GradScale(o.groups[g])) && std::isnan(GradScale(o.groups[0])))) {
        return Status::InvalidArgument(
            "engine: the groups' grad_scale differ; the loss scale is one per step");
      }
    }
    if (!(o.max_grad_norm >= 0)) {
      return Status::InvalidArgument("engine: max_grad_norm must be >= 0 (0: no clipping)");
    }
    return ValidateNormType(o.norm_type).WithPrefix("engine");
  }

  static double GradScale(const SwapStepOptions& o) {
    return std::visit([](const auto& v) { return v.grad_scale; }, o);
  }
  static void SetGradScale(SwapStepOptions& o, double scale) {
    std::visit([scale](auto& v) { v.grad_scale = scale; }, o);
  }

  // Completes the sub-groups of the parameters declared with NoGradient() with zeros, once a step
  // (after DrainGradients(): the gradient thread is idle).
  Status FeedMissingZeros() {
    if (zeros_fed) return Status::Ok();
    for (size_t i = 0; i < specs.size(); ++i) {
      if (no_gradient[i]) MEMPLAN_RETURN_IF_ERROR(FeedZeros(i));
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
    MEMPLAN_RETURN_IF_ERROR(DrainGradients());
    MEMPLAN_RETURN_IF_ERROR(FeedMissingZeros());
    GradientNormParts mine;
    for (const GradientNormParts& part : norm_parts) mine.Add(part);
    GradientNormParts all = mine;
    if (params->world_size() > 1) {
      MEMPLAN_ASSIGN_OR_RETURN(all, GatherNormParts(mine));
    }
    step_norm = all;
    norm_s += SecondsSince(t0);
    return all;
  }

  // World size > 1: the sum of every rank's pieces, in rank order (an all-gather of five 8-byte
  // words a rank, moved as fp32 elements, never computed on).
  Result<GradientNormParts> GatherNormParts(const GradientNormParts& mine) {
    constexpr uint64_t kWords = 5;
    const auto world = static_cast<uint64_t>(params->world_size());
    const auto rank = static_cast<uint64_t>(params->rank());
    std::vector<uint64_t> all(world * kWords, 0);
    const double doubles[3] = {mine.sum_squares, mine.sum_abs, mine.max_abs};
    std::memcpy(&all[rank * kWords], doubles, sizeof(doubles));
    all[rank * kWords + 3] = mine.nan;
    all[rank * kWords + 4] = mine.inf;
    const uint64_t bytes = kWords * 8;
    MEMPLAN_ASSIGN_OR_RETURN(void* device, runtime->AllocateDevice(world * bytes));
    Status status = [&]() -> Status {
      auto* base = static_cast<std::byte*>(device);
      MEMPLAN_ASSIGN_OR_RETURN(gpu::CopyTicket up,
                               runtime->CopyAsync(gpu::CopyDirection::kHostToDevice,
                                                  base + rank * bytes, &all[rank * kWords], bytes));
      MEMPLAN_RETURN_IF_ERROR(runtime->Wait(up));
      MEMPLAN_RETURN_IF_ERROR(options.collective->AllGather(base + rank * bytes, base, bytes / 4,
                                                            ElementType::kFloat32));
      MEMPLAN_ASSIGN_OR_RETURN(
          gpu::CopyTicket down,
          runtime->CopyAsync(gpu::CopyDirection::kDeviceToHost, all.data(), base, world * bytes));
      return runtime->Wait(down);
    }();
    Status freed = runtime->FreeDevice(device);
    MEMPLAN_RETURN_IF_ERROR(status.WithPrefix("engine: gathering the gradient norm"));
    MEMPLAN_RETURN_IF_ERROR(freed);
    GradientNormParts sum;
    for (uint64_t r = 0; r < world; ++r) {
      GradientNormParts part;
      double d[3];
      std::memcpy(d, &all[r * kWords], sizeof(d));
      part.sum_squares = d[0];
      part.sum_abs = d[1];
      part.max_abs = d[2];
      part.nan = all[r * kWords + 3];
      part.inf = all[r * kWords + 4];
      sum.Add(part);
    }
    return sum;
  }

  void RunGradients() {
    for (;;) {
      GradJob job;
      {
        MutexLock lock(&grad_mu);
        while (!grad_stop && grad_jobs.empty()) grad_cv.Wait(&grad_mu);
        if (grad_jobs.empty()) return;  // stopping, nothing left
        job = std::move(grad_jobs.front());
        grad_jobs.pop_front();
        grad_busy = true;
      }
      Status status = runtime->Wait(job.ticket);
      if (status.ok()) status = Accumulate(job);
      job.slot.Release();  // GradReady() may be waiting for it
      {
        MutexLock lock(&grad_mu);
        if (!status.ok() && grad_error.ok()) {
          grad_error = status.WithPrefix("gradient of " + specs[job.param].name);
        }
        if (!job.host.empty()) grad_free.push_back(std::move(job.host));
        if (job.scratch != nullptr) grad_scratch_free.push_back(job.scratch);
        grad_busy = false;
      }
      grad_cv.SignalAll();
    }
  }

  // World size > 1: reduce-scatters `device_grad` (the parameter's whole gradient, `count`
  // elements of `type` per rank's shard) across the ranks into a scratch buffer, after the
  // trainer's work queued on `stream` (Note [Reduce-scattered gradients]). Returns the scratch
  // buffer, whose slot `rank` then holds this rank's summed shard; the caller gives it back to
  // grad_scratch_free (on failure it is back there already).
  Result<void*> ReduceScatterGradient(ParamId param /* the swapper's id */, const void* device_grad,
                                      ElementType type, uint64_t count, gpu::Stream stream) {
    const auto eb = static_cast<uint64_t>(ElementBytes(type));
    const uint64_t n = params->Numel(param) * eb;
    const uint64_t shard = count * eb;
    const uint64_t full = shard * static_cast<uint64_t>(params->world_size());
    void* scratch = nullptr;
    {
      // At most two gradients are between their reduce-scatter and their copy to the host.
      MutexLock lock(&grad_mu);
      while (grad_scratch_free.empty() && grad_error.ok()) grad_cv.Wait(&grad_mu);
      if (!grad_error.ok()) return grad_error;
      scratch = grad_scratch_free.back();
      grad_scratch_free.pop_back();
    }
    Status status = [&]() -> Status {
      auto* base = static_cast<std::byte*>(scratch);
      MEMPLAN_RETURN_IF_ERROR(runtime->OrderAfter(gpu::CopyDirection::kDeviceToDevice, stream));
      MEMPLAN_ASSIGN_OR_RETURN(
          const gpu::CopyTicket copied,
          runtime->CopyAsync(gpu::CopyDirection::kDeviceToDevice, base, device_grad, n));
      gpu::CopyTicket zeroed;
      if (full > n) {
        MEMPLAN_ASSIGN_OR_RETURN(zeroed, runtime->CopyAsync(gpu::CopyDirection::kDeviceToDevice,
                                                            base + n, grad_zeros, full - n));
      }
      MEMPLAN_RETURN_IF_ERROR(runtime->Wait(copied));
      MEMPLAN_RETURN_IF_ERROR(runtime->Wait(zeroed));
      std::byte* mine = base + static_cast<uint64_t>(params->rank()) * shard;
      return options.collective->ReduceScatter(base, mine, count, type)
          .WithPrefix("reduce-scattering the gradient");
    }();
    if (!status.ok()) {
      {
        MutexLock lock(&grad_mu);
        grad_scratch_free.push_back(scratch);
      }
      grad_cv.SignalAll();
      return status;
    }
    stats.reduce_scatter_bytes += full;
    return scratch;
  }

  // --- Step()'s pieces ---

  // Step()'s work once every gradient is given: the gradient thread drained, the zeros of the
  // parameters without a gradient fed, then the optimizer's step (serial) or the end of the step
  // it has been running beside backward (`overlapped`). On the trainer's thread.
  Status RunStep(const StepOptions& step_options, bool overlapped, bool skipping) {
    MEMPLAN_RETURN_IF_ERROR(DrainGradients());
    if (skipping) MEMPLAN_RETURN_IF_ERROR(FeedMissingZeros());
    MEMPLAN_RETURN_IF_ERROR(params->EndOfStep());
    segmented = segmented || skipping;
    if (segmented && !steps_path.empty()) {
      MEMPLAN_RETURN_IF_ERROR(SaveStepCounts(optimizer->epoch() + 1, true));
    }
    if (!overlapped) {
      SegmentFn segments;
      if (segmented || GroupsDiffer(step_options)) {
        segments = [this](uint64_t sg) { return Segments(sg); };
      }
      return optimizer->Step(
          step_options.groups, [this](const SubGroupUpdate& u) { return WriteBack(u); }, segments);
    }
    // Every working parameter is written: the next step's first parameters can be read while
    // the last states are written and the step commits.
    MEMPLAN_RETURN_IF_ERROR(optimizer->WaitForUpdates());
    MEMPLAN_RETURN_IF_ERROR(params->PrefetchNextStep());
    return optimizer->FinishStep(true);
  }

  // Note [Optimizer overlapped with backward]: where the step that began at `start` went, into
  // stats.step_profile; `before_step` sub-groups were updated before Step() was called.
  void RecordStepProfile(std::chrono::steady_clock::time_point start, bool overlapped,
                         uint64_t before_step) {
    const SwapStepStats last = optimizer->last_step();
    EngineStepProfile& p = stats.step_profile;
    p = EngineStepProfile();
    p.overlapped = overlapped;
    p.backward_s = overlapped ? std::chrono::duration<double>(start - prepared_at).count() : 0.0;
    p.step_s = stats.last_step_s;
    p.optimizer_s = last.compute_s;
    p.read_s = last.read_s;
    p.write_s = last.write_s;
    p.sync_s = last.sync_s;
    p.backward_wait_s = overlapped ? last.grad_wait_s : 0.0;
    p.stall_s = stall_s;
    p.sub_groups = optimizer->sub_group_count();
    p.sub_groups_before_step = before_step;
    p.overlapped_fraction =
        static_cast<double>(before_step) / static_cast<double>(std::max<uint64_t>(p.sub_groups, 1));
  }

  // --- Start()'s pieces, in the order it runs them ---

  // What this rank's partition (Note [ZeRO-3 partitions] in param_swapper.cc) holds; the flat
  // space itself for world size 1.
  struct PartitionLayout {
    uint64_t total = 0;         // the trainable parameters' elements: what the optimizer holds
    uint64_t frozen_begin = 0;  // where the frozen parameters start, on a chunk boundary
    uint64_t partition = 0;     // what the parameter tier holds
  };
  PartitionLayout partition_layout;  // Start()'s

  // Lays out the partition: trainable parameters first, then the frozen ones from a chunk boundary
  // (Note [Frozen parameters]); fills swap_id, spec_of, trainable_params and the frozen counts of
  // `stats`. InvalidArgument when every parameter is frozen.
  Result<PartitionLayout> LayOutPartition() {
    const Schedule& sc = options.schedule;
    const int world = stats.world_size;
    swap_id.assign(specs.size(), 0);
    spec_of.clear();
    uint64_t total = 0, frozen_total = 0;
    for (int pass = 0; pass < 2; ++pass) {
      for (size_t i = 0; i < specs.size(); ++i) {
        if (specs[i].frozen != (pass == 1)) continue;
        swap_id[i] = static_cast<ParamId>(spec_of.size());
        spec_of.push_back(i);
        (pass == 0 ? total : frozen_total) += ShardElements(numels[i], world);
        if (pass == 1) {
          ++stats.frozen_params;
          stats.frozen_elements += numels[i];
        }
      }
    }
    trainable_params = specs.size() - stats.frozen_params;
    if (total == 0) {
      return Status::InvalidArgument("engine: every parameter is frozen; nothing to train");
    }
    PartitionLayout layout;
    layout.total = total;
    layout.frozen_begin = frozen_total == 0 ? total
                                            : (total + sc.sub_group_elements - 1) /
                                                  sc.sub_group_elements * sc.sub_group_elements;
    layout.partition = layout.frozen_begin + frozen_total;
    return layout;
  }

  // Parameters on NVMe: their store under `nvme_dir`/params, for `partition` elements, and the
  // pinned staging buffers. The working copies are derived from the master weights, so the store
  // is made afresh each run; one left by a crashed run is removed first (FailedPrecondition unless
  // this is a resume). ResourceExhausted when the staging buffers exceed pinned_budget_bytes.
  Status OpenParamStore(const std::string& nvme_dir, uint64_t partition) {
    const Schedule& sc = options.schedule;
    const std::string dir = nvme_dir + "/params";
    if (::access((dir + "/" + nvme::SwapStore::kDataFileName).c_str(), F_OK) == 0) {
      // A live store (this process's or another's) says so, with or without resume.
      const int holder = LockHolder(dir + "/" + nvme::SwapStore::kLockFileName);
      if (holder != 0) {
        return Status::FailedPrecondition(
            "engine: the parameter store " + dir + " is in use by " +
            (holder > 0 ? "pid " + std::to_string(holder) : std::string("another process")) +
            (holder == ::getpid() ? " (this process: another engine on the same path; close it)"
                                  : "") +
            "; use another path");
      }
      if (!options.resume) {
        return Status::FailedPrecondition(
            "engine: " + dir +
            " holds a parameter store from an earlier run; start with resume, "
            "or remove it");
      }
      for (const char* name : {nvme::SwapStore::kDataFileName, nvme::SwapStore::kIndexFileName,
                               nvme::SwapStore::kLockFileName}) {
        ::unlink((dir + "/" + name).c_str());
      }
    }
    nvme::SwapStoreOptions so;
    so.directory = dir;
    so.direct = sc.nvme_direct;
    so.backend = sc.nvme_backend;
    so.backend_options.queue_depth = sc.nvme_queue_depth;
    so.engine_options.block_size = sc.nvme_block_size;
    so.engine_options.threads = sc.nvme_io_threads;
    // A parameter is read with the checksum blocks it touches: small blocks keep that extra
    // reading and hashing small (this store is made afresh each run: no format to keep).
    so.checksum_block_bytes = uint32_t{64} << 10;
    const uint64_t chunks = (partition + sc.sub_group_elements - 1) / sc.sub_group_elements;
    so.capacity_bytes = partition * static_cast<uint64_t>(ElementBytes(sc.param_dtype)) +
                        chunks * (uint64_t{64} << 10) + (uint64_t{1} << 20);
    MEMPLAN_ASSIGN_OR_RETURN(param_store, nvme::SwapStore::Open(so));
    PinnedPoolOptions pool;
    pool.slot_bytes = sc.param_buffer_bytes;
    pool.slot_count = sc.param_buffer_count;
    pool.budget_bytes = sc.param_buffer_bytes * sc.param_buffer_count;
    if (sc.pinned_budget_bytes > 0 && pool.budget_bytes > sc.pinned_budget_bytes) {
      return Status::ResourceExhausted(
          "engine: the parameter staging buffers need " + std::to_string(pool.budget_bytes) +
          " pinned bytes; pinned_budget_bytes is " + std::to_string(sc.pinned_budget_bytes));
    }
    MEMPLAN_ASSIGN_OR_RETURN(staging, PinnedPool::Create(pool, runtime));
    // Every parameter read lands in these slots: registered, io_uring skips pinning their pages
    // per request. A refusal (RLIMIT_MEMLOCK) only costs that.
    (void)param_store->RegisterBuffers(
        nvme::RegistrationRegions(staging->memory().data(), staging->memory().size()));
    return Status::Ok();
  }

  // The parameter swapper, on the schedule's parameter tier (its NVMe store under `nvme_dir`),
  // holding every parameter where `layout` puts it.
  Status CreateParamSwapper(const std::string& nvme_dir, const PartitionLayout& layout) {
    const Schedule& sc = options.schedule;
    ParamSwapperOptions po;
    po.tier = sc.param_tier;
    po.dtype = sc.param_dtype;
    po.persistence_threshold = sc.persistence_threshold;
    po.prefetch_bytes = sc.prefetch_bytes;
    po.max_live_bytes = sc.max_live_bytes;
    po.chunk_elements = sc.sub_group_elements;
    po.runtime = runtime;
    po.collective = options.collective;
    po.staging_slots = sc.param_buffer_count;
    if (sc.param_tier == Tier::kNvme) {
      MEMPLAN_RETURN_IF_ERROR(OpenParamStore(nvme_dir, layout.partition));
      po.store = param_store.get();
      po.staging = staging.get();
    }
    MEMPLAN_ASSIGN_OR_RETURN(params, ParamSwapper::Create(po));
    for (size_t k = 0; k < spec_of.size(); ++k) {
      const size_t i = spec_of[k];
      const ParamSpec& p = specs[i];
      if (k == trainable_params && layout.frozen_begin > layout.total) {
        MEMPLAN_RETURN_IF_ERROR(params->Pad(layout.frozen_begin - layout.total));
      }
      MEMPLAN_ASSIGN_OR_RETURN(ParamId id, params->Add(p.name, p.module, numels[i]));
      for (const std::string& m : p.also_used_by) MEMPLAN_RETURN_IF_ERROR(params->AddUse(id, m));
    }
    return params->Finalize();
  }

  // Note [What a store holds]: the registration, in order, as the optimizer store records it.
  std::string Identity() const {
    nlohmann::json list = nlohmann::json::array();
    for (const ParamSpec& p : specs) list.push_back({p.name, p.shape, p.frozen, p.dtype});
    return nlohmann::json{{"format", "memplan-registration"}, {"version", 1}, {"params", list}}
        .dump();
  }

  // Refuses a resume onto a store written for another registration, naming the first difference
  // (Note [What a store holds]). A store that records none (an older memplan's) is accepted on
  // its element count alone, with a note in `report`.
  Status CheckIdentity(const std::string& stored, const std::string& dir,
                       RecoveryReport* report) const {
    if (stored.empty()) {
      if (report != nullptr) {
        report->notes.push_back(dir +
                                ": the store records no parameter names or shapes (written by an "
                                "older memplan); only its element count was checked");
      }
      return Status::Ok();
    }
    auto parsed = ParseJson(stored, dir + " identity");
    const nlohmann::json* list = nullptr;
    if (parsed.ok() && parsed->is_object() && parsed->contains("params") &&
        (*parsed)["params"].is_array()) {
      list = &(*parsed)["params"];
    }
    if (list == nullptr) return Status::DataLoss("engine: " + dir + ": unreadable identity record");
    auto describe = [](const nlohmann::json& p) {
      if (!p.is_array() || p.size() != 4) return std::string("(unreadable)");
      std::string text = "'" + p[0].get<std::string>() + "' (shape [";
      for (size_t d = 0; d < p[1].size(); ++d) {
        text += (d ? ", " : "") + std::to_string(p[1][d].get<int64_t>());
      }
      text += "], ";
      text += p[2].get<bool>() ? "frozen" : "trainable";
      const std::string dtype = p[3].get<std::string>();
      if (!dtype.empty()) text += ", " + dtype;
      return text + ")";
    };
    const std::string why =
        "; resuming would train each parameter on another's weights and optimizer states. "
        "Register the parameters as the run that wrote the store did (same names, order, shapes, "
        "dtypes and frozen set), or start without resume";
    const nlohmann::json mine = nlohmann::json::parse(Identity())["params"];
    try {
      for (size_t k = 0; k < std::max(list->size(), mine.size()); ++k) {
        if (k >= list->size()) {
          return Status::InvalidArgument(
              "engine: resume refused: the store in " + dir + " holds " +
              std::to_string(list->size()) + " parameters; this model registers " +
              std::to_string(mine.size()) + ", the first extra one " + describe(mine[k]) + why);
        }
        if (k >= mine.size()) {
          return Status::InvalidArgument(
              "engine: resume refused: the store in " + dir + " holds " +
              std::to_string(list->size()) + " parameters; this model registers " +
              std::to_string(mine.size()) + ", none for the store's " + describe((*list)[k]) + why);
        }
        if ((*list)[k] != mine[k]) {
          return Status::InvalidArgument("engine: resume refused: parameter #" + std::to_string(k) +
                                         " is " + describe((*list)[k]) + " in the store in " + dir +
                                         " and " + describe(mine[k]) + " in this model" + why);
        }
      }
    } catch (const nlohmann::json::exception& e) {
      return Status::DataLoss("engine: " + dir + ": unreadable identity record: " + e.what());
    }
    return Status::Ok();
  }

  // Resume with the optimizer on NVMe: its store reopened at the last complete step (with world
  // size > 1, the oldest rank's: Note [Resuming ranks]). InvalidArgument when the store holds
  // another registration (Note [What a store holds]) or another number of elements than this
  // rank's `total`.
  Result<std::unique_ptr<OptimizerSwapper>> ReopenOptimizer(OptimizerSwapperOptions oo,
                                                            uint64_t total,
                                                            RecoveryReport* report) {
    const int world = stats.world_size;
    MEMPLAN_ASSIGN_OR_RETURN(std::unique_ptr<OptimizerSwapper> swapper,
                             OptimizerSwapper::Open(oo, report));
    if (world > 1) {
      MEMPLAN_ASSIGN_OR_RETURN(const uint64_t agreed, OldestEpoch(swapper->epoch()));
      if (agreed < swapper->epoch()) {
        MEMPLAN_RETURN_IF_ERROR(swapper->Close());
        swapper.reset();
        oo.max_epoch = agreed;
        MEMPLAN_ASSIGN_OR_RETURN(swapper, OptimizerSwapper::Open(oo, report));
      }
    }
    MEMPLAN_RETURN_IF_ERROR(CheckIdentity(swapper->identity(), oo.store.directory, report));
    if (swapper->num_elements() != total) {
      return Status::InvalidArgument("engine: the optimizer store holds " +
                                     std::to_string(swapper->num_elements()) +
                                     " parameters; the model registered " + std::to_string(total) +
                                     (world > 1 ? " for this rank (a different world size?)" : ""));
    }
    return swapper;
  }

  // The optimizer on NVMe, under `nvme_dir`/optimizer: created for `total` elements from the
  // parameters' init, or reopened for a resume. ResourceExhausted when its pinned buffers and the
  // parameter staging exceed pinned_budget_bytes.
  Status OpenNvmeOptimizer(const std::string& nvme_dir, const CpuOptimizerOptions& cpu,
                           uint64_t total, RecoveryReport* report) {
    const Schedule& sc = options.schedule;
    OptimizerSwapperOptions oo;
    oo.store.directory = nvme_dir + "/optimizer";
    oo.store.direct = sc.nvme_direct;
    oo.store.backend = sc.nvme_backend;
    oo.store.backend_options.queue_depth = sc.nvme_queue_depth;
    oo.store.engine_options.block_size = sc.nvme_block_size;
    oo.store.engine_options.threads = sc.nvme_io_threads;
    oo.sub_group_elements = sc.sub_group_elements;
    oo.buffer_count = sc.optimizer_buffer_count;
    oo.optimizer = sc.optimizer;
    oo.half_dtype = ToHalf(sc.param_dtype);
    oo.cpu = cpu;
    oo.runtime = runtime;
    oo.make_backend = options.make_optimizer_backend;
    oo.identity = Identity();
    const uint64_t optimizer_pinned = OptimizerSwapper::RequiredSlotBytes(oo) * oo.buffer_count;
    const uint64_t staging_pinned = staging ? staging->stats().capacity_bytes : 0;
    if (sc.pinned_budget_bytes > 0 && optimizer_pinned + staging_pinned > sc.pinned_budget_bytes) {
      return Status::ResourceExhausted(
          "engine: the optimizer's pinned buffers (" + std::to_string(optimizer_pinned) +
          " bytes) and the parameter staging buffers (" + std::to_string(staging_pinned) +
          ") exceed pinned_budget_bytes " + std::to_string(sc.pinned_budget_bytes) +
          "; lower optimizer.sub_group_elements or the buffer counts");
    }
    std::unique_ptr<OptimizerSwapper> swapper;
    const std::string data = oo.store.directory + "/" + nvme::SwapStore::kDataFileName;
    if (::access(data.c_str(), F_OK) == 0) {
      const int holder = LockHolder(oo.store.directory + "/" + nvme::SwapStore::kLockFileName);
      if (holder != 0) {
        return Status::FailedPrecondition(
            "engine: the optimizer store " + oo.store.directory + " is in use by " +
            (holder > 0 ? "pid " + std::to_string(holder) : std::string("another process")) +
            (holder == ::getpid() ? " (this process: another engine on the same path; close it)"
                                  : "") +
            "; use another path");
      }
      if (!options.resume) {
        return Status::FailedPrecondition(
            "engine: " + oo.store.directory +
            " holds the optimizer store of an earlier run (kept for a resume); start with "
            "resume to continue from it, or remove it");
      }
    }
    if (options.resume) {
      MEMPLAN_ASSIGN_OR_RETURN(swapper, ReopenOptimizer(oo, total, report));
    } else {
      auto fill = [this](uint64_t first, std::span<float> out) { return Fill(first, out); };
      MEMPLAN_ASSIGN_OR_RETURN(swapper, OptimizerSwapper::Create(oo, total, fill));
    }
    optimizer = std::make_unique<NvmeHome>(std::move(swapper));
    steps_path = nvme_dir + "/param_steps.json";
    if (!options.resume) ::unlink(steps_path.c_str());  // a crashed run's; ours starts at 0
    return Status::Ok();
  }

  // The optimizer's home for `total` elements, on the schedule's optimizer tier: NVMe (under
  // `nvme_dir`) or memory. InvalidArgument for a resume with the optimizer in memory.
  Status CreateOptimizer(const std::string& nvme_dir, const CpuOptimizerOptions& cpu,
                         uint64_t total, RecoveryReport* report) {
    const Schedule& sc = options.schedule;
    if (sc.optimizer_tier == Tier::kNvme) return OpenNvmeOptimizer(nvme_dir, cpu, total, report);
    if (options.resume) {
      return Status::InvalidArgument(
          "engine: resume needs the optimizer on nvme (a cpu "
          "optimizer keeps nothing across runs)");
    }
    auto fill = [this](uint64_t first, std::span<float> out) { return Fill(first, out); };
    MEMPLAN_ASSIGN_OR_RETURN(auto home,
                             MemoryHome::Create(sc.optimizer, ToHalf(sc.param_dtype), cpu, total,
                                                sc.sub_group_elements, fill));
    optimizer = std::move(home);
    return Status::Ok();
  }

  // The frozen parameters' working copies, from their init, once (Note [Frozen parameters]): they
  // have no master weights for WriteWorkingCopies() to derive them from.
  // `fill` (partition coordinates): their values; null: their init.
  Status WriteFrozenWorkingCopies(
      const PartitionLayout& layout,
      const std::function<Status(uint64_t, std::span<float>)>& fill = nullptr) {
    const Schedule& sc = options.schedule;
    const HalfDtype half_dtype = ToHalf(sc.param_dtype);
    std::vector<float> master;
    std::vector<uint16_t> half;
    for (uint64_t at = layout.frozen_begin; at < layout.partition; at += sc.sub_group_elements) {
      const uint64_t n = std::min(sc.sub_group_elements, layout.partition - at);
      if (master.size() < n) master.resize(n);
      std::span<float> m(master.data(), n);
      MEMPLAN_RETURN_IF_ERROR(fill ? fill(at, m) : Fill(at, m));
      if (half_dtype == HalfDtype::kNone) {
        MEMPLAN_RETURN_IF_ERROR(params->WriteFloat(at, m));
        continue;
      }
      if (half.size() < n) half.resize(n);
      std::span<uint16_t> h(half.data(), n);
      MEMPLAN_RETURN_IF_ERROR(converter->ConvertToHalf(m, h, half_dtype));
      MEMPLAN_RETURN_IF_ERROR(params->WriteHalf(at, h));
    }
    return Status::Ok();
  }

  // World size > 1: the reduce-scatter's scratch buffers and the padding's zeros (Note
  // [Reduce-scattered gradients]), sized for the largest shard in any gradient type.
  Status AllocateGradientScratch() {
    const auto world = static_cast<uint64_t>(params->world_size());
    uint64_t largest = 0;
    for (size_t i = 0; i < specs.size(); ++i) {
      if (!specs[i].frozen) largest = std::max(largest, params->ShardSize(swap_id[i]));
    }
    grad_scratch_bytes = largest * world * 4;
    for (int i = 0; i < 2; ++i) {
      MEMPLAN_ASSIGN_OR_RETURN(void* scratch, runtime->AllocateDevice(grad_scratch_bytes));
      grad_scratch_all.push_back(scratch);
      MutexLock lock(&grad_mu);
      grad_scratch_free.push_back(scratch);
    }
    const std::vector<std::byte> zeros(world * 4, std::byte{0});
    MEMPLAN_ASSIGN_OR_RETURN(grad_zeros, runtime->AllocateDevice(zeros.size()));
    MEMPLAN_ASSIGN_OR_RETURN(gpu::CopyTicket ticket,
                             runtime->CopyAsync(gpu::CopyDirection::kHostToDevice, grad_zeros,
                                                zeros.data(), zeros.size()));
    return runtime->Wait(ticket);
  }

  // The pinned staging of the gradients (Note [Asynchronous gradients]): kGradSlots slots of up to
  // kMaxGradSlotBytes (less when the largest gradient is smaller, or when the pinned budget left
  // after `pinned_used` bytes is short). ResourceExhausted when not even a page per slot fits the
  // budget.
  Status CreateGradientStaging(uint64_t pinned_used) {
    const Schedule& sc = options.schedule;
    uint64_t largest = 0;
    for (size_t i = 0; i < specs.size(); ++i) {
      if (!specs[i].frozen) largest = std::max(largest, params->ShardSize(swap_id[i]) * 4);
    }
    uint64_t slot =
        std::min(kMaxGradSlotBytes, (largest + kPageBytes - 1) / kPageBytes * kPageBytes);
    if (sc.pinned_budget_bytes > 0) {
      const uint64_t left =
          sc.pinned_budget_bytes > pinned_used ? sc.pinned_budget_bytes - pinned_used : 0;
      slot = std::min(slot, left / kGradSlots / kPageBytes * kPageBytes);
      if (slot < kPageBytes) {
        return Status::ResourceExhausted(
            "engine: pinned_budget_bytes " + std::to_string(sc.pinned_budget_bytes) + " leaves " +
            std::to_string(left) + " bytes after the other pinned buffers (" +
            std::to_string(pinned_used) + "); the gradient staging needs at least " +
            std::to_string(kGradSlots * kPageBytes));
      }
    }
    PinnedPoolOptions pool;
    pool.slot_bytes = slot;
    pool.slot_count = kGradSlots;
    pool.budget_bytes = slot * kGradSlots;
    MEMPLAN_ASSIGN_OR_RETURN(grad_staging, PinnedPool::Create(pool, runtime));
    return Status::Ok();
  }

  // Completes the gradients of a parameter declared with NoGradient(): zeros into its partition
  // range, through Accumulate(), so its sub-groups are whole; the segments then skip it. On the
  // trainer's thread, after DrainGradients() (the gradient thread is idle).
  Status FeedZeros(size_t spec) {
    const ParamId sid = swap_id[spec];
    const uint64_t first = params->PartitionOffset(sid), count = params->ShardSize(sid);
    constexpr uint64_t kPiece = uint64_t{1} << 20;
    GradJob job;
    job.param = static_cast<ParamId>(spec);
    job.type = ElementType::kFloat32;
    job.host.assign(std::min(count, kPiece) * 4, std::byte{0});
    for (uint64_t done = 0; done < count; done += job.count) {
      job.first = first + done;
      job.count = std::min(kPiece, count - done);
      MEMPLAN_RETURN_IF_ERROR(Accumulate(job));
    }
    return Status::Ok();
  }

  // Writes the step counts after the store's step `epoch` to steps_path, atomically, each with how
  // much that step changes it (Note [Skipped parameters]): an optimizer step (`stepping`) advances
  // those with a gradient by one; a load (LoadOptimizerState) sets them to `loaded`.
  Status SaveStepCounts(uint64_t epoch, bool stepping, std::span<const uint64_t> loaded = {}) {
    nlohmann::json doc = {{"epoch", epoch}, {"params", nlohmann::json::object()}};
    for (size_t i = 0; i < specs.size(); ++i) {
      if (specs[i].frozen) continue;
      uint64_t after = param_steps[i];
      if (stepping && !no_gradient[i]) after += 1;
      if (!stepping && !loaded.empty()) after = loaded[i];
      const int64_t change = static_cast<int64_t>(after) - static_cast<int64_t>(param_steps[i]);
      doc["params"][specs[i].name] = {after, change};
    }
    const std::string tmp = steps_path + ".tmp";
    {
      std::ofstream out(tmp, std::ios::trunc);
      out << doc.dump();
      out.flush();
      if (!out) return Status::IoError("engine: cannot write " + tmp);
    }
    if (::rename(tmp.c_str(), steps_path.c_str()) != 0) {
      return Status::FromErrno(errno, "engine: cannot rename " + tmp);
    }
    return Status::Ok();
  }

  // With resume: the step counts of the store's step `epoch`, from steps_path (absent: every
  // parameter at `epoch`, no step ever skipped).
  Status LoadStepCounts(uint64_t epoch) {
    param_steps.assign(specs.size(), epoch);
    std::ifstream in(steps_path);
    if (!in) return Status::Ok();
    nlohmann::json doc = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (doc.is_discarded() || !doc.is_object() || !doc.contains("epoch") ||
        !doc["epoch"].is_number_unsigned() || !doc.contains("params") ||
        !doc["params"].is_object()) {
      return Status::DataLoss("engine: " + steps_path + " is not a step-count file");
    }
    const uint64_t saved = doc["epoch"].get<uint64_t>();
    if (saved != epoch && saved != epoch + 1) {
      return Status::DataLoss("engine: " + steps_path + " holds the step counts of step " +
                              std::to_string(saved) + "; the optimizer store is at step " +
                              std::to_string(epoch));
    }
    for (size_t i = 0; i < specs.size(); ++i) {
      if (specs[i].frozen) continue;
      const auto it = doc["params"].find(specs[i].name);
      if (it == doc["params"].end() || !it->is_array() || it->size() != 2 ||
          !(*it)[0].is_number_unsigned() || !(*it)[1].is_number_integer()) {
        return Status::DataLoss("engine: " + steps_path + " has no step count for " +
                                specs[i].name);
      }
      // A file one step ahead was written for a step (or a load) the store did not commit: undo
      // what it changed.
      const auto after = (*it)[0].get<uint64_t>();
      const auto change = (*it)[1].get<int64_t>();
      param_steps[i] =
          saved == epoch ? after : static_cast<uint64_t>(static_cast<int64_t>(after) - change);
    }
    segmented = true;
    return Status::Ok();
  }

  // The segments of optimizer sub-group `sg` (Note [Skipped parameters], Note [Parameter groups]):
  // each trainable parameter's shard at its own next step, or 0 when it has no gradient this step,
  // with its group; neighbours at the same step in the same group merged.
  std::vector<StepSegment> Segments(uint64_t sg) {
    const uint64_t sg_elems = optimizer->sub_group_elements();
    const uint64_t begin = sg * sg_elems, end = begin + optimizer->SubGroupSize(sg);
    size_t lo = 0, hi = trainable_params;
    while (hi - lo > 1) {
      const size_t mid = (lo + hi) / 2;
      if (params->PartitionOffset(static_cast<ParamId>(mid)) <= begin) {
        lo = mid;
      } else {
        hi = mid;
      }
    }
    std::vector<StepSegment> out;
    for (size_t k = lo; k < trainable_params; ++k) {
      const auto id = static_cast<ParamId>(k);
      const uint64_t local = params->PartitionOffset(id), shard = params->ShardSize(id);
      if (local >= end) break;
      const uint64_t a = std::max(begin, local), b = std::min(end, local + shard);
      if (a >= b) continue;
      const size_t i = spec_of[k];
      const int64_t step = no_gradient[i] ? 0 : static_cast<int64_t>(param_steps[i] + 1);
      const uint32_t group = specs[i].group;
      if (!out.empty() && out.back().step == step && out.back().group == group) {
        out.back().count += b - a;
      } else {
        out.push_back({a - begin, b - a, step, group});
      }
    }
    return out;
  }

  // World size > 1: the smallest of the ranks' `epoch` (a collective: an all-gather of each
  // rank's 8 bytes, as two fp32 elements that are only moved, never computed on).
  Result<uint64_t> OldestEpoch(uint64_t epoch) {
    const auto world = static_cast<uint64_t>(params->world_size());
    const auto rank = static_cast<uint64_t>(params->rank());
    std::vector<uint64_t> all(world, 0);
    all[rank] = epoch;
    MEMPLAN_ASSIGN_OR_RETURN(void* device, runtime->AllocateDevice(world * 8));
    Status status = [&]() -> Status {
      auto* base = static_cast<std::byte*>(device);
      MEMPLAN_ASSIGN_OR_RETURN(
          gpu::CopyTicket up,
          runtime->CopyAsync(gpu::CopyDirection::kHostToDevice, base + rank * 8, &all[rank], 8));
      MEMPLAN_RETURN_IF_ERROR(runtime->Wait(up));
      MEMPLAN_RETURN_IF_ERROR(
          options.collective->AllGather(base + rank * 8, base, 2, ElementType::kFloat32));
      MEMPLAN_ASSIGN_OR_RETURN(
          gpu::CopyTicket down,
          runtime->CopyAsync(gpu::CopyDirection::kDeviceToHost, all.data(), base, world * 8));
      return runtime->Wait(down);
    }();
    Status freed = runtime->FreeDevice(device);
    MEMPLAN_RETURN_IF_ERROR(status.WithPrefix("engine: agreeing on the step to resume from"));
    MEMPLAN_RETURN_IF_ERROR(freed);
    return *std::min_element(all.begin(), all.end());
  }

  // Reads the master weights of partition elements [first, first + out.size()).
  // Reads partition elements [first, first + out.size()) of `array` (0 the master weights, 1.. the
  // optimizer's states), only those bytes of each sub-group.
  Status ReadPartition(uint64_t first, std::span<float> out, int array = 0) {
    const uint64_t sg_elems = optimizer->sub_group_elements();
    uint64_t done = 0;
    while (done < out.size()) {
      const uint64_t at = first + done;
      const uint64_t sg = at / sg_elems;
      const uint64_t in_sg = at - sg * sg_elems;
      const uint64_t len =
          std::min<uint64_t>(out.size() - done, optimizer->SubGroupSize(sg) - in_sg);
      MEMPLAN_RETURN_IF_ERROR(optimizer->ReadRange(sg, array, in_sg, out.subspan(done, len)));
      done += len;
    }
    return Status::Ok();
  }

  // Waits until every queued gradient is in the optimizer; returns the first failure.
  Status DrainGradients() {
    MutexLock lock(&grad_mu);
    while (!grad_jobs.empty() || grad_busy) grad_cv.Wait(&grad_mu);
    return grad_error;
  }

  void StopGradients() {
    {
      MutexLock lock(&grad_mu);
      grad_stop = true;
    }
    grad_cv.SignalAll();
    if (grad_worker.joinable()) grad_worker.join();
  }

  // Queues the copies of `bytes` of a gradient at `src` (device memory, ordered for the
  // device-to-host lane already) into staging slots, as jobs for the gradient thread; `first` is
  // the partition element the first byte belongs to. `scratch` goes with the last job.
  Status QueueGradientCopies(ParamId param, ElementType type, uint64_t first, const std::byte* src,
                             uint64_t bytes, void* scratch) {
    if (!runtime->has_device()) {
      Status copied = CopyGradientToHost(param, type, first, src, bytes);
      if (scratch != nullptr) {  // read already
        {
          MutexLock lock(&grad_mu);
          grad_scratch_free.push_back(scratch);
        }
        grad_cv.SignalAll();
      }
      return copied;
    }
    const auto eb = static_cast<uint64_t>(ElementBytes(type));
    const uint64_t chunk = grad_staging->slot_bytes() / eb * eb;
    gpu::CopyTicket last;
    for (uint64_t done = 0; done < bytes;) {
      const uint64_t len = std::min(chunk, bytes - done);
      GradJob job;
      job.param = param;
      job.type = type;
      job.first = first + done / eb;
      job.count = len / eb;
      const auto waited = std::chrono::steady_clock::now();
      MEMPLAN_ASSIGN_OR_RETURN(job.slot, grad_staging->Acquire());  // waits for the thread
      stall_s += SecondsSince(waited);
      MEMPLAN_ASSIGN_OR_RETURN(
          job.ticket, runtime->CopyAsync(gpu::CopyDirection::kDeviceToHost, job.slot.data().data(),
                                         src + done, len));
      last = job.ticket;
      done += len;
      if (done == bytes) job.scratch = scratch;
      {
        MutexLock lock(&grad_mu);
        grad_jobs.push_back(std::move(job));
        d2h_bytes += len;
      }
      grad_cv.SignalAll();
    }
    return Status::Ok();
  }

  // The host-only runtime's QueueGradientCopies (Note [Asynchronous gradients]): the whole
  // gradient into a recycled host buffer, copied before this returns.
  Status CopyGradientToHost(ParamId param, ElementType type, uint64_t first, const std::byte* src,
                            uint64_t bytes) {
    GradJob job;
    job.param = param;
    job.type = type;
    job.first = first;
    job.count = bytes / static_cast<uint64_t>(ElementBytes(type));
    {
      MutexLock lock(&grad_mu);
      const auto waited = std::chrono::steady_clock::now();
      while (grad_jobs.size() >= kGradSlots) grad_cv.Wait(&grad_mu);
      stall_s += SecondsSince(waited);
      // The smallest recycled buffer that holds it: first fit would hand the largest gradient's
      // buffer to a small one and make the largest allocate (and fault in) a new one.
      size_t best = grad_free.size();
      for (size_t i = 0; i < grad_free.size(); ++i) {
        if (grad_free[i].size() >= bytes &&
            (best == grad_free.size() || grad_free[i].size() < grad_free[best].size())) {
          best = i;
        }
      }
      if (best < grad_free.size()) {
        job.host = std::move(grad_free[best]);
        grad_free.erase(grad_free.begin() + static_cast<int64_t>(best));
      }
    }
    if (job.host.size() < bytes) job.host.resize(bytes);
    MEMPLAN_ASSIGN_OR_RETURN(job.ticket, runtime->CopyAsync(gpu::CopyDirection::kDeviceToHost,
                                                            job.host.data(), src, bytes));
    MEMPLAN_RETURN_IF_ERROR(runtime->Wait(job.ticket));
    {
      MutexLock lock(&grad_mu);
      grad_jobs.push_back(std::move(job));
      d2h_bytes += bytes;
    }
    grad_cv.SignalAll();
    return Status::Ok();
  }
};

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Engine::~Engine() { (void)Close(); }

Result<std::unique_ptr<Engine>> Engine::Create(const EngineOptions& options) {
  MEMPLAN_RETURN_IF_ERROR(options.schedule.Validate());
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  if (options.runtime != nullptr) {
    impl->runtime = options.runtime;
  } else {
    impl->own_runtime = gpu::CreateBestRuntime(nullptr, options.device);
    impl->runtime = impl->own_runtime.get();
  }
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
  if (spec.name.empty() || spec.module.empty()) {
    return Status::InvalidArgument("engine: a parameter needs a name and a module");
  }
  if (!spec.init) return Status::InvalidArgument("engine: parameter " + spec.name + " has no init");
  uint64_t numel = 1;
  for (int64_t d : spec.shape) {
    if (d <= 0) {
      return Status::InvalidArgument("engine: parameter " + spec.name + " has a dimension " +
                                     std::to_string(d));
    }
    if (numel > (uint64_t{1} << 40) / static_cast<uint64_t>(d)) {
      return Status::InvalidArgument("engine: parameter " + spec.name + " is implausibly large");
    }
    numel *= static_cast<uint64_t>(d);
  }
  for (const ParamSpec& other : s.specs) {
    if (other.name == spec.name) {
      return Status::InvalidArgument("engine: parameter " + spec.name + " registered twice");
    }
  }
  if (spec.group >= kMaxGroups) {
    return Status::InvalidArgument("engine: parameter " + spec.name + " is in group " +
                                   std::to_string(spec.group) + "; groups are 0 .. " +
                                   std::to_string(kMaxGroups - 1));
  }
  s.groups = std::max(s.groups, spec.group + 1);
  s.specs.push_back(spec);
  s.numels.push_back(numel);
  s.total_elements += numel;
  return static_cast<ParamId>(s.specs.size() - 1);
}

Status Engine::Start(RecoveryReport* report) {
  Impl& s = *impl_;
  if (s.started) return Status::FailedPrecondition("engine: Start() twice");
  if (s.specs.empty()) return Status::FailedPrecondition("engine: no parameters registered");
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
  MEMPLAN_ASSIGN_OR_RETURN(const Impl::PartitionLayout layout, s.LayOutPartition());
  s.partition_layout = layout;
  MEMPLAN_RETURN_IF_ERROR(s.CreateParamSwapper(nvme_dir, layout));
  CpuOptimizerOptions cpu;
  cpu.threads = s.threads();
  MEMPLAN_ASSIGN_OR_RETURN(s.converter, CpuOptimizer::Create(cpu));
  MEMPLAN_RETURN_IF_ERROR(s.CreateOptimizer(nvme_dir, cpu, layout.total, report));
  // The working copies, from the master weights (which, after a resume, are the last complete
  // step's), and the frozen parameters' from their init.
  MEMPLAN_RETURN_IF_ERROR(s.WriteWorkingCopies());
  MEMPLAN_RETURN_IF_ERROR(s.WriteFrozenWorkingCopies(layout));
  MEMPLAN_RETURN_IF_ERROR(s.params->GatherResident());
  // The pinned buffers pinned_budget_bytes covers (as checked above): the parameter staging and
  // the optimizer's; the gradient staging takes what they leave.
  const uint64_t pinned_used =
      (s.staging ? s.staging->stats().capacity_bytes : 0) + s.optimizer->pinned_bytes();
  if (s.runtime->has_device()) MEMPLAN_RETURN_IF_ERROR(s.CreateGradientStaging(pinned_used));
  if (world > 1) MEMPLAN_RETURN_IF_ERROR(s.AllocateGradientScratch());
  s.grad_given.assign(s.specs.size(), false);
  s.no_gradient.assign(s.specs.size(), false);
  s.grads_missing = s.trainable_params;
  s.norm_parts.assign(s.optimizer->sub_group_count(), GradientNormParts());
  if (s.options.resume && !s.steps_path.empty()) {
    MEMPLAN_RETURN_IF_ERROR(s.LoadStepCounts(s.optimizer->epoch()));
  } else {
    s.param_steps.assign(s.specs.size(), s.optimizer->epoch());
  }
  s.grad_worker = std::thread([&s] { s.RunGradients(); });
  s.stats.params = s.specs.size();
  s.stats.elements = s.total_elements;
  s.stats.partition_elements = layout.partition;
  s.stats.optimizer_elements = layout.total;
  s.stats.epoch = s.optimizer->epoch();
  s.stats.groups = s.groups;
  s.started = true;
  return Status::Ok();
}

Status Engine::Fetch(std::string_view module) {
  Impl& s = *impl_;
  if (!s.started || s.closed) return Status::FailedPrecondition("engine: not started");
  Status status = s.params->Fetch(module);
  s.stats.peak_device_bytes = std::max(s.stats.peak_device_bytes, s.runtime->device_bytes_in_use());
  return status;
}

Status Engine::Release(std::string_view module, gpu::Stream stream) {
  Impl& s = *impl_;
  if (!s.started || s.closed) return Status::FailedPrecondition("engine: not started");
  return s.params->Release(module, stream);
}

gpu::Stream Engine::GradientStream() const {
  return impl_->runtime->CopyStream(gpu::CopyDirection::kDeviceToHost);
}

Result<void*> Engine::DevicePointer(ParamId param) const {
  const Impl& s = *impl_;
  if (!s.started) return Status::FailedPrecondition("engine: not started");
  if (param >= s.specs.size()) return Status::InvalidArgument("engine: unknown parameter id");
  return s.params->DevicePointer(s.swap_id[param]);
}

Status Engine::GradReady(ParamId param, const void* device_grad, ElementType type,
                         gpu::Stream stream) {
  Impl& s = *impl_;
  if (!s.started || s.closed) return Status::FailedPrecondition("engine: not started");
  if (param >= s.specs.size()) return Status::InvalidArgument("engine: unknown parameter id");
  if (s.grad_given[param]) {
    return Status::FailedPrecondition("engine: gradient of " + s.specs[param].name +
                                      " given twice in one step");
  }
  if (s.specs[param].frozen) {
    return Status::InvalidArgument("engine: " + s.specs[param].name +
                                   " is frozen; it takes no gradient");
  }
  if (ElementBytes(type) == 0) return Status::InvalidArgument("engine: invalid gradient type");
  if (device_grad == nullptr) {
    return Status::InvalidArgument("engine: gradient of " + s.specs[param].name + " is null");
  }
  {
    MutexLock lock(&s.grad_mu);
    if (!s.grad_error.ok()) return s.grad_error;
  }
  const ParamId sid = s.swap_id[param];
  const uint64_t first = s.params->PartitionOffset(sid);
  const uint64_t count = s.params->ShardSize(sid);
  const auto eb = static_cast<uint64_t>(ElementBytes(type));
  const std::byte* src = static_cast<const std::byte*>(device_grad);
  void* scratch = nullptr;
  if (s.params->world_size() == 1) {
    // The gradient may still be being computed on the trainer's stream (Note [Asynchronous
    // gradients]).
    MEMPLAN_RETURN_IF_ERROR(s.runtime->OrderAfter(gpu::CopyDirection::kDeviceToHost, stream));
  } else {
    MEMPLAN_ASSIGN_OR_RETURN(scratch,
                             s.ReduceScatterGradient(sid, device_grad, type, count, stream));
    src = static_cast<const std::byte*>(scratch) +
          static_cast<uint64_t>(s.params->rank()) * count * eb;
  }
  Status queued = s.QueueGradientCopies(param, type, first, src, count * eb, scratch);
  if (!queued.ok()) {
    // Part of the gradient may be queued already: the step cannot be completed.
    MutexLock lock(&s.grad_mu);
    if (s.grad_error.ok()) s.grad_error = queued.WithPrefix("gradient of " + s.specs[param].name);
    return s.grad_error;
  }
  s.grad_given[param] = true;
  --s.grads_missing;
  return Status::Ok();
}

Status Engine::NoGradient(ParamId param) {
  Impl& s = *impl_;
  if (!s.started || s.closed) return Status::FailedPrecondition("engine: not started");
  if (param >= s.specs.size()) return Status::InvalidArgument("engine: unknown parameter id");
  if (s.specs[param].frozen) {
    return Status::InvalidArgument("engine: " + s.specs[param].name + " is frozen");
  }
  if (s.grad_given[param]) {
    return Status::FailedPrecondition("engine: " + s.specs[param].name +
                                      " already has a gradient this step");
  }
  if (!s.no_gradient[param]) {
    s.no_gradient[param] = true;
    s.grad_given[param] = true;
    --s.grads_missing;
  }
  return Status::Ok();
}

Status Engine::PrepareStep(const SwapStepOptions& options) {
  return PrepareStep(StepOptions{{options}});
}

Status Engine::PrepareStep(const StepOptions& options) {
  Impl& s = *impl_;
  if (!s.started || s.closed) return Status::FailedPrecondition("engine: not started");
  if (s.grads_missing != s.trainable_params) {
    return Status::FailedPrecondition(
        "engine: PrepareStep() after the step's first GradReady() or NoGradient(); give the "
        "options before backward, or at Step()");
  }
  MEMPLAN_RETURN_IF_ERROR(s.ValidateStepOptions(options).WithPrefix("engine: PrepareStep()"));
  if (s.overlap) {  // replaced: nothing was handed over yet
    s.optimizer->AbortStep();
    s.overlap = false;
  }
  s.prepared = true;
  s.prepared_options = options;
  s.prepared_at = std::chrono::steady_clock::now();
  s.keep_grads = false;
  s.clipping.clear();
  if (!s.optimizer->CanOverlap()) return Status::Ok();  // the cpu optimizer: serial
  // Note [Clipping by the global norm]: a step that may clip runs beside backward unclipped
  // (keeping its gradients for a redo) unless the last step clipped: then it waits for the norm.
  const bool clips = options.max_grad_norm > 0 && !std::isinf(options.max_grad_norm);
  if (clips && s.last_clipped) {
    s.clipping = "deferred";
    return Status::Ok();
  }
  MEMPLAN_RETURN_IF_ERROR(s.optimizer->BeginStep(
      options.groups, [&s](const SubGroupUpdate& u) { return s.WriteBack(u); }));
  s.overlap_limit = s.options.schedule.optimizer_buffer_count + 2;
  s.keep_grads = clips;
  s.clipping = clips ? "speculated" : "";
  s.overlap = true;
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
  if (s.grads_missing > 0) {
    for (size_t i = 0; i < s.specs.size(); ++i) {
      if (!s.grad_given[i] && !s.specs[i].frozen) {
        return Status::FailedPrecondition(
            "engine: the gradient norm needs every gradient of the step; none yet for " +
            s.specs[i].name + " (" + std::to_string(s.grads_missing) +
            " missing; NoGradient() declares a parameter without one)");
      }
    }
  }
  Result<GradientNormParts> parts = s.StepNorm();
  if (!parts.ok()) {
    if (s.overlap) return s.Abandon(parts.status());
    return parts.status();
  }
  MEMPLAN_ASSIGN_OR_RETURN(const double norm, parts->Norm(norm_type));
  return norm / grad_scale;
}

Status Engine::AbandonStep() {
  Impl& s = *impl_;
  if (!s.started || s.closed) return Status::FailedPrecondition("engine: not started");
  const bool overlapped = s.overlap;
  s.DropStep();
  MEMPLAN_RETURN_IF_ERROR(s.params->EndOfStep());
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
  if (s.prepared && !(options == s.prepared_options)) {
    const Status refused = Status::FailedPrecondition(
        "engine: Step() was given other options than PrepareStep(); the step is abandoned "
        "(nothing of it applied): run its forward and backward again");
    if (s.overlap) return s.Abandon(refused);
    s.DropStep();
    return refused;
  }
  if (!s.prepared) MEMPLAN_RETURN_IF_ERROR(s.ValidateStepOptions(options));
  if (s.grads_missing > 0) {
    for (size_t i = 0; i < s.specs.size(); ++i) {
      if (!s.grad_given[i] && !s.specs[i].frozen) {
        return Status::FailedPrecondition("engine: no gradient for " + s.specs[i].name +
                                          " this step (" + std::to_string(s.grads_missing) +
                                          " missing; NoGradient() skips a parameter)");
      }
    }
  }
  const bool skipping =
      std::find(s.no_gradient.begin(), s.no_gradient.end(), uint8_t{1}) != s.no_gradient.end();
  // Note [Clipping by the global norm]: the norm, when the step clips or may skip.
  StepOptions effective = options;
  double norm = -1;
  float coefficient = 1.0f;
  bool skip = false;
  s.norm_s = 0;
  if (options.max_grad_norm > 0 || options.skip_nonfinite || s.step_norm) {
    Result<GradientNormParts> parts = s.StepNorm();
    if (!parts.ok()) {
      if (s.overlap) return s.Abandon(parts.status().WithPrefix("engine: step"));
      return parts.status();
    }
    const double loss_scale = Impl::GradScale(options.groups[0]);
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
          Impl::SetGradScale(g, loss_scale / static_cast<double>(coefficient));
        }
      }
    }
  }
  s.stats.last_grad_norm = norm;
  s.stats.last_clip_coefficient = coefficient;
  if (skip) {  // GradScaler's skipped step: nothing applied, no count advances
    const bool overlapped = s.overlap;
    s.DropStep();
    MEMPLAN_RETURN_IF_ERROR(s.params->EndOfStep());
    if (overlapped) MEMPLAN_RETURN_IF_ERROR(s.WriteWorkingCopies());
    MEMPLAN_RETURN_IF_ERROR(s.params->GatherResident());
    ++s.stats.skipped_steps;
    s.stats.last_step_skipped = true;
    s.stats.last_step_s = SecondsSince(start);
    return Status::Ok();
  }
  s.stats.last_step_skipped = false;
  bool overlapped = s.overlap;
  const uint64_t before_step = overlapped ? s.optimizer->SubGroupsUpdated() : 0;
  // A speculated step that stands: the gradients kept for a redo are not written any more.
  if (overlapped && s.keep_grads && effective == options) s.optimizer->StopStoringGradients();
  if (overlapped && !(effective == options)) {
    // The step ran beside backward unclipped, and the norm says it must clip: drop it and run it
    // again from the gradients kept on NVMe (its other slots are rewritten; nothing was committed).
    // Run to its end, uncommitted, so that every sub-group's gradients are stored.
    Status drained = s.DrainGradients();
    if (drained.ok()) drained = s.FeedMissingZeros();
    if (drained.ok()) drained = s.DrainGradients();
    if (drained.ok()) drained = s.optimizer->FinishStep(false);
    if (!drained.ok()) return s.Abandon(drained.WithPrefix("engine: step"));
    s.overlap = false;
    s.clipping = "redone";
    overlapped = false;
  }
  Status status = s.RunStep(effective, overlapped, skipping);
  if (!status.ok()) {
    if (overlapped)
      return s.Abandon(
          status.WithPrefix("engine: overlapped step " + std::to_string(s.optimizer->epoch() + 1)));
    return status;
  }
  s.last_clipped = coefficient != 1.0f;
  const std::string clipping = s.clipping;
  s.overlap = false;
  s.prepared = false;
  s.keep_grads = false;
  s.step_norm.reset();
  for (size_t i = 0; i < s.specs.size(); ++i) {
    if (!s.specs[i].frozen && !s.no_gradient[i]) ++s.param_steps[i];
  }
  std::fill(s.no_gradient.begin(), s.no_gradient.end(), uint8_t{0});
  s.zeros_fed = false;
  MEMPLAN_RETURN_IF_ERROR(s.params->GatherResident());
  s.stats.last_step_s = SecondsSince(start);
  std::fill(s.grad_given.begin(), s.grad_given.end(), false);
  s.grads_missing = s.trainable_params;
  ++s.stats.steps;
  s.stats.epoch = s.optimizer->epoch();
  s.RecordStepProfile(start, overlapped, before_step);
  s.stats.step_profile.clipping = clipping;
  s.stats.step_profile.norm_s = s.norm_s;
  s.clipping.clear();
  s.stall_s = 0;
  return Status::Ok();
}

Result<ParamShard> Engine::Shard(ParamId param) const {
  const Impl& s = *impl_;
  if (!s.started) return Status::FailedPrecondition("engine: not started");
  if (param >= s.specs.size()) return Status::InvalidArgument("engine: unknown parameter id");
  const ParamId sid = s.swap_id[param];
  ParamShard shard;
  shard.size = s.params->ShardSize(sid);
  shard.first = static_cast<uint64_t>(s.params->rank()) * shard.size;
  shard.numel = s.params->Numel(sid);
  return shard;
}

int Engine::OptimizerStates() const {
  return SwapOptimizerStates(impl_->options.schedule.optimizer);
}

Status Engine::ReadOptimizerState(ParamId param, int array, std::span<float> out) {
  Impl& s = *impl_;
  if (!s.started || s.closed) return Status::FailedPrecondition("engine: not started");
  if (param >= s.specs.size()) return Status::InvalidArgument("engine: unknown parameter id");
  if (s.specs[param].frozen) {
    return Status::FailedPrecondition("engine: " + s.specs[param].name +
                                      " is frozen: it has no optimizer state");
  }
  if (array < 0 || array > OptimizerStates()) {
    return Status::InvalidArgument("engine: array " + std::to_string(array) + " of " +
                                   std::to_string(OptimizerStates() + 1));
  }
  if (s.grads_missing != s.trainable_params || s.overlap) {
    return Status::FailedPrecondition(
        "engine: the optimizer state is read between steps (gradients of the next step were "
        "given already)");
  }
  const ParamId sid = s.swap_id[param];
  if (out.size() != s.params->ShardSize(sid)) {
    return Status::InvalidArgument("engine: output size mismatch (the shard has " +
                                   std::to_string(s.params->ShardSize(sid)) + " elements)");
  }
  return s.ReadPartition(s.params->PartitionOffset(sid), out, array);
}

Result<uint64_t> Engine::ParamStepCount(ParamId param) const {
  const Impl& s = *impl_;
  if (!s.started) return Status::FailedPrecondition("engine: not started");
  if (param >= s.specs.size()) return Status::InvalidArgument("engine: unknown parameter id");
  if (s.specs[param].frozen) {
    return Status::FailedPrecondition("engine: " + s.specs[param].name + " is frozen");
  }
  return s.param_steps[param];
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
  if (!steps.empty() && steps.size() != s.specs.size()) {
    return Status::InvalidArgument("engine: " + std::to_string(steps.size()) + " step counts for " +
                                   std::to_string(s.specs.size()) + " parameters");
  }
  if (s.grads_missing != s.trainable_params || s.overlap || s.prepared) {
    return Status::FailedPrecondition(
        "engine: the optimizer state is loaded between steps (this step's gradients were given "
        "already: finish or abandon it first)");
  }
  const uint64_t sg_elems = s.optimizer->sub_group_elements();
  const bool any = std::find(arrays.begin(), arrays.end(), true) != arrays.end();
  if (any) {
    // The step counts first, as for a step: a crash before the store's commit leaves a file one
    // step ahead, which a resume undoes (Note [Skipped parameters]).
    if (!steps.empty() && !s.steps_path.empty()) {
      MEMPLAN_RETURN_IF_ERROR(s.SaveStepCounts(s.optimizer->epoch() + 1, false, steps));
    }
    MEMPLAN_RETURN_IF_ERROR(s.optimizer->Load(
        [&](uint64_t sg, int array, std::span<float> out) {
          return s.FillFrom(fill, array, sg * sg_elems, out);
        },
        arrays));
  }
  if (!steps.empty()) {
    for (size_t i = 0; i < s.specs.size(); ++i) {
      if (!s.specs[i].frozen) s.param_steps[i] = steps[i];
    }
  }
  // The store's epoch moved by one with the load: the counts are the parameters' own from now on.
  s.segmented = true;
  if (!s.steps_path.empty() && (steps.empty() || !any)) {
    MEMPLAN_RETURN_IF_ERROR(s.SaveStepCounts(s.optimizer->epoch(), false));
  }
  s.stats.epoch = s.optimizer->epoch();
  MEMPLAN_RETURN_IF_ERROR(s.params->EndOfStep());
  if (arrays[0]) {
    MEMPLAN_RETURN_IF_ERROR(s.WriteWorkingCopies());
    if (s.partition_layout.partition > s.partition_layout.frozen_begin) {
      MEMPLAN_RETURN_IF_ERROR(s.WriteFrozenWorkingCopies(
          s.partition_layout,
          [&](uint64_t at, std::span<float> out) { return s.FillFrom(fill, 0, at, out); }));
    }
  }
  return s.params->GatherResident();
}

Status Engine::ReadMasterWeights(ParamId param, std::span<float> out) {
  Impl& s = *impl_;
  if (!s.started || s.closed) return Status::FailedPrecondition("engine: not started");
  if (param >= s.specs.size()) return Status::InvalidArgument("engine: unknown parameter id");
  if (s.specs[param].frozen) {
    return Status::FailedPrecondition("engine: " + s.specs[param].name +
                                      " is frozen: it has no master weights (read a fetched "
                                      "working copy)");
  }
  const ParamId sid = s.swap_id[param];
  const uint64_t n = s.params->Numel(sid);
  if (out.size() != n) return Status::InvalidArgument("engine: output size mismatch");
  const uint64_t first = s.params->PartitionOffset(sid);
  const int world = s.params->world_size();
  if (world == 1) return s.ReadPartition(first, out);
  // World size > 1: this rank holds one shard; all-gather every rank's, through device memory as
  // the Collective needs.
  const uint64_t shard = s.params->ShardSize(sid);
  const uint64_t shard_bytes = shard * 4;
  const uint64_t rank = static_cast<uint64_t>(s.params->rank());
  std::vector<float> all(shard * static_cast<uint64_t>(world));
  MEMPLAN_RETURN_IF_ERROR(
      s.ReadPartition(first, std::span<float>(all).subspan(rank * shard, shard)));
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
  MEMPLAN_RETURN_IF_ERROR(
      status.WithPrefix("engine: gathering the master weights of " + s.specs[param].name));
  MEMPLAN_RETURN_IF_ERROR(freed);
  std::copy_n(all.begin(), n, out.begin());
  return Status::Ok();
}

EngineStats Engine::stats() const {
  const Impl& s = *impl_;
  EngineStats out = s.stats;
  {
    MutexLock lock(&s.grad_mu);
    out.d2h_bytes = s.d2h_bytes;
  }
  if (s.params) out.param = s.params->stats();
  if (s.optimizer) {
    out.optimizer_read_bytes = s.optimizer->read_bytes();
    out.optimizer_write_bytes = s.optimizer->write_bytes();
    out.grad_write_bytes = s.optimizer->grad_write_bytes();
    out.pinned_bytes = out.param.pinned_bytes + s.optimizer->pinned_bytes() +
                       (s.grad_staging ? s.grad_staging->stats().capacity_bytes : 0);
    const nvme::SwapStoreStats store = s.optimizer->store_stats();
    out.nvme_read_bytes += store.get_bytes;
    out.nvme_write_bytes += store.put_bytes;
  }
  if (s.param_store) {
    const nvme::SwapStoreStats store = s.param_store->stats();
    out.nvme_read_bytes += store.get_bytes;
    out.nvme_write_bytes += store.put_bytes;
  }
  out.peak_device_bytes = std::max(out.peak_device_bytes, s.runtime->peak_device_bytes());
  out.device_arena_bytes = out.param.device_arena_bytes + 2 * s.grad_scratch_bytes;
  return out;
}

Status Engine::Close() {
  Impl& s = *impl_;
  if (s.closed) return Status::Ok();
  s.closed = true;
  if (s.overlap) {  // a prepared step never finished: nothing of it is committed
    s.StopHandOvers();
    s.optimizer->AbortStep();
  }
  s.StopGradients();  // finishes the gradients queued (their copies may still be in flight)
  {
    MutexLock lock(&s.grad_mu);
    s.grad_jobs.clear();  // (none: StopGradients finished them)
  }
  s.grad_staging.reset();
  if (!s.grad_scratch_all.empty() || s.grad_zeros != nullptr) {
    (void)s.runtime->Synchronize();  // a copy may still read a scratch buffer
  }
  for (void* scratch : s.grad_scratch_all) (void)s.runtime->FreeDevice(scratch);
  s.grad_scratch_all.clear();
  {
    MutexLock lock(&s.grad_mu);
    s.grad_scratch_free.clear();
  }
  if (s.grad_zeros != nullptr) (void)s.runtime->FreeDevice(s.grad_zeros);
  s.grad_zeros = nullptr;
  Status status;
  if (s.params) status = s.params->EndOfStep();
  s.params.reset();  // before the store and staging pool it uses
  if (s.optimizer) {
    Status closed = s.optimizer->Close();
    if (status.ok()) status = closed;
  }
  if (s.param_store) {
    Status closed = s.param_store->Close();
    if (status.ok()) status = closed;
  }
  s.staging.reset();
  return status;
}

}  // namespace memplan::offload
