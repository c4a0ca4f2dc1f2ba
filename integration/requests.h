// integration::requests: `memplan estimate`, `plan` and `capacity` as functions from one JSON
// request to the JSON answer the CLI prints with --format json. The C API (memplan.h) and the
// Python package pass these same documents, so a script gets the same answer whichever door it
// uses.
//
// Estimate request (keys other than these are errors naming the key):
//   {"model": "llama-2-7b" | "<path>" | "<org/name>",   // exactly one of model, config, shapes
//    "config": {...},          // the contents of a Hugging Face config.json
//    "shapes": {...} | [...],  // a tensor-shape list (estimator/shape_list.h)
//    "name": "my-model",       // how config / shapes are named in the answer (default "request")
//    "model_class": "auto" | "base",
//    "gpus": 1, "nodes": 1, "buffer_factor": 1.5,
//    "setup": {...},           // TrainingSetup JSON (any subset); present: the full memory model
//    "deepspeed": {...}}       // a ds_config.json document applied under "setup"'s keys
// Answer: estimator::ToJson(Estimate), the same as `memplan estimate --format json`.
//
// Plan request (parse, resolve, search, emit; every default is planner::Resolve's, Note [Plan
// defaults] in planner/plan_request.h):
//   {"model" | "config": as above, "name", "model_class",
//    "cluster": {...},         // planner::ClusterFromJson form; and/or the preset keys below
//    "gpu": "a100-80", "gpus": 8, "nodes": 1, "cpu_mem": "1TiB" | bytes, "cpu_cores": 64,
//    "pcie_gen": 4, "memlock": "64GiB" | bytes | "unlimited", "nvme_path": "/mnt/nvme",
//    "nvme_capacity": "4TiB" | bytes, "inter_node_bw": 25 (GB/s),
//    "global_batch": 64 | "global_batch_tokens": 131072,   // exactly one
//    "setup": {...},           // TrainingSetup JSON, as the estimate request's: "precision",
//                              // "optimizer", "seq_len", "lora_rank", "lora_targets", "qlora",
//                              // "flash_attention", "framework", "cuda_context_bytes", ...; not
//                              // the keys the search chooses ("zero_stage", "offload_*",
//                              // "checkpointing", "micro_batch", "grad_accum", GPU counts)
//    "gpu_margin": 0.05, "allow_nvme": true,
//    "zero_stage", "offload_optimizer", "offload_param", "checkpointing", "micro_batch",
//    "sharding": "full" | "hybrid", "default_buffers": false,   // what if: restrict the search
//    "top": 5, "emit": ["deepspeed", "accelerate", "fsdp", "schedule", "trainer"],
//    "plan_index": 0, "for_hf_trainer": false, "lr": 1e-4, "accelerate_plugin": "deepspeed"}
// Deprecated, read for one more release: the setup keys at the top level ("precision",
// "optimizer", "seq_len", "lora_rank", "lora_targets", "qlora", "flash_attention", "foreach",
// "fused_optimizer", "sgd_momentum", "sequence_parallel", "autocast", "gradient_as_bucket_view",
// "cuda_context_mib"); each one used adds a line to the answer's "deprecations" saying what to
// write instead; one given both there and in "setup" is an error.
// Answer: planner::ToJson(PlanResult, Cluster, Job) as `memplan plan --format json` prints it
// (plans cut to `top`), plus "emitted": {"deepspeed": {...}, "accelerate": "<yaml>", ...} when
// "emit" names any (for plans[plan_index]).
//
// Capacity request (`memplan capacity`; the node, job and setup keys as the plan request's):
//   {"model" | "config", "name", "model_class",
//    "gpu": ["a100-80", "h100-80"] | "a100-80,h100-80",   // GPU types; and/or
//    "cluster": {...},         // a capacity cluster document (planner::OffersFromJson)
//    "gpus": "1-64" | "8-512" | [8, 16, 64],   // total GPU counts (default "1-64")
//    "gpus_per_node": 8, "price": 2.5 | {"a100-80": 1.8, ...},  // per GPU-hour
//    "tokens": "1T" | 1e12,    // the training budget (required)
//    "max_days": 30, "threads": 0,
//    "cpu_mem", "cpu_cores", "pcie_gen", "inter_node_bw", "memlock", "nvme_path",
//    "nvme_capacity", "global_batch" | "global_batch_tokens", "setup", "gpu_margin",
//    "allow_nvme"}
// Answer: planner::ToJson(CapacityResult, ...) as `memplan capacity --format json` prints it.
//
// Errors: InvalidArgument for a bad request (naming the key), the estimator's and planner's
// errors otherwise.
//
// Thread safety: plain functions over their arguments.
#pragma once

#include <nlohmann/json.hpp>

#include "common/status.h"

namespace memplan::integration {

Result<nlohmann::json> Estimate(const nlohmann::json& request);
Result<nlohmann::json> Plan(const nlohmann::json& request);
Result<nlohmann::json> Capacity(const nlohmann::json& request);

}  // namespace memplan::integration
