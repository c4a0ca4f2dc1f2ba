// The engine's optimizer homes: see engine_home.h.
//
// Note [Two optimizer homes]
// The Schedule's optimizer tier decides where the fp32 master weights, states and gradients live:
// "nvme" runs the OptimizerSwapper (a store on disk, pipelined sub-groups, crash-safe epochs);
// "cpu" keeps them in ordinary host memory and runs the same kernels over the same sub-groups
// (ZeRO-Offload). Both present the same small interface below, so the gradient path and the
// write-back of updated parameters do not care which one runs.
#include "offload/engine_home.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <cerrno>
#include <utility>

#include "nvme/swap_store.h"

namespace memplan::offload::internal {
namespace {

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

HalfDtype ToHalf(ElementType type) {
  switch (type) {
    case ElementType::kFloat32: return HalfDtype::kNone;
    case ElementType::kFloat16: return HalfDtype::kFp16;
    case ElementType::kBFloat16: return HalfDtype::kBf16;
  }
  return HalfDtype::kNone;
}

std::unique_ptr<OptimizerHome> MakeNvmeHome(std::unique_ptr<OptimizerSwapper> swapper) {
  return std::make_unique<NvmeHome>(std::move(swapper));
}

Result<std::unique_ptr<OptimizerHome>> MakeMemoryHome(SwapOptimizer optimizer, HalfDtype half,
                                                      const CpuOptimizerOptions& cpu_options,
                                                      uint64_t n, uint64_t sub_group,
                                                      const ParamFiller& fill) {
  MEMPLAN_ASSIGN_OR_RETURN(std::unique_ptr<MemoryHome> home,
                           MemoryHome::Create(optimizer, half, cpu_options, n, sub_group, fill));
  return std::unique_ptr<OptimizerHome>(std::move(home));
}

Status RefuseLiveStore(const std::string& dir, std::string_view what) {
  const int holder = LockHolder(dir + "/" + nvme::SwapStore::kLockFileName);
  if (holder == 0) return Status::Ok();
  return Status::FailedPrecondition(
      "engine: the " + std::string(what) + " store " + dir + " is in use by " +
      (holder > 0 ? "pid " + std::to_string(holder) : std::string("another process")) +
      (holder == ::getpid() ? " (this process: another engine on the same path; close it)" : "") +
      "; use another path");
}

}  // namespace memplan::offload::internal
