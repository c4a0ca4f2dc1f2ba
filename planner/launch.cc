#include "planner/launch.h"

#include <algorithm>
#include <cctype>
#include <utility>

#include "common/printable.h"
#include "planner/generated_text.h"

namespace memplan::planner {
namespace {

// A value an #SBATCH directive can hold: sbatch reads the line itself, no shell quoting there.
bool DirectiveSafe(const std::string& s) {
  return !s.empty() && s.size() <= 128 && std::all_of(s.begin(), s.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' || c == ':' ||
           c == '-' || c == ',';
  });
}

std::string Join(const std::vector<std::string>& words) {
  std::string out;
  for (const std::string& w : words) out += (out.empty() ? "" : " ") + w;
  return out;
}

// The training script, its arguments and the config argument, each one shell word (Note
// [Generated text]); errors name the field.
Result<std::vector<std::string>> ScriptWords(const LaunchOptions& o) {
  std::vector<std::string> out;
  MEMPLAN_ASSIGN_OR_RETURN(std::string script, ShellWord(o.script, "`script`"));
  out.push_back(std::move(script));
  for (size_t i = 0; i < o.script_args.size(); ++i) {
    MEMPLAN_ASSIGN_OR_RETURN(
        std::string arg,
        ShellWord(o.script_args[i], "`script_args` " + std::to_string(i + 1) + " of " +
                                        std::to_string(o.script_args.size())));
    out.push_back(std::move(arg));
  }
  const bool accelerate = o.launcher == Launcher::kAccelerate ||
                          (o.launcher == Launcher::kSlurm && !o.accelerate_config.empty());
  if (!o.deepspeed_config.empty() && !accelerate) {
    out.push_back(o.for_hf_trainer ? "--deepspeed" : "--deepspeed_config");
    MEMPLAN_ASSIGN_OR_RETURN(std::string config,
                             ShellWord(o.deepspeed_config, "`deepspeed_config_path`"));
    out.push_back(std::move(config));
  }
  return out;
}

std::string SafeJobName(const std::string& name) {
  std::string out;
  for (char c : name) out += std::isalnum(static_cast<unsigned char>(c)) || c == '-' ? c : '-';
  while (out.find("--") != std::string::npos) out.replace(out.find("--"), 2, "-");
  if (out.empty() || out == "-") out = "memplan";
  return out.substr(0, 64);
}

}  // namespace

Result<Launcher> ParseLauncher(const std::string& text) {
  if (text == "slurm") return Launcher::kSlurm;
  if (text == "torchrun") return Launcher::kTorchrun;
  if (text == "deepspeed") return Launcher::kDeepSpeed;
  if (text == "accelerate") return Launcher::kAccelerate;
  return Status::InvalidArgument("`launcher` '" + Printable(text) +
                                 "': expected slurm, torchrun, deepspeed or accelerate");
}

Result<std::string> LaunchScript(const Plan& plan, const Cluster& cluster, const LaunchOptions& o) {
  if (o.script.empty()) return Status::InvalidArgument("`script`: no training script given");
  MEMPLAN_ASSIGN_OR_RETURN(const std::vector<std::string> words, ScriptWords(o));
  MEMPLAN_ASSIGN_OR_RETURN(const std::string accelerate_config,
                           ShellWord(o.accelerate_config, "`accelerate_config`"));
  MEMPLAN_ASSIGN_OR_RETURN(const std::string hostfile,
                           ShellWord(o.hostfile, "the DeepSpeed hostfile path"));
  if (o.master_port < 1 || o.master_port > 65535) {
    return Status::InvalidArgument("`master_port` must be in [1, 65535]");
  }
  if (!o.slurm_partition.empty() && !DirectiveSafe(o.slurm_partition)) {
    return Status::InvalidArgument("`slurm_partition` '" + Printable(o.slurm_partition) +
                                   "': letters, digits, '_', '.', ':', '-' and ',' only");
  }
  if (!o.slurm_time.empty() && !DirectiveSafe(o.slurm_time)) {
    return Status::InvalidArgument("`slurm_time` '" + Printable(o.slurm_time) +
                                   "': expected minutes, HH:MM:SS or D-HH:MM:SS");
  }
  const bool hybrid = plan.sharding == Sharding::kHybrid && plan.setup.zero_stage == 3;
  const bool deepspeed_engine = !o.deepspeed_config.empty();
  if (o.launcher == Launcher::kDeepSpeed && hybrid) {
    return Status::InvalidArgument(
        "`launcher` deepspeed: the plan shards within each node (HYBRID_SHARD), which "
        "DeepSpeed 0.19 no longer has (MiCS was removed); launch it with torchrun, accelerate or "
        "slurm and the FSDP files");
  }
  if (o.launcher == Launcher::kAccelerate && o.accelerate_config.empty()) {
    return Status::InvalidArgument(
        "`launcher` accelerate needs the Accelerate config it launches: give "
        "`accelerate_config`");
  }
  const int64_t nodes = cluster.nodes;
  const int64_t per_node = cluster.gpus_per_node;
  const std::string port = std::to_string(o.master_port);
  const std::string script = Join(words);

  std::string out = "#!/usr/bin/env bash\n";
  // The plan's description and the cluster's GPU name come from files others write: one comment
  // line whatever they hold (Note [Generated text]).
  const std::string about = CommentLine(
      "memplan plan: " + plan.family + ", micro-batch " + std::to_string(plan.setup.micro_batch) +
      " x " + std::to_string(plan.setup.grad_accum) + " accumulation, on " + std::to_string(nodes) +
      (nodes == 1 ? " node" : " nodes") + " x " + std::to_string(per_node) + " " +
      cluster.gpu.name + ".");
  if (o.launcher == Launcher::kSlurm) {
    out += "#SBATCH --job-name=" + SafeJobName(o.job_name) + "\n";
    out += "#SBATCH --nodes=" + std::to_string(nodes) + "\n";
    out += "#SBATCH --ntasks=" + std::to_string(nodes) + "\n";
    out += "#SBATCH --ntasks-per-node=1\n";
    out += "#SBATCH --gres=gpu:" + std::to_string(per_node) + "\n";
    if (cluster.cpu_cores > 0) {
      out += "#SBATCH --cpus-per-task=" + std::to_string(cluster.cpu_cores) + "\n";
    }
    out += "#SBATCH --exclusive\n";
    if (!o.slurm_partition.empty()) out += "#SBATCH --partition=" + o.slurm_partition + "\n";
    if (!o.slurm_time.empty()) out += "#SBATCH --time=" + o.slurm_time + "\n";
    out += about;
    out += "# Submit with: sbatch THIS_FILE (one launcher per node starts its " +
           std::to_string(per_node) + " GPU processes).\n";
    out += "set -euo pipefail\n";
    // sed reads the whole list: `head -n 1` would exit first, and the SIGPIPE scontrol then gets
    // on a long node list fails the job under pipefail.
    out += "MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | sed -n 1p)\n";
    out += "export MASTER_ADDR\nexport MASTER_PORT=" + port + "\n";
    if (!o.accelerate_config.empty()) {
      out += "srun --kill-on-bad-exit=1 bash -c " +
             ShellQuote("accelerate launch --config_file " + accelerate_config +
                        " --num_machines " + std::to_string(nodes) + " --num_processes " +
                        std::to_string(nodes * per_node) +
                        " --machine_rank \"$SLURM_NODEID\" --main_process_ip \"$MASTER_ADDR\" "
                        "--main_process_port \"$MASTER_PORT\" " +
                        script) +
             "\n";
    } else {
      out += "srun --kill-on-bad-exit=1 torchrun --nnodes=\"$SLURM_NNODES\" --nproc-per-node=" +
             std::to_string(per_node) +
             " --rdzv-id=\"$SLURM_JOB_ID\" --rdzv-backend=c10d "
             "--rdzv-endpoint=\"$MASTER_ADDR:$MASTER_PORT\" " +
             script + "\n";
    }
    return out;
  }
  out += about;
  if (nodes > 1 && o.launcher == Launcher::kDeepSpeed) {
    out +=
        "# Start on node 0 only: DeepSpeed reaches the other nodes over ssh (pdsh) from the "
        "hostfile, one line per node: \"HOST slots=" +
        std::to_string(per_node) + "\".\n";
  } else if (nodes > 1) {
    out += "# Run on every node with NODE_RANK (0 .. " + std::to_string(nodes - 1) +
           ") and MASTER_ADDR (node 0's address) set.\n";
  }
  if (o.launcher == Launcher::kDeepSpeed && !deepspeed_engine) {
    out +=
        "# No DeepSpeed config was emitted (--emit-deepspeed): the script configures "
        "DeepSpeed itself.\n";
  }
  out += "set -euo pipefail\n";
  switch (o.launcher) {
    case Launcher::kTorchrun:
      if (nodes == 1) {
        out += "torchrun --standalone --nnodes=1 --nproc-per-node=" + std::to_string(per_node) +
               " " + script + "\n";
      } else {
        out += "torchrun --nnodes=" + std::to_string(nodes) +
               " --nproc-per-node=" + std::to_string(per_node) +
               " --node-rank=\"${NODE_RANK:?set NODE_RANK}\" "
               "--master-addr=\"${MASTER_ADDR:?set MASTER_ADDR}\" --master-port=" +
               port + " " + script + "\n";
      }
      break;
    case Launcher::kDeepSpeed:
      if (nodes == 1) {
        out += "deepspeed --num_gpus=" + std::to_string(per_node) + " --master_port=" + port + " " +
               script + "\n";
      } else {
        out += "deepspeed --hostfile=" + hostfile + " --num_nodes=" + std::to_string(nodes) +
               " --num_gpus=" + std::to_string(per_node) + " --master_port=" + port + " " + script +
               "\n";
      }
      break;
    case Launcher::kAccelerate:
      if (nodes == 1) {
        out += "accelerate launch --config_file " + accelerate_config +
               " --num_machines 1 --num_processes " + std::to_string(per_node) +
               " --main_process_port " + port + " " + script + "\n";
      } else {
        out += "accelerate launch --config_file " + accelerate_config + " --num_machines " +
               std::to_string(nodes) + " --num_processes " + std::to_string(nodes * per_node) +
               " --machine_rank \"${NODE_RANK:?set NODE_RANK}\" "
               "--main_process_ip \"${MASTER_ADDR:?set MASTER_ADDR}\" --main_process_port " +
               port + " " + script + "\n";
      }
      break;
    case Launcher::kSlurm: break;
  }
  return out;
}

}  // namespace memplan::planner
