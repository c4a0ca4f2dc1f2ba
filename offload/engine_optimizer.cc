// The engine's optimizer path: see engine_optimizer.h.
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
// rank's gradients of step E were reduced, which needs them all alive past their backward). A
// store with one state slot (optimizer.state_slots 1) cannot go back: such a resume fails with
// DataLoss (Note [One slot per sub-group] in optimizer_swapper.cc).
#include "offload/engine_optimizer.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <utility>
#include <variant>

#include <nlohmann/json.hpp>

#include "nvme/swap_store.h"

namespace memplan::offload::internal {

// The optimizer's home for `total` elements, on the schedule's optimizer tier: NVMe (under
// `nvme_dir`) or memory. InvalidArgument for a resume with the optimizer in memory.
Status OptimizerPath::CreateOptimizer(const std::string& nvme_dir, const CpuOptimizerOptions& cpu,
                                      uint64_t total, RecoveryReport* report) {
  const Schedule& sc = options.schedule;
  if (sc.optimizer_tier == Tier::kNvme) return OpenNvmeOptimizer(nvme_dir, cpu, total, report);
  if (options.resume) {
    return Status::InvalidArgument(
        "engine: resume needs the optimizer on nvme (a cpu "
        "optimizer keeps nothing across runs)");
  }
  auto fill = [this](uint64_t first, std::span<float> out) { return param_path.Fill(first, out); };
  MEMPLAN_ASSIGN_OR_RETURN(home, MakeMemoryHome(sc.optimizer, ToHalf(sc.param_dtype), cpu, total,
                                                sc.sub_group_elements, fill));
  return Status::Ok();
}

// The optimizer on NVMe, under `nvme_dir`/optimizer: created for `total` elements from the
// parameters' init, or reopened for a resume. ResourceExhausted when its pinned buffers and the
// parameter staging exceed pinned_budget_bytes.
Status OptimizerPath::OpenNvmeOptimizer(const std::string& nvme_dir, const CpuOptimizerOptions& cpu,
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
  oo.state_slots = sc.optimizer_state_slots;
  oo.durability = sc.optimizer_durability;
  oo.optimizer = sc.optimizer;
  oo.half_dtype = ToHalf(sc.param_dtype);
  oo.cpu = cpu;
  oo.runtime = runtime;
  oo.make_backend = options.make_optimizer_backend;
  oo.identity = param_path.Identity();
  const uint64_t optimizer_pinned = OptimizerSwapper::RequiredSlotBytes(oo) * oo.buffer_count;
  const uint64_t staging_pinned =
      param_path.staging ? param_path.staging->stats().capacity_bytes : 0;
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
    MEMPLAN_RETURN_IF_ERROR(RefuseLiveStore(oo.store.directory, "optimizer"));
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
    auto fill = [this](uint64_t first, std::span<float> out) {
      return param_path.Fill(first, out);
    };
    MEMPLAN_ASSIGN_OR_RETURN(swapper, OptimizerSwapper::Create(oo, total, fill));
  }
  home = MakeNvmeHome(std::move(swapper));
  steps_path = nvme_dir + "/param_steps.json";
  if (!options.resume) ::unlink(steps_path.c_str());  // a crashed run's; ours starts at 0
  return Status::Ok();
}

// Resume with the optimizer on NVMe: its store reopened at the last complete step (with world
// size > 1, the oldest rank's: Note [Resuming ranks]). InvalidArgument when the store holds
// another registration (Note [What a store holds]) or another number of elements than this
// rank's `total`.
Result<std::unique_ptr<OptimizerSwapper>> OptimizerPath::ReopenOptimizer(OptimizerSwapperOptions oo,
                                                                         uint64_t total,
                                                                         RecoveryReport* report) {
  const int world = param_path.params->world_size();
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
  MEMPLAN_RETURN_IF_ERROR(
      param_path.CheckIdentity(swapper->identity(), oo.store.directory, report));
  if (swapper->num_elements() != total) {
    return Status::InvalidArgument("engine: the optimizer store holds " +
                                   std::to_string(swapper->num_elements()) +
                                   " parameters; the model registered " + std::to_string(total) +
                                   (world > 1 ? " for this rank (a different world size?)" : ""));
  }
  return swapper;
}

// World size > 1: the smallest of the ranks' `epoch` (a collective: an all-gather of each
// rank's 8 bytes, as two fp32 elements that are only moved, never computed on).
Result<uint64_t> OptimizerPath::OldestEpoch(uint64_t epoch) {
  const auto world = static_cast<uint64_t>(param_path.params->world_size());
  const auto rank = static_cast<uint64_t>(param_path.params->rank());
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

// An overlapped step's sub-group `sg` has all its gradients (in `grads`): hands it to the
// optimizer, which steps it in the background and gives the buffer back once it has read it
// (Note [Optimizer overlapped with backward]). Waits while overlap_limit sub-groups are handed
// over and unread: backward then waits for the optimizer (the stall).
Status OptimizerPath::HandOver(uint64_t sg, std::vector<float> grads) {
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
  if (parts.size() == 1 && parts[0].step == static_cast<int64_t>(home->epoch() + 1) &&
      SameOptions(prepared_options, parts[0].group, 0)) {
    parts.clear();
  }
  const std::span<const float> view(held->data(), held->size());
  // keep_grads: the optimizer's writer stores them too, for a redo (Note [Clipping by the
  // global norm]).
  Status handed = home->StepSubGroup(sg, view, std::move(parts), done, keep_grads);
  if (!handed.ok()) done();  // refused: the optimizer keeps nothing of it
  {
    MutexLock lock(&overlap_mu);
    --overlap_handing;
  }
  overlap_cv.SignalAll();
  return handed;
}

// Gives the gradient thread the buffers the optimizer has read (TakeGradBuffer in
// engine_gradients.cc).
void OptimizerPath::TakeFreedBuffers(std::vector<std::vector<float>>& into) {
  MutexLock lock(&overlap_mu);
  for (std::vector<float>& b : overlap_free) into.push_back(std::move(b));
  overlap_free.clear();
}

// Makes the gradient thread drop what it would still hand over and waits for a hand-over in
// progress to reach the optimizer: after it the optimizer's step may be abandoned (AbortStep
// destroys what StepSubGroup uses; the two run on different threads).
void OptimizerPath::StopHandOvers() {
  MutexLock lock(&overlap_mu);
  overlap_abandoned = true;
  overlap_cv.SignalAll();  // a hand-over waiting for room gives up
  while (overlap_handing > 0) overlap_cv.Wait(&overlap_mu);
}

// Hand-overs resume after StopHandOvers(), for the next step.
void OptimizerPath::AllowHandOvers() {
  MutexLock lock(&overlap_mu);
  overlap_abandoned = false;
}

// The segments of optimizer sub-group `sg` (Note [Skipped parameters], Note [Parameter groups]):
// each trainable parameter's shard at its own next step, or 0 when it has no gradient this step,
// with its group; neighbours at the same step in the same group merged.
std::vector<StepSegment> OptimizerPath::Segments(uint64_t sg) {
  const uint64_t sg_elems = home->sub_group_elements();
  const uint64_t begin = sg * sg_elems, end = begin + home->SubGroupSize(sg);
  size_t lo = 0, hi = param_path.trainable_params;
  while (hi - lo > 1) {
    const size_t mid = (lo + hi) / 2;
    if (param_path.params->PartitionOffset(static_cast<ParamId>(mid)) <= begin) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  std::vector<StepSegment> out;
  for (size_t k = lo; k < param_path.trainable_params; ++k) {
    const auto id = static_cast<ParamId>(k);
    const uint64_t local = param_path.params->PartitionOffset(id),
                   shard = param_path.params->ShardSize(id);
    if (local >= end) break;
    const uint64_t a = std::max(begin, local), b = std::min(end, local + shard);
    if (a >= b) continue;
    const size_t i = param_path.spec_of[k];
    const int64_t step = no_gradient[i] ? 0 : static_cast<int64_t>(param_steps[i] + 1);
    const uint32_t group = param_path.specs[i].group;
    if (!out.empty() && out.back().step == step && out.back().group == group) {
      out.back().count += b - a;
    } else {
      out.push_back({a - begin, b - a, step, group});
    }
  }
  return out;
}

// Writes the step counts after the store's step `epoch` to steps_path, atomically, each with how
// much that step changes it (Note [Skipped parameters]): an optimizer step (`stepping`) advances
// those with a gradient by one; a load (LoadOptimizerState) sets them to `loaded`.
Status OptimizerPath::SaveStepCounts(uint64_t epoch, bool stepping,
                                     std::span<const uint64_t> loaded) {
  nlohmann::json doc = {{"epoch", epoch}, {"params", nlohmann::json::object()}};
  for (size_t i = 0; i < param_path.specs.size(); ++i) {
    if (param_path.specs[i].frozen) continue;
    uint64_t after = param_steps[i];
    if (stepping && !no_gradient[i]) after += 1;
    if (!stepping && !loaded.empty()) after = loaded[i];
    const int64_t change = static_cast<int64_t>(after) - static_cast<int64_t>(param_steps[i]);
    doc["params"][param_path.specs[i].name] = {after, change};
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
Status OptimizerPath::LoadStepCounts(uint64_t epoch) {
  param_steps.assign(param_path.specs.size(), epoch);
  std::ifstream in(steps_path);
  if (!in) return Status::Ok();
  nlohmann::json doc = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded() || !doc.is_object() || !doc.contains("epoch") ||
      !doc["epoch"].is_number_unsigned() || !doc.contains("params") || !doc["params"].is_object()) {
    return Status::DataLoss("engine: " + steps_path + " is not a step-count file");
  }
  const uint64_t saved = doc["epoch"].get<uint64_t>();
  if (saved != epoch && saved != epoch + 1) {
    return Status::DataLoss("engine: " + steps_path + " holds the step counts of step " +
                            std::to_string(saved) + "; the optimizer store is at step " +
                            std::to_string(epoch));
  }
  for (size_t i = 0; i < param_path.specs.size(); ++i) {
    if (param_path.specs[i].frozen) continue;
    const auto it = doc["params"].find(param_path.specs[i].name);
    if (it == doc["params"].end() || !it->is_array() || it->size() != 2 ||
        !(*it)[0].is_number_unsigned() || !(*it)[1].is_number_integer()) {
      return Status::DataLoss("engine: " + steps_path + " has no step count for " +
                              param_path.specs[i].name);
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

// Reads the master weights of partition elements [first, first + out.size()).
// Reads partition elements [first, first + out.size()) of `array` (0 the master weights, 1.. the
// optimizer's states), only those bytes of each sub-group.
Status OptimizerPath::ReadPartition(uint64_t first, std::span<float> out, int array) {
  const uint64_t sg_elems = home->sub_group_elements();
  uint64_t done = 0;
  while (done < out.size()) {
    const uint64_t at = first + done;
    const uint64_t sg = at / sg_elems;
    const uint64_t in_sg = at - sg * sg_elems;
    const uint64_t len = std::min<uint64_t>(out.size() - done, home->SubGroupSize(sg) - in_sg);
    MEMPLAN_RETURN_IF_ERROR(home->ReadRange(sg, array, in_sg, out.subspan(done, len)));
    done += len;
  }
  return Status::Ok();
}

// Whether group `a`'s options equal group `b`'s in `options` (one entry: every group's).
bool OptimizerPath::SameOptions(const StepOptions& options, uint32_t a, uint32_t b) {
  if (options.groups.size() <= 1 || a == b) return true;
  return options.groups[a] == options.groups[b];
}

bool OptimizerPath::GroupsDiffer(const StepOptions& options) {
  for (size_t g = 1; g < options.groups.size(); ++g) {
    if (!(options.groups[g] == options.groups[0])) return true;
  }
  return false;
}

double OptimizerPath::GradScale(const SwapStepOptions& o) {
  return std::visit([](const auto& v) { return v.grad_scale; }, o);
}

void OptimizerPath::SetGradScale(SwapStepOptions& o, double scale) {
  std::visit([scale](auto& v) { v.grad_scale = scale; }, o);
}

}  // namespace memplan::offload::internal
