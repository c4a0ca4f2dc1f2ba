#include "planner/search.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <set>

#include "common/printable.h"
#include "common/strings.h"
#include "estimator/estimate.h"

namespace memplan::planner {
namespace {

using estimator::Checkpointing;
using estimator::OffloadDevice;
using estimator::Optimizer;
using estimator::Precision;
using estimator::TrainingSetup;

std::string GiB(uint64_t bytes) {
  return FormatDouble("%.1f", static_cast<double>(bytes) / 0x1p30);
}

bool Offloads(const TrainingSetup& s) {
  return s.offload_optimizer != OffloadDevice::kNone || s.offload_param != OffloadDevice::kNone;
}
bool UsesNvme(const TrainingSetup& s) {
  return s.offload_optimizer == OffloadDevice::kNvme || s.offload_param == OffloadDevice::kNvme;
}

struct Limits {
  uint64_t gpu = 0;
  uint64_t cpu = 0;     // 0: unknown, unchecked
  uint64_t pinned = 0;  // 0: unchecked
  uint64_t nvme = 0;    // 0: unknown capacity, unchecked
};

struct Misfit {
  std::string reason;  // empty: fits
  std::string tier;
  double ratio = 0;          // needed / usable
  bool pinned_only = false;  // only pinned (or locked) memory is short
  bool ok() const { return reason.empty(); }
};

double Ratio(uint64_t need, uint64_t have) {
  return have == 0 ? 1e9 : static_cast<double>(need) / static_cast<double>(have);
}

Misfit CheckFit(const estimator::PeakMemory& peak, const Limits& limits, const Cluster& c,
                const TrainingSetup& s) {
  Misfit m;
  if (peak.gpu_bytes > limits.gpu) {
    m.reason = "needs " + GiB(peak.gpu_bytes) + " GiB per GPU, has " + GiB(limits.gpu) +
               " usable of " + GiB(c.gpu.memory_bytes);
    m.tier = "gpu";
    m.ratio = Ratio(peak.gpu_bytes, limits.gpu);
    return m;
  }
  if (limits.cpu > 0 && peak.cpu_bytes > limits.cpu) {
    m.reason = "needs " + GiB(peak.cpu_bytes) + " GiB of CPU memory per node, has " +
               GiB(limits.cpu) + " usable of " + GiB(c.cpu_memory_bytes);
    m.tier = "cpu";
    m.ratio = Ratio(peak.cpu_bytes, limits.cpu);
    return m;
  }
  if (UsesNvme(s) && limits.nvme > 0 && peak.nvme_bytes > limits.nvme) {
    m.reason = "needs " + GiB(peak.nvme_bytes) + " GiB of NVMe per node, has " + GiB(limits.nvme) +
               " usable of " + GiB(c.nvme_capacity_bytes);
    m.tier = "nvme";
    m.ratio = Ratio(peak.nvme_bytes, limits.nvme);
    return m;
  }
  if (limits.pinned > 0 && peak.pinned_bytes > limits.pinned) {
    m.pinned_only = true;
    m.reason = "needs " + GiB(peak.pinned_bytes) + " GiB of pinned memory per node, has " +
               GiB(limits.pinned) + " (half the RAM)";
    m.tier = "pinned";
    m.ratio = Ratio(peak.pinned_bytes, limits.pinned);
    return m;
  }
  const uint64_t per_process = peak.pinned_bytes / static_cast<uint64_t>(c.gpus_per_node);
  if (UsesNvme(s) && c.memlock_bytes > 0 && per_process > c.memlock_bytes) {
    m.pinned_only = true;
    m.reason = "needs " + GiB(per_process) +
               " GiB of locked memory per process, RLIMIT_MEMLOCK is " + GiB(c.memlock_bytes);
    m.tier = "memlock";
    m.ratio = Ratio(per_process, c.memlock_bytes);
  }
  return m;
}

// What the buffer choices are made from (Note [Tuned buffers]).
struct BufferFacts {
  int64_t hidden = 0;
  int64_t largest_block = 0;   // parameters of the largest transformer layer
  int64_t largest_tensor = 0;  // elements of the largest parameter tensor
  int64_t trainable = 0;
  uint64_t pinned_budget = 0;  // bytes per GPU process; 0 = unknown
  // Parameters on NVMe: the reuse window (elements) and the swap buffers it needs, Note [Tuned
  // buffers].
  int64_t nvme_reuse_window = 0;
  int64_t nvme_buffers = 0;
};

}  // namespace

// A plan's "time" object: the step's parts under their field names (total_s is the plan's
// "step_time_s"; the FLOP counts are reported as MFU and HFU).
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(StepTime, compute_s, comm_s, pcie_s, optimizer_s, nvme_s,
                                   exposed_comm_s, exposed_offload_s, exposed_optimizer_s, gemm_s,
                                   attention_s, elementwise_s, host_wait_s, bound)

int64_t NvmeBuffersNeeded(const estimator::ModelInventory& inventory, int64_t window,
                          int64_t persistence_threshold, int64_t min_partition_numel,
                          int64_t partition_ranks) {
  std::vector<const estimator::TensorInfo*> live;
  for (const estimator::TensorInfo& t : inventory.tensors) {
    if (t.tied_to.empty()) live.push_back(&t);
  }
  const uint64_t ranks = static_cast<uint64_t>(std::max<int64_t>(partition_ranks, 1));
  auto swapped = [&](const estimator::TensorInfo* t) {
    const uint64_t partition = (t->numel + ranks - 1) / ranks;
    return static_cast<int64_t>(t->numel) > persistence_threshold &&
                   partition >= static_cast<uint64_t>(std::max<int64_t>(min_partition_numel, 0))
               ? 1
               : 0;
  };
  int64_t held = 0, in_window = 0, span = 0, module_most = 0, in_module = 0;
  size_t lo = 0;
  for (size_t hi = 0; hi < live.size(); ++hi) {
    span += static_cast<int64_t>(live[hi]->numel);
    in_window += swapped(live[hi]);
    while (span > window && lo <= hi) {
      span -= static_cast<int64_t>(live[lo]->numel);
      in_window -= swapped(live[lo]);
      ++lo;
    }
    held = std::max(held, in_window);
    in_module = hi > 0 && live[hi]->module == live[hi - 1]->module ? in_module + swapped(live[hi])
                                                                   : swapped(live[hi]);
    module_most = std::max(module_most, in_module);
  }
  return held + module_most;
}

std::vector<CheckpointPolicy> FrameworkCheckpointPolicies(estimator::Framework framework) {
  using C = Checkpointing;
  switch (framework) {
    case estimator::Framework::kTransformers: return {{C::kNone}, {C::kSelective}, {C::kFull}};
    case estimator::Framework::kTorchtune: return {{C::kNone}, {C::kFull, 2}, {C::kFull}};
    case estimator::Framework::kLitGpt:
    case estimator::Framework::kLlmFoundry: return {{C::kNone}, {C::kFull}};
    case estimator::Framework::kTorchtitan:
      return {{C::kNone}, {C::kOp}, {C::kFull, 2}, {C::kFull}};
  }
  return {{C::kNone}, {C::kFull}};
}

std::string CheckpointLabel(const TrainingSetup& setup) {
  std::string label(CheckpointingName(setup.checkpointing));
  if (setup.checkpointing == Checkpointing::kFull && setup.checkpoint_every > 1) {
    label += "/" + std::to_string(setup.checkpoint_every);
  }
  return label;
}

namespace {

int64_t RoundTo(double v, double unit) {
  return static_cast<int64_t>(std::max(unit, std::floor(v / unit) * unit));
}

// Sets DeepSpeed's buffer sizes in `s` for `level` 0 (tuned) or 1 (tight); -1 leaves DeepSpeed's
// defaults. Returns the label.
std::string ApplyBuffers(TrainingSetup* s, const BufferFacts& f, double partition_ranks,
                         int level) {
  if (level < 0) return "defaults";
  const bool tight = level > 0;
  const double h2 = static_cast<double>(f.hidden) * static_cast<double>(f.hidden);
  if (s->zero_stage == 1 || s->zero_stage == 2) {
    const int64_t bucket = tight ? RoundTo(std::min(h2, 2e8), 1e6) : 200000000;
    s->reduce_bucket_size = bucket;
    s->allgather_bucket_size = bucket;
  }
  if (s->zero_stage == 3) {
    s->reduce_bucket_size = RoundTo(tight ? h2 / 4 : h2, 1e6);
    const double block = static_cast<double>(std::max<int64_t>(f.largest_block, 1));
    int64_t prefetch = tight ? RoundTo(0.9 * h2, 1e6) : RoundTo(block, 1e6);
    if (s->offload_param == OffloadDevice::kNvme) {
      // One tensor ahead: every prefetched tensor holds an NVMe swap buffer.
      prefetch = RoundTo(2.0 * static_cast<double>(f.largest_tensor) / partition_ranks, 1e6);
    }
    s->stage3_prefetch_bucket_size = prefetch;
    s->stage3_param_persistence_threshold = std::max<int64_t>(10 * f.hidden, 10000);
    s->stage3_max_live_parameters = std::max<int64_t>(RoundTo(3 * block, 1e6), 100000000);
  }
  const bool nvme_params = s->offload_param == OffloadDevice::kNvme;
  if (s->zero_stage >= 2 || s->offload_optimizer != OffloadDevice::kNone) {
    int64_t sub_group = tight ? 100000000 : 1000000000;
    if (s->offload_optimizer == OffloadDevice::kNvme) {
      // buffer_count pinned fp32 sub-groups (and, with the parameters on NVMe too, the parameter
      // swap buffers that must each hold a sub-group's 16-bit copy) within half the pinned budget
      // per process.
      const double budget = f.pinned_budget > 0 ? static_cast<double>(f.pinned_budget) / 2 : 16e9;
      const double per_element = 4.0 * static_cast<double>(s->optimizer_buffer_count) +
                                 (nvme_params ? 2.0 * static_cast<double>(f.nvme_buffers) : 0.0);
      sub_group = RoundTo(std::clamp(budget / per_element, 1e7, tight ? 1e8 : 1e9), 1e6);
    }
    s->sub_group_size = sub_group;
  }
  if (nvme_params) {
    // DeepSpeed's partitioned_param_swapper asserts that a buffer holds the largest partition;
    // with the optimizer on NVMe too, optimizer_utils asserts that it holds the largest optimizer
    // sub-group (partitions accumulate until sub_group_size is reached, so up to one partition
    // more). Every gathered parameter keeps its buffer: the coordinator keeps those reused within
    // stage3_max_reuse_distance, which the DeepSpeed file sets to stage3_max_live_parameters, one
    // layer, so buffer_count covers the tensors of one layer's window and one module.
    const double largest = std::ceil(static_cast<double>(f.largest_tensor) / partition_ranks);
    double size = largest;
    if (s->offload_optimizer == OffloadDevice::kNvme) {
      size = std::max(size, static_cast<double>(s->sub_group_size) + largest);
    }
    s->param_buffer_size = static_cast<int64_t>(std::ceil(size / 1e6) * 1e6);
    s->param_buffer_count = std::max<int64_t>(5, f.nvme_buffers);
    s->stage3_max_live_parameters = f.nvme_reuse_window;
  }
  return tight ? "tight" : "tuned";
}

std::string CheckpointPhrase(const TrainingSetup& s) {
  switch (s.checkpointing) {
    case Checkpointing::kNone: return "no recomputation";
    case Checkpointing::kSelective: return "selective recomputation";
    case Checkpointing::kFull:
      return s.checkpoint_every > 1 ? "activation checkpointing of every " +
                                          std::to_string(s.checkpoint_every) + "th block"
                                    : "full activation checkpointing";
    case Checkpointing::kOp: return "op-level selective checkpointing";
  }
  return "";
}

std::string PlacePhrase(const Plan& p) {
  const TrainingSetup& s = p.setup;
  if (!Offloads(s)) {
    if (s.zero_stage == 0) return "keeps a full replica on every GPU";
    return p.sharding == Sharding::kHybrid ? "shards all state within each node"
                                           : "keeps all state on the GPUs, sharded";
  }
  std::string out = "moves";
  if (s.offload_optimizer != OffloadDevice::kNone) {
    out += std::string(" the optimizer to ") +
           (s.offload_optimizer == OffloadDevice::kCpu ? "CPU RAM" : "NVMe");
  }
  if (s.offload_param != OffloadDevice::kNone) {
    out += std::string(s.offload_optimizer != OffloadDevice::kNone ? " and" : "") +
           " the parameters to " + (s.offload_param == OffloadDevice::kCpu ? "CPU RAM" : "NVMe");
  }
  return out;
}

// Why `plan` ranks where it does, against the best plan and the others that fit.
std::string Explain(const Plan& plan, const std::vector<Plan>& plans, const Cluster& c,
                    double tie_fraction) {
  const StepTime& t = plan.time;
  const Plan& best = plans.front();
  std::string why = plan.family + " " + PlacePhrase(plan) + " (" + GiB(plan.peak.gpu_bytes) +
                    " of " + GiB(plan.gpu_capacity_bytes) + " GiB usable per GPU) at micro-batch " +
                    std::to_string(plan.setup.micro_batch) + " x " +
                    std::to_string(plan.setup.grad_accum) + " accumulation with " +
                    CheckpointPhrase(plan.setup) + "; the " + FormatDouble("%.2f", t.total_s) +
                    " s step is " + FormatDouble("%.0f", 100 * t.compute_s / t.total_s) +
                    "% compute";
  if (t.bound != "compute") why += ", bound by " + t.bound;
  why += ".";
  if (&plan == &best) {
    why += " Fastest that fits";
    for (const Plan& p : plans) {
      if (p.setup.optimizer != best.setup.optimizer && p.tokens_per_s > best.tokens_per_s) {
        why += " with the job's optimizer (" + p.family + " would be " +
               FormatDouble("%.0f", 100 * (p.tokens_per_s / best.tokens_per_s - 1)) +
               "% faster with bitsandbytes' 8-bit states: `optimizer` adam8bit)";
        break;
      }
    }
    bool plain_fits = false;
    for (const Plan& p : plans) plain_fits = plain_fits || !Offloads(p.setup);
    const Plan* runner_up = plans.size() > 1 ? &plans[1] : nullptr;
    if (runner_up != nullptr && best.tokens_per_s <= runner_up->tokens_per_s * (1 + tie_fraction)) {
      why += " (" + runner_up->family + " is within the time model's noise; the tie goes to " +
             (Offloads(runner_up->setup) && !Offloads(best.setup)
                  ? std::string("the plan without offload")
                  : std::string("the plan with more headroom")) +
             ")";
    } else if (!Offloads(best.setup) && best.setup.zero_stage == 3 &&
               plan.sharding == Sharding::kFull) {
      why += ": lower stages do not fit or need more recomputation";
    } else if (Offloads(best.setup) && !plain_fits) {
      why += ": nothing without offload fits " + std::to_string(c.WorldSize()) + " x " + c.gpu.name;
    }
    return why + ".";
  }
  const StepTime& b = best.time;
  struct Delta {
    const char* what;
    double seconds;
  };
  const Delta deltas[] = {
      {"more compute (recomputation or a smaller micro-batch)", t.compute_s - b.compute_s},
      {"more exposed communication", t.exposed_comm_s - b.exposed_comm_s},
      {"host/NVMe transfers", t.exposed_offload_s - b.exposed_offload_s},
      {"the optimizer step (CPU optimizer when offloaded)",
       t.exposed_optimizer_s - b.exposed_optimizer_s},
  };
  const Delta* top = &deltas[0];
  for (const Delta& d : deltas) {
    if (d.seconds > top->seconds) top = &d;
  }
  why += " " + FormatDouble("%.2f", t.total_s / b.total_s) + "x the best step time";
  if (top->seconds > 0) {
    why +=
        std::string(", mostly ") + top->what + " (+" + FormatDouble("%.2f", top->seconds) + " s)";
  }
  return why + ".";
}

// Note [Ranking]: the order within a tie.
bool Preferred(const Plan& a, const Plan& b, const Optimizer job_optimizer) {
  const bool a_own = a.setup.optimizer == job_optimizer, b_own = b.setup.optimizer == job_optimizer;
  if (a_own != b_own) return a_own;
  const int a_off = (a.setup.offload_optimizer != OffloadDevice::kNone) +
                    (a.setup.offload_param != OffloadDevice::kNone);
  const int b_off = (b.setup.offload_optimizer != OffloadDevice::kNone) +
                    (b.setup.offload_param != OffloadDevice::kNone);
  if (a_off != b_off) return a_off < b_off;
  if (a.HeadroomBytes() != b.HeadroomBytes()) return a.HeadroomBytes() > b.HeadroomBytes();
  return a.tokens_per_s > b.tokens_per_s;
}

// Orders `plans` by Note [Ranking] (stable for exact ties). Plans that change the job's optimizer
// (8-bit AdamW candidates) follow every plan that keeps it.
void Rank(std::vector<Plan>* plans, double tie_fraction, Optimizer job_optimizer) {
  std::vector<Plan> changed;
  for (auto it = plans->begin(); it != plans->end();) {
    if (it->setup.optimizer != job_optimizer) {
      changed.push_back(std::move(*it));
      it = plans->erase(it);
    } else {
      ++it;
    }
  }
  if (!changed.empty()) {
    Rank(plans, tie_fraction, job_optimizer);
    for (Plan& p : changed) p.setup.optimizer = job_optimizer;  // rank among themselves
    Rank(&changed, tie_fraction, job_optimizer);
    for (Plan& p : changed) {
      p.setup.optimizer = Optimizer::kAdam8bit;
      plans->push_back(std::move(p));
    }
    return;
  }
  std::vector<Plan> left = std::move(*plans);
  plans->clear();
  std::stable_sort(left.begin(), left.end(),
                   [](const Plan& a, const Plan& b) { return a.tokens_per_s > b.tokens_per_s; });
  while (!left.empty()) {
    const double fastest = left.front().tokens_per_s;
    auto end = std::find_if(left.begin(), left.end(), [&](const Plan& p) {
      return p.tokens_per_s * (1 + tie_fraction) < fastest;
    });
    std::vector<Plan> tier(left.begin(), end);
    left.erase(left.begin(), end);
    std::stable_sort(tier.begin(), tier.end(),
                     [&](const Plan& a, const Plan& b) { return Preferred(a, b, job_optimizer); });
    for (Plan& p : tier) plans->push_back(std::move(p));
  }
}

}  // namespace

Status SearchOptions::Validate() const {
  auto fraction = [](double v, const char* name) -> Status {
    if (!(v >= 0 && v < 1)) {
      return Status::InvalidArgument(std::string(name) + " must be in [0, 1)");
    }
    return Status::Ok();
  };
  MEMPLAN_RETURN_IF_ERROR(fraction(gpu_safety_fraction, "`gpu_margin`"));
  MEMPLAN_RETURN_IF_ERROR(fraction(1 - cpu_usable_fraction, "CPU usable fraction"));
  MEMPLAN_RETURN_IF_ERROR(fraction(1 - pinned_fraction, "pinned fraction"));
  MEMPLAN_RETURN_IF_ERROR(fraction(1 - nvme_usable_fraction, "NVMe usable fraction"));
  MEMPLAN_RETURN_IF_ERROR(fraction(tie_fraction, "tie fraction"));
  if (only_stage < -1 || only_stage > 3) {
    return Status::InvalidArgument("`zero_stage` must be 0-3");
  }
  if (only_micro_batch < 0) return Status::InvalidArgument("`micro_batch` must be >= 1");
  return Status::Ok();
}

std::string FamilyName(int stage, OffloadDevice optimizer, OffloadDevice param, Sharding sharding,
                       bool eight_bit) {
  auto where = [](OffloadDevice d) { return d == OffloadDevice::kCpu ? "CPU" : "NVMe"; };
  std::string name = stage == 0 ? "ZeRO-0 (DDP)" : "ZeRO-" + std::to_string(stage);
  if (stage == 3 && sharding == Sharding::kHybrid) name += " hybrid (shard per node)";
  if (eight_bit) name += " + 8-bit AdamW";
  if (optimizer != OffloadDevice::kNone) name += std::string(" + optimizer on ") + where(optimizer);
  if (param != OffloadDevice::kNone) name += std::string(" + params on ") + where(param);
  return name;
}

namespace {

// Note [Search stages]
// SearchPlans reads top to bottom as its stages: prepare (validate the request; the limits, the
// micro-batches, the checkpointing policies and the buffer facts every stage reads: a
// SearchContext), enumerate (the families: ZeRO stage x offload x sharding x 8-bit), and per
// family evaluate fit (each checkpointing x micro-batch through the memory model, buffers tuned,
// unpinned as a fallback) and score (the step-time model, tokens/s, MFU); then rank (Note
// [Ranking]) and explain (each plan's why, the rejected families closest first, what would make
// one fit, the gaps left unchecked and the assumptions in sentences).

// What every stage reads: the request and what follows from it once.
struct SearchContext {
  const estimator::ModelInventory& inventory;
  const Cluster& cluster;
  const Job& job;
  const SearchOptions& options;
  estimator::ModelCounts counts{};
  ModelShape shape{};
  Limits limits{};
  BufferFacts facts{};
  int64_t world = 0;
  int64_t per_gpu = 0;                             // sequences per GPU per step
  std::vector<int64_t> micro_batches{};            // ascending
  std::vector<CheckpointPolicy> checkpointings{};  // the most memory-saving last
  double peak_flops = 0;
  // The step model's runs, shared by every configuration tried (Note [Reusing a step]), and by
  // other searches over the model when SearchOptions::step_cache is given.
  std::shared_ptr<estimator::StepModelCache> step_cache =
      std::make_shared<estimator::StepModelCache>();
};

// The request's errors a search cannot start with.
Status ValidateSearch(const estimator::ModelInventory& inventory, const Cluster& cluster,
                      const Job& job, const SearchOptions& options) {
  MEMPLAN_RETURN_IF_ERROR(cluster.Validate());
  MEMPLAN_RETURN_IF_ERROR(options.Validate());
  MEMPLAN_RETURN_IF_ERROR(job.ValidateFor(inventory));
  if (PeakFlops(cluster.gpu, job.setup.precision) <= 0) {
    return Status::InvalidArgument(
        "`precision` " + std::string(estimator::PrecisionName(job.setup.precision)) + ": " +
        cluster.gpu.name + " has no bf16 support; use `precision` fp16-mixed");
  }
  const int64_t world = cluster.WorldSize();
  if (job.global_batch % world != 0) {
    return Status::InvalidArgument("`global_batch` " + std::to_string(job.global_batch) +
                                   " is not a multiple of the " + std::to_string(world) +
                                   " GPUs (train_batch_size = micro-batch x accumulation x GPUs)");
  }
  return Status::Ok();
}

// The micro-batches tried: the divisors of the sequences per GPU (or the one asked for).
Result<std::vector<int64_t>> MicroBatchesFor(const Job& job, int64_t per_gpu,
                                             const SearchOptions& options) {
  std::vector<int64_t> micro_batches;
  for (int64_t b = 1; b <= per_gpu; ++b) {
    if (per_gpu % b != 0) continue;
    if (options.only_micro_batch > 0 && b != options.only_micro_batch) continue;
    micro_batches.push_back(b);
  }
  if (options.only_micro_batch > 0 && micro_batches.empty()) {
    return Status::InvalidArgument("`micro_batch` " + std::to_string(options.only_micro_batch) +
                                   " does not divide the " + std::to_string(per_gpu) +
                                   " sequences per GPU of `global_batch` " +
                                   std::to_string(job.global_batch));
  }
  return micro_batches;
}

// What a plan may use: the GPU less its margin, the host RAM less the processes' own, the pinned
// share of it, the NVMe capacity's usable part.
Limits LimitsFor(const Cluster& cluster, const SearchOptions& options) {
  Limits limits;
  limits.gpu = static_cast<uint64_t>(static_cast<double>(cluster.gpu.memory_bytes) *
                                     (1 - options.gpu_safety_fraction));
  if (cluster.cpu_memory_bytes > 0) {
    const double usable =
        static_cast<double>(cluster.cpu_memory_bytes) * options.cpu_usable_fraction -
        static_cast<double>(options.cpu_per_process_bytes) *
            static_cast<double>(cluster.gpus_per_node);
    limits.cpu = static_cast<uint64_t>(std::max(usable, 1.0));
    limits.pinned = static_cast<uint64_t>(static_cast<double>(cluster.cpu_memory_bytes) *
                                          options.pinned_fraction);
  }
  if (cluster.nvme_capacity_bytes > 0) {
    limits.nvme = static_cast<uint64_t>(static_cast<double>(cluster.nvme_capacity_bytes) *
                                        options.nvme_usable_fraction);
  }
  return limits;
}

// The model's and the machine's facts the tuned buffers are sized from (Note [Tuned buffers]).
BufferFacts BufferFactsFor(const estimator::ModelInventory& inventory,
                           const estimator::ModelCounts& counts, const ModelShape& shape,
                           const Cluster& cluster, const Limits& limits) {
  BufferFacts facts;
  facts.hidden = inventory.arch->hidden;
  facts.largest_block = static_cast<int64_t>(counts.largest_block_params);
  for (const estimator::TensorInfo& t : inventory.tensors) {
    facts.largest_tensor = std::max<int64_t>(facts.largest_tensor, static_cast<int64_t>(t.numel));
  }
  facts.trainable = static_cast<int64_t>(shape.trainable);
  facts.nvme_reuse_window = RoundTo(
      std::ceil(static_cast<double>(std::max<int64_t>(facts.largest_block, 1)) / 1e6) * 1e6, 1e6);
  facts.nvme_buffers = NvmeBuffersNeeded(inventory, facts.nvme_reuse_window,
                                         std::max<int64_t>(10 * facts.hidden, 10000));
  uint64_t budget =
      limits.pinned > 0 ? limits.pinned / static_cast<uint64_t>(cluster.gpus_per_node) : 0;
  if (cluster.memlock_bytes > 0) {
    budget = budget > 0 ? std::min(budget, cluster.memlock_bytes) : cluster.memlock_bytes;
  }
  facts.pinned_budget = budget;
  return facts;
}

// Stage "prepare": the request validated and what every later stage reads.
Result<SearchContext> PrepareSearch(const estimator::ModelInventory& inventory,
                                    const Cluster& cluster, const Job& job,
                                    const SearchOptions& options) {
  MEMPLAN_RETURN_IF_ERROR(ValidateSearch(inventory, cluster, job, options));
  SearchContext ctx{.inventory = inventory, .cluster = cluster, .job = job, .options = options};
  if (options.step_cache != nullptr) ctx.step_cache = options.step_cache;
  ctx.world = cluster.WorldSize();
  ctx.per_gpu = job.global_batch / ctx.world;
  MEMPLAN_ASSIGN_OR_RETURN(ctx.micro_batches, MicroBatchesFor(job, ctx.per_gpu, options));
  MEMPLAN_ASSIGN_OR_RETURN(ctx.counts, estimator::CountParams(inventory));
  MEMPLAN_ASSIGN_OR_RETURN(ctx.shape, ModelShapeFor(inventory, job.setup));
  ctx.limits = LimitsFor(cluster, options);
  ctx.facts = BufferFactsFor(inventory, ctx.counts, ctx.shape, cluster, ctx.limits);
  ctx.checkpointings = FrameworkCheckpointPolicies(job.setup.framework);
  if (options.only_checkpointing) {
    ctx.checkpointings = {{*options.only_checkpointing, job.setup.checkpoint_every}};
  }
  ctx.peak_flops = PeakFlops(cluster.gpu, job.setup.precision);
  return ctx;
}

struct Family {
  int stage;
  OffloadDevice opt, param;
  Sharding sharding;
  bool eight_bit;
};

// Stage "enumerate": ZeRO stage x optimizer offload x parameter offload x sharding (x 8-bit
// AdamW where nothing is offloaded), within the what-if restrictions.
std::vector<Family> EnumerateFamilies(const SearchContext& ctx) {
  const SearchOptions& options = ctx.options;
  const TrainingSetup& setup = ctx.job.setup;
  std::vector<Family> families;
  const OffloadDevice devices[] = {OffloadDevice::kNone, OffloadDevice::kCpu, OffloadDevice::kNvme};
  const bool try_8bit =
      options.consider_8bit && setup.optimizer == Optimizer::kAdamW && setup.lora_rank == 0;
  for (int stage = 0; stage <= 3; ++stage) {
    if (options.only_stage >= 0 && stage != options.only_stage) continue;
    for (OffloadDevice opt : devices) {
      if (options.only_offload_optimizer && opt != *options.only_offload_optimizer) continue;
      for (OffloadDevice param : devices) {
        if (options.only_offload_param && param != *options.only_offload_param) continue;
        // Combinations DeepSpeed has no code for are not families at all.
        if (param != OffloadDevice::kNone && stage != 3) continue;
        if (opt != OffloadDevice::kNone && stage == 0) continue;
        if (opt == OffloadDevice::kNvme && stage != 3) continue;
        for (Sharding sharding : {Sharding::kFull, Sharding::kHybrid}) {
          // Hybrid sharding only means something across nodes, and offloads nothing (FSDP's
          // HYBRID_SHARD offloads to CPU only as FULL_SHARD does; MiCS none).
          if (sharding == Sharding::kHybrid &&
              (stage != 3 || ctx.cluster.nodes < 2 || opt != OffloadDevice::kNone ||
               param != OffloadDevice::kNone)) {
            continue;
          }
          if (options.only_sharding && sharding != *options.only_sharding) continue;
          families.push_back({stage, opt, param, sharding, false});
          if (try_8bit && opt == OffloadDevice::kNone && param == OffloadDevice::kNone &&
              sharding == Sharding::kFull) {
            families.push_back({stage, opt, param, sharding, true});
          }
        }
      }
    }
  }
  return families;
}

// A family's setup before checkpointing and micro-batch are chosen.
TrainingSetup FamilySetup(const Family& family, const SearchContext& ctx) {
  const Cluster& cluster = ctx.cluster;
  TrainingSetup base = ctx.job.setup;
  base.zero_stage = family.stage;
  base.offload_optimizer = family.opt;
  base.offload_param = family.param;
  if (family.eight_bit) base.optimizer = Optimizer::kAdam8bit;
  base.gpus_per_node = cluster.gpus_per_node;
  base.num_nodes = cluster.nodes;
  base.tp = 1;
  base.pin_memory = family.opt != OffloadDevice::kNone || family.param != OffloadDevice::kNone;
  if (cluster.aio_block_size > 0) base.aio_block_size = cluster.aio_block_size;
  if (cluster.aio_queue_depth > 0) base.aio_queue_depth = cluster.aio_queue_depth;
  if (cluster.aio_intra_op_parallelism > 0) {
    base.aio_intra_op_parallelism = cluster.aio_intra_op_parallelism;
  }
  return base;
}

// One configuration's memory: the setup tried (buffers, pinning), its estimate and its misfit.
struct Evaluated {
  std::optional<estimator::MemoryEstimate> memory;  // memory->setup: the setup tried
  Misfit misfit;
  std::string buffers;  // ApplyBuffers' label
};

// Stage "evaluate fit": one configuration `s` of `family` through the memory model, DeepSpeed's
// buffers tuned then tight (options.tune_buffers), without pinned buffers when only pinned memory
// is short. Counts the configurations in `result` and records the sequence length.
Result<Evaluated> EvaluateFit(const SearchContext& ctx, const Family& family,
                              const TrainingSetup& s, PlanResult* result) {
  // Hybrid sharding partitions over one node's GPUs: the memory of a one-node job.
  const double partition_ranks = static_cast<double>(
      family.sharding == Sharding::kHybrid ? ctx.cluster.gpus_per_node : ctx.world);
  const bool tune = ctx.options.tune_buffers;
  Evaluated out;
  // One grid point, however many buffer sizes it takes (the report said "41 evaluated" of 36).
  ++result->configurations;
  for (int level = tune ? 0 : -1; level <= (tune ? 1 : -1); ++level) {
    TrainingSetup tried = s;
    std::string label = ApplyBuffers(&tried, ctx.facts, partition_ranks, level);
    TrainingSetup for_memory = tried;
    if (family.sharding == Sharding::kHybrid) for_memory.num_nodes = 1;
    MEMPLAN_ASSIGN_OR_RETURN(
        estimator::MemoryEstimate e,
        estimator::EstimateMemory(ctx.inventory, for_memory, ctx.counts, ctx.step_cache.get()));
    Misfit fit = CheckFit(e.peak, ctx.limits, ctx.cluster, tried);
    if (!fit.ok() && fit.pinned_only && tried.pin_memory) {
      // Try again without pinned host buffers (slower transfers).
      TrainingSetup unpinned = tried;
      unpinned.pin_memory = false;
      TrainingSetup unpinned_memory = for_memory;
      unpinned_memory.pin_memory = false;
      MEMPLAN_ASSIGN_OR_RETURN(e, estimator::EstimateMemory(ctx.inventory, unpinned_memory,
                                                            ctx.counts, ctx.step_cache.get()));
      fit = CheckFit(e.peak, ctx.limits, ctx.cluster, unpinned);
      if (fit.ok()) tried = unpinned;
    }
    if (result->seq_len == 0) result->seq_len = e.setup.seq_len;
    out.memory = e;
    out.memory->setup = tried;
    out.memory->setup.seq_len = e.setup.seq_len;
    out.misfit = fit;
    out.buffers = label;
    // Tight buffers shrink GPU, host and pinned memory alike (with parameters on NVMe the swap
    // buffers hold a sub-group each); only an NVMe shortfall is not theirs to fix.
    if (fit.ok() || fit.tier == "nvme") break;
  }
  return out;
}

// Stage "score": a fitting configuration as a plan, with its step time, throughput and MFU.
Result<Plan> ScorePlan(const SearchContext& ctx, const Family& family, const std::string& name,
                       const Evaluated& fit) {
  Plan plan;
  plan.setup = fit.memory->setup;
  plan.sharding = family.sharding;
  plan.buffers = fit.buffers;
  plan.peak = fit.memory->peak;
  plan.gpu_capacity_bytes = ctx.limits.gpu;
  plan.time = PredictStepTime(ctx.shape, ctx.cluster, plan.setup, ctx.job.global_batch,
                              plan.setup.pin_memory, family.sharding, ctx.options.time_constants);
  if (!(std::isfinite(plan.time.total_s) && plan.time.total_s > 0)) {
    // Cluster::Validate's rate floors (Note [Rate floors]) make this unreachable; a ranking of
    // infinite steps would be meaningless, so it is a bug, not a plan.
    return Status::Internal("the time model gave a step of " +
                            FormatDouble("%g", plan.time.total_s) + " s for " + name +
                            "; please report it with the cluster and model");
  }
  plan.tokens_per_s =
      static_cast<double>(ctx.job.global_batch) * ctx.shape.seq_len / plan.time.total_s;
  plan.mfu = plan.time.model_flops / (plan.time.total_s * ctx.peak_flops);
  plan.hfu = plan.time.hardware_flops / (plan.time.total_s * ctx.peak_flops);
  plan.family = name;
  return plan;
}

// One family: evaluated and scored over checkpointing x micro-batch; its representative (the first
// of Note [Ranking] among its fitting configurations) joins result->plans, or it joins
// result->rejected with its tightest configuration's misfit.
Status SearchFamily(const SearchContext& ctx, const Family& family, PlanResult* result) {
  const std::string name =
      FamilyName(family.stage, family.opt, family.param, family.sharding, family.eight_bit);
  Rejection rejection;
  rejection.plan = name;
  rejection.sharding = family.sharding;
  if (family.opt == OffloadDevice::kNvme || family.param == OffloadDevice::kNvme) {
    if (ctx.cluster.nvme_path.empty() || !ctx.options.allow_nvme) {
      rejection.reason = "no NVMe drive given (`nvme_path`)";
      result->rejected.push_back(rejection);
      return Status::Ok();
    }
  }
  const TrainingSetup base = FamilySetup(family, ctx);
  if (Status valid = base.Validate(); !valid.ok()) {
    rejection.reason = valid.message();
    result->rejected.push_back(rejection);
    return Status::Ok();
  }
  const std::vector<int64_t>& micro_batches = ctx.micro_batches;
  std::vector<Plan> fitting;
  Misfit tightest;  // the smallest configuration: micro-batch 1, full checkpointing
  for (const CheckpointPolicy& ckpt : ctx.checkpointings) {
    for (int64_t mb : micro_batches) {
      TrainingSetup s = base;
      s.checkpointing = ckpt.checkpointing;
      s.checkpoint_every = ckpt.every;
      s.micro_batch = mb;
      s.grad_accum = ctx.per_gpu / mb;
      MEMPLAN_ASSIGN_OR_RETURN(Evaluated fit, EvaluateFit(ctx, family, s, result));
      if (!fit.misfit.ok()) {
        if (&ckpt == &ctx.checkpointings.back() && mb == micro_batches.front()) {
          tightest = fit.misfit;
        }
        break;  // a larger micro-batch needs more memory still
      }
      MEMPLAN_ASSIGN_OR_RETURN(Plan plan, ScorePlan(ctx, family, name, fit));
      fitting.push_back(std::move(plan));
    }
  }
  if (!fitting.empty()) {
    Rank(&fitting, ctx.options.tie_fraction, ctx.job.setup.optimizer);
    result->plans.push_back(fitting.front());
    return Status::Ok();
  }
  rejection.reason = tightest.ok() ? "does not fit even at micro-batch 1 with full checkpointing"
                                   : tightest.reason;
  rejection.over_ratio = tightest.ratio;
  rejection.tier = tightest.tier;
  rejection.setup = base;
  rejection.setup.checkpointing = ctx.checkpointings.back().checkpointing;
  rejection.setup.checkpoint_every = ctx.checkpointings.back().every;
  rejection.setup.micro_batch = micro_batches.front();
  rejection.setup.grad_accum = ctx.per_gpu / micro_batches.front();
  result->rejected.push_back(rejection);
  return Status::Ok();
}

// Stage "rank": the families' representatives in Note [Ranking]'s order, each with its why; the
// rejected families closest to fitting first, those that could not be tried at all last.
void RankAndExplain(const SearchContext& ctx, PlanResult* result) {
  Rank(&result->plans, ctx.options.tie_fraction, ctx.job.setup.optimizer);
  for (Plan& plan : result->plans) {
    plan.why = Explain(plan, result->plans, ctx.cluster, ctx.options.tie_fraction);
  }
  std::stable_sort(result->rejected.begin(), result->rejected.end(),
                   [](const Rejection& a, const Rejection& b) {
                     const bool a_tried = a.over_ratio > 0, b_tried = b.over_ratio > 0;
                     if (a_tried != b_tried) return a_tried;
                     return a.over_ratio < b.over_ratio;
                   });
}

// The peak of rejected family `r`'s setup `s` on cluster `c`, when it fits there.
std::optional<estimator::PeakMemory> FitsOn(const SearchContext& ctx, const Rejection& r,
                                            TrainingSetup s, const Cluster& c) {
  s.gpus_per_node = c.gpus_per_node;
  s.num_nodes = r.sharding == Sharding::kHybrid ? 1 : c.nodes;
  auto e = estimator::EstimateMemory(ctx.inventory, s, ctx.counts, ctx.step_cache.get());
  if (!e.ok()) return std::nullopt;
  if (!CheckFit(e->peak, ctx.limits, c, s).ok()) return std::nullopt;
  return e->peak;
}

// The changes said for no-fit: each kind once (`kinds`), for the first family it makes fit.
struct Suggestions {
  std::set<std::string> kinds;
  std::vector<std::string>* out;
  bool Wants(const std::string& kind) const { return kinds.count(kind) == 0; }
  void Add(const std::string& kind, std::string text) {
    if (kinds.insert(kind).second) out->push_back(std::move(text));
  }
};

// What would make rejected family `r` fit, each change checked with the memory model.
void SuggestFor(const SearchContext& ctx, const Rejection& r, int64_t seq_len,
                Suggestions* suggest) {
  const Cluster& cluster = ctx.cluster;
  const TrainingSetup& s0 = r.setup;
  if (r.tier == "gpu" && s0.zero_stage == 3 && suggest->Wants("nodes")) {
    for (int64_t nodes = cluster.nodes * 2; nodes <= cluster.nodes * 64; nodes *= 2) {
      Cluster more = cluster;
      more.nodes = nodes;
      if (auto p = FitsOn(ctx, r, s0, more)) {
        suggest->Add("nodes", std::to_string(nodes) + " nodes of " +
                                  std::to_string(cluster.gpus_per_node) + " x " + cluster.gpu.name +
                                  ": " + r.plan + " needs " + GiB(p->gpu_bytes) +
                                  " GiB per GPU (`nodes` " + std::to_string(nodes) +
                                  ", `global_batch` a multiple of " +
                                  std::to_string(nodes * cluster.gpus_per_node) + ")");
        break;
      }
    }
  }
  if (s0.optimizer == Optimizer::kAdamW && s0.lora_rank == 0 && !Offloads(s0) &&
      suggest->Wants("8bit")) {
    TrainingSetup eight = s0;
    eight.optimizer = Optimizer::kAdam8bit;
    if (auto p = FitsOn(ctx, r, eight, cluster)) {
      suggest->Add("8bit", "8-bit AdamW (`optimizer` adam8bit): " + r.plan + " needs " +
                               GiB(p->gpu_bytes) + " GiB per GPU");
    }
  }
  if (cluster.nvme_path.empty() && s0.zero_stage == 3 && suggest->Wants("nvme")) {
    TrainingSetup nvme = s0;
    nvme.offload_optimizer = nvme.offload_param = OffloadDevice::kNvme;
    nvme.pin_memory = true;
    Cluster with = cluster;
    with.nvme_path = "/nvme";
    if (nvme.Validate().ok()) {
      if (auto p = FitsOn(ctx, r, nvme, with)) {
        suggest->Add("nvme",
                     "an NVMe drive (`nvme_path`, `nvme_capacity`): ZeRO-3 with optimizer and "
                     "parameters on NVMe needs " +
                         GiB(p->gpu_bytes) + " GiB per GPU and " + GiB(p->nvme_bytes) +
                         " GiB of NVMe per node");
      }
    }
  }
  if (r.tier == "cpu" && suggest->Wants("ram")) {
    const SearchOptions& o = ctx.options;
    const double need = r.over_ratio * static_cast<double>(ctx.limits.cpu);
    suggest->Add(
        "ram",
        "more host RAM: " + r.plan + " needs " + GiB(static_cast<uint64_t>(need)) +
            " GiB of CPU memory per node (" +
            GiB(static_cast<uint64_t>((need + static_cast<double>(o.cpu_per_process_bytes) *
                                                  static_cast<double>(cluster.gpus_per_node)) /
                                      o.cpu_usable_fraction)) +
            " GiB of RAM)");
  }
  if (s0.seq_len == 0 || s0.micro_batch == 1) {
    TrainingSetup shorter = s0;
    shorter.seq_len = std::max<int64_t>(seq_len / 2, 1);
    if (seq_len > 256 && suggest->Wants("seq")) {
      if (auto p = FitsOn(ctx, r, shorter, cluster)) {
        suggest->Add("seq", "a shorter sequence (`seq_len` " + std::to_string(shorter.seq_len) +
                                "): " + r.plan + " needs " + GiB(p->gpu_bytes) + " GiB per GPU");
      }
    }
  }
}

// Stage "explain", when nothing fits: what would make a family fit, each kind of change once, for
// the closest family it makes fit (more nodes do nothing for ZeRO-1's replicated parameters, and
// NVMe applies to ZeRO-3 only, so the closest family alone can leave the changes that work for the
// next one unsaid).
void SuggestChanges(const SearchContext& ctx, PlanResult* result) {
  Suggestions suggest{{}, &result->suggestions};
  for (const Rejection& r : result->rejected) {
    if (r.over_ratio <= 0) continue;
    SuggestFor(ctx, r, result->seq_len, &suggest);
  }
  if (result->suggestions.empty() && !result->rejected.empty() &&
      result->rejected.front().over_ratio > 0) {
    result->suggestions.push_back("nothing simple: the closest, " + result->rejected.front().plan +
                                  ", " + result->rejected.front().reason +
                                  "; more GPUs or nodes are needed");
  }
}

// Stage "explain": what the search could not check.
void NoteGaps(const SearchContext& ctx, PlanResult* result) {
  if (!result->host_ram_checked) {
    result->gaps.push_back(
        "host RAM not checked: give `cpu_mem` (or cpu_memory_bytes in `cluster`); "
        "offload plans may need more RAM than the nodes have");
  }
  if (ctx.cluster.memlock_bytes == 0) {
    bool pinned = false;
    for (const Plan& p : result->plans) {
      pinned = pinned || (p.setup.pin_memory && UsesNvme(p.setup));
    }
    if (pinned) {
      result->gaps.push_back(
          "RLIMIT_MEMLOCK not checked (`memlock`): NVMe offload "
          "locks its swap buffers");
    }
  }
}

// Stage "explain": the limits and the models' constants the plans rest on, in sentences.
std::vector<std::string> SearchAssumptions(const SearchContext& ctx, bool host_ram_checked) {
  const Cluster& cluster = ctx.cluster;
  const SearchOptions& options = ctx.options;
  const TimeConstants& k = options.time_constants;
  std::vector<std::string> assumptions = {
      "Fit: GPU peak (CUDA context and 10% allocator margin included) <= GPU memory less " +
          FormatDouble("%.0f", options.gpu_safety_fraction * 100) + "%; " +
          (host_ram_checked
               ? "CPU per node <= " + FormatDouble("%.0f", options.cpu_usable_fraction * 100) +
                     "% of RAM less " + GiB(options.cpu_per_process_bytes) +
                     " GiB per GPU process; pinned <= " +
                     FormatDouble("%.0f", options.pinned_fraction * 100) + "% of RAM"
               : std::string("host RAM not checked")) +
          "; NVMe <= " + FormatDouble("%.0f", options.nvme_usable_fraction * 100) +
          "% of capacity.",
      "Compute (Note [Step-time model]): each Linear as an M x K x N GEMM (M = micro-batch x "
      "sequence tokens) at " +
          FormatDouble("%.0f", cluster.gpu.gemm_efficiency * 100) + "% of " +
          FormatDouble("%.0f", ctx.peak_flops / 1e12) + " TFLOPS plus its operands at " +
          FormatDouble("%.0f", k.hbm_efficiency * 100) + "% of " +
          FormatDouble("%.0f", cluster.gpu.hbm_bytes_per_s / 1e9) + " GB/s HBM; attention at " +
          FormatDouble("%.0f", cluster.gpu.attention_efficiency * 100) +
          "% of peak; elementwise kernels memory-bound; MFU counts 6N + 12Lsd per token "
          "(LoRA 4N + 6N_adapters), HFU adds recomputation.",
      "Collectives: NCCL ring at " + FormatDouble("%.0f", k.link_efficiency * 100) + "% of " +
          FormatDouble("%.0f", cluster.gpu.link_bytes_per_s / 1e9) + " GB/s per GPU link" +
          (cluster.nodes > 1
               ? "; across nodes " + FormatDouble("%.0f", k.network_efficiency * 100) + "% of " +
                     FormatDouble("%.0f", cluster.InterNodeBytesPerS() / 1e9) + " GB/s per node" +
                     (cluster.inter_node_bytes_per_s > 0
                          ? std::string()
                          : " (the " + cluster.gpu.name +
                                " reference server's network; `inter_node_bw` for "
                                "yours)")
               : std::string()) +
          "; ZeRO-3 gathers the 16-bit parameters twice and reduce-scatters the gradients every "
          "micro-batch.",
      "PCIe Gen" + std::to_string(cluster.PcieGen()) + ": " +
          FormatDouble("%.1f", cluster.PcieLineBytesPerS() * k.pcie_efficiency / 1e9) +
          " GB/s per host link pinned (" + std::to_string(cluster.gpu.gpus_per_pcie_switch) +
          " GPU(s) per link), half unpinned; CPU Adam " +
          FormatDouble("%.2g", cluster.CpuAdamParamsPerS()) + " params/s per node (" +
          cluster.cpu_adam_source + "); NVMe " +
          FormatDouble("%.1f", cluster.NvmeReadBytesPerS() / 1e9) + " / " +
          FormatDouble("%.1f", cluster.NvmeWriteBytesPerS() / 1e9) + " GB/s read / write (" +
          cluster.nvme_bandwidth_source + ").",
      "Overlap: gathers and parameter fetches hide behind forward, gradient reduction and copies "
      "behind backward (" +
          FormatDouble("%.0f", k.overlap_interference * 100) +
          "% of the overlapped time still slows compute); the optimizer step, the post-step "
          "all-gather and parameter upload are serial; " +
          FormatDouble("%.0f", k.step_fixed_s * 1000) + " ms fixed per step.",
      "Ranking: plans within " + FormatDouble("%.0f", options.tie_fraction * 100) +
          "% of each other tie; ties go to the job's own optimizer, less offload, then more GPU "
          "headroom.",
  };
  if (!options.calibration_note.empty()) {
    assumptions.push_back(
        "Step-time constants calibrated from measured runs: " + options.calibration_note + ".");
  }
  if (options.tune_buffers) {
    assumptions.push_back(
        "DeepSpeed buffers tuned from the model (Note [Tuned buffers]): buckets, prefetch and "
        "live-parameter limits from h = " +
        std::to_string(ctx.inventory.arch->hidden) +
        " and the largest layer, sub-groups and NVMe buffers from the pinned budget; a tighter set "
        "is tried when the first does not fit.");
  }
  return assumptions;
}

}  // namespace

// Note [Search stages].
Result<PlanResult> SearchPlans(const estimator::ModelInventory& inventory, const Cluster& cluster,
                               const Job& job, const SearchOptions& options) {
  MEMPLAN_ASSIGN_OR_RETURN(const SearchContext ctx,
                           PrepareSearch(inventory, cluster, job, options));
  PlanResult result;
  result.host_ram_checked = cluster.cpu_memory_bytes > 0;
  const std::vector<Family> families = EnumerateFamilies(ctx);
  result.grid_size =
      static_cast<int64_t>(families.size() * ctx.checkpointings.size() * ctx.micro_batches.size());
  // The sequence the plans are for, said even when no configuration is evaluated (every family
  // refused, e.g. NVMe asked for without a drive; issue 31 item 10 printed "x 0 tokens").
  if (inventory.arch) result.seq_len = job.setup.SeqLenFor(&*inventory.arch);
  for (const Family& family : families) {
    MEMPLAN_RETURN_IF_ERROR(SearchFamily(ctx, family, &result));
  }
  RankAndExplain(ctx, &result);
  if (result.plans.empty()) SuggestChanges(ctx, &result);
  NoteGaps(ctx, &result);
  result.assumptions = SearchAssumptions(ctx, result.host_ram_checked);
  return result;
}

std::vector<std::string> TrainerSettings(const Plan& plan,
                                         const estimator::ModelInventory& inventory,
                                         bool for_hf_trainer) {
  const TrainingSetup& s = plan.setup;
  std::vector<std::string> out;
  if (s.checkpointing == Checkpointing::kFull) {
    out.push_back(
        "turn on gradient checkpointing in the model: "
        "model.gradient_checkpointing_enable() (Hugging Face) or "
        "TrainingArguments(gradient_checkpointing=True); DeepSpeed's "
        "activation_checkpointing block only configures deepspeed.checkpointing");
  } else if (s.checkpointing == Checkpointing::kSelective) {
    out.push_back(
        "recompute the attention core only (Megatron's --recompute-granularity "
        "selective, or torch.utils.checkpoint around the attention of each layer)");
  } else {
    out.push_back("leave gradient checkpointing off (the plan keeps every activation)");
  }
  if (s.flash_attention && !estimator::TransformersRunsSdpa(inventory.model_type)) {
    out.push_back(inventory.model_type +
                  " has no SDPA path in Transformers: eager attention was assumed, "
                  "attn_implementation=\"eager\" (\"flash_attention_2\" needs less memory than "
                  "planned)");
  } else {
    out.push_back(s.flash_attention
                      ? "use memory-efficient attention: attn_implementation=\"sdpa\" (or "
                        "\"flash_attention_2\") when loading the model"
                      : "eager attention was assumed (memory-efficient attention off): "
                        "attn_implementation=\"eager\"");
  }
  const std::string precision = s.precision == Precision::kFp16Mixed ? "fp16=True"
                                : s.precision == Precision::kFp32    ? "neither bf16 nor fp16"
                                                                     : "bf16=True";
  out.push_back(std::string(for_hf_trainer ? "Hugging Face Trainer (the DeepSpeed file says "
                                             "\"auto\"): "
                                           : "Hugging Face Trainer: ") +
                "per_device_train_batch_size=" + std::to_string(s.micro_batch) +
                ", gradient_accumulation_steps=" + std::to_string(s.grad_accum) + ", " + precision);
  if (s.optimizer == Optimizer::kAdam8bit) {
    out.push_back(
        "use bitsandbytes' 8-bit AdamW: TrainingArguments(optim=\"adamw_bnb_8bit\") or "
        "bnb.optim.AdamW8bit");
  }
  if (s.lora_rank > 0) {
    out.push_back("wrap the model with PEFT LoRA r=" + std::to_string(s.lora_rank) +
                  (s.qlora ? " over a 4-bit base (BitsAndBytesConfig(load_in_4bit=True, "
                             "bnb_4bit_quant_type=\"nf4\"))"
                           : ""));
  }
  (void)inventory;
  return out;
}

std::string AttnImplementation(const TrainingSetup& s, const estimator::ModelInventory& inventory) {
  return s.flash_attention && estimator::TransformersRunsSdpa(inventory.model_type) ? "sdpa"
                                                                                    : "eager";
}

nlohmann::json TrainerSettingsJson(const Plan& plan, const estimator::ModelInventory& inventory) {
  const TrainingSetup& s = plan.setup;
  nlohmann::json j = {
      {"gradient_checkpointing", s.checkpointing != Checkpointing::kNone},
      {"attn_implementation", AttnImplementation(s, inventory)},
      {"per_device_train_batch_size", s.micro_batch},
      {"gradient_accumulation_steps", s.grad_accum},
      {"bf16", s.precision == Precision::kBf16Mixed || s.precision == Precision::kBf16Pure},
      {"fp16", s.precision == Precision::kFp16Mixed}};
  if (s.optimizer == Optimizer::kAdam8bit) j["optim"] = "adamw_bnb_8bit";
  (void)inventory;
  return j;
}

nlohmann::json ToJson(const Plan& p) {
  return {{"family", p.family},
          {"zero_stage", p.setup.zero_stage},
          {"sharding", p.sharding == Sharding::kHybrid ? "hybrid" : "full"},
          {"optimizer", std::string(OptimizerName(p.setup.optimizer))},
          {"offload_optimizer", std::string(OffloadDeviceName(p.setup.offload_optimizer))},
          {"offload_param", std::string(OffloadDeviceName(p.setup.offload_param))},
          {"activation_checkpointing", std::string(CheckpointingName(p.setup.checkpointing))},
          {"micro_batch", p.setup.micro_batch},
          {"grad_accum", p.setup.grad_accum},
          {"pin_memory", p.setup.pin_memory},
          {"buffers", p.buffers},
          {"gpu_bytes", p.peak.gpu_bytes},
          {"gpu_capacity_bytes", p.gpu_capacity_bytes},
          {"gpu_headroom_bytes", p.HeadroomBytes()},
          {"cpu_bytes", p.peak.cpu_bytes},
          {"nvme_bytes", p.peak.nvme_bytes},
          {"pinned_bytes", p.peak.pinned_bytes},
          {"peak_phase", p.peak.phase},
          {"step_time_s", p.time.total_s},
          {"time", p.time},
          {"tokens_per_s", p.tokens_per_s},
          {"mfu", p.mfu},
          {"hfu", p.hfu},
          {"buckets",
           {{"reduce_bucket_size", p.setup.reduce_bucket_size},
            {"allgather_bucket_size", p.setup.allgather_bucket_size},
            {"stage3_prefetch_bucket_size", p.setup.stage3_prefetch_bucket_size},
            {"stage3_param_persistence_threshold", p.setup.stage3_param_persistence_threshold},
            {"stage3_max_live_parameters", p.setup.stage3_max_live_parameters},
            {"sub_group_size", p.setup.sub_group_size},
            {"param_buffer_size", p.setup.param_buffer_size},
            {"param_buffer_count", p.setup.param_buffer_count},
            {"optimizer_buffer_count", p.setup.optimizer_buffer_count}}},
          {"why", p.why}};
}

nlohmann::json ToJson(const PlanResult& r, const Cluster& cluster, const Job& job) {
  nlohmann::json plans = nlohmann::json::array();
  for (const Plan& p : r.plans) {
    nlohmann::json j = ToJson(p);
    j["tokens_per_s_per_gpu"] = p.tokens_per_s / static_cast<double>(cluster.WorldSize());
    plans.push_back(j);
  }
  nlohmann::json rejected = nlohmann::json::array();
  for (const Rejection& x : r.rejected) {
    nlohmann::json j = {{"plan", x.plan}, {"reason", x.reason}};
    if (x.over_ratio > 0) {
      j["over_ratio"] = x.over_ratio;
      j["tier"] = x.tier;
    }
    rejected.push_back(j);
  }
  return {{"cluster", ToJson(cluster)},
          {"job", ToJson(job, r.seq_len)},
          {"plans", plans},
          {"rejected", rejected},
          {"suggestions", r.suggestions},
          {"gaps", r.gaps},
          {"host_ram_checked", r.host_ram_checked},
          {"assumptions", r.assumptions},
          {"configurations", r.configurations},
          {"grid_size", r.grid_size}};
}

nlohmann::json PlanReportJson(const PlanResult& result, const Cluster& cluster, const Job& job,
                              const estimator::ModelInventory& inventory, size_t top,
                              size_t plan_index, bool for_hf_trainer) {
  nlohmann::json j = ToJson(result, cluster, job);
  if (j["plans"].size() > top) {
    nlohmann::json kept = nlohmann::json::array();
    for (size_t i = 0; i < top; ++i) kept.push_back(j["plans"][i]);
    j["plans"] = kept;
  }
  if (plan_index < result.plans.size()) {
    const Plan& chosen = result.plans[plan_index];
    j["trainer"] = TrainerSettingsJson(chosen, inventory);
    j["trainer"]["plan_index"] = plan_index + 1;
    j["trainer"]["notes"] = TrainerSettings(chosen, inventory, for_hf_trainer);
  }
  return j;
}

std::string FormatPlanText(const PlanResult& r, const Cluster& c, const Job& job, size_t top) {
  estimator::TrainingSetup fixed = job.setup;
  fixed.seq_len = r.seq_len;
  std::string out = estimator::SetupLine(fixed, /*searched=*/true) + "\n";
  // The model, GPU and path names come from the user's files and flags: escaped.
  out += "Plans for " + Printable(job.model) + " on " + std::to_string(c.nodes) + " node(s) x " +
         std::to_string(c.gpus_per_node) + " " + Printable(c.gpu.name) + " (" +
         GiB(c.gpu.memory_bytes) + " GiB)";
  out += c.cpu_memory_bytes > 0 ? ", " + GiB(c.cpu_memory_bytes) + " GiB RAM per node"
                                : std::string(", host RAM not checked");
  if (!c.nvme_path.empty()) out += ", NVMe at " + Printable(c.nvme_path);
  out += "\nGlobal batch " + std::to_string(job.global_batch) + " x " + std::to_string(r.seq_len) +
         " tokens; " + std::to_string(r.grid_size) + " configurations, " +
         std::to_string(r.configurations) + " evaluated (the rest cannot fit).\n\n";
  if (r.plans.empty()) {
    out += "No configuration fits.\n";
  } else {
    char line[512];
    std::snprintf(line, sizeof(line), "%-3s %-40s %-9s %4s %4s %8s %8s %8s %8s %10s %5s\n", "#",
                  "plan", "ckpt", "mb", "ga", "GPU GiB", "CPU GiB", "NVMe GiB", "step s",
                  "tok/s/GPU", "MFU");
    out += line;
    for (size_t i = 0; i < r.plans.size() && i < top; ++i) {
      const Plan& p = r.plans[i];
      std::snprintf(line, sizeof(line),
                    "%-3zu %-40s %-9s %4lld %4lld %8s %8s %8s %8.2f %10.0f %4.0f%%\n", i + 1,
                    p.family.c_str(), CheckpointLabel(p.setup).c_str(),
                    static_cast<long long>(p.setup.micro_batch),
                    static_cast<long long>(p.setup.grad_accum), GiB(p.peak.gpu_bytes).c_str(),
                    GiB(p.peak.cpu_bytes).c_str(), GiB(p.peak.nvme_bytes).c_str(), p.time.total_s,
                    p.tokens_per_s / static_cast<double>(c.WorldSize()), p.mfu * 100);
      out += line;
    }
    out += "\n";
    for (size_t i = 0; i < r.plans.size() && i < top; ++i) {
      const Plan& p = r.plans[i];
      std::snprintf(line, sizeof(line),
                    "%zu. step %.2f s = compute %.2f + comm %.2f + offload %.2f + optimizer %.2f "
                    "(MFU %.0f%%, HFU %.0f%%)\n   ",
                    i + 1, p.time.total_s, p.time.compute_s, p.time.exposed_comm_s,
                    p.time.exposed_offload_s, p.time.exposed_optimizer_s, p.mfu * 100, p.hfu * 100);
      out += line + p.why + "\n";
    }
  }
  if (!r.rejected.empty()) {
    out += r.plans.empty() ? "\nRejected (closest to fitting first):\n" : "\nRejected:\n";
    for (const Rejection& x : r.rejected) out += "  " + x.plan + ": " + x.reason + "\n";
  }
  if (!r.suggestions.empty()) {
    out += "\nWhat would make it fit:\n";
    for (const std::string& s : r.suggestions) out += "  - " + s + "\n";
  }
  if (!r.gaps.empty()) {
    out += "\nNot checked:\n";
    for (const std::string& g : r.gaps) out += "  - " + g + "\n";
  }
  out += "\nAssumptions:\n";
  for (const std::string& a : r.assumptions) out += "  - " + a + "\n";
  return out;
}

}  // namespace memplan::planner
