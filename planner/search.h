// The planner's search: every ZeRO stage (0-3) x optimizer offload {none, cpu, nvme} x parameter
// offload {none, cpu, nvme} x the framework's checkpointing policies x micro-batch (with
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
// The step-time model is planner/step_time.h (Note [Step-time model]).
//
// Note [Ranking]
// Plans are compared by tokens per second. Two plans whose speeds differ by less than the time
// model's noise (tie_fraction, 3%) are a tie: the tie goes to the plan that keeps the user's
// choices (their optimizer), offloads less (host memory, pinned buffers and PCIe traffic are what
// breaks on a shared node), then has more GPU headroom. Ties are resolved in tiers: the fastest
// plan and every plan within the noise of it form the first tier, ordered by those rules; the
// rest are ranked the same way.
//
// Note [Tuned buffers]
// DeepSpeed's buffers are chosen from the model, not left at DeepSpeed's defaults, and the search
// tries a second, tighter set when the first does not fit:
//   reduce / allgather bucket (ZeRO-1/2): 2e8 elements (each collective moves ~400 MB, far above
//     NCCL's latency-bound sizes), tight h^2; ZeRO-3 reduce bucket h^2 (the Hugging Face "auto"),
//     tight h^2 / 4;
//   stage3_prefetch_bucket_size: one transformer layer (the next layer's gather overlaps this
//     layer's compute), tight 0.9 h^2 (Hugging Face "auto"); stage3_param_persistence_threshold
//     10 h (norms and biases stay whole); stage3_max_live_parameters: three layers, at least 1e8;
//   sub_group_size: 1e9 (DeepSpeed's default) when the fp32 conversion of a sub-group fits, tight
//     1e8; with NVMe optimizer offload, the largest that keeps buffer_count pinned sub-groups
//     within the pinned budget per process (memlock, half the RAM);
//   parameters on NVMe: every gathered parameter holds a swap buffer until it is released, and
//     DeepSpeed keeps gathered the parameters reused within stage3_max_reuse_distance, so the
//     DeepSpeed file sets that distance and stage3_max_live_parameters to one layer, and
//     offload_param buffer_count covers the tensors above the persistence threshold in any
//     layer-long stretch of the model plus one module's (at least DeepSpeed's 5); buffer_size is
//     the largest parameter partition (DeepSpeed asserts a buffer holds one) and, with the
//     optimizer on NVMe too, the largest optimizer sub-group (optimizer_utils asserts the 16-bit
//     buffers hold one for the fp32 initialisation); sub_group_size then keeps both sets of pinned
//     buffers within the budget. The aio block comes from --nvme-bench.
// Thread safety: pure functions over plain values.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/status.h"
#include "estimator/inventory.h"
#include "estimator/memory_model.h"
#include "estimator/training_setup.h"
#include "planner/cluster.h"
#include "planner/job.h"
#include "planner/step_time.h"

namespace memplan::planner {

// See Note [Feasibility].
struct SearchOptions {
  double gpu_safety_fraction = 0.05;                   // of GPU memory kept free
  double cpu_usable_fraction = 0.85;                   // of RAM usable for training state
  uint64_t cpu_per_process_bytes = uint64_t{2} << 30;  // host memory of each GPU process
  double pinned_fraction = 0.5;                        // of RAM that may be pinned
  double nvme_usable_fraction = 0.9;                   // of the NVMe capacity
  bool allow_nvme = true;                              // false: no NVMe offload even with a path
  // Restrict the grid ("what if": a given configuration scored like any plan). Stage -1 = all.
  int only_stage = -1;
  std::optional<estimator::OffloadDevice> only_offload_optimizer;
  std::optional<estimator::OffloadDevice> only_offload_param;
  std::optional<estimator::Checkpointing> only_checkpointing;
  int64_t only_micro_batch = 0;           // 0 = all divisors of the per-GPU batch
  std::optional<Sharding> only_sharding;  // ZeRO-3 on several nodes: full or hybrid
  // Candidates beyond the job's own optimizer: 8-bit AdamW (bitsandbytes) for an AdamW job, on the
  // GPU, where it is faster. Off when the user chose the optimizer.
  bool consider_8bit = false;
  bool tune_buffers = true;    // Note [Tuned buffers]; false: DeepSpeed's defaults
  double tie_fraction = 0.03;  // Note [Ranking]
  // The step-time model's constants: the defaults, or fitted to measured runs (`memplan
  // calibrate`, planner/calibrate.h; the GPU's own efficiencies are in Cluster::gpu).
  TimeConstants time_constants = DefaultTimeConstants();
  // Where calibrated constants came from ("calibration.json: 12 runs, ..."), stated in the
  // assumptions; empty: the defaults.
  std::string calibration_note;
  // The step model's runs for this model, shared by several searches over it (capacity's, on
  // several threads: the cache is thread-safe; Note [Reusing a step]); null: each search keeps
  // its own. Only for searches over the same inventory.
  std::shared_ptr<estimator::StepModelCache> step_cache;
  Status Validate() const;
};

struct Plan {
  estimator::TrainingSetup setup;  // stage, offload, checkpointing, micro_batch, grad_accum, ...
  Sharding sharding = Sharding::kFull;  // ZeRO-3: over all GPUs, or hybrid (within each node)
  estimator::PeakMemory peak;
  uint64_t gpu_capacity_bytes = 0;  // usable, after the safety margin
  StepTime time;
  double tokens_per_s = 0;  // all GPUs
  double mfu = 0;           // model FLOPs x tokens/s / (peak FLOPs x GPUs) (LoRA: LoRA's FLOPs)
  double hfu = 0;           // the same with the recomputed FLOPs
  std::string family;       // "ZeRO-2", "ZeRO-3 + optimizer on CPU", ...
  std::string buffers;      // "tuned" or "tight" (Note [Tuned buffers]), "defaults"
  std::string why;          // one or two sentences for people
  // GPU headroom: usable minus peak, per GPU.
  uint64_t HeadroomBytes() const {
    return gpu_capacity_bytes > peak.gpu_bytes ? gpu_capacity_bytes - peak.gpu_bytes : 0;
  }
};

struct Rejection {
  std::string plan;    // family name
  std::string reason;  // "needs 93.1 GiB per GPU, has 76.0 usable of 80.0"
  // How close it came: needed / usable of the tier that failed (>= 1); 0 when the family could
  // not be tried at all (no NVMe drive, an optimizer DeepSpeed cannot offload).
  double over_ratio = 0;
  std::string tier = "";  // "gpu", "cpu", "pinned", "memlock", "nvme", "" (not tried)
  // The smallest configuration tried (micro-batch 1, full checkpointing): its setup.
  estimator::TrainingSetup setup = {};
  Sharding sharding = Sharding::kFull;
};

struct PlanResult {
  std::vector<Plan> plans;  // best configuration of each feasible family, fastest first
  // Families that cannot run, closest to fitting first (Rejection::over_ratio).
  std::vector<Rejection> rejected;
  // When nothing fits: what would make the closest family fit, each checked with the memory
  // model ("2 nodes: ZeRO-3 needs 61.2 GiB per GPU").
  std::vector<std::string> suggestions;
  // What the report cannot check and says so ("host RAM not checked: ...").
  std::vector<std::string> gaps;
  std::vector<std::string> assumptions;
  int64_t seq_len = 0;
  int64_t configurations = 0;  // grid points evaluated with the memory model
  // All grid points: families x checkpointing x micro-batches; those not evaluated were skipped
  // because a smaller micro-batch of the same family already did not fit GPU memory.
  int64_t grid_size = 0;
  bool host_ram_checked = false;  // the cluster's RAM is known (--cpu-mem, --detect, --cluster)
};

// The most swap buffers DeepSpeed holds at once with parameters on NVMe when the coordinator keeps
// parameters reused within `window` elements: the swapped tensors in any stretch of `window`
// elements of the module order, plus one module's (swapped in together). A tensor is swapped when
// it is above the persistence threshold and its partition over `partition_ranks` has at least
// `min_partition_numel` elements (partitioned_param_swapper.swappable_tensor: smaller ones stay
// in CPU memory); the planner counts every tensor above the threshold (the defaults).
int64_t NvmeBuffersNeeded(const estimator::ModelInventory& inventory, int64_t window,
                          int64_t persistence_threshold, int64_t min_partition_numel = 0,
                          int64_t partition_ranks = 1);

// Runs the search. Errors: an invalid cluster, job or options; a global batch the GPUs do not
// divide; bf16 on a GPU without it; estimator failures other than a setup the grid skips.
Result<PlanResult> SearchPlans(const estimator::ModelInventory& inventory, const Cluster& cluster,
                               const Job& job, const SearchOptions& options = {});

// "ZeRO-3 + optimizer on NVMe + params on CPU"; hybrid: "ZeRO-3 hybrid (shard per node)"; the
// 8-bit optimizer when it replaces the job's: " + 8-bit AdamW".
std::string FamilyName(int stage, estimator::OffloadDevice optimizer,
                       estimator::OffloadDevice param, Sharding sharding = Sharding::kFull,
                       bool eight_bit = false);

// What the training script must do besides loading the emitted configs, for `plan`: turn on
// gradient checkpointing in the model, the attention implementation, the Hugging Face Trainer's
// settings when --for-hf-trainer leaves them "auto". One sentence each.
std::vector<std::string> TrainerSettings(const Plan& plan,
                                         const estimator::ModelInventory& inventory,
                                         bool for_hf_trainer);
nlohmann::json TrainerSettingsJson(const Plan& plan, const estimator::ModelInventory& inventory);
// The attn_implementation a Transformers model is loaded with for the plan: "sdpa" with
// memory-efficient attention where the family has an SDPA path, else "eager"
// (estimator::TransformersRunsSdpa).
std::string AttnImplementation(const estimator::TrainingSetup& s,
                               const estimator::ModelInventory& inventory);

// `memplan plan --format json`: {"cluster", "job", "plans": [...], "rejected": [...],
// "assumptions", "configurations"}.
nlohmann::json ToJson(const Plan& plan);
nlohmann::json ToJson(const PlanResult& result, const Cluster& cluster, const Job& job);
// The document `plan --format json` prints and the Python / C requests return: ToJson(result)
// with its plans cut to `top`, and "trainer" (TrainerSettingsJson plus "plan_index", 1-based, and
// "notes") for the plan at `plan_index` (0-based) when it exists.
nlohmann::json PlanReportJson(const PlanResult& result, const Cluster& cluster, const Job& job,
                              const estimator::ModelInventory& inventory, size_t top,
                              size_t plan_index, bool for_hf_trainer);
// The table people read: top `top` plans, then rejected families, then assumptions.
std::string FormatPlanText(const PlanResult& result, const Cluster& cluster, const Job& job,
                           size_t top);

// A checkpointing policy the search tries: the policy and, for kFull, every how many blocks.
struct CheckpointPolicy {
  estimator::Checkpointing checkpointing = estimator::Checkpointing::kNone;
  int64_t every = 1;
};

// The policies `plan` searches for a framework, the most memory-saving last (the tightest
// configuration tried): Transformers: none, selective (Megatron-style attention recompute, as
// plans always searched), full (gradient_checkpointing); torchtune: none, full every 2nd block
// (the distributed recipe's ac_mode selective, ac_option 2), full
// (enable_activation_checkpointing); LitGPT and llm-foundry: none, full
// (activation_checkpointing); torchtitan: none, op (activation_checkpointing.mode selective,
// selective_ac_option op), full every 2nd block (selective_ac_option 2), full.
std::vector<CheckpointPolicy> FrameworkCheckpointPolicies(estimator::Framework framework);

// The plan table's name of a setup's policy: "none", "selective", "op", "full", "full/2".
std::string CheckpointLabel(const estimator::TrainingSetup& setup);

}  // namespace memplan::planner
