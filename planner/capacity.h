// Capacity planning: which GPU type, how many, on how many nodes, for how long and at what cost
// (`memplan capacity`). For each GPU type (an offer: a GPU preset or figures, its price per
// GPU-hour and its node size) and each total GPU count, the plan search of search.h finds the
// fastest configuration that fits; the training budget in tokens turns its throughput into the
// time to train and, with the price, the cost. The answer names three of them: the fewest GPUs
// that fit, the fastest, and the cheapest for the budget.
//
// Note [Capacity search]
// A count G of one GPU type runs on ceil(G / node size) nodes: G below the node size is one node
// with G GPUs; above it, G must be a multiple of the node size (a count that is not is skipped
// with the reason). Each (type, count) point is one SearchPlans run over the whole grid (ZeRO
// stage x offload x checkpointing x micro-batch) with the same job (global batch, sequence) and the
// same node settings (host RAM, NVMe, network), so the points differ only in the GPUs. A global
// batch that the count does not divide is a point that cannot run ("global batch 512 is not a
// multiple of 768 GPUs"). Points are searched on up to `threads` threads (pure functions; the
// answer does not depend on the thread count).
//   time to train = tokens / tokens per second of the point's best plan
//   GPU-hours    = time to train x G
//   cost         = GPU-hours x price per GPU-hour (no cost without a price)
// Fewest GPUs: the smallest G that fits (ties: the faster). Fastest: the shortest time to train
// (ties within 1%: fewer GPUs). Cheapest: the lowest cost among the priced offers (ties within
// 1%: the faster); with no price at all, the fewest GPU-hours, and the answer says so. With a
// deadline (max_train_hours), the fewest and the cheapest are chosen among the points that meet
// it; when none does, they are absent (the fastest still says how close the fastest comes).
//
// Thread safety: pure functions over plain values (PlanCapacity starts and joins its own threads).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/status.h"
#include "estimator/inventory.h"
#include "planner/cluster.h"
#include "planner/job.h"
#include "planner/search.h"

namespace memplan::planner {

// One GPU type the search may choose.
struct GpuOffer {
  GpuSpec gpu;
  double price_per_gpu_hour = 0;  // in the user's currency; 0 = not priced (no cost computed)
  int64_t gpus_per_node = 8;      // node size: GPUs per node of this type
  // Step-time constants calibrated for this GPU (`memplan calibrate`'s per-GPU link efficiency);
  // empty: the request's.
  std::optional<TimeConstants> time_constants;
};

struct CapacityRequest {
  std::vector<GpuOffer> offers;
  std::vector<int64_t> gpu_counts;  // total GPUs to try, ascending, each >= 1
  // Settings of every node (host RAM, cores, NVMe, network, memlock); its gpu, nodes and
  // gpus_per_node are ignored (the offers and counts set them).
  Cluster node;
  double tokens = 0;  // the training budget: tokens to train on (> 0)
  // A deadline: the fewest-GPUs and cheapest answers only among points that train within it
  // (the fastest is the fastest either way); 0: none.
  double max_train_hours = 0;
  SearchOptions search;
  int threads = 0;  // 0: the hardware's concurrency, at most 8
  // The job's precision was the default (bf16-mixed): GPUs without bf16 run fp16-mixed instead
  // of being a point that cannot run.
  bool fp16_fallback = false;
  // Valid offers (each GPU valid, price finite and >= 0, node size in [1, 1024]), counts in
  // [1, 1 << 20], tokens finite and > 0. Errors name the field (`price_per_gpu_hour`, `tokens`;
  // Note [Field names in errors] in estimator/training_setup.h).
  Status Validate() const;
};

// One GPU type x count.
struct CapacityPoint {
  size_t offer = 0;  // index into CapacityRequest::offers
  std::string gpu;   // its name
  int64_t gpus = 0, nodes = 0, gpus_per_node = 0;
  bool fits = false;
  std::string reason;        // when it does not fit: why (the closest family's reason)
  std::optional<Plan> plan;  // the fastest plan, when it fits
  double train_hours = 0;    // tokens / plan tokens per second / 3600
  double gpu_hours = 0;
  double cost = 0;  // 0 when the offer has no price
  bool priced = false;
  int64_t configurations = 0;  // grid points evaluated by the search
};

struct CapacityResult {
  std::vector<CapacityPoint> points;                // offers in the given order, counts ascending
  std::optional<size_t> fewest, fastest, cheapest;  // indexes into points
  bool cheapest_by_gpu_hours = false;  // no offer has a price: "cheapest" is the fewest GPU-hours
  int64_t seq_len = 0;
  int64_t searches = 0;        // (type, count) points searched
  int64_t configurations = 0;  // grid points evaluated, all searches
  std::vector<std::string> assumptions;
};

// Runs Note [Capacity search]. Errors: an invalid request or job; the job's own errors that do
// not depend on the GPU count (a model without architecture, a precision no offer supports is a
// point that cannot run, not an error).
Result<CapacityResult> PlanCapacity(const estimator::ModelInventory& inventory, const Job& job,
                                    const CapacityRequest& request);

// `memplan capacity --format json`: {"job", "tokens", "deadline_hours" (null: none), "node",
// "offers": [...], "points": [...],
// "fewest_gpus", "fastest", "cheapest" (each a point or null), "cheapest_by", "searches",
// "configurations", "assumptions"}. A point: {"gpu", "gpus", "nodes", "gpus_per_node", "fits",
// "reason" | "plan" (search.h's ToJson(Plan)), "train_hours", "train_days", "gpu_hours",
// "cost" (null without a price), "price_per_gpu_hour"}.
nlohmann::json ToJson(const CapacityResult& result, const CapacityRequest& request, const Job& job);
// The table people read: the three answers with their plans, then every point.
std::string FormatCapacityText(const CapacityResult& result, const CapacityRequest& request,
                               const Job& job);
// The picture (cost against time to train) is planner/svg.h's CapacitySvg.

// "8-512" (doubling from 8 up to 512, and 512 itself), "8,16,64", "1-8,16", "24": ascending,
// without duplicates. Errors name `flag` and the bad part.
Result<std::vector<int64_t>> ParseGpuCounts(const std::string& text, const std::string& flag);
// "1T", "300B", "15e12", "2.5M", "1000000": a count with an optional decimal suffix K, M, B
// (or G), T. Errors name `flag`.
Result<double> ParseTokenCount(const std::string& text, const std::string& flag);

// The offers of a capacity cluster file: {"gpus": [preset name | {"preset": ..., any GpuSpec key
// of ClusterFromJson, "price_per_gpu_hour": 2.5, "gpus_per_node": 8}, ...], and any node key of a
// cluster file ("cpu_memory_bytes", "nvme_path", ...)}; a plain cluster file (one "gpu") is one
// offer. `*node` receives the node settings. Errors name `source` and the key.
Result<std::vector<GpuOffer>> OffersFromJson(const nlohmann::json& json, const std::string& source,
                                             Cluster* node);

// The offers a request searches: `names` (GPU presets, or the names of `listed`'s types, which
// keep their figures and price) pick and order them, else all of `listed`; `gpus_per_node` > 0
// sets every node size; each of `prices` is a price for every type ("2.5") or for one
// ("h100-80=2.9", a preset alias naming its preset's type), each type priced at most once.
// Errors name the fields (`offers`, `price_per_gpu_hour`).
Result<std::vector<GpuOffer>> ChooseOffers(std::vector<GpuOffer> listed,
                                           const std::vector<std::string>& names,
                                           int64_t gpus_per_node,
                                           const std::vector<std::string>& prices);

}  // namespace memplan::planner
