// The planner's search: every ZeRO stage (0-3) x optimizer offload {none, cpu, nvme} x parameter
// offload {none, cpu, nvme} x activation checkpointing {none, selective, full} x micro-batch (with
// gradient accumulation making up the global batch), checked for fit with the estimator's full
// memory model (estimator/memory_model.h) and timed with the step-time model below; the fastest
// configuration of each family (stage + offload) that fits, ranked by tokens per second, and for
// each family that cannot run, why.
//
// Note [Feasibility]
// A configuration fits when, at its peak phase, (a) the estimator's GPU bytes (which already hold
// the CUDA context and a 10% allocator margin) are at most the GPU's memory less
// gpu_safety_fraction (5%: NCCL buffers, other processes); (b) CPU bytes per node are at most
// cpu_usable_fraction (85%) of RAM less cpu_per_process_bytes (2 GiB) per GPU process (Python,
// torch, dataloader); (c) pinned bytes are at most pinned_fraction (50%) of RAM, and NVMe swap
// buffers fit the memlock limit when one is known; if pinned host buffers do not fit, the
// configuration is tried again with pin_memory off (PCIe at half speed); (d) NVMe bytes per node
// are at most nvme_usable_fraction (90%) of the capacity, and an NVMe path is given.
//
// Note [Step-time model]
// Per optimizer step (global batch B sequences of s tokens, data-parallel degree d = GPUs):
//   compute   = (B s / d) x F / (peak x MFU x b s / (b s + 256)), F = 6N + 12 L h s FLOPs per token
//               (LoRA: 4N, no weight gradients), + 2N + 4 L h s for full recompute, + 4 L h s for
//               selective; peak is the GPU's dense bf16/fp16/TF32 figure; the b s / (b s + 256)
//               factor is the small-micro-batch efficiency loss; ZeRO-3 compute is x1.1 (per-layer
//               gather/release hooks and synchronisation).
//   collectives (ring, at 70% of the link's per-direction bandwidth; across nodes the slower of
//               the GPU link and the per-node network): with S = trainable x 2 bytes (16-bit
//               gradients) and f = (d - 1) / d: stage 0 all-reduce 2 f S once per step; stage 1
//               reduce-scatter f S once plus all-gather f S after the step; stage 2 reduce-scatter
//               f S every micro-batch plus the all-gather after the step; stage 3 all-gather of
//               the 16-bit parameters in forward and in backward plus the reduce-scatter, every
//               micro-batch (1.5x the data of stages 1/2 per micro-batch).
//   PCIe       (per GPU x16 link at 80% of 16/32/63 GB/s for Gen 3/4/5, half without pinned
//               memory): optimizer offload moves each micro-batch's 16-bit gradient partition
//               down and the updated 16-bit parameters up once per step (4 bytes/param);
//               parameter offload uploads the parameter partition in forward and in backward.
//   CPU optimizer: trainable parameters per node / the node's Adam rate (`bench adam`, or the
//               prior 5e7 params/s per core, at most 3e9 per node).
//   NVMe       (`bench nvme`, or the prior 3.2 / 2.6 GB/s read / write): optimizer offload reads
//               and writes the fp32 master weights and optimizer states once per step, pipelined
//               with the CPU optimizer (read i+1 | step i | write i-1), so that phase takes the
//               larger of the two; parameter offload reads the 16-bit parameters in forward and
//               backward and writes them after the step.
// Overlap rules: gradient reduction (stages 0-2) overlaps the backward pass (2/3 of compute);
// ZeRO-3 collectives, parameter uploads and parameter reads from NVMe overlap all of compute
// (prefetch); gradient copies to the host overlap the backward pass. Each overlapped component
// adds only what exceeds its window, and since they use different links only the largest excess
// counts. Serial: the all-gather after the step (stages 1-2), the parameter upload after an
// offloaded step, the CPU optimizer / NVMe optimizer phase, NVMe parameter writes.
//
// Thread safety: pure functions over plain values.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/status.h"
#include "estimator/inventory.h"
#include "estimator/memory_model.h"
#include "estimator/training_setup.h"
#include "planner/cluster.h"
#include "planner/job.h"

namespace memplan::planner {

// See Note [Feasibility].
struct SearchOptions {
  double gpu_safety_fraction = 0.05;       // of GPU memory kept free
  double cpu_usable_fraction = 0.85;       // of RAM usable for training state
  uint64_t cpu_per_process_bytes = uint64_t{2} << 30;  // host memory of each GPU process
  double pinned_fraction = 0.5;            // of RAM that may be pinned
  double nvme_usable_fraction = 0.9;       // of the NVMe capacity
  bool allow_nvme = true;                  // false: no NVMe offload even with a path
  // Restrict the grid (empty = all). Stage -1 = all.
  int only_stage = -1;
  Status Validate() const;
};

// Predicted step time, each part in seconds (Note [Step-time model]).
struct StepTime {
  double compute_s = 0;
  double comm_s = 0;         // collectives, total
  double pcie_s = 0;         // host <-> GPU transfers, total
  double optimizer_s = 0;    // CPU optimizer step (offloaded optimizer)
  double nvme_s = 0;         // NVMe reads and writes, total
  double exposed_comm_s = 0;     // the part of comm_s not hidden behind compute
  double exposed_offload_s = 0;  // the part of pcie_s + nvme_s not hidden (optimizer phase aside)
  double exposed_optimizer_s = 0;  // the optimizer phase: max(CPU optimizer, NVMe optimizer I/O)
  double total_s = 0;
  std::string bound;  // "compute", "communication", "PCIe", "CPU optimizer", "NVMe"
};

struct Plan {
  estimator::TrainingSetup setup;  // stage, offload, checkpointing, micro_batch, grad_accum, ...
  estimator::PeakMemory peak;
  uint64_t gpu_capacity_bytes = 0;  // usable, after the safety margin
  StepTime time;
  double tokens_per_s = 0;
  double mfu = 0;  // 6N x tokens/s / (peak FLOPs x GPUs)
  std::string family;  // "ZeRO-2", "ZeRO-3 + optimizer on CPU", ...
  std::string why;     // one or two sentences for people
};

struct Rejection {
  std::string plan;    // family name
  std::string reason;  // "needs 93.1 GiB per GPU, has 76.0 usable of 80.0"
};

struct PlanResult {
  std::vector<Plan> plans;  // best configuration of each feasible family, fastest first
  std::vector<Rejection> rejected;
  std::vector<std::string> assumptions;
  int64_t seq_len = 0;
  int64_t configurations = 0;  // grid points evaluated with the memory model
  // All grid points: families x checkpointing x micro-batches; those not evaluated were skipped
  // because a smaller micro-batch of the same family already did not fit GPU memory.
  int64_t grid_size = 0;
};

// Runs the search. Errors: an invalid cluster, job or options; a global batch the GPUs do not
// divide; bf16 on a GPU without it; estimator failures other than a setup the grid skips.
Result<PlanResult> SearchPlans(const estimator::ModelInventory& inventory, const Cluster& cluster,
                               const Job& job, const SearchOptions& options = {});

// Model facts the time model needs.
struct TimeModelInputs {
  double params = 0;     // N, all parameters
  double trainable = 0;  // trained parameters (N, or the LoRA adapters)
  double layers = 0;     // L (encoder + decoder)
  double hidden = 0;     // h
  double seq_len = 0;    // s
};

// The step time of `setup` for `global_batch` sequences (Note [Step-time model]); `pinned`: host
// buffers are pinned.
StepTime PredictStepTime(const TimeModelInputs& model, const Cluster& cluster,
                         const estimator::TrainingSetup& setup, int64_t global_batch, bool pinned);

// "ZeRO-3 + optimizer on NVMe + params on CPU".
std::string FamilyName(int stage, estimator::OffloadDevice optimizer,
                       estimator::OffloadDevice param);

// `memplan plan --format json`: {"cluster", "job", "plans": [...], "rejected": [...],
// "assumptions", "configurations"}.
nlohmann::json ToJson(const Plan& plan);
nlohmann::json ToJson(const PlanResult& result, const Cluster& cluster, const Job& job);
// The table people read: top `top` plans, then rejected families, then assumptions.
std::string FormatPlanText(const PlanResult& result, const Cluster& cluster, const Job& job,
                           size_t top);

}  // namespace memplan::planner
