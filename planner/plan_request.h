// planner::PlanRequest: one plan request as the user gave it, whichever door it came through (the
// CLI's flags in tools/plan_command.cc and tools/capacity_command.cc, the JSON request of
// integration/requests.h, the C API and Python, which pass that JSON), and Resolve(), the one place
// where every default of a plan is applied. A front end only fills the fields the user gave; it
// decides nothing.
//
// Note [Plan defaults]
// Resolve() turns a PlanRequest into the planner's Cluster, Job and SearchOptions, in this order:
//  1. Cluster: `cluster` (a cluster file or the request's "cluster" object, or --detect's machine)
//     or Cluster's own defaults; then the preset `node.gpu` replaces its GPU; then each node
//     setting given replaces its field (ClusterSettings::ApplyTo); then the measured benches
//     (--nvme-bench,
//     --adam-bench) and a calibration's GPU efficiency. A GPU must come from one of them (HasGpu).
//     memlock: absent keeps the cluster's (0: not checked); "unlimited" is 0 too (Memlock).
//  2. Precision: the one given, else DefaultPrecision(GPU): bf16-mixed where the GPU has bf16
//     FLOPs, fp16-mixed where it has none. `memplan capacity` applies the same per GPU type
//     (CapacityRequest::fp16_fallback).
//  3. Optimizer: the one given, else AdamW, and then 8-bit AdamW is also a candidate of the search
//     (SearchOptions::consider_8bit); a given optimizer is searched alone.
//  4. The rest of the setup: TrainingSetup's own defaults (seq_len 0: min(positions, 2048); CUDA
//     context 1343 MiB; flash attention on; ...), whichever fields the request gave replacing them.
//  5. Global batch: exactly one of samples and tokens (positive); tokens / the resolved seq_len,
//     which must divide them (SamplesFromTokens).
//  6. Search: SearchOptions' defaults (GPU margin 0.05, NVMe allowed, buffers tuned), the what-if
//     restrictions given (stage, offload, checkpointing, micro-batch, sharding "full" | "hybrid",
//     ParseSharding), and a calibration's time constants.
//  7. Notes for the report's assumptions: a GPU alias ("`gpu` h100 is the h100-80 preset") and
//     more than 8 GPUs on one node ("`gpus` is GPUs per node"), naming the request's fields (the
//     CLI prints them as flags, FieldsToFlags).
//
// Thread safety: plain values and pure functions.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/status.h"
#include "estimator/inventory.h"
#include "estimator/training_setup.h"
#include "planner/calibrate.h"
#include "planner/cluster.h"
#include "planner/job.h"
#include "planner/search.h"

namespace memplan::planner {

// RLIMIT_MEMLOCK as a user gives it: a byte count or "unlimited". Cluster::memlock_bytes keeps 0
// for "no limit known or none"; this type is where "unlimited" becomes that 0, in one place.
struct Memlock {
  bool unlimited = false;
  uint64_t bytes = 0;  // when not unlimited

  // "unlimited", or a byte size ("64GiB", "1048576"); errors name `what` (the flag or key).
  static Result<Memlock> Parse(std::string_view text, std::string_view what);
  // The JSON forms: "unlimited", a byte-size string or a number of bytes. Errors name the key as
  // JsonFieldReader does ("request: 'memlock' ...").
  static Result<Memlock> FromJson(const nlohmann::json& object, const char* key,
                                  const std::string& where);
  // Cluster::memlock_bytes: 0 for unlimited.
  uint64_t ClusterBytes() const { return unlimited ? 0 : bytes; }
};

// The node settings a request may give over a cluster (each absent: the cluster's).
struct ClusterSettings {
  std::string gpu;  // a GPU preset name (FindGpuPreset); empty: the cluster's GPU
  std::optional<int64_t> gpus_per_node, nodes;
  std::optional<uint64_t> cpu_memory_bytes;
  std::optional<int64_t> cpu_cores;
  std::optional<int> pcie_gen;
  std::optional<double> inter_node_bytes_per_s;
  std::optional<Memlock> memlock;
  std::optional<std::string> nvme_path;
  std::optional<uint64_t> nvme_capacity_bytes;

  // Every setting given but the GPU, over `*cluster`'s (no validation).
  void ApplyTo(Cluster* cluster) const;
};

// A measured input read by the front end: a `memplan bench nvme|adam --format json` document.
struct BenchInput {
  nlohmann::json document;
  std::string source;  // the file it came from, for errors
};

struct PlanRequest {
  std::string model;  // the model as the user named it (Job::model)
  // The cluster before the settings: a cluster file, a request's "cluster", or the detected
  // machine; absent: Cluster's defaults.
  std::optional<Cluster> cluster;
  ClusterSettings node;
  std::optional<BenchInput> nvme_bench, adam_bench;
  std::optional<Calibration> calibration;  // fitted step-time constants (`memplan calibrate`)

  // The job: exactly one of the two is positive.
  int64_t global_batch = 0;         // samples per optimizer step, all GPUs
  int64_t global_batch_tokens = 0;  // tokens per optimizer step
  // Every setting the user gave; precision and optimizer are read from the two below.
  estimator::TrainingSetup setup;
  std::optional<estimator::Precision> precision;  // absent: DefaultPrecision
  std::optional<estimator::Optimizer> optimizer;  // absent: AdamW, 8-bit AdamW also tried

  // The search: SearchOptions' defaults, with the what-if restrictions (only_*), the GPU margin,
  // allow_nvme and tune_buffers as given. consider_8bit and the calibration are Resolve's.
  SearchOptions search;

  // A GPU is known: a cluster with one (--detect on a machine without GPUs gives none) or a preset.
  bool HasGpu() const;
};

// What Resolve makes of a request: the planner's inputs, and notes for the report's assumptions.
struct ResolvedPlan {
  Cluster cluster;
  Job job;
  SearchOptions options;
  std::vector<std::string> notes;
};

// Note [Plan defaults]. `arch` resolves seq_len for tokens. Errors: no GPU, an unknown preset,
// an invalid cluster, batch given twice or not at all, tokens the sequence does not divide.
Result<ResolvedPlan> Resolve(const PlanRequest& request, const estimator::ArchitectureInfo& arch);

// Step 1 of Note [Plan defaults]: the cluster alone (`memplan check` needs no job).
Result<Cluster> ResolveCluster(const PlanRequest& request);
// Step 5's first half: exactly one of global_batch and global_batch_tokens is positive (errors
// name both fields). Front ends may call it before loading the model; ResolveJob calls it.
Status CheckBatch(const PlanRequest& request);
// Steps 2-5 of Note [Plan defaults] without a GPU: the job (precision as given, else bf16-mixed,
// which `memplan capacity` turns into DefaultPrecision per GPU type) and the search options of a
// request. Used by Resolve and by capacity, which resolves the cluster per GPU type.
Result<Job> ResolveJob(const PlanRequest& request, const GpuSpec* gpu,
                       const estimator::ArchitectureInfo& arch);
SearchOptions ResolveSearch(const PlanRequest& request);

// bf16-mixed where `gpu` has bf16 FLOPs, else fp16-mixed.
estimator::Precision DefaultPrecision(const GpuSpec& gpu);
// "full" or "hybrid"; errors name `what`.
Result<Sharding> ParseSharding(std::string_view text, std::string_view what);

// The plan request's JSON reader (integration/requests.h documents the keys): the cluster keys,
// the job keys, "setup" (TrainingSetup JSON, as the estimate request's), and the what-if keys.
// Keys in `also_allowed` are the caller's (the model, output and emit keys); any other key is an
// error naming it. The old flattened setup keys ("precision", "seq_len", ... at the top level) are
// read for one release, each adding a line to `*deprecations`. Errors name the key ("request:
// 'gpus' must be an integer ...").
Result<PlanRequest> PlanRequestFromJson(const nlohmann::json& request,
                                        std::initializer_list<std::string_view> also_allowed,
                                        std::vector<std::string>* deprecations);
// The keys PlanRequestFromJson reads itself.
std::vector<std::string> PlanRequestKeys();
// The capacity request's share of the same reader (integration::Capacity): the node keys but
// "gpu", "gpus", "nodes" and "cluster" (capacity's own), the job keys and "setup"; no what-if keys
// and no flattened setup keys.
Result<PlanRequest> CapacityJobFromJson(const nlohmann::json& request,
                                        std::initializer_list<std::string_view> also_allowed,
                                        std::vector<std::string>* deprecations);

}  // namespace memplan::planner
