// OptimizerSwapper: the ZeRO-Infinity optimizer step over states that live on NVMe.
//
// The fp32 master weights, the optimizer's states and the fp32 gradients of a flat parameter
// partition of `num_elements` elements live in an nvme::SwapStore, cut into sub-groups of
// `sub_group_elements`. A step walks the sub-groups through `buffer_count` pinned buffers from a
// PinnedPool, in a three-stage pipeline:
//
//   reader thread:   read sub-group i+1 (states and gradients)  -> ready queue
//   calling thread:  step sub-group i with the CPU optimizer     -> written queue
//   writer thread:   write sub-group i-1 back                    -> free buffers
//
// so with enough buffers the step takes max(I/O time, compute time), not their sum.
//
// Crash consistency (Note [Two slots per sub-group] in optimizer_swapper.cc). Every sub-group has
// two state slots in the store; step number E (the "epoch", also the optimizer's step count) is
// written to slot E % 2, with a header that carries E, so the slot holding step E - 1 is never
// touched while step E is written. At the end of a step the store is synced (data, then the
// index), which commits it. A process killed mid-step leaves a store in which some sub-groups hold
// the new step (or torn bytes that fail their checksums) and all of them still hold the previous
// one: Open() finds the last epoch that every sub-group holds whole, reports the torn step, and
// resumes from there. A Step() that fails (an I/O error, a callback's error) likewise leaves the
// last committed step intact, and may simply be retried once gradients are written again.
//
// One slot (state_slots 1, Note [One slot per sub-group] in optimizer_swapper.cc): for a drive too
// small for two copies of the states, every step rewrites each sub-group's states in place, and
// the store needs half the space for them. The price is the torn-step safety above: a process
// killed after a step's first write, or a step that fails or is abandoned after it, leaves a mix
// of two steps that cannot be resumed. Open() then fails with DataLoss naming the step, and the
// swapper that saw the failure refuses every further step and read (DataLoss): training restarts
// from a checkpoint. A step that ends before its first write (an abandoned step whose sub-groups
// were only read) leaves the store as it was. A clean commit resumes exactly as with two slots.
//
// Gradients are written per sub-group with WriteGradients() (fp32) or, when the swapper was made
// with a 16-bit grad_dtype, WriteHalfGradients() (bf16 / fp16, as a mixed-precision backward
// leaves them: half the bytes to store and read, and the Adam kernel widens them as it loads them)
// before each Step(); a step refuses to run while any sub-group's gradients are missing, so stale
// gradients are never applied twice.
//
// Overlapped steps (Note [Sub-groups as their gradients arrive] in optimizer_swapper.cc). Step()
// needs every gradient first. A trainer whose backward produces the sub-groups' gradients one by
// one (in reverse, as backward runs) can instead BeginStep() with the step's options before
// backward, hand each sub-group to StepSubGroup() as soon as its gradients are complete (in
// memory: they are never written to the store nor read back), and FinishStep() after backward:
// the pipeline reads, steps and writes each sub-group while backward goes on, and FinishStep()
// waits for what is left and commits. The results are those of Step() with the same options and
// gradients, bit for bit (every sub-group is stepped on its own, whatever the order), and the
// crash consistency is Step()'s: the begun marker is committed in BeginStep(), the new states go
// to the other slots, and only FinishStep() commits them.
//
// Thread safety: one caller at a time (WriteGradients, Step, the overlapped-step calls and
// ReadParams must not overlap; StepSubGroup() may come from another thread than BeginStep() and
// FinishStep(), one call at a time). The swapper runs its own reader, compute and writer threads
// during a step; the update callback runs on the compute thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <variant>
#include <vector>

#include "common/status.h"
#include "nvme/swap_store.h"
#include "offload/cpu_optimizer.h"
#include "offload/pinned_pool.h"
#include "schedule/enums.h"

namespace memplan::offload {

// SwapOptimizer (which optimizer the swapper runs, fixed when the store is created), its names and
// SwapOptimizerStates are in schedule/enums.h: a Schedule names one.

// The hyperparameters of one step; the alternative must match the SwapOptimizer (AdamOptions for
// kAdam and kAdamAmsgrad, with `amsgrad` set accordingly). They may change from step to step
// (learning-rate schedules, loss scale).
using SwapStepOptions = std::variant<AdamOptions, SgdOptions, LionOptions>;

// Checks that `options` fit `optimizer` (the right alternative, amsgrad matching, SGD with
// momentum) and are valid.
Status ValidateSwapStepOptions(SwapOptimizer optimizer, const SwapStepOptions& options);

// One step of `optimizer` over in-memory arrays, as the swapper runs it on each sub-group:
// `states` holds SwapOptimizerStates(optimizer) arrays of params.size() elements back to back (in
// the order of SwapOptimizer's comment); `half` is empty or receives the 16-bit copy.
// `half_grads` (grad_dtype bf16 / fp16), for Adam only, replaces `grads` (then empty).
Status RunSwapOptimizerStep(CpuOptimizer& cpu, SwapOptimizer optimizer,
                            const SwapStepOptions& options, int64_t step, std::span<float> params,
                            std::span<const float> grads, std::span<float> states,
                            std::span<uint16_t> half, HalfDtype half_dtype,
                            std::span<const uint16_t> half_grads = {},
                            HalfDtype grad_dtype = HalfDtype::kNone);

struct OptimizerSwapperOptions {
  // The store: directory, direct I/O, backend, checksum block size... `capacity_bytes` 0 (the
  // default here) sizes it from the geometry (RequiredStoreBytes). keep_files is forced on: a store
  // that the swapper persists must survive its process. open_existing is set by Open().
  nvme::SwapStoreOptions store;
  // Elements per sub-group (a multiple of 1024, so every array starts 4 KiB-aligned in the store).
  // Larger sub-groups mean larger, more efficient I/O and more pinned memory. Default 4 Mi.
  uint64_t sub_group_elements = uint64_t{4} << 20;
  // Pinned buffers in the pipeline, >= 2 (3 lets reading, stepping and writing all overlap; 4 lets
  // the reader run one more sub-group ahead). Default 3.
  uint32_t buffer_count = 3;
  SwapOptimizer optimizer = SwapOptimizer::kAdam;
  // Also produce the updated parameters in this 16-bit format for the GPU copy (see
  // UpdateCallback).
  HalfDtype half_dtype = HalfDtype::kNone;
  // The gradients' format: kNone (fp32, WriteGradients) or bf16 / fp16 (WriteHalfGradients: stored
  // and read at 2 bytes an element, stepped by the fused kernel). 16-bit needs Adam.
  HalfDtype grad_dtype = HalfDtype::kNone;
  // Register the pinned buffers with the store's backends (io_uring fixed buffers), so reads and
  // writes of them skip per-request page pinning. Default on; a refusal only costs speed.
  bool register_buffers = true;
  // The CPU optimizer's threads and kernel.
  CpuOptimizerOptions cpu;
  // Pinned buffers come from this pool when given (its slots must hold at least
  // RequiredSlotBytes() bytes; the swapper holds buffer_count of them for its lifetime);
  // otherwise the swapper creates its own pool of exactly buffer_count slots with these settings.
  PinnedPool* pool = nullptr;
  bool lock_memory = false;
  std::string node_budget_name;
  uint64_t node_budget_bytes = 0;
  gpu::Runtime* runtime = nullptr;
  // Persist the store's index at the end of every step (the commit point). Turning it off makes a
  // crash lose every step since the last sync; Sync() still commits on demand.
  bool sync_every_step = true;
  // What a step's commit (and, with one slot, its begun marker) survives. kProcessCrash, the
  // default: the index written and renamed, nothing flushed, so a process killed anywhere resumes
  // from its last committed step exactly as with kPowerLoss, and a step costs no flush of the
  // drive's write cache (0.3-0.5 s on a virtio disk at 300 MB a step). After a power loss or a
  // kernel crash the store resumes from a step whose every block reads back with its checksum, or
  // Open() fails with DataLoss: never from a mix. kPowerLoss: the data fdatasynced and the index
  // fsynced at every commit, so the last committed step survives those too. Sync() and a Close()
  // that keeps the files always flush (Note [Commits without a flush] in optimizer_swapper.cc).
  Durability durability = Durability::kProcessCrash;
  // Open(): resume no later than this step. The ranks of a data-parallel job resume at the step
  // every rank completed: a rank killed between two ranks' commits is one step behind the others,
  // which then go back one step. Each sub-group keeps the step before its newest in its other
  // slot, so one step back is possible; DataLoss beyond that. Default: the newest complete step.
  uint64_t max_epoch = UINT64_MAX;
  // State slots per sub-group, 2 (the default) or 1. 2: each step writes the slot the last step
  // did not, so a crash or a failed step leaves the last committed step whole. 1: each step
  // rewrites the states in place, in half the store space, and gives that safety up (Note [One
  // slot per sub-group]). Fixed when the store is created; Open() needs the store's value.
  uint32_t state_slots = 2;
  // Test seam: when set, the store runs on the backend this returns (e.g. an nvme::FaultBackend)
  // instead of one made from store.backend.
  std::function<Result<std::unique_ptr<nvme::Backend>>()> make_backend;
  // Create(): what the store holds, as its owner describes it (the engine: every parameter's name,
  // shape, dtype and frozen flag), recorded with the store for the owner to compare at Open()
  // (identity()). Opaque to the swapper; at most 64 MiB. Default empty.
  std::string identity;

  Status Validate() const;
};

// What Open() found in an existing store.
struct RecoveryReport {
  uint64_t epoch = 0;            // the last step every sub-group holds whole; training resumes here
  bool torn = false;             // a step after `epoch` was started and not committed
  uint64_t torn_epoch = 0;       // that step (epoch + 1) when torn
  uint64_t torn_sub_groups = 0;  // sub-groups whose other slot holds that step or unreadable bytes
  std::vector<std::string> notes;  // one line per slot found damaged or ahead, for logs
};

// Timings and volumes of the last step; all times in seconds of wall clock.
struct SwapStepStats {
  double total_s = 0;
  double read_s = 0;          // reader thread busy reading
  double compute_s = 0;       // optimizer kernels plus the update callback
  double write_s = 0;         // writer thread busy writing
  double sync_s = 0;          // the commit at the end
  double compute_wait_s = 0;  // compute stage waiting for a read to finish
  // Overlapped steps: the reader waiting for the next sub-group to be handed over (the
  // optimizer idle, waiting for backward's gradients), and the time from BeginStep() until the
  // last sub-group's update callback returned.
  double grad_wait_s = 0;
  double updates_done_s = 0;
  uint64_t sub_groups_in_memory = 0;   // sub-groups stepped from gradients handed over in memory
  uint64_t sub_groups_read_ahead = 0;  // states read before their sub-group was handed over
  uint64_t read_bytes = 0, write_bytes = 0;
};

struct OptimizerSwapperStats {
  uint64_t epoch = 0;
  uint64_t steps = 0;  // steps completed by this object
  uint64_t failed_steps = 0;
  SwapStepStats last_step;
  PinnedPoolStats pool;  // of the pool the buffers come from
  nvme::SwapStoreStats store;
};

// One sub-group's updated parameters, handed to the UpdateCallback during Step(). The spans are
// valid only during the call (they point into a pinned buffer).
struct SubGroupUpdate {
  uint64_t sub_group = 0;
  uint64_t first_element = 0;             // offset of params[0] in the flat partition
  std::span<const float> params;          // fp32 master weights after the step
  std::span<const uint16_t> half_params;  // the 16-bit copy; empty when half_dtype is kNone
};
using UpdateCallback = std::function<Status(const SubGroupUpdate&)>;

// Part of a sub-group stepped at a step count of its own, or not at all: the optimizer's per-
// parameter step counts, as torch keeps them (a parameter without a gradient in a step is skipped
// and its count does not advance). [offset, offset + count) within the sub-group; step 0: skipped
// (its master weights and states unchanged; the 16-bit copy is still produced for the write-back).
// `group` picks the segment's options among the step's per-group options (parameter groups, as
// torch.optim's param_groups: Note [Parameter groups] in engine.cc); 0 without groups.
struct StepSegment {
  uint64_t offset = 0;
  uint64_t count = 0;
  int64_t step = 0;
  uint32_t group = 0;
};
// The segments of sub-group `sub_group` for this step, covering it in order with no gap. Empty:
// the whole sub-group at the step the caller runs (the swapper's epoch + 1).
using SegmentFn = std::function<std::vector<StepSegment>(uint64_t sub_group)>;

// RunSwapOptimizerStep over `segments` of the arrays (params.size() elements; states as there):
// each segment at its own step, step 0 skipped, with the options group_options[segment.group].
// The kernels run on the segment's part of each array in place. InvalidArgument for segments that
// do not cover the arrays in order or name a group past group_options, and for 16-bit gradients
// (not supported here).
Status RunSegmentedSwapOptimizerStep(CpuOptimizer& cpu, SwapOptimizer optimizer,
                                     std::span<const SwapStepOptions> group_options,
                                     std::span<const StepSegment> segments, std::span<float> params,
                                     std::span<const float> grads, std::span<float> states,
                                     std::span<uint16_t> half, HalfDtype half_dtype);

// Fills the initial fp32 parameters of the elements [first_element, first_element + out.size()).
using ParamFiller = std::function<Status(uint64_t first_element, std::span<float> out)>;

class OptimizerSwapper {
 public:
  // Bytes of one pinned buffer for these options (page-rounded by the pool).
  static uint64_t RequiredSlotBytes(const OptimizerSwapperOptions& options);
  // Store capacity a partition of `num_elements` needs (options.state_slots state slots and one
  // gradient per sub-group, alignment and metadata included).
  static uint64_t RequiredStoreBytes(const OptimizerSwapperOptions& options, uint64_t num_elements);

  // Creates a new store for a partition of `num_elements` (> 0), filling the initial parameters
  // sub-group by sub-group through `fill` (states start at zero), and commits it as epoch 0.
  // Fails, leaving no store behind, on bad options, a directory that already holds a store, a
  // filler's error, or I/O errors.
  static Result<std::unique_ptr<OptimizerSwapper>> Create(const OptimizerSwapperOptions& options,
                                                          uint64_t num_elements,
                                                          const ParamFiller& fill);
  // Reopens a store left by Create() (by this process or one that died). The geometry and the
  // optimizer come from the store; options.sub_group_elements, options.optimizer and
  // options.state_slots must match them. `report` (optional) receives what recovery found.
  // DataLoss for a one-slot store whose last step began and never committed (Note [One slot per
  // sub-group]): it holds a mix of two steps.
  static Result<std::unique_ptr<OptimizerSwapper>> Open(const OptimizerSwapperOptions& options,
                                                        RecoveryReport* report = nullptr);
  ~OptimizerSwapper();
  OptimizerSwapper(const OptimizerSwapper&) = delete;
  OptimizerSwapper& operator=(const OptimizerSwapper&) = delete;

  uint64_t num_elements() const { return num_elements_; }
  uint64_t sub_group_elements() const { return sub_group_elements_; }
  uint64_t sub_group_count() const { return sub_group_count_; }
  // First element and element count of sub-group i (< sub_group_count()).
  uint64_t SubGroupBegin(uint64_t i) const { return i * sub_group_elements_; }
  uint64_t SubGroupSize(uint64_t i) const;
  // The last committed step (0 right after Create).
  uint64_t epoch() const { return epoch_; }

  // Stores the fp32 gradients of sub-group i for the next step (grads.size() == SubGroupSize(i)).
  // FailedPrecondition when the swapper takes 16-bit gradients.
  Status WriteGradients(uint64_t sub_group, std::span<const float> grads);
  // The same for a swapper made with a 16-bit grad_dtype: the bit patterns of that format.
  Status WriteHalfGradients(uint64_t sub_group, std::span<const uint16_t> grads);
  // Runs step epoch() + 1 over every sub-group, pipelined; `on_update` (optional) sees each
  // sub-group's new parameters in order. Needs every sub-group's gradients written since the last
  // step (FailedPrecondition naming the first missing one). On success epoch() advances and, with
  // sync_every_step, the step is committed; on failure epoch() is unchanged and the committed
  // states are intact, the gradients still written. With one state slot a failure after the
  // step's first write leaves the store torn instead: torn_step() says which step, and every
  // later step and read fails with DataLoss.
  // `segments` (optional): per-parameter step counts and skipped parameters (StepSegment); the
  // epoch still advances by one.
  Status Step(const SwapStepOptions& options, const UpdateCallback& on_update = nullptr,
              const SegmentFn& segments = nullptr);
  // Step() with options per parameter group: `group_options` (non-empty) indexed by
  // StepSegment::group; an unsegmented sub-group takes group_options[0].
  Status Step(std::span<const SwapStepOptions> group_options, const UpdateCallback& on_update,
              const SegmentFn& segments);

  // The overlapped step (see the header comment). BeginStep() validates `options`, commits the
  // begun marker of step epoch() + 1 and starts the pipeline, which then waits for sub-groups;
  // `on_update` and `segments` as for Step(). FailedPrecondition when a step is begun already.
  Status BeginStep(const SwapStepOptions& options, const UpdateCallback& on_update = nullptr,
                   const SegmentFn& segments = nullptr);
  // BeginStep() with options per parameter group, as Step()'s.
  Status BeginStep(std::span<const SwapStepOptions> group_options, const UpdateCallback& on_update,
                   const SegmentFn& segments);
  // Hands sub-group i to the begun step. `grads`: its SubGroupSize(i) fp32 gradients in memory
  // (not for a 16-bit grad_dtype), which the compute thread reads: they must stay valid and
  // unchanged until `done` is called (once, from a pipeline thread when the kernel has read them,
  // or from FinishStep() / AbortStep() when the step ends without it); empty: the gradients
  // written with WriteGradients() since the last step. `segments` (non-empty) replace the
  // SegmentFn's for this sub-group. Returns at once. InvalidArgument for a sub-group out of range,
  // given twice, or gradients of the wrong size; FailedPrecondition without a begun step, or for
  // empty `grads` with none written. A failure of the step itself is not returned here but by
  // WaitForUpdates() / FinishStep() (`done` is then called at once): the caller's producer, a
  // backward pass, is not interrupted by it.
  // `store_gradients` (with `grads` in memory): the writer stage also writes them to the store's
  // gradient slot after the sub-group's states, as WriteGradients() would (`done` is then called
  // once they are written), so that the step can be run again by Step() (FinishStep(false)).
  Status StepSubGroup(uint64_t sub_group, std::span<const float> grads,
                      std::vector<StepSegment> segments = {}, std::function<void()> done = nullptr,
                      bool store_gradients = false);
  // Waits until every sub-group's update callback has returned (all must have been handed over:
  // FailedPrecondition naming the first that was not). Returns the step's first error; the step
  // then still needs FinishStep() or AbortStep().
  Status WaitForUpdates();
  // Ends the begun step: waits for the pipeline, commits (sync_every_step) and advances epoch().
  // On failure (an I/O error, the callback's error, a sub-group never handed over) the step is
  // over and nothing of it is committed: epoch() and the committed states are unchanged, and the
  // error names the step and the sub-group (one state slot: torn once a sub-group was written).
  Status FinishStep();
  // With `commit` false: the step is run to its end (every sub-group stepped and written to its
  // other slot, the gradients given with store_gradients stored) and then dropped, uncommitted:
  // epoch() stays, and Step() may run it again from the stored gradients (the engine's redo of a
  // step that must be clipped, Note [Clipping by the global norm] in engine.cc). Not with one
  // state slot: the states were rewritten in place, so the store is then torn (torn_step()).
  Status FinishStep(bool commit);
  // Abandons the begun step (a no-op without one): the pipeline stops, nothing is committed. With
  // one state slot, a step that wrote any sub-group leaves the store torn (torn_step()).
  void AbortStep();
  // The gradients given with store_gradients will not be needed (the step will be committed as it
  // runs): those not written yet are not written (a no-op without a begun step).
  void StopStoringGradients();
  bool step_begun() const;
  // Sub-groups of the begun step whose update callback has returned (0 without one).
  uint64_t SubGroupsUpdated() const;
  // Reads the fp32 master weights of sub-group i at epoch() (out.size() == SubGroupSize(i)).
  Status ReadParams(uint64_t sub_group, std::span<float> out);
  // Reads state array `state` (0 .. SwapOptimizerStates - 1, in the order of SwapOptimizer's
  // comment) of sub-group i at epoch().
  Status ReadState(uint64_t sub_group, int state, std::span<float> out);
  // Reads elements [offset, offset + out.size()) of array `array` (0 the master weights, 1.. the
  // states) of sub-group i at epoch(): only the bytes asked for (and their checksum blocks).
  Status ReadRange(uint64_t sub_group, int array, uint64_t offset, std::span<float> out);
  // Commits now, flushed to the drive (kPowerLoss, whatever options.durability says).
  Status Sync();
  // The store's state slots per sub-group (OptimizerSwapperOptions::state_slots).
  uint32_t state_slots() const;
  // One state slot: the step that failed or was abandoned after rewriting sub-groups in place
  // (Note [One slot per sub-group]); 0 when none. While it is set the store holds a mix of that
  // step and the one before: Step(), BeginStep(), Load() and the reads fail with DataLoss, and a
  // later Open() refuses the store.
  uint64_t torn_step() const;

  // The identity the store was created with (OptimizerSwapperOptions::identity); empty for a store
  // made without one (or by a memplan that did not record it).
  const std::string& identity() const;
  // Fills sub-group i's `array` (0 the master weights, 1.. the states) for Load().
  using ArrayFiller = std::function<Status(uint64_t sub_group, int array, std::span<float> out)>;
  // Replaces the arrays `arrays` says (1 + states entries) of every sub-group, keeping the others,
  // as step epoch() + 1 of the store, committed like a step (begun marker, the other slots, one
  // sync): a crash or an error (the filler's included) leaves step epoch() as it was. Between
  // steps only (FailedPrecondition with a step begun). The gradients written are kept.
  Status Load(const ArrayFiller& fill, std::span<const bool> arrays);
  // Forgets the gradients written since the last step (a step the trainer abandoned): Step() then
  // needs them all again.
  void DiscardGradients();

  OptimizerSwapperStats stats() const;
  // Commits and closes the store, keeping its files for a later Open(). Idempotent.
  Status Close();

 private:
  struct Impl;
  // Array 0 is the master weights, 1.. the states.
  Status ReadArray(uint64_t sub_group, int array, std::span<float> out);
  Status PutGradients(uint64_t sub_group, std::span<const std::byte> bytes, size_t count);
  struct StepRun;
  OptimizerSwapper(std::unique_ptr<Impl> impl, uint64_t num_elements, uint64_t sub_group_elements,
                   uint64_t epoch);

  std::unique_ptr<Impl> impl_;
  const uint64_t num_elements_;
  const uint64_t sub_group_elements_;
  const uint64_t sub_group_count_;
  uint64_t epoch_;
};

}  // namespace memplan::offload
