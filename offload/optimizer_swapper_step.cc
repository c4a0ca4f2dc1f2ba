// OptimizerSwapper's step: the pipeline that steps the sub-groups (Note [The pipeline]), serially
// (Step()) or as their gradients arrive (BeginStep(), StepSubGroup(), FinishStep()). See
// optimizer_swapper.h for the contract, optimizer_swapper_internal.h for the types.
//
// Note [The pipeline]
// Three stages, each a thread of the step, connected by queues of buffer indices: the reader
// takes the sub-groups in the order they are handed over and fills free buffers (states, then
// gradients unless they were handed over in memory), the compute thread steps the ready ones and
// runs the update callback, the writer writes them back and frees them. buffer_count bounds the
// data in flight. Any stage's error aborts the queues, every stage drains and returns, and the
// first error is the step's. Step() hands every sub-group over at once, in order.
//
// Note [Reading states ahead]
// A sub-group's states do not depend on its gradients, so the reader need not wait for the
// hand-over to read them: while nothing handed over is waiting, it reads the states of the
// sub-group expected next into a free buffer. The expectation is the order of the last overlapped
// step's hand-overs (training repeats it), at first backward's (the last sub-group first), and
// Step()'s ascending order for Step(). When the sub-group is handed over its buffer goes straight
// to the compute stage (after its stored gradients, if any, are read); at the end of backward the
// last sub-groups' states are then already in memory and only their update and write remain. A
// wrong guess costs one read, never a deadlock: a sub-group handed over that finds no free buffer
// takes the one holding the guess expected last, and the buffers the other stages hold come back
// without the reader. The reader's one queue carries both hand-overs and freed buffers, so that it
// waits for whichever comes first.
//
// Note [Sub-groups as their gradients arrive]
// In a training step the optimizer's sub-groups get their last gradient one after another as
// backward runs (the last sub-group first), so the sub-groups' optimizer work need not wait for
// the whole backward: BeginStep() starts the pipeline before backward, with the step's options
// (which must therefore be known then: the engine decides clipping and overflow with them, Note
// [Clipping by the global norm] in engine.cc), and each
// StepSubGroup() feeds it one sub-group. The pipeline is Step()'s, stage for stage; only the order
// of the sub-groups and the source of the gradients differ. Neither changes a result: every
// sub-group is stepped by the same kernel over its own elements with the same options and step
// count, and in-memory fp32 gradients are the values WriteGradients() would have stored. Nor the
// crash consistency: BeginStep() commits the begun marker before the first write, every sub-group
// is written to its other slot, and only FinishStep() syncs, so a crash or an error anywhere in
// between leaves step epoch() whole, and Open() takes no step past the one FinishStep() last
// committed (kCommittedKey), so an abandoned step is never resumed from. The gradients handed over
// in memory are also never written to the store nor read back: the step moves (4 + 4) bytes less
// per element than Step().
#include <algorithm>
#include <utility>

#include "offload/optimizer_swapper.h"
#include "offload/optimizer_swapper_internal.h"

namespace memplan::offload {

Status OptimizerSwapper::Step(const SwapStepOptions& options, const UpdateCallback& on_update,
                              const SegmentFn& segments) {
  return Step(std::span<const SwapStepOptions>(&options, 1), on_update, segments);
}

Status OptimizerSwapper::Step(std::span<const SwapStepOptions> options,
                              const UpdateCallback& on_update, const SegmentFn& segments) {
  Impl& s = *impl_;
  if (s.closed) return Status::FailedPrecondition("the optimizer swapper is closed");
  if (s.run) return Status::FailedPrecondition("an overlapped step is begun; FinishStep() it");
  if (options.empty()) return Status::InvalidArgument("step: no options given");
  for (const SwapStepOptions& o : options) {
    MEMPLAN_RETURN_IF_ERROR(ValidateSwapStepOptions(s.options.optimizer, o));
  }
  for (uint64_t i = 0; i < sub_group_count_; ++i) {
    if (!s.grads_written[i]) {
      return Status::FailedPrecondition("gradients of sub-group " + std::to_string(i) +
                                        " have not been written since step " +
                                        std::to_string(epoch_));
    }
  }
  // The serial step is the overlapped one with every sub-group handed over at once, in order,
  // its gradients read from the store.
  s.serial = true;
  Status begun = BeginStep(options, on_update, segments);
  s.serial = false;
  MEMPLAN_RETURN_IF_ERROR(begun);
  for (uint64_t i = 0; i < sub_group_count_; ++i) {
    Status handed = StepSubGroup(i, {});
    if (!handed.ok()) {
      AbortStep();
      return handed;
    }
  }
  return FinishStep();
}

bool OptimizerSwapper::step_begun() const { return impl_->run != nullptr; }

uint64_t OptimizerSwapper::SubGroupsUpdated() const {
  if (!impl_->run) return 0;
  MutexLock lock(&impl_->run->mu);
  return impl_->run->updated;
}

Status OptimizerSwapper::BeginStep(const SwapStepOptions& options, const UpdateCallback& on_update,
                                   const SegmentFn& segments) {
  return BeginStep(std::span<const SwapStepOptions>(&options, 1), on_update, segments);
}

Status OptimizerSwapper::BeginStep(std::span<const SwapStepOptions> options,
                                   const UpdateCallback& on_update, const SegmentFn& segments) {
  Impl& s = *impl_;
  if (s.closed) return Status::FailedPrecondition("the optimizer swapper is closed");
  if (s.run) return Status::FailedPrecondition("a step is begun already");
  if (s.torn_step != 0) return s.TornError("step " + std::to_string(epoch_ + 1));
  if (options.empty()) return Status::InvalidArgument("step: no options given");
  for (const SwapStepOptions& o : options) {
    MEMPLAN_RETURN_IF_ERROR(ValidateSwapStepOptions(s.options.optimizer, o));
  }
  auto run = std::make_unique<StepRun>();
  run->options.assign(options.begin(), options.end());
  run->on_update = on_update;
  run->segments = segments;
  run->from = epoch_;
  run->to = epoch_ + 1;
  run->start = std::chrono::steady_clock::now();
  run->jobs.resize(sub_group_count_);
  run->group_of.assign(s.buffers.size(), 0);
  if (s.options.sync_every_step || s.slots == 1) {
    // Record that step `to` has begun before anything of it is written, so that a crash before its
    // commit is reported as a torn step even where no slot shows it (the first step's slots are
    // new keys, which a crash simply loses). With one slot, always: it is what tells Open() that
    // the store holds a mix (Note [One slot per sub-group] in optimizer_swapper.cc).
    const uint64_t begun = run->to;
    Status marked = s.store->Put(
        kBegunKey,
        std::span<const std::byte>(reinterpret_cast<const std::byte*>(&begun), sizeof(begun)));
    if (marked.ok()) marked = s.store->Sync(s.options.durability);
    if (!marked.ok()) {
      s.EndUncommitted(begun, /*wrote=*/false);  // one slot: the marker back, nothing written
      return marked.WithPrefix("beginning step " + std::to_string(begun));
    }
  }
  for (size_t b = 0; b < s.buffers.size(); ++b) run->reader_q.Push(kFreed + b);
  run->serial = s.serial;
  run->predicted.resize(sub_group_count_);
  if (s.serial) {  // Step(): in order
    for (uint64_t k = 0; k < sub_group_count_; ++k) run->predicted[k] = k;
  } else if (s.last_order.size() == sub_group_count_) {
    run->predicted = s.last_order;
  } else {  // backward's order: the last sub-group first
    for (uint64_t k = 0; k < sub_group_count_; ++k) run->predicted[k] = sub_group_count_ - 1 - k;
  }
  StepRun& r = *run;
  r.reader = std::thread([this, &s, &r] { r.RunReader(*this, s); });
  r.computer = std::thread([this, &s, &r] { r.RunComputer(*this, s); });
  r.writer = std::thread([this, &s, &r] { r.RunWriter(*this, s); });
  s.run = std::move(run);
  return Status::Ok();
}

// The reader stage (Note [Reading states ahead]): takes the sub-groups as they are handed over
// and fills free buffers with their states (and stored gradients), reading ahead when idle.
void OptimizerSwapper::StepRun::RunReader(const OptimizerSwapper& sw, Impl& s) {
  const uint64_t count = sw.sub_group_count();
  // Note [Reading states ahead].
  std::deque<size_t> free;                // buffers free to fill
  std::deque<uint64_t> pending;           // handed over, not yet read
  std::vector<int64_t> ahead(count, -1);  // the buffer holding sub-group i's states read ahead
  std::vector<bool> handed(count, false);
  size_t guess = 0;  // next candidate in predicted
  uint64_t dispatched = 0;
  auto take = [&](size_t value) {
    if (value >= kFreed) {
      free.push_back(value - kFreed);
    } else {
      pending.push_back(value);
      handed[value] = true;
      order.push_back(value);
    }
  };
  // Reads sub-group i's states into buffer b (and its stored gradients when `with_grads`).
  auto read = [&](uint64_t i, size_t b, bool states, bool with_grads) -> bool {
    const auto t0 = std::chrono::steady_clock::now();
    const uint64_t n = sw.SubGroupSize(i);
    std::span<std::byte> value = s.Value(b, n);
    Status st;
    if (states) {
      st = s.store->Get(StateKey(i, s.SlotOf(from)), value);
      if (st.ok()) {
        SlotHeader h;
        std::memcpy(&h, value.data(), sizeof(h));
        auto epoch = s.CheckHeader(h, i, s.SlotOf(from), sw.SubGroupBegin(i), n);
        if (!epoch.ok()) {
          st = epoch.status();
        } else if (*epoch != from) {
          st = Status::DataLoss("state slot " + StateKey(i, s.SlotOf(from)) + " holds epoch " +
                                std::to_string(*epoch) + ", expected " + std::to_string(from));
        }
      }
    }
    uint64_t grad_bytes = 0;
    if (st.ok() && with_grads) {
      std::span<std::byte> grads = s.GradBytes(b, n);
      st = s.store->Get(GradKey(i), grads);
      grad_bytes = grads.size();
    }
    read_s += SecondsSince(t0);
    if (!st.ok()) {
      Abort(
          st.WithPrefix("step " + std::to_string(to) + ", reading sub-group " + std::to_string(i)));
      return false;
    }
    read_bytes += (states ? value.size() : 0) + grad_bytes;
    return true;
  };
  while (dispatched < count) {
    bool queue_aborted = false;
    if (std::optional<size_t> value = reader_q.TryPop(&queue_aborted)) {
      take(*value);
      continue;
    }
    if (queue_aborted) return;
    if (!pending.empty()) {
      const uint64_t i = pending.front();
      const bool with_grads = jobs[i].grads.empty();
      size_t b;
      bool states = true;
      if (ahead[i] >= 0) {
        b = static_cast<size_t>(ahead[i]);
        ahead[i] = -1;
        states = false;
      } else if (!free.empty()) {
        b = free.front();
        free.pop_front();
      } else {
        // Every buffer is busy or holds a guess: give up the guess expected last.
        int64_t victim = -1;
        for (size_t k = predicted.size(); k-- > 0 && victim < 0;) {
          if (ahead[predicted[k]] >= 0) victim = static_cast<int64_t>(predicted[k]);
        }
        if (victim < 0) {
          std::optional<size_t> value = reader_q.Pop();
          if (!value) return;
          take(*value);
          continue;
        }
        b = static_cast<size_t>(ahead[victim]);
        ahead[victim] = -1;
        ++evicted;
      }
      if (!read(i, b, states, with_grads)) return;
      pending.pop_front();
      group_of[b] = i;
      ++dispatched;
      ready_q.Push(b);
      continue;
    }
    // Nothing handed over: read the expected next sub-group's states ahead, into a free buffer.
    while (guess < predicted.size() && (handed[predicted[guess]] || ahead[predicted[guess]] >= 0)) {
      ++guess;
    }
    if (!free.empty() && guess < predicted.size()) {
      const uint64_t i = predicted[guess++];
      const size_t b = free.front();
      free.pop_front();
      if (!read(i, b, /*states=*/true, /*with_grads=*/false)) return;
      ahead[i] = static_cast<int64_t>(b);
      ++read_ahead;
      continue;
    }
    const auto g0 = std::chrono::steady_clock::now();
    std::optional<size_t> value = reader_q.Pop();
    grad_wait_s += SecondsSince(g0);
    if (!value) return;
    take(*value);
  }
}

// The compute stage: steps each ready buffer's sub-group and runs the update callback.
void OptimizerSwapper::StepRun::RunComputer(const OptimizerSwapper& sw, Impl& s) {
  const uint64_t count = sw.sub_group_count();
  for (uint64_t k = 0; k < count; ++k) {
    const auto w0 = std::chrono::steady_clock::now();
    std::optional<size_t> b = ready_q.Pop();
    wait_s += SecondsSince(w0);
    if (!b) return;
    const auto t0 = std::chrono::steady_clock::now();
    const uint64_t i = group_of[*b];
    const uint64_t n = sw.SubGroupSize(i);
    Job& job = jobs[i];
    if (!Claim(i)) return;  // aborted meanwhile
    std::vector<StepSegment> parts = job.segments;
    if (parts.empty() && segments) parts = segments(i);
    Status st = s.RunKernel(options, static_cast<int64_t>(to), *b, n, parts, job.grads);
    if (!job.grads.empty()) ++in_memory;
    if (!job.store) {
      std::function<void()> done;
      {
        MutexLock lock(&mu);
        done = std::move(job.done);
        job.done = nullptr;
      }
      if (done) done();  // the gradients are read
    }
    if (st.ok()) {
      SlotHeader h = s.MakeHeader(to, i, sw.SubGroupBegin(i), n);
      std::memcpy(s.Base(*b), &h, sizeof(h));
      if (on_update) {
        std::span<uint16_t> half = s.Half(*b, n);
        SubGroupUpdate update{i, sw.SubGroupBegin(i), s.Array(*b, 0, n),
                              std::span<const uint16_t>(half.data(), half.size())};
        st = on_update(update).WithPrefix("update callback for sub-group " + std::to_string(i));
      }
    }
    compute_s += SecondsSince(t0);
    if (!st.ok()) {
      Abort(st.WithPrefix("step " + std::to_string(to)));
      return;
    }
    {
      MutexLock lock(&mu);
      if (++updated == count) updates_done_s = SecondsSince(start);
    }
    cv.SignalAll();
    written_q.Push(*b);
  }
}

// The writer stage: writes each stepped sub-group's states to its other slot (and its gradients,
// for a redo) and frees its buffer for the reader.
void OptimizerSwapper::StepRun::RunWriter(const OptimizerSwapper& sw, Impl& s) {
  const uint64_t count = sw.sub_group_count();
  for (uint64_t k = 0; k < count; ++k) {
    std::optional<size_t> b = written_q.Pop();
    if (!b) return;
    const auto t0 = std::chrono::steady_clock::now();
    const uint64_t i = group_of[*b];
    std::span<std::byte> value = s.Value(*b, sw.SubGroupSize(i));
    wrote.store(true, std::memory_order_release);  // from here a one-slot store is torn
    Status st = s.store->Put(StateKey(i, s.SlotOf(to)), value);
    Job& job = jobs[i];
    uint64_t grad_bytes = 0;
    if (st.ok() && job.store) {
      // Kept for a step run again (FinishStep(false)): beside backward, off its path; not once
      // the caller knows the step stands.
      if (!store_stopped.load(std::memory_order_acquire)) {
        const std::span<const std::byte> grads = std::as_bytes(job.grads);
        st = s.store->Put(GradKey(i), grads);
        if (st.ok()) {
          s.grads_written[i] = true;  // the writer is the only one writing them in this step
          grad_bytes = grads.size();
        }
      }
      std::function<void()> done;
      {
        MutexLock lock(&mu);
        done = std::move(job.done);
        job.done = nullptr;
      }
      if (done) done();
    }
    write_s += SecondsSince(t0);
    if (!st.ok()) {
      Abort(
          st.WithPrefix("step " + std::to_string(to) + ", writing sub-group " + std::to_string(i)));
      return;
    }
    write_bytes += value.size();
    grad_write_bytes += grad_bytes;
    reader_q.Push(kFreed + *b);
  }
}

Status OptimizerSwapper::StepSubGroup(uint64_t sub_group, std::span<const float> grads,
                                      std::vector<StepSegment> segments, std::function<void()> done,
                                      bool store_gradients) {
  Impl& s = *impl_;
  if (!s.run) return Status::FailedPrecondition("no step is begun (BeginStep)");
  StepRun& r = *s.run;
  if (sub_group >= sub_group_count_) {
    return Status::InvalidArgument("sub-group " + std::to_string(sub_group) + " out of range (" +
                                   std::to_string(sub_group_count_) + " sub-groups)");
  }
  StepRun::Job& job = r.jobs[sub_group];
  if (job.submitted) {
    return Status::InvalidArgument("sub-group " + std::to_string(sub_group) + " handed to step " +
                                   std::to_string(r.to) + " twice");
  }
  if (grads.empty()) {
    if (!s.grads_written[sub_group]) {
      return Status::FailedPrecondition("gradients of sub-group " + std::to_string(sub_group) +
                                        " have not been written since step " +
                                        std::to_string(epoch_));
    }
  } else {
    if (s.options.grad_dtype != HalfDtype::kNone) {
      return Status::FailedPrecondition("the optimizer swapper takes " +
                                        std::string(HalfDtypeName(s.options.grad_dtype)) +
                                        " gradients; fp32 ones cannot be handed over");
    }
    if (grads.size() != SubGroupSize(sub_group)) {
      return Status::InvalidArgument("sub-group " + std::to_string(sub_group) + " has " +
                                     std::to_string(SubGroupSize(sub_group)) + " elements; " +
                                     std::to_string(grads.size()) + " gradients given");
    }
  }
  ++r.submitted;
  bool refused = false;  // decided under the lock: Abort() may claim the job as soon as it is out
  {
    MutexLock lock(&r.mu);
    job.submitted = true;
    if (!r.aborted) {
      job.grads = grads;
      job.segments = std::move(segments);
      job.done = std::move(done);
      job.store = store_gradients && !grads.empty();
    } else {
      job.claimed = true;  // the step has failed: nothing will read them
      refused = true;
    }
  }
  if (refused) {
    if (done) done();
    return Status::Ok();
  }
  r.reader_q.Push(sub_group);
  return Status::Ok();
}

Status OptimizerSwapper::WaitForUpdates() {
  Impl& s = *impl_;
  if (!s.run) return Status::FailedPrecondition("no step is begun (BeginStep)");
  StepRun& r = *s.run;
  if (r.submitted < sub_group_count_) {
    for (uint64_t i = 0; i < sub_group_count_; ++i) {
      if (!r.jobs[i].submitted) {
        return Status::FailedPrecondition("step " + std::to_string(r.to) + ": sub-group " +
                                          std::to_string(i) + " was never handed over");
      }
    }
  }
  MutexLock lock(&r.mu);
  while (!r.aborted && r.updated != sub_group_count_) r.cv.Wait(&r.mu);
  lock.Unlock();
  return r.error.Get();
}

Status OptimizerSwapper::FinishStep() { return FinishStep(true); }

Status OptimizerSwapper::FinishStep(bool commit) {
  Impl& s = *impl_;
  if (!s.run) return Status::FailedPrecondition("no step is begun (BeginStep)");
  StepRun& r = *s.run;
  Status status;
  if (r.submitted < sub_group_count_) {
    status = WaitForUpdates();  // names the sub-group never handed over
    r.Abort(status);
  }
  r.Join();
  if (status.ok()) status = r.error.Get();
  if (!commit) {
    // Run to its end and dropped: nothing committed, the stored gradients kept for Step() (with
    // two slots; one slot's states were rewritten: torn).
    s.stats.last_step.grad_wait_s = r.grad_wait_s;
    const bool serial = r.serial;
    const std::vector<uint64_t> order = r.order;
    const uint64_t to = r.to;
    const bool wrote = r.wrote.load(std::memory_order_acquire);
    s.run.reset();
    if (!serial && order.size() == sub_group_count_) s.last_order = order;
    s.EndUncommitted(to, wrote);
    return status;
  }
  double sync_s = 0;
  if (status.ok()) {
    const uint64_t committed = r.to;
    status = s.store
                 ->Put(kCommittedKey,
                       std::span<const std::byte>(reinterpret_cast<const std::byte*>(&committed),
                                                  sizeof(committed)))
                 .WithPrefix("committing step " + std::to_string(r.to));
  }
  if (status.ok() && s.options.sync_every_step) {
    const auto t0 = std::chrono::steady_clock::now();
    status =
        s.store->Sync(s.options.durability).WithPrefix("committing step " + std::to_string(r.to));
    sync_s = SecondsSince(t0);
  }
  SwapStepStats& last = s.stats.last_step;
  last.total_s = SecondsSince(r.start);
  last.read_s = r.read_s;
  last.write_s = r.write_s;
  last.compute_s = r.compute_s;
  last.compute_wait_s = r.wait_s;
  last.grad_wait_s = r.grad_wait_s;
  last.sync_s = sync_s;
  last.read_bytes = r.read_bytes;
  last.write_bytes = r.write_bytes;
  last.sub_groups_in_memory = r.in_memory;
  {
    MutexLock lock(&r.mu);
    last.updates_done_s = r.updates_done_s;
  }
  last.sub_groups_read_ahead = r.read_ahead;
  const uint64_t to = r.to;
  const bool wrote = r.wrote.load(std::memory_order_acquire);
  if (!r.serial && r.order.size() == sub_group_count_) s.last_order = r.order;
  s.run.reset();
  if (!status.ok()) {
    ++s.stats.failed_steps;
    s.EndUncommitted(to, wrote);
    return status;
  }
  epoch_ = to;
  s.stats.epoch = to;
  ++s.stats.steps;
  std::fill(s.grads_written.begin(), s.grads_written.end(), false);
  return Status::Ok();
}

void OptimizerSwapper::StopStoringGradients() {
  if (impl_->run) impl_->run->store_stopped.store(true, std::memory_order_release);
}

void OptimizerSwapper::AbortStep() {
  Impl& s = *impl_;
  if (!s.run) return;
  s.run->Abort(Status::FailedPrecondition("step " + std::to_string(s.run->to) + " abandoned"));
  s.run->Join();
  const uint64_t to = s.run->to;
  const bool wrote = s.run->wrote.load(std::memory_order_acquire);
  s.run.reset();
  s.EndUncommitted(to, wrote);
}
}  // namespace memplan::offload
