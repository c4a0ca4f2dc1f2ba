#include "planner/search.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>

#include "estimator/estimate.h"

namespace memplan::planner {
namespace {

using estimator::Checkpointing;
using estimator::OffloadDevice;
using estimator::Precision;
using estimator::TrainingSetup;

constexpr double kCommEfficiency = 0.7;        // NCCL bus bandwidth / link peak
constexpr double kSmallBatchTokens = 256;      // b s / (b s + 256) efficiency factor
constexpr double kZero3ComputeOverhead = 1.1;  // per-layer gather/release hooks
constexpr double kUnpinnedFactor = 0.5;        // pageable host memory: half the PCIe rate

std::string Fmt(const char* format, double v) {
  char text[64];
  std::snprintf(text, sizeof(text), format, v);
  return text;
}

std::string GiB(uint64_t bytes) { return Fmt("%.1f", static_cast<double>(bytes) / 0x1p30); }

double PeakFlops(const GpuSpec& gpu, Precision precision) {
  switch (precision) {
    case Precision::kFp32: return gpu.fp32_flops > 0 ? gpu.fp32_flops : gpu.fp16_flops / 8;
    case Precision::kFp16Mixed: return gpu.fp16_flops;
    case Precision::kBf16Mixed:
    case Precision::kBf16Pure: return gpu.bf16_flops;
  }
  return gpu.fp16_flops;
}

double FlopsPerToken(const TimeModelInputs& m, const TrainingSetup& s, bool lora) {
  const double attention = 12 * m.layers * m.hidden * m.seq_len;
  double f = (lora ? 4 : 6) * m.params + attention;
  if (s.checkpointing == Checkpointing::kFull) f += 2 * m.params + attention / 3;
  if (s.checkpointing == Checkpointing::kSelective) f += attention / 3;
  return f;
}

}  // namespace

Status SearchOptions::Validate() const {
  auto fraction = [](double v, const char* name) -> Status {
    if (!(v >= 0 && v < 1)) {
      return Status::InvalidArgument(std::string(name) + " must be in [0, 1)");
    }
    return Status::Ok();
  };
  MEMPLAN_RETURN_IF_ERROR(fraction(gpu_safety_fraction, "--gpu-margin"));
  MEMPLAN_RETURN_IF_ERROR(fraction(1 - cpu_usable_fraction, "CPU usable fraction"));
  MEMPLAN_RETURN_IF_ERROR(fraction(1 - pinned_fraction, "pinned fraction"));
  MEMPLAN_RETURN_IF_ERROR(fraction(1 - nvme_usable_fraction, "NVMe usable fraction"));
  if (only_stage < -1 || only_stage > 3) {
    return Status::InvalidArgument("--zero-stage must be 0-3");
  }
  return Status::Ok();
}

std::string FamilyName(int stage, OffloadDevice optimizer, OffloadDevice param) {
  auto where = [](OffloadDevice d) { return d == OffloadDevice::kCpu ? "CPU" : "NVMe"; };
  std::string name = stage == 0 ? "ZeRO-0 (DDP)" : "ZeRO-" + std::to_string(stage);
  if (optimizer != OffloadDevice::kNone) name += std::string(" + optimizer on ") + where(optimizer);
  if (param != OffloadDevice::kNone) name += std::string(" + params on ") + where(param);
  return name;
}

StepTime PredictStepTime(const TimeModelInputs& m, const Cluster& c, const TrainingSetup& s,
                         int64_t global_batch, bool pinned) {
  StepTime t;
  const bool lora = s.lora_rank > 0;
  const double d = static_cast<double>(c.WorldSize());
  const double nodes = static_cast<double>(c.nodes);
  const double ga = static_cast<double>(s.grad_accum);
  const double w = s.precision == Precision::kFp32 ? 4 : 2;
  const double tokens_per_gpu = static_cast<double>(global_batch) * m.seq_len / d;
  const double micro_tokens = static_cast<double>(s.micro_batch) * m.seq_len;
  const double efficiency =
      c.gpu.mfu_prior * micro_tokens / (micro_tokens + kSmallBatchTokens);
  t.compute_s = tokens_per_gpu * FlopsPerToken(m, s, lora) /
                (PeakFlops(c.gpu, s.precision) * efficiency);
  if (s.zero_stage == 3) t.compute_s *= kZero3ComputeOverhead;
  const double recompute_share =
      s.checkpointing == Checkpointing::kFull ? 0.25 : 0.0;  // recompute runs inside backward
  const double backward_s = t.compute_s * (2.0 / 3.0 + recompute_share / 3.0);

  // Collectives.
  double link = c.gpu.link_bytes_per_s;
  if (c.nodes > 1) link = std::min(link, c.inter_node_bytes_per_s);
  link *= kCommEfficiency;
  const double f = d > 1 ? (d - 1) / d : 0;
  const double grads = m.trainable * w;
  const double params = m.params * w;
  double comm_overlapped = 0, comm_serial = 0, comm_window = backward_s;
  if (f > 0) {
    switch (s.zero_stage) {
      case 0: comm_overlapped = 2 * f * grads / link; break;
      case 1:
        comm_overlapped = f * grads / link;
        comm_serial = f * grads / link;
        break;
      case 2:
        comm_overlapped = ga * f * grads / link;
        comm_serial = f * grads / link;
        break;
      default:
        comm_overlapped = ga * f * (2 * params + grads) / link;
        comm_window = t.compute_s;
        break;
    }
  }
  t.comm_s = comm_overlapped + comm_serial;

  // PCIe and NVMe.
  const double pcie = c.PcieBytesPerS() * (pinned ? 1.0 : kUnpinnedFactor);
  const double grad_partition = grads / d;
  const double param_partition = params / d;
  double pcie_backward = 0, pcie_forward = 0, pcie_serial = 0;
  if (s.offload_optimizer != OffloadDevice::kNone) {
    pcie_backward += ga * grad_partition / pcie;
    pcie_serial += grad_partition / pcie;  // updated 16-bit parameters up after the step
  }
  if (s.offload_param != OffloadDevice::kNone) {
    pcie_forward += ga * 2 * param_partition / pcie;
  }
  t.pcie_s = pcie_backward + pcie_forward + pcie_serial;

  const double per_node_trainable = m.trainable / nodes;
  double optimizer_s = 0, nvme_optimizer_s = 0, nvme_param_read = 0, nvme_param_write = 0;
  if (s.offload_optimizer != OffloadDevice::kNone) {
    optimizer_s = per_node_trainable / c.CpuAdamParamsPerS();
  }
  if (s.offload_optimizer == OffloadDevice::kNvme) {
    const bool mixed = s.precision == Precision::kFp16Mixed || s.precision == Precision::kBf16Mixed;
    const double state_bytes =
        (mixed ? 4 : 0) + (s.optimizer == estimator::Optimizer::kLion ? 4 : 8);
    const double bytes = per_node_trainable * state_bytes;
    nvme_optimizer_s = bytes / c.NvmeReadBytesPerS() + bytes / c.NvmeWriteBytesPerS();
  }
  if (s.offload_param == OffloadDevice::kNvme) {
    const double node_params = params / nodes;
    nvme_param_read = ga * 2 * node_params / c.NvmeReadBytesPerS();
    nvme_param_write = node_params / c.NvmeWriteBytesPerS();
  }
  t.optimizer_s = optimizer_s;
  t.nvme_s = nvme_optimizer_s + nvme_param_read + nvme_param_write;

  // Overlap: each overlapped component adds what exceeds its window; only the largest excess
  // counts, since they run on different links.
  const double comm_excess = std::max(0.0, comm_overlapped - comm_window);
  const double pcie_excess = std::max(0.0, pcie_backward - backward_s) +
                             std::max(0.0, pcie_forward - t.compute_s);
  const double nvme_excess = std::max(0.0, nvme_param_read - t.compute_s);
  const double excess = std::max({comm_excess, pcie_excess, nvme_excess});
  t.exposed_comm_s = comm_serial + (excess == comm_excess ? comm_excess : 0);
  t.exposed_offload_s = pcie_serial + nvme_param_write +
                        (excess != comm_excess || comm_excess == 0
                             ? std::max(pcie_excess, nvme_excess) * (excess > 0 ? 1 : 0)
                             : 0);
  t.exposed_optimizer_s = std::max(optimizer_s, nvme_optimizer_s);
  t.total_s = t.compute_s + excess + comm_serial + pcie_serial + nvme_param_write +
              t.exposed_optimizer_s;
  // Recompute the split so that the parts add up to total_s exactly.
  t.exposed_offload_s =
      std::max(0.0, t.total_s - t.compute_s - t.exposed_comm_s - t.exposed_optimizer_s);

  struct Part {
    const char* name;
    double seconds;
  };
  const Part parts[] = {
      {"compute", t.compute_s},
      {"communication", t.exposed_comm_s},
      {"PCIe", pcie_serial + pcie_excess * (excess == pcie_excess && excess > 0 ? 1 : 0)},
      {"CPU optimizer", optimizer_s >= nvme_optimizer_s ? optimizer_s : 0},
      {"NVMe", (nvme_optimizer_s > optimizer_s ? nvme_optimizer_s : 0) + nvme_param_write +
                   (excess == nvme_excess && excess > 0 ? nvme_excess : 0)},
  };
  const Part* top = &parts[0];
  for (const Part& p : parts) {
    if (p.seconds > top->seconds) top = &p;
  }
  t.bound = top->name;
  return t;
}

namespace {

struct Limits {
  uint64_t gpu = 0;
  uint64_t cpu = 0;     // 0: unknown, unchecked
  uint64_t pinned = 0;  // 0: unchecked
  uint64_t nvme = 0;    // 0: unknown capacity, unchecked
};

// Empty when `peak` fits; otherwise why not.
std::string Misfit(const estimator::PeakMemory& peak, const Limits& limits, const Cluster& c,
                   const TrainingSetup& s, bool* pinned_only) {
  *pinned_only = false;
  if (peak.gpu_bytes > limits.gpu) {
    return "needs " + GiB(peak.gpu_bytes) + " GiB per GPU, has " + GiB(limits.gpu) +
           " usable of " + GiB(c.gpu.memory_bytes);
  }
  if (limits.cpu > 0 && peak.cpu_bytes > limits.cpu) {
    return "needs " + GiB(peak.cpu_bytes) + " GiB of CPU memory per node, has " +
           GiB(limits.cpu) + " usable of " + GiB(c.cpu_memory_bytes);
  }
  const bool nvme = s.offload_optimizer == OffloadDevice::kNvme ||
                    s.offload_param == OffloadDevice::kNvme;
  if (nvme && limits.nvme > 0 && peak.nvme_bytes > limits.nvme) {
    return "needs " + GiB(peak.nvme_bytes) + " GiB of NVMe per node, has " + GiB(limits.nvme) +
           " usable of " + GiB(c.nvme_capacity_bytes);
  }
  if (limits.pinned > 0 && peak.pinned_bytes > limits.pinned) {
    *pinned_only = true;
    return "needs " + GiB(peak.pinned_bytes) + " GiB of pinned memory per node, has " +
           GiB(limits.pinned) + " (half the RAM)";
  }
  if (nvme && c.memlock_bytes > 0 && peak.pinned_bytes / c.gpus_per_node > c.memlock_bytes) {
    *pinned_only = true;
    return "needs " + GiB(peak.pinned_bytes / c.gpus_per_node) +
           " GiB of locked memory per process, RLIMIT_MEMLOCK is " + GiB(c.memlock_bytes);
  }
  return "";
}

std::string CheckpointPhrase(Checkpointing c) {
  switch (c) {
    case Checkpointing::kNone: return "no recomputation";
    case Checkpointing::kSelective: return "selective recomputation";
    case Checkpointing::kFull: return "full activation checkpointing";
  }
  return "";
}

std::string PlacePhrase(const TrainingSetup& s) {
  if (s.offload_optimizer == OffloadDevice::kNone && s.offload_param == OffloadDevice::kNone) {
    return s.zero_stage == 0 ? "keeps a full replica on every GPU"
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

// Why `plan` ranks where it does, against the best plan.
std::string Explain(const Plan& plan, const Plan* best, const Cluster& c) {
  const StepTime& t = plan.time;
  std::string why = plan.family + " " + PlacePhrase(plan.setup) + " (" + GiB(plan.peak.gpu_bytes) +
                    " of " + GiB(plan.gpu_capacity_bytes) + " GiB usable per GPU) at micro-batch " +
                    std::to_string(plan.setup.micro_batch) + " x " +
                    std::to_string(plan.setup.grad_accum) + " accumulation with " +
                    CheckpointPhrase(plan.setup.checkpointing) + "; the " +
                    Fmt("%.2f", t.total_s) + " s step is " +
                    Fmt("%.0f", 100 * t.compute_s / t.total_s) + "% compute";
  if (t.bound != "compute") why += ", bound by " + t.bound;
  why += ".";
  if (best == nullptr || best == &plan) {
    why += " Fastest that fits";
    if (plan.setup.zero_stage == 3 && plan.setup.offload_optimizer == OffloadDevice::kNone &&
        plan.setup.offload_param == OffloadDevice::kNone) {
      why += ": lower stages do not fit or need more recomputation";
    } else if (plan.setup.offload_optimizer != OffloadDevice::kNone ||
               plan.setup.offload_param != OffloadDevice::kNone) {
      why += ": nothing without this offload fits " + std::to_string(c.WorldSize()) + " x " +
             c.gpu.name;
    }
    return why + ".";
  }
  const StepTime& b = best->time;
  struct Delta {
    const char* what;
    double seconds;
  };
  const Delta deltas[] = {
      {"more compute (recomputation or a smaller micro-batch)", t.compute_s - b.compute_s},
      {"more exposed communication", t.exposed_comm_s - b.exposed_comm_s},
      {"host/NVMe transfers", t.exposed_offload_s - b.exposed_offload_s},
      {"the CPU optimizer step", t.exposed_optimizer_s - b.exposed_optimizer_s},
  };
  const Delta* top = &deltas[0];
  for (const Delta& d : deltas) {
    if (d.seconds > top->seconds) top = &d;
  }
  why += " " + Fmt("%.2f", t.total_s / b.total_s) + "x the best step time, mostly " + top->what +
         " (+" + Fmt("%.2f", top->seconds) + " s).";
  return why;
}

}  // namespace

Result<PlanResult> SearchPlans(const estimator::ModelInventory& inventory, const Cluster& cluster,
                               const Job& job, const SearchOptions& options) {
  MEMPLAN_RETURN_IF_ERROR(cluster.Validate());
  MEMPLAN_RETURN_IF_ERROR(options.Validate());
  MEMPLAN_RETURN_IF_ERROR(job.ValidateFor(inventory));
  if (PeakFlops(cluster.gpu, job.setup.precision) <= 0) {
    return Status::InvalidArgument("--precision " +
                                   std::string(estimator::PrecisionName(job.setup.precision)) +
                                   ": " + cluster.gpu.name +
                                   " has no bf16 support; use --precision fp16-mixed");
  }
  const int64_t world = cluster.WorldSize();
  if (job.global_batch % world != 0) {
    return Status::InvalidArgument("--global-batch " + std::to_string(job.global_batch) +
                                   " is not a multiple of the " + std::to_string(world) +
                                   " GPUs (train_batch_size = micro-batch x accumulation x GPUs)");
  }
  const int64_t per_gpu = job.global_batch / world;
  std::vector<int64_t> micro_batches;
  for (int64_t b = 1; b <= per_gpu; ++b) {
    if (per_gpu % b == 0) micro_batches.push_back(b);
  }

  const estimator::ArchitectureInfo& arch = *inventory.arch;
  MEMPLAN_ASSIGN_OR_RETURN(estimator::ModelCounts counts, estimator::CountParams(inventory));

  Limits limits;
  limits.gpu = static_cast<uint64_t>(static_cast<double>(cluster.gpu.memory_bytes) *
                                     (1 - options.gpu_safety_fraction));
  if (cluster.cpu_memory_bytes > 0) {
    const double usable = static_cast<double>(cluster.cpu_memory_bytes) *
                              options.cpu_usable_fraction -
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

  PlanResult result;
  TimeModelInputs model;
  model.params = static_cast<double>(counts.params_total);
  model.layers = static_cast<double>(arch.layers + arch.decoder_layers);
  model.hidden = static_cast<double>(arch.hidden);

  struct Family {
    int stage;
    OffloadDevice opt, param;
  };
  std::vector<Family> families;
  const OffloadDevice devices[] = {OffloadDevice::kNone, OffloadDevice::kCpu, OffloadDevice::kNvme};
  for (int stage = 0; stage <= 3; ++stage) {
    if (options.only_stage >= 0 && stage != options.only_stage) continue;
    for (OffloadDevice opt : devices) {
      for (OffloadDevice param : devices) {
        // Combinations DeepSpeed has no code for are not families at all.
        if (param != OffloadDevice::kNone && stage != 3) continue;
        if (opt != OffloadDevice::kNone && stage == 0) continue;
        if (opt == OffloadDevice::kNvme && stage != 3) continue;
        families.push_back({stage, opt, param});
      }
    }
  }
  const Checkpointing checkpointings[] = {Checkpointing::kNone, Checkpointing::kSelective,
                                          Checkpointing::kFull};
  result.grid_size = static_cast<int64_t>(families.size() * 3 * micro_batches.size());

  for (const Family& family : families) {
    const std::string name = FamilyName(family.stage, family.opt, family.param);
    const bool uses_nvme =
        family.opt == OffloadDevice::kNvme || family.param == OffloadDevice::kNvme;
    if (uses_nvme && (cluster.nvme_path.empty() || !options.allow_nvme)) {
      result.rejected.push_back({name, "no NVMe drive given (--nvme-path)"});
      continue;
    }
    TrainingSetup base = job.setup;
    base.zero_stage = family.stage;
    base.offload_optimizer = family.opt;
    base.offload_param = family.param;
    base.gpus_per_node = cluster.gpus_per_node;
    base.num_nodes = cluster.nodes;
    base.tp = 1;
    base.pin_memory = family.opt != OffloadDevice::kNone || family.param != OffloadDevice::kNone;
    if (cluster.aio_block_size > 0) base.aio_block_size = cluster.aio_block_size;
    if (cluster.aio_queue_depth > 0) base.aio_queue_depth = cluster.aio_queue_depth;
    if (cluster.aio_intra_op_parallelism > 0) {
      base.aio_intra_op_parallelism = cluster.aio_intra_op_parallelism;
    }
    if (Status valid = base.Validate(); !valid.ok()) {
      result.rejected.push_back({name, valid.message()});
      continue;
    }
    std::optional<Plan> best;
    std::string tightest_reason;  // from the smallest configuration: mb 1, full checkpointing
    for (Checkpointing ckpt : checkpointings) {
      for (int64_t mb : micro_batches) {
        TrainingSetup s = base;
        s.checkpointing = ckpt;
        s.micro_batch = mb;
        s.grad_accum = per_gpu / mb;
        ++result.configurations;
        MEMPLAN_ASSIGN_OR_RETURN(estimator::MemoryEstimate m, estimator::EstimateMemory(inventory, s, counts));
        if (result.seq_len == 0) result.seq_len = m.setup.seq_len;
        bool pinned_only = false;
        std::string misfit = Misfit(m.peak, limits, cluster, s, &pinned_only);
        if (!misfit.empty() && pinned_only && s.pin_memory) {
          // Try again without pinned host buffers (slower transfers).
          TrainingSetup unpinned = s;
          unpinned.pin_memory = false;
          MEMPLAN_ASSIGN_OR_RETURN(m, estimator::EstimateMemory(inventory, unpinned, counts));
          std::string again = Misfit(m.peak, limits, cluster, unpinned, &pinned_only);
          if (again.empty()) s = unpinned;
          misfit = again;
        }
        if (!misfit.empty()) {
          if (ckpt == Checkpointing::kFull && mb == 1) tightest_reason = misfit;
          break;  // a larger micro-batch needs more memory still
        }
        model.seq_len = static_cast<double>(m.setup.seq_len);
        model.trainable = static_cast<double>(m.trainable_params);
        Plan plan;
        plan.setup = m.setup;
        plan.peak = m.peak;
        plan.gpu_capacity_bytes = limits.gpu;
        plan.time = PredictStepTime(model, cluster, plan.setup, job.global_batch, s.pin_memory);
        plan.tokens_per_s =
            static_cast<double>(job.global_batch) * model.seq_len / plan.time.total_s;
        plan.mfu = 6 * model.params * plan.tokens_per_s /
                   (PeakFlops(cluster.gpu, s.precision) * static_cast<double>(world));
        plan.family = name;
        // Ties (within 0.1%) go to less recomputation, then the smaller micro-batch.
        if (!best || plan.tokens_per_s > best->tokens_per_s * 1.001) best = plan;
      }
    }
    if (best) {
      result.plans.push_back(*best);
    } else {
      result.rejected.push_back({name, tightest_reason.empty()
                                           ? "does not fit even at micro-batch 1 with full "
                                             "checkpointing"
                                           : tightest_reason});
    }
  }
  // Fastest first; ties to the simpler plan (lower stage, less offload: the order generated).
  std::stable_sort(result.plans.begin(), result.plans.end(), [](const Plan& a, const Plan& b) {
    return a.tokens_per_s > b.tokens_per_s * 1.001;
  });
  for (Plan& plan : result.plans) {
    plan.why = Explain(plan, &result.plans.front(), cluster);
  }
  result.assumptions = {
      "Fit: GPU peak (CUDA context and 10% allocator margin included) <= GPU memory less " +
          Fmt("%.0f", options.gpu_safety_fraction * 100) +
          "%; CPU per node <= " + Fmt("%.0f", options.cpu_usable_fraction * 100) +
          "% of RAM less " + GiB(options.cpu_per_process_bytes) +
          " GiB per GPU process; pinned <= " + Fmt("%.0f", options.pinned_fraction * 100) +
          "% of RAM; NVMe <= " + Fmt("%.0f", options.nvme_usable_fraction * 100) +
          "% of capacity.",
      "Compute: 6N + 12Lhs FLOPs per token (+2N + 4Lhs full recompute, +4Lhs selective; LoRA 4N) "
      "at " + Fmt("%.0f", cluster.gpu.mfu_prior * 100) +
          "% MFU prior x bs/(bs+256); ZeRO-3 x1.1.",
      "Collectives: ring at 70% of " + Fmt("%.0f", cluster.gpu.link_bytes_per_s / 1e9) +
          " GB/s per GPU link" +
          (cluster.nodes > 1
               ? " (" + Fmt("%.0f", cluster.inter_node_bytes_per_s / 1e9) + " GB/s between nodes)"
               : std::string()) +
          "; ZeRO-3 moves 1.5x the data of ZeRO-1/2 per micro-batch.",
      "PCIe Gen" + std::to_string(cluster.PcieGen()) + ": " +
          Fmt("%.1f", cluster.PcieBytesPerS() / 1e9) +
          " GB/s per GPU pinned, half unpinned; CPU Adam " +
          Fmt("%.2g", cluster.CpuAdamParamsPerS()) + " params/s per node (" +
          cluster.cpu_adam_source + "); NVMe " + Fmt("%.1f", cluster.NvmeReadBytesPerS() / 1e9) +
          " / " + Fmt("%.1f", cluster.NvmeWriteBytesPerS() / 1e9) + " GB/s read / write (" +
          cluster.nvme_bandwidth_source + ").",
      "Overlap: gradient reduction hides behind backward, ZeRO-3 gathers and parameter fetches "
      "behind compute; the optimizer step, the post-step all-gather and parameter upload are "
      "serial.",
  };
  return result;
}

nlohmann::json ToJson(const Plan& p) {
  return {{"family", p.family},
          {"zero_stage", p.setup.zero_stage},
          {"offload_optimizer", std::string(OffloadDeviceName(p.setup.offload_optimizer))},
          {"offload_param", std::string(OffloadDeviceName(p.setup.offload_param))},
          {"activation_checkpointing", std::string(CheckpointingName(p.setup.checkpointing))},
          {"micro_batch", p.setup.micro_batch},
          {"grad_accum", p.setup.grad_accum},
          {"pin_memory", p.setup.pin_memory},
          {"gpu_bytes", p.peak.gpu_bytes},
          {"gpu_capacity_bytes", p.gpu_capacity_bytes},
          {"cpu_bytes", p.peak.cpu_bytes},
          {"nvme_bytes", p.peak.nvme_bytes},
          {"pinned_bytes", p.peak.pinned_bytes},
          {"peak_phase", p.peak.phase},
          {"step_time_s", p.time.total_s},
          {"time",
           {{"compute_s", p.time.compute_s},
            {"comm_s", p.time.comm_s},
            {"pcie_s", p.time.pcie_s},
            {"optimizer_s", p.time.optimizer_s},
            {"nvme_s", p.time.nvme_s},
            {"exposed_comm_s", p.time.exposed_comm_s},
            {"exposed_offload_s", p.time.exposed_offload_s},
            {"exposed_optimizer_s", p.time.exposed_optimizer_s},
            {"bound", p.time.bound}}},
          {"tokens_per_s", p.tokens_per_s},
          {"mfu", p.mfu},
          {"why", p.why}};
}

nlohmann::json ToJson(const PlanResult& r, const Cluster& cluster, const Job& job) {
  nlohmann::json plans = nlohmann::json::array();
  for (const Plan& p : r.plans) plans.push_back(ToJson(p));
  nlohmann::json rejected = nlohmann::json::array();
  for (const Rejection& x : r.rejected) rejected.push_back({{"plan", x.plan}, {"reason", x.reason}});
  return {{"cluster", ToJson(cluster)}, {"job", ToJson(job, r.seq_len)},
          {"plans", plans},             {"rejected", rejected},
          {"assumptions", r.assumptions}, {"configurations", r.configurations},
          {"grid_size", r.grid_size}};
}

std::string FormatPlanText(const PlanResult& r, const Cluster& c, const Job& job, size_t top) {
  estimator::TrainingSetup fixed = job.setup;
  fixed.seq_len = r.seq_len;
  std::string out = estimator::SetupLine(fixed, /*searched=*/true) + "\n";
  out += "Plans for " + job.model + " on " + std::to_string(c.nodes) + " node(s) x " +
                    std::to_string(c.gpus_per_node) + " " + c.gpu.name + " (" +
                    GiB(c.gpu.memory_bytes) + " GiB)";
  if (c.cpu_memory_bytes > 0) out += ", " + GiB(c.cpu_memory_bytes) + " GiB RAM per node";
  if (!c.nvme_path.empty()) out += ", NVMe at " + c.nvme_path;
  out += "\nGlobal batch " + std::to_string(job.global_batch) + " x " + std::to_string(r.seq_len) +
         " tokens; " + std::to_string(r.grid_size) + " configurations, " +
         std::to_string(r.configurations) + " evaluated (the rest cannot fit).\n\n";
  if (r.plans.empty()) {
    out += "No configuration fits.\n";
  } else {
    char line[512];
    std::snprintf(line, sizeof(line), "%-3s %-38s %-9s %4s %4s %9s %9s %9s %8s %10s\n", "#",
                  "plan", "ckpt", "mb", "ga", "GPU GiB", "CPU GiB", "NVMe GiB", "step s",
                  "tokens/s");
    out += line;
    for (size_t i = 0; i < r.plans.size() && i < top; ++i) {
      const Plan& p = r.plans[i];
      std::snprintf(line, sizeof(line), "%-3zu %-38s %-9s %4lld %4lld %9s %9s %9s %8.2f %10.0f\n",
                    i + 1, p.family.c_str(),
                    std::string(CheckpointingName(p.setup.checkpointing)).c_str(),
                    static_cast<long long>(p.setup.micro_batch),
                    static_cast<long long>(p.setup.grad_accum), GiB(p.peak.gpu_bytes).c_str(),
                    GiB(p.peak.cpu_bytes).c_str(), GiB(p.peak.nvme_bytes).c_str(),
                    p.time.total_s, p.tokens_per_s);
      out += line;
    }
    out += "\n";
    for (size_t i = 0; i < r.plans.size() && i < top; ++i) {
      const Plan& p = r.plans[i];
      std::snprintf(line, sizeof(line),
                    "%zu. step %.2f s = compute %.2f + comm %.2f + offload %.2f + optimizer %.2f "
                    "(MFU %.0f%%)\n   ",
                    i + 1, p.time.total_s, p.time.compute_s, p.time.exposed_comm_s,
                    p.time.exposed_offload_s, p.time.exposed_optimizer_s, p.mfu * 100);
      out += line + p.why + "\n";
    }
  }
  if (!r.rejected.empty()) {
    out += "\nRejected:\n";
    for (const Rejection& x : r.rejected) out += "  " + x.plan + ": " + x.reason + "\n";
  }
  out += "\nAssumptions:\n";
  for (const std::string& a : r.assumptions) out += "  - " + a + "\n";
  return out;
}

}  // namespace memplan::planner
