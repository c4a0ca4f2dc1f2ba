// integration::requests: `memplan estimate` and `memplan plan` as functions from one JSON request
// to the JSON answer the CLI prints with --format json. The C API (memplan.h) and the Python
// package pass these same documents, so a script gets the same answer whichever door it uses.
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
// Plan request:
//   {"model" | "config": as above, "model_class",
//    "cluster": {...},         // planner::ClusterFromJson form; or the preset keys below
//    "gpu": "a100-80", "gpus": 8, "nodes": 1, "cpu_mem": "1TiB" | bytes, "cpu_cores": 64,
//    "pcie_gen": 4, "memlock": "64GiB" | bytes | "unlimited", "nvme_path": "/mnt/nvme",
//    "nvme_capacity": "4TiB" | bytes,
//    "global_batch": 64 | "global_batch_tokens": 131072,   // exactly one
//    "seq_len": 2048, "precision": "bf16-mixed", "optimizer": "adamw", "lora_rank": 0,
//    "lora_targets": [...], "qlora": false, "flash_attention": true, "cuda_context_mib": 1343,
//    "gpu_margin": 0.05, "allow_nvme": true, "top": 5,
//    "emit": ["deepspeed", "accelerate", "fsdp", "schedule"], "plan_index": 0,
//    "for_hf_trainer": false, "lr": 1e-4, "accelerate_plugin": "deepspeed" | "fsdp"}
// Answer: planner::ToJson(PlanResult, Cluster, Job) as `memplan plan --format json` prints it
// (plans cut to `top`), plus "emitted": {"deepspeed": {...}, "accelerate": "<yaml>", ...} when
// "emit" names any (for plans[plan_index]).
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

}  // namespace memplan::integration
