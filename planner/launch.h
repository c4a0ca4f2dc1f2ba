// Launch files: what starts a plan's training job on its nodes (`memplan plan --emit-launch KIND
// FILE`), beside the configs emit.h writes.
//
//   slurm       an sbatch script: #SBATCH --nodes, --ntasks (one launcher per node),
//               --ntasks-per-node=1, --gres=gpu:N, --cpus-per-task (the node's cores when known),
//               --exclusive, then `srun` running torchrun (or `accelerate launch` when an
//               Accelerate config is emitted) on every node, rendezvous at the first node;
//   torchrun    the torchrun command line (--standalone on one node; on several, --nnodes,
//               --node-rank and the master address from NODE_RANK / MASTER_ADDR);
//   deepspeed   the deepspeed launcher command line (--num_gpus, and --num_nodes with a hostfile
//               on several nodes);
//   accelerate  `accelerate launch` with the emitted Accelerate config (--num_processes,
//               --num_machines, --machine_rank from NODE_RANK, --main_process_ip).
// Every file is a bash script (#!/usr/bin/env bash, set -euo pipefail) whose only command is the
// launch; every path and argument that is not plain is single-quoted for the shell (a path with
// spaces, quotes or $ stays one word, unexpanded), and every comment is one line whatever the
// names in it hold (Note [Generated text]). The training script gets the DeepSpeed config as
// `--deepspeed PATH` (the Hugging Face Trainer's flag) with for_hf_trainer, else
// `--deepspeed_config PATH` (DeepSpeed's deepspeed.add_config_arguments).
//
// Thread safety: pure functions.
#pragma once

#include <string>
#include <vector>

#include "common/status.h"
#include "planner/cluster.h"
#include "planner/generated_text.h"
#include "planner/search.h"

namespace memplan::planner {

enum class Launcher { kSlurm, kTorchrun, kDeepSpeed, kAccelerate };

// "slurm", "torchrun", "deepspeed", "accelerate"; errors list them.
Result<Launcher> ParseLauncher(const std::string& text);

struct LaunchOptions {
  Launcher launcher = Launcher::kTorchrun;
  std::string script = "train.py";       // the training script the launcher starts
  std::vector<std::string> script_args;  // its own arguments, each passed verbatim
  std::string deepspeed_config;          // the emitted ds_config.json's path; empty: none
  std::string accelerate_config;         // the emitted Accelerate YAML's path; empty: none
  bool for_hf_trainer = false;  // --deepspeed PATH (Trainer) instead of --deepspeed_config PATH
  int master_port = 29500;
  std::string job_name = "memplan";   // sbatch --job-name (made safe)
  std::string hostfile = "hostfile";  // deepspeed on several nodes: its --hostfile
  std::string slurm_partition;        // #SBATCH --partition, when given
  std::string slurm_time;             // #SBATCH --time, when given ("2-00:00:00")
};

// The script. Every value in it went through Note [Generated text] (planner/generated_text.h):
// the plan's description and the GPU name (from a cluster file anyone may write) as one comment
// line, paths and arguments as single shell words. Errors, each naming its field: an empty
// script; a NUL, newline or carriage return in the script, an argument (`script_args` K of N), a
// config path or the hostfile; a port outside [1, 65535]; a partition or time with characters
// sbatch directives cannot hold; a DeepSpeed launch for a hybrid-sharded plan (FSDP only:
// DeepSpeed 0.19 removed MiCS); an Accelerate launch without an Accelerate config.
Result<std::string> LaunchScript(const Plan& plan, const Cluster& cluster,
                                 const LaunchOptions& options);

}  // namespace memplan::planner
